"""Select-N's per-iteration choice: prefill and decode with their own interval N (issue 4, item 3).

One batch of requests on one GPU; for a fixed TTFT SLO and a sweep of TPOT SLOs, build the record, let the runtime
choose N per iteration (``request_intervals``) and simulate the result (``simulate_phased``): the N of the prefill and
of the decode steps, the host memory each uses, the reload paid when N changes (``switch_seconds``), TTFT and TPOT.

Raising N between iterations reloads the layers that become resident, and the offloaded sets of two intervals
(layers j with j % N == N − 1) are nested only when one interval divides the other: so the runtime changes N between
prefill and decode when the change is free (the prefill's offloaded layers are a subset of the decode's) or its
reload fits in the first decode step's slack.

Writes results/selectn/phases_<hw>_<budget>.csv (+ .png), prints a table, then one JSON line.

    python -m experiments.selectn.phases          # rtx3090 (24 GiB, PCIe 4.0 x16), OPT-13B, batch 1, prompt 480
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from experiments.common import ROOT, finish, provenance, pyplot
from offsim import OffsimError, Workload, get_hardware, get_model
from offsim.policies.selectn.policy import host_weight_bytes
from offsim.policies.selectn.record import build_record, request_intervals, simulate_phased

plt = pyplot()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="rtx3090")
    ap.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory budget, GiB (default: the card's)")
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--ttft-slo-ms", type=float, default=300.0)
    ap.add_argument("--tpot-slo-ms", type=float, nargs="+", default=[100, 150, 200, 250, 300, 400, 600, 1000])
    ap.add_argument("--out", default=str(ROOT / "results" / "selectn"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hw = get_hardware(args.hardware, gpu_mem_gb=args.gpu_mem_gb)
    model = get_model(args.model)
    wl = Workload(args.prompt_len, args.gen_len, args.batch, 1)
    tag = f"{args.hardware}_{hw.gpu_mem_bytes / 2**30:g}gib"
    prov = {**provenance(argv),
            "hardware": hw.name, "gpu_mem_bytes": hw.gpu_mem_bytes, "hardware_source": hw.source}
    rows = []
    for tpot_ms in args.tpot_slo_ms:
        rec = build_record(model, hw, args.ttft_slo_ms / 1e3, tpot_ms / 1e3, batches=(1, 2, 4, 8),
                           seq_lens=(256, 512, 1024))
        base = {"tpot_slo_ms": tpot_ms, "ttft_slo_ms": args.ttft_slo_ms}
        try:
            ch = request_intervals(rec, model, hw, wl)
        except OffsimError as e:
            rows.append({**base, "note": str(e)[:160]})
            continue
        ns = [c.interval for c in ch]
        r = simulate_phased(model, hw, wl, ns)
        rows.append({**base, "n_prefill": ns[0], "n_decode": max(ns[1:]),
                     "host_gb_prefill": host_weight_bytes(model, ns[0]) / 1e9,
                     "host_gb_decode": host_weight_bytes(model, max(ns[1:])) / 1e9,
                     "switch_ms": r["switch_s"] * 1e3, "ttft_ms": r["ttft_s"] * 1e3,
                     "tpot_mean_ms": sum(r["tpot_s"]) / len(r["tpot_s"]) * 1e3, "tpot_max_ms": max(r["tpot_s"]) * 1e3,
                     "meets_slo": r["ttft_s"] <= args.ttft_slo_ms / 1e3 and max(r["tpot_s"]) <= tpot_ms / 1e3,
                     "total_tok_s": r["total_tok_s"], "note": ""})
    df = pd.DataFrame(rows)
    csv = out / f"phases_{tag}.csv"
    with open(csv, "w") as f:
        f.write("# " + json.dumps({"experiment": "selectn_phases", "model": model.name, "workload": wl.to_dict(),
                                   "provenance": prov}) + "\n")
        df.to_csv(f, index=False)

    ok = df.dropna(subset=["n_prefill"]) if "n_prefill" in df else df.iloc[0:0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].step(ok["tpot_slo_ms"], ok["n_prefill"], where="mid", marker="o", label="prefill N")
    axes[0].step(ok["tpot_slo_ms"], ok["n_decode"], where="mid", marker="s", label="decode N")
    axes[0].set(xscale="log", xlabel="TPOT SLO (ms)", ylabel="interval N",
                title=f"{model.name}, {hw.name}, batch {args.batch}, TTFT SLO {args.ttft_slo_ms:g} ms")
    axes[0].legend()
    axes[1].plot(ok["tpot_slo_ms"], ok["host_gb_prefill"], marker="o", label="host GB, prefill")
    axes[1].plot(ok["tpot_slo_ms"], ok["host_gb_decode"], marker="s", label="host GB, decode")
    axes[1].plot(ok["tpot_slo_ms"], ok["tpot_max_ms"] / 1e3, marker="^", label="simulated max TPOT (s)")
    axes[1].set(xscale="log", xlabel="TPOT SLO (ms)", title="host memory of weights; simulated TPOT")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"phases_{tag}.png", dpi=110)
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(df.round(2).to_string(index=False))
    finish({"experiment": "selectn_phases", "model": model.name, "hardware": hw.name,
            "rows": df.round(4).to_dict(orient="records"), "csv": str(csv), "commit": prov["commit"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
