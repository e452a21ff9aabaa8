"""The issuing thread's time per op, handler by handler, as measured in real runs of one plan beside what the
profile's issue rows price it at (``costmodel.issue_seconds``, what ``offsim`` charges the host for each op).

A host-bound run (the issuing thread busy most of the run: many small GPU batches, small models) is predicted from
these rows alone, so when such a run misses, this table says which handlers the rows overprice or underprice, and
how much the same handler moves from run to run. Each run's log is an ``offexec run`` log (the JSON line it ends
with: ``issue_s_by_handler``); logs named ``PLAN_SIDE.log`` as ``runtime_ab.sh`` writes them (several runs appended)
are matched to the plan whose name they start with. Handlers are named as the executor names them
(``offexec.program.bind``); a graph replay's time (the executor's "NAME (graph)") is counted under its handler.

    python -m experiments.offexec.issue_rows results/offexec/host_bound_d753770/ab_hostbound \
        --plans results/offexec/host_bound_d753770/ab_hostbound/*.plan.json.gz \
        --profile v2=results/profiles/h200_offexec_v2.json \
        --profile same-call=results/offexec/host_bound_d753770/issue_rows_now.json [--out DIR/issue_rows.md]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from experiments.offexec.handler_profile import run_json
from offexec.model import layer_layout
from offexec.program import bind
from offsim.core.sim import issue_costs
from offsim.core.plan import Plan
from offsim.core.provenance import provenance
from offsim.core.specs import get_hardware


def plan_name(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".json").removesuffix(".plan")


def predicted_by_handler(plan: Plan, hw_path: str) -> tuple[Counter, Counter]:
    """(ops, predicted issue seconds) per executor handler over the whole plan, on profile ``hw_path``: each op's
    cost as the simulator charges the issuing thread (``sim.issue_costs``; 0 where the profile prices no issue)."""
    costs = issue_costs(plan, get_hardware(hw_path)) or [0.0] * len(plan.ops)
    fns = [b.fn for b in bind(plan, layer_layout(plan.model)).bound]
    ops, secs = Counter(), Counter()
    for fn, c in zip(fns, costs):
        ops[fn] += 1
        secs[fn] += c
    return ops, secs


def per_handler(issue_s_by_handler: dict) -> Counter:
    """A run's ``issue_s_by_handler`` with each graph replay's time ("NAME (graph)") counted under its handler."""
    out = Counter()
    for fn, s in issue_s_by_handler.items():
        out[fn.removesuffix(" (graph)")] += s
    return out


def runs_of(log: Path) -> list[dict]:
    """Every run's JSON line in ``log`` (runtime_ab.sh appends the runs of one side to one log)."""
    out = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith('{"measured"')]
    if not out:  # a single run's log: its last JSON line
        out = [run_json(log)]
    return out


def table(plan_path: Path, logs: list[Path], profiles: dict[str, str]) -> list[str]:
    plan = Plan.load(plan_path)
    runs = [(f"{lg.stem.removeprefix(plan_name(plan_path)).strip('_') or lg.stem} {i + 1}", r)
            for lg in logs for i, r in enumerate(runs_of(lg))]
    pred = {k: predicted_by_handler(plan, p) for k, p in profiles.items()}
    ops = next(iter(pred.values()))[0]
    measured = [per_handler(r["issue_s_by_handler"]) for _, r in runs]
    order = sorted(ops, key=lambda fn: -max(m[fn] for m in measured))
    head = ["handler", "ops"] + [f"{n} us/op" for n, _ in runs] + [f"{k} us/op" for k in pred]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for fn in order:
        cells = [fn, f"{ops[fn]:,}"] + [f"{m[fn] / ops[fn] * 1e6:,.1f}" for m in measured] \
            + [f"{p[1][fn] / ops[fn] * 1e6:,.1f}" for p in pred.values()]
        rows.append("| " + " | ".join(cells) + " |")
    tot = ["**all (s)**", f"{sum(ops.values()):,}"] + [f"{r['issue_s']:.2f}" for _, r in runs] \
        + [f"{sum(p[1].values()):.2f}" for p in pred.values()]
    rows.append("| " + " | ".join(tot) + " |")
    dec = ["decode tok/s (measured; offsim)", ""] + [f"{r['measured']['decode_tok_s']:,.1f}" for _, r in runs] \
        + ["" for _ in pred]
    rows.append("| " + " | ".join(dec) + " |")
    return [f"### `{plan_name(plan_path)}`", "", *rows, ""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.offexec.issue_rows", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a folder of offexec run logs (*.log), named PLAN[_SIDE].log")
    ap.add_argument("--plans", nargs="+", type=Path, required=True, help="the plans the logs ran (.json or .json.gz)")
    ap.add_argument("--profile", action="append", default=[], metavar="LABEL=PATH",
                    help="a hardware profile to price the plan's issue with (repeatable)")
    ap.add_argument("--out", type=Path, help="write the tables here (default: DIR/issue_rows.md)")
    a = ap.parse_args(argv)
    profiles = {}
    for p in a.profile or ["v2=results/profiles/h200_offexec_v2.json"]:
        label, sep, path = p.partition("=")
        if not sep or not Path(path).is_file():
            print(f"issue_rows: --profile wants LABEL=PATH of a profile JSON, got {p!r}", file=sys.stderr)
            return 2
        profiles[label] = path
    missing = [str(p) for p in a.plans if not p.is_file()]
    if missing or not a.dir.is_dir():
        print(f"issue_rows: not found: {', '.join(missing) or a.dir}", file=sys.stderr)
        return 2
    body = []
    for pp in a.plans:
        logs = sorted(a.dir.glob(f"{plan_name(pp)}*.log"))
        if logs:
            body += table(pp, logs, profiles)
    if not body:
        print(f"issue_rows: no log in {a.dir} starts with a plan's name", file=sys.stderr)
        return 2
    prov = provenance()
    text = ["# The issuing thread's time per op: measured runs beside the profile's issue rows", "",
            f"Generated by `python -m experiments.offexec.issue_rows {' '.join(sys.argv[1:] if argv is None else argv)}` "
            f"(commit {prov['commit']}, {prov['date'][:10]}) "
            f"from the logs in this folder; do not edit by hand. Per handler (the executor's names; a graph replay "
            f"counted under its handler): microseconds of the issuing thread per op in each run, then what each "
            f"profile's issue rows price it at (`costmodel.issue_seconds`: {', '.join(f'{k} = `{v}`' for k, v in profiles.items())}). "
            f"'all' is the run's whole issue time and the prediction's.", "", *body]
    out = a.out or a.dir / "issue_rows.md"
    out.write_text("\n".join(text))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
