"""flexgen-ref as FlexGen 0.1.8's code runs (issue 15): its per-tensor weight placement (``init_weight_list``), the
embedding and head it streams every step, its CPU attention sub-layer priced once by the profile row that timed
its own call, and its one-position KV stores. CPU only, small plans."""
from __future__ import annotations

import dataclasses

import pytest

from offsim import Workload, build_plan, get_hardware, get_model, simulate
from offsim.core import costmodel as C
from offsim.core import footprint as fp
from offsim.core.specs import layer_key
from offsim.policies.ref import flexgen_ref_schedule, flexgen_tensor_tiers, flexgen_unit_homes
from offsim.policies.flexgen import FlexGenSettings

OPT30 = get_model("opt-30b")
H = OPT30.d_model
CPU_ATTN = {"percent": (23, 77, 0, 100, 100, 0), "cpu_attention": True}  # the measured FlexGen run's policy


def _streamed(model, percent) -> dict[str, int]:
    """Bytes each FlexGen layer streams (host + disk) under flexgen-ref's placement."""
    out = {}
    for u, nd, nc in flexgen_unit_homes(model, *percent[:2]):
        b = fp.flexgen_unit_home_bytes(model, u, nd, nc)
        out[u] = b["cpu"] + b["disk"]
    return out


# -- 1. per-tensor placement ----------------------------------------------------------------------------------------
def test_opt30b_23_77_streams_flexgens_tensors():
    """At 23 / 77 FlexGen keeps w_q, b_q, w_k, b_k, w_v, b_v on the CPU (308.3 MB per layer), w_out, b_out and the
    norm on the GPU; the MLP streams fc1, b_fc1, fc2 (822.1 MB); the embedding its token table and the head all of
    itself (720.7 MB each). 20 / 80 places the same tensors. A byte prefix would stream 127.5 MB of attention."""
    homes = dict((u, (nd, nc)) for u, nd, nc in flexgen_unit_homes(OPT30, 23, 77))
    assert homes == {"embed": (0, 1), "attn": (0, 6), "mlp": (0, 3), "head": (0, 3)}
    assert flexgen_unit_homes(OPT30, 20, 80) == flexgen_unit_homes(OPT30, 23, 77)
    s = _streamed(OPT30, (23, 77))
    assert s["attn"] == 2 * 3 * (H * H + H) == 308_324_352
    assert s["mlp"] == 2 * (2 * 4 * H * H + 4 * H) == 822_140_928
    assert s["embed"] == 2 * OPT30.vocab_size * H and s["head"] == 2 * (OPT30.vocab_size * H + 2 * H)
    names = [n for n, _ in fp.flexgen_unit_tensors(OPT30, "attn")]
    assert names[6:] == ["out_proj.weight", "out_proj.bias", "self_attn_layer_norm.weight",
                         "self_attn_layer_norm.bias"]  # the GPU's
    # the plan's weight copies per step: exactly those bytes, the embedding (layer -1) and head (layer L) included
    wl = Workload(64, 3, 4, 2)
    plan = build_plan("flexgen-ref", OPT30, get_hardware("h200"), wl, CPU_ATTN, check_fits=False, validate=False)
    step = sorted((o.layer, o.nbytes) for o in plan.ops if o.kind == "h2d" and o.tensor == "weight" and o.step == 1)
    L = OPT30.num_layers
    assert step == sorted([(-1, s["embed"]), (L, s["head"])] + [(j, s[u]) for j in range(L) for u in ("attn", "mlp")])
    # the ideal policy keeps its flat prefix (and the embeddings on the GPU)
    ideal = build_plan("flexgen", OPT30, get_hardware("h200"), wl, CPU_ATTN, check_fits=False, validate=False)
    attn = {o.nbytes for o in ideal.ops if o.kind == "h2d" and o.tensor == "weight" and o.step == 1
            and o.hi <= fp.sublayer_ranges_bytes(OPT30)["attn"][1]}
    assert attn == {fp.sublayer_ranges_bytes(OPT30)["attn"][1] - int(fp.layer_weight_bytes(OPT30) * 0.23 / 2) * 2}
    assert not any(o.layer in (-1, L) for o in ideal.ops if o.kind == "h2d")


