"""Select-N (arXiv 2502.08182; docs/cost-model.md §9): one decoder layer in every N has its weights offloaded to
pinned host memory and fetched ahead of use, so its PCIe copy overlaps the compute of the N - 1 resident layers in
front of it. N is the *offloading interval*: a smaller N offloads more (more host memory used, more PCIe traffic, less
GPU memory for weights), a larger N less; N > num_layers offloads nothing.

Which layers: layer j is offloaded iff ``j % N == N - 1`` (N = 1: every layer, as ZeRO-Inference; N = 2: the odd
layers; N = 4: layers 3, 7, 11, ...), so ``num_layers // N`` layers live on the host and each sits at the end of a
run of N - 1 resident ones, the spacing that gives every copy the longest compute to hide under.

The plan is the shared block schedule (``schedule.build_block_plan``) with a per-layer weight placement -- resident
layers (W, 0), offloaded ones (0, W) -- the KV cache on the GPU (Select-N keeps vLLM's paged cache on the GPU and
spends the GPU memory it frees on a larger batch) and next-layer prefetch on: the load of offloaded layer j is
issued when the previous offloaded layer runs, double-buffered. So a selectn plan uses only ops the static policies
already use, which the executor runs unchanged.

One N per plan: a plan's weight placement is static (``Plan.weight_split``), so prefill and decode with different
N are two iterations with two plans; ``offsim.policies.selectn.record`` chooses N per iteration and prices the switch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload
from offsim.policies.base import Candidate, Policy, capacity_of, check_field_types, compression_of
from offsim.policies.schedule import Schedule, build_block_plan


@dataclass(frozen=True)
class SelectNSettings:
    """``interval``: the offloading interval N >= 1 (layer j offloaded iff j % N == N - 1; N > num_layers offloads
    nothing); ``prefetch``: load an offloaded layer while the resident layers before it compute (Select-N's overlap;
    False is the ablation: the copy starts when the layer is reached)."""

    interval: int = 1
    prefetch: bool = True
    # FlexGen's approximations (``specs.Compression``): --compress-weight, --compress-cache, --sparse-attention
    compress_weight: bool = False
    compress_cache: bool = False
    sparse_attention: float = 1.0

    def __post_init__(self):
        check_field_types(self, "selectn")
        compression_of(self)
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise OffsimError(f"selectn interval must be an integer >= 1 (1 offloads every layer, a value above "
                              f"the layer count offloads none), got {self.interval!r}")


def offloaded_layers(num_layers: int, interval: int) -> list[int]:
    """Decoder layers whose weights live in host memory for offloading interval N = ``interval``."""
    if interval < 1:
        raise OffsimError(f"selectn interval must be >= 1, got {interval}")
    return [j for j in range(num_layers) if j % interval == interval - 1]


def host_weight_bytes(model: ModelSpec, interval: int) -> int:
    """Host-memory bytes of the offloaded weights: (num_layers // N) layers of ``layer_weight_bytes`` each."""
    return len(offloaded_layers(model.num_layers, interval)) * model.layer_weight_bytes()


def selectn_schedule(model: ModelSpec, interval: int, prefetch: bool = True,
                     comp: Compression = NO_COMPRESSION) -> Schedule:
    """The block schedule of Select-N with offloading interval ``interval`` (and compression ``comp``)."""
    W = model.layer_weight_bytes()
    off = set(offloaded_layers(model.num_layers, interval))
    split = tuple((0, W) if j in off else (W, 0) for j in range(model.num_layers))
    return Schedule(policy="selectn", weight_split=split, kv_split=(model.num_kv_heads, 0), hidden_home="gpu",
                    prefetch=prefetch, overlap=True, cpu_attention=False, pinned=True, compression=comp,
                    settings=(("interval", interval), ("prefetch", prefetch), *comp.settings().items()))


def selectn_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: SelectNSettings) -> Plan:
    return build_block_plan(model, wl, selectn_schedule(model, st.interval, st.prefetch, compression_of(st)),
                            capacity_of(hw))


def selectn_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                       batch: int | None = None, key_mask: bool = False,
                       max_batch: int | None = None) -> Iterable[Candidate]:
    """One interval per distinct number of offloaded layers (the largest N with that count; num_layers + 1 = none),
    fewest offloaded first, times one GPU batch (Select-N serves one batch per iteration) of 1, 2, 4, ... sequences
    while the KV cache alone still fits the GPU -- or of ``batch`` sequences. Plans that do not fit are the search's
    to reject; at a fixed batch the first that fits is the fastest (fewer offloaded layers, less traffic)."""
    L = model.num_layers
    intervals = sorted({L // c for c in range(1, L + 1)} | {L + 1}, reverse=True)
    max_len = prompt_len + gen_len - 1
    sizes = [batch] if batch is not None else []
    bs = 1
    top = 4096 if max_batch is None else min(4096, max_batch)  # (``base.CandidateFn``)
    while batch is None and fp.kv_bytes(model, bs, max_len, layers=model.num_layers) < hw.gpu_mem_bytes and bs <= top:
        sizes.append(bs)
        bs *= 2
    # Only the GPU filters candidates: a host-memory shortfall is left to the plan builder, whose refusal the search
    # reports (the tier that is short and by how much; filtering it here would leave the search "no candidate").
    cap = capacity_of(hw)
    for bs in sizes:
        wl = Workload(prompt_len, gen_len, bs, 1, reserve_key_mask=key_mask)  # (``base.CandidateFn``)
        for n in intervals:
            # what the GPU holds (resident and the minimum working set) must fit: arithmetic, no plan built
            if fp.fits(model, cap, wl, selectn_schedule(model, n).placement(), ("gpu",)):
                yield Candidate({"interval": n}, wl)


SELECTN = Policy("selectn", SelectNSettings, selectn_plan, selectn_candidates,
                 "Select-N: one layer in every N offloaded and prefetched; N chosen to meet a latency SLO",
                 lambda m, hw, wl, st: selectn_schedule(m, st.interval, st.prefetch, compression_of(st)).placement())
