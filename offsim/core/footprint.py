"""How many bytes each thing takes: the one module that turns shapes into bytes (issue 12).

Everything outside this module asks here, and this module builds on ``ModelSpec``'s primitive sizes only
(``layer_tensors`` / ``layer_weight_bytes``, ``embedding_bytes``, ``kv_bytes_per_token``, ``hidden_bytes``,
``dtype_bytes``).
Names carry units (``_bytes``). Shapes use offexec's names (offexec/model.py): B sequences, T new (query) tokens,
C context tokens (the new ones included), E = d_model, H query heads, Hk KV heads, D head dim, F ffn dim,
V vocabulary, e = ``model.dtype_bytes``; "tokens" n = B·T.

Four layers of sizes:

1. **Tensors**: a layer's weights, a weight *slot* (the streamed part of a layer as the executor holds it on the
   GPU), embeddings, KV per token / sequence / layer / head range, a KV *work buffer* (the executor's per (layer,
   batch) buffer of off-GPU heads, always at full length), the hidden state, Q/K/V, the attention output, the FFN
   intermediate, logits, token ids, RoPE tables.
2. **Op peaks** (``op_peak_bytes``): the most bytes a compute op has alive at once beyond its inputs, as offexec
   computes it (offexec/model.py ``pre_attn``/``attention``/``_sdpa``/``post_attn``/``embed``/``head`` called from
   offexec/executor.py ``_op_*``), its output included. Worked out stage by stage in ``layer_stage_bytes``.
3. **Per-plan totals by tier** (``tier_bytes``): what a placement holds on the GPU, in host memory and on disk:
   resident (weights, KV at full length, activations, embeddings, token ids) plus the minimum working set (weight
   slots, KV work buffers, host staging, the largest op peak). Written over placement *fractions* so that FlexGen's
   LP (offsim/policies/lp.py) uses the very same formula with its fractions as LP variables (it stays affine).
   ``check_fits`` refuses, from this arithmetic alone, a placement that fits nowhere -- before any op is built.
4. **The executor's buffers by purpose** (``executor_gpu_bytes``, ``disk_tier_bytes``, ``executor_host_bytes``): what
   offexec's ``gpu_need``/``disk_need``/``check_plan`` add up.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

from offsim.core.errors import OffsimError
from offsim.core.plan import PlanError
from offsim.core.specs import (NO_COMPRESSION, QUANT_BITS, QUANT_GROUP_SIZE, QUANT_SCALE_BYTES,
                               WEIGHT_GROUP_DIM, Compression, ModelSpec, Workload)

GiB = 1 << 30
TOKEN_ID_BYTES = 8  # int64 token ids (offexec keeps every sequence's ids on the GPU: executor.Executor.tokens)
FP32_BYTES = 4  # RMSNorm statistics are computed in fp32 (transformers' LlamaRMSNorm; offexec/model.py _norm)
TIERS = ("gpu", "cpu", "disk")
# cuBLAS's workspace for the compute stream: PyTorch allocates it through its caching allocator on the first GEMM of
# a (cuBLAS handle, stream) pair and keeps it for the life of the process (4096 KiB x 8 = 32 MiB on Hopper, PyTorch's
# default CUBLAS_WORKSPACE_CONFIG there; about 8 MiB on older GPUs, so 32 MiB bounds both). offexec issues every GEMM
# on one compute stream that lives as long as the process (offexec/memory.py ``executor_streams``), so it is held
# once: a resident GPU constant of every plan.
LIBRARY_WORKSPACE_BYTES = 32 << 20
# The caching allocator's granularity: free bytes inside 2 MiB pages (expandable segments) and 2 MiB small-block
# segments that live blocks keep mapped, which no release can return. Measured on the H200 at the cap: up to 148 MiB
# reserved beyond the live tensors (results/memory/README.md: a llama-2-7b TightLLM run with recompute); counted as a
# resident GPU constant of every plan so that the allocator's rounding cannot push a plan that fits by arithmetic
# over it.
ALLOCATOR_SLACK_BYTES = 256 << 20
# The CUDA graphs' private memory pool (offexec/graphs.py) comes in allocator segments: tensors up to 1 MiB in 2 MiB
# segments, 1-10 MiB ones in 20 MiB segments; one of each (the large one only where a decode op's intermediates pass
# 1 MiB: ``decode_graph_bytes``) beyond the intermediates' own bytes bounds the rounding.
GRAPH_SMALL_SEGMENT_BYTES, GRAPH_LARGE_SEGMENT_BYTES = 2 << 20, 20 << 20
# What every plan holds on the GPU beyond its tensors (tests that build toy GPUs add it to their capacity)
GPU_PROCESS_OVERHEAD_BYTES = LIBRARY_WORKSPACE_BYTES + ALLOCATOR_SLACK_BYTES + GRAPH_SMALL_SEGMENT_BYTES


# ================================================================================================================
# 1. tensors
# ================================================================================================================
# -- weights -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)  # (the fits of TightLLM's candidates ask it ~2·10^5 times: 2.2 of 5.4 s, OPT-66B)
def layer_weight_bytes(model: ModelSpec) -> int:
    """One decoder layer's flat weight buffer (``ModelSpec.layer_weight_bytes``: Σ prod(shape) · e)."""
    return model.layer_weight_bytes()


@functools.lru_cache(maxsize=256)  # a model's layout never changes; the search asks it ~10^5 times
def weight_tensor_ranges_bytes(model: ModelSpec) -> tuple[tuple[str, int, int], ...]:
    """(name, first byte, end byte) of each tensor in a layer's flat buffer, in ``layer_tensors`` order."""
    out, off = [], 0
    for name, shape in model.layer_tensors():
        n = math.prod(shape) * model.dtype_bytes
        out.append((name, off, off + n))
        off += n
    return tuple(out)


def largest_weight_tensor_bytes(model: ModelSpec) -> int:
    """The largest single tensor of a layer (OPT/Llama: an FFN matrix, F·E·e)."""
    return max(hi - lo for _, lo, hi in weight_tensor_ranges_bytes(model))


def weight_slot_base_bytes(model: ModelSpec, gpu_bytes: int) -> int:
    """First byte of a layer's streamed slot when bytes [0, gpu_bytes) are GPU-resident: the start of the tensor
    that holds byte ``gpu_bytes`` -- the executor keeps every tensor whole in one buffer, so the tensor that
    straddles the GPU|offloaded boundary is assembled in the slot (offexec/program.py ``weight_slot_base``)."""
    for _, lo, hi in weight_tensor_ranges_bytes(model):
        if lo <= gpu_bytes < hi:
            return lo
    return gpu_bytes


def weight_slot_bytes(model: ModelSpec, gpu_bytes: int) -> int:
    """GPU bytes of one streamed-weight slot of a layer with [0, gpu_bytes) resident: W − slot base (0 when the
    whole layer is resident). = the streamed bytes W − gpu_bytes plus the straddling tensor's resident head."""
    W = layer_weight_bytes(model)
    return 0 if gpu_bytes >= W else W - weight_slot_base_bytes(model, gpu_bytes)


def weight_slot_straddle_bytes(model: ModelSpec, gpu_bytes: int) -> int:
    """Bytes of a slot beyond the streamed bytes: the resident head of the straddling tensor, copied GPU->GPU into
    the slot when the slot is first filled (offexec/executor.py ``_op_h2d_weight``)."""
    W = layer_weight_bytes(model)
    return 0 if gpu_bytes >= W else weight_slot_bytes(model, gpu_bytes) - (W - gpu_bytes)


# -- sub-layers: FlexGen's granularity ----------------------------------------------------------------------------
SUBLAYERS = ("attn", "mlp")


