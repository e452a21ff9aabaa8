"""What the notebooks compute and draw, kept in the package so that each notebook is a parameters cell, calls into
this module and text (STYLE.md: anything a notebook does twice moves into the package).

Four groups:

- **sweeps**: ``policy_at_batch`` gives a policy's settings for a *fixed* block of ``batch`` sequences (FlexGen and
  TightLLM from FlexGen's LP over the block shapes whose product is ``batch``; the static policies and Select-N from
  their few discrete knobs, the fastest that fits) and simulates it; ``throughput_sweep`` does that over a grid of
  prompt lengths and batches and returns a DataFrame; ``plot_sweep`` draws it. (``offsim.optimize.search`` is the
  other question -- each policy's best batch -- and is what ``offsim compare`` answers.)
- **decisions**: ``lp_placements`` (FlexGen's LP per block shape), ``tightllm_nr_vs_context`` and
  ``tightllm_balance`` (TightLLM's KV distributor: the N_r it picks, and the compute/transfer curves it balances);
- **timelines**: ``gantt`` draws the streams of a Trace for one generation step, with the GPU's idle gaps shaded;
  ``gantt_overlay`` sets a measured and a predicted trace of the same plan one above the other;
- **results**: ``read_results_csv`` (provenance line + table), ``load_offexec_runs``, ``find_traces`` and
  ``validation_long`` (what offexec and the validation commit), ``resimulate``, ``op_kind_errors``, ``error_table``,
  ``plot_pred_vs_measured``, ``plot_published_vs_simulated``.

matplotlib only, and nothing here selects a backend: it draws on the Axes it is given (or a new figure), so it runs
under Agg in CI and inline in Jupyter.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from .errors import OffsimError
from .plan import STREAMS
from .policies import POLICIES, build_plan
from .sim import simulate
from .specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from .trace import TRACE_SCHEMA, Trace

GiB = 1 << 30
KIND_COLORS = {"compute": "#1f77b4", "cpu_compute": "#9467bd", "h2d": "#2ca02c", "d2h": "#ff7f0e",
               "disk_read": "#8c564b", "disk_write": "#e377c2"}
POLICY_COLORS = {"static-accelerate": "#7f7f7f", "static-zero": "#bcbd22", "flexgen": "#1f77b4",
                 "tightllm": "#d62728", "selectn": "#2ca02c"}
NUM_GPU_BATCHES = (1, 2, 4, 8, 16)  # block shapes tried for FlexGen/TightLLM at a fixed batch


def _ax(ax, figsize=(7, 4)):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize)
    return ax


# ----------------------------------------------------------------------------------------------------------------
# a policy at a fixed batch, and sweeps
# ----------------------------------------------------------------------------------------------------------------
def _candidates_at_batch(policy: str, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                         batch: int) -> Iterable[tuple[dict, Workload]]:
    """(settings, workload) to try for ``policy`` with ``batch`` sequences in flight, best first (by the policy's
    own rule, not by simulation: the first that fits memory is the one used)."""
    one = Workload(prompt_len, gen_len, batch, 1)
    offload = "cpu" if model.weight_bytes() <= 0.95 * hw.cpu_mem_bytes else "disk"
    if policy == "static-accelerate":
        yield {"offload": offload}, one
    elif policy == "static-zero":
        yield {"offload": offload, "kv_on_cpu": False}, one  # KV on the GPU when it fits (no KV traffic)
        yield {"offload": offload, "kv_on_cpu": True}, one
    elif policy in ("flexgen", "tightllm"):
        from .optimize import flexgen_lp

        lps = []
        for nb in NUM_GPU_BATCHES:
            if batch % nb:
                continue
            for ca in ((False, True) if policy == "flexgen" else (False,)):  # TightLLM attends on the GPU
                r = flexgen_lp(model, hw, prompt_len, gen_len, batch // nb, nb, ca)
                if r is not None:
                    lps.append(r)
        for r in sorted(lps, key=lambda r: r.seconds_per_token)[:4]:
            st = {"percent": r.percent}
            if policy == "flexgen":
                st["cpu_attention"] = r.cpu_attention
            yield st, Workload(prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches)
    elif policy == "selectn":
        # the fastest interval is the largest N (fewest layers offloaded) that fits: binary search on feasibility,
        # which is monotone (a larger N keeps more layers on the GPU)
        lo, hi = 1, model.num_layers + 1
        if _fits(policy, model, hw, one, {"interval": hi}):
            lo = hi
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _fits(policy, model, hw, one, {"interval": mid}) else (lo, mid)
        for n in range(lo, 0, -1):
            yield {"interval": n}, one
    else:  # a policy this module does not know: its defaults, one GPU batch
        yield {}, one


def _fits(policy, model, hw, wl, settings) -> bool:
    try:
        build_plan(policy, model, hw, wl, settings)
        return True
    except OffsimError:
        return False


def policy_at_batch(policy: str, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, batch: int,
                    max_tries: int = 4) -> tuple[dict, Workload, Trace]:
    """Settings, workload and simulated trace of ``policy`` with ``batch`` sequences per block; raises OffsimError
    with the last reason when nothing fits."""
    if policy not in POLICIES:
        raise OffsimError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    why = "no candidate"
    for t, (st, wl) in enumerate(_candidates_at_batch(policy, model, hw, prompt_len, gen_len, batch)):
        if t >= max_tries:
            break
        try:
            return st, wl, simulate(build_plan(policy, model, hw, wl, st), hw)
        except OffsimError as e:
            why = str(e)
    raise OffsimError(f"{policy} does not fit {batch} sequences of {model.name} on {hw.name}: {why}")


def throughput_sweep(model: ModelSpec, hw: HardwareSpec, policies: Sequence[str] | None = None,
                     prompt_lens: Sequence[int] = (512,), batches: Sequence[int] = (8,), gen_len: int = 8,
                     progress: bool = False) -> pd.DataFrame:
    """One row per (policy, prompt_len, batch): settings, block shape and the simulated metrics (FlexGen's
    throughput definitions); ``error`` says why a cell has no numbers (usually: does not fit memory)."""
    policies = list(POLICIES) if policies is None else list(policies)
    grid = [(p, s, b) for p in policies for s in prompt_lens for b in batches]
    if progress:
        from tqdm.auto import tqdm

        grid = tqdm(grid, desc="sweep", unit="plan")
    rows = []
    for pol, s, b in grid:
        row = {"policy": pol, "prompt_len": s, "gen_len": gen_len, "batch": b}
        try:
            st, wl, tr = policy_at_batch(pol, model, hw, s, gen_len, b)
        except OffsimError as e:
            rows.append({**row, "error": str(e)})
            continue
        m = tr.metrics()
        rows.append({**row, "gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches,
                     "settings": json.dumps(st), **{k: m[k] for k in (
                         "prefill_tok_s", "decode_tok_s", "total_tok_s", "gpu_idle_frac", "peak_gpu_bytes",
                         "peak_cpu_bytes")}, "error": ""})
    cols = ["policy", "prompt_len", "gen_len", "batch", "gpu_batch_size", "num_gpu_batches", "settings",
            "prefill_tok_s", "decode_tok_s", "total_tok_s", "gpu_idle_frac", "peak_gpu_bytes", "peak_cpu_bytes",
            "error"]
    return pd.DataFrame(rows).reindex(columns=cols)  # the same columns even when no cell fits


def plot_sweep(df: pd.DataFrame, x: str = "prompt_len", y: str = "total_tok_s", ax=None, logx: bool = True,
               logy: bool = True, title: str | None = None):
    """Throughput ``y`` against ``x`` ('prompt_len' or 'batch'), one line per policy; cells that do not fit are
    left out (a line that stops is a policy running out of memory)."""
    ax = _ax(ax)
    ok = df[df[y].notna()] if y in df else df.iloc[:0]
    for pol, g in ok.groupby("policy", sort=False):
        g = g.sort_values(x)
        ax.plot(g[x], g[y], marker="o", label=pol, color=POLICY_COLORS.get(pol))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_tok_s", " tok/s").replace("_", " "))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


# ----------------------------------------------------------------------------------------------------------------
# FlexGen's LP placement
# ----------------------------------------------------------------------------------------------------------------
def lp_placements(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                  shapes: Sequence[tuple], cpu_attention: bool = False) -> pd.DataFrame:
    """FlexGen's LP optimum for each block shape (gpu_batch_size, num_gpu_batches[, cpu_attention]): the nine
    fractions, FlexGen's rounded ``--percent``, the LP's tok/s estimate and the memory constraints that bind."""
    from .optimize import flexgen_lp

    rows = []
    for shape in shapes:
        gbs, nb = shape[:2]
        ca = bool(shape[2]) if len(shape) > 2 else cpu_attention
        r = flexgen_lp(model, hw, prompt_len, gen_len, gbs, nb, ca)
        row = {"gpu_batch_size": gbs, "num_gpu_batches": nb, "batch": gbs * nb, "cpu_attention": ca}
        if r is None:
            rows.append({**row, "feasible": False})
            continue
        rows.append({**row, "feasible": True, **r.fractions, "percent": r.percent,
                     "lp_tok_s": 1.0 / r.seconds_per_token, "binding": ",".join(r.binding)})
    return pd.DataFrame(rows)


def plot_placement(df: pd.DataFrame, ax=None):
    """Stacked bars: where the LP puts weights, KV cache and activations (GPU / CPU / disk) for each block shape."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(1, 3, figsize=(11, 3.2), sharey=True)
    ok = df[df["feasible"]].reset_index(drop=True)
    ca = ok["cpu_attention"] if "cpu_attention" in ok else [False] * len(ok)
    labels = [f"{g}x{n}" + (" cpu-attn" if c else "")
              for g, n, c in zip(ok["gpu_batch_size"], ok["num_gpu_batches"], ca)]
    tiers = {"GPU": "#1f77b4", "CPU": "#ff7f0e", "disk": "#8c564b"}
    for a, (name, cols) in zip(ax, (("weights", ("wg", "wc", "wd")), ("KV cache", ("cg", "cc", "cd")),
                                    ("activations", ("hg", "hc", None)))):
        bottom = np.zeros(len(ok))
        for (tier, color), c in zip(tiers.items(), cols):
            v = ok[c].to_numpy() * 100 if c else np.zeros(len(ok))
            a.bar(labels, v, bottom=bottom, color=color, label=tier)
            bottom += v
        a.set_title(name)
        a.tick_params(axis="x", rotation=45, labelsize=8)
        a.set_xlabel("gpu batch x num batches")
    ax[0].set_ylabel("% placed")
    ax[-1].legend(fontsize=8, loc="lower right")
    return ax


