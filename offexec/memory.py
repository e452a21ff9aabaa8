"""Memory tiers of the executor: the GPU budget, pinned host memory, GPU buffer pools and the disk tier.

- **GPU budget**: a "virtual" smaller GPU on a big one. ``apply_gpu_budget`` caps PyTorch's caching allocator with
  ``torch.cuda.set_per_process_memory_fraction`` (an allocation past the cap raises, so the run cannot quietly use
  more), and the executor refuses, before allocating anything large, a plan whose bytes do not fit
  (``check_gpu_budget``: the shortfall in bytes). Peaks come from the allocator's own counters.
- **Pinned host memory**: PyTorch's pinned allocator rounds every block up to a power of two (a 45 GB pool would pin
  64 GB), so large host pools are ordinary tensors page-locked in place with ``cudaHostRegister`` (``pin_``); small,
  short-lived host buffers use PyTorch's caching host allocator, which already tracks the streams that use them.
- **The GPU arena** (``GpuArena``): every buffer whose size the plan fixes -- embeddings, token ids, RoPE tables,
  resident weights, resident KV, weight slots and KV work buffers -- is a view of one allocation made at the start of
  a run, exactly the sum of their sizes (each rounded up to ``GpuArena.ALIGN_BYTES``). The caching allocator then
  only serves the values and temporaries of compute ops, so it has nothing large to fragment around, and what a run
  holds is the plan's footprint (offsim/core/footprint.py ``executor_gpu_bytes``), not what the allocator made of it.
- **Streams** (``executor_streams``): one set of CUDA streams per device for the life of the process. A stream's
  first GEMM makes cuBLAS allocate a workspace that PyTorch keeps until the process ends; fresh streams per run
  would leak one per run (32 MiB each on Hopper) and pin the segments they were carved from.
- **GPU buffer pools** (``BufferPool``): buffers that one stream fills and another reads (streamed weights, loaded
  KV) are reused through release events instead of the caching allocator, so the issuing thread can run ahead of the
  GPU without the allocator needing fresh memory for every buffer still in flight: the next user's stream waits on
  the events of the last users (``cudaStreamWaitEvent``), the host never blocks.
- **Disk tier** (``DiskTier``): file-backed tensors under a private directory that is removed on exit, read and
  written by worker threads with ``os.preadv`` / ``os.pwritev``, with O_DIRECT (past the page cache, so a run
  times the disk) unless the plan asks for the page-cached tier (``Plan.disk_cached``).
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from offsim.core.errors import OffsimError

GiB = 1 << 30


class ExecError(OffsimError):
    """The executor cannot run this plan here (budget, device, disk room, checkpoint): the message says why."""


def parse_device(name) -> "torch.device":
    """``name`` as a torch device, or one line saying it is none and what is."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ExecError(f"--device {name!r} is not a device ({' '.join(str(e).split())}); valid: cpu, cuda, "
                        "cuda:N") from None
    if dev.type == "cpu" and dev.index not in (None, 0):  # torch takes 'cpu:3', yet there is one CPU device
        raise ExecError(f"--device {name!r}: the CPU is one device, 'cpu'; valid: cpu, cuda, cuda:N")
    return dev


def require_device(name) -> "torch.device":
    """``name`` as a torch device, refused in one line when it asks for CUDA on a machine without it (every
    offexec command and the executor check it the same way)."""
    dev = parse_device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExecError("--device cuda was asked but no CUDA device is available (use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ExecError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev


# how the host thread waits on the GPU (CUDA's CU_CTX_SCHED_* flags of the primary context): 'auto' (CUDA's
# default: spin while the process has fewer active contexts than cores, which on the 16-core H200 machine means
# spin), 'spin', 'yield' (spin, yielding the core), 'blocking' (sleep on an OS primitive). Spinning makes a blocked
# CUDA call cost the thread's CPU time as well as its wall time, so a run's issue CPU time cannot tell waiting from
# working; with 'blocking' it can (results/offexec/runtime_ab_f1562d2: the issue share includes blocked calls)
CUDA_SCHED = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "blocking": 0x4}


