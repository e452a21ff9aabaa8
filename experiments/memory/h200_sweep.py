"""The memory contract on real hardware: settings chosen by ``offsim search`` at 100 % of a GPU budget (no headroom
factor), run by offexec under that budget. Does any run out of memory, and how does the measured peak compare with
offsim's predicted peak?

Three steps, the first and last on any machine, the second on the GPU machine:

    python -m experiments.memory.h200_sweep plan --out results/memory/h200_sweep_config.json
    python -m experiments.memory.h200_sweep plan --padded --out results/memory/padded/config.json
    python -m experiments.memory.h200_sweep run --config results/memory/h200_sweep_config.json --out OUT --commit C
    python -m experiments.memory.h200_sweep report --runs OUT/runs.jsonl --config results/memory/h200_sweep_config.json \
        --out results/memory

``plan`` draws the grid with a seed written into the config (models x budgets x prompt/gen lengths x policies, some
with the host memory cut so that the search must use the disk), runs each policy's search on the H200 profile at
the full budget, and keeps the cases whose predicted run time is short (device time is scarce). ``run`` generates
each model's random weights once and runs every case of that model: a two-token warm-up, then the measured run;
an out-of-memory error is recorded, not fatal. ``report`` writes ``h200_sweep.csv`` (provenance on its first line)
and a plot of measured against predicted peaks.

``plan --padded``: left-padded blocks of mixed prompt lengths instead (docs/jobs.md §4), whose ops hold a key mask:
per model and job policy, requests drawn from a task kind's length distribution, the settings of ``offsim job``'s
search (``best_for_job``: at the requests' longest lengths, the key mask reserved), and as the case the block of
those settings that reaches the longest prompt, padded in arrival order. Does every padded block fit in what the
search placed, on the device too?
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from offsim import Workload, build_plan, get_hardware, get_model
from offsim.core.errors import OffsimError
from offsim.core.provenance import provenance, write_csv
from experiments.common import case_tag, predicted_within, searched_case

GiB = 1 << 30
PROFILE = "results/profiles/h200_offexec.json"
MODELS = ("opt-6.7b", "llama-2-7b", "opt-13b", "llama-2-13b")  # llama-2-* are absent from the validation matrix
BUDGETS_GIB = (8, 12, 16, 24, 32, 40)
PROMPTS = (256, 512, 1024, 1984)  # OPT has 2048 positions: prompt + gen - 1 <= 2048 is checked per draw
GENS = (16, 32, 64, 128)
VARIANTS = (("static-accelerate", {}), ("static-zero", {}), ("flexgen", {}), ("flexgen", {"cpu_attention": True}),
            ("tightllm", {}), ("selectn", {}))
HOST_MEM_GIB = 110.0  # host memory the runs may use on the 125 GiB machine (the rest: OS, CUDA, Python)
DISK_HOST_GIB = 12.0  # host memory left to a "disk" case beyond the executor's master copy: forces the disk tier
MAX_BATCH = 32  # sequences per run: keeps each run to seconds
MAX_PREDICTED_S = 25.0  # a case whose predicted run is longer is skipped (device time)
JOB_POLICIES = ("static-accelerate", "static-zero", "flexgen", "tightllm")  # ``plan --padded``


def _hardware(budget_gib: float, host_bytes: int):
    return get_hardware(PROFILE, budget_gib).with_(cpu_mem_bytes=max(int(host_bytes), GiB))


def plan_cases(seed: int, per_model: int) -> list[dict]:
    """Draw (budget, prompt, gen, disk?) per model and policy variant; search each at 100 % of the budget."""
    rng = random.Random(seed)
    cases = []
    for mname in MODELS:
        model = get_model(mname)
        master = model.weight_bytes()  # offexec keeps a host master copy of every weight
        draws = 0
        while draws < per_model:
            policy, fixed = VARIANTS[draws % len(VARIANTS)]
            budget, prompt, gen = rng.choice(BUDGETS_GIB), rng.choice(PROMPTS), rng.choice(GENS)
            if prompt + gen - 1 > model.max_positions:
                continue
            draws += 1
            disk = policy != "selectn" and rng.random() < 0.2
            host = (DISK_HOST_GIB * GiB) if disk else (HOST_MEM_GIB * GiB - master)
            hw = _hardware(budget, host)
            tag = case_tag(mname, policy, fixed, budget, prompt, gen, disk)
            try:
                st, wl, plan, m = searched_case(policy, fixed, model, hw, prompt, gen, MAX_BATCH, MAX_PREDICTED_S)
            except OffsimError as e:
                print(f"  {tag}: skipped ({str(e)[:160]})", flush=True)
                continue
            cases.append({"case": tag, "model": mname, "policy": policy, "settings": st, "workload": wl.to_dict(),
                          "budget_gib": budget, "host_bytes": int(host), "disk": disk,
                          "predicted_peak_gpu_bytes": int(m["peak_gpu_bytes"]),
                          "predicted_peak_cpu_bytes": int(m["peak_cpu_bytes"]),
                          "predicted_peak_disk_bytes": int(m["peak_disk_bytes"]),
                          "predicted_total_s": m["total_s"], "plan_sha256": plan.fingerprint()})
            print(f"  {tag}: {wl.gpu_batch_size} x {wl.num_gpu_batches} {st}, predicted peak "
                  f"{m['peak_gpu_bytes'] / GiB:.2f} GiB, {m['total_s']:.1f} s", flush=True)
    return cases


def plan_padded_cases(seed: int, per_model: int) -> list[dict]:
    """Draw (budget, task kind, disk?) per model and job policy; the padded block of ``offsim job``'s settings that
    reaches the requests' longest prompt (module docstring)."""
    from offsim.core.requests import TASKS, draw_requests, make_blocks
    from offsim.search.job import best_for_job

    rng = random.Random(seed)
    cases = []
    for mname in MODELS:
        model = get_model(mname)
        master = model.weight_bytes()
        for i in range(per_model):
            policy = JOB_POLICIES[i % len(JOB_POLICIES)]
            budget, task = rng.choice(BUDGETS_GIB), rng.choice(sorted(TASKS))
            disk = rng.random() < 0.2
            host = (DISK_HOST_GIB * GiB) if disk else (HOST_MEM_GIB * GiB - master)
            hw = _hardware(budget, host)
            reqs = [r for r in draw_requests(task, 4 * MAX_BATCH, rng.randrange(1 << 30))
                    if r.prompt_len + r.gen_len - 1 <= model.max_positions][:MAX_BATCH]
            tag = f"{mname}_{policy}_b{budget}_{task}" + ("_disk" if disk else "")
            try:
                if len({r.prompt_len for r in reqs}) < 2:
                    raise OffsimError("the draw has one prompt length: nothing to pad")
                best = best_for_job(policy, model, hw, reqs, max_sims=2, max_batch=MAX_BATCH)
                blocks = make_blocks(reqs, best.workload.gpu_batch_size, best.workload.num_gpu_batches, "padded")
                wl = max(blocks, key=lambda b: b.workload.prompt_len).workload
                plan, m = predicted_within(policy, model, hw, wl, best.settings, MAX_PREDICTED_S)
            except OffsimError as e:
                print(f"  {tag}: skipped ({str(e)[:160]})", flush=True)
                continue
            cases.append({"case": tag, "model": mname, "policy": policy, "settings": best.settings,
                          "workload": wl.to_dict(), "budget_gib": budget, "host_bytes": int(host), "disk": disk,
                          "task": task, "padded": wl.padded,
                          "predicted_peak_gpu_bytes": int(m["peak_gpu_bytes"]),
                          "predicted_peak_cpu_bytes": int(m["peak_cpu_bytes"]),
                          "predicted_peak_disk_bytes": int(m["peak_disk_bytes"]),
                          "predicted_total_s": m["total_s"], "plan_sha256": plan.fingerprint()})
            print(f"  {tag}: {wl.gpu_batch_size} x {wl.num_gpu_batches} at prompts up to {wl.prompt_len} "
                  f"{best.settings}, predicted peak {m['peak_gpu_bytes'] / GiB:.2f} GiB, {m['total_s']:.1f} s",
                  flush=True)
    return cases


