"""``offexec run`` end to end on the CPU with a tiny model: the report, the JSON last line, the trace file, the
warm-up, ``--plan``, the CPU-vs-preset comparison, and exit code 2 with one line for bad input."""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from offexec.cli import build_parser, main
from offexec.testing import tiny_hf
from offsim.core.plan import Plan
from offsim.core.specs import Workload, get_hardware, get_model
from offsim.core.trace import Trace
from offsim.policies import build_plan

TINY_ARGS = ["--hardware", "h200", "--prompt-len", "8", "--gen-len", "4", "--gpu-batch-size", "2",
             "--num-gpu-batches", "2", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    hf, spec = tiny_hf("opt", seed=3)
    hf.save_pretrained(d, safe_serialization=True)
    return d


def test_run_prints_comparison_and_json(checkpoint, tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--percent", "0", "50", "0",
               "50", "100", "0", "--trace", str(trace), "--disk-dir", str(tmp_path)] + TINY_ARGS)
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert any(line.startswith("decode") for line in out)
    assert "host time issuing ops" in "\n".join(out)
    js = json.loads(out[-1])
    assert js["policy"] == "flexgen" and js["measured"]["decode_tok_s"] > 0 and js["predicted"]["decode_tok_s"] > 0
    assert set(js["error"]) == {"prefill", "decode", "total"}
    assert js["provenance"]["commit"]
    # the host's state as the measured run started (offexec.hostprobe), in the JSON and the trace's metadata
    assert js["provenance"]["host_probe"]["cpu_attn_ms"] > 0 and "host before the run" in "\n".join(out)
    # a preset (h200) describes a GPU: a CPU run is not compared with it, and says so
    assert js["comparable"] is False and all(v is None for v in js["error"].values())
    assert "no comparison with offsim" in "\n".join(out) and "%" not in "\n".join(out[2:6])
    # the warm-up ran (2 tokens, unmeasured): the trace holds the measured run only, at its own gen_len
    assert js["warmup"]["gen_len"] == 2 and any(line.startswith("warm-up: the same plan for 2 tokens") for line in out)
    t = Trace.from_csv(trace)
    assert t.meta["source"] == "offexec" and len(t.df) > 0 and t.meta["warmup"] is True
    assert t.meta["host_probe"]["cpu_attn_ms"] == js["provenance"]["host_probe"]["cpu_attn_ms"]
    assert t.df["step"].max() == 3  # gen_len 4: prefill and three decode steps
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]  # the disk tier's files are gone


def test_run_no_warmup_and_cpu_profile_comparison(checkpoint, tmp_path, capsys):
    profile = tmp_path / "cpu.json"  # stands in for `offexec profile --device cpu`'s JSON
    profile.write_text(json.dumps(get_hardware("h200").to_dict()))
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup"]
              + TINY_ARGS[2:] + ["--hardware", str(profile)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    js = json.loads(out[-1])
    assert js["warmup"] is None and any("warm-up: skipped" in line for line in out)
    assert js["comparable"] is True and all(isinstance(v, float) for v in js["error"].values())
    assert any(line.startswith("decode") and line.rstrip().endswith("%") for line in out)


def test_run_full_warmup_runs_the_whole_plan_first(checkpoint, tmp_path, capsys):
    """--warmup-mode full: the plan itself runs once unmeasured (a steady-state measured run), said in the output
    and the JSON; the trace still holds the measured run only."""
    trace = tmp_path / "t.csv"
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--warmup-mode", "full",
               "--trace", str(trace)] + TINY_ARGS)
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    js = json.loads(out[-1])
    assert js["warmup"]["mode"] == "full" and js["warmup"]["gen_len"] == js["workload"]["gen_len"]
    assert any(line.startswith("warm-up: the whole plan ran unmeasured") for line in out)
    assert Trace.from_csv(trace).df["step"].max() == js["workload"]["gen_len"] - 1