def set_cuda_sched(mode: str, device_index: int = 0) -> None:
    """Set how this process's threads wait on GPU ``device_index`` (``CUDA_SCHED``), through the driver's primary
    context flags. Call it before anything uses CUDA in the process: once the primary context is made the driver
    may refuse (an error that says so). 'auto' leaves the flags as they are."""
    if mode not in CUDA_SCHED:
        raise ExecError(f"--cuda-sched must be one of {', '.join(CUDA_SCHED)}, got {mode!r}")
    if mode == "auto":
        return
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise ExecError(f"--cuda-sched {mode}: cannot load the CUDA driver (libcuda.so.1): {e}") from None
    dev = ctypes.c_int()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), device_index)),
                       ("cuDevicePrimaryCtxSetFlags", (dev, CUDA_SCHED[mode]))):
        err = getattr(cu, call)(*args)
        if err:
            raise ExecError(f"--cuda-sched {mode}: {call} failed with CUDA driver error {err} (set it before the "
                            "process first uses CUDA)")


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
_ALLOCATOR_SET = [False]


def configure_allocator() -> str:
    """Turn on the caching allocator's expandable segments (unless the user configured the allocator through
    PYTORCH_CUDA_ALLOC_CONF, which wins) and return the setting in force. With them, a segment is a range of virtual
    addresses whose 2 MiB pages are mapped as blocks need them and unmapped when a retry after a failed allocation
    releases cached memory -- free blocks between live ones cost nothing, where fixed segments keep them reserved.
    That is what lets a run's values and op temporaries (the part of the footprint outside the arena) reserve
    what they use, not what they once fragmented into."""
    user = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if user:
        return user
    if not _ALLOCATOR_SET[0]:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        _ALLOCATOR_SET[0] = True
    return "expandable_segments:True"


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


def check_gpu_free(need_bytes: int, device, what: str = "the plan") -> None:
    """Refuse ``need_bytes`` of GPU memory that the card does not have free now, before any of it is allocated: a
    budget (``--gpu-mem-gb``, a preset's nominal size) may be larger than the card, or another process may hold part
    of it, and the budget's own check passes either way."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    # (plus what this process's caching allocator holds unused: a job's earlier block, given back by empty_cache)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if need_bytes > free:
        raise ExecError(f"{what} needs {need_bytes / GiB:.2f} GiB of GPU memory but {device} has {free / GiB:.2f} GiB "
                        f"free (of {total / GiB:.2f} GiB): lower --gpu-mem-gb to what the card holds, or free the "
                        "memory other processes use")


# ----------------------------------------------------------------------------------------------------------------
# the GPU arena and the executor's streams
# ----------------------------------------------------------------------------------------------------------------
class GpuArena:
    """One allocation carved into typed views, for every buffer whose shape the plan fixes before the run.

    ``nbytes_for(items)`` sizes it from (shape, dtype) items -- each rounded up to ``ALIGN_BYTES``, the caching
    allocator's own rounding, which also keeps every view aligned for vectorised kernels and cuBLAS -- and ``take``
    hands the views out in the same order. Taking more than was sized is a bug in the caller: it raises."""

    ALIGN_BYTES = 512

    def __init__(self, device: torch.device, nbytes: int):
        self.device, self.nbytes, self.used = device, int(nbytes), 0
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device) if nbytes else None

    @classmethod
    def aligned(cls, nbytes: int) -> int:
        return -(-int(nbytes) // cls.ALIGN_BYTES) * cls.ALIGN_BYTES

    @classmethod
    def nbytes_for(cls, items) -> int:
        """Bytes of an arena holding ``items``: (shape, dtype) pairs."""
        return sum(cls.aligned(_numel(shape) * _elem_bytes(dt)) for shape, dt in items)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = _numel(shape) * _elem_bytes(dtype)
        end = self.used + self.aligned(n)
        if end > self.nbytes:
            raise ExecError(f"GPU arena of {self.nbytes} bytes exhausted: {self.used} used, {n} more asked "
                            "(the arena is sized from the plan before the run: this is a bug)")
        t = self.buf[self.used:self.used + n].view(dtype).view(tuple(shape))
        self.used = end
        return t

    def close(self) -> None:
        self.buf = None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


_STREAMS: dict = {}


def executor_streams(device: torch.device, names) -> dict:
    """The executor's CUDA streams on ``device``, one per name, made once per process (see the module docstring:
    a stream's cuBLAS workspace lives as long as the process, so streams must too)."""
    key = (device.index, tuple(names))
    if key not in _STREAMS:
        _STREAMS[key] = {n: torch.cuda.Stream(device) for n in names}
    return _STREAMS[key]


