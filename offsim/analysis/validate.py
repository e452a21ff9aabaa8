"""Validation: re-simulate measured runs and report how far the prediction is from the hardware (docs/architecture.md §8).

A measured *case* is what ``offexec run`` recorded for one plan: the run's metadata (model, hardware profile,
policy, settings, workload, GPU budget, machine, commit, date, command), its measured metrics, per-step latency, and
op time aggregated per (step, layer, kind) -- small enough to commit (``CASE_SCHEMA``). A full measured trace CSV
(``Trace.to_csv``) is accepted too and aggregated on load.

``validate_case`` takes the plan the run saved beside the case (``meta.plan_file``), or else rebuilds it from the
case's metadata and checks it against the run's ``meta.plan_sha256``; it simulates that plan with the profile
measured on the same machine, and returns phase-throughput errors, per-op-kind MAPE and per-step latency error. The CI thresholds live
here, in one place: ``MAX_CASE_ERROR`` and ``MAX_MEDIAN_ERROR``.
"""
from __future__ import annotations

import functools
import re
import json
from pathlib import Path

import numpy as np
import pandas as pd

from offsim.core.errors import OffsimError
from offsim.core.io import read_json_object, write_text_atomic
from offsim.core.plan import Plan
from offsim.policies import build_plan, get_policy
from offsim.core.sim import simulate
from offsim.core.specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model, is_finite_number
from offsim.core.trace import Trace

CASE_SCHEMA = "offsim.case/1"
MAX_CASE_ERROR = 0.10  # target: every case's total-throughput error within 10 %
MAX_MEDIAN_ERROR = 0.05  # target: the median over cases within 5 %
REGRESSION_SLACK = 0.02  # CI: no case's |error| may grow by more than 2 points over the committed baseline
META_FIELDS = ("model", "hardware", "policy", "settings", "workload")


def aggregate(trace: Trace) -> dict:
    """A trace reduced to what validation compares: metrics, per-step latency, op time per (step, layer, kind)."""
    df = trace.df.assign(dur_s=trace.df["end_s"] - trace.df["start_s"])
    ops = df.groupby(["step", "layer", "kind"])["dur_s"].agg(["count", "sum"]).reset_index()
    steps = trace.step_latency()
    return {"metrics": trace.metrics(),
            "steps": steps[["step", "start_s", "end_s", "latency_s"]].values.tolist(),
            "ops_by_kind": ops.values.tolist()}


def case_from_trace(trace: Trace, **provenance) -> dict:
    """The committed form of a measured run."""
    meta = dict(trace.meta)
    meta.update(provenance)
    return {"schema": CASE_SCHEMA, "meta": meta, "peak_bytes": trace.peak_bytes, **aggregate(trace)}


def save_case(case: dict, path: str | Path) -> None:
    write_text_atomic(path, json.dumps(case, default=str))


def load_case(path: str | Path) -> dict:
    """A case JSON, or a full trace CSV aggregated on the fly. Errors name the file and the field."""
    path = Path(path)
    if path.name.endswith((".csv", ".csv.gz")):
        tr = Trace.from_csv(path)
        case = {"schema": CASE_SCHEMA, "meta": tr.meta, "peak_bytes": tr.peak_bytes, **aggregate(tr)}
    else:
        case = read_json_object(path, "case")
        if case.get("schema") != CASE_SCHEMA:
            raise OffsimError(f"case {path}: field 'schema' is {case.get('schema')!r}; this offsim reads "
                              f"{CASE_SCHEMA!r}")
    for f in ("meta", "metrics", "steps", "ops_by_kind"):
        if f not in case:
            raise OffsimError(f"case {path}: missing field {f!r}")
    for f in META_FIELDS:
        if f not in case["meta"]:
            raise OffsimError(f"case {path}: missing field 'meta.{f}'")
    _check_case_fields(case, path)
    if case["metrics"].get("model") not in (None, case["meta"]["model"]):
        raise OffsimError(f"case {path}: field 'metrics.model' is {case['metrics']['model']!r} but the case is for "
                          f"{case['meta']['model']!r}")
    case["path"] = str(path)
    return case


