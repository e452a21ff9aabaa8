"""The worked example of docs/architecture.md ("How a policy is added"), run for real: a small policy defined here,
registered in a copy of the registry, planned, validated, simulated and searched like the built-in ones.

The policy, ``gpu-share``: keep the same share of every decoder layer's weights on the GPU and stream the rest from
pinned host memory, prefetching the next layer; the KV cache stays on the GPU; one GPU batch. It sits between
ZeRO-Inference (0 % on the GPU) and an all-GPU run (100 %).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import pytest

from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.core.sim import simulate
from offsim.core.specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from offsim.policies import registry
from offsim.policies.base import Candidate, Policy, capacity_of, weight_split_from_percent
from offsim.policies.schedule import Schedule, build_block_plan


# 1. the settings: a frozen dataclass of the policy's inputs, with defaults, checked on construction
@dataclass(frozen=True)
class GpuShareSettings:
    """``gpu_percent``: share of every decoder layer's weights kept on the GPU; the rest is streamed from pinned
    host memory."""

    gpu_percent: float = 50.0

    def __post_init__(self):
        if not 0 <= self.gpu_percent <= 100:
            raise OffsimError(f"gpu_percent must be in [0, 100], got {self.gpu_percent}")


# 2. the plan builder: describe placement and pipelining as a Schedule, let the shared block schedule emit the ops
def _gpu_share_schedule(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: GpuShareSettings) -> Schedule:
    if wl.num_gpu_batches != 1:
        raise OffsimError("gpu-share runs one GPU batch at a time: use --num-gpu-batches 1")
    split = weight_split_from_percent(model, st.gpu_percent, 100 - st.gpu_percent)  # bytes (gpu, cpu) of a layer
    return Schedule(policy="gpu-share", weight_split=(split,) * model.num_layers,
                    kv_split=(model.num_kv_heads, 0),  # all KV heads on the GPU
                    prefetch=True, overlap=True, pinned=True, settings=(("gpu_percent", st.gpu_percent),))


def gpu_share_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: GpuShareSettings) -> Plan:
    return build_block_plan(model, wl, _gpu_share_schedule(model, hw, wl, st), capacity_of(hw))


# 3. the candidates: settings and block shapes for the search to try, best first (here unranked: it simulates them)
def gpu_share_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                         batch: int | None = None) -> Iterable[Candidate]:
    for pct in (75, 50, 25, 0):
        for gbs in ((1, 4, 16) if batch is None else (batch,)):
            yield Candidate({"gpu_percent": pct}, Workload(prompt_len, gen_len, gbs, 1))


# 4. the record the registry lists (offsim/policies/registry.py: POLICIES)
GPU_SHARE = Policy("gpu-share", GpuShareSettings, gpu_share_plan, gpu_share_candidates,
                   "the same share of every layer on the GPU, the rest streamed from pinned host memory")


@pytest.fixture
def registered(monkeypatch):
    """The registry with gpu-share added (a copy: the real dict is untouched)."""
    monkeypatch.setattr(registry, "POLICIES", {**registry.POLICIES, GPU_SHARE.name: GPU_SHARE})


GiB = 1 << 30


def test_unregistered_policy_is_an_error_naming_the_valid_ones():
    with pytest.raises(OffsimError, match="unknown policy 'gpu-share'; valid: .*flexgen"):
        registry.get_policy("gpu-share")


def test_example_policy_plans_and_simulates_opt30b(registered):
    """OPT-30B on the H200 preset with a 24 GiB budget: the plan validates, fits, and streams what it should."""
    model, hw = get_model("opt-30b"), get_hardware("h200", gpu_mem_gb=24)
    wl = Workload(prompt_len=512, gen_len=8, gpu_batch_size=8)
    L, W = model.num_layers, model.layer_weight_bytes()
    out = {}
    for pct in (25, 0):
        plan = registry.build_plan("gpu-share", model, hw, wl, {"gpu_percent": pct})  # validated
        assert plan.policy == "gpu-share" and dict(plan.settings)["gpu_percent"] == pct
        tr = simulate(plan, hw)
        m = tr.metrics()
        assert m["peak_gpu_bytes"] <= hw.gpu_mem_bytes
        # every generation step streams each layer's host share once (the prefill step included)
        per_layer = weight_split_from_percent(model, pct, 100 - pct)[1]
        streamed = L * per_layer
        h2d = tr.df.loc[tr.df["kind"] == "h2d", "nbytes"].sum()
        assert h2d >= wl.gen_len * streamed
        assert h2d < wl.gen_len * streamed + wl.gen_len * L * W * 0.05  # + small hidden/KV copies at most
        # the link bounds decode: its steps cannot be faster than their weight bytes over the link's best rate (less
        # the two layers that double-buffered prefetching may load while prefill is still running)
        link = max(bw for _, bw in hw.h2d_pinned)
        assert m["decode_s"] >= ((wl.gen_len - 1) * L - 2) * per_layer / link
        out[pct] = m
    # more on the GPU, less to stream: faster decode
    assert out[25]["decode_tok_s"] > out[0]["decode_tok_s"]


def test_example_policy_refuses_a_placement_that_fits_nowhere(registered):
    model, hw = get_model("opt-30b"), get_hardware("h200", gpu_mem_gb=24)
    with pytest.raises(OffsimError, match="(?i)gpu"):  # 75 % of 55.8 GB of weights on a 24 GiB GPU: the GPU is short
        registry.build_plan("gpu-share", model, hw, Workload(512, 8, 8), {"gpu_percent": 75})
    with pytest.raises(OffsimError, match="gpu_percent must be in"):
        registry.build_plan("gpu-share", model, hw, Workload(512, 8, 8), {"gpu_percent": 120})


def test_example_policy_is_searched_like_the_others(registered):
    from offsim.search import search

    model, hw = get_model("opt-13b"), get_hardware("h200", gpu_mem_gb=16)
    res = search("gpu-share", model, hw, prompt_len=256, gen_len=8)
    assert res.policy == "gpu-share"
    assert res.settings["gpu_percent"] in (75, 50, 25, 0) and res.workload.num_gpu_batches == 1
    assert res.metrics["peak_gpu_bytes"] <= hw.gpu_mem_bytes
    # its generator takes neither optional keyword (base.CandidateFn): the search caps and reserves for it
    capped = search("gpu-share", model, hw, prompt_len=256, gen_len=8, max_batch=4)
    assert capped.workload.num_prompts <= 4
    job = search("gpu-share", model, hw, prompt_len=256, gen_len=8, max_batch=4, key_mask=True)
    assert job.workload.reserve_key_mask
