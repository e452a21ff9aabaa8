"""TightLLM (IEEE TC 2025; docs/cost-model.md §8): adaptive offloading that trades GPU compute for PCIe transfer.

Algorithm 1, as a plan generator: for every decode step and GPU batch, estimate the sequence length, price the KV
load (T_cache), the weight slice (T_weight) and the compute (T_compute) with ``offsim.core.costmodel``, and let the KV
distributor (``offsim.policies.tightllm.kv_distributor``, an ILP) choose N_r, the number of most recent tokens to *recompute* instead
of load; then emit the ops layer by layer and batch by batch, on the zig-zag block order FlexGen uses (for step i,
layer j, batch k: prefetch the next position's KV, load a slice of the next layer's weights, compute, store).

What the ops mean (only the op semantics of ``offsim.core.plan``'s docstring; the executor runs them unchanged):

- Decode step i, batch k, N_ctx = prompt_len + i - 1 tokens have KV, N_r recomputed, b = N_ctx - N_r loaded
  (prompt_len: the batch's own, padded to its longest prompt; the distributor decides N_r on the batch's *mean*
  prompt length, as Algorithm 1 estimates it: ``batch_ctx_tokens``, docs/jobs.md §5):
  * ``h2d kv [0, b)`` (host-homed heads; disk-homed heads ``disk_read kv [0, b)`` then ``h2d kv [0, b)``): only the
    prefix is loaded;
  * ``compute embed`` with ``q_tokens = N_r + 1``, ``ctx_tokens = N_ctx + 1``: the recomputed tokens start from
    their token ids (nothing else about them is kept on the GPU between steps), plus the new token;
  * ``compute layer`` with ``q_tokens = N_r + 1``, ``ctx_tokens = N_ctx + 1`` in every decoder layer: a small
    prefill of the last N_r + 1 positions -- QKV, causal attention over the loaded KV [0, b) and the K/V these
    positions just produced [b, N_ctx + 1), output projection, FFN. Its K/V are a by-product used in place; nothing
    of them survives the op except what a store below copies out. (TightLLM's "scheme 2": full forward, not a K/V
    projection from kept hidden states.);
  * ``compute head`` with ``q_tokens = N_r + 1``: the LM head on the last position only (as at prefill);
  * ``d2h kv [S, t)`` (and ``disk_write`` for disk-homed heads) after the layer: t = the next step's boundary
    b' = N_ctx + 1 - N_r'. Only what some later step will *load* is ever stored, and each token once: S is what is
    already stored, and tokens [S, t) are inside what this compute produced ([b, N_ctx + 1)), because S >= b.
- Prefill: ``compute layer`` over the prompt as usual, but only ``[0, t)`` of its KV is stored, t = prompt_len -
  N_r of step 1 (TightLLM: "the KV of tokens decode will recompute is never offloaded"). The D2H bytes drop by exactly
  the KV of those N_r tokens.
- Invariant (``Plan.validate`` checks it; ``check_kv_flow`` below checks the rest): every KV token loaded was stored
  on its tier (S >= b at every load), and every decode layer attends over exactly [0, b) loaded + [b, N_ctx + 1)
  recomputed.

Weight loader (TightLLM's second method; docs/cost-model.md §8): the offloaded bytes of a layer are cut into b_n slices (host part and disk part each split
in b_n), and slice s rides on batch s of the previous layer (issued with that batch's compute), so each batch's
compute hides 1/b_n of the next layer instead of batch 0 hiding all of it. The distributor sees, for batch k, the
slice that batch carries: with b_n < num_gpu_batches the front batches carry the weights and recompute more, the
later ones less (``weight_slices``). ``weight_loader=False`` (the ablation) loads the whole next layer with batch 0,
as FlexGen does; ``kv_distributor=False`` sets N_r = 0 everywhere. Each flag changes only its own ops.

Memory (sizes from ``offsim.core.footprint``, as offexec holds them): streamed weights are double-buffered (a layer's
slices wait for the layer two back to be done; the first slice of a layer takes its whole weight slot); loaded KV is
double-buffered across positions, each position's off-GPU heads in full-length work buffers that its store (or, with
nothing to store, its compute) frees; disk reads stage into host memory one layer (weights) or one position (KV)
ahead of their copy, no further; a recompute's scratch is the op peak (``footprint.op_peak_bytes``) of (N_r + 1) ·
batch tokens, and N_r is capped so that it fits beside what is resident, the weight slots and two positions' KV
buffers (and, with activations on the GPU, N_r + 1 <= prompt length, the activation buffer reserved for the block).
Token ids of the block are resident on the GPU (``footprint.token_ids_bytes``).

Stream order (ops on one stream run in plan order): at each position the hidden state's load (activations on the CPU)
goes first, then what is already in host memory (the next position's KV, this batch's weight slice), then what must
come from disk, so a copy waiting for the disk never holds up one that could run.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Iterable

from offsim.core.costmodel import (GRAPH_MAX_Q_TOKENS, capture_extra_seconds, graphed, new_q_capture_seconds,
                                   op_table)
from offsim.core.errors import OffsimError
from offsim.policies.tightllm.kv_distributor import SOLVERS, TRANSFER_MODELS, Decision, KVDistributorWarning, distributor, kv_load_bytes
from offsim.core.plan import Plan, PlanBuilder
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload, check_positions
from offsim.policies.base import (Candidate, Policy, capacity_of, check_field_types, compression_of,
                                  kv_split_from_percent, weight_split_from_percent)
from offsim.policies.flexgen import FlexGenSettings, fit_gpu_weights
from offsim.policies.lp import flexgen_candidates
from offsim.core import footprint as fp
from offsim.policies.schedule import (DiskStoreBuffers, LandingBuffers, Schedule, balanced_stages, check_stages_fit,
                                     layer_devices, micro_batch_groups, resident_bytes, stage_model,
                                     stage_resident_bytes)


@dataclass(frozen=True)
class TightLLMSettings:
    """TightLLM's knobs. ``percent``: placement as FlexGen's six numbers (weights GPU/CPU, KV cache GPU/CPU,
    activations GPU/CPU; the rest of each pair on disk). ``kv_distributor`` / ``weight_loader``: the two components
    (CLI ``--no-kv-distributor`` / ``--no-weight-loader`` for the ablations). ``weight_slices``: b_n, slices per
    layer (0: one per GPU batch). ``kv_solver``: 'ilp' (cvxpy + HiGHS MILP) or 'exact' (the certified fast path;
    same answers). ``transfer_model``: 'streams' (disk and PCIe overlap) or 'serial' (the paper's sum).
    ``max_recompute_tokens``: cap on N_r (None: GPU memory is the only cap). ``pin_weights``: pinned host buffers.
    ``capture_aware``: choose each batch's N_r over the whole run, pricing the CUDA-graph captures a new N_r costs
    (``hold_for_captures``); False: every step's N_r alone, as Algorithm 1 does. The same where the hardware
    profile has no capture rows (presets). ``hold_recompute``: each GPU batch recomputes the same N_r at every
    decode step, the smallest Algorithm 1 chose for it over the run (``hold_recompute_tokens``): one recompute shape
    per batch, which CUDA graphs can serve at every step; a smaller N_r is always feasible (the KV it no longer
    recomputes is loaded into buffers sized for the whole context), and on the H200 profile it costs OPT-30B's
    512/32 plan 0.25 % of its predicted decode rate (N_r 251-257 held at 251). ``graph_recompute`` (with
    ``hold_recompute``): offexec replays every recompute op as a CUDA graph, not only those of at most
    ``costmodel.GRAPH_MAX_Q_TOKENS`` query tokens (the plan's ``graph_max_q_tokens`` raised to its longest), attending
    over the rows written so far (``graph_attention`` 'written_rows'): one launch per (layer, batch, step) instead of a
    few dozen, for the graphs' static tensors and one op's intermediates in their pool, which N_r's memory cap counts
    (``recompute_memory_cap``)."""

    percent: tuple[int, int, int, int, int, int] = (100, 0, 100, 0, 100, 0)
    kv_distributor: bool = True
    weight_loader: bool = True
    weight_slices: int = 0
    kv_solver: str = "ilp"
    transfer_model: str = "streams"
    max_recompute_tokens: int | None = None
    pin_weights: bool = True
    # FlexGen's approximations (``specs.Compression``): a compressed cache is cheaper to load, so the KV
    # distributor recomputes less; the recomputed tokens' KV is fresh fp16 (no dequantize)
    compress_weight: bool = False
    compress_cache: bool = False
    sparse_attention: float = 1.0
    capture_aware: bool = True
    hold_recompute: bool = False
    graph_recompute: bool = False
    # pipeline parallelism (issue 18), as FlexGen's (``FlexGenSettings``): ``num_stages`` contiguous stages of
    # layers, one GPU each with the hardware's budget, the percentages applying within every stage; ``stage_layers``
    # layers per stage (default balanced); ``micro_batches`` groups of GPU batches flowing through the stages (0:
    # num_stages, at most num_gpu_batches). One host. N_r is one per (step, GPU batch) on every stage: each stage
    # holds the same per-layer placement, so the distributor's per-layer problem is the same on every GPU
    num_stages: int = 1
    stage_layers: tuple = ()
    micro_batches: int = 0

    def __post_init__(self):
        check_field_types(self, "tightllm")
        # same placement and pipeline rules and messages as FlexGen
        FlexGenSettings(percent=tuple(self.percent), num_stages=self.num_stages, stage_layers=self.stage_layers,
                        micro_batches=self.micro_batches)
        compression_of(self)
        object.__setattr__(self, "percent", tuple(self.percent))
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if self.kv_solver not in SOLVERS:
            raise OffsimError(f"tightllm kv_solver must be one of {SOLVERS}, got {self.kv_solver!r}")
        if self.transfer_model not in TRANSFER_MODELS:
            raise OffsimError(f"tightllm transfer_model must be one of {TRANSFER_MODELS}, got "
                              f"{self.transfer_model!r}")
        if isinstance(self.weight_slices, bool) or not isinstance(self.weight_slices, int) or self.weight_slices < 0:
            raise OffsimError(f"tightllm weight_slices must be an integer >= 0 (0: one per GPU batch), got "
                              f"{self.weight_slices!r}")
        if self.graph_recompute and not self.hold_recompute:
            raise OffsimError("tightllm graph_recompute needs hold_recompute=true (one N_r per GPU batch: one graph "
                              "per layer and batch, captured once; an N_r that changes by step would capture anew)")
        if self.max_recompute_tokens is not None and (not isinstance(self.max_recompute_tokens, int)
                                                      or self.max_recompute_tokens < 0):
            raise OffsimError(f"tightllm max_recompute_tokens must be None or an integer >= 0, got "
                              f"{self.max_recompute_tokens!r}")


# ----------------------------------------------------------------------------------------------------------------
# the decisions (Algorithm 1, lines "estimate the mean sequence length ... solve for N_r")
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Placement and slicing of one plan, in bytes and heads."""

    weight_gpu: int  # bytes of each layer's flat weights on the GPU ([0, weight_gpu))
    weight_cpu: int  # then in host memory
    weight_disk: int  # then on disk
    kv_gpu_heads: int
    kv_cpu_heads: int
    kv_disk_heads: int
    hidden_home: str
    num_slices: int  # b_n
    # slice s: ((cpu_lo, cpu_hi), (disk_lo, disk_hi)) byte ranges of the layer's flat buffer
    slices: tuple[tuple[tuple[int, int], tuple[int, int]], ...]

    @property
    def weight_offloaded(self) -> int:
        return self.weight_cpu + self.weight_disk


def layout_of(model: ModelSpec, wl: Workload, st: TightLLMSettings) -> Layout:
    """Where everything lives, and the weight loader's slices (element-aligned, host and disk parts split alike)."""
    wg, wc, cg, cc, ag, ac = st.percent
    g, c = weight_split_from_percent(model, wg, wc)
    W, e = model.layer_weight_bytes(), model.dtype_bytes
    d = W - g - c
    kg, kc = kv_split_from_percent(model, cg, cc)
    nb = min(len(g) for g in batch_groups(wl, st))  # the GPU batches that share one load of a layer
    b_n = (st.weight_slices or nb) if st.weight_loader else 1
    if b_n > nb:
        raise OffsimError(f"tightllm weight_slices = {b_n} exceeds the {nb} GPU batches that share a layer: each "
                          f"slice rides on one batch (valid: 0..{nb}, 0 = {nb})")

    def cut(lo: int, nbytes: int, s: int) -> tuple[int, int]:
        el = nbytes // e
        return lo + e * (el * s // b_n), lo + e * (el * (s + 1) // b_n)

    slices = tuple((cut(g, c, s), cut(g + c, d, s)) for s in range(b_n))
    return Layout(g, c, d, kg, kc, model.num_kv_heads - kg - kc, "gpu" if ag >= ac else "cpu", b_n, slices)


def stages_of(model: ModelSpec, st: TightLLMSettings) -> tuple[tuple[int, int], ...]:
    """The pipeline's stages, each [lo, hi) of the decoder layers (one stage: all of them)."""
    return balanced_stages(model.num_layers, st.num_stages, st.stage_layers) if st.num_stages > 1 else \
        ((0, model.num_layers),)


def batch_groups(wl: Workload, st: TightLLMSettings) -> list[range]:
    """The block's GPU batches in the micro-batch groups that flow through a pipeline's stages together (a stage
    loads each of its layers once per group); one group without stages."""
    nb = wl.num_gpu_batches
    G = (st.micro_batches or min(st.num_stages, nb)) if st.num_stages > 1 else 1
    if G > nb:
        raise OffsimError(f"micro_batches {G} exceeds the block's {nb} GPU batches")
    return micro_batch_groups(nb, G)


def kv_work_buffers_bytes(model: ModelSpec, wl: Workload, lay: Layout, comp: Compression = NO_COMPRESSION) -> int:
    """One position's full-length KV work buffers of the off-GPU head groups (``footprint.kv_buffer_bytes``, at
    their stored size)."""
    return sum(fp.stored_kv_bytes(model, wl.gpu_batch_size, wl.max_len, h, comp=comp)
               for h in (lay.kv_cpu_heads, lay.kv_disk_heads))


def kv_distributor_of(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings):
    """The KV distributor a plan of these settings asks (``kv_distributor.distributor``, shared and memoised): its
    transfer model and compression, the workload's padded-batch masking and KV buffer length."""
    return distributor(model, hw, st.transfer_model, compression_of(st), wl.padded, wl.max_len)


def recompute_memory_cap(model: ModelSpec, wl: Workload, lay: Layout, free_gpu_bytes: int, ctx_tokens: int,
                         comp: Compression = NO_COMPRESSION, graph_all: bool = False) -> int:
    """The largest N_r whose decode step fits: the op peak of a layer over (N_r + 1)·batch tokens at a context of
    N_ctx + 1 (``footprint.op_peak_bytes``), with activations on the host the copy of its input, and two positions'
    KV work buffers (this one's and the next one's, loaded ahead; full length, so independent of N_r), with
    compression the op's fp16 working copies, and where offexec replays the N_r + 1 token op as a CUDA graph
    (``costmodel.GRAPH_MAX_Q_TOKENS``) what its graphs hold beyond the one-token graphs the placement already counts
    (``footprint.decode_graph_bytes``). ``graph_all`` (``TightLLMSettings.graph_recompute``): every recompute op a
    graph over the written rows, whatever N_r: the op's intermediates in the graphs' pool (at least the op peak,
    ``footprint.graph_pool_bytes``) beside their static tensors, each GPU batch's hidden state among them
    (``footprint.graph_static_bytes``). -1 if not even N_r = 0 fits (the plan will then fail validation with the
    shortfall)."""
    gbs = wl.gpu_batch_size
    groups = sum(1 for h in (lay.kv_gpu_heads, lay.kv_cpu_heads, lay.kv_disk_heads) if h)
    bufs = 2 * kv_work_buffers_bytes(model, wl, lay, comp) + fp.dequantized_copy_bytes(model, gbs, wl.max_len,
                                                                                        comp, False) + \
        fp.sparse_attention_bytes(model, gbs, wl.max_len, comp)
    graphs_1 = fp.decode_graph_bytes(model, wl, 1)

    def need(n: int) -> int:
        # (activations parked on the host: this op's landed input and the next batch's, loaded during it)
        hin = fp.LANDING_BUFFERS * fp.hidden_bytes(model, gbs, n + 1) if lay.hidden_home == "cpu" else 0
        # (at most the longest graphed op's: a plan whose N_r varies by step may hold those graphs too; monotone)
        peak = fp.op_peak_bytes(model, "layer", gbs, n + 1, ctx_tokens + 1, groups, masked=wl.key_masked)
        if graph_all:  # the pool holds the op's intermediates (replayed, never eager): the larger of the two
            # Beside the graphs, as offexec's pre-check counts them (executor.gpu_need): the recompute's embedding,
            # eager (its transient beyond its output: footprint.op_transient_bytes), and, with activations on the
            # GPU, one GPU batch's layer output beside the block's hidden states (the values' peak, at the
            # prefill's length or the recompute's, whichever is longer)
            embed = fp.op_transient_bytes(model, "embed", gbs, n + 1, ctx_tokens + 1, groups)
            out = fp.hidden_bytes(model, gbs, max(wl.prompt_len, n + 1)) if lay.hidden_home == "gpu" else 0
            return max(peak, fp.graph_pool_bytes(model, wl, n + 1)) + hin + bufs - graphs_1 \
                + fp.graph_static_bytes(model, wl, n + 1, cpu_attention=False, homes=True) + embed + out
        graphs = fp.decode_graph_bytes(model, wl, min(n + 1, GRAPH_MAX_Q_TOKENS)) - graphs_1
        return peak + hin + bufs + graphs

    # need(n) grows with n: every term of the op peak is linear in the query tokens
    if need(0) > free_gpu_bytes:
        return -1
    lo, hi = 0, ctx_tokens + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= free_gpu_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def decision_for(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings, ctx_tokens: int,
                 batch_index: int, lay: Layout | None = None, free_gpu_bytes: int | None = None,
                 padded_ctx_tokens: int | None = None) -> Decision:
    """The KV distributor's problem for GPU batch ``batch_index`` at a decode step where ``ctx_tokens`` tokens have
    KV (Algorithm 1: the batch's *mean* sequence length, ``batch_ctx_tokens``): its KV placement, the weight slice it
    carries, and the caps on N_r (the user's, GPU memory, and with activations on the GPU the prompt-sized
    activation buffer). GPU memory is capped at the context the ops really run at, ``padded_ctx_tokens`` (the
    batch padded to its longest prompt; default ``ctx_tokens``, as for uniform prompts)."""
    lay = lay or layout_of(model, wl, st)
    if free_gpu_bytes is None:
        free_gpu_bytes = free_gpu_bytes_of(model, hw, wl, lay, compression_of(st), stages_of(model, st))
    comp = compression_of(st)
    mem_hi = recompute_memory_cap(model, wl, lay, free_gpu_bytes,
                                  ctx_tokens if padded_ctx_tokens is None else padded_ctx_tokens, comp,
                                  st.graph_recompute)
    if lay.hidden_home == "gpu":
        # the block's activations between layers live in the buffer reserved for the prompt (``resident``): the
        # N_r + 1 recomputed-plus-new tokens of every sequence must fit in it
        mem_hi = min(mem_hi, wl.prompt_len - 1)
    # the slice the batch carries: the n-th batch of its micro-batch group carries slice n (one group: batch n)
    n = batch_index - next(g[0] for g in batch_groups(wl, st) if batch_index in g)
    if n < lay.num_slices:
        (c_lo, c_hi), (d_lo, d_hi) = lay.slices[n]
        w_cpu, w_disk = fp.stored_weight_bytes(model, c_lo, c_hi, comp), fp.stored_weight_bytes(model, d_lo, d_hi, comp)
    else:
        w_cpu = w_disk = 0
    hi = None if st.max_recompute_tokens is None else min(st.max_recompute_tokens, ctx_tokens)
    return Decision(num_seqs=wl.gpu_batch_size, ctx_tokens=ctx_tokens, kv_cpu_heads=lay.kv_cpu_heads,
                    kv_disk_heads=lay.kv_disk_heads, weight_cpu_bytes=w_cpu, weight_disk_bytes=w_disk, lo=0, hi=hi,
                    mem_hi=mem_hi, pinned=st.pin_weights, hidden_offloaded=lay.hidden_home == "cpu",
                    hidden_serial=lay.hidden_home == "cpu" and wl.num_gpu_batches == 1)


def batch_ctx_tokens(wl: Workload, step: int, k: int) -> tuple[int, int]:
    """(estimated, padded) N_ctx of GPU batch k at decode step ``step``: tokens that have KV before the step, at
    the batch's mean prompt length rounded to a token (Algorithm 1: "estimate the batch's mean sequence length"), and
    at the length its ops run at, its longest prompt. The same for uniform prompts."""
    return wl.batch_mean_prompt_len(k) + step - 1, wl.batch_prompt_lens[k] + step - 1


def recompute_tokens(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings,
                     lay: Layout | None = None, free_gpu_bytes: int | None = None) -> list[list[int]]:
    """N_r[i][k] for decode steps i = 1 .. gen_len - 1 (index 0: prefill, all 0) and GPU batches k."""
    lay = lay or layout_of(model, wl, st)
    nb = wl.num_gpu_batches
    table = [[0] * nb for _ in range(wl.gen_len)]
    if not st.kv_distributor or lay.kv_cpu_heads + lay.kv_disk_heads == 0:
        return table  # nothing is loaded, so nothing to trade
    if free_gpu_bytes is None:
        free_gpu_bytes = free_gpu_bytes_of(model, hw, wl, lay, compression_of(st), stages_of(model, st))
    kvd = kv_distributor_of(model, hw, wl, st)
    decisions: dict[tuple[int, int], Decision] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KVDistributorWarning)
        for i in range(1, wl.gen_len):
            for k in range(nb):
                est, padded = batch_ctx_tokens(wl, i, k)
                d = decisions[i, k] = decision_for(model, hw, wl, st, est, k, lay, free_gpu_bytes, padded)
                table[i][k] = kvd.decide(d, st.kv_solver)
    if st.hold_recompute:
        table = hold_recompute_tokens(table)
    elif st.capture_aware:
        table = hold_for_captures(model, hw, wl, kvd, decisions, table)
    fell = [w for w in caught if issubclass(w.category, KVDistributorWarning)]
    for w in caught:
        if not issubclass(w.category, KVDistributorWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if fell:  # one warning per plan, not one per decision
        warnings.warn(f"tightllm: {len(fell)} KV-distributor decision(s) of this plan fell back to N_r = 0; the first: "
                      f"{fell[0].message}", KVDistributorWarning, stacklevel=2)
    return table


def hold_recompute_tokens(table: list[list[int]]) -> list[list[int]]:
    """``TightLLMSettings.hold_recompute``: each GPU batch's N_r at every decode step (rows 1 ..) set to the smallest
    Algorithm 1 chose for that batch over the run; row 0 (prefill) stays 0."""
    if len(table) < 2:
        return table
    held = [min(row[k] for row in table[1:]) for k in range(len(table[0]))]
    return [table[0][:]] + [held[:] for _ in table[1:]]


def capture_seconds(model: ModelSpec, hw: HardwareSpec, wl: Workload, n: int) -> float:
    """What a GPU batch pays, once, the first time the run recomputes ``n`` tokens (q = n + 1 query tokens): offexec
    captures every decoder layer's op at that q as a CUDA graph, priced as the simulator prices it
    (``sim._capture_extras``: the profile's 'capture' rows beyond a replay, per layer, plus the 'new_q' row of a
    query count's first op). 0 where the op runs eagerly (``costmodel.graphed``) or the profile has no capture
    rows (presets)."""
    q = n + 1
    if not graphed("compute", "layer", q, "decode") or op_table(hw, model, "capture", "first") is None:
        return 0.0
    rows = wl.gpu_batch_size * q
    return (model.num_layers * capture_extra_seconds(model, hw, "layer", rows, False, q_tokens=q)
            + new_q_capture_seconds(model, hw, "layer", rows))


def hold_for_captures(model: ModelSpec, hw: HardwareSpec, wl: Workload, kvd, decisions: dict,
                      table: list[list[int]]) -> list[list[int]]:
    """Each GPU batch's N_r over the run, priced with the captures a change costs. Algorithm 1 decides every step
    alone, but in offexec a step whose N_r differs from the previous one replays no graph it has: every layer's
    recompute op is captured anew (``capture_seconds``, ~1 ms a layer on the H200), which pays only if the new N_r
    saves more than that over the steps it holds. Per batch, a shortest path over the steps: at step i the
    candidates are Algorithm 1's N_r and every feasible N_r whose op is graphed; a step costs the layers' time at
    that N_r (``num_layers`` x the distributor's per-layer objective), a change of N_r adds the new value's
    captures (charged again when a value comes back: an upper bound). Ties keep Algorithm 1's choice. Without
    capture rows in the profile every change is free and the table comes back as it was."""
    cap = {n: capture_seconds(model, hw, wl, n) for n in range(GRAPH_MAX_Q_TOKENS)}
    if not any(cap.values()):
        return table
    out = [row[:] for row in table]
    L = model.num_layers
    for k in range(wl.num_gpu_batches):
        best: dict[int, tuple[float, tuple[int, ...]]] = {}  # N_r at the step -> (seconds so far, path)
        for i in range(1, wl.gen_len):
            d, own = decisions[i, k], table[i][k]
            lo, hi = kvd.feasible_bounds(d)
            cands = {own} | (set(range(lo, min(hi, GRAPH_MAX_Q_TOKENS - 1) + 1)) if lo is not None else set())
            step = {n: L * kvd.objective(d, n) for n in cands}
            new = {}
            for n in sorted(cands, key=lambda x: (x != own, x)):  # Algorithm 1's N_r first: it wins ties
                if not best:
                    new[n] = (step[n] + cap.get(n, 0.0), (n,))
                    continue
                v, path = min(((v + (0.0 if m == n else cap.get(n, 0.0)), p) for m, (v, p) in best.items()),
                              key=lambda x: x[0])
                new[n] = (v + step[n], path + (n,))
            best = new
        path = min(best.values(), key=lambda x: x[0])[1]
        for i, n in enumerate(path, start=1):
            out[i][k] = n
    return out


def _schedule_of(model: ModelSpec, lay: Layout, st: TightLLMSettings) -> Schedule:
    stages = stages_of(model, st) if st.num_stages > 1 else ()
    return Schedule(policy="tightllm", weight_split=((lay.weight_gpu, lay.weight_cpu),) * model.num_layers,
                    kv_split=(lay.kv_gpu_heads, lay.kv_cpu_heads), hidden_home=lay.hidden_home,
                    pinned=st.pin_weights, compression=compression_of(st), stages=stages)


def _resident(model: ModelSpec, wl: Workload, lay: Layout, st: TightLLMSettings) -> dict[str, int]:
    """Resident bytes per tier (``footprint.resident_bytes``; token ids included)."""
    return resident_bytes(model, wl, _schedule_of(model, lay, st))


def free_gpu_bytes_of(model: ModelSpec, hw: HardwareSpec, wl: Workload, lay: Layout,
                      comp: Compression = NO_COMPRESSION, stages: tuple = ()) -> int:
    """GPU bytes left for one position's scratch and KV buffers: capacity minus what is resident and the two
    streamed-weight slots (``footprint.stored_slot_bytes``), at their stored size with compression ``comp``. With
    ``stages`` (``stages_of``; several: a pipeline): on the GPU with the least left, each holding its own layers and,
    but for the last, the hidden states it has sent and not yet seen received (``footprint.p2p_send_bytes``)."""
    slot = fp.stored_slot_bytes(model, lay.weight_gpu, None, comp) if lay.weight_offloaded else 0
    one = TightLLMSettings(**comp.settings())  # (placement comes from lay)
    left = []
    for d, (lo, hi) in enumerate(stages or ((0, model.num_layers),)):
        res = _resident(stage_model(model, lo, hi), wl, lay, one)["gpu"]
        sends = fp.p2p_send_bytes(model, wl) if d < len(stages) - 1 else 0
        left.append(int(hw.gpu_mem_bytes) - res - 2 * slot - sends)
    return min(left)




# ----------------------------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------------------------
def tightllm_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings) -> Plan:
    """Algorithm 1: the whole block's plan (all steps, layers, batches). With stages (``num_stages`` > 1), a
    pipeline as FlexGen's: stage d's layers on GPU d (stage 0 also the embedding, the last the head), every op with
    its ``device``, the hidden states of a batch's q tokens sent on to the next stage and each new token's id back
    to the first (``p2p`` ops), the batches flowing through the stages in micro-batch groups; each GPU streams its
    own layers' weights over its own link (once per group) and loads its own layers' KV."""
    check_positions(model, wl)
    lay = layout_of(model, wl, st)
    stages = stages_of(model, st)
    S = len(stages)
    multi = S > 1
    if multi and lay.hidden_home != "gpu":
        raise OffsimError("tightllm with stages keeps the activations on the GPU: give percent's activations as "
                          "100 0 (a stage sends its last layer's output on from the GPU)")
    groups = batch_groups(wl, st)
    nr = recompute_tokens(model, hw, wl, st, lay)
    L, gbs = model.num_layers, wl.gpu_batch_size
    P_of = wl.batch_prompt_lens  # each GPU batch's prompt length (padded to its longest prompt)
    kg, kc, kd = lay.kv_gpu_heads, lay.kv_cpu_heads, lay.kv_disk_heads
    n_kv = model.num_kv_heads
    off = lay.weight_offloaded
    cz = compression_of(st)  # every stored weight / KV byte below is its stored size (4-bit with compression)
    slot = fp.stored_slot_bytes(model, lay.weight_gpu, None, cz) if off else 0  # GPU bytes of one streamed layer
    W = model.layer_weight_bytes()
    straddle = slot - fp.stored_weight_bytes(model, lay.weight_gpu, W, cz) if off else 0
    buf = {"cpu": fp.stored_kv_bytes(model, gbs, wl.max_len, kc, comp=cz),
           "disk": fp.stored_kv_bytes(model, gbs, wl.max_len, kd, comp=cz)}
    dq = fp.dequantized_copy_bytes(model, gbs, wl.max_len, cz, False) + \
        fp.sparse_attention_bytes(model, gbs, wl.max_len, cz)  # a decoder compute's fp16 copies, top-k temporaries
    kv_groups = sum(1 for h in (kg, kc, kd) if h)
    pinned = st.pin_weights
    b = PlanBuilder()
    if multi:  # every op of a pipeline names its GPU (the default: the GPU whose position is being emitted)
        cur_dev = [0]

        def add(kind, deps, phase, step, layer, batch, **kw):
            kw.setdefault("device", cur_dev[0])
            return b.add(kind, deps, phase, step, layer, batch, **kw)
    else:
        add = b.add
    dev_of = layer_devices(stages, L)  # layer -> its stage's GPU
    group_of = {k: t for t, g in enumerate(groups) for k in g}

    def kvb(heads: int, tokens: int) -> int:  # a KV load for GPU attention (the stored KV, sparse too)
        return kv_load_bytes(model, gbs, heads, tokens, cz)

    def kv_stored(heads: int, tokens: int) -> int:  # KV as stored: a store, a disk read
        return fp.stored_kv_bytes(model, gbs, tokens, heads, comp=cz)

    def w_bytes(lo: int, hi: int) -> int:
        return fp.stored_weight_bytes(model, lo, hi, cz)

    def boundary(i: int, k: int) -> int:
        """b(i, k): tokens [0, b) of decode step i are loaded, the rest recomputed."""
        return P_of[k] + i - 1 - nr[i][k]

    def store_target(i: int, k: int) -> int:
        """After step i (0 = prefill), KV must be stored up to the next step's boundary; after the last, nothing."""
        return boundary(i + 1, k) if i + 1 < wl.gen_len else 0

    # --- streamed weights: per GPU, instances (step, group, layer) of its layers, each loaded in slices during the
    #     previous instance (one group, one GPU: an instance per (step, layer), as the paper's loader) --------------
    instances = [[(i, t, j) for i in range(wl.gen_len) for t in range(len(groups)) for j in range(lo, hi)]
                 if off else [] for lo, hi in stages]
    inst_index = {ij: (d, u) for d in range(S) for u, ij in enumerate(instances[d])}
    loaded: dict[tuple, list[int]] = {}  # instance (GPU, index) -> its h2d ops (all slices)
    free_op: dict[tuple, int] = {}  # instance -> last compute that used it (frees the buffer)

    def issue_slice(d: int, u: int, s: int, part: str) -> None:
        """Slice s of GPU d's instance u: its host-memory bytes (``part='cpu'``: one h2d) or its disk bytes
        (``'disk'``: a disk read into host staging, then an h2d). The h2d waits for its GPU buffer (double
        buffering: the instance two back must be done); the disk read for its host staging buffer, one instance
        earlier, so the read runs ahead of the copy by one layer but no further (a plan is static: without that
        dependency the disk stream would read every layer of every step into host memory as fast as it can)."""
        if u >= len(instances[d]):
            return
        i, _, j = instances[d][u]
        phase = "prefill" if i == 0 else "decode"
        dep = free_op.get((d, u - 2))
        stage_dep = free_op.get((d, u - 3))
        (c_lo, c_hi), (d_lo, d_hi) = lay.slices[s]
        ids = loaded.setdefault((d, u), [])
        first = straddle if not ids else 0  # the instance's first load takes its whole weight slot
        dev = {"device": d} if multi else {}
        if part == "cpu" and c_hi > c_lo:
            nbytes = w_bytes(c_lo, c_hi)
            ids.append(add("h2d", [dep], phase, i, j, s, tensor="weight", lo=c_lo, hi=c_hi, nbytes=nbytes,
                           pinned=pinned, alloc=(nbytes + first, 0, 0), **dev))
        if part == "disk" and d_hi > d_lo:
            nbytes = w_bytes(d_lo, d_hi)
            first = straddle if not ids else 0
            rd = add("disk_read", [stage_dep], phase, i, j, s, tensor="weight", lo=d_lo, hi=d_hi, nbytes=nbytes,
                     alloc=(0, nbytes, 0), **dev)
            ids.append(add("h2d", [rd, dep], phase, i, j, s, tensor="weight", lo=d_lo, hi=d_hi, nbytes=nbytes,
                           pinned=pinned, alloc=(nbytes + first, 0, 0), free=(0, nbytes, 0), **dev))

    # --- KV ----------------------------------------------------------------------------------------------------
    # positions (step, layer, batch): per step, each micro-batch group through every stage in turn (one stage, one
    # group: every layer of [embedding, decoder layers, head] over all batches, as the paper's loop)
    positions = [(i, j, k) for i in range(wl.gen_len) for grp in groups for d, (lo, hi) in enumerate(stages)
                 for j in ([-1] if d == 0 else []) + list(range(lo, hi)) + ([L] if d == S - 1 else []) for k in grp]
    # per GPU, its positions in order: the KV work buffers, double-buffered, are reused by a GPU's positions two apart
    on_dev: list[list[int]] = [[] for _ in range(S)]
    nth: list[int] = []  # position -> its index among its GPU's positions
    for p, (_, j, _) in enumerate(positions):
        d = dev_of[j]
        nth.append(len(on_dev[d]))
        on_dev[d].append(p)

    def dev_pos(p: int, back: int) -> int | None:
        """The position ``back`` before position p on p's GPU (None: none), or with ``back`` -1 the next one."""
        n, mine = nth[p] - back, on_dev[dev_of[positions[p][1]]]
        return mine[n] if 0 <= n < len(mine) else None

    computes: dict[int, int] = {}  # position -> its compute
    # per position, the ops that give its KV work buffers back: the stores (their last user) or, with nothing to
    # store, the compute. A buffer two positions on (on its GPU) waits for them (double buffering, as the footprint
    # counts two)
    releases: dict[int, list[int]] = {}
    pending_loads: dict[int, tuple[list[int], set]] = {}  # position -> (h2d ops, head groups whose buffer they made)
    stored_upto: dict[tuple[int, int], int] = {}  # (layer, batch) -> S: KV tokens [0, S) stored off the GPU
    store_ops: dict[tuple[int, int], list[int]] = {}  # (layer, batch) -> the latest ops that extended S
    disk_stores = [DiskStoreBuffers() for _ in range(S)]  # KV stored to disk: bounded GPU and host staging, per GPU

    def emit_kv_loads(p: int | None, part: str) -> None:
        """The KV prefix [0, b) of position p: the host-homed heads (``part='cpu'``: one h2d) or the disk-homed
        heads (``'disk'``: a disk read into host staging, then an h2d). The h2d waits for its GPU buffer (the compute
        two positions back on its GPU: double buffering), the disk read for its host staging (the compute three
        positions back: it runs one position ahead of the copy, no further); every op waits for the stores that made
        the prefix durable."""
        if p is None:
            return
        i, j, k = positions[p]
        if i == 0 or not 0 <= j < L:
            return
        hi = boundary(i, k)
        ids, held = pending_loads.setdefault(p, ([], set()))
        if hi <= 0:
            return
        back2 = dev_pos(p, 2)
        buf_dep = releases[back2] if back2 is not None else []
        back3 = dev_pos(p, 3)
        stage = computes.get(back3) if back3 is not None else None
        durable = store_ops.get((j, k), [])
        dev = {"device": dev_of[j]} if multi else {}
        if part == "cpu" and kc:
            nbytes = kvb(kc, hi)
            ids.append(add("h2d", buf_dep + durable, "decode", i, j, k, tensor="kv", lo=0, hi=hi, head_lo=kg,
                           head_hi=kg + kc, nbytes=nbytes, pinned=pinned, alloc=(buf["cpu"], 0, 0), **dev))
            held.add("cpu")
        if part == "disk" and kd:
            nbytes = kv_stored(kd, hi)
            rd = add("disk_read", [stage] + durable, "decode", i, j, k, tensor="kv", lo=0, hi=hi, head_lo=kg + kc,
                     head_hi=n_kv, nbytes=nbytes, alloc=(0, nbytes, 0), **dev)
            ids.append(add("h2d", [rd] + buf_dep, "decode", i, j, k, tensor="kv", lo=0, hi=hi, head_lo=kg + kc,
                           head_hi=n_kv, nbytes=kvb(kd, hi), pinned=pinned, alloc=(buf["disk"], 0, 0),
                           free=(0, nbytes, 0), **dev))
            held.add("disk")

    last_out: dict[int, int] = {}
    last_dev: dict[int, int] = {}  # batch -> the GPU that holds its current hidden state (or its new token id)
    hidden_store: dict[int, int] = {}
    landings = LandingBuffers()
    for d in range(S):  # each GPU's first layer's weights, all slices, before anything runs
        if instances[d]:
            for s in range(lay.num_slices):
                issue_slice(d, 0, s, "cpu")
                issue_slice(d, 0, s, "disk")
    for p, (i, j, k) in enumerate(positions):
        phase = "prefill" if i == 0 else "decode"
        P = P_of[k]
        q = P if i == 0 else nr[i][k] + 1
        ctx = P + i
        decoder = 0 <= j < L
        dev = dev_of[j]
        grp = groups[group_of[k]]
        u = inst_index.get((i, group_of[k], j)) if decoder else None
        deps = [last_out.get(k)]
        recv = 0  # GPU bytes of a hidden state received from the previous stage: counted while this compute runs
        if multi:
            cur_dev[0] = dev
            src = last_dev.get(k)
            if src is not None and src != dev:
                # the batch's activations (or, for the next step's embedding, its new token's id) are on another
                # GPU: a GPU-to-GPU copy on the sender's p2p stream
                if j < 0:
                    deps = [add("p2p", [last_out[k]], phase, i, j, k, tensor="token", lo=ctx - 1, hi=ctx,
                                nbytes=gbs * fp.TOKEN_ID_BYTES, device=src, peer=dev)]
                else:
                    recv = fp.hidden_bytes(model, gbs, q)
                    deps = [add("p2p", [last_out[k]], phase, i, j, k, tensor="hidden", lo=ctx - q, hi=ctx,
                                nbytes=recv, device=src, peer=dev)]
            last_dev[k] = dev
        # (1) hidden from the CPU, if parked there: first on the h2d stream, because this compute needs it now
        #     (behind the next layer's weights it would serialise compute and transfer)
        hin = 0  # GPU bytes of the hidden copy loaded for this compute: counted from its load to the compute's end
        if lay.hidden_home == "cpu" and k in hidden_store and j >= 0:
            hin = fp.hidden_bytes(model, gbs, q)
            # (at most fp.LANDING_BUFFERS copies in flight, as offexec's landing pool: schedule.LandingBuffers)
            hl = add("h2d", [hidden_store.pop(k)] + landings.load_deps(), phase, i, j, k, tensor="hidden",
                     lo=ctx - q, hi=ctx, nbytes=hin, pinned=pinned, alloc=(hin, 0, 0))
            deps = [hl]
        # (2) prefetch the next position's KV prefix on this GPU (FlexGen: load_cache(k+1)) and (3) the weight
        #     loader's slice of the next streamed instance of this GPU, carried by the group's n-th batch. On the h2d
        #     stream (in order, like a CUDA stream) what is already in host memory goes first -- KV, then weights --
        #     and what must first come from disk last, so a copy waiting for the disk never holds up one that could
        #     run (head-of-line blocking)
        nxt = dev_pos(p, -1)
        n_in_grp = k - grp[0]
        carries = u is not None and n_in_grp < lay.num_slices
        emit_kv_loads(nxt, "cpu")
        if carries:
            issue_slice(dev, u[1] + 1, n_in_grp, "cpu")
        emit_kv_loads(nxt, "disk")
        if carries:
            issue_slice(dev, u[1] + 1, n_in_grp, "disk")
        if u is not None:
            deps += loaded[u]
        load_ids, loaded_groups = pending_loads.pop(p, ([], set()))
        deps += load_ids
        part = "layer" if decoder else ("embed" if j < 0 else "head")
        # (4) compute
        if decoder:
            S_ = stored_upto.get((j, k), 0)
            t = store_target(i, k)
            new_store = max(0, t - S_) if (kc or kd) else 0
            ws = fp.op_peak_bytes(model, "layer", gbs, q, ctx, kv_groups, masked=wl.key_masked) + dq
            last_k = k == grp[-1]
            w_free = slot if (last_k and u is not None) else 0
            if new_store and kd:
                deps += disk_stores[dev].compute_deps()
            # work buffers of off-GPU head groups: made by their load, else by this compute; freed by their store,
            # else (nothing to store) by this compute
            hgroups = [g for g, h in (("cpu", kc), ("disk", kd)) if h]
            made = sum(buf[g] for g in hgroups if g not in loaded_groups)
            back2 = dev_pos(p, 2)
            if made and back2 is not None:  # buffers this compute makes (prefill): not before two back gave theirs
                deps += releases[back2]
            unstored = sum(buf[g] for g in hgroups) if not new_store else 0
            comp = add("compute", deps, phase, i, j, k, part="layer", num_seqs=gbs, q_tokens=q, ctx_tokens=ctx,
                       frees_weights=last_k and u is not None, alloc=(ws + made + recv, 0, 0),
                       free=(ws + hin + recv + w_free + unstored, 0, 0))
            if last_k and u is not None:
                free_op[u] = comp
            # (5) store what a later step will load: tokens [S, t), all inside [ctx - q, ctx) computed just now
            rel = [comp]
            if new_store:
                ops = []
                if kc:
                    nbytes = kv_stored(kc, new_store)
                    ops.append(add("d2h", [comp], phase, i, j, k, tensor="kv", lo=S_, hi=t, head_lo=kg,
                                   head_hi=kg + kc, nbytes=nbytes, pinned=pinned, free=(buf["cpu"], 0, 0)))
                    rel = [ops[-1]]
                if kd:
                    nbytes = kv_stored(kd, new_store)
                    st_ = add("d2h", [comp] + disk_stores[dev].d2h_deps(), phase, i, j, k, tensor="kv", lo=S_, hi=t,
                              head_lo=kg + kc, head_hi=n_kv, nbytes=nbytes, pinned=pinned, alloc=(0, nbytes, 0),
                              free=(buf["disk"], 0, 0))
                    rel = rel[:1] if kc else []
                    rel.append(st_)
                    ops.append(add("disk_write", [st_], phase, i, j, k, tensor="kv", lo=S_, hi=t, head_lo=kg + kc,
                                   head_hi=n_kv, nbytes=nbytes, free=(0, nbytes, 0)))
                    disk_stores[dev].record(st_, ops[-1])
                stored_upto[(j, k)] = t
                store_ops[(j, k)] = ops
        else:
            ws = fp.op_peak_bytes(model, part, gbs, q, ctx, masked=wl.key_masked)
            comp = add("compute", deps, phase, i, j, k, part=part, num_seqs=gbs, q_tokens=q, ctx_tokens=ctx,
                       alloc=(ws + recv, 0, 0), free=(ws + hin + recv, 0, 0))
            rel = [comp]
        computes[p] = comp
        if hin:
            landings.record(comp)
        releases[p] = rel
        last_out[k] = comp
        # (6) park the hidden on the CPU between layers
        if lay.hidden_home == "cpu" and j < L:
            hidden_store[k] = add("d2h", [comp], phase, i, j, k, tensor="hidden", lo=ctx - q, hi=ctx,
                                  nbytes=fp.hidden_bytes(model, gbs, q), pinned=pinned)
    # the pipeline's settings and graph_recompute recorded only when set: a plan without them records what it
    # always did (and hashes the same)
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(st).items()
                if k not in _UNRECORDED_DEFAULTS or v != _UNRECORDED_DEFAULTS[k]}
    derived = {"weight_slices_used": lay.num_slices,
               "recompute_tokens": nr[1:]}  # N_r per decode step (1..gen_len-1), per GPU batch
    cap = capacity_of(hw)
    plan_stages = []
    if multi:  # every GPU has the budget ``capacity['gpu']``; the plan's gpu capacity and residents are the sums
        per = stage_resident_bytes(model, wl, _schedule_of(model, lay, st))
        plan_stages = [{"layers": [lo, hi], "gpu_capacity": int(cap["gpu"]), "gpu_resident": int(r["gpu"])}
                       for (lo, hi), r in zip(stages, per)]
        cap = {**cap, "gpu": int(cap["gpu"]) * S}
    # graph_recompute: every recompute op replayed from a graph over the written rows (one N_r per batch: held)
    graphing = {}
    if st.graph_recompute:
        longest = max((n + 1 for row in nr[1:] for n in row), default=1)
        graphing = {"graph_max_q_tokens": max(longest, GRAPH_MAX_Q_TOKENS), "graph_attention": "written_rows"}
    return Plan(model=model, workload=wl, policy="tightllm", settings=settings, capacity=cap,
                resident=_resident(model, wl, lay, st), weight_split=[(lay.weight_gpu, lay.weight_cpu)] * L,
                kv_split=(kg, kc), hidden_home=lay.hidden_home, ops=b.ops, derived=derived, stages=plan_stages,
                **graphing)


_STAGE_DEFAULTS = {"num_stages": 1, "stage_layers": (), "micro_batches": 0}
_UNRECORDED_DEFAULTS = {**_STAGE_DEFAULTS, "graph_recompute": False}


def check_tightllm_stages(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings,
                          what: str = "plan") -> None:
    """Every stage of a pipeline on one GPU's budget, the host's memory and disk shared by the stages
    (``check_stages_fit``), from arithmetic, before any op is built."""
    check_stages_fit(model, wl, _schedule_of(model, layout_of(model, wl, st), st), capacity_of(hw), what)


# ----------------------------------------------------------------------------------------------------------------
# checks beyond Plan.validate
# ----------------------------------------------------------------------------------------------------------------
def check_kv_flow(plan: Plan) -> None:
    """Raise OffsimError unless every GPU 'layer' compute of a decode step attends over exactly what it has:
    the KV h2d ops it depends on cover [0, ctx - q) for each off-GPU head range, and nothing else is loaded for it.
    (``Plan.validate`` checks that what is loaded was stored; this checks that what is attended was loaded.)"""
    kg, kc = plan.kv_split
    n_kv = plan.model.num_kv_heads
    ranges = [r for r in ((kg, kg + kc), (kg + kc, n_kv)) if r[1] > r[0]]
    ops = plan.ops
    for op in ops:
        if op.kind != "compute" or op.part != "layer" or op.step == 0 or not ranges:
            continue
        need = op.ctx_tokens - op.q_tokens
        got = {}
        for dep in op.deps:
            o = ops[dep]
            if o.kind == "h2d" and o.tensor == "kv":
                if (o.layer, o.batch, o.step) != (op.layer, op.batch, op.step):
                    raise OffsimError(f"{op.describe()}: depends on a KV load of another position ({o.describe()})")
                got[(o.head_lo, o.head_hi)] = (o.lo, o.hi)
        for r in ranges:
            have = got.get(r, (0, 0))
            if need and have != (0, need):
                raise OffsimError(f"{op.describe()}: attends over KV [0, {need}) of heads {r} but loads "
                                  f"[{have[0]}, {have[1]}) (recomputes the last {op.q_tokens - 1})")
            if not need and r in got:
                raise OffsimError(f"{op.describe()}: loads KV it recomputes")


# ----------------------------------------------------------------------------------------------------------------
# candidates for offsim.search.search
# ----------------------------------------------------------------------------------------------------------------
def estimate_seconds_per_token(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings) -> float:
    """A quick ranking score for the search (seconds per generated token, inf if it cannot fit): per layer and
    step, each batch costs the distributor's objective at the middle decode step; prefill costs, per batch, the
    larger of the prompt's compute, the weight slice and the KV store."""
    from offsim.core import costmodel as cm

    lay = layout_of(model, wl, st)
    # resident bytes and the minimum working set (prefill included) on every tier
    if not fp.fits(model, capacity_of(hw), wl, _schedule_of(model, lay, st).placement()):
        return math.inf
    free = free_gpu_bytes_of(model, hw, wl, lay, compression_of(st), stages_of(model, st))
    gbs, P = wl.gpu_batch_size, wl.prompt_len
    off_heads = lay.kv_cpu_heads + lay.kv_disk_heads
    cz = compression_of(st)
    kvd = kv_distributor_of(model, hw, wl, st)
    mid = P + wl.gen_len // 2 - 1
    pre = dec = 0.0
    for k in range(wl.num_gpu_batches):
        d = decision_for(model, hw, wl, st, mid, k, lay, free)
        if d.mem_hi is not None and d.mem_hi < 0:
            return math.inf
        n = kvd.decide(d, "exact") if (st.kv_distributor and off_heads) else 0
        dec += kvd.objective(d, n)
        t_w = sum(cm.transfer_seconds(hw, x, "h2d") for x in (d.weight_cpu_bytes, d.weight_disk_bytes) if x)
        t_st = cm.transfer_seconds(hw, kvb_all(model, gbs, off_heads, P - n, cz), "d2h") if off_heads else 0.0
        pre += max(cm.compute_seconds(model, hw, "layer", gbs, P, P, graphs=False, comp=cz, masked=wl.padded),
                   t_w + cm.disk_seconds(hw, d.weight_disk_bytes, "read"), t_st)
    return model.num_layers * (pre + (wl.gen_len - 1) * dec) / (wl.num_prompts * wl.gen_len)


def kvb_all(model: ModelSpec, gbs: int, heads: int, tokens: int, comp: Compression = NO_COMPRESSION) -> int:
    return fp.stored_kv_bytes(model, gbs, max(tokens, 0), heads, comp=comp)


def tightllm_placement(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: TightLLMSettings) -> fp.Placement:
    """What a TightLLM plan puts where (for ``footprint.check_fits`` before the plan is built)."""
    return _schedule_of(model, layout_of(model, wl, st), st).placement()


def _fits(model: ModelSpec, hw: HardwareSpec, wl: Workload, percent: tuple,
          comp: Compression = NO_COMPRESSION) -> bool:
    """Whether TightLLM's placement of ``percent`` fits every tier (``footprint.fits``)."""
    return fp.fits(model, capacity_of(hw), wl, tightllm_placement(model, hw, wl, TightLLMSettings(
        percent=percent, **comp.settings())))


def tightllm_stage_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, num_stages: int,
                              batch: int | None = None, compression: Compression = NO_COMPRESSION,
                              key_mask: bool = False, max_batch: int | None = None) -> list[Candidate]:
    """Pipeline candidates over ``num_stages`` GPUs of one host: FlexGen's (``flexgen.stage_candidates``: the LP of
    every block shape, stage split and micro-batch count) with GPU attention and the activations on the GPU, each
    made to fit TightLLM's own stages (``check_tightllm_stages``; its recompute needs more working memory than
    FlexGen's LP counts) two ways -- its GPU weight share trimmed, and its GPU share of the KV cache moved to the
    host first (which TightLLM can recompute instead of loading) -- in the LP's order (the search simulates the
    best)."""
    from offsim.policies.flexgen import stage_candidates

    extra = compression.settings() if compression.any else {}
    out, seen = [], set()
    for c in stage_candidates(model, hw, prompt_len, gen_len, num_stages, batch, compression, 0, key_mask,
                              max_batch):
        s, wl = c.settings, c.workload
        if s.get("cpu_attention") or s["percent"][4] != 100:
            continue
        pipe = {k: s[k] for k in _STAGE_DEFAULTS if k in s}

        def fits(p, wl=wl, pipe=pipe) -> bool:
            try:
                check_tightllm_stages(model, hw, wl, TightLLMSettings(percent=p, **pipe, **extra))
            except OffsimError:
                return False
            return True

        kv_first = tuple(s["percent"])
        while not fits(kv_first) and kv_first[2] > 0:  # the cache's GPU share to the host, a point at a time
            wg, wc, cg, cc = kv_first[:4]
            kv_first = (wg, wc, cg - 1, cc + 1) + kv_first[4:]
        for pct in (fit_gpu_weights(model, hw, wl, tuple(s["percent"]), False, fits=fits),
                    fit_gpu_weights(model, hw, wl, kv_first, False, fits=fits)):
            key = (pct, wl.gpu_batch_size, wl.num_gpu_batches, tuple(pipe.get("stage_layers", ())),
                   pipe.get("micro_batches"))
            if key in seen or not fits(pct):
                continue
            seen.add(key)
            out.append(Candidate({"percent": pct, **pipe, **extra}, wl, c.score_s_per_token))
    return out


