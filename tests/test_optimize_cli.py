"""FlexGen's LP against brute force; the search; the CLI's output contract and its errors."""
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from offsim.cli import main
from offsim.policies.lp import flexgen_block_seconds, flexgen_lp, flexgen_terms
from offsim.search import search


def _brute_force(model, hw, s, n, gbs, nb, step=0.05):
    """Minimum of FlexGen's objective over a grid of placements that fit memory (float evaluation of the very
    terms the LP is built from)."""
    grid = np.round(np.arange(0, 1 + 1e-9, step), 6)
    cap = {"gpu": hw.gpu_mem_bytes, "cpu": hw.cpu_mem_bytes, "disk": hw.disk_bytes}
    best = np.inf
    for wg, wc, cg, cc, hg in itertools.product(grid, grid, grid, grid, (0.0, 1.0)):
        if wg + wc > 1 + 1e-9 or cg + cc > 1 + 1e-9:
            continue
        x = dict(wg=wg, wc=wc, wd=max(0.0, 1 - wg - wc), cg=cg, cc=cc, cd=max(0.0, 1 - cg - cc), hg=hg, hc=1 - hg)
        t = flexgen_terms(model, hw, s, n, gbs, nb, x, False)
        if any(t["mem"][k] > cap[k] for k in cap):
            continue
        best = min(best, flexgen_block_seconds(t, model, n) / (gbs * nb))
    return best


def test_lp_matches_brute_force(tiny_opt, small_gpu_t4):
    hw = small_gpu_t4
    for gbs, nb in ((2, 2), (4, 1)):
        r = flexgen_lp(tiny_opt, hw, 8, 4, gbs, nb)
        assert r is not None
        bf = _brute_force(tiny_opt, hw, 8, 4, gbs, nb)
        # the LP optimum is at least as good as any grid point, and the grid (5 % steps) comes within 2 % of it
        assert r.seconds_per_token <= bf * (1 + 1e-6)
        assert bf <= r.seconds_per_token * 1.02
        # and the LP's own solution, priced by the float terms, gives the LP's objective
        t = flexgen_terms(tiny_opt, hw, 8, 4, gbs, nb, r.fractions, False)
        assert flexgen_block_seconds(t, tiny_opt, 4) / (gbs * nb) == pytest.approx(r.seconds_per_token, rel=1e-3)


def test_lp_infeasible_returns_none(tiny_opt, small_gpu_t4):
    import dataclasses

    hw = dataclasses.replace(small_gpu_t4, gpu_mem_bytes=10, cpu_mem_bytes=10, disk_bytes=10)
    assert flexgen_lp(tiny_opt, hw, 8, 4, 2, 2) is None


def test_search_picks_feasible_best(tiny_opt, small_gpu_t4):
    res = search("flexgen", tiny_opt, small_gpu_t4, 8, 4, max_sims=3)
    # the winner is the best screened candidate, and its full simulation is what the result reports
    top = res.candidates.iloc[0]
    assert top["screen_total_tok_s"] == res.candidates["screen_total_tok_s"].max()
    assert res.metrics["total_tok_s"] == pytest.approx(top["total_tok_s"])
    # screening extrapolates decode from two steps: close to the full simulation for a tiny model
    assert top["screen_total_tok_s"] == pytest.approx(top["total_tok_s"], rel=0.1)
    assert res.metrics["peak_gpu_bytes"] <= small_gpu_t4.gpu_mem_bytes
    st = search("static-zero", tiny_opt, small_gpu_t4, 8, 4)
    assert st.workload.num_gpu_batches == 1


def test_search_infeasible_names_constraint(tiny_opt, small_gpu_t4):
    import dataclasses

    from offsim.core.errors import OffsimError

    hw = dataclasses.replace(small_gpu_t4, gpu_mem_bytes=1000)  # below even the library workspace
    with pytest.raises(OffsimError, match="GPU memory: even one sequence needs .* short by"):
        search("flexgen", tiny_opt, hw, 8, 4)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "offsim.cli", *args], capture_output=True, text=True)


def test_cli_simulate_json_last_line(tmp_path):
    r = run_cli("simulate", "--model", "opt-1.3b", "--hardware", "t4", "--gpu-mem-gb", "2", "--prompt-len", "64",
                "--gen-len", "4", "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--percent", "0", "100", "0",
                "100", "100", "0", "--trace", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("model", "hardware", "policy", "batch", "prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s",
              "total_tok_s", "peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes"):
        assert k in out
    assert out["batch"] == 8 and out["policy"] == "flexgen"
    assert (tmp_path / "t.json").exists()


@pytest.mark.parametrize("args,msg", [
    (["--model", "gpt-9"], "unknown model 'gpt-9'; valid presets: opt-125m"),
    (["--hardware", "tpu"], "unknown hardware 'tpu'; valid presets: t4"),
    (["--percent", "50", "60", "0", "100", "100", "0"], "exceeds 100"),
    (["--percent", "50", "50", "0", "100", "50", "0"], "must sum to 100"),
    (["--policy", "magic"], "unknown policy 'magic'"),
    (["--policy", "static-zero", "--cpu-attention"], "--cpu-attention does not apply"),
    (["--model", "opt-175b", "--hardware", "t4", "--percent", "100", "0", "100", "0", "100", "0", "--gen-len", "2"],
     "GPU memory short by"),
    (["--plan", "/nonexistent.json"], "cannot read plan"),
    (["--plan", "/nonexistent.json", "--gen-len", "2"], "drop --gen-len"),
    (["--hardware", "/nonexistent.json"], "cannot read hardware profile"),
])
def test_cli_bad_input_exit_2_one_line(args, msg):
    r = run_cli("simulate", *args)
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["--prompt-len", "0"], ["--gpu-batch-size", "-3"], ["--percent", "1", "2"]])
def test_cli_argparse_rejects(args):
    r = run_cli("simulate", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_cli_compare_lists_every_policy(capsys):
    rc = main(["compare", "--model", "opt-125m", "--hardware", "t4", "--gpu-mem-gb", "0.4", "--prompt-len", "32",
               "--gen-len", "3", "--policies", "static-accelerate", "static-zero", "flexgen", "--max-sims", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(o["policy"] for o in out) == ["flexgen", "static-accelerate", "static-zero"]
    assert all(o.get("total_tok_s", 0) > 0 or o.get("error") for o in out)


def test_flexgen_lp_on_hardware_without_a_disk():
    """A tier of 0 bytes (no disk) holds nothing: the LP places nothing there, or says no placement fits, instead
    of dividing by the capacity."""
    from offsim import get_hardware, get_model
    from offsim.policies.lp import flexgen_lp

    hw = get_hardware("t4").with_(disk_bytes=0)
    r = flexgen_lp(get_model("opt-30b"), hw, 512, 32, 16, 3, False)
    assert r is not None and r.fractions["wd"] < 1e-6 and r.fractions["cd"] < 1e-6
    # OPT-175B: ~350 GB of fp16 weights, the T4 preset 16 GB of GPU and 208 GB of host memory
    assert flexgen_lp(get_model("opt-175b"), hw, 512, 32, 32, 8, False) is None
