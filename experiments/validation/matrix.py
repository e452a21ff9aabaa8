"""Validation matrix (issue 6): run many plans on the GPU with offexec, save each measured run as a committed case
(``offsim.analysis.validate`` schema: metrics, per-step latency, op time per (step, layer, kind)), then re-simulate them.

One process per model generates the random weights once and runs every configuration of that model. Each
configuration's settings come from offsim's own search on the machine's profile under the GPU budget (so every
policy runs at its best), with the host-memory capacity reduced by the executor's master copy of the weights.

    python -m experiments.validation.matrix --profile results/profiles/h200.json --out results/validation \
        --models opt-6.7b llama-3-8b            # on the H200
    python -m experiments.validation.matrix --device cpu --quick --out /tmp/v   # CPU smoke test (tiny model)

OPT has 2048 learned positions: for prompt 2048 its position table is extended (random weights), as docs/anchors.md §2
says FlexGen's code needs too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from experiments.common import finish, provenance
from offsim import POLICIES, Workload, build_plan, get_hardware, get_model, simulate
from offsim.core.errors import OffsimError
from offsim.search import search
from offsim.analysis.validate import case_from_trace, save_case

GiB = 1 << 30
# (model, GPU budget GiB, prompt lengths) -> every policy at each prompt length
MATRIX = {
    "opt-6.7b": [(8, (512, 2048))],
    "llama-3-8b": [(8, (512, 2048))],
    "opt-13b": [(16, (512,)), (24, (2048,))],
    "opt-30b": [(16, (512,)), (24, (512,))],
}
MAX_BATCH = 64  # prompts per run: keeps each measured run to seconds (device time is scarce)
HEADROOM = 0.85  # settings are chosen for 85 % of the budget: PyTorch's allocator needs slack the plan does not count
VARIANTS = [("static-accelerate", {}), ("static-zero", {}), ("flexgen", {"cpu_attention": False}),
            ("flexgen", {"cpu_attention": True}), ("tightllm", {}), ("selectn", {})]


def settings_for(policy, fixed, model, hw, prompt_len, gen_len, quick=False):
    """The policy's best settings by offsim's search, with ``fixed`` settings forced (e.g. CPU attention);
    ``quick`` (CPU smoke test): default settings on a small block."""
    if quick:
        wl = Workload(prompt_len, gen_len, 2, 1 if policy.startswith("static") else 2)
        st = {"percent": (0, 100, 0, 100, 100, 0), **fixed} if policy == "flexgen" else {}
        return st, wl
    if policy == "flexgen":
        from offsim.policies.lp import flexgen_candidates

        cands = flexgen_candidates(model, hw, prompt_len, gen_len, cpu_attention=(fixed["cpu_attention"],))
        cands = [r for r in cands if r.gpu_batch_size * r.num_gpu_batches <= MAX_BATCH]
        for r in cands[:6]:
            st = {"percent": r.percent, "cpu_attention": r.cpu_attention}
            wl = Workload(prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches)
            try:
                simulate(build_plan(policy, model, hw, wl, st), hw)
                return st, wl
            except OffsimError:
                continue
        raise OffsimError(f"no feasible flexgen setting with cpu_attention={fixed['cpu_attention']}")
    res = search(policy, model, hw, prompt_len, gen_len, max_sims=2, max_batch=MAX_BATCH)
    return res.settings, res.workload


def plan_cases(args) -> list[dict]:
    """Choose every case's settings with offsim's search (no GPU needed): the config the GPU run executes."""
    matrix = {"opt-125m": [(0.4, (32,))]} if args.quick else {m: MATRIX[m] for m in args.models}
    gen_len = 3 if args.quick else args.gen_len
    cases = []
    for mname, configs in matrix.items():
        model = get_model(mname)
        if model.family == "opt" and max(p for _, ps in configs for p in ps) + gen_len > model.max_positions:
            model = dataclasses.replace(model, max_positions=4096)  # random weights: extend OPT's positions
        if args.device != "cuda":
            model = dataclasses.replace(model, dtype_bytes=4)  # fp32 on the CPU
        for budget_gb, prompts in configs:
            host = int(args.host_mem_gb * GiB) - model.weight_bytes()  # the executor keeps a host master copy
            hw = get_hardware(args.profile, budget_gb * (1.0 if args.quick else HEADROOM))
            hw = hw.with_(cpu_mem_bytes=max(host, 1 << 30))
            for prompt_len in prompts:
                for policy, fixed in VARIANTS:
                    if policy not in POLICIES:
                        continue
                    tag = f"{mname}_{policy}{'-cpuattn' if fixed.get('cpu_attention') else ''}_p{prompt_len}" \
                          f"_g{budget_gb:g}"
                    try:
                        st, wl = settings_for(policy, fixed, model, hw, prompt_len, gen_len, args.quick)
                        build_plan(policy, model, hw, wl, st)
                    except OffsimError as e:
                        print(f"  {tag}: no setting ({e})", flush=True)
                        continue
                    cases.append({"tag": tag, "model": mname, "model_config": model.to_dict(), "policy": policy,
                                  "settings": st, "workload": wl.to_dict(), "gpu_mem_gb": budget_gb})
                    print(f"  {tag}: {wl.gpu_batch_size} x {wl.num_gpu_batches} {st}", flush=True)
    return cases


def run_cases(cases: list[dict], args) -> list[dict]:
    """Run each case on the device with offexec (weights generated once per model); save each as a case JSON."""
    import torch

    from offexec.executor import check_plan, run_plan
    from offexec.weights import random_weights
    from offsim.core.specs import ModelSpec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    summary = []
    by_model: dict[str, list[dict]] = {}
    for c in cases:
        by_model.setdefault(json.dumps(c["model_config"], sort_keys=True), []).append(c)
    for key, group in by_model.items():
        model = ModelSpec.from_dict(json.loads(key))
        dtype = torch.float16 if model.dtype_bytes == 2 else torch.float32
        t0 = time.time()
        weights = random_weights(model, 0, dtype, device=args.device, pinned=args.device == "cuda", progress=False)
        print(f"{model.name}: weights ready in {time.time() - t0:.1f} s", flush=True)
        try:
            for c in group:
                tag, policy = c["tag"], c["policy"]
                base = get_hardware(args.profile, c["gpu_mem_gb"])
                wl = Workload.from_dict(c["workload"])
                try:
                    plan = build_plan(policy, model, base, wl, c["settings"])
                    check_plan(plan, torch.device(args.device), int(base.gpu_mem_bytes))
                    if args.warmup:  # same shapes, two steps, unmeasured: cuBLAS heuristics, allocator growth
                        warm = build_plan(policy, model, base, wl.with_(gen_len=2), c["settings"])
                        run_plan(warm, weights, args.device, gpu_budget_bytes=int(base.gpu_mem_bytes))
                    t1 = time.time()
                    res = run_plan(plan, weights, args.device, gpu_budget_bytes=int(base.gpu_mem_bytes),
                                   meta={"hardware": base.name})
                    wall = time.time() - t1
                except Exception as e:  # one failed configuration must not lose the others
                    msg = str(e).split("\n")[0][:300]
                    print(f"  {tag}: FAILED {type(e).__name__}: {msg}", flush=True)
                    summary.append({"case": tag, "error": f"{type(e).__name__}: {msg}"})
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                tr = res.trace
                plan.save(out / f"{tag}.plan.json.gz")  # what ran, op for op: `offsim validate` re-simulates it
                tr.meta.update({"plan_file": f"{tag}.plan.json.gz", "plan_sha256": plan.fingerprint(),
                                "model": c["model"], "policy": policy, "settings": plan.settings,
                                "workload": wl.to_dict(), "gpu_mem_gb": c["gpu_mem_gb"], "hardware": base.name,
                                "hardware_profile": args.profile_ref or args.profile,
                                "model_config": c["model_config"]})
                commit = {"commit": args.commit} if args.commit else {}
                case = case_from_trace(tr, **provenance(gpu=gpu, wall_s=round(wall, 2), **commit,
                                                        issue_frac=res.stats.get("issue_frac"),
                                                        warmup=bool(args.warmup),
                                                        host_mem_gb=args.host_mem_gb))
                save_case(case, out / f"{tag}.case.json")
                pred = simulate(plan, base, check_memory=False).metrics()
                m = tr.metrics()
                row = {"case": tag, "batch": wl.num_prompts, "measured_total_tok_s": m["total_tok_s"],
                       "predicted_total_tok_s": pred["total_tok_s"],
                       "err": (pred["total_tok_s"] - m["total_tok_s"]) / m["total_tok_s"],
                       "peak_gpu_GiB": m["peak_gpu_bytes"] / GiB, "wall_s": wall}
                summary.append(row)
                print(f"  {tag}: batch {wl.num_prompts} measured {m['total_tok_s']:.1f} tok/s, offsim "
                      f"{pred['total_tok_s']:.1f} ({row['err']:+.1%}), decode {m['decode_tok_s']:.1f}, "
                      f"{wall:.1f} s", flush=True)
        finally:
            weights.close()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h200", help="hardware profile JSON (or preset) of this machine")
    ap.add_argument("--profile-ref", default=None,
                    help="the profile path to record in each case (default: --profile), e.g. the committed copy")
    ap.add_argument("--out", help="directory for the *.case.json files (run mode)")
    ap.add_argument("--models", nargs="+", default=list(MATRIX))
    ap.add_argument("--gen-len", type=int, default=4, help="tokens per prompt (default: %(default)s)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-mem-gb", type=float, default=110.0, help="host memory the runs may use (GiB)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: opt-125m, tiny budget")
    ap.add_argument("--plan-only", metavar="CONFIG", help="choose the cases' settings and write them to CONFIG")
    ap.add_argument("--config", metavar="CONFIG", help="run the cases of CONFIG (written by --plan-only)")
    ap.add_argument("--commit", default=None,
                    help="commit to record (the device machine's copy has no .git, so provenance cannot read it)")
    ap.add_argument("--warmup", action="store_true",
                    help="before each measured run, run the same plan for two steps unmeasured")
    args = ap.parse_args()
    if args.config:
        cases = json.loads(Path(args.config).read_text())
    else:
        cases = plan_cases(args)
    if args.plan_only:
        Path(args.plan_only).write_text(json.dumps(cases, indent=1, default=list))
        finish({"cases": len(cases), "config": args.plan_only})
        return
    summary = run_cases(cases, args)
    finish({"cases": sum("err" in r for r in summary), "failed": sum("error" in r for r in summary),
            "out": args.out})


if __name__ == "__main__":
    main()
