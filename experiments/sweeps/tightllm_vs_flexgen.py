"""TightLLM vs FlexGen over the design space: 2,000 points (5 models x the 4 hardware presets x 5 GPU budgets x 5
prompt lengths x 2 generation lengths x the 2 policies, each at its best simulated settings), run by ``offsim
sweep`` on Ray (experiments/sweeps/tightllm_vs_flexgen.yaml). Where does TightLLM's KV recompute pay, and by how
much?

    python -m experiments.sweeps.tightllm_vs_flexgen run [--workers N] [--out DIR] [--max-points N]
    python -m experiments.sweeps.tightllm_vs_flexgen report [--scaling DIR_1_WORKER]

``run`` is ``offsim sweep experiments/sweeps/tightllm_vs_flexgen.yaml --out DIR`` (default
results/sweeps/tightllm-vs-flexgen): a local Ray runtime with N workers (default: every core), resumable (rerun it
after an interrupt; answered points are skipped). About 25 minutes on 2 cores.

``report`` reads that table and writes, beside it: map_gen32.png and map_gen8.png (TightLLM / FlexGen total tok/s
per hardware, model, budget and prompt length), summary.csv (per hardware and model: points both answered,
TightLLM's wins, median and largest ratio), failures.csv (failed points by kind of reason), pareto.png, and
results/sweeps/README.md (generated: every number in
it is read from these files). With ``--scaling DIR`` (the same sweep run with ``--workers 1``) it also writes
scaling.csv: each sweep's wall time and points per second from their sweep.json run records, and whether the two
tables agree point for point (they must: the simulator is deterministic); a sweep's wall time there is the sum of
its runs' (an interrupted and resumed sweep: both segments). Always: resume.csv, each run of each sweep checked
against its journal (points skipped as answered before it, points run, points answered again: 0 when resuming
skips finished points; from the committed resume.csv where a journal is absent). Ends with one JSON line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import ROOT, argparser, finish, provenance, pyplot, results_dir, write_csv
from offsim.core.io import read_commented_csv
from offsim.search import grid

SPEC = Path(__file__).with_name("tightllm_vs_flexgen.yaml")
OUT = ROOT / "results" / "sweeps" / "tightllm-vs-flexgen"
README = ROOT / "results" / "sweeps" / "README.md"
RESULT_COLUMNS = ("status", "settings", "block_gpu_batch_size", "block_num_gpu_batches", "total_tok_s",
                  "decode_tok_s", "prefill_tok_s", "total_s", "peak_gpu_bytes")


def run(out: Path, workers: int | None, max_points: int | None) -> dict:
    from offsim.analysis.pareto import plot_pareto

    spec = grid.load_spec(SPEC)
    rec = grid.run_sweep(spec, out, workers=workers, progress=True, max_points=max_points,
                         command=provenance()["command"])
    _, df = grid.read_table(out)
    plt = pyplot()
    fig = plot_pareto(df, title=f"{spec.name}: latency vs throughput per policy (Pareto fronts)")
    fig.savefig(out / "pareto.png")
    plt.close(fig)
    return rec


# ---- report ------------------------------------------------------------------------------------------------------
def pairs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (hardware, model, budget, prompt, gen): both policies' total tok/s and status, the ratio."""
    keys = ["hardware", "model", "gpu_mem_gb", "prompt_len", "gen_len"]
    w = df.pivot_table(index=keys, columns="policy", values="total_tok_s", aggfunc="first", dropna=False)
    s = df.pivot_table(index=keys, columns="policy", values="status", aggfunc="first")
    out = pd.DataFrame({"flexgen_tok_s": w.get("flexgen"), "tightllm_tok_s": w.get("tightllm"),
                        "flexgen_status": s["flexgen"], "tightllm_status": s["tightllm"]}).reset_index()
    both = (out["flexgen_status"] == "ok") & (out["tightllm_status"] == "ok")
    out["ratio"] = np.where(both, out["tightllm_tok_s"] / out["flexgen_tok_s"], np.nan)
    return out


