"""The plan: the op DAG that a policy emits and the simulator and the executor both run (docs/architecture.md §2).

An op is one thing done on one stream: a GPU compute, a CPU attention, a PCIe copy (h2d, d2h) or a disk read or
write. Ops on one stream run in plan order, as on a CUDA stream; an op also waits for the ops it depends on. Plan
order is a topological order: an op may depend only on earlier ops, which makes every plan acyclic by construction.

What an op touches, in terms the executor can act on without policy logic:

- ``tensor='weight'``: bytes ``[lo, hi)`` of layer ``layer``'s flat weight buffer (``ModelSpec.layer_tensors``
  order). Static placement: bytes ``[0, gpu)`` of each layer live on the GPU for the whole run, ``[gpu, gpu+cpu)``
  in host memory, the rest on disk (``Plan.weight_split``). Streamed weights stay on the GPU until the last compute
  op of that layer in that step (``frees_weights``) has run.
- ``tensor='kv'``: K and V of layer ``layer``, batch ``batch``, token positions ``[lo, hi)``, KV heads
  ``[head_lo, head_hi)``. Home tier of each head range: ``Plan.kv_split``. KV copied to the GPU serves the next
  compute op of that (layer, batch) and is then dropped; KV whose home is the GPU stays.
- ``tensor='hidden'``: the activations of batch ``batch`` between layers, token positions ``[lo, hi)``.
- ``tensor='qkv'`` / ``'attn_out'``: for CPU attention, the new tokens' Q, K, V sent to the host and the attention
  output sent back.
- compute ops: ``part`` of ``layer`` (see ``costmodel.COMPUTE_PARTS``) for ``num_seqs`` sequences whose last
  ``q_tokens`` positions (of ``ctx_tokens``) are computed; attention sees KV positions ``[0, ctx_tokens)``.

Memory: ``Plan.resident`` bytes per tier are held for the whole run; an op allocates ``alloc`` bytes per tier
(gpu, cpu, disk) when it starts and frees ``free`` when it ends. ``validate`` checks capacity along plan order; the
simulator reports the true peak under its timing.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from offsim.core.costmodel import COMPUTE_PARTS
from offsim.core.errors import OffsimError
from offsim.core.io import read_json_object, write_text_atomic
from offsim.core.specs import ModelSpec, Workload

PLAN_SCHEMA = "offsim.plan/1"
KINDS = ("compute", "cpu_compute", "h2d", "d2h", "disk_read", "disk_write")
STREAM_OF_KIND = {"compute": "compute", "cpu_compute": "cpu", "h2d": "h2d", "d2h": "d2h", "disk_read": "disk",
                  "disk_write": "disk"}
STREAMS = ("compute", "cpu", "h2d", "d2h", "disk")
TIERS = ("gpu", "cpu", "disk")
TIER_INDEX = {t: i for i, t in enumerate(TIERS)}
ROUTE_OF_KIND = {"h2d": ("cpu", "gpu"), "d2h": ("gpu", "cpu"), "disk_read": ("disk", "cpu"),
                 "disk_write": ("cpu", "disk")}
TENSORS = ("weight", "kv", "hidden", "qkv", "attn_out")
PHASES = ("prefill", "decode")


class PlanError(OffsimError):
    """A plan breaks a rule; the message names the op and the rule."""


class Op:
    """One op of a plan. Fields not given take the class defaults below (plain attributes, not a dataclass: a plan
    of OPT-175B has ~2·10^5 ops and must build in about a second)."""

    id: int
    kind: str
    deps: tuple[int, ...]
    phase: str
    step: int  # 0 = prefill, i >= 1 = decode step i
    layer: int  # decoder layer; -1 = embedding, num_layers = LM head
    batch: int  # GPU batch within the block
    stream: str = ""
    # compute
    part: str = ""
    num_seqs: int = 0
    q_tokens: int = 0
    ctx_tokens: int = 0
    # transfers
    tensor: str = ""
    lo: int = 0
    hi: int = 0
    head_lo: int = 0
    head_hi: int = 0
    nbytes: int = 0
    pinned: bool = True
    frees_weights: bool = False  # compute op: last user of this layer's streamed weights in this step
    # memory: bytes per tier (gpu, cpu, disk) allocated at start and freed at end
    alloc: tuple[int, int, int] = (0, 0, 0)
    free: tuple[int, int, int] = (0, 0, 0)

    def __init__(self, id, kind, deps, phase, step, layer, batch, stream="", **kw):
        self.id, self.kind, self.deps, self.phase, self.step, self.layer, self.batch = \
            id, kind, deps, phase, step, layer, batch
        self.stream = stream
        if kw:
            if not _OPTIONAL.issuperset(kw):
                raise TypeError(f"Op got unknown fields {sorted(set(kw) - _OPTIONAL)}")
            self.__dict__.update(kw)

    def __eq__(self, other):
        return isinstance(other, Op) and all(getattr(self, f) == getattr(other, f) for f in OP_FIELDS)

    def __repr__(self):
        return "Op(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in OP_FIELDS
                                 if f in self.__dict__ or f in _REQUIRED) + ")"

    @property
    def src(self) -> str:
        return ROUTE_OF_KIND.get(self.kind, ("", ""))[0]

    @property
    def dst(self) -> str:
        return ROUTE_OF_KIND.get(self.kind, ("", ""))[1]

    def describe(self) -> str:
        what = f"{self.part}" if self.kind in ("compute", "cpu_compute") else f"{self.tensor}[{self.lo}:{self.hi})"
        return f"op {self.id} ({self.kind} {what} step {self.step} layer {self.layer} batch {self.batch})"


OP_FIELDS = list(Op.__annotations__)
_REQUIRED = OP_FIELDS[:7]
_OPTIONAL = set(OP_FIELDS[7:])


@dataclass
class Plan:
    """A complete schedule for one block of ``workload`` on a model, with its static placement."""

    model: ModelSpec
    workload: Workload
    policy: str
    settings: dict[str, Any]  # the policy's inputs (its settings dataclass): enough to rebuild this plan
    capacity: dict[str, int]  # bytes per tier the plan may use (GPU budget, host memory, disk)
    resident: dict[str, int]  # bytes per tier held for the whole run
    weight_split: list[tuple[int, int]]  # per layer: bytes of its flat weights on (gpu, cpu); the rest on disk
    kv_split: tuple[int, int]  # KV heads of each layer on (gpu, cpu); the rest on disk
    hidden_home: str = "gpu"  # where activations live between layers
    ops: list[Op] = field(default_factory=list)
    derived: dict[str, Any] = field(default_factory=dict)  # what the policy chose from its inputs (e.g. N_r)
    # the disk tier goes through the page cache (offexec ``DiskTier(cached=True)``) instead of past it (O_DIRECT, the
    # default); the simulator prices its disk ops at the profile's page-cached rates
    disk_cached: bool = False

    def __post_init__(self):
        # as JSON would store them (tuples become lists), so a plan equals its own round trip
        self.settings = json.loads(json.dumps(self.settings, default=str))
        self.derived = json.loads(json.dumps(self.derived, default=str))

    # ---- summaries ----------------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS if k not in ("compute", "cpu_compute")}
        for op in self.ops:
            if op.kind in out:
                out[op.kind] += op.nbytes
        return out

    def count_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for op in self.ops:
            out[op.kind] += 1
        return out

    # ---- serialisation ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        rows = [[getattr(op, f) for f in OP_FIELDS] for op in self.ops]
        for r in rows:
            r[2] = list(r[2])  # deps
            r[-2], r[-1] = list(r[-2]), list(r[-1])
        return {"schema": PLAN_SCHEMA, "model": self.model.to_dict(), "workload": self.workload.to_dict(),
                "policy": self.policy, "settings": self.settings, "capacity": self.capacity,
                "resident": self.resident, "weight_split": [list(x) for x in self.weight_split], "kv_split": list(self.kv_split),
                "hidden_home": self.hidden_home, "derived": self.derived, "disk_cached": self.disk_cached,
                "op_fields": OP_FIELDS, "ops": rows}

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected a JSON object")
        if d.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"{where}: field 'schema' is {d.get('schema')!r}; this offsim reads {PLAN_SCHEMA!r}")
        try:
            if d["op_fields"] != OP_FIELDS:
                raise PlanError(f"{where}: field 'op_fields' does not match this offsim's op schema {OP_FIELDS}")
            ops = []
            for i, r in enumerate(d["ops"]):
                if len(r) != len(OP_FIELDS):
                    raise PlanError(f"{where}: op row {i} has {len(r)} values, expected {len(OP_FIELDS)}")
                kw = dict(zip(OP_FIELDS, r))
                kw["deps"] = tuple(kw["deps"])
                kw["alloc"] = tuple(kw["alloc"])
                kw["free"] = tuple(kw["free"])
                ops.append(Op(**kw))
            return cls(model=ModelSpec.from_dict(d["model"]), workload=Workload.from_dict(d["workload"]),
                       policy=d["policy"], settings=d["settings"], capacity=d["capacity"], resident=d["resident"],
                       weight_split=[tuple(x) for x in d["weight_split"]], kv_split=tuple(d["kv_split"]),
                       hidden_home=d["hidden_home"], ops=ops, derived=d.get("derived", {}),
                       disk_cached=d.get("disk_cached", False))
        except KeyError as e:
            raise PlanError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, OffsimError):
                raise
            raise PlanError(f"{where}: malformed value ({e})") from None

    def fingerprint(self) -> str:
        """SHA-256 of what the plan does: model, workload, placement and every op (not settings, derived values,
        capacity or resident bytes, which record how it was chosen). Two plans with one fingerprint run identically; a measured
        case records the fingerprint of the plan it ran, so a rebuilt plan that differs is caught."""
        d = self.to_dict()
        body = {k: d[k] for k in ("model", "workload", "weight_split", "kv_split", "hidden_home", "op_fields", "ops")}
        if self.disk_cached:  # (only when set, so plans from before the field keep their fingerprints)
            body["disk_cached"] = True
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        """JSON, gzipped when ``path`` ends in .gz; written atomically."""
        write_text_atomic(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json_object(path, "plan", PlanError), where=f"plan {path}")

    # ---- validation ---------------------------------------------------------------------------------------
    def validate(self) -> "Plan":
        """Check every rule; raise ``PlanError`` naming the first op that breaks one. Returns self."""
        m, L = self.model, self.model.num_layers
        W = m.layer_weight_bytes()
        if len(self.weight_split) != L:
            raise PlanError(f"plan: weight_split has {len(self.weight_split)} entries, expected one per layer ({L})")
        for j, (g, c) in enumerate(self.weight_split):
            if not (0 <= g and 0 <= c and g + c <= W):
                raise PlanError(f"plan: weight_split of layer {j} ({g}, {c}) must be two non-negative byte counts "
                                f"summing to at most the layer size {W}")
        kg, kc = self.kv_split
        if not (0 <= kg and 0 <= kc and kg + kc <= m.num_kv_heads):
            raise PlanError(f"plan: kv_split {self.kv_split} must be two non-negative head counts summing to at most "
                            f"{m.num_kv_heads}")
        if not isinstance(self.disk_cached, bool):
            raise PlanError(f"plan: disk_cached must be true or false, got {self.disk_cached!r}")
        if self.hidden_home not in ("gpu", "cpu"):
            raise PlanError(f"plan: hidden_home must be 'gpu' or 'cpu', got {self.hidden_home!r}")
        for t in TIERS:
            if self.resident.get(t, 0) > self.capacity.get(t, 0):
                raise PlanError(f"plan: resident {t} bytes {self.resident[t]} exceed the {t} capacity "
                                f"{self.capacity.get(t, 0)} by {self.resident[t] - self.capacity.get(t, 0)} bytes")
        # KV presence: (tier or 'new' for computed, layer, batch) -> end of the contiguous prefix [0, end) held
        present: dict[tuple, int] = {}
        use = [self.resident.get(t, 0) for t in TIERS]
        cap = [self.capacity.get(t, 0) for t in TIERS]
        max_len = self.workload.max_len
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise PlanError(f"op at position {i} has id {op.id}: ids must be 0..n-1 in plan order")
            if op.kind not in KINDS:
                raise PlanError(f"{op.describe()}: unknown kind; valid: {KINDS}")
            if op.stream != STREAM_OF_KIND[op.kind]:
                raise PlanError(f"{op.describe()}: a {op.kind} op must be on stream "
                                f"{STREAM_OF_KIND[op.kind]!r}, not {op.stream!r}")
            for d in op.deps:
                if not 0 <= d < i:
                    raise PlanError(f"{op.describe()}: depends on op {d}, which is not an earlier op (plans are "
                                    "acyclic and listed in a topological order)")
            if op.phase not in PHASES:
                raise PlanError(f"{op.describe()}: phase must be one of {PHASES}")
            if not -1 <= op.layer <= L:
                raise PlanError(f"{op.describe()}: layer must be in [-1, {L}]")
            if op.kind in ("compute", "cpu_compute"):
                if op.part not in COMPUTE_PARTS:
                    raise PlanError(f"{op.describe()}: part must be one of {COMPUTE_PARTS}")
                if op.kind == "cpu_compute" and op.part != "attn":
                    raise PlanError(f"{op.describe()}: the CPU only runs 'attn'")
                if not (op.num_seqs > 0 and 0 < op.q_tokens <= op.ctx_tokens <= max_len):
                    raise PlanError(f"{op.describe()}: needs num_seqs > 0 and 0 < q_tokens <= ctx_tokens <= "
                                    f"{max_len} (got {op.num_seqs}, {op.q_tokens}, {op.ctx_tokens})")
                if op.part in ("layer", "attn"):
                    self._check_kv_read(op, present, "gpu" if op.kind == "compute" else "cpu")
                if op.part in ("layer", "pre_attn") and op.kind == "compute":  # new tokens' KV now exists
                    _extend(present, ("new", op.layer, op.batch), op.ctx_tokens - op.q_tokens, op.ctx_tokens)
            else:
                if op.tensor not in TENSORS:
                    raise PlanError(f"{op.describe()}: tensor must be one of {TENSORS}")
                if op.nbytes <= 0:
                    raise PlanError(f"{op.describe()}: moves {op.nbytes} bytes; a transfer moves a positive number")
                if op.hi <= op.lo:
                    raise PlanError(f"{op.describe()}: empty range [{op.lo}, {op.hi})")
                if op.tensor == "weight" and not (0 <= op.lo and op.hi <= W):
                    raise PlanError(f"{op.describe()}: weight bytes [{op.lo}, {op.hi}) outside the layer's {W}")
                if op.tensor == "kv":
                    self._check_kv_move(op, present)
                if op.tensor == "qkv":  # CPU attention: new tokens' K, V land in host memory
                    _extend(present, ("cpu", op.layer, op.batch), op.lo, op.hi)
            for t in range(3):
                use[t] += op.alloc[t]
                if use[t] > cap[t]:
                    raise PlanError(f"{op.describe()}: {TIERS[t]} memory reaches {use[t]} bytes, over the capacity "
                                    f"{cap[t]} by {use[t] - cap[t]} bytes")
            for t in range(3):
                use[t] -= op.free[t]
        return self

    def _check_kv_read(self, op: Op, present: dict, where: str) -> None:
        """A compute op attends over KV [0, ctx - q): on the GPU it must have been computed (and loaded or kept
        resident, which the executor tracks); for CPU attention it must be in host memory."""
        need = op.ctx_tokens - op.q_tokens
        have = _prefix(present, ("new" if where == "gpu" else "cpu", op.layer, op.batch))
        if have < need:
            src = "were ever computed" if where == "gpu" else "are in host memory"
            raise PlanError(f"{op.describe()}: attends over KV tokens [0, {need}) but only [0, {have}) {src} "
                            "(rule: every KV token read exists on the tier it is read from)")

    def _check_kv_move(self, op: Op, present: dict) -> None:
        """A KV copy reads tokens that exist on its source tier; stores extend the destination's prefix."""
        src = "new" if op.kind == "d2h" else op.src
        have = _prefix(present, (src, op.layer, op.batch))
        if op.hi > have:
            raise PlanError(f"{op.describe()}: moves KV tokens [{op.lo}, {op.hi}) from {op.src}, but only "
                            f"[0, {have}) {'were computed' if op.kind == 'd2h' else 'were stored there'} (rule: every "
                            "KV token loaded was stored)")
        if op.kind != "h2d":  # KV on the GPU is tracked as 'computed'; host and disk copies extend their tier
            _extend(present, (op.dst, op.layer, op.batch), op.lo, op.hi)


