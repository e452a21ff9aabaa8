"""Op tables (HardwareSpec.op_times, costmodel.compute_seconds / op_seconds), sustained clocks
(sustained_compute_fraction), the host-gated issue of GPU ops behind host ops (sim._host_gates, both engines), and the
executor's op-table probe on the CPU (offexec.profile.profile_ops / profile_attention on tiny models)."""
import dataclasses
import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from offsim import Workload, build_plan
from offsim.core import costmodel as C
from offsim.core.errors import OffsimError
from offsim.core.sim import HOST_STREAMS, simulate, simulate_simpy
from offsim.core.specs import OP_TABLE_MODES, HardwareSpec, get_hardware, get_model, layer_key

M = get_model("opt-125m")
KEY = layer_key(M)
H200 = get_hardware("h200")
RIDGE = H200.gpu_peak_flops / H200.gpu_hbm_bytes_per_s  # tokens past which an op is compute-bound

# a synthetic op table for opt-125m; attention efficiencies are tiny so that attention's FLOP term (the one the
# tables change) dominates its KV-read term at the sizes used below
ROWS = (
    (KEY, "graph", "layer", ((1.0, 1e-4), (8.0, 2e-4))),
    (KEY, "eager", "layer", ((1.0, 3e-4), (8.0, 5e-4))),
    (KEY, "eager", "mlp", ((1.0, 4e-5), (8.0, 6e-5))),
    (KEY, "tokens", "layer", ((16.0, 1e-3), (256.0, 4e-3))),
    (KEY, "tokens", "embed", ((1.0, 2e-5), (1024.0, 8e-5))),
    (KEY, "eager", "head", ((1.0, 7e-5), (8.0, 9e-5))),
    (KEY, "cpu", "attn", ((1.0, 1e-4), (8.0, 2e-4))),
    (KEY, "cpu", "attn_flops", ((1.0, 1e9), (8.0, 4e9))),
    (KEY, "copy", "d2h_qkv", ((1000.0, 1e-5), (100000.0, 3e-5))),
    (KEY, "copy", "h2d_attn_out", ((1000.0, 2e-5), (100000.0, 6e-5))),
    (KEY, "attn", "prefill", ((128.0, 0.01), (2048.0, 0.02))),
    (KEY, "attn", "recompute", ((128.0, 0.0005), (2048.0, 0.001))),
)
HW = H200.with_(op_times=ROWS)


def curve(hw, mode, part, model=M):
    c = C.op_table(hw, model, mode, part)
    assert c is not None, (mode, part)
    return c


def same_traces(plan, hw):
    """Both engines: identical trace frames (exactly) and peaks; returns the event loop's trace."""
    a, b = simulate(plan, hw), simulate_simpy(plan, hw)
    pd.testing.assert_frame_equal(a.df, b.df, check_exact=True)
    assert a.peak_bytes == b.peak_bytes
    return a


def cpu_attention_plan(model=M, hw=HW, percent=(100, 0, 0, 100, 100, 0), wl=Workload(16, 3, 4, 2)):
    return build_plan("flexgen", model, hw, wl, {"percent": list(percent), "cpu_attention": True})


# ----------------------------------------------------------------------------------------------------------------
# specs: layer_key, op_times and sustained_compute_fraction
# ----------------------------------------------------------------------------------------------------------------
def test_layer_key_ignores_depth_and_vocab_only():
    deeper = dataclasses.replace(M, name="x", num_layers=3, vocab_size=1000)
    assert layer_key(deeper) == KEY
    assert layer_key(dataclasses.replace(M, dtype_bytes=4)) != KEY
    assert layer_key(dataclasses.replace(M, ffn_dim=M.ffn_dim * 2)) != KEY
    assert layer_key(dataclasses.replace(M, family="llama")) != KEY
    assert layer_key(get_model("opt-1.3b")) != KEY
    # Llama-2-7B and -13B differ in width; Llama-2-70B and Llama-3-70B share one layer shape (GQA 64/8)
    assert layer_key(get_model("llama-2-7b")) != layer_key(get_model("llama-2-13b"))
    assert layer_key(get_model("llama-2-70b")) == layer_key(get_model("llama-3-70b"))


def test_op_times_and_sustained_round_trip_through_dict_and_json():
    hw = HW.with_(sustained_compute_fraction=0.8)
    d = hw.to_dict()
    assert isinstance(d["op_times"], list) and d["op_times"][0] == [KEY, "graph", "layer", [[1.0, 1e-4], [8.0, 2e-4]]]
    back = HardwareSpec.from_dict(json.loads(json.dumps(d)))
    assert back == hw
    assert back.op_times == ROWS and back.sustained_compute_fraction == 0.8
    assert isinstance(back.op_times, tuple) and all(isinstance(r, tuple) and isinstance(r[3], tuple)
                                                    for r in back.op_times)
    # rows given as JSON-like lists (ints included) become the same tuples
    listy = [[k, m, p, [[int(x) if x == int(x) else x, y] for x, y in c]] for k, m, p, c in ROWS]
    assert H200.with_(op_times=listy).op_times == ROWS
    # the preset without tables: nothing measured
    assert H200.op_times == () and H200.sustained_compute_fraction == 1.0


BAD_ROWS = {
    "three elements": (KEY, "eager", "layer"),
    "unknown mode": (KEY, "bogus", "layer", ((1.0, 1.0),)),
    "decreasing x": (KEY, "eager", "layer", ((2.0, 1.0), (1.0, 1.0))),
    "repeated x": (KEY, "eager", "layer", ((1.0, 1.0), (1.0, 2.0))),
    "zero seconds": (KEY, "eager", "layer", ((1.0, 0.0),)),
    "negative seconds": (KEY, "eager", "layer", ((1.0, 1e-4), (2.0, -1e-4))),
    "zero x": (KEY, "eager", "layer", ((0.0, 1.0),)),
    "empty curve": (KEY, "eager", "layer", ()),
    "key not a string": (7, "eager", "layer", ((1.0, 1.0),)),
}


@pytest.mark.parametrize("what", list(BAD_ROWS))
def test_malformed_row_raises_naming_op_times(what):
    row = BAD_ROWS[what]
    with pytest.raises(OffsimError, match="op_times"):
        dataclasses.replace(H200, op_times=ROWS + (row,))


@pytest.mark.parametrize("what", [w for w in BAD_ROWS if w not in ("three elements", "key not a string")])
def test_malformed_row_through_from_dict_raises_naming_op_times(what):
    k, m, p, c = BAD_ROWS[what]
    d = H200.to_dict()
    d["op_times"] = [[k, m, p, [list(q) for q in c]]]
    with pytest.raises(OffsimError, match="op_times"):
        HardwareSpec.from_dict(d)


WRONG_NESTING = {
    "three elements": [[KEY, "eager", "layer"]],
    "flat curve": [[KEY, "eager", "layer", [1.0, 2e-4]]],
    "curve is null": [[KEY, "eager", "layer", None]],
    "one row, not a list of rows": [KEY, "eager", "layer", [[1.0, 2e-4]]],
    "points of three": [[KEY, "eager", "layer", [[1.0, 2e-4, 3.0]]]],
}


@pytest.mark.parametrize("what", list(WRONG_NESTING))
def test_wrong_nesting_through_from_dict_raises(what):
    d = H200.to_dict()
    d["op_times"] = WRONG_NESTING[what]
    with pytest.raises(OffsimError):
        HardwareSpec.from_dict(d)


@pytest.mark.parametrize("what", list(WRONG_NESTING))
def test_wrong_nesting_through_from_dict_names_op_times(what):
    d = H200.to_dict()
    d["op_times"] = WRONG_NESTING[what]
    with pytest.raises(OffsimError, match="op_times"):
        HardwareSpec.from_dict(d)


def test_row_of_five_elements_through_from_dict_raises():
    d = H200.to_dict()
    d["op_times"] = [[KEY, "eager", "layer", [[1.0, 2e-4]], "extra"]]
    with pytest.raises(OffsimError, match="op_times"):
        HardwareSpec.from_dict(d)


@pytest.mark.parametrize("f", [0.0, -0.5, 1.01, 2.0, math.nan])
def test_sustained_fraction_outside_unit_interval_raises(f):
    with pytest.raises(OffsimError, match="sustained_compute_fraction"):
        H200.with_(sustained_compute_fraction=f)
    with pytest.raises(OffsimError, match="sustained_compute_fraction"):
        dataclasses.replace(H200, sustained_compute_fraction=f)


def test_sustained_fraction_bounds_accepted():
    assert H200.with_(sustained_compute_fraction=1.0).sustained_compute_fraction == 1.0
    assert H200.with_(sustained_compute_fraction=1e-3).sustained_compute_fraction == 1e-3


# ----------------------------------------------------------------------------------------------------------------
# costmodel: table_seconds and the table lookups
# ----------------------------------------------------------------------------------------------------------------
def test_table_seconds_interpolates_clamps_below_extrapolates_above():
    c = ((10.0, 1.0), (20.0, 3.0), (40.0, 4.0))
    assert C.table_seconds(c, 10) == 1.0
    assert C.table_seconds(c, 15) == pytest.approx(2.0, rel=1e-12)  # linear in x, not in log(x)
    assert C.interp(c, 15) != pytest.approx(2.0, rel=1e-3)
    assert C.table_seconds(c, 30) == pytest.approx(3.5, rel=1e-12)
    assert C.table_seconds(c, 20) == pytest.approx(3.0, rel=1e-12)
    assert C.table_seconds(c, 5) == 1.0 and C.table_seconds(c, 0.1) == 1.0  # the first point below
    assert C.table_seconds(c, 40) == pytest.approx(4.0, rel=1e-12)
    assert C.table_seconds(c, 80) == pytest.approx(8.0, rel=1e-12)  # proportional to x beyond the last
    assert C.table_seconds(c, 100) == pytest.approx(10.0, rel=1e-12)
    assert C.table_seconds(((4.0, 2.0),), 1) == 2.0 and C.table_seconds(((4.0, 2.0),), 12) == pytest.approx(6.0)


def test_op_table_lookup():
    assert C.op_table(HW, M, "eager", "layer") == ((1.0, 3e-4), (8.0, 5e-4))
    assert C.op_table(HW, M, "graph", "mlp") is None  # no such row
    assert C.op_table(H200, M, "eager", "layer") is None  # no tables at all
    assert C.op_table(HW, get_model("opt-1.3b"), "eager", "layer") is None  # another layer shape
    assert C.op_table(HW, dataclasses.replace(M, name="m2", num_layers=2), "eager", "layer") is not None


