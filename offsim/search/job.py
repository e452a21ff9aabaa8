"""Offline jobs (``offsim job SPEC``; docs/jobs.md): N requests of mixed lengths run by one policy at its best, block
after block, and what a job owner asks -- when is it done, how fast, how long did each request wait, how much of
the work was padding.

- ``load_job_spec`` reads a YAML or JSON spec (schema ``offsim.job/1``): model, hardware, GPU budget, policies,
  requests (a named length distribution of ``offsim.core.requests.TASKS`` or a CSV of lengths, a count and a
  seed), batching (``padded`` or ``bucketed``). Every problem is one OffsimError naming the key.
- ``run_job`` finds the policy's best settings and block shape with ``offsim search`` at the job's longest prompt
  and generation (so that every block fits: a block padded to less needs no more memory; where prompts differ, a
  padded batch's key mask is reserved), cuts the requests into blocks (``requests.make_blocks``), simulates each
  block's own plan -- each GPU batch at its padded length -- one after another, and reads each request's
  completion from the trace: the end of the step that produced its last token. Blocks of identical shape are
  simulated once; a long block is simulated in pieces by default, the rest of its steps interpolated
  (``simulate_block``; ``decode_steps`` None: every step).

Numbers (``JobResult.summary``): ``completion_s`` (the job's makespan: its blocks back to back), ``output_tok_s``
(generated tokens of the requests / completion_s), ``requests_per_s``, per-request completion times within the
job at p50/p90/p99, and ``padding_waste``: the share of the token positions computed that are padding, 1 - the
requests' own prompt and generated tokens / every slot's padded prompt and all the block's steps
(``Workload.slot_tokens``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from offsim.core.errors import OffsimError
from offsim.core.io import read_spec
from offsim.core.requests import BATCHING, TASKS, Block, Request, draw_requests, make_blocks, read_requests_csv, \
    sample_requests
from offsim.core.sim import simulate
from offsim.core.specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from offsim.policies import DEFAULT_POLICIES, POLICIES, build_plan
from offsim.policies.registry import check_plan_fits, same_placement
from offsim.search.grid import check_gpu_mem_gb, check_spec_keys
from offsim.search.search import SearchResult, search

SCHEMA = "offsim.job/1"
SPEC_KEYS = ("schema", "name", "model", "hardware", "gpu_mem_gb", "policies", "requests", "batching", "max_batch",
             "max_sims", "decode_steps")
DECODE_STEPS = 16  # decode steps of a block simulated by default (``simulate_block``); null in a spec: all
REQUEST_KEYS = ("count", "seed", "distribution", "csv")
PERCENTILES = (50, 90, 99)


# ----------------------------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobSpec:
    name: str
    model: str
    hardware: str
    gpu_mem_gb: float | None
    policies: tuple[str, ...]
    requests: tuple[Request, ...]
    source: str  # where the lengths came from: the distribution's name, or the CSV's path
    seed: int
    batching: str = "padded"
    max_batch: int | None = None
    max_sims: int = 3
    decode_steps: int | None = DECODE_STEPS  # None: every step simulated


def load_job_spec(path: str | Path) -> JobSpec:
    """The spec in ``path`` (.yaml/.yml: YAML, else JSON), checked (``parse_job_spec``); a CSV it names is read
    relative to the spec's folder."""
    return parse_job_spec(read_spec(path, "job spec"), where=f"job spec {path}", base=Path(path).parent)


