"""Select-N's offline performance record and its runtime choice of the offloading interval N (arXiv 2502.08182;
docs/cost-model.md §9).

Offline: for one (model, hardware) the record holds the per-iteration latency of every interval N at each point of
a grid of batch sizes × sequence lengths (powers of two) -- TTFT of a prefill iteration, TPOT of a decode iteration
-- together with the GPU peak and the host bytes of the offloaded weights. From it, per point and phase:

- N_max: the least offloading (largest N) whose plan fits GPU memory;
- N_min: the most offloading (smallest N) such that every measured interval from N_min up to N_max meets the SLO.

Building it follows the write-up's three speed-ups: only powers of two; early termination -- the scan over N at a
point stops at the first N that misses the SLO (N_min − 1 is that one), and the scan over batch sizes at a sequence
length stops at the first point no N can serve (latency and memory only grow with the batch); and convergence to
N = 1 -- once the copy of a layer hides under the compute of one layer (prefill at large batch·length), offloading
every layer costs nothing, so past the smallest batch·length where that was seen a point is probed at N = 1 and N_max
only (and scanned in full if the probe shows it has not converged).

Latencies come from the simulator on the real model (every layer): a prefill iteration is the plan of
``Workload(s, 1, b)`` (its makespan is the TTFT); a decode iteration at context s is step 2 of ``Workload(s − 2, 3,
b)`` (its step latency, steady state: step 1 still overlaps the prefill's tail). The same CSV schema takes measured
latencies from ``offexec`` (column ``source``).

At run time ``choose_interval`` picks N for one iteration from the point that covers the current batch and sequence
length (the next grid point up: latency and memory grow with both, so the choice is conservative); prefill and decode
have their own SLO and their own N. A plan's weight placement is static, so a change of N between iterations is
priced as the copy of the layers that become resident (``switch_seconds``); ``simulate_phased`` runs a workload that
way.

CSV schema (``RECORD_SCHEMA``): the first line is ``# `` + JSON metadata (model, hardware, gpu_mem_bytes,
link_share, ttft_slo_s, tpot_slo_s, batches, seq_lens, converge_tol, provenance); then one row per measured
(phase, batch, seq_len, interval) with columns ``RECORD_COLUMNS``:

- ``phase``: 'prefill' (latency = TTFT) or 'decode' (latency = TPOT at context seq_len);
- ``batch``, ``seq_len``: the grid point; ``interval``: N (num_layers + 1 = nothing offloaded);
- ``offloaded_layers``, ``host_bytes``: layers and weight bytes served from host memory;
- ``gpu_peak_bytes``: GPU memory peak of the iteration (empty when it does not fit);
- ``status``: 'ok' (latency measured) or 'oom' (the plan does not fit GPU memory);
- ``latency_s``: seconds of the iteration (empty for 'oom');
- ``source``: 'offsim' (simulated) or 'offexec' (measured).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from offsim.core import costmodel
from offsim.core.errors import OffsimError
from offsim.core.io import read_commented_csv, write_commented_csv
from offsim.policies import build_plan
from offsim.policies.selectn.policy import SelectNSettings, host_weight_bytes, offloaded_layers
from offsim.core.sim import simulate
from offsim.core.specs import HardwareSpec, ModelSpec, Workload

RECORD_SCHEMA = "offsim.selectn_record/1"
RECORD_COLUMNS = ["phase", "batch", "seq_len", "interval", "offloaded_layers", "host_bytes", "gpu_peak_bytes",
                  "status", "latency_s", "source"]
PHASES = ("prefill", "decode")
DEFAULT_BATCHES = tuple(2**i for i in range(9))  # 1 .. 256
DECODE_STEP = 2  # the decode step whose latency is the TPOT (steady state, see the module docstring)


from offsim.core.provenance import provenance  # noqa: E402  (re-exported: experiments import it from here)


def intervals_of(model: ModelSpec) -> list[int]:
    """Every interval worth measuring, least offloading first: num_layers + 1 (none) down to 1 (every layer)."""
    return list(range(model.num_layers + 1, 0, -1))


def default_seq_lens(model: ModelSpec, lo: int = 128, hi: int = 4096) -> tuple[int, ...]:
    """Powers of two from ``lo`` up to the model's position table (and ``hi``)."""
    out, s = [], lo
    while s <= min(hi, model.max_positions):
        out.append(s)
        s *= 2
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# one iteration
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IterationResult:
    """One (phase, batch, seq_len, interval) measurement; ``latency_s`` is None when the plan does not fit."""

    latency_s: float | None
    gpu_peak_bytes: int | None
    host_bytes: int
    offloaded_layers: int

    @property
    def fits(self) -> bool:
        return self.latency_s is not None


