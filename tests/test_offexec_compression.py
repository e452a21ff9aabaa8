"""offexec runs plans with compressed weights (``compress_weight``, issue 16): the off-GPU tiers and the GPU hold the
packed 4-bit form (offexec/weights.py ``PackedLayers``), copies move the plan's packed bytes, and every compute op
dequantizes its tensors into an fp16 working copy. Checked on the CPU against an uncompressed run of "fake-quantized"
weights -- every matrix replaced by dequantize(quantize(w)), the very values the compressed run computes with -- which
must give the same tokens and bit-identical logits; the tiers' stored bytes against offsim's packed sizes; and the
refusal of CPU attention with compression (sparse attention: tests/test_offexec_sparse.py)."""
import numpy as np
import pytest
import torch

from offexec import quant
from offexec.executor import Executor, compression_of, gpu_need, run_plan
from offexec.testing import fake_quantized_store, tiny_hf
from offexec.weights import from_state_dict
from offsim import POLICIES, Workload, build_plan, get_hardware
from offsim.core import footprint as fp
from offsim.core.specs import Compression

HW = get_hardware("h200")
PROMPT, GEN = 8, 5
CW = Compression(weight=True)

# (policy, settings, gpu_batch_size, num_gpu_batches): weights split over GPU, CPU and disk, per sub-layer and per
# layer (the split straddles a tensor), and the static policies
CASES = [
    ("flexgen", {"percent": (50, 25, 25, 25, 0, 100)}, 2, 2),  # every tier, activations parked on the host
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}, 2, 2),  # GPU + CPU, KV on the host, GPU attention
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "sublayer": False}, 2, 2),  # whole layers, straddling split
    ("flexgen", {"percent": (30, 30, 0, 0, 100, 0), "sublayer": False}, 2, 2),  # whole layers, disk weights
    ("static-accelerate", {"gpu_layers": 1}, 3, 1),
    ("static-zero", {"offload": "disk"}, 3, 1),
]
_MODELS: dict = {}


def _fake_quantized(spec, w):
    """A copy of weights ``w`` whose every packed matrix (``footprint.weight_tensor_is_packed``) is replaced by
    dequantize(quantize(m)) in the model's dtype: what a compressed run computes with."""
    fq = from_state_dict(spec, _MODELS[spec.family][0].state_dict())
    for j in range(spec.num_layers):
        for t in fq.layout:
            if fp.weight_tensor_is_packed(t.shape, CW):
                x = fq.layers[j, t.lo:t.hi].view(t.shape)
                x.copy_(quant.dequantize(quant.quantize_weight(x), fq.dtype))
    return fq


def _model(family):
    if family not in _MODELS:
        hf, spec = tiny_hf(family, seed=11)
        _MODELS[family] = (hf, spec)
        w = from_state_dict(spec, hf.state_dict())
        prompts = torch.randint(0, spec.vocab_size, (6, PROMPT), generator=torch.Generator().manual_seed(7))
        _MODELS[family] = (hf, spec, w, _fake_quantized(spec, w), prompts)
    return _MODELS[family][1:]


def _plans(spec, policy, settings, gbs, nb):
    wl = Workload(PROMPT, GEN, gbs, nb)
    return (build_plan(policy, spec, HW, wl, {**settings, "compress_weight": True}),
            build_plan(policy, spec, HW, wl, settings))


def _case_id(c):
    return f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[1].items()).replace(" ", "")


