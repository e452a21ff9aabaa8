"""Shared fixtures: tiny models and hardware so the CPU suite stays fast."""
import dataclasses

import pytest

from offsim.core.footprint import GPU_PROCESS_OVERHEAD_BYTES
from offsim.core.specs import ModelSpec, get_hardware


@pytest.fixture(autouse=True)
def _gpu_uncapped_between_tests():
    """A run caps the caching allocator for the rest of the process (``memory.apply_gpu_budget``); the next test
    starts with the whole card again."""
    yield
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.fixture
def tiny_opt() -> ModelSpec:
    return ModelSpec(name="tiny-opt", family="opt", num_layers=2, d_model=64, num_heads=4, num_kv_heads=4,
                     head_dim=16, ffn_dim=256, vocab_size=128, max_positions=64)


@pytest.fixture
def tiny_llama() -> ModelSpec:
    return ModelSpec(name="tiny-llama", family="llama", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_dim=128, vocab_size=128, max_positions=64, tie_word_embeddings=False)


@pytest.fixture
def t4():
    return get_hardware("t4")


@pytest.fixture
def small_gpu_t4(t4):
    """A T4 with 1 MiB of GPU memory for the plan (beyond cuBLAS's workspace and the allocator's rounding, which
    every plan holds: ``footprint.GPU_PROCESS_OVERHEAD_BYTES``), 4 MiB host and 64 MiB disk: tiny models must
    offload."""
    return dataclasses.replace(t4, gpu_mem_bytes=GPU_PROCESS_OVERHEAD_BYTES + (1 << 20), cpu_mem_bytes=4 << 20,
                               disk_bytes=64 << 20)
