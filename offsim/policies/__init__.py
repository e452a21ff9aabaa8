"""Offloading policies: each turns (model, hardware, workload, settings) into a Plan.

``static`` (Accelerate, ZeRO-Inference), ``flexgen`` (with FlexGen's LP in ``lp``), ``tightllm/`` and
``selectn/``, all on the block schedule of ``schedule`` or their own; ``registry`` lists them.
"""
from offsim.policies.base import Candidate, Policy
from offsim.policies.registry import POLICIES, build_plan, get_policy

__all__ = ["Candidate", "Policy", "POLICIES", "build_plan", "get_policy"]
