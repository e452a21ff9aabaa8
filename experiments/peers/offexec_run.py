"""offexec's policies at their best for one workload point, as systems ``offexec-<policy>``: the existing experiment
path (``experiments.common.best_settings``: ``offsim search`` on the H200 profile at the budget → plan →
``offexec.executor.run_plan``), beside the peers in ``experiments.real_throughput``.

One process: the seeded random weights once (pinned), then per policy a 2-token warm-up of the same plan and the
measured run; offsim's prediction of the same plan beside it; the link bound from the run's own decode H2D bytes.
The host tier offsim plans with keeps the executor's master copy of the weights plus the host KV within the host
limit (``hardware``). The largest block (``--max-batch``) is lowered until offsim predicts the run
within ``--max-run-s`` (device time).

    python -m experiments.peers.offexec_run --model opt-30b --prompt-len 512 --gen-len 32 --budget-gib 16 \\
        [--policies flexgen flexgen-cpuattn tightllm static-zero static-accelerate]
    python -m experiments.peers.offexec_run --model tiny.json --device cpu ...   # smoke test, no GPU

Prints ``PEER_RESULT {json}`` per policy (``common.emit``) and ends with one JSON line.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path

from experiments.peers.common import (GiB, HOST_LIMIT_GIB, base_record, emit, link_bound, measure_h2d, peak_rss_bytes,
                                      point_parser, versions)

# system suffix -> (offsim policy, fixed settings); the searched best (experiments.common.best_settings) under
# those settings. offsim's search picks small blocks on this profile (OPT-30B 512/32 16 GiB: 16 prompts), where
# offexec measured more at 48 (results/offexec): the '-anchor' variants run docs/anchors.md §2's placement (20/80
# weights, KV on the CPU, GPU attention) at the largest of ANCHOR_SHAPES that fits, as experiments/offexec/h200.py
# does; the best of each system family is what the report compares
POLICIES = {"flexgen": ("flexgen", {}), "flexgen-cpuattn": ("flexgen", {"cpu_attention": True}),
            "flexgen-anchor": ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": False}),
            "tightllm": ("tightllm", {}),
            "tightllm-anchor": ("tightllm", {"percent": (20, 80, 0, 100, 100, 0)}),
            "static-zero": ("static-zero", {}), "static-accelerate": ("static-accelerate", {}),
            "selectn": ("selectn", {}),
            # FlexGen's 4-bit group-wise weights and KV (issue 16), beside FlexGen's own 4-bit mode
            "flexgen+4bit": ("flexgen", {"compress_weight": True, "compress_cache": True}),
            "tightllm+4bit": ("tightllm", {"compress_weight": True, "compress_cache": True})}
ANCHORED = ("flexgen-anchor", "tightllm-anchor")
ANCHOR_SHAPES = ((48, 3), (32, 3), (16, 3), (8, 3), (4, 3), (2, 3), (1, 3))
# settings put on the searched best before the plan is built: TightLLM's N_r by its certified 'exact' path (no
# cvxpy on the GPU machine; experiments/offexec/h200.py runs it so)
OVERRIDES = {"tightllm": {"kv_solver": "exact"}}
# static-zero and static-accelerate (offexec's runs of the peers' schedules) are predicted at > 25 min for OPT-30B
# even at 8 prompts: ask for them with --policies
DEFAULT_POLICIES = ("flexgen", "flexgen-anchor", "tightllm", "tightllm-anchor", "flexgen+4bit", "tightllm+4bit")
# profile v2: op tables, issue rows and the fused 4-bit kernels' rates (results/profiles/README.md)
PROFILE = Path(__file__).resolve().parents[2] / "results/profiles/h200_offexec_v2.json"
MAX_BATCHES = (512, 384, 256, 192, 128, 96, 64, 48, 32, 16, 8)


def hardware(model, budget_gib: float, host_limit_gib: float, profile: str | None = None):
    """The H200 profile at ``budget_gib`` with the host tier offsim may plan: the executor keeps a host master copy
    of every weight (W) beside the host KV, so it needs KV <= limit − W; offsim's host tier holds the CPU-homed
    weights W_cpu and the KV, and W_cpu >= W − budget (the rest must fit the GPU), so a host tier of limit − budget
    keeps KV <= limit − budget − W_cpu <= limit − W."""
    from offsim import get_hardware

    prof = profile or (str(PROFILE) if PROFILE.exists() else "h200")
    host = max((host_limit_gib - budget_gib) * GiB, GiB)
    return get_hardware(prof, budget_gib).with_(cpu_mem_bytes=int(host))


def plan_point(name: str, model, hw, prompt_len: int, gen_len: int, max_batch: int, max_run_s: float):
    """(settings, workload, plan, predicted metrics) of policy ``name`` at its best with at most ``max_batch``
    prompts, the cap lowered until the predicted run takes at most ``max_run_s``. Raises OffsimError."""
    from experiments.common import best_settings, executor_host_bytes
    from offsim import build_plan, simulate
    from offsim.core.errors import OffsimError

    pol, fixed = POLICIES[name]
    host_limit = hw.cpu_mem_bytes + hw.gpu_mem_bytes  # (``hardware``: the host tier is the limit − the budget)
    if fixed.get("compress_weight"):
        # with 4-bit weights the executor also holds every layer packed (footprint.executor_host_bytes): the host
        # tier offsim may plan shrinks by that much
        from offsim.core import footprint as fp
        from offsim.core.specs import Compression

        packed = model.num_layers * fp.stored_layer_weight_bytes(model, Compression.from_settings(fixed))
        hw = hw.with_(cpu_mem_bytes=max(int(hw.cpu_mem_bytes - packed), GiB))
    why = None
    if name in ANCHORED:
        from offsim import Workload

        for gbs, ngb in ANCHOR_SHAPES:
            if gbs * ngb > max_batch:
                continue
            st = {**fixed, **OVERRIDES.get(pol, {})}
            wl = Workload(prompt_len, gen_len, gbs, ngb)
            try:
                plan = build_plan(pol, model, hw, wl, st)
                m = simulate(plan, hw).metrics()
            except OffsimError as e:
                why = e
                continue
            if m["total_s"] <= max_run_s:
                return st, wl, plan, m
            why = OffsimError(f"predicted {m['total_s']:.0f} s at {wl.num_prompts} prompts, over {max_run_s:.0f} s")
        raise why or OffsimError("no block fits")
    for cap in [c for c in MAX_BATCHES if c <= max_batch] or [max_batch]:
        try:
            st, wl = best_settings(pol, fixed, model, hw, prompt_len, gen_len, cap)
        except OffsimError as e:
            why = e
            continue
        st = {**st, **OVERRIDES.get(pol, {})}
        plan = build_plan(pol, model, hw, wl, st)
        held = sum(executor_host_bytes(plan).values())
        if held > host_limit:  # the master, a packed copy and the host KV as the executor holds them
            why = OffsimError(f"{wl.num_prompts} prompts need {held / GiB:.1f} GiB of host memory in offexec "
                              f"(> {host_limit / GiB:.1f})")
            continue
        m = simulate(plan, hw).metrics()
        if m["total_s"] <= max_run_s:
            return st, wl, plan, m
        why = OffsimError(f"predicted {m['total_s']:.0f} s at {wl.num_prompts} prompts, over {max_run_s:.0f} s")
    raise why or OffsimError("no block fits")


def model_for(model_name: str, prompt_len: int, gen_len: int):
    """offsim's model, its learned position table extended to prompt + gen when shorter (OPT's 2048 at 1984 + 128),
    as the peers' harnesses extend theirs (random weights: the extra rows change no timing)."""
    import dataclasses

    from offsim import get_model

    model = get_model(model_name)
    if prompt_len + gen_len - 1 > model.max_positions:
        model = dataclasses.replace(model, max_positions=prompt_len + gen_len)
    return model


