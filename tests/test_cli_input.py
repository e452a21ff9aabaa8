"""Bad and unusual input to the offsim CLI: each is exit 2 with one line that says what is wrong and what is valid
(never a traceback), or -- for inputs that are legitimate -- the right answer. Found by a new-user audit of the CLI
(2026-12-04): each test here failed before its fix."""
import copy
import json
import os
from pathlib import Path

import pytest

from offsim.cli import main
from offsim.core.errors import OffsimError
from offsim.core.io import write_text_atomic
from offsim.core.specs import get_hardware

SMALL = ["--model", "opt-125m", "--hardware", "t4", "--prompt-len", "32", "--gen-len", "3"]
OFFLOADED = ["--model", "opt-1.3b", "--hardware", "t4", "--prompt-len", "32", "--gen-len", "3", "--percent", "0",
             "100", "0", "100", "100", "0", "--gpu-batch-size", "2"]


def _error(capsys, argv) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == 2, (cap.out[-500:], err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("gb", ["inf", "1e300", "nan", "1e-12", "0"])
def test_gpu_budget_that_is_no_number_of_bytes(capsys, gb):
    err = _error(capsys, ["simulate", *SMALL, "--gpu-mem-gb", gb])
    assert "--gpu-mem-gb must be a finite number of GiB" in err
    with pytest.raises(OffsimError, match="finite number"):
        get_hardware("t4", True)  # (a spec's `gpu_mem_gb: true` is no budget either)


@pytest.mark.parametrize("setting, msg", [
    ("cpu_attention=no", "flexgen cpu_attention must be true or false, got 'no'"),
    ("overlap=off", "flexgen overlap must be true or false"),
    ("sublayer=1", "flexgen sublayer must be true or false, got 1"),
    ('stage_layers=["6","6"]', "stage_layers must be one integer >= 1 per stage"),
])
def test_a_setting_of_the_wrong_type_is_refused_not_taken_as_true(capsys, setting, msg):
    assert msg in _error(capsys, ["simulate", *OFFLOADED, "--set", setting])


@pytest.mark.parametrize("policy, setting", [("static-zero", "kv_on_cpu=yes"), ("selectn", "prefetch=maybe"),
                                             ("tightllm", "weight_loader=no"), ("static-accelerate-ref",
                                                                                 "compress_weight=1")])
def test_every_policys_true_or_false_settings_are_checked(capsys, policy, setting):
    err = _error(capsys, ["simulate", "--policy", policy, *SMALL, "--set", setting])
    assert f"{policy} {setting.split('=')[0]} must be true or false" in err


@pytest.mark.parametrize("policy", ["static-accelerate", "static-accelerate-ref"])
@pytest.mark.parametrize("value", ['"3"', "1.5", "true", "[1]"])
def test_an_integer_or_null_setting_is_checked(capsys, policy, value):
    # (gpu_layers is `int | None`: a string was a TypeError traceback, 1.5 ran as 2 layers and true as 1)
    err = _error(capsys, ["simulate", "--policy", policy, *SMALL, "--set", f"gpu_layers={value}"])
    assert f"{policy} gpu_layers must be an integer or null" in err


def test_sizes_past_the_model_or_any_plan_are_refused_from_arithmetic(tmp_path, capsys):
    # a prompt past the model's positions: that, not a memory shortfall with advice that cannot help
    err = _error(capsys, ["simulate", "--model", "opt-30b", "--hardware", "t4", "--prompt-len", "4096"])
    assert "exceeds opt-30b's 2048 positions" in err and "short by" not in err
    # 10**12 GPU batches ended in a MemoryError traceback; 10**5 built for minutes
    err = _error(capsys, ["simulate", *SMALL, "--gpu-batch-size", "1", "--num-gpu-batches", str(10 ** 12)])
    assert "more than one plan holds" in err
    # a config.json with a typo's sizes: 10**9 layers ran for minutes, 10**400 overflowed
    from offsim.core.specs import get_model

    cfg = get_model("opt-125m").to_hf_config_dict()
    for layers in (10 ** 9, 10 ** 400):
        f = tmp_path / "config.json"
        f.write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
        assert "num_layers" in (e := _error(capsys, ["simulate", "--model", str(f), "--hardware", "t4"])) and \
            "more than offsim models" in e


def test_a_setting_given_twice_or_a_file_named_twice_is_refused(tmp_path, capsys):
    # (the --set value won in silence; a --trace over the --plan it read replaced the plan with a trace)
    err = _error(capsys, ["simulate", *OFFLOADED, "--cpu-attention", "--set", "cpu_attention=false"])
    assert "--set cpu_attention and --cpu-attention both set cpu_attention" in err
    assert "--set overlap is given twice" in _error(capsys, ["simulate", *OFFLOADED, "--set", "overlap=false",
                                                              "--set", "overlap=true"])
    plan = tmp_path / "p.json"
    assert main(["simulate", *SMALL, "--save-plan", str(plan)]) == 0
    capsys.readouterr()
    before = plan.read_bytes()
    assert "--trace and --plan are one file" in _error(capsys, ["simulate", "--plan", str(plan), "--trace",
                                                                 str(plan)])
    assert plan.read_bytes() == before
    t = str(tmp_path / "t.json")
    assert "--save-plan and --trace are one file" in _error(capsys, ["simulate", *SMALL, "--trace", t,
                                                                      "--save-plan", t])


def test_a_true_or_false_setting_spelled_in_json_still_works(capsys):
    assert main(["simulate", *OFFLOADED, "--set", "cpu_attention=true"]) == 0
    assert _last_json(capsys)["settings"]["cpu_attention"] is True


def _saved_plan(tmp_path, capsys) -> tuple[Path, dict]:
    path = tmp_path / "p.json"
    assert main(["simulate", *OFFLOADED, "--save-plan", str(path)]) == 0
    capsys.readouterr()
    return path, json.loads(path.read_text())


def _edit(d: dict, fn) -> dict:
    e = copy.deepcopy(d)
    fn(e)
    return e


def _first(d: dict, kind: str) -> list:
    k = d["op_fields"].index("kind")
    return next(r for r in d["ops"] if r[k] == kind)


def test_a_hand_edited_plan_of_the_wrong_shape_is_refused_with_its_file_named(tmp_path, capsys):
    path, d = _saved_plan(tmp_path, capsys)
    f = d["op_fields"]
    edits = {
        "alloc": lambda e: e["ops"][3].__setitem__(f.index("alloc"), [1]),
        "capacity": lambda e: e.__setitem__("capacity", "big"),
        "kv_split": lambda e: e.__setitem__("kv_split", [5]),
        "nbytes": lambda e: _first(e, "h2d").__setitem__(f.index("nbytes"), "lots"),
    }
    for name, fn in edits.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps(_edit(d, fn)))
        err = _error(capsys, ["simulate", "--plan", str(bad)])
        # (a wrong op field is named with its op since 2026-12-05: "op 3: field 'alloc' must be ...")
        assert f"plan {bad}" in err and ("malformed value" in err or "must be" in err), (name, err)


