"""``offsim`` command line: simulate one policy, search a policy's best settings, compare every policy.

Each command prints a readable table and, as its last stdout line, one JSON document (an object; for ``compare`` a
list) that scripts can parse. Bad input exits with code 2 and a one-line reason on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import pandas as pd

from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.policies import POLICIES, build_plan, get_policy
from offsim.core.sim import simulate
from offsim.core.specs import HARDWARE_PRESETS, MODEL_PRESETS, Workload, get_hardware, get_model

GiB = 1 << 30
SUMMARY_KEYS = ("model", "hardware", "policy", "batch", "gpu_batch_size", "num_gpu_batches", "prompt_len",
                "gen_len", "prefill_s", "decode_s", "total_s", "prefill_tok_s", "decode_tok_s", "total_tok_s",
                "gpu_idle_frac", "peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def percent_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer percentage, got {s!r}") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"a percentage is in [0, 100], got {v}")
    return v


def add_target_args(p: argparse.ArgumentParser) -> None:
    """Model, hardware and lengths: shared by every command (and by ``offexec run``)."""
    p.add_argument("--model", default="opt-30b",
                   help=f"model preset ({', '.join(MODEL_PRESETS)}) or a transformers config.json path "
                        "(default: %(default)s)")
    p.add_argument("--hardware", default="t4",
                   help=f"hardware preset ({', '.join(HARDWARE_PRESETS)}) or a hardware-profile JSON written by "
                        "`offexec profile` (default: %(default)s)")
    p.add_argument("--gpu-mem-gb", type=float, default=None, metavar="GiB",
                   help="GPU memory budget in GiB, replacing the hardware's GPU memory (e.g. 16 for a virtual "
                        "16 GiB GPU)")
    p.add_argument("--prompt-len", type=positive_int, default=512, metavar="TOKENS",
                   help="prompt length in tokens (default: %(default)s)")
    p.add_argument("--gen-len", type=positive_int, default=32, metavar="TOKENS",
                   help="tokens generated per prompt, the first by prefill (default: %(default)s)")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """One policy with its settings (``simulate``; ``offexec run``)."""
    p.add_argument("--policy", default="flexgen", help=f"policy: {', '.join(POLICIES)} (default: %(default)s)")
    p.add_argument("--gpu-batch-size", type=positive_int, default=16, metavar="SEQS",
                   help="sequences per GPU batch (default: %(default)s)")
    p.add_argument("--num-gpu-batches", type=positive_int, default=1, metavar="N",
                   help="GPU batches per block, FlexGen's zig-zag block (default: %(default)s)")
    p.add_argument("--percent", type=percent_int, nargs=6, default=None,
                   metavar=("W_GPU", "W_CPU", "C_GPU", "C_CPU", "A_GPU", "A_CPU"),
                   help="FlexGen's placement, in %%: weights on GPU, weights on CPU, KV cache on GPU, cache on CPU, "
                        "activations on GPU, activations on CPU (weights and cache: the rest on disk; activations "
                        "must sum to 100). flexgen and tightllm only")
    p.add_argument("--cpu-attention", action="store_true",
                   help="decode attention on the CPU over the host KV cache (FlexGen's --cpu-cache-compute)")
    p.add_argument("--no-overlap", action="store_true", help="serialise all I/O and compute (FlexGen ablation)")
    p.add_argument("--no-kv-distributor", action="store_true",
                   help="tightllm ablation: never recompute KV (N_r = 0)")
    p.add_argument("--no-weight-loader", action="store_true",
                   help="tightllm ablation: load each layer's weights whole with the first batch")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other policy setting, VALUE as JSON (e.g. --set offload=\"disk\", --set interval=4); "
                        "repeatable")


def policy_settings(args) -> dict:
    """Settings dict for ``args.policy`` from the flags; a flag that the policy does not take is an error."""
    names = set(get_policy(args.policy).input_names())
    given = {}
    if args.percent is not None:
        given["percent"] = tuple(args.percent)
    if args.cpu_attention:
        given["cpu_attention"] = True
    if args.no_overlap:
        given["overlap"] = False
    if args.no_kv_distributor:
        given["kv_distributor"] = False
    if args.no_weight_loader:
        given["weight_loader"] = False
    flag = {"percent": "--percent", "cpu_attention": "--cpu-attention", "overlap": "--no-overlap",
            "kv_distributor": "--no-kv-distributor", "weight_loader": "--no-weight-loader"}
    for k in given:
        if k not in names:
            raise OffsimError(f"{flag[k]} does not apply to policy {args.policy} (its settings: {sorted(names)})")
    for kv in args.set:
        if "=" not in kv:
            raise OffsimError(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        if k not in names:
            raise OffsimError(f"--set {k}: policy {args.policy} has no such setting; valid: {sorted(names)}")
        try:
            given[k] = json.loads(v)
        except json.JSONDecodeError:
            given[k] = v  # a bare string
    return given


def summary(metrics: dict, settings: dict | None = None, derived: dict | None = None) -> dict:
    """The JSON line: metrics, the policy's inputs (``settings``) and what it derived from them (``derived``)."""
    out = {k: metrics.get(k) for k in SUMMARY_KEYS}
    if settings is not None:
        out["settings"] = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if derived:
        out["derived"] = derived
    return out


