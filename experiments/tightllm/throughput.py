"""TightLLM vs Accelerate and FlexGen, each at its best settings: decode and prefill throughput against prompt length
(0.5K-8K, 32 generated tokens) for OPT-13B/30B/66B/175B and Llama-2-13B/70B on C1 (rtx3090) and C2 (a800) --
TightLLM's Fig. "throughput", with speedup tables beside the paper's ranges (docs/anchors.md §3).

    python -m experiments.tightllm.throughput [--models opt-30b,...] [--hardware a800] [--prompts 512,2048]

``--sequences N`` fixes the number of sequences per block (the paper's fixed batch size; models that fit the GPU then
still have to offload their KV cache): results/tightllm/throughput_{N}seq/.

Writes results/tightllm/throughput/: cases.jsonl (resumable cache, one search per policy and case), throughput.csv,
speedup.csv, speedup_summary.csv, decode.png, prefill.png. Prints the tables, then one JSON line. Long: about an hour
on a 2-core machine for the full grid (progress bar); rerunning skips cases already in cases.jsonl.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm


from experiments.common import argparser, finish, provenance, pyplot, write_csv
from experiments.tightllm.common import (GEN_LEN, HARDWARE, MODELS, OUT, PAPER, POLICIES, POLICY_COLOR,
                             POLICY_LABEL, PROMPTS, Cache, best, best_fixed, model_for)

from offsim import Workload, get_hardware
from offsim.policies.tightllm import policy as T

plt = pyplot()

DIR = OUT / "throughput"  # --sequences N: OUT / f"throughput_{N}seq"
SEQUENCES = None


def nr_summary(model, hw, row: dict, prompt_len: int) -> dict:
    """Recompute share the distributor chose in the best TightLLM plan (first and last decode step, batch 0)."""
    wl = Workload(prompt_len, GEN_LEN, row["gpu_batch_size"], row["num_gpu_batches"])
    st = T.TightLLMSettings(**{k: tuple(v) if k == "percent" else v for k, v in row["settings"].items()})
    nr = T.recompute_tokens(model, hw, wl, st)
    first, last = nr[1], nr[-1]
    return {"n_r_first": int(first[0]), "n_r_last": int(last[0]),
            "recompute_frac_first": first[0] / prompt_len, "recompute_frac_last": last[0] / (prompt_len + GEN_LEN - 2),
            "n_r_batches_first": json.dumps(first)}


def run(models, hws, prompts, sequences: int | None = None, commit: str = "") -> pd.DataFrame:
    cache = Cache(DIR / "cases.jsonl")
    todo = [(h, m, p, pol) for h in hws for m in models for p in prompts for pol in POLICIES]
    for h, m, p, pol in tqdm(todo, desc="cases", unit="search"):
        key = (h, m, p, pol)
        if cache.get(key):
            continue
        model, hw = model_for(m, p), get_hardware(h)
        t0 = time.perf_counter()
        row = best(pol, model, hw, p) if sequences is None else best_fixed(pol, model, hw, p, sequences)
        row["search_s"] = time.perf_counter() - t0
        if pol == "tightllm" and row["status"] == "ok":
            row.update(nr_summary(model, hw, row, p))
        cache.put(key, {"commit": commit, "hardware": h, "config": HARDWARE[h], "model": m, "prompt_len": p,
                        "policy": pol,
                        "max_positions_extended": model.max_positions > model_for(m, 1).max_positions, **row})
    rows = [r for r in cache.rows.values() if r["hardware"] in hws and r["model"] in models
            and r["prompt_len"] in prompts]
    return pd.DataFrame(rows).drop(columns=["key"])


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"]
    piv = {ph: ok.pivot_table(index=["hardware", "config", "model", "prompt_len"], columns="policy",
                              values=f"{ph}_tok_s") for ph in ("decode", "prefill")}
    out = []
    for ph, t in piv.items():
        for base in ("static-accelerate", "flexgen"):
            if base not in t or "tightllm" not in t:
                continue
            s = (t["tightllm"] / t[base]).rename("speedup").reset_index()
            s["phase"], s["baseline"] = ph, base
            out.append(s)
    sp = pd.concat(out, ignore_index=True)
    return sp[["hardware", "config", "model", "prompt_len", "phase", "baseline", "speedup"]]


def summary(sp: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (ph, cfg), g in sp.dropna().groupby(["phase", "config"]):
        by_case_mean = g.groupby(["model", "prompt_len"])["speedup"].mean()
        rows.append({"phase": ph, "config": cfg, "min": g["speedup"].min(), "max": g["speedup"].max(),
                     "avg_of_baselines_max": by_case_mean.max(), "median": g["speedup"].median(),
                     "cases_below_1": int((g["speedup"] < 0.999).sum()), "cases": len(g)})
    for p in (512, 4096):
        g = sp[(sp["phase"] == "decode") & (sp["prompt_len"] == p)].dropna()
        rows.append({"phase": f"decode @ {p}", "config": "C1+C2", "min": g["speedup"].min(),
                     "max": g["speedup"].max(), "avg_of_baselines_max": float("nan"), "median": g["speedup"].median(),
                     "cases_below_1": int((g["speedup"] < 0.999).sum()), "cases": len(g)})
    s = pd.DataFrame(rows)
    paper = {("decode", "C1"): f"{PAPER['decode_speedup']} (avg up to {PAPER['decode_speedup_C1_avg_max']})",
             ("decode", "C2"): f"{PAPER['decode_speedup']} (up to {PAPER['decode_speedup_C2_max']})",
             ("prefill", "C1"): str(PAPER["prefill_speedup"]), ("prefill", "C2"): str(PAPER["prefill_speedup"]),
             ("decode @ 512", "C1+C2"): str(PAPER["decode_speedup_512"]),
             ("decode @ 4096", "C1+C2"): str(PAPER["decode_speedup_4096"])}
    s["paper_range"] = [paper.get((a, b), "") for a, b in zip(s["phase"], s["config"])]
    return s


def plot(df: pd.DataFrame, phase: str, path: Path) -> None:
    hws = [h for h in HARDWARE if h in set(df["hardware"])]
    models = [m for m in MODELS if m in set(df["model"])]
    fig, axes = plt.subplots(len(hws), len(models), figsize=(3.0 * len(models), 2.8 * len(hws)), squeeze=False,
                             sharex=True)
    for a, h in enumerate(hws):
        for b, m in enumerate(models):
            ax = axes[a][b]
            for pol in POLICIES:
                g = df[(df["hardware"] == h) & (df["model"] == m) & (df["policy"] == pol)].sort_values("prompt_len")
                okg = g[g["status"] == "ok"]
                ax.plot(okg["prompt_len"], okg[f"{phase}_tok_s"], "o-", color=POLICY_COLOR[pol],
                        label=POLICY_LABEL[pol], ms=3)
                bad = g[g["status"] != "ok"]
                for p in bad["prompt_len"]:
                    ax.annotate("OOM", (p, ax.get_ylim()[0]), color=POLICY_COLOR[pol], fontsize=6, ha="center")
            ax.set_xscale("log", base=2)
            ax.set_xticks(PROMPTS, [f"{p / 1024:g}K" for p in PROMPTS])
            ax.set_yscale("log")
            ax.set_title(f"{m} on {h} ({HARDWARE[h]})", fontsize=8)
            ax.grid(True, alpha=0.3, which="both")
            ax.tick_params(labelsize=7)
            if a == len(hws) - 1:
                ax.set_xlabel("prompt tokens", fontsize=8)
            if b == 0:
                ax.set_ylabel(f"{phase} tok/s", fontsize=8)
    axes[0][0].legend(fontsize=7)
    what = "best settings" if SEQUENCES is None else f"best settings for {SEQUENCES} sequences"
    fig.suptitle(f"{phase} throughput, each policy at its {what} (offsim, gen {GEN_LEN})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--hardware", default=",".join(HARDWARE))
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    ap.add_argument("--sequences", type=int, default=None,
                    help="fix the number of sequences (the paper's batch size) instead of letting the search pick it")
    a = ap.parse_args()
    global DIR, SEQUENCES
    SEQUENCES = a.sequences
    if a.sequences is not None:
        DIR = OUT / f"throughput_{a.sequences}seq"
    models, hws = a.models.split(","), a.hardware.split(",")
    prompts = [int(x) for x in a.prompts.split(",")]
    how = ("each policy at its best settings by offsim.search.search" if a.sequences is None else
           f"{a.sequences} sequences per block, each policy at its best shape and LP placement for them")
    # provenance of the code this process loaded (taken before the long run: others may commit meanwhile); cases
    # cached in cases.jsonl by an earlier run carry their own commit
    prov = provenance(gen_len=GEN_LEN, sequences=a.sequences, note=how + " (see experiments/tightllm/common.py); "
                      "OPT/Llama-2 positions extended where prompt+gen exceeds them")
    df = run(models, hws, prompts, a.sequences, prov["commit"])
    cols = ["hardware", "config", "model", "prompt_len", "policy", "status", "found_by", "settings", "gpu_batch_size",
            "num_gpu_batches", "prefill_tok_s", "decode_tok_s", "total_tok_s", "gpu_idle_frac", "busy_compute_s",
            "busy_h2d_s", "busy_disk_s", "n_r_first", "n_r_last", "recompute_frac_first", "recompute_frac_last",
            "max_positions_extended", "search_s", "commit", "reason"]
    df = df.reindex(columns=cols).sort_values(["hardware", "model", "prompt_len", "policy"])
    DIR.mkdir(parents=True, exist_ok=True)
    write_csv(df, DIR / "throughput.csv", prov)
    sp = speedups(df)
    write_csv(sp, DIR / "speedup.csv", prov)
    sm = summary(sp)
    write_csv(sm, DIR / "speedup_summary.csv", prov)
    for ph in ("decode", "prefill"):
        plot(df, ph, DIR / f"{ph}.png")
    pd.set_option("display.width", 220)
    show = df[["config", "model", "prompt_len", "policy", "gpu_batch_size", "num_gpu_batches", "prefill_tok_s",
               "decode_tok_s", "gpu_idle_frac", "recompute_frac_first"]]
    print(show.to_string(index=False, float_format=lambda v: f"{v:,.3g}"))
    print()
    wide = sp.pivot_table(index=["config", "model", "prompt_len"], columns=["phase", "baseline"], values="speedup")
    print(wide.to_string(float_format=lambda v: f"{v:,.2f}"))
    print()
    print(sm.to_string(index=False, float_format=lambda v: f"{v:,.2f}"))
    dec = sp[sp["phase"] == "decode"]["speedup"].dropna()
    pre = sp[sp["phase"] == "prefill"]["speedup"].dropna()
    finish({"cases": int(df[["hardware", "model", "prompt_len"]].drop_duplicates().shape[0]),
            "decode_speedup_min": round(float(dec.min()), 3), "decode_speedup_max": round(float(dec.max()), 3),
            "prefill_speedup_min": round(float(pre.min()), 3),
            "prefill_speedup_max": round(float(pre.max()), 3),
            "paper_decode_speedup": PAPER["decode_speedup"], "paper_prefill_speedup": PAPER["prefill_speedup"],
            **prov})


if __name__ == "__main__":
    main()