def iteration_workload(phase: str, batch: int, seq_len: int) -> Workload:
    """The workload whose simulation prices one iteration (see the module docstring)."""
    if phase == "prefill":
        return Workload(seq_len, 1, batch, 1)
    if phase == "decode":
        if seq_len < 3:
            raise OffsimError(f"decode iterations are priced at contexts >= 3 tokens, got seq_len {seq_len}")
        return Workload(seq_len - DECODE_STEP, DECODE_STEP + 1, batch, 1)
    raise OffsimError(f"phase must be one of {PHASES}, got {phase!r}")


def _is_memory_error(e: OffsimError) -> bool:
    return "capacity" in str(e)  # both plan validation and the simulator name the tier's capacity


def iteration_latency(model: ModelSpec, hw: HardwareSpec, phase: str, batch: int, seq_len: int,
                      interval: int) -> IterationResult:
    """Simulate one iteration of Select-N with interval N on the real model; latency None if it does not fit."""
    wl = iteration_workload(phase, batch, seq_len)
    host = host_weight_bytes(model, interval)
    n_off = len(offloaded_layers(model.num_layers, interval))
    try:  # build_plan refuses a placement that does not fit from arithmetic (footprint.check_fits), before any op
        plan = build_plan("selectn", model, hw, wl, SelectNSettings(interval=interval), validate=False)
        plan.validate()
        tr = simulate(plan, hw)
    except OffsimError as e:  # PlanError is an OffsimError
        if _is_memory_error(e):
            return IterationResult(None, None, host, n_off)
        raise
    if phase == "prefill":
        lat = tr.makespan_s
    else:
        sl = tr.step_latency()
        lat = float(sl.loc[sl["step"] == DECODE_STEP, "latency_s"].iloc[0])
    return IterationResult(float(lat), int(tr.peak_bytes["gpu"]), host, n_off)


# ----------------------------------------------------------------------------------------------------------------
# the record
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PointSummary:
    """What the record says about one grid point for one SLO. ``status``: 'meets' (n_min..n_max meet the SLO),
    'slo_unreachable' (fits, but no interval meets the SLO; ``best_*`` is the best there is), 'oom' (no interval
    fits GPU memory)."""

    phase: str
    batch: int
    seq_len: int
    slo_s: float
    status: str
    n_min: int | None
    n_max: int | None
    best_interval: int | None
    best_latency_s: float | None
    note: str = ""

    @property
    def meets(self) -> bool:
        return self.status == "meets"


