"""Offline jobs of mixed-length requests (issue 20): per-prompt lengths in a workload, padded and length-bucketed
blocks, a uniform job that is exactly the plain simulation, TightLLM's distributor deciding on the batch's mean
length, ``offsim job`` (its table, JSON line and bad input), per-request latency percentiles."""
import json

import numpy as np
import pandas as pd
import pytest

from offsim.cli import main
from offsim.core.errors import OffsimError
from offsim.core.requests import TASKS, Request, draw_requests, make_blocks, read_requests_csv
from offsim.core.sim import simulate
from offsim.core.specs import Workload, get_hardware, get_model
from offsim.policies import build_plan
from offsim.policies.registry import check_plan_fits, same_placement
from offsim.policies.tightllm import policy as T
from offsim.search.job import run_job
from offsim.search.search import SearchResult, search

FLEXGEN = ("flexgen", {"percent": (0, 100, 0, 100, 100, 0)})  # everything streamed: the link decides
TIGHTLLM = ("tightllm", {"percent": (0, 100, 0, 100, 100, 0)})


@pytest.fixture(scope="module")
def opt125():
    return get_model("opt-125m")


@pytest.fixture(scope="module")
def t4_small():
    return get_hardware("t4", 1.0)  # 1 GiB budget: OPT-125M's weights and KV stream over PCIe


def fixed(policy: str, settings: dict, gbs: int, nb: int) -> SearchResult:
    """A 'search result' with a given block shape and settings, so a test picks the shape (no search)."""
    return SearchResult(policy, settings, Workload(8, 2, gbs, nb), {}, pd.DataFrame())


def skewed(n: int) -> list[Request]:
    """Every other request short (prompt 16, 2 tokens out), the others long (prompt 200, 8 tokens out)."""
    return [Request(i, 16 if i % 2 else 200, 2 if i % 2 else 8) for i in range(n)]


# ---- workload --------------------------------------------------------------------------------------------------
def test_workload_per_prompt_lengths_give_padded_and_mean_lengths():
    wl = Workload(300, 5, 2, 2, prompt_lens=(100, 300, 50, 0), gen_lens=(5, 1, 3, 0))
    assert wl.batch_prompt_lens == (300, 50)  # each batch padded to its own longest prompt
    assert wl.batch_mean_prompt_len(0) == 200 and wl.batch_mean_prompt_len(1) == 50  # empty slot left out
    assert wl.request_lens() == [(0, 100, 5), (0, 300, 1), (1, 50, 3)]
    assert wl.slot_tokens() == 2 * (300 + 5) + 2 * (50 + 5)
    assert Workload.from_dict(wl.to_dict()) == wl
    uniform = Workload(64, 4, 2, 3)
    assert uniform.batch_prompt_lens == (64,) * 3 and "gen_lens" not in uniform.to_dict()


@pytest.mark.parametrize("kw, msg", [
    (dict(prompt_lens=(10, 20, 30), gen_lens=(1, 1, 1)), "3 lengths for 4 prompts"),
    (dict(prompt_lens=(10, 20, 30, 400), gen_lens=(1, 1, 1, 1)), "in [0, 300]"),
    (dict(prompt_lens=(10, 20, 30, 40), gen_lens=()), "go together"),
    (dict(prompt_lens=(10, 0, 30, 40), gen_lens=(1, 1, 1, 1)), "same empty slots"),
    (dict(prompt_lens=(0, 0, 30, 40), gen_lens=(0, 0, 1, 1)), "GPU batch 0 has no prompt"),
])
def test_workload_refuses_inconsistent_lengths(kw, msg):
    with pytest.raises(OffsimError) as e:
        Workload(300, 5, 2, 2, **kw)
    assert msg in str(e.value)


