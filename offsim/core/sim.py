"""The discrete-event simulator (docs/architecture.md §6): a plan's ops on the compute, cpu, h2d, d2h and disk streams.

Each stream walks its ops in plan order -- the story of a CUDA stream: wait for the ops this one depends on, then
hold the stream for as long as the cost model says. Memory on each tier is allocated when an op starts and freed
when it ends; the peaks are reported. Same inputs, same trace: nothing here is random, and simultaneous events are
taken in the order they were scheduled.

Host issue: when the hardware profile gives the runtime's per-op issue cost, an op also waits until the host has
issued it (ops are issued in plan order by one thread).

Duplex: a PCIe copy that starts while the opposite direction is busy runs at ``duplex_fraction`` of its bandwidth
for the overlap (see ``costmodel.transfer_seconds``); the copy already in flight keeps its duration. That is a
first-order model of the shared link, not a fluid one.

Several GPUs (a plan with ``Plan.stages``, pipeline parallelism): every device has its own compute, h2d, d2h and
p2p streams, its own GPU memory (peaks reported per device: ``peak_bytes['gpu0']``, ... and their largest as
``'gpu'``) and its own issuing thread (offexec runs one process per GPU); the host CPU's stream and the disk are
one each, shared by all devices, as are host memory and disk space. Over several nodes (``Plan.nodes``: FlexGen's
multi-node runs) each node has its own: a ``cpu`` and a ``disk`` stream shared by its devices, host memory and disk
space (peaks per node: ``peak_bytes['cpu0']``, ``'disk0'``, ... and their largest as ``'cpu'``, ``'disk'``), and a
p2p op between devices of different nodes is priced as the network transfer (``costmodel.network_p2p_seconds``).
Only ``simulate`` runs such plans.

Two engines, one model. ``simulate`` is a hand-written event loop over the plan's rows (``plan.op_rows``): a heap
of (time, sequence number, what to resume), and a queue of the events scheduled for the current instant, that takes
events in exactly the order SimPy would -- by time, then by the order they were scheduled, the five stream processes'
start first -- so that duplex slow-downs and memory peaks, which depend on what happens first at one instant, come out
the same. ``simulate_simpy`` is the model as
SimPy processes, kept as the readable reference: the tests require both to give identical traces. The event loop
is ~3-4x faster (no generator, event object or callback list per op; no ``Op`` object per op either).
"""
from __future__ import annotations

import gc
import heapq
import math
from collections import deque
from itertools import repeat
from operator import itemgetter

import numpy as np
import pandas as pd

from offsim.core import costmodel
from offsim.core.errors import OffsimError
from offsim.core.plan import (ALL_KINDS, ALL_STREAMS, SHARED_STREAMS, STREAM_OF_KIND, STREAMS, TIERS, Plan, PlanError,
                               _op_from_row, op_rows)
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec
from offsim.core.trace import COLUMNS, Trace

_OPPOSITE = {"h2d": "d2h", "d2h": "h2d"}
_NONE = (0, 0, 0)


HOST_STREAMS = ("cpu", "disk")  # ops the runtime's host threads run (offexec: one worker thread per stream)
# The issuer picks its next op as offexec's issuing loop does -- each stream's ops in plan order, of the streams'
# next ops the first in plan order whose dependencies are issued and whose host dependencies have finished --
# instead of walking every op in plan order. So the ops queued behind a GPU op that waits for a host op (CPU
# attention's output copy) are issued only after that host op, as in offexec; a host op costs the issuing loop's
# dispatch time only (handed to its worker, no handler). Both engines; where the plan has a run-ahead window and the
# profile prices issuing (a plan without a window, or a runtime that issues for free as the presets do, issues in
# plan order). False gives the plan-order issuer, for comparison
# (results/validation/calib_misses.md sets the two side by side on the calibration cases with CPU attention)
STREAM_ORDER_ISSUE = True


_prices_issue = costmodel.prices_issue  # whether the profile gives the runtime a cost per issued op


def _host_gates(is_host, blocks, deps_of, cost) -> list[float]:
    """Per op: its issue cost (``cost(i)``) where it runs on a GPU stream and depends on a host op, else 0. A runtime
    cannot enqueue a GPU op behind work the host has not done yet: offexec issues such an op only when its host
    dependencies have finished, and issuing it then takes its issue cost, so it starts no earlier than the last
    host dependency's end plus that cost."""
    return [cost(i) if not is_host[i] and any(blocks[d] for d in deps) else 0.0 for i, deps in enumerate(deps_of)]


def _blocks_issue(plan: Plan, is_host: list) -> list:
    """Per op: whether the issuing thread waits for it to finish before issuing an op that depends on it -- a host
    op (offexec's rule), or any op where the plan's runtime waits for every dependency
    (``Plan.issue_waits_for_deps``: FlexGen's ``sync()`` after each position blocks its main loop)."""
    return [True] * len(is_host) if plan.issue_waits_for_deps else is_host


WINDOW_STREAMS = ("compute", "h2d", "d2h")  # the streams of ``Plan.run_ahead``, in its order


def _window_preds(run_ahead, streams, index: dict[str, int] | None = None, none: int = -1) -> list[int] | None:
    """Per op (plan order): the op ``run_ahead`` places earlier on its stream, which must have finished before the
    runtime issues it (offexec's flow control), or ``none``; None without a window (``run_ahead`` None). ``streams``:
    each op's stream name (a sequence or a numpy array), or with ``index`` ({stream name: code}) each op's stream code
    (an integer array: comparing integers, not strings, is what keeps this cheap for a plan of 10^5 ops). Ops on the
    host streams are handed to worker threads and have no window. Both engines take their windows from here."""
    if run_ahead is None:
        return None
    names = np.asarray(streams)
    pred = np.full(len(names), none, dtype=np.intp)
    for name, w in zip(WINDOW_STREAMS, run_ahead):
        b = np.flatnonzero(names == (name if index is None else index[name]))
        if len(b) > w:
            pred[b[w:]] = b[:-w]
    return pred.tolist()