def test_run_rejects_an_unknown_warmup_mode(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--warmup-mode", "half"])
    assert e.value.code == 2 and "invalid choice: 'half'" in capsys.readouterr().err


def test_run_host_profile_writes_pstats(checkpoint, tmp_path, capsys):
    """--host-profile: cProfile of the issuing thread to FILE and its costliest functions printed; the allocator's
    retries by handler are a CUDA diagnostic (absent on the CPU, where there is no caching allocator)."""
    import pstats

    prof = tmp_path / "issue.prof"
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup",
               "--host-profile", str(prof)] + TINY_ARGS)
    out = capsys.readouterr().out
    assert rc == 0 and prof.exists()
    assert pstats.Stats(str(prof)).total_calls > 0
    assert "cProfile of the issuing thread" in out and "caching-allocator retries" not in out


def test_run_kernel_profile_tabulates_the_run_by_operator(checkpoint, tmp_path, capsys):
    """--kernel-profile: the measured run's time by kernel (on the CPU, by operator) to a commented CSV whose
    shares sum to one, its categories and costliest names printed; the trace says the run was profiled."""
    import pandas as pd

    from offexec.kernels import category

    table, trace = tmp_path / "k.csv.gz", tmp_path / "t.csv"
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup",
               "--kernel-profile", str(table), "--trace", str(trace)] + TINY_ARGS)
    out = capsys.readouterr().out
    assert rc == 0 and "time by operator of the profiled run" in out
    df = pd.read_csv(table, comment="#")
    assert list(df.columns) == ["name", "category", "calls", "total_ms", "mean_us", "share"]
    assert (df["calls"] > 0).all() and abs(df["share"].sum() - 1) < 1e-6
    assert df["total_ms"].is_monotonic_decreasing
    assert "gemm" in set(df["category"])  # a decoder layer's projections (aten::mm / addmm / linear)
    assert Trace.from_csv(trace).meta["kernel_profile"] is True
    # kernels as CUDA and its libraries name them
    assert category("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert category("Memcpy HtoD (Pinned -> Device)") == "memcpy"
    assert category("void at::native::index_copy_kernel_impl<...>") == "copy"
    assert category("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<c10::Half>>") \
        == "elementwise"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_host_profile_that_cannot_be_written_keeps_the_trace_and_figures(checkpoint, tmp_path, capsys):
    """A --host-profile whose write fails (a full device) is one line after the run, the trace and the figures
    already out (the profile was written first, and its failure lost both)."""
    trace = tmp_path / "t.csv"
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup",
               "--host-profile", "/dev/full", "--trace", str(trace)] + TINY_ARGS)
    cap = capsys.readouterr()
    assert rc == 2 and trace.exists() and "measured tok/s" in cap.out
    assert "--host-profile /dev/full: cannot write the profile" in cap.err and "Traceback" not in cap.err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_an_output_folder_that_takes_no_files_is_refused_before_the_run(checkpoint, capsys):
    base = ["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup"] + TINY_ARGS
    assert "cannot write files in /proc/" in _error(capsys, base + ["--trace", "/proc/self/status"])
    assert "cannot write files in /proc/" in _error(capsys, base + ["--host-profile", "/proc/self/p.prof"])


def test_contradictory_warmup_options_are_refused(checkpoint, capsys):
    base = ["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen"] + TINY_ARGS
    assert "give one" in _error(capsys, base + ["--no-warmup", "--warmup-mode", "full"])


def test_gen_len_one_prints_strict_json(checkpoint, capsys):
    argv = ["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup"] + TINY_ARGS
    argv[argv.index("--gen-len") + 1] = "1"
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    d = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert d["measured"]["decode_tok_s"] is None and d["measured"]["total_tok_s"] > 0


