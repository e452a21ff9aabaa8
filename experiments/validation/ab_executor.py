"""Is slow CPU attention the host or the executor? Two executors on the same stored plans, side by side (issue 13).

    python -m experiments.validation.ab_executor results/validation/ab_executor_23c5a0b

The folder holds one device session's runs (``.snap``-style script, command in its README's provenance): the plans
``PLAN.plan.json.gz`` (saved at b497c67), and for each plan, executor side and repeat a trace
``PLAN_SIDE_REPEAT.csv.gz`` and the run's log, with ``probes.jsonl`` (``offexec.hostprobe`` before every run).
Sides: ``old`` = offexec at b497c67 (the day the CPU-attention rows and runs agreed), ``new`` = the executor of the
commit the traces name, ``new14`` = the same with torch's CPU threads at 14 of the host's 16 (oversubscription by the
issuing and copy threads?).

For each run: measured prefill / decode / total tok/s, the decode CPU-attention ops' summed time (``cpu_compute``),
and offsim's price of those same ops on three profiles -- the one the run was planned on, profile v2, and profile v2
with its CPU-attention rows re-measured in the same device session (``--same-day PROFILE``) -- so the ratio in-run /
isolated says whether the ops ran slower inside the run than alone on the same host that day. Writes ``README.md``
(tables generated here, never edited) and ``ab.csv`` beside the runs.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pandas as pd

from experiments.common import argparser, provenance
from offsim.analysis.results import load_trace
from offsim.analysis.validate import _as_ran
from offsim.core.plan import Plan
from offsim.core.sim import simulate
from offsim.core.specs import get_hardware

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {"planned": ROOT / "results" / "profiles" / "h200_offexec.json",
            "v2": ROOT / "results" / "profiles" / "h200_offexec_v2.json"}
SIDES = {"old": "offexec at b497c67", "new": "offexec at the traces' commit",
         "new14": "the same, OMP_NUM_THREADS=14"}
RUN = re.compile(r"^(?P<plan>.+)_(?P<side>old|new14|new)_(?P<rep>\d+)\.csv\.gz$")


def _cpu_attn_s(trace) -> float:
    """Summed duration of the decode CPU-attention ops (kind ``cpu_compute``) of a trace, in seconds."""
    df = trace.df
    d = df[(df["kind"] == "cpu_compute") & (df["phase"] == "decode")]
    return float((d["end_s"] - d["start_s"]).sum())


def _predicted(plan_path: Path, meta: dict, profile: Path) -> tuple[dict, float]:
    """offsim's metrics and decode CPU-attention time for the stored plan as the run issued it, on ``profile``."""
    plan = _as_ran(Plan.load(plan_path), meta)  # graphs and disk tier as the trace recorded them (offsim validate's)
    hw = get_hardware(str(profile), gpu_mem_gb=meta.get("gpu_mem_gb"))
    trace = simulate(plan, hw, check_memory=False)
    return trace.metrics(), _cpu_attn_s(trace)


def rows(folder: Path, same_day: Path | None) -> pd.DataFrame:
    probes = {}
    if (folder / "probes.jsonl").exists():
        for line in (folder / "probes.jsonl").read_text().splitlines():
            p = json.loads(line)
            probes[p["at"]] = p
    profiles = dict(PROFILES)
    if same_day is not None:
        profiles["same_day"] = same_day
    cache: dict[tuple[str, str], tuple[dict, float]] = {}
    out = []
    for f in sorted(folder.glob("*.csv.gz")):
        m = RUN.match(f.name)
        if not m:
            continue
        trace = load_trace(f)
        meta = trace.meta
        mm = trace.metrics()
        row = {"plan": m["plan"], "side": m["side"], "repeat": int(m["rep"]), "commit": meta.get("commit"),
               "date": meta.get("date"),
               "probe_cpu_attn_ms": probes.get(f"{m['plan']}_{m['side']}_{m['rep']}", {}).get("cpu_attn_ms"),
               "run_probe_cpu_attn_ms": (meta.get("host_probe") or {}).get("cpu_attn_ms"),
               "measured_prefill_tok_s": mm["prefill_tok_s"], "measured_decode_tok_s": mm["decode_tok_s"],
               "measured_total_tok_s": mm["total_tok_s"], "measured_cpu_attn_s": _cpu_attn_s(trace)}
        for name, prof in profiles.items():
            key = (m["plan"], name)
            if key not in cache:
                cache[key] = _predicted(folder / f"{m['plan']}.plan.json.gz", meta, prof)
            pm, cpu_s = cache[key]
            row[f"{name}_total_tok_s"] = pm["total_tok_s"]
            row[f"{name}_decode_tok_s"] = pm["decode_tok_s"]
            row[f"{name}_cpu_attn_s"] = cpu_s
        out.append(row)
    return pd.DataFrame(out)


def _table(df: pd.DataFrame, cols: list[tuple[str, str, str]]) -> list[str]:
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(format(r[c], fmt) if fmt else str(r[c]) for _, c, fmt in cols) + " |")
    return lines


