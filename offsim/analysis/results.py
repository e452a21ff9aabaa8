"""Committed results, loaded and joined: results CSVs with their provenance line, measured traces, the JSON documents
``offexec run`` prints, and the long tables and error summaries notebooks plot (``offsim.analysis.validate`` holds
the measured cases themselves: finding, loading and re-simulating them)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import pandas as pd

from offsim.core.errors import OffsimError
from offsim.core.specs import GiB
from offsim.core.trace import TRACE_SCHEMA, Trace


def read_results_csv(path: str | Path) -> tuple[dict, pd.DataFrame]:
    """(provenance, table) of a results CSV whose first line is '# ' + JSON (``offsim.provenance.write_csv``)."""
    path = Path(path)
    try:
        with open(path) as f:
            head = f.readline()
            prov = json.loads(head[2:]) if head.startswith("# ") else {}
            if not head.startswith("# "):
                f.seek(0)
            df = pd.read_csv(f)
    except OSError as e:
        raise OffsimError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise OffsimError(f"{path}: the first line is not '# ' + provenance JSON ({e})") from None
    return prov, df


def results_dir(start: str | Path | None = None) -> Path:
    """The repository's ``results/`` folder: the first parent of ``start`` (default: the working directory, which
    is ``notebooks/`` when Jupyter runs a notebook) that holds ``pyproject.toml``."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file():
            return d / "results"
    raise OffsimError(f"no pyproject.toml above {here}: run from inside the offsim repository")


def inventory(root: str | Path, names: Sequence[str]) -> pd.DataFrame:
    """What each ``root/NAME`` folder holds: files by type (so a notebook can say what is not committed yet)."""
    rows = []
    for n in names:
        d = Path(root) / n
        files = sorted(p for p in d.rglob("*") if p.is_file()) if d.is_dir() else []
        rows.append({"folder": f"results/{n}", "present": d.is_dir(), "files": len(files),
                     "csv": sum(p.suffix == ".csv" for p in files), "json": sum(p.suffix == ".json" for p in files),
                     "png": sum(p.suffix == ".png" for p in files),
                     "readme": any(p.name.lower() == "readme.md" for p in files)})
    return pd.DataFrame(rows)


def _is_trace_csv(path: Path) -> bool:
    import gzip

    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            head = f.readline()
        return head.startswith("# ") and json.loads(head[2:]).get("schema") == TRACE_SCHEMA
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def find_traces(*dirs: str | Path) -> list[Path]:
    """Trace CSVs (offsim's trace schema; plain or gzipped) under ``dirs``, recursively, sorted."""
    out = []
    for d in dirs:
        d = Path(d)
        if d.is_dir():
            out += [p for p in sorted([*d.rglob("*.csv"), *d.rglob("*.csv.gz")]) if _is_trace_csv(p)]
    return out


def load_trace(path: str | Path) -> Trace:
    """``Trace.from_csv`` for a plain or a gzipped (``.csv.gz``) trace CSV."""
    path = Path(path)
    if path.suffix != ".gz":
        return Trace.from_csv(path)
    import gzip
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / path.stem  # x.csv.gz -> x.csv
        try:
            with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (OSError, EOFError) as e:
            raise OffsimError(f"cannot decompress trace {path}: {e}") from None
        return Trace.from_csv(plain)


