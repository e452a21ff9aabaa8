"""Unpinned copies staged through a pinned copy (FlexGen's ``general_copy``): the profile's relay curves, the plan's
``pageable_copy``, and how the cost model and both engines price them."""
import json

import pandas as pd
import pytest

from offsim import Workload, build_plan
from offsim.core import costmodel as C
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan, PlanError
from offsim.core.sim import simulate, simulate_simpy
from offsim.core.specs import HardwareSpec, get_hardware

GB = 1e9
RELAY = [[1 << 20, 8 * GB], [1 << 30, 12 * GB]]  # between the H200 preset's pageable and pinned rates


@pytest.fixture
def h200_relay():
    return get_hardware("h200").with_(h2d_relay=RELAY, d2h_relay=RELAY)


def check_ref_field(ref, ideal, hw, plain, field: str, value, bad) -> None:
    """A flexgen-ref plan field that the ideal plan leaves unset: the ref plan is slower on ``hw`` than on ``plain``,
    the ideal plan's trace does not change, both engines agree on the ref plan; the field round-trips, enters the
    fingerprint only when set, and ``bad`` is refused by name."""
    assert getattr(ref, field) == value and not getattr(ideal, field)
    assert simulate(ref, hw).metrics()["total_s"] > simulate(ref, plain).metrics()["total_s"]
    pd.testing.assert_frame_equal(simulate(ideal, hw).df, simulate(ideal, plain).df, check_exact=True)
    pd.testing.assert_frame_equal(simulate(ref, hw).df, simulate_simpy(ref, hw).df, check_exact=True)
    back = Plan.from_dict(json.loads(json.dumps(ref.to_dict())))
    assert getattr(back, field) == value and back.fingerprint() == ref.fingerprint()
    d = ref.to_dict()
    d.pop(field)
    assert Plan.from_dict(d).fingerprint() != ref.fingerprint()
    assert field not in ideal.to_dict()
    d[field] = bad
    with pytest.raises(PlanError, match=f"{field} must be"):
        Plan.from_dict(d).validate()


def test_relay_curves_round_trip_and_are_checked(h200_relay):
    back = HardwareSpec.from_dict(json.loads(json.dumps(h200_relay.to_dict())))
    assert back.h2d_relay == h200_relay.h2d_relay and back.d2h_relay == h200_relay.d2h_relay
    assert "h2d_relay" not in get_hardware("h200").to_dict()  # not measured: left out of the file
    assert h200_relay.scaled_link(2.0).h2d_relay[-1][1] == 2 * RELAY[-1][1]
    with pytest.raises(OffsimError, match="h2d_relay must be a list of positive"):
        h200_relay.with_(h2d_relay=[[1 << 30, 1e9], [1 << 20, 1e9]])


def test_relay_prices_unpinned_copies_only(h200_relay):
    n = 1 << 30
    plain = get_hardware("h200")
    assert C.link_bytes_per_s(h200_relay, n, "h2d", pinned=False, relay=True) == pytest.approx(12 * GB)
    assert C.link_bytes_per_s(h200_relay, n, "h2d", pinned=False) == C.link_bytes_per_s(plain, n, "h2d", False)
    assert C.link_bytes_per_s(h200_relay, n, "d2h", pinned=True, relay=True) == C.link_bytes_per_s(plain, n, "d2h")
    # not measured: a relay copy is priced as a pageable one
    assert C.link_bytes_per_s(plain, n, "h2d", pinned=False, relay=True) == C.link_bytes_per_s(plain, n, "h2d", False)


