"""The plan: the op DAG that a policy emits and the simulator and the executor both run (docs/architecture.md §2).

An op is one thing done on one stream: a GPU compute, a CPU attention, a PCIe copy (h2d, d2h) or a disk read or
write. Ops on one stream run in plan order, as on a CUDA stream; an op also waits for the ops it depends on. Plan
order is a topological order: an op may depend only on earlier ops, which makes every plan acyclic by construction.

What an op touches, in terms the executor can act on without policy logic:

- ``tensor='weight'``: bytes ``[lo, hi)`` of layer ``layer``'s flat weight buffer (``ModelSpec.layer_tensors``
  order). Static placement: bytes ``[0, gpu)`` of each layer live on the GPU for the whole run, ``[gpu, gpu+cpu)``
  in host memory, the rest on disk (``Plan.weight_split``). Streamed weights stay on the GPU until the last compute
  op of that layer in that step (``frees_weights``) has run. Layer -1 / ``num_layers``: the embedding's / the LM
  head's weights (bytes of their tensors in order, within ``ModelSpec.embedding_bytes``), which only ``flexgen-ref``
  streams (FlexGen places them like any layer; every other plan keeps them on the GPU).
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

Several GPUs (pipeline parallelism, docs/architecture.md §2.1): a plan with ``Plan.stages`` spans one GPU per
stage. Every op then carries ``device`` (the stage's GPU; its GPU streams and GPU memory are that device's) and the
hidden states (and the generated token ids, back to the first stage) move between GPUs by ``p2p`` ops on the
sending device's ``p2p`` stream, ``peer`` naming the receiving device: ``tensor='hidden'`` (positions ``[lo, hi)``
of batch ``batch``, received for layer ``layer``) or ``tensor='token'`` (the ids at positions ``[lo, hi)``, for
the embedding). Host memory, the disk and the host CPU are one machine's, shared by all stages -- or, over several
nodes (``Plan.nodes``), each node's, shared by its stages; a p2p op between nodes crosses the network. A single-GPU plan
has no stages, every op on device 0, and serialises exactly as before (``device`` and ``peer`` are left out of
its JSON and its fingerprint).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import MutableSequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, get_args, get_origin, get_type_hints

from offsim.core.costmodel import COMPUTE_PARTS, GRAPH_MAX_Q_TOKENS
from offsim.core.errors import OffsimError
from offsim.core.io import read_json_object, write_text_atomic
from offsim.core.specs import ModelSpec, Workload

PLAN_SCHEMA = "offsim.plan/1"
CPU_ATTENTION_IMPLS = ("", "flexgen")  # whose CPU attention path a plan's cpu_compute ops run (Plan.cpu_attention_impl)
PAGEABLE_COPIES = ("", "relay")  # how a plan's unpinned copies move (Plan.pageable_copy)
QUANT_IMPLS = ("", "flexgen")  # whose code runs a compressed plan's dequantize passes (Plan.quant_impl)
# how a graphed decode op of several query tokens attends (Plan.graph_attention): '' over the whole KV buffer under
# a key mask; 'written_rows' over the rows written so far (offexec model.written_rows_attention)
GRAPH_ATTENTIONS = ("", "written_rows")
# Plan fields written (and fingerprinted) only when set, in this order, so that plans from before each field read
# and hash the same
OPTIONAL_FIELDS = ("weight_gather_copies", "cpu_attention_impl", "pageable_copy", "quant_impl",
                   "issue_waits_for_deps", "graph_attention")
# the top-level fields a saved plan may have (``Plan.to_dict`` writes them; the optional ones only when set)
PLAN_KEYS = frozenset(("schema", "model", "workload", "policy", "settings", "capacity", "resident", "weight_split",
                       "kv_split", "hidden_home", "derived", "disk_cached", "cuda_graphs", "graph_max_q_tokens",
                       "graph_min_uses", "run_ahead", "op_fields", "ops", "stages", "nodes") + OPTIONAL_FIELDS)
KINDS = ("compute", "cpu_compute", "h2d", "d2h", "disk_read", "disk_write")
# a GPU-to-GPU copy (pipeline parallelism): only in plans with stages, so not among the KINDS that single-GPU
# summaries list
P2P_KIND = "p2p"
ALL_KINDS = KINDS + (P2P_KIND,)
STREAM_OF_KIND = {"compute": "compute", "cpu_compute": "cpu", "h2d": "h2d", "d2h": "d2h", "disk_read": "disk",
                  "disk_write": "disk", "p2p": "p2p"}
STREAMS = ("compute", "cpu", "h2d", "d2h", "disk")
ALL_STREAMS = STREAMS + ("p2p",)  # with the sending device's GPU-to-GPU stream (plans with stages)
# streams of one host that every device shares (the host CPU's attention, the disk); the others are per device
SHARED_STREAMS = ("cpu", "disk")
TIERS = ("gpu", "cpu", "disk")
TIER_INDEX = {t: i for i, t in enumerate(TIERS)}
ROUTE_OF_KIND = {"h2d": ("cpu", "gpu"), "d2h": ("gpu", "cpu"), "disk_read": ("disk", "cpu"),
                 "disk_write": ("cpu", "disk")}
TENSORS = ("weight", "kv", "hidden", "qkv", "attn_out", "token")
PHASES = ("prefill", "decode")


class PlanError(OffsimError):
    """A plan breaks a rule; the message names the op and the rule."""


# offexec's flow control (``Plan.run_ahead``): ops its issuing thread may have outstanding on compute, h2d, d2h. A
# copy window of 6 keeps pinned-copy queues short (each queued copy holds a staging buffer)
RUN_AHEAD_OPS = (16, 6, 16)


def _run_ahead(v):
    """A plan file's ``run_ahead`` (a list, or null) as the field holds it; a malformed value is left for
    ``Plan.validate`` to name."""
    return tuple(v) if isinstance(v, list) else v


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
    # several GPUs (plans with stages; ``DEVICE_FIELDS``): the GPU whose streams run the op and whose memory its
    # gpu bytes count against; a p2p op's receiving GPU
    device: int = 0
    peer: int = -1

    def __init__(self, id, kind, deps, phase, step, layer, batch, stream="", **kw):
        self.id, self.kind, self.deps, self.phase, self.step, self.layer, self.batch = \
            id, kind, deps, phase, step, layer, batch
        self.stream = stream
        if kw:
            if not _OPTIONAL.issuperset(kw):
                raise TypeError(f"Op got unknown fields {sorted(set(kw) - _OPTIONAL)}")
            self.__dict__.update(kw)

    def __eq__(self, other):
        return isinstance(other, Op) and all(getattr(self, f) == getattr(other, f) for f in _EQ_FIELDS)

    def __repr__(self):
        return "Op(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in _EQ_FIELDS
                                 if f in self.__dict__ or f in _REQUIRED) + ")"

    @property
    def src(self) -> str:
        return ROUTE_OF_KIND.get(self.kind, ("", ""))[0]

    @property
    def dst(self) -> str:
        return ROUTE_OF_KIND.get(self.kind, ("", ""))[1]

    def describe(self) -> str:
        what = f"{self.part}" if self.kind in ("compute", "cpu_compute") else f"{self.tensor}[{self.lo}:{self.hi})"
        dev = f" device {self.device}" if self.device else ""
        return f"op {self.id} ({self.kind} {what} step {self.step} layer {self.layer} batch {self.batch}{dev})"


# the fields a plan with stages adds to each op row (after OP_FIELDS): left out of single-GPU plans' JSON, so
# their saved files and fingerprints are what they were
DEVICE_FIELDS = ["device", "peer"]


_SCALAR_WANT = {int: "an integer", str: "a string", bool: "true or false"}
_OP_TYPES = get_type_hints(Op)  # (the annotations are strings here: resolved once)


def _check_op_rows(rows: Any, fields: list, where: str) -> None:
    """The op rows of a plan read from JSON: a list of rows of ``fields``' length, each field of its ``Op`` type (a
    plan edited by hand: a float byte count, a string where a list belongs), named by op and field; the types are
    checked a column at a time, as plans have 10^5 ops."""
    if not isinstance(rows, list):
        raise PlanError(f"{where}: field 'ops' must be a list of op rows (values in 'op_fields' order), got "
                        f"{str(rows)[:60]}")
    for i, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != len(fields):
            raise PlanError(f"{where}: op row {i} has {len(r) if isinstance(r, list) else 'no list of'} values, "
                            f"expected {len(fields)}")

    def refuse(i: int, f: str, want: str):
        raise PlanError(f"{where}: op {i}: field {f!r} must be {want}, got {rows[i][fields.index(f)]!r}")

    for j, f in enumerate(fields):
        t = _OP_TYPES[f]  # int, str, bool, tuple[int, ...] or tuple[int, int, int]
        col = [r[j] for r in rows]
        if t in _SCALAR_WANT:
            if set(map(type, col)) - {t}:
                refuse(next(i for i, v in enumerate(col) if type(v) is not t), f, _SCALAR_WANT[t])
        elif get_origin(t) is tuple:
            n = None if Ellipsis in get_args(t) else len(get_args(t))
            for i, v in enumerate(col):
                if not isinstance(v, list) or (n and len(v) != n) or any(type(x) is not int for x in v):
                    refuse(i, f, f"a list of {n} integers" if n else "a list of integers")


OP_FIELDS = [f for f in Op.__annotations__ if f not in DEVICE_FIELDS]
_EQ_FIELDS = OP_FIELDS + DEVICE_FIELDS
_REQUIRED = OP_FIELDS[:7]
_OPTIONAL = set(OP_FIELDS[7:]) | set(DEVICE_FIELDS)
_ROW_FIELDS = set(OP_FIELDS[8:]) | set(DEVICE_FIELDS)  # what a builder row may hold: not id or stream
_DEFAULTS = {f: getattr(Op, f) for f in OP_FIELDS[8:]}  # the optional fields' class defaults (stream: set always)
_new_op = object.__new__


def _op_from_row(i: int, row: tuple) -> Op:
    """The Op of a builder row (kind, deps, phase, step, layer, batch, kw) at position ``i``: exactly what
    ``Op(i, kind, deps, phase, step, layer, batch, STREAM_OF_KIND[kind], **kw)`` makes, without the call overhead."""
    kind, deps, phase, step, layer, batch, kw = row
    op = _new_op(Op)
    d = op.__dict__
    d["id"] = i
    d["kind"] = kind
    d["deps"] = deps
    d["phase"] = phase
    d["step"] = step
    d["layer"] = layer
    d["batch"] = batch
    d["stream"] = STREAM_OF_KIND[kind]
    if kw:
        d.update(kw)
    return op


class OpList(MutableSequence):
    """``Plan.ops`` as ``PlanBuilder`` makes it: a sequence of ``Op`` that stores one compact row per op, (kind,
    deps, phase, step, layer, batch, {fields given}), and makes the ``Op`` objects only when one is asked for.

    Why: an OPT-175B plan has ~2.3·10^5 ops; a Python object per op costs about as much to create as the whole
    block schedule costs to compute, and the simulator, ``validate``, ``to_dict`` and the summaries read the rows
    directly (``op_rows``). The first access to an ``Op`` (indexing, iteration, assignment, ``append``) makes the
    list of all of them once; from then on that list is the plan's ops (changes to an ``Op`` stick) and the rows
    are dropped. It is a ``MutableSequence``; equality, ``len`` and ``repr`` are those of the list of ``Op``."""

    __slots__ = ("_rows", "_ops")

    def __init__(self, rows: list[tuple] | None = None):
        self._rows = [] if rows is None else rows
        self._ops = None

    def _list(self) -> list[Op]:
        if self._ops is None:
            rows, self._rows = self._rows, None
            self._ops = [_op_from_row(i, r) for i, r in enumerate(rows)]
        return self._ops

    @property
    def rows(self) -> list[tuple] | None:
        """The builder rows, or None once the ``Op`` objects exist (then they are the truth)."""
        return self._rows

    def __len__(self):
        return len(self._rows) if self._ops is None else len(self._ops)

    def __getitem__(self, i):
        return self._list()[i]

    def __setitem__(self, i, op):
        self._list()[i] = op

    def __iter__(self):
        return iter(self._list())

    def __delitem__(self, i):
        del self._list()[i]

    def insert(self, i: int, op: Op) -> None:
        self._list().insert(i, op)

    def append(self, op: Op) -> None:
        self._list().append(op)

    def __eq__(self, other):
        if isinstance(other, OpList):
            other = other._list()
        return self._list() == other if isinstance(other, list) else NotImplemented

    def __repr__(self):
        return repr(self._list())

    def __reduce__(self):  # pickles (and deep-copies) as its rows when it still has them
        return (OpList, (self._rows,)) if self._ops is None else (list, (self._ops,))


def op_rows(ops) -> list[tuple]:
    """Rows (kind, deps, phase, step, layer, batch, fields) of ``ops``, position i being op i: a builder's rows as
    they are, or one row per ``Op`` with its instance ``__dict__`` as ``fields`` (read with ``fields.get(name,
    default)``: it also holds ``id`` and ``stream``, which a row of the builder leaves out because they follow from
    the position and the kind)."""
    rows = ops.rows if isinstance(ops, OpList) else None
    if rows is not None:
        return rows
    return [(o.kind, o.deps, o.phase, o.step, o.layer, o.batch, o.__dict__) for o in ops]


def _row_stream(row: tuple) -> str:
    kw = row[6]
    s = kw.get("stream")
    return s if s is not None else STREAM_OF_KIND[row[0]]


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
    # offexec replays one-token decode ops as CUDA graphs (offexec/graphs.py; ``costmodel.GRAPHED_PARTS``); the
    # simulator prices their host issue at the profile's ``issue_graph_s``. False: every op issued kernel by kernel
    cuda_graphs: bool = True
    # the longest decode op, in query tokens, that offexec replays as a graph (``costmodel.GRAPH_MAX_Q_TOKENS``):
    # TightLLM's short recomputes too. Plans and runs from before recompute graphs replayed one-token ops only (1)
    graph_max_q_tokens: int = GRAPH_MAX_Q_TOKENS
    # a graphable decode shape (part, query tokens) met at fewer decode steps than this runs eagerly
    # (``costmodel.eager_graph_shapes``): its captures would cost more than their replays save. 1: every graphable op
    # is graphed (plans before the field)
    graph_min_uses: int = 1
    # the runtime's flow control: how many ops its single issuing thread may have outstanding on the compute, h2d and
    # d2h streams (offexec's ``Executor`` reads it; before issuing an op it waits for the op this many places earlier
    # on the same stream to finish). The simulator models it (offsim.core.sim: the issuer). None: unbounded (an
    # ideal runtime). Plans from before the field ran with offexec's window, ``RUN_AHEAD_OPS``
    run_ahead: tuple[int, int, int] | None = RUN_AHEAD_OPS
    # pipeline parallelism (docs/architecture.md §2.1): one dict per stage, stage s on GPU s -- 'layers' [lo, hi)
    # (contiguous; the first stage also runs the embedding, the last the LM head), 'gpu_capacity' and
    # 'gpu_resident' (that GPU's budget and the bytes it holds for the whole run; ``capacity['gpu']`` and
    # ``resident['gpu']`` are then the sums over the GPUs). Empty: one GPU, as every plan before stages
    stages: list[dict] = field(default_factory=list)
    # a pipeline over several nodes (hosts; ``Schedule.gpus_per_node``): each stage's dict also names its 'node'
    # (in order, from 0), and one dict per node gives its host memory and disk: 'cpu_capacity', 'cpu_resident',
    # 'disk_capacity', 'disk_resident' (``capacity`` and ``resident``'s cpu and disk are then the sums over the
    # nodes). Empty: every stage on one host, as every plan before nodes
    nodes: list[dict] = field(default_factory=list)
    # device-side copies of its bytes that follow every weight copy to the GPU on the same stream, before the next
    # copy starts: DeepSpeed ZeRO-3 gathers each fetched parameter through a flat buffer (``torch.cat`` into the
    # partition, then ``torch.cat`` out of it in the gather handle's ``wait``: 2; ``offsim.policies.ref``). The
    # simulator prices each at 2 bytes of HBM traffic per byte (a read and a write). 0: none, as every plan before it
    weight_gather_copies: int = 0
    # whose CPU attention the plan's cpu_compute ops run: '' offexec's (the profile's ('cpu', 'attn_ctx:B') rows), or
    # 'flexgen' FlexGen's own fp32 path (``flexgen-ref``: rows 'attn_ctx_flexgen:B', ``costmodel.cpu_attention_seconds``)
    cpu_attention_impl: str = ""
    # how its unpinned copies (``Op.pinned`` false) move: '' a plain copy from pageable memory (the profile's
    # ``h2d_pageable`` / ``d2h_pageable``), or 'relay' staged by the caller through a pinned copy of its own
    # (FlexGen's ``general_copy``, ``flexgen-ref``: the profile's ``h2d_relay`` / ``d2h_relay`` where measured)
    pageable_copy: str = ""
    # whose code runs its 4-bit dequantize passes: '' offexec's (the profile's quant_*_bytes_per_s), or 'flexgen'
    # FlexGen's own TorchCompressedDevice.decompress (``flexgen-ref``: the profile's 'dequant_flexgen:*' rows)
    quant_impl: str = ""
    # whether the runtime's issuing thread waits for every dependency of an op to finish before issuing it (FlexGen's
    # sync() after each (layer, batch) position blocks its main loop: ``flexgen-ref``), rather than for its host
    # dependencies only (offexec's rule); the simulator's issuer follows it where the profile prices issuing
    issue_waits_for_deps: bool = False
    # how offexec's graphed decode ops of more than one query token (TightLLM's recomputes) attend
    # (``GRAPH_ATTENTIONS``): '' (the default) over the whole full-length KV buffer under a key mask, 'written_rows'
    # sequence-first over the rows written so far through flash's variable-length call (a single KV head group, no
    # compression, sparse attention or padding; other ops keep ''). The simulator prices both alike: such an op's
    # attention over the rows written at its step (``costmodel.attention_seconds``), which is what 'written_rows' runs
    graph_attention: str = ""

    @property
    def num_devices(self) -> int:
        """GPUs the plan runs on: one per stage (1 without stages)."""
        return max(1, len(self.stages))

    @property
    def num_nodes(self) -> int:
        """Hosts the plan runs on (1: every stage on one host)."""
        return max(1, len(self.nodes))

    def node_of_device(self, device: int) -> int:
        """The node (host) of GPU ``device``."""
        return int(self.stages[device].get("node", 0)) if self.stages else 0

    def device_of_layer(self, layer: int) -> int:
        """The GPU that runs decoder layer ``layer`` (-1, the embedding: the first; num_layers, the head: the last)."""
        if not self.stages:
            return 0
        if layer < 0:
            return 0
        for d, st in enumerate(self.stages):
            if st["layers"][0] <= layer < st["layers"][1]:
                return d
        return len(self.stages) - 1

    @property
    def graph_q_tokens(self) -> int:
        """The longest decode op replayed as a CUDA graph (0: graphs off): what ``costmodel.graphed`` and
        ``costmodel.issue_seconds`` take."""
        return self.graph_max_q_tokens if self.cuda_graphs else 0

    def __post_init__(self):
        # as JSON would store them (tuples become lists), so a plan equals its own round trip
        self.settings = json.loads(json.dumps(self.settings, default=str))
        self.derived = json.loads(json.dumps(self.derived, default=str))

    # ---- summaries ----------------------------------------------------------------------------------------
    def _kinds(self) -> tuple:
        return ALL_KINDS if self.stages else KINDS  # (p2p only where there are stages: summaries keep their keys)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in self._kinds() if k not in ("compute", "cpu_compute")}
        for r in op_rows(self.ops):
            if r[0] in out:
                out[r[0]] += r[6].get("nbytes", 0)
        return out

    def count_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in self._kinds()}
        for r in op_rows(self.ops):
            out[r[0]] += 1
        return out

    # ---- serialisation ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        opt = list(_DEFAULTS.items())  # the fields after stream, in OP_FIELDS order (alloc and free last)
        multi = bool(self.stages)
        rows = []
        for i, (kind, deps, phase, step, layer, batch, kw) in enumerate(op_rows(self.ops)):
            get = kw.get
            stream = get("stream")
            r = [get("id", i), kind, list(deps), phase, step, layer, batch,
                 STREAM_OF_KIND[kind] if stream is None else stream]
            r += [get(f, v) for f, v in opt]
            r[-2], r[-1] = list(r[-2]), list(r[-1])
            if multi:  # (after alloc and free: a single-GPU row is unchanged)
                r += [get("device", 0), get("peer", -1)]
            rows.append(r)
        extra = {"stages": [dict(st) for st in self.stages]} if multi else {}
        if self.nodes:  # (only with several nodes: one-host plans read and hash as before)
            extra["nodes"] = [dict(x) for x in self.nodes]
        extra.update({f: getattr(self, f) for f in OPTIONAL_FIELDS if getattr(self, f)})
        return {"schema": PLAN_SCHEMA, "model": self.model.to_dict(), "workload": self.workload.to_dict(),
                "policy": self.policy, "settings": self.settings, "capacity": self.capacity,
                "resident": self.resident, "weight_split": [list(x) for x in self.weight_split], "kv_split": list(self.kv_split),
                "hidden_home": self.hidden_home, "derived": self.derived, "disk_cached": self.disk_cached,
                "cuda_graphs": self.cuda_graphs, "graph_max_q_tokens": self.graph_max_q_tokens,
                "run_ahead": None if self.run_ahead is None else list(self.run_ahead),
                **({"graph_min_uses": self.graph_min_uses} if self.graph_min_uses != 1 else {}),
                "op_fields": OP_FIELDS + DEVICE_FIELDS if multi else OP_FIELDS, "ops": rows, **extra}

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected a JSON object")
        if d.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"{where}: field 'schema' is {d.get('schema')!r}; this offsim reads {PLAN_SCHEMA!r}")
        unknown = sorted(set(d) - PLAN_KEYS)
        if unknown:  # (a misspelt option would be dropped in silence and the plan run without it)
            raise PlanError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"a plan has {', '.join(sorted(PLAN_KEYS))}")
        try:
            stages = d.get("stages", [])
            fields = OP_FIELDS + DEVICE_FIELDS if stages else OP_FIELDS
            if d["op_fields"] != fields:
                raise PlanError(f"{where}: field 'op_fields' does not match this offsim's op schema {fields}")
            _check_op_rows(d["ops"], fields, where)
            ops = []
            for r in d["ops"]:
                kw = dict(zip(fields, r))
                kw["deps"] = tuple(kw["deps"])
                kw["alloc"] = tuple(kw["alloc"])
                kw["free"] = tuple(kw["free"])
                ops.append(Op(**kw))
            return cls(model=ModelSpec.from_dict(d["model"]), workload=Workload.from_dict(d["workload"]),
                       policy=d["policy"], settings=d["settings"], capacity=d["capacity"], resident=d["resident"],
                       weight_split=[tuple(x) for x in d["weight_split"]], kv_split=tuple(d["kv_split"]),
                       hidden_home=d["hidden_home"], ops=ops, derived=d.get("derived", {}),
                       disk_cached=d.get("disk_cached", False), cuda_graphs=d.get("cuda_graphs", True),
                       graph_max_q_tokens=d.get("graph_max_q_tokens", 1),
                       graph_min_uses=d.get("graph_min_uses", 1),
                       run_ahead=_run_ahead(d.get("run_ahead", list(RUN_AHEAD_OPS))),
                       stages=[dict(st) for st in stages], nodes=[dict(x) for x in d.get("nodes", [])],
                       weight_gather_copies=d.get("weight_gather_copies", 0),
                       cpu_attention_impl=d.get("cpu_attention_impl", ""),
                       pageable_copy=d.get("pageable_copy", ""), quant_impl=d.get("quant_impl", ""),
                       issue_waits_for_deps=d.get("issue_waits_for_deps", False),
                       graph_attention=d.get("graph_attention", ""))
        except KeyError as e:
            raise PlanError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, OffsimError):
                raise
            raise PlanError(f"{where}: malformed value ({e})") from None

    def fingerprint(self) -> str:
        """SHA-256 of what the plan does: model, workload, placement and every op (not settings, derived values,
        capacity or resident bytes, which record how it was chosen, nor ``cuda_graphs``: how the runtime issues the
        ops, which a measured case records in its metadata). Two plans with one fingerprint run the same ops; a measured
        case records the fingerprint of the plan it ran, so a rebuilt plan that differs is caught."""
        d = self.to_dict()
        body = {k: d[k] for k in ("model", "workload", "weight_split", "kv_split", "hidden_home", "op_fields", "ops")}
        if self.disk_cached:  # (only when set, so plans from before the field keep their fingerprints)
            body["disk_cached"] = True
        if self.stages:  # (likewise: single-GPU plans keep theirs)
            body["stages"] = d["stages"]
        body.update({f: d[f] for f in OPTIONAL_FIELDS if f in d})
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        """JSON, gzipped when ``path`` ends in .gz; written atomically."""
        write_text_atomic(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json_object(path, "plan", PlanError), where=f"plan {path}")

    @classmethod
    def load_valid(cls, path: str | Path) -> "Plan":
        """``load`` then ``validate``: what a command given ``--plan FILE`` runs. A file edited by hand can hold values
        of the wrong type (a string for a byte count, a number where a list belongs) that the rules' arithmetic trips
        over; such a value is a ``PlanError`` naming the file, not a traceback."""
        plan = cls.load(path)
        try:
            return plan.validate()
        except OffsimError:
            raise
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            raise PlanError(f"plan {path}: malformed value ({type(e).__name__}: {e})") from None

    # ---- validation ---------------------------------------------------------------------------------------
    def validate(self) -> "Plan":
        """Check every rule; raise ``PlanError`` naming the first op that breaks one. Returns self."""
        m, L = self.model, self.model.num_layers
        W = m.layer_weight_bytes()
        W_emb = max(W, m.embedding_bytes())  # (the embedding's and the head's weights: layers -1 and L)
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
        g = self.weight_gather_copies
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise PlanError(f"plan: weight_gather_copies must be a non-negative integer, got {g!r}")
        if self.cpu_attention_impl not in CPU_ATTENTION_IMPLS:
            raise PlanError(f"plan: cpu_attention_impl must be one of {CPU_ATTENTION_IMPLS} ('': offexec's), got "
                            f"{self.cpu_attention_impl!r}")
        if not isinstance(self.issue_waits_for_deps, bool):
            raise PlanError(f"plan: issue_waits_for_deps must be true or false, got {self.issue_waits_for_deps!r}")
        if self.graph_attention not in GRAPH_ATTENTIONS:
            raise PlanError(f"plan: graph_attention must be one of {GRAPH_ATTENTIONS} ('': masked over the whole "
                            f"buffer), got {self.graph_attention!r}")
        if self.quant_impl not in QUANT_IMPLS:
            raise PlanError(f"plan: quant_impl must be one of {QUANT_IMPLS} ('': offexec's), got {self.quant_impl!r}")
        if self.pageable_copy not in PAGEABLE_COPIES:
            raise PlanError(f"plan: pageable_copy must be one of {PAGEABLE_COPIES} ('': a plain pageable copy), got "
                            f"{self.pageable_copy!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise PlanError(f"plan: cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if isinstance(self.graph_max_q_tokens, bool) or not isinstance(self.graph_max_q_tokens, int) \
                or self.graph_max_q_tokens < 1:
            raise PlanError(f"plan: graph_max_q_tokens must be a positive integer, got {self.graph_max_q_tokens!r}")
        if isinstance(self.graph_min_uses, bool) or not isinstance(self.graph_min_uses, int) \
                or self.graph_min_uses < 1:
            raise PlanError(f"plan: graph_min_uses must be a positive integer, got {self.graph_min_uses!r}")
        ra = self.run_ahead
        if ra is not None and (not isinstance(ra, tuple) or len(ra) != 3
                               or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ra)):
            raise PlanError(f"plan: run_ahead must be null or three positive integers (compute, h2d, d2h), got {ra!r}")
        if self.hidden_home not in ("gpu", "cpu"):
            raise PlanError(f"plan: hidden_home must be 'gpu' or 'cpu', got {self.hidden_home!r}")
        multi = bool(self.stages)
        ndev = self.num_devices
        if multi:
            self._validate_stages()
            guse = [int(st["gpu_resident"]) for st in self.stages]
            gcap = [int(st["gpu_capacity"]) for st in self.stages]
        nodes = bool(self.nodes)
        if nodes:  # host memory and disk per node: an op's count against its device's node's
            self._validate_nodes()
            node_of = [self.node_of_device(d) for d in range(ndev)]
            nuse = [[int(x["cpu_resident"]), int(x["disk_resident"])] for x in self.nodes]
            ncap = [[int(x["cpu_capacity"]), int(x["disk_capacity"])] for x in self.nodes]
        for t in TIERS:
            if self.resident.get(t, 0) > self.capacity.get(t, 0):
                raise PlanError(f"plan: resident {t} bytes {self.resident[t]} exceed the {t} capacity "
                                f"{self.capacity.get(t, 0)} by {self.resident[t] - self.capacity.get(t, 0)} bytes")
        # KV presence: (tier or 'new' for computed, layer, batch) -> end of the contiguous prefix [0, end) held
        present: dict[tuple, int] = {}
        use = [self.resident.get(t, 0) for t in TIERS]
        cap = [self.capacity.get(t, 0) for t in TIERS]
        max_len = self.workload.max_len
        rows = op_rows(self.ops)  # (read as rows: no Op object is made for a plan from the builder)
        if not rows:
            raise PlanError("plan: no ops (a plan runs at least the prefill of its workload)")
        last_step = self.workload.gen_len - 1
        steps_seen = -1
        ends: dict[tuple, int] = {}  # ('embed' or 'head', step, batch) -> its ops
        for i, row in enumerate(rows):
            kind, deps, phase, step, layer, batch, kw = row
            if step > steps_seen:
                steps_seen = step
            get = kw.get
            if get("id", i) != i:
                raise PlanError(f"op at position {i} has id {get('id')}: ids must be 0..n-1 in plan order")
            if kind not in KINDS and not (multi and kind == P2P_KIND):
                raise PlanError(f"{self._describe(i)}: unknown kind; valid: {self._kinds()}")
            if multi:
                dev = get("device", 0)
                if not (isinstance(dev, int) and 0 <= dev < ndev):
                    raise PlanError(f"{self._describe(i)}: device must be in [0, {ndev}) (one per stage)")
                if kind == P2P_KIND:
                    peer = get("peer", -1)
                    if not (isinstance(peer, int) and 0 <= peer < ndev and peer != dev):
                        raise PlanError(f"{self._describe(i)}: a p2p op needs a peer device in [0, {ndev}) other "
                                        f"than its own, got {peer}")
                    if get("tensor", "") not in ("hidden", "token"):
                        raise PlanError(f"{self._describe(i)}: a p2p op moves 'hidden' or 'token', not "
                                        f"{get('tensor', '')!r}")
                use[0], cap[0] = guse[dev], gcap[dev]  # this op's GPU is its device's
                if nodes:
                    nd = node_of[dev]
                    (use[1], use[2]), (cap[1], cap[2]) = nuse[nd], ncap[nd]
            stream = get("stream")
            if stream is not None and stream != STREAM_OF_KIND[kind]:
                raise PlanError(f"{self._describe(i)}: a {kind} op must be on stream "
                                f"{STREAM_OF_KIND[kind]!r}, not {stream!r}")
            for d in deps:
                if not 0 <= d < i:
                    raise PlanError(f"{self._describe(i)}: depends on op {d}, which is not an earlier op (plans are "
                                    "acyclic and listed in a topological order)")
            if phase not in PHASES:
                raise PlanError(f"{self._describe(i)}: phase must be one of {PHASES}")
            if not -1 <= layer <= L:
                raise PlanError(f"{self._describe(i)}: layer must be in [-1, {L}]")
            if kind == "compute" or kind == "cpu_compute":
                part = get("part", "")
                if part not in COMPUTE_PARTS:
                    raise PlanError(f"{self._describe(i)}: part must be one of {COMPUTE_PARTS}")
                if kind == "cpu_compute" and part != "attn":
                    raise PlanError(f"{self._describe(i)}: the CPU only runs 'attn'")
                num_seqs, q, ctx = get("num_seqs", 0), get("q_tokens", 0), get("ctx_tokens", 0)
                if not (num_seqs > 0 and 0 < q <= ctx <= max_len):
                    raise PlanError(f"{self._describe(i)}: needs num_seqs > 0 and 0 < q_tokens <= ctx_tokens <= "
                                    f"{max_len} (got {num_seqs}, {q}, {ctx})")
                if part == "layer" or part == "attn" or part == "attn_layer":
                    # a compute op attends over KV [0, ctx - q): on the GPU it must have been computed (and loaded
                    # or kept resident, which the executor tracks); for CPU attention it must be in host memory
                    need = ctx - q
                    gpu = kind == "compute"
                    have = present.get(("new" if gpu else "cpu", layer, batch), 0)
                    if have < need:
                        src = "were ever computed" if gpu else "are in host memory"
                        raise PlanError(f"{self._describe(i)}: attends over KV tokens [0, {need}) but only [0, {have}) "
                                        f"{src} (rule: every KV token read exists on the tier it is read from)")
                # new tokens' KV now exists: computed on the GPU (with CPU attention by pre_attn; flexgen-ref's
                # CPU attention op is FlexGen's whole sub-layer, QKV included)
                if kind == "cpu_compute" or part in ("layer", "pre_attn", "attn_layer"):
                    key = ("new", layer, batch)  # (``_extend``, inlined: this loop runs once per op)
                    end = present.get(key, 0)
                    if ctx - q <= end and ctx > end:
                        present[key] = ctx
                elif part == "embed" or part == "head":
                    key = (part, step, batch)
                    ends[key] = ends.get(key, 0) + 1
            else:
                tensor, nbytes, lo, hi = get("tensor", ""), get("nbytes", 0), get("lo", 0), get("hi", 0)
                if tensor not in TENSORS:
                    raise PlanError(f"{self._describe(i)}: tensor must be one of {TENSORS}")
                if nbytes <= 0:
                    raise PlanError(f"{self._describe(i)}: moves {nbytes} bytes; a transfer moves a positive number")
                if hi <= lo:
                    raise PlanError(f"{self._describe(i)}: empty range [{lo}, {hi})")
                if tensor == "weight" and not (0 <= lo and hi <= (W if 0 <= layer < L else W_emb)):
                    raise PlanError(f"{self._describe(i)}: weight bytes [{lo}, {hi}) outside the layer's "
                                    f"{W if 0 <= layer < L else W_emb}")
                if tensor == "kv":
                    # a KV copy reads tokens that exist on its source tier; stores extend the destination's prefix
                    src, dst = ROUTE_OF_KIND[kind]
                    have = present.get(("new" if kind == "d2h" else src, layer, batch), 0)
                    if hi > have:
                        raise PlanError(f"{self._describe(i)}: moves KV tokens [{lo}, {hi}) from {src}, but only "
                                        f"[0, {have}) {'were computed' if kind == 'd2h' else 'were stored there'} "
                                        "(rule: every KV token loaded was stored)")
                    if kind != "h2d":  # KV on the GPU is tracked as 'computed'; host and disk copies extend their tier
                        key = (dst, layer, batch)  # (``_extend``, inlined)
                        end = present.get(key, 0)
                        if lo <= end and hi > end:
                            present[key] = hi
                elif tensor == "qkv":  # CPU attention: new tokens' K, V land in host memory
                    key = ("cpu", layer, batch)  # (``_extend``, inlined)
                    end = present.get(key, 0)
                    if lo <= end and hi > end:
                        present[key] = hi
            alloc = get("alloc")
            if alloc is None and (use[0] > cap[0] or use[1] > cap[1] or use[2] > cap[2]):
                alloc = (0, 0, 0)  # (nothing allocated, but a negative free may have raised the use: report it)
            if alloc is not None:
                use[0] += alloc[0]
                use[1] += alloc[1]
                use[2] += alloc[2]
                if use[0] > cap[0] or use[1] > cap[1] or use[2] > cap[2]:
                    t = 0 if use[0] > cap[0] else 1 if use[1] > cap[1] else 2  # the first tier over, as before
                    raise PlanError(f"{self._describe(i)}: {TIERS[t]} memory reaches {use[t]} bytes, over the "
                                    f"capacity {cap[t]} by {use[t] - cap[t]} bytes")
            free = get("free")
            if free is not None:
                use[0] -= free[0]
                use[1] -= free[1]
                use[2] -= free[2]
            if multi:
                guse[dev] = use[0]
                if nodes:
                    nuse[nd] = [use[1], use[2]]
        if steps_seen != last_step:
            # the metrics divide the workload's tokens by the ops' time: ops of another length would be priced
            # as this one (a plan edited by hand, or a workload changed without its ops)
            raise PlanError(f"plan: its ops run steps 0..{steps_seen} but its workload generates "
                            f"{self.workload.gen_len} tokens (steps 0..{last_step}): the ops and the workload disagree")
        self._check_ends(ends)
        return self

    def _check_ends(self, ends: dict) -> None:
        """Each step of each GPU batch embeds its tokens once and samples its next token once (one 'embed' and one
        'head' compute op): without it the executor would run a step on a stale token and still report a rate."""
        nb, gen = self.workload.num_gpu_batches, self.workload.gen_len
        for (part, step, batch), n in ends.items():
            if not 0 <= batch < nb:
                raise PlanError(f"plan: an '{part}' op of step {step} is for GPU batch {batch}; the workload has "
                                f"batches 0..{nb - 1}")
        what = {"embed": "embedding", "head": "LM-head"}
        for step in range(gen):
            for batch in range(nb):
                for part in ("embed", "head"):
                    n = ends.get((part, step, batch), 0)
                    if n != 1:
                        raise PlanError(f"plan: step {step} of GPU batch {batch} has {n} {what[part]} ('{part}') ops; "
                                        "every step of every batch has exactly one (rule: each step embeds its "
                                        "tokens once and samples its next token once)")

    def _validate_nodes(self) -> None:
        """Every stage names its node, in order from 0 with none empty; each node's residents within its host."""
        N = len(self.nodes)
        at = 0
        for d, st in enumerate(self.stages):
            n = st.get("node")
            if isinstance(n, bool) or not isinstance(n, int) or n not in (at, at + 1) or (d == 0 and n != 0):
                raise PlanError(f"plan: stage {d} has node {n!r}; the stages' nodes must run 0, 0, ..., 1, ... "
                                "in order")
            at = n
        if at != N - 1:
            raise PlanError(f"plan: the stages run on {at + 1} nodes but the plan lists {N}")
        for n, x in enumerate(self.nodes):
            try:
                use = {t: (int(x[f"{t}_resident"]), int(x[f"{t}_capacity"])) for t in ("cpu", "disk")}
            except (KeyError, TypeError, ValueError):
                raise PlanError(f"plan: node {n} must have 'cpu_capacity', 'cpu_resident', 'disk_capacity' and "
                                f"'disk_resident'; got {x!r}") from None
            for t, (res, cap) in use.items():
                if res > cap:
                    raise PlanError(f"plan: node {n}'s resident {t} bytes {res} exceed its capacity {cap} by "
                                    f"{res - cap} bytes")

    def _validate_stages(self) -> None:
        """The stages tile the decoder layers in order, each non-empty, with a GPU budget that holds its resident
        bytes."""
        L, at = self.model.num_layers, 0
        for d, st in enumerate(self.stages):
            try:
                lo, hi = st["layers"]
                cap, res = int(st["gpu_capacity"]), int(st["gpu_resident"])
            except (KeyError, TypeError, ValueError):
                raise PlanError(f"plan: stage {d} must have 'layers' [lo, hi), 'gpu_capacity' and 'gpu_resident'; "
                                f"got {st!r}") from None
            if lo != at or hi <= lo:
                raise PlanError(f"plan: stage {d} has layers [{lo}, {hi}); stages must tile layers [0, {L}) in "
                                "order, each with at least one layer")
            if res > cap:
                raise PlanError(f"plan: stage {d}'s resident GPU bytes {res} exceed its GPU capacity {cap} by "
                                f"{res - cap} bytes")
            at = hi
        if at != L:
            raise PlanError(f"plan: the stages cover layers [0, {at}) of the model's {L}")

    def _describe(self, i: int) -> str:
        """``Op.describe`` of op ``i`` (for a message: makes that one Op from its row)."""
        ops = self.ops
        rows = ops.rows if isinstance(ops, OpList) else None
        return (_op_from_row(i, rows[i]) if rows is not None else ops[i]).describe()


