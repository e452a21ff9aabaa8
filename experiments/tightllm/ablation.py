"""TightLLM ablations: each case's best TightLLM configuration (from tightllm_throughput's search) simulated again
without the KV distributor (N_r = 0), without the weight loader (each layer's weights loaded whole with the first
batch), without both, and FlexGen's own schedule on the same placement (what separates the policies beyond the two
components: op order, the last step's unneeded KV store); decode and prefill throughput change against the full
system -- the paper's "decode:
without KV distributor -12.6 to -43.1 %, without weight loader -4.4 to -74.8 %; prefill: up to -46.6 % and -38.2 %".

    python -m experiments.tightllm.ablation [--models ...] [--hardware ...] [--sequences N]
    # after tightllm_throughput.py (with the same --sequences)

Writes results/tightllm/ablation/{ablation.csv,summary.csv,ablation.png}; prints the tables, then one JSON line.
Same placement and block shape for all four variants (only the named component changes).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
from tqdm import tqdm


from experiments.common import argparser, finish, provenance, pyplot, write_csv
from experiments.tightllm.common import GEN_LEN, HARDWARE, MODELS, OUT, PAPER, Cache, model_for

from offsim import OffsimError, Workload, build_plan, get_hardware, simulate

plt = pyplot()

DIR = OUT / "ablation"
FLEXGEN_SAME = "FlexGen, same placement"
VARIANTS = {"full": {}, "no KV distributor": {"kv_distributor": False}, "no weight loader": {"weight_loader": False},
            "neither": {"kv_distributor": False, "weight_loader": False}, FLEXGEN_SAME: None}


def main() -> None:
    ap = argparser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--hardware", default=",".join(HARDWARE))
    ap.add_argument("--sequences", type=int, default=None,
                    help="use the configurations of tightllm_throughput.py --sequences N (writes ablation_{N}seq/)")
    a = ap.parse_args()
    models, hws = a.models.split(","), a.hardware.split(",")
    global DIR
    tag = "" if a.sequences is None else f"_{a.sequences}seq"
    DIR = OUT / f"ablation{tag}"
    src = Cache(OUT / f"throughput{tag}" / "cases.jsonl")
    cases = [r for r in src.rows.values() if r["policy"] == "tightllm" and r["status"] == "ok"
             and r["model"] in models and r["hardware"] in hws]
    if not cases:
        raise SystemExit("no TightLLM results in results/tightllm/throughput/cases.jsonl: run "
                         "experiments/tightllm/throughput.py first")
    prov = provenance(gen_len=GEN_LEN, sequences=a.sequences,
                      note=f"configurations from results/tightllm/throughput{tag}/cases.jsonl")
    rows = []
    for r in tqdm(sorted(cases, key=lambda r: (r["hardware"], MODELS.index(r["model"]), r["prompt_len"])),
                  desc="ablations", unit="case"):
        model, hw = model_for(r["model"], r["prompt_len"]), get_hardware(r["hardware"])
        wl = Workload(r["prompt_len"], GEN_LEN, r["gpu_batch_size"], r["num_gpu_batches"])
        base = {k: tuple(v) if k == "percent" else v for k, v in r["settings"].items()}
        for name, extra in VARIANTS.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if name == FLEXGEN_SAME:  # FlexGen's own schedule on the same placement, GPU attention
                        plan = build_plan("flexgen", model, hw, wl, {"percent": base["percent"]})
                    else:
                        plan = build_plan("tightllm", model, hw, wl, {**base, **extra})
                    m = simulate(plan, hw).metrics()
            except OffsimError as e:
                rows.append({"hardware": r["hardware"], "config": r["config"], "model": r["model"],
                             "prompt_len": r["prompt_len"], "variant": name, "status": str(e)[:200]})
                continue
            rows.append({"hardware": r["hardware"], "config": r["config"], "model": r["model"],
                         "prompt_len": r["prompt_len"], "variant": name, "status": "ok",
                         "gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches,
                         "settings": json.dumps(base, default=list), "prefill_tok_s": m["prefill_tok_s"],
                         "decode_tok_s": m["decode_tok_s"], "gpu_idle_frac": m["gpu_idle_frac"]})
    df = pd.DataFrame(rows)
    ok = df[df["status"] == "ok"]
    full = ok[ok["variant"] == "full"].set_index(["hardware", "model", "prompt_len"])
    for ph in ("decode", "prefill"):
        ref = full[f"{ph}_tok_s"]
        df[f"{ph}_change_pct"] = [
            100 * (row[f"{ph}_tok_s"] / ref.loc[(row["hardware"], row["model"], row["prompt_len"])] - 1)
            if row["status"] == "ok" and (row["hardware"], row["model"], row["prompt_len"]) in ref.index else None
            for _, row in df.iterrows()]
    DIR.mkdir(parents=True, exist_ok=True)
    write_csv(df, DIR / "ablation.csv", prov)
    summ = []
    for name in ("no KV distributor", "no weight loader", "neither", FLEXGEN_SAME):
        g = df[(df["variant"] == name) & (df["status"] == "ok")]
        for ph in ("decode", "prefill"):
            c = g[f"{ph}_change_pct"].astype(float)
            summ.append({"variant": name, "phase": ph, "min_pct": c.min(), "median_pct": c.median(),
                         "max_pct": c.max(), "cases": len(c), "cases_slower": int((c < -0.1).sum())})
    s = pd.DataFrame(summ)
    paper = {("no KV distributor", "decode"): str(PAPER["ablation_decode_no_kvd_pct"]),
             ("no weight loader", "decode"): str(PAPER["ablation_decode_no_wl_pct"]),
             ("no KV distributor", "prefill"): f"down to {PAPER['ablation_prefill_no_kvd_pct_max']}",
             ("no weight loader", "prefill"): f"down to {PAPER['ablation_prefill_no_wl_pct_max']}"}
    s["paper_pct"] = [paper.get((v, p), "") for v, p in zip(s["variant"], s["phase"])]
    write_csv(s, DIR / "summary.csv", prov)
    _plot(df, DIR / "ablation.png")
    pd.set_option("display.width", 220)
    wide = df[df["variant"] != "full"].pivot_table(index=["config", "model", "prompt_len"], columns="variant",
                                                   values=["decode_change_pct", "prefill_change_pct"])
    print(wide.to_string(float_format=lambda v: f"{v:,.1f}"))
    print()
    print(s.to_string(index=False, float_format=lambda v: f"{v:,.1f}"))
    finish({"cases": len(cases), **{f"{r.variant}|{r.phase}": [round(r.min_pct, 1), round(r.max_pct, 1)]
                                    for r in s.itertuples()}, **prov})


def _plot(df: pd.DataFrame, path: Path) -> None:
    ok = df[(df["status"] == "ok") & (df["variant"] != "full")].copy()
    ok["case"] = ok["config"] + " " + ok["model"] + " " + (ok["prompt_len"] // 1024).astype(str).str.replace(
        "^0$", "0.5", regex=True) + "K"
    cases = list(dict.fromkeys(ok.sort_values(["config", "model", "prompt_len"])["case"]))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.28 * len(cases)), 7), sharex=True)
    colors = {"no KV distributor": "#1f77b4", "no weight loader": "#ff7f0e", "neither": "#7f7f7f",
              FLEXGEN_SAME: "#2ca02c"}
    w = 0.2
    for ax, ph in zip(axes, ("decode", "prefill")):
        for n, v in enumerate(colors):
            g = ok[ok["variant"] == v].set_index("case").reindex(cases)
            ax.bar([i + (n - 1.5) * w for i in range(len(cases))], g[f"{ph}_change_pct"].astype(float), w,
                   color=colors[v], label=v)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylabel(f"{ph} tok/s change, %")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("TightLLM ablations in offsim (each case at TightLLM's best configuration)", fontsize=10)
    axes[1].set_xticks(range(len(cases)), cases, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
