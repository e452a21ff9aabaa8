"""Shared by the TightLLM experiments (experiments/tightllm_*.py): the paper's setup, each policy at its best, and a
resumable cache of results.

Setup (TightLLM, IEEE TC'25, §6): OPT-13B/30B/66B/175B and Llama-2-13B/70B; prompts 0.5K-8K; 32 generated tokens; C1 =
``rtx3090`` (24 GB, PCIe 4.0, 128 GB host), C2 = ``a800`` (80 GB, PCIe 4.0, 256 GB host); baselines Accelerate and
FlexGen. OPT has 2048 learned positions and Llama-2 4096: for longer prompts the model's ``max_positions`` is raised
with ``dataclasses.replace`` (it only changes OPT's position-table size, which offsim counts in the embedding bytes;
the numbers say nothing about output quality at those lengths -- as in the paper, which uses the same models at 8K).

"Best settings": ``offsim.search.search`` (FlexGen: its LP then simulation; Accelerate: batch sizes; TightLLM: the
candidates ``offsim.policies.tightllm.policy.tightllm_candidates`` yields). When the search finds nothing feasible -- its LP's memory
model can put host memory exactly at its limit while the plan's disk staging needs a little more -- ``best`` falls back
to the same LP placements with 2-10 percentage points of host-memory weights (and KV) moved to disk, simulated in
full; rows say which path produced them (``found_by``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

from offsim import OffsimError, PlanError, Workload, build_plan, get_model, simulate
from offsim.policies.lp import flexgen_candidates
from offsim.search import search

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "tightllm"
MODELS = ["opt-13b", "opt-30b", "opt-66b", "opt-175b", "llama-2-13b", "llama-2-70b"]
HARDWARE = {"rtx3090": "C1", "a800": "C2"}
PROMPTS = [512, 1024, 2048, 4096, 8192]
GEN_LEN = 32
POLICIES = ["static-accelerate", "flexgen", "tightllm"]
POLICY_LABEL = {"static-accelerate": "Accelerate", "flexgen": "FlexGen", "tightllm": "TightLLM"}
POLICY_COLOR = {"static-accelerate": "#7f7f7f", "flexgen": "#1f77b4", "tightllm": "#d62728"}
MARGINS = (0, 2, 5, 10)  # host-memory percentage points moved to disk when the LP's placement does not fit

# TightLLM's published claims (docs/anchors.md §3), for the tables beside ours
PAPER = {
    "decode_speedup": (1.3, 23.0), "prefill_speedup": (1.2, 22.0),
    "decode_speedup_C1_avg_max": 10.4, "decode_speedup_C2_max": 19.9,
    "decode_speedup_512": (2.4, 12.4), "decode_speedup_4096": (3.3, 22.8),
    "opt175b_latency_drop_pct": (59.7, 95.7), "opt175b_compute_growth": (3.1, 5.4),
    "opt175b_transfer_drop_pct": (68.9, 97.5),
    "a800_opt175b_b8_baselines_below_prefill_pct": (35.9, 95.4),
    "a800_opt175b_b8_baselines_below_decode_pct": (60.4, 95.6),
    "ablation_decode_no_kvd_pct": (-43.1, -12.6), "ablation_decode_no_wl_pct": (-74.8, -4.4),
    "ablation_prefill_no_kvd_pct_max": -46.6, "ablation_prefill_no_wl_pct_max": -38.2,
}


def model_for(name: str, prompt_len: int, gen_len: int = GEN_LEN):
    """The preset, with ``max_positions`` raised when prompt + generation needs more (see module docstring)."""
    m = get_model(name)
    need = prompt_len + gen_len - 1
    return dataclasses.replace(m, max_positions=need) if need > m.max_positions else m


def metrics_row(m: dict) -> dict:
    keys = ("prefill_tok_s", "decode_tok_s", "total_tok_s", "prefill_s", "decode_s", "gpu_idle_frac",
            "busy_compute_s", "busy_h2d_s", "busy_d2h_s", "busy_disk_s", "peak_gpu_bytes", "peak_cpu_bytes")
    return {k: m[k] for k in keys}


def _margin_candidates(policy: str, model, hw, prompt_len: int, gen_len: int, top: int = 8):
    cas = (False, True) if policy == "flexgen" else (False,)
    for r in flexgen_candidates(model, hw, prompt_len, gen_len, cpu_attention=cas,
                                sublayer=policy == "flexgen")[:top]:  # TightLLM streams whole layers
        wg, wc, cg, cc, ag, ac = r.percent
        for delta in (2, 5, 10):
            pct = (wg, max(0, wc - delta), cg, max(0, cc - delta), ag, ac)
            st = {"percent": pct}
            if policy == "flexgen":
                st["cpu_attention"] = r.cpu_attention
            yield st, Workload(prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches)


def best(policy: str, model, hw, prompt_len: int, gen_len: int = GEN_LEN) -> dict:
    """The policy at its best settings: a dict with settings, block shape, metrics and ``found_by``; or with
    ``status`` 'infeasible' and the reason."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            r = search(policy, model, hw, prompt_len, gen_len, max_sims=6 if policy == "tightllm" else 3)
            return {"status": "ok", "found_by": "search", "settings": _jsonable(r.settings),
                    "gpu_batch_size": r.workload.gpu_batch_size, "num_gpu_batches": r.workload.num_gpu_batches,
                    **metrics_row(r.metrics)}
        except OffsimError as e:
            reason = str(e)
        if policy == "static-accelerate":
            return {"status": "infeasible", "reason": reason}
        bestrow = None
        for st, wl in _margin_candidates(policy, model, hw, prompt_len, gen_len):
            try:
                m = simulate(build_plan(policy, model, hw, wl, st), hw).metrics()
            except (PlanError, OffsimError):
                continue
            if bestrow is None or m["total_tok_s"] > bestrow["total_tok_s"]:
                bestrow = {"status": "ok", "found_by": "fallback: LP placement with host share moved to disk",
                           "settings": _jsonable(st), "gpu_batch_size": wl.gpu_batch_size,
                           "num_gpu_batches": wl.num_gpu_batches, **metrics_row(m)}
        return bestrow or {"status": "infeasible", "reason": reason}


