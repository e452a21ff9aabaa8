"""The search over pipeline plans (issue 18, item 1): ``search(..., num_gpus=N)`` / ``offsim search --num-gpus N``
chooses the block shape, micro-batch groups, placement and layers per stage by FlexGen's LP per stage split
(``lp.flexgen_stage_lp``), verified by simulation. One GPU is the single-GPU search, exactly."""
import dataclasses
import json

import pytest

from offsim import build_plan, get_hardware, simulate
from offsim.cli import main
from offsim.core.errors import OffsimError
from offsim.core.footprint import GPU_PROCESS_OVERHEAD_BYTES
from offsim.core.specs import ModelSpec, Workload
from offsim.policies.flexgen import check_flexgen_stages, fit_stages, stage_candidates
from offsim.policies.lp import flexgen_lp, flexgen_stage_lp, stage_splits
from offsim.policies.registry import get_policy
from offsim.search import search

MODEL = ModelSpec(name="tiny-opt-8", family="opt", num_layers=8, d_model=256, num_heads=4, num_kv_heads=4,
                  head_dim=64, ffn_dim=1024, vocab_size=512, max_positions=256)
# an H200 with 6 MiB of GPU memory for the plan: the tiny model's weights (12 MiB) must be offloaded on one GPU
HW = dataclasses.replace(get_hardware("h200"), gpu_mem_bytes=GPU_PROCESS_OVERHEAD_BYTES + (6 << 20))
P, G = 32, 8


def test_stage_splits():
    assert stage_splits(48, 1) == [(48,)]
    assert stage_splits(48, 2) == [(24, 24), (26, 22), (25, 23), (23, 25), (22, 26)]
    # the balanced default first (the first L mod S stages one layer more), then the last stage's layers moved
    s = stage_splits(10, 3)
    assert s[0] == (4, 3, 3) and all(sum(x) == 10 and len(x) == 3 and min(x) >= 1 for x in s)
    assert len(set(s)) == len(s) and (3, 3, 4) in s
    assert all(min(x) >= 1 for x in stage_splits(3, 3))


def test_stage_lp_of_one_stage_is_flexgens_lp():
    for ca in (False, True):
        a = flexgen_lp(MODEL, HW, P, G, 4, 2, ca)
        b = flexgen_stage_lp(MODEL, HW, P, G, 4, 2, (MODEL.num_layers,), 1, ca)
        assert b.seconds_per_token == pytest.approx(a.seconds_per_token, rel=1e-6)
        assert b.stage_layers == (8,) and b.micro_batches == 1


def test_stage_lp_gains_from_more_gpus_and_prices_the_shared_disk():
    one = flexgen_lp(MODEL, HW, P, G, 4, 4)
    two = flexgen_stage_lp(MODEL, HW, P, G, 4, 4, (4, 4))
    assert two.micro_batches == 2 and two.seconds_per_token < one.seconds_per_token
    assert two.fractions["wg"] > one.fractions["wg"]  # half the layers per GPU: more of them resident
    # weights on the disk, shared by the stages: each micro-batch group streams them again, so one group (the stages
    # taking turns) moves half the disk bytes of two
    disk = dataclasses.replace(HW, cpu_mem_bytes=4 << 20)
    g2, g1 = (flexgen_stage_lp(MODEL, disk, P, G, 4, 4, (4, 4), g) for g in (2, 1))
    assert g2.fractions["wd"] > 0.1 and g1.seconds_per_token < g2.seconds_per_token


@pytest.mark.parametrize("layers", [8, 9])
def test_stage_candidates_fit_every_stage_and_list_the_balanced_sibling(layers):
    model = dataclasses.replace(MODEL, num_layers=layers, name=f"tiny-opt-{layers}")
    cands = list(stage_candidates(model, HW, P, G, 2))
    fits = []
    for c in cands:
        try:
            check_flexgen_stages(model, HW, c.workload, get_policy("flexgen").settings_from(c.settings))
            fits.append(True)
        except OffsimError:
            fits.append(False)
    # every stage of the candidates fits (the LP's rounded optimum trimmed by ``fit_stages``); those that could not
    # be made to fit come last
    assert sum(fits) > 6 and fits == sorted(fits, reverse=True)
    even = stage_splits(layers, 2)[0]
    seen = []
    for c in cands:
        st = c.settings
        assert st["num_stages"] == 2 and sum(st["stage_layers"]) == layers
        assert 1 <= st["micro_batches"] <= c.workload.num_gpu_batches
        seen.append((c.workload, st["micro_batches"], tuple(st["stage_layers"])))
    for i, (wl, g, split) in enumerate(seen[:sum(fits)]):  # an unbalanced split: its block's balanced one listed too
        if split != even:
            assert (wl, g, even) in seen[:i + 3] + seen[sum(fits):]
    if layers == 9:  # (5, 4) balanced; the LP prefers (4, 5) for some block: the last stage sends nothing on
        assert any(split == (4, 5) for _, _, split in seen[:sum(fits)])


def _simulated(settings, wl):
    return simulate(build_plan("flexgen", MODEL, HW, wl, settings), HW).metrics()


