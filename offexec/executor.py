"""The executor: runs an offsim plan with real tensors and measures it (docs/architecture.md §7).

It does what the ops say and nothing else -- placement, order, prefetching and buffering are the plan's; the
executor only binds ops to buffers (``program.bind``) and issues them:

- GPU ops (compute, h2d, d2h) go to one CUDA stream per plan stream. An op on another stream that it depends on is
  awaited on the GPU through that op's end event (``cudaStreamWaitEvent``); the issuing thread never waits for the
  GPU. Every op is bracketed by two timing events.
- Host ops (cpu attention, disk reads and writes) run on one worker thread per plan stream ('cpu', 'disk'), in plan
  order; a worker waits for the GPU ops its op depends on by synchronising on their end events. A GPU op that
  depends on a host op is issued once that host op has finished.
- One issuing thread walks the streams' op lists and issues, among the ops whose dependencies allow it, the one
  earliest in plan order -- plan order exactly, unless a host op holds a stream back.

On ``device='cpu'`` the same handlers run every op in plan order, one after the other (CI's path); times are wall
clock. The result is a ``Trace`` in offsim's schema (``source='offexec'``) plus the generated tokens.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from offsim.core import costmodel
from offsim.core import footprint as fp
from offsim.core.plan import Plan
from offsim.core.errors import OffsimError
from offsim.core.specs import Compression, ModelSpec, get_model
from offsim.core.trace import Trace

from . import ALLOCATOR_CAPS, DEFAULT_ALLOCATOR_CAP
from . import model as M
from . import quant
from .graphs import GRAPH_MODES, DecodeGraphs
from .memory import (BufferPool, DiskTier, ExecError, GpuArena, HostBuffer, apply_gpu_budget, check_disk_dir,
                     check_gpu_budget, check_gpu_free, configure_allocator, executor_streams, host_tensor,
                     require_device, warm_library_workspace)
from .program import GPU_STREAMS, HOST_STREAMS, P2P_STREAM, Program, bind, pool_of
from .weights import ModelWeights

GiB = fp.GiB


@dataclass
class RunResult:
    trace: Trace
    tokens: np.ndarray  # [num_prompts, gen_len] generated token ids (batch-major: prompt p = batch p // gbs)
    # (a mixed-length workload: request p's output is its first gen_lens[p] tokens; it kept generating after them)
    stats: dict  # memory peaks, issue overhead, pool sizes
    logits: list | None = None  # per (step, batch): [gbs, V] float32 CPU tensors, when asked
    kv: dict = field(default_factory=dict)  # home-tier KV caches after the run, when asked (tests)
    # host seconds the issuing thread spent on each op (by op id; 0 for host-stream ops, which it hands to a worker):
    # what ``offexec profile`` reads for its per-part issue rows
    issue_s_by_op: np.ndarray | None = None


def _is_preset(spec: ModelSpec) -> bool:
    """Whether ``spec`` is exactly the preset of its name (then a trace's ``meta.model`` is enough to rebuild it)."""
    try:
        return get_model(spec.name) == spec
    except OffsimError:
        return False


def check_one_host(plan: Plan) -> None:
    """offexec runs on one host (its ranks' clocks are compared, their GPUs share one host's memory): a plan over
    several nodes (``Plan.nodes``, offsim's ``gpus_per_node``) is refused in one line, before anything is made."""
    if plan.num_nodes > 1:
        raise ExecError(f"the plan runs on {plan.num_nodes} nodes (gpus_per_node): offexec runs on one host only; "
                        "simulate it with offsim, or build the plan without --gpus-per-node")


def run_plan(plan: Plan, weights: ModelWeights, device: str = "cuda", prompts: torch.Tensor | None = None,
             seed: int = 0, gpu_budget_bytes: int | None = None, disk_dir: str | None = None,
             record_logits: bool = False, keep_kv: bool = False, meta: dict | None = None,
             threaded: bool = False, host_kv_pool: HostBuffer | None = None,
             allocator_cap: str = DEFAULT_ALLOCATOR_CAP, graphs: str | None = None,
             switch_interval_s: float | None = None, trace_allocator: bool = False,
             cpu_threads: int | None = None) -> RunResult:
    """Run ``plan`` with ``weights`` on ``device``; return the measured trace and the generated tokens.

    ``prompts``: [num_prompts, prompt_len] token ids (default: seeded random ids); in a mixed-length workload prompt
    i's ids are the first ``prompt_lens[i]`` of its row (the executor left-pads them, docs/jobs.md §4). ``gpu_budget_bytes``: the GPU
    memory cap (default: the plan's GPU capacity). ``threaded``: on the CPU, run the stream scheduler with host
    stand-ins for streams instead of plain plan order (tests). ``host_kv_pool``: a (pinned) host buffer to hold the
    host-homed KV cache, reused across runs in one process (page-locking tens of GB takes seconds).
    ``allocator_cap``: 'budget' (default, ``offexec.DEFAULT_ALLOCATOR_CAP``: why) caps PyTorch's allocator at the
    budget, letting it cache freely up to it; 'plan' caps it at the plan's own GPU bytes (``gpu_need``, what offsim
    predicts; never above the budget), so that a run proves the memory contract -- it holds at most what was
    planned. ``graphs``: decode
    layer ops as CUDA graphs ('cuda', the default on a GPU), their graph-ready kernels run eagerly ('static', for
    CPU tests of the graph path's numerics), or the plain eager kernels ('off', the default on the CPU)
    (offexec/graphs.py). ``switch_interval_s``: Python's thread switch interval during the run (default
    ``Executor.SWITCH_INTERVAL_S``; see there). ``trace_allocator``: on CUDA, attribute the caching allocator's
    retries (each a device-wide synchronisation) to the op handler that was issuing when they happened
    (``stats['allocator_retries_by_handler']``; reading the counters costs ~0.1 ms per op, so it is a diagnostic).
    ``cpu_threads``: torch's intra-op threads during the run -- CPU attention's parallelism (default: torch's own,
    one per usable core; ``Executor.cpu_threads``). A plan over several GPUs (``Plan.stages``) runs one process per
    GPU: ``offexec.distributed``."""
    check_one_host(plan)
    if plan.stages:
        raise ExecError(f"the plan runs on {plan.num_devices} GPUs (pipeline stages): run it with one process per "
                        f"GPU, `torchrun --nproc-per-node {plan.num_devices} -m offexec.distributed --plan FILE` "
                        "(docs/architecture.md §7.1)")
    ex = Executor(plan, weights, device, prompts, seed, gpu_budget_bytes, disk_dir, record_logits, keep_kv,
                  threaded, allocator_cap, graphs)
    ex.host_kv_pool = host_kv_pool
    ex.trace_allocator = trace_allocator
    if switch_interval_s is not None:
        if not switch_interval_s > 0:
            raise ExecError(f"switch interval must be a positive number of seconds, got {switch_interval_s!r}")
        ex.switch_interval_s = float(switch_interval_s)
    if cpu_threads is not None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1:
            raise ExecError(f"cpu_threads must be a positive whole number of threads, got {cpu_threads!r}")
        ex.cpu_threads = cpu_threads
    try:
        return ex.run(meta or {})
    finally:
        ex.close()


def kv_buffer_elems(plan: Plan, heads: int) -> int:
    """Elements of one (layer, batch) KV buffer of ``heads`` heads at full length: [max_len, 2, B, heads, D]
    (``footprint.kv_buffer_elems``)."""
    wl = plan.workload
    return fp.kv_buffer_elems(plan.model, wl.gpu_batch_size, wl.max_len, heads)


def op_transient_bytes(plan: Plan, prog: Program, graph_bytes: int = 0) -> int:
    """The largest eager compute op's peak beyond the value it leaves (``footprint.op_peak_bytes`` minus
    ``op_output_bytes``; the values are in the activation peak), over the plan's distinct op shapes. A CPU
    delegation's ``pre_attn`` stands for its whole GPU side: ``cpu_attn_layer`` (whole layers: its ``post_attn``
    is inside) or ``cpu_attn_pre`` (sub-layers: ``attn_out`` is an op of its own).

    Ops replayed as CUDA graphs hold their intermediates in the graphs' pool (``footprint.decode_graph_bytes``:
    ``graph_bytes``, pool and static tensors), which exists from the first decode step on. So a prefill op's
    transients, freed before it, share their room with the graphs: the bytes counted here are the most of the
    prefill's eager peak less ``graph_bytes`` and the decode's eager peak -- the graphs plus these are the most of
    either phase's. (Under the GPU budget the caching allocator hands the prefill's cached blocks back to the
    device when the graphs' pool needs room: a one-time allocator retry.)"""
    m, kv_groups = plan.model, sum(1 for lo, hi in prog.groups.values() if hi > lo)
    whole = None in prog.units
    gq, eager = plan.graph_q_tokens, costmodel.eager_graph_shapes(plan)
    shapes = {(o.phase == "decode", o.part, o.num_seqs, o.q_tokens, o.ctx_tokens) for o in plan.ops
              if o.kind == "compute" and o.part != "post_attn"
              and not costmodel.op_graphed(o.kind, o.part, o.q_tokens, o.phase, gq, eager)}
    best = {False: 0, True: 0}
    for decode, part, B, T, C in shapes:
        fpart = ("cpu_attn_layer" if whole else "cpu_attn_pre") if part == "pre_attn" else part
        best[decode] = max(best[decode], fp.op_transient_bytes(m, fpart, B, T, C, kv_groups,
                                                               masked=plan.workload.key_masked, output_part=part))
    return max(best[False] - graph_bytes, best[True], 0)


def compression_of(plan: Plan) -> Compression:
    """The plan's compression (its settings are the contract), refused in one line where the executor does not run
    it: CPU attention with compressed weights or cache (offsim refuses it too: ``Compression.check_cpu_attention``).
    Compressed weights, a compressed cache and sparse attention (on the GPU and on the CPU, as offsim allows it) run."""
    comp = Compression.from_settings(plan.settings)
    comp.check_cpu_attention(any(op.kind == "cpu_compute" for op in plan.ops))
    return comp


def gpu_need(prog: Program, plan: Plan) -> dict[str, int]:
    """GPU bytes the executor will hold for ``plan``, by purpose (``footprint.executor_gpu_bytes``): what the budget
    pre-check adds up. Buffer pools count the most buffers live at once in plan order, activations the most GPU
    values (hidden states, Q/K/V, attention outputs) live at once in plan order, and op transients the largest
    eager compute op's peak beyond its output (``op_transient_bytes``). The decode graphs are sized for the plan's
    longest graphed op, their static tensors for what its graphed ops take and give (CPU delegation's, written-rows
    per-batch hidden states). Compressed weights: stored sizes plus the fp16 working copy of the largest unit."""
    gq, eager = plan.graph_q_tokens, costmodel.eager_graph_shapes(plan)
    through = [op for op in plan.ops if costmodel.op_graphed(op.kind, op.part, op.q_tokens, op.phase, gq, eager)]
    longest = max((op.q_tokens for op in through), default=1)
    cpu_attention = any(op.part in costmodel.CPU_DELEGATION_PARTS for op in through)
    homes = plan.graph_attention == "written_rows" and longest > 1
    graph_bytes = fp.decode_graph_bytes(plan.model, plan.workload, longest, cpu_attention, homes)
    return fp.executor_gpu_bytes(plan.model, plan.workload, plan.weight_split, plan.kv_split, prog.pool_peak,
                                 prog.gpu_value_peak_bytes, op_transient_bytes(plan, prog, graph_bytes), longest,
                                 compression_of(plan), None not in prog.units,
                                 sends_hidden=any(b.fn == "send_hidden" for b in prog.bound),
                                 landing_tokens=prog.landing_tokens, graph_cpu_attention=cpu_attention,
                                 graph_homes=homes)


def plan_gpu_need(plan: Plan) -> dict[str, int]:
    """``gpu_need`` of ``plan`` bound to its model's layer layout: the pre-check's GPU bytes by purpose, by
    arithmetic alone (what ``check_plan`` adds up before refusing a plan; for sweeps and tests of the contract)."""
    return gpu_need(bind(plan, M.layer_layout(plan.model)), plan)


def disk_need(plan: Plan, layout=None) -> int:
    """Bytes of the disk tier's files (``footprint.disk_tier_bytes``): each layer's disk-homed weight bytes (stored
    size, at the largest layer's stride) and the KV of disk-homed heads. (``layout``: unused, kept for callers.)"""
    return fp.disk_tier_bytes(plan.model, plan.workload, plan.weight_split, plan.kv_split, compression_of(plan))


def host_need(prog: Program, plan: Plan, weights_loaded: bool = False) -> dict[str, int]:
    """Host bytes the executor will hold for ``plan``, by purpose (``footprint.executor_host_bytes``); the weights'
    host master is left out when it is already loaded (``weights_loaded``)."""
    need = fp.executor_host_bytes(plan.model, plan.workload, plan.kv_split, prog.host_peak_bytes,
                                  compression_of(plan))
    if weights_loaded:
        need["weights master"] = 0
    return need


def _meminfo_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memlock_limit_bytes() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes (None: unlimited or unknown)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def check_host_memory(host: dict[str, int], pinned: bool, what: str = "the plan") -> None:
    """Refuse, in one line with sizes in GiB, host bytes by purpose (``host_need``) that exceed MemAvailable of
    /proc/meminfo, or, when ``pinned`` (CUDA, page-locked copies), whose page-locked part (the weights' master and
    the host KV) exceeds RLIMIT_MEMLOCK where it is set. ``what`` names whose bytes they are in the message."""
    total = sum(host.values())
    avail = _meminfo_available_bytes()
    if avail is not None and total > avail:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in host.items() if v)
        raise ExecError(f"{what} needs {total / GiB:.2f} GiB of host memory ({parts}) but only {avail / GiB:.2f} "
                        f"GiB are available (MemAvailable): short by {(total - avail) / GiB:.2f} GiB; use fewer or "
                        "smaller GPU batches or a plan with less in host memory")
    lock = _memlock_limit_bytes()
    locked = host["weights master"] + host["host KV"] + host.get("packed weights", 0)
    if pinned and lock is not None and locked > lock:
        raise ExecError(f"{what} page-locks {locked / GiB:.2f} GiB of host memory (weights and host KV) but "
                        f"RLIMIT_MEMLOCK allows {lock / GiB:.2f} GiB: short by {(locked - lock) / GiB:.2f} GiB; "
                        "raise it (ulimit -l unlimited) or run with pageable memory")


