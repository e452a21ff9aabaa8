"""The search's candidates are fitted by the footprint's exact arithmetic (GPU, then host), and more GPU memory
never makes the best found worse: found by metamorphic checks of `offsim search` (2026-12-04), where FlexGen's
search found settings for Llama-2-70B on the H200 preset at 24 and 48 GiB but none at 32, flexgen-ref none at 64
and 80, and the static policies sent layers to disk that their host memory held; and screening's extrapolation
(2026-12-06): the mean of two screened decode steps, the first carrying the profile's CUDA-graph captures, ranked
OPT-6.7B's best 1984/32 candidate on a 16 GiB H200 profile at 124 total tok/s (203 in full), so 20 GiB found 191.
``python -m experiments.sweeps.search_monotone`` runs the ladders of budgets at large."""
from pathlib import Path

import pytest

from offsim.core import footprint as fp
from offsim.core.specs import get_hardware, get_model
from offsim.policies.base import capacity_of
from offsim.policies.flexgen import FlexGenSettings, candidates, flexgen_schedule, more_on_disk
from offsim.search import search

LLAMA_70B = get_model("llama-2-70b")
PROFILE = str(Path(__file__).resolve().parents[1] / "results" / "profiles" / "h200_offexec_v2.json")


@pytest.mark.parametrize("policy, budgets", [("flexgen", (24, 32, 48)), ("flexgen-ref", (48, 64))])
def test_more_gpu_memory_never_finds_worse(policy, budgets):
    found = [search(policy, LLAMA_70B, get_hardware("h200", gb), 512, 8).metrics["total_tok_s"] for gb in budgets]
    assert all(a <= b * 1.001 for a, b in zip(found, found[1:])), dict(zip(budgets, found))


def test_candidates_fit_first_then_those_spilled_to_disk_then_the_rest():
    hw = get_hardware("h200", 32)
    cap = capacity_of(hw)
    seen = []
    for c in candidates(LLAMA_70B, hw, 512, 8):
        pl = flexgen_schedule(LLAMA_70B, FlexGenSettings(**c.settings)).placement()
        seen.append(2 if not fp.fits(LLAMA_70B, cap, c.workload, pl) else 0)
    assert seen and seen[0] == 0 and seen == sorted(seen)  # every fitting candidate before every unfit one
    assert more_on_disk((20, 70, 0, 100, 100, 0), (20, 80, 0, 100, 100, 0))
    assert not more_on_disk((19, 81, 0, 100, 100, 0), (20, 80, 0, 100, 100, 0))  # a GPU trim to the host


def test_static_offload_tier_follows_the_policys_own_placement():
    from offsim.policies.static import accelerate_candidates

    # OPT-66B (122 GiB) on a 24 GiB RTX 3090 with 119 GiB of host memory: Accelerate keeps layers on the GPU,
    # the rest fits the host; all of it would not
    cands = list(accelerate_candidates(get_model("opt-66b"), get_hardware("rtx3090", 24), 256, 32, batch=24))
    assert [c.settings["offload"] for c in cands] == ["cpu"]


@pytest.mark.parametrize("policy, model, hardware, lens, budgets, rel", [
    ("flexgen", "opt-6.7b", PROFILE, (1984, 32), (16, 20), 0.02),  # the first decode step's captures
    ("static-accelerate", "opt-6.7b", "h200", (512, 32), (24, 32), 0.02),  # GPU layers sized for the whole output
    # the LP's 12 best shapes: 128 x 2, the best at 16 GiB, was not among them at 20 (screened 2 % fast: N_r grows)
    ("tightllm", "opt-13b", "h200", (512, 32), (16, 20), 0.03),
])
def test_more_gpu_memory_never_finds_worse_screened_right(policy, model, hardware, lens, budgets, rel):
    found = []
    for gb in budgets:
        res = search(policy, get_model(model), get_hardware(hardware, gb), *lens)
        found.append(res.metrics["total_tok_s"])
        top = res.candidates.iloc[0]  # the verified candidate: screened at its full-length rate
        assert top["screen_total_tok_s"] == pytest.approx(top["total_tok_s"], rel=rel), (gb, dict(top))
    assert all(a <= b * 1.005 for a, b in zip(found, found[1:])), dict(zip(budgets, found))


def test_extrapolation_takes_the_first_decode_step_apart():
    """A plan of prefill and two decode steps, its first step 3x the second (the profile's graph captures),
    extrapolated to 32 tokens as screening and ``verify_decode_steps`` do, is the full plan's rate to 1 %, not the
    mean step's (~40 % slow)."""
    from offsim.core.sim import simulate
    from offsim.core.specs import Workload
    from offsim.policies import build_plan
    from offsim.search.search import decode_step_times, extrapolated_metrics

    model, hw = get_model("opt-6.7b"), get_hardware(PROFILE, 16)
    st = {"percent": (100, 0, 100, 0, 100, 0), "cpu_attention": False}
    full = Workload(1984, 32, 2, 1)
    short = simulate(build_plan("flexgen", model, hw, full.with_(gen_len=3), st, validate=False), hw)
    first, later, steps = decode_step_times(short, short.metrics())
    assert steps == 2 and first > 2 * later > 0
    want = simulate(build_plan("flexgen", model, hw, full, st, validate=False), hw).metrics()
    got = extrapolated_metrics(short, full)
    assert got["gen_len"] == 32 and got["extrapolated_from_decode_steps"] == 2
    assert got["total_tok_s"] == pytest.approx(want["total_tok_s"], rel=0.01)
    assert got["decode_tok_s"] == pytest.approx(want["decode_tok_s"], rel=0.01)
    assert extrapolated_metrics(short, full.with_(gen_len=3)) == short.metrics()  # not shortened: as simulated


def test_search_screens_each_candidate_once():
    # OPT-13B 512/32 on a 20 GiB H200: TightLLM's 8 x 16 doubled and the LP's own 16 x 16 trim to one placement,
    # which took two of the six screened places
    res = search("tightllm", get_model("opt-13b"), get_hardware("h200", 20), 512, 32)
    keys = [(r.gpu_batch_size, r.num_gpu_batches, repr(r.settings)) for r in res.candidates.itertuples()]
    assert len(keys) == len(set(keys)) == 6
