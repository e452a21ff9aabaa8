"""FlexGen's 4-bit group-wise quantization and top-k sparse attention, as PyTorch kernels (issue 16).

The executor runs compressed weights and KV with it (offexec/weights.py ``PackedLayers`` stores every layer with
``quantize_weight`` / ``to_bytes``, compute ops ``dequantize_into`` their fp16 working copy; KV buffers hold
``pack_vectors``' form, attention ops ``unpack_vectors_into`` the working KV) and runs sparse attention with
``sparse_sdpa`` (``model.attention``'s ``sparse``); ``top_k_sparse_attention`` is its one-token reference.

**Format** (FlexGen, ICML'23 §5; its ``CompressionConfig(num_bits=4, group_size=64)``): a tensor is cut into groups
of ``QUANT_GROUP_SIZE`` = 64 consecutive elements along one dim; each group keeps its min and its step
(max − min) / 15 in fp16 and every element as the 4-bit integer round((x − min) / step), two to a byte (the even
element in the high nibble). Weights [out, in] are grouped along dim 0, the output channel (FlexGen's
``group_dim=0``); the KV cache along the head dimension D (FlexGen's ``group_dim=2`` of [s, b·heads, D]). A size
that is not a multiple of 64 is padded up to whole groups by repeating the last element (so the padding never widens
a group's range; FlexGen pads with zeros), and the padding is dropped on ``dequantize``. Bytes per 64 elements:
32 payload + 2 · 2 (min, step) = 36, exactly ``offsim.core.footprint.quantized_bytes`` -- the size formula offsim
prices, which ``Packed.nbytes`` must equal (tests/test_compression.py).

Error bound per group: rounding to the grid is at most step / 2 = (max − min) / 30, plus fp16 rounding of min, step
and the output (``round_trip_bound``).

Device-agnostic: plain tensor ops, computed in fp32 and stored in fp16/uint8. Tested on the CPU; the CUDA check
(tests/test_compression.py, marked gpu) compares the packed bytes with the CPU's and has not run on a GPU yet. On
CUDA with Triton the KV loads and stores run fused kernels instead (offexec/quant_triton.py): the dequantize within
an fp16 ulp of ``_values``, the quantize (``pack_vectors``, ``pack_vectors_into``) byte for byte ``quantize``'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offexec import quant_triton
from offsim.core.footprint import SPARSE_CHUNK_ELEMS, quantized_bytes
from offsim.core.specs import QUANT_BITS, QUANT_GROUP_SIZE, WEIGHT_GROUP_DIM

LEVELS = (1 << QUANT_BITS) - 1  # 15: the largest 4-bit code
FP16_EPS = 2.0 ** -10  # fp16's spacing at 1 (10 mantissa bits): relative rounding is at most half of it


@dataclass(frozen=True)
class Packed:
    """A tensor in 4-bit group-wise form. ``data``: uint8 [..., groups, 32], two codes a byte; ``scale``: fp16
    [..., groups, 2], each group's (min, step); ``...`` are the tensor's other dims in order (the grouped dim moved
    last and cut into groups). ``shape`` and ``dim``: the original tensor's shape and grouped dim."""

    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    dim: int

    @property
    def nbytes(self) -> int:
        """Bytes held: payload + per-group min and step (= ``footprint.quantized_bytes(shape, dim)``)."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def to(self, device) -> "Packed":
        """The same packed tensor on ``device`` (what a copy between tiers moves: ``nbytes``)."""
        return Packed(self.data.to(device, non_blocking=True), self.scale.to(device, non_blocking=True), self.shape,
                      self.dim)


def _groups(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """x with ``dim`` moved last, padded up to whole groups by repeating its last element, as [..., groups, 64]
    fp32; and the unpadded length of that dim."""
    xm = x.movedim(dim, -1).float()
    n = xm.shape[-1]
    pad = -n % QUANT_GROUP_SIZE
    if pad:
        xm = torch.cat([xm, xm[..., -1:].expand(*xm.shape[:-1], pad)], dim=-1)
    return xm.reshape(*xm.shape[:-1], -1, QUANT_GROUP_SIZE), n


def quantize(x: torch.Tensor, dim: int) -> Packed:
    """``x`` (any float dtype, any device, non-empty along ``dim``) in 4-bit groups of 64 along ``dim``."""
    if x.dim() == 0 or x.shape[dim] == 0:
        raise ValueError(f"quantize needs a non-empty dim {dim}, got shape {tuple(x.shape)}")
    dim = dim % x.dim()
    g, _ = _groups(x, dim)  # [..., G, 64]
    mn = g.amin(dim=-1, keepdim=True).half()  # stored in fp16: quantize against the stored values
    step = ((g.amax(dim=-1, keepdim=True) - mn.float()) / LEVELS).half()
    s = step.float()
    codes = torch.where(s > 0, torch.round((g - mn.float()) / torch.where(s > 0, s, 1.0)), 0.0)
    codes = codes.clamp_(0, LEVELS).to(torch.uint8)  # [..., G, 64]
    data = (codes[..., 0::2] << 4) | codes[..., 1::2]  # [..., G, 32]: even element high, odd element low
    return Packed(data.contiguous(), torch.cat([mn, step], dim=-1).contiguous(), tuple(x.shape), dim)


def _values(data: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 values [..., n] of packed groups (``data`` [..., G, 32], ``scale`` [..., G, 2]), padding dropped: the
    one dequantize formula (``dequantize`` and ``dequantize_into`` both use it, so they agree bit for bit)."""
    codes = torch.stack([data >> 4, data & 0xF], dim=-1).flatten(-2)  # [..., G, 64]
    mn, step = scale[..., 0:1].float(), scale[..., 1:2].float()
    x = codes.float() * step + mn  # [..., G, 64]
    return x.flatten(-2)[..., :n]  # drop the padding: [..., n]