@pytest.mark.parametrize("percent", [(23, 77), (20, 80), (0, 50), (10, 30), (50, 50), (0, 100), (100, 0), (45, 10)])
def test_placement_rule_matches_the_harness_estimate(percent):
    """offsim's rule and the FlexGen harness's own reading of ``init_weight_list`` (experiments/peers/flexgen_ref.py
    ``weight_homes``, which sizes FlexGen's host memory) put every tensor of OPT-30B on the same tier."""
    from experiments.peers.flexgen_ref import weight_homes

    theirs = [t for t, _ in weight_homes(OPT30, percent + (0, 100, 100, 0))]
    ours = []
    homes = dict((u, (nd, nc)) for u, nd, nc in flexgen_unit_homes(OPT30, *percent))
    for u in ["embed"] + ["attn", "mlp"] * OPT30.num_layers + ["head"]:
        n, (nd, nc) = len(fp.flexgen_unit_tensors(OPT30, u)), homes[u]
        ours += ["disk"] * nd + ["cpu"] * nc + ["gpu"] * (n - nd - nc)
    assert ours == theirs


def test_tiers_are_disk_then_cpu_then_gpu_by_midpoint():
    assert flexgen_tensor_tiers([1, 1, 1, 1], 25, 50) == ["disk", "cpu", "cpu", "gpu"]
    assert flexgen_tensor_tiers([10, 1], 0, 100) == ["cpu", "cpu"]
    assert flexgen_tensor_tiers([10, 1], 100, 0) == ["gpu", "gpu"]
    assert flexgen_tensor_tiers([9, 1], 20, 80) == ["cpu", "gpu"]  # midpoints 45 % and 95 %


def test_disk_homed_tensors_are_read_then_copied():
    """At 0 / 50 half of each layer's tensors (by their midpoints) are on disk: each unit reads them into host
    staging and copies them up after its host-homed ones; the footprint holds them on disk."""
    m = get_model("opt-125m")
    wl = Workload(32, 2, 2, 1)
    plan = build_plan("flexgen-ref", m, get_hardware("t4"), wl, {"percent": (0, 50, 0, 100, 100, 0)})
    reads = [o for o in plan.ops if o.kind == "disk_read" and o.tensor == "weight"]
    homes = dict((u, (nd, nc)) for u, nd, nc in flexgen_unit_homes(m, 0, 50))
    lo, d_end, _, _ = fp.flexgen_unit_cuts(m, "attn", *homes["attn"])
    assert {(o.lo, o.hi) for o in reads if 0 <= o.layer < m.num_layers} >= {(lo, d_end)}
    assert any(o.layer == -1 for o in reads) and any(o.layer == m.num_layers for o in reads)
    t = fp.placement_tier_bytes(m, wl, flexgen_ref_schedule(m, FlexGenSettings(percent=(0, 50, 0, 100, 100, 0)),
                                                            wl).placement())
    disk = sum(fp.flexgen_unit_home_bytes(m, u, nd, nc)["disk"] * (m.num_layers if u in fp.SUBLAYERS else 1)
               for u, (nd, nc) in homes.items())
    assert t["disk"]["weights"] == disk > 0


def test_footprint_of_flexgens_placement():
    """GPU: the GPU-homed tensors (out_proj and the norms of every layer, the position table), and the streamed
    bytes of two consecutive FlexGen layers (here the last MLP and the head); host: the rest."""
    wl = Workload(512, 32, 16, 3)
    st = FlexGenSettings(**CPU_ATTN)
    t = fp.placement_tier_bytes(OPT30, wl, flexgen_ref_schedule(OPT30, st, wl).placement())
    L, s = OPT30.num_layers, _streamed(OPT30, (23, 77))
    assert t["gpu"]["resident weights"] == L * 2 * (H * H + 3 * H + 3 * H)
    assert t["gpu"]["embeddings"] == 2 * (OPT30.max_positions + 2) * H
    assert t["gpu"]["weight slots"] == s["mlp"] + s["head"]
    assert t["cpu"]["weights"] == L * (s["attn"] + s["mlp"]) + s["embed"] + s["head"]


# -- 2. the CPU attention sub-layer priced once ---------------------------------------------------------------------
def _with_flexgen_rows(hw, model, seq: bool = True, t: float = 0.02):
    key = layer_key(model)
    rows = [[key, "cpu", "attn_ctx_flexgen:4", [[16.0, t], [2048.0, t]]]]
    if seq:  # the profile's mark that FlexGen's own call was timed (offexec/profile.py _flexgen_attention_tables)
        rows.append([key, "cpu", "attn_ctx_flexgen_seq:4", [[16.0, 3 * t], [2048.0, 3 * t]]])
    return dataclasses.replace(hw, op_times=tuple(hw.op_times or ()) + tuple(rows))


def _decode_parts(plan):
    return {(o.kind, o.part if o.kind in ("compute", "cpu_compute") else o.tensor) for o in plan.ops
            if o.phase == "decode"}


