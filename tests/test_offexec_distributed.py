"""offexec runs a pipeline plan with one process per stage (issue 18): torch.distributed with the gloo backend on the
CPU, tiny OPT and Llama models cut into 2 and 3 stages, greedy tokens and logits equal to transformers', and the
ranks' traces merged into one trace of the whole plan in offsim's schema (each op with its device). The GPU path
(NCCL, one GPU per rank) is marked ``gpu``."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offexec.distributed import merge_traces, stage_plan, stage_weights
from offexec.executor import run_plan
from offexec.memory import ExecError
from offexec.testing import hf_generate, tiny_hf
from offexec.weights import from_state_dict
from offsim import Workload, build_plan, get_hardware, get_model, simulate
from offsim.core.trace import COLUMNS

HW = get_hardware("h200")
PROMPT, GEN, LAYERS = 8, 5, 4
# (family, settings, gpu_batch_size, num_gpu_batches): every tier the single-GPU tests cover, per stage
CASES = [
    ("opt", {"percent": (20, 80, 0, 100, 100, 0)}, 2, 3),  # KV on the host, GPU attention, weights streamed
    ("opt", {"percent": (50, 25, 25, 25, 0, 100)}, 2, 2),  # every tier, activations parked on the host
    ("llama", {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True}, 2, 2),  # CPU attention, disk heads
    ("llama", {"percent": (100, 0, 100, 0, 100, 0), "sublayer": False, "micro_batches": 1}, 3, 2),
    # TightLLM's pipeline: each stage recomputes N_r tokens of its layers, KV on the host (and on disk)
    ("opt", {"policy": "tightllm", "percent": (20, 80, 0, 100, 100, 0), "kv_solver": "exact"}, 2, 3),
    ("llama", {"policy": "tightllm", "percent": (0, 50, 0, 50, 100, 0), "kv_solver": "exact"}, 2, 2),
]
# a mixed-length block (docs/jobs.md §4): left-padded prompts, each request's tokens those of it alone
MIXED = ("opt", {"percent": (20, 80, 0, 100, 100, 0), "mixed": True}, 2, 3)
PROMPT_LENS, GEN_LENS = (8, 3, 6, 2, 5, 5), (5, 5, 2, 4, 5, 1)


def _prompts(n, vocab):
    return torch.randint(0, vocab, (n, PROMPT), generator=torch.Generator().manual_seed(7))


def _worker(rank, world, init, out_dir, cases):
    torch.set_num_threads(1)  # (ranks share the machine's cores)
    from offexec.distributed import run_pipeline

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        models = {}
        for c, (family, settings, gbs, nb) in enumerate(cases):
            if family not in models:
                hf, spec = tiny_hf(family, seed=11, layers=LAYERS)
                models[family] = (spec, from_state_dict(spec, hf.state_dict()))
            spec, w = models[family]
            settings = dict(settings)
            wl = Workload(PROMPT, GEN, gbs, nb, prompt_lens=PROMPT_LENS, gen_lens=GEN_LENS) \
                if settings.pop("mixed", False) else Workload(PROMPT, GEN, gbs, nb)
            policy = settings.pop("policy", "flexgen")
            plan = build_plan(policy, spec, HW, wl, {**settings, "num_stages": world})
            res = run_pipeline(plan, w, "cpu", _prompts(wl.num_prompts, spec.vocab_size), record_logits=True,
                               disk_dir=out_dir)
            if rank == 0:
                torch.save({"tokens": res.tokens, "logits": res.logits, "df": res.trace.df, "meta": res.trace.meta,
                            "peaks": res.trace.peak_bytes, "plan": plan.to_dict()}, os.path.join(out_dir, f"{c}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world, tmp_path, cases):
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/rendezvous", str(tmp_path), cases), nprocs=world)
    return [torch.load(tmp_path / f"{c}.pt", weights_only=False) for c in range(len(cases))]


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_tokens_equal_transformers(world, tmp_path):
    cases = CASES + [MIXED] if world == 2 else CASES[1:]  # (3 ranks: fewer cases, the machine is small)
    results = _spawn(world, tmp_path, cases)
    refs = {}
    for (family, settings, gbs, nb), r in zip(cases, results):
        if family not in refs:
            hf, spec = tiny_hf(family, seed=11, layers=LAYERS)
            refs[family] = (hf, spec, hf_generate(hf, _prompts(6, spec.vocab_size), GEN))
        hf, spec, (tok, logits) = refs[family]
        n = gbs * nb
        if settings.get("mixed"):  # each request alone, unpadded: its first gen_lens tokens
            prompts = _prompts(6, spec.vocab_size)
            for i, (p, g) in enumerate(zip(PROMPT_LENS, GEN_LENS)):
                alone = hf_generate(hf, prompts[i:i + 1, :p], g)[0][0]
                np.testing.assert_array_equal(r["tokens"][i, :g], alone.numpy(), err_msg=f"request {i}")
            continue
        np.testing.assert_array_equal(r["tokens"], tok[:n].numpy())
        assert len(r["logits"]) == GEN * nb
        for step, b, lg in r["logits"]:
            assert (lg - logits[step, b * gbs:(b + 1) * gbs]).abs().max().item() <= 1e-4
        # one trace of the whole plan: offsim's columns and every op with its device, as offsim's own trace
        from offsim import Plan
        plan = Plan.from_dict(r["plan"])
        df = r["df"]
        assert list(df.columns) == COLUMNS + ["device"] and len(df) == len(plan.ops)
        pred = simulate(plan, HW).df
        assert (df[["op_id", "kind", "stream", "step", "layer", "batch", "device"]].to_numpy() ==
                pred[["op_id", "kind", "stream", "step", "layer", "batch", "device"]].to_numpy()).all()
        assert set(df["device"]) == set(range(world)) and (df["end_s"] >= df["start_s"]).all()
        assert r["meta"]["source"] == "offexec" and r["meta"]["num_devices"] == world
        assert {f"gpu{d}" for d in range(world)} <= set(r["peaks"])
        # a receive ends after its send starts (times from one barrier)
        p2p = df[df["kind"] == "p2p"]
        assert len(p2p) and (p2p["end_s"] >= p2p["start_s"]).all()


def test_stage_plans_partition_the_plan():
    hf, spec = tiny_hf("opt", seed=11, layers=5)
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, 3, 2, 2),
                      {"percent": (20, 80, 0, 100, 100, 0), "num_stages": 3})
    seen = {}
    for r in range(3):
        sp = stage_plan(plan, r)
        lo, hi = plan.stages[r]["layers"]
        assert sp.layers == (lo, hi) and sp.plan.model.num_layers == hi - lo
        assert sp.plan.capacity["gpu"] == plan.stages[r]["gpu_capacity"] and not sp.plan.stages
        for op, oid in zip(sp.plan.ops, sp.orig_ids):
            seen.setdefault(oid, []).append(r)
            orig = plan.ops[oid]
            assert op.kind == orig.kind and op.batch == orig.batch and op.step == orig.step
            if op.kind != "p2p" and 0 <= orig.layer < spec.num_layers:
                assert op.layer == orig.layer - lo
            assert all(d < op.id for d in op.deps)
            if op.kind == "p2p" and orig.peer == r:
                assert op.deps == ()  # a receive waits for its message only
    for op in plan.ops:  # every op on exactly its GPU; a p2p op on its sender and its receiver
        assert sorted(seen[op.id]) == (sorted([op.device, op.peer]) if op.kind == "p2p" else [op.device])
    # the stage's weights are its layers of the model's
    w = from_state_dict(spec, hf.state_dict())
    sw = stage_weights(w, 2, 4)
    assert torch.equal(sw.layers, w.layers[2:4]) and sw.spec.num_layers == 2
    with pytest.raises(ExecError, match="3 stages"):
        stage_plan(plan, 3)


def test_single_process_run_refuses_a_pipeline_in_one_line():
    hf, spec = tiny_hf("opt", seed=11, layers=LAYERS)
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, 2, 2, 2), {"num_stages": 2})
    with pytest.raises(ExecError, match="torchrun --nproc-per-node 2 -m offexec.distributed") as e:
        run_plan(plan, from_state_dict(spec, hf.state_dict()), "cpu")
    assert len(str(e.value).splitlines()) == 1


def test_merge_refuses_missing_ranks():
    hf, spec = tiny_hf("opt", seed=11, layers=LAYERS)
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, 2, 2, 2), {"num_stages": 2})
    sp = stage_plan(plan, 0)
    n = len(sp.plan.ops)
    with pytest.raises(ExecError, match="op times missing"):
        merge_traces(plan, [(sp.orig_ids, np.zeros(n), np.ones(n), {})], {})


@pytest.mark.gpu
def test_pipeline_on_two_gpus_with_nccl(tmp_path):
    """Two GPUs, NCCL: the same tokens as transformers (fp32 tiny model, one rank per GPU)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    mp.spawn(_gpu_worker, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2)
    r = torch.load(tmp_path / "gpu.pt", weights_only=False)
    hf, spec = tiny_hf("opt", seed=11, layers=LAYERS)
    tok, _ = hf_generate(hf, _prompts(6, spec.vocab_size), GEN)
    np.testing.assert_array_equal(r["tokens"], tok.numpy())


