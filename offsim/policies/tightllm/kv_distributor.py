"""TightLLM's KV distributor (TightLLM, IEEE TC'25: KV distributor and weight loader; docs/cost-model.md §8): for one GPU batch at one decode step, how
many of its most recent tokens, N_r, to *recompute* on the GPU instead of loading their KV cache over PCIe.

The problem (TightLLM Eq. "min T_batch", extended by the weight loader's T_weight), per decoder layer:

    minimise   max( T_compute(N_r),  T_transfer(N_r) )           N_r integer, lo <= N_r <= hi <= N_ctx

- T_compute(N_r) = T_attn + T_ffn of the paper: one ``'layer'`` compute op over q = N_r + 1 tokens (the N_r
  recomputed ones and the new one) at a context of N_ctx + 1, priced by ``costmodel.compute_seconds`` -- so the GEMM
  and attention *efficiency curves* (MFU rising with tokens for the FFN, attention falling at long context) are in it;
- T_transfer(N_r) = T_cache(N_r) + T_weight: the KV of the N_ctx - N_r loaded tokens (C_c share from host memory, C_d
  share read from disk first) plus the weight slice this batch's compute hides (the weight loader), priced op by op
  with ``costmodel.transfer_seconds`` / ``costmodel.disk_seconds`` exactly as the simulator prices the plan's ops.
  ``transfer_model='serial'`` adds disk and PCIe seconds as the paper's equation does (C_d/Bdw_dc + (C_c+C_d)/Bdw_cg);
  ``'streams'`` (default) takes the larger of the two, because disk reads and PCIe copies are separate streams that
  overlap in offsim (and in TightLLM's multi-stream runtime).
- When activations are parked in host memory between layers (FlexGen's activation placement), the N_r + 1 tokens'
  hidden state crosses PCIe both ways in every layer: it is added to the H2D time and is the D2H stream's time (a
  term the paper does not have, because TightLLM keeps activations on the GPU; leaving it out makes the ILP recompute
  far too much when they are not). With a single GPU batch nothing else runs during that round trip, so it is also
  added to the compute stream's critical path (``hidden_serial``).

Because MFU varies with the token count, T_compute is not linear in N_r (the paper: "the optimal N_r is an integer
program, not a closed form"; its measured FFN FLOP/s rises steeply with tokens and its attention FLOP/s falls at long
context, and offsim's curves interpolate in log(tokens), so T_compute even wiggles between curve points). The ILP
here is therefore a *per-candidate* MILP: one binary per candidate N_r, each candidate's stream times evaluated
exactly with the cost model, ``t >= T_stream · x`` for every stream, exactly one candidate chosen, t minimised (cvxpy,
HiGHS named explicitly, a parameterised problem compiled once per size bucket and reused). Its candidates are the
integers of [lo, hi] that an exact bound-tightening presolve cannot exclude:

- an attained value U = f(n) (a coarse grid, then a bisection on the compute/transfer crossing that stops at a
  bracket of ``PRESOLVE_BRACKET`` integers: the rest of the choice is left to the MILP);
- branch and bound over intervals [a, b] of N_r with ``interval_bound``: every part of a stream's time is monotone in
  N_r -- KV and disk bytes fall, the hidden state's copies rise, and T_compute(n) >= compute_seconds on the same
  hardware with its GEMM efficiency curve replaced by its suffix maximum (never below the real curve, and
  non-increasing, so that bound rises with n) -- so on [a, b] each stream is at least its falling parts at b plus its
  rising parts at a. An interval whose bound exceeds U (or equals U and starts after the incumbent: ties go to the
  smaller N_r) holds no answer.

What remains (typically 1-40 integers) goes into the MILP. ``solve_exact`` takes the minimum over the same candidates
directly (the fast path); ``brute_force`` evaluates every integer (tests check all three agree). If a hardware
profile's transfer curve is not monotone in bytes, the presolve is skipped and every integer is a candidate.

Bad input: a context under 1 token or bounds that cannot hold (lo > hi, lo > N_ctx) raise ``OffsimError``; a MILP
that is infeasible (e.g. GPU memory leaves no room even for N_r = lo) or that the solver fails on gives N_r = 0 with a
``RuntimeWarning`` saying why.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from offsim.core import costmodel as cm
from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.solvers import solve_quietly
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec

ILP_SOLVER = "HIGHS"  # cvxpy's name for HiGHS; named explicitly, never "whatever cvxpy finds first"
TRANSFER_MODELS = ("streams", "serial")
SOLVERS = ("ilp", "exact")
NUM_ROWS = 4  # streams bounding t in the MILP: compute, h2d, disk, d2h
PRESOLVE_BRACKET = 16  # the presolve's crossing search stops when the bracket is this many integers wide
_LEAF = 4  # the branch and bound stops splitting intervals of this many integers
_TIE_EPS = 1e-9  # weight of the candidate's rank (smaller N_r first) against t, which is scaled to ~1
# mip_rel_gap 0: the exact optimum, not one within HiGHS' default 0.01 %. The feasibility-jump heuristic costs
# ~5 ms of fixed overhead per solve on these tiny problems and never helps (the LP relaxation finds the optimum at the
# root), so it is off; presolve off saves ~0.5 ms. Measured on the 2-core dev box: ~2.5 ms per MILP instead of ~9.
HIGHS_OPTIONS = {"output_flag": False, "mip_rel_gap": 0.0, "mip_abs_gap": 0.0, "presolve": "off",
                 "mip_heuristic_run_feasibility_jump": False, "mip_feasibility_tolerance": 1e-9,
                 "primal_feasibility_tolerance": 1e-9}
# threads=1: a MILP this small gains nothing from HiGHS' worker threads, and on a loaded 2-core machine their
# synchronisation adds ~6 ms to about half the solves. HiGHS keeps one global scheduler per process: threads=1 is
# honoured when this is the first HiGHS call (later callers with the default 0 = automatic still work); otherwise we
# fall back to the caller's setting.
_threads_ok = True
_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class KVDistributorWarning(RuntimeWarning):
    """The ILP was infeasible or the solver failed; the decision fell back to N_r = 0."""


@dataclass(frozen=True)
class Decision:
    """One KV-distributor problem: a GPU batch of ``num_seqs`` sequences at a decode step where ``ctx_tokens``
    (N_ctx) tokens already have KV. ``kv_cpu_heads`` / ``kv_disk_heads``: KV heads homed in host memory (C_c) and on
    disk (C_d) -- the GPU-homed heads are never loaded. ``weight_cpu_bytes`` / ``weight_disk_bytes``: the weight slice
    that rides on this batch's compute (from host memory, and from disk through host memory). ``lo``/``hi``: bounds on
    N_r set by the user (``hi`` None: N_ctx); ``mem_hi``: the largest N_r whose recompute fits in GPU memory (None: no
    limit). ``pinned``: host buffers pinned. ``hidden_offloaded``: the hidden state of the computed tokens goes to
    host memory after each layer and comes back before the next; ``hidden_serial``: that round trip cannot overlap
    another batch's compute (a block of one GPU batch), so it lengthens the compute stream's critical path."""

    num_seqs: int
    ctx_tokens: int
    kv_cpu_heads: int
    kv_disk_heads: int
    weight_cpu_bytes: int = 0
    weight_disk_bytes: int = 0
    lo: int = 0
    hi: int | None = None
    mem_hi: int | None = None
    pinned: bool = True
    hidden_offloaded: bool = False  # activations parked in host memory between layers (h2d and d2h per layer)
    hidden_serial: bool = False  # ... and no other batch runs while they travel (one GPU batch): on the critical path

    def bounds(self) -> tuple[int, int]:
        """[lo, hi] of N_r after the user's bounds; raises OffsimError when they cannot hold."""
        if self.ctx_tokens < 1:
            raise OffsimError(f"KV distributor: the context must hold at least 1 token (N_ctx >= 1), got "
                              f"{self.ctx_tokens}")
        if self.num_seqs < 1:
            raise OffsimError(f"KV distributor: num_seqs must be >= 1, got {self.num_seqs}")
        if min(self.kv_cpu_heads, self.kv_disk_heads, self.weight_cpu_bytes, self.weight_disk_bytes) < 0:
            raise OffsimError("KV distributor: head counts and weight bytes must be non-negative")
        hi = self.ctx_tokens if self.hi is None else self.hi
        if self.lo < 0 or hi < self.lo or self.lo > self.ctx_tokens or hi > self.ctx_tokens:
            raise OffsimError(f"KV distributor: N_r bounds [{self.lo}, {hi}] cannot hold: need 0 <= lo <= hi <= "
                              f"N_ctx = {self.ctx_tokens}")
        return self.lo, hi


