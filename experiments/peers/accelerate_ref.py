"""HF Accelerate's offloading (``device_map="auto"`` with ``max_memory``) running transformers' own OPT or Llama, as
system ``accelerate-ref``: what a user gets from ``from_pretrained(..., device_map="auto", max_memory=...)``.

The model is transformers' ``OPTForCausalLM`` / ``LlamaForCausalLM`` built from offsim's preset config
(``ModelSpec.to_hf_config_dict``; no hub) on the meta device, its device map from ``accelerate.infer_auto_device_map``
under ``max_memory`` = {GPU: the budget less the batch's KV cache and activations, "cpu": the host limit}, its
weights materialised in host memory with seeded random values (tiled from one random block: a 30B model in
seconds), then ``accelerate.dispatch_model`` -- the call ``from_pretrained`` ends with: CPU-homed modules get
Accelerate's hooks, which copy each module's weights to the GPU synchronously from pageable memory before its
forward. ``generate`` (greedy, EOS off, ``min_new_tokens = gen_len``) runs a warm-up of 2 tokens, then the measured
run; a stopping criterion timestamps every step (after a CUDA synchronise): prefill = up to the first token, decode
= the rest; FlexGen's throughput definitions.

Batch: ``--batch auto`` takes the largest batch (from ``BATCHES``) whose KV cache and activations leave the GPU at
least ``MIN_GPU_WEIGHTS_GIB`` for weights plus one streamed decoder layer; ``experiments.real_throughput`` retries
a smaller batch in a new process after an OOM. The KV cache stays on the GPU (transformers' DynamicCache), as in a
user's run. Disk offload is not used: every model here fits the 125 GiB host.

    python -m experiments.peers.accelerate_ref --model opt-30b --prompt-len 512 --gen-len 32 --budget-gib 16 \\
        [--batch auto|N]
    python -m experiments.peers.accelerate_ref --model tiny.json --device cpu ...   # smoke test, no GPU

Prints ``PEER_RESULT {json}`` (``common.emit``) and ends with one JSON line.
"""
from __future__ import annotations

import json
import sys
import time

from experiments.peers.common import (GiB, HOST_LIMIT_GIB, allocator_counts, base_record, emit, env_offline,
                                      finish_record, flexgen_metrics, link_bound, measure_h2d, measure_h2d_pageable,
                                      point_parser, record_failure, set_gpu_budget, versions)

SYSTEM = "accelerate-ref"
BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_GPU_WEIGHTS_GIB = 1.0
ALLOC_SLACK_GIB = 1.0  # allocator fragmentation, cuBLAS workspace, the sampled tokens


def hf_model_on_meta(model_name: str, min_positions: int = 0):
    """transformers' model of offsim's preset (or config.json) on the meta device, fp16; the learned position table
    (OPT) extended to ``min_positions`` when shorter (dummy weights; said in the record). Returns (model, spec)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    from offsim import get_model

    spec = get_model(model_name)
    d = spec.to_hf_config_dict()
    mtype = d.pop("model_type")
    if min_positions > d["max_position_embeddings"]:
        d["max_position_embeddings"] = int(min_positions)
    cfg = OPTConfig(**d) if mtype == "opt" else LlamaConfig(**d)
    cls = OPTForCausalLM if mtype == "opt" else LlamaForCausalLM
    with torch.device("meta"):
        m = cls(cfg)
    m = m.to(torch.float16).eval()
    for c in (m.config, m.generation_config):
        c.eos_token_id = None  # random weights: never stop early
    return m, spec


def materialise(model, device: str = "cpu", seed: int = 0, std: float = 0.02) -> float:
    """Give every parameter of a meta model real memory on ``device`` with seeded values (tiled from one random
    block: norm weights 1, biases and the rest N(0, std)); rebuild the non-persistent buffers that meta construction
    left empty (RoPE's inverse frequencies). Returns seconds."""
    import torch

    t0 = time.perf_counter()
    rope = {n: m for n, m in model.named_modules() if hasattr(m, "inv_freq")}
    model.to_empty(device=device)
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(1 << 24, generator=g) * std).to(torch.float16).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.view(-1)
            if "norm" in name and name.endswith("weight"):
                flat.fill_(1.0)
                continue
            for lo in range(0, flat.numel(), block.numel()):
                n = min(block.numel(), flat.numel() - lo)
                flat[lo:lo + n].copy_(block[:n])
        for mod in rope.values():
            inv = _inv_freq(mod).to(device)
            mod.inv_freq = inv
            if hasattr(mod, "original_inv_freq"):
                mod.original_inv_freq = inv.clone()
    return time.perf_counter() - t0


