"""``offexec selectn-record``: Select-N's offline performance record measured on the device, as the paper builds it,
instead of simulated (``offsim.policies.selectn.record``; docs/cost-model.md §9).

The record's schema, grid, early termination and convergence are the simulated build's own (``build_record``);
only the price of one iteration differs: ``MeasuredIterations`` runs the plan that prices it
(``record.iteration_workload``: a prefill iteration is the plan of ``Workload(s, 1, b)``, its makespan the TTFT; a
decode iteration at context s is step 2 of ``Workload(s - 2, 3, b)``) with ``run_plan`` and reads the same numbers
from the measured trace. A plan that does not fit -- offsim's arithmetic, the executor's budget check, or the
device's allocator -- is an 'oom' row, as in the simulated record. The rows say ``source`` 'offexec'; the file
loads wherever a simulated record does (``PerformanceRecord.from_csv``; ``experiments/selectn/slo.py
--measured-record``).

Device time is scarce, so the grid is small by default (batches 1, 4, 16; seq_len 512) and only a geometric subset
of the intervals is scanned (num_layers + 1, then halving down to 1: ``default_intervals``); ``--time-limit-s``
stops starting new grid points (the rest are left out, as early termination leaves them). Beside each measured
latency the simulated one of the same iteration is computed (cheap) and summarised in the metadata
(``sim_vs_measured``).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time

import numpy as np

from offsim.core.errors import OffsimError
from offsim.core.provenance import provenance
from offsim.core.specs import HARDWARE_PRESETS, get_hardware, get_model
from offsim.policies import build_plan
from offsim.policies.selectn.policy import SelectNSettings, host_weight_bytes, offloaded_layers
from offsim.policies.selectn.record import (DECODE_STEP, PHASES, IterationResult, _is_memory_error, build_record,
                                            iteration_latency, iteration_workload)

from . import ALLOCATOR_CAPS, DEFAULT_ALLOCATOR_CAP

GiB = 1 << 30
DEFAULT_BATCHES = (1, 4, 16)
DEFAULT_SEQ_LENS = (512,)


def default_intervals(num_layers: int) -> list[int]:
    """num_layers + 1 (nothing offloaded), then num_layers // 2, // 4, ... down to 1: a handful of points."""
    out, n = [num_layers + 1], num_layers // 2
    while n > 1:
        out.append(n)
        n //= 2
    out.append(1)
    return sorted(set(out), reverse=True)


