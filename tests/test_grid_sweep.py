"""``offsim sweep`` (offsim/search/grid.py): the spec's checks, the points and their ids, a 20-point sweep on the local
Ray runtime that is interrupted and resumed without redoing answered points, per-point failures with their reason,
'error' points run again, the table with its provenance, and the Pareto front."""
import importlib
import json
import math
import socket

import numpy as np
import pandas as pd
import pytest

from offsim.analysis.pareto import fronts, pareto_front, plot_pareto
from offsim.cli import main
from offsim.core.errors import OffsimError
from offsim.core.specs import get_hardware
from offsim.search import grid

# 20 points: 5 prompt lengths x 2 budgets x 2 policies on OPT-1.3B; at 0.3 GiB nothing fits (one sequence needs
# 0.42 GiB on the GPU), so 10 points fail with that reason and 10 are answered
SPEC = {"name": "ci", "grid": {"model": ["opt-1.3b"], "hardware": ["t4"], "gpu_mem_gb": [0.3, 2],
                               "prompt_len": [8, 16, 32, 64, 128], "gen_len": [4],
                               "policy": ["static-zero", "static-accelerate"]}}


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---- the spec ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,message", [
    (lambda d: d["grid"].update(colour=["red"]), "unknown grid axes"),
    (lambda d: d["grid"].pop("model"), "grid needs"),
    (lambda d: d["grid"].update(policy=["flexgen", "magic"]), "unknown policy 'magic'"),
    (lambda d: d["grid"].update(model=["opt-999b"]), "opt-999b"),
    (lambda d: d["grid"].update(hardware=["t4", "no-such-gpu"]), "no-such-gpu"),
    (lambda d: d["grid"].update(prompt_len=[0]), "positive integers"),
    (lambda d: d["grid"].update(gpu_mem_gb=[-1]), "gpu_mem_gb"),
    (lambda d: d["grid"].update(prompt_len=[8, 8]), "twice"),
    (lambda d: d["grid"].update(batch=[4], gpu_batch_size=[4]), "not both"),
    (lambda d: d.update(settings={"static-zero": [{"kv_on_cpu": True}]}), "gpu_batch_size"),
    (lambda d: (d["grid"].update(gpu_batch_size=[4]), d.update(settings={"static-zero": [{"percent": 5}]})),
     "unknown settings"),
    (lambda d: d.update(seed=3), "unknown keys"),
])
def test_spec_checks_name_the_problem(change, message):
    d = json.loads(json.dumps(SPEC))
    change(d)
    with pytest.raises(OffsimError, match=message):
        grid.parse_spec(d)


def test_points_modes_and_ids(tmp_path):
    spec = grid.parse_spec(SPEC)
    pts = grid.expand(spec)
    assert spec.mode == "search" and len(pts) == 20 and len({p["point_id"] for p in pts}) == 20
    # an id depends on the point, not on the grid around it: a smaller grid finds the same ids
    small = json.loads(json.dumps(SPEC))
    small["grid"]["prompt_len"] = [32]
    assert {p["point_id"] for p in grid.expand(grid.parse_spec(small))} < {p["point_id"] for p in pts}
    # fixed plans: one point per settings dict of the point's policy; the search options do not enter their ids
    fixed = {"grid": {**SPEC["grid"], "gpu_batch_size": [2, 4]},
             "settings": {"static-zero": [{"kv_on_cpu": False}, {"kv_on_cpu": True}]}, "max_sims": 7}
    f = grid.parse_spec(fixed)
    assert f.mode == "settings" and len(grid.expand(f)) == 20 * 2 + 20
    p = tmp_path / "s.yaml"
    p.write_text("name: y\ngrid:\n  model: opt-125m\n  hardware: [t4]\n  prompt_len: [8]\n  gen_len: [2]\n"
                 "  policy: [flexgen]\n  batch: [1, 2]\n")
    y = grid.load_spec(p)
    assert y.mode == "batch" and len(grid.expand(y)) == 2 and y.grid["model"] == ["opt-125m"]
    # YAML 1.2's floats: PyYAML alone (YAML 1.1) reads 1.6e1 as the text '1.6e1', refused as not a budget
    p.write_text("name: y\ngrid:\n  model: opt-125m\n  hardware: [t4]\n  gpu_mem_gb: [1.6e1, 8]\n"
                 "  prompt_len: [8]\n  gen_len: [2]\n  policy: [flexgen]\n  batch: [1]\n")
    assert grid.load_spec(p).grid["gpu_mem_gb"] == [16.0, 8]
    # ... its integers (010 is ten, not eight) and its unique keys (the first of two was dropped in silence)
    p.write_text(p.read_text().replace("gen_len: [2]", "gen_len: [010]"))
    assert grid.load_spec(p).grid["gen_len"] == [10]
    p.write_text(p.read_text() + "grid: {}\n")
    with pytest.raises(OffsimError, match="key 'grid' is given twice"):
        grid.load_spec(p)
    j = tmp_path / "s.json"
    j.write_text('{"name": "a", "name": "b", "grid": {}}')
    with pytest.raises(OffsimError, match="key 'name' is given twice"):
        grid.load_spec(j)
    p.write_text("grid: [unclosed")
    with pytest.raises(OffsimError, match="not valid YAML"):
        grid.load_spec(p)


