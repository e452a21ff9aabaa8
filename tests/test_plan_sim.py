"""Plan JSON round trip and every validate rule; simulator invariants (hypothesis), determinism, a golden trace."""
import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offsim import Plan, PlanError, Workload, build_plan, get_model, simulate
from offsim.core.errors import OffsimError
from offsim.core.plan import Op

GOLDEN = Path(__file__).parent / "golden" / "tiny_flexgen_trace.csv"


def flexgen(model, hw, wl=Workload(8, 4, 2, 2), **st_):
    st_.setdefault("percent", (50, 50, 0, 100, 100, 0))
    return build_plan("flexgen", model, hw, wl, st_)


def test_plan_json_roundtrip(tiny_opt, t4, tmp_path):
    for settings_ in ({"percent": (50, 50, 0, 100, 100, 0)}, {"percent": (0, 50, 0, 50, 0, 100), "cpu_attention": True},
                      {"percent": (100, 0, 100, 0, 100, 0), "overlap": False}):
        plan = build_plan("flexgen", tiny_opt, t4, Workload(8, 4, 2, 2), settings_)
        p = tmp_path / "plan.json"
        plan.save(p)
        back = Plan.load(p).validate()
        assert back.ops == plan.ops
        assert back.to_dict() == plan.to_dict()


def _break(plan, i, **changes):
    plan.ops[i] = dataclasses.replace(plan.ops[i], **changes) if False else _copy(plan.ops[i], **changes)
    return plan


def _copy(op, **changes):
    kw = {f: getattr(op, f) for f in Op.__annotations__}
    kw.update(changes)
    base = {k: kw.pop(k) for k in ("id", "kind", "deps", "phase", "step", "layer", "batch", "stream")}
    return Op(**base, **kw)


def _first(plan, **match):
    return next(i for i, o in enumerate(plan.ops) if all(getattr(o, k) == v for k, v in match.items()))


@pytest.mark.parametrize("rule,mutate", [
    ("ids must be", lambda p: _break(p, 3, id=7)),
    ("must be on stream", lambda p: _break(p, _first(p, kind="h2d"), stream="d2h")),
    ("not an earlier op", lambda p: _break(p, 2, deps=(5,))),
    ("phase must be", lambda p: _break(p, 1, phase="warmup")),
    ("part must be", lambda p: _break(p, _first(p, kind="compute"), part="softmax")),
    ("q_tokens <= ctx_tokens", lambda p: _break(p, _first(p, kind="compute"), q_tokens=99, ctx_tokens=9)),
    ("positive number", lambda p: _break(p, _first(p, kind="h2d"), nbytes=0)),
    ("outside the layer", lambda p: _break(p, _first(p, kind="h2d", tensor="weight"), hi=10**12)),
    ("were stored there", lambda p: _break(p, _first(p, kind="h2d", tensor="kv"), hi=11)),
    ("over the capacity", lambda p: _break(p, 0, alloc=(10**15, 0, 0))),
    ("unknown kind", lambda p: _break(p, 0, kind="teleport")),
])
def test_validate_names_op_and_rule(tiny_opt, t4, rule, mutate):
    plan = flexgen(tiny_opt, t4)
    plan = mutate(plan)
    with pytest.raises(PlanError, match=rule) as e:
        plan.validate()
    assert "op " in str(e.value)


def test_validate_kv_never_computed(tiny_opt, t4):
    plan = flexgen(tiny_opt, t4)
    i = _first(plan, kind="d2h", tensor="kv")
    _break(plan, i, hi=plan.ops[i].hi + 5)
    with pytest.raises(PlanError, match="were computed"):
        plan.validate()


