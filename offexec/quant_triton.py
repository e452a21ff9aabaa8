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
"""
from __future__ import annotations

import torch

try:  # pragma: no cover - exercised on the GPU machine only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from offsim.core.specs import QUANT_GROUP_SIZE

HALF = QUANT_GROUP_SIZE // 2  # bytes of codes per group (two 4-bit codes a byte)
BLOCK_ROWS = 64  # rows per program
ALIGN_BYTES = 16  # the widest vector access claimed (and checked) when the layout allows it


def available(out: torch.Tensor) -> bool:
    """Whether the fused kernel serves an output like ``out``."""
    return triton is not None and out.is_cuda


if triton is not None:  # pragma: no cover - compiled and run on the GPU machine only
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
            i3 = r0 % r3
            t = r0 // r3
            i2 = t % r2
            t = t // r2
            i1 = t % r1
            i0 = t // r1
            live = (r0 + k) < rows
            d_off = i0 * d0 + i1 * d1 + i2 * d2 + i3 * d3 + g * dg + k * d3
            s_off = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3 + g * sg + k * s3
            o_off = i0 * o0 + i1 * o1 + i2 * o2 + i3 + k  # o3 == 1
        else:
            r = pid * BLOCK_R + k
            live = r < rows
            i3 = r % r3
            t = r // r3
            i2 = t % r2
            t = t // r2
            i1 = t % r1
            i0 = t // r1
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
