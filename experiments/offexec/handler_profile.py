"""Where a decode layer op's host time goes, from `offexec run --host-profile` (cProfile of the issuing thread).

Issue 14's host-issue target: TightLLM's recompute ops (q = N_r + 1 query tokens) cost the issuing thread most of
its time. Given the ``.pstats`` and the run's log of one or more runs, this writes ``README.md``'s table (generated;
never edit): per run the host time by handler (from the log's JSON), then the calls that make up the layer handler
(`_op_layer`) -- its callees' cumulative time per call -- and the graph machinery's calls (capture, replay, the
static copies), so that eager and graphed runs of one plan can be read side by side. Also, from the traces of
``--traces`` runs, the mean GPU time of a decode layer op at each step (what the graphs cost on the GPU).

    python -m experiments.offexec.handler_profile results/offexec/host_profile_cf26d6a --about about.md \
        [--traces results/offexec/graph_recompute_b76e16a/p512_eager.trace.csv.gz ...]

cProfile slows the issuing thread (each profiled call costs ~1 us more), so its times are relative: they say which
calls hold the handler's time, not the time a run without the profiler spends.
"""
from __future__ import annotations

import csv
import gzip
import json
import pstats
import re
from collections import defaultdict
from pathlib import Path
from experiments.common import argparser

# (label, regex over pstats' 'file:line(function)' key) of the calls reported; first match wins
CALLS = (
    ("layer handler (_op_layer)", r"executor\.py:\d+\(_op_layer\)"),
    ("  pre-attention (model.pre_attn)", r"model\.py:\d+\(pre_attn\)"),
    ("  KV write + attention (_attend_gpu)", r"executor\.py:\d+\(_attend_gpu\)"),
    ("    attention (model.attention)", r"model\.py:\d+\(attention\)"),
    ("    lower-right causal dispatch (CausalBias._dispatch)", r"bias\.py:\d+\(_dispatch\)"),
    ("    flash kernel call", r"_scaled_dot_product_flash_attention"),
    ("  post-attention (model.post_attn)", r"model\.py:\d+\(post_attn\)"),
    ("  weight views (_weights)", r"executor\.py:\d+\(_weights\)"),
    ("  through a graph (_graphed)", r"executor\.py:\d+\(_graphed\)"),
    ("graph: run (graphs.run)", r"graphs\.py:\d+\(run\)"),
    ("graph: capture (graphs._capture)", r"graphs\.py:\d+\(_capture\)"),
    ("graph: capture_end (instantiate)", r"graphs\.py:\d+\(capture_end\)"),
    ("graph: replay", r"graphs\.py:\d+\(replay\)"),
    ("F.linear", r"torch\._C\._nn\.linear"),
    ("layer_norm", r"torch\.layer_norm"),
    ("SDPA (scaled_dot_product_attention)", r"torch\._C\._nn\.scaled_dot_product_attention"),
    ("Tensor.copy_", r"'copy_' of"),
    ("Tensor.clone", r"'clone' of"),
    ("run-ahead window wait (Event.synchronize)", r"Event\.synchronize"),
    ("allocator counters (memory_stats, the profile's diagnostic)", r"memory\.py:\d+\(memory_stats\)"),
)


def _key(func) -> str:
    file, line, name = func
    return f"{file}:{line}({name})"


def calls(path: Path) -> dict:
    """label -> (calls, own s, cumulative s, consistent) of each of ``CALLS`` found in a .pstats file (summed over
    matches). ``consistent`` is False where cProfile counted primitive calls apart from all calls on a function that
    never recurses (its stack bookkeeping lost track, as around a CUDA graph capture): that row's times are not
    read."""
    st = pstats.Stats(str(path)).stats
    out = {}
    for label, rx in CALLS:
        r = re.compile(rx)
        n = tt = ct = 0.0
        ok = True
        for func, (cc, nc, t, c, _) in st.items():
            if r.search(_key(func)):
                n, tt, ct, ok = n + nc, tt + t, ct + c, ok and cc == nc
        if n:
            out[label] = (int(n), tt, ct, ok)
    return out


