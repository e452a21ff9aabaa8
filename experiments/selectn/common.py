"""Shared by the Select-N experiments (experiments/selectn/): one simulated block's SLO metrics, and FlexGen at its
best for a fixed batch (the baseline every Select-N figure compares with)."""
from __future__ import annotations

from offsim import OffsimError, Workload, build_plan, simulate


def trace_row(tr, plan) -> dict:
    """TTFT, TPOT and throughput of a simulated block."""
    m = tr.metrics()
    sl = tr.step_latency()
    tpot = sl.loc[sl["step"] >= 1, "latency_s"]
    return {"ttft_s": m["prefill_s"], "tpot_mean_s": float(tpot.mean()), "tpot_max_s": float(tpot.max()),
            "total_tok_s": m["total_tok_s"], "decode_tok_s": m["decode_tok_s"], "peak_gpu_bytes": m["peak_gpu_bytes"],
            "host_weight_bytes": sum(c for _, c in plan.weight_split)}


def run_flexgen(model, hw, wl, top: int = 3) -> dict:
    from offsim.policies.lp import flexgen_lp

    b = wl.gpu_batch_size
    cands = []
    for nb in [d for d in range(1, b + 1) if b % d == 0]:
        for ca in (False, True):
            r = flexgen_lp(model, hw, wl.prompt_len, wl.gen_len, b // nb, nb, ca)
            if r is not None:
                cands.append(r)
    cands.sort(key=lambda r: r.seconds_per_token)
    best, errors = None, []
    for r in cands[:top]:
        st = {"percent": r.percent, "cpu_attention": r.cpu_attention}
        try:
            plan = build_plan("flexgen", model, hw, Workload(wl.prompt_len, wl.gen_len, r.gpu_batch_size,
                                                             r.num_gpu_batches), st)
            row = trace_row(simulate(plan, hw), plan)
        except OffsimError as e:
            errors.append(str(e))
            continue
        row["settings"] = (f"gbs {r.gpu_batch_size} x {r.num_gpu_batches}, percent {list(r.percent)}, "
                           f"cpu_attention {r.cpu_attention}")
        if best is None or row["total_tok_s"] > best["total_tok_s"]:
            best = row
    if best is None:
        raise OffsimError(errors[0] if errors else "no FlexGen placement fits (LP infeasible for every block shape)")
    return best