def flash_reads_written_rows() -> bool:
    """Whether this torch's flash attention takes ``seqused_k`` (``model.written_rows_attention``)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)


def check_plan(plan: Plan, device, budget_bytes: int, disk_dir: str | None = None,
               weights_loaded: bool = False) -> dict[str, int]:
    """Everything that can refuse a plan before weights are made: binding (ops the executor cannot run), the GPU
    budget, host memory (MemAvailable of /proc/meminfo; with CUDA and pinned ops also RLIMIT_MEMLOCK, when set, for
    what gets page-locked: the weights' master and the host KV) and the disk tier's room -- each refusal one line
    with sizes in GiB. ``weights_loaded``: the weights' host master already exists (do not count it again). Returns
    the GPU bytes by purpose."""
    layout = M.layer_layout(plan.model)
    prog = bind(plan, layout)
    need = gpu_need(prog, plan)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        check_gpu_budget(need, budget_bytes)
        check_gpu_free(sum(need.values()), device)
        if plan.graph_attention == "written_rows" and not flash_reads_written_rows():
            raise ExecError(f"the plan's graph_attention 'written_rows' needs flash's variable-length call with "
                            f"seqused_k, which this torch {torch.__version__} lacks: run the plan with "
                            f"--graph-attention masked")
    host = host_need(prog, plan, weights_loaded)
    if not cuda:  # on the CPU the plan's device tier is host memory too (its budget is not checked: no GPU)
        host = {**host, "device tier on the CPU": sum(need.values())}
    check_host_memory(host, cuda and all(o.pinned for o in plan.ops))
    dn = disk_need(plan)
    if dn:  # room, and (unless the plan's disk tier is page-cached) a filesystem that takes O_DIRECT
        check_disk_dir(disk_dir, dn, plan.disk_cached)
    return need



def host_bound_idle_s(plan: Plan, start: np.ndarray, end: np.ndarray, issued_at: np.ndarray,
                      stream: str = "compute") -> float:
    """Seconds the GPU's ``stream`` sat idle because the host had not issued its next op yet: for each op on the
    stream (in start order), the part of the gap after the previous op's end that passed before the op's issue ended
    on the host (``issued_at``, the host clock from the run's start, which the GPU times share: both count from the
    reference event the host waited for). Host issue time that overlaps GPU work (the host ahead, or blocked in a
    launch or an allocator sync while the GPU is busy) is not counted: this is the host's cost the run really paid.
    GPU clock and host clock agree to the few microseconds between the reference event's end and the host's wake-up."""
    ids = np.array([op.id for op in plan.ops if op.stream == stream], dtype=np.int64)
    if len(ids) < 2:
        return 0.0
    ids = ids[np.argsort(start[ids], kind="stable")]
    prev_end = np.maximum.accumulate(end[ids])[:-1]
    nxt = ids[1:]
    lost = np.minimum(start[nxt], issued_at[nxt]) - prev_end
    return float(np.clip(np.nan_to_num(lost, nan=0.0), 0.0, None).sum())


def host_in_op_s(plan: Plan, start: np.ndarray, end: np.ndarray, issued_at: np.ndarray,
                 stream: str = "compute") -> float:
    """Seconds of the GPU's ``stream`` ops' own spans that passed while the host was still issuing them: per op,
    ``min(end, issued_at) - start`` where the host's issue ended after the GPU began the op (0 where the host was
    ahead). ``host_bound_idle_s`` counts the gaps between ops; this is the part of the waiting that lies inside an
    op's span -- the GPU ran an eager op's first kernels while the host was still launching the rest, or a graphed
    op's input copy while the host was replaying it -- which a plan's per-op GPU times (and offsim's op times) do
    not hold. An upper bound: the GPU may have had work of the op's earlier kernels through the whole overlap.
    (runtime_ab_f1562d2: a shallower window cost a compute-bound run a fifth of its decode speed while the gaps
    read 0.1 %.)"""
    ids = np.array([op.id for op in plan.ops if op.stream == stream], dtype=np.int64)
    if not len(ids):
        return 0.0
    inside = np.minimum(end[ids], issued_at[ids]) - start[ids]
    return float(np.clip(np.nan_to_num(inside, nan=0.0), 0.0, None).sum())


class Executor:
    # flow control: ops the issuing thread may have outstanding on each stream. Waiting here is not issue time; it
    # keeps every CUDA call from blocking on a full launch or copy queue, so issue time measures only host work
    # (the plan's ``run_ahead`` for compute, h2d and d2h, offsim's ``RUN_AHEAD_OPS`` by default: the simulator
    # models the same window; a pipeline stage's GPU-to-GPU stream: ``P2P_RUN_AHEAD``)
    P2P_RUN_AHEAD = 16
    # Python's GIL switch interval during a run. The host workers (CPU attention, disk) and the issuing thread share
    # the GIL; each torch call releases it, and taking it back while another thread runs Python waits up to the
    # interval (5 ms by default) -- a CPU attention op of a few small torch calls then takes several intervals
    # (experiments/offexec/host_threads_check.py measured it). A shorter interval hands the GIL back within it.
    SWITCH_INTERVAL_S = 2e-4
    switch_interval_s = SWITCH_INTERVAL_S
    # torch's intra-op threads during the run (None: leave torch's, one per usable core). CPU attention runs its
    # kernels on them while the issuing thread and the host workers also want a core: with every core taken by the
    # pool, a descheduled pool thread stalls the op at its next barrier (an A/B knob, `offexec run --cpu-threads`)
    cpu_threads: int | None = None

    def __init__(self, plan: Plan, weights: ModelWeights, device: str, prompts, seed: int,
                 gpu_budget_bytes: int | None, disk_dir: str | None, record_logits: bool, keep_kv: bool,
                 threaded: bool = False, allocator_cap: str = DEFAULT_ALLOCATOR_CAP, graphs: str | None = None,
                 comm=None):
        self.plan, self.spec, self.wts = plan, plan.model, weights
        self.comm = comm  # one stage of a pipeline: its sends and receives (offexec/distributed.py ``StageComm``)
        if comm is not None and threaded:
            raise ExecError("a pipeline stage on the CPU runs its ops in plan order (threaded=False): a receive "
                            "would block the issuing thread")
        if weights.spec.layer_weight_bytes() != plan.model.layer_weight_bytes() or \
                weights.spec.num_layers != plan.model.num_layers:
            raise ExecError(f"weights are for model {weights.spec.name}, the plan for {plan.model.name}")
        self.device = require_device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ExecError(f"--device must be 'cuda' or 'cpu', got {device!r}")
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.threaded = threaded
        self.dtype = weights.dtype
        self.e = self.spec.dtype_bytes
        self.record_logits, self.keep_kv = record_logits, keep_kv
        self._disk_dir = disk_dir
        self.budget = int(gpu_budget_bytes if gpu_budget_bytes is not None else plan.capacity["gpu"])
        self.prog: Program = bind(plan, weights.layout, comm.rank if comm is not None else 0)
        self.comp = compression_of(plan)
        # compressed weights: GPU slots hold the stored bytes of their range (``footprint.stored_slot_bytes``)
        self.packed_slot_bytes = {pool_of(u): max((fp.stored_slot_bytes(plan.model, g, u, self.comp)
                                                   for g, _ in plan.weight_split), default=0)
                                  for u in self.prog.units} if self.comp.weight else {}
        # every KV buffer's last dim: D elements, or with a compressed cache each vector's stored bytes
        # (``quant.pack_vectors``; uint8)
        D = self.spec.head_dim
        self.kv_last, self.kv_dtype = (quant.stored_nbytes((D,), 0), torch.uint8) if self.comp.cache else \
            (D, weights.dtype)
        self.kv_e = torch.empty(0, dtype=self.kv_dtype).element_size()
        self.gpu_need = gpu_need(self.prog, plan)
        # a pipeline stage's GPU-to-GPU sends and receives get a stream of their own
        self.gpu_streams = GPU_STREAMS + ((P2P_STREAM,) if any(o.kind == "p2p" for o in plan.ops) else ())
        if self.cuda:
            check_gpu_budget(self.gpu_need, self.budget)  # before any large allocation
        if allocator_cap not in ALLOCATOR_CAPS:
            raise ExecError(f"allocator cap must be one of {', '.join(ALLOCATOR_CAPS)}, got {allocator_cap!r}")
        self.cap_bytes = min(self.budget, sum(self.gpu_need.values())) if allocator_cap == "plan" else self.budget
        if graphs is None:  # the plan says (Plan.cuda_graphs); graphs need a GPU
            graphs = "cuda" if self.cuda and plan.cuda_graphs else "off"
        if graphs not in GRAPH_MODES or (graphs == "cuda" and not self.cuda):
            raise ExecError(f"graphs must be one of {', '.join(GRAPH_MODES)} ('cuda' needs --device cuda), "
                            f"got {graphs!r}")
        self.graph_mode = graphs
        self.graphs: DecodeGraphs | None = None
        self.disk: DiskTier | None = None
        self.host_kv: HostBuffer | None = None
        self.host_kv_pool: HostBuffer | None = None
        self.trace_allocator = False  # run_plan's trace_allocator
        self.pools: dict[str, BufferPool] = {}
        wl = plan.workload
        self.nb, self.gbs, self.cap = wl.num_gpu_batches, wl.gpu_batch_size, wl.max_len
        if prompts is None:
            g = torch.Generator().manual_seed(seed)
            prompts = torch.randint(0, self.spec.vocab_size, (wl.num_prompts, wl.prompt_len), generator=g)
        if tuple(prompts.shape) != (wl.num_prompts, wl.prompt_len):
            raise ExecError(f"prompts have shape {list(prompts.shape)}, the workload needs "
                            f"[{wl.num_prompts}, {wl.prompt_len}]")
        self.prompts = prompts
        # a mixed-length workload (docs/jobs.md §4): batch k runs at batch_prompt_lens[k], each shorter prompt
        # LEFT-padded by pad[k, i] positions (so every sequence's last prompt token, and every decode step, sits at
        # the same cache row); prompt i's ids are the first prompt_lens[i] of its row of ``prompts``. An empty slot
        # (length 0) runs unpadded on zero ids, its output unused. None: a uniform workload, no mask, no padding.
        self.pad = None
        lens = wl.batch_prompt_lens
        if wl.padded:
            self.pad = torch.tensor([[lens[k] - p if p else 0
                                      for p in wl.prompt_lens[k * self.gbs:(k + 1) * self.gbs]]
                                     for k in range(self.nb)], dtype=torch.long)  # [nb, B]
        self.written_rows = self._written_rows_plan()

    # ---- memory -----------------------------------------------------------------------------------------------
    def _kv_elems(self, heads: int) -> int:
        """Elements of one full-length KV buffer of ``heads`` heads: [max_len, 2, B, heads, kv_last] -- fp16
        elements, or with a compressed cache its stored bytes (``footprint.stored_kv_bytes``)."""
        if self.comp.cache:
            wl = self.plan.workload
            return fp.stored_kv_bytes(self.spec, wl.gpu_batch_size, wl.max_len, heads, comp=self.comp)
        return kv_buffer_elems(self.plan, heads)

    def _arena_items(self) -> list:
        """(key, shape, dtype) of every GPU buffer whose shape the plan fixes, in the order ``_setup`` takes them
        from the arena: the executor's share of ``footprint.executor_gpu_bytes`` (all but activations, op
        transients and the library workspace, which the caching allocator and cuBLAS hold)."""
        s, dt = self.spec, self.dtype
        L, D = s.num_layers, s.head_dim
        items = [(f"emb.{k}", tuple(t.shape), t.dtype) for k, t in self.wts.emb.fields().items() if t is not None]
        if s.family == "llama":
            items += [("rope.cos", (self.cap + 1, D), dt), ("rope.sin", (self.cap + 1, D), dt)]
        items.append(("tokens", (self.nb, self.gbs, self.cap + 1), torch.long))
        if self.comp.weight:  # resident weights stored packed, and the fp16 working copy compute ops dequantize into
            items += [(f"w_res.{j}", (fp.stored_weight_bytes(s, 0, g, self.comp),), torch.uint8)
                      for j, (g, _) in enumerate(self.plan.weight_split) if g]
            w_only = dataclasses.replace(self.comp, cache=False)  # the weights' share of the working copies
            w_deq_bytes = fp.dequantized_copy_bytes(s, self.gbs, self.cap, w_only, None not in self.prog.units)
            items.append(("w_deq", (w_deq_bytes // self.e,), dt))
        else:
            items += [(f"w_res.{j}", (g // self.e,), dt) for j, (g, _) in enumerate(self.plan.weight_split) if g]
        heads = {g: hi - lo for g, (lo, hi) in self.prog.groups.items()}
        if heads["gpu"]:
            items.append(("kv_gpu", (L, self.nb, self.cap, 2, self.gbs, heads["gpu"], self.kv_last), self.kv_dtype))
        if self.comp.cache:  # the fp16 working copy attention reads: every head of a batch at full length
            items.append(("kv_deq", (self.cap, 2, self.gbs, s.num_kv_heads, D), dt))
        for name, n in self.prog.pool_peak.items():
            items += [(f"{name}.{i}",) + self._pool_buffer(name) for i in range(n)]
        return items

    def _pool_buffer(self, name: str) -> tuple[tuple[int], torch.dtype]:
        """(shape, dtype) of one buffer of pool ``name``: a weight slot (elements, or stored bytes with compressed
        weights), a landing buffer of parked activations, or a KV work buffer."""
        if name.startswith("wslot"):
            if self.comp.weight:
                return (self.packed_slot_bytes.get(name, 0),), torch.uint8
            return (self.prog.slot_numel.get(name, 0),), self.dtype
        if name == "hidden_in":
            return (fp.landing_buffer_bytes(self.spec, self.gbs, self.prog.landing_tokens) // self.e,), self.dtype
        return (self._kv_elems(self.kv_heads_of(name.removeprefix("kvwork_"))),), self.kv_dtype

    def kv_heads_of(self, group: str) -> int:
        lo, hi = self.prog.groups[group]
        return hi - lo

    def _setup(self) -> None:
        s, plan, dev, dt = self.spec, self.plan, self.device, self.dtype
        L, e = s.num_layers, self.e
        Wn = self.wts.layer_numel
        if self.cuda:
            self.allocator_conf = configure_allocator()
            apply_gpu_budget(dev, self.cap_bytes)
            # the allocator's counters are the process's; the run reports its own share (a test or notebook that ran
            # something before must not show up as this run's OOM)
            self.alloc_counts0 = dict(torch.cuda.memory_stats(dev))
            self.streams = executor_streams(dev, self.gpu_streams)
            warm_library_workspace(dev, self.streams["compute"])  # before the arena: see memory.py
        pinned = all(o.pinned for o in plan.ops) if plan.ops else True
        self.wts.set_pinned(pinned)
        # every plan-sized GPU buffer is a view of one allocation (memory.py, "The GPU arena")
        items = self._arena_items()
        self.arena = GpuArena(dev, GpuArena.nbytes_for((shape, d) for _, shape, d in items))
        take = {k: (shape, d) for k, shape, d in items}

        def arena(key: str) -> torch.Tensor:
            return self.arena.take(*take[key])

        self.emb = M.Embeddings(**{k: None if t is None else arena(f"emb.{k}").copy_(t)
                                   for k, t in self.wts.emb.fields().items()})
        self.rope = None
        if s.family == "llama":
            rope = M.Rope(s, dev, dt, self.cap + 1)
            rope.cos, rope.sin = arena("rope.cos").copy_(rope.cos), arena("rope.sin").copy_(rope.sin)
            self.rope = rope
        # token ids of every sequence: [nb, B, cap + 1]
        self.tokens = arena("tokens").zero_()
        wl = plan.workload
        if not wl.prompt_lens:
            self.tokens[:, :, :wl.prompt_len] = self.prompts.view(self.nb, self.gbs, -1).to(dev)
        else:  # each prompt ends at its batch's length (left padding; batches may run at different lengths)
            for i, p in enumerate(wl.prompt_lens):
                k, r = divmod(i, self.gbs)
                end = wl.batch_prompt_lens[k]
                self.tokens[k, r, end - p:end] = self.prompts[i, :p].to(dev)
        self.pad_dev = None if self.pad is None else self.pad.to(dev)
        # resident weight bytes [0, gpu) of each layer
        self.g_el = [g // e for g, _ in plan.weight_split]
        self.c_el = [c // e for _, c in plan.weight_split]
        self.packed = self.wts.packed_layers(self.comp) if self.comp.weight else None
        src = self.wts.layers if self.packed is None else self.packed.layers
        self.w_res: list = [None] * L  # resident bytes [0, gpu) of each layer (stored bytes when compressed)
        for j in range(L):
            if self.g_el[j]:
                t = arena(f"w_res.{j}")
                self.w_res[j] = t.copy_(src[j, :t.numel()])
        self.w_deq = arena("w_deq") if self.comp.weight else None
        self.view_cache: dict = {}
        # a weight slot's straddling-tensor head (its resident part), copied on the compute stream by the first compute
        # op that reads the slot: slot address -> (source, destination) views (``_op_h2d_weight``, ``_straddle``)
        self.straddle_pending: dict = {}
        self.straddle_copies = 0
        self.pool_index: dict[int, int] = {}  # bound pool value -> the buffer it took (``BufferPool.take``)
        # KV homes
        groups = self.prog.groups
        self.kv_heads = {g: hi - lo for g, (lo, hi) in groups.items()}
        shape = lambda n: (self.cap, 2, self.gbs, n, self.kv_last)  # noqa: E731  token-major: a prefix is contiguous
        self.kv_gpu = arena("kv_gpu").zero_() if self.kv_heads["gpu"] else None
        # zeroed: a graph (or a masked position) reads whole buffers, and zero bytes dequantize to 0, not NaN
        self.kv_deq = arena("kv_deq").zero_() if self.comp.cache else None
        self.kv_host = None
        self.host_kv_bytes = 0
        if self.kv_heads["cpu"]:
            n = L * self.nb * self._kv_elems(self.kv_heads["cpu"])
            pool = self.host_kv_pool
            if pool is not None and pool.nbytes >= n * self.kv_e and pool.pinned == (pinned and self.cuda):
                # the pool's bytes, whatever its dtype (a compressed cache stores uint8)
                raw = pool.tensor.view(-1).view(torch.uint8)[:n * self.kv_e]
                self.kv_host = raw.view(self.kv_dtype).view((L, self.nb) + shape(self.kv_heads["cpu"]))
                self.host_kv_bytes = n * self.kv_e
            else:
                self.host_kv = HostBuffer(n, self.kv_dtype, pinned and self.cuda)
                self.kv_host = self.host_kv.tensor.view((L, self.nb) + shape(self.kv_heads["cpu"]))
                self.host_kv_bytes = self.host_kv.nbytes
        # disk tier: weight bytes [gpu + cpu, W) of each layer, KV of disk-homed heads
        disk_w = [Wn - self.g_el[j] - self.c_el[j] for j in range(L)]
        # the disk-homed range of layer j as its file holds it: (first byte in the layer's buffer, bytes) -- fp16
        # elements times e, or the stored range of the packed layer (``PackedLayers.range``)
        self.disk_w_range = [((Wn - n) * e, n * e) if self.packed is None else self.packed.range((Wn - n) * e, Wn * e)
                             for n in disk_w]
        self.disk_w_stride = max(n for _, n in self.disk_w_range)
        self.disk_kv_stride = self._kv_elems(self.kv_heads["disk"]) * self.kv_e
        need = self.disk_w_stride * L + self.disk_kv_stride * L * self.nb
        if need:
            self.disk = DiskTier(self._disk_dir, need, cached=self.plan.disk_cached)
            if self.disk_w_stride:
                self.disk.create("weights.bin", self.disk_w_stride * L)
                for j in range(L):
                    if disk_w[j]:
                        a, n = self.disk_w_range[j]
                        row = (self.wts.layers[j] if self.packed is None else self.packed.layers[j]).view(torch.uint8)
                        self.disk.write("weights.bin", row[a:a + n].contiguous(), j * self.disk_w_stride)
            if self.disk_kv_stride:
                self.disk.create("kv.bin", self.disk_kv_stride * L * self.nb)
        # pools, from the arena: as many buffers as plan order has live at once, or the KV work buffers' binding needs
        p = self.prog
        for name in ("wslot", "wslot_attn", "wslot_mlp", "hidden_in"):
            (numel,), pdt = self._pool_buffer(name)
            self.pools[name] = BufferPool(name, numel, pdt, dev)
        for g in ("cpu", "disk"):
            self.pools[f"kvwork_{g}"] = BufferPool(f"kvwork_{g}", self._kv_elems(self.kv_heads[g]), self.kv_dtype,
                                                   dev)
        for name, pool in self.pools.items():
            pool.reserve(p.pool_peak.get(name, 0), self.arena)
        if self.arena.used != self.arena.nbytes:
            raise ExecError(f"GPU arena: {self.arena.used} of {self.arena.nbytes} bytes taken (a bug)")
        self.eager_shapes = costmodel.eager_graph_shapes(self.plan)  # graphable, but too few steps to pay a capture
        if self.graph_mode != "off":
            self.graphs = DecodeGraphs(dev, self.cap, self.graph_mode, max(1, self.plan.graph_q_tokens))
            for g in ("cpu", "disk"):  # a graph attends over whole buffers: no NaN in a masked position
                for buf, _ in self.pools[f"kvwork_{g}"].free:
                    buf.zero_()
        self.logits: list = []
        self.replayed = False
        # sparse attention: kept V rows (query head x query x position), counted on the device and on the host
        self.sparse_rows = torch.zeros((), dtype=torch.long, device=dev)
        self.sparse_rows_host = torch.zeros((), dtype=torch.long)
        self.sparse_first = torch.zeros((), dtype=torch.long, device=dev)  # a graphed op's batch prompt length

    def close(self) -> None:
        """Drop every buffer (GPU memory goes back to the allocator; the disk tier's files are removed)."""
        for attr in ("vals", "view_cache", "w_res", "w_deq", "kv_deq", "kv_gpu", "kv_host", "emb", "tokens", "rope",
                     "val_events", "sparse_rows", "sparse_first"):
            if hasattr(self, attr):
                setattr(self, attr, None)
        for pool in self.pools.values():
            pool.close()
        if getattr(self, "arena", None) is not None:
            self.arena.close()
            self.arena = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.host_kv is not None:
            self.host_kv.close()
            self.host_kv = None

    # ---- the run ----------------------------------------------------------------------------------------------
    def run(self, meta: dict) -> RunResult:
        self._setup()
        if self.comm is not None:
            self.comm.ready()  # a pipeline's ranks start their clocks together, after every rank's setup
        ops = self.plan.ops
        n = len(ops)
        self.vals: dict[int, object] = {}
        self.val_left = [v.users for v in self.prog.values]
        self.pool_vid = bytearray(v.kind in self.pools for v in self.prog.values)  # values held in a pool buffer
        self.val_stream: dict[int, object] = {}
        self.pool_flat: dict[int, object] = {}  # value -> the whole pool buffer it was given (``_pool_get``)
        self.val_events: dict[int, list] = {}
        self.val_lock = threading.Lock()
        self.start = np.zeros(n)
        self.end = np.zeros(n)
        self.issue_s = self.issue_cpu_s = self.wait_s = 0.0
        self.issue_by_fn: dict = {}
        self.retries_by_fn: dict = {}
        self.issue_by_op = [0.0] * n  # (the plan-order path on the CPU leaves it 0: no issuing thread there)
        self.dispatch_s = 0.0
        # Python's cyclic collector, left alone, scans every object the process holds (the plan's ops, torch's and
        # transformers' modules: ~0.4-1 M) whenever enough new ones survive, ~0.3 s a pass on the issuing thread in
        # the middle of the run (issue 14: a big part of the host issue time). Objects that exist now live until the
        # run ends, so they are moved out of its reach: the run's own garbage is still collected, cheaply. On CUDA
        # garbage is collected first (a cycle could hold GPU memory through the run; ~0.3 s, before the clock); the
        # CPU paths (tests) skip that pass: what garbage it leaves is frozen with the rest and collected afterwards.
        if self.cuda:
            gc.collect()
        gc.freeze()
        t_wall = time.perf_counter()
        old_threads = torch.get_num_threads()
        try:
            if self.cpu_threads is not None:
                torch.set_num_threads(self.cpu_threads)
            if self.cuda or self.threaded:
                old = sys.getswitchinterval()
                sys.setswitchinterval(self.switch_interval_s)
                try:
                    self._run_streams()
                finally:
                    sys.setswitchinterval(old)
            else:
                self._run_sequential()
        finally:
            gc.unfreeze()
            torch.set_num_threads(old_threads)
        if self.comm is not None:
            self.comm.finish()  # every send delivered before the buffers go
        wall_s = time.perf_counter() - t_wall
        wl = self.plan.workload
        # batch k's generated tokens start after its prompt length; a request of a mixed workload whose gen_lens entry
        # is shorter than gen_len kept generating with its batch: its output is the first gen_lens[i] of its row
        toks = torch.stack([self.tokens[k, :, L:L + wl.gen_len] for k, L in enumerate(wl.batch_prompt_lens)])
        toks = toks.reshape(wl.num_prompts, wl.gen_len)
        peaks = {"gpu": 0, "cpu": 0, "disk": self.disk.size_bytes if self.disk else 0}
        stats = {"wall_s": wall_s, "issue_s": self.issue_s, "issue_cpu_s": self.issue_cpu_s,
                 "dispatch_s": self.dispatch_s, "dispatch_s_per_op": self.dispatch_s / n if n else 0.0,
                 "run_ahead_wait_s": self.wait_s, "switch_interval_s": self.switch_interval_s,
                 "cpu_threads": self.cpu_threads or torch.get_num_threads(),
                 "issue_s_by_handler": dict(self.issue_by_fn), "gpu_need_bytes": self.gpu_need,
                 "allocator_retries_by_handler": (dict(self.retries_by_fn) if self.trace_allocator and self.cuda
                                                  else None),
                 "pool_buffers": {k: p.count for k, p in self.pools.items()},
                 "straddle_copies": self.straddle_copies,  # heads copied by compute ops (``_straddle``)
                 "pool_buffers_plan_order": dict(self.prog.pool_peak),
                 "host_staging_peak_bytes_plan_order": self.prog.host_peak_bytes,
                 "host_weights_master_bytes": self.wts.host.nbytes,
                 "host_weights_tier_bytes": self._host_weight_tier_bytes(),
                 "disk_weights_tier_bytes": sum(n for _, n in self.disk_w_range),
                 "host_kv_bytes": self.host_kv_bytes,
                 "budget_bytes": self.budget,
                 "graphs": self.graphs.stats() if self.graphs is not None else {"mode": "off"}}
        if self.comp.sparse_attention < 1:  # V rows the sparse attention ops multiplied (``quant.sparse_sdpa``)
            stats["sparse_v_rows"] = int(self.sparse_rows.item()) + int(self.sparse_rows_host.item())
        if self.cuda:
            ms = torch.cuda.memory_stats(self.device)
            stats["allocator"] = {k: ms.get(k, 0) - self.alloc_counts0.get(k, 0)
                                  for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                            "num_device_alloc", "num_device_free")}
            peaks["gpu"] = torch.cuda.max_memory_reserved(self.device)
            stats["gpu_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            stats["gpu_max_reserved_bytes"] = peaks["gpu"]
            stats["allocator_conf"] = self.allocator_conf
            stats["allocator_cap_bytes"] = self.cap_bytes
            stats["arena_bytes"] = self.arena.nbytes
        peaks["cpu"] = stats["host_weights_tier_bytes"] + stats["host_kv_bytes"] + self.prog.host_peak_bytes
        makespan = float(self.end.max()) if n else 0.0
        stats["issue_frac"] = self.issue_s / makespan if makespan > 0 else 0.0
        # the issuing thread's CPU time in the same terms: its work alone when CUDA waits block (`--cuda-sched
        # blocking`); with CUDA's default spinning a blocked call counts as CPU time too, as in issue_frac
        stats["issue_cpu_frac"] = self.issue_cpu_s / makespan if makespan > 0 else 0.0
        if self.cuda and n:
            stats["host_bound_idle_s"] = host_bound_idle_s(self.plan, self.start, self.end, self.issued_at)
            stats["host_bound_idle_frac"] = stats["host_bound_idle_s"] / makespan if makespan > 0 else 0.0
            stats["host_in_op_s"] = host_in_op_s(self.plan, self.start, self.end, self.issued_at)
            stats["host_in_op_frac"] = stats["host_in_op_s"] / makespan if makespan > 0 else 0.0
        m = {"model": self.spec.name, "hardware": meta.get("hardware", self.device.type), "policy": self.plan.policy,
             "workload": wl.to_dict(), "settings": self.plan.settings,
             "derived": self.plan.derived, "source": "offexec", "device": str(self.device),
             "cuda_graphs": self.graph_mode == "cuda" and self.graphs is not None}
        if m["cuda_graphs"]:
            m["graph_max_q_tokens"] = self.plan.graph_max_q_tokens  # offsim prices issue as the run replayed
            if self.plan.graph_min_uses != 1:
                m["graph_min_uses"] = self.plan.graph_min_uses
        if self.plan.disk_cached:
            m["disk_cached"] = True
        m["run_ahead"] = None if self.plan.run_ahead is None else list(self.plan.run_ahead)  # its flow control
        if not _is_preset(self.spec):  # a checkpoint's or a modified spec: the trace carries it whole (validate)
            m["model_config"] = self.spec.to_dict()
        m.update(meta)
        trace = Trace.from_arrays(self.plan, self.start, self.end, m, peaks)
        kv = {}
        if self.keep_kv:
            kv = {"gpu": None if self.kv_gpu is None else self.kv_gpu.cpu(),
                  "cpu": None if self.kv_host is None else self.kv_host.clone(),
                  "disk": self._read_disk_kv() if self.disk_kv_stride else None}
        return RunResult(trace, toks.cpu().numpy(), stats, self.logits if self.record_logits else None, kv,
                         np.asarray(self.issue_by_op))

    def _host_weight_tier_bytes(self) -> int:
        """Bytes of the host-homed weight ranges h2d ops read: fp16 bytes, or their stored size when compressed."""
        split = self.plan.weight_split
        if self.packed is None:
            return sum(c for _, c in split)
        return sum(self.packed.range(g, g + c)[1] for g, c in split if c)

    def _read_disk_kv(self) -> torch.Tensor:
        s = self.spec
        out = torch.empty((s.num_layers, self.nb, self.cap, 2, self.gbs, self.kv_heads["disk"], self.kv_last),
                          dtype=self.kv_dtype)
        self.disk.read("kv.bin", out, 0)
        return out

    def _run_sequential(self) -> None:
        t0 = time.perf_counter()
        self.stream = None
        for b in self.prog.bound:
            a = time.perf_counter()
            getattr(self, "_op_" + b.fn)(b.op, b.args, b.info)
            z = time.perf_counter()
            self.start[b.op.id], self.end[b.op.id] = a - t0, z - t0
            self._done(b, ())

    def _run_streams(self) -> None:
        """The stream scheduler. On CUDA, real streams and events; with ``threaded`` on the CPU, stand-ins that run
        each GPU op at issue (so CI exercises the issue loop, the host workers and their dependencies).

        What the issuing loop needs of each op is looked up once, before the clock starts, in lists indexed by op id
        (its dependencies, its stream's queue, window and run-ahead bound, the events of its cross-stream
        dependencies, its timing events, its handler, the pool values it takes), so that an op's issue is its
        handler's host work plus a few list reads."""
        ops, bound = list(self.plan.ops), self.prog.bound
        n = len(ops)
        dev = self.device
        cuda = self.cuda
        Event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _HostEvent  # noqa: E731
        gpu_streams = self.gpu_streams
        streams = self.streams if cuda else {s: _HostStream(s) for s in gpu_streams}
        queues: dict[str, deque] = {s: deque() for s in gpu_streams + HOST_STREAMS}
        for op in ops:
            queues[op.stream].append(op.id)
        qlist = list(queues.values())
        is_host = bytearray(op.stream in HOST_STREAMS for op in ops)
        # ready[d]: what an op that depends on op d waits for -- a GPU op issued, a host op finished
        ready = bytearray(n)
        deps = [op.deps for op in ops]
        # timing events of every GPU op, made before the clock starts (each is recorded once, at the op's issue)
        ev_start = self.ev_start = [None if h else Event() for h in is_host]
        ev_end = self.ev_end = [None if h else Event() for h in is_host]
        cond = threading.Condition()
        errors: list = []
        host_q = {s: deque() for s in HOST_STREAMS}

        def worker(sname):
            if cuda:
                torch.cuda.set_device(dev)
            while True:
                with cond:
                    while not host_q[sname] and not errors:
                        cond.wait()
                    if errors:
                        return
                    oid = host_q[sname].popleft()
                if oid < 0:
                    return
                b = bound[oid]
                try:
                    for d in b.op.deps:
                        if is_host[d]:
                            with cond:
                                while not ready[d] and not errors:
                                    cond.wait()
                        else:
                            ev_end[d].synchronize()
                    a = time.perf_counter()
                    getattr(self, "_op_" + b.fn)(b.op, b.args, b.info)
                    z = time.perf_counter()
                    self.start[oid], self.end[oid] = a - self.t0, z - self.t0
                    self._done(b, ())
                except BaseException as exc:  # surface in the issuing thread
                    with cond:
                        errors.append(exc)
                        cond.notify_all()
                    return
                with cond:
                    ready[oid] = 1
                    cond.notify_all()

        windows = {st: deque() for st in gpu_streams}
        ra = self.plan.run_ahead
        run_ahead = {st: (math.inf if ra is None else w) for st, w in zip(("compute", "h2d", "d2h"), ra or (0, 0, 0))}
        run_ahead[P2P_STREAM] = self.P2P_RUN_AHEAD
        # per op: its stream's queue; per GPU op: its stream, window and run-ahead bound, the end events of the
        # dependencies on other GPU streams it waits for, its handler, the values it takes from a pool
        values, pools = self.prog.values, self.pools
        handlers = {fn: getattr(self, "_op_" + fn) for fn in {b.fn for b in bound}}
        queue_of = [queues[op.stream] for op in ops]
        gpu_of: list = [None] * n
        for op, b in zip(ops, bound):
            if is_host[op.id]:
                continue
            st = op.stream
            gpu_of[op.id] = (streams[st], windows[st], run_ahead[st],
                             tuple(ev_end[d] for d in op.deps if not is_host[d] and ops[d].stream != st),
                             handlers[b.fn], b.args, b.info,
                             tuple(vid for vid in b.args.values() if values[vid].kind in pools))
        if cuda:
            torch.cuda.synchronize(dev)
        ref = Event()
        ref.record(streams["compute"])
        if cuda:
            torch.cuda.synchronize(dev)
        self.t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(s,), daemon=True, name=f"offexec-{s}") for s in HOST_STREAMS]
        for t in threads:
            t.start()
        remaining = n
        issue = issue_cpu = 0.0
        by_op = self.issue_by_op = [0.0] * n
        issued_at = self.issued_at = np.full(n, np.nan)  # host clock (s from t0) when each GPU op's issue ended
        self.wait_s = 0.0
        by_fn: dict[str, float] = {}
        self.issue_by_fn = by_fn
        trace_alloc = cuda and self.trace_allocator
        by_retry = self.retries_by_fn = {}
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) if trace_alloc else 0
        cur = None
        vals, pool_get, done = self.vals, self._pool_get, self._done
        perf_counter, thread_time = time.perf_counter, time.thread_time
        idle = 0.0  # the loop waiting for a host op to finish (nothing issuable)
        diag = 0.0  # reading the allocator's counters (trace_allocator): the diagnostic's cost, not the loop's
        t_loop = time.perf_counter()
        try:
            while remaining:
                # among the streams' next ops whose dependencies allow it, the earliest in plan order
                best = n
                for q in qlist:
                    if q:
                        oid = q[0]
                        if oid < best:
                            for d in deps[oid]:
                                if not ready[d]:
                                    break
                            else:
                                best = oid
                if best == n:
                    wi = perf_counter()
                    with cond:
                        if errors:
                            raise errors[0]
                        cond.wait(timeout=0.05)
                        if errors:
                            raise errors[0]
                    idle += perf_counter() - wi
                    continue
                queue_of[best].popleft()
                remaining -= 1
                if is_host[best]:
                    with cond:
                        host_q[ops[best].stream].append(best)
                        cond.notify_all()
                    continue
                ready[best] = 1
                s, win, bound_ahead, waits, handler, args, info, pool_vids = gpu_of[best]
                if len(win) >= bound_ahead:
                    wa = perf_counter()
                    win.popleft().synchronize()
                    self.wait_s += perf_counter() - wa
                a = perf_counter()
                ca = thread_time()
                if s is not cur and cuda:
                    torch.cuda.set_stream(s)
                    cur = s
                self.stream = s
                for ev in waits:
                    s.wait_event(ev)
                self.replayed = False  # set by _graphed: this op went through a CUDA graph
                # the op's pool buffers, taken now: the stream's wait for their previous users (``BufferPool.acquire``)
                # is enqueued before the op's start event (waiting is not the op's time)
                for vid in pool_vids:
                    if vid not in vals:
                        pool_get(vid)
                ev1 = ev_end[best]
                ev_start[best].record(s)
                handler(ops[best], args, info)
                ev1.record(s)
                done(bound[best], (ev1,))
                win.append(ev1)
                z = perf_counter()
                dt = z - a
                issue += dt
                by_op[best] = dt
                issued_at[best] = z - self.t0
                issue_cpu += thread_time() - ca
                fn = bound[best].fn
                if self.replayed:  # per handler, graphed apart (the profile's
                    fn += " (graph)"  # issue_graph_s: experiments/validation/calibrate_issue.py)
                by_fn[fn] = by_fn.get(fn, 0.0) + dt
                if trace_alloc:  # retries since the last op: made by this handler's allocations (this thread's)
                    r = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
                    if r > retries:
                        key = f"{fn} ({ops[best].phase})"
                        by_retry[key] = by_retry.get(key, 0) + r - retries
                        retries = r
                    diag += perf_counter() - z
            # the loop's own time per op, outside the handlers: finding the next op, its dependencies, the window's
            # bookkeeping (offsim prices it beside each handler's issue time: the profile's ('issue', 'dispatch') rows)
            self.dispatch_s = max(0.0, time.perf_counter() - t_loop - issue - self.wait_s - idle - diag)
            for sname in HOST_STREAMS:
                with cond:
                    host_q[sname].append(-1)
                    cond.notify_all()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            if cuda:
                torch.cuda.synchronize(dev)
        finally:
            with cond:
                if not errors:
                    errors.append(None)
                cond.notify_all()
            if cuda:
                torch.cuda.set_stream(torch.cuda.default_stream(dev))
        self.issue_s, self.issue_cpu_s = issue, issue_cpu
        for oid in range(n):
            if not is_host[oid]:
                self.start[oid] = ref.elapsed_time(ev_start[oid]) / 1e3
                self.end[oid] = ref.elapsed_time(ev_end[oid]) / 1e3
        self.ev_start = self.ev_end = None

    def _done(self, b, events) -> None:
        """After op ``b`` is issued (GPU) or finished (host): values whose last user it was go back. ``events``
        (the op's end event on its stream) are kept for pool values only: what a pool buffer's next user waits on
        (``_free``); other values are freed without waiting."""
        left, pool_vid = self.val_left, self.pool_vid
        with self.val_lock:
            for vid in b.args.values():
                if events and pool_vid[vid]:
                    evs = self.val_events.get(vid)
                    if evs is None:
                        self.val_events[vid] = list(events)
                    else:
                        evs.extend(events)
                left[vid] -= 1
                if not left[vid]:
                    self._free(vid)

    def _free(self, vid: int) -> None:
        v = self.prog.values[vid]
        t = self.vals.pop(vid, None)
        evs = self.val_events.pop(vid, ())
        self.val_stream.pop(vid, None)
        t = self.pool_flat.pop(vid, t)  # a pool buffer goes back whole, not the view its handler shaped
        if v.kind in self.pools and t is not None:
            i = self.pool_index.pop(vid, None)
            if i is None:
                self.pools[v.kind].release(t, _last_per_stream(evs))
            else:
                self.pools[v.kind].give(i, _last_per_stream(evs))

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _val(self, vid: int):
        """A value for the op being issued; GPU tensors made on another stream are marked as used on this one."""
        t = self.vals[vid]
        if self.cuda and self.stream is not None:
            made = self.val_stream.get(vid)
            if made is not None and made is not self.stream:
                for x in (t if isinstance(t, tuple) else (t,)):
                    if isinstance(x, torch.Tensor) and x.is_cuda:
                        x.record_stream(self.stream)
        return t

    def _put(self, vid: int, t) -> None:
        self.vals[vid] = t
        if self.cuda and not self.pool_vid[vid]:  # pool buffers are never freed
            self.val_stream[vid] = self.stream

    def _pool_get(self, vid: int) -> torch.Tensor:
        """The pool buffer of value ``vid``, taken from its pool at the value's first use."""
        t = self.vals.get(vid)
        if t is None:
            pool, i = self.pools[self.prog.values[vid].kind], self.prog.buffer_of.get(vid)
            if i is None:
                t = pool.acquire(self.stream)
            else:
                self.pool_index[vid], t = pool.take(i, self.stream)
            self.vals[vid] = self.pool_flat[vid] = t
        return t

    def _unit(self, part: str):
        """The weight unit a compute part reads: the whole layer (None), or its sub-layer ('attn', 'mlp')."""
        if None in self.prog.units:
            return None
        return "mlp" if part == "mlp" else "attn"

    def _weights(self, j: int, args: dict, unit=None, part: str = "layer") -> dict:
        """Named weight tensors of layer ``j``'s ``unit`` for compute part ``part``: views of the resident buffer and
        the slot, or, with compressed weights, of the fp16 working copy after dequantizing the part's tensors."""
        if self.packed is not None:
            return self._dequantized(j, args, unit, part)
        ulo, uhi = self.prog.units[unit]
        if "w" not in args:
            key = (j, unit, None)
            w = self.view_cache.get(key)
            if w is None:
                w = self.view_cache[key] = M.layer_views(self.wts.layout, [(0, self.w_res[j])], ulo, uhi)
            return w
        slot = self._straddle(self._pool_get(args["w"]))
        key = (j, unit, slot.data_ptr())
        w = self.view_cache.get(key)
        if w is None:
            base = self.prog.slot_base[(j, unit)]
            pieces = [(base, slot[:uhi - base])]
            if base > ulo:
                pieces.insert(0, (0, self.w_res[j][:base]))
            w = self.view_cache[key] = M.layer_views(self.wts.layout, pieces, ulo, uhi)
        return w

    def _straddle(self, slot: torch.Tensor) -> torch.Tensor:
        """``slot``, its straddling tensor's resident head copied in first if its load left that to the first compute
        op that reads it (``_op_h2d_weight``): on the current (compute) stream, ordered after the load's end, which
        the op waits for."""
        pending = self.straddle_pending.pop(slot.data_ptr(), None)
        if pending is not None:
            pending[1].copy_(pending[0], non_blocking=True)
            self.straddle_copies += 1
        return slot

    def _dequantized(self, j: int, args: dict, unit, part: str) -> dict:
        """Compressed weights: dequantize the tensors compute part ``part`` reads (``part_reads``) from their stored
        bytes -- the resident buffer, or the slot for streamed tensors (the straddling one included) -- into the fp16
        working copy ``w_deq`` (the unit's tensors at their offsets from its start), in the op itself, on the compute
        stream: the passes offsim adds to the compute op (``costmodel.quant_seconds``). Every op dequantizes anew,
        as FlexGen does: one working copy serves every op (``footprint.dequantized_copy_bytes``)."""
        ulo, uhi = self.prog.units[unit]
        views = self.view_cache.get(("deq", unit))
        if views is None:
            views = self.view_cache[("deq", unit)] = M.layer_views(self.wts.layout, [(ulo, self.w_deq[:uhi - ulo])],
                                                                   ulo, uhi)
        pk, e = self.packed, self.e
        slot = self._straddle(self._pool_get(args["w"])) if "w" in args else None
        base = pk.offset(self.prog.slot_base[(j, unit)] * e)  # the slot's first stored byte (a tensor's start)
        for i, (t, off, n, _) in enumerate(pk.tensors):
            if t.lo < ulo or t.hi > uhi or not part_reads(t.name, part):
                continue
            src = self.w_res[j][off:off + n] if t.hi <= self.g_el[j] else slot[off - base:off - base + n]
            pk.unpack(i, src, views[t.name])
        return views

    def _kv_view(self, buf: torch.Tensor, heads: int) -> torch.Tensor:
        return buf.view(self.cap, 2, self.gbs, heads, self.kv_last)

    def _kv_work(self, vid: int, g: str) -> torch.Tensor:
        """The KV work buffer of value ``vid`` (pool ``kvwork_<g>``) as head group ``g``'s [max_len, 2, B, n, D]
        buffer: one view per pool buffer, made at its first use (pool buffers live for the whole run)."""
        buf = self._pool_get(vid)
        key = ("kv", g, buf.data_ptr())
        v = self.view_cache.get(key)
        if v is None:
            lo, hi = self.prog.groups[g]
            v = self.view_cache[key] = self._kv_view(buf, hi - lo)
        return v

    def _kv_home(self, g: str, j: int, k: int) -> torch.Tensor:
        """Layer ``j`` batch ``k``'s home KV buffer of head group ``g`` ('gpu' or 'cpu'), [max_len, 2, B, n, D]: a
        view of ``kv_gpu`` / ``kv_host``, made once per (layer, batch)."""
        key = (g, j, k)
        v = self.view_cache.get(key)
        if v is None:
            v = self.view_cache[key] = (self.kv_gpu if g == "gpu" else self.kv_host)[j, k]
        return v

    def _load_kv(self, op, args) -> None:
        """Compressed cache: dequantize the cached positions [0, ctx - q) of every head group into the fp16 working
        copy ``kv_deq`` -- in the attention's op, on the compute stream, as offsim prices it (``quant_seconds``: the
        cached positions only; the new tokens' K/V are fresh fp16) -- before a graph replays (the graph then holds
        no dequantize temporaries). A no-op without compression."""
        start = op.ctx_tokens - op.q_tokens
        if self.comp.cache and start:
            for lo, hi, buf in self._kv_buffers(op, args):
                quant.unpack_vectors_into(buf[:start], self.kv_deq[:start, :, :, lo:hi])

    def _attend_packed(self, bufs, start: int, ctx: int, q, k_new, v_new, pos=None, mask=None,
                       sparse=None) -> torch.Tensor:
        """``_attend_gpu`` with a compressed cache: quantize the new tokens' K/V into each group's packed buffer
        (the store; d2h and disk ops then move packed bytes), put them fresh into the working copy beside the
        cached positions ``_load_kv`` dequantized, and attend over it -- rows [start, ctx), or with ``pos`` (the
        graphs' device-side positions) those rows over the whole buffer with ``mask``. ``bufs``: ``_kv_buffers``."""
        kt, vt = k_new.transpose(0, 1), v_new.transpose(0, 1)  # [T, B, Hk, D]
        work = self.kv_deq
        for lo, hi, buf in bufs:
            for i, x in ((0, kt), (1, vt)):
                if pos is None:  # prefill or a recompute: many tokens, packed in bounded chunks
                    quant.pack_vectors_into(x[:, :, lo:hi], buf[start:ctx, i])
                else:
                    buf[:, i].index_copy_(0, pos, quant.pack_vectors(x[:, :, lo:hi]))
        for i, x in ((0, kt), (1, vt)):
            if pos is None:
                work[start:ctx, i] = x
            else:
                work[:, i].index_copy_(0, pos, x)
        rows = work if pos is not None else work[:ctx]
        groups = [(0, self.spec.num_kv_heads, rows[:, 0].permute(1, 2, 0, 3), rows[:, 1].permute(1, 2, 0, 3))]
        return M.attention(self.spec, q, groups, mask=mask, sparse=sparse)

    def _start(self, op, device=None):
        """The positions of the op's tokens, cache rows [ctx - q, ctx): their first row (an int), or in a padded
        batch each sequence's positions, int64 [B, q] (``model.positions``)."""
        start = op.ctx_tokens - op.q_tokens
        if self.pad is None:
            return start
        pad = self._pad(op, device)
        return M.positions(torch.arange(start, op.ctx_tokens, device=pad.device), pad)

    def _pad(self, op, device=None) -> torch.Tensor:
        return self.pad[op.batch] if device is not None and torch.device(device).type == "cpu" else \
            self.pad_dev[op.batch]

    def _mask(self, op, device=None):
        """The key mask of an eager attention over cache rows [0, ctx): None (causal, no padding), or in a padded
        batch bool [B, 1, q, ctx] (``model.visible``)."""
        if self.pad is None:
            return None
        pad = self._pad(op, device)
        return M.visible(torch.arange(op.ctx_tokens - op.q_tokens, op.ctx_tokens, device=pad.device),
                         torch.arange(op.ctx_tokens, device=pad.device), pad)

    def _sparse(self, op=None, host: bool = False):
        """Top-k sparse attention for ``op`` (``model.Sparse``), or None (dense): the plan's ``sparse_attention``
        below 1, in generation -- a decode op's queries at generated rows (``costmodel.sparse_share``; prefill is
        dense, and so are the prompt rows a TightLLM recompute block holds, even one recomputing the whole context).
        No ``op``: a graphed decode op. ``host``: counted on the host's counter (CPU attention's worker thread)."""
        f = self.comp.sparse_attention
        if f >= 1 or (op is not None and op.phase != "decode"):
            return None
        # queries at the batch's prompt rows (a TightLLM recompute of prompt tokens) stay dense, as their prefill
        # was; a graph reads the row from a device tensor that ``_graphed`` writes before each replay
        first = self.sparse_first if op is None else self.plan.workload.batch_prompt_lens[op.batch]
        return M.Sparse(f, None, self.sparse_rows_host if host else self.sparse_rows, first)

    def _attend_gpu(self, op, args, q, k_new, v_new) -> torch.Tensor:
        """Write the new tokens' K/V into each head group's buffer and attend over positions [0, ctx) (densely, or
        top-k sparse: ``_sparse``)."""
        ctx, start = op.ctx_tokens, op.ctx_tokens - op.q_tokens
        sparse = self._sparse(op)
        # a padded batch's decode mask is a new shape every step: no SDPA backend that plans per shape (model.py)
        with M.growing_mask_kernels(self.pad is not None and op.phase == "decode", self.device):
            if self.comp.cache:
                return self._attend_packed(self._kv_buffers(op, args), start, ctx, q, k_new, v_new,
                                           mask=self._mask(op), sparse=sparse)
            groups = []
            for lo, hi, buf in self._kv_buffers(op, args):
                buf[start:ctx, 0] = k_new[:, :, lo:hi].transpose(0, 1)  # [T, B, n, D]
                buf[start:ctx, 1] = v_new[:, :, lo:hi].transpose(0, 1)
                K = buf[:ctx, 0].permute(1, 2, 0, 3)  # [B, n, C, D]
                V = buf[:ctx, 1].permute(1, 2, 0, 3)
                groups.append((lo, hi, K, V))
            return M.attention(self.spec, q, groups, mask=self._mask(op), sparse=sparse)

    # ---- op handlers: compute ---------------------------------------------------------------------------------
    def _op_embed(self, op, args, info):
        start = op.ctx_tokens - op.q_tokens
        ids = self.tokens[op.batch, :, start:op.ctx_tokens]  # [B, T]
        self._put(args["out"], M.embed(self.spec, self.emb, ids, self._start(op)))

    def _op_head(self, op, args, info):
        x = self._val(args["x"])
        logits = M.head(self.spec, self.emb, x)  # [B, V]
        self.tokens[op.batch, :, op.ctx_tokens] = logits.argmax(-1)
        if self.record_logits:
            self.logits.append((op.step, op.batch, logits.float().cpu()))

    def _op_layer(self, op, args, info):
        x = self._val(args["x"])
        w = self._weights(op.layer, args, None, "layer")
        self._load_kv(op, args)
        sf = self._written_rows(op)
        attend = self._attend_written if sf else self._attend_static
        if self._graphed(op, args, (x,), lambda xs, bufs: M.post_attn(self.spec, w, xs, attend(
                bufs, *M.pre_attn(self.spec, w, xs, self.graphs.rpos, self.rope, sf))), seq_first=sf):
            return
        q, k, v = M.pre_attn(self.spec, w, x, self._start(op), self.rope)
        o = self._attend_gpu(op, args, q, k, v)
        self._put(args["out"], M.post_attn(self.spec, w, x, o))

    def _op_attn_layer(self, op, args, info):
        """The attention sub-layer: Q/K/V, attention, output projection and residual (Q/K/V freed before the
        projection: ``footprint.layer_stage_bytes`` 'out_proj')."""
        x = self._val(args["x"])
        w = self._weights(op.layer, args, "attn", "attn_layer")
        self._load_kv(op, args)
        sf = self._written_rows(op)
        attend = self._attend_written if sf else self._attend_static
        if self._graphed(op, args, (x,), lambda xs, bufs: M.attn_out(self.spec, w, xs, attend(
                bufs, *M.pre_attn(self.spec, w, xs, self.graphs.rpos, self.rope, sf))), seq_first=sf):
            return
        q, k, v = M.pre_attn(self.spec, w, x, self._start(op), self.rope)
        o = self._attend_gpu(op, args, q, k, v)
        del q, k, v
        self._put(args["out"], M.attn_out(self.spec, w, x, o))

    def _op_mlp(self, op, args, info):
        x = self._val(args["x"])
        w = self._weights(op.layer, args, "mlp", "mlp")
        if self._graphed(op, args, (x,), lambda xs, bufs: M.mlp(self.spec, w, xs)):
            return
        self._put(args["out"], M.mlp(self.spec, w, x))

    # ---- decode ops as CUDA graphs (offexec/graphs.py) --------------------------------------------------------
    def _kv_buffers(self, op, args) -> list:
        """(head_lo, head_hi, [max_len, 2, B, n, D] buffer) of each head group an attention op reads."""
        out = []
        for g, (lo, hi) in self.prog.groups.items():
            if hi > lo:
                buf = self._kv_home("gpu", op.layer, op.batch) if g == "gpu" else self._kv_work(args[f"kv_{g}"], g)
                out.append((lo, hi, buf))
        return out

    def _graphed(self, op, args, xs: tuple, body, out=None, seq_first: bool = False) -> bool:
        """Run decode op ``op`` (one new token) through its graph; False: not graphable, run it eagerly.
        ``body(*static_inputs, kv_buffers)`` is the op's math on the graphs' static inputs; the graph is keyed by
        the addresses it bakes in: the layer's weights (a slot's address, or the resident views) and the KV buffers
        it attends over. ``out(result)``: what the op leaves as its value (default: the result itself).
        ``seq_first``: the body takes and returns its hidden states [q, B, E] (``DecodeGraphs.run``)."""
        if self.graphs is None or not costmodel.op_graphed(op.kind, op.part, op.q_tokens, op.phase,
                                                           self.plan.graph_q_tokens, self.eager_shapes):
            return False
        bufs = self._kv_buffers(op, args) if op.part in ("layer", "attn_layer") else []
        slot = self.vals[args["w"]].data_ptr() if "w" in args else None
        # sequence-first, a result read by one op only (the batch's next, or a copy that op's input waits for) lives
        # in the batch's own buffer, in place: no static copies (DecodeGraphs.run's ``home``)
        home = op.batch if seq_first and len(xs) == 1 and self.prog.values[args["out"]].users == 2 else None
        key = (op.part, op.q_tokens, op.layer, slot, tuple(b.data_ptr() for _, _, b in bufs), home)
        self.graphs.set_ctx(op.ctx_tokens, op.q_tokens, None if self.pad is None else self.pad_dev[op.batch])
        if self.comp.sparse_attention < 1 and op.q_tokens > 1:  # sparse from the batch's first generated row on
            self.sparse_first.fill_(self.plan.workload.batch_prompt_lens[op.batch])
        y = self.graphs.run(key, lambda *ins: body(*ins, bufs), *xs, seq_first=seq_first, home=home)
        if y is None:  # capture failed: eager from here on
            self.graphs = None
            return False
        self._put(args["out"], y if out is None else out(y))
        self.replayed = self.graphs.mode == "cuda"
        return True

    def _written_rows_plan(self) -> bool:
        """Whether this run's graphed decode ops of several query tokens attend over the rows written so far,
        sequence-first (``Plan.graph_attention`` 'written_rows', ``model.written_rows_attention``): a plan without
        padding, compressed cache or sparse attention, whose KV heads sit in one buffer (one home tier), in half
        precision with a head size flash takes on CUDA. Other ops attend over the whole buffer under the key mask
        (``_attend_static``)."""
        if self.plan.graph_attention != "written_rows" or self.pad is not None or self.comp.cache \
                or self.comp.sparse_attention < 1:
            return False
        if sum(1 for lo, hi in self.prog.groups.values() if hi > lo) != 1:
            return False
        return not self.cuda or (self.dtype in (torch.float16, torch.bfloat16) and self.spec.head_dim % 8 == 0
                                 and self.spec.head_dim <= 256)

    def _written_rows(self, op) -> bool:
        """``_written_rows_plan`` for op ``op``: an op of several query tokens (a TightLLM recompute)."""
        return self.written_rows and op.q_tokens > 1

    def _attend_written(self, bufs, q, k_new, v_new) -> torch.Tensor:
        """``_attend_static`` sequence-first over the written rows: q [q, B, H, D], the new K/V [q, B, n, D] written
        at the graphs' device-side positions from contiguous rows (``index_copy_``), then
        ``model.written_rows_attention`` over the buffer's rows [0, ctx); [q, B, H·D]."""
        (_, _, buf), = bufs
        g = self.graphs
        buf[:, 0].index_copy_(0, g.pos, k_new)  # [M, B, n, D] at rows pos <- [q, B, n, D]
        buf[:, 1].index_copy_(0, g.pos, v_new)
        return M.written_rows_attention(q, buf[:, 0], buf[:, 1], g.ctx_k, g.cu_q(q.shape[0]), g.cu_k, g.keys)

    def _attend_static(self, bufs, q, k_new, v_new) -> torch.Tensor:
        """``_attend_gpu`` for the op's q tokens at the graphs' device-side positions: their K/V written with
        ``index_copy_`` at ``pos``, attention over each full-length buffer, each query's unseen keys masked."""
        pos, groups = self.graphs.pos, []
        sparse = self._sparse()  # (a graphed op is a decode op: sparse when the plan is; V rows gathered per head:
        # the most a query keeps over the full-length buffer, a fixed count every replay shares)
        if self.comp.cache:
            return self._attend_packed(bufs, 0, 0, q, k_new, v_new, pos, self.graphs.keys, sparse)
        for lo, hi, buf in bufs:
            buf[:, 0].index_copy_(0, pos, k_new[:, :, lo:hi].transpose(0, 1))  # [q, B, n, D] at rows pos
            buf[:, 1].index_copy_(0, pos, v_new[:, :, lo:hi].transpose(0, 1))
            groups.append((lo, hi, buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3)))  # [B, n, M, D]
        return M.attention(self.spec, q, groups, mask=self.graphs.keys, sparse=sparse)

    def _op_pre_attn(self, op, args, info):
        """Q, K and V of the new tokens packed in one tensor [B, T, H + 2 Hk, D] (made here, on the compute stream,
        inside the graph when graphed), so that the CPU delegation's ``d2h_qkv`` is one copy and no kernel on the
        copy stream; the value is (residual, q, k, v, packed) with q, k, v views of the packed tensor."""
        x = self._val(args["x"])
        w = self._weights(op.layer, args, self._unit("pre_attn"), "pre_attn")
        H, Hk = self.spec.num_heads, self.spec.num_kv_heads

        def value(qkv):
            return x, qkv[:, :, :H], qkv[:, :, H:H + Hk], qkv[:, :, H + Hk:], qkv

        if self._graphed(op, args, (x,), lambda xs, bufs: torch.cat(
                M.pre_attn(self.spec, w, xs, self.graphs.rpos, self.rope), 2), out=value):
            return
        self._put(args["out"], value(torch.cat(M.pre_attn(self.spec, w, x, self._start(op), self.rope), 2)))

    def _op_attn_gpu(self, op, args, info):
        _, q, k, v, _ = self._val(args["pre"])
        self._load_kv(op, args)
        self._put(args["out"], self._attend_gpu(op, args, q, k, v))

    def _op_post_attn(self, op, args, info):
        x = self._val(args["pre"])[0]
        o = self._val(args["attn"])
        w = self._weights(op.layer, args, None, "post_attn")
        if self._graphed(op, args, (x, o), lambda xs, os, bufs: M.post_attn(self.spec, w, xs, os)):
            return
        self._put(args["out"], M.post_attn(self.spec, w, x, o))

    def _op_attn_out(self, op, args, info):
        x = self._val(args["pre"])[0]
        o = self._val(args["attn"])
        w = self._weights(op.layer, args, "attn", "attn_out")
        if self._graphed(op, args, (x, o), lambda xs, os, bufs: M.attn_out(self.spec, w, xs, os)):
            return
        self._put(args["out"], M.attn_out(self.spec, w, x, o))

    def _op_attn_cpu(self, op, args, info):
        """FlexGen's CPU delegation: attention on the host over the host-homed (and disk-read) KV."""
        s = self.spec
        H, Hk = s.num_heads, s.num_kv_heads
        qkv = self.vals[args["qkv"]]  # [B, T, H + 2 Hk, D]
        q, k_new, v_new = qkv[:, :, :H], qkv[:, :, H:H + Hk], qkv[:, :, H + Hk:]
        j, b = op.layer, op.batch
        ctx, start = op.ctx_tokens, op.ctx_tokens - op.q_tokens
        groups = []
        lo, hi = self.prog.groups["cpu"]
        if hi > lo:
            buf = self.kv_host[j, b]
            buf[start:ctx, 0] = k_new[:, :, lo:hi].transpose(0, 1)
            buf[start:ctx, 1] = v_new[:, :, lo:hi].transpose(0, 1)
            groups.append((lo, hi, buf[:ctx, 0].permute(1, 2, 0, 3), buf[:ctx, 1].permute(1, 2, 0, 3)))
        lo, hi = self.prog.groups["disk"]
        if hi > lo:
            new = torch.stack((k_new[:, :, lo:hi], v_new[:, :, lo:hi]), 0).permute(2, 0, 1, 3, 4)  # [T, 2, B, n, D]
            if start:
                stage = self.vals[args["kvread"]][:start]  # [start, 2, B, n, D]
                new = torch.cat((stage, new), 0)
            groups.append((lo, hi, new[:, 0].permute(1, 2, 0, 3), new[:, 1].permute(1, 2, 0, 3)))
        out = host_tensor((qkv.shape[0], qkv.shape[1], H * s.head_dim), qkv.dtype, self.device)
        M.attention(s, q, groups, out=out, mask=self._mask(op, "cpu"), sparse=self._sparse(op, host=True))
        self.vals[args["out"]] = out

    # ---- op handlers: transfers -------------------------------------------------------------------------------
    def _op_h2d_weight(self, op, args, info):
        if self.packed is not None:
            return self._h2d_packed_weight(op, args, info)
        j = op.layer
        base = self.prog.slot_base[(j, info["unit"])]
        slot = self._pool_get(args["slot"])
        if info.get("init") and base < self.g_el[j]:
            # the straddling tensor's resident head, so that it is whole in the slot: a device-to-device copy that
            # the first compute op reading the slot makes on the compute stream (``_straddle``). Made here, on the
            # H2D stream, the slices behind it were slow: OPT-30B TightLLM at 24 GiB (74 MB heads) moved its first
            # slices at 38 GB/s, the rest at 55 -- the copy waiting for SMs the compute stream's GEMMs held, the link
            # idle behind it; moved here, 55 and 55, decode +7.8 % (docs/architecture.md, 2026-12-04)
            self.straddle_pending[slot.data_ptr()] = (self.w_res[j][base:], slot[:self.g_el[j] - base])
        lo, hi = op.lo // self.e, op.hi // self.e
        if "stage" in args:
            a = lo - info["stage_lo"]
            src = self.vals[args["stage"]][a:a + hi - lo]
        else:  # a range of the host master: the same view every step (made once)
            key = ("w", j, lo, hi)
            src = self.view_cache.get(key)
            if src is None:
                src = self.view_cache[key] = self.wts.layers[j, lo:hi]
        key = ("slot", slot.data_ptr(), lo - base, hi - base)  # (slots are pool buffers: they live for the run)
        dst = self.view_cache.get(key)
        if dst is None:
            dst = self.view_cache[key] = slot[lo - base:hi - base]
        dst.copy_(src, non_blocking=True)

    def _h2d_packed_weight(self, op, args, info):
        """``_op_h2d_weight`` with compressed weights: the stored bytes of fp16 range [lo, hi) (``PackedLayers.range``:
        the op's nbytes) from the host's packed layer or the disk read's staging into the slot, which holds the
        stored bytes from its base (a tensor's start) on; the first load brings the straddling tensor's resident
        head."""
        j, pk = op.layer, self.packed
        base = pk.offset(self.prog.slot_base[(j, info["unit"])] * self.e)
        slot = self._pool_get(args["slot"])
        if info.get("init") and self.w_res[j] is not None and base < self.w_res[j].numel():
            # (on the compute stream, as ``_op_h2d_weight``'s)
            self.straddle_pending[slot.data_ptr()] = (self.w_res[j][base:], slot[:self.w_res[j].numel() - base])
        a, n = pk.range(op.lo, op.hi)
        if "stage" in args:
            stage = self.vals[args["stage"]]
            s = a - pk.offset(info["stage_lo"] * self.e)
            if s < 0 or s + n > stage.numel():
                raise ExecError(f"{op.describe()}: its stored bytes are not all in the disk read's staging buffer "
                                "(a load that splits a disk read inside a tensor): not supported with compression")
            src = stage[s:s + n]
        else:
            src = pk.layers[j, a:a + n]
        slot[a - base:a - base + n].copy_(src, non_blocking=True)

    def _op_disk_read_weight(self, op, args, info):
        j = op.layer
        if self.packed is not None:  # the stored bytes of the range, from the layer's stored disk range
            a, n = self.packed.range(op.lo, op.hi)
            out = host_tensor((n,), torch.uint8, self.device)
            self.disk.read("weights.bin", out, j * self.disk_w_stride + a - self.disk_w_range[j][0])
            self.vals[args["out"]] = out
            return
        lo, hi = op.lo // self.e, op.hi // self.e
        first = self.g_el[j] + self.c_el[j]
        out = host_tensor((hi - lo,), self.dtype, self.device)
        self.disk.read("weights.bin", out, j * self.disk_w_stride + (lo - first) * self.e)
        self.vals[args["out"]] = out

    def _op_h2d_kv(self, op, args, info):
        g = "cpu" if "src" not in args else "disk"
        glo = self.prog.groups[g][0]
        h0, h1 = op.head_lo - glo, op.head_hi - glo
        dst = _kv_rows(self._kv_work(args["dst"], g), op.lo, op.hi, h0, h1)
        if g == "cpu":
            src = _kv_rows(self._kv_home("cpu", op.layer, op.batch), op.lo, op.hi, h0, h1)
        else:
            a = op.lo - info["src_lo"]
            src = self.vals[args["src"]][a:a + op.hi - op.lo]
        dst.copy_(src, non_blocking=True)

    def _op_d2h_kv(self, op, args, info):
        g = "cpu" if "out" not in args else "disk"
        glo = self.prog.groups[g][0]
        h0, h1 = op.head_lo - glo, op.head_hi - glo
        src = _kv_rows(self._kv_work(args["src"], g), op.lo, op.hi, h0, h1)
        if g == "cpu" and info.get("scratch"):  # (``program.bind``: CPU attention already stored these rows)
            host_tensor(src.shape, src.dtype, self.device).copy_(src, non_blocking=True)
        elif g == "cpu":
            _kv_rows(self._kv_home("cpu", op.layer, op.batch), op.lo, op.hi, h0, h1).copy_(src, non_blocking=True)
        else:
            out = host_tensor(src.shape, src.dtype, self.device)
            out.copy_(src, non_blocking=True)
            self.vals[args["out"]] = out

    def _op_disk_read_kv(self, op, args, info):
        n = self.kv_heads["disk"]
        out = host_tensor((op.hi - op.lo, 2, self.gbs, n, self.kv_last), self.kv_dtype, self.device)
        tok_bytes = 2 * self.gbs * n * self.kv_last * self.kv_e
        base = (op.layer * self.nb + op.batch) * self.disk_kv_stride
        self.disk.read("kv.bin", out, base + op.lo * tok_bytes)
        self.vals[args["out"]] = out

    def _op_disk_write_kv(self, op, args, info):
        n = self.kv_heads["disk"]
        glo = self.prog.groups["disk"][0]
        if op.head_lo != glo or op.head_hi != glo + n:
            raise ExecError(f"{op.describe()}: the disk tier writes whole disk-homed head groups "
                            f"([{glo}, {glo + n}))")
        src = self.vals[args["src"]]
        a, b = op.lo - info["src_lo"], op.hi - info["src_lo"]
        if info["src_kind"] == "qkv":  # CPU attention's landing buffer [B, T, H + 2 Hk, D]
            s = self.spec
            h0 = s.num_heads + glo
            k = src[:, a:b, h0:h0 + n]
            v = src[:, a:b, h0 + s.num_kv_heads:h0 + s.num_kv_heads + n]
            data = torch.stack((k, v), 0).permute(2, 0, 1, 3, 4).contiguous()  # [T, 2, B, n, D]
        else:
            h = op.head_lo - info["src_h0"]
            data = src[a:b, :, :, h:h + n].contiguous()
        tok_bytes = 2 * self.gbs * n * self.kv_last * self.kv_e
        base = (op.layer * self.nb + op.batch) * self.disk_kv_stride
        self.disk.write("kv.bin", data, base + op.lo * tok_bytes)

    def _op_d2h_hidden(self, op, args, info):
        x = self._val(args["src"])
        out = host_tensor(x.shape, x.dtype, self.device)
        out.copy_(x, non_blocking=True)
        self.vals[args["out"]] = out

    def _op_h2d_hidden(self, op, args, info):
        src = self.vals[args["src"]]
        buf = self._pool_get(args["out"])  # a landing buffer (``footprint.landing_buffer_bytes``)
        x = buf[:src.numel()].view(src.shape)
        x.copy_(src, non_blocking=True)
        self.vals[args["out"]] = x

    def _op_d2h_qkv(self, op, args, info):
        packed = self._val(args["src"])[4]  # [B, T, H + 2 Hk, D], packed by pre_attn on the compute stream
        out = host_tensor(packed.shape, packed.dtype, self.device)
        out.copy_(packed, non_blocking=True)
        self.vals[args["out"]] = out

    def _op_h2d_attn_out(self, op, args, info):
        src = self.vals[args["src"]]
        self._put(args["out"], src.to(self.device, non_blocking=True))

    # ---- op handlers: a pipeline stage's GPU-to-GPU copies (offexec/distributed.py) ----------------------------
    def _op_send_hidden(self, op, args, info):
        self.comm.send(op, self._val(args["src"]).contiguous())

    def _op_recv_hidden(self, op, args, info):
        out = torch.empty((self.gbs, op.hi - op.lo, self.spec.d_model), dtype=self.dtype, device=self.device)
        self.comm.recv(op, out)
        self._put(args["out"], out)

    def _op_send_token(self, op, args, info):
        self.comm.send(op, self.tokens[op.batch, :, op.lo:op.hi].contiguous())

    def _op_recv_token(self, op, args, info):
        out = torch.empty((self.gbs, op.hi - op.lo), dtype=self.tokens.dtype, device=self.device)
        self.comm.recv(op, out)
        self.tokens[op.batch, :, op.lo:op.hi] = out