def settings_key(name: str, model_name: str, prompt_len: int, gen_len: int, budget_gib: float) -> str:
    """The key of a policy's planned settings at a point (``experiments.real_throughput.point_key``'s form)."""
    return f"offexec-{name}|{model_name}|p{prompt_len}|g{gen_len}|b{budget_gib:g}"


def plan_or_cached(name: str, model, hw, prompt_len: int, gen_len: int, max_batch: int, max_run_s: float,
            cache: dict | None, key: str):
    """``plan_point``, or the settings and workload ``cache`` holds for ``key`` (planned on another machine: the
    GPU machine then needs no LP solver); TightLLM's N_r by its certified 'exact' path (no cvxpy), as
    experiments/offexec/h200.py runs it. Stores what it plans in ``cache``."""
    from offsim import Workload, build_plan, simulate

    if cache is not None and key in cache:
        if "error" in cache[key]:
            from offsim.core.errors import OffsimError

            raise OffsimError(cache[key]["error"])
        st, wl = dict(cache[key]["settings"]), Workload.from_dict(cache[key]["workload"])
        plan = build_plan(POLICIES[name][0], model, hw, wl, st)
        return st, wl, plan, simulate(plan, hw).metrics()
    st, wl, plan, m = plan_point(name, model, hw, prompt_len, gen_len, max_batch, max_run_s)
    if cache is not None:
        cache[key] = {"settings": st, "workload": wl.to_dict(), "predicted_total_s": m["total_s"]}
    return st, wl, plan, m


