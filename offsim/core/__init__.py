"""The core every layer builds on: model/hardware/workload specs, the cost model (the only place bytes and FLOPs
become seconds), the plan (the contract), the SimPy simulator, traces, and file/provenance helpers."""
