"""Hardware presets are data (offsim/core/presets/hardware/<name>.json): each loads, says where every constant comes
from, agrees with its sources, ships with the package, and equals the Python preset it replaced (so no simulated
result moved)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from offsim.core.errors import OffsimError
from offsim.core.specs import GB, GiB, HARDWARE_PRESETS, Curve, HardwareSpec, get_hardware, load_hardware_preset

ROOT = Path(__file__).resolve().parents[1]
PRESET_DIR = ROOT / "offsim" / "core" / "presets" / "hardware"
PROBE = ROOT / "docs" / "h200_probe_2026-11-29.jsonl"


# ---- the Python builders these files replaced (offsim/core/specs.py at commit ddee5e6), frozen as the reference the
# ---- JSON must equal. If you recalibrate a preset on purpose, drop that preset from test_equal_to_the_python_preset.
def roofline_gemm_curve(peak_flops: float, hbm_bytes_per_s: float, compute_eff: float, mem_eff: float) -> Curve:
    """GEMM efficiency by tokens for a GPU known only by its datasheet: a [t x h] @ [h x 4h] fp16 GEMM does 2·t·h·4h
    FLOP on 2·h·4h bytes of weights, t FLOP per byte, so achieved = min(compute_eff·peak, mem_eff·HBM·t)."""
    pts = []
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384):
        pts.append((float(t), min(compute_eff, mem_eff * hbm_bytes_per_s * t / peak_flops)))
    return tuple(pts)


def _flat(bw: float) -> Curve:
    return ((1.0, bw), (1e12, bw))


def _h200() -> HardwareSpec:
    peak = 989e12  # H200 SXM dense fp16 tensor-core peak (NVIDIA datasheet)
    gemm_tflops = [(1, 4.10), (8, 32.28), (32, 128.83), (64, 256.57), (256, 612.52), (1024, 763.53),
                   (4096, 707.50), (16384, 670.43)]  # docs/anchors.md probe: [t x 7168] @ [7168 x 28672]
    pinned_h2d = [(1 << 20, 43.71e9), (4 << 20, 50.03e9), (16 << 20, 54.68e9), (64 << 20, 55.09e9),
                  (256 << 20, 54.78e9), (1 << 30, 55.16e9)]
    pinned_d2h = [(1 << 20, 48.63e9), (4 << 20, 52.79e9), (16 << 20, 55.02e9), (64 << 20, 55.09e9),
                  (256 << 20, 55.13e9), (1 << 30, 55.29e9)]
    pageable_h2d = [(1 << 20, 8.61e9), (4 << 20, 14.04e9), (16 << 20, 17.52e9), (64 << 20, 15.77e9),
                    (256 << 20, 17.90e9), (1 << 30, 18.99e9)]
    hbm = 4.8e12  # H200 HBM3e, datasheet
    return HardwareSpec(
        name="h200", gpu_mem_bytes=141 * GB, gpu_peak_flops=peak, gpu_hbm_bytes_per_s=hbm,
        gemm_efficiency=tuple((float(t), tf * 1e12 / peak) for t, tf in gemm_tflops),
        # not in the probe: flash-style prefill attention reaches about half of peak on Hopper (estimate; replace
        # with `offexec profile`)
        attn_prefill_efficiency=((128.0, 0.25), (512.0, 0.4), (2048.0, 0.5), (8192.0, 0.55)),
        # probe: SDPA decode read 3.13 TB/s of KV at ctx 512, 4.08 at 2048, 4.31 at 8192 (bs 8)
        attn_decode_efficiency=((512.0, 3.13e12 / hbm), (2048.0, 4.08e12 / hbm), (8192.0, 4.31e12 / hbm)),
        h2d_pinned=tuple((float(a), b) for a, b in pinned_h2d),
        d2h_pinned=tuple((float(a), b) for a, b in pinned_d2h),
        h2d_pageable=tuple((float(a), b) for a, b in pageable_h2d),
        d2h_pageable=tuple((float(a), b) for a, b in pageable_h2d),  # not measured: taken equal to H2D pageable
        duplex_fraction=49.46 / 55.2,  # probe: 1 GB each way at once kept 49.5 GB/s of 55.2
        cpu_mem_bytes=125 * GiB,  # usable host memory of the one-GPU machine
        # FlexGen's CPU attention measured on this host (docs/anchors.md: 12.78 decode tok/s, 48 seqs, ctx ~528, OPT-30B)
        # scans ~9.3 GB/s of fp16 KV, i.e. ~9.3 GFLOP/s (attention does 1 FLOP per KV byte)
        cpu_attention_flops=9.3e9,
        disk_bytes=64 * GiB, disk_read_bytes_per_s=1.07e9, disk_write_bytes_per_s=0.39e9,  # probe: virtio disk
        link_latency_s=0.0,  # the measured curves already include the per-copy cost
        kernel_overhead_s=30e-6,  # estimate: ~10 launches per layer op at ~3 us
        source="ANCHORS.md H200 probe 2026-11-29 (shared/docs/h200_probe_2026-11-29.jsonl); datasheet peak/HBM; "
               "prefill attention and kernel overhead estimated",
    )


def _t4() -> HardwareSpec:
    peak = 65e12  # T4 fp16 tensor-core peak (NVIDIA T4 datasheet)
    hbm = 320e9  # T4 GDDR6, datasheet
    mm_p = 21.24e12  # FlexGen's T4 profile (cost_model.py): prefill GEMM 21.24 TFLOP/s
    ctog = 12.89 * GiB  # FlexGen's T4 profile: CPU->GPU 12.89 GB/s (GB = 2^30 in FlexGen)
    return HardwareSpec(
        name="t4", gpu_mem_bytes=15 * GiB,  # 16 GB card; FlexGen's cost model budgets 15 GB of it ("gmem")
        gpu_peak_flops=peak, gpu_hbm_bytes_per_s=hbm,
        # roofline: capped at FlexGen's measured prefill GEMM rate, memory-bound below ~80 tokens at 0.8 x HBM
        # (which gives ~4 TFLOP/s at 16 tokens, FlexGen's decode "mm_flops_g" 4.3)
        gemm_efficiency=roofline_gemm_curve(peak, hbm, mm_p / peak, 0.8),
        attn_prefill_efficiency=((1.0, 9.97e12 / peak),),  # FlexGen's T4 profile: bmm_flops_p 9.97 TFLOP/s
        # FlexGen's T4 profile: decode bmm 0.079 TFLOP/s at 1 FLOP per KV byte = 79 GB/s of 320
        attn_decode_efficiency=((1.0, 0.079e12 / hbm),),
        h2d_pinned=_flat(ctog), d2h_pinned=_flat(ctog),  # PCIe 3.0 x16 is symmetric
        # pageable copies go through a staging buffer: about half the pinned rate on PCIe 3.0 hosts (estimate)
        h2d_pageable=_flat(ctog / 2), d2h_pageable=_flat(ctog / 2),
        duplex_fraction=0.9,  # assumed as measured on the H200's link
        cpu_mem_bytes=208 * GB,  # FlexGen's testbed: 208 GB DRAM
        cpu_attention_flops=0.0123e12,  # FlexGen's T4 profile: cpu_flops 0.0123 TFLOP/s
        disk_bytes=1500 * GB,  # 1.5 TB: four GCP local NVMe SSDs
        # GCP local SSD (NVMe), 4 x 375 GB: 2,650 MB/s read, 1,400 MB/s write (Google Cloud documentation)
        disk_read_bytes_per_s=2.65e9, disk_write_bytes_per_s=1.4e9,
        link_latency_s=10e-6, kernel_overhead_s=50e-6,
        source="T4 datasheet (65 TFLOP/s fp16, 320 GB/s); FlexGen's released T4 profile (cost_model.py: ctog 12.89 GB/s,"
               " mm_flops_p 21.24T, bmm_flops 9.97T/0.079T, cpu_flops 0.0123T); GCP local-SSD throughput; "
               "pageable = pinned/2 estimate",
    )


def _pcie4_gpu(name: str, mem: int, peak: float, hbm: float, link: float, cpu_mem: int, cpu_cores: int,
               src: str) -> HardwareSpec:
    return HardwareSpec(
        name=name, gpu_mem_bytes=mem, gpu_peak_flops=peak, gpu_hbm_bytes_per_s=hbm,
        gemm_efficiency=roofline_gemm_curve(peak, hbm, 0.7, 0.8),  # 70 % of peak, 80 % of HBM: typical cuBLAS
        attn_prefill_efficiency=((128.0, 0.2), (2048.0, 0.4), (8192.0, 0.45)),
        attn_decode_efficiency=((512.0, 0.6), (4096.0, 0.8)),
        h2d_pinned=((1 << 20, 0.8 * link), (16 << 20, link), (1 << 30, link)),
        d2h_pinned=((1 << 20, 0.8 * link), (16 << 20, link), (1 << 30, link)),
        h2d_pageable=_flat(link / 2), d2h_pageable=_flat(link / 2),
        duplex_fraction=0.9, cpu_mem_bytes=cpu_mem,
        cpu_attention_flops=cpu_cores * 1.0e9,  # ~1 GFLOP/s per core of fp16 attention in PyTorch (estimate)
        disk_bytes=2000 * GB, disk_read_bytes_per_s=3.0e9, disk_write_bytes_per_s=2.0e9,  # PCIe 4 NVMe (estimate)
        link_latency_s=10e-6, kernel_overhead_s=30e-6, source=src)


def _rtx3090() -> HardwareSpec:
    # RTX 3090: 24 GB, 71 TFLOP/s fp16 with fp32 accumulate (GA102 whitepaper), 936 GB/s; PCIe 4.0 x16 pinned
    # ~25.4 GB/s, which gives docs/anchors.md's ~2,800 FLOP per byte moved. TightLLM C1: 24-core CPU, 128 GB.
    return _pcie4_gpu("rtx3090", 24 * GiB, 71e12, 936e9, 25.4e9, 128 * GB, 24,
                      "GA102 whitepaper (71 TFLOP/s fp16/fp32-acc, 936 GB/s); PCIe 4.0 x16 25.4 GB/s (ANCHORS.md "
                      "ratio 2,800 FLOP/B); TightLLM C1 host (24 cores, 128 GB); efficiencies estimated")


def _a800() -> HardwareSpec:
    # A800 80 GB: A100 silicon, 312 TFLOP/s dense fp16, 2.04 TB/s HBM2e; PCIe 4.0 x16 ~26 GB/s (docs/anchors.md's
    # ~12,000 FLOP per byte). TightLLM C2: 26-core CPU, 256 GB.
    return _pcie4_gpu("a800", 80 * GB, 312e12, 2.04e12, 26e9, 256 * GB, 26,
                      "A100/A800 datasheet (312 TFLOP/s fp16, 2.04 TB/s); PCIe 4.0 x16 26 GB/s (ANCHORS.md ratio "
                      "12,000 FLOP/B); TightLLM C2 host (26 cores, 256 GB); efficiencies estimated")


LEGACY = {"t4": _t4, "rtx3090": _rtx3090, "a800": _a800, "h200": _h200}


# The `source` string of the old presets cited files outside the repository; the files cite docs/ instead.
_OLD_CITATIONS = {"ANCHORS.md H200 probe 2026-11-29 (shared/docs/h200_probe_2026-11-29.jsonl)":
                  "H200 probe 2026-11-29 (docs/anchors.md, docs/h200_probe_2026-11-29.jsonl)",
                  "(ANCHORS.md ratio": "(docs/anchors.md ratio"}


@pytest.mark.parametrize("name", HARDWARE_PRESETS)
def test_equal_to_the_python_preset(name):
    old = LEGACY[name]()
    src = old.source
    for a, b in _OLD_CITATIONS.items():
        src = src.replace(a, b)
    # (the presets gained quant_bytes_per_s after these were written: documented as HBM / QUANT_HBM_PASSES)
    from offsim.core.costmodel import QUANT_HBM_PASSES

    quant = old.gpu_hbm_bytes_per_s / QUANT_HBM_PASSES
    # (and the T4 the network rate between hosts of FlexGen's multi-node testbed: documented in its provenance)
    net = get_hardware(name).network_bytes_per_s if name == "t4" else 0.0
    assert get_hardware(name) == dataclasses.replace(old, source=src, quant_bytes_per_s=quant,
                                                     network_bytes_per_s=net)


def test_every_preset_has_a_file_and_every_file_is_a_preset():
    assert sorted(p.stem for p in PRESET_DIR.glob("*.json")) == sorted(HARDWARE_PRESETS)


@pytest.mark.parametrize("name", HARDWARE_PRESETS)
def test_file_is_the_profile_schema_with_a_source_for_every_field(name):
    d = json.loads((PRESET_DIR / f"{name}.json").read_text())
    prov = d.pop("provenance")
    assert d["schema"] == "offsim.hardware/1" and d["name"] == name
    hw = load_hardware_preset(name)
    # the file holds exactly what to_dict gives (fields that a later HardwareSpec adds with a default may be absent)
    full = hw.to_dict()
    assert {k: full[k] for k in d} == d
    assert set(full) - set(d) <= {f.name for f in dataclasses.fields(HardwareSpec)
                                  if f.default is not dataclasses.MISSING}
    missing = [k for k in d if k != "schema" and not str(prov.get(k, "")).strip()]
    assert not missing, f"{name}.json: no provenance for {missing}"
    assert not set(prov) - set(d), f"{name}.json: provenance for fields it does not have: {set(prov) - set(d)}"
    assert "ANCHORS.md" not in json.dumps(prov) + hw.source and "shared/docs" not in hw.source


def _probe(kind):
    return [r for r in map(json.loads, PROBE.read_text().splitlines()) if r["kind"] == kind]


def _close(curve: Curve, points, rel=5e-3):
    assert len(curve) == len(points)
    for (x, y), (px, py) in zip(curve, points):
        assert x == px and y == pytest.approx(py, rel=rel)


def test_h200_matches_its_probe():
    """The h200 preset's measured curves are the probe's lines (rounded to 0.01 in the preset)."""
    hw = get_hardware("h200")
    pcie = _probe("pcie")
    _close(hw.h2d_pinned, [(r["MB"] << 20, r["h2d_GBps"] * 1e9) for r in pcie])
    _close(hw.d2h_pinned, [(r["MB"] << 20, r["d2h_GBps"] * 1e9) for r in pcie])
    _close(hw.h2d_pageable, [(r["MB"] << 20, r["h2d_pageable_GBps"] * 1e9) for r in pcie])
    gemm = [r for r in _probe("gemm") if r["h"] == 7168]  # OPT-30B's FFN shape
    _close(hw.gemm_efficiency, [(r["tokens"], r["tflops"] * 1e12 / hw.gpu_peak_flops) for r in gemm])
    dec = [r for r in _probe("attn_decode") if r["bs"] == 8]
    _close(hw.attn_decode_efficiency, [(r["ctx"], r["GBps"] * 1e9 / hw.gpu_hbm_bytes_per_s) for r in dec])
    (duplex,) = _probe("pcie_duplex")
    assert hw.duplex_fraction == pytest.approx(duplex["GBps_each"] / 55.2, rel=1e-3)
    (disk,) = _probe("disk")
    assert hw.disk_read_bytes_per_s == pytest.approx(disk["read_GBps"] * 1e9, rel=5e-3)
    assert hw.disk_write_bytes_per_s == pytest.approx(disk["write_GBps"] * 1e9, rel=1e-2)


@pytest.mark.parametrize("name", ["t4", "rtx3090", "a800"])
def test_datasheet_gemm_curves_are_the_roofline_their_provenance_states(name):
    hw = get_hardware(name)
    cap = max(y for _, y in hw.gemm_efficiency)
    for t, y in hw.gemm_efficiency:
        assert y == pytest.approx(min(cap, 0.8 * hw.gpu_hbm_bytes_per_s * t / hw.gpu_peak_flops), rel=1e-12)


def test_presets_ship_as_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["offsim.core"]
    shipped = {p for g in globs for p in (ROOT / "offsim" / "core").glob(g)}
    assert {PRESET_DIR / f"{n}.json" for n in HARDWARE_PRESETS} <= shipped


def test_bad_preset_name_is_one_line_error():
    with pytest.raises(OffsimError, match="valid presets: t4, rtx3090, a800, h200"):
        get_hardware("v100")
    with pytest.raises(OffsimError, match="valid: t4"):
        load_hardware_preset("v100")
