"""Latency against throughput over a sweep's table (``offsim.search.grid``): which points no other point beats on
both (``pareto_front``), and the plot ``offsim sweep`` writes (``plot_pareto``): one panel per model, hardware and
workload (prompt and generation length), every answered point of each policy, and each policy's front drawn as a
staircase.

A point is on a policy's front when no other point of that policy in the same panel has both a lower latency and
a higher throughput (ties count as beaten only when strictly better on one and no worse on the other). Points of
different workloads are never compared: a short prompt's point would "beat" a long prompt's without being a choice
for the same requests. Within a panel the front runs over what else the sweep varies (GPU budgets, batches,
settings).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

LATENCY_COLUMNS = {"total_s": "latency: time to the block's last token (s)",
                   "ttft_s": "time to first token (s)",
                   "decode_ms_per_token": "decode latency per token (ms)"}
MAX_PANELS = 25
PANEL = ("model", "hardware", "prompt_len", "gen_len")  # what a front never spans (those columns the table has)


def pareto_front(x: Sequence[float], y: Sequence[float]) -> np.ndarray:
    """Boolean mask of the points not dominated when ``x`` is to be small and ``y`` large."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    order = np.lexsort((-y, x))  # by x ascending, then y descending
    keep = np.zeros(len(x), dtype=bool)
    best_y = -np.inf
    for i in order:
        if y[i] > best_y:  # strictly more throughput than every point with no more latency
            keep[i] = True
            best_y = y[i]
    return keep


def _panel(df: pd.DataFrame) -> tuple[str, ...]:
    return tuple(c for c in PANEL if c in df.columns)


def fronts(df: pd.DataFrame, x: str = "total_s", y: str = "total_tok_s",
           by: Sequence[str] | None = None) -> pd.DataFrame:
    """The answered points (status 'ok') with a column ``on_front``: on the Pareto front of their ``by`` group
    (default: the panel, ``PANEL``'s columns that ``df`` has, and the policy)."""
    by = (*_panel(df), "policy") if by is None else by
    ok = df[(df["status"] == "ok") & df[x].notna() & df[y].notna()].copy()
    ok["on_front"] = False
    for _, g in ok.groupby(list(by), sort=False, dropna=False):
        ok.loc[g.index, "on_front"] = pareto_front(g[x], g[y])
    return ok


def plot_pareto(df: pd.DataFrame, x: str = "total_s", y: str = "total_tok_s", facet: Sequence[str] | None = None,
                title: str | None = None):
    """One panel per value of ``facet`` (default: ``PANEL``'s columns that ``df`` has) that has answered points (at
    most ``MAX_PANELS``, the rest named in the title), log-log; returns the figure. Colours per policy as in
    ``offsim.analysis.plots``."""
    facet = _panel(df) if facet is None else tuple(facet)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    from offsim.analysis.plots import POLICY_COLORS

    pts = fronts(df, x, y, by=(*facet, "policy"))
    groups = list(pts.groupby(list(facet), sort=False)) if len(pts) else []
    shown, hidden = groups[:MAX_PANELS], groups[MAX_PANELS:]
    n = max(1, len(shown))
    cols = min(5, n)
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    if not shown:
        axes.flat[0].text(0.5, 0.5, "no answered point", ha="center", va="center", transform=axes.flat[0].transAxes)
    for ax, (key, g) in zip(axes.flat, shown):
        for pol, gp in g.groupby("policy", sort=False):
            color = POLICY_COLORS.get(pol)
            ax.scatter(gp[x], gp[y], s=9, alpha=0.35, color=color, linewidths=0)
            f = gp[gp["on_front"]].sort_values(x)
            ax.step(f[x], f[y], where="post", color=color, lw=1.4, marker="o", ms=3, label=pol)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.25)
        names = {"prompt_len": "prompt ", "gen_len": "gen "}
        ax.set_title(" / ".join(f"{names.get(c, '')}{k}" for c, k in
                                zip(facet, key if isinstance(key, tuple) else (key,))), fontsize=9)
        ax.tick_params(labelsize=7, which="both")
        ax.legend(fontsize=7)
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if lo > 0 and hi / lo > 10:  # decade labels only: minor ones overlap in small panels
                axis.set_minor_formatter(NullFormatter())
    for ax in axes[-1]:
        ax.set_xlabel(LATENCY_COLUMNS.get(x, x), fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(y.replace("_tok_s", " tok/s").replace("_", " "), fontsize=8)
    head = title or "latency vs throughput, each policy's Pareto front (line) and every point (dots)"
    if hidden:
        head += f"; {len(hidden)} more panel(s) not drawn"
    fig.suptitle(head, fontsize=10)
    fig.tight_layout()
    return fig
