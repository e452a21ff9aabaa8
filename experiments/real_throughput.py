"""Real throughput on the H200 (issue 15 §2): offexec's policies at their best beside the peers' own code --
FlexGen 0.1.8 (``flexgen-ref``, and its 4-bit mode ``flexgen-4bit-ref``), HF Accelerate (``accelerate-ref``) and
DeepSpeed ZeRO-Inference (``deepspeed-ref``) -- on OPT-30B and Llama-2-13B, prompts 512 and 1984, gen 32 and 128,
GPU budgets 16 and 24 GiB; prefill, decode and total tok/s (FlexGen's definitions) and each run's link bound.

Every run is a subprocess (``experiments/peers/*``), so a GPU or host OOM, a hang or a crash of one leaves the rest;
each has a timeout. Results are appended, one JSON record per run, to OUT/runs.jsonl (the journal); after every
run OUT/real_throughput.csv is rewritten from it (provenance on its first line). Rerun the same command to resume:
runs already answered are skipped (``error`` records are retried; ``--rerun`` runs the selected ones again after an
executor change, the newer record winning in the tables). ``--time-limit-s`` stops starting runs when
the call's time is nearly spent, so the grid runs in pieces of one 10-minute device call each.

    python -m experiments.real_throughput [--only offexec flexgen-ref ...] [--models opt-30b] [--prompts 512]
        [--gens 32] [--budgets 16] [--quick] [--flexgen-k 3] [--timeout-s 480] [--time-limit-s 560] [--rerun]
        [--dry-run]
    python -m experiments.real_throughput --report          # CSV, bar chart, README from the journal; no GPU

Writes OUT (default results/real_throughput/): runs.jsonl, real_throughput.csv, real_throughput.png, README.md,
logs/ (each run's output), traces/ (each offexec run's measured trace). Ends with one JSON line.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import RESULTS, argparser, finish, provenance
from experiments.peers.accelerate_ref import cut_gen_len_arg
from experiments.peers.common import RESULT_FIELDS, harness_status, parse_results

MODELS = ("opt-30b", "llama-2-13b")
PROMPTS = (512, 1984)
GENS = (32, 128)
BUDGETS = (16, 24)
SYSTEMS = ("offexec", "flexgen-ref", "flexgen-4bit-ref", "accelerate-ref", "deepspeed-ref")
PEERS = ("flexgen-ref", "flexgen-4bit-ref", "accelerate-ref", "deepspeed-ref")
DONE = ("ok", "oom", "host_oom", "timeout", "unsupported", "skipped")  # answered; 'error' is retried
MAX_ATTEMPTS = 3  # Accelerate / DeepSpeed: the auto batch, then halved after each OOM


# ---------------------------------------------------------------------------------------------------------------
# the grid and its jobs
# ---------------------------------------------------------------------------------------------------------------
def points(models, prompts, gens, budgets) -> list[tuple[str, int, int, float]]:
    """(model, prompt, gen, budget) of the grid, model-major."""
    return [(m, p, g, float(b)) for m in models for p in prompts for g in gens for b in budgets]


def point_key(system: str, model: str, prompt: int, gen: int, budget: float, tag: str = "") -> str:
    return f"{system}|{model}|p{prompt}|g{gen}|b{budget:g}" + (f"|{tag}" if tag else "")


def jobs_for_point(system: str, model: str, prompt: int, gen: int, budget: float, flexgen_k: int = 3,
                   offexec_policies=None, cache: dict | None = None, settings_cache: str | None = None,
                   trace_dir: str | None = None, cut_gen_len: int | None = None) -> list[dict]:
    """The subprocess jobs of one system at one point: {key(s), argv, system}. FlexGen: one job per candidate
    policy (``flexgen_ref.candidates``, kept in ``cache`` by point so that every call of a resumed grid runs the
    same list and computes it once); an OPT-only peer on a Llama: one 'unsupported' record, no job.
    ``cut_gen_len``: Accelerate and DeepSpeed generate that many tokens where ``gen`` is longer and project the
    rest (``accelerate_ref.project_decode_s``; the record says projected)."""
    from experiments.peers import flexgen_ref
    from offsim import get_model

    common = ["--model", model, "--prompt-len", str(prompt), "--gen-len", str(gen), "--budget-gib", f"{budget:g}"]
    if system == "offexec":
        from experiments.peers.offexec_run import DEFAULT_POLICIES

        pols = list(offexec_policies or DEFAULT_POLICIES)
        # one job per policy: each makes the weights (~10 s for OPT-30B) and fits one run's timeout
        return [{"system": system, "keys": [point_key(f"offexec-{p}", model, prompt, gen, budget)],
                 "argv": ["-m", "experiments.peers.offexec_run", *common, "--policies", p,
                          *(["--settings-cache", settings_cache] if settings_cache else []),
                          *(["--trace-dir", trace_dir] if trace_dir else [])]} for p in pols]
    if system in ("flexgen-ref", "flexgen-4bit-ref"):
        spec = get_model(model)
        if spec.family != "opt":
            return [{"system": system, "keys": [point_key(system, model, prompt, gen, budget)], "argv": None,
                     "record": {"status": "unsupported", "reason": "FlexGen 0.1.8 implements OPT models only"}}]
        comp = system == "flexgen-4bit-ref"
        ck = point_key(system, model, prompt, gen, budget)  # cached: the best k_asked, a prefix serves fewer
        if cache is not None and ck in cache and cache[ck]["k"] >= flexgen_k:
            pols = [flexgen_ref.FlexGenPolicy(**{**d, "percent": tuple(d["percent"])})
                    for d in cache[ck]["policies"][:flexgen_k]]
        else:
            pols = flexgen_ref.candidates(spec, prompt, gen, budget, flexgen_k, compress=comp)
            if cache is not None:
                cache[ck] = {"k": flexgen_k, "policies": [{**p.settings(), "percent": list(p.percent)} for p in pols]}
        if not pols:
            return [{"system": system, "keys": [point_key(system, model, prompt, gen, budget)], "argv": None,
                     "record": {"status": "skipped", "reason": "no FlexGen policy fits host and GPU here"}}]
        return [{"system": system, "keys": [point_key(system, model, prompt, gen, budget, p.tag())],
                 "argv": ["-m", "experiments.peers.flexgen_ref", *common, *_policy_args(p)]} for p in pols]
    if system in ("accelerate-ref", "deepspeed-ref"):
        mod = "accelerate_ref" if system == "accelerate-ref" else "deepspeed_ref"
        cut = ["--cut-gen-len", str(cut_gen_len)] if cut_gen_len and cut_gen_len < gen else []
        return [{"system": system, "keys": [point_key(system, model, prompt, gen, budget)],
                 "argv": ["-m", f"experiments.peers.{mod}", *common, *cut], "retry_batch": True}]
    raise ValueError(f"unknown system {system!r}; valid: {', '.join(SYSTEMS)}")


def _policy_args(p) -> list[str]:
    a = ["--gpu-batch-size", str(p.gpu_batch_size), "--num-gpu-batches", str(p.num_gpu_batches),
         "--percent", *[str(x) for x in p.percent]]
    if p.cpu_cache_compute:
        a.append("--cpu-cache-compute")
    if p.compress_weight:
        a.append("--compress-weight")
    if p.compress_cache:
        a.append("--compress-cache")
    return a


# ---------------------------------------------------------------------------------------------------------------
# journal
# ---------------------------------------------------------------------------------------------------------------
# the GPU of a record written before records named theirs (2026-12-05): every run of results/real_throughput until
# then ran on the H200 device machine
LEGACY_GPU = "NVIDIA H200"
RUN_FIELDS = ("commit", "date", "machine", "gpu")  # the call's provenance, copied into each of its records


def gpu_name() -> str:
    """This machine's GPU as nvidia-smi names it (the first), '' without one; the harness itself touches no CUDA."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout.strip().splitlines()[0].strip() if p.returncode == 0 and p.stdout.strip() else ""