def test_flexgen_ref_plans_relay_their_kv(tiny_opt):
    """flexgen-ref's KV is unpinned and relayed: with a relay far slower than the pageable rate its run is slower,
    with the same trace in both engines; the ideal flexgen plan (pinned KV, no relay) does not change. The field
    round-trips, enters the fingerprint and is checked."""
    plain = get_hardware("h200")
    slow = [[1 << 20, 0.1 * GB], [1 << 30, 0.1 * GB]]
    hw = plain.with_(h2d_relay=slow, d2h_relay=slow)
    wl = Workload(32, 4, 4, 2)
    st = {"percent": (0, 100, 0, 100, 100, 0)}
    ref = build_plan("flexgen-ref", tiny_opt, hw, wl, st)
    ideal = build_plan("flexgen", tiny_opt, hw, wl, st)
    assert any(not o.pinned for o in ref.ops if o.kind in ("h2d", "d2h"))
    check_ref_field(ref, ideal, hw, plain, "pageable_copy", "relay", "dma")


def test_flexgen_ref_prices_its_own_dequantize_from_the_profile_rows(tiny_opt):
    """flexgen-ref's compressed plans run FlexGen's own decompress (``Plan.quant_impl`` 'flexgen'): with the
    profile's 'dequant_flexgen:*' rows a compute op pays them (by fp16 bytes: weights of the part, the cache it
    reads), without them offexec's rates stand in; the ideal flexgen plan never reads them. Same trace in both
    engines; the field round-trips, enters the fingerprint and is checked."""
    from offsim.core.specs import layer_key

    plain = get_hardware("h200")
    key = layer_key(tiny_opt)
    slow = [[1e3, 1e-3], [1e9, 1.0]]  # 1 GB/s: far below offexec's rates
    hw = plain.with_(op_times=[[key, "quant", "dequant_flexgen:weight", slow],
                               [key, "quant", "dequant_flexgen:cache", slow]])
    comp = C.Compression(weight=True, cache=True)
    fast = C.quant_seconds(tiny_opt, plain, "mlp", 4, 1, 64, comp, "flexgen")
    assert fast == C.quant_seconds(tiny_opt, plain, "mlp", 4, 1, 64, comp)  # no rows: offexec's rates
    w_bytes = C.gemm_flops_per_token(tiny_opt, "mlp") / 2 * tiny_opt.dtype_bytes
    assert C.quant_seconds(tiny_opt, hw, "mlp", 4, 1, 64, comp, "flexgen") == pytest.approx(
        C.table_seconds(slow, w_bytes))
    cached = 4 * 63 * tiny_opt.kv_bytes_per_token()
    attn = C.quant_seconds(tiny_opt, hw, "attn_layer", 4, 1, 64, comp, "flexgen")
    assert attn > C.table_seconds(slow, cached) > C.quant_seconds(tiny_opt, hw, "attn_layer", 4, 1, 64, comp)

    wl = Workload(32, 4, 4, 2)
    st = {"percent": (0, 100, 0, 100, 100, 0), "compress_weight": True, "compress_cache": True}
    ref = build_plan("flexgen-ref", tiny_opt, hw, wl, st)
    ideal = build_plan("flexgen", tiny_opt, hw, wl, st)
    check_ref_field(ref, ideal, hw, plain, "quant_impl", "flexgen", "bnb")


