"""GPU checks (skipped without CUDA; evidence in results/offexec/): OPT-1.3B-sized random fp16 weights, 32 generated
tokens. Every offloading plan gives the tokens of the all-on-GPU plan (same kernels, same batch shapes: bit-equal),
which agree with a plain forward without offloading; a recompute plan (TightLLM) may differ from them only where
fp16 rounding can flip a near tie; the GPU budget is respected and a plan over it is refused before it runs; the
measured trace respects every cross-stream dependency."""
import dataclasses

import pytest
import torch

from offexec import model as M
from offexec.executor import run_plan
from offexec.memory import ExecError
from offexec.weights import random_weights
from offsim import POLICIES, Workload, build_plan, get_hardware, get_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GiB = 1 << 30
PROMPT, GEN, GBS, NB = 64, 32, 4, 2


@pytest.fixture(scope="module")
def setup():
    spec = get_model("opt-1.3b")
    w = random_weights(spec, seed=0, device="cuda", pinned=True, progress=False)
    prompts = torch.randint(0, spec.vocab_size, (GBS * NB, PROMPT), generator=torch.Generator().manual_seed(0))
    hw = get_hardware("h200", gpu_mem_gb=4)
    wl = Workload(PROMPT, GEN, GBS, NB)
    ref = run_plan(build_plan("flexgen", spec, hw, wl, {"percent": (100, 0, 100, 0, 100, 0)}), w, "cuda", prompts,
                   record_logits=True)
    yield spec, w, prompts, hw, wl, ref
    w.close()


def test_all_gpu_plan_matches_plain_forward(setup):
    spec, w, prompts, hw, wl, ref = setup
    dev = torch.device("cuda")
    layers = [M.layer_views(w.layout, [(0, w.layers[j].to(dev))]) for j in range(spec.num_layers)]
    torch.cuda.set_per_process_memory_fraction(1.0)
    for b in range(NB):
        toks, logits = M.reference_generate(spec, layers, w.emb.to(dev), prompts[b * GBS:(b + 1) * GBS].to(dev),
                                            GEN, return_logits=True)
        mine = torch.stack([lg for s, bb, lg in sorted(ref.logits, key=lambda x: x[0]) if bb == b])
        assert (mine - logits.float().cpu()).abs().max().item() < 0.05  # fp16 kernels with other strides
        agree = (toks.cpu().numpy() == ref.tokens[b * GBS:(b + 1) * GBS]).mean()
        assert agree >= 0.9, agree


@pytest.mark.parametrize("policy, settings, nb", [
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}, NB),
    ("flexgen", {"percent": (30, 70, 0, 100, 0, 100)}, NB),
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}, NB),
    ("static-zero", {"kv_on_cpu": True}, 1),
])
def test_offloading_plans_give_the_same_tokens(setup, policy, settings, nb):
    spec, w, prompts, hw, wl, ref = setup
    plan = build_plan(policy, spec, hw, wl.with_(num_gpu_batches=nb), settings)
    res = run_plan(plan, w, "cuda", prompts[:GBS * nb], gpu_budget_bytes=hw.gpu_mem_bytes)
    n = GBS * nb
    assert (res.tokens == ref.tokens[:n]).all()
    assert res.stats["gpu_max_reserved_bytes"] <= hw.gpu_mem_bytes
    # the measured trace respects every dependency (GPU events and host clocks, 0.2 ms of clock skew allowed)
    df = res.trace.df
    start, end = df["start_s"].to_numpy(), df["end_s"].to_numpy()
    for op in plan.ops:
        for d in op.deps:
            assert end[d] <= start[op.id] + 2e-4, (op.describe(), plan.ops[d].describe())


