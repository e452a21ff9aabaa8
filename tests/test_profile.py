"""offexec profile writes a hardware profile that offsim loads and simulates with (CPU, quick mode)."""
import json

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
    m = get_model("opt-125m")
    tr = simulate(build_plan("flexgen", m, hw, Workload(16, 2, 2, 1), {"percent": (0, 100, 0, 100, 100, 0)}), hw)
    assert tr.metrics()["total_tok_s"] > 0
    assert not list(tmp_path.glob("offexec-profile-*"))  # the disk probe cleaned up