def summary(p: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (hw, m), g in p.groupby(["hardware", "model"], sort=False):
        r = g["ratio"].dropna()
        rows.append({"hardware": hw, "model": m, "cells": len(g), "both_ok": len(r),
                     "only_tightllm": int(((g["tightllm_status"] == "ok") & (g["flexgen_status"] != "ok")).sum()),
                     "only_flexgen": int(((g["flexgen_status"] == "ok") & (g["tightllm_status"] != "ok")).sum()),
                     "neither": int(((g["flexgen_status"] != "ok") & (g["tightllm_status"] != "ok")).sum()),
                     "tightllm_faster_5pct": int((r > 1.05).sum()), "flexgen_faster_5pct": int((r < 1 / 1.05).sum()),
                     "median_ratio": r.median() if len(r) else np.nan, "max_ratio": r.max() if len(r) else np.nan,
                     "min_ratio": r.min() if len(r) else np.nan})
    return pd.DataFrame(rows)


def plot_map(p: pd.DataFrame, gen_len: int, path: Path) -> None:
    """Rows: hardware; columns: model; each panel budget (y) x prompt length (x), coloured by log2 of TightLLM /
    FlexGen total tok/s; 'T'/'F': only TightLLM/FlexGen has an answer there; blank: neither."""
    plt = pyplot()
    g = p[p["gen_len"] == gen_len]
    hws, models = list(dict.fromkeys(g["hardware"])), list(dict.fromkeys(g["model"]))
    budgets, prompts = sorted(g["gpu_mem_gb"].unique()), sorted(g["prompt_len"].unique())
    fig, axes = plt.subplots(len(hws), len(models), figsize=(2.6 * len(models), 2.2 * len(hws)), squeeze=False,
                             sharex=True, sharey=True)
    norm = plt.Normalize(-1, 1)
    im = None
    for i, hw in enumerate(hws):
        for j, m in enumerate(models):
            ax = axes[i, j]
            c = g[(g["hardware"] == hw) & (g["model"] == m)].set_index(["gpu_mem_gb", "prompt_len"])
            z = np.full((len(budgets), len(prompts)), np.nan)
            for a, b in enumerate(budgets):
                for k, s in enumerate(prompts):
                    if (b, s) not in c.index:
                        continue
                    r = c.loc[(b, s)]
                    if r["tightllm_status"] == "ok" and r["flexgen_status"] == "ok":
                        z[a, k] = np.log2(r["ratio"])
                        ax.text(k, a, f"{r['ratio']:.2f}", ha="center", va="center", fontsize=5.5)
                    elif r["tightllm_status"] == "ok" or r["flexgen_status"] == "ok":
                        ax.text(k, a, "T" if r["tightllm_status"] == "ok" else "F", ha="center", va="center",
                                fontsize=7, weight="bold")
            im = ax.imshow(z, cmap="RdBu_r", norm=norm, origin="lower", aspect="auto")
            ax.set_xticks(range(len(prompts)), [str(s) for s in prompts], fontsize=6)
            ax.set_yticks(range(len(budgets)), [f"{b:g}" for b in budgets], fontsize=6)
            if i == 0:
                ax.set_title(m, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{hw}\nGPU budget (GiB)", fontsize=8)
            if i == len(hws) - 1:
                ax.set_xlabel("prompt length", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.6, label="log2(TightLLM / FlexGen total tok/s)")
    fig.suptitle(f"TightLLM / FlexGen total throughput, each at its best simulated settings, gen_len {gen_len} "
                 "(T, F: only that policy fits)", fontsize=10)
    fig.savefig(path)
    plt.close(fig)


def failure_reasons(df: pd.DataFrame) -> pd.DataFrame:
    """Failed points per policy and kind of reason: the reason with the search's preamble, op ids, times and sizes
    taken out, so that one cause is one row."""
    f = df[df["status"] != "ok"].copy()
    why = f["reason"].astype(str).str.replace(r"^no feasible \S+ setting for \S+ on \S+: ", "", regex=True)
    why = why.str.replace(r"op \d+ \((\w+) [^ ]+ step \d+ layer \d+ batch \d+\) at t=[\d.]+s", r"a \1 op",
                          regex=True)
    # numbers, but not those inside names (opt-30b, a800, h2d)
    f["kind"] = why.str.replace(r"(?<![A-Za-z\-\d])\d[\d.,]*(?![A-Za-z\d])", "#", regex=True).str.slice(0, 110)
    out = f.groupby(["policy", "kind"]).size().rename("points").reset_index()
    return out.sort_values(["points", "policy"], ascending=[False, True]).reset_index(drop=True)


def scaling(runs_a: dict, runs_b: dict, df_a: pd.DataFrame, df_b: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """Wall time and points/s of two sweeps of the same spec (from their sweep.json runs), and whether their
    tables agree on every result column of every point."""
    rows = []
    for label, runs, df in (("a", runs_a, df_a), ("b", runs_b, df_b)):
        ran = sum(r["ran"] for r in runs["runs"])
        wall = sum(r["wall_s"] for r in runs["runs"])
        rows.append({"sweep": label, "workers": "/".join(str(r["workers"]) for r in runs["runs"] if r["ran"]),
                     "runs": sum(1 for r in runs["runs"] if r["ran"]), "points_answered": ran, "wall_s": wall,
                     "points_per_s": ran / wall if wall else np.nan,
                     "point_wall_s_sum": float(df["wall_s"].sum()), "point_wall_s_median": float(df["wall_s"].median()),
                     "commits": ",".join(sorted({r["commit"] for r in runs["runs"]}))})
    a = df_a.set_index("point_id")[list(RESULT_COLUMNS)].sort_index()
    b = df_b.set_index("point_id")[list(RESULT_COLUMNS)].sort_index()
    same = a.index.equals(b.index) and a.equals(b)
    return pd.DataFrame(rows), same


def resume_check(label: str, d: Path, runs: dict) -> pd.DataFrame:
    """Per run of the sweep in ``d``: the points it skipped as already answered (its sweep.json record) and the
    points it ran, checked against the journal: the journal's lines, in order, split into the runs' ``ran`` counts;
    ``answered_before`` is the points answered (ok or failed) in earlier runs' lines, ``redone`` the points a run
    answered again although an earlier run had answered them (0 when resuming skips finished points)."""
    lines, bad = [], 0
    if not (d / grid.JOURNAL).exists():  # a checkout (journals are not committed): the rows resume.csv has
        kept = d.parent / "resume.csv"
        if kept.exists():
            old = read_commented_csv(kept, "resume")[1]
            if (old["sweep"] == label).any():
                return old[old["sweep"] == label].reset_index(drop=True)
        raise SystemExit(f"{d / grid.JOURNAL} is missing and resume.csv has no rows for {label}")
    with open(d / grid.JOURNAL) as f:
        for line in f:
            if line.strip():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    bad += 1
    rows, answered, at = [], set(), 0
    for i, r in enumerate(runs["runs"]):
        seg = lines[at:at + r["ran"]]
        at += r["ran"]
        ids = [x["point_id"] for x in seg]
        rows.append({"sweep": label, "run": i + 1, "workers": r["workers"], "interrupted": r["interrupted"],
                     "skipped": r["skipped"], "answered_before": len(answered), "ran": r["ran"],
                     "redone": len(set(ids) & answered), "wall_s": r["wall_s"],
                     "points_per_s": r["ran"] / r["wall_s"] if r["ran"] and r["wall_s"] else np.nan})
        answered |= {x["point_id"] for x in seg if x["status"] in grid.FINAL}
    out = pd.DataFrame(rows)
    out["journal_lines"] = len(lines)
    out["journal_bad_lines"] = bad
    out["journal_points"] = len({x["point_id"] for x in lines})
    return out


def _table(df: pd.DataFrame, fmt: dict) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(fmt.get(c, str)(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def report(out: Path, scaling_dir: Path | None) -> dict:
    header, df = grid.read_table(out)
    runs = json.loads((out / grid.RUNS).read_text())
    p = pairs(df)
    s = summary(p)
    prov = provenance(sweep=str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
                      sweep_commits=sorted({r["commit"] for r in runs["runs"]}))
    write_csv(s, out / "summary.csv", prov)
    fr = failure_reasons(df)
    write_csv(fr, out / "failures.csv", prov)
    for gl in sorted(p["gen_len"].unique()):
        plot_map(p, int(gl), out / f"map_gen{int(gl)}.png")
    from offsim.analysis.pareto import plot_pareto

    plt = pyplot()
    fig = plot_pareto(df, title=f"{header['spec']['name']}: latency vs throughput per policy (Pareto fronts)")
    fig.savefig(out / "pareto.png")
    plt.close(fig)
    both = p["ratio"].dropna()
    counts = df["status"].value_counts().to_dict()
    res = {"points": len(df), "ok": int(counts.get("ok", 0)), "failed": int(counts.get("failed", 0)),
           "error": int(counts.get("error", 0)), "cells": len(p), "both_ok": len(both),
           "tightllm_faster_5pct": int((both > 1.05).sum()), "flexgen_faster_5pct": int((both < 1 / 1.05).sum()),
           "median_ratio": float(both.median()), "max_ratio": float(both.max()), "min_ratio": float(both.min())}
    sc, same = None, None
    if scaling_dir is not None:
        _, df1 = grid.read_table(scaling_dir)
        runs1 = json.loads((scaling_dir / grid.RUNS).read_text())
        sc, same = scaling(runs1, runs, df1, df)
        sc["sweep"] = [str(scaling_dir.relative_to(ROOT)) if scaling_dir.is_relative_to(ROOT) else str(scaling_dir),
                       str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)]
        write_csv(sc.assign(tables_identical=same), out.parent / "scaling.csv", prov)
        res.update({"scaling_wall_s": sc["wall_s"].round(1).tolist(), "tables_identical": same})
    rel = lambda d: str(d.relative_to(ROOT)) if d.is_relative_to(ROOT) else str(d)  # noqa: E731
    rc = [resume_check(rel(out), out, runs)]
    if scaling_dir is not None:
        rc.append(resume_check(rel(scaling_dir), scaling_dir, runs1))
    rc = pd.concat(rc, ignore_index=True)
    write_csv(rc, out.parent / "resume.csv", prov)
    res.update({"resumed_runs": int((rc["run"] > 1).sum()), "redone": int(rc["redone"].sum()),
                "skipped_matches_journal": bool((rc["skipped"] == rc["answered_before"]).all())})
    runs_by = {rel(out): runs, **({rel(scaling_dir): runs1} if scaling_dir is not None else {})}
    _write_readme(header, runs, df, s, fr, res, sc, same, prov, rc, runs_by)
    return res


def _write_readme(header, runs, df, s, fr, res, sc, same, prov, rc, runs_by) -> None:
    f2 = lambda v: "" if pd.isna(v) else f"{v:.2f}"  # noqa: E731
    spec = header["spec"]
    g = spec["grid"]
    load = lambda r: "/".join(f"{x[0]:.1f}" if x else "?" for x in (r.get("loadavg_start"), r.get("loadavg_end")))  # noqa: E731
    pps = lambda r: f"{r['ran'] / r['wall_s']:.3f}" if r["ran"] and r["wall_s"] else ""  # noqa: E731
    run_lines = "\n".join(
        f"| `{d}` | {i + 1} | `{r['command']}` | {r['commit']} | {r['date'][:16]} | {r['machine']} | {r['workers']} | "
        f"{r['ran']} | {r['skipped']} | {r['wall_s']:.0f} | {pps(r)} | {load(r)} | "
        f"{'yes' if r['interrupted'] else 'no'} |"
        for d, rr in runs_by.items() for i, r in enumerate(rr["runs"]))
    text = f"""# Sweeps (`offsim sweep`)

Generated by `{prov['command']}` (commit {prov['commit']}, {prov['date'][:16]} UTC, {prov['machine']}) from the
tables in this folder; edit the generator (`experiments/sweeps/tightllm_vs_flexgen.py`), not this file.
How sweeps work: [docs/sweeps.md](../../docs/sweeps.md).

## TightLLM vs FlexGen over {res['points']:,} points: `tightllm-vs-flexgen/`

Spec: `experiments/sweeps/tightllm_vs_flexgen.yaml` -- models {', '.join(g['model'])}; hardware presets
{', '.join(g['hardware'])}; GPU budgets {', '.join(f'{b:g}' for b in g['gpu_mem_gb'])} GiB; prompt lengths
{', '.join(map(str, g['prompt_len']))}; generated tokens {', '.join(map(str, g['gen_len']))}; policies
{', '.join(g['policy'])}, each at its best simulated settings (`offsim search`, max_sims {spec['max_sims']}).
Throughput is FlexGen's total tok/s (prompts x gen_len / makespan). Simulated, no GPU.

Points: {res['ok']:,} answered, {res['failed']:,} failed (no setting of the policy fits; the reason of each is in
`sweep.csv`), {res['error']} error. Of the {res['cells']:,} (hardware, model, budget, prompt, gen) cells,
{res['both_ok']:,} have both policies answered: TightLLM is more than 5 % faster in {res['tightllm_faster_5pct']},
FlexGen in {res['flexgen_faster_5pct']}; the median TightLLM / FlexGen ratio is {res['median_ratio']:.3f}
(range {res['min_ratio']:.3f}-{res['max_ratio']:.3f}).

Per hardware and model (`summary.csv`; ratio = TightLLM / FlexGen total tok/s where both fit):

{_table(s, {'median_ratio': f2, 'max_ratio': f2, 'min_ratio': f2})}

Why points failed (`failures.csv`: per policy and kind of reason, numbers replaced by #):

{_table(fr.head(12), {})}

`map_gen32.png`, `map_gen8.png`: the ratio per budget and prompt length; `pareto.png`: latency (time to a block's
last token) against total tok/s, each policy's Pareto front per model and hardware.

Runs of this sweep{' and of its 1-worker twin' if sc is not None else ''} (each folder's `sweep.json`; a table's first
line holds its last run's provenance; points/s = points run / wall s of that run):

| sweep | run | command | commit | date (UTC) | machine | workers | points run | already answered | wall s | points/s | load avg start/end | interrupted |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{run_lines}
"""
    inter = rc[rc["interrupted"]]
    resumed = rc[rc["run"] > 1]
    text += f"""
## Interrupt and resume: `resume.csv`

Each run's record against the journal (`points.jsonl`, not committed: `resume.csv` is read from it): the journal's
lines in order, split by the runs' `points run`; `answered_before` is how many points earlier runs answered (ok or
failed), `redone` how many of this run's points an earlier run had already answered.

{_table(rc.drop(columns=["journal_lines", "journal_bad_lines", "journal_points"]),
        {'wall_s': lambda v: f'{v:,.0f}', 'points_per_s': lambda v: '' if pd.isna(v) else f'{v:.3f}'})}

{len(inter)} run(s) interrupted (SIGINT, as Ctrl-C), {len(resumed)} resumed run(s). Every run skipped exactly the
points the journal holds as answered before it: {'yes' if res['skipped_matches_journal'] else '**no**'}; points
answered again after an earlier run had answered them: {res['redone']}. Journals:
{'; '.join(f"`{d}` {g['journal_lines'].iloc[0]:,} lines, {g['journal_points'].iloc[0]:,} distinct points, "
           f"{g['journal_bad_lines'].iloc[0]} unreadable" for d, g in rc.groupby('sweep', sort=False))}.
"""
    if sc is not None:
        ratio = sc["wall_s"].iloc[0] / sc["wall_s"].iloc[1]
        text += f"""
## Wall time against workers: `scaling.csv`

The same spec run twice on this machine: with workers {sc['workers'].iloc[0]} (`{sc['sweep'].iloc[0]}`, in
{sc['runs'].iloc[0]} run(s)) and with workers {sc['workers'].iloc[1]} (`{sc['sweep'].iloc[1]}`, in
{sc['runs'].iloc[1]} run(s)). A sweep's `wall_s` is the sum of its runs' wall times (an interrupted sweep: the
segment before the interrupt plus the resumed one; each run includes its own Ray start and stop, and the points in
flight at an interrupt are cancelled and run again); `points_per_s` is points answered / that sum, and each run's
own points/s is in the runs table above. `point_wall_s_sum` is the time the points themselves took inside the
workers. The machine is shared: the 1-minute load average at the start and end of each run is in the runs table;
other work on the machine during a run slows its points.

{_table(sc, {'wall_s': lambda v: f'{v:,.0f}', 'points_per_s': lambda v: f'{v:.3f}',
             'point_wall_s_sum': lambda v: f'{v:,.0f}', 'point_wall_s_median': lambda v: f'{v:.2f}'})}

Speed-up of workers {sc['workers'].iloc[1]} over workers {sc['workers'].iloc[0]}: x{ratio:.2f} in summed wall time
(x{sc['points_per_s'].iloc[1] / sc['points_per_s'].iloc[0]:.2f} in points/s). The two tables
{'agree on every point (status, settings, block shape, throughputs, makespan, peak GPU bytes)' if same else
 '**differ**: see the report step' if sc['commits'].iloc[0] == sc['commits'].iloc[1] else
 f"**differ**: they ran at different commits ({sc['commits'].iloc[0]}; {sc['commits'].iloc[1]}), so the comparison "
 "says nothing about determinism, and the speed-up above compares two versions of the search as well as two worker "
 "counts: run the 1-worker sweep again at the same commit"}.
"""
    README.write_text(text)


def main() -> None:
    ap = argparser(__doc__)
    ap.add_argument("step", choices=("run", "report"))
    ap.add_argument("--out", type=Path, default=OUT, help="the sweep's directory (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=None, help="run: Ray workers (default: every core)")
    ap.add_argument("--max-points", type=int, default=None, help="run: answer at most N new points")
    ap.add_argument("--scaling", type=Path, default=None,
                    help="report: the same sweep run with --workers 1, for scaling.csv")
    args = ap.parse_args()
    results_dir("sweeps")
    if args.step == "run":
        try:
            rec = run(args.out, args.workers, args.max_points)
        except KeyboardInterrupt:  # the table of what is answered is written; the same command resumes
            print("interrupted: rerun the same command to finish the sweep", file=sys.stderr)
            raise SystemExit(130) from None
        finish({k: v for k, v in rec.items() if k != "tables"})
    else:
        finish(report(args.out.resolve(), args.scaling.resolve() if args.scaling else None))


if __name__ == "__main__":
    main()
