"""offexec profile writes a hardware profile that offsim loads and simulates with (CPU, quick mode)."""
import json
import os

import pytest

from offsim import Workload, build_plan, simulate
from offsim.core.specs import HardwareSpec, get_hardware, get_model


def test_profile_cpu_quick_roundtrip(tmp_path):
    from offexec.profile import main

    out = tmp_path / "cpu.json"
    assert main(["profile", "--device", "cpu", "--quick", "--model", "opt-125m", "--out", str(out),
                 "--disk-dir", str(tmp_path)]) == 0
    d = json.loads(out.read_text())
    assert d["schema"] == "offsim.hardware/1" and d["provenance"]["commit"]
    hw = HardwareSpec.from_json(out)
    assert hw == get_hardware(str(out))
    assert all(bw > 0 for _, bw in hw.h2d_pinned) and 0 < hw.duplex_fraction <= 1
    assert min(hw.disk_read_bytes_per_s, hw.disk_write_bytes_per_s, hw.disk_cached_read_bytes_per_s,
               hw.disk_cached_write_bytes_per_s) > 0
    m = get_model("opt-125m")
    tr = simulate(build_plan("flexgen", m, hw, Workload(16, 2, 2, 1), {"percent": (0, 100, 0, 100, 100, 0)}), hw)
    assert tr.metrics()["total_tok_s"] > 0
    assert not list(tmp_path.glob("offexec-profile-*"))  # the disk probe cleaned up
    # the 4-bit dequantize rates through offexec's own kernels: the KV cache's and the weights', each its own
    q = d["provenance"]["quant_rates"]
    assert hw.quant_bytes_per_s == q["quant_kv_bytes_per_s"] > 0
    assert hw.quant_weight_bytes_per_s == q["quant_weight_bytes_per_s"] > 0
    # and the KV store's quantize (pack_vectors_into, a prefill's K and V), its own rate
    assert hw.quant_store_bytes_per_s == q["quant_store_bytes_per_s"] > 0
    # --quant-only re-measures just that on a base profile, the rest kept
    out2 = tmp_path / "cpu2.json"
    assert main(["profile", "--device", "cpu", "--base", str(out), "--quant-only", "--model", "opt-125m",
                 "--out", str(out2)]) == 0
    d2 = json.loads(out2.read_text())
    assert d2["quant_bytes_per_s"] > 0 and d2["h2d_pinned"] == d["h2d_pinned"]
    assert d2["provenance"]["quant_rates"]["quant_bytes_per_s"] == d2["quant_bytes_per_s"]
    assert d2["quant_store_bytes_per_s"] > 0 and d2["quant_weight_bytes_per_s"] > 0
    assert d2["provenance"]["quant_rates"]["quant_store_bytes_per_s"] == d2["quant_store_bytes_per_s"]
    # the host's state as the profile was measured (offexec.hostprobe), and --host-probe-only records it anew
    hp = d["provenance"]["host_probe"]
    assert hp["cpu_attn_ms"] > 0 and hp["host_copy_GB_s"] > 0 and hp["logical_cpus"] >= 1 and hp["date"]
    assert "host_probe" not in d2["provenance"] or d2["provenance"]["host_probe"] == hp  # --quant-only keeps it
    out3 = tmp_path / "cpu3.json"
    assert main(["profile", "--device", "cpu", "--base", str(out), "--host-probe-only", "--out", str(out3)]) == 0
    d3 = json.loads(out3.read_text())
    assert d3["provenance"]["host_probe"]["date"] >= hp["date"] and d3["h2d_pinned"] == d["h2d_pinned"]
    assert main(["profile", "--device", "cpu", "--host-probe-only", "--out", str(out3)]) == 2  # no --base
    # the link sweep: no link on the CPU (an empty record); --link-sweep-only needs a base and a CUDA GPU
    assert d["provenance"]["link_sweep"] == {}
    assert main(["profile", "--device", "cpu", "--link-sweep-only", "--out", str(out3)]) == 2  # no --base
    assert main(["profile", "--device", "cpu", "--base", str(out), "--link-sweep-only", "--out", str(out3)]) == 2
    assert main(["profile", "--device", "cpu", "--base", str(out), "--link-sweep-only", "--sweep-pool-gb", "0",
                 "--out", str(out3)]) == 2


