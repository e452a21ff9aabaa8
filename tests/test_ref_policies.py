"""The ``*-ref`` policies (offsim.policies.ref, issue 15 part 3): each peer's schedule as its code runs it. Each test
checks, on a small model, that the plan (and its simulated trace) has the behaviour the policy claims, and that the
ideal policy it refines does not."""
from __future__ import annotations

import pytest

from offsim import Workload, build_plan, get_hardware, get_model, simulate
from offsim.core import costmodel
from offsim.core import footprint as fp
from offsim.core.plan import Plan
from offsim.policies import DEFAULT_POLICIES, POLICIES

HW = get_hardware("t4")
M = get_model("opt-125m")
N_TENSORS = len(M.layer_tensors())


def _ops(plan):
    return list(plan.ops)


def _overlaps(a, b) -> bool:
    return a.start_s < b.end_s - 1e-12 and b.start_s < a.end_s - 1e-12


def test_ref_policies_registered_but_not_default():
    for name, ideal in (("flexgen-ref", "flexgen"), ("static-accelerate-ref", "static-accelerate"),
                        ("static-zero-ref", "static-zero")):
        assert POLICIES[name].implements == ideal
        assert name not in DEFAULT_POLICIES and ideal in DEFAULT_POLICIES


# -- HF Accelerate ----------------------------------------------------------------------------------------------------
def test_accelerate_ref_all_layers_offloaded_per_tensor_pageable_copies():
    wl = Workload(64, 4, 2, 1)
    plan = build_plan("static-accelerate-ref", M, HW, wl, {"offload": "cpu"})
    assert plan.derived["gpu_layers"] == 0  # FlexGen's hf_opt.py device_map: every decoder layer on "cpu"
    w = [o for o in _ops(plan) if o.kind == "h2d" and o.tensor == "weight"]
    assert w and all(not o.pinned for o in w)  # pageable host memory
    # one copy per tensor of every layer in every step
    assert len(w) == M.num_layers * wl.gen_len * N_TENSORS
    bounds = {(lo, hi) for _, lo, hi in fp.weight_tensor_ranges_bytes(M)}
    assert {(o.lo, o.hi) for o in w} == bounds
    # priced at the profile's pageable rate (plus the per-copy latency)
    o = max(w, key=lambda o: o.nbytes)
    assert costmodel.op_seconds(o, M, HW) == pytest.approx(HW.link_latency_s + o.nbytes / HW.h2d_pageable[0][1])


def test_accelerate_ref_no_copy_overlaps_a_compute():
    plan = build_plan("static-accelerate-ref", M, HW, Workload(64, 4, 2, 1), {"offload": "cpu"})
    df = simulate(plan, HW).df
    copies = df[(df.kind == "h2d")].itertuples()
    computes = list(df[df.kind == "compute"].itertuples())
    assert not any(_overlaps(c, g) for c in copies for g in computes)
    # the ideal policy prefetches nothing either, but keeps layers on the GPU; its copies are whole layers
    ideal = build_plan("static-accelerate", M, HW, Workload(64, 4, 2, 1), {"offload": "cpu"})
    assert ideal.derived["gpu_layers"] > 0


def test_accelerate_ref_disk_reads_one_tensor_at_a_time():
    plan = build_plan("static-accelerate-ref", M, HW, Workload(64, 2, 1, 1), {"offload": "disk"}, check_fits=False)
    df = simulate(plan, HW, check_memory=False).df.sort_values("start_s")
    reads = list(df[(df.kind == "disk_read")].itertuples())
    h2d = list(df[(df.kind == "h2d") & (df.nbytes > 0)].itertuples())
    assert len(reads) == M.num_layers * 2 * N_TENSORS
    assert not any(_overlaps(r, c) for r in reads for c in h2d)  # synchronous: read, copy, next tensor