def test_a_plan_whose_ops_and_workload_disagree_is_refused(tmp_path, capsys):
    path, d = _saved_plan(tmp_path, capsys)
    bad = tmp_path / "gen.json"
    bad.write_text(json.dumps(_edit(d, lambda e: e["workload"].__setitem__("gen_len", 100000))))
    assert "its ops run steps 0..2 but its workload generates 100000 tokens" in _error(
        capsys, ["simulate", "--plan", str(bad)])
    bad.write_text(json.dumps(_edit(d, lambda e: e.__setitem__("ops", []))))
    assert "plan: no ops" in _error(capsys, ["simulate", "--plan", str(bad)])


def _without_op(d: dict, drop: int) -> None:
    """``d``'s op ``drop`` deleted by hand: the later ids shifted down, the dependencies on it dropped."""
    rows = [r for i, r in enumerate(d["ops"]) if i != drop]
    for r in rows:
        r[0] -= r[0] > drop
        r[2] = [x - (x > drop) for x in r[2] if x != drop]
    d["ops"] = rows


def test_a_plan_that_names_what_offsim_does_not_know_or_skips_a_token_is_refused(tmp_path, capsys):
    """Hand edits that ran before 2026-12-05: a misspelt field (dropped in silence, the plan run without it), a
    policy no builder has (the warm-up or `validate` failed later), the last step's LM-head op deleted (the step ran
    on a stale token and the rate was reported)."""
    from offexec.cli import main as offexec_main

    path, d = _saved_plan(tmp_path, capsys)
    f = d["op_fields"]
    heads = [i for i, r in enumerate(d["ops"]) if r[1] == "compute" and r[f.index("part")] == "head"]
    cases = {"field": (lambda e: e.__setitem__("cuda_graph", False), "unknown field 'cuda_graph'"),
             "policy": (lambda e: e.__setitem__("policy", "flexgen2"), "policy 'flexgen2' is not one offsim knows"),
             "head": (lambda e: _without_op(e, heads[-1]), "has 0 LM-head ('head') ops")}
    for name, (fn, msg) in cases.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps(_edit(d, fn)))
        assert msg in _error(capsys, ["simulate", "--plan", str(bad)]), name
        assert offexec_main(["run", "--plan", str(bad), "--device", "cpu", "--no-warmup"]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (name, err)


def test_plan_with_a_gpu_budget_is_held_to_it_and_pipeline_options_conflict(tmp_path, capsys):
    path, _ = _saved_plan(tmp_path, capsys)
    err = _error(capsys, ["simulate", "--plan", str(path), "--gpu-mem-gb", "0.1"])
    assert f"plan {path} does not fit --gpu-mem-gb 0.1 GiB" in err
    assert main(["simulate", "--plan", str(path), "--gpu-mem-gb", "15"]) == 0  # a budget it fits: simulated
    capsys.readouterr()
    for opt in (["--num-gpus", "2"], ["--gpus-per-node", "1"]):
        assert opt[0] in _error(capsys, ["simulate", "--plan", str(path), *opt])


def test_one_gpu_applies_to_every_policy_and_nodes_need_a_pipeline(capsys):
    assert main(["simulate", "--policy", "static-zero", *SMALL, "--num-gpus", "1"]) == 0
    capsys.readouterr()
    for cmd in (["simulate", *SMALL], ["search", "--policy", "static-zero", *SMALL]):
        assert "give --num-gpus N too" in _error(capsys, [*cmd, "--gpus-per-node", "1"])


def test_gen_len_one_prints_strict_json(capsys):
    assert main(["simulate", *SMALL, "--gen-len", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    d = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert d["decode_tok_s"] is None and d["total_tok_s"] > 0


@pytest.mark.parametrize("name", ["t.CSV", "t.csv.gz"])
def test_trace_names_ending_in_csv_any_case_or_gzipped_are_csv(tmp_path, capsys, name):
    from offsim.core.trace import Trace

    assert main(["simulate", *SMALL, "--trace", str(tmp_path / name)]) == 0
    assert len(Trace.from_csv(tmp_path / name).df) > 0


def test_unwritable_outputs_are_one_line_errors(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is a file, not a directory" in _error(capsys, ["simulate", *SMALL, "--save-plan", str(blocker / "p.json")])
    assert "does not exist" in _error(capsys, ["simulate", *SMALL, "--save-plan", str(tmp_path / "no" / "p.json")])
    err = _error(capsys, ["validate", str(tmp_path), "--hardware", "t4", "--out", str(blocker)])
    assert "is a file; give a directory" in err
    err = _error(capsys, ["validate", str(tmp_path), "--hardware", "t4", "--out", str(blocker / "sub")])
    assert "cannot make the directory" in err
    with pytest.raises(OffsimError, match=f"cannot write {blocker / 'x' / 'y.json'}"):
        write_text_atomic(blocker / "x" / "y.json", "{}")


def test_writes_go_through_a_symlink_and_into_a_non_regular_file(tmp_path):
    target = tmp_path / "target.json"
    link = tmp_path / "link.json"
    os.symlink(target, link)
    write_text_atomic(link, "{}")
    assert link.is_symlink() and target.read_text() == "{}"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_text_atomic(fifo, "through")
    reader.join(10)
    assert got == ["through"] and fifo.exists() and not fifo.is_file()  # written into, not replaced


def test_hardware_fields_of_the_wrong_type_are_named(tmp_path, capsys):
    from offsim.core.specs import load_hardware_preset

    base = load_hardware_preset("t4").to_dict()
    for field, value, kind in [("gpu_mem_bytes", "16e9", "a number"), ("sustained_compute_fraction", None,
                                                                           "a number"),
                               ("name", [1], "a string"), ("h2d_pinned", 5, "a list of [x, y] number pairs")]:
        f = tmp_path / f"{field}.json"
        f.write_text(json.dumps({**base, field: value}))
        err = _error(capsys, ["simulate", *SMALL[:2], "--hardware", str(f)])
        assert f"field {field!r} must be {kind}" in err and "malformed curve" not in err


def test_static_policies_keep_layers_in_host_memory_where_their_placement_fits_it(capsys):
    # OPT-66B: 121.5 GiB of weights, over 95 % of the H200 host's 125 GiB (the old rule's line) and over its
    # 64 GiB disk; on a 24 GiB RTX 3090 Accelerate keeps layers on the GPU, and the rest fits its host
    from offsim.policies.static import accelerate_candidates, zero_candidates

    for gen, hw in ((zero_candidates, get_hardware("h200")), (accelerate_candidates, get_hardware("rtx3090", 24))):
        from offsim.core.specs import get_model

        cands = list(gen(get_model("opt-66b"), hw, 256, 32, batch=8))
        assert cands and all(c.settings["offload"] == "cpu" for c in cands), cands
    assert main(["search", "--policy", "static-zero", "--model", "opt-66b", "--hardware", "h200", "--gen-len",
                 "4"]) == 0
    assert _last_json(capsys)["settings"]["offload"] == "cpu"


def test_search_reasons_quote_the_users_lengths_not_the_screening_plans(capsys):
    err = _error(capsys, ["search", "--policy", "static-accelerate", "--model", "opt-175b", "--hardware", "t4",
                          "--prompt-len", "512", "--gen-len", "8", "--gpu-mem-gb", "1"])
    assert "+ 3 tokens" not in err


def test_compare_names_a_policy_twice_once(capsys):
    assert main(["compare", *SMALL, "--policies", "static-zero", "static-zero"]) == 0
    assert len(_last_json(capsys)) == 1


def test_job_and_sweep_specs_with_values_of_the_wrong_type(tmp_path, capsys):
    job = {"model": "opt-125m", "hardware": "t4", "policies": ["static-zero"]}
    for req, msg in [({"distribution": ["a"], "count": 4}, "unknown length distribution"),
                     ({"csv": 5}, "requests.csv takes the path of a CSV")]:
        f = tmp_path / "job.json"
        f.write_text(json.dumps({**job, "requests": req}))
        err = _error(capsys, ["job", str(f)])
        assert msg in err and err.count("job spec") <= 1, err
    f = tmp_path / "job.json"
    f.write_text(json.dumps({**job, "requests": {"distribution": "classification", "count": 0}}))
    assert _error(capsys, ["job", str(f)]).count("job spec") == 1
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"name": "s", "grid": {"model": ["opt-125m"], "hardware": ["t4"],
                                                       "policy": [["flexgen"]], "prompt_len": [32],
                                                       "gen_len": [3]}}))
    assert "unknown policy ['flexgen']" in _error(capsys, ["sweep", str(sweep), "--out", str(tmp_path / "o")])


def test_model_directory_without_a_config(tmp_path, capsys):
    err = _error(capsys, ["simulate", "--model", str(tmp_path), "--hardware", "t4"])
    assert "holds no config.json" in err


# ---- a second audit (2026-12-05): each case below was a traceback or a silent wrong answer before its fix ----------
def _t4(tmp_path, name, **changes) -> str:
    d = json.loads((Path(__file__).resolve().parents[1] / "offsim/core/presets/hardware/t4.json").read_text())
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps(d))  # (NaN and Infinity as Python's json writes them)
    return str(f)


