"""Events at one instant in the event loop (offsim/core/sim.py ``simulate``): ops that end the instant they start and
many ops ending together, with the free issuer of the presets, with issue costs (the stream-order issuer) and
without a window -- the same traces, peaks and errors as the SimPy reference. The loop keeps the events it schedules
for the current instant in a queue of their own (``ready``), not in the heap; this checks it takes them in SimPy's
order where the real cost model rarely puts two events at one instant."""
import dataclasses
import math

import pytest

from offsim import Workload, build_plan
from offsim.core import costmodel
from offsim.core.sim import simulate, simulate_simpy

_real_op_seconds = costmodel.op_seconds


def _coarse_op_seconds(op, model, hw, other_busy_s=0.0, *args, **kw):
    """The cost model's price on a 10 ms grid (many ops end together), 0 s for every device-to-host copy, CPU
    compute op and embedding (ops that end the instant they start); a copy that the opposite direction slows down
    keeps its real (duplex) price, which the event loop takes from ``duplex_seconds``. (Coarse on purpose: with a
    2 ms grid and zero-time copies only, a loop that put the end of a zero-time op in the heap still passed.)"""
    base = _real_op_seconds(op, model, hw, 0.0, *args, **kw)
    if other_busy_s:
        d = _real_op_seconds(op, model, hw, other_busy_s, *args, **kw)
        if d != base:
            return d
    if op.kind in ("d2h", "cpu_compute") or getattr(op, "part", "") == "embed":
        return 0.0
    return math.ceil(base * 100) / 100


def _same(plan, hw, check_memory=True):
    out = []
    for engine in (simulate, simulate_simpy):
        try:
            out.append(engine(plan, hw, check_memory))
        except Exception as e:  # (an overflow or a deadlock: the same message from both)
            out.append(f"{type(e).__name__}: {e}")
    a, b = out
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    assert a.df.equals(b.df) and list(a.df.dtypes) == list(b.df.dtypes)
    assert a.peak_bytes == b.peak_bytes and a.meta == b.meta


@pytest.mark.parametrize("cpu_attention", [False, True])
@pytest.mark.parametrize("host", ["free", "issue_costs", "no_window"])
def test_same_instant_events_as_simpy(tiny_opt, t4, monkeypatch, cpu_attention, host):
    monkeypatch.setattr(costmodel, "op_seconds", _coarse_op_seconds)
    hw = t4 if host != "issue_costs" else dataclasses.replace(t4, name="t4-issue", issue_compute_s=2e-3,
                                                                issue_copy_s=1e-3)
    for pct in [(0, 100, 0, 100, 100, 0), (20, 80, 0, 50, 0, 100), (50, 50, 0, 60, 100, 0)]:
        plan = build_plan("flexgen", tiny_opt, hw, Workload(16, 5, 2, 3),
                          {"percent": pct, "cpu_attention": cpu_attention})
        if host == "no_window":
            plan.run_ahead = None
        assert any(op.kind == "d2h" for op in plan.ops)  # (ops of zero duration)
        _same(plan, hw)
        _same(plan, hw, check_memory=False)
