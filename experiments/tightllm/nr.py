"""What the KV distributor chooses, and why it pays only so much: N_r against context length, the compute/transfer
curves it balances, the exchange rate of recompute for transfer, and the GPU idle fraction of each policy.

    python -m experiments.tightllm.nr      # after tightllm_throughput.py; writes results/tightllm/nr/

Outputs:
- nr_vs_context.csv / .png: N_r / N_ctx at the first decode step of each case's best TightLLM configuration, and N_r
  over the 31 decode steps of one long run;
- balance.csv / .png: T_compute, T_h2d, T_disk of one layer against N_r for three representative decisions, with the
  chosen N_r (the curves the ILP balances, from offsim's cost model);
- exchange.csv: rho = extra compute seconds per transfer second saved, measured on those curves, against the
  first-order estimate 6·d_model·(link bytes/s)/(GPU FLOP/s): recomputing a token's KV through a full layer costs
  ~24·h^2 FLOP to save 4·h bytes (fp16 K and V) -- 6·h FLOP per byte. With all the step's GPU time idle, the best
  the distributor can do is cut the step to rho / (1 + rho) of the transfer-bound time;
- bounds.csv: that ceiling, 1 + 1/rho, for every model on C1 and C2, KV over PCIe or from disk;
- idle.csv / .png: GPU idle fraction (1 - compute busy / makespan) per policy and prompt length, from the
  throughput experiment.
"""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd


from experiments.common import argparser, finish, provenance, pyplot, write_csv
from experiments.tightllm.common import (GEN_LEN, HARDWARE, MODELS, OUT, POLICIES, POLICY_COLOR,
                             POLICY_LABEL, PROMPTS, Cache, model_for)

from offsim import Workload, get_hardware
from offsim.core.costmodel import gemm_flops_per_token
from offsim.policies.tightllm.kv_distributor import distributor
from offsim.policies.tightllm import policy as T

plt = pyplot()

DIR = OUT / "nr"
# (label, model, hardware, GPU GiB, percent, gbs, nb, prompt, batch index)
EXAMPLES = [
    ("OPT-13B RTX3090, KV on CPU (16x16, p512)", "opt-13b", "rtx3090", None, (95, 5, 0, 100, 0, 100), 16, 16, 512, 0),
    ("OPT-175B A800, KV on disk (8x4, p2048)", "opt-175b", "a800", None, (0, 50, 0, 0, 100, 0), 8, 4, 2048, 0),
    ("OPT-30B H200 16G, KV on CPU (16x3, p512)", "opt-30b", "h200", 16, (20, 80, 0, 100, 100, 0), 16, 3, 512, 0),
]


def _settings(row):
    return T.TightLLMSettings(**{k: tuple(v) if k == "percent" else v for k, v in row["settings"].items()})


def balance_and_exchange():
    rows, ex = [], []
    for label, m, h, gib, pct, gbs, nb, P, k in EXAMPLES:
        model, hw = model_for(m, P), get_hardware(h, gpu_mem_gb=gib)
        wl = Workload(P, GEN_LEN, gbs, nb)
        st = T.TightLLMSettings(percent=pct)
        d = T.decision_for(model, hw, wl, st, P, k)
        kvd = distributor(model, hw, st.transfer_model)
        n_star = kvd.decide(d)
        top = d.ctx_tokens if d.mem_hi is None else max(0, min(d.mem_hi, d.ctx_tokens))
        for n in sorted(set(np.linspace(0, top, 96).round().astype(int).tolist()) | {n_star}):
            c, hh, dk, dd = kvd.stream_seconds(d, n)
            rows.append({"example": label, "n_r": n, "compute_s": c, "h2d_s": hh, "disk_s": dk, "d2h_s": dd,
                         "layer_s": kvd.combine((c, hh, dk, dd)), "chosen": n == n_star})
        c0, h0, d0, _ = kvd.stream_seconds(d, 0)
        c1, h1, d1, _ = kvd.stream_seconds(d, n_star)
        x0, x1 = max(h0, d0), max(h1, d1)
        link = hw.disk_read_bytes_per_s if d0 >= h0 else hw.h2d_pinned[-1][1]
        flops = hw.gpu_peak_flops * max(y for _, y in hw.gemm_efficiency)
        rho_est = 6 * model.d_model * link / flops
        ex.append({"example": label, "n_ctx": d.ctx_tokens, "n_r": n_star, "layer_s_no_recompute": max(c0, x0),
                   "layer_s_chosen": kvd.objective(d, n_star), "gain_pct": 100 * (1 - kvd.objective(d, n_star)
                                                                                 / max(c0, x0)),
                   "rho_measured": (c1 - c0) / (x0 - x1) if x0 > x1 else float("nan"),
                   "rho_first_order": rho_est, "bound_step_ratio": rho_est / (1 + rho_est),
                   "bottleneck_without": "disk" if d0 >= h0 else "h2d"})
    return pd.DataFrame(rows), pd.DataFrame(ex)


