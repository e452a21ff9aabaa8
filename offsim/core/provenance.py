"""Provenance for results: what code, which machine, when, by which command -- written beside every number."""
from __future__ import annotations

import datetime as _dt
import platform
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd


def git_commit(short: bool = True) -> str:
    """The checkout's commit (with '+dirty' when the tree has uncommitted changes), or 'unknown'."""
    here = Path(__file__).resolve().parent
    if os.environ.get("OFFSIM_COMMIT"):  # a copy made from a commit elsewhere (a device run): that commit
        return os.environ["OFFSIM_COMMIT"]
    try:
        args = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
        c = subprocess.run(args, cwd=here, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (c or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(**extra) -> dict:
    """commit, UTC date, machine, python and the command line, plus ``extra``."""
    return {"commit": git_commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
            "python": platform.python_version(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            **extra}


def write_csv(df: pd.DataFrame, path: str | Path, prov: dict) -> None:
    """CSV whose first line is '# ' + the provenance JSON (pandas reads it back with comment='#')."""
    from offsim.core.io import write_commented_csv

    write_commented_csv(path, prov, df)
