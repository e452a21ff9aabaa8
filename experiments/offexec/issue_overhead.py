"""Host time the executor's issuing thread spends per op, by handler, on the CPU (issue 14's host-issue target).

A tiny OPT-shaped model with many layers (d_model 64, ``--layers`` 24) runs FlexGen's H200 layout (weights 20/80
GPU/CPU, KV on the host, sub-layer streaming: h2d_weight, h2d_kv, d2h_kv, attn_layer and mlp ops) through
``run_plan(device='cpu', threaded=True)``: the stream scheduler of a CUDA run (``Executor._run_streams``) with host
stand-ins for streams and events, so every op goes through the issuing loop, ``_done`` and its handler. Twice: with
decode graphs off, and with ``graphs='static'`` (decode ops through ``DecodeGraphs.run``'s static buffers, run
eagerly). Each variant runs ``--repeats`` times; per handler the least over runs of (issue seconds / ops) from the
run's ``issue_s_by_handler`` (the least: other load on the machine only adds), the loop's own time per op
(``dispatch_s_per_op``: finding the next op, its dependencies, the window), and over all ops the issue time and the
issuing thread's CPU time (``issue_cpu_s``, which time spent descheduled does not inflate). Then one more run under cProfile (the issuing thread only) prints the functions with the
most own time.

Limits: CPU stand-ins -- no CUDA launch, event or stream cost, and a copy or a tiny compute op really runs at issue
(its work is inside the handler's figure; the model is tiny so that the Python around it dominates). The figures
compare code versions on one machine; they are not the H200's issue times.

    python -m experiments.offexec.issue_overhead [--layers 24] [--repeats 5] [--top 25]
"""
from __future__ import annotations

import cProfile
import dataclasses
import io
import pstats

from experiments.common import argparser, finish, provenance

WORKLOAD = dict(prompt_len=32, gen_len=16, gpu_batch_size=4, num_gpu_batches=3)
SETTINGS = {"percent": (20, 80, 0, 100, 100, 0)}


def main() -> None:
    ap = argparser(__doc__)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="functions of the cProfile listing")
    args = ap.parse_args()

    import torch

    from offexec.executor import run_plan
    from offexec.program import HOST_STREAMS, bind
    from offexec.weights import random_weights
    from offsim import Workload, build_plan, get_hardware, get_model

    torch.set_num_threads(1)
    spec = dataclasses.replace(get_model("opt-125m"), name="tiny-opt", num_layers=args.layers, d_model=64,
                               num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=128, vocab_size=128, dtype_bytes=4)
    plan = build_plan("flexgen", spec, get_hardware("h200"), Workload(**WORKLOAD), SETTINGS)
    w = random_weights(spec, seed=0, progress=False)
    fn_of = [b.fn for b in bind(plan, w.layout).bound]
    counts: dict[str, int] = {}
    for op, fn in zip(plan.ops, fn_of):
        if op.stream not in HOST_STREAMS:
            counts[fn] = counts.get(fn, 0) + 1
    prov = provenance(layers=args.layers, ops=len(plan.ops), issued_ops=sum(counts.values()), **WORKLOAD)
    print("# " + " ".join(f"{k}={v}" for k, v in prov.items()))
    out = {"provenance": prov, "us_per_op": {}}
    for graphs in ("off", "static"):
        runs = [run_plan(plan, w, "cpu", threaded=True, graphs=graphs).stats for _ in range(args.repeats)]
        us = {fn: min(r["issue_s_by_handler"].get(fn, 0.0) for r in runs) / n * 1e6 for fn, n in sorted(counts.items())}
        us["(dispatch)"] = min(r["dispatch_s_per_op"] for r in runs) * 1e6
        issued = sum(counts.values())
        us["(all issued ops)"] = min(r["issue_s"] for r in runs) / issued * 1e6
        us["(all, CPU time)"] = min(r["issue_cpu_s"] for r in runs) / issued * 1e6
        out["us_per_op"][graphs] = us
        print(f"\ngraphs={graphs}: issuing thread, us per op (least of {args.repeats} runs)")
        for fn, v in us.items():
            print(f"  {fn:18s} {counts.get(fn, issued):6d} ops {v:8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    run_plan(plan, w, "cpu", threaded=True, graphs="static")
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print("\ncProfile of one graphs=static run (issuing thread), by own time:")
    print(s.getvalue().split("\n", 4)[-1].rstrip())
    finish(out)


if __name__ == "__main__":
    main()
