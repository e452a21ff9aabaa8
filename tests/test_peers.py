"""The peer harnesses of issue 15 (experiments/peers, experiments/real_throughput), as far as they run without a GPU:
the stand-in tokenizer, FlexGen's placement and memory as its code allocates them, the policy space and its
candidates, the records and the journal (resume, retries, timeouts), the CSV/README/chart, and Accelerate's and
offexec's workers on a tiny model on the CPU. The GPU runs themselves are marked ``gpu``."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from experiments.peers import accelerate_ref, deepspeed_ref
from experiments.peers import flexgen_ref as fr
from experiments.peers.common import (PREFIX, RESULT_FIELDS, StandInTokenizer, emit, flexgen_metrics, link_bound,
                                      parse_results, pow2ceil)
from offsim import get_model

GiB = 1 << 30
TINY_OPT = {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 128,
            "vocab_size": 128, "max_position_embeddings": 64, "word_embed_proj_dim": 64, "do_layer_norm_before": True,
            "activation_function": "relu", "tie_word_embeddings": True, "enable_bias": True}
TINY_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.fixture
def tiny_cfg(tmp_path):
    def make(d, name):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        return str(p)
    return make


# -- records --------------------------------------------------------------------------------------------------------
def test_flexgen_metrics_and_link_bound():
    m = flexgen_metrics(48, 512, 32, 2.0, 31.0)
    assert m["prefill_tok_s"] == pytest.approx(48 * 512 / 2.0)
    assert m["decode_tok_s"] == pytest.approx(48 * 31 / 31.0)
    assert m["total_tok_s"] == pytest.approx(48 * 32 / 33.0)
    # docs/anchors.md: 44.6 GB of weights + ~17 GB of KV per step at 55 GB/s -> <= ~42 decode tok/s for 48 prompts
    assert link_bound(48, 32, 31 * 61.6e9, 55e9) == pytest.approx(48 / (61.6 / 55), rel=1e-6)
    assert link_bound(4, 32, 0, 55e9) == float("inf")


def test_emit_and_parse_round_trip(capsys):
    emit({"system": "x", "decode_tok_s": float("nan"), "total_tok_s": 1.5})
    print("noise")
    out = capsys.readouterr().out
    assert out.startswith(PREFIX)
    recs = parse_results(out + PREFIX + "{broken\n")
    assert recs == [{"system": "x", "decode_tok_s": None, "total_tok_s": 1.5}]
    assert RESULT_FIELDS[:9] == ("system", "model", "prompt_len", "gen_len", "budget_gib", "batch", "prefill_tok_s",
                                 "decode_tok_s", "total_tok_s")


# -- the stand-in tokenizer -------------------------------------------------------------------------------------------
def test_standin_tokenizer_pads_like_opts():
    tok = StandInTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")
    enc = tok(["Paris is the capital city of"], padding="max_length", max_length=512)
    ids = enc.input_ids[0]
    assert len(ids) == 512 and ids[:505] == [1] * 505 and ids[505] == 2  # pad 1 on the left, BOS 2, 6 words
    assert all(4 <= t < 50272 for t in ids[506:])
    assert enc["attention_mask"][0] == [0] * 505 + [1] * 7
    assert tok("a b")["input_ids"] == tok.encode("a b") and len(tok.encode("a b")) == 3
    right = StandInTokenizer(padding_side="right")(["a"], padding="max_length", max_length=4).input_ids[0]
    assert right[:2] == [2, tok.word_id("a")] and right[2:] == [1, 1]
    t = tok(["a b c", "a"], padding=True, return_tensors="pt")
    assert t.input_ids.shape == (2, 4) and t.input_ids[1, 0] == 1
    assert tok.batch_decode([[1, 2, 7]]) == ["<7>"]


def test_flexgen_test_inputs_with_standin():
    """FlexGen's own get_test_inputs with the stand-in (skipped where flexgen is not installed)."""
    flex_opt = pytest.importorskip("flexgen.flex_opt")
    ins = flex_opt.get_test_inputs(512, 3, StandInTokenizer(padding_side="left"))
    assert len(ins) == 3 and all(len(x) == 512 for x in ins)