# ----------------------------------------------------------------------------------------------------------------
# TightLLM's KV distributor
# ----------------------------------------------------------------------------------------------------------------
def _tightllm():
    if "tightllm" not in POLICIES:
        raise OffsimError("the tightllm policy is not installed (offsim/policies/tightllm.py is missing)")
    from .policies import tightllm

    return tightllm


def tightllm_nr_vs_context(model: ModelSpec, hw: HardwareSpec, settings: dict, gpu_batch_size: int,
                           num_gpu_batches: int, contexts: Sequence[int]) -> pd.DataFrame:
    """N_r that TightLLM's distributor picks for each GPU batch at a decode step with ``ctx`` tokens of context
    (the plan's own ``recompute_tokens``, on a one-decode-step workload with prompt_len = ctx), one row per
    (context, batch)."""
    t = _tightllm()
    st = t.TightLLMSettings(**settings)
    rows = []
    for ctx in contexts:
        wl = Workload(int(ctx), 2, gpu_batch_size, num_gpu_batches)
        nr = t.recompute_tokens(model, hw, wl, st)[1]  # step 1 attends over exactly ctx tokens
        for k, n in enumerate(nr):
            rows.append({"ctx_tokens": int(ctx), "batch_index": k, "n_r": int(n), "recompute_frac": n / ctx})
    return pd.DataFrame(rows)


