"""``offsim`` command line: simulate one policy, search a policy's best settings, compare every policy, sweep a grid,
run an offline job of mixed-length requests.

Each command prints a readable table and, as its last stdout line, one JSON document (an object; for ``compare`` a
list) that scripts can parse. Bad input exits with code 2 and a one-line reason on stderr.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from offsim.core.errors import OffsimError
from offsim.core.io import finite_json, write_text_atomic
from offsim.core.costmodel import prices_issue
from offsim.core.latency import host_issue_share, latency_and_bottleneck
from offsim.core.plan import RUN_AHEAD_OPS, Plan
from offsim.policies import DEFAULT_POLICIES, POLICIES, build_plan, get_policy, load_plan
from offsim.core.sim import simulate
from offsim.core.specs import HARDWARE_PRESETS, MODEL_PRESETS, Workload, get_hardware, get_model

GiB = 1 << 30
TIER_NAMES = {"gpu": "GPU memory", "cpu": "host memory", "disk": "disk"}
# Options that define a plan: with --plan FILE the plan is the file's, so any of these is a conflict.
PLAN_DEFINING = ("model", "policy", "gpu_batch_size", "num_gpu_batches", "percent", "prompt_len", "gen_len",
                 "cpu_attention", "no_overlap", "whole_layers", "no_kv_distributor", "no_weight_loader", "set",
                 "compress_weight", "compress_cache", "sparse_attention", "num_gpus", "gpus_per_node")
SUMMARY_KEYS = ("model", "hardware", "policy", "batch", "gpu_batch_size", "num_gpu_batches", "prompt_len",
                "gen_len", "prefill_s", "decode_s", "total_s", "prefill_tok_s", "decode_tok_s", "total_tok_s",
                "gpu_idle_frac", "peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes")


def gib(nbytes: float) -> str:
    """A byte count for a message: GiB with two decimals."""
    return f"{nbytes / GiB:.2f} GiB"


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def percent_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer percentage, got {s!r}") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"a percentage is in [0, 100], got {v}")
    return v


def fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] (1: dense attention), got {v:g}")
    return v


COMPRESSION_POLICIES = ", ".join(p for p, rec in POLICIES.items() if rec.compressible)  # their settings carry it


def add_compression_args(p: argparse.ArgumentParser, choice: bool = False) -> None:
    """FlexGen's approximations (``specs.Compression``). ``choice`` (search, compare): each of the two may also be
    ``auto``, to search over it (fp16 and 4-bit both tried, the best simulated one kept)."""
    how = " (alone: on; 'off': fp16 only; 'auto': search both fp16 and 4-bit)" if choice else ""
    kw = dict(nargs="?", const="on", choices=("on", "off", "auto"), metavar="on|off|auto") if choice else \
        dict(action="store_true")
    p.add_argument("--compress-weight", **kw,
                   help="store decoder weight matrices 4-bit group-wise (groups of 64 along the output channel, fp16 "
                        "min and step per group), dequantized to fp16 before compute (FlexGen's --compress-weight)"
                        f"{how}; {COMPRESSION_POLICIES}")
    p.add_argument("--compress-cache", **kw,
                   help="store the KV cache 4-bit group-wise (groups of 64 along the head dimension), quantized on "
                        f"store, dequantized before attention (FlexGen's --compress-cache){how}; "
                        f"{COMPRESSION_POLICIES}")
    p.add_argument("--sparse-attention", type=fraction, default=None, metavar="FRACTION",
                   help="in decode each query keeps the top FRACTION of K positions and only those V rows are loaded "
                        "and multiplied (FlexGen's --attn-sparsity; 1: dense)")


def compression_choices(args) -> tuple:
    """``search``'s compression choices from ``--compress-weight / --compress-cache [on|off|auto]`` and
    ``--sparse-attention``: every combination of the two (fp16 or 4-bit each), the sparse fraction fixed."""
    from offsim.core.specs import Compression

    opts = {"on": (True,), "off": (False,), "auto": (False, True), None: (False,)}
    sparse = args.sparse_attention or 1.0
    return tuple(Compression(w, c, sparse) for w in opts[args.compress_weight] for c in opts[args.compress_cache])


def add_target_args(p: argparse.ArgumentParser) -> None:
    """Model, hardware and lengths: shared by every command (and by ``offexec run``)."""
    p.add_argument("--model", default="opt-30b",
                   help=f"model preset ({', '.join(MODEL_PRESETS)}) or a transformers config.json path "
                        "(default: %(default)s)")
    p.add_argument("--hardware", default="t4",
                   help=f"hardware preset ({', '.join(HARDWARE_PRESETS)}) or a hardware-profile JSON written by "
                        "`offexec profile` (default: %(default)s)")
    p.add_argument("--gpu-mem-gb", type=float, default=None, metavar="GiB",
                   help="GPU memory budget in GiB, replacing the hardware's GPU memory (e.g. 16 for a virtual "
                        "16 GiB GPU)")
    p.add_argument("--prompt-len", type=positive_int, default=512, metavar="TOKENS",
                   help="prompt length in tokens (default: %(default)s)")
    p.add_argument("--gen-len", type=positive_int, default=32, metavar="TOKENS",
                   help="tokens generated per prompt, the first by prefill (default: %(default)s)")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """One policy with its settings (``simulate``; ``offexec run``)."""
    p.add_argument("--policy", default="flexgen", help=f"policy: {', '.join(POLICIES)} (default: %(default)s); a "
                   "*-ref policy runs its ideal policy's schedule as that system's code does, same settings "
                   "(docs/architecture.md §5.1)")
    p.add_argument("--gpu-batch-size", type=positive_int, default=16, metavar="SEQS",
                   help="sequences per GPU batch (default: %(default)s)")
    p.add_argument("--num-gpu-batches", type=positive_int, default=1, metavar="N",
                   help="GPU batches per block, FlexGen's zig-zag block (default: %(default)s)")
    p.add_argument("--percent", type=percent_int, nargs=6, default=None,
                   metavar=("W_GPU", "W_CPU", "C_GPU", "C_CPU", "A_GPU", "A_CPU"),
                   help="FlexGen's placement, in %%: weights on GPU, weights on CPU, KV cache on GPU, cache on CPU, "
                        "activations on GPU, activations on CPU (weights and cache: the rest on disk; activations "
                        "must sum to 100). flexgen and tightllm only")
    p.add_argument("--cpu-attention", action="store_true",
                   help="decode attention on the CPU over the host KV cache (FlexGen's --cpu-cache-compute)")
    p.add_argument("--no-overlap", action="store_true", help="serialise all I/O and compute (FlexGen ablation)")
    p.add_argument("--whole-layers", action="store_true",
                   help="flexgen: stream each decoder layer's weights whole (two layers' weight buffers on the GPU) "
                        "instead of per sub-layer, attention then MLP, as FlexGen's code does (the default)")
    p.add_argument("--no-kv-distributor", action="store_true",
                   help="tightllm ablation: never recompute KV (N_r = 0)")
    p.add_argument("--no-weight-loader", action="store_true",
                   help="tightllm ablation: load each layer's weights whole with the first batch")
    p.add_argument("--num-gpus", type=positive_int, default=None, metavar="N",
                   help="flexgen, tightllm: pipeline parallelism over N GPUs, each with the hardware's GPU memory: the layers "
                        "in N contiguous stages (balanced; --set stage_layers=[...] to choose), the GPU batches "
                        "in micro-batch groups through them (--set micro_batches=M; default N, at most "
                        "--num-gpu-batches) (the setting "
                        "num_stages)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="G",
                   help="flexgen with --num-gpus N: the N GPUs on N/G nodes of G GPUs each (G must divide N; "
                        "FlexGen's 4 nodes x 1 GPU: --num-gpus 4 --gpus-per-node 1), each node a host with the "
                        "hardware's host memory, disk, CPU and links; hidden states between nodes go GPU -> host -> "
                        "network -> host -> GPU at the hardware's network_bytes_per_s (default: all GPUs on one "
                        "host; the setting gpus_per_node)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other policy setting, VALUE as JSON (e.g. --set offload=\"disk\", --set interval=4); "
                        "repeatable")


def add_search_gpus_arg(p: argparse.ArgumentParser) -> None:
    """``--num-gpus`` of ``search`` and ``compare``: the pipeline's GPU count, chosen with the rest."""
    p.add_argument("--num-gpus", type=positive_int, default=1, metavar="N",
                   help="flexgen, tightllm: search a pipeline over N GPUs of one host, each with the hardware's GPU "
                        "memory (host memory and disk shared): block shape, micro-batch groups, placement and "
                        "layers per stage (balanced, or the last stage with a few layers more or fewer), each stage "
                        "checked against its GPU (default: %(default)s; the other policies have no pipeline and are "
                        "refused with N > 1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="G",
                   help="flexgen with --num-gpus N: the N GPUs on N/G nodes of G GPUs each (G must divide N; "
                        "FlexGen's 4 nodes x 1 GPU: --num-gpus 4 --gpus-per-node 1), each node with the hardware's "
                        "host memory, disk and CPU (checked per node), hidden states between nodes over the "
                        "hardware's network_bytes_per_s (default: all N GPUs on one host)")


