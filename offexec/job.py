"""``offexec job SPEC``: an offline job (the spec of ``offsim job``, docs/jobs.md) run on the device, block after
block, with offsim's prediction of every block beside the measurement (docs/jobs.md §8).

One place for each thing: the spec, each policy's best settings, the blocks and the per-request arithmetic are
``offsim.search.job``'s (``load_job_spec``, ``best_for_job``, ``run_job``); this module only supplies how a block
runs -- ``run_plan`` of the block's own plan (each GPU batch at its padded prompt length, left padding, per-request
positions and masks) -- and reads the measured trace the way offsim reads a simulated one (``job.token_table``).

Per process: the weights are made (or loaded) once, a host KV pool is page-locked once, and each policy runs a
2-token warm-up of its first block once (kernels, GEMM algorithm choice, allocator growth), not one per block.
Request i's prompt ids are seeded from (seed, i) alone (``request_prompt``), so a request gets the same prompt in
any block, batching or policy, and its tokens can be checked against transformers' generation of it alone.

Resumable at block granularity: each measured block is appended to ``OUT/blocks.jsonl`` (its makespan, each batch's
token times, each request's tokens) under a key of the job, the policy, its settings, the block and the run's
device/dtype/seed; a rerun with the same ``--out`` skips blocks already there. At the end ``OUT`` holds
``job.json`` (provenance and per-policy summaries: measured and predicted), ``blocks.csv`` (per block: measured and
predicted seconds, error) and ``requests.csv`` (per request and policy: measured and predicted completion, tokens),
each CSV with the provenance on its first line.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from offsim.cli import add_runtime_args, apply_runtime_args, make_output_dir
from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.io import write_commented_csv, write_text_atomic
from offsim.core.provenance import provenance
from offsim.core.requests import Block
from offsim.core.specs import HARDWARE_PRESETS, Workload, get_hardware, get_model
from offsim.policies import POLICIES, build_plan
from offsim.search import job as J

from . import ALLOCATOR_CAPS, DEFAULT_ALLOCATOR_CAP

GiB = 1 << 30
# an unmeasured warm-up's steps (offexec run, job blocks): prefill and one decode step. The run's kernel shapes, but
# not all of them: its plan is built for these steps, so its KV buffers and the graphed decode attention over them
# are shorter than the measured run's (results/validation/calib_misses.md: the first decode op of the measured run)
WARMUP_GEN_LEN = 2
JOURNAL = "blocks.jsonl"
TRACES = "traces"  # --traces: each measured block's trace and plan, POLICY_blockI.{trace.csv,plan.json}.gz


class TimeLimit(Exception):
    """--time-limit-s passed between two blocks: the blocks measured so far are in the journal."""


def request_prompt(index: int, length: int, vocab: int, seed: int = 0):
    """Request ``index``'s prompt ids (int64 [length]): seeded from (seed, index) alone."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab, (length,), generator=g)


def block_prompts(blk: Block, lengths: dict[int, int], vocab: int, seed: int = 0):
    """The prompts ``run_plan`` takes for a block: [slots, the block's prompt_len], request r's ids in the first
    ``prompt_len`` columns of its slot's row; empty slots zero."""
    import torch

    wl = blk.workload
    out = torch.zeros((wl.num_prompts, wl.prompt_len), dtype=torch.long)
    for s, idx in enumerate(blk.slots):
        if idx is not None:
            out[s, :lengths[idx]] = request_prompt(idx, lengths[idx], vocab, seed)
    return out


def shortened(wl: Workload, steps: int) -> Workload:
    """``wl`` for its first ``steps`` steps (the warm-up)."""
    steps = min(steps, wl.gen_len)
    return wl.with_(gen_len=steps, gen_lens=tuple(min(g, steps) for g in wl.gen_lens))