def bounds() -> pd.DataFrame:
    """First-order ceiling of the KV distributor's decode speedup, per model and machine: when a step is bound by
    loading KV over a link of B bytes/s with the GPU idle, recomputing costs rho = (FLOP per KV byte) · B / F seconds
    of GPU per second of transfer saved (F: peak FLOP/s times the best GEMM efficiency; attention FLOPs left out),
    so the step shrinks at best to rho / (1 + rho) of its time: speedup <= 1 + 1/rho (less when weights also stream
    or the GPU is not idle)."""
    rows = []
    for h in HARDWARE:
        hw = get_hardware(h)
        F = hw.gpu_peak_flops * max(y for _, y in hw.gemm_efficiency)
        for m in MODELS:
            model = model_for(m, 512)
            # GEMM FLOPs of one token through a whole layer per byte of that token's KV in that layer (6·h for OPT;
            # more for GQA models, whose KV is smaller)
            fpb = gemm_flops_per_token(model, "layer") / model.kv_bytes_per_token()
            for link, B in (("PCIe H2D", hw.h2d_pinned[-1][1]), ("disk read", hw.disk_read_bytes_per_s)):
                rho = fpb * B / F
                rows.append({"hardware": h, "config": HARDWARE[h], "model": m, "kv_source": link,
                             "flop_per_kv_byte_recompute": fpb, "gpu_flop_per_link_byte": F / B,
                             "rho": rho, "max_decode_speedup": 1 + 1 / rho})
    return pd.DataFrame(rows)


def nr_from_cache():
    cache = Cache(OUT / "throughput" / "cases.jsonl")
    tl = [r for r in cache.rows.values() if r["policy"] == "tightllm" and r["status"] == "ok"]
    ctx = pd.DataFrame([{"config": r["config"], "hardware": r["hardware"], "model": r["model"],
                         "prompt_len": r["prompt_len"], "gpu_batch_size": r["gpu_batch_size"],
                         "num_gpu_batches": r["num_gpu_batches"], "n_r_first": r.get("n_r_first"),
                         "recompute_frac_first": r.get("recompute_frac_first"),
                         "recompute_frac_last": r.get("recompute_frac_last")} for r in tl])
    steps = []
    long = [r for r in tl if r["model"] == "opt-175b" and r["hardware"] == "a800" and r["prompt_len"] == 8192]
    for r in long[:1]:
        model, hw = model_for(r["model"], r["prompt_len"]), get_hardware(r["hardware"])
        wl = Workload(r["prompt_len"], GEN_LEN, r["gpu_batch_size"], r["num_gpu_batches"])
        nr = T.recompute_tokens(model, hw, wl, _settings(r))
        for i in range(1, GEN_LEN):
            for k, n in enumerate(nr[i]):
                steps.append({"run": f"{r['model']} {r['hardware']} p{r['prompt_len']} "
                                     f"{r['gpu_batch_size']}x{r['num_gpu_batches']}",
                              "step": i, "n_ctx": r["prompt_len"] + i - 1, "batch": k, "n_r": n})
    idle = pd.DataFrame([{"config": r["config"], "hardware": r["hardware"], "model": r["model"],
                          "prompt_len": r["prompt_len"], "policy": r["policy"], "gpu_idle_frac": r.get("gpu_idle_frac")}
                         for r in cache.rows.values() if r["status"] == "ok"])
    return ctx, pd.DataFrame(steps), idle


