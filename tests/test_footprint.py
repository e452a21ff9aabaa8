"""offsim.core.footprint: every tensor size matches torch's nbytes for a tiny model's real tensors; for every policy
and tier the footprint's GPU bytes by purpose equal what offexec allocates on the CPU (summed from the tensors the
executor creates: embeddings, token ids, resident weights, resident KV, buffer pools, activation values); a block
that fits nowhere is refused from arithmetic, fast, before any op is built."""
import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from offexec import model as M
from offexec.executor import Executor, gpu_need
from offexec.memory import GpuArena
from offexec.program import weight_slot_base
from offexec.testing import TIER_CASES, tiny_hf
from offexec.weights import from_state_dict
from offsim import POLICIES, Workload, build_plan, get_hardware
from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import PlanBuilder
from offsim.core.specs import get_model

HW = get_hardware("h200")
PROMPT, GEN = 8, 6

# (policy, settings, gpu_batch_size, num_gpu_batches): every policy, every tier (as tests/test_offexec_executor.py)
CASES = TIER_CASES + [
    ("selectn", {"interval": 2}, 3, 1),
    ("tightllm", {"percent": (30, 40, 25, 50, 100, 0), "weight_slices": 2, "kv_solver": "exact"}, 2, 2),
    ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact"}, 2, 2),
    ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact", "max_recompute_tokens": 4}, 2, 2),
]

_MODELS: dict = {}