def run_point(model_name: str, prompt_len: int, gen_len: int, budget_gib: float, policies, device: str = "cuda",
              host_limit_gib: float = HOST_LIMIT_GIB, max_batch: int = 256, max_run_s: float = 300.0,
              profile: str | None = None, only_plan: bool = False, cache: dict | None = None,
              trace_dir: str | None = None) -> list[dict]:
    """Every policy of ``policies`` at this point; one record each. ``cache``: planned settings by
    ``settings_key`` (read, and filled with what is planned here). ``trace_dir``: each run's measured trace goes
    there as gzip CSV (offsim's trace schema: ``offsim validate`` re-simulates it), named in the record's
    ``trace`` field."""
    import torch

    from offexec.executor import check_plan, run_plan
    from offexec.weights import random_weights
    from offsim import build_plan, get_model
    from offsim.core.errors import OffsimError

    model = model_for(model_name, prompt_len, gen_len)
    cuda = device == "cuda"
    hw = hardware(model, budget_gib, host_limit_gib, profile)
    budget = int(hw.gpu_mem_bytes)
    planned, recs = [], []
    for name in policies:
        rec = base_record(f"offexec-{name}", model_name, prompt_len, gen_len, budget_gib, probe=True,
                          versions=versions("torch", "offsim"))
        try:
            key = settings_key(name, model_name, prompt_len, gen_len, budget_gib)
            try:
                st, wl, plan, pm = plan_or_cached(name, model, hw, prompt_len, gen_len, max_batch, max_run_s, cache, key)
            except OffsimError as e:
                if cache is not None and key not in cache:
                    cache[key] = {"error": str(e)}
                raise
            if not only_plan:
                check_plan(plan, device, budget)
            rec.update(batch=wl.num_prompts, gpu_batch_size=wl.gpu_batch_size, num_gpu_batches=wl.num_gpu_batches,
                       settings=json.dumps({"policy": plan.policy, **st, "extended_positions":
                                            model.max_positions > get_model(model_name).max_positions},
                                           sort_keys=True, default=str),
                       predicted_decode_tok_s=pm["decode_tok_s"], predicted_total_tok_s=pm["total_tok_s"])
            planned.append((name, st, wl, plan, rec))
        except (OffsimError, RuntimeError, ValueError, ImportError) as e:
            rec.update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
            recs.append(rec)
    if only_plan or not planned:
        return recs + [p[4] for p in planned]
    h2d = measure_h2d() if cuda else None
    t0 = time.perf_counter()
    weights = random_weights(model, seed=0, device=device, pinned=cuda, progress=False)
    weights_s = time.perf_counter() - t0
    try:
        for name, st, wl, plan, rec in planned:
            t1 = time.perf_counter()
            try:
                pol = POLICIES[name][0]
                warm = build_plan(pol, model, hw, wl.with_(gen_len=2), st)
                run_plan(warm, weights, device, seed=1, gpu_budget_bytes=budget)
                res = run_plan(plan, weights, device, seed=1, gpu_budget_bytes=budget)
                m = res.trace.metrics()
                df = res.trace.df
                dec = df[(df["step"] > 0) & (df["kind"] == "h2d")]
                dec_bytes = int(dec["nbytes"].sum())
                rec.update({k: m[k] for k in ("prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s",
                                              "total_tok_s")})
                rec.update(decode_h2d_bytes=dec_bytes, h2d_bytes_per_s=h2d,
                           link_bound_decode_tok_s=link_bound(wl.num_prompts, gen_len, dec_bytes, h2d) if h2d
                           else None,
                           peak_gpu_bytes=int(res.stats.get("gpu_max_reserved_bytes", 0)),
                           issue_frac=res.stats.get("issue_frac"), allocator=res.stats.get("allocator"))
                if trace_dir:
                    from experiments.offexec.h200 import save_trace_gz

                    d = Path(trace_dir)
                    d.mkdir(parents=True, exist_ok=True)
                    tag = f"offexec-{name}_{Path(model.name).name}_p{prompt_len}_g{gen_len}_b{budget_gib:g}"
                    rec["trace"] = save_trace_gz(res.trace, d / f"{tag}.trace.csv").name
            except Exception as e:  # noqa: BLE001 -- one policy's failure is a result
                traceback.print_exc()
                oom = cuda and isinstance(e, torch.OutOfMemoryError)
                rec.update(status="oom" if oom else "error", reason=f"{type(e).__name__}: {str(e)[:300]}")
            rec["peak_host_bytes"] = peak_rss_bytes()
            rec["wall_s"] = time.perf_counter() - t1
            rec["weights_s"] = weights_s
            emit(rec)
            recs.append(rec)
            res = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    finally:
        weights.close()
    return recs


