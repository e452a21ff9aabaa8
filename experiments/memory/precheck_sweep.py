"""The plan as a memory contract, by arithmetic alone (no GPU): every plan offsim builds over a grid of policies,
settings, models, workloads, blockings, GPU budgets and placements, set against offexec's budget pre-check
(``offexec.executor.gpu_need``, what refuses a plan before any weight is made). A plan offsim builds that offexec's
count puts over its budget is a broken contract: printed with its sizes, counted, and the exit status is 1.

    python -m experiments.memory.precheck_sweep [--hardware results/profiles/h200_offexec_v2.json]
        [--models opt-6.7b opt-30b llama-2-13b] [--budgets 12 24] [--quick]

A plan offsim refuses (it does not fit, or a setting it rejects) is counted as refused, not as a failure. Ends with
one JSON line: plans built, over offexec's count, refused.
"""
from __future__ import annotations

import itertools

from tqdm import tqdm

from experiments.common import argparser, finish
from offsim import Workload, build_plan, get_hardware, get_model
from offsim.core.errors import OffsimError

# (policy, settings beside the placement): each policy's variants whose GPU working set differs
CONFIGS = (("flexgen", {}), ("flexgen", {"cpu_attention": True}),
           ("flexgen", {"compress_weight": True, "compress_cache": True}),
           ("tightllm", {"kv_solver": "exact"}), ("tightllm", {"kv_solver": "exact", "compress_cache": True}),
           ("tightllm", {"kv_solver": "exact", "hold_recompute": True, "graph_recompute": True}),
           ("tightllm", {"kv_solver": "exact", "hold_recompute": True, "graph_recompute": True,
                         "compress_weight": True}))
WORKLOADS = ((128, 32), (1024, 64), (1984, 32))  # (prompt, gen)
BLOCKINGS = ((8, 4), (32, 2), (64, 1))  # (GPU batch size, GPU batches)
PLACEMENTS = ((20, 80, 0, 100, 100, 0), (0, 100, 0, 100, 0, 100), (50, 50, 20, 80, 100, 0))


def main(argv=None) -> int:
    from offexec.executor import plan_gpu_need
    from offexec.memory import ExecError

    ap = argparser(__doc__)
    ap.add_argument("--hardware", default="results/profiles/h200_offexec_v2.json")
    ap.add_argument("--models", nargs="+", default=["opt-6.7b", "opt-30b", "llama-2-13b"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[12.0, 24.0], metavar="GIB")
    ap.add_argument("--quick", action="store_true", help="one workload, blocking and placement (a smoke test)")
    args = ap.parse_args(argv)
    grid = (CONFIGS, args.models, WORKLOADS[:1] if args.quick else WORKLOADS,
            BLOCKINGS[:1] if args.quick else BLOCKINGS, args.budgets, PLACEMENTS[:1] if args.quick else PLACEMENTS)
    built = refused = 0
    over = []
    for (pol, extra), m, (p, g), (gbs, nb), budget, pct in tqdm(list(itertools.product(*grid)), desc="plans"):
        hw = get_hardware(args.hardware, gpu_mem_gb=budget)
        model = get_model(m)
        try:
            plan = build_plan(pol, model, hw, Workload(p, g, gbs, nb), {"percent": pct, **extra})
            need = sum(plan_gpu_need(plan).values())
        except (OffsimError, ExecError):
            refused += 1
            continue
        built += 1
        if need > hw.gpu_mem_bytes:
            over.append({"policy": pol, "settings": extra, "model": m, "prompt_len": p, "gen_len": g,
                         "gpu_batch_size": gbs, "num_gpu_batches": nb, "budget_gib": budget, "percent": pct,
                         "offexec_gib": round(need / 2 ** 30, 3)})
            tqdm.write(f"over: {over[-1]}")
    print(f"{built} plans built, {len(over)} over offexec's pre-check, {refused} refused by offsim or offexec")
    finish({"experiment": "precheck_sweep", "hardware": args.hardware, "built": built, "over": over,
            "refused": refused})
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