def test_cpu_attention_sublayer_is_one_row_priced_op():
    """With a row timed from FlexGen's own call (load_cache + mha_gen: QKV, the copies, the output projection in
    it), a decode attention sub-layer of flexgen-ref is that one CPU op: no pre_attn, Q/K/V or output copies or
    attn_out beside it, and the position lasts the row (plus the KV stores and issuing). With the reproduction's
    rows only, or a preset without rows, the parts are priced apart as before."""
    m = get_model("opt-125m")
    base = get_hardware("h200")
    own, repro = _with_flexgen_rows(base, m), _with_flexgen_rows(base, m, seq=False)
    assert C.cpu_attention_row_holds_sublayer(own, m, "flexgen")
    assert not C.cpu_attention_row_holds_sublayer(own, m, "")
    assert not C.cpu_attention_row_holds_sublayer(repro, m, "flexgen")
    assert not C.cpu_attention_row_holds_sublayer(get_hardware("t4"), m, "flexgen")
    wl = Workload(32, 4, 4, 3)
    st = {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}
    one = build_plan("flexgen-ref", m, own, wl, st)
    assert one.derived.get("cpu_attention_sublayer_op") is True
    parts = _decode_parts(one)
    assert ("cpu_compute", "attn") in parts
    assert not parts & {("compute", "pre_attn"), ("compute", "attn_out"), ("d2h", "qkv"), ("h2d", "attn_out")}
    for hw in (repro, get_hardware("t4")):
        apart = build_plan("flexgen-ref", m, hw, wl, st)
        assert {("compute", "pre_attn"), ("compute", "attn_out"), ("d2h", "qkv"), ("h2d", "attn_out")} \
            <= _decode_parts(apart)
        assert "cpu_attention_sublayer_op" not in apart.derived
    # the ideal policy always prices the parts (offexec's path)
    assert ("compute", "pre_attn") in _decode_parts(build_plan("flexgen", m, own, wl, st))
    # per attention position: the row's time, the parts not added again
    df = simulate(one, own).df
    att = df[(df.kind == "cpu_compute") & (df.phase == "decode")]
    assert (att.end_s - att.start_s).values == pytest.approx(0.02)
    df2 = simulate(build_plan("flexgen-ref", m, repro, wl, st), repro).df
    assert df.end_s.max() < df2.end_s.max()  # the same row, but the reproduction's plan adds the GPU parts


def test_sublayer_op_needs_a_host_homed_cache():
    """A cache partly on disk is read by another path than the one the row timed: the parts stay apart."""
    m = get_model("opt-125m")
    own = _with_flexgen_rows(get_hardware("h200"), m)
    plan = build_plan("flexgen-ref", m, own, Workload(32, 3, 4, 2),
                      {"percent": (20, 80, 0, 50, 100, 0), "cpu_attention": True})
    assert ("compute", "pre_attn") in _decode_parts(plan)


# -- 3. KV one-position stores --------------------------------------------------------------------------------------
RELAY = [[1 << 20, 8e9], [1 << 30, 12e9]]


@pytest.mark.parametrize("own_rows", [True, False])
def test_kv_token_stores(own_rows):
    """FlexGen's store_cache of a decode token: two pageable D2H copies of [B, heads x head_dim] (K, V) per (layer,
    batch), by general_copy's plain path (one position: not relayed, even in a relay plan), after the next position's
    compute and before its sync; none for the last token; the ideal policy has none (its Q/K/V copy lands them)."""
    m = get_model("opt-125m")
    hw = get_hardware("h200").with_(h2d_relay=RELAY, d2h_relay=RELAY)
    if own_rows:
        hw = _with_flexgen_rows(hw, m)
    wl = Workload(32, 4, 4, 3)
    st = {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}
    plan = build_plan("flexgen-ref", m, hw, wl, st)
    stores = [o for o in plan.ops if o.kind == "d2h" and o.tensor == "kv" and o.phase == "decode"]
    half = fp.kv_bytes(m, wl.gpu_batch_size, 1) // 2
    assert len(stores) == 2 * m.num_layers * wl.num_gpu_batches * (wl.gen_len - 2)  # steps 1 .. gen_len - 2
    assert {o.step for o in stores} == set(range(1, wl.gen_len - 1))
    assert all(o.nbytes == half and o.hi - o.lo == 1 and not o.pinned for o in stores)
    o = stores[0]
    assert C.op_seconds(o, m, hw, pageable_copy="relay") == pytest.approx(
        C.transfer_seconds(hw, half, "d2h", pinned=False))  # the pageable table, not the relay's
    prefill = next(x for x in plan.ops if x.kind == "d2h" and x.tensor == "kv" and x.phase == "prefill")
    assert C.op_seconds(prefill, m, hw, pageable_copy="relay") == pytest.approx(
        C.transfer_seconds(hw, prefill.nbytes, "d2h", pinned=False, relay=True))  # many positions: relayed
    ops = plan.ops
    df = simulate(plan, hw).df.set_index("op_id")
    for s in stores:
        c = ops[max(d for d in s.deps if ops[d].kind in ("compute", "cpu_compute"))]
        assert (c.layer, c.batch) != (s.layer, s.batch) and c.step == s.step  # the next position's compute
        assert df.at[s.id, "start_s"] >= df.at[c.id, "end_s"] - 1e-12
    ideal = build_plan("flexgen", m, hw, wl, st)
    assert not [x for x in ideal.ops if x.kind == "d2h" and x.tensor == "kv" and x.phase == "decode"]