def test_cli_bad_spec_exits_2_before_ray(capsys, tmp_path):
    err = _one_line_error(capsys, ["sweep", str(tmp_path / "missing.json")])
    assert "cannot read sweep spec" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"grid": {**SPEC["grid"], "model": ["opt-1.3b", "gpt-7"]}}))
    assert "gpt-7" in _one_line_error(capsys, ["sweep", str(bad)])
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(SPEC))
    with socket.socket() as s:  # a port nothing listens on: refused at once, where ray.init retries for minutes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = _one_line_error(capsys, ["sweep", str(ok), "--out", str(tmp_path / "a" / "b"), "--address",
                                   f"127.0.0.1:{port}"])
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in err and not (tmp_path / "a").exists()
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00")
    assert "not text (not UTF-8)" in _one_line_error(capsys, ["sweep", str(binary)])
    named = tmp_path / "named.json"
    named.write_text(json.dumps({**SPEC, "name": "../../escape"}))
    assert "name '../../escape'" in _one_line_error(capsys, ["sweep", str(named)])


def test_point_ids_follow_what_the_files_hold(tmp_path):
    """A point's id covers its model's and hardware's contents: a resumed sweep whose profile file was edited runs
    its points again instead of reusing answers of the old profile; 8 and 8.0 GiB are one budget."""
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps(get_hardware("t4").to_dict()))
    spec = {"grid": {**SPEC["grid"], "hardware": [str(prof)], "gpu_mem_gb": [2]}}
    before = [p["point_id"] for p in grid.expand(grid.parse_spec(spec))]
    assert before == [p["point_id"] for p in grid.expand(grid.parse_spec(spec))]  # stable
    slower = get_hardware("t4").to_dict()
    slower["h2d_pinned"] = [[size, rate / 10] for size, rate in slower["h2d_pinned"]]
    prof.write_text(json.dumps(slower))
    after = [p["point_id"] for p in grid.expand(grid.parse_spec(spec))]
    assert not set(before) & set(after)
    as_float = {"grid": {**spec["grid"], "gpu_mem_gb": [2.0]}}
    assert [p["point_id"] for p in grid.expand(grid.parse_spec(as_float))] == after
    with pytest.raises(OffsimError, match="twice"):
        grid.parse_spec({"grid": {**spec["grid"], "gpu_mem_gb": [2, 2.0]}})


def test_journal_lines_are_strict_json(tmp_path):
    """gen_len 1 has no decode step: its decode rate is written as null, not Infinity (which strict JSON lacks)."""
    j = grid._Journal(tmp_path / grid.JOURNAL)
    j.write({"point_id": "a", "status": "ok", "decode_tok_s": math.inf, "x": [math.nan, 1.0]})
    j.close()
    row = json.loads((tmp_path / grid.JOURNAL).read_text(), parse_constant=lambda c: pytest.fail(c))
    assert row["decode_tok_s"] is None and row["x"] == [None, 1.0]


def test_evaluate_point_statuses(monkeypatch):
    spec = grid.parse_spec(SPEC)
    models, hws = grid.resolve(spec)
    pts = grid.expand(spec)
    ok = next(p for p in pts if p["gpu_mem_gb"] == 2)
    r = grid.evaluate_point(ok, models[ok["model"]], hws[(ok["hardware"], ok["gpu_mem_gb"])])
    assert r["status"] == "ok" and r["total_tok_s"] > 0 and r["prompts"] >= 1 and r["commit"]
    assert r["ttft_s"] == r["prefill_s"] and json.loads(r["settings"]) is not None
    no = next(p for p in pts if p["gpu_mem_gb"] == 0.3)
    r = grid.evaluate_point(no, models[no["model"]], hws[(no["hardware"], 0.3)])
    assert r["status"] == "failed" and "GPU memory" in r["reason"] and math.isnan(r.get("total_tok_s", math.nan))
    S = importlib.import_module("offsim.search.search")  # (the package's `search` attribute is the function)
    monkeypatch.setattr(S, "search", lambda *a, **k: 1 / 0)  # a bug: recorded, not raised
    r = grid.evaluate_point(ok, models[ok["model"]], hws[(ok["hardware"], 2)])
    assert r["status"] == "error" and r["reason"].startswith("ZeroDivisionError")


