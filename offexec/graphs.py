"""Decode layer ops as CUDA graphs: one launch instead of a few dozen.

A decode step of a layer (one new token per sequence) is a dozen small kernels; issued one by one from Python, the
host's issue time is a tenth to a fifth of an offloaded run (issue 14's audit). Here each decode op
(``offsim.core.costmodel.graphed``) whose inputs sit at fixed addresses -- a layer's resident weights or its weight
slot, its KV buffers -- is captured once as a CUDA graph and replayed at every later step. TightLLM's decode ops
that recompute N_r tokens beside the new one (q = N_r + 1 query tokens) are graphed the same way while q is at most
the plan's ``graph_max_q_tokens``: one graph per (op, layer, q), replayed at every step with that q.

What varies between steps is read from device memory, so one graph serves every step:

- the positions of the op's q tokens (``pos``, int64 [q]): the KV write (``index_copy_``) and RoPE read them;
- which cache positions each query sees (``keys``, bool [1, 1, q, max_len]; causal, aligned to the bottom right):
  attention runs over the full-length KV buffer with the positions not yet written masked out, instead of over a
  prefix whose length is baked into the kernels. The buffers are zeroed when the run starts, so a masked position
  never holds NaN or Inf.
- in a mixed-length batch (left-padded prompts, docs/jobs.md §4), the batch's pad lengths: ``keys`` becomes
  [B, 1, q, max_len], the causal mask combined with each sequence's pad positions (``model.visible``), and the RoPE
  positions ``rpos`` [B, q] count from each sequence's first real token (``model.positions``); both are written
  per op into static buffers, so the same graph serves every batch.

Inputs go in through static buffers and outputs come out through static buffers (one per argument position and
size per token: the hidden state [gbs, q, E]; with CPU attention also the attention output in, Q/K/V out, each
allocated for the longest q and viewed at the op's), copied into fresh tensors after the replay; they are shared by
every graph, which is safe because every graph replays on the compute stream, one after the other. The graphs'
intermediates live in one private memory pool that all captures share (``torch.cuda.graph_pool_handle``): never
two at once, so the pool holds one op's intermediates (the longest q's at most). Its size is in the plan's footprint
(``offsim.core.footprint.decode_graph_bytes``).

A plan with ``graph_attention`` 'written_rows' runs its graphed ops of several query tokens sequence-first
(``run(seq_first=True)``: the copy into the static input transposes [B, q, E] to [q, B, E], the copy out transposes
back) and attends over the rows written so far, not the whole buffer: ``ctx_k`` (int32 [1], written by ``set_ctx``)
tells flash's variable-length call how many (``model.written_rows_attention``; ``cu_q`` and ``cu_k`` its fixed
offsets).

The first time a key is met the op runs eagerly through the same static body (real work, the step's result), then
is captured (recording only; nothing runs twice). ``mode='static'`` runs the static body eagerly every time with no
capture: on the CPU that checks the graph path's numerics in CI. A capture that fails switches graphs off for the
run with a warning, and the op falls back to the eager kernels.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from offexec import model as M_  # M is the max length below

GRAPH_MODES = ("cuda", "static", "off")


class DecodeGraphs:
    """Captured decode ops of one run, keyed by what fixes their addresses (op kind, layer, slot, KV buffers)."""

    def __init__(self, device: torch.device, max_len: int, mode: str = "cuda", max_q_tokens: int = 1):
        if mode not in GRAPH_MODES[:2]:
            raise ValueError(f"graph mode must be one of {', '.join(GRAPH_MODES[:2])}, got {mode!r}")
        self.mode, self.device = mode, device
        self.max_len, self.max_q = max_len, max_q_tokens
        self._steps = torch.arange(max_q_tokens, device=device)  # 0 .. max_q - 1
        self._cols = torch.arange(max_len, device=device)  # every cache position
        self._pos = torch.zeros(max_q_tokens, dtype=torch.long, device=device)
        self._mask = torch.zeros(max_q_tokens * max_len, dtype=torch.bool, device=device)
        self.pos = self._pos[:1]  # the current op's token positions [q] (views at fixed addresses)
        self.rpos = self.pos  # their RoPE positions: ``pos``, or [B, q] in a left-padded batch
        self._bmask: torch.Tensor | None = None  # a padded batch's keys [B·max_q·max_len] and RoPE positions
        self._rpos: torch.Tensor | None = None
        self.keys = self._mask[:max_len].view(1, 1, 1, max_len)  # their visible keys [1, 1, q, max_len]
        # the written-rows attention's device-side lengths (model.written_rows_attention): ctx, and [0, M]
        self.ctx_k = torch.zeros(1, dtype=torch.int32, device=device)
        self.cu_k = torch.tensor([0, max_len], dtype=torch.int32, device=device)
        self._cu_q: dict[int, torch.Tensor] = {}  # q -> [0, q] (int32), one fixed address per q
        self._homes: dict = {}  # (GPU batch, dtype, elements per token) -> its hidden state's storage (longest q)
        self.static_in: dict = {}  # (shape, dtype) of the inputs -> their static tensors
        self.static_out: dict = {}  # (shape, dtype) of the outputs -> their static tensors
        self._flat: dict = {}  # (role, argument position, dtype, elements per token) -> storage for the longest q
        self.out_sig: dict = {}  # key -> the signature of its outputs
        self.ctx: tuple | None = None
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.replays = 0
        self.calls = 0  # decode ops run through the static body or its graph
        self.capture_s = 0.0
        self.failed: str | None = None

    def set_ctx(self, ctx: int, q_tokens: int = 1, pad: torch.Tensor | None = None) -> None:
        """The op's ``q_tokens`` queries sit at positions [ctx - q, ctx) and query t sees keys [0, ctx - q + t]
        (written on the current stream, before the op's kernels). ``pad``: int64 [B] on the device, each sequence's
        left padding in a mixed-length batch (None: no padding, the masks above unchanged)."""
        tag = (ctx, q_tokens, None if pad is None else pad.data_ptr())
        if tag == self.ctx:
            return
        if not 1 <= q_tokens <= self.max_q:
            raise ValueError(f"a graphed op has 1 to {self.max_q} query tokens, got {q_tokens}")
        M = self.max_len
        self.pos = self._pos[:q_tokens]
        torch.add(self._steps[:q_tokens], ctx - q_tokens, out=self.pos)
        mask = self._mask[:q_tokens * M].view(q_tokens, M)
        torch.le(self._cols.unsqueeze(0), self.pos.unsqueeze(1), out=mask)
        self.keys = mask.view(1, 1, q_tokens, M)
        self.rpos = self.pos
        self.ctx_k.fill_(ctx)
        if pad is not None:
            B = pad.shape[0]
            if self._bmask is None:  # once, at fixed addresses every graph bakes in
                self._bmask = torch.zeros(B * self.max_q * M, dtype=torch.bool, device=self.device)
                self._rpos = torch.zeros(B * self.max_q, dtype=torch.long, device=self.device)
            self.keys = self._bmask[:B * q_tokens * M].view(B, 1, q_tokens, M)
            self.keys.copy_(M_.visible(self.pos, self._cols, pad))
            self.rpos = self._rpos[:B * q_tokens].view(B, q_tokens)
            self.rpos.copy_(M_.positions(self.pos, pad))
        self.ctx = tag

    def cu_q(self, q_tokens: int) -> torch.Tensor:
        """int32 [0, q] on the device (the written-rows attention's query offsets), one tensor per q."""
        t = self._cu_q.get(q_tokens)
        if t is None:
            t = self._cu_q[q_tokens] = torch.tensor([0, q_tokens], dtype=torch.int32, device=self.device)
        return t

    @staticmethod
    def _sig(ts) -> tuple:
        return tuple((tuple(t.shape), t.dtype) for t in ts)

    def _statics(self, table: dict, sig: tuple, qdim: int = 1) -> tuple:
        """Static tensors of signature ``sig``: views of one storage per argument position and size per token,
        allocated for the longest q (dimension ``qdim`` of every graphed tensor is the op's query tokens: 1, or 0
        sequence-first)."""
        if (sig, qdim) not in table:
            role = "in" if table is self.static_in else "out"
            views = []
            for i, (shape, dt) in enumerate(sig):
                numel = 1
                for d in shape:
                    numel *= d
                q = shape[qdim] if len(shape) > 1 and shape[qdim] > 0 else 1
                per_token = numel // q if numel % q == 0 else numel
                key = (role, i, dt, per_token) if numel % q == 0 else (role, i, dt, shape)
                size = per_token * self.max_q if numel % q == 0 else numel
                flat = self._flat.get(key)
                if flat is None or flat.numel() < size:
                    flat = self._flat[key] = torch.zeros(size, dtype=dt, device=self.device)
                views.append(flat[:numel].view(shape))
            table[sig, qdim] = tuple(views)
        return table[sig, qdim]

    def home(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        """GPU batch ``batch``'s hidden-state buffer shaped as ``like`` (sequence-first, [q, B, ...]), a view of
        storage sized for the longest q, at a fixed address for the run (``run(home=...)``)."""
        per_token = like.numel() // like.shape[0]
        key = (batch, like.dtype, per_token)
        flat = self._homes.get(key)
        if flat is None:
            flat = self._homes[key] = torch.zeros(per_token * self.max_q, dtype=like.dtype, device=self.device)
        return flat[:like.numel()].view(like.shape)

    def run(self, key, body: Callable, *xs: torch.Tensor, seq_first: bool = False, home: int | None = None):
        """The op's output(s) for inputs ``xs``: ``body(*static inputs)`` (a tensor or a tuple of tensors) replayed
        from its graph, captured at the first call; fresh tensors, copied from the shared static outputs. None when
        graphs failed for this run: the caller runs the op eagerly. ``seq_first``: each x [B, q, ...] goes in as
        [q, B, ...] (the copy into the static input transposes it) and each output of the body, [q, B, ...], comes
        out as [B, q, ...] (so does the copy out).

        ``home`` (with ``seq_first``, one input and one output: a layer op's hidden state): GPU batch ``home``'s own
        buffer (``home()``) is both the graph's input and its output, written in place at the graph's end; what comes
        back is a [B, q, ...] view of it, no copy, and an input that is that view already (the batch's previous op
        left it) is not copied in either. Only for a result whose one reader is the batch's next op (or one whose
        own results that next op waits for): the batch's next graphed op overwrites it (``Executor._graphed``)."""
        if self.failed is not None:
            return None
        self.calls += 1
        qdim = 0 if seq_first else 1
        if seq_first:
            xs = tuple(x.transpose(0, 1) for x in xs)
        if home is not None:
            hb = self.home(home, xs[0])
            if not (xs[0].data_ptr() == hb.data_ptr() and xs[0].stride() == hb.stride()):
                hb.copy_(xs[0])
            ins = outs = (hb,)
        else:
            ins = self._statics(self.static_in, self._sig(xs), qdim)
            for d, x in zip(ins, xs):
                d.copy_(x)
        g = self.graphs.get(key)
        if g is not None and self.mode == "cuda":
            g.replay()
            self.replays += 1
            if home is None:
                outs = self.static_out[self.out_sig[key], qdim]
        else:  # the first call (or 'static'): the static body eagerly, its results through the static outputs
            ys = body(*ins)
            ys = ys if isinstance(ys, tuple) else (ys,)
            self.out_sig[key] = sig = self._sig(ys)
            if home is None:
                outs = self._statics(self.static_out, sig, qdim)
            for d, y in zip(outs, ys):
                d.copy_(y)
            del ys
            if self.mode == "cuda":
                self._capture(key, body, ins, outs)
        if seq_first:
            outs = tuple(o.transpose(0, 1) for o in outs)
        if home is not None:
            return outs[0]
        if len(outs) == 1:
            return outs[0].clone(memory_format=torch.contiguous_format)
        return tuple(o.clone(memory_format=torch.contiguous_format) for o in outs)

    def _capture(self, key, body, ins, outs) -> None:
        t0 = time.perf_counter()
        if not self.graphs:
            # the run's first capture: hand the caching allocator's free blocks back to the device first. The pool's
            # segments come from the room the prefill's transients had (the footprint counts the graphs there:
            # ``executor.op_transient_bytes``), and under a capture the allocator cannot free cached blocks to make
            # room (measured: a 222 MiB pool segment refused beside 1.27 GiB reserved and unallocated, 16 GiB cap)
            torch.cuda.empty_cache()
        g = torch.cuda.CUDAGraph()
        try:
            # thread_local: the host workers (CPU attention, disk) may touch CUDA while this thread captures
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                ys = body(*ins)
                for d, y in zip(outs, ys if isinstance(ys, tuple) else (ys,)):
                    d.copy_(y)
                del ys
            finally:
                g.capture_end()
        except RuntimeError as exc:  # an op that cannot be captured: eager for the rest of the run
            self.failed = str(exc).splitlines()[0]
            warnings.warn(f"offexec: CUDA graph capture failed ({self.failed}); decode ops run eagerly",
                          RuntimeWarning, stacklevel=3)
            return
        self.graphs[key] = g
        self.capture_s += time.perf_counter() - t0

    def static_bytes(self) -> int:
        """Bytes of the tensors every graph reads or writes at fixed addresses (inputs, outputs, per-batch hidden
        states, positions, masks, lengths), allocated outside the graphs' pool."""
        ts = [self._steps, self._cols, self._pos, self._mask, self.ctx_k, self.cu_k, *self._cu_q.values(),
              *self._homes.values(), *self._flat.values()]
        ts += [t for t in (self._bmask, self._rpos) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def pool_bytes(self) -> int:
        """Bytes the graphs' private memory pool has reserved (the caching allocator's segments of ``self.pool``):
        the intermediates the captured ops keep for their replays. 0 without CUDA graphs."""
        if self.pool is None:
            return 0
        pool = tuple(self.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)

    def stats(self) -> dict:
        """What the run's graphs did, and what they hold: ``static_bytes`` and ``pool_bytes`` (measured here; the
        footprint's ``decode_graph_bytes`` is their arithmetic)."""
        return {"mode": self.mode, "ops": self.calls, "graphs": len(self.graphs), "replays": self.replays,
                "capture_s": self.capture_s, "failed": self.failed, "homes": len(self._homes),
                "static_bytes": self.static_bytes(), "pool_bytes": self.pool_bytes()}
