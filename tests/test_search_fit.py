"""The search's candidates are fitted by the footprint's exact arithmetic (GPU, then host), and more GPU memory
never makes the best found worse: found by metamorphic checks of `offsim search` (2026-12-04), where FlexGen's
search found settings for Llama-2-70B on the H200 preset at 24 and 48 GiB but none at 32, flexgen-ref none at 64
and 80, and the static policies sent layers to disk that their host memory held."""
import pytest

from offsim.core import footprint as fp
from offsim.core.specs import get_hardware, get_model
from offsim.policies.base import capacity_of
from offsim.policies.flexgen import FlexGenSettings, candidates, flexgen_schedule, more_on_disk
from offsim.search import search

LLAMA_70B = get_model("llama-2-70b")


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
