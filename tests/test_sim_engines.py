"""The event-loop simulator and the compact plan rows against the SimPy reference (offsim/core/sim.py): identical
traces, peaks and errors for every policy, with host issue costs, page-cached disk, loaded (Op list) plans,
memory overflows and deadlocks; OpList behaves as the list of Op it stands for."""
import copy
import dataclasses
import pickle

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offsim import Plan, Workload, build_plan, get_hardware
from offsim.core.errors import OffsimError
from offsim.core.plan import Op, OpList, PlanBuilder
from offsim.core.sim import simulate, simulate_simpy
from offsim.policies import POLICIES, get_policy


def same(plan, hw, check_memory=True):
    """Both engines on ``plan``: the same trace frame (exactly), peaks and metadata, or the same error."""
    out = []
    for engine in (simulate, simulate_simpy):
        try:
            out.append(engine(plan, hw, check_memory))
        except OffsimError as e:
            out.append(str(e))
    a, b = out
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return a
    pd.testing.assert_frame_equal(a.df, b.df, check_exact=True)
    assert a.peak_bytes == b.peak_bytes and a.meta == b.meta
    return a


def test_every_policy_and_candidate(tiny_opt, tiny_llama, t4):
    """All five policies, their first candidates, on OPT and Llama, on a T4 and on a profile with host issue costs
    (issue_compute_s/issue_copy_s: every op also waits for its issue) and page-cached disk rates."""
    slow_host = dataclasses.replace(t4, name="t4-issue", issue_compute_s=3e-5, issue_copy_s=1e-5,
                                    disk_cached_read_bytes_per_s=4e9, disk_cached_write_bytes_per_s=2e9)
    n = 0
    for m in (tiny_opt, tiny_llama):
        for name in POLICIES:
            for st_, wl, _ in list(get_policy(name).candidates(m, t4, 8, 4, None))[:3]:
                for hw in (t4, slow_host):
                    plan = build_plan(name, m, hw, wl.with_(gen_len=4), st_)
                    same(plan, hw)
                    if hw is slow_host:
                        plan.disk_cached = True
                        same(plan, hw)
                    n += 1
    assert n >= 20


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pct=st.sampled_from([(100, 0, 100, 0, 100, 0), (0, 100, 0, 100, 100, 0), (20, 80, 0, 100, 0, 100),
                            (0, 50, 0, 50, 100, 0), (0, 30, 0, 40, 0, 100), (50, 50, 50, 50, 100, 0)]),
       gbs=st.integers(1, 4), nb=st.integers(1, 3), prompt=st.integers(1, 12), gen=st.integers(1, 5),
       cpu_att=st.booleans(), overlap=st.booleans())
def test_flexgen_plans_identical(tiny_opt, small_gpu_t4, pct, gbs, nb, prompt, gen, cpu_att, overlap):
    """FlexGen plans over placements (disk tiers included: duplex and disk contention), block shapes and lengths;
    also with memory checks off, where the peaks are still reported."""
    if cpu_att and pct[2]:
        return
    plan = build_plan("flexgen", tiny_opt, small_gpu_t4, Workload(prompt, gen, gbs, nb),
                      {"percent": pct, "cpu_attention": cpu_att, "overlap": overlap})
    same(plan, small_gpu_t4)
    same(plan, small_gpu_t4, check_memory=False)


def test_loaded_plan_memory_overflow_and_deadlock(tiny_opt, t4, tmp_path):
    plan = build_plan("flexgen", tiny_opt, t4, Workload(8, 4, 2, 2), {"percent": (0, 50, 0, 50, 100, 0)})
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")  # a list of Op (not builder rows): the other input path
    assert isinstance(loaded.ops, list)
    a, b = same(plan, t4), same(loaded, t4)
    pd.testing.assert_frame_equal(a.df, b.df, check_exact=True)
    # a tier that overflows under the simulated timing: the same op, instant and shortfall in both
    squeezed = dataclasses.replace(plan, capacity={**plan.capacity, "gpu": plan.resident["gpu"] + 1})
    msg = same(squeezed, t4)
    assert isinstance(msg, str) and "over the capacity" in msg
    # an op that waits on one behind it on its own stream never runs
    first_h2d, later_h2d = [o.id for o in loaded.ops if o.kind == "h2d"][:2]
    loaded.ops[first_h2d].deps = (later_h2d,)
    msg = same(loaded, t4)
    assert isinstance(msg, str) and "deadlock" in msg


