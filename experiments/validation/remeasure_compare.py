"""Cases measured twice, side by side: what a re-measurement at a later commit changed (issue 13).

    python -m experiments.validation.remeasure_compare OLD_DIR NEW_DIR [--hardware PROFILE] [--out CSV]

For every case (``TAG.case.json``) in both folders: the measured total tok/s of each, the change, whether the two
runs ran the same plan (the cases' ``plan_sha256``), the commits they were measured at, and offsim's error on each
(the plan stored beside each case, re-simulated on ``--hardware``, default the committed profile v2). Prints a
markdown table and a summary (median |change|, cases that moved more than 5 %), writes the CSV with ``--out``
(provenance on its first line), ends with one JSON line. Nothing is chosen by error: every case found in both
folders is listed, and cases in only one are named, as are cases whose two files are the same run (the same commit
and date in their metadata: not re-measured yet, so left out of the rows).

``--runs RUNS.jsonl --runs-commit C`` adds the cases a device call measured but whose case files did not come back
(``matrix``'s one line per case: its measured total): their rows re-simulate the old case's plan and say 'unknown'
for the plan and schedule, which only a case file records.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from experiments.common import provenance
from offsim.analysis.validate import load_case, resimulate
from offsim.core.errors import OffsimError
from offsim.core.plan import DEVICE_FIELDS, OP_FIELDS, Plan

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "results" / "profiles" / "h200_offexec_v2.json"
MOVED = 0.05  # a change of measured throughput larger than this is reported as moved


def compare(old_dir: Path, new_dir: Path, hardware: str) -> tuple[list[dict], list[str], list[str], list[str]]:
    """Rows for the cases re-measured (sorted by tag); the tags found only in the old / the new folder; the tags in
    both whose two files are the same run (same commit and date: not re-measured)."""
    tags = {p.name[:-len(".case.json")] for p in old_dir.glob("*.case.json")}
    new_tags = {p.name[:-len(".case.json")] for p in new_dir.glob("*.case.json")}
    rows, not_remeasured = [], []
    for tag in sorted(tags & new_tags):
        cases = {side: load_case(folder / f"{tag}.case.json") for side, folder in (("old", old_dir), ("new", new_dir))}
        run = {side: (c["meta"].get("commit"), c["meta"].get("date")) for side, c in cases.items()}
        if run["old"] == run["new"]:
            not_remeasured.append(tag)
            continue
        row = {"case": tag}
        for side, case in cases.items():
            meta = case["meta"]
            measured = float(case["metrics"]["total_tok_s"])
            predicted = resimulate(case, hardware).metrics()["total_tok_s"]
            row.update({f"{side}_commit": meta.get("commit", ""), f"{side}_plan_sha256": meta.get("plan_sha256", ""),
                        f"{side}_measured_total_tok_s": measured, f"{side}_offsim_error": predicted / measured - 1})
        row["change"] = row["new_measured_total_tok_s"] / row["old_measured_total_tok_s"] - 1
        row["same_plan"] = bool(row["old_plan_sha256"]) and row["old_plan_sha256"] == row["new_plan_sha256"]
        row["same_schedule"] = row["same_plan"] or same_schedule(old_dir, new_dir, tag)
        rows.append(row)
    return rows, sorted(tags - new_tags), sorted(new_tags - tags), not_remeasured


# what the simulator times of an op: every field of it (``plan.OP_FIELDS``, ``DEVICE_FIELDS``) but its position and
# its memory annotations (alloc, free), which a footprint change moves
SCHEDULE_FIELDS = tuple(f for f in OP_FIELDS + DEVICE_FIELDS if f not in ("id", "alloc", "free"))


def rows_from_runs(old_dir: Path, new_dir: Path, runs: Path, commit: str, hardware: str) -> list[dict]:
    """Rows for the cases in ``runs`` (matrix's runs.jsonl) that have an old case file but no new one: the new side
    is the line's measured total at ``commit``; plan and schedule unknown (None)."""
    rows = []
    for line in runs.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        tag = r.get("case")
        if not tag or "measured_total_tok_s" not in r or (new_dir / f"{tag}.case.json").exists() \
                or not (old_dir / f"{tag}.case.json").exists():
            continue
        old = load_case(old_dir / f"{tag}.case.json")
        measured_old, measured_new = float(old["metrics"]["total_tok_s"]), float(r["measured_total_tok_s"])
        predicted = resimulate(old, hardware).metrics()["total_tok_s"]
        rows.append({"case": tag, "old_commit": old["meta"].get("commit", ""),
                     "old_plan_sha256": old["meta"].get("plan_sha256", ""), "old_measured_total_tok_s": measured_old,
                     "old_offsim_error": predicted / measured_old - 1, "new_commit": commit, "new_plan_sha256": "",
                     "new_measured_total_tok_s": measured_new, "new_offsim_error": predicted / measured_new - 1,
                     "change": measured_new / measured_old - 1, "same_plan": None, "same_schedule": None})
    return rows


def same_schedule(old_dir: Path, new_dir: Path, tag: str) -> bool:
    """Whether the plans stored beside the two runs of ``tag`` have the same ops in the same order with the same
    dependencies and sizes (``SCHEDULE_FIELDS``), whatever their memory annotations and recorded fields; False when
    either plan is missing."""
    plans = []
    for folder in (old_dir, new_dir):
        f = folder / f"{tag}.plan.json.gz"
        if not f.exists():
            return False
        plans.append(Plan.load(f))
    a, b = plans
    if len(a.ops) != len(b.ops):
        return False
    key = lambda op: tuple(getattr(op, k) for k in SCHEDULE_FIELDS)  # noqa: E731
    return all(key(x) == key(y) for x, y in zip(a.ops, b.ops))


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | old tok/s (commit) | new tok/s (commit) | change | same plan | same schedule | offsim error "
             "old | new |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['old_measured_total_tok_s']:,.1f} ({r['old_commit']}) | "
                     f"{r['new_measured_total_tok_s']:,.1f} ({r['new_commit']}) | {r['change']:+.1%} | "
                     f"{_yes(r['same_plan'])} | {_yes(r['same_schedule'])} | "
                     f"{r['old_offsim_error']:+.1%} | {r['new_offsim_error']:+.1%} |")
    return lines


