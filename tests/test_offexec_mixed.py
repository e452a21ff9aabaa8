"""Mixed-length plans (issue 20, docs/jobs.md §4): each GPU batch runs at its longest prompt, shorter prompts
left-padded with a pad mask in prefill and every decode step, positions counted from each request's first real
token. Every request's first gen_lens tokens must equal transformers' greedy generation of that request alone
(no padding) -- eagerly, through the graphs' static bodies, and with the threaded scheduler."""
import numpy as np
import pytest
import torch

from offexec.executor import run_plan
from offexec.testing import hf_generate, tiny_hf
from offexec.weights import from_state_dict
from offsim import POLICIES, Workload, build_plan, get_hardware

HW = get_hardware("h200")
# gbs 2 x 3 batches: batch lengths 8, 6 and 5 (a batch whose prompts are all its length pads nothing), shorter
# generations that keep generating with their block
PROMPT_LENS = (8, 3, 6, 2, 5, 5)
GEN_LENS = (5, 6, 2, 6, 6, 1)
GBS, NB = 2, 3

CASES = [
    ("flexgen", {"percent": (100, 0, 100, 0, 100, 0)}),  # KV on the GPU, sub-layers
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}),  # KV on the host, GPU attention
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "sublayer": False}),  # whole layers
    ("flexgen", {"percent": (50, 25, 25, 25, 0, 100)}),  # every tier, activations on the host
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}),
    ("flexgen", {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True}),  # CPU attention, disk heads
]
if "tightllm" in POLICIES:
    CASES += [("tightllm", {"percent": (30, 40, 25, 50, 100, 0), "weight_slices": 2, "kv_solver": "exact"}),
              ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact", "max_recompute_tokens": 4})]

_MODELS: dict = {}


def _model(family):
    """Tiny model, weights, the prompts (request i's ids in the first PROMPT_LENS[i] columns) and transformers'
    greedy tokens of each request alone."""
    if family not in _MODELS:
        hf, spec = tiny_hf(family, seed=11)
        g = torch.Generator().manual_seed(7)
        prompts = torch.randint(0, spec.vocab_size, (len(PROMPT_LENS), max(PROMPT_LENS)), generator=g)
        ref = [hf_generate(hf, prompts[i:i + 1, :p], n)[0][0] for i, (p, n) in enumerate(zip(PROMPT_LENS, GEN_LENS))]
        _MODELS[family] = (spec, from_state_dict(spec, hf.state_dict()), prompts, ref)
    return _MODELS[family]


def _run(family, policy, settings, prompt_lens=PROMPT_LENS, gen_lens=GEN_LENS, **kw):
    spec, w, prompts, ref = _model(family)
    wl = Workload(max(prompt_lens), max(gen_lens), GBS, NB, prompt_lens=prompt_lens, gen_lens=gen_lens)
    plan = build_plan(policy, spec, HW, wl, settings)
    return plan, run_plan(plan, w, "cpu", prompts[:, :wl.prompt_len], **kw), ref


def _check(res, ref):
    for i, n in enumerate(GEN_LENS):
        np.testing.assert_array_equal(res.tokens[i, :n], ref[i].numpy(), err_msg=f"request {i}")


def _case_id(c):
    return f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[1].items()).replace(" ", "")


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_mixed_plan_reproduces_each_request_alone(family, case):
    plan, res, ref = _run(family, *case)
    assert plan.workload.batch_prompt_lens == (8, 6, 5)
    _check(res, ref)


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("case", [c for c in CASES if not c[1].get("cpu_attention")] + CASES[4:5], ids=_case_id)
def test_mixed_plan_graph_bodies(family, case):
    """The decode graphs' static bodies (a device-side key mask combined with the batch's pad mask, per-sequence
    RoPE positions), run eagerly on the CPU."""
    plan, res, ref = _run(family, *case, graphs="static")
    assert res.stats["graphs"]["ops"] > 0 and res.stats["graphs"]["failed"] is None
    _check(res, ref)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=_case_id)
def test_mixed_plan_threaded(case):
    _check(_run("llama", *case, threaded=True)[1], _model("llama")[3])


def test_uniform_lists_run_as_the_uniform_workload():
    """A workload whose per-prompt lists are all one length takes the unpadded path and gives the same tokens as the
    uniform workload (empty lists)."""
    spec, w, prompts, _ = _model("opt")
    settings = {"percent": (20, 80, 0, 100, 100, 0)}
    n = GBS * NB
    a = run_plan(build_plan("flexgen", spec, HW, Workload(8, 4, GBS, NB), settings), w, "cpu", prompts)
    wl = Workload(8, 4, GBS, NB, prompt_lens=(8,) * n, gen_lens=(4,) * n)
    b = run_plan(build_plan("flexgen", spec, HW, wl, settings), w, "cpu", prompts)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_an_unmasked_pad_changes_the_tokens(monkeypatch):
    """The test can fail: with pad positions left visible, some padded request's tokens differ."""
    import offexec.model as M
    monkeypatch.setattr(M, "visible", lambda rows, cols, pad: (cols.unsqueeze(0) <= rows.unsqueeze(1))[None, None])
    _, res, ref = _run("opt", *CASES[0])
    assert any(not np.array_equal(res.tokens[i, :n], ref[i].numpy()) for i, n in enumerate(GEN_LENS))


def test_masked_decode_attention_avoids_per_shape_planning_backends(monkeypatch):
    """A padded batch's decode attention grows its mask's shape every step: the executor runs it under
    ``model.GROWING_MASK_BACKENDS`` (memory-efficient first, no cuDNN plan per shape); prefill and unpadded batches keep
    SDPA's default. On the CPU the context changes nothing, so here the calls are recorded."""
    import offexec.model as M

    calls = []
    real = M.growing_mask_kernels

    def spy(on, device):
        calls.append(on)
        return real(on, device)

    monkeypatch.setattr(M, "growing_mask_kernels", spy)
    plan, res, ref = _run("llama", "flexgen", {"percent": (20, 80, 0, 100, 100, 0)})
    _check(res, ref)
    attn = [o.phase for o in plan.ops if o.kind == "compute" and o.part in ("layer", "attn_layer", "attention")]
    decode, prefill = attn.count("decode"), attn.count("prefill")
    assert decode and prefill
    assert calls.count(True) == decode and calls.count(False) == prefill
    assert M.GROWING_MASK_BACKENDS[0] == torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION


def test_growing_mask_kernels_order_efficient_first():
    import offexec.model as M

    with M.growing_mask_kernels(True, torch.device("cuda")):
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()
    with M.growing_mask_kernels(True, torch.device("cpu")):
        assert torch.backends.cuda.flash_sdp_enabled()
