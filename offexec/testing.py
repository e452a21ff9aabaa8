"""Helpers for offexec's tests: tiny transformers models with random weights, their greedy generation, logits and
KV cache (the reference the executor must reproduce), and which KV positions a plan stores on each home tier."""
from __future__ import annotations

import dataclasses

import torch

from offsim.core.plan import Plan
from offsim.core.specs import ModelSpec, _hf_config

TINY = {"opt": dict(layers=2, h=64, heads=4, kv=4, ffn=128), "llama": dict(layers=2, h=64, heads=4, kv=2, ffn=128)}


def tiny_hf(family: str, seed: int = 0, vocab: int = 128, max_pos: int = 64, std: float = 0.15,
            layers: int | None = None):
    """A tiny transformers OPTForCausalLM / LlamaForCausalLM (2 layers, or ``layers``, d_model 64; Llama with GQA)
    with random weights large enough for logits of order one (so greedy tokens vary), fp32, EOS disabled
    (transformers' generate would otherwise pad after OPT's EOS id 2). Returns (model, ModelSpec with 4-byte
    elements)."""
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    t = TINY[family]
    d = _hf_config(family, layers or t["layers"], t["h"], t["heads"], t["kv"], t["ffn"], vocab, max_pos)
    d.pop("model_type")
    torch.manual_seed(seed)
    m = (OPTForCausalLM(OPTConfig(**d)) if family == "opt" else LlamaForCausalLM(LlamaConfig(**d))).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)
    for cfg in (m.config, m.generation_config):
        cfg.eos_token_id = None
    spec = dataclasses.replace(ModelSpec.from_hf_config(m.config, name=f"tiny-{family}"), dtype_bytes=4)
    return m, spec


def hf_generate(model, prompts: torch.Tensor, gen_len: int):
    """Greedy tokens [N, gen_len] and raw logits [gen_len, N, V] of transformers' ``generate``."""
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=gen_len,
                             min_new_tokens=0, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences[:, prompts.shape[1]:], torch.stack(out.logits)


def hf_kv(model, seqs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V of every layer after a full forward over ``seqs`` [N, S]: per layer ([N, Hk, S, D], [N, Hk, S, D])."""
    with torch.no_grad():
        out = model(seqs, use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    if hasattr(cache, "layers"):
        return [(lay.keys, lay.values) for lay in cache.layers]
    return [(k, v) for k, v in cache]


def stored_positions(plan: Plan) -> dict[tuple[str, int, int], set]:
    """(home tier, layer, batch) -> KV positions the plan writes to that home: every computed position for
    GPU-homed heads, d2h stores for host-homed heads (and CPU attention's new tokens), disk writes for disk-homed."""
    out: dict = {}
    kg, kc = plan.kv_split
    for op in plan.ops:
        key = None
        if op.kind == "compute" and op.part in ("layer", "pre_attn") and kg:
            key, lo, hi = ("gpu", op.layer, op.batch), op.ctx_tokens - op.q_tokens, op.ctx_tokens
        elif op.kind == "cpu_compute" and kc:
            key, lo, hi = ("cpu", op.layer, op.batch), op.ctx_tokens - op.q_tokens, op.ctx_tokens
        elif op.tensor == "kv" and op.kind == "d2h" and op.head_hi <= kg + kc:
            key, lo, hi = ("cpu", op.layer, op.batch), op.lo, op.hi
        elif op.tensor == "kv" and op.kind == "disk_write":
            key, lo, hi = ("disk", op.layer, op.batch), op.lo, op.hi
        if key is not None:
            out.setdefault(key, set()).update(range(lo, hi))
    return out


def spec_fp32(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, dtype_bytes=4)


# (policy, settings, gpu_batch_size, num_gpu_batches) on a tiny model: every static and FlexGen placement over every
# tier, CPU attention included -- the settings the executor's token tests and the footprint's byte tests share
TIER_CASES = [
    ("static-accelerate", {"gpu_layers": 1}, 3, 1),
    ("static-accelerate", {"gpu_layers": 0, "offload": "disk"}, 3, 1),
    ("static-zero", {}, 3, 1),
    ("static-zero", {"kv_on_cpu": True, "offload": "disk"}, 3, 1),
    ("flexgen", {"percent": (100, 0, 100, 0, 100, 0)}, 2, 2),  # KV on the GPU
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0)}, 2, 3),  # KV on the CPU, GPU attention (the H200 target)
    ("flexgen", {"percent": (0, 0, 0, 0, 100, 0)}, 2, 2),  # weights and KV on disk
    ("flexgen", {"percent": (50, 25, 25, 25, 0, 100)}, 2, 2),  # every tier, activations on the CPU
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "cpu_attention": True}, 2, 2),
    ("flexgen", {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True}, 2, 2),  # CPU attention, disk heads
    # whole-layer streaming (flexgen --whole-layers; flexgen streams sub-layers by default, as FlexGen's code does)
    ("flexgen", {"percent": (20, 80, 0, 100, 100, 0), "sublayer": False}, 2, 3),  # the split straddles a tensor
    ("flexgen", {"percent": (50, 25, 25, 25, 0, 100), "sublayer": False}, 2, 2),  # every tier, activations parked
    ("flexgen", {"percent": (0, 50, 0, 50, 100, 0), "cpu_attention": True, "sublayer": False}, 2, 2),
]


def fake_quantized_store(monkeypatch):
    """Make an uncompressed run store what a compressed cache stores: after each attention (over the fresh fp16
    new tokens, as the compressed run attends), the new positions' K/V in the buffers become
    dequantize(quantize(kv)); loads, stores and later attention then see the 4-bit values."""
    from offexec import quant
    from offexec.executor import Executor

    orig = Executor._attend_gpu

    def attend(self, op, args, q, k_new, v_new):
        out = orig(self, op, args, q, k_new, v_new)
        start, ctx = op.ctx_tokens - op.q_tokens, op.ctx_tokens
        for _, _, buf in self._kv_buffers(op, args):
            buf[start:ctx] = quant.dequantize(quant.quantize_kv(buf[start:ctx]), buf.dtype)
        return out

    monkeypatch.setattr(Executor, "_attend_gpu", attend)
