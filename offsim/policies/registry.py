"""The policy registry: one ``Policy`` record per policy, listed once, and ``build_plan``, the one entry point that
turns (policy, model, hardware, workload, settings) into a validated Plan.

To add a policy: write a module with its settings dataclass, plan builder and candidate generator, end it with a
``Policy(...)`` record, and list that record here (``docs/architecture.md`` walks through an example).
"""
from __future__ import annotations

import gc

from typing import Any, Mapping

from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan, PlanError
from offsim.core.specs import HardwareSpec, ModelSpec, Workload, check_plan_size, check_positions
from offsim.policies.base import Policy, capacity_of
from offsim.policies.flexgen import FLEXGEN
from offsim.policies.ref import ACCELERATE_REF, FLEXGEN_REF, ZERO_REF
from offsim.policies.selectn.policy import SELECTN
from offsim.policies.static import ACCELERATE, ZERO
from offsim.policies.tightllm.policy import TIGHTLLM

POLICIES: dict[str, Policy] = {p.name: p for p in (ACCELERATE, ZERO, FLEXGEN, TIGHTLLM, SELECTN, ACCELERATE_REF,
                                                    ZERO_REF, FLEXGEN_REF)}
# the policies that compare, sweeps and jobs run when none are named: the ideal ones (a ``*-ref`` policy models a
# peer's implementation of one of them: ``offsim.policies.ref``)
DEFAULT_POLICIES: tuple[str, ...] = tuple(n for n, p in POLICIES.items() if not p.implements)


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; an unknown name is an error listing the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise OffsimError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}") from None


def load_plan(path) -> Plan:
    """A saved plan as a command given ``--plan FILE`` runs it: ``Plan.load_valid``, and its ``policy`` one that is
    registered -- the name that a warm-up, ``offsim validate`` and a re-plan rebuild it with, so a plan that names
    no policy would run once and then fail (or be compared with nothing) later."""
    plan = Plan.load_valid(path)
    if plan.policy not in POLICIES:
        raise PlanError(f"plan {path}: policy {plan.policy!r} is not one offsim knows; valid: {', '.join(POLICIES)}")
    return plan


def build_plan(policy: str, model: ModelSpec, hw: HardwareSpec, wl: Workload,
               settings: Mapping[str, Any] | Any | None = None, validate: bool = True,
               check_fits: bool = True) -> Plan:
    """The plan of ``policy`` for this model, hardware and workload; ``settings`` a dict or the settings object.

    ``check_fits``: a placement whose resident bytes and minimum working set exceed a tier is refused first, from
    arithmetic (``footprint.check_fits``: one line, each short tier and its shortfall in GiB), before any op is
    built -- so a block that fits nowhere fails in microseconds, not after minutes of emitting ops. ``validate``:
    the built plan is then checked op by op (``Plan.validate``). Turn both off only to rebuild the plan of a run
    that already happened; the search skips ``validate`` (it returns settings, whose plan is validated where built
    for use)."""
    p = get_policy(policy)
    st = p.settings_from(settings)
    check_positions(model, wl)
    check_plan_size(model, wl)
    if check_fits:
        check_plan_fits(policy, model, hw, wl, st)
    # The cyclic garbage collector is paused while the ops are made (as ``simulate`` pauses it while it runs): a
    # large plan is ~10^6 new objects that form no cycles, and each of the collector's passes over them frees
    # nothing (OPT-175B's FlexGen plan: build 1.14 s with the collector, 0.68 s without; results/bench_sim_speed/)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        plan = p.build(model, hw, wl, st)
        return plan.validate() if validate else plan
    finally:
        if was_enabled:
            gc.enable()


def check_plan_fits(policy: str, model: ModelSpec, hw: HardwareSpec, wl: Workload,
                    settings: Mapping[str, Any] | Any | None = None) -> None:
    """Refuse, from arithmetic alone (``footprint.check_fits``: one line, each short tier and its shortfall in GiB),
    a placement of ``policy`` whose resident bytes and minimum working set exceed a tier -- without building an op.
    A policy that gives no placement is not checked here (its built plan's ``validate`` is)."""
    p = get_policy(policy)
    check_positions(model, wl)
    check_plan_size(model, wl)
    if p.placement is None:
        return
    st = p.settings_from(settings)
    what = (f"{policy} for {model.name} with {wl.num_gpu_batches} GPU batches of {wl.gpu_batch_size} sequences of "
            f"{wl.prompt_len} + {wl.gen_len} tokens on {hw.name}")
    if getattr(st, "num_stages", 1) > 1 and p.check_stages is not None:
        p.check_stages(model, hw, wl, st, what)
        return
    fp.check_fits(model, capacity_of(hw), wl, p.placement(model, hw, wl, st), what)


def same_placement(policy: str, model: ModelSpec, hw: HardwareSpec, settings: Mapping[str, Any] | Any | None,
                   wl: Workload, *others: Workload) -> bool:
    """Whether ``policy`` places weights and cache alike for ``wl`` and every one of ``others`` (False when it gives
    no placement): a plan shortened to fewer steps is then the same plan, cut short. Not so for a policy that sizes
    its placement by the lengths (Accelerate's GPU layers make room for the KV of the whole output)."""
    p = get_policy(policy)
    if p.placement is None:
        return False
    st = p.settings_from(settings)
    ref = p.placement(model, hw, wl, st)
    return all(p.placement(model, hw, x, st) == ref for x in others)
