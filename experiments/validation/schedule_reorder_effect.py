"""The FlexGen schedule's hidden-state load moved ahead of the prefetches (commit 5856a73): what that did on the
H200, per re-measured validation case -- the case as measured before (read from git at ``--before``) and after
(the working tree), with offsim's predictions of both plans.

    python -m experiments.validation.schedule_reorder_effect --before b916834 --out results/validation/schedule_reorder.csv
"""
from __future__ import annotations

import argparse
import json
import io
import subprocess

from experiments.common import ROOT, provenance, write_csv
from offsim.analysis import validate as V

CASES = ("llama-3-8b_flexgen_p512_g16", "opt-13b_flexgen_p2048_g24", "opt-13b_flexgen_p512_g16",
         "opt-6.7b_flexgen_p2048_g8", "opt-6.7b_flexgen_p512_g8")


def main() -> None:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision holding the cases measured with the old order")
    ap.add_argument("--profile", default=str(ROOT / "results" / "profiles" / "h200_offexec.json"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for c in CASES:
        rel = f"results/validation/h200/{c}.case.json"
        old = json.loads(subprocess.run(["git", "show", f"{a.before}:{rel}"], cwd=ROOT, check=True,
                                        capture_output=True, text=True).stdout)
        new = V.load_case(ROOT / rel)
        new_r = V.validate_case(new, a.profile)  # re-simulates the stored plan: the one that ran
        row = {"case": c}
        for ph in ("prefill", "decode", "total"):
            row[f"measured_{ph}_before"] = old["metrics"][f"{ph}_tok_s"]
            row[f"measured_{ph}_after"] = new["metrics"][f"{ph}_tok_s"]
            row[f"predicted_{ph}_after"] = new_r[f"predicted_{ph}_tok_s"]
        row["measured_decode_change"] = row["measured_decode_after"] / row["measured_decode_before"] - 1
        rows.append(row)
    # the old plans are not rebuilt by today's code: their predictions come from the report committed with them
    base = subprocess.run(["git", "show", f"{a.before}:results/validation/h200_report/validation.csv"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
    b = pd.read_csv(io.StringIO(base), comment="#").set_index("case")
    df = pd.DataFrame(rows)
    for ph in ("prefill", "decode", "total"):
        df[f"predicted_{ph}_before"] = [b.loc[c, f"predicted_{ph}_tok_s"] for c in df["case"]]
    df["predicted_decode_change"] = df["predicted_decode_after"] / df["predicted_decode_before"] - 1
    write_csv(df, a.out, provenance(before=a.before, profile=a.profile))
    print(df[["case", "measured_decode_before", "measured_decode_after", "measured_decode_change",
              "predicted_decode_before", "predicted_decode_after", "predicted_decode_change"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