# -- FlexGen's placement and memory ---------------------------------------------------------------------------------
def test_flexgen_weight_homes_follow_its_midpoint_rule():
    m = get_model("opt-30b")
    homes = fr.weight_homes(m, (20, 80, 0, 100, 100, 0))
    h, f = m.d_model, m.ffn_dim
    assert homes[:2] == [("cpu", (m.vocab_size, h)), ("gpu", (2050, h))]  # InputEmbed: tokens, positions
    attn_out = [t for t, s in homes if s == (h, h)]
    # per decoder layer q, k, v on the CPU and out_proj (midpoint 87.5 %) on the GPU; fc1 and fc2 (25 %, 75 %) on CPU
    assert attn_out[:4] == ["cpu", "cpu", "cpu", "gpu"]
    assert all(t == "cpu" for t, s in homes if s in ((f, h), (h, f)))
    assert all(t == "gpu" for t, _ in fr.weight_homes(m, (100, 0, 0, 100, 100, 0)))
    assert all(t == "cpu" for t, _ in fr.weight_homes(m, (0, 100, 0, 100, 100, 0)))
    assert {t for t, _ in fr.weight_homes(m, (0, 50, 0, 100, 100, 0))} == {"disk", "cpu"}
    total = sum(2 * fr._numel(s) for _, s in homes)
    assert total == pytest.approx(m.weight_bytes() + 2 * m.vocab_size * h, rel=0.01)  # two token tables


def test_flexgen_host_estimate_matches_the_anchor_runs():
    """docs/anchors.md: OPT-30B 512/32, 20/80 weights, KV on the CPU: 16 x 3 ran on the 125 GiB host, 24 x 3 was
    killed by the kernel."""
    m = get_model("opt-30b")
    ran = fr.FlexGenPolicy(16, 3, (20, 80, 0, 100, 100, 0), True)
    killed = fr.FlexGenPolicy(24, 3, (20, 80, 0, 100, 100, 0), False)
    assert fr.host_bytes(m, ran, 512, 32)["total"] <= fr.FLEXGEN_HOST_LIMIT_GIB * GiB
    assert fr.host_bytes(m, killed, 512, 32)["total"] > 125 * GiB
    assert fr.fits(m, ran, 512, 32, 16)[0]
    assert not fr.fits(m, killed, 512, 32, 16)[0]
    # the prefill at prompt ~2048 with 8 sequences per batch did not fit 16 GiB (it materialises the scores)
    assert not fr.fits(m, fr.FlexGenPolicy(8, 1, (20, 80, 0, 100, 100, 0)), 2016, 32, 16)[0]
    assert pow2ceil(5) == 8 and pow2ceil(8) == 8 and pow2ceil(1) == 1


def test_flexgen_policy_validation_and_cli():
    p = fr.FlexGenPolicy(48, 3, (20, 80, 0, 100, 100, 0), True)
    assert p.cli_args() == ["--gpu-batch-size", "48", "--num-gpu-batches", "3", "--percent", "20", "80", "0", "100",
                            "100", "0", "--cpu-cache-compute"]
    assert p.system == "flexgen-ref" and p.num_prompts == 144
    q = fr.FlexGenPolicy(64, 8, (0, 100, 0, 100, 100, 0), False, True, True)
    assert q.system == "flexgen-4bit-ref" and q.cli_args()[-2:] == ["--compress-weight", "--compress-cache"]
    for bad in (fr.FlexGenPolicy(1, 1, (60, 60, 0, 100, 100, 0)), fr.FlexGenPolicy(1, 1, (0, 100, 0, 100, 50, 50)),
                fr.FlexGenPolicy(1, 1, (0, 100, 0, 100, 100, 0), True, True, False)):
        with pytest.raises(ValueError):
            bad.validate()
    argv = fr.flexgen_argv("opt-30b", p, 512, 32, "/tmp/off", "/tmp/log")
    assert argv[:4] == ["--model", "facebook/opt-30b", "--path", "_DUMMY_"]
    assert "--debug-mode" not in argv and "--cut-gen-len" not in argv
    assert fr._normalise((18, 80, 0, 98, 100, 0)) == (18, 82, 0, 100, 100, 0)


def test_flexgen_argv_parses_with_flexgens_own_parser():
    flex_opt = pytest.importorskip("flexgen.flex_opt")
    import argparse

    ap = argparse.ArgumentParser()
    flex_opt.add_parser_arguments(ap)
    p = fr.FlexGenPolicy(16, 3, (20, 80, 0, 100, 100, 0), True, False, False)
    a = ap.parse_args(fr.flexgen_argv("opt-30b", p, 512, 32, "/tmp/off", "/tmp/log"))
    assert (a.gpu_batch_size, a.num_gpu_batches, a.percent, a.cpu_cache_compute, a.path) == (
        16, 3, [20, 80, 0, 100, 100, 0], True, "_DUMMY_")
    assert a.debug_mode is None and a.cut_gen_len is None and a.overlap and a.pin_weight


def test_patch_flexgen_offline_and_positions(monkeypatch):
    flex_opt = pytest.importorskip("flexgen.flex_opt")
    monkeypatch.setattr(flex_opt, "AutoTokenizer", flex_opt.AutoTokenizer)
    monkeypatch.setattr(flex_opt, "get_opt_config", flex_opt.get_opt_config)
    done = fr.patch_flexgen(flex_opt, 2112)
    assert flex_opt.AutoTokenizer is StandInTokenizer and len(done) == 2
    assert flex_opt.get_opt_config("facebook/opt-30b").max_seq_len == 2112
    tok = flex_opt.AutoTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")
    assert tok.pad_token_id == flex_opt.get_opt_config("opt-30b").pad_token_id


