"""Prefill compute against the GPU's busy share: how fast the compute-bound prefill ops of each validation case ran
against their price, beside how busy the prefill kept the GPU (the finding behind ``costmodel.ClockModel``).

    python -m experiments.validation.prefill_duty [--splits h200_calib] [--hardware PROFILE]

Per case: tokens per compute op, the measured prefill time, the GPU's busy share over it (measured compute time over
prefill time), and measured over predicted prefill compute time (offsim re-simulating the case's plan on the
profile); then, for the cases whose ops are compute-bound (more rows than the ridge point), the medians of that
ratio for prefills that kept the GPU busy at most ``--busy`` of the time and for the busier ones. Prints Markdown.
"""
from __future__ import annotations

import collections
import statistics
import warnings

from offsim.analysis.validate import aggregate, find_cases, load_case, resimulate
from offsim.core import costmodel
from offsim.core.specs import get_hardware
from experiments.common import argparser


def _prefill_seconds(ops_by_kind) -> collections.Counter:
    out = collections.Counter()
    for step, _, kind, _, seconds in ops_by_kind:
        if step == 0:
            out[kind] += seconds
    return out


def rows(splits: list[str], hardware: str) -> list[dict]:
    hw = get_hardware(hardware)
    out = []
    for split in splits:
        for path in find_cases(f"results/validation/{split}"):
            case = load_case(path)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sim = aggregate(resimulate(case, hardware))
            m, s = _prefill_seconds(case["ops_by_kind"]), _prefill_seconds(sim["ops_by_kind"])
            wl = case["meta"]["workload"]
            prefill_s = case["metrics"]["prefill_s"]
            tokens = wl["gpu_batch_size"] * wl["prompt_len"]
            out.append({"split": split, "case": path.name.removesuffix(".case.json"), "tokens_per_op": tokens,
                        "prefill_s": prefill_s, "busy": m["compute"] / prefill_s,
                        "measured_over_predicted": m["compute"] / s["compute"],
                        "compute_bound": costmodel.clock_bound(hw, tokens)})
    return out


def report(rs: list[dict], busy: float) -> str:
    lines = ["| split | case | tokens per op | prefill s | GPU busy | compute measured / predicted |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rs, key=lambda r: (r["split"], r["busy"])):
        lines.append(f"| {r['split']} | {r['case']} | {r['tokens_per_op']} | {r['prefill_s']:.2f} | "
                     f"{r['busy']:.0%} | {r['measured_over_predicted']:.2f} |")
    bound = [r for r in rs if r["compute_bound"]]
    for name, sel in ((f"busy at most {busy:.0%}", [r for r in bound if r["busy"] <= busy]),
                      (f"busy over {busy:.0%}", [r for r in bound if r["busy"] > busy])):
        x = sorted(r["measured_over_predicted"] for r in sel)
        if len(x) >= 2:
            q = statistics.quantiles(x, n=4)
            lines += ["", f"Compute-bound prefills {name}: {len(x)}, measured / predicted {x[0]:.2f}-{x[-1]:.2f}, "
                          f"median {statistics.median(x):.2f} (quartiles {q[0]:.2f}-{q[2]:.2f})."]
        elif x:
            lines += ["", f"Compute-bound prefills {name}: 1, measured / predicted {x[0]:.2f}."]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparser(__doc__)
    ap.add_argument("--splits", nargs="+", default=["h200_calib"])
    ap.add_argument("--hardware", default="results/profiles/h200_offexec_v2.json")
    ap.add_argument("--busy", type=float, default=0.8, help="the busy share that splits the summary (default 0.8)")
    a = ap.parse_args(argv)
    print(report(rows(a.splits, a.hardware), a.busy))


if __name__ == "__main__":
    main()
