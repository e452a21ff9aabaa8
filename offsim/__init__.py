"""offsim: predict what an LLM offloading policy does on given hardware (DESIGN.md).

The public surface: specs (``get_model``, ``get_hardware``, ``Workload``), ``build_plan`` (policies), ``simulate``
(SimPy), ``Trace`` and its metrics, and ``optimize.search`` (policy search).
"""
from .errors import OffsimError
from .plan import Plan, PlanError
from .policies import POLICIES, build_plan
from .sim import simulate
from .specs import HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from .trace import Trace

__all__ = ["OffsimError", "Plan", "PlanError", "POLICIES", "build_plan", "simulate", "HardwareSpec", "ModelSpec",
           "Workload", "get_hardware", "get_model", "Trace"]
__version__ = "0.1.0"
