"""Pipeline parallelism in offsim (issue 18): FlexGen's layers split into stages, one GPU each, hidden states passed
GPU to GPU, micro-batches flowing through the stages. Single-GPU plans are untouched (ops, JSON, fingerprints); a
plan with stages round-trips, validates per GPU, simulates with per-GPU streams and memory and a shared disk, and is
refused per stage, from arithmetic, when a stage does not fit its GPU."""

import pytest

from offsim import Plan, PlanError, Workload, build_plan, get_hardware, get_model, simulate
from offsim.cli import main
from offsim.core import costmodel
from offsim.core.errors import OffsimError
from offsim.core.plan import Op
from offsim.core.sim import simulate_simpy
from offsim.policies.schedule import balanced_stages

H200 = get_hardware("h200")
OFFLOAD = {"percent": (20, 80, 0, 100, 100, 0)}  # weights mostly and KV wholly on the host


def _tiny(layers=4, family="opt"):
    kw = dict(num_kv_heads=4) if family == "opt" else dict(num_kv_heads=2, tie_word_embeddings=False)
    from offsim.core.specs import ModelSpec
    return ModelSpec(name=f"tiny-{family}-{layers}", family=family, num_layers=layers, d_model=64, num_heads=4,
                     head_dim=16, ffn_dim=128, vocab_size=128, max_positions=64, **kw)


def _plan(model, stages, wl=Workload(8, 4, 2, 2), hw=H200, **st):
    return build_plan("flexgen", model, hw, wl, {**OFFLOAD, **st, "num_stages": stages})


def test_balanced_stages_and_chosen_layers():
    assert balanced_stages(10, 3) == ((0, 4), (4, 7), (7, 10))
    assert balanced_stages(10, 2, (3, 7)) == ((0, 3), (3, 10))
    for bad, msg in (((3, 6), "summing"), ((0, 10), "positive"), ((10,), "2 positive")):
        with pytest.raises(OffsimError, match=msg):
            balanced_stages(10, 2, bad)
    with pytest.raises(OffsimError, match="exceeds the model's 4 layers"):
        balanced_stages(4, 5)


def test_one_stage_is_the_single_gpu_plan_exactly():
    m = _tiny()
    wl = Workload(8, 4, 2, 3)
    for st in (OFFLOAD, {"percent": (50, 25, 25, 25, 0, 100)}, {"percent": (0, 50, 0, 50, 100, 0),
                                                                   "cpu_attention": True}):
        a = build_plan("flexgen", m, H200, wl, st)
        b = build_plan("flexgen", m, H200, wl, {**st, "num_stages": 1})
        assert a.ops == b.ops and a.fingerprint() == b.fingerprint() and a.to_dict() == b.to_dict()
        assert "num_stages" not in a.settings and not a.stages and "device" not in a.to_dict()["op_fields"]


@pytest.mark.parametrize("settings", [OFFLOAD, {"percent": (50, 25, 25, 25, 0, 100)},
                                      {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True},
                                      {"percent": (20, 80, 0, 100, 100, 0), "sublayer": False, "micro_batches": 1}])
