"""The policy registry: one ``Policy`` record per policy, listed once, and ``build_plan``, the one entry point that
turns (policy, model, hardware, workload, settings) into a validated Plan.

To add a policy: write a module with its settings dataclass, plan builder and candidate generator, end it with a
``Policy(...)`` record, and list that record here (``docs/architecture.md`` walks through an example).
"""
from __future__ import annotations

from typing import Any, Mapping

from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.core.specs import HardwareSpec, ModelSpec, Workload
from offsim.policies.base import Policy
from offsim.policies.flexgen import FLEXGEN
from offsim.policies.selectn.policy import SELECTN
from offsim.policies.static import ACCELERATE, ZERO
from offsim.policies.tightllm.policy import TIGHTLLM

POLICIES: dict[str, Policy] = {p.name: p for p in (ACCELERATE, ZERO, FLEXGEN, TIGHTLLM, SELECTN)}


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; an unknown name is an error listing the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise OffsimError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}") from None


def build_plan(policy: str, model: ModelSpec, hw: HardwareSpec, wl: Workload,
               settings: Mapping[str, Any] | Any | None = None, validate: bool = True) -> Plan:
    """The plan of ``policy`` for this model, hardware and workload; ``settings`` a dict or the settings object."""
    p = get_policy(policy)
    plan = p.build(model, hw, wl, p.settings_from(settings))
    return plan.validate() if validate else plan
