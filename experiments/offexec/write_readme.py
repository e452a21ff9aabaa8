"""README of an ``experiments.offexec.h200`` results folder: one table per workload sub-folder (its
``offexec_h200.json``), and issue 14's targets checked against them. Every figure comes from those files.

    python -m experiments.offexec.write_readme results/offexec/h200_265e402
    python -m experiments.offexec.write_readme results/offexec/h200_0b8e77a --before results/offexec/h200_265e402

``--before DIR``: an earlier folder of the same workloads, whose host issue (total and by handler) is set beside
this one's, run by run -- what a change to the executor did to the issuing thread.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from experiments.common import argparser, provenance
from experiments.offexec.profile_card import measured_gpu
from offsim.core.plan import RUN_AHEAD_OPS

GiB = 2 ** 30
ISSUE_FRAC_MAX = 0.05  # issue 14: host issue <= 5 % of the run
TIGHTLLM_DECODE_MIN = 39.0  # issue 14: TightLLM >= 39 decode tok/s at OPT-30B 512/32, 16 x 3, 16 GiB
LINK_BOUND_MIN = 0.98  # issue 14: FlexGen's placement >= 98 % of its link bound
OFFSIM_ERR_MAX = 0.03  # issue 14: offsim within 3 % (decode and total)


def _runs(folder: Path) -> list[tuple[str, dict, dict]]:
    out = []
    for f in sorted(folder.glob("*/offexec_h200.json")):
        d = json.loads(f.read_text())
        for r in d["runs"]:
            if "failed" not in r:
                out.append((f.parent.name, d, r))
    return out


def _table(runs) -> str:
    head = ["config", "fit", "N_r", "prefill tok/s (offsim)", "decode tok/s (offsim)", "total tok/s (offsim)",
            "decode error", "total error", "% of link bound", "decode H2D GB/s (stream busy)", "host issue % of run",
            "GPU idle on the host", "GPU peak GiB"]
    # the flow-control windows, where a run was given other than the plans' default (`h200 --run-ahead`)
    windows = any(r.get("run_ahead", list(RUN_AHEAD_OPS)) != list(RUN_AHEAD_OPS) for _, _, r in runs)
    if windows:
        head.append("run-ahead (compute, h2d, d2h)")
    beyond = any(_beyond_plan(r) for _, _, r in runs)  # a run given more GPU memory than its plan
    if beyond:
        head.append("run budget GiB (runtime)")
    rows = []
    for _, d, r in runs:
        m, p, e = r["measured"], r["predicted"], r["error"]
        nr = r.get("recompute_tokens_min_max") or [0, 0]
        rows.append([r["config"], "FIT" if r["config"] in d.get("fits", []) else "",
                     f"{nr[0]}-{nr[1]}" if nr[1] else "0",
                     f"{m['prefill_tok_s']:,.0f} ({p['prefill_tok_s']:,.0f})",
                     f"**{m['decode_tok_s']:.2f}** ({p['decode_tok_s']:.2f})",
                     f"{m['total_tok_s']:.2f} ({p['total_tok_s']:.2f})",
                     f"{e['decode_tok_s']:+.1%}", f"{e['total_tok_s']:+.1%}",
                     f"{r['decode_link_bound_frac']:.1%}", _h2d_cell(r), f"{r['issue_frac']:.1%}",
                     f"{r['host_bound_idle_frac']:.2%}" if r.get("host_bound_idle_frac") is not None else "",
                     f"{r['peak_gpu_reserved_bytes'] / GiB:.2f}"])
        if windows:
            w = r.get("run_ahead", list(RUN_AHEAD_OPS))  # (runs before the field: the default)
            rows[-1].append("unbounded" if w is None else " ".join(map(str, w)))
        if beyond:
            rows[-1].append(f"{r['budget_bytes'] / GiB:g}" + (f" ({', '.join(sorted(r['runtime']))})"
                                                               if r.get("runtime") else ""))
    return "\n".join(["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
                     + ["| " + " | ".join(x) + " |" for x in rows])


@functools.lru_cache(maxsize=None)
def _profile(hardware: str) -> dict:
    """The profile JSON a run was planned on, {} where it is a preset or not readable here (read once: every run of
    a folder names it)."""
    path = Path(hardware)
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _profile_gpu(hardware: str) -> str:
    """The GPU a run's profile was measured on, '' where that is unknown."""
    return measured_gpu(_profile(hardware))