@pytest.mark.parametrize("stages", [2, 3])
def test_stage_plan_structure(settings, stages):
    m = _tiny(5)
    wl = Workload(8, 4, 2, 3)
    plan = _plan(m, stages, wl, **settings)
    ranges = balanced_stages(5, stages)
    assert [tuple(s["layers"]) for s in plan.stages] == list(ranges)
    # every op runs on the GPU of its layer; the embedding on the first, the head on the last
    for op in plan.ops:
        if op.kind in ("compute", "h2d", "d2h") and op.layer >= 0:
            assert op.device == plan.device_of_layer(op.layer), op.describe()
        if op.kind == "compute" and op.part == "embed":
            assert op.device == 0
        if op.kind == "compute" and op.part == "head":
            assert op.device == stages - 1
    # hidden states cross each stage boundary once per (step, batch); token ids go back from the last GPU to the
    # first for every decode step
    p2p = [op for op in plan.ops if op.kind == "p2p"]
    hidden = [op for op in p2p if op.tensor == "hidden"]
    token = [op for op in p2p if op.tensor == "token"]
    steps, nb = wl.gen_len, wl.num_gpu_batches
    assert len(hidden) == (stages - 1) * steps * nb
    assert len(token) == (steps - 1) * nb
    assert all(op.peer == op.device + 1 for op in hidden)
    assert all(op.device == stages - 1 and op.peer == 0 for op in token)
    assert all(op.nbytes == 8 * wl.gpu_batch_size * (op.hi - op.lo) for op in token)  # int64 ids
    for op in hidden:  # the receiving layer is the first of the peer's stage
        assert op.layer == ranges[op.peer][0] and op.stream == "p2p"
    # micro-batch groups: a stage's weights stream once per group and step
    groups = settings.get("micro_batches") or min(stages, nb)
    loads = [op for op in plan.ops if op.kind == "h2d" and op.tensor == "weight" and op.layer == 0]
    single = build_plan("flexgen", m, H200, wl, settings)
    single_loads = [op for op in single.ops if op.kind == "h2d" and op.tensor == "weight" and op.layer == 0]
    assert len(loads) == groups * len(single_loads)
    # the same compute as one GPU, moved
    key = lambda o: (o.step, o.layer, o.batch, o.part, o.q_tokens, o.ctx_tokens)  # noqa: E731
    assert sorted(map(key, (o for o in plan.ops if o.kind == "compute"))) == \
        sorted(map(key, (o for o in single.ops if o.kind == "compute")))


def test_stage_plan_json_roundtrip_and_fingerprint(tmp_path):
    plan = _plan(_tiny(), 2)
    f = tmp_path / "plan.json"
    plan.save(f)
    back = Plan.load(f).validate()
    assert back == plan and back.fingerprint() == plan.fingerprint()
    assert back.to_dict()["op_fields"][-2:] == ["device", "peer"]
    assert back.fingerprint() != build_plan("flexgen", _tiny(), H200, Workload(8, 4, 2, 2), OFFLOAD).fingerprint()
    # the stages are part of what the plan does
    other = _plan(_tiny(), 2, stage_layers=[1, 3])
    assert other.fingerprint() != plan.fingerprint()


def _replace(plan, i, **changes):
    op = plan.ops[i]
    kw = {**op.__dict__, **changes}
    base = {k: kw.pop(k) for k in ("id", "kind", "deps", "phase", "step", "layer", "batch", "stream")}
    plan.ops[i] = Op(**base, **kw)
    return plan


@pytest.mark.parametrize("rule,mutate", [
    ("device must be in", lambda p: _replace(p, 0, device=5)),
    ("needs a peer device", lambda p: _replace(p, next(i for i, o in enumerate(p.ops) if o.kind == "p2p"),
                                               peer=0, device=0)),
    ("moves 'hidden' or 'token'", lambda p: _replace(p, next(i for i, o in enumerate(p.ops) if o.kind == "p2p"),
                                                     tensor="kv")),
    ("must tile layers", lambda p: p.stages.__setitem__(1, {**p.stages[1], "layers": [3, 4]}) or p),
    ("cover layers", lambda p: p.stages.__setitem__(1, {**p.stages[1], "layers": [2, 3]}) or p),
    ("resident GPU bytes", lambda p: p.stages.__setitem__(0, {**p.stages[0], "gpu_resident": 10 ** 15}) or p),
    ("GPU 1's|device 1", lambda p: _replace(p, next(i for i, o in enumerate(p.ops) if o.device == 1 and
                                                         o.kind == "compute"), alloc=(p.stages[1]["gpu_capacity"], 0, 0))),
])
def test_stage_plan_validate_rules(rule, mutate):
    plan = mutate(_plan(_tiny(), 2))
    with pytest.raises(PlanError, match=rule):
        plan.validate()


