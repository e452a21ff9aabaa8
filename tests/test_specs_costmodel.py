"""Specs (sizes as FlexGen counts them, config loading, hardware profiles) and cost-model terms by hand."""
import json
import math

import pytest

from offsim.core import costmodel as cm
from offsim.core.errors import OffsimError
from offsim.core.specs import (HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec, Workload, get_hardware,
                          get_model)

GiB = 1 << 30


@pytest.mark.parametrize("name,flexgen_gb", [("opt-6.7b", 12.386), ("opt-30b", 55.803), ("opt-66b", 122.375),
                                              ("opt-175b", 325.175)])
def test_opt_sizes_match_flexgen(name, flexgen_gb):
    m = get_model(name)
    assert round(m.flexgen_model_bytes() / GiB, 3) == flexgen_gb  # FlexGen's own accounting, exactly
    # ours counts every bias and the position table: within 0.2 % of FlexGen's
    assert abs(m.weight_bytes() / GiB - flexgen_gb) / flexgen_gb < 2e-3


def test_kv_bytes_opt_and_gqa():
    opt = get_model("opt-30b")
    assert opt.kv_bytes(1, 1) == 4 * 7168 * 48  # 4·h bytes per token per layer (K and V, fp16)
    llama = get_model("llama-3-8b")
    assert llama.kv_bytes_per_token() == 4 * 8 * 128  # 4 · n_kv · d_head


def test_every_preset_builds():
    for name in MODEL_PRESETS:
        m = get_model(name)
        assert m.weight_bytes() > 0
    for name in HARDWARE_PRESETS:
        assert get_hardware(name).gpu_mem_bytes > 0


def test_model_from_transformers_config_and_json(tmp_path):
    from transformers import LlamaConfig, OPTConfig

    m = ModelSpec.from_hf_config(OPTConfig(**get_model("opt-1.3b").to_hf_config_dict()), name="x")
    assert (m.num_layers, m.d_model, m.ffn_dim) == (24, 2048, 8192)
    cfg = LlamaConfig(**get_model("llama-2-70b").to_hf_config_dict())
    p = tmp_path / "config.json"
    p.write_text(cfg.to_json_string())
    m2 = get_model(str(p))
    assert (m2.num_kv_heads, m2.head_dim, m2.family) == (8, 128, "llama")
    assert m2.layer_weight_bytes() == get_model("llama-2-70b").layer_weight_bytes()


def test_unknown_names_list_valid_ones():
    with pytest.raises(OffsimError, match="opt-30b"):
        get_model("gpt-5")
    with pytest.raises(OffsimError, match="rtx3090"):
        get_hardware("tpu")


def test_hardware_profile_roundtrip_and_errors(tmp_path):
    hw = get_hardware("h200")
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(hw.to_dict()))
    assert HardwareSpec.from_json(p) == hw
    d = hw.to_dict()
    d["schema"] = "offsim.hardware/0"
    p.write_text(json.dumps(d))
    with pytest.raises(OffsimError, match="schema"):
        HardwareSpec.from_json(p)
    p.write_text("{not json")
    with pytest.raises(OffsimError, match="not valid JSON"):
        HardwareSpec.from_json(p)
    d = hw.to_dict()
    d["h2d_pinned"] = [[1, -5]]
    p.write_text(json.dumps(d))
    with pytest.raises(OffsimError, match="h2d_pinned"):
        HardwareSpec.from_json(p)


def test_workload_rejects_non_positive():
    with pytest.raises(OffsimError, match="prompt-len"):
        Workload(0, 32)
    with pytest.raises(OffsimError, match="gpu-batch-size"):
        Workload(8, 8, -1)


def test_interp_log_linear_and_clamped():
    c = ((1.0, 10.0), (100.0, 30.0))
    assert cm.interp(c, 0.5) == 10.0 and cm.interp(c, 1e9) == 30.0
    assert cm.interp(c, 10.0) == pytest.approx(20.0)  # halfway in log space


