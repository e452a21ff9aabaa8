"""What a key mask costs PyTorch's ``scaled_dot_product_attention`` on this GPU: time and the memory it allocates
beyond its inputs and output, for the mask offexec builds for left-padded mixed-length batches (bool [B, 1, T, C],
``offexec/model.py visible``) against the alternatives (an additive mask in the query's dtype, contiguous or with
its rows 16-element aligned; no mask at all, i.e. the uniform-length path's bottom-right causal attention), under
each SDPA backend that accepts it (issue 20: the job blocks' decode layer ops stall at every step's first layer),
and for decode shapes the host time of the first call at the next step's context (``new_shape_ms``: a backend that
plans per shape pays it there).

    python -m experiments.offexec.mask_sdpa [--out FILE.json] [--shapes B,H,T,C ...]
    python -m experiments.offexec.mask_sdpa --readme FILE.json      # README.md beside it, from its rows; no GPU

Prints one line per (shape, mask, backend) and writes them as JSON. GPU only (``--readme`` aside).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from offexec import model as M
from offsim.core.provenance import provenance
from experiments.common import argparser

# Llama-2-13B's TightLLM job blocks (results/offline_jobs/h200): translation decode (64 sequences, ~50 recomputed
# query rows over ~130 keys), summarization decode (48, ~145 over ~545) and its prefill (48, 592 over 592)
SHAPES = ((64, 40, 50, 130), (48, 40, 145, 545), (48, 40, 592, 592), (64, 40, 1, 130))
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def _masks(B: int, T: int, C: int, dev) -> dict:
    """The key masks of one left-padded batch: sequence b padded by b mod 7 positions, causal at the bottom right
    (offexec's own, ``model.visible``), and the alternatives built from it."""
    vis = M.visible(torch.arange(C - T, C, device=dev), torch.arange(C, device=dev),
                    torch.arange(B, device=dev) % 7)  # [B, 1, T, C]
    add = torch.zeros(B, 1, T, C, dtype=torch.float16, device=dev).masked_fill_(~vis, float("-inf"))
    C16 = -(-C // 16) * 16
    aligned = torch.full((B, 1, T, C16), float("-inf"), dtype=torch.float16, device=dev)[..., :C]
    aligned.copy_(add)
    return {"bool": vis, "additive": add, "additive_aligned16": aligned,
            "none": causal_lower_right(T, C) if 1 < T < C else None}


def _call(q, K, V, mask, be):
    T, C = q.shape[2], K.shape[2]
    if be is None:
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=T == C and mask is None)
    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=T == C and mask is None)


def _new_shape_ms(q, K, V, mask_of, be, T: int, C: int, dev) -> float:
    """Host wall time of the first call at a context one longer than the one just run (a decode step's next shape):
    a backend that plans per shape (cuDNN) pays its planning here, on the host."""
    K1, V1 = torch.cat((K, K[:, :, :1]), 2), torch.cat((V, V[:, :, :1]), 2)
    m1 = mask_of(C + 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _call(q, K1, V1, m1, be)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


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
                    return _call(q, K, V, mask, be)
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
                if T < C:  # a decode shape: what the next step's context costs the first time
                    row["new_shape_ms"] = _new_shape_ms(q, K, V, lambda c: _masks(B, T, c, dev)[name], be, T, C, dev)
            except RuntimeError as e:  # the backend refuses this mask or shape
                row["error"] = str(e).splitlines()[0][:160]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def readme(path: str) -> str:
    """README.md beside a measurement's JSON: its provenance and every row as a table (generated, never edited)."""
    d = json.load(open(path))
    pv = d["provenance"]
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else ""  # noqa: E731
    lines = [f"# What a key mask costs SDPA on the {d['gpu']}", "",
             f"`{pv['command']}` at {pv['commit']}, {pv['date']} (torch {d['torch']}); generated by `python -m "
             f"experiments.offexec.mask_sdpa --readme {Path(path).name}` from the rows of that file.", "",
             "Per (shape, mask, backend): the median time of the call, the first call at the next step's context "
             "(decode shapes: what a backend that plans per shape pays once per step), and the bytes it allocated "
             "beyond its output. B sequences, H heads, T queries over C keys (`experiments/offexec/mask_sdpa.py`).",
             "", "| B | H | T | C | mask | backend | ms | first call at the next context, ms | bytes beyond output |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in d["rows"]:
        res = (f"not available: {r['error'][:60]} | | |" if "error" in r else
               f"{f(r, 'ms', '.3f')} | {f(r, 'new_shape_ms', '.3f')} | {f(r, 'extra_bytes', ',')} |")
        lines.append(f"| {r['B']} | {r['H']} | {r['T']} | {r['C']} | {r['mask']} | {r['backend']} | {res}")
    out = Path(path).with_name("README.md")
    out.write_text("\n".join(lines) + "\n")
    return str(out)


def main(argv=None) -> None:
    ap = argparser(__doc__)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--shapes", nargs="*", help="B,H,T,C (default: the job blocks' shapes)")
    ap.add_argument("--readme", metavar="FILE.json", help="write README.md beside a measurement's JSON and stop")
    a = ap.parse_args(argv)
    if a.readme:
        if not Path(a.readme).is_file():
            sys.exit(f"mask_sdpa: --readme {a.readme} is not a file")
        print(readme(a.readme))
        return
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
