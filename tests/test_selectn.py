"""Select-N: the offloading-interval policy, the offline performance record and its runtime choice, and the PCIe
bandwidth coordinator. Real model sizes (OPT-13B, Llama-2-13B), fast: each iteration is a few hundred ops."""
from __future__ import annotations

import random

import pytest

from offsim import OffsimError, Workload, build_plan, get_hardware, get_model, simulate
from offsim.policies.selectn.coordinator import Instance, Option, coordinate, instance_options
from offsim.policies.selectn.policy import SelectNSettings, host_weight_bytes, offloaded_layers
from offsim.policies.selectn.record import (PerformanceRecord, build_record, choose_interval, iteration_latency,
                                   iteration_workload, request_intervals, simulate_phased, switch_seconds)

H200_24 = dict(name_or_path="h200", gpu_mem_gb=24)  # a 24 GiB budget on the H200: OPT-13B (25.7 GB) must offload
TTFT_SLO_S, TPOT_SLO_S = 0.5, 0.1


@pytest.fixture(scope="module")
def opt13b():
    return get_model("opt-13b")


@pytest.fixture(scope="module")
def hw24():
    return get_hardware(**H200_24)


@pytest.fixture(scope="module")
def record(opt13b, hw24):
    return build_record(opt13b, hw24, TTFT_SLO_S, TPOT_SLO_S, batches=(1, 2, 4, 8, 16), seq_lens=(512, 1024))


# ---- the policy -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["opt-13b", "llama-2-13b"])
def test_host_memory_is_monotone_in_interval(name):
    m = get_model(name)
    hw = get_hardware("h200")
    wl = Workload(64, 2, 1, 1)
    L = m.num_layers
    host = [host_weight_bytes(m, n) for n in range(1, L + 2)]
    assert host[0] == L * m.layer_weight_bytes() and host[-1] == 0
    assert all(a >= b for a, b in zip(host, host[1:]))
    assert host[0] > host[1] > host[3]  # N = 1, 2, 4: strictly less offloaded
    prev = None
    for n in (1, 2, 3, 4, 8, 13, 20, L, L + 1):  # the plans agree with the formula
        p = build_plan("selectn", m, hw, wl, {"interval": n})
        assert p.resident["cpu"] == host_weight_bytes(m, n)
        if prev is not None:
            assert p.resident["cpu"] <= prev
        prev = p.resident["cpu"]


def test_plan_streams_exactly_the_offloaded_layers(opt13b):
    hw = get_hardware("h200")
    wl = Workload(128, 3, 2, 1)
    for n in (1, 3, 7):
        plan = build_plan("selectn", opt13b, hw, wl, {"interval": n})
        off = set(offloaded_layers(opt13b.num_layers, n))
        assert off == {j for j in range(opt13b.num_layers) if j % n == n - 1}
        loads = [(op.step, op.layer) for op in plan.ops if op.kind == "h2d" and op.tensor == "weight"]
        assert sorted(loads) == sorted((i, j) for i in range(wl.gen_len) for j in off)  # once per step each
        assert all(op.nbytes == opt13b.layer_weight_bytes() for op in plan.ops if op.tensor == "weight")
        assert not any(op.tensor == "kv" and op.kind in ("h2d", "d2h") for op in plan.ops)  # KV stays on the GPU


def test_more_offloading_is_slower_but_uses_less_gpu(opt13b):
    hw = get_hardware("h200")
    res = {n: iteration_latency(opt13b, hw, "decode", 4, 512, n) for n in (2, 5, 41)}
    assert res[2].latency_s > res[5].latency_s > res[41].latency_s
    assert res[2].gpu_peak_bytes < res[5].gpu_peak_bytes < res[41].gpu_peak_bytes


def test_settings_reject_bad_interval():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(OffsimError, match="interval"):
            SelectNSettings(interval=bad)


# ---- the record -------------------------------------------------------------------------------------------------
def test_record_nmin_meets_slo_and_nmin_minus_one_does_not(record, opt13b, hw24):
    ranges = record.ranges()
    checked = 0
    for r in ranges.itertuples():
        if r.status != "meets":
            continue
        slo = TTFT_SLO_S if r.phase == "prefill" else TPOT_SLO_S
        n_min, n_max = int(r.n_min), int(r.n_max)
        # an independent simulation of the iteration (not the record's own rows)
        wl = iteration_workload(r.phase, r.batch, r.seq_len)
        tr = simulate(build_plan("selectn", opt13b, hw24, wl, {"interval": n_min}), hw24)
        lat = tr.makespan_s if r.phase == "prefill" else tr.step_latency()["latency_s"].iloc[-1]
        assert lat <= slo
        if n_min > 1:
            below = iteration_latency(opt13b, hw24, r.phase, r.batch, r.seq_len, n_min - 1)
            assert below.latency_s is not None and below.latency_s > slo
            checked += 1
        # N_max is the least offloading that fits: N_max + 1 does not
        if n_max <= opt13b.num_layers:
            assert not iteration_latency(opt13b, hw24, r.phase, r.batch, r.seq_len, n_max + 1).fits
    assert checked >= 3