def _check_case_fields(case: dict, path: Path) -> None:
    """What validation reads from a case, each by name: measured throughputs that are positive numbers (a run
    that measured nothing cannot be validated against), steps rows [step, start_s, end_s, latency_s] and ops rows
    [step, layer, kind, count, sum_s]."""
    number = is_finite_number
    for f in ("meta", "metrics"):
        if not isinstance(case[f], dict):
            raise OffsimError(f"case {path}: field {f!r} must be an object, got {str(case[f])[:60]}")
    m = case["metrics"]
    for k in ("prefill_tok_s", "total_tok_s"):
        if not number(m.get(k)) or not m[k] > 0:
            raise OffsimError(f"case {path}: field 'metrics.{k}' must be a positive number (the measured "
                              f"throughput), got {m.get(k)!r}")
    d = m.get("decode_tok_s")  # (a run of one generated token has no decode: null)
    if d is not None and (not number(d) or not d > 0):
        raise OffsimError(f"case {path}: field 'metrics.decode_tok_s' must be a positive number or null, got {d!r}")
    for f, n, cols in (("steps", 4, "step, start_s, end_s, latency_s"),
                       ("ops_by_kind", 5, "step, layer, kind, count, sum_s")):
        rows = case[f]
        bad = next((r for r in rows if not isinstance(r, (list, tuple)) or len(r) != n), None) \
            if isinstance(rows, list) else rows
        if bad is not None:
            raise OffsimError(f"case {path}: field {f!r} must be a list of rows [{cols}], got {str(bad)[:60]}")


def _err(pred: float, meas: float) -> float:
    """Signed relative error of a prediction."""
    return (pred - meas) / meas if meas else float("nan")


def run_setup(meta: dict, where: str = "case", hardware=None) -> tuple[ModelSpec, HardwareSpec, str, Workload]:
    """(model, hardware, hardware reference, workload) of a measured run from its metadata; ``hardware`` (a preset,
    a profile JSON or a HardwareSpec) overrides the run's own profile."""
    try:  # a run may use a modified spec (fp32, extended positions): then the case carries it whole
        model = ModelSpec.from_dict(meta["model_config"]) if meta.get("model_config") else get_model(meta["model"])
    except OffsimError as e:
        raise OffsimError(f"{where}: field 'meta.model': {e}") from None
    if model.name != meta["model"]:
        raise OffsimError(f"{where}: field 'meta.model' names {meta['model']!r} but the model is {model.name!r}")
    if isinstance(hardware, HardwareSpec):
        return model, hardware, hardware.name, Workload.from_dict(meta["workload"])
    hw_ref = hardware or _resolve(meta.get("hardware_profile") or meta.get("hardware") or "h200", where)
    hw = get_hardware(hw_ref, meta.get("gpu_mem_gb"))
    return model, hw, hw_ref, Workload.from_dict(meta["workload"])


def resimulate(measured: Trace | dict, hw: HardwareSpec | str | None = None) -> Trace:
    """The prediction for a measured run (a Trace, or a case dict): the plan that ran (stored beside the case) or
    one rebuilt from its policy and settings, simulated on ``hw`` (default: the profile the run names). Memory is
    not re-checked: the run already happened within its budget."""
    case = {"meta": measured.meta} if isinstance(measured, Trace) else measured
    meta, where = case["meta"], case.get("path", "measured run")
    missing = [k for k in ("model", "policy", "workload") if k not in meta]
    if missing:
        raise OffsimError(f"measured run metadata lacks {missing}: cannot rebuild its plan")
    model, hw, _, wl = run_setup(meta, where, hw)
    plan, _ = _plan_of(case, model, hw, wl)
    return simulate(plan, hw, check_memory=False)


