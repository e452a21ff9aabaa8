"""Derive offexec's host issue cost per op from a measured calibration run and write a profile that carries it.

offexec times the host work of issuing each op (``issue_s_by_handler`` in its run stats). Divided by the number of
ops of each kind, that is the runtime's issue cost: a property of the executor on this host, measured on a
calibration run (results/offexec/offexec_h200.json, OPT-30B, issued kernel by kernel), not fitted to the validation
cases. The issue cost of a decode op replayed as a CUDA graph (``issue_graph_s``) comes the same way from the FlexGen
runs of a later OPT-30B run with graphs (GRAPH_RUNS: offexec times graphed ops apart, handlers named "... (graph)").

    python -m experiments.validation.calibrate_issue      # writes results/profiles/h200_offexec.json
"""
from __future__ import annotations

import json

from experiments.common import ROOT, argparser, finish, provenance
from offsim import build_plan, get_hardware, get_model
from offsim.policies import get_policy
from offsim.core.specs import HardwareSpec, Workload

RUNS = ROOT / "results" / "offexec" / "offexec_h200.json"
PROFILE = ROOT / "results" / "profiles" / "h200.json"
OUT = ROOT / "results" / "profiles" / "h200_offexec.json"
GRAPH_RUNS = ROOT / "results" / "offexec" / "graphs" / "opt30b_h200_0bd744e" / "offexec_h200.json"
COMPUTE_HANDLERS = ("layer", "embed", "head", "pre_attn", "post_attn")


def main() -> None:
    data = json.loads(RUNS.read_text())
    comp_s = copy_s = 0.0
    n_comp = n_copy = 0
    used = []
    for run in data["runs"]:
        if run["policy"] not in ("flexgen",):  # plain schedules only: one handler per op kind
            continue
        model = get_model(data["model"]) if isinstance(data["model"], str) else get_model(data["model"]["name"])
        hw = get_hardware("h200", data["budget_gib"])
        plan = build_plan(run["policy"], model, hw, Workload.from_dict(run["workload"]), _as_run(run),
                          validate=False)
        counts = plan.count_by_kind()
        by = run["issue_s_by_handler"]
        comp_s += sum(v for k, v in by.items() if k in COMPUTE_HANDLERS)
        copy_s += sum(v for k, v in by.items() if k not in COMPUTE_HANDLERS)
        n_comp += counts["compute"]
        n_copy += sum(v for k, v in counts.items() if k != "compute")
        used.append(run["config"])
    prof = json.loads(PROFILE.read_text())
    prof["issue_compute_s"] = comp_s / n_comp
    prof["issue_copy_s"] = copy_s / n_copy
    prof["issue_graph_s"], n_graph, used_graph = graph_issue_cost()
    prof["name"] = prof["name"] + "-offexec"
    prof["source"] += (f"; issue costs from {RUNS.relative_to(ROOT)} runs {used}, of a graphed decode op from "
                       f"{GRAPH_RUNS.relative_to(ROOT)} runs {used_graph}")
    prov = prof.get("provenance", {})
    prof["provenance"] = {"measured": prov, "derived": provenance(from_files=[str(PROFILE.relative_to(ROOT)),
                                                                              str(RUNS.relative_to(ROOT)),
                                                                              str(GRAPH_RUNS.relative_to(ROOT))])}
    HardwareSpec.from_dict(prof)
    OUT.write_text(json.dumps(prof, indent=1))
    print(f"issue cost: compute op {prof['issue_compute_s'] * 1e3:.3f} ms, copy op {prof['issue_copy_s'] * 1e3:.3f} ms"
          f" (from {n_comp} compute and {n_copy} copy ops of {used}); graphed decode op "
          f"{prof['issue_graph_s'] * 1e3:.3f} ms (from {n_graph} ops of {used_graph})")
    finish({"out": str(OUT), "issue_compute_s": prof["issue_compute_s"],
            "issue_copy_s": prof["issue_copy_s"], "issue_graph_s": prof["issue_graph_s"]})


def _as_run(run: dict):
    """The settings the run's plan was built from, as validation rebuilds them (a run from before a setting existed
    gets the behaviour it ran with: ``Policy.inputs_of``)."""
    pol = get_policy(run["policy"])
    return pol.settings_from(pol.inputs_of(run["settings"]))


def graph_issue_cost() -> tuple[float, int, list]:
    """Seconds per graphed decode op: the host time of the handlers' graphed calls over the number of graphed ops
    (``costmodel.graphed``) in the FlexGen runs of GRAPH_RUNS."""
    from offsim.core.costmodel import graphed

    data = json.loads(GRAPH_RUNS.read_text())
    total, n, used = 0.0, 0, []
    for run in data["runs"]:
        if run["policy"] != "flexgen":
            continue
        hw = get_hardware("h200", data["budget_gib"])
        plan = build_plan(run["policy"], get_model(data["model"]), hw, Workload.from_dict(run["workload"]),
                          _as_run(run), validate=False)
        total += sum(v for k, v in run["issue_s_by_handler"].items() if k.endswith(" (graph)"))
        n += sum(1 for o in plan.ops if graphed(o.kind, o.part, o.q_tokens, o.phase, 1))
        used.append(run["config"])
    return total / n, n, used


if __name__ == "__main__":
    argparser(__doc__).parse_args()
    main()