class MeasuredIterations:
    """``iteration(model, hw, phase, batch, seq_len, interval) -> IterationResult`` measured with ``run_plan`` (the
    weights made once; the first fitting iteration of each shape -- phase, batch, sequence length -- runs once
    unmeasured first, unless ``warmup`` is False; ``repeats`` runs, the median kept). Per shape, not per phase: the
    first measured interval at each new batch size ran 9-42 % slower than the later ones of the same batch on the
    H200 (2026-12-01, ``results/selectn/measured_record_llama-2-13b_h200_24gib.csv``: offsim within 1 % of the others),
    the cost of kernels and allocations met for the first time at that shape."""

    def __init__(self, weights, device: str = "cuda", budget_bytes: int | None = None, seed: int = 0,
                 repeats: int = 1, warmup: bool = True, allocator_cap: str = DEFAULT_ALLOCATOR_CAP, cuda_graphs: bool = True,
                 disk_dir: str | None = None):
        self.weights, self.device, self.budget, self.seed = weights, device, budget_bytes, seed
        self.repeats, self.warmup, self.allocator_cap = repeats, warmup, allocator_cap
        self.cuda_graphs, self.disk_dir = cuda_graphs, disk_dir
        self.warmed: set[tuple] = set()  # (phase, batch, seq_len) shapes that have run once unmeasured
        self.log: list[dict] = []  # one entry per measured iteration: what the simulation says beside it

    def _oom(self, model, interval, why: str) -> IterationResult:
        return IterationResult(None, None, host_weight_bytes(model, interval),
                               len(offloaded_layers(model.num_layers, interval)))

    def __call__(self, model, hw, phase, batch, seq_len, interval) -> IterationResult:
        import torch

        from .executor import check_plan, run_plan
        from .memory import ExecError

        wl = iteration_workload(phase, batch, seq_len)
        budget = self.budget if self.budget is not None else int(hw.gpu_mem_bytes)
        try:
            plan = build_plan("selectn", model, hw, wl, SelectNSettings(interval=interval), validate=False)
            plan.validate()
        except OffsimError as e:
            if _is_memory_error(e):
                return self._oom(model, interval, str(e))
            raise
        if not self.cuda_graphs:
            plan.cuda_graphs = False
        try:
            check_plan(plan, self.device, budget, self.disk_dir, weights_loaded=True)
        except ExecError as e:
            return self._oom(model, interval, str(e))
        lats, peak = [], 0
        shape = (phase, batch, seq_len)
        runs = self.repeats + (1 if self.warmup and shape not in self.warmed else 0)
        try:
            for k in range(runs):
                res = run_plan(plan, self.weights, self.device, seed=self.seed, gpu_budget_bytes=budget,
                               disk_dir=self.disk_dir, allocator_cap=self.allocator_cap)
                if k == 0 and runs > self.repeats:
                    self.warmed.add(shape)
                    continue
                tr = res.trace
                if phase == "prefill":
                    lats.append(tr.makespan_s)
                else:
                    sl = tr.step_latency()
                    lats.append(float(sl.loc[sl["step"] == DECODE_STEP, "latency_s"].iloc[0]))
                peak = max(peak, int(tr.peak_bytes.get("gpu", 0)))
                res = None
        except (torch.cuda.OutOfMemoryError, ExecError) as e:  # the device's allocator, or the executor's cap
            return self._oom(model, interval, f"does not fit on the device: {e}")
        finally:
            gc.collect()
            if torch.device(self.device).type == "cuda":
                torch.cuda.empty_cache()
        lat = float(statistics.median(lats))
        sim = iteration_latency(model, hw, phase, batch, seq_len, interval)
        self.log.append({"phase": phase, "batch": batch, "seq_len": seq_len, "interval": interval,
                         "measured_s": lat, "simulated_s": sim.latency_s})
        return IterationResult(lat, peak, host_weight_bytes(model, interval),
                               len(offloaded_layers(model.num_layers, interval)))


def sim_vs_measured(log: list[dict]) -> dict:
    """Per phase: how far the simulation of the same iterations is from the measurement (predicted / measured - 1)."""
    out = {}
    for ph in PHASES:
        e = [r["simulated_s"] / r["measured_s"] - 1 for r in log
             if r["phase"] == ph and r["simulated_s"] and r["measured_s"] > 0]
        if e:
            out[ph] = {"points": len(e), "median_error": float(np.median(e)),
                       "max_abs_error": float(max(abs(x) for x in e))}
    return out


def measure_record(model, hw, weights, ttft_slo_s: float, tpot_slo_s: float, batches=DEFAULT_BATCHES,
                   seq_lens=DEFAULT_SEQ_LENS, phases=PHASES, intervals=None, device: str = "cuda", seed: int = 0,
                   repeats: int = 1, warmup: bool = True, time_limit_s: float | None = None, progress: bool = False,
                   converge_tol: float = 0.02, allocator_cap: str = DEFAULT_ALLOCATOR_CAP, cuda_graphs: bool = True,
                   disk_dir: str | None = None, meta: dict | None = None):
    """Select-N's record with every iteration measured on ``device`` (``build_record`` with ``MeasuredIterations``).
    ``intervals`` None: ``default_intervals``. Returns the ``PerformanceRecord`` (source 'offexec')."""
    it = MeasuredIterations(weights, device, int(hw.gpu_mem_bytes), seed, repeats, warmup, allocator_cap,
                            cuda_graphs, disk_dir)
    ivs = list(intervals) if intervals else default_intervals(model.num_layers)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None
    t0 = time.perf_counter()
    rec = build_record(model, hw, ttft_slo_s, tpot_slo_s, batches=batches, seq_lens=seq_lens, phases=phases,
                       converge_tol=converge_tol, progress=progress, intervals=ivs, iteration=it,
                       source="offexec", deadline_s=deadline)
    rec.meta.update({"measured_iterations": len(it.log), "repeats": repeats, "warmup": warmup,
                     "build_s": round(time.perf_counter() - t0, 2), "sim_vs_measured": sim_vs_measured(it.log),
                     **(meta or {})})
    return rec


