"""Memory tiers of the executor: the GPU budget, pinned host memory, GPU buffer pools and the disk tier.

- **GPU budget**: a "virtual" smaller GPU on a big one. ``apply_gpu_budget`` caps PyTorch's caching allocator with
  ``torch.cuda.set_per_process_memory_fraction`` (an allocation past the cap raises, so the run cannot quietly use
  more), and the executor refuses, before allocating anything large, a plan whose bytes do not fit
  (``check_gpu_budget``: the shortfall in bytes). Peaks come from the allocator's own counters.
- **Pinned host memory**: PyTorch's pinned allocator rounds every block up to a power of two (a 45 GB pool would pin
  64 GB), so large host pools are ordinary tensors page-locked in place with ``cudaHostRegister`` (``pin_``); small,
  short-lived host buffers use PyTorch's caching host allocator, which already tracks the streams that use them.
- **GPU buffer pools** (``BufferPool``): buffers that one stream fills and another reads (streamed weights, loaded
  KV) are reused through release events instead of the caching allocator, so the issuing thread can run ahead of the
  GPU without the allocator needing fresh memory for every buffer still in flight: the next user's stream waits on
  the events of the last users (``cudaStreamWaitEvent``), the host never blocks.
- **Disk tier** (``DiskTier``): file-backed tensors under a private directory that is removed on exit, read and
  written by worker threads with ``os.preadv`` / ``os.pwritev`` straight into (pinned) host buffers.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offsim.core.errors import OffsimError

GiB = 1 << 30


class ExecError(OffsimError):
    """The executor cannot run this plan here (budget, device, disk room, checkpoint): the message says why."""


# ----------------------------------------------------------------------------------------------------------------
# host memory
# ----------------------------------------------------------------------------------------------------------------
def touch_(t: torch.Tensor) -> torch.Tensor:
    """Fault in a fresh host tensor's pages with all of torch's threads (cudaHostRegister would do it on one)."""
    t.view(-1).view(torch.uint8).zero_()
    return t


def pin_(t: torch.Tensor) -> bool:
    """Page-lock a contiguous host tensor in place (cudaHostRegister). Returns False without CUDA."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise ExecError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed (error {int(err)}): "
                        "not enough host memory can be page-locked")
    return True


def unpin_(t: torch.Tensor) -> None:
    if torch.cuda.is_available() and t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostBuffer:
    """One large host tensor, optionally page-locked in place; ``close`` unlocks it."""

    def __init__(self, numel: int, dtype: torch.dtype, pinned: bool):
        self.tensor = touch_(torch.empty(max(numel, 0), dtype=dtype))
        self.pinned = pin_(self.tensor) if pinned else False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def set_pinned(self, pinned: bool) -> None:
        """Lock or unlock the pages (a plan with pageable host memory must copy from pageable memory)."""
        if pinned and not self.pinned:
            self.pinned = pin_(self.tensor)
        elif not pinned and self.pinned:
            unpin_(self.tensor)
            self.pinned = False

    def close(self) -> None:
        self.set_pinned(False)
        self.tensor = torch.empty(0, dtype=self.tensor.dtype)


def host_tensor(shape, dtype, device: torch.device) -> torch.Tensor:
    """A small host buffer: pinned (PyTorch's caching host allocator, stream-safe) when the executor runs on CUDA."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


# ----------------------------------------------------------------------------------------------------------------
# GPU budget
# ----------------------------------------------------------------------------------------------------------------
def apply_gpu_budget(device: torch.device, budget_bytes: int) -> None:
    """Cap the caching allocator of ``device`` at ``budget_bytes`` for the rest of the process."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    # a budget above the card (a preset's nominal size) caps nothing: the card itself is the limit
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    torch.cuda.reset_peak_memory_stats(device)


def check_gpu_budget(need: dict[str, int], budget_bytes: int) -> None:
    """Refuse a plan whose GPU bytes (``need``: name -> bytes) exceed the budget, naming the shortfall."""
    total = sum(need.values())
    if total > budget_bytes:
        parts = ", ".join(f"{k} {v / GiB:.3f} GiB" for k, v in need.items() if v)
        raise ExecError(f"the plan needs {total} bytes ({total / GiB:.3f} GiB) of GPU memory but the budget is "
                        f"{budget_bytes} bytes ({budget_bytes / GiB:.3f} GiB): short by {total - budget_bytes} bytes "
                        f"({parts}); raise --gpu-mem-gb or choose a policy that keeps less on the GPU")