def job_key(spec: J.JobSpec, requests, model_name: str, hw_name: str, budget: int, batching: str, device: str,
            dtype: str, seed: int, checkpoint: str | None) -> str:
    """What the measured blocks of a job depend on, hashed: a journal line is reused only under the same key."""
    d = {"model": model_name, "hardware": hw_name, "budget": budget, "batching": batching, "device": device,
         "dtype": dtype, "seed": seed, "checkpoint": checkpoint, "max_batch": spec.max_batch,
         "requests": [(r.index, r.prompt_len, r.gen_len) for r in requests]}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class Journal:
    """``OUT/blocks.jsonl``: one JSON line per measured block, appended as it finishes (a rerun resumes)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.lines: dict[tuple, dict] = {}
        if path is not None and path.exists():
            for n, ln in enumerate(path.read_text().splitlines(), 1):
                try:
                    d = json.loads(ln)
                    self.lines[(d["job"], d["policy"], d["settings_key"], d["block"])] = d
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by an interrupt: that block runs again

    def get(self, key: tuple) -> dict | None:
        return self.lines.get(key)

    def add(self, key: tuple, d: dict) -> None:
        self.lines[key] = d
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(d, default=_jsonable) + "\n")


REPLACED = "blocks.replaced.jsonl"


def retire_policies(path: Path, policies) -> int:
    """Move ``policies``' lines out of the journal ``path`` into ``REPLACED`` beside it (appended: nothing is lost), so
    that their blocks are measured again (``--remeasure``, e.g. after an executor change); the other policies' lines
    stay and resume. The journal is rewritten through a temporary file. Returns the lines moved."""
    if not path.exists():
        return 0
    keep, moved = [], []
    for ln in path.read_text().splitlines():
        try:
            pol = json.loads(ln).get("policy")
        except (json.JSONDecodeError, AttributeError):
            pol = None  # a line cut by an interrupt stays where it is (the journal skips it)
        (moved if pol in policies else keep).append(ln)
    if moved:
        with open(path.parent / REPLACED, "a") as f:
            f.write("".join(ln + "\n" for ln in moved))
        write_text_atomic(path, "".join(ln + "\n" for ln in keep))
    return len(moved)


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def settings_key(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, default=_jsonable)


BEST = "best.json"


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def saved_best(out: Path, key: str, policy: str):
    """The search result an earlier run of this job (``key``) used for ``policy`` (``OUT/best.json``), or None: a
    resumed job runs the blocks it started with, whatever this machine's free memory says now."""
    from offsim.search.search import SearchResult

    try:
        d = json.loads((out / BEST).read_text())[key][policy]
        wl = Workload(d["prompt_len"], d["gen_len"], d["gpu_batch_size"], d["num_gpu_batches"])
        return SearchResult(policy, {k: _tuples(v) for k, v in d["settings"].items()}, wl, {}, pd.DataFrame())
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def save_best(out: Path, key: str, best) -> None:
    try:
        d = json.loads((out / BEST).read_text())
    except (OSError, json.JSONDecodeError):
        d = {}
    wl = best.workload
    d.setdefault(key, {})[best.policy] = {"settings": best.settings, "prompt_len": wl.prompt_len,
                                          "gen_len": wl.gen_len, "gpu_batch_size": wl.gpu_batch_size,
                                          "num_gpu_batches": wl.num_gpu_batches}
    write_text_atomic(out / BEST, json.dumps(d, indent=1, default=_jsonable))


