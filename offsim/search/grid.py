"""Design-space sweeps (``offsim sweep SPEC``; docs/sweeps.md): a grid of points -- model x hardware x GPU budget x
prompt/gen length x policy, each with fixed settings, a fixed batch, or "its best" -- evaluated in parallel on Ray,
resumable, one table out.

- ``load_spec`` reads a YAML or JSON spec (schema ``offsim.sweep/1``) and checks it: every model, hardware and
  policy is resolved and every settings dict is parsed before any point runs, so a typo is one line and exit 2,
  not 2,000 failed points.
- ``expand`` lists the points in a fixed order, each with a ``point_id``: a hash of what defines its answer (its
  axis values, settings and search options), so that a rerun, or a larger grid that contains it, finds it done.
- ``evaluate_point`` answers one point, never raising: ``ok`` with the metrics; ``failed`` with offsim's one-line
  reason when the point has no answer (it does not fit, or the policy refuses it); ``error`` with the exception
  when evaluating it broke (a bug, a worker that died). ``ok`` and ``failed`` are final; ``error`` points run again
  on the next run.
- ``run_sweep`` runs the points not yet done as Ray tasks (a local Ray runtime by default, all cores; a cluster
  with ``address``), appends each answer to the journal ``points.jsonl`` as it arrives (flushed, so an interrupt
  or a kill loses only the points in flight), and writes the table ``sweep.csv`` (always: the repository's
  commented CSV, provenance on its first line) and ``sweep.parquet`` (when pyarrow is installed, the same
  provenance in the file's metadata), and ``sweep.json`` (the spec and one record per run: provenance, workers,
  counts, wall time).

Modes, from the axes the grid gives: ``gpu_batch_size`` (and ``num_gpu_batches``, ``settings``): a fixed plan,
built and simulated (``offsim simulate``); ``batch``: the policy's best candidate at that many sequences per block
(``offsim.search.sweep.policy_at_batch``); neither: the policy's best settings and block shape (``offsim search``).
"""
from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import json
import logging
import math
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from offsim.core import provenance as prov
from offsim.core.errors import OffsimError
from offsim.core.io import finite_json, read_json_object, read_spec, write_commented_csv, write_text_atomic
from offsim.core.latency import latency_and_bottleneck
from offsim.core.specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from offsim.policies import POLICIES, get_policy

SCHEMA = "offsim.sweep/1"
GiB = 1 << 30
# grid axes, in the order points are listed and columns written
AXES = ("model", "hardware", "gpu_mem_gb", "prompt_len", "gen_len", "policy", "batch", "gpu_batch_size",
        "num_gpu_batches")
REQUIRED_AXES = ("model", "hardware", "policy", "prompt_len", "gen_len")
SPEC_KEYS = ("schema", "name", "grid", "settings", "max_sims", "max_batch")
STATUSES = ("ok", "failed", "error")
FINAL = ("ok", "failed")  # answered; 'error' points run again
METRICS = ("prefill_s", "decode_s", "total_s", "prefill_tok_s", "decode_tok_s", "total_tok_s", "ttft_s",
           "decode_ms_per_token", "bottleneck_stream", "bottleneck_busy_frac", "gpu_idle_frac", "peak_gpu_bytes",
           "peak_cpu_bytes", "peak_disk_bytes")
COLUMNS = ("point_id", *AXES, "settings", "status", "reason", "gpu_mem_gib", "block_gpu_batch_size",
           "block_num_gpu_batches", "prompts", *METRICS, "wall_s", "worker", "commit")
JOURNAL, TABLE_CSV, TABLE_PARQUET, RUNS = "points.jsonl", "sweep.csv", "sweep.parquet", "sweep.json"


# ----------------------------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepSpec:
    """A checked sweep spec. ``grid`` maps each axis to its values (lists); ``settings`` maps a policy to the
    settings dicts to try with it (fixed-plan mode only); ``max_sims``/``max_batch`` are the search's options."""

    name: str
    grid: dict[str, list]
    settings: dict[str, list[dict]] = field(default_factory=dict)
    max_sims: int = 3
    max_batch: int | None = None

    @property
    def mode(self) -> str:
        """'settings' (a fixed plan per point), 'batch' (best at a batch) or 'search' (best of all)."""
        return "settings" if "gpu_batch_size" in self.grid else "batch" if "batch" in self.grid else "search"

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "name": self.name, "grid": self.grid, "settings": self.settings,
                "max_sims": self.max_sims, "max_batch": self.max_batch}