def test_policy_space_fits_host_and_gpu():
    m = get_model("opt-30b")
    space = fr.policy_space(m, 512, 32, 16)
    assert space and len({p.tag() for p in space}) == len(space)
    for p in space:
        assert fr.fits(m, p, 512, 32, 16)[0]
        assert fr.host_bytes(m, p, 512, 32)["total"] <= fr.FLEXGEN_HOST_LIMIT_GIB * GiB
        assert p.percent[1] == 100 - p.percent[0] and p.percent[4] == 100
        assert not (p.cpu_cache_compute and p.percent[2])
    # more GPU memory admits at least as many weights on the GPU for the same block
    more = {(p.gpu_batch_size, p.num_gpu_batches, p.percent[2], p.cpu_cache_compute): p.percent[0]
            for p in fr.policy_space(m, 512, 32, 24)}
    for p in space:
        assert more[(p.gpu_batch_size, p.num_gpu_batches, p.percent[2], p.cpu_cache_compute)] >= p.percent[0]
    assert all(p.compress_cache and p.compress_weight for p in fr.policy_space(m, 512, 32, 16, compress=True))


@pytest.mark.slow
def test_candidates_from_offsims_lp_fit_and_include_the_anchor():
    m = get_model("opt-30b")
    c = fr.candidates(m, 512, 32, 16, k=3)
    assert 1 <= len(c) <= 3
    assert all(fr.fits(m, p, 512, 32, 16)[0] for p in c)
    assert c[0].source == "lp" and any(p.source == "anchor" for p in c)
    assert fr.candidates(get_model("llama-2-13b"), 512, 32, 16) == []


# -- Accelerate / DeepSpeed sizing ----------------------------------------------------------------------------------
def test_accelerate_and_deepspeed_batches():
    m = get_model("opt-30b")
    b16 = accelerate_ref.auto_batch(m, 512, 32, 16)
    b24 = accelerate_ref.auto_batch(m, 512, 32, 24)
    assert b16 and b24 >= b16
    assert accelerate_ref.auto_batch(m, 1984, 128, 16) < b16
    assert accelerate_ref.auto_batch(m, 512, 32, 1) is None
    # the batch's KV cache alone fits beside the reserve
    assert m.kv_bytes(b16, 544) < 16 * GiB
    d = deepspeed_ref.auto_batch(m, 512, 32, 16)
    assert d and m.kv_bytes(d, 544) + 2 * m.layer_weight_bytes() < 16 * GiB
    cfg = deepspeed_ref.ds_config(m)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and cfg["fp16"]["enabled"]
    assert z["stage3_max_live_parameters"] == 2 * m.layer_weight_bytes() // 2


def test_accelerate_ref_runs_a_tiny_model_on_the_cpu(tiny_cfg):
    for d in (TINY_OPT, TINY_LLAMA):
        path = tiny_cfg(d, d["model_type"])
        rec = accelerate_ref.run(path, 12, 4, 16, batch=2, device="cpu", warmup=False)
        assert rec["status"] == "ok", rec["reason"]
        assert rec["batch"] == 2 and rec["decode_tok_s"] > 0 and rec["prefill_tok_s"] > 0
        assert rec["system"] == "accelerate-ref"
        assert rec["host_probe_cpu_attn_ms"] > 0 and rec["host_probe_copy_GB_s"] > 0  # the host as the run started
        # each decode step's time, summing to the decode time the throughput is computed from
        assert len(rec["decode_step_ms"]) == 3 and all(ms > 0 for ms in rec["decode_step_ms"])
        assert sum(rec["decode_step_ms"]) / 1e3 == pytest.approx(rec["decode_s"], rel=0.05, abs=5e-3)


def test_accelerate_ref_cut_run_projects_its_decode(tiny_cfg):
    """--cut-gen-len: generate fewer tokens than asked and project the decode from the measured steps (a straight
    line, the measured ones as measured), the record marked projected with its measured steps; the runner passes the
    option to Accelerate and DeepSpeed only, where the generation is longer."""
    from experiments import real_throughput as rt

    assert accelerate_ref.project_decode_s([1.0, 1.0, 1.0], 7) == pytest.approx(6.0)  # flat: 6 steps of 1 s
    assert accelerate_ref.project_decode_s([1.0, 2.0, 3.0], 5) == pytest.approx(10.0)  # 1 + 2 + 3 + 4
    assert accelerate_ref.project_decode_s([2.0, 1.0, 1.0, 1.0], 3) == pytest.approx(3.0)  # more measured than asked
    path = tiny_cfg(TINY_OPT, "opt")
    rec = accelerate_ref.run(path, 12, 10, 16, batch=2, device="cpu", warmup=False, cut_gen_len=4)
    assert rec["status"] == "ok", rec["reason"]
    assert rec["projected"] and rec["measured_steps"] == 3 and rec["gen_len"] == 10 and rec["decode_tok_s"] > 0
    assert not accelerate_ref.run(path, 12, 4, 16, batch=2, device="cpu", warmup=False, cut_gen_len=8)["projected"]
    for system, cut in (("accelerate-ref", True), ("deepspeed-ref", True), ("flexgen-ref", False)):
        argv = rt.jobs_for_point(system, "opt-30b", 512, 128, 16, flexgen_k=1, cut_gen_len=32)[0]["argv"]
        assert ("--cut-gen-len" in argv) == cut
    assert "--cut-gen-len" not in rt.jobs_for_point("accelerate-ref", "opt-30b", 512, 32, 16, cut_gen_len=32)[0]["argv"]
    for bad in ("2", "0", "-5", "x"):  # refused by name, before anything runs
        with pytest.raises(SystemExit):
            rt.main(["--cut-gen-len", bad, "--dry-run"])