def dequantize(p: Packed, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The fp16 (or ``dtype``) tensor of ``p``, in its original shape, on ``p``'s device."""
    return _values(p.data, p.scale, p.shape[p.dim]).to(dtype).movedim(-1, p.dim).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# the stored form as flat bytes (the executor's tiers hold weights this way: offexec/weights.py PackedLayers)
# ----------------------------------------------------------------------------------------------------------------
# Rows of groups dequantize_into turns into values per pass: its fp32 temporaries (codes, values) are ~12 bytes an
# element (quantizing, ``pack_vectors_into``: ~24), so 2^20 elements bound them to 12-24 MiB whatever the tensor
# (inside the allocator's slack, footprint.ALLOCATOR_SLACK_BYTES, which the plan's GPU bytes carry), where one pass
# over OPT-30B's 205 M-element fc1 would take 2.5 GB the plan does not have.
DEQUANT_CHUNK_ELEMS = 1 << 20


def to_bytes(p: Packed) -> torch.Tensor:
    """``p`` as one flat uint8 tensor: its codes, then its scales' bytes (``p.nbytes`` of them)."""
    return torch.cat([p.data.reshape(-1), p.scale.reshape(-1).view(torch.uint8)])


def _split_bytes(buf: torch.Tensor, shape: tuple[int, ...], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (data [..., G, 32], scale [..., G, 2]) of ``to_bytes``'s layout in the uint8 tensor ``buf``."""
    dim = dim % len(shape)
    others = tuple(d for i, d in enumerate(shape) if i != dim)
    groups = -(-shape[dim] // QUANT_GROUP_SIZE)
    nd = math.prod(others) * groups * (QUANT_GROUP_SIZE // 2)
    if buf.numel() != stored_nbytes(shape, dim):
        raise ValueError(f"{buf.numel()} bytes do not hold a tensor of shape {list(shape)} packed along dim {dim} "
                         f"({stored_nbytes(shape, dim)} bytes)")
    data = buf[:nd].view(*others, groups, QUANT_GROUP_SIZE // 2)
    scale = buf[nd:].view(torch.float16).view(*others, groups, 2)
    return data, scale


def dequantize_into(buf: torch.Tensor, shape: tuple[int, ...], dim: int, out: torch.Tensor) -> torch.Tensor:
    """Dequantize ``to_bytes``'s form in ``buf`` (uint8, on ``out``'s device) into ``out`` (shape ``shape``, any
    float dtype) in place -- the same values as ``dequantize`` -- a bounded number of rows at a time
    (``DEQUANT_CHUNK_ELEMS``), so the temporaries stay small; on CUDA with Triton one fused launch instead
    (``quant_triton``). Returns ``out``."""
    data, scale = _split_bytes(buf, tuple(shape), dim)
    n = shape[dim % len(shape)]
    om = out.movedim(dim, -1)  # [..., n], the grouped dim last (a view)
    if quant_triton.available(out) and om.dim() <= 5:  # one fused launch, no temporaries (offexec/quant_triton.py)
        quant_triton.dequantize_rows(data, scale, om)
        return out
    rows_d, rows_s, rows_o = data.reshape(-1, *data.shape[-2:]), scale.reshape(-1, *scale.shape[-2:]), \
        om.reshape(-1, n)
    if rows_o.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():  # reshape copied: writes lost
        raise ValueError("dequantize_into needs an output whose grouped dim can be moved last as a view")
    step = max(1, DEQUANT_CHUNK_ELEMS // max(n, 1))
    for r in range(0, rows_o.shape[0], step):
        rows_o[r:r + step].copy_(_values(rows_d[r:r + step], rows_s[r:r + step], n))
    return out


def quantize_weight(w: torch.Tensor) -> Packed:
    """A weight matrix [out, in], grouped along its output channel (FlexGen's ``group_dim=0``)."""
    return quantize(w, WEIGHT_GROUP_DIM)


def quantize_weight_into(w: torch.Tensor, buf: torch.Tensor, device=None) -> None:
    """``to_bytes(quantize_weight(w))`` written into the uint8 ``buf`` (``stored_nbytes`` of them), quantized on
    ``device`` (default: ``w``'s) a block of whole groups -- 64·k consecutive output rows, about
    ``DEQUANT_CHUNK_ELEMS`` elements -- at a time: a row block is contiguous in ``w`` (one plain copy to the
    device), its groups are whole (the last block pads as the one-pass form does), and its codes and scales are a
    slice of ``buf``'s data and scale sections, so the bytes are the one-pass result's. The fp32 temporaries stay
    within the allocator's slack, where one pass over OPT-30B's fc1 would take gigabytes a run's cap does not hold."""
    data, scale = _split_bytes(buf, tuple(w.shape), WEIGHT_GROUP_DIM)  # [in, G, 32], [in, G, 2]
    g = QUANT_GROUP_SIZE
    rows = max(g, DEQUANT_CHUNK_ELEMS // max(w.shape[1], 1) // g * g)
    for r0 in range(0, w.shape[0], rows):
        p = quantize_weight(w[r0:r0 + rows].to(device if device is not None else w.device))
        g0 = r0 // g
        data[:, g0:g0 + p.data.shape[1]].copy_(p.data)
        scale[:, g0:g0 + p.scale.shape[1]].copy_(p.scale)


def quantize_kv(kv: torch.Tensor) -> Packed:
    """K or V with the head dimension last ([..., D], offexec's layouts), grouped along D."""
    return quantize(kv, -1)


def stored_nbytes(shape: tuple[int, ...], dim: int) -> int:
    """Bytes of a tensor of ``shape`` packed along ``dim``: offsim's formula (``footprint.quantized_bytes``), the
    one source of truth; ``quantize(...).nbytes`` equals it."""
    return quantized_bytes(tuple(shape), dim % len(shape))


def round_trip_bound(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Per element, the most |x − dequantize(quantize(x))| may be: half a step of its group, (max − min) / 15 / 2,
    plus fp16 rounding -- of the stored min and step (the step's error times up to 15 codes) and of the fp16
    output -- bounded by ``FP16_EPS`` times the group's largest magnitude, three times over. Shape of ``x``."""
    g, n = _groups(x, dim % x.dim())
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    big = torch.maximum(mn.abs(), mx.abs())
    bound = (mx - mn) / LEVELS / 2 + 3 * FP16_EPS * (big + (mx - mn))
    b = bound.expand_as(g).flatten(-2)[..., :n]
    return b.movedim(-1, dim % x.dim())


def pack_vectors(x: torch.Tensor) -> torch.Tensor:
    """K or V ``x`` [..., D] (head dimension last) packed per vector along D: uint8 [..., stored_nbytes((D,), 0)],
    each vector's codes then its groups' (min, step) bytes -- how the executor's compressed KV buffers hold a token's
    head (``footprint.stored_kv_bytes`` per vector). On CUDA with Triton one fused launch into a fresh buffer (the
    same bytes: ``quant_triton.quantize_rows``; the decode store inside the CUDA graphs runs it)."""
    if quant_triton.available(x) and 0 < x.dim() <= 5 and x.shape[-1]:
        out = torch.empty(*x.shape[:-1], stored_nbytes((x.shape[-1],), 0), dtype=torch.uint8, device=x.device)
        return quant_triton.quantize_rows(x, out)
    p = quantize_kv(x)
    return torch.cat([p.data.flatten(-2), p.scale.flatten(-2).view(torch.uint8)], dim=-1)


def pack_vectors_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``pack_vectors(x)`` written into ``out`` [S, ..., stored] (uint8, any strides) a bounded number of leading
    rows at a time (``DEQUANT_CHUNK_ELEMS``): quantizing takes several fp32 temporaries per element, so a prefill's
    K or V in one pass (OPT-30B, 24 x 1984 tokens: 0.3 G elements) would need GBs the plan does not have. On CUDA
    with Triton one fused launch instead, no temporaries (``quant_triton.quantize_rows``: the chunks' dozen small
    kernels each made the H200's 4-bit prefill store-bound). Returns ``out``."""
    if out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"packed KV of shape {list(out.shape)} cannot hold vectors of shape {list(x.shape)}")
    if quant_triton.available(out) and x.device == out.device and x.dim() <= 5 and out.stride(-1) == 1 \
            and x.shape[-1]:
        return quant_triton.quantize_rows(x, out)
    per_row = max(1, x[0].numel()) if x.shape[0] else 1
    step = max(1, DEQUANT_CHUNK_ELEMS // per_row)
    for r in range(0, x.shape[0], step):
        out[r:r + step] = pack_vectors(x[r:r + step])
    return out


def unpack_vectors_into(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``pack_vectors``'s form ``buf`` [S, ..., stored] dequantized into ``out`` [S, ..., D] (any float dtype, any
    strides; on ``buf``'s device) -- the same values as ``dequantize`` -- a bounded number of leading rows at a time
    (``DEQUANT_CHUNK_ELEMS``), or on CUDA with Triton one fused launch (``quant_triton``). Returns ``out``."""
    D = out.shape[-1]
    groups = -(-D // QUANT_GROUP_SIZE)
    nd = groups * (QUANT_GROUP_SIZE // 2)
    if buf.shape[-1] != stored_nbytes((D,), 0) or buf.shape[:-1] != out.shape[:-1]:
        raise ValueError(f"packed KV of shape {list(buf.shape)} does not hold vectors of shape {list(out.shape)}")
    data = buf[..., :nd].unflatten(-1, (groups, QUANT_GROUP_SIZE // 2))
    scale = buf[..., nd:].view(torch.float16).unflatten(-1, (groups, 2))
    if quant_triton.available(out) and out.dim() <= 5:  # one fused launch, no temporaries (offexec/quant_triton.py)
        return quant_triton.dequantize_rows(data, scale, out)
    per_row = max(1, out[0].numel()) if out.shape[0] else 1
    step = max(1, DEQUANT_CHUNK_ELEMS // per_row)
    for r in range(0, out.shape[0], step):
        out[r:r + step].copy_(_values(data[r:r + step], scale[r:r + step], D))
    return out


# ----------------------------------------------------------------------------------------------------------------
# sparse attention
# ----------------------------------------------------------------------------------------------------------------
def top_k_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fraction: float,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention that keeps, per query and head, the top ``fraction`` of the cached key positions (FlexGen's
    ``--attn-sparsity``, its ``_sparse_attention_value``) -- the reference implementation, for one new token.

    q: [B, H, 1, D]; k, v: [B, Hk, C, D] (H a multiple of Hk: GQA); ``mask``: bool [1, 1, 1, C], the key positions
    that exist, a prefix (offexec's full-length buffers), or None (all do); the new token's K/V is the last of them. As FlexGen:
    softmax over every existing key, then keep the weights of the top int(fraction · cached) cached positions plus the
    new token's own (always kept), unrenormalised, and multiply only those V rows -- so only they need loading.
    ``fraction`` ≥ 1 is dense attention: the same call as ``offexec.model._sdpa`` for one token (FlexGen switches to
    its dense path the same way), so it equals the project's attention exactly. Returns [B, H, 1, D]."""
    from offexec.model import _sdpa  # the project's attention (one token: no causal mask beyond ``mask``)

    if not 0 < fraction:
        raise ValueError(f"fraction must be positive, got {fraction}")
    B, H, T, D = q.shape
    G = H // k.shape[1]
    if T != 1:
        raise ValueError(f"top_k_sparse_attention is for one new token (T = 1), got T = {T}")
    if fraction >= 1:
        return _sdpa(q, k, v, 1, G, mask)
    C = k.shape[2]
    kx = k.repeat_interleave(G, dim=1) if G > 1 else k  # [B, H, C, D]
    vx = v.repeat_interleave(G, dim=1) if G > 1 else v
    scores = (q.float() @ kx.float().transpose(-1, -2)) / math.sqrt(D)  # [B, H, 1, C]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.softmax(scores, dim=-1)  # [B, H, 1, C]
    # the existing positions are a prefix [0, p]: p is the new token's, [0, p) the cached ones
    p = C - 1 if mask is None else int(mask.sum()) - 1
    keep = max(1, int(fraction * p)) if p else 0
    out = w[..., p:p + 1] * vx[:, :, p:p + 1].float()  # [B, H, 1, D]: the new token, always kept
    if keep:
        top_w, top_i = w[..., :p].topk(keep, dim=-1)  # [B, H, 1, keep]
        rows = torch.gather(vx.float(), 2, top_i.squeeze(2).unsqueeze(-1).expand(B, H, keep, D))  # V rows loaded
        out = out + top_w @ rows
    return out.to(q.dtype)


def keep_count(fraction: float, others: int) -> int:
    """How many of ``others`` cached key positions a query keeps (FlexGen's ``int(attn_sparsity · (s − 1))``, at
    least one where there is one): the V rows of the kept positions are the ones attention multiplies."""
    return max(1, int(fraction * others)) if others > 0 else 0


# ``SPARSE_CHUNK_ELEMS`` (offsim's, imported above): score elements [B, n·G, T, C] a recompute block ranks per
# pass -- its fp32 and int64 temporaries (scores, weights, order, ranks) stay 4-8 MiB each whatever the block, where
# one pass over a whole-context recompute would take GBs; offsim counts them (``footprint.sparse_attention_bytes``)


def sparse_sdpa(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, fraction: float, T: int,
                keys: torch.Tensor | None = None, k_cap: int | None = None,
                first: "int | torch.Tensor" = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k sparse attention as the executor runs it (``model._sdpa``'s arguments; any T, masks, GQA): each query
    keeps its own position and the top ``keep_count(fraction, n)`` of the n other key positions it sees, by score;
    the softmax is over every key it sees and the kept weights are not renormalised (FlexGen's
    ``_sparse_attention_value``, which ``top_k_sparse_attention`` spells out for one token).

    q: [B, n·G, T, D]; K, V: [B, n, C, D]; ``keys``: bool [B or 1, 1, T, C], the positions each query sees (a query's
    own position is the last it sees), or None (causal, aligned to the bottom right). ``first``: the first position
    (cache row) whose query is sparse -- a generated token's; a query at an earlier row (a prompt token that TightLLM
    recomputes) keeps every position it sees, as the dense prefill that made its KV did, so that recomputing KV gives
    what loading it would (an int, or a 0-d tensor on the device that a CUDA graph reads per replay). QKᵀ is whole
    (in the inputs' dtype, q scaled first, as SDPA does; scores and softmax in fp32). PV:

    - one query (T = 1, decode): the kept positions' V rows are gathered -- ``k_cap`` of them per head (default
      ``keep_count(fraction, C − 1)``, the most any query of this C keeps; a fixed size, so that a CUDA graph
      replays it: the graphs pass the count for the full-length buffer), the ranks past a query's own count weighted
      0 -- and only they are multiplied: the V read and PV FLOPs offsim prices (``costmodel.sparse_share``);
    - several (TightLLM's recompute, T > 1): a masked product, the weights of the dropped positions zeroed, over
      every V row (per query the kept set differs; gathering T · keep rows per head would outgrow the op's memory),
      ``SPARSE_CHUNK_ELEMS`` score elements at a time.

    No host sync (CUDA-graph safe). Returns (out [B, n·G, T, D] in q's dtype, the number of kept (query head, query,
    V row) entries as a 0-d int64 tensor on q's device)."""
    B, HG, _, D = q.shape
    C = K.shape[2]
    if keys is None:
        cols = torch.arange(C, device=q.device)
        keys = (cols.unsqueeze(0) <= (C - T + torch.arange(T, device=q.device)).unsqueeze(1)).view(1, 1, T, C)
    if T == 1:
        return _sparse_one(q, K, V, fraction, keys, k_cap)
    step = max(1, SPARSE_CHUNK_ELEMS // max(1, B * HG * C))
    outs, count = [], 0
    for t0 in range(0, T, step):
        o, c = _sparse_block(q[:, :, t0:t0 + step], K, V, fraction, keys[..., t0:t0 + step, :], first)
        outs.append(o)
        count = count + c
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), count


def _select(q, K, fraction: float, vis):
    """Scores and the selection rule of ``sparse_sdpa`` for queries q [B, n·G, T, D] seeing ``vis`` [B|1, 1, T, C]
    of K [B, n, C, D]: (softmax weights fp32 [B, n·G, T, C], the others' scores with the own position at −inf, own
    position [B|1, 1, T, 1], positions each keeps [B|1, 1, T, 1], the other positions each sees [B|1, 1, T, 1])."""
    B, HG, T, D = q.shape
    n, C = K.shape[1], K.shape[2]
    qs = (q * (1.0 / math.sqrt(D))).reshape(B, n, (HG // n) * T, D)
    scores = (qs @ K.transpose(-1, -2)).float().view(B, HG, T, C).masked_fill_(~vis, float("-inf"))
    w = torch.softmax(scores, dim=-1)
    cols = torch.arange(C, device=q.device)
    own = (vis.long() * (cols + 1)).argmax(-1, keepdim=True)  # the last position each query sees: its own
    seen = vis.sum(-1, keepdim=True) - 1
    keep = torch.where(seen > 0, (seen.double() * fraction).floor().long().clamp_(min=1), 0)  # keep_count
    return w, scores.masked_fill_(cols == own, float("-inf")), own, keep, seen


def _sparse_one(q, K, V, fraction: float, vis, k_cap):
    """``sparse_sdpa`` for one query: gather the kept V rows (``k_cap`` per head, the ranks past each query's count
    weighted 0) and multiply only them."""
    B, HG, _, D = q.shape
    n, C = K.shape[1], K.shape[2]
    G = HG // n
    w, others, own, keep, _ = _select(q, K, fraction, vis)
    kc = min(C, keep_count(fraction, C - 1) if k_cap is None else k_cap)
    _, idx = others.topk(kc, dim=-1)  # [B, n·G, 1, kc], best first
    tw = w.gather(-1, idx) * (torch.arange(kc, device=q.device) < keep)  # ranks past the count: weight 0
    rows = torch.gather(V, 2, idx.reshape(B, n, G * kc, 1).expand(B, n, G * kc, D))  # the V rows read
    out = (tw.to(V.dtype).view(B, HG, 1, 1, kc) @ rows.view(B, HG, 1, kc, D)).view(B, HG, 1, D).float()
    ow = w.gather(-1, own.expand(B, HG, 1, 1))  # [B, n·G, 1, 1]
    orow = torch.gather(V, 2, own.expand(B, n, 1, D)).float()  # [B, n, 1, D]: the own position's V row
    out = out + ow * (orow.repeat_interleave(G, dim=1) if G > 1 else orow)
    return out.to(q.dtype), (keep + 1).expand(B, HG, 1, 1).sum()


def _sparse_block(q, K, V, fraction: float, vis, first):
    """``sparse_sdpa`` for a block of queries: the dropped positions' weights zeroed, every V row multiplied; the
    queries at rows before ``first`` keep everything they see."""
    B, HG, T, D = q.shape
    n, C = K.shape[1], K.shape[2]
    w, others, own, keep, seen = _select(q, K, fraction, vis)
    keep = torch.where(own >= first, keep, seen)
    cols = torch.arange(C, device=q.device)
    order = others.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, cols.expand_as(order))
    del order
    wk = w.masked_fill_(~((rank < keep) | (cols == own)), 0.0).to(V.dtype).view(B, n, (HG // n) * T, C)
    out = (wk @ V).view(B, HG, T, D)
    return out.to(q.dtype), (keep + 1).expand(B, HG, T, 1).sum()


# ----------------------------------------------------------------------------------------------------------------
# the rate offsim prices the passes with
# ----------------------------------------------------------------------------------------------------------------
def measure_dequantize_bytes_per_s(device: str = "cuda", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """fp16 bytes per second that ``dequantize`` produces on ``device`` for a weight matrix of ``nbytes`` fp16
    bytes, best of ``repeats`` after one warm-up: ``HardwareSpec.quant_bytes_per_s`` as a profile can measure it
    (what ``offexec profile`` can write under that key; offsim prices every dequantize and quantize pass with it)."""
    import time

    cols = 4096
    rows = max(QUANT_GROUP_SIZE, nbytes // 2 // cols)
    w = torch.randn(rows, cols, device=device, dtype=torch.float16)
    p = quantize_weight(w)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    dequantize(p)
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dequantize(p)
        sync()
        best = min(best, time.perf_counter() - t0)
    return rows * cols * 2 / best