def load_offexec_runs(*dirs: str | Path) -> pd.DataFrame:
    """One row per (run, phase) from the JSON documents ``offexec run`` prints last (saved as ``*.json``): model,
    policy, workload, measured and predicted tok/s and the relative error of the prediction."""
    rows = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*.json")):
            try:
                doc = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            # one run per document, a list of them, or an experiment's {"runs": [...]} (model etc. at the top)
            top = doc if isinstance(doc, dict) else {}
            docs = doc if isinstance(doc, list) else top.get("runs", [top]) if isinstance(top.get("runs"), list) \
                else [top]
            for r in docs:
                if not (isinstance(r, dict) and "measured" in r and "predicted" in r):
                    continue
                r = {**{k: top[k] for k in ("model", "provenance", "workload") if k in top}, **r}
                if "budget_bytes" not in r and "budget_gib" in top:
                    r["budget_bytes"] = top["budget_gib"] * GiB
                wl = r.get("workload", {})
                for phase in ("prefill", "decode", "total"):
                    k = f"{phase}_tok_s"
                    m, pr = r["measured"].get(k), r["predicted"].get(k)
                    if m is None or pr is None:
                        continue
                    rows.append({"file": str(p), "config": r.get("config", p.stem), "model": r.get("model"),
                                 "policy": r.get("policy"),
                                 "prompt_len": wl.get("prompt_len"), "gen_len": wl.get("gen_len"),
                                 "batch": (wl.get("gpu_batch_size") or 0) * (wl.get("num_gpu_batches") or 0),
                                 "budget_GiB": (r.get("budget_bytes") or 0) / GiB, "phase": phase,
                                 "measured_tok_s": m, "predicted_tok_s": pr,
                                 "error": (pr - m) / m if m else math.nan,
                                 "gpu": (r.get("provenance") or {}).get("gpu", "")})
    return pd.DataFrame(rows, columns=["file", "config", "model", "policy", "prompt_len", "gen_len", "batch",
                                       "budget_GiB", "phase", "measured_tok_s", "predicted_tok_s", "error", "gpu"])


def error_table(df: pd.DataFrame, by: Sequence[str] = ("policy", "phase")) -> pd.DataFrame:
    """Cases, median and worst absolute relative error of predicted vs measured throughput, grouped by ``by``."""
    if df.empty:
        return pd.DataFrame(columns=[*by, "cases", "median_abs_error", "max_abs_error", "mean_error"])
    d = df.assign(error=pd.to_numeric(df["error"], errors="coerce"))
    d["abs_error"] = d["error"].abs()
    return d.groupby(list(by)).agg(cases=("error", "size"), median_abs_error=("abs_error", "median"),
                                   max_abs_error=("abs_error", "max"), mean_error=("error", "mean")).reset_index()


def validation_long(df: pd.DataFrame) -> pd.DataFrame:
    """``offsim.analysis.validate.validate_dir``'s table (one row per case) in long form: one row per (case, phase) with
    measured_tok_s, predicted_tok_s and the signed relative error."""
    keys = [c for c in ("case", "model", "policy", "hardware", "gpu_mem_gb", "prompt_len", "batch") if c in df]
    parts = []
    for phase in ("prefill", "decode", "total"):
        m, pr = f"measured_{phase}_tok_s", f"predicted_{phase}_tok_s"
        if m in df and pr in df:
            part = df[keys].copy()
            part["phase"], part["measured_tok_s"], part["predicted_tok_s"] = phase, df[m], df[pr]
            part["error"] = (df[pr] - df[m]) / df[m]
            parts.append(part)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=[*keys, "phase", "measured_tok_s", "predicted_tok_s", "error"])


def op_kind_errors(measured: Trace, predicted: Trace) -> pd.DataFrame:
    """Per op kind: ops, total and mean seconds measured and predicted, and the mean absolute percentage error of
    the per-op durations (ops matched by id: both traces come from the same plan)."""
    m = measured.df.set_index("op_id")
    p = predicted.df.set_index("op_id").reindex(m.index)
    dm, dp = m["end_s"] - m["start_s"], p["end_s"] - p["start_s"]
    d = pd.DataFrame({"kind": m["kind"], "measured_s": dm, "predicted_s": dp})
    d["ape"] = (d["predicted_s"] - d["measured_s"]).abs() / d["measured_s"].where(d["measured_s"] > 0)
    g = d.groupby("kind").agg(ops=("measured_s", "size"), measured_total_s=("measured_s", "sum"),
                              predicted_total_s=("predicted_s", "sum"), mape=("ape", "mean")).reset_index()
    g["total_error"] = (g["predicted_total_s"] - g["measured_total_s"]) / g["measured_total_s"]
    return g
