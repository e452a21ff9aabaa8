"""Layer math of OPT and Llama decoders as small torch functions (docs/architecture.md §7), written so that an offloading
executor can call them piece by piece.

A decoder layer's weights are one flat buffer in ``ModelSpec.layer_tensors`` order; ``layer_views`` turns (a piece
of) that buffer into named [out, in] tensors without copying. A layer runs in three parts, matching the plan's
compute parts (``offsim.core.costmodel.COMPUTE_PARTS``):

- ``pre_attn``: norm and Q/K/V projections (and RoPE for Llama) of the T new tokens;
- ``attention``: the T queries against K/V of positions [0, C) -- a loaded (or resident) prefix plus the freshly
  computed tokens -- given as head groups that may live in different buffers (GPU-resident heads, heads loaded from
  the host, heads loaded from disk). T may be anything from 1 (decode) through C (prefill); 1 < T < C is TightLLM's
  recompute of the last T - 1 tokens plus the new one, a causal block aligned to the bottom right;
- ``post_attn``: output projection and residual (``attn_out``), then norm, FFN, residual (``mlp``) -- FlexGen's
  two sub-layers split there: with sub-layer streaming the attention sub-layer (``pre_attn``, ``attention``,
  ``attn_out``) and the MLP run as separate ops with separately streamed weights.

Shapes: B sequences, T new tokens, C context tokens (the new ones included), E = d_model, H query heads, Hk KV heads,
D head dim, V vocabulary. They reproduce transformers' ``OPTForCausalLM`` and ``LlamaForCausalLM`` (same weights,
same logits within fp32 rounding; tests/test_offexec_model.py).
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from offsim.core import footprint as fp
from offsim.core.specs import ModelSpec

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (transformers OPTLearnedPositionalEmbedding)


def dtype_of(spec: ModelSpec, name: str | None = None) -> torch.dtype:
    """The torch dtype of a model's weights: ``name`` if given, else fp16 for 2-byte specs and fp32 for 4-byte."""
    if name is not None:
        return DTYPES[name]
    return {2: torch.float16, 4: torch.float32}[spec.dtype_bytes]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a layer lives in the layer's flat buffer: elements [lo, hi)."""

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int


def layer_layout(spec: ModelSpec) -> list[TensorSlot]:
    """Element ranges of each tensor of one decoder layer in its flat buffer (``layer_tensors`` order)."""
    out, off = [], 0
    for name, shape in spec.layer_tensors():
        n = math.prod(shape)
        out.append(TensorSlot(name, shape, off, off + n))
        off += n
    return out


def layer_views(layout: list[TensorSlot], pieces: list[tuple[int, torch.Tensor]],
                lo: int = 0, hi: int | None = None) -> dict[str, torch.Tensor]:
    """Named tensors of one layer from pieces of its flat buffer. ``pieces``: (first element, 1-D tensor) covering
    disjoint element ranges; every tensor must lie inside one piece (the executor assembles a tensor that straddles
    two tiers into the later piece before calling this). ``lo``/``hi``: only the tensors inside elements [lo, hi)
    (one sub-layer's)."""
    views = {}
    for t in layout:
        if t.lo < lo or (hi is not None and t.hi > hi):
            continue
        for base, buf in pieces:
            if base <= t.lo and t.hi <= base + buf.numel():
                views[t.name] = buf[t.lo - base:t.hi - base].view(t.shape)
                break
        else:
            raise ValueError(f"tensor {t.name} (elements [{t.lo}, {t.hi})) is not inside one piece of the buffer")
    return views