# -- 4. the embedding and the head, streamed every step -------------------------------------------------------------
def test_embedding_and_head_streamed_each_step_and_exposed():
    """Off the GPU, FlexGen loads OutputEmbed beside the last MLP's first batch and the next step's InputEmbed beside
    the head's (load_weight(i, j + 1, k) at k == 0); the sync after each position exposes them: the head's compute
    starts after its load ends. All on the GPU: nothing streams."""
    m = get_model("opt-125m")
    hw = get_hardware("t4")
    wl = Workload(32, 4, 2, 2)
    L = m.num_layers
    plan = build_plan("flexgen-ref", m, hw, wl, {"percent": (20, 80, 0, 100, 100, 0)})
    ops = plan.ops
    emb = [o for o in ops if o.kind == "h2d" and o.tensor == "weight" and o.layer == -1]
    head = [o for o in ops if o.kind == "h2d" and o.tensor == "weight" and o.layer == L]
    s = _streamed(m, (20, 80))
    assert [o.nbytes for o in emb] == [s["embed"]] * wl.gen_len and [o.nbytes for o in head] == [s["head"]] * wl.gen_len
    comps = [o for o in ops if o.kind == "compute"]

    def previous_compute(o):
        return max((c for c in comps if c.id < o.id), key=lambda c: c.id, default=None)

    for o in head:
        c = previous_compute(o)
        assert (c.layer, c.part, c.batch) == (L - 1, "attn_layer", wl.num_gpu_batches - 1)  # issued at (MLP, 0)
    for o in emb[1:]:
        c = previous_compute(o)
        assert (c.layer, c.batch) == (L - 1, wl.num_gpu_batches - 1)  # issued at (head, 0)
    df = simulate(plan, hw).df.set_index("op_id")
    for o in head:
        hc = next(c for c in comps if c.layer == L and c.step == o.step and c.batch == 0)
        assert df.at[hc.id, "start_s"] >= df.at[o.id, "end_s"] - 1e-12
    none = build_plan("flexgen-ref", m, hw, wl, {"percent": (100, 0, 100, 0, 100, 0)})
    assert not [o for o in none.ops if o.kind == "h2d"]


# -- the ideal policy is untouched ----------------------------------------------------------------------------------
# fingerprints of flexgen plans built before issue 15's flexgen-ref changes (commit 93bb5dd)
IDEAL_FINGERPRINTS = [
    ("opt-6.7b", Workload(128, 8, 4, 2), {"percent": (30, 50, 0, 100, 0, 100)},
     "94eecd0f41fcb9663647d53b2722c81cf2ce9a9f73abb1ddc5b7b87a4bd0a71d"),
    ("opt-13b", Workload(256, 4, 8, 2), {"percent": (10, 90, 0, 100, 100, 0), "compress_weight": True},
     "ad6d9ee0c15e408ab84bd8a3bb7549856d27ad67affda013263e168657a6971a"),
    ("opt-13b", Workload(256, 4, 8, 2), {"percent": (10, 90, 0, 100, 100, 0), "sublayer": False},
     "e90d0bb4c9e65c5b9363b891b80fbfcef7286e2ce341bb4e2457daf9a32e94d8"),
]


@pytest.mark.parametrize("model, wl, st, fingerprint", IDEAL_FINGERPRINTS)
def test_ideal_flexgen_plans_unchanged(model, wl, st, fingerprint):
    plan = build_plan("flexgen", get_model(model), get_hardware("t4"), wl, st, validate=False, check_fits=False)
    assert plan.fingerprint() == fingerprint
