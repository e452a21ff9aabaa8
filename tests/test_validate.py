"""offsim validate: re-simulating measured cases, error metrics, malformed inputs, and the CI guard on the committed
H200 cases (results/validation/)."""
import json
import math
from pathlib import Path

import pytest

from offsim import Workload, build_plan, simulate
from offsim.analysis import validate as V
from offsim.core.errors import OffsimError
from offsim.core.specs import get_hardware, get_model

ROOT = Path(__file__).resolve().parents[1]

CASES = Path(__file__).resolve().parents[1] / "results" / "validation"
PROFILE = Path(__file__).resolve().parents[1] / "results" / "profiles" / "h200_offexec.json"
PROFILE_V2 = PROFILE.with_name("h200_offexec_v2.json")  # op tables, sustained clocks (offexec profile --ops)


def _measured(tmp_path, link_scale=1.0, name="c1"):
    """A stand-in for a measured run: the same plan simulated on hardware whose link is ``link_scale`` as fast."""
    model, hw = get_model("opt-125m"), get_hardware("t4", gpu_mem_gb=0.4)
    wl = Workload(32, 4, 4, 2)
    settings = {"percent": [0, 100, 0, 100, 100, 0]}
    tr = simulate(build_plan("flexgen", model, hw, wl, settings), hw.scaled_link(link_scale))
    tr.meta.update({"gpu_mem_gb": 0.4, "hardware": "t4"})
    case = V.case_from_trace(tr, machine="test", commit="x", date="today", command="test")
    p = tmp_path / f"{name}.case.json"
    V.save_case(case, p)
    return p


def test_same_hardware_zero_error(tmp_path):
    r = V.validate_case(V.load_case(_measured(tmp_path)))
    assert abs(r["err_total_tok_s"]) < 1e-9 and abs(r["err_decode_tok_s"]) < 1e-9
    assert r["mape_h2d"] < 1e-9 and r["step_latency_mape"] < 1e-9


def test_slower_link_shows_up_as_error(tmp_path):
    r = V.validate_case(V.load_case(_measured(tmp_path, link_scale=0.5)))
    assert r["err_total_tok_s"] > 0.2  # predicted (full-speed link) is faster than "measured"
    assert r["mape_h2d"] == pytest.approx(0.5, rel=0.05)  # every copy took twice as long: |1 - 2| / 2
    assert r["h2d_decode_time_ratio"] == pytest.approx(2.0, rel=0.02)  # decode's copies, measured over predicted
    _measured(tmp_path, name="same")
    df = V.validate_dir(tmp_path)
    assert df.set_index("case").loc["same", "h2d_decode_time_ratio"] == pytest.approx(1.0)
    md = V.report_markdown(df, "t", "test", {})
    x = f"{r['h2d_decode_time_ratio']:.2f}"
    assert "decode H2D time / predicted |" in md and f"| {x} |" in md and "| 1.00 |" in md
    assert f"2 cases copied in decode, 1 more than 5% away from the profile's price (ratio 1.00-{x})" in md


def test_repeated_case_reports_its_spread(tmp_path):
    """A case measured K times (`matrix.py --repeats`) keeps the run of median throughput and reports the spread
    of the K totals; a case measured once has none."""
    from experiments.validation.matrix import median_run

    assert median_run([(3.0, "c"), (1.0, "a"), (2.0, "b")])[1] == "b"
    assert median_run([(4.0, "d"), (1.0, "a"), (2.0, "b"), (3.0, "c")])[1] == "b"  # even K: the lower middle
    assert median_run([(5.0, "x")])[1] == "x"
    p = _measured(tmp_path)
    assert math.isnan(V.validate_case(V.load_case(p))["measured_spread"])
    c = json.loads(p.read_text())
    c["meta"]["repeat_total_tok_s"] = [90.0, 100.0, 120.0]
    p.write_text(json.dumps(c))
    assert V.validate_case(V.load_case(p))["measured_spread"] == pytest.approx(0.3)
    df = V.validate_dir(tmp_path)
    md = V.report_markdown(df, "t", "test", {})
    assert "measured spread |" in md and "| 30.0% |" in md
    _measured(tmp_path, name="once")  # a case measured once beside it: no spread, a dash
    assert "| — |" in V.report_markdown(V.validate_dir(tmp_path), "t", "test", {})


def test_host_probe_ratio_sets_the_cases_host_beside_the_profiles(tmp_path):
    """A case that recorded the host's state (offexec.hostprobe, `matrix.py`) validated on a profile that recorded
    it too: the ratio of their CPU-attention probe times, and the report says how many cases ran in another state;
    NaN where either side lacks the probe (presets, older cases)."""
    from offsim.core.specs import load_hardware_preset

    prof = load_hardware_preset("t4").to_dict()
    prof["provenance"] = {"host_probe": {"cpu_attn_ms": 4.0, "host_copy_GB_s": 20.0}}
    pf = tmp_path / "prof.json"
    pf.write_text(json.dumps(prof))
    cases = tmp_path / "cases"
    cases.mkdir()
    p = _measured(cases)
    assert math.isnan(V.validate_case(V.load_case(p), str(pf))["host_probe_ratio"])  # the case has none
    c = json.loads(p.read_text())
    c["meta"]["host_probe"] = {"cpu_attn_ms": 10.0, "host_copy_GB_s": 12.0}
    p.write_text(json.dumps(c))
    assert V.validate_case(V.load_case(p), str(pf))["host_probe_ratio"] == pytest.approx(2.5)
    assert math.isnan(V.validate_case(V.load_case(p), "t4")["host_probe_ratio"])  # a preset has none
    df = V.validate_dir(cases, str(pf))
    md = V.report_markdown(df, "t", "test", {})
    assert "host probe / profile's |" in md and "| 2.50 |" in md
    assert "1 cases recorded it, 1 ran it more than 15% slower or faster" in md