def test_accelerate_materialise_rebuilds_rope(tiny_cfg):
    """Meta construction leaves RoPE's inverse frequencies empty: materialise rebuilds them, so the meta-built model
    computes what a normally built one does with the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tiny_cfg(TINY_LLAMA, "llama")
    m, _ = accelerate_ref.hf_model_on_meta(path)
    accelerate_ref.materialise(m, "cpu")
    d = dict(TINY_LLAMA)
    d.pop("model_type")
    ref = LlamaForCausalLM(LlamaConfig(**d)).to(torch.float16).eval()
    ref.load_state_dict(m.state_dict())
    ids = torch.randint(4, 128, (1, 10))
    with torch.no_grad():
        a, b = m(ids).logits.float(), ref(ids).logits.float()
    assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-2)


@pytest.mark.slow
def test_deepspeed_ref_runs_zero3_on_a_tiny_model_on_the_cpu(tiny_cfg, tmp_path):
    """The ZeRO-3 path (materialise, zero.Init(module=...), initialize, generate) on DeepSpeed's CPU accelerator, in
    a subprocess (DeepSpeed's process group is global), here with ``--kernel-profile`` (its time by operator to a
    CSV, the record marked); skipped where deepspeed is not installed."""
    import os
    import subprocess

    import pandas as pd

    pytest.importorskip("deepspeed")
    path = tiny_cfg(TINY_LLAMA, "llama")
    table = tmp_path / "k.csv"
    r = subprocess.run([sys.executable, "-m", "experiments.peers.deepspeed_ref", "--model", path, "--device", "cpu",
                        "--prompt-len", "12", "--gen-len", "4", "--batch", "2", "--no-warmup",
                        "--kernel-profile", str(table)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    recs = parse_results(r.stdout)
    assert recs and recs[0]["status"] == "ok", (recs, r.stderr[-2000:])
    assert recs[0]["system"] == "deepspeed-ref" and recs[0]["decode_tok_s"] > 0
    assert recs[0]["kernel_profile"] == str(table)
    df = pd.read_csv(table, comment="#")
    assert (df["calls"] > 0).all() and "gemm" in set(df["category"])


def test_a_peer_package_missing_from_the_harness_is_an_error_not_the_peers_answer(tiny_cfg, monkeypatch, tmp_path):
    """DeepSpeed absent from the harness's environment (a broken wheel install) is an 'error', retried by the next
    call, not 'unsupported' (DeepSpeed's answer); a record written that way before is read as such an error."""
    import builtins
    import json

    from experiments import real_throughput as rt
    from experiments.peers.common import MISSING_PEER

    real_import = builtins.__import__

    def no_deepspeed(name, *a, **kw):
        if name == "deepspeed":
            raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "DS_ACCELERATOR"):
        monkeypatch.delenv(k, raising=False)  # (run sets them for its world of one)
    rec = deepspeed_ref.run(tiny_cfg(TINY_LLAMA, "llama"), 12, 4, 1.0, batch=2, warmup=False, device="cpu")
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert rec["status"] == "error" and rec["reason"].startswith(MISSING_PEER + "deepspeed"), rec
    old = {"key": "deepspeed-ref|llama-2-13b|p512|g32|b24", "status": "unsupported",
           "reason": "import deepspeed: ModuleNotFoundError: No module named 'deepspeed'"}
    other = {"key": "deepspeed-ref|x", "status": "unsupported", "reason": "import deepspeed: ImportError: no CUDA op"}
    j = tmp_path / "runs.jsonl"
    j.write_text("".join(json.dumps(r) + "\n" for r in (old, other)))
    a, b = rt.read_journal(j)
    assert a["status"] == "error" and a["reason"].startswith(MISSING_PEER) and b == other
    job = {"keys": [old["key"]]}
    assert rt.job_state(job, [a]) == (False, None)  # retried


