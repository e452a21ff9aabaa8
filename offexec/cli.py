"""``offexec run``: run one policy's plan with real tensors on a GPU (or the CPU) and set the measurement beside
offsim's prediction for the same plan. (``offexec profile``: offexec/profile.py; ``offexec job``: offexec/job.py;
``offexec selectn-record``: offexec/selectn.py.)

Takes ``offsim simulate``'s model / hardware / policy / workload options (the same argparse helpers), or
``--plan FILE`` (a plan saved by ``offsim simulate --save-plan``), plus ``--device``, ``--trace``, ``--checkpoint``,
``--dtype``, ``--disk-dir``. Before the measured run, the same plan for two tokens runs unmeasured (a warm-up:
kernel loading, GEMM algorithm choice, allocator growth; ``--warmup-mode full`` runs the whole plan instead, so that
the measured run is a steady-state run as offsim predicts it; ``--no-warmup`` skips it). Prints measured and predicted
prefill / decode / total tok/s with the error, the peak memory of each tier, the host's state before the run
(``offexec/hostprobe.py``), the host time spent issuing ops, and, as the last line, one JSON object. Bad input -- an unknown name, a plan that does not fit the GPU budget, a
checkpoint that does not match the model, ``--device cuda`` without a GPU, a disk tier without room, options that
contradict ``--plan`` -- exits with code 2 and one line on stderr, before anything large is allocated; an interrupted
run removes its disk-tier files.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import marshal
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from offsim.cli import (add_compression_args, add_policy_args, add_runtime_args, add_target_args, apply_runtime_args,
                        build_fitting_plan, check_distinct_files, check_output_path, check_plan_conflicts,
                        given_options, quiet_broken_pipe)
from offsim.core.errors import OffsimError
from offsim.core.io import finite_json, open_atomic, write_commented_csv
from offsim.core.provenance import provenance
from offsim.core.sim import simulate
from offsim.core.specs import HARDWARE_PRESETS, Workload, get_hardware, get_model
from offsim.policies import build_plan, load_plan

from . import ALLOCATOR_CAPS, DEFAULT_ALLOCATOR_CAP

WARMUP_MODES = ("short", "full")  # offexec run's unmeasured warm-up: 2 tokens, or the whole plan once

GiB = 1 << 30
PHASES = ("prefill_tok_s", "decode_tok_s", "total_tok_s")
DEFAULT_MODEL = "opt-30b"  # when neither --model nor --checkpoint names one
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="offexec", description=(
        "Run offsim's plans with real tensors on a GPU (or the CPU, for tests) and measure them: one plan beside "
        "its prediction (run), the hardware profile offsim loads (profile), an offline job block after block "
        "(job), Select-N's offline performance record (selectn-record)."))
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a policy's plan with real tensors and compare with offsim's prediction")
    add_target_args(r)
    add_policy_args(r)
    add_compression_args(r)  # (as `offsim simulate`'s: the executor runs the 4-bit formats and sparse attention)
    r.set_defaults(model=None)  # None: the checkpoint's config.json, else DEFAULT_MODEL
    for a in r._actions:  # the shared help says opt-30b, the default of `offsim`; here it depends on --checkpoint
        if a.dest == "model":
            a.help = (f"model preset or a transformers config.json path (default: the --checkpoint's config.json, "
                      f"else {DEFAULT_MODEL})")
        if a.dest == "num_gpus":  # a plan over several GPUs runs one process per GPU, not in `offexec run`
            a.help += ("; offexec run refuses such a plan: save it with `offsim simulate --num-gpus N --save-plan "
                       "FILE` and run `torchrun --nproc-per-node N -m offexec.distributed --plan FILE`")
        if a.dest == "hardware":
            a.help += ("; with --device cpu give a profile JSON written by `offexec profile --device cpu`, else the "
                       "comparison is skipped (a GPU preset says nothing about a CPU run)")
        if a.dest == "gpu_mem_gb":
            a.help += "; with --plan, default: the budget the plan was made for"
    r.add_argument("--plan", metavar="FILE",
                   help="run a plan JSON written by `offsim simulate --save-plan` (it carries model, policy, "
                        "settings and workload: options that set those are then an error)")
    r.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured warm-up before the measured run")
    r.add_argument("--warmup-mode", choices=WARMUP_MODES, default="short",
                   help="the unmeasured warm-up: the same plan for 2 tokens (short: kernels, GEMM heuristics, the "
                        "prefill's allocations) or the whole plan once (full: twice the time; the measured run is "
                        "then a steady-state run, as offsim predicts it: after 'short' its first decode step ran "
                        "~30-150 ms longer on the H200) (default: %(default)s)")
    r.add_argument("--allocator-cap", default=DEFAULT_ALLOCATOR_CAP, choices=ALLOCATOR_CAPS,
                   help="cap PyTorch's GPU allocator at the --gpu-mem-gb budget (budget, default) or at the plan's "
                        "own bytes, what offsim predicts (plan: a run that completes proves the memory contract, "
                        "but where the allocator fragments beyond the footprint's allowance it retries, "
                        "synchronising every stream, and runs slower)")
    r.add_argument("--device", default="cuda", help="'cuda' (default) or 'cpu' (sequential, for tests)")
    r.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="local transformers checkpoint (config.json + *.safetensors) instead of random weights")
    r.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                   help="weights and activations dtype (default: float16; float32 counts 4 bytes per element)")
    r.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts (default: %(default)s)")
    r.add_argument("--disk-dir", default=None, metavar="DIR",
                   help="where the disk tier's files go (default: the system temp directory); removed at exit")
    add_runtime_args(r, simulated=False)  # --disk-cache, --no-cuda-graphs, --run-ahead
    r.add_argument("--trace", default=None, metavar="FILE",
                   help="write the measured trace: .csv or .csv.gz (offsim's trace schema) or Chrome/Perfetto JSON "
                        "otherwise")
    r.add_argument("--progress", action="store_true", help="show progress bars while weights are prepared")
    r.add_argument("--host-profile", default=None, metavar="FILE",
                   help="profile the measured run's issuing thread with cProfile (where host issue time goes): "
                        "pstats to FILE, the 25 costliest functions printed; on CUDA also the caching allocator's "
                        "retries (device-wide synchronisations) by the op handler that caused them")
    r.add_argument("--kernel-profile", default=None, metavar="FILE",
                   help="record the measured run with torch.profiler and write its time by kernel to FILE (.csv or "
                        ".csv.gz: name, category, calls, total_ms, mean_us, share; on CUDA the device's kernels, "
                        "graph replays' included, and copies; on the CPU the operators), the categories and the 15 "
                        "costliest printed (offexec/kernels.py); the profiler slows the run, so its tok/s are no "
                        "measurement")
    # (memory.CUDA_SCHED's keys, spelled out: importing memory brings torch, and --help stays fast without it)
    r.add_argument("--cuda-sched", default="auto", choices=("auto", "spin", "yield", "blocking"),
                   help="how the host threads wait on the GPU (the CUDA context's scheduling flag): auto (CUDA's "
                        "default, which spins on a machine with more cores than contexts), spin, yield, blocking "
                        "(sleep: a blocked CUDA call then costs the issuing thread wall time but no CPU time, so the "
                        "run's issue CPU time is its work alone). Default: %(default)s")
    r.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch's intra-op threads during the run, which CPU attention's kernels use (default: "
                        "torch's, one per usable core); fewer leave cores to the issuing thread and the host workers")
    from .profile import add_profile_parser

    add_profile_parser(sub)  # `offexec profile`: the hardware-profile JSON offsim loads
    from .job import add_job_parser
    from .selectn import add_record_parser

    add_job_parser(sub)  # `offexec job`: an offline job's blocks measured, offsim's prediction beside
    add_record_parser(sub)  # `offexec selectn-record`: Select-N's performance record measured
    ap.subcommands = {"run": r}  # for given_options (only `run` takes --plan)
    return ap


def _jsonable(obj):
    """``obj`` as strict JSON holds it: numpy and other values as text, and every float that is not finite (decode
    at gen-len 1 has no rate) as null -- ``json.dumps`` writes them as Infinity and NaN, which strict readers
    refuse (its ``default`` is never asked about a float)."""
    return finite_json(json.loads(json.dumps(obj, default=lambda x: list(x) if isinstance(x, tuple) else str(x))))


def compare_rows(measured: dict, predicted: dict) -> list[dict]:
    """Measured vs predicted throughput per phase, with the relative error of the prediction."""
    rows = []
    for k in PHASES:
        m, p = measured[k], predicted[k]
        err = (p - m) / m if m and math.isfinite(m) and math.isfinite(p) else float("nan")
        rows.append({"phase": k.replace("_tok_s", ""), "measured_tok_s": m, "predicted_tok_s": p, "error": err})
    return rows


def _dtype_of(args, plan_dtype_bytes: int | None) -> str:
    """The torch dtype name: --dtype, else the plan's element size (4: float32, 2: float16)."""
    if plan_dtype_bytes is None:
        return args.dtype or "float16"
    if args.dtype and DTYPE_BYTES[args.dtype] != plan_dtype_bytes:
        raise OffsimError(f"--dtype {args.dtype} ({DTYPE_BYTES[args.dtype]} bytes) contradicts the plan's "
                          f"{plan_dtype_bytes}-byte elements; drop --dtype")
    return args.dtype or {2: "float16", 4: "float32"}[plan_dtype_bytes]