def tightllm_balance(model: ModelSpec, hw: HardwareSpec, settings: dict, wl: Workload, ctx_tokens: int,
                     batch_index: int = 0, points: int = 64) -> tuple[pd.DataFrame, int]:
    """The compute and transfer seconds of one decoder layer of GPU batch ``batch_index`` as functions of N_r (the
    distributor's own ``stream_seconds``, i.e. offsim's cost model), on ``points`` values from 0 to the memory cap
    plus the N_r the distributor picks; and that N_r. TightLLM minimises max(T_compute, T_transfer) (DESIGN.md §5)."""
    t = _tightllm()
    from .kv_distributor import distributor

    st = t.TightLLMSettings(**settings)
    # the very problem the plan generator solves for this batch and context (placement, weight slice, memory caps)
    d = t.decision_for(model, hw, wl, st, ctx_tokens, batch_index)
    mem_hi = -1 if d.mem_hi is None else d.mem_hi
    kvd = distributor(model, hw, st.transfer_model)
    chosen = kvd.decide(d, st.kv_solver)
    top = ctx_tokens if mem_hi < 0 else min(mem_hi, ctx_tokens)
    top = top if d.hi is None else min(top, d.hi)
    ns = sorted(set(np.linspace(0, top, points).round().astype(int).tolist()) | {chosen})
    rows = []
    for n in ns:
        c, h, dk, dd = kvd.stream_seconds(d, n)
        rows.append({"n_r": n, "compute_s": c, "h2d_s": h, "disk_s": dk, "d2h_s": dd,
                     "layer_s": kvd.combine((c, h, dk, dd))})
    return pd.DataFrame(rows), chosen