@pytest.mark.parametrize("policy,settings,gbs,nb", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_compressed_weights_equal_an_fp16_run_of_the_fake_quantized_weights(family, policy, settings, gbs, nb):
    spec, w, fq, prompts = _model(family)
    plan, plain = _plans(spec, policy, settings, gbs, nb)
    assert plan.weight_split == plain.weight_split  # the same placement, only the stored form differs
    n = plan.workload.num_prompts
    res = run_plan(plan, w, "cpu", prompts[:n], record_logits=True)
    ref = run_plan(plain, fq, "cpu", prompts[:n], record_logits=True)
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    assert len(res.logits) == len(ref.logits) == GEN * nb
    for (s1, b1, a), (s2, b2, b) in zip(res.logits, ref.logits):
        assert (s1, b1) == (s2, b2) and torch.equal(a, b), (s1, b1, (a - b).abs().max())
    # and the compression is real: the original weights give other logits
    orig = run_plan(plain, w, "cpu", prompts[:n], record_logits=True)
    assert max((a - b).abs().max().item() for (_, _, a), (_, _, b) in zip(res.logits, orig.logits)) > 1e-4


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("mode", ["threaded", "static graphs"])
def test_compressed_weights_through_the_stream_scheduler_and_the_graph_path(family, mode):
    spec, w, fq, prompts = _model(family)
    plan, plain = _plans(spec, "flexgen", {"percent": (50, 25, 25, 25, 0, 100)}, 2, 2)
    kw = {"threaded": True} if mode == "threaded" else {"graphs": "static"}
    res = run_plan(plan, w, "cpu", prompts[:4], record_logits=True, **kw)
    ref = run_plan(plain, fq, "cpu", prompts[:4], record_logits=True, **kw)  # the graph path's own numerics
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    for (_, _, a), (_, _, b) in zip(res.logits, ref.logits):
        assert torch.equal(a, b)


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@pytest.mark.parametrize("policy,settings,gbs,nb", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_tiers_hold_the_packed_sizes_offsim_prices(family, policy, settings, gbs, nb):
    """Host, disk and GPU hold the weights in their stored sizes: the executor's buffers equal its pre-check
    (``gpu_need`` = ``footprint.executor_gpu_bytes``) and offsim's placement arithmetic (``placement_tier_bytes``),
    the disk file and the host-homed ranges equal the plan's stored bytes, and the copies the plan prices move them."""
    spec, w, _, prompts = _model(family)
    plan, plain = _plans(spec, policy, settings, gbs, nb)
    wl = plan.workload
    ex = Executor(plan, w, "cpu", prompts[:wl.num_prompts], 0, None, None, False, False)
    try:
        res = ex.run({})
        measured = {"resident weights": _nbytes(*ex.w_res),
                    "weight slots": sum(ex.pools[k].count * ex.pools[k].buffer_bytes
                                        for k in ("wslot", "wslot_attn", "wslot_mlp")),
                    "dequantized copies": _nbytes(ex.w_deq)}
        disk_file = ex.disk.file_bytes.get("weights.bin", 0) if ex.disk else 0
        packed = ex.packed
    finally:
        ex.close()
    need = gpu_need(ex.prog, plan)
    placement = POLICIES[policy].placement(spec, HW, wl, POLICIES[policy].settings_from(
        {**settings, "compress_weight": True}))
    assert placement.compression == CW
    tiers = fp.placement_tier_bytes(spec, wl, placement)
    for k, v in measured.items():
        assert need[k] == v == tiers["gpu"][k], (k, need[k], v, tiers["gpu"][k])
    assert measured["resident weights"] < sum(g for g, _ in plan.weight_split) or not measured["resident weights"]
    # off-GPU tiers: the stored sizes, well under fp16
    assert res.stats["host_weights_tier_bytes"] == tiers["cpu"]["weights"]
    assert res.stats["disk_weights_tier_bytes"] == tiers["disk"]["weights"]
    W = fp.layer_weight_bytes(spec)
    assert disk_file == spec.num_layers * max(fp.stored_weight_bytes(spec, g + c, W, CW) for g, c in plan.weight_split)
    fp16 = fp.placement_tier_bytes(spec, wl, POLICIES[policy].placement(spec, HW, wl,
                                                                           POLICIES[policy].settings_from(settings)))
    if fp16["cpu"]["weights"]:
        assert res.stats["host_weights_tier_bytes"] < 0.5 * fp16["cpu"]["weights"]
    # the weight copies the plan prices are the packed bytes of their ranges, inside the packed layer
    for op in plan.ops:
        if op.tensor == "weight" and op.kind in ("h2d", "disk_read"):
            a, n = packed.range(op.lo, op.hi)
            assert n == op.nbytes and 0 <= a and a + n <= packed.layer_bytes


def test_bad_combinations_are_refused_in_one_line():
    spec, w, _, _ = _model("opt")
    wl = Workload(PROMPT, GEN, 2, 1)
    # CPU attention with compressed weights: offsim refuses to build it; a plan edited to say so is refused too
    plan = build_plan("flexgen", spec, HW, wl, {"percent": (50, 50, 0, 100, 100, 0), "cpu_attention": True})
    plan.settings = {**plan.settings, "compress_weight": True}
    with pytest.raises(Exception) as e:
        compression_of(plan)
    assert len(str(e.value).splitlines()) == 1 and "CPU attention" in str(e.value)


def test_part_reads_covers_every_tensor_of_its_unit():
    """The tensors a compute part dequantizes: a layer reads all, pre_attn + post_attn and attn_layer + mlp split
    them without overlap (a tensor missed would be read stale from the working copy: the equality tests catch it)."""
    from offexec.executor import part_reads

    for family in ("opt", "llama"):
        names = [n for n, _ in _model(family)[0].layer_tensors()]
        assert all(part_reads(n, "layer") for n in names)
        for a, b in (("pre_attn", "post_attn"), ("attn_layer", "mlp")):
            assert all(part_reads(n, a) != part_reads(n, b) for n in names)
        assert [n for n in names if part_reads(n, "attn_out")] == [n for n in names if n.split(".")[0] in
                                                                   ("out_proj", "o_proj")]


# ---- compressed KV cache ------------------------------------------------------------------------------------------
KV_CASES = [
    ("flexgen", {"percent": (100, 0, 100, 0, 100, 0)}, 2, 2),  # KV on the GPU
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}, 2, 2),  # KV on the host, GPU attention
    ("flexgen", {"percent": (50, 25, 25, 25, 0, 100)}, 2, 2),  # KV on every tier, activations parked
    ("flexgen", {"percent": (0, 0, 0, 0, 100, 0), "sublayer": False}, 2, 2),  # weights and KV on disk
    ("static-zero", {"kv_on_cpu": True, "offload": "disk"}, 3, 1),
]