def test_gpu_memory_is_per_device():
    # a compute op of GPU 1 that allocates GPU 0's remaining room fits GPU 1 (its own budget), and the plan's
    # validate counts it there: each GPU against its own capacity
    plan = _plan(_tiny(), 2)
    i = next(i for i, o in enumerate(plan.ops) if o.device == 1 and o.kind == "compute")
    room = plan.stages[1]["gpu_capacity"] - plan.stages[1]["gpu_resident"] - 10 ** 9
    _replace(plan, i, alloc=(room, 0, 0), free=(room, 0, 0))
    plan.validate()
    t = simulate(plan, H200)
    assert t.peak_bytes["gpu1"] >= plan.stages[1]["gpu_resident"] + room > t.peak_bytes["gpu0"]
    assert t.peak_bytes["gpu"] == t.peak_bytes["gpu1"]


def _intervals(df):
    return sorted(zip(df["start_s"], df["end_s"]))


def _no_overlap(df) -> bool:
    iv = _intervals(df)
    return all(a[1] <= b[0] + 1e-12 for a, b in zip(iv, iv[1:]))


@pytest.mark.parametrize("settings", [OFFLOAD, {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True},
                                      {"percent": (50, 25, 25, 25, 0, 100)}])
def test_simulated_streams_are_per_gpu_and_host_streams_shared(settings):
    m = get_model("opt-1.3b")
    plan = _plan(m, 2, Workload(64, 3, 4, 2), **settings)
    t = simulate(plan, H200)
    df = t.df
    assert set(df["device"]) == {0, 1}
    assert (df[df["kind"] == "p2p"]["stream"] == "p2p").all()
    # each GPU's compute and h2d streams run one op at a time, but the two GPUs' streams overlap each other
    for s in ("compute", "h2d"):
        for d in (0, 1):
            assert _no_overlap(df[(df["stream"] == s) & (df["device"] == d)])
    assert not _no_overlap(df[df["stream"] == "h2d"])
    # the disk and the host CPU are one for both GPUs
    for s in ("disk", "cpu"):
        if (df["stream"] == s).any():
            assert _no_overlap(df[df["stream"] == s])
    # dependencies hold across devices: every op starts after the ops it depends on end
    end = df["end_s"].to_numpy()
    for op in plan.ops:
        for d in op.deps:
            assert df["start_s"].iat[op.id] >= end[d] - 1e-12
    # per-GPU peaks within each GPU's budget; the metrics report them
    mt = t.metrics()
    assert mt["num_devices"] == 2 and mt["peak_gpu0_bytes"] > 0 and mt["peak_gpu1_bytes"] > 0
    assert max(mt["peak_gpu0_bytes"], mt["peak_gpu1_bytes"]) == mt["peak_gpu_bytes"] <= H200.gpu_mem_bytes
    # a p2p copy takes bytes over the GPU-to-GPU link
    p = df[df["kind"] == "p2p"].iloc[0]
    assert p["end_s"] - p["start_s"] == pytest.approx(costmodel.p2p_seconds(H200, int(p["nbytes"])))


@pytest.mark.parametrize("policy,model,gib,wl,st,gain", [
    # all on the GPU (compute-bound): two GPUs decode nearly twice as fast as one
    ("flexgen", "opt-1.3b", None, Workload(128, 8, 8, 4), {"percent": (100, 0, 100, 0, 100, 0)}, 1.6),
    # TightLLM, weights streamed and KV loaded over each GPU's own link
    ("tightllm", "opt-30b", 16, Workload(512, 8, 16, 4), {"percent": (18, 82, 0, 100, 100, 0), "kv_solver": "exact"},
     1.2)])