def _model(family):
    if family not in _MODELS:
        hf, spec = tiny_hf(family, seed=3)
        _MODELS[family] = (spec, from_state_dict(spec, hf.state_dict()))
    return _MODELS[family]


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ----------------------------------------------------------------------------------------------------------------
# tensor sizes against torch
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_tensor_sizes_match_torch(family):
    spec, w = _model(family)
    B, T, C = 3, 5, 9
    assert _nbytes(w.layers[0]) == fp.layer_weight_bytes(spec)
    assert w.emb.nbytes() == fp.embedding_bytes(spec)
    e = spec.dtype_bytes
    for slot, (name, lo, hi) in zip(M.layer_layout(spec), fp.weight_tensor_ranges_bytes(spec)):
        assert (slot.name, slot.lo * e, slot.hi * e) == (name, lo, hi)
    assert fp.largest_weight_tensor_bytes(spec) == max(math_prod(s.shape) for s in M.layer_layout(spec)) * e
    W = fp.layer_weight_bytes(spec)
    for g in (0, e, 7 * e, W // 2 - (W // 2) % e, W - e, W):  # the executor's slot, at any split
        base = weight_slot_base(M.layer_layout(spec), g // e) * e if g < W else W
        assert fp.weight_slot_base_bytes(spec, g) == base
        assert fp.weight_slot_bytes(spec, g) == (W - base if g < W else 0)
    rope = M.Rope(spec, "cpu", w.dtype, C + 1) if family == "llama" else None
    ids = torch.randint(0, spec.vocab_size, (B, T))
    x = M.embed(spec, w.emb, ids, 0)
    assert _nbytes(x) == fp.hidden_bytes(spec, B, T)
    views = M.layer_views(w.layout, [(0, w.layers[0])])
    q, k, v = M.pre_attn(spec, views, x, 0, rope)
    assert _nbytes(q) == fp.q_bytes(spec, B, T) and _nbytes(k) == _nbytes(v) == fp.k_bytes(spec, B, T)
    assert _nbytes(q, k, v) == fp.qkv_bytes(spec, B, T)
    assert _nbytes(torch.cat((q, k, v), 2)) == fp.qkv_bytes(spec, B, T)  # CPU attention's packed copy
    Kc = torch.randn(B, spec.num_kv_heads, C, spec.head_dim, dtype=w.dtype)
    Vc = torch.randn_like(Kc)
    kq = torch.cat((Kc[:, :, :C - T], k.transpose(1, 2)), 2)
    vq = torch.cat((Vc[:, :, :C - T], v.transpose(1, 2)), 2)
    o = M.attention(spec, q, [(0, spec.num_kv_heads, kq, vq)])
    assert _nbytes(o) == fp.attn_out_bytes(spec, B, T)
    up = "fc1.weight" if family == "opt" else "up_proj.weight"
    assert _nbytes(F.linear(x, views[up])) == fp.ffn_bytes(spec, B, T)
    scores = torch.matmul(q.transpose(1, 2)[:, :spec.num_kv_heads], kq.transpose(2, 3))  # [B, n, T, C]
    assert _nbytes(scores) * spec.num_heads // spec.num_kv_heads == fp.scores_bytes(spec, B, T, C)
    out = M.post_attn(spec, views, x, o)
    assert _nbytes(out) == fp.hidden_bytes(spec, B, T)
    logits = M.head(spec, w.emb, out)
    assert _nbytes(logits) == fp.logits_bytes(spec, B)
    assert _nbytes(logits.float()) == fp.logits_bytes(spec, B, fp.FP32_BYTES)
    if rope is not None:
        assert _nbytes(rope.cos, rope.sin) == fp.rope_table_bytes(spec, C)
    else:
        assert fp.rope_table_bytes(spec, C) == 0
    assert _nbytes(torch.zeros(2, B, C + 1, dtype=torch.long)) == fp.token_ids_bytes(2 * B, C)
    for heads in (1, spec.num_kv_heads):
        buf = torch.zeros(C, 2, B, heads, spec.head_dim, dtype=w.dtype)  # the executor's KV buffer layout
        assert _nbytes(buf) == fp.kv_buffer_bytes(spec, B, C, heads) == fp.kv_bytes(spec, B, C, heads)
        assert buf.numel() == fp.kv_buffer_elems(spec, B, C, heads)


def math_prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_op_peak_contains_its_live_tensors(tiny_opt, tiny_llama):
    """Each op peak holds at least the tensors that are alive together in offexec's code (and grows with the
    query block, which TightLLM's recompute cap relies on)."""
    for m in (tiny_opt, tiny_llama, get_model("opt-30b"), get_model("llama-3-8b")):
        for T in (1, 7, 64):
            st = fp.layer_stage_bytes(m, 2, T, 64)
            qkv, o = fp.qkv_bytes(m, 2, T), fp.attn_out_bytes(m, 2, T)
            assert st["post_attn"] >= qkv + o + fp.ffn_bytes(m, 2, T) * (2 if m.family == "llama" else 1)
            assert st["attention"] >= qkv + o
            assert fp.op_peak_bytes(m, "layer", 2, T, 64) == max(st.values())
            assert fp.op_peak_bytes(m, "layer", 2, T + 1, 64) > fp.op_peak_bytes(m, "layer", 2, T, 64)
            assert fp.op_peak_bytes(m, "head", 2, T, 64) >= fp.logits_bytes(m, 2)
    assert fp.attention_is_fused(get_model("opt-30b"))  # fp16, head_dim 128: flash attention, no scores
    assert not fp.attention_is_fused(tiny_opt.__class__(**{**tiny_opt.to_dict(), "dtype_bytes": 4}))


# ----------------------------------------------------------------------------------------------------------------
# the footprint equals what offexec allocates, per purpose
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,settings,gbs,nb", CASES,
                         ids=[f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[1].items()).replace(" ", "")
                              for c in CASES])
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_footprint_equals_executor_allocations(family, policy, settings, gbs, nb):
    """Run the plan on the CPU and sum the nbytes of the tensors the executor creates, purpose by purpose, against
    (a) offexec's pre-check (``gpu_need`` = ``footprint.executor_gpu_bytes``) and (b) offsim's arithmetic for the
    policy's placement (``footprint.placement_tier_bytes``, what ``check_fits`` and the plans use). Exact, except
    activations: the live activation values are measured after every op (distinct tensors) and the plan-order count
    may exceed them by at most ACT_SLACK: pre_attn's (x, Q, K, V) counts x again (offexec/program.py value_bytes)."""
    spec, w = _model(family)
    wl = Workload(PROMPT, GEN, gbs, nb)
    plan = build_plan(policy, spec, HW, wl, settings)
    ex = Executor(plan, w, "cpu", None, 0, None, None, False, False)
    live_peak = [0]
    orig_done = ex._done

    def sampled_done(b, events):
        kinds = ("hidden", "pre", "attn")
        seen, total = set(), 0
        for vid, t in ex.vals.items():
            if ex.prog.values[vid].kind in kinds:
                for x in (t if isinstance(t, tuple) else (t,)):
                    if x.data_ptr() not in seen:
                        seen.add(x.data_ptr())
                        total += _nbytes(x)
        live_peak[0] = max(live_peak[0], total)
        orig_done(b, events)

    ex._done = sampled_done
    try:
        ex.run({})
        measured = {"embeddings": ex.emb.nbytes(),
                    "token ids": _nbytes(ex.tokens) + (_nbytes(ex.rope.cos, ex.rope.sin) if ex.rope else 0),
                    "resident weights": _nbytes(*ex.w_res),
                    "resident KV": _nbytes(ex.kv_gpu),
                    "weight slots": sum(ex.pools[k].count * ex.pools[k].buffer_bytes
                                        for k in ("wslot", "wslot_attn", "wslot_mlp")),
                    "KV work buffers": sum(ex.pools[f"kvwork_{g}"].count * ex.pools[f"kvwork_{g}"].buffer_bytes
                                           for g in ("cpu", "disk")),
                    "activation landing buffers": ex.pools["hidden_in"].count * ex.pools["hidden_in"].buffer_bytes}
        assert all(ex.pools[k].count == ex.prog.pool_peak[k] for k in ex.pools)  # no pool grew past plan order
        arena_bytes, arena_items = ex.arena.nbytes, len(ex._arena_items())
    finally:
        ex.close()
    need = gpu_need(ex.prog, plan)
    for k, v in measured.items():
        assert need[k] == v, (k, need[k], v)
    # every plan-sized buffer is a view of the one arena, which is their footprint plus alignment padding only
    static = sum(measured.values())
    assert static <= arena_bytes < static + GpuArena.ALIGN_BYTES * arena_items, (static, arena_bytes)
    ACT_SLACK = fp.hidden_bytes(spec, gbs, 1)  # x of a decode step's pre_attn, counted twice (CPU attention only)
    assert live_peak[0] <= need["activations"] <= live_peak[0] + ACT_SLACK, (live_peak[0], need["activations"])
    # offsim's side: the policy's placement, before any plan is built
    placement = POLICIES[policy].placement(spec, HW, wl, POLICIES[policy].settings_from(settings))
    gpu = fp.placement_tier_bytes(spec, wl, placement)["gpu"]
    landing = measured.pop("activation landing buffers")  # offsim's placement counts them in its activations
    for k, v in measured.items():
        if policy == "tightllm" and k == "KV work buffers" and ex.prog.pool_peak["kvwork_cpu"] < 2:
            # offsim counts two work buffers per off-GPU group (a decode step that loads its prefix while the
            # previous one stores); a TightLLM plan whose distributor recomputes everything loads nothing: one
            assert gpu[k] == 2 * v, (k, gpu[k], v)
            continue
        assert gpu[k] == v, (k, gpu[k], v)
    # and the activations the executor holds are within what offsim reserves (resident block + the op's output)
    assert live_peak[0] + landing <= gpu["activations"] + fp.op_peak_bytes(spec, "layer", gbs, PROMPT, PROMPT, 3), \
        (live_peak[0], landing, gpu["activations"])
    assert plan.resident["gpu"] <= sum(gpu.values())