# ---- on Ray ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    """One local Ray runtime (2 CPUs, no dashboard, no worker logs) for the module; run_sweep uses it as it is."""
    ray, started, _ = grid.start_ray(workers=2)
    yield ray
    if started:
        ray.shutdown()


def test_sweep_on_ray_interrupted_and_resumed(local_ray, tmp_path, capsys):
    spec = grid.parse_spec(SPEC)
    out = tmp_path / "sweep"
    first = grid.run_sweep(spec, out, workers=2, max_points=8, log=None)  # stops after 8: an interrupted run
    assert (first["ran"], first["skipped"], first["unanswered"]) == (8, 0, 12)
    journal = out / grid.JOURNAL
    before, _ = grid.read_journal(journal)
    assert len(before) == 8
    # a run killed while writing leaves a line cut short; and a point that broke ('error') is run again
    broken = next(p for p in grid.expand(spec) if p["point_id"] not in before)
    with open(journal, "a") as f:
        f.write(json.dumps({"point_id": broken["point_id"], "status": "error", "reason": "worker died"}) + "\n")
        f.write('{"point_id": "0123", "stat')
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC))
    rc = main(["sweep", str(spec_file), "--out", str(out), "--workers", "2", "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    js = json.loads(cap.out.strip().splitlines()[-1])
    assert (js["points"], js["skipped"], js["ran"], js["unanswered"]) == (20, 8, 12, 0)
    assert (js["ok"], js["failed"], js["error"]) == (10, 10, 0)
    after, bad = grid.read_journal(journal)
    assert bad == 1 and len(after) == 20
    for pid, row in before.items():  # answered points were not redone: the very same rows
        assert after[pid] == row
    assert after[broken["point_id"]]["status"] in grid.FINAL
    assert len(journal.read_text().splitlines()) == 8 + 2 + 12
    # the table: every point once, provenance on the first line, the reason of each failure
    header, df = grid.read_table(out)
    assert header["schema"] == grid.SCHEMA and header["provenance"]["commit"] and header["runs"] == 2
    assert header["spec"]["grid"] == spec.grid
    assert len(df) == 20 and df["point_id"].is_unique
    failed = df[df["status"] == "failed"]
    assert len(failed) == 10 and (failed["gpu_mem_gb"] == 0.3).all()
    assert failed["reason"].str.contains("GPU memory: even one sequence needs").all()
    ok = df[df["status"] == "ok"]
    assert (ok["total_tok_s"] > 0).all() and (ok["prompts"] >= 1).all() and ok["worker"].notna().all()
    runs = json.loads((out / grid.RUNS).read_text())["runs"]
    assert [r["ran"] for r in runs] == [8, 12] and runs[1]["skipped"] == 8
    assert (out / "pareto.png").stat().st_size > 0
    # a third run has nothing to do and starts no task
    third = grid.run_sweep(spec, out, workers=2, log=None)
    assert (third["ran"], third["skipped"], third["workers"]) == (0, 20, None)


def test_device_scaling_report_of_two_worker_counts(local_ray, tmp_path):
    """experiments/sweeps/device_scaling.py (the GPU host's 16-vs-1 worker measurement): the same first points run
    with 1 and 2 workers in w1/ and w2/, tabulated -- points/s, speed-up over the fewest workers, identical tables
    (a differing table is said so)."""
    from experiments.sweeps import device_scaling as D

    spec = grid.parse_spec(SPEC)
    for w in (1, 2):
        grid.run_sweep(spec, tmp_path / f"w{w}", workers=w, max_points=4, log=None)
    (tmp_path / "env.log").write_text("ray x | 2 CPUs\n")
    res = D.write(tmp_path)
    assert res["workers"] == [1, 2] and res["tables_identical"] is True
    df = pd.read_csv(tmp_path / "scaling.csv", comment="#")
    assert list(df["points_answered"]) == [4, 4] and df["speedup"].iloc[0] == 1.0
    assert (df["points_per_s"] > 0).all()
    readme = (tmp_path / "README.md").read_text()
    assert "`ray x | 2 CPUs`" in readme and "| 2 | 4 |" in readme
    # a table that differs from the fewest workers' is reported as such
    csv = tmp_path / "w2" / grid.TABLE_CSV
    text = csv.read_text().splitlines()
    i = next(n for n, ln in enumerate(text) if ",ok," in ln or ",failed," in ln)
    text[i] = text[i].replace(",ok,", ",_,", 1).replace(",failed,", ",ok,", 1).replace(",_,", ",failed,", 1)
    csv.write_text("\n".join(text) + "\n")
    assert D.write(tmp_path)["tables_identical"] is False
    assert "| NO |" in (tmp_path / "README.md").read_text()


# ---- the Pareto front -------------------------------------------------------------------------------------------
def test_pareto_front():
    x = [1.0, 2.0, 2.0, 3.0, 0.5, 4.0]
    y = [10, 20, 15, 20, 5, 30]
    assert pareto_front(x, y).tolist() == [True, True, False, False, True, True]
    df = pd.DataFrame({"model": "m", "hardware": "h", "policy": ["a", "a", "b", "b"], "status": "ok",
                       "total_s": [1.0, 2.0, 1.0, 2.0], "total_tok_s": [5.0, 4.0, 1.0, 3.0]})
    f = fronts(df)
    assert f["on_front"].tolist() == [True, False, True, True]
    fig = plot_pareto(pd.concat([df, df.assign(status="failed", total_tok_s=np.nan)]))
    assert len(fig.axes) == 1
    # different workloads never beat one another: a short prompt's fast point leaves the long prompt's on its front
    w = pd.DataFrame({"model": "m", "hardware": "h", "policy": "a", "status": "ok", "gen_len": 32,
                      "prompt_len": [128, 2048, 2048], "total_s": [1.0, 5.0, 6.0], "total_tok_s": [50.0, 9.0, 8.0]})
    assert fronts(w)["on_front"].tolist() == [True, True, False]
    assert len([a for a in plot_pareto(w).axes if a.get_visible()]) == 2


def test_table_files(tmp_path):
    """sweep.csv always (provenance on its first line); sweep.parquet with the same header only with pyarrow, and
    a stale one removed without it."""
    df = pd.DataFrame([{"point_id": "a1", "model": "m", "status": "ok", "total_tok_s": 2.5},
                       {"point_id": "b2", "model": "m", "status": "failed", "reason": "does not fit"}]
                      ).reindex(columns=list(grid.COLUMNS))
    header = {"schema": grid.SCHEMA, "provenance": {"commit": "abc"}}
    paths = grid.write_table(df, tmp_path, header)
    h, back = grid.read_table(tmp_path)
    assert h == header and back["status"].tolist() == ["ok", "failed"] and list(back.columns) == list(grid.COLUMNS)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert paths == [tmp_path / grid.TABLE_CSV]
        (tmp_path / grid.TABLE_PARQUET).write_text("stale")
        grid.write_table(df, tmp_path, header)
        assert not (tmp_path / grid.TABLE_PARQUET).exists()
        return
    assert paths[1] == tmp_path / grid.TABLE_PARQUET
    h, back = grid.read_table(paths[1])
    assert h == header and back["reason"].tolist()[1] == "does not fit"


def test_fixed_settings_row_records_the_settings_that_ran():
    """A fixed plan whose spec leaves settings to the policy ({} for TightLLM) records what the plan ran with."""
    spec = grid.parse_spec({"grid": {"model": ["opt-125m"], "hardware": ["t4"], "gpu_mem_gb": [2], "prompt_len": [8],
                                     "gen_len": [2], "policy": ["tightllm"], "gpu_batch_size": [2]},
                            "settings": {"tightllm": [{}]}})
    models, hws = grid.resolve(spec)
    (p,) = grid.expand(spec)
    r = grid.evaluate_point(p, models[p["model"]], hws[(p["hardware"], p["gpu_mem_gb"])])
    assert r["status"] == "ok" and json.loads(r["settings"]).get("percent"), r["settings"]


def test_interrupted_sweep_plots_what_is_done(local_ray, tmp_path, monkeypatch, capsys):
    """Ctrl-C: the table of the points answered so far and the Pareto plot drawn from it, exit 130."""
    real = grid.run_sweep

    def interrupted(spec, out, **kw):
        real(spec, out, workers=2, max_points=3, log=None)
        raise KeyboardInterrupt

    monkeypatch.setattr(grid, "run_sweep", interrupted)
    p = tmp_path / "s.json"
    p.write_text(json.dumps(SPEC))
    assert main(["sweep", str(p), "--out", str(tmp_path / "o"), "--no-progress"]) == 130
    assert (tmp_path / "o" / "pareto.png").stat().st_size > 0 and len(grid.read_table(tmp_path / "o")[1]) == 3
