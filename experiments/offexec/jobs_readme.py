"""README of the offline jobs measured on the H200 (issue 20), generated from each job folder's ``job.json``.

    python -m experiments.offexec.jobs_readme results/offline_jobs/h200

Each sub-folder is one ``offexec job SPEC --out DIR`` (``experiments/offexec/jobs/``): ``job.json`` (the report),
``blocks.csv`` / ``blocks.jsonl`` (each block measured beside offsim's prediction), ``requests.csv``, ``best.json``
(the settings the job started with) and ``run.log``. A policy the command's ``--time-limit-s`` stopped before it ran
is listed as not measured; the same command, given the folder back, resumes it.

    python -m experiments.offexec.jobs_readme results/offline_jobs/h200 --explain

first writes ``misses.csv``: for every measured block off by more than 5 %, its prefill and its mean decode step
measured against offsim's exact simulation of the block's plan (every step; the job's own prediction simulates
long blocks in pieces, docs/jobs.md §6), the simulated streams' busy shares, and the host's issue time measured
and priced -- where a miss is, before why. The README's section on the misses is generated from it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import argparser, provenance

MISS = 0.05  # a block whose offsim time is off by more than this is explained in misses.csv
MISSES = "misses.csv"
MISS_COLUMNS = ("task_kind", "policy", "block", "batch_prompt_lens", "gen_len", "measured_s", "job_predicted_s",
                "exact_predicted_s", "measured_prefill_s", "predicted_prefill_s", "prefill_error",
                "measured_decode_step_s", "predicted_decode_step_s", "decode_error", "measured_issue_s",
                "predicted_issue_s")  # and busy_<stream> per simulated stream
MASK_FIX = "314b9be"  # the commit that took the masked decode attention off cuDNN (``_block_runs``)


def _rows(folder: Path) -> list[tuple[Path, dict, dict]]:
    """(job folder, named for its task kind; job report; policy entry) for every policy of every job folder, sorted by kind then policy."""
    out = []
    for f in sorted(folder.glob("*/job.json")):
        job = json.loads(f.read_text())
        for p in job.get("policies", []):
            out.append((f.parent, job, p))
    return out


def _measured_at(folder: Path, job: dict, policy: str) -> str:
    """Commit(s) and date of the blocks of ``policy``, from ``blocks.jsonl`` (a resumed job's blocks can come from
    several runs, each with its own provenance); the job report's own provenance (its last run) when none."""
    runs = set()
    journal = folder / "blocks.jsonl"
    if journal.exists():
        for line in journal.read_text().splitlines():
            b = json.loads(line)
            if b.get("policy") == policy and b.get("provenance"):
                runs.add((b["provenance"].get("commit", "?"), str(b["provenance"].get("date", "?"))[:16] + "Z"))
    if not runs:
        prov = job.get("provenance", {})
        runs = {(prov.get("commit", "?"), str(prov.get("date", "?"))[:16] + "Z")}
    return "; ".join(f"{c}, {d}" for c, d in sorted(runs, key=lambda r: r[1]))