# ----------------------------------------------------------------------------------------------------------------
# refusals from arithmetic
# ----------------------------------------------------------------------------------------------------------------
def test_block_that_fits_nowhere_is_refused_fast_before_any_op(monkeypatch):
    """2,000 GPU batches of OPT-30B on a T4 (3.2 million (step, layer, batch) positions: within what a plan may
    hold, ``specs.MAX_PLAN_POSITIONS``, but minutes and GBs of ops) fail in well under a second, naming the tier and
    the shortfall in GiB, and not one op is built."""
    built = []
    for name in ("add", "add_row"):  # (a block schedule emits most ops through add_row)
        orig = getattr(PlanBuilder, name)
        monkeypatch.setattr(PlanBuilder, name, lambda self, *a, _orig=orig, **k: built.append(1) or _orig(self, *a, **k))
    model, hw = get_model("opt-30b"), get_hardware("t4")
    wl = Workload(512, 32, 8, 2000)
    for policy, settings in (("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}),
                             ("flexgen", {"percent": (0, 100, 0, 100, 0, 100)}),
                             ("tightllm", {"percent": (0, 100, 0, 100, 100, 0)})):
        t0 = time.perf_counter()
        with pytest.raises(OffsimError, match=r"does not fit: (GPU|host) memory short by [\d.]+ GiB \(needs "
                                              r"[\d.]+ GiB") as e:
            build_plan(policy, model, hw, wl, settings)
        assert time.perf_counter() - t0 < 5
        assert "\n" not in str(e.value)
    assert not built


def test_cli_refuses_fast_with_exit_2(capsys):
    from offsim.cli import main

    t0 = time.perf_counter()
    rc = main(["simulate", "--model", "opt-30b", "--hardware", "t4", "--gpu-batch-size", "8",
               "--num-gpu-batches", "2000"])
    assert rc == 2 and time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB" in err[0] and "short by" in err[0]


def test_check_fits_names_each_tier(tiny_opt):
    wl = Workload(8, 4, 2, 2)
    W = tiny_opt.layer_weight_bytes()
    pl = fp.Placement(((0, W),) * tiny_opt.num_layers, (0, tiny_opt.num_kv_heads))
    t = fp.placement_tier_bytes(tiny_opt, wl, pl)
    need = {k: sum(v.values()) for k, v in t.items()}
    fp.check_fits(tiny_opt, need, wl, pl)  # exactly enough
    for tier, word in (("gpu", "GPU memory"), ("cpu", "host memory")):
        cap = dict(need, **{tier: need[tier] - 1})
        with pytest.raises(OffsimError, match=f"does not fit: {word} short by"):
            fp.check_fits(tiny_opt, cap, wl, pl)
    pl_disk = dataclasses.replace(pl, weight_split=((0, 0),) * tiny_opt.num_layers)
    need_d = {k: sum(v.values()) for k, v in fp.placement_tier_bytes(tiny_opt, wl, pl_disk).items()}
    with pytest.raises(OffsimError, match="does not fit: disk short by"):
        fp.check_fits(tiny_opt, dict(need_d, disk=need_d["disk"] - 1), wl, pl_disk)


def test_lp_memory_is_the_footprint(tiny_opt, small_gpu_t4):
    """FlexGen's LP constrains exactly ``footprint.tier_bytes`` (affine in the fractions): evaluated at a placement's
    fractions it equals the footprint of that placement up to the weight slot's straddling tensor."""
    from offsim.policies.lp import flexgen_terms

    wl = Workload(8, 4, 2, 2)
    W, L = tiny_opt.layer_weight_bytes(), tiny_opt.num_layers
    for sublayer in (False, True):  # whole-layer slots, or an attention and an MLP slot
        pl = fp.Placement(((0, W),) * L, (0, tiny_opt.num_kv_heads), sublayer=sublayer)  # layers off: no straddle
        mem = flexgen_terms(tiny_opt, small_gpu_t4, 8, 4, 2, 2, pl.fractions(tiny_opt), False, sublayer)["mem"]
        exact = fp.placement_tier_bytes(tiny_opt, wl, pl)
        for tier in ("gpu", "cpu", "disk"):
            assert mem[tier] == pytest.approx(sum(exact[tier].values()), rel=1e-12)


def test_executor_host_check_uses_meminfo(monkeypatch):
    from offexec import executor as X
    from offexec.memory import ExecError

    spec, w = _model("opt")
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 2), {"percent": (20, 80, 0, 100, 100, 0)})
    monkeypatch.setattr(X, "_meminfo_available_bytes", lambda: 1000)
    with pytest.raises(ExecError, match=r"host memory .* GiB are available \(MemAvailable\): short by"):
        X.check_plan(plan, "cpu", 1 << 40)
    monkeypatch.setattr(X, "_meminfo_available_bytes", lambda: 1 << 40)
    X.check_plan(plan, "cpu", 1 << 40)


