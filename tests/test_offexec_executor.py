"""The executor runs every policy's plan on the CPU and reproduces transformers: same greedy tokens, logits within
1e-4 (fp32), and every KV position a plan stores on a home tier equals transformers' KV cache (so recomputed KV
equals what prefill stored). Also: the threaded stream scheduler, the trace it returns, and its refusals."""
import os

import numpy as np
import pytest
import torch

from offexec.executor import check_plan, run_plan
from offexec.memory import DiskTier, ExecError, check_gpu_budget
from offexec.testing import TIER_CASES, hf_generate, hf_kv, stored_positions, tiny_hf
from offexec.weights import from_state_dict
from offsim import POLICIES, Workload, build_plan, get_hardware
from offsim.core.costmodel import graphed
from offsim.core.plan import Plan
from offsim.core.trace import COLUMNS

HW = get_hardware("h200")
PROMPT, GEN = 8, 6

# (policy, settings, gpu_batch_size, num_gpu_batches)
CASES = TIER_CASES + [
    ("flexgen", {"percent": (30, 70, 0, 100, 100, 0), "overlap": False}, 2, 2),
    # FlexGen's own code with CPU attention: its decode tokens' K/V stores follow CPU attention, which has already
    # written those rows into the host cache (they once overwrote it with the GPU work buffer's stale rows)
    ("flexgen-ref", {"percent": (100, 0, 0, 100, 100, 0), "cpu_attention": True}, 2, 2),
]

if "selectn" in POLICIES:
    CASES.append(("selectn", {"interval": 2}, 3, 1))
if "tightllm" in POLICIES:
    CASES += [("tightllm", {"percent": (30, 40, 25, 50, 100, 0), "weight_slices": 2, "kv_solver": "exact"}, 2, 2),
              ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact"}, 2, 2),  # recompute all
              # N_r = 4 of 8..12: a loaded prefix + a recompute block; recomputed prompt positions stored later
              ("tightllm", {"percent": (0, 50, 0, 50, 0, 100), "kv_solver": "exact", "max_recompute_tokens": 4},
               2, 2)]


MAX_PROMPTS = 6
_MODELS: dict = {}


def _model(family):
    """Tiny model, its weights, a pool of prompts and transformers' reference for them (computed once: greedy
    sequences are independent, so a workload of N prompts compares with the first N rows)."""
    if family not in _MODELS:
        hf, spec = tiny_hf(family, seed=11)
        pool = torch.randint(0, spec.vocab_size, (MAX_PROMPTS, PROMPT), generator=torch.Generator().manual_seed(7))
        tok, logits = hf_generate(hf, pool, GEN)
        kv = hf_kv(hf, torch.cat((pool, tok[:, :-1]), 1))  # the last token's KV is never computed
        _MODELS[family] = (hf, spec, from_state_dict(spec, hf.state_dict()), pool, (tok, logits, kv))
    return _MODELS[family][:3]


def _case_id(c):
    return f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[1].items()).replace(" ", "")


def _run(family, policy, settings, gbs, nb, threaded=False, **kw):
    hf, spec, w = _model(family)
    wl = Workload(PROMPT, GEN, gbs, nb)
    plan = build_plan(policy, spec, HW, wl, settings)
    prompts = _MODELS[family][3][:wl.num_prompts]
    res = run_plan(plan, w, "cpu", prompts, record_logits=True, keep_kv=True, threaded=threaded, **kw)
    return hf, spec, plan, prompts, res


