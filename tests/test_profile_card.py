"""experiments.offexec.profile_card: a card's profile set beside a reference profile, computed from the JSON."""
import json

from experiments.offexec import profile_card
from offsim.core.specs import get_model, layer_key


def _profile(gpu, h2d, gemm, op_s):
    layer = layer_key(get_model("opt-30b"))
    return {"gpu_mem_bytes": 80 << 30, "gpu_peak_flops": 989e12, "gemm_efficiency": [[1024, gemm], [8192, gemm]],
            "h2d_pinned": [[1 << 20, h2d / 2], [1 << 30, h2d]], "duplex_fraction": 0.8,
            "op_times": [[layer, "graph", "ffn", [[1, op_s], [16, 2 * op_s]]],
                         [layer, "eager", "qkv", [[1, 1.0]]]],
            "provenance": {"measured": {"gpu": gpu}}}


def test_scalar_and_op_ratios(tmp_path):
    new, ref = tmp_path / "new.json", tmp_path / "ref.json"
    new.write_text(json.dumps(_profile("NVIDIA H100", 50e9, 0.6, 3e-4)))
    ref_d = _profile("NVIDIA H200", 55e9, 0.75, 2e-4)
    ref_d["op_times"] = ref_d["op_times"][:1]  # the eager row only in the new one: not compared
    ref.write_text(json.dumps(ref_d))
    rows = {name: (x, y) for name, x, y, _ in profile_card.scalar_rows(json.loads(new.read_text()), ref_d)}
    assert rows["H2D pinned, 1 GiB copy"] == (50.0, 55.0)
    assert rows["GEMM efficiency at 4096 tokens (burst)"] == (0.6, 0.75)
    assert rows["disk read"] == (None, None)
    ops = profile_card.op_ratio_rows(json.loads(new.read_text()), ref_d, layer_key(get_model("opt-30b")))
    assert [(m, p, n) for m, p, n, *_ in ops] == [("graph", "ffn", 2)]
    assert abs(ops[0][3] - 1.5) < 1e-12
    out = tmp_path / "README.md"
    assert profile_card.main([str(new), "--ref", str(ref), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| H2D pinned, 1 GiB copy | 50 | 55 | 0.91 | GB/s |" in text
    assert "| graph | ffn | 2 | 1.50 | 1.50 | 1.50 |" in text