def test_oplist_is_the_list_of_ops(tiny_opt, t4):
    """Rows until an Op is asked for; then the Op list, whose edits stick; equal to what Op(...) makes; pickles."""
    plan = build_plan("flexgen", tiny_opt, t4, Workload(8, 4, 2, 2), {"percent": (0, 50, 0, 50, 100, 0)})
    ops = plan.ops
    assert isinstance(ops, OpList) and ops.rows is not None
    n = len(ops)
    back = pickle.loads(pickle.dumps(plan))
    assert back.ops == ops and back.fingerprint() == plan.fingerprint()
    fp_rows = plan.fingerprint()
    first = ops[0]  # makes the Op list
    assert ops.rows is None and len(ops) == n and ops[0] is first
    assert first == Op(first.id, first.kind, first.deps, first.phase, first.step, first.layer, first.batch,
                       first.stream, **{f: getattr(first, f) for f in ("tensor", "lo", "hi", "nbytes", "alloc")})
    assert plan.fingerprint() == fp_rows  # the same plan read from rows or from Op objects
    ops[0].nbytes += 1  # an edit sticks
    assert plan.ops[0].nbytes == first.nbytes and plan.fingerprint() != fp_rows
    assert copy.deepcopy(plan).ops == plan.ops


def test_builder_keeps_add_semantics():
    b = PlanBuilder(serial=True)
    assert b.add("compute", [None], "prefill", 0, 0, 0, part="layer", num_seqs=1, q_tokens=1, ctx_tokens=1) == 0
    assert b.add("h2d", iter([None, 0, 0]), "prefill", 0, 0, 0, tensor="weight", lo=0, hi=8, nbytes=8) == 1
    assert b.add("d2h", (), "prefill", 0, 0, 0, tensor="hidden", lo=0, hi=1, nbytes=2, stream="h2d") == 2
    assert [o.deps for o in b.ops] == [(), (0,), (1,)]  # Nones dropped, duplicates merged, serial chain
    assert b.ops[2].stream == "h2d"  # an explicit stream is kept (and refused by validate)
    assert b.add("h2d", [2], "prefill", 0, 0, 0, tensor="weight", lo=0, hi=8, nbytes=8) == 3  # after the Ops exist
    assert b.ops[3].deps == (2,) and b.ops[3].id == 3
    with pytest.raises(TypeError, match="unknown fields"):
        PlanBuilder().add("h2d", [], "prefill", 0, 0, 0, colour="red")
    with pytest.raises(KeyError):
        PlanBuilder().add("teleport", [], "prefill", 0, 0, 0)


def test_large_plan_identical():
    """OPT-30B, FlexGen's published T4 policy (33,744 ops): CPU attention, disk, duplex."""
    hw = get_hardware("t4")
    from offsim import get_model

    plan = build_plan("flexgen", get_model("opt-30b"), hw, Workload(512, 8, 48, 3),
                      {"percent": (20, 80, 0, 100, 0, 100), "cpu_attention": True}, validate=False,
                      check_fits=False)  # (the published policy is over the T4 by offexec's footprint)
    same(plan, hw, check_memory=False)