def kv_load_bytes(model: ModelSpec, num_seqs: int, heads: int, tokens: int,
                  comp: Compression = NO_COMPRESSION) -> int:
    """Bytes of the KV of ``tokens`` tokens of ``num_seqs`` sequences over ``heads`` of the model's KV heads, one
    layer, that one KV load of a TightLLM plan moves: K and V at their stored size, whole with sparse attention too
    (``footprint.kv_load_bytes``)."""
    return fp.kv_load_bytes(model, num_seqs, tokens, heads, comp)


def _suffix_max_curve(curve):
    """The curve's running maximum from the right: >= the curve everywhere (log-linear interpolation is a convex
    combination of the end points) and non-increasing."""
    out, m = [], 0.0
    for x, y in reversed(curve):
        m = max(m, y)
        out.append((x, m))
    return tuple(reversed(out))


def _transfer_monotone(curve) -> bool:
    """True when bytes / bandwidth(bytes) is non-decreasing along a log-interpolated bandwidth curve: on a segment
    d/dx [x / bw(x)] >= 0  iff  bw(x) >= (y1 - y0) / ln(x1 / x0), which holds if it holds for the smaller end."""
    return all(min(y0, y1) >= (y1 - y0) / math.log(x1 / x0) for (x0, y0), (x1, y1) in zip(curve, curve[1:]))


