"""The peers as implemented (issue 15, part 3): each ``*-ref`` policy runs the same schedule as its ideal policy
(``static-accelerate``, ``static-zero``, ``flexgen``), with the settings of that policy, but executed the way the
system's released code executes it. The ideal policies model an ideal executor of each system's schedule; these
model the implementation -- every difference below is read from the system's public source (the versions FlexGen's
paper benchmarked: FlexGen's own code, and its ``benchmark/hf_ds`` scripts with transformers 4.24, accelerate 0.15
and DeepSpeed 0.7.7, vendored under ``benchmark/third_party``), and every rate comes from the hardware profile.
Nothing is fitted to a measured throughput.

- ``flexgen-ref`` (FMInference/FlexLLMGen, ``flexllmgen/flex_opt.py``, ``flexllmgen/pytorch_backend.py``):
  its loop calls ``sync()`` (``torch.cuda.synchronize`` and the disk threads' join) after every (layer, batch)
  position, so nothing of one position overlaps the next, and its main loop issues nothing of a position before the
  previous one has finished (``Plan.issue_waits_for_deps``: where the profile prices issuing, the issuing thread's
  work -- and the ``pin_memory()`` staging of each H2D relay, done on that thread -- adds to each position), except the stores it issues one position late
  (``store_cache(k-1)``, ``store_hidden(k-1)``); the next layer's weights are loaded beside the first batch only
  (``load_weight`` copies when ``k == 0``: as the ideal schedule); and its CPU KV cache is allocated with
  ``pin_memory=False`` (``init_cache_one_gpu_batch``: "disable pin_memory due to high memory overhead"), so each
  cache copy goes through a pinned relay (``general_copy``: ``src.pin_memory()`` before the H2D, the copy threads'
  pinned buffer for D2H): KV copies are priced at the profile's relay rates where it has them (``h2d_relay`` /
  ``d2h_relay``: that staging timed by ``offexec profile``; ``Plan.pageable_copy`` 'relay'), else at its pageable
  rates -- and a prefill's KV stores at the profile's 'store_flexgen:*' rows where it has them (FlexGen's own
  ``general_copy`` timed into a fresh home: its copy threads' relay buffer is float16, so a 4-bit cache's bytes
  are converted there and back, and the home's pages are first written then; ``costmodel.flexgen_store_curve``).
  Its CPU attention runs FlexGen's own fp32 path (``Plan.cpu_attention_impl`` 'flexgen'; QKV on the GPU, attention
  on the CPU over the host cache, inside the position), and with ``--compress-weight`` /
  ``--compress-cache`` its own 4-bit decompress, every weight matrix in each (layer, batch) call and the whole
  cache the attention reads (``Plan.quant_impl`` 'flexgen': the profile's 'dequant_flexgen:*' rows where measured).
  Its weights are placed tensor by tensor (``init_weight_list``: each whole tensor on the tier that holds the
  midpoint of its cumulative size in its layer, ``flexgen_unit_homes``), so each of its layers -- the embedding
  and the head included, which it loads every step, one layer ahead (``InputEmbed.load_weight``,
  ``OutputEmbed.load_weight``), exposed by the sync -- streams its off-GPU tensors (``Schedule.unit_homes``), not
  a byte prefix of the decoder layer. With CPU attention each decode token's K and V go to the unpinned host cache
  by two one-position copies, ``general_copy``'s plain pageable path, blocking its main thread after the next
  position's compute (``store_cache(k-1)``; none for the last token: ``Schedule.kv_token_stores``); where the
  profile timed its own attention call (``load_cache`` + ``mha_gen``: the GPU part and the small copies too,
  ``costmodel.cpu_attention_row_holds_sublayer``), a decode attention sub-layer is that one op
  (``Schedule.cpu_attention_sublayer``), elsewhere its parts are priced apart.
- ``static-accelerate-ref`` (huggingface/accelerate 0.15 ``hooks.py``, ``big_modeling.py``; FlexGen's
  ``benchmark/hf_ds/hf_opt.py``): FlexGen's benchmark maps every decoder layer to "cpu" (or "disk") with only the
  embeddings and the LM head on the GPU (its own ``device_map``, not ``"auto"``), so ``gpu_layers`` defaults to 0;
  an ``AlignDevicesHook`` on each leaf module copies that module's tensors one by one
  (``set_module_tensor_to_device``: ``value.to(device)`` from the pageable state dict) in its ``pre_forward``, on
  the compute stream: one synchronous copy per tensor from pageable memory, none overlapping a compute, no
  prefetch.
- ``static-zero-ref`` (DeepSpeed 0.7.7 ``runtime/zero/partitioned_param_coordinator.py``,
  ``partition_parameters.py``; FlexGen's ``hf_opt.py`` config: stage 3, ``offload_param`` to pinned CPU memory,
  ``stage3_param_persistence_threshold`` 0, ``stage3_prefetch_bucket_size`` hidden²): every parameter, biases and
  norms too, is fetched on its own (``ds_tensor.to(device)``, one copy each, with its per-copy latency) when its
  module runs; the next module's parameters are prefetched (one bucket of hidden² elements ahead, about one
  module; approximated here by one sub-layer -- attention or MLP -- ahead, which is more than the bucket holds but
  changes little while the link is the bottleneck) only once the module trace is complete
  (``is_complete_trace()``), i.e. from the second forward on: the first forward (the prefill) fetches each module's
  parameters when it runs. Each fetch gathers the parameters through a flat GPU buffer on the fetch stream
  (``all_gather_coalesced``: ``torch.cat`` of the copied partitions into the flat buffer, an all-gather that is in
  place with one rank, then ``AllGatherCoalescedHandle.wait``'s ``torch.cat`` out of it for each parameter): two
  device copies of every fetched byte, priced at the profile's HBM rate (``Plan.weight_gather_copies``), before the
  next fetch's copy (each ``ds_tensor.to(device)`` is a blocking copy on that stream).

None of the three replays CUDA graphs: each plan has ``cuda_graphs`` off (``_eager``), so with a profile's op
tables its decode ops are priced by the 'eager' rows and the eager issue costs.

What they leave out is in ``docs/architecture.md`` ("The peers as implemented").
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from offsim.core import costmodel
from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload
from offsim.policies.base import Candidate, Policy, capacity_of
from offsim.policies.flexgen import (FlexGenSettings, candidates as flexgen_candidates, fit_gpu_weights,
                                     flexgen_schedule, more_on_disk, spill_host_to_disk)
from offsim.policies.schedule import Schedule, build_block_plan
from offsim.policies.static import (ZERO_KV_CHOICES, AccelerateSettings, ZeroSettings, _accelerate_schedule,
                                    _zero_schedule, offload_candidates)


# ---- FlexGen as its code runs it ------------------------------------------------------------------------------
def flexgen_tensor_tiers(numels, w_gpu: float, w_cpu: float) -> list[str]:
    """The tier ('disk', 'cpu' or 'gpu') of each tensor of one of FlexGen's layers (``numels``: their element counts,
    in its order) for weight percentages ``w_gpu`` / ``w_cpu`` (the rest on disk): FlexGen places every tensor whole
    (flex_opt.py ``init_weight_list`` and ``get_choice``) on the tier whose range of the cumulative percentages,
    disk then CPU then GPU, holds the midpoint of the tensor's cumulative size in the layer. So a layer's tensors go
    disk first, then CPU, then GPU, in order -- not a byte prefix: at 23 / 77 an OPT attention layer keeps w_q, w_k,
    w_v and their biases on the CPU (they hold its first 75 %) and w_out, its bias and the norm on the GPU."""
    bounds = [(100 - w_gpu - w_cpu, "disk"), (100 - w_gpu, "cpu"), (100, "gpu")]
    total, cum, out = sum(numels), 0, []
    for n in numels:
        cum += n
        mid = (cum - n / 2) / total * 100
        out.append(next((t for b, t in bounds if mid < b), "gpu"))
    return out


def flexgen_unit_homes(model: ModelSpec, w_gpu: float, w_cpu: float) -> tuple[tuple[str, int, int], ...]:
    """FlexGen's placement of each of its layers (``footprint.FLEXGEN_UNITS``: its InputEmbed, each decoder layer's
    SelfAttention and MLP, its OutputEmbed -- which it places like any layer, by the same percentages) as
    ``Schedule.unit_homes``: (unit, tensors on disk, tensors on the CPU), the rest on the GPU
    (``flexgen_tensor_tiers`` over ``footprint.flexgen_unit_tensors``)."""
    out = []
    for u in fp.FLEXGEN_UNITS:
        tiers = flexgen_tensor_tiers([math.prod(shape) for _, shape in fp.flexgen_unit_tensors(model, u)],
                                     w_gpu, w_cpu)
        out.append((u, tiers.count("disk"), tiers.count("cpu")))
    return tuple(out)


def flexgen_ref_schedule(model: ModelSpec, st: FlexGenSettings, wl: Workload | None = None,
                         hw: HardwareSpec | None = None) -> Schedule:
    """``flexgen``'s schedule as FlexGen 0.1.8's code runs it (module docstring). Beyond the settings: every weight
    tensor placed whole by FlexGen's rule, the embedding and the head too (``flexgen_unit_homes``: what each layer
    streams; ``weight_split`` holds each decoder layer's totals); with CPU attention the new token's K and V stored
    by two one-position pageable copies (``Schedule.kv_token_stores``); and where ``hw``'s profile timed FlexGen's
    own attention call (``costmodel.cpu_attention_row_holds_sublayer``) and the cache is homed in host memory, the
    attention sub-layer in decode is that one op (``Schedule.cpu_attention_sublayer``)."""
    if st.num_stages > 1:
        raise OffsimError("flexgen-ref models FlexGen's single-GPU loop: use num_stages 1")
    s = flexgen_schedule(model, st, wl)
    homes = flexgen_unit_homes(model, st.percent[0], st.percent[1])
    per_layer = [fp.flexgen_unit_home_bytes(model, u, nd, nc) for u, nd, nc in homes if u in fp.SUBLAYERS]
    split = (sum(x["gpu"] for x in per_layer), sum(x["cpu"] for x in per_layer))
    kd = model.num_kv_heads - sum(s.kv_split)
    sublayer_op = bool(st.cpu_attention and kd == 0 and s.compression.sparse_attention >= 1 and hw is not None
                       and costmodel.cpu_attention_row_holds_sublayer(hw, model, "flexgen"))
    derived = (("cpu_attention_sublayer_op", True),) if sublayer_op else ()
    return dataclasses.replace(s, policy="flexgen-ref", kv_pinned=False,
                               sync_positions=True, cpu_attention_impl="flexgen", pageable_copy="relay",
                               quant_impl="flexgen", issue_waits_for_deps=True,
                               weight_split=(split,) * model.num_layers, unit_homes=homes,
                               kv_token_stores=st.cpu_attention, cpu_attention_sublayer=sublayer_op,
                               derived=s.derived + derived)


def _eager(plan: Plan) -> Plan:
    """The plan issued kernel by kernel (``Plan.cuda_graphs`` off): none of the peers replays CUDA graphs -- FlexGen
    0.1.8, transformers' ``generate`` under Accelerate's hooks and DeepSpeed's ZeRO-3 modules all launch each kernel
    from Python -- so where the profile has op tables, their decode ops are priced by the 'eager' rows and the eager
    issue costs, not by offexec's graph replays."""
    plan.cuda_graphs = False
    return plan