def sublayer_ranges_bytes(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """[first, end) bytes of each sub-layer's tensors in a layer's flat buffer: the attention's (Q/K/V/output
    projections and the norm before them) come first in ``layer_tensors``, then the MLP's (its norm and FFN). FlexGen
    lists a decoder layer as these two layers and streams their weights separately."""
    return dict(_sublayer_ranges(model))


@functools.lru_cache(maxsize=256)
def _sublayer_ranges(model: ModelSpec) -> tuple[tuple[str, tuple[int, int]], ...]:
    ends = {}
    for name, lo, hi in weight_tensor_ranges_bytes(model):
        sub = "attn" if name.split(".")[0] in ATTN_TENSORS else "mlp"
        a, b = ends.get(sub, (lo, hi))
        ends[sub] = (min(a, lo), max(b, hi))
    if ends["attn"][1] != ends["mlp"][0]:
        raise OffsimError(f"{model.name}: the attention's weights are not one contiguous range before the MLP's")
    return tuple(ends.items())


ATTN_TENSORS = ("q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "self_attn_layer_norm", "input_layernorm")


def sublayer_slot_bytes(model: ModelSpec, gpu_bytes: int, sub: str) -> int:
    """GPU bytes of sub-layer ``sub``'s streamed slot when bytes [0, gpu_bytes) of the layer are resident: from the
    later of the sub-layer's start and the straddling tensor's start (``weight_slot_base_bytes``) to its end; 0 when
    the whole sub-layer is resident."""
    lo, hi = sublayer_ranges_bytes(model)[sub]
    if gpu_bytes >= hi:
        return 0
    return hi - max(lo, weight_slot_base_bytes(model, gpu_bytes))


def sublayer_slot_straddle_bytes(model: ModelSpec, gpu_bytes: int, sub: str) -> int:
    """Bytes of a sub-layer slot beyond its streamed bytes: the straddling tensor's resident head, when it lies in
    this sub-layer."""
    lo, hi = sublayer_ranges_bytes(model)[sub]
    if gpu_bytes >= hi:
        return 0
    return sublayer_slot_bytes(model, gpu_bytes, sub) - (hi - max(lo, gpu_bytes))


def stored_slot_bytes(model: ModelSpec, gpu_bytes: int, sub: str | None,
                      comp: Compression = NO_COMPRESSION) -> int:
    """``weight_slot_bytes`` (``sub`` None: a whole layer) or ``sublayer_slot_bytes`` (``sub`` 'attn' / 'mlp') as
    stored: the slot's fp16 range [slot base, unit end) in its stored size (``stored_weight_bytes``)."""
    lo, hi = (0, layer_weight_bytes(model)) if sub is None else sublayer_ranges_bytes(model)[sub]
    if gpu_bytes >= hi:
        return 0
    return stored_weight_bytes(model, max(lo, weight_slot_base_bytes(model, gpu_bytes)), hi, comp)


def kv_work_buffers(cpu_attention: bool) -> int:
    """Full-length KV work buffers per off-GPU head group: two (a decode step loads one layer's prefix while the
    previous layer's is attended and stored), one with CPU attention (only new tokens' K/V pass through the GPU).
    offexec binds its work buffers up to this count (``offexec/program.py`` ``bind_pool_buffers``)."""
    return 1 if cpu_attention else 2


def weight_slots_bytes(model: ModelSpec, weight_split, weight_buffers: int, sublayer: bool,
                       comp: Compression = NO_COMPRESSION) -> int:
    """GPU bytes of the streamed-weight slots a schedule holds at once: ``weight_buffers`` whole-layer slots of the
    largest ``weight_slot_bytes``; or, streaming sub-layers (always double-buffered: the next streamed sub-layer
    loads while this one computes), per sub-layer kind as many slots as two consecutive streamed sub-layers hold of
    it (one attention and one MLP slot when both stream; two MLP slots when the attention is resident), each of
    that kind's largest ``sublayer_slot_bytes`` -- the executor's pools (offexec/program.py)."""
    gpu = {g for g, _ in weight_split}  # (each layer's GPU bytes, once: a split is mostly one value repeated)
    if not sublayer:
        return weight_buffers * max((stored_slot_bytes(model, g, None, comp) for g in gpu), default=0)
    seq = [sub for g, _ in weight_split for sub in SUBLAYERS if sublayer_slot_bytes(model, g, sub)]
    seq += seq[:1]  # the last of a step, then the first of the next
    total = 0
    for sub in SUBLAYERS:
        live = max((int(a == sub) + int(b == sub) for a, b in zip(seq, seq[1:])), default=0)
        total += live * max((stored_slot_bytes(model, g, sub, comp) for g in gpu), default=0)
    return total


def embedding_bytes(model: ModelSpec) -> int:
    """Token (+ OPT position) embeddings, final norm and an untied LM head (``ModelSpec.embedding_bytes``); the
    executor holds all of them on the GPU (``Executor.emb``)."""
    return model.embedding_bytes()


# -- FlexGen's own layers (the ``flexgen-ref`` policy: FlexGen 0.1.8's code as it runs) ---------------------------
# FlexGen's layer list with ``sep_layer`` (its default): InputEmbed, then each decoder layer's SelfAttention and MLP,
# then OutputEmbed (flex_opt.py ``OptLM.__init__``); each places and loads its own weight list
FLEXGEN_UNITS = ("embed", "attn", "mlp", "head")


@functools.lru_cache(maxsize=256)
def flexgen_unit_tensors(model: ModelSpec, unit: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of the weight tensors of one of FlexGen's layers, in the order of its weight list
    (``init_weight`` of each class in flex_opt.py): 'embed' (InputEmbed: the token embedding, and OPT's learned
    positions, max_positions + 2 rows), 'attn' / 'mlp' (a decoder layer's attention / MLP tensors: ``layer_tensors``
    order, which is SelfAttention's w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out, w_ln, b_ln and MLP's fc1, b_fc1, fc2,
    b_fc2, w_ln, b_ln for OPT), 'head' (OutputEmbed: the final norm, then the LM head -- its own copy of the token
    embedding, which FlexGen allocates again even though OPT ties the two)."""
    h, v = model.d_model, model.vocab_size
    opt = model.family == "opt"
    if unit == "embed":
        return (("embed_tokens", (v, h)),) + ((("embed_positions", (model.max_positions + 2, h)),) if opt else ())
    if unit == "head":
        return (("final_norm.weight", (h,)),) + ((("final_norm.bias", (h,)),) if opt else ()) + \
            (("lm_head", (v, h)),)
    if unit not in SUBLAYERS:
        raise OffsimError(f"FlexGen's layers are {FLEXGEN_UNITS}, not {unit!r}")
    lo, hi = sublayer_ranges_bytes(model)[unit]
    return tuple((name, shape) for (name, t_lo, _), (_, shape) in zip(weight_tensor_ranges_bytes(model),
                                                                      model.layer_tensors()) if lo <= t_lo < hi)


def flexgen_unit_cuts(model: ModelSpec, unit: str, n_disk: int, n_cpu: int) -> tuple[int, int, int, int]:
    """fp16 byte offsets (lo, disk end, CPU end, hi) of one of FlexGen's layers whose first ``n_disk`` tensors are on
    disk, the next ``n_cpu`` in host memory and the rest on the GPU (as FlexGen's placement leaves them: see
    ``offsim.policies.ref.flexgen_unit_homes``): bytes [lo, disk end) on disk, [disk end, CPU end) on the CPU, [CPU
    end, hi) on the GPU. For 'attn' / 'mlp' in the decoder layer's flat buffer (a plan's weight ops address those
    bytes); for 'embed' / 'head' in the layer's own tensors, from 0."""
    tensors = flexgen_unit_tensors(model, unit)
    lo = sublayer_ranges_bytes(model)[unit][0] if unit in SUBLAYERS else 0
    ends = [lo]
    for _, shape in tensors:
        ends.append(ends[-1] + math.prod(shape) * model.dtype_bytes)
    n_disk = min(n_disk, len(tensors))
    n_cpu = min(n_cpu, len(tensors) - n_disk)
    return lo, ends[n_disk], ends[n_disk + n_cpu], ends[-1]


def flexgen_unit_stored_bytes(model: ModelSpec, unit: str, lo: int, hi: int,
                              comp: Compression = NO_COMPRESSION) -> int:
    """Stored bytes of fp16 bytes [lo, hi) of one of FlexGen's layers (``flexgen_unit_cuts``' offsets; tensor
    boundaries for 'embed' / 'head'): ``stored_weight_bytes`` for the decoder's sub-layers; for the embedding and the
    head every tensor in the range as stored (FlexGen compresses their matrices too with --compress-weight:
    ``init_weight_list`` packs every weight of two or more dimensions)."""
    if unit in SUBLAYERS:
        return stored_weight_bytes(model, lo, hi, comp)
    out, at = 0, 0
    for _, shape in flexgen_unit_tensors(model, unit):
        n = math.prod(shape) * model.dtype_bytes
        if lo <= at and at + n <= hi:
            out += _stored_tensor_bytes(model, shape, comp)
        at += n
    return out


def flexgen_unit_home_bytes(model: ModelSpec, unit: str, n_disk: int, n_cpu: int,
                            comp: Compression = NO_COMPRESSION) -> dict[str, int]:
    """Stored bytes on each tier ('gpu', 'cpu', 'disk') of one of FlexGen's layers placed as ``flexgen_unit_cuts``
    describes; the host and disk bytes are what FlexGen's ``load_weight`` copies to the GPU for it."""
    lo, d_end, c_end, hi = flexgen_unit_cuts(model, unit, n_disk, n_cpu)
    return {"gpu": flexgen_unit_stored_bytes(model, unit, c_end, hi, comp),
            "cpu": flexgen_unit_stored_bytes(model, unit, d_end, c_end, comp),
            "disk": flexgen_unit_stored_bytes(model, unit, lo, d_end, comp)}


# -- KV cache ----------------------------------------------------------------------------------------------------
def kv_bytes(model: ModelSpec, num_seqs: int, tokens: int, heads: int | None = None, layers: int = 1) -> int:
    """KV of ``tokens`` tokens of ``num_seqs`` sequences over ``heads`` KV heads (default all) and ``layers``
    layers: num_seqs · tokens · layers · (2 · heads · D · e) -- K and V per head (``kv_bytes_per_token`` is the
    all-heads value 2 · Hk · D · e; a head range is its ``heads / Hk`` share, exact since it is linear in heads)."""
    heads = model.num_kv_heads if heads is None else heads
    return num_seqs * max(tokens, 0) * layers * model.kv_bytes_per_token() * heads // model.num_kv_heads


def kv_buffer_bytes(model: ModelSpec, num_seqs: int, max_len: int, heads: int) -> int:
    """One (layer, GPU batch) KV buffer of ``heads`` heads at full length, [max_len, 2, B, heads, D]: the layout of
    the executor's GPU-resident KV, host KV, disk KV and its KV *work buffers* (offexec/executor.py; a work buffer
    is always allocated at full length, however short the prefix loaded into it)."""
    return kv_bytes(model, num_seqs, max_len, heads)


def kv_buffer_elems(model: ModelSpec, num_seqs: int, max_len: int, heads: int) -> int:
    """Elements of ``kv_buffer_bytes``: max_len · 2 · B · heads · D."""
    return max_len * 2 * num_seqs * heads * model.head_dim


# -- compressed storage: FlexGen's 4-bit group-wise format (the one formula; offexec/quant.py packs exactly this) ---
def quantized_bytes(shape: tuple[int, ...], group_dim: int) -> int:
    """Bytes of a tensor of ``shape`` stored 4-bit group-wise along ``group_dim``: that dim is padded up to whole
    groups of ``QUANT_GROUP_SIZE`` (64) elements; each group holds 64 · 4 / 8 = 32 bytes of packed payload (two
    elements a byte) and its min and step in fp16 (2 · 2 bytes) -- 36 bytes per 64 elements, 0.28125 of fp16:

        groups = ceil(shape[group_dim] / 64) · prod(the other dims)
        bytes  = groups · (64 · 4 / 8 + 2 · 2)

    (FlexGen's TorchCompressedDevice.allocate: data [.., groups, 32] uint8, scale [.., groups, 2] fp16.)"""
    n = shape[group_dim]
    others = math.prod(shape) // n if n else 0
    groups = -(-n // QUANT_GROUP_SIZE) * others
    return groups * (QUANT_GROUP_SIZE * QUANT_BITS // 8 + 2 * QUANT_SCALE_BYTES)


def weight_tensor_is_packed(shape: tuple[int, ...], comp: Compression) -> bool:
    """Whether a layer's weight tensor of ``shape`` is stored 4-bit: the matrices, when weights are compressed (1-D
    biases and norms stay in the model's dtype, as FlexGen keeps them)."""
    return comp.weight and len(shape) >= 2


def _stored_tensor_bytes(model: ModelSpec, shape: tuple[int, ...], comp: Compression) -> int:
    """One weight tensor as stored: 4-bit along its output channel when it is packed (``weight_tensor_is_packed``);
    otherwise fp16 (the model's dtype)."""
    if weight_tensor_is_packed(shape, comp):
        return quantized_bytes(shape, WEIGHT_GROUP_DIM)
    return math.prod(shape) * model.dtype_bytes


@functools.lru_cache(maxsize=256)
def _stored_tensor_table(model: ModelSpec, comp: Compression) -> tuple[tuple[int, int, int], ...]:
    """(first fp16 byte, end fp16 byte, stored bytes) of each tensor of a layer, in ``layer_tensors`` order."""
    return tuple((lo, hi, _stored_tensor_bytes(model, shape, comp))
                 for (_, lo, hi), (_, shape) in zip(weight_tensor_ranges_bytes(model), model.layer_tensors()))


def stored_weight_bytes(model: ModelSpec, lo: int, hi: int, comp: Compression = NO_COMPRESSION) -> int:
    """Stored bytes of bytes [lo, hi) of a layer's flat fp16 weight buffer -- what a copy of that range moves and a
    tier holds. Plans keep addressing weights in fp16 bytes (``Plan.weight_split``, an op's lo/hi); with compressed
    weights a range is each tensor's packed form in the share the range covers of that tensor (rounded up, so a
    non-empty range never moves 0 bytes and the parts of a split cover the whole; a whole tensor or layer is
    exact). Without compression: hi − lo."""
    if not comp.weight:
        return max(hi - lo, 0)
    out = 0
    for t_lo, t_hi, stored in _stored_tensor_table(model, comp):
        a, b = max(lo, t_lo), min(hi, t_hi)
        if b > a:
            out += stored if (a, b) == (t_lo, t_hi) else -(-stored * (b - a) // (t_hi - t_lo))  # rounded up
    return out


def stored_weight_offset_bytes(model: ModelSpec, lo: int, comp: Compression = NO_COMPRESSION) -> int:
    """Where fp16 byte ``lo`` of a layer's flat weights starts in the layer's stored buffer -- every tensor's stored
    form back to back in ``layer_tensors`` order (offexec/weights.py ``PackedLayers``): the stored bytes of the whole
    tensors before it plus, inside a tensor, its share of that tensor's stored bytes rounded down. With the share of a
    range rounded up (``stored_weight_bytes``), [offset(lo), offset(lo) + stored_weight_bytes(lo, hi)) covers every
    byte of the range's tensors' stored forms that a byte of [lo, hi) maps to, ends at the tensor's end when hi is a
    tensor's end, and never passes that end: the copy of a range moves exactly the bytes the plan prices."""
    if not comp.weight:
        return max(lo, 0)
    out = 0
    for t_lo, t_hi, stored in _stored_tensor_table(model, comp):
        if lo >= t_hi:
            out += stored
        else:
            return out + stored * max(lo - t_lo, 0) // (t_hi - t_lo)
    return out


def stored_layer_weight_bytes(model: ModelSpec, comp: Compression = NO_COMPRESSION) -> int:
    """One decoder layer's weights as stored (``stored_weight_bytes`` of the whole layer)."""
    return stored_weight_bytes(model, 0, layer_weight_bytes(model), comp)


def stored_kv_bytes(model: ModelSpec, num_seqs: int, tokens: int, heads: int | None = None, layers: int = 1,
                    comp: Compression = NO_COMPRESSION) -> int:
    """``kv_bytes`` as stored: with a compressed cache, each token's K and V of each head are [D] vectors grouped
    along D (``quantized_bytes((D,), 0)`` each); else fp16."""
    if not comp.cache:
        return kv_bytes(model, num_seqs, tokens, heads, layers)
    heads = model.num_kv_heads if heads is None else heads
    return num_seqs * max(tokens, 0) * layers * heads * 2 * quantized_bytes((model.head_dim,), 0)  # 2: K and V


def kv_load_bytes(model: ModelSpec, num_seqs: int, tokens: int, heads: int | None = None,
                  comp: Compression = NO_COMPRESSION) -> int:
    """Bytes a KV load for GPU attention moves: the stored KV, K and V whole -- with sparse attention too.

    FlexGen's sparse mode loads K, scores it, and only then copies the kept positions' V rows from the host, a
    synchronous gather inside the attention (its ``_sparse_attention_value``). offexec's KV loads are h2d ops that
    run ahead of the compute (prefetched, on their own stream, a CUDA graph replaying the attention), before any score
    exists: a V gather by score would be a device-to-host sync in the middle of the compute op, which the executor's
    issue loop and graphs do not allow. So the plan prices what the executor does: the load moves the whole stored
    KV, and sparse attention saves on the GPU -- the kept V rows gathered and multiplied (``costmodel.sparse_share``:
    the HBM read and PV FLOPs of one-token decode attention) -- not on the link (docs/cost-model.md §4b)."""
    return stored_kv_bytes(model, num_seqs, tokens, heads, 1, comp)


def weight_stored_fraction(model: ModelSpec, comp: Compression = NO_COMPRESSION) -> float:
    """Stored over fp16 bytes of a layer's weights (1 without compression): the constant that keeps FlexGen's LP
    affine (``tier_bytes``, ``lp.flexgen_terms``)."""
    return stored_layer_weight_bytes(model, comp) / layer_weight_bytes(model)


def kv_stored_fraction(model: ModelSpec, comp: Compression = NO_COMPRESSION) -> float:
    """Stored over fp16 bytes of the KV cache (1 without compression): 36 / 128 for a head dim that is a multiple
    of 64."""
    return stored_kv_bytes(model, 1, 1, comp=comp) / kv_bytes(model, 1, 1)


def dequantized_copy_bytes(model: ModelSpec, gbs: int, max_len: int, comp: Compression, sublayer: bool) -> int:
    """GPU bytes of the fp16 working copies that compression adds beside the packed storage, for the op being
    computed: the dequantized weights of the unit it computes (a sub-layer's or a whole layer's, the largest) and,
    with a compressed cache, the dequantized KV of its batch over every head at full length (the attention reads
    fp16; a decode step attends over the whole prefix). Both forms exist at once only inside that op."""
    w = 0
    if comp.weight:
        units = sublayer_ranges_bytes(model).values() if sublayer else ((0, layer_weight_bytes(model)),)
        w = max(hi - lo for lo, hi in units)
    kv = kv_buffer_bytes(model, gbs, max_len, model.num_kv_heads) if comp.cache else 0
    return w + kv


# Score elements a sparse recompute block ranks per pass (offexec/quant.py ``SPARSE_CHUNK_ELEMS``, which must equal it)
SPARSE_CHUNK_ELEMS = 1 << 20


# A pipeline stage sends each GPU batch's hidden states to the next GPU without waiting (offexec.distributed's
# ``StageComm``): at most this many sends are outstanding, each holding its tensor until the peer has received it.
P2P_SENDS_IN_FLIGHT = 2


def p2p_send_bytes(model: ModelSpec, wl: Workload) -> int:
    """GPU bytes a pipeline stage that sends holds in messages not yet received: ``P2P_SENDS_IN_FLIGHT`` hidden
    states of the largest send, a GPU batch's whole prompt (prefill). Without them the first 2-GPU OPT-30B run on the
    H200 ran out of its 16 GiB in prefill, 112 MiB per send past the plan."""
    return P2P_SENDS_IN_FLIGHT * hidden_bytes(model, wl.gpu_batch_size, wl.prompt_len)


def sparse_attention_bytes(model: ModelSpec, gbs: int, max_len: int, comp: Compression) -> int:
    """GPU bytes of top-k sparse attention's temporaries in one attention op (offexec/quant.py ``sparse_sdpa``),
    beyond dense attention's, at the longest context M over every head (the graphs attend over full-length
    buffers); 0 without sparse attention. The larger of a one-query op -- fp32 scores and weights [B, H, M], top-k
    values, indices and kept weights [B, H, k] (4 + 8 + 4 + e bytes), the gathered V rows [B, H, k, D] -- and a
    recompute block ranked ``SPARSE_CHUNK_ELEMS`` score elements at a time (at least one query's [B, H, M]): fp32
    scores and weights, int64 order and ranks, and the masked weights in the model dtype."""
    if comp.sparse_attention >= 1:
        return 0
    e, BH = model.dtype_bytes, gbs * model.num_heads
    k = max(1, int(comp.sparse_attention * (max_len - 1)))
    one = 8 * BH * max_len + BH * k * (16 + e + model.head_dim * e)
    block = (24 + e) * max(SPARSE_CHUNK_ELEMS, BH * max_len)
    return max(one, block)


# -- activations ---------------------------------------------------------------------------------------------------
def hidden_bytes(model: ModelSpec, num_seqs: int, q_tokens: int) -> int:
    """The hidden state [B, T, E] (``ModelSpec.hidden_bytes`` of B·T tokens)."""
    return model.hidden_bytes(num_seqs * q_tokens)


# activations parked on the host that may be loaded back (landed on the GPU) at once: a load waits for the compute
# that consumed the load two back (``offsim.policies.schedule.LandingBuffers``), so the next batch's copy overlaps
# the current batch's compute, and offexec's ``hidden_in`` pool holds this many landing buffers
LANDING_BUFFERS = 2


def landing_buffer_bytes(model: ModelSpec, num_seqs: int, tokens: int) -> int:
    """One buffer that activations parked on the host land in when loaded back (offexec's ``hidden_in`` pool): the
    largest hidden state the plan's h2d ops move, ``tokens`` positions of a GPU batch (a prefill's prompt, or
    TightLLM's recomputed positions). A pool of these, reused through events on the H2D stream, keeps the landing
    copies out of the caching allocator, whose per-stream caches would otherwise hold them where compute cannot
    reuse them (and retry, with a device-wide synchronisation, when it needs memory)."""
    return hidden_bytes(model, num_seqs, tokens)


def q_bytes(model: ModelSpec, num_seqs: int, q_tokens: int) -> int:
    """Q of the new tokens [B, T, H, D]: B·T·H·D·e (= the attention output [B, T, H·D])."""
    return num_seqs * q_tokens * model.q_dim * model.dtype_bytes


def k_bytes(model: ModelSpec, num_seqs: int, q_tokens: int) -> int:
    """K (or V) of the new tokens [B, T, Hk, D]: B·T·Hk·D·e."""
    return num_seqs * q_tokens * model.kv_dim * model.dtype_bytes


def qkv_bytes(model: ModelSpec, num_seqs: int, q_tokens: int) -> int:
    """Q, K and V of the new tokens: B·T·(H + 2·Hk)·D·e (also CPU attention's packed [B, T, H + 2 Hk, D] copy)."""
    return q_bytes(model, num_seqs, q_tokens) + 2 * k_bytes(model, num_seqs, q_tokens)


def attn_out_bytes(model: ModelSpec, num_seqs: int, q_tokens: int) -> int:
    """The attention output [B, T, H·D]: B·T·H·D·e."""
    return q_bytes(model, num_seqs, q_tokens)


# the most rows (sequences x tokens) of the MLP's intermediate at once: above this, offexec runs the MLP in equal
# blocks of at most this many rows (``offexec.model.mlp``), so a prefill's FFN intermediate (OPT-30B, 64 x 512
# tokens: 1.9 GB, a caching-allocator retry per op at a tight cap) stays a block's (0.47 GB). Each block reads the
# MLP's weights again, which at 8,192 rows is a few per cent of its GEMMs at most; decode, graphed and most recompute
# ops (a few thousand rows) never reach it. The footprint counts a block of the full size (an upper bound that grows
# with the rows, as TightLLM's recompute cap needs)
MLP_CHUNK_ROWS = 8192


def ffn_bytes(model: ModelSpec, num_seqs: int, q_tokens: int) -> int:
    """One FFN intermediate [B, T, F]: B·T·F·e (SwiGLU holds two at once: see ``layer_stage_bytes``)."""
    return num_seqs * q_tokens * model.ffn_dim * model.dtype_bytes


def logits_bytes(model: ModelSpec, num_seqs: int, dtype_bytes: int | None = None) -> int:
    """Logits of the LM head [B, V] (offexec's ``head`` takes each sequence's last position only): B·V·e, or
    B·V·4 for the fp32 copy kept when logits are recorded."""
    return num_seqs * model.vocab_size * (model.dtype_bytes if dtype_bytes is None else dtype_bytes)


def scores_bytes(model: ModelSpec, num_seqs: int, q_tokens: int, ctx_tokens: int) -> int:
    """An attention score matrix [B, H, T, C]: B·H·T·C·e (materialised only when attention is not fused)."""
    return num_seqs * model.num_heads * q_tokens * ctx_tokens * model.dtype_bytes


def mask_bytes(num_seqs: int, q_tokens: int, ctx_tokens: int) -> int:
    """What an eager attention under a left-padded batch's key mask holds beyond the unmasked call (offexec
    ``model.visible``, ``Executor._mask``): each sequence's positions [B, T] int64, the bool mask [B, 1, T, C], and
    inside SDPA its additive copy in the model dtype and the memory-efficient kernel's copy padded to 16 columns --
    2 bytes per element each, C rounded up to 16 (measured on the H200: 2.0-3.8 bytes per mask element beyond the
    bool mask, by backend and shape: experiments/offexec/mask_sdpa.py)."""
    B, T, C = num_seqs, q_tokens, ctx_tokens
    c16 = -(-C // 16) * 16
    return B * T * (TOKEN_ID_BYTES + C + 2 * 2 * c16)


def token_ids_bytes(num_seqs: int, max_len: int) -> int:
    """Token ids of every sequence, [num_seqs, max_len + 1] int64 (the executor's ``tokens``; TightLLM's recompute
    restarts from them)."""
    return num_seqs * (max_len + 1) * TOKEN_ID_BYTES


def rope_table_bytes(model: ModelSpec, max_len: int) -> int:
    """Llama's RoPE cos and sin tables, [max_len + 1, D] each in the model dtype (offexec/model.py ``Rope``); 0 for
    OPT (learned positions are in the embeddings)."""
    return 2 * (max_len + 1) * model.head_dim * model.dtype_bytes if model.family == "llama" else 0


# ================================================================================================================
# 2. op peaks
# ================================================================================================================
def attention_is_fused(model: ModelSpec) -> bool:
    """Whether offexec's ``_sdpa`` runs a fused kernel (no score matrix): PyTorch's flash attention takes fp16/bf16
    with head_dim a multiple of 8 up to 256 (torch sdp_utils ``check_head_dim_size_flash``), which every fp16 preset
    meets. Otherwise the math backend materialises scores (and, with GQA, K/V expanded to H heads)."""
    return model.dtype_bytes == 2 and model.head_dim % 8 == 0 and model.head_dim <= 256


def norm_peak_bytes(model: ModelSpec, tokens: int) -> int:
    """Peak bytes of one norm over ``tokens`` rows, its output included. OPT LayerNorm: the output, n·E·e (mean and
    rstd are n floats: ignored). Llama RMSNorm (offexec/model.py ``_norm``): an fp32 copy xf and x² (2 · 4·n·E),
    then xf·rsqrt beside xf (2 · 4·n·E), then xf beside its cast and w · cast (4·n·E + 2·n·E·e): 8·n·E for
    e <= 4."""
    nE = tokens * model.d_model
    if model.family == "opt":
        return nE * model.dtype_bytes
    return max(2 * FP32_BYTES * nE, FP32_BYTES * nE + 2 * nE * model.dtype_bytes)


def layer_stage_bytes(model: ModelSpec, num_seqs: int, q_tokens: int, ctx_tokens: int,
                      kv_groups: int = 1, masked: bool = False) -> dict[str, int]:
    """Bytes alive in each stage of one decoder layer's forward (offexec ``_op_layer``: pre_attn, attention,
    post_attn), beyond its inputs (the hidden state x, the weights and the KV buffers), the output included.

    Term by term (n = B·T; hE = n·E·e, q = B·T·H·D·e, k = v = B·T·Hk·D·e, o = q, f = n·F·e):
    - ``pre_attn``: the norm output h (peak ``norm_peak_bytes``) beside Q, K, V: h + q + 2k, or the norm's own
      peak if larger. Llama's RoPE (``Rope.apply``) holds rotate_half, x·cos, rot·sin and their sum beside its
      input: 4 more of the rotated tensor, for Q (while h, q, k, v live) and then for K (while the rotated Q lives
      too): + max(4q, q + 4k).
    - ``attention``: Q, K, V stay alive (``_op_layer`` keeps them as locals until it returns) and the output o.
      With more than one head group (KV homed on several tiers) ``attention`` writes each group's output into o:
      one group's output (at most o) more. Unfused: the score matrix B·H·T·C twice (scores, softmax), K/V expanded
      to H heads for GQA, and o copied from [B, H, T, D] to [B, T, H·D].
    - ``post_attn``: q + 2k + o stay; then OPT: out_proj and x1 = x + it (2·hE); LayerNorm h (hE) and fc1 (f)
      beside x1; fc1, fc2 and the output beside x1: max(2·hE, 2·hE + f, 3·hE + f) = 3·hE + f. Llama: x1 and the
      norm peak; x1, h, gate/silu (2f) -- then silu(gate) · up: 2f; then h, g, down and the output: x1 + max(8·n·E
      norm, hE + 2f, hE + f + 2·hE).
    - sub-layer ops: ``out_proj`` (the attention sub-layer's end, Q/K/V freed): o, the projection and x1 (o + 2·hE);
      ``mlp`` (the MLP sub-layer beyond its input x1): OPT 2·hE + f, Llama max(norm, hE + 2f, 3·hE + f) -- the
      post_attn terms above without x1.
    - above ``MLP_CHUNK_ROWS`` rows the MLP runs in blocks of at most that many (f_b, h_b: a full block's FFN
      intermediate and projection): h and the output (2·hE) stay, beside OPT f_b + h_b (fc1, then fc2 beside it),
      Llama 2·f_b (gate, silu) or f_b + h_b (g, down).
    - ``masked`` (a left-padded batch, or its worst case reserved: ``Workload.key_masked``): attention holds the
      key mask and SDPA's copies of it (``mask_bytes``); Llama's RoPE gathers cos and sin per sequence
      ([B, T, 1, D] each) beside its pre_attn."""
    B, T, C = num_seqs, q_tokens, ctx_tokens
    n = B * T
    e = model.dtype_bytes
    hE = n * model.d_model * e
    q, k = q_bytes(model, B, T), k_bytes(model, B, T)
    o, f = attn_out_bytes(model, B, T), ffn_bytes(model, B, T)
    qkv = q + 2 * k
    norm = norm_peak_bytes(model, n)
    pre = max(norm, hE + qkv)
    if model.family == "llama":
        rope = 2 * B * T * model.head_dim * e if masked else 0  # cos, sin gathered per sequence
        pre = max(pre, hE + qkv + max(4 * q, q + 4 * k) + rope)
    attn = qkv + o + (mask_bytes(B, T, C) if masked else 0)
    if kv_groups > 1:
        attn += o
    if not attention_is_fused(model):
        expand = 2 * B * model.num_heads * C * model.head_dim * e if model.num_heads != model.num_kv_heads else 0
        attn += 2 * scores_bytes(model, B, T, C) + expand + o
    if n > MLP_CHUNK_ROWS:  # blocked MLP: the norm h and the output beside one block's f_b and its projection h_b
        fb, hb = ffn_bytes(model, MLP_CHUNK_ROWS, 1), hidden_bytes(model, MLP_CHUNK_ROWS, 1)
        mlp = 2 * hE + fb + hb if model.family == "opt" else max(norm, 2 * hE + 2 * fb, 2 * hE + fb + hb)
    else:
        mlp = 2 * hE + f if model.family == "opt" else max(norm, hE + 2 * f, 3 * hE + f)
    post = qkv + o + hE + mlp  # + x1, the output projection's sum, which the MLP reads
    return {"pre_attn": pre, "attention": attn, "post_attn": post,
            # sub-layer ops (offexec ``_op_attn_layer`` frees Q, K, V before the output projection; ``_op_mlp``):
            "out_proj": o + 2 * hE, "mlp": mlp}


def op_peak_bytes(model: ModelSpec, part: str, num_seqs: int, q_tokens: int, ctx_tokens: int,
                  kv_groups: int = 1, record_logits: bool = False, masked: bool = False) -> int:
    """Peak bytes a compute op holds beyond its inputs, its output included, as offexec computes it.

    - ``layer``: the largest of ``layer_stage_bytes``;
    - ``cpu_attn_layer`` (FlexGen's CPU delegation: ``pre_attn`` on the GPU, attention on the CPU, ``post_attn`` on
      the GPU): the pre_attn stage; then Q, K, V (kept as the ``pre`` value) and their packed copy for the d2h
      (``_op_d2h_qkv``: q + 2k); then the post_attn stage with the attention output copied back;
    - sub-layers (FlexGen's granularity): ``attn_layer`` (pre_attn, attention, then the output projection with Q/K/V
      freed), ``cpu_attn_pre`` (its CPU-delegation half on the GPU: pre_attn and the packed Q/K/V), ``attn_out``
      (output projection and residual after CPU attention: 2·hE) and ``mlp``;
    - ``embed``: the gathered embeddings and (OPT) their sum with the positions: 2·hE (OPT), hE (Llama);
    - ``head``: the final norm of the last position [B, E] and the logits [B, V] (+ their fp32 copy when
      ``record_logits``).
    ``masked``: a left-padded batch or its worst case (``Workload.key_masked``): attention under a key mask
    (``layer_stage_bytes``), and OPT's learned positions gathered per sequence in ``embed`` (one more hE).
    """
    B, T = num_seqs, q_tokens
    hE = hidden_bytes(model, B, T)
    if part == "layer":
        return max(layer_stage_bytes(model, B, T, ctx_tokens, kv_groups, masked).values())
    if part == "cpu_attn_layer":
        st = layer_stage_bytes(model, B, T, ctx_tokens, 1, masked)
        packed = 2 * qkv_bytes(model, B, T)
        return max(st["pre_attn"], packed, st["post_attn"])
    if part == "attn_layer":  # the attention sub-layer: norm, Q/K/V, attention, output projection, residual
        st = layer_stage_bytes(model, B, T, ctx_tokens, kv_groups, masked)
        return max(st["pre_attn"], st["attention"], st["out_proj"])
    if part == "cpu_attn_pre":  # sub-layer CPU delegation, GPU side: pre_attn and the packed Q/K/V for the d2h
        return max(layer_stage_bytes(model, B, T, ctx_tokens, 1, masked)["pre_attn"], 2 * qkv_bytes(model, B, T))
    if part == "attn_out":  # after CPU attention: output projection and residual, beside its inputs
        return 2 * hE
    if part == "mlp":
        return layer_stage_bytes(model, B, T, ctx_tokens, kv_groups)["mlp"]
    if part == "embed":
        return (3 if masked else 2) * hE if model.family == "opt" else hE
    if part == "head":
        norm = norm_peak_bytes(model, B)
        out = max(norm, hidden_bytes(model, B, 1) + logits_bytes(model, B))
        return out + (logits_bytes(model, B, FP32_BYTES) if record_logits else 0)
    raise OffsimError(f"op_peak_bytes: unknown part {part!r}; valid: layer, cpu_attn_layer, attn_layer, "
                      "cpu_attn_pre, attn_out, mlp, embed, head")


def op_output_bytes(model: ModelSpec, part: str, num_seqs: int, q_tokens: int) -> int:
    """The value an op leaves behind (included in ``op_peak_bytes``): the hidden state for embed and a layer, Q/K/V
    for pre_attn, nothing for the head (its token ids go into the preallocated ``tokens``)."""
    if part in ("layer", "embed", "post_attn", "cpu_attn_layer", "attn_layer", "attn_out", "mlp"):
        return hidden_bytes(model, num_seqs, q_tokens)
    if part == "pre_attn":
        return qkv_bytes(model, num_seqs, q_tokens)
    return 0


def op_transient_bytes(model: ModelSpec, part: str, num_seqs: int, q_tokens: int, ctx_tokens: int,
                       kv_groups: int = 1, masked: bool = False, output_part: str | None = None) -> int:
    """An eager op's bytes beyond the value it leaves: ``op_peak_bytes`` less ``op_output_bytes`` (the value is
    counted among the run's activations, the rest is freed when the op ends). ``output_part``: the part whose output
    is left where it differs from ``part`` (a CPU delegation's ``pre_attn``, whose peak is priced as
    ``cpu_attn_layer`` / ``cpu_attn_pre``, leaves Q/K/V). Never below 0."""
    peak = op_peak_bytes(model, part, num_seqs, q_tokens, ctx_tokens, kv_groups, masked=masked)
    return max(peak - op_output_bytes(model, output_part or part, num_seqs, q_tokens), 0)


def max_layer_peak_bytes(model: ModelSpec, wl: Workload, cpu_attention: bool = False, kv_groups: int = 1,
                         sublayer: bool = False) -> int:
    """The largest op peak of a block without recompute: a prefill layer over the prompt (T = C = prompt_len), a
    decode layer at the longest context (T = 1, C = max_len), the embedding and the head; with ``sublayer``, the
    attention and MLP sub-layers instead of whole layers. (TightLLM's recompute blocks are sized against what is
    left: ``offsim.policies.tightllm.policy.recompute_memory_cap``.)"""
    gbs, P, M = wl.gpu_batch_size, wl.prompt_len, wl.max_len
    mk = wl.key_masked
    if sublayer:
        decode = ("cpu_attn_pre", "attn_out", "mlp") if cpu_attention else ("attn_layer", "mlp")
        layers = [op_peak_bytes(model, part, gbs, P, P, kv_groups, masked=mk) for part in ("attn_layer", "mlp")] + \
            [op_peak_bytes(model, part, gbs, 1, M, kv_groups, masked=mk) for part in decode]
    else:
        layers = [op_peak_bytes(model, "layer", gbs, P, P, kv_groups, masked=mk),
                  op_peak_bytes(model, "cpu_attn_layer" if cpu_attention else "layer", gbs, 1, M, kv_groups,
                                masked=mk)]
    return max(layers + [op_peak_bytes(model, "embed", gbs, P, P, masked=mk),
                         op_peak_bytes(model, "head", gbs, P, P)])


def graph_static_bytes(model: ModelSpec, wl: Workload, q_tokens: int = 1, cpu_attention: bool = True,
                       homes: bool = False) -> int:
    """GPU bytes of the tensors offexec's decode CUDA graphs read and write at fixed addresses
    (``DecodeGraphs.static_bytes``), allocated outside their pool, sized for the longest graphed op's ``q_tokens``:
    the positions [q] and the key mask [q, max_len] (per sequence too in a padded batch); the hidden state in and out
    [gbs, q, E], and with ``cpu_attention`` (FlexGen's delegation: its graphed ops take the attention output in and give
    Q/K/V out) two more hidden states and two Q/K/V; with ``homes`` (``Plan.graph_attention`` 'written_rows': each
    GPU batch's hidden state lives in a buffer of its own, ``DecodeGraphs.home``) one hidden state per GPU batch."""
    gbs, M, q = wl.gpu_batch_size, wl.max_len, q_tokens
    hidden = hidden_bytes(model, gbs, q)
    static = 2 * hidden + q * (TOKEN_ID_BYTES + M)
    if cpu_attention:
        static += 2 * hidden + 2 * qkv_bytes(model, gbs, q)
    if homes:
        static += wl.num_gpu_batches * hidden
    if wl.key_masked:  # a padded batch: per sequence, its keys [q, max_len] and RoPE positions [q] (offexec/graphs.py)
        static += gbs * q * (M + TOKEN_ID_BYTES)
    return static


def graph_pool_bytes(model: ModelSpec, wl: Workload, q_tokens: int = 1) -> int:
    """GPU bytes of the decode CUDA graphs' private memory pool (``DecodeGraphs.pool_bytes``): every graph captures
    into the one pool and none runs beside another, so it holds one decode op's intermediates -- the largest, at the
    longest graphed op's ``q_tokens`` and the longest context (a graph may attend over the full-length buffer, with up
    to three KV head groups) -- plus its segment rounding. Measured (``offexec run``'s "CUDA graphs" line, H100,
    results/offexec/written_rows_h100_b6ae8be): 0.451 GiB of pool where this counts 0.614 (OPT-30B, 16 x 252 query
    tokens), 0.412 (masked) and 0.354 (written rows) where it counts 0.504 (4 x 822)."""
    gbs, M, q = wl.gpu_batch_size, wl.max_len, q_tokens
    op = max(op_peak_bytes(model, part, gbs, q, M, 3)
             for part in ("layer", "attn_layer", "mlp", "cpu_attn_layer", "cpu_attn_pre", "attn_out"))
    rounding = GRAPH_SMALL_SEGMENT_BYTES + (GRAPH_LARGE_SEGMENT_BYTES if op > (1 << 20) else 0)  # see the constants
    return op + rounding


def decode_graph_bytes(model: ModelSpec, wl: Workload, q_tokens: int = 1, cpu_attention: bool = True,
                       homes: bool = False) -> int:
    """GPU bytes of offexec's decode CUDA graphs (offexec/graphs.py), held from the first decode step to the end,
    when the longest graphed decode op has ``q_tokens`` query tokens (1: one new token; TightLLM's recompute of N_r
    tokens: N_r + 1, up to the plan's ``graph_max_q_tokens``): their static tensors (``graph_static_bytes``) and
    their pool (``graph_pool_bytes``). The pool holds the graphed ops' intermediates, which eager ops would hold in
    the caching allocator instead: the executor counts it in place of those ops' transients
    (``offexec.executor.op_transient_bytes``)."""
    return graph_static_bytes(model, wl, q_tokens, cpu_attention, homes) + graph_pool_bytes(model, wl, q_tokens)


# ================================================================================================================
# 3. per-plan totals by tier
# ================================================================================================================
@dataclass(frozen=True)
class Placement:
    """What a policy puts where, as far as memory goes: per layer (gpu, cpu) bytes of its flat weights (the rest on
    disk), KV heads (gpu, cpu) (the rest on disk), where activations wait between layers, how many streamed-weight
    slots are live at once (2 with prefetch: double buffering; 1 without), FlexGen's CPU attention, and whether
    weights stream per sub-layer."""

    weight_split: tuple[tuple[int, int], ...]
    kv_split: tuple[int, int]
    hidden_home: str = "gpu"
    weight_buffers: int = 2
    cpu_attention: bool = False
    sublayer: bool = False  # weights stream per sub-layer (attention, MLP), as FlexGen's code does
    compression: Compression = NO_COMPRESSION  # 4-bit weights / KV (stored sizes) and their fp16 working copies
    # FlexGen's own placement of whole tensors (``Schedule.unit_homes``, ``flexgen-ref``): ((unit, n_disk, n_cpu), ...)
    # per FlexGen layer; () = ``weight_split``'s flat prefix with the embeddings on the GPU
    unit_homes: tuple = ()

    def fractions(self, model: ModelSpec) -> dict[str, float]:
        """Placement fractions (FlexGen's LP variables) of the weights (the mean over layers), KV heads and
        activations."""
        W, L, n = layer_weight_bytes(model), model.num_layers, model.num_kv_heads
        wg = sum(g for g, _ in self.weight_split) / (W * L)
        wc = sum(c for _, c in self.weight_split) / (W * L)
        kg, kc = self.kv_split
        hg = 1.0 if self.hidden_home == "gpu" else 0.0
        return {"wg": wg, "wc": wc, "wd": 1 - wg - wc, "cg": kg / n, "cc": kc / n, "cd": (n - kg - kc) / n,
                "hg": hg, "hc": 1 - hg}


def tier_bytes(model: ModelSpec, wl: Workload, x: Mapping[str, Any], cpu_attention: bool = False,
               weight_buffers: int = 2, op_peak: int | None = None, sublayer: bool = False,
               comp: Compression = NO_COMPRESSION) -> dict[str, dict[str, Any]]:
    """Bytes per tier and purpose of a block on a placement given as fractions ``x`` (wg, wc, wd, cg, cc, cd, hg,
    hc; floats or LP expressions -- every term is a constant or a constant times one fraction, so the LP stays
    affine): what is resident for the whole run plus the minimum working set. Returns {tier: {purpose: bytes}}.

    GPU: embeddings; token ids (and RoPE tables); cuBLAS's workspace and the allocator's rounding
    (``GPU_PROCESS_OVERHEAD_BYTES``); offexec's decode CUDA graphs (``decode_graph_bytes``); wg · L · W
    resident weights; ``weight_buffers`` streamed slots of
    (wc + wd) · W, or with ``sublayer`` one attention and one MLP slot, (wc + wd) · W together (the straddling tensor of a partial split is added by ``check_fits``: not affine); cg of the KV at
    full length (all prompts, all layers); KV work buffers of the off-GPU heads at full length, (cc + cd) of a
    [max_len, 2, gbs, Hk, D] buffer, two of them (the current position's and the next one's, loaded ahead) or one
    with CPU attention (a prefill position's, until stored); hg of the block's activations at the prompt (nb
    batches of [gbs, prompt_len, E]), or with activations parked on the host (hc) one batch's copy in and out; and
    the largest op peak (``max_layer_peak_bytes``).
    Host: wc · L · W weights; cc of the KV; hc of the block's activations; staging of what comes from disk -- wd of
    ``weight_buffers`` layers, and cd of one full-length KV buffer read ahead plus two prefill stores in flight
    (``schedule.DiskStoreBuffers``).
    Disk: wd · L · W weights and cd of the KV.

    Compression (``comp``): every stored weight and KV byte above is its stored size (W and the KV times
    ``weight_stored_fraction`` / ``kv_stored_fraction``, constants, so the LP stays affine), and the GPU also holds
    the fp16 working copies of the op being computed (``dequantized_copy_bytes``) and, with sparse attention, its
    top-k temporaries (``sparse_attention_bytes``)."""
    L, W = model.num_layers, layer_weight_bytes(model)
    gbs, P, M = wl.gpu_batch_size, wl.prompt_len, wl.max_len
    n_kv = model.num_kv_heads
    kv_all = kv_bytes(model, wl.num_prompts, M, n_kv, L)
    kv_buf = kv_buffer_bytes(model, gbs, M, n_kv)
    hidden_block = hidden_bytes(model, wl.num_prompts, P)
    hidden_batch = hidden_bytes(model, gbs, P)
    w_off, c_off = x["wc"] + x["wd"], x["cc"] + x["cd"]
    if comp.weight or comp.cache:  # stored sizes (the fractions are constants: affine still)
        W = W * weight_stored_fraction(model, comp)
        rc = kv_stored_fraction(model, comp)
        kv_all, kv_buf = kv_all * rc, kv_buf * rc
        kv_prompt = kv_bytes(model, gbs, P) * rc
    else:
        kv_prompt = kv_bytes(model, gbs, P)
    if op_peak is None:
        op_peak = max_layer_peak_bytes(model, wl, cpu_attention, sublayer=sublayer)
    slot_layers = 1 if sublayer else weight_buffers  # sub-layers: an attention and an MLP slot, one layer's worth
    gpu = {"embeddings": embedding_bytes(model),
           "token ids": token_ids_bytes(wl.num_prompts, M) + rope_table_bytes(model, M),
           "library workspace": LIBRARY_WORKSPACE_BYTES, "allocator slack": ALLOCATOR_SLACK_BYTES,
           "CUDA graphs": decode_graph_bytes(model, wl),
           "resident weights": x["wg"] * (L * W),
           "weight slots": w_off * (slot_layers * W),
           "resident KV": x["cg"] * kv_all,
           "KV work buffers": c_off * (kv_work_buffers(cpu_attention) * kv_buf),
           "activations": x["hg"] * hidden_block + x["hc"] * (2 * hidden_batch),
           "op peak": op_peak}
    if comp.weight or comp.cache:
        gpu["dequantized copies"] = dequantized_copy_bytes(model, gbs, M, comp, sublayer)
    if comp.sparse_attention < 1:
        gpu["sparse attention"] = sparse_attention_bytes(model, gbs, M, comp)
    cpu = {"weights": x["wc"] * (L * W), "KV": x["cc"] * kv_all, "activations": x["hc"] * hidden_block,
           "disk staging": x["wd"] * (weight_buffers * W) + x["cd"] * (kv_buf + 2 * kv_prompt)}
    disk = {"weights": x["wd"] * (L * W), "KV": x["cd"] * kv_all}
    return {"gpu": gpu, "cpu": cpu, "disk": disk}


def placement_tier_bytes(model: ModelSpec, wl: Workload, pl: Placement) -> dict[str, dict[str, int]]:
    """``tier_bytes`` of a concrete placement, in whole bytes, with the weight slot's straddling tensor."""
    x = pl.fractions(model)
    kv_groups = sum(1 for h in _head_groups(model, pl.kv_split) if h)
    peak = max_layer_peak_bytes(model, wl, pl.cpu_attention, kv_groups, pl.sublayer)
    cz = pl.compression
    out = tier_bytes(model, wl, x, pl.cpu_attention, pl.weight_buffers, peak, pl.sublayer, cz)
    # exact integers where fractions were used: sums of the split, heads, and the slot as the executor sizes it
    L, W = model.num_layers, layer_weight_bytes(model)
    kg, kc = pl.kv_split
    kd = model.num_kv_heads - kg - kc
    M, gbs = wl.max_len, wl.gpu_batch_size
    gpu, cpu, disk = out["gpu"], out["cpu"], out["disk"]
    sw = functools.partial(stored_weight_bytes, model, comp=cz)
    skv = functools.partial(stored_kv_bytes, model, comp=cz)
    gpu["resident weights"] = sum(sw(0, g) for g, _ in pl.weight_split)
    gpu["weight slots"] = weight_slots_bytes(model, pl.weight_split, pl.weight_buffers, pl.sublayer, cz)
    gpu["resident KV"] = skv(wl.num_prompts, M, kg, L)
    gpu["KV work buffers"] = kv_work_buffers(pl.cpu_attention) * sum(skv(gbs, M, h) for h in (kc, kd))
    cpu["weights"] = sum(sw(g, g + c) for g, c in pl.weight_split)
    cpu["KV"] = skv(wl.num_prompts, M, kc, L)
    disk_w = sum(sw(g + c, W) for g, c in pl.weight_split)
    kv_staging = skv(gbs, M, kd) + 2 * skv(gbs, wl.prompt_len, kd)
    cpu["disk staging"] = pl.weight_buffers * max((sw(g + c, W) for g, c in pl.weight_split), default=0) + \
        kv_staging
    disk["weights"] = disk_w
    disk["KV"] = skv(wl.num_prompts, M, kd, L)
    if pl.unit_homes:
        _flexgen_unit_tier_bytes(model, pl, out, kv_staging)
    return {t: {k: int(v) for k, v in d.items()} for t, d in out.items()}


def _flexgen_unit_tier_bytes(model: ModelSpec, pl: Placement, out: dict, kv_staging: int) -> None:
    """``placement_tier_bytes``' weights for FlexGen's own placement of whole tensors (``Placement.unit_homes``),
    in place of the flat prefix's: each layer's GPU-, host- and disk-homed tensors (the embedding's and the head's
    too: FlexGen places them like any layer), and on the GPU the streamed weights of two consecutive FlexGen layers
    -- its ``weight_read_buf`` of a layer lives from its load, one layer ahead, to the layer's last batch (the
    plan's loads wait for the slot two loads back: ``Schedule.prefetch``) -- whole tensors, so no straddling head."""
    L = model.num_layers
    hb = {u: flexgen_unit_home_bytes(model, u, nd, nc, pl.compression) for u, nd, nc in pl.unit_homes}
    dec = [hb[u] for u in SUBLAYERS]
    gpu, cpu, disk = out["gpu"], out["cpu"], out["disk"]
    gpu["embeddings"] = hb["embed"]["gpu"] + hb["head"]["gpu"]
    gpu["resident weights"] = L * sum(x["gpu"] for x in dec)
    off = {u: x["cpu"] + x["disk"] for u, x in hb.items()}
    units = list(SUBLAYERS) if pl.sublayer else ["layer"]
    off["layer"] = sum(off[u] for u in SUBLAYERS)
    seq = ["embed"] + units * min(L, 2) + ["head"]  # a step's order of streamed layers, around to the next step
    gpu["weight slots"] = max(off[a] + off[b] for a, b in zip(seq, seq[1:] + seq[:1]))
    cpu["weights"] = L * sum(x["cpu"] for x in dec) + hb["embed"]["cpu"] + hb["head"]["cpu"]
    disk_of = {u: x["disk"] for u, x in hb.items()}
    disk_of["layer"] = sum(disk_of[u] for u in SUBLAYERS)
    cpu["disk staging"] = pl.weight_buffers * max(disk_of.values()) + kv_staging
    disk["weights"] = L * sum(x["disk"] for x in dec) + hb["embed"]["disk"] + hb["head"]["disk"]


def resident_bytes(model: ModelSpec, wl: Workload, pl: Placement) -> dict[str, int]:
    """Bytes held for the whole run on each tier (a plan's ``resident``): weights, KV at full length, the block's
    activations where they live, embeddings, token ids, RoPE tables, cuBLAS's workspace and the allocator's slack
    (GPU). The working set (slots, work buffers,
    staging, op peaks) is what plan ops allocate and free."""
    t = placement_tier_bytes(model, wl, pl)
    gpu = t["gpu"]
    hidden_gpu = hidden_bytes(model, wl.num_prompts, wl.prompt_len) if pl.hidden_home == "gpu" else 0
    return {"gpu": gpu["embeddings"] + gpu["token ids"] + gpu["library workspace"] + gpu["allocator slack"]
            + gpu["CUDA graphs"] + gpu["resident weights"] + gpu["resident KV"] + hidden_gpu,
            "cpu": t["cpu"]["weights"] + t["cpu"]["KV"] + t["cpu"]["activations"],
            "disk": t["disk"]["weights"] + t["disk"]["KV"]}


def gib(nbytes: float) -> str:
    """``nbytes`` in GiB for messages: two decimals, or three significant digits below 0.1 GiB."""
    x = nbytes / GiB
    return f"{x:.2f} GiB" if abs(x) >= 0.1 or x == 0 else f"{x:.3g} GiB"


def fits(model: ModelSpec, capacity: Mapping[str, int], wl: Workload, pl: Placement,
         tiers: tuple[str, ...] = TIERS) -> bool:
    """Whether the placement's resident bytes plus minimum working set fit each of ``tiers``: ``check_fits``'s test
    without its message, for the fits that trim a placement in a loop (``tiers=("gpu",)``: the GPU alone)."""
    t = placement_tier_bytes(model, wl, pl)
    return all(sum(t[tier].values()) <= int(capacity.get(tier, 0)) for tier in tiers)


def check_fits(model: ModelSpec, capacity: Mapping[str, int], wl: Workload, pl: Placement, what: str = "plan") -> None:
    """Refuse, from arithmetic alone, a placement whose resident bytes plus minimum working set exceed a tier:
    one line naming every short tier with its shortfall, need and capacity in GiB and its largest parts
    (``PlanError``). Cheap (no op is built), so every plan can afford it before thousands of ops are emitted."""
    t = placement_tier_bytes(model, wl, pl)
    names = {"gpu": "GPU memory", "cpu": "host memory", "disk": "disk"}
    short = []
    for tier in TIERS:
        need = sum(t[tier].values())
        cap = int(capacity.get(tier, 0))
        if need > cap:
            parts = sorted(((v, k) for k, v in t[tier].items() if v), reverse=True)[:3]
            detail = ", ".join(f"{k} {gib(v)}" for v, k in parts)
            short.append(f"{names[tier]} short by {gib(need - cap)} (needs {gib(need)}: {detail}; capacity {gib(cap)})")
    if short:
        raise PlanError(f"{what} does not fit: {'; '.join(short)}; use fewer or smaller GPU batches or place less "
                        "on the short tier")


def _head_groups(model: ModelSpec, kv_split) -> tuple[int, int, int]:
    kg, kc = kv_split
    return kg, kc, model.num_kv_heads - kg - kc


# ================================================================================================================
# 4. the executor's buffers
# ================================================================================================================
def executor_gpu_bytes(model: ModelSpec, wl: Workload, weight_split, kv_split, pool_buffers: Mapping[str, int],
                       activation_peak_bytes: int, op_transient_bytes: int, graph_q_tokens: int = 1,
                       comp: Compression = NO_COMPRESSION, sublayer: bool = False,
                       sends_hidden: bool = False, landing_tokens: int = 0, graph_cpu_attention: bool = True,
                       graph_homes: bool = False) -> dict[str, int]:
    """GPU bytes offexec holds for a plan, by purpose (offexec/executor.py ``Executor._setup`` and the op handlers):

    - embeddings (``emb``), token ids [nb, gbs, max_len + 1] int64 and RoPE tables (``tokens``, ``rope``);
    - cuBLAS's workspace of the compute stream (``LIBRARY_WORKSPACE_BYTES``) and the caching allocator's rounding
      (``ALLOCATOR_SLACK_BYTES``); the decode CUDA graphs' static tensors and pool (``decode_graph_bytes``, for
      the plan's longest graphed decode op, ``graph_q_tokens``; ``graph_cpu_attention``: graphed CPU-delegation
      ops, ``graph_homes``: per-batch hidden states of written-rows graphs);
    - resident weights: [0, g) of every layer (``w_res``);
    - resident KV: [L, nb] buffers of the GPU-homed heads at full length (``kv_gpu``);
    - weight slots: ``pool_buffers['wslot']`` slots of the largest ``weight_slot_bytes`` (whole layers), or
      ``pool_buffers['wslot_attn' / 'wslot_mlp']`` of the largest ``sublayer_slot_bytes`` (sub-layers);
    - KV work buffers: ``pool_buffers['kvwork_cpu' / 'kvwork_disk']`` full-length buffers of each off-GPU group;
    - activation landing buffers: ``pool_buffers['hidden_in']`` buffers of ``landing_buffer_bytes`` (the plan's
      longest activation load: ``landing_tokens`` positions) that parked activations are loaded back into;
    - activations: the most other GPU values (hidden states made on the GPU, pre_attn's Q/K/V, attention outputs)
      alive at once in plan order (``activation_peak_bytes``, from offexec/program.py);
    - op transients: the largest eager op peak beyond its output (``op_transient_bytes``; the graphed ops' are in
      the graphs' pool);
    - with compression (``comp``): resident weights and slots (compressed weights), resident KV and KV work buffers
      (compressed cache) in their stored sizes (``stored_weight_bytes``, ``stored_slot_bytes``, ``stored_kv_bytes``)
      and the fp16 working copies a compute op dequantizes into (``dequantized_copy_bytes``; ``sublayer``: weight
      units are sub-layers); with sparse attention its top-k temporaries (``sparse_attention_bytes``);
    - a pipeline stage that sends hidden states to the next GPU (``sends_hidden``): its sends in flight
      (``p2p_send_bytes``)."""
    L, M, gbs, nb = model.num_layers, wl.max_len, wl.gpu_batch_size, wl.num_gpu_batches
    kg, kc, kd = _head_groups(model, kv_split)
    slot = max((stored_slot_bytes(model, g, None, comp) for g, _ in weight_split), default=0)
    sub_slots = {sub: max((stored_slot_bytes(model, g, sub, comp) for g, _ in weight_split), default=0)
                 for sub in SUBLAYERS}
    out = {"embeddings": embedding_bytes(model),
            "token ids": token_ids_bytes(wl.num_prompts, M) + rope_table_bytes(model, M),
            "library workspace": LIBRARY_WORKSPACE_BYTES, "allocator slack": ALLOCATOR_SLACK_BYTES,
            "CUDA graphs": decode_graph_bytes(model, wl, graph_q_tokens, graph_cpu_attention, graph_homes),
            "resident weights": sum(stored_weight_bytes(model, 0, g, comp) for g, _ in weight_split),
            "resident KV": L * nb * stored_kv_bytes(model, gbs, M, kg, comp=comp),
            "weight slots": pool_buffers.get("wslot", 0) * slot
            + sum(pool_buffers.get(f"wslot_{sub}", 0) * sub_slots[sub] for sub in SUBLAYERS),
            "KV work buffers": pool_buffers.get("kvwork_cpu", 0) * stored_kv_bytes(model, gbs, M, kc, comp=comp)
            + pool_buffers.get("kvwork_disk", 0) * stored_kv_bytes(model, gbs, M, kd, comp=comp),
            "activation landing buffers": pool_buffers.get("hidden_in", 0) * landing_buffer_bytes(model, gbs,
                                                                                                 landing_tokens),
            "activations": activation_peak_bytes, "op transients": op_transient_bytes}
    if comp.weight or comp.cache:
        out["dequantized copies"] = dequantized_copy_bytes(model, gbs, M, comp, sublayer)
    if comp.sparse_attention < 1:  # top-k sparse attention's temporaries (``sparse_attention_bytes``)
        out["sparse attention"] = sparse_attention_bytes(model, gbs, M, comp)
    if sends_hidden:
        out["p2p sends in flight"] = p2p_send_bytes(model, wl)
    return out


def disk_tier_bytes(model: ModelSpec, wl: Workload, weight_split, kv_split,
                    comp: Compression = NO_COMPRESSION) -> int:
    """Bytes of offexec's disk-tier files: every layer's disk-homed weights (in their stored size,
    ``stored_weight_bytes``) at the largest layer's stride (``weights.bin``) and the [L, nb] full-length KV buffers of
    the disk-homed heads (``kv.bin``; stored size, ``stored_kv_bytes``)."""
    W = layer_weight_bytes(model)
    stride = max((stored_weight_bytes(model, g + c, W, comp) for g, c in weight_split), default=0)
    _, _, kd = _head_groups(model, kv_split)
    L, nb = model.num_layers, wl.num_gpu_batches
    return stride * L + L * nb * stored_kv_bytes(model, wl.gpu_batch_size, wl.max_len, kd, comp=comp)


def executor_host_bytes(model: ModelSpec, wl: Workload, kv_split, staging_peak_bytes: int,
                        comp: Compression = NO_COMPRESSION) -> dict[str, int]:
    """Host bytes offexec holds, by purpose: the weights' host master (every layer in full, plus embeddings:
    offexec/weights.py ``ModelWeights``; host-homed weight bytes are views of it), the [L, nb] full-length KV buffers
    of host-homed heads (``kv_host``, stored size) and the most disk/CPU-attention staging alive at once
    (``staging_peak_bytes``, from offexec/program.py). With compressed weights also every layer in its stored form
    (``PackedLayers``, made from the master; host-homed weight bytes are views of it instead)."""
    _, kc, _ = _head_groups(model, kv_split)
    packed = {"packed weights": model.num_layers * stored_layer_weight_bytes(model, comp)} if comp.weight else {}
    return {**packed, "weights master": model.num_layers * layer_weight_bytes(model) + embedding_bytes(model),
            "host KV": model.num_layers * wl.num_gpu_batches
            * stored_kv_bytes(model, wl.gpu_batch_size, wl.max_len, kc, comp=comp),
            "staging": staging_peak_bytes}
