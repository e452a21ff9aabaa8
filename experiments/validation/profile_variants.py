"""Compare profile variants on one validation split before adopting any (docs/cost-model.md: a profile change is
re-validated on the calibration split first; the held-out split is reported, never used to choose).

Each variant is the base profile with what one or more ``offexec profile --base BASE ... --out PART`` files measured
merged in (``offexec.profile.merge_profiles``, as ``offexec profile --merge`` does); every case of the split is
re-simulated on the base and on each variant, and the split's figures are tabulated side by side, with the cases
whose total error moved most.

    python -m experiments.validation.profile_variants --base results/profiles/h200_offexec_v2.json \\
        --variant decode_graph=decode_attn.json --variant layer_clock=sus_layer.json \\
        [--variant both=decode_attn.json,sus_layer.json] [--split calib] --out DIR

Writes DIR/compare.md (the tables), DIR/validation_<name>.csv (each variant's per-case report, as ``offsim
validate`` writes it) and DIR/<name>.json (each merged profile, to adopt as it is).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from offexec.profile import merge_profiles
from offsim.analysis import validate as V
from offsim.core.errors import OffsimError
from offsim.core.io import read_json_object, write_text_atomic
from offsim.core.provenance import provenance

ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("calib", "heldout")


def variant_arg(text: str) -> tuple[str, list[str]]:
    """NAME=PART[,PART...] -> (name, [part paths]); argparse's clear error otherwise."""
    name, sep, parts = text.partition("=")
    files = [p for p in parts.split(",") if p]
    if not sep or not name or not files or name == "base":
        raise argparse.ArgumentTypeError(f"a variant is NAME=PART[,PART...] (NAME not 'base'), got {text!r}")
    return name, files


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--base", required=True, help="the profile the parts were measured from")
    ap.add_argument("--variant", type=variant_arg, action="append", required=True, metavar="NAME=PART[,PART...]")
    ap.add_argument("--split", default="calib", choices=SPLITS)
    ap.add_argument("--cases", default=None, help="a folder of cases instead of results/validation/h200_SPLIT")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        base = read_json_object(args.base, "hardware profile")
        variants = {name: merge_profiles(base, [(f, read_json_object(f, "hardware profile")) for f in files])
                    for name, files in args.variant}
    except OffsimError as e:
        ap.exit(2, f"profile_variants: {e}\n")
    cases = Path(args.cases or ROOT / "results" / "validation" / f"h200_{args.split}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = {"base": Path(args.base)}
    for name, d in variants.items():
        profiles[name] = out / f"{name}.json"
        write_text_atomic(profiles[name], json.dumps(d, indent=1))
    reports = {name: V.validate_dir(cases, hardware=str(p), progress=True) for name, p in profiles.items()}
    prov = provenance(base=args.base, variants={n: f for n, f in args.variant}, cases=str(cases))
    for name, df in reports.items():
        write_text_atomic(out / f"validation_{name}.csv", f"# {json.dumps(prov)}\n" + df.to_csv(index=False))
    lines = [f"# Profile variants on `{cases.name}`", "",
             f"Written by `python -m experiments.validation.profile_variants` ({prov['commit']}, {prov['date'][:10]}); "
             f"base `{args.base}`; variants: " + "; ".join(f"`{n}` = base + {', '.join(f)}" for n, f in args.variant)
             + ". Error = (predicted - measured) / measured, absolute values.", "",
             "| profile | cases | median total | max total | within 10 % | median prefill | median decode | "
             "median step-latency MAPE |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, df in reports.items():
        m = V.split_summary(df)
        lines.append(f"| {name} | {m['cases']} | {_pct(m['median'])} | {_pct(m['max'])} | {m['within']} | "
                     f"{_pct(m['prefill'])} | {_pct(m['decode'])} | {_pct(m['step'])} |")
    b = reports["base"].set_index("case")["err_total_tok_s"]
    for name in variants:
        v = reports[name].set_index("case")["err_total_tok_s"]
        moved = (v.abs() - b.abs()).sort_values()
        lines += ["", f"`{name}`: the cases whose |total error| moved most (negative: closer to measured)", "",
                  "| case | base | variant | change of abs |", "| --- | --- | --- | --- |"]
        for c in list(moved.index[:5]) + list(moved.index[-5:][::-1]):
            lines.append(f"| {c} | {b[c]:+.1%} | {v[c]:+.1%} | {moved[c]:+.1%} |")
    write_text_atomic(out / "compare.md", "\n".join(lines) + "\n")
    print("\n".join(lines[:6 + len(reports)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
