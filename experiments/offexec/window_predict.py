"""What offsim predicts a shallower compute run-ahead window does to host-bound plans (issue 14).

Two ops ahead instead of 16 cut the host issue of every issue-14 run at the same decode rate
(results/offexec/runahead2_b450f9a/). Before it becomes the default: on plans whose GPU ops are shorter than their
issue (small models, small batches), a window of two leaves the GPU waiting whenever one op's issue runs long. This
re-simulates the calibration cases whose measured host issue was the largest, each on its stored plan with the
windows given, and writes the table (markdown) and the commands that measure the same plans with those windows
on a GPU machine.

    python -m experiments.offexec.window_predict --out results/offexec/runahead2_b450f9a/window_predict.md \
        [--cases 6] [--windows 16,6,16 4,6,16 2,6,16]
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from experiments.common import argparser, provenance
from offsim import get_hardware, simulate
from offsim.core.io import read_commented_csv, read_json_object
from offsim.core.plan import Plan

CALIB = Path("results/validation/h200_calib")
REPORT = Path("results/validation/h200_v2_report/calib/validation.csv")
PROFILE = "results/profiles/h200_offexec_v2.json"


def _windows(text: str) -> tuple[int, int, int]:
    try:
        w = tuple(int(x) for x in text.split(","))
    except ValueError:
        w = ()
    if len(w) != 3 or min(w) < 1:
        raise argparse.ArgumentTypeError(f"a window is three positive integers COMPUTE,H2D,D2H, got {text!r}")
    return w


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("--out", required=True, help="the markdown file to write")
    ap.add_argument("--cases", type=int, default=6, help="how many of the most host-bound calibration cases")
    ap.add_argument("--windows", type=_windows, nargs="+", default=[(16, 6, 16), (4, 6, 16), (2, 6, 16)])
    args = ap.parse_args(argv)
    _, report = read_commented_csv(REPORT, "validation report")
    rows = report.dropna(subset=["measured_issue_frac"]).sort_values("measured_issue_frac", ascending=False)
    rows = rows.to_dict("records")
    head = ["case", "measured host issue", "measured total tok/s"] + \
        [f"offsim total tok/s, window {w[0]}" for w in args.windows] + \
        [f"window {w[0]} / {args.windows[0][0]}" for w in args.windows[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    cmds = []
    for r in rows[:args.cases]:
        case = r["case"]
        meta = read_json_object(CALIB / f"{case}.case.json", "case")["meta"]
        plan = Plan.load(CALIB / f"{case}.plan.json.gz")
        hw = get_hardware(PROFILE, gpu_mem_gb=meta.get("gpu_mem_gb", 16))
        tps = [simulate(dataclasses.replace(plan, run_ahead=w), hw, check_memory=False).metrics()["total_tok_s"]
               for w in args.windows]
        lines.append(f"| {case} | {float(r['measured_issue_frac']):.1%} | {float(r['measured_total_tok_s']):,.1f} | "
                     + " | ".join(f"{t:,.1f}" for t in tps) + " | "
                     + " | ".join(f"{t / tps[0] - 1:+.1%}" for t in tps[1:]) + " |")
        for w in args.windows:
            cmds.append(f"offexec run --plan {case}.plan.json --hardware {PROFILE} "
                        f"--gpu-mem-gb {meta.get('gpu_mem_gb', 16):g} --run-ahead {w[0]} {w[1]} {w[2]}")
    prov = provenance()
    text = (f"# offsim's prediction of shallower compute windows on host-bound plans\n\n"
            f"Written by `python -m experiments.offexec.window_predict --out {args.out} --cases {args.cases}` (commit "
            f"{prov.get('commit')}, "
            f"{prov.get('date')}): the {args.cases} calibration cases of `{CALIB}` with the largest measured host "
            f"issue (`{REPORT}`), each stored plan re-simulated on `{PROFILE}` with the compute, H2D and D2H "
            f"windows below (offexec's default: {args.windows[0]}). A prediction, not a measurement: the commands "
            f"at the end measure the same plans (after `gunzip -k` of each `*.plan.json.gz`).\n\n"
            + "\n".join(lines) + "\n\n```\n" + "\n".join(cmds) + "\n```\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