# ----------------------------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------------------------
def add_record_parser(sub) -> None:
    r = sub.add_parser(
        "selectn-record", help="measure Select-N's offline performance record on the device",
        description="Fill Select-N's offline performance record (offsim.policies.selectn.record's schema: per "
                    "phase, batch, seq_len and offloading interval N the iteration latency, GPU peak and host "
                    "bytes) by running each iteration's plan with offexec instead of simulating it; the same "
                    "grid, early termination and convergence as the simulated build, over a small grid and a "
                    "geometric subset of N by default. The CSV loads wherever a simulated record does "
                    "(experiments/selectn/slo.py --measured-record). Exit 2 with one line for bad input.")
    r.add_argument("--model", required=True, help="model preset or a transformers config.json path")
    r.add_argument("--hardware", default="h200",
                   help="hardware preset or profile JSON: the plans' budget and link, and the simulated latency "
                        "beside each measurement (default: %(default)s)")
    r.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory budget in GiB (default: the "
                                                                   "hardware's)")
    r.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="TTFT SLO the scan stops at (default: "
                                                                     "%(default)s)")
    r.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT SLO the scan stops at (default: "
                                                                    "%(default)s)")
    r.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), metavar="B",
                   help="batch sizes, powers of two (default: %(default)s)")
    r.add_argument("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS), metavar="S",
                   help="sequence lengths, powers of two (default: %(default)s); a decode point at S covers "
                        "contexts up to S")
    r.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="(default: both)")
    r.add_argument("--intervals", type=int, nargs="+", default=None, metavar="N",
                   help="intervals to scan, including 1 (default: num_layers + 1, then halving down to 1)")
    r.add_argument("--repeats", type=int, default=1, help="runs per iteration, the median kept (default: 1)")
    r.add_argument("--time-limit-s", type=float, default=None,
                   help="start no new grid point after this many seconds (the rest are left out of the record)")
    r.add_argument("--out", required=True, metavar="FILE", help="the record CSV to write")
    r.add_argument("--device", default="cuda", help="'cuda' (default) or 'cpu' (sequential, for tests)")
    r.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                   help="weights and activations dtype (default: float16)")
    r.add_argument("--checkpoint", default=None, metavar="DIR", help="local transformers checkpoint of the model")
    r.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts (default: %(default)s)")
    r.add_argument("--no-warmup", action="store_true",
                   help="no unmeasured first run per iteration shape (phase, batch, sequence length)")
    r.add_argument("--allocator-cap", default=DEFAULT_ALLOCATOR_CAP, choices=ALLOCATOR_CAPS,
                   help="as `offexec run --allocator-cap` (default: %(default)s)")
    r.add_argument("--no-cuda-graphs", action="store_true", help="as `offexec run --no-cuda-graphs`")
    r.add_argument("--disk-dir", default=None, metavar="DIR", help="where a disk tier's files go (none expected)")
    r.add_argument("--progress", action="store_true", help="show a progress bar over grid points")
    r.set_defaults(func=cmd_record)


def _check_some_point_fits(model, hw, phases, batch: int, seq_len: int, intervals) -> None:
    """Refuse, from offsim's arithmetic and before any weights are made, a grid none of whose points fits: if the
    smallest shape (``batch``, ``seq_len``) fits at no interval in any phase, every row would be 'oom' (such a
    record was written and the command exited 0)."""
    why = None
    for phase in phases:
        for iv in intervals:
            try:
                build_plan("selectn", model, hw, iteration_workload(phase, batch, seq_len), SelectNSettings(interval=iv))
                return
            except OffsimError as e:
                if not _is_memory_error(e):
                    raise
                why = why or str(e)
    raise OffsimError(f"no point of the grid fits {hw.name} at {hw.gpu_mem_bytes / GiB:.2f} GiB: its smallest "
                      f"(batch {batch}, seq_len {seq_len}) is refused at every interval ({why}); raise --gpu-mem-gb")