def test_transfer_seconds_by_hand():
    hw = get_hardware("t4")  # flat 12.89 GiB/s pinned, 10 us latency
    n = 1 << 30
    assert cm.transfer_seconds(hw, n, "h2d") == pytest.approx(10e-6 + 1 / 12.89)
    assert cm.transfer_seconds(hw, n, "h2d", pinned=False) == pytest.approx(10e-6 + 2 / 12.89)
    # duplex: the first 0.01 s at 90 % bandwidth, the rest at full
    bw = 12.89 * GiB
    expect = 10e-6 + 0.01 + (n - 0.9 * bw * 0.01) / bw
    assert cm.transfer_seconds(hw, n, "h2d", other_busy_s=0.01) == pytest.approx(expect)
    assert cm.transfer_seconds(hw, 0, "d2h") == 0.0
    assert cm.disk_seconds(hw, 2.65e9, "read") == pytest.approx(1.0)


def test_size_dependent_bandwidth_h200():
    hw = get_hardware("h200")
    small, big = cm.link_bytes_per_s(hw, 1 << 20, "h2d"), cm.link_bytes_per_s(hw, 1 << 30, "h2d")
    assert small == pytest.approx(43.71e9) and big == pytest.approx(55.16e9)


def test_gemm_and_attention_by_hand():
    hw = get_hardware("h200")
    m = get_model("opt-30b")
    h = 7168
    # one token through a layer: 2·(3h·h + h·h + 2·h·4h) FLOPs at the 1-token efficiency
    flops = 2 * (4 * h * h + 8 * h * h)
    assert cm.gemm_flops_per_token(m, "layer") == flops
    eff = 4.10e12 / 989e12
    assert cm.gemm_seconds(hw, 1, flops) == pytest.approx(flops / (989e12 * eff))
    # decode attention is memory-bound: KV bytes / (HBM · efficiency at that context)
    kv = 8 * 2048 * m.kv_bytes_per_token()
    assert cm.attention_seconds(m, hw, 8, 1, 2048) == pytest.approx(kv / 4.08e12)
    # causal prefill: s(s+1)/2 query-key pairs
    assert cm.attention_flops(m, 1, 4, 4) == 4 * 10 * 56 * 128


def test_cost_terms_accept_cvxpy_expressions():
    import cvxpy as cp

    hw = get_hardware("t4")
    x = cp.Variable(nonneg=True)
    e = cm.transfer_seconds(hw, x * 1e9, "h2d") + cm.disk_seconds(hw, x * 1e9, "read")
    prob = cp.Problem(cp.Minimize(e), [x >= 0.5])
    prob.solve(solver=cp.HIGHS)
    assert prob.value == pytest.approx(10e-6 + 0.5e9 / (12.89 * GiB) + 0.5e9 / 2.65e9, rel=1e-6)
    assert math.isfinite(prob.value)


@pytest.mark.parametrize("name", ["t4", "rtx3090", "a800", "h200", "results/profiles/h200_offexec_v2.json"])
def test_gemm_time_lies_on_the_line_between_measured_points(name):
    """A GEMM's time over its tokens follows a roofline, piecewise linear: between two measured points it is priced
    on the straight line between their times, so it never leaves the range they span, and more rows never take less
    time where the measurements do not say so. (Log-linear interpolation of the efficiency priced two decode tokens
    27 % faster than one on the h200 preset, its weights read past the card's HBM bandwidth.)"""
    from pathlib import Path

    ref = str(Path(__file__).resolve().parents[1] / name) if name.endswith(".json") else name
    hw = get_hardware(ref)
    flops_per_token = 2 * 8192 * 8192
    pts = [(x, cm.gemm_seconds(hw, x, flops_per_token * x)) for x, _ in hw.gemm_efficiency]
    for (x0, s0), (x1, s1) in zip(pts, pts[1:]):
        prev = s0
        for t in range(int(x0) + 1, int(x1) + 1):
            s = cm.gemm_seconds(hw, t, flops_per_token * t)
            assert min(s0, s1) * (1 - 1e-9) <= s <= max(s0, s1) * (1 + 1e-9), (name, t)
            assert (s >= prev * (1 - 1e-9)) if s1 >= s0 else (s <= prev * (1 + 1e-9)), (name, t)
            prev = s
    for x, y in hw.gemm_efficiency:  # the measured points themselves are kept
        assert cm.gemm_efficiency(hw.gemm_efficiency, x) == pytest.approx(y)
    if not name.endswith(".json"):  # the presets' curves are monotone in time: so is every token count between
        assert all(s1 >= s0 for (_, s0), (_, s1) in zip(pts, pts[1:]))