def tightllm_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                        batch: int | None = None, max_shapes: int | None = None,
                        compression: Compression = NO_COMPRESSION, key_mask: bool = False,
                        max_batch: int | None = None, num_gpus: int = 1) -> Iterable[Candidate]:
    """Placements and block shapes for the search: FlexGen's LP optimum (GPU attention) for each block shape (same
    memory constraints; with ``batch`` sequences when given), its GPU weight share trimmed until TightLLM's own
    placement fits (``flexgen.fit_gpu_weights``: the LP's memory row is FlexGen's, a few tens of MB off TightLLM's
    working set), re-ranked by TightLLM's own estimate, plus -- when the batch is free -- twice the GPU batch on the
    same placement (with recompute the KV loads shrink, so a bigger batch can pay). ``max_shapes``: only the LP's
    best that many shapes (None: every shape the LP solved). The LP prices no recompute, so its ranking is no cut for
    TightLLM: kept to its best 12 shapes (before 2026-12-05), OPT-13B 512/32 on the H200 preset lost the 128 x 2 block
    at 20 GiB (the LP's 13th) that won at 16 GiB (its 10th), and found 132 total tok/s where 16 GiB found 138 and all
    shapes find 143 (TightLLM's search was no better at 20 GiB than at 16 in 14 of 26 ladders of
    ``experiments.sweeps.search_monotone``, in none with every shape; OPT-66B's search on the A800 preset 0.9 -> 1.4 s).
    ``compression``: the LP, the fit, the estimate and every candidate run with it. ``key_mask``: every workload
    reserves a padded batch's key mask (``Workload.reserve_key_mask``), the fit included. ``max_batch``: no block of
    more sequences -- the LP's shapes under that cap (a cap after a cut would leave none). ``num_gpus`` > 1: pipeline
    candidates (``tightllm_stage_candidates``)."""
    if num_gpus > 1:
        return tightllm_stage_candidates(model, hw, prompt_len, gen_len, num_gpus, batch, compression, key_mask,
                                         max_batch)
    seen = set()
    extra = compression.settings() if compression.any else {}
    lps = flexgen_candidates(model, hw, prompt_len, gen_len, cpu_attention=(False,), batch=batch,
                             sublayer=False, comp=compression, max_batch=max_batch)[:max_shapes]  # whole layers
    out = []
    for r in lps:
        for gbs in (r.gpu_batch_size,) if batch is not None else (r.gpu_batch_size, 2 * r.gpu_batch_size):
            key = (r.percent, gbs, r.num_gpu_batches)
            if key in seen or (max_batch is not None and gbs * r.num_gpu_batches > max_batch):
                continue
            seen.add(key)
            wl = Workload(prompt_len, gen_len, gbs, r.num_gpu_batches, reserve_key_mask=key_mask)
            pct = fit_gpu_weights(model, hw, wl, r.percent, False,
                                  fits=lambda p: _fits(model, hw, wl, p, compression))
            fitted = (pct, gbs, r.num_gpu_batches)
            if fitted != key and fitted in seen:  # two LP optima trimmed to one placement (OPT-13B 512/32 on 20
                continue  # GiB: 8 x 16's doubled and the LP's own 16 x 16): one candidate, not two
            seen.add(fitted)
            st = TightLLMSettings(percent=pct, **extra)
            try:
                score = estimate_seconds_per_token(model, hw, wl, st)
            except OffsimError:
                continue
            if math.isfinite(score):
                out.append(Candidate({"percent": pct, **extra}, wl, score))
    out.sort(key=lambda c: c.score_s_per_token)
    return out


TIGHTLLM = Policy("tightllm", TightLLMSettings, tightllm_plan, tightllm_candidates,
                  "TightLLM: recompute part of the KV cache on the idle GPU (ILP per batch), weight slices per batch",
                  tightllm_placement, ranks_compression=True,
                  before_inputs={"capture_aware": False},  # plans made before it decided every step alone
                  check_stages=check_tightllm_stages)