def main(argv=None) -> int:
    ap = point_parser(__doc__)
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=list(POLICIES))
    ap.add_argument("--host-limit-gib", type=float, default=HOST_LIMIT_GIB)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-run-s", type=float, default=300.0, help="lower the block until offsim predicts this")
    ap.add_argument("--profile", default=None, help="hardware profile JSON (default results/profiles/h200_offexec)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--only-plan", action="store_true", help="plan and print, run nothing")
    ap.add_argument("--trace-dir", default=None, help="write each run's measured trace there (gzip CSV)")
    ap.add_argument("--settings-cache", default=None, help="JSON of planned settings by point and policy "
                    "(experiments.real_throughput --plan-only writes it): skip the search where it has them")
    args = ap.parse_args(argv)
    cache = None
    if args.settings_cache and Path(args.settings_cache).exists():
        cache = json.loads(Path(args.settings_cache).read_text())
    recs = run_point(args.model, args.prompt_len, args.gen_len, args.budget_gib, args.policies, args.device,
                     args.host_limit_gib, args.max_batch, args.max_run_s, args.profile, args.only_plan, cache,
                     args.trace_dir)
    for r in recs:
        if "wall_s" not in r:  # skipped or only planned (measured runs were printed as they finished)
            emit(r)
    print(json.dumps([{k: r.get(k) for k in ("system", "status", "batch", "decode_tok_s", "total_tok_s")}
                      for r in recs], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
