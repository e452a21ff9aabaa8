"""offsim.analysis and offsim.search.sweep: what the notebooks compute (sweeps, LP placements, TightLLM's balance, timelines, results loading).

Real sizes where it is cheap (OPT-1.3B on a T4 with a 2 GiB budget simulates in tens of milliseconds); hand-made
traces where the expected answer must be known exactly.
"""
from __future__ import annotations

import dataclasses
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from offsim import POLICIES, OffsimError, Trace, Workload, build_plan, get_hardware, get_model, simulate  # noqa: E402
from offsim.analysis import validate as V  # noqa: E402
from offsim.analysis import decisions  # noqa: E402
from offsim.analysis import plots  # noqa: E402
from offsim.analysis import results  # noqa: E402
from offsim.search import sweep  # noqa: E402
from offsim.analysis import timeline  # noqa: E402
from offsim.core.provenance import write_csv  # noqa: E402


@pytest.fixture(scope="module")
def opt13():
    return get_model("opt-1.3b")


@pytest.fixture(scope="module")
def t4_2g():
    return get_hardware("t4", 2)


def _trace(rows, steps=None) -> Trace:
    """A hand-made trace: rows of (stream, kind, step, start_s, end_s)."""
    df = pd.DataFrame([{"op_id": i, "kind": k, "stream": s, "phase": "decode" if st else "prefill", "step": st,
                        "layer": 0, "batch": 0, "start_s": a, "end_s": b, "nbytes": 0}
                       for i, (s, k, st, a, b) in enumerate(rows)])
    return Trace(df=df, meta={"workload": {"prompt_len": 8, "gen_len": 2, "gpu_batch_size": 1, "num_gpu_batches": 1}})


# ---- results files ---------------------------------------------------------------------------------------------
def test_read_results_csv_round_trip(tmp_path):
    df = pd.DataFrame({"a": [1, 2], "b": ["x", "y"]})
    write_csv(df, tmp_path / "r.csv", {"commit": "abc", "date": "today"})
    prov, back = results.read_results_csv(tmp_path / "r.csv")
    assert prov == {"commit": "abc", "date": "today"}
    pd.testing.assert_frame_equal(back, df)
    (tmp_path / "plain.csv").write_text("a,b\n1,x\n")  # no provenance line: read as a plain CSV
    prov, back = results.read_results_csv(tmp_path / "plain.csv")
    assert prov == {} and list(back.columns) == ["a", "b"] and len(back) == 1


def test_read_results_csv_bad_input(tmp_path):
    (tmp_path / "bad.csv").write_text("# {not json\na\n1\n")
    with pytest.raises(OffsimError, match="provenance JSON"):
        results.read_results_csv(tmp_path / "bad.csv")
    with pytest.raises(OffsimError, match="cannot read"):
        results.read_results_csv(tmp_path / "missing.csv")


def test_inventory_and_results_dir(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "results" / "a").mkdir(parents=True)
    (tmp_path / "results" / "a" / "x.csv").write_text("a\n1\n")
    (tmp_path / "results" / "a" / "README.md").write_text("hi")
    (tmp_path / "notebooks").mkdir()
    assert results.results_dir(tmp_path / "notebooks") == tmp_path / "results"
    inv = results.inventory(tmp_path / "results", ["a", "b"]).set_index("folder")
    assert inv.loc["results/a", "csv"] == 1 and inv.loc["results/a", "readme"]
    assert not inv.loc["results/b", "present"] and inv.loc["results/b", "files"] == 0


# ---- timelines ---------------------------------------------------------------------------------------------------
def test_idle_gaps_and_step_summary():
    tr = _trace([("compute", "compute", 1, 0.0, 1.0), ("h2d", "h2d", 1, 0.0, 4.0),
                 ("compute", "compute", 1, 2.0, 2.5), ("compute", "compute", 1, 2.25, 3.0)])  # overlaps merge
    assert timeline.idle_gaps(tr, 0.0, 4.0) == [(1.0, 2.0), (3.0, 4.0)]
    assert timeline.idle_gaps(tr, 0.5, 2.1) == [(1.0, 2.0)]
    s = timeline.step_summary(tr, 1)
    assert s["step_s"] == 4.0 and s["gpu_idle_s"] == pytest.approx(2.0) and s["gpu_idle_frac"] == pytest.approx(0.5)
    assert s["busy_h2d_s"] == 4.0 and s["busy_compute_s"] == pytest.approx(2.25)  # op time, overlaps counted twice