def _inv_freq(mod):
    import torch

    try:  # transformers' own: the module's class with its config, on the CPU
        with torch.device("cpu"):
            return type(mod)(config=mod.config).inv_freq.float()
    except Exception:  # noqa: BLE001 -- default RoPE from the config
        cfg = mod.config
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        base = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta",
                                                                                                     10000.0)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def reserve_bytes(spec, batch: int, prompt_len: int, gen_len: int) -> int:
    """GPU memory the batch needs beside the weights: its KV cache (on the GPU in a DynamicCache, plus one layer's
    copy while it grows), the prefill's activations (hidden states, q/k/v, the FFN's intermediate; SDPA keeps no
    full attention matrix), the last token's logits in fp32, and slack."""
    seq = prompt_len + gen_len
    kv = spec.kv_bytes(batch, seq)
    kv_grow = 2 * kv // spec.num_layers
    act = batch * prompt_len * (8 * spec.d_model + 2 * spec.ffn_dim) * 2
    logits = batch * spec.vocab_size * 4 * 2
    return int(kv + kv_grow + act + logits + ALLOC_SLACK_GIB * GiB)


def largest_layer_bytes(spec) -> int:
    return spec.layer_weight_bytes()


def auto_batch(spec, prompt_len: int, gen_len: int, budget_gib: float) -> int | None:
    """The largest batch of ``BATCHES`` whose reserve leaves the GPU at least ``MIN_GPU_WEIGHTS_GIB`` of weights and
    one streamed decoder layer; None when even one sequence does not fit."""
    best = None
    for b in BATCHES:
        free = budget_gib * GiB - reserve_bytes(spec, b, prompt_len, gen_len) - largest_layer_bytes(spec)
        if free >= MIN_GPU_WEIGHTS_GIB * GiB:
            best = b
    return best


class StepClock:
    """A stopping criterion that never stops generation and timestamps every step (after a CUDA synchronise): the
    first call comes after the prefill's forward."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kw):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def timed_generate(model, input_ids, attention_mask, gen_len: int, cuda: bool,
                   steps: list | None = None) -> tuple[float, float, object]:
    """(prefill seconds, decode seconds, output ids) of greedy ``generate`` for ``gen_len`` new tokens; ``steps``:
    a list to receive each decode step's seconds (``gen_len`` - 1 of them)."""
    import torch
    from transformers import StoppingCriteriaList

    clock = StepClock(cuda)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=gen_len,
                             min_new_tokens=gen_len, do_sample=False, use_cache=True, pad_token_id=1,
                             stopping_criteria=StoppingCriteriaList([clock]))
    if cuda:
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    if not clock.times:
        return t_end - t0, 0.0, out
    if steps is not None:
        steps.extend(b - a for a, b in zip(clock.times, clock.times[1:]))
    return clock.times[0] - t0, t_end - clock.times[0], out


def project_decode_s(steps: list[float], gen_len: int) -> float:
    """Decode seconds of ``gen_len`` - 1 steps from the first measured ``steps``: a straight line through the
    measured steps' seconds by step (least squares: a step reads one more position of KV than the last), summed
    over every step, the measured ones as measured. The way FlexGen's own benchmarks project a cut run
    (``--cut-gen-len``); a record so made says ``projected``."""
    import numpy as np

    n = len(steps)
    if n >= gen_len - 1:
        return float(sum(steps[:gen_len - 1]))
    i = np.arange(1, n + 1, dtype=float)
    slope, icpt = np.polyfit(i, np.asarray(steps, dtype=float), 1) if n >= 2 else (0.0, float(steps[0]))
    rest = np.arange(n + 1, gen_len, dtype=float)
    return float(sum(steps) + np.maximum(icpt + slope * rest, 0.0).sum())


