"""Generated reports of offexec's H200 evidence: results/offexec/issue_under_load/README.md is what
experiments.offexec.issue_under_load makes of its JSON, and write_readme's --before section sets every run's host
issue beside the earlier folder's same run, from their offexec_h200.json files."""
import json
import shutil
from pathlib import Path

from experiments.offexec import issue_under_load as IUL
from experiments.offexec import write_readme as W

REPO = Path(__file__).resolve().parents[1]
OFFEXEC = REPO / "results" / "offexec"


def _table(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("| ")]


def test_issue_under_load_readme_is_generated_from_its_json(tmp_path):
    work = tmp_path / "iul"
    shutil.copytree(OFFEXEC / "issue_under_load", work)
    text = IUL.report(work)
    assert _table(text) == _table((OFFEXEC / "issue_under_load" / "README.md").read_text())
    res = json.loads((work / "issue_under_load.json").read_text())["results"]
    assert "| event_record | " in text and res["event_record"]["idle"]["wall_us"] > 0


def test_measuring_needs_cuda_and_says_so(capsys):
    import torch
    if torch.cuda.is_available():
        return
    assert IUL.main(["--out", "x.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_write_readme_before_sets_each_runs_issue_beside_the_earlier_one(tmp_path):
    now, before = OFFEXEC / "h200_0b8e77a", OFFEXEC / "h200_265e402"
    work = tmp_path / "now"
    shutil.copytree(now, work)
    text = W.write(work, before).read_text()
    section = text.split("## Host issue against")[1]
    rows = _table(section)[2:]
    runs = W._runs(now)
    assert len(rows) == len(runs) == 6
    old = {(s, r["config"]): r for s, _, r in W._runs(before)}
    for sub, _, r in runs:
        row = next(x for x in rows if x.startswith(f"| {sub} {r['config']} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) == round(old[(sub, r["config"])]["issue_s"], 2)
        assert float(cells[2]) == round(r["issue_s"], 2)
    # the committed README is this output (the table lines)
    assert _table(text) == _table((now / "README.md").read_text())


def test_runs_table_readme_is_generated_from_its_logs(tmp_path):
    """results/offexec/capture_aware_ff97435's table is what runs_table makes of its logs; a folder without run
    lines is refused with a message."""
    from experiments.offexec import runs_table as RT
    src = OFFEXEC / "capture_aware_ff97435"
    work = tmp_path / "ca"
    shutil.copytree(src, work)
    RT.write(work, work / "about.md")
    assert _table((work / "README.md").read_text()) == _table((src / "README.md").read_text())
    df = RT.runs(work)
    assert len(df) == 4 and set(df["label"]) == {"capture_aware_false", "capture_aware_true"}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.log").write_text("no result here\n")
    import pytest
    with pytest.raises(SystemExit, match="no `offexec run` result lines"):
        RT.runs(empty)


def test_write_readme_shows_the_windows_only_where_a_run_was_given_others(tmp_path):
    """A folder whose runs carry another ``run_ahead`` than the plans' default (`h200 --run-ahead`) gets a column
    with each run's windows; runs at the default (or from before the field) get none."""
    work = tmp_path / "now"
    shutil.copytree(OFFEXEC / "h200_0b8e77a", work)
    assert "run-ahead" not in W.write(work, None).read_text()
    f = work / "p512_g32" / "offexec_h200.json"
    d = json.loads(f.read_text())
    d["runs"][0]["run_ahead"] = [2, 6, 16]
    f.write_text(json.dumps(d))
    rows = _table(W.write(work, None).read_text().split("### `p512_g32`")[1])
    assert "run-ahead (compute, h2d, d2h)" in rows[0]
    assert rows[2].rstrip(" |").endswith("2 6 16") and rows[3].rstrip(" |").endswith("16 6 16")


def test_window_predict_tabulates_the_most_host_bound_calibration_plan(tmp_path):
    """experiments.offexec.window_predict: the most host-bound calibration case re-simulated at two windows, its
    measured issue and the commands to measure it; a malformed window is refused by argparse."""
    import pytest

    from experiments.offexec import window_predict as WP

    out = tmp_path / "w.md"
    assert WP.main(["--out", str(out), "--cases", "1", "--windows", "16,6,16", "2,6,16"]) == 0
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ") and "%" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 6 and cells[-1].endswith("%")  # case, issue, measured, two predictions, their ratio
    assert text.count("offexec run --plan") == 2 and "--run-ahead 2 6 16" in text
    with pytest.raises(SystemExit):
        WP.main(["--out", str(out), "--windows", "2,6"])


def test_host_stacks_attributes_handler_samples_to_the_innermost_library(tmp_path):
    """experiments.offexec.host_stacks: samples through an `_op_*` frame are counted per innermost handler and
    grouped by the library of the stack's innermost frame; samples outside any handler are counted apart; a file
    with no handler sample is refused with a message."""
    from experiments.offexec import host_stacks as HS
    raw = tmp_path / "stacks.txt"
    raw.write_text(
        "run (offexec/executor.py:800);_op_layer (offexec/executor.py:1111);linear (torch/nn/functional.py:1);"
        "at::native::addmm (libtorch_cpu.so);cuLaunchKernel (libcuda.so.1) 30\n"
        "run (offexec/executor.py:800);_op_layer (offexec/executor.py:1111);_attend_gpu (offexec/executor.py:1090) 10\n"
        "run (offexec/executor.py:800);_op_h2d_weight (offexec/executor.py:1246);0x7f00 (libcudart.so.13) 5\n"
        "run (offexec/executor.py:800);synchronize (torch/cuda/streams.py:1);cuEventSynchronize (libcuda.so.1) 99\n"
        "not a stack line\n")
    s = HS.summarise(HS.parse(raw.read_text().splitlines()))
    assert s["total"] == {"layer": 40, "h2d_weight": 5} and s["outside"] == 99
    assert s["libraries"]["layer"] == {"CUDA driver": 30, "Python code": 10}
    assert s["leaves"]["layer"] == [("cuLaunchKernel (libcuda.so.1)", 30)]
    assert HS.main([str(raw), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "host_stacks.md").read_text()
    head = next(ln for ln in text.splitlines() if ln.startswith("| handler |")).split(" | ")
    row = next(ln for ln in text.splitlines() if ln.startswith("| layer |")).split(" | ")
    assert row[head.index("CUDA driver")] == "75%" and row[head.index("CUDA runtime")] == "0%"
    empty = tmp_path / "empty.txt"
    empty.write_text("main (x.py:1) 3\n")
    assert HS.main([str(empty)]) == 2


def test_write_readme_keeps_a_run_beyond_its_plans_budget_out_of_the_targets(tmp_path):
    """A run given more GPU memory than its plan (2026-12-04's split recompute graphs, whose graphs were in no plan's
    footprint: results/offexec/split_a518028/) gets a run-budget column with its runtime options and no line among
    the targets; the others keep theirs."""
    work = tmp_path / "now"
    shutil.copytree(OFFEXEC / "h200_0b8e77a", work)
    assert "run budget GiB" not in W.write(work, None).read_text()
    f = work / "p512_g32" / "offexec_h200.json"
    d = json.loads(f.read_text())
    r = d["runs"][0]
    r["plan_budget_bytes"], r["budget_bytes"] = r["budget_bytes"], r["budget_bytes"] + 2 * W.GiB
    r["runtime"] = {"split_recompute_graphs": True}
    f.write_text(json.dumps(d))
    text = W.write(work, None).read_text()
    rows = _table(text.split("### `p512_g32`")[1])
    assert "run budget GiB (runtime)" in rows[0]
    assert rows[2].rstrip(" |").endswith("18 (split_recompute_graphs)") and rows[3].rstrip(" |").endswith("| 16")
    targets = text.split("## Issue 14's targets")[1].split("\n## ")[0]
    assert f"p512_g32 {r['config']} |" not in targets
    assert f"p512_g32 {d['runs'][1]['config']} |" in targets


def test_h200_script_runs_end_to_end_on_the_cpu_and_its_readme_is_written(tmp_path):
    """experiments.offexec.h200's device run, smoke-tested on a tiny model on the CPU (its `--device cpu` mode):
    every configuration a session asks the GPU for plans, passes the pre-check, runs, records a trace and a
    validation case, and write_readme makes the README from what it wrote -- so a device call does not fail on the
    script itself."""
    from experiments.offexec import h200 as H
    out = tmp_path / "h200_smoke"
    configs = ["tightllm", "tightllm_graph_recompute", "flexgen_gpu_attn"]
    rc = H.main(["--device", "cpu", "--model", "opt-125m", "--budget-gb", "0.5", "--prompt-len", "32",
                 "--gen-len", "4", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--out", str(out / "p32_g4"),
                 "--configs", *configs])
    assert rc == 0
    d = json.loads((out / "p32_g4" / "offexec_h200.json").read_text())
    runs = {r["config"]: r for r in d["runs"]}
    assert sorted(runs) == sorted(configs) and not any("failed" in r for r in runs.values())
    for name, r in runs.items():
        assert r["measured"]["decode_tok_s"] > 0 and r["predicted"]["decode_tok_s"] > 0
        assert (out / "p32_g4" / f"trace_{name}.csv.gz").exists() and (out / "p32_g4" / f"case_{name}.json").exists()
    assert W.main([str(out)]) == 0
    text = (out / "README.md").read_text()
    assert all(f"| {c} |" in text for c in configs)
