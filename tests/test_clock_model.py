"""The GPU clock's response to load (costmodel.ClockModel, sim._Clock): the window recovered from a settling curve,
the moving average, both engines alike, and what it predicts -- a GPU that waits for its weights part of the time
keeps a faster clock than a GPU computing back to back. Without the profile's clock rows nothing changes."""
import dataclasses
import math

import pandas as pd
import pytest

from offsim import Workload, build_plan
from offsim.core import costmodel as C
from offsim.core.sim import simulate, simulate_simpy
from offsim.core.specs import layer_key


SUSTAINED = 0.84
DUTY = ((0.3, 1.0), (0.6, 1.0), (0.8, 0.93), (1.0, SUSTAINED))  # burst up to 60 % busy, then falling


def _held(duty, window_s: float, ends=(0.05, 0.1, 0.2, 0.4, 0.8)) -> tuple:
    """Settling windows from idle as ``ClockModel`` predicts them (each window's mean fraction)."""
    out, a = [], 0.0
    for b in ends:
        ts = [a + (b - a) * (j + 0.5) / 64 for j in range(64)]
        out.append((b, sum(C.table_seconds(duty, 1 - math.exp(-t / window_s), True) for t in ts) / 64))
        a = b
    return tuple(out)


def _clocked_hw(hw, model, window_s: float = 0.03):
    """``hw`` with clock rows for ``model``, slowed so that a tiny model's ops take what a real one's do: its
    prefill ops compute-bound (ridge point 16 rows) and ~10 ms long, a layer's weights ~100 ms over the link."""
    key = layer_key(model)
    rows = (*hw.op_times, [key, "clock", "duty", [list(p) for p in DUTY]],
            [key, "clock", "held", [list(p) for p in _held(DUTY, window_s)]])
    return dataclasses.replace(hw, name=hw.name + "-clock", op_times=rows, gpu_hbm_bytes_per_s=1e8,
                               gpu_peak_flops=16e8).scaled_link(3e-5)


def test_window_is_recovered_from_the_settling_curve():
    for w in (0.01, 0.03, 0.2):
        assert C.fit_window(DUTY, _held(DUTY, w)) == pytest.approx(w, rel=0.03)


def test_busy_share_averages_over_the_window():
    w = 0.05
    u = C.ClockModel.advance(0.0, w, 0.0, w)
    assert u == pytest.approx(1 - math.exp(-1))
    assert C.ClockModel.advance(u, 0.0, w, w) == pytest.approx(u * math.exp(-1))
    assert C.ClockModel.advance(0.0, 100 * w, 0.0, w) == pytest.approx(1.0)
    m = C.ClockModel(DUTY, w)
    assert m.speedup(1.0) == 1.0 and m.speedup(0.5) == pytest.approx(1 / SUSTAINED)
    assert m.speedup(0.9) == pytest.approx((0.93 + SUSTAINED) / 2 / SUSTAINED)


def test_no_clock_rows_no_model(tiny_opt, t4):
    assert C.clock_model(t4, tiny_opt) is None
    hw = _clocked_hw(t4, tiny_opt)
    assert C.clock_model(hw, tiny_opt).window_s == pytest.approx(0.03, rel=0.03)
    other = dataclasses.replace(tiny_opt, d_model=128, ffn_dim=512, head_dim=32)  # another layer shape: no rows
    assert C.clock_model(hw, other) is None


def _plans(model, hw):
    wl = Workload(prompt_len=24, gen_len=3, gpu_batch_size=4, num_gpu_batches=2)
    streamed = build_plan("flexgen", model, hw, wl, {"percent": [0, 100, 100, 0, 100, 0]})  # weights on the host
    resident = build_plan("flexgen", model, hw, wl, {"percent": [100, 0, 100, 0, 100, 0]})  # weights on the GPU
    # TightLLM, recomputing part of the host-homed KV: decode ops of N_r + 1 tokens, compute-bound past the ridge
    recompute = build_plan("tightllm", model, hw, wl, {"percent": [40, 60, 0, 100, 100, 0], "kv_solver": "exact"})
    return streamed, resident, recompute


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("window_s", [0.002, 0.03])
def test_both_engines_apply_the_clock_alike(tiny_opt, t4, which, window_s):
    hw = _clocked_hw(t4, tiny_opt, window_s)
    plan = _plans(tiny_opt, hw)[which]
    a, b = simulate(plan, hw), simulate_simpy(plan, hw)
    pd.testing.assert_frame_equal(a.df, b.df, check_exact=True)


def _prefill_speedups(plan, hw) -> list[float]:
    """Each compute-bound prefill decoder op's price over its simulated duration."""
    tr = simulate(plan, hw)
    df = tr.df
    out = []
    for op, (s, e) in zip(plan.ops, zip(df["start_s"], df["end_s"])):
        if op.kind == "compute" and op.phase == "prefill" and op.part in ("layer", "attn_layer", "mlp") \
                and C.clock_bound(hw, op.num_seqs * op.q_tokens):
            out.append(C.op_seconds(op, plan.model, hw) / (e - s))
    return out


def test_a_gpu_waiting_for_its_weights_keeps_a_faster_clock(tiny_opt, t4):
    """With the weights streamed over the link the GPU computes a small share of the time: its compute-bound ops
    run up to the burst rate (price x the sustained fraction); with every weight resident it computes back to back
    and its ops settle at their price. Without the rows, every op at its price."""
    hw = _clocked_hw(t4, tiny_opt, window_s=0.002)
    streamed, resident, _ = _plans(tiny_opt, hw)
    fast = _prefill_speedups(streamed, hw)
    assert fast and max(fast) == pytest.approx(1 / SUSTAINED, rel=1e-6) and min(fast) >= 1.0
    busy = _prefill_speedups(resident, hw)
    assert busy and busy[0] > busy[-1] and busy[-1] == pytest.approx(1.0, abs=0.02)  # the first runs faster
    plain = dataclasses.replace(hw, op_times=tuple(r for r in hw.op_times if r[1] != "clock"))
    p_streamed = _plans(tiny_opt, plain)[0]
    assert all(x == pytest.approx(1.0) for x in _prefill_speedups(p_streamed, plain))
    assert simulate(p_streamed, plain).metrics()["prefill_s"] > simulate(streamed, hw).metrics()["prefill_s"]