def check_gpu_args(args) -> None:
    """--gpus-per-node places the GPUs of a pipeline on nodes: without --num-gpus N > 1 there is none to place."""
    if getattr(args, "gpus_per_node", None) is not None and (getattr(args, "num_gpus", None) or 1) < 2:
        raise OffsimError(f"--gpus-per-node {args.gpus_per_node} places a pipeline's GPUs on nodes: give --num-gpus N "
                          f"too (N > 1, a multiple of {args.gpus_per_node})")


def policy_settings(args) -> dict:
    """Settings dict for ``args.policy`` from the flags; a flag that the policy does not take is an error."""
    names = set(get_policy(args.policy).input_names())
    given = {}
    if args.percent is not None:
        given["percent"] = tuple(args.percent)
    if args.cpu_attention:
        given["cpu_attention"] = True
    if args.no_overlap:
        given["overlap"] = False
    if args.whole_layers:
        given["sublayer"] = False
    if args.no_kv_distributor:
        given["kv_distributor"] = False
    if args.no_weight_loader:
        given["weight_loader"] = False
    if getattr(args, "compress_weight", False):
        given["compress_weight"] = True
    if getattr(args, "compress_cache", False):
        given["compress_cache"] = True
    if getattr(args, "sparse_attention", None) is not None:
        given["sparse_attention"] = args.sparse_attention
    check_gpu_args(args)
    if getattr(args, "num_gpus", None) is not None and (args.num_gpus > 1 or "num_stages" in names):
        given["num_stages"] = args.num_gpus  # (one GPU is every policy's: --num-gpus 1 applies to all)
    if getattr(args, "gpus_per_node", None) is not None:
        given["gpus_per_node"] = args.gpus_per_node
    flag = {"num_stages": "--num-gpus", "gpus_per_node": "--gpus-per-node", "percent": "--percent", "cpu_attention": "--cpu-attention", "overlap": "--no-overlap",
            "sublayer": "--whole-layers", "kv_distributor": "--no-kv-distributor", "weight_loader": "--no-weight-loader",
            "compress_weight": "--compress-weight", "compress_cache": "--compress-cache",
            "sparse_attention": "--sparse-attention"}
    for k in given:
        if k not in names:
            raise OffsimError(f"{flag[k]} does not apply to policy {args.policy} (its settings: {sorted(names)})")
    from_flags = set(given)
    for kv in args.set:
        if "=" not in kv:
            raise OffsimError(f"--set expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        if k not in names:
            raise OffsimError(f"--set {k}: policy {args.policy} has no such setting; valid: {sorted(names)}")
        if k in from_flags:  # (the --set value won in silence, whichever came first on the line)
            raise OffsimError(f"--set {k} and {flag[k]} both set {k}: give one of them")
        if k in given:
            raise OffsimError(f"--set {k} is given twice: give it once")
        try:
            given[k] = json.loads(v)
        except json.JSONDecodeError:
            try:  # a comma-separated list without brackets: --set percent=20,80,0,100,100,0
                given[k] = json.loads(f"[{v}]") if "," in v else v
            except json.JSONDecodeError:
                given[k] = v  # a bare string
    return given


def summary(metrics: dict, settings: dict | None = None, derived: dict | None = None) -> dict:
    """The JSON line: metrics, latency and bottleneck, the policy's inputs (``settings``) and what it derived from
    them (``derived``)."""
    out = {k: metrics.get(k) for k in SUMMARY_KEYS}
    out.update(latency_and_bottleneck(metrics))
    if settings is not None:
        out["settings"] = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if derived:
        out["derived"] = derived
    return out


def _fmt_table(rows: list[dict]) -> str:
    df = pd.DataFrame(rows)
    show = [c for c in ("policy", "batch", "gpu_batch_size", "num_gpu_batches", "prefill_tok_s", "decode_tok_s",
                        "total_tok_s", "gpu_idle_frac", "peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes")
            if c in df]
    df = df[show].copy()
    for c in ("peak_gpu_bytes", "peak_cpu_bytes", "peak_disk_bytes"):
        if c in df:
            df[c.replace("_bytes", "_GiB")] = df.pop(c) / GiB
    # (a rate with no time to divide by -- decode at gen-len 1 -- reads n/a, as the summary line and the JSON's null)
    return df.to_string(index=False, float_format=lambda x: f"{x:,.3f}" if math.isfinite(x) else "n/a")


def _print_json(obj) -> None:
    print(json.dumps(finite_json(obj), allow_nan=False,
                     default=lambda x: finite_json(x.item()) if hasattr(x, "item") and not hasattr(x, "__len__")
                     else str(x)))


# ---- checks made before anything is simulated --------------------------------------------------------------------
def check_output_path(path: str | None, option: str, make_parents: bool = False) -> None:
    """Refuse an output file that could not be written, before minutes of simulation or measurement: its directory
    does not exist (``make_parents``: none of its ancestors can take the folders the write will make), it is a
    directory, or the directory takes no files. The last is probed with a temporary file, since ``os.access`` says
    yes to root where no file can be made (/proc). A path that exists and is not a regular file (``/dev/stdout``, a
    pipe) is written straight into, as ``io.open_atomic`` does, and is not probed (opening a pipe would block)."""
    if path is None:
        return
    if not str(path).strip():
        raise OffsimError(f"{option} is empty; give a file name")
    p = Path(path).expanduser()
    if p.is_dir():
        raise OffsimError(f"{option} {path} is a directory; give a file name")
    if p.exists() and not p.is_file():
        return
    parent = p.resolve().parent
    if make_parents:
        while not parent.exists():
            parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise OffsimError(f"{option} {path}: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise OffsimError(f"{option} {path}: directory {parent} does not exist (create it first)")
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise OffsimError(f"{option} {path}: cannot write files in {parent} ({e.strerror or e})") from None


def check_distinct_files(**paths: str | None) -> None:
    """Refuse two of a command's file options that name one file (``--trace`` over the ``--plan`` it read, or over
    ``--save-plan``): the second write would replace the first in silence. Keyword names are the options with '_'
    for '-'."""
    seen: dict[Path, str] = {}
    for name, path in paths.items():
        if not path:
            continue
        p = Path(path).expanduser().resolve()
        option = "--" + name.replace("_", "-")
        if p in seen:
            raise OffsimError(f"{option} and {seen[p]} are one file ({path}): give each its own")
        seen[p] = option


def check_output_dir(path: str | Path, option: str) -> None:
    """``make_output_dir``'s refusals without making anything: a file is there, a file stands where a parent
    folder would be made, or the nearest existing folder takes no files."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OffsimError(f"{option} {path} is a file; give a directory")
    at = out
    while not at.exists():
        at = at.parent
    if not at.is_dir():
        raise OffsimError(f"{option} {path}: cannot make the directory ({at} is a file)")
    if not os.access(at, os.W_OK | os.X_OK):
        raise OffsimError(f"{option} {path}: cannot make the directory ({at} is not writable)")


def make_output_dir(path: str | Path, option: str) -> Path:
    """The output directory ``path`` made (with its parents) before any work, or an error naming ``option`` that
    says why it cannot be: a file is there, or the system refuses (no permission, a read-only place)."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OffsimError(f"{option} {path} is a file; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffsimError(f"{option} {path}: cannot make the directory ({e.strerror or e})") from None
    return out


def given_options(build: callable, argv: list[str]) -> set[str]:
    """The option dests given on the command line ``argv`` (not left at their defaults): ``argv`` parsed again by a
    fresh parser from ``build`` whose subcommand defaults are all suppressed, so that only given options appear
    (argparse sets no attribute for an absent option whose default is SUPPRESS)."""
    p = build()
    for sp in p.subcommands.values():
        for a in sp._actions:
            a.default = argparse.SUPPRESS
        sp._defaults.clear()  # set_defaults(func=...)
    return set(vars(p.parse_args(argv))) - {"cmd"}


def check_plan_conflicts(given: set[str]) -> None:
    """--plan FILE is the whole plan: an option that would define another plan is an error naming it."""
    clash = [d for d in PLAN_DEFINING if d in given]
    if clash:
        names = ", ".join("--" + d.replace("_", "-") for d in clash)
        raise OffsimError(f"--plan takes the model, policy, settings and workload from the plan file; drop {names} "
                          f"(or drop --plan to build a plan from them)")


def add_runtime_args(p: argparse.ArgumentParser, simulated: bool) -> None:
    """How the runtime issues a plan's ops, for `offexec run` and, as the simulator models offexec doing it, for
    `offsim simulate` (``simulated``): set on the plan, built from flags or loaded by --plan alike
    (``apply_runtime_args``)."""
    if simulated:
        disk = ("the disk tier goes through the OS page cache (as `offexec run --disk-cache`): disk ops are priced at "
                "the profile's disk_cached_* rates instead of its O_DIRECT rates")
        graphs = ("the runtime issues decode ops kernel by kernel (as `offexec run --no-cuda-graphs`): their host "
                  "issue is priced at the profile's issue_compute_s instead of issue_graph_s")
    else:
        disk = ("run the disk tier through the OS page cache instead of O_DIRECT (sets the plan's disk_cached; "
                "offsim then prices disk ops at the profile's disk_cached_* rates); needed when --disk-dir is on "
                "tmpfs or a filesystem that refuses O_DIRECT")
        graphs = "issue decode layer ops kernel by kernel instead of replaying them as CUDA graphs"
    p.add_argument("--disk-cache", action="store_true", help=disk)
    p.add_argument("--no-cuda-graphs", action="store_true", help=graphs)
    p.add_argument("--run-ahead", nargs=3, type=positive_int, metavar=("COMPUTE", "H2D", "D2H"), default=None,
                   help="ops the issuing thread may have outstanding on the compute, host-to-device and "
                        f"device-to-host streams (the plan's run_ahead; default {' '.join(map(str, RUN_AHEAD_OPS))})"
                        + (", as `offexec run --run-ahead`" if simulated else "") + ". On the H200, 2 compute ops "
                        "ahead instead of 16 issued less on every OPT-30B run of results/offexec/runahead2_b450f9a at "
                        "the same decode rates; offsim predicts it up to 5 %% slower on host-bound small-model plans "
                        "(results/offexec/runahead2_b450f9a/window_predict.md)")
    p.add_argument("--graph-min-uses", type=positive_int, default=None, metavar="N",
                   help="run a graphable decode shape (part, query tokens) eagerly when the plan meets it at fewer "
                        "than N decode steps: a graph captured for one or two replays costs the issuing thread more "
                        "than it saves, as TightLLM's recompute lengths that last a step (the plan's graph_min_uses; "
                        "default 1: every graphable op graphed)" + (", as `offexec run --graph-min-uses`"
                                                                    if simulated else ""))
    p.add_argument("--graph-attention", choices=("masked", "written_rows"), default=None,
                   help="how graphed decode ops of several query tokens (TightLLM's recomputes) attend: masked over "
                        "the whole KV buffer (the default) or written_rows, sequence-first over the rows written so "
                        "far through flash's variable-length call (the plan's graph_attention)"
                        + ("; offsim prices both alike, attention over the rows written at the op's step (what "
                           "written_rows runs)" if simulated else ""))


def apply_runtime_args(args, *plans) -> None:
    """``add_runtime_args``'s choices, set on each plan given (None skipped): they are part of the plan, which the
    executor, its memory check and the simulator all read."""
    for p in plans:
        if p is None:
            continue
        if getattr(args, "disk_cache", False):
            p.disk_cached = True
        if getattr(args, "no_cuda_graphs", False):
            p.cuda_graphs = False
        if getattr(args, "run_ahead", None):
            p.run_ahead = tuple(args.run_ahead)
        if getattr(args, "graph_min_uses", None):
            p.graph_min_uses = int(args.graph_min_uses)
        if getattr(args, "graph_attention", None):
            p.graph_attention = "" if args.graph_attention == "masked" else args.graph_attention


def shortfalls(plan: Plan) -> list[str]:
    """Each tier whose resident bytes (held for the whole run) exceed its capacity, by name, in GiB: the test
    ``Plan.validate`` makes first, with every short tier named instead of the first in bytes."""
    out = []
    for t, name in TIER_NAMES.items():
        need, have = plan.resident.get(t, 0), plan.capacity.get(t, 0)
        if need > have:
            out.append(f"{name} short by {gib(need - have)} ({gib(need)} resident, {gib(have)} available)")
    return out


def search_command(args, policy: str, model_arg: str) -> str:
    """The ``offsim search`` command line for the same model, hardware and lengths."""
    cmd = (f"offsim search --policy {policy} --model {model_arg} --hardware {args.hardware} "
           f"--prompt-len {args.prompt_len} --gen-len {args.gen_len}")
    cmd += f" --gpu-mem-gb {args.gpu_mem_gb:g}" if args.gpu_mem_gb is not None else ""
    gpus = getattr(args, "num_gpus", None) or 1
    per_node = getattr(args, "gpus_per_node", None)
    return cmd + (f" --num-gpus {gpus}" if gpus > 1 else "") + (f" --gpus-per-node {per_node}"
                                                                 if gpus > 1 and per_node else "")


def build_fitting_plan(args, model, hw, wl: Workload, model_arg: str | None = None) -> Plan:
    """``args.policy``'s plan from the flags. When it does not fit, the error names every short tier (in GiB) and
    points to ``offsim search``: FlexGen's default settings put everything on the GPU, which no large model fits."""
    settings = policy_settings(args)
    fix = "a smaller --gpu-batch-size" + (", another --percent" if "percent" in get_policy(args.policy).input_names()
                                          else "")
    hint = (("" if settings else f"These are {args.policy}'s default settings. ") +
            f"Try {fix}, or let `{search_command(args, args.policy, model_arg or args.model)}` find settings that "
            f"fit")
    try:
        plan = build_plan(args.policy, model, hw, wl, settings, validate=False)
        short = shortfalls(plan)
        if short:
            what = "these settings" if settings else "its default settings"
            raise OffsimError(f"{args.policy} with {what} and {wl.gpu_batch_size} x {wl.num_gpu_batches} sequences "
                              f"does not fit {model.name} on {hw.name}: {'; '.join(short)}")
        return plan.validate()
    except OffsimError as e:
        if "fit" in str(e) or "capacity" in str(e):  # a memory refusal, from the builder or the plan's check
            raise OffsimError(f"{e}. {hint}") from None
        raise


def check_plan_budget(plan: Plan, hw, path) -> None:
    """``--plan FILE --gpu-mem-gb G``: the saved plan held to that GPU budget (each GPU's, for a pipeline) instead
    of the one it was planned for -- its memory rules checked again, so that a plan that does not fit is refused,
    not simulated as if it did."""
    gpu = int(hw.gpu_mem_bytes)
    for st in plan.stages:
        st["gpu_capacity"] = gpu
    plan.capacity = {**plan.capacity, "gpu": gpu * max(1, len(plan.stages))}
    try:
        plan.validate()
    except OffsimError as e:
        raise OffsimError(f"plan {path} does not fit --gpu-mem-gb {gpu / GiB:g} GiB: {e} (it was planned for "
                          f"another budget; drop --gpu-mem-gb, or plan again for this one)") from None


# ---- commands --------------------------------------------------------------------------------------------------
def cmd_simulate(args) -> None:
    check_output_path(args.trace, "--trace")
    check_output_path(args.save_plan, "--save-plan")
    check_distinct_files(plan=args.plan, trace=args.trace, save_plan=args.save_plan)
    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    if args.plan:
        check_plan_conflicts(getattr(args, "given", set()))
        plan = load_plan(args.plan)
        if args.gpu_mem_gb is not None:
            check_plan_budget(plan, hw, args.plan)
    else:
        model = get_model(args.model)
        wl = Workload(args.prompt_len, args.gen_len, args.gpu_batch_size, args.num_gpu_batches)
        plan = build_fitting_plan(args, model, hw, wl)
    apply_runtime_args(args, plan)  # (offexec run's --disk-cache, --no-cuda-graphs, --run-ahead)
    if args.save_plan:
        plan.save(args.save_plan)
    t0 = time.perf_counter()
    trace = simulate(plan, hw)
    wall = time.perf_counter() - t0
    m = trace.metrics()
    if args.trace:
        trace.write(args.trace)
    print(f"{plan.policy} on {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB GPU), {plan.model.name}, "
          f"prompt {plan.workload.prompt_len}, gen {plan.workload.gen_len}, {len(plan.ops)} ops simulated in "
          f"{wall:.2f} s")
    print(_fmt_table([m]))
    busy = ", ".join(f"{s} {m[f'busy_{s}_s']:.2f} s" for s in ("compute", "h2d", "d2h", "disk", "cpu"))
    print(f"makespan {m['total_s']:.2f} s; stream busy: {busy}")
    if plan.stages:  # several GPUs: each one's layers and peak (its budget is the hardware's GPU memory)
        per = "; ".join(f"GPU {d} layers {st['layers'][0]}-{st['layers'][1] - 1} peak "
                        f"{m[f'peak_gpu{d}_bytes'] / GiB:.3f} GiB of {st['gpu_capacity'] / GiB:.1f}"
                        for d, st in enumerate(plan.stages))
        print(f"{plan.num_devices} GPUs (pipeline; GPU stream busy times are per-GPU means, p2p "
              f"{m['busy_p2p_s']:.2f} s): {per}")
    if plan.nodes:  # several hosts: each node's GPUs and host peaks (its capacities are the hardware's)
        per = "; ".join(f"node {n} GPUs {', '.join(str(d) for d in range(plan.num_devices) if plan.node_of_device(d) == n)}"
                        f" host memory peak {m[f'peak_cpu{n}_bytes'] / GiB:.1f} GiB of {x['cpu_capacity'] / GiB:.1f}, "
                        f"disk {m[f'peak_disk{n}_bytes'] / GiB:.1f} GiB of {x['disk_capacity'] / GiB:.1f}"
                        for n, x in enumerate(plan.nodes))
        print(f"{plan.num_nodes} nodes (cpu and disk busy times are per-node means): {per}")
    issue = host_issue_share(plan, hw, m)  # (a pass over every op: once)
    lat = {**latency_and_bottleneck(m), **issue}
    print(f"time to first token {lat['ttft_s']:.2f} s; decode {_ms(lat['decode_ms_per_token'])} per token; "
          f"bottleneck: {lat['bottleneck_stream']} busy {lat['bottleneck_busy_frac']:.0%} of the makespan")
    note = host_bound_note(lat)
    if note:
        print(note)
    _print_json({**summary(m, plan.settings, plan.derived), **issue})


# a prediction whose CPU stream (CPU attention) is busy this share of the decode or more follows the host's state
HOST_STREAM_NOTE_FRAC = 0.5


def host_bound_note(m: dict) -> str:
    """A caution for a prediction that rests on the host (``m``: a summary with ``latency_and_bottleneck``'s
    ``cpu_decode_frac`` and, where known, ``host_issue_share``'s ``host_issue_decode_frac``): where CPU attention
    keeps the CPU stream busy ``HOST_STREAM_NOTE_FRAC`` of the decode or more, its rate is the profile's CPU rows;
    where the runtime's issuing thread is priced that busy, its time is the profile's issue rows. Both follow the
    host's state (threads, load, the day on a shared machine) more than any GPU row does (docs/profiling.md §4: on the
    H200's virtual machine CPU-attention runs moved by a fifth between sessions, and host-bound runs of one plan
    109-151 tok/s over six runs on three machines). '' else."""
    f = m.get("cpu_decode_frac") or 0.0
    g = m.get("host_issue_decode_frac") or 0.0
    notes = []
    if f >= HOST_STREAM_NOTE_FRAC:
        notes.append(f"CPU attention keeps the host's CPU busy for {f:.0%} of the decode's time; its time is the "
                     "profile's CPU rows")
    if g >= HOST_STREAM_NOTE_FRAC:
        notes.append(f"the runtime's issuing thread is busy for about {g:.0%} of the decode's time (many small "
                     "ops); its time is the profile's issue rows")
    if not notes:
        return ""
    return ("note: " + "; ".join(notes) + ". These follow the host's state (threads, load, the machine's day): read "
            "this prediction as good to about a fifth unless the profile was measured beside the run "
            "(docs/profiling.md §4)")


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f} ms"


def _winner_issue_share(policy: str, model, hw, res) -> dict:
    """``host_issue_share`` of a search's winner, its plan rebuilt for it only where the profile prices the
    runtime's issue (a preset does not, and the rebuild doubled OPT-175B's `offsim search`: 1.9 -> 4 s)."""
    if not prices_issue(hw):
        return {}
    return host_issue_share(build_plan(policy, model, hw, res.workload, res.settings), hw, res.metrics)


def cmd_search(args) -> None:
    from offsim.search import search

    check_gpu_args(args)
    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    model = get_model(args.model)
    res = search(args.policy, model, hw, args.prompt_len, args.gen_len, max_sims=args.max_sims,
                 progress=args.progress, compression=compression_choices(args), num_gpus=args.num_gpus,
                 gpus_per_node=args.gpus_per_node or 0)
    on = hw.name if args.num_gpus == 1 else f"{args.num_gpus} GPUs of {hw.name}" + (
        f" ({args.gpus_per_node} per node)" if args.gpus_per_node else "")
    print(f"best {args.policy} for {model.name} on {on}: gpu_batch_size {res.workload.gpu_batch_size}, "
          f"num_gpu_batches {res.workload.num_gpu_batches}, settings {res.settings}")
    print(_fmt_table([res.metrics]))
    if res.stages:  # a pipeline: each GPU's layers and peak
        m = res.metrics
        print("stages: " + "; ".join(f"GPU {d} layers {lo}-{hi - 1} peak {m[f'peak_gpu{d}_bytes'] / GiB:.3f} GiB of "
                                     f"{hw.gpu_mem_bytes / GiB:.1f}" for d, (lo, hi) in enumerate(res.stages)))
    cols = [c for c in ("gpu_batch_size", "num_gpu_batches", "settings", "lp_s_per_token", "screen_total_tok_s",
                        "total_tok_s", "error")
            if c in res.candidates]
    print(f"\ncandidates evaluated ({len(res.candidates)}; best first):")
    print(res.candidates[cols].head(args.show).to_string(index=False))
    out = summary(res.metrics, res.settings)
    if res.stages:
        out["num_gpus"], out["stages"] = args.num_gpus, [list(x) for x in res.stages]
        if args.gpus_per_node:
            out["gpus_per_node"] = args.gpus_per_node
    else:  # the issuing thread's share of the decode, from the winning plan, as simulate and compare give it
        out.update(_winner_issue_share(args.policy, model, hw, res))
        note = host_bound_note({**latency_and_bottleneck(res.metrics), **out})
        if note:
            print(note)
    by_comp = res.best_by_compression()
    if len(compression_choices(args)) > 1:  # the user asked to compare: the best of each choice
        print("\nbest screened total tok/s by compression: " +
              ", ".join(f"{k} {v:,.3f}" for k, v in by_comp.items()))
        out["best_by_compression"] = by_comp
    _print_json(out)


def _rank(out: list[dict], key) -> list[dict]:
    """Sort the policies' results by ``key`` (smallest first), infeasible ones (with an 'error') last, mark the first
    feasible one 'best'; the feasible ones, in that order."""
    out.sort(key=lambda o: key(o) if "error" not in o else math.inf)
    feasible = [o for o in out if "error" not in o]
    for o in out:
        o["best"] = bool(feasible) and o is feasible[0]
    return feasible


def _ranked_table(out: list[dict], columns) -> str:
    """The feasible results in order, the winner marked '*', with policy and block shape, then ``columns(o)``."""
    rows = [{" ": "*" if i == 0 else "", "policy": o["policy"],
             "batch": f"{o['gpu_batch_size']}x{o['num_gpu_batches']}", **columns(o)}
            for i, o in enumerate(o for o in out if "error" not in o)]
    return pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:,.2f}")


