"""``offexec profile``: microbenchmarks that fill the hardware-profile JSON offsim loads (schema
``offsim.hardware/1``, ``offsim.core.specs.HardwareSpec``).

Measured: pinned and pageable H2D and D2H by transfer size; both directions at once (duplex fraction); HBM copy
bandwidth; GEMM efficiency by token count for the model's own FFN shape; causal prefill attention by context and
decode attention by batch x context (SDPA, the executor's kernel); CPU attention throughput (the executor's CPU
path); disk write and read through the executor's own disk tier, with O_DIRECT (cold) and page-cached. Every
figure is the median of repeated timed runs after warm-up, timed with CUDA events on the GPU. GPU peak FLOP/s
comes from a datasheet table by device name (efficiencies are relative to it, so only the product matters), or
``--peak-tflops``.

    offexec profile --model opt-30b --out results/profiles/h200.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from offsim.core.costmodel import OP_TABLE_PROBE_GEN, OP_TABLE_PROBE_PROMPT

GiB = 1 << 30
DATASHEET_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                        "RTX 3090": 71e12, "RTX 4090": 165e12, "T4": 65e12}
DATASHEET_HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12, "A800": 2.04e12, "RTX 3090": 936e9, "T4": 320e9}


def _median_time(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, perf_counter on the CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile_link(device, sizes: list[int], reps: int) -> dict:
    """Bytes/s of one copy by size: pinned and pageable, H2D and D2H; duplex fraction at the largest size."""
    import torch

    out = {"h2d_pinned": [], "d2h_pinned": [], "h2d_pageable": [], "d2h_pageable": []}
    big = max(sizes)
    gpu = torch.empty(big, dtype=torch.uint8, device=device)
    pinned = torch.empty(big, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pageable = torch.empty(big, dtype=torch.uint8)
    pageable.fill_(1)  # touch the pages
    for n in sizes:
        for host, kind in ((pinned, "pinned"), (pageable, "pageable")):
            t = _median_time(lambda: gpu[:n].copy_(host[:n], non_blocking=True), device, reps)
            out[f"h2d_{kind}"].append([float(n), n / t])
            t = _median_time(lambda: host[:n].copy_(gpu[:n], non_blocking=True), device, reps)
            out[f"d2h_{kind}"].append([float(n), n / t])
    duplex = 1.0
    if device.type == "cuda":
        n = big // 2
        gpu2 = torch.empty(n, dtype=torch.uint8, device=device)
        host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            with torch.cuda.stream(s1):
                gpu[:n].copy_(pinned[:n], non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(gpu2, non_blocking=True)
            torch.cuda.synchronize()

        both()
        t0 = time.perf_counter()
        for _ in range(reps):
            both()
        t_both = (time.perf_counter() - t0) / reps
        alone = min(out["h2d_pinned"][-1][1], out["d2h_pinned"][-1][1])
        duplex = min(1.0, (n / t_both) / alone)
    return {**out, "duplex_fraction": duplex}


RELAY_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30)  # --relay-only: 1 MiB to 1 GiB

# the link sweep: a pool of pinned host memory copied to the GPU chunk by chunk, every chunk once a pass, as a
# run streams its weights (profile_link times one buffer again and again). On one H100 host (2026-12-06,
# results/offexec/h100prof_fd0e0c5/) runs' decode copies moved 49.5 GB/s with the stream busy throughout while that
# probe read 55.0: the sweep records what a pass over a large pool sees, beside it
LINK_SWEEP_POOL_BYTES = 16 << 30
LINK_SWEEP_CHUNK_BYTES = 256 << 20


def h2d_sweep(host, device, chunk_bytes: int = LINK_SWEEP_CHUNK_BYTES, passes: int = 2) -> dict:
    """Host-to-GPU bytes/s of whole passes over ``host`` (a flat uint8 tensor, pinned for a CUDA ``device``): each
    pass copies every ``chunk_bytes`` chunk once, in order, into one device buffer on one stream, timed as a whole
    (CUDA events; wall clock on the CPU). Returns the pool and chunk sizes, each pass's rate and the last pass's
    (``h2d_sweep_bytes_per_s``: the first may include the pages' first mapping), and the rate of the first chunk
    copied again and again as many times (``h2d_repeat_bytes_per_s``: what a one-buffer probe sees)."""
    import torch

    dev = torch.device(device)
    chunk = int(min(chunk_bytes, host.numel()))
    n = host.numel() // chunk
    if n < 1 or passes < 1:
        raise ValueError(f"the sweep needs a pool of at least one chunk and one pass, got {host.numel()} bytes, "
                         f"{passes} passes")
    cuda = dev.type == "cuda"

    def timed(srcs, buf) -> float:
        if cuda:
            torch.cuda.synchronize(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for src in srcs:
                buf.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        for src in srcs:
            buf.copy_(src)
        return time.perf_counter() - t0

    chunks = [host[i * chunk:(i + 1) * chunk] for i in range(n)]
    buf = torch.empty(chunk, dtype=torch.uint8, device=dev)
    rates = [n * chunk / timed(chunks, buf) for _ in range(passes)]
    repeat = n * chunk / timed([chunks[0]] * n, buf)
    return {"pool_bytes": int(n * chunk), "chunk_bytes": chunk, "pass_bytes_per_s": [float(r) for r in rates],
            "h2d_sweep_bytes_per_s": float(rates[-1]), "h2d_repeat_bytes_per_s": float(repeat)}


def profile_link_sweep(device, pool_bytes: int = LINK_SWEEP_POOL_BYTES) -> dict:
    """``h2d_sweep`` over a fresh pinned pool of ``pool_bytes`` (at most half of the host's memory), touched
    before timing; {} off CUDA (no link to sweep)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    pool = min(int(pool_bytes), host_memory_bytes() // 2)
    host = torch.empty(pool, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    try:
        return h2d_sweep(host, dev)
    finally:
        del host


def profile_relay(device, sizes, reps: int) -> dict:
    """Bytes/s of one copy by size between unpinned host memory and the GPU, staged through a pinned copy as
    FlexGen's ``general_copy`` does (``flexgen==0.1.8``, ``pytorch_backend.py``): H2D ``src.pin_memory()`` then
    ``dst.copy_(pinned, non_blocking=True)``; D2H (its copy threads) into a pinned buffer, then a copy out of it to
    the unpinned destination. Wall time with the GPU synchronised, each copy as its caller waits for it. {} without
    CUDA (nothing to stage). ``HardwareSpec.h2d_relay`` / ``d2h_relay``: what ``Plan.pageable_copy`` 'relay' is
    priced at."""
    import torch

    if device.type != "cuda":
        return {}
    big = max(sizes)
    gpu = torch.empty(big, dtype=torch.uint8, device=device)
    host = torch.empty(big, dtype=torch.uint8)
    host.fill_(1)  # touch the pages
    buf = torch.empty(big, dtype=torch.uint8, pin_memory=True)  # the copy threads' pinned buffer
    out = {"h2d_relay": [], "d2h_relay": []}
    cpu = torch.device("cpu")
    # one unmeasured copy of each size first: a fresh process's first relays wait on the pinned host allocator's
    # first blocks (the H200's first run timed 0.17 GB/s at 1 MiB, the next one 11 GB/s)
    for n in sorted(sizes):
        gpu[:n].copy_(host[:n].pin_memory(), non_blocking=True)
    torch.cuda.synchronize(device)
    for n in sizes:
        def h2d():
            gpu[:n].copy_(host[:n].pin_memory(), non_blocking=True)
            torch.cuda.synchronize(device)

        def d2h():
            buf[:n].copy_(gpu[:n])
            host[:n].copy_(buf[:n])

        out["h2d_relay"].append([float(n), n / _median_time(h2d, cpu, reps)])
        out["d2h_relay"].append([float(n), n / _median_time(d2h, cpu, reps)])
    return out


def profile_gpu(device, spec, reps: int, peak_flops: float) -> dict:
    """GEMM efficiency by tokens for [t x d_model] @ [d_model x ffn]; prefill and decode attention; HBM; overhead."""
    import torch
    import torch.nn.functional as F

    dt = torch.float16 if device.type == "cuda" else torch.float32
    h, f = spec.d_model, spec.ffn_dim
    w = torch.randn(f, h, dtype=dt, device=device) * 0.02
    quick = device.type != "cuda"  # on the CPU (tests) keep the sweeps short
    gemm = []
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) + (() if quick else (2048, 4096, 8192, 16384)):
        x = torch.randn(t, h, dtype=dt, device=device)
        s = _median_time(lambda: F.linear(x, w), device, reps)
        gemm.append([float(t), 2 * t * h * f / s / peak_flops])
        del x
    del w
    H, D, Hk = spec.num_heads, spec.head_dim, spec.num_kv_heads
    prefill = []
    for ctx in (128, 512) + (() if quick else (2048, 8192)):
        b = max(1, 8192 // ctx)
        q = torch.randn(b, H, ctx, D, dtype=dt, device=device)
        k = torch.randn(b, Hk, ctx, D, dtype=dt, device=device)
        v = torch.randn_like(k)
        s = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hk),
                         device, reps)
        flops = 4 * b * H * D * ctx * (ctx + 1) / 2
        prefill.append([float(ctx), flops / s / peak_flops])
        del q, k, v
    n = 1 << 30 if device.type == "cuda" else 1 << 26
    a = torch.empty(n, dtype=torch.uint8, device=device)
    c = torch.empty_like(a)
    hbm = 2 * n / _median_time(lambda: c.copy_(a), device, reps)  # read + write
    del a, c
    decode = []
    for ctx in (256, 512, 1024) + (() if quick else (2048, 4096, 8192)):
        b = 32
        q = torch.randn(b, H, 1, D, dtype=dt, device=device)
        k = torch.randn(b, Hk, ctx, D, dtype=dt, device=device)
        v = torch.randn_like(k)  # a distinct V: with V = K the kernel re-reads K's tiles from L2
        s = _median_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hk), device, reps)
        decode.append([float(ctx), 2 * k.numel() * k.element_size() / s / hbm])
        del q, k, v
    # per-op fixed cost: a decoder layer launches ~10 kernels; time ten tiny ones
    x = torch.randn(1, 64, dtype=dt, device=device)
    overhead = _median_time(lambda: [x.add_(0) for _ in range(10)], device, reps)
    return {"gemm_efficiency": gemm, "attn_prefill_efficiency": prefill, "attn_decode_efficiency": decode,
            "gpu_hbm_bytes_per_s": hbm, "kernel_overhead_s": overhead}


