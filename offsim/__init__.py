"""offsim: predict what an LLM offloading policy does on given hardware (docs/architecture.md).

The public surface: specs (``get_model``, ``get_hardware``, ``Workload``), ``build_plan`` (policies), ``simulate``
(SimPy), ``Trace`` and its metrics, and ``optimize.search`` (policy search).
"""
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan, PlanError
from offsim.policies import POLICIES, build_plan
from offsim.core.sim import simulate
from offsim.core.specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from offsim.core.trace import Trace

__all__ = ["OffsimError", "Plan", "PlanError", "POLICIES", "build_plan", "simulate", "HardwareSpec", "ModelSpec",
           "Workload", "get_hardware", "get_model", "Trace"]
__version__ = "0.1.0"
