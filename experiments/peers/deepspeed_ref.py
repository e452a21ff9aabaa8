"""DeepSpeed ZeRO-Inference (ZeRO stage 3, parameters offloaded to pinned CPU memory) running transformers' own OPT
or Llama, as system ``deepspeed-ref``: the real counterpart of offsim's ``static-zero`` policy.

DeepSpeed 0.19.8 is published on PyPI as a source archive only; ``fetch_wheels.sh`` builds a pure-Python wheel from
it here (``DS_BUILD_OPS=0``: no CUDA op compiled ahead of time; ZeRO-3 parameter offload to CPU loads none at run
time -- only NVMe offload (async_io), CPU Adam and the inference kernels need compiled ops, and this run uses none
of them). On the GPU machine it runs as one process of a world of one (``init_distributed`` over NCCL on the
loopback address).

The model: transformers' class from offsim's preset config on the meta device, materialised in host memory with
seeded random values (``accelerate_ref.materialise``), converted to ZeRO-3 parameters by ``deepspeed.zero.Init(module=
model)`` (each passes through the GPU once and is partitioned to pinned CPU memory; what ``deepspeed.initialize``
does itself only after moving the whole model to the GPU), then ``deepspeed.initialize`` with no optimizer: its
parameter coordinator fetches each module's weights to the GPU before its forward, prefetching the
next ones (``overlap_comm``), and releases them after. ``generate`` as in ``accelerate_ref`` (greedy, EOS off,
per-step timestamps; FlexGen's throughput definitions). The KV cache stays on the GPU (transformers' DynamicCache):
the batch is the largest whose KV cache and activations fit beside DeepSpeed's live-parameter window.

    python -m experiments.peers.deepspeed_ref --model opt-30b --prompt-len 512 --gen-len 32 --budget-gib 16 \\
        [--batch auto|N]
    python -m experiments.peers.deepspeed_ref --print-config ...      # the ZeRO config, no GPU
    python -m experiments.peers.deepspeed_ref --model tiny.json --device cpu ...   # smoke test, no GPU

Prints ``PEER_RESULT {json}`` (``common.emit``; status ``unsupported`` with the import error when DeepSpeed does not
import) and ends with one JSON line.
"""
from __future__ import annotations

import json
import os
import sys
import time

from experiments.peers.accelerate_ref import (BATCHES, add_cut_option, hf_model_on_meta, materialise,
                                              measure_generate, reserve_bytes)
from experiments.peers.common import (MISSING_PEER, GiB, HOST_LIMIT_GIB, base_record, emit, env_offline,
                                      finish_record, link_bound, measure_h2d, point_parser, record_failure,
                                      set_gpu_budget, versions)

SYSTEM = "deepspeed-ref"


def ds_config(spec, pin_memory: bool = True, fp16: bool = True) -> dict:
    """ZeRO-Inference's configuration (DeepSpeed's documented ZeRO-3 inference settings): fp16, stage 3, parameters
    offloaded to (pinned) CPU memory, communication overlapped (prefetch); the live-parameter window and the
    prefetch bucket sized to two and one decoder layers (DeepSpeed's defaults, 1e9 and 5e7 parameters, would hold
    2 GB of weights live on a small budget); parameters under 1e5 elements (norms, biases) stay on the GPU."""
    layer_params = spec.layer_weight_bytes() // spec.dtype_bytes
    return {
        "fp16": {"enabled": fp16},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": pin_memory},
            "overlap_comm": True,
            "stage3_prefetch_bucket_size": int(layer_params),
            "stage3_max_live_parameters": int(2 * layer_params),
            "stage3_param_persistence_threshold": int(1e5),
        },
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def auto_batch(spec, prompt_len: int, gen_len: int, budget_gib: float) -> int | None:
    """The largest batch of ``BATCHES`` whose KV cache and activations (``accelerate_ref.reserve_bytes``) fit the
    budget beside DeepSpeed's live window (two decoder layers) and the embeddings (kept on the GPU when fetched)."""
    best = None
    window = 2 * spec.layer_weight_bytes() + spec.embedding_bytes()
    for b in BATCHES:
        if reserve_bytes(spec, b, prompt_len, gen_len) + window <= budget_gib * GiB:
            best = b
    return best