def cut_gen_len_arg(text: str) -> int:
    """``--cut-gen-len``'s value: a whole number of at least 3 tokens (two decode steps draw the projection's
    line), or argparse's clear error."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 3:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 3 tokens (two decode steps to draw the "
                                         f"projection's line from), got {text!r}")
    return n


def add_cut_option(ap) -> None:
    """``--cut-gen-len N``, shared by the Accelerate and DeepSpeed harnesses."""
    ap.add_argument("--cut-gen-len", type=cut_gen_len_arg, default=None, metavar="N",
                    help="generate N tokens and project the decode to --gen-len from them (a straight line through "
                         "the measured steps; the record says projected), for runs longer than a device call")


def prompts(batch: int, prompt_len: int, vocab: int, device):
    """Seeded random prompt ids [batch, prompt_len] (no padding: FlexGen's runs pad to a fixed length, and the
    padded positions cost the same compute) and an all-ones mask."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (batch, prompt_len), generator=g)
    return ids.to(device), torch.ones_like(ids).to(device)


def measure_generate(model, rec: dict, b: int, prompt_len: int, gen_len: int, vocab: int, warmup: bool,
                     cuda: bool, cut_gen_len: int | None = None) -> None:
    """transformers' ``generate`` of ``b`` seeded prompts, after an unmeasured two-token warm-up (its peak memory
    then reset), timed as prefill and decode; FlexGen's throughputs into ``rec``. Accelerate's and DeepSpeed's
    harnesses measure the same way. ``cut_gen_len`` (< ``gen_len``): generate that many tokens and project the
    decode to ``gen_len`` (``project_decode_s``): ``rec['projected']`` is then true and ``rec['measured_steps']``
    says how many decode steps ran; for runs whose whole generation outlasts a device call."""
    import torch

    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if warmup:
        ids, mask = prompts(b, prompt_len, vocab, dev)
        timed_generate(model, ids, mask, 2, cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
    ids, mask = prompts(b, prompt_len, vocab, dev)
    cut = cut_gen_len if cut_gen_len and cut_gen_len < gen_len else None
    steps: list[float] = []
    before = allocator_counts() if cuda else {}
    prefill_s, decode_s, out = timed_generate(model, ids, mask, cut or gen_len, cuda, steps)
    if cuda:  # the caching allocator's device calls during the measured generate: cudaMalloc / cudaFree (each free
        # synchronises the device) when a run near its cap keeps freeing cached blocks to allocate new ones
        rec.update({f"gen_{k}": v - before[k] for k, v in allocator_counts().items()})
    rec["decode_step_ms"] = [round(s * 1e3, 3) for s in steps]  # each decode step, to tell a uniform step from stalls
    if out.shape[1] != prompt_len + (cut or gen_len):
        raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} new tokens, asked for {cut or gen_len}")
    if cut:
        decode_s = project_decode_s(steps, gen_len)
        rec.update(projected=True, measured_steps=len(steps))
    rec.update(flexgen_metrics(b, prompt_len, gen_len, prefill_s, decode_s))


