"""What every policy shares: the ``Policy`` record the registry holds, a search ``Candidate``, and the placement
helpers (percentages to bytes and heads) that FlexGen-style policies use.

A policy is five things (``Policy``): a name, a frozen settings dataclass (its *inputs*: what a user sets), a plan
builder ``(model, hardware, workload, settings) -> Plan``, a candidate generator that proposes settings and
block shapes for the search, best first, and its placement ``(model, hardware, workload, settings) ->
footprint.Placement`` -- what it puts where, so that ``build_plan`` can refuse a plan that fits nowhere from
arithmetic (``footprint.check_fits``) before the builder emits a single op. Nothing else about a policy is known
outside its module.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from offsim.core.errors import OffsimError
from offsim.core.footprint import Placement
from offsim.core.plan import Plan
from offsim.core.specs import COMPRESSION_KEYS, Compression, HardwareSpec, ModelSpec, Workload


class Candidate(NamedTuple):
    """One point for the search to try: settings (a dict of the policy's settings fields), the block shape (a
    Workload) and, when the policy ranks its candidates by a model of its own (FlexGen's LP, TightLLM's estimate),
    that model's seconds per token (None otherwise)."""

    settings: dict
    workload: Workload
    score_s_per_token: float | None = None


# (model, hardware, prompt_len, gen_len, batch) -> candidates, best first. ``batch`` None: any block shape;
# an int: only block shapes with exactly that many sequences (gpu_batch_size x num_gpu_batches). Optional keyword
# ``key_mask=True`` (an offline job's search): each candidate's workload reserves a padded batch's key mask
# (``Workload.reserve_key_mask``) and the candidate fits with it. Keyword ``max_batch=N``: no block shape of more than N
# sequences (a generator that keeps only its best few shapes keeps the best few under the cap). A generator without
# them still serves: the search then filters by the cap and reserves the mask itself (docs/architecture.md §5).
CandidateFn = Callable[[ModelSpec, HardwareSpec, int, int, "int | None"], Iterable[Candidate]]


@dataclass(frozen=True)
class Policy:
    """One offloading policy, as the registry (``offsim.policies.POLICIES``) holds it."""

    name: str
    settings: type  # a frozen dataclass: the policy's inputs, with defaults
    build: Callable[[ModelSpec, HardwareSpec, Workload, Any], Plan]  # builds the plan; raises OffsimError
    candidates: CandidateFn
    summary: str  # one line for --help and docs
    placement: Callable[[ModelSpec, HardwareSpec, Workload, Any], Placement] | None = None
    # inputs added after runs were recorded, with the value those runs had: a recorded run without one ran so
    before_inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # its candidate generator takes ``compression=`` and ranks under it (FlexGen's LP); for the other policies that
    # model compression (their settings have ``specs.COMPRESSION_KEYS``) the search adds it to each candidate
    ranks_compression: bool = False
    # pipeline parallelism: settings with ``num_stages`` > 1 are checked by this instead of the whole-model
    # placement (every stage against one GPU; host and disk shared): (model, hardware, workload, settings, what).
    # A policy with it also takes ``num_gpus=N`` in its candidate generator (``offsim search --num-gpus N``:
    # pipeline candidates, their stages in their settings)
    check_stages: Callable[[ModelSpec, HardwareSpec, Workload, Any, str], None] | None = None
    # a ``*-ref`` policy (``offsim.policies.ref``): the name of the ideal policy whose schedule it runs as that
    # system's code does; left out of the default policy sets (compare, sweeps, jobs' 'all'), asked for by name
    implements: str = ""

    @property
    def compressible(self) -> bool:
        """Whether its settings carry FlexGen's compression and sparse attention (``specs.COMPRESSION_KEYS``)."""
        return set(COMPRESSION_KEYS) <= set(self.input_names())

    def settings_from(self, d: Mapping[str, Any] | Any | None):
        """The settings object from a dict (unknown keys are an error naming the valid ones) or as given."""
        if isinstance(d, self.settings):
            return d
        d = dict(d or {})
        names = [f.name for f in dataclasses.fields(self.settings)]
        unknown = set(d) - set(names)
        if unknown:
            raise OffsimError(f"unknown settings {sorted(unknown)} for policy {self.name}; valid: {names}")
        d = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}  # JSON lists back to tuples
        return self.settings(**d)

    def input_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.settings)]

    def inputs_of(self, recorded: Mapping[str, Any]) -> dict:
        """The inputs among settings recorded by a run. Plans written before ``Plan.derived`` existed stored derived
        values (TightLLM's N_r table, Accelerate's GPU layers) among their settings; this drops them. An input the
        run predates takes the value the run had (``before_inputs``; FlexGen streamed whole layers before
        ``sublayer``)."""
        names = set(self.input_names())
        return {**self.before_inputs, **{k: v for k, v in recorded.items() if k in names}}


def check_field_types(st: Any, policy: str) -> None:
    """Refuse a settings field of the wrong type by its annotation: a ``bool`` field must be true or false (from
    ``--set cpu_attention=no`` or a spec's ``"yes"`` the value is a string, which Python would take as true) and an
    ``int`` field an integer. What a settings ``__post_init__`` calls first; range checks stay with each policy."""
    for f in dataclasses.fields(st):
        v = getattr(st, f.name)
        if f.type in ("bool", bool) and not isinstance(v, bool):
            raise OffsimError(f"{policy} {f.name} must be true or false, got {v!r}")
        if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise OffsimError(f"{policy} {f.name} must be an integer, got {v!r}")
        if f.type in ("int | None", "Optional[int]") and v is not None \
                and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise OffsimError(f"{policy} {f.name} must be an integer or null, got {v!r}")


def compression_of(st: Any) -> Compression:
    """A settings object's compression (its ``compress_weight``, ``compress_cache`` and ``sparse_attention``;
    ``Compression.from_settings``), checked against its CPU attention: what a settings ``__post_init__`` calls so
    that a bad combination is refused on construction, in one line."""
    comp = Compression.from_settings(st)
    comp.check_cpu_attention(getattr(st, "cpu_attention", False))
    return comp


def capacity_of(hw: HardwareSpec) -> dict[str, int]:
    """Bytes per tier a plan may use on ``hw``: the GPU budget, host memory and disk."""
    return {"gpu": int(hw.gpu_mem_bytes), "cpu": int(hw.cpu_mem_bytes), "disk": int(hw.disk_bytes)}


def weight_split_from_percent(model: ModelSpec, gpu_pct: float, cpu_pct: float) -> tuple[int, int]:
    """Bytes (gpu, cpu) of one layer's flat weights for placement percentages, on element boundaries."""
    W, e = model.layer_weight_bytes(), model.dtype_bytes
    g = int(W * gpu_pct / 100 / e) * e  # rounded down: never more on a fast tier than asked
    c = min(int(W * cpu_pct / 100 / e) * e, W - g)
    if gpu_pct + cpu_pct >= 100:
        c = W - g  # nothing on disk when nothing was asked there
    return g, c


def kv_split_from_percent(model: ModelSpec, gpu_pct: float, cpu_pct: float) -> tuple[int, int]:
    """KV heads (gpu, cpu) for cache placement percentages (FlexGen splits the cache along heads)."""
    n = model.num_kv_heads
    g = int(n * gpu_pct / 100 + 1e-9)  # rounded down, as for weights
    c = n - g if gpu_pct + cpu_pct >= 100 else min(int(n * cpu_pct / 100 + 1e-9), n - g)
    return g, c
