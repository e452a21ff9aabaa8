"""Decode layer ops as CUDA graphs: one launch instead of a few dozen.

A decode step of a layer (one new token per sequence) is a dozen small kernels; issued one by one from Python, the
host's issue time is a tenth to a fifth of an offloaded run (issue 14's audit). Here each decode op whose inputs sit
at fixed addresses -- a layer's resident weights or its weight slot, its KV buffers -- is captured once as a CUDA
graph and replayed at every later step.

What varies between steps is read from device memory, so one graph serves every step:

- the new token's position (``pos``, int64 [1]): the KV write (``index_copy_``) and RoPE read it;
- which cache positions exist (``mask``, bool [max_len]): attention runs over the full-length KV buffer with the
  positions not yet written masked out, instead of over a prefix whose length is baked into the kernels. The buffers
  are zeroed when the run starts, so a masked position never holds NaN or Inf.

The hidden state goes in through one static input buffer and the op's output comes out through one static output
buffer, copied into a fresh tensor after the replay; both are shared by every graph, which is safe because every
graph replays on the compute stream, one after the other. The graphs' intermediates live in one private memory pool
that all captures share (``torch.cuda.graph_pool_handle``): never two at once, so the pool holds one op's
intermediates. Its size is in the plan's footprint (``offsim.core.footprint.decode_graph_bytes``).

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

GRAPH_MODES = ("cuda", "static", "off")


class DecodeGraphs:
    """Captured decode ops of one run, keyed by what fixes their addresses (op kind, layer, slot, KV buffers)."""

    def __init__(self, device: torch.device, hidden: int, gbs: int, max_len: int, dtype: torch.dtype,
                 mode: str = "cuda"):
        if mode not in GRAPH_MODES[:2]:
            raise ValueError(f"graph mode must be one of {', '.join(GRAPH_MODES[:2])}, got {mode!r}")
        self.mode = mode
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # the new token's position
        self.mask = torch.zeros(max_len, dtype=torch.bool, device=device)  # cache positions that exist
        self.keys = self.mask.view(1, 1, 1, max_len)  # as attention's mask: [B, H, T, C] broadcast
        self.x_in = torch.zeros(gbs, 1, hidden, dtype=dtype, device=device)
        self.out = torch.zeros(gbs, 1, hidden, dtype=dtype, device=device)
        self.ctx: int | None = None
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.replays = 0
        self.calls = 0  # decode ops run through the static body or its graph
        self.capture_s = 0.0
        self.failed: str | None = None

    @staticmethod
    def static_bytes(hidden_bytes_1: int, max_len: int) -> int:
        """Bytes of the shared static tensors: input and output hidden [gbs, 1, E], ``pos`` and ``mask``."""
        return 2 * hidden_bytes_1 + 8 + max_len

    def set_ctx(self, ctx: int) -> None:
        """Positions [0, ctx) exist, the new token is at ctx - 1 (on the current stream, before the op's kernels)."""
        if ctx == self.ctx:
            return
        if self.ctx is None or ctx < self.ctx:
            self.mask.zero_()
        self.mask[:ctx] = True
        self.pos.fill_(ctx - 1)
        self.ctx = ctx

    def run(self, key, body: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        """The op's output for input ``x``: ``body(x_in)`` replayed from its graph (captured at the first call).
        None when graphs failed for this run: the caller runs the op eagerly."""
        if self.failed is not None:
            return None
        self.calls += 1
        self.x_in.copy_(x)
        g = self.graphs.get(key)
        if g is not None and self.mode == "cuda":
            g.replay()
            self.replays += 1
            return self.out.clone()
        self.out.copy_(body(self.x_in))  # the first call (or 'static'): the static body eagerly
        y = self.out.clone()
        if self.mode == "cuda":
            self._capture(key, body)
        return y

    def _capture(self, key, body) -> None:
        t0 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        try:
            # thread_local: the host workers (CPU attention, disk) may touch CUDA while this thread captures
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self.out.copy_(body(self.x_in))
            finally:
                g.capture_end()
        except RuntimeError as exc:  # an op that cannot be captured: eager for the rest of the run
            self.failed = str(exc).splitlines()[0]
            warnings.warn(f"offexec: CUDA graph capture failed ({self.failed}); decode ops run eagerly",
                          RuntimeWarning, stacklevel=3)
            return
        self.graphs[key] = g
        self.capture_s += time.perf_counter() - t0

    def stats(self) -> dict:
        return {"mode": self.mode, "ops": self.calls, "graphs": len(self.graphs), "replays": self.replays,
                "capture_s": self.capture_s, "failed": self.failed}