def test_pipeline_overlaps_stages_and_scales_decode(policy, model, gib, wl, st, gain):
    """With two micro-batch groups the stages work at once, so two GPUs decode faster than one; with one group they
    take turns (no faster than one GPU)."""
    m, hw = get_model(model), get_hardware("h200", gib)

    def decode(**pipe):
        return simulate(build_plan(policy, m, hw, wl, {**st, **pipe}), hw).metrics()["decode_tok_s"]

    one = decode()
    assert decode(num_stages=2) > gain * one
    assert decode(num_stages=2, micro_batches=1) < 1.1 * one


def test_gpu_link_bandwidth_prices_p2p():
    fast = H200.with_(gpu_link_bytes_per_s=400e9)
    assert costmodel.p2p_seconds(fast, 4e9) == pytest.approx(H200.link_latency_s + 0.01)
    assert costmodel.gpu_link_bytes_per_s(H200) == max(y for _, y in H200.h2d_pinned)  # not measured: PCIe peer
    assert "gpu_link_bytes_per_s" not in H200.to_dict()  # (profiles without it read back the same)
    assert fast.to_dict()["gpu_link_bytes_per_s"] == 400e9
    with pytest.raises(OffsimError, match="gpu_link_bytes_per_s"):
        H200.with_(gpu_link_bytes_per_s=-1)


def test_a_stage_that_does_not_fit_is_refused_per_stage_before_any_op():
    m = get_model("opt-6.7b")
    hw = H200.with_(gpu_mem_bytes=8 << 30)
    wl = Workload(256, 4, 8, 2)
    st = {"percent": (100, 0, 100, 0, 100, 0)}
    with pytest.raises(PlanError, match="GPU memory short"):  # one GPU: the whole model does not fit
        build_plan("flexgen", m, hw, wl, st)
    plan = build_plan("flexgen", m, hw, wl, {**st, "num_stages": 2})  # two: half the layers each fit
    assert all(s["gpu_resident"] <= s["gpu_capacity"] == hw.gpu_mem_bytes for s in plan.stages)
    with pytest.raises(PlanError, match=r"stage 0 \(layers 0-27\) does not fit on its GPU: short by") as e:
        build_plan("flexgen", m, hw, wl, {**st, "num_stages": 2, "stage_layers": [28, 4]})
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(PlanError, match="host memory \\(shared by all stages\\)"):
        build_plan("flexgen", m, hw.with_(cpu_mem_bytes=4 << 30), wl,
                   {"percent": (0, 100, 0, 100, 100, 0), "num_stages": 2})