def test_decode_op_picks_graph_row_with_graphs_and_eager_row_without():
    n, ctx = 4, 100
    att = C.attention_seconds(M, HW, n, 1, ctx)
    assert att == C.attention_seconds(M, H200, n, 1, ctx)  # one query: attention rows do not apply
    g = C.compute_seconds(M, HW, "layer", n, 1, ctx, graphs=True)
    e = C.compute_seconds(M, HW, "layer", n, 1, ctx, graphs=False)
    assert g == pytest.approx(C.table_seconds(curve(HW, "graph", "layer"), n) + att, rel=1e-12)
    assert e == pytest.approx(C.table_seconds(curve(HW, "eager", "layer"), n) + att, rel=1e-12)
    assert g < e
    assert C.compute_seconds(M, HW, "layer", n, 1, ctx) == g  # graphs default to on
    # a part without attention: no attention added; its only row is 'eager', which graphs=False reads
    assert C.compute_seconds(M, HW, "mlp", n, 1, ctx, graphs=False) == pytest.approx(
        C.table_seconds(curve(HW, "eager", "mlp"), n), rel=1e-12)
    # past the largest measured batch: proportional
    assert C.compute_seconds(M, HW, "layer", 16, 1, ctx, graphs=False) == pytest.approx(
        2 * 5e-4 + C.attention_seconds(M, HW, 16, 1, ctx), rel=1e-12)


def test_many_tokens_op_picks_tokens_row_by_seqs_times_queries_plus_attention():
    for n, q in ((4, 16), (2, 48), (8, 64)):
        t = C.compute_seconds(M, HW, "layer", n, q, q, graphs=True)
        expect = C.table_seconds(curve(HW, "tokens", "layer"), n * q) + C.attention_seconds(M, HW, n, q, q)
        assert t == pytest.approx(expect, rel=1e-12)
        assert t == C.compute_seconds(M, HW, "layer", n, q, q, graphs=False)  # graphs do not matter here
    # recompute (q < ctx): the same tokens row, attention over the longer context
    assert C.compute_seconds(M, HW, "layer", 4, 17, 500) == pytest.approx(
        C.table_seconds(curve(HW, "tokens", "layer"), 68) + C.attention_seconds(M, HW, 4, 17, 500), rel=1e-12)


def test_embed_and_head_rows():
    # embed: 'tokens' by num_seqs * q_tokens, decode included
    assert C.compute_seconds(M, HW, "embed", 4, 1, 50) == pytest.approx(
        C.table_seconds(curve(HW, "tokens", "embed"), 4), rel=1e-12)
    assert C.compute_seconds(M, HW, "embed", 4, 32, 32) == pytest.approx(
        C.table_seconds(curve(HW, "tokens", "embed"), 128), rel=1e-12)
    # head: 'eager' by sequences, whatever the queries (it reads each sequence's last position)
    h = C.table_seconds(curve(HW, "eager", "head"), 4)
    assert C.compute_seconds(M, HW, "head", 4, 1, 50) == pytest.approx(h, rel=1e-12)
    assert C.compute_seconds(M, HW, "head", 4, 32, 32) == pytest.approx(h, rel=1e-12)
    assert C.compute_seconds(M, HW, "head", 4, 32, 32, graphs=False) == pytest.approx(h, rel=1e-12)


def test_attention_rows_for_many_queries():
    peak = HW.gpu_peak_flops
    n, ctx = 4, 1024
    pre = C.attention_seconds(M, HW, n, ctx, ctx)
    assert pre == pytest.approx(C.attention_flops(M, n, ctx, ctx) / (peak * C.interp(
        curve(HW, "attn", "prefill"), ctx)), rel=1e-12)
    assert pre != pytest.approx(C.attention_seconds(M, H200, n, ctx, ctx), rel=1e-3)
    q = C.ATTN_RECOMPUTE_QUERIES  # the recompute row's own query count: the row as measured
    e_rec = C.interp(curve(HW, "attn", "recompute"), ctx)
    rec = C.attention_seconds(M, HW, n, q, ctx)
    assert rec == pytest.approx(C.attention_flops(M, n, q, ctx) / (peak * e_rec), rel=1e-12)
    assert C.attention_seconds(M, HW, n, 5, ctx) == pytest.approx(
        C.attention_flops(M, n, 5, ctx) / (peak * e_rec), rel=1e-12)
    # more queries: linear in log q from the recompute row (64 queries) to the prefill row (q = ctx)
    e_pre = C.interp(curve(HW, "attn", "prefill"), ctx)
    q = 256
    w = math.log(q / 64) / math.log(ctx / 64)
    mid = C.attention_seconds(M, HW, n, q, ctx)
    assert mid == pytest.approx(C.attention_flops(M, n, q, ctx) / (peak * (e_rec + w * (e_pre - e_rec))), rel=1e-12)
    assert C.attention_flops(M, n, q, ctx) / (peak * e_pre) < mid < C.attention_flops(M, n, q, ctx) / (peak * e_rec)
    # the KV-read term still bounds it from below
    kv = n * ctx * M.kv_bytes_per_token() / (HW.gpu_hbm_bytes_per_s * C.interp(HW.attn_decode_efficiency, ctx))
    assert rec > kv and pre > kv


def test_other_layer_shape_falls_back_to_analytical():
    other = get_model("opt-1.3b")
    shapes = [("layer", 4, 1, 100), ("layer", 4, 64, 64), ("layer", 2, 17, 300), ("mlp", 4, 1, 100),
              ("embed", 4, 64, 64), ("head", 4, 1, 100), ("pre_attn", 8, 1, 10), ("attn", 4, 64, 64)]
    for part, n, q, ctx in shapes:
        for graphs in (True, False):
            assert C.compute_seconds(other, HW, part, n, q, ctx, graphs) == \
                C.compute_seconds(other, H200, part, n, q, ctx, graphs)
        assert C.cpu_attention_seconds(other, HW, n, q, ctx) == C.cpu_attention_seconds(other, H200, n, q, ctx)
        assert C.attention_seconds(other, HW, n, q, ctx) == C.attention_seconds(other, H200, n, q, ctx)
    # the same shape, a part the table lacks: analytical too
    assert C.compute_seconds(M, HW, "pre_attn", 4, 1, 100) == C.compute_seconds(M, H200, "pre_attn", 4, 1, 100)
    # and a table row is not the analytical value
    assert C.compute_seconds(M, HW, "layer", 4, 1, 100) != pytest.approx(
        C.compute_seconds(M, H200, "layer", 4, 1, 100), rel=1e-3)


def test_shallower_model_of_same_shape_uses_the_table():
    small = dataclasses.replace(M, name="opt-125m-2l", num_layers=2)
    assert C.compute_seconds(small, HW, "layer", 4, 1, 100, graphs=False) == \
        C.compute_seconds(M, HW, "layer", 4, 1, 100, graphs=False)


# ----------------------------------------------------------------------------------------------------------------
# sustained clocks
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("base", [H200, HW], ids=["analytical", "tables"])
def test_sustained_fraction_slows_compute_bound_ops_only(base):
    f = 0.8
    slow = base.with_(sustained_compute_fraction=f)
    for part, n, q, ctx in (("layer", 4, 512, 512), ("layer", 1, 1024, 1024), ("mlp", 8, 64, 64),
                            ("layer", 4, 65, 2000)):
        assert n * q >= RIDGE
        assert C.compute_seconds(M, slow, part, n, q, ctx) == pytest.approx(
            C.compute_seconds(M, base, part, n, q, ctx) / f, rel=1e-12)
    for part, n, q, ctx in (("layer", 4, 1, 100), ("layer", 64, 1, 2000), ("mlp", 1, 1, 10), ("layer", 2, 8, 8)):
        assert n * q < RIDGE
        assert C.compute_seconds(M, slow, part, n, q, ctx) == C.compute_seconds(M, base, part, n, q, ctx)
    # the threshold is the ridge point, in tokens
    lo, hi = math.floor(RIDGE), math.ceil(RIDGE)
    assert lo < RIDGE <= hi
    assert C.compute_seconds(M, slow, "layer", 1, lo, lo) == C.compute_seconds(M, base, "layer", 1, lo, lo)
    assert C.compute_seconds(M, slow, "layer", 1, hi, hi) == pytest.approx(
        C.compute_seconds(M, base, "layer", 1, hi, hi) / f, rel=1e-12)
    # host work is not GPU clocks
    assert C.cpu_attention_seconds(M, slow, 4, 512, 512) == C.cpu_attention_seconds(M, base, 4, 512, 512)


def test_sustained_fraction_in_a_simulated_plan():
    f = 0.5
    plan = build_plan("flexgen", M, H200, Workload(256, 3, 4, 1), {"percent": [100, 0, 100, 0, 100, 0]})
    fast = simulate(plan, H200).df
    slow = simulate(plan, H200.with_(sustained_compute_fraction=f)).df
    d_fast, d_slow = fast.end_s - fast.start_s, slow.end_s - slow.start_s
    n_big = n_small = 0
    for op in plan.ops:
        if op.kind != "compute":
            continue
        if op.num_seqs * op.q_tokens >= RIDGE:
            assert d_slow[op.id] == pytest.approx(d_fast[op.id] / f, rel=1e-9)
            n_big += 1
        else:
            assert d_slow[op.id] == pytest.approx(d_fast[op.id], rel=1e-12)
            n_small += 1
    assert n_big >= M.num_layers and n_small >= 2 * M.num_layers
    assert slow.end_s.max() > fast.end_s.max()


# ----------------------------------------------------------------------------------------------------------------
# CPU attention and its copies
# ----------------------------------------------------------------------------------------------------------------
def test_cpu_attention_seconds_with_and_without_rows():
    n, q, ctx = 4, 1, 300
    flops = C.attention_flops(M, n, q, ctx)
    assert C.cpu_attention_seconds(M, H200, n, q, ctx) == pytest.approx(flops / H200.cpu_attention_flops, rel=1e-12)
    fixed = C.table_seconds(curve(HW, "cpu", "attn"), n)
    rate = C.interp(curve(HW, "cpu", "attn_flops"), n)
    assert C.cpu_attention_seconds(M, HW, n, q, ctx) == pytest.approx(flops / rate + fixed, rel=1e-12)
    # the fixed cost alone: FLOPs at the profile's scalar rate
    only_fixed = H200.with_(op_times=tuple(r for r in ROWS if r[1:3] == ("cpu", "attn")))
    assert C.cpu_attention_seconds(M, only_fixed, n, q, ctx) == pytest.approx(
        flops / H200.cpu_attention_flops + fixed, rel=1e-12)
    # the rate alone: no fixed cost
    only_rate = H200.with_(op_times=tuple(r for r in ROWS if r[1:3] == ("cpu", "attn_flops")))
    assert C.cpu_attention_seconds(M, only_rate, n, q, ctx) == pytest.approx(flops / rate, rel=1e-12)


