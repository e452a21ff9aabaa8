"""Offloading policies: each turns (model, hardware, workload, settings) into a Plan.

``static`` (Accelerate, ZeRO-Inference), ``flexgen`` (with FlexGen's LP in ``lp``), ``tightllm/`` and
``selectn/``, all on the block schedule of ``schedule`` or their own; ``ref`` (the ``*-ref`` policies: the peers'
schedules as their code runs them); ``registry`` lists them.
"""
from offsim.policies.base import Candidate, Policy
from offsim.policies.registry import DEFAULT_POLICIES, POLICIES, build_plan, get_policy, load_plan

__all__ = ["Candidate", "DEFAULT_POLICIES", "Policy", "POLICIES", "build_plan", "get_policy", "load_plan"]
