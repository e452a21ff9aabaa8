"""A folder of peer runs made by hand (each worker's output saved as ``<name>.log``) as one table: batch, budget, the
run's tok/s, its decode steps (median and spread), the caching allocator's device calls during the measured generate,
and offsim's prediction of the same run (``real_throughput.predict_peer``: the peer's ``*-ref`` policy on the
profile, nothing fitted). For controls the grid does not run (``experiments.real_throughput`` picks one batch per
point): DeepSpeed at two batches under one budget and one batch under two budgets separates what grows with the batch
from what grows near the budget.

    python -m experiments.peers.control_table results/real_throughput/ds_control_h100_59beda7 [--write]

Prints the table (and writes it between the ``generated`` markers of the folder's README with ``--write``).
"""
from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from experiments.common import argparser
from experiments.peers.common import parse_results

GiB = 2 ** 30
BEGIN, END = "<!-- generated: control -->", "<!-- /generated: control -->"


def records(folder: Path) -> list[tuple[str, dict]]:
    """Every ``PEER_RESULT`` record of the folder's ``*.log`` files, with its file's stem, by budget then batch."""
    out = []
    for f in sorted(folder.glob("*.log")):
        for r in parse_results(f.read_text(errors="replace")):
            out.append((f.stem, r))
    return sorted(out, key=lambda x: (float(x[1].get("budget_gib") or 0), int(x[1].get("batch") or 0)))


def _steps(r: dict) -> str:
    ms = r.get("decode_step_ms") or []
    if not ms:
        return "–"
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return f"{statistics.median(ms):.0f} ({q[0]:.0f}–{q[-1]:.0f})"


def table(rows: list[tuple[str, dict]]) -> str:
    from experiments.real_throughput import predict_peer

    head = ["run", "system", "model", "prompt/gen", "budget GiB", "batch", "status", "decode tok/s", "offsim decode",
            "error", "decode step ms, median (p10–p90)", "peak reserved GiB", "cudaMalloc / cudaFree in generate",
            "allocator retries in generate"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in rows:
        p = predict_peer(r)
        dec = r.get("decode_tok_s")
        err = f"{p['decode_tok_s'] / dec - 1:+.1%}" if p and dec else "–"
        out.append("| " + " | ".join([
            name, str(r.get("system")), str(r.get("model")), f"{r.get('prompt_len')}/{r.get('gen_len')}",
            f"{float(r.get('budget_gib') or 0):g}", str(r.get("batch")), str(r.get("status")),
            f"{dec:.2f}" if dec else "–", f"{p['decode_tok_s']:.2f}" if p else "–", err, _steps(r),
            f"{r['peak_gpu_bytes'] / GiB:.2f}" if r.get("peak_gpu_bytes") else "–",
            f"{r.get('gen_num_device_alloc', '–')} / {r.get('gen_num_device_free', '–')}",
            str(r.get("gen_num_alloc_retries", "–"))]) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--write", action="store_true", help="write the table into the folder's README.md")
    args = ap.parse_args(argv)
    rows = records(args.folder)
    if not rows:
        print(f"control_table: no PEER_RESULT records in {args.folder}/*.log", file=sys.stderr)
        return 2
    text = table(rows)
    print(text)
    if args.write:
        readme = args.folder / "README.md"
        old = readme.read_text() if readme.exists() else f"{BEGIN}\n{END}\n"
        if BEGIN not in old:
            old += f"\n{BEGIN}\n{END}\n"
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}\n{END}", old, flags=re.S)
        readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
