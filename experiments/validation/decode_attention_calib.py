"""Write results/validation/decode_attention_calib.{csv,md}: what the calibration cases say about a graphed decode
op's attention (issue 13). For each calibration case whose decode steps run one 'layer' op per (step, layer) as a
CUDA graph (one query per sequence), the measured op time over the decode steps beside offsim's price of it on the
profile: the op's measured time minus the profile's ('graph', 'layer') row at its sequence count (the op without
attention over a long buffer) is what its attention took; over the KV bytes of the whole buffer (the graph attends
over all of it, the unwritten tail masked: offexec/graphs.py) that is the rate the kernel reached. Read, not fitted:
nothing here enters the cost model; the ('attn', 'decode_graph:B') rows measured by
``offexec profile --attention-only decode`` do. Only the calibration split is read.

    python -m experiments.validation.decode_attention_calib [--profile results/profiles/h200_offexec_v2.json]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import pandas as pd

from offsim.analysis.validate import load_case, resimulate, run_setup
from offsim.core import costmodel as cm
from offsim.core.io import write_text_atomic
from offsim.core.plan import Plan
from offsim.core.provenance import provenance

ROOT = Path(__file__).resolve().parents[2]
CALIB = ROOT / "results" / "validation" / "h200_calib"
PROFILE = ROOT / "results" / "profiles" / "h200_offexec_v2.json"
OUT = ROOT / "results" / "validation" / "decode_attention_calib"


def case_row(path: Path, hw_path: str) -> dict | None:
    c = load_case(path)
    meta = c["meta"]
    plan = Plan.load(CALIB / meta["plan_file"])
    if not plan.graph_q_tokens or plan.workload.num_gpu_batches != 1:
        return None
    ops = [o for o in plan.ops if o.kind == "compute" and o.phase == "decode" and o.step >= 2 and o.q_tokens == 1
           and o.part not in ("embed", "head")]
    if not ops or {o.part for o in ops} != {"layer"}:
        return None
    model, hw, _, _ = run_setup(meta, str(CALIB / path.name.removesuffix(".case.json")), hw_path)
    measured = {(s, l): t for s, l, k, n, t in c["ops_by_kind"] if k == "compute" and n == 1}
    pred = resimulate(c, hw_path).df
    pred = pred[pred.kind == "compute"]
    pred = dict(zip(zip(pred.step, pred.layer), pred.end_s - pred.start_s))
    inner = [o for o in ops if 0 < o.layer < plan.model.num_layers - 1 and (o.step, o.layer) in measured]
    if not inner:
        return None
    seqs, buf = inner[0].num_seqs, plan.workload.max_len
    table = cm.table_seconds(cm.op_table(hw, model, "graph", "layer"), seqs)
    m = np.array([measured[(o.step, o.layer)] for o in inner])
    p = np.array([pred[(o.step, o.layer)] for o in inner])
    first, last = min(o.step for o in inner), max(o.step for o in inner)
    at = lambda arr, s: statistics.median(arr[[o.step == s for o in inner]])  # noqa: E731
    attn_ms = 1e3 * (float(np.median(m)) - table)
    kv_mb = seqs * buf * model.kv_bytes_per_token() / 1e6
    return {"case": path.name.removesuffix(".case.json"), "model": model.name, "sequences": seqs,
            "buffer_tokens": buf, "context_first": first + plan.workload.prompt_len,
            "context_last": last + plan.workload.prompt_len, "kv_buffer_MB": round(kv_mb, 1),
            "measured_op_ms": round(1e3 * float(np.median(m)), 4), "graph_row_ms": round(1e3 * table, 4),
            "implied_attention_ms": round(attn_ms, 4),
            "implied_TB_s": round(kv_mb / attn_ms / 1e3, 2) if attn_ms > 0 else float("nan"),
            "priced_op_ms": round(1e3 * float(np.median(p)), 4),
            # the profile's model-agnostic decode efficiency read at the whole buffer instead of the context
            "priced_at_buffer_ms": round(1e3 * cm.compute_seconds(model, hw, "layer", seqs, 1, buf), 4),
            "measured_first_step_ms": round(1e3 * at(m, first), 4),
            "measured_last_step_ms": round(1e3 * at(m, last), 4),
            "priced_first_step_ms": round(1e3 * at(p, first), 4), "priced_last_step_ms": round(1e3 * at(p, last), 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    rows = [r for f in sorted(CALIB.glob("*.case.json")) if (r := case_row(f, args.profile)) is not None]
    df = pd.DataFrame(rows).sort_values(["sequences", "kv_buffer_MB"])
    out = Path(args.out)
    prov = provenance(profile=str(Path(args.profile).relative_to(ROOT)) if Path(args.profile).is_absolute() and
                      Path(args.profile).is_relative_to(ROOT) else args.profile, cases=str(CALIB.relative_to(ROOT)))
    out.parent.mkdir(parents=True, exist_ok=True)
    csv = out.with_suffix(".csv")
    write_text_atomic(csv, f"# {prov}\n" + df.to_csv(index=False))
    grow_m = (df.measured_last_step_ms / df.measured_first_step_ms - 1).median()
    grow_p = (df.priced_last_step_ms / df.priced_first_step_ms - 1).median()
    few, many = df[df.sequences <= 8], df[df.sequences >= 24]
    e_ctx, e_buf = df.priced_op_ms / df.measured_op_ms - 1, df.priced_at_buffer_ms / df.measured_op_ms - 1
    off_ctx, abs_ctx, off_buf, abs_buf = e_ctx.median(), e_ctx.abs().median(), e_buf.median(), e_buf.abs().median()
    cols = ["case", "sequences", "buffer_tokens", "kv_buffer_MB", "measured_op_ms", "graph_row_ms",
            "implied_attention_ms", "implied_TB_s", "priced_op_ms", "priced_at_buffer_ms", "measured_first_step_ms",
            "measured_last_step_ms", "priced_first_step_ms", "priced_last_step_ms"]
    lines = ["# A graphed decode op's attention in the calibration cases", "",
             f"Written by `python -m experiments.validation.decode_attention_calib` ({prov['commit']}, "
             f"{prov['date'][:10]}) from the calibration cases ({len(df)} whose decode runs one graphed 'layer' op "
             f"per step and layer) and the profile `{Path(args.profile).name}`; every number is computed there. "
             "Medians over each case's decode steps from the second on, the first and last layers left out. "
             "`implied attention` = measured op - the profile's ('graph', 'layer') row at the sequence count; "
             "`implied TB/s` = the whole KV buffer's bytes over it (the graph attends over all of it).", "",
             f"- Over the decode steps a measured op's time changes by {grow_m:+.1%} (median, first step to last); "
             f"offsim's price today by {grow_p:+.1%}: the measured op reads its whole buffer at every step.",
             f"- Priced today at the step's context, an op is off its measured time by {off_ctx:+.1%} (median; "
             f"median absolute {abs_ctx:.1%}); with the profile's model-agnostic decode efficiency read at the whole "
             f"buffer instead (`priced_at_buffer_ms`), {off_buf:+.1%} (median absolute {abs_buf:.1%}).",
             f"- Implied rate, median: {few.implied_TB_s.median():.2f} TB/s at 8 sequences or fewer "
             f"({len(few)} cases), {many.implied_TB_s.median():.2f} TB/s at 24 or more ({len(many)} cases); the "
             "profile's model-agnostic `attn_decode_efficiency` prices by context alone. A rate above the HBM's "
             "4.8 TB/s says the ('graph', 'layer') row overstates the rest of that op in that run: the split is only "
             "as good as the row, so these are pointers, not measurements of the kernel (the 'decode_graph' rows "
             "are).", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"{out.with_suffix('.md')}: {len(df)} cases")


if __name__ == "__main__":
    main()