def load_spec(path: str | Path) -> SweepSpec:
    """The spec in ``path`` (.yaml/.yml: YAML, else JSON), checked (``parse_spec``)."""
    return parse_spec(read_spec(path, "sweep spec"), where=f"sweep spec {path}")


def check_spec_keys(d: Any, where: str, keys: tuple[str, ...], schema: str, needs: str) -> None:
    """A spec is a mapping (with ``needs``, for the message) of known ``keys`` whose schema, if given, is
    ``schema`` (``offsim sweep``, ``offsim job``)."""
    if not isinstance(d, dict):
        raise OffsimError(f"{where}: expected a mapping with {needs}")
    unknown = set(d) - set(keys)
    if unknown:
        raise OffsimError(f"{where}: unknown keys {sorted(unknown)}; valid: {list(keys)}")
    if d.get("schema", schema) != schema:
        raise OffsimError(f"{where}: schema is {d['schema']!r}; this offsim reads {schema!r}")


def check_gpu_mem_gb(where: str, key: str, v: Any) -> None:
    """A GPU budget in a spec: GiB > 0, or null for the hardware's own."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
        raise OffsimError(f"{where}: {key} takes a finite GiB > 0 or null (the hardware's own), got {v!r}")


def _positive_ints(where: str, axis: str, values: list) -> list[int]:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise OffsimError(f"{where}: grid.{axis} takes positive integers, got {v!r}")
    return values


def parse_spec(d: Any, where: str = "sweep spec") -> SweepSpec:
    """Check a spec dict: known keys, every axis a non-empty list of valid values, models, hardware and policies
    that resolve (a model config or hardware profile path is read relative to the current directory, as the other
    commands read it), settings each policy accepts. Every problem is an OffsimError naming the key."""
    check_spec_keys(d, where, SPEC_KEYS, SCHEMA, "a 'grid'")
    grid_in = d.get("grid")
    if not isinstance(grid_in, dict):
        raise OffsimError(f"{where}: 'grid' must be a mapping of axis -> list of values (axes: {list(AXES)})")
    bad = set(grid_in) - set(AXES)
    if bad:
        raise OffsimError(f"{where}: unknown grid axes {sorted(bad)}; valid: {list(AXES)}")
    missing = [a for a in REQUIRED_AXES if a not in grid_in]
    if missing:
        raise OffsimError(f"{where}: grid needs {missing} (every point has a model, hardware, policy and lengths)")
    grid: dict[str, list] = {}
    for axis in AXES:
        if axis not in grid_in:
            continue
        v = grid_in[axis]
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        if not v:
            raise OffsimError(f"{where}: grid.{axis} is empty")
        if axis == "gpu_mem_gb":  # 8 and 8.0 are one budget: one point, one point_id
            for x in v:
                check_gpu_mem_gb(where, "grid.gpu_mem_gb", x)
            v = [None if x is None else float(x) for x in v]
        if len(set(map(json.dumps, v))) != len(v):
            raise OffsimError(f"{where}: grid.{axis} lists a value twice")
        grid[axis] = v
    for axis in ("prompt_len", "gen_len", "batch", "gpu_batch_size", "num_gpu_batches"):
        if axis in grid:
            _positive_ints(where, axis, grid[axis])
    if "batch" in grid and "gpu_batch_size" in grid:
        raise OffsimError(f"{where}: give either grid.batch (each policy's best at that batch) or "
                          "grid.gpu_batch_size (a fixed plan), not both")
    if "num_gpu_batches" in grid and "gpu_batch_size" not in grid:
        raise OffsimError(f"{where}: grid.num_gpu_batches needs grid.gpu_batch_size (a fixed plan)")
    for p in grid["policy"]:
        if not isinstance(p, str) or p not in POLICIES:
            raise OffsimError(f"{where}: unknown policy {p!r}; valid: {', '.join(POLICIES)}")
    for axis in ("model", "hardware"):
        for v in grid[axis]:
            if not isinstance(v, str):
                raise OffsimError(f"{where}: grid.{axis} takes names or file paths, got {v!r}")
    settings_in = d.get("settings") or {}
    if not isinstance(settings_in, dict):
        raise OffsimError(f"{where}: 'settings' must map a policy to a list of settings mappings")
    if settings_in and "gpu_batch_size" not in grid:
        raise OffsimError(f"{where}: 'settings' fixes a plan, which also needs grid.gpu_batch_size (without it each "
                          "point searches the policy's own settings)")
    settings: dict[str, list[dict]] = {}
    for pol, lst in settings_in.items():
        if pol not in grid["policy"]:
            raise OffsimError(f"{where}: settings for {pol!r}, which is not in grid.policy {grid['policy']}")
        lst = lst if isinstance(lst, list) else [lst]
        for st in lst:
            if not isinstance(st, dict):
                raise OffsimError(f"{where}: settings.{pol} entries must be mappings, got {st!r}")
            try:
                get_policy(pol).settings_from(st)
            except (TypeError, ValueError) as e:
                raise OffsimError(f"{where}: settings.{pol} {st}: {e}") from None
            except OffsimError as e:
                raise OffsimError(f"{where}: settings.{pol}: {e}") from None
        settings[pol] = [json.loads(json.dumps(st)) for st in lst]
    max_sims = d.get("max_sims", 3)
    if isinstance(max_sims, bool) or not isinstance(max_sims, int) or max_sims <= 0:
        raise OffsimError(f"{where}: max_sims must be a positive integer, got {max_sims!r}")
    max_batch = d.get("max_batch")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch <= 0):
        raise OffsimError(f"{where}: max_batch must be a positive integer or null, got {max_batch!r}")
    name = d.get("name") or "sweep"
    if not isinstance(name, (str, int)) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(name)):
        raise OffsimError(f"{where}: name {name!r} names the default output folder (sweep-NAME): use letters, digits, "
                          "'.', '_' and '-', starting with a letter or digit")
    spec = SweepSpec(name=str(name), grid=grid, settings=settings, max_sims=max_sims, max_batch=max_batch)
    resolve(spec)  # every model and hardware (at every budget) loads, or one line says which does not
    return spec


def resolve(spec: SweepSpec) -> tuple[dict[str, ModelSpec], dict[tuple, HardwareSpec]]:
    """Every model by name and every (hardware, gpu_mem_gb) of the grid, loaded once (errors name the value)."""
    models = {m: get_model(m) for m in spec.grid["model"]}
    hws = {(h, g): get_hardware(h, g) for h in spec.grid["hardware"] for g in spec.grid.get("gpu_mem_gb", [None])}
    return models, hws


# ----------------------------------------------------------------------------------------------------------------
# points
# ----------------------------------------------------------------------------------------------------------------
def _content_sha(spec: ModelSpec | HardwareSpec) -> str:
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def expand(spec: SweepSpec) -> list[dict]:
    """Every point of the grid, in a fixed order (axes in ``AXES`` order, values as listed), each a dict of its
    axis values plus 'settings' (fixed-plan mode: the settings dict; else None), 'mode', 'max_sims', 'max_batch'
    and its 'point_id'. A point's id covers what its model and hardware resolve to (the contents of a config or
    profile file, not its name), so an edited file, or one path read from another folder, is a new point."""
    models, hws = resolve(spec)
    model_sha = {m: _content_sha(v) for m, v in models.items()}
    hw_sha = {k: _content_sha(v) for k, v in hws.items()}
    axes = [a for a in AXES if a in spec.grid]
    mode = spec.mode
    out = []
    for values in itertools.product(*(spec.grid[a] for a in axes)):
        base = dict(zip(axes, values))
        base.setdefault("gpu_mem_gb", None)
        if mode == "settings":
            base.setdefault("num_gpu_batches", 1)
            variants = spec.settings.get(base["policy"], [{}])
        else:
            variants = [None]
        for st in variants:
            p = {**base, "settings": st, "mode": mode,
                 "max_sims": spec.max_sims if mode == "search" else None,
                 "max_batch": spec.max_batch if mode == "search" else None}
            p["point_id"] = point_id(p, model_sha[p["model"]], hw_sha[(p["hardware"], p["gpu_mem_gb"])])
            out.append(p)
    return out


def point_id(point: dict, model_sha: str, hardware_sha: str) -> str:
    """16 hex digits of SHA-256 over what defines a point's answer: its values, settings, mode, search options, and
    the contents of its model and hardware (``model_sha``, ``hardware_sha``: hashes of their resolved specs)."""
    key = {k: point.get(k) for k in (*AXES, "settings", "mode", "max_sims", "max_batch")}
    key.update(model_spec=model_sha, hardware_spec=hardware_sha)
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _commit() -> str:
    return prov.git_commit()


def evaluate_point(point: dict, model: ModelSpec, hw: HardwareSpec) -> dict:
    """One row of the table for ``point`` (see the module docstring for the statuses). Never raises for a point's
    own trouble: an OffsimError is the point's answer ('failed', with its reason); any other exception is recorded
    as 'error' with its type and message, and the sweep goes on."""
    from offsim.core.sim import simulate
    from offsim.policies import build_plan
    from offsim.search.search import search
    from offsim.search.sweep import policy_at_batch

    t0 = time.perf_counter()
    row: dict[str, Any] = {"point_id": point["point_id"], **{a: point.get(a) for a in AXES},
                           "settings": json.dumps(point["settings"]) if point.get("settings") is not None else None,
                           "gpu_mem_gib": hw.gpu_mem_bytes / GiB}
    pol, s, g = point["policy"], point["prompt_len"], point["gen_len"]
    try:
        if point["mode"] == "search":
            res = search(pol, model, hw, s, g, max_sims=point["max_sims"], max_batch=point["max_batch"])
            settings, wl, m = res.settings, res.workload, res.metrics
        elif point["mode"] == "batch":
            settings, wl, trace = policy_at_batch(pol, model, hw, s, g, point["batch"])
            m = trace.metrics()
        else:
            wl = Workload(s, g, point["gpu_batch_size"], point["num_gpu_batches"])
            plan = build_plan(pol, model, hw, wl, point["settings"])
            settings = plan.settings  # as the plan ran them: the policy's choices for what the spec left out
            m = simulate(plan, hw).metrics()
        row.update({"settings": json.dumps(settings, default=list), "status": "ok", "reason": "",
                    "block_gpu_batch_size": wl.gpu_batch_size, "block_num_gpu_batches": wl.num_gpu_batches,
                    "prompts": wl.num_prompts})
        m = {**m, **latency_and_bottleneck(m)}
        row.update({k: m.get(k) for k in METRICS})
    except OffsimError as e:
        row.update({"status": "failed", "reason": _one_line(str(e))})
    except Exception as e:  # a bug: recorded with the point, retried on the next run, the sweep goes on
        row.update({"status": "error", "reason": _one_line(f"{type(e).__name__}: {e}")})
    row.update({"wall_s": time.perf_counter() - t0, "worker": f"{socket.gethostname()}:{os.getpid()}",
                "commit": _commit()})
    return row


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _one_line(s: str) -> str:
    return " ".join(s.split())


# ---- on a Ray worker -------------------------------------------------------------------------------------------
_WORKER_READY = False


def _prepare_worker() -> None:
    """Once per worker process: import what every point needs, then move everything alive so far (modules,
    presets) out of the cyclic collector's sight (``gc.freeze``). A large plan keeps ~10^6 objects alive for a
    moment, and each full collection pass would otherwise also walk every module object of numpy, pandas, scipy and
    cvxpy; in a worker process nothing frozen here is ever garbage."""
    global _WORKER_READY
    if not _WORKER_READY:
        import offsim.core.sim  # noqa: F401
        import offsim.search.search  # noqa: F401
        import offsim.search.sweep  # noqa: F401

        gc.collect()
        gc.freeze()
        _WORKER_READY = True


def _evaluate_task(point: dict, model: ModelSpec, hw: HardwareSpec) -> dict:
    _prepare_worker()
    return evaluate_point(point, model, hw)


# ----------------------------------------------------------------------------------------------------------------
# the journal and the table
# ----------------------------------------------------------------------------------------------------------------
def read_journal(path: Path) -> tuple[dict[str, dict], int]:
    """Rows of the journal by point id (a later row of a point replaces an earlier one) and the number of lines
    that were not JSON (a line cut short when a run was killed mid-write is skipped, and its point runs again)."""
    rows: dict[str, dict] = {}
    bad = 0
    if not path.exists():
        return rows, 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(r, dict) and r.get("point_id") and r.get("status") in STATUSES:
                rows[r["point_id"]] = r
            else:
                bad += 1
    return rows, bad


class _Journal:
    """Appends one JSON line per answered point and flushes it at once (what a rerun reads to skip it)."""

    def __init__(self, path: Path):
        if path.exists() and path.stat().st_size:
            with open(path, "rb") as f:  # a line cut short by a kill: start ours on a fresh line
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        else:
            torn = False
        self.f = open(path, "a")
        if torn:
            self.f.write("\n")

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(finite_json(row), default=str, allow_nan=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def table(points: list[dict], rows: dict[str, dict]) -> pd.DataFrame:
    """The table: one row per point of the grid that has an answer, in grid order, columns ``COLUMNS``."""
    recs = [rows[p["point_id"]] for p in points if p["point_id"] in rows]
    return pd.DataFrame(recs).reindex(columns=list(COLUMNS))


def write_table(df: pd.DataFrame, out: Path, header: dict) -> list[Path]:
    """``sweep.csv`` (commented CSV: the header JSON on its first line) and, when pyarrow is installed,
    ``sweep.parquet`` with the header in the schema's metadata (key ``offsim.sweep``). Returns the paths written."""
    paths = [out / TABLE_CSV]
    write_commented_csv(paths[0], header, df)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        stale = out / TABLE_PARQUET
        if stale.exists():  # a table from an earlier run would disagree with the CSV
            stale.unlink()
        return paths
    t = pa.Table.from_pandas(df, preserve_index=False)
    t = t.replace_schema_metadata({**(t.schema.metadata or {}),
                                   b"offsim.sweep": json.dumps(header, default=str).encode()})
    tmp = out / (TABLE_PARQUET + ".tmp")
    pq.write_table(t, tmp)
    tmp.replace(out / TABLE_PARQUET)
    paths.append(out / TABLE_PARQUET)
    return paths


