"""Issue 16: FlexGen's 4-bit group-wise compression and sparse attention -- the packed format (offexec/quant.py) and
offsim's model of it (sizes in footprint, passes in the cost model, the block schedule, the LP and the search)."""
from __future__ import annotations

import math

import pytest
import torch

from offexec import quant
from offexec.model import _sdpa
from offsim import Workload, build_plan, get_hardware, get_model, simulate
from offsim.cli import main as offsim_main
from offsim.core import costmodel as cm
from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.specs import NO_COMPRESSION, Compression

C4 = Compression(weight=True, cache=True)


# ---- the packed format -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,dim", [((128, 64), 0), ((100, 7), 0), ((3, 5, 130), -1), ((64,), 0), ((1, 1), 0),
                                       ((7, 200), 1)])
def test_round_trip_within_the_4bit_bound_per_group(shape, dim):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + torch.rand(shape, generator=g)).half()
    p = quant.quantize(x, dim)
    y = quant.dequantize(p)
    assert y.shape == x.shape and y.dtype == torch.float16
    err = (x.float() - y.float()).abs()
    bound = quant.round_trip_bound(x, dim)
    assert (err <= bound).all(), float((err - bound).max())
    # and the bound is not loose: somewhere the error reaches a good share of its group's half step
    g, _ = quant._groups(x, dim % x.dim())
    half_step = (g.amax(-1) - g.amin(-1)) / quant.LEVELS / 2  # [..., groups]
    if x.numel() >= 64:
        assert float(err.max()) > 0.5 * float(half_step.min())


def test_constant_groups_and_padding_round_trip_exactly():
    x = torch.full((70, 3), 1.5, dtype=torch.float16)  # 70 = one group and a padded one along dim 0
    assert torch.equal(quant.dequantize(quant.quantize(x, 0)), x)
    codes = torch.arange(16, dtype=torch.float16).repeat(4)  # on the grid: 0..15, step 1
    assert torch.equal(quant.dequantize(quant.quantize(codes, 0)), codes)


@pytest.mark.parametrize("shape,dim", [((7168, 7168), 0), ((28672, 7168), 0), ((100, 33), 0), ((5, 12, 128), 2),
                                       ((3, 96), -1), ((65,), 0)])
def test_packed_bytes_equal_offsims_size_formula(shape, dim):
    p = quant.quantize(torch.zeros(shape, dtype=torch.float16), dim) if math.prod(shape) < 1e7 else None
    want = fp.quantized_bytes(shape, dim % len(shape))
    assert quant.stored_nbytes(shape, dim) == want
    n = shape[dim]
    assert want == math.prod(shape) // n * math.ceil(n / 64) * 36  # 32 bytes of codes + fp16 min and step
    if p is not None:
        assert p.nbytes == want


def test_layer_and_kv_stored_sizes_are_the_packed_sizes():
    m = get_model("opt-1.3b")
    # every matrix of a layer packed along dim 0, every 1-D tensor fp16: what quantize_weight would hold
    want = sum(quant.stored_nbytes(s, 0) if len(s) == 2 else math.prod(s) * 2 for _, s in m.layer_tensors())
    assert fp.stored_layer_weight_bytes(m, C4) == want
    assert fp.stored_layer_weight_bytes(m, NO_COMPRESSION) == m.layer_weight_bytes()
    # one token, one head: K and V of D elements each, grouped along D
    kv = torch.zeros(2, 1, 1, m.head_dim, dtype=torch.float16)  # [K/V, B, heads, D]
    assert fp.stored_kv_bytes(m, 1, 1, 1, comp=C4) == quant.quantize_kv(kv).nbytes
    assert fp.kv_stored_fraction(m, C4) == 36 / 128