def run_cases(cases: list[dict], out: Path, commit: str | None, disk_dir: str | None = None) -> None:
    """Each model's weights once; per case a warm-up and the measured run; one JSON line per case in runs.jsonl."""
    import inspect

    import torch

    from offexec.executor import check_plan, run_plan
    from offexec.job import shortened
    from offexec.weights import random_weights

    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "runs.jsonl", "a")
    done = {json.loads(x)["case"] for x in open(out / "runs.jsonl")} if (out / "runs.jsonl").stat().st_size else set()
    by_model: dict[str, list[dict]] = {}
    for c in cases:
        if c["case"] not in done:
            by_model.setdefault(c["model"], []).append(c)
    dev = torch.device("cuda")
    for mname, group in by_model.items():
        model = get_model(mname)
        t0 = time.time()
        weights = random_weights(model, 0, torch.float16, device="cuda", pinned=True, progress=False)
        print(f"{mname}: weights in {time.time() - t0:.1f} s", flush=True)
        try:
            for c in group:
                hw = _hardware(c["budget_gib"], c["host_bytes"])
                wl = Workload.from_dict(c["workload"])
                row = {"case": c["case"], "commit": commit, "gpu": torch.cuda.get_device_name()}
                budget = int(hw.gpu_mem_bytes)
                t1 = time.time()
                try:
                    plan = build_plan(c["policy"], model, hw, wl, c["settings"])
                    row["plan_matches_config"] = plan.fingerprint() == c["plan_sha256"]
                    kw = {"weights_loaded": True} if "weights_loaded" in inspect.signature(check_plan).parameters else {}
                    need = check_plan(plan, dev, budget, disk_dir, **kw)  # the weights' master copy is already made
                    row["offexec_need_bytes"] = int(sum(need.values()))
                    warm = build_plan(c["policy"], model, hw, shortened(wl, 2), c["settings"])  # (per request too)
                    # the allocator capped at the plan's own bytes: a run that completes held at most the prediction
                    cap = {"allocator_cap": "plan"}
                    run_plan(warm, weights, "cuda", gpu_budget_bytes=budget, disk_dir=disk_dir, **cap)
                    res = run_plan(plan, weights, "cuda", gpu_budget_bytes=budget, disk_dir=disk_dir, **cap)
                    m = res.trace.metrics()
                    row.update(oom=False, measured_peak_gpu_bytes=int(res.stats["gpu_max_reserved_bytes"]),
                               measured_max_allocated_bytes=int(res.stats["gpu_max_allocated_bytes"]),
                               measured_total_tok_s=m["total_tok_s"], allocator=res.stats.get("allocator"),
                               allocator_conf=res.stats.get("allocator_conf"), arena_bytes=res.stats.get("arena_bytes"))
                except torch.cuda.OutOfMemoryError as e:
                    row.update(oom=True, error=str(e).split("\n")[0][:300],
                               measured_peak_gpu_bytes=int(torch.cuda.max_memory_reserved(dev)))
                except Exception as e:  # a refusal (offsim/offexec error) or a bug: recorded, the sweep goes on
                    row.update(oom="out of memory" in str(e).lower(), error=f"{type(e).__name__}: {str(e)[:300]}")
                row["wall_s"] = round(time.time() - t1, 2)
                torch.cuda.empty_cache()
                log.write(json.dumps(row, default=str) + "\n")
                log.flush()
                print(f"  {c['case']}: {'OOM' if row.get('oom') else row.get('error', 'ok')[:80]} peak "
                      f"{row.get('measured_peak_gpu_bytes', 0) / GiB:.2f} GiB (predicted "
                      f"{c['predicted_peak_gpu_bytes'] / GiB:.2f}, budget {c['budget_gib']}) {row['wall_s']} s",
                      flush=True)
        finally:
            weights.close()
    log.close()


