"""Where the device's time goes, kernel by kernel: ``offexec run --kernel-profile FILE``.

The trace says how long each op of the plan took; this says what ran inside it. The measured run is recorded with
``torch.profiler`` (on CUDA only the device's activity -- kernels, including those a CUDA graph replays, and copies --
so the issuing thread pays little for it; on the CPU the operators, which is all a CPU run has), and its events are
summed by name: calls, total and mean time, and a coarse category (GEMM, attention, copy, normalisation,
element-wise, other), so that two runs of one plan -- eager and graphed, say -- can be compared category by
category. Profiling slows the run (the profiler's buffers, its flush at the end): its tok/s are not a measurement
of the plan; rerun without it for those.
"""
from __future__ import annotations

import re
from contextlib import contextmanager

import pandas as pd

# first match wins; names as CUDA, cuBLAS/CUTLASS, flash and PyTorch's own kernels spell them (lower-cased)
CATEGORIES = (
    ("memcpy", r"^memcpy|^memset"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("gemm", r"gemm|cutlass|xmma|cublas|matmul|^aten::(mm|addmm|bmm|linear)$|sm\d+_"),
    ("norm", r"layer_?norm|rms_?norm|norm_kernel|^aten::(layer_norm|native_layer_norm)$"),
    ("copy", r"copy|index|cat_|catarray|gather|scatter|transpose|permute|^aten::(copy_|cat|index_copy_|clone)$"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|^aten::"),
)


def category(name: str) -> str:
    n = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, n):
            return cat
    return "other"


@contextmanager
def recording(device_type: str):
    """``torch.profiler`` over the block: the device's activity on CUDA, the CPU operators otherwise."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device_type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        yield prof


def kernel_table(prof, device_type: str) -> pd.DataFrame:
    """One row per kernel (or CPU operator) name: calls, total and mean time, category, share of the total;
    costliest first. Only self time counts on the CPU (an operator's callees are their own rows)."""
    rows: dict[str, list] = {}
    for e in prof.events():
        if device_type == "cuda":
            if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
                continue
            us = getattr(e, "device_time", None)
            if us is None:
                us = e.cuda_time
        else:
            us = e.self_cpu_time_total
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += us
    df = pd.DataFrame([{"name": n, "category": category(n), "calls": c, "total_ms": us / 1e3,
                        "mean_us": us / c if c else 0.0} for n, (c, us) in rows.items()],
                      columns=["name", "category", "calls", "total_ms", "mean_us"])
    total = df["total_ms"].sum()
    df["share"] = df["total_ms"] / total if total > 0 else 0.0
    return df.sort_values("total_ms", ascending=False).reset_index(drop=True)


def write_table(path, prof, device_type: str, header: dict) -> pd.DataFrame:
    """``kernel_table`` of ``prof`` written to ``path`` as a commented CSV (``header`` on its first line); returned."""
    from offsim.core.io import write_commented_csv

    df = kernel_table(prof, device_type)
    write_commented_csv(path, header, df)
    return df


def by_category(df: pd.DataFrame) -> pd.DataFrame:
    """``kernel_table`` summed by category, costliest first."""
    g = df.groupby("category", as_index=False)[["calls", "total_ms", "share"]].sum()
    return g.sort_values("total_ms", ascending=False).reset_index(drop=True)


def summary_lines(df: pd.DataFrame, top: int = 15) -> list[str]:
    """What ``offexec run --kernel-profile`` prints: the categories, then the ``top`` costliest names."""
    lines = [f"{'category':<12} {'calls':>9} {'total ms':>11} {'share':>7}"]
    lines += [f"{r.category:<12} {r.calls:>9,} {r.total_ms:>11,.1f} {r.share:>7.1%}"
              for r in by_category(df).itertuples()]
    lines.append(f"{'calls':>9} {'total ms':>11} {'mean us':>9} {'share':>7}  name")
    lines += [f"{r.calls:>9,} {r.total_ms:>11,.1f} {r.mean_us:>9,.1f} {r.share:>7.1%}  {r.name[:100]}"
              for r in df.head(top).itertuples()]
    return lines
