"""Shared by the Select-N experiments (experiments/selectn/): one simulated block's SLO metrics, and FlexGen at its
best for a fixed batch (the baseline every Select-N figure compares with)."""
from __future__ import annotations

from offsim import OffsimError, build_plan, simulate


def trace_row(tr, plan) -> dict:
    """TTFT, TPOT and throughput of a simulated block."""
    m = tr.metrics()
    sl = tr.step_latency()
    tpot = sl.loc[sl["step"] >= 1, "latency_s"]
    return {"ttft_s": m["prefill_s"], "tpot_mean_s": float(tpot.mean()), "tpot_max_s": float(tpot.max()),
            "total_tok_s": m["total_tok_s"], "decode_tok_s": m["decode_tok_s"], "peak_gpu_bytes": m["peak_gpu_bytes"],
            "host_weight_bytes": sum(c for _, c in plan.weight_split)}


def run_flexgen(model, hw, wl, top: int = 3) -> dict:
    """FlexGen at its best for ``wl``'s batch: the ``top`` best LP optima over every block shape with that many
    sequences (each with its activations on either tier), as the search makes them (``flexgen.candidates``: the
    GPU weight share trimmed until the placement fits by the footprint's exact arithmetic), simulated; the
    fastest."""
    from itertools import islice

    from offsim.policies.flexgen import candidates

    b = wl.gpu_batch_size
    # best LP time first, two per optimum: the rest are never fitted (each fit builds schedules)
    cands = list(islice(candidates(model, hw, wl.prompt_len, wl.gen_len, batch=b), 2 * top))
    best, errors = None, []
    for st, cwl, _ in cands:
        try:
            plan = build_plan("flexgen", model, hw, cwl, st)
            row = trace_row(simulate(plan, hw), plan)
        except OffsimError as e:
            errors.append(str(e))
            continue
        row["settings"] = (f"gbs {cwl.gpu_batch_size} x {cwl.num_gpu_batches}, percent {list(st['percent'])}, "
                           f"cpu_attention {st['cpu_attention']}")
        if best is None or row["total_tok_s"] > best["total_tok_s"]:
            best = row
    if best is None:
        raise OffsimError(errors[0] if errors else "no FlexGen placement fits (LP infeasible for every block shape)")
    return best
