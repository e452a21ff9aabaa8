"""The disk tier: O_DIRECT round trips of arbitrary, unaligned ranges; the page-cached mode; the refusal of a
directory that cannot bypass the page cache."""
import errno
import fcntl
import os
import random
import tempfile
from pathlib import Path

import pytest
import torch

from offexec import memory
from offexec.memory import DiskTier, ExecError, check_disk_dir

REPO = Path(__file__).resolve().parents[1]


def direct_io_dir() -> str | None:
    """A directory whose filesystem takes O_DIRECT: the system temp directory, else one under the repository."""
    for root in (tempfile.gettempdir(), str(REPO)):
        try:
            check_disk_dir(root, 0, cached=False)
            return root
        except ExecError:
            continue
    return None


@pytest.fixture
def odirect_dir():
    root = direct_io_dir()
    if root is None:
        pytest.skip("no directory here (temp dir, repository) is on a filesystem that takes O_DIRECT")
    d = tempfile.mkdtemp(prefix="test-disk-tier-", dir=root)
    yield d
    assert os.listdir(d) == []  # the tier removed its files
    os.rmdir(d)


def _roundtrip(tier: DiskTier, file_bytes: int, seed: int, n_ranges: int = 60):
    """Write random unaligned ranges (random data, random buffer offsets), mirror them in a reference array, then
    read random unaligned ranges back, into buffers that are and are not block-aligned."""
    rng = random.Random(seed)
    tier.create("x.bin", file_bytes)
    ref = torch.zeros(file_bytes, dtype=torch.uint8)
    for _ in range(n_ranges):
        a = rng.randrange(file_bytes)
        b = min(file_bytes, a + rng.choice([1, 3, 511, 4095, 4096, 4097, 9000, rng.randrange(1, 3 * tier.CHUNK_BYTES)]))
        lead = rng.choice([0, 1, 7, 64, 4096])  # the source's start in its own allocation: aligned or not
        backing = memory.aligned_empty(lead + b - a, 4096)
        src = backing[lead:]
        src.random_(0, 256, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        tier.write("x.bin", src, a)
        ref[a:b] = src
    for _ in range(n_ranges):
        a = rng.randrange(file_bytes)
        b = min(file_bytes, a + rng.randrange(1, 3 * tier.CHUNK_BYTES))
        lead = rng.choice([0, 5, 4096 - a % 4096])  # the last one makes buffer and file congruent: in-place path
        dst = memory.aligned_empty(lead + b - a, 4096)[lead:]
        tier.read("x.bin", dst, a)
        assert torch.equal(dst, ref[a:b]), (a, b, lead)
    whole = torch.empty(file_bytes, dtype=torch.uint8)
    tier.read("x.bin", whole, 0)
    assert torch.equal(whole, ref)


def test_odirect_roundtrip_of_unaligned_ranges(odirect_dir):
    t = DiskTier(odirect_dir, 1 << 20, threads=3)
    try:
        assert not t.cached and t.align >= 512 and t.align & (t.align - 1) == 0
        t.CHUNK_BYTES = 3 * t.align  # several chunks (and worker threads) per request
        _roundtrip(t, 100_003, seed=1)
        path = t.dir / "x.bin"
        assert path.stat().st_size % t.align == 0  # padded to whole blocks
        assert fcntl.fcntl(t.files["x.bin"], fcntl.F_GETFL) & os.O_DIRECT
    finally:
        t.close()


def test_odirect_roundtrip_large_chunks(odirect_dir):
    """Default chunking on a multi-chunk file: requests larger than one chunk, split over the workers."""
    t = DiskTier(odirect_dir, 64 << 20)
    try:
        _roundtrip(t, (20 << 20) + 12345, seed=2, n_ranges=12)
    finally:
        t.close()


def test_cached_roundtrip(tmp_path):
    t = DiskTier(tmp_path, 1 << 20, threads=3, cached=True)
    try:
        assert t.cached and t.align == 1
        t.CHUNK_BYTES = 1000
        _roundtrip(t, 50_001, seed=3)
        assert not fcntl.fcntl(t.files["x.bin"], fcntl.F_GETFL) & os.O_DIRECT
    finally:
        t.close()
    assert os.listdir(tmp_path) == []


def test_out_of_file_range_is_refused(tmp_path):
    t = DiskTier(tmp_path, 1 << 20, cached=True)
    try:
        t.create("x.bin", 100)
        with pytest.raises(ExecError, match=r"bytes \[96, 104\) are outside file x.bin of 100 bytes"):
            t.write("x.bin", torch.zeros(8, dtype=torch.uint8), 96)
    finally:
        t.close()


def test_einval_refusal_is_one_line_naming_the_directory(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(memory, "filesystem_type", lambda root: "overlay")
    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ExecError) as e:
        DiskTier(tmp_path, 1 << 20)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and "O_DIRECT" in msg and "Invalid argument" in msg
    assert "--disk-dir" in msg and "--disk-cache" in msg
    assert os.listdir(tmp_path) == []  # the probe file is gone
    t = DiskTier(tmp_path, 1 << 20, cached=True)  # the cached mode asks for no O_DIRECT
    t.close()


def test_memory_filesystem_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "filesystem_type", lambda root: "tmpfs")
    with pytest.raises(ExecError, match=f"{tmp_path} is on tmpfs, which keeps its files in memory; pass --disk-dir"):
        check_disk_dir(tmp_path, 0)
    assert check_disk_dir(tmp_path, 0, cached=True) == tmp_path


