"""What every experiment shares: where its results go, the provenance written beside them, plotting defaults, and
the one JSON line it ends with.

An experiment is a module run from the repository root, ``python -m experiments.<topic>.<name> [--help]``; it
writes ``results/<name>/`` (CSV or JSON whose provenance says which commit, machine, date and command made it, and a
PNG where a person would rather look than read), prints a readable table, and ends with one JSON document on the
last stdout line so that scripts can parse it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from offsim.core import provenance as _provenance
from offsim.core.provenance import write_csv  # noqa: F401  (re-exported: CSV with the provenance on its first line)

ROOT = Path(__file__).resolve().parents[1]  # the repository root
RESULTS = ROOT / "results"


def results_dir(*parts: str, create: bool = True) -> Path:
    """``results/<parts...>`` in the repository (created unless ``create`` is False)."""
    d = RESULTS.joinpath(*parts)
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def command(argv: list[str] | None = None) -> str:
    """The command line that repeats this run: ``python -m experiments.<topic>.<name> ARGS`` when run as a module
    (``argv``: the arguments, default ``sys.argv[1:]``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None else f"python {Path(sys.argv[0]).name}"
    return " ".join([prog] + list(sys.argv[1:] if argv is None else argv))


def argparser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` prints the experiment's docstring (what it does, its command, its output).
    Experiments without options call ``argparser(__doc__).parse_args()`` so that ``--help`` never starts a run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec is not None else None, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def folder_report_main(argv, doc: str, default_root, write) -> int:
    """The command line of a report generated from a folder of measurements: ``--root DIR`` (default
    ``default_root``), ``write(Path)`` returns the README text, printed."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--root", default=str(default_root), help="the folder of profile parts (default: %(default)s)")
    args = ap.parse_args(argv)
    print(write(Path(args.root)))
    return 0


def provenance(argv: list[str] | None = None, **extra) -> dict:
    """Commit, UTC date, machine, python and the command that repeats this run, plus ``extra``."""
    return _provenance.provenance(**{"command": command(argv), **extra})


def pyplot():
    """``matplotlib.pyplot`` drawing to files only (the Agg backend: experiments run headless), house defaults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"savefig.dpi": 120, "figure.dpi": 100})
    return plt


def finish(summary: dict | list, default=str) -> None:
    """Print ``summary`` as the run's last stdout line: one JSON document (``default`` converts what JSON cannot
    hold, as in ``json.dumps``)."""
    print(json.dumps(summary, default=default), flush=True)


def executor_host_bytes(plan) -> dict[str, int]:
    """Host bytes offexec holds for ``plan``, by purpose (``executor.host_need``: weights master, packed copy, host
    KV, staging; what its ``check_plan`` refuses on)."""
    from offexec import model as M
    from offexec.executor import bind, host_need

    return host_need(bind(plan, M.layer_layout(plan.model)), plan)


def best_settings(policy: str, fixed: dict, model, hw, prompt_len: int, gen_len: int, max_batch: int):
    """A policy's best (settings, workload) by offsim's search at ``hw``'s full budget, at most ``max_batch``
    sequences; ``fixed`` settings forced (FlexGen with CPU attention: its best candidate that has it). Raises
    OffsimError when nothing fits."""
    from offsim import build_plan, simulate
    from offsim.core.errors import OffsimError
    from offsim.core.specs import Compression
    from offsim.policies import get_policy
    from offsim.search import search

    comp_keys = ("compress_weight", "compress_cache", "sparse_attention")
    if not set(fixed) - set(comp_keys):  # nothing fixed but (maybe) compression: the search, under it
        comp = Compression.from_settings(fixed)
        r = search(policy, model, hw, prompt_len, gen_len, max_sims=2, max_batch=max_batch, compression=(comp,))
        return r.settings, r.workload
    why = "no candidate"
    for st, wl, _ in get_policy(policy).candidates(model, hw, prompt_len, gen_len, None):
        if wl.num_prompts > max_batch or any(st.get(k) != v for k, v in fixed.items()):
            continue
        try:
            simulate(build_plan(policy, model, hw, wl, st), hw)
            return st, wl
        except OffsimError as e:
            why = str(e)
    raise OffsimError(why)


def case_tag(model: str, policy: str, fixed: dict, budget_gib, prompt_len: int, gen_len: int, disk: bool) -> str:
    """A drawn case's name: model, policy (``-cpuattn`` with CPU attention forced), budget, lengths, ``_disk``."""
    return (f"{model}_{policy}{'-cpuattn' if fixed.get('cpu_attention') else ''}_b{budget_gib}_p{prompt_len}"
            f"_g{gen_len}{'_disk' if disk else ''}")


def searched_case(policy: str, fixed: dict, model, hw, prompt_len: int, gen_len: int, max_batch: int,
                  max_predicted_s: float):
    """A drawn case at its best setting (``best_settings``): (settings, workload, plan, predicted metrics).
    OffsimError when nothing fits, or when the run is predicted to take longer than ``max_predicted_s`` (device
    time is scarce)."""
    st, wl = best_settings(policy, fixed, model, hw, prompt_len, gen_len, max_batch)
    plan, m = predicted_within(policy, model, hw, wl, st, max_predicted_s)
    return st, wl, plan, m


def predicted_within(policy: str, model, hw, wl, settings: dict, max_predicted_s: float):
    """(plan, predicted metrics) of a drawn case; OffsimError when its run is predicted to take longer than
    ``max_predicted_s`` (device time is scarce: the draw is redrawn)."""
    from offsim import build_plan, simulate
    from offsim.core.errors import OffsimError

    plan = build_plan(policy, model, hw, wl, settings)
    m = simulate(plan, hw).metrics()
    if m["total_s"] > max_predicted_s:
        raise OffsimError(f"predicted {m['total_s']:.0f} s, over {max_predicted_s:.0f} s")
    return plan, m
