"""A card's profile beside another's: what `offexec profile` measured on a new GPU, set against a reference profile.

    python -m experiments.offexec.profile_card NEW.json --ref results/profiles/h200_offexec_v2.json \\
        --model opt-30b --out results/profiles/h100_<commit>/README.md

Two tables, both computed from the two JSON files: the scalar rates (link at 1 GiB, duplex, HBM, the burst GEMM
efficiency at 4096 tokens, the sustained clock fraction, CPU attention, disk, 4-bit passes) and, for ``--model``'s
layer shape, each op table (mode, part) both profiles hold: the median of new / reference over the points they
share. Nothing here feeds offsim; it says how far the reference card's numbers would have been from this card's,
i.e. why a prediction must be made on the card's own profile.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from experiments.common import argparser, provenance
from offsim.core.costmodel import interp

GiB_BYTES = 1 << 30


def _at(curve, x: float) -> float | None:
    """``curve``'s value at ``x`` as the cost model reads it (``costmodel.interp``); None where the profile has no
    such curve."""
    return interp(curve, x) if curve else None


def measured_gpu(d: dict, default: str = "") -> str:
    """The GPU a profile was measured on: its provenance's 'measured' record (a profile assembled from several
    measurements, as profile v2), or the provenance itself (a profile written by one `offexec profile` run);
    ``default`` where neither names one."""
    prov = d.get("provenance", {})
    return str(prov.get("measured", prov).get("gpu", default))


def scalar_rows(new: dict, ref: dict) -> list[tuple[str, float | None, float | None, str]]:
    """(quantity, new, reference, unit) for the headline rates both profiles carry."""
    def curve(key, x):
        return lambda d: _at(d.get(key), x)

    def field(key, scale=1.0):
        return lambda d: (float(d[key]) / scale) if d.get(key) is not None else None

    def sustained(d):  # the OPT-30B-shaped clock probe's fraction (profile-wide field)
        return d.get("sustained_compute_fraction")

    items = [
        ("GPU memory", field("gpu_mem_bytes", GiB_BYTES), "GiB"),
        ("datasheet fp16 peak", field("gpu_peak_flops", 1e12), "TFLOP/s"),
        ("GEMM efficiency at 4096 tokens (burst)", curve("gemm_efficiency", 4096), "of peak"),
        ("sustained clock fraction", sustained, "of burst"),
        ("HBM", field("gpu_hbm_bytes_per_s", 1e9), "GB/s"),
        ("H2D pinned, 1 GiB copy", lambda d: (_at(d.get("h2d_pinned"), GiB_BYTES) or 0) / 1e9 or None, "GB/s"),
        ("D2H pinned, 1 GiB copy", lambda d: (_at(d.get("d2h_pinned"), GiB_BYTES) or 0) / 1e9 or None, "GB/s"),
        ("H2D pageable, 1 GiB copy", lambda d: (_at(d.get("h2d_pageable"), GiB_BYTES) or 0) / 1e9 or None, "GB/s"),
        ("duplex fraction (H2D beside D2H)", field("duplex_fraction"), ""),
        ("CPU attention", field("cpu_attention_flops", 1e9), "GFLOP/s"),
        ("disk read", field("disk_read_bytes_per_s", 1e9), "GB/s"),
        ("disk write", field("disk_write_bytes_per_s", 1e9), "GB/s"),
        ("4-bit dequantize (KV)", field("quant_bytes_per_s", 1e9), "GB/s"),
        ("4-bit dequantize (weights)", field("quant_weight_bytes_per_s", 1e9), "GB/s"),
    ]
    return [(name, fn(new), fn(ref), unit) for name, fn, unit in items]


def op_ratio_rows(new: dict, ref: dict, layer: str) -> list[tuple[str, str, int, float, float, float]]:
    """(mode, part, shared points, median, min, max of new / reference) for each op table of ``layer`` both hold."""
    def tables(d):
        return {(m, p): {float(x): float(y) for x, y in pts} for k, m, p, pts in d.get("op_times", []) if k == layer}

    a, b = tables(new), tables(ref)
    rows = []
    for key in sorted(set(a) & set(b)):
        xs = sorted(set(a[key]) & set(b[key]))
        ratios = [a[key][x] / b[key][x] for x in xs if b[key][x] > 0]
        if ratios:
            rows.append((*key, len(ratios), statistics.median(ratios), min(ratios), max(ratios)))
    return rows


def _fmt(v) -> str:
    if v is None:
        return "–"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def report(new_path: Path, ref_path: Path, model: str) -> str:
    from offsim.core.specs import get_model, layer_key

    new, ref = json.loads(new_path.read_text()), json.loads(ref_path.read_text())
    def gpu(d):  # (a profile that names no GPU: its name)
        return measured_gpu(d, d.get("name", ""))

    layer = layer_key(get_model(model))
    lines = [f"| quantity | {gpu(new)} | {gpu(ref)} | ratio | unit |", "| --- | --- | --- | --- | --- |"]
    for name, x, y, unit in scalar_rows(new, ref):
        r = f"{x / y:.2f}" if x is not None and y else "–"
        lines.append(f"| {name} | {_fmt(x)} | {_fmt(y)} | {r} | {unit} |")
    ops = op_ratio_rows(new, ref, layer)
    lines += ["", f"Op tables of {model}'s layer shape (`{layer}`) both profiles hold: time on {gpu(new)} over time"
              f" on {gpu(ref)} at the points both measured (below 1: faster on {gpu(new)}).", "",
              "| mode | part | points | median | min | max |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {m} | {p} | {n} | {md:.2f} | {lo:.2f} | {hi:.2f} |" for m, p, n, md, lo, hi in ops]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("profile", type=Path, help="the new card's profile (offexec profile)")
    ap.add_argument("--ref", type=Path, default=Path("results/profiles/h200_offexec_v2.json"))
    ap.add_argument("--model", default="opt-30b", help="whose op tables to compare (default: opt-30b)")
    ap.add_argument("--out", type=Path, default=None, help="write the tables here (default: print them)")
    ap.add_argument("--preamble", type=Path, default=None,
                    help="a markdown file put above the generated tables (what was run, where, when)")
    a = ap.parse_args(argv)
    for p in (a.profile, a.ref):
        if not p.is_file():
            raise SystemExit(f"no profile at {p}: give a JSON written by `offexec profile`")
    body = report(a.profile, a.ref, a.model)
    if a.out is None:
        print(body)
        return 0
    prov = provenance()
    cmd = (f"python -m experiments.offexec.profile_card {a.profile} --ref {a.ref} --model {a.model} --out {a.out}"
           + (f" --preamble {a.preamble}" if a.preamble else ""))
    head = a.preamble.read_text().rstrip() + "\n\n" if a.preamble else ""
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(f"{head}<!-- generated by `{cmd}` (commit {prov['commit']}, {prov['date'][:10]}) -->\n\n{body}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