@dataclass
class PerformanceRecord:
    """Rows (``RECORD_COLUMNS``) plus metadata; see the module docstring for the schema."""

    df: pd.DataFrame
    meta: dict = field(default_factory=dict)

    # ---- grid ---------------------------------------------------------------------------------------------
    @property
    def batches(self) -> list[int]:
        return sorted(self.meta.get("batches") or self.df["batch"].unique().tolist())

    @property
    def seq_lens(self) -> list[int]:
        return sorted(self.meta.get("seq_lens") or self.df["seq_len"].unique().tolist())

    def slo_s(self, phase: str) -> float:
        return float(self.meta["ttft_slo_s" if phase == "prefill" else "tpot_slo_s"])

    def grid_point(self, phase: str, batch: int, seq_len: int) -> tuple[int, int]:
        """The grid point that covers (batch, seq_len): the next power of two up in each (conservative)."""
        if phase not in PHASES:
            raise OffsimError(f"phase must be one of {PHASES}, got {phase!r}")
        if batch < 1 or seq_len < 1:
            raise OffsimError(f"batch and seq_len must be positive, got batch {batch}, seq_len {seq_len}")
        bs = [b for b in self.batches if b >= batch]
        ss = [s for s in self.seq_lens if s >= seq_len]
        if not bs or not ss:
            raise OffsimError(
                f"the Select-N record of {self.meta.get('model')} on {self.meta.get('hardware')} does not cover "
                f"{phase} batch {batch}, seq_len {seq_len}: it spans batches {self.batches[0]}..{self.batches[-1]} and "
                f"seq_lens {self.seq_lens[0]}..{self.seq_lens[-1]}; rebuild it with a larger grid")
        return bs[0], ss[0]

    def rows(self, phase: str, batch: int, seq_len: int) -> pd.DataFrame:
        d = self.df
        return d[(d["phase"] == phase) & (d["batch"] == batch) & (d["seq_len"] == seq_len)]

    # ---- derivation -------------------------------------------------------------------------------------------
    def point(self, phase: str, batch: int, seq_len: int, slo_s: float | None = None) -> PointSummary:
        """[N_min, N_max] at the grid point covering (batch, seq_len), for ``slo_s`` (default: the record's)."""
        b, s = self.grid_point(phase, batch, seq_len)
        slo = self.slo_s(phase) if slo_s is None else float(slo_s)
        r = self.rows(phase, b, s)
        if r.empty:
            return self._terminated(phase, b, s, slo, batch, seq_len)
        ok = r[r["status"] == "ok"].sort_values("interval", ascending=False)
        if ok.empty:
            return PointSummary(phase, b, s, slo, "oom", None, None, None, None,
                                f"no interval fits GPU memory at {phase} batch {b}, seq_len {s}")
        n_max = int(ok["interval"].iloc[0])
        best = ok.loc[ok["latency_s"].idxmin()]
        best_n, best_lat = int(best["interval"]), float(best["latency_s"])
        if float(ok["latency_s"].iloc[0]) > slo:
            return PointSummary(phase, b, s, slo, "slo_unreachable", None, n_max, best_n, best_lat,
                                f"no interval meets the {phase} SLO {slo * 1e3:.1f} ms at batch {b}, seq_len {s}: "
                                f"best achievable {best_lat * 1e3:.1f} ms at N={best_n}")
        n_min = n_max
        for n, lat in zip(ok["interval"].iloc[1:], ok["latency_s"].iloc[1:]):
            if lat > slo:
                break
            n_min = int(n)
        else:
            if n_min > 1:  # every measured interval meets: those below n_min were never measured
                raise OffsimError(
                    f"the Select-N record does not cover {phase} batch {b}, seq_len {s} at interval {n_min - 1}: it "
                    f"was built for a {phase} SLO of {self.slo_s(phase) * 1e3:.1f} ms and stopped scanning there; "
                    f"rebuild it with an SLO of at least {slo * 1e3:.1f} ms")
        return PointSummary(phase, b, s, slo, "meets", n_min, n_max, best_n, best_lat)

    def _terminated(self, phase, b, s, slo, batch, seq_len) -> PointSummary:
        """A point with no rows: below it at the same seq_len the build terminated early (or it was never built)."""
        d = self.df
        below = d[(d["phase"] == phase) & (d["seq_len"] == s) & (d["batch"] < b)]
        for bb in sorted(below["batch"].unique(), reverse=True):
            p = self.point(phase, int(bb), s, slo)
            if p.status in ("oom", "slo_unreachable"):
                return PointSummary(phase, b, s, slo, p.status, None, None, p.best_interval, p.best_latency_s,
                                    f"not measured: the build terminated early at batch {bb} ({p.note}), and a "
                                    f"larger batch is no faster and needs more memory")
            break
        raise OffsimError(f"the Select-N record of {self.meta.get('model')} on {self.meta.get('hardware')} has no "
                          f"measurement at {phase} batch {b}, seq_len {s} (the point covering batch {batch}, seq_len "
                          f"{seq_len}); rebuild it over that point")

    def latency(self, phase: str, batch: int, seq_len: int, interval: int) -> float:
        """The recorded latency of interval N at the point covering (batch, seq_len)."""
        b, s = self.grid_point(phase, batch, seq_len)
        r = self.rows(phase, b, s)
        r = r[(r["interval"] == interval) & (r["status"] == "ok")]
        if r.empty:
            raise OffsimError(f"the Select-N record has no latency for {phase} batch {b}, seq_len {s}, interval "
                              f"{interval} (not measured, or it does not fit GPU memory)")
        return float(r["latency_s"].iloc[0])

    def ranges(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> pd.DataFrame:
        """[N_min, N_max] of every measured point, as a table."""
        out = []
        for (ph, b, s), _ in self.df.groupby(["phase", "batch", "seq_len"], sort=True):
            slo = slo_ttft_s if ph == "prefill" else slo_tpot_s
            try:
                p = self.point(ph, int(b), int(s), slo)
            except OffsimError as e:
                out.append({"phase": ph, "batch": b, "seq_len": s, "status": "not_covered", "note": str(e)})
                continue
            out.append({"phase": ph, "batch": b, "seq_len": s, "slo_s": p.slo_s, "status": p.status,
                        "n_min": p.n_min, "n_max": p.n_max, "best_interval": p.best_interval,
                        "best_latency_s": p.best_latency_s})
        df = pd.DataFrame(out)
        for c in ("n_min", "n_max", "best_interval"):
            if c in df:
                df[c] = df[c].astype("Int64")  # intervals are integers; missing ones stay empty
        return df

    # ---- files ------------------------------------------------------------------------------------------------
    def to_csv(self, path: str | Path) -> None:
        write_commented_csv(path, {"schema": RECORD_SCHEMA, **self.meta}, self.df[RECORD_COLUMNS])

    @classmethod
    def from_csv(cls, path: str | Path) -> "PerformanceRecord":
        meta, df = read_commented_csv(path, "Select-N record")
        if meta.pop("schema", None) != RECORD_SCHEMA:
            raise OffsimError(f"Select-N record {path}: schema is not {RECORD_SCHEMA!r}")
        missing = [c for c in RECORD_COLUMNS if c not in df.columns]
        if missing:
            raise OffsimError(f"Select-N record {path}: missing columns {missing}; expected {RECORD_COLUMNS}")
        for k in ("ttft_slo_s", "tpot_slo_s"):
            if k not in meta:
                raise OffsimError(f"Select-N record {path}: metadata lacks {k!r}")
        return cls(df=df[RECORD_COLUMNS], meta=meta)


def _check_slo(name: str, v: float) -> float:
    if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
        raise OffsimError(f"{name} must be a positive number of seconds, got {v!r}")
    return float(v)


def check_intervals(model: ModelSpec, intervals: Sequence[int] | None) -> list[int]:
    """The intervals a build scans, least offloading first: all (``intervals_of``), or the given subset -- which
    must hold 1 (every layer offloaded: N_min's lower end) and be within 1 .. num_layers + 1."""
    if intervals is None:
        return intervals_of(model)
    out = sorted({int(n) for n in intervals}, reverse=True)
    bad = [n for n in out if not 1 <= n <= model.num_layers + 1]
    if bad:
        raise OffsimError(f"intervals must be in 1..{model.num_layers + 1} for {model.name} ({model.num_layers} "
                          f"layers; {model.num_layers + 1} = nothing offloaded), got {bad}")
    if not out or out[-1] != 1:
        raise OffsimError("intervals must include 1 (every layer offloaded): the scan ends there")
    return out


def build_record(model: ModelSpec, hw: HardwareSpec, ttft_slo_s: float, tpot_slo_s: float,
                 batches: Sequence[int] = DEFAULT_BATCHES, seq_lens: Sequence[int] | None = None,
                 phases: Iterable[str] = PHASES, converge_tol: float = 0.02, link_share: float = 1.0,
                 progress: bool = False, intervals: Sequence[int] | None = None,
                 iteration=None, source: str = "offsim", deadline_s: float | None = None) -> PerformanceRecord:
    """Build the record by simulation (see the module docstring for the grid, early termination and convergence).

    ``link_share``: the share of the PCIe link this instance gets (``HardwareSpec.scaled_link``), for GPUs that
    share one link. ``converge_tol``: a point has converged when N = 1 is within this fraction of N_max's latency.
    ``intervals``: scan only these N (with 1; default: every N) -- fewer points where each costs device time.
    ``iteration(model, hw, phase, batch, seq_len, interval) -> IterationResult``: how one iteration is priced
    (default ``iteration_latency``, simulated; ``offexec.selectn.measured_iteration`` measures it on the device),
    ``source`` the rows' and metadata's label. ``deadline_s``: a ``time.monotonic()`` after which no new grid
    point is started (the points not reached are left out, as early termination leaves them; the metadata's
    ``stopped_at_deadline`` says so).
    """
    ttft_slo_s, tpot_slo_s = _check_slo("TTFT SLO", ttft_slo_s), _check_slo("TPOT SLO", tpot_slo_s)
    seq_lens = tuple(sorted(seq_lens or default_seq_lens(model)))
    batches = tuple(sorted(batches))
    for v in (*batches, *seq_lens):
        if v < 1 or v & (v - 1):
            raise OffsimError(f"record grid values must be powers of two, got {v}")
    if seq_lens[-1] > model.max_positions:
        raise OffsimError(f"seq_len {seq_lens[-1]} exceeds {model.name}'s {model.max_positions} positions")
    if not 0 < link_share <= 1:
        raise OffsimError(f"link_share must be in (0, 1], got {link_share}")
    phases = tuple(phases)
    for ph in phases:
        if ph not in PHASES:
            raise OffsimError(f"phase must be one of {PHASES}, got {ph!r}")
    if "decode" in phases and seq_lens[0] < 3:
        raise OffsimError(f"decode iterations are priced at contexts >= 3 tokens, got seq_len {seq_lens[0]}")
    cands = check_intervals(model, intervals)
    iteration = iteration or iteration_latency
    stopped = False
    phys = hw.scaled_link(link_share) if link_share != 1 else hw
    rows: list[dict] = []
    points = [(ph, s, b) for ph in phases for s in seq_lens for b in batches]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(points), desc=f"record {model.name}", unit="pt")
    for ph in phases:
        slo = ttft_slo_s if ph == "prefill" else tpot_slo_s
        threshold = math.inf  # smallest batch·seq_len seen converged
        for s in seq_lens:
            for i, b in enumerate(batches):
                if deadline_s is not None and time.monotonic() > deadline_s:
                    stopped = True
                    break
                res, converged = _scan_point(model, phys, ph, b, s, slo, b * s >= threshold, converge_tol,
                                             cands, iteration)
                fit_ns = [n for n, r in res.items() if r.fits]
                keep_oom = {max(fit_ns) + 1} if fit_ns else {1}  # the evidence for N_max (or that none fits)
                for n, r in res.items():
                    if not r.fits and n not in keep_oom:
                        continue
                    rows.append({"phase": ph, "batch": b, "seq_len": s, "interval": n,
                                 "offloaded_layers": r.offloaded_layers, "host_bytes": r.host_bytes,
                                 "gpu_peak_bytes": r.gpu_peak_bytes, "status": "ok" if r.fits else "oom",
                                 "latency_s": r.latency_s, "source": source})
                if bar:
                    bar.update(1)
                if converged:
                    threshold = min(threshold, b * s)
                fitting = [r.latency_s for r in res.values() if r.fits]
                if not fitting or min(fitting) > slo:  # early termination: larger batches are no better
                    if bar:
                        bar.update(len(batches) - i - 1)
                    break
    if bar:
        bar.close()
    df = pd.DataFrame(rows, columns=RECORD_COLUMNS)
    meta = {"model": model.name, "hardware": hw.name, "gpu_mem_bytes": int(hw.gpu_mem_bytes),
            "link_share": link_share, "num_layers": model.num_layers, "ttft_slo_s": ttft_slo_s,
            "tpot_slo_s": tpot_slo_s, "batches": list(batches), "seq_lens": list(seq_lens),
            "converge_tol": converge_tol, "source": source, "provenance": provenance()}
    if intervals is not None:
        meta["intervals"] = cands
    if stopped:
        meta["stopped_at_deadline"] = True
    return PerformanceRecord(df, meta)