def run_json(log: Path) -> dict:
    """The run's JSON (the log's last line that parses)."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise SystemExit(f"{log}: no run JSON in the log (was the run cut?)")


def step_means(trace: Path) -> list[float]:
    """Mean GPU time (ms) of a decode layer op at each decode step of a trace: its compute ops of layers 0..L-1 (the
    embedding is layer -1, the head layer L)."""
    with gzip.open(trace, "rt") if str(trace).endswith(".gz") else open(trace) as f:
        rows = [x for x in csv.DictReader(line for line in f if not line.startswith("#"))
                if x["phase"] == "decode" and x["kind"] == "compute"]
    head = max(int(x["layer"]) for x in rows)
    by = defaultdict(list)
    for x in rows:
        if 0 <= int(x["layer"]) < head:
            by[int(x["step"])].append(float(x["end_s"]) - float(x["start_s"]))
    return [1e3 * sum(v) / len(v) for _, v in sorted(by.items())]


def report(d: Path, about: str, traces: list[Path], about_path: Path | None = None) -> str:
    runs = sorted(d.glob("*.pstats"))
    if not runs:
        raise SystemExit(f"{d}: no .pstats files")
    out = ["# " + about.splitlines()[0].lstrip("# "), "", *about.splitlines()[1:], "",
           f"Generated by `python -m experiments.offexec.handler_profile {d}"
           + (f" --about {about_path}" if about_path else "")
           + (f" --traces {' '.join(map(str, traces))}" if traces else "")
           + "` from the `.pstats` and `.log` files here"
           "; do not edit by hand.", ""]
    data = {p.stem: (calls(p), run_json(p.with_name(p.stem + "_cprofile.log"))) for p in runs}
    out += ["| run | decode tok/s (offsim) | host issue % of run | issue s by handler | graphs / replays (capture s) |",
            "| --- | --- | --- | --- | --- |"]
    for name, (_, j) in data.items():
        g = j.get("graphs", {})
        h = ", ".join(f"{k} {v:.2f}" for k, v in sorted(j["issue_s_by_handler"].items(), key=lambda kv: -kv[1])[:4])
        out.append(f"| {name} | {j['measured']['decode_tok_s']:.2f} ({j['predicted']['decode_tok_s']:.2f}) | "
                   f"{100 * j['issue_frac']:.1f}% | {h} | {g.get('graphs', 0)} / {g.get('replays', 0)} "
                   f"({g.get('capture_s', 0):.2f}) |")
    out += ["", "Calls under cProfile: calls / cumulative s / cumulative us per call.", "",
            "| call | " + " | ".join(data) + " |", "| --- |" + " --- |" * len(data)]
    for label, _ in CALLS:
        cells = []
        for c, _ in data.values():
            if label in c:
                n, tt, ct, ok = c[label]
                cells.append(f"{n:,} / {ct:.2f} s / {1e6 * ct / n:,.0f} us" if ok else
                             f"{n:,} (cProfile's count lost track: not read)")
            else:
                cells.append("–")
        if any(x != "–" for x in cells):
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    if traces:
        out += ["", "Mean GPU time of a decode layer op by step (ms; from each trace's decode compute ops):", ""]
        for t in traces:
            m = step_means(t)
            out.append(f"- `{t}`: " + ", ".join(f"{x:.2f}" for x in m)
                       + f" (steps 1-{len(m) - 1} mean {sum(m[1:]) / max(1, len(m) - 1):.2f})")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparser(__doc__)
    ap.add_argument("dir", type=Path, help="folder of NAME.pstats + NAME_cprofile.log pairs; README.md written there")
    ap.add_argument("--about", type=Path, default=None,
                    help="markdown put above the tables (default: DIR/about.md); its first line is the title")
    ap.add_argument("--traces", type=Path, nargs="*", default=[], help="trace CSVs for the per-step GPU op means")
    a = ap.parse_args(argv)
    about = (a.about or a.dir / "about.md")
    if not about.exists():
        raise SystemExit(f"{about}: missing (the README's title and what was run)")
    text = report(a.dir, about.read_text().strip(), a.traces, a.about)
    (a.dir / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