def simulate_simpy(plan: Plan, hw: HardwareSpec, check_memory: bool = True) -> Trace:
    """The reference engine: ``simulate`` written as SimPy processes, one per stream (slower; the tests check that
    both give identical traces). One GPU only."""
    if plan.stages:
        raise OffsimError("the SimPy reference engine runs single-GPU plans; simulate a plan with stages with "
                          "`simulate` (the default engine)")
    import simpy  # only the reference engine runs on SimPy: the commands (``simulate``) do not import it

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
    price = _op_pricer(plan, model, hw)
    comp = Compression.from_settings(plan.settings)  # 4-bit passes and sparse attention of compute ops
    captures = _capture_extras(plan, op_rows(ops), hw)  # graphed ops offexec captures where they first run
    clock = _Clock.of(plan, hw, comp)  # the clock under the power cap (None: every op at its price)

    def duration(op, now: float) -> float:
        other = _OPPOSITE.get(op.kind)
        other_busy = max(0.0, busy_until[other] - now) if other else 0.0
        if other_busy > 0.0:
            return price(op, other_busy)
        key = (op.kind, op.part, op.num_seqs, op.q_tokens, op.ctx_tokens, op.nbytes, op.pinned, op.tensor)
        d = duration_cache.get(key)
        if d is None:
            d = duration_cache[key] = price(op)
        return d

    # the host issues ops one after another in plan order (a single issuing thread); an op cannot start before
    # it is issued. With an ideal runtime (zero issue cost, no run-ahead window) this is a no-op.
    has_cost = _prices_issue(hw)
    relay = plan.pageable_copy == "relay"
    gq_of = _issue_graph_q(plan)
    costs = issue_costs(plan, hw)
    if costs is not None:  # a capture is host work: the issuing thread records the graph (as ``simulate``)
        for i, extra in captures.items():
            costs[i] += extra
        captures = {}
    pred = _window_preds(plan.run_ahead, [op.stream for op in ops])  # None: no window
    stream_order = STREAM_ORDER_ISSUE and pred is not None and has_cost
    is_host = [op.stream in HOST_STREAMS for op in ops]
    blocks = _blocks_issue(plan, is_host)
    issued_at = np.cumsum(costs) if has_cost and pred is None else None
    issued = [False] * n
    issue_waiters: dict[int, simpy.Event] = {}
    host_wait: list[simpy.Event] = []  # the stream-order issuer, waiting for any host op to end

    def issue(i):
        # before op i: wait for the op ``run_ahead`` places earlier on i's stream to finish, then spend i's issue
        # cost; op i may start from then on
        p = pred[i]
        if p >= 0 and not finished[p]:
            ev = waiters.get(p)
            if ev is None:
                ev = waiters[p] = env.event()
            yield ev
        if costs is not None and costs[i] > 0.0:
            yield env.timeout(costs[i])
        issued[i] = True
        ev = issue_waiters.pop(i, None)
        if ev is not None:
            ev.succeed()

    def issuer_stream_order():
        # offexec's issuing loop (``Executor``): each stream's ops in plan order; of the streams' next ops, the first
        # in plan order whose dependencies are all issued and whose host dependencies have finished; when none is,
        # it waits for the next host op to end
        queues = [[op.id for op in ops if op.stream == st] for st in STREAMS]
        ptr = [0] * len(queues)
        while True:
            i, q_of = -1, -1
            for q, b in enumerate(queues):
                k = ptr[q]
                if k >= len(b) or (i >= 0 and b[k] > i):
                    continue
                if all(issued[d] and (not blocks[d] or finished[d]) for d in ops[b[k]].deps):
                    i, q_of = b[k], q
            if i < 0:
                if not any(ptr[q] < len(b) for q, b in enumerate(queues)):
                    return
                ev = env.event()
                host_wait.append(ev)
                yield ev
                continue
            ptr[q_of] += 1
            yield from issue(i)

    def issuer():
        # the issuing thread with the runtime's window: before op i it waits for the op ``run_ahead`` places
        # earlier on i's stream to finish, then spends i's issue cost; op i may start from then on
        for i in range(n):
            yield from issue(i)

    gate_s = _host_gates(is_host, blocks, [op.deps for op in ops],
                         lambda i: costmodel.issue_seconds(ops[i], hw, gq_of(ops[i]), model, relay)) \
        if has_cost else None

    def stream(stream_ops):
        for op in stream_ops:
            if issued_at is not None and issued_at[op.id] > env.now:
                yield env.timeout(issued_at[op.id] - env.now)
            if pred is not None and not issued[op.id]:
                ev = issue_waiters.get(op.id)
                if ev is None:
                    ev = issue_waiters[op.id] = env.event()
                yield ev
            for d in op.deps:  # wait for each unfinished dependency in turn (cheaper than an AllOf condition)
                if not finished[d]:
                    ev = waiters.get(d)
                    if ev is None:
                        ev = waiters[d] = env.event()
                    yield ev
            if gate_s is not None and gate_s[op.id]:  # issued only once its host dependencies are done
                gate = max(end[d] for d in op.deps if blocks[d]) + gate_s[op.id]
                if gate > env.now:
                    yield env.timeout(gate - env.now)
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
                key = (op.kind, op.part, op.num_seqs, op.q_tokens, op.ctx_tokens, op.nbytes, op.pinned, op.tensor)
                dt = duration_cache.get(key)
                if dt is None:
                    dt = duration_cache[key] = price(op)
                if clock is not None and op.kind == "compute":
                    dt = clock.start(op.stream, now, dt + captures.get(op.id, 0.0), clock.clocked(op, dt))
                else:
                    dt += captures.get(op.id, 0.0)
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
            if host_wait and blocks[op.id]:  # the stream-order issuer waits for a host op: rescan
                host_wait.pop().succeed()

    by_stream: dict[str, list] = {s: [] for s in STREAMS}
    for op in ops:
        by_stream[op.stream].append(op)
    if pred is not None and n:
        env.process(issuer_stream_order() if stream_order else issuer())  # (first: as the event loop's issuer)
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


# ---------------------------------------------------------------------------------------------------------------
# the event loop
# ---------------------------------------------------------------------------------------------------------------
_STREAM_INDEX = {s: i for i, s in enumerate(ALL_STREAMS)}  # (p2p last: a single-GPU plan has none)
_OTHER_INDEX = [_STREAM_INDEX.get(_OPPOSITE.get(s), -1) for s in ALL_STREAMS]  # h2d <-> d2h, others -1
_SHARED_INDEX = frozenset(_STREAM_INDEX[s] for s in SHARED_STREAMS)
_KIND_STREAM_INDEX = {k: _STREAM_INDEX[s] for k, s in STREAM_OF_KIND.items()}
_KIND_INDEX = {k: i for i, k in enumerate(ALL_KINDS)}
_KIND_STREAM_CODES = np.array([_KIND_STREAM_INDEX[k] for k in ALL_KINDS], dtype=np.intp)  # kind index -> stream's


def _op_pricer(plan: Plan, model, hw: HardwareSpec):
    """``price(op, other_busy_s=0.0)``: ``costmodel.op_seconds`` of one of ``plan``'s ops with what the plan fixes
    for all of them -- its disk tier's page cache, graphed decode ops, compression, DeepSpeed's gather copies, whose
    CPU attention and copy paths run, left-padded batches (eager attention under a key mask) and the KV buffers'
    length (what a graphed decode op attends over). Both engines price through it."""
    kw = dict(disk_cached=plan.disk_cached, graph_q_tokens=plan.graph_q_tokens,
              comp=Compression.from_settings(plan.settings), gather_copies=plan.weight_gather_copies,
              cpu_attention_impl=plan.cpu_attention_impl, pageable_copy=plan.pageable_copy,
              quant_impl=plan.quant_impl, masked=plan.workload.padded, kv_len=plan.workload.max_len)

    eager = costmodel.eager_graph_shapes(plan)
    if not eager:
        def price(op, other_busy_s: float = 0.0) -> float:
            return costmodel.op_seconds(op, model, hw, other_busy_s, **kw)

        return price
    kw_eager = {**kw, "graph_q_tokens": 0}  # a shape the plan runs eagerly (``Plan.graph_min_uses``)

    def price_some_eager(op, other_busy_s: float = 0.0) -> float:
        eager_op = (getattr(op, "part", ""), getattr(op, "q_tokens", 0)) in eager
        return costmodel.op_seconds(op, model, hw, other_busy_s, **(kw_eager if eager_op else kw))

    return price_some_eager