def _fmt_table(rows: list[dict]) -> str:
    df = pd.DataFrame(rows)
    show = [c for c in ("policy", "batch", "gpu_batch_size", "num_gpu_batches", "prefill_tok_s", "decode_tok_s",
                        "total_tok_s", "gpu_idle_frac", "peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes")
            if c in df]
    df = df[show].copy()
    for c in ("peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes"):
        if c in df:
            df[c.replace("_bytes", "_GiB")] = df.pop(c) / GiB
    return df.to_string(index=False, float_format=lambda x: f"{x:,.3f}")


def _print_json(obj) -> None:
    print(json.dumps(obj, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x)))


def cmd_simulate(args) -> None:
    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    if args.plan:
        plan = Plan.load(args.plan).validate()
    else:
        model = get_model(args.model)
        wl = Workload(args.prompt_len, args.gen_len, args.gpu_batch_size, args.num_gpu_batches)
        plan = build_plan(args.policy, model, hw, wl, policy_settings(args))
    if args.save_plan:
        plan.save(args.save_plan)
    t0 = time.perf_counter()
    trace = simulate(plan, hw)
    wall = time.perf_counter() - t0
    m = trace.metrics()
    if args.trace:
        (trace.to_csv if str(args.trace).endswith(".csv") else trace.to_chrome)(args.trace)
    print(f"{plan.policy} on {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB GPU), {plan.model.name}, "
          f"prompt {plan.workload.prompt_len}, gen {plan.workload.gen_len}, {len(plan.ops)} ops simulated in "
          f"{wall:.2f} s")
    print(_fmt_table([m]))
    busy = ", ".join(f"{s} {m[f'busy_{s}_s']:.2f} s" for s in ("compute", "h2d", "d2h", "disk", "cpu"))
    print(f"makespan {m['total_s']:.2f} s; stream busy: {busy}")
    _print_json(summary(m, plan.settings, plan.derived))


def cmd_search(args) -> None:
    from offsim.search import search

    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    model = get_model(args.model)
    res = search(args.policy, model, hw, args.prompt_len, args.gen_len, max_sims=args.max_sims,
                 progress=args.progress)
    print(f"best {args.policy} for {model.name} on {hw.name}: gpu_batch_size {res.workload.gpu_batch_size}, "
          f"num_gpu_batches {res.workload.num_gpu_batches}, settings {res.settings}")
    print(_fmt_table([res.metrics]))
    cols = [c for c in ("gpu_batch_size", "num_gpu_batches", "settings", "lp_s_per_token", "screen_total_tok_s",
                        "total_tok_s", "error")
            if c in res.candidates]
    print(f"\ncandidates evaluated ({len(res.candidates)}; best first):")
    print(res.candidates[cols].head(args.show).to_string(index=False))
    _print_json(summary(res.metrics, res.settings))


def cmd_compare(args) -> None:
    from offsim.search import search

    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    model = get_model(args.model)
    policies = args.policies or list(POLICIES)
    rows, out = [], []
    for pol in policies:
        if pol not in POLICIES:
            raise OffsimError(f"unknown policy {pol!r}; valid: {', '.join(POLICIES)}")
        try:
            res = search(pol, model, hw, args.prompt_len, args.gen_len, max_sims=args.max_sims)
        except OffsimError as e:
            print(f"{pol}: {e}", file=sys.stderr)
            out.append({"policy": pol, "error": str(e)})
            continue
        rows.append(res.metrics)
        out.append(summary(res.metrics, res.settings))
        print(f"{pol}: gpu_batch_size {res.workload.gpu_batch_size} x {res.workload.num_gpu_batches}, "
              f"settings {res.settings}", flush=True)
    print(f"\n{model.name} on {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB GPU), prompt {args.prompt_len}, "
          f"gen {args.gen_len}, each policy at its best simulated settings:")
    if rows:
        print(_fmt_table(rows))
    _print_json(out)


