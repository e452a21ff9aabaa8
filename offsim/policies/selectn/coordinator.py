"""Select-N's PCIe bandwidth coordinator (arXiv 2502.08182, its PCIe bandwidth coordinator; docs/cost-model.md §9).

Several GPUs, each serving one model instance, share one host link (e.g. two GPUs behind one PCIe switch). Each
instance keeps a range [N_min, N_max] of offloading intervals; a smaller N frees more GPU memory (more weights served
from the host) but moves more bytes over the shared link. The coordinator chooses one interval per instance so that
every instance meets its latency SLO and the total host memory used is maximised -- the paper's
"ΣBW_i ≤ BW_total, maximise ΣHostMemory_i".

Model of the shared link: instance i with interval N needs a share ``x_i(N)`` of the link's bandwidth -- the
least share on a grid (``SHARE_GRID``) at which the simulator, run with ``HardwareSpec.scaled_link(share)``, keeps
its iteration latency within the SLO (latency only falls as the share grows, so a bisection finds it). The link is
not oversubscribed when Σ x_i ≤ 1: then each instance gets at least its share under any work-conserving
arbitration. Building these demand tables is offline (like the record); the decision itself is a multiple-choice
knapsack over them:

    maximise  Σ_i Σ_N host_bytes_i(N) · y_iN          y_iN ∈ {0, 1}
    s.t.      Σ_N y_iN = 1                for every instance i
              Σ_i Σ_N x_i(N) · y_iN ≤ 1   (the link)

solved as a MILP in cvxpy (``solver=cp.HIGHS``, named explicitly), or exactly by dynamic programming over the share
grid (``method='dp'``, shares are integer multiples of 1/grid, so the DP is exact, and it takes well under a
millisecond); ``method='brute'`` enumerates (small cases, for tests). Ties in host memory go to the allocation that
uses less of the link.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable

from offsim.core.errors import OffsimError
from offsim.policies.selectn.policy import host_weight_bytes, offloaded_layers
from offsim.policies.selectn.record import iteration_latency
from offsim.core.specs import HardwareSpec, ModelSpec

SHARE_GRID = 40  # link shares are multiples of 1/40 (2.5 %)
TIE_EPS = 1e-6  # weight of the link share used against host memory (in GB) in the MILP objective


@dataclass(frozen=True)
class Option:
    """One interval an instance could run: it meets the SLO with ``share_units``/grid of the link."""

    interval: int
    host_bytes: int
    share_units: int
    latency_s: float  # at that share

    def share(self, grid: int = SHARE_GRID) -> float:
        return self.share_units / grid

    def hardware(self, hw: HardwareSpec, grid: int = SHARE_GRID) -> HardwareSpec:
        """``hw`` with the link scaled to this option's share (unchanged when nothing crosses the link)."""
        return hw if self.share_units in (0, grid) else hw.scaled_link(self.share_units / grid)


@dataclass(frozen=True)
class Instance:
    """A model instance on its own GPU: the intervals that meet its SLO with some share of the link."""

    name: str
    slo_s: float
    options: tuple[Option, ...]
    grid: int = SHARE_GRID
    note: str = ""  # why there are no options, when there are none


def instance_options(model: ModelSpec, hw: HardwareSpec, phase: str, batch: int, seq_len: int, slo_s: float,
                     name: str | None = None, grid: int = SHARE_GRID,
                     intervals: Iterable[int] | None = None) -> Instance:
    """The demand table of one instance: for every interval that fits GPU memory and meets ``slo_s`` with the whole
    link, the least link share (a multiple of 1/grid) with which it still does. Least offloading first (all of
    num_layers + 1 .. 1, or ``intervals``); the scan stops at the first interval that misses the SLO even with the
    whole link."""
    if not 0 < slo_s < float("inf"):
        raise OffsimError(f"SLO must be a positive number of seconds, got {slo_s!r}")
    name = name or model.name
    cache: dict[tuple[int, int], float | None] = {}

    def lat(n: int, units: int) -> float | None:
        if (n, units) not in cache:
            h = hw if units == grid else hw.scaled_link(units / grid)
            cache[n, units] = iteration_latency(model, h, phase, batch, seq_len, n).latency_s
        return cache[n, units]

    opts, best = [], None
    for n in sorted(intervals or range(1, model.num_layers + 2), reverse=True):
        full = lat(n, grid)
        if full is None:  # does not fit GPU memory: more offloading might
            continue
        best = full if best is None else min(best, full)
        if full > slo_s:
            break
        if not offloaded_layers(model.num_layers, n):  # nothing crosses the link
            opts.append(Option(n, 0, 0, full))
            continue
        lo, hi = 1, grid  # invariant: hi meets the SLO
        while lo < hi:
            mid = (lo + hi) // 2
            if lat(n, mid) <= slo_s:
                hi = mid
            else:
                lo = mid + 1
        opts.append(Option(n, host_weight_bytes(model, n), hi, lat(n, hi)))
    note = ""
    if not opts:
        note = (f"{name}: no interval fits GPU memory at {phase} batch {batch}, seq_len {seq_len}" if best is None
                else f"{name}: no interval meets the {phase} SLO {slo_s * 1e3:.1f} ms at batch {batch}, seq_len "
                     f"{seq_len} even with the whole link; best achievable {best * 1e3:.1f} ms")
    return Instance(name, slo_s, tuple(opts), grid, note)