@pytest.mark.skipif("tightllm" not in POLICIES, reason="offsim.policies.tightllm not present")
def test_recompute_plan_tokens(setup):
    """TightLLM recomputes KV with other GEMM shapes: tokens equal the reference's unless the reference's top-2
    logits at the first difference are within fp16 rounding (a near tie)."""
    spec, w, prompts, hw, wl, ref = setup
    plan = build_plan("tightllm", spec, hw, wl, {"percent": (20, 80, 0, 100, 100, 0), "kv_solver": "exact"})
    assert max(o.q_tokens for o in plan.ops if o.kind == "compute" and o.step > 0) > 1
    res = run_plan(plan, w, "cuda", prompts, gpu_budget_bytes=hw.gpu_mem_bytes)
    logits = {(s, b): lg for s, b, lg in ref.logits}
    for p in range(GBS * NB):
        diff = (res.tokens[p] != ref.tokens[p]).nonzero()[0]
        if len(diff):
            s = int(diff[0])
            top2 = logits[(s, p // GBS)][p % GBS].topk(2).values
            assert (top2[0] - top2[1]).item() < 0.05, (p, s)


def test_budget_respected_and_overflow_refused(setup):
    spec, w, prompts, hw, wl, ref = setup
    small = get_hardware("h200", gpu_mem_gb=1.5)
    plan = build_plan("flexgen", spec, small, wl, {"percent": (0, 100, 0, 100, 100, 0)})
    res = run_plan(plan, w, "cuda", prompts, gpu_budget_bytes=small.gpu_mem_bytes)
    assert res.stats["gpu_max_reserved_bytes"] <= small.gpu_mem_bytes
    assert (res.tokens == ref.tokens).all()
    big = build_plan("flexgen", spec, hw, wl, {"percent": (100, 0, 100, 0, 100, 0)})
    with pytest.raises(ExecError, match="short by"):
        run_plan(big, w, "cuda", prompts, gpu_budget_bytes=1 * GiB)


@pytest.mark.parametrize("model", ["opt-1.3b", "llama-2-7b"])
def test_blocked_mlp_peak_within_the_footprint(model):
    """A prefill-sized MLP (more rows than ``footprint.MLP_CHUNK_ROWS``) allocates at most what
    ``layer_stage_bytes['mlp']`` counts beyond its input, and less than the whole-MLP count: the allocator's own peak
    on the GPU, fp16 weights of the model's shapes."""
    from offsim.core import footprint as fp

    spec = get_model(model)
    E, Fd = spec.d_model, spec.ffn_dim
    names = (("final_layer_norm.weight", (E,)), ("final_layer_norm.bias", (E,)), ("fc1.weight", (Fd, E)),
             ("fc1.bias", (Fd,)), ("fc2.weight", (E, Fd)), ("fc2.bias", (E,))) if spec.family == "opt" else \
        (("post_attention_layernorm.weight", (E,)), ("gate_proj.weight", (Fd, E)), ("up_proj.weight", (Fd, E)),
         ("down_proj.weight", (E, Fd)))
    w = {n: torch.randn(s, dtype=torch.float16, device="cuda") * 0.02 for n, s in names}
    B, T = 3, fp.MLP_CHUNK_ROWS // 2 + 7  # 1.5 blocks and a bit
    x = torch.randn(B, T, E, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = M.mlp(spec, w, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    st = fp.layer_stage_bytes(spec, B, T, T)
    assert y.shape == x.shape
    assert peak <= st["mlp"], (peak, st["mlp"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp, "MLP_CHUNK_ROWS", B * T)  # the same MLP unblocked, as the footprint counts it
        assert st["mlp"] < fp.layer_stage_bytes(spec, B, T, T)["mlp"]


def test_recompute_attention_direct_flash_matches_lower_right_bias():
    """A recompute block's attention (T < C queries, bottom-right causal) goes straight to the flash kernel
    (``model._lower_right_flash``): the same kernel and result as PyTorch's ``causal_lower_right`` dispatch, over the
    executor's KV layout (permuted views of a [C, 2, B, n, D] buffer)."""
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, D, C, T = 4, 8, 64, 300, 37
    buf = torch.randn(C, 2, B, H, D, dtype=torch.float16, device="cuda", generator=g)
    q = torch.randn(B, T, H, D, dtype=torch.float16, device="cuda", generator=g).transpose(1, 2)
    K, V = buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3)
    direct = M._lower_right_flash(q, K, V, 1)
    assert direct is not None, "flash should take an fp16 MHA recompute block on this GPU"
    ref = F.scaled_dot_product_attention(q, K, V, attn_mask=causal_lower_right(T, C))
    assert torch.equal(direct, ref)
    assert torch.equal(M._sdpa(q, K, V, T, 1), ref)
    assert M._lower_right_flash(q, K[:, :2], V[:, :2], 4) is None  # GQA: through the bias's dispatch


@pytest.mark.parametrize("n_kv", [8, 2])
def test_written_rows_attention_matches_eager_and_replays_at_other_contexts(n_kv):
    """``model.written_rows_attention`` (flash's variable-length call, batch and heads merged, ``seqused_k`` = ctx
    on the device) over a [M, 2, B, n, D] buffer whose rows [0, ctx) are written equals eager attention over those
    rows (MHA and GQA), and a CUDA graph of it captured at one context gives each other context's eager result when
    only the device-side ctx changes."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, D, Mx, T = 4, 8, 64, 300, 37
    buf = torch.randn(Mx, 2, B, n_kv, D, dtype=torch.float16, device="cuda", generator=g)
    q = torch.randn(T, B, H, D, dtype=torch.float16, device="cuda", generator=g)
    ctx_k = torch.zeros(1, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, Mx], dtype=torch.int32, device="cuda")

    def eager(ctx):  # [T, B, H·D]: queries at rows [ctx - T, ctx), bottom-right causal over rows [0, ctx)
        K = buf[:ctx, 0].permute(1, 2, 0, 3)
        V = buf[:ctx, 1].permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), K, V, enable_gqa=H != n_kv,
                                           attn_mask=torch.ones(T, ctx, dtype=torch.bool, device="cuda").tril(ctx - T))
        return o.permute(2, 0, 1, 3).reshape(T, B, H * D)

    for ctx in (T, 120, Mx):
        ctx_k.fill_(ctx)
        got = M.written_rows_attention(q, buf[:, 0], buf[:, 1], ctx_k, cu_q, cu_k, None)
        assert (got.float() - eager(ctx).float()).abs().max().item() < 2e-3, ctx
    ctx_k.fill_(200)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # (a warm-up call on the capturing stream, then the capture)
        M.written_rows_attention(q, buf[:, 0], buf[:, 1], ctx_k, cu_q, cu_k, None)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.written_rows_attention(q, buf[:, 0], buf[:, 1], ctx_k, cu_q, cu_k, None)
    for ctx in (64, 250):
        ctx_k.fill_(ctx)
        graph.replay()
        assert (out.float() - eager(ctx).float()).abs().max().item() < 2e-3, ctx


def test_written_rows_recompute_plan_runs_as_graphs_and_gives_eagers_tokens():
    """A TightLLM plan whose recompute ops are graphed over the written rows (``graph_attention`` 'written_rows',
    graph_max_q_tokens raised to its longest recompute) captures and replays them on the GPU and gives the same
    tokens as the same plan run eagerly (graphs off)."""
    from offsim.core import footprint as fp
    from offexec.testing import tiny_hf
    from offexec.weights import from_state_dict

    hf, spec = tiny_hf("llama", seed=11)
    # half precision: on CUDA the written-rows path is flash's, fp16/bf16 only (``Executor._written_rows_plan``); the
    # tiny spec's 4-byte elements would run every recompute op over the whole buffer under the mask instead
    spec = dataclasses.replace(spec, dtype_bytes=2)
    w = from_state_dict(spec, hf.state_dict())
    assert w.dtype == torch.float16
    prompts = torch.randint(0, spec.vocab_size, (8, 32), generator=torch.Generator().manual_seed(7))
    for act in ((100, 0), (0, 100)):  # activations on the GPU, then parked on the host between layers
        # (at 2-byte elements the H200 preset's distributor recomputes 6 tokens of a 32-token prompt at 4 x 2, none
        # at 8 tokens; TightLLM's graph_recompute graphs every recompute op)
        plan = build_plan("tightllm", spec, get_hardware("h200"), Workload(32, 16, 4, 2),
                          {"percent": (0, 50, 0, 0) + act, "kv_solver": "exact", "hold_recompute": True,
                           "graph_recompute": True})
        assert plan.graph_attention == "written_rows"
        assert any(o.q_tokens > 1 and o.phase == "decode" for o in plan.ops)
        ref = run_plan(plan, w, "cuda", prompts, graphs="off")
        res = run_plan(plan, w, "cuda", prompts, graphs="cuda")
        g = res.stats["graphs"]
        assert g["failed"] is None and g["replays"] > 0 and g["homes"] == 2  # each batch's hidden state in place
        assert (res.tokens == ref.tokens).all(), act
        # the graphs' pool and static tensors, measured, within what the footprint counts for them
        assert 0 < g["pool_bytes"] and 0 < g["static_bytes"]
        assert g["pool_bytes"] + g["static_bytes"] <= fp.decode_graph_bytes(spec, plan.workload, plan.graph_max_q_tokens)


def test_capture_only_profile_has_issue_rows_for_head_embed_and_weight_copies():
    """``offexec profile --capture-only`` measures the host's issue time of the ops that had no row of their own
    (priced at one constant before: the head and the embedding at ``issue_compute_s``, weight copies at
    ``issue_copy_s``): ('issue', 'eager:head'), ('issue', 'eager:embed') by sequences and ('issue', 'h2d_weight') by
    bytes, each positive and below a millisecond (a few launches)."""
    from offexec.profile import profile_ops
    from offexec.testing import tiny_hf

    _, spec = tiny_hf("opt")
    rows = profile_ops(spec, "cuda", batches=(1, 4), prompts=(16,), capture_only=True, progress=False)
    issue = {name: curve for _, kind, name, curve in rows if kind == "issue"}
    for name in ("eager:head", "eager:embed", "h2d_weight"):
        assert name in issue, f"no ('issue', {name!r}) row: {sorted(issue)}"
        assert all(0 < s < 1e-3 for _, s in issue[name]), (name, issue[name])
    assert [x for x, _ in issue["eager:head"]] == [1, 4]