def write(folder: Path, same_day: Path | None) -> Path:
    df = rows(folder, same_day)
    if df.empty:
        raise SystemExit(f"{folder}: no runs named PLAN_SIDE_REPEAT.csv.gz")
    df.to_csv(folder / "ab.csv", index=False)
    has_same_day = "same_day_cpu_attn_s" in df
    df["in_run_over_same_day"] = (df["measured_cpu_attn_s"] / df["same_day_cpu_attn_s"]) if has_same_day else float("nan")
    df["in_run_over_v2"] = df["measured_cpu_attn_s"] / df["v2_cpu_attn_s"]
    prov = provenance(command=f"python -m experiments.validation.ab_executor {folder}"
                      + (f" --same-day {same_day}" if same_day else ""))
    commits = sorted(set(df["commit"].dropna()))
    text = ["# Slow CPU attention: the host or the executor? (issue 13)", "",
            f"Generated by `{prov['command']}` (commit {prov['commit']}, {prov['date'][:16]}Z) from the traces, logs and "
            f"`probes.jsonl` in this folder; do not edit by hand. Runs: one NVIDIA H200 host, traces' commit "
            f"{', '.join(commits)}, {str(df['date'].min())[:16]}Z to {str(df['date'].max())[:16]}Z; each run "
            "`offexec run --plan PLAN.plan.json.gz --hardware results/profiles/h200_offexec.json` with its warm-up, "
            "the two plans alternating, sides in the order new, old, new14, twice. Sides: "
            + "; ".join(f"`{k}` = {v}" for k, v in SIDES.items()) + ".", "",
            "## Each run", "",
            *_table(df.sort_values(["plan", "side", "repeat"]), [
                ("plan", "plan", ""), ("side", "side", ""), ("repeat", "repeat", ""),
                ("host probe ms", "probe_cpu_attn_ms", ".2f"), ("prefill tok/s", "measured_prefill_tok_s", ",.0f"),
                ("decode tok/s", "measured_decode_tok_s", ",.1f"), ("total tok/s", "measured_total_tok_s", ",.1f"),
                ("CPU attention s (in run)", "measured_cpu_attn_s", ".3f"),
                ("priced v2 s", "v2_cpu_attn_s", ".3f"),
                *([("priced same-day s", "same_day_cpu_attn_s", ".3f")] if has_same_day else []),
                ("in run / v2", "in_run_over_v2", ".2f"),
                *([("in run / same-day", "in_run_over_same_day", ".2f")] if has_same_day else [])]), "",
            "## By plan and side (median of the repeats)", ""]
    g = df.groupby(["plan", "side"]).agg(decode=("measured_decode_tok_s", "median"),
                                         total=("measured_total_tok_s", "median"),
                                         cpu_s=("measured_cpu_attn_s", "median"),
                                         v2_total=("v2_total_tok_s", "first"),
                                         **({"same_day_total": ("same_day_total_tok_s", "first")}
                                            if has_same_day else {})).reset_index()
    g["v2_err"] = g["v2_total"] / g["total"] - 1
    cols = [("plan", "plan", ""), ("side", "side", ""), ("decode tok/s", "decode", ",.1f"),
            ("total tok/s", "total", ",.1f"), ("CPU attention s", "cpu_s", ".3f"),
            ("offsim v2 total", "v2_total", ",.1f"), ("error v2", "v2_err", "+.1%")]
    if has_same_day:
        g["same_day_err"] = g["same_day_total"] / g["total"] - 1
        cols += [("offsim same-day total", "same_day_total", ",.1f"), ("error same-day", "same_day_err", "+.1%")]
    text += _table(g, cols)
    # the finding, from the data: each plan's old-vs-new decode ratio, and in-run over isolated CPU-attention time
    ratios = {}
    for plan, gp in g.groupby("plan"):
        d = dict(zip(gp["side"], gp["decode"]))
        if "old" in d and "new" in d:
            ratios[plan] = d["new"] / d["old"]
    text += ["", "## What it says", ""]
    if ratios:
        text.append("- Decode tok/s of today's executor over b497c67's on the same plan, same host, same hour: "
                    + ", ".join(f"{p} {r:.3f}" for p, r in ratios.items()) + ".")
    spread = df.groupby(["plan", "side"])["measured_decode_tok_s"].agg(lambda s: (s.max() - s.min()) / s.median())
    text.append(f"- Repeats of one side spread by up to {spread.max():.1%} in decode tok/s.")
    if has_same_day:
        r = df["in_run_over_same_day"]
        text.append(f"- The decode CPU-attention ops took {r.min():.2f}-{r.max():.2f}x (median {r.median():.2f}) "
                    "the time the same session's profile rows price them at: the ops run slower inside a run than "
                    "alone on the same host.")
    # the same plans in the calibration split's runs on earlier days (its re-measurement table: the earlier run and
    # the re-measured one, each with its commit): did the host of those days run them as today's does?
    for table in sorted((ROOT / "results" / "validation").glob("remeasure_calib_*/compare.csv")):
        earlier = pd.read_csv(table, comment="#").set_index("case")
        for plan, gp in g.groupby("plan"):
            if plan in earlier.index and "new" in set(gp["side"]):
                e = earlier.loc[plan]
                today = float(gp.loc[gp["side"] == "new", "total"].iloc[0])
                text.append(f"- {plan} in the calibration split ({table.parent.name}): {e['old_measured_total_tok_s']:,.1f} "
                            f"tok/s at {e['old_commit']}, {e['new_measured_total_tok_s']:,.1f} at {e['new_commit']}; "
                            f"today {today:,.1f} ({today / e['new_measured_total_tok_s']:.2f}x the latter).")
    probes = df["probe_cpu_attn_ms"].dropna()
    if len(probes):
        text.append(f"- The host probe before each run: {probes.min():.2f}-{probes.max():.2f} ms "
                    f"(median {statistics.median(probes):.2f}).")
    text.append("")
    out = folder / "README.md"
    out.write_text("\n".join(text))
    return out


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--same-day", type=Path, default=None,
                    help="a profile whose CPU-attention rows were measured in the runs' device session")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        ap.error(f"{args.folder}: no such folder")
    print(write(args.folder, args.same_day))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
