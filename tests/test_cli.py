"""``offsim`` CLI without rough edges (issue 17): `compare` says who wins and why; bad input, inconsistent configs,
missing output directories, settings that do not fit and a closed stdout pipe give exit 2 (or a quiet exit) with one
line, never a traceback; `--plan` refuses options that would define another plan; `validate` fits a terminal."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offsim.cli import main
from offsim.core.errors import OffsimError
from offsim.core.specs import MODEL_PRESETS, ModelSpec

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model", "opt-125m", "--hardware", "t4", "--prompt-len", "32", "--gen-len", "3"]


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == 2, (cap.out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _no_raw_byte_counts(msg: str) -> bool:
    """Sizes in GiB: no number of 8 digits or more (a raw byte count) in the message."""
    return not re.search(r"\d{8,}", msg)


# ---- compare: who wins and why -----------------------------------------------------------------------------------
def test_compare_sorted_best_marked_with_latency_and_bottleneck(capsys):
    rc = main(["compare", *SMALL, "--gpu-mem-gb", "0.4", "--policies", "static-accelerate", "static-zero",
               "--progress"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    js = [o for o in json.loads(out[-1]) if "error" not in o]
    assert len(js) >= 2
    tok = [o["total_tok_s"] for o in js]
    assert tok == sorted(tok, reverse=True)  # best first by the objective
    assert [o["best"] for o in js] == [True] + [False] * (len(js) - 1)
    for o in js:
        assert o["ttft_s"] == pytest.approx(o["prefill_s"])
        assert o["decode_ms_per_token"] == pytest.approx(1e3 * o["decode_s"] / (o["gen_len"] - 1))
        assert o["bottleneck_stream"] in ("compute", "cpu", "h2d", "d2h", "disk")
        assert 0 < o["bottleneck_busy_frac"] <= 1 + 1e-9
    table = "\n".join(out)
    assert "ttft_s" in table and "decode_ms/tok" in table and "bottleneck" in table
    best_row = next(line for line in out if line.lstrip().startswith("*"))
    assert js[0]["policy"] in best_row
    assert f"{js[0]['policy']} wins" in table


def test_compare_every_policy_infeasible_exits_2_with_each_reason(capsys):
    err = _one_line_error(capsys, ["compare", *SMALL, "--gpu-mem-gb", "0.001", "--policies", "static-zero",
                                   "flexgen"])
    assert "no policy fits" in err and "static-zero:" in err and "flexgen:" in err
    assert _no_raw_byte_counts(err)


def test_summary_bottleneck_is_the_busiest_stream():
    from offsim.cli import latency_and_bottleneck

    m = {"gen_len": 5, "prefill_s": 2.0, "decode_s": 8.0, "total_s": 10.0, "busy_compute_s": 3.0, "busy_h2d_s": 9.0,
         "busy_d2h_s": 1.0, "busy_disk_s": 0.0, "busy_cpu_s": 2.0}
    lat = latency_and_bottleneck(m)
    assert lat == {"ttft_s": 2.0, "decode_ms_per_token": 2000.0, "bottleneck_stream": "h2d",
                   "bottleneck_busy_frac": 0.9, "cpu_decode_frac": 0.25}


# ---- model configs -------------------------------------------------------------------------------------------------
def _config(tmp_path, **changes):
    cfg = dict(MODEL_PRESETS["opt-125m"], **changes)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("changes, msg", [
    ({"hidden_size": "768"}, "'hidden_size' must be a positive integer, got '768'"),
    ({"num_hidden_layers": 12.5}, "'num_hidden_layers' must be a positive integer"),
    ({"ffn_dim": None}, "'ffn_dim' must be a positive integer"),
    ({"vocab_size": True}, "'vocab_size' must be a positive integer"),
    ({"num_attention_heads": 7}, "hidden_size (768) must be divisible by num_attention_heads (7)"),
])
def test_model_config_bad_fields_exit_2(tmp_path, capsys, changes, msg):
    p = _config(tmp_path, **changes)
    with pytest.raises(OffsimError, match=re.escape(msg)):
        ModelSpec.from_hf_config(p)
    assert msg in _one_line_error(capsys, ["simulate", "--model", str(p), "--gen-len", "2"])


def test_model_config_that_is_a_list_exits_2(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps([MODEL_PRESETS["opt-125m"]]))
    assert "must be a JSON object" in _one_line_error(capsys, ["simulate", "--model", str(p)])


def test_llama_config_with_explicit_head_dim_is_consistent():
    cfg = dict(MODEL_PRESETS["llama-2-7b"], hidden_size=4000, head_dim=128)  # 4000 % 32 != 0, head_dim given
    assert ModelSpec.from_hf_config(cfg).head_dim == 128


# ---- output paths, checked before simulating ---------------------------------------------------------------------
@pytest.mark.parametrize("opt", ["--trace", "--save-plan"])
def test_output_into_missing_directory_exits_2_before_simulating(tmp_path, capsys, opt):
    # opt-30b with the default all-on-GPU placement does not fit a T4: the directory error coming out shows the
    # check ran first
    err = _one_line_error(capsys, ["simulate", "--model", "opt-30b", "--hardware", "t4",
                                   opt, str(tmp_path / "missing" / "x.json")])
    assert "does not exist" in err and opt in err


# ---- settings that do not fit ------------------------------------------------------------------------------------
def test_default_placement_that_does_not_fit_points_to_search(capsys):
    err = _one_line_error(capsys, ["simulate", "--model", "opt-30b", "--hardware", "t4", "--gen-len", "2"])
    assert "GPU memory short by" in err and "GiB" in err and _no_raw_byte_counts(err)
    assert "offsim search --policy flexgen --model opt-30b --hardware t4" in err


def test_selectn_that_does_not_fit_names_host_memory(capsys):
    # interval 1 offloads all 96 layers of OPT-175B (324 GiB) to a T4 host of 194 GiB; one sequence fits the GPU
    err = _one_line_error(capsys, ["simulate", "--policy", "selectn", "--set", "interval=1", "--model", "opt-175b",
                                   "--hardware", "t4", "--gpu-batch-size", "1", "--gen-len", "2"])
    assert "host memory" in err and "short by" in err and "GPU memory" not in err and _no_raw_byte_counts(err)
    assert "offsim search --policy selectn" in err
    # the search says the same: every interval whose GPU share fits needs more host memory than there is
    err = _one_line_error(capsys, ["search", "--policy", "selectn", "--model", "opt-175b", "--hardware", "t4",
                                   "--gen-len", "2"])
    assert "host memory" in err and "short by" in err and "gpu capacity" not in err and _no_raw_byte_counts(err)


# ---- --plan ------------------------------------------------------------------------------------------------------
def test_simulate_plan_conflicts_name_the_options(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["simulate", *SMALL, "--gpu-batch-size", "2", "--save-plan", str(plan)]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    err = _one_line_error(capsys, ["simulate", "--plan", str(plan), "--gen-len", "8", "--policy", "static-zero"])
    assert "--gen-len" in err and "--policy" in err and "--hardware" not in err
    # options that do not define the plan are fine: the same plan simulates to the same numbers
    assert main(["simulate", "--plan", str(plan), "--hardware", "t4"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["total_tok_s"] == pytest.approx(first["total_tok_s"])


# ---- a closed stdout pipe ----------------------------------------------------------------------------------------
def test_output_into_closed_pipe_exits_2_with_one_line():
    p = subprocess.Popen([sys.executable, "-m", "offsim.cli", "simulate", *SMALL, "--gpu-batch-size", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    p.stdout.close()  # as `| head` does once it has its lines: every write of the CLI now fails with EPIPE
    err = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=120) == 2
    assert "Traceback" not in err and "BrokenPipe" not in err and len(err.strip().splitlines()) == 1
    assert "stdout was closed" in err


# ---- validate fits a terminal ------------------------------------------------------------------------------------
def test_validate_table_fits_120_columns(capsys):
    case = REPO / "results" / "validation" / "h200" / "llama-3-8b_selectn_p512_g8.case.json"
    if not case.exists():  # measured cases get renamed now and then: any one will do
        case = sorted((REPO / "results" / "validation" / "h200").glob("*.case.json"))[0]
    rc = main(["validate", str(case)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert max(len(line) for line in out[:-1]) <= 120  # the last line is the JSON document
    assert case.name.split(".")[0] in "\n".join(out)
    assert any("--out DIR writes them to validation.csv" in line for line in out)  # where the details are


def test_validate_out_writes_a_readme_computed_from_its_csv(tmp_path, capsys):
    """`validate --out` writes validation.csv and a README whose figures are the CSV's: the case count, the median
    total error and one row per case."""
    import pandas as pd

    cases = REPO / "results" / "validation" / "h200_heldout"
    if not cases.exists():
        cases = REPO / "results" / "validation" / "h200"
    assert main(["validate", str(cases), "--hardware", str(REPO / "results/profiles/h200_offexec.json"),
                 "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    df = pd.read_csv(tmp_path / "validation.csv", comment="#")
    text = (tmp_path / "README.md").read_text()
    assert f"**{len(df)} cases: median |total tok/s error| {df['err_total_tok_s'].abs().median():.1%}" in text
    assert all(f"| {c} |" in text for c in df["case"])


def test_disk_cache_prices_the_page_cached_disk_or_refuses_without_its_rates(tmp_path, capsys):
    """--disk-cache marks the plan's disk tier as page-cached: a profile without cached rates refuses it in one line;
    one with them simulates it, faster than the O_DIRECT tier."""
    base = ["simulate", "--model", "opt-1.3b", "--prompt-len", "64", "--gen-len", "3", "--gpu-batch-size", "2",
            "--percent", "0", "0", "100", "0", "100", "0"]
    msg = _one_line_error(capsys, base + ["--hardware", "t4", "--disk-cache"])
    assert "cached" in msg
    from offsim.core.specs import get_hardware

    prof = tmp_path / "hw.json"
    hw = get_hardware("t4").with_(disk_cached_read_bytes_per_s=20e9, disk_cached_write_bytes_per_s=5e9)
    prof.write_text(json.dumps(hw.to_dict()))
    runs = []
    for extra in ([], ["--disk-cache"]):
        assert main(base + ["--hardware", str(prof)] + extra) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[1]["total_tok_s"] > runs[0]["total_tok_s"]


def test_simulate_no_cuda_graphs_prices_eager_issue(capsys):
    """`offsim simulate --no-cuda-graphs` predicts the run issued kernel by kernel: on a profile with issue costs
    (the H200's, where a graphed decode op costs less to issue) a host-bound plan is predicted slower."""
    argv = ["simulate", "--model", "opt-125m", "--hardware", str(REPO / "results/profiles/h200_offexec.json"),
            "--prompt-len", "32", "--gen-len", "16", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
            "--percent", "100", "0", "100", "0", "100", "0"]
    tok_s = []
    for extra in ([], ["--no-cuda-graphs"]):
        assert main(argv + extra) == 0
        tok_s.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode_tok_s"])
    assert tok_s[0] > 1.5 * tok_s[1]


def test_simulate_run_ahead_sets_the_plans_windows_and_a_host_bound_plan_feels_it(capsys, tmp_path):
    """`offsim simulate --run-ahead C H D` writes the windows into the plan it saves (what `offexec run --plan` then
    issues with) and predicts with them: on a profile with issue costs, a host-bound plan whose compute stream may
    run one op ahead is predicted slower than at the default 16; --plan takes it too; 0 is refused by argparse."""
    argv = ["simulate", "--model", "opt-125m", "--hardware", str(REPO / "results/profiles/h200_offexec.json"),
            "--prompt-len", "32", "--gen-len", "16", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
            "--percent", "100", "0", "100", "0", "100", "0"]
    tok_s = []
    for i, extra in enumerate(([], ["--run-ahead", "1", "1", "1"])):
        assert main(argv + extra + ["--save-plan", str(tmp_path / f"p{i}.json")]) == 0
        tok_s.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode_tok_s"])
    saved = [json.loads((tmp_path / f"p{i}.json").read_text())["run_ahead"] for i in range(2)]
    assert saved == [[16, 6, 16], [1, 1, 1]]
    assert tok_s[0] > tok_s[1]
    assert main(["simulate", "--plan", str(tmp_path / "p0.json"), "--hardware",
                 str(REPO / "results/profiles/h200_offexec.json"), "--run-ahead", "1", "1", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode_tok_s"] == pytest.approx(tok_s[1])
    with pytest.raises(SystemExit) as e:
        main(argv + ["--run-ahead", "0", "6", "16"])
    assert e.value.code == 2 and "--run-ahead" in capsys.readouterr().err


def test_set_takes_a_comma_separated_list_and_a_bad_percent_says_what_is_valid(capsys):
    """--set percent=20,80,0,100,100,0 (no brackets) is the list a user means; a percent that is not six numbers is
    refused with an example of a valid one, never iterated as characters."""
    assert main(["simulate", "--model", "opt-30b", "--hardware", "t4", "--policy", "flexgen",
                 "--set", "percent=20,80,0,100,100,0"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]["percent"] == [20, 80, 0, 100,
                                                                                                 100, 0]
    for bad in ("percent=abc", "percent=5", 'percent=["a",1,2,3,4,5]'):
        assert main(["simulate", "--model", "opt-30b", "--hardware", "t4", "--policy", "flexgen", "--set", bad]) == 2
        err = capsys.readouterr().err
        assert "six numbers" in err and "e.g. 20 80 0 100 100 0" in err and "Traceback" not in err


def test_simulate_graph_min_uses_is_saved_with_the_plan(capsys, tmp_path):
    """`offsim simulate --graph-min-uses N` writes the field into the plan it saves; a plan whose decode shapes are
    all met at fewer steps than N is predicted as issued kernel by kernel (--no-cuda-graphs); 0 is refused."""
    argv = ["simulate", "--model", "opt-125m", "--hardware", str(REPO / "results/profiles/h200_offexec.json"),
            "--prompt-len", "32", "--gen-len", "16", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
            "--percent", "100", "0", "100", "0", "100", "0"]
    tok_s = []
    for i, extra in enumerate((["--graph-min-uses", "99"], ["--no-cuda-graphs"], [])):
        assert main(argv + extra + ["--save-plan", str(tmp_path / f"p{i}.json")]) == 0
        tok_s.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode_tok_s"])
    assert json.loads((tmp_path / "p0.json").read_text())["graph_min_uses"] == 99
    assert "graph_min_uses" not in json.loads((tmp_path / "p2.json").read_text())
    assert tok_s[0] == pytest.approx(tok_s[1]) and tok_s[2] != pytest.approx(tok_s[0])
    with pytest.raises(SystemExit) as e:
        main(argv + ["--graph-min-uses", "0"])
    assert e.value.code == 2 and "--graph-min-uses" in capsys.readouterr().err


def test_simulate_notes_a_prediction_bound_by_cpu_attention(capsys):
    """A plan whose CPU attention keeps the host's CPU busy most of its decode is predicted with a note that its
    time follows the host's state (docs/profiling.md §4); the same placement with attention on the GPU has none."""
    argv = ["simulate", "--model", "opt-30b", "--hardware", "t4", "--prompt-len", "512", "--gen-len", "8",
            "--gpu-batch-size", "64", "--num-gpu-batches", "1", "--percent", "6", "94", "0", "100", "100", "0"]
    assert main(argv + ["--cpu-attention"]) == 0
    out = capsys.readouterr().out
    m = json.loads(out.strip().splitlines()[-1])
    assert m["cpu_decode_frac"] >= 0.5 and "note: CPU attention keeps the host's CPU busy" in out
    assert main(argv) == 0
    assert "note:" not in capsys.readouterr().out


def test_simulate_notes_a_prediction_bound_by_the_issuing_thread(capsys):
    """A plan of many tiny GPU batches with the KV cache and the activations in host memory is issue-bound: on a
    profile that prices issue, the JSON carries the issuing thread's share of the decode and the printout a note
    that the prediction follows the host's state; a link-bound OPT-30B plan (weights streamed) has a small share and
    no note."""
    prof = str(REPO / "results/profiles/h200_offexec_v2.json")
    argv = ["simulate", "--model", "opt-125m", "--hardware", prof, "--prompt-len", "32", "--gen-len", "8"]
    assert main(argv + ["--gpu-batch-size", "2", "--num-gpu-batches", "8",
                        "--percent", "100", "0", "0", "100", "0", "100"]) == 0
    out = capsys.readouterr().out
    m = json.loads(out.strip().splitlines()[-1])
    assert m["host_issue_decode_frac"] >= 0.5 and "the runtime's issuing thread is busy for about" in out
    assert main(["simulate", "--model", "opt-30b", "--hardware", prof, "--prompt-len", "512", "--gen-len", "8",
                 "--gpu-batch-size", "16", "--num-gpu-batches", "3", "--percent", "20", "80", "0", "100", "100",
                 "0"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["host_issue_decode_frac"] < 0.2 and "note:" not in out