def test_a_missing_or_damaged_checkpoint_is_one_line(checkpoint, tmp_path, capsys):
    import shutil

    base = ["run", "--policy", "flexgen", "--no-warmup", "--device", "cpu", "--dtype", "float32"] + TINY_ARGS[:-4]
    assert "does not exist" in _error(capsys, base + ["--checkpoint", str(tmp_path / "nope")])
    for name, cut in (("header", 5), ("body", -5000)):  # cut inside the header, then inside the tensors
        bad = tmp_path / name
        bad.mkdir()
        shutil.copy(checkpoint / "config.json", bad)
        data = (checkpoint / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[:cut])
        err = _error(capsys, base + ["--checkpoint", str(bad)])
        assert "model.safetensors" in err and ("not a readable safetensors" in err or "cut short" in err), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trace_allocator_attributes_retries_on_cuda(checkpoint):
    """On CUDA, run_plan(trace_allocator=True) reports the allocator's retries by handler (a dict, possibly empty:
    a run that never hits the cap retries nowhere), and None without it."""
    from offexec.executor import run_plan
    from offexec.weights import random_weights

    spec = get_model(str(checkpoint / "config.json"))
    wl = Workload(prompt_len=8, gen_len=4, gpu_batch_size=2, num_gpu_batches=2)
    plan = build_plan("flexgen", spec, get_hardware("h200"), wl)
    w = random_weights(spec, 0, torch.float16, device="cuda", pinned=True, progress=False)
    try:
        on = run_plan(plan, w, "cuda", trace_allocator=True).stats["allocator_retries_by_handler"]
        off = run_plan(plan, w, "cuda").stats["allocator_retries_by_handler"]
    finally:
        w.close()
    assert isinstance(on, dict) and all(isinstance(v, int) and v > 0 for v in on.values())
    assert off is None


def _flexgen_plan_file(checkpoint, tmp_path):
    """(model, plan, path): a small FlexGen plan of the tiny checkpoint's model (fp32), saved as tmp_path/p.json."""
    model = dataclasses.replace(get_model(checkpoint / "config.json"), dtype_bytes=4)
    plan = build_plan("flexgen", model, get_hardware("h200"), Workload(8, 3, 2, 2),
                      {"percent": (0, 100, 0, 100, 100, 0)})
    path = tmp_path / "p.json"
    plan.save(path)
    return model, plan, path