# ----------------------------------------------------------------------------------------------------------------
# GPU buffer pools
# ----------------------------------------------------------------------------------------------------------------
class BufferPool:
    """Same-sized buffers handed out and returned with the events that must complete before reuse."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, device: torch.device):
        self.name, self.numel, self.dtype, self.device = name, numel, dtype, device
        self.free: deque = deque()
        self.count = 0
        self.lock = threading.Lock()

    @property
    def buffer_bytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def reserve(self, n: int) -> None:
        """Allocate buffers up front (so that a budget overflow shows before the run starts)."""
        while self.count < n:
            self.free.append((torch.empty(self.numel, dtype=self.dtype, device=self.device), ()))
            self.count += 1

    def acquire(self, stream=None) -> torch.Tensor:
        """A buffer for work about to be issued on ``stream``, which waits (on the GPU) until its last users ended."""
        with self.lock:
            if self.free:
                buf, events = self.free.popleft()
            else:  # more in flight than the plan-order count: grow (reported as pool growth)
                buf, events = torch.empty(self.numel, dtype=self.dtype, device=self.device), ()
                self.count += 1
        if stream is not None:
            for ev in events:
                stream.wait_event(ev)
        return buf

    def release(self, buf: torch.Tensor, events=()) -> None:
        with self.lock:
            self.free.append((buf, tuple(events)))

    def close(self) -> None:
        self.free.clear()


# ----------------------------------------------------------------------------------------------------------------
# disk tier
# ----------------------------------------------------------------------------------------------------------------
_LIVE_TIERS: set = set()


def _cleanup_all(*_args) -> None:
    for t in list(_LIVE_TIERS):
        t.close()


atexit.register(_cleanup_all)


_SIGNAL_INSTALLED = [False]


def _install_signal_cleanup() -> None:
    """On SIGTERM remove disk-tier files before dying (SIGINT raises KeyboardInterrupt, which unwinds through
    ``close`` in the executor's finally). Installed once per process, chaining to any earlier handler."""
    if _SIGNAL_INSTALLED[0] or threading.current_thread() is not threading.main_thread():
        return
    _SIGNAL_INSTALLED[0] = True
    prev = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        _cleanup_all()
        if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
            prev(signum, frame)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class DiskTier:
    """Files under a private directory in ``root``; every file goes when ``close`` runs (also at exit and on
    SIGTERM). Reads and writes of large ranges are split over ``threads`` worker threads."""

    CHUNK_BYTES = 64 << 20

    def __init__(self, root: str | Path | None, need_bytes: int, threads: int = 4):
        root = Path(root) if root else Path(tempfile.gettempdir())
        if not root.is_dir():
            raise ExecError(f"--disk-dir {root} is not a directory")
        free = shutil.disk_usage(root).free
        if need_bytes > free:
            raise ExecError(f"the disk tier needs {need_bytes} bytes in {root} but only {free} are free: short by "
                            f"{need_bytes - free} bytes; use --disk-dir on a larger disk or a plan with less on disk")
        self.dir = Path(tempfile.mkdtemp(prefix="offexec-", dir=root))
        self.files: dict[str, int] = {}
        self.size_bytes = 0
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offexec-disk")
        self.lock = threading.Lock()
        _LIVE_TIERS.add(self)
        _install_signal_cleanup()

    def create(self, name: str, nbytes: int) -> None:
        path = self.dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.files[name] = os.open(path, os.O_RDWR)
        self.size_bytes += nbytes

    def _io(self, name: str, t: torch.Tensor, offset: int, write: bool) -> None:
        fd = self.files[name]
        mv = memoryview(t.view(-1).view(torch.uint8).numpy())
        n = len(mv)
        jobs = []
        for a in range(0, n, self.CHUNK_BYTES):
            b = min(n, a + self.CHUNK_BYTES)
            fn = _pwrite_all if write else _pread_all
            jobs.append(self.pool.submit(fn, fd, mv[a:b], offset + a))
        for j in jobs:
            j.result()

    def read(self, name: str, dst: torch.Tensor, offset: int) -> None:
        """Fill contiguous host tensor ``dst`` from file ``name`` at byte ``offset``."""
        self._io(name, dst, offset, write=False)

    def write(self, name: str, src: torch.Tensor, offset: int) -> None:
        """Write contiguous host tensor ``src`` to file ``name`` at byte ``offset``."""
        self._io(name, src, offset, write=True)

    def close(self) -> None:
        with self.lock:
            if self not in _LIVE_TIERS:
                return
            _LIVE_TIERS.discard(self)
        self.pool.shutdown(wait=True)
        for fd in self.files.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n <= 0:
            raise ExecError(f"disk tier: short read at byte {offset}")
        mv, offset = mv[n:], offset + n


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwritev(fd, [mv], offset)
        mv, offset = mv[n:], offset + n
