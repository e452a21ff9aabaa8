"""offexec runs top-k sparse attention (issue 16; FlexGen's ``--attn-sparsity``): in generation each query keeps its
own position and the top ``int(f · n)`` (at least one) of the n other positions it sees, by score, with the softmax
over all of them and the kept weights not renormalised; prefill (and the prompt rows a TightLLM recompute block
holds) stays dense. Checked on the CPU with tiny models against a top-k reference written here, loop by loop, from
that rule alone: tokens equal and logits within fp32 rounding, for every policy that builds sparse plans (flexgen,
tightllm with a loaded prefix + recompute and with recompute only, selectn, the static ones), GPU and CPU attention,
with and without a compressed cache; the V rows the kernels multiply counted against the plan's ops;
``sparse_attention`` 1.0 equal to dense exactly; and, on a model whose attention is peaked as a trained one's, the
token agreement with dense attention reported and bounded below."""
import math

import numpy as np
import pytest
import torch

from offexec import model as M
from offexec import quant
from offexec.executor import compression_of, run_plan
from offexec.testing import fake_quantized_store, tiny_hf
from offexec.weights import from_state_dict
from offsim import POLICIES, Workload, build_plan, get_hardware, simulate
from offsim.core import costmodel as cm
from offsim.core import footprint as fp
from offsim.core.specs import Compression

HW = get_hardware("h200")
PROMPT, GEN = 12, 6
_MODELS: dict = {}

CASES = [
    ("flexgen", {"percent": (100, 0, 100, 0, 100, 0)}, 2, 2),  # KV on the GPU, sub-layers
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}, 2, 2),  # KV on the host, GPU attention
    ("flexgen", {"percent": (50, 25, 25, 25, 0, 100)}, 2, 2),  # KV on every tier, activations parked
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "sublayer": False}, 2, 2),  # whole layers
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}, 2, 2),  # CPU attention
    ("flexgen", {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True}, 2, 2),  # CPU attention, disk heads
    # a loaded prefix and a recompute block of N_r + 1 = 5 queries (prompt rows among them stay dense)
    ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact", "max_recompute_tokens": 4}, 2, 2),
    ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact"}, 2, 2),  # recompute everything
    ("static-accelerate", {"gpu_layers": 1}, 3, 1),
    ("static-zero", {"kv_on_cpu": True, "offload": "disk"}, 3, 1),
]
if "selectn" in POLICIES:
    CASES.append(("selectn", {"interval": 2}, 3, 1))


def _case_id(c):
    return f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[1].items()).replace(" ", "")


def _model(family, std=0.15):
    """Tiny model (``std``: the weights' spread; 0.5 peaks the attention as a trained model's is), its weights and
    prompts."""
    key = (family, std)
    if key not in _MODELS:
        hf, spec = tiny_hf(family, seed=11, std=std)
        prompts = torch.randint(0, spec.vocab_size, (6, 24), generator=torch.Generator().manual_seed(7))
        _MODELS[key] = (spec, from_state_dict(spec, hf.state_dict()), prompts)
    return _MODELS[key]


# ---- the reference: the rule alone, one query and one head at a time ----------------------------------------------
def _keep(f: float, others: int) -> int:
    return max(1, int(f * others)) if others else 0