def profile_cpu_attention(spec, reps: int) -> float:
    """FLOP/s of decode attention on the host through the executor's own CPU path (``offexec.model.attention``
    over views of a host KV buffer laid out [ctx, 2, batch, heads, head_dim], as ``Executor._op_attn_cpu`` reads
    it), fp16 as the executor keeps it. The rate is the slope between two context lengths, so the fixed cost of a
    call (priced apart, from the op tables of ``profile_ops``) does not inflate it."""
    import torch

    H, D = spec.num_heads, spec.head_dim
    b = 16
    cpu = torch.device("cpu")
    times = {ctx: _median_time(cpu_attention_call(spec, b, ctx), cpu, max(3, reps // 2), warmup=1)
             for ctx in (256, 1024)}
    flops = 4 * b * H * D * (1024 - 256)
    return flops / max(times[1024] - times[256], 1e-9)


def cpu_attention_call(spec, b: int, ctx: int):
    """A decode CPU-attention op (one new token for ``b`` sequences at context ``ctx``, every head of ``spec``) as
    ``Executor._op_attn_cpu`` runs it: ``offexec.model.attention`` over views of a host KV buffer laid out
    [ctx, 2, b, heads, head_dim], fp16. Returns the call (timed by ``profile_cpu_attention`` and
    ``offexec.hostprobe``)."""
    import torch

    from offexec import model as M

    H, D, Hk = spec.num_heads, spec.head_dim, spec.num_kv_heads
    buf = torch.randn(ctx, 2, b, Hk, D, dtype=torch.float16)
    q = torch.randn(b, 1, H, D, dtype=torch.float16)
    out = torch.empty(b, 1, H * D, dtype=torch.float16)
    groups = [(0, Hk, buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3))]
    return lambda: M.attention(spec, q, groups, out=out)


# the sub-layer and CPU-attention forms of a decoder layer, each a flexgen plan setting: together they emit every
# compute part a plan can hold (costmodel.COMPUTE_PARTS) and the CPU attention op
_OP_FORMS = ({"sublayer": False, "cpu_attention": False}, {"sublayer": True, "cpu_attention": False},
             {"sublayer": False, "cpu_attention": True}, {"sublayer": True, "cpu_attention": True})


# measured runs of each configuration that takes the one-shot host timings ('capture' and 'issue' rows: one graph
# capture per graph and run): their rows are medians over this many runs
CAPTURE_RUNS = 5

# an extra probe form: weights on the GPU, the KV cache and the activations in host memory (offloaded runs' copies)
_ISSUE_FORM = {"sublayer": True, "cpu_attention": False}
# and one with half of each layer's weights in host memory: its streamed weight copies give the 'h2d_weight' issue
# row (without it a weight copy's issue was the profile's one constant for every copy, ``issue_copy_s``: 140 us
# where runs of small models measured 50-110 us, results/offexec/host_bound_d753770). Only that row is taken from it.
_ISSUE_WEIGHT_FORM = {"sublayer": True, "cpu_attention": False}
_ISSUE_FORMS = (_ISSUE_FORM, _ISSUE_WEIGHT_FORM)


def _copy_handlers(plan) -> dict:
    """{offexec handler: (copies, median bytes)} of a plan's GPU-stream copies (handler = KIND_TENSOR, as
    offexec/program.py names them)."""
    sizes: dict[str, list] = {}
    for op in plan.ops:
        if op.kind in ("h2d", "d2h"):
            sizes.setdefault(f"{op.kind}_{op.tensor}", []).append(op.nbytes)
    return {fn: (len(v), int(statistics.median(v))) for fn, v in sizes.items()}


def _issue_sample(samples: dict, res, op, take: bool) -> None:
    """The issuing thread's time on a decode op that is never graphed (the head, the embedding: 'issue',
    'eager:PART' by sequences), past the first decode step. Without these rows each was priced at the profile's
    one eager constant (``issue_compute_s``, 646 us on the H200) where runs of small models measured 70-420 us."""
    if take and op.step >= 2 and res.issue_s_by_op is not None:
        samples.setdefault(("issue", f"eager:{op.part}", op.num_seqs), []).append(float(res.issue_s_by_op[op.id]))


def profile_ops(spec, device: str = "cuda", batches=(1, 4, 16, 64), prompts=(OP_TABLE_PROBE_PROMPT, 512),
                gen_len: int = OP_TABLE_PROBE_GEN,
                progress: bool = True, capture_only: bool = False, decode_only: bool = False) -> list:
    """Op tables: seconds of each compute op as offexec itself runs it, by size, for one model's layer shape.

    Small plans of the model cut to two layers (all weights and the KV cache on the GPU, or the KV on the host for
    CPU attention) run through ``run_plan`` at each batch size and prompt length, with CUDA graphs on and off; each
    op's time is taken from the run's own trace. That covers what the analytical terms miss -- GEMM efficiency at
    this model's shapes, the elementwise kernels, launches or a graph replay with its static copies -- with no
    constant fitted to any run that is later validated. Rows (``HardwareSpec.op_times``):

    - ('graph' | 'eager', part, [[num_seqs, s], ...]): decode ops (one new token), replayed as a CUDA graph or eager;
    - ('tokens', part, [[tokens, s], ...]): ops over many tokens (prefill, TightLLM's recompute), eager;
    - ('eager', 'head', ...) by sequences (the LM head reads the last position only);
    - ('issue', KIND_TENSOR, [[bytes, s], ...]): the host time offexec spends issuing one copy of a handler
      (``issue_s_by_handler`` over the plan's copies of it), by their median size; an extra form with the KV cache
      and the activations in host memory adds the copies of offloaded runs, another with half the weights there
      the weight copies ('h2d_weight');
    - ('issue', 'graph:PART' | 'eager:PART', [[num_seqs, s], ...]): the host time of one decode compute op, replayed
      or eager (``RunResult.issue_s_by_op``, median over the steps after the captures), the head and the
      embedding ('eager:head', 'eager:embed') included;
    - ('capture', part, [[num_seqs, s], ...]): a graphed decode op at the first decode step, where offexec runs its
      static body eagerly and captures it; ('capture', 'first', ...): the run's first such op (it also sets up the
      graphs' memory pool);
    - ('cpu', 'attn', ...): a CPU-attention op's time at the short prompt, by sequences (its fixed cost: storing the
      new KV, the call, the worker thread), and ('cpu', 'attn_flops', ...) its FLOP/s by sequences, the slope from
      the short prompt to the long one;
    - ('copy', 'd2h_qkv' | 'h2d_attn_out', [[bytes, s], ...]): CPU attention's small copies as the executor makes
      them (the Q/K/V packing kernel, the copy, the output's allocation), by bytes.

    Times include attention over the probe's short contexts (at most prompt + gen tokens); the cost model adds
    attention at the op's real context on top, and takes a graphed op's own back out where the profile has the
    ('attn', 'decode_graph:B') rows that price it (``costmodel.graph_row_attention_seconds``: ~0.05 ms of a
    64-sequence op's ~0.35 ms row; the probe's buffer is ``costmodel.OP_TABLE_PROBE_KV_LEN``, from these defaults).

    ``capture_only``: the 'capture' and 'issue' rows alone; ``decode_only``: every row of the decode ops ('graph',
    'eager', 'capture', 'issue'), the runs at the short prompt alone -- to time them at more sequence counts
    (``batches``) than the full probe, without the prefill rows' long prompt."""
    import dataclasses

    import torch

    from offexec.executor import run_plan
    from offexec.weights import random_weights
    from offsim.core.costmodel import COPY_TABLE_TENSORS, GRAPHED_PARTS, attention_flops
    from offsim.core.specs import Workload, layer_key, load_hardware_preset
    from offsim.policies.registry import build_plan

    small = dataclasses.replace(spec, num_layers=2)
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32
    cuda = device == "cuda"
    weights = random_weights(small, 0, dt, device=device, pinned=cuda, progress=False)
    # a roomy profile for building the probe plans (their placement is fixed; only the plan's shape matters)
    hw = load_hardware_preset("h200")
    samples: dict[tuple, list] = {}
    cpu: dict[tuple, list] = {}  # (prompt, sequences) -> [(seconds, FLOPs)] of CPU-attention ops
    runs = [(p, b, form, g) for p in prompts for b in batches for form in _OP_FORMS
            for g in (("cuda", "off") if cuda and p == prompts[0] else ("cuda",) if cuda else ("off",))]
    if capture_only:  # the 'capture' and 'issue' rows alone (the profile's 'graph' rows stay as measured)
        runs = [r for r in runs if r[0] == prompts[0] and r[3] == "cuda"]
    elif decode_only:  # the decode ops' rows come from the short prompt's runs (graphs on and off)
        runs = [r for r in runs if r[0] == prompts[0]]
    if cuda:  # the KV cache and the activations in host memory: the copies of offloaded runs, for 'issue' rows
        runs += [(prompts[0], b, form, "cuda") for form in _ISSUE_FORMS for b in batches]
    try:
        from tqdm import tqdm

        it = tqdm(runs, desc=f"op tables {spec.name}", unit="run", file=sys.stderr, disable=not progress)
    except ImportError:  # pragma: no cover
        it = runs
    try:
        for p, b, form, g in it:
            issue_only = any(form is f for f in _ISSUE_FORMS)
            kv = [0, 100] if form["cpu_attention"] or issue_only else [100, 0]  # the KV cache on the host
            act = [0, 100] if issue_only else [100, 0]
            w = [50, 50] if form is _ISSUE_WEIGHT_FORM else [100, 0]
            settings = {"percent": w + kv + act, "overlap": True, "pin_weights": True, **form}
            # CPU attention reads a host cache far larger than the CPU's caches in a real run: so many GPU batches
            # that even one sequence's cache (16 x 2 layers) spills past the last-level cache
            nb = max(1, 16 // b) if form["cpu_attention"] else 1
            wl = Workload(p, gen_len, b, nb)
            plan = build_plan("flexgen", small, hw, wl, settings)
            # each configuration once unmeasured: kernel loading, cuBLAS heuristics and handles, the allocator's
            # first growth (an eager decode op of a fresh configuration measured ~18 ms for a few steps, not
            # ~0.5 ms). The allocator is capped at the budget, not the plan: the probe times ops, not the memory
            # contract (which the runs it prices prove)
            run_plan(plan, weights, device, graphs=g, allocator_cap="budget")
            # the graph-capture and issue rows are one-shot host timings (a capture per graph and run): one run
            # gives too few to be stable (two measurements 11 h apart differed 0.5-3.6x per point), so the
            # configurations that take them run CAPTURE_RUNS times and their rows are medians over all runs
            reps = CAPTURE_RUNS if g == "cuda" and p == prompts[0] else 1
            for _ in range(reps):
                res = run_plan(plan, weights, device, graphs=g, allocator_cap="budget")
                if g == "cuda" and p == prompts[0]:
                    # the issuing loop's own time per op between handlers (Executor.dispatch_s): the 'dispatch' row
                    if form is not _ISSUE_WEIGHT_FORM:
                        samples.setdefault(("issue", "dispatch", b), []).append(res.stats["dispatch_s_per_op"])
                    # a copy handler's host issue time per op (offexec times each handler: issue_s_by_handler), by the
                    # median size of its copies
                    for fn, (count, nbytes) in _copy_handlers(plan).items():
                        if (fn == "h2d_weight") != (form is _ISSUE_WEIGHT_FORM):
                            continue  # each form gives its own rows (the weight form: the weight copies alone)
                        spent = res.stats["issue_s_by_handler"].get(fn)
                        if spent is not None and count:
                            samples.setdefault(("issue", fn, nbytes), []).append(spent / count)
                if issue_only:
                    del res
                    continue
                df = res.trace.df
                first = True  # the run's first graphed op: its capture also sets up the graphs' pool
                for r in df.sort_values("op_id").itertuples():
                    op = plan.ops[r.op_id]
                    dur = r.end_s - r.start_s
                    if op.kind in ("h2d", "d2h") and op.tensor in COPY_TABLE_TENSORS:
                        if op.step >= 2 and p == prompts[0]:
                            samples.setdefault(("copy", f"{op.kind}_{op.tensor}", op.nbytes), []).append(dur)
                        continue
                    if op.kind not in ("compute", "cpu_compute"):
                        continue
                    if op.kind == "cpu_compute":
                        if op.q_tokens == 1 and op.step >= 2:  # (x, FLOPs) beside the time: the rate is a slope
                            cpu.setdefault((p, op.num_seqs), []).append(
                                (dur, attention_flops(spec, op.num_seqs, 1, op.ctx_tokens)))
                    elif op.part == "head":
                        samples.setdefault(("eager", "head", op.num_seqs), []).append(dur)
                        _issue_sample(samples, res, op, p == prompts[0] and cuda)
                    elif op.q_tokens > 1 or op.part == "embed":
                        samples.setdefault(("tokens", op.part, op.num_seqs * op.q_tokens), []).append(dur)
                        _issue_sample(samples, res, op, p == prompts[0] and cuda and op.q_tokens == 1)
                    elif op.step >= 2 and p == prompts[0]:  # step 1 captures the graphs
                        mode = "graph" if g == "cuda" and op.part in GRAPHED_PARTS else "eager"
                        samples.setdefault((mode, op.part, op.num_seqs), []).append(dur)
                        if cuda and res.issue_s_by_op is not None and form is not _ISSUE_FORM:
                            # the issuing thread's own time on this op (a replay, or an eager op's launches)
                            samples.setdefault(("issue", f"{mode}:{op.part}", op.num_seqs), []).append(
                                float(res.issue_s_by_op[op.id]))
                    elif op.step == 1 and p == prompts[0] and g == "cuda" and op.part in GRAPHED_PARTS:
                        # every graph key is new at the first decode step: the static body eagerly, then the capture
                        samples.setdefault(("capture", "first" if first else op.part, op.num_seqs), []).append(dur)
                        first = False
                del res
    finally:
        weights.close()
    key = layer_key(spec)
    curves: dict[tuple, list] = {}
    for (mode, part, x), ts in sorted(samples.items()):
        # decode ops: the median of many; prefill ops (one per layer and run): the faster, past first-call effects
        t = statistics.median(ts) if mode in ("graph", "eager", "capture", "issue", "cpu", "copy") else min(ts)
        curves.setdefault((mode, part), []).append([float(x), float(t)])
    # CPU attention: the fixed cost at the short prompt, the FLOP rate from the slope up to the long one
    lo, hi = prompts[0], prompts[-1]
    for b in sorted({b for _, b in cpu}):
        if (lo, b) not in cpu:
            continue
        t_s, f_s = (statistics.median(v) for v in zip(*cpu[lo, b]))
        fixed = t_s
        if hi != lo and (hi, b) in cpu:
            t_l, f_l = (statistics.median(v) for v in zip(*cpu[hi, b]))
            if t_l > t_s and f_l > f_s:
                rate = (f_l - f_s) / (t_l - t_s)
                curves.setdefault(("cpu", "attn_flops"), []).append([float(b), float(rate)])
                fixed = max(t_s - f_s / rate, 0.1 * t_s)  # the short prompt's FLOPs are priced by the rate
        curves.setdefault(("cpu", "attn"), []).append([float(b), float(fixed)])
    keep = ("capture", "issue") if capture_only else ("graph", "eager", "capture", "issue") if decode_only else None
    return [[key, mode, part, pts] for (mode, part), pts in sorted(curves.items()) if keep is None or mode in keep]


CPU_ATTN_CONTEXTS = (16, 128, 512, 2048)  # the probe's prompt lengths: short (fixed cost) to long (past the LLC)


def fit_contexts(contexts, limit: int) -> list[int]:
    """The probe's contexts, each at most ``limit`` (the longest that fits the model's positions with the tokens the
    probe generates): a context past it is measured at ``limit`` instead of dropped, so a model of 2048 positions
    (OPT) still gets a row point near its longest prompts, where the rate falls (the host's caches no longer hold
    the KV) and reading on from 512 would extrapolate."""
    return sorted({min(int(c), limit) for c in contexts if min(int(c), limit) >= 1})


class H2DLoad:
    """A host-to-GPU link kept busy while a probe runs (``--under-h2d-load``): a thread of its own copies a pinned
    ``nbytes`` host buffer to the GPU on a stream of its own, back to back, as a run's weight stream does -- the
    DMA engine reading host memory at the link's rate beside the CPU's own work. ``bytes_per_s``: the rate it held
    (0 on the CPU, where it does nothing). ``direction`` 'd2h': the same load GPU-to-host. Whether a CPU-attention
    op slows while the weights stream is what results/validation/calib_misses.md asks of its largest miss (CPU
    attention 46 % slower in a run than in its profile row, measured with no weight stream) and what flexgen-ref's
    fp16 decode misses by."""

    def __init__(self, device: str, nbytes: int = 1 << 29, direction: str = "h2d"):
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"link load direction must be 'h2d' or 'd2h', got {direction!r}")
        self.cuda = str(device).startswith("cuda")
        self.nbytes, self.bytes_per_s, self.direction = nbytes, 0.0, direction

    def __enter__(self):
        if not self.cuda:
            return self
        import threading

        import torch

        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.gpu = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
        self.stop, self.moved = threading.Event(), 0
        stream = torch.cuda.Stream()

        # waited for with a blocking-sync event: the thread sleeps while its copy runs. (``stream.synchronize()``
        # spins a core: a first probe, at 34657a2, slowed CPU attention by up to 40 ms a call in FlexGen's path --
        # its 16 OpenMP threads waiting on the one that shared a core with the spinning thread -- which a run's weight
        # stream, issued from the executor's own thread, never does.)
        done = torch.cuda.Event(blocking=True)

        dst, src = (self.gpu, self.host) if self.direction == "h2d" else (self.host, self.gpu)  # ('d2h': the other way)

        def loop():
            with torch.cuda.stream(stream):
                while not self.stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    done.record(stream)
                    done.synchronize()
                    self.moved += self.nbytes

        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return self

    rates: list = []  # every load's bytes/s, in order (add_op_tables records them)

    def __exit__(self, *exc):
        if self.cuda:
            self.stop.set()
            self.thread.join()
            self.bytes_per_s = self.moved / max(time.perf_counter() - self.t0, 1e-9)
            H2DLoad.rates.append(self.bytes_per_s)
            del self.host, self.gpu
        return False


H2D_LOADED = "_h2d"  # the suffix of a row part measured under H2DLoad: 'attn_ctx_h2d:B', 'attn_ctx_flexgen_h2d:B'


def profile_cpu_attention_ctx(spec, device: str = "cuda", batches=(1, 4, 16, 64), contexts=CPU_ATTN_CONTEXTS,
                              gen_len: int = 12, progress: bool = True, under_h2d_load: bool = False) -> list:
    """Op-table rows ('cpu', 'attn_ctx:B', [[context, s], ...]): a decode CPU-attention op (one new token per
    sequence, B sequences, every head of the model, through offexec's own CPU path) by its context, for each
    B in ``batches``. The time is measured, not split into a fixed cost and a FLOP rate: at long contexts the
    host's caches no longer hold a GPU batch's KV and its rate falls (the matrix v2 cases at 2048 ran ~1.3 x
    slower than the rate measured up to 512 predicted), and the fixed part depends on the heads. Two-layer
    flexgen plans of the model, the KV cache in host memory, as many GPU batches as keep even one sequence's cache
    past the last-level cache (``profile_ops``' rule); each plan after an unmeasured 2-token run of it; the median
    over the decode steps after the first (``gen_len`` - 2 of them: with 64 sequences one GPU batch gives two ops a
    step, and the 2 steps of gen 4 left a row point from 4 ops, too few on a host whose CPU attention varies by
    10 % run to run: results/validation/calib_misses.md). ``costmodel.cpu_attention_seconds`` interpolates in B and
    the context where a profile has these rows. ``under_h2d_load``: the measured runs with the link kept busy
    (``H2DLoad``), rows 'attn_ctx_h2d:B' (not read by the cost model: on five models they differ from the unloaded
    rows by no more than the host drifts between calls, results/profiles/cpu_attention_load/README.md)."""
    import dataclasses

    import torch

    from offexec.executor import run_plan
    from offexec.weights import random_weights
    from offsim.core.specs import Workload, layer_key, load_hardware_preset
    from offsim.policies.registry import build_plan

    small = dataclasses.replace(spec, num_layers=2)
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32
    cuda = device == "cuda"
    weights = random_weights(small, 0, dt, device=device, pinned=cuda, progress=False)
    hw = load_hardware_preset("h200")
    runs = [(c, b) for b in batches for c in fit_contexts(contexts, spec.max_positions - gen_len)]
    try:
        from tqdm import tqdm

        it = tqdm(runs, desc=f"CPU attention {spec.name}", unit="run", file=sys.stderr, disable=not progress)
    except ImportError:  # pragma: no cover
        it = runs
    curves: dict[int, list] = {}
    try:
        for c, b in it:
            settings = {"percent": [100, 0, 0, 100, 100, 0], "overlap": True, "pin_weights": True,
                        "sublayer": True, "cpu_attention": True}
            wl = Workload(c, gen_len, b, max(1, 16 // b))
            plan = build_plan("flexgen", small, hw, wl, settings)
            warm = build_plan("flexgen", small, hw, wl.with_(gen_len=2), settings)
            run_plan(warm, weights, device, graphs="cuda" if cuda else "off", allocator_cap="budget")
            with H2DLoad(device if under_h2d_load else "cpu"):
                res = run_plan(plan, weights, device, graphs="cuda" if cuda else "off", allocator_cap="budget")
            df = res.trace.df
            xs, ts = [], []
            for r in df.itertuples():
                op = plan.ops[r.op_id]
                if op.kind == "cpu_compute" and op.q_tokens == 1 and op.step >= 2:
                    xs.append(op.ctx_tokens)
                    ts.append(r.end_s - r.start_s)
            if ts:
                curves.setdefault(b, []).append([float(statistics.median(xs)), float(statistics.median(ts))])
            del res
    finally:
        weights.close()
    key = layer_key(spec)
    part = "attn_ctx" + (H2D_LOADED if under_h2d_load else "")
    return [[key, "cpu", f"{part}:{b}", sorted(pts)] for b, pts in sorted(curves.items())]


def profile_cpu_attention_flexgen(spec, batches=(1, 4, 16, 64), contexts=CPU_ATTN_CONTEXTS, reps: int = 5) -> list:
    """Op-table rows ('cpu', 'attn_ctx_flexgen:B', [[context, s], ...]): a decode CPU-attention op as FlexGen's own
    code runs it (``flexgen==0.1.8``, ``pytorch_backend.py`` ``mha_gen`` with the cache on the CPU), timed on this
    host's CPU by context for each batch size B -- what the ``flexgen-ref`` policy prices its CPU ops with
    (``Plan.cpu_attention_impl``). FlexGen keeps the cache as [s, B·heads, D] fp16; per op it writes the new token's
    K and V into it, copies the first ``context`` positions out through ``permute(...).reshape(...)`` (K to
    [B·heads, D, s], V to [B·heads, s, D]), converts Q, K and V to fp32, and runs Q·K, the mask, softmax and the
    product with V in fp32, the result cast back to fp16. This reproduces that sequence of tensor operations at the
    model's shapes (every head; Llama's grouped K/V expanded as FlexGen's Llama port does); the median of ``reps``
    after two unmeasured runs. No GPU is involved (the op's Q comes from the GPU and its result goes back, priced
    apart as offexec's copies)."""
    import torch

    H, D = spec.num_heads, spec.head_dim
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32

    def make_op(b: int, s_len: int):
        k_cache = torch.randn(s_len, b * H, D).to(dt)
        v_cache = torch.randn(s_len, b * H, D).to(dt)
        q = torch.randn(b * H, 1, D).to(dt)
        k_new = torch.randn(1, b * H, D).to(dt)
        v_new = torch.randn(1, b * H, D).to(dt)
        mask = torch.ones(b, 1, 1, s_len, dtype=torch.bool)

        def op():
            k, v = k_cache[:s_len], v_cache[:s_len]
            k[s_len - 1:s_len] = k_new
            v[s_len - 1:s_len] = v_new
            k = k.permute(1, 2, 0).reshape(b * H, D, s_len).float()
            v = v.permute(1, 0, 2).reshape(b * H, s_len, D).float()
            w = torch.bmm(q.float(), k).view(b, H, 1, s_len)
            w = torch.where(mask, w, -1e4).view(b * H, 1, s_len).softmax(dim=2)
            return torch.bmm(w, v).view(b, H, 1, D).to(dt)
        return op

    return _flexgen_attention_rows(spec, batches, contexts, reps, make_op)


def _flexgen_attention_rows(spec, batches, contexts, reps: int, make_op) -> list:
    """Rows ('cpu', 'attn_ctx_flexgen:B', [[context, s], ...]): for each batch B and context c within the model's
    positions, the median of ``reps`` wall-clock timings of ``make_op(B, c + 1)()`` (c + 1: the new token's position
    included, as FlexGen's src_s)."""
    import torch

    from offsim.core.specs import layer_key

    rows = []
    for b in batches:
        pts = [[float(c), _median_time(make_op(b, c + 1), torch.device("cpu"), reps)]
               for c in fit_contexts(contexts, spec.max_positions - 1)]
        if pts:
            rows.append([layer_key(spec), "cpu", f"attn_ctx_flexgen:{b}", sorted(pts)])
    return rows


def _flexgen_devices():
    """FlexGen 0.1.8's (TorchDevice('cuda:0'), TorchDevice('cpu'), its module ``pytorch_backend``), or None where
    ``flexgen`` is not importable or there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from flexgen import pytorch_backend as fb
    except ImportError:
        return None
    fb.fix_recursive_import()  # binds TorchDevice's compressed-device class, as importing flex_opt does
    return fb.TorchDevice("cuda:0"), fb.TorchDevice("cpu"), fb


def profile_cpu_attention_flexgen_own(spec, device: str = "cuda", batches=(1, 4, 16, 64),
                                      contexts=CPU_ATTN_CONTEXTS, reps: int = 5) -> list:
    """Rows ('cpu', 'attn_ctx_flexgen:B', [[context, s], ...]) timed by calling FlexGen's own code as its OPT runs
    with ``--cpu-cache-compute`` call it per (layer, GPU batch) of a decode step, both on its main thread:
    ``SelfAttention.load_cache``'s path 1 -- ``general_copy`` of the cache's first ``context`` positions from its
    fp16 home (unpinned CPU memory, [s, B·heads, D]) into the fp32 attention workspace -- then
    ``TorchDevice.mha_gen`` on the GPU device over that workspace (so its ``.float()`` casts are no-ops). The call
    also holds the op's GPU part (layer norm, the Q/K/V and output projections: under 1 % of it at these shapes) and
    the copies of Q, the new K/V row and the result; wall time with the GPU synchronised, the median of ``reps``
    after two unmeasured calls. [] when ``flexgen`` is not importable, there is no CUDA device, or the model is not
    an OPT (FlexGen 0.1.8 runs OPT only): the reproduced sequence (``profile_cpu_attention_flexgen``) stands in."""
    import torch

    fg = _flexgen_devices() if spec.family == "opt" and str(device).startswith("cuda") else None
    if fg is None:
        return []
    gpu, cpu, fb = fg
    E, H, D = spec.d_model, spec.num_heads, spec.head_dim
    half, dev = torch.float16, torch.device("cuda:0")

    def on_gpu(*shape):
        return fb.TorchTensor.create_from_torch(torch.randn(*shape, dtype=half, device=dev) * 0.02, gpu)

    w = [on_gpu(E, E), on_gpu(E), on_gpu(E, E), on_gpu(E), on_gpu(E, E), on_gpu(E), on_gpu(E, E), on_gpu(E),
         on_gpu(E), on_gpu(E)]  # w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out, w_ln, b_ln: mha_gen's order

    def make_op(b: int, s_len: int):
        def cpu_tensor(t):
            return fb.TorchTensor.create_from_torch(t, cpu)
        k_home = cpu_tensor(torch.randn(s_len, b * H, D).to(half))  # FlexGen's cache home: unpinned fp16
        v_home = cpu_tensor(torch.randn(s_len, b * H, D).to(half))
        k_buf = cpu_tensor(torch.empty(s_len, b * H, D))  # the fp32 workspace (init_attention_compute_workspace)
        v_buf = cpu_tensor(torch.empty(s_len, b * H, D))
        mask = cpu_tensor(torch.ones(b, s_len, dtype=torch.bool))
        x = on_gpu(b, 1, E)
        idx = (slice(0, s_len - 1), slice(0, b * H))

        def op():
            fb.general_copy(k_buf, idx, k_home, idx)
            fb.general_copy(v_buf, idx, v_home, idx)
            gpu.mha_gen(x, mask, *w, H, k_buf, v_buf, [False, False], 1.0, False, None)
            torch.cuda.synchronize()
        return op

    return _flexgen_attention_rows(spec, batches, contexts, reps, make_op)


# (context, sequences) of the 'dequant_flexgen:cache' probe's caches: 128 to 131,072 cached positions in all
FLEXGEN_DEQUANT_CACHES = ((128, 1), (512, 4), (1024, 16), (2048, 64))


def profile_flexgen_dequant(spec, device: str = "cuda", caches=FLEXGEN_DEQUANT_CACHES, reps: int = 5) -> list:
    """Rows ('quant', 'dequant_flexgen:weight' / 'dequant_flexgen:cache', [[fp16 bytes, s], ...]): FlexGen 0.1.8's
    own 4-bit decompression (``TorchCompressedDevice.decompress``: unpack both nibbles by strided writes, divide by
    the scale, add the minimum; a fresh fp16 tensor each call) on the GPU, timed with CUDA events -- what its
    ``--compress-weight`` runs pay per (layer, GPU batch) for every weight matrix (group 64 along dimension 0, as
    ``flex_opt`` configures it) and its ``--compress-cache`` runs for the K and V cache they attend over (group 64
    along the head dimension), at the model's matrix shapes and caches [s, B·heads, D] of ``caches`` (s, B). ``flexgen-ref``'s compressed plans price their dequantize passes by these rows
    (``Plan.quant_impl`` 'flexgen', ``costmodel.quant_seconds``). [] without ``flexgen``, a CUDA device or an OPT."""
    import torch

    from offsim.core.specs import layer_key

    fg = _flexgen_devices() if spec.family == "opt" and str(device).startswith("cuda") else None
    if fg is None:
        return []
    gpu, _, fb = fg
    from flexgen.compression import CompressionConfig

    dev = torch.device("cuda:0")
    E, F, H, D = spec.d_model, spec.ffn_dim, spec.num_heads, spec.head_dim

    def curve(shapes, group_dim):
        cfg = CompressionConfig(num_bits=4, group_size=64, group_dim=group_dim, symmetric=False)
        pts = []
        for shape in shapes:
            t = gpu.compressed_device.compress(torch.randn(*shape, dtype=torch.float16, device=dev), cfg)
            n = 2
            for d in shape:
                n *= d
            pts.append([float(n), _median_time(lambda: gpu.compressed_device.decompress(t), dev, reps)])
        return sorted(pts)

    key = layer_key(spec)
    weights = curve([(E, E), (F, E)], 0)  # q/k/v/out; fc1 (fc2 is its transpose: the same bytes)
    cache = curve([(c, b * H, D) for c, b in caches], 2)
    torch.cuda.empty_cache()
    return [[key, "quant", "dequant_flexgen:weight", weights], [key, "quant", "dequant_flexgen:cache", cache]]


# (positions, sequences) of the 'store_flexgen:*' probe's stores: one (layer, GPU batch) of a prefill, K and V of
# [positions, sequences x heads, head_dim] each; OPT-30B's fp16 K alone is 1.8 MB at (128, 1) and 940 MB at (2048, 32)
FLEXGEN_STORE_CACHES = ((128, 1), (512, 4), (512, 16), (512, 48), (2048, 32))


def profile_flexgen_store(spec, device: str = "cuda", caches=FLEXGEN_STORE_CACHES, reps: int = 3) -> list:
    """Rows ('copy', 'store_flexgen:fp16' / 'store_flexgen:4bit', [[bytes stored, s], ...]): FlexGen 0.1.8's own
    prefill KV store, as ``SelfAttention.store_cache`` makes it for one (layer, GPU batch): ``general_copy`` of K
    and of V, [positions, sequences x heads, head_dim] on the GPU (fp16, or 4-bit as its ``--compress-cache``
    compresses them: group 64 along the head dimension), into a cache home that ``TorchDevice.allocate`` made
    unpinned (``init_cache_one_gpu_batch``) and nothing has written before -- a fresh home each call, as in a
    prefill, where every page is faulted in by the store. ``general_copy`` hands such a copy (GPU to unpinned host,
    more than one position) to the copy threads of FlexGen's ``TorchDisk`` (4, each with a float16 pinned relay
    buffer); the timed call returns when ``TorchDisk.synchronize`` and the GPU have finished, as its ``sync()``
    after every position does. x = the bytes stored (a 4-bit cache: its packed data and its scales); the median of
    ``reps`` after one unmeasured call per size. ``flexgen-ref`` prices its relayed KV stores by these rows
    (``costmodel.flexgen_store_curve``). [] without ``flexgen``, a CUDA device or an OPT."""
    import tempfile

    import numpy as np
    import torch

    from offsim.core.specs import layer_key

    fg = _flexgen_devices() if spec.family == "opt" and str(device).startswith("cuda") else None
    if fg is None:
        return []
    gpu, cpu, fb = fg
    from flexgen.compression import CompressionConfig

    dev = gpu.dev
    H, D = spec.num_heads, spec.head_dim
    cfg = CompressionConfig(num_bits=4, group_size=64, group_dim=2, symmetric=False)  # flex_opt's comp_cache_config
    with tempfile.TemporaryDirectory(prefix="offexec-flexgen-") as tmp:
        disk = fb.TorchDisk(tmp)  # starts FlexGen's copy threads: general_copy's D2H relays run on them
        try:
            rows = {"fp16": [], "4bit": []}
            # every cache home stays allocated until the end (~15 GB for OPT-30B's sizes): memory freed and
            # allocated again may come back touched, not fresh
            keep = []
            for s_len, b in caches:
                if s_len > spec.max_positions:
                    continue
                shape = (s_len, b * H, D)
                kv16 = [fb.TorchTensor.create_from_torch(torch.randn(*shape, dtype=torch.float16, device=dev), gpu)
                        for _ in range(2)]
                for kind in ("fp16", "4bit"):
                    src = kv16 if kind == "fp16" else [gpu.compressed_device.compress(t.data, cfg) for t in kv16]
                    idx = (slice(0, s_len), slice(0, b * H))

                    def home():
                        if kind == "fp16":
                            return cpu.allocate(shape, np.float16, pin_memory=False)
                        return cpu.compressed_device.allocate(shape, np.float16, cfg, pin_memory=False)

                    def stored_bytes(t) -> int:
                        parts = t.data[:2] if kind == "4bit" else (t,)
                        return sum(p.data.numel() * p.data.element_size() for p in parts)

                    times = []
                    for rep in range(reps + 1):
                        dst = [home(), home()]
                        keep.append(dst)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for d, x in zip(dst, src):
                            fb.general_copy(d, idx, x, None)
                        disk.synchronize()
                        torch.cuda.synchronize()
                        if rep:  # the first call of each size warms the copy threads and the relay buffers
                            times.append(time.perf_counter() - t0)
                    nbytes = sum(stored_bytes(d) for d in keep[-1])  # (the same every repetition)
                    rows[kind].append([float(nbytes), statistics.median(times)])
                del kv16
        finally:
            disk.close_copy_threads()
    torch.cuda.empty_cache()
    key = layer_key(spec)
    return [[key, "copy", f"store_flexgen:{kind}", sorted(pts)] for kind, pts in rows.items() if pts]


def _tightllm_probe_runs(spec, device: str, runs, desc: str, progress: bool):
    """For each (sequences, prompt, gen_len, N_r cap, percent) of ``runs``: (sequences, plan, measured result) of a
    two-layer TightLLM plan of the model, run through ``run_plan`` once unmeasured first (see ``profile_ops``). The
    plans are built on an H200 whose host-to-GPU link is a thousand times slower: recomputing always beats loading,
    so N_r = min(cap, context) (only the plan's shape matters here)."""
    import dataclasses

    import torch

    from offexec.executor import run_plan
    from offexec.weights import random_weights
    from offsim.core.specs import Workload, load_hardware_preset
    from offsim.policies.registry import build_plan

    small = dataclasses.replace(spec, num_layers=2)
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32
    weights = random_weights(small, 0, dt, device=device, pinned=device == "cuda", progress=False)
    h200 = load_hardware_preset("h200")
    hw = h200.with_(h2d_pinned=tuple((x, y * 1e-3) for x, y in h200.h2d_pinned))
    graphs = "cuda" if device == "cuda" else "static"
    try:
        from tqdm import tqdm

        it = tqdm(runs, desc=f"{desc} {spec.name}", unit="run", file=sys.stderr, disable=not progress)
    except ImportError:  # pragma: no cover
        it = runs
    try:
        for b, prompt, gen_len, cap, percent in it:
            settings = {"percent": percent, "max_recompute_tokens": cap, "kv_solver": "exact"}
            plan = build_plan("tightllm", small, hw, Workload(prompt, gen_len, b, 1), settings)
            run_plan(plan, weights, device, graphs=graphs, allocator_cap="budget")
            yield b, plan, run_plan(plan, weights, device, graphs=graphs, allocator_cap="budget")
    finally:
        weights.close()


def _median_rows(spec, samples: dict, mode: str, prefix: str = "") -> list:
    """Op-table rows [layer key, mode, prefix + part, [[x, median s], ...]] from {(part, x): [seconds, ...]}."""
    from offsim.core.specs import layer_key

    curves: dict[str, list] = {}
    for (part, x), ts in sorted(samples.items()):
        curves.setdefault(part, []).append([float(x), float(statistics.median(ts))])
    return [[layer_key(spec), mode, prefix + part, pts] for part, pts in sorted(curves.items())]


def profile_graph_recompute(spec, device: str = "cuda", batches=(1, 4, 16, 64), q_tokens=(2, 4, 8),
                            gen_len: int = 8, progress: bool = True) -> list:
    """Op-table rows ('graph_tokens', part, [[rows, s], ...]) of TightLLM's decode ops that recompute N_r tokens
    beside the new one (q = N_r + 1 query tokens, up to ``costmodel.GRAPH_MAX_Q_TOKENS``), replayed as CUDA graphs
    as offexec runs them, by rows (sequences x q). Two-layer TightLLM plans of the model, weights on the GPU and
    the KV cache in host memory (so that recomputing is worth it), N_r capped at q - 1 (the prompt leaves room for
    it, so every decode layer op has exactly q query tokens), each run once unmeasured; the median of each op
    size's decode ops after the step that captures its graphs."""
    from offsim.core.costmodel import GRAPH_MAX_Q_TOKENS, graphed

    prompt = 2 * max(q_tokens)  # room for N_r recomputed prompt tokens
    runs = [(b, prompt, gen_len, q - 1, [100, 0, 0, 100, 100, 0])
            for b in batches for q in q_tokens if 1 < q <= GRAPH_MAX_Q_TOKENS]
    samples: dict[tuple, list] = {}
    for _, plan, res in _tightllm_probe_runs(spec, device, runs, "recompute graphs", progress):
        for r in res.trace.df.itertuples():
            op = plan.ops[r.op_id]
            if op.step >= 2 and op.q_tokens > 1 and graphed(op.kind, op.part, op.q_tokens, op.phase,
                                                            plan.graph_q_tokens):
                samples.setdefault((op.part, op.num_seqs * op.q_tokens), []).append(r.end_s - r.start_s)
        del res  # before the next run
    return _median_rows(spec, samples, "graph_tokens")


def profile_graph_new_q(spec, device: str = "cuda", batches=(1, 4, 16, 64), prompt: int = 4,
                        progress: bool = True) -> list:
    """Rows ('capture', 'new_q:PART', [[rows, s], ...]): what a graphed decode op costs at the first layer of a step
    where TightLLM's recompute reaches a query count q the run has not captured before, beyond what the same step's
    op costs at the next layer (which captures too), by rows = sequences x q. And rows ('capture', 'recompute:PART',
    [[rows, s], ...]): that next layer's op itself -- a capture at a recompute's own shape (its static body run
    eagerly, then recorded), which ``costmodel.capture_extra_seconds`` sets against the replay at the same rows; the
    ('capture', PART) rows are one-token ops of at most 64 rows. (Measured on the H200 at 07babc2, these rows read
    1.0-1.9 ms a layer at 5-512 rows, close to the one-token rows: results/profiles/new_q_07babc2.)
    The first layer's extra was measured on the H200 inside a run
    (results/validation/calib_misses.md: 61-87 ms at the first layer against about 1.2 ms at the others) and
    priced by ``sim._capture_extras``. Two-layer TightLLM plans with a ``prompt``-token prompt, the KV cache and
    the activations in host memory, N_r capped at ``GRAPH_MAX_Q_TOKENS`` - 1: N_r = min(cap, context) grows by one
    each step, so q is new at each of the first steps. The run's first capture (which also sets up the graphs'
    pool: the 'capture', 'first' row) is left out; each plan runs once unmeasured first. Points where the first
    layer was not slower are left out."""
    from offsim.core.costmodel import GRAPH_MAX_Q_TOKENS, graphed

    cap = GRAPH_MAX_Q_TOKENS - 1
    gen_len = cap - prompt + 3  # q = prompt + 1 at step 1, then one more each step up to cap + 1, then steady
    runs = [(b, prompt, gen_len, cap, [100, 0, 0, 100, 0, 100]) for b in batches]
    samples: dict[tuple, list] = {}
    recapture: dict[tuple, list] = {}  # (part, rows) -> the second layer's op at a new q: a capture at that shape
    for _, plan, res in _tightllm_probe_runs(spec, device, runs, "new-q captures", progress):
        dur = dict(zip(res.trace.df["op_id"], res.trace.df["end_s"] - res.trace.df["start_s"]))
        by_step: dict[tuple, dict] = {}  # (step, part, q, sequences) -> {layer: seconds}
        for op in plan.ops:
            if op.kind == "compute" and op.phase == "decode" and op.q_tokens > 1 and \
                    graphed(op.kind, op.part, op.q_tokens, op.phase, plan.graph_q_tokens):
                by_step.setdefault((op.step, op.part, op.q_tokens, op.num_seqs), {})[op.layer] = dur[op.id]
        seen = set()
        first_step = min((k[0] for k in by_step), default=0)
        for (step, part, q, n), t in sorted(by_step.items()):
            if (part, q) in seen:
                continue
            seen.add((part, q))
            if 1 in t:  # layer 1 meets a new graph key (part, q, layer) too, at any step: never the run's first
                recapture.setdefault((part, n * q), []).append(t[1])
            if step > first_step and 0 in t and 1 in t and t[0] > t[1]:
                samples.setdefault((part, n * q), []).append(t[0] - t[1])
        del res  # before the next run
    return _median_rows(spec, samples, "capture", "new_q:") + _median_rows(spec, recapture, "capture", "recompute:")


def profile_attention(spec, device: str, peak_flops: float, reps: int = 10) -> list:
    """Op-table rows of causal GPU attention's FLOP efficiency by context for one model's heads (GQA included),
    through ``offexec.model.attention`` over the executor's KV layout (views of a [ctx, 2, batch, heads, head_dim]
    buffer): ('attn', 'prefill') with the queries the whole context (the causal kernel), ('attn', 'recompute') with
    the last 64 of them (TightLLM's recompute: an explicit bottom-right mask). ~16k query tokens a call. Each again
    under a left-padded batch's per-sequence key mask (``model.visible``; sequence i padded by 7i mod ctx/4
    positions), with the SDPA backends the executor picks for it (``model.growing_mask_kernels`` for a recompute,
    the default for a prefill): ('attn', 'prefill_masked') and ('attn', 'recompute_masked') -- a masked call runs
    another kernel (experiments/offexec/mask_sdpa.py)."""
    import torch

    from offexec import model as M
    from offsim.core.costmodel import ATTN_RECOMPUTE_QUERIES, attention_flops
    from offsim.core.specs import layer_key

    dev = torch.device(device)
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32
    H, Hk, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    ctxs = [c for c in (128, 512, 2048, 4096) if c <= spec.max_positions] if dev.type == "cuda" else [32, 64]
    rows = {"prefill": [], "recompute": [], "prefill_masked": [], "recompute_masked": []}
    for ctx in ctxs:
        for kind, T in (("prefill", ctx), ("recompute", min(ATTN_RECOMPUTE_QUERIES, ctx // 2))):
            b = max(1, (16384 if dev.type == "cuda" else 256) // ctx)
            buf = torch.randn(ctx, 2, b, Hk, D, dtype=dt, device=dev)
            q = torch.randn(b, T, H, D, dtype=dt, device=dev)
            groups = [(0, Hk, buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3))]
            t = _median_time(lambda: M.attention(spec, q, groups), dev, reps)
            rows[kind].append([float(ctx), float(attention_flops(spec, b, T, ctx) / t / peak_flops)])
            pad = (7 * torch.arange(b, device=dev)) % max(1, ctx // 4)
            mask = M.visible(torch.arange(ctx - T, ctx, device=dev), torch.arange(ctx, device=dev), pad)
            with M.growing_mask_kernels(kind == "recompute", dev):
                t = _median_time(lambda: M.attention(spec, q, groups, mask=mask), dev, reps)
            rows[kind + "_masked"].append([float(ctx), float(attention_flops(spec, b, T, ctx) / t / peak_flops)])
            del buf, q, groups, mask
    key = layer_key(spec)
    return [[key, "attn", kind, pts] for kind, pts in rows.items()]


DECODE_GRAPH_LENGTHS = (128, 512, 2048, 4096)  # KV buffer lengths of the graphed decode attention rows


def profile_decode_attention(spec, device: str, batches=(1, 4, 16, 64), reps: int = 20) -> list:
    """Op-table rows ('attn', 'decode_graph:B', [[buffer length, s], ...]): the attention of a graphed decode op
    (one new token for each of B sequences, every head) as offexec's CUDA graphs run it (offexec/graphs.py):
    ``offexec.model.attention`` over the whole KV buffer of the executor's layout (views of [length, 2, B, heads,
    head_dim]) under the graphs' bool key mask [1, 1, 1, length], replayed from a captured graph, so no launch is
    timed. A graphed op reads its whole buffer at every step whatever its context, and the masked kernel's rate
    depends on B as much as on the length (few sequences of a long buffer leave the GPU's units idle): hence a row
    per B, by length, priced by ``costmodel.attention_seconds``. On the CPU (tests): tiny lengths, eager."""
    import torch

    from offexec import model as M
    from offsim.core.specs import layer_key

    dev = torch.device(device)
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32
    H, Hk, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    cuda = dev.type == "cuda"
    lengths = [n for n in DECODE_GRAPH_LENGTHS if n <= spec.max_positions] if cuda else [16, 32]
    rows = []
    for b in batches:
        pts = []
        for n in lengths:
            buf = torch.randn(n, 2, b, Hk, D, dtype=dt, device=dev)
            q = torch.randn(b, 1, H, D, dtype=dt, device=dev)
            keys = torch.ones(1, 1, 1, n, dtype=torch.bool, device=dev)  # every position written
            groups = [(0, Hk, buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3))]
            pts.append([float(n), _graph_median_time(lambda: M.attention(spec, q, groups, mask=keys), dev, reps)])
            del buf, q, keys, groups
        rows.append([layer_key(spec), "attn", f"decode_graph:{b}", pts])
    return rows


def _graph_median_time(fn, device, reps: int, per_replay: int = 10) -> float:
    """Median seconds of one ``fn()`` replayed from a CUDA graph that holds ``per_replay`` calls of it (a graph's
    replay launch spread over them, as over a decode op's kernels); ``_median_time`` of ``fn`` on the CPU."""
    import torch

    if device.type != "cuda":
        return _median_time(fn, device, reps)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm the kernels (and cuDNN's plan) up outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_replay):
            fn()
    t = _median_time(g.replay, device, reps)
    del g
    return t / per_replay


SUSTAINED_TOKENS = 16384  # rows of the sustained-clock probe's GEMM: a prefill's size, compute-bound


def profile_sustained(device: str, seconds: float = 6.0, h: int = 7168, f: int = 28672,
                      curve: list | None = None, load=None) -> float:
    """The compute-bound GEMM rate held under ``seconds`` of back-to-back load (the median of the last half's
    0.2-s windows), over the rate of a burst after 2 s idle: how far the clocks fall under the power cap as a
    prefill runs. The GEMM is an FFN's at prefill size, [``SUSTAINED_TOKENS``, h] x [h, f] (default OPT-30B's;
    ``sustained_rows`` gives each model's own). 1.0 on the CPU. ``curve``: a list to receive [seconds under load
    at the window's end, that window's rate over the burst's] for every window: how fast the clocks fall (on the
    H200 within the first few tenths of a second, then held: results/profiles/clock_held_55c9fa9/README.md).
    ``load``: another load than the FFN GEMM, (timer, ops of a burst, ops of a window) (``_layer_ops``)."""
    if device != "cuda":
        return 1.0
    gemms, n_burst, n_window = load or (_ffn_gemms(device, h, f), 5, 40)

    def rate(n: int) -> float:  # GEMMs (or the load's ops) a second
        return n / gemms(n)

    rate(3)
    time.sleep(2.0)
    burst = rate(n_burst)
    windows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        windows.append(rate(n_window))
        if curve is not None:
            curve.append([time.perf_counter() - t0, min(1.0, windows[-1] / burst)])
    held = statistics.median(windows[len(windows) // 2:])
    return min(1.0, held / burst)


def _ffn_gemms(device: str, h: int, f: int):
    """A timer of an FFN GEMM at prefill size, [``SUSTAINED_TOKENS``, h] x [h, f] on ``device``: ``seconds(n)``,
    n of them back to back, the GPU idle before and after (synchronised). The clock probes' load."""
    import torch
    import torch.nn.functional as F

    w = torch.randn(f, h, dtype=torch.float16, device=device) * 0.02
    x = torch.randn(SUSTAINED_TOKENS, h, dtype=torch.float16, device=device)
    return _back_to_back(lambda: F.linear(x, w), device)


def _back_to_back(op, device):
    """``seconds(n)``: wall seconds of ``op()`` run n times back to back, the device synchronised before and after
    (idle around the burst): the clock probes' timer of their load."""
    import torch

    cuda = torch.device(device).type == "cuda"

    def seconds(n: int) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        a = time.perf_counter()
        for _ in range(n):
            op()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - a

    return seconds


def _layer_ops(spec, device: str, tokens: int = SUSTAINED_TOKENS):
    """The clock probes' load as a run's prefill puts it on the GPU: the model's whole decoder layer as offexec
    computes it (``model.pre_attn``, causal attention over each prompt, ``model.post_attn``: norms, rotary, the
    attention kernel and the FFN, not the FFN GEMM alone, whose power draw is the highest of them) on ``tokens``
    rows, sequences of the model's positions up to 2048. (timer, ops of a burst, ops of a window) for
    ``profile_sustained`` / ``profile_duty``: ``seconds(n)``, n layers back to back, the GPU idle before and after;
    a burst of ~40 ms and windows of ~0.25 s, as the FFN's 5 and 40 GEMMs are at OPT-30B's size."""
    import math

    import torch

    from offexec import model as M

    dev = torch.device(device)
    dt = torch.float16 if spec.dtype_bytes == 2 else torch.float32
    ctx = min(2048, spec.max_positions, tokens)
    b = max(1, tokens // ctx)
    flat = torch.empty(sum(math.prod(shape) for _, shape in spec.layer_tensors()), dtype=dt, device=dev)
    flat.normal_(0.0, 0.02)
    w = M.layer_views(M.layer_layout(spec), [(0, flat)])
    x = torch.randn(b, ctx, spec.d_model, dtype=dt, device=dev)
    rope = None if spec.family == "opt" else M.Rope(spec, dev, dt, ctx + 1)
    Hk = spec.num_kv_heads

    def layer():
        q, k, v = M.pre_attn(spec, w, x, 0, rope)
        o = M.attention(spec, q, [(0, Hk, k.transpose(1, 2), v.transpose(1, 2))])
        return M.post_attn(spec, w, x, o)

    seconds = _back_to_back(layer, dev)
    seconds(2)  # kernels loaded, the allocator grown
    one = seconds(3) / 3
    return seconds, max(1, round(0.04 / one)), max(1, round(0.25 / one))


CLOCK_DUTIES = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # the duty cycles ``profile_duty`` holds the GPU at
DUTY_BUSY_S = 0.02  # each busy spell of ``profile_duty``: about a prefill layer's compute


def profile_duty(device: str, seconds: float = 2.0, h: int = 7168, f: int = 28672, load=None) -> list:
    """The compute-bound GEMM rate when the GPU works only part of the time, over the rate of a burst after 2 s
    idle: for each duty cycle d of ``CLOCK_DUTIES``, ``seconds`` of spells of ~``DUTY_BUSY_S`` of back-to-back FFN
    GEMMs ([``SUSTAINED_TOKENS``, h] x [h, f]), each followed by an idle gap of busy x (1 - d) / d (the host sleeps
    with nothing queued), as a prefill that waits for its streamed weights between layers loads the GPU; the rate
    is the median of the last half's spells. [[d, fraction], ...]: what ``costmodel.ClockModel`` reads as its
    ('clock', 'duty') row (d = 1 is the sustained rate). [] on the CPU. ``load``: ``profile_sustained``'s."""
    if device != "cuda":
        return []
    spell = (load or (_ffn_gemms(device, h, f),))[0]  # seconds of n GEMMs, the GPU idle before and after
    spell(3)
    time.sleep(2.0)
    one = spell(5) / 5  # a GEMM at the burst clock
    n = max(1, round(DUTY_BUSY_S / one))
    out = []
    for d in CLOCK_DUTIES:
        time.sleep(2.0)  # each duty from the same cool start
        times, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            b = spell(n)
            times.append(b)
            if d < 1:
                time.sleep(b * (1 - d) / d)
        held = statistics.median(times[len(times) // 2:])
        out.append([float(d), float(min(1.0, one * n / held))])
    return out


SUSTAINED_LOADS = ("ffn", "layer")  # the clock probes' load: the model's FFN GEMM, or its whole prefill layer


def sustained_rows(spec, device: str, load: str = "ffn") -> list:
    """Row ('clock', 'sustained', [[SUSTAINED_TOKENS, fraction]]): ``profile_sustained`` with the model's own FFN
    GEMM (d_model x ffn_dim), what ``costmodel.sustained_fraction`` reads for its compute-bound ops; and row
    ('clock', 'held', [[seconds under load, fraction], ...]): the same probe's windows as the load went on (the clock
    settles within a few tenths of a second, results/profiles/clock_held_55c9fa9/README.md); and row ('clock',
    'duty', [[duty cycle, fraction], ...]): ``profile_duty``. ``costmodel.clock_model`` reads the last two: the
    clock's response to load. [] on the CPU (nothing throttles). ``load`` 'layer': the three rows with the model's
    whole prefill layer as the load (``_layer_ops``) instead of its FFN GEMM -- the clock a run's prefill sees, if
    the op mix draws less power than the GEMM alone."""
    from offsim.core.specs import layer_key

    if load not in SUSTAINED_LOADS:
        raise ValueError(f"the clock probes' load must be one of {', '.join(SUSTAINED_LOADS)}, got {load!r}")
    if device != "cuda":
        return []
    curve: list = []
    ld = _layer_ops(spec, device) if load == "layer" else None
    frac = profile_sustained(device, h=spec.d_model, f=spec.ffn_dim, curve=curve, load=ld)
    key = layer_key(spec)
    return [[key, "clock", "sustained", [[float(SUSTAINED_TOKENS), float(frac)]]],
            [key, "clock", "held", [[float(t), float(x)] for t, x in curve]],
            [key, "clock", "duty", profile_duty(device, h=spec.d_model, f=spec.ffn_dim, load=ld)]]


def profile_disk(directory: str, nbytes: int, reps: int = 3) -> dict[str, float]:
    """Bytes/s of the executor's own disk tier (``offexec.memory.DiskTier``, the very code a run uses) on a
    ``nbytes`` file in ``directory``: with O_DIRECT (the default tier), one write and the median of ``reps`` reads,
    each from the disk since O_DIRECT bypasses the page cache; then the page-cached tier (``cached=True``), a write
    into the page cache and reads of the file just written (warm). Buffers are page-aligned, as the executor's
    pinned staging buffers are, so whole blocks go in place. Returns the profile's four disk rates."""
    import torch

    from .memory import DiskTier, ExecError, aligned_empty

    src = aligned_empty(nbytes, 4096)
    src.random_(0, 256, generator=torch.Generator().manual_seed(0))  # random bytes: nothing to compress or dedup
    dst = aligned_empty(nbytes, 4096)
    out = {}
    for cached, key in ((False, "disk"), (True, "disk_cached")):
        tier = DiskTier(directory, nbytes, cached=cached)
        try:
            tier.create("probe.bin", nbytes)
            t = time.perf_counter()
            tier.write("probe.bin", src, 0)
            out[f"{key}_write_bytes_per_s"] = nbytes / (time.perf_counter() - t)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                tier.read("probe.bin", dst, 0)
                times.append(time.perf_counter() - t)
            out[f"{key}_read_bytes_per_s"] = nbytes / statistics.median(times)
            if not torch.equal(dst[:1 << 20], src[:1 << 20]):
                raise ExecError(f"disk probe in {directory}: the bytes read back differ from those written")
        finally:
            tier.close()
    return out


# --disk-ops-only: request sizes of 9 x 512 bytes x 4^i, 4.5 KiB to 72 MiB -- a KV slab is 512 x sequences x heads
# bytes a token (fp16, 128-wide heads), so a run's requests are multiples of 512, and the smaller of these are not
# whole 4-KiB blocks (read-modify-write at their ends, as a run's token stores often are)
DISK_OP_SIZES = tuple(9 * 512 * 4 ** i for i in range(8))


def profile_disk_ops(directory: str, device, sizes=DISK_OP_SIZES, reps: int = 5) -> dict[str, list]:
    """Seconds of one request of the executor's O_DIRECT disk tier (``offexec.memory.DiskTier``, the code a run
    uses) by its size: ``reps`` writes of each size at consecutive offsets of that size (a run's token slabs, one
    after another), each from a fresh host tensor as the executor's KV stores make them (``.contiguous()``: not
    page-aligned, so the bytes go through the tier's bounce buffer), then reads of the same ranges into buffers
    from ``host_tensor`` (pinned on CUDA), as its disk reads are; the medians. Returns the profile's
    ``disk_write_op`` and ``disk_read_op`` curves ([[bytes, seconds], ...])."""
    import torch

    from .memory import DiskTier, ExecError, host_tensor

    dev = torch.device(device)
    need = sum(n * reps for n in sizes)
    tier = DiskTier(directory, need, cached=False)
    out = {"disk_write_op": [], "disk_read_op": []}
    try:
        for n in sizes:
            name = f"op{n}.bin"
            tier.create(name, n * reps)
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
            writes, reads = [], []
            for k in range(reps):
                data = src.clone()  # a fresh tensor a store would write (its address as the allocator gives it)
                t = time.perf_counter()
                tier.write(name, data, k * n)
                writes.append(time.perf_counter() - t)
            for k in range(reps):
                buf = host_tensor((n,), torch.uint8, dev)
                t = time.perf_counter()
                tier.read(name, buf, k * n)
                reads.append(time.perf_counter() - t)
                if k == 0 and not torch.equal(buf, src):
                    raise ExecError(f"disk probe in {directory}: the bytes read back differ from those written")
            out["disk_write_op"].append([float(n), float(statistics.median(writes))])
            out["disk_read_op"].append([float(n), float(statistics.median(reads))])
    finally:
        tier.close()
    return out


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def profile_quant(device, spec, reps: int) -> dict:
    """FlexGen 4-bit dequantize rates as offexec runs them (``quant.dequantize_into`` for a weight,
    ``quant.unpack_vectors_into`` for KV; on CUDA the fused kernel, offexec/quant_triton.py): fp16 bytes written per
    second, for the model's largest matrix (fc1 / up: [ffn, d_model]) and a decode step's KV (16 sequences x 1024
    positions x every KV head, K and V): ``quant_weight_bytes_per_s`` and ``quant_bytes_per_s`` (the cache's, which
    ``costmodel.quant_seconds`` also prices weights with where a profile lacks the weights' rate); and the KV
    store's quantize as offexec runs it (``quant.pack_vectors_into`` of a prefill's new K and V -- 16 sequences x
    512 tokens x every KV head -- into a slice of a packed buffer, as the executor's ``_attend_packed``; on CUDA the
    fused kernel): ``quant_store_bytes_per_s``, fp16 bytes quantized per second, which ``quant_seconds`` prices the
    store with (a quantize is not a dequantize: the H200's prefill ran at a third of the rate predicted with the
    store at the dequantize's rate)."""
    import torch

    from offexec import quant

    dt = torch.float16 if device.type == "cuda" else torch.float32
    w = torch.randn(spec.ffn_dim, spec.d_model, dtype=dt, device=device)
    buf = quant.to_bytes(quant.quantize_weight(w))
    out = torch.empty_like(w)
    t_w = _median_time(lambda: quant.dequantize_into(buf, tuple(w.shape), 0, out), device, reps)
    weight_rate = out.numel() * 2 / t_w  # fp16 bytes (the cost model's unit), whatever the probe's dtype
    ctx = 1024 if device.type == "cuda" else 64
    kv = torch.randn(ctx, 2, 16, spec.num_kv_heads, spec.head_dim, dtype=dt, device=device)
    packed = quant.pack_vectors(kv)
    kv_out = torch.empty_like(kv)
    t_kv = _median_time(lambda: quant.unpack_vectors_into(packed, kv_out), device, reps)
    kv_rate = kv_out.numel() * 2 / t_kv
    del w, buf, out, kv, packed, kv_out
    tokens, seqs = (512, 16) if device.type == "cuda" else (64, 2)
    # the store's operands as the executor has them: the new K and V [tokens, seqs, heads, D] (transposed from the
    # projections' [seqs, tokens, ...]) into rows of its packed buffer [capacity, K/V, seqs, heads, stored]
    new = torch.randn(2, seqs, tokens, spec.num_kv_heads, spec.head_dim, dtype=dt, device=device).transpose(1, 2)
    store = torch.empty(tokens, 2, seqs, spec.num_kv_heads, quant.stored_nbytes((spec.head_dim,), 0),
                        dtype=torch.uint8, device=device)
    t_st = _median_time(lambda: [quant.pack_vectors_into(new[i], store[:, i]) for i in (0, 1)], device, reps)
    store_rate = new.numel() * 2 / t_st
    return {"quant_bytes_per_s": float(kv_rate), "quant_weight_bytes_per_s": float(weight_rate),
            "quant_kv_bytes_per_s": float(kv_rate), "quant_store_bytes_per_s": float(store_rate)}


def profile_multi_gpu(nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """On a host with several GPUs (issue 18): ``gpu_link_bytes_per_s``, a GPU-to-GPU copy from GPU 0 to GPU 1
    (``Tensor.copy_`` between devices: NVLink or PCIe peer, what a pipeline's hidden states cross; NCCL's send/recv
    rides the same link), and ``link_concurrent_fraction``, the pinned host-to-device rate each GPU keeps while every
    GPU copies from host memory at once (one stream and one pinned buffer per GPU, all started together), over its
    rate alone -- whether the host sustains every link at once (1: it does). Medians of ``reps`` timings of
    ``nbytes`` copies. {} with fewer than two GPUs."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return {}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    p2p = nbytes / _median_time(lambda: dst.copy_(src), torch.device("cuda:0"), reps)
    del src, dst
    hosts = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in range(n)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    streams = [torch.cuda.Stream(device=f"cuda:{i}") for i in range(n)]

    def copy(ids) -> float:
        """Seconds until every GPU in ``ids`` has its copy (host clock, all issued back to back)."""
        times = []
        for _ in range(reps + 1):
            for i in ids:
                torch.cuda.synchronize(i)
            t = time.perf_counter()
            for i in ids:
                with torch.cuda.stream(streams[i]):
                    devs[i].copy_(hosts[i], non_blocking=True)
            for i in ids:
                streams[i].synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    alone = min(copy([i]) for i in range(n))
    together = copy(list(range(n)))
    del hosts, devs
    return {"gpu_link_bytes_per_s": float(p2p), "link_concurrent_fraction": float(min(1.0, alone / together))}


def run_profile(model: str = "opt-30b", device: str = "cuda", quick: bool = False, peak_tflops: float | None = None,
                disk_dir: str | None = None, name: str | None = None) -> dict:
    """Measure this machine; return the profile dict (``HardwareSpec.from_dict`` accepts it)."""
    import torch

    from offsim.core.provenance import provenance
    from offsim.core.specs import HARDWARE_SCHEMA, HardwareSpec, get_model

    from .memory import require_device

    dev = require_device(device)
    spec = get_model(model)
    if quick:  # CI: tiny shapes, few repetitions, small disk file
        import dataclasses

        spec = dataclasses.replace(spec, d_model=min(spec.d_model, 256), ffn_dim=min(spec.ffn_dim, 1024),
                                   num_heads=4, num_kv_heads=4, head_dim=32)
    reps = 3 if quick else 10
    gpu_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    key = next((k for k in DATASHEET_PEAK_FLOPS if k in gpu_name), None)
    peak = peak_tflops * 1e12 if peak_tflops else DATASHEET_PEAK_FLOPS.get(key, 0.0)
    steps = ["link", "gpu", "4-bit", "cpu attention", "disk"]
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(steps), desc="profile", unit="step", file=sys.stderr)
    except ImportError:  # pragma: no cover
        bar = None
    sizes = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26] + ([] if quick else [1 << 28, 1 << 30])
    link = profile_link(dev, sizes, reps)
    link.update(profile_relay(dev, sizes, reps))
    bar and bar.update()
    if not peak:  # unknown GPU: efficiencies relative to the best GEMM measured, a lower bound on the peak --
        # of the same pass: a second pass normalised by the first's best read 2.3 x "peak" on a CPU whose load
        # changed between them (a CI run beside other work), which the hardware spec rightly refuses
        g = profile_gpu(dev, spec, reps, 1.0)  # FLOP/s
        peak = max(e for _, e in g["gemm_efficiency"])
        for f in ("gemm_efficiency", "attn_prefill_efficiency"):
            g[f] = [[x, y / peak] for x, y in g[f]]
    else:
        g = profile_gpu(dev, spec, reps, peak)
    bar and bar.update()
    qr = profile_quant(dev, spec, reps)
    bar and bar.update()
    cpu_flops = profile_cpu_attention(spec, reps)
    bar and bar.update()
    disk_dir = disk_dir or tempfile.gettempdir()
    disk = profile_disk(disk_dir, (64 << 20) if quick else (1 << 30), reps=2 if quick else 3)
    bar and bar.update()
    bar and bar.close()
    gpu_mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else host_memory_bytes()
    d = {"schema": HARDWARE_SCHEMA, "name": name or (gpu_name.replace("NVIDIA ", "").lower().replace(" ", "-")),
         "gpu_mem_bytes": int(gpu_mem), "gpu_peak_flops": float(peak), **g,
         "h2d_pinned": link["h2d_pinned"], "d2h_pinned": link["d2h_pinned"],
         "h2d_pageable": link["h2d_pageable"], "d2h_pageable": link["d2h_pageable"],
         **{k: link[k] for k in ("h2d_relay", "d2h_relay") if k in link},
         "duplex_fraction": float(link["duplex_fraction"]), "cpu_mem_bytes": host_memory_bytes(),
         "cpu_attention_flops": float(cpu_flops), "quant_bytes_per_s": qr["quant_bytes_per_s"],
         "quant_store_bytes_per_s": qr["quant_store_bytes_per_s"],
         "quant_weight_bytes_per_s": qr["quant_weight_bytes_per_s"],
         "disk_bytes": int(shutil.disk_usage(disk_dir).free),
         **{k: float(v) for k, v in disk.items()}, "link_latency_s": 0.0,
         "source": f"offexec profile on {gpu_name} ({'quick' if quick else 'full'}), model shapes of {model}"}
    multi = profile_multi_gpu() if dev.type == "cuda" else {}
    d.update(multi)  # several GPUs on this host: their peer link and whether the host feeds every link at once
    HardwareSpec.from_dict(d)  # the profile must load
    sweep = profile_link_sweep(dev, (256 << 20) if quick else LINK_SWEEP_POOL_BYTES)
    d["provenance"] = provenance(gpu=gpu_name, model_shapes=model, quick=quick, quant_rates=qr, link_sweep=sweep,
                                 gpus=torch.cuda.device_count() if dev.type == "cuda" else 0,
                                 peak_flops_source="datasheet" if key or peak_tflops else "best measured GEMM")
    return d


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine and write a hardware-profile JSON for offsim",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="opt-30b", help="model whose GEMM and attention shapes to time "
                                                      "(default: %(default)s)")
    p.add_argument("--device", default="cuda", help="'cuda' (default) or 'cpu' (for tests)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the profile JSON")
    p.add_argument("--name", default=None, help="the profile's name (default: from the GPU's name)")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOP/s",
                   help="dense fp16 peak of the GPU, when it is not in the datasheet table")
    p.add_argument("--disk-dir", default=None, metavar="DIR", help="directory whose disk to time (default: temp)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (tests)")
    p.add_argument("--ops", default=None, metavar="MODELS",
                   help="comma-separated models (presets or config.json paths) whose compute ops to time as the "
                        "executor runs them: op tables the cost model prefers to its analytical terms")
    p.add_argument("--base", default=None, metavar="PROFILE",
                   help="with --ops: keep this profile's other measurements and add the op tables (and CPU "
                        "attention through the executor's path) to it, instead of measuring everything")
    p.add_argument("--attention-only", nargs="?", const="all", default=None, choices=("all", "decode"),
                   metavar="{all,decode}",
                   help="with --ops: measure only the GPU attention rows (by context, each model's heads; a graphed "
                        "decode op's by sequences and KV buffer length, 'decode_graph:B') and the sustained compute "
                        "fraction; decode: only the graphed decode rows, the rest of --base kept (default: all)")
    p.add_argument("--recompute-only", action="store_true",
                   help="with --ops: measure only the graphed recompute rows (TightLLM's decode ops of 2 to 8 "
                        "query tokens as CUDA graphs)")
    p.add_argument("--capture-only", nargs="?", const="all", default=None, choices=("all", "new_q"),
                   metavar="{all,new_q}",
                   help="with --ops: measure only the graph-capture rows (graphed decode ops at the first decode "
                        "step; TightLLM's first op at each new recompute length, 'new_q:PART') and the issue rows "
                        "(host time per copy of each kind, and per replayed decode op of each part); new_q: only "
                        "the new-length captures, the other rows kept as they are (default: all)")
    p.add_argument("--cpu-attention-only", nargs="?", const="all", default=None, choices=("all", "offexec", "flexgen"),
                   metavar="{all,offexec,flexgen}",
                   help="with --ops: measure only CPU attention by context (decode ops at contexts "
                        f"{', '.join(map(str, CPU_ATTN_CONTEXTS))}, each GPU batch size), which offsim prefers to "
                        "its fixed cost + FLOP rate: offexec's path ('attn_ctx:B' rows) and FlexGen's own fp32 path "
                        "('attn_ctx_flexgen:B', what the flexgen-ref policy prices: FlexGen's mha_gen itself where "
                        "the flexgen package is importable, else its sequence of ops reproduced); a value keeps "
                        "the other path's rows as they are (default: all)")
    p.add_argument("--under-h2d-load", action="store_true",
                   help="with --cpu-attention-only: measure those rows with the host-to-GPU link kept busy by a "
                        "copy loop of its own, as a run's weight stream keeps it (rows 'attn_ctx_h2d:B' / "
                        "'attn_ctx_flexgen_h2d:B', beside the unloaded ones; offsim does not read them: "
                        "results/profiles/cpu_attention_load/README.md)")
    p.add_argument("--flexgen-only", nargs="?", const="all", default=None, choices=("all", "store"),
                   metavar="{all,store}",
                   help="with --ops (OPT models): measure only FlexGen 0.1.8's own code, what the flexgen-ref policy "
                        "prices -- its CPU attention per (layer, GPU batch) as --cpu-attention-only flexgen times "
                        "it, its 4-bit decompress of weights and of the KV cache on the GPU "
                        "('dequant_flexgen:weight' / ':cache' rows), and its store of a prefill's K and V into its "
                        "fresh unpinned host cache through its copy threads ('store_flexgen:fp16' / ':4bit' rows); "
                        "store: those rows alone, the rest kept (default: all); needs the flexgen package and a CUDA "
                        "GPU")
    p.add_argument("--multi-gpu-only", action="store_true",
                   help="with --base: measure only the GPU-to-GPU link and whether the host feeds every GPU's link "
                        "at once (gpu_link_bytes_per_s, link_concurrent_fraction; needs two or more GPUs)")
    p.add_argument("--quant-only", action="store_true",
                   help="with --base: measure only the 4-bit rates (quant_weight_bytes_per_s / quant_bytes_per_s: "
                        "dequantize of weights / of the KV cache; quant_store_bytes_per_s: the KV store's quantize; "
                        "at --model's shapes) and keep the rest of the base profile")
    p.add_argument("--relay-only", action="store_true",
                   help="with --base: measure only the relay copy rates (h2d_relay / d2h_relay: an unpinned host "
                        "tensor staged through a pinned copy, as FlexGen's general_copy does; what flexgen-ref "
                        "prices its unpinned KV copies at) and keep the rest of the base profile")
    p.add_argument("--disk-ops-only", action="store_true",
                   help="with --base: measure only the disk tier's time per request by size (disk_read_op / "
                        "disk_write_op: 4.5 KiB to 72 MiB through offexec's O_DIRECT tier in --disk-dir, as a run's "
                        "KV stores and loads make them; offsim prices disk ops from them) and keep the rest of the "
                        "base profile")
    p.add_argument("--host-probe-only", action="store_true",
                   help="with --base: record only the host's state now (provenance.host_probe: offexec.hostprobe's "
                        "fixed CPU-attention op and host copy, CPU model, load), the state offsim validate sets each "
                        "measured case's own probe beside; a full profile and a CPU-attention measurement record "
                        "it themselves")
    p.add_argument("--link-sweep-only", action="store_true",
                   help="with --base: measure only the link sweep (provenance.link_sweep: a pinned pool of "
                        "--sweep-pool-gb copied to the GPU in 256 MiB chunks, every chunk once a pass, as a run "
                        "streams its weights, beside one chunk copied as often) and keep the rest of the base "
                        "profile; offsim does not read it")
    p.add_argument("--sweep-pool-gb", type=float, default=LINK_SWEEP_POOL_BYTES / (1 << 30), metavar="GiB",
                   help="the link sweep's pinned pool (default: %(default)g; at most half of host memory)")
    p.add_argument("--decode-only", action="store_true",
                   help="with --ops: measure only the decode ops' rows (replayed as CUDA graphs and eager, their "
                        "captures and issue times) at --op-batches, the runs at the short prompt alone; the prefill "
                        "and CPU-attention rows are kept as they are. For sequence counts the full probe did not "
                        "time: a plan's decode op is priced between the sizes measured")
    p.add_argument("--merge", nargs="+", default=None, metavar="PROFILE",
                   help="with --base: combine profiles that were each measured from --base (e.g. one --ops model per "
                        "device call): every op-table row and provenance record a PROFILE changed or added is taken; "
                        "two PROFILEs changing the same row differently is an error. Nothing is measured")
    p.add_argument("--sustained-only", nargs="?", const="ffn", default=None, choices=SUSTAINED_LOADS,
                   metavar="{ffn,layer}",
                   help="with --ops: measure only each model's clock under load (its FFN GEMM held for seconds "
                        "over a burst after idle: 'clock' 'sustained' rows, what offsim divides its compute-bound "
                        "ops by, and 'held' rows, the windows as it settles; then at duty cycles 0.3-1: 'duty' "
                        "rows; ~45 s a model), the rest of the base profile kept; layer: the same rows with the "
                        "model's whole prefill decoder layer as offexec computes it as the load (default: ffn)")
    p.add_argument("--op-batches", default="1,4,16,64", metavar="N,N,...",
                   help="sequences per GPU batch of the op-table runs (default: %(default)s)")
    p.set_defaults(func=cmd_profile)


def _flexgen_attention_tables(spec, device: str, batches, source: dict) -> list:
    """FlexGen's own CPU-attention rows (what flexgen-ref prices): its code timed where flexgen is importable, the
    reproduced sequence kept beside them as 'attn_ctx_flexgen_seq:B' (the two disagreeing says the reproduction
    misses something); the reproduction alone otherwise. ``source[model]``: which was timed."""
    own = profile_cpu_attention_flexgen_own(spec, device, batches=batches)
    seq = profile_cpu_attention_flexgen(spec, batches=batches)
    source[spec.name] = "flexgen load_cache (path 1) + TorchDevice.mha_gen" if own else "reproduced sequence"
    return own + ([[k, m, p.replace("attn_ctx_flexgen:", "attn_ctx_flexgen_seq:"), c] for k, m, p, c in seq]
                  if own else seq)


def add_op_tables(d: dict, models: list[str], device: str, batches=(1, 4, 16, 64), attention_only=None,
                  recompute_only: bool = False, capture_only=None, cpu_attention_only=None,
                  flexgen_only: bool = False, decode_only: bool = False, sustained_only: bool = False,
                  under_h2d_load: bool = False) -> dict:
    """Profile dict ``d`` with op tables for ``models`` (replacing rows of the same layer shapes and modes), CPU
    attention re-measured through the executor's path and the sustained compute fraction; ``attention_only``: the
    GPU attention rows and the sustained fraction alone ('decode': the graphed decode attention rows alone);
    ``recompute_only``: the graphed recompute rows alone (the rest of ``d`` kept); ``capture_only``: the
    graph-capture and copy-issue rows alone; ``decode_only``: the decode ops' rows (graph, eager, capture, issue)
    alone, at ``batches``; ``sustained_only``: the clock rows alone ('layer': with the prefill layer as the load,
    ``sustained_rows``); ``under_h2d_load`` (with ``cpu_attention_only``): the CPU-attention rows measured with the
    host-to-GPU link kept busy (``H2DLoad``), under parts ending in '_h2d', beside the others. Provenance says
    which."""
    from offsim.core.provenance import provenance
    from offsim.core.specs import HardwareSpec, get_model

    d = dict(d)
    specs = [get_model(m) for m in models]
    rows = []
    H2DLoad.rates.clear()  # (the loads of this call's probes alone)
    flexgen_source = {}  # model -> what its 'attn_ctx_flexgen:B' rows timed
    flexgen_timed = {}  # model -> whether FlexGen's own code was timed for it (needs the package, CUDA, an OPT)
    for spec in specs:
        if cpu_attention_only:
            if cpu_attention_only in (True, "all", "offexec"):
                rows += profile_cpu_attention_ctx(spec, device, batches=batches, under_h2d_load=under_h2d_load)
            if cpu_attention_only == "offexec":
                continue
            if under_h2d_load:
                with H2DLoad(device):
                    fg = _flexgen_attention_tables(spec, device, batches, flexgen_source)
                rows += [[k, m, part.replace(":", H2D_LOADED + ":", 1), c] for k, m, part, c in fg]
            else:
                rows += _flexgen_attention_tables(spec, device, batches, flexgen_source)
            continue
        if flexgen_only == "store":  # FlexGen's own prefill KV store alone (OPT models)
            st = profile_flexgen_store(spec, device)
            rows += st
            flexgen_timed[spec.name] = bool(st)
            continue
        if flexgen_only:  # FlexGen's own code: its CPU attention, 4-bit decompress and KV store (OPT models)
            rows += _flexgen_attention_tables(spec, device, batches, flexgen_source)
            dq = profile_flexgen_dequant(spec, device)
            rows += dq + profile_flexgen_store(spec, device)
            flexgen_timed[spec.name] = bool(dq)
            continue
        if decode_only:
            rows += profile_ops(spec, device, batches=batches, decode_only=True)
            continue
        if sustained_only:
            rows += sustained_rows(spec, device, "ffn" if sustained_only is True else sustained_only)
            continue
        if capture_only:
            if capture_only != "new_q":
                rows += profile_ops(spec, device, batches=batches, capture_only=True)
            if device == "cuda":
                rows += profile_graph_new_q(spec, device, batches=batches)
            continue
        if not (attention_only or recompute_only):
            rows += profile_ops(spec, device, batches=batches) + sustained_rows(spec, device)
        if not attention_only and device == "cuda":
            rows += profile_graph_recompute(spec, device, batches=batches)
            if not recompute_only:
                rows += profile_graph_new_q(spec, device, batches=batches)
        if not recompute_only:
            if attention_only != "decode":
                rows += profile_attention(spec, device, float(d["gpu_peak_flops"]))
            rows += profile_decode_attention(spec, device, batches=batches)
    keys = {(r[0], r[1], r[2]) for r in rows}
    d["op_times"] = [r for r in d.get("op_times", []) if tuple(r[:3]) not in keys] + rows
    prov = dict(d.get("provenance", {}))
    if not (recompute_only or capture_only or cpu_attention_only or flexgen_only or decode_only or sustained_only
            or attention_only == "decode"):
        d["sustained_compute_fraction"] = float(profile_sustained(device))
    if flexgen_only:
        from offsim.core.errors import OffsimError

        if not any(flexgen_timed.values()):
            raise OffsimError("--flexgen-only times FlexGen 0.1.8's own code: it needs the flexgen package, a CUDA "
                              "GPU (--device cuda) and an OPT model in --ops")
        if flexgen_only == "store":
            prov["flexgen_store_tables"] = provenance(models=models, device=device,
                                                      caches=list(FLEXGEN_STORE_CACHES))
        else:
            prov["flexgen_code_tables"] = provenance(models=models, batches=list(batches),
                                                     contexts=list(CPU_ATTN_CONTEXTS), device=device,
                                                     rows_timed=flexgen_source, caches=list(FLEXGEN_DEQUANT_CACHES))
    elif cpu_attention_only and under_h2d_load:  # beside the unloaded rows, with a record of its own
        rates = H2DLoad.rates
        prov["cpu_attention_h2d_tables"] = provenance(
            models=models, batches=list(batches), contexts=list(CPU_ATTN_CONTEXTS), device=device,
            paths=cpu_attention_only, rows_timed=flexgen_source,
            h2d_load_GBps=round(statistics.median(rates) / 1e9, 2) if rates else 0.0)
    elif cpu_attention_only:
        # each path's rows carry their own provenance, so measuring one path leaves the other's record as it was
        if cpu_attention_only in (True, "all", "offexec"):
            prov["cpu_attention_ctx_tables"] = provenance(models=models, batches=list(batches),
                                                          contexts=list(CPU_ATTN_CONTEXTS), device=device)
        if cpu_attention_only in (True, "all", "flexgen"):
            prov["cpu_attention_flexgen_tables"] = provenance(models=models, batches=list(batches),
                                                              contexts=list(CPU_ATTN_CONTEXTS), device=device,
                                                              rows_timed=flexgen_source)
    elif decode_only:
        prov["decode_op_tables"] = provenance(models=models, batches=list(batches), device=device)
    elif sustained_only:
        prov["sustained_tables"] = provenance(models=models, device=device, tokens=SUSTAINED_TOKENS,
                                              load="ffn" if sustained_only is True else sustained_only)
    elif capture_only:  # (the new-length captures alone keep the other capture rows' record)
        prov["new_q_capture_tables" if capture_only == "new_q" else "capture_tables"] = provenance(
            models=models, batches=list(batches), device=device)
    elif recompute_only:
        prov["recompute_graph_tables"] = provenance(models=models, batches=list(batches), device=device)
    elif attention_only == "decode":
        pass  # (its own record below)
    elif attention_only:
        prov["attention_tables"] = provenance(models=models, device=device)
    else:
        d["cpu_attention_flops"] = float(profile_cpu_attention(specs[0], 10))
        prov["op_tables"] = provenance(models=models, batches=list(batches), device=device,
                                       cpu_attention="executor path, model shapes of " + models[0])
    if not (recompute_only or capture_only or cpu_attention_only or flexgen_only or decode_only or sustained_only):
        prov["decode_graph_attention_tables"] = provenance(models=models, batches=list(batches), device=device)
    HardwareSpec.from_dict(d)  # the profile must load
    d["provenance"] = prov
    return d


def _parse_models(text: str) -> list[str]:
    from offsim.core.errors import OffsimError

    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise OffsimError(f"--ops: no model named in {text!r} (e.g. --ops opt-6.7b,llama-3-8b)")
    return models


def merge_profiles(base: dict, parts: list[tuple[str, dict]]) -> dict:
    """``base`` with what each of ``parts`` ((name, profile) pairs, each measured from ``base`` by one ``offexec
    profile --base``) changed: op-table rows (by layer shape, mode, part) and provenance records that differ from
    ``base``'s or are new. A record two parts changed (the same measurement split over calls, e.g. one model each)
    becomes the list of their records. Two parts changing one row differently, or a scalar field, is an error: what
    they measured would depend on the order of the files."""
    from offsim.core.errors import OffsimError
    from offsim.core.specs import HardwareSpec

    for name, d in [("--base", base)] + list(parts):  # each one offsim reads, before any is combined
        try:
            HardwareSpec.from_dict(d)
        except OffsimError as e:
            raise OffsimError(f"{name}: {e}") from None
        if not isinstance(d.get("provenance", {}), dict):
            raise OffsimError(f"{name}: field 'provenance' must be an object, got {type(d['provenance']).__name__}")
    rows = {tuple(r[:3]): r for r in base.get("op_times", [])}
    out_rows = dict(rows)
    source: dict[tuple, str] = {}
    base_prov = base.get("provenance", {})
    prov = dict(base_prov)
    merged_prov: dict[str, list] = {}
    for name, d in parts:
        for key in set(d) - {"op_times", "provenance", "name"}:
            if d[key] != base.get(key):
                raise OffsimError(f"{name}: field {key!r} differs from the base profile's; --merge combines op-table "
                                  "rows measured from the same base (re-measure with --base BASE)")
        for r in d.get("op_times", []):
            k = tuple(r[:3])
            if rows.get(k) == r:
                continue
            if k in source and out_rows[k] != r:
                raise OffsimError(f"{name} and {source[k]} both measured row {list(k)} differently: merge one of them")
            out_rows[k], source[k] = r, name
        for sec, rec in d.get("provenance", {}).items():
            if base_prov.get(sec) != rec:
                merged_prov.setdefault(sec, []).append(rec)
    for sec, recs in merged_prov.items():
        prov[sec] = recs[0] if len(recs) == 1 else recs
    from offsim.core.provenance import provenance

    prov["merged"] = provenance(parts=[name for name, _ in parts])  # this merge: its command and files
    out = {**base, "op_times": list(out_rows.values()), "provenance": prov}
    HardwareSpec.from_dict(out)  # a merged profile is one offsim reads
    return out


def _write_profile(d: dict, path) -> Path:
    """Write profile ``d`` to ``path`` whole or not at all (through ``write_text_atomic``), as strict JSON (a value
    that is not finite is a measurement gone wrong, refused here by name rather than written as NaN)."""
    from offsim.core.errors import OffsimError
    from offsim.core.io import write_text_atomic

    out = Path(path)
    try:
        text = json.dumps(d, indent=1, allow_nan=False)
    except ValueError:
        bad = [k for k, v in d.items() if isinstance(v, float) and not math.isfinite(v)]
        raise OffsimError(f"the profile holds values that are not finite numbers ({', '.join(bad) or 'in a curve'}); "
                          "nothing written") from None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, text)
    except OSError as e:
        raise OffsimError(f"--out {path}: cannot write the profile ({e.strerror or e})") from None
    return out


def cmd_profile(args) -> dict:
    from offsim.cli import check_output_path
    from offsim.core.errors import OffsimError
    from offsim.core.io import read_json_object

    # the output's folder may be made (as _write_profile makes it), but it must be makeable: refused now, not after
    # minutes of measurement
    check_output_path(args.out, "--out", make_parents=True)

    if args.merge:
        if not args.base:
            raise OffsimError("--merge combines profiles measured from one base: give --base PROFILE too")
        if (args.ops or args.quant_only or args.multi_gpu_only or args.relay_only or args.host_probe_only
                or args.disk_ops_only or args.link_sweep_only):
            raise OffsimError("--merge measures nothing: give it without --ops and the --*-only options")
        d = merge_profiles(read_json_object(args.base, "hardware profile"),
                           [(f, read_json_object(f, "hardware profile")) for f in args.merge])
        out = _write_profile(d, args.out)
        summary = {"out": str(out), "name": d["name"], "merged": list(args.merge)}
        print(json.dumps(summary))
        return summary

    only = [f"--{n.replace('_', '-')}" for n in ("attention_only", "recompute_only", "capture_only",
                                                 "cpu_attention_only") if getattr(args, n, None)]
    if only and not args.ops:  # (without --ops they would be ignored and the whole profile measured)
        raise OffsimError(f"{', '.join(only)} narrows the op tables that --ops MODELS measures: give --ops MODELS "
                          "(and --base PROFILE) too")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise OffsimError(f"--peak-tflops must be a positive number of TFLOP/s, got {args.peak_tflops}")
    if args.multi_gpu_only and not args.base:
        raise OffsimError("--multi-gpu-only adds the multi-GPU rates to an existing profile: give --base PROFILE too")
    if args.quant_only and not args.base:
        raise OffsimError("--quant-only adds the 4-bit rates to an existing profile: give --base PROFILE too")
    if args.relay_only and not args.base:
        raise OffsimError("--relay-only adds the relay copy rates to an existing profile: give --base PROFILE too")
    if args.disk_ops_only and not args.base:
        raise OffsimError("--disk-ops-only adds the disk tier's time per request to an existing profile: give --base "
                          "PROFILE too")
    if args.link_sweep_only and not args.base:
        raise OffsimError("--link-sweep-only records the link sweep in an existing profile: give --base PROFILE too")
    if not args.sweep_pool_gb > 0:
        raise OffsimError(f"--sweep-pool-gb must be a positive number of GiB, got {args.sweep_pool_gb}")
    if args.host_probe_only and not args.base:
        raise OffsimError("--host-probe-only records the host's state in an existing profile: give --base PROFILE "
                          "too")
    if args.under_h2d_load and not args.cpu_attention_only:
        raise OffsimError("--under-h2d-load measures the CPU-attention rows with the link busy: give "
                          "--cpu-attention-only [offexec|flexgen] (and --base PROFILE --ops MODELS) too")
    if args.sustained_only and not (args.ops and args.base):
        raise OffsimError("--sustained-only adds each model's sustained clock fraction to an existing profile: give "
                          "--base PROFILE and --ops MODELS too")
    if args.decode_only and not (args.ops and args.base):
        raise OffsimError("--decode-only re-measures the decode ops' rows of an existing profile: give --base PROFILE "
                          "and --ops MODELS too")
    if args.base and not (args.ops or args.quant_only or args.multi_gpu_only or args.relay_only
                          or args.host_probe_only or args.disk_ops_only or args.link_sweep_only):
        raise OffsimError("--base adds op tables to an existing profile: give --ops MODELS (or --quant-only, "
                          "--multi-gpu-only, --relay-only, --host-probe-only, --disk-ops-only, --link-sweep-only) "
                          "too")
    try:
        batches = tuple(int(b) for b in args.op_batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise OffsimError(f"--op-batches must be positive integers separated by commas, got {args.op_batches!r}")
    models = _parse_models(args.ops) if args.ops else []
    from offsim.core.specs import get_model

    for m in models + ([args.model] if args.model else []):  # a misspelt name refused now, not after the measuring
        get_model(m)
    if args.base:
        read_json_object(args.base, "hardware profile")
    if args.flexgen_only:  # refused before anything is measured
        if not models or not any(get_model(m).family == "opt" for m in models):
            raise OffsimError("--flexgen-only times FlexGen 0.1.8's own code, which runs OPT models: give --ops with "
                              "at least one OPT model")
        if not str(args.device).startswith("cuda") or _flexgen_devices() is None:
            raise OffsimError("--flexgen-only times FlexGen 0.1.8's own code: it needs the flexgen package and a "
                              "CUDA GPU (--device cuda)")
    # the host's state as the host-side rows are measured (CPU attention above all: offexec.hostprobe), recorded
    # by the measurements that time them; a measured case's own probe is set beside it by offsim validate
    host_rows = (not args.base or args.host_probe_only or args.cpu_attention_only in ("all", "offexec")
                 or (models and not (args.attention_only or args.recompute_only or args.capture_only
                                     or args.cpu_attention_only or args.flexgen_only or args.decode_only
                                     or args.sustained_only)))
    if models or args.quant_only or args.relay_only or args.multi_gpu_only or args.link_sweep_only or not args.base:
        from .memory import require_device

        require_device(args.device)  # one line, before anything is read or measured
    if host_rows:
        from offsim.core.provenance import provenance

        from .hostprobe import host_probe

        probe = provenance(**host_probe())
    if args.base:
        d = read_json_object(args.base, "hardware profile")
    else:
        d = run_profile(args.model, args.device, args.quick, args.peak_tflops, args.disk_dir, args.name)
    if args.quant_only:
        from offsim.core.provenance import provenance
        from offsim.core.specs import HardwareSpec, get_model

        from .memory import require_device

        qr = profile_quant(require_device(args.device), get_model(args.model), 10)
        d = {**d, "quant_bytes_per_s": qr["quant_bytes_per_s"],
             "quant_store_bytes_per_s": qr["quant_store_bytes_per_s"],
             "quant_weight_bytes_per_s": qr["quant_weight_bytes_per_s"]}
        HardwareSpec.from_dict(d)
        d["provenance"] = {**d.get("provenance", {}),
                           "quant_rates": provenance(model_shapes=args.model, device=args.device, **qr)}
    if args.relay_only:
        from offsim.core.provenance import provenance
        from offsim.core.specs import HardwareSpec

        from .memory import require_device

        dev = require_device(args.device)
        relay = profile_relay(dev, RELAY_SIZES, 5)
        if not relay:
            raise OffsimError("--relay-only times copies to a CUDA GPU: give --device cuda on a machine with one")
        d = {**d, **relay}
        HardwareSpec.from_dict(d)
        d["provenance"] = {**d.get("provenance", {}), "relay_rates": provenance(device=args.device,
                                                                                  sizes=list(RELAY_SIZES))}
    if args.disk_ops_only:
        from offsim.core.provenance import provenance
        from offsim.core.specs import HardwareSpec

        disk_dir = args.disk_dir or tempfile.gettempdir()
        ops = profile_disk_ops(disk_dir, args.device, DISK_OP_SIZES)
        d = {**d, **ops}
        HardwareSpec.from_dict(d)
        d["provenance"] = {**d.get("provenance", {}), "disk_ops": provenance(directory=disk_dir,
                                                                           sizes=list(DISK_OP_SIZES))}
    if args.link_sweep_only:
        from offsim.core.provenance import provenance

        from .memory import require_device

        sweep = profile_link_sweep(require_device(args.device), int(args.sweep_pool_gb * (1 << 30)))
        if not sweep:
            raise OffsimError("--link-sweep-only times copies to a CUDA GPU: give --device cuda on a machine with one")
        d["provenance"] = {**d.get("provenance", {}), "link_sweep": provenance(device=args.device, **sweep)}
    if args.multi_gpu_only:
        from offsim.core.provenance import provenance
        from offsim.core.specs import HardwareSpec

        mg = profile_multi_gpu()
        if not mg:
            raise OffsimError("--multi-gpu-only needs two or more CUDA GPUs on this host")
        d = {**d, **mg}
        HardwareSpec.from_dict(d)
        d["provenance"] = {**d.get("provenance", {}), "multi_gpu": provenance(**mg)}
    if models:
        d = add_op_tables(d, models, args.device, batches, args.attention_only, args.recompute_only,
                          args.capture_only, args.cpu_attention_only, args.flexgen_only, args.decode_only,
                          args.sustained_only, args.under_h2d_load)
        if args.name:
            d["name"] = args.name
    if host_rows:
        d["provenance"] = {**d.get("provenance", {}), "host_probe": probe}
    out = _write_profile(d, args.out)
    h2d = d["h2d_pinned"][-1][1] / 1e9
    print(f"profile of {d['name']} written to {out}")
    d = {"disk_cached_read_bytes_per_s": 0.0, "disk_cached_write_bytes_per_s": 0.0, **d}
    print(f"  pinned H2D {h2d:.1f} GB/s, D2H {d['d2h_pinned'][-1][1] / 1e9:.1f} GB/s, duplex "
          f"{d['duplex_fraction']:.2f}; HBM {d['gpu_hbm_bytes_per_s'] / 1e12:.2f} TB/s; best GEMM "
          f"{max(e for _, e in d['gemm_efficiency']) * d['gpu_peak_flops'] / 1e12:.0f} TFLOP/s; CPU attention "
          f"{d['cpu_attention_flops'] / 1e9:.1f} GFLOP/s; disk (O_DIRECT) read "
          f"{d['disk_read_bytes_per_s'] / 1e9:.2f} GB/s, write {d['disk_write_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"page-cached read {d['disk_cached_read_bytes_per_s'] / 1e9:.2f} GB/s, write "
          f"{d['disk_cached_write_bytes_per_s'] / 1e9:.2f} GB/s")
    summary = {"out": str(out), "name": d["name"], "h2d_pinned_GBps": h2d,
               "duplex_fraction": d["duplex_fraction"], "provenance": d["provenance"]}
    print(json.dumps(summary))
    return summary


def main(argv=None) -> int:
    from offsim.core.errors import OffsimError

    ap = argparse.ArgumentParser(prog="offexec")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_profile_parser(sub)
    args = ap.parse_args(argv)
    try:
        args.func(args)
    except OffsimError as e:
        print(f"offexec: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(["profile", *sys.argv[1:]]))