def _build(args, hw):
    """(plan, model, dtype name, warm-up plan or None, hardware), from --plan or from the flags; the warm-up plan is
    the same policy and settings at gen_len 2, built the same way (``experiments/offexec/h200.py`` does the same).
    With --plan and no --gpu-mem-gb the GPU budget is the one the plan was made for (its ``capacity``), not the
    --hardware's whole GPU (a plan saved for an H200 budget was refused against the default T4's 15 GiB)."""
    if args.plan:
        check_plan_conflicts(getattr(args, "given", set()))
        plan = load_plan(args.plan)
        if args.gpu_mem_gb is None and not plan.stages:
            hw = hw.with_(gpu_mem_bytes=int(plan.capacity["gpu"]))
        from .executor import check_one_host

        check_one_host(plan)  # (before the weights or any buffer)
        model, dtype_name = plan.model, _dtype_of(args, plan.model.dtype_bytes)
        settings, policy = plan.settings, plan.policy
    else:
        if args.checkpoint:  # (before get_model, which calls a missing folder an unknown model)
            from .weights import check_checkpoint_dir

            check_checkpoint_dir(args.checkpoint)
        model = get_model(args.model or args.checkpoint or DEFAULT_MODEL)
        dtype_name = _dtype_of(args, None)
        if dtype_name == "float32":
            model = dataclasses.replace(model, dtype_bytes=4)
        wl = Workload(args.prompt_len, args.gen_len, args.gpu_batch_size, args.num_gpu_batches)
        plan = build_fitting_plan(args, model, hw, wl, model_arg=args.model or args.checkpoint or DEFAULT_MODEL)
        settings, policy = plan.settings, plan.policy
    from .executor import compression_of

    compression_of(plan)  # compression and sparse attention run; CPU attention with compression is refused here
    warm = None
    if not args.no_warmup:
        from .job import WARMUP_GEN_LEN, shortened  # (per-request lengths capped too: a mixed-length plan)

        warm = (plan if getattr(args, "warmup_mode", "short") == "full"
                else build_plan(policy, model, hw, shortened(plan.workload, WARMUP_GEN_LEN), settings))
    apply_runtime_args(args, plan, warm)  # how the ops are issued is part of the plan: executor, check, simulator
    return plan, model, dtype_name, warm, hw


