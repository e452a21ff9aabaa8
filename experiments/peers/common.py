"""What the peer harnesses share: the result record every worker prints, FlexGen's throughput definitions, the GPU
budget, the host-memory limit, the stand-in tokenizer, the link bound.

A worker (``flexgen_ref``, ``accelerate_ref``, ``deepspeed_ref``, ``offexec_run``) measures one workload point and
prints one line ``PEER_RESULT {json}`` per configuration it ran (``emit``); ``experiments.real_throughput`` runs each
worker in a subprocess and appends those records to its journal. Records carry the fields of ``RESULT_FIELDS``.
"""
from __future__ import annotations

import json
import os
import sys
import time

GiB = 1 << 30
PREFIX = "PEER_RESULT "
# host memory a run may use on the 125 GiB H200 machine (the rest: OS, CUDA context, Python, the page cache);
# experiments/memory/h200_sweep.py uses the same figure
HOST_LIMIT_GIB = 110.0
# pinned H2D rate for >= 16 MB copies measured on the H200 machine (docs/anchors.md, shared/docs/ANCHORS.md); a
# worker measures its own at start (``measure_h2d``) and uses this only where it cannot
H2D_DEFAULT_BYTES_PER_S = 55.1e9

# the CSV columns, in order (experiments/real_throughput.py); the first nine are the issue's
RESULT_FIELDS = ("system", "model", "prompt_len", "gen_len", "budget_gib", "batch", "prefill_tok_s", "decode_tok_s",
                 "total_tok_s", "prefill_s", "decode_s", "gpu_batch_size", "num_gpu_batches", "settings",
                 "link_bound_decode_tok_s", "decode_h2d_bytes", "h2d_bytes_per_s", "peak_gpu_bytes",
                 "peak_host_bytes", "projected", "status", "reason", "key", "wall_s", "predicted_decode_tok_s",
                 "predicted_total_tok_s", "versions", "commit", "date", "machine")
STATUSES = ("ok", "oom", "host_oom", "timeout", "error", "unsupported", "skipped")
# the reason of a run whose peer package was absent from the harness's environment: an error of the harness (retried),
# never the peer's answer
MISSING_PEER = "not installed in the harness's environment: "


def harness_status(rec: dict) -> dict:
    """``rec`` as the tables read it: a DeepSpeed record from before 2026-12-05 that called the harness's own missing
    package (``No module named 'deepspeed'``, a broken wheel install) 'unsupported' is an 'error' -- retried, and
    never counted as DeepSpeed's answer -- as ``deepspeed_ref`` records it since."""
    if rec.get("status") == "unsupported" and "No module named 'deepspeed'" in str(rec.get("reason", "")):
        return {**rec, "status": "error", "reason": MISSING_PEER + "deepspeed (" + rec["reason"] + ")"}
    return rec


def flexgen_metrics(num_prompts: int, prompt_len: int, gen_len: int, prefill_s: float, decode_s: float) -> dict:
    """FlexGen's definitions (README): prefill tok/s = prompts·prompt_len / prefill time; decode tok/s =
    prompts·(gen_len−1) / decode time; total tok/s = prompts·gen_len / (prefill + decode)."""
    total_s = prefill_s + decode_s
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_tok_s": num_prompts * prompt_len / prefill_s if prefill_s > 0 else float("nan"),
            "decode_tok_s": num_prompts * (gen_len - 1) / decode_s if decode_s > 0 else float("nan"),
            "total_tok_s": num_prompts * gen_len / total_s if total_s > 0 else float("nan")}


def link_bound(num_prompts: int, gen_len: int, decode_h2d_bytes: float, h2d_bytes_per_s: float) -> float:
    """Decode tok/s if the decode phase did nothing but move ``decode_h2d_bytes`` (all decode steps together) over
    the host-to-device link at ``h2d_bytes_per_s``: the bound of docs/anchors.md §"The physical limit"."""
    if decode_h2d_bytes <= 0:
        return float("inf")
    return num_prompts * (gen_len - 1) / (decode_h2d_bytes / h2d_bytes_per_s)


def kv_bytes_per_token(model) -> int:
    """K and V of one token over all layers (``ModelSpec.kv_bytes_per_token`` is one layer's)."""
    return model.num_layers * model.kv_bytes_per_token()


def emit(rec: dict, stream=None) -> None:
    """Print one result record as ``PEER_RESULT {json}`` (NaN/inf as null), flushed."""
    def clean(v):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return None
        return v
    out = {k: clean(v) for k, v in rec.items()}
    print(PREFIX + json.dumps(out, default=str), file=stream or sys.stdout, flush=True)


def parse_results(text: str) -> list[dict]:
    """The records a worker printed (``emit``), in order."""
    out = []
    for line in text.splitlines():
        if line.startswith(PREFIX):
            try:
                out.append(json.loads(line[len(PREFIX):]))
            except json.JSONDecodeError:
                continue
    return out


