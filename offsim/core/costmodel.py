"""The cost model: the single place where bytes and FLOPs become seconds (docs/cost-model.md).

The simulator prices every op of a plan here, and the optimisers (FlexGen's LP, TightLLM's ILP, Select-N's record)
build their terms from the same functions. Terms are plain arithmetic, so a byte count may be a float or a cvxpy
expression (a placement fraction times a size): where a rate depends on the size of a transfer, an expression is
priced at the large-transfer rate (the last point of the curve), which is what the LP's linearity needs.

Conventions: ``num_seqs`` sequences in a GPU batch, each with ``q_tokens`` query tokens at the end of a context of
``ctx_tokens`` tokens (the query tokens included); prefill of a prompt of s tokens is q = ctx = s, a decode step is
q = 1, ctx = current length, TightLLM's recompute of N_r tokens is q = N_r + 1.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from numbers import Real

from offsim.core.errors import OffsimError
from offsim.core.specs import NO_COMPRESSION, Compression, Curve, HardwareSpec, ModelSpec, layer_key

# ----------------------------------------------------------------------------------------------------------------
# curves
# ----------------------------------------------------------------------------------------------------------------


_PREPARED: dict[int, tuple] = {}  # id(curve) -> (curve, xs, log xs, ys): interp is the planners' innermost call


def _prepared(curve: Curve) -> tuple:
    e = _PREPARED.get(id(curve))
    if e is None or e[0] is not curve:  # (the entry holds the curve, so its id cannot be reused while cached)
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        xs = [float(p[0]) for p in curve]
        e = _PREPARED[id(curve)] = (curve, xs, [math.log(x) for x in xs], [float(p[1]) for p in curve])
    return e


def _segment(curve: Curve, x: float) -> tuple:
    """(``_prepared(curve)``, i) with xs[i - 1] < x <= xs[i]; i is None at or past an end point (clamped there)."""
    e = _prepared(curve)
    xs = e[1]
    return e, (None if x <= xs[0] or x >= xs[-1] else bisect.bisect_left(xs, x))


def interp(curve: Curve, x: float) -> float:
    """y at x on a curve, linear in log(x) between points, clamped to the end points. (``_segment``'s work, inlined:
    this is the planners' innermost call.)"""
    _, xs, lxs, ys = _prepared(curve)
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_left(xs, x)  # xs[i - 1] < x <= xs[i]
    w = (math.log(x) - lxs[i - 1]) / (lxs[i] - lxs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


def gemm_efficiency(curve: Curve, tokens: float) -> float:
    """Achieved / peak FLOP rate of a GEMM over ``tokens`` rows on a ``gemm_efficiency`` curve, interpolated so that
    the GEMM's *time* (tokens / efficiency, for one shape) is linear in tokens between measured points, clamped to
    the end points. A GEMM's time follows a roofline, piecewise linear in tokens (flat while its weights' read
    dominates, then rising with its FLOPs). ``interp``'s log-linear blend of the efficiency itself overshoots it
    between distant points: on the h200 preset (points at 1 and 8 tokens) two tokens' weights were priced as read
    at 6.7 TB/s, past the card's 4.8, and decoding two sequences took 27 % less time than one. Here the time never
    falls as tokens grow, and never beats the straight line between two measurements."""
    (_, xs, _, ys), i = _segment(curve, tokens)
    if i is None:
        return ys[0] if tokens <= xs[0] else ys[-1]
    g0, g1 = xs[i - 1] / ys[i - 1], xs[i] / ys[i]  # time per FLOP-at-peak-per-token, at the two points
    return tokens / (g0 + (tokens - xs[i - 1]) / (xs[i] - xs[i - 1]) * (g1 - g0))


def _is_number(x) -> bool:
    return isinstance(x, Real)


# ----------------------------------------------------------------------------------------------------------------
# transfers
# ----------------------------------------------------------------------------------------------------------------
DIRECTIONS = ("h2d", "d2h")


def prices_issue(hw: HardwareSpec) -> bool:
    """Whether the profile gives the runtime a cost per issued op (else an ideal runtime that issues for free)."""
    return bool(hw.issue_compute_s or hw.issue_copy_s or hw.issue_graph_s)


def relay_staged_by_issuer(hw: HardwareSpec, direction: str) -> bool:
    """Whether a relayed copy's staging is the issuing thread's work rather than its stream's: an H2D relay
    (FlexGen's ``general_copy`` runs ``src.pin_memory()`` on the calling thread -- its main loop -- before the
    asynchronous copy; its D2H relays go to its copy threads), where the profile measured the relay
    (``h2d_relay``) and prices issuing (``prices_issue``). Then the copy's stream moves the bytes at the pinned rate
    and its issue costs ``relay_staging_seconds``; otherwise the stream takes the whole relay."""
    return direction == "h2d" and bool(hw.h2d_relay) and prices_issue(hw)


def relay_staging_seconds(hw: HardwareSpec, nbytes) -> float:
    """The host's share of one H2D relay of ``nbytes`` (``relay_staged_by_issuer``): the profile's relay time (the
    staging copy into pinned memory, then the pinned copy, one after the other as ``offexec profile`` times them)
    less the pinned copy's time; 0 where the relay is not measured or ``nbytes`` is empty."""
    if not hw.h2d_relay or not _is_number(nbytes) or nbytes <= 0:
        return 0.0
    return max(0.0, nbytes / interp(hw.h2d_relay, nbytes) - nbytes / interp(hw.h2d_pinned, nbytes))


def link_bytes_per_s(hw: HardwareSpec, nbytes, direction: str, pinned: bool = True, relay: bool = False) -> float:
    """Bandwidth of one copy of ``nbytes`` over PCIe in ``direction`` ('h2d' or 'd2h'), pinned or pageable host;
    ``relay``: an unpinned copy that the caller stages through a pinned copy of its own (``Plan.pageable_copy``
    'relay'), at the profile's ``h2d_relay`` / ``d2h_relay`` where measured, else as a pageable copy -- or, where
    the issuing thread stages it (``relay_staged_by_issuer``), at the pinned rate: the stream's share."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if relay and not pinned and relay_staged_by_issuer(hw, direction):
        pinned = True
    curve = {("h2d", True): hw.h2d_pinned, ("d2h", True): hw.d2h_pinned,
             ("h2d", False): hw.h2d_pageable, ("d2h", False): hw.d2h_pageable}[direction, pinned]
    if relay and not pinned:
        curve = (hw.h2d_relay if direction == "h2d" else hw.d2h_relay) or curve
    return interp(curve, nbytes) if _is_number(nbytes) else curve[-1][1]


def relayed(op, pageable_copy: str) -> bool:
    """Whether plan op ``op``, a copy, is staged through a pinned relay when unpinned (``link_bytes_per_s``' ``relay``)
    in a plan whose ``pageable_copy`` is ``pageable_copy``: with 'relay' (FlexGen's ``general_copy``,
    pytorch_backend.py), every copy but a D2H of one KV position -- ``general_copy`` sends a GPU-to-unpinned-host
    copy through its copy threads' pinned buffer only when ``src.shape[0] > 1``; a decode token's K or V (shape [1,
    B x heads, head_dim], ``SelfAttention.store_cache``) takes its plain path, a pageable ``copy_``."""
    if pageable_copy != "relay":
        return False
    return not (op.kind == "d2h" and getattr(op, "tensor", "") == "kv"
                and getattr(op, "hi", 0) - getattr(op, "lo", 0) <= 1)


# ('copy', PART) rows of FlexGen's own multi-position KV store (``offexec profile --flexgen-only``), by whether the
# cache is compressed (``Compression.cache``)
FLEXGEN_STORE_PARTS = {False: "store_flexgen:fp16", True: "store_flexgen:4bit"}


def flexgen_store_curve(op, model: ModelSpec, hw: HardwareSpec, pageable_copy: str, comp: Compression):
    """The profile's row for FlexGen's own store of the K and V of several positions (a prefill's) into its unpinned
    host cache, or None: what ``flexgen-ref`` (``Plan.pageable_copy`` 'relay') pays for a relayed KV D2H copy where
    ``offexec profile --flexgen-only`` timed it ('copy', 'store_flexgen:fp16' / ':4bit', by the bytes stored). Its
    ``general_copy`` hands such a copy to its copy threads, which stage it through a *float16* pinned buffer
    (``copy_worker_func``'s ``cpu_buf``; a 4-bit cache's uint8 data is converted to float16 there and back) into
    the cache home, which ``init_cache_one_gpu_batch`` allocated unpinned and nothing has touched before the prefill
    writes it (every page faulted in by the copy): the relay rate (``d2h_relay``: a float16 tensor into touched
    memory) prices none of that."""
    if (op.kind != "d2h" or getattr(op, "tensor", "") != "kv" or getattr(op, "pinned", True) or not hw.op_times
            or not relayed(op, pageable_copy)):
        return None
    return op_table(hw, model, "copy", FLEXGEN_STORE_PARTS[bool(comp.cache)])


def transfer_seconds(hw: HardwareSpec, nbytes, direction: str, pinned: bool = True, other_busy_s: float = 0.0,
                     relay: bool = False):
    """Seconds to copy ``nbytes`` over PCIe: latency + bytes / bandwidth(size, direction).

    Duplex: for the first ``other_busy_s`` seconds the opposite direction is also busy, and this copy runs at
    ``duplex_fraction`` of its bandwidth (measured: 49.5 of 55.2 GB/s on the H200 link); after that at full rate.
    """
    bw = link_bytes_per_s(hw, nbytes, direction, pinned, relay)
    if _is_number(nbytes) and nbytes <= 0:
        return 0.0
    if other_busy_s > 0 and _is_number(nbytes):
        return duplex_seconds(hw, nbytes, bw, other_busy_s)
    return hw.link_latency_s + nbytes / bw


def duplex_seconds(hw: HardwareSpec, nbytes: float, bw: float, other_busy_s: float) -> float:
    """``transfer_seconds`` of a copy of ``nbytes`` > 0 whose full rate is ``bw`` (``link_bytes_per_s``) while the
    opposite direction stays busy for its first ``other_busy_s`` > 0 seconds. Apart so that the simulator, which
    prices such a copy afresh at every overlap, can pass a rate it looked up once per copy shape
    (``duplex_rate``)."""
    slow_bw = bw * hw.duplex_fraction
    if nbytes <= slow_bw * other_busy_s:
        return hw.link_latency_s + nbytes / slow_bw
    return hw.link_latency_s + other_busy_s + (nbytes - slow_bw * other_busy_s) / bw


def gpu_link_bytes_per_s(hw: HardwareSpec) -> float:
    """Bytes/s of a GPU-to-GPU copy: the profile's ``gpu_link_bytes_per_s``, or where it was not measured the best
    rate of the pinned host-to-device curve (a PCIe peer copy crosses one PCIe link each way at about that rate)."""
    return hw.gpu_link_bytes_per_s or max(y for _, y in hw.h2d_pinned)


def p2p_seconds(hw: HardwareSpec, nbytes) -> float:
    """Seconds of one GPU-to-GPU copy (pipeline parallelism's hidden states and token ids): latency + bytes /
    ``gpu_link_bytes_per_s``. Each sending GPU has a link of its own (no switch shared between GPUs is modelled)."""
    if _is_number(nbytes) and nbytes <= 0:
        return 0.0
    return hw.link_latency_s + nbytes / gpu_link_bytes_per_s(hw)


def network_bytes_per_s(hw: HardwareSpec) -> float:
    """Bytes/s between two hosts (``HardwareSpec.network_bytes_per_s``); a plan over several nodes needs it."""
    if not hw.network_bytes_per_s > 0:
        raise OffsimError(f"hardware {hw.name}: a pipeline over several nodes needs the network rate between hosts: "
                          "set network_bytes_per_s (bytes/s) in the hardware profile")
    return hw.network_bytes_per_s


def network_p2p_seconds(hw: HardwareSpec, nbytes) -> float:
    """Seconds of one copy between GPUs on different nodes (a multi-node pipeline's hidden states and token ids), as
    FlexGen's ``--comm-device cpu`` moves it: GPU -> host memory (a pinned d2h over the sender's link), the network
    between the hosts, host memory -> GPU (a pinned h2d over the receiver's link), one after another (each leg
    waits for the whole tensor: store and forward). The network leg pays ``link_latency_s`` too (a per-message
    cost; not measured for a network)."""
    if _is_number(nbytes) and nbytes <= 0:
        return 0.0
    return (transfer_seconds(hw, nbytes, "d2h") + hw.link_latency_s + nbytes / network_bytes_per_s(hw)
            + transfer_seconds(hw, nbytes, "h2d"))


def disk_seconds(hw: HardwareSpec, nbytes, direction: str, cached: bool = False):
    """Seconds to read ('read': disk -> host) or write ('write': host -> disk) ``nbytes``: past the page cache
    (offexec's default O_DIRECT disk tier) from the profile's time of one request by size where measured
    (``disk_read_op`` / ``disk_write_op``: linear between sizes, proportional past the largest), else at the disk's
    cold rates; for a plan whose disk tier is page-cached (``Plan.disk_cached``), at the profile's page-cached
    rates. An expression (the LP's) is priced at the rate: a per-request cost is not linear in its bytes."""
    if direction not in ("read", "write"):
        raise ValueError(f"disk direction must be 'read' or 'write', got {direction!r}")
    if _is_number(nbytes) and nbytes <= 0:
        return 0.0
    if not cached:
        per_op = hw.disk_read_op if direction == "read" else hw.disk_write_op
        if per_op and _is_number(nbytes):
            return table_seconds(per_op, nbytes)
        return nbytes / (hw.disk_read_bytes_per_s if direction == "read" else hw.disk_write_bytes_per_s)
    bw = hw.disk_cached_read_bytes_per_s if direction == "read" else hw.disk_cached_write_bytes_per_s
    if not bw > 0:
        raise OffsimError(f"hardware {hw.name} has no page-cached disk rate (disk_cached_{direction}_bytes_per_s), so "
                          "a plan with a page-cached disk tier cannot be priced on it; measure it with offexec profile "
                          "or use the default (O_DIRECT) disk tier")
    return nbytes / bw


# ----------------------------------------------------------------------------------------------------------------
# GPU compute
# ----------------------------------------------------------------------------------------------------------------
# 'layer' = 'pre_attn' + 'attn' + 'post_attn'; FlexGen's sub-layers: 'attn_layer' (= 'pre_attn' + 'attn' + 'attn_out')
# and 'mlp' ('post_attn' = 'attn_out' + 'mlp')
COMPUTE_PARTS = ("layer", "pre_attn", "attn", "post_attn", "attn_layer", "attn_out", "mlp", "embed", "head")


def gemm_flops_per_token(model: ModelSpec, part: str) -> float:
    """FLOPs of the dense GEMMs of one token through ``part`` of a decoder layer (2 FLOP per multiply-add)."""
    h, q, kv, f = model.d_model, model.q_dim, model.kv_dim, model.ffn_dim
    qkv = 2 * h * (q + 2 * kv)  # Q, K and V projections
    out = 2 * q * h  # attention output projection
    ffn = 2 * h * f * (3 if model.family == "llama" else 2)  # SwiGLU has gate, up, down; OPT fc1, fc2
    return {"layer": qkv + out + ffn, "pre_attn": qkv, "post_attn": out + ffn, "attn": 0.0, "embed": 0.0,
            "attn_layer": qkv + out, "attn_out": out, "mlp": ffn, "head": 2 * h * model.vocab_size}[part]


def elementwise_bytes_per_token(model: ModelSpec, part: str) -> float:
    """HBM bytes that one token's elementwise passes (norms, activations, rotary, residual adds) read and write in
    ``part`` of a decoder layer. Counted as passes over a vector, each pass reading and writing it once (2 ×
    dtype bytes an element), as PyTorch's unfused eager kernels do:
    - OPT: LayerNorm before attention and before the FFN (2 passes over h each, as read + write: 2h), residual
      adds (3h each: two reads, one write), ReLU over the FFN intermediate (2f); biases are fused into the GEMMs.
    - Llama: RMSNorm ×2 (≈6h each: square, mean, rsqrt scale, weight; in fp32), rotary on Q and K (≈6 passes:
      two multiplies, rotate-half, add), residual adds (3h each), SwiGLU (silu: 2f, gate·up: 3f).
    At prefill sizes this is a few percent (OPT) to ~15 % (Llama) of a layer; in decode it is negligible."""
    h, q, kv, f = model.d_model, model.q_dim, model.kv_dim, model.ffn_dim
    out = 3 * h  # the residual add after the output projection
    if model.family == "opt":
        pre, mlp = 2 * h, 2 * h + 2 * f + 3 * h
    else:
        pre, mlp = 6 * h + 6 * (q + kv), 6 * h + 5 * f + 3 * h
    elems = {"layer": pre + out + mlp, "pre_attn": pre, "post_attn": out + mlp, "attn_layer": pre + out,
             "attn_out": out, "mlp": mlp}.get(part, 0)
    return elems * model.dtype_bytes


def gemm_seconds(hw: HardwareSpec, tokens: float, flops):
    """Seconds for ``flops`` of GEMM work over ``tokens`` rows: FLOPs / (peak · efficiency(tokens))."""
    if _is_number(flops) and flops <= 0:
        return 0.0
    return flops / (hw.gpu_peak_flops * gemm_efficiency(hw.gemm_efficiency, max(tokens, 1)))


def attention_flops(model: ModelSpec, num_seqs, q_tokens: int, ctx_tokens: int, sparse: float = 1.0):
    """FLOPs of causal attention (QK^T and PV: 4 FLOP per query·key·head_dim) for the last ``q_tokens`` queries of
    a ``ctx_tokens`` context: query i (0-based among the q) sees ctx - q + i + 1 keys. ``sparse``: the share of
    keys whose V rows each query keeps (``sparse_share``): QK^T stays whole, PV shrinks to that share."""
    keys = q_tokens * (ctx_tokens - q_tokens) + q_tokens * (q_tokens + 1) / 2
    return 2 * (1 + sparse) * num_seqs * keys * model.num_heads * model.head_dim  # 2·(QK^T) + 2·sparse·(PV)


def sparse_share(q_tokens: int, ctx_tokens: int, comp: Compression) -> float:
    """The share of V an attention op reads and multiplies: ``comp.sparse_attention`` for one-token decode attention
    (FlexGen's ``mha_gen``; offexec gathers the kept rows, ``quant.sparse_sdpa``), 1 at prefill (FlexGen's prefill
    attention is dense) and for TightLLM's recompute blocks of several queries (offexec zeroes the dropped
    positions' weights and multiplies every V row: each query keeps a different set)."""
    return comp.sparse_attention if q_tokens == 1 < ctx_tokens else 1.0


def attention_seconds(model: ModelSpec, hw: HardwareSpec, num_seqs, q_tokens: int, ctx_tokens: int,
                      comp: Compression = NO_COMPRESSION, masked: bool = False, graphed: bool = False,
                      kv_len: int = 0):
    """GPU attention: the larger of its FLOPs at the prefill efficiency and its KV read at the decode efficiency.
    ``graphed``: a decode op replayed as a CUDA graph, which attends over its whole KV buffer of ``kv_len``
    positions (the plan's ``Workload.max_len``), the ones not written yet masked out (offexec/graphs.py: no length
    is baked into a captured kernel), so its cost does not follow the step's context. One query per sequence is
    then priced from the profile's ('attn', 'decode_graph:B') rows where it measured them for this model
    (``offexec profile --ops M --attention-only decode``: that masked kernel replayed from a graph, by sequences B
    and buffer length) at the buffer's length. Without them, as below at the step's context: the model-agnostic
    ``attn_decode_efficiency`` was measured for one batch size over the context alone (unmasked), and read so it
    is the closer estimate (what the calibration cases' decode ops took beside both prices:
    results/validation/decode_attention_calib.md).
    The FLOP efficiency of many queries is this model's own where the profile's op tables have it (mode 'attn':
    'prefill' when the queries are the whole context, else 'recompute' -- a masked kernel), else the profile's
    model-agnostic curve. ``masked``: the batch is left-padded (``Workload.padded``), so the kernel takes a
    per-sequence key mask: the profile's 'prefill_masked' / 'recompute_masked' rows where measured (a masked SDPA
    call runs another kernel, up to 2.5x slower at these shapes: experiments/offexec/mask_sdpa.py), else the
    unmasked rows. Sparse attention (``comp``) reads all of K and its share of V, and does its share of PV; where
    a measured row prices the op, that row (timed dense) times ``sparse_scale``, so that the price is continuous in
    the kept share (it jumped +8 % from 1 to 0.999 where the rows gave way to the FLOP and byte terms below)."""
    sparse = sparse_share(q_tokens, ctx_tokens, comp)
    if graphed and _decode_graph_rows_price(num_seqs, q_tokens):
        t = _rows_by_batch_and_context(model, hw, num_seqs, max(ctx_tokens, kv_len), "decode_graph:", mode="attn")
        if t is not None:
            return t * sparse_scale(sparse)
    flops = attention_flops(model, num_seqs, q_tokens, ctx_tokens, sparse)
    eff = None
    if q_tokens > 1 and hw.op_times:
        eff = _attention_table_efficiency(hw, model, q_tokens, ctx_tokens, masked)
    t_flops = flops / (hw.gpu_peak_flops * (eff if eff is not None else interp(hw.attn_prefill_efficiency,
                                                                                ctx_tokens)))
    kv_read = num_seqs * ctx_tokens * model.kv_bytes_per_token() * (1 + sparse) / 2  # K whole, V's kept share
    t_mem = kv_read / (hw.gpu_hbm_bytes_per_s * interp(hw.attn_decode_efficiency, ctx_tokens))
    if _is_number(t_flops) and _is_number(t_mem):
        return max(t_flops, t_mem)
    return t_flops + t_mem  # an upper bound that stays linear (expressions only)


def _decode_graph_rows_price(num_seqs, q_tokens: int) -> bool:
    """Whether the profile's ('attn', 'decode_graph:B') rows price a graphed op's attention: one query per sequence,
    a numeric batch (not an LP expression). The rows time the dense masked kernel; a sparse op's is scaled
    (``sparse_scale``)."""
    return q_tokens == 1 and _is_number(num_seqs)


def sparse_scale(sparse: float) -> float:
    """A dense attention's measured time scaled to sparse attention keeping ``sparse`` of the V rows: K and QK^T stay
    whole, V's read and PV shrink to the kept share -- (1 + sparse) / 2, the ratio of both the FLOP and the byte terms
    of ``attention_flops`` and ``attention_seconds``. The top-k selection's own cost is in neither (not measured)."""
    return (1 + sparse) / 2


# The KV buffer (positions) the op tables' graphed decode ops attend over: ``offexec profile`` times them in plans of
# prompt 16 and gen 8 (``offexec.profile.profile_ops``, whose defaults these are), and a graphed op attends over its
# whole buffer, Workload.max_len = 16 + 8 - 1 positions
OP_TABLE_PROBE_PROMPT, OP_TABLE_PROBE_GEN = 16, 8
OP_TABLE_PROBE_KV_LEN = OP_TABLE_PROBE_PROMPT + OP_TABLE_PROBE_GEN - 1


def graph_row_attention_seconds(model: ModelSpec, hw: HardwareSpec, num_seqs, q_tokens: int) -> float:
    """The attention a graphed decode op's ('graph', part) row already holds: the row was timed on the probe's ops,
    which attend over the probe's buffer (``OP_TABLE_PROBE_KV_LEN`` positions), and ``compute_seconds`` adds the
    attention over the op's own buffer on top. Priced from the profile's ('attn', 'decode_graph:B') rows where it
    has them, as ``attention_seconds`` prices the op's own (their shortest buffer is 128 positions: below it the
    line through their two shortest, the kernel's time being close to affine in the buffer's length); 0 without
    them (the model-agnostic price at so short a context is below 1 % of a row, and the profiles without these
    rows predict as before). Without this the rows' 64-sequence ops counted ~0.05 ms twice beside ~0.35 ms rows."""
    if not _decode_graph_rows_price(num_seqs, q_tokens):  # (the probe ran dense: its row holds dense attention)
        return 0.0
    t = _rows_by_batch_and_context(model, hw, num_seqs, OP_TABLE_PROBE_KV_LEN, "decode_graph:", mode="attn",
                                   affine_below=True)
    return 0.0 if t is None else t


# the query tokens of the profile's ('attn', 'recompute') rows: ``offexec profile`` times a recompute block of the
# last min(ATTN_RECOMPUTE_QUERIES, ctx // 2) queries of each context (``offexec.profile.profile_attention``)
ATTN_RECOMPUTE_QUERIES = 64


def _attention_table_efficiency(hw: HardwareSpec, model: ModelSpec, q_tokens: int, ctx_tokens: int,
                                masked: bool = False) -> float | None:
    """GPU attention's FLOP efficiency for ``q_tokens`` > 1 queries at the end of a ``ctx_tokens`` context from the
    profile's ('attn', ...) rows, or None without them. The rows measure two query counts at each context: the
    whole context ('prefill', q = ctx, the causal kernel) and a recompute block of ``ATTN_RECOMPUTE_QUERIES``
    queries ('recompute', the bottom-right causal mask). A block between them is one kernel over more queries: its
    FLOPs per KV byte read grow with q, so its efficiency lies between the two measured points; it is interpolated
    linearly in log q between them (as ``interp`` does between a curve's points). Up to the recompute row's query
    count, that row as measured. ``masked``: the '_masked' rows (a per-sequence key mask), where the profile has
    both; else the unmasked ones."""
    sfx = "_masked" if masked and op_table(hw, model, "attn", "prefill_masked") is not None \
        and op_table(hw, model, "attn", "recompute_masked") is not None else ""
    pre = op_table(hw, model, "attn", "prefill" + sfx)
    if q_tokens >= ctx_tokens:
        return None if pre is None else interp(pre, ctx_tokens)
    rec = op_table(hw, model, "attn", "recompute" + sfx)
    if rec is None:
        return None
    e_rec = interp(rec, ctx_tokens)
    q_rec = min(ATTN_RECOMPUTE_QUERIES, ctx_tokens // 2)
    if pre is None or q_tokens <= q_rec or not _is_number(q_tokens):
        return e_rec
    w = math.log(q_tokens / q_rec) / math.log(ctx_tokens / q_rec)
    return e_rec + w * (interp(pre, ctx_tokens) - e_rec)


# ----------------------------------------------------------------------------------------------------------------
# op tables: compute ops as the executor runs them (HardwareSpec.op_times, offexec profile --ops)
# ----------------------------------------------------------------------------------------------------------------
_OP_INDEX: dict[int, tuple] = {}  # id(hw.op_times) -> (op_times, {(layer key, mode, part): curve})
_layer_key = functools.lru_cache(maxsize=256)(layer_key)


# copies priced from the op tables where measured: CPU attention's per-batch Q/K/V out and attention output back,
# small transfers that the executor's own work (a packing kernel, an allocation) dominates, not the link
COPY_TABLE_TENSORS = ("qkv", "attn_out")


def op_table(hw: HardwareSpec, model: ModelSpec, mode: str, part: str) -> Curve | None:
    """The measured curve of ``part`` in ``mode`` for this model's layer shape, or None where the profile has none."""
    if not hw.op_times:
        return None
    e = _OP_INDEX.get(id(hw.op_times))
    if e is None or e[0] is not hw.op_times:
        if len(_OP_INDEX) > 256:
            _OP_INDEX.clear()
        e = _OP_INDEX[id(hw.op_times)] = (hw.op_times, {(k, m, p): c for k, m, p, c in hw.op_times})
    return e[1].get((_layer_key(model), mode, part))


def table_seconds(curve: Curve, x: float, flat_past_largest: bool = False, affine_below: bool = False) -> float:
    """Seconds at size ``x`` on an op table: linear between measured sizes (an op's time is close to affine in its
    rows), the smallest size's time below them, and proportional to ``x`` past the largest (where the GEMMs are
    compute-bound: time per row is constant) -- or, with ``flat_past_largest``, the largest size's time (host issue
    time: a copy's host work does not grow with its bytes). ``affine_below``: below the smallest size, the line
    through the two smallest (clamped to [0, the smallest's time]): where a size well below the table's is wanted
    and its time is known to follow the line (``graph_row_attention_seconds``)."""
    _, xs, _, ys = _prepared(curve)
    if x <= xs[0]:
        if affine_below and len(xs) > 1:
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            return min(ys[0], max(0.0, ys[0] - slope * (xs[0] - x)))
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] if flat_past_largest else ys[-1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


# tokens at and above which an eager op of the 'tokens' table keeps the GPU busy while the host issues it (below,
# its measured time includes host issue, and the probe's small sizes scatter by +-20 %: docs/cost-model.md §4a)
GPU_BOUND_TOKENS = 512
_GRAPH_TOKENS: dict[tuple, Curve] = {}


def _graph_tokens_curve(hw: HardwareSpec, model: ModelSpec, part: str) -> Curve | None:
    """A graphed op of q > 1 query tokens by its rows (sequences x q): the profile's 'graph_tokens' table where it
    measured one (``offexec profile``: such ops replayed as offexec runs them); otherwise the 'graph' table
    (one-token decode ops, rows = sequences: the same GEMMs) up to its largest size, then the 'tokens' table from
    ``GPU_BOUND_TOKENS`` on, linear between (an op's time is close to affine in its rows)."""
    measured = op_table(hw, model, "graph_tokens", part)
    if measured is not None:
        return measured
    g, t = op_table(hw, model, "graph", part), op_table(hw, model, "tokens", part)
    if g is None or t is None:
        return g or t
    key = (id(g), id(t))
    c = _GRAPH_TOKENS.get(key)
    if c is None or c[0] is not g or c[1] is not t:
        top = max(x for x, _ in g)
        merged = sorted(g) + [p for p in sorted(t) if p[0] > top and p[0] >= GPU_BOUND_TOKENS]
        if len(_GRAPH_TOKENS) > 256:
            _GRAPH_TOKENS.clear()
        c = _GRAPH_TOKENS[key] = (g, t, merged)
    return c[2]


def _table_compute_seconds(model: ModelSpec, hw: HardwareSpec, part: str, num_seqs, q_tokens: int,
                           graphs: bool) -> float | None:
    """A compute op priced from the op tables (without attention over its context), or None without a row.
    ``graphs``: this op is a CUDA-graph replay (``graphed``)."""
    if part == "head":  # the LM head reads each sequence's last position only
        mode, x = "eager", num_seqs
    elif graphs and part in GRAPHED_PARTS and q_tokens <= GRAPH_MAX_Q_TOKENS:
        if q_tokens > 1:
            curve = _graph_tokens_curve(hw, model, part)
            return None if curve is None else table_seconds(curve, num_seqs * q_tokens)
        mode, x = "graph", num_seqs
    elif part == "embed" or q_tokens > 1:
        mode, x = "tokens", num_seqs * q_tokens
    else:
        mode, x = "eager", num_seqs
    curve = op_table(hw, model, mode, part)
    return None if curve is None else table_seconds(curve, x)


def compute_seconds(model: ModelSpec, hw: HardwareSpec, part: str, num_seqs, q_tokens: int, ctx_tokens: int,
                    graphs: bool = True, comp: Compression = NO_COMPRESSION, quant_impl: str = "",
                    masked: bool = False, kv_len: int = 0):
    """One GPU compute op: ``part`` of one layer (or 'embed'/'head') for a batch of ``num_seqs`` sequences.
    'layer' = 'pre_attn' (norm, QKV) + 'attn' + 'post_attn' (output projection, norm, FFN). ``graphs``: the runtime
    replays this op as a CUDA graph (``graphed``: a decode op of at most the plan's ``graph_q_tokens`` tokens).

    Where the profile has an op table for this model's layer shape (``HardwareSpec.op_times``), the op's time is the
    table's (measured through the executor at this size) plus attention over its real context; otherwise the
    analytical terms: fixed overhead + GEMM FLOPs at the profiled efficiency + elementwise HBM traffic + attention.
    With compression (``comp``), plus its dequantize and quantize passes (``quant_seconds``; ``quant_impl``: the
    plan's, whose code runs them). ``masked``: attention under a per-sequence key mask (``attention_seconds``).
    ``kv_len``: the length of the op's KV buffer (the plan's ``Workload.max_len``; 0: unknown), what a graphed op's
    attention reads (``attention_seconds``)."""
    q = quant_seconds(model, hw, part, num_seqs, q_tokens, ctx_tokens, comp, quant_impl) \
        if comp is not NO_COMPRESSION else 0.0
    if hw.op_times and _is_number(num_seqs):
        t = _table_compute_seconds(model, hw, part, num_seqs, q_tokens, graphs)
        if t is not None:
            if part in ("attn", "layer", "attn_layer"):
                t += attention_seconds(model, hw, num_seqs, q_tokens, ctx_tokens, comp, masked, graphs, kv_len)
                if graphs and part in GRAPHED_PARTS:  # its row holds the probe's attention: not counted twice
                    t -= graph_row_attention_seconds(model, hw, num_seqs, q_tokens)
            return _sustained(hw, t, num_seqs * q_tokens, model) + q
    t = _analytical_compute_seconds(model, hw, part, num_seqs, q_tokens, ctx_tokens, comp, masked, graphs, kv_len)
    return _sustained(hw, t, num_seqs * q_tokens, model) + q


# Bytes of HBM traffic per fp16 byte that a dequantize (or quantize) pass moves when no profile measured its rate
# (HardwareSpec.quant_bytes_per_s = 0): FlexGen's PyTorch kernels are unfused elementwise passes -- unpack the
# high and the low nibbles, interleave them, divide by the scale, add the min, cut the padding -- each reading and
# writing about the tensor's size.
QUANT_HBM_PASSES = 8


def quant_bytes_per_s(hw: HardwareSpec) -> float:
    """fp16 bytes per second dequantized (or quantized): the profile's ``quant_bytes_per_s``, else HBM bandwidth /
    ``QUANT_HBM_PASSES``."""
    return hw.quant_bytes_per_s or hw.gpu_hbm_bytes_per_s / QUANT_HBM_PASSES


def quant_store_bytes_per_s(hw: HardwareSpec) -> float:
    """fp16 bytes per second quantized on the KV store: the profile's ``quant_store_bytes_per_s`` where measured
    (the store is its own kernel -- a quantize, not the dequantize the other rate times -- and the H200's 4-bit
    prefill ran at a third of the rate offsim predicted with the store priced as a dequantize), else
    ``quant_bytes_per_s`` (profiles without it predict as before)."""
    return hw.quant_store_bytes_per_s or quant_bytes_per_s(hw)


def quant_weight_bytes_per_s(hw: HardwareSpec) -> float:
    """fp16 bytes per second dequantized from compressed weights: the profile's ``quant_weight_bytes_per_s`` where
    measured (a weight is one large matrix per call; the H200 dequantizes it at 2.8x the rate of the cache's small
    vectors, and pricing weights at the cache's rate overpriced a 4-bit decode MLP 2.6x), else
    ``quant_bytes_per_s``."""
    return hw.quant_weight_bytes_per_s or quant_bytes_per_s(hw)


# parts that read a decoder layer's KV cache (attention) and that store new KV (the Q/K/V projections)
_KV_READ_PARTS = ("layer", "attn_layer", "attn")
_KV_STORE_PARTS = ("layer", "attn_layer", "pre_attn")


def quant_seconds(model: ModelSpec, hw: HardwareSpec, part: str, num_seqs, q_tokens: int, ctx_tokens: int,
                  comp: Compression, impl: str = ""):
    """Seconds of the compression passes of one compute op (FlexGen's compressed mode runs them on the GPU):

        compressed weights: dequantize the part's weight matrices to fp16 before its GEMMs, every op (FlexGen
                            decompresses in each batch's mha/mlp call): matrix elements = GEMM FLOPs per token / 2
        compressed cache:   dequantize the cached K and V the attention reads -- the ctx − q positions before the
                            op's queries, K and V whole (sparse attention too: the executor dequantizes the cached
                            positions before the scores exist); the q new (or recomputed, TightLLM) tokens' K and
                            V are fresh fp16 -- and quantize the new tokens' K and V on store
        t = weight fp16 bytes / quant_weight_bytes_per_s + cache fp16 bytes / quant_bytes_per_s
            + stored fp16 bytes / quant_store_bytes_per_s

    (the weights' and the store's rates are the cache dequantize's unless a profile measured them). 0 for the
    embedding and the head (kept fp16 on the GPU). With ``impl`` 'flexgen' (``Plan.quant_impl``, ``flexgen-ref``)
    the two dequantize terms are FlexGen's own code's, read off the profile's ('quant', 'dequant_flexgen:weight' /
    ':cache') rows by fp16 bytes where it has them (``offexec profile --flexgen-only``)."""
    if part in ("embed", "head"):
        return 0.0
    fp16_bytes = 0.0
    store_bytes = 0.0
    weight_bytes = gemm_flops_per_token(model, part) / 2 * model.dtype_bytes if comp.weight else 0.0
    if comp.cache:
        kv_tok = model.kv_bytes_per_token()
        if part in _KV_READ_PARTS:
            cached = ctx_tokens - q_tokens
            fp16_bytes += num_seqs * cached * kv_tok
        if part in _KV_STORE_PARTS:
            store_bytes = num_seqs * q_tokens * kv_tok
    if impl == "flexgen":
        w_row = op_table(hw, model, "quant", "dequant_flexgen:weight") if weight_bytes else None
        c_row = op_table(hw, model, "quant", "dequant_flexgen:cache") if fp16_bytes else None
        if w_row is not None or c_row is not None:
            t = table_seconds(w_row, weight_bytes) if w_row is not None else \
                weight_bytes / quant_weight_bytes_per_s(hw)
            t += table_seconds(c_row, fp16_bytes) if c_row is not None else fp16_bytes / quant_bytes_per_s(hw)
            return t + store_bytes / quant_store_bytes_per_s(hw)
    if not hw.quant_store_bytes_per_s and not hw.quant_weight_bytes_per_s:
        # not measured: one rate, one division -- bit for bit the prices from before
        return (weight_bytes + fp16_bytes + store_bytes) / quant_bytes_per_s(hw)
    return weight_bytes / quant_weight_bytes_per_s(hw) + fp16_bytes / quant_bytes_per_s(hw) \
        + store_bytes / quant_store_bytes_per_s(hw)


def sustained_fraction(hw: HardwareSpec, model: ModelSpec | None = None) -> float:
    """The share of the burst GEMM rate a compute-bound op holds under sustained load: measured with ``model``'s own
    FFN GEMM where the profile has its ('clock', 'sustained') row (``offexec profile --ops`` / ``--sustained-only``:
    how far the clocks fall under the power cap depends on the kernel that runs), else the profile's
    ``sustained_compute_fraction`` (one GEMM shape, OPT-30B's). What every static price assumes; the simulator
    varies it with the load where the profile measured how (``clock_model``)."""
    row = op_table(hw, model, "clock", "sustained") if model is not None and hw.op_times else None
    return row[-1][1] if row else hw.sustained_compute_fraction


@dataclass(frozen=True)
class ClockModel:
    """The GPU's clock under its power cap as the load varies (``clock_model``). The power controller holds the
    burst clock while the GPU's recent load stays under what the cap allows and lowers it above: a compute-bound op
    runs at ``fraction(u)`` of the burst rate, where ``u`` is the GPU's busy share averaged over the last
    ``window_s`` seconds (an exponential moving average: ``advance``). Under continuous load ``u`` -> 1 and the rate
    is the sustained one, what every static price assumes (``sustained_fraction``); a GPU that waits for its
    weights part of the time (a prefill streaming them) can keep a faster clock, and a run's first compute runs
    faster for a moment. Both from the profile: ``duty`` the measured fraction by duty cycle (``offexec profile``'s
    ``profile_duty``), ``window_s`` the window that makes the measured settling from idle (``profile_sustained``'s
    windows) what this model predicts of it (``fit_window``)."""

    duty: tuple  # ((busy share, fraction of the burst rate), ...) by busy share, ending at share 1
    window_s: float

    def fraction(self, u: float) -> float:
        return table_seconds(self.duty, u, flat_past_largest=True)  # (a table read: linear, flat past its ends)

    def speedup(self, u: float) -> float:
        """How much faster than at the sustained clock a compute-bound op runs at busy share ``u`` (>= 1 where the
        measured fractions fall with the load): its sustained price over this, relative to the curve's own u = 1."""
        return self.fraction(u) / self.duty[-1][1]

    @staticmethod
    def advance(u: float, busy_s: float, idle_s: float, window_s: float) -> float:
        """The busy share ``u`` after ``busy_s`` seconds busy, then ``idle_s`` idle (the moving average's update)."""
        if busy_s > 0:
            u = 1.0 - (1.0 - u) * math.exp(-busy_s / window_s)
        if idle_s > 0:
            u *= math.exp(-idle_s / window_s)
        return u


def fit_window(duty, held) -> float:
    """The averaging window (seconds) with which ``ClockModel`` reproduces the measured settling from idle:
    ``held`` ((seconds of continuous load since idle at a window's end, that window's fraction of the burst rate),
    ...: ``profile_sustained``'s windows), ``duty`` as ``ClockModel``'s. Under continuous load from idle the busy
    share is 1 - exp(-t / window), and a measured window's fraction is the model's mean over its span; the window is
    the one, on a log grid of 1 ms to 30 s, whose means come closest to the measured ones (least squares). The
    profile's own measurement, never a validation case."""
    spans = [(a, b, f) for (a, _), (b, f) in zip([(0.0, 0.0), *held], held)]
    best, best_err = 1.0, math.inf
    for k in range(449):  # 10^-3 .. 10^1.48 s in steps of 10^0.01
        w = 10 ** (-3 + 0.01 * k)
        err = 0.0
        for a, b, f in spans:
            ts = [a + (b - a) * (j + 0.5) / 8 for j in range(8)]
            err += (sum(table_seconds(duty, 1.0 - math.exp(-t / w), True) for t in ts) / 8 - f) ** 2
        if err < best_err:
            best, best_err = w, err
    return best


def clock_model(hw: HardwareSpec, model: ModelSpec) -> ClockModel | None:
    """The clock's response to load for ``model``'s GEMMs where the profile measured it (its ('clock', 'duty') and
    ('clock', 'held') rows: ``offexec profile --ops M --sustained-only``), else None: every compute-bound op at the
    sustained fraction, as ``compute_seconds`` prices it."""
    if not hw.op_times:
        return None
    duty, held = op_table(hw, model, "clock", "duty"), op_table(hw, model, "clock", "held")
    if not duty or not held:
        return None
    duty = tuple((float(x), float(y)) for x, y in duty)
    return _clock_model(duty, tuple((float(t), float(f)) for t, f in held))


@functools.lru_cache(maxsize=64)
def _clock_model(duty: tuple, held: tuple) -> ClockModel:
    return ClockModel(duty, fit_window(duty, held))


def clock_bound(hw: HardwareSpec, tokens) -> bool:
    """Whether an op of ``tokens`` rows is compute-bound, so that its time follows the clock: more rows than the
    ridge point (peak FLOP/s over HBM bytes/s: a GEMM's FLOP per weight byte is its row count)."""
    return _is_number(tokens) and tokens >= hw.gpu_peak_flops / hw.gpu_hbm_bytes_per_s


def _sustained(hw: HardwareSpec, t, tokens, model: ModelSpec | None = None):
    """``t`` at the clocks a compute-bound op sees under sustained load: ops of more tokens than the ridge point
    (peak FLOP/s over HBM bytes/s: a GEMM's FLOP per weight byte is its token count) run at
    ``sustained_fraction`` of the burst rate the tables and curves were measured at."""
    f = sustained_fraction(hw, model)
    if f < 1 and clock_bound(hw, tokens):
        return t / f
    return t


def _analytical_compute_seconds(model: ModelSpec, hw: HardwareSpec, part: str, num_seqs, q_tokens: int,
                                ctx_tokens: int, comp: Compression = NO_COMPRESSION, masked: bool = False,
                                graphed: bool = False, kv_len: int = 0):
    """``compute_seconds`` from the analytical terms (no op table)."""
    tokens = num_seqs * q_tokens
    if part == "embed":  # a gather: memory-bound, tiny
        return hw.kernel_overhead_s + model.hidden_bytes(tokens) / hw.gpu_hbm_bytes_per_s
    if part == "head":  # final norm + LM head on the last position of each sequence only
        return hw.kernel_overhead_s + gemm_seconds(hw, num_seqs, num_seqs * gemm_flops_per_token(model, "head"))
    t = hw.kernel_overhead_s + gemm_seconds(hw, tokens, tokens * gemm_flops_per_token(model, part))
    t = t + tokens * elementwise_bytes_per_token(model, part) / hw.gpu_hbm_bytes_per_s
    if part in ("attn", "layer", "attn_layer"):
        t = t + attention_seconds(model, hw, num_seqs, q_tokens, ctx_tokens, comp, masked, graphed, kv_len)
    return t


def cpu_attention_seconds(model: ModelSpec, hw: HardwareSpec, num_seqs, q_tokens: int, ctx_tokens: int,
                          comp: Compression = NO_COMPRESSION, impl: str = ""):
    """Attention on the host CPU over a KV cache in host memory (FlexGen's CPU delegation): FLOPs / CPU FLOP/s, plus
    the op's fixed cost (storing the new KV, the call, the worker thread) where the profile's op table has it.
    Sparse attention (``comp``) does its share of PV. A decode op is priced from the profile's rows by context
    where it has them: offexec's path ('attn_ctx:B'), or with ``impl`` 'flexgen' (``Plan.cpu_attention_impl``,
    ``flexgen-ref``) FlexGen's own ('attn_ctx_flexgen:B': K and V copied out of its cache layout, converted to fp32,
    attention in fp32), falling back to offexec's rows where the profile has none of FlexGen's."""
    flops = attention_flops(model, num_seqs, q_tokens, ctx_tokens, sparse_share(q_tokens, ctx_tokens, comp))
    if not _is_number(num_seqs):
        return flops / hw.cpu_attention_flops
    if q_tokens == 1:  # (the rows timed dense ops: a sparse one's is scaled, ``sparse_scale``)
        f = sparse_share(q_tokens, ctx_tokens, comp)
        # (FlexGen's rows that hold its whole sub-layer do not price a sparse plan's CPU part, which it prices apart:
        # offexec's rows do, as for a profile without FlexGen's)
        own = impl and not (f < 1 and cpu_attention_row_holds_sublayer(hw, model, impl))
        t = _rows_by_batch_and_context(model, hw, num_seqs, ctx_tokens, f"attn_ctx_{impl}:") if own else None
        if t is None:
            t = _rows_by_batch_and_context(model, hw, num_seqs, ctx_tokens)
        if t is not None:
            return t * sparse_scale(f)
    rate = op_table(hw, model, "cpu", "attn_flops")
    t = flops / (interp(rate, num_seqs) if rate else hw.cpu_attention_flops)
    fixed = op_table(hw, model, "cpu", "attn")
    return t if fixed is None else t + table_seconds(fixed, num_seqs)


def cpu_attention_row_holds_sublayer(hw: HardwareSpec, model: ModelSpec, impl: str) -> bool:
    """Whether the profile prices ``model``'s decode CPU-attention op of ``impl`` from rows that timed the whole
    attention sub-layer: 'flexgen' rows ('attn_ctx_flexgen:B') timed by calling FlexGen's own code
    (offexec/profile.py ``profile_cpu_attention_flexgen_own``: ``load_cache``'s copy into the fp32 workspace, then
    ``TorchDevice.mha_gen`` -- its layer norm and Q/K/V projections on the GPU, the copies of Q and the new K/V to
    the host, the CPU attention, the copy of the result back, the output projection and residual -- with the GPU
    synchronised), which the profile marks by keeping its reproduction of the CPU part beside them as
    'attn_ctx_flexgen_seq:B' (``_flexgen_attention_tables``). Then a plan prices that op alone for the sub-layer
    (``Schedule.cpu_attention_sublayer``: flexgen-ref). False where the rows are the reproduction alone (the CPU
    part only), offexec's, or missing (a preset: the parts are priced apart, each by its own rate)."""
    if impl != "flexgen" or not hw.op_times:
        return False
    key = _layer_key(model)
    parts = {p.split(":")[0] for k, m, p, _ in hw.op_times if k == key and m == "cpu"}
    return "attn_ctx_flexgen" in parts and "attn_ctx_flexgen_seq" in parts


def _rows_by_batch_and_context(model: ModelSpec, hw: HardwareSpec, num_seqs: float, ctx_tokens: int,
                               prefix: str = "attn_ctx:", mode: str = "cpu", affine_below: bool = False) -> float | None:
    """A decode attention op from the profile's rows measured by context for each batch size B, or None where the
    model has none: by default ('cpu', 'attn_ctx:B') (``offexec profile --ops M --cpu-attention-only``: a CPU
    attention op; ``prefix`` 'attn_ctx_flexgen:': another implementation's), or with ``mode`` 'attn' and ``prefix``
    'decode_graph:' a graphed GPU decode op's attention (``attention_seconds``);
    linear in the context between measured contexts, proportional to it past the longest (the work is linear in it),
    the shortest's time below (``affine_below``: as ``table_seconds``); linear in B between measured batch sizes,
    proportional to B past the largest."""
    if not hw.op_times:
        return None
    key = _layer_key(model)
    e = _CTX_INDEX.get((id(hw.op_times), key, mode, prefix))
    if e is None or e[0] is not hw.op_times:  # (the entry holds the tables, so their id is not reused while cached)
        if len(_CTX_INDEX) > 256:
            _CTX_INDEX.clear()
        e = _CTX_INDEX[(id(hw.op_times), key, mode, prefix)] = (hw.op_times, sorted(
            (int(p.split(":")[1]), c) for k, m, p, c in hw.op_times if k == key and m == mode
            and p.startswith(prefix)))
    by_b = e[1]
    if not by_b:
        return None

    def at(curve) -> float:
        return table_seconds(curve, ctx_tokens, affine_below=affine_below)

    bs = [b for b, _ in by_b]
    if num_seqs >= bs[-1]:
        return at(by_b[-1][1]) * num_seqs / bs[-1]
    if num_seqs <= bs[0]:
        return at(by_b[0][1])
    i = next(i for i, b in enumerate(bs) if b >= num_seqs)
    (b0, c0), (b1, c1) = by_b[i - 1], by_b[i]
    w = (num_seqs - b0) / (b1 - b0)
    return (1 - w) * at(c0) + w * at(c1)


_CTX_INDEX: dict = {}  # (id of op_times, layer key, mode, row prefix) -> (op_times, [(B, curve by context)])


# ----------------------------------------------------------------------------------------------------------------
# per-op pricing, for the simulator
# ----------------------------------------------------------------------------------------------------------------


# compute parts whose decode ops offexec replays as CUDA graphs (offexec/graphs.py)
GRAPHED_PARTS = ("layer", "attn_layer", "mlp", "pre_attn", "post_attn", "attn_out")
# those of FlexGen's CPU delegation (attention on the host between them): their graphs take the attention output in
# and give Q/K/V out, static tensors of their own (``footprint.graph_static_bytes``' cpu_attention)
CPU_DELEGATION_PARTS = ("pre_attn", "post_attn", "attn_out")
# the longest decode op (query tokens) offexec replays as a graph: one new token, or TightLLM's recompute of N_r
# tokens plus the new one where N_r + 1 is this small. Such ops are a few dozen small kernels whose host issue
# outlasts their GPU time; longer ones keep the GPU busy while the host issues them, and a graph's private pool
# would hold their larger intermediates for the whole run (``footprint.decode_graph_bytes``)
GRAPH_MAX_Q_TOKENS = 8


def graphed(kind: str, part: str, q_tokens: int, phase: str, max_q_tokens: int = GRAPH_MAX_Q_TOKENS) -> bool:
    """Whether offexec runs an op of this kind, part, query length and phase as a CUDA-graph replay, when its plan
    replays decode ops of up to ``max_q_tokens`` query tokens as graphs (``Plan.graph_q_tokens``; 0: none)."""
    return kind == "compute" and phase == "decode" and 1 <= q_tokens <= max_q_tokens and part in GRAPHED_PARTS


def eager_graph_shapes(plan) -> frozenset:
    """(part, query tokens) of the decode ops ``graphed`` allows that offexec nevertheless runs eagerly: those met at
    fewer than ``Plan.graph_min_uses`` decode steps. Each (part, q, layer, batch) graph is captured where it first
    runs and replayed at the later steps with that q, so a shape that lasts a step or two (a TightLLM recompute
    length) pays its captures for few replays. Empty where ``graph_min_uses`` is 1 (every graphable op graphed, as
    before the field). The simulator and the executor both read it (``op_graphed``)."""
    need = getattr(plan, "graph_min_uses", 1)
    gq = plan.graph_q_tokens
    if need <= 1 or not gq:
        return frozenset()
    steps: dict[tuple, set] = {}
    for op in plan.ops:
        if graphed(op.kind, op.part, op.q_tokens, op.phase, gq):
            steps.setdefault((op.part, op.q_tokens), set()).add(op.step)
    return frozenset(k for k, st in steps.items() if len(st) < need)


def op_graphed(kind: str, part: str, q_tokens: int, phase: str, graph_q_tokens: int, eager: frozenset) -> bool:
    """``graphed``, less the shapes of ``eager_graph_shapes``: whether offexec replays this op of a plan as a graph."""
    return bool(graph_q_tokens) and graphed(kind, part, q_tokens, phase, graph_q_tokens) \
        and (part, q_tokens) not in eager


def capture_extra_seconds(model: ModelSpec, hw: HardwareSpec, part: str, rows: int, first: bool,
                          flat_past_largest: bool = True, q_tokens: int = 1) -> float:
    """What a graphed decode op costs beyond its replay the first time offexec meets it: it runs its static body
    eagerly (issued kernel by kernel) and then records it as a CUDA graph (offexec/graphs.py). From the profile's
    'capture' rows (``offexec profile --ops``: the probe's step-1 ops, by sequences) less its 'graph' row; ``first``:
    the run's first capture, which also creates the graphs' pool and context (row 'capture', 'first'). 0 where the
    profile has no such rows. ``rows``: sequences x query tokens. The simulator charges it to the host (issue time:
    ``sim._capture_extras``). ``flat_past_largest=False``: the proportional reading the model used until 2026-12-02
    (a counterfactual for reports, ``experiments/validation/calib_misses.py``). ``q_tokens`` > 1 (a TightLLM
    recompute) where the profile has ('capture', 'recompute:PART') rows (``profile_graph_new_q``: captures measured
    at the recompute's own rows): that row less the replay at the same rows (``_graph_tokens_curve``), read flat past
    their largest size; without them, the one-token rows as below."""
    if q_tokens > 1 and not first:
        rc, rep_q = op_table(hw, model, "capture", f"recompute:{part}"), _graph_tokens_curve(hw, model, part)
        if rc is not None and rep_q is not None:
            return max(0.0, table_seconds(rc, rows, flat_past_largest)
                       - table_seconds(rep_q, rows, flat_past_largest))
    cap = op_table(hw, model, "capture", "first" if first else part)
    rep = op_table(hw, model, "graph", part)
    if cap is None or rep is None:
        return 0.0
    # Past the row's largest size (a TightLLM recompute: sequences x q rows, 64 x 3 to 64 x 5 where the probe stopped
    # at 64) both rows are read flat, as the host-issue rows are: what a capture adds to a replay is the issuing
    # thread's work (the static body's launches, recording, instantiating), whose kernel count does not grow with the
    # rows. That is the steady-state run offsim predicts: a capture of a shape the process has captured before (the
    # full warm-up ran the whole plan). With the full warm-up, calibration case opt-13b_tightllm_b32_p128_g32's steps
    # at a new q took 23-60 ms beyond steady steps, 0.6-1.5 ms a layer (flat: 1.40 ms; proportional: 4.2-7.0 ms,
    # -27.7 % total -> +2.4 % flat). The proportional reading matched only a process's first capture of a shape
    # (6.6 ms in capture_end under cProfile after the 2-token warm-up): results/validation/calib_misses.md.
    flat = flat_past_largest
    return max(0.0, table_seconds(cap, rows, flat) - table_seconds(rep, rows, flat))


def new_q_capture_seconds(model: ModelSpec, hw: HardwareSpec, part: str, rows: int) -> float:
    """What offexec's first graphed decode op at a query count q > 1 that the run has not captured before costs
    beyond any other layer's capture at that step (the profile's ('capture', 'new_q:PART') row by rows = sequences x
    q: ``offexec profile --ops M``'s ``profile_graph_new_q``); 0 where the profile has no such row. The simulator
    charges it to the host with the op's capture (``sim._capture_extras``)."""
    row = op_table(hw, model, "capture", f"new_q:{part}")
    return 0.0 if row is None else table_seconds(row, rows)


def issue_seconds(op, hw: HardwareSpec, graph_q_tokens: int = 0, model: ModelSpec | None = None,
                  relay: bool = False) -> float:
    """Host time the runtime spends issuing ``op`` (see ``HardwareSpec.issue_compute_s``); a decode op that the plan
    replays as a graph (``graph_q_tokens``: the plan's ``graph_q_tokens``) costs ``issue_graph_s`` where the profile
    measured it. A copy costs its handler's row ('issue', KIND_TENSOR, by bytes: ``offexec profile --ops``, offexec's
    own issue time per handler) where ``model``'s layer shape has one, else ``issue_copy_s``; a compute op its part's
    row ('issue', 'graph:PART' or 'eager:PART', by sequences) where there is one. Where the profile has the issuing
    loop's own time per op ('issue', 'dispatch': finding the next op, its dependencies, the window's bookkeeping,
    between handlers), every op costs that too. ``relay``: the plan relays its unpinned copies
    (``Plan.pageable_copy`` 'relay'): an unpinned H2D copy's staging is issue time too where the issuing thread does
    it (``relay_staged_by_issuer``, ``relay_staging_seconds``)."""
    t = _handler_issue_seconds(op, hw, graph_q_tokens, model) + dispatch_seconds(op, hw, model)
    if relay and op.kind == "h2d" and not getattr(op, "pinned", True) and relay_staged_by_issuer(hw, "h2d"):
        t += relay_staging_seconds(hw, getattr(op, "nbytes", 0))
    return t


def dispatch_seconds(op, hw: HardwareSpec, model: ModelSpec | None) -> float:
    """The issuing loop's time per op outside its handler (``offexec profile``'s ('issue', 'dispatch') row, by the
    probe's sequences per batch, flat past the largest); 0 where the profile has none."""
    if model is None or not hw.op_times:
        return 0.0
    curve = op_table(hw, model, "issue", "dispatch")
    return 0.0 if curve is None else table_seconds(curve, max(getattr(op, "num_seqs", 1) or 1, 1),
                                                   flat_past_largest=True)


def _handler_issue_seconds(op, hw: HardwareSpec, graph_q_tokens: int, model: ModelSpec | None) -> float:
    if op.kind != "compute":
        if model is not None and hw.op_times:
            curve = op_table(hw, model, "issue", f"{op.kind}_{getattr(op, 'tensor', '')}")
            if curve is not None:
                # the probe's copies reach tens of MB; larger ones (prefill's KV stores, weight loads) cost the host
                # no more: the bytes move on the copy engine, not in the issuing thread
                return table_seconds(curve, getattr(op, "nbytes", 0), flat_past_largest=True)
        return hw.issue_copy_s
    g = bool(graph_q_tokens) and graphed(op.kind, getattr(op, "part", ""), getattr(op, "q_tokens", 0),
                                         getattr(op, "phase", ""), graph_q_tokens)
    if model is not None and hw.op_times:
        # the part's own row ('issue', 'graph:PART' | 'eager:PART', by sequences: offexec profile --ops), flat past
        # the largest batch measured: a replay, or an eager op's launches, costs the host the same whatever its size
        curve = op_table(hw, model, "issue", ("graph:" if g else "eager:") + getattr(op, "part", ""))
        if curve is not None:
            return table_seconds(curve, max(getattr(op, "num_seqs", 1), 1), flat_past_largest=True)
    if g and hw.issue_graph_s:
        return hw.issue_graph_s
    return hw.issue_compute_s


def gather_seconds(hw: HardwareSpec, nbytes, copies: int) -> float:
    """Seconds of ``copies`` device-to-device copies of ``nbytes`` (DeepSpeed ZeRO-3's gather of a fetched
    parameter through a flat buffer): each reads and writes every byte at the HBM rate, plus one kernel's overhead."""
    if not copies or (_is_number(nbytes) and nbytes <= 0):
        return 0.0
    return copies * (hw.kernel_overhead_s + 2 * nbytes / hw.gpu_hbm_bytes_per_s)


def duplex_rate(op, model: ModelSpec, hw: HardwareSpec, pageable_copy: str = "",
                comp: Compression = NO_COMPRESSION) -> float | None:
    """For an op whose ``op_seconds`` depends on how long the opposite PCIe direction stays busy (a non-empty h2d or
    d2h copy priced by ``transfer_seconds``): its full rate, so that ``duplex_seconds(hw, op.nbytes, rate,
    other_busy_s)`` is ``op_seconds(op, ..., other_busy_s)`` for any ``other_busy_s`` > 0. None for any other op (its
    price does not depend on the other direction: a copy priced from the op tables, an empty copy, not a copy)."""
    k = op.kind
    if k not in DIRECTIONS or not (_is_number(op.nbytes) and op.nbytes > 0):
        return None
    if hw.op_times and getattr(op, "tensor", None) in COPY_TABLE_TENSORS \
            and op_table(hw, model, "copy", f"{k}_{op.tensor}") is not None:
        return None
    if flexgen_store_curve(op, model, hw, pageable_copy, comp) is not None:
        return None
    return link_bytes_per_s(hw, op.nbytes, k, op.pinned, relayed(op, pageable_copy))


def op_seconds(op, model: ModelSpec, hw: HardwareSpec, other_busy_s: float = 0.0, disk_cached: bool = False,
               graph_q_tokens: int = GRAPH_MAX_Q_TOKENS, comp: Compression = NO_COMPRESSION,
               gather_copies: int = 0, cpu_attention_impl: str = "", pageable_copy: str = "",
               quant_impl: str = "", masked: bool = False, kv_len: int = 0) -> float:
    """Duration of one plan op (see ``offsim.core.plan.Op``). ``other_busy_s``: for PCIe copies, how long the opposite
    direction stays busy from this op's start (duplex). ``disk_cached``: the plan's disk tier is page-cached.
    ``graph_q_tokens``: the plan's ``graph_q_tokens`` (decode ops of up to this many query tokens replayed as CUDA
    graphs; 0: none). ``comp``: the plan's compression (``Compression.from_settings(plan.settings)``): a copy's bytes
    are already its stored size; a compute op adds its dequantize / quantize passes and sparse attention.
    ``gather_copies``: the plan's ``weight_gather_copies``: a weight copy to the GPU is followed, on its stream, by
    that many device copies of its bytes (``gather_seconds``). ``cpu_attention_impl``: the plan's
    ``cpu_attention_impl`` (whose CPU attention path prices its cpu_compute ops). ``pageable_copy``: the plan's
    ``pageable_copy`` ('relay': its unpinned copies are staged through a pinned copy, ``link_bytes_per_s``).
    ``quant_impl``: the plan's ``quant_impl`` (whose code runs a compute op's dequantize passes). ``masked``: the
    plan's workload is left-padded (``Workload.padded``): an eager attention takes a per-sequence key mask (a graphed
    op attends under a mask anyway: its rows are measured so). ``kv_len``: the plan's KV buffer length
    (``Workload.max_len``), what a graphed op attends over (``compute_seconds``)."""
    k = op.kind
    if k == "compute":
        g = bool(graph_q_tokens) and graphed(k, op.part, op.q_tokens, op.phase, graph_q_tokens)
        return compute_seconds(model, hw, op.part, op.num_seqs, op.q_tokens, op.ctx_tokens, g, comp, quant_impl,
                               masked and not g, kv_len)
    if k == "cpu_compute":
        return cpu_attention_seconds(model, hw, op.num_seqs, op.q_tokens, op.ctx_tokens, comp, cpu_attention_impl)
    if k in ("h2d", "d2h"):
        if hw.op_times and getattr(op, "tensor", None) in COPY_TABLE_TENSORS:
            curve = op_table(hw, model, "copy", f"{k}_{op.tensor}")
            if curve is not None:
                return table_seconds(curve, op.nbytes)
        curve = flexgen_store_curve(op, model, hw, pageable_copy, comp)
        if curve is not None:  # FlexGen's own store into its fresh host cache (its copy threads)
            return table_seconds(curve, op.nbytes)
        t = transfer_seconds(hw, op.nbytes, k, pinned=op.pinned, other_busy_s=other_busy_s,
                             relay=relayed(op, pageable_copy))
        if gather_copies and k == "h2d" and getattr(op, "tensor", "") == "weight":
            t += gather_seconds(hw, op.nbytes, gather_copies)
        return t
    if k == "p2p":
        return p2p_seconds(hw, op.nbytes)
    if k == "disk_read":
        return disk_seconds(hw, op.nbytes, "read", disk_cached)
    if k == "disk_write":
        return disk_seconds(hw, op.nbytes, "write", disk_cached)
    raise ValueError(f"op {op.id}: unknown kind {k!r}")