def test_copy_rows_price_cpu_attention_copies_not_weights():
    plan = cpu_attention_plan(percent=(50, 50, 0, 100, 100, 0))
    by = {}
    for op in plan.ops:
        by.setdefault((op.kind, op.tensor), []).append(op)
    assert {("d2h", "qkv"), ("h2d", "attn_out"), ("h2d", "weight"), ("d2h", "kv")} <= set(by)
    for kind, tensor in (("d2h", "qkv"), ("h2d", "attn_out")):
        c = curve(HW, "copy", f"{kind}_{tensor}")
        for op in by[kind, tensor]:
            t = C.op_seconds(op, M, HW)
            assert t == pytest.approx(C.table_seconds(c, op.nbytes), rel=1e-12)
            assert t != pytest.approx(C.transfer_seconds(HW, op.nbytes, kind, op.pinned), rel=1e-3)
            # the link's duplex share does not apply to a measured copy
            assert C.op_seconds(op, M, HW, other_busy_s=1.0) == t
            # without tables: the link
            assert C.op_seconds(op, M, H200) == C.transfer_seconds(H200, op.nbytes, kind, op.pinned)
    for kind, tensor in (("h2d", "weight"), ("d2h", "kv")):
        for op in by[kind, tensor]:
            assert C.op_seconds(op, M, HW) == C.op_seconds(op, M, H200) == \
                C.transfer_seconds(HW, op.nbytes, kind, op.pinned)
    # copy rows of another layer shape are not this model's
    other = H200.with_(op_times=tuple(("opt/other", *r[1:]) for r in ROWS))
    op = by["d2h", "qkv"][0]
    assert C.op_seconds(op, M, other) == C.transfer_seconds(other, op.nbytes, "d2h", op.pinned)


def test_simulated_cpu_attention_plan_reads_the_tables():
    plan = cpu_attention_plan(percent=(50, 50, 0, 100, 100, 0))
    df = same_traces(plan, HW).df
    dur = df.end_s - df.start_s
    seen = set()
    for op in plan.ops:
        if op.kind == "cpu_compute":
            expect = C.cpu_attention_seconds(M, HW, op.num_seqs, op.q_tokens, op.ctx_tokens)
        elif op.tensor in C.COPY_TABLE_TENSORS:
            expect = C.table_seconds(curve(HW, "copy", f"{op.kind}_{op.tensor}"), op.nbytes)
        elif op.kind == "compute" and op.part == "layer" and op.q_tokens == 1 and plan.cuda_graphs:
            expect = C.table_seconds(curve(HW, "graph", "layer"), op.num_seqs) + C.attention_seconds(
                M, HW, op.num_seqs, 1, op.ctx_tokens)
        else:
            continue
        seen.add((op.kind, op.tensor))
        assert dur[op.id] == pytest.approx(expect, rel=1e-9), op.describe()
    assert {("cpu_compute", ""), ("d2h", "qkv"), ("h2d", "attn_out")} <= seen


# ----------------------------------------------------------------------------------------------------------------
# host-gated issue (sim._host_gates), both engines
# ----------------------------------------------------------------------------------------------------------------
def _check_host_gates(plan, hw, df):
    """Every GPU-stream op that depends on a host op starts at or after that op's end plus its own issue cost;
    returns (how many such ops, how many of them start exactly at the gate)."""
    ops = plan.ops
    n = binding = 0
    for op in ops:
        if op.stream in HOST_STREAMS:
            continue
        host = [d for d in op.deps if ops[d].stream in HOST_STREAMS]
        if not host:
            continue
        gate = max(df.end_s[d] for d in host) + C.issue_seconds(op, hw, plan.cuda_graphs)
        assert df.start_s[op.id] >= gate - 1e-12, op.describe()
        n += 1
        binding += math.isclose(df.start_s[op.id], gate, rel_tol=1e-12, abs_tol=1e-15)
    return n, binding


def test_host_gate_cpu_attention_both_engines():
    hw = H200.with_(issue_compute_s=1e-4, issue_copy_s=5e-5)
    plan = cpu_attention_plan(hw=hw)
    df = same_traces(plan, hw).df
    n, binding = _check_host_gates(plan, hw, df)
    assert n > 0 and binding > 0
    ops = plan.ops
    outs = [op for op in ops if op.kind == "h2d" and op.tensor == "attn_out"]
    assert len(outs) == M.num_layers * 2 * 2  # layers x GPU batches x decode steps past the first
    for op in outs:
        (dep,) = [d for d in op.deps if ops[d].kind == "cpu_compute"]
        assert df.start_s[op.id] >= df.end_s[dep] + hw.issue_copy_s - 1e-12
    # the gate binds: the attention output's copy waits for the CPU op and then for its issue
    assert sum(math.isclose(df.start_s[op.id], df.end_s[op.deps[0]] + hw.issue_copy_s, rel_tol=1e-12)
               for op in outs) > len(outs) // 2


def test_no_host_gate_without_issue_costs():
    plan = cpu_attention_plan(hw=H200)
    df = same_traces(plan, H200).df
    ops = plan.ops
    outs = [op for op in ops if op.kind == "h2d" and op.tensor == "attn_out"]
    assert outs
    # an ideal runtime: the copy starts the moment the CPU attention ends (the h2d stream idles there)
    starts_at_dep_end = [df.start_s[op.id] == max(df.end_s[d] for d in op.deps) for op in outs]
    assert sum(starts_at_dep_end) > len(outs) // 2


@pytest.mark.parametrize("graphs", [True, False])
def test_host_gate_uses_the_graph_issue_cost_for_graphed_ops(graphs):
    hw = H200.with_(issue_compute_s=3e-4, issue_copy_s=2e-5, issue_graph_s=4e-5)
    plan = cpu_attention_plan(hw=hw, percent=(50, 50, 0, 100, 100, 0))
    plan.cuda_graphs = graphs
    df = same_traces(plan, hw).df
    ops = plan.ops
    gated_compute = [op for op in ops if op.kind == "compute"
                     and any(ops[d].stream in HOST_STREAMS for d in op.deps)]
    assert gated_compute and all(C.graphed(op.kind, op.part, op.q_tokens, op.phase) for op in gated_compute)
    cost = hw.issue_graph_s if graphs else hw.issue_compute_s
    for op in gated_compute:
        host_end = max(df.end_s[d] for d in op.deps if ops[d].stream in HOST_STREAMS)
        assert df.start_s[op.id] >= host_end + cost - 1e-12
    n, binding = _check_host_gates(plan, hw, df)
    assert n >= len(gated_compute) and binding > 0


@pytest.mark.parametrize("stream_order", [False, True])
def test_host_gate_disk_stream_both_engines(tiny_opt, monkeypatch, stream_order):
    """Every GPU op behind a disk read starts no earlier than the read's end plus its issue cost. With the issuer in
    plan order some start exactly there; in offexec's stream order (``sim.STREAM_ORDER_ISSUE``) the issuer, woken by
    the read's end, may first issue an earlier op of another stream, so none need to."""
    from offsim.core import sim as S

    monkeypatch.setattr(S, "STREAM_ORDER_ISSUE", stream_order)
    hw = H200.with_(issue_compute_s=1e-4, issue_copy_s=5e-5)
    plan = build_plan("flexgen", tiny_opt, hw, Workload(8, 3, 2, 2), {"percent": [0, 0, 0, 0, 100, 0]})
    ops = plan.ops
    assert any(op.stream == "disk" for op in ops)
    df = same_traces(plan, hw).df
    n, binding = _check_host_gates(plan, hw, df)
    assert n > 0 and (binding > 0 or stream_order)
    assert any(op.kind == "h2d" and any(ops[d].kind == "disk_read" for d in op.deps) for op in ops)


def test_engines_agree_with_tables_sustained_and_issue_costs():
    hw = HW.with_(issue_compute_s=1e-4, issue_copy_s=5e-5, issue_graph_s=2e-5, sustained_compute_fraction=0.7)
    for percent in ((100, 0, 0, 100, 100, 0), (50, 50, 0, 100, 100, 0)):
        plan = cpu_attention_plan(hw=hw, percent=percent, wl=Workload(128, 3, 4, 2))
        df = same_traces(plan, hw).df
        n, _ = _check_host_gates(plan, hw, df)
        assert n > 0


# ----------------------------------------------------------------------------------------------------------------
# offexec profile_ops / profile_attention on the CPU, tiny models
# ----------------------------------------------------------------------------------------------------------------
BATCHES, PROMPTS = (1, 4), (8, 16)


@pytest.fixture(scope="module", params=["opt", "llama"])
def probed(request):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import profile_attention, profile_ops
    from offexec.testing import tiny_hf

    _, spec = tiny_hf(request.param)
    rows = profile_ops(spec, "cpu", batches=BATCHES, prompts=PROMPTS, gen_len=4, progress=False)
    att = profile_attention(spec, "cpu", H200.gpu_peak_flops)
    return spec, rows, att


def test_profile_ops_rows_are_well_formed(probed):
    spec, rows, att = probed
    key = layer_key(spec)
    assert json.loads(json.dumps(rows + att)) == rows + att  # plain JSON
    for r in rows + att:
        assert len(r) == 4 and r[0] == key and r[1] in OP_TABLE_MODES and isinstance(r[2], str)
        xs = [p[0] for p in r[3]]
        assert xs == sorted(set(xs)) and all(len(p) == 2 and p[0] > 0 and p[1] > 0 for p in r[3])
    table = {(r[1], r[2]): r[3] for r in rows}
    assert len(table) == len(rows)  # one row per (mode, part)
    for need in (("eager", "layer"), ("tokens", "layer"), ("eager", "head"), ("cpu", "attn"), ("copy", "d2h_qkv"),
                 ("copy", "h2d_attn_out"), ("eager", "pre_attn"), ("eager", "mlp"), ("tokens", "embed")):
        assert need in table, need
    assert not any(m == "graph" for m, _ in table)  # no CUDA graphs on the CPU
    assert [x for x, _ in table["eager", "layer"]] == list(BATCHES)
    assert [x for x, _ in table["cpu", "attn"]] == list(BATCHES)
    assert {b * p for b in BATCHES for p in PROMPTS} <= {x for x, _ in table["tokens", "layer"]}
    w = spec.dtype_bytes
    assert [x for x, _ in table["copy", "d2h_qkv"]] == [b * (spec.q_dim + 2 * spec.kv_dim) * w for b in BATCHES]
    assert [x for x, _ in table["copy", "h2d_attn_out"]] == [b * spec.q_dim * w for b in BATCHES]
    assert {(r[1], r[2]) for r in att} == {("attn", k) for k in ("prefill", "recompute", "prefill_masked",
                                                                  "recompute_masked")}


