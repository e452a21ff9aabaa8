"""Pipeline parallelism in offexec: one process per GPU (a *rank*), each running its stage of the same plan, the
hidden states and token ids moving with ``torch.distributed`` send / recv (docs/architecture.md §7.1).

A plan over several GPUs (``Plan.stages``, built by ``offsim`` with ``num_stages`` > 1) holds every op of every
stage, each with its ``device``; the GPU-to-GPU copies are ``p2p`` ops, on the sender's device, naming the
receiver as ``peer``. Rank r runs ``stage_plan(plan, r)``: the ops of device r and the p2p ops it sends or
receives, in plan order, with the model cut to its stage's layers (renumbered from 0; the embedding and the head
keep their indices -1 and num_layers) -- a plan the single-GPU executor runs unchanged but for its p2p handlers
(``Executor._op_send_hidden`` and the rest; a p2p op whose peer is this rank receives, any other sends). Sends are
non-blocking (``isend``, at most two outstanding); receives block. Every rank walks its ops in plan order and a receive's
send comes earlier in plan order on its sender, so the ranks cannot deadlock: the first op in plan order that any
rank is blocked on would be a receive whose send its sender has already posted.

Each p2p message is tagged with the op's id in the whole plan (gloo matches tags; NCCL matches in order, which plan
order makes the same on both sides). Timing: every rank times its ops from a barrier-aligned start; rank 0 gathers
them into one trace of the whole plan in offsim's schema, with a ``device`` column (a p2p op from its send's start
to its receive's end).

Launch: ``torchrun --nproc-per-node N -m offexec.distributed --plan PLAN.json [--device cuda|cpu] [--trace F]``
(NCCL on GPUs, each rank on GPU ``LOCAL_RANK``; gloo on the CPU), or, in tests, ``run_pipeline`` under
``torch.multiprocessing.spawn``. ``--one-gpu``: a rehearsal on a machine with one GPU -- every rank on GPU 0 within
its own budget, the messages through host memory over gloo -- that checks each stage's memory and the tokens, not
the times of a run on several GPUs.

Weights: the launcher loads (or seeds) only the rank's layers (``random_weights`` / ``load_checkpoint`` with
``layers``: host memory is shared by the ranks); ``run_pipeline`` also takes the whole model's and copies the
stage's rows out. What is not done yet: every rank keeps its own copy of the embeddings on its GPU (the footprint
counts them on every stage); the stream scheduler on the CPU (``threaded``) is refused for a stage; one host only
(ranks' clocks are compared).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.io import finite_json, write_text_atomic
from offsim.core.plan import Op, Plan
from offsim.core.trace import Trace
from offsim.policies import load_plan
from offsim.policies.schedule import stage_model

from . import model as M
from .executor import Executor, RunResult, check_host_memory, check_one_host, disk_need, gpu_need, host_need
from .memory import ExecError, check_disk_dir, check_gpu_budget, check_gpu_free, require_device
from .program import bind
from .weights import ModelWeights


@dataclasses.dataclass
class StagePlan:
    """Rank ``rank``'s share of a pipeline plan: ``plan`` (its ops renumbered 0..n-1, its stage's model and layers),
    ``orig_ids`` (each op's id in the whole plan) and ``layers`` [lo, hi) of the whole model."""

    plan: Plan
    orig_ids: list[int]
    layers: tuple[int, int]
    rank: int


def stage_plan(plan: Plan, rank: int) -> StagePlan:
    """The plan that rank ``rank`` runs (see the module docstring); ``ExecError`` for a rank the plan lacks."""
    check_one_host(plan)
    if not plan.stages:
        raise ExecError("the plan has no pipeline stages: run it with `offexec run` (one process)")
    if not 0 <= rank < len(plan.stages):
        raise ExecError(f"rank {rank}: the plan has {len(plan.stages)} stages (run one process per stage)")
    lo, hi = plan.stages[rank]["layers"]
    L = plan.model.num_layers
    keep: dict[int, int] = {}
    ops: list[Op] = []
    orig: list[int] = []
    for op in plan.ops:
        mine = op.device == rank if op.kind != "p2p" else rank in (op.device, op.peer)
        if not mine:
            continue
        new_id = len(ops)
        keep[op.id] = new_id
        recv = op.kind == "p2p" and op.peer == rank
        # a receive waits for its message, not for the sender's ops; any other op's dependencies are on this rank
        deps = () if recv else tuple(keep[d] for d in op.deps if d in keep)
        if not recv and len(deps) != len(op.deps):
            missing = [d for d in op.deps if d not in keep]
            raise ExecError(f"{op.describe()}: depends on ops {missing} of another GPU other than through a p2p op")
        layer = op.layer if op.layer < 0 else (hi - lo if op.layer >= L else op.layer - lo)
        kw = {f: v for f, v in op.__dict__.items() if f not in ("id", "kind", "deps", "phase", "step", "layer",
                                                              "batch", "stream")}
        ops.append(Op(new_id, op.kind, deps, op.phase, op.step, layer, op.batch, op.stream, **kw))
        orig.append(op.id)
    st = plan.stages[rank]
    sp = Plan(model=stage_model(plan.model, lo, hi), workload=plan.workload, policy=plan.policy,
              settings=plan.settings, capacity={**plan.capacity, "gpu": int(st["gpu_capacity"])},
              resident={**plan.resident, "gpu": int(st["gpu_resident"])},
              weight_split=list(plan.weight_split[lo:hi]), kv_split=plan.kv_split, hidden_home=plan.hidden_home,
              ops=ops, derived=plan.derived, disk_cached=plan.disk_cached, cuda_graphs=plan.cuda_graphs,
              graph_max_q_tokens=plan.graph_max_q_tokens, graph_min_uses=plan.graph_min_uses,
              graph_attention=plan.graph_attention)
    return StagePlan(sp, orig, (lo, hi), rank)


def stage_weights(weights: ModelWeights, lo: int, hi: int) -> ModelWeights:
    """The weights of decoder layers [lo, hi) (a copy of those rows of the host master) and the embeddings."""
    w = ModelWeights(stage_model(weights.spec, lo, hi), weights.dtype)
    w.layers.copy_(weights.layers[lo:hi])
    w.emb = weights.emb
    w.source = weights.source
    return w


class StageComm:
    """One rank's sends and receives: ``torch.distributed`` point-to-point, each message tagged with its op's id in
    the whole plan. Sends are non-blocking; at most ``SENDS_IN_FLIGHT`` are outstanding: an older one is waited for
    first (with NCCL the issuing stream waits, not the host), which releases its tensor. Kept until the end, every
    prefill send's hidden state (16 x 512 tokens of OPT-30B: 112 MiB each) stayed allocated beyond the plan's bytes
    and the first two-GPU run ran out of its 16 GiB. Plan order on every rank makes the wait safe: the receive of an
    older send comes earlier on its receiver than anything that receiver waits for from this rank."""

    SENDS_IN_FLIGHT = fp.P2P_SENDS_IN_FLIGHT  # one number for the plan's bytes and the runtime

    def __init__(self, rank: int, orig_ids: list[int], via_host: bool = False):
        self.rank = rank
        self.orig_ids = orig_ids
        self.via_host = via_host  # messages through host memory (gloo): the one-GPU rehearsal (``--one-gpu``)
        self.pending: list = []

    def send(self, op, tensor: torch.Tensor) -> None:
        while len(self.pending) >= self.SENDS_IN_FLIGHT:
            self.pending.pop(0)[0].wait()
        if self.via_host:
            tensor = tensor.cpu()
        self.pending.append((dist.isend(tensor, dst=op.peer, tag=self.orig_ids[op.id]), tensor))

    def recv(self, op, out: torch.Tensor) -> None:
        if self.via_host and out.device.type != "cpu":
            buf = torch.empty(out.shape, dtype=out.dtype)
            dist.recv(buf, src=op.device, tag=self.orig_ids[op.id])
            out.copy_(buf)
            return
        dist.recv(out, src=op.device, tag=self.orig_ids[op.id])

    def ready(self) -> None:
        """Called by the executor after its setup, before its first op: every rank waits for the others, so that
        their times count from one instant."""
        dist.barrier()

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def check_pipeline(plan: Plan, device: str, disk_dir: str | None = None, one_gpu: bool = False) -> list[dict]:
    """``executor.check_plan`` for a plan over several GPUs, before the process group, the weights or any buffer:
    each stage's GPU bytes within its own budget, and what the ranks share summed over the stages -- host memory
    (the ranks of one host hold every stage's weights and host KV together), the disk tier's room, and with
    ``one_gpu`` (the rehearsal: every rank on GPU 0) GPU 0's free memory. Each refusal is one line with sizes in
    GiB. Returns each stage's GPU bytes by purpose."""
    cuda = require_device(device).type == "cuda"
    needs, host, disk = [], {}, 0
    for r in range(len(plan.stages)):
        sp = stage_plan(plan, r).plan
        prog = bind(sp, M.layer_layout(sp.model), r)
        need = gpu_need(prog, sp)
        if cuda:
            try:
                check_gpu_budget(need, int(sp.capacity["gpu"]))
            except ExecError as e:
                raise ExecError(f"stage {r}: {e}") from None
        needs.append(need)
        for k, v in host_need(prog, sp).items():
            host[k] = host.get(k, 0) + v
        disk += disk_need(sp)
    n = len(plan.stages)
    check_host_memory(host, cuda and all(o.pinned for o in plan.ops), f"the plan (its {n} stages together)")
    if disk:
        check_disk_dir(disk_dir, disk, plan.disk_cached)
    if one_gpu and cuda:
        check_gpu_free(sum(sum(nd.values()) for nd in needs), "cuda:0",
                       f"the rehearsal (all {n} stages on GPU 0, together)")
    return needs


def run_stage(plan: Plan, weights: ModelWeights, rank: int, device: str = "cpu", prompts: torch.Tensor | None = None,
              seed: int = 0, record_logits: bool = False, disk_dir: str | None = None,
              graphs: str | None = None, via_host: bool = False) -> tuple[StagePlan, RunResult]:
    """Run rank ``rank``'s stage of ``plan`` (the process group must be initialised, one rank per stage). Returns
    (its stage plan, its RunResult); the times in its trace count from a barrier every rank passes after its setup,
    just before its first op (``StageComm.ready``)."""
    check_one_host(plan)
    if dist.get_world_size() != len(plan.stages):
        raise ExecError(f"the plan has {len(plan.stages)} stages but {dist.get_world_size()} processes run it "
                        "(one per stage)")
    sp = stage_plan(plan, rank)
    # the whole model's weights (this stage's rows are copied out) or already only this stage's
    # (``random_weights`` / ``load_checkpoint`` with ``layers``)
    if weights.spec.num_layers == plan.model.num_layers:
        w = stage_weights(weights, *sp.layers)
    elif weights.spec.num_layers == sp.plan.model.num_layers:
        w = weights
    else:
        raise ExecError(f"rank {rank}: weights of {weights.spec.num_layers} layers, neither the model's "
                        f"{plan.model.num_layers} nor the stage's {sp.plan.model.num_layers}")
    ex = Executor(sp.plan, w, device, prompts, seed, None, disk_dir, record_logits, False, False, "plan", graphs,
                  comm=StageComm(rank, sp.orig_ids, via_host))
    try:
        res = ex.run({"rank": rank, "stage_layers": list(sp.layers)})
    finally:
        ex.close()
    return sp, res


def merge_traces(plan: Plan, parts: list[tuple[list[int], np.ndarray, np.ndarray, dict]], meta: dict) -> Trace:
    """One trace of the whole plan from every rank's (orig_ids, start, end, peak bytes): each op's times from the
    rank that ran it; a p2p op from its send's start to the later of the send's and the receive's ends. Peaks: each
    GPU's as ``gpu{d}`` (``gpu`` the largest), host memory and disk summed over the ranks (one host)."""
    n = len(plan.ops)
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    ops = plan.ops
    for rank, (orig, s, e, _) in enumerate(parts):
        for i, oid in enumerate(orig):
            op = ops[oid]
            if op.kind == "p2p" and op.peer == rank:  # the receive: where the copy ends
                end[oid] = max(end[oid], e[i]) if not np.isnan(end[oid]) else e[i]
                if np.isnan(start[oid]):
                    start[oid] = s[i]
            elif op.kind == "p2p":  # the send: where it starts
                start[oid] = s[i]
                end[oid] = max(end[oid], e[i]) if not np.isnan(end[oid]) else e[i]
            else:
                start[oid], end[oid] = s[i], e[i]
    if np.isnan(start).any() or np.isnan(end).any():
        missing = int(np.isnan(start).sum() + np.isnan(end).sum())
        raise ExecError(f"merging the ranks' traces: {missing} op times missing (a rank ran a different plan?)")
    peaks = {f"gpu{d}": int(p[3].get("gpu", 0)) for d, p in enumerate(parts)}
    peaks["gpu"] = max(peaks.values())
    for t in ("cpu", "disk"):
        peaks[t] = int(sum(p[3].get(t, 0) for p in parts))
    return Trace.from_arrays(plan, start, end, {**meta, "num_devices": len(parts)}, peaks)


def run_pipeline(plan: Plan, weights: ModelWeights, device: str = "cpu", prompts: torch.Tensor | None = None,
                 seed: int = 0, record_logits: bool = False, disk_dir: str | None = None,
                 graphs: str | None = None, meta: dict | None = None, via_host: bool = False) -> RunResult | None:
    """Run this rank's stage and gather: rank 0 returns the whole run -- the merged trace (offsim's schema, one
    ``device`` per op), the generated tokens (from the last stage, which computes them), its logits when asked,
    and every rank's stats under ``stats['ranks']`` -- the other ranks return None."""
    rank = dist.get_rank()
    sp, res = run_stage(plan, weights, rank, device, prompts, seed, record_logits, disk_dir, graphs, via_host)
    df = res.trace.df
    mine = (sp.orig_ids, df["start_s"].to_numpy(), df["end_s"].to_numpy(), dict(res.trace.peak_bytes),
            res.tokens if rank == len(plan.stages) - 1 else None, res.logits, res.stats)
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return None
    last = parts[-1]
    m = {k: v for k, v in res.trace.meta.items() if k not in ("rank", "stage_layers")}
    m.update(meta or {})
    trace = merge_traces(plan, [p[:4] for p in parts], m)
    stats = {"ranks": [p[6] for p in parts], "wall_s": max(p[6]["wall_s"] for p in parts)}
    return RunResult(trace, last[4], stats, last[5] if record_logits else None)


def init_process_group(device: str, rank: int | None = None, world: int | None = None,
                       init_method: str | None = None, one_gpu: bool = False) -> str:
    """Join the process group: NCCL on GPUs (each rank on GPU ``LOCAL_RANK``), gloo on the CPU. Under torchrun the
    rank and world size come from the environment. ``one_gpu``: every rank on GPU 0, gloo (NCCL refuses two ranks
    on one GPU), the messages through host memory (``StageComm.via_host``). Returns the device of this rank."""
    backend = "nccl" if device.startswith("cuda") and not one_gpu else "gloo"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ExecError("--device cuda was asked but no CUDA device is available (use --device cpu)")
        local = 0 if one_gpu else int(os.environ.get("LOCAL_RANK", rank or 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    kw = {} if init_method is None else {"init_method": init_method, "rank": rank, "world_size": world}
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10), **kw)
    except ValueError as e:  # the environment torchrun sets is incomplete (MASTER_ADDR, MASTER_PORT, RANK)
        raise ExecError(f"cannot join the process group ({' '.join(str(e).split())}): launch with torchrun, "
                        "which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT") from None
    return device


def main(argv=None) -> int:
    """``torchrun --nproc-per-node N -m offexec.distributed --plan PLAN.json``: run a pipeline plan, one process
    per stage; rank 0 prints the measured throughput (and, as the last line, one JSON object) and writes the
    merged trace."""
    ap = argparse.ArgumentParser(prog="offexec.distributed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, metavar="FILE",
                    help="a plan with stages, written by `offsim simulate --num-gpus N --save-plan FILE`")
    ap.add_argument("--device", default="cuda", help="'cuda' (NCCL, GPU LOCAL_RANK per rank) or 'cpu' (gloo)")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="local transformers checkpoint instead of random weights")
    ap.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts (default: %(default)s)")
    ap.add_argument("--disk-dir", default=None, metavar="DIR", help="where each rank's disk tier goes")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="write the merged trace: .csv or .csv.gz (offsim's schema, with a device column) or "
                         "Chrome JSON")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the unmeasured warm-up (the whole plan once before the measured run: kernel loading, "
                         "NCCL's first connections, CUDA-graph captures)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="rank 0 writes the measured metrics, each rank's stats and provenance here (JSON)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="a rehearsal where only one GPU is lent: every rank on GPU 0, each within its own budget, "
                         "the hidden states through host memory (gloo). It checks that each stage runs within its "
                         "plan's memory, and its tokens; its times are not those of a run on several GPUs (the "
                         "stages share one GPU and one PCIe link), and the output says so")
    args = ap.parse_args(argv)
    try:
        from offsim.cli import check_output_path

        check_output_path(args.trace, "--trace")  # (before the run: its results are written after it)
        check_output_path(args.out, "--out")
        plan = load_plan(args.plan)
        check_one_host(plan)  # (before the process group, the weights or any buffer)
        if not plan.stages:
            raise OffsimError(f"{args.plan} has no pipeline stages: run it with `offexec run --plan`")
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise OffsimError(f"launch with torchrun, one process per stage: `torchrun --nproc-per-node "
                              f"{plan.num_devices} -m offexec.distributed --plan {args.plan}`")
        if not os.environ["WORLD_SIZE"].isdigit():
            raise OffsimError(f"WORLD_SIZE must be a number of processes, got {os.environ['WORLD_SIZE']!r}: launch "
                              "with torchrun")
        if int(os.environ["WORLD_SIZE"]) != len(plan.stages):  # (every rank says so: none indexes a missing stage)
            raise OffsimError(f"the plan has {len(plan.stages)} stages but {os.environ['WORLD_SIZE']} processes run "
                              f"it: `torchrun --nproc-per-node {len(plan.stages)} ...`")
        check_pipeline(plan, args.device, args.disk_dir, args.one_gpu)  # every rank, before anything is made
        device = init_process_group(args.device, one_gpu=args.one_gpu)
        from .weights import dtype_of, load_checkpoint, random_weights

        dt = dtype_of(plan.model)
        layers = tuple(plan.stages[dist.get_rank()]["layers"])  # this rank's layers only: host memory is shared
        pinned = device.startswith("cuda")  # page-locked: the weights' copies run at the link's pinned rate
        weights = load_checkpoint(args.checkpoint, plan.model, dt, progress=False, layers=layers, pinned=pinned) \
            if args.checkpoint else random_weights(plan.model, args.seed, dt, device=device, progress=False,
                                                   layers=layers, pinned=pinned)
        warmup_s = None
        if not args.no_warmup:  # unmeasured; every rank runs it, so the ranks stay in step
            t0 = time.perf_counter()
            run_pipeline(plan, weights, device, seed=args.seed, disk_dir=args.disk_dir, via_host=args.one_gpu)
            warmup_s = time.perf_counter() - t0
        res = run_pipeline(plan, weights, device, seed=args.seed, disk_dir=args.disk_dir,
                           meta={"warmup": warmup_s is not None, **({"one_gpu_rehearsal": True}
                                                                     if args.one_gpu else {})},
                           via_host=args.one_gpu)
    except OffsimError as e:  # ExecError too: one line, exit 2
        print(f"offexec.distributed: error: {e}", file=sys.stderr)
        if dist.is_initialized():  # (an error after joining the group: leave it, as the other ranks will)
            dist.destroy_process_group()
        return 2
    try:
        _report(args, plan, res, warmup_s, device)
    except OffsimError as e:  # a write that fails after the run (its paths were probed before it)
        print(f"offexec.distributed: error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _report(args, plan: Plan, res, warmup_s, device: str) -> None:
    """Rank 0's summary line, ``--trace`` and ``--out`` (the other ranks' ``res`` is None)."""
    if res is not None:
        m = finite_json(res.trace.metrics())  # (strict JSON: decode at gen-len 1 has no rate, null)
        if args.trace:
            res.trace.write(args.trace)  # (an OffsimError: its path was probed before the run, so rare)
        where = (f"{plan.num_devices} stages on one GPU (a rehearsal: memory and tokens; these times are not a "
                 f"{plan.num_devices}-GPU run's)" if args.one_gpu else f"{plan.num_devices} GPUs")
        def rate(x):
            return "n/a" if x is None else f"{x:.1f}"
        print(f"{plan.policy} on {where}: prefill {rate(m['prefill_tok_s'])} tok/s, decode "
              f"{rate(m['decode_tok_s'])} tok/s, total {rate(m['total_tok_s'])} tok/s")
        doc = {k: m[k] for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "prefill_s", "decode_s",
                                 "peak_gpu_bytes")} | {"peaks": res.trace.peak_bytes, "warmup_s": warmup_s,
                                                       "one_gpu_rehearsal": bool(args.one_gpu)}
        if args.out:
            from offsim.core.provenance import provenance

            full = {**doc, "plan": args.plan, "policy": plan.policy, "settings": plan.settings,
                    "workload": plan.workload.to_dict(), "num_gpus": plan.num_devices, "stages": plan.stages,
                    "ranks": res.stats["ranks"], "provenance": provenance(
                        gpu=torch.cuda.get_device_name(0) if device.startswith("cuda") else "")}
            write_text_atomic(args.out, json.dumps(finite_json(full), indent=1, default=str, allow_nan=False))
        print(json.dumps(finite_json(doc), default=str, allow_nan=False))


if __name__ == "__main__":
    sys.exit(main())
