"""Pipelines over several nodes (FlexGen's multi-node runs, e.g. 4 nodes x 1 GPU: ``gpus_per_node``): each node has
its own host memory, disk, host CPU and disk streams; hidden states between nodes cross the network
(``HardwareSpec.network_bytes_per_s``, ``costmodel.network_p2p_seconds``). The default (every stage on one host) is
the one-host pipeline unchanged; offexec refuses a multi-node plan."""

import pytest

from offsim import Plan, PlanError, Workload, build_plan, get_hardware, get_model, simulate
from offsim.cli import main
from offsim.core import costmodel
from offsim.core.errors import OffsimError
from offsim.policies.flexgen import FlexGenSettings
from offsim.policies.lp import flexgen_stage_lp

NET = 2e9  # bytes/s between the hosts of these tests
H200 = get_hardware("h200").with_(network_bytes_per_s=NET)
HOST = {"percent": (0, 100, 0, 100, 100, 0)}  # weights and KV in host memory


def _plan(model, stages, per_node=0, wl=Workload(64, 3, 4, 2), hw=H200, **st):
    return build_plan("flexgen", model, hw, wl, {**HOST, **st, "num_stages": stages, "gpus_per_node": per_node})


def test_default_topology_is_the_one_host_pipeline_unchanged():
    # no gpus_per_node, or all stages on one node: the same ops, JSON (but the recorded setting) and trace as before
    m = get_model("opt-1.3b")
    a = build_plan("flexgen", m, H200, Workload(64, 3, 4, 2), {**HOST, "num_stages": 2})
    b = _plan(m, 2, per_node=2)
    assert "gpus_per_node" not in a.settings and not a.nodes and all("node" not in s for s in a.stages)
    assert "nodes" not in a.to_dict() and a.num_nodes == 1
    assert a.ops == b.ops and a.fingerprint() == b.fingerprint() and a.stages == b.stages and not b.nodes
    ta, tb = simulate(a, H200), simulate(b, H200)
    assert ta.df.equals(tb.df) and ta.peak_bytes == tb.peak_bytes
    assert "cpu0" not in ta.peak_bytes and "num_nodes" not in ta.metrics()