def issue_costs(plan: Plan, hw: HardwareSpec, captures: bool = False) -> list[float] | None:
    """The issuing thread's seconds for each of ``plan``'s ops (plan order) as the simulator charges them:
    ``costmodel.issue_seconds``, and for an op of a host stream (CPU attention, the disk) handed to its worker thread
    only the issuing loop's own time (``costmodel.dispatch_seconds``) where the runtime issues in stream order with a
    window (``STREAM_ORDER_ISSUE``); with ``captures`` also the CUDA-graph captures the simulator adds where a graph
    key first runs (``_capture_extras``: host work too). None where the profile prices no issue (an ideal runtime).
    With captures, what ``offsim simulate`` reports as the host's issue share (``host_issue_decode_frac``)."""
    if not _prices_issue(hw):
        return None
    gq_of, model = _issue_graph_q(plan), plan.model
    relay = plan.pageable_copy == "relay"
    handed = STREAM_ORDER_ISSUE and plan.run_ahead is not None
    costs = [costmodel.dispatch_seconds(o, hw, model) if handed and o.stream in HOST_STREAMS
             else costmodel.issue_seconds(o, hw, gq_of(o), model, relay) for o in plan.ops]
    if captures:
        for i, extra in _capture_extras(plan, op_rows(plan.ops), hw).items():
            costs[i] += extra
    return costs


def _issue_graph_q(plan: Plan):
    """``gq(op)``: the graph_q_tokens ``costmodel.issue_seconds`` takes for one of ``plan``'s ops -- the plan's, or 0
    for a shape it runs eagerly (``costmodel.eager_graph_shapes``)."""
    gq, eager = plan.graph_q_tokens, costmodel.eager_graph_shapes(plan)
    return lambda op: 0 if (getattr(op, "part", ""), getattr(op, "q_tokens", 0)) in eager else gq


def _capture_extras(plan: Plan, rows: list, hw: HardwareSpec) -> dict[int, float]:
    """{op index: extra seconds} of the ops at which offexec captures a CUDA graph
    (``costmodel.capture_extra_seconds``): the first op in plan order of each graph key -- part, query tokens,
    layer, and for parts that attend over the GPU KV buffers the batch (offexec keys a graph by the addresses it
    reads: weights, KV buffers). Empty without graphs or without the profile's 'capture' rows. Both engines add
    these to the ops' issue costs -- a capture is host work (the static body's launches, recording, instantiating),
    which the host overlaps with the GPU's earlier ops --
    or, for a runtime without issue costs, to the ops' durations. (Priced as GPU time the first decode step came out
    10-20 ms too long. Step 1 case by case today: results/validation/calib_misses.md, 'The first decode step'; a
    run that is its process's first after a short warm-up pays more than these rows, measured in a probe's later
    run.) The first op at each query count q > 1 (a TightLLM recompute of a new length) adds the profile's
    ('capture', 'new_q:PART') row (``costmodel.new_q_capture_seconds``)."""
    gq = plan.graph_q_tokens
    if not gq or not hw.op_times or costmodel.op_table(hw, plan.model, "capture", "first") is None:
        return {}
    seen, seen_q, out = set(), set(), {}
    eager = costmodel.eager_graph_shapes(plan)
    for i, r in enumerate(rows):
        if r[0] != "compute":
            continue
        kw = r[6]
        part, q = kw.get("part", ""), kw.get("q_tokens", 0)
        if not costmodel.op_graphed("compute", part, q, r[2], gq, eager):
            continue
        key = (part, q, r[4], r[5] if part in ("layer", "attn_layer") else -1)
        if key in seen:
            continue
        n_rows = kw.get("num_seqs", 0) * q
        t = costmodel.capture_extra_seconds(plan.model, hw, part, n_rows, not seen, q_tokens=q)
        if q > 1 and (part, q) not in seen_q:  # the run's first op at this query count (TightLLM's recompute)
            t += costmodel.new_q_capture_seconds(plan.model, hw, part, n_rows)
        seen.add(key)
        seen_q.add((part, q))
        if t:
            out[i] = t
    return out


class _Clock:
    """The GPU clock's response to load (``costmodel.clock_model``) as both engines apply it: each GPU's busy share
    (its compute stream's moving average, brought up to date at every compute op's start) sets the rate of the
    compute-bound part of the op that starts (``clocked``: its seconds at the sustained rate, as priced). None where
    the profile has no clock rows: every op at its price, as before."""

    def __init__(self, plan: Plan, hw: HardwareSpec, comp: Compression):
        self.model = costmodel.clock_model(hw, plan.model)
        self.hw, self.comp, self.quant_impl, self.llm = hw, comp, plan.quant_impl, plan.model
        self.state: dict = {}  # GPU (its compute stream) -> [busy share, when last brought up to date, busy until]

    @classmethod
    def of(cls, plan: Plan, hw: HardwareSpec, comp: Compression) -> "_Clock | None":
        """The clock for ``plan`` on ``hw``, or None where the profile has no clock rows."""
        clock = cls(plan, hw, comp)
        return clock if clock.model is not None else None

    def clocked(self, op, seconds: float) -> float:
        """The part of a compute op's ``seconds`` that follows the clock: all of it but its compression passes, for
        an op of more rows than the ridge point (``costmodel.clock_bound``); 0 for any other."""
        if op.kind != "compute" or not costmodel.clock_bound(self.hw, op.num_seqs * op.q_tokens):
            return 0.0
        if self.comp is NO_COMPRESSION:
            return seconds
        return seconds - costmodel.quant_seconds(self.llm, self.hw, op.part, op.num_seqs, op.q_tokens,
                                                 op.ctx_tokens, self.comp, self.quant_impl)

    def start(self, gpu, now: float, seconds: float, clocked: float) -> float:
        """A compute op starting at ``now`` on ``gpu``'s compute stream, priced ``seconds`` of which ``clocked``
        follow the clock: its duration at the clock its GPU's busy share gives now."""
        st = self.state.get(gpu)
        if st is None:
            st = self.state[gpu] = [0.0, 0.0, 0.0]  # idle since the run's start
        u, t0, busy_end = st
        w = self.model.window_s
        u = costmodel.ClockModel.advance(u, max(0.0, min(busy_end, now) - t0), now - max(busy_end, t0), w)
        if clocked:
            seconds += clocked * (1.0 / self.model.speedup(u) - 1.0)
        st[0], st[1], st[2] = u, now, now + seconds
        return seconds