def _check_against_transformers(hf, spec, plan, prompts, res):
    ref_tok, ref_logits, ref = _MODELS[f"{spec.family}"][4]
    n = plan.workload.num_prompts
    np.testing.assert_array_equal(res.tokens, ref_tok[:n].numpy())
    gbs = plan.workload.gpu_batch_size
    assert len(res.logits) == GEN * plan.workload.num_gpu_batches
    for step, b, lg in res.logits:
        assert (lg - ref_logits[step, b * gbs:(b + 1) * gbs]).abs().max().item() <= 1e-4
    # every KV position stored on a home tier equals transformers' cache of the same sequences
    kg, kc = plan.kv_split
    homes = {"gpu": (0, kg), "cpu": (kg, kg + kc), "disk": (kg + kc, spec.num_kv_heads)}
    checked = 0
    for (tier, j, k), pos in stored_positions(plan).items():
        lo, hi = homes[tier]
        cache = res.kv[tier][j, k]  # [cap, 2, B, n, D]
        idx = torch.tensor(sorted(pos))
        for kv in (0, 1):
            got = cache[idx, kv]  # [P, B, n, D]
            want = ref[j][kv][k * gbs:(k + 1) * gbs, lo:hi][:, :, idx].permute(2, 0, 1, 3)
            assert (got - want).abs().max().item() <= 1e-4, (tier, j, k)
        checked += len(pos)
    return checked


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_plan_reproduces_transformers(family, case):
    hf, spec, plan, prompts, res = _run(family, *case)
    checked = _check_against_transformers(hf, spec, plan, prompts, res)
    if any(o.kind in ("d2h", "disk_write") and o.tensor == "kv" for o in plan.ops):
        assert checked > 0  # stored KV was compared


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_graph_path_reproduces_transformers(family, case):
    """The kernels the decode CUDA graphs capture (offexec/graphs.py: the KV written at a device-side position,
    attention over the full-length buffer with the unwritten tail masked, RoPE read at that position; with CPU
    attention the GPU halves around it), run eagerly on the CPU, give transformers' tokens, logits and stored KV too;
    every decode op of one new token goes through them, and so does every TightLLM recompute of up to
    ``GRAPH_MAX_Q_TOKENS`` query tokens (positions and a causal key mask of q rows read on the device)."""
    hf, spec, plan, prompts, res = _run(family, *case, graphs="static")
    _check_against_transformers(hf, spec, plan, prompts, res)
    through = [o for o in plan.ops if graphed(o.kind, o.part, o.q_tokens, o.phase, plan.graph_q_tokens)]
    g = res.stats["graphs"]
    assert g["mode"] == "static" and g["failed"] is None
    assert g["replays"] == 0 and g["graphs"] == 0  # static: nothing captured
    assert g["ops"] == len(through)
    if plan.settings.get("max_recompute_tokens"):  # N_r = 4: recompute blocks of 5 query tokens, graphed
        assert any(o.q_tokens == 5 for o in through)


def test_graph_modes_are_checked():
    hf, spec, w = _model("opt")
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 1), {"percent": (100, 0, 0, 100, 100, 0)})
    with pytest.raises(ExecError, match="graphs must be one of"):
        run_plan(plan, w, "cpu", _MODELS["opt"][3][:2], graphs="cuda")


@pytest.mark.parametrize("case", [CASES[5], CASES[7], CASES[9], CASES[-1]], ids=_case_id)
def test_threaded_scheduler_reproduces_transformers(case):
    hf, spec, plan, prompts, res = _run("llama", *case, threaded=True)
    _check_against_transformers(hf, spec, plan, prompts, res)


@pytest.mark.parametrize("run_ahead", [(1, 1, 1), None])
def test_the_plans_run_ahead_window_is_the_executors(run_ahead):
    """The executor's flow control is the plan's ``run_ahead`` (what offsim models): one op in flight per stream,
    or no bound, still reproduces transformers through the threaded scheduler."""
    hf, spec, w = _model("opt")
    plan = build_plan(CASES[7][0], spec, HW, Workload(PROMPT, GEN, CASES[7][2], CASES[7][3]), CASES[7][1])
    plan.run_ahead = run_ahead
    prompts = _MODELS["opt"][3][:plan.workload.num_prompts]
    res = run_plan(plan, w, "cpu", prompts, record_logits=True, keep_kv=True, threaded=True)
    _check_against_transformers(hf, spec, plan, prompts, res)
    # the issuing thread's time per op (offexec profile's per-part issue rows): every GPU-stream op has some
    by_op = res.issue_s_by_op
    gpu_ops = [o.id for o in plan.ops if o.stream in ("compute", "h2d", "d2h")]
    assert by_op.shape == (len(plan.ops),) and (by_op[gpu_ops] > 0).all()
    assert by_op.sum() == pytest.approx(res.stats["issue_s"], rel=1e-6)