def _profile_h2d(hardware: str) -> float | None:
    """The profile's pinned host-to-GPU rate for its largest copy (B/s): what offsim priced the runs' copies at."""
    curve = _profile(hardware).get("h2d_pinned")
    return float(max(curve)[1]) if curve else None


def _h2d_cell(r: dict) -> str:
    """The rate decode's host-to-GPU copies moved their bytes at while they ran, and the share of decode the H2D
    stream was busy: a run below its link bound with the stream busy throughout was held by the link itself (its
    copies ran slower than the in-process probe), not by the executor."""
    rate, busy = r.get("decode_h2d_achieved_bytes_per_s"), r.get("decode_h2d_stream_busy_frac")
    if rate is None or busy is None:
        return ""
    return f"{rate / 1e9:.1f} ({busy:.1%})"


def _beyond_plan(r: dict) -> bool:
    """A run given more GPU memory than its plan was made for (the recompute split's runs of 2026-12-04,
    ``results/offexec/split_a518028/``: ``plan_budget_bytes`` below the run's ``budget_bytes``)."""
    return r.get("plan_budget_bytes", r["budget_bytes"]) < r["budget_bytes"]


def _targets(runs) -> str:
    lines = ["| target | run | measured | |", "| --- | --- | --- | --- |"]
    ok = lambda b: "met" if b else "**missed**"  # noqa: E731
    for sub, d, r in runs:
        if r["config"] in d.get("fits", []) or _beyond_plan(r):
            continue  # a fit, or a run beyond its plan's budget, is no evidence for a target
        name = f"{sub} {r['config']}"
        lines.append(f"| host issue <= {ISSUE_FRAC_MAX:.0%} of the run | {name} | {r['issue_frac']:.1%} | "
                     f"{ok(r['issue_frac'] <= ISSUE_FRAC_MAX)} |")
        if r["policy"] == "tightllm" and sub == "p512_g32":
            dec = r["measured"]["decode_tok_s"]
            lines.append(f"| TightLLM >= {TIGHTLLM_DECODE_MIN:g} decode tok/s, planned from the profile alone | "
                         f"{name} | {dec:.2f} | {ok(dec >= TIGHTLLM_DECODE_MIN)} |")
        if r["config"] == "flexgen_gpu_attn":
            f = r["decode_link_bound_frac"]
            lines.append(f"| FlexGen's placement >= {LINK_BOUND_MIN:.0%} of its link bound | {name} | {f:.1%} | "
                         f"{ok(f >= LINK_BOUND_MIN)} |")
        e = max(abs(r["error"]["decode_tok_s"]), abs(r["error"]["total_tok_s"]))
        lines.append(f"| offsim within {OFFSIM_ERR_MAX:.0%} (decode and total) | {name} | "
                     f"{r['error']['decode_tok_s']:+.1%} / {r['error']['total_tok_s']:+.1%} | "
                     f"{ok(e <= OFFSIM_ERR_MAX)} |")
    return "\n".join(lines)


def _issue_against(runs, before: Path) -> str:
    """Host issue of each run here beside the same (workload, config) in ``before``: seconds, share of the run, and
    the handlers that moved most."""
    old = {(s, r["config"]): r for s, _, r in _runs(before)}
    lines = [f"## Host issue against `{before}`", "",
             "| run | issue s before | issue s now | % of run before | % of run now | handlers that moved most (s, "
             "before -> now) |", "| --- | --- | --- | --- | --- | --- |"]
    for sub, _, r in runs:
        o = old.get((sub, r["config"]))
        if o is None:
            continue
        a, b = o.get("issue_s_by_handler", {}), r.get("issue_s_by_handler", {})
        moved = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))[:3]
        lines.append(f"| {sub} {r['config']} | {o['issue_s']:.2f} | {r['issue_s']:.2f} | {o['issue_frac']:.1%} | "
                     f"{r['issue_frac']:.1%} | "
                     + "; ".join(f"{k} {a.get(k, 0.0):.2f} -> {b.get(k, 0.0):.2f}" for k in moved) + " |")
    return "\n".join(lines) + "\n"


