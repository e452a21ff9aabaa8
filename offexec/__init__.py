"""offexec: run an offsim plan on a real GPU (or the CPU, for tests) and measure it."""

# what the executor caps PyTorch's GPU allocator at: the plan's own GPU bytes (what offsim predicts) or the budget
# (here, torch-free, so that the CLI can list the choices without importing torch)
ALLOCATOR_CAPS = ("plan", "budget")
# The default is the budget, the limit the user gave (the plan was checked to fit it, from arithmetic, before the run
# allocates). At the plan's own bytes the allocator retries -- frees its cache and synchronises every stream -- where
# its fragmentation outgrows the footprint's allowance: on the H200 two Llama-3-8B plans retried 30 and 42 times, their
# prefill rate 9-19 % and TightLLM's decode rate 4-6 % below those at the budget, where they never retried
# (results/validation/allocator_cap_23ec055/). `offexec profile` measures at the budget too, so runs now see the rates
# offsim predicts with. 'plan' remains the memory contract's test: a run that completes under it held at most what
# offsim predicted (experiments/memory/h200_sweep.py runs every case so).
DEFAULT_ALLOCATOR_CAP = "budget"