def test_h2d_sweep_times_whole_passes_over_the_pool():
    """offexec.profile.h2d_sweep: every whole chunk of the pool once a pass (the remainder left out), each pass's
    rate, the last one as the sweep's, and one chunk copied as often as there are chunks."""
    import torch

    from offexec.profile import h2d_sweep

    host = torch.ones(10 << 20, dtype=torch.uint8)
    r = h2d_sweep(host, "cpu", chunk_bytes=4 << 20, passes=3)
    assert r["chunk_bytes"] == 4 << 20 and r["pool_bytes"] == 8 << 20
    assert len(r["pass_bytes_per_s"]) == 3 and r["h2d_sweep_bytes_per_s"] == r["pass_bytes_per_s"][-1] > 0
    assert r["h2d_repeat_bytes_per_s"] > 0
    whole = h2d_sweep(host, "cpu", chunk_bytes=64 << 20, passes=1)  # a chunk larger than the pool: the pool
    assert whole["chunk_bytes"] == whole["pool_bytes"] == 10 << 20
    with pytest.raises(ValueError, match="at least one chunk and one pass"):
        h2d_sweep(host, "cpu", passes=0)


def test_profile_disk_times_the_disk_tier_itself(tmp_path, monkeypatch):
    """The disk probe runs DiskTier's own I/O: O_DIRECT jobs for the cold rates, page-cached jobs for the cached."""
    from offexec import memory
    from offexec.profile import profile_disk

    calls = {"direct": 0, "cached": 0}
    for kind, name in (("direct", "_job_direct"), ("cached", "_job_cached")):
        orig = getattr(memory.DiskTier, name)

        def counted(self, *a, _orig=orig, _kind=kind):
            calls[_kind] += 1
            return _orig(self, *a)

        monkeypatch.setattr(memory.DiskTier, name, counted)
    rates = profile_disk(str(tmp_path), 3 << 20, reps=1)
    assert set(rates) == {"disk_read_bytes_per_s", "disk_write_bytes_per_s", "disk_cached_read_bytes_per_s",
                          "disk_cached_write_bytes_per_s"} and min(rates.values()) > 0
    assert calls["direct"] > 0 and calls["cached"] > 0
    assert os.listdir(tmp_path) == []