def flexgen_ref_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: FlexGenSettings) -> Plan:
    return _eager(build_block_plan(model, wl, flexgen_ref_schedule(model, st, wl, hw), capacity_of(hw)))


def flexgen_ref_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                           batch: int | None = None, compression: Compression = NO_COMPRESSION,
                           key_mask: bool = False, max_batch: int | None = None) -> list[Candidate]:
    """FlexGen's candidates (``flexgen.candidates``: the LP optimum of each block shape, its GPU weight share trimmed
    until the flat placement fits), each share trimmed further until FlexGen's own placement fits the GPU too:
    whole tensors by their midpoints (``flexgen_unit_homes``), the embedding and the head by the same percentages,
    can hold more on the GPU than the share says (OPT-30B at 24 GiB: 22.97 GiB of resident weights where the flat
    placement of the same percentages fits); then, where the tensors that trim moved home to the host overflow it
    (Llama-2-70B's at a share of 16 % all land there: 128.5 GiB on a 125 GiB host), host-homed weights and then KV
    moved to disk until FlexGen's placement fits the host (``flexgen.spill_host_to_disk``). Those that this put
    more on disk than the LP's placement come after the rest (``flexgen.more_on_disk``), those that still do not
    fit last: the search screens the first few."""
    cap = capacity_of(hw)
    fit, spilled, unfit = [], [], []
    for c in flexgen_candidates(model, hw, prompt_len, gen_len, batch, compression, key_mask=key_mask,
                                max_batch=max_batch):
        ca = c.settings["cpu_attention"]

        def fits(p, tiers=("gpu",), wl=c.workload, ca=ca):
            st = FlexGenSettings(percent=p, cpu_attention=ca, **compression.settings())
            return fp.fits(model, cap, wl, flexgen_ref_schedule(model, st).placement(), tiers)

        p = fit_gpu_weights(model, hw, c.workload, c.settings["percent"], ca, fits=fits, comp=compression)
        p = spill_host_to_disk(p, lambda q: not fits(q, ("cpu",)))
        fitted = c._replace(settings={**c.settings, "percent": p})
        if not fits(p, ("gpu", "cpu", "disk")):
            unfit.append(fitted)
        elif more_on_disk(p, c.settings["percent"]):
            spilled.append(fitted)
        else:
            fit.append(fitted)
    return fit + spilled + unfit