def cmd_validate(args) -> None:
    from pathlib import Path

    from offsim.analysis import validate as V

    df = V.validate_dir(args.dir, hardware=args.hardware, progress=args.progress)
    show = ["case", "policy", "plan", "prompt_len", "batch", "measured_total_tok_s", "predicted_total_tok_s",
            "err_prefill_tok_s", "err_decode_tok_s", "err_total_tok_s", "step_latency_mape"]
    show += sorted(c for c in df.columns if c.startswith("mape_"))
    print(df[show].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    by_policy = df.groupby("policy")["err_total_tok_s"].agg(lambda e: e.abs().median())
    print("\nmedian |total tok/s error| by policy:")
    print(by_policy.to_string(float_format=lambda v: f"{v:.1%}"))
    kinds = df[[c for c in df.columns if c.startswith("mape_")]].mean()
    print("\nmean per-op-kind MAPE over cases:")
    print(kinds.to_string(float_format=lambda v: f"{v:.1%}"))
    stale = V.stale_cases(df)
    if stale:
        print(f"\nwarning: {len(stale)} case(s) ran a plan that today's code no longer builds from their settings "
              f"(re-measure them): {', '.join(stale)}")
    bad = V.check_thresholds(df)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        from offsim.core.provenance import provenance, write_csv

        write_csv(df, out / "validation.csv", provenance(cases=str(args.dir)))
        V.plot(df, out / "validation.png")
    errs = df["err_total_tok_s"].abs()
    print(f"\n{len(df)} cases; median |total error| {errs.median():.1%} (limit {V.MAX_MEDIAN_ERROR:.0%}), max "
          f"{errs.max():.1%} (limit {V.MAX_CASE_ERROR:.0%}): {'OK' if not bad else 'FAIL'}")
    for b in bad:
        print("  " + b)
    _print_json({"cases": len(df), "median_abs_err_total": float(errs.median()), "max_abs_err_total":
                 float(errs.max()), "ok": not bad, "violations": bad})
    if bad and args.strict:
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offsim", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("simulate", help="simulate one policy with given settings",
                       description="Build the plan of one policy and simulate it (SimPy). Throughput follows "
                                   "FlexGen's definitions.")
    add_target_args(s)
    add_policy_args(s)
    s.add_argument("--plan", metavar="FILE", help="simulate a saved plan JSON instead of building one")
    s.add_argument("--save-plan", metavar="FILE", help="write the plan as JSON (what `offexec run --plan` runs)")
    s.add_argument("--trace", metavar="FILE",
                   help="write the predicted trace: FILE.csv as CSV, anything else as Chrome/Perfetto JSON")
    s.set_defaults(func=cmd_simulate)
    q = sub.add_parser("search", help="find a policy's best settings (FlexGen: LP + simulation)",
                       description="Search a policy's block shape and placement; prints the chosen settings.")
    add_target_args(q)
    q.add_argument("--policy", default="flexgen", help=f"policy: {', '.join(POLICIES)} (default: %(default)s)")
    q.add_argument("--max-sims", type=positive_int, default=3,
                   help="LP-ranked policies screen 2 x this many best LP candidates by simulation "
                        "(default: %(default)s)")
    q.add_argument("--show", type=positive_int, default=8, help="candidates to list (default: %(default)s)")
    q.add_argument("--progress", action="store_true", help="show a progress bar")
    q.set_defaults(func=cmd_search)
    c = sub.add_parser("compare", help="every policy at its best settings, side by side",
                       description="Search every policy (or --policies) and print them side by side.")
    add_target_args(c)
    c.add_argument("--policies", nargs="+", metavar="POLICY", help=f"subset of: {', '.join(POLICIES)}")
    c.add_argument("--max-sims", type=positive_int, default=3,
                   help="LP-ranked candidates to simulate per policy (default: %(default)s)")
    c.set_defaults(func=cmd_compare)
    v = sub.add_parser("validate", help="re-simulate measured runs and report the prediction error",
                       description="Re-simulate every measured case under DIR (*.case.json, *.trace.csv from "
                                   "`offexec run`) with the hardware profile it names and report predicted vs "
                                   "measured throughput, per-op-kind MAPE and per-step latency error.")
    v.add_argument("dir", help="a directory of measured cases, or one case file")
    v.add_argument("--hardware", default=None,
                   help="hardware preset or profile JSON for every case (default: the one each case names)")
    v.add_argument("--out", metavar="DIR", help="write validation.csv and validation.png there")
    v.add_argument("--strict", action="store_true", help="exit 1 when a threshold is exceeded")
    v.add_argument("--progress", action="store_true", help="show a progress bar")
    v.set_defaults(func=cmd_validate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except OffsimError as e:
        print(f"offsim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("offsim: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