def test_profile_flexgen_only_refuses_clearly_where_flexgen_cannot_run(tmp_path, capsys):
    """--flexgen-only times FlexGen 0.1.8's own code: on the CPU (or without the package, or for a Llama) there is
    nothing to time, so it stops with a message naming what it needs, and writes nothing."""
    from offexec.profile import main

    base = tmp_path / "base.json"
    base.write_text(json.dumps(get_hardware("h200").to_dict()))
    out = tmp_path / "out.json"
    assert main(["profile", "--device", "cpu", "--base", str(base), "--ops", "opt-125m", "--flexgen-only",
                 "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "--flexgen-only" in err and "flexgen package" in err and "CUDA" in err and "Traceback" not in err
    assert main(["profile", "--device", "cuda", "--base", str(base), "--ops", "llama-3-8b", "--flexgen-only",
                 "--out", str(out)]) != 0
    assert "runs OPT models" in capsys.readouterr().err
    assert not out.exists()


def test_host_probe_keeps_the_fastest_round(monkeypatch):
    """A transient slows one round of the host probe's CPU-attention op, a state of the host slows every round: the
    probe keeps the fastest round's median and records them all."""
    import offexec.hostprobe as HP
    import offexec.profile as P

    times = iter([0.010, 0.002, 0.0025, 0.004])  # three attention rounds (the first hit a transient), then the copy
    monkeypatch.setattr(P, "_median_time", lambda fn, device, reps, warmup=2: next(times))
    monkeypatch.setattr(HP, "PROBE_GAP_S", 0.0)
    hp = HP.host_probe(reps=1, rounds=3)
    assert hp["cpu_attn_ms"] == 2.0 and hp["cpu_attn_rounds_ms"] == [10.0, 2.0, 2.5]
    assert hp["host_copy_GB_s"] == 2 * HP.PROBE_COPY_BYTES / 0.004 / 1e9


def test_profile_merge_combines_parts_measured_from_one_base(tmp_path, capsys):
    """--merge: profiles measured from one base over several calls (one model each) combine into one; a row two
    parts measured differently, or a changed scalar, is refused with a message and nothing is written."""
    from offexec.profile import main

    base_d = json.loads(open("results/profiles/h200_offexec_v2.json").read())
    base = tmp_path / "base.json"
    base.write_text(json.dumps(base_d))
    shapes = sorted({r[0] for r in base_d["op_times"]})
    assert len(shapes) >= 2

    def part(name, shape, scale, extra_row=None, **fields):
        d = json.loads(json.dumps(base_d))
        for r in d["op_times"]:
            if r[0] == shape and r[1] == "graph":
                r[3] = [[x, t * scale] for x, t in r[3]]
        if extra_row:
            d["op_times"].append(extra_row)
        d["provenance"]["decode_op_tables"] = {"models": [name]}
        d.update(fields)
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        return str(p)

    a = part("a", shapes[0], 0.5, [shapes[0], "issue", "eager:new_part", [[1.0, 1e-4]]])
    b = part("b", shapes[1], 2.0)
    out = tmp_path / "merged.json"
    assert main(["profile", "--base", str(base), "--merge", a, b, "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    rows = {tuple(r[:3]): r[3] for r in m["op_times"]}
    for r in base_d["op_times"]:
        want = ([[x, t * 0.5] for x, t in r[3]] if r[0] == shapes[0] and r[1] == "graph" else
                [[x, t * 2.0] for x, t in r[3]] if r[0] == shapes[1] and r[1] == "graph" else r[3])
        assert rows[tuple(r[:3])] == want
    assert rows[(shapes[0], "issue", "eager:new_part")] == [[1.0, 1e-4]]  # a row only a part has is added
    assert m["provenance"]["decode_op_tables"] == [{"models": ["a"]}, {"models": ["b"]}]
    assert m["provenance"]["op_tables"] == base_d["provenance"]["op_tables"]  # untouched records kept
    assert m["provenance"]["merged"]["parts"] == [a, b]
    HardwareSpec.from_json(out)
    # the same row measured differently by two parts, and a changed scalar: refused, nothing written
    out2 = tmp_path / "never.json"
    c = part("c", shapes[0], 3.0)
    assert main(["profile", "--base", str(base), "--merge", a, c, "--out", str(out2)]) == 2
    assert "both measured row" in capsys.readouterr().err
    e = part("e", shapes[1], 1.0, duplex_fraction=0.5)
    assert main(["profile", "--base", str(base), "--merge", e, "--out", str(out2)]) == 2
    assert "duplex_fraction" in capsys.readouterr().err
    assert main(["profile", "--merge", a, "--out", str(out2)]) == 2  # no --base
    assert "--base" in capsys.readouterr().err and not out2.exists()


def test_profile_asked_for_cuda_without_it_is_one_line(tmp_path, capsys):
    """--base P --ops M (any table) with the default --device cuda on a machine without CUDA: one line that says so
    and what to use instead, nothing written -- not a traceback from the first CUDA tensor."""
    import torch

    from offexec.profile import main

    if torch.cuda.is_available():
        return  # (the machine has CUDA: nothing to refuse)
    base = tmp_path / "base.json"
    base.write_text(json.dumps(get_hardware("h200").to_dict()))
    out = tmp_path / "out.json"
    for extra in (["--decode-only"], ["--sustained-only"], ["--sustained-only", "layer"], ["--attention-only"],
                  ["--attention-only", "decode"]):
        assert main(["profile", "--base", str(base), "--ops", "opt-125m", *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "no CUDA device" in err and "--device cpu" in err and "Traceback" not in err
    assert not out.exists()


def test_profile_disk_ops_prices_each_disk_request(tmp_path, monkeypatch, capsys):
    """--disk-ops-only: the disk tier's time per request by size, through DiskTier's own O_DIRECT path, added to a
    base profile (the rest kept); offsim then prices a disk op from that curve (linear between sizes, proportional
    past the largest), an LP's expression still at the rate; without the curve, bytes at the rate as before."""
    import offexec.profile as P
    from offexec.cli import main
    from offsim.core import costmodel as cm

    monkeypatch.setattr(P, "DISK_OP_SIZES", (4608, 73728, 1 << 20))
    base = tmp_path / "base.json"
    base.write_text(json.dumps(get_hardware("h200").to_dict()))
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "p.json"
    assert main(["profile", "--base", str(base), "--disk-ops-only", "--device", "cpu", "--disk-dir", str(disk),
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert os.listdir(disk) == []  # the tier removed its files
    d = json.loads(out.read_text())
    assert [x for x, _ in d["disk_write_op"]] == [4608, 73728, 1 << 20] and all(y > 0 for _, y in d["disk_read_op"])
    assert d["provenance"]["disk_ops"]["sizes"] == [4608, 73728, 1 << 20]
    hw, plain = HardwareSpec.from_dict(d), get_hardware("h200")
    assert hw.disk_read_bytes_per_s == plain.disk_read_bytes_per_s  # the base profile's rates kept
    (x0, y0), (x1, y1) = hw.disk_write_op[:2]
    mid = (x0 + x1) / 2
    assert cm.disk_seconds(hw, mid, "write") == pytest.approx((y0 + y1) / 2)
    big = hw.disk_read_op[-1]
    assert cm.disk_seconds(hw, 4 * big[0], "read") == pytest.approx(4 * big[1])
    assert cm.disk_seconds(plain, mid, "write") == pytest.approx(mid / plain.disk_write_bytes_per_s)
    import cvxpy as cp
    x = cp.Variable()
    assert cm.disk_seconds(hw, 1000 * x, "write").is_affine()
    # a plan with KV on disk: its small decode stores cost their measured time, not their bytes at the rate
    model, wl = get_model("opt-1.3b"), Workload(64, 8, 4, 2)
    plan = build_plan("flexgen", model, plain, wl, {"percent": (100, 0, 0, 50, 100, 0)})
    fast, slow = simulate(plan, plain), simulate(plan, hw.with_(disk_write_op=((1.0, 0.01),)))
    w = lambda t: t.df[t.df["kind"] == "disk_write"]  # noqa: E731
    assert len(w(fast)) > 0 and (w(slow)["end_s"] - w(slow)["start_s"]).min() >= 0.01 - 1e-12


def test_disk_op_curves_are_checked():
    d = get_hardware("h200").to_dict()
    assert "disk_read_op" not in d  # not measured: left out, so older profiles read back the same
    with pytest.raises(Exception, match=r"disk_write_op must be a list of positive \[bytes, seconds\] pairs"):
        HardwareSpec.from_dict({**d, "disk_write_op": [[4096, 1e-3], [1024, 2e-3]]})


def test_clock_probe_layer_load_runs_the_models_layer():
    """``--sustained-only layer``'s load: the model's whole prefill decoder layer as offexec computes it (OPT and a
    GQA Llama), timed n at a time, with a burst's and a window's op counts; a load the probe does not know is refused
    by name; on the CPU no clock rows (nothing throttles)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from offexec.profile import SUSTAINED_LOADS, _layer_ops, sustained_rows
    from offexec.testing import tiny_hf

    for family in ("opt", "llama"):
        _, spec = tiny_hf(family)
        seconds, n_burst, n_window = _layer_ops(spec, "cpu", tokens=64)
        assert seconds(2) > 0 and 1 <= n_burst <= n_window
        assert sustained_rows(spec, "cpu", "layer") == []
    assert SUSTAINED_LOADS == ("ffn", "layer")
    with pytest.raises(ValueError, match="ffn, layer"):
        sustained_rows(spec, "cpu", "gemm")