def read_table(path: str | Path) -> tuple[dict, pd.DataFrame]:
    """(header, table) of a sweep's ``sweep.csv`` or ``sweep.parquet``, or of the folder holding them."""
    from offsim.core.io import read_commented_csv

    path = Path(path)
    if path.is_dir():
        path = path / TABLE_CSV
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(path)
        return json.loads(t.schema.metadata[b"offsim.sweep"]), t.to_pandas()
    return read_commented_csv(path, "sweep table")


# ----------------------------------------------------------------------------------------------------------------
# running on Ray
# ----------------------------------------------------------------------------------------------------------------
def _ray():
    try:
        import ray
    except ImportError:
        raise OffsimError("offsim sweep runs its points on Ray, which is not installed: pip install ray") from None
    return ray


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a Ray address (``HOST:PORT`` or ``ray://HOST:PORT``) that nothing answers on within ``timeout_s``:
    ``ray.init`` would retry for minutes without a word. Other forms ('auto', 'local') are left to Ray."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address.strip())
    if not m:
        return
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise OffsimError(f"cannot reach the Ray cluster at {address}: nothing answers there within {timeout_s:g} s "
                          f"({getattr(e, 'strerror', None) or e}); start it (`ray start --head`) or give its "
                          "address as HOST:PORT (the head's GCS port, 6379 by default)") from None


def start_ray(workers: int | None = None, address: str | None = None) -> tuple[Any, bool, int]:
    """(ray, started_here, workers): connect to ``address`` (or $RAY_ADDRESS), or start a local Ray runtime with
    ``workers`` CPUs (default: all cores), quietly -- no dashboard, no worker logs on this terminal, only Ray's
    errors. A Ray already initialised in this process is used as it is (``started_here`` False: not shut down)."""
    ray = _ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    started = False
    if not ray.is_initialized():
        if address:
            check_reachable(address)
        try:
            if address:
                ray.init(address=address, **quiet)
            else:
                ray.init(num_cpus=workers or os.cpu_count() or 1, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"the Ray cluster at {address}" if address else "a local Ray runtime"
            raise OffsimError(f"cannot start or reach {where}: {_one_line(str(e))}") from None
        started = True
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return ray, started, max(1, min(workers or cpus, cpus))


def run_sweep(spec: SweepSpec, out: str | Path, workers: int | None = None, address: str | None = None,
              progress: bool = False, max_points: int | None = None, command: str | None = None,
              log: Callable[[str], None] | None = print) -> dict:
    """Run the points of ``spec`` not yet answered in ``out`` on Ray and write the table. ``workers``: tasks at
    a time (default: every CPU Ray has); ``address``: a Ray cluster (default: a local runtime); ``max_points``:
    stop after that many new points (the rest wait for the next run). Returns the run's record (also appended to
    ``sweep.json``): counts by status, points run and skipped, wall time, the table's paths.
    A KeyboardInterrupt cancels the points in flight and writes the table of what is done, then propagates."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = expand(spec)
    models, hws = resolve(spec)
    done, bad_lines = read_journal(out / JOURNAL)
    known = {p["point_id"] for p in points}
    finished = {pid for pid, r in done.items() if r["status"] in FINAL and pid in known}
    todo = [p for p in points if p["point_id"] not in finished]
    if max_points is not None:
        todo = todo[:max_points]
    say = log or (lambda _msg: None)
    record: dict[str, Any] = {**prov.provenance(**({"command": command} if command else {})), "points": len(points),
                              "skipped": len(finished), "ran": 0, "address": address or "local", "workers": None,
                              "cpus": os.cpu_count(), "loadavg_start": _loadavg(),
                              "journal_lines_skipped": bad_lines, "interrupted": False}
    say(f"sweep {spec.name!r} ({spec.mode} mode): {len(points)} points, {len(finished)} already answered in {out}, "
        f"{len(todo)} to run" + (f"; {bad_lines} unreadable journal line(s) skipped" if bad_lines else ""))
    t0 = time.perf_counter()
    interrupted = None
    if todo:
        journal = _Journal(out / JOURNAL)
        ray, started, width = start_ray(workers, address)
        record["workers"] = width
        say(f"on Ray ({'cluster ' + address if address else 'local runtime'}): {width} worker(s)")
        try:
            _run_on_ray(ray, todo, models, hws, width, journal, done, progress, record)
        except KeyboardInterrupt as e:
            interrupted = e
            record["interrupted"] = True
        finally:
            journal.close()
            if started:
                ray.shutdown()
    record["wall_s"] = time.perf_counter() - t0
    record["loadavg_end"] = _loadavg()  # (with loadavg_start: how busy the machine was, others' work included)
    rows = {pid: r for pid, r in done.items() if pid in known}
    df = table(points, rows)
    counts = df["status"].value_counts().to_dict()
    record.update({s: int(counts.get(s, 0)) for s in STATUSES})
    record["unanswered"] = len(points) - int(df["status"].isin(FINAL).sum())
    runs = _append_run(out / RUNS, spec, record)
    header = {"schema": SCHEMA, "spec": spec.to_dict(), "provenance": record, "runs": len(runs)}
    record["tables"] = [str(p) for p in write_table(df, out, header)]
    if interrupted is not None:
        say(f"interrupted: {record['ran']} point(s) answered in this run, {record['unanswered']} unanswered; the same "
            f"command resumes")
        raise interrupted
    return record


def _run_on_ray(ray, todo: list[dict], models: dict, hws: dict, width: int, journal: _Journal,
                done: dict, progress: bool, record: dict) -> None:
    """Keep ``2 * width`` tasks in flight; journal each answer as it comes; on an interrupt cancel the rest."""
    from tqdm import tqdm  # (a text bar on stderr, also in a notebook: tqdm.auto would want ipywidgets there)

    remote = ray.remote(num_cpus=1)(_evaluate_task)
    model_refs = {k: ray.put(v) for k, v in models.items()}
    hw_refs = {k: ray.put(v) for k, v in hws.items()}
    queue: Iterable[dict] = iter(todo)
    in_flight: dict[Any, dict] = {}
    counts = {s: 0 for s in STATUSES}
    bar = tqdm(total=len(todo), desc="sweep", unit="pt", disable=not progress, dynamic_ncols=True)

    def submit(n: int) -> None:
        for p in itertools.islice(queue, n):
            ref = remote.remote(p, model_refs[p["model"]], hw_refs[(p["hardware"], p["gpu_mem_gb"])])
            in_flight[ref] = p

    try:
        submit(2 * width)
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in ready:
                p = in_flight.pop(ref)
                try:
                    row = ray.get(ref)
                except ray.exceptions.RayError as e:  # the worker died (memory, a signal): not the point's answer
                    row = {"point_id": p["point_id"], **{a: p.get(a) for a in AXES}, "status": "error",
                           "reason": _one_line(f"{type(e).__name__}: {e}")[:500]}
                journal.write(row)
                done[row["point_id"]] = row
                counts[row["status"]] += 1
                record["ran"] += 1
                bar.set_postfix(counts, refresh=False)
                bar.update(1)
            submit(len(ready))
    except KeyboardInterrupt:
        for ref in in_flight:
            ray.cancel(ref, force=True)
        raise
    finally:
        bar.close()


def _append_run(path: Path, spec: SweepSpec, record: dict) -> list[dict]:
    """``sweep.json``: the spec and every run's record, this one appended."""
    runs = []
    if path.exists():
        try:
            runs = list(read_json_object(path, "sweep record").get("runs", []))
        except OffsimError:
            runs = []  # unreadable: start the record again (the journal holds the answers)
    runs.append({k: v for k, v in record.items() if k != "tables"})
    write_text_atomic(path, json.dumps(finite_json({"schema": SCHEMA, "spec": spec.to_dict(), "runs": runs}),
                                       indent=1, default=str, allow_nan=False))
    return runs