# ----------------------------------------------------------------------------------------------------------------
# embeddings and head (weights always on the GPU: offsim's schedule keeps them there)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Embeddings:
    """Weights outside the decoder layers. tokens: [V, E]; positions: [max_positions + 2, E] (OPT only);
    norm_w / norm_b: final norm (norm_b OPT only); lm_head: [V, E] or None when tied to ``tokens``."""

    tokens: torch.Tensor
    positions: torch.Tensor | None
    norm_w: torch.Tensor
    norm_b: torch.Tensor | None
    lm_head: torch.Tensor | None

    def fields(self) -> dict[str, torch.Tensor | None]:
        return {"tokens": self.tokens, "positions": self.positions, "norm_w": self.norm_w, "norm_b": self.norm_b,
                "lm_head": self.lm_head}

    def to(self, device, dtype=None) -> "Embeddings":
        f = (lambda t: None if t is None else t.to(device=device, dtype=dtype or t.dtype))  # noqa: E731
        return Embeddings(f(self.tokens), f(self.positions), f(self.norm_w), f(self.norm_b), f(self.lm_head))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.positions, self.norm_w, self.norm_b,
                                                          self.lm_head) if t is not None)


def embed(spec: ModelSpec, emb: Embeddings, tokens: torch.Tensor, start) -> torch.Tensor:
    """tokens: [B, T] ids of positions [start, start + T) -> hidden [B, T, E]. ``start``: an int, or (left-padded
    sequences of a mixed-length batch) an int64 [B, T] tensor of each token's position (``positions``)."""
    x = F.embedding(tokens, emb.tokens)  # [B, T, E]
    if spec.family == "opt":
        if isinstance(start, torch.Tensor):
            return x + emb.positions[start + OPT_POSITION_OFFSET]  # [B, T, E]
        T = tokens.shape[1]
        x = x + emb.positions[start + OPT_POSITION_OFFSET:start + OPT_POSITION_OFFSET + T]  # [T, E] broadcast
    return x


