"""FlexGen's sub-layer streaming against whole layers on the GPU: the same placements (OPT-6.7B, prompt 512, gen 32,
16 x 2; GPU attention at 12 GiB, CPU attention at 10 GiB), each run with its warm-up under the allocator cap; one
JSON line per run (predicted and measured GPU peak and throughput), then one comparing the two runs: whether their
tokens are equal, and their logits at every step whose inputs were still identical (all earlier tokens of the batch
equal): the largest absolute difference against the logits' spread.

    python -m experiments.memory.sublayer_check     # on the GPU machine; results/memory/sublayer_h200.jsonl
"""
import json

import torch

from offsim import Workload, build_plan, get_hardware, get_model, simulate
from offexec.executor import run_plan
from offexec.weights import random_weights


def run() -> None:
    m = get_model("opt-6.7b")
    w = random_weights(m, 0, torch.float16, device="cuda", pinned=True, progress=False)
    for budget, pct, ca, gbs, nb in ((12, (20, 80, 0, 100, 100, 0), False, 16, 2), (10, (0, 100, 0, 100, 100, 0), True, 16, 2)):
        hw = get_hardware("results/profiles/h200_offexec.json", budget)
        wl = Workload(512, 32, gbs, nb)
        toks, lgs = {}, {}
        for sub in (False, True):
            st = {"percent": pct, "cpu_attention": ca, "sublayer": sub}
            plan = build_plan("flexgen", m, hw, wl, st)
            pred = simulate(plan, hw).metrics()
            warm = build_plan("flexgen", m, hw, wl.with_(gen_len=2), st)
            run_plan(warm, w, "cuda", gpu_budget_bytes=int(hw.gpu_mem_bytes))
            r = run_plan(plan, w, "cuda", gpu_budget_bytes=int(hw.gpu_mem_bytes), record_logits=True)
            mm = r.trace.metrics()
            toks[sub] = r.tokens
            lgs[sub] = {(st_, b): lg for st_, b, lg in r.logits}
            print(json.dumps({"budget": budget, "cpu_attention": ca, "sublayer": sub, "pred_peak_gib": pred["peak_gpu_bytes"] / 2**30,
                              "meas_peak_gib": r.stats["gpu_max_reserved_bytes"] / 2**30, "pred_decode": pred["decode_tok_s"],
                              "meas_decode": mm["decode_tok_s"], "pred_total": pred["total_tok_s"], "meas_total": mm["total_tok_s"],
                              "issue_frac": r.stats["issue_frac"]}), flush=True)
        print(json.dumps({"tokens_equal": bool((toks[False] == toks[True]).all()), "budget": budget,
                          **compare_logits(toks[False], toks[True], lgs[False], lgs[True], gbs)}), flush=True)


def compare_logits(tok_a, tok_b, lg_a: dict, lg_b: dict, gbs: int) -> dict:
    """Two runs' tokens [n, gen] and logits {(step, batch): [gbs, V]}: token agreement, and the logits of every
    (step, batch) whose inputs were identical in both runs (no earlier token of the batch differed)."""
    same = tok_a == tok_b  # [n, gen]
    worst, spread, compared = 0.0, 0.0, 0
    for (step, b), a in lg_a.items():
        if not same[b * gbs:(b + 1) * gbs, :step].all():
            continue
        d = (a - lg_b[(step, b)]).abs().max().item()
        worst, spread, compared = max(worst, d), max(spread, a.std().item()), compared + 1
    return {"token_agreement": float(same.mean()), "logit_steps_compared": compared, "logit_steps": len(lg_a),
            "logit_max_abs_diff": worst, "logit_std": spread}




def report(path: str) -> str:
    """A markdown table of a run's records (``python -m experiments.memory.sublayer_check --report FILE``)."""
    rows, eq = [], {}
    cmp = ["| budget GiB | token agreement | (step, batch) logits with identical inputs | largest logit difference "
           "| logit std |", "| --- | --- | --- | --- | --- |"]
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        r = json.loads(line)
        if "tokens_equal" in r:
            eq[r["budget"]] = r["tokens_equal"]
            if "token_agreement" in r:
                cmp.append(f"| {r['budget']} | {r['token_agreement']:.1%} | {r['logit_steps_compared']} of "
                           f"{r['logit_steps']} | {r['logit_max_abs_diff']:.3g} | {r['logit_std']:.3g} |")
        else:
            rows.append(r)
    out = ["| budget GiB | CPU attention | streaming | predicted peak GiB | measured peak GiB | predicted decode tok/s "
           "| measured decode tok/s | tokens equal to the other streaming |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['budget']} | {'yes' if r['cpu_attention'] else 'no'} | "
                   f"{'sub-layers' if r['sublayer'] else 'whole layers'} | {r['pred_peak_gib']:.2f} | "
                   f"{r['meas_peak_gib']:.2f} | {r['pred_decode']:.1f} | {r['meas_decode']:.1f} | "
                   f"{'yes' if eq.get(r['budget']) else 'no'} |")
    return "\n".join(out + ([""] + cmp if len(cmp) > 2 else []))


if __name__ == "__main__":
    from experiments.common import argparser

    ap = argparser(__doc__)
    ap.add_argument("--report", metavar="JSONL", help="print the tables of a run's JSON lines instead of running")
    args = ap.parse_args()
    if args.report:
        print(report(args.report))
    else:
        run()