def _yes(flag) -> str:
    return "unknown" if flag is None else "yes" if flag else "no"


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {"cases": 0}
    ch = [abs(r["change"]) for r in rows]
    return {"cases": len(rows), "median_abs_change": statistics.median(ch),
            "moved_over_5pct": sum(c > MOVED for c in ch), "same_plan": sum(r["same_plan"] is True for r in rows),
            "same_schedule": sum(r["same_schedule"] is True for r in rows),
            "median_abs_offsim_error_old": statistics.median(abs(r["old_offsim_error"]) for r in rows),
            "median_abs_offsim_error_new": statistics.median(abs(r["new_offsim_error"]) for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="folder of the earlier cases (TAG.case.json)")
    ap.add_argument("new", type=Path, help="folder of the same cases measured again")
    ap.add_argument("--hardware", default=str(PROFILE), help="profile to re-simulate on (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as CSV here")
    ap.add_argument("--runs", type=Path, default=None,
                    help="matrix's runs.jsonl of the new measurement: adds the cases whose case files are missing")
    ap.add_argument("--runs-commit", default="", help="the commit the --runs lines were measured at")
    args = ap.parse_args(argv)
    if args.runs and not (args.runs.is_file() and args.runs_commit):
        ap.error(f"--runs {args.runs}: give an existing runs.jsonl and --runs-commit (the code it was measured at)")
    for p in (args.old, args.new):
        if not p.is_dir():
            ap.error(f"{p}: no such folder (give two folders of *.case.json)")
    try:
        rows, only_old, only_new, not_remeasured = compare(args.old, args.new, args.hardware)
        if args.runs:
            extra = rows_from_runs(args.old, args.new, args.runs, args.runs_commit, args.hardware)
            rows = sorted(rows + extra, key=lambda r: r["case"])
            only_old = [t for t in only_old if t not in {r["case"] for r in extra}]
    except OffsimError as e:
        ap.exit(2, f"remeasure_compare: error: {e}\n")
    print("\n".join(table(rows)))
    s = summary(rows)
    if only_old or only_new:
        print(f"\nonly in {args.old}: {', '.join(only_old) or 'none'}; only in {args.new}: "
              f"{', '.join(only_new) or 'none'}")
    if not_remeasured:
        print(f"\nnot re-measured (the same run in both folders): {', '.join(not_remeasured)}")
    if args.out and rows:
        import pandas as pd

        from offsim.core.provenance import write_csv

        write_csv(pd.DataFrame(rows), args.out, provenance(command="python -m experiments.validation."
                                                                   f"remeasure_compare {args.old} {args.new}"))
    print(json.dumps({"experiment": "remeasure_compare", **s, "only_old": only_old, "only_new": only_new,
                      "not_remeasured": not_remeasured}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