def test_record_terminates_early_and_says_so(record):
    # decode at 1024 cannot meet 100 ms on this budget from some batch b on (4 with the GPU footprint of
    # offsim.core.footprint): the larger batches there are never simulated
    b = next(x for x in (1, 2, 4, 8) if record.point("decode", x, 1024).status == "slo_unreachable")
    pb = record.point("decode", b, 1024)
    assert pb.best_latency_s > TPOT_SLO_S
    assert record.rows("decode", 16, 1024).empty
    p16 = record.point("decode", 16, 1024)
    assert p16.status == "slo_unreachable" and f"terminated early at batch {b}" in p16.note
    with pytest.raises(OffsimError, match="best achievable"):
        choose_interval(record, get_model("opt-13b"), "decode", 8, 1000, strict=True)


def test_record_converges_to_one_past_the_threshold(opt13b):
    # prefill on a 48 GiB H200: the copy of a layer (11.4 ms) hides under one layer's compute from ~16k tokens on
    hw = get_hardware("h200", gpu_mem_gb=48)
    rec = build_record(opt13b, hw, 2.0, 1.0, batches=(16, 32, 64), seq_lens=(256, 512), phases=("prefill",))
    ok = rec.df[rec.df["status"] == "ok"]
    # (64, 256) = 16k tokens: scanned in full, and found converged; (32, 512) = 16k tokens: probed only
    full = ok[(ok["batch"] == 64) & (ok["seq_len"] == 256)]
    assert len(full) == opt13b.num_layers + 1
    assert full["latency_s"].max() <= 1.02 * full["latency_s"].min()
    probed = ok[(ok["batch"] == 32) & (ok["seq_len"] == 512)]
    assert sorted(probed["interval"]) == [1, opt13b.num_layers + 1]  # only N = 1 and N_max are simulated
    assert rec.point("prefill", 32, 512).n_min == 1
    # not converged below the threshold: at 8k tokens N = 1 is still much slower than N_max
    half = ok[(ok["batch"] == 16) & (ok["seq_len"] == 512)].set_index("interval")["latency_s"]
    assert half[1] > 1.3 * half[opt13b.num_layers + 1]
    # the assumption behind the shortcut holds at the probed point: an interval in between is no slower than N = 1
    mid = iteration_latency(opt13b, hw, "prefill", 32, 512, 13)
    assert mid.latency_s <= rec.latency("prefill", 32, 512, 1) * 1.001


def test_record_csv_roundtrip_and_missing_points(record, tmp_path, opt13b):
    path = tmp_path / "rec.csv"
    record.to_csv(path)
    back = PerformanceRecord.from_csv(path)
    assert back.ranges().equals(record.ranges())
    with pytest.raises(OffsimError, match=r"does not cover decode batch 64, seq_len 300"):
        back.point("decode", 64, 300)
    with pytest.raises(OffsimError, match="seq_len 4096"):
        back.point("prefill", 1, 4096)
    # a looser SLO than the record was built for: the intervals below the scan were never measured
    with pytest.raises(OffsimError, match="rebuild it with an SLO"):
        back.point("decode", 1, 512, slo_s=10.0)
    path.write_text("phase,batch\n")
    with pytest.raises(OffsimError, match="metadata"):
        PerformanceRecord.from_csv(path)


def test_runtime_choice_per_iteration(record, opt13b, hw24):
    c = choose_interval(record, opt13b, "decode", 3, 300)  # covered by the (4, 512) point
    assert (c.point.batch, c.point.seq_len) == (4, 512) and c.meets_slo and c.interval == c.point.n_min
    # from a smaller N, a larger one costs the reload of the layers that become resident
    assert switch_seconds(opt13b, hw24, 1, 5) > 0 and switch_seconds(opt13b, hw24, 5, 1) == 0
    wl = Workload(500, 8, 2, 1)
    ch = request_intervals(record, opt13b, hw24, wl)
    assert len(ch) == wl.gen_len and all(x.meets_slo for x in ch)
    res = simulate_phased(opt13b, hw24, wl, [x.interval for x in ch])
    assert res["ttft_s"] <= TTFT_SLO_S and max(res["tpot_s"]) <= TPOT_SLO_S


# ---- the coordinator ----------------------------------------------------------------------------------------------
def _random_instances(rng: random.Random) -> list[Instance]:
    out = []
    for i in range(rng.randint(1, 4)):
        opts = tuple(Option(n, rng.randint(0, 12) * 629_278_720, rng.randint(0, 40), 0.05)
                     for n in range(1, rng.randint(2, 7)))
        out.append(Instance(f"gpu{i}", 0.1, opts))
    return out


