"""The search that keeps every policy at its best: each policy proposes candidates (``Policy.candidates``: settings
and a block shape, ranked by the policy's own model where it has one -- FlexGen's LP, TightLLM's estimate), the
search screens them by simulating a short plan and then simulates the full plan of the best, so what it returns is
the best *simulated* setting, not the best modelled one.
"""
from __future__ import annotations

import gc
import inspect
from dataclasses import dataclass
from typing import Any

import pandas as pd

from offsim.core import footprint as fp
from offsim.core.costmodel import network_bytes_per_s
from offsim.core.errors import OffsimError
from offsim.core.sim import simulate
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload
from offsim.core.trace import Trace
from offsim.policies import build_plan, get_policy
from offsim.policies.registry import check_plan_fits, same_placement
from offsim.policies.schedule import balanced_stages, check_gpus_per_node


@dataclass
class SearchResult:
    policy: str
    settings: dict[str, Any]
    workload: Workload
    metrics: dict[str, Any]
    candidates: pd.DataFrame  # every candidate evaluated (simulated or not), best first
    stages: tuple = ()  # a pipeline's decoder layers [lo, hi) per GPU (``num_gpus`` > 1); () on one GPU

    def best_by_compression(self) -> dict[str, float]:
        """The best screened total tok/s of each compression choice the search tried ('fp16', '4-bit cache', ...),
        best first: how much compression buys here."""
        out: dict[str, float] = {}
        for st, tok_s in zip(self.candidates["settings"], self.candidates.get("screen_total_tok_s", [])):
            if tok_s == tok_s:  # (NaN: not screened)
                label = Compression.from_settings(st).describe()
                out[label] = max(out.get(label, 0.0), float(tok_s))
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self) -> dict:
        out = {"policy": self.policy, "settings": self.settings, "gpu_batch_size": self.workload.gpu_batch_size,
               "num_gpu_batches": self.workload.num_gpu_batches, **{k: self.metrics[k] for k in (
                   "prefill_tok_s", "decode_tok_s", "total_tok_s")}}
        if self.stages:
            out["stages"] = [list(x) for x in self.stages]
        return out


SCREEN_DECODE_STEPS = 2  # decode steps simulated when screening candidates (then extrapolated)


def _try(fn, row: dict, reasons: list):
    try:
        return fn()
    except OffsimError as e:  # infeasible placement, memory overflow under the simulated timing, ...
        reasons.append(str(e))
        row["error"] = str(e)
        return None


def search(policy: str, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
           max_sims: int = 3, progress: bool = False, max_batch: int | None = None,
           compression: tuple[Compression, ...] = (NO_COMPRESSION,),
           verify_decode_steps: int | None = None, num_gpus: int = 1, gpus_per_node: int = 0,
           key_mask: bool = False) -> SearchResult:
    """The best settings and block shape of ``policy`` for this model, hardware and lengths, by simulated total
    throughput.

    Two stages keep OPT-175B searches in seconds: (1) screen candidates on a short plan (prefill and
    ``SCREEN_DECODE_STEPS`` decode steps, decode time extrapolated to ``gen_len``); LP-ranked policies (FlexGen)
    screen only their ``2 · max_sims`` best LP candidates; (2) build and simulate the full plan of the best
    screened candidate, falling back to the next when the full-length plan does not fit memory. ``max_batch``
    caps the prompts per block (gpu_batch_size × num_gpu_batches). ``compression``: the compression choices to
    search over (default: none, fp16); each choice draws its own candidates -- ranked under it by the policy's own
    model where it has one (FlexGen's LP), else the policy's candidates with the choice added to their settings --
    so ``(NO_COMPRESSION, Compression(True, True))`` returns the better of fp16 and 4-bit, and the candidate table
    shows both. ``verify_decode_steps`` (``offsim job``'s fast mode): stage (2) checks the full-length plan's fit
    from arithmetic (``registry.check_plan_fits``) and simulates only prefill and that many decode steps, decode
    extrapolated as in screening -- no memory check under the full plan's timing -- where the shortened plan places
    weights and cache as the full one does (``registry.same_placement``); None: the full plan, as above.

    ``num_gpus`` > 1 (FlexGen): a pipeline over that many GPUs of one host, each with ``hw``'s GPU budget, host
    memory and disk shared -- the policy's pipeline candidates (FlexGen's: the LP per block shape and stage split,
    ``lp.flexgen_stage_lp``), each with its layers per stage and micro-batch groups in its settings, screened and
    verified by simulation as above; the result's ``stages`` are the chosen layers per GPU. 1: the single-GPU
    search, exactly. ``gpus_per_node`` (0: all on one host): the GPUs on nodes of that many each (FlexGen's 4 x 1:
    1), every node with ``hw``'s host memory, disk and CPU, hidden states between nodes over
    ``hw.network_bytes_per_s``. ``key_mask`` (``offsim job``): every candidate reserves the GPU memory of a
    left-padded batch's key mask at these lengths (``Workload.reserve_key_mask``), so that any batch padded to at
    most them fits in what the result places."""
    # The cyclic garbage collector is paused for the search (``build_plan`` and ``simulate`` pause it while they
    # run, but between them its young-generation passes would walk the ~10^6 objects of a large plan, which form no
    # cycles); what the search makes is freed by reference counting when it returns.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(policy, model, hw, prompt_len, gen_len, max_sims, progress, max_batch, tuple(compression),
                       verify_decode_steps, num_gpus, gpus_per_node, key_mask)
    finally:
        if was_enabled:
            gc.enable()


