"""Does the host's cost of a CUDA call grow while the link is busy? (issue 14: in the H200 runs a graphed decode op
or a KV copy costs the issuing thread ~0.2-0.3 ms, 3-4x its profile row, which ``offexec profile`` measures with
the link idle; ``issue_cpu_s`` ~ ``issue_s``, so the thread is busy, not blocked.)

Times, per call, the CUDA calls offexec's issuing loop makes for one op -- a timing event's record, a stream's wait
on an event, a small kernel, a device copy into a static buffer, a clone, pinned host-to-GPU copies (from PyTorch's
pinned allocator and from memory page-locked in place, as a run's weights and KV cache are), the replay of a
one-kernel and of a 24-kernel CUDA graph, a stream switch -- with the link idle, then while another thread keeps it
busy host-to-GPU (``offexec.profile.H2DLoad``: 512 MiB pinned copies back to back, as a run's weight stream), then
GPU-to-host, then launched behind a busy GPU ('gpu_busy': a ~20 ms kernel queued first on the stream, as a run's
issuing thread works ahead of its GPU), then behind that kernel and a backlog of hundreds of small kernels
('deep_queue': the launches a run's window of eager ops leaves pending). Wall and thread-CPU microseconds per call
(medians over rounds of ``--calls`` calls; the stream is drained between rounds, outside the timing). Writes JSON to
``--out``.

    python -m experiments.offexec.issue_under_load --out issue_under_load.json     # on a CUDA machine
    python -m experiments.offexec.issue_under_load --report results/offexec/issue_under_load/   # here: README
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _load(kind: str, device: str):
    """A context keeping the link busy in one direction ('h2d' or 'd2h': ``offexec.profile.H2DLoad``'s thread), or
    a null context for 'idle'."""
    import contextlib

    from offexec.profile import H2DLoad

    return contextlib.nullcontext() if kind == "idle" else H2DLoad(device, direction=kind)


def calls(device: str = "cuda") -> dict:
    """({name: call}, the stream they run on): each call is one of the issuing loop's CUDA calls, made on that
    stream (the measurement makes it current)."""
    import torch

    s, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    small = torch.zeros(16, device=device)
    out = torch.empty_like(small)
    hidden = torch.randn(16, 1, 7168, dtype=torch.float16, device=device)  # OPT-30B decode hidden state, 16 seqs
    static = torch.empty_like(hidden)
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    # a run's weights and KV cache live in large host tensors page-locked in place (cudaHostRegister:
    # offexec.memory.HostBuffer), not in PyTorch's pinned allocator: copies from them may take another path
    from offexec.memory import HostBuffer

    reg = HostBuffer(1 << 30, torch.uint8, pinned=True).tensor
    big_host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    big_dev = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    offs = iter(range(1 << 30))

    def reg_copy(n):
        o = (next(offs) * (1 << 20)) % ((1 << 30) - n)  # a different region each call, as a run's KV rows are
        (big_dev if n > dev.numel() else dev)[:n].copy_(reg[o:o + n], non_blocking=True)

    evs = [torch.cuda.Event(enable_timing=True) for _ in range(4096)]
    done = torch.cuda.Event()
    done.record(s2)
    graphs = {}
    for n in (1, 24):
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(4096, device=device)
        with torch.cuda.stream(s):
            x.add_(1)  # warm the kernel before capture
            torch.cuda.synchronize()
            g.capture_begin()
            for _ in range(n):
                x.add_(1)
            g.capture_end()
        graphs[n] = (g, x)
    it = iter(range(1 << 30))

    def rec():
        evs[next(it) % len(evs)].record(s)

    toggle = [s, s2]
    return {
        "event_record": rec,
        "wait_event": lambda: s.wait_event(done),
        "small_kernel": lambda: torch.add(small, 1, out=out),
        "copy_static_input": lambda: static.copy_(hidden),
        "clone_output": lambda: hidden.clone(),
        "h2d_copy_1MiB": lambda: dev.copy_(host, non_blocking=True),
        "h2d_copy_1MiB_registered": lambda: reg_copy(1 << 20),
        "h2d_copy_64MiB": lambda: big_dev.copy_(big_host, non_blocking=True),
        "h2d_copy_64MiB_registered": lambda: reg_copy(64 << 20),
        "d2h_copy_1MiB_registered": lambda: reg[:1 << 20].copy_(dev, non_blocking=True),
        "graph_replay_1_kernel": graphs[1][0].replay,
        "graph_replay_24_kernels": graphs[24][0].replay,
        "set_stream": lambda: torch.cuda.set_stream(toggle[next(it) & 1]),
        "python_only": lambda: None,
    }, s


LOADS = ("idle", "h2d", "d2h", "gpu_busy", "deep_queue")
# 'gpu_busy': each round's calls are launched behind a ~20 ms kernel on the same stream (``torch.cuda._sleep``), as a
# run's are -- its issuing thread works ahead of a busy GPU, where the other loads' rounds start on a drained one
BUSY_CYCLES = 40_000_000
# 'deep_queue': as 'gpu_busy', with a backlog of BACKLOG_KERNELS small kernels queued behind that kernel first: a
# run's compute stream may hold 16 ops ahead of its GPU, and an eager TightLLM recompute op is ~35 launches, so the
# driver holds hundreds of pending launches when the thread issues the next (does its per-call cost grow with them?
# 2026-12-03: a run-ahead window of 4 instead of 16 cut such a run's issue time by a quarter,
# results/offexec/runahead_7040813/)
BACKLOG_KERNELS = 600
BEHIND_KERNEL = ("gpu_busy", "deep_queue")  # the loads whose rounds start behind the ~20 ms kernel, link idle


def measure(n_calls: int = 200, rounds: int = 15, loads=LOADS) -> dict:
    import torch

    dev = "cuda"
    table, s = calls(dev)
    backlog = torch.zeros(16, device=dev)
    res = {}
    for load in loads:
        with _load("idle" if load in BEHIND_KERNEL else load, dev) as ld:
            time.sleep(0.3)  # the load reaches its rate
            for name, fn in table.items():
                walls, cpus = [], []
                with torch.cuda.stream(s):
                    for r in range(rounds + 1):
                        s.synchronize()
                        if load in BEHIND_KERNEL:
                            torch.cuda._sleep(BUSY_CYCLES)
                        if load == "deep_queue":
                            for _ in range(BACKLOG_KERNELS):
                                backlog.add_(1)
                        a, c = time.perf_counter(), time.thread_time()
                        for _ in range(n_calls):
                            fn()
                        w, cc = time.perf_counter() - a, time.thread_time() - c
                        if r:  # the first round warms up
                            walls.append(w / n_calls)
                            cpus.append(cc / n_calls)
                torch.cuda.set_stream(torch.cuda.default_stream())
                res.setdefault(name, {})[load] = {"wall_us": 1e6 * statistics.median(walls),
                                                  "cpu_us": 1e6 * statistics.median(cpus),
                                                  "wall_us_max": 1e6 * max(walls)}
        if ld is not None and hasattr(ld, "bytes_per_s") and load in ("h2d", "d2h"):
            res.setdefault("_load_GBps", {})[load] = ld.bytes_per_s / 1e9
    return res


def report(folder: Path) -> str:
    """README.md of a folder holding this script's JSON (``issue_under_load.json``): the table, generated."""
    doc = json.loads((folder / "issue_under_load.json").read_text())
    res, prov = doc["results"], doc["provenance"]
    loads = [k for k in LOADS if k in next(iter(v for k, v in res.items() if k[0] != "_"))]
    rate = res.get("_load_GBps", {})
    lines = ["# Host cost of offexec's CUDA calls, with the link idle and busy", "",
             f"Generated by `python -m experiments.offexec.issue_under_load --report {folder}` from "
             f"`issue_under_load.json`; do not edit by hand. Measured by `{prov['command']}` at commit "
             f"{prov['commit']}, {prov['date']}, on {prov.get('gpu', '?')} (torch {prov.get('torch', '?')}). "
             "Microseconds of host time per call (median over rounds; cpu: the calling thread's CPU time). Load: "
             "another thread copying 512 MiB pinned blocks back to back "
             + ", ".join(f"{k} at {v:.1f} GB/s" for k, v in rate.items())
             + ("; gpu_busy: the calls launched behind a ~20 ms kernel on their stream" if "gpu_busy" in loads else "")
             + (f"; deep_queue: behind that kernel and {BACKLOG_KERNELS} small kernels queued after it"
                if "deep_queue" in loads else "")
             + ".", "",
             "| call | " + " | ".join(f"{ld} wall us | {ld} cpu us" for ld in loads) + " | "
             + " | ".join(f"{ld} / idle" for ld in loads[1:]) + " |",
             "| --- |" + " --- | --- |" * len(loads) + " --- |" * (len(loads) - 1)]
    ratios = {ld: [] for ld in loads[1:]}
    for name, r in res.items():
        if name.startswith("_"):
            continue
        cells = " | ".join(f"{r[ld]['wall_us']:.1f} | {r[ld]['cpu_us']:.1f}" for ld in loads)
        rs = []
        for ld in loads[1:]:
            x = r[ld]["wall_us"] / r["idle"]["wall_us"]
            rs.append(f"{x:.2f}")
            if name != "python_only":
                ratios[ld].append(x)
        lines.append(f"| {name} | {cells} | " + " | ".join(rs) + " |")
    lines += ["", "**What it says.** Over the CUDA calls (not `python_only`), the median ratio to the idle link is "
              + "; ".join(f"{ld}: {statistics.median(v):.2f} (range {min(v):.2f}-{max(v):.2f})"
                          for ld, v in ratios.items()) + ".", ""]
    text = "\n".join(lines)
    (folder / "README.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON to write (on a CUDA machine)")
    ap.add_argument("--calls", type=int, default=200, help="calls per round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per call and load (default: %(default)s)")
    ap.add_argument("--report", metavar="DIR", help="write DIR/README.md from DIR/issue_under_load.json")
    args = ap.parse_args(argv)
    if args.report:
        print(report(Path(args.report)))
        return 0
    if not args.out:
        ap.error("give --out FILE (measure, on a CUDA machine) or --report DIR")
    import torch

    if not torch.cuda.is_available():
        print("issue_under_load: needs a CUDA GPU (run it on the device machine); --report works anywhere",
              file=sys.stderr)
        return 2
    from offsim.core.provenance import provenance

    prov = provenance()
    prov.update({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "command": "python -m experiments.offexec.issue_under_load " + " ".join(argv or sys.argv[1:])})
    res = measure(args.calls, args.rounds)
    Path(args.out).write_text(json.dumps({"provenance": prov, "results": res}, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