@pytest.mark.skipif("tightllm" not in POLICIES, reason="offsim.policies.tightllm not present")
def test_tightllm_case_recomputes():
    """The tightllm cases above really recompute (N_r > 0: decode layer ops with more than one query token), and
    store KV positions that decode produced by recompute, which the test compares with transformers' cache."""
    hf, spec, w = _model("opt")
    plan = build_plan("tightllm", spec, HW, Workload(PROMPT, GEN, 2, 2), CASES[-1][1])
    q = [o.q_tokens for o in plan.ops if o.kind == "compute" and o.part == "layer" and o.step > 0]
    assert max(q) > 1
    stores = [o for o in plan.ops if o.kind == "d2h" and o.tensor == "kv" and o.step > 0]
    recomputed_then_stored = [o for o in stores if o.lo < PROMPT]  # prompt positions stored only after recompute
    assert recomputed_then_stored


def test_trace_schema_and_dependencies():
    hf, spec, plan, prompts, res = _run("opt", *CASES[7])
    df = res.trace.df
    assert list(df.columns) == COLUMNS and len(df) == len(plan.ops)
    assert res.trace.meta["source"] == "offexec"
    assert (df["end_s"] >= df["start_s"]).all() and (df["start_s"] >= 0).all()
    end = df["end_s"].to_numpy()
    start = df["start_s"].to_numpy()
    for op in plan.ops:  # sequential on the CPU: every op starts after the ops it depends on ended
        for d in op.deps:
            assert end[d] <= start[op.id] + 1e-9
    m = res.trace.metrics()
    assert m["decode_tok_s"] > 0 and m["peak_disk_bytes"] > 0
    assert res.stats["pool_buffers"]["wslot"] == res.stats["pool_buffers_plan_order"]["wslot"]


def test_threaded_trace_respects_host_dependencies():
    hf, spec, plan, prompts, res = _run("opt", *CASES[9], threaded=True)
    df = res.trace.df
    start, end = df["start_s"].to_numpy(), df["end_s"].to_numpy()
    for op in plan.ops:
        if op.stream in ("cpu", "disk"):
            for d in op.deps:
                assert end[d] <= start[op.id] + 1e-6


@pytest.mark.parametrize("case", [CASES[5], CASES[10]], ids=_case_id)
def test_threaded_issue_order_and_stream_waits(case, monkeypatch):
    """The issuing loop (``Executor._run_streams``) on a plan without host ops issues every op in plan order, each
    between its two events on its own stream, and first makes that stream wait on the end event of each dependency
    on another stream, in the op's dependency order (then on the last users of the pool buffers it takes)."""
    from offexec import executor as E

    log, ex = [], {}
    orig_init = E.Executor.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        ex["ex"] = self

    def wait_event(self, ev):
        log.append(("wait", self.name, next(i for i, e in enumerate(ex["ex"].ev_end) if e is ev)))

    def record(self, stream=None):
        if stream is not None and ex["ex"].ev_start is not None:
            log.append(("record", stream.name, self))
        self.t = 0.0

    monkeypatch.setattr(E.Executor, "__init__", init)
    monkeypatch.setattr(E._HostStream, "wait_event", wait_event)
    monkeypatch.setattr(E._HostEvent, "record", record)
    hf, spec, plan, prompts, res = _run("opt", *case, threaded=True)
    assert not any(op.stream in ("cpu", "disk") for op in plan.ops)
    recs = [i for i, e in enumerate(log) if e[0] == "record"]
    assert len(recs) == 1 + 2 * len(plan.ops)  # the run's reference event, then two per op
    prev, recs = recs[0], recs[1:]
    for op in plan.ops:  # op k is the k-th issued: records 2k (start) and 2k + 1 (end)
        a, z = recs[2 * op.id], recs[2 * op.id + 1]
        assert log[a][1] == log[z][1] == op.stream and z == a + 1  # nothing waits inside an op's events
        cross = [d for d in op.deps if plan.ops[d].stream != op.stream]
        waits = log[prev + 1:a]
        assert all(w[0] == "wait" and w[1] == op.stream for w in waits)
        assert [w[2] for w in waits[:len(cross)]] == cross
        prev = z