def _positive_int(where: str, key: str, v: Any, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise OffsimError(f"{where}: {key} must be a positive integer{' or null' if allow_none else ''}, got {v!r}")
    return v


def parse_job_spec(d: Any, where: str = "job spec", base: Path = Path(".")) -> JobSpec:
    """Check a spec dict and draw its requests. Keys: ``model``, ``hardware`` (required), ``gpu_mem_gb``,
    ``policies`` (a list, a name, or ``all``; default all), ``requests`` {``count``, ``seed`` (default 0), one of
    ``distribution`` (a name in ``TASKS``) or ``csv`` (a file of ``prompt_len,gen_len`` rows; without ``count``
    the file's requests as listed, with it ``count`` drawn from them)}, ``batching`` (``padded`` or ``bucketed``),
    ``max_batch``, ``max_sims``, ``decode_steps`` (default ``DECODE_STEPS``; null: every step simulated)."""
    check_spec_keys(d, where, SPEC_KEYS, SCHEMA, "model, hardware and requests")
    for k in ("model", "hardware", "requests"):
        if k not in d:
            raise OffsimError(f"{where}: '{k}' is required")
    for k in ("model", "hardware"):
        if not isinstance(d[k], str):
            raise OffsimError(f"{where}: {k} takes a name or a file path, got {d[k]!r}")
    gpu_mem_gb = d.get("gpu_mem_gb")
    check_gpu_mem_gb(where, "gpu_mem_gb", gpu_mem_gb)
    pols = d.get("policies", "all")
    pols = list(DEFAULT_POLICIES) if pols == "all" else ([pols] if isinstance(pols, str) else pols)
    if not isinstance(pols, list) or not pols:
        raise OffsimError(f"{where}: policies takes a list of names or 'all'")
    for p in pols:
        if not isinstance(p, str) or p not in POLICIES:
            raise OffsimError(f"{where}: unknown policy {p!r}; valid: {', '.join(POLICIES)} (or 'all')")
    pols = list(dict.fromkeys(pols))  # (a policy listed twice runs once)
    batching = d.get("batching", "padded")
    if batching not in BATCHING:
        raise OffsimError(f"{where}: batching must be one of {BATCHING}, got {batching!r}")
    r = d["requests"]
    if not isinstance(r, dict):
        raise OffsimError(f"{where}: requests must be a mapping with count and distribution (or csv)")
    bad = set(r) - set(REQUEST_KEYS)
    if bad:
        raise OffsimError(f"{where}: unknown keys {sorted(bad)} in requests; valid: {list(REQUEST_KEYS)}")
    if ("distribution" in r) == ("csv" in r):
        raise OffsimError(f"{where}: requests takes one of 'distribution' ({', '.join(TASKS)}) or 'csv'")
    seed = r.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise OffsimError(f"{where}: requests.seed must be an integer >= 0, got {seed!r}")
    try:
        if "distribution" in r:
            count = _positive_int(where, "requests.count", r.get("count"))
            reqs, source = draw_requests(r["distribution"], count, seed), str(r["distribution"])
        else:
            if not isinstance(r["csv"], str) or not r["csv"]:
                raise OffsimError(f"{where}: requests.csv takes the path of a CSV of prompt_len,gen_len (relative "
                                  f"to the spec), got {r['csv']!r}")
            csv_path = Path(r["csv"])
            csv_path = csv_path if csv_path.is_absolute() else base / csv_path
            reqs, source = read_requests_csv(csv_path), str(csv_path)
            if r.get("count") is not None:
                reqs = sample_requests(reqs, _positive_int(where, "requests.count", r["count"]), seed)
    except OffsimError as e:
        msg = str(e)
        raise OffsimError(msg if msg.startswith(f"{where}: ") else f"{where}: {msg}") from None
    max_batch = _positive_int(where, "max_batch", d.get("max_batch"), allow_none=True)
    max_sims = _positive_int(where, "max_sims", d.get("max_sims", 3))
    decode_steps = d.get("decode_steps", DECODE_STEPS)
    if decode_steps is not None and (isinstance(decode_steps, bool) or not isinstance(decode_steps, int)
                                     or decode_steps < 2):
        raise OffsimError(f"{where}: decode_steps must be an integer >= 2 or null (every step simulated), got "
                          f"{decode_steps!r}")
    spec = JobSpec(name=str(d.get("name") or "job"), model=d["model"], hardware=d["hardware"], gpu_mem_gb=gpu_mem_gb,
                   policies=tuple(pols), requests=tuple(reqs), source=source, seed=seed, batching=batching,
                   max_batch=max_batch, max_sims=max_sims, decode_steps=decode_steps)
    model = get_model(spec.model)
    get_hardware(spec.hardware, spec.gpu_mem_gb)  # both load, or one line
    longest = max(q.prompt_len + q.gen_len - 1 for q in spec.requests)
    if longest > model.max_positions:
        raise OffsimError(f"{where}: a request of {longest} tokens (prompt + gen - 1) exceeds {model.name}'s "
                          f"{model.max_positions} positions")
    return spec


# ----------------------------------------------------------------------------------------------------------------
# running a job
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class BlockRun:
    """A simulated block: its makespan and when each (step, GPU batch) produced its token (seconds from the block's
    start): ``token_end_s[i, k]`` is the end of the last compute of step i of batch k -- its LM head."""

    makespan_s: float
    token_end_s: np.ndarray


def block_key(wl: Workload) -> tuple:
    """What a block's plan depends on: its shape, its GPU batches' padded prompt lengths, and their mean lengths
    (TightLLM's estimate), to a token; blocks with the same key are simulated once."""
    means = tuple(wl.batch_mean_prompt_len(k) for k in range(wl.num_gpu_batches))
    return wl.gpu_batch_size, wl.num_gpu_batches, wl.gen_len, wl.batch_prompt_lens, means


PROBES = 4  # shortened blocks at later contexts sampled by ``simulate_block``'s fast mode
PROBE_DECODE_STEPS = 4  # decode steps of each (steps 2 and 3 are measured: see ``simulate_block``)


def _token_ends(policy: str, model: ModelSpec, hw: HardwareSpec, wl: Workload, settings: dict,
                probe: bool = False) -> tuple[float, np.ndarray]:
    """Simulate ``wl``'s plan: its makespan and ``[step, batch]`` -> end of that batch's last compute of the step.
    ``probe``: a timing instrument, not a plan anyone runs -- no memory checks (its prefill, at a longer prompt than
    the block's, may need more GPU memory than the block ever does; only its decode steps are read)."""
    plan = build_plan(policy, model, hw, wl, settings, validate=not probe, check_fits=not probe)
    return token_table(simulate(plan, hw, check_memory=not probe), wl)


def token_table(trace, wl: Workload) -> tuple[float, np.ndarray]:
    """A trace's makespan and ``[step, batch]`` -> end of that batch's last compute op of the step (its LM head):
    when each GPU batch produced its token of each step. A simulated and a measured trace (``offexec job``) are
    read the same way."""
    comp = trace.df[trace.df["kind"] == "compute"]
    ends = comp.groupby(["step", "batch"])["end_s"].max()
    table = np.zeros((wl.gen_len, wl.num_gpu_batches))
    table[ends.index.get_level_values(0).to_numpy(), ends.index.get_level_values(1).to_numpy()] = ends.to_numpy()
    return trace.makespan_s, table


def _shifted(wl: Workload, extra_tokens: int, steps: int) -> Workload:
    """``wl`` with every prompt ``extra_tokens`` longer and ``steps`` steps: its decode step i sees the context of
    ``wl``'s step ``extra_tokens + i``."""
    return wl.with_(prompt_len=wl.prompt_len + extra_tokens, gen_len=steps,
                    prompt_lens=tuple(p + extra_tokens if p else 0 for p in wl.prompt_lens),
                    gen_lens=tuple(min(g, steps) for g in wl.gen_lens))


def simulate_block(policy: str, model: ModelSpec, hw: HardwareSpec, wl: Workload, settings: dict,
                   decode_steps: int | None = None) -> BlockRun:
    """Build and simulate one block's plan; the end of each (step, batch)'s last compute op.

    ``decode_steps`` None: every step simulated (exact). An int K: a block of more than 2K decode steps is
    simulated in pieces of about 2K + 2 steps in all, and the rest interpolated:
    - the block itself, shortened to prefill and its first K/2 decode steps (+1: the last step of a shortened plan
      has no next step to prefetch for, so it is not used) -- its token times are exact;
    - ``PROBES`` probes: the block with every prompt longer by d tokens, d spread up to the block's last step, for
      ``PROBE_DECODE_STEPS`` decode steps: a probe's decode step i runs at the context of the block's step d + i;
    - a decode step's duration is interpolated (piecewise linear in the step index) between the steps measured
      (decode step 1 never: it overlaps prefill's tail), and each later step adds it to every batch's token time
      of the step before; what the shortened block ran after its last token (its last stores) is added at the end.
    A step's duration is the larger of what its streams carry, each growing with the context at its own rate (the
    weight stream not at all, the KV or CPU attention linearly), so it bends where the growing one overtakes: the
    probes see the bend, a line through the first steps would not. Against the exact simulation (OPT-30B on the
    rtx3090 and Llama-2-13B on the rtx3090, translation and summarisation blocks of 128-384 steps, the five
    policies at their best, K = 16): makespan within 0.4 %, every request's time within 1.7 %
    (``tests/test_jobs.py`` bounds it on a small case). The full block must fit its memory from
    arithmetic (``registry.check_plan_fits``); the memory check under the timing sees only the pieces. A policy
    whose placement depends on the lengths (Accelerate's GPU layers) has its blocks simulated whole: a shortened
    piece would be another plan."""
    G = wl.gen_len
    if decode_steps is not None and decode_steps < 2:
        raise OffsimError(f"decode_steps must be at least 2 or None (exact), got {decode_steps!r}")
    if decode_steps is None or G - 1 <= 2 * decode_steps:
        return BlockRun(*_token_ends(policy, model, hw, wl, settings))
    kept = max(2, decode_steps // 2)  # decode steps of the block simulated and kept: 1 .. kept
    last = G - 1 - PROBE_DECODE_STEPS + 1  # the last probe's steps 2, 3 are the block's G - 2, G - 1
    shifts = [round(kept + (last - kept) * j / PROBES) for j in range(1, PROBES + 1)]
    head_wl = _shifted(wl, 0, kept + 2)
    probes = [_shifted(wl, d, PROBE_DECODE_STEPS + 1) for d in shifts]
    if not same_placement(policy, model, hw, settings, wl, head_wl, *probes):
        # the policy places its weights and cache by the lengths (Accelerate's GPU layers make room for the KV of
        # the whole output): a shortened piece would be another plan, so this block is simulated whole
        return BlockRun(*_token_ends(policy, model, hw, wl, settings))
    check_plan_fits(policy, model, hw, wl, settings)  # the shortened pieces hold less KV than the block
    head_s, head = _token_ends(policy, model, hw, head_wl, settings)
    tail_s = head_s - head[kept + 1].max()  # after the shortened block's last token: its last stores
    table = np.zeros((G, wl.num_gpu_batches))
    table[:kept + 1] = head[:kept + 1]
    step_end = head[:kept + 1].max(axis=1)
    at, dur = list(range(2, kept + 1)), list(np.diff(step_end)[1:])  # decode steps 2 .. kept
    for shift, probe_wl in zip(shifts, probes):
        _, probe = _token_ends(policy, model, hw, probe_wl, settings, probe=True)
        pe = probe.max(axis=1)
        for i in (2, 3):
            at.append(shift + i)
            dur.append(pe[i] - pe[i - 1])
    order = np.argsort(at)
    at_sorted, dur_sorted = np.asarray(at)[order], np.asarray(dur)[order]
    for i in range(kept + 1, G):
        table[i] = table[i - 1] + max(float(np.interp(i, at_sorted, dur_sorted)), 0.0)
    return BlockRun(table[G - 1].max() + tail_s, table)


@dataclass
class JobResult:
    policy: str
    settings: dict
    gpu_batch_size: int  # the searched block shape (the last block may be smaller)
    num_gpu_batches: int
    batching: str
    num_requests: int
    blocks: int
    distinct_blocks: int  # blocks simulated (the rest had the shape of one already simulated)
    completion_s: float
    request_done_s: np.ndarray  # per request (job order): when its last token was produced, from the job's start
    prompt_tokens: int
    output_tokens: int
    slot_tokens: int  # token positions computed, padding included
    wall_s: float
    extra: dict = field(default_factory=dict)
    block_s: list = field(default_factory=list)  # each block's makespan, in job order (block i starts at their sum)

    @property
    def padding_waste(self) -> float:
        return 1.0 - (self.prompt_tokens + self.output_tokens) / self.slot_tokens

    def summary(self) -> dict:
        pct = np.percentile(self.request_done_s, PERCENTILES)
        return {**self.extra, "policy": self.policy, "settings": self.settings,
                "batch": self.gpu_batch_size * self.num_gpu_batches, "gpu_batch_size": self.gpu_batch_size,
                "num_gpu_batches": self.num_gpu_batches, "batching": self.batching, "requests": self.num_requests,
                "blocks": self.blocks, "distinct_blocks": self.distinct_blocks, "completion_s": self.completion_s,
                "output_tok_s": self.output_tokens / self.completion_s,
                "requests_per_s": self.num_requests / self.completion_s,
                **{f"p{p}_request_s": float(v) for p, v in zip(PERCENTILES, pct)},
                "mean_request_s": float(self.request_done_s.mean()), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "slot_tokens": self.slot_tokens,
                "padding_waste": self.padding_waste, "wall_s": self.wall_s}


def job_lengths(requests: Sequence[Request]) -> tuple[int, int]:
    """The longest prompt and the longest generation of a job: what its policies are searched at."""
    return max(r.prompt_len for r in requests), max(r.gen_len for r in requests)


def best_for_job(policy: str, model: ModelSpec, hw: HardwareSpec, requests: Sequence[Request], max_sims: int = 3,
                 max_batch: int | None = None, decode_steps: int | None = None) -> SearchResult:
    """``offsim search`` at the job's longest prompt and generation, at most ``max_batch`` and, where the policy has
    such candidates, no more sequences a block than the job has requests (a policy whose candidates are all larger
    -- TightLLM's come from FlexGen's LP shapes -- keeps its best shape; ``make_blocks`` then runs the job as one
    partly filled block with fewer GPU batches). ``decode_steps``: the search's last stage simulates that many
    decode steps of its best candidate, not all (``search(verify_decode_steps=...)``); None: all. Where the
    prompts differ in length a batch may be left-padded, and its ops then hold a key mask: the search reserves its
    memory at the longest lengths (``search(key_mask=True)``), so that every block fits in what it placed."""
    p, g = job_lengths(requests)
    mixed = len({r.prompt_len for r in requests}) > 1
    if max_batch is None or max_batch > len(requests):
        try:
            return search(policy, model, hw, p, g, max_sims=max_sims, max_batch=len(requests),
                          verify_decode_steps=decode_steps, key_mask=mixed)
        except OffsimError:
            pass
    return search(policy, model, hw, p, g, max_sims=max_sims, max_batch=max_batch, verify_decode_steps=decode_steps,
                  key_mask=mixed)


def run_job(policy: str, model: ModelSpec, hw: HardwareSpec, requests: Sequence[Request], batching: str = "padded",
            max_sims: int = 3, max_batch: int | None = None, progress: bool = False,
            best: SearchResult | None = None, cache: dict | None = None,
            decode_steps: int | None = None,
            run_block: Callable[[int, Block], BlockRun] | None = None, desc: str | None = None) -> JobResult:
    """Run the job's requests with ``policy`` at its best (``best``: a search result to reuse), block after block
    (module docstring). ``cache``: simulated blocks by (policy, settings, ``block_key``), shared across calls.
    ``decode_steps``: simulate at most that many decode steps of a block and extrapolate the rest
    (``simulate_block``); None: exact. ``run_block(i, block)``: how block i runs instead of simulating it -- every
    block, no cache (``offexec job`` measures each on the device); the blocks, the per-request times and the numbers
    are the same code either way."""
    t0 = time.perf_counter()
    if not requests:
        raise OffsimError("a job needs at least one request")
    best = best or best_for_job(policy, model, hw, requests, max_sims, max_batch, decode_steps)
    gbs, nb = best.workload.gpu_batch_size, best.workload.num_gpu_batches
    blocks = make_blocks(requests, gbs, nb, batching)
    cache = {} if cache is None else cache
    done = np.full(len(requests), math.nan)
    by_index = {r.index: i for i, r in enumerate(requests)}
    gen_of = {r.index: r.gen_len for r in requests}
    start_s, slot_tokens, simulated = 0.0, 0, 0
    block_s = []
    it = blocks
    if progress:
        from tqdm import tqdm

        it = tqdm(blocks, desc=desc or f"job {policy}", unit="block")
    for i, blk in enumerate(it):
        wl = blk.workload
        if run_block is not None:
            run = run_block(i, blk)
            simulated += 1
        else:
            key = (policy, model.name, hw.name, repr(sorted(best.settings.items())), decode_steps, block_key(wl))
            run = cache.get(key)
            if run is None:
                run = cache[key] = simulate_block(policy, model, hw, wl, best.settings, decode_steps)
                simulated += 1
        for slot, idx in enumerate(blk.slots):
            if idx is not None:
                done[by_index[idx]] = start_s + run.token_end_s[gen_of[idx] - 1, slot // wl.gpu_batch_size]
        start_s += run.makespan_s
        block_s.append(float(run.makespan_s))
        slot_tokens += wl.slot_tokens()
    return JobResult(policy=policy, settings=dict(best.settings), gpu_batch_size=gbs, num_gpu_batches=nb,
                     batching=batching, num_requests=len(requests), blocks=len(blocks), distinct_blocks=simulated,
                     completion_s=start_s, request_done_s=done,
                     prompt_tokens=sum(r.prompt_len for r in requests),
                     output_tokens=sum(r.gen_len for r in requests), slot_tokens=slot_tokens,
                     wall_s=time.perf_counter() - t0, extra={"decode_steps": decode_steps}, block_s=block_s)
