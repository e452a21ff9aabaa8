"""The static policies: HF Accelerate's and DeepSpeed ZeRO-Inference's layer-by-layer offloading, on the shared
block schedule (``offsim.policies.schedule``) with one GPU batch.

- ``static-accelerate``: HF Accelerate's ``device_map``: whole layers on the GPU (as many as fit beside the KV
  cache), the rest in pageable host memory (or on disk), each copied in synchronously when the layer runs, no
  prefetch; KV on the GPU.
- ``static-zero``: DeepSpeed ZeRO-Inference: all layer weights in pinned host memory (or on disk), streamed layer by
  layer with the next layer prefetched; KV on the GPU (or the CPU).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, Iterable

from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload
from offsim.policies.base import Candidate, Policy, capacity_of, check_field_types, compression_of
from offsim.policies.lp import GPU_BATCH_SIZES
from offsim.policies.schedule import Schedule, build_block_plan


@dataclass(frozen=True)
class AccelerateSettings:
    """``gpu_layers``: decoder layers kept whole on the GPU (None: as many as fit beside KV cache and buffers);
    ``offload``: where the other layers live, 'cpu' (pageable, as Accelerate keeps them) or 'disk'."""

    POLICY: ClassVar[str] = "static-accelerate"

    gpu_layers: int | None = None
    offload: str = "cpu"
    # FlexGen's approximations (``specs.Compression``): --compress-weight, --compress-cache, --sparse-attention
    compress_weight: bool = False
    compress_cache: bool = False
    sparse_attention: float = 1.0

    def __post_init__(self):
        check_field_types(self, self.POLICY)
        if self.offload not in ("cpu", "disk"):
            raise OffsimError(f"offload must be 'cpu' or 'disk', got {self.offload!r}")
        compression_of(self)


def accelerate_gpu_layers(model: ModelSpec, hw: HardwareSpec, wl: Workload,
                          comp: Compression = NO_COMPRESSION) -> int:
    """How many whole decoder layers fit on the GPU beside everything else the GPU holds with every layer offloaded
    (``footprint.placement_tier_bytes``: embeddings, token ids, the KV cache at full length, the activations, the
    largest op peak and one streamed layer's slot) -- what device_map='auto' with max_memory does, leaving room
    for generation. With compression (``comp``), at the layers' stored size."""
    W, L = fp.layer_weight_bytes(model), model.num_layers
    pl = fp.Placement(((0, W),) * L, (model.num_kv_heads, 0), weight_buffers=1, compression=comp)
    fixed = sum(fp.placement_tier_bytes(model, wl, pl)["gpu"].values())
    return max(0, min(L, (hw.gpu_mem_bytes - fixed) // fp.stored_layer_weight_bytes(model, comp)))


def _accelerate_schedule(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateSettings) -> Schedule:
    if wl.num_gpu_batches != 1:
        raise OffsimError("static-accelerate runs one GPU batch at a time: use --num-gpu-batches 1")
    W = model.layer_weight_bytes()
    n = accelerate_gpu_layers(model, hw, wl, compression_of(st)) if st.gpu_layers is None else st.gpu_layers
    if not 0 <= n <= model.num_layers:
        raise OffsimError(f"gpu_layers must be in [0, {model.num_layers}], got {n}")
    off = (0, W) if st.offload == "cpu" else (0, 0)
    split = tuple((W, 0) if j < n else off for j in range(model.num_layers))
    return Schedule(policy="static-accelerate", weight_split=split, kv_split=(model.num_kv_heads, 0), prefetch=False,
                    overlap=True, pinned=False, compression=compression_of(st),
                    settings=tuple(dataclasses.asdict(st).items()), derived=(("gpu_layers", n),))


def static_accelerate_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateSettings) -> Plan:
    return build_block_plan(model, wl, _accelerate_schedule(model, hw, wl, st), capacity_of(hw))


@dataclass(frozen=True)
class ZeroSettings:
    """``offload``: where the layer weights live, 'cpu' (pinned) or 'disk'; ``kv_on_cpu``: KV cache in host memory
    (loaded every step) instead of on the GPU."""

    POLICY: ClassVar[str] = "static-zero"

    offload: str = "cpu"
    kv_on_cpu: bool = False
    # FlexGen's approximations (``specs.Compression``): --compress-weight, --compress-cache, --sparse-attention
    compress_weight: bool = False
    compress_cache: bool = False
    sparse_attention: float = 1.0

    def __post_init__(self):
        check_field_types(self, self.POLICY)
        if self.offload not in ("cpu", "disk"):
            raise OffsimError(f"offload must be 'cpu' or 'disk', got {self.offload!r}")
        compression_of(self)


def _zero_schedule(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings) -> Schedule:
    if wl.num_gpu_batches != 1:
        raise OffsimError("static-zero runs one GPU batch at a time: use --num-gpu-batches 1")
    W = model.layer_weight_bytes()
    split = ((0, W) if st.offload == "cpu" else (0, 0),) * model.num_layers
    kv = (0, model.num_kv_heads) if st.kv_on_cpu else (model.num_kv_heads, 0)
    return Schedule(policy="static-zero", weight_split=split, kv_split=kv, prefetch=True, overlap=True, pinned=True,
                    compression=compression_of(st), settings=tuple(dataclasses.asdict(st).items()))


def static_zero_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings) -> Plan:
    return build_block_plan(model, wl, _zero_schedule(model, hw, wl, st), capacity_of(hw))


def _batches(batch: int | None, max_batch: int | None = None) -> Iterable[int]:
    sizes = GPU_BATCH_SIZES if batch is None else (batch,)
    return [b for b in sizes if max_batch is None or b <= max_batch]


def offload_tier(model: ModelSpec, hw: HardwareSpec, wl: Workload, settings: type, placement) -> str:
    """Where a static policy's offloaded layers go for this block: host memory when the policy's own placement with
    them there (``placement(model, hw, wl, settings(offload='cpu'))``: the layers it keeps on the GPU, the KV where
    it puts it) fits the host by the footprint's arithmetic, else disk -- unless the disk cannot hold the weights
    either, where host memory is the one chance (the plan's check then says what is short). Before 2026-12-04 the
    rule was all the weights within 95 % of host memory, which sent OPT-66B's layers to disk on a 24 GiB RTX 3090
    (Accelerate keeps some on the GPU: 2.26 tok/s from host memory, 0.46 from disk) and refused it on the H200
    (121.5 GiB of weights, a 64 GiB disk) where host memory holds them."""
    pl = placement(model, hw, wl, settings(offload="cpu"))
    fits_host = fp.fits(model, capacity_of(hw), wl, pl, ("cpu",))
    return "cpu" if fits_host or model.weight_bytes() > hw.disk_bytes else "disk"


def offload_candidates(settings: type, placement, kv_choices: tuple = ((),)):
    """A static policy's candidate generator (``base.CandidateFn``): one GPU batch of each size (or of ``batch``),
    its layers where they fit (``offload_tier``), for each of ``kv_choices`` (extra settings: ZeRO's KV on the GPU
    and in host memory). Unranked: the search simulates them."""

    def candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, batch: int | None = None,
                   key_mask: bool = False, max_batch: int | None = None) -> Iterable[Candidate]:
        for kv in kv_choices:
            for gbs in _batches(batch, max_batch):
                wl = Workload(prompt_len, gen_len, gbs, 1, reserve_key_mask=key_mask)
                off = offload_tier(model, hw, wl, functools.partial(settings, **dict(kv)), placement)
                yield Candidate({"offload": off, **dict(kv)}, wl)

    return candidates


def accelerate_placement(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateSettings) -> fp.Placement:
    return _accelerate_schedule(model, hw, wl, st).placement()


def zero_placement(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings) -> fp.Placement:
    return _zero_schedule(model, hw, wl, st).placement()


ZERO_KV_CHOICES = ((("kv_on_cpu", False),), (("kv_on_cpu", True),))  # ZeRO's candidates: KV on the GPU, on the host
accelerate_candidates = offload_candidates(AccelerateSettings, accelerate_placement)
zero_candidates = offload_candidates(ZeroSettings, zero_placement, ZERO_KV_CHOICES)


ACCELERATE = Policy("static-accelerate", AccelerateSettings, static_accelerate_plan, accelerate_candidates,
                    "HF Accelerate: whole layers on the GPU, the rest copied in synchronously, KV on the GPU",
                    accelerate_placement)
ZERO = Policy("static-zero", ZeroSettings, static_zero_plan, zero_candidates,
              "ZeRO-Inference: every layer streamed from pinned host memory with the next one prefetched",
              zero_placement)