def test_offexec_run_on_a_tiny_model_on_the_cpu(tiny_cfg, tmp_path):
    from experiments.peers.offexec_run import run_point
    from offsim.core.trace import Trace

    recs = run_point(tiny_cfg(TINY_OPT, "opt"), 16, 4, 16, ["flexgen", "static-zero"], device="cpu", max_batch=8,
                     trace_dir=str(tmp_path))
    assert [r["system"] for r in recs] == ["offexec-flexgen", "offexec-static-zero"]
    for r in recs:
        assert r["status"] == "ok", r["reason"]
        assert r["decode_tok_s"] > 0 and r["predicted_decode_tok_s"] > 0 and r["batch"] <= 8
        t = Trace.from_csv(tmp_path / r["trace"])  # the measured trace, kept for offsim validate
        assert t.meta["source"] == "offexec" and t.metrics()["decode_tok_s"] == pytest.approx(r["decode_tok_s"])


# -- the driver: grid, journal, resume --------------------------------------------------------------------------------
def test_grid_and_jobs():
    from experiments import real_throughput as rt

    pts = rt.points(rt.MODELS, rt.PROMPTS, rt.GENS, rt.BUDGETS)
    assert len(pts) == 16 and pts[0] == ("opt-30b", 512, 32, 16.0)
    j = rt.jobs_for_point("flexgen-ref", "llama-2-13b", 512, 32, 16)
    assert j[0]["argv"] is None and j[0]["record"]["status"] == "unsupported"
    j = rt.jobs_for_point("accelerate-ref", "opt-30b", 1984, 128, 24)
    assert j[0]["retry_batch"] and j[0]["argv"][:2] == ["-m", "experiments.peers.accelerate_ref"]
    assert j[0]["keys"] == ["accelerate-ref|opt-30b|p1984|g128|b24"]
    j = rt.jobs_for_point("offexec", "opt-30b", 512, 32, 16, offexec_policies=["flexgen", "tightllm"],
                          settings_cache="s.json")
    assert [x["keys"] for x in j] == [["offexec-flexgen|opt-30b|p512|g32|b16"], ["offexec-tightllm|opt-30b|p512|g32|b16"]]
    assert j[1]["argv"][-4:] == ["--policies", "tightllm", "--settings-cache", "s.json"]
    j = rt.jobs_for_point("offexec", "opt-30b", 512, 32, 16, offexec_policies=["tightllm"], trace_dir="T")
    assert j[0]["argv"][-2:] == ["--trace-dir", "T"]  # each offexec run's measured trace is kept
    pols = [fr.FlexGenPolicy(16, 3, (20, 80, 0, 100, 100, 0)).settings(),
            fr.FlexGenPolicy(8, 3, (20, 80, 0, 100, 100, 0), True).settings()]
    cache = {"flexgen-ref|opt-30b|p512|g32|b16": {"k": 3, "policies": pols}}
    j = rt.jobs_for_point("flexgen-ref", "opt-30b", 512, 32, 16, flexgen_k=1, cache=cache)
    assert len(j) == 1 and j[0]["keys"][0].endswith("gbs16x3_p20-80-0-100-100-0")
    assert "--percent" in j[0]["argv"] and "--cpu-cache-compute" not in j[0]["argv"]


def test_job_state_resume_and_oom_retry():
    from experiments import real_throughput as rt

    job = {"keys": ["accelerate-ref|opt-30b|p512|g32|b16"], "retry_batch": True}
    k = job["keys"][0]
    assert rt.job_state(job, []) == (False, None)
    assert rt.job_state(job, [{"key": k, "status": "error"}]) == (False, None)
    assert rt.job_state(job, [{"key": k, "status": "oom", "batch": 12}]) == (False, 6)
    two = [{"key": k, "status": "oom", "batch": 12}, {"key": k, "status": "oom", "batch": 6}]
    assert rt.job_state(job, two) == (False, 3)
    assert rt.job_state(job, two + [{"key": k, "status": "oom", "batch": 3}])[0]
    assert rt.job_state(job, [{"key": k, "status": "oom", "batch": 1}])[0]
    assert rt.job_state(job, [{"key": k, "status": "ok"}]) == (True, None)
    assert rt.job_state(job, [{"key": k, "status": "timeout"}]) == (True, None)
    assert rt.job_state(job, [{"key": k, "status": "timeout"}], retry=("timeout",)) == (False, None)
    multi = {"keys": ["a", "b"]}
    assert not rt.job_state(multi, [{"key": "a", "status": "ok"}])[0]
    assert rt.job_state(multi, [{"key": "a", "status": "ok"}, {"key": "b", "status": "oom"}])[0]


def _fake_job(code: str, keys):
    return {"system": keys[0].split("|")[0], "keys": keys, "argv": ["-c", code]}