def test_a_disk_dir_that_is_missing_or_takes_no_files_says_so(tmp_path):
    with pytest.raises(ExecError, match="does not exist"):
        check_disk_dir(tmp_path / "missing" / "dd", 0, cached=True)
    if os.path.isdir("/proc/self"):  # (it reported a disk of 0 bytes: "short by 0.00 GiB")
        with pytest.raises(ExecError, match="takes no files"):
            check_disk_dir("/proc/self", 1, cached=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="no /proc/self/mountinfo (not Linux)")
def test_filesystem_type_takes_the_innermost_mount():
    assert memory.filesystem_type("/proc/self") == "proc"
    assert memory.filesystem_type("/") not in ("", "proc")


# ---- offsim: the page-cached disk tier is a plan-level choice, priced at the profile's page-cached rates ----------
def _disk_plan(tiny_opt, hw):
    from offsim import Workload, build_plan

    return build_plan("flexgen", tiny_opt, hw, Workload(8, 4, 2, 2), {"percent": (0, 0, 0, 0, 100, 0)})


def test_cached_disk_rates_price_cached_plans(tiny_opt, small_gpu_t4):
    from offsim.core import costmodel as cm
    from offsim import simulate
    from offsim.core.errors import OffsimError
    from offsim.core.plan import Plan

    hw = small_gpu_t4.with_(disk_cached_read_bytes_per_s=4 * small_gpu_t4.disk_read_bytes_per_s,
                            disk_cached_write_bytes_per_s=2 * small_gpu_t4.disk_write_bytes_per_s)
    assert cm.disk_seconds(hw, 1e9, "read", cached=True) == pytest.approx(1e9 / hw.disk_cached_read_bytes_per_s)
    assert cm.disk_seconds(hw, 1e9, "write", cached=True) == pytest.approx(1e9 / hw.disk_cached_write_bytes_per_s)
    assert cm.disk_seconds(hw, 1e9, "read") == pytest.approx(1e9 / hw.disk_read_bytes_per_s)
    plan = _disk_plan(tiny_opt, hw)
    assert not plan.disk_cached and any(o.kind == "disk_read" for o in plan.ops)
    cached = Plan.from_dict({**plan.to_dict(), "disk_cached": True}).validate()
    assert cached.disk_cached and Plan.from_dict(cached.to_dict()) == cached
    assert cached.fingerprint() != plan.fingerprint()  # a different run
    d = plan.to_dict()
    d.pop("disk_cached")  # a plan saved before the field: the O_DIRECT tier, same fingerprint
    assert Plan.from_dict(d).fingerprint() == plan.fingerprint()
    df_direct, df_cached = simulate(plan, hw).df, simulate(cached, hw).df
    for kind, rate, cold in (("disk_read", hw.disk_cached_read_bytes_per_s, hw.disk_read_bytes_per_s),
                             ("disk_write", hw.disk_cached_write_bytes_per_s, hw.disk_write_bytes_per_s)):
        for df, bw in ((df_direct, cold), (df_cached, rate)):
            ops = df[df["kind"] == kind]
            assert len(ops) and ((ops["end_s"] - ops["start_s"]) * bw / ops["nbytes"]).to_numpy() == \
                pytest.approx(1.0, rel=1e-6)
    assert simulate(cached, hw).meta.get("disk_cached") is True
    # a profile without page-cached rates (every older one) cannot price a cached plan: one line saying so
    with pytest.raises(OffsimError, match="no page-cached disk rate .*disk_cached_read_bytes_per_s"):
        simulate(cached, small_gpu_t4)
    with pytest.raises(OffsimError, match="disk_cached_read_bytes_per_s must be a finite non-negative number"):
        small_gpu_t4.with_(disk_cached_read_bytes_per_s=-1.0)