def _compare_table(out: list[dict]) -> str:
    """Feasible policies, best total tok/s first, the winner marked; then why each loses or wins: latency and the
    busiest stream."""
    return _ranked_table(out, lambda o: {
        "total_tok_s": o["total_tok_s"], "decode_tok_s": o["decode_tok_s"], "ttft_s": o["ttft_s"],
        "decode_ms/tok": o["decode_ms_per_token"],
        "bottleneck": f"{o['bottleneck_stream']} {o['bottleneck_busy_frac']:.0%}",
        "peak_gpu_GiB": o["peak_gpu_bytes"] / GiB, "peak_cpu_GiB": o["peak_cpu_bytes"] / GiB,
        "peak_disk_GiB": o["peak_disk_bytes"] / GiB})


def _short_reason(policy: str, msg: str) -> str:
    """The search's reason without its 'no feasible <policy> setting for <model> on <hw>:' preamble."""
    return msg.split(": ", 1)[1] if msg.startswith(f"no feasible {policy} setting") else msg


def cmd_compare(args) -> None:
    from offsim.search import search

    hw = get_hardware(args.hardware, args.gpu_mem_gb)
    model = get_model(args.model)
    policies = list(dict.fromkeys(args.policies or DEFAULT_POLICIES))  # (a policy named twice is compared once)
    check_gpu_args(args)
    for pol in policies:
        if pol not in POLICIES:
            raise OffsimError(f"unknown policy {pol!r}; valid: {', '.join(POLICIES)}")
    out = []
    for pol in policies:
        try:
            res = search(pol, model, hw, args.prompt_len, args.gen_len, max_sims=args.max_sims,
                         progress=args.progress, compression=compression_choices(args), num_gpus=args.num_gpus,
                         gpus_per_node=args.gpus_per_node or 0)
        except OffsimError as e:
            print(f"{pol}: infeasible: {_short_reason(pol, str(e))}", flush=True)
            out.append({"policy": pol, "error": str(e)})
            continue
        out.append(summary(res.metrics, res.settings))
        if res.stages:
            out[-1]["stages"] = [list(x) for x in res.stages]
        else:  # the issuing thread's share of the decode, from the winning plan (host_bound_note)
            out[-1].update(_winner_issue_share(pol, model, hw, res))
        print(f"{pol}: gpu_batch_size {res.workload.gpu_batch_size} x {res.workload.num_gpu_batches}, "
              f"settings {res.settings}", flush=True)
    feasible = _rank(out, lambda o: -o["total_tok_s"])  # the objective (total tok/s, FlexGen's) decides
    gpus = "" if args.num_gpus == 1 else f"{args.num_gpus} x "
    nodes = f" on {args.num_gpus // args.gpus_per_node} nodes" if args.num_gpus > 1 and args.gpus_per_node else ""
    print(f"\n{model.name} on {hw.name} ({gpus}{hw.gpu_mem_bytes / GiB:.1f} GiB GPU{nodes}), prompt {args.prompt_len}, "
          f"gen {args.gen_len}, each policy at its best simulated settings, best total tok/s first (*):")
    if feasible:
        print(_compare_table(out))
        w = feasible[0]
        why = f"{w['policy']} wins with {w['total_tok_s']:,.2f} tok/s"
        if len(feasible) > 1:
            r = feasible[1]
            why += (f", {w['total_tok_s'] / r['total_tok_s']:.2f}x {r['policy']}'s; its busiest stream is "
                    f"{w['bottleneck_stream']} ({w['bottleneck_busy_frac']:.0%} busy), {r['policy']}'s "
                    f"{r['bottleneck_stream']} ({r['bottleneck_busy_frac']:.0%})")
        print(why)
        fragile = [o["policy"] for o in feasible if host_bound_note(o)]
        if fragile:
            print(f"note: {', '.join(fragile)}'s decode rests on the host (CPU attention or the runtime's issuing "
                  "thread): such predictions follow the host's state (docs/profiling.md §4)")
    _print_json(out)
    if not feasible:
        raise OffsimError(f"no policy fits {model.name} on {hw.name} (prompt {args.prompt_len}, gen "
                          f"{args.gen_len}): " + "; ".join(f"{o['policy']}: {_short_reason(o['policy'], o['error'])}"
                                                          for o in out))


