"""A trace's timeline, step by step: where a generation step starts and ends, the GPU's idle gaps in it, and each
stream's busy time (what ``offsim.analysis.plots.gantt`` shades and notebooks tabulate)."""
from __future__ import annotations

import numpy as np

from offsim.core.errors import OffsimError
from offsim.core.plan import STREAMS
from offsim.core.trace import Trace


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


def step_summary(trace: Trace, step: int) -> dict:
    """Length of step ``step`` and the share of it the GPU computes, and each stream's busy seconds in it."""
    t0, t1 = step_window(trace, step)
    idle = float(sum(b - a for a, b in idle_gaps(trace, t0, t1)))
    d = trace.df[trace.df["step"] == step]
    busy = (d["end_s"] - d["start_s"]).groupby(d["stream"]).sum()
    return {"step_s": t1 - t0, "gpu_idle_s": idle, "gpu_idle_frac": idle / (t1 - t0) if t1 > t0 else 0.0,
            **{f"busy_{s}_s": float(busy.get(s, 0.0)) for s in STREAMS}}