def test_per_node_host_memory_fits_what_one_shared_host_refuses():
    m = get_model("opt-6.7b")
    wl = Workload(64, 3, 4, 2)
    host = m.weight_bytes() * 3 // 4  # one host holds 3/4 of the weights: two hosts hold half each
    hw = H200.with_(cpu_mem_bytes=host)
    with pytest.raises(PlanError, match=r"host memory \(shared by all stages\)"):
        _plan(m, 2, hw=hw, wl=wl)
    plan = _plan(m, 2, per_node=1, hw=hw, wl=wl).validate()
    assert [s["node"] for s in plan.stages] == [0, 1] and plan.num_nodes == 2
    assert all(x["cpu_capacity"] == host and x["cpu_resident"] <= host for x in plan.nodes)
    assert plan.capacity["cpu"] == 2 * host and plan.resident["cpu"] == sum(x["cpu_resident"] for x in plan.nodes)
    t = simulate(plan, hw)
    assert 0 < t.peak_bytes["cpu0"] <= host and 0 < t.peak_bytes["cpu1"] <= host
    assert t.peak_bytes["cpu"] == max(t.peak_bytes["cpu0"], t.peak_bytes["cpu1"])
    mt = t.metrics()
    assert mt["num_nodes"] == 2 and mt["peak_cpu1_bytes"] == t.peak_bytes["cpu1"]
    # a node whose own stages exceed its host is refused per node, in one line
    with pytest.raises(PlanError, match=r"node 0 \(stages 0-1\) does not fit: its host memory") as e:
        _plan(m, 4, per_node=2, hw=H200.with_(cpu_mem_bytes=host // 2), wl=wl)
    assert len(str(e.value).splitlines()) == 1


def test_the_lp_checks_each_nodes_host_memory():
    m = get_model("opt-6.7b")
    # a small GPU: most weights must go to the host, which holds a third of them (no room on disk either)
    hw = H200.with_(gpu_mem_bytes=2 << 30, cpu_mem_bytes=m.weight_bytes() // 3, disk_bytes=1 << 30)
    one = flexgen_stage_lp(m, hw, 64, 8, 4, 2, (8, 8, 8, 8))
    four = flexgen_stage_lp(m, hw, 64, 8, 4, 2, (8, 8, 8, 8), gpus_per_node=1)
    assert one is None and four is not None  # one host cannot hold the weights; four hosts can


def test_the_network_leg_is_priced_and_p2p_within_a_node_is_not():
    m = get_model("opt-1.3b")
    plan = _plan(m, 4, per_node=2)
    assert [s["node"] for s in plan.stages] == [0, 0, 1, 1]
    df = simulate(plan, H200).df
    p2p = df[df["kind"] == "p2p"]
    dur = p2p["end_s"] - p2p["start_s"]
    peers = {(o.device, o.peer) for o in plan.ops if o.kind == "p2p"}
    assert peers == {(0, 1), (1, 2), (2, 3), (3, 0)}
    for o in (o for o in plan.ops if o.kind == "p2p"):
        across = plan.node_of_device(o.device) != plan.node_of_device(o.peer)
        want = costmodel.network_p2p_seconds(H200, o.nbytes) if across else costmodel.p2p_seconds(H200, o.nbytes)
        assert dur.loc[o.id] == pytest.approx(want)
    n = 1 << 20  # GPU -> host, network, host -> GPU: one after another
    assert costmodel.network_p2p_seconds(H200, n) == pytest.approx(
        costmodel.transfer_seconds(H200, n, "d2h") + H200.link_latency_s + n / NET
        + costmodel.transfer_seconds(H200, n, "h2d"))
    # without a network rate a multi-node plan is refused, naming the field
    with pytest.raises(OffsimError, match="network_bytes_per_s"):
        simulate(plan, get_hardware("h200"))
    with pytest.raises(OffsimError, match="network_bytes_per_s"):
        _plan(m, 2, per_node=1, hw=get_hardware("h200"))
    assert "network_bytes_per_s" not in get_hardware("h200").to_dict()  # (0: left out, profiles read back the same)
    assert get_hardware("t4").network_bytes_per_s > 0  # FlexGen's testbed: documented in the preset's provenance


def test_each_node_has_its_own_host_cpu_and_link_share():
    m = get_model("opt-1.3b")
    st = {"percent": (0, 100, 0, 100, 100, 0), "cpu_attention": True}
    slow_cpu = H200.with_(cpu_attention_flops=H200.cpu_attention_flops / 100)  # CPU attention the bottleneck
    plan = _plan(m, 2, per_node=1, wl=Workload(64, 6, 4, 4), hw=slow_cpu, **st)
    t = simulate(plan, slow_cpu)
    df = t.df
    cpu = df[df["stream"] == "cpu"]
    iv = [sorted(zip(cpu[cpu["device"] == d]["start_s"], cpu[cpu["device"] == d]["end_s"])) for d in (0, 1)]
    for one in iv:  # one CPU stream per node: its ops one at a time ...
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(one, one[1:]))
    # ... but the two nodes' CPUs work at the same time
    assert any(a0 < b1 and a1 < b0 for a0, b0 in iv[0] for a1, b1 in iv[1])
    one_host = _plan(m, 2, wl=Workload(64, 6, 4, 4), hw=slow_cpu, **st)
    assert t.metrics()["decode_tok_s"] > 1.5 * simulate(one_host, slow_cpu).metrics()["decode_tok_s"]
    # link_concurrent_fraction is a host's: with one GPU per node every link runs at its full rate
    shared = H200.with_(link_concurrent_fraction=0.5)
    assert simulate(plan, shared).makespan_s == simulate(plan, H200).makespan_s
    one_host = _plan(m, 2, wl=Workload(64, 6, 4, 4), **st)
    assert simulate(one_host, shared).makespan_s > simulate(one_host, H200).makespan_s


def test_bad_gpus_per_node_is_refused_in_one_line(capsys):
    with pytest.raises(OffsimError, match=r"gpus_per_node must divide the 4 stages .* one of \[1, 2, 4\]"):
        FlexGenSettings(num_stages=4, gpus_per_node=3)
    with pytest.raises(OffsimError, match="gpus_per_node"):
        FlexGenSettings(num_stages=2, gpus_per_node=-1)
    rc = main(["simulate", "--model", "opt-1.3b", "--hardware", "h200", "--num-gpus", "4", "--gpus-per-node", "3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "one of [1, 2, 4]" in err
    from offsim.search import search

    with pytest.raises(OffsimError, match="one of \\[1, 2\\]"):
        search("flexgen", m := get_model("opt-1.3b"), H200, 64, 3, num_gpus=2, gpus_per_node=3)
    with pytest.raises(OffsimError, match="network_bytes_per_s"):
        search("flexgen", m, get_hardware("h200"), 64, 3, num_gpus=2, gpus_per_node=1)


def test_plan_json_round_trip_and_validate(tmp_path):
    plan = _plan(get_model("opt-1.3b"), 2, per_node=1)
    f = tmp_path / "p.json"
    plan.save(f)
    back = Plan.load(f).validate()
    assert back == plan and back.fingerprint() == plan.fingerprint() and back.nodes == plan.nodes
    assert back.to_dict()["nodes"] == plan.nodes and back.settings["gpus_per_node"] == 1
    # the nodes are part of what the plan does
    assert plan.fingerprint() != _plan(get_model("opt-1.3b"), 2).fingerprint()
    bad = Plan.load(f)
    bad.stages[1]["node"] = 3
    with pytest.raises(PlanError, match="nodes must run 0, 0, ..., 1"):
        bad.validate()
    bad = Plan.load(f)
    bad.nodes[1]["cpu_resident"] = bad.nodes[1]["cpu_capacity"] + 1
    with pytest.raises(PlanError, match="node 1's resident cpu bytes"):
        bad.validate()


def test_cli_search_and_simulate_over_nodes(capsys, tmp_path):
    argv = ["simulate", "--model", "opt-1.3b", "--hardware", "t4", "--prompt-len", "64", "--gen-len", "3",
            "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--percent", "0", "100", "0", "100", "100", "0",
            "--num-gpus", "2", "--gpus-per-node", "1", "--save-plan", str(tmp_path / "p.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 nodes" in out and "node 1 GPUs 1 host memory peak" in out
    assert Plan.load(tmp_path / "p.json").num_nodes == 2
    assert main(["search", "--model", "opt-1.3b", "--hardware", "t4", "--prompt-len", "64", "--gen-len", "3",
                 "--num-gpus", "2", "--gpus-per-node", "1", "--max-sims", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs of t4 (1 per node)" in out and '"gpus_per_node": 1' in out


def test_offexec_refuses_a_multi_node_plan_before_anything(tmp_path, capsys):
    from offexec.distributed import stage_plan
    from offexec.executor import run_plan
    from offexec.memory import ExecError

    plan = _plan(get_model("opt-1.3b"), 2, per_node=1)
    for run in (lambda: run_plan(plan, None, "cpu"), lambda: stage_plan(plan, 0)):
        with pytest.raises(ExecError, match="runs on 2 nodes .* one host only") as e:
            run()
        assert len(str(e.value).splitlines()) == 1
    plan.save(tmp_path / "p.json")
    from offexec.cli import main as offexec_main

    assert offexec_main(["run", "--plan", str(tmp_path / "p.json"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "one host only" in err