class DeviceJob:
    """The weights, the device and the budget, shared by every block of every policy of one ``offexec job``."""

    def __init__(self, args, spec: J.JobSpec, model, hw, requests, out: Path | None, comparable: bool = True):
        self.args, self.spec, self.model, self.hw, self.requests = args, spec, model, hw, requests
        self.comparable = comparable  # False: a CPU run against a GPU preset, no error is computed
        self.budget = int(hw.gpu_mem_bytes)
        self.device = args.device
        self.cuda = args.device == "cuda"
        self.lengths = {r.index: r.prompt_len for r in requests}
        self.gens = {r.index: r.gen_len for r in requests}
        self.weights = None
        self.kv_pool = None
        self.weights_s = None
        self.out = out
        self.journal = Journal(out / JOURNAL if out is not None else None)
        self.key = job_key(spec, requests, model.name, hw.name, self.budget, args.batching or spec.batching,
                           args.device, args.dtype_name, args.seed, args.checkpoint)
        self.prov = {}
        self.deadline = (time.monotonic() + args.time_limit_s) if args.time_limit_s else None

    # ---- the plan of a block, as ``offexec run`` builds it --------------------------------------------------------
    def plan(self, policy: str, wl: Workload, settings: dict):
        plan = build_plan(policy, self.model, self.hw, wl, settings)
        apply_runtime_args(self.args, plan)  # --disk-cache, --no-cuda-graphs, --run-ahead, as offexec run's
        return plan

    def check(self, plan, weights_loaded: bool) -> None:
        from .executor import check_plan, compression_of

        compression_of(plan)
        check_plan(plan, self.device, self.budget, self.args.disk_dir, weights_loaded=weights_loaded)

    def ensure_weights(self, kv_elems: int) -> None:
        """The weights (once per process) and a host KV pool of at least ``kv_elems`` elements (grown if needed)."""
        import torch

        from .memory import HostBuffer
        from .weights import load_checkpoint, random_weights

        dt = getattr(torch, self.args.dtype_name)
        if self.weights is None:
            t0 = time.perf_counter()
            if self.args.checkpoint:
                self.weights = load_checkpoint(self.args.checkpoint, self.model, dt, pinned=self.cuda,
                                               progress=not self.args.no_progress)
            else:
                self.weights = random_weights(self.model, self.args.seed, dt, device=self.device, pinned=self.cuda,
                                              progress=not self.args.no_progress)
            self.weights_s = time.perf_counter() - t0
            print(f"weights: {self.model.name} {self.weights.host.nbytes / GiB:.2f} GiB "
                  f"({self.weights.source}) ready in {self.weights_s:.1f} s", flush=True)
            self.prov = provenance(device=self.device,
                                   gpu=torch.cuda.get_device_name(self.device) if self.cuda else "")
        if kv_elems and (self.kv_pool is None or self.kv_pool.tensor.numel() < kv_elems):
            if self.kv_pool is not None:
                self.kv_pool.close()
            t0 = time.perf_counter()
            self.kv_pool = HostBuffer(kv_elems, self.weights.dtype, pinned=self.cuda)
            print(f"host KV pool: {self.kv_pool.nbytes / GiB:.2f} GiB in {time.perf_counter() - t0:.1f} s",
                  flush=True)

    def run(self, plan, prompts, meta: dict | None = None):
        from .executor import run_plan

        return run_plan(plan, self.weights, self.device, prompts=prompts, seed=self.args.seed,
                        gpu_budget_bytes=self.budget, disk_dir=self.args.disk_dir,
                        allocator_cap=self.args.allocator_cap, host_kv_pool=self.kv_pool, meta=meta)

    def tidy(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.kv_pool is not None:
            self.kv_pool.close()
        if self.weights is not None:
            self.weights.close()

    # ---- one policy -------------------------------------------------------------------------------------------
    def run_policy(self, policy: str, best, predicted: J.JobResult, batching: str, rows: list) -> J.JobResult:
        """Measure every block of ``policy``'s job (``run_job`` with a device block runner); ``rows`` gets one dict
        per block."""
        from offsim.core.requests import make_blocks

        from .executor import compression_of

        st = dict(best.settings)
        skey = settings_key(st)
        gbs, nb = best.workload.gpu_batch_size, best.workload.num_gpu_batches
        blocks = make_blocks(self.requests, gbs, nb, batching)
        todo = [i for i in range(len(blocks)) if self.journal.get((self.key, policy, skey, i)) is None]
        built = {}  # the first block's plan, checked before the weights are made: run as it is, not built again
        if todo and self.args.report_only:
            raise TimeLimit(f"{len(blocks) - len(todo)} of {len(blocks)} blocks measured in {self.journal.path} "
                            "(--report-only: nothing runs); the command without --report-only measures the rest")
        if todo:
            first = self.plan(policy, blocks[todo[0]].workload, st)
            if self.kv_pool is not None:  # page-locked for another policy: freed, so that the check sees the room
                self.kv_pool.close()
                self.kv_pool = None
            self.check(first, weights_loaded=self.weights is not None)
            built[todo[0]] = first
            # the host-homed KV heads (the same split in every block of one policy), at each block's full length
            kc = first.kv_split[1]
            kv = max(self.model.num_layers * b.workload.num_gpu_batches
                     * fp.kv_buffer_elems(self.model, b.workload.gpu_batch_size, b.workload.max_len, kc)
                     for b in blocks) if kc and not compression_of(first).cache else 0
            self.ensure_weights(kv)
            first = None
            if not self.args.no_warmup:  # once per policy: its first block for 2 tokens, unmeasured
                t0 = time.perf_counter()
                wblk = blocks[todo[0]]
                wl = shortened(wblk.workload, WARMUP_GEN_LEN)
                self.run(self.plan(policy, wl, st), block_prompts(wblk, self.lengths, self.model.vocab_size,
                                                                   self.args.seed))
                print(f"{policy}: warm-up (block {todo[0]} for {wl.gen_len} tokens) ran unmeasured in "
                      f"{time.perf_counter() - t0:.2f} s", flush=True)
                self.tidy()
        resumed = len(blocks) - len(todo)
        if resumed:
            print(f"{policy}: {resumed} of {len(blocks)} blocks already measured in {self.journal.path}: resumed",
                  flush=True)

        def run_block(i: int, blk: Block) -> J.BlockRun:
            key = (self.key, policy, skey, i)
            d = self.journal.get(key)
            wl = blk.workload
            if d is None and self.deadline is not None:
                # a block is not started unless offsim's prediction of it fits in the time left: a block cut off
                # by the caller's own limit (a device call's) is lost whole, measured for nothing
                left, need = self.deadline - time.monotonic(), float(predicted.block_s[i])
                if left < need:
                    done = sum(self.journal.get((self.key, policy, skey, k)) is not None
                               for k in range(len(blocks)))
                    why = ("reached" if left <= 0 else
                           f"leaves {left:.0f} s, less than block {i}'s predicted {need:.0f} s")
                    more = ("" if need < self.args.time_limit_s else
                            f"; block {i} alone is predicted to take {need:.0f} s: give --time-limit-s at least "
                            "that")
                    raise TimeLimit(f"--time-limit-s {self.args.time_limit_s:g} {why}: {done} of {len(blocks)} "
                                    f"blocks measured; the same command again resumes{more}")
            if d is None:
                plan = built.pop(i, None) or self.plan(policy, wl, st)
                meta = {"hardware": self.hw.name, "job": self.spec.name, "block": i, **self.prov}
                stem = self.out / TRACES / f"{policy}_block{i}" if self.args.traces and self.out else None
                if stem is not None:  # the plan beside its trace: `offsim validate` re-simulates exactly what ran
                    stem.parent.mkdir(exist_ok=True)
                    plan.save(stem.with_name(stem.name + ".plan.json.gz"))
                    meta["plan_file"] = stem.name + ".plan.json.gz"
                t0 = time.perf_counter()
                res = self.run(plan, block_prompts(blk, self.lengths, self.model.vocab_size, self.args.seed),
                               meta=meta)
                wall = time.perf_counter() - t0
                makespan, table = J.token_table(res.trace, wl)
                if stem is not None:
                    res.trace.to_csv(stem.with_name(stem.name + ".trace.csv.gz"))
                toks = {str(idx): res.tokens[s, :self.gens[idx]].tolist()
                        for s, idx in enumerate(blk.slots) if idx is not None}
                d = {"job": self.key, "policy": policy, "settings_key": skey, "block": i, "makespan_s": makespan,
                     "token_end_s": table.tolist(), "tokens": toks, "wall_s": wall, "ops": len(plan.ops),
                     "peak_gpu_bytes": int(res.trace.peak_bytes.get("gpu", 0)),
                     "issue_frac": res.stats.get("issue_frac"), "graphs": res.stats.get("graphs", {}).get("mode"),
                     # what explains a block's time without its trace: each stream's busy seconds, the host's
                     # issue time by handler
                     "busy_s": {r.kind: float(r.sum) for r in res.trace.busy_by(("kind",)).itertuples()},
                     "issue_s_by_handler": res.stats.get("issue_s_by_handler"),
                     "provenance": self.prov}
                self.journal.add(key, d)
                res = plan = None
                self.tidy()
            pred = predicted.block_s[i]
            meas = float(d["makespan_s"])
            rows.append({"policy": policy, "block": i, "requests": sum(s is not None for s in blk.slots),
                         "gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches,
                         "prompt_len": wl.prompt_len, "gen_len": wl.gen_len,
                         "batch_prompt_lens": " ".join(map(str, wl.batch_prompt_lens)),
                         "slot_tokens": wl.slot_tokens(), "measured_s": meas, "predicted_s": pred,
                         "error": _err(pred, meas) if self.comparable else None, "wall_s": d.get("wall_s"),
                         "peak_gpu_bytes": d.get("peak_gpu_bytes"), "ops": d.get("ops"),
                         "issue_frac": d.get("issue_frac"), "resumed": i not in todo,
                         "tokens": d["tokens"]})
            return J.BlockRun(meas, np.asarray(d["token_end_s"], dtype=float))

        return J.run_job(policy, self.model, self.hw, self.requests, batching, best=best, run_block=run_block,
                         progress=not self.args.no_progress, desc=f"offexec {policy}")


# ----------------------------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------------------------
def add_job_parser(sub) -> None:
    j = sub.add_parser(
        "job", help="an offline job (offsim job's spec) run on the device, block after block, beside offsim's "
                    "prediction",
        description="Run an offline job -- the spec of `offsim job` (YAML or JSON, docs/jobs.md): N requests with "
                    "their own prompt and output lengths -- with each policy of the spec at its best settings "
                    "(offsim's search), its blocks executed one after another by offexec (each block's own plan, "
                    "mixed-length batches left-padded), and offsim's prediction of each block beside the "
                    "measurement. Reports measured completion time, output tok/s, per-request completion "
                    "p50/p90/p99, padding waste and the prediction's error; writes job.json, blocks.csv and "
                    "requests.csv to --out (resumable: a rerun skips blocks already measured). Exit 2 with one "
                    "line for bad input, or when no policy can run the job.")
    j.add_argument("spec", help="job spec, .yaml/.yml or .json (schema offsim.job/1)")
    j.add_argument("--policies", nargs="+", metavar="POLICY",
                   help=f"subset of: {', '.join(POLICIES)} (default: the spec's)")
    j.add_argument("--batching", choices=("padded", "bucketed"), default=None,
                   help="padded (FlexGen: arrival order, each batch padded to its longest prompt) or bucketed "
                        "(sorted by length first); default: the spec's")
    j.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="run only the spec's first N requests (arrival order); the search and blocks use those")
    j.add_argument("--hardware", default=None,
                   help="override the spec's hardware: a preset or a profile JSON (e.g. what `offexec profile` "
                        "wrote on this machine); it prices the prediction and sets the plans")
    j.add_argument("--gpu-mem-gb", type=float, default=None, help="override the spec's GPU budget (GiB)")
    j.add_argument("--out", default=None, metavar="DIR",
                   help="write job.json, blocks.csv, requests.csv and the journal blocks.jsonl here (default: "
                        "offexec-job-<spec name>); a folder with an earlier run of the same job is resumed")
    j.add_argument("--device", default="cuda", help="'cuda' (default) or 'cpu' (sequential, for tests)")
    j.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                   help="weights and activations dtype (default: float16; float32 counts 4 bytes per element)")
    j.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="local transformers checkpoint of the spec's model instead of random weights")
    j.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts (default: %(default)s)")
    j.add_argument("--no-warmup", action="store_true",
                   help="skip each policy's unmeasured 2-token warm-up of its first block")
    j.add_argument("--allocator-cap", default=DEFAULT_ALLOCATOR_CAP, choices=ALLOCATOR_CAPS,
                   help="as `offexec run --allocator-cap` (default: %(default)s)")
    j.add_argument("--disk-dir", default=None, metavar="DIR", help="where the disk tier's files go")
    add_runtime_args(j, simulated=False)  # --disk-cache, --no-cuda-graphs, --run-ahead: as `offexec run`'s
    j.add_argument("--host-mem-gb", type=float, default=None, metavar="GB",
                   help="host memory (GiB) the searched plans may hold, offsim's cpu_mem (default on cuda: this "
                        "machine's MemAvailable minus the weights' host master copy -- offexec keeps every weight in "
                        "host memory, offsim counts only the CPU-homed ones -- never above the hardware's; on the "
                        "CPU: the hardware's)")
    j.add_argument("--time-limit-s", type=float, default=None, metavar="S",
                   help="start no block whose predicted time does not fit in what is left of S seconds (the "
                        "blocks measured are kept in the journal; the same command again resumes) -- for device "
                        "sessions with a time limit")
    j.add_argument("--remeasure", nargs="+", default=None, metavar="POLICY",
                   help="measure these policies' blocks again in a folder that has them (e.g. after an executor "
                        "change): their journal lines move to blocks.replaced.jsonl, the other policies resume; "
                        "their settings stay those the job started with (best.json)")
    j.add_argument("--report-only", action="store_true",
                   help="no device: write the report from the blocks already in --out's journal (e.g. copied back "
                        "from the GPU machine; give the --device they ran on); policies with blocks missing are "
                        "reported incomplete")
    j.add_argument("--exact", action="store_true",
                   help="offsim's prediction simulates every decode step of every block (default: the spec's "
                        "decode_steps, long blocks in pieces; docs/jobs.md §6)")
    j.add_argument("--traces", action="store_true",
                   help="also write each measured block's trace (offsim's trace schema) and plan to "
                        "--out/traces/POLICY_blockI.trace.csv.gz and .plan.json.gz: `offsim validate OUT/traces "
                        "--hardware PROFILE` compares them op by op with offsim's simulation")
    j.add_argument("--no-progress", action="store_true", help="no progress bar")
    j.set_defaults(func=cmd_job)