def test_coordinator_matches_brute_force_and_never_oversubscribes():
    rng = random.Random(4)
    solved = 0
    for _ in range(100):
        insts = _random_instances(rng)
        try:
            ref = coordinate(insts, "brute")
        except OffsimError as e:
            assert "oversubscribed" in str(e)
            assert sum(min(o.share_units for o in i.options) for i in insts) > 40
            continue
        for method in ("dp", "milp"):
            a = coordinate(insts, method)
            assert a.share_units <= a.grid  # the link is never oversubscribed
            assert [c in i.options for c, i in zip(a.choices, insts)] == [True] * len(insts)
            assert a.host_bytes == ref.host_bytes
        solved += 1
    assert solved > 50


def test_coordinator_on_two_13b_instances_sharing_pcie4():
    hw = get_hardware("a800", gpu_mem_gb=32)  # PCIe 4.0 x16, 26 GB/s, shared by two GPUs
    ns = (41, 40, 20, 13, 10, 8)
    insts = [instance_options(get_model(m), hw, "decode", 4, 512, TPOT_SLO_S, intervals=ns)
             for m in ("opt-13b", "llama-2-13b")]
    a = coordinate(insts, "milp")
    assert a.share_units <= a.grid
    assert a.host_bytes == coordinate(insts, "brute").host_bytes
    for name, c in zip(a.names, a.choices):  # each instance meets its SLO with its share, re-simulated
        lat = iteration_latency(get_model(name), c.hardware(hw, a.grid), "decode", 4, 512, c.interval)
        assert lat.latency_s <= TPOT_SLO_S
    # alone, each would take more of the link than half: the joint choice offloads less than the two solo choices
    solo = sum(coordinate([i], "dp").host_bytes for i in insts)
    assert a.host_bytes < solo


def test_coordinator_reports_what_cannot_be_served():
    hw = get_hardware("a800", gpu_mem_gb=32)
    # 10 ms TPOT: faster than OPT-13B's weights can even be read from HBM at batch 16
    inst = instance_options(get_model("opt-13b"), hw, "decode", 16, 512, 0.01, intervals=(41, 20, 10, 5, 2))
    assert not inst.options and "best achievable" in inst.note
    with pytest.raises(OffsimError, match=r"no interval meets the decode SLO 10.0 ms .* best achievable"):
        coordinate([inst])
    oom = instance_options(get_model("opt-13b"), hw, "decode", 64, 512, 0.1, intervals=(41, 20, 10, 5, 2))
    with pytest.raises(OffsimError, match="no interval fits GPU memory at decode batch 64"):
        coordinate([oom])
    hungry = Instance("a", 0.1, (Option(4, 1, 30, 0.05),))
    with pytest.raises(OffsimError, match="oversubscribed even with the least offloading"):
        coordinate([hungry, hungry])
    with pytest.raises(OffsimError, match="method"):
        coordinate([Instance("x", 0.1, (Option(2, 1, 1, 0.05),))], "greedy")


def test_candidates_cover_every_offload_count_once(opt13b):
    from offsim.core import footprint as fp
    from offsim.policies.selectn.policy import selectn_candidates, selectn_schedule

    cands = list(selectn_candidates(opt13b, get_hardware(**H200_24), 480, 32))
    by_batch: dict[int, list[int]] = {}
    for st, wl, _ in cands:
        assert wl.num_gpu_batches == 1 and SelectNSettings(**st).interval >= 1
        by_batch.setdefault(wl.gpu_batch_size, []).append(st["interval"])
    counts = [len(offloaded_layers(opt13b.num_layers, n)) for n in by_batch[1]]
    # every offload count once, except those whose GPU footprint (resident layers, KV, slots, op peak) overflows
    hw = get_hardware(**H200_24)
    wl1 = Workload(480, 32, 1, 1)
    fits = {len(offloaded_layers(opt13b.num_layers, n)) for n in range(1, 42)
            if sum(fp.placement_tier_bytes(opt13b, wl1, selectn_schedule(opt13b, n).placement())["gpu"].values())
            <= hw.gpu_mem_bytes}
    assert sorted(counts) == sorted(set(counts)) and set(counts) == fits and 0 not in fits
    assert max(by_batch) < 256  # stops where the KV cache alone outgrows the 24 GiB GPU


def test_results_readme_is_generated_from_the_committed_csvs():
    """results/selectn/README.md is what experiments.selectn.write_readme makes of the committed CSVs: its summary
    rows are the summary CSV's, so an edited CSV or README shows up here."""
    from pathlib import Path

    import pandas as pd

    from experiments.selectn import write_readme as W

    root = Path(__file__).resolve().parents[1] / "results" / "selectn"
    if not (root / "slo_h200_24gib_p480_summary.csv").exists():
        pytest.skip("no committed Select-N results")
    text = W.build()
    s = pd.read_csv(root / "slo_h200_24gib_p480_summary.csv")
    for r in s[s["attain_points"] > 0].itertuples():
        assert f"{r.goodput_tok_s:.1f} ({r.goodput_batch})" in text
    for head in ("## 1. SLO", "## 2. Two 13B", "## 3. Prefill", "## Published claims"):
        assert head in text
    body = lambda t: t.split("\n", 3)[3]  # past the line naming the generating commit
    assert body(text) == body((root / "README.md").read_text())