def test_report_counts_host_bound_runs_apart(tmp_path):
    """A case records its run's host-issue share and host probe (offexec): the report shows both per case and
    counts the runs that spent HOST_BOUND_ISSUE or more of their time issuing apart from the rest; a case without
    them (a trace from elsewhere) shows a dash."""
    for name, frac in (("bound", 0.74), ("free", 0.07)):
        p = _measured(tmp_path, name=name)
        c = json.loads(p.read_text())
        c["meta"]["issue_frac"] = frac
        c["meta"]["host_probe"] = {"cpu_attn_ms": 2.82 if frac > 0.5 else 1.61}
        p.write_text(json.dumps(c))
    _measured(tmp_path, name="plain")
    df = V.validate_dir(tmp_path)
    r = df.set_index("case")
    assert r.loc["bound", "measured_issue_frac"] == pytest.approx(0.74)
    assert r.loc["free", "host_probe_ms"] == pytest.approx(1.61) and math.isnan(r.loc["plain", "host_probe_ms"])
    md = V.report_markdown(df, "t", "test", {})
    assert "host issue | host probe ms |" in md and "| 74% | 2.82 |" in md and "| — | — |" in md
    assert "1 case spent 50% or more" in md and "the other 1," in md


def test_thresholds_and_dir(tmp_path):
    _measured(tmp_path, 1.0, "a")
    _measured(tmp_path, 0.5, "b")
    df = V.validate_dir(tmp_path)
    assert len(df) == 2
    bad = V.check_thresholds(df)
    assert any("b:" in x for x in bad) and not any("a:" in x for x in bad)


def test_full_trace_csv_accepted(tmp_path):
    model, hw = get_model("opt-125m"), get_hardware("t4", gpu_mem_gb=0.4)
    tr = simulate(build_plan("flexgen", model, hw, Workload(16, 3, 2, 2), {"percent": [0, 100, 0, 100, 100, 0]}), hw)
    tr.meta["gpu_mem_gb"] = 0.4
    tr.to_csv(tmp_path / "run.trace.csv")
    r = V.validate_dir(tmp_path).iloc[0]
    assert abs(r["err_total_tok_s"]) < 1e-9


