"""Extend a profile's op-table curves past their longest measured point with a re-measurement's longer points.

A profile row measured by context (``('cpu', 'attn_ctx:B')``: CPU attention by context) is read linearly between its
points and proportionally past the last (``costmodel._rows_by_batch_and_context``). When the probe once stopped
short (OPT's CPU-attention rows end at 518.5 tokens: before 369e279 the probe dropped the context past OPT's 2048
positions), a long prompt is priced by that extrapolation. A later ``offexec profile --base BASE ...`` measures the
whole curve again, short points included; on this host those move by up to 44 % between two measurements of the
same op (results/profiles/cpu_attention_opt_long_7040813/), so replacing the curve trades one measurement's noise
for another's on every case. This keeps the base's points and appends only the points beyond the base's last one
(the mean over the parts where several measured them): cases within the measured range are priced as before, the
extrapolation is replaced by a measurement.

    python -m experiments.validation.extend_rows --base results/profiles/h200_offexec_v2.json \
        --part A.json [--part B.json] --mode cpu --prefix attn_ctx: --out PART.json
    python -m experiments.validation.extend_rows --base ... --part CAPTURE_ONLY.json --mode issue --prefix "" \
        --new-only --out PART.json     (only the row kinds the base lacks: e.g. ('issue', 'eager:head'))

Writes PART.json: the base profile with the extended rows, a part that ``offexec profile --merge`` and
``experiments.validation.profile_variants`` take like any other (the rows it changes are those extended).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from experiments.common import argparser, provenance
from offsim.core.errors import OffsimError
from offsim.core.io import read_json_object


def extend(base: dict, parts: list[dict], mode: str, prefix: str) -> tuple[dict, list[str]]:
    """``base`` with each (layer shape, ``mode``, ``prefix``...) curve extended by the parts' points past its last
    x; returns the profile and a line per extended row."""
    longer: dict[tuple, dict[float, list[float]]] = {}
    rows = {tuple(r[:3]): r for r in base.get("op_times", [])}
    for p in parts:
        for r in p.get("op_times", []):
            k = tuple(r[:3])
            if r[1] != mode or not str(r[2]).startswith(prefix) or k not in rows:
                continue
            last = max(x for x, _ in rows[k][3])
            for x, t in r[3]:
                if x > last:
                    longer.setdefault(k, {}).setdefault(float(x), []).append(float(t))
    out, lines = [], []
    for r in base.get("op_times", []):
        k = tuple(r[:3])
        if k in longer:
            add = [[x, statistics.mean(ts)] for x, ts in sorted(longer[k].items())]
            r = [*r[:3], sorted([list(pt) for pt in r[3]] + add)]
            lines.append(f"{k[0]} {k[1]} {k[2]}: + " + ", ".join(f"{x:g} tokens {t * 1e3:.2f} ms"
                                                                    f" (mean of {len(longer[k][x])})"
                                                                    for x, t in add))
        out.append(r)
    return {**base, "op_times": out}, lines


def add_new(base: dict, parts: list[dict], mode: str, prefix: str) -> tuple[dict, list[str]]:
    """``base`` with the parts' (layer shape, ``mode``, ``prefix``...) rows that ``base`` has no row for at all (a
    row kind the probe did not measure when the base was made, e.g. the issue rows of the head, the embedding and
    the weight copies since stop 56); the base's own rows stay as they are, however the part re-measured them (the
    mean over the parts where several measured a new row, point by point). Returns the profile and a line per row."""
    rows = {tuple(r[:3]) for r in base.get("op_times", [])}
    new: dict[tuple, dict[float, list[float]]] = {}
    for p in parts:
        for r in p.get("op_times", []):
            k = tuple(r[:3])
            if r[1] == mode and str(r[2]).startswith(prefix) and k not in rows:
                for x, t in r[3]:
                    new.setdefault(k, {}).setdefault(float(x), []).append(float(t))
    added = [[*k, [[x, statistics.mean(ts)] for x, ts in sorted(pts.items())]] for k, pts in sorted(new.items())]
    lines = [f"{r[0]} {r[1]} {r[2]}: new, {len(r[3])} points" for r in added]
    return {**base, "op_times": list(base.get("op_times", [])) + added}, lines


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("--base", required=True, help="the profile whose curves to extend")
    ap.add_argument("--part", action="append", required=True, help="a re-measurement (`offexec profile --base BASE`)")
    ap.add_argument("--mode", default="cpu", help="the rows' mode (default: cpu)")
    ap.add_argument("--prefix", default="attn_ctx:", help="the rows' part prefix (default: attn_ctx:)")
    ap.add_argument("--new-only", action="store_true",
                    help="instead of extending curves, add only the parts' rows (of --mode, --prefix) the base has "
                         "no row for: a new kind of row adopted without re-measuring the base's")
    ap.add_argument("--out", required=True, help="where to write the extended profile (a part for --merge)")
    args = ap.parse_args(argv)
    try:  # (a part may be gzipped, as committed evidence is)
        base = read_json_object(args.base, "profile")
        parts = [read_json_object(p, "profile part") for p in args.part]
    except OffsimError as exc:
        print(f"extend_rows: {exc}", file=sys.stderr)
        return 2
    out, lines = (add_new if args.new_only else extend)(base, parts, args.mode, args.prefix)
    if not lines:
        raise SystemExit(f"extend_rows: no {args.mode!r} row starting {args.prefix!r} in the parts "
                         + ("is missing from the base; nothing to add" if args.new_only
                            else "reaches past the base's last point; nothing to extend"))
    prov = dict(out.get("provenance", {}))
    prov["new_rows" if args.new_only else "extended_rows"] = provenance(base=args.base, parts=args.part,
                                                                         mode=args.mode, prefix=args.prefix, rows=lines)
    out["provenance"] = prov
    try:
        from offsim.core.specs import HardwareSpec

        HardwareSpec.from_dict(out)
    except (OffsimError, ValueError, TypeError) as exc:
        raise SystemExit(f"extend_rows: the extended profile does not load: {exc}")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