class KVDistributor:
    """Solves ``Decision`` problems for one model on one hardware; memoises decisions (a plan asks the same one for
    every batch that shares a step)."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, transfer_model: str = "streams",
                 comp: Compression = NO_COMPRESSION, masked: bool = False, kv_len: int = 0):
        if transfer_model not in TRANSFER_MODELS:
            raise OffsimError(f"transfer_model must be one of {TRANSFER_MODELS}, got {transfer_model!r}")
        self.model, self.hw, self.transfer_model = model, hw, transfer_model
        # compression: KV loads at their stored size, compute with its dequantize / quantize
        # passes -- a compressed cache makes loading cheaper, so recompute pays off later (a smaller N_r)
        self.comp = comp
        # left-padded batches (``Workload.padded``): an eager recompute attends under a key mask, as the simulator
        # prices it (``costmodel.attention_seconds``)
        self.masked = masked
        # the KV buffers' length (``Workload.max_len``): what a graphed decode op attends over, as the simulator
        # prices it where the profile measured that kernel (``costmodel.attention_seconds``)
        self.kv_len = kv_len
        self.bracket = PRESOLVE_BRACKET
        # the lower-bound hardware: same everything, GEMM efficiency replaced by its suffix maximum
        self._hw_lb = hw.with_(gemm_efficiency=_suffix_max_curve(hw.gemm_efficiency))
        self._presolve_ok = all(_transfer_monotone(c) for c in (hw.h2d_pinned, hw.h2d_pageable, hw.d2h_pinned,
                                                                hw.d2h_pageable))
        self._memo: dict[tuple, tuple[int, str | None]] = {}  # (decision, solver) -> (N_r, fallback warning)
        self._last_fallback: str | None = None
        self._evals: dict[int, tuple[float, ...]] = {}  # n -> ``_parts`` of the decision being solved
        self._evals_of: Decision | None = None
        self.stats = {"decisions": 0, "candidates": 0, "evaluations": 0}

    # ---- the stream times of one candidate -------------------------------------------------------------------
    def stream_seconds(self, d: Decision, n: int) -> tuple[float, float, float, float]:
        """(compute, h2d, disk, d2h) seconds of one decoder layer of this batch when it recomputes its last ``n``
        tokens. Compute: 'layer' over q = n + 1 tokens at context N_ctx + 1. H2D: the KV of tokens [0, N_ctx - n) of
        the host- and disk-homed heads and the weight slice (one copy per source, as the plan issues them), and the
        hidden state of the q tokens if parked in host memory. Disk: the disk-homed share of KV and weights, read
        into host memory first. D2H: the hidden state going back to host memory (the new token's KV store, a few
        KB, is left out)."""
        t_c, t_kvw, t_hid, t_d, t_dd = self._parts(d, n)
        return t_c, t_kvw + t_hid, t_d, t_dd

    def _parts(self, d: Decision, n: int) -> tuple[float, float, float, float, float]:
        """(compute, h2d of KV and weights, h2d of the hidden state, disk, d2h): the h2d split into the part that
        falls with n and the part that rises, for the presolve's bounds."""
        if d is not self._evals_of:  # keep the evaluations of the decision being solved only
            self._evals, self._evals_of = {}, d
        hit = self._evals.get(n)
        if hit is not None:
            return hit
        m, hw = self.model, self.hw
        self.stats["evaluations"] += 1
        # offexec replays a recompute of up to GRAPH_MAX_Q_TOKENS query tokens as a CUDA graph
        graphed = n + 1 <= cm.GRAPH_MAX_Q_TOKENS
        t_c = cm.compute_seconds(m, hw, "layer", d.num_seqs, n + 1, d.ctx_tokens + 1, graphed, comp=self.comp,
                                 masked=self.masked and not graphed, kv_len=self.kv_len)
        loaded = d.ctx_tokens - n
        kv_d = kv_load_bytes(m, d.num_seqs, d.kv_disk_heads, loaded, self.comp)
        t_kvw = 0.0
        for nbytes in (kv_load_bytes(m, d.num_seqs, d.kv_cpu_heads, loaded, self.comp), kv_d, d.weight_cpu_bytes,
                       d.weight_disk_bytes):
            if nbytes:
                t_kvw += cm.transfer_seconds(hw, nbytes, "h2d", pinned=d.pinned)
        t_hid = t_dd = 0.0
        if d.hidden_offloaded:
            hb = fp.hidden_bytes(m, d.num_seqs, n + 1)
            t_hid = cm.transfer_seconds(hw, hb, "h2d", pinned=d.pinned)
            t_dd = cm.transfer_seconds(hw, hb, "d2h", pinned=d.pinned)
            if d.hidden_serial:  # layer j+1 waits for layer j's output to go to the host and back
                t_c += t_hid + t_dd
        t_d = cm.disk_seconds(hw, kv_d, "read") + cm.disk_seconds(hw, d.weight_disk_bytes, "read")
        out = self._evals[n] = (t_c, t_kvw, t_hid, t_d, t_dd)
        return out

    def combine(self, t) -> float:
        """The objective from the stream times: max(T_compute, T_transfer, T_d2h)."""
        t_c, t_h, t_d, t_dd = t
        return max(t_c, t_h + t_d, t_dd) if self.transfer_model == "serial" else max(t_c, t_h, t_d, t_dd)

    def objective(self, d: Decision, n: int) -> float:
        """Seconds of one layer of this batch with N_r = n (the larger of its compute and its transfers)."""
        return self.combine(self.stream_seconds(d, n))

    def interval_bound(self, d: Decision, a: int, b: int) -> float:
        """A lower bound on the objective over N_r in [a, b]. Each part of a stream's time is monotone in N_r: the KV
        and disk parts fall (fewer tokens loaded), the hidden state's copies rise, and compute is at least
        ``compute_seconds`` on the suffix-max GEMM curve, which rises. So on [a, b] each stream is at least its
        falling parts at b plus its rising parts at a."""
        _, kvw_b, _, disk_b, _ = self._parts(d, b)
        _, _, hid_a, _, dd_a = self._parts(d, a)
        lb_c = cm.compute_seconds(self.model, self._hw_lb, "layer", d.num_seqs, a + 1, d.ctx_tokens + 1, False,
                                  comp=self.comp, masked=self.masked)
        if a + 1 <= cm.GRAPH_MAX_Q_TOKENS:  # n in [a, b] may run graphed or eager: the lower of the two at a
            lb_c = min(lb_c, cm.compute_seconds(self.model, self._hw_lb, "layer", d.num_seqs, a + 1,
                                                d.ctx_tokens + 1, True, comp=self.comp))
        if d.hidden_serial:
            lb_c += hid_a + dd_a
        return self.combine((lb_c, kvw_b + hid_a, disk_b, dd_a))

    # ---- solvers ---------------------------------------------------------------------------------------------
    def brute_force(self, d: Decision) -> int:
        """The smallest N_r minimising the objective, by evaluating every integer in the bounds (for tests)."""
        lo, hi = self.feasible_bounds(d)
        if lo is None:
            return 0
        vals = [self.objective(d, n) for n in range(lo, hi + 1)]
        return lo + int(np.argmin(vals))  # argmin returns the first minimum: the smallest N_r

    def candidates(self, d: Decision) -> tuple[list[int], float]:
        """Every N_r the presolve cannot exclude (ascending), and a global lower bound on the objective. All
        minimisers of the objective over the bounds are in the list."""
        lo, hi = self.feasible_bounds(d)
        if lo is None:
            return [], 0.0
        if not self._presolve_ok or hi - lo <= 16:
            return list(range(lo, hi + 1)), 0.0
        f = self.objective
        # 1. an attained value U: a geometric grid over [lo, hi], then a bisection for the crossing of compute and
        #    transfer between the best grid point's neighbours (both are near-monotone: a good U, not a proof)
        grid = sorted({lo, hi, *(lo + int(round((hi - lo) * r)) for r in np.geomspace(1e-3, 1, 14))})
        vals = [f(d, n) for n in grid]
        b = int(np.argmin(vals))
        best_n, U = grid[b], vals[b]
        a_, b_ = grid[max(b - 1, 0)], grid[min(b + 1, len(grid) - 1)]
        while b_ - a_ > self.bracket:  # stop at a bracket: what is left of the choice is the MILP's
            mid = (a_ + b_) // 2
            t = self.stream_seconds(d, mid)
            v = self.combine(t)
            if v < U or (v == U and mid < best_n):
                best_n, U = mid, v
            if max(t[0], t[3]) >= (t[1] + t[2] if self.transfer_model == "serial" else max(t[1], t[2])):
                b_ = mid
            else:
                a_ = mid
        # 2. branch and bound over intervals of N_r (``interval_bound``): an interval whose bound exceeds U, or
        #    equals U while starting after the best n (ties go to the smaller N_r), holds no answer
        bound = functools.partial(self.interval_bound, d)
        keep, stack = [], [(lo, hi)]
        while stack:
            a, b = stack.pop()
            v = bound(a, b)
            if v > U or (v == U and a > best_n):
                continue
            if b - a < _LEAF:
                keep.append((a, b, v))
                continue
            mid = (a + b) // 2
            fm = f(d, mid)
            if fm < U or (fm == U and mid < best_n):
                best_n, U = mid, fm
            stack += [(mid + 1, b), (a, mid)]
        out = [n for a, b, v in sorted(keep) if not (v > U or (v == U and a > best_n)) for n in range(a, b + 1)]
        glb = bound(lo, hi)
        return out, glb

    def certified(self, d: Decision) -> tuple[list[int], np.ndarray]:
        """The candidates the MILP chooses from and their (compute, h2d, disk, d2h) seconds, [K, 4]: ``candidates``,
        cut after the first one that reaches the global lower bound (none later can be better, and ties go to the
        smaller N_r)."""
        cands, glb = self.candidates(d)
        rows = []
        for n in cands:
            t = self.stream_seconds(d, n)
            rows.append(t)
            if self.combine(t) <= glb:
                break
        return cands[:len(rows)], np.array(rows, dtype=float).reshape(-1, 4)

    def _stream_matrix(self, times: np.ndarray) -> np.ndarray:
        """Rows the MILP bounds t with: [compute, h2d, disk, d2h], or [compute, h2d + disk, d2h, 0] (serial)."""
        if self.transfer_model == "serial":
            return np.column_stack([times[:, 0], times[:, 1] + times[:, 2], times[:, 3], np.zeros(len(times))])
        return times

    def solve_exact(self, d: Decision) -> int:
        """The fast path: the smallest minimiser over the certified candidates (no MILP)."""
        cands, times = self.certified(d)
        if not cands:
            return self._fallback(d, "infeasible: no N_r in the bounds fits in GPU memory")
        f = self._stream_matrix(times).max(1)
        return cands[int(np.argmin(f))]

    def solve_ilp(self, d: Decision) -> int:
        """The MILP (cvxpy + HiGHS): one binary per certified candidate N_r, t above each stream's time, minimise
        t (ties to the smaller N_r)."""
        cands, times = self.certified(d)
        if not cands:
            return self._fallback(d, "infeasible: no N_r in the bounds fits in GPU memory")
        times = self._stream_matrix(times)
        scale = float(times.max()) or 1.0
        try:
            k = _solve_choice_milp(times / scale)
        except _MilpFailure as e:
            return self._fallback(d, str(e))
        self.stats["candidates"] += len(cands)
        return cands[k]

    def decide(self, d: Decision, solver: str = "ilp") -> int:
        """N_r for this problem (memoised), by the MILP (``solver='ilp'``) or the exact fast path (``'exact'``)."""
        if solver not in SOLVERS:
            raise OffsimError(f"KV distributor solver must be one of {SOLVERS}, got {solver!r}")
        key = (d, solver)
        hit = self._memo.get(key)
        if hit is None:
            d.bounds()  # raise on bad input before anything else
            self.stats["decisions"] += 1
            self._last_fallback = None
            n = self.solve_ilp(d) if solver == "ilp" else self.solve_exact(d)
            hit = self._memo[key] = (n, self._last_fallback)
        elif hit[1]:  # a remembered fallback warns again, so every plan that relies on it hears about it
            warnings.warn(hit[1], KVDistributorWarning, stacklevel=2)
        return hit[0]

    # ---- helpers ---------------------------------------------------------------------------------------------
    def feasible_bounds(self, d: Decision) -> tuple[int | None, int | None]:
        """The user's bounds cut by the GPU-memory cap; (None, None) when nothing is left (infeasible)."""
        lo, hi = d.bounds()
        if d.mem_hi is not None:
            hi = min(hi, d.mem_hi)
        if hi < lo:
            return None, None
        return lo, hi

    def _fallback(self, d: Decision, why: str) -> int:
        msg = f"KV distributor (N_ctx={d.ctx_tokens}, batch of {d.num_seqs}): {why}; recomputing no tokens (N_r = 0)"
        self._last_fallback = msg
        warnings.warn(msg, KVDistributorWarning, stacklevel=3)
        return 0