def _damaged(text: str, raw: bytes) -> dict:
    """Damaged copies of a trace CSV (``text``; ``raw`` its gzipped bytes): file name -> bytes and the message."""
    lines = text.splitlines(keepends=True)
    row = lines[2].split(",")
    return {
        "cut.trace.csv.gz": (raw[: len(raw) // 2], "cannot read trace"),
        "notgz.trace.csv.gz": (text.encode(), "cannot read trace"),
        "binary.trace.csv": (lines[0].encode() + b"\xff\xfe\x00op_id\n", "not text"),
        "meta_only.trace.csv": (lines[0].encode(), "no table"),
        "ragged.trace.csv": ("".join(lines[:3] + [lines[2].rstrip("\n") + ",1,2,3\n"]).encode(), "malformed"),
        "text.trace.csv": ("".join(lines[:2] + [",".join(row[:7] + ["abc"] + row[8:])] + lines[3:]).encode(),
                           "column 'start_s' must hold finite numbers"),
    }


def test_a_case_whose_run_cannot_be_rebuilt_is_named(tmp_path):
    p = _measured(tmp_path)
    c = json.loads(p.read_text())
    c["meta"]["settings"]["percent"] = [1, 2]
    p.write_text(json.dumps(c))
    with pytest.raises(OffsimError, match="cannot be re-simulated from its meta") as e:
        V.validate_dir(tmp_path)
    assert str(p) in str(e.value)


def test_damaged_trace_csvs_are_one_line_errors_naming_the_file(tmp_path):
    import gzip

    model, hw = get_model("opt-125m"), get_hardware("t4", gpu_mem_gb=0.4)
    tr = simulate(build_plan("flexgen", model, hw, Workload(16, 3, 2, 2), {"percent": [0, 100, 0, 100, 100, 0]}), hw)
    tr.to_csv(tmp_path / "good.csv")
    text = (tmp_path / "good.csv").read_text()
    assert text.splitlines()[1].split(",")[7] == "start_s"
    for name, (data, msg) in _damaged(text, gzip.compress(text.encode())).items():
        d = tmp_path / name.split(".")[0]
        d.mkdir()
        (d / name).write_bytes(data)
        with pytest.raises(OffsimError, match=msg) as e:
            V.validate_dir(d)
        assert name in str(e.value), (name, str(e.value))


@pytest.mark.parametrize("mutate,msg", [
    (lambda c: c.update(schema="offsim.case/0"), "field 'schema'"),
    (lambda c: c.pop("steps"), "missing field 'steps'"),
    (lambda c: c["meta"].pop("policy"), "meta.policy"),
    (lambda c: c["metrics"].update(model="opt-66b"), "metrics.model"),
])
def test_malformed_case_names_file_and_field(tmp_path, mutate, msg):
    p = _measured(tmp_path)
    c = json.loads(p.read_text())
    mutate(c)
    p.write_text(json.dumps(c))
    with pytest.raises(OffsimError, match=msg) as e:
        V.load_case(p)
    assert str(p) in str(e.value)


def test_committed_h200_cases_do_not_regress():
    """The CI guard: every committed H200 case (results/validation/h200, measured with warm-up) re-simulated with
    the committed profile; no case may drift further from the hardware than the committed baseline
    (validate.REGRESSION_SLACK). The issue's targets (10 % per case, 5 % median) are not met yet: the baseline says
    by how much, and results/validation/README.md says why."""
    import pandas as pd

    base_csv = CASES / "h200_report" / "validation.csv"
    if not base_csv.exists():
        pytest.skip("no committed baseline under results/validation/h200_report/")
    df = V.validate_dir(CASES / "h200", hardware=str(PROFILE))
    base = pd.read_csv(base_csv, comment="#")
    assert not V.check_regression(df, base), V.check_regression(df, base)


@pytest.fixture(scope="module")
def matrix_v2():
    """Matrix v2 (results/validation/h200_{calib,heldout}: 68 H200 cases, each with the plan that ran) re-simulated
    with the committed profile v2, per split."""
    out = {}
    for split in ("calib", "heldout"):
        if not (CASES / f"h200_{split}").is_dir():
            pytest.skip(f"no committed cases under results/validation/h200_{split}/")
        out[split] = V.validate_dir(CASES / f"h200_{split}", hardware=str(PROFILE_V2))
    return out


@pytest.mark.parametrize("split", ["calib", "heldout"])
def test_matrix_v2_does_not_regress(matrix_v2, split):
    """The CI guard on matrix v2: no case may drift further from the hardware than in the committed report
    (results/validation/h200_v2_report/SPLIT/validation.csv) by more than validate.REGRESSION_SLACK, no case may
    go missing, and no plan may change under its stored fingerprint."""
    import pandas as pd

    base = pd.read_csv(CASES / "h200_v2_report" / split / "validation.csv", comment="#")
    assert len(matrix_v2[split]) == len(base) >= 30
    assert not V.check_regression(matrix_v2[split], base), V.check_regression(matrix_v2[split], base)


@pytest.mark.xfail(strict=True, reason="issue 13's targets (median |total error| <= 5 %, every case <= 10 %, on each "
                                       "split) are not met yet; results/validation/README.md says where it misses. "
                                       "Strict: once they are met this fails, and the mark must go")
@pytest.mark.parametrize("split", ["calib", "heldout"])
def test_matrix_v2_meets_targets(matrix_v2, split):
    assert not V.check_thresholds(matrix_v2[split]), V.check_thresholds(matrix_v2[split])


COMPRESSION_RUNS = sorted((ROOT / "results" / "compression").glob("h200_*/validation/validation.csv"))


@pytest.mark.parametrize("report", COMPRESSION_RUNS, ids=lambda p: p.parent.parent.name)
def test_compression_reports_do_not_regress(report):
    """The compression runs' committed reports (results/compression/*/validation/, which the generated
    results/compression/README.md quotes) are guarded like matrix v2's: re-simulated on profile v2 with today's
    code, no case may drift further from the measurement than committed (2026-12-05: five such reports had gone
    stale unnoticed, one from 'targets met' to 'NOT met')."""
    import pandas as pd

    now = V.validate_dir(report.parent.parent, hardware=str(PROFILE_V2))
    base = pd.read_csv(report, comment="#")
    assert len(now) == len(base) >= 1
    assert not V.check_regression(now, base), V.check_regression(now, base)


def test_regression_check_catches_growth(tmp_path):
    import pandas as pd

    base = pd.DataFrame({"case": ["a", "b"], "err_total_tok_s": [0.05, -0.20]})
    assert not V.check_regression(base.assign(err_total_tok_s=[0.06, -0.21]), base)
    assert V.check_regression(base.assign(err_total_tok_s=[0.09, -0.20]), base)
    assert V.check_regression(base.iloc[:1], base)  # a case vanished


def _with_plan_meta(p, plan, store: bool):
    case = json.loads(p.read_text())
    case["meta"]["plan_sha256"] = plan.fingerprint()
    if store:
        plan.save(p.parent / "c1.plan.json.gz")
        case["meta"]["plan_file"] = "c1.plan.json.gz"
    p.write_text(json.dumps(case))


def _case_plan():
    model, hw = get_model("opt-125m"), get_hardware("t4", gpu_mem_gb=0.4)
    return build_plan("flexgen", model, hw, Workload(32, 4, 4, 2), {"percent": [0, 100, 0, 100, 100, 0]})


def test_stored_plan_is_what_gets_resimulated(tmp_path):
    """A case that carries its plan is re-simulated from that file, not rebuilt: editing the stored plan (here:
    dropping the prefetch overlap by serialising its ops) changes the prediction; a fingerprint mismatch is an
    error that names the file."""
    from offsim.core.plan import Plan

    p = _measured(tmp_path)
    plan = _case_plan()
    _with_plan_meta(p, plan, store=True)
    r = V.validate_case(V.load_case(p))
    assert r["plan"] == "stored" and abs(r["err_total_tok_s"]) < 1e-9
    slow = Plan.from_dict(plan.to_dict())
    for o in slow.ops[1:]:
        o.deps = tuple(sorted(set(o.deps) | {o.id - 1}))
    slow.save(tmp_path / "c1.plan.json.gz")
    with pytest.raises(OffsimError, match="c1.plan.json.gz does not match field 'meta.plan_sha256'"):
        V.validate_case(V.load_case(p))
    case = json.loads(p.read_text())
    case["meta"]["plan_sha256"] = slow.fingerprint()
    p.write_text(json.dumps(case))
    r = V.validate_case(V.load_case(p))
    assert r["plan"] == "stored" and r["err_total_tok_s"] < -0.05  # the serial plan is predicted slower


def test_rebuilt_plan_that_differs_from_the_run_is_flagged(tmp_path):
    """Without a stored plan the case is rebuilt from its settings; when its fingerprint says the run executed a
    different plan (the policy code changed since), the report says so and the regression check fails on it."""
    import pandas as pd

    p = _measured(tmp_path)
    _with_plan_meta(p, _case_plan(), store=False)
    assert V.validate_case(V.load_case(p))["plan"] == "rebuilt"
    case = json.loads(p.read_text())
    case["meta"]["plan_sha256"] = "0" * 64
    p.write_text(json.dumps(case))
    df = V.validate_dir(tmp_path)
    assert df["plan"].tolist() == ["rebuilt, differs"]
    bad = V.check_regression(df, pd.DataFrame({"case": ["c1"], "err_total_tok_s": [0.0]}))
    assert any("re-measure" in b for b in bad)


def test_matrix_v2_split_is_seeded_and_stratified():
    """Matrix v2 (issue 13) splits its cases into a calibration and a held-out set before anything is measured:
    the split is a function of the seed alone, each policy variant is dealt to both sets, and the committed config's
    split is the one its seed gives."""
    import copy
    from pathlib import Path

    from experiments.validation.matrix import SPLITS, split_cases

    cases = [{"tag": f"c{i}", "policy": p, "settings": {"cpu_attention": ca}, "disk": d}
             for i, (p, ca, d) in enumerate([("flexgen", False, False)] * 5 + [("flexgen", True, False)] * 4
                                            + [("tightllm", False, True)] * 3)]
    a, b = copy.deepcopy(cases), copy.deepcopy(cases)
    split_cases(a, 7)
    split_cases(b, 7)
    assert [c["split"] for c in a] == [c["split"] for c in b]
    for key in {(c["policy"], c["settings"]["cpu_attention"], c["disk"]) for c in a}:
        got = [c["split"] for c in a if (c["policy"], c["settings"]["cpu_attention"], c["disk"]) == key]
        assert set(got) == set(SPLITS) and abs(got.count("calib") - got.count("heldout")) <= 1
    cfg = Path(__file__).parent.parent / "results" / "validation" / "matrix_v2_config.json"
    if cfg.exists():
        doc = json.loads(cfg.read_text())
        redo = copy.deepcopy(doc["cases"])
        split_cases(redo, doc["seed"])
        assert {c["tag"]: c["split"] for c in redo} == {c["tag"]: c["split"] for c in doc["cases"]}


def _remeasure_folders(tmp_path, tag: str, both: bool) -> tuple[Path, Path]:
    """Folders 'old' and 'new' under ``tmp_path``, calibration case ``tag``'s files (case and plan) copied into old
    and, with ``both``, into new."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    for f in (ROOT / "results" / "validation" / "h200_calib").glob(f"{tag}.*"):
        for d in (old, new) if both else (old,):
            shutil.copy(f, d)
    return old, new


def test_remeasure_compare_lists_every_case_measured_twice(tmp_path, capsys):
    """experiments.validation.remeasure_compare sets each case found in both folders beside its re-measurement:
    the change of measured throughput, whether the plan is the same, offsim's error on each; cases in one folder
    only are named, not dropped; a case whose two files are the same run is named as not re-measured, not counted
    as a change of 0 %."""
    import shutil

    from experiments.validation.remeasure_compare import main

    src = ROOT / "results" / "validation" / "h200_calib"
    tag = "opt-30b_flexgen_b12_p256_g32"
    old, new = _remeasure_folders(tmp_path, tag, both=True)
    case = json.loads((new / f"{tag}.case.json").read_text())
    case["metrics"]["total_tok_s"] *= 1.25  # the re-measurement ran 25 % faster
    case["meta"]["date"] = "2099-01-01T00:00:00+00:00"
    (new / f"{tag}.case.json").write_text(json.dumps(case))
    shutil.copy(src / "opt-13b_tightllm_b32_p128_g32.case.json", old)  # measured once only
    same = "opt-30b_flexgen_b8_p128_g32"  # the very same run on both sides
    for f in src.glob(f"{same}.*"):
        shutil.copy(f, old)
        shutil.copy(f, new)
    assert main([str(old), str(new), "--out", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr().out
    assert f"| {tag} |" in out and "| +25.0% | yes |" in out
    assert "only in" in out and "opt-13b_tightllm_b32_p128_g32" in out
    s = json.loads(out.strip().splitlines()[-1])
    assert s["cases"] == 1 and s["moved_over_5pct"] == 1 and s["only_old"] == ["opt-13b_tightllm_b32_p128_g32"]
    assert s["not_remeasured"] == [same] and f"| {same} |" not in out
    # offsim predicts the same plan either way: against the faster run its error is the old one over the speed-up
    import pandas as pd

    row = pd.read_csv(tmp_path / "c.csv", comment="#").iloc[0]
    assert 1 + row["new_offsim_error"] == pytest.approx((1 + row["old_offsim_error"]) / 1.25)


def test_remeasure_compare_adds_runs_whose_case_files_were_lost(tmp_path, capsys):
    """--runs: a case measured again whose case file did not come back (only its runs.jsonl line did) gets a row
    from that line, its plan and schedule 'unknown', offsim's error against the old case's own plan; a line of a case
    with a new case file is not counted twice; --runs without --runs-commit is refused."""
    from experiments.validation.remeasure_compare import main

    tag = "opt-13b_tightllm_b32_p128_g32"
    old, new = _remeasure_folders(tmp_path, tag, both=False)
    measured = json.loads((old / f"{tag}.case.json").read_text())["metrics"]["total_tok_s"]
    runs = tmp_path / "runs.jsonl"
    runs.write_text(json.dumps({"case": tag, "measured_total_tok_s": measured * 0.8}) + "\n"
                    + json.dumps({"case": "not-in-old", "measured_total_tok_s": 1.0}) + "\n")
    assert main([str(old), str(new), "--runs", str(runs), "--runs-commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert f"| {tag} |" in out and "(abc1234) | -20.0% | unknown | unknown |" in out
    s = json.loads(out.strip().splitlines()[-1])
    assert s["cases"] == 1 and s["only_old"] == [] and s["same_plan"] == 0
    with pytest.raises(SystemExit):
        main([str(old), str(new), "--runs", str(runs)])


def test_remeasure_compare_tells_a_changed_schedule_from_changed_bookkeeping(tmp_path):
    """Two runs whose plans differ only in memory annotations have the same schedule; a changed op size is a
    changed schedule."""
    import shutil

    from experiments.validation.remeasure_compare import same_schedule
    from offsim.core.plan import Plan

    src = ROOT / "results" / "validation" / "h200_calib"
    tag = "opt-30b_flexgen_b12_p256_g32"
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
        shutil.copy(src / f"{tag}.plan.json.gz", d)
    assert same_schedule(old, new, tag)
    plan = Plan.load(new / f"{tag}.plan.json.gz")
    op = next(o for o in plan.ops if o.kind == "compute")
    op.alloc = (op.alloc[0] + 1024, 0, 0)  # a footprint change: bookkeeping, the same schedule
    plan.save(new / f"{tag}.plan.json.gz")
    assert same_schedule(old, new, tag)
    op = next(o for o in plan.ops if o.kind == "h2d")
    op.nbytes += 1  # a copy of another size: another schedule
    plan.save(new / f"{tag}.plan.json.gz")
    assert not same_schedule(old, new, tag)
    assert not same_schedule(old, tmp_path, tag)  # a plan missing on one side


def test_matrix_cases_are_exact_tags_and_unknown_ones_are_refused(tmp_path):
    """--cases selects by exact tag (--only-cases matches substrings); a tag the configuration lacks is refused,
    with what tags look like, before anything runs."""
    import subprocess
    import sys

    cfg = CASES / "matrix_v2_config.json"
    r = subprocess.run([sys.executable, "-m", "experiments.validation.matrix", "--config", str(cfg), "--out",
                        str(tmp_path), "--cases", "opt-6.7b_flexgen_b12_p2048_g64"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "no case tagged opt-6.7b_flexgen_b12_p2048_g64" in r.stderr
    assert "tags look like" in r.stderr and not any(tmp_path.iterdir())


def test_matrix_repeats_keep_first_records_the_runs_and_the_host(tmp_path):
    """`matrix --repeats 2 --keep first` (CPU smoke mode, one case): the case is the first run after the warm-up
    (what `offexec run` measures), both totals and which run was kept are in the case, and so is the host's state
    before the runs (offexec.hostprobe)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "experiments.validation.matrix", "--device", "cpu", "--quick", "--out",
                        str(tmp_path), "--repeats", "2", "--keep", "first", "--only-cases", "opt-125m_flexgen_p32",
                        "--warmup", "--warmup-mode", "same-length"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    (f,) = tmp_path.glob("*.case.json")
    case = V.load_case(f)
    m = case["meta"]
    assert m["kept"] == "first" and m["kept_run"] == 0 and len(m["repeat_total_tok_s"]) == 2
    assert case["metrics"]["total_tok_s"] == pytest.approx(m["repeat_total_tok_s"][0])
    assert m["host_probe"]["cpu_attn_ms"] > 0 and m["host_probe"]["usable_cpus"] >= 1
    assert m["warmup"] and m["warmup_mode"] == "same-length"


def test_warmup_plan_modes():
    """matrix's warm-up: 'short' is 2 tokens of the case's prompt; 'same-length' is 2 tokens at the case's full length
    (KV buffers as long as the run's), 'short' for a mixed-length batch; 'full' is the case's own plan."""
    from experiments.validation.matrix import warmup_plan

    model, hw = get_model("opt-125m"), get_hardware("h200", gpu_mem_gb=4)
    st = {"percent": [100, 0, 100, 0, 100, 0]}
    wl = Workload(64, 16, 4, 1)
    plan = build_plan("flexgen", model, hw, wl, st)
    short, m = warmup_plan(plan, "flexgen", model, hw, wl, st, "short")
    assert m == "short" and short.workload.gen_len == 2 and short.workload.max_len < wl.max_len
    same, m = warmup_plan(plan, "flexgen", model, hw, wl, st, "same-length")
    assert m == "same-length" and same.workload.gen_len == 2 and same.workload.max_len == wl.max_len
    assert warmup_plan(plan, "flexgen", model, hw, wl, st, "full") == (plan, "full")
    mixed = wl.with_(prompt_lens=(60, 64, 50, 64), gen_lens=(16, 8, 16, 1))
    warm, m = warmup_plan(plan, "flexgen", model, hw, mixed, st, "same-length")
    assert m == "short" and warm.workload.gen_lens == (2, 2, 2, 1)


def test_validation_readme_joins_rounds_that_complete_each_other(tmp_path, monkeypatch):
    """A split re-measured in two rounds (the second reaching the cases the first did not): each round's section
    names the other for the rest instead of listing them as 'not yet', and says how many of its runs are still the
    split's files; a case no round reached is 'not yet'."""
    import experiments.validation.write_readme as W

    monkeypatch.setattr(W, "VAL", tmp_path)
    (tmp_path / "h200_calib").mkdir()
    commits = {"a": "new1", "b": "new1", "c": "new2", "d": "old0"}  # the split's files: who measured each now
    for tag, commit in commits.items():
        (tmp_path / "h200_calib" / f"{tag}.case.json").write_text(json.dumps({"meta": {"commit": commit}}))
    cols = ("case,old_commit,old_measured_total_tok_s,old_offsim_error,new_commit,new_measured_total_tok_s,"
            "new_offsim_error,change,same_plan,same_schedule")
    for name, rows in (("remeasure_calib_new1", ["a,old0,100,0.01,new1,102,0.0,0.02,True,True",
                                                 "b,old0,100,0.01,new1,90,0.1,-0.1,False,True"]),
                       ("remeasure_calib_new2", ["c,old0,50,0.0,new2,50,0.0,0.0,True,True"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "compare.csv").write_text(
            '# {"commit": "x", "date": "2026-12-02T00:00:00"}\n' + cols + "\n" + "\n".join(rows) + "\n")
    text = "\n".join(W._remeasured())
    first, second = text.split("### Re-measured at one commit: `remeasure_calib_new2/`")
    assert "2 of the 4 cases (the other 1 case in `remeasure_calib_new2/`; not yet: `d`" in first
    assert "so that, with `remeasure_calib_new2/`, every case of the split is measured again" in first
    assert "The cases' files in the split are these runs." in first
    assert "1 of the 4 cases (the other 2 cases in `remeasure_calib_new1/`; not yet: `d`" in second
    assert "On the same plan (1 case)" in second

    # a later run replaced one of the first round's cases
    (tmp_path / "h200_calib" / "a.case.json").write_text(json.dumps({"meta": {"commit": "new3"}}))
    assert "1 of these runs are the split's files today" in "\n".join(W._remeasured())


def test_profile_variants_compares_merged_profiles_on_cases(tmp_path, capsys):
    """experiments.validation.profile_variants: a variant is the base profile with a part merged in (here graphed
    decode attention rows for the case's model, as ``offexec profile --attention-only decode`` writes them); each
    case is re-simulated on both and the table says each profile's figures; a malformed variant is refused."""
    import shutil

    import pandas as pd

    from experiments.validation import profile_variants as PV
    from offsim.core.specs import layer_key

    src = Path(__file__).resolve().parents[1] / "results" / "validation" / "h200_calib"
    cases = tmp_path / "cases"
    cases.mkdir()
    name = "opt-6.7b_static-accelerate_b32_p1024_g16"
    for f in (f"{name}.case.json", f"{name}.plan.json.gz"):
        shutil.copy(src / f, cases / f)
    base = Path(__file__).resolve().parents[1] / "results" / "profiles" / "h200_offexec_v2.json"
    part = json.loads(base.read_text())
    key = layer_key(get_model("opt-6.7b"))
    part["op_times"] = part["op_times"] + [[key, "attn", f"decode_graph:{b}", [[128.0, 1e-5 * b], [2048.0, 1e-4 * b]]]
                                           for b in (1, 64)]
    pfile = tmp_path / "decode_attn.json"
    pfile.write_text(json.dumps(part))
    out = tmp_path / "out"
    assert PV.main(["--base", str(base), "--variant", f"decode_graph={pfile}", "--cases", str(cases),
                    "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "| base | 1 |" in md and "| decode_graph | 1 |" in md
    a = pd.read_csv(out / "validation_base.csv", comment="#")
    b = pd.read_csv(out / "validation_decode_graph.csv", comment="#")
    assert a.err_total_tok_s[0] != b.err_total_tok_s[0]  # the rows moved the prediction
    assert json.loads((out / "decode_graph.json").read_text())["op_times"][-1][2] == "decode_graph:64"
    with pytest.raises(SystemExit):
        PV.main(["--base", str(base), "--variant", "nofiles=", "--out", str(out)])
    assert "NAME=PART" in capsys.readouterr().err


def test_mixed_lengths_reach_the_tops_within_the_ranges():
    """matrix v2's mixed-length draw: each request's lengths within the ranges, the longest request at both tops
    (the lengths the settings were searched at), the same draw for the same seed."""
    import random

    from experiments.validation.matrix import mixed_lengths

    p, g = mixed_lengths(random.Random(3), 16, (128, 1024), (16, 64))
    assert len(p) == len(g) == 16 and max(p) == 1024 and max(g) == 64
    assert all(128 <= x <= 1024 for x in p) and all(16 <= x <= 64 for x in g)
    assert (p, g) == mixed_lengths(random.Random(3), 16, (128, 1024), (16, 64))
    with pytest.raises(ValueError, match="bad ranges"):
        mixed_lengths(random.Random(3), 4, (512, 128), (16, 64))


def test_mixed_config_split_is_its_seeds_and_its_cases_are_mixed():
    """The committed mixed-length extension of matrix v2: every case has per-request lengths (not all equal), its
    split is the one its seed gives, and no tag clashes with v2's."""
    import copy

    from experiments.validation.matrix import split_cases

    doc = json.loads((CASES / "matrix_v2_mixed_config.json").read_text())
    v2 = {c["tag"] for c in json.loads((CASES / "matrix_v2_config.json").read_text())["cases"]}
    for c in doc["cases"]:
        wl = c["workload"]
        assert c["tag"].endswith("_mixed") and c["tag"] not in v2
        assert len(set(wl["prompt_lens"])) > 1 or len(set(wl["gen_lens"])) > 1
        assert max(wl["prompt_lens"]) == wl["prompt_len"] and max(wl["gen_lens"]) == wl["gen_len"]
    redo = copy.deepcopy(doc["cases"])
    split_cases(redo, doc["seed"])
    assert {c["tag"]: c["split"] for c in redo} == {c["tag"]: c["split"] for c in doc["cases"]}


def test_matrix_runs_a_mixed_length_case_that_validate_reads(tmp_path):
    """A mixed-length case through the matrix on the CPU (tiny OPT, fp32): its case file lands in its split's
    folder with the per-request lengths, and `offsim validate` re-simulates it from its stored plan."""
    import dataclasses
    import subprocess
    import sys

    from offsim import Workload, get_model

    model = dataclasses.replace(get_model("opt-125m"), dtype_bytes=4)
    wl = Workload(32, 4, 2, 2, prompt_lens=(32, 9, 20, 5), gen_lens=(4, 2, 3, 4))
    case = {"tag": "opt-125m_flexgen_b1_p5-32_g2-4_mixed", "model": "opt-125m", "model_config": model.to_dict(),
            "policy": "flexgen", "settings": {"percent": [0, 100, 0, 100, 100, 0]}, "workload": wl.to_dict(),
            "gpu_mem_gb": 1, "split": "calib"}
    cfg = tmp_path / "mixed.json"
    cfg.write_text(json.dumps({"cases": [case]}))
    r = subprocess.run([sys.executable, "-m", "experiments.validation.matrix", "--config", str(cfg), "--out",
                        str(tmp_path / "v"), "--device", "cpu"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    f = tmp_path / "v" / "h200_calib" / f"{case['tag']}.case.json"
    c = V.load_case(f)
    assert tuple(c["meta"]["workload"]["prompt_lens"]) == wl.prompt_lens
    row = V.validate_case(c)
    assert row["plan"] == "stored" and math.isfinite(row["err_total_tok_s"])


def test_coverage_gaps_name_variants_measured_only_held_out():
    """The coverage extension's rule (``matrix.coverage_gaps``): a model and policy variant (FlexGen's GPU and CPU
    attention apart) that the configs hold only in the held-out set is a gap; one with a calibration case is not.
    The committed coverage config fills exactly the gaps of the two v2 configs, every case in the calibration set,
    no tag repeated."""
    from pathlib import Path

    from experiments.validation.matrix import VARIANTS, coverage_gaps

    def case(m, p, ca, split):
        return {"tag": f"{m}_{p}_{ca}_{split}", "model": m, "policy": p,
                "settings": {"cpu_attention": ca} if p == "flexgen" else {}, "split": split}

    doc = {"cases": [case("a", "flexgen", True, "calib"), case("a", "flexgen", False, "heldout"),
                     case("a", "tightllm", None, "heldout"), case("a", "tightllm", None, "calib"),
                     case("b", "selectn", None, "heldout")]}
    got = [(m, VARIANTS[v]) for m, v in coverage_gaps([doc])]
    assert got == [("a", ("flexgen", {"cpu_attention": False})), ("b", ("selectn", {}))]
    val = Path(__file__).parent.parent / "results" / "validation"
    if (val / "matrix_v2_coverage_config.json").exists():
        base = [json.loads((val / f).read_text()) for f in ("matrix_v2_config.json", "matrix_v2_mixed_config.json")]
        cov = json.loads((val / "matrix_v2_coverage_config.json").read_text())
        assert {c["split"] for c in cov["cases"]} == {"calib"}
        filled = {(c["model"], c["policy"], bool(c["settings"].get("cpu_attention"))) for c in cov["cases"]}
        want = {(m, VARIANTS[v][0], bool(VARIANTS[v][1].get("cpu_attention"))) for m, v in coverage_gaps(base)}
        assert filled == want
        assert coverage_gaps(base + [cov]) == []
        tags = [c["tag"] for d in base + [cov] for c in d["cases"]]
        assert len(set(tags)) == len(tags) - 1  # v2's one repeated draw (opt-13b_static-zero_b40_p512_g128) only


def test_gen_coverage_gaps_name_variants_held_out_at_longer_generations():
    """The generation-length coverage rule (``matrix.gen_coverage_gaps``): a model and policy variant whose longest
    held-out generation exceeds its longest calibration one is a gap at that held-out length; a variant without any
    calibration case is left to ``coverage_gaps``; one measured as long in calibration is none. The committed config,
    where there is one, fills exactly the gaps of the three configs before it, each at its gap's generation, all in
    the calibration set, no tag repeated, and leaves none."""
    from pathlib import Path

    from experiments.validation.matrix import VARIANTS, gen_coverage_gaps

    def case(m, p, gen, split):
        return {"tag": f"{m}_{p}_{gen}_{split}", "model": m, "policy": p, "settings": {}, "split": split,
                "workload": {"gen_len": gen}}

    doc = {"cases": [case("a", "tightllm", 32, "calib"), case("a", "tightllm", 128, "heldout"),
                     case("a", "tightllm", 64, "heldout"), case("a", "selectn", 128, "calib"),
                     case("a", "selectn", 64, "heldout"), case("b", "selectn", 128, "heldout")]}
    assert [(m, VARIANTS[v][0], g) for m, v, g in gen_coverage_gaps([doc])] == [("a", "tightllm", 128)]
    val = Path(__file__).parent.parent / "results" / "validation"
    if (val / "matrix_v2_gencoverage_config.json").exists():
        base = [json.loads((val / f).read_text()) for f in ("matrix_v2_config.json", "matrix_v2_mixed_config.json",
                                                             "matrix_v2_coverage_config.json")]
        cov = json.loads((val / "matrix_v2_gencoverage_config.json").read_text())
        assert {c["split"] for c in cov["cases"]} == {"calib"}
        filled = {(c["model"], c["policy"], bool(c["settings"].get("cpu_attention")), c["workload"]["gen_len"])
                  for c in cov["cases"]}
        want = {(m, VARIANTS[v][0], bool(VARIANTS[v][1].get("cpu_attention")), g)
                for m, v, g in gen_coverage_gaps(base)}
        assert filled == want
        assert gen_coverage_gaps(base + [cov]) == []
        tags = [c["tag"] for d in base + [cov] for c in d["cases"]]
        assert len(set(tags)) == len(tags) - 1  # v2's one repeated draw only
        held = {(c["model"], c["policy"], bool(c["settings"].get("cpu_attention")), c["workload"]["prompt_len"],
                 c["workload"]["gen_len"]) for d in base for c in d["cases"] if c["split"] == "heldout"}
        assert not any((c["model"], c["policy"], bool(c["settings"].get("cpu_attention")),
                        c["workload"]["prompt_len"], c["workload"]["gen_len"]) in held for c in cov["cases"])


def test_fresh_heldout_draw_repeats_nothing_and_holds_every_case_out(monkeypatch):
    """``matrix.plan_v2_fresh_heldout``: a few v2 draws per model, the policy variants in turn across the models,
    every case held out, none with a tag or a workload (model, variant, prompt, generation) of the configs before
    it (a repeat is redrawn). The committed draw, where there is one, says the same of the committed configs."""
    from pathlib import Path

    import experiments.validation.matrix as MX

    def fake_case(rng, mname, policy, fixed, profile, host_mem_gb, taken, gen=None):
        prompt = rng.choice((128, 256))
        tag = f"{mname}_{policy}{'-cpuattn' if fixed.get('cpu_attention') else ''}_p{prompt}_g32"
        if tag in taken:
            return None
        return {"tag": tag, "model": mname, "policy": policy, "settings": dict(fixed),
                "workload": {"prompt_len": prompt, "gen_len": 32}}

    monkeypatch.setattr(MX, "_v2_case", fake_case)
    monkeypatch.setattr(MX, "provenance", lambda: {})
    old = {"cases": [{"tag": "old", "model": "opt-13b", "policy": "static-zero", "settings": {}, "split": "calib",
                      "workload": {"prompt_len": 128, "gen_len": 32}}]}
    doc = MX.plan_v2_fresh_heldout(7, [old], "h200", 110.0, per_model=2)
    cases = doc["cases"]
    assert len(cases) == 2 * len(MX.V2_MODELS) and {c["split"] for c in cases} == {"heldout"}
    assert doc["splits"] == {"calib": 0, "heldout": len(cases)}
    assert len({c["tag"] for c in cases}) == len(cases)
    assert MX._workload_of(old["cases"][0]) not in {MX._workload_of(c) for c in cases}
    assert len({MX._variant(c) for c in cases}) == len(MX.VARIANTS)  # ten draws reach all six variants
    assert MX.plan_v2_fresh_heldout(7, [old], "h200", 110.0, per_model=2)["cases"] == cases  # seeded
    val = Path(__file__).parent.parent / "results" / "validation"
    if (val / "matrix_v2_fresh_heldout_config.json").exists():
        fresh = json.loads((val / "matrix_v2_fresh_heldout_config.json").read_text())["cases"]
        before = [c for f in ("matrix_v2_config.json", "matrix_v2_mixed_config.json", "matrix_v2_coverage_config.json",
                              "matrix_v2_gencoverage_config.json") for c in json.loads((val / f).read_text())["cases"]]
        assert {c["split"] for c in fresh} == {"heldout"}
        assert not {c["tag"] for c in fresh} & {c["tag"] for c in before}
        assert not {MX._workload_of(c) for c in fresh} & {MX._workload_of(c) for c in before}


def test_preregistered_prediction_builds_the_configs_plan():
    """``preregister.predict`` builds a case's plan as the GPU run will (the config's profile, the case's host memory)
    -- the fingerprint the config recorded -- and predicts it on profile v2, as ``offsim validate`` will."""
    from pathlib import Path

    from experiments.validation.preregister import predict

    val = Path(__file__).parent.parent / "results" / "validation"
    cfg = json.loads((val / "matrix_v2_coverage_config.json").read_text())
    case = next(c for c in cfg["cases"] if c["policy"] == "selectn")
    r = predict(case, cfg["profile"], str(val.parent / "profiles" / "h200_offexec_v2.json"))
    assert r["plan_is_the_configs"] and r["total_tok_s"] > 0 and r["decode_tok_s"] > r["total_tok_s"]


def test_validation_readme_sets_measured_coverage_cases_beside_their_registered_predictions(tmp_path, monkeypatch):
    """write_readme's table of the coverage cases measured so far: each against the prediction written before it was
    measured (error = registered / measured - 1) and today's model's error; nothing before any is measured."""
    import pandas as pd

    import experiments.validation.write_readme as W

    monkeypatch.setattr(W, "VAL", tmp_path)
    calib = pd.DataFrame({"case": ["a", "x"], "measured_total_tok_s": [100.0, 5.0], "err_total_tok_s": [0.02, 0.0]})
    assert W._preregistered(calib) == []  # no registered predictions
    (tmp_path / "coverage_predictions.json").write_text(json.dumps(
        {"provenance": {"commit": "abc1234", "date": "2026-12-04T14:41:44+00:00"},
         "cases": [{"case": "a", "total_tok_s": 110.0}, {"case": "b", "total_tok_s": 50.0},
                   {"case": "c", "error": "no fit"}]}))
    text = "\n".join(W._preregistered(calib))
    assert "1 of 3 coverage cases measured, median |total error| 10.0 %, max 10.0 %" in text
    assert "| a | 100.0 | 110.0 | +10.0% | +2.0% |" in text and "| b |" not in text
    assert W._preregistered(calib[calib["case"] == "x"]) == []  # none of them measured yet


def test_regime_coverage_gaps_name_placements_held_out_at_longer_generations():
    """The placement-regime coverage rule (``matrix.regime_coverage_gaps``): a policy variant and placement regime
    (weights on the GPU or not; KV on the GPU, split or off it) whose longest held-out generation exceeds its longest
    calibration one, or that has no calibration case, is a gap at that held-out length, across models; a policy
    without a placement has no regime. The committed config, where there is one, puts every case in the calibration
    set, each in a gap's regime at its generation, none a held-out workload, no tag repeated."""
    from pathlib import Path

    from experiments.validation.matrix import VARIANTS, placement_regime, regime_coverage_gaps

    def case(m, p, pct, gen, split):
        return {"tag": f"{m}_{p}_{gen}_{split}_{pct}", "model": m, "policy": p, "split": split,
                "settings": {} if pct is None else {"percent": pct}, "workload": {"gen_len": gen}}

    split_kv, stream = [100, 0, 90, 10, 100, 0], [20, 80, 0, 100, 100, 0]
    assert placement_regime(case("a", "tightllm", split_kv, 8, "calib")) == "weights on GPU, KV split"
    assert placement_regime(case("a", "tightllm", stream, 8, "calib")) == "weights offloaded, KV off GPU"
    assert placement_regime(case("a", "selectn", None, 8, "calib")) is None
    doc = {"cases": [case("a", "tightllm", split_kv, 32, "calib"), case("b", "tightllm", split_kv, 128, "heldout"),
                     case("a", "tightllm", stream, 128, "calib"), case("b", "tightllm", stream, 64, "heldout"),
                     case("a", "tightllm", [90, 10, 100, 0, 100, 0], 16, "heldout"),
                     case("a", "selectn", None, 128, "heldout")]}
    got = [(VARIANTS[v][0], reg, g) for v, reg, g in regime_coverage_gaps([doc])]
    assert got == [("tightllm", "weights offloaded, KV on GPU", 16), ("tightllm", "weights on GPU, KV split", 128)]
    val = Path(__file__).parent.parent / "results" / "validation"
    if (val / "matrix_v2_regime_coverage_config.json").exists():
        names = ("", "mixed_", "coverage_", "gencoverage_", "fresh_heldout_")
        base = [json.loads((val / f"matrix_v2_{n}config.json").read_text()) for n in names]
        cov = json.loads((val / "matrix_v2_regime_coverage_config.json").read_text())
        gaps = {(VARIANTS[v][0], reg, g) for v, reg, g in regime_coverage_gaps(base)}
        assert cov["cases"] and {c["split"] for c in cov["cases"]} == {"calib"}
        assert all((c["policy"], placement_regime(c), c["workload"]["gen_len"]) in gaps for c in cov["cases"])
        tags = [c["tag"] for d in base + [cov] for c in d["cases"]]
        assert len(set(tags)) == len(tags) - 1  # v2's one repeated draw only
        held = {(c["model"], c["policy"], c["workload"]["prompt_len"], c["workload"]["gen_len"])
                for d in base for c in d["cases"] if c["split"] == "heldout"}
        assert not any((c["model"], c["policy"], c["workload"]["prompt_len"], c["workload"]["gen_len"]) in held
                       for c in cov["cases"])
