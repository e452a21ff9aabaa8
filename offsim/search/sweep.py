"""Sweeps: a policy at a *fixed* number of sequences, over a grid of prompt lengths and batches.

``policy_at_batch`` takes the policy's own candidates at that batch (``Policy.candidates(..., batch)``: FlexGen and
TightLLM from FlexGen's LP over the block shapes whose product is ``batch``, the static policies and Select-N from
their few discrete knobs), best first, and simulates the first that fits; ``throughput_sweep`` does that over a grid
and returns a DataFrame (``offsim.analysis.plots.plot_sweep`` draws it). ``offsim.search.search`` answers the other
question -- each policy's best batch -- and is what ``offsim compare`` runs. ``lp_placements`` tabulates FlexGen's LP
optimum per block shape.
"""
from __future__ import annotations

import json
from typing import Sequence

import pandas as pd

from offsim.core.errors import OffsimError
from offsim.core.sim import simulate
from offsim.core.specs import HardwareSpec, ModelSpec, Workload
from offsim.core.trace import Trace
from offsim.policies import DEFAULT_POLICIES, build_plan, get_policy
from offsim.policies.lp import flexgen_lp


def policy_at_batch(policy: str, model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, batch: int,
                    max_tries: int = 4) -> tuple[dict, Workload, Trace]:
    """Settings, workload and simulated trace of ``policy`` with ``batch`` sequences per block; raises OffsimError
    with the last reason when nothing fits."""
    pol = get_policy(policy)
    why = "no candidate"
    for t, (st, wl, _) in enumerate(pol.candidates(model, hw, prompt_len, gen_len, batch)):
        if t >= max_tries:
            break
        try:
            return st, wl, simulate(build_plan(policy, model, hw, wl, st), hw)
        except OffsimError as e:
            why = str(e)
    raise OffsimError(f"{policy} does not fit {batch} sequences of {model.name} on {hw.name}: {why}")


def throughput_sweep(model: ModelSpec, hw: HardwareSpec, policies: Sequence[str] | None = None,
                     prompt_lens: Sequence[int] = (512,), batches: Sequence[int] = (8,), gen_len: int = 8,
                     progress: bool = False) -> pd.DataFrame:
    """One row per (policy, prompt_len, batch): settings, block shape and the simulated metrics (FlexGen's
    throughput definitions); ``error`` says why a cell has no numbers (usually: does not fit memory)."""
    policies = list(DEFAULT_POLICIES) if policies is None else list(policies)
    grid = [(p, s, b) for p in policies for s in prompt_lens for b in batches]
    if progress:
        from tqdm.auto import tqdm

        grid = tqdm(grid, desc="sweep", unit="plan")
    rows = []
    for pol, s, b in grid:
        row = {"policy": pol, "prompt_len": s, "gen_len": gen_len, "batch": b}
        try:
            st, wl, tr = policy_at_batch(pol, model, hw, s, gen_len, b)
        except OffsimError as e:
            rows.append({**row, "error": str(e)})
            continue
        m = tr.metrics()
        rows.append({**row, "gpu_batch_size": wl.gpu_batch_size, "num_gpu_batches": wl.num_gpu_batches,
                     "settings": json.dumps(st), **{k: m[k] for k in (
                         "prefill_tok_s", "decode_tok_s", "total_tok_s", "gpu_idle_frac", "peak_gpu_bytes",
                         "peak_cpu_bytes")}, "error": ""})
    cols = ["policy", "prompt_len", "gen_len", "batch", "gpu_batch_size", "num_gpu_batches", "settings",
            "prefill_tok_s", "decode_tok_s", "total_tok_s", "gpu_idle_frac", "peak_gpu_bytes", "peak_cpu_bytes",
            "error"]
    return pd.DataFrame(rows).reindex(columns=cols)  # the same columns even when no cell fits


def lp_placements(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                  shapes: Sequence[tuple], cpu_attention: bool = False) -> pd.DataFrame:
    """FlexGen's LP optimum for each block shape (gpu_batch_size, num_gpu_batches[, cpu_attention]): the nine
    fractions, FlexGen's rounded ``--percent``, the LP's tok/s estimate and the memory constraints that bind."""
    rows = []
    for shape in shapes:
        gbs, nb = shape[:2]
        ca = bool(shape[2]) if len(shape) > 2 else cpu_attention
        r = flexgen_lp(model, hw, prompt_len, gen_len, gbs, nb, ca)
        row = {"gpu_batch_size": gbs, "num_gpu_batches": nb, "batch": gbs * nb, "cpu_attention": ca}
        if r is None:
            rows.append({**row, "feasible": False})
            continue
        rows.append({**row, "feasible": True, **r.fractions, "percent": r.percent,
                     "lp_tok_s": 1.0 / r.seconds_per_token, "binding": ",".join(r.binding)})
    return pd.DataFrame(rows)