def test_run_job_records_timeouts_crashes_and_kills(tmp_path):
    from experiments import real_throughput as rt

    prov = {"commit": "c0ffee", "date": "d", "machine": "m"}
    key = "accelerate-ref|opt-30b|p512|g32|b16"
    rec = {"system": "accelerate-ref", "status": "ok", "batch": 4, "decode_tok_s": 2.0}
    ok = _fake_job(f"print({(PREFIX + json.dumps(rec))!r})", [key])
    recs, cut = rt.run_job(ok, tmp_path, 30, prov, batch=4)
    assert not cut and recs[0]["status"] == "ok" and recs[0]["key"] == key and recs[0]["commit"] == "c0ffee"
    recs, cut = rt.run_job(_fake_job("import time; time.sleep(30)", [key]), tmp_path, 1, prov)
    assert cut and recs[0]["status"] == "timeout"
    recs, _ = rt.run_job(_fake_job("import sys; sys.exit(3)", [key]), tmp_path, 30, prov)
    assert recs[0]["status"] == "error" and recs[0]["model"] == "opt-30b" and recs[0]["prompt_len"] == 512
    recs, _ = rt.run_job(_fake_job("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", [key]), tmp_path, 30,
                         prov)
    assert recs[0]["status"] == "host_oom"
    # one job, several systems (offexec): records matched to keys by system, a missing one reported
    keys = ["offexec-flexgen|opt-30b|p512|g32|b16", "offexec-tightllm|opt-30b|p512|g32|b16"]
    one = {"system": "offexec-tightllm", "status": "ok"}
    recs, _ = rt.run_job(_fake_job(f"print({(PREFIX + json.dumps(one))!r})", keys), tmp_path, 30, prov)
    assert {r["key"]: r["status"] for r in recs} == {keys[1]: "ok", keys[0]: "error"}
    assert (tmp_path / "logs").is_dir()


def test_outputs_from_the_journal(tmp_path):
    from experiments import real_throughput as rt
    from offsim.core.io import read_commented_csv

    base = {"model": "opt-30b", "prompt_len": 512, "gen_len": 32, "budget_gib": 16.0, "prefill_tok_s": 5000.0,
            "total_tok_s": 10.0, "prefill_s": 1.0, "decode_s": 10.0}
    j = [{**base, "system": "offexec-flexgen", "key": "o1", "status": "ok", "batch": 48, "decode_tok_s": 40.0,
          "link_bound_decode_tok_s": 42.0},
         {**base, "system": "flexgen-ref", "key": "f1", "status": "ok", "batch": 48, "decode_tok_s": 19.5,
          "link_bound_decode_tok_s": 42.0},
         {**base, "system": "flexgen-ref", "key": "f2", "status": "ok", "batch": 32, "decode_tok_s": 12.8},
         {**base, "system": "accelerate-ref", "key": "a1", "status": "oom", "batch": 24, "reason": "CUDA OOM"},
         {**base, "system": "accelerate-ref", "key": "a1", "status": "ok", "batch": 12, "decode_tok_s": 4.0}]
    path = tmp_path / "runs.jsonl"
    rt.append_journal(path, j)
    path.write_text(path.read_text() + '{"cut by a kil')
    assert len(rt.read_journal(path)) == 5
    s = rt.write_outputs(tmp_path, rt.read_journal(path), {"commit": "abc", "date": "now"})
    assert s["rows"] == 5 and s["ok"] == 4 and s["points_with_results"] == 1
    prov, df = read_commented_csv(tmp_path / "real_throughput.csv", "csv")
    assert prov["commit"] == "abc" and list(df.columns[:9]) == list(RESULT_FIELDS[:9])
    b = rt.best(df)
    assert b.set_index("system").loc["flexgen-ref", "decode_tok_s"] == 19.5
    text = (tmp_path / "README.md").read_text()
    assert "×2.05" in text and "×10.00" in text and "CUDA OOM" in text
    assert (tmp_path / "real_throughput.png").stat().st_size > 0