def _search(policy: str, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, max_sims: int,
            progress: bool, max_batch: int | None, compression: tuple[Compression, ...],
            verify_decode_steps: int | None = None, num_gpus: int = 1, gpus_per_node: int = 0,
            key_mask: bool = False) -> SearchResult:
    pol = get_policy(policy)
    Workload(prompt_len, gen_len)  # validates the lengths
    check_num_gpus(pol, model, num_gpus, gpus_per_node, hw)
    rows, reasons = [], []
    cands = []
    for comp in compression:
        cands += _candidates(pol, model, hw, prompt_len, gen_len, max_sims, max_batch, comp, num_gpus,
                             gpus_per_node, key_mask)
    short_gen = min(gen_len, SCREEN_DECODE_STEPS + 1)
    it = cands
    if progress:
        from tqdm import tqdm
        it = tqdm(cands, desc=f"search {policy}", unit="cand")
    for settings, wl, lp_s in it:
        row = {"gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches,
               "settings": dict(settings), "lp_s_per_token": lp_s, "_wl": wl}
        rows.append(row)
        short = _screen_workload(policy, model, hw, settings, wl, short_gen)
        plan = _try(lambda: build_plan(policy, model, hw, short, settings, validate=False), row, [])
        m = plan and _try(lambda: extrapolated_metrics(simulate(plan, hw), wl), row, [])
        if not m:
            # say why in the user's lengths, not the screening plan's: the full workload's memory arithmetic where
            # it refuses the candidate too, else the screening plan's own reason
            _try(lambda: check_plan_fits(policy, model, hw, wl, settings), row, [])
            reasons.append(row["error"])
            continue
        row["screen_total_tok_s"] = m["total_tok_s"]
        if short is wl:
            row["_full"] = m
    # (plans are built unvalidated here: the search returns settings, and the plan a user then builds from them --
    # `offsim simulate`, offexec -- is validated op by op there; OPT-175B's full plan takes ~1 s to validate)
    screened = sorted((r for r in rows if "screen_total_tok_s" in r), key=lambda r: -r["screen_total_tok_s"])
    best = None
    short_verify = verify_decode_steps is not None and gen_len > verify_decode_steps + 2
    for row in screened:
        wl, m = row["_wl"], row.get("_full")  # (a candidate screened on its full plan: verified there)
        if m is None:
            vwl = wl
            if short_verify and same_placement(policy, model, hw, row["settings"], wl,
                                               wl.with_(gen_len=verify_decode_steps + 2)):
                if _try(lambda: check_plan_fits(policy, model, hw, wl, row["settings"]) or True, row,
                        reasons) is None:
                    continue
                vwl = wl.with_(gen_len=verify_decode_steps + 2)
            plan = _try(lambda: build_plan(policy, model, hw, vwl, row["settings"], validate=False), row, reasons)
            m = plan and _try(lambda: extrapolated_metrics(simulate(plan, hw), wl), row, reasons)
        if m:
            row.update({k: m[k] for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "peak_gpu_bytes")})
            best = (row["settings"], wl, m)
            break
    if best is None:
        raise OffsimError(infeasibility_reason(policy, model, hw, prompt_len, gen_len, reasons, num_gpus,
                                               gpus_per_node))
    df = pd.DataFrame([{k: v for k, v in r.items() if k not in ("_wl", "_full")} for r in rows])
    df = df.sort_values("screen_total_tok_s", ascending=False, na_position="last").reset_index(drop=True)
    stages = ()
    if num_gpus > 1:
        stages = balanced_stages(model.num_layers, num_gpus, best[0].get("stage_layers", ()))
    return SearchResult(policy, best[0], best[1], best[2], df, stages)


