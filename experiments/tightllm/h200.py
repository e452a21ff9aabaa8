"""TightLLM's components measured on the H200 (offexec), beside what offsim predicts for the same plans.

For each scenario (a TightLLM configuration that offsim's search chose for the validation matrix), five plans run on
the GPU: TightLLM, TightLLM without the KV distributor (N_r = 0), without the weight loader, without both, and
FlexGen's schedule on the same placement and block. The question is whether the simulated ablation deltas -- the
basis of results/tightllm/README.md §4 -- hold on hardware.

    python -m experiments.tightllm.h200 config                      # -> experiments/tightllm/h200_config.json
    python -m experiments.validation.matrix --config experiments/tightllm/h200_config.json --warmup \\
        --profile results/profiles/h200.json --out results/tightllm/h200      # on the H200
    python -m experiments.tightllm.h200 report results/tightllm/h200  # -> ablation.csv, ablation.png there

The report re-simulates each case's stored plan (the exact plan that ran) with the calibrated profile
``results/profiles/h200_offexec.json``, like ``offsim validate``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.common import ROOT, finish, provenance, write_csv

SCENARIOS = ("opt-13b_tightllm_p2048_g24", "opt-6.7b_tightllm_p2048_g8", "opt-30b_tightllm_p512_g16")  # tags in experiments/validation/matrix_config.json
VARIANTS = {  # name -> (policy, settings overrides)
    "tightllm": ("tightllm", {}),
    "no-kv-distributor": ("tightllm", {"kv_distributor": False}),
    "no-weight-loader": ("tightllm", {"weight_loader": False}),
    "neither": ("tightllm", {"kv_distributor": False, "weight_loader": False}),
    "flexgen-same-placement": ("flexgen", {"cpu_attention": False}),
}


def make_config(out: Path) -> None:
    base = {c["tag"]: c for c in json.loads((ROOT / "experiments" / "validation" / "matrix_config.json").read_text())}
    cases = []
    for tag in SCENARIOS:
        c = base[tag]
        for name, (policy, extra) in VARIANTS.items():
            settings = {"percent": c["settings"]["percent"], **extra}
            cases.append({**c, "tag": tag.replace("_tightllm_", f"_{name}_"), "policy": policy, "settings": settings,
                          "scenario": tag, "variant": name})
    out.write_text(json.dumps(cases, indent=1))
    finish({"cases": len(cases), "config": str(out)})


def report(case_dir: Path, profile: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from offsim.analysis import validate as V

    df = V.validate_dir(case_dir, hardware=profile)
    df["variant"] = [next(v for v in VARIANTS if f"_{v}_" in c) for c in df["case"]]
    df["scenario"] = [c.replace(f"_{v}_", "_tightllm_") for c, v in zip(df["case"], df["variant"])]
    rows = []
    for scen, g in df.groupby("scenario"):
        ref = g.set_index("variant").loc["tightllm"]
        for _, r in g.iterrows():
            row = {"scenario": scen, "variant": r["variant"], "plan": r["plan"]}
            for ph in ("decode", "total"):
                m, p = r[f"measured_{ph}_tok_s"], r[f"predicted_{ph}_tok_s"]
                row[f"measured_{ph}_tok_s"], row[f"predicted_{ph}_tok_s"] = m, p
                # change of this variant against TightLLM: the ablation deltas of README §4
                row[f"measured_{ph}_vs_tightllm"] = m / ref[f"measured_{ph}_tok_s"] - 1
                row[f"predicted_{ph}_vs_tightllm"] = p / ref[f"predicted_{ph}_tok_s"] - 1
            rows.append(row)
    out = pd.DataFrame(rows)
    write_csv(out, case_dir / "ablation.csv", provenance(cases=str(case_dir), profile=profile))
    print(out.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    fig, axes = plt.subplots(1, len(out["scenario"].unique()), figsize=(6 * out["scenario"].nunique(), 4),
                             squeeze=False)
    for ax, (scen, g) in zip(axes[0], out.groupby("scenario")):
        x = range(len(g))
        ax.bar([i - 0.2 for i in x], g["measured_decode_vs_tightllm"] * 100, 0.4, label="measured (H200)")
        ax.bar([i + 0.2 for i in x], g["predicted_decode_vs_tightllm"] * 100, 0.4, label="offsim")
        ax.set_xticks(list(x), g["variant"], rotation=20, fontsize=8)
        ax.axhline(0, color="k", lw=0.6)
        ax.set(title=scen, ylabel="decode tok/s vs TightLLM (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(case_dir / "ablation.png", dpi=120)
    print(f"wrote {case_dir / 'ablation.csv'} and ablation.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="write the GPU run's config")
    c.add_argument("--out", default=str(ROOT / "experiments" / "tightllm" / "h200_config.json"))
    r = sub.add_parser("report", help="measured vs predicted ablation deltas from the measured cases")
    r.add_argument("dir")
    r.add_argument("--profile", default=str(ROOT / "results" / "profiles" / "h200_offexec.json"))
    a = ap.parse_args()
    if a.cmd == "config":
        make_config(Path(a.out))
    else:
        report(Path(a.dir), a.profile)


if __name__ == "__main__":
    main()