def check_same_gpu(journal: list[dict], gpu: str, jpath: Path) -> None:
    """A journal holds one GPU's runs, so that its tables compare like with like: runs on another GPU are refused
    before any starts (an H100 lent for an H200 would otherwise mix into the H200's tables)."""
    theirs = {r.get("gpu") or LEGACY_GPU for r in journal}
    if gpu and theirs and gpu not in theirs:
        sys.exit(f"real_throughput: {jpath} holds runs on {', '.join(sorted(theirs))} and this machine's GPU is "
                 f"{gpu}: give --out another folder for this GPU's runs")


def read_journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(harness_status(json.loads(line)))
            except json.JSONDecodeError:
                continue  # a line cut by a kill: ignored
    return out


def append_journal(path: Path, recs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps(r, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def job_state(job: dict, journal: list[dict], retry: tuple[str, ...] = ()) -> tuple[bool, int | None]:
    """(answered, the batch to retry with): a job is answered when each of its keys has a record in ``DONE`` (less
    the statuses in ``retry``: ``--retry timeout`` reruns runs that timed out, e.g. with a longer ``--timeout-s``);
    an Accelerate / DeepSpeed job whose runs ran out of memory is retried at half the smallest batch tried, up to
    ``MAX_ATTEMPTS`` runs."""
    done = tuple(x for x in DONE if x not in retry)
    by_key: dict[str, list[dict]] = {}
    for r in journal:
        by_key.setdefault(r.get("key"), []).append(r)
    if not job.get("retry_batch"):
        return all(any(r.get("status") in done for r in by_key.get(k, [])) for k in job["keys"]), None
    recs = by_key.get(job["keys"][0], [])
    if any(r.get("status") in done and r.get("status") != "oom" for r in recs):
        return True, None
    ooms = [r for r in recs if r.get("status") == "oom"]
    if not ooms:
        return False, None
    if len(recs) >= MAX_ATTEMPTS:
        return True, None
    tried = [int(r["batch"]) for r in ooms if r.get("batch")]
    nxt = min(tried) // 2 if tried else None
    return (nxt is not None and nxt < 1), nxt


def log_name(key: str) -> str:
    """The file in OUT/logs/ that holds the output of the job whose first key is ``key``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".log"


def run_job(job: dict, out: Path, timeout_s: float, prov: dict, batch: int | None = None) -> tuple[list[dict], bool]:
    """Run one job's subprocess; its records (with key, provenance; status timeout / host_oom / error when it
    printed none), and whether it was cut by ``timeout_s``."""
    argv = list(job["argv"])
    if batch is not None:
        argv += ["--batch", str(batch)]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / log_name(job["keys"][0])
    t0 = time.perf_counter()
    cut = False
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {' '.join(argv)}\n")
        log.flush()
        p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=log, text=True,
                             start_new_session=True, cwd=str(Path(__file__).resolve().parents[1]))
        try:
            stdout, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            cut = True
            os.killpg(p.pid, signal.SIGKILL)
            stdout, _ = p.communicate()
        log.write(stdout or "")
    wall = time.perf_counter() - t0
    recs = parse_results(stdout or "")
    keys = list(job["keys"])
    for r in recs:  # match a record to its key by system (offexec: one job, several policies)
        r.setdefault("key", next((k for k in keys if k.split("|")[0] == r.get("system")), keys[0]))
    missing = [k for k in keys if not any(r["key"] == k for r in recs)]
    for k in missing:
        if cut:
            st, why = "timeout", f"no result within {timeout_s:.0f} s"
        elif p.returncode in (-9, 137):
            st, why = "host_oom", "killed by SIGKILL (the kernel's OOM killer, most likely)"
        else:
            st, why = "error", f"exit {p.returncode}; see {log_path.relative_to(out)}"
        sysname, model, pp, gg, bb = k.split("|")[:5]
        recs.append({"system": sysname, "model": model, "prompt_len": int(pp[1:]), "gen_len": int(gg[1:]),
                     "budget_gib": float(bb[1:]), "status": st, "reason": why, "key": k, "wall_s": wall,
                     "batch": batch})
    for r in recs:
        r.setdefault("wall_s", wall)
        for k in RUN_FIELDS:
            r[k] = prov.get(k)
    return recs, cut


# ---------------------------------------------------------------------------------------------------------------
# table, chart, README
# ---------------------------------------------------------------------------------------------------------------
def table(journal: list[dict]):
    """Every record as a row, the issue's columns first; the last record of a key wins over earlier ones of the
    same key and batch (a retried error)."""
    import pandas as pd

    seen = {}
    for r in journal:
        seen[(r.get("key"), r.get("batch"), r.get("status") == "ok")] = r
    df = pd.DataFrame(list(seen.values()))
    for c in RESULT_FIELDS:
        if c not in df.columns:
            df[c] = None
    extra = [c for c in df.columns if c not in RESULT_FIELDS]
    return df[list(RESULT_FIELDS) + extra]


def _projected(r) -> bool:
    """A run whose decode was projected from its first tokens (``--cut-gen-len``), with how many it measured."""
    ms = r.get("measured_steps")
    return bool(r.get("projected")) and ms is not None and ms == ms


def best(df):
    """Each system's best ok run (decode tok/s) per (model, prompt, gen, budget)."""
    ok = df[df["status"] == "ok"].copy()
    if ok.empty:
        return ok
    ok["decode_tok_s"] = ok["decode_tok_s"].astype(float)
    idx = ok.groupby(["system", "model", "prompt_len", "gen_len", "budget_gib"])["decode_tok_s"].idxmax()
    return ok.loc[idx].sort_values(["model", "prompt_len", "gen_len", "budget_gib", "system"])


# the H200 profile the peers' runs are predicted on (offexec's own runs carry their prediction from the run)
PEER_PROFILE = "results/profiles/h200_offexec_v2.json"
PEER_POLICY = {"flexgen-ref": "flexgen-ref", "flexgen-4bit-ref": "flexgen-ref", "deepspeed-ref": "static-zero-ref",
               "accelerate-ref": "static-accelerate-ref"}  # the offsim policy that models each peer's own code


def predict_peer(r: dict) -> dict | None:
    """offsim's prediction of a peer run (issue 15: "offsim predicts the peers"): the peer's ``*-ref`` policy
    (``offsim.policies.ref``: the schedule as that system's code runs it) with the run's settings and block, on
    ``PEER_PROFILE`` at the run's GPU budget -- planned from the profile, nothing fitted to the run. None for an
    offexec run, a run without a block, or settings offsim refuses (the reason is not a prediction)."""
    from offsim import Workload, build_plan, get_model, simulate
    from offsim.core.errors import OffsimError
    from offsim.core.specs import get_hardware

    pol = PEER_POLICY.get(r.get("system"))
    gbs, nb = r.get("gpu_batch_size"), r.get("num_gpu_batches")
    if pol is None or r.get("status") != "ok":
        return None
    if gbs is None or gbs != gbs:  # (NaN: a system without FlexGen's block -- one GPU batch of the run's batch)
        gbs, nb = r.get("batch"), 1
    try:
        st = json.loads(r["settings"]) if isinstance(r.get("settings"), str) else (r.get("settings") or {})
        settings = {}
        if pol == "flexgen-ref":
            settings = {"percent": tuple(st["percent"]), "cpu_attention": bool(st.get("cpu_cache_compute")),
                        "compress_weight": bool(st.get("compress_weight")),
                        "compress_cache": bool(st.get("compress_cache"))}
        elif pol == "static-accelerate-ref":
            settings = {"gpu_layers": accelerate_gpu_layers(r, st)}
        hw = get_hardware(PEER_PROFILE, float(r["budget_gib"]))
        wl = Workload(int(r["prompt_len"]), int(r["gen_len"]), int(gbs), int(nb or 1))
        tr = simulate(build_plan(pol, get_model(r["model"]), hw, wl, settings), hw)
        m = tr.metrics()
    except (OffsimError, KeyError, TypeError, ValueError):  # a record without the fields, or settings offsim refuses
        return None
    df = tr.df
    h2d = df.loc[(df["phase"] == "decode") & (df["kind"] == "h2d"), "nbytes"].sum()
    return {"policy": pol, "decode_tok_s": m["decode_tok_s"], "total_tok_s": m["total_tok_s"],
            "prefill_tok_s": m["prefill_tok_s"],
            "decode_h2d_bytes_per_s": float(h2d) / m["decode_s"] if m["decode_s"] else float("nan")}


def accelerate_gpu_layers(r: dict, st: dict) -> int:
    """The decoder layers an Accelerate run kept on the GPU (the device map's, what static-accelerate-ref's
    ``gpu_layers`` prices; its default, 0, is FlexGen's benchmark's map, not ``device_map='auto'``'s): the run's
    ``gpu_layers`` (``accelerate_ref.gpu_modules``, recorded since 2026-12-04), else, for an older record, its
    ``gpu_weight_bytes`` in whole layers -- the GPU tier holds whole decoder layers and the input embeddings, which
    are smaller than one layer in every model of the grid, so the floor is the count. Raises KeyError without
    either (no prediction)."""
    from offsim import get_model
    from offsim.core import footprint as fp

    if st.get("gpu_layers") is not None:
        return int(st["gpu_layers"])
    spec = get_model(r["model"])
    return min(int(st["gpu_weight_bytes"]) // fp.layer_weight_bytes(spec), spec.num_layers)


def _host_state(r) -> tuple[str, str]:
    """The run's host as it started beside the profile's (``common.probe_host``; Accelerate's pageable copy rate,
    ``common.measure_h2d_pageable``, against the profile's ``h2d_pageable`` curve at the same size): what a peer's
    CPU attention and pageable copies ran on, which the VM's host changes from day to day. '–' where the run or
    the profile lacks it (runs before 2026-12-04)."""
    from offsim.analysis.validate import _float_or_nan as num, _profile_host_probe
    from offsim.core.costmodel import interp
    from offsim.core.specs import get_hardware

    prof = _profile_host_probe(PEER_PROFILE) or {}
    probe, prof_ms = num(r.get("host_probe_cpu_attn_ms")), num(prof.get("cpu_attn_ms"))
    a = "–" if probe != probe else f"{probe:.2f} ({'–' if prof_ms != prof_ms else f'{prof_ms:.2f}'})"
    try:
        st = json.loads(r["settings"]) if isinstance(r.get("settings"), str) else (r.get("settings") or {})
    except (KeyError, ValueError):
        st = {}
    rate = num(st.get("h2d_pageable_bytes_per_s"))
    if rate != rate:
        return a, "–"
    from experiments.peers.common import PAGEABLE_PROBE_BYTES

    curve = get_hardware(PEER_PROFILE).h2d_pageable
    return a, f"{rate / 1e9:.1f} ({interp(curve, PAGEABLE_PROBE_BYTES) / 1e9:.1f})"


def _rate_gbps(nbytes, seconds) -> float:
    """GB/s from a record's fields; NaN where either is missing (a record from an older harness) or zero."""
    try:
        return float(nbytes) / float(seconds) / 1e9 if float(seconds) > 0 else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _flexgen_attention_check(r) -> str:
    """For a flexgen-ref run with CPU attention: its measured decode time per (step, layer, GPU batch) -- an upper
    bound on one CPU attention op, since that op runs on FlexGen's main thread between the batch's GPU ops -- beside
    what offsim prices that op at from the profile's ('cpu', 'attn_ctx_flexgen:B') rows at the run's mid-decode
    context (``costmodel.cpu_attention_seconds``). '' when not applicable."""
    from offsim import get_model
    from offsim.core import costmodel as cm
    from offsim.core.specs import get_hardware

    try:
        st = json.loads(r["settings"]) if isinstance(r.get("settings"), str) else (r.get("settings") or {})
        if not st.get("cpu_cache_compute"):
            return ""
        spec = get_model(r["model"])
        gbs, nb, gen = int(r["gpu_batch_size"]), int(r["num_gpu_batches"]), int(r["gen_len"])
        per_op_s = float(r["decode_s"]) / ((gen - 1) * spec.num_layers * nb)
    except (KeyError, TypeError, ValueError):
        return ""
    ctx = int(r["prompt_len"]) + gen / 2
    hw = get_hardware(PEER_PROFILE)
    row = cm.op_table(hw, spec, "cpu", f"attn_ctx_flexgen:{gbs}")
    if row is None:
        return ""
    prof_s = cm.cpu_attention_seconds(spec, hw, gbs, 1, ctx, impl="flexgen")
    c = [x for x, _ in row]
    verdict = ("The profiled op alone takes longer than the measured step: the profile's timing runs slower than "
               "FlexGen's own process ran it." if prof_s > per_op_s else
               f"The other {(per_op_s - prof_s) * 1e3:.1f} ms of the measured step hold the batch's GPU ops, its "
               "copies and the loop's own work.")
    return (f"In the {r['system']} run ({r['model']} {r['prompt_len']}/{gen}, {gbs} x {nb}), a decode (step, layer, "
            f"GPU batch) took {per_op_s * 1e3:.1f} ms in all (GPU ops, copies and the CPU attention, measured); offsim "
            f"prices FlexGen's CPU attention alone at {prof_s * 1e3:.1f} ms for that batch at context {ctx:.0f} "
            f"(contexts up to {c[-1]:.0f} measured). {verdict}")


def _flexgen_profile_notes(prof: dict) -> list[str]:
    """What the peer profile holds of FlexGen's own code, from its rows and provenance (what flexgen-ref reads)."""
    rows = prof.get("op_times", [])
    prov = prof.get("provenance", {})
    timed = (prov.get("flexgen_code_tables") or prov.get("cpu_attention_flexgen_tables") or {}).get("rows_timed", {})
    has_attn = any(str(r[2]).startswith("attn_ctx_flexgen:") for r in rows)
    notes = ["", "flexgen-ref prices FlexGen's own code from the profile (`" + PEER_PROFILE + "`):", ""]
    if has_attn:
        notes.append("- CPU attention: the ('cpu', 'attn_ctx_flexgen:B') rows, timed as "
                     + (", ".join(f"{m}: {w}" for m, w in sorted(timed.items())) or "FlexGen's sequence of ops")
                     + " (`offexec profile --flexgen-only`).")
    else:
        notes.append("- CPU attention: the profile has no ('cpu', 'attn_ctx_flexgen:B') rows, so FlexGen's attention "
                     "is priced at offexec's rate (its 'attn_ctx:B' rows).")
    if prof.get("h2d_relay"):
        big = max(prof["h2d_relay"], key=lambda xy: xy[0])
        notes.append("- Its unpinned KV copies of more than one position (`general_copy` pins a copy of the source "
                     f"first): the profile's relay curves (`h2d_relay` / `d2h_relay`; H2D {big[1] / 1e9:.1f} GB/s at "
                     f"{big[0] / 2**20:.0f} MiB); a decode token's K and V stores (one position: its plain path) at "
                     "the pageable rate.")
    else:
        notes.append("- Its unpinned KV copies: the profile has no relay curves, so they are priced at the pageable "
                     "rate (`h2d_pageable`).")
    st = {str(r[2]).split(":")[1]: r[3] for r in rows if str(r[2]).startswith("store_flexgen:")
          and str(r[0]).startswith("opt/h7168")}
    if st:
        notes.append("- Its prefill KV stores of many positions (its copy threads relaying into a fresh host cache): "
                     "the ('copy', 'store_flexgen:fp16' / ':4bit') rows (`offexec profile --flexgen-only store`); "
                     "at OPT-30B's largest measured stores " + ", ".join(
                         f"{k} {st[k][-1][0] / st[k][-1][1] / 1e9:.1f} GB/s of bytes stored" for k in sorted(st)) + ".")
    dq = {str(r[2]).split(":")[1]: r[3] for r in rows if str(r[2]).startswith("dequant_flexgen:")
          and str(r[0]).startswith("opt/h7168")}
    if dq:
        notes.append("- Its 4-bit decompress: the ('quant', 'dequant_flexgen:weight' / ':cache') rows; at OPT-30B's "
                     "largest measured sizes " + ", ".join(f"{k} {dq[k][-1][0] / dq[k][-1][1] / 1e9:.0f} GB/s"
                                                          for k in sorted(dq))
                     + f" of fp16 output (offexec's own kernels: {prof.get('quant_weight_bytes_per_s', 0) / 1e9:.0f}"
                     f" and {prof.get('quant_bytes_per_s', 0) / 1e9:.0f} GB/s).")
    else:
        notes.append("- Its 4-bit decompress: no 'dequant_flexgen' rows, so offexec's dequantize rates stand in.")
    return notes


def write_outputs(out: Path, journal: list[dict], prov: dict) -> dict:
    """real_throughput.csv (every run), README.md (the best of each system per point, offexec's best fp16 policy
    against each fp16 peer, the link bound) and real_throughput.png (bar chart), all from the journal."""
    from offsim.core.provenance import write_csv

    if not journal:
        (out / "README.md").write_text("\n".join(["# Real throughput: offexec beside the peers' own code (H200)", "",
                                                  "No run yet: see experiments/peers/README.md for the commands.",
                                                  ""] + _FILES))
        return {"rows": 0}
    df = table(journal)
    for i, r in df.iterrows():  # the peers' predictions, made here (offexec's own runs recorded theirs)
        pr = predict_peer(r.to_dict())
        if pr is not None:
            df.loc[i, ["predicted_decode_tok_s", "predicted_total_tok_s", "predicted_decode_h2d_bytes_per_s"]] = [
                pr["decode_tok_s"], pr["total_tok_s"], pr["decode_h2d_bytes_per_s"]]
            df.loc[i, "predicted_policy"] = pr["policy"]
    # each decode step's time stays in runs.jsonl (a list per run; a CSV cell would hold it as text)
    write_csv(df.drop(columns=["decode_step_ms"], errors="ignore"), out / "real_throughput.csv", prov)
    b = best(df)
    plot(b, out / "real_throughput.png")
    (out / "README.md").write_text(readme(df, b, prov, out))
    return {"rows": len(df), "ok": int((df["status"] == "ok").sum()), "points_with_results": int(
        b.groupby(["model", "prompt_len", "gen_len", "budget_gib"]).ngroups) if not b.empty else 0}


def _fmt(x, nd=1):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "–"
    return "–" if not math.isfinite(x) else f"{x:.{nd}f}"


def readme(df, b, prov: dict, out: Path | None = None) -> str:
    lines = ["# Real throughput: offexec beside the peers' own code (H200)", "",
             "Generated by `python -m experiments.real_throughput --report` from `runs.jsonl`; every run is a row "
             "of `real_throughput.csv`. Throughputs follow FlexGen's definitions; `link bound` is each run's "
             "decode H2D bytes over the measured pinned H2D rate. Provenance: "
             f"commit {prov.get('commit')}, {prov.get('date')}.", ""]
    if b.empty:
        lines.append("No run has succeeded yet.")
    else:
        lines += ["## Best of each system per workload (decode tok/s)", "",
                  "| model | prompt | gen | budget GiB | system | batch | prefill tok/s | decode tok/s | total tok/s | "
                  "link bound | of bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in b.iterrows():
            lb = r.get("link_bound_decode_tok_s")
            frac = (float(r["decode_tok_s"]) / float(lb)) if lb not in (None, 0) and lb == lb else None
            proj = f" (projected from {int(r['measured_steps']) + 1} tokens)" if _projected(r) else ""
            lines.append(f"| {r['model']} | {r['prompt_len']} | {r['gen_len']} | {r['budget_gib']:g} | "
                         f"{r['system']}{proj} | {r['batch']} | {_fmt(r['prefill_tok_s'], 0)} | {_fmt(r['decode_tok_s'], 2)} | "
                         f"{_fmt(r['total_tok_s'], 2)} | {_fmt(lb, 2)} | "
                         f"{'–' if frac is None else f'{frac:.0%}'} |")
        over = [r for _, r in b.iterrows() if r.get("link_bound_decode_tok_s") == r.get("link_bound_decode_tok_s")
                and r.get("link_bound_decode_tok_s") and float(r["decode_tok_s"]) > float(r["link_bound_decode_tok_s"])]
        if any(_projected(r) for _, r in b.iterrows()):
            lines += ["", "Rows marked projected ran `--cut-gen-len`: they generated that many tokens and their decode "
                      "time is the measured steps plus a straight line through them for the rest "
                      "(`experiments/peers/accelerate_ref.py` `project_decode_s`, as FlexGen's own benchmarks project "
                      "a cut run): a whole generation would outlast a device call."]
        if over:  # a run cannot beat the link: its bound's denominator (measured in that run) came out low
            lines += ["", "Above 100 % of its bound: " + ", ".join(
                f"{r['system']} ({float(r['h2d_bytes_per_s']) / 1e9:.1f} GB/s measured in its run)" for r in over)
                + ". No run can move its bytes faster than the link, so that run's rate measurement came out low: "
                "`experiments/peers/common.py` `measure_h2d` took the median of five 256 MB copies until commit "
                "bdcfc66, and takes the fastest of ten since."]
        lines += ["", "## offexec's best fp16 policy against each fp16 peer's best (decode tok/s ratio; target ≥ 2)",
                  "", "| model | prompt | gen | budget GiB | offexec best | " + " | ".join(
                      p for p in PEERS if p != "flexgen-4bit-ref") + " |",
                  "|---|---|---|---|---|" + "---|" * (len(PEERS) - 1)]
        for (m, p, g, bud), grp in b.groupby(["model", "prompt_len", "gen_len", "budget_gib"]):
            ox = grp[grp["system"].str.startswith("offexec-") & ~grp["system"].str.endswith("+4bit")]
            if ox.empty:
                continue
            top = ox.loc[ox["decode_tok_s"].astype(float).idxmax()]
            cells = []
            for peer in PEERS:
                if peer == "flexgen-4bit-ref":
                    continue
                pr = grp[grp["system"] == peer]
                cells.append("–" if pr.empty else f"×{float(top['decode_tok_s']) / float(pr['decode_tok_s'].iloc[0]):.2f}")
            lines.append(f"| {m} | {p} | {g} | {bud:g} | {top['system']} {_fmt(top['decode_tok_s'], 2)} | "
                         + " | ".join(cells) + " |")
        lines += ["", "## offexec's best 4-bit policy against FlexGen's own 4-bit mode (decode tok/s ratio; target ≥ 2)",
                  "", "| model | prompt | gen | budget GiB | offexec best 4-bit | flexgen-4bit-ref | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for (m, p, g, bud), grp in b.groupby(["model", "prompt_len", "gen_len", "budget_gib"]):
            ox = grp[grp["system"].str.startswith("offexec-") & grp["system"].str.endswith("+4bit")]
            pr = grp[grp["system"] == "flexgen-4bit-ref"]
            if ox.empty or pr.empty:
                continue
            top = ox.loc[ox["decode_tok_s"].astype(float).idxmax()]
            ref = float(pr["decode_tok_s"].iloc[0])
            lines.append(f"| {m} | {p} | {g} | {bud:g} | {top['system']} {_fmt(top['decode_tok_s'], 2)} | "
                         f"{_fmt(ref, 2)} | ×{float(top['decode_tok_s']) / ref:.2f} |")
    pred = df[(df["status"] == "ok") & df["system"].isin(list(PEER_POLICY)) & df["predicted_decode_tok_s"].notna()] \
        if "predicted_policy" in df.columns else df.iloc[:0]
    if not pred.empty:
        lines += ["", "## offsim's prediction of each peer run (target: within 15 %)", "",
                  f"Each peer's `*-ref` policy (the schedule as that system's code runs it, `offsim/policies/ref.py`) "
                  f"with the run's settings and block, on `{PEER_PROFILE}` at the run's budget, simulated when this "
                  "report was written (nothing fitted to the run). Error = (predicted - measured) / measured.", "",
                  "| system | model | prompt | gen | budget GiB | batch | offsim policy | decode tok/s | offsim decode "
                  "| decode error | total tok/s | offsim total | total error | decode H2D GB/s | offsim "
                  "| host probe ms (profile's) | host copy GB/s at start | pageable H2D GB/s at start (profile's) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in pred.iterrows():
            md, pd_ = float(r["decode_tok_s"]), float(r["predicted_decode_tok_s"])
            mt, pt = float(r["total_tok_s"]), float(r["predicted_total_tok_s"])
            # decode's host-to-GPU bytes over decode's time: the link's effective rate, measured and predicted
            mh = _rate_gbps(r.get("decode_h2d_bytes"), r.get("decode_s"))
            ph = _rate_gbps(r.get("predicted_decode_h2d_bytes_per_s"), 1.0)
            # the host's state at the run's start: its CPU-attention probe, its memory-copy rate (a slow host
            # slowed DeepSpeed's fetches: results/real_throughput/ds_control_h100_bb16235), its pageable copies
            probe_ms, pageable = _host_state(r)
            lines.append(f"| {r['system']} | {r['model']} | {r['prompt_len']} | {r['gen_len']} | {r['budget_gib']:g} "
                         f"| {r['batch']} | {r['predicted_policy']} | {md:.2f} | {pd_:.2f} | {(pd_ - md) / md:+.1%} | "
                         f"{mt:.2f} | {pt:.2f} | {(pt - mt) / mt:+.1%} | {mh:.1f} | {ph:.1f} | "
                         f"{probe_ms} | {_fmt(r.get('host_probe_copy_GB_s'))} | {pageable} |")
        if (pred["predicted_policy"] == "flexgen-ref").any():
            lines += _flexgen_profile_notes(json.loads(Path(PEER_PROFILE).read_text()))
            lines += [""] + [_flexgen_attention_check(r) for _, r in pred.iterrows()
                             if r["predicted_policy"] == "flexgen-ref" and _flexgen_attention_check(r)]
            for _, r in pred[pred["system"] == "flexgen-4bit-ref"].iterrows():
                mh = _rate_gbps(r.get("decode_h2d_bytes"), r.get("decode_s"))
                ph = _rate_gbps(r.get("predicted_decode_h2d_bytes_per_s"), 1.0)
                lines += ["", f"In the {r['system']} run ({r['model']} {r['prompt_len']}/{r['gen_len']}, batch "
                          f"{r['batch']:.0f}) decode moved its host-to-GPU bytes at {mh:.1f} GB/s over decode's whole "
                          f"time; offsim's plan moves them at {ph:.1f}."]
    lines += coverage_lines(df)
    notok = df[df["status"] != "ok"]
    answered = notok["key"].isin(set(df.loc[df["status"] == "ok", "key"]))  # another run of the key has a result
    bad = notok[~answered]
    if not notok.empty:
        lines += ["", "## Runs without a result", ""]
    if not bad.empty:
        lines += ["| system | model | prompt | gen | budget | batch | status | reason |", "|---|---|---|---|---|---|---|---|"]
        for _, r in bad.iterrows():
            lines.append(f"| {r['system']} | {r['model']} | {r['prompt_len']} | {r['gen_len']} | {r['budget_gib']} | "
                         f"{r.get('batch')} | {r['status']} | {str(r.get('reason') or '')[:160]} |")
    elif not notok.empty:
        lines.append("None left.")
    if answered.any():
        lines += ["", "Attempts without a result whose workload another run of the same key answered (kept in the "
                  "CSV): "
                  + "; ".join(f"{r['system']} {r['model']} {r['prompt_len']}/{r['gen_len']} at {r['budget_gib']:g} GiB "
                              f"({r['status']}: {str(r.get('reason') or '')[:120]})"
                              for _, r in notok[answered].iterrows()) + "."]
    lines += ["", "![best decode tok/s per system and workload](real_throughput.png)", ""]
    lines += _FILES
    if out is not None:  # a device call returns a limited number of files: say which runs' logs did not come back
        lost = sorted(k for k in df.loc[df["status"] == "ok", "key"] if not (out / "logs" / log_name(k)).exists())
        if lost:
            lines += [f"Runs whose log is not in `logs/` ({len(lost)}; their records in the journal are complete): "
                      + ", ".join(f"`{k}`" for k in lost) + ".", ""]
    return "\n".join(lines)


COVERAGE_COLUMNS = (("offexec fp16", lambda s: s.startswith("offexec-") and "+4bit" not in s),
                    ("offexec 4-bit", lambda s: s.startswith("offexec-") and "+4bit" in s),
                    *((peer, lambda s, peer=peer: s == peer) for peer in SYSTEMS[1:]))


def coverage_lines(df) -> list[str]:
    """The issue's grid (``points`` of the default models, prompts, generation lengths and budgets) by system: the
    best decode tok/s measured at each point, 'n/a' where the system does not run the model, '–' where nothing has
    answered yet; and how many cells are filled."""
    ok = df[df["status"] == "ok"]
    rows = ["", "## Coverage of the grid (best decode tok/s measured; – not yet run)", "",
            "| model | prompt | gen | budget GiB | " + " | ".join(c for c, _ in COVERAGE_COLUMNS) + " |",
            "|---|---|---|---|" + "---|" * len(COVERAGE_COLUMNS)]
    filled = total = 0
    for m, p, g, b in points(MODELS, PROMPTS, GENS, BUDGETS):
        at = ok[(ok["model"] == m) & (ok["prompt_len"] == p) & (ok["gen_len"] == g) & (ok["budget_gib"] == b)]
        cells = []
        for name, is_it in COVERAGE_COLUMNS:
            if name.startswith("flexgen") and not m.startswith("opt"):
                cells.append("n/a")
                continue
            total += 1
            hit = at[[is_it(s) for s in at["system"]]]
            if hit.empty:
                cells.append("–")
            else:
                filled += 1
                cells.append(_fmt(hit["decode_tok_s"].astype(float).max(), 2))
        rows.append(f"| {m} | {p} | {g} | {b:g} | " + " | ".join(cells) + " |")
    rows += ["", f"{filled} of {total} cells measured."]
    return rows


_FILES = ["## Files", "",
          "- `runs.jsonl`: the journal, one record per run (every field the worker printed); what the rest is made "
          "from.",
          "- `real_throughput.csv`: every run, provenance on the first line; `status` ok / oom / host_oom / timeout / "
          "error / unsupported / skipped with `reason`; `settings` as JSON (FlexGen's policy, Accelerate's device map "
          "tiers, DeepSpeed's ZeRO config, offexec's searched settings).",
          "- `flexgen_candidates.json`, `offexec_settings.json`: the plans of every point, made with `--plan-only` on "
          "a CPU machine (offsim's LP and search), so the GPU machine runs them without an LP solver and every call "
          "of a resumed grid runs the same list.",
          "- `logs/`: each run's stdout and stderr.", ""]


def plot(b, path: Path) -> None:
    """Grouped bars: per workload, each system's best decode tok/s, log scale; a tick at each bar's link bound."""
    from experiments.common import pyplot

    if b.empty:
        return
    plt = pyplot()
    groups = list(b.groupby(["model", "prompt_len", "gen_len", "budget_gib"]))
    systems = sorted(b["system"].unique())
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(systems)) / 3), 4.5))
    w = 0.8 / max(len(systems), 1)
    cmap = plt.get_cmap("tab10")
    for si, s in enumerate(systems):
        xs, ys, lbs = [], [], []
        for gi, (_, grp) in enumerate(groups):
            r = grp[grp["system"] == s]
            if r.empty:
                continue
            xs.append(gi + (si - (len(systems) - 1) / 2) * w)
            ys.append(float(r["decode_tok_s"].iloc[0]))
            lb = r["link_bound_decode_tok_s"].iloc[0]
            lbs.append(float(lb) if lb is not None and lb == lb else float("nan"))
        ax.bar(xs, ys, width=w, label=s, color=cmap(si % 10))
        ax.scatter(xs, lbs, marker="_", s=200, color="black", zorder=3)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{p}/{g}, {bud:g} GiB" for (m, p, g, bud), _ in groups], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("decode tok/s (best run; – : link bound)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("--out", default=str(RESULTS / "real_throughput"))
    ap.add_argument("--only", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS), metavar="SYSTEM",
                    help=f"systems to run ({', '.join(SYSTEMS)})")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--prompts", nargs="+", type=int, default=list(PROMPTS))
    ap.add_argument("--gens", nargs="+", type=int, default=list(GENS))
    ap.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    ap.add_argument("--offexec-policies", nargs="+", default=None, help="default: experiments.peers.offexec_run's")
    ap.add_argument("--quick", action="store_true", help="OPT-30B, 512/32, 16 GiB, one FlexGen policy per mode")
    ap.add_argument("--flexgen-k", type=int, default=3, help="FlexGen policies run per point (best reported)")
    ap.add_argument("--cut-gen-len", type=cut_gen_len_arg, default=None, metavar="N",
                    help="Accelerate and DeepSpeed: where --gens is longer, generate N tokens and project the decode "
                         "from their steps (a straight line; rows marked projected in the README), for runs whose "
                         "whole generation outlasts a device call (Accelerate at OPT-30B: ~10 s a token)")
    ap.add_argument("--timeout-s", type=float, default=480.0, help="per run")
    ap.add_argument("--time-limit-s", type=float, default=560.0, help="start no run past this (one device call)")
    ap.add_argument("--min-left-s", type=float, default=60.0, help="start no run with less than this left")
    ap.add_argument("--commit", default=None, help="the commit these runs are of (no .git on the GPU machine)")
    ap.add_argument("--retry", nargs="*", default=[], choices=["timeout", "oom", "host_oom", "skipped"],
                    help="statuses to run again (e.g. timeout, with a longer --timeout-s)")
    ap.add_argument("--rerun", action="store_true",
                    help="run the selected jobs again even if answered (after an executor change): the new record "
                         "replaces the old one in the tables, runs.jsonl keeps both, the log appends")
    ap.add_argument("--dry-run", action="store_true", help="list the jobs (and which are answered), run nothing")
    ap.add_argument("--plan-only", action="store_true", help="on any machine: plan every point -- FlexGen's "
                    "candidate policies and offexec's searched settings -- into OUT's caches, run nothing (the GPU "
                    "machine then needs no LP solver)")
    ap.add_argument("--report", action="store_true", help="only rewrite CSV, chart and README from the journal")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.quick:
        args.models, args.prompts, args.gens, args.budgets, args.flexgen_k = ["opt-30b"], [512], [32], [16.0], 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "runs.jsonl"
    prov = provenance(argv)
    if args.commit:
        prov["commit"] = args.commit
    if args.report:
        s = write_outputs(out, read_journal(jpath), prov)
        finish({"experiment": "real_throughput", "report": str(out), **s})
        return 0
    cpath = out / "flexgen_candidates.json"
    cache = json.loads(cpath.read_text()) if cpath.exists() else {}
    spath = out / "offexec_settings.json"
    if args.plan_only:
        return plan_only(args, out, cache, cpath, spath, t_start)

    gpu = "" if args.dry_run else gpu_name()
    prov["gpu"] = gpu
    check_same_gpu(read_journal(jpath), gpu, jpath)

    def all_jobs():
        for (m, p, g, b) in points(args.models, args.prompts, args.gens, args.budgets):
            for system in args.only:
                n = len(cache)
                yield from jobs_for_point(system, m, p, g, b, args.flexgen_k, args.offexec_policies, cache,
                                          str(spath) if spath.exists() else None, str(out / "traces"),
                                          args.cut_gen_len)
                if len(cache) != n:
                    cpath.write_text(json.dumps(cache, indent=1))

    ran = skipped = 0
    stopped = None
    todo = []
    for job in all_jobs():
        todo.append(job)
        journal = read_journal(jpath)
        done, batch = job_state(job, journal, tuple(args.retry))
        if args.dry_run:
            state = "todo" if not done else "rerun" if args.rerun and job["argv"] is not None else "done"
            print(f"{state}  {job['keys'][0]}{'' if batch is None else f' (batch {batch})'}"
                  f"  {' '.join(job['argv'] or ['(no run)'])}")
            continue
        if done and not (args.rerun and job["argv"] is not None):
            skipped += 1
            continue
        if job["argv"] is None:  # answered without a run (an OPT-only peer on a Llama, nothing fits)
            rec = {"system": job["system"], **_point_fields(job["keys"][0]), "key": job["keys"][0], **job["record"],
                   **{k: prov.get(k) for k in RUN_FIELDS}}
            append_journal(jpath, [rec])
            continue
        last_batch = None
        while True:
            last_batch = batch
            left = args.time_limit_s - (time.perf_counter() - t_start)
            if left < args.min_left_s:
                stopped = f"call time limit: {left:.0f} s left"
                break
            print(f"run {job['keys'][0]}{'' if batch is None else f' --batch {batch}'} (timeout "
                  f"{min(args.timeout_s, left):.0f} s)", flush=True)
            recs, cut = run_job(job, out, min(args.timeout_s, left), prov, batch)
            if cut and left < args.timeout_s:  # cut by this call's limit, not its own: leave it for the next call
                print("  cut by the call's time limit; not recorded (rerun to resume)", flush=True)
                stopped = "call time limit"
                break
            append_journal(jpath, recs)
            ran += 1
            for r in recs:
                print(f"  {r.get('system')}: {r.get('status')} batch {r.get('batch')} decode "
                      f"{_fmt(r.get('decode_tok_s'), 2)} total {_fmt(r.get('total_tok_s'), 2)} tok/s "
                      f"{str(r.get('reason') or '')[:120]}", flush=True)
            write_outputs(out, read_journal(jpath), prov)
            done, batch = job_state(job, read_journal(jpath), tuple(args.retry))
            if done or batch is None or batch == last_batch:
                break
        if stopped:
            break
    s = write_outputs(out, read_journal(jpath), prov) if not args.dry_run else {}
    remaining = sum(1 for j in todo if not job_state(j, read_journal(jpath), tuple(args.retry))[0])
    finish({"experiment": "real_throughput", "ran": ran, "answered_before": skipped, "remaining_jobs": remaining,
            "stopped": stopped, "elapsed_s": time.perf_counter() - t_start, **s})
    return 0