def _table(rows) -> list[str]:
    lines = ["| task kind | policy | batching | block (gbs x nb) | blocks | completion s | offsim s | error | "
             "output tok/s | p50 / p99 request s (offsim) | padding | measured at |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for job_dir, job, p in rows:
        kind = job_dir.name
        when = _measured_at(job_dir, job, p["policy"])
        if p.get("incomplete") or "completion_s" not in p:
            lines.append(f"| {kind} | {p['policy']} | {job.get('batching', '')} | | | not measured | | | | | | "
                         f"{when}: {p.get('error', '')} |")
            continue
        lines.append(
            f"| {kind} | {p['policy']} | {p['batching']} | {p['gpu_batch_size']} x {p['num_gpu_batches']} | "
            f"{p['blocks']} | {p['completion_s']:.2f} | {p['predicted_completion_s']:.2f} | "
            f"{p['completion_error']:+.1%} | {p['output_tok_s']:.2f} | {p['p50_request_s']:.1f} / "
            f"{p['p99_request_s']:.1f} ({p['predicted_p50_request_s']:.1f} / {p['predicted_p99_request_s']:.1f}) | "
            f"{p['padding_waste']:.1%} | {when} |")
    return lines


def explain(folder: Path, miss: float = MISS) -> Path:
    """``misses.csv``: each measured block off by more than ``miss``, split into prefill and decode, beside offsim's
    exact simulation of its plan (see the module docstring)."""
    from experiments.offexec.job_block_plan import block_plan
    from offexec.job import JOURNAL, Journal
    from offsim.core import costmodel
    from offsim.core.io import read_commented_csv, write_commented_csv
    from offsim.core.sim import simulate
    from offsim.search.job import token_table

    rows = []
    for job_dir, job, p in _rows(folder):
        blocks_csv = job_dir / "blocks.csv"
        if "completion_error" not in p or not blocks_csv.exists():
            continue
        blocks = read_commented_csv(blocks_csv, "blocks")[1]
        off = blocks[(blocks["policy"] == p["policy"]) & (blocks["error"].abs() > miss)]
        journal = {d["block"]: d for d in Journal(job_dir / JOURNAL).lines.values() if d["policy"] == p["policy"]}
        spec = Path(job["provenance"]["spec"])  # the spec the job ran (its provenance), from the repository root
        for b in off.itertuples():
            plan, hw = block_plan(spec, job_dir, p["policy"], int(b.block), None)
            trace = simulate(plan, hw)
            _, pred = token_table(trace, plan.workload)
            meas = np.asarray(journal[int(b.block)]["token_end_s"], dtype=float)
            mp, pp = meas.max(axis=1), pred.max(axis=1)
            steps = len(mp) - 1
            busy = trace.busy_by(("stream",)).set_index("stream")["sum"] / trace.makespan_s
            relay = plan.pageable_copy == "relay"  # as the simulator prices each op's issue (sim.simulate)
            issue_pred = sum(costmodel.issue_seconds(op, hw, plan.graph_q_tokens, plan.model, relay)
                             for op in plan.ops)
            rows.append({
                "task_kind": job_dir.name, "policy": p["policy"], "block": int(b.block),
                "batch_prompt_lens": b.batch_prompt_lens, "gen_len": int(b.gen_len),
                "measured_s": float(b.measured_s), "job_predicted_s": float(b.predicted_s),
                "exact_predicted_s": float(trace.makespan_s),
                "measured_prefill_s": float(mp[0]), "predicted_prefill_s": float(pp[0]),
                "prefill_error": float(pp[0] / mp[0] - 1),
                "measured_decode_step_s": float((mp[-1] - mp[0]) / steps),
                "predicted_decode_step_s": float((pp[-1] - pp[0]) / steps),
                "decode_error": float((pp[-1] - pp[0]) / (mp[-1] - mp[0]) - 1),
                **{f"busy_{k}": float(v) for k, v in busy.items()},
                "measured_issue_s": float(b.issue_frac * b.measured_s),
                "predicted_issue_s": float(issue_pred)})
    out = folder / MISSES
    # (no miss: the header alone, so that the README can say so)
    df = pd.DataFrame(rows) if rows else pd.DataFrame(columns=MISS_COLUMNS)
    write_commented_csv(out, provenance(command=f"python -m experiments.offexec.jobs_readme {folder} --explain",
                                        miss=miss), df)
    return out


def _misses(folder: Path) -> list[str]:
    """The README's section on the misses, from ``misses.csv`` (absent: none)."""
    from offsim.core.io import read_commented_csv

    path = folder / MISSES
    if not path.exists():
        return []
    head, df = read_commented_csv(path, "misses")
    if df.empty:
        return ["## Where the misses are", "",
                f"No measured block is off by more than {head.get('miss', MISS):.0%} against offsim "
                f"(`{MISSES}`, `python -m experiments.offexec.jobs_readme {folder} --explain`, commit "
                f"{head.get('commit', '?')}).", ""]
    streams = [c for c in df.columns if c.startswith("busy_")]
    lines = ["## Where the misses are", "",
             f"Generated from `{MISSES}` (`python -m experiments.offexec.jobs_readme {folder} --explain`, commit "
             f"{head.get('commit', '?')}): every block off by more than {head.get('miss', MISS):.0%}, its prefill and "
             "its mean decode step measured against offsim's exact simulation of the block's plan; the simulated "
             "streams' busy shares of the block; the host's issue time as offexec measured it (issue share x block) "
             "and as offsim prices the block's ops. Errors are offsim / measured - 1 (time).", "",
             "| task kind | policy | block | prompts | gen | measured s | offsim exact s | prefill s (offsim, error) | "
             "decode step s (offsim, error) | " + " | ".join(c.removeprefix("busy_") + " busy" for c in streams)
             + " | host issue s measured / priced |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in streams)
             + " | --- |"]
    for r in df.itertuples():
        busy = " | ".join("" if pd.isna(getattr(r, c)) else f"{getattr(r, c):.0%}" for c in streams)
        lines.append(f"| {r.task_kind} | {r.policy} | {r.block} | {r.batch_prompt_lens} | {r.gen_len} | "
                     f"{r.measured_s:.1f} | {r.exact_predicted_s:.1f} | {r.measured_prefill_s:.2f} "
                     f"({r.predicted_prefill_s:.2f}, {r.prefill_error:+.1%}) | {r.measured_decode_step_s:.3f} "
                     f"({r.predicted_decode_step_s:.3f}, {r.decode_error:+.1%}) | {busy} | "
                     f"{r.measured_issue_s:.1f} / {r.predicted_issue_s:.1f} |")
    return lines + [""]


ROOT = Path(__file__).resolve().parents[2]
# TightLLM's job blocks run alone before and after the masked-decode fix (314b9be), with traces
BLOCK_RUNS = (("before", ROOT / "results" / "offexec" / "masked_decode_8fefc11", "_plan"),
              ("after", ROOT / "results" / "offexec" / "masked_decode_fix_124c502", ""))


def _has_fix(commit: str) -> bool | None:
    """Whether ``commit`` contains ``MASK_FIX`` (git's ancestry); None where git cannot say."""
    import subprocess

    try:
        r = subprocess.run(["git", "merge-base", "--is-ancestor", MASK_FIX, commit.split("+")[0]], cwd=ROOT,
                           capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(r.returncode)


def _since_fix(folder: Path) -> str:
    """Which TightLLM jobs ran every block at a commit with the fix, and which not (``_has_fix``), from their
    journals."""
    from offexec.job import JOURNAL, Journal

    after, before = [], []
    for job_dir, _, p in _rows(folder):
        if p["policy"] != "tightllm" or not (job_dir / JOURNAL).exists():
            continue
        commits = {str(d.get("provenance", {}).get("commit", "?")) for d in Journal(job_dir / JOURNAL).lines.values()
                   if d["policy"] == "tightllm"}
        fixed = [_has_fix(c) for c in commits]
        (after if fixed and all(fixed) else before).append(f"{job_dir.name} ({', '.join(sorted(commits))})")
    said = []
    if after:
        said.append("TightLLM's blocks of " + "; ".join(after) + " ran with the fix")
    if before:
        said.append("those of " + "; ".join(before) + " ran before it (or git cannot tell)")
    return (" and ".join(said) + ".") if said else ""


def _block_runs(folder: Path) -> list[str]:
    """The README's section on the cause found since the jobs ran: block 0 of TightLLM's long jobs run alone with the
    executor of the jobs and with the fix, from those runs' ``runs.csv`` (``experiments/offexec/runs_table.py``)."""
    got = {}
    for when, runs, suffix in BLOCK_RUNS:
        if not (runs / "runs.csv").exists():
            return []
        df = pd.read_csv(runs / "runs.csv")
        for kind in ("summarization", "translation"):
            r = df[df.label.isin([f"{kind}{suffix}", f"tightllm_{kind}{suffix}"])]
            if not r.empty:
                got[(kind, when)] = r.iloc[0]
    if len(got) < 4:
        return []
    lines = ["## Found since: the masked decode attention", "",
             "TightLLM's long jobs decode with eager recompute ops over left-padded batches, so each attention takes a "
             "key mask that grows every step, and SDPA's default backend for it (cuDNN) built a plan at every new "
             f"shape: a stall at each step's first layer op of each GPU batch. Since {MASK_FIX} those ops run the "
             "memory-efficient kernel (`offexec/model.py GROWING_MASK_BACKENDS`). Block 0 of each job, its first "
             "24 steps, run alone before and after (generated from `results/offexec/masked_decode_8fefc11/runs.csv` "
             "and `results/offexec/masked_decode_fix_124c502/runs.csv`; their READMEs say how they ran). In the "
             f"table above, {_since_fix(folder)}", "",
             "| task kind | measured decode tok/s, before -> after | offsim's error in the block's time, before -> "
             "after | commits |",
             "| --- | --- | --- | --- |"]

    def t_err(r) -> float:  # offsim's time / measured - 1, as the tables above (runs.csv has it in tok/s)
        return r.total_tok_s / r.offsim_total_tok_s - 1

    for kind in ("summarization", "translation"):
        b, a = got[(kind, "before")], got[(kind, "after")]
        lines.append(f"| {kind} | {b.decode_tok_s:.1f} -> {a.decode_tok_s:.1f} | {t_err(b):+.1%} -> "
                     f"{t_err(a):+.1%} | {b.commit} -> {a.commit} |")
    return lines + [""]


def write(folder: Path) -> Path:
    rows = _rows(folder)
    done = [p for _, _, p in rows if "completion_error" in p]
    within = sum(abs(p["completion_error"]) <= 0.05 for p in done)
    prov = provenance(command=f"python -m experiments.offexec.jobs_readme {folder}")
    text = [
        "# Offline jobs measured on the H200 (issue 20)", "",
        f"Generated by `python -m experiments.offexec.jobs_readme {folder}` (commit {prov['commit']}, "
        f"{prov['date'][:16]}Z) from each folder's `job.json`; do not edit by hand. One NVIDIA H200, Llama-2-13B "
        "(random fp16 weights), 256 requests per job drawn from the task kind's length distribution (seed 0, "
        "docs/jobs.md), a 16 GiB GPU budget, each policy at the settings `offsim search` picked on the profile "
        "`results/profiles/h200_offexec_v2.json` when the job first ran (kept in its `best.json`, so that resumed "
        "and re-measured blocks run the same; a search at a later commit may pick others), planned and predicted "
        "from that profile alone (nothing fitted to these runs). Specs and commands: `experiments/offexec/jobs/`. Error = offsim's completion time / measured "
        "- 1; p50 / p99: when half / 99 % of the requests had their last token, from the job's start.", "",
        *_table(rows), "",
        f"offsim's completion time within 5 % of the measured one: {within} of {len(done)} measured jobs "
        f"(target of issue 20: every one).", "", *_misses(folder), *_block_runs(folder)]
    out = folder / "README.md"
    out.write_text("\n".join(text))
    return out


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("folder", type=Path, help="folder of job folders (each with job.json)")
    ap.add_argument("--explain", action="store_true",
                    help=f"first write {MISSES}: each block off by more than {MISS * 100:.0f} %% against offsim's exact "
                         "simulation of its plan (simulates those blocks: a minute or so)")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        ap.error(f"{args.folder}: no such folder")
    if args.explain:
        print(explain(args.folder))
    print(write(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