def test_gantt_draws_each_op_and_the_gaps():
    tr = _trace([("compute", "compute", 0, 0.0, 1.0), ("compute", "compute", 1, 2.0, 3.0),
                 ("h2d", "h2d", 1, 1.0, 2.5), ("d2h", "d2h", 1, 3.0, 3.5)])
    fig, ax = plt.subplots()
    plots.gantt(tr, ax, step=1)
    bars = {c.get_label(): c for c in ax.collections}
    assert set(bars) == {"compute", "h2d", "d2h", "GPU idle"}
    assert len(bars["compute"].get_paths()) == 1  # step 0's compute is outside the window
    assert len(bars["GPU idle"].get_paths()) == 2  # idle [1, 2) and [3, 3.5) within step 1's window [1, 3.5]
    assert ax.get_xlim() == pytest.approx((0.0, 2500.0))  # ms
    with pytest.raises(OffsimError, match="no ops in step 7"):
        plots.gantt(tr, ax, step=7)
    plt.close(fig)


def test_gantt_overlay_of_a_real_plan(opt13, t4_2g):
    plan = build_plan("flexgen", opt13, t4_2g, Workload(128, 3, 4, 2), {"percent": (0, 100, 0, 100, 100, 0)})
    tr = simulate(plan, t4_2g)
    fig, ax = plt.subplots()
    plots.gantt_overlay(tr, tr, 1, ax)
    assert len(ax.get_yticks()) == 2 * len(plots.STREAMS)
    plt.close(fig)


# ---- sweeps ----------------------------------------------------------------------------------------------------
def test_throughput_sweep_matches_direct_simulation(opt13, t4_2g):
    df = sweep.throughput_sweep(opt13, t4_2g, ["static-zero", "flexgen"], prompt_lens=(128,), batches=(4, 16),
                                gen_len=3)
    assert len(df) == 4 and set(df.policy) == {"static-zero", "flexgen"}
    ok = df[df.error == ""]
    assert len(ok) >= 2
    for r in ok.itertuples():  # every row is the simulation of the settings it records
        pol = r.policy
        wl = Workload(128, 3, int(r.gpu_batch_size), int(r.num_gpu_batches))
        assert wl.num_prompts == r.batch
        m = simulate(build_plan(pol, opt13, t4_2g, wl, json.loads(r.settings)), t4_2g).metrics()
        assert m["total_tok_s"] == pytest.approx(r.total_tok_s)
    ax = plots.plot_sweep(df, x="batch")
    assert {l.get_label() for l in ax.get_lines()} <= {"static-zero", "flexgen"}
    plt.close("all")


def test_sweep_records_why_a_cell_does_not_fit(opt13, t4_2g):
    df = sweep.throughput_sweep(opt13, t4_2g, ["static-accelerate"], prompt_lens=(1024,), batches=(512,), gen_len=2)
    assert np.isnan(df.loc[0, "total_tok_s"])  # the columns exist even when no cell fits
    assert "does not fit 512 sequences" in df.loc[0, "error"]
    with pytest.raises(OffsimError, match="unknown policy"):
        sweep.policy_at_batch("nope", opt13, t4_2g, 128, 2, 1)


@pytest.mark.skipif("selectn" not in POLICIES, reason="selectn policy not installed")
def test_selectn_at_batch_keeps_the_most_layers_that_fit(opt13):
    hw = get_hardware("t4", 1.5)  # OPT-1.3B is ~2.4 GiB: some layers must be offloaded
    st, wl, tr = sweep.policy_at_batch("selectn", opt13, hw, 128, 2, 4)
    n = st["interval"]
    assert 1 <= n <= opt13.num_layers
    with pytest.raises(OffsimError):  # one more resident layer per run does not fit
        simulate(build_plan("selectn", opt13, hw, wl, {"interval": n + 1}), hw)