def test_search_num_gpus_fits_every_stage_and_beats_the_balanced_default():
    one = search("flexgen", MODEL, HW, P, G)
    res = search("flexgen", MODEL, HW, P, G, num_gpus=2)
    st, wl = res.settings, res.workload
    assert st["num_stages"] == 2 and res.stages[0][0] == 0 and res.stages[-1][1] == 8
    assert [hi - lo for lo, hi in res.stages] == list(st["stage_layers"])
    check_flexgen_stages(MODEL, HW, wl, get_policy("flexgen").settings_from(st))
    for d in range(2):
        assert 0 < res.metrics[f"peak_gpu{d}_bytes"] <= HW.gpu_mem_bytes
    # what it reports is the full plan's simulation
    assert _simulated(st, wl)["total_tok_s"] == pytest.approx(res.metrics["total_tok_s"])
    # at least as good as the balanced default of the same block (its percentages fitted to that split)
    pipe = {"num_stages": 2, "stage_layers": (), "micro_batches": 0}
    p = fit_stages(MODEL, HW, wl, st["percent"], st["cpu_attention"], pipe)
    balanced = _simulated({**st, **pipe, "percent": p}, wl)
    assert res.metrics["total_tok_s"] >= balanced["total_tok_s"] * (1 - 1e-9)
    # two GPUs of this budget hold twice the resident layers: the pipeline beats the single-GPU search
    assert res.metrics["total_tok_s"] > 1.3 * one.metrics["total_tok_s"]
    assert res.summary()["stages"] == [list(x) for x in res.stages]


def test_search_one_gpu_is_the_single_gpu_search():
    a = search("flexgen", MODEL, HW, P, G)
    b = search("flexgen", MODEL, HW, P, G, num_gpus=1)
    assert a.settings == b.settings and a.workload == b.workload and a.metrics == b.metrics
    assert a.candidates.equals(b.candidates) and b.stages == () and "num_stages" not in b.settings
    assert "stages" not in b.summary()


def test_search_num_gpus_refusals():
    with pytest.raises(OffsimError, match="policy static-zero runs on one GPU .*flexgen.*drop --num-gpus"):
        search("static-zero", MODEL, HW, P, G, num_gpus=2)
    with pytest.raises(OffsimError, match="exceeds tiny-opt-8's 8 layers"):
        search("flexgen", MODEL, HW, P, G, num_gpus=9)
    with pytest.raises(OffsimError, match="num_gpus must be a positive integer"):
        search("flexgen", MODEL, HW, P, G, num_gpus=0)
    tiny = dataclasses.replace(HW, gpu_mem_bytes=1000)
    with pytest.raises(OffsimError, match="on 2 GPUs of h200: GPU memory: even one sequence"):
        search("flexgen", MODEL, tiny, P, G, num_gpus=2)


def test_cli_search_num_gpus(capsys):
    argv = ["search", "--model", "opt-1.3b", "--hardware", "h200", "--gpu-mem-gb", "2", "--prompt-len", "64",
            "--gen-len", "4", "--max-sims", "1"]
    assert main(argv + ["--num-gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 GPUs of h200" in out and "stages: GPU 0 layers 0-" in out
    js = json.loads(out.strip().splitlines()[-1])
    assert js["num_gpus"] == 2 and [lo for lo, _ in js["stages"]][0] == 0 and js["stages"][-1][1] == 24
    assert js["settings"]["num_stages"] == 2 and sum(js["settings"]["stage_layers"]) == 24
    # the settings it prints are what `offsim simulate --num-gpus` takes
    st = js["settings"]
    assert main(["simulate", "--model", "opt-1.3b", "--hardware", "h200", "--gpu-mem-gb", "2", "--prompt-len", "64",
                 "--gen-len", "4", "--gpu-batch-size", str(js["gpu_batch_size"]), "--num-gpu-batches",
                 str(js["num_gpu_batches"]), "--percent", *map(str, st["percent"]), "--num-gpus", "2",
                 "--set", f"stage_layers={st['stage_layers']}", "--set", f"micro_batches={st['micro_batches']}"]
                + (["--cpu-attention"] if st["cpu_attention"] else [])) == 0
    sim = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sim["total_tok_s"] == pytest.approx(js["total_tok_s"])
    assert main(["search", "--policy", "static-zero", "--model", "opt-1.3b", "--hardware", "h200",
                 "--num-gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "runs on one GPU" in err and len(err.strip().splitlines()) == 1


def test_simulate_num_gpus_that_does_not_fit_points_to_search_with_the_gpus(capsys):
    argv = ["simulate", "--model", "opt-1.3b", "--hardware", "h200", "--gpu-mem-gb", "1", "--prompt-len", "64",
            "--gen-len", "4", "--num-gpus", "2", "--percent", "100", "0", "100", "0", "100", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "stage 0 (layers 0-11) does not fit on its GPU" in err
    assert "offsim search --policy flexgen --model opt-1.3b" in err and "--num-gpus 2` find settings" in err


def test_workload_fields_of_a_pipeline_candidate():
    c = next(iter(stage_candidates(MODEL, HW, P, G, 2)))
    assert isinstance(c.workload, Workload) and c.workload.prompt_len == P and c.workload.gen_len == G