def test_blocks_padded_in_order_bucketed_sorted_last_block_partly_filled():
    reqs = skewed(10)
    pad = make_blocks(reqs, 2, 2, "padded")
    assert [b.slots for b in pad][:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert pad[0].workload.batch_prompt_lens == (200, 200)  # a long prompt in every batch
    assert pad[-1].workload.num_gpu_batches == 1 and pad[-1].workload.gpu_batch_size == 2  # 2 left: one batch of 2
    buck = make_blocks(reqs, 2, 2, "bucketed")
    assert buck[0].workload.batch_prompt_lens == (16, 16) and buck[-1].workload.batch_prompt_lens == (200,)
    # 5 left with batches of 2: three batches, the last with one empty slot
    b = make_blocks(skewed(5), 2, 4)[0]
    assert b.workload.num_gpu_batches == 3 and b.slots[-1] is None and b.workload.prompt_lens[-1] == 0
    assert sorted(i for blk in buck for i in blk.slots if i is not None) == list(range(10))


# ---- padded vs bucketed ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, settings", [FLEXGEN, TIGHTLLM])
def test_bucketed_never_slower_and_pads_less_on_a_skewed_mix(opt125, t4_small, policy, settings):
    reqs = skewed(16)
    best = fixed(policy, settings, 4, 2)
    pad = run_job(policy, opt125, t4_small, reqs, "padded", best=best)
    buck = run_job(policy, opt125, t4_small, reqs, "bucketed", best=best)
    assert buck.completion_s <= pad.completion_s
    assert buck.completion_s < 0.9 * pad.completion_s  # half the batches no longer run at 200 tokens
    assert buck.padding_waste < pad.padding_waste
    assert pad.padding_waste > 0.4  # padded: short prompts padded to 200 in every batch
    assert buck.prompt_tokens == pad.prompt_tokens and buck.output_tokens == pad.output_tokens


# ---- a uniform job is the plain simulation -------------------------------------------------------------------
@pytest.mark.parametrize("policy, settings", [FLEXGEN, TIGHTLLM, ("static-zero", {"offload": "cpu"})])
def test_uniform_job_equals_single_length_simulation(opt125, t4_small, policy, settings):
    gbs, nb = (4, 1) if policy == "static-zero" else (4, 2)
    P, G = 48, 5
    reqs = [Request(i, P, G) for i in range(2 * gbs * nb)]  # two identical blocks
    res = run_job(policy, opt125, t4_small, reqs, "padded", best=fixed(policy, settings, gbs, nb))
    tr = simulate(build_plan(policy, opt125, t4_small, Workload(P, G, gbs, nb), settings), t4_small)
    assert res.blocks == 2 and res.distinct_blocks == 1  # the second block is the first's shape: not re-simulated
    assert res.completion_s == 2 * tr.makespan_s  # bit for bit
    assert res.padding_waste == 0.0
    # every request of a block is done when its batch's last step ends
    head = tr.df[(tr.df["kind"] == "compute") & (tr.df["step"] == G - 1)].groupby("batch")["end_s"].max()
    first = res.request_done_s[:gbs * nb]
    assert list(first) == [head[k // gbs] for k in range(gbs * nb)]  # request k sits in batch k // gbs
    assert list(res.request_done_s[gbs * nb:]) == list(first + tr.makespan_s)


# ---- fast mode: decode steps interpolated ---------------------------------------------------------------------------
@pytest.mark.parametrize("policy, settings", [FLEXGEN, TIGHTLLM])
def test_interpolated_decode_close_to_exact(opt125, t4_small, policy, settings):
    reqs = [Request(i, 32 + 16 * (i % 4), 24 + 4 * (i % 3)) for i in range(16)]
    best = fixed(policy, settings, 4, 2)
    exact = run_job(policy, opt125, t4_small, reqs, "bucketed", best=best)
    fast = run_job(policy, opt125, t4_small, reqs, "bucketed", best=best, decode_steps=6)
    assert fast.completion_s == pytest.approx(exact.completion_s, rel=0.02)
    np.testing.assert_allclose(fast.request_done_s, exact.request_done_s, rtol=0.03)
    assert fast.summary()["decode_steps"] == 6 and exact.summary()["decode_steps"] is None
    # a block no longer than the simulated steps is exact
    short = [Request(i, 32, 5) for i in range(8)]
    assert run_job(policy, opt125, t4_small, short, best=best, decode_steps=6).completion_s == \
        run_job(policy, opt125, t4_small, short, best=best).completion_s


def test_fast_mode_simulates_whole_blocks_of_a_length_dependent_placement(opt125):
    # Accelerate's GPU layers make room for the KV of the whole output: a shortened piece would be another plan
    hw = get_hardware("t4", 0.8)  # 5 layers fit beside 64 sequences' KV of 32 steps, 10 beside 4 steps'
    reqs = [Request(i, 32 + 16 * (i % 4), 24 + 4 * (i % 3)) for i in range(64)]
    best = fixed("static-accelerate", {"offload": "cpu"}, 64, 1)
    wl = make_blocks(reqs, 64, 1)[0].workload
    short = wl.with_(gen_len=4, gen_lens=tuple(min(g, 4) for g in wl.gen_lens))
    assert not same_placement("static-accelerate", opt125, hw, {"offload": "cpu"}, wl, short)
    assert same_placement("flexgen", opt125, hw, FLEXGEN[1], wl, short)
    fast = run_job("static-accelerate", opt125, hw, reqs, best=best, decode_steps=4)
    exact = run_job("static-accelerate", opt125, hw, reqs, best=best)
    assert fast.completion_s == exact.completion_s
    assert list(fast.request_done_s) == list(exact.request_done_s)


def test_search_with_a_shortened_last_stage_picks_the_same(opt125, t4_small):
    full = search("flexgen", opt125, t4_small, 64, 40, max_sims=2)
    short = search("flexgen", opt125, t4_small, 64, 40, max_sims=2, verify_decode_steps=4)
    assert (short.settings, short.workload) == (full.settings, full.workload)
    assert short.metrics["extrapolated_from_decode_steps"] == 5 and short.metrics["gen_len"] == 40
    # (its metrics are screening's estimate, the first steps' mean step time: optimistic where steps grow)
    assert short.metrics["total_tok_s"] >= full.metrics["total_tok_s"]
    # the full-length fit is still checked from arithmetic: a block too large for the GPU is refused
    with pytest.raises(OffsimError, match="does not fit"):
        check_plan_fits("flexgen", opt125, t4_small, Workload(64, 40, 4096, 4), {"percent": (100, 0, 100, 0, 100, 0)})


@pytest.mark.parametrize("policy, settings", [FLEXGEN, TIGHTLLM, ("static-zero", {"offload": "cpu", "kv_on_cpu": True})])
def test_padded_block_fits_in_the_worst_case_the_job_search_reserves(opt125, t4_small, policy, settings):
    """A left-padded batch's ops hold a key mask (footprint.mask_bytes, the graphs' per-sequence keys): a padded
    block at the job's maxima needs more GPU memory than the uniform workload at those maxima, and no more than
    that workload with the mask reserved -- what the job's search plans at (Workload.reserve_key_mask)."""
    from offsim.core import footprint as fp
    from offsim.policies.registry import get_policy

    pol = get_policy(policy)
    st = pol.settings_from(settings)
    gbs, nb = (16, 1) if policy == "static-zero" else (8, 2)

    def gpu(wl):
        return sum(fp.placement_tier_bytes(opt125, wl, pol.placement(opt125, t4_small, wl, st))["gpu"].values())

    reqs = [Request(i, 1024 - 40 * (i % 3), 4 + i % 2) for i in range(16)]
    blk = make_blocks(reqs, gbs, nb)[0].workload
    top = Workload(1024, 5, gbs, nb)
    assert blk.padded and gpu(blk) > gpu(top)  # what the search at the maxima used to place
    assert gpu(blk) <= gpu(top.with_(reserve_key_mask=True))
    assert top.with_(reserve_key_mask=True).key_masked and not top.key_masked
    assert "reserve_key_mask" not in top.to_dict()  # plans without it serialise (and hash) as before
    assert Workload.from_dict(top.with_(reserve_key_mask=True).to_dict()).reserve_key_mask


def test_job_search_reserves_the_key_mask_only_where_prompts_differ(opt125, t4_small):
    from offsim.search.job import best_for_job

    mixed = [Request(i, 200 - 50 * (i % 3), 4) for i in range(12)]
    best = best_for_job("flexgen", opt125, t4_small, mixed, max_sims=1)
    assert best.workload.reserve_key_mask
    for blk in make_blocks(mixed, best.workload.gpu_batch_size, best.workload.num_gpu_batches):
        check_plan_fits("flexgen", opt125, t4_small, blk.workload, best.settings)
    same = [Request(i, 200, 2 + i % 3) for i in range(12)]  # outputs differ, prompts do not: nothing is padded
    assert not best_for_job("flexgen", opt125, t4_small, same, max_sims=1).workload.reserve_key_mask


@pytest.mark.parametrize("policy", ["tightllm", "flexgen", "static-zero", "selectn"])
def test_search_honours_a_small_max_batch(opt125, t4_small, policy):
    """A cap on sequences per block reaches the candidate generators (``max_batch=``): TightLLM keeps its best few LP
    shapes, which on a 1 GiB T4 all hold more than 12 sequences, so a cap applied after that cut left it none."""
    for cap in (4, 12):
        res = search(policy, opt125, t4_small, 64, 8, max_sims=2, max_batch=cap)
        assert res.workload.num_prompts <= cap


def test_decode_steps_below_two_refused(opt125, t4_small):
    with pytest.raises(OffsimError, match="decode_steps must be at least 2"):
        run_job("flexgen", opt125, t4_small, [Request(0, 32, 8)], best=fixed(*FLEXGEN, 1, 1), decode_steps=1)


# ---- TightLLM: the batch's mean length ---------------------------------------------------------------------------
def test_tightllm_distributor_sees_the_batch_mean_length(opt125, t4_small, monkeypatch):
    # activations parked on the host: no prompt-sized activation buffer caps N_r, so the decisions are the
    # distributor's own
    st = T.TightLLMSettings(percent=(0, 100, 0, 100, 0, 100))
    wl = Workload(200, 4, 2, 2, prompt_lens=(40, 200, 120, 120), gen_lens=(4, 4, 4, 4))  # means 120 and 120
    seen = []
    real = T.distributor

    def spy(*a, **k):
        kvd = real(*a, **k)
        decide = kvd.decide

        class Spy:
            def decide(self, d, solver="ilp"):
                seen.append(d)
                return decide(d, solver)

        return Spy()

    monkeypatch.setattr(T, "distributor", spy)
    nr = T.recompute_tokens(opt125, t4_small, wl, st)
    assert sorted({d.ctx_tokens for d in seen}) == [120, 121, 122]  # mean 120 + step - 1, in both batches
    monkeypatch.setattr(T, "distributor", real)
    # the decisions of a uniform block at the mean length (here: recompute everything, N_r = N_ctx -- of the
    # mean, 120 + step - 1, not of batch 0's padded 200)
    assert nr == T.recompute_tokens(opt125, t4_small, Workload(120, 4, 2, 2), st)
    assert nr[1] == [120, 120]
    # ... while the ops run at each batch's padded length
    plan = build_plan("tightllm", opt125, t4_small, wl, st)
    layer = [op for op in plan.ops if op.kind == "compute" and op.part == "layer"]
    assert {op.batch: op.q_tokens for op in layer if op.step == 0} == {0: 200, 1: 120}
    assert {(op.batch, op.ctx_tokens) for op in layer if op.step == 1} == {(0, 201), (1, 121)}
    assert T.batch_ctx_tokens(wl, 2, 0) == (121, 201)


# ---- CLI ---------------------------------------------------------------------------------------------------------
def _spec(tmp_path, **over) -> str:
    d = {"name": "t", "model": "opt-125m", "hardware": "t4", "gpu_mem_gb": 1.0,
         "policies": ["flexgen", "static-zero"], "requests": {"distribution": "classification", "count": 24,
                                                             "seed": 3}}
    d.update(over)
    p = tmp_path / "job.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_job_cli_table_and_json_percentiles_ordered(tmp_path, capsys):
    rc = main(["job", _spec(tmp_path), "--batching", "bucketed", "--exact"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    js = json.loads(out[-1])
    assert [o["policy"] for o in js] and all("error" not in o for o in js)
    assert [o["completion_s"] for o in js] == sorted(o["completion_s"] for o in js)  # shortest job first
    assert js[0]["best"] and not any(o["best"] for o in js[1:])
    for o in js:
        assert o["requests"] == 24 and o["batching"] == "bucketed" and o["decode_steps"] is None
        assert 0 < o["p50_request_s"] <= o["p90_request_s"] <= o["p99_request_s"] <= o["completion_s"]
        assert 0 <= o["padding_waste"] < 1
        assert o["output_tok_s"] == pytest.approx(o["output_tokens"] / o["completion_s"])
    assert "p99_s" in "\n".join(out) and "padding" in "\n".join(out)


def test_job_from_csv(tmp_path, capsys):
    (tmp_path / "lens.csv").write_text("prompt_len,gen_len\n32,2\n64,4\n16,1\n")
    rc = main(["job", _spec(tmp_path, requests={"csv": "lens.csv"}, policies="flexgen"), "--no-progress"])
    js = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and js[0]["requests"] == 3 and js[0]["prompt_tokens"] == 112 and js[0]["output_tokens"] == 7


@pytest.mark.parametrize("over, msg", [
    ({"requests": {"distribution": "poetry", "count": 4}}, "unknown length distribution 'poetry'"),
    ({"requests": {"count": 4}}, "one of 'distribution'"),
    ({"requests": {"distribution": "classification", "count": 0}}, "count must be a positive integer"),
    ({"batching": "sorted"}, "batching must be one of"),
    ({"policies": ["flexgen", "vllm"]}, "unknown policy 'vllm'"),
    ({"model": "opt-7b"}, "opt-7b"),
    ({"colour": "red"}, "unknown keys ['colour']"),
    ({"decode_steps": 1}, "decode_steps must be an integer >= 2 or null"),
    ({"requests": {"csv": "missing.csv"}}, "cannot read request lengths"),
    ({"requests": {"csv": "bad.csv"}}, "row 3 is not two integers"),
    ({"requests": {"csv": "long.csv"}}, "exceeds opt-125m's 2048 positions"),
])
def test_job_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, over, msg):
    (tmp_path / "bad.csv").write_text("prompt_len,gen_len\n32,2\n64,x\n")
    (tmp_path / "long.csv").write_text("prompt_len,gen_len\n2000,64\n")
    rc = main(["job", _spec(tmp_path, **over)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert msg in err


def test_job_cli_nothing_fits_exits_2(tmp_path, capsys):
    rc = main(["job", _spec(tmp_path, gpu_mem_gb=0.001)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no policy fits job t" in err and "flexgen:" in err


# ---- named distributions -----------------------------------------------------------------------------------------
def test_task_distributions_have_their_shapes_and_are_seeded():
    stats = {}
    for name in TASKS:
        r = draw_requests(name, 2000, seed=1)
        assert r == draw_requests(name, 2000, seed=1) and r != draw_requests(name, 2000, seed=2)
        p, g = np.array([x.prompt_len for x in r]), np.array([x.gen_len for x in r])
        stats[name] = (p.mean(), g.mean())
    assert stats["classification"][0] < 150 and stats["classification"][1] <= 4  # short in, short out
    assert 0.8 < stats["translation"][1] / (stats["translation"][0] - 16) < 1.4  # out ~ in
    assert stats["summarization"][0] > 500 and stats["summarization"][1] < 100  # long in, short out
    assert stats["feature_extraction"][0] > 500 and stats["feature_extraction"][1] == 1  # long in, one token


def test_csv_reader_refuses_a_missing_header(tmp_path):
    (tmp_path / "x.csv").write_text("32,2\n")
    with pytest.raises(OffsimError, match="header 'prompt_len,gen_len'"):
        read_requests_csv(tmp_path / "x.csv")
    (tmp_path / "x.csv").write_bytes(b"prompt_len,gen_len\n\xff\xfe32,2\n")  # not text: one line, no traceback
    with pytest.raises(OffsimError, match="not text"):
        read_requests_csv(tmp_path / "x.csv")
    # a spreadsheet's "CSV UTF-8" (a byte-order mark first) is read; more rows than a job takes are refused
    (tmp_path / "x.csv").write_bytes("\ufeffprompt_len,gen_len\n32,2\n".encode())
    assert read_requests_csv(tmp_path / "x.csv") == [Request(0, 32, 2)]
    (tmp_path / "x.csv").write_text("prompt_len,gen_len\n" + "32,2\n" * 1_000_001)
    with pytest.raises(OffsimError, match="more than one job takes"):
        read_requests_csv(tmp_path / "x.csv")