def _prefix(present: dict, key: tuple) -> int:
    return present.get(key, 0)


def _extend(present: dict, key: tuple, lo: int, hi: int) -> None:
    """Record tokens [lo, hi) as present under key; presence is tracked as a contiguous prefix [0, end)."""
    end = present.get(key, 0)
    if lo <= end:
        present[key] = max(end, hi)


class PlanBuilder:
    """Appends ops in issue order with consecutive ids. With ``serial=True`` every op also waits for the op issued
    before it (FlexGen's 'overlap off': nothing runs concurrently)."""

    def __init__(self, serial: bool = False):
        self.ops: list[Op] = []
        self.serial = serial

    def add(self, kind: str, deps: Iterable[int | None], phase: str, step: int, layer: int, batch: int,
            **kw) -> int:
        ops = self.ops
        i = len(ops)
        ds = [d for d in deps if d is not None]
        if self.serial and i:
            ds.append(i - 1)
        if len(ds) > 1:
            ds = sorted(set(ds))
        op = Op(i, kind, tuple(ds), phase, step, layer, batch, STREAM_OF_KIND[kind])
        if kw:
            if not _OPTIONAL.issuperset(kw):
                raise TypeError(f"Op got unknown fields {sorted(set(kw) - _OPTIONAL)}")
            op.__dict__.update(kw)
        ops.append(op)
        return i
