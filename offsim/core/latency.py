"""What a user of a run sees, from a trace's metrics (``Trace.metrics``): time to first token, decode latency per
token and the stream that limits throughput. One place for these, read by ``offsim simulate``/``compare`` and by
the sweep's table (``offsim.search.grid``)."""
from __future__ import annotations

from offsim.core.plan import STREAMS, Plan
from offsim.core.sim import issue_costs
from offsim.core.specs import HardwareSpec


def latency_and_bottleneck(m: dict) -> dict:
    """Latency a user sees and the stream that limits throughput, from a trace's metrics.

    ``ttft_s``: time to first token = the prefill time (prefill emits each prompt's first token; the block's
    prompts go through the last layer together). ``decode_ms_per_token``: one decode step, i.e. the time between
    two tokens of a sequence (every sequence of the block gains one token per step). ``bottleneck_stream``: the
    stream busiest over the makespan (busy_<stream>_s / total_s, ``Trace.metrics``), with that fraction.
    ``cpu_decode_frac``: the host CPU stream's busy time (CPU attention, which runs in decode only) over the decode's
    time -- how much of a prediction rests on the profile's CPU rows (``offsim.cli.host_bound_note``)."""
    steps = m["gen_len"] - 1
    busy = {s: m.get(f"busy_{s}_s", 0.0) / m["total_s"] if m["total_s"] > 0 else 0.0 for s in STREAMS}
    worst = max(busy, key=busy.get)
    return {"ttft_s": m["prefill_s"], "decode_ms_per_token": 1e3 * m["decode_s"] / steps if steps else None,
            "bottleneck_stream": worst, "bottleneck_busy_frac": busy[worst],
            "cpu_decode_frac": m.get("busy_cpu_s", 0.0) / m["decode_s"] if m.get("decode_s") else 0.0}


def host_issue_share(plan: Plan, hw: HardwareSpec, m: dict) -> dict:
    """``host_issue_decode_frac``: the runtime's issuing thread's priced time over the decode ops (``sim.issue_costs``:
    the profile's issue rows and the CUDA-graph captures the simulator adds) over the decode's predicted time -- how
    much of a prediction rests on the host's single-thread speed (``offsim.cli.host_bound_note``). {} where the
    profile prices no issue (an ideal runtime) or the plan has no decode."""
    costs = issue_costs(plan, hw, captures=True)
    if costs is None or not m.get("decode_s"):
        return {}
    busy = sum(c for c, op in zip(costs, plan.ops) if op.phase == "decode")
    return {"host_issue_decode_frac": busy / m["decode_s"]}
