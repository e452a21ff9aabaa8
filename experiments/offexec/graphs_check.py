"""Decode layer ops as CUDA graphs against eager issue, on the GPU: the same plan run with ``graphs='off'`` and
``graphs='cuda'`` (each after its own two-token warm-up, the allocator capped at the plan), one JSON line per run
(decode tok/s, host issue time and its share of the run, graphs captured and replayed, GPU peak against the plan's
need), then one per configuration comparing the two runs' tokens and their logits at every (step, batch) whose inputs
were still identical (``experiments.memory.sublayer_check.compare_logits``).

    python -m experiments.offexec.graphs_check [--out FILE] [--only NAME]     # on the GPU machine
    python -m experiments.offexec.graphs_check --report FILE [FILE ...] [--profile P]  # markdown tables of runs
"""
from __future__ import annotations

import argparse
import json
import sys

CONFIGS = (  # (name, model, policy, settings, prompt, gen, gbs, nb, budget GiB); FlexGen's sub-layers (its default)
    ("opt-6.7b weights on the GPU, KV on the host, 8x4", "opt-6.7b", "flexgen", {"percent": (100, 0, 0, 100, 100, 0)}, 512, 64, 8, 4, 40),
    ("opt-6.7b weights 20/80, KV on the host, 16x2", "opt-6.7b", "flexgen", {"percent": (20, 80, 0, 100, 100, 0)},
     512, 32, 16, 2, 12),
    ("llama-2-7b weights on the GPU, KV on the host, 4x4", "llama-2-7b", "flexgen", {"percent": (100, 0, 0, 100, 100, 0)}, 256, 64, 4, 4, 40),
    ("llama-2-7b weights 50/50, KV on the host, 8x2", "llama-2-7b", "flexgen", {"percent": (50, 50, 0, 100, 100, 0)},
     512, 32, 8, 2, 16),
    # TightLLM recomputing N_r <= 2 tokens per step: decode layer ops of 3 query tokens, graphed
    ("llama-2-7b tightllm KV 50/50, N_r <= 2, 16x1", "llama-2-7b", "tightllm",
     {"percent": (100, 0, 50, 50, 100, 0), "max_recompute_tokens": 2, "kv_solver": "exact"}, 512, 32, 16, 1, 40),
)
PROFILE = "results/profiles/h200_offexec.json"
# the records of the first run (commit c853c92) carry the names these configurations had then
RENAMED = {"opt-6.7b resident, 8x4": CONFIGS[0][0], "opt-6.7b flexgen 20/80 sub-layers, 16x2": CONFIGS[1][0],
           "llama-2-7b resident, 4x4": CONFIGS[2][0], "llama-2-7b flexgen 50/50 KV on host, 8x2": CONFIGS[3][0]}


def run(out, only: str | None = None) -> None:
    import torch

    from experiments.common import provenance
    from experiments.memory.sublayer_check import compare_logits
    from offexec.executor import run_plan
    from offexec.weights import random_weights
    from offsim import Workload, build_plan, get_hardware, get_model, simulate

    emit = lambda d: (print(json.dumps(d), flush=True), out.write(json.dumps(d) + "\n"), out.flush())  # noqa: E731
    emit({"provenance": provenance()})
    weights = {}
    for name, mname, policy, st, prompt, gen, gbs, nb, budget in CONFIGS:
        if only and only not in name:
            continue
        m = get_model(mname)
        if mname not in weights:
            for old in weights.values():  # unpin before freeing: a freed pinned range breaks later page-locking
                old.close()
            weights.clear()
            torch.cuda.empty_cache()
            weights[mname] = random_weights(m, 0, torch.float16, device="cuda", pinned=True, progress=False)
        w = weights[mname]
        hw = get_hardware(PROFILE, budget)
        wl = Workload(prompt, gen, gbs, nb)
        plan = build_plan(policy, m, hw, wl, st)
        pred = simulate(plan, hw).metrics()
        warm = build_plan(policy, m, hw, wl.with_(gen_len=2), st)
        toks, lgs = {}, {}
        for mode in ("off", "cuda"):
            run_plan(warm, w, "cuda", gpu_budget_bytes=int(hw.gpu_mem_bytes), graphs=mode)
            r = run_plan(plan, w, "cuda", gpu_budget_bytes=int(hw.gpu_mem_bytes), graphs=mode, record_logits=True)
            mm, s = r.trace.metrics(), r.stats
            toks[mode], lgs[mode] = r.tokens, {(a, b): lg for a, b, lg in r.logits}
            emit({"config": name, "graphs": mode, "decode_tok_s": mm["decode_tok_s"], "total_tok_s": mm["total_tok_s"],
                  "pred_decode_tok_s": pred["decode_tok_s"], "issue_s": s["issue_s"], "issue_frac": s["issue_frac"],
                  "wall_s": s["wall_s"], "graph_stats": s["graphs"],
                  "gpu_max_reserved_bytes": s["gpu_max_reserved_bytes"],
                  "gpu_max_allocated_bytes": s["gpu_max_allocated_bytes"],
                  "gpu_need_bytes": sum(s["gpu_need_bytes"].values()), "gpu_idle_frac": mm["gpu_idle_frac"]})
        emit({"config": name, "tokens_equal": bool((toks["off"] == toks["cuda"]).all()),
              **compare_logits(toks["off"], toks["cuda"], lgs["off"], lgs["cuda"], gbs)})