def test_validate_resident_shortfall_says_tier_and_bytes(tiny_opt, small_gpu_t4):
    big = dataclasses.replace(small_gpu_t4, gpu_mem_bytes=1000)
    args = ("flexgen", tiny_opt, big, Workload(8, 4, 2, 2), {"percent": (100, 0, 100, 0, 100, 0)})
    with pytest.raises(OffsimError, match=r"does not fit: GPU memory short by .* GiB \(needs .* GiB"):
        build_plan(*args)  # refused from arithmetic (footprint.check_fits) before any op is built
    with pytest.raises(PlanError, match=r"resident gpu bytes \d+ exceed the gpu capacity 1000 by \d+ bytes"):
        build_plan(*args, validate=False, check_fits=False).validate()


def test_malformed_plan_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"schema": "offsim.plan/1", "ops": []}')
    with pytest.raises(PlanError, match="missing field"):
        Plan.load(p)
    p.write_text("[1, 2")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(p)


def test_every_policy_plan_validates(tiny_opt, tiny_llama, small_gpu_t4, t4):
    wl = Workload(8, 4, 2, 2)
    for m in (tiny_opt, tiny_llama):
        for pct in [(100, 0, 100, 0, 100, 0), (0, 100, 0, 100, 100, 0), (0, 0, 0, 0, 0, 100), (30, 40, 50, 25, 100, 0)]:
            for ca in (False, True):
                if ca and pct[2]:
                    continue
                simulate(build_plan("flexgen", m, small_gpu_t4, wl, {"percent": pct, "cpu_attention": ca}),
                         small_gpu_t4)
        simulate(build_plan("static-accelerate", m, t4, Workload(8, 4, 2, 1)), t4)
        simulate(build_plan("static-accelerate", m, t4, Workload(8, 4, 2, 1), {"gpu_layers": 0, "offload": "disk"}),
                 t4)
        simulate(build_plan("static-zero", m, t4, Workload(8, 4, 2, 1), {"kv_on_cpu": True}), t4)


def test_cpu_attention_needs_cache_off_gpu(tiny_opt, t4):
    with pytest.raises(OffsimError, match="CPU attention"):
        flexgen(tiny_opt, t4, percent=(100, 0, 50, 50, 100, 0), cpu_attention=True)


def test_percent_must_be_sane(tiny_opt, t4):
    with pytest.raises(OffsimError, match="exceeds 100"):
        flexgen(tiny_opt, t4, percent=(60, 60, 0, 100, 100, 0))
    with pytest.raises(OffsimError, match="sum to 100"):
        flexgen(tiny_opt, t4, percent=(50, 50, 0, 100, 50, 0))