# -- DeepSpeed ZeRO-Inference -----------------------------------------------------------------------------------------
def test_zero_ref_fetches_each_parameter_and_gathers_it():
    wl = Workload(64, 4, 4, 1)
    plan = build_plan("static-zero-ref", M, HW, wl, {"offload": "cpu"})
    w = [o for o in _ops(plan) if o.kind == "h2d" and o.tensor == "weight"]
    assert len(w) == M.num_layers * wl.gen_len * N_TENSORS  # every parameter, biases and norms too
    assert all(o.pinned for o in w)  # offload_param pin_memory
    assert plan.weight_gather_copies == 2
    o = max(w, key=lambda o: o.nbytes)
    bare = HW.link_latency_s + o.nbytes / HW.h2d_pinned[0][1]
    gather = 2 * (HW.kernel_overhead_s + 2 * o.nbytes / HW.gpu_hbm_bytes_per_s)
    assert costmodel.op_seconds(o, M, HW, gather_copies=plan.weight_gather_copies) == pytest.approx(bare + gather)
    # the plan round-trips through JSON with its gather copies; plans without them are unchanged
    assert Plan.from_dict(plan.to_dict()).weight_gather_copies == 2
    ideal = build_plan("static-zero", M, HW, wl, {"offload": "cpu"})
    assert "weight_gather_copies" not in ideal.to_dict()


def test_zero_ref_prefetches_only_after_the_first_forward():
    plan = build_plan("static-zero-ref", M, HW, Workload(64, 3, 4, 1), {"offload": "cpu"})
    ops = _ops(plan)
    last_compute = {}  # (step, layer) -> id of its last compute (its MLP's)
    for o in ops:
        if o.kind == "compute" and 0 <= o.layer < M.num_layers:
            last_compute[(o.step, o.layer)] = o.id
    first_load = {}
    for o in ops:
        if o.kind == "h2d" and o.tensor == "weight":
            first_load.setdefault((o.step, o.layer), o.id)
    # prefill: a layer's parameters are fetched only once the previous layer's computes have been issued
    for j in range(1, M.num_layers):
        assert first_load[(0, j)] > last_compute[(0, j - 1)]
    # decode: the next layer's parameters are fetched ahead, before the previous layer's MLP is issued
    for i in (1, 2):
        assert all(first_load[(i, j)] < last_compute[(i, j - 1)] for j in range(1, M.num_layers))


def test_zero_ref_slower_than_ideal():
    wl = Workload(64, 4, 4, 1)
    t = {p: simulate(build_plan(p, M, HW, wl, {"offload": "cpu"}), HW).makespan_s
         for p in ("static-zero", "static-zero-ref")}
    assert t["static-zero-ref"] > t["static-zero"]


# -- FlexGen ------------------------------------------------------------------------------------------------------------
FG = {"percent": (20, 80, 0, 100, 0, 100)}


def _positions(df):
    """Per position (step, layer, batch) in plan order, its compute's op id: one GPU compute per position here."""
    c = df[df.kind == "compute"].sort_values("op_id")
    return list(c.op_id)


@pytest.mark.parametrize("policy, synced", [("flexgen-ref", True), ("flexgen", False)])
def test_flexgen_ref_sync_after_every_layer_and_batch(policy, synced):
    wl = Workload(32, 3, 2, 3)
    plan = build_plan(policy, M, HW, wl, FG)
    df = simulate(plan, HW).df.set_index("op_id").sort_index()
    comp = _positions(df.reset_index())
    stores = (df.kind == "d2h") & df.index.map(lambda i: plan.ops[i].tensor in ("kv", "hidden"))
    early = 0  # ops of a position that start before the previous position's compute has ended
    late_stores = 0  # stores of a position still running when the position after next starts
    for a, b, c in zip(comp, comp[1:], comp[2:] + [None]):
        between = df.loc[a + 1:b]  # position b's ops (and position a's stores, issued after compute a)
        nxt = between[~stores.loc[a + 1:b]]
        early += int((nxt.start_s < df.at[a, "end_s"] - 1e-12).sum())
        if c is not None:
            st = between[stores.loc[a + 1:b]]
            first_after = df.loc[b + 1:c]
            first_after = first_after[~stores.loc[b + 1:c]].start_s.min()
            late_stores += int((st.end_s > first_after + 1e-12).sum())
    if synced:
        assert early == 0 and late_stores == 0
        # one sync point per position: every (layer or sub-layer) x batch of every step, embedding and head too
        per_step = (1 + 2 * M.num_layers + 1) * wl.num_gpu_batches
        assert len(comp) == per_step * wl.gen_len
    else:
        assert early > 0  # the ideal executor runs the next positions' copies under this compute