def test_profiled_rows_load_and_price_a_simulated_plan(probed):
    spec, rows, att = probed
    d = H200.to_dict()
    d["op_times"] = rows + att
    hw = HardwareSpec.from_dict(json.loads(json.dumps(d)))
    as_tuples = tuple((k, m, p, tuple(tuple(q) for q in c)) for k, m, p, c in rows + att)
    assert H200.with_(op_times=as_tuples) == hw
    assert len(hw.op_times) == len(rows) + len(att)
    # attention rows price many-query attention
    assert C.attention_seconds(spec, hw, 2, 48, 48) != C.attention_seconds(spec, H200, 2, 48, 48)

    plan = build_plan("flexgen", spec, hw, Workload(8, 4, 4, 2), {"percent": [100, 0, 0, 100, 100, 0],
                                                                   "cpu_attention": True})
    plan.cuda_graphs = False  # as probed: eager decode ops
    tr = same_traces(plan, hw)
    df = tr.df
    assert df.end_s.notna().all() and df.end_s.max() > 0
    dur = df.end_s - df.start_s
    seen = set()
    for op in plan.ops:
        if op.kind == "cpu_compute":
            expect = C.cpu_attention_seconds(spec, hw, op.num_seqs, op.q_tokens, op.ctx_tokens)
            assert expect > C.cpu_attention_seconds(spec, H200, op.num_seqs, op.q_tokens, op.ctx_tokens)
        elif op.tensor in C.COPY_TABLE_TENSORS:
            expect = C.table_seconds(curve(hw, "copy", f"{op.kind}_{op.tensor}", spec), op.nbytes)
        elif op.kind == "compute" and op.q_tokens == 1 and op.part != "embed" \
                and C.op_table(hw, spec, "eager", op.part) is not None:
            expect = C.table_seconds(curve(hw, "eager", op.part, spec), op.num_seqs)
            if op.part in ("attn", "layer", "attn_layer"):
                expect += C.attention_seconds(spec, hw, op.num_seqs, 1, op.ctx_tokens)
        elif op.kind == "compute" and op.q_tokens > 1 and op.part != "head":
            expect = C.table_seconds(curve(hw, "tokens", op.part, spec), op.num_seqs * op.q_tokens)
            if op.part in ("attn", "layer", "attn_layer"):
                expect += C.attention_seconds(spec, hw, op.num_seqs, op.q_tokens, op.ctx_tokens)
        else:
            continue
        seen.add((op.kind, op.part, op.q_tokens > 1))
        assert dur[op.id] == pytest.approx(expect, rel=1e-9), op.describe()
    assert any(k == "cpu_compute" for k, _, _ in seen)
    assert any(k == "compute" and many for k, _, many in seen) and any(k == "compute" and not many
                                                                      for k, _, many in seen)
    # the measured tables, not the H200's analytical terms, set the pace of this tiny model
    base = simulate(plan, H200).df
    assert df.end_s.max() != pytest.approx(base.end_s.max(), rel=1e-3)


def test_graphed_recompute_op_reads_the_graph_rows_then_the_gpu_bound_tokens_rows():
    """A decode op of 1 < q <= GRAPH_MAX_Q_TOKENS query tokens that offexec replays as a graph is priced by its rows
    (sequences x q) on the 'graph' table, then linearly up to the 'tokens' table's first GPU-bound size (its smaller
    sizes are eager timings that include host issue); past GRAPH_MAX_Q_TOKENS, or eager, the 'tokens' table."""
    rows = tuple(r for r in ROWS if r[1:3] != ("tokens", "layer")) + (
        (KEY, "tokens", "layer", ((16.0, 1e-3), (256.0, 4e-3), (512.0, 3e-3), (1024.0, 6e-3))),)
    hw = H200.with_(op_times=rows)
    ctx = 300
    for n, q, table in ((2, 3, 1e-4 + 5 / 7 * 1e-4), (64, 5, 2e-4 + 312 / 504 * 2.8e-3)):
        att = C.attention_seconds(M, hw, n, q, ctx)
        assert C.compute_seconds(M, hw, "layer", n, q, ctx, graphs=True) == pytest.approx(
            C._sustained(hw, table + att, n * q), rel=1e-12)
        eager = C.table_seconds(curve(hw, "tokens", "layer"), n * q) + att
        assert C.compute_seconds(M, hw, "layer", n, q, ctx, graphs=False) == pytest.approx(
            C._sustained(hw, eager, n * q), rel=1e-12)
    q = C.GRAPH_MAX_Q_TOKENS + 1  # never graphed
    assert C.compute_seconds(M, hw, "layer", 4, q, ctx, graphs=True) == C.compute_seconds(M, hw, "layer", 4, q, ctx,
                                                                                        graphs=False)
    # op_seconds asks the plan: decode only, and only up to the plan's longest graphed op
    from types import SimpleNamespace
    op = SimpleNamespace(kind="compute", part="layer", num_seqs=2, q_tokens=3, ctx_tokens=ctx, phase="decode")
    graphed = C.compute_seconds(M, hw, "layer", 2, 3, ctx, graphs=True)
    eager = C.compute_seconds(M, hw, "layer", 2, 3, ctx, graphs=False)
    assert graphed < eager
    assert C.op_seconds(op, M, hw, graph_q_tokens=C.GRAPH_MAX_Q_TOKENS) == graphed
    assert C.op_seconds(op, M, hw, graph_q_tokens=1) == eager  # a run from before recompute graphs
    assert C.op_seconds(op, M, hw, graph_q_tokens=0) == eager  # graphs off
    assert C.op_seconds(SimpleNamespace(**{**vars(op), "phase": "prefill"}), M, hw) == eager


def test_graph_captures_cost_the_profiles_capture_rows_at_each_keys_first_op():
    """Where the profile has 'capture' rows, the first op of each graph key (part, query tokens, layer, and the
    batch for parts that attend over GPU KV buffers) costs its capture beyond its replay, the plan's very first one
    the 'first' row's; every other op is priced as before, in both engines."""
    cap = ((KEY, "capture", "layer", ((1.0, 5e-3), (8.0, 6e-3))), (KEY, "capture", "first", ((1.0, 0.05), (8.0, 0.07))))
    hw, base = H200.with_(op_times=ROWS + cap), H200.with_(op_times=ROWS)
    plan = build_plan("flexgen", M, hw, Workload(16, 4, 2, 3), {"percent": [100, 0, 100, 0, 100, 0],
                                                                 "sublayer": False})
    dur = lambda h: (lambda df: (df.end_s - df.start_s).to_numpy())(same_traces(plan, h).df)  # noqa: E731
    extra = dur(hw) - dur(base)
    graph = curve(hw, "graph", "layer")
    seen, expect = set(), [0.0] * len(plan.ops)
    for op in plan.ops:
        if C.graphed(op.kind, op.part, op.q_tokens, op.phase, plan.graph_q_tokens):
            key = (op.part, op.layer, op.batch)
            if key not in seen:
                row = curve(hw, "capture", "first" if not seen else "layer")
                expect[op.id] = C.table_seconds(row, op.num_seqs) - C.table_seconds(graph, op.num_seqs)
                seen.add(key)
    assert len(seen) == M.num_layers * 3  # each layer's graph for each of the 3 batches, captured at step 1
    assert extra == pytest.approx(expect, abs=1e-12)
    assert simulate(plan, hw).metrics()["total_s"] > simulate(plan, base).metrics()["total_s"]
    plan.cuda_graphs = False  # no graphs, no captures
    assert (dur(hw) == dur(base)).all()


def test_first_capture_at_a_new_query_count_costs_the_new_q_row():
    """TightLLM's recompute reaches a new query count q at several decode steps (N_r grows with the context up to its
    cap): where the profile has ('capture', 'new_q:PART') rows, the first op at each new q > 1 adds that row at its
    rows (sequences x q) to its capture, the other layers' captures at that q do not (the per-layer capture row is
    read as without it). Without the new_q row nothing changes. Both engines."""
    cap = ((KEY, "capture", "layer", ((1.0, 5e-3), (8.0, 6e-3))), (KEY, "capture", "first", ((1.0, 0.05), (8.0, 0.07))))
    new_q = ((KEY, "capture", "new_q:layer", ((2.0, 0.02), (64.0, 0.04))),)
    base, hw = H200.with_(op_times=ROWS + cap), H200.with_(op_times=ROWS + cap + new_q)
    slow = tuple((x, y * 1e-3) for x, y in H200.h2d_pinned)  # recomputing always wins: N_r = min(cap, context)
    # Algorithm 1's per-step N_r (a capture-aware plan would hold one q: this test is about pricing every new one)
    settings = {"percent": [100, 0, 0, 100, 0, 100], "max_recompute_tokens": 7, "kv_solver": "exact",
                "capture_aware": False}
    plan = build_plan("tightllm", M, base.with_(h2d_pinned=slow), Workload(4, 6, 2, 1), settings)
    graphed = [op for op in plan.ops if C.graphed(op.kind, op.part, op.q_tokens, op.phase, plan.graph_q_tokens)]
    qs = sorted({op.q_tokens for op in graphed})
    assert len([q for q in qs if q > 1]) >= 3  # q grows over the first steps
    dur = lambda h: (lambda df: (df.end_s - df.start_s).to_numpy())(same_traces(plan, h).df)  # noqa: E731
    extra = dur(hw) - dur(base)
    expect, seen_key, seen_q = [0.0] * len(plan.ops), set(), set()
    for op in graphed:
        key = (op.part, op.q_tokens, op.layer)
        if key in seen_key:
            continue
        rows = op.num_seqs * op.q_tokens
        if op.q_tokens > 1 and (op.part, op.q_tokens) not in seen_q:
            expect[op.id] += C.table_seconds(curve(hw, "capture", "new_q:layer"), rows)
        seen_key.add(key)
        seen_q.add((op.part, op.q_tokens))
    assert sum(1 for e in expect if e > 0.015) == len([q for q in qs if q > 1])  # one new_q charge per new q
    assert extra == pytest.approx(expect, abs=1e-12)


def test_a_capture_past_the_rows_largest_size_costs_what_it_costs_there():
    """A recompute op has sequences x q rows, past the 'capture' row's largest size (one-token ops): its capture's
    extra over a replay is read flat there (host work: the kernel count does not grow with the rows), not
    proportionally; inside the rows it is capture - replay, interpolated."""
    cap = ((KEY, "capture", "layer", ((1.0, 5e-3), (8.0, 6e-3))), (KEY, "capture", "first", ((1.0, 0.05), (8.0, 0.07))))
    hw = H200.with_(op_times=ROWS + cap)
    top = C.capture_extra_seconds(M, hw, "layer", 8, False)
    assert top == pytest.approx(6e-3 - C.table_seconds(curve(hw, "graph", "layer"), 8), rel=1e-12)
    for rows in (9, 24, 64 * 5):
        assert C.capture_extra_seconds(M, hw, "layer", rows, False) == pytest.approx(top, rel=1e-12)
    mid = C.capture_extra_seconds(M, hw, "layer", 4, False)
    assert mid == pytest.approx(C.table_seconds(curve(hw, "capture", "layer"), 4)
                                - C.table_seconds(curve(hw, "graph", "layer"), 4), rel=1e-12)
    assert C.capture_extra_seconds(M, hw, "layer", 64 * 5, True) == pytest.approx(
        0.07 - C.table_seconds(curve(hw, "graph", "layer"), 8), rel=1e-12)  # the run's first capture: its own row