def init_single_process(port: int = 29533, accelerator: str = "cuda") -> None:
    """The environment of a world of one for ``deepspeed.init_distributed`` (loopback only)."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"), ("DS_ACCELERATOR", accelerator)):
        os.environ.setdefault(k, v)


def run(model_name: str, prompt_len: int, gen_len: int, budget_gib: float, batch: int | None = None,
        host_limit_gib: float = HOST_LIMIT_GIB, warmup: bool = True, device: str = "cuda",
        cut_gen_len: int | None = None, kernel_profile: str | None = None) -> dict:
    """One ZeRO-Inference run; the result record. ``device='cpu'``: a smoke test of the same path on DeepSpeed's CPU
    accelerator (gloo, fp32, unpinned; a tiny model). ``kernel_profile``: record the generation (warm-up, prefill and
    decode) with torch.profiler and write its time by kernel (on the CPU, by operator) to that CSV
    (``offexec.kernels``; two batches' tables side by side: ``experiments.offexec.kernel_compare``); the record is
    then marked, its tok/s no measurement."""
    from offsim import get_model

    spec = get_model(model_name)
    b = batch or auto_batch(spec, prompt_len, gen_len, budget_gib)
    rec = base_record(SYSTEM, model_name, prompt_len, gen_len, budget_gib, probe=True, batch=b, gpu_batch_size=b,
                      num_gpu_batches=1, versions=versions("torch", "transformers", "deepspeed"))
    if b is None:
        rec.update(status="skipped", reason="even one sequence's KV cache and activations leave no GPU room")
        return rec
    t0 = time.perf_counter()
    env_offline()
    cuda = device == "cuda"
    init_single_process(accelerator="cuda" if cuda else "cpu")
    try:
        import deepspeed
    except ModuleNotFoundError as e:
        if e.name != "deepspeed":  # DeepSpeed is there but needs what this machine lacks: its answer here
            rec.update(status="unsupported", reason=f"import deepspeed: {type(e).__name__}: {str(e)[:300]}")
            return rec
        # the harness's environment, not DeepSpeed: an error, retried by the next call (common.MISSING_PEER)
        rec.update(status="error", reason=f"{MISSING_PEER}deepspeed (install .whl-peers: "
                                          "experiments/peers/fetch_wheels.sh)")
        return rec
    except Exception as e:  # noqa: BLE001 -- the exact reason is the result
        rec.update(status="unsupported", reason=f"import deepspeed: {type(e).__name__}: {str(e)[:300]}")
        return rec
    import torch

    cfg = ds_config(spec, pin_memory=cuda, fp16=cuda)
    st = {"ds_config": cfg, "batch_rule": "explicit" if batch else "auto (largest that fits)"}
    try:
        h2d = None
        if cuda:
            budget = set_gpu_budget(budget_gib)
            st["gpu_fraction"] = budget["fraction"]
            h2d = measure_h2d()
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        model, spec = hf_model_on_meta(model_name, prompt_len + gen_len)
        st["extended_positions"] = model.config.max_position_embeddings > spec.max_positions
        st["materialise_s"] = materialise(model, "cpu")
        dtype = torch.float16 if cuda else torch.float32
        model = model.to(dtype)
        t1 = time.perf_counter()
        # partition the materialised parameters first (each passes through the GPU once and lands in pinned CPU
        # memory): deepspeed.initialize moves a model none of whose parameters is a ZeRO parameter to the GPU whole
        # (engine._configure_distributed_model), which a 30B model does not survive under the budget
        deepspeed.zero.Init(module=model, config_dict_or_path=cfg, remote_device="cpu", pin_memory=cuda,
                            dtype=dtype)
        for mod in model.modules():  # buffers (RoPE's inverse frequencies) are not ZeRO's: put them on the GPU
            for name, buf in list(mod._buffers.items()):
                if buf is not None and cuda:
                    mod._buffers[name] = buf.to("cuda")
        engine = deepspeed.initialize(model=model, config=cfg)[0]
        st["zero_init_s"] = time.perf_counter() - t1
        model = engine.module.eval()
        if kernel_profile:
            from offexec import kernels

            rec["kernel_profile"] = kernel_profile  # (the profiler slows the run: its tok/s are no measurement)
            with kernels.recording(device) as prof:
                measure_generate(model, rec, b, prompt_len, gen_len, spec.vocab_size, warmup, cuda, cut_gen_len)
            kernels.write_table(kernel_profile, prof, device, {"system": SYSTEM, "model": model_name, "batch": b,
                                                               "prompt_len": prompt_len, "gen_len": gen_len})
        else:
            measure_generate(model, rec, b, prompt_len, gen_len, spec.vocab_size, warmup, cuda, cut_gen_len)
        persistent = sum(p.numel() * 2 for p in model.parameters()
                         if p.numel() <= cfg["zero_optimization"]["stage3_param_persistence_threshold"])
        dec = (spec.weight_bytes() - persistent) * (gen_len - 1)  # ZeRO-3 fetches every other parameter each step
        rec.update(decode_h2d_bytes=dec, h2d_bytes_per_s=h2d,
                   link_bound_decode_tok_s=link_bound(b, gen_len, dec, h2d) if h2d else None)
    except Exception as e:  # noqa: BLE001 -- a failure is a result
        record_failure(rec, e)
    rec["settings"] = json.dumps(st, sort_keys=True, default=str)
    return finish_record(rec, t0, cuda)


def main(argv=None) -> int:
    ap = point_parser(__doc__)
    ap.add_argument("--batch", default="auto", help="'auto' (the largest that fits) or a number")
    ap.add_argument("--host-limit-gib", type=float, default=HOST_LIMIT_GIB)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--print-config", action="store_true", help="print the ZeRO config and the batch, then exit")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="'cpu': smoke test on a tiny model")
    add_cut_option(ap)
    ap.add_argument("--kernel-profile", default=None, metavar="FILE",
                    help="record the generation with torch.profiler and write its time by kernel to FILE (.csv or "
                         ".csv.gz; offexec/kernels.py); the run's tok/s are then no measurement")
    args = ap.parse_args(argv)
    from offsim import get_model

    spec = get_model(args.model)
    batch = None if args.batch == "auto" else int(args.batch)
    if args.print_config:
        print(json.dumps({"batch": batch or auto_batch(spec, args.prompt_len, args.gen_len, args.budget_gib),
                          "ds_config": ds_config(spec)}))
        return 0
    rec = run(args.model, args.prompt_len, args.gen_len, args.budget_gib, batch, args.host_limit_gib,
              not args.no_warmup, args.device, args.cut_gen_len, args.kernel_profile)
    emit(rec)
    print(json.dumps({k: rec.get(k) for k in ("system", "status", "batch", "prefill_tok_s", "decode_tok_s",
                                                "total_tok_s", "reason")}, default=str))
    sys.stdout.flush()
    os._exit(0)  # skip the process group's teardown at exit (one process; nothing left to flush)


if __name__ == "__main__":
    sys.exit(main())
