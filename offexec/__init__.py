"""offexec: run an offsim plan on a real GPU (or the CPU, for tests) and measure it."""

# what the executor caps PyTorch's GPU allocator at: the plan's own GPU bytes (what offsim predicts) or the budget
# (here, torch-free, so that the CLI can list the choices without importing torch)
ALLOCATOR_CAPS = ("plan", "budget")