def test_a_recompute_capture_costs_its_own_row_where_the_profile_has_one():
    """A recompute op (q > 1) that offexec captures costs, where the profile has ('capture', 'recompute:PART') rows
    (captures timed at the recompute's own rows), that row less the replay at the same rows ('graph_tokens'), not the
    one-token 'capture' row read flat; one-token ops and the run's first capture keep their rows; without the
    recompute row nothing changes. The TightLLM policy's capture price and the simulator read the same number."""
    cap = ((KEY, "capture", "layer", ((1.0, 5e-3), (8.0, 6e-3))), (KEY, "capture", "first", ((1.0, 0.05), (8.0, 0.07))))
    rc = ((KEY, "capture", "recompute:layer", ((6.0, 0.010), (24.0, 0.016), (96.0, 0.030))),)
    base, hw = H200.with_(op_times=ROWS + cap), H200.with_(op_times=ROWS + cap + rc)
    rep = C._graph_tokens_curve(hw, M, "layer")
    for rows, q in ((24, 3), (60, 5), (500, 5)):
        got = C.capture_extra_seconds(M, hw, "layer", rows, False, q_tokens=q)
        want = C.table_seconds(curve(hw, "capture", "recompute:layer"), rows, True) - C.table_seconds(rep, rows, True)
        assert got == pytest.approx(max(0.0, want), rel=1e-12) and got > C.capture_extra_seconds(
            M, base, "layer", rows, False, q_tokens=q)
    for args in ((8, False), (24, True)):  # a one-token op; the run's first capture
        q = 1 if not args[1] else 3
        assert C.capture_extra_seconds(M, hw, "layer", *args, q_tokens=q) == \
            C.capture_extra_seconds(M, base, "layer", *args, q_tokens=q)
    from offsim.policies.tightllm.policy import capture_seconds

    wl = Workload(4, 6, 2, 1)
    assert capture_seconds(M, hw, wl, 2) == pytest.approx(
        M.num_layers * C.capture_extra_seconds(M, hw, "layer", 2 * 3, False, q_tokens=3), rel=1e-12)


def test_copy_issue_costs_follow_the_profiles_issue_rows():
    """A copy whose handler (KIND_TENSOR) has an 'issue' row costs that row at its bytes to issue, in both engines;
    other copies cost ``issue_copy_s``; a cost function asked without the model reads no rows."""
    slow = H200.with_(op_times=ROWS, issue_compute_s=1e-4, issue_copy_s=2e-3, issue_graph_s=5e-5)
    fast = slow.with_(op_times=ROWS + ((KEY, "issue", "h2d_kv", ((1e3, 1e-5), (1e8, 2e-5))),))
    plan = build_plan("flexgen", M, fast, Workload(16, 4, 2, 2), {"percent": [100, 0, 0, 100, 100, 0],
                                                                   "sublayer": False})
    kv = [op for op in plan.ops if op.kind == "h2d" and op.tensor == "kv"]
    assert kv and any(op.kind == "d2h" and op.tensor == "kv" for op in plan.ops)
    for op in kv:
        assert C.issue_seconds(op, fast, 0, M) == pytest.approx(
            C.table_seconds(curve(fast, "issue", "h2d_kv"), op.nbytes), rel=1e-12)
        assert C.issue_seconds(op, fast, 0) == fast.issue_copy_s  # no model, no rows
    d2h = next(op for op in plan.ops if op.kind == "d2h")
    assert C.issue_seconds(d2h, fast, 0, M) == fast.issue_copy_s  # its handler has no row
    t_fast, t_slow = same_traces(plan, fast), same_traces(plan, slow)
    assert t_fast.metrics()["total_s"] < t_slow.metrics()["total_s"]  # host-bound at 2 ms a copy
    # past the largest measured copy the issue time stays flat (the bytes move on the copy engine, not the host),
    # where a compute table grows in proportion
    from offsim.core.sim import _KindOnly

    assert C.issue_seconds(_KindOnly("h2d", tensor="kv", nbytes=int(1e10)), fast, 0, M) == pytest.approx(2e-5)
    assert C.table_seconds(curve(fast, "issue", "h2d_kv"), 1e10) == pytest.approx(2e-5 * 100)


def test_compute_issue_costs_follow_the_profiles_part_rows():
    """A compute op whose part has an 'issue' row ('graph:PART' replayed, 'eager:PART' not) costs that row at its
    sequences to issue (flat past the largest measured), in both engines; parts without one keep the flat costs."""
    from offsim.core.sim import _KindOnly

    slow = H200.with_(op_times=ROWS, issue_compute_s=1e-3, issue_copy_s=1e-5, issue_graph_s=1e-3)
    fast = slow.with_(op_times=ROWS + ((KEY, "issue", "graph:layer", ((1.0, 1e-5), (16.0, 2e-5))),))
    plan = build_plan("flexgen", M, fast, Workload(16, 4, 2, 2), {"percent": [100, 0, 100, 0, 100, 0],
                                                                   "sublayer": False})
    layer = [op for op in plan.ops if op.kind == "compute" and op.part == "layer" and op.step > 0]
    assert layer and all(C.graphed(o.kind, o.part, o.q_tokens, o.phase) for o in layer)
    for op in layer:
        assert C.issue_seconds(op, fast, plan.graph_q_tokens, M) == pytest.approx(
            C.table_seconds(curve(fast, "issue", "graph:layer"), op.num_seqs), rel=1e-12)
    big = _KindOnly("compute", "layer", 1, "decode", num_seqs=1000)
    assert C.issue_seconds(big, fast, plan.graph_q_tokens, M) == pytest.approx(2e-5)  # flat past 16 sequences
    head = next(o for o in plan.ops if o.kind == "compute" and o.part == "head")
    assert C.issue_seconds(head, fast, plan.graph_q_tokens, M) == fast.issue_compute_s  # no row for it
    prefill = next(o for o in plan.ops if o.kind == "compute" and o.part == "layer" and o.step == 0)
    assert C.issue_seconds(prefill, fast, plan.graph_q_tokens, M) == fast.issue_compute_s  # eager: no eager row
    t_fast, t_slow = same_traces(plan, fast), same_traces(plan, slow)
    assert t_fast.metrics()["decode_s"] < t_slow.metrics()["decode_s"]  # host-bound at 1 ms a layer op


def test_cpu_attention_by_context_rows_price_decode_cpu_attention():
    """Where the profile has ('cpu', 'attn_ctx:B') rows for the model (offexec profile --cpu-attention-only), a
    decode CPU-attention op is priced from them: linear in the context between measured contexts, proportional past
    the longest, linear in B between batch sizes; without them, the fixed cost + FLOP rate as before."""
    from offsim import get_hardware, get_model
    from offsim.core import costmodel as cm
    from offsim.core.specs import layer_key

    m = get_model("opt-6.7b")
    hw = get_hardware("h200")
    before = cm.cpu_attention_seconds(m, hw, 8, 1, 300)
    key = layer_key(m)
    rows = [[key, "cpu", "attn_ctx:4", [[16.0, 0.001], [512.0, 0.005]]],
            [key, "cpu", "attn_ctx:16", [[16.0, 0.002], [512.0, 0.014]]]]
    hw2 = dataclasses.replace(hw, op_times=(hw.op_times or []) + rows)
    assert cm.cpu_attention_seconds(m, hw2, 4, 1, 264) == pytest.approx(0.003)
    assert cm.cpu_attention_seconds(m, hw2, 16, 1, 1024) == pytest.approx(0.028)  # proportional past 512
    assert cm.cpu_attention_seconds(m, hw2, 10, 1, 16) == pytest.approx(0.0015)  # halfway in B
    assert cm.cpu_attention_seconds(m, hw2, 32, 1, 512) == pytest.approx(0.028)  # proportional past B = 16
    assert cm.cpu_attention_seconds(m, hw2, 8, 2, 300) == cm.cpu_attention_seconds(m, hw, 8, 2, 300)  # q > 1: as before
    assert cm.cpu_attention_seconds(get_model("opt-13b"), hw2, 8, 1, 300) == \
        cm.cpu_attention_seconds(get_model("opt-13b"), hw, 8, 1, 300)  # another model's shape: as before
    assert before == cm.cpu_attention_seconds(m, hw, 8, 1, 300)


def test_profile_cpu_attention_by_context_on_the_cpu():
    """``offexec profile --cpu-attention-only``'s probe runs offexec's CPU attention on a tiny model at each (batch,
    context) and writes one ('cpu', 'attn_ctx:B') row per batch, by context, that the cost model then reads."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import profile_cpu_attention_ctx
    from offexec.testing import tiny_hf

    _, spec = tiny_hf("opt")
    rows = profile_cpu_attention_ctx(spec, "cpu", batches=(1, 4), contexts=(8, 32), gen_len=4, progress=False)
    assert [r[2] for r in rows] == ["attn_ctx:1", "attn_ctx:4"]
    for r in rows:
        assert r[0] == layer_key(spec) and r[1] == "cpu" and r[1] in OP_TABLE_MODES
        ctxs = [x for x, _ in r[3]]
        assert ctxs == sorted(ctxs) and len(ctxs) == 2 and ctxs[0] > 8 and ctxs[1] > 32  # decode steps past the prompt
        assert all(t > 0 for _, t in r[3])
    hw = H200.with_(op_times=rows)
    assert C.cpu_attention_seconds(spec, hw, 4, 1, 20) == pytest.approx(C.table_seconds(rows[1][3], 20))
    # --under-h2d-load: the same probe under a busy link (nothing to load on the CPU), rows of their own name that
    # the cost model does not read yet: with only those, the CPU op is priced as without any row
    loaded = profile_cpu_attention_ctx(spec, "cpu", batches=(1,), contexts=(8,), gen_len=4, progress=False,
                                       under_h2d_load=True)
    assert [r[2] for r in loaded] == ["attn_ctx_h2d:1"]
    assert C.cpu_attention_seconds(spec, H200.with_(op_times=loaded), 1, 1, 20) == \
        C.cpu_attention_seconds(spec, H200, 1, 1, 20)


def test_cpu_attention_probe_measures_past_the_positions_at_the_longest_that_fits():
    """A probe context past the model's positions (2048 on OPT, whose probe generates tokens after it) is measured
    at the longest that fits, not dropped: OPT's CPU-attention rows reach its long prompts instead of stopping at
    512 and being read on from there."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import CPU_ATTN_CONTEXTS, fit_contexts, profile_cpu_attention_ctx
    from offexec.testing import tiny_hf

    assert fit_contexts(CPU_ATTN_CONTEXTS, 2048 - 12) == [16, 128, 512, 2036]
    assert fit_contexts(CPU_ATTN_CONTEXTS, 4096 - 12) == list(CPU_ATTN_CONTEXTS)
    assert fit_contexts((8, 100, 200), 60) == [8, 60]  # two past the limit: one point at it
    _, spec = tiny_hf("opt")  # 64 positions
    rows = profile_cpu_attention_ctx(spec, "cpu", batches=(1,), contexts=(8, 100), gen_len=4, progress=False)
    ctxs = [x for x, _ in rows[0][3]]
    assert len(ctxs) == 2 and 56 < ctxs[1] <= 64  # measured near the longest context, not dropped


