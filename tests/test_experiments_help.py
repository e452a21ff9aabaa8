"""Every experiment script answers ``--help`` with its usage and exit 0, and writes nothing: a report writer that
ignored the flag rewrote its README, a GPU script started its run (found 2026-12-05). Runs each module in a
subprocess (four at a time) and compares the repository's files before and after."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("results", "experiments", "docs", "README.md")


def _modules() -> list[str]:
    out = []
    for p in sorted((ROOT / "experiments").rglob("*.py")):
        if '__name__ == "__main__"' in p.read_text():
            out.append(".".join(p.relative_to(ROOT).with_suffix("").parts))
    return out


def _snapshot() -> dict[str, tuple[int, int]]:
    files = {}
    for name in WATCHED:
        base = ROOT / name
        for p in ([base] if base.is_file() else base.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                st = p.stat()
                files[str(p.relative_to(ROOT))] = (st.st_size, st.st_mtime_ns)
    return files


def test_every_experiment_answers_help_and_writes_nothing():
    mods = _modules()
    assert len(mods) > 40
    before = _snapshot()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}

    def run(mod):
        r = subprocess.run([sys.executable, "-m", mod, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
        return mod, r.returncode, r.stdout + r.stderr

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, mods))
    bad = [f"{m}: exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}" for m, rc, out in results
           if rc != 0 or "usage" not in out.lower()]
    assert not bad, "\n".join(bad)
    after = _snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"--help changed files: {changed[:10]}"