def _screen_workload(policy: str, model: ModelSpec, hw: HardwareSpec, settings, wl: Workload,
                     short_gen: int) -> Workload:
    """The workload a candidate is screened on: ``wl`` shortened to ``short_gen`` tokens, unless the policy would
    place that plan's weights or cache otherwise than the full one's (``registry.same_placement``; Accelerate's GPU
    layers make room for the KV of the whole output: OPT-6.7B 512/32 on a 32 GiB H200, 64 x 1 screened 2,087 total
    tok/s with more layers on the GPU than its full plan holds, which runs 921), then ``wl`` itself."""
    if short_gen >= wl.gen_len:
        return wl
    short = wl.with_(gen_len=short_gen)
    try:
        return short if same_placement(policy, model, hw, settings, wl, short) else wl
    except OffsimError:  # (settings the policy refuses: the screening plan's build says why)
        return short


def check_num_gpus(pol, model: ModelSpec, num_gpus: int, gpus_per_node: int = 0,
                   hw: HardwareSpec | None = None) -> None:
    """Refuse a GPU count the policy cannot use: below 1, above the model's layers (a stage needs one), or more
    than one GPU for a policy without pipeline stages (those with: the policies with ``check_stages``); a node size
    that does not divide it, or several nodes on hardware without a network rate (``hw.network_bytes_per_s``)."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise OffsimError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    check_gpus_per_node(num_gpus, gpus_per_node)
    if gpus_per_node and num_gpus // gpus_per_node > 1 and hw is not None:
        network_bytes_per_s(hw)
    if num_gpus > 1 and pol.check_stages is None:
        from offsim.policies import POLICIES

        can = ", ".join(p for p, rec in POLICIES.items() if rec.check_stages is not None)
        raise OffsimError(f"policy {pol.name} runs on one GPU (pipeline parallelism over several: {can}); drop "
                          "--num-gpus for it")
    if gpus_per_node and num_gpus > 1 and not _takes(pol.candidates, "gpus_per_node"):
        raise OffsimError(f"policy {pol.name}'s pipeline runs on one host: drop --gpus-per-node for it")
    if num_gpus > model.num_layers:
        raise OffsimError(f"--num-gpus {num_gpus} exceeds {model.name}'s {model.num_layers} layers (a stage needs "
                          "one)")


def _candidates(pol, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, max_sims: int,
                max_batch: int | None, comp: Compression, num_gpus: int = 1, gpus_per_node: int = 0,
                key_mask: bool = False) -> list:
    """The candidates of one compression choice: a ranked policy's 2 · max_sims best, else all of them (with
    ``num_gpus`` > 1, the policy's pipeline candidates: ``check_num_gpus`` has checked that it has them)."""
    kw = {"num_gpus": num_gpus} if num_gpus > 1 else {}
    # the optional keywords of ``base.CandidateFn``, for a generator that takes them (a policy written without them
    # still works: its candidates are filtered by the cap below, and reserve the key mask without fitting to it)
    if key_mask and _takes(pol.candidates, "key_mask"):
        kw["key_mask"] = True
    if max_batch is not None and _takes(pol.candidates, "max_batch"):
        kw["max_batch"] = max_batch  # (a generator that keeps its best few shapes keeps them under the cap)
    if num_gpus > 1 and gpus_per_node:
        kw["gpus_per_node"] = gpus_per_node
    if comp.any and not pol.compressible:
        from offsim.policies import POLICIES

        can = ", ".join(p for p, rec in POLICIES.items() if rec.compressible)
        raise OffsimError(f"policy {pol.name} does not model compression or sparse attention (those that do: {can}); "
                          "drop --compress-weight, --compress-cache and --sparse-attention for it")
    if pol.ranks_compression:
        drawn = pol.candidates(model, hw, prompt_len, gen_len, None, compression=comp, **kw)
    else:
        extra = comp.settings() if comp.any else {}
        drawn = (c._replace(settings={**c.settings, **extra})
                 for c in pol.candidates(model, hw, prompt_len, gen_len, None, **kw))
    if key_mask and not _takes(pol.candidates, "key_mask"):
        drawn = (c._replace(workload=c.workload.with_(reserve_key_mask=True)) for c in drawn)
    cands, seen = [], set()
    for c in drawn:
        if max_batch is not None and c[1].num_prompts > max_batch:  # a cap on prompts per block (latency, host
            continue  # memory, or run time)
        key = (tuple(sorted((k, repr(v)) for k, v in c[0].items())), c[1])
        if key in seen:  # the same candidate drawn twice (two LP optima trimmed to one placement) is screened
            continue  # once: of a ranked policy's 2 · max_sims, each a different one
        seen.add(key)
        cands.append(c)
        if cands[0][2] is not None and len(cands) >= 2 * max_sims:
            # ranked (the first is): only the 2 · max_sims best are screened, so the rest are not drawn --
            # FlexGen's trims each LP optimum to fit (``fit_gpu_weights``), ~1 ms a candidate
            break
    return cands


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (by name, or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def decode_step_times(trace: Trace, m: dict) -> tuple[float, float, int]:
    """The first decode step's time, the mean time of the later decode steps (the first's where there is only
    one) and the number of decode steps of a simulated trace (``m``: its ``metrics()``). A step ends when the last op
    of it or an earlier step ends: prefill ends at ``m['prefill_s']``, the last step at the makespan. The first
    decode step is apart because it carries one-off costs that a hardware profile prices (CUDA-graph captures, the
    first use of a buffer): the mean of two screened steps over-estimated each later one ~2x on
    h200_offexec_v2.json, by a different factor for each candidate (results of ``experiments.sweeps.search_monotone``).
    """
    steps = m["gen_len"] - 1
    if steps <= 0:
        return 0.0, 0.0, 0
    first_end = m["prefill_s"]
    if steps > 1:
        step = trace.df["step"].to_numpy()
        end = trace.df["end_s"].to_numpy()
        first_end = max(first_end, float(end[step <= 1].max()))
    first = first_end - m["prefill_s"]
    later = (m["total_s"] - first_end) / (steps - 1) if steps > 1 else first
    return first, later, steps


def extrapolated_metrics(trace: Trace, wl: Workload) -> dict:
    """Metrics of a simulated plan, shortened to fewer decode steps than ``wl`` (or not: then its own metrics), its
    decode time extrapolated to ``wl.gen_len``: the first decode step as simulated, every later one at the mean of
    the simulated later steps (``decode_step_times``; an estimate, optimistic where later steps grow with the
    context); the throughputs follow FlexGen's definitions (``Trace.metrics``). Peaks are the shortened plan's.
    What screening ranks candidates by, and ``verify_decode_steps``' metrics."""
    m = trace.metrics()
    if m["gen_len"] == wl.gen_len:
        return m
    first, later, steps = decode_step_times(trace, m)
    decode_s = first + later * (wl.gen_len - 2) if wl.gen_len > 1 else 0.0
    total_s = m["prefill_s"] + decode_s
    prompts = wl.num_prompts
    return {**m, "gen_len": wl.gen_len, "decode_s": decode_s, "total_s": total_s,
            "decode_tok_s": prompts * (wl.gen_len - 1) / decode_s if decode_s > 0 else float("inf"),
            "total_tok_s": prompts * wl.gen_len / total_s, "extrapolated_from_decode_steps": steps}


def infeasibility_reason(policy: str, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                         reasons: list[str], num_gpus: int = 1, gpus_per_node: int = 0) -> str:
    """Which constraint binds when nothing fits: the smallest block (one sequence) against each tier. On the GPU the
    least any policy needs (``footprint.tier_bytes`` with every weight and all the KV off the GPU: embeddings, two
    weight slots, two KV work buffers, one sequence's activations and its largest op peak: the same on each GPU of
    a pipeline); across tiers, the weights and one sequence's KV (against ``num_gpus`` GPUs, host and disk)."""
    wl = Workload(prompt_len, gen_len)
    GiB = fp.GiB
    off = {"wg": 0, "wc": 1, "wd": 0, "cg": 0, "cc": 1, "cd": 0, "hg": 1, "hc": 0}
    need_gpu = int(sum(fp.tier_bytes(model, wl, off)["gpu"].values()))
    total = model.weight_bytes() + fp.kv_bytes(model, 1, wl.max_len, layers=model.num_layers)
    hosts = num_gpus // gpus_per_node if gpus_per_node else 1
    have = num_gpus * hw.gpu_mem_bytes + hosts * (hw.cpu_mem_bytes + hw.disk_bytes)
    if need_gpu > hw.gpu_mem_bytes:
        why = (f"GPU memory: even one sequence needs {need_gpu / GiB:.2f} GiB on the GPU (embeddings, two streamed "
               f"layers, KV work buffers, activations), has {hw.gpu_mem_bytes / GiB:.2f} GiB, short by "
               f"{(need_gpu - hw.gpu_mem_bytes) / GiB:.2f} GiB")
    elif total > have:
        gpus = "GPU" if num_gpus == 1 else f"{num_gpus} GPUs"
        why = (f"total memory: weights + KV need {total / GiB:.2f} GiB, {gpus} + CPU + disk hold {have / GiB:.2f} "
               f"GiB, short by {(total - have) / GiB:.2f} GiB")
    else:
        why = reasons[0] if reasons else "no candidate"
    on = hw.name if num_gpus == 1 else f"{num_gpus} GPUs of {hw.name}" + (f" on {hosts} nodes" if hosts > 1 else "")
    return f"no feasible {policy} setting for {model.name} on {on}: {why}"