def test_lp_placements_are_fractions(opt13, t4_2g):
    df = sweep.lp_placements(opt13, t4_2g, 128, 3, [(4, 1), (4, 2, True), (4096, 16)])
    ok = df[df.feasible]
    assert len(ok) == 2 and not df.iloc[2]["feasible"]  # 65536 sequences do not fit anywhere
    for r in ok.itertuples():
        assert r.wg + r.wc + r.wd == pytest.approx(1, abs=1e-6)
        assert r.cg + r.cc + r.cd == pytest.approx(1, abs=1e-6)
        assert r.hg + r.hc == pytest.approx(1, abs=1e-6)
    assert bool(ok.iloc[1]["cpu_attention"]) and ok.iloc[1]["cg"] == pytest.approx(0, abs=1e-6)
    plots.plot_placement(df)
    plt.close("all")


@pytest.mark.skipif("tightllm" not in POLICIES, reason="tightllm policy not installed")
def test_tightllm_balance_picks_the_minimum_of_its_curve(opt13, t4_2g):
    st = {"percent": (0, 100, 0, 100, 100, 0)}
    wl = Workload(256, 3, 4, 2)
    bal, chosen = decisions.tightllm_balance(opt13, t4_2g, st, wl, 256)
    assert chosen in set(bal.n_r)
    best = bal.layer_s.min()
    assert bal.set_index("n_r").loc[chosen, "layer_s"] == pytest.approx(best, rel=1e-12)
    # recompute grows with N_r, the KV load shrinks
    assert bal.compute_s.iloc[-1] > bal.compute_s.iloc[0] and bal.h2d_s.iloc[-1] < bal.h2d_s.iloc[0]
    nr = decisions.tightllm_nr_vs_context(opt13, t4_2g, st, 4, 2, [64, 256])
    assert len(nr) == 4 and (nr.n_r <= nr.ctx_tokens).all()
    assert nr[(nr.ctx_tokens == 256) & (nr.batch_index == 0)].n_r.item() == chosen  # the plan's choice, same problem
    plots.plot_balance(bal, chosen)
    plt.close("all")


# ---- measured vs predicted ---------------------------------------------------------------------------------------
def test_resimulate_and_op_kind_errors(opt13, t4_2g, tmp_path):
    plan = build_plan("flexgen", opt13, t4_2g, Workload(128, 3, 4, 2), {"percent": (0, 100, 0, 100, 100, 0)})
    tr = simulate(plan, t4_2g)
    tr.meta.update({"settings": dict(plan.settings), "hardware": "t4", "gpu_mem_gb": 2})
    tr.to_csv(tmp_path / "x.trace.csv")
    back = Trace.from_csv(tmp_path / "x.trace.csv")
    assert results.find_traces(tmp_path) == [tmp_path / "x.trace.csv"]
    same = V.resimulate(back, t4_2g)
    e = results.op_kind_errors(back, same).set_index("kind")
    assert (e["mape"].fillna(0) < 1e-9).all() and (e["total_error"].abs() < 1e-9).all()
    # a slower link: the prediction for the h2d ops must move, and by the right sign
    slow = dataclasses.replace(t4_2g, h2d_pinned=tuple((x, y / 2) for x, y in t4_2g.h2d_pinned))
    e = results.op_kind_errors(back, V.resimulate(back, slow)).set_index("kind")
    assert e.loc["h2d", "total_error"] > 0.5 and e.loc["compute", "mape"] < 1e-9
    with pytest.raises(OffsimError, match="lacks"):
        V.resimulate(_trace([("compute", "compute", 0, 0.0, 1.0)]))