def _prefix(present: dict, key: tuple) -> int:
    return present.get(key, 0)


def _extend(present: dict, key: tuple, lo: int, hi: int) -> None:
    """Record tokens [lo, hi) as present under key; presence is tracked as a contiguous prefix [0, end)."""
    end = present.get(key, 0)
    if lo <= end:
        present[key] = max(end, hi)


def _merged(deps: list | tuple) -> tuple:
    """An op's dependencies as its row keeps them: sorted, each once, without None (a dependency that is absent).

    (One or two dependencies -- most ops' -- without building a set and sorting it; a None tested by identity: ``None
    in deps`` compares each int with None, the slow way. ``PlanBuilder.add_row`` inlines this: it runs once per op.)"""
    n = len(deps)
    if n == 1:
        a = deps[0]
        return () if a is None else (a,)
    if n == 2:
        a, b = deps
        if a is not None and b is not None:
            return (a, b) if a < b else (b, a) if b < a else (a,)
    ds = set(deps)
    ds.discard(None)
    return tuple(sorted(ds))


class PlanBuilder:
    """Appends ops in issue order with consecutive ids. With ``serial=True`` every op also waits for the op issued
    before it (FlexGen's 'overlap off': nothing runs concurrently). ``ops`` is an ``OpList``: one row per op, the
    ``Op`` objects made only if someone asks for them (``add`` is the planners' innermost call)."""

    def __init__(self, serial: bool = False):
        self.ops = OpList()
        self.serial = serial
        self._fields_ok: dict[int, dict] = {}  # the fields dicts ``add_row`` has checked, by id

    def add(self, kind: str, deps: Iterable[int | None], phase: str, step: int, layer: int, batch: int,
            **kw) -> int:
        rows = self.ops._rows
        if rows is None:  # someone made the Op objects mid-build: append to them from now on
            return self._add_op(kind, deps, phase, step, layer, batch, kw)
        if kw and not _ROW_FIELDS.issuperset(kw):
            if not _OPTIONAL.issuperset(kw):
                raise TypeError(f"Op got unknown fields {sorted(set(kw) - _OPTIONAL)}")
            self.ops._list()  # a stream other than its kind's: kept on an Op (rows derive the stream from the kind)
            return self._add_op(kind, deps, phase, step, layer, batch, kw)
        if kind not in STREAM_OF_KIND:
            raise KeyError(kind)
        i = len(rows)
        if type(deps) is not list and type(deps) is not tuple:
            deps = list(deps)
        if self.serial and i:
            deps = [*deps, i - 1]
        rows.append((kind, _merged(deps), phase, step, layer, batch, kw))
        return i

    def add_row(self, kind: str, deps: list | tuple, phase: str, step: int, layer: int, batch: int,
                fields: dict) -> int:
        """``add(kind, deps, phase, step, layer, batch, **fields)``, keeping ``fields`` itself as the op's row
        fields: rows may share one dict, which the caller must not change afterwards. ``deps``: a list or a tuple.

        Why: a block schedule emits ~3·10^5 ops of a few hundred shapes; making (and keeping) a fields dict per op
        and passing it by keywords cost about a third of OPT-175B's build. A builder that has made its ``Op``
        objects, a serial builder and fields other than a row's go through ``add`` (a copy of ``fields``; ``add``
        refuses an unknown field or kind). A shared dict's names are checked once."""
        rows = self.ops._rows
        # (fast path: a dict this builder has checked; a serial builder checks none, so its ops all go through ``add``)
        if rows is None or self._fields_ok.get(id(fields)) is not fields or kind not in STREAM_OF_KIND:
            if rows is not None and not self.serial and kind in STREAM_OF_KIND and self._row_fields(fields):
                return self.add_row(kind, deps, phase, step, layer, batch, fields)  # (a new shape, now checked)
            return self.add(kind, deps, phase, step, layer, batch, **fields)
        # ``_merged(deps)``, inlined (a call per op was ~4 % of a block schedule's build)
        n = len(deps)
        if n == 1:
            a = deps[0]
            deps = () if a is None else (a,)
        elif n == 2 and deps[0] is not None and deps[1] is not None:
            a, b = deps
            deps = (a, b) if a < b else (b, a) if b < a else (a,)
        else:
            ds = set(deps)
            ds.discard(None)
            deps = tuple(sorted(ds))
        rows.append((kind, deps, phase, step, layer, batch, fields))
        return len(rows) - 1

    def _row_fields(self, fields: dict) -> bool:
        """Whether ``fields`` can be a row's as it is (``add_row``); remembered when it can."""
        if not _ROW_FIELDS.issuperset(fields):
            return False
        self._fields_ok[id(fields)] = fields
        return True

    def _add_op(self, kind, deps, phase, step, layer, batch, kw) -> int:
        ops = self.ops
        i = len(ops)
        ds = [d for d in deps if d is not None]
        if self.serial and i:
            ds.append(i - 1)
        if len(ds) > 1:
            ds = sorted(set(ds))
        if kw and not _OPTIONAL.issuperset(kw):
            raise TypeError(f"Op got unknown fields {sorted(set(kw) - _OPTIONAL)}")
        ops.append(_op_from_row(i, (kind, tuple(ds), phase, step, layer, batch, kw)))
        return i
