"""experiments.validation.warmup_modes: the step-1 excess and the tables come from the case files (issue 13)."""
import shutil
from pathlib import Path

import pytest

from experiments.validation import warmup_modes as W

DATA = Path(__file__).resolve().parents[1] / "results" / "validation" / "warmup_modes_93bb5dd"
CASE = "opt-6.7b_static-accelerate_b32_p1024_g16"


def test_step1_excess_is_first_decode_step_less_median_of_later():
    assert W._step1_excess_s([5.0, 0.030, 0.010, 0.012, 0.011]) == pytest.approx(0.019)


@pytest.mark.skipif(not (DATA / "full").is_dir(), reason="committed warm-up evidence not present")
def test_readme_and_csv_from_the_case_files(tmp_path):
    for mode in ("short", "full"):  # one case, two modes: a small copy of the committed evidence
        dest = tmp_path / mode / "h200_calib"
        dest.mkdir(parents=True)
        for suffix in (".case.json", ".plan.json.gz"):
            shutil.copy(DATA / mode / "h200_calib" / f"{CASE}{suffix}", dest)
    assert W.main([str(tmp_path)]) == 0
    df = W.rows(tmp_path)
    assert sorted(df["mode"]) == ["full", "short"]
    short = df.set_index("mode").loc["short"]
    assert short["step1_excess_ms"] > 0 and short["run1_total_tok_s"] > 0
    text = (tmp_path / "README.md").read_text()
    assert f"| {CASE} | {short['step1_excess_ms']:.1f} |  | " in text  # same-length missing: an empty cell
    assert (tmp_path / "warmup_modes.csv").read_text().count("\n") == 3


def test_empty_folder_is_refused_with_what_it_expects(tmp_path):
    with pytest.raises(SystemExit, match="MODE/\\*/TAG.case.json"):
        W.rows(tmp_path)
