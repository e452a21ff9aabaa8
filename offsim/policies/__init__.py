"""Offloading policies: each a function (model, hardware, workload, settings) -> Plan (DESIGN.md §6).

- ``static-accelerate``: HF Accelerate's ``device_map``: whole layers on the GPU (as many as fit beside the KV
  cache), the rest in pageable host memory (or on disk), each copied in synchronously when the layer runs, no
  prefetch; KV on the GPU; one GPU batch.
- ``static-zero``: DeepSpeed ZeRO-Inference: all layer weights in pinned host memory (or on disk), streamed layer by
  layer with the next layer prefetched; KV on the GPU (or the CPU); one GPU batch.
- ``flexgen``: FlexGen's zig-zag block schedule with placement percentages for weights, KV cache and activations
  over GPU/CPU/disk, overlap on or off, optional CPU attention (FlexGen's six ``--percent`` numbers).

``POLICIES`` maps a name to (plan function, settings class); ``build_plan`` is the one entry point.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import OffsimError
from ..plan import Plan
from ..specs import HardwareSpec, ModelSpec, Workload
from .schedule import Schedule, build_block_plan, resident_bytes, workspace_bytes


def capacity_of(hw: HardwareSpec) -> dict[str, int]:
    return {"gpu": int(hw.gpu_mem_bytes), "cpu": int(hw.cpu_mem_bytes), "disk": int(hw.disk_bytes)}


def _settings_from(cls, d: Mapping[str, Any] | None):
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise OffsimError(f"unknown settings {sorted(unknown)} for this policy; valid: {sorted(names)}")
    return cls(**d)


# ----------------------------------------------------------------------------------------------------------------
# FlexGen
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlexGenSettings:
    """FlexGen's policy knobs. ``percent``: weights GPU, weights CPU, cache GPU, cache CPU, activations GPU,
    activations CPU (FlexGen's ``--percent``; the rest of each pair is on disk)."""

    percent: tuple[int, int, int, int, int, int] = (100, 0, 100, 0, 100, 0)
    overlap: bool = True  # overlap I/O with compute (FlexGen's default)
    cpu_attention: bool = False  # FlexGen's --cpu-cache-compute
    pin_weights: bool = True  # FlexGen's --pin-weight

    def __post_init__(self):
        p = tuple(self.percent)
        if len(p) != 6 or any(not 0 <= x <= 100 for x in p):
            raise OffsimError(f"--percent needs six numbers in [0, 100], got {list(p)}")
        for name, (a, b_) in (("weights", p[0:2]), ("cache", p[2:4]), ("activations", p[4:6])):
            if a + b_ > 100:
                raise OffsimError(f"--percent: {name} GPU + CPU = {a + b_} % exceeds 100 (the rest goes to disk)")
        if p[4] + p[5] != 100:
            raise OffsimError(f"--percent: activations GPU + CPU must sum to 100 (activations never go to disk), "
                              f"got {p[4]} + {p[5]}")
        object.__setattr__(self, "percent", p)


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


def flexgen_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: FlexGenSettings) -> Plan:
    wg, wc, cg, cc, ag, ac = st.percent
    split = weight_split_from_percent(model, wg, wc)
    kv = kv_split_from_percent(model, cg, cc)
    s = Schedule(policy="flexgen", weight_split=(split,) * model.num_layers, kv_split=kv,
                 hidden_home="gpu" if ag >= ac else "cpu", prefetch=True, overlap=st.overlap,
                 cpu_attention=st.cpu_attention, pinned=st.pin_weights,
                 settings=tuple(dataclasses.asdict(st).items()))
    return build_block_plan(model, wl, s, capacity_of(hw))


# ----------------------------------------------------------------------------------------------------------------
# Static policies
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AccelerateSettings:
    """``gpu_layers``: decoder layers kept whole on the GPU (None: as many as fit beside KV cache and buffers);
    ``offload``: where the other layers live, 'cpu' (pageable, as Accelerate keeps them) or 'disk'."""

    gpu_layers: int | None = None
    offload: str = "cpu"

    def __post_init__(self):
        if self.offload not in ("cpu", "disk"):
            raise OffsimError(f"offload must be 'cpu' or 'disk', got {self.offload!r}")