def warm_library_workspace(device: torch.device, stream) -> None:
    """Run one tiny GEMM on ``stream`` so that cuBLAS's workspace for it (``footprint.LIBRARY_WORKSPACE_BYTES``) is
    allocated now, before the arena, not carved later out of memory the run's values need."""
    with torch.cuda.stream(stream):
        a = torch.zeros(16, 16, dtype=torch.float16, device=device)
        torch.nn.functional.linear(a, a, a[0])  # a GEMM with a bias epilogue (cuBLASLt), as F.linear with bias
        torch.mm(a, a)
    stream.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# GPU buffer pools
# ----------------------------------------------------------------------------------------------------------------
class BufferPool:
    """Same-sized buffers handed out and returned with the events that must complete before reuse."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, device: torch.device):
        self.name, self.numel, self.dtype, self.device = name, numel, dtype, device
        self.free: deque = deque()  # acquire / release: first free, first taken
        self.slots: list = []  # take / give by index: [buffer, events its next user waits for, taken]
        self.count = 0
        self.lock = threading.Lock()

    @property
    def buffer_bytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def reserve(self, n: int, arena: GpuArena | None = None) -> None:
        """Allocate buffers up front (so that a budget overflow shows before the run starts), from ``arena`` when
        given."""
        while self.count < n:
            buf = arena.take((self.numel,), self.dtype) if arena is not None else \
                torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.free.append((buf, ()))
            self.slots.append([buf, (), False])
            self.count += 1

    def take(self, index: int, stream=None) -> tuple[int, torch.Tensor]:
        """(index, buffer) for a value bound to buffer ``index`` ahead of the run (``program.bind_pool_buffers``), for
        work about to be issued on ``stream``, which waits (on the GPU) until the buffer's last users ended. Where the
        issuing loop reached the value before the one holding that buffer let it go (the binding orders by the
        plan's dependencies, issuing can run ahead of plan order), the first free buffer instead, or a new one
        (reported as pool growth): the binding is a preference, never a wait on the host."""
        with self.lock:
            if self.slots[index][2]:
                index = next((i for i, sl in enumerate(self.slots) if not sl[2]), len(self.slots))
                if index == len(self.slots):
                    self.slots.append([torch.empty(self.numel, dtype=self.dtype, device=self.device), (), False])
                    self.count += 1
            slot = self.slots[index]
            slot[2] = True
        if stream is not None:
            for ev in slot[1]:
                stream.wait_event(ev)
        return index, slot[0]

    def give(self, index: int, events=()) -> None:
        """Buffer ``index`` back (as ``take`` returned it), with the events its next value's work waits for."""
        with self.lock:
            slot = self.slots[index]
            slot[1], slot[2] = tuple(events), False

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


# filesystems that keep their files in RAM: O_DIRECT there (tmpfs accepts it since Linux 6.6) still measures memory
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
DEFAULT_ALIGN_BYTES = 4096


def disk_alignment_bytes(root: str | Path) -> int:
    """The alignment O_DIRECT needs in ``root``: buffer addresses, file offsets and lengths must be multiples of the
    device's logical block size (open(2), 'O_DIRECT'). The filesystem's block size (statvfs f_bsize) is a multiple of
    it on Linux filesystems, so aligning to it is safe; anything odd (not a power of two, or above 64 KiB) falls
    back to 4096, a multiple of every common logical block size (512, 4096)."""
    try:
        bs = os.statvfs(root).f_bsize
    except OSError:
        return DEFAULT_ALIGN_BYTES
    return bs if 512 <= bs <= 1 << 16 and bs & (bs - 1) == 0 else DEFAULT_ALIGN_BYTES


def filesystem_type(root: str | Path) -> str:
    """The type of the filesystem holding ``root`` (from /proc/self/mountinfo: the longest mount point above it),
    '' where it cannot be told."""
    path = os.path.realpath(root)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
    except (OSError, IndexError):
        return ""
    return fstype


def _direct_io_refusal(root: Path) -> str | None:
    """Why the disk tier cannot bypass the page cache in ``root`` (None: it can). Tries what the tier does: open a
    file with O_DIRECT, write an aligned block and read it back (some filesystems accept the flag and refuse the
    I/O)."""
    fstype = filesystem_type(root)
    if fstype in MEMORY_FILESYSTEMS:
        return f"{root} is on {fstype}, which keeps its files in memory"
    if not hasattr(os, "O_DIRECT"):
        return "this OS has no O_DIRECT"
    align = disk_alignment_bytes(root)
    try:
        fd, path = tempfile.mkstemp(prefix="offexec-odirect-probe-", dir=root)
    except OSError as e:
        return f"no file can be created in {root} ({e.strerror or e})"
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            buf = aligned_empty(align, align)
            buf.fill_(7)
            _pwrite_all(fd, memoryview(buf.numpy()), 0)
            buf.zero_()
            _pread_all(fd, memoryview(buf.numpy()), 0)
            if int(buf.min()) != 7:
                return f"an O_DIRECT read in {root} did not return the block just written"
        finally:
            os.close(fd)
    except OSError as e:
        return f"the filesystem of {root} refuses O_DIRECT ({os.strerror(e.errno) if e.errno else e})"
    finally:
        os.unlink(path)
    return None


def check_disk_dir(root: str | Path | None, need_bytes: int, cached: bool = False) -> Path:
    """Refuse a disk-tier directory that cannot hold ``need_bytes`` or, unless ``cached``, cannot bypass the page
    cache; return it (default: the system temp directory). The executor calls this before weights are made."""
    root = Path(root) if root else Path(tempfile.gettempdir())
    if not root.exists():
        raise ExecError(f"--disk-dir {root} does not exist (create it first)")
    if not root.is_dir():
        raise ExecError(f"--disk-dir {root} is not a directory")
    try:  # (a real probe: /proc and /sys report a disk of 0 bytes and take no files; os.access says yes to root)
        with tempfile.NamedTemporaryFile(dir=root):
            pass
    except OSError as e:
        raise ExecError(f"--disk-dir {root} takes no files ({e.strerror or e}): give a folder on a real disk") from None
    free = shutil.disk_usage(root).free
    if need_bytes > free:
        raise ExecError(f"the disk tier needs {need_bytes / GiB:.2f} GiB in {root} but only {free / GiB:.2f} GiB "
                        f"are free: short by {(need_bytes - free) / GiB:.2f} GiB; use --disk-dir on a larger disk or a "
                        "plan with less on disk")
    if not cached:
        why = _direct_io_refusal(root)
        if why:
            raise ExecError(f"the disk tier reads and writes with O_DIRECT so that it times the disk, not the page "
                            f"cache, but {why}; pass --disk-dir on a real disk, or choose the cached disk tier "
                            "(--disk-cache: the plan's disk_cached), which goes through the page cache")
    return root


def aligned_empty(nbytes: int, align: int) -> torch.Tensor:
    """A host uint8 tensor of ``nbytes`` whose first byte sits at a multiple of ``align`` (O_DIRECT buffers)."""
    t = torch.empty(nbytes + align, dtype=torch.uint8)
    shift = -t.data_ptr() % align
    return t[shift:shift + nbytes]


def _round_down(x: int, a: int) -> int:
    return x - x % a


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


class DiskTier:
    """Files under a private directory in ``root``; every file goes when ``close`` runs (also at exit and on
    SIGTERM). Reads and writes of large ranges are split over ``threads`` worker threads, in chunks of
    ``CHUNK_BYTES`` that end on block boundaries (so no two chunks of a request share a block).

    By default the files are opened with O_DIRECT, so that reads come from the disk and not from the page cache
    (through the page cache, decode on the H200 read the disk tier's KV at 3.5 GB/s, a disk that does 1.07 GB/s
    cold): O_DIRECT needs the buffer, the file offset and the length aligned to the block size (``align``), so
    - files are padded to a whole number of blocks;
    - where the caller's buffer sits at the same offset within a block as the file range, the whole blocks of the
      range go straight to or from the caller's buffer (the executor's pinned staging buffers are page-aligned);
    - everything else (the partial blocks at the ends, or the whole range when buffer and file are not congruent)
      goes through a per-thread aligned bounce buffer: reads take the aligned superset and copy out the bytes
      asked for; writes of partial blocks read the block, patch it and write it back (under a lock, so two writes
      into one block cannot lose each other's bytes). The bounce buffer is not page-locked: no GPU copy reads it.
    ``cached=True`` keeps the page-cached tier (plain ``preadv``/``pwritev`` straight into the caller's buffer): an
    explicit choice, priced by offsim with the profile's page-cached disk rates (``Plan.disk_cached``)."""

    CHUNK_BYTES = 8 << 20

    def __init__(self, root: str | Path | None, need_bytes: int, threads: int = 4, cached: bool = False):
        root = check_disk_dir(root, need_bytes, cached)
        self.cached = cached
        self.align = 1 if cached else disk_alignment_bytes(root)
        self.dir = Path(tempfile.mkdtemp(prefix="offexec-", dir=root))
        self.files: dict[str, int] = {}
        self.file_bytes: dict[str, int] = {}
        self.size_bytes = 0
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offexec-disk")
        self.lock = threading.Lock()
        self.rmw_lock = threading.Lock()
        self.local = threading.local()  # each worker's bounce buffer
        _LIVE_TIERS.add(self)
        _install_signal_cleanup()

    def create(self, name: str, nbytes: int) -> None:
        """A file of ``nbytes`` (zeros; sparse until written), padded to a whole number of blocks."""
        path = self.dir / name
        padded = _round_up(nbytes, self.align)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, padded)
        finally:
            os.close(fd)
        self.files[name] = os.open(path, os.O_RDWR | (0 if self.cached else os.O_DIRECT))
        self.file_bytes[name] = nbytes
        self.size_bytes += padded

    def read(self, name: str, dst: torch.Tensor, offset: int) -> None:
        """Fill contiguous host tensor ``dst`` from file ``name`` at byte ``offset``."""
        self._io(name, dst, offset, write=False)

    def write(self, name: str, src: torch.Tensor, offset: int) -> None:
        """Write contiguous host tensor ``src`` to file ``name`` at byte ``offset``."""
        self._io(name, src, offset, write=True)

    def _io(self, name: str, t: torch.Tensor, offset: int, write: bool) -> None:
        fd = self.files[name]
        flat = t.view(-1).view(torch.uint8)
        end = offset + flat.numel()
        if offset < 0 or end > self.file_bytes[name]:
            raise ExecError(f"disk tier: bytes [{offset}, {end}) are outside file {name} of "
                            f"{self.file_bytes[name]} bytes")
        job = self._job_cached if self.cached else self._job_direct
        chunk = max(self.align, _round_down(self.CHUNK_BYTES, self.align))  # whole blocks, at least one
        jobs, a = [], offset
        while a < end:
            b = min(end, _round_down(a, self.align) + chunk)
            jobs.append(self.pool.submit(job, fd, flat[a - offset:b - offset], a, write))
            a = b
        wait(jobs)
        for j in jobs:
            j.result()  # the first error, once every chunk has stopped touching the caller's buffer

    def _job_cached(self, fd: int, part: torch.Tensor, a: int, write: bool) -> None:
        (_pwrite_all if write else _pread_all)(fd, memoryview(part.numpy()), a)

    def _job_direct(self, fd: int, part: torch.Tensor, a: int, write: bool) -> None:
        """File bytes [a, a + len(part)) to or from ``part``, with O_DIRECT."""
        al = self.align
        b = a + part.numel()
        head_end, tail_start = _round_up(a, al), _round_down(b, al)
        if (part.data_ptr() - a) % al == 0 and head_end < tail_start:  # congruent: whole blocks in place
            mid = part[head_end - a:tail_start - a]
            (_pwrite_all if write else _pread_all)(fd, memoryview(mid.numpy()), head_end)
            if a < head_end:
                self._bounce(fd, part[:head_end - a], a, write)
            if tail_start < b:
                self._bounce(fd, part[tail_start - a:], tail_start, write)
        else:
            self._bounce(fd, part, a, write)

    def _bounce(self, fd: int, part: torch.Tensor, a: int, write: bool) -> None:
        """File bytes [a, a + len(part)) through this thread's aligned buffer: its aligned superset [lo, hi)."""
        al = self.align
        b = a + part.numel()
        lo, hi = _round_down(a, al), _round_up(b, al)
        buf = getattr(self.local, "buf", None)
        if buf is None or buf.numel() < hi - lo:
            buf = self.local.buf = aligned_empty(max(hi - lo, self.CHUNK_BYTES + 2 * al), al)
        buf = buf[:hi - lo]
        mv = memoryview(buf.numpy())
        if not write:
            _pread_all(fd, mv, lo)
            part.copy_(buf[a - lo:b - lo])
            return
        if a == lo and b == hi:  # whole blocks: nothing of the file's to keep
            buf.copy_(part)
            _pwrite_all(fd, mv, lo)
            return
        with self.rmw_lock:  # partial blocks: read, patch, write back, with no other write in between
            if a != lo:
                _pread_all(fd, mv[:al], lo)
            if b != hi and (a == lo or hi - lo > al):  # (one block: the read above already has it)
                _pread_all(fd, mv[hi - lo - al:], hi - al)
            buf[a - lo:b - lo].copy_(part)
            _pwrite_all(fd, mv, lo)

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