def report(config: Path, runs: Path, out: Path, note: str = "") -> dict:
    """h200_sweep.csv (the issue's columns first) and a plot; returns the summary."""
    import pandas as pd

    cfg = json.loads(config.read_text())
    cases = pd.DataFrame(cfg["cases"])
    rows = pd.DataFrame([json.loads(x) for x in open(runs) if x.strip()])
    df = cases.merge(rows, on="case", how="inner")
    if "error" not in df:  # no run failed
        df["error"] = None
    wl = pd.json_normalize(df["workload"])
    df["prompt_len"], df["gen_len"] = wl["prompt_len"], wl["gen_len"]
    df["batch"] = wl["gpu_batch_size"] * wl["num_gpu_batches"]
    df["settings"] = df["settings"].map(json.dumps)
    done = df["error"].isna() if "error" in df else df["case"].notna()
    # ratios of completed runs only (an OOM's peak is where the failing allocation stopped it)
    df["measured_over_predicted"] = (df["measured_peak_gpu_bytes"] / df["predicted_peak_gpu_bytes"]).where(done)
    # what tensors were allocated against the footprint offexec's pre-check adds up: the footprint's own accuracy,
    # apart from what the caching allocator reserves beyond it
    df["allocated_over_footprint"] = (df["measured_max_allocated_bytes"] / df["offexec_need_bytes"]).where(done)
    df["within_budget"] = df["measured_peak_gpu_bytes"] <= df["budget_gib"] * GiB
    first = ["case", "model", "policy", "budget_gib", "prompt_len", "gen_len", "batch", "predicted_peak_gpu_bytes",
             "measured_peak_gpu_bytes", "oom"]
    rest = ["measured_over_predicted", "allocated_over_footprint", "within_budget", "measured_max_allocated_bytes", "offexec_need_bytes", "disk",
            "settings", "error", "measured_total_tok_s", "plan_matches_config", "wall_s", "commit", "gpu"]
    df = df.reindex(columns=first + [c for c in rest if c in df])
    out.mkdir(parents=True, exist_ok=True)
    commits = sorted({str(c) for c in df["commit"].dropna()})
    write_csv(df, out / "h200_sweep.csv", provenance(config=str(config), runs_commit=commits, seed=cfg["seed"]))
    ran = df[df["error"].isna()] if "error" in df else df
    summ = {"cases": len(df), "ooms": int(df["oom"].astype(bool).sum()),
            "refused_or_failed": int((df["error"].notna() & ~df["oom"].astype(bool)).sum()) if "error" in df else 0,
            "over_budget": int((~ran["within_budget"].astype(bool)).sum()),  # among completed runs
            "ratio_min": float(ran["measured_over_predicted"].min()) if len(ran) else None,
            "ratio_max": float(ran["measured_over_predicted"].max()) if len(ran) else None,
            "in_0.90_1.00": int(ran["measured_over_predicted"].between(0.90, 1.00).sum()),
            "allocated_over_footprint_min": float(ran["allocated_over_footprint"].min()) if len(ran) else None,
            "allocated_over_footprint_max": float(ran["allocated_over_footprint"].max()) if len(ran) else None}
    _plot(df, out / "h200_sweep.png")
    _readme(df, summ, out / "README.md", commits, note, bool(cfg.get("padded")))
    return summ