@pytest.mark.parametrize("field, value, says", [
    ("gpu_mem_bytes", float("inf"), "gpu_mem_bytes must be a finite positive number"),
    ("cpu_mem_bytes", float("inf"), "cpu_mem_bytes must be a finite positive number"),
    ("disk_bytes", -5, "disk_bytes must be a finite non-negative number"),
    ("kernel_overhead_s", -1e-5, "kernel_overhead_s must be a finite non-negative number"),
    ("link_latency_s", float("nan"), "link_latency_s must be a finite non-negative number"),
    ("issue_compute_s", float("nan"), "issue_compute_s must be a finite non-negative number"),
    ("gemm_efficiency", [[1, 50]], "gemm_efficiency is achieved / peak FLOP/s, at most 2"),
    ("h2d_pinned", [5], "'h2d_pinned' must be a list of [x, y] number pairs"),
    ("op_times", 5, "op_times must be a list of rows"),
    ("gpu_peak_flops", None, "missing required fields ['gpu_peak_flops']"),
])
def test_hardware_values_out_of_range_are_refused_by_name(capsys, tmp_path, field, value, says):
    err = _error(capsys, ["simulate", "--model", "opt-125m", "--hardware", _t4(tmp_path, field, **{field: value}),
                          "--prompt-len", "16", "--gen-len", "2"])
    assert says in err