VALIDATE_COLUMNS = {"case": "case", "policy": "policy", "batch": "batch", "measured_total_tok_s": "measured tok/s",
                    "predicted_total_tok_s": "offsim tok/s", "err_total_tok_s": "err total",
                    "err_decode_tok_s": "err decode", "step_latency_mape": "step MAPE"}
CASE_WIDTH = 40  # characters of a case name in the terminal table (the CSV has it whole)


def _validate_table(df: pd.DataFrame) -> str:
    """The cases, one short line each (under 120 columns): throughput measured vs predicted and the errors."""
    t = df[list(VALIDATE_COLUMNS)].rename(columns=VALIDATE_COLUMNS)
    t["case"] = [c if len(c) <= CASE_WIDTH else c[:CASE_WIDTH - 1] + "~" for c in t["case"].astype(str)]
    signed = lambda v: "n/a" if pd.isna(v) else f"{v:+.1%}"  # noqa: E731
    fmt = {"measured tok/s": "{:,.1f}".format, "offsim tok/s": "{:,.1f}".format, "err total": signed,
           "err decode": signed, "step MAPE": lambda v: "n/a" if pd.isna(v) else f"{v:.1%}"}
    return t.to_string(index=False, formatters=fmt, justify="right")


def cmd_validate(args) -> None:
    from offsim.analysis import validate as V

    if args.out:
        check_output_dir(args.out, "--out")
    if not V.find_cases(args.dir):  # (a missing folder, or one without cases, refused before --out is made)
        raise OffsimError(f"{args.dir}: no measured cases (*.case.json or *.trace.csv)")
    if args.out:
        make_output_dir(args.out, "--out")
    df = V.validate_dir(args.dir, hardware=args.hardware, progress=args.progress)
    print(_validate_table(df))
    if not args.out:
        print("(per-phase errors, per-op-kind MAPE and the rest per case: --out DIR writes them to validation.csv)")
    by_policy = df.groupby("policy")["err_total_tok_s"].agg(lambda e: e.abs().median())
    print("\nmedian |total tok/s error| by policy:")
    print(by_policy.to_string(float_format=lambda v: f"{v:.1%}"))
    kinds = df[[c for c in df.columns if c.startswith("mape_")]].mean()
    print("\nmean per-op-kind MAPE over cases:")
    print(kinds.to_string(float_format=lambda v: f"{v:.1%}"))
    stale = V.stale_cases(df)
    if stale:
        print(f"\nwarning: {len(stale)} case(s) ran a plan that today's code no longer builds from their settings "
              f"(re-measure them): {', '.join(stale)}")
    bad = V.check_thresholds(df)
    out = Path(args.out) if args.out else None
    if out:
        from offsim.core.provenance import provenance, write_csv

        prov = provenance(cases=str(args.dir))
        write_csv(df, out / "validation.csv", prov)
        V.plot(df, out / "validation.png")
        write_text_atomic(out / "README.md", V.report_markdown(
            df, f"offsim vs measured runs: {args.dir}",
            f"offsim validate {args.dir}" + (f" --hardware {args.hardware}" if args.hardware else "") + f" --out {out}",
            prov))
    errs = df["err_total_tok_s"].abs()
    print(f"\n{len(df)} cases; median |total error| {errs.median():.1%} (limit {V.MAX_MEDIAN_ERROR:.0%}), max "
          f"{errs.max():.1%} (limit {V.MAX_CASE_ERROR:.0%}): {'OK' if not bad else 'FAIL'}")
    for b in bad:
        print("  " + b)
    _print_json({"cases": len(df), "median_abs_err_total": float(errs.median()), "max_abs_err_total":
                 float(errs.max()), "ok": not bad, "violations": bad})
    if bad and args.strict:
        raise SystemExit(1)