def report(paths: list[str], profile: str | None = None) -> str:
    """Markdown: one table per records file (a run), and with ``profile`` the decode throughput offsim predicts
    for each configuration with and without graphs on that profile (``Plan.cuda_graphs``)."""
    out = []
    for path in paths:
        rows, cmp = [], {}
        for line in open(path):
            r = json.loads(line)
            if "config" in r:
                r["config"] = RENAMED.get(r["config"], r["config"])
            if "tokens_equal" in r:
                cmp[r["config"]] = r
            elif "graphs" in r:
                rows.append(r)
        out += [f"Records: `{path}`", "",
                "| configuration | decode ops | decode tok/s | host issue s | issue share of the run | GPU idle | "
                "graphs (capture s) | peak reserved / plan need GiB | token agreement | largest logit difference (std) |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            g, c = r["graph_stats"], cmp.get(r["config"], {})
            out.append(f"| {r['config']} | {'CUDA graphs' if r['graphs'] == 'cuda' else 'eager'} | "
                       f"{r['decode_tok_s']:.1f} | {r['issue_s']:.2f} | {r['issue_frac']:.1%} | "
                       f"{r['gpu_idle_frac']:.1%} | "
                       + (f"{g['graphs']} ({g['capture_s']:.2f})" if r["graphs"] == "cuda" else "") + " | "
                       f"{r['gpu_max_reserved_bytes'] / 2**30:.2f} / {r['gpu_need_bytes'] / 2**30:.2f} | "
                       + (f"{c['token_agreement']:.1%} | {c['logit_max_abs_diff']:.3g} ({c['logit_std']:.3g})"
                          if r["graphs"] == "cuda" and c else " | ") + " |")
        out.append("")
    if profile:
        out += predictions(paths, profile)
    return "\n".join(out)


def predictions(paths: list[str], profile: str) -> list[str]:
    """Predicted against measured decode tok/s per configuration, eager and graphed (the last records of each)."""
    from offsim import Workload, build_plan, get_hardware, get_model, simulate

    meas = {}
    for line in (x for p in paths for x in open(p)):
        r = json.loads(line)
        if "graphs" in r and "config" in r:
            meas.setdefault((RENAMED.get(r["config"], r["config"]), r["graphs"]), []).append(r["decode_tok_s"])
    out = [f"Predicted by offsim on `{profile}` (issue cost of a graphed op: its `issue_graph_s`) against the "
           "measured decode tok/s of every run above:", "",
           "| configuration | decode ops | predicted tok/s | measured tok/s (runs) | error of the prediction |",
           "| --- | --- | --- | --- | --- |"]
    for name, mname, policy, st, prompt, gen, gbs, nb, budget in CONFIGS:
        hw = get_hardware(profile, budget)
        plan = build_plan(policy, get_model(mname), hw, Workload(prompt, gen, gbs, nb), st)
        for mode in ("off", "cuda"):
            plan.cuda_graphs = mode == "cuda"
            pred = simulate(plan, hw).metrics()["decode_tok_s"]
            ms = meas.get((name, mode), [])
            err = ", ".join(f"{(pred - m) / m:+.1%}" for m in ms)
            out.append(f"| {name} | {'CUDA graphs' if mode == 'cuda' else 'eager'} | {pred:.1f} | "
                       f"{', '.join(f'{m:.1f}' for m in ms)} | {err} |")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="graphs_h200.jsonl")
    ap.add_argument("--report", nargs="+", default=None, metavar="FILE")
    ap.add_argument("--only", default=None, help="only the configurations whose name contains this")
    ap.add_argument("--profile", default=None, help="with --report: also offsim's predictions on this profile")
    a = ap.parse_args()
    if a.report:
        print(report(a.report, a.profile))
        sys.exit(0)
    with open(a.out, "w") as f:
        run(f, a.only)