def _dump_host_profile(prof, path: str) -> None:
    """``--host-profile``'s pstats file (what ``Profile.dump_stats`` writes: its stats, marshalled), through
    ``io.open_atomic``. A write that fails is one line, after the run's trace and figures are out."""
    prof.create_stats()
    try:
        with open_atomic(path, binary=True) as f:
            marshal.dump(prof.stats, f)
    except OffsimError as e:
        raise OffsimError(f"--host-profile {path}: cannot write the profile ({e}); the run's trace and figures above "
                          "are complete") from None


def cmd_run(args) -> dict:
    import torch  # imported here so that `offexec --help` and argument errors stay fast

    from . import kernels
    from .executor import check_plan, run_plan
    from .memory import parse_device, require_device, set_cuda_sched
    from .weights import load_checkpoint, random_weights

    if args.no_warmup and "warmup_mode" in getattr(args, "given", set()):
        raise OffsimError(f"--warmup-mode {args.warmup_mode} says how to warm up and --no-warmup not to: give one")
    check_output_path(args.trace, "--trace")
    check_output_path(args.host_profile, "--host-profile")
    check_output_path(args.kernel_profile, "--kernel-profile")
    check_distinct_files(plan=args.plan, trace=args.trace, host_profile=args.host_profile,
                         kernel_profile=args.kernel_profile)
    if args.cuda_sched != "auto":  # before anything touches CUDA (the driver fixes it with the context)
        dev = parse_device(args.device)  # (set_cuda_sched says itself what a missing driver is)
        if dev.type != "cuda":
            raise OffsimError(f"--cuda-sched {args.cuda_sched} applies to a CUDA run, not --device {args.device}")
        set_cuda_sched(args.cuda_sched, dev.index or 0)
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= len(os.sched_getaffinity(0)):
        raise OffsimError(f"--cpu-threads must be between 1 and this process's {len(os.sched_getaffinity(0))} usable "
                          f"cores, got {args.cpu_threads}")
    device = require_device(args.device)
    if device.type not in ("cuda", "cpu"):
        raise OffsimError(f"--device must be 'cuda' or 'cpu', got {args.device!r}")
    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    # a CPU run compares only with a measured CPU profile: a preset describes a GPU
    comparable = device.type == "cuda" or str(args.hardware).lower() not in HARDWARE_PRESETS
    plan, model, dtype_name, warm, hw = _build(args, hw)
    wl = plan.workload
    budget = int(hw.gpu_mem_bytes)
    # every refusal before anything large is allocated: budget, disk room, checkpoint shapes
    need = check_plan(plan, device, budget, args.disk_dir)
    if warm is not None:
        check_plan(warm, device, budget, args.disk_dir)
    dt = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    if args.checkpoint:
        weights = load_checkpoint(args.checkpoint, model, dt, pinned=device.type == "cuda", progress=args.progress)
    else:
        weights = random_weights(model, args.seed, dt, device=args.device, pinned=device.type == "cuda",
                                 progress=args.progress)
    weights_s = time.perf_counter() - t0
    prov = provenance(device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    warmup_s = None
    try:
        if warm is not None:  # unmeasured: its trace is dropped
            t0 = time.perf_counter()
            run_plan(warm, weights, args.device, seed=args.seed, gpu_budget_bytes=budget, disk_dir=args.disk_dir,
                     allocator_cap=args.allocator_cap, cpu_threads=args.cpu_threads)
            warmup_s = time.perf_counter() - t0
        from .hostprobe import host_probe

        probe = host_probe()  # the host's state as the measured run starts (offsim validate sets it beside a profile's)
        prov["host_probe"] = probe
        if args.cuda_sched != "auto":
            prov["cuda_sched"] = args.cuda_sched
        prof = None
        if args.host_profile:  # the issuing thread is this one (host-stream workers are not profiled)
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        # the trace names the plan it ran (its fingerprint; and its file where it sits beside the trace), so that
        # `offsim validate` re-simulates exactly that plan or says that today's code builds another
        where = {"plan_sha256": plan.fingerprint()}
        if args.plan and args.trace and Path(args.plan).resolve().parent == Path(args.trace).resolve().parent:
            where["plan_file"] = Path(args.plan).name
        if args.kernel_profile:
            prov["kernel_profile"] = True  # (a profiled run's figures are no measurement: the trace says so)
        with kernels.recording(device.type) if args.kernel_profile else nullcontext() as kprof:
            res = run_plan(plan, weights, args.device, seed=args.seed, gpu_budget_bytes=budget,
                           disk_dir=args.disk_dir, allocator_cap=args.allocator_cap,
                           trace_allocator=bool(args.host_profile), cpu_threads=args.cpu_threads,
                           meta={"hardware": hw.name, "warmup": warm is not None, **where, **prov})
        if prof is not None:
            prof.disable()
    finally:
        weights.close()
    measured = res.trace.metrics()
    predicted = simulate(plan, hw).metrics()
    if args.trace:
        res.trace.write(args.trace)
    st = res.stats
    rows = compare_rows(measured, predicted)
    print(f"offexec {plan.policy} on {prov['gpu'] or device.type} (budget {budget / GiB:.2f} GiB), {model.name} "
          f"{dtype_name}, prompt {wl.prompt_len}, gen {wl.gen_len}, {wl.gpu_batch_size} x {wl.num_gpu_batches} "
          f"prompts, {len(plan.ops)} ops; weights ready in {weights_s:.1f} s ({weights.source})")
    print(f"warm-up: {'the whole plan' if warm is plan else f'the same plan for {warm.workload.gen_len} tokens'} "
          f"ran unmeasured in {warmup_s:.2f} s"
          if warm is not None else "warm-up: skipped (--no-warmup): the measured run includes first-call costs")
    if comparable:
        print(f"{'phase':<8} {'measured tok/s':>15} {'offsim tok/s':>13} {'error':>8}")
        for r in rows:
            print(f"{r['phase']:<8} {r['measured_tok_s']:>15,.2f} {r['predicted_tok_s']:>13,.2f} "
                  f"{r['error']:>+8.1%}")
    else:
        print(f"{'phase':<8} {'measured tok/s':>15}")
        for r in rows:
            print(f"{r['phase']:<8} {r['measured_tok_s']:>15,.2f}")
        print(f"no comparison with offsim: this ran on the CPU and --hardware {args.hardware} is a GPU preset, so its "
              f"prediction says nothing about this run (give --hardware a profile JSON from `offexec profile "
              f"--device cpu`)")
    print(f"time: prefill {measured['prefill_s']:.3f} s, decode {measured['decode_s']:.3f} s, total "
          f"{measured['total_s']:.3f} s" + (f" (offsim {predicted['total_s']:.3f} s)" if comparable else ""))
    print(f"peak memory: GPU {measured['peak_gpu_bytes'] / GiB:.3f} GiB of {budget / GiB:.3f} GiB budget "
          f"(pre-check {sum(need.values()) / GiB:.3f} GiB; offsim {predicted['peak_gpu_bytes'] / GiB:.3f}"
          + (f"; most allocated at once {st['gpu_max_allocated_bytes'] / GiB:.3f}" if "gpu_max_allocated_bytes" in st
             else "") + "); "
          f"host {measured['peak_cpu_bytes'] / GiB:.3f} GiB (+ {st['host_weights_master_bytes'] / GiB:.3f} GiB "
          f"host master of all weights); disk {measured['peak_disk_bytes'] / GiB:.3f} GiB")
    print(f"host before the run: CPU-attention probe {probe['cpu_attn_ms']:.2f} ms, host copy "
          f"{probe['host_copy_GB_s']:.1f} GB/s, load {probe['load_avg_1m']:.2f} ({probe['usable_cpus']} CPUs, "
          f"{probe['torch_threads']} torch threads; offexec/hostprobe.py)")
    print(f"host time issuing ops: {st['issue_s']:.3f} s = {st['issue_frac']:.1%} of the run ({st['issue_cpu_s']:.3f} s "
          f"of it on the CPU, CUDA waits {args.cuda_sched}); by handler: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(st["issue_s_by_handler"].items(), key=lambda kv: -kv[1])))
    if "host_bound_idle_s" in st:
        print(f"GPU compute idle waiting for the host to issue: {st['host_bound_idle_s']:.3f} s = "
              f"{st['host_bound_idle_frac']:.1%} of the run (issue time that overlapped GPU work is not counted)")
    if "host_in_op_s" in st:
        print(f"GPU compute ops running while the host still issued them: {st['host_in_op_s']:.3f} s = "
              f"{st['host_in_op_frac']:.1%} of the run (inside the ops' spans: an upper bound on the host's share)")
    if args.host_profile:
        import pstats

        if st.get("allocator_retries_by_handler") is not None:
            r = st["allocator_retries_by_handler"]
            print("caching-allocator retries by handler (phase): "
                  + (", ".join(f"{k} {v}" for k, v in sorted(r.items(), key=lambda kv: -kv[1])) or "none"))
        print(f"cProfile of the issuing thread ({args.host_profile}), by own time:")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    ktable = None
    if kprof is not None:
        ktable = kernels.kernel_table(kprof, device.type)
        print(f"time by {'kernel' if device.type == 'cuda' else 'operator'} of the profiled run "
              f"({args.kernel_profile}; the profiler slowed it: the tok/s above are no measurement):")
        print("\n".join(kernels.summary_lines(ktable)))
    g = st["graphs"]
    if g["mode"] == "cuda":
        print(f"CUDA graphs: {g['graphs']} decode ops captured in {g['capture_s']:.2f} s, {g['replays']} replays; "
              f"they hold {g['pool_bytes'] / GiB:.3f} GiB of pool and {g['static_bytes'] / GiB:.3f} GiB of static "
              f"tensors (the pre-check counts {need.get('CUDA graphs', 0) / GiB:.3f} GiB for both)"
              + (f"; capture failed, the rest ran eagerly: {g['failed']}" if g["failed"] else ""))
    out = {"measured": {k: measured[k] for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "prefill_s",
                                                  "decode_s", "total_s", "peak_gpu_bytes", "peak_cpu_bytes",
                                                  "peak_disk_bytes")},
           "predicted": {k: predicted[k] for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "total_s",
                                                   "peak_gpu_bytes")},
           "error": {r["phase"]: r["error"] if comparable else None for r in rows}, "comparable": comparable,
           "warmup": None if warm is None else {"mode": "full" if warm is plan else "short",
                                                "gen_len": warm.workload.gen_len, "wall_s": warmup_s},
           "issue_s": st["issue_s"], "issue_frac": st["issue_frac"], "issue_s_by_handler": st["issue_s_by_handler"],
           "issue_cpu_s": st.get("issue_cpu_s"), "issue_cpu_frac": st.get("issue_cpu_frac"),
           "cuda_sched": args.cuda_sched, "cpu_threads": st.get("cpu_threads"),
           "host_bound_idle_s": st.get("host_bound_idle_s"), "host_bound_idle_frac": st.get("host_bound_idle_frac"),
           "host_in_op_s": st.get("host_in_op_s"), "host_in_op_frac": st.get("host_in_op_frac"),
           "run_ahead_wait_s": st["run_ahead_wait_s"], "graphs": st["graphs"], "allocator": st.get("allocator"),
           "gpu_max_allocated_bytes": st.get("gpu_max_allocated_bytes"),
           "budget_bytes": budget, "within_budget": measured["peak_gpu_bytes"] <= budget,
           "policy": plan.policy, "settings": plan.settings, "model": model.name, "workload": wl.to_dict(),
           "plan_file": args.plan, "provenance": prov}
    print(json.dumps(_jsonable(out), allow_nan=False))
    if prof is not None:  # (last: a profile that cannot be written loses neither the trace nor the figures)
        _dump_host_profile(prof, args.host_profile)
    if ktable is not None:
        try:
            write_commented_csv(args.kernel_profile, prov, ktable)
        except OffsimError as e:
            raise OffsimError(f"--kernel-profile {args.kernel_profile}: cannot write the table ({e}); the run's trace "
                              "and figures above are complete") from None
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            args.given = given_options(build_parser, argv)
            cmd_run(args)
        else:  # profile, job, selectn-record
            args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return 0
    except OffsimError as e:
        print(f"offexec: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return quiet_broken_pipe("offexec")
    except KeyboardInterrupt:  # disk-tier files are removed by the executor's finally and at exit
        print("offexec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