# a case whose host ran offexec's host probe this much slower or faster than the host the profile was measured on
# (``host_probe_ratio`` beyond 1 +- this) ran in another state of the machine than the one the profile describes
HOST_STATE_SLACK = 0.15
# a run whose issuing thread spent at least this share of it issuing ops is host-bound: its speed is the host's
# (the report counts such cases apart)
HOST_BOUND_ISSUE = 0.5
# a case whose decode copies took this much longer or shorter than offsim priced them (``h2d_decode_time_ratio``
# beyond 1 +- this) met a link other than the profile's, or a copy the cost model misprices
LINK_STATE_SLACK = 0.05


@functools.lru_cache(maxsize=None)
def _profile_host_probe(hw_ref: str) -> dict | None:
    """The host probe a profile JSON recorded when it was measured (``provenance.host_probe``, ``offexec
    profile``); None for presets and profiles without one."""
    p = Path(hw_ref)
    if p.suffix != ".json" or not p.is_file():
        return None
    probe = read_json_object(p, "hardware profile").get("provenance", {}).get("host_probe")
    return probe if isinstance(probe, dict) else None


def host_probe_ratio(meta: dict, hw_ref: str) -> float:
    """The case's host-probe CPU-attention time over the profile's (``offexec.hostprobe``: one fixed decode
    CPU-attention op timed before the run and when the profile was measured): above 1 the host was slower than the
    one the profile describes. NaN where either lacks the probe."""
    case, prof = meta.get("host_probe"), _profile_host_probe(str(hw_ref))
    try:
        return float(case["cpu_attn_ms"]) / float(prof["cpu_attn_ms"])
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return float("nan")


