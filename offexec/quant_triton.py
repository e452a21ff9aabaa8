"""One fused kernel per dequantize on CUDA (Triton): 4-bit groups straight into the fp16 output, no temporaries.

Why: ``quant._values`` in PyTorch makes fp32 temporaries of ~12 bytes an element, so ``dequantize_into`` and
``unpack_vectors_into`` work in 2^20-element chunks of about seven kernels each. On OPT-30B that is ~600 chunks per
layer's weights and, for a decode step's KV (96 sequences x 56 heads x 128 x K/V: more than 2^20 per token row), one
chunk per token row -- about a hundred thousand small kernels per decode step, which made the first 4-bit run on the
H200 launch-bound (its two-token warm-up took 32 s where offsim prices a few; results/compression/README.md). Here one
launch per call reads each group's 32 bytes and (min, step) and writes its 64 values.

The layout is general: ``rows`` of ``groups`` groups each, rows indexed by up to four dims with their own strides in
the data (uint8), the scales (fp16: min then step per group) and the output (any float dtype; the grouped dim with
stride ``out_stride_n``), so both ``to_bytes``' weight layout (codes, then scales) and ``pack_vectors``' KV layout
(per vector: codes then scales) and strided outputs (a slice of the working KV, a weight moved to put its grouped dim
last) are one kernel. Values: code * step + min in fp32, then the output dtype -- ``quant._values``' formula (the
compiler may fuse the multiply-add, which can differ from PyTorch's two roundings in the last fp32 bit; after
rounding to fp16 that is at most one fp16 ulp, tests/test_compression.py checks it on a GPU).

Used where ``available(out)``: a CUDA output and Triton importable (the GPU machine's torch ships it; the CPU CI has
none and keeps the PyTorch path). Integer arguments are not specialised on (``do_not_specialize``), so a new row
count never compiles a new kernel inside a CUDA-graph capture.

The KV store has its own kernel (``quantize_rows``, used by ``quant.pack_vectors`` / ``pack_vectors_into`` on CUDA):
``quant.quantize``'s PyTorch passes make ~24 bytes of fp32 temporaries an element, so a prefill's K or V went
through ``pack_vectors_into`` in 2^20-element chunks of a dozen kernels each -- the H200's 4-bit OPT-30B prefill ran
at 2730 tok/s where offsim, pricing the store at the fused dequantize's rate, predicted 8721. Here one launch reads
each vector's group of 64 values (any strides) and writes its 32 code bytes and its (min, step) fp16 bytes in
``pack_vectors``' layout. Its bytes are ``quant.quantize``'s exactly: the same fp32 operations in the same order, each
correctly rounded (``tl.div_rn``, not Triton's approximate fp32 division; round half to even done with ``floor`` and
a parity fix, exact on [0, 15]; no multiply-add the compiler could fuse), the tail group padded by repeating the
vector's last element. One exception: a group whose min is a zero that appears as both +0 and -0 may store the other
sign of zero (which of two equal values a min reduction returns is unspecified, in PyTorch too); its codes, its step
and every dequantized value are the same.
"""
from __future__ import annotations

import torch

try:  # pragma: no cover - exercised on the GPU machine only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from offsim.core.specs import QUANT_BITS, QUANT_GROUP_SIZE

HALF = QUANT_GROUP_SIZE // 2  # bytes of codes per group (two 4-bit codes a byte)
BLOCK_ROWS = 64  # rows per program
ALIGN_BYTES = 16  # the widest vector access claimed (and checked) when the layout allows it


def available(out: torch.Tensor) -> bool:
    """Whether the fused kernel serves an output like ``out``."""
    return triton is not None and out.is_cuda


