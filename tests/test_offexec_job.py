"""``offexec job`` and ``offexec selectn-record`` on the CPU with a tiny model (issue 20): a job's blocks run by
run_plan with offsim's prediction beside, each request's tokens equal to transformers' generation of it alone,
per-request times and the padding arithmetic the same code as ``offsim job``'s, the journal resuming; Select-N's
record filled by measurement, loaded and used by the SLO experiment; bad input one line and exit 2."""
import json

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from offexec.cli import main
from offexec.job import block_prompts, request_prompt
from offexec.testing import hf_generate, tiny_hf
from offsim.core.io import read_commented_csv
from offsim.core.requests import make_blocks, read_requests_csv
from offsim.core.specs import get_hardware, get_model
from offsim.policies.selectn.record import PerformanceRecord

LENS = [(8, 3), (5, 4), (12, 2), (3, 5), (9, 1), (6, 3), (10, 4), (4, 2), (7, 3), (11, 5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny OPT checkpoint, a CPU 'profile' (h200's numbers: a CPU run is then compared), request lengths and
    a job spec over them."""
    d = tmp_path_factory.mktemp("job")
    hf, spec = tiny_hf("opt", seed=3)
    hf.save_pretrained(d / "ck", safe_serialization=True)
    (d / "lens.csv").write_text("prompt_len,gen_len\n" + "\n".join(f"{p},{g}" for p, g in LENS) + "\n")
    (d / "cpu.json").write_text(json.dumps(get_hardware("h200").to_dict()))
    job = {"name": "tiny", "model": str(d / "ck" / "config.json"), "hardware": str(d / "cpu.json"),
           "requests": {"csv": "lens.csv"}, "policies": ["flexgen", "static-zero"], "max_batch": 4}
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    return d, hf


def _run(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out.strip().splitlines(), cap.err


def test_job_runs_every_block_on_the_device_with_offsim_beside(tiny, capsys):
    d, hf = tiny
    out = d / "out"
    rc, lines, err = _run(capsys, ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32",
                                   "--checkpoint", str(d / "ck"), "--out", str(out), "--no-progress"])
    assert rc == 0, err
    res = json.loads(lines[-1])
    assert [r["policy"] for r in res if "error" in r] == []
    assert res[0]["best"] and any(line.startswith("*") or " * " in line or line.lstrip().startswith("*")
                                  for line in lines)
    blocks = read_commented_csv(out / "blocks.csv", "blocks")[1]
    reqs = read_commented_csv(out / "requests.csv", "requests")[1]
    head, _ = read_commented_csv(out / "requests.csv", "requests")
    assert head["provenance"]["commit"] and head["provenance"]["device"] == "cpu"
    doc = json.loads((out / "job.json").read_text())
    assert doc["schema"] == "offexec.job/1" and doc["comparable"] is True and doc["requests"] == len(LENS)
    for r in res:
        pol = r["policy"]
        b = blocks[blocks["policy"] == pol].sort_values("block")
        q = reqs[reqs["policy"] == pol].sort_values("request")
        assert len(b) == r["blocks"] == len(make_blocks(read_requests_csv(d / "lens.csv"), r["gpu_batch_size"],
                                                        r["num_gpu_batches"]))
        # measured and predicted side by side, per block and for the job
        assert (b["measured_s"] > 0).all() and (b["predicted_s"] > 0).all() and b["error"].notna().all()
        assert r["completion_s"] == pytest.approx(b["measured_s"].sum())
        assert r["predicted_completion_s"] > 0 and isinstance(r["completion_error"], float)
        assert r["completion_error"] == pytest.approx(r["predicted_completion_s"] / r["completion_s"] - 1)
        # per request: completion within the job, latency percentiles from the measured times
        assert (q["measured_done_s"] > 0).all() and (q["measured_done_s"] <= r["completion_s"] + 1e-9).all()
        assert r["p50_request_s"] == pytest.approx(np.percentile(q["measured_done_s"], 50))
        assert r["p99_request_s"] <= r["completion_s"] and isinstance(r["p99_request_error"], float)
        # padding waste: the same slot arithmetic as offsim job (the blocks are the same)
        assert 0 < r["padding_waste"] < 1 and r["slot_tokens"] == b["slot_tokens"].sum()
        # tokens: every request's equal transformers' greedy generation of that request alone
        for row in q.itertuples():
            prompt = request_prompt(row.request, row.prompt_len, 128, seed=0)
            ref = hf_generate(hf, prompt[None], row.gen_len)[0][0].tolist()
            assert [int(t) for t in str(row.tokens).split()] == ref, (pol, row.request)


def test_job_resumes_from_its_journal_and_limits_requests(tiny, capsys):
    d, _ = tiny
    out = d / "out2"
    argv = ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32", "--out", str(out),
            "--no-progress", "--policies", "flexgen", "--max-requests", "6"]
    rc, lines, err = _run(capsys, argv)
    assert rc == 0, err
    first = json.loads(lines[-1])[0]
    assert first["requests"] == 6 and first["resumed_blocks"] == 0
    journal = (out / "blocks.jsonl").read_text().splitlines()
    assert len(journal) == first["blocks"]
    rc, lines, err = _run(capsys, argv)  # every block already measured: nothing runs, the numbers are the same
    again = json.loads(lines[-1])[0]
    assert rc == 0 and again["resumed_blocks"] == first["blocks"]
    assert again["completion_s"] == pytest.approx(first["completion_s"])
    assert any("already measured" in line for line in lines) and not any("warm-up" in line for line in lines)
    assert any("settings of the earlier run" in line for line in lines)  # best.json: no new search on resume
    assert len((out / "blocks.jsonl").read_text().splitlines()) == len(journal)
    # the report from the journal alone (as on a machine without the device the blocks ran on)
    rc, lines, err = _run(capsys, argv + ["--report-only"])
    rep = json.loads(lines[-1])[0]
    assert rc == 0 and rep["completion_s"] == pytest.approx(first["completion_s"]) and "incomplete" not in rep
    assert json.loads((out / "job.json").read_text())["provenance"]["report_only"] is True
    # blocks measured on another device are not this job's: nothing to report, nothing run, exit 0
    rc, lines, err = _run(capsys, [a if a != "cpu" else "cuda" for a in argv] + ["--report-only"])
    assert rc == 0 and json.loads(lines[-1])[0]["incomplete"] and "nothing runs" in lines[-1]
    # a run refused before any block (a budget nothing fits in) leaves the earlier run's tables as they were (it
    # rewrote them empty)
    tables = {f: (out / f).read_text() for f in ("blocks.csv", "requests.csv", "job.json")}
    rc, lines, err = _run(capsys, argv + ["--gpu-mem-gb", "0.0001"])
    assert rc == 2 and "no policy could run" in err and "Traceback" not in err
    assert {f: (out / f).read_text() for f in tables} == tables
    # a folder that holds no job: refused in one line, nothing made (it made the folder and wrote empty tables)
    fresh = d / "never-ran"
    rc, lines, err = _run(capsys, [a if a != str(out) else str(fresh) for a in argv] + ["--report-only"])
    assert rc == 2 and "holds none" in err and "Traceback" not in err and not fresh.exists()
    # another job (other requests) in the same folder does not reuse those blocks
    rc, lines, _ = _run(capsys, argv[:-1] + ["4"])
    assert rc == 0 and json.loads(lines[-1])[0]["resumed_blocks"] == 0


@pytest.mark.parametrize("policy, settings", [
    ("flexgen", {"percent": (0, 100, 0, 100, 100, 0)}),  # weights and KV in host memory: the shared host KV pool
    ("tightllm", {"percent": (30, 40, 25, 50, 100, 0), "kv_solver": "exact"}),  # KV recompute, every tier
])
def test_job_with_host_kv_reproduces_each_request(tiny, capsys, monkeypatch, policy, settings):
    """Settings given (not searched): a policy keeping KV in host memory runs its blocks through the one page-locked
    pool, and every request's tokens still equal transformers' of it alone."""
    d, hf = tiny
    import offexec.job as OJ
    from offsim.core.specs import Workload
    from offsim.search import job as J
    from offsim.search.search import SearchResult

    monkeypatch.setattr(J, "best_for_job", lambda pol, *a, **k: SearchResult(pol, dict(settings), Workload(12, 5, 2, 2),
                                                                             {}, pd.DataFrame()))
    pools = []
    real = OJ.DeviceJob.ensure_weights
    monkeypatch.setattr(OJ.DeviceJob, "ensure_weights", lambda self, kv: (pools.append(kv), real(self, kv))[1])
    rc, lines, err = _run(capsys, ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32",
                                   "--checkpoint", str(d / "ck"), "--out", str(d / f"out-{policy}"), "--no-progress",
                                   "--policies", policy])
    assert rc == 0, err
    r = json.loads(lines[-1])[0]
    assert r["policy"] == policy and r["blocks"] == 3 and pools and pools[0] > 0
    q = read_commented_csv(d / f"out-{policy}" / "requests.csv", "requests")[1]
    for row in q.itertuples():
        ref = hf_generate(hf, request_prompt(row.request, row.prompt_len, 128)[None], row.gen_len)[0][0].tolist()
        assert [int(t) for t in str(row.tokens).split()] == ref, row.request


def test_time_limit_stops_between_blocks_and_the_same_command_resumes(tiny, capsys, monkeypatch):
    d, _ = tiny
    import offexec.job as OJ

    calls = []
    real = OJ.DeviceJob.run

    def counted(self, plan, prompts, meta=None):
        calls.append(meta)
        if sum(m is not None for m in calls) == 2:  # the second measured block: the clock runs out after it
            self.deadline = 0.0
        return real(self, plan, prompts, meta)

    monkeypatch.setattr(OJ.DeviceJob, "run", counted)
    argv = ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32", "--out", str(d / "out5"),
            "--no-progress", "--time-limit-s", "3600"]
    rc, lines, err = _run(capsys, argv)
    assert rc == 0, err
    res = json.loads(lines[-1])
    assert all(r.get("incomplete") for r in res) and "2 of 3 blocks measured" in res[0]["error"]
    assert "before it started" in res[1]["error"]
    monkeypatch.setattr(OJ.DeviceJob, "run", real)
    rc, lines, err = _run(capsys, argv)
    res = json.loads(lines[-1])
    assert rc == 0 and not any(r.get("incomplete") for r in res)
    fg = next(r for r in res if r["policy"] == "flexgen")
    assert fg["resumed_blocks"] == 2 and fg["blocks"] == 3


def test_a_block_predicted_past_the_time_limit_is_not_started(tiny, capsys, monkeypatch):
    """A block is started only where offsim's prediction of it fits in the time left (one cut off by the caller's
    own limit would be lost whole); the message says how many are measured and that the command resumes."""
    import time as real_time

    d, _ = tiny
    import offexec.job as OJ

    class Clock:  # offexec.job's clock, moved by hand: 1 ns before the deadline after the first measured block
        now = 0.0

        def monotonic(self):
            return self.now

        def __getattr__(self, name):
            return getattr(real_time, name)

    clock = Clock()
    monkeypatch.setattr(OJ, "time", clock)
    real = OJ.DeviceJob.run

    def counted(self, plan, prompts, meta=None):
        out = real(self, plan, prompts, meta)
        if meta is not None:  # a measured block (the warm-up has no meta)
            clock.now = self.deadline - 1e-9
        return out

    monkeypatch.setattr(OJ.DeviceJob, "run", counted)
    argv = ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32", "--out", str(d / "out6"),
            "--no-progress", "--time-limit-s", "3600", "--policies", "flexgen"]
    rc, lines, err = _run(capsys, argv)
    assert rc == 0, err
    res = json.loads(lines[-1])[0]
    assert res.get("incomplete") and "1 of 3 blocks measured" in res["error"]
    assert "less than block 1's predicted" in res["error"] and "resumes" in res["error"]


def test_cpu_run_against_a_gpu_preset_is_not_compared(tiny, capsys):
    d, _ = tiny
    rc, lines, err = _run(capsys, ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32",
                                   "--hardware", "h200", "--policies", "flexgen", "--max-requests", "3",
                                   "--out", str(d / "out3"), "--no-progress", "--no-warmup"])
    assert rc == 0, err
    r = json.loads(lines[-1])[0]
    assert r["comparable"] is False and r["completion_error"] is None and r["predicted_completion_s"] > 0
    assert any("not comparable" in line for line in lines)


def test_block_prompts_put_each_request_first_in_its_row():
    reqs = read_requests_csv_rows([(5, 2), (3, 2), (4, 1)])
    blk = make_blocks(reqs, 2, 2)[0]
    p = block_prompts(blk, {r.index: r.prompt_len for r in reqs}, 50, seed=1)
    assert p.shape == (4, 5)
    for s, idx in enumerate(blk.slots):
        if idx is None:
            assert (p[s] == 0).all()
        else:
            n = reqs[idx].prompt_len
            assert torch.equal(p[s, :n], request_prompt(idx, n, 50, seed=1)) and (p[s, n:] == 0).all()


def read_requests_csv_rows(rows):
    from offsim.core.requests import Request

    return [Request(i, p, g) for i, (p, g) in enumerate(rows)]


@pytest.mark.parametrize("spec, extra, msg", [
    ({"model": "opt-125m", "hardware": "h200", "requests": {"distribution": "translation", "count": 4},
      "colour": 1}, [], "unknown key"),
    ({"model": "opt-125m", "hardware": "h200", "requests": {"distribution": "poetry", "count": 4}}, [],
     "poetry"),
    ({"model": "opt-125m", "hardware": "h200", "requests": {"distribution": "translation", "count": 0}}, [],
     "count"),
    ({"model": "opt-125m", "hardware": "h200", "requests": {"distribution": "translation", "count": 4}},
     ["--policies", "magic"], "unknown policy"),
    ({"model": "opt-125m", "hardware": "h200", "requests": {"distribution": "translation", "count": 4}},
     ["--max-requests", "0"], "--max-requests"),
    ({"model": "opt-125m", "hardware": "h200", "requests": {"distribution": "translation", "count": 4}},
     ["--host-mem-gb", "0"], "--host-mem-gb"),
    ({"model": "opt-125m", "hardware": "nowhere", "requests": {"distribution": "translation", "count": 4}},
     [], "nowhere"),
    (None, [], "cannot read"),
])
def test_bad_job_input_is_one_line_and_exit_2(tmp_path, capsys, spec, extra, msg):
    path = tmp_path / "job.yaml"
    if spec is not None:
        path.write_text(yaml.safe_dump(spec))
    rc, lines, err = _run(capsys, ["job", str(path), "--device", "cpu", "--out", str(tmp_path / "o")] + extra)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("offexec: error:") and msg in err
    assert "Traceback" not in err


def test_job_on_cuda_without_a_gpu_is_one_line(tiny, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    d, _ = tiny
    rc, _, err = _run(capsys, ["job", str(d / "job.yaml"), "--out", str(d / "o4")])
    assert rc == 2 and "no CUDA device" in err and len(err.strip().splitlines()) == 1


# ---- Select-N's record, measured ---------------------------------------------------------------------------
def test_selectn_record_measured_on_cpu_loads_and_drives_the_slo_experiment(tiny, capsys, tmp_path):
    d, _ = tiny
    rec_path = tmp_path / "measured.csv"
    rc, lines, err = _run(capsys, ["selectn-record", "--model", str(d / "ck" / "config.json"), "--hardware", "h200",
                                   "--gpu-mem-gb", "24", "--device", "cpu", "--dtype", "float32", "--batches", "1",
                                   "2", "--seq-lens", "16", "--ttft-slo-ms", "5000", "--tpot-slo-ms", "5000",
                                   "--out", str(rec_path)])
    assert rc == 0, err
    js = json.loads(lines[-1])
    assert js["measured"] > 0 and js["intervals"] == [3, 1]
    # a CPU run against a GPU preset is not compared with offsim (it printed errors of -99 %), as offexec run says
    assert js["comparable"] is False and js["sim_vs_measured"] is None
    assert any("no comparison with offsim" in line for line in lines)
    rec = PerformanceRecord.from_csv(rec_path)  # loads as a simulated record does
    assert set(rec.df["source"]) == {"offexec"} and rec.meta["source"] == "offexec"
    assert rec.meta["device"] == "cpu" and rec.meta["provenance"]["commit"]
    ok = rec.df[rec.df["status"] == "ok"]
    assert (ok["latency_s"] > 0).all() and set(ok["phase"]) == {"prefill", "decode"}
    assert set(ok["interval"]) <= {1, 3} and set(rec.meta["sim_vs_measured"]) == {"prefill", "decode"}
    p = rec.point("decode", 2, 10)
    assert p.status == "meets" and p.n_min == 1  # a generous SLO: every interval meets it
    # the SLO code path on the measured record beside the simulated one
    from experiments.selectn import slo

    model = get_model(str(d / "ck" / "config.json"))
    out = tmp_path / "slo"
    rc = slo.main(["--models", str(d / "ck" / "config.json"), "--hardware", "h200", "--gpu-mem-gb", "24",
                   "--batches", "1", "2", "--prompt-len", "8", "--gen-len", "4", "--record-batches", "1", "2",
                   "--record-seq-lens", "16", "--ttft-slo-ms", "5000", "--tpot-slo-ms", "5000",
                   "--measured-record", str(rec_path), "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    res = json.loads(lines[-1])
    pols = {s["policy"]: s for s in res["summary"]}
    assert "selectn-measured" in pols and "selectn" in pols
    assert pols["selectn-measured"]["attain_points_record"] == 1.0
    df = pd.read_csv(out / "slo_h200_24gib_p8.csv", comment="#")
    m = df[df["policy"] == "selectn-measured"]
    assert len(m) == 2 and m["record_source"].eq("offexec").all() and m["record_tpot_mean_s"].gt(0).all()
    assert (out / f"ranges_measured_{model.name}_h200_24gib_p8.csv").exists()
    # a measured record for another SLO or budget is refused in one line
    rc = slo.main(["--models", str(d / "ck" / "config.json"), "--hardware", "h200", "--gpu-mem-gb", "24",
                   "--batches", "1", "--prompt-len", "8", "--gen-len", "4", "--record-batches", "1",
                   "--record-seq-lens", "16", "--measured-record", str(rec_path), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "SLO" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra, msg", [
    (["--intervals", "3", "2"], "include 1"),
    (["--intervals", "9", "1"], "intervals must be in 1..3"),
    (["--batches", "3"], "powers of two"),
    (["--seq-lens", "128"], "positions"),
    (["--repeats", "0"], "--repeats"),
    (["--gpu-mem-gb", "0.000001", "--seq-lens", "16"], "no point of the grid fits"),  # (all-oom record, exit 0)
])
def test_bad_record_input_is_one_line_and_exit_2(tiny, capsys, tmp_path, extra, msg):
    d, _ = tiny
    rc, _, err = _run(capsys, ["selectn-record", "--model", str(d / "ck" / "config.json"), "--device", "cpu",
                               "--dtype", "float32", "--out", str(tmp_path / "r.csv")] + extra)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_h200_job_specs_load(monkeypatch):
    """experiments/offexec/jobs/: the specs the GPU session runs parse, 256 requests each, from the repository root."""
    from pathlib import Path

    from offsim.search.job import load_job_spec

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    specs = sorted((root / "experiments" / "offexec" / "jobs").glob("*.yaml"))
    assert len(specs) == 4
    for p in specs:
        s = load_job_spec(p.relative_to(root))
        assert len(s.requests) >= 256 and s.policies == ("flexgen", "tightllm") and s.gpu_mem_gb == 16
        assert get_hardware(s.hardware, s.gpu_mem_gb).name == "h200-offexec-v2"


def test_measured_jobs_readme_is_generated_from_job_json(tmp_path):
    """experiments.offexec.jobs_readme tabulates every policy of every job folder from its job.json: a measured one
    with its error and the count within 5 %, one a time limit stopped as not measured."""
    from experiments.offexec.jobs_readme import write

    done = {"policy": "flexgen", "batching": "padded", "gpu_batch_size": 8, "num_gpu_batches": 2, "blocks": 3,
            "completion_s": 10.0, "predicted_completion_s": 10.3, "completion_error": 0.03, "output_tok_s": 5.0,
            "p50_request_s": 4.0, "p99_request_s": 9.0, "predicted_p50_request_s": 4.1,
            "predicted_p99_request_s": 9.2, "padding_waste": 0.25}
    stopped = {"policy": "tightllm", "error": "--time-limit-s 10 reached before it started", "incomplete": True}
    (tmp_path / "kind_a").mkdir()
    (tmp_path / "kind_a" / "job.json").write_text(json.dumps(
        {"batching": "padded", "policies": [done, stopped], "provenance": {"commit": "abc", "date": "2026-12-01T00:00"}}))
    text = write(tmp_path).read_text()
    assert "| kind_a | flexgen | padded | 8 x 2 | 3 | 10.00 | 10.30 | +3.0% |" in text
    assert "| kind_a | tightllm | padded | | | not measured |" in text
    assert "within 5 % of the measured one: 1 of 1 measured jobs" in text
    assert "| abc, 2026-12-01T00:00Z |" in text  # no journal: the report's own provenance

    # A resumed job: each policy's blocks say which run measured them, not the report's last run.
    blocks = [{"policy": "flexgen", "block": 0, "provenance": {"commit": "old1", "date": "2026-11-30T10:00:00"}},
              {"policy": "flexgen", "block": 1, "provenance": {"commit": "new2", "date": "2026-12-02T02:06:00"}},
              {"policy": "tightllm", "block": 0, "provenance": {"commit": "new2", "date": "2026-12-02T02:07:00"}}]
    (tmp_path / "kind_a" / "blocks.jsonl").write_text("\n".join(json.dumps(b) for b in blocks) + "\n")
    text = write(tmp_path).read_text()
    assert "| old1, 2026-11-30T10:00Z; new2, 2026-12-02T02:06Z |" in text
    assert "abc, 2026-12-01" not in text.split("| kind_a | flexgen")[1].splitlines()[0]


def test_selectn_record_warms_up_each_iteration_shape_once(tiny, monkeypatch):
    """Each new (phase, batch, sequence length) runs once unmeasured before its first measured run (the first
    interval measured at a new batch size ran 9-42 % slow on the H200); later intervals of that shape do not."""
    import offexec.executor as EX
    from offexec.selectn import MeasuredIterations
    from offexec.weights import random_weights

    d, _ = tiny
    import dataclasses

    model = dataclasses.replace(get_model(str(d / "ck" / "config.json")), dtype_bytes=4)  # float32 on the CPU
    hw = get_hardware("h200", gpu_mem_gb=24)
    calls = []
    real = EX.run_plan

    def counted(plan, *a, **kw):
        calls.append(plan.workload.num_prompts)
        return real(plan, *a, **kw)

    monkeypatch.setattr(EX, "run_plan", counted)
    weights = random_weights(model, 0, torch.float32, device="cpu", pinned=False, progress=False)
    try:
        it = MeasuredIterations(weights, "cpu", int(hw.gpu_mem_bytes))
        for batch, interval in ((1, 3), (1, 1), (2, 3), (2, 1)):
            assert it(model, hw, "prefill", batch, 16, interval).latency_s > 0
    finally:
        weights.close()
    assert calls == [1, 1, 1, 2, 2, 2]  # 2 runs at the first interval of each batch, 1 at the next
    assert len(it.log) == 4


def test_job_traces_validate_op_by_op(tiny, capsys):
    """--traces writes each block's measured trace with its plan beside: `offsim validate` re-simulates exactly
    what ran; the journal keeps each block's busy seconds per kind and its issue time by handler."""
    from offsim.cli import main as offsim_main
    d, _ = tiny
    out = d / "out_traces"
    rc, lines, err = _run(capsys, ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32",
                                   "--checkpoint", str(d / "ck"), "--out", str(out), "--no-progress",
                                   "--policies", "flexgen", "--max-requests", "6", "--traces"])
    assert rc == 0, err
    blocks = read_commented_csv(out / "blocks.csv", "blocks")[1]
    traces = sorted((out / "traces").glob("*.trace.csv.gz"))
    assert [t.name for t in traces] == [f"flexgen_block{i}.trace.csv.gz" for i in sorted(blocks["block"])]
    assert all(t.with_name(t.name.replace(".trace.csv.gz", ".plan.json.gz")).is_file() for t in traces)
    entry = json.loads((out / "blocks.jsonl").read_text().splitlines()[0])
    assert entry["busy_s"]["compute"] > 0 and "issue_s_by_handler" in entry  # (empty on the CPU: no issuing thread)
    rc = offsim_main(["validate", str(out / "traces"), "--hardware", str(d / "cpu.json"), "--out",
                      str(out / "report")])
    cap = capsys.readouterr()
    assert rc in (0, None), cap.err
    rep = pd.read_csv(out / "report" / "validation.csv", comment="#")
    assert len(rep) == len(traces) and (rep["plan"] == "stored").all()


def test_job_block_plan_rebuilds_a_measured_block(tmp_path, capsys):
    """experiments.offexec.job_block_plan: block 0 of the committed summarization job, as the job ran it (its
    padded prompt lengths in blocks.csv), shortened; a block the job does not have is one line and exit 2."""
    from pathlib import Path

    from experiments.offexec import job_block_plan as JBP
    repo = Path(__file__).resolve().parents[1]
    spec = repo / "experiments" / "offexec" / "jobs" / "llama-2-13b_summarization.yaml"
    folder = repo / "results" / "offline_jobs" / "h200" / "summarization"
    blocks = read_commented_csv(folder / "blocks.csv", "blocks")[1]
    row = blocks[(blocks["policy"] == "tightllm") & (blocks["block"] == 0)].iloc[0]
    out = tmp_path / "b0.json.gz"
    assert JBP.main([str(spec), str(folder), "--policy", "tightllm", "--block", "0", "--gen-len", "4",
                     "--out", str(out)]) == 0
    from offsim.core.plan import Plan
    wl = Plan.load(out).workload
    assert " ".join(map(str, wl.batch_prompt_lens)) == row["batch_prompt_lens"] and wl.gen_len == 4
    assert wl.gpu_batch_size == row["gpu_batch_size"] and wl.num_gpu_batches == row["num_gpu_batches"]
    capsys.readouterr()
    assert JBP.main([str(spec), str(folder), "--policy", "tightllm", "--block", "9", "--out", str(out)]) == 2
    assert "blocks 0 to 2" in capsys.readouterr().err


def test_jobs_readme_explains_its_misses(tmp_path):
    """jobs_readme --explain on the committed translation job: no block off by more than 5 %, and the README says so;
    then with TightLLM's block 0 made 25 % slower in its journal and blocks.csv (as it measured before the masked
    decode fix), that block is listed, split into prefill and decode against offsim's exact simulation of its plan,
    and the README's section on the misses is generated from it."""
    import shutil
    from pathlib import Path

    from experiments.offexec import jobs_readme as JR
    from offsim.core.io import write_commented_csv
    src = Path(__file__).resolve().parents[1] / "results" / "offline_jobs" / "h200"
    shutil.copytree(src / "translation", tmp_path / "translation")
    assert read_commented_csv(JR.explain(tmp_path), "misses")[1].empty
    assert "No measured block is off by more than 5%" in JR.write(tmp_path).read_text()

    folder, slow = tmp_path / "translation", 1.25
    head, blocks = read_commented_csv(folder / "blocks.csv", "blocks")
    hit = (blocks["policy"] == "tightllm") & (blocks["block"] == 0)
    blocks.loc[hit, "measured_s"] *= slow
    blocks.loc[hit, "error"] = blocks.loc[hit, "predicted_s"] / blocks.loc[hit, "measured_s"] - 1
    write_commented_csv(folder / "blocks.csv", head, blocks)
    lines = [json.loads(x) for x in (folder / "blocks.jsonl").read_text().splitlines()]
    for d in lines:
        if d["policy"] == "tightllm" and d["block"] == 0:
            d["makespan_s"] *= slow
            d["token_end_s"] = [[t * slow for t in row] for row in d["token_end_s"]]
            ends = d["token_end_s"]
    (folder / "blocks.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    df = read_commented_csv(JR.explain(tmp_path), "misses")[1]
    assert list(zip(df["task_kind"], df["policy"], df["block"])) == [("translation", "tightllm", 0)]
    r = df.iloc[0]
    assert r["measured_prefill_s"] == pytest.approx(max(ends[0]))
    assert r["prefill_error"] == pytest.approx(r["predicted_prefill_s"] / r["measured_prefill_s"] - 1)
    assert r["decode_error"] < -0.15 and r["exact_predicted_s"] > 0 and 0 < r["busy_h2d"] <= 1
    text = JR.write(tmp_path).read_text()
    row = blocks[hit].iloc[0]
    assert f"| translation | tightllm | 0 | {row['batch_prompt_lens']} | {row['gen_len']} |" in text


def test_job_remeasures_a_policy_keeping_the_others(tiny, capsys):
    """--remeasure POLICY: that policy's journal lines move to blocks.replaced.jsonl (nothing lost) and its blocks
    run again at the settings the job started with; another policy's blocks resume. Bad use is refused in one line."""
    d, _ = tiny
    out = d / "out_re"
    argv = ["job", str(d / "job.yaml"), "--device", "cpu", "--dtype", "float32", "--out", str(out),
            "--no-progress", "--max-requests", "6"]
    rc, lines, err = _run(capsys, argv)
    assert rc == 0, err
    first = {r["policy"]: r for r in json.loads(lines[-1])}
    assert len(first) >= 2
    pol, other = sorted(first)[0], sorted(first)[1]
    before = (out / "blocks.jsonl").read_text().splitlines()
    mine = [ln for ln in before if json.loads(ln)["policy"] == pol]
    rc, lines, err = _run(capsys, argv + ["--remeasure", pol])
    assert rc == 0, err
    again = {r["policy"]: r for r in json.loads(lines[-1])}
    assert again[pol]["resumed_blocks"] == 0 and again[other]["resumed_blocks"] == first[other]["blocks"]
    assert again[pol]["settings"] == first[pol]["settings"]
    assert (out / "blocks.replaced.jsonl").read_text().splitlines() == mine
    after = (out / "blocks.jsonl").read_text().splitlines()
    assert len(after) == len(before) and [ln for ln in after if json.loads(ln)["policy"] != pol] == \
        [ln for ln in before if json.loads(ln)["policy"] != pol]
    for bad in (["--remeasure", "selectn-nope"], ["--remeasure", pol, "--report-only"]):
        rc, lines, err = _run(capsys, argv + bad)
        assert rc == 2 and "--remeasure" in err and "Traceback" not in err