# ---- sweep -------------------------------------------------------------------------------------------------------
def _sweep_table(df: pd.DataFrame) -> str:
    """Per policy: points answered (ok), refused (failed) and broken (error), and the best and median total tok/s."""
    g = df.groupby("policy", sort=False)
    t = pd.DataFrame({s: g["status"].apply(lambda x, s=s: int((x == s).sum())) for s in ("ok", "failed", "error")})
    ok = df[df["status"] == "ok"].groupby("policy", sort=False)["total_tok_s"]
    t["best_total_tok_s"] = ok.max()
    t["median_total_tok_s"] = ok.median()
    return t.reset_index().to_string(index=False, float_format=lambda x: f"{x:,.2f}")


def _sweep_plot(spec, out: Path, df: pd.DataFrame, latency: str) -> Path:
    """``out``/pareto.png from the sweep's table ``df`` as it stands (after an interrupted run too)."""
    import matplotlib.pyplot as plt

    from offsim.analysis.pareto import plot_pareto

    fig = plot_pareto(df, x=latency, title=f"{spec.name}: latency vs throughput per policy (Pareto fronts)")
    plot = out / "pareto.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return plot


def cmd_sweep(args) -> None:
    from offsim.search import grid

    if args.workers is not None and args.workers < 1:
        raise OffsimError(f"--workers must be at least 1, got {args.workers}")
    spec = grid.load_spec(args.spec)
    out = Path(args.out) if args.out else Path(f"sweep-{spec.name}")
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        grid.check_reachable(address)  # before the output folder is made: an unreachable cluster leaves nothing
    make_output_dir(out, "--out")  # with its parents, as `offsim sweep spec.yaml --out runs/NAME` is documented
    try:
        rec = grid.run_sweep(spec, out, workers=args.workers, address=args.address, progress=not args.no_progress,
                             max_points=args.max_points)
    except KeyboardInterrupt:  # run_sweep wrote the table of what is done: the plot follows it, then exit 130
        _sweep_plot(spec, out, grid.read_table(out)[1], args.latency)
        raise
    _, df = grid.read_table(out)
    if len(df):
        print(_sweep_table(df))
    plot = _sweep_plot(spec, out, df, args.latency)
    print(f"{rec['points']} points: {rec['ok']} ok, {rec['failed']} failed (no answer: see 'reason'), {rec['error']} "
          f"error; this run answered {rec['ran']} in {rec['wall_s']:.1f} s ({rec['skipped']} were already answered)"
          f"; table {', '.join(rec['tables'])}; plot {plot}")
    _print_json({**{k: rec[k] for k in ("points", "ran", "skipped", "ok", "failed", "error", "unanswered", "workers",
                                        "address", "wall_s", "commit")}, "out": str(out), "tables": rec["tables"],
                 "plot": str(plot)})
    if rec["error"]:
        print(f"offsim: {rec['error']} point(s) ended in error (see the 'reason' column); the same command runs "
              "them again", file=sys.stderr)
        raise SystemExit(1)