def _scan_point(model, hw, phase, batch, seq_len, slo, probe_converged: bool, tol: float, cands=None,
                iteration=None) -> tuple[dict[int, IterationResult], bool]:
    """Intervals from the least offloading down (``cands``, default every N): 'oom' until one fits (N_max), then
    timed until the first that misses the SLO. Past the convergence threshold, probe N = 1 and N_max first."""
    res: dict[int, IterationResult] = {}
    cands = cands or intervals_of(model)
    iteration = iteration or iteration_latency

    def run(n):
        if n not in res:
            res[n] = iteration(model, hw, phase, batch, seq_len, n)
        return res[n]

    n_max = None
    for n in cands:
        if run(n).fits:
            n_max = n
            break
    if n_max is None:
        return res, False
    if probe_converged and n_max > 1:
        r1 = run(1)
        if r1.fits and r1.latency_s <= (1 + tol) * res[n_max].latency_s:
            return res, True
    if res[n_max].latency_s > slo:
        return res, False
    for n in cands[cands.index(n_max) + 1:]:
        r = run(n)
        if r.fits and r.latency_s > slo:  # (N = num_layers may not fit where N = num_layers + 1 does: 2 buffers)
            break
    converged = 1 in res and res[1].fits and res[1].latency_s <= (1 + tol) * res[n_max].latency_s
    return res, converged