def test_flexgen_ref_stages_its_h2d_relays_on_the_issuing_thread(tiny_opt):
    """FlexGen's general_copy pins an unpinned source on the calling thread before the asynchronous copy (its D2H
    relays go to copy threads): where the profile measured the relay and prices issuing, an unpinned H2D copy of a
    relay plan moves on its stream at the pinned rate and its staging (relay time less the pinned copy's) is issue
    time; without issue costs the stream takes the whole relay, as before. Same trace in both engines."""
    plain = get_hardware("h200")
    slow = [[1 << 20, 2 * GB], [1 << 30, 2 * GB]]  # a slow relay: the staging dominates
    n = 1 << 26
    no_issue = plain.with_(h2d_relay=slow, d2h_relay=slow)
    issued = no_issue.with_(issue_copy_s=1e-5, issue_compute_s=1e-5)
    assert not C.relay_staged_by_issuer(no_issue, "h2d") and C.relay_staged_by_issuer(issued, "h2d")
    assert not C.relay_staged_by_issuer(issued, "d2h")
    assert C.link_bytes_per_s(no_issue, n, "h2d", pinned=False, relay=True) == pytest.approx(2 * GB)
    assert C.link_bytes_per_s(issued, n, "h2d", pinned=False, relay=True) == C.link_bytes_per_s(plain, n, "h2d")
    assert C.link_bytes_per_s(issued, n, "d2h", pinned=False, relay=True) == pytest.approx(2 * GB)
    stage = C.relay_staging_seconds(issued, n)
    assert stage == pytest.approx(n / (2 * GB) - n / C.link_bytes_per_s(plain, n, "h2d"))

    class Copy:
        kind, tensor, nbytes, pinned = "h2d", "kv", n, False

    assert C.issue_seconds(Copy, issued, 0, None, relay=True) == pytest.approx(issued.issue_copy_s + stage)
    assert C.issue_seconds(Copy, issued, 0, None) == issued.issue_copy_s  # not a relay plan
    wl = Workload(32, 4, 4, 2)
    ref = build_plan("flexgen-ref", tiny_opt, issued, wl, {"percent": (0, 100, 0, 100, 100, 0)})
    df = simulate(ref, issued).df
    pd.testing.assert_frame_equal(df, simulate_simpy(ref, issued).df, check_exact=True)
    slower = issued.with_(h2d_relay=[[1 << 20, 1 * GB], [1 << 30, 1 * GB]], d2h_relay=slow)
    assert simulate(ref, slower).metrics()["total_s"] > simulate(ref, issued).metrics()["total_s"]
    # the KV loads' stream time is the pinned copy's: the same under either relay rate
    kv = [o.id for o in ref.ops if o.kind == "h2d" and not o.pinned and o.nbytes]
    assert kv
    d1, d2 = simulate(ref, issued).df, simulate(ref, slower).df
    assert ((d1.end_s - d1.start_s)[kv] - (d2.end_s - d2.start_s)[kv]).abs().max() < 1e-9 + 0.5 * (
        d1.end_s - d1.start_s)[kv].max()


def test_flexgen_ref_issues_each_position_after_the_previous_one_ends(tiny_opt):
    """flexgen-ref's runtime waits for every dependency of an op before issuing it (``Plan.issue_waits_for_deps``:
    FlexGen's sync() blocks its main loop), so where issuing costs time that time adds to each position instead of
    hiding under the GPU's work; with free issue (the presets) it changes nothing. The field round-trips, enters
    the fingerprint and is checked; both engines agree."""
    plain = get_hardware("h200")
    costly = plain.with_(issue_copy_s=2e-4, issue_compute_s=2e-4)
    wl = Workload(32, 4, 4, 2)
    st = {"percent": (0, 100, 0, 100, 100, 0)}
    ref = build_plan("flexgen-ref", tiny_opt, costly, wl, st)
    assert ref.issue_waits_for_deps and not build_plan("flexgen", tiny_opt, costly, wl, st).issue_waits_for_deps
    free = Plan.from_dict({**ref.to_dict(), "issue_waits_for_deps": False})
    assert simulate(ref, costly).metrics()["total_s"] > simulate(free, costly).metrics()["total_s"]
    pd.testing.assert_frame_equal(simulate(ref, plain).df, simulate(free, plain).df, check_exact=True)
    pd.testing.assert_frame_equal(simulate(ref, costly).df, simulate_simpy(ref, costly).df, check_exact=True)
    back = Plan.from_dict(json.loads(json.dumps(ref.to_dict())))
    assert back.issue_waits_for_deps and back.fingerprint() == ref.fingerprint() != free.fingerprint()
    assert "issue_waits_for_deps" not in free.to_dict()
    with pytest.raises(PlanError, match="issue_waits_for_deps must be true or false"):
        Plan.from_dict({**ref.to_dict(), "issue_waits_for_deps": "yes"}).validate()