@dataclass(frozen=True)
class Allocation:
    """The coordinator's decision: one option per instance."""

    names: tuple[str, ...]
    choices: tuple[Option, ...]
    grid: int
    method: str
    decide_s: float

    @property
    def intervals(self) -> dict[str, int]:
        return {n: c.interval for n, c in zip(self.names, self.choices)}

    @property
    def shares(self) -> dict[str, float]:
        return {n: c.share(self.grid) for n, c in zip(self.names, self.choices)}

    @property
    def host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.choices)

    @property
    def share_units(self) -> int:
        return sum(c.share_units for c in self.choices)


def _check(instances: list[Instance]) -> int:
    if not instances:
        raise OffsimError("the coordinator needs at least one instance")
    grids = {i.grid for i in instances}
    if len(grids) != 1:
        raise OffsimError(f"instances use different share grids {sorted(grids)}; build them with one grid")
    for i in instances:
        if not i.options:
            raise OffsimError(f"the coordinator cannot serve {i.note or i.name}")
    grid = grids.pop()
    need = sum(min(o.share_units for o in i.options) for i in instances)
    if need > grid:
        least = ", ".join(f"{i.name} {min(o.share_units for o in i.options) / grid:.1%}" for i in instances)
        raise OffsimError(f"the shared link is oversubscribed even with the least offloading: the instances need "
                          f"{need / grid:.1%} of it ({least}); lower a batch or relax an SLO")
    return grid


def _key(choices) -> tuple:
    return (sum(c.host_bytes for c in choices), -sum(c.share_units for c in choices))


def coordinate(instances: list[Instance], method: str = "dp") -> Allocation:
    """Choose one interval per instance: every SLO met (by construction of the options), Σ share ≤ 1, host memory
    maximised. ``method``: 'dp' (exact on the share grid, well under a millisecond: the run-time default), 'milp'
    (the integer program in cvxpy + HiGHS: the same optimum in tens of milliseconds, most of it cvxpy compiling
    the problem) or 'brute' (enumeration, for tests)."""
    grid = _check(instances)
    t0 = time.perf_counter()
    if method == "brute":
        best = None
        for combo in itertools.product(*(i.options for i in instances)):
            if sum(c.share_units for c in combo) <= grid and (best is None or _key(combo) > _key(best)):
                best = combo
        choices = best
    elif method == "dp":
        choices = _dp(instances, grid)
    elif method == "milp":
        choices = _milp(instances, grid)
    else:
        raise OffsimError(f"coordinator method must be 'milp', 'dp' or 'brute', got {method!r}")
    dt = time.perf_counter() - t0
    return Allocation(tuple(i.name for i in instances), tuple(choices), grid, method, dt)


def _dp(instances: list[Instance], grid: int) -> tuple[Option, ...]:
    """Multiple-choice knapsack by dynamic programming over used share units: state = units used so far, value =
    (host bytes, −units) of the best partial choice reaching it."""
    states: dict[int, tuple[tuple, tuple[Option, ...]]] = {0: ((0, 0), ())}
    for inst in instances:
        nxt: dict[int, tuple[tuple, tuple[Option, ...]]] = {}
        for used, (_, chosen) in states.items():
            for o in inst.options:
                u = used + o.share_units
                if u > grid:
                    continue
                cand = chosen + (o,)
                k = _key(cand)
                if u not in nxt or k > nxt[u][0]:
                    nxt[u] = (k, cand)
        states = nxt
    return max(states.values(), key=lambda v: v[0])[1]


def _milp(instances: list[Instance], grid: int) -> tuple[Option, ...]:
    import cvxpy as cp
    import numpy as np

    flat = [(i, o) for i, inst in enumerate(instances) for o in inst.options]
    y = cp.Variable(len(flat), boolean=True)
    host_gb = np.array([o.host_bytes / 1e9 for _, o in flat])
    units = np.array([o.share_units for _, o in flat], dtype=float)
    cons = [units @ y <= grid]
    for i in range(len(instances)):
        cons.append(cp.sum(y[[k for k, (ii, _) in enumerate(flat) if ii == i]]) == 1)
    prob = cp.Problem(cp.Maximize(host_gb @ y - TIE_EPS * (units @ y)), cons)
    from offsim.core.solvers import solve_quietly

    solve_quietly(prob, solver=cp.HIGHS)
    if prob.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or y.value is None:
        raise OffsimError(f"the coordinator's MILP did not solve (status {prob.status})")
    picked = [flat[k][1] for k in range(len(flat)) if y.value[k] > 0.5]
    return tuple(picked)