def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bal, ex = balance_and_exchange()
        ctx, steps, idle = nr_from_cache()
    prov = provenance(gen_len=GEN_LEN)
    DIR.mkdir(parents=True, exist_ok=True)
    write_csv(bal, DIR / "balance.csv", prov)
    write_csv(ex, DIR / "exchange.csv", prov)
    write_csv(ctx, DIR / "nr_vs_context.csv", prov)
    write_csv(steps, DIR / "nr_by_step.csv", prov)
    write_csv(idle, DIR / "idle.csv", prov)
    bd = bounds()
    write_csv(bd, DIR / "bounds.csv", prov)

    fig, axes = plt.subplots(1, len(EXAMPLES), figsize=(5 * len(EXAMPLES), 3.6))
    for ax, (label, *_rest) in zip(axes, EXAMPLES):
        g = bal[bal["example"] == label]
        ax.plot(g["n_r"], g["compute_s"] * 1e3, label="compute (N_r + 1 tokens, full layer)", color="#2ca02c")
        ax.plot(g["n_r"], g["h2d_s"] * 1e3, label="H2D (KV prefix + weight slice)", color="#1f77b4")
        if g["disk_s"].max() > 0:
            ax.plot(g["n_r"], g["disk_s"] * 1e3, label="disk read", color="#8c564b")
        ax.plot(g["n_r"], g["layer_s"] * 1e3, "k--", lw=1, label="max = layer time")
        n_star = int(g[g["chosen"]]["n_r"].iloc[0])
        ax.axvline(n_star, color="r", ls=":", label=f"ILP's N_r = {n_star}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("N_r")
        ax.set_ylabel("ms per layer")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DIR / "balance.png", dpi=130)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for (cfg, m), g in ctx.sort_values("prompt_len").groupby(["config", "model"]):
        axes[0].plot(g["prompt_len"], g["recompute_frac_first"], "o-" if cfg == "C2" else "s--", ms=3,
                     label=f"{m} {cfg}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(PROMPTS, [f"{p / 1024:g}K" for p in PROMPTS])
    axes[0].set_xlabel("prompt tokens (N_ctx at the first decode step)")
    axes[0].set_ylabel("N_r / N_ctx (batch 0)")
    axes[0].set_title("share of the context recomputed, best TightLLM config per case", fontsize=9)
    axes[0].legend(fontsize=6, ncol=2)
    axes[0].grid(True, alpha=0.3)
    if len(steps):
        for k, g in steps.groupby("batch"):
            axes[1].plot(g["n_ctx"], g["n_r"], label=f"batch {k}")
        axes[1].set_title(steps["run"].iloc[0] + ": N_r per decode step", fontsize=9)
        axes[1].set_xlabel("N_ctx")
        axes[1].set_ylabel("N_r")
        axes[1].legend(fontsize=6, ncol=2)
        axes[1].grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(DIR / "nr_vs_context.png", dpi=130)
    plt.close(fig)

    hws = [h for h in HARDWARE if h in set(idle["hardware"])]
    fig, axes = plt.subplots(len(hws), len(MODELS), figsize=(2.6 * len(MODELS), 2.6 * len(hws)), squeeze=False,
                             sharey=True)
    for a, h in enumerate(hws):
        for b, m in enumerate(MODELS):
            ax = axes[a][b]
            for pol in POLICIES:
                g = idle[(idle["hardware"] == h) & (idle["model"] == m) & (idle["policy"] == pol)]
                g = g.sort_values("prompt_len")
                ax.plot(g["prompt_len"], g["gpu_idle_frac"], "o-", ms=3, color=POLICY_COLOR[pol],
                        label=POLICY_LABEL[pol])
            ax.set_xscale("log", base=2)
            ax.set_xticks(PROMPTS, [f"{p / 1024:g}K" for p in PROMPTS])
            ax.set_ylim(0, 1)
            ax.set_title(f"{m} {HARDWARE[h]}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("GPU idle fraction")
    axes[0][0].legend(fontsize=6)
    fig.suptitle("GPU idle fraction per policy (best settings), against prompt length", fontsize=10)
    fig.tight_layout()
    fig.savefig(DIR / "idle.png", dpi=130)
    plt.close(fig)

    pd.set_option("display.width", 220)
    print(ex.to_string(index=False, float_format=lambda v: f"{v:,.3g}"))
    print()
    print(bd.pivot_table(index=["config", "model"], columns="kv_source", values="max_decode_speedup")
          .to_string(float_format=lambda v: f"{v:.2f}"))
    print()
    if len(ctx):
        print(ctx.pivot_table(index=["config", "model"], columns="prompt_len",
                              values="recompute_frac_first").to_string(float_format=lambda v: f"{v:.3f}"))
        print()
        print(idle.pivot_table(index=["config", "policy"], columns="prompt_len", values="gpu_idle_frac",
                               aggfunc="median").to_string(float_format=lambda v: f"{v:.2f}"))
    finish({"examples": ex[["example", "n_r", "gain_pct", "rho_measured", "rho_first_order"]]
            .round(3).to_dict("records"),
            "median_gpu_idle": idle.groupby("policy")["gpu_idle_frac"].median().round(3).to_dict()
            if len(idle) else {}, **prov})


if __name__ == "__main__":
    argparser(__doc__).parse_args()
    main()