def _readme(df, summ: dict, path: Path, commits: list[str], note: str = "", padded: bool = False) -> None:
    """README.md of the results folder: every number in it is computed here from the CSV beside it."""
    G = lambda b: f"{b / GiB:.2f}" if b == b else ""  # noqa: E731  (NaN: no measurement)
    by = df.assign(oom=df["oom"].astype(bool), failed=df["error"].notna() & ~df["oom"].astype(bool)) \
        .groupby("policy").agg(cases=("case", "size"), ooms=("oom", "sum"), refused_or_failed=("failed", "sum"),
                               ratio_min=("measured_over_predicted", "min"),
                               ratio_max=("measured_over_predicted", "max"))
    what = ("Left-padded blocks of mixed prompt lengths at the settings `offsim job` picks (its search at the "
            "requests' longest lengths, a padded batch's key mask reserved, at 100 % of the GPU budget), each case the "
            "block that reaches the longest prompt (`h200_sweep plan --padded`), run by offexec under"
            if padded else
            "Settings chosen by `offsim search` at 100 % of the GPU budget (no headroom factor), run by offexec under")
    lines = ["# The memory contract" + (" for left-padded blocks" if padded else "") + ", measured on the H200", "",
             what, "that budget (`torch.cuda.set_per_process_memory_fraction`). Written by",
             "`python -m experiments.memory.h200_sweep report` from `h200_sweep.csv` (first line: provenance); runs at "
             f"commit(s) {', '.join(commits) or 'unknown'}.", "",
             f"**{summ['cases']} cases: {summ['ooms']} out of GPU memory, {summ['refused_or_failed']} refused or failed "
             f"otherwise, {summ['over_budget']} completed with a measured peak over the budget; measured / predicted GPU peak "
             f"{summ['ratio_min']:.2f} to {summ['ratio_max']:.2f} where the run completed, {summ['in_0.90_1.00']} "
             "within the target band 0.90-1.00.**", "", *([note, ""] if note else []),
             "How the run holds to the plan: every buffer whose size the plan fixes (weights, KV, pools, embeddings, "
             "token ids) is a view of one GPU arena sized from the plan; the executor's CUDA streams live as long as "
             "the process (a fresh stream's cuBLAS workspace would leak 32 MiB a run); the caching allocator runs with "
             "expandable segments and is capped at the plan's own GPU bytes (`offexec run --allocator-cap plan`; "
             "runs are capped at the budget by default), so a completed run held at most what offsim predicted. Tensors allocated "
             "(`torch.cuda.max_memory_allocated`) were "
             f"{summ['allocated_over_footprint_min']:.3f} to {summ['allocated_over_footprint_max']:.3f} times what the "
             "footprint module adds up for the plan (`offexec_need_bytes`, the sizes offsim plans with, which include "
             "cuBLAS's workspace and the allocator's slack: `offsim/core/footprint.py`).", "",
             *_over_prediction(df), "| policy | cases | OOM | refused/failed | measured/predicted min | max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for pol, r in by.iterrows():
        lines.append(f"| {pol} | {int(r.cases)} | {int(r.ooms)} | {int(r.refused_or_failed)} | {r.ratio_min:.2f} | "
                     f"{r.ratio_max:.2f} |")
    lines += ["", "| case | budget GiB | batch | predicted GiB | measured GiB | OOM | note |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for _, r in df.iterrows():
        note = "" if r.get("error") != r.get("error") or r.get("error") is None else str(r["error"])[:90]
        lines.append(f"| {r.case} | {r.budget_gib} | {r.batch} | {G(r.predicted_peak_gpu_bytes)} | "
                     f"{G(r.measured_peak_gpu_bytes)} | {'yes' if r.oom else ''} | {note} |")
    lines += ["", "![measured against predicted peak](h200_sweep.png)", "",
              "Measured peak: `torch.cuda.max_memory_reserved` over the measured run (after a two-token warm-up); for "
              "a run that ran out of memory, the peak reached before the failing allocation." + (
                  "" if padded else " `baseline_1011948.log`: the same sweep before the footprint module (its "
                  "printed log).")]
    path.write_text("\n".join(lines) + "\n")


def _over_prediction(df) -> list[str]:
    """README lines on completed runs whose reserved peak passed the simulated peak: by how much, and against the
    allocator cap (``offexec_need_bytes``, the footprint with its slack) and the tensors really allocated."""
    over = df[(df["measured_over_predicted"] > 1) & df["error"].isna()]
    if not len(over):
        return []
    M = lambda b: f"{abs(b) / 2**20:,.0f} MiB"  # noqa: E731
    side = lambda b: "under" if b >= 0 else "over"  # noqa: E731
    items = []
    for _, r in over.iterrows():
        t = r.predicted_peak_gpu_bytes - r.measured_max_allocated_bytes  # the tensors against the simulated peak
        items.append(f"{r.case} reserved {M(r.measured_peak_gpu_bytes - r.predicted_peak_gpu_bytes)} more than the "
                     f"simulated peak, {M(r.offexec_need_bytes - r.measured_peak_gpu_bytes)} under the allocator cap, "
                     f"its tensors {M(t)} {side(t)} the simulated peak")
    return [f"{len(over)} completed run(s) reserved more than the simulated peak: " + "; ".join(items) + ". The "
            "allocator may reserve up to its cap: the footprint's bound over the whole plan (cuBLAS's workspace and "
            "the allocator's slack included, as in the simulated peak), which can lie above the peak at the "
            "simulated timing.", ""]


def _plot(df, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from offsim.analysis.plots import POLICY_COLORS

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for pol, g in df.groupby("policy"):
        ax.scatter(g["predicted_peak_gpu_bytes"] / GiB, g["measured_peak_gpu_bytes"] / GiB, label=pol, s=20,
                   color=POLICY_COLORS.get(pol), marker="o")
        oom = g[g["oom"].astype(bool)]
        ax.scatter(oom["predicted_peak_gpu_bytes"] / GiB, oom["measured_peak_gpu_bytes"] / GiB, s=60,
                   facecolors="none", edgecolors="r")
    hi = float(max(df["predicted_peak_gpu_bytes"].max(), df["measured_peak_gpu_bytes"].max()) / GiB) * 1.05
    ax.plot([0, hi], [0, hi], "k-", lw=0.8, label="measured = predicted")
    ax.plot([0, hi], [0, 0.9 * hi], "k:", lw=0.8, label="0.90 x predicted")
    ax.set_xlabel("offsim predicted GPU peak (GiB)")
    ax.set_ylabel("offexec measured peak reserved (GiB)")
    ax.set_title("memory contract on the H200 (red ring: out of memory)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="choose the cases with offsim's search (no GPU)")
    p.add_argument("--out", required=True, help="config JSON to write")
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--per-model", type=int, default=12, help="draws per model (default: %(default)s)")
    p.add_argument("--padded", action="store_true",
                   help="left-padded blocks of mixed prompt lengths, at offsim job's settings (module docstring)")
    r = sub.add_parser("run", help="run the cases of a config on the GPU")
    r.add_argument("--config", required=True)
    r.add_argument("--out", required=True, help="folder for runs.jsonl (appended: a rerun skips finished cases)")
    r.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    r.add_argument("--models", nargs="*", help="only these models")
    r.add_argument("--disk-dir", default=None, help="folder of the disk tier (a real disk: O_DIRECT)")
    q = sub.add_parser("report", help="write h200_sweep.csv and the plot")
    q.add_argument("--config", required=True)
    q.add_argument("--runs", required=True)
    q.add_argument("--out", default="results/memory")
    q.add_argument("--note", default="", help="a sentence for the README (e.g. how the runs differed)")
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        cases = (plan_padded_cases if a.padded else plan_cases)(a.seed, a.per_model)
        doc = {"seed": a.seed, "profile": PROFILE, "max_batch": MAX_BATCH, "padded": a.padded,
               "provenance": provenance(), "cases": cases}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1, default=list))
        print(json.dumps({"cases": len(cases), "config": a.out}))
    elif a.cmd == "run":
        cases = json.loads(Path(a.config).read_text())["cases"]
        if a.models:
            cases = [c for c in cases if c["model"] in a.models]
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "runs.jsonl").touch()
        run_cases(cases, out, a.commit, a.disk_dir)
        print(json.dumps({"runs": str(out / "runs.jsonl")}))
    else:
        print(json.dumps(report(Path(a.config), Path(a.runs), Path(a.out), a.note)))


if __name__ == "__main__":
    sys.exit(main())
