"""Two 13B instances on two GPUs behind one PCIe 4.0 x16 link: TPOT over batch size with and without Select-N's
bandwidth coordinator, and FlexGen on the same shared link (issue 4, item 5).

Each GPU runs one instance (default OPT-13B and Llama-2-13B) at the same batch size, decoding at context
``--seq-len``. The link is the hardware preset's (a800: PCIe 4.0 x16, 26 GB/s), shared: an instance that gets a share
x of it is simulated on ``HardwareSpec.scaled_link(x)`` (``offsim.policies.selectn.coordinator``).

- selectn, no coordinator: each instance picks, alone, the interval with the most host memory that meets its TPOT
  SLO with the whole link (its own record's N_min); together they split the link evenly (each instance that moves
  weights gets 1/k of it), and TPOT is simulated at that share.
- selectn + coordinator: the MILP (cvxpy, HiGHS; the exact DP agrees) over both demand tables: every SLO met, Σ shares ≤ 1, host memory
  maximised; TPOT simulated at each instance's share. When even the least offloading oversubscribes the link, the
  coordinator says so and both run their fastest interval at an even split.
- flexgen: FlexGen at its best for that batch (``common.run_flexgen``: the 3 best LP optima over block shapes
  gbs x nb = batch, as the search makes them fit, simulated), each with
  half the link; TPOT = mean decode step of prompt seq_len − 16, gen 32 (mean context = seq_len).

Also times the coordinator's decision (MILP and exact DP) on the real demand tables, and on 8 instances.
Writes results/selectn/shared_link_<hw>_<budget>.csv (+ .png), prints a table, then one JSON line.

    python -m experiments.selectn.shared_link                  # a800 with a 32 GiB budget per GPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.common import ROOT, finish, provenance, pyplot
from offsim import OffsimError, Workload, get_hardware, get_model
from offsim.policies.selectn.coordinator import Instance, coordinate, instance_options
from offsim.policies.selectn.record import iteration_latency

from experiments.selectn.common import run_flexgen

plt = pyplot()


def even_share_latency(model, hw, b, s, n, k) -> float:
    """TPOT of interval n when the link is split evenly among k instances that move weights."""
    h = hw if k <= 1 else hw.scaled_link(1 / k)
    return iteration_latency(model, h, "decode", b, s, n).latency_s


def fastest(model, hw, b, s) -> int | None:
    for n in range(model.num_layers + 1, 0, -1):
        if iteration_latency(model, hw, "decode", b, s, n).fits:
            return n
    return None


def time_decision(insts, method, reps=20) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        coordinate(insts, method)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="a800")
    ap.add_argument("--gpu-mem-gb", type=float, default=32.0, help="GPU memory budget of each GPU, GiB")
    ap.add_argument("--models", nargs="+", default=["opt-13b", "llama-2-13b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--out", default=str(ROOT / "results" / "selectn"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hw = get_hardware(args.hardware, gpu_mem_gb=args.gpu_mem_gb)
    slo = args.tpot_slo_ms / 1e3
    s = args.seq_len
    models = [get_model(m) for m in args.models]
    names = [f"{m.name}#{i}" if args.models.count(m.name) > 1 else m.name for i, m in enumerate(models)]
    tag = f"{args.hardware}_{args.gpu_mem_gb:g}gib"
    prov = {**provenance(argv),
            "hardware": hw.name, "gpu_mem_bytes": hw.gpu_mem_bytes, "hardware_source": hw.source,
            "link_h2d_bytes_per_s": hw.h2d_pinned[-1][1]}
    rows, timing = [], []
    for b in tqdm(args.batches, desc="batches", unit="batch"):
        insts = [instance_options(m, hw, "decode", b, s, slo, name=nm) for m, nm in zip(models, names)]
        # -- without the coordinator: each alone takes its N_min, then they share the link evenly
        solo = []
        for m, inst in zip(models, insts):
            if inst.options:
                solo.append(coordinate([inst], "dp").choices[0].interval)
            else:
                solo.append(fastest(m, hw, b, s))
        movers = sum(1 for m, n in zip(models, solo) if n is not None and n <= m.num_layers)
        for m, nm, n in zip(models, names, solo):
            if n is None:
                rows.append({"batch": b, "scheme": "selectn, no coordinator", "instance": nm, "feasible": False})
                continue
            k = movers if n <= m.num_layers else 1
            lat = even_share_latency(m, hw, b, s, n, k)
            rows.append({"batch": b, "scheme": "selectn, no coordinator", "instance": nm, "feasible": True,
                         "interval": n, "link_share": (1 / k if n <= m.num_layers else 0.0), "tpot_s": lat,
                         "host_bytes": (m.num_layers // n) * m.layer_weight_bytes(), "meets_slo": lat <= slo})
        # -- with the coordinator
        try:
            alloc = coordinate(insts, "milp")
            note = ""
            timing.append({"batch": b, "milp_ms": time_decision(insts, "milp") * 1e3,
                           "dp_ms": time_decision(insts, "dp") * 1e3,
                           "options": sum(len(i.options) for i in insts)})
            for m, nm, c in zip(models, names, alloc.choices):
                lat = iteration_latency(m, c.hardware(hw, alloc.grid), "decode", b, s, c.interval).latency_s
                rows.append({"batch": b, "scheme": "selectn + coordinator", "instance": nm, "feasible": True,
                             "interval": c.interval, "link_share": c.share(alloc.grid), "tpot_s": lat,
                             "host_bytes": c.host_bytes, "meets_slo": lat <= slo})
        except OffsimError as e:
            note = str(e)
            fast = [fastest(m, hw, b, s) for m in models]
            movers = sum(1 for m, n in zip(models, fast) if n is not None and n <= m.num_layers)
            for m, nm, n in zip(models, names, fast):
                if n is None:
                    rows.append({"batch": b, "scheme": "selectn + coordinator", "instance": nm, "feasible": False,
                                 "note": note[:160]})
                    continue
                k = movers if n <= m.num_layers else 1
                lat = even_share_latency(m, hw, b, s, n, k)
                rows.append({"batch": b, "scheme": "selectn + coordinator", "instance": nm, "feasible": True,
                             "interval": n, "link_share": 1 / k if n <= m.num_layers else 0.0, "tpot_s": lat,
                             "host_bytes": (m.num_layers // n) * m.layer_weight_bytes(), "meets_slo": lat <= slo,
                             "note": "coordinator infeasible: " + note[:140]})
        # -- FlexGen, half the link each
        half = hw.scaled_link(1 / len(models))
        for m, nm in zip(models, names):
            try:
                r = run_flexgen(m, half, Workload(max(s - 16, 1), 32, b, 1))
                rows.append({"batch": b, "scheme": "flexgen", "instance": nm, "feasible": True,
                             "link_share": 1 / len(models), "tpot_s": r["tpot_mean_s"],
                             "host_bytes": r["host_weight_bytes"], "meets_slo": r["tpot_mean_s"] <= slo,
                             "note": r["settings"]})
            except OffsimError as e:
                rows.append({"batch": b, "scheme": "flexgen", "instance": nm, "feasible": False, "note": str(e)[:160]})
    df = pd.DataFrame(rows)

    # decision time at scale: 8 instances, the real tables repeated (a harder knapsack than 2)
    big = None
    real = instance_options(models[0], hw, "decode", 4, s, slo, name="x")
    if real.options:
        many = [Instance(f"gpu{k}", slo, real.options) for k in range(8)]
        try:
            big = {"instances": 8, "options": sum(len(i.options) for i in many),
                   "milp_ms": time_decision(many, "milp", 5) * 1e3, "dp_ms": time_decision(many, "dp", 5) * 1e3,
                   "same_host_bytes": coordinate(many, "milp").host_bytes == coordinate(many, "dp").host_bytes}
        except OffsimError as e:
            big = {"instances": 8, "error": str(e)[:160]}
    tdf = pd.DataFrame(timing)

    csv = out / f"shared_link_{tag}.csv"
    with open(csv, "w") as f:
        f.write("# " + json.dumps({"experiment": "selectn_shared_link", "seq_len": s, "tpot_slo_s": slo,
                                   "models": args.models, "decision_ms": timing, "decision_8_instances": big,
                                   "provenance": prov}) + "\n")
        df.to_csv(f, index=False)

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"selectn, no coordinator": "--", "selectn + coordinator": "-", "flexgen": ":"}
    for (scheme, nm), d in df[df["feasible"]].groupby(["scheme", "instance"], sort=False):
        axes[0].plot(d["batch"], d["tpot_s"] * 1e3, styles[scheme], marker="o", label=f"{scheme}: {nm}")
    axes[0].axhline(args.tpot_slo_ms, color="k", lw=1, label="TPOT SLO")
    axes[0].set(xscale="log", yscale="log", xlabel="batch (each instance)", ylabel="TPOT (ms)",
                title=f"two instances, one {hw.name} PCIe link ({hw.h2d_pinned[-1][1] / 1e9:.1f} GB/s), "
                      f"{args.gpu_mem_gb:g} GiB each")
    axes[0].legend(fontsize=7)
    host = df[df["feasible"]].groupby(["scheme", "batch"])["host_bytes"].sum().unstack(0) / 1e9
    host.plot(ax=axes[1], marker="o")
    axes[1].set(xscale="log", xlabel="batch (each instance)", ylabel="host memory for weights, both (GB)",
                title="host memory used")
    fig.tight_layout()
    fig.savefig(out / f"shared_link_{tag}.png", dpi=110)

    show = df.assign(tpot_ms=df["tpot_s"] * 1e3, host_gb=df["host_bytes"] / 1e9)
    with pd.option_context("display.width", 250, "display.max_colwidth", 60, "display.max_rows", 500):
        print(show[["batch", "scheme", "instance", "interval", "link_share", "tpot_ms", "host_gb", "meets_slo",
                    "note"]].round(3).to_string(index=False))
        print()
        print("coordinator decision time (median of 20), two instances:")
        print(tdf.round(3).to_string(index=False))
        print("eight instances:", big)
    summ = {sch: {"slo_met_points": int(d.groupby("batch")["meets_slo"].all().sum()),
                  "points": int(d["batch"].nunique())} for sch, d in df.fillna({"meets_slo": False}).groupby("scheme")}
    finish({"experiment": "selectn_shared_link", "hardware": hw.name, "gpu_mem_gib": args.gpu_mem_gb,
            "tpot_slo_ms": args.tpot_slo_ms, "seq_len": s, "summary": summ,
            "decision_ms_max": {"milp": float(tdf["milp_ms"].max()) if len(tdf) else None,
                                "dp": float(tdf["dp_ms"].max()) if len(tdf) else None},
            "decision_8_instances": big, "csv": str(csv), "commit": prov["commit"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