# --------------------------------------------------------------------------------------------------------------
# the parameterised MILP
# --------------------------------------------------------------------------------------------------------------
class _MilpFailure(Exception):
    pass


class _ChoiceMilp:
    """min t + eps·(rank · x)  s.t.  t >= T[s, :] · x for each stream s,  t >= f · x,  sum(x) = 1,  x binary
    (K candidates, f_k = max_s T[s, k]):
    TightLLM's min max(T_compute, T_transfer) with one binary per candidate N_r, whose stream times are evaluated
    exactly by the cost model (the MFU curves make them non-linear in N_r).
    Compiled once per K (cvxpy DPP); a decision only sets the parameters T and f."""

    def __init__(self, K: int):
        import cvxpy as cp

        self.cp = cp
        self.K = K
        self.T = cp.Parameter((NUM_ROWS, K), nonneg=True)
        self.f = cp.Parameter(K, nonneg=True)  # each candidate's objective, max over its streams
        self.x = cp.Variable(K, boolean=True)
        self.t = cp.Variable()
        rank = np.arange(K) / K  # ties go to the earliest candidate: the smallest N_r
        # f @ x <= t is a valid cut (for a one-hot x it says t >= max_s T[s, k]) that makes the LP relaxation
        # tight: without it a fractional x mixes candidates whose bottleneck streams differ and HiGHS branches for
        # seconds when thousands of candidates survive the presolve (e.g. one batch carrying a whole layer's weights)
        self.prob = cp.Problem(cp.Minimize(self.t + _TIE_EPS * rank @ self.x),
                               [self.T @ self.x <= self.t, self.f @ self.x <= self.t, cp.sum(self.x) == 1])

    def solve(self, T: np.ndarray) -> int:
        cp = self.cp
        n = T.shape[0]
        full = np.empty((NUM_ROWS, self.K))
        full[:, :n] = T.T
        full[:, n:] = 2.0  # padding: a candidate slower than any real one (T is scaled to at most 1)
        self.T.value = full
        self.f.value = full.max(0)
        global _threads_ok
        try:
            if _threads_ok:
                try:
                    solve_quietly(self.prob, solver=ILP_SOLVER, threads=1, **HIGHS_OPTIONS)
                except cp.error.SolverError:
                    # HiGHS refuses threads=1 when another caller already started its global scheduler with more
                    # threads; solve as that caller set it up from now on
                    _threads_ok = False
                    solve_quietly(self.prob, solver=ILP_SOLVER, **HIGHS_OPTIONS)
            else:
                solve_quietly(self.prob, solver=ILP_SOLVER, **HIGHS_OPTIONS)
        except (cp.error.SolverError, ValueError) as e:
            raise _MilpFailure(f"HiGHS failed on the MILP ({e})") from None
        if self.prob.status != cp.OPTIMAL or self.x.value is None:
            raise _MilpFailure(f"HiGHS returned status {self.prob.status!r} for the MILP")
        k = int(np.argmax(self.x.value))
        return min(k, n - 1)


@lru_cache(maxsize=None)
def _milp(K: int) -> _ChoiceMilp:
    return _ChoiceMilp(K)


def _solve_choice_milp(T: np.ndarray) -> int:
    """Index of the candidate the MILP picks; T is [n, 4] stream seconds, scaled to at most 1."""
    n = T.shape[0]
    K = next((b for b in _BUCKETS if b >= n), None)
    if K is None:
        raise _MilpFailure(f"{n} candidates exceed the largest MILP size {_BUCKETS[-1]}")
    return _milp(K).solve(T)


@lru_cache(maxsize=64)
def distributor(model: ModelSpec, hw: HardwareSpec, transfer_model: str = "streams",
                comp: Compression = NO_COMPRESSION, masked: bool = False, kv_len: int = 0) -> KVDistributor:
    """A shared distributor per (model, hardware, transfer model, compression, masked attention, KV buffer length),
    so decisions are memoised across plans."""
    return KVDistributor(model, hw, transfer_model, comp, masked, kv_len)