def host_memory_for_plans(hw, model, args):
    """``hw`` with the host memory the searched plans may use: ``--host-mem-gb``, or on cuda what this machine has
    available less the weights' host master (offexec holds every weight there; offsim's host tier counts only the
    CPU-homed share, so this is conservative by the GPU-resident share), never above ``hw``'s."""
    from .executor import _meminfo_available_bytes

    if args.host_mem_gb is not None:
        if not args.host_mem_gb > 0:
            raise OffsimError(f"--host-mem-gb must be positive, got {args.host_mem_gb}")
        cap = int(args.host_mem_gb * GiB)
    elif args.device == "cuda":
        avail = _meminfo_available_bytes()
        if avail is None:
            return hw
        cap = avail - model.weight_bytes()
        if cap <= 0:
            raise OffsimError(f"{model.name}'s weights ({model.weight_bytes() / GiB:.1f} GiB) do not fit this "
                              f"machine's available host memory ({avail / GiB:.1f} GiB)")
    else:
        return hw
    cap = min(cap, int(hw.cpu_mem_bytes))
    if cap != hw.cpu_mem_bytes:
        print(f"host memory for the plans: {cap / GiB:.1f} GiB (the hardware says {hw.cpu_mem_bytes / GiB:.1f}; "
              + ("--host-mem-gb" if args.host_mem_gb is not None else "available here, less the weights' host master")
              + ")", flush=True)
    return hw.with_(cpu_mem_bytes=cap)


