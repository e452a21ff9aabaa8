"""What one eager call costs the issuing thread on the GPU machine (issue 14's host issue time).

TightLLM's eager layer ops cost the issuing thread 0.45 to 1.3 ms each in runs of the same plan
(results/offexec/runahead_*), a few dozen microseconds per kernel where a small kernel's launch costs 7-10 us. This
times, on the host (wall and thread CPU time, microseconds per call), the calls such an op makes at OPT-30B's
decode and recompute shapes -- ``F.linear`` with and without bias, the attention ``F.scaled_dot_product_attention``
with a lower-right causal mask, a KV row copy -- with the GPU idle and with the GPU busy far ahead (a long kernel
queued first, as in a run whose host is ahead of its GPU), with the link saturated in either direction by queued
pinned copies (as a link-bound run's weight stream keeps it), and how many launches the host can queue behind a busy
GPU before a launch blocks (the depth of CUDA's launch queue).

    python -m experiments.offexec.launch_cost [--out FILE.json]
    python -m experiments.offexec.launch_cost --report FILE.json [--about about.md]   # README.md beside it, no GPU

Run it once as is and once with ``DISABLE_ADDMM_CUDA_LT=1`` (PyTorch reads it once per process: linear with bias
through cuBLAS instead of cuBLASLt's fused bias epilogue, which asks cuBLASLt for an algorithm at every call).
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from experiments.common import argparser, provenance


class LinkLoad:
    """Pinned copies queued on a stream of their own, enough to keep one direction of the link saturated for
    ``seconds`` (at ~53 GB/s) while calls are timed -- as a run's weight stream keeps H2D busy 99 % of decode.
    Queued from the timing thread before the clock starts: no second host thread competes for the CPU or the GIL
    (``issue_under_load`` loaded the link from a thread of its own and reached 7 GB/s, not the run's 53)."""
    CHUNK = 256 << 20

    def __init__(self, direction: str):
        self.direction = direction
        self.host = torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(self.CHUNK, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()

    def start(self, seconds: float) -> None:
        n = max(1, int(seconds * 53e9 / self.CHUNK))
        with torch.cuda.stream(self.stream):
            for _ in range(n):
                if self.direction == "h2d":
                    self.dev.copy_(self.host, non_blocking=True)
                else:
                    self.host.copy_(self.dev, non_blocking=True)


def _time(fn, n: int, busy_s: float, load: LinkLoad | None = None) -> dict:
    """Host wall and CPU microseconds per call of ``fn`` over ``n`` calls; with ``busy_s`` > 0 a kernel of that
    length is queued first, so every call is issued behind a busy GPU; with ``load``, the link is kept saturated
    in its direction the whole time (``LinkLoad``)."""
    torch.cuda.synchronize()
    if load is not None:
        load.start(0.3)
    if busy_s:
        torch.cuda._sleep(int(busy_s * 2e9))  # ~2 GHz cycles
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    w1, c1 = time.perf_counter(), time.thread_time()
    torch.cuda.synchronize()
    return {"wall_us": (w1 - w0) / n * 1e6, "cpu_us": (c1 - c0) / n * 1e6}


def queue_depth(max_launches: int = 4096, busy_s: float = 2.0) -> dict:
    """Launch tiny kernels behind a long one and record when a launch first takes more than 1 ms of wall time:
    the launches CUDA queues before the host blocks."""
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(busy_s * 2e9))
    blocked_at, lat = None, []
    for i in range(max_launches):
        t = time.perf_counter()
        x.add_(1.0)
        dt = time.perf_counter() - t
        lat.append(dt)
        if dt > 1e-3 and blocked_at is None:
            blocked_at = i
            break
    torch.cuda.synchronize()
    lat_us = sorted(v * 1e6 for v in lat[:-1] or lat)
    return {"blocked_at_launch": blocked_at, "median_launch_us": lat_us[len(lat_us) // 2],
            "launches_tried": len(lat)}


def interleaved_rows(dev, dt, E: int, B: int) -> dict:
    """Calls as a run issues them: a linear on the compute stream after a switch from the copy streams and a wait
    on a copy's event (as ``Executor`` issues an op after its weights' H2D), against the same linear with no
    switch -- whether a stream switch or a cross-stream wait makes the launches after it dearer, which the
    single-stream rows above cannot show."""
    compute, h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    x = torch.randn(B, 254, E, device=dev, dtype=dt)
    w = torch.randn(E, E, device=dev, dtype=dt) * 0.02
    src = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    ev = torch.cuda.Event()

    def switched():
        torch.cuda.set_stream(h2d)
        dst.copy_(src, non_blocking=True)
        ev.record(h2d)
        torch.cuda.set_stream(compute)
        compute.wait_event(ev)
        F.linear(x, w)

    def same_stream():
        torch.cuda.set_stream(compute)
        dst.copy_(src, non_blocking=True)
        ev.record(compute)
        F.linear(x, w)

    return {"copy+wait+linear, 2 streams": switched, "copy+linear, 1 stream": same_stream}


def report(path: str, about: str | None = None) -> str:
    """README.md beside ``path`` (a JSON this script wrote): microseconds of host wall time per call in every
    condition measured, and each condition's ratio to the idle GPU and link (median and range over the calls)."""
    import statistics
    from pathlib import Path

    d = json.loads(Path(path).read_text())
    rows = d["rows"]
    conds = list(next(iter(rows.values())))
    prov = d["provenance"]
    out = [Path(about).read_text().rstrip() + "\n"] if about else []
    cmd = f"python -m experiments.offexec.launch_cost --report {path}" + (f" --about {about}" if about else "")
    out += [f"Generated by `{cmd}` from `{Path(path).name}` "
            f"(measured at commit {prov.get('commit')}, {prov.get('date')}: `{prov.get('command')}`); do not edit "
            f"by hand. Host wall microseconds per call, {d['calls']} calls per condition (thread CPU time: the "
            f"JSON).", "",
            "| call | " + " | ".join(conds) + " |", "| --- |" + " --- |" * len(conds)]
    out += [f"| {name} | " + " | ".join(f"{r[c]['wall_us']:.1f}" for c in conds) + " |" for name, r in rows.items()]
    out += ["", "| condition | median ratio to idle | min | max |", "| --- | --- | --- | --- |"]
    for c in conds[1:]:
        ratio = [r[c]["wall_us"] / r["idle"]["wall_us"] for r in rows.values()]
        out.append(f"| {c} | {statistics.median(ratio):.2f} | {min(ratio):.2f} | {max(ratio):.2f} |")
    if d.get("queue"):
        out += ["", f"Launch queue: the host first blocked at launch {d['queue']['blocked_at_launch']} behind a busy "
                f"GPU (median launch {d['queue']['median_launch_us']:.1f} us)."]
    readme = Path(path).parent / "README.md"
    readme.write_text("\n".join(out) + "\n")
    return str(readme)


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--report", default=None, metavar="JSON", help="no GPU: write README.md beside JSON (a file "
                    "this script wrote) from it, headed by --about")
    ap.add_argument("--about", default=None, help="with --report: a Markdown file whose text heads the README")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report, args.about))
        return 0
    dev, dt = torch.device("cuda"), torch.float16
    E, B = 7168, 16  # OPT-30B's hidden size, the 16-sequence GPU batch
    H, D = 56, 128
    w = torch.randn(E, E, device=dev, dtype=dt) * 0.02
    w4 = torch.randn(4 * E, E, device=dev, dtype=dt) * 0.02
    bias, bias4 = torch.zeros(E, device=dev, dtype=dt), torch.zeros(4 * E, device=dev, dtype=dt)
    rows = {}
    for q in (1, 8, 254):
        x = torch.randn(B, q, E, device=dev, dtype=dt)
        rows[f"linear_bias q={q}"] = lambda x=x: F.linear(x, w, bias)
        rows[f"linear q={q}"] = lambda x=x: F.linear(x, w)
        rows[f"fc1_bias q={q}"] = lambda x=x: F.linear(x, w4, bias4)
        rows[f"layer_norm q={q}"] = lambda x=x: F.layer_norm(x, (E,), bias, bias)
        C = 512 + q
        qq = torch.randn(B, H, q, D, device=dev, dtype=dt)
        kk = torch.randn(B, H, C, D, device=dev, dtype=dt)
        mask = None if q == 1 else causal_lower_right(q, C)
        rows[f"sdpa q={q} ctx={C}"] = lambda qq=qq, kk=kk, mask=mask: F.scaled_dot_product_attention(
            qq, kk, kk, attn_mask=mask)
        buf = torch.zeros(1024, 2, B, H, D, device=dev, dtype=dt)
        kn = torch.randn(B, q, H, D, device=dev, dtype=dt)
        rows[f"kv_row_copy q={q}"] = lambda buf=buf, kn=kn, q=q: buf[512:512 + q, 0].copy_(kn.transpose(0, 1))
    tiny = torch.zeros(16, device=dev)
    rows["add_ tiny"] = lambda: tiny.add_(1.0)
    rows.update(interleaved_rows(dev, dt, E, B))
    out = {"provenance": provenance(), "env": {"DISABLE_ADDMM_CUDA_LT": os.environ.get("DISABLE_ADDMM_CUDA_LT")},
           "calls": args.calls, "rows": {}}
    loads = {d: LinkLoad(d) for d in ("h2d", "d2h")}
    for name, fn in rows.items():
        for _ in range(5):
            fn()  # warm: kernels loaded, algorithms chosen
        r = out["rows"][name] = {"idle": _time(fn, args.calls, 0.0), "busy": _time(fn, args.calls, 1.0)}
        for d, load in loads.items():  # the link saturated while the calls are made (the GPU's compute idle)
            r[f"{d}_saturated"] = _time(fn, args.calls, 0.0, load)
        r["busy_h2d_saturated"] = _time(fn, args.calls, 1.0, loads["h2d"])  # as in a link-bound run, host ahead
        print(f"{name:28s} " + " | ".join(f"{k} {v['wall_us']:7.1f} us wall {v['cpu_us']:7.1f} cpu"
                                          for k, v in r.items()), flush=True)
    out["queue"] = queue_depth()
    print("launch queue:", out["queue"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
