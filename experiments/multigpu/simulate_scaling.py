"""Simulated scaling of FlexGen's pipeline parallelism over 1, 2 and 4 GPUs (issue 18), every GPU with the same
budget, beside FlexGen's published 1 -> 4 GPU numbers (OPT-175B decode on T4s: 0.83 -> 3.86 tok/s, FlexGen
ICML'23 §6, from the issue's seeds).

For each (model, hardware) the single-GPU point is offsim's FlexGen search at the budget. With S GPUs the block
shape is kept (the same sequences) and the weights' GPU share is raised in steps of 5 points while every stage
still fits its GPU (and, where the stages' host staging no longer fits the one host, host-homed weights moved to
disk in steps of 3 points) (a stage holds 1/S of the layers: what makes FlexGen's multi-GPU result super-linear), for each
micro-batch count in {1, S}; the best decode throughput is reported. The placement search does not choose the stage
split yet (balanced).

    python -m experiments.multigpu.simulate_scaling     # writes results/multigpu/simulated/{scaling.csv,README.md}
"""
from __future__ import annotations

import json
import time

import pandas as pd

from experiments.common import ROOT, argparser, finish, provenance, write_csv
from offsim import Workload, build_plan, get_hardware, get_model, simulate
from offsim.core.errors import OffsimError
from offsim.policies.registry import check_plan_fits
from offsim.search import search

OUT = ROOT / "results" / "multigpu" / "simulated"
PROMPT, GEN = 512, 32
# (model, hardware preset, GPU budget GiB or None for the preset's, published decode tok/s per GPU count)
CASES = [("opt-30b", "h200", 16, {}),
         ("opt-66b", "h200", 16, {}),
         ("opt-175b", "t4", None, {1: 0.83, 4: 3.86})]
GPUS = (1, 2, 4)


def best_with_stages(model, hw, wl: Workload, base: dict, stages: int) -> tuple[dict, dict] | None:
    """The best decode tok/s of ``base`` on ``stages`` GPUs: the weights' GPU share raised while the stages fit,
    micro-batches 1 or ``stages``. (settings, metrics) or None when nothing fits."""
    best = None
    p = tuple(base["percent"])
    for wg in range(p[0], 101, 5):
        wc0 = max(0, min(p[1], 100 - wg)) if p[0] + p[1] < 100 else 100 - wg
        for micro in sorted({1, min(stages, wl.num_gpu_batches)}):
            # the stages' host staging adds up on the one host: move host weights to disk (steps of 3 points)
            # until the stages fit, from arithmetic (no op built)
            st = None
            for wc in range(wc0, -1, -3):
                cand = {**base, "percent": (wg, wc) + p[2:], "num_stages": stages, "micro_batches": micro}
                try:
                    check_plan_fits("flexgen", model, hw, wl, cand)
                except OffsimError:
                    continue
                st = cand
                break
            if st is None:
                continue
            try:
                m = simulate(build_plan("flexgen", model, hw, wl, st), hw).metrics()
            except OffsimError:
                continue
            if best is None or m["decode_tok_s"] > best[1]["decode_tok_s"]:
                best = (st, m)
    return best


def main() -> None:
    argparser(__doc__).parse_args()
    t0 = time.time()
    rows = []
    for mname, hwname, budget, published in CASES:
        model, hw = get_model(mname), get_hardware(hwname, budget)
        r = search("flexgen", model, hw, PROMPT, GEN, max_sims=2)
        wl, base = r.workload, {k: v for k, v in r.settings.items()}
        one = None
        for S in GPUS:
            found = ({**base}, r.metrics) if S == 1 else best_with_stages(model, hw, wl, base, S)
            if found is None:
                print(f"{mname} {hwname} {S} GPUs: nothing fits", flush=True)
                continue
            st, m = found
            one = m["decode_tok_s"] if S == 1 else one
            row = {"model": mname, "hardware": hwname, "gpu_budget_gib": hw.gpu_mem_bytes / 2**30, "gpus": S,
                   "gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches,
                   "settings": json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in st.items()}),
                   "decode_tok_s": m["decode_tok_s"], "prefill_tok_s": m["prefill_tok_s"],
                   "total_tok_s": m["total_tok_s"], "decode_speedup": m["decode_tok_s"] / one if one else None,
                   "peak_gpu_GiB": m["peak_gpu_bytes"] / 2**30, "peak_cpu_GiB": m["peak_cpu_bytes"] / 2**30,
                   "published_decode_tok_s": published.get(S)}
            rows.append(row)
            print(f"{mname:9s} {hwname:5s} {S} GPUs: decode {m['decode_tok_s']:8.2f} tok/s (x{row['decode_speedup']:.2f})"
                  f" total {m['total_tok_s']:8.2f}  percent {st['percent']} micro {st.get('micro_batches', 1)}"
                  + (f"  published {published[S]}" if S in published else ""), flush=True)
    df = pd.DataFrame(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    prov = provenance(prompt_len=PROMPT, gen_len=GEN, wall_s=round(time.time() - t0, 1))
    write_csv(df, OUT / "scaling.csv", prov)
    lines = ["# Simulated pipeline-parallel scaling (issue 18)", "",
             f"`{prov['command']}` at commit {prov.get('commit', '?')}: FlexGen's pipeline over 1, 2 and 4 GPUs, "
             f"prompt {PROMPT}, gen {GEN}, each GPU with the budget shown; the block shape of the single-GPU search "
             "kept, the weights' GPU share raised while every stage fits (steps of 5 points), micro-batches 1 or "
             "the GPU count. Simulated only (no multi-GPU machine measured yet); the presets' GPU-to-GPU link is "
             "PCIe peer at the host link's rate.", "",
             "| model | hardware | GPU GiB | GPUs | batch | decode tok/s | speedup | total tok/s | published decode |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pub = "" if r["published_decode_tok_s"] is None else f"{r['published_decode_tok_s']:.2f}"
        lines.append(f"| {r['model']} | {r['hardware']} | {r['gpu_budget_gib']:.0f} | {r['gpus']} | "
                     f"{r['gpu_batch_size']}x{r['num_gpu_batches']} | {r['decode_tok_s']:.2f} | "
                     f"x{r['decode_speedup']:.2f} | {r['total_tok_s']:.2f} | {pub} |")
    lines += ["", "Reading: where the single-GPU placement streams most weights from the host (OPT-30B on 16 GiB), a "
              "stage of 1/S of the layers keeps nearly all of them resident and decode scales super-linearly, as "
              "FlexGen reports. Where the placement needs the disk (OPT-66B's KV tail, OPT-175B on T4s: all KV and "
              "42 % of the weights), the disk is one per host and shared by every stage (host memory too, which "
              "pushes more weights to disk as stages add their own staging), so more GPUs on one host add little "
              "or nothing. offsim models every GPU on one host; FlexGen's published 4-GPU T4 numbers are beside "
              "the rows for reference, not reproduced (its testbed's hosts and disks are not modelled here)."]
    (OUT / "README.md").write_text("\n".join(lines) + "\n")
    finish({"rows": len(rows), "out": str(OUT)})


if __name__ == "__main__":
    main()