if triton is not None:  # pragma: no cover - compiled and run on the GPU machine only
    @triton.jit
    def _row_index(r, r1, r2, r3):
        """A flat row number (or a block's first) -> its four row dims' indices (sizes r0 x r1 x r2 x r3)."""
        i3 = r % r3
        t = r // r3
        i2 = t % r2
        t = t // r2
        return t // r1, t % r1, i2, i3

    @triton.jit(do_not_specialize=list(range(3, 24)))  # every integer argument (rows ... on), by position
    def _dequant_kernel(d_ptr, s_ptr, o_ptr, rows, groups, n, r1, r2, r3,
                        d0, d1, d2, d3, dg, s0, s1, s2, s3, sg, o0, o1, o2, o3, on,
                        BLOCK_R: tl.constexpr, HALF_G: tl.constexpr, ROW_RUN: tl.constexpr,
                        OUT_CONTIG: tl.constexpr, D_ALIGN: tl.constexpr, O_ALIGN: tl.constexpr):
        # Memory-bound: what matters is wide, coalesced accesses. The integer strides are not specialised on (a
        # graph capture must never compile), so the layout facts the compiler would otherwise infer come in as
        # constexpr flags the host checked (``dequantize_rows``):
        # - ROW_RUN: a program's BLOCK_R rows are consecutive in the innermost row dim and contiguous in the output
        #   (o3 == 1, r3 a multiple of BLOCK_R) -- a weight grouped along its output channel, whose grouped dim has
        #   the large stride: each of a group's 64 values is stored as one contiguous run over the rows.
        # - OUT_CONTIG: the grouped dim is contiguous in the output (on == 1) -- KV vectors: the high and low nibbles
        #   are interleaved in registers and a group's 64 values stored as one contiguous run.
        # - D_ALIGN / O_ALIGN: every row's first code byte / output element is a multiple of this (bytes / elements),
        #   so loads and stores may be vectorised that wide.
        pid = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        k = tl.arange(0, BLOCK_R).to(tl.int64)
        if ROW_RUN:
            r0 = pid * BLOCK_R
            i0, i1, i2, i3 = _row_index(r0, r1, r2, r3)
            live = (r0 + k) < rows
            d_off = i0 * d0 + i1 * d1 + i2 * d2 + i3 * d3 + g * dg + k * d3
            s_off = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + g * sg + k * s3
            o_off = i0 * o0 + i1 * o1 + i2 * o2 + i3 + k  # o3 == 1
        else:
            r = pid * BLOCK_R + k
            live = r < rows
            i0, i1, i2, i3 = _row_index(r, r1, r2, r3)
            d_off = i0 * d0 + i1 * d1 + i2 * d2 + i3 * d3 + g * dg
            s_off = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + g * sg
            o_off = i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3
        d_off = tl.multiple_of(d_off, D_ALIGN)
        j = tl.arange(0, HALF_G).to(tl.int64)
        b = tl.load(d_ptr + d_off[:, None] + j[None, :], mask=live[:, None], other=0)
        mn = tl.load(s_ptr + s_off, mask=live, other=0.0).to(tl.float32)
        st = tl.load(s_ptr + s_off + 1, mask=live, other=0.0).to(tl.float32)
        v_hi = (b >> 4).to(tl.float32) * st[:, None] + mn[:, None]  # the even element sits in the high nibble
        v_lo = (b & 15).to(tl.float32) * st[:, None] + mn[:, None]
        ty = o_ptr.dtype.element_ty
        if OUT_CONTIG:
            v = tl.interleave(v_hi, v_lo)  # [BLOCK_R, 2 * HALF_G]: element 2j from the high nibble, 2j + 1 low
            e = g * (2 * HALF_G) + tl.arange(0, 2 * HALF_G).to(tl.int64)
            o_off = tl.multiple_of(o_off, O_ALIGN)
            tl.store(o_ptr + o_off[:, None] + e[None, :], v.to(ty), mask=live[:, None] & (e < n)[None, :])
        else:
            e_hi = g * (2 * HALF_G) + 2 * j
            tl.store(o_ptr + o_off[:, None] + e_hi[None, :] * on, v_hi.to(ty),
                     mask=live[:, None] & (e_hi < n)[None, :])
            tl.store(o_ptr + o_off[:, None] + (e_hi + 1)[None, :] * on, v_lo.to(ty),
                     mask=live[:, None] & (e_hi + 1 < n)[None, :])


    @triton.jit(do_not_specialize=list(range(2, 17)))  # every integer argument (rows ... on), by position
    def _quant_kernel(x_ptr, o_ptr, rows, groups, n, r1, r2, r3, x0, x1, x2, x3, xn, o0, o1, o2, o3,
                      BLOCK_R: tl.constexpr, HALF_G: tl.constexpr, LEVELS: tl.constexpr, X_CONTIG: tl.constexpr,
                      FULL: tl.constexpr, X_ALIGN: tl.constexpr, O_ALIGN: tl.constexpr):
        # One program: BLOCK_R vectors x one group of 2 * HALF_G values. ``quant.quantize``'s arithmetic, in its
        # order, in fp32 (see the module docstring for why each step is bit-exact). Layout facts the host checked
        # (``quantize_rows``), as constexpr because the integer strides are not specialised on:
        # - X_CONTIG: the vector dim is contiguous in the input (xn == 1): a group is one contiguous 64-value load;
        # - FULL: D is a multiple of 64 (no tail group to pad);
        # - X_ALIGN / O_ALIGN: every vector's first value (elements) / first byte is a multiple of this.
        pid = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        live = r < rows
        i0, i1, i2, i3 = _row_index(r, r1, r2, r3)
        x_off = i0 * x0 + i1 * x1 + i2 * x2 + i3 * x3
        o_off = tl.multiple_of(i0 * o0 + i1 * o1 + i2 * o2 + i3 * o3, O_ALIGN)
        e = g * (2 * HALF_G) + tl.arange(0, 2 * HALF_G).to(tl.int64)
        if not FULL:  # the tail group: padded by repeating the vector's last value (quant._groups)
            e = tl.minimum(e, n - 1)
        if X_CONTIG:
            ptrs = x_ptr + tl.multiple_of(x_off, X_ALIGN)[:, None] + e[None, :]
        else:
            ptrs = x_ptr + x_off[:, None] + e[None, :] * xn
        v = tl.load(ptrs, mask=live[:, None], other=0.0).to(tl.float32)  # [BLOCK_R, 64]
        mn = tl.min(v, axis=1).to(tl.float16)  # stored in fp16: quantize against the stored values
        mnf = mn.to(tl.float32)
        st = tl.div_rn(tl.max(v, axis=1) - mnf, LEVELS * 1.0).to(tl.float16)
        s = st.to(tl.float32)
        pos = s > 0
        q = tl.div_rn(v - mnf[:, None], tl.where(pos, s, 1.0)[:, None])
        q = tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0)  # clamping first: the same codes as round then clamp
        f = tl.floor(q + 0.5)  # exact on [0, 15]; a tie (q + 0.5 an integer) rounds up ...
        f = tl.where((f - q == 0.5) & ((f.to(tl.int32) & 1) == 1), f - 1.0, f)  # ... so to even: torch.round
        c = tl.where(pos[:, None], f.to(tl.int32), 0)
        hi, lo = tl.split(tl.reshape(c, [BLOCK_R, HALF_G, 2]))  # the even element in the high nibble
        j = tl.arange(0, HALF_G).to(tl.int64)
        tl.store(o_ptr + o_off[:, None] + g * HALF_G + j[None, :], ((hi << 4) | lo).to(tl.uint8),
                 mask=live[:, None])
        # the group's (min, step) fp16 pair as 4 little-endian bytes after the vector's codes (``pack_vectors``:
        # ``scale.view(torch.uint8)``); bytes, so the output needs no 2-byte alignment
        w = mn.to(tl.uint16, bitcast=True).to(tl.uint32) | (st.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
        k = tl.arange(0, 4).to(tl.uint32)
        sb = ((w[:, None] >> (8 * k[None, :])) & 255).to(tl.uint8)
        tl.store(o_ptr + o_off[:, None] + groups * HALF_G + g * 4 + k[None, :].to(tl.int64), sb, mask=live[:, None])


def _four(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Row sizes and strides padded in front to four dims (a row dim of size 1 has stride 0)."""
    if len(shape) > 4:
        raise ValueError(f"the fused dequantize takes at most 4 row dims, got {len(shape)}")
    pad = 4 - len(shape)
    return [1] * pad + list(shape), [0] * pad + list(strides)


def _alignment(base: int, strides, widest: int) -> int:
    """The largest power of two up to ``widest`` dividing ``base`` and every stride (1 at least)."""
    a = widest
    while a > 1 and (base % a or any(x % a for x in strides)):
        a //= 2
    return a


def layout_flags(data: torch.Tensor, out: torch.Tensor, rows_shape, ds, os_, on: int) -> dict:
    """The kernel's constexpr layout facts for these tensors (see ``_dequant_kernel``), checked here."""
    es = out.element_size()
    row_run = os_[3] == 1 and on != 1 and rows_shape[-1] % BLOCK_ROWS == 0 if rows_shape else False
    contig = on == 1
    d_align = _alignment(data.data_ptr(), [x for x in ds] + [data.stride(-2)], ALIGN_BYTES)
    o_align = _alignment(out.data_ptr() // es if out.data_ptr() % es == 0 else 1, list(os_), ALIGN_BYTES // es) \
        if contig else 1
    if contig and QUANT_GROUP_SIZE % o_align:
        o_align = 1
    return {"ROW_RUN": bool(row_run), "OUT_CONTIG": bool(contig), "D_ALIGN": d_align, "O_ALIGN": o_align}


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[..., :n] = code * step + min`` for ``data`` uint8 [*rows, G, 32], ``scale`` fp16 [*rows, G, 2] and
    ``out`` [*rows, n] (n ≤ 64·G; any strides; all on one CUDA device), in one launch. Returns ``out``."""
    rows_shape = tuple(out.shape[:-1])
    if tuple(data.shape[:-2]) != rows_shape or tuple(scale.shape[:-2]) != rows_shape or data.shape[-1] != HALF \
            or scale.shape[-1] != 2 or data.shape[-2] != scale.shape[-2]:
        raise ValueError(f"packed groups {list(data.shape)} / scales {list(scale.shape)} do not match the output "
                         f"{list(out.shape)}")
    groups, n = data.shape[-2], out.shape[-1]
    if n > groups * QUANT_GROUP_SIZE:
        raise ValueError(f"{groups} groups hold at most {groups * QUANT_GROUP_SIZE} values, not {n}")
    if data.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("the fused dequantize needs each group's bytes and (min, step) contiguous")
    rows = 1
    for d in rows_shape:
        rows *= d
    if rows == 0 or n == 0:
        return out
    size, ds = _four(rows_shape, data.stride()[:-2])
    _, ss = _four(rows_shape, scale.stride()[:-2])
    _, os_ = _four(rows_shape, out.stride()[:-1])
    flags = layout_flags(data, out, size, ds, os_, out.stride(-1))
    grid = (triton.cdiv(rows, BLOCK_ROWS), groups)
    _dequant_kernel[grid](data, scale, out, rows, groups, n, size[1], size[2], size[3],
                          *ds, data.stride(-2), *ss, scale.stride(-2), *os_, out.stride(-1),
                          BLOCK_R=BLOCK_ROWS, HALF_G=HALF, **flags)
    return out


def quantize_rows(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[...] = quant.pack_vectors(x)`` for ``x`` [*rows, n] (fp16, bf16 or fp32, any strides, up to four row
    dims) and ``out`` uint8 [*rows, stored] (``quant.stored_nbytes((n,), 0)`` bytes a vector, the last dim contiguous,
    any other strides; on ``x``'s device), in one launch. Returns ``out``."""
    rows_shape = tuple(x.shape[:-1])
    n = x.shape[-1] if x.dim() else 0
    groups = -(-n // QUANT_GROUP_SIZE)
    if n == 0 or tuple(out.shape[:-1]) != rows_shape or out.shape[-1] != groups * (HALF + 4) \
            or out.dtype != torch.uint8 or out.device != x.device:
        raise ValueError(f"packed KV {list(out.shape)} ({out.dtype}, {out.device}) cannot hold vectors "
                         f"{list(x.shape)} ({x.device})")
    if out.stride(-1) != 1:
        raise ValueError("the fused quantize needs each packed vector's bytes contiguous")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the fused quantize takes fp16, bf16 or fp32 vectors, not {x.dtype}")
    rows = 1
    for d in rows_shape:
        rows *= d
    if rows == 0:
        return out
    size, xs = _four(rows_shape, x.stride()[:-1])
    _, os_ = _four(rows_shape, out.stride()[:-1])
    es = x.element_size()
    contig = x.stride(-1) == 1 or n == 1
    x_align = _alignment(x.data_ptr() // es if x.data_ptr() % es == 0 else 1, xs, ALIGN_BYTES // es) if contig else 1
    o_align = _alignment(out.data_ptr(), os_, ALIGN_BYTES)
    grid = (triton.cdiv(rows, BLOCK_ROWS), groups)
    _quant_kernel[grid](x, out, rows, groups, n, size[1], size[2], size[3], *xs, x.stride(-1), *os_,
                        BLOCK_R=BLOCK_ROWS, HALF_G=HALF, LEVELS=(1 << QUANT_BITS) - 1, X_CONTIG=bool(contig),
                        FULL=n % QUANT_GROUP_SIZE == 0, X_ALIGN=x_align, O_ALIGN=o_align)
    return out
