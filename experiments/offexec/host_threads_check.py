"""Two executor changes, one factor at a time, on matrix v2 cases (on the GPU): Python's thread switch interval
(the host workers -- CPU attention, disk -- and the issuing thread share the GIL: ``Executor.SWITCH_INTERVAL_S``)
and TightLLM's short recompute ops replayed as CUDA graphs (``Plan.graph_max_q_tokens``; 1 replays one-token ops
only, as offexec did before).

Each case of ``--cases`` (tags of ``results/validation/matrix_v2_config.json``) runs at its planned settings under
its budget, once per variant (each after a two-token warm-up), the weights generated once per model. One JSON line
per run: measured and predicted (``--profile``) tok/s, the mean CPU-attention op, host issue share, and whether its
tokens equal the first variant's.

    python -m experiments.offexec.host_threads_check --cases TAG [TAG ...] --out FILE   # on the GPU machine
    python -m experiments.offexec.host_threads_check --report FILE [--md OUT]            # markdown table of a run
"""
from __future__ import annotations

import json
from pathlib import Path

from experiments.common import argparser, provenance

CONFIG = Path("results/validation/matrix_v2_config.json")
PROFILE = "results/profiles/h200_offexec_v2.json"
GiB = 1 << 30
# (name, switch interval s, longest graphed decode op in query tokens)
VARIANTS = (("before: 5 ms, one-token graphs", 5e-3, 1), ("switch 0.2 ms", 2e-4, 1),
            ("recompute graphs", 5e-3, 8), ("both", 2e-4, 8))
# --threads: the CPU attention's intra-op threads (torch.set_num_threads), each twice: the run-to-run spread beside
# the effect (None: torch's default, one per core)
THREADS = (None, None, 4, 4, 8, 8)