def _ref_attention(q, K, V, P: int, f: float):
    """q [T, H, D] at rows C − T .. C − 1 of K, V [C, Hk, D]; rows from P on are generated (sparse when f < 1).
    Returns (out [T, H·D], kept V rows of the sparse queries)."""
    T, H, D = q.shape
    C, G = K.shape[0], H // K.shape[1]
    out, kept_rows = torch.zeros(T, H, D, dtype=torch.float64), 0
    for t in range(T):
        row = C - T + t
        for h in range(H):
            s = K[:row + 1, h // G].double() @ q[t, h].double() / math.sqrt(D)
            w = torch.softmax(s, 0)
            if f < 1 and row >= P:
                others = sorted(range(row), key=lambda c: -s[c].item())
                kept = others[:_keep(f, row)] + [row]
                kept_rows += len(kept)
            else:
                kept = range(row + 1)
            for c in kept:
                out[t, h] += w[c] * V[c, h // G].double()
    return out.reshape(T, H * D), kept_rows


def _reference(spec, w, prompt, gen: int, f: float):
    """Greedy generation of one request alone: (tokens [gen], logits [gen, V], kept V rows)."""
    layers = [M.layer_views(w.layout, [(0, w.layers[j])]) for j in range(spec.num_layers)]
    rope = M.Rope(spec, "cpu", w.dtype) if spec.family == "llama" else None
    Ks, Vs = [None] * spec.num_layers, [None] * spec.num_layers
    P, cur, start, toks, logits, rows = len(prompt), prompt[None], 0, [], [], 0
    for _ in range(gen):
        x = M.embed(spec, w.emb, cur, start)
        for j, lw in enumerate(layers):
            q, k, v = M.pre_attn(spec, lw, x, start, rope)
            Ks[j] = k[0] if Ks[j] is None else torch.cat((Ks[j], k[0]))
            Vs[j] = v[0] if Vs[j] is None else torch.cat((Vs[j], v[0]))
            o, n = _ref_attention(q[0], Ks[j], Vs[j], P, f)
            rows += n
            x = M.post_attn(spec, lw, x, o[None].to(x.dtype))
        lg = M.head(spec, w.emb, x)[0]
        logits.append(lg)
        toks.append(int(lg.argmax()))
        start += cur.shape[1]
        cur = torch.tensor([[toks[-1]]])
    return np.array(toks), torch.stack(logits), rows


def _expected_rows(plan, f: float) -> int:
    """V rows the plan's attention ops multiply by the rule: per decode attention op, per sequence, query head and
    query at row r, the kept positions and the own one at a generated row, all r + 1 at a prompt row."""
    H, n = plan.model.num_heads, 0
    for op in plan.ops:
        if op.phase != "decode" or not (op.kind == "cpu_compute" or
                                        (op.kind == "compute" and op.part in ("layer", "attn_layer", "attn"))):
            continue
        P = plan.workload.batch_prompt_lens[op.batch]
        for r in range(op.ctx_tokens - op.q_tokens, op.ctx_tokens):
            n += op.num_seqs * H * (_keep(f, r) + 1 if r >= P else r + 1)
    return n


# ---- the kernel ----------------------------------------------------------------------------------------------------
def test_sparse_sdpa_matches_the_one_token_reference_and_the_rule_for_blocks(monkeypatch):
    g = torch.Generator().manual_seed(3)
    B, H, Hk, C, D = 2, 8, 2, 41, 32
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hk, C, D, generator=g), torch.randn(B, Hk, C, D, generator=g)
    for f in (0.1, 0.5, 0.999):
        out, n = quant.sparse_sdpa(q, k, v, f, 1)
        assert torch.allclose(out, quant.top_k_sparse_attention(q, k, v, f), atol=1e-6)
        assert int(n) == B * H * (_keep(f, C - 1) + 1)
    # a prefix mask over a longer buffer with a fixed gather size (the graphs' form) keeps the same rows
    mask = torch.zeros(1, 1, 1, C, dtype=torch.bool)
    mask[..., :20] = True
    out, n = quant.sparse_sdpa(q, k, v, 0.3, 1, mask, k_cap=_keep(0.3, C - 1))
    assert torch.allclose(out, quant.top_k_sparse_attention(q, k, v, 0.3, mask), atol=1e-6)
    assert int(n) == B * H * (_keep(0.3, 19) + 1)
    # a block of T queries (a recompute), rows before ``first`` dense: against the loop reference per sequence
    T, first = 6, 38
    q6 = torch.randn(B, H, T, D, generator=g)
    out, n = quant.sparse_sdpa(q6, k, v, 0.25, T, first=first)
    want = 0
    for b in range(B):
        ref, rows = _ref_attention(q6[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), first, 0.25)
        assert torch.allclose(out[b].transpose(0, 1).reshape(T, H * D), ref.float(), atol=1e-5)
        want += rows + H * sum(r + 1 for r in range(C - T, first))
    assert int(n) == want
    # ranked a few queries at a time (``SPARSE_CHUNK_ELEMS``): the same result
    monkeypatch.setattr(quant, "SPARSE_CHUNK_ELEMS", B * H * C * 2)
    out2, n2 = quant.sparse_sdpa(q6, k, v, 0.25, T, first=first)
    assert torch.equal(out2, out) and int(n2) == want
    # fp16 inputs (scores and softmax in fp32): close to the fp32 result
    h, _ = quant.sparse_sdpa(q.half(), k.half(), v.half(), 0.5, 1)
    assert h.dtype == torch.float16 and (h.float() - quant.sparse_sdpa(q, k, v, 0.5, 1)[0]).abs().max() < 1e-2


# ---- plans -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_sparse_attention_one_is_dense_exactly(family):
    """``sparse_attention`` 1.0 is no approximation: the tokens and logits of the plan without the setting."""
    spec, w, prompts = _model(family)
    wl = Workload(PROMPT, GEN, 2, 2)
    for policy, st in (("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}), ("tightllm", CASES[6][1]),
                       ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "compress_cache": True})):
        one = run_plan(build_plan(policy, spec, HW, wl, {**st, "sparse_attention": 1.0}), w, "cpu",
                       prompts[:4, :PROMPT], record_logits=True)
        dense = run_plan(build_plan(policy, spec, HW, wl, st), w, "cpu", prompts[:4, :PROMPT], record_logits=True)
        np.testing.assert_array_equal(one.tokens, dense.tokens)
        assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(one.logits, dense.logits))
        assert "sparse_v_rows" not in one.stats


