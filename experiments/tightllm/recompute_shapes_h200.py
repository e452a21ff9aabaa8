"""Why offsim over-predicts TightLLM's recompute on the H200 (results/tightllm/README.md §7): time one decoder
layer at the shapes the plans run -- decode (T = 1), TightLLM recompute (1 < T < C) and prefill (T = C) -- split
into its GEMM part and its attention part, with the K/V layout offexec uses (a token-major cache buffer viewed as
[B, n, C, D]) and with contiguous K/V, beside offsim's price of the same work from the measured profile.

    python -m experiments.tightllm.recompute_shapes_h200 --profile results/profiles/h200.json --out DIR   # on the GPU

Writes DIR/recompute_shapes.csv (one row per model and shape) and prints it.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from experiments.common import provenance, write_csv
from offsim.core import costmodel as cm
from offsim.core.specs import get_hardware, get_model

# (model, batch B, [(T, C)]): the decode, recompute and prefill shapes of the three H200 TightLLM scenarios
SHAPES = [
    ("opt-6.7b", 4, [(1, 2050), (834, 2050), (2048, 2048)]),
    ("opt-13b", 2, [(1, 2050), (664, 2050), (2048, 2048)]),
    ("opt-30b", 4, [(1, 514), (512, 514), (512, 512)]),
]


def main() -> None:
    import pandas as pd
    import torch

    from offexec import model as M

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="results/profiles/h200.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: opt-125m, small shapes")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                    help="also run each recompute shape's layer back to back for SECONDS and record its time per "
                         "chunk of 50 (does the rate hold under sustained load?) -> sustain.csv")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.quick else "cuda")
    shapes_of = [("opt-125m", 1, [(1, 34), (8, 34), (32, 32)])] if a.quick else SHAPES
    rows = []

    sustain: list[dict] = []

    def timed_n(fn, n: int) -> float:
        """Mean seconds of ``fn()`` over ``n`` back-to-back calls (CUDA events on the GPU)."""
        if dev.type == "cpu":
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3 / n

    def timed(fn) -> float:
        for _ in range(3):  # warm-up: cuBLAS heuristics, allocator
            fn()
        return timed_n(fn, a.reps)

    for name, B, shapes in shapes_of:
        spec = dataclasses.replace(get_model(name), max_positions=4096)  # random weights: extend OPT's positions
        hw = get_hardware(a.profile)
        layout = M.layer_layout(spec)
        flat = (torch.randn(layout[-1].hi, device=dev, dtype=torch.float16) * 0.02)
        w = M.layer_views(layout, [(0, flat)])
        n, D, H = spec.num_kv_heads, spec.head_dim, spec.num_heads
        for T, C in shapes:
            x = torch.randn(B, T, spec.d_model, device=dev, dtype=torch.float16)
            buf = torch.randn(C, 2, B, n, D, device=dev, dtype=torch.float16)  # offexec's cache layout
            Kc = buf[:, 0].permute(1, 2, 0, 3).contiguous()
            Vc = buf[:, 1].permute(1, 2, 0, 3).contiguous()
            q = torch.randn(B, T, H, D, device=dev, dtype=torch.float16)
            o = torch.randn(B, T, H * D, device=dev, dtype=torch.float16)

            def layer():
                qq, k, v = M.pre_attn(spec, w, x, C - T)
                buf[C - T:C, 0] = k.transpose(0, 1)
                buf[C - T:C, 1] = v.transpose(0, 1)
                oo = M.attention(spec, qq, [(0, n, buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3))])
                return M.post_attn(spec, w, x, oo)

            def gemms():
                M.pre_attn(spec, w, x, C - T)
                return M.post_attn(spec, w, x, o)

            def attn_strided():
                return M.attention(spec, q, [(0, n, buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3))])

            def attn_contig():
                return M.attention(spec, q, [(0, n, Kc, Vc)])

            tok = B * T
            pred_layer = cm.compute_seconds(spec, hw, "layer", B, T, C)
            pred_attn = cm.attention_seconds(spec, hw, B, T, C)
            rows.append({"model": name, "B": B, "T": T, "C": C,
                         "kind": "decode" if T == 1 else ("prefill" if T == C else "recompute"),
                         "measured_layer_s": timed(layer), "measured_gemms_s": timed(gemms),
                         "measured_attn_s": timed(attn_strided), "measured_attn_contiguous_s": timed(attn_contig),
                         "predicted_layer_s": pred_layer, "predicted_attn_s": pred_attn,
                         "predicted_rest_s": pred_layer - pred_attn, "tokens": tok})
            print(rows[-1], flush=True)
            if a.sustain and rows[-1]["kind"] == "recompute" and dev.type == "cuda":
                t_end, k = time.perf_counter() + a.sustain, 0
                while time.perf_counter() < t_end:
                    sustain.append({"model": name, "B": B, "T": T, "C": C, "chunk": k,
                                    "elapsed_s": a.sustain - (t_end - time.perf_counter()),
                                    "layer_s": timed_n(layer, 50)})
                    k += 1
                print(f"  sustained {a.sustain:.0f} s: first chunk {sustain[-k]['layer_s'] * 1e3:.3f} ms, last "
                      f"{sustain[-1]['layer_s'] * 1e3:.3f} ms", flush=True)
        del flat, w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    df["layer_err"] = df["predicted_layer_s"] / df["measured_layer_s"] - 1
    df["attn_err"] = df["predicted_attn_s"] / df["measured_attn_s"] - 1
    df["rest_err"] = df["predicted_rest_s"] / df["measured_gemms_s"] - 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(df, out / "recompute_shapes.csv", provenance(gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", profile=a.profile,
                                                            **({"commit": a.commit} if a.commit else {})))
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if sustain:
        write_csv(pd.DataFrame(sustain), out / "sustain.csv", provenance(gpu=torch.cuda.get_device_name(),
                                                                      **({"commit": a.commit} if a.commit else {})))


if __name__ == "__main__":
    main()
