"""The discrete-event simulator (SimPy; docs/architecture.md §6): a plan's ops on the compute, cpu, h2d, d2h and disk streams.

Each stream is a SimPy process that walks its ops in plan order -- the story of a CUDA stream: wait for the ops this
one depends on, then hold the stream for as long as the cost model says. Memory on each tier is allocated when an op
starts and freed when it ends; the peaks are reported. Same inputs, same trace: nothing here is random, and SimPy
orders simultaneous events by insertion.

Host issue: when the hardware profile gives the runtime's per-op issue cost, an op also waits until the host has
issued it (ops are issued in plan order by one thread).

Duplex: a PCIe copy that starts while the opposite direction is busy runs at ``duplex_fraction`` of its bandwidth
for the overlap (see ``costmodel.transfer_seconds``); the copy already in flight keeps its duration. That is a
first-order model of the shared link, not a fluid one.
"""
from __future__ import annotations

import math

import numpy as np
import simpy

from offsim.core import costmodel
from offsim.core.errors import OffsimError
from offsim.core.plan import STREAMS, TIERS, Plan
from offsim.core.specs import HardwareSpec
from offsim.core.trace import Trace

_OPPOSITE = {"h2d": "d2h", "d2h": "h2d"}
_NONE = (0, 0, 0)


def simulate(plan: Plan, hw: HardwareSpec, check_memory: bool = True) -> Trace:
    """Run ``plan`` on ``hw``; return the predicted Trace. With ``check_memory`` a tier that overflows its
    capacity under this timing raises OffsimError naming the op and the shortfall."""
    model = plan.model
    ops = plan.ops
    n = len(ops)
    env = simpy.Environment()
    start = np.zeros(n)
    end = np.full(n, math.nan)
    finished = [False] * n
    waiters: dict[int, simpy.Event] = {}
    busy_until = {s: 0.0 for s in STREAMS}
    mem = [plan.resident.get(t, 0) for t in TIERS]
    peak = list(mem)
    cap = [plan.capacity.get(t, 0) for t in TIERS]
    duration_cache: dict[tuple, float] = {}
    disk_cached = plan.disk_cached  # the plan's disk tier goes through the page cache: priced at its rates

    def duration(op, now: float) -> float:
        other = _OPPOSITE.get(op.kind)
        other_busy = max(0.0, busy_until[other] - now) if other else 0.0
        if other_busy > 0.0:
            return costmodel.op_seconds(op, model, hw, other_busy, disk_cached)
        key = (op.kind, op.part, op.num_seqs, op.q_tokens, op.ctx_tokens, op.nbytes, op.pinned)
        d = duration_cache.get(key)
        if d is None:
            d = duration_cache[key] = costmodel.op_seconds(op, model, hw, disk_cached=disk_cached)
        return d

    # the host issues ops one after another in plan order (a single issuing thread); an op cannot start before
    # it is issued. With an ideal runtime (zero issue cost) this is a no-op.
    if hw.issue_compute_s or hw.issue_copy_s:
        issued_at = np.cumsum([costmodel.issue_seconds(o, hw) for o in ops])
    else:
        issued_at = None

    def stream(stream_ops):
        for op in stream_ops:
            if issued_at is not None and issued_at[op.id] > env.now:
                yield env.timeout(issued_at[op.id] - env.now)
            for d in op.deps:  # wait for each unfinished dependency in turn (cheaper than an AllOf condition)
                if not finished[d]:
                    ev = waiters.get(d)
                    if ev is None:
                        ev = waiters[d] = env.event()
                    yield ev
            now = env.now
            start[op.id] = now
            if op.alloc != _NONE:
                for t in range(3):
                    if op.alloc[t]:
                        mem[t] += op.alloc[t]
                        if mem[t] > peak[t]:
                            peak[t] = mem[t]
                            if check_memory and mem[t] > cap[t]:
                                raise OffsimError(
                                    f"{op.describe()} at t={now:.4f}s: {TIERS[t]} memory reaches {mem[t]} bytes, "
                                    f"over the capacity {cap[t]} by {mem[t] - cap[t]} bytes")
            if op.kind in _OPPOSITE and busy_until[_OPPOSITE[op.kind]] > now:
                dt = duration(op, now)
            else:
                key = (op.kind, op.part, op.num_seqs, op.q_tokens, op.ctx_tokens, op.nbytes, op.pinned)
                dt = duration_cache.get(key)
                if dt is None:
                    dt = duration_cache[key] = costmodel.op_seconds(op, model, hw, disk_cached=disk_cached)
            busy_until[op.stream] = now + dt
            yield env.timeout(dt)
            end[op.id] = env.now
            finished[op.id] = True
            if op.free != _NONE:
                for t in range(3):
                    mem[t] -= op.free[t]
            ev = waiters.pop(op.id, None)
            if ev is not None:
                ev.succeed()

    by_stream: dict[str, list] = {s: [] for s in STREAMS}
    for op in ops:
        by_stream[op.stream].append(op)
    for s in STREAMS:
        if by_stream[s]:
            env.process(stream(by_stream[s]))
    env.run()
    if not all(finished):
        stuck = next(o for o in ops if not finished[o.id])
        raise OffsimError(f"{stuck.describe()} never ran: it waits on an op that is behind it on its own stream "
                          "(deadlock in the plan)")
    meta = {"model": model.name, "hardware": hw.name, "policy": plan.policy, "workload": plan.workload.to_dict(),
            "settings": plan.settings, "derived": plan.derived,
            "source": "offsim"}
    if plan.disk_cached:
        meta["disk_cached"] = True
    return Trace.from_arrays(plan, start, end, meta, {t: int(peak[i]) for i, t in enumerate(TIERS)})