def test_flexgen_ref_cache_copies_pageable_weights_pinned():
    wl = Workload(32, 3, 2, 3)
    plan = build_plan("flexgen-ref", M, HW, wl, FG)
    kv = [o for o in _ops(plan) if o.tensor == "kv" and o.kind in ("h2d", "d2h")]
    w = [o for o in _ops(plan) if o.tensor == "weight" and o.kind == "h2d"]
    assert kv and all(not o.pinned for o in kv)  # init_cache_one_gpu_batch: pin_memory=False
    assert w and all(o.pinned for o in w)  # --pin-weight 1
    ideal = build_plan("flexgen", M, HW, wl, FG)
    assert all(o.pinned for o in _ops(ideal) if o.tensor == "kv" and o.kind in ("h2d", "d2h"))
    # weights of the next unit are loaded beside the first batch only (FlexGen's load_weight: k == 0)
    comp = {o.id: o for o in _ops(plan) if o.kind == "compute"}
    ids = sorted(comp)
    for o in w:
        prev = [i for i in ids if i < o.id]
        if prev:
            assert comp[prev[-1]].batch == wl.num_gpu_batches - 1 or comp[prev[-1]].layer < 0 \
                or comp[prev[-1]].batch == 0


def test_flexgen_ref_same_plan_when_nothing_moves():
    # all on the GPU: no copies, the barrier changes nothing that runs concurrently
    wl = Workload(32, 3, 2, 1)
    st = {"percent": (100, 0, 100, 0, 100, 0)}
    a = simulate(build_plan("flexgen", M, HW, wl, st), HW).makespan_s
    b = simulate(build_plan("flexgen-ref", M, HW, wl, st), HW).makespan_s
    assert b == pytest.approx(a, rel=1e-9)


def test_flexgen_ref_refuses_stages():
    from offsim.core.errors import OffsimError
    with pytest.raises(OffsimError, match="single-GPU"):
        build_plan("flexgen-ref", M, HW, Workload(32, 2, 2, 2), {**FG, "num_stages": 2}, check_fits=False)


def test_flexgen_ref_candidates_fit_its_own_tensor_placement():
    """FlexGen places whole tensors by their midpoints and the embedding and head by the same percentages, which can
    hold more on the GPU than the flat share FlexGen's candidates are trimmed to: flexgen-ref's candidates are
    trimmed until its own placement fits (the search found no feasible flexgen-ref setting for OPT-30B and
    Llama-2-13B at 24 GiB before)."""
    from offsim.core.errors import OffsimError
    from offsim.policies.flexgen import candidates
    from offsim.policies.ref import flexgen_ref_candidates
    from offsim.policies.registry import check_plan_fits

    m, hw = get_model("opt-1.3b"), get_hardware("t4", 1.5)

    def fits(c) -> bool:
        try:
            check_plan_fits("flexgen-ref", m, hw, c.workload, c.settings)
        except OffsimError:
            return False
        return True

    def key(c):
        return c.workload, c.settings["cpu_attention"], c.settings["percent"][4]

    flat = list(candidates(m, hw, 336, 3))
    ref = flexgen_ref_candidates(m, hw, 336, 3)
    by_key = {key(c): c for c in flat}
    assert len(by_key) == len(flat) == len(ref) and {key(c) for c in ref} == set(by_key)  # the same candidates
    assert sum(fits(c) for c in ref) >= sum(fits(c) for c in flat) + 10  # the flat fit left these short
    # each fits, or holds no weight on the GPU and is short by what FlexGen's placement needs beside the weights
    # (its slots of whole tensors, the activations): the search's to reject, as it rejects the flat candidates
    assert all(fits(c) or c.settings["percent"][0] == 0 for c in ref)
    assert all(c.settings["percent"][0] <= by_key[key(c)].settings["percent"][0] for c in ref)
    ok = [fits(c) for c in ref]
    assert ok == sorted(ok, reverse=True)  # those that fit first: the search screens the first few