def _gpu_worker(rank, world, init, out_dir):
    from offexec.distributed import init_process_group, run_pipeline

    device = init_process_group("cuda", rank, world, init)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        hf, spec = tiny_hf("opt", seed=11, layers=LAYERS)
        w = from_state_dict(spec, hf.state_dict())
        plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 3),
                          {"percent": (20, 80, 0, 100, 100, 0), "num_stages": world})
        res = run_pipeline(plan, w, device, _prompts(6, spec.vocab_size), disk_dir=out_dir)
        if rank == 0:
            torch.save({"tokens": res.tokens}, os.path.join(out_dir, "gpu.pt"))
    finally:
        dist.destroy_process_group()


def test_entry_point_outside_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    from offexec.distributed import main

    hf, spec = tiny_hf("opt", seed=11, layers=LAYERS)
    f = tmp_path / "pp.json"
    build_plan("flexgen", spec, HW, Workload(PROMPT, 2, 2, 2), {"num_stages": 2}).save(f)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--plan", str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "torchrun --nproc-per-node 2 -m offexec.distributed" in err
    single = tmp_path / "one.json"
    build_plan("flexgen", spec, HW, Workload(PROMPT, 2, 2, 2), {}).save(single)
    assert main(["--plan", str(single), "--device", "cpu"]) == 2
    assert "no pipeline stages" in capsys.readouterr().err
    # outputs that cannot be written are refused before the run (they failed after it, the results lost)
    assert main(["--plan", str(f), "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
    # torchrun's environment, incomplete: one line, not init_process_group's traceback
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main(["--plan", str(f), "--device", "cpu"]) == 2
    assert "WORLD_SIZE must be a number" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(["--plan", str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "launch with torchrun" in err


def test_stage_weights_seeded_or_loaded_per_stage(tmp_path):
    from offexec.weights import load_checkpoint, random_weights

    hf, spec = tiny_hf("llama", seed=11, layers=LAYERS)
    full = random_weights(spec, seed=3, progress=False)
    part = random_weights(spec, seed=3, progress=False, layers=(1, 3))
    assert part.spec.num_layers == 2 and torch.equal(part.layers, full.layers[1:3])
    assert all(torch.equal(a, b) for a, b in zip(part.emb.fields().values(), full.emb.fields().values())
               if a is not None)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ck = load_checkpoint(tmp_path, spec, progress=False, layers=(2, 4))
    ref = from_state_dict(spec, hf.state_dict())
    assert torch.equal(ck.layers, ref.layers[2:4])
    with pytest.raises(ExecError, match="not a range"):
        random_weights(spec, layers=(3, 9), progress=False)


def test_torchrun_launcher_on_the_cpu(tmp_path):
    import shutil
    import subprocess
    import sys

    from offsim.core.trace import Trace

    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun")
    _, spec = tiny_hf("opt", seed=11, layers=LAYERS)
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, 3, 2, 2),
                      {"percent": (20, 80, 0, 100, 100, 0), "num_stages": 2})
    plan.save(tmp_path / "pp.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # (a session of its own: on a timeout the launcher and both ranks are ended together)
    p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "offexec.distributed",
                          "--plan", str(tmp_path / "pp.json"), "--device", "cpu", "--trace", str(tmp_path / "t.csv"),
                          "--disk-dir", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        raise
    assert p.returncode == 0, err[-2000:]
    assert "flexgen on 2 GPUs: prefill" in out
    t = Trace.from_csv(tmp_path / "t.csv")
    assert len(t.df) == len(plan.ops) and set(t.df["device"]) == {0, 1} and t.meta["num_devices"] == 2


def test_each_stage_of_a_streamed_pipeline_binds_within_offsims_stage_budget():
    """The memory contract per GPU: OPT-30B over 2 stages of 16 GiB, weights 40 % on the GPU, 8 batches in 2
    micro-batch groups, each group reloading a layer's streamed bytes. The executor's binder once kept one slot per
    (step, layer) across both groups' loads, so every layer's slot stayed live for the whole step: 24 MLP slots, 32 GiB
    needed where offsim planned 15.6 (the first two-GPU run on the H200 was refused). Each reload now takes a fresh
    slot: two live, and each rank's bytes within the stage's budget."""
    from offexec import model as M
    from offexec.distributed import stage_plan
    from offexec.executor import gpu_need
    from offexec.program import bind
    from offsim import PlanError, Workload, build_plan, get_hardware, get_model
    from offsim.core import footprint as fp

    m = get_model("opt-30b")
    hw = get_hardware("h200", gpu_mem_gb=16)
    plan = build_plan("flexgen", m, hw, Workload(512, 4, 16, 8),
                      {"percent": (40, 60, 0, 100, 100, 0), "num_stages": 2})
    for r, st in enumerate(plan.stages):
        sp = stage_plan(plan, r).plan
        prog = bind(sp, M.layer_layout(sp.model), rank=r)
        assert prog.pool_peak["wslot_mlp"] <= 2
        need = gpu_need(prog, sp)
        assert sum(need.values()) <= st["gpu_capacity"]
        # the sender holds its sends in flight (offexec.distributed.StageComm); the last stage sends only tokens
        assert need.get("p2p sends in flight", 0) == (fp.p2p_send_bytes(m, plan.workload) if r == 0 else 0)
    # offsim's per-stage check counts the same bytes: at 41 % of the weights stage 0 fits only without them
    with pytest.raises(PlanError, match="stage 0 .*does not fit"):
        build_plan("flexgen", m, hw, Workload(512, 4, 16, 8), {"percent": (41, 59, 0, 100, 100, 0), "num_stages": 2})


def test_pipeline_host_memory_is_checked_for_all_stages_together(monkeypatch, tmp_path, capsys):
    """The ranks of one host share its memory: a plan whose stages each fit but together do not is refused from
    arithmetic in one line, before the process group or any weight (the 16 x 8 OPT-30B plan's 146 GiB of weights
    and host KV were SIGKILLed by a 125 GiB machine's kernel in the one-GPU rehearsal)."""
    from offexec import executor as E
    from offexec import model as M
    from offexec.distributed import check_pipeline, main
    from offexec.program import bind

    m = get_model("opt-30b")
    plan = build_plan("flexgen", m, get_hardware("h200", gpu_mem_gb=16), Workload(512, 4, 16, 8),
                      {"percent": (40, 60, 0, 100, 100, 0), "num_stages": 2})
    per_stage = []
    for r in range(2):
        sp = stage_plan(plan, r).plan
        per_stage.append(sum(E.host_need(bind(sp, M.layer_layout(sp.model), r), sp).values()))
    # room for either stage alone, not for both
    monkeypatch.setattr(E, "_meminfo_available_bytes", lambda: max(per_stage) + (1 << 30))
    with pytest.raises(ExecError, match=r"the plan \(its 2 stages together\) needs .* GiB of host memory"):
        check_pipeline(plan, "cpu")
    monkeypatch.setattr(E, "_meminfo_available_bytes", lambda: sum(per_stage) + (1 << 30))
    assert len(check_pipeline(plan, "cpu")) == 2
    # the launcher refuses before init_process_group: one line, exit 2
    monkeypatch.setattr(E, "_meminfo_available_bytes", lambda: max(per_stage))
    f = tmp_path / "pp.json.gz"
    plan.save(f)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--plan", str(f), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stages together" in err and not dist.is_initialized()
    if not torch.cuda.is_available():  # asked for CUDA where there is none: one line too, not a traceback
        assert main(["--plan", str(f), "--device", "cuda"]) == 2
        assert "no CUDA device is available" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_multi_gpu_profile_measures_the_peer_link_and_the_shared_host_links():
    """``offexec profile`` on a host with two GPUs: a GPU-to-GPU rate and each link's share under concurrency."""
    from offexec.profile import profile_multi_gpu

    mg = profile_multi_gpu(64 << 20, reps=3)
    assert mg["gpu_link_bytes_per_s"] > 1e9 and 0 < mg["link_concurrent_fraction"] <= 1


def test_one_gpu_rehearsal_moves_messages_through_host_memory(monkeypatch):
    """--one-gpu (every rank on GPU 0, gloo): a send hands gloo a host copy of the tensor, a receive lands in a host
    buffer and is copied into the rank's own tensor (here a 'meta' tensor stands for a GPU one: no GPU in CI);
    without it the tensors go to torch.distributed as they are."""
    from offexec import distributed as D

    seen = []

    class Work:
        def wait(self):
            pass

    def isend(t, dst, tag):
        seen.append(("send", t.device.type, dst, tag))
        return Work()

    def recv(t, src, tag):
        seen.append(("recv", t.device.type, src, tag))
        t.fill_(3.0)

    monkeypatch.setattr(D.dist, "isend", isend)
    monkeypatch.setattr(D.dist, "recv", recv)
    op = type("Op", (), {"id": 0, "peer": 1, "device": 0})()
    comm = D.StageComm(1, [41], via_host=True)
    out = torch.empty(4, device="meta")
    comm.recv(op, out)
    comm.send(op, torch.zeros(4))
    assert seen == [("recv", "cpu", 0, 41), ("send", "cpu", 1, 41)]
    seen.clear()
    plain = D.StageComm(1, [41])
    plain.recv(op, out)
    assert seen == [("recv", "meta", 0, 41)]


def test_setup_error_after_joining_leaves_the_process_group(tmp_path, capsys, monkeypatch):
    """An error after the rank joined its group (here a missing checkpoint) is one line, exit 2, and the group is
    left (destroyed), as a clean exit leaves it."""
    import offexec.distributed as D

    hf, spec = tiny_hf("opt", seed=11, layers=LAYERS)
    f = tmp_path / "pp.json"
    build_plan("flexgen", spec, HW, Workload(PROMPT, 2, 2, 2), {"num_stages": 2}).save(f)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    # a group of one on a file store stands in for torchrun's two ranks (the error comes before any message)
    monkeypatch.setattr(D, "init_process_group", lambda device, **kw: (dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1), "cpu")[1])
    assert D.main(["--plan", str(f), "--device", "cpu", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing" in err
    assert not dist.is_initialized()