# ---- HF Accelerate as FlexGen's benchmark ran it ----------------------------------------------------------------
@dataclass(frozen=True)
class AccelerateRefSettings(AccelerateSettings):
    """As ``static-accelerate``'s, but ``gpu_layers`` defaults to 0: FlexGen's benchmark (``hf_opt.py``) maps all
    decoder layers to the offload tier (None: as many as fit, as ``device_map='auto'`` would)."""

    POLICY: ClassVar[str] = "static-accelerate-ref"

    gpu_layers: int | None = 0


def accelerate_ref_schedule(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateRefSettings) -> Schedule:
    # overlap off: the hooks' copies are synchronous and on the compute stream, so every op (the embedding's and the
    # head's computes too) waits for the one before it -- and nothing else moves (the KV cache is on the GPU)
    return dataclasses.replace(_accelerate_schedule(model, hw, wl, st), policy="static-accelerate-ref",
                               prefetch=False, overlap=False, pinned=False, weight_copies="tensor")


def accelerate_ref_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateRefSettings) -> Plan:
    return _eager(build_block_plan(model, wl, accelerate_ref_schedule(model, hw, wl, st), capacity_of(hw)))


# ---- DeepSpeed ZeRO-Inference as its parameter coordinator runs it ----------------------------------------------
def zero_ref_schedule(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings) -> Schedule:
    return dataclasses.replace(_zero_schedule(model, hw, wl, st), policy="static-zero-ref", sublayer=True,
                               weight_copies="tensor", prefetch_from_step=1, weight_gather_copies=2)