def accelerate_gpu_layers(model: ModelSpec, hw: HardwareSpec, wl: Workload) -> int:
    """How many whole decoder layers fit on the GPU beside the embedding, the KV cache at full length, the
    activations, one layer's scratch and one streamed layer's buffer (what device_map='auto' with max_memory does,
    leaving room for generation)."""
    W = model.layer_weight_bytes()
    fixed = resident_bytes(model, wl, Schedule("x", ((0, W),) * model.num_layers, (model.num_kv_heads, 0)))["gpu"]
    free = hw.gpu_mem_bytes - fixed - workspace_bytes(model, wl.num_prompts * wl.prompt_len) - W
    return max(0, min(model.num_layers, free // W))


def static_accelerate_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateSettings) -> Plan:
    if wl.num_gpu_batches != 1:
        raise OffsimError("static-accelerate runs one GPU batch at a time: use --num-gpu-batches 1")
    W = model.layer_weight_bytes()
    n = accelerate_gpu_layers(model, hw, wl) if st.gpu_layers is None else st.gpu_layers
    if not 0 <= n <= model.num_layers:
        raise OffsimError(f"gpu_layers must be in [0, {model.num_layers}], got {n}")
    off = (0, W) if st.offload == "cpu" else (0, 0)
    split = tuple((W, 0) if j < n else off for j in range(model.num_layers))
    s = Schedule(policy="static-accelerate", weight_split=split, kv_split=(model.num_kv_heads, 0), prefetch=False,
                 overlap=True, pinned=False, settings=(("gpu_layers", n), ("offload", st.offload)))
    return build_block_plan(model, wl, s, capacity_of(hw))


@dataclass(frozen=True)
class ZeroSettings:
    """``offload``: where the layer weights live, 'cpu' (pinned) or 'disk'; ``kv_on_cpu``: KV cache in host memory
    (loaded every step) instead of on the GPU."""

    offload: str = "cpu"
    kv_on_cpu: bool = False

    def __post_init__(self):
        if self.offload not in ("cpu", "disk"):
            raise OffsimError(f"offload must be 'cpu' or 'disk', got {self.offload!r}")


def static_zero_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings) -> Plan:
    if wl.num_gpu_batches != 1:
        raise OffsimError("static-zero runs one GPU batch at a time: use --num-gpu-batches 1")
    W = model.layer_weight_bytes()
    split = ((0, W) if st.offload == "cpu" else (0, 0),) * model.num_layers
    kv = (0, model.num_kv_heads) if st.kv_on_cpu else (model.num_kv_heads, 0)
    s = Schedule(policy="static-zero", weight_split=split, kv_split=kv, prefetch=True, overlap=True, pinned=True,
                 settings=(("offload", st.offload), ("kv_on_cpu", st.kv_on_cpu)))
    return build_block_plan(model, wl, s, capacity_of(hw))


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------
POLICIES: dict[str, tuple[Callable[..., Plan], type]] = {
    "static-accelerate": (static_accelerate_plan, AccelerateSettings),
    "static-zero": (static_zero_plan, ZeroSettings),
    "flexgen": (flexgen_plan, FlexGenSettings),
}


def _register_optional() -> None:
    """Policies that live in their own modules (TightLLM, Select-N) join the table if present."""
    import importlib

    for mod in ("tightllm", "selectn"):
        try:
            m = importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise
            continue
        POLICIES.update(m.POLICY)


_register_optional()


def build_plan(policy: str, model: ModelSpec, hw: HardwareSpec, wl: Workload,
               settings: Mapping[str, Any] | Any | None = None, validate: bool = True) -> Plan:
    """The plan of ``policy`` for this model, hardware and workload; ``settings`` a dict or the settings object."""
    if policy not in POLICIES:
        raise OffsimError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    fn, cls = POLICIES[policy]
    st = settings if isinstance(settings, cls) else _settings_from(cls, settings)
    plan = fn(model, hw, wl, st)
    return plan.validate() if validate else plan