def test_driver_report_and_dry_run(tmp_path, capsys):
    from experiments import real_throughput as rt

    assert rt.main(["--out", str(tmp_path), "--report"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 0
    rt.main(["--out", str(tmp_path), "--dry-run", "--only", "accelerate-ref", "deepspeed-ref", "flexgen-ref",
             "--models", "llama-2-13b", "--prompts", "512", "--gens", "32", "--budgets", "16"])
    out = capsys.readouterr().out
    assert "todo  accelerate-ref|llama-2-13b|p512|g32|b16" in out and "deepspeed_ref" in out
    key = "deepspeed-ref|llama-2-13b|p512|g32|b16"
    rt.append_journal(tmp_path / "runs.jsonl", [{"key": key, "status": "ok", "system": "deepspeed-ref"}])
    args = ["--out", str(tmp_path), "--dry-run", "--only", "deepspeed-ref", "flexgen-ref", "--models", "llama-2-13b",
            "--prompts", "512", "--gens", "32", "--budgets", "16"]
    rt.main(args)
    assert f"done  {key}" in capsys.readouterr().out
    rt.main(args + ["--rerun"])  # answered runs again; a cell answered without a run (FlexGen on a Llama) does not
    out = capsys.readouterr().out
    assert f"rerun  {key}" in out and "rerun  flexgen-ref" not in out


# -- on the GPU (each run in a subprocess: a GPU budget set in this process would cap the other GPU tests) ---------------
def _worker(args: list[str]) -> dict:
    import subprocess

    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=900)
    recs = parse_results(r.stdout)
    assert recs, r.stderr[-3000:]
    return recs[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flexgen_ref_runs_opt_125m_on_the_gpu():
    pytest.importorskip("flexgen.flex_opt")
    rec = _worker(["experiments.peers.flexgen_ref", "--model", "opt-125m", "--prompt-len", "32", "--gen-len", "8",
                   "--budget-gib", "4", "--gpu-batch-size", "4", "--num-gpu-batches", "2",
                   "--percent", "50", "50", "0", "100", "100", "0"])
    assert rec["status"] == "ok", rec["reason"]
    assert rec["decode_tok_s"] > 0 and rec["peak_gpu_bytes"] <= 4 * GiB and not rec["projected"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_accelerate_ref_offloads_opt_1_3b_on_the_gpu():
    pytest.importorskip("accelerate")
    rec = _worker(["experiments.peers.accelerate_ref", "--model", "opt-1.3b", "--prompt-len", "32", "--gen-len", "8",
                   "--budget-gib", "2", "--batch", "2"])
    assert rec["status"] == "ok", rec["reason"]
    assert json.loads(rec["settings"]).get("device_map_tiers", {}).get("cpu", 0) > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_report_predicts_each_peer_run_with_its_ref_policy():
    """The report's prediction of a peer run is that system's ``*-ref`` policy with the run's block and settings on
    the H200 profile; offexec's own runs (which record their prediction) and failed runs get none."""
    from experiments.real_throughput import predict_peer

    base = {"model": "opt-1.3b", "prompt_len": 64, "gen_len": 4, "budget_gib": 4.0, "status": "ok"}
    ds = predict_peer({**base, "system": "deepspeed-ref", "batch": 4, "gpu_batch_size": float("nan"),
                       "num_gpu_batches": float("nan"), "settings": "{}"})
    assert ds["policy"] == "static-zero-ref" and ds["decode_tok_s"] > 0
    fg = predict_peer({**base, "system": "flexgen-ref", "batch": 8, "gpu_batch_size": 4, "num_gpu_batches": 2,
                       "settings": '{"percent": [50, 50, 0, 100, 100, 0], "cpu_cache_compute": true}'})
    assert fg["policy"] == "flexgen-ref" and fg["total_tok_s"] > 0
    assert predict_peer({**base, "system": "offexec-flexgen", "batch": 8}) is None
    assert predict_peer({**base, "system": "deepspeed-ref", "status": "timeout", "batch": 4}) is None


def test_report_predicts_an_accelerate_run_with_the_layers_its_device_map_kept_on_the_gpu():
    """An Accelerate run is priced with the decoder layers its device map put on the GPU: the record's
    ``gpu_layers``, else its GPU weight bytes in whole layers; more layers on the GPU, less streamed, a faster
    decode; a record with neither gets no prediction. The host columns show a run's probe and pageable rate, '–'
    without them."""
    from offsim import get_model
    from offsim.core import footprint as fp
    from experiments.real_throughput import _host_state, accelerate_gpu_layers, predict_peer

    W = fp.layer_weight_bytes(get_model("opt-1.3b"))
    base = {"system": "accelerate-ref", "model": "opt-1.3b", "prompt_len": 64, "gen_len": 4, "budget_gib": 4.0,
            "status": "ok", "batch": 4, "gpu_batch_size": 4, "num_gpu_batches": 1}
    assert accelerate_gpu_layers(base, {"gpu_layers": 7, "gpu_weight_bytes": 0}) == 7
    assert accelerate_gpu_layers(base, {"gpu_weight_bytes": 3 * W + W // 2}) == 3
    none = predict_peer({**base, "settings": json.dumps({"gpu_layers": 0})})
    half = predict_peer({**base, "settings": json.dumps({"gpu_layers": 12})})
    assert none["policy"] == half["policy"] == "static-accelerate-ref"
    assert half["decode_tok_s"] > 1.5 * none["decode_tok_s"]
    assert predict_peer({**base, "settings": "{}"}) is None
    assert _host_state({**base, "settings": "{}"}) == ("–", "–")
    probe, rate = _host_state({**base, "host_probe_cpu_attn_ms": 2.5,
                               "settings": json.dumps({"h2d_pageable_bytes_per_s": 7.2e9})})
    assert probe.startswith("2.50 (") and rate.startswith("7.2 (")


def test_real_throughput_report_shows_the_grids_coverage():
    """The report's coverage table: every point of the issue's grid by system -- the best decode tok/s measured,
    'n/a' for FlexGen on a Llama, '–' where nothing answered -- and how many cells are filled."""
    import pandas as pd

    from experiments import real_throughput as rt

    df = pd.DataFrame([
        {"system": "offexec-tightllm", "model": "opt-30b", "prompt_len": 512, "gen_len": 32, "budget_gib": 16.0,
         "status": "ok", "decode_tok_s": 41.4},
        {"system": "offexec-flexgen", "model": "opt-30b", "prompt_len": 512, "gen_len": 32, "budget_gib": 16.0,
         "status": "ok", "decode_tok_s": 34.0},
        {"system": "deepspeed-ref", "model": "opt-30b", "prompt_len": 512, "gen_len": 32, "budget_gib": 16.0,
         "status": "timeout", "decode_tok_s": float("nan")}])
    lines = rt.coverage_lines(df)
    row = next(x for x in lines if x.startswith("| opt-30b | 512 | 32 | 16 |"))
    assert row.split(" | ")[4:6] == ["41.40", "–"]  # offexec's best fp16; no 4-bit run
    assert row.endswith("| – |")  # DeepSpeed timed out: not measured
    assert all("| n/a | n/a |" in x for x in lines if x.startswith("| llama-2-13b |"))
    assert lines[-1] == "1 of 80 cells measured."


def test_a_journal_holds_one_gpus_runs(tmp_path, monkeypatch, capsys):
    """real_throughput refuses to add a GPU's runs to a journal of another GPU's (a lent H100 for the H200), before
    any run starts; records from before the field existed count as the H200's; with no GPU (a dry run here) nothing
    is refused."""
    from experiments import real_throughput as rt

    jpath = tmp_path / "runs.jsonl"
    rt.append_journal(jpath, [{"system": "deepspeed-ref", "status": "ok"}])  # (no gpu: a legacy record)
    rt.check_same_gpu(rt.read_journal(jpath), "NVIDIA H200", jpath)
    rt.check_same_gpu(rt.read_journal(jpath), "", jpath)
    with pytest.raises(SystemExit) as e:
        rt.check_same_gpu(rt.read_journal(jpath), "NVIDIA H100 80GB HBM3", jpath)
    assert "holds runs on NVIDIA H200" in str(e.value) and "give --out another folder" in str(e.value)
    monkeypatch.setattr(rt, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit):
        rt.main(["--out", str(tmp_path), "--only", "deepspeed-ref", "--models", "opt-30b", "--prompts", "512",
                 "--gens", "32", "--budgets", "16"])
    assert jpath.read_text().count("\n") == 1  # nothing appended


def test_control_table_sets_each_hand_made_run_beside_offsims_prediction(tmp_path, capsys):
    """experiments.peers.control_table: the PEER_RESULT records of a folder's logs, by budget then batch, each with
    its decode steps' spread, its allocator calls and offsim's prediction of the same run (static-zero-ref for
    DeepSpeed); the README's generated block is rewritten, the prose around it kept."""
    from experiments.peers import control_table as CT
    base = {"system": "deepspeed-ref", "model": "llama-2-13b", "prompt_len": 512, "gen_len": 32, "status": "ok",
            "prefill_tok_s": 17000.0, "peak_gpu_bytes": 20 * 2 ** 30}
    for name, batch, budget, dec in (("b32_g24", 32, 24, 41.1), ("b24_g24", 24, 24, 36.0), ("b32_g32", 32, 32, 50.0)):
        rec = dict(base, batch=batch, budget_gib=float(budget), decode_tok_s=dec, gpu_batch_size=batch,
                   num_gpu_batches=1, decode_step_ms=[700.0 + i for i in range(31)], gen_num_device_alloc=5,
                   gen_num_device_free=3, gen_num_alloc_retries=1)
        (tmp_path / f"{name}.log").write_text("noise\n" + PREFIX + json.dumps(rec) + "\n")
    (tmp_path / "README.md").write_text("# control\n\nprose kept\n")
    assert CT.main([str(tmp_path), "--write"]) == 0
    text = (tmp_path / "README.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| b")]
    assert [r.split(" | ")[0] for r in rows] == ["| b24_g24", "| b32_g24", "| b32_g32"]
    assert "prose kept" in text and "| 715 (702–728) |" in rows[0] and "| 5 / 3 | 1 |" in rows[0]
    # offsim's decode and its error against the record's own decode
    cells = rows[1].split(" | ")
    assert float(cells[8]) > 0 and abs(float(cells[9].rstrip("%")) / 100 - (float(cells[8]) / 41.1 - 1)) < 2e-3
    assert CT.main([str(tmp_path / "none")]) == 2