def _pct(a) -> dict:
    v = np.percentile(np.asarray(a, dtype=float), J.PERCENTILES)
    return {f"p{p}": float(x) for p, x in zip(J.PERCENTILES, v)}


def _err(pred: float, meas: float):
    return (pred - meas) / meas if meas and math.isfinite(meas) and math.isfinite(pred) else None


def cmd_job(args) -> list[dict]:
    from offsim.cli import _print_json, _rank, _ranked_table, _short_reason

    spec = J.load_job_spec(args.spec)
    if args.max_requests is not None and args.max_requests <= 0:
        raise OffsimError(f"--max-requests must be a positive integer, got {args.max_requests}")
    if args.time_limit_s is not None and not args.time_limit_s > 0:
        raise OffsimError(f"--time-limit-s must be positive, got {args.time_limit_s}")
    requests = list(spec.requests[:args.max_requests] if args.max_requests else spec.requests)
    batching = args.batching or spec.batching
    decode_steps = None if args.exact else spec.decode_steps
    policies = args.policies or list(spec.policies)
    for pol in policies:
        if pol not in POLICIES:
            raise OffsimError(f"unknown policy {pol!r}; valid: {', '.join(POLICIES)}")
    if args.device not in ("cuda", "cpu"):
        raise OffsimError(f"--device must be 'cuda' or 'cpu', got {args.device!r}")
    if not args.report_only:
        from .memory import require_device

        require_device(args.device)
    hw_arg = args.hardware or spec.hardware
    hw = get_hardware(hw_arg, args.gpu_mem_gb if args.gpu_mem_gb is not None else spec.gpu_mem_gb)
    model = get_model(spec.model)
    args.dtype_name = args.dtype or "float16"
    if args.dtype_name == "float32":
        model = dataclasses.replace(model, dtype_bytes=4)
    if not args.report_only:
        hw = host_memory_for_plans(hw, model, args)
    comparable = args.device == "cuda" or str(hw_arg).lower() not in HARDWARE_PRESETS
    out = Path(args.out) if args.out else Path(f"offexec-job-{spec.name}")
    if out.exists() and not out.is_dir():
        raise OffsimError(f"--out {out} is a file; give a folder")
    if not out.parent.resolve().is_dir():
        raise OffsimError(f"--out {out}: folder {out.parent.resolve()} does not exist (create it first)")
    if args.remeasure:
        bad = [p for p in args.remeasure if p not in policies]
        if bad:
            raise OffsimError(f"--remeasure takes policies the job runs ({', '.join(policies)}), got {', '.join(bad)}")
        if args.report_only:
            raise OffsimError("--remeasure measures again: it does not go with --report-only")
    if args.report_only and not (out / JOURNAL).is_file():  # (it made the folder and wrote empty tables)
        raise OffsimError(f"--report-only reports the blocks measured in {out}, but it holds none ({out / JOURNAL} "
                          "does not exist): run the job without --report-only first, or give its --out")
    make_output_dir(out, "--out")
    if args.remeasure:
        n = retire_policies(out / JOURNAL, set(args.remeasure))
        print(f"--remeasure: {n} measured blocks of {', '.join(args.remeasure)} moved to {out / REPLACED}",
              file=sys.stderr)
    p_max, g_max = J.job_lengths(requests)
    print(f"offexec job {spec.name}: {len(requests)} requests from {spec.source} (seed {spec.seed}), prompts "
          f"{min(r.prompt_len for r in requests)}-{p_max} tokens, outputs {min(r.gen_len for r in requests)}-{g_max}; "
          f"{model.name} {args.dtype_name} on {args.device} (plans and prediction: {hw.name}, "
          f"{hw.gpu_mem_bytes / GiB:.1f} GiB GPU), {batching} batches; out {out}", flush=True)
    dev = DeviceJob(args, spec, model, hw, requests, out, comparable)
    summaries, block_rows, req_rows = [], [], []
    t_start = time.perf_counter()
    try:
        for pol in policies:
            if dev.deadline is not None and time.monotonic() > dev.deadline:
                msg = (f"--time-limit-s {args.time_limit_s:g} reached before it started; the same command again "
                       "runs it")
                print(f"{pol}: {msg}", flush=True)
                summaries.append({"model": model.name, "hardware": hw.name, "policy": pol, "error": msg,
                                  "incomplete": True})
                continue
            try:
                best = saved_best(out, dev.key, pol)
                if best is None:
                    if args.report_only:
                        raise TimeLimit(f"no block measured in {out} (--report-only: nothing runs)")
                    best = J.best_for_job(pol, model, hw, requests, spec.max_sims, spec.max_batch,
                                          spec.decode_steps)
                    save_best(out, dev.key, best)
                else:
                    print(f"{pol}: the settings of the earlier run in {out / BEST}: {best.settings}, "
                          f"{best.workload.gpu_batch_size} x {best.workload.num_gpu_batches}", flush=True)
                pred = J.run_job(pol, model, hw, requests, batching, best=best, decode_steps=decode_steps)
                rows: list = []
                meas = dev.run_policy(pol, best, pred, batching, rows)
            except TimeLimit as e:
                print(f"{pol}: {e}", flush=True)
                summaries.append({"model": model.name, "hardware": hw.name, "policy": pol, "error": str(e),
                                  "incomplete": True})
                continue
            except OffsimError as e:
                print(f"{pol}: cannot run: {_short_reason(pol, str(e))}", flush=True)
                summaries.append({"model": model.name, "hardware": hw.name, "policy": pol, "error": str(e)})
                continue
            except (RuntimeError, MemoryError) as e:  # the device failed mid-job (out of memory, a CUDA error):
                # the other policies still run; the blocks measured so far stay in the journal
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"{pol}: failed on the device: {msg}", flush=True)
                summaries.append({"model": model.name, "hardware": hw.name, "policy": pol, "error": msg})
                dev.tidy()
                continue
            block_rows += [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
            toks = {k: v for r in rows for k, v in r["tokens"].items()}
            for i, r in enumerate(requests):
                req_rows.append({"policy": pol, "request": r.index, "prompt_len": r.prompt_len, "gen_len": r.gen_len,
                                 "measured_done_s": float(meas.request_done_s[i]),
                                 "predicted_done_s": float(pred.request_done_s[i]),
                                 "tokens": " ".join(map(str, toks.get(str(r.index), [])))})
            ms, ps = meas.summary(), pred.summary()
            m_pct, p_pct = _pct(meas.request_done_s), _pct(pred.request_done_s)
            summ = {"model": model.name, "hardware": hw.name, "job": spec.name, "source": spec.source,
                    "seed": spec.seed, **{k: ms[k] for k in ms if k not in ("wall_s", "decode_steps",
                                                                              "distinct_blocks")},
                    "predicted_completion_s": pred.completion_s,
                    "completion_error": _err(pred.completion_s, meas.completion_s) if comparable else None,
                    "predicted_output_tok_s": ps["output_tok_s"],
                    **{f"predicted_{k}_request_s": v for k, v in p_pct.items()},
                    **{f"{k}_request_error": _err(p_pct[k], m_pct[k]) if comparable else None for k in m_pct},
                    "block_error_max": max((abs(r["error"]) for r in rows if r["error"] is not None),
                                           default=None),
                    "comparable": comparable, "decode_steps_predicted": decode_steps,
                    "resumed_blocks": sum(r["resumed"] for r in rows), "wall_s": meas.wall_s}
            summaries.append(summ)
            e = summ["completion_error"]
            print(f"{pol}: measured {meas.completion_s:,.2f} s for {meas.blocks} blocks"
                  + (f", offsim {pred.completion_s:,.2f} s ({e:+.1%})" if e is not None else
                     f" (offsim {pred.completion_s:,.2f} s: not comparable, a CPU run against a GPU preset)"),
                  flush=True)
    finally:
        dev.close()
    feasible = _rank(summaries, lambda o: o["completion_s"])
    if not feasible and not all(o.get("incomplete") for o in summaries):
        # refused before a block ran (the budget, the checkpoint): the folder's tables from an earlier run stay
        raise OffsimError(f"no policy could run job {spec.name} ({model.name} on {args.device}): " + "; ".join(
            f"{o['policy']}: {_short_reason(o['policy'], o['error'])}" for o in summaries))
    measured_on = sorted({json.dumps(d.get("provenance", {}).get("gpu") or d.get("provenance", {}).get("device"))
                          for d in dev.journal.lines.values() if d.get("job") == dev.key})
    prov = {**(dev.prov or provenance(device=args.device)), "spec": str(args.spec), "job_key": dev.key,
            "blocks_measured_on": [json.loads(x) for x in measured_on], "report_only": bool(args.report_only)}
    write_commented_csv(out / "blocks.csv", {"schema": "offexec.job_blocks/1", "provenance": prov},
                        pd.DataFrame(block_rows))
    write_commented_csv(out / "requests.csv", {"schema": "offexec.job_requests/1", "provenance": prov},
                        pd.DataFrame(req_rows))
    doc = {"schema": "offexec.job/1", "job": spec.name, "model": model.name, "hardware": hw.name,
           "gpu_mem_bytes": int(hw.gpu_mem_bytes), "device": args.device, "dtype": args.dtype_name,
           "batching": batching, "requests": len(requests), "source": spec.source, "comparable": comparable,
           "wall_s": time.perf_counter() - t_start, "weights_s": dev.weights_s, "policies": summaries,
           "provenance": prov}
    write_text_atomic(out / "job.json", json.dumps(doc, indent=1, default=_jsonable))
    print(f"\n{spec.name}: measured on {args.device}, shortest job first (*); p50/p90/p99: when a request's last "
          f"token came, from the job's start; offsim's prediction beside (error = predicted / measured - 1):")
    if feasible:
        print(_ranked_table(summaries, lambda o: {
            "blocks": o["blocks"], "completion_s": o["completion_s"], "offsim_s": o["predicted_completion_s"],
            "error": "n/a" if o["completion_error"] is None else f"{o['completion_error']:+.1%}",
            "output_tok_s": o["output_tok_s"], "p50_s": o["p50_request_s"], "p90_s": o["p90_request_s"],
            "p99_s": o["p99_request_s"], "padding": f"{o['padding_waste']:.1%}"}))
    print(f"wrote {out / 'job.json'}, {out / 'blocks.csv'}, {out / 'requests.csv'}")
    _print_json(summaries)
    return summaries  # (none feasible here: the time limit came first; the same command resumes)