def plan_only(args, out: Path, cache: dict, cpath: Path, spath: Path, t_start: float) -> int:
    """``--plan-only``: FlexGen's candidates and offexec's settings of every point into OUT's caches."""
    from experiments.peers.offexec_run import DEFAULT_POLICIES, run_point

    scache = json.loads(spath.read_text()) if spath.exists() else {}
    n = 0
    for (m, p, g, b) in points(args.models, args.prompts, args.gens, args.budgets):
        for system in args.only:
            if system == "offexec":
                recs = run_point(m, p, g, b, list(args.offexec_policies or DEFAULT_POLICIES), device="cpu",
                                 only_plan=True, cache=scache)
                spath.write_text(json.dumps(scache, indent=1, default=str))
                for r in recs:
                    print(f"{r['system']} {m} {p}/{g} {b:g} GiB: {r['status']} batch {r.get('batch')} predicted "
                          f"decode {_fmt(r.get('predicted_decode_tok_s'), 2)} {str(r.get('reason') or '')[:100]}",
                          flush=True)
            elif system in ("flexgen-ref", "flexgen-4bit-ref"):
                jobs = jobs_for_point(system, m, p, g, b, args.flexgen_k, cache=cache)
                cpath.write_text(json.dumps(cache, indent=1))
                print(f"{system} {m} {p}/{g} {b:g} GiB: " + ", ".join(j["keys"][0].split("|")[-1] for j in jobs),
                      flush=True)
            n += 1
    finish({"experiment": "real_throughput", "plan_only": True, "planned": n, "flexgen_candidates": str(cpath),
            "offexec_settings": str(spath), "elapsed_s": time.perf_counter() - t_start})
    return 0


def _point_fields(key: str) -> dict:
    _, model, p, g, b = key.split("|")[:5]
    return {"model": model, "prompt_len": int(p[1:]), "gen_len": int(g[1:]), "budget_gib": float(b[1:])}


if __name__ == "__main__":
    sys.exit(main())