def plot_balance(df: pd.DataFrame, chosen_n_r: int, ax=None, title: str | None = None):
    """T_compute and T_transfer against N_r, their max (what TightLLM minimises) and the chosen N_r."""
    ax = _ax(ax)
    ax.plot(df["n_r"], df["compute_s"] * 1e3, label="compute (recompute N_r + 1 tokens)", color=KIND_COLORS["compute"])
    ax.plot(df["n_r"], df["h2d_s"] * 1e3, label="H2D (KV prefix + weight slice [+ hidden])", color=KIND_COLORS["h2d"])
    if df["disk_s"].max() > 0:
        ax.plot(df["n_r"], df["disk_s"] * 1e3, label="disk read", color=KIND_COLORS["disk_read"])
    if df["d2h_s"].max() > 0:
        ax.plot(df["n_r"], df["d2h_s"] * 1e3, label="D2H (hidden back to host)", color=KIND_COLORS["d2h"])
    ax.plot(df["n_r"], df["layer_s"] * 1e3, "k--", lw=1, label="max: layer time")
    ax.axvline(chosen_n_r, color="r", lw=1, ls=":", label=f"chosen N_r = {chosen_n_r}")
    ax.set_xlabel("N_r (tokens recomputed instead of loaded)")
    ax.set_ylabel("ms per layer")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


# ----------------------------------------------------------------------------------------------------------------
# timelines
# ----------------------------------------------------------------------------------------------------------------
def step_window(trace: Trace, step: int) -> tuple[float, float]:
    """(start_s, end_s) of generation step ``step``: from its first op's start to its last op's end."""
    d = trace.df[trace.df["step"] == step]
    if d.empty:
        steps = sorted(trace.df["step"].unique())
        raise OffsimError(f"trace has no ops in step {step}; valid steps: {steps[0]}..{steps[-1]}")
    return float(d["start_s"].min()), float(d["end_s"].max())


def idle_gaps(trace: Trace, t0: float, t1: float, stream: str = "compute") -> list[tuple[float, float]]:
    """Intervals of [t0, t1] in which ``stream`` runs nothing (for 'compute': the GPU's idle gaps)."""
    d = trace.df[(trace.df["stream"] == stream) & (trace.df["end_s"] > t0) & (trace.df["start_s"] < t1)]
    iv = sorted(zip(np.maximum(d["start_s"].to_numpy(), t0).tolist(),
                    np.minimum(d["end_s"].to_numpy(), t1).tolist()))
    gaps, cur = [], t0
    for a, b in iv:
        if a > cur:
            gaps.append((cur, a))
        cur = max(cur, b)
    if cur < t1:
        gaps.append((cur, t1))
    return gaps