def main() -> None:
    ap = argparser(__doc__)
    ap.add_argument("--cases", nargs="+", help="case tags of the matrix v2 config")
    ap.add_argument("--out", help="JSON lines file")
    ap.add_argument("--report", metavar="FILE", help="write a markdown table of the records in FILE")
    ap.add_argument("--md", metavar="OUT", help="with --report: the markdown file (default: stdout)")
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--threads", action="store_true",
                    help="variants of torch's intra-op threads (THREADS) instead of the switch interval and graphs")
    ap.add_argument("--kv-solver", default=None, choices=("ilp", "exact"),
                    help="TightLLM's N_r solver instead of the case's (exact: the same N_r without cvxpy; each run "
                         "records whether its plan is the one measured)")
    args = ap.parse_args()
    if args.report:
        text = report(args.report)
        if args.md:
            Path(args.md).write_text(text)
        else:
            print(text)
        return
    if not args.cases or not args.out:
        ap.error("--cases and --out are required (or --report FILE)")

    import numpy as np
    import torch

    from offexec.executor import run_plan
    from offexec.weights import random_weights
    from offsim import Workload, build_plan, get_hardware, simulate
    from offsim.core.specs import ModelSpec

    doc = json.loads(CONFIG.read_text())
    cases = {c["tag"]: c for c in doc["cases"]}
    unknown = [t for t in args.cases if t not in cases]
    if unknown:
        raise SystemExit(f"not in {CONFIG}: {', '.join(unknown)}")
    out = open(args.out, "w")

    def emit(d):
        print(json.dumps(d, default=str), flush=True)
        out.write(json.dumps(d, default=str) + "\n")
        out.flush()

    emit({"provenance": provenance()})
    by_model: dict[str, list] = {}
    for t in args.cases:
        by_model.setdefault(json.dumps(cases[t]["model_config"], sort_keys=True), []).append(cases[t])
    for key, group in by_model.items():
        model = ModelSpec.from_dict(json.loads(key))
        w = random_weights(model, 0, torch.float16, device="cuda", pinned=True, progress=False)
        try:
            for c in group:
                base = get_hardware("h200", c["gpu_mem_gb"])
                prof = get_hardware(args.profile, c["gpu_mem_gb"])
                if "host_bytes" in c:
                    base = base.with_(cpu_mem_bytes=max(int(c["host_bytes"]), GiB))
                    prof = prof.with_(cpu_mem_bytes=max(int(c["host_bytes"]), GiB))
                wl = Workload.from_dict(c["workload"])
                if args.kv_solver and c["policy"] == "tightllm":
                    c = {**c, "settings": {**c["settings"], "kv_solver": args.kv_solver}}
                first = None
                default_threads = torch.get_num_threads()
                variants = [(f"threads {t or default_threads}", 2e-4, 8, t or default_threads) for t in THREADS] \
                    if args.threads else [v + (default_threads,) for v in VARIANTS]
                for name, switch_s, gq, threads in variants:
                    torch.set_num_threads(threads)
                    plan = build_plan(c["policy"], model, base, wl, c["settings"])
                    plan.graph_max_q_tokens = gq
                    warm = build_plan(c["policy"], model, base, wl.with_(gen_len=2), c["settings"])
                    warm.graph_max_q_tokens = gq
                    kw = dict(gpu_budget_bytes=int(base.gpu_mem_bytes), disk_dir=args.disk_dir,
                              switch_interval_s=switch_s)
                    try:
                        run_plan(warm, w, "cuda", **kw)
                        res = run_plan(plan, w, "cuda", **kw)
                    except Exception as e:  # one failed variant must not lose the others
                        emit({"case": c["tag"], "variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
                        torch.cuda.empty_cache()
                        continue
                    m = res.trace.metrics()
                    df = res.trace.df
                    cpu = df[df["kind"] == "cpu_compute"]
                    dec = cpu[cpu["phase"] == "decode"]
                    pred = simulate(plan, prof, check_memory=False).metrics()
                    toks = np.asarray(res.tokens.cpu() if hasattr(res.tokens, "cpu") else res.tokens)
                    first = toks if first is None else first
                    emit({"case": c["tag"], "variant": name, "switch_interval_s": switch_s, "graph_max_q_tokens": gq,
                          "torch_threads": threads,
                          "measured_total_tok_s": m["total_tok_s"], "measured_decode_tok_s": m["decode_tok_s"],
                          "predicted_total_tok_s": pred["total_tok_s"], "predicted_decode_tok_s": pred["decode_tok_s"],
                          "err_total": pred["total_tok_s"] / m["total_tok_s"] - 1,
                          "cpu_attn_decode_mean_ms": 1e3 * float((dec["end_s"] - dec["start_s"]).mean())
                          if len(dec) else None,
                          "issue_frac": res.stats["issue_frac"], "graphs": res.stats["graphs"],
                          "same_plan_as_measured": plan.fingerprint() == c.get("plan_sha256"),
                          "tokens_equal_first": bool(np.array_equal(toks, first)),
                          "tokens_agree_frac": float((toks == first).mean()),
                          "gpu_max_reserved_GiB": res.stats.get("gpu_max_reserved_bytes", 0) / GiB,
                          "allocator_cap_GiB": res.stats.get("allocator_cap_bytes", 0) / GiB})
                torch.set_num_threads(default_threads)
        finally:
            w.close()
            torch.cuda.empty_cache()
    out.close()


def report(path: str) -> str:
    """Markdown: one row per run of the records file (its provenance on top)."""
    recs = [json.loads(line) for line in open(path)]
    prov = next((r["provenance"] for r in recs if "provenance" in r), {})
    out = [f"Records `{Path(path).name}`: commit {prov.get('commit')}, {prov.get('date')}, `{prov.get('command')}`.",
           "Predicted: offsim on `results/profiles/h200_offexec_v2.json` as it was at that commit.", "",
           "| case | variant | measured total tok/s | predicted | host issue share | mean CPU-attention op (ms) | "
           "graphs (replays) | tokens as the first variant |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        if "case" not in r:
            continue
        if "error" in r:
            out.append(f"| {r['case']} | {r['variant']} | failed: {r['error']} | | | | | |")
            continue
        cpu = r["cpu_attn_decode_mean_ms"]
        g = r["graphs"]
        out.append(f"| {r['case']} | {r['variant']} | {r['measured_total_tok_s']:.1f} | "
                   f"{r['predicted_total_tok_s']:.1f} | {r['issue_frac']:.0%} | "
                   f"{'' if cpu is None else f'{cpu:.2f}'} | {g['graphs']} ({g['replays']}) | "
                   f"{r['tokens_agree_frac']:.0%} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