def test_model_config_binary_or_with_a_string_flag_is_refused_and_a_file_is_named_for_itself(capsys, tmp_path):
    from offsim.core.specs import MODEL_PRESETS

    (tmp_path / "bin.json").write_bytes(bytes(range(128, 256)))
    assert "is not text (not UTF-8)" in _error(capsys, ["simulate", "--model", str(tmp_path / "bin.json")])
    cfg = dict(MODEL_PRESETS["opt-125m"], tie_word_embeddings="false")
    (tmp_path / "tie.json").write_text(json.dumps(cfg))
    assert "tie_word_embeddings must be true or false" in _error(capsys, ["simulate", "--model",
                                                                          str(tmp_path / "tie.json")])
    (tmp_path / "mine.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    assert main(["simulate", "--model", str(tmp_path / "mine.json"), "--prompt-len", "16", "--gen-len", "2"]) == 0
    assert _last_json(capsys)["model"] == "mine"  # (was the folder's name: two configs in one folder alike)


def test_hand_edited_plan_values_of_the_wrong_type_are_named(capsys, tmp_path):
    p = tmp_path / "p.json"
    assert main(["simulate", *SMALL, "--save-plan", str(p)]) == 0
    capsys.readouterr()
    d = json.loads(p.read_text())
    f = d["op_fields"]
    for name, edit, says in (("nan", (0, "nbytes", float("nan")), "op 0: field 'nbytes' must be an integer, got nan"),
                             ("alloc", (0, "alloc", [1, 2]), "op 0: field 'alloc' must be a list of 3 integers"),
                             ("deps", (1, "deps", ["a"]), "op 1: field 'deps' must be a list of integers")):
        e = copy.deepcopy(d)
        i, field, v = edit
        e["ops"][i][f.index(field)] = v
        (tmp_path / f"{name}.json").write_text(json.dumps(e))
        assert says in _error(capsys, ["simulate", "--plan", str(tmp_path / f"{name}.json")])
    (tmp_path / "dict.json").write_text(json.dumps({**d, "ops": {"a": 1}}))
    assert "field 'ops' must be a list of op rows" in _error(capsys, ["simulate", "--plan",
                                                                      str(tmp_path / "dict.json")])


def test_validate_refuses_a_case_that_measured_nothing_finds_minified_cases_and_leaves_no_out(capsys, tmp_path):
    src = next((Path(__file__).resolve().parents[1] / "results" / "validation" / "h200_calib").glob("*.case.json"))
    case = json.loads(src.read_text())
    plan = src.with_name(src.name.replace(".case.json", ".plan.json.gz"))
    for name, metrics in (("zero", {**case["metrics"], "total_tok_s": 0}),
                          ("text", {**case["metrics"], "total_tok_s": "fast"})):
        d = tmp_path / name
        d.mkdir()
        (d / src.name).write_text(json.dumps({**case, "metrics": metrics}))
        if plan.exists():
            (d / plan.name).write_bytes(plan.read_bytes())
        assert "field 'metrics.total_tok_s' must be a positive number" in _error(capsys, ["validate", str(d)])
    mini = tmp_path / "mini"
    mini.mkdir()
    (mini / src.name).write_text(json.dumps(case, separators=(",", ":")))  # no spaces, as `jq -c` writes
    from offsim.analysis.validate import find_cases
    assert find_cases(mini) == [mini / src.name]
    out = tmp_path / "vout"
    assert "no such file or directory" in _error(capsys, ["validate", str(tmp_path / "nothing"), "--out", str(out)])
    assert not out.exists()


def test_a_job_too_large_to_draw_is_refused_from_its_count():
    from offsim.core.requests import MAX_REQUESTS, draw_requests

    with pytest.raises(OffsimError, match="more than one job takes"):
        draw_requests("classification", MAX_REQUESTS + 1)


def test_gen_len_one_prints_no_decode_rate(capsys):
    assert main(["simulate", "--model", "opt-125m", "--prompt-len", "16", "--gen-len", "1"]) == 0
    table = capsys.readouterr().out.splitlines()[2]
    assert "inf" not in table and "n/a" in table
