"""Drawing only: every function takes a DataFrame or a Trace that other modules computed and draws it on the Axes it
is given (or a new figure). matplotlib only, and nothing here selects a backend, so it runs under Agg in CI and inline
in Jupyter.

- sweeps and decisions: ``plot_sweep`` (``offsim.search.sweep``), ``plot_placement`` (FlexGen's LP per block shape),
  ``plot_balance`` (TightLLM's compute/transfer balance, ``offsim.analysis.decisions``);
- timelines: ``gantt`` draws the streams of a Trace, the GPU's idle gaps shaded; ``gantt_overlay`` sets a measured and
  a predicted trace of the same plan one above the other;
- results: ``plot_pred_vs_measured``, ``plot_published_vs_simulated``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from offsim.core.plan import STREAMS
from offsim.core.trace import Trace
from offsim.analysis.timeline import idle_gaps, step_window


KIND_COLORS = {"compute": "#1f77b4", "cpu_compute": "#9467bd", "h2d": "#2ca02c", "d2h": "#ff7f0e",
               "disk_read": "#8c564b", "disk_write": "#e377c2"}


POLICY_COLORS = {"static-accelerate": "#7f7f7f", "static-zero": "#bcbd22", "flexgen": "#1f77b4",
                 "tightllm": "#d62728", "selectn": "#2ca02c"}


def _ax(ax, figsize=(7, 4)):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize)
    return ax


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