def run(model_name: str, prompt_len: int, gen_len: int, budget_gib: float, batch: int | None = None,
        host_limit_gib: float = HOST_LIMIT_GIB, device: str = "cuda", warmup: bool = True,
        cut_gen_len: int | None = None) -> dict:
    """One Accelerate run; the result record. ``cut_gen_len``: ``measure_generate``'s (the batch still sized for
    ``gen_len``)."""
    import torch

    from offsim import get_model

    spec = get_model(model_name)
    cuda = device == "cuda"
    b = batch or auto_batch(spec, prompt_len, gen_len, budget_gib)
    rec = base_record(SYSTEM, model_name, prompt_len, gen_len, budget_gib, probe=True, batch=b, gpu_batch_size=b,
                      num_gpu_batches=1, versions=versions("torch", "transformers", "accelerate"))
    if b is None:
        rec.update(status="skipped", reason="even one sequence's KV cache and activations leave no GPU room")
        return rec
    t0 = time.perf_counter()
    env_offline()
    st = {"batch_rule": "explicit" if batch else "auto (largest that fits)"}
    try:
        h2d = 0.0
        if cuda:
            budget = set_gpu_budget(budget_gib)
            st["gpu_fraction"] = budget["fraction"]
            h2d = measure_h2d()
        model, spec = hf_model_on_meta(model_name, prompt_len + gen_len)
        st["extended_positions"] = model.config.max_position_embeddings > spec.max_positions
        gpu_w = 0
        if cuda:
            from accelerate import dispatch_model, infer_auto_device_map

            gpu_w = int(budget_gib * GiB - reserve_bytes(spec, b, prompt_len, gen_len))
            max_memory = {0: max(gpu_w, 0), "cpu": int(host_limit_gib * GiB)}
            dmap = infer_auto_device_map(model, max_memory=max_memory, dtype=torch.float16,
                                         no_split_module_classes=model._no_split_modules)
            st["max_memory_gpu_bytes"] = max_memory[0]
            st["device_map_tiers"] = {str(k): sum(1 for v in dmap.values() if v == k) for k in set(dmap.values())}
        st["materialise_s"] = materialise(model, "cpu")
        offloaded = spec.weight_bytes()
        if cuda:
            model = dispatch_model(model, device_map=dmap, main_device=0)
            on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
            offloaded = max(spec.weight_bytes() - on_gpu, 0)
            st["gpu_weight_bytes"] = int(on_gpu)
            st.update(gpu_modules(model))
            st["h2d_pageable_bytes_per_s"] = measure_h2d_pageable()
        rec["settings"] = json.dumps(st, sort_keys=True, default=str)
        measure_generate(model, rec, b, prompt_len, gen_len, spec.vocab_size, warmup, cuda, cut_gen_len)
        dec = offloaded * (gen_len - 1)
        rec.update(decode_h2d_bytes=dec, h2d_bytes_per_s=h2d or None,
                   link_bound_decode_tok_s=link_bound(b, gen_len, dec, h2d) if h2d else None)
    except Exception as e:  # noqa: BLE001 -- a failure is a result
        record_failure(rec, e)
    rec["settings"] = json.dumps(st, sort_keys=True, default=str)
    return finish_record(rec, t0, cuda)


def gpu_modules(model) -> dict:
    """Where the device map put the decoder layers and the LM head: ``gpu_layers``, the decoder layers (the classes
    in ``model._no_split_modules``) whose every parameter is on the GPU -- what offsim's static-accelerate-ref
    prices as ``gpu_layers`` -- and ``lm_head_on_gpu`` (device_map='auto' fills the GPU in module order, so the
    head, last, is offloaded whenever a layer is)."""
    kinds = set(model._no_split_modules or ())
    n = 0
    for mod in model.modules():
        if type(mod).__name__ in kinds:
            ps = list(mod.parameters())
            n += bool(ps) and all(p.device.type == "cuda" for p in ps)
    head = model.get_output_embeddings()
    return {"gpu_layers": n, "lm_head_on_gpu": bool(head is not None and head.weight.device.type == "cuda")}


def main(argv=None) -> int:
    ap = point_parser(__doc__)
    ap.add_argument("--batch", default="auto", help="'auto' (the largest that fits) or a number")
    ap.add_argument("--host-limit-gib", type=float, default=HOST_LIMIT_GIB)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="'cpu': smoke test on a tiny model")
    ap.add_argument("--no-warmup", action="store_true")
    add_cut_option(ap)
    args = ap.parse_args(argv)
    batch = None if args.batch == "auto" else int(args.batch)
    rec = run(args.model, args.prompt_len, args.gen_len, args.budget_gib, batch, args.host_limit_gib, args.device,
              not args.no_warmup, args.cut_gen_len)
    emit(rec)
    print(json.dumps({k: rec.get(k) for k in ("system", "status", "batch", "prefill_tok_s", "decode_tok_s",
                                                "total_tok_s")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