def zero_ref_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings) -> Plan:
    return _eager(build_block_plan(model, wl, zero_ref_schedule(model, hw, wl, st), capacity_of(hw)))


FLEXGEN_REF = Policy("flexgen-ref", FlexGenSettings, flexgen_ref_plan, flexgen_ref_candidates,
                     "FlexGen as its code runs: flexgen's schedule with a sync after every layer x batch and the "
                     "CPU KV cache in pageable memory", lambda m, hw, wl, st: flexgen_ref_schedule(m, st).placement(),
                     ranks_compression=True, implements="flexgen")
def accelerate_ref_placement(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: AccelerateRefSettings):
    return accelerate_ref_schedule(model, hw, wl, st).placement()


def zero_ref_placement(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: ZeroSettings):
    return zero_ref_schedule(model, hw, wl, st).placement()


ACCELERATE_REF = Policy("static-accelerate-ref", AccelerateRefSettings, accelerate_ref_plan,
                        offload_candidates(AccelerateRefSettings, accelerate_ref_placement),
                        "HF Accelerate as FlexGen's benchmark ran it: all decoder layers offloaded, one synchronous "
                        "pageable copy per tensor before each module", accelerate_ref_placement,
                        implements="static-accelerate")
ZERO_REF = Policy("static-zero-ref", ZeroSettings, zero_ref_plan,
                  offload_candidates(ZeroSettings, zero_ref_placement, ZERO_KV_CHOICES),
                  "DeepSpeed ZeRO-Inference as its coordinator runs: one fetch per parameter, prefetch only after "
                  "the first forward", zero_ref_placement, implements="static-zero")