def gantt(trace: Trace, ax=None, step: int | None = None, streams: Sequence[str] = STREAMS,
          window: tuple[float, float] | None = None, title: str | None = None, show_gaps: bool = True,
          y_offset: float = 0.0, height: float = 0.8, alpha: float = 1.0, legend: bool = True, labels: bool = True):
    """Timeline of ``trace``: one row per stream, one bar per op coloured by kind, time in ms from the window's
    start. ``step`` picks one generation step (0 = prefill); the GPU's idle gaps in the window are shaded red.
    Returns the Axes."""
    ax = _ax(ax, figsize=(11, 2.6))
    df = trace.df
    if window is None:
        window = step_window(trace, step) if step is not None else (0.0, trace.makespan_s)
    t0, t1 = window
    d = df[(df["end_s"] > t0) & (df["start_s"] < t1) & df["stream"].isin(streams)]
    rows = {s: i for i, s in enumerate(streams)}
    for (stream, kind), g in d.groupby(["stream", "kind"]):
        a = (np.maximum(g["start_s"].to_numpy(), t0) - t0) * 1e3
        w = (np.minimum(g["end_s"].to_numpy(), t1) - t0) * 1e3 - a
        y = y_offset + rows[stream]
        ax.broken_barh(list(zip(a, w)), (y - height / 2, height), facecolors=KIND_COLORS.get(kind, "k"),
                       edgecolor="none", alpha=alpha, label=kind)
    if show_gaps and "compute" in rows:
        y = y_offset + rows["compute"]
        gaps = idle_gaps(trace, t0, t1)
        ax.broken_barh([((a - t0) * 1e3, (b - a) * 1e3) for a, b in gaps], (y - height / 2, height),
                       facecolors="none", edgecolor="red", hatch="////", lw=0, alpha=0.5, label="GPU idle")
    if labels:
        ax.set_yticks([y_offset + i for i in rows.values()], list(rows))
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_xlabel("ms from the start of the window")
    if legend:
        h, lab = ax.get_legend_handles_labels()
        uniq = dict(zip(lab, h))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def step_summary(trace: Trace, step: int) -> dict:
    """Length of step ``step`` and the share of it the GPU computes, and each stream's busy seconds in it."""
    t0, t1 = step_window(trace, step)
    idle = float(sum(b - a for a, b in idle_gaps(trace, t0, t1)))
    d = trace.df[trace.df["step"] == step]
    busy = (d["end_s"] - d["start_s"]).groupby(d["stream"]).sum()
    return {"step_s": t1 - t0, "gpu_idle_s": idle, "gpu_idle_frac": idle / (t1 - t0) if t1 > t0 else 0.0,
            **{f"busy_{s}_s": float(busy.get(s, 0.0)) for s in STREAMS}}


def gantt_overlay(measured: Trace, predicted: Trace, step: int, ax=None, streams: Sequence[str] = STREAMS,
                  title: str | None = None):
    """A measured and a predicted timeline of the same plan for one step: each stream has two lanes, measured
    (upper, solid) and predicted (lower, faded), on one time axis from each trace's own step start."""
    ax = _ax(ax, figsize=(11, 4))
    for tr, off, alpha, tag in ((measured, 0.2, 1.0, "measured"), (predicted, -0.2, 0.55, "offsim")):
        gantt(tr, ax, step=step, streams=streams, y_offset=off, height=0.36, alpha=alpha, legend=False,
              labels=False, show_gaps=False)
    ax.set_yticks([i + o for i in range(len(streams)) for o in (0.2, -0.2)],
                  [f"{s} {tag}" for s in streams for tag in ("measured", "offsim")], fontsize=7)
    m0, m1 = step_window(measured, step)
    p0, p1 = step_window(predicted, step)
    ax.set_xlim(0, max(m1 - m0, p1 - p0) * 1e3)
    h, lab = ax.get_legend_handles_labels()
    uniq = {}
    for lb, hd in zip(lab, h):
        uniq.setdefault(lb, hd)  # the measured (solid) patch
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(title or f"step {step}: measured {1e3 * (m1 - m0):.1f} ms, offsim {1e3 * (p1 - p0):.1f} ms",
                 fontsize=10)
    return ax


