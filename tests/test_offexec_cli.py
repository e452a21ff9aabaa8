"""``offexec run`` end to end on the CPU with a tiny model: the report, the JSON last line, the trace file, and
exit code 2 with one line for bad input."""
import json

import pytest
import torch

from offexec.cli import main
from offexec.testing import tiny_hf
from offsim.core.trace import Trace

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
    t = Trace.from_csv(trace)
    assert t.meta["source"] == "offexec" and len(t.df) > 0
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]  # the disk tier's files are gone


def test_run_with_checkpoint_generates_its_tokens(checkpoint, capsys):
    rc = main(["run", "--checkpoint", str(checkpoint), "--policy", "static-zero", "--gpu-batch-size", "2",
               "--num-gpu-batches", "1"] + TINY_ARGS[:6] + TINY_ARGS[10:])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == checkpoint.name


@pytest.mark.parametrize("extra, msg", [
    (["--policy", "nope"], "unknown policy"),
    (["--policy", "static-zero", "--percent", "0", "100", "0", "100", "100", "0"], "--percent does not apply"),
    (["--policy", "flexgen", "--set", "bogus=1"], "no such setting"),
    (["--policy", "flexgen", "--gpu-mem-gb", "0.00001"], "capacity"),  # the plan does not fit the budget
])
def test_bad_input_exits_2_with_one_line(checkpoint, capsys, extra, msg):
    rc = main(["run", "--model", str(checkpoint / "config.json")] + TINY_ARGS + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and msg in err and len(err.splitlines()) == 1


def test_checkpoint_that_does_not_match_the_model_exits_2(checkpoint, capsys):
    rc = main(["run", "--model", "opt-125m", "--checkpoint", str(checkpoint)] + TINY_ARGS)
    err = capsys.readouterr().err
    assert rc == 2 and "does not match model opt-125m" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_exits_2(checkpoint, capsys):
    args = [a if a != "cpu" else "cuda" for a in TINY_ARGS]
    rc = main(["run", "--model", str(checkpoint / "config.json")] + args)
    assert rc == 2 and "no CUDA device" in capsys.readouterr().err