def test_inconsistent_plan_is_refused_naming_the_op():
    hf, spec, w = _model("opt")
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 2), {"percent": (20, 80, 0, 100, 100, 0)})
    d = plan.to_dict()
    # drop the first decode KV load: the compute that needs it has nothing to attend over
    ti = d["op_fields"].index("tensor")
    drop = next(i for i, r in enumerate(d["ops"]) if r[1] == "h2d" and r[ti] == "kv")
    rows = [r for i, r in enumerate(d["ops"]) if i != drop]
    remap = {old: new for new, old in enumerate(i for i in range(len(d["ops"])) if i != drop)}
    for r in rows:
        r[0] = remap[r[0]]
        r[2] = [remap[x] for x in r[2] if x in remap]
    d["ops"] = rows
    bad = Plan.from_dict(d)
    with pytest.raises(ExecError, match="no KV load"):
        check_plan(bad, "cpu", 1 << 40)


def test_gpu_budget_precheck_names_the_shortfall():
    with pytest.raises(ExecError, match="short by 100 bytes"):
        check_gpu_budget({"resident weights": 1000, "buffer pools": 100}, 1000)
    check_gpu_budget({"resident weights": 1000}, 1000)


def test_a_cuda_plan_larger_than_the_cards_free_memory_is_refused_before_allocating(monkeypatch):
    """A budget within --gpu-mem-gb but above what the card has free (a preset's nominal size on a smaller card,
    another process's memory) is refused from arithmetic, not by an out-of-memory error mid-allocation. Checked here
    with the card's figures stood in (no GPU in CI); memory a job's earlier block left in the allocator's cache
    counts as free."""
    hf, spec, w = _model("opt")
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 2), {"percent": (100, 0, 100, 0, 100, 0)})
    need = sum(check_plan(plan, "cpu", 1 << 40).values())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (need - 1, 80 << 30))
    with pytest.raises(ExecError, match="free \\(of 80.00 GiB\\): lower --gpu-mem-gb"):
        check_plan(plan, "cuda", 1 << 40)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 1)  # the cache holds the missing byte
    check_plan(plan, "cuda", 1 << 40)


def test_disk_tier_without_room_is_refused(monkeypatch, tmp_path):
    import shutil
    from collections import namedtuple

    hf, spec, w = _model("opt")
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 2), {"percent": (0, 0, 0, 0, 100, 0)})
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10, 10, 10))
    with pytest.raises(ExecError, match="short by"):
        check_plan(plan, "cpu", 1 << 40, str(tmp_path))