class _KindOnly:
    """Stands for an op where a cost function reads only its kind, part, query length, phase, tensor, bytes and
    sequences (``costmodel.issue_seconds``)."""

    __slots__ = ("kind", "part", "q_tokens", "phase", "tensor", "nbytes", "num_seqs", "pinned")

    def __init__(self, kind: str, part: str = "", q_tokens: int = 0, phase: str = "", tensor: str = "",
                 nbytes: int = 0, num_seqs: int = 1, pinned: bool = True):
        self.kind, self.part, self.q_tokens, self.phase = kind, part, q_tokens, phase
        self.tensor, self.nbytes, self.num_seqs, self.pinned = tensor, nbytes, num_seqs, pinned


def simulate(plan: Plan, hw: HardwareSpec, check_memory: bool = True) -> Trace:
    """Run ``plan`` on ``hw``; return the predicted Trace. With ``check_memory`` a tier that overflows its
    capacity under this timing raises OffsimError naming the op and the shortfall."""
    # The cyclic garbage collector is paused while the loop runs: it makes no reference cycles, and with the
    # ~10^6 live objects of a large plan each of the collector's full passes costs ~50 ms, so a run of
    # OPT-175B's plan paid ~0.3 s for passes that free nothing.
    if plan.num_devices // plan.num_nodes > 1 and hw.link_concurrent_fraction < 1:
        # every GPU of a pipeline streams over its link at the same time, and a host does not feed all its links at
        # full rate at once (``HardwareSpec.link_concurrent_fraction``, measured): each link at its measured share.
        # Only among the GPUs of one host: with one GPU per node every link is its host's alone
        hw = hw.scaled_link(hw.link_concurrent_fraction)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(plan, hw, check_memory)
    finally:
        if was_enabled:
            gc.enable()