def test_run_plan_file(checkpoint, tmp_path, capsys):
    model, plan, path = _flexgen_plan_file(checkpoint, tmp_path)
    rc = main(["run", "--plan", str(path), "--hardware", "h200", "--device", "cpu", "--no-warmup"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    js = json.loads(out[-1])
    assert js["workload"] == plan.workload.to_dict() and js["settings"]["percent"] == [0, 100, 0, 100, 100, 0]
    assert js["plan_file"] == str(path)
    assert Plan.load(path).policy == js["policy"] == "flexgen"


def test_run_plan_file_trace_names_its_plan(checkpoint, tmp_path, capsys):
    """A trace of `--plan FILE` records the plan's fingerprint, and its file where it sits beside the trace: offsim
    validate then re-simulates that stored plan ('stored'), and the trace carries a non-preset model whole."""
    from offsim.analysis.validate import load_case, validate_case
    model, plan, path = _flexgen_plan_file(checkpoint, tmp_path)
    trace = tmp_path / "t.trace.csv"
    rc = main(["run", "--plan", str(path), "--hardware", "h200", "--device", "cpu", "--no-warmup",
               "--trace", str(trace)])
    capsys.readouterr()
    assert rc == 0
    meta = Trace.from_csv(trace).meta
    assert meta["plan_sha256"] == plan.fingerprint() and meta["plan_file"] == "p.json"
    assert meta["model_config"]["num_layers"] == model.num_layers
    assert validate_case(load_case(trace))["plan"] == "stored"
    other = tmp_path / "elsewhere"
    other.mkdir()
    rc = main(["run", "--plan", str(path), "--hardware", "h200", "--device", "cpu", "--no-warmup",
               "--trace", str(other / "t.trace.csv")])
    capsys.readouterr()
    meta = Trace.from_csv(other / "t.trace.csv").meta
    assert rc == 0 and "plan_file" not in meta and meta["plan_sha256"] == plan.fingerprint()


def test_run_ahead_is_part_of_the_plan_run_and_of_its_trace(checkpoint, tmp_path, capsys):
    """`offexec run --plan FILE --run-ahead C H D` issues with those windows: the trace records them, and offsim
    validate re-simulates the stored plan with them (the file beside the trace keeps its own)."""
    from offsim.analysis.validate import _plan_of, load_case
    model, plan, path = _flexgen_plan_file(checkpoint, tmp_path)
    trace = tmp_path / "t.trace.csv"
    rc = main(["run", "--plan", str(path), "--hardware", "h200", "--device", "cpu", "--no-warmup",
               "--trace", str(trace), "--run-ahead", "2", "3", "4"])
    capsys.readouterr()
    assert rc == 0 and Trace.from_csv(trace).meta["run_ahead"] == [2, 3, 4]
    case = load_case(trace)
    ran, where = _plan_of(case, model, get_hardware("h200"), plan.workload)
    assert where == "stored" and ran.run_ahead == (2, 3, 4) and Plan.load(path).run_ahead == plan.run_ahead


def test_run_mixed_length_plan_file_warms_up(checkpoint, tmp_path, capsys):
    """A plan of mixed-length requests runs with the default warm-up: the warm-up's plan caps each request's
    generation length too (it was built with the batch's gen_len alone, which a longer request's length refused)."""
    model = dataclasses.replace(get_model(checkpoint / "config.json"), dtype_bytes=4)
    wl = Workload(8, 4, 2, 2, prompt_lens=(8, 5, 3, 8), gen_lens=(4, 2, 4, 1))
    plan = build_plan("flexgen", model, get_hardware("h200"), wl, {"percent": (0, 100, 0, 100, 100, 0)})
    path = tmp_path / "mixed.json"
    plan.save(path)
    rc = main(["run", "--plan", str(path), "--hardware", "h200", "--device", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, out[-3:]
    js = json.loads(out[-1])
    assert js["warmup"]["gen_len"] == 2 and js["workload"] == wl.to_dict()


@pytest.mark.parametrize("extra, names", [
    (["--policy", "static-zero"], "--policy"),
    (["--gen-len", "8", "--gpu-batch-size", "4"], "--gpu-batch-size, --gen-len"),
    (["--model", "opt-125m"], "--model"),
    (["--dtype", "float16"], "--dtype float16"),  # the plan's elements are 4 bytes
])
def test_run_plan_with_conflicting_options_exits_2(checkpoint, tmp_path, capsys, extra, names):
    model = dataclasses.replace(get_model(checkpoint / "config.json"), dtype_bytes=4)
    path = tmp_path / "p.json"
    build_plan("static-zero", model, get_hardware("h200"), Workload(8, 3, 2, 1)).save(path)
    rc = main(["run", "--plan", str(path), "--device", "cpu"] + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and names in err and len(err.splitlines()) == 1


def test_help_shows_the_real_default_model():
    help_text = " ".join(build_parser().subcommands["run"].format_help().split())
    assert "default: the --checkpoint's config.json, else opt-30b" in help_text and "default: None" not in help_text


def test_run_with_checkpoint_generates_its_tokens(checkpoint, capsys):
    rc = main(["run", "--checkpoint", str(checkpoint), "--policy", "static-zero", "--gpu-batch-size", "2",
               "--num-gpu-batches", "1"] + TINY_ARGS[:6] + TINY_ARGS[10:])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == checkpoint.name


@pytest.mark.parametrize("extra, msg", [
    (["--policy", "nope"], "unknown policy"),
    (["--policy", "static-zero", "--percent", "0", "100", "0", "100", "100", "0"], "--percent does not apply"),
    (["--policy", "flexgen", "--set", "bogus=1"], "no such setting"),
    (["--policy", "flexgen", "--gpu-mem-gb", "0.00001"], "GPU memory short by"),  # the plan does not fit the budget
    (["--trace", "/nonexistent/t.csv"], "does not exist"),
    (["--cuda-sched", "blocking"], "--cuda-sched blocking applies to a CUDA run"),  # (TINY_ARGS run on the CPU)
    (["--cpu-threads", "0"], "--cpu-threads must be between 1 and"),
    (["--cpu-threads", "100000"], "--cpu-threads must be between 1 and"),
])
def test_bad_input_exits_2_with_one_line(checkpoint, capsys, extra, msg):
    rc = main(["run", "--model", str(checkpoint / "config.json")] + TINY_ARGS + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and msg in err and len(err.splitlines()) == 1


def test_cpu_threads_hold_for_the_run_only(checkpoint, capsys):
    """--cpu-threads sets torch's intra-op threads for the run (reported in the JSON line) and gives them back."""
    before = torch.get_num_threads()
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--cpu-threads", "1", "--no-warmup"] + TINY_ARGS)
    assert rc == 0, capsys.readouterr().err
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["cpu_threads"] == 1 and line["issue_cpu_frac"] >= 0.0
    assert torch.get_num_threads() == before


def test_checkpoint_that_does_not_match_the_model_exits_2(checkpoint, capsys):
    rc = main(["run", "--model", "opt-125m", "--checkpoint", str(checkpoint)] + TINY_ARGS)
    err = capsys.readouterr().err
    assert rc == 2 and "does not match model opt-125m" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_sched_without_a_driver_exits_2(checkpoint, capsys):
    """--cuda-sched on a machine without a usable CUDA driver: one line that says what failed, before any work."""
    args = [a if a != "cpu" else "cuda" for a in TINY_ARGS]
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--cuda-sched", "blocking"] + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--cuda-sched blocking: " in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_exits_2(checkpoint, capsys):
    args = [a if a != "cpu" else "cuda" for a in TINY_ARGS]
    rc = main(["run", "--model", str(checkpoint / "config.json")] + args)
    assert rc == 2 and "no CUDA device" in capsys.readouterr().err


def test_handler_profile_tabulates_a_host_profiled_run(checkpoint, tmp_path, capsys):
    """``experiments.offexec.handler_profile`` reads a ``--host-profile`` run's .pstats and its log (the JSON last
    line): the run's issue figures and the layer handler's calls, counted once per decode and prefill layer op."""
    from experiments.offexec import handler_profile

    d = tmp_path / "hp"
    d.mkdir()
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "tightllm", "--no-warmup",
               "--host-profile", str(d / "tiny.pstats")] + TINY_ARGS)
    out = capsys.readouterr().out
    assert rc == 0
    (d / "tiny_cprofile.log").write_text(out)
    (d / "about.md").write_text("# tiny\n\nA CPU run.")
    handler_profile.main([str(d)])
    text = (d / "README.md").read_text()
    js = json.loads(out.strip().splitlines()[-1])
    assert f"| tiny | {js['measured']['decode_tok_s']:.2f} (" in text
    n, _, cum, ok = handler_profile.calls(d / "tiny.pstats")["layer handler (_op_layer)"]
    _, spec = tiny_hf("opt", seed=3)
    assert ok and cum > 0 and n == spec.num_layers * 4 * 2  # every (step, layer, GPU batch): gen 4, 2 batches
    assert f"| layer handler (_op_layer) | {n:,} / " in text


def test_issue_rows_sets_a_runs_handlers_beside_the_profiles_pricing(checkpoint, tmp_path, capsys):
    """``experiments.offexec.issue_rows``: a plan's runs (a log with several runs appended, as runtime_ab.sh writes
    them) per executor handler beside each profile's pricing of the same ops; every handler of the plan has a row,
    the ops counted once, and the runs' whole issue time is the logs'."""
    from experiments.offexec import issue_rows
    from offsim.cli import main as offsim_main

    d = tmp_path / "ir"
    d.mkdir()
    plan = d / "tiny.plan.json"
    assert offsim_main(["simulate", "--model", str(checkpoint / "config.json"), "--hardware", "h200", "--policy",
                        "flexgen", "--prompt-len", "8", "--gen-len", "4", "--gpu-batch-size", "2",
                        "--num-gpu-batches", "2", "--set", "percent=50,50,0,100,0,100",
                        "--save-plan", str(plan)]) == 0
    capsys.readouterr()
    js = []
    for _ in range(2):
        assert main(["run", "--plan", str(plan), "--hardware", "h200", "--device", "cpu",
                     "--no-warmup"]) == 0
        out = capsys.readouterr().out
        js.append(json.loads(out.strip().splitlines()[-1]))
        with open(d / "tiny_a.log", "a") as f:
            f.write(out)
    assert issue_rows.main([str(d), "--plans", str(plan), "--profile", "preset=results/profiles/h200_offexec_v2.json"]) == 0
    text = (d / "issue_rows.md").read_text()
    ops, _ = issue_rows.predicted_by_handler(Plan.load(plan), "results/profiles/h200_offexec_v2.json")
    assert sum(ops.values()) == len(Plan.load(plan).ops)
    for fn in ("h2d_weight", "d2h_hidden", "h2d_hidden"):
        assert f"| {fn} | {ops[fn]:,} |" in text
    assert f"| **all (s)** | {len(Plan.load(plan).ops):,} | {js[0]['issue_s']:.2f} | {js[1]['issue_s']:.2f} |" in text
    assert issue_rows.main([str(d), "--plans", str(d / "missing.json")]) == 2


# ---- bad or unusual input (a new-user audit, 2026-12-04: each failed before its fix) ----------------------------
def _error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, err)
    return err


@pytest.mark.parametrize("device", ["cuda:x", "", "cpu:3"])
def test_a_device_that_is_no_device_is_one_line(checkpoint, capsys, device):
    base = ["run", "--model", str(checkpoint / "config.json"), "--no-warmup"] + TINY_ARGS[:-4] + ["--dtype", "float32"]
    assert "valid: cpu, cuda, cuda:N" in _error(capsys, base + ["--device", device])
    assert "valid: cpu, cuda, cuda:N" in _error(capsys, base + ["--device", device, "--cuda-sched", "spin"])
    assert "valid: cpu, cuda, cuda:N" in _error(capsys, ["profile", "--device", device, "--out", "p.json",
                                                         "--quick"])


def test_profile_refuses_options_it_would_ignore_before_measuring(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert "give --ops MODELS" in _error(capsys, ["profile", "--device", "cpu", "--out", out, "--attention-only"])
    assert "--peak-tflops must be a positive" in _error(capsys, ["profile", "--device", "cpu", "--out", out,
                                                                 "--peak-tflops", "-1", "--quick"])
    # an --out that cannot be written is refused before minutes of measurement (it failed at the end, all lost)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "is a file, not a directory" in _error(capsys, ["profile", "--device", "cpu", "--quick", "--out",
                                                           str(blocker / "sub" / "p.json")])
    # a folder that takes no files though it exists and root may "write" it (os.access says yes in /proc)
    assert "cannot write files in /proc" in _error(capsys, ["profile", "--device", "cpu", "--quick", "--out",
                                                            "/proc/self/p.json"])
    assert "is a directory; give a file name" in _error(capsys, ["profile", "--device", "cpu", "--quick", "--out",
                                                                 str(tmp_path)])
    # names and files checked before the measuring (a misspelt --ops model failed after it, all lost)
    assert "unknown model 'llama3-8b'" in _error(capsys, ["profile", "--device", "cpu", "--quick", "--out", out,
                                                          "--ops", "llama3-8b"])
    assert "cannot read hardware profile" in _error(capsys, ["profile", "--device", "cpu", "--out", out, "--base",
                                                             str(tmp_path / "none.json"), "--ops", "opt-125m"])
    # --merge: each part read as a profile first (a list as a row's key was an unhashable-type traceback)
    v2 = str(Path(__file__).resolve().parents[1] / "results/profiles/h200_offexec_v2.json")
    base = json.loads(open(v2).read())
    base["op_times"][0][0] = [1]
    part = tmp_path / "part.json"
    part.write_text(json.dumps(base))
    assert "op_times rows must be" in _error(capsys, ["profile", "--base", v2, "--merge", str(part), "--out", out])


def test_run_takes_the_compression_flags_as_simulate_does(checkpoint, capsys):
    rc = main(["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen", "--no-warmup", "--percent",
               "0", "100", "0", "100", "100", "0", "--compress-weight"] + TINY_ARGS)
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]["compress_weight"] is True


def test_flexgen_ref_streaming_its_embedding_is_refused_in_one_line(checkpoint, capsys):
    err = _error(capsys, ["run", "--model", str(checkpoint / "config.json"), "--policy", "flexgen-ref", "--percent",
                          "0", "100", "0", "100", "100", "0", "--no-warmup"] + TINY_ARGS)
    assert "streams the embedding or the LM head" in err


def test_run_plan_keeps_the_budget_it_was_made_for(tmp_path, capsys):
    # OPT-13B's plan for an H200 (all on the GPU: 24 GiB), run with the default --hardware (a T4's 15 GiB): its own
    # budget applies, so its warm-up plan is built for that budget too (it was refused against the T4's)
    from offexec.cli import _build
    from offsim.cli import main as offsim_main

    plan = tmp_path / "p.json"
    assert offsim_main(["simulate", "--model", "opt-13b", "--hardware", "h200", "--prompt-len", "8", "--gen-len",
                        "3", "--gpu-batch-size", "1", "--save-plan", str(plan)]) == 0
    capsys.readouterr()
    args = build_parser().parse_args(["run", "--plan", str(plan), "--device", "cpu"])
    p, _, _, warm, hw = _build(args, get_hardware(args.hardware, args.gpu_mem_gb))
    assert hw.gpu_mem_bytes == p.capacity["gpu"] > get_hardware("t4").gpu_mem_bytes and warm is not None
    args = build_parser().parse_args(["run", "--plan", str(plan), "--device", "cpu", "--gpu-mem-gb", "30"])
    assert _build(args, get_hardware(args.hardware, args.gpu_mem_gb))[4].gpu_mem_bytes == 30 << 30


def test_llama_config_variants_are_read_or_refused_not_run_wrong(tmp_path):
    from offsim.core.errors import OffsimError
    from offsim.core.specs import ModelSpec

    base = get_model("llama-2-7b").to_hf_config_dict()
    base.pop("rope_theta")
    # transformers 5 writes the RoPE base inside rope_parameters
    spec = ModelSpec.from_hf_config({**base, "rope_parameters": {"rope_theta": 3.0, "rope_type": "default"}})
    assert spec.rope_theta == 3.0
    for extra, msg in [({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}}, "RoPE type"),
                       ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type"),
                       ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"type": "linear"}},
                        "RoPE type 'linear'"),
                       ({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
                       ({"hidden_act": "gelu"}, "activation")]:
        with pytest.raises(OffsimError, match=msg):
            ModelSpec.from_hf_config({**base, **extra})


def test_a_cpu_run_counts_its_device_tier_as_host_memory(capsys):
    """On --device cpu the plan's "GPU" tier is host memory: a plan far over this machine's memory is refused from
    arithmetic before any weights are made (it allocated for 20 s, then died in the allocator)."""
    err = _error(capsys, ["run", "--device", "cpu", "--no-warmup", "--model", "opt-1.3b", "--prompt-len", "1024",
                          "--gen-len", "4", "--gpu-batch-size", "4000", "--gpu-mem-gb", "4000"])
    assert "device tier on the CPU" in err and "GiB of host memory" in err
