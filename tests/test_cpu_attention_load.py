"""results/profiles/cpu_attention_load/: its README's table is what experiments.validation.cpu_attention_load computes
from the raw profile parts beside it (prose from data), and the finding it states holds on them."""
import shutil
import statistics
from pathlib import Path

from experiments.validation import cpu_attention_load as C

ROOT = Path(__file__).resolve().parents[1] / "results" / "profiles" / "cpu_attention_load"


def _table(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("| ")]


def test_readme_table_is_generated_from_the_committed_parts(tmp_path, monkeypatch):
    work = tmp_path / "cpu_attention_load"
    shutil.copytree(ROOT, work)
    monkeypatch.chdir(ROOT.parents[2])  # the profile the comparison reads is named relative to the repository
    text = C.write(work)
    assert _table(text) == _table((ROOT / "README.md").read_text())


def test_offexec_path_under_load_within_the_hosts_drift(monkeypatch):
    """The README's claim: on offexec's own path the loaded / unloaded median is near 1, and the unloaded rows'
    drift against the profile's spans at least as wide a range as the load's effect."""
    monkeypatch.chdir(ROOT.parents[2])
    recs = [r for r in C.collect(ROOT) if r["mode"].startswith("blocking") and r["path"] == "offexec"]
    assert len({r["model"] for r in recs}) == 5
    load = [r["loaded_ms"] / r["unloaded_ms"] for r in recs]
    drift = [r["unloaded_ms"] / r["profile_ms"] for r in recs if r["profile_ms"]]
    assert 0.9 < statistics.median(load) < 1.1
    assert max(drift) - min(drift) >= 0.9 * (max(load) - min(load))