def _simulate(plan: Plan, hw: HardwareSpec, check_memory: bool) -> Trace:
    model = plan.model
    ops = plan.ops
    rows = op_rows(ops)
    n = len(rows)
    gather = plan.weight_gather_copies  # device copies after each weight copy (DeepSpeed's gather)
    comp = Compression.from_settings(plan.settings)  # 4-bit passes and sparse attention of compute ops
    op_price = _op_pricer(plan, model, hw)
    from_builder = getattr(ops, "rows", None) is not None

    def op_at(i: int):  # the Op itself, for a cost function's duplex price and for messages
        return _op_from_row(i, rows[i]) if from_builder else ops[i]

    # ---- per op: stream, memory, and its duration when the link is not shared (cached by what prices it) ------
    kind_stream = _KIND_STREAM_INDEX
    kidx = None  # each op's kind as its index in ALL_KINDS (the builder's rows): the trace's kind column takes it
    if from_builder:  # (the builder's rows hold neither id nor stream: both follow from position and kind)
        kind_index = _KIND_INDEX
        kidx = np.fromiter(map(kind_index.__getitem__, map(itemgetter(0), rows)), dtype=np.intp, count=n)
        sname = _KIND_STREAM_CODES[kidx]
        sidx = sname.tolist()
    else:  # an Op list (a loaded plan): the engine indexes ops by position and runs each on its stream
        sidx = []
        for i, r in enumerate(rows):
            kw = r[6]
            if kw.get("id", i) != i:
                raise PlanError(f"op at position {i} has id {kw['id']}: ids must be 0..n-1 in plan order")
            st = kw.get("stream")
            sidx.append(kind_stream[r[0]] if not st else _STREAM_INDEX[st])
        sname = np.asarray(sidx, dtype=np.intp)
    # several GPUs: each op's device, and its stream -- stream s of device d is s + d * ns_local. The host's shared
    # streams (cpu, disk) are one resource per node for all its devices ("servers", at the index of the node's first
    # device): each device's host ops run in its own plan order, and a node's server runs one of them at a time, in
    # the order they became ready (offexec runs a process per GPU; its ranks share the host's cores and its disk).
    # Before 2026-12-04 they were one stream in plan order for all stages, so a stage's CPU attention waited behind
    # the other stages' earlier-planned ops even when its own were ready: pipelines with CPU attention or disk KV
    # ran slower on more GPUs (OPT-30B on the T4 preset with CPU attention: 125 s on 1 GPU, 208 s on 4)
    ndev = plan.num_devices
    multi = ndev > 1
    nodes = plan.num_nodes > 1  # several hosts: host memory, disk space and the host streams per node
    ns_local = len(ALL_STREAMS)
    stream_name_idx = sidx  # (what the trace's stream column shows)
    odev = onode = server_of = None
    if multi:
        odev = [r[6].get("device", 0) for r in rows]
        node_of = [plan.node_of_device(d) for d in range(ndev)]
        host_dev = [node_of.index(node_of[d]) for d in range(ndev)]  # each device's node's first device
        shared = _SHARED_INDEX
        sidx = [s + ns_local * d for s, d in zip(sidx, odev)]
        server_of = [-1] * (ns_local * ndev)  # a device's shared host stream -> its node's server
        for d in range(ndev):
            for s_ in shared:
                server_of[s_ + ns_local * d] = s_ + ns_local * host_dev[d]
        if nodes:
            onode = [node_of[d] for d in odev]
    # each op's duration when the link is not shared, cached by what prices it
    cache: dict[tuple, float] = {}

    def price(i: int, r: tuple) -> float:
        kind = r[0]
        get = r[6].get
        nb = get("nbytes", 0)
        # what op_seconds reads: a compute op's shape, a copy's size and memory kind, a disk op's size
        if kind == "compute" or kind == "cpu_compute":
            key = (kind, get("part", ""), get("num_seqs", 0), get("q_tokens", 0), get("ctx_tokens", 0))
        elif nodes and kind == "p2p" and onode[i] != node_of[get("peer", -1)]:
            key = ("network", nb)  # a copy to a GPU of another node: over the network between the hosts
        else:
            key = (kind, nb, get("pinned", True), get("tensor", ""))
        d = cache.get(key)
        if d is None:
            d = cache[key] = costmodel.network_p2p_seconds(hw, nb) if key[0] == "network" else \
                op_price(op_at(i))
        return d

    # memory, bytes and duration per op (an alloc or a free of (0, 0, 0), counted as given, changes nothing)
    if from_builder and not nodes:
        # a block schedule's rows share their fields dicts (``PlanBuilder.add_row``): ~450 distinct (kind, fields
        # dict) pairs in OPT-175B's 3·10^5 ops. Each pair's alloc, free, bytes and duration are read once, at its
        # first op (so each price is that of the first op of its ``cache`` key, as op by op), and handed to its ops
        # by numpy: ~25 ms less than reading them op by op for OPT-175B. (Over several nodes a p2p op's price depends
        # on its device's node, not on its fields alone: op by op, below)
        pair = np.fromiter(map(id, map(itemgetter(6), rows)), dtype=np.uint64, count=n)
        pair *= len(ALL_KINDS)
        pair += kidx.astype(np.uint64)
        codes = pd.factorize(pair)[0]  # (numbered in order of first appearance)
        firsts = np.flatnonzero(np.diff(np.maximum.accumulate(codes), prepend=-1)).tolist()
        per_pair = np.empty((4, len(firsts)), dtype=object)  # (object: each value as it is, int, float or tuple)
        for g, j in enumerate(firsts):
            r = rows[j]
            get = r[6].get
            per_pair[0, g], per_pair[1, g], per_pair[2, g] = get("alloc"), get("free"), get("nbytes", 0)
            per_pair[3, g] = price(j, r)
        allocs, frees, nbytes, dur0 = (x[codes].tolist() for x in per_pair)
    else:
        fields = list(map(itemgetter(6), rows))
        allocs = list(map(dict.get, fields, repeat("alloc")))
        frees = list(map(dict.get, fields, repeat("free")))
        nbytes = list(map(dict.get, fields, repeat("nbytes"), repeat(0)))
        # an op whose kind and fields dict an earlier op had takes that op's duration as it is, without reading its
        # fields again (a loaded plan's ops have a dict each; over several nodes a p2p op is priced by its node)
        dur0 = [0.0] * n
        seen: dict[int, tuple[str, float]] = {}  # id(fields) -> (kind, duration) of the last op with those fields
        for i, r in enumerate(rows):
            kind = r[0]
            kw = r[6]
            x = seen.get(id(kw))
            if x is not None and x[0] == kind:
                dur0[i] = x[1]
                continue
            d = dur0[i] = price(i, r)
            if kind != "p2p":  # (a p2p op's price depends on its device's node, not on its fields alone)
                seen[id(kw)] = (kind, d)
    # a copy that starts while the opposite direction is busy is priced for the overlap: ``op_seconds`` with that
    # overlap is ``duplex_seconds`` at the copy's full rate, looked up once per copy shape (the key of ``cache``)
    # rather than making the op and pricing it from scratch at every overlap (~10^4 of them in OPT-175B's plan)
    duplex_seconds = costmodel.duplex_seconds
    rates: dict[tuple, tuple[float, float] | None] = {}
    rate_seen: dict[int, tuple] = {}  # id(fields) -> (kind, rate) of the last copy with those fields (as ``seen``)

    def duplex_rate(i: int) -> tuple[float, float] | None:
        """(full rate, seconds the copy's stream spends after it: DeepSpeed's gather copies of a weight) or None."""
        r = rows[i]
        kw = r[6]
        y = rate_seen.get(id(kw))
        if y is not None and y[0] == r[0]:
            return y[1]
        get = kw.get
        key = (r[0], get("nbytes", 0), get("pinned", True), get("tensor", ""))
        x = rates.get(key, rates)
        if x is rates:
            op = op_at(i)
            bw = costmodel.duplex_rate(op, model, hw, plan.pageable_copy, comp)
            extra = costmodel.gather_seconds(hw, op.nbytes, gather) \
                if gather and op.kind == "h2d" and getattr(op, "tensor", "") == "weight" else 0.0
            x = rates[key] = None if bw is None else (bw, extra)
        rate_seen[id(kw)] = (r[0], x)
        return x

    # the clock under the power cap, where the profile measured its response to load (``_Clock``): each compute
    # op's seconds that follow it, from its price (before a capture's extra is added below)
    clock = _Clock.of(plan, hw, comp)
    clk = None
    if clock is not None:
        clk_of: dict[int, float] = {}  # id(fields) -> the clocked seconds of ops with those fields (as ``seen``)
        clk = [0.0] * n
        for i, r in enumerate(rows):
            if r[0] == "compute":
                c = clk_of.get(id(r[6]))
                clk[i] = clk_of[id(r[6])] = clock.clocked(op_at(i), dur0[i]) if c is None else c
    # graphed ops offexec captures where they first run: host work (the issuing thread runs the static body's
    # launches and records the graph), so with a runtime that has issue costs it is issue time; else op time
    captures = _capture_extras(plan, rows, hw)
    priced = _prices_issue(hw)
    if not priced:
        for i, extra in captures.items():
            dur0[i] += extra
        captures = {}
    # each stream's ops in plan order (numpy: a tenth of the time of appending op by op)
    sarr = np.asarray(sidx, dtype=np.intp) if multi else sname
    ns = ns_local * ndev
    stream_ops = [np.flatnonzero(sarr == s) for s in range(ns)]
    # (as lists: the queues of the stream-order issuer, the only one that reads them)
    by_stream: list[list[int]] | None = [b.tolist() for b in stream_ops] if STREAM_ORDER_ISSUE and priced else None
    deps_of = list(map(itemgetter(1), rows))

    # the host issues ops one after another in plan order (a single issuing thread); an op cannot start before
    # it is issued. With an ideal runtime (zero issue cost) this is a no-op.
    issued = None
    gate_s = None
    costs = None
    # the runtime's window (None: none). Pipeline plans: each device's issuer runs ahead unbounded (its window is
    # not modelled yet)
    # (an op without a window op has ``n``, an op that has always ended: ``end[n]``)
    pred = None if multi else _window_preds(plan.run_ahead, sname, _STREAM_INDEX, none=n)
    if priced:
        graph_q = plan.graph_q_tokens
        compute_s = costmodel.issue_seconds(_KindOnly("compute"), hw)
        graph_s = costmodel.issue_seconds(_KindOnly("compute", "layer", 1, "decode"), hw, graph_q)
        relay = plan.pageable_copy == "relay"
        copy_s: dict[tuple, float] = {}  # (kind, tensor, bytes, pinned) -> a copy's issue cost (its handler's row)

        def copy_issue(r) -> float:
            k = (r[0], r[6].get("tensor", ""), r[6].get("nbytes", 0), r[6].get("pinned", True))
            c = copy_s.get(k)
            if c is None:
                c = copy_s[k] = costmodel.issue_seconds(_KindOnly(k[0], tensor=k[1], nbytes=k[2], pinned=k[3]), hw, 0,
                                                        model, relay)
            return c

        part_rows = any(m == "issue" and ":" in part for _, m, part, _ in (hw.op_times or ()))
        comp_s: dict[tuple, float] = {}  # (part, q, phase, sequences) -> a compute op's cost (its part's row)

        eager = costmodel.eager_graph_shapes(plan)  # shapes run eagerly (``Plan.graph_min_uses``)

        def compute_issue(r) -> float:
            g = r[6].get
            k = (g("part", ""), g("q_tokens", 0), r[2], g("num_seqs", 1))
            c = comp_s.get(k)
            if c is None:
                c = comp_s[k] = costmodel.issue_seconds(_KindOnly("compute", k[0], k[1], k[2], num_seqs=k[3]), hw,
                                                        0 if k[:2] in eager else graph_q, model)
            return c

        if part_rows:  # the profile prices each part's compute ops apart ('issue', 'graph:PART' / 'eager:PART')
            costs = [compute_issue(r) if r[0] == "compute" else copy_issue(r) for r in rows]
        else:
            costs = [(graph_s if costmodel.op_graphed(r[0], r[6].get("part", ""), r[6].get("q_tokens", 0), r[2],
                                                      graph_q, eager)
                      else compute_s) if r[0] == "compute" else copy_issue(r) for r in rows]
        for i, extra in captures.items():  # a capture is host work: the issuing thread records the graph
            costs[i] += extra
        if STREAM_ORDER_ISSUE and pred is not None:
            # a host op is handed to its worker thread, no handler: the issuing loop's own time per op only
            host_idx0 = {_STREAM_INDEX[h] for h in HOST_STREAMS}
            for i, x in enumerate(sidx):
                if x in host_idx0:
                    costs[i] = costmodel.dispatch_seconds(_KindOnly(rows[i][0], num_seqs=rows[i][6].get("num_seqs", 1)),
                                                          hw, model)
        if multi:  # one issuing thread per device (offexec: a process per GPU), each in plan order
            dev_arr = np.asarray(odev, dtype=np.intp)
            carr = np.asarray(costs, dtype=float)
            issued_arr = np.zeros(n)
            for d in range(ndev):
                mask = dev_arr == d
                issued_arr[mask] = np.cumsum(carr[mask])
            issued = issued_arr.tolist()
        elif pred is None:  # no window: op i is issued at the sum of the costs up to it
            issued = np.cumsum(costs).tolist()
        host_idx = {_STREAM_INDEX[h] for h in HOST_STREAMS}
        is_host = [x in host_idx for x in stream_name_idx]
        blocks = _blocks_issue(plan, is_host)
        gate_s = _host_gates(is_host, blocks, [r[1] for r in rows], lambda i: costmodel.issue_seconds(
            _KindOnly(rows[i][0], rows[i][6].get("part", ""), rows[i][6].get("q_tokens", 0), rows[i][2],
                      rows[i][6].get("tensor", ""), rows[i][6].get("nbytes", 0), rows[i][6].get("num_seqs", 1),
                      rows[i][6].get("pinned", True)),
            hw, graph_q, model, relay))
        gated = [False] * ns  # the stream's next op waits out its host gate (scheduled once)

    start = [0.0] * n
    # None until the op has finished (what a dependency waits on); ``end[n]`` is the window op of an op without one
    # (``pred``), which has always ended: the issuer tests ``end[pred[i]] is None`` alone
    end: list = [None] * n + [0.0]
    # memory per tier (gpu, cpu, disk) and its peaks as locals: the loop touches them for most ops
    mem_g, mem_c, mem_d = (plan.resident.get(t, 0) for t in TIERS)
    peak_g, peak_c, peak_d = mem_g, mem_c, mem_d
    cap_g, cap_c, cap_d = (plan.capacity.get(t, 0) for t in TIERS)
    if multi:  # GPU memory per device (mem_g, peak_g, cap_g unused)
        gmem = [int(st["gpu_resident"]) for st in plan.stages]
        gpeak = list(gmem)
        gcap = [int(st["gpu_capacity"]) for st in plan.stages]
    if nodes:  # host memory and disk space per node (mem_c, mem_d, their peaks and caps unused)
        nmem = [[int(x["cpu_resident"]), int(x["disk_resident"])] for x in plan.nodes]
        npeak = [list(m) for m in nmem]
        ncap = [[int(x["cpu_capacity"]), int(x["disk_capacity"])] for x in plan.nodes]

    def overflow(i: int, now: float, t: int, m: int) -> OffsimError:
        cap = (gcap[odev[i]] if multi else cap_g, cap_c, cap_d)[t]
        what = f"GPU {odev[i]}'s gpu" if multi and t == 0 else TIERS[t]
        if nodes and t:
            cap, what = ncap[onode[i]][t - 1], f"node {onode[i]}'s {TIERS[t]}"
        return OffsimError(f"{op_at(i).describe()} at t={now:.4f}s: {what} memory reaches {m} bytes, over the "
                           f"capacity {cap} by {m - cap} bytes")

    # per stream, until when it is busy; the last entry, never busy, is the opposite direction of a stream that has
    # none (``other_of``): an op's start tests ``busy_until[other_of[s]] > now`` alone
    busy_until = [0.0] * ns + [-math.inf]
    on_gpu_compute = [r % ns_local == _STREAM_INDEX["compute"] for r in range(ns)]  # each GPU's compute stream
    other_of = [o + (r // ns_local) * ns_local if (o := _OTHER_INDEX[r % ns_local]) >= 0 else ns
                for r in range(ns)]
    # per op, the streams waiting for it to end, in the order they started waiting (None: none). A list indexed by op
    # rather than a dict: every op's end looks here, and an op that has ended is never waited for again
    waiting: list[list[int] | None] = [None] * n
    # each stream's current op (the one it runs or waits to start; -1 when it has none left); ``next_on[i]``: the op
    # after i on its stream (-1 for the last)
    cur = [int(b[0]) if len(b) else -1 for b in stream_ops]
    next_on = np.full(n, -1, dtype=np.intp)
    for b in stream_ops:  # (as arrays: the lists would be converted back)
        next_on[b[:-1]] = b[1:]
    next_on = next_on.tolist()
    # per stream, the op whose issue it has checked (-1: none yet): the issue times and the stream-order issuer check
    # an op once, whatever resumes its stream after (none is checked where nothing is issued: no issue costs, no window;
    # the plain issuer's ``i >= iss_i`` needs no record)
    issue_checked = [-1] * ns
    itself = [[s] for s in range(ns)]  # what a stream's own event resumes: itself
    ends = [[~s] for s in range(ns)]  # ... and the event of its op's end (~s: the loop tells the two apart)
    # the event queue: (time, sequence number, streams to resume), taken in time order, then in the order the events
    # were scheduled (SimPy's order): a stream's own event (its op ends, or it is issued) resumes it; an op's end
    # releases the streams waiting for it with an event of its own, scheduled at that instant
    heap: list[tuple] = []
    seq = 0
    # ... except the events scheduled for the current instant (``now``: mostly an op's end releasing its waiters,
    # ~4 of every 10 events in OPT-175B's plan), which wait in ``ready``, first in first out, with neither time nor
    # sequence number, instead of a push and a pop of the heap each. They come in the order SimPy takes them: after
    # the heap's events at ``now`` (scheduled before ``now`` was reached, so with lower sequence numbers) and before
    # any later event -- so every event for ``now`` that is scheduled at ``now`` goes here, never to the heap
    ready = deque()
    ready_put, ready_take = ready.append, ready.popleft
    # the issuer (``simulate_simpy``'s ``issuer``): a virtual stream ``ISS`` walking the ops in plan order, where
    # the plan has a run-ahead window; ops before ``iss_i`` are issued; ``iwaiting``: streams waiting for an issue
    ISS = ns
    itself_iss = [ISS]
    iss_i, iss_busy = 0, False
    iwaiting: dict[int, list[int]] = {}
    # offexec's issuing loop (``Executor``): each stream's ops in plan order; of the streams' next ops, the first in
    # plan order whose dependencies are all issued and whose host dependencies have finished
    iss_done = [False] * n  # issued
    iss_ptr = [0] * ns  # per stream: its next op to issue (an index into ``by_stream``)
    iss_min = 0  # the first op in plan order not issued yet: the answer whenever it is issuable (the usual case)
    iss_cur = -1  # the op chosen, waiting for its window or spending its issue cost
    iss_host_wait = False  # nothing issuable: resumed by the next host op's end
    # (read once: the issuer tests it per op) offexec's issuing loop, where the profile prices issuing; a runtime that
    # issues for free (the presets) keeps the issuer in plan order
    stream_order = STREAM_ORDER_ISSUE and priced
    # the issuer of a runtime that issues for free, in plan order (the presets): only its window holds it back, so
    # it walks ``pred`` straight to the next op whose window op has not ended (``iss_walk``, resumed where it
    # stopped: the op it stopped at is issuable once that op ends) -- ~3·10^5 steps for OPT-175B's plan
    plain_issue = pred is not None and costs is None and not stream_order
    iss_walk = enumerate(pred) if plain_issue else None
    if issued is None and pred is None:
        iss_i = n  # nothing is issued (no issue costs, no window): every op counts as issued, none is checked
    host_codes = {_STREAM_INDEX[h] for h in HOST_STREAMS}
    host_stream = [s_ % ns_local in host_codes for s_ in range(ns)]  # (every device's)
    server_op = [-1] * ns  # per server (``server_of``): the op it runs (or ran last)

    wait_all = plan.issue_waits_for_deps
    # (only the stream-order issuer reads it; sarr: sidx as an array)
    blocks_iss = _blocks_issue(plan, np.isin(sarr % ns_local, list(host_codes)).tolist()) if stream_order else None

    def issuable(o: int) -> bool:
        """Op o's dependencies are all issued, and those on a host stream have finished (offexec's rule; every one
        has, where the runtime waits for all: ``_blocks_issue``)."""
        for d in deps_of[o]:
            if not iss_done[d] or (blocks_iss[d] and end[d] is None):
                return False
        return True
    if pred is not None and n:  # (SimPy creates the issuer's process first)
        heap.append((0.0, seq, itself_iss))
        seq += 1
    for s in range(ns):  # SimPy starts each process with an urgent event at time 0, in creation order
        if len(stream_ops[s]):
            heap.append((0.0, seq, itself[s]))
            seq += 1
    push, pop = heapq.heappush, heapq.heappop

    # The event an op's start schedules (its end) is held back in ``nxt`` until the next pop, which takes it with
    # ``heappushpop``: when it is the earliest event (often) it comes straight back without touching the heap. The
    # events in the heap plus ``nxt`` are the same set at every pop, so the order taken is the same.
    pushpop = heapq.heappushpop
    nxt = None  # (never at ``now``: an op that ends the instant it starts has its end in ``ready``)
    now = 0.0
    while True:
        if ready and (not heap or heap[0][0] > now):
            resumed = ready_take()
        elif nxt is not None:
            now, _, resumed = pushpop(heap, nxt) if heap else nxt
            nxt = None
        elif heap:
            now, _, resumed = pop(heap)
        else:
            break
        for s in resumed:
            if s < 0:  # the op on stream ~s ends now (the event its start scheduled)
                s = ~s
                i = cur[s]
                end[i] = now
                f = frees[i]
                if f is not None:
                    if multi:
                        gmem[odev[i]] -= f[0]
                    else:
                        mem_g -= f[0]
                    if nodes:
                        nm = nmem[onode[i]]
                        nm[0] -= f[1]
                        nm[1] -= f[2]
                    else:
                        mem_c -= f[1]
                        mem_d -= f[2]
                w = waiting[i]
                if w is not None:  # release its waiters
                    ready_put(w)
                if iss_host_wait and (host_stream[s] or wait_all):  # the issuer waits for a host op: rescan
                    iss_host_wait = False
                    ready_put(itself_iss)
                i = cur[s] = next_on[i]
                if i < 0:
                    continue
            elif s == ISS:  # the issuer: after an op's issue cost, or once the op its next op waits for has ended
                if plain_issue:
                    for i, p in iss_walk:
                        if end[p] is None:  # the window is full: wait for the op ``run_ahead`` back
                            break
                    else:
                        i = n
                    iss_i = i
                    if iwaiting:  # release the streams waiting for the ops issued now, in plan order
                        for o in sorted(iwaiting):
                            if o >= i:
                                break
                            ready_put(iwaiting.pop(o))
                    if i < n:
                        w = waiting[p]
                        if w is None:
                            waiting[p] = [ISS]
                        else:
                            w.append(ISS)
                    continue
                while True:
                    if stream_order:  # as offexec's issuing loop picks its next op
                        i = iss_cur
                        if i < 0:
                            while iss_min < n and iss_done[iss_min]:
                                iss_min += 1
                            # the first op not issued heads its stream's queue: when it is issuable no other op
                            # comes before it, so the scan over the streams' next ops is needed only when it is not
                            if iss_min < n and issuable(iss_min):
                                i = iss_min
                            else:
                                for st in range(ns):
                                    b = by_stream[st]
                                    k = iss_ptr[st]
                                    if k < len(b) and (i < 0 or b[k] < i) and issuable(b[k]):
                                        i = b[k]
                                if i < 0:  # every stream's next op waits for a host op (or none is left)
                                    iss_host_wait = any(iss_ptr[st] < len(by_stream[st]) for st in range(ns))
                                    break
                            iss_ptr[sidx[i]] += 1
                            iss_cur = i  # (a host op: no window, ``pred`` is n; its cost is the dispatch time)
                    elif iss_i < n:  # in plan order
                        i = iss_i
                    else:
                        break
                    if iss_busy:  # op i's issue cost is spent
                        iss_busy = False
                    else:
                        p = pred[i]
                        if end[p] is None:  # the window is full: wait for the op ``run_ahead`` back
                            w = waiting[p]
                            if w is None:
                                waiting[p] = [ISS]
                            else:
                                w.append(ISS)
                            break
                        if costs is not None and costs[i] > 0.0:  # (no issue costs: it only waits for its window)
                            iss_busy = True
                            at = now + costs[i]
                            if at > now:
                                push(heap, (at, seq, itself_iss))
                                seq += 1
                            else:  # (a cost too small to move the clock)
                                ready_put(itself_iss)
                            break
                    if stream_order:
                        iss_done[i] = True
                        iss_cur = -1
                    else:
                        iss_i += 1
                    if iwaiting:
                        w = iwaiting.pop(i, None)
                        if w is not None:  # release the stream waiting for it
                            ready_put(w)
                continue
            else:
                i = cur[s]
            # (one test per resumption where the issuer is plain: an op from ``iss_i`` on is not issued yet; with
            # issue times or the stream-order issuer ``iss_i`` stays 0, and each op is checked once below)
            if i >= iss_i and issue_checked[s] != i:
                if plain_issue:  # not issued yet: wait for it
                    w = iwaiting.get(i)
                    if w is None:
                        iwaiting[i] = [s]
                    else:
                        w.append(s)
                    continue
                if issued is not None:
                    issue_checked[s] = i
                    if issued[i] > now:
                        at = now + (issued[i] - now)
                        if at > now:
                            push(heap, (at, seq, itself[s]))
                            seq += 1
                        else:
                            ready_put(itself[s])
                        continue
                else:  # (the issuer with a window)
                    if (not iss_done[i]) if stream_order else i >= iss_i:  # not issued yet: wait for it
                        w = iwaiting.get(i)
                        if w is None:
                            iwaiting[i] = [s]
                        else:
                            w.append(s)
                        continue
                    issue_checked[s] = i
            # wait for each unfinished dependency in turn: resumed when it ends, the stream scans them again from the
            # first (those before it have ended, and an op that has ended stays ended)
            for d in deps_of[i]:
                if end[d] is None:
                    w = waiting[d]
                    if w is None:
                        waiting[d] = [s]
                    else:
                        w.append(s)
                    break
            else:  # none unfinished: the op starts, where its host gate lets it (``for``'s ``else``: a flag tested
                # after the loop was ~3 % of the loop's bytecode)
                if gate_s is not None:
                    if gate_s[i] and not gated[s]:  # issued once its host dependencies are done
                        gate = max(end[d] for d in deps_of[i] if blocks[d]) + gate_s[i]
                        if gate > now:
                            gated[s] = True
                            at = now + (gate - now)
                            if at > now:
                                push(heap, (at, seq, itself[s]))
                                seq += 1
                            else:
                                ready_put(itself[s])
                            continue
                    gated[s] = False
                if server_of is not None and (v := server_of[s]) >= 0:  # a shared host stream: its node's server
                    o = server_op[v]
                    if o >= 0 and end[o] is None:  # busy with another device's op: wait for it, first come first
                        w = waiting[o]
                        if w is None:
                            waiting[o] = [s]
                        else:
                            w.append(s)
                        continue
                    server_op[v] = i
                start[i] = now
                a = allocs[i]
                if a is not None:  # tier by tier, gpu first: an overflow names the first tier over
                    x = a[0]
                    if x:
                        if multi:
                            dv = odev[i]
                            m = gmem[dv] = gmem[dv] + x
                            if m > gpeak[dv]:
                                gpeak[dv] = m
                                if check_memory and m > gcap[dv]:
                                    raise overflow(i, now, 0, m)
                        else:
                            mem_g += x
                            if mem_g > peak_g:
                                peak_g = mem_g
                                if check_memory and mem_g > cap_g:
                                    raise overflow(i, now, 0, mem_g)
                    if nodes:  # (a node's host memory and disk: its own)
                        nd = onode[i]
                        nm, npk = nmem[nd], npeak[nd]
                        for t in (1, 2):
                            x = a[t]
                            if x:
                                m = nm[t - 1] = nm[t - 1] + x
                                if m > npk[t - 1]:
                                    npk[t - 1] = m
                                    if check_memory and m > ncap[nd][t - 1]:
                                        raise overflow(i, now, t, m)
                        a = _NONE
                    x = a[1]
                    if x:
                        mem_c += x
                        if mem_c > peak_c:
                            peak_c = mem_c
                            if check_memory and mem_c > cap_c:
                                raise overflow(i, now, 1, mem_c)
                    x = a[2]
                    if x:
                        mem_d += x
                        if mem_d > peak_d:
                            peak_d = mem_d
                            if check_memory and mem_d > cap_d:
                                raise overflow(i, now, 2, mem_d)
                if busy_until[other_of[s]] > now:  # the opposite direction is busy: priced for the overlap
                    r = duplex_rate(i)
                    dt = dur0[i] if r is None else \
                        duplex_seconds(hw, nbytes[i], r[0], busy_until[other_of[s]] - now) + r[1]
                else:
                    dt = dur0[i]
                    if clock is not None and on_gpu_compute[s]:  # (the clock's state; a clock-bound op's rate)
                        dt = clock.start(s, now, dt, clk[i])
                at = busy_until[s] = now + dt
                if at > now:
                    if nxt is not None:
                        push(heap, nxt)
                    nxt = (at, seq, ends[s])
                    seq += 1
                else:  # it ends the instant it starts
                    ready_put(ends[s])

    end.pop()  # (``end[n]``)
    if None in end:
        stuck = end.index(None)
        raise OffsimError(f"{op_at(stuck).describe()} never ran: it waits on an op that is behind it on its own "
                          "stream (deadlock in the plan)")
    if nodes:
        peak_c, peak_d = max(p[0] for p in npeak), max(p[1] for p in npeak)
    peak = (max(gpeak) if multi else peak_g, peak_c, peak_d)
    meta = {"model": model.name, "hardware": hw.name, "policy": plan.policy, "workload": plan.workload.to_dict(),
            "settings": plan.settings, "derived": plan.derived,
            "source": "offsim"}
    if plan.disk_cached:
        meta["disk_cached"] = True
    peak_bytes = {t: int(peak[i]) for i, t in enumerate(TIERS)}
    if multi:
        meta["num_devices"] = ndev
        peak_bytes.update({f"gpu{d}": int(p) for d, p in enumerate(gpeak)})
    if nodes:
        meta["num_nodes"] = plan.num_nodes
        for n, (pc, pd_) in enumerate(npeak):
            peak_bytes[f"cpu{n}"], peak_bytes[f"disk{n}"] = int(pc), int(pd_)
    df = _trace_frame(rows, kidx, sname, nbytes, start, end)
    if multi:
        df["device"] = np.asarray(odev, dtype=np.int64)
    return Trace(df=df, meta=meta, peak_bytes=peak_bytes)


def _names(names: tuple[str, ...], codes: np.ndarray):
    """The column pandas makes of the list ``[names[c] for c in codes]`` (its dtype for strings: ``str`` since pandas
    3, ``object`` before), taken from the few names: making a string column out of 10^5 Python strings costs ~20 ns
    a string, taking from a few ~1 ns."""
    return pd.Series(list(names)).array.take(codes)


def _trace_frame(rows: list[tuple], kidx: np.ndarray | None, sidx: np.ndarray, nbytes: list[int],
                 start: list[float], end: list[float]) -> pd.DataFrame:
    """The trace table (``trace.COLUMNS``, with the dtypes of ``Trace.from_arrays``) from the plan's rows, each op's
    kind index in ``ALL_KINDS`` (None: read the kinds from the rows) and stream index in ``ALL_STREAMS``."""
    n = len(rows)
    if not n:  # (an empty plan: the columns as pandas makes them from empty lists)
        kinds, streams = [], []
    else:
        kinds = [r[0] for r in rows] if kidx is None else _names(ALL_KINDS, kidx)
        streams = _names(ALL_STREAMS, sidx)
    # one pass per column (``map(itemgetter)``): a third of the time of transposing a tuple per row with zip(*...).
    # ``copy=False``: every column is a new array made here, which the frame may keep as it is (copying them into
    # consolidated blocks took ~10 ms for OPT-175B's plan)
    df = pd.DataFrame({
        "op_id": np.arange(n), "kind": kinds, "stream": streams, "phase": list(map(itemgetter(2), rows)),
        "step": np.fromiter(map(itemgetter(3), rows), dtype=np.int64, count=n),
        "layer": np.fromiter(map(itemgetter(4), rows), dtype=np.int64, count=n),
        "batch": np.fromiter(map(itemgetter(5), rows), dtype=np.int64, count=n),
        "start_s": np.fromiter(start, dtype=float, count=n), "end_s": np.fromiter(end, dtype=float, count=n),
        "nbytes": np.asarray(nbytes, dtype=np.int64)}, copy=False)
    return df[COLUMNS]