# ----------------------------------------------------------------------------------------------------------------
# runtime choice
# ----------------------------------------------------------------------------------------------------------------
def switch_seconds(model: ModelSpec, hw: HardwareSpec, old: int, new: int) -> float:
    """Time to change the interval between iterations: the layers offloaded under ``old`` but resident under ``new``
    are copied to the GPU before the next iteration (pinned H2D, not overlapped: an upper bound); layers that become
    offloaded are dropped (the host keeps their pinned copy), which costs nothing."""
    grow = set(offloaded_layers(model.num_layers, old)) - set(offloaded_layers(model.num_layers, new))
    return costmodel.transfer_seconds(hw, len(grow) * model.layer_weight_bytes(), "h2d") if grow else 0.0


@dataclass(frozen=True)
class Choice:
    """The interval of one iteration. ``latency_s``: the record's latency at the covering grid point, plus
    ``switch_s`` when coming from another interval. ``meets_slo`` False: no interval can; ``interval`` is then the
    fastest."""

    phase: str
    batch: int
    seq_len: int
    interval: int
    latency_s: float
    switch_s: float
    host_bytes: int
    meets_slo: bool
    point: PointSummary


def choose_interval(record: PerformanceRecord, model: ModelSpec, phase: str, batch: int, seq_len: int,
                    slo_s: float | None = None, strict: bool = False, current: int | None = None,
                    hw: HardwareSpec | None = None) -> Choice:
    """N for one iteration at (batch, seq_len): N_min of the covering grid point -- the most host memory that meets
    the SLO. With ``current`` (the previous iteration's N; needs ``hw``), the smallest N in [N_min, N_max] whose
    latency plus ``switch_seconds(current, N)`` meets the SLO. When none can: the fastest interval with
    ``meets_slo`` False -- or, ``strict``, an OffsimError that says so and gives the best latency achievable."""
    p = record.point(phase, batch, seq_len, slo_s)
    if p.status == "oom":
        raise OffsimError(f"Select-N cannot run {model.name} {phase} batch {batch}, seq_len {seq_len}: {p.note}")
    if current is not None and hw is None:
        raise OffsimError("choose_interval: pricing a change of interval needs the hardware (hw=...)")
    r = record.rows(phase, p.batch, p.seq_len)
    ok = r[r["status"] == "ok"].sort_values("interval")
    if ok.empty:  # a point the build skipped after terminating early: nothing measured to fall back on
        raise OffsimError(f"Select-N cannot meet the {phase} SLO at batch {batch}, seq_len {seq_len}: {p.note}")
    sw = {int(n): (switch_seconds(model, hw, current, int(n)) if current is not None else 0.0)
          for n in ok["interval"]}
    cost = {int(n): float(lat) + sw[int(n)] for n, lat in zip(ok["interval"], ok["latency_s"])}
    if p.status == "meets":
        for n in range(p.n_min, p.n_max + 1):
            if n in cost and cost[n] <= p.slo_s:
                return Choice(phase, batch, seq_len, n, cost[n], sw[n], host_weight_bytes(model, n), True, p)
        why = (f"no interval in [{p.n_min}, {p.n_max}] meets the {phase} SLO {p.slo_s * 1e3:.1f} ms at batch "
               f"{p.batch}, seq_len {p.seq_len} once the switch from N={current} is paid")
    else:
        why = p.note
    n = min(cost, key=lambda k: (cost[k], -k))
    if strict:
        raise OffsimError(f"Select-N: {why}; best achievable {cost[n] * 1e3:.1f} ms at N={n}")
    return Choice(phase, batch, seq_len, n, cost[n], sw[n], host_weight_bytes(model, n), False, p)