# ---- job ---------------------------------------------------------------------------------------------------------
def _job_table(out: list[dict]) -> str:
    """Feasible policies, shortest completion first (the winner marked): completion, throughput, request latency
    percentiles and the padding waste."""
    return _ranked_table(out, lambda o: {
        "blocks": o["blocks"], "completion_s": o["completion_s"], "output_tok_s": o["output_tok_s"],
        "p50_s": o["p50_request_s"], "p90_s": o["p90_request_s"], "p99_s": o["p99_request_s"],
        "padding": f"{o['padding_waste']:.1%}"})


def _job_winner(feasible: list[dict]) -> str:
    """One line: the fastest policy's completion time, and how much shorter than the runner-up's."""
    w = feasible[0]
    nxt = (f", {1 - w['completion_s'] / feasible[1]['completion_s']:.1%} less than {feasible[1]['policy']}"
           if len(feasible) > 1 else "")
    return f"{w['policy']} finishes the job in {w['completion_s']:,.1f} s{nxt}"


def cmd_job(args) -> None:
    from offsim.search import job as J

    spec = J.load_job_spec(args.spec)
    batching = args.batching or spec.batching
    decode_steps = None if args.exact else spec.decode_steps
    policies = args.policies or list(spec.policies)
    for pol in policies:
        if pol not in POLICIES:
            raise OffsimError(f"unknown policy {pol!r}; valid: {', '.join(POLICIES)}")
    hw = get_hardware(spec.hardware, spec.gpu_mem_gb)
    model = get_model(spec.model)
    reqs = spec.requests
    p_max, g_max = J.job_lengths(reqs)
    print(f"job {spec.name}: {len(reqs)} requests from {spec.source} (seed {spec.seed}), prompts "
          f"{min(r.prompt_len for r in reqs)}-{p_max} tokens, outputs {min(r.gen_len for r in reqs)}-{g_max}; "
          f"{model.name} on {hw.name} ({hw.gpu_mem_bytes / GiB:.1f} GiB GPU), {batching} batches, "
          + ("every step simulated" if decode_steps is None else
             f"long blocks simulated in pieces of {decode_steps} decode steps, the rest interpolated (--exact: all)"), flush=True)
    out = []
    for pol in policies:
        try:
            res = J.run_job(pol, model, hw, reqs, batching, max_sims=spec.max_sims, max_batch=spec.max_batch,
                            progress=not args.no_progress, decode_steps=decode_steps)
        except OffsimError as e:
            print(f"{pol}: infeasible: {_short_reason(pol, str(e))}", flush=True)
            out.append({"model": model.name, "hardware": hw.name, "policy": pol, "error": str(e)})
            continue
        out.append({"model": model.name, "hardware": hw.name, "job": spec.name, "source": spec.source,
                    "seed": spec.seed, **res.summary()})
    feasible = _rank(out, lambda o: o["completion_s"])  # the job's completion time decides
    print(f"\n{spec.name}: each policy at its best settings (searched at prompt {p_max}, gen {g_max}), shortest "
          "job first (*); p50/p90/p99: when a request's last token came, from the job's start:")
    if feasible:
        print(_job_table(out) + "\n" + _job_winner(feasible))
    _print_json(out)
    if not feasible:
        raise OffsimError(f"no policy fits job {spec.name} ({model.name} on {hw.name}): " + "; ".join(
            f"{o['policy']}: {_short_reason(o['policy'], o['error'])}" for o in out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offsim", description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("simulate", help="simulate one policy with given settings",
                       description="Build the plan of one policy and simulate it (SimPy). Throughput follows "
                                   "FlexGen's definitions.")
    add_target_args(s)
    add_policy_args(s)
    add_compression_args(s)
    s.add_argument("--plan", metavar="FILE",
                   help="simulate a saved plan JSON instead of building one (it carries model, policy, settings "
                        "and workload: options that set those are then an error)")
    s.add_argument("--save-plan", metavar="FILE", help="write the plan as JSON (what `offexec run --plan FILE` runs)")
    add_runtime_args(s, simulated=True)
    s.add_argument("--trace", metavar="FILE",
                   help="write the predicted trace: FILE.csv (or .csv.gz) as CSV, anything else as Chrome/Perfetto "
                        "JSON")
    s.set_defaults(func=cmd_simulate)
    q = sub.add_parser("search", help="find a policy's best settings (FlexGen: LP + simulation)",
                       description="Search a policy's block shape and placement; prints the chosen settings.")
    add_target_args(q)
    q.add_argument("--policy", default="flexgen", help=f"policy: {', '.join(POLICIES)} (default: %(default)s)")
    q.add_argument("--max-sims", type=positive_int, default=3,
                   help="LP-ranked policies screen 2 x this many best LP candidates by simulation "
                        "(default: %(default)s)")
    q.add_argument("--show", type=positive_int, default=8, help="candidates to list (default: %(default)s)")
    q.add_argument("--progress", action="store_true", help="show a progress bar")
    add_search_gpus_arg(q)
    add_compression_args(q, choice=True)
    q.set_defaults(func=cmd_search)
    c = sub.add_parser("compare", help="every policy at its best settings, side by side",
                       description="Search every ideal policy (or --policies, the *-ref peers among them) and print "
                                   "them side by side, best total "
                                   "tok/s first, with time to first token, decode latency per token and each "
                                   "policy's busiest stream. Exit 2 when no policy fits.")
    add_target_args(c)
    c.add_argument("--policies", nargs="+", metavar="POLICY", help=f"subset of: {', '.join(POLICIES)}")
    c.add_argument("--max-sims", type=positive_int, default=3,
                   help="LP-ranked policies screen 2 x this many best LP candidates by simulation "
                        "(default: %(default)s)")
    c.add_argument("--progress", action="store_true", help="show a progress bar per policy")
    add_search_gpus_arg(c)
    add_compression_args(c, choice=True)
    c.set_defaults(func=cmd_compare)
    v = sub.add_parser("validate", help="re-simulate measured runs and report the prediction error",
                       description="Re-simulate every measured case under DIR (*.case.json, *.trace.csv from "
                                   "`offexec run`) with the hardware profile it names and report predicted vs "
                                   "measured throughput, per-op-kind MAPE and per-step latency error.")
    v.add_argument("dir", help="a directory of measured cases, or one case file")
    v.add_argument("--hardware", default=None,
                   help="hardware preset or profile JSON for every case (default: the one each case names)")
    v.add_argument("--out", metavar="DIR",
                   help="write validation.csv (every column per case), validation.png and a README.md of tables "
                        "computed from the CSV there")
    v.add_argument("--strict", action="store_true", help="exit 1 when a threshold is exceeded")
    v.add_argument("--progress", action="store_true", help="show a progress bar")
    v.set_defaults(func=cmd_validate)
    w = sub.add_parser("sweep", help="a grid of models, hardware, budgets, lengths and policies, in parallel on Ray",
                       description="Run every point of a sweep spec (YAML or JSON: docs/sweeps.md) on Ray -- a local "
                                   "Ray runtime on all cores by default, a cluster with --address -- and write one "
                                   "table (sweep.csv, and sweep.parquet when pyarrow is installed) with provenance, "
                                   "each point's status (ok, failed with offsim's reason, error) and a Pareto plot "
                                   "of latency vs throughput per policy (pareto.png). Resumable: points already "
                                   "answered in --out are skipped, so rerunning the command after an interrupt "
                                   "finishes the rest. Exit 1 when a point ended in error (a bug or a dead worker; "
                                   "the next run tries it again).")
    w.add_argument("spec", help="sweep spec, .yaml/.yml or .json (schema offsim.sweep/1)")
    w.add_argument("--out", metavar="DIR", help="output directory (default: sweep-<spec name> here); a directory "
                                                "with an earlier run of the spec is resumed")
    w.add_argument("--workers", type=int, metavar="N",
                   help="points evaluated at a time (default: every core of the local runtime, or every CPU of the "
                        "cluster)")
    w.add_argument("--address", metavar="ADDR",
                   help="a running Ray cluster to use (e.g. ray://head:10001 or auto; default: $RAY_ADDRESS, else a "
                        "local Ray runtime started for this run)")
    w.add_argument("--max-points", type=positive_int, metavar="N",
                   help="answer at most N new points in this run (the rest wait for the next run)")
    w.add_argument("--latency", choices=("total_s", "ttft_s", "decode_ms_per_token"), default="total_s",
                   help="latency axis of the Pareto plot (default: %(default)s, a block's time to its last token)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=cmd_sweep)
    j = sub.add_parser("job", help="an offline job of mixed-length requests: completion time per policy",
                       description="Run an offline job (YAML or JSON spec: docs/jobs.md) -- N requests with their "
                                   "own prompt and output lengths, from a named task distribution or a CSV -- with "
                                   "every policy (or the spec's) at its best settings, block after block, and "
                                   "report completion time, throughput, per-request latency percentiles and "
                                   "padding waste, shortest job first. Exit 2 when no policy fits.")
    j.add_argument("spec", help="job spec, .yaml/.yml or .json (schema offsim.job/1)")
    j.add_argument("--policies", nargs="+", metavar="POLICY", help=f"subset of: {', '.join(POLICIES)} (default: "
                                                                   "the spec's)")
    j.add_argument("--batching", choices=("padded", "bucketed"), default=None,
                   help="padded: batches in arrival order, each padded to its longest prompt (FlexGen); bucketed: "
                        "sorted by length first (default: the spec's, else padded)")
    j.add_argument("--exact", action="store_true",
                   help="simulate every decode step of every block (default: the spec's decode_steps, 16: a "
                        "longer block is simulated in pieces and its other steps interpolated; docs/jobs.md §6)")
    j.add_argument("--no-progress", action="store_true", help="no progress bar")
    j.set_defaults(func=cmd_job)
    p.subcommands = {"simulate": s, "search": q, "compare": c, "validate": v, "sweep": w, "job": j}  # for given_options
    return p


def quiet_broken_pipe(prog: str = "offsim") -> int:
    """The reader of stdout went away (``offsim compare | head -3``): stop with a one-line reason and exit 2, never
    a traceback. stdout is pointed at /dev/null so that the interpreter's final flush does not raise again (Python
    docs, signal module, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    print(f"{prog}: stdout was closed before all output was written (e.g. piped into head); stopped",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """The command line ``argv`` (None: this process's own, ``offsim ...``: the process ends when this returns)."""
    if argv is None:
        # At exit the interpreter runs full garbage collections over every object of every imported module (~0.3 s
        # with pandas, scipy and cvxpy loaded, a tenth of `offsim search`); frozen objects are skipped, and a command
        # that has printed its output leaves no garbage whose collection matters. (Not for in-process callers.)
        atexit.register(gc.freeze)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.given = given_options(build_parser, argv)
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
    except OffsimError as e:
        print(f"offsim: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return quiet_broken_pipe()
    except KeyboardInterrupt:
        print("offsim: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
