"""results/profiles/clock_held_55c9fa9/: its README's table is what experiments.validation.clock_curve computes from
the profile part beside it (prose from data), and the finding behind the cost model's one sustained fraction holds
on it: the clock settles early and then stays near the profile's fraction."""
import json
import shutil
from pathlib import Path

from experiments.validation import clock_curve as C

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "results" / "profiles" / "clock_held_55c9fa9"


def _table(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("| ")]


def test_readme_table_is_generated_from_the_committed_part(tmp_path, monkeypatch):
    work = tmp_path / "clock"
    shutil.copytree(ROOT, work)
    monkeypatch.chdir(REPO)  # the profile and prefill_layers.csv are named relative to the repository
    text = C.write(work)
    assert _table(text) == _table((ROOT / "README.md").read_text())
    assert (work / "clock_curve.png").stat().st_size > 0


def test_clock_settles_near_the_profiles_sustained_fraction():
    rows = C.summary(C.collect(ROOT))
    assert len(rows) == 5  # the five matrix models' FFN shapes
    prof = json.loads((REPO / C.PROFILE).read_text())["sustained_compute_fraction"]
    for r in rows:
        assert r["first_window"] > r["settled_median"]  # the burst is faster: the clock does fall
        assert abs(r["median_4_6s"] / r["median_0p5_2s"] - 1) < 0.03  # ...once, not on and on
        assert abs(r["settled_median"] / prof - 1) < 0.03


def test_no_part_is_a_clear_error(tmp_path):
    import pytest
    with pytest.raises(SystemExit, match="no profile part"):
        C.collect(tmp_path)