def part_reads(name: str, part: str) -> bool:
    """Whether compute part ``part`` reads weight tensor ``name`` (a ``layer_tensors`` name): the tensors of the
    math in offexec/model.py -- pre_attn: the norm and Q/K/V projections; attn_out: the output projection;
    post_attn: the output projection and the MLP; attn_layer: the attention's; mlp: the MLP's; layer: all. With
    compressed weights, the tensors an op dequantizes (offsim prices the part's matrices: ``quant_seconds``)."""
    mod = name.split(".")[0]
    attn, out = mod in fp.ATTN_TENSORS, mod in ("out_proj", "o_proj")
    return {"layer": True, "pre_attn": attn and not out, "attn_out": out, "post_attn": out or not attn,
            "attn_layer": attn, "mlp": not attn}[part]


class _HostStream:
    """Stand-in for a CUDA stream when the scheduler runs on the CPU: work runs at issue, so nothing to wait for."""

    def __init__(self, name: str):
        self.name = name

    def wait_event(self, ev) -> None:
        pass


class _HostEvent:
    """Stand-in for a CUDA timing event: the host clock when recorded."""

    def __init__(self):
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


def _kv_rows(buf: torch.Tensor, lo: int, hi: int, h0: int, h1: int) -> torch.Tensor:
    """Positions [lo, hi) of heads [h0, h1) of a [max_len, 2, B, n, D] KV buffer: ``buf[lo:hi, :, :, h0:h1]``, or
    ``buf[lo:hi]`` (the same view, one slice cheaper) when the heads are all of the buffer's."""
    if h0 == 0 and h1 == buf.shape[3]:
        return buf[lo:hi]
    return buf[lo:hi, :, :, h0:h1]


def _last_per_stream(events) -> tuple:
    """Events to wait on before reusing a buffer: all of them (an event is cheap to wait on once done)."""
    seen, out = set(), []
    for ev in reversed(events):
        if id(ev) not in seen:
            seen.add(id(ev))
            out.append(ev)
    return tuple(out)