def positions(rows: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Each sequence's position of cache rows ``rows`` (int64 [T]) when sequence b is left-padded by ``pad[b]``
    (int64 [B]): [B, T], counted from the sequence's first real token as transformers counts them for a request
    alone. Pad rows get 0 (clamped): their outputs are never seen (``visible``), only need to be finite."""
    return (rows.unsqueeze(0) - pad.unsqueeze(1)).clamp_(min=0)


def visible(rows: torch.Tensor, cols: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, C]: key ``cols[c]`` is visible to the query at cache row ``rows[t]`` of sequence b, left-padded
    by ``pad[b]``: causal, and not a pad position -- except a pad query sees itself, so that no row is all masked
    (SDPA would give NaN, and a pad position's K/V, NaN, would poison every later query through 0 x NaN)."""
    causal = cols.unsqueeze(0) <= rows.unsqueeze(1)  # [T, C]
    real = cols.unsqueeze(0) >= pad.unsqueeze(1)  # [B, C]
    self_ = cols.unsqueeze(0) == rows.unsqueeze(1)  # [T, C]
    return (causal.unsqueeze(0) & (real.unsqueeze(1) | self_.unsqueeze(0))).unsqueeze(1)


def head(spec: ModelSpec, emb: Embeddings, x: torch.Tensor) -> torch.Tensor:
    """x: [B, T, E] -> logits [B, V] of each sequence's last position (final norm, then the LM head)."""
    h = _norm(spec, x[:, -1], emb.norm_w, emb.norm_b)  # [B, E]
    return F.linear(h, emb.tokens if emb.lm_head is None else emb.lm_head)  # [B, V]


# ----------------------------------------------------------------------------------------------------------------
# decoder layer
# ----------------------------------------------------------------------------------------------------------------
def _norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if spec.family == "opt":
        return F.layer_norm(x, (x.shape[-1],), w, b, spec.norm_eps)
    # RMSNorm as transformers' LlamaRMSNorm: statistics in fp32, scale in the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.norm_eps)
    return w * xf.to(x.dtype)


class Rope:
    """cos/sin tables of rotary position embeddings (Llama; transformers' default rope type), [P, D] in ``dtype``."""

    def __init__(self, spec: ModelSpec, device, dtype, max_positions: int | None = None):
        D = spec.head_dim
        P = max_positions or spec.max_positions
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
        freqs = torch.arange(P, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        e = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = e.cos().to(dtype)
        self.sin = e.sin().to(dtype)

    def apply(self, x: torch.Tensor, start, seq_first: bool = False) -> torch.Tensor:
        """x: [B, T, n, D] of positions [start, start + T) -> rotated, same shape. ``start``: an int, or (one new
        token or a graphed recompute) an int64 [T] tensor of the positions on the device, read by the kernels (a
        CUDA graph replays it per step), or int64 [B, T] per sequence (left-padded mixed-length batches).
        ``seq_first``: x is [T, B, n, D] (``pre_attn``'s sequence-first layout), rotated alike."""
        T = x.shape[0] if seq_first else x.shape[1]
        if isinstance(start, torch.Tensor) and start.dim() == 2:  # per-sequence positions [B, T] (``positions``)
            cos, sin = self.cos[start], self.sin[start]  # [B, T, D]
            if seq_first:
                cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, D] (seq_first: [T, B, 1, D])
        else:
            if isinstance(start, torch.Tensor):
                cos, sin = self.cos.index_select(0, start), self.sin.index_select(0, start)  # [T, D]
            else:
                cos, sin = self.cos[start:start + T], self.sin[start:start + T]
            # [1, T, 1, D], or seq_first [T, 1, 1, D]
            cos, sin = (cos[:, None, None, :], sin[:, None, None, :]) if seq_first else \
                (cos[None, :, None, :], sin[None, :, None, :])
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
        return x * cos + rot * sin


def pre_attn(spec: ModelSpec, w: dict, x: torch.Tensor, start: int, rope: Rope | None = None,
             seq_first: bool = False):
    """x: [B, T, E] hidden of positions [start, start + T) -> q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, D].
    ``seq_first``: x is [T, B, E] and q, k, v come out [T, B, H or Hk, D] (``written_rows_attention``'s layout: no
    copy between the projections and the attention call)."""
    lead = x.shape[:2]  # (B, T), or seq_first (T, B): the projections are per row either way
    H, Hk, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if spec.family == "opt":
        h = _norm(spec, x, w["self_attn_layer_norm.weight"], w["self_attn_layer_norm.bias"])
        q = F.linear(h, w["q_proj.weight"], w["q_proj.bias"]).view(*lead, H, D)
        k = F.linear(h, w["k_proj.weight"], w["k_proj.bias"]).view(*lead, Hk, D)
        v = F.linear(h, w["v_proj.weight"], w["v_proj.bias"]).view(*lead, Hk, D)
        return q, k, v
    h = _norm(spec, x, w["input_layernorm.weight"], None)
    q = F.linear(h, w["q_proj.weight"]).view(*lead, H, D)
    k = F.linear(h, w["k_proj.weight"]).view(*lead, Hk, D)
    v = F.linear(h, w["v_proj.weight"]).view(*lead, Hk, D)
    return rope.apply(q, start, seq_first), rope.apply(k, start, seq_first), v


def written_rows_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ctx_k: torch.Tensor,
                           cu_q: torch.Tensor, cu_k: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A graphed recompute block's causal attention over the rows written so far, sequence-first: q [T, B, H, D]
    (``pre_attn(seq_first=True)``), K, V: [M, B, n, D] full-length buffers whose rows [0, ctx) are written; returns
    [T, B, H·D], query t seeing keys [0, ctx - T + t]. ``ctx_k``: int32 [1] on the device holding ctx, read by the
    kernel (a CUDA graph replays it at every step), ``cu_q`` = [0, T] and ``cu_k`` = [0, M] (int32, device).

    On CUDA, flash's variable-length call with batch and heads merged into the call's heads: q viewed as one
    sequence of T tokens with B·H heads, K and V as one of M rows with B·n heads (every view free: the buffers'
    rows hold [B, n, D] contiguously), ``seqused_k`` = ctx so only written rows are read and the causal diagonal sits
    at the bottom right of them (query head b·H + h reads KV head (b·H + h) // (H / n) = b·n + h // (H / n): GQA
    stays right). The masked call over the whole buffer that it replaces runs another kernel, slower at these shapes
    (results/offexec/kernels_h100_b67b39f). Elsewhere (the CPU's graph-path checks) SDPA over the whole buffer under
    ``keys`` (bool [1, 1, T, M]), the same numbers."""
    T, B, H, D = q.shape
    M, _, n, _ = K.shape
    if q.device.type == "cuda":
        o = torch.ops.aten._flash_attention_forward(
            q.view(T, B * H, D), K.view(M, B * n, D), V.view(M, B * n, D), cu_q, cu_k, T, M, 0.0, True, False,
            seqused_k=ctx_k)[0]
        return o.view(T, B, H * D)
    o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), K.permute(1, 2, 0, 3), V.permute(1, 2, 0, 3),
                                       attn_mask=keys, enable_gqa=H != n)  # [B, H, T, D]
    return o.permute(2, 0, 1, 3).reshape(T, B, H * D)


def attention(spec: ModelSpec, q: torch.Tensor, groups: list[tuple[int, int, torch.Tensor, torch.Tensor]],
              out: torch.Tensor | None = None, mask: torch.Tensor | None = None,
              sparse: "Sparse | None" = None) -> torch.Tensor:
    """Causal attention of T queries at the end of a C-token context.

    q: [B, T, H, D]; groups: (head_lo, head_hi, K, V) with K, V: [B, head_hi - head_lo, C, D] for KV heads
    [head_lo, head_hi) (query heads [head_lo·G, head_hi·G), G = H / Hk: GQA). Query t (0-based) sees keys
    [0, C - T + t] -- causal, aligned to the bottom right -- so a prefill (T = C), a decode step (T = 1) and a
    recompute block (1 < T < C) are one function. Returns out [B, T, H·D] (written into ``out`` if given).
    ``mask`` (graphed ops): bool [1, 1, T, C], the key positions each query sees -- attention over a full-length buffer
    whose tail is not written yet (offexec/graphs.py); [B, 1, T, C] for left-padded mixed-length batches
    (``visible``). ``sparse``: top-k sparse attention (``Sparse``, ``quant.sparse_sdpa``) instead of dense SDPA; the
    selection is per query head over all positions, so head groups in different buffers select alike.
    """
    B, T, H, D = q.shape
    G = H // spec.num_kv_heads
    if out is None and len(groups) == 1 and groups[0][:2] == (0, spec.num_kv_heads):
        _, _, K, V = groups[0]
        o = _attend(q.transpose(1, 2), K, V, T, G, mask, sparse)  # [B, H, T, D], a transposed view of [B, T, H, D]
        return o.transpose(1, 2).reshape(B, T, H * D)  # no copy when the kernel laid it out [B, T, H, D]
    if out is None:
        out = q.new_empty(B, T, H * D)
    o4 = out.view(B, T, H, D)
    for h0, h1, K, V in groups:
        og = _attend(q[:, :, h0 * G:h1 * G].transpose(1, 2), K, V, T, G, mask, sparse)  # [B, n·G, T, D]
        o4[:, :, h0 * G:h1 * G] = og.transpose(1, 2)  # [B, T, n·G, D]
    return out


@dataclass
class Sparse:
    """Top-k sparse attention for one attention call: ``fraction`` of the other positions each query keeps;
    ``k_cap``: V rows gathered per head for one query (``quant.sparse_sdpa``; None: the most this context keeps);
    ``rows``: a 0-d int64 tensor on the device that each call adds its count of kept V rows to, in place (so that a
    CUDA graph's replay counts too; read once after the run); ``first``: the first cache row whose query is sparse
    (``quant.sparse_sdpa``)."""

    fraction: float
    k_cap: int | None = None
    rows: torch.Tensor | None = None
    first: "int | torch.Tensor" = 0


def _attend(q, K, V, T: int, G: int, mask, sparse: Sparse | None) -> torch.Tensor:
    """``_sdpa``, or with ``sparse`` top-k sparse attention (``quant.sparse_sdpa``), counting its kept V rows."""
    if sparse is None:
        return _sdpa(q, K, V, T, G, mask)
    from offexec.quant import sparse_sdpa

    o, n = sparse_sdpa(q, K, V, sparse.fraction, T, mask, sparse.k_cap, sparse.first)
    if sparse.rows is not None:
        sparse.rows.add_(n)
    return o


def _sdpa(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, T: int, G: int,
          keys: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, n·G, T, D] against K, V: [B, n, C, D], causal aligned to the bottom right; ``keys``: bool [1, 1, T, C],
    the positions each query sees (then no causal alignment is applied: the mask is the whole rule)."""
    C = K.shape[2]
    if keys is not None:
        if keys.shape[-2] != T:
            raise ValueError(f"a key mask [B or 1, 1, T, C] for {T} queries has {keys.shape[-2]} rows")
        mask, causal = keys, False
    elif T == 1:
        mask, causal = None, False
    elif T == C:
        mask, causal = None, True
    else:
        o = _lower_right_flash(q, K, V, G)
        if o is not None:
            return o
        mask, causal = causal_lower_right(T, C), False
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=causal, enable_gqa=G > 1)


_FLASH_OK: dict = {}  # (dtype, head dim, device, strides' last, flash enabled) -> flash can run it


def _lower_right_flash(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, G: int) -> torch.Tensor | None:
    """A recompute block's causal attention (T < C queries at the end of the context, aligned to the bottom right)
    straight through the flash kernel, whose causal mask is bottom-right aligned: the kernel PyTorch's
    ``causal_lower_right`` bias dispatches to, without that dispatch's Python work per call (input validation, an
    ``SDPAParams`` and the backend checks: ~70 us of the issuing thread's time a TightLLM recompute op under cProfile,
    results/offexec/host_profile_cf26d6a). The backend check runs once per input signature. None where flash cannot
    run it (not CUDA, GQA, a head size that would need padding, flash disabled or unsupported): the caller then goes
    through ``causal_lower_right``, which picks another backend."""
    if q.device.type != "cuda" or G != 1 or q.shape[-1] % 8:
        return None
    key = (q.dtype, q.shape[-1], q.device, q.stride(-1), K.stride(-1), V.stride(-1),
           torch.backends.cuda.flash_sdp_enabled())
    ok = _FLASH_OK.get(key)
    if ok is None:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        ok = _FLASH_OK[key] = bool(key[-1]) and can_use_flash_attention(SDPAParams(q, K, V, None, 0.0, False, False))
    if not ok:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention(q, K, V, 0.0, True, False)[0]


# SDPA's backends, in order, for an eager attention under a per-sequence key mask in decode (left-padded mixed-length
# batches: ``visible``), whose shape grows with the context at every step. For a masked call PyTorch's default on the
# H200 is cuDNN, which builds an execution plan on the host for every new shape: in Llama-2-13B's TightLLM job blocks
# that cost ~45 ms at every step's first layer op of each GPU batch, ten times the op (`offexec run --host-profile`:
# 4.2 s of host time inside SDPA over 1,920 layer ops; results/offexec/masked_decode_*). The memory-efficient kernel
# builds nothing and at those shapes runs within 15 % of cuDNN (experiments/offexec/mask_sdpa.py). Prefill keeps the
# default: its shape repeats over every layer of a batch, so cuDNN's plan is built once per batch.
GROWING_MASK_BACKENDS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def growing_mask_kernels(on: bool, device: torch.device):
    """A context for the SDPA calls of one eager op: ``GROWING_MASK_BACKENDS`` in that order when ``on`` (a masked
    decode op) on a CUDA device, else nothing changes."""
    if not on or device.type != "cuda":
        return contextlib.nullcontext()
    if _SET_PRIORITY:
        return sdpa_kernel(list(GROWING_MASK_BACKENDS), set_priority=True)
    return sdpa_kernel(list(GROWING_MASK_BACKENDS[:1]) + [SDPBackend.MATH])  # older torch: no order, so no cuDNN


def post_attn(spec: ModelSpec, w: dict, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """x: [B, T, E] residual (the layer's input); o: [B, T, H·D] attention output -> the layer's output [B, T, E]:
    the attention sub-layer's end (``attn_out``), then the MLP sub-layer (``mlp``)."""
    return mlp(spec, w, attn_out(spec, w, x, o))


def attn_out(spec: ModelSpec, w: dict, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The attention sub-layer's output: x + o · W_out (+ bias), [B, T, E]."""
    if spec.family == "opt":
        return x + F.linear(o, w["out_proj.weight"], w["out_proj.bias"])
    return x + F.linear(o, w["o_proj.weight"])


def mlp(spec: ModelSpec, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The MLP sub-layer: x + FFN(norm(x)), [B, T, E] (OPT: fc1, ReLU, fc2; Llama: SwiGLU). Over more than
    ``footprint.MLP_CHUNK_ROWS`` rows, in blocks of at most that many rows (``_blocked_mlp``)."""
    if x.numel() // x.shape[-1] > fp.MLP_CHUNK_ROWS:
        return _blocked_mlp(spec, w, x)
    if spec.family == "opt":
        h = _norm(spec, x, w["final_layer_norm.weight"], w["final_layer_norm.bias"])
        h = F.relu_(F.linear(h, w["fc1.weight"], w["fc1.bias"]))  # [B, T, F]
        return x + F.linear(h, w["fc2.weight"], w["fc2.bias"])
    h = _norm(spec, x, w["post_attention_layernorm.weight"], None)
    g = F.silu(F.linear(h, w["gate_proj.weight"])).mul_(F.linear(h, w["up_proj.weight"]))  # [B, T, F] SwiGLU
    return x + F.linear(g, w["down_proj.weight"])


def _blocked_mlp(spec: ModelSpec, w: dict, x: torch.Tensor) -> torch.Tensor:
    """``mlp`` in equal blocks of at most ``footprint.MLP_CHUNK_ROWS`` rows (no short tail block, which would read
    the weights again for a few rows): the FFN intermediate of one block lives at once instead of the whole
    [B, T, F] (``footprint.layer_stage_bytes``); each row's arithmetic is unchanged."""
    E = x.shape[-1]
    xf = x.reshape(-1, E)
    n = xf.shape[0]
    rows = -(-n // -(-n // fp.MLP_CHUNK_ROWS))  # ceil(n / number of blocks)
    if spec.family == "opt":
        h = _norm(spec, xf, w["final_layer_norm.weight"], w["final_layer_norm.bias"])
    else:
        h = _norm(spec, xf, w["post_attention_layernorm.weight"], None)
    out = torch.empty_like(x)  # (after the norm, whose own peak is counted alone)
    of = out.view(-1, E)
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        if spec.family == "opt":
            g = F.relu_(F.linear(h[lo:hi], w["fc1.weight"], w["fc1.bias"]))
            torch.add(xf[lo:hi], F.linear(g, w["fc2.weight"], w["fc2.bias"]), out=of[lo:hi])
        else:
            g = F.silu(F.linear(h[lo:hi], w["gate_proj.weight"])).mul_(F.linear(h[lo:hi], w["up_proj.weight"]))
            torch.add(xf[lo:hi], F.linear(g, w["down_proj.weight"]), out=of[lo:hi])
        del g
    return out


# ----------------------------------------------------------------------------------------------------------------
# a plain forward, no offloading: the reference the executor is tested against on the GPU
# ----------------------------------------------------------------------------------------------------------------
def reference_generate(spec: ModelSpec, layers: list[dict], emb: Embeddings, prompt: torch.Tensor, gen_len: int,
                       rope: Rope | None = None, return_logits: bool = False):
    """Greedy generation with everything in memory: prompt [B, S] -> tokens [B, gen_len] (and logits per step,
    [gen_len, B, V], if asked). KV cache in [B, Hk, C, D] tensors, extended by cat."""
    B, S = prompt.shape
    cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * spec.num_layers
    toks, logits_all = [], []
    cur, start = prompt, 0
    for _ in range(gen_len):
        x = embed(spec, emb, cur, start)
        for j, w in enumerate(layers):
            q, k, v = pre_attn(spec, w, x, start, rope)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hk, T, D]
            if cache[j] is not None:
                k, v = torch.cat((cache[j][0], k), 2), torch.cat((cache[j][1], v), 2)
            cache[j] = (k, v)
            o = attention(spec, q, [(0, spec.num_kv_heads, k, v)])
            x = post_attn(spec, w, x, o)
        lg = head(spec, emb, x)
        nxt = lg.argmax(-1)
        toks.append(nxt)
        logits_all.append(lg)
        start += cur.shape[1]
        cur = nxt[:, None]
    out = torch.stack(toks, 1)
    return (out, torch.stack(logits_all)) if return_logits else out