def cmd_record(args) -> dict:
    import torch

    from offsim.cli import _print_json, check_output_path

    check_output_path(args.out, "--out")
    if args.device not in ("cuda", "cpu"):
        raise OffsimError(f"--device must be 'cuda' or 'cpu', got {args.device!r}")
    from .memory import require_device

    require_device(args.device)
    if args.repeats < 1:
        raise OffsimError(f"--repeats must be at least 1, got {args.repeats}")
    if args.time_limit_s is not None and not args.time_limit_s > 0:
        raise OffsimError(f"--time-limit-s must be positive, got {args.time_limit_s}")
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        v = getattr(args, name)
        if not (v > 0 and math.isfinite(v)):
            raise OffsimError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    model = get_model(args.model)
    dtype_name = args.dtype or "float16"
    if dtype_name == "float32":
        model = dataclasses.replace(model, dtype_bytes=4)
    from offsim.policies.selectn.record import check_intervals

    ivs = check_intervals(model, args.intervals or default_intervals(model.num_layers))
    for v in (*args.batches, *args.seq_lens):
        if v < 1 or v & (v - 1):
            raise OffsimError(f"--batches and --seq-lens take powers of two, got {v}")
    if max(args.seq_lens) > model.max_positions:
        raise OffsimError(f"seq_len {max(args.seq_lens)} exceeds {model.name}'s {model.max_positions} positions")
    _check_some_point_fits(model, hw, args.phases, min(args.batches), min(args.seq_lens), ivs)
    from .weights import load_checkpoint, random_weights

    dt = getattr(torch, dtype_name)
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    weights = (load_checkpoint(args.checkpoint, model, dt, pinned=cuda, progress=args.progress) if args.checkpoint
               else random_weights(model, args.seed, dt, device=args.device, pinned=cuda, progress=args.progress))
    weights_s = time.perf_counter() - t0
    prov = provenance(device=args.device, gpu=torch.cuda.get_device_name(args.device) if cuda else "")
    print(f"selectn-record {model.name} {dtype_name} on {prov['gpu'] or args.device} (plans: {hw.name}, "
          f"{hw.gpu_mem_bytes / GiB:.1f} GiB); batches {args.batches}, seq_lens {args.seq_lens}, phases "
          f"{args.phases}, intervals {ivs}; weights ready in {weights_s:.1f} s", flush=True)
    try:
        rec = measure_record(model, hw, weights, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3,
                             batches=tuple(args.batches), seq_lens=tuple(args.seq_lens), phases=tuple(args.phases),
                             intervals=ivs, device=args.device, seed=args.seed, repeats=args.repeats,
                             warmup=not args.no_warmup, time_limit_s=args.time_limit_s, progress=args.progress,
                             allocator_cap=args.allocator_cap, cuda_graphs=not args.no_cuda_graphs,
                             disk_dir=args.disk_dir,
                             meta={"device": args.device, "dtype": dtype_name, "weights_s": round(weights_s, 2),
                                   "provenance": prov})
    finally:
        weights.close()
    rec.to_csv(args.out)
    ok = rec.df[rec.df["status"] == "ok"]
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(rec.ranges().to_string(index=False))
    svm = rec.meta["sim_vs_measured"]
    # (a CPU run against a GPU preset: offsim predicts the GPU, so an error would say nothing; offexec run's rule)
    comparable = cuda or str(args.hardware).lower() not in HARDWARE_PRESETS
    for ph, d in svm.items():
        print(f"{ph}: offsim vs measured over {d['points']} iterations: median {d['median_error']:+.1%}, worst "
              f"{d['max_abs_error']:.1%}" if comparable else
              f"{ph}: no comparison with offsim: this ran on the CPU and --hardware {args.hardware} is a GPU preset")
    if rec.meta.get("stopped_at_deadline"):
        print(f"stopped at --time-limit-s {args.time_limit_s:g}: the grid points not reached are not in the record")
    print(f"wrote {args.out}: {len(rec.df)} rows ({len(ok)} measured, {len(rec.df) - len(ok)} oom) in "
          f"{rec.meta['build_s']:.1f} s")
    out = {"record": str(args.out), "model": model.name, "hardware": hw.name, "gpu_mem_bytes": int(hw.gpu_mem_bytes),
           "rows": len(rec.df), "measured": len(ok), "build_s": rec.meta["build_s"], "intervals": ivs,
           "sim_vs_measured": svm if comparable else None, "comparable": comparable,
           "stopped_at_deadline": bool(rec.meta.get("stopped_at_deadline")), "provenance": prov}
    _print_json(out)
    return out