def test_sparse_attention_at_one_is_dense_attention_exactly():
    g = torch.Generator().manual_seed(0)
    B, H, Hk, C, D = 2, 8, 2, 37, 64
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hk, C, D, generator=g), torch.randn(B, Hk, C, D, generator=g)
    dense = _sdpa(q, k, v, 1, H // Hk)
    assert torch.equal(quant.top_k_sparse_attention(q, k, v, 1.0), dense)
    mask = torch.zeros(1, 1, 1, C, dtype=torch.bool)
    mask[..., :20] = True
    assert torch.equal(quant.top_k_sparse_attention(q, k, v, 1.0, mask), _sdpa(q, k, v, 1, H // Hk, mask))


def test_sparse_attention_keeps_the_top_fraction():
    g = torch.Generator().manual_seed(1)
    B, H, C, D = 1, 4, 101, 32
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, H, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    dense = _sdpa(q, k, v, 1, 1)
    # keeping almost everything is close to dense; keeping 10 % differs but stays a weighted sum of V rows
    near = quant.top_k_sparse_attention(q, k, v, 0.999)
    assert torch.allclose(near, dense, atol=5e-2)
    sparse = quant.top_k_sparse_attention(q, k, v, 0.1)
    assert not torch.allclose(sparse, dense, atol=1e-4)
    # by hand: softmax weights, the top 10 of the 100 cached positions and the new token, unrenormalised
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)
    tw, ti = w[..., :100].topk(10, -1)
    rows = torch.stack([v[0, h, ti[0, h, 0]] for h in range(H)])  # [H, 10, D]
    ref = (tw[0, :, 0].unsqueeze(-1) * rows).sum(1) + w[0, :, 0, 100:] * v[0, :, 100]
    assert torch.allclose(sparse[0, :, 0], ref, atol=1e-5)


# ---- offsim ------------------------------------------------------------------------------------------------------
T4 = get_hardware("t4")


def _run(model, st, wl, hw=T4):
    plan = build_plan("flexgen", model, hw, wl, st)
    return plan, simulate(plan, hw).metrics()


def test_weight_packed_in_column_blocks_equals_one_pass(monkeypatch):
    """``quantize_weight_into`` (row blocks of whole groups, bounded temporaries: how ``PackedLayers`` packs,
    possibly under a run's GPU cap) writes byte for byte ``to_bytes(quantize_weight(w))``, with a row count that is
    not a multiple of 64 (the last block's last group padded) and blocks that do not divide the rows."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 130, generator=g).half()
    ref = quant.to_bytes(quant.quantize_weight(w))
    monkeypatch.setattr(quant, "DEQUANT_CHUNK_ELEMS", 130 * 128)  # 128 rows a block: 128, 128, 44
    buf = torch.full_like(ref, 0xAB)
    quant.quantize_weight_into(w, buf)
    assert torch.equal(buf, ref)


def test_compressed_plans_move_the_packed_share_of_the_bytes():
    m = get_model("opt-30b")
    wl = Workload(512, 4, 32, 2)
    base = {"percent": (0, 100, 0, 100, 100, 0)}
    p16, _ = _run(m, base, wl)
    p4, _ = _run(m, {**base, "compress_weight": True, "compress_cache": True}, wl)
    b16, b4 = p16.bytes_by_kind(), p4.bytes_by_kind()
    ratio = fp.weight_stored_fraction(m, C4)  # 0.2813: weights dominate; KV is exactly 36/128
    assert b4["h2d"] / b16["h2d"] == pytest.approx(ratio, rel=2e-3)
    assert b4["d2h"] / b16["d2h"] == pytest.approx(36 / 128, rel=1e-9)  # only KV is stored (activations on GPU)
    # every tier holds the stored size
    assert p4.resident["cpu"] / p16.resident["cpu"] == pytest.approx(ratio, rel=1e-2)


def test_sparse_attention_loads_the_whole_kv_and_reads_k_and_its_share_of_v():
    """offexec's KV loads run ahead of the attention, before any score exists, so they copy the stored KV whole
    (``footprint.kv_load_bytes``); the decode attention on the GPU reads all of K and the kept share of V."""
    m = get_model("opt-6.7b")
    wl = Workload(256, 4, 8, 1)
    base = {"percent": (100, 0, 0, 100, 100, 0)}  # weights on the GPU: the h2d is KV loads only
    p1, m1 = _run(m, base, wl)
    p2, m2 = _run(m, {**base, "sparse_attention": 0.1}, wl)
    assert p2.bytes_by_kind()["h2d"] == p1.bytes_by_kind()["h2d"]
    assert m2["decode_tok_s"] >= m1["decode_tok_s"]
    c = Compression(sparse_attention=0.1)
    assert cm.attention_seconds(m, T4, 8, 1, 260, c) < cm.attention_seconds(m, T4, 8, 1, 260)
    # attention FLOPs: QK^T whole, PV at the share; prefill stays dense
    assert cm.attention_flops(m, 1, 1, 100, 0.1) == pytest.approx(cm.attention_flops(m, 1, 1, 100) * 0.55)
    assert cm.sparse_share(256, 256, Compression(sparse_attention=0.1)) == 1.0


def test_dequantize_passes_are_priced_from_the_profiled_rate():
    m = get_model("opt-6.7b")
    t16 = cm.compute_seconds(m, T4, "mlp", 8, 1, 300)
    t4 = cm.compute_seconds(m, T4, "mlp", 8, 1, 300, comp=C4)
    fp16_bytes = cm.gemm_flops_per_token(m, "mlp") / 2 * 2  # the MLP's matrices in fp16
    assert t4 - t16 == pytest.approx(fp16_bytes / T4.quant_bytes_per_s)
    assert T4.quant_bytes_per_s == T4.gpu_hbm_bytes_per_s / cm.QUANT_HBM_PASSES
    fast = T4.with_(quant_bytes_per_s=10 * T4.quant_bytes_per_s)  # a profile key overrides the preset
    assert cm.compute_seconds(m, fast, "mlp", 8, 1, 300, comp=C4) < t4
    # a profile without the key: HBM / QUANT_HBM_PASSES
    assert cm.quant_bytes_per_s(T4.with_(quant_bytes_per_s=0.0)) == T4.gpu_hbm_bytes_per_s / cm.QUANT_HBM_PASSES



def _with_rate(field: str, rate: float):
    """OPT-6.7B, its KV bytes per token, a profile with the cache's dequantize at 1e11 B/s and ``field`` not
    measured (left out of its JSON), and the same profile with ``field`` at ``rate``."""
    m = get_model("opt-6.7b")
    hw = T4.with_(quant_bytes_per_s=1e11)
    assert getattr(hw, field) == 0.0 and field not in hw.to_dict()
    other = hw.with_(**{field: rate})
    assert other.to_dict()[field] == rate
    return m, m.kv_bytes_per_token(), hw, other


def test_kv_store_is_priced_at_the_profiled_store_rate():
    """A profile's ``quant_store_bytes_per_s`` prices the new tokens' K/V quantize (the store) and nothing else; a
    profile without it prices the store at ``quant_bytes_per_s``, exactly as before the key existed."""
    m, kv_tok, hw, slow = _with_rate("quant_store_bytes_per_s", 1e10)
    for part, seqs, q, ctx in (("layer", 8, 512, 512), ("attn_layer", 8, 1, 300), ("pre_attn", 4, 3, 40)):
        before = cm.quant_seconds(m, hw, part, seqs, q, ctx, C4)
        w_bytes = cm.gemm_flops_per_token(m, part) / 2 * 2
        read = seqs * (ctx - q) * kv_tok if part != "pre_attn" else 0
        assert before == (w_bytes + read + seqs * q * kv_tok) / 1e11  # one rate, one division: as before
        assert cm.quant_seconds(m, slow, part, seqs, q, ctx, C4) == pytest.approx(
            (w_bytes + read) / 1e11 + seqs * q * kv_tok / 1e10)
    # parts that store no KV, and weight-only compression, do not see the store rate
    for part in ("mlp", "attn"):
        assert cm.quant_seconds(m, slow, part, 8, 1, 300, C4) == cm.quant_seconds(m, hw, part, 8, 1, 300, C4)
    w_only = Compression(weight=True)
    assert cm.quant_seconds(m, slow, "layer", 8, 512, 512, w_only) == cm.quant_seconds(m, hw, "layer", 8, 512, 512,
                                                                                        w_only)
    with pytest.raises(OffsimError, match="quant_store_bytes_per_s"):
        T4.with_(quant_store_bytes_per_s=-1.0)


def test_weights_are_dequantized_at_the_profiled_weight_rate():
    """A profile's ``quant_weight_bytes_per_s`` prices the weights' dequantize and nothing else (the cache's stays at
    ``quant_bytes_per_s``); without it, weights are priced at ``quant_bytes_per_s`` exactly as before."""
    m, kv_tok, hw, fast = _with_rate("quant_weight_bytes_per_s", 3e11)
    for part, seqs, q, ctx in (("layer", 8, 512, 512), ("attn_layer", 8, 1, 300), ("mlp", 4, 1, 40)):
        w_bytes = cm.gemm_flops_per_token(m, part) / 2 * 2
        kv = seqs * (ctx - q) * kv_tok + seqs * q * kv_tok if part != "mlp" else 0
        assert cm.quant_seconds(m, hw, part, seqs, q, ctx, C4) == (w_bytes + kv) / 1e11
        assert cm.quant_seconds(m, fast, part, seqs, q, ctx, C4) == pytest.approx(w_bytes / 3e11 + kv / 1e11)
    cache_only = Compression(cache=True)
    assert cm.quant_seconds(m, fast, "layer", 8, 512, 512, cache_only) == cm.quant_seconds(m, hw, "layer", 8, 512,
                                                                                            512, cache_only)
    with pytest.raises(OffsimError, match="quant_weight_bytes_per_s"):
        T4.with_(quant_weight_bytes_per_s=-1.0)


def test_compression_fits_what_fp16_does_not():
    m = get_model("opt-13b")
    wl = Workload(512, 8, 8, 1)
    st = {"percent": (100, 0, 100, 0, 100, 0)}  # all on the 15 GiB T4: 24 GiB of fp16 weights do not fit, 6.8 do
    with pytest.raises(OffsimError, match="does not fit"):
        build_plan("flexgen", m, T4, wl, st)
    plan = build_plan("flexgen", m, T4, wl, {**st, "compress_weight": True, "compress_cache": True})
    gpu = fp.placement_tier_bytes(m, wl, fp.Placement(plan.weight_split, plan.kv_split, compression=C4))["gpu"]
    assert gpu["dequantized copies"] > 0  # the fp16 working copy counted beside the packed storage
    assert simulate(plan, T4).metrics()["peak_gpu_bytes"] <= T4.gpu_mem_bytes


def test_cpu_attention_with_compression_is_refused():
    with pytest.raises(OffsimError, match="CPU attention"):
        build_plan("flexgen", get_model("opt-1.3b"), T4, Workload(64, 4, 4, 1),
                   {"percent": (100, 0, 0, 100, 100, 0), "cpu_attention": True, "compress_cache": True})


def test_cli_refuses_cpu_attention_with_compression_in_one_line(capsys):
    rc = offsim_main(["simulate", "--model", "opt-1.3b", "--percent", "100", "0", "0", "100", "100", "0",
                      "--cpu-attention", "--compress-weight", "--gen-len", "4", "--gpu-batch-size", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "CPU attention" in err


@pytest.mark.parametrize("settings", [{"sparse_attention": 0}, {"sparse_attention": 1.5},
                                      {"compress_weight": "yes"}])
def test_bad_compression_settings_are_one_line_errors(settings):
    with pytest.raises(OffsimError):
        build_plan("flexgen", get_model("opt-1.3b"), T4, Workload(64, 4, 4, 1), settings)


def test_a_saved_plan_carries_its_compression(tmp_path):
    m = get_model("opt-1.3b")
    wl = Workload(64, 4, 4, 1)
    plan = build_plan("static-zero", m, T4, wl, {"compress_weight": True, "sparse_attention": 0.5})
    path = tmp_path / "p.json"
    plan.save(path)
    from offsim.core.plan import Plan

    again = Plan.load(path)
    assert Compression.from_settings(again.settings) == Compression(True, False, 0.5)
    assert simulate(again, T4).metrics()["total_s"] == simulate(plan, T4).metrics()["total_s"]


def test_uncompressed_plans_are_unchanged_by_the_compression_settings():
    m = get_model("opt-1.3b")
    wl = Workload(64, 4, 4, 2)
    st = {"percent": (50, 50, 0, 100, 100, 0)}
    a = build_plan("flexgen", m, T4, wl, st)
    b = build_plan("flexgen", m, T4, wl, {**st, "compress_weight": False, "sparse_attention": 1.0})
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.slow
def test_search_with_compression_beats_fp16_on_opt30b_t4():
    """FlexGen's paper: OPT-30B on the T4, 7.32 total tok/s in fp16, 8.70 with 4-bit compression."""
    from offsim.search import search

    m = get_model("opt-30b")
    fp16 = search("flexgen", m, T4, 512, 32)
    best = search("flexgen", m, T4, 512, 32, compression=(NO_COMPRESSION, Compression(False, True),
                                                          Compression(True, True)))
    assert Compression.from_settings(best.settings).any
    assert best.metrics["total_tok_s"] > 1.1 * fp16.metrics["total_tok_s"]
    # the candidate table holds fp16 and compressed candidates side by side
    assert {bool(s.get("compress_cache", False)) for s in best.candidates["settings"]} == {False, True}


def test_offexec_runs_a_saved_sparse_plan(tmp_path, capsys):
    """The executor runs sparse attention with a compressed cache (tests/test_offexec_sparse.py checks the
    numerics): a saved plan runs from the CLI."""
    from offexec.cli import main as offexec_main

    plan = build_plan("flexgen", get_model("opt-125m"), T4, Workload(16, 2, 2, 1),
                      {"compress_cache": True, "sparse_attention": 0.5})
    path = tmp_path / "c.json"
    plan.save(path)
    rc = offexec_main(["run", "--plan", str(path), "--device", "cpu", "--hardware", "t4"])
    assert rc == 0, capsys.readouterr().err


def test_tightllm_recomputes_less_when_the_cache_is_compressed():
    """Compressed KV is cheaper to load, so the KV distributor trades less of it for recompute; the recomputed
    tokens' KV is fresh fp16 (no dequantize), only the loaded prefix is dequantized."""
    m = get_model("opt-30b")
    wl = Workload(512, 4, 64, 2)
    base = {"percent": (0, 100, 0, 100, 100, 0)}
    p16 = build_plan("tightllm", m, T4, wl, base)
    p4 = build_plan("tightllm", m, T4, wl, {**base, "compress_cache": True})
    n16 = sum(map(sum, p16.derived["recompute_tokens"]))
    n4 = sum(map(sum, p4.derived["recompute_tokens"]))
    assert n16 > 0 and n4 < n16
    assert simulate(p4, T4).metrics()["decode_tok_s"] > simulate(p16, T4).metrics()["decode_tok_s"]
    q = cm.quant_seconds(m, T4, "layer", 64, 11, 600, Compression(cache=True))  # 10 recomputed + 1 new token
    kv_tok = m.kv_bytes_per_token()
    assert q == pytest.approx((64 * 589 * kv_tok + 64 * 11 * kv_tok) / T4.quant_bytes_per_s)


def test_static_policies_and_selectn_store_the_packed_weights():
    from offsim.policies.static import accelerate_gpu_layers

    m = get_model("opt-13b")
    wl = Workload(128, 4, 4, 1)
    assert accelerate_gpu_layers(m, T4, wl, Compression(weight=True)) > accelerate_gpu_layers(m, T4, wl)
    z16 = build_plan("static-zero", m, T4, wl, {})
    z4 = build_plan("static-zero", m, T4, wl, {"compress_weight": True})
    assert z4.resident["cpu"] / z16.resident["cpu"] == pytest.approx(fp.weight_stored_fraction(m, C4), rel=1e-3)
    s16 = build_plan("selectn", m, T4, wl, {"interval": 2})
    s4 = build_plan("selectn", m, T4, wl, {"interval": 2, "compress_weight": True})
    assert s4.bytes_by_kind()["h2d"] / s16.bytes_by_kind()["h2d"] == pytest.approx(
        fp.weight_stored_fraction(m, C4), rel=1e-3)


def test_dequantize_rate_can_be_measured_for_a_profile():
    rate = quant.measure_dequantize_bytes_per_s("cpu", nbytes=1 << 20, repeats=2)
    assert rate > 1e6  # fp16 bytes per second: a profile's quant_bytes_per_s
    assert get_hardware("t4").with_(quant_bytes_per_s=rate).quant_bytes_per_s == rate


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_format_on_cuda_matches_the_cpu():
    x = torch.randn(300, 130, dtype=torch.float16)
    on_cpu = quant.quantize(x, 0)
    on_gpu = quant.quantize(x.cuda(), 0)
    assert torch.equal(on_gpu.data.cpu(), on_cpu.data) and torch.equal(on_gpu.scale.cpu(), on_cpu.scale)
    assert torch.equal(quant.dequantize(on_gpu).cpu(), quant.dequantize(on_cpu))
    assert on_gpu.nbytes == quant.stored_nbytes(x.shape, 0)


def test_a_weight_range_is_never_empty_and_its_parts_cover_the_whole():
    m = get_model("opt-125m")
    W = m.layer_weight_bytes()
    assert fp.stored_weight_bytes(m, 2, 4, C4) >= 1  # one element of a matrix: still a byte on the link
    cuts = [0, 1000, 1002, W // 3, W // 2 + 6, W]
    parts = sum(fp.stored_weight_bytes(m, a, b, C4) for a, b in zip(cuts, cuts[1:]))
    whole = fp.stored_layer_weight_bytes(m, C4)
    assert whole <= parts <= whole + len(cuts) * len(m.layer_tensors())


def test_pack_vectors_into_in_chunks_equals_one_pass(monkeypatch):
    """The chunked store (prefill, recomputes) packs exactly what one pass would."""
    x = torch.randn(300, 3, 5, 128, generator=torch.Generator().manual_seed(0)).half()
    whole = quant.pack_vectors(x)
    monkeypatch.setattr(quant, "DEQUANT_CHUNK_ELEMS", 2000)  # many chunks
    assert torch.equal(quant.pack_vectors_into(x, torch.zeros_like(whole)), whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_dequantize_matches_the_pytorch_path_on_cuda(monkeypatch):
    """The fused Triton kernel (offexec/quant_triton.py) writes what the chunked PyTorch path writes, within one fp16
    ulp (the compiler may fuse code * step + min), for a weight (grouped along its output channel, 300 = not a
    multiple of 64) and for KV vectors into a strided slice of a larger working buffer, as the executor's loads do."""
    from offexec import quant_triton

    if quant_triton.triton is None:
        pytest.skip("no Triton here")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 130, generator=g).half().cuda()
    buf = quant.to_bytes(quant.quantize_weight(w))
    kv = torch.randn(7, 2, 3, 5, 128, generator=g).half().cuda()
    packed = quant.pack_vectors(kv)
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(quant_triton, "available", lambda out: False)
        wo = torch.full_like(w, float("nan"))
        quant.dequantize_into(buf, tuple(w.shape), 0, wo)
        big = torch.full((7, 2, 3, 8, 128), float("nan"), dtype=torch.float16, device="cuda")
        quant.unpack_vectors_into(packed, big[:, :, :, 1:6])
        outs[fused] = (wo, big)
    for a, b in zip(outs[True], outs[False]):
        assert torch.isnan(a).sum() == torch.isnan(b).sum()  # the same elements written (the slice's outside: NaN)
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -10, atol=1e-5, equal_nan=True)


_INTERPRETED_KERNEL_CHECK = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from offexec import quant, quant_triton
g = torch.Generator().manual_seed(1)
worst = 0.0
for shape in ((300, 130), (300, 128), (256, 192)):  # weights grouped along dim 0; 128, 192 rows: the ROW_RUN path
    w = torch.randn(*shape, generator=g)
    buf = quant.to_bytes(quant.quantize_weight(w))
    data, scale = quant._split_bytes(buf, tuple(w.shape), 0)
    a = torch.full_like(w, float("nan"))
    quant_triton.dequantize_rows(data, scale, a.movedim(0, -1))
    b = torch.full_like(w, float("nan"))
    quant.dequantize_into(buf, tuple(w.shape), 0, b)
    assert torch.equal(torch.isnan(a), torch.isnan(b)), shape
    worst = max(worst, (a - b).abs().nan_to_num().max().item())
for full, sl, kv_shape in (((7, 2, 3, 8, 128), (slice(None),) * 3 + (slice(1, 6),), (7, 2, 3, 5, 128)),
                          ((4, 3, 100), (), (4, 3, 100))):
    kv = torch.randn(*kv_shape, generator=g)
    D = kv_shape[-1]
    packed = quant.pack_vectors(kv)
    groups = -(-D // 64)
    data = packed[..., :32 * groups].unflatten(-1, (groups, 32))
    scale = packed[..., 32 * groups:].view(torch.float16).unflatten(-1, (groups, 2))
    a, b = torch.full(full, float("nan")), torch.full(full, float("nan"))
    quant_triton.dequantize_rows(data, scale, a[sl])  # the OUT_CONTIG path, into a strided slice
    quant.unpack_vectors_into(packed, b[sl])
    assert torch.equal(torch.isnan(a), torch.isnan(b)), full
    worst = max(worst, (a - b).abs().nan_to_num().max().item())
print("worst", worst)
"""


def test_fused_dequantize_kernel_in_triton_interpreter():
    """The fused kernel's every layout path (a weight's grouped dim strided, with and without whole row runs; KV
    vectors contiguous, into a strided slice, a masked tail of D = 100) writes exactly what the PyTorch path writes,
    run by Triton's interpreter on the CPU (fp32: no fp16 rounding), where Triton is installed (not in CI: the GPU
    machine's test above covers the compiled kernel)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", _INTERPRETED_KERNEL_CHECK], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.split()[-1]) <= 1e-6


_INTERPRETED_QUANTIZE_CHECK = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from offexec import quant, quant_triton
g = torch.Generator().manual_seed(2)
ties = torch.cat([torch.tensor([0.0, 15.0]), torch.arange(31.0) / 2, torch.arange(31.0) / 2])  # k + 1/2 on the grid
big = torch.randn(7, 2, 3, 8, 128, generator=g).half()
cases = {
    "D=128": torch.randn(5, 3, 128, generator=g).half(),
    "D=100 tail": torch.randn(4, 3, 100, generator=g) * 3 + 1,  # fp32: the fp16 min may round above the group's
    "D=200 bf16": torch.randn(2, 9, 200, generator=g).bfloat16(),
    "strided slice": big[:, 1, :, 1:6],  # [7, 3, 5, 128] of a larger buffer
    "D not contiguous": torch.randn(100, 6, generator=g).half().t(),
    "ties to even": ties.view(1, 64),
    "constant groups": torch.full((3, 130), 1.5).half(),
    "tiny steps": torch.randn(4, 128, generator=g) * 1e-6,  # the fp16 step subnormal or 0
    "one vector": torch.randn(70, generator=g).half(),
}
for name, x in cases.items():
    want = quant.pack_vectors(x)  # the PyTorch path (CPU tensors)
    got = quant_triton.quantize_rows(x, torch.zeros_like(want))
    assert torch.equal(got, want), name
# into a strided slice of a larger packed buffer (the executor's buf[start:ctx, i]), through pack_vectors_into with
# the fused path switched on for CPU tensors; nothing outside the slice written
x = torch.randn(7, 2, 3, 128, generator=g).half()
want = quant.pack_vectors(x)
buf = torch.zeros(9, 2, 2, 3, want.shape[-1], dtype=torch.uint8)
quant_triton.available = lambda out: True
quant.pack_vectors_into(x, buf[1:8, 1])
assert torch.equal(buf[1:8, 1], want)
buf[1:8, 1] = 0
assert not buf.any()
print("ok", len(cases) + 1)
"""


def test_fused_quantize_kernel_in_triton_interpreter():
    """The fused KV quantize (offexec/quant_triton.py ``quantize_rows``) writes exactly ``pack_vectors``' bytes --
    codes and fp16 (min, step) -- for D = 128, a D = 100 tail group, bf16 and fp32 input, a strided input slice, a
    non-contiguous D, ties on the grid (round half to even), constant groups, tiny steps, and into a strided slice of
    a larger packed buffer through ``pack_vectors_into``; run by Triton's interpreter on the CPU, where Triton is
    installed (the GPU test below covers the compiled kernel)."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", _INTERPRETED_QUANTIZE_CHECK], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_quantize_matches_the_pytorch_path_on_cuda(monkeypatch):
    """On CUDA the fused quantize (``pack_vectors`` / ``pack_vectors_into``, as the executor's KV store runs them)
    writes the bytes the PyTorch path writes on the GPU and on the CPU: a prefill's K into a strided slice of a
    packed buffer, a D = 100 tail, a decode token's vectors."""
    from offexec import quant_triton

    if quant_triton.triton is None:
        pytest.skip("no Triton here")
    g = torch.Generator().manual_seed(3)
    kt = torch.randn(3, 40, 5, 128, generator=g).half().cuda().transpose(0, 1)  # [T, B, Hk, D] as the store gets it
    x100 = torch.randn(6, 2, 100, generator=g).cuda()
    tok = torch.randn(1, 3, 4, 128, generator=g).bfloat16().cuda()
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(quant_triton, "available", lambda out: False)
        buf = torch.zeros(50, 2, 3, 3, quant.stored_nbytes((128,), 0), dtype=torch.uint8, device="cuda")
        quant.pack_vectors_into(kt[:, :, 1:4], buf[5:45, 1])
        outs[fused] = (buf, quant.pack_vectors(x100), quant.pack_vectors(tok))
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
    assert torch.equal(outs[True][0][5:45, 1].cpu(), quant.pack_vectors(kt[:, :, 1:4].cpu()))
    assert torch.equal(outs[True][1].cpu(), quant.pack_vectors(x100.cpu()))