@pytest.mark.parametrize("policy,settings,gbs,nb", KV_CASES, ids=[_case_id(c) for c in KV_CASES])
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_compressed_cache_equals_an_fp16_run_storing_fake_quantized_kv(family, policy, settings, gbs, nb,
                                                                        monkeypatch):
    """Quantize on store, dequantize on load: the same tokens and logits as an uncompressed run whose stored KV is
    fake-quantized (so every tier and copy in between keeps the packed bytes intact); prefill (no cached prefix)
    equals the uncompressed run exactly, and decode differs from it, within the 4-bit error."""
    spec, w, _, prompts = _model(family)
    wl = Workload(PROMPT, GEN, gbs, nb)
    plan = build_plan(policy, spec, HW, wl, {**settings, "compress_cache": True})
    plain = build_plan(policy, spec, HW, wl, settings)
    n = wl.num_prompts
    res = run_plan(plan, w, "cpu", prompts[:n], record_logits=True, keep_kv=True)
    exact = run_plan(plain, w, "cpu", prompts[:n], record_logits=True, keep_kv=True)
    fake_quantized_store(monkeypatch)
    ref = run_plan(plain, w, "cpu", prompts[:n], record_logits=True)
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    for (s, b, a), (_, _, r), (_, _, x) in zip(res.logits, ref.logits, exact.logits):
        assert torch.equal(a, r), (s, b, (a - r).abs().max())
        if s == 0:
            assert torch.equal(a, x)  # prefill attends over fresh K/V only
    decode_err = max((a - x).abs().max().item() for (s, _, a), (_, _, x) in zip(res.logits, exact.logits) if s)
    assert 0 < decode_err
    # the stored prompt KV is the packed form of the uncompressed run's, byte for byte, on every home tier
    kg, kc = plan.kv_split
    homes = {"gpu": (0, kg), "cpu": (kg, kg + kc), "disk": (kg + kc, spec.num_kv_heads)}
    for tier, (lo, hi) in homes.items():
        if hi > lo:
            packed, fp_kv = res.kv[tier], exact.kv[tier]  # [L, nb, cap, 2, B, n, stored] / [..., D]
            assert packed.dtype == torch.uint8 and packed.shape[-1] == quant.stored_nbytes((spec.head_dim,), 0)
            assert torch.equal(packed[:, :, :PROMPT], quant.pack_vectors(fp_kv[:, :, :PROMPT]))


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("mode", ["threaded", "static graphs"])
def test_compressed_cache_through_the_stream_scheduler_and_the_graph_path(family, mode):
    """The scheduler and the graph path's attention (full-length buffers, masked) give the eager run's tokens; the
    threaded run its logits exactly."""
    spec, w, _, prompts = _model(family)
    wl = Workload(PROMPT, GEN, 2, 2)
    plan = build_plan("flexgen", spec, HW, wl, {"percent": (50, 25, 25, 25, 0, 100), "compress_cache": True,
                                                 "compress_weight": True})
    kw = {"threaded": True} if mode == "threaded" else {"graphs": "static"}
    res = run_plan(plan, w, "cpu", prompts[:4], record_logits=True, **kw)
    eager = run_plan(plan, w, "cpu", prompts[:4], record_logits=True)
    np.testing.assert_array_equal(res.tokens, eager.tokens)
    for (_, _, a), (_, _, b) in zip(res.logits, eager.logits):
        assert torch.equal(a, b) if mode == "threaded" else (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("comp", [Compression(cache=True), Compression(weight=True, cache=True)],
                         ids=["cache", "weights+cache"])
@pytest.mark.parametrize("policy,settings,gbs,nb", KV_CASES, ids=[_case_id(c) for c in KV_CASES])
def test_compressed_cache_tiers_hold_the_packed_sizes(policy, settings, gbs, nb, comp):
    spec, w, _, prompts = _model("llama")
    wl = Workload(PROMPT, GEN, gbs, nb)
    st = {**settings, **comp.settings()}
    plan = build_plan(policy, spec, HW, wl, st)
    ex = Executor(plan, w, "cpu", prompts[:wl.num_prompts], 0, None, None, False, False)
    try:
        res = ex.run({})
        measured = {"resident weights": _nbytes(*ex.w_res),
                    "resident KV": _nbytes(ex.kv_gpu),
                    "KV work buffers": sum(ex.pools[f"kvwork_{g}"].count * ex.pools[f"kvwork_{g}"].buffer_bytes
                                           for g in ("cpu", "disk")),
                    "dequantized copies": _nbytes(ex.w_deq, ex.kv_deq)}
        disk_kv_file = ex.disk.file_bytes.get("kv.bin", 0) if ex.disk else 0
    finally:
        ex.close()
    need = gpu_need(ex.prog, plan)
    placement = POLICIES[policy].placement(spec, HW, wl, POLICIES[policy].settings_from(st))
    assert placement.compression == comp
    tiers = fp.placement_tier_bytes(spec, wl, placement)
    for k, v in measured.items():
        if policy == "static-zero" and k == "KV work buffers" and ex.prog.pool_peak["kvwork_cpu"] < 2:
            assert need[k] == v and tiers["gpu"][k] == 2 * v, (k, need[k], v, tiers["gpu"][k])
            continue
        assert need[k] == v == tiers["gpu"][k], (k, need[k], v, tiers["gpu"][k])
    assert res.stats["host_kv_bytes"] == tiers["cpu"]["KV"]
    assert disk_kv_file == tiers["disk"]["KV"]
    # the KV copies the plan prices: their nbytes are the stored bytes of their positions and heads
    for op in plan.ops:
        if op.tensor == "kv" and op.kind in ("h2d", "d2h", "disk_read", "disk_write"):
            assert op.nbytes == fp.stored_kv_bytes(spec, gbs, op.hi - op.lo, op.head_hi - op.head_lo, comp=comp)


# ---- on a GPU (skipped without CUDA) --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compressed_plans_on_cuda_within_the_plans_own_gpu_bytes():
    """OPT-1.3B-sized random fp16 weights on CUDA (streams, CUDA graphs, the allocator capped at the plan's own GPU
    bytes): compressed weights give the tokens of an uncompressed run of the fake-quantized weights, and weights +
    cache run within the plan's bytes, with the tokens of the eager (graph-less) run. Written with the executor's
    compression; it has not run on a GPU yet (no device time was left in its session)."""
    from offexec.weights import random_weights
    from offsim import get_model

    spec = get_model("opt-1.3b")
    w = random_weights(spec, seed=0, device="cuda", pinned=True, progress=False)
    try:
        hw = get_hardware("h200", gpu_mem_gb=4)
        wl = Workload(64, 16, 4, 2)
        prompts = torch.randint(0, spec.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
        st = {"percent": (20, 80, 0, 100, 100, 0)}
        cw = build_plan("flexgen", spec, hw, wl, {**st, "compress_weight": True})
        res = run_plan(cw, w, "cuda", prompts)
        assert res.stats["allocator"]["num_ooms"] == 0
        assert res.stats["gpu_max_reserved_bytes"] <= res.stats["allocator_cap_bytes"]
        for j in range(spec.num_layers):  # fake-quantize the master in place (the packed copy is made already)
            for t in w.layout:
                if fp.weight_tensor_is_packed(t.shape, CW):
                    x = w.layers[j, t.lo:t.hi].view(t.shape)
                    x.copy_(quant.dequantize(quant.quantize_weight(x.cuda()), x.dtype).cpu())
        ref = run_plan(build_plan("flexgen", spec, hw, wl, st), w, "cuda", prompts)
        np.testing.assert_array_equal(res.tokens, ref.tokens)
        both = build_plan("flexgen", spec, hw, wl, {**st, "compress_weight": True, "compress_cache": True})
        graphed = run_plan(both, w, "cuda", prompts)
        eager = run_plan(both, w, "cuda", prompts, graphs="off")
        assert graphed.stats["allocator"]["num_ooms"] == 0
        assert graphed.stats["gpu_max_reserved_bytes"] <= graphed.stats["allocator_cap_bytes"]
        assert (graphed.tokens == eager.tokens).mean() > 0.9  # graphs attend over full buffers: fp16 ties may flip
    finally:
        w.close()


def test_a_compressed_cache_runs_in_an_fp16_host_kv_pool_by_its_bytes():
    """A caller's page-locked KV pool (experiments make one per process) serves a compressed cache's uint8 buffers
    by its bytes: no second host KV beside it (on the H200 that second copy was killed for host memory), and the
    same tokens as without the pool."""
    from offexec.memory import HostBuffer

    spec, w, _, prompts = _model("opt")
    wl = Workload(PROMPT, GEN, 2, 2)
    plan = build_plan("flexgen", spec, HW, wl, {"percent": (100, 0, 0, 100, 100, 0), "compress_cache": True})
    need = fp.executor_host_bytes(spec, wl, plan.kv_split, 0, compression_of(plan))["host KV"]
    pool = HostBuffer(need // 2 + 1, torch.float16, pinned=False)  # fp16 elements, whatever the model dtype
    try:
        ex = Executor(plan, w, "cpu", prompts[:4], 0, None, None, False, False)
        ex.host_kv_pool = pool
        res = ex.run({})
        assert getattr(ex, "host_kv", None) is None  # the pool's bytes, no buffer of its own
        assert res.stats["host_kv_bytes"] == need
        np.testing.assert_array_equal(res.tokens, run_plan(plan, w, "cpu", prompts[:4]).tokens)
    finally:
        pool.close()
