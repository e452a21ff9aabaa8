"""offexec's layer math against transformers (fp32, CPU): same weights, same logits and greedy tokens; a recompute
block over a loaded KV prefix reproduces the prefill's outputs and KV; weight sources and their checks."""
import dataclasses

import pytest
import torch

from offexec import model as M
from offexec.memory import ExecError
from offexec.testing import hf_generate, hf_kv, tiny_hf
from offexec.weights import from_state_dict, load_checkpoint, random_weights
from offsim.core.specs import get_model

FAMILIES = ["opt", "llama"]


def _layers(w):
    return [M.layer_views(w.layout, [(0, w.layers[j])]) for j in range(w.spec.num_layers)]


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_generate_matches_transformers(family):
    hf, spec = tiny_hf(family, seed=1)
    w = from_state_dict(spec, hf.state_dict())
    prompts = torch.randint(0, spec.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    ref_tok, ref_logits = hf_generate(hf, prompts, 6)
    rope = M.Rope(spec, "cpu", torch.float32) if family == "llama" else None
    tok, logits = M.reference_generate(spec, _layers(w), w.emb, prompts, 6, rope, return_logits=True)
    assert torch.equal(tok, ref_tok)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert len(set(tok.flatten().tolist())) > 3  # the tiny model's tokens are not degenerate


@pytest.mark.parametrize("family", FAMILIES)
def test_blocked_mlp_equals_whole_and_holds_what_the_footprint_says(family, monkeypatch):
    """Above ``footprint.MLP_CHUNK_ROWS`` rows the MLP runs in blocks: the same values as the whole MLP, and the
    footprint counts one block's intermediate instead of the whole (the allocator's measured peak against it is
    the GPU memory test's: ``tests/test_offexec_gpu.py``)."""
    from offsim.core import footprint as fp

    hf, spec = tiny_hf(family, seed=2)
    w = from_state_dict(spec, hf.state_dict())
    views = M.layer_views(w.layout, [(0, w.layers[0])])
    B, T = 3, 7  # 21 rows
    x = torch.randn(B, T, spec.d_model, generator=torch.Generator().manual_seed(1))
    whole = M.mlp(spec, views, x)
    st_whole = fp.layer_stage_bytes(spec, B, T, T)
    monkeypatch.setattr(fp, "MLP_CHUNK_ROWS", 4)  # 6 blocks of at most 4 rows (equal: 4 and 3)
    blocked = M.mlp(spec, views, x)
    assert torch.allclose(blocked, whole, atol=1e-5, rtol=1e-5)
    st = fp.layer_stage_bytes(spec, B, T, T)
    assert st["mlp"] < st_whole["mlp"] and st["post_attn"] - st["mlp"] == st_whole["post_attn"] - st_whole["mlp"]


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_block_over_loaded_prefix_equals_prefill(family):
    """TightLLM recompute: positions [b, S) run as a query block over KV [0, b) taken from the prefill give the
    prefill's outputs, and their recomputed K/V equal the K/V the prefill stored."""
    hf, spec = tiny_hf(family, seed=2)
    w = from_state_dict(spec, hf.state_dict())
    layer = _layers(w)[0]
    rope = M.Rope(spec, "cpu", torch.float32) if family == "llama" else None
    S, b = 10, 6
    x = torch.randn(2, S, spec.d_model, generator=torch.Generator().manual_seed(3))
    q, k, v = M.pre_attn(spec, layer, x, 0, rope)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hk, S, D]
    full = M.post_attn(spec, layer, x, M.attention(spec, q, [(0, spec.num_kv_heads, kt, vt)]))
    q2, k2, v2 = M.pre_attn(spec, layer, x[:, b:], b, rope)  # recompute [b, S)
    assert (k2 - k[:, b:]).abs().max().item() <= 1e-5
    assert (v2 - v[:, b:]).abs().max().item() <= 1e-5
    K = torch.cat((kt[:, :, :b], k2.transpose(1, 2)), 2)
    V = torch.cat((vt[:, :, :b], v2.transpose(1, 2)), 2)
    # heads in two groups (as GPU-resident + loaded heads would be)
    hk = spec.num_kv_heads
    groups = [(0, hk // 2, K[:, :hk // 2], V[:, :hk // 2]), (hk // 2, hk, K[:, hk // 2:], V[:, hk // 2:])]
    out = M.post_attn(spec, layer, x[:, b:], M.attention(spec, q2, groups))
    assert (out - full[:, b:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_kv_matches_transformers_cache(family):
    hf, spec = tiny_hf(family, seed=4)
    w = from_state_dict(spec, hf.state_dict())
    seqs = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    rope = M.Rope(spec, "cpu", torch.float32) if family == "llama" else None
    x = M.embed(spec, w.emb, seqs, 0)
    ref = hf_kv(hf, seqs)
    for j, layer in enumerate(_layers(w)):
        q, k, v = M.pre_attn(spec, layer, x, 0, rope)
        assert (k.transpose(1, 2) - ref[j][0]).abs().max().item() <= 1e-5
        assert (v.transpose(1, 2) - ref[j][1]).abs().max().item() <= 1e-5
        x = M.post_attn(spec, layer, x, M.attention(spec, q, [(0, spec.num_kv_heads, k.transpose(1, 2),
                                                                  v.transpose(1, 2))]))


def test_layer_layout_covers_the_flat_buffer_like_the_spec():
    for name in ("opt-30b", "llama-2-70b", "llama-3-8b"):
        spec = get_model(name)
        lay = M.layer_layout(spec)
        assert lay[-1].hi * spec.dtype_bytes == spec.layer_weight_bytes()
        assert all(a.hi == b.lo for a, b in zip(lay, lay[1:]))


def test_layer_views_from_two_pieces_match_one_buffer():
    hf, spec = tiny_hf("opt")
    w = from_state_dict(spec, hf.state_dict())
    lay = w.layout
    row = w.layers[1]
    cut = lay[3].lo  # a tensor boundary
    two = M.layer_views(lay, [(0, row[:cut].clone()), (cut, row[cut:].clone())])
    one = M.layer_views(lay, [(0, row)])
    assert all(torch.equal(two[k], one[k]) for k in one)
    with pytest.raises(ValueError):
        M.layer_views(lay, [(0, row[:cut + 1]), (cut + 1, row[cut + 1:])])  # a tensor straddles the pieces


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_roundtrip_and_shape_mismatch(tmp_path, family):
    hf, spec = tiny_hf(family, seed=6)
    hf.save_pretrained(tmp_path / "ck", safe_serialization=True)
    a = from_state_dict(spec, hf.state_dict())
    b = load_checkpoint(tmp_path / "ck", spec, torch.float32, progress=False)
    assert torch.equal(a.layers, b.layers)
    assert torch.equal(a.emb.tokens, b.emb.tokens)
    other = dataclasses.replace(spec, ffn_dim=spec.ffn_dim * 2)
    with pytest.raises(ExecError, match="ffn_dim"):
        load_checkpoint(tmp_path / "ck", other, torch.float32, progress=False)
    with pytest.raises(ExecError, match="does not exist"):
        load_checkpoint(tmp_path / "missing", spec, progress=False)


def test_random_weights_seeded_and_finite():
    hf, spec = tiny_hf("llama")
    a = random_weights(spec, seed=3, progress=False)
    b = random_weights(spec, seed=3, progress=False)
    c = random_weights(spec, seed=4, progress=False)
    assert torch.equal(a.layers, b.layers) and not torch.equal(a.layers, c.layers)
    assert torch.isfinite(a.layers).all()
    norm = M.layer_views(a.layout, [(0, a.layers[0])])["input_layernorm.weight"]
    assert (norm - 1).abs().max() < 0.2  # norms near one, matrices near zero