# ----------------------------------------------------------------------------------------------------------------
# committed results
# ----------------------------------------------------------------------------------------------------------------
def read_results_csv(path: str | Path) -> tuple[dict, pd.DataFrame]:
    """(provenance, table) of a results CSV whose first line is '# ' + JSON (``offsim.provenance.write_csv``)."""
    path = Path(path)
    try:
        with open(path) as f:
            head = f.readline()
            prov = json.loads(head[2:]) if head.startswith("# ") else {}
            if not head.startswith("# "):
                f.seek(0)
            df = pd.read_csv(f)
    except OSError as e:
        raise OffsimError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise OffsimError(f"{path}: the first line is not '# ' + provenance JSON ({e})") from None
    return prov, df


def results_dir(start: str | Path | None = None) -> Path:
    """The repository's ``results/`` folder: the first parent of ``start`` (default: the working directory, which
    is ``notebooks/`` when Jupyter runs a notebook) that holds ``pyproject.toml``."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file():
            return d / "results"
    raise OffsimError(f"no pyproject.toml above {here}: run from inside the offsim repository")


def inventory(root: str | Path, names: Sequence[str]) -> pd.DataFrame:
    """What each ``root/NAME`` folder holds: files by type (so a notebook can say what is not committed yet)."""
    rows = []
    for n in names:
        d = Path(root) / n
        files = sorted(p for p in d.rglob("*") if p.is_file()) if d.is_dir() else []
        rows.append({"folder": f"results/{n}", "present": d.is_dir(), "files": len(files),
                     "csv": sum(p.suffix == ".csv" for p in files), "json": sum(p.suffix == ".json" for p in files),
                     "png": sum(p.suffix == ".png" for p in files),
                     "readme": any(p.name.lower() == "readme.md" for p in files)})
    return pd.DataFrame(rows)


def _is_trace_csv(path: Path) -> bool:
    import gzip

    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            head = f.readline()
        return head.startswith("# ") and json.loads(head[2:]).get("schema") == TRACE_SCHEMA
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def find_traces(*dirs: str | Path) -> list[Path]:
    """Trace CSVs (offsim's trace schema; plain or gzipped) under ``dirs``, recursively, sorted."""
    out = []
    for d in dirs:
        d = Path(d)
        if d.is_dir():
            out += [p for p in sorted([*d.rglob("*.csv"), *d.rglob("*.csv.gz")]) if _is_trace_csv(p)]
    return out


def load_trace(path: str | Path) -> Trace:
    """``Trace.from_csv`` for a plain or a gzipped (``.csv.gz``) trace CSV."""
    path = Path(path)
    if path.suffix != ".gz":
        return Trace.from_csv(path)
    import gzip
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / path.stem  # x.csv.gz -> x.csv
        try:
            with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (OSError, EOFError) as e:
            raise OffsimError(f"cannot decompress trace {path}: {e}") from None
        return Trace.from_csv(plain)


def find_cases(*dirs: str | Path) -> list[Path]:
    """Measured cases under ``dirs`` that ``offsim.validate.load_case`` reads: ``*.case.json`` and ``*.trace.csv``
    (its naming convention) and any other ``*.json`` whose ``schema`` is the case schema, recursively, sorted."""
    from .validate import CASE_SCHEMA

    out = set()
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        out |= set(d.rglob("*.case.json")) | set(d.rglob("*.trace.csv"))
        for p in d.rglob("*.json"):
            try:
                with open(p) as f:
                    head = f.read(4096)
            except OSError:
                continue
            if f'"schema": "{CASE_SCHEMA}"' in head or f'"schema":"{CASE_SCHEMA}"' in head:
                out.add(p)
    return sorted(out)


def load_offexec_runs(*dirs: str | Path) -> pd.DataFrame:
    """One row per (run, phase) from the JSON documents ``offexec run`` prints last (saved as ``*.json``): model,
    policy, workload, measured and predicted tok/s and the relative error of the prediction."""
    rows = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*.json")):
            try:
                doc = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            # one run per document, a list of them, or an experiment's {"runs": [...]} (model etc. at the top)
            top = doc if isinstance(doc, dict) else {}
            docs = doc if isinstance(doc, list) else top.get("runs", [top]) if isinstance(top.get("runs"), list) \
                else [top]
            for r in docs:
                if not (isinstance(r, dict) and "measured" in r and "predicted" in r):
                    continue
                r = {**{k: top[k] for k in ("model", "provenance", "workload") if k in top}, **r}
                if "budget_bytes" not in r and "budget_gib" in top:
                    r["budget_bytes"] = top["budget_gib"] * GiB
                wl = r.get("workload", {})
                for phase in ("prefill", "decode", "total"):
                    k = f"{phase}_tok_s"
                    m, pr = r["measured"].get(k), r["predicted"].get(k)
                    if m is None or pr is None:
                        continue
                    rows.append({"file": str(p), "config": r.get("config", p.stem), "model": r.get("model"),
                                 "policy": r.get("policy"),
                                 "prompt_len": wl.get("prompt_len"), "gen_len": wl.get("gen_len"),
                                 "batch": (wl.get("gpu_batch_size") or 0) * (wl.get("num_gpu_batches") or 0),
                                 "budget_GiB": (r.get("budget_bytes") or 0) / GiB, "phase": phase,
                                 "measured_tok_s": m, "predicted_tok_s": pr,
                                 "error": (pr - m) / m if m else math.nan,
                                 "gpu": (r.get("provenance") or {}).get("gpu", "")})
    return pd.DataFrame(rows, columns=["file", "config", "model", "policy", "prompt_len", "gen_len", "batch",
                                       "budget_GiB", "phase", "measured_tok_s", "predicted_tok_s", "error", "gpu"])


def error_table(df: pd.DataFrame, by: Sequence[str] = ("policy", "phase")) -> pd.DataFrame:
    """Cases, median and worst absolute relative error of predicted vs measured throughput, grouped by ``by``."""
    if df.empty:
        return pd.DataFrame(columns=[*by, "cases", "median_abs_error", "max_abs_error", "mean_error"])
    d = df.assign(error=pd.to_numeric(df["error"], errors="coerce"))
    d["abs_error"] = d["error"].abs()
    return d.groupby(list(by)).agg(cases=("error", "size"), median_abs_error=("abs_error", "median"),
                                   max_abs_error=("abs_error", "max"), mean_error=("error", "mean")).reset_index()


def resimulate(measured: Trace | dict, hw: HardwareSpec | str | None = None) -> Trace:
    """The prediction for a measured run (a Trace, or a case dict of ``offsim.validate``): rebuild its plan from the
    metadata (model, policy, settings, workload) and simulate it on ``hw`` (default: the hardware profile the
    metadata names, else its hardware). Memory is not re-checked: the run already happened within its budget."""
    meta = measured.meta if isinstance(measured, Trace) else measured["meta"]
    missing = [k for k in ("model", "policy", "workload") if k not in meta]
    if missing:
        raise OffsimError(f"measured run metadata lacks {missing}: cannot rebuild its plan")
    model = get_model(meta.get("model_config") or meta["model"])
    if not isinstance(hw, HardwareSpec):
        hw = get_hardware(hw or meta.get("hardware_profile") or meta.get("hardware") or "h200",
                          meta.get("gpu_mem_gb"))
    policy = meta["policy"]
    if policy not in POLICIES:
        raise OffsimError(f"policy {policy!r} of the measured run is not installed; valid: {', '.join(POLICIES)}")
    names = {f.name for f in dataclasses.fields(POLICIES[policy][1])}
    settings = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (meta.get("settings") or {}).items()
                if k in names}  # plans record derived values too (e.g. TightLLM's N_r table)
    plan = build_plan(policy, model, hw, Workload.from_dict(meta["workload"]), settings, validate=False)
    return simulate(plan, hw, check_memory=False)


