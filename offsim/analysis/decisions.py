"""TightLLM's decisions, tabulated for notebooks: the N_r its KV distributor picks against context length, and the
compute and transfer curves it balances (the distributor's own ``stream_seconds``, i.e. offsim's cost model)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from offsim.core.specs import HardwareSpec, ModelSpec, Workload
from offsim.policies.tightllm import policy as t


def tightllm_nr_vs_context(model: ModelSpec, hw: HardwareSpec, settings: dict, gpu_batch_size: int,
                           num_gpu_batches: int, contexts: Sequence[int]) -> pd.DataFrame:
    """N_r that TightLLM's distributor picks for each GPU batch at a decode step with ``ctx`` tokens of context
    (the plan's own ``recompute_tokens``, on a one-decode-step workload with prompt_len = ctx), one row per
    (context, batch)."""
    st = t.TightLLMSettings(**settings)
    rows = []
    for ctx in contexts:
        wl = Workload(int(ctx), 2, gpu_batch_size, num_gpu_batches)
        nr = t.recompute_tokens(model, hw, wl, st)[1]  # step 1 attends over exactly ctx tokens
        for k, n in enumerate(nr):
            rows.append({"ctx_tokens": int(ctx), "batch_index": k, "n_r": int(n), "recompute_frac": n / ctx})
    return pd.DataFrame(rows)


def tightllm_balance(model: ModelSpec, hw: HardwareSpec, settings: dict, wl: Workload, ctx_tokens: int,
                     batch_index: int = 0, points: int = 64) -> tuple[pd.DataFrame, int]:
    """The compute and transfer seconds of one decoder layer of GPU batch ``batch_index`` as functions of N_r (the
    distributor's own ``stream_seconds``, i.e. offsim's cost model), on ``points`` values from 0 to the memory cap
    plus the N_r the distributor picks; and that N_r. TightLLM minimises max(T_compute, T_transfer) (docs/cost-model.md §8)."""
    st = t.TightLLMSettings(**settings)
    # the very problem the plan generator solves for this batch and context (placement, weight slice, memory caps)
    d = t.decision_for(model, hw, wl, st, ctx_tokens, batch_index)
    mem_hi = -1 if d.mem_hi is None else d.mem_hi
    kvd = t.kv_distributor_of(model, hw, wl, st)  # the plan's own
    chosen = kvd.decide(d, st.kv_solver)
    top = ctx_tokens if mem_hi < 0 else min(mem_hi, ctx_tokens)
    top = top if d.hi is None else min(top, d.hi)
    ns = sorted(set(np.linspace(0, top, points).round().astype(int).tolist()) | {chosen})
    rows = []
    for n in ns:
        c, h, dk, dd = kvd.stream_seconds(d, n)
        rows.append({"n_r": n, "compute_s": c, "h2d_s": h, "disk_s": dk, "d2h_s": dd,
                     "layer_s": kvd.combine((c, h, dk, dd))})
    return pd.DataFrame(rows), chosen
