"""What a key mask costs PyTorch's ``scaled_dot_product_attention`` on this GPU: time and the memory it allocates
beyond its inputs and output, for the mask offexec builds for left-padded mixed-length batches (bool [B, 1, T, C],
``offexec/model.py visible``) against the alternatives (an additive mask in the query's dtype, contiguous or with
its rows 16-element aligned; no mask at all, i.e. the uniform-length path's bottom-right causal attention), under
each SDPA backend that accepts it (issue 20: the job blocks' decode layer ops stall at every step's first layer).

    python -m experiments.offexec.mask_sdpa [--out FILE.json] [--shapes B,H,T,C ...]

Prints one line per (shape, mask, backend) and writes them as JSON. GPU only.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from offsim.core.provenance import provenance

# Llama-2-13B's TightLLM job blocks (results/offline_jobs/h200): translation decode (64 sequences, ~50 recomputed
# query rows over ~130 keys), summarization decode (48, ~145 over ~545) and its prefill (48, 592 over 592)
SHAPES = ((64, 40, 50, 130), (48, 40, 145, 545), (48, 40, 592, 592), (64, 40, 1, 130))
BACKENDS = {"default": None, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH}


def _masks(B: int, T: int, C: int, dev) -> dict:
    """The key masks of one left-padded batch: sequence b padded by b mod 7 positions, causal at the bottom right."""
    rows = torch.arange(C - T, C, device=dev)
    cols = torch.arange(C, device=dev)
    pad = torch.arange(B, device=dev) % 7
    vis = ((cols[None] <= rows[:, None])[None] & (cols[None] >= pad[:, None])[:, None]
           | (cols[None] == rows[:, None])[None]).unsqueeze(1)  # [B, 1, T, C]
    add = torch.zeros(B, 1, T, C, dtype=torch.float16, device=dev).masked_fill_(~vis, float("-inf"))
    C16 = -(-C // 16) * 16
    aligned = torch.full((B, 1, T, C16), float("-inf"), dtype=torch.float16, device=dev)[..., :C]
    aligned.copy_(add)
    return {"bool": vis, "additive": add, "additive_aligned16": aligned,
            "none": causal_lower_right(T, C) if 1 < T < C else None}


def measure(B: int, H: int, T: int, C: int, D: int = 128, repeats: int = 20) -> list[dict]:
    dev = torch.device("cuda")
    q = torch.randn(B, H, T, D, dtype=torch.float16, device=dev)
    K = torch.randn(B, H, C, D, dtype=torch.float16, device=dev)
    V = torch.randn_like(K)
    out = []
    for name, mask in _masks(B, T, C, dev).items():
        for bname, be in BACKENDS.items():
            row = {"B": B, "H": H, "T": T, "C": C, "D": D, "mask": name, "backend": bname}
            try:
                def call():
                    if be is None:
                        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=T == C and mask is None)
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask,
                                                              is_causal=T == C and mask is None)
                call()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                o = call()
                torch.cuda.synchronize()
                row["extra_bytes"] = torch.cuda.max_memory_allocated() - base - o.numel() * o.element_size()
                del o
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * repeats)]
                for i in range(repeats):
                    ev[2 * i].record()
                    call()
                    ev[2 * i + 1].record()
                torch.cuda.synchronize()
                ts = sorted(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(repeats))
                row["ms"] = ts[len(ts) // 2]
            except RuntimeError as e:  # the backend refuses this mask or shape
                row["error"] = str(e).splitlines()[0][:160]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--shapes", nargs="*", help="B,H,T,C (default: the job blocks' shapes)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("mask_sdpa: needs a CUDA GPU")
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    rows = [r for s in shapes for r in measure(*s)]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"provenance": provenance(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
