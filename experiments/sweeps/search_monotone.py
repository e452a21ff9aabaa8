"""Does ``offsim search`` find at least as fast a plan when the GPU budget grows? A larger budget only adds
candidates (every placement that fits 16 GiB fits 20 GiB), so each policy's best simulated total tok/s should not
fall along a ladder of budgets. This runs ``offsim.search.search`` for every (hardware, model, prompt, gen, policy)
over a ladder of GPU budgets and lists every ladder where the total tok/s at a budget is below the best of a smaller
budget by more than ``--tol`` (default 0.5 %), or where a budget finds nothing though a smaller one found a plan.

    python -m experiments.sweeps.search_monotone                    # the full grid (a few minutes on 2 cores)
    python -m experiments.sweeps.search_monotone --models opt-6.7b --policies flexgen --hardware h200
    python -m experiments.sweeps.search_monotone --csv /tmp/ladders.csv   # every search's result, one row each

Lengths past a model's context (OPT: prompt + gen <= 2048) are skipped. Prints each non-monotone ladder (its
budgets' tok/s and block shapes), the count and each policy's search times; ends with one JSON line: ladders run, non-monotone ladders, and
the non-monotone ones' keys. Writes nothing unless ``--csv`` is given.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pandas as pd

from experiments.common import argparser, finish

PROFILE = "results/profiles/h200_offexec_v2.json"
BUDGETS = (8, 12, 16, 20, 24, 32, 40)
MODELS = ("opt-6.7b", "opt-13b", "opt-30b", "llama-2-13b")
POLICIES = ("flexgen", "tightllm", "static-accelerate", "static-zero")
LENGTHS = ((512, 32), (512, 128), (1984, 32), (1984, 128))


def _one(key: tuple) -> dict:
    """One search: (hardware, model, prompt, gen, policy, budget GiB) -> its best total tok/s (NaN: infeasible)."""
    import time

    from offsim.core.errors import OffsimError
    from offsim.core.specs import get_hardware, get_model
    from offsim.search import search

    hw_name, model, prompt, gen, policy, gib = key
    row = {"hardware": hw_name, "model": model, "prompt_len": prompt, "gen_len": gen, "policy": policy,
           "gpu_mem_gb": gib, "total_tok_s": float("nan"), "block": "", "settings": "", "error": ""}
    t0 = time.perf_counter()
    try:
        res = search(policy, get_model(model), get_hardware(hw_name, gib), prompt, gen)
    except OffsimError as e:
        row["error"] = str(e)[:200]
        return row
    finally:
        row["search_s"] = time.perf_counter() - t0
    row.update(total_tok_s=float(res.metrics["total_tok_s"]), settings=str(res.settings),
               block=f"{res.workload.gpu_batch_size}x{res.workload.num_gpu_batches}")
    return row


def non_monotone(df: pd.DataFrame, tol: float) -> list[tuple]:
    """The ladders (keys without the budget) where a larger budget's tok/s is below the best smaller budget's by
    more than ``tol``, or is infeasible after a feasible one."""
    bad = []
    for key, g in df.sort_values("gpu_mem_gb").groupby(["hardware", "model", "prompt_len", "gen_len", "policy"]):
        best = float("nan")
        for v in g["total_tok_s"]:
            if best == best and not (v == v and v >= best * (1 - tol)):
                bad.append(key)
                break
            if v == v:
                best = v if best != best else max(best, v)
    return bad


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("--hardware", nargs="+", default=[PROFILE, "h200"],
                    help="hardware presets or profiles (default: %(default)s)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="model presets (default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="policies (default: %(default)s)")
    ap.add_argument("--lengths", nargs="+", default=[f"{p}/{g}" for p, g in LENGTHS], metavar="PROMPT/GEN",
                    help="prompt/gen lengths (default: %(default)s)")
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS), metavar="GiB",
                    help="the ladder of GPU budgets (default: %(default)s)")
    ap.add_argument("--tol", type=float, default=0.005, help="relative drop tolerated (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes (default: %(default)s)")
    ap.add_argument("--csv", default=None, help="write every search's row here")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from offsim.core.specs import get_model

    lengths = [tuple(int(x) for x in s.split("/")) for s in args.lengths]
    keys = []
    for hw in args.hardware:
        for model in args.models:
            ctx = get_model(model).max_positions
            for prompt, gen in lengths:
                if prompt + gen > ctx:
                    continue
                for pol in args.policies:
                    keys += [(hw, model, prompt, gen, pol, b) for b in args.budgets]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(tqdm(pool.map(_one, keys, chunksize=1), total=len(keys), desc="searches", unit="search"))
    df = pd.DataFrame(rows)
    if args.csv:
        df.to_csv(args.csv, index=False)
    bad = non_monotone(df, args.tol)
    ladders = df.groupby(["hardware", "model", "prompt_len", "gen_len", "policy"]).ngroups
    for key in bad:
        g = df[(df[["hardware", "model", "prompt_len", "gen_len", "policy"]] == pd.Series(
            dict(zip(["hardware", "model", "prompt_len", "gen_len", "policy"], key)))).all(axis=1)]
        g = g.sort_values("gpu_mem_gb")
        steps = ", ".join(f"{b:g}G {t:.2f} ({blk})" if t == t else f"{b:g}G -"
                          for b, t, blk in zip(g["gpu_mem_gb"], g["total_tok_s"], g["block"]))
        print(f"non-monotone: {' '.join(map(str, key))}: {steps}")
    print(f"{len(bad)} of {ladders} ladders non-monotone (tol {args.tol:.1%}); search time by policy (s, over "
          "processes sharing the machine): " + ", ".join(f"{p} median {g.median():.2f} max {g.max():.2f}"
                                                         for p, g in df.groupby("policy")["search_s"]))
    finish({"ladders": ladders, "non_monotone": len(bad), "keys": [list(k) for k in bad]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