def base_record(system: str, model: str, prompt_len: int, gen_len: int, budget_gib: float, probe: bool = False,
                **kw) -> dict:
    """A run's record; ``probe``: with the host's state as the run starts (``probe_host``)."""
    rec = {"system": system, "model": model, "prompt_len": int(prompt_len), "gen_len": int(gen_len),
           "budget_gib": float(budget_gib), "status": "ok", "reason": "", "projected": False}
    rec.update(kw)
    if probe:
        rec.update(probe_host())
    return rec


def probe_host() -> dict:
    """``offexec.hostprobe``'s probe of the host now (a fixed decode CPU-attention op and a host memory copy, ~0.3 s)
    as flat record fields: the lent H200 is a virtual machine whose host runs CPU attention and pageable copies up
    to 2.5x slower on some days (results/validation/calib_misses.md), and the profile the report predicts from
    recorded the same probe, so the report can set the run's host beside the profile's. A failed probe is recorded,
    not raised: it must not cost the run."""
    try:
        from offexec.hostprobe import host_probe

        p = host_probe()
    except Exception as e:  # noqa: BLE001 -- the probe is context, never the result
        return {"host_probe_error": repr(e)[:200]}
    return {"host_probe_cpu_attn_ms": p["cpu_attn_ms"], "host_probe_copy_GB_s": p["host_copy_GB_s"],
            "host_probe_load_1m": p["load_avg_1m"]}


def versions(*mods: str) -> str:
    """'torch 2.11.0, transformers 5.17.0, ...' for the modules given that import."""
    out = []
    for m in mods:
        try:
            mod = __import__(m)
            out.append(f"{m} {getattr(mod, '__version__', '?')}")
        except Exception:  # noqa: BLE001 -- absent or broken: say so
            out.append(f"{m} absent")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------------------------