@pytest.mark.parametrize("cpu_attention", [False, True])
def test_graphed_decode_ops_issue_at_the_graph_cost(tiny_opt, t4, cpu_attention):
    """With ``Plan.cuda_graphs`` (the default) a one-token decode op of a graphed part is issued at the profile's
    ``issue_graph_s``, every other op at its kind's cost; off, or with no graph cost measured, everything at the
    eager costs. Both engines agree in every case."""
    from offsim.core import costmodel

    hw = dataclasses.replace(t4, issue_compute_s=2e-3, issue_copy_s=1e-4, issue_graph_s=1e-4)
    st = {"percent": (100, 0, 0, 100, 100, 0), "cpu_attention": cpu_attention}
    plan = build_plan("flexgen", tiny_opt, hw, Workload(8, 6, 2, 2), st)
    graphed = [o for o in plan.ops if costmodel.graphed(o.kind, o.part, o.q_tokens, o.phase)]
    assert graphed and all(o.step > 0 for o in graphed)  # decode only: prefill has the whole prompt per op
    totals = {}
    for graphs, h in ((True, hw), (False, hw), (True, dataclasses.replace(hw, issue_graph_s=0.0))):
        plan.cuda_graphs = graphs
        same(plan, h)
        totals[(graphs, h.issue_graph_s)] = simulate(plan, h).metrics()["total_s"]
    eager = totals[(False, 1e-4)]
    # the plan is host-bound at 2 ms an op: the graphed run saves about what its graphed ops' issue saved
    assert totals[(True, 1e-4)] < eager - 0.5 * len(graphed) * (2e-3 - 1e-4)
    assert totals[(True, 0.0)] == eager


@pytest.mark.parametrize("costs", [False, True])
def test_run_ahead_window_is_modelled_alike_in_both_engines(tiny_opt, t4, costs):
    """``Plan.run_ahead`` (offexec's flow control): before issuing an op the runtime waits for the op that many
    places earlier on its stream to finish, and issuing is one thread in plan order. Both engines model it alike,
    with and without issue costs; no op starts before it could have been issued (its window predecessor ended);
    a narrower window is never faster; None is the unbounded host of before."""
    from offsim.core.sim import _window_preds

    hw = dataclasses.replace(t4, issue_compute_s=2e-4, issue_copy_s=5e-5) if costs else t4
    plan = build_plan("flexgen", tiny_opt, hw, Workload(16, 6, 2, 3), {"percent": (0, 100, 0, 100, 100, 0)})
    totals = {}
    for ra in (None, (16, 6, 16), (2, 1, 2), (1, 1, 1)):
        plan.run_ahead = ra
        tr = same(plan, hw)
        df = tr.df
        totals[ra] = tr.metrics()["total_s"]
        preds = _window_preds(ra, [o.stream for o in plan.ops])
        if preds is not None:
            for i, p in enumerate(preds):
                if p >= 0:
                    assert df.at[i, "start_s"] >= df.at[p, "end_s"]
    assert totals[None] <= totals[(16, 6, 16)] <= totals[(2, 1, 2)] <= totals[(1, 1, 1)]
    assert totals[(1, 1, 1)] > totals[None]  # one op in flight per stream: the copies no longer run ahead


def test_run_ahead_round_trips_and_old_plans_had_offexecs_window(tiny_opt, t4):
    from offsim.core.plan import RUN_AHEAD_OPS, PlanError

    plan = build_plan("flexgen", tiny_opt, t4, Workload(8, 3, 2, 1), {"percent": (100, 0, 100, 0, 100, 0)})
    assert plan.run_ahead == RUN_AHEAD_OPS
    for ra in (None, (3, 2, 1)):
        plan.run_ahead = ra
        assert Plan.from_dict(plan.to_dict()).run_ahead == ra
    d = plan.to_dict()
    del d["run_ahead"]  # a plan saved before the field: offexec ran it with its window
    assert Plan.from_dict(d).run_ahead == RUN_AHEAD_OPS
    for bad in ([0, 1, 1], [1, 2], "16"):
        d["run_ahead"] = bad
        with pytest.raises(PlanError, match="run_ahead"):
            Plan.from_dict(d).validate()