def test_padded_batches_count_their_key_mask():
    """A left-padded batch's attention holds the key mask and SDPA's copies of it (footprint.mask_bytes: positions,
    the bool mask, two 2-byte copies at 16-column rows); Llama's RoPE gathers cos/sin per sequence; OPT's embed
    gathers its positions per sequence. Uniform batches are unchanged."""
    from offsim import Workload
    from offsim.core import footprint as F
    from offsim.core.specs import get_model

    for name in ("opt-13b", "llama-2-13b"):
        m = get_model(name)
        B, T, C = 48, 145, 545
        plain, masked = F.layer_stage_bytes(m, B, T, C), F.layer_stage_bytes(m, B, T, C, masked=True)
        assert masked["attention"] - plain["attention"] == F.mask_bytes(B, T, C) == B * T * (8 + C + 4 * 560)
        rope = 2 * B * T * m.head_dim * m.dtype_bytes if m.family == "llama" else 0
        assert masked["pre_attn"] - plain["pre_attn"] in (0, rope) and masked["mlp"] == plain["mlp"]
        hE = F.hidden_bytes(m, B, T)
        assert F.op_peak_bytes(m, "embed", B, T, T, masked=True) - F.op_peak_bytes(m, "embed", B, T, T) == \
            (hE if m.family == "opt" else 0)
        uniform = Workload(592, 24, 48, 2)
        padded = Workload(592, 24, 48, 2, prompt_lens=(592,) * 95 + (400,), gen_lens=(24,) * 96)
        assert F.max_layer_peak_bytes(m, padded) >= F.max_layer_peak_bytes(m, uniform)  # (the MLP may dominate)
