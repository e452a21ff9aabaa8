"""How fast offsim plans and simulates at realistic sizes (issue targets: OPT-175B, FlexGen's 32 x 8 policy, plan
build + simulation under 2 s; ``offsim search`` for OPT-175B on t4 under 10 s). Prints a table, then one JSON line.

    python -m experiments.bench.sim_speed           # writes results/bench_sim_speed/bench.csv
"""
from __future__ import annotations

import os
import time

import pandas as pd

from experiments.common import ROOT, argparser, finish, provenance, write_csv
from offsim import PlanError, Workload, build_plan, get_hardware, get_model, simulate
from offsim.search import search

OUT = ROOT / "results" / "bench_sim_speed"

CASES = [  # (label, model, hardware, policy, settings, gbs, nb)
    ("FlexGen OPT-175B 32x8 (published policy)", "opt-175b", "t4", "flexgen",
     {"percent": (0, 50, 0, 0, 0, 100), "cpu_attention": True, "pin_weights": False}, 32, 8),
    ("FlexGen OPT-175B 32x8, GPU attention", "opt-175b", "t4", "flexgen",
     {"percent": (0, 50, 0, 0, 0, 100), "pin_weights": False}, 32, 8),
    ("FlexGen OPT-30B 48x3 (published policy)", "opt-30b", "t4", "flexgen",
     {"percent": (20, 80, 0, 100, 0, 100), "cpu_attention": True}, 48, 3),
]


def _validate(plan):
    try:
        plan.validate()
    except PlanError as e:
        return str(e)
    return "ok"


def best_of(fn, repeat=3):
    times = []
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    rows = []
    for label, mname, hwname, policy, st, gbs, nb in CASES:
        model, hw = get_model(mname), get_hardware(hwname)
        wl = Workload(512, 32, gbs, nb)
        t_build, plan = best_of(lambda: build_plan(policy, model, hw, wl, st, validate=False))
        t_valid, _ = best_of(lambda: _validate(plan))  # timed whatever its verdict (30B: see flexgen_table)
        t_sim, trace = best_of(lambda: simulate(plan, hw, check_memory=False))
        n = len(plan.ops)
        events = 2 * n  # each op: a start (dependencies met) and an end (timeout) event
        rows.append({"case": label, "ops": n, "build_s": t_build, "validate_s": t_valid, "simulate_s": t_sim,
                     "build_plus_sim_s": t_build + t_sim, "ops_per_s": n / t_sim, "events_per_s": events / t_sim,
                     "total_tok_s": trace.metrics()["total_tok_s"]})
    t_search, res = best_of(lambda: search("flexgen", get_model("opt-175b"), get_hardware("t4"), 512, 32), 1)
    rows.append({"case": "offsim search flexgen OPT-175B on t4", "ops": float("nan"), "build_s": float("nan"),
                 "validate_s": float("nan"), "simulate_s": float("nan"), "build_plus_sim_s": t_search,
                 "ops_per_s": float("nan"), "events_per_s": float("nan"), "total_tok_s": res.metrics["total_tok_s"]})
    df = pd.DataFrame(rows)
    prov = provenance(cpus=os.cpu_count(), note="best of 3 runs (search: 1 run); machine may be shared")
    write_csv(df, OUT / "bench.csv", prov)
    print(df.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    headline = rows[0]
    finish({"opt175b_flexgen_build_plus_sim_s": round(headline["build_plus_sim_s"], 3),
            "opt175b_flexgen_ops": headline["ops"], "ops_per_s": round(headline["ops_per_s"]),
            "events_per_s": round(headline["events_per_s"]), "search_opt175b_t4_s": round(t_search, 2),
            **prov})


if __name__ == "__main__":
    argparser(__doc__).parse_args()
    main()