def test_stream_order_issue_switch(tiny_opt, t4, monkeypatch):
    """``sim.STREAM_ORDER_ISSUE`` (on by default): the issuer takes each stream's ops in plan order and an op only
    once its dependencies are issued and its host dependencies done, as offexec's issuing loop does. Without host
    ops that is plan order (the same trace as the switch off); with CPU attention the ops behind each CPU op are
    issued after it, and no GPU op starts before a host op it depends on has ended. Both engines, identical traces,
    either way."""
    from offsim.core import sim as S

    hw = dataclasses.replace(t4, issue_compute_s=2e-4, issue_copy_s=5e-5)
    gpu = build_plan("flexgen", tiny_opt, hw, Workload(16, 4, 2, 3), {"percent": (0, 100, 0, 100, 100, 0)})
    cpu = build_plan("flexgen", tiny_opt, hw, Workload(16, 4, 2, 3),
                     {"percent": (0, 100, 0, 100, 100, 0), "cpu_attention": True})
    for plan in (gpu, cpu):
        plan.run_ahead = (16, 6, 16)
    traces = {}
    for flag in (False, True):
        monkeypatch.setattr(S, "STREAM_ORDER_ISSUE", flag)
        for k, p in (("gpu", gpu), ("cpu", cpu)):
            traces[flag, k] = simulate(p, hw)
            pd.testing.assert_frame_equal(traces[flag, k].df, simulate_simpy(p, hw).df, check_exact=True)
    pd.testing.assert_frame_equal(traces[False, "gpu"].df, traces[True, "gpu"].df, check_exact=True)
    assert not traces[True, "cpu"].df.equals(traces[False, "cpu"].df)
    df = traces[True, "cpu"].df
    host = set(df.index[df["stream"].isin(S.HOST_STREAMS)])
    for o in cpu.ops:
        for d in o.deps:
            if d in host and o.stream not in S.HOST_STREAMS:
                assert df.at[o.id, "start_s"] >= df.at[d, "end_s"]


def test_graph_min_uses_issues_short_lived_shapes_eagerly(tiny_opt, t4):
    """``Plan.graph_min_uses``: a graphable decode shape (part, query tokens) met at fewer decode steps than that is
    issued at the eager cost (``costmodel.eager_graph_shapes``); 1 (the default) graphs all as before; both engines
    agree; the field survives a JSON round trip (left out at 1) and a bad value is refused."""
    from offsim.core import costmodel
    from offsim.core.plan import PlanError

    hw = dataclasses.replace(t4, issue_compute_s=2e-3, issue_copy_s=1e-4, issue_graph_s=1e-4)
    plan = build_plan("flexgen", tiny_opt, hw, Workload(8, 6, 2, 2), {"percent": (100, 0, 0, 100, 100, 0)})
    steps = {o.step for o in plan.ops if costmodel.graphed(o.kind, o.part, o.q_tokens, o.phase)}
    assert costmodel.eager_graph_shapes(plan) == frozenset()
    assert "graph_min_uses" not in plan.to_dict()
    totals = {}
    for need in (1, len(steps), len(steps) + 1):
        plan.graph_min_uses = need
        same(plan, hw)
        totals[need] = simulate(plan, hw).metrics()["total_s"]
    assert totals[len(steps)] == totals[1]  # every shape is met at all decode steps: all still graphed
    assert costmodel.eager_graph_shapes(plan)  # one more than there are steps: every shape eager
    plan.cuda_graphs = False
    assert totals[len(steps) + 1] == simulate(plan, hw).metrics()["total_s"] > totals[1]
    plan.cuda_graphs = True
    d = plan.to_dict()
    assert d["graph_min_uses"] == len(steps) + 1 and Plan.from_dict(d).graph_min_uses == len(steps) + 1
    d["graph_min_uses"] = 0
    with pytest.raises(PlanError, match="graph_min_uses must be a positive integer"):
        Plan.from_dict(d).validate()