def validation_long(df: pd.DataFrame) -> pd.DataFrame:
    """``offsim.validate.validate_dir``'s table (one row per case) in long form: one row per (case, phase) with
    measured_tok_s, predicted_tok_s and the signed relative error."""
    keys = [c for c in ("case", "model", "policy", "hardware", "gpu_mem_gb", "prompt_len", "batch") if c in df]
    parts = []
    for phase in ("prefill", "decode", "total"):
        m, pr = f"measured_{phase}_tok_s", f"predicted_{phase}_tok_s"
        if m in df and pr in df:
            part = df[keys].copy()
            part["phase"], part["measured_tok_s"], part["predicted_tok_s"] = phase, df[m], df[pr]
            part["error"] = (df[pr] - df[m]) / df[m]
            parts.append(part)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=[*keys, "phase", "measured_tok_s", "predicted_tok_s", "error"])


def op_kind_errors(measured: Trace, predicted: Trace) -> pd.DataFrame:
    """Per op kind: ops, total and mean seconds measured and predicted, and the mean absolute percentage error of
    the per-op durations (ops matched by id: both traces come from the same plan)."""
    m = measured.df.set_index("op_id")
    p = predicted.df.set_index("op_id").reindex(m.index)
    dm, dp = m["end_s"] - m["start_s"], p["end_s"] - p["start_s"]
    d = pd.DataFrame({"kind": m["kind"], "measured_s": dm, "predicted_s": dp})
    d["ape"] = (d["predicted_s"] - d["measured_s"]).abs() / d["measured_s"].where(d["measured_s"] > 0)
    g = d.groupby("kind").agg(ops=("measured_s", "size"), measured_total_s=("measured_s", "sum"),
                              predicted_total_s=("predicted_s", "sum"), mape=("ape", "mean")).reset_index()
    g["total_error"] = (g["predicted_total_s"] - g["measured_total_s"]) / g["measured_total_s"]
    return g