@pytest.mark.parametrize("compress", [False, True])
def test_flexgen_ref_prices_its_prefill_kv_store_from_the_store_rows(tiny_opt, compress):
    """FlexGen's own store of a prefill's K and V into its fresh, unpinned host cache (its copy threads, a float16
    relay): where the profile has the 'store_flexgen:fp16' / ':4bit' row (``offexec profile --flexgen-only``),
    flexgen-ref's multi-position KV D2H copies cost that row at their bytes, the row of the plan's cache format;
    a decode token's one-position store (its plain path), the H2D loads and the ideal flexgen plan do not read it.
    Both engines agree."""
    from offsim.core.specs import layer_key

    plain = get_hardware("h200")
    key = layer_key(tiny_opt)
    slow = [[1e3, 1e-3], [1e9, 1.0]]  # 1 GB/s: far below the relay and pageable rates
    other = "store_flexgen:fp16" if compress else "store_flexgen:4bit"
    mine = "store_flexgen:4bit" if compress else "store_flexgen:fp16"
    hw = plain.with_(op_times=[[key, "copy", mine, slow], [key, "copy", other, [[1e3, 1e-9], [1e9, 1e-9]]]])
    wl = Workload(32, 4, 4, 2)
    st = {"percent": (0, 100, 0, 100, 100, 0), "compress_cache": compress}
    ref = build_plan("flexgen-ref", tiny_opt, hw, wl, st)
    comp = C.Compression(cache=compress)
    stores = [o for o in ref.ops if o.kind == "d2h" and o.tensor == "kv"]
    multi = [o for o in stores if o.hi - o.lo > 1]
    assert multi and all(not o.pinned for o in multi)
    for o in multi:
        assert C.op_seconds(o, tiny_opt, hw, comp=comp, pageable_copy="relay") == pytest.approx(
            C.table_seconds(slow, o.nbytes))
        assert C.duplex_rate(o, tiny_opt, hw, "relay", comp) is None  # the row is its whole price
        assert C.op_seconds(o, tiny_opt, plain, comp=comp, pageable_copy="relay") < C.table_seconds(slow, o.nbytes)
    for o in ref.ops:  # everything else priced as without the rows
        if o not in multi and o.kind in ("h2d", "d2h"):
            assert C.op_seconds(o, tiny_opt, hw, comp=comp, pageable_copy="relay") == \
                C.op_seconds(o, tiny_opt, plain, comp=comp, pageable_copy="relay")
    assert simulate(ref, hw).metrics()["prefill_s"] > simulate(ref, plain).metrics()["prefill_s"]
    pd.testing.assert_frame_equal(simulate(ref, hw).df, simulate_simpy(ref, hw).df, check_exact=True)
    ideal = build_plan("flexgen", tiny_opt, hw, wl, st)
    pd.testing.assert_frame_equal(simulate(ideal, hw).df, simulate(ideal, plain).df, check_exact=True)


def test_peer_plans_issue_kernel_by_kernel(tiny_opt):
    """FlexGen, Accelerate and DeepSpeed launch every kernel from Python: their *-ref plans have cuda_graphs off
    (priced by the eager rows and issue costs where a profile has them), the ideal policies' plans keep them on."""
    hw = get_hardware("h200")
    wl, one = Workload(32, 4, 4, 2), Workload(32, 4, 4, 1)  # (the static policies run one GPU batch)
    for pol, w, st in (("flexgen-ref", wl, {"percent": (0, 100, 0, 100, 100, 0)}), ("static-accelerate-ref", one, {}),
                       ("static-zero-ref", one, {})):
        assert build_plan(pol, tiny_opt, hw, w, st).graph_q_tokens == 0, pol
    assert build_plan("flexgen", tiny_opt, hw, wl, {"percent": (0, 100, 0, 100, 100, 0)}).graph_q_tokens > 0
    assert build_plan("static-zero", tiny_opt, hw, one, {}).graph_q_tokens > 0