def request_intervals(record: PerformanceRecord, model: ModelSpec, hw: HardwareSpec, wl: Workload) -> list[Choice]:
    """The interval of every iteration of a batch of requests: the prefill at (batch, prompt_len), then decode step
    i at context prompt_len + i.

    The decode steps bind (there are gen_len − 1 of them): when one interval meets the TPOT SLO at every step, all
    use the largest of their N_min (no switches); otherwise each step chooses in turn, paying switches. The prefill
    then offloads as much as its TTFT SLO allows, provided the reload before the first decode step
    (``switch_seconds``) still fits in that step's slack; prefill and decode so use different N when it pays."""
    b = wl.num_prompts
    ctxs = [wl.prompt_len + i for i in range(1, wl.gen_len)]
    dec: list[Choice] = []
    if ctxs:
        pts = [record.point("decode", b, c) for c in ctxs]
        if all(p.meets for p in pts) and max(p.n_min for p in pts) <= min(p.n_max for p in pts):
            n_d = max(p.n_min for p in pts)
            dec = [Choice("decode", b, c, n_d, record.latency("decode", b, c, n_d), 0.0,
                          host_weight_bytes(model, n_d), True, p) for c, p in zip(ctxs, pts)]
        else:
            cur = None
            for c in ctxs:
                ch = choose_interval(record, model, "decode", b, c, current=cur, hw=hw)
                dec.append(ch)
                cur = ch.interval
    pre = record.point("prefill", b, wl.prompt_len)
    if pre.status == "meets" and dec:
        d0 = dec[0]
        base = d0.latency_s - d0.switch_s
        slack = max(record.slo_s("decode") - base, 0.0)
        r = record.rows("prefill", pre.batch, pre.seq_len)
        r = r[(r["status"] == "ok") & (r["interval"] >= pre.n_min) & (r["interval"] <= pre.n_max)]
        cands = sorted((int(n), float(lat)) for n, lat in zip(r["interval"], r["latency_s"]) if lat <= pre.slo_s)
        sw = {n: switch_seconds(model, hw, n, d0.interval) for n, _ in cands}
        ok = [(n, lat) for n, lat in cands if sw[n] <= slack]
        n, lat = ok[0] if ok else min(cands, key=lambda c: (sw[c[0]], c[0]))
        first = Choice("prefill", b, wl.prompt_len, n, lat, 0.0, host_weight_bytes(model, n), True, pre)
    else:
        first = choose_interval(record, model, "prefill", b, wl.prompt_len)
    if dec:
        d0 = dec[0]
        sw = switch_seconds(model, hw, first.interval, d0.interval)
        lat = d0.latency_s - d0.switch_s + sw
        dec[0] = Choice(d0.phase, d0.batch, d0.seq_len, d0.interval, lat, sw, d0.host_bytes,
                        lat <= record.slo_s("decode"), d0.point)
    return [first] + dec


