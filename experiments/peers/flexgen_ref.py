"""FlexGen's own code (the public ``flexgen==0.1.8`` package) on this machine's GPU, as system ``flexgen-ref`` (fp16)
or ``flexgen-4bit-ref`` (``--compress-weight --compress-cache``).

One process runs one FlexGen policy: FlexGen's own CLI arguments (``flexgen.flex_opt.add_parser_arguments``) and
its own ``run_flexgen`` with dummy weights (``--path _DUMMY_``: every weight is ``np.ones``, nothing is read or
downloaded), offline, under a GPU budget (``torch.cuda.set_per_process_memory_fraction``); the throughputs are
recomputed from FlexGen's own timer (``timers("generate").costs``: prefill = the first step, decode = the rest,
exactly as ``run_flexgen`` logs them). ``experiments.real_throughput`` runs one process per policy, so an OOM (GPU or
host) of one policy leaves the others' results.

Runtime patches, none to the package's files (the package is used as installed):
  1. ``flexgen.flex_opt.AutoTokenizer`` -> ``StandInTokenizer`` (``common.py``): ``run_flexgen`` calls
     ``AutoTokenizer.from_pretrained("facebook/opt-30b")``, the only network access on the ``_DUMMY_`` path
     (``OptLM.init_weight`` downloads only when the path lacks ``_DUMMY_``; ``get_opt_config`` is a local table).
  2. ``flexgen.flex_opt.get_opt_config`` -> the same with ``max_seq_len`` raised to prompt + gen when that exceeds
     OPT's 2048 positions (prompt 1984 + gen 128): FlexGen's position table is ``max_seq_len + 2`` rows and its
     positions run to prompt + gen, so the run would die on a device-side index assert. Dummy weights: the extra
     rows cost 2 x 64 x d_model bytes and nothing else; the record says ``extended_positions``.
  3. The TypedStorage deprecation warning of ``flexgen.utils.cpu_mem_stats`` (``tensor.storage()``, still present
     in torch 2.11) is silenced; nothing else in FlexGen 0.1.8 uses an API that torch 2.11 or transformers 5 removed
     (transformers is used for the tokenizer only).

Which policies: ``candidates`` takes offsim's FlexGen LP candidates for the H200 profile at the budget (FlexGen's own
policy search, ranked by the LP), normalised to FlexGen's integer percentages with no disk share, then the anchor
policy of docs/anchors.md §2 and a coarse grid (``policy_space``); every one is kept only if FlexGen's host memory
(``host_bytes``: its pinned weights rounded up to powers of two by PyTorch's pinned allocator, the unpinned KV, its
copy threads' 4 x 2 GiB pinned relays, the CPU-attention fp32 workspace) fits ``HOST_LIMIT_GIB`` and its GPU need
(``gpu_bytes``, an estimate) fits the budget.

    python -m experiments.peers.flexgen_ref --model opt-30b --prompt-len 512 --gen-len 32 --budget-gib 16 \\
        --gpu-batch-size 16 --num-gpu-batches 3 --percent 20 80 0 100 100 0 [--cpu-cache-compute]
    python -m experiments.peers.flexgen_ref --model opt-30b ... --list-candidates [--compress]   # no GPU needed

Prints ``PEER_RESULT {json}`` per run (``common.emit``) and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import warnings

from experiments.peers.common import (GiB, StandInTokenizer, base_record, emit, env_offline, finish_record,
                                      flexgen_metrics, link_bound, measure_h2d, point_parser,
                                      pow2ceil, record_failure, set_gpu_budget, versions)

SYSTEM = "flexgen-ref"
SYSTEM_4BIT = "flexgen-4bit-ref"
OPT_MODELS = ("opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "opt-175b")
COPY_THREAD_PINNED_BYTES = 4 * 2 * GiB  # TorchDisk's 4 copy threads, each a 1 G-element fp16 pinned relay
HOST_BASE_BYTES = 4 * GiB  # Python, torch, CUDA's host side, numpy temporaries of the weight init
QUANT_BYTES_PER_ELEM = 0.5 + 4 / 64  # 4-bit data + an fp16 min and scale per group of 64
# host memory FlexGen's runs may take on the 125 GiB machine, by ``host_bytes``: the anchor run (OPT-30B, 16 x 3,
# 512/32) is 113.9 GiB by it and ran; the same with 24 x 3 is 131 GiB and was killed by the kernel (docs/anchors.md)
FLEXGEN_HOST_LIMIT_GIB = 118.0
ANCHOR = dict(gpu_batch_size=16, num_gpu_batches=3, percent=(20, 80, 0, 100, 100, 0))  # docs/anchors.md §2


@dataclasses.dataclass(frozen=True)
class FlexGenPolicy:
    """One point of FlexGen's policy space (its ``Policy`` as CLI arguments)."""

    gpu_batch_size: int
    num_gpu_batches: int
    percent: tuple[int, int, int, int, int, int]  # W_GPU W_CPU C_GPU C_CPU A_GPU A_CPU, FlexGen's order
    cpu_cache_compute: bool = False
    compress_weight: bool = False
    compress_cache: bool = False
    source: str = ""  # where it came from: 'lp', 'anchor', 'grid', 'cli'

    @property
    def num_prompts(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def system(self) -> str:
        return SYSTEM_4BIT if (self.compress_weight or self.compress_cache) else SYSTEM

    def tag(self) -> str:
        p = "-".join(str(x) for x in self.percent)
        return (f"gbs{self.gpu_batch_size}x{self.num_gpu_batches}_p{p}{'_cpuattn' if self.cpu_cache_compute else ''}"
                f"{'_cw' if self.compress_weight else ''}{'_cc' if self.compress_cache else ''}")

    def settings(self) -> dict:
        return {"percent": list(self.percent), "gpu_batch_size": self.gpu_batch_size,
                "num_gpu_batches": self.num_gpu_batches, "cpu_cache_compute": self.cpu_cache_compute,
                "compress_weight": self.compress_weight, "compress_cache": self.compress_cache, "source": self.source}

    def cli_args(self) -> list[str]:
        """This policy as ``flexgen.flex_opt``'s command-line options."""
        a = ["--gpu-batch-size", str(self.gpu_batch_size), "--num-gpu-batches", str(self.num_gpu_batches),
             "--percent", *[str(int(x)) for x in self.percent]]
        if self.cpu_cache_compute:
            a.append("--cpu-cache-compute")
        if self.compress_weight:
            a.append("--compress-weight")
        if self.compress_cache:
            a.append("--compress-cache")
        return a

    def validate(self) -> None:
        p = self.percent
        if len(p) != 6 or any(x < 0 or x > 100 for x in p):
            raise ValueError(f"percent needs six numbers in [0, 100], got {p}")
        for name, a, b in (("weights", p[0], p[1]), ("cache", p[2], p[3]), ("activations", p[4], p[5])):
            if a + b > 100:
                raise ValueError(f"{name}: GPU {a} + CPU {b} > 100")
        if p[4] not in (0, 100) or (p[4] == 0 and p[5] != 100):
            raise ValueError("FlexGen puts all activations on one tier: A_GPU A_CPU = 100 0 or 0 100")
        if self.cpu_cache_compute and (self.compress_cache or self.compress_weight):
            raise ValueError("FlexGen's CPU attention works on an fp16 cache only (it turns it off with compression)")


# ---------------------------------------------------------------------------------------------------------------
# FlexGen's memory, as its code allocates it
# ---------------------------------------------------------------------------------------------------------------
def _layer_specs(model) -> list[list[tuple[tuple[int, ...], str]]]:
    """FlexGen's weight lists, one per FlexGen layer (InputEmbed, SelfAttention and MLP per decoder layer,
    OutputEmbed), each tensor (shape, name), in FlexGen's order (``init_weight`` of each class)."""
    h, v, s, f = model.d_model, model.vocab_size, max(model.max_positions, 2048), model.ffn_dim
    specs = [[((v, h), "embed_tokens"), ((s + 2, h), "embed_positions")]]
    attn = [((h, h), "q"), ((h,), "bq"), ((h, h), "k"), ((h,), "bk"), ((h, h), "v"), ((h,), "bv"), ((h, h), "out"),
            ((h,), "bout"), ((h,), "ln_w"), ((h,), "ln_b")]
    mlp = [((f, h), "fc1"), ((f,), "bfc1"), ((h, f), "fc2"), ((h,), "bfc2"), ((h,), "ln_w"), ((h,), "ln_b")]
    for _ in range(model.num_layers):
        specs += [attn, mlp]
    specs.append([((h,), "ln_w"), ((h,), "ln_b"), ((v, h), "lm_head")])  # OutputEmbed: its own copy of the tokens
    return specs


def weight_homes(model, percent) -> list[tuple[str, tuple[int, ...]]]:
    """(tier, shape) of every weight tensor as FlexGen places it (``init_weight_list``): within each FlexGen layer,
    tensor i goes to the tier whose cumulative percentage range (disk, then CPU, then GPU) holds the midpoint of its
    cumulative size -- the rule offsim's flexgen-ref applies (``offsim.policies.ref.flexgen_tensor_tiers``, one
    place), over this harness's layer list (the shapes FlexGen allocates)."""
    from offsim.policies.ref import flexgen_tensor_tiers

    out = []
    for layer in _layer_specs(model):
        shapes = [s for s, _ in layer]
        out += list(zip(flexgen_tensor_tiers([_numel(s) for s in shapes], percent[0], percent[1]), shapes))
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _weight_bytes(shape, compress: bool) -> int:
    n = _numel(shape)
    if compress and len(shape) >= 2:
        return int(n * QUANT_BYTES_PER_ELEM)
    return 2 * n


def cache_bytes(model, pol: FlexGenPolicy, prompt_len: int, gen_len: int) -> int:
    """FlexGen's KV cache of the whole block: (prompt + gen − 1) positions × batch × K and V × layers, fp16 (4-bit
    group-wise with ``--compress-cache``)."""
    n = 2 * pol.num_prompts * (prompt_len + gen_len - 1) * model.num_layers * model.num_kv_heads * model.head_dim
    return int(n * (QUANT_BYTES_PER_ELEM if pol.compress_cache else 2))


def host_bytes(model, pol: FlexGenPolicy, prompt_len: int, gen_len: int) -> dict:
    """Host memory FlexGen's code takes for this policy, by part (bytes)."""
    pinned = 0
    for tier, shape in weight_homes(model, pol.percent):
        if tier == "cpu":  # --pin-weight defaults to True (1-D weights are pinned always)
            pinned += pow2ceil(_weight_bytes(shape, pol.compress_weight))
    kv = cache_bytes(model, pol, prompt_len, gen_len)
    kv_cpu = kv * pol.percent[3] // 100  # unpinned (FlexGen: 'disable pin_memory due to high memory overhead')
    relay = 0
    if not pol.cpu_cache_compute and pol.percent[3]:  # GPU attention on a CPU cache: src.pin_memory() relays
        per = 2 * pol.gpu_batch_size * (prompt_len + gen_len - 1) * model.num_kv_heads * model.head_dim
        relay = 2 * 2 * pow2ceil(int(per * (QUANT_BYTES_PER_ELEM if pol.compress_cache else 2)) // 2)
    ws = 0
    if pol.cpu_cache_compute:  # fp32 K and V workspace of one GPU batch (init_attention_compute_workspace)
        ws = 2 * (prompt_len + gen_len - 1) * pol.gpu_batch_size * model.num_heads * model.head_dim * 4
    act = 0
    if pol.percent[5] == 100:  # activations on the CPU: a block's hidden states
        act = pol.num_prompts * prompt_len * model.d_model * 2 * 2
    parts = {"weights_pinned": pinned, "kv": kv_cpu, "kv_pinned_relays": relay, "cpu_attention_workspace": ws,
             "activations": act, "copy_threads": COPY_THREAD_PINNED_BYTES, "base": HOST_BASE_BYTES}
    parts["total"] = sum(parts.values())
    return parts


def gpu_bytes(model, pol: FlexGenPolicy, prompt_len: int, gen_len: int) -> dict:
    """An estimate of FlexGen's peak GPU memory for this policy (bytes): its GPU-homed weights and KV share, two
    FlexGen layers of streamed weights in flight, a GPU batch's KV read buffers (GPU attention on a CPU cache), and
    the prefill's working set (it materialises the attention matrix: batch × heads × prompt² fp16, several
    copies)."""
    g = model.num_layers
    w_gpu = sum(_weight_bytes(s, pol.compress_weight) for t, s in weight_homes(model, pol.percent) if t == "gpu")
    h, f = model.d_model, model.ffn_dim
    # streamed weights: the current and the next FlexGen layer (the MLP is the larger), fp16 after decompression
    stream = 2 * 2 * 2 * h * f * (100 - pol.percent[0]) // 100 + (2 * 2 * h * f if pol.compress_weight else 0)
    stream += 2 * model.vocab_size * h * (100 - pol.percent[0]) // 100  # the output embedding when it streams
    kv = cache_bytes(model, pol, prompt_len, gen_len)
    kv_gpu = kv * pol.percent[2] // 100
    s = prompt_len + gen_len - 1
    b = pol.gpu_batch_size
    kv_buf = 0
    if not pol.cpu_cache_compute and pol.percent[2] < 100:  # K and V of a GPU batch and layer, loaded, x2 in flight
        kv_buf = 2 * 2 * b * s * model.num_kv_heads * model.head_dim * 2
    heads = model.num_heads
    prefill = (3 * b * heads * prompt_len * prompt_len * 2  # scores, masked, softmax
               + b * prompt_len * (6 * h + f) * 2)  # hidden, q, k, v, out, residual, fc1
    act = pol.num_prompts * prompt_len * h * 2 if pol.percent[4] == 100 else 0
    parts = {"weights": w_gpu, "streamed_weights": stream, "kv": kv_gpu, "kv_buffers": kv_buf, "prefill": prefill,
             "activations": act, "slack": GiB // 2}
    parts["total"] = int(sum(parts.values()) * 1.05)
    del g
    return parts


def decode_h2d_bytes(model, pol: FlexGenPolicy, prompt_len: int, gen_len: int) -> int:
    """Bytes the decode phase must move host -> GPU at least: the CPU-homed weights once per step (FlexGen loads a
    layer's weights once for all GPU batches), and with GPU attention the CPU-homed KV of every step's context."""
    w_cpu = sum(_weight_bytes(s, pol.compress_weight) for t, s in weight_homes(model, pol.percent) if t != "gpu")
    total = w_cpu * (gen_len - 1)
    if not pol.cpu_cache_compute:
        per_tok = 2 * model.num_layers * model.num_kv_heads * model.head_dim
        per_tok = per_tok * (QUANT_BYTES_PER_ELEM if pol.compress_cache else 2)
        c_cpu = (100 - pol.percent[2]) / 100
        ctx = sum(prompt_len + i for i in range(1, gen_len))
        total += int(per_tok * c_cpu * pol.num_prompts * ctx)
    return int(total)


def fits(model, pol: FlexGenPolicy, prompt_len: int, gen_len: int, budget_gib: float,
         host_limit_gib: float = FLEXGEN_HOST_LIMIT_GIB) -> tuple[bool, str]:
    """Whether FlexGen's code can run this policy here: (fits, why not)."""
    try:
        pol.validate()
    except ValueError as e:
        return False, str(e)
    hb = host_bytes(model, pol, prompt_len, gen_len)["total"]
    if hb > host_limit_gib * GiB:
        return False, f"host: FlexGen needs ~{hb / GiB:.1f} GiB, limit {host_limit_gib:.0f} GiB"
    gb = gpu_bytes(model, pol, prompt_len, gen_len)["total"]
    if gb > budget_gib * GiB:
        return False, f"GPU: ~{gb / GiB:.1f} GiB estimated, budget {budget_gib:g} GiB"
    return True, ""


# ---------------------------------------------------------------------------------------------------------------
# Which policies to run
# ---------------------------------------------------------------------------------------------------------------
GRID_GBS = (4, 8, 16, 24, 32, 48, 64, 96, 128)
GRID_NGB = (1, 2, 3, 4, 6, 8, 12, 16)
GRID_W_GPU = tuple(range(0, 101, 5))
GRID_C_GPU = (0, 50, 100)


def policy_space(model, prompt_len: int, gen_len: int, budget_gib: float, host_limit_gib: float = FLEXGEN_HOST_LIMIT_GIB,
                 compress: bool = False, max_prompts: int = 1024) -> list[FlexGenPolicy]:
    """FlexGen's policy space on a coarse grid -- GPU batch size × number of GPU batches × weights' GPU share (5 %
    steps, the rest on the CPU) × cache's GPU share (0, 50, 100 %) × CPU attention (cache fully on the CPU only) --
    keeping for each (block shape, cache share, attention) only the largest weight share that fits, and only
    points that fit host and GPU (``fits``). Activations on the GPU. No disk: the host holds every model here."""
    out = []
    for gbs in GRID_GBS:
        for ngb in GRID_NGB:
            if gbs * ngb > max_prompts:
                continue
            for c_gpu in GRID_C_GPU:
                for cpu_attn in ((False, True) if c_gpu == 0 and not compress else (False,)):
                    best = None
                    for w in GRID_W_GPU:
                        pol = FlexGenPolicy(gbs, ngb, (w, 100 - w, c_gpu, 100 - c_gpu, 100, 0), cpu_attn,
                                            compress, compress, "grid")
                        if fits(model, pol, prompt_len, gen_len, budget_gib, host_limit_gib)[0]:
                            best = pol
                        else:
                            # a larger weight share fits no better on the GPU; host need falls with it, so go on
                            if gpu_bytes(model, pol, prompt_len, gen_len)["total"] > budget_gib * GiB:
                                break
                    if best is not None:
                        out.append(best)
    return out


def _normalise(percent) -> tuple[int, ...]:
    """Offsim's six integers as FlexGen runs them here: no disk share (what would go to disk goes to the CPU)."""
    p = [int(round(x)) for x in percent]
    p[1] = 100 - p[0]
    p[3] = 100 - p[2]
    if p[4] + p[5] != 100 or p[4] not in (0, 100):
        p[4], p[5] = (100, 0) if p[4] >= p[5] else (0, 100)
    return tuple(p)


def lp_candidates(model, prompt_len: int, gen_len: int, budget_gib: float, compress: bool = False,
                  host_limit_gib: float = FLEXGEN_HOST_LIMIT_GIB, limit: int = 24,
                  hardware: str | None = None) -> list[FlexGenPolicy]:
    """Offsim's FlexGen LP candidates (FlexGen's policy search: the best placement per block shape, with and
    without CPU attention, LP-ranked) for the H200 profile at this budget and host limit, as FlexGen policies
    (``_normalise``); in LP order, duplicates dropped. [] when offsim's LP cannot run (no cvxpy)."""
    from offsim.core.specs import Compression
    from offsim.policies import get_policy

    # the LP's host tier: the limit less what FlexGen's code adds beyond weights and KV (copy threads, base, the
    # pinned allocator's power-of-two rounding of ~90 % of the weights)
    lp_host = host_limit_gib - (COPY_THREAD_PINNED_BYTES + HOST_BASE_BYTES) / GiB - 0.3 * model.weight_bytes() / GiB
    hw = _hardware(hardware, budget_gib, max(lp_host, 1.0))
    comp = Compression(True, True) if compress else Compression()
    out, seen = [], set()
    try:
        it = get_policy("flexgen").candidates(model, hw, prompt_len, gen_len, None, compression=comp)
        for c in it:
            st, wl = c.settings, c[1]
            pol = FlexGenPolicy(wl.gpu_batch_size, wl.num_gpu_batches, _normalise(st["percent"]),
                                bool(st.get("cpu_attention")), compress, compress, "lp")
            if pol.tag() in seen:
                continue
            seen.add(pol.tag())
            out.append(pol)
            if len(out) >= limit:
                break
    except Exception as e:  # noqa: BLE001 -- offsim's LP needs cvxpy + HiGHS; the grid still works without
        print(f"flexgen_ref: offsim's LP gave no candidates ({type(e).__name__}: {e})", file=sys.stderr)
    return out


def _hardware(hardware: str | None, budget_gib: float, host_limit_gib: float):
    from pathlib import Path

    from offsim import get_hardware

    root = Path(__file__).resolve().parents[2]
    prof = hardware or str(root / "results/profiles/h200_offexec_v2.json")
    if not Path(prof).exists():
        prof = "h200"
    return get_hardware(prof, budget_gib).with_(cpu_mem_bytes=int(host_limit_gib * GiB))


def candidates(model, prompt_len: int, gen_len: int, budget_gib: float, k: int = 4, compress: bool = False,
               host_limit_gib: float = FLEXGEN_HOST_LIMIT_GIB, hardware: str | None = None) -> list[FlexGenPolicy]:
    """At most ``k`` FlexGen policies to run for this point, most promising first: offsim's LP candidates that fit
    FlexGen's own memory (the best with and without CPU attention first), then the anchor policy (docs/anchors.md
    §2) with and without CPU attention, then (fp16) the grid's largest block of an attention placement still missing,
    then the rest of the LP's, then the grid
    (``policy_space``) by block size. [] for a model FlexGen does not implement (only OPT)."""
    if model.family != "opt":
        return []
    out, seen = [], set()

    def add(p):
        if p is not None and p.tag() not in seen and fits(model, p, prompt_len, gen_len, budget_gib, host_limit_gib)[0]:
            seen.add(p.tag())
            out.append(p)

    lp = [p for p in lp_candidates(model, prompt_len, gen_len, budget_gib, compress, host_limit_gib,
                                   hardware=hardware) if p.percent[4] == 100]  # activations on the GPU, as FlexGen's
    for attn in (True, False):  # the LP's best with and without CPU attention first (the H200 run: GPU attention won)
        for p in lp:
            if p.cpu_cache_compute == attn and fits(model, p, prompt_len, gen_len, budget_gib, host_limit_gib)[0]:
                add(p)
                break
    if not compress:
        for attn in (False, True):
            add(FlexGenPolicy(ANCHOR["gpu_batch_size"], ANCHOR["num_gpu_batches"], ANCHOR["percent"], attn,
                              source="anchor"))
    grid = policy_space(model, prompt_len, gen_len, budget_gib, host_limit_gib, compress)
    grid.sort(key=lambda p: (-p.num_prompts, -p.gpu_batch_size, -p.percent[0], p.cpu_cache_compute))
    if not compress:  # both attention placements among the first: the grid's largest block where the LP has none
        for attn in (False, True):
            if not any(p.cpu_cache_compute == attn for p in out):
                add(next((p for p in grid if p.cpu_cache_compute == attn), None))
    for p in lp:
        add(p)
    for p in grid:
        add(p)
    return out[:k]


# ---------------------------------------------------------------------------------------------------------------
# Running FlexGen's code
# ---------------------------------------------------------------------------------------------------------------
def patch_flexgen(flex_opt, max_seq_len: int | None) -> list[str]:
    """The runtime patches of this module's docstring; returns what was patched."""
    done = []
    flex_opt.AutoTokenizer = StandInTokenizer  # 1. no hub: run_flexgen's only network call
    done.append("AutoTokenizer->StandInTokenizer")
    if max_seq_len and max_seq_len > 2048:
        orig = flex_opt.get_opt_config

        def get_opt_config(name, **kw):  # 2. a longer position table (dummy weights)
            kw.setdefault("max_seq_len", max_seq_len)
            return orig(name, **kw)

        flex_opt.get_opt_config = get_opt_config
        done.append(f"max_seq_len->{max_seq_len}")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # 3. cosmetic
    return done


def flexgen_argv(model_name: str, pol: FlexGenPolicy, prompt_len: int, gen_len: int, offload_dir: str,
                 log_file: str, cut_gen_len: int | None = None) -> list[str]:
    """FlexGen's command line for one run: dummy weights, no debug mode (a full run, not a projection)."""
    a = ["--model", f"facebook/{model_name}", "--path", "_DUMMY_", "--offload-dir", offload_dir,
         "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--log-file", log_file, "--verbose", "1",
         *pol.cli_args()]
    if cut_gen_len:
        a += ["--cut-gen-len", str(cut_gen_len)]
    return a


def run_policy(model_name: str, pol: FlexGenPolicy, prompt_len: int, gen_len: int, budget_gib: float,
               offload_dir: str | None = None, cut_gen_len: int | None = None) -> dict:
    """Run FlexGen's ``run_flexgen`` for one policy in this process; the result record (``common.base_record``)."""
    from offsim import get_model

    model = get_model(model_name)
    rec = base_record(pol.system, model_name, prompt_len, gen_len, budget_gib, probe=True, batch=pol.num_prompts,
                      gpu_batch_size=pol.gpu_batch_size, num_gpu_batches=pol.num_gpu_batches,
                      settings=json.dumps(pol.settings(), sort_keys=True))
    t0 = time.perf_counter()
    env_offline()
    budget = set_gpu_budget(budget_gib)
    h2d = measure_h2d()
    dec_bytes = decode_h2d_bytes(model, pol, prompt_len, gen_len)
    rec.update(h2d_bytes_per_s=h2d, decode_h2d_bytes=dec_bytes,
               link_bound_decode_tok_s=link_bound(pol.num_prompts, gen_len, dec_bytes, h2d),
               versions=versions("torch", "transformers", "numpy", "flexgen"))
    import flexgen.flex_opt as flex_opt
    from flexgen.timer import timers

    max_seq = prompt_len + gen_len if prompt_len + gen_len > 2048 else None
    patches = patch_flexgen(flex_opt, max_seq)
    st = pol.settings()
    st.update(patches=patches, extended_positions=bool(max_seq), gpu_fraction=budget["fraction"],
              est_host_gib=host_bytes(model, pol, prompt_len, gen_len)["total"] / GiB,
              est_gpu_gib=gpu_bytes(model, pol, prompt_len, gen_len)["total"] / GiB)
    rec["settings"] = json.dumps(st, sort_keys=True)
    tmp = tempfile.mkdtemp(prefix="flexgen_ref_")
    parser = argparse.ArgumentParser()
    flex_opt.add_parser_arguments(parser)
    args = parser.parse_args(flexgen_argv(model_name, pol, prompt_len, gen_len, offload_dir or
                                          os.path.join(tmp, "offload"), os.path.join(tmp, "flexgen.log"),
                                          cut_gen_len))
    try:
        flex_opt.run_flexgen(args)
        costs = list(timers("generate").costs)
        prefill_s = costs[0]
        if cut_gen_len:  # FlexGen's own projection (only when asked: then the record says projected)
            from flexgen.utils import project_decode_latency

            decode_s = project_decode_latency(costs, prompt_len, gen_len)
        else:
            decode_s = sum(costs[1:])
        rec.update(flexgen_metrics(pol.num_prompts, prompt_len, gen_len, prefill_s, decode_s))
        rec["projected"] = bool(cut_gen_len)
        try:
            with open(os.path.join(tmp, "flexgen.log")) as f:
                rec["flexgen_log"] = f.read().strip().replace("\n", " | ")
        except OSError:
            pass
    except Exception as e:  # noqa: BLE001 -- one policy's failure is a result, not a crash
        record_failure(rec, e)
    return finish_record(rec, t0)


def main(argv=None) -> int:
    ap = point_parser(__doc__)
    ap.add_argument("--gpu-batch-size", type=int)
    ap.add_argument("--num-gpu-batches", type=int, default=1)
    ap.add_argument("--percent", type=int, nargs=6)
    ap.add_argument("--cpu-cache-compute", action="store_true")
    ap.add_argument("--compress", action="store_true", help="FlexGen's 4-bit mode: --compress-weight --compress-cache "
                    "(system flexgen-4bit-ref)")
    ap.add_argument("--compress-weight", action="store_true")
    ap.add_argument("--compress-cache", action="store_true")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--cut-gen-len", type=int, default=None, help="FlexGen's projection (rows marked projected)")
    ap.add_argument("--host-limit-gib", type=float, default=FLEXGEN_HOST_LIMIT_GIB)
    ap.add_argument("--list-candidates", type=int, nargs="?", const=4, default=None, metavar="K",
                    help="print the K policies to run for this point as JSON (no GPU) and exit")
    args = ap.parse_args(argv)
    from offsim import get_model

    model = get_model(args.model)
    cw = args.compress or args.compress_weight
    cc = args.compress or args.compress_cache
    if args.list_candidates is not None:
        pols = candidates(model, args.prompt_len, args.gen_len, args.budget_gib, args.list_candidates,
                          compress=cw or cc, host_limit_gib=args.host_limit_gib)
        print(json.dumps([p.settings() for p in pols]))
        return 0
    if model.family != "opt":
        emit(base_record(SYSTEM, args.model, args.prompt_len, args.gen_len, args.budget_gib, status="unsupported",
                         reason="FlexGen 0.1.8 implements OPT models only (flex_opt.py)"))
        return 0
    if args.percent is None or args.gpu_batch_size is None:
        pols = candidates(model, args.prompt_len, args.gen_len, args.budget_gib, 1, compress=cw or cc,
                          host_limit_gib=args.host_limit_gib)
        if not pols:
            emit(base_record(SYSTEM_4BIT if cw or cc else SYSTEM, args.model, args.prompt_len, args.gen_len,
                             args.budget_gib, status="skipped", reason="no FlexGen policy fits host and GPU"))
            return 0
        pol = pols[0]
    else:
        pol = FlexGenPolicy(args.gpu_batch_size, args.num_gpu_batches, tuple(args.percent), args.cpu_cache_compute,
                            cw, cc, "cli")
    ok, why = fits(model, pol, args.prompt_len, args.gen_len, args.budget_gib, args.host_limit_gib)
    if not ok:
        print(f"flexgen_ref: warning, estimated not to fit ({why}); running anyway", file=sys.stderr)
    rec = run_policy(args.model, pol, args.prompt_len, args.gen_len, args.budget_gib, args.offload_dir,
                     args.cut_gen_len)
    emit(rec)
    print(json.dumps({k: rec.get(k) for k in ("system", "status", "prefill_tok_s", "decode_tok_s", "total_tok_s")},
                     default=str))
    # FlexGen's OptLM.__del__ and its copy threads can hang interpreter shutdown after a failure: leave now
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