def shapes_for(sequences: int) -> list[tuple[int, int]]:
    """Block shapes (gpu_batch_size, num_gpu_batches) holding exactly ``sequences`` sequences, at most 16 batches."""
    return [(sequences // nb, nb) for nb in range(1, min(16, sequences) + 1) if sequences % nb == 0]


def fixed_lp_groups(policy: str, model, hw, prompt_len: int, sequences: int, gen_len: int = GEN_LEN):
    """(settings, workload) groups for FlexGen or TightLLM with exactly ``sequences`` sequences: one group per block
    shape (and, for FlexGen, with and without CPU attention) with FlexGen's LP placement for it, then that placement
    with ``MARGINS`` points of host memory moved to disk -- in order of preference (the first that fits is used)."""
    from offsim.policies.lp import flexgen_lp

    for gbs, nb in shapes_for(sequences):
        for ca in ((False, True) if policy == "flexgen" else (False,)):
            r = flexgen_lp(model, hw, prompt_len, gen_len, gbs, nb, ca, sublayer=policy == "flexgen")
            if r is None:
                continue
            wg, wc, cg, cc, ag, ac = r.percent
            group = []
            for dm in MARGINS:
                st = {"percent": (wg, max(0, wc - dm), cg, max(0, cc - dm), ag, ac)}
                if policy == "flexgen":
                    st["cpu_attention"] = ca
                group.append((st, Workload(prompt_len, gen_len, gbs, nb)))
            yield group


def best_fixed(policy: str, model, hw, prompt_len: int, sequences: int, gen_len: int = GEN_LEN) -> dict:
    """The policy at its best for a fixed number of sequences (the paper's fixed batch): Accelerate runs them as one
    GPU batch; FlexGen and TightLLM try every block shape of that size with FlexGen's LP placement for it (FlexGen
    with and without CPU attention), moving 2-10 points of host memory to disk when the LP's placement does not
    fit, and keep the best simulated total throughput."""
    if policy == "static-accelerate":
        tries = [[({"offload": off}, Workload(prompt_len, gen_len, sequences, 1))] for off in ("cpu", "disk")]
    else:
        tries = fixed_lp_groups(policy, model, hw, prompt_len, sequences, gen_len)
    bestrow, reason = None, "no block shape fits"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group in tries:
            for st, wl in group:
                try:
                    m = simulate(build_plan(policy, model, hw, wl, st), hw).metrics()
                except (PlanError, OffsimError) as e:
                    reason = str(e)
                    continue
                if bestrow is None or m["total_tok_s"] > bestrow["total_tok_s"]:
                    bestrow = {"status": "ok", "found_by": f"fixed {sequences} sequences: shapes x LP placement",
                               "settings": _jsonable(st), "gpu_batch_size": wl.gpu_batch_size,
                               "num_gpu_batches": wl.num_gpu_batches, **metrics_row(m)}
                break
    return bestrow or {"status": "infeasible", "reason": reason[:300]}


def _jsonable(x):
    return json.loads(json.dumps(x, default=list))


class Cache:
    """Results keyed by a tuple, appended to a JSONL file as they come, so a long experiment can be resumed."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    self.rows[r["key"]] = r

    def get(self, key: tuple):
        return self.rows.get(json.dumps(list(key)))

    def put(self, key: tuple, row: dict) -> dict:
        row = {"key": json.dumps(list(key)), **row}
        self.rows[row["key"]] = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=_nan_safe) + "\n")
        return row


def _nan_safe(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)