# ---- simulator -------------------------------------------------------------------------------------------------
placements = st.sampled_from([(100, 0, 100, 0, 100, 0), (0, 100, 0, 100, 100, 0), (20, 80, 0, 100, 0, 100),
                              (0, 50, 0, 50, 100, 0), (50, 50, 50, 50, 100, 0)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pct=placements, gbs=st.integers(1, 4), nb=st.integers(1, 3), prompt=st.integers(1, 12),
       gen=st.integers(1, 5), cpu_att=st.booleans(), overlap=st.booleans())
def test_sim_invariants(tiny_opt, small_gpu_t4, pct, gbs, nb, prompt, gen, cpu_att, overlap):
    if cpu_att and pct[2]:
        return
    wl = Workload(prompt, gen, gbs, nb)
    plan = build_plan("flexgen", tiny_opt, small_gpu_t4, wl, {"percent": pct, "cpu_attention": cpu_att,
                                                               "overlap": overlap})
    tr = simulate(plan, small_gpu_t4)
    m = tr.metrics()
    for s in ("compute", "h2d", "d2h", "disk", "cpu"):
        assert m["total_s"] >= m[f"busy_{s}_s"] - 1e-12  # a stream is never busier than the whole run
    df = tr.df
    ends = dict(zip(df.op_id, df.end_s))
    starts = dict(zip(df.op_id, df.start_s))
    for op in plan.ops:  # every op starts after its dependencies end
        for d in op.deps:
            assert starts[op.id] >= ends[d] - 1e-12
    assert simulate(plan, small_gpu_t4).df.equals(df)  # deterministic
    if not overlap:  # serialised: the run is the sum of its ops
        assert m["total_s"] == pytest.approx((df.end_s - df.start_s).sum())
    # more bandwidth is never slower
    faster = simulate(plan, small_gpu_t4.scaled_link(2.0)).metrics()
    assert faster["total_s"] <= m["total_s"] * (1 + 1e-9)


def test_overlap_helps(tiny_opt, small_gpu_t4):
    wl = Workload(8, 4, 2, 2)
    on = simulate(flexgen(tiny_opt, small_gpu_t4, wl), small_gpu_t4).metrics()["total_s"]
    off = simulate(flexgen(tiny_opt, small_gpu_t4, wl, overlap=False), small_gpu_t4).metrics()["total_s"]
    assert on < off


def test_flexgen_throughput_definitions(tiny_opt, t4):
    wl = Workload(8, 4, 2, 3)
    m = simulate(flexgen(tiny_opt, t4, wl), t4).metrics()
    assert m["prefill_tok_s"] == pytest.approx(6 * 8 / m["prefill_s"])
    assert m["decode_tok_s"] == pytest.approx(6 * 3 / m["decode_s"])
    assert m["total_tok_s"] == pytest.approx(6 * 4 / (m["prefill_s"] + m["decode_s"]))


def test_golden_trace(tiny_opt, t4, tmp_path):
    """A tiny FlexGen plan's predicted trace, op by op (whole-layer streaming: the simulator's regression guard
    since before sub-layers; ``test_sublayer_schedule`` covers those). Regenerate deliberately with
    OFFSIM_REGEN_GOLDEN=1."""
    import os

    import pandas as pd

    plan = flexgen(tiny_opt, t4, Workload(4, 2, 1, 2), percent=(0, 100, 0, 100, 100, 0), sublayer=False)
    tr = simulate(plan, t4)
    out = tmp_path / "trace.csv"
    tr.to_csv(out)
    if os.environ.get("OFFSIM_REGEN_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(out.read_text())
    want = pd.read_csv(GOLDEN, comment="#")
    got = pd.read_csv(out, comment="#")
    pd.testing.assert_frame_equal(got, want, rtol=1e-9)


def test_trace_exports(tiny_opt, t4, tmp_path):
    from offsim.core.trace import Trace

    tr = simulate(flexgen(tiny_opt, t4), t4)
    tr.to_chrome(tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == len(tr.df)
    tr.to_csv(tmp_path / "t.csv")
    back = Trace.from_csv(tmp_path / "t.csv")
    assert back.metrics()["total_tok_s"] == pytest.approx(tr.metrics()["total_tok_s"])


@pytest.mark.parametrize("policy", ["flexgen", "tightllm"])
def test_disk_kv_stores_have_bounded_staging(tiny_opt, t4, policy):
    """A prefill that writes its KV to a slow disk must not fill host memory: the stores are double-buffered
    (schedule.DiskStoreBuffers), so the host staging above the resident bytes stays within two KV stores plus two
    KV loads however many batches queue behind the disk."""
    slow_disk = t4.with_(disk_write_bytes_per_s=1e6, disk_read_bytes_per_s=1e6)
    peaks = []
    for nb in (2, 8):
        wl = Workload(48, 3, 2, nb)
        plan = build_plan(policy, tiny_opt, slow_disk, wl, {"percent": (100, 0, 0, 0, 100, 0)})
        m = simulate(plan, slow_disk).metrics()
        kvpt = tiny_opt.kv_bytes_per_token()
        bound = 2 * wl.gpu_batch_size * wl.prompt_len * kvpt + 2 * wl.gpu_batch_size * wl.max_len * kvpt
        staging = m["peak_cpu_bytes"] - plan.resident["cpu"]
        assert 0 < staging <= bound, (nb, staging, bound)
        peaks.append(staging)
    assert peaks[1] <= peaks[0] * 1.01  # four times the batches, no more staging


def test_hidden_load_is_issued_before_the_prefetches(tiny_opt, t4):
    """On the in-order H2D stream a batch's hidden state (a few KB, needed now) goes ahead of the next layer's
    weights and the next batch's KV (needed later): behind them, compute waits for a whole layer's copy. Measured on
    the H200 this order is worth up to ×3 decode (results/validation/schedule_reorder.csv)."""
    for sublayer in (False, True):
        plan = build_plan("flexgen", tiny_opt, t4, Workload(8, 3, 2, 2),
                          {"percent": (0, 100, 0, 100, 0, 100), "sublayer": sublayer})
        ops = plan.ops
        hidden = [o for o in ops if o.kind == "h2d" and o.tensor == "hidden" and o.layer >= 0]
        assert hidden
        computes = [o.id for o in ops if o.kind == "compute"]
        for o in hidden:
            # the position's other loads (next unit's weights, next batch's KV) come after it: it is the first h2d
            # issued since the previous compute
            prev = max(c for c in computes if c < o.id)
            between = [x for x in ops[prev + 1:o.id] if x.kind == "h2d"]
            assert not between, (o.describe(), [x.describe() for x in between])


@pytest.mark.parametrize("policy,settings", [("flexgen", {"percent": (100, 0, 0, 100, 0, 100)}),
                                             ("flexgen", {"percent": (100, 0, 0, 100, 0, 100), "cpu_attention": True}),
                                             ("tightllm", {"percent": (100, 0, 0, 100, 0, 100),
                                                           "kv_solver": "exact"})])
def test_landing_copies_are_bounded_and_counted(tiny_opt, t4, policy, settings):
    """Activations parked on the host land back on the GPU at most ``LANDING_BUFFERS`` at a time (the pool offexec
    holds): each load waits for the compute that consumed the load that many back -- with CPU attention the
    ``attn_out`` that still reads the landed residual -- and the simulated GPU memory counts the copy from its load
    to that compute's end, so however many batches a layer has, no more copies are in flight."""
    from offsim.core import footprint as fp

    peaks = []
    for nb in (4, 16):
        plan = build_plan(policy, tiny_opt, t4, Workload(16, 3, 2, nb), settings)
        ops = plan.ops
        loads = [o for o in ops if o.kind == "h2d" and o.tensor == "hidden"]
        assert len(loads) > fp.LANDING_BUFFERS
        consumer = {}  # load -> the compute that frees its copy: the one that reads it (pre_attn: its attn_out)
        for ld in loads:
            c = next(o for o in ops if o.kind == "compute" and ld.id in o.deps)
            if c.part == "pre_attn":
                c = next(o for o in ops[c.id:] if o.kind == "compute" and o.part in ("attn_out", "post_attn"))
            consumer[ld.id] = c.id
        for n, ld in enumerate(loads):
            assert ld.alloc[0] == fp.hidden_bytes(tiny_opt, 2, ld.hi - ld.lo)
            back = n - fp.LANDING_BUFFERS
            if back >= 0:
                assert consumer[loads[back].id] in ld.deps, ld.describe()
        tr = simulate(plan, t4)
        start, end = tr.df.set_index("op_id")["start_s"], tr.df.set_index("op_id")["end_s"]
        for ld in loads:  # copies landed and not yet consumed when this one starts
            live = sum(1 for x in loads if start[x.id] <= start[ld.id] < end[consumer[x.id]])
            assert live <= fp.LANDING_BUFFERS, ld.describe()
        peaks.append(tr.metrics()["peak_gpu_bytes"] - plan.resident["gpu"])
    assert peaks[1] <= peaks[0]  # four times the batches, no more GPU memory above the resident bytes


def test_sublayer_schedule(tiny_opt, t4):
    """FlexGen's granularity: per step, each decoder layer runs as an attention and an MLP op per batch, every weight
    load stays inside one sub-layer, and the GPU holds one layer's worth of streamed weights where whole-layer
    streaming holds two (the simulator's peak shows it)."""
    from offsim.core import footprint as fp

    wl = Workload(8, 3, 2, 2)
    sub = flexgen(tiny_opt, t4, wl, percent=(0, 100, 0, 100, 100, 0))
    whole = flexgen(tiny_opt, t4, wl, percent=(0, 100, 0, 100, 100, 0), sublayer=False)
    ranges = fp.sublayer_ranges_bytes(tiny_opt)
    for o in sub.ops:
        if o.kind == "h2d" and o.tensor == "weight":
            assert any(lo <= o.lo and o.hi <= hi for lo, hi in ranges.values()), o.describe()
    parts = [(o.step, o.layer, o.batch, o.part) for o in sub.ops
             if o.kind == "compute" and 0 <= o.layer < tiny_opt.num_layers]
    assert sorted(parts) == sorted((i, j, k, p) for i in range(3) for j in range(tiny_opt.num_layers)
                                   for k in range(2) for p in ("attn_layer", "mlp"))
    W = tiny_opt.layer_weight_bytes()
    peak_sub, peak_whole = (simulate(p, t4).metrics()["peak_gpu_bytes"] for p in (sub, whole))
    assert peak_whole - peak_sub >= W  # one streamed layer's slot less (and a smaller op peak)


def test_flexgen_opt30b_t4_policy_bytes():
    """FlexGen's published OPT-30B policy on its T4 (48 x 3, --percent 20 80 0 100 0 100, CPU attention): sub-layer
    streaming halves the weight slots (1.91 -> 0.96 GiB) and drops the op peak by Q/K/V no longer alive in the MLP
    (3.61 -> 1.97 GiB), the two terms where offsim's whole-layer schedule differed from FlexGen's code."""
    from offsim.core import footprint as fp
    from offsim.policies.flexgen import FlexGenSettings, flexgen_schedule

    model, wl = get_model("opt-30b"), Workload(512, 32, 48, 3)
    need = {}
    for sub in (False, True):
        st = FlexGenSettings(percent=(20, 80, 0, 100, 0, 100), cpu_attention=True, sublayer=sub)
        need[sub] = fp.placement_tier_bytes(model, wl, flexgen_schedule(model, st).placement())["gpu"]
    assert need[True]["weight slots"] < 0.51 * need[False]["weight slots"]
    assert need[True]["op peak"] < 0.6 * need[False]["op peak"]
    assert need[True]["resident weights"] == need[False]["resident weights"]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_simulated_peak_within_the_footprint(family, tiny_opt, tiny_llama, t4):
    """On a GPU exactly as large as the footprint says a placement needs (``check_fits``' arithmetic), the built plan
    simulates without running out of memory: the schedule's op-level allocations never exceed the footprint. (The
    KV work buffers are what this caught: a load or a prefill compute must take the buffer the stores two attention
    positions back gave up, as offexec's pool does, or three are live.)"""
    from offsim.core import footprint as fp
    from offsim.policies import POLICIES

    model = tiny_opt if family == "opt" else tiny_llama
    cases = [("flexgen", {"percent": (wg, 100 - wg, 0, 100, hg, 100 - hg), "cpu_attention": ca, "sublayer": sub})
             for wg in (0, 40) for hg in (0, 100) for ca in (False, True) for sub in (False, True)]
    cases += [("flexgen", {"percent": (30, 40, 25, 50, 100, 0)}), ("static-zero", {"kv_on_cpu": True}),
              ("static-accelerate", {"gpu_layers": 1})]
    for policy, st in cases:
        for gbs, nb in ((2, 1), (2, 3)) if policy == "flexgen" else ((3, 1),):
            wl = Workload(8, 4, gbs, nb)
            pol = POLICIES[policy]
            need = fp.placement_tier_bytes(model, wl, pol.placement(model, t4, wl, pol.settings_from(st)))["gpu"]
            hw = dataclasses.replace(t4, gpu_mem_bytes=sum(need.values()), cpu_mem_bytes=1 << 30,
                                     disk_bytes=1 << 30)
            peak = simulate(build_plan(policy, model, hw, wl, st), hw).metrics()["peak_gpu_bytes"]
            assert peak <= sum(need.values()), (policy, st, gbs, nb)
