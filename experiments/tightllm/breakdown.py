"""Per-token latency, compute against transfer: OPT-175B on the A800 (C2), 8 sequences, prompts 0.5K-8K, Accelerate,
FlexGen and TightLLM -- the paper's "OPT-175B per-token latency -59.7 to -95.7 %: compute grows x3.1-5.4, transfer
falls 68.9-97.5 %" and "FlexGen and Accelerate are 35.9-95.4 % (prefill) and 60.4-95.6 % (decode) below TightLLM".

    python -m experiments.tightllm.breakdown      # writes results/tightllm/breakdown/{breakdown.csv,summary.csv,breakdown.png}

Batch 8 = 8 sequences per block. FlexGen and TightLLM take the best of the block shapes 8x1, 4x2, 2x4, 1x8 with
FlexGen's LP placement for each (FlexGen also with CPU attention); Accelerate runs one batch of 8 with as many
layers on the GPU as fit beside the KV cache. Per decode step (every sequence gains one token): latency = decode
time / (gen - 1); compute = GPU busy time; transfer = the busiest transfer stream's busy time (H2D, D2H or disk);
exposed transfer = latency - compute (the time the GPU waits). Prefill: the same over the prefill, per prompt token.
OPT's 2048 positions are extended for prompts past 2K (dataclasses.replace; see tightllm_common.py).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm


from experiments.common import argparser, finish, provenance, pyplot, write_csv
from experiments.tightllm.common import GEN_LEN, OUT, PAPER, POLICY_LABEL, PROMPTS, fixed_lp_groups, model_for

from offsim import OffsimError, PlanError, Workload, build_plan, get_hardware, simulate

plt = pyplot()

DIR = OUT / "breakdown"
SEQUENCES = 8  # the paper's batch for this figure; block shapes 8x1, 4x2, 2x4, 1x8


def phase_breakdown(trace, phase: str, units: float) -> dict:
    """Latency, compute, busiest-transfer and exposed-transfer seconds of ``phase``, divided by ``units``."""
    df = trace.df
    d = df[df["step"] > 0] if phase == "decode" else df[df["step"] == 0]
    m = trace.metrics()
    wall = m["decode_s"] if phase == "decode" else m["prefill_s"]
    dur = d["end_s"] - d["start_s"]
    busy = {s: float(dur[d["stream"] == s].sum()) for s in ("compute", "h2d", "d2h", "disk")}
    transfer_stream = max(("h2d", "d2h", "disk"), key=lambda s: busy[s])
    return {f"{phase}_latency_s": wall / units, f"{phase}_compute_s": busy["compute"] / units,
            f"{phase}_transfer_s": busy[transfer_stream] / units, f"{phase}_transfer_stream": transfer_stream,
            f"{phase}_exposed_transfer_s": max(0.0, wall - busy["compute"]) / units,
            f"{phase}_tok_s": m[f"{phase}_tok_s"]}


def candidates(policy: str, model, hw, P: int):
    """(settings, workload) groups of 8 sequences, each in order of preference (the first that fits is used):
    Accelerate as one batch of 8, on CPU or else disk; FlexGen and TightLLM as in ``fixed_lp_groups``."""
    if policy == "static-accelerate":
        yield [({"offload": off}, Workload(P, GEN_LEN, SEQUENCES, 1)) for off in ("cpu", "disk")]
        return
    yield from fixed_lp_groups(policy, model, hw, P, SEQUENCES)


def best_run(policy: str, model, hw, P: int):
    """The best (by total throughput) of the first variant that fits in each group."""
    best, why = None, ""
    for group in candidates(policy, model, hw, P):
        for st, wl in group:
            try:
                tr = simulate(build_plan(policy, model, hw, wl, st), hw)
            except (PlanError, OffsimError) as e:
                why = str(e)
                continue
            if best is None or tr.metrics()["total_tok_s"] > best[2].metrics()["total_tok_s"]:
                best = (st, wl, tr)
            break
    return best, why


def main() -> None:
    hw = get_hardware("a800")
    prov = provenance(model="opt-175b (positions extended past 2048)", hardware="a800", sequences=SEQUENCES,
                      gen_len=GEN_LEN)
    rows = []
    for P in tqdm(PROMPTS, desc="prompt lengths"):
        model = model_for("opt-175b", P)
        for pol in ("static-accelerate", "flexgen", "tightllm"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res, why = best_run(pol, model, hw, P)
            if res is None:
                rows.append({"prompt_len": P, "policy": pol, "status": "infeasible", "reason": why[:300]})
                continue
            st, wl, tr = res
            row = {"prompt_len": P, "policy": pol, "status": "ok", "settings": json.dumps(st, default=list),
                   "gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches}
            row.update(phase_breakdown(tr, "decode", GEN_LEN - 1))
            row.update(phase_breakdown(tr, "prefill", P))
            rows.append(row)
    df = pd.DataFrame(rows)
    DIR.mkdir(parents=True, exist_ok=True)
    write_csv(df, DIR / "breakdown.csv", prov)

    # TightLLM against each baseline, per prompt length
    ok = df[df["status"] == "ok"].set_index(["prompt_len", "policy"])
    comp = []
    for P in PROMPTS:
        if (P, "tightllm") not in ok.index:
            continue
        t = ok.loc[(P, "tightllm")]
        for base in ("flexgen", "static-accelerate"):
            if (P, base) not in ok.index:
                comp.append({"prompt_len": P, "baseline": base, "note": "baseline infeasible (out of memory)"})
                continue
            b = ok.loc[(P, base)]
            comp.append({"prompt_len": P, "baseline": base,
                         "decode_latency_change_pct": 100 * (t["decode_latency_s"] / b["decode_latency_s"] - 1),
                         "decode_compute_ratio": t["decode_compute_s"] / b["decode_compute_s"],
                         "decode_transfer_change_pct": 100 * (t["decode_transfer_s"] / b["decode_transfer_s"] - 1),
                         "prefill_latency_change_pct": 100 * (t["prefill_latency_s"] / b["prefill_latency_s"] - 1),
                         "prefill_transfer_change_pct":
                             100 * (t["prefill_transfer_s"] / b["prefill_transfer_s"] - 1),
                         "baseline_below_tightllm_decode_pct": 100 * (1 - b["decode_tok_s"] / t["decode_tok_s"]),
                         "baseline_below_tightllm_prefill_pct": 100 * (1 - b["prefill_tok_s"] / t["prefill_tok_s"]),
                         "note": ""})
    cdf = pd.DataFrame(comp)
    write_csv(cdf, DIR / "summary.csv", prov)
    _plot(df, DIR / "breakdown.png")

    pd.set_option("display.width", 220)
    show = ["prompt_len", "policy", "gpu_batch_size", "num_gpu_batches", "decode_latency_s", "decode_compute_s",
            "decode_transfer_s", "decode_transfer_stream", "decode_exposed_transfer_s", "prefill_latency_s",
            "prefill_compute_s", "prefill_transfer_s"]
    print(df.reindex(columns=show).to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    print()
    print(cdf.to_string(index=False, float_format=lambda v: f"{v:,.1f}"))
    fg = cdf[cdf["baseline"] == "flexgen"].dropna(subset=["decode_compute_ratio"])
    finish({
        "vs_flexgen_decode_latency_change_pct": [round(fg["decode_latency_change_pct"].min(), 1),
                                       round(fg["decode_latency_change_pct"].max(), 1)],
        "vs_flexgen_decode_compute_ratio": [round(fg["decode_compute_ratio"].min(), 2),
                                  round(fg["decode_compute_ratio"].max(), 2)],
        "vs_flexgen_decode_transfer_change_pct": [round(fg["decode_transfer_change_pct"].min(), 1),
                                        round(fg["decode_transfer_change_pct"].max(), 1)],
        "paper_latency_drop_pct": PAPER["opt175b_latency_drop_pct"],
        "paper_compute_growth": PAPER["opt175b_compute_growth"],
        "paper_transfer_drop_pct": PAPER["opt175b_transfer_drop_pct"], **prov})


def _plot(df: pd.DataFrame, path: Path) -> None:
    """Stacked compute + not-hidden transfer, each relative to FlexGen's latency at that prompt length (linear; bars
    above the axis are clipped and labelled with their value)."""
    ok = df[df["status"] == "ok"]
    pols = ["static-accelerate", "flexgen", "tightllm"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    w = 0.27
    x = np.arange(len(PROMPTS))
    top = 1.6
    for ax, ph in ((axes[0], "decode"), (axes[1], "prefill")):
        fg = ok[ok["policy"] == "flexgen"].set_index("prompt_len")[f"{ph}_latency_s"]
        for n, pol in enumerate(pols):
            g = ok[ok["policy"] == pol].set_index("prompt_len")
            ref = np.array([fg.get(p, np.nan) for p in PROMPTS])
            comp = np.array([g.loc[p, f"{ph}_compute_s"] if p in g.index else np.nan for p in PROMPTS]) / ref
            exp = np.array([g.loc[p, f"{ph}_exposed_transfer_s"] if p in g.index else np.nan for p in PROMPTS]) / ref
            xs = x + (n - 1) * w
            ax.bar(xs, np.minimum(comp, top), w, color="#2ca02c", edgecolor="k", lw=0.3,
                   label="compute" if n == 0 else None)
            ax.bar(xs, np.clip(exp, 0, top - np.minimum(comp, top)), w, bottom=np.minimum(comp, top),
                   color="#ff7f0e", edgecolor="k", lw=0.3, label="transfer not hidden" if n == 0 else None)
            for xi, c, e in zip(xs, comp, exp):
                if np.isnan(c):
                    ax.text(xi, 0.02, "OOM", rotation=90, fontsize=7, ha="center", va="bottom")
                else:
                    tot = c + e
                    lab = POLICY_LABEL[pol][0] + (f" x{tot:.1f}" if tot > top else "")
                    ax.text(xi, min(tot, top) + 0.01, lab, fontsize=6, ha="center", va="bottom",
                            rotation=90 if tot > top else 0)
        ax.set_xticks(x, [f"{p // 1024}K" if p >= 1024 else "0.5K" for p in PROMPTS])
        ax.set_ylim(0, top + 0.35)
        ax.axhline(1, color="k", lw=0.5, ls=":")
        ax.set_ylabel(f"{ph} latency / FlexGen's")
        ax.set_title(f"OPT-175B, A800, 8 sequences: {ph} (A=Accelerate, F=FlexGen, T=TightLLM)", fontsize=9)
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    argparser(__doc__).parse_args()
    main()
