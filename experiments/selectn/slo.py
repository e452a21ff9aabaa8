"""Select-N vs FlexGen and the static policies under latency SLOs, across batch sizes (issue 4, item 5).

For each model: build Select-N's offline performance record (simulated) on the hardware and GPU budget, then for each
batch size run every policy on one batch of requests (prompt_len, gen_len) and report TTFT, TPOT, throughput
(FlexGen's definitions), GPU peak, host bytes of weights, and whether the requests meet both SLOs (TTFT <= SLO and
mean TPOT <= SLO, as serving papers count it).

- selectn: the runtime choice from the record, per iteration (``request_intervals``: max host memory within the
  SLOs; the record rounds the current batch and length up to its next grid point, so the choice is conservative);
  where the record says no interval can meet the SLO, the record's fastest interval, or, where the build never
  measured the point (early termination), the least offloading that fits (``fastest_interval``).
- selectn-nmax: Select-N with N_max of the actual workload (the least offloading that fits, simulated; normally
  the fastest interval) -- the latency Select-N gives up for host memory, and what it could do without the record's
  rounding to grid points.
- flexgen: FlexGen at its best for that batch: the search's candidates (``offsim.policies.flexgen.candidates``: the
  LP over every block shape with gpu_batch_size x num_gpu_batches = batch, GPU or CPU attention, the GPU weight share
  trimmed to fit exactly, the activations on either tier); the 3 best LP optima simulated, the best simulated
  throughput kept (FlexGen's own objective: it is not SLO-aware).
- static-accelerate (device_map: whole layers on the GPU as fit, the rest copied in synchronously, pageable) and
  static-zero (every layer streamed with prefetch, KV on the GPU, or on the CPU when that does not fit).

- selectn-measured (with ``--measured-record FILE``, a record measured on the device by ``offexec
  selectn-record``): the same runtime choice made from the measured record instead of the simulated one, and
  evaluated the same way (``simulate_phased``), so the two rows differ only by the record. Both selectn rows also
  carry what their record itself says of the chosen intervals (``record_ttft_s``, ``record_tpot_mean_s``,
  ``meets_slo_record``: the record's latencies at the covering grid points plus switches) -- for the measured
  record, SLO attainment as measured on the device.

Writes results/selectn/slo_<hw>_<budget>.csv (+ .png), the records record_<model>_<hw>_<budget>.csv and their
[N_min, N_max] tables ranges_<model>_<hw>_<budget>.csv (ranges_measured_... for a measured record); prints a
table and, last, one JSON line.

    python -m experiments.selectn.slo                       # h200, 24 GiB budget, OPT-13B and Llama-2-13B
    python -m experiments.selectn.slo --hardware rtx3090 --ttft-slo-ms 4000
    python -m experiments.selectn.slo --models llama-2-13b --measured-record results/selectn/measured_llama-2-13b.csv
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.common import ROOT, finish, provenance, pyplot
from experiments.selectn.common import run_flexgen, trace_row
from offsim import OffsimError, Workload, build_plan, get_hardware, get_model, simulate
from offsim.policies.selectn.record import (build_record, fastest_interval, request_intervals,
                                            simulate_phased)

plt = pyplot()

POLICY_ORDER = ["selectn", "selectn-nmax", "flexgen", "static-accelerate", "static-zero"]


def run_selectn(model, hw, wl, record) -> dict:
    """Select-N's per-iteration choice from ``record`` (simulated or measured), evaluated by ``simulate_phased``;
    ``record_*``: what the record itself says of the chosen intervals (None where it has no answer)."""
    rec = {"record_ttft_s": None, "record_tpot_mean_s": None, "record_source": record.meta.get("source", "offsim")}
    try:
        ch = request_intervals(record, model, hw, wl)
        ns = [c.interval for c in ch]
        how = "record" if all(c.meets_slo for c in ch) else "record (SLO unreachable: fastest)"
        if len(ch) > 1:
            rec.update(record_ttft_s=ch[0].latency_s,
                       record_tpot_mean_s=sum(c.latency_s for c in ch[1:]) / (len(ch) - 1))
    except OffsimError as e:  # the record has no interval for this point (terminated early / does not fit)
        ns = [fastest_interval(model, hw, wl)] * wl.gen_len
        how = f"workload N_max (record: {str(e).split(': ', 1)[-1][:60]}...)"
    r = simulate_phased(model, hw, wl, ns)
    return {"ttft_s": r["ttft_s"], "tpot_mean_s": sum(r["tpot_s"]) / len(r["tpot_s"]), "tpot_max_s": max(r["tpot_s"]),
            "total_tok_s": r["total_tok_s"], "decode_tok_s": r["decode_tok_s"], "peak_gpu_bytes": r["peak_gpu_bytes"],
            "host_weight_bytes": r["host_bytes_max"], **rec,
            "settings": f"N prefill {ns[0]}, decode {sorted(set(ns[1:]))}; {how}"}


def load_measured(paths, models, hw, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """Measured records by the model name they name; each must be one of ``models`` (names as ``get_model`` gives
    them) and built with the same GPU budget as ``hw`` -- else one line says which."""
    from offsim.policies.selectn.record import PerformanceRecord

    out = {}
    names = {get_model(m).name: m for m in models}
    for p in paths or []:
        rec = PerformanceRecord.from_csv(p)
        m = rec.meta.get("model")
        if m not in names:
            raise OffsimError(f"measured record {p} is for {m!r}, not one of --models {list(names)}")
        if not math.isclose(float(rec.meta.get("gpu_mem_bytes", -1)), float(hw.gpu_mem_bytes), rel_tol=1e-4):
            raise OffsimError(f"measured record {p} was built for a GPU budget of "
                              f"{rec.meta.get('gpu_mem_bytes', 0) / 2**30:.2f} GiB, this run has "
                              f"{hw.gpu_mem_bytes / 2**30:.2f} GiB (--gpu-mem-gb)")
        for k, slo in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
            if not math.isclose(float(rec.meta[k]), slo):
                raise OffsimError(f"measured record {p} was built for a {k[:4].upper()} SLO of "
                                  f"{float(rec.meta[k]) * 1e3:g} ms, this run asks {slo * 1e3:g} ms "
                                  f"(--{k[:4]}-slo-ms): rebuild it, or run with its SLOs")
        out[names[m]] = rec
    return out


def run_selectn_nmax(model, hw, wl) -> dict:
    n = fastest_interval(model, hw, wl)
    plan = build_plan("selectn", model, hw, wl, {"interval": n})
    return {**trace_row(simulate(plan, hw), plan), "settings": f"N {n}"}


def run_static(policy, model, hw, wl) -> dict:
    variants = [{}] if policy == "static-accelerate" else [{"kv_on_cpu": False}, {"kv_on_cpu": True}]
    err = None
    for st in variants:
        try:
            plan = build_plan(policy, model, hw, wl, st)
            row = trace_row(simulate(plan, hw), plan)
            row["settings"] = ", ".join(f"{k} {v}" for k, v in plan.settings.items())
            return row
        except OffsimError as e:
            err = e
    raise err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--gpu-mem-gb", type=float, default=24.0, help="GPU memory budget, GiB")
    ap.add_argument("--models", nargs="+", default=["opt-13b", "llama-2-13b"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--record-batches", type=int, nargs="+", default=[2**i for i in range(8)],
                    help="the simulated record's batch grid (powers of two)")
    ap.add_argument("--record-seq-lens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                    help="the simulated record's sequence-length grid (powers of two)")
    ap.add_argument("--measured-record", nargs="+", default=None, metavar="FILE",
                    help="records measured by `offexec selectn-record` (one per model): adds the policy "
                         "selectn-measured, Select-N choosing from the measured record")
    ap.add_argument("--out", default=str(ROOT / "results" / "selectn"))
    args = ap.parse_args(argv)
    try:
        return run(args, argv)
    except OffsimError as e:
        print(f"slo: error: {e}", file=sys.stderr)
        return 2


def run(args, argv) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hw = get_hardware(args.hardware, gpu_mem_gb=args.gpu_mem_gb)
    measured = load_measured(args.measured_record, args.models, hw, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    order = POLICY_ORDER[:1] + (["selectn-measured"] if measured else []) + POLICY_ORDER[1:]
    hw_tag = args.hardware if "/" not in args.hardware and not args.hardware.endswith(".json") else hw.name
    tag = f"{hw_tag}_{args.gpu_mem_gb:g}gib_p{args.prompt_len}"
    ttft_slo, tpot_slo = args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3
    prov = {**provenance(argv),
            "hardware": hw.name, "gpu_mem_bytes": hw.gpu_mem_bytes, "hardware_source": hw.source}
    rows = []
    for name in args.models:
        model = get_model(name)
        fname = name if "/" not in name and "\\" not in name else model.name  # a config.json path: its model name
        t0 = time.perf_counter()
        rec = build_record(model, hw, ttft_slo, tpot_slo, batches=tuple(args.record_batches),
                           seq_lens=tuple(args.record_seq_lens), progress=True)
        rec_s = time.perf_counter() - t0
        rec.meta["build_s"] = round(rec_s, 2)
        rec.to_csv(out / f"record_{fname}_{tag}.csv")
        rec.ranges().to_csv(out / f"ranges_{fname}_{tag}.csv", index=False)
        if name in measured:
            measured[name].ranges().to_csv(out / f"ranges_measured_{fname}_{tag}.csv", index=False)
        for b in tqdm(args.batches, desc=f"policies {name}", unit="batch"):
            wl = Workload(args.prompt_len, args.gen_len, b, 1)
            for pol in order:
                if pol == "selectn-measured" and name not in measured:
                    continue
                base = {"model": name, "batch": b, "policy": pol}
                try:
                    if pol == "selectn":
                        r = run_selectn(model, hw, wl, rec)
                    elif pol == "selectn-measured":
                        r = run_selectn(model, hw, wl, measured[name])
                    elif pol == "selectn-nmax":
                        r = run_selectn_nmax(model, hw, wl)
                    elif pol == "flexgen":
                        r = run_flexgen(model, hw, wl)
                    else:
                        r = run_static(pol, model, hw, wl)
                except OffsimError as e:
                    rows.append({**base, "feasible": False, "meets_slo": False, "settings": str(e)[:160]})
                    continue
                meets = r["ttft_s"] <= ttft_slo and r["tpot_mean_s"] <= tpot_slo
                if r.get("record_ttft_s") is not None:
                    r["meets_slo_record"] = r["record_ttft_s"] <= ttft_slo and r["record_tpot_mean_s"] <= tpot_slo
                rows.append({**base, "feasible": True, "meets_slo": meets, **r})
        print(f"{name}: record built in {rec_s:.1f} s ({len(rec.df)} rows)", file=sys.stderr)
    df = pd.DataFrame(rows)
    csv = out / f"slo_{tag}.csv"
    with open(csv, "w") as f:
        f.write("# " + json.dumps({"experiment": "selectn_slo", "prompt_len": args.prompt_len,
                                   "gen_len": args.gen_len, "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
                                   "provenance": prov}) + "\n")
        df.to_csv(f, index=False)

    # summary: SLO attainment over the sweep (share of batch sizes, and of requests), goodput
    summ = []
    for (name, pol), d in df.groupby(["model", "policy"], sort=False):
        ok = d[d["meets_slo"]]
        rec_meets = d["meets_slo_record"] if "meets_slo_record" in d else None
        summ.append({"model": name, "policy": pol,
                     "attain_points_record": (float(rec_meets.fillna(False).astype(bool).mean())
                                              if rec_meets is not None and rec_meets.notna().any() else None),
                     "attain_points": len(ok) / len(d), "attain_requests": ok["batch"].sum() / d["batch"].sum(),
                     "goodput_tok_s": float(ok["total_tok_s"].max()) if len(ok) else 0.0,
                     "goodput_batch": int(ok.loc[ok["total_tok_s"].idxmax(), "batch"]) if len(ok) else 0,
                     "max_tok_s": float(d["total_tok_s"].max()) if d["feasible"].any() else 0.0})
    summ = pd.DataFrame(summ)
    summ.to_csv(out / f"slo_{tag}_summary.csv", index=False)
    # FlexGen at its own optimum (any block size): what a throughput-oriented FlexGen run would pick
    fsearch = []
    for name in args.models:
        try:
            from offsim.search import search

            sr = search("flexgen", get_model(name), hw, args.prompt_len, args.gen_len)
            tr = simulate(build_plan("flexgen", get_model(name), hw, sr.workload, sr.settings), hw)
            r = trace_row(tr, build_plan("flexgen", get_model(name), hw, sr.workload, sr.settings))
            fsearch.append({"model": name, "batch": sr.workload.num_prompts, "settings": str(sr.settings),
                            "ttft_s": r["ttft_s"], "tpot_mean_s": r["tpot_mean_s"], "total_tok_s": r["total_tok_s"],
                            "meets_slo": r["ttft_s"] <= ttft_slo and r["tpot_mean_s"] <= tpot_slo})
        except (ImportError, OffsimError) as e:
            fsearch.append({"model": name, "error": str(e)[:160]})
    pd.DataFrame(fsearch).to_csv(out / f"slo_{tag}_flexgen_search.csv", index=False)

    # figure: TPOT and throughput over batch size, per model
    fig, axes = plt.subplots(2, len(args.models), figsize=(6 * len(args.models), 8), squeeze=False)
    for c, name in enumerate(args.models):
        d = df[(df["model"] == name) & df["feasible"]]
        for pol in order:
            p = d[d["policy"] == pol]
            axes[0, c].plot(p["batch"], p["tpot_mean_s"] * 1e3, marker="o", label=pol)
            axes[1, c].plot(p["batch"], p["total_tok_s"], marker="o", label=pol)
            met = p[p["meets_slo"]]
            axes[1, c].scatter(met["batch"], met["total_tok_s"], s=90, facecolors="none", edgecolors="k")
        axes[0, c].axhline(args.tpot_slo_ms, color="k", ls="--", lw=1, label="TPOT SLO")
        axes[0, c].set(xscale="log", yscale="log", xlabel="batch", ylabel="mean TPOT (ms)",
                       title=f"{name}, {hw.name} {args.gpu_mem_gb:g} GiB")
        axes[1, c].set(xscale="log", xlabel="batch", ylabel="total tok/s (circled: meets both SLOs)")
        axes[0, c].legend(fontsize=8)
    fig.suptitle(f"prompt {args.prompt_len}, gen {args.gen_len}; SLO TTFT {args.ttft_slo_ms:g} ms, TPOT "
                 f"{args.tpot_slo_ms:g} ms (offsim, simulated"
                 + ("; selectn-measured chooses from the record measured by offexec" if measured else "") + ")",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"slo_{tag}.png", dpi=110)

    show = df.assign(ttft_ms=df.get("ttft_s") * 1e3, tpot_ms=df.get("tpot_mean_s") * 1e3,
                     host_gb=df.get("host_weight_bytes") / 1e9, gpu_gib=df.get("peak_gpu_bytes") / 2**30)
    cols = ["model", "batch", "policy", "ttft_ms", "tpot_ms", "total_tok_s", "host_gb", "gpu_gib", "meets_slo",
            "settings"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 70, "display.max_rows", 500):
        print(show[cols].round(2).to_string(index=False))
        print()
        print(summ.round(3).to_string(index=False))
        print()
        print("FlexGen at its own optimum (policy search over every block size):")
        print(pd.DataFrame(fsearch).round(3).to_string(index=False))
    res = {"experiment": "selectn_slo", "hardware": hw.name, "gpu_mem_gib": args.gpu_mem_gb,
           "ttft_slo_ms": args.ttft_slo_ms, "tpot_slo_ms": args.tpot_slo_ms,
           "prompt_len": args.prompt_len, "gen_len": args.gen_len,
           "summary": summ.round(4).astype(object).where(summ.notna(), None).to_dict(orient="records"),
           "flexgen_search": fsearch, "csv": str(csv),
           "measured_records": {k: v.meta.get("provenance", {}).get("gpu") or v.meta.get("device")
                                for k, v in measured.items()},
           "commit": prov["commit"]}
    finish(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