def _float_or_nan(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def validate_case(case: dict, hardware: str | None = None) -> dict:
    """Re-simulate one measured case; ``hardware`` overrides the case's profile (a preset name or profile JSON)."""
    meta, where = case["meta"], case.get("path", "case")
    model, hw, hw_ref, wl = run_setup(meta, where, hardware)
    plan, plan_source = _plan_of(case, model, hw, wl)
    pred_trace = simulate(plan, hw, check_memory=False)
    pred = aggregate(pred_trace)
    pm, mm = pred["metrics"], case["metrics"]
    name = Path(where).name.removesuffix(".gz").removesuffix(".case.json").removesuffix(".trace.csv")
    out = {"case": name, "model": meta["model"], "policy": meta["policy"],
           "hardware": str(hw_ref), "gpu_mem_gb": meta.get("gpu_mem_gb"), "prompt_len": wl.prompt_len,
           "batch": wl.num_prompts, "plan": plan_source}
    for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s"):
        out[f"measured_{k}"] = mm[k]
        out[f"predicted_{k}"] = pm[k]
        out[f"err_{k}"] = _err(pm[k], mm[k])
    # the case measured K times (`matrix.py --repeats`): the spread of its total tok/s, (max - min) / median --
    # an error within it is within the measurement's own noise
    reps = meta.get("repeat_total_tok_s")
    out["measured_spread"] = (float((max(reps) - min(reps)) / np.median(reps)) if reps and len(reps) > 1
                              else float("nan"))
    out["host_probe_ratio"] = host_probe_ratio(meta, hw_ref)
    # the run's host side as offexec recorded it: the share of the run its issuing thread spent issuing ops, and the
    # host probe's CPU-attention time (ms) before the run -- a host-bound case moves with the host's state
    out["measured_issue_frac"] = _float_or_nan(meta.get("issue_frac"))
    out["host_probe_ms"] = _float_or_nan((meta.get("host_probe") or {}).get("cpu_attn_ms"))
    # per op kind: MAPE over (step, layer) groups of total op time
    cols = ["step", "layer", "kind", "count", "sum_s"]
    mo = pd.DataFrame(case["ops_by_kind"], columns=cols)
    po = pd.DataFrame(pred["ops_by_kind"], columns=cols)
    j = mo.merge(po, on=["step", "layer", "kind"], suffixes=("_meas", "_pred"))
    j = j[j["sum_s_meas"] > 0]
    for kind, g in j.groupby("kind"):
        out[f"mape_{kind}"] = float(np.mean(np.abs(g["sum_s_pred"] - g["sum_s_meas"]) / g["sum_s_meas"]))
    # the link as the run found it: decode's host-to-GPU op time (steps after the prefill), measured over predicted.
    # Above 1 the run's copies took longer than the profile prices them; on a link-bound run that is the decode
    # error's share from the link's rate that day (results/offexec/h100prof_fd0e0c5/: 1.10 on a host whose copies
    # moved 49.5 GB/s against its profile's 55.0)
    dec = j[(j["kind"] == "h2d") & (j["step"] >= 1)]
    pred_s = float(dec["sum_s_pred"].sum())
    out["h2d_decode_time_ratio"] = float(dec["sum_s_meas"].sum()) / pred_s if pred_s > 0 else float("nan")
    ms = pd.DataFrame(case["steps"], columns=["step", "start_s", "end_s", "latency_s"])
    ps = pd.DataFrame(pred["steps"], columns=["step", "start_s", "end_s", "latency_s"])
    s = ms.merge(ps, on="step", suffixes=("_meas", "_pred"))
    s = s[s["latency_s_meas"] > 0]
    out["step_latency_mape"] = float(np.mean(np.abs(s["latency_s_pred"] - s["latency_s_meas"])
                                             / s["latency_s_meas"])) if len(s) else float("nan")
    return out


def _plan_of(case: dict, model: ModelSpec, hw, wl: Workload) -> tuple[Plan, str]:
    """The plan to re-simulate, and where it came from: 'stored' (the plan file the run saved beside the case:
    exactly what ran), 'rebuilt' (from the policy and settings, for cases without one), or 'rebuilt, differs' when
    the case's ``meta.plan_sha256`` shows that today's policy code builds a different plan from those settings --
    then the prediction is for a plan that was never measured."""
    meta, where = case["meta"], case.get("path", "case")
    if meta.get("plan_file") and "path" in case:
        path = Path(where).parent / meta["plan_file"]
        plan = Plan.load(path)
        if meta.get("plan_sha256") not in (None, plan.fingerprint()):
            raise OffsimError(f"{where}: the stored plan {path} does not match field 'meta.plan_sha256'")
        _as_ran(plan, meta)
        return plan, "stored"
    # a plan records its inputs (settings) apart from what the policy derived from them: rebuild from the inputs
    pol = get_policy(meta["policy"])
    settings = pol.settings_from(pol.inputs_of(meta["settings"]))
    plan = _as_ran(build_plan(meta["policy"], model, hw, wl, settings, validate=False), meta)
    if meta.get("plan_sha256") not in (None, plan.fingerprint()):
        return plan, "rebuilt, differs"
    return plan, "rebuilt"


def _as_ran(plan: Plan, meta: dict) -> Plan:
    """How the run issued its ops and where its disk tier was, as its trace recorded them: a run from before
    offexec's CUDA graphs carries no 'cuda_graphs' (it issued kernel by kernel), a stored plan from before the field
    reads as graphed; a run from before its trace recorded 'run_ahead' ran with the plan's."""
    plan.cuda_graphs = bool(meta.get("cuda_graphs", False))
    plan.graph_max_q_tokens = int(meta.get("graph_max_q_tokens", 1))  # runs before recompute graphs: one token
    plan.graph_min_uses = int(meta.get("graph_min_uses", 1))  # (`offexec run --graph-min-uses`)
    plan.disk_cached = bool(meta.get("disk_cached", plan.disk_cached))
    if "run_ahead" in meta:  # (`offexec run --run-ahead`)
        plan.run_ahead = None if meta["run_ahead"] is None else tuple(meta["run_ahead"])
    return plan


_CASE_SCHEMA_RE = re.compile(r'"schema"\s*:\s*"' + re.escape(CASE_SCHEMA) + '"')


def _is_case_json(path: Path) -> bool:
    """A JSON file whose 'schema' is a case's (read from its first bytes, not the whole file; any spacing, so a
    minified case is found too)."""
    try:
        with open(path) as f:
            return _CASE_SCHEMA_RE.search(f.read(200)) is not None
    except (OSError, UnicodeDecodeError):
        return False


def find_cases(*roots: str | Path, missing_ok: bool = False) -> list[Path]:
    """Measured cases under ``roots`` (files are taken as they are): case JSONs (found by their schema, whatever
    their name) and full trace CSVs (``*.trace.csv``, gzipped or not), sorted. A root that does not exist is an
    error unless ``missing_ok`` (a notebook listing folders that may not be committed yet)."""
    out: set[Path] = set()
    for root in map(Path, roots):
        if root.is_file():
            out.add(root)
        elif root.is_dir():
            out |= {p for p in root.rglob("*.json") if _is_case_json(p)}
            out |= set(root.rglob("*.trace.csv")) | set(root.rglob("*.trace.csv.gz"))
        elif not missing_ok:
            raise OffsimError(f"{root}: no such file or directory")
    return sorted(out)


def _resolve(ref: str, case_path: str) -> str:
    """A profile path recorded relative to the repository root: found from the case file's folders upward."""
    p = Path(ref)
    if p.is_absolute() or p.exists() or p.suffix != ".json":
        return ref
    for parent in Path(case_path).resolve().parents:
        if (parent / p).exists():
            return str(parent / p)
    return ref


def validate_dir(root: str | Path, hardware: str | None = None, progress: bool = False) -> pd.DataFrame:
    paths = find_cases(root)
    if not paths:
        raise OffsimError(f"{root}: no measured cases (*.case.json or *.trace.csv)")
    it = paths
    if progress:
        from tqdm import tqdm
        it = tqdm(paths, desc="validate", unit="case")
    return pd.DataFrame([_validate_path(p, hardware) for p in it])


def _validate_path(path: Path, hardware: str | None) -> dict:
    """``validate_case`` of the case at ``path``; a case whose run cannot be rebuilt (a policy, settings or lengths
    no plan is made of) is an error that names it and says which part of it (the builder's message speaks of
    options such as --percent, which a case never had)."""
    case = load_case(path)
    try:
        return validate_case(case, hardware)
    except OffsimError as e:
        if str(path) in str(e):
            raise
        raise OffsimError(f"case {path}: its run cannot be re-simulated from its meta (policy, settings, workload): "
                          f"{e}") from None


def split_summary(df: pd.DataFrame) -> dict:
    """The headline figures of a validation report (one split on one profile): cases, median and max |total
    error|, cases within ``MAX_CASE_ERROR``, median |prefill| and |decode| error, median per-step latency MAPE."""
    e = df["err_total_tok_s"].abs()
    return {"cases": len(df), "median": e.median(), "max": e.max(), "within": int((e <= MAX_CASE_ERROR).sum()),
            "prefill": df["err_prefill_tok_s"].abs().median(), "decode": df["err_decode_tok_s"].abs().median(),
            "step": df["step_latency_mape"].median()}


def check_thresholds(df: pd.DataFrame) -> list[str]:
    """What breaks the CI thresholds (empty when the simulator is within them)."""
    errs = df["err_total_tok_s"].abs()
    bad = [f"{c}: total throughput error {e:+.1%} exceeds {MAX_CASE_ERROR:.0%}"
           for c, e in zip(df["case"], df["err_total_tok_s"]) if abs(e) > MAX_CASE_ERROR]
    if errs.median() > MAX_MEDIAN_ERROR:
        bad.append(f"median total throughput error {errs.median():.1%} exceeds {MAX_MEDIAN_ERROR:.0%}")
    return bad


def _ratio_note(df: pd.DataFrame, col: str, slack: float, what: str, recorded: str, beyond: str,
                why: str) -> list[str]:
    """A report paragraph on a ratio column (the case's state over the profile's): how many cases recorded it, how
    many lie beyond 1 +- ``slack``, its range; [] where no case recorded it."""
    v = df[col].dropna() if col in df else pd.Series(dtype=float)
    if not len(v):
        return []
    n = int(((v - 1).abs() > slack).sum())
    return ["", f"{what}: {len(v)} cases {recorded}, {n} {beyond} (ratio {v.min():.2f}-{v.max():.2f}){why}"]


def report_markdown(df: pd.DataFrame, title: str, command: str, prov: dict) -> str:
    """A README for ``validate --out``: every number in it computed here from ``df`` (the validation.csv beside it):
    the targets' verdict, errors by phase and by policy, and one row per case, worst first."""
    errs = df["err_total_tok_s"].abs()
    bad = check_thresholds(df)
    med = {k: df[f"err_{k}_tok_s"].abs().median() for k in ("prefill", "decode", "total")}
    lines = [f"# {title}", "", f"Written by `{command}` (commit {prov.get('commit')}, {prov.get('date')}) from "
             "`validation.csv` beside it.", "",
             f"**{len(df)} cases: median |total tok/s error| {med['total']:.1%} (target {MAX_MEDIAN_ERROR:.0%}), "
             f"max {errs.max():.1%} (target {MAX_CASE_ERROR:.0%} per case), {int((errs <= MAX_CASE_ERROR).sum())} "
             f"within {MAX_CASE_ERROR:.0%}: {'targets met' if not bad else 'targets NOT met'}.** Median |error| by "
             f"phase: prefill {med['prefill']:.1%}, decode {med['decode']:.1%}; median per-step latency MAPE "
             f"{df['step_latency_mape'].median():.1%}.", "",
             "| policy | cases | median abs total error | max abs total error |", "| --- | --- | --- | --- |"]
    for pol, g in df.groupby("policy"):
        e = g["err_total_tok_s"].abs()
        lines.append(f"| {pol} | {len(g)} | {e.median():.1%} | {e.max():.1%} |")
    # cases measured K times (matrix.py --repeats): their own spread beside the errors; cases that recorded the
    # host's state (offexec.hostprobe) against a profile that did: how much slower their host ran the probe
    spread = bool("measured_spread" in df and df["measured_spread"].notna().any())
    note = _ratio_note(df, "host_probe_ratio", HOST_STATE_SLACK,
                       "Host probe (`offexec.hostprobe`, one fixed CPU-attention op timed before each run and when "
                       "the profile was measured)", "recorded it",
                       f"ran it more than {HOST_STATE_SLACK:.0%} slower or faster than the profile's host",
                       "; their errors include the machine's change of state.")
    probe = bool(note)
    lines += note
    issue = bool("measured_issue_frac" in df and df["measured_issue_frac"].notna().any())
    probe_ms = not probe and bool("host_probe_ms" in df and df["host_probe_ms"].notna().any())
    if issue:
        bound = df["measured_issue_frac"] >= HOST_BOUND_ISSUE
        e_b, e_r = errs[bound], errs[~bound & df["measured_issue_frac"].notna()]
        nb = int(bound.sum())
        lines += ["", f"Host issue (the share of each run its issuing thread spent issuing ops, as offexec "
                  f"recorded it): {nb} case{'' if nb == 1 else 's'} spent {HOST_BOUND_ISSUE:.0%} or more"
                  + (f", median |total error| {e_b.median():.1%} (max {e_b.max():.1%})" if len(e_b) else "")
                  + (f"; the other {len(e_r)}, {e_r.median():.1%} (max {e_r.max():.1%})" if len(e_r) else "")
                  + ". A host-bound run's speed follows the host's state that day, which the profile cannot "
                  "know; the host probe column is that state (ms for one fixed CPU-attention op before the run)."]
    note = _ratio_note(df, "h2d_decode_time_ratio", LINK_STATE_SLACK,
                       "Link (decode's host-to-GPU op time, measured over predicted)", "copied in decode",
                       f"more than {LINK_STATE_SLACK:.0%} away from the profile's price",
                       ". Above 1 the run's copies ran slower than the profile says; on a link-bound run that share "
                       "of the decode error is the link's rate that day, or the cost model's copy pricing.")
    link = bool(note)
    lines += note
    extra = ([("measured spread", "measured_spread", "{:.1%}")] * spread
             + [("host probe / profile's", "host_probe_ratio", "{:.2f}")] * probe
             + [("host issue", "measured_issue_frac", "{:.0%}")] * issue
             + [("host probe ms", "host_probe_ms", "{:.2f}")] * probe_ms
             + [("decode H2D time / predicted", "h2d_decode_time_ratio", "{:.2f}")] * link)
    lines += ["", "| case | plan | batch | measured total tok/s | predicted | total error | prefill error | "
              "decode error |" + "".join(f" {h} |" for h, _, _ in extra), "| --- " * (8 + len(extra)) + "|"]
    for _, r in df.assign(_a=errs).sort_values("_a", ascending=False).iterrows():
        sp = "".join(" — |" if pd.isna(r[c]) else f" {f.format(r[c])} |" for _, c, f in extra)
        lines.append(f"| {r['case']} | {r['plan']} | {r['batch']} | {r['measured_total_tok_s']:.1f} | "
                     f"{r['predicted_total_tok_s']:.1f} | {r['err_total_tok_s']:+.1%} | "
                     f"{r['err_prefill_tok_s']:+.1%} | {r['err_decode_tok_s']:+.1%} |" + sp)
    return "\n".join(lines) + "\n"


def stale_cases(df: pd.DataFrame) -> list[str]:
    """Cases whose plan today's code rebuilds differently from the one that ran (``plan`` = 'rebuilt, differs')."""
    return df.loc[df["plan"] == "rebuilt, differs", "case"].tolist() if "plan" in df else []


def check_regression(df: pd.DataFrame, baseline: pd.DataFrame) -> list[str]:
    """What got worse than the committed baseline (``validation.csv`` of an earlier ``offsim validate --out``):
    a case missing, a case's |total error| grown by more than ``REGRESSION_SLACK``, or the median grown."""
    bad = [f"{c}: today's code builds a different plan from its settings than the one measured; re-measure it"
           for c in stale_cases(df)]
    cur = dict(zip(df["case"], df["err_total_tok_s"].abs()))
    for case, e0 in zip(baseline["case"], baseline["err_total_tok_s"].abs()):
        if case not in cur:
            bad.append(f"{case}: in the baseline but no longer validated")
        elif cur[case] > e0 + REGRESSION_SLACK:
            bad.append(f"{case}: |total error| {cur[case]:.1%} grew from the baseline's {e0:.1%}")
    m, m0 = df["err_total_tok_s"].abs().median(), baseline["err_total_tok_s"].abs().median()
    if m > m0 + REGRESSION_SLACK:
        bad.append(f"median |total error| {m:.1%} grew from the baseline's {m0:.1%}")
    return bad


def plot(df: pd.DataFrame, path: str | Path) -> None:
    """Predicted vs measured total tok/s (log-log, one point per case) and |error| by policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for pol, g in df.groupby("policy"):
        a.scatter(g["measured_total_tok_s"], g["predicted_total_tok_s"], label=pol, s=18)
    lo = min(df["measured_total_tok_s"].min(), df["predicted_total_tok_s"].min()) * 0.8
    hi = max(df["measured_total_tok_s"].max(), df["predicted_total_tok_s"].max()) * 1.25
    a.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    a.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15, label="±10 %")
    a.set(xscale="log", yscale="log", xlabel="measured total tok/s", ylabel="predicted total tok/s",
          title="offsim vs hardware")
    a.legend(fontsize=7)
    e = df.assign(abs_err=df["err_total_tok_s"].abs() * 100)
    e.boxplot(column="abs_err", by="policy", ax=b, rot=30)
    b.set(ylabel="|total tok/s error| (%)", title="error by policy", xlabel="")
    fig.suptitle("")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