def test_offexec_runs_validation_long_and_error_table(tmp_path):
    doc = {"measured": {"prefill_tok_s": 100.0, "decode_tok_s": 10.0, "total_tok_s": 8.0},
           "predicted": {"prefill_tok_s": 110.0, "decode_tok_s": 9.0, "total_tok_s": 8.0},
           "policy": "flexgen", "model": "opt-1.3b", "budget_bytes": 2 << 30,
           "workload": {"prompt_len": 128, "gen_len": 3, "gpu_batch_size": 4, "num_gpu_batches": 2}}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a run"}))
    runs = results.load_offexec_runs(tmp_path, tmp_path / "absent")
    assert len(runs) == 3 and set(runs.batch) == {8} and runs.budget_GiB.iloc[0] == 2
    assert runs.set_index("phase").error.to_dict() == pytest.approx({"prefill": 0.1, "decode": -0.1, "total": 0.0})
    val = pd.DataFrame({"case": ["a", "b"], "policy": ["flexgen", "flexgen"], "measured_total_tok_s": [1.0, 2.0],
                        "predicted_total_tok_s": [1.1, 1.6], "measured_decode_tok_s": [1.0, 1.0],
                        "predicted_decode_tok_s": [1.0, 1.0]})
    long = results.validation_long(val)
    assert len(long) == 4 and set(long.phase) == {"total", "decode"}
    t = results.error_table(long).set_index("phase")
    assert t.loc["total", "max_abs_error"] == pytest.approx(0.2)
    assert t.loc["total", "median_abs_error"] == pytest.approx(0.15)
    assert t.loc["total", "mean_error"] == pytest.approx(-0.05)
    assert results.error_table(long.iloc[:0]).empty
    ax = plots.plot_pred_vs_measured(long)
    assert len(ax.collections) >= 2
    ax = plots.plot_pred_vs_measured(long.iloc[:0])  # empty: says so, no crash
    plt.close("all")


def test_plot_published_vs_simulated_annotates_ratios():
    df = pd.DataFrame({"cell": ["a", "b"], "published_tok_s": [1.0, 4.0], "predicted_tok_s": [2.0, 3.0]})
    ax = plots.plot_published_vs_simulated(df, "cell")
    assert [t.get_text() for t in ax.texts] == ["x2.00", "x0.75"]
    plt.close("all")


def test_gzipped_traces_cases_and_experiment_summaries(opt13, t4_2g, tmp_path):
    import gzip

    from offsim.analysis.validate import case_from_trace, save_case

    plan = build_plan("static-zero", opt13, t4_2g, Workload(128, 3, 4, 1), {})
    tr = simulate(plan, t4_2g)
    tr.meta.update({"settings": dict(plan.settings), "hardware": "t4", "gpu_mem_gb": 2})
    tr.to_csv(tmp_path / "t.csv")
    (tmp_path / "sub").mkdir()
    with open(tmp_path / "t.csv", "rb") as f, gzip.open(tmp_path / "sub" / "trace_x.csv.gz", "wb") as g:
        g.write(f.read())
    (tmp_path / "t.csv").unlink()
    (tmp_path / "broken.csv.gz").write_bytes(b"\x1f\x8b not gzip")  # skipped, not fatal
    assert results.find_traces(tmp_path) == [tmp_path / "sub" / "trace_x.csv.gz"]
    back = results.load_trace(tmp_path / "sub" / "trace_x.csv.gz")
    pd.testing.assert_frame_equal(back.df, tr.df, check_dtype=False)
    with pytest.raises(OffsimError, match="cannot decompress"):
        results.load_trace(tmp_path / "broken.csv.gz")
    # a case under any .json name is found by its schema; other JSON is not
    save_case(case_from_trace(tr), tmp_path / "sub" / "case_x.json")
    (tmp_path / "profile.json").write_text(json.dumps({"schema": "offsim.hardware/1"}))
    assert V.find_cases(tmp_path) == [tmp_path / "sub" / "case_x.json"]
    # an experiment's summary: {"model", "budget_gib", "runs": [{config, policy, workload, measured, predicted}]}
    wl = {"prompt_len": 128, "gen_len": 3, "gpu_batch_size": 4, "num_gpu_batches": 3}
    run = {"config": "a", "policy": "flexgen", "workload": wl,
           "measured": {"prefill_tok_s": 10.0, "decode_tok_s": 2.0, "total_tok_s": 1.0},
           "predicted": {"prefill_tok_s": 10.0, "decode_tok_s": 3.0, "total_tok_s": 1.5}}
    (tmp_path / "exp.json").write_text(json.dumps({"model": "opt-30b", "budget_gib": 16.0, "runs": [run, run]}))
    runs = results.load_offexec_runs(tmp_path)
    assert len(runs) == 6 and set(runs.model) == {"opt-30b"} and set(runs.config) == {"a"}
    assert set(runs.batch) == {12} and set(runs.budget_GiB) == {16.0}
    assert runs[runs.phase == "decode"].error.tolist() == pytest.approx([0.5, 0.5])