def test_under_h2d_load_needs_cpu_attention_only(tmp_path, capsys):
    from offexec.profile import H2DLoad, main

    base = tmp_path / "base.json"
    base.write_text(json.dumps(H200.to_dict()))
    assert main(["profile", "--device", "cpu", "--base", str(base), "--ops", "opt-125m", "--decode-only",
                 "--under-h2d-load", "--out", str(tmp_path / "o.json")]) == 2
    assert "--under-h2d-load" in capsys.readouterr().err and not (tmp_path / "o.json").exists()
    with H2DLoad("cpu") as load:  # on the CPU: nothing to keep busy
        pass
    assert load.bytes_per_s == 0.0


def test_flexgen_ref_cpu_attention_priced_from_flexgens_own_rows():
    """A ``flexgen-ref`` plan runs FlexGen's own CPU attention path (``Plan.cpu_attention_impl`` 'flexgen'): its
    decode CPU ops are priced from the profile's ('cpu', 'attn_ctx_flexgen:B') rows where it has them, from offexec's
    'attn_ctx:B' rows where it does not; a ``flexgen`` plan of the same settings always from offexec's. The field
    round-trips through the plan JSON and leaves the fingerprints of plans without it as they were."""
    from offsim import PlanError
    from offsim.core.plan import Plan

    m = get_model("opt-6.7b")
    key = layer_key(m)
    ours = [[key, "cpu", "attn_ctx:16", [[16.0, 0.002], [512.0, 0.014]]]]
    theirs = [[key, "cpu", "attn_ctx_flexgen:16", [[16.0, 0.006], [512.0, 0.042]]]]
    hw = dataclasses.replace(H200, op_times=(H200.op_times or []) + ours)
    hw2 = dataclasses.replace(hw, op_times=hw.op_times + theirs)
    assert C.cpu_attention_seconds(m, hw2, 16, 1, 264, impl="flexgen") == pytest.approx(0.024)
    assert C.cpu_attention_seconds(m, hw2, 16, 1, 264) == pytest.approx(0.008)
    assert C.cpu_attention_seconds(m, hw, 16, 1, 264, impl="flexgen") == pytest.approx(0.008)  # no rows of its own
    wl = Workload(128, 4, 16, 2)
    st = {"percent": (50, 50, 0, 100, 100, 0), "cpu_attention": True}
    ref, ideal = build_plan("flexgen-ref", m, hw2, wl, st), build_plan("flexgen", m, hw2, wl, st)
    assert ref.cpu_attention_impl == "flexgen" and ideal.cpu_attention_impl == ""
    busy = {}
    for name, plan in (("ref", ref), ("ideal", ideal)):
        df = simulate(plan, hw2).df
        busy[name] = float((df["end_s"] - df["start_s"])[df["kind"] == "cpu_compute"].sum())
    assert busy["ref"] == pytest.approx(3 * busy["ideal"], rel=0.05)  # FlexGen's rows are 3x offexec's here
    back = Plan.from_dict(json.loads(json.dumps(ref.to_dict())))
    assert back.cpu_attention_impl == "flexgen" and back.fingerprint() == ref.fingerprint()
    assert "cpu_attention_impl" not in ideal.to_dict()
    with pytest.raises(PlanError, match="cpu_attention_impl must be one of"):
        dataclasses.replace(ideal, cpu_attention_impl="numpy").validate()


def test_profile_flexgen_cpu_attention_on_the_cpu():
    """``offexec profile --cpu-attention-only`` also times FlexGen's own CPU attention sequence (fp32 after copying K
    and V out of its [s, B·heads, D] cache) by context for each batch: one 'attn_ctx_flexgen:B' row per batch."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import profile_cpu_attention_flexgen
    from offexec.testing import tiny_hf

    _, spec = tiny_hf("opt")
    rows = profile_cpu_attention_flexgen(spec, batches=(1, 4), contexts=(8, 32, 1000), reps=2)
    assert [r[2] for r in rows] == ["attn_ctx_flexgen:1", "attn_ctx_flexgen:4"]
    for r in rows:
        assert r[0] == layer_key(spec) and r[1] == "cpu"
        assert [x for x, _ in r[3]] == [8.0, 32.0, 63.0]  # 1000 is past the tiny model's 64: timed at 63
        assert all(t > 0 for _, t in r[3])


def test_profile_flexgen_own_mha_gen_is_skipped_without_flexgen_or_a_gpu():
    """FlexGen's own ``mha_gen`` is timed only where it can run: an OPT, a CUDA device and ``flexgen`` importable;
    elsewhere no rows (the reproduced sequence stands in)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import profile_cpu_attention_flexgen_own
    from offexec.testing import tiny_hf

    _, spec = tiny_hf("opt")
    _, llama = tiny_hf("llama")
    assert profile_cpu_attention_flexgen_own(spec, "cpu", batches=(1,), contexts=(8,), reps=1) == []
    assert profile_cpu_attention_flexgen_own(llama, "cuda", batches=(1,), contexts=(8,), reps=1) == []


@pytest.mark.gpu
def test_profile_flexgen_own_mha_gen_on_cuda():
    """With ``flexgen`` 0.1.8 importable and a GPU: one 'attn_ctx_flexgen:B' row per batch from FlexGen's own
    ``TorchDevice.mha_gen`` (KV cache on the CPU), times positive and growing with the context at 4 sequences."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flexgen.pytorch_backend")
    from offexec.profile import profile_cpu_attention_flexgen_own

    spec = get_model("opt-1.3b")
    rows = profile_cpu_attention_flexgen_own(spec, "cuda", batches=(1, 4), contexts=(16, 512), reps=3)
    assert [r[2] for r in rows] == ["attn_ctx_flexgen:1", "attn_ctx_flexgen:4"]
    assert all(t > 0 for r in rows for _, t in r[3])
    assert rows[1][3][1][1] > rows[1][3][0][1]


def test_profile_flexgen_dequant_is_skipped_without_flexgen_or_a_gpu():
    """FlexGen's own decompress is timed only where it can run (an OPT, a CUDA device, ``flexgen``)."""
    pytest.importorskip("torch")
    from offexec.profile import profile_flexgen_dequant

    assert profile_flexgen_dequant(get_model("opt-1.3b"), "cpu") == []
    assert profile_flexgen_dequant(get_model("llama-3-8b"), "cuda") == []