def write(folder: Path, before: Path | None = None) -> Path:
    runs = _runs(folder)
    if not runs:
        raise SystemExit(f"no */offexec_h200.json runs under {folder}")
    subs = sorted({s for s, _, _ in runs})
    parts = []
    for sub in subs:
        rs = [x for x in runs if x[0] == sub]
        d = rs[0][1]
        wl, pv = d["workload"], d["provenance"]
        h2d = _profile_h2d(d["hardware"])
        link = d.get("link", {})
        parts.append(
            f"### `{sub}`: {d['model']}, prompt {wl['prompt_len']}, gen {wl['gen_len']}, "
            f"{wl['gpu_batch_size']} x {wl['num_gpu_batches']}, {d['budget_gib']:g} GiB\n\n"
            f"`{pv.get('command')}` -- commit {pv.get('commit')}, {pv.get('date', '')[:16]}Z, {pv.get('gpu')}, "
            f"torch {pv.get('torch')}; planned and predicted on `{d['hardware']}`. Pinned copies measured in the "
            f"same process: H2D {link.get('h2d_bytes_per_s', 0) / 1e9:.1f} GB/s, D2H "
            f"{link.get('d2h_bytes_per_s', 0) / 1e9:.1f} GB/s, H2D beside D2H "
            f"{link.get('duplex_h2d_bytes_per_s', 0) / 1e9:.1f} GB/s"
            + (f", H2D over a whole pass of the pinned weights {link['sweep_h2d_bytes_per_s'] / 1e9:.1f} GB/s"
               if link.get("sweep_h2d_bytes_per_s") else "")
            + (f"; the profile's pinned H2D (largest copy): {h2d / 1e9:.1f} GB/s" if h2d else "")
            + f".\n\n{_table(rs)}\n")
    prov = provenance()
    cmd = f"python -m experiments.offexec.write_readme {folder}" + (f" --before {before}" if before else "")
    gpus = sorted({str(d["provenance"].get("gpu")) for _, d, _ in runs})
    card = " and ".join(g.replace("NVIDIA ", "") for g in gpus)
    profiled = {_profile_gpu(d["hardware"]) for _, d, _ in runs}
    if all("H200" in g for g in gpus):
        other = ""
    elif profiled == set(gpus):
        other = (f" The runs here are on {'an' if card[:1] in 'AEH' else 'a'} {card}, not the H200 issue 14's targets"
                 " name; offsim planned and predicted them on that card's own profile, measured by `offexec profile`"
                 " on it before the runs.")
    else:
        other = (f" The runs here are on {'an' if card[:1] in 'AEH' else 'a'} {card}, not the H200 issue 14's"
                 " targets name; offsim planned and predicted them on another card's profile"
                 f" ({', '.join(sorted(g or 'unknown' for g in profiled))}): no accuracy claim.")
    text = f"""# offexec on the {card}, planned from the profile alone

Generated by `{cmd}` (commit {prov['commit']}, {prov['date'][:10]})
from the `offexec_h200.json` files below; do not edit by hand. Each sub-folder also holds the measured traces
(`trace_<config>.csv.gz`, offsim's trace schema), offsim validation cases made from them (`case_<config>.json`) and
the run's log. Configurations (`experiments/offexec/h200.py`): `flexgen_gpu_attn` FlexGen's schedule with attention
on the GPU; `tightllm` TightLLM planned by offsim on the profile (KV distributor `exact`); `flexgen_cpu_attn`
FlexGen's CPU delegation; `tightllm_held` TightLLM with each GPU batch's N_r held over the run (`hold_recompute`),
`tightllm_graph_recompute` that, every recompute op a CUDA graph over the written rows (`graph_recompute`),
`tightllm_held_split` (2026-12-04 only) the same plan with its recompute ops as two CUDA graphs around eager
attention (`offexec run --split-recompute-graphs`, an experiment since removed). "GPU idle on the host" is the time GPU compute waited for the host to
issue its next op (issue time that overlapped GPU work is not counted); "host issue" is all the issuing thread's time
in op handlers. "Decode H2D GB/s" is the rate decode's host-to-GPU copies moved their bytes at while they ran, with
the share of decode the H2D stream was busy: a run below its link bound whose stream was busy throughout was held by
the link (its copies ran slower than the probe's), not by the executor. A run marked FIT was planned on its own measurements, and a run given more GPU memory than its plan
(a run budget column, where there is one) ran beyond what offsim planned: neither is evidence for a target.{other}

{chr(10).join(parts)}
## Issue 14's targets

{_targets(runs)}
"""
    if before is not None:
        text += "\n" + _issue_against(runs, before)
    out = folder / "README.md"
    out.write_text(text)
    return out


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="an earlier folder of the same workloads: its host issue beside this one's")
    a = ap.parse_args(argv)
    print(f"wrote {write(a.folder, a.before)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