def test_simpy_engine_refuses_a_pipeline():
    with pytest.raises(OffsimError, match="single-GPU"):
        simulate_simpy(_plan(_tiny(), 2), H200)


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == 2, (cap.out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cli_num_gpus_reports_each_gpu(capsys, tmp_path):
    argv = ["simulate", "--model", "opt-1.3b", "--hardware", "h200", "--gpu-mem-gb", "4", "--prompt-len", "64",
            "--gen-len", "3", "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--percent", "30", "70", "0", "100",
            "100", "0"]
    assert main(argv + ["--num-gpus", "2", "--save-plan", str(tmp_path / "p.json"),
                        "--trace", str(tmp_path / "t.csv")]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs (pipeline" in out and "GPU 0 layers 0-11 peak" in out and "GPU 1 layers 12-23 peak" in out
    plan = Plan.load(tmp_path / "p.json")
    assert plan.num_devices == 2 and plan.settings["num_stages"] == 2
    from offsim.core.trace import Trace
    t = Trace.from_csv(tmp_path / "t.csv")
    assert set(t.df["device"]) == {0, 1} and "gpu1" in t.peak_bytes
    assert main(argv + ["--set", "num_stages=2", "--set", "stage_layers=[8,16]"]) == 0
    assert "GPU 0 layers 0-7 peak" in capsys.readouterr().out
    err = _one_line_error(capsys, argv + ["--num-gpus", "30"])
    assert "num_stages 30 exceeds the model's 24 layers" in err
    err = _one_line_error(capsys, ["simulate", "--policy", "static-zero", "--model", "opt-1.3b", "--hardware", "h200",
                                   "--num-gpus", "2"])
    assert "--num-gpus does not apply to policy static-zero" in err
    err = _one_line_error(capsys, argv + ["--num-gpus", "2", "--set", "micro_batches=5"])
    assert "micro_batches" in err


def test_chrome_trace_has_a_track_per_gpu(tmp_path):
    import json

    t = simulate(_plan(_tiny(), 2), H200)
    t.to_chrome(tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    ops = [e for e in ev if e["ph"] == "X"]
    assert len(ops) == len(t.df) and {e["pid"] for e in ops} == {0, 1}
    assert {e["args"]["name"] for e in ev if e["ph"] == "M"} >= {"p2p", "compute"}
    # a single-GPU trace keeps its five stream tracks
    t1 = simulate(build_plan("flexgen", _tiny(), H200, Workload(8, 4, 2, 2), OFFLOAD), H200)
    t1.to_chrome(tmp_path / "t1.json")
    ev1 = json.loads((tmp_path / "t1.json").read_text())["traceEvents"]
    assert len([e for e in ev1 if e["ph"] == "M"]) == 5 and {e["pid"] for e in ev1} == {0}


def test_link_concurrent_fraction_prices_a_pipelines_links_at_their_shared_rate():
    """A host that feeds every GPU's link at half rate at once (``link_concurrent_fraction`` 0.5, measured by
    ``offexec profile`` on a host with several GPUs) slows a link-bound 2-GPU plan, leaves a 1-GPU plan alone, and
    round-trips through the profile JSON (left out at 1.0, so older profiles read back the same)."""
    from offexec.profile import profile_multi_gpu

    m = get_model("opt-30b")
    hw = get_hardware("h200", gpu_mem_gb=16)
    shared = hw.with_(link_concurrent_fraction=0.5)
    assert "link_concurrent_fraction" not in hw.to_dict()
    assert type(shared).from_dict(shared.to_dict()).link_concurrent_fraction == 0.5
    with pytest.raises(OffsimError, match="link_concurrent_fraction"):
        hw.with_(link_concurrent_fraction=1.5)
    st = {"percent": (20, 80, 0, 100, 100, 0)}
    two = build_plan("flexgen", m, hw, Workload(512, 4, 16, 4), {**st, "num_stages": 2})
    one = build_plan("flexgen", m, hw, Workload(512, 4, 16, 4), st)
    assert simulate(two, shared).makespan_s > 1.5 * simulate(two, hw).makespan_s  # link-bound: ~2x
    assert simulate(one, shared).makespan_s == simulate(one, hw).makespan_s
    import torch

    if torch.cuda.device_count() < 2:
        assert profile_multi_gpu() == {}  # measured only where there are two GPUs


# ---- TightLLM's pipeline: the same stages, each recomputing N_r tokens of its own layers ---------------------------
TIGHT = {"percent": (20, 80, 0, 100, 100, 0), "kv_solver": "exact"}


def test_tightllm_one_stage_is_the_single_gpu_plan_exactly():
    m = _tiny()
    wl = Workload(8, 4, 2, 3)
    for st in (TIGHT, {"percent": (50, 25, 25, 25, 0, 100), "kv_solver": "exact"}):
        a = build_plan("tightllm", m, H200, wl, st)
        b = build_plan("tightllm", m, H200, wl, {**st, "num_stages": 1})
        assert a.ops == b.ops and a.fingerprint() == b.fingerprint() and a.to_dict() == b.to_dict()
        assert "num_stages" not in a.settings and not a.stages


@pytest.mark.parametrize("stages,micro", [(2, 0), (3, 0), (2, 1), (2, 3)])
def test_tightllm_stage_plan_structure(stages, micro):
    """Every op on its layer's GPU, the hidden states of a batch's q = N_r + 1 tokens sent on between stages and each
    new token's id back to the first; each GPU streams and loads only its own layers' weights and KV; the plan
    validates per GPU and simulates."""
    m = _tiny(5)
    wl = Workload(8, 4, 2, 3)
    plan = build_plan("tightllm", m, H200, wl, {**TIGHT, "num_stages": stages, "micro_batches": micro,
                                                 "weight_slices": 1})
    ranges = balanced_stages(5, stages)
    assert [tuple(s["layers"]) for s in plan.stages] == list(ranges)
    dev = {j: d for d, (lo, hi) in enumerate(ranges) for j in range(lo, hi)}
    dev[-1], dev[5] = 0, stages - 1
    nr = plan.derived["recompute_tokens"]
    for op in plan.ops:
        if op.kind == "p2p":
            assert op.peer != op.device
            if op.tensor == "token":
                assert op.layer == -1 and op.peer == 0 and op.device == stages - 1 and op.hi - op.lo == 1
            else:
                assert op.peer == dev[op.layer] and op.device == dev[op.layer] - 1
                q = 8 if op.step == 0 else nr[op.step - 1][op.batch] + 1
                assert op.hi - op.lo == q
            continue
        assert op.device == dev[op.layer], op.describe()
    assert any(o.kind == "p2p" and o.tensor == "token" for o in plan.ops)
    simulate(plan, H200)


def test_tightllm_stages_refused_from_arithmetic_and_activations_on_the_gpu():
    m = get_model("opt-6.7b")
    hw = H200.with_(gpu_mem_bytes=8 << 30)
    wl = Workload(256, 4, 8, 2)
    st = {"percent": (100, 0, 100, 0, 100, 0), "kv_solver": "exact"}
    with pytest.raises(PlanError, match="GPU memory short"):
        build_plan("tightllm", m, hw, wl, st)
    plan = build_plan("tightllm", m, hw, wl, {**st, "num_stages": 2})
    assert all(s["gpu_resident"] <= s["gpu_capacity"] == hw.gpu_mem_bytes for s in plan.stages)
    with pytest.raises(PlanError, match=r"stage 0 \(layers 0-27\) does not fit on its GPU"):
        build_plan("tightllm", m, hw, wl, {**st, "num_stages": 2, "stage_layers": [28, 4]})
    with pytest.raises(OffsimError, match="keeps the activations on the GPU"):
        build_plan("tightllm", _tiny(), H200, Workload(8, 4, 2, 2),
                   {"percent": (20, 80, 0, 100, 0, 100), "num_stages": 2})


def test_search_picks_a_tightllm_pipeline():
    from offsim.search import search
    res = search("tightllm", get_model("opt-6.7b"), H200.with_(gpu_mem_bytes=8 << 30), 256, 8, max_sims=2,
                 num_gpus=2)
    assert res.settings["num_stages"] == 2 and len(res.stages) == 2


def test_stages_share_the_host_by_readiness_not_by_plan_order():
    """A pipeline's stages share the host CPU (and disk) one op at a time, served in the order the ops become ready
    -- not one stream in plan order for all stages, where a stage's CPU attention waited behind the other stages'
    earlier-planned ops and a pipeline with CPU attention ran slower on more GPUs (125 s on one T4, 150 on two, 208
    on four, before 2026-12-04). The host is still one: its busy time is the same CPU work, never two ops at once."""
    m, hw = get_model("opt-30b"), get_hardware("t4")
    st = {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}
    runs = {}
    for g in (1, 2, 4):
        t = simulate(build_plan("flexgen", m, hw, Workload(512, 8, 8, 4), {**st, "num_stages": g}), hw)
        cpu = t.df[t.df["stream"] == "cpu"].sort_values("start_s")
        assert (cpu["start_s"].to_numpy()[1:] >= cpu["end_s"].to_numpy()[:-1] - 1e-9).all()  # one at a time
        runs[g] = t.metrics()["total_s"]
    assert runs[4] < runs[2] < runs[1], runs