def simulate_phased(model: ModelSpec, hw: HardwareSpec, wl: Workload, intervals: Sequence[int]) -> dict:
    """Simulate a batch of requests whose iterations use their own intervals (``intervals[0]`` for the prefill,
    ``intervals[i]`` for decode step i): the prefill is the plan ``Workload(prompt_len, 1)`` at its N (its makespan
    is the TTFT); each run of decode steps with one N takes its step latencies from the block plan at that N; a
    change of N costs ``switch_seconds``, added to the step after it. Returns TTFT, per-step TPOTs, throughputs
    (FlexGen's definitions) and the GPU peak."""
    if len(intervals) != wl.gen_len:
        raise OffsimError(f"need one interval per iteration ({wl.gen_len}), got {len(intervals)}")
    if wl.num_gpu_batches != 1:
        raise OffsimError("Select-N runs one batch per iteration: use num_gpu_batches 1")
    pre = simulate(build_plan("selectn", model, hw, Workload(wl.prompt_len, 1, wl.gpu_batch_size, 1),
                              {"interval": int(intervals[0])}), hw)
    ttft = pre.makespan_s
    peak = pre.peak_bytes["gpu"]
    steps: dict[int, float] = {}
    for n in sorted(set(intervals[1:])):
        tr = simulate(build_plan("selectn", model, hw, wl, {"interval": int(n)}), hw)
        peak = max(peak, tr.peak_bytes["gpu"])
        sl = tr.step_latency().set_index("step")["latency_s"]
        for i in range(1, wl.gen_len):
            if intervals[i] == n:
                steps[i] = float(sl.loc[i])
    tpots = [steps[i] + switch_seconds(model, hw, intervals[i - 1], intervals[i]) for i in range(1, wl.gen_len)]
    decode_s = sum(tpots)
    total = ttft + decode_s
    prompts = wl.num_prompts
    return {"ttft_s": ttft, "tpot_s": tpots, "prefill_s": ttft, "decode_s": decode_s, "total_s": total,
            "switch_s": sum(switch_seconds(model, hw, a, b) for a, b in zip(intervals, intervals[1:])),
            "prefill_tok_s": prompts * wl.prompt_len / ttft,
            "decode_tok_s": prompts * (wl.gen_len - 1) / decode_s if decode_s > 0 else math.inf,
            "total_tok_s": prompts * wl.gen_len / total, "peak_gpu_bytes": int(peak),
            "host_bytes_max": max(host_weight_bytes(model, n) for n in intervals)}


def fastest_interval(model: ModelSpec, hw: HardwareSpec, wl: Workload) -> int:
    """N_max of a whole workload: the least offloading whose plan fits GPU memory under simulation -- normally the
    fastest interval (latency is not strictly monotone in N: where the offloaded layers sit matters a little).
    The fallback when the record has no answer. OffsimError if even N = 1 does not fit."""
    for n in intervals_of(model):
        try:
            simulate(build_plan("selectn", model, hw, wl, {"interval": n}), hw)
            return n
        except OffsimError as e:
            if not _is_memory_error(e):
                raise
    raise OffsimError(f"Select-N cannot fit {model.name} with batch {wl.num_prompts}, prompt {wl.prompt_len}, gen "
                      f"{wl.gen_len} in {hw.gpu_mem_bytes} bytes of GPU memory even with every layer offloaded")