# GPU budget and link
# ---------------------------------------------------------------------------------------------------------------
def set_gpu_budget(budget_gib: float, device: int = 0) -> dict:
    """Cap this process's CUDA caching allocator at ``budget_gib`` of the GPU (``set_per_process_memory_fraction``,
    as the FlexGen run in docs/anchors.md did): an allocation beyond it raises ``torch.OutOfMemoryError``. The CUDA
    context and cuBLAS workspaces outside the allocator are not counted (the same for every system). Returns the
    fraction and the GPU's total bytes."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    frac = min(1.0, budget_gib * GiB / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    torch.cuda.reset_peak_memory_stats(device)
    return {"fraction": frac, "gpu_total_bytes": total, "budget_bytes": int(budget_gib * GiB)}


def _copy_times(make_src, reps: int, blocking: bool) -> list[float]:
    """Seconds of each of ``reps`` copies of the host tensor ``make_src()`` makes to a GPU tensor of its size (one
    unmeasured copy first), each between two device synchronisations; both tensors given back after (the pinned
    host block too, where PyTorch names the call: made here, so no caller holds it)."""
    import torch

    src = make_src()
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=not blocking)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):  # give the pinned block back (names vary)
        if hasattr(torch._C, name):
            getattr(torch._C, name)()
            break
    return times[1:]


PAGEABLE_PROBE_BYTES = 128 << 20  # measure_h2d_pageable's copy: Accelerate's tensors are 50-600 MB (OPT-30B, Llama)


def measure_h2d_pageable(nbytes: int = PAGEABLE_PROBE_BYTES, reps: int = 5) -> float | None:
    """Host-to-device copy rate from pageable memory (bytes/s, the median of ``reps`` blocking copies of
    ``nbytes``), what Accelerate's hooks move every offloaded tensor at; None without a GPU. A state of the host
    (its memcpy into the driver's staging buffers), not a bound: the median. Recorded beside a run so a report
    can set it against the rate the profile was measured at (the H200 VM's host drifts between days)."""
    import torch

    if not torch.cuda.is_available():
        return None
    # ones, not empty: the pages exist before the clock starts
    times = sorted(_copy_times(lambda: torch.ones(nbytes, dtype=torch.uint8), reps, blocking=True))
    return nbytes / times[len(times) // 2]


def measure_h2d(nbytes: int = 256 << 20, reps: int = 10) -> float:
    """Pinned host-to-device copy rate of ``nbytes`` copies (bytes/s, the fastest of ``reps``), the link bound's
    denominator (copies of >= 16 MB reach the full rate on the H200 machine, docs/anchors.md); the default rate when
    there is no GPU. The fastest, not the median: a bound is what the link can do, and a copy is only ever slowed
    (by the previous run's threads, the page-locking of a new host block); the median of five once came out at
    50.3 GB/s and put a run at 107 % of its bound (results/real_throughput/, offexec-flexgen-anchor, a45e8a9)."""
    import torch

    if not torch.cuda.is_available():
        return H2D_DEFAULT_BYTES_PER_S
    times = _copy_times(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), reps,
                        blocking=False)
    return nbytes / min(times)


def host_mem_bytes() -> dict:
    """MemTotal and MemAvailable of /proc/meminfo (bytes; {} where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set (bytes): pinned host memory counts too."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pow2ceil(n: int) -> int:
    """The next power of two >= n: PyTorch's pinned-memory caching allocator rounds every block up to one."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------------------------------------------------
# A tokenizer that needs no network
# ---------------------------------------------------------------------------------------------------------------
class _Encoding(dict):
    """What a transformers tokenizer call returns, as far as callers here read it (``.input_ids``,
    ``.attention_mask``, or as a dict)."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


class StandInTokenizer:
    """A stand-in for OPT's GPT-2 BPE tokenizer (``AutoTokenizer.from_pretrained("facebook/opt-30b")``), which the
    GPU machine cannot download: one id per whitespace-separated word (a stable hash into the vocabulary above the
    special ids), OPT's specials (pad 1, BOS 2 first, EOS 2), padding to ``max_length`` on ``padding_side``. With
    dummy weights only the prompt's length and padding reach the computation, so a run's timing is that of the real
    tokenizer's; "Paris is the capital city of" is 6 words + BOS = 7 ids, as OPT's tokenizer makes it."""

    pad_token_id = 1
    bos_token_id = 2
    eos_token_id = 2

    def __init__(self, vocab_size: int = 50272, padding_side: str = "left", add_bos: bool = True):
        self.vocab_size = vocab_size
        self.padding_side = padding_side
        self.add_bos = add_bos

    @classmethod
    def from_pretrained(cls, name: str = "", padding_side: str = "left", **kw) -> "StandInTokenizer":
        """Accepts (and ignores) the hub name: nothing is downloaded."""
        return cls(padding_side=padding_side)

    def word_id(self, word: str) -> int:
        import zlib

        return 4 + zlib.crc32(word.encode()) % (self.vocab_size - 4)

    def encode(self, text: str) -> list[int]:
        ids = [self.word_id(w) for w in text.split()]
        return ([self.bos_token_id] if self.add_bos else []) + ids

    def __call__(self, texts, padding=False, max_length=None, truncation=False, return_tensors=None, **kw):
        single = isinstance(texts, str)
        rows = [self.encode(t) for t in ([texts] if single else texts)]
        if padding in ("max_length", True, "longest"):
            n = max_length if padding == "max_length" and max_length else max(len(r) for r in rows)
            padded, masks = [], []
            for r in rows:
                r = r[-n:] if len(r) > n else r
                pad = [self.pad_token_id] * (n - len(r))
                m0, m1 = [0] * len(pad), [1] * len(r)
                padded.append(pad + r if self.padding_side == "left" else r + pad)
                masks.append(m0 + m1 if self.padding_side == "left" else m1 + m0)
        else:
            padded, masks = rows, [[1] * len(r) for r in rows]
        if return_tensors == "pt":
            import torch

            padded, masks = torch.tensor(padded), torch.tensor(masks)
        elif single:
            padded, masks = padded[0], masks[0]
        return _Encoding(input_ids=padded, attention_mask=masks)

    def batch_decode(self, ids, skip_special_tokens: bool = True, **kw) -> list[str]:
        return [" ".join(f"<{int(t)}>" for t in row if not (skip_special_tokens and int(t) in (1, 2))) for row in ids]

    def decode(self, ids, **kw) -> str:
        return self.batch_decode([ids], **kw)[0]


def env_offline() -> None:
    """Make the hub libraries refuse the network at once instead of timing out (the GPU machine has none)."""
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(k, "1")


def point_parser(doc: str):
    """The command line every harness shares: one point of the grid (model, prompt and generation lengths, GPU
    budget); each harness adds its own options."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--model", default="opt-30b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--budget-gib", type=float, default=16.0)
    return ap


def record_failure(rec: dict, e: BaseException) -> None:
    """A run's exception as its record's result: 'oom' for a CUDA out-of-memory, else 'error' (with the traceback
    on stderr): a failure is a result, and the grid goes on."""
    import traceback

    import torch

    if isinstance(e, torch.OutOfMemoryError):
        rec.update(status="oom", reason=str(e).split("\n")[0][:300])
    else:
        traceback.print_exc()
        rec.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_counts() -> dict:
    """The CUDA caching allocator's cumulative counters (``torch.cuda.memory_stats``): retries after a failed
    allocation, out-of-memory errors, device-wide synchronisations, and its cudaMalloc / cudaFree calls."""
    import torch

    ms = torch.cuda.memory_stats()
    return {k: int(ms.get(k, 0)) for k in ALLOCATOR_COUNTS}


def finish_record(rec: dict, t0: float, cuda: bool = True) -> dict:
    """The run's peaks and wall time, added to ``rec`` (returned)."""
    import torch

    rec["peak_gpu_bytes"] = int(torch.cuda.max_memory_reserved()) if cuda else 0
    if cuda:  # a run near its budget makes the caching allocator free and retry (each a device-wide sync): a peer
        # that slows at a larger budget's larger batch (DeepSpeed, Llama-2-13B 24 GiB) says here whether that is why
        rec.update({f"allocator_{k}": v for k, v in allocator_counts().items()})
    rec["peak_host_bytes"] = peak_rss_bytes()
    rec["wall_s"] = time.perf_counter() - t0
    return rec