def plot_pred_vs_measured(df: pd.DataFrame, ax=None, hue: str = "policy", band: float = 0.10,
                          x: str = "measured_tok_s", y: str = "predicted_tok_s", title: str | None = None):
    """Predicted against measured (log-log), the y = x line and a ±``band`` band; one colour per ``hue``."""
    ax = _ax(ax, figsize=(5, 5))
    if df.empty:
        ax.text(0.5, 0.5, "no measured cases committed", ha="center", va="center", transform=ax.transAxes)
        return ax
    for key, g in df.groupby(hue, sort=False):
        ax.scatter(g[x], g[y], label=key, color=POLICY_COLORS.get(key), s=22)
    lo = float(min(df[x].min(), df[y].min())) * 0.8
    hi = float(max(df[x].max(), df[y].max())) * 1.25
    t = np.geomspace(lo, hi, 50)
    ax.plot(t, t, "k-", lw=0.8)
    ax.fill_between(t, t * (1 - band), t * (1 + band), color="k", alpha=0.08, label=f"±{band:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("offsim tok/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def plot_published_vs_simulated(df: pd.DataFrame, label: str, published: str = "published_tok_s",
                                simulated: str = "predicted_tok_s", ax=None, logy: bool = True,
                                title: str | None = None):
    """Paired bars per row: the paper's number and offsim's, with the ratio above each pair."""
    ax = _ax(ax, figsize=(max(6, 0.7 * len(df)), 4))
    xs = np.arange(len(df))
    ax.bar(xs - 0.2, df[published], 0.4, label="published", color="#7f7f7f")
    ax.bar(xs + 0.2, df[simulated], 0.4, label="offsim", color="#1f77b4")
    for xv, a, b in zip(xs, df[published], df[simulated]):
        if a and np.isfinite(a) and np.isfinite(b):
            ax.annotate(f"x{b / a:.2f}", (xv, max(a, b)), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs, df[label], rotation=40, ha="right", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel("tok/s")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if title:
        ax.set_title(title)
    return ax