@pytest.mark.parametrize("f", [0.5, 0.1])
@pytest.mark.parametrize("policy,settings,gbs,nb", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_sparse_plan_equals_the_top_k_reference(family, policy, settings, gbs, nb, f):
    """Every policy and placement: the tokens of the reference's greedy generation, logits within fp32 rounding, and
    the V rows the kernels multiplied are the rule's count over the plan's attention ops."""
    spec, w, prompts = _model(family)
    wl = Workload(PROMPT, GEN, gbs, nb)
    plan = build_plan(policy, spec, HW, wl, {**settings, "sparse_attention": f})
    assert compression_of(plan) == Compression(sparse_attention=f)
    n = wl.num_prompts
    res = run_plan(plan, w, "cpu", prompts[:n, :PROMPT], record_logits=True)
    refs = [_reference(spec, w, prompts[i, :PROMPT], GEN, f) for i in range(n)]
    np.testing.assert_array_equal(res.tokens, np.stack([r[0] for r in refs]))
    for step, batch, lg in res.logits:
        want = torch.stack([refs[batch * gbs + i][1][step] for i in range(gbs)])
        assert torch.allclose(lg, want, atol=1e-4), (step, batch, (lg - want).abs().max())
    assert res.stats["sparse_v_rows"] == _expected_rows(plan, f)
    if policy == "flexgen":  # one query per decode op: exactly the reference's sparse queries
        assert res.stats["sparse_v_rows"] == sum(r[2] for r in refs)


def test_tightllm_recompute_gives_the_loaded_runs_tokens():
    """Recomputing KV (generated rows sparse, prompt rows dense, as when they were made) gives what loading it
    does: a TightLLM plan that recomputes and a FlexGen plan that loads everything agree token for token."""
    spec, w, prompts = _model("opt")
    wl = Workload(PROMPT, GEN, 2, 2)
    st = {"sparse_attention": 0.3}
    a = run_plan(build_plan("tightllm", spec, HW, wl, {**CASES[6][1], **st}), w, "cpu", prompts[:4, :PROMPT],
                 record_logits=True)
    b = run_plan(build_plan("flexgen", spec, HW, wl, {"percent": (20, 80, 0, 100, 100, 0), **st}), w, "cpu",
                 prompts[:4, :PROMPT], record_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert max((x - y).abs().max().item() for (_, _, x), (_, _, y) in zip(a.logits, b.logits)) < 1e-4


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("mode", ["threaded", "static graphs"])
def test_sparse_through_the_stream_scheduler_and_the_graph_path(family, mode):
    """The scheduler (exactly) and the graphs' static bodies (full-length buffers, a fixed gather size, masked) give
    the eager run's tokens and V row count; also TightLLM's graphed recompute blocks."""
    spec, w, prompts = _model(family)
    wl = Workload(PROMPT, GEN, 2, 2)
    kw = {"threaded": True} if mode == "threaded" else {"graphs": "static"}
    for policy, st in (("flexgen", {"percent": (50, 25, 25, 25, 0, 100)}), ("tightllm", CASES[6][1]),
                       ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True})):
        plan = build_plan(policy, spec, HW, wl, {**st, "sparse_attention": 0.4})
        res = run_plan(plan, w, "cpu", prompts[:4, :PROMPT], record_logits=True, **kw)
        eager = run_plan(plan, w, "cpu", prompts[:4, :PROMPT], record_logits=True)
        np.testing.assert_array_equal(res.tokens, eager.tokens)
        assert res.stats["sparse_v_rows"] == eager.stats["sparse_v_rows"]
        for (_, _, a), (_, _, b) in zip(res.logits, eager.logits):
            assert torch.equal(a, b) if mode == "threaded" else (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_sparse_with_a_compressed_cache(family, monkeypatch):
    """Quantize on store, dequantize on load, then top-k: the tokens and logits of an uncompressed sparse run whose
    stored KV is fake-quantized (the compressed cache's values), over KV on every tier; with compressed weights too,
    it runs end to end."""
    spec, w, prompts = _model(family)
    wl = Workload(PROMPT, GEN, 2, 2)
    st = {"percent": (50, 25, 25, 25, 0, 100), "sparse_attention": 0.3}
    res = run_plan(build_plan("flexgen", spec, HW, wl, {**st, "compress_cache": True}), w, "cpu",
                   prompts[:4, :PROMPT], record_logits=True)
    both = run_plan(build_plan("flexgen", spec, HW, wl, {**st, "compress_cache": True, "compress_weight": True}), w,
                    "cpu", prompts[:4, :PROMPT])
    assert both.stats["sparse_v_rows"] == res.stats["sparse_v_rows"]
    fake_quantized_store(monkeypatch)
    ref = run_plan(build_plan("flexgen", spec, HW, wl, st), w, "cpu", prompts[:4, :PROMPT], record_logits=True)
    np.testing.assert_array_equal(res.tokens, ref.tokens)
    assert res.stats["sparse_v_rows"] == ref.stats["sparse_v_rows"]
    for (s, b, a), (_, _, r) in zip(res.logits, ref.logits):
        assert (a - r).abs().max() < 1e-5, (s, b, (a - r).abs().max())


def test_mixed_lengths_keep_each_requests_own_top_k():
    """Left-padded batches: a query ranks only its request's positions, so each request's tokens are the
    reference's for that request alone."""
    spec, w, prompts = _model("llama")
    lens, gens = (8, 3, 6, 2), (5, 6, 2, 6)
    wl = Workload(max(lens), max(gens), 2, 2, prompt_lens=lens, gen_lens=gens)
    for st in ({"percent": (20, 80, 0, 100, 100, 0)}, {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}):
        res = run_plan(build_plan("flexgen", spec, HW, wl, {**st, "sparse_attention": 0.3}), w, "cpu",
                       prompts[:4, :max(lens)])
        for i, (p, n) in enumerate(zip(lens, gens)):
            np.testing.assert_array_equal(res.tokens[i, :n], _reference(spec, w, prompts[i, :p], n, 0.3)[0])


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_token_agreement_with_dense_attention(family, capsys):
    """On a tiny model whose attention is peaked as a trained model's (weights' std 0.5): keeping half of the
    positions changes (almost) no token, keeping 10 % few; reported with the logit error (pytest -s)."""
    spec, w, prompts = _model(family, std=0.5)
    wl = Workload(24, 8, 2, 2)
    for policy, st in (("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}), ("tightllm", CASES[6][1])):
        dense = run_plan(build_plan(policy, spec, HW, wl, st), w, "cpu", prompts[:4], record_logits=True)
        assert len(np.unique(dense.tokens)) > 8  # not a degenerate model
        for f, floor in ((0.5, 0.9), (0.1, 0.6)):
            res = run_plan(build_plan(policy, spec, HW, wl, {**st, "sparse_attention": f}), w, "cpu", prompts[:4],
                           record_logits=True)
            agree = float((res.tokens == dense.tokens).mean())
            err = max((a - b).abs().max().item() for (s, _, a), (_, _, b) in zip(res.logits, dense.logits) if s == 1)
            with capsys.disabled():
                print(f"\n{family} {policy} sparse {f}: token agreement {agree:.2f}, first sparse step's logit "
                      f"error {err:.3g}")
            assert agree >= floor


# ---- offsim prices what the executor does ----------------------------------------------------------------------------
def test_sparse_plans_move_the_whole_kv_and_save_decode_attention():
    """The executor's KV loads copy the stored KV whole (the kept rows are chosen on the GPU, after the load), so a
    sparse plan's copies are the dense plan's byte for byte; the decode attention reads K and the kept share of V
    and does that share of PV; prefill and recompute blocks are priced dense."""
    spec, _, _ = _model("opt")
    wl = Workload(PROMPT, GEN, 2, 2)
    for comp in ({}, {"compress_cache": True}):
        st = {"percent": (20, 80, 0, 100, 100, 0), **comp}
        dense, sparse = (build_plan("flexgen", spec, HW, wl, {**st, **x}) for x in ({}, {"sparse_attention": 0.1}))
        assert [(o.kind, o.nbytes) for o in dense.ops] == [(o.kind, o.nbytes) for o in sparse.ops]
        for op in sparse.ops:
            if op.tensor == "kv" and op.kind == "h2d":
                assert op.nbytes == fp.stored_kv_bytes(spec, 2, op.hi - op.lo, op.head_hi - op.head_lo,
                                                       comp=compression_of(sparse))
    # the GPU bytes count top-k's temporaries (the plan's, the placement's and the executor's budget alike)
    from offexec.executor import plan_gpu_need

    extra = fp.sparse_attention_bytes(spec, 2, wl.max_len, compression_of(sparse))
    assert extra > 0 and fp.sparse_attention_bytes(spec, 2, wl.max_len, compression_of(dense)) == 0
    assert plan_gpu_need(sparse)["sparse attention"] == extra
    assert "sparse attention" not in plan_gpu_need(dense)
    assert sparse.capacity == dense.capacity
    c = Compression(sparse_attention=0.1)
    assert cm.sparse_share(1, 100, c) == 0.1 and cm.sparse_share(5, 100, c) == 1.0 and cm.sparse_share(8, 8, c) == 1
    m = sparse.model
    assert cm.attention_seconds(m, HW, 64, 1, 4096, c) < cm.attention_seconds(m, HW, 64, 1, 4096)
    assert simulate(sparse, HW).makespan_s <= simulate(dense, HW).makespan_s


# ---- on a GPU (skipped without CUDA) --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sparse_plans_on_cuda_within_the_plans_own_gpu_bytes():
    """OPT-1.3B-sized random fp16 weights on CUDA (streams, CUDA graphs replaying the fixed-size gather, the
    allocator capped at the plan's own GPU bytes): a sparse plan with KV on the host, plain and with a compressed
    cache, and a TightLLM plan recomputing through graphs, give the eager run's tokens (fp16 ties may flip a few) and
    V row counts."""
    from offexec.weights import random_weights
    from offsim import get_model

    spec = get_model("opt-1.3b")
    w = random_weights(spec, seed=0, device="cuda", pinned=True, progress=False)
    try:
        hw = get_hardware("h200", gpu_mem_gb=4)
        wl = Workload(64, 16, 4, 2)
        prompts = torch.randint(0, spec.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
        for policy, st in (("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}),
                           ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "compress_cache": True}),
                           ("tightllm", {"percent": (20, 80, 0, 100, 100, 0), "kv_solver": "exact",
                                         "max_recompute_tokens": 4})):
            plan = build_plan(policy, spec, hw, wl, {**st, "sparse_attention": 0.2})
            graphed = run_plan(plan, w, "cuda", prompts)
            eager = run_plan(plan, w, "cuda", prompts, graphs="off")
            assert graphed.stats["allocator"]["num_ooms"] == 0
            assert graphed.stats["gpu_max_reserved_bytes"] <= graphed.stats["allocator_cap_bytes"]
            assert graphed.stats["sparse_v_rows"] == eager.stats["sparse_v_rows"] == _expected_rows(plan, 0.2)
            # prefill is not graphed: its token is the eager run's; later steps may flip on an fp16 tie in the top-k
            # choice (graphed and eager kernels round differently), and one flip changes the rest of that sequence
            # (random weights make near-ties common): 0.87 of the tokens agreed on the H200 on 2026-12-01
            assert (graphed.tokens[:, 0] == eager.tokens[:, 0]).all()
            assert (graphed.tokens == eager.tokens).mean() > 0.75
    finally:
        w.close()