def test_interrupted_run_leaves_no_disk_files(tmp_path, monkeypatch):
    from offexec.executor import Executor

    hf, spec, w = _model("opt")
    plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 2), {"percent": (0, 0, 0, 0, 100, 0)})
    calls = {"n": 0}
    orig = Executor._op_attn_layer  # flexgen streams sub-layers: a decoder layer's attention half

    def interrupt(self, op, args, info):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return orig(self, op, args, info)

    monkeypatch.setattr(Executor, "_op_attn_layer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_plan(plan, w, "cpu", disk_dir=str(tmp_path))
    assert calls["n"] == 5 and os.listdir(tmp_path) == []


@pytest.mark.slow  # a subprocess that imports torch
def test_disk_tier_removed_on_sigterm(tmp_path):
    import subprocess
    import sys
    import textwrap
    import time

    code = textwrap.dedent(f"""
        import sys, time
        from offexec.memory import DiskTier
        t = DiskTier({str(tmp_path)!r}, 1 << 20)
        t.create("kv.bin", 1 << 20)
        print("ready", flush=True)
        time.sleep(30)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert len(os.listdir(tmp_path)) == 1
    p.terminate()
    p.wait(timeout=10)
    p.stdout.close()
    time.sleep(0.1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cached", [False, True], ids=["odirect", "cached"])
def test_disk_tier_roundtrip(tmp_path, cached):
    t = DiskTier(tmp_path, 1 << 20, threads=3, cached=cached)
    t.CHUNK_BYTES = 1000  # several chunks per request (O_DIRECT: one block each)
    t.create("x.bin", 1 << 16)
    a = torch.arange(10000, dtype=torch.float32)
    t.write("x.bin", a, 512)
    b = torch.empty_like(a)
    t.read("x.bin", b, 512)
    assert torch.equal(a, b)
    t.close()
    assert os.listdir(tmp_path) == []


def test_host_bound_idle_counts_only_gaps_the_host_caused():
    """Compute ops at [0,1], [1.5,2], [4,5] (GPU clock): the first gap (0.5 s) passed with the op issued at 1.2 s
    (0.2 s on the host's account); the second gap (2 s) with the op issued early (0 s: a dependency held it). Host
    issue that overlapped GPU work never counts."""
    from offexec.executor import host_bound_idle_s

    _, _, w = _model("opt")
    plan = build_plan("flexgen", _MODELS["opt"][1], HW, Workload(PROMPT, 2, 1, 1), {})
    comp = [op.id for op in plan.ops if op.stream == "compute"][:3]
    n = len(plan.ops)
    start, end, issued = np.zeros(n), np.zeros(n), np.full(n, np.nan)
    for oid, (a, z, i) in zip(comp, ((0.0, 1.0, 0.0), (1.5, 2.0, 1.2), (4.0, 5.0, 0.5))):
        start[oid], end[oid], issued[oid] = a, z, i
    others = [op.id for op in plan.ops if op.stream == "compute"][3:]
    start[others] = end[others] = 5.0  # the rest back to back after: no gaps
    issued[others] = 0.0
    assert host_bound_idle_s(plan, start, end, issued) == pytest.approx(0.2)
    issued[comp[2]] = 4.5  # issued late: the whole 2 s gap is the host's (never more than the gap itself)
    assert host_bound_idle_s(plan, start, end, issued) == pytest.approx(0.2 + 2.0)


def test_straddling_heads_are_copied_by_the_compute_op_that_reads_the_slot():
    """A GPU share that splits a tensor: each load of a slot leaves the straddling tensor's resident head to the
    first compute op reading the slot (on the compute stream, not the link's), once per load -- and the tokens are
    transformers'."""
    hf, spec, plan, prompts, res = _run("opt", "flexgen", {"percent": (30, 70, 0, 100, 100, 0), "sublayer": False},
                                        2, 2)
    _check_against_transformers(hf, spec, plan, prompts, res)
    loads = [op for op in plan.ops if op.kind == "h2d" and op.tensor == "weight"]
    first = {j: min(op.lo for op in loads if op.layer == j) for j in {op.layer for op in loads}}
    inits = sum(op.lo == first[op.layer] for op in loads)  # each load's first slice (whole layers: every load)
    assert res.stats["straddle_copies"] > 0
    assert res.stats["straddle_copies"] == inits  # one per load of a layer's slot


def test_kv_work_buffers_are_bound_so_that_a_load_overlaps_the_attention_before_it():
    """FlexGen with the weights on the GPU and part of the KV on the host, one GPU batch: the KV load of layer j+1
    depends on the store of layer j-1, so two work buffers let it run beside layer j's attention. Plan order has
    one live at a time; the binding (``program.bind_pool_buffers``) gives two, alternating, as offsim's placement
    reserves -- and no reuse waits for an op the load does not depend on. With CPU attention: one. Tokens are
    transformers'."""
    from offexec.program import bind
    from offexec.weights import layer_layout
    from offsim.core import footprint as fp

    hf, spec, plan, prompts, res = _run("opt", "flexgen", {"percent": (100, 0, 50, 50, 100, 0)}, 2, 1)
    _check_against_transformers(hf, spec, plan, prompts, res)
    prog = bind(plan, layer_layout(spec))
    kv = [v for v in prog.values if v.kind == "kvwork_cpu"]
    assert prog.pool_peak["kvwork_cpu"] == 2 == res.stats["pool_buffers"]["kvwork_cpu"]
    assert [prog.buffer_of[v.id] for v in kv[:6]] == [0, 1, 0, 1, 0, 1]
    placement = POLICIES["flexgen"].placement(spec, HW, plan.workload,
                                              POLICIES["flexgen"].settings_from({"percent": (100, 0, 50, 50, 100, 0)}))
    # the executor's two buffers are what offsim's placement reserves
    assert fp.placement_tier_bytes(spec, plan.workload, placement)["gpu"]["KV work buffers"] == \
        res.stats["gpu_need_bytes"]["KV work buffers"]
    cpu_plan = build_plan("flexgen", spec, HW, Workload(PROMPT, GEN, 2, 1),
                          {"percent": (100, 0, 0, 100, 100, 0), "cpu_attention": True})
    assert bind(cpu_plan, layer_layout(spec)).pool_peak["kvwork_cpu"] == 1


def test_a_bound_buffer_still_in_use_falls_back_to_a_free_one_then_grows():
    """``BufferPool.take``: the bound buffer when free; while it is taken, the first free buffer; with none free, a
    new one (counted); given back, the bound one again."""
    from offexec.memory import BufferPool

    pool = BufferPool("kvwork_cpu", 4, torch.float32, torch.device("cpu"))
    pool.reserve(2)
    i0, b0 = pool.take(0)
    i1, b1 = pool.take(0)  # buffer 0 is live: the other
    i2, b2 = pool.take(1)  # both live: a third
    assert (i0, i1, i2) == (0, 1, 2) and pool.count == 3 and len({id(b0), id(b1), id(b2)}) == 3
    pool.give(0)
    assert pool.take(0) == (0, b0)


def test_host_in_op_counts_the_part_of_each_span_before_its_issue_ended():
    """Compute ops at [0,1] issued at 0.4 s (0.4 s of its span ran while the host still issued it), [1.5,2] issued
    at 1.2 s (before it began: none), [4,5] issued at 6 s (never more than the span: 1 s); the gaps are
    host_bound_idle_s's, not counted here."""
    from offexec.executor import host_in_op_s

    plan = build_plan("flexgen", _MODELS["opt"][1], HW, Workload(PROMPT, 2, 1, 1), {})
    comp = [op.id for op in plan.ops if op.stream == "compute"]
    n = len(plan.ops)
    start, end, issued = np.full(n, 5.0), np.full(n, 5.0), np.zeros(n)
    for oid, (a, z, i) in zip(comp, ((0.0, 1.0, 0.4), (1.5, 2.0, 1.2), (4.0, 5.0, 6.0))):
        start[oid], end[oid], issued[oid] = a, z, i
    assert host_in_op_s(plan, start, end, issued) == pytest.approx(0.4 + 0.0 + 1.0)
    issued[comp[0]] = np.nan  # an op without an issue time (a host op's) counts nothing
    assert host_in_op_s(plan, start, end, issued) == pytest.approx(1.0)


@pytest.mark.skipif("tightllm" not in POLICIES, reason="offsim.policies.tightllm not present")
def test_graph_min_uses_runs_short_lived_recompute_shapes_eagerly():
    """``Plan.graph_min_uses``: the executor sends through the graph path exactly the ops offsim counts as graphed
    (``costmodel.op_graphed`` less ``eager_graph_shapes``) -- none when every shape is met at fewer steps -- and
    the tokens, logits and stored KV still equal transformers'."""
    from offsim.core import costmodel

    hf, spec, w = _model("opt")
    settings = CASES[-1][1]  # N_r = 4: recompute blocks of up to 5 query tokens, graphable
    plan = build_plan("tightllm", spec, HW, Workload(PROMPT, GEN, 2, 2), settings)
    shapes: dict = {}
    for o in plan.ops:
        if graphed(o.kind, o.part, o.q_tokens, o.phase, plan.graph_q_tokens):
            shapes.setdefault((o.part, o.q_tokens), set()).add(o.step)
    counts = sorted({len(s) for s in shapes.values()})
    assert shapes  # recompute blocks of q = 5 at every decode step
    for need in (counts[-1], counts[-1] + 1):
        plan.graph_min_uses = need
        eager = costmodel.eager_graph_shapes(plan)
        through = [o for o in plan.ops if costmodel.op_graphed(o.kind, o.part, o.q_tokens, o.phase,
                                                               plan.graph_q_tokens, eager)]
        res = run_plan(plan, w, "cpu", _MODELS["opt"][3][:plan.workload.num_prompts], record_logits=True,
                       keep_kv=True, graphs="static")
        _check_against_transformers(hf, spec, plan, None, res)
        assert res.stats["graphs"]["ops"] == len(through)
        if need > counts[-1]:
            assert not through  # every shape met at fewer steps: all eager


@pytest.mark.skipif("tightllm" not in POLICIES, reason="offsim.policies.tightllm not present")
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_written_rows_graph_path_reproduces_transformers(family, monkeypatch):
    """``Plan.graph_attention`` 'written_rows': the graphed recompute ops' sequence-first path (hidden states
    [q, B, E] through the static copies, Q/K/V out of the projections [q, B, H, D], RoPE along dim 0, the new K/V
    written from contiguous rows, attention over the rows written so far: on the CPU through SDPA under the key
    mask, on CUDA flash's variable-length call; each GPU batch's hidden state read and written in place in a buffer of
    its own) gives transformers' tokens, logits and stored KV, for every recompute
    op of the plan (graph_max_q_tokens raised to the longest); one-token ops keep the masked path. A plan whose KV
    heads sit in two buffers keeps the masked path for all. The plan field round-trips and is checked."""
    from offexec import model as M
    from offsim.core.plan import Plan, PlanError
    from offsim.core import footprint as fp

    calls = []
    real = M.written_rows_attention
    monkeypatch.setattr(M, "written_rows_attention", lambda q, *a: calls.append(q.shape) or real(q, *a))
    hf, spec, w = _model(family)
    one_tier = {"percent": (0, 50, 0, 0, 100, 0), "kv_solver": "exact"}  # every KV head on disk: N_r up to 7
    parked = {**one_tier, "percent": (0, 50, 0, 0, 0, 100)}  # activations parked on the host between layers
    for settings, single in ((one_tier, True), (parked, True), (CASES[-1][1], False)):  # then KV on host and disk
        calls.clear()
        plan = build_plan("tightllm", spec, HW, Workload(PROMPT, GEN, 2, 2), settings)
        plan.graph_max_q_tokens = max(o.q_tokens for o in plan.ops)
        plan.graph_attention = "written_rows"
        plan.validate()
        again = Plan.from_dict(plan.to_dict())
        assert again.graph_attention == "written_rows" and again.fingerprint() == plan.fingerprint()
        res = run_plan(plan, w, "cpu", _MODELS[family][3][:plan.workload.num_prompts], record_logits=True,
                       keep_kv=True, graphs="static")
        _check_against_transformers(hf, spec, plan, None, res)
        through = [o for o in plan.ops if graphed(o.kind, o.part, o.q_tokens, o.phase, plan.graph_q_tokens)]
        assert res.stats["graphs"]["ops"] == len(through) and any(o.q_tokens > 1 for o in through)
        kv_groups = sum(1 for n in plan.kv_split + (spec.num_kv_heads - sum(plan.kv_split),) if n)
        assert (kv_groups == 1) == single
        multi = [o for o in through if o.q_tokens > 1]
        assert len(calls) == (len(multi) if single else 0)  # sequence-first: [q, B, H, D]
        # activations on the GPU, each layer's result read by the batch's next op only: in the batch's own buffer
        assert res.stats["graphs"]["homes"] == (plan.workload.num_gpu_batches if single else 0)
        assert all(c[0] > 1 and c[1] == 2 for c in calls)
        # what the graphs hold at fixed addresses, measured, within what the footprint counts for them (no pool on
        # the CPU: 'static' captures nothing)
        g = res.stats["graphs"]
        assert g["pool_bytes"] == 0
        assert 0 < g["static_bytes"] <= fp.decode_graph_bytes(spec, plan.workload, plan.graph_max_q_tokens)
    plan.graph_attention = "causal"
    with pytest.raises(PlanError, match="graph_attention must be one of"):
        plan.validate()
    plan.graph_attention = ""
    assert "graph_attention" not in plan.to_dict()  # the default is not written: older plans hash the same


def test_a_torch_without_seqused_k_refuses_written_rows_before_the_run(monkeypatch):
    """On CUDA, a plan asking for the written-rows graph path on a torch whose flash call lacks ``seqused_k`` is
    refused by ``check_plan`` in one line naming the way out, before anything is allocated; this torch's check
    reads the op's schema."""
    from offexec import executor as E

    assert isinstance(E.flash_reads_written_rows(), bool)
    hf, spec, w = _model("opt")
    plan = build_plan("tightllm", spec, HW, Workload(PROMPT, GEN, 2, 2), {"percent": (0, 50, 0, 0, 100, 0),
                                                                          "kv_solver": "exact"})
    plan.graph_attention = "written_rows"
    monkeypatch.setattr(E, "flash_reads_written_rows", lambda: False)
    for fn in ("check_gpu_budget", "check_gpu_free"):  # (no GPU here: the budget checks pass)
        monkeypatch.setattr(E, fn, lambda *a, **k: None)
    with pytest.raises(ExecError, match="--graph-attention masked"):
        E.check_plan(plan, "cuda", 1 << 40)
    E.check_plan(plan, "cpu", 1 << 40)  # the CPU's path attends through SDPA: nothing to refuse