@pytest.mark.gpu
def test_profile_flexgen_dequant_on_cuda():
    """With ``flexgen`` 0.1.8 and a GPU: a weight and a cache row of FlexGen's decompress by fp16 bytes, loadable
    as a profile, times growing with the bytes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("flexgen.compression")
    from offexec.profile import profile_flexgen_dequant

    spec = get_model("opt-1.3b")
    rows = profile_flexgen_dequant(spec, "cuda", caches=((128, 1), (2048, 64)), reps=3)  # 0.5 MB, 0.5 GB
    assert [(r[1], r[2]) for r in rows] == [("quant", "dequant_flexgen:weight"), ("quant", "dequant_flexgen:cache")]
    HardwareSpec.from_dict({**H200.to_dict(), "op_times": rows})
    for r in rows:
        assert r[3][-1][1] > r[3][0][1] > 0


def test_profile_decode_only_times_the_decode_rows_at_the_batches_given(tmp_path):
    """``offexec profile --base P --ops M --decode-only --op-batches ...`` re-measures only the decode ops' rows
    (graph / eager / capture / issue) at the sequence counts given, and keeps every other row of the base profile
    (on the CPU: eager rows, the shape of the result, not the H200's numbers); without --base it is refused."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    from offexec.profile import profile_ops
    from offexec.testing import tiny_hf

    hf, spec = tiny_hf("opt")
    rows = profile_ops(spec, "cpu", batches=(1, 3, 5), decode_only=True, progress=False)
    assert rows and {m for _, m, _, _ in rows} <= {"graph", "eager", "capture", "issue"}
    assert all([x for x, _ in c] == [1.0, 3.0, 5.0] for _, m, p, c in rows if m == "eager" and p != "head")
    # through the command, on the tiny model's config: the base's other rows stay
    hf.config.to_json_file(tmp_path / "config.json")
    cfg = tmp_path / "config.json"
    key = layer_key(get_model(cfg))
    base = {**H200.to_dict(), "op_times": [[key, "tokens", "layer", [[16.0, 1e-3], [512.0, 2e-2]]],
                                           [key, "eager", "layer", [[1.0, 9.0]]]]}
    (tmp_path / "base.json").write_text(json.dumps(base))
    r = subprocess.run([sys.executable, "-m", "offexec.cli", "profile", "--device", "cpu", "--base",
                        str(tmp_path / "base.json"), "--ops", str(cfg), "--decode-only", "--op-batches", "1,2",
                        "--out", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = {(m, p): c for _, m, p, c in json.loads((tmp_path / "out.json").read_text())["op_times"]}
    assert out[("tokens", "layer")] == [[16.0, 1e-3], [512.0, 2e-2]]  # kept
    assert [x for x, _ in out[("eager", "layer")]] == [1.0, 2.0] and out[("eager", "layer")][0][1] != 9.0
    r = subprocess.run([sys.executable, "-m", "offexec.cli", "profile", "--device", "cpu", "--ops", str(cfg),
                        "--decode-only", "--out", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode != 0 and "--decode-only" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.json").exists()


def test_profile_new_q_captures_on_the_cpu():
    """``profile_graph_new_q`` runs TightLLM plans whose query count grows step by step and returns well-formed
    ('capture', 'new_q:PART') rows by rows = sequences x q (on the CPU with static graphs: the shape, not the
    H200's numbers)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import profile_graph_new_q
    from offexec.testing import tiny_hf

    _, spec = tiny_hf("opt")
    rows = profile_graph_new_q(spec, "cpu", batches=(1, 2), progress=False)
    HardwareSpec.from_dict({**H200.to_dict(), "op_times": [[k, m, p, c] for k, m, p, c in rows]})  # loads
    for k, m, p, c in rows:
        assert k == layer_key(spec) and m == "capture" and p.split(":")[0] in ("new_q", "recompute")
        assert [x for x, _ in c] == sorted({x for x, _ in c}) and all(t > 0 for _, t in c)
    # the second layer's op at every new q is a capture at the recompute's own rows: one point per (batch, q)
    rc = [c for _, _, p, c in rows if p == "recompute:layer"]
    assert rc and {x for x, _ in rc[0]} >= {2.0 * q for q in range(2, 4)}


def test_a_models_own_sustained_clock_row_replaces_the_profiles_fraction():
    """('clock', 'sustained'): the sustained fraction measured with the model's own FFN GEMM. A compute-bound op
    (past the ridge point) of that model is divided by it instead of the profile's sustained_compute_fraction; a
    memory-bound op and other models keep the profile's; a fraction outside (0, 1] is refused by name."""
    base = HW.with_(sustained_compute_fraction=0.8)
    own = base.with_(op_times=ROWS + ((KEY, "clock", "sustained", ((16384.0, 0.5),)),))
    assert C.sustained_fraction(base, M) == 0.8 and C.sustained_fraction(own, M) == 0.5
    assert C.sustained_fraction(own, get_model("opt-1.3b")) == 0.8  # another layer shape: no row
    big = int(RIDGE) + 512  # tokens of one prefill op, past the ridge: compute-bound
    burst = C.compute_seconds(M, base.with_(sustained_compute_fraction=1.0), "layer", 1, big, big)
    assert C.compute_seconds(M, base, "layer", 1, big, big) == pytest.approx(burst / 0.8)
    assert C.compute_seconds(M, own, "layer", 1, big, big) == pytest.approx(burst / 0.5)
    small = C.compute_seconds(M, base, "layer", 2, 1, 64)  # a decode op: memory-bound, no clock term
    assert C.compute_seconds(M, own, "layer", 2, 1, 64) == small
    d = own.to_dict()
    assert HardwareSpec.from_dict(json.loads(json.dumps(d))) == own
    d["op_times"] = [[KEY, "clock", "sustained", [[16384.0, 1.5]]]]
    with pytest.raises(OffsimError, match="clock fraction, which must be in"):
        HardwareSpec.from_dict(d)


def test_profile_sustained_only_needs_a_base_and_models(tmp_path, capsys):
    from offexec.profile import main

    base = tmp_path / "base.json"
    base.write_text(json.dumps(HW.to_dict()))
    out = tmp_path / "out.json"
    assert main(["profile", "--device", "cpu", "--sustained-only", "--ops", "opt-125m", "--out", str(out)]) == 2
    assert "--sustained-only" in capsys.readouterr().err and not out.exists()
    # on the CPU nothing throttles: no row, the base kept, the measurement recorded
    assert main(["profile", "--device", "cpu", "--base", str(base), "--sustained-only", "--ops", "opt-125m",
                 "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["op_times"] == json.loads(base.read_text())["op_times"]
    assert d["provenance"]["sustained_tables"]["models"] == ["opt-125m"]


MASKED = HW.with_(op_times=ROWS + ((KEY, "attn", "prefill_masked", ((128.0, 0.005), (2048.0, 0.01))),
                                   (KEY, "attn", "recompute_masked", ((128.0, 0.00025), (2048.0, 0.0005)))))


def test_masked_attention_reads_the_masked_rows():
    """A left-padded batch's eager attention is priced from the '_masked' rows (half the efficiency here: twice the
    time), with the same log-q interpolation; without them, or unmasked, from the plain rows."""
    n, ctx = 4, 1024
    for q in (ctx, C.ATTN_RECOMPUTE_QUERIES, 256):
        plain = C.attention_seconds(M, MASKED, n, q, ctx)
        assert plain == pytest.approx(C.attention_seconds(M, HW, n, q, ctx), rel=1e-12)
        assert C.attention_seconds(M, MASKED, n, q, ctx, masked=True) == pytest.approx(2 * plain, rel=1e-12)
        assert C.attention_seconds(M, HW, n, q, ctx, masked=True) == pytest.approx(plain, rel=1e-12)


def test_padded_plan_prices_its_eager_attention_masked():
    """The simulator prices a padded workload's eager attention ops from the masked rows (Workload.padded), a
    uniform one's -- and a padded one's graphed decode ops -- from the plain rows."""
    from offsim.core.trace import Trace

    lens = (100, 60, 100, 90)
    padded = Workload(100, 4, 2, 2, prompt_lens=lens, gen_lens=(4,) * 4)
    uniform = Workload(100, 4, 2, 2)
    assert padded.padded and not uniform.padded
    assert not Workload(100, 4, 2, 2, prompt_lens=(100, 100, 90, 90), gen_lens=(4,) * 4).padded
    st = {"percent": (100, 0, 100, 0, 100, 0)}

    def prefill_s(hw, wl):
        t: Trace = simulate(build_plan("flexgen", M, hw, wl, st), hw)
        d = t.df[(t.df.kind == "compute") & (t.df.phase == "prefill") & (t.df.layer == 0)]
        return float((d.end_s - d.start_s).sum()), t

    base, _ = prefill_s(MASKED, uniform)
    assert prefill_s(HW, uniform)[0] == pytest.approx(base, rel=1e-12)
    masked, tr = prefill_s(MASKED, padded)
    assert masked > base
    plain_padded, tr_plain = prefill_s(HW, padded)
    assert plain_padded == pytest.approx(base, rel=1e-12)
    dec = lambda t: t.df[(t.df.kind == "compute") & (t.df.phase == "decode") & (t.df.layer == 0)]  # graphed
    d1, d2 = dec(tr), dec(tr_plain)
    assert ((d1.end_s - d1.start_s).values == pytest.approx((d2.end_s - d2.start_s).values, rel=1e-12))


def test_graphed_decode_attention_reads_the_whole_buffer_from_its_rows():
    """A graphed decode op attends over its whole KV buffer (offexec/graphs.py: the unwritten tail masked). Where
    the profile has the model's ('attn', 'decode_graph:B') rows (offexec profile --attention-only decode) they price
    its attention at the plan's buffer length whatever the step's context -- linear in the length, past the longest
    proportional, linear in B between rows; an eager op, a recompute of several queries, another model's shape and
    a profile without the rows are priced as before, at the context."""
    m, n, buf = get_model("opt-6.7b"), 8, 300
    key = layer_key(m)
    rows = [[key, "attn", "decode_graph:4", ((128.0, 1e-5), (512.0, 3e-5))],
            [key, "attn", "decode_graph:16", ((128.0, 2e-5), (512.0, 9e-5))]]
    hw = H200.with_(op_times=tuple(tuple(r) for r in rows))
    assert C.attention_seconds(m, hw, 4, 1, 320, graphed=True) == pytest.approx(2e-5)
    assert C.attention_seconds(m, hw, 16, 1, 1024, graphed=True) == pytest.approx(1.8e-4)  # proportional past 512
    assert C.attention_seconds(m, hw, 10, 1, 128, graphed=True) == pytest.approx(1.5e-5)  # halfway in B
    assert C.attention_seconds(m, hw, 8, 1, 320) == C.attention_seconds(m, H200, 8, 1, 320)  # eager: as before
    assert C.attention_seconds(m, hw, 8, 3, 320, graphed=True) == C.attention_seconds(m, H200, 8, 3, 320)
    assert C.attention_seconds(get_model("opt-13b"), hw, 8, 1, 320, graphed=True) == \
        C.attention_seconds(get_model("opt-13b"), H200, 8, 1, 320)
    # with the rows the step's context does not matter to a graphed op, its buffer's length does; to an eager one
    # (or without the rows) the context does
    early, late = (C.compute_seconds(m, hw, "layer", n, 1, ctx, graphs=True, kv_len=buf) for ctx in (130, 299))
    assert early == late == C.compute_seconds(m, hw, "layer", n, 1, buf, graphs=True)
    assert late < C.compute_seconds(m, hw, "layer", n, 1, 299, graphs=True, kv_len=2 * buf)
    for h, graphs in ((hw, False), (H200, True), (H200, False)):
        assert C.compute_seconds(m, h, "layer", n, 1, 130, graphs=graphs, kv_len=buf) < \
            C.compute_seconds(m, h, "layer", n, 1, 299, graphs=graphs, kv_len=buf)


def test_graphed_layer_row_holds_the_probes_attention_once():
    """A graphed decode op's ('graph', part) row was timed on the probe's ops, which attend over the probe's buffer
    (costmodel.OP_TABLE_PROBE_KV_LEN positions); where the profile's ('attn', 'decode_graph:B') rows price that
    attention it is taken back out of the row, the op's own buffer's added: the op = row + rows(buffer) -
    rows(probe's buffer), the latter on the line through the rows' two shortest lengths (the probe's buffer is
    below them), never below zero. An eager op, a recompute block, and a profile without the rows are priced as
    before."""
    assert C.OP_TABLE_PROBE_KV_LEN == C.OP_TABLE_PROBE_PROMPT + C.OP_TABLE_PROBE_GEN - 1
    n, buf, key = 8, 300, layer_key(M)
    row = ((64.0, 1e-5), (128.0, 2e-5))  # the kernel: 1e-5 s at 64 positions, 2e-5 s at 128
    hw = HW.with_(op_times=HW.op_times + ((key, "attn", f"decode_graph:{n}", row),))
    probe = 1e-5 - (64 - C.OP_TABLE_PROBE_KV_LEN) * (1e-5 / 64)  # the line below its shortest length
    assert C.graph_row_attention_seconds(M, hw, n, 1) == pytest.approx(probe)
    table = C._table_compute_seconds(M, hw, "layer", n, 1, True)
    own = C.attention_seconds(M, hw, n, 1, 200, graphed=True, kv_len=buf)
    assert own == pytest.approx(2e-5 * buf / 128)  # proportional past the longest
    assert C.compute_seconds(M, hw, "layer", n, 1, 200, graphs=True, kv_len=buf) == pytest.approx(
        C._sustained(hw, table + own - probe, n, M))
    # without the rows, a recompute block, an eager op: nothing taken out
    assert C.graph_row_attention_seconds(M, HW, n, 1) == 0.0
    assert C.graph_row_attention_seconds(M, hw, n, 5) == 0.0
    eager = C.compute_seconds(M, hw, "layer", n, 1, 200, graphs=False, kv_len=buf)
    assert eager == pytest.approx(C._sustained(hw, C._table_compute_seconds(M, hw, "layer", n, 1, False)
                                               + C.attention_seconds(M, hw, n, 1, 200), n, M))
    # the line below a table's shortest size stays within [0, its time] (table_seconds' affine_below)
    assert C.table_seconds(((100.0, 1.0), (200.0, 3.0)), 10.0, affine_below=True) == 0.0
    assert C.table_seconds(((100.0, 1.0), (200.0, 0.5)), 10.0, affine_below=True) == 1.0
    assert C.table_seconds(((100.0, 1.0), (200.0, 3.0)), 10.0) == 1.0


def test_simulator_prices_graphed_decode_steps_alike_over_one_buffer():
    """In a simulated plan whose decode ops are graphed, on a profile with the model's graphed decode attention rows,
    every step's layer op costs the same (each attends over the whole buffer, as measured runs show); with graphs
    off, later steps cost more."""
    plan = build_plan("static-accelerate", M, H200, Workload(prompt_len=64, gen_len=24, gpu_batch_size=8))
    assert plan.graph_q_tokens >= 1
    hw = HW.with_(op_times=HW.op_times + ((layer_key(M), "attn", "decode_graph:8", ((64.0, 1e-5), (128.0, 2e-5))),))
    df = simulate(plan, hw).df
    dur = (df.end_s - df.start_s)[(df.phase == "decode") & (df.layer == 1) & (df.kind == "compute")]
    assert dur.max() == pytest.approx(dur.min(), rel=1e-9)
    eager = dataclasses.replace(plan, cuda_graphs=False)
    df = simulate(eager, hw).df
    dur = (df.end_s - df.start_s)[(df.phase == "decode") & (df.layer == 1) & (df.kind == "compute")]
    assert dur.iloc[-1] > dur.iloc[0]


def test_profile_decode_graph_attention_on_the_cpu(tmp_path, capsys):
    """``offexec profile --attention-only decode``'s probe times offexec's attention over a masked buffer per batch
    size and length (on the CPU: tiny lengths, eager) and writes one ('attn', 'decode_graph:B') row per batch that
    the cost model then reads; the CLI adds them to --base, keeping its other rows and its sustained fraction."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.cli import main
    from offexec.profile import profile_decode_attention
    from offexec.testing import tiny_hf

    _, spec = tiny_hf("llama")  # GQA: fewer KV heads than query heads
    rows = profile_decode_attention(spec, "cpu", batches=(1, 4), reps=2)
    assert [r[2] for r in rows] == ["decode_graph:1", "decode_graph:4"]
    for r in rows:
        assert r[0] == layer_key(spec) and r[1] == "attn"
        assert [x for x, _ in r[3]] == [16.0, 32.0] and all(t > 0 for _, t in r[3])
    hw = H200.with_(op_times=tuple((k, mo, p, tuple(map(tuple, c))) for k, mo, p, c in rows))
    assert C.attention_seconds(spec, hw, 4, 1, 20, graphed=True) == pytest.approx(C.table_seconds(rows[1][3], 20))
    base = tmp_path / "base.json"
    d0 = get_hardware("results/profiles/h200_offexec_v2.json").to_dict()
    base.write_text(json.dumps(d0))
    out = tmp_path / "out.json"
    assert main(["profile", "--base", str(base), "--ops", "opt-125m", "--attention-only", "decode", "--device", "cpu",
                 "--op-batches", "1,2", "--out", str(out)]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    key = layer_key(get_model("opt-125m"))  # (the base has other models' rows)
    new = [r for r in d["op_times"] if r[0] == key and r[1] == "attn" and r[2].startswith("decode_graph:")]
    assert sorted(r[2] for r in new) == ["decode_graph:1", "decode_graph:2"]
    assert [r for r in d["op_times"] if r not in new] == [r for r in json.loads(json.dumps(d0["op_times"]))]
    assert d["sustained_compute_fraction"] == d0["sustained_compute_fraction"]
    assert "decode_graph_attention_tables" in d["provenance"]


def test_extend_rows_appends_only_points_past_the_base_curve(tmp_path):
    """experiments.validation.extend_rows: a re-measured curve's points past the base's last one are appended (the
    mean where two parts measured them); the base's own points, and rows of other modes or parts, are kept; the
    cost model then reads the measured long point instead of extrapolating."""
    from experiments.validation.extend_rows import main

    base_rows = [[KEY, "cpu", "attn_ctx:4", [[22.5, 1e-3], [518.5, 4e-3]]], [KEY, "cpu", "attn", [[1.0, 1e-4]]]]
    base = {**H200.with_(op_times=()).to_dict(), "op_times": base_rows}
    part = lambda short, long: {**base, "op_times": [  # noqa: E731
        [KEY, "cpu", "attn_ctx:4", [[22.5, short], [518.5, 9e-3], [2042.5, long]]],
        [KEY, "cpu", "attn", [[1.0, 5e-4], [4.0, 6e-4]]]]}
    paths = []
    for i, (s, lg) in enumerate(((2e-3, 10e-3), (3e-3, 12e-3))):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(part(s, lg)))
    out = tmp_path / "ext.json"
    assert main(["--base", str(tmp_path / "b.json"), "--part", str(paths[0]), "--out", str(out)]) == 2  # unreadable
    (tmp_path / "b.json").write_text(json.dumps(base))
    assert main(["--base", str(tmp_path / "b.json"), "--part", str(paths[0]), "--part", str(paths[1]),
                 "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    rows = {tuple(r[:3]): r[3] for r in d["op_times"]}
    assert rows[(KEY, "cpu", "attn_ctx:4")] == [[22.5, 1e-3], [518.5, 4e-3], [2042.5, pytest.approx(11e-3)]]
    assert rows[(KEY, "cpu", "attn")] == [[1.0, 1e-4]]  # another part: untouched
    assert "extended_rows" in d["provenance"]
    hw = HardwareSpec.from_dict(d)
    assert C.cpu_attention_seconds(M, hw, 4, 1, 2042) == pytest.approx(11e-3, rel=1e-3)
    # a part with nothing past the base's curve: refused, nothing written
    (tmp_path / "same.json").write_text(json.dumps(base))
    with pytest.raises(SystemExit, match="nothing to extend"):
        main(["--base", str(tmp_path / "b.json"), "--part", str(tmp_path / "same.json"), "--out",
              str(tmp_path / "none.json")])
    assert not (tmp_path / "none.json").exists()


def test_extend_rows_new_only_adds_the_row_kinds_the_base_lacks(tmp_path):
    """extend_rows --new-only: a capture-only re-measurement's rows that the base has no row for (the issue rows of
    the head and the weight copies) are added, point by point the mean of the parts; the base's existing issue rows
    stay as they were however the parts re-measured them; the cost model then prices the head with its new row
    instead of the profile's constant."""
    from experiments.validation.extend_rows import main

    base_rows = [[KEY, "issue", "graph:layer", [[1.0, 1e-4]]]]
    base = {**H200.with_(op_times=(), issue_compute_s=6e-4, issue_copy_s=1.4e-4).to_dict(), "op_times": base_rows}
    (tmp_path / "b.json").write_text(json.dumps(base))
    paths = []
    for i, t in enumerate((1e-4, 3e-4)):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps({**base, "op_times": [
            [KEY, "issue", "graph:layer", [[1.0, 9e-4]]],
            [KEY, "issue", "eager:head", [[1.0, t], [4.0, t]]],
            [KEY, "issue", "h2d_weight", [[1e6, t / 2]]],
            [KEY, "cpu", "attn_ctx:4", [[22.5, 1e-3]]]]}))
    out = tmp_path / "new.json"
    assert main(["--base", str(tmp_path / "b.json"), "--part", str(paths[0]), "--part", str(paths[1]),
                 "--mode", "issue", "--prefix", "", "--new-only", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    rows = {tuple(r[:3]): r[3] for r in d["op_times"]}
    assert rows[(KEY, "issue", "graph:layer")] == [[1.0, 1e-4]]  # the base's row: kept
    assert rows[(KEY, "issue", "eager:head")] == [[1.0, pytest.approx(2e-4)], [4.0, pytest.approx(2e-4)]]
    assert rows[(KEY, "issue", "h2d_weight")] == [[1e6, pytest.approx(1e-4)]]
    assert (KEY, "cpu", "attn_ctx:4") not in rows  # another mode: not taken
    assert "new_rows" in d["provenance"]
    head = next(o for o in build_plan("flexgen", M, H200, Workload(16, 4, 1, 1), {}).ops if o.part == "head")
    assert C._handler_issue_seconds(head, HardwareSpec.from_dict(d), 0, M) == pytest.approx(2e-4)
    assert C._handler_issue_seconds(head, HardwareSpec.from_dict(base), 0, M) == pytest.approx(6e-4)
    with pytest.raises(SystemExit, match="nothing to add"):  # nothing new: refused, nothing written
        main(["--base", str(out), "--part", str(paths[0]), "--mode", "issue", "--prefix", "", "--new-only",
              "--out", str(tmp_path / "none.json")])
    assert not (tmp_path / "none.json").exists()


def test_issue_share_counts_the_graph_captures_the_simulator_adds():
    """``host_issue_decode_frac`` reads the issuing thread's time as the simulator charges it: with ``captures`` the
    per-op issue costs carry the CUDA-graph captures (``_capture_extras``, host work at the first op of each graph
    key, all in decode), so the share of a graphed plan is that much larger than the issue rows alone."""
    from pathlib import Path

    from offsim.core.latency import host_issue_share
    from offsim.core.plan import op_rows
    from offsim.core.sim import _capture_extras, issue_costs

    hw = get_hardware(str(Path(__file__).resolve().parents[1] / "results/profiles/h200_offexec_v2.json"))
    plan = build_plan("flexgen", get_model("opt-6.7b"), hw, Workload(32, 8, 2, 2),
                      {"percent": [100, 0, 100, 0, 100, 0]})
    extras = _capture_extras(plan, op_rows(plan.ops), hw)
    assert extras and all(plan.ops[i].phase == "decode" for i in extras)
    bare, full = issue_costs(plan, hw), issue_costs(plan, hw, captures=True)
    assert sum(full) - sum(bare) == pytest.approx(sum(extras.values()), rel=1e-12)
    decode_s = 1.0
    busy = sum(c for c, op in zip(full, plan.ops) if op.phase == "decode")
    assert host_issue_share(plan, hw, {"decode_s": decode_s}) == {"host_issue_decode_frac": pytest.approx(busy)}


def test_sparse_attention_priced_from_the_dense_rows_is_continuous_and_monotone():
    """Where the profile's measured rows price a decode attention op (graphed on the GPU: 'decode_graph:B'; on the
    CPU: 'attn_ctx:B'), a sparse op is that row scaled by (1 + f) / 2 (K and QK^T whole, V and PV by the kept share
    f): no jump at f just below 1 (it was +8 % on the GPU, -17 % on the CPU, where the rows gave way to another
    model), and fewer kept rows never cost more."""
    from pathlib import Path

    from offsim.core.specs import Compression

    hw = get_hardware(str(Path(__file__).resolve().parents[1] / "results" / "profiles" / "h200_offexec_v2.json"))
    m = get_model("opt-6.7b")
    fs = (1.0, 0.999, 0.9, 0.5, 0.1)
    gpu = [C.attention_seconds(m, hw, 32, 1, 1000, Compression(sparse_attention=f), graphed=True, kv_len=2015)
           for f in fs]
    cpu = [C.cpu_attention_seconds(m, hw, 32, 1, 1000, Compression(sparse_attention=f)) for f in fs]
    for t in (gpu, cpu):
        assert t[1] == pytest.approx(t[0], rel=1e-3) and all(a >= b for a, b in zip(t, t[1:]))
        assert t[-1] == pytest.approx(t[0] * (1 + fs[-1]) / 2)
