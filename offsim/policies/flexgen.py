"""FlexGen (ICML'23): the zig-zag block schedule with placement percentages for weights, KV cache and activations
over GPU/CPU/disk (FlexGen's six ``--percent`` numbers), overlap on or off and optional CPU attention. Its search
candidates come from FlexGen's LP (``offsim.policies.lp``), one optimum per block shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload
from offsim.policies.base import (Candidate, Policy, capacity_of, check_field_types, compression_of,
                                  kv_split_from_percent, weight_split_from_percent)
from offsim.policies.lp import flexgen_candidates, flexgen_stage_candidates, stage_splits
from offsim.core.costmodel import network_bytes_per_s
from offsim.policies.schedule import (Schedule, balanced_stages, build_block_plan, check_gpus_per_node, check_stages_fit,
                                     node_host_bytes, stages_fit_gpus)


@dataclass(frozen=True)
class FlexGenSettings:
    """FlexGen's policy knobs. ``percent``: weights GPU, weights CPU, cache GPU, cache CPU, activations GPU,
    activations CPU (FlexGen's ``--percent``; the rest of each pair is on disk)."""

    percent: tuple[int, int, int, int, int, int] = (100, 0, 100, 0, 100, 0)
    overlap: bool = True  # overlap I/O with compute (FlexGen's default)
    cpu_attention: bool = False  # FlexGen's --cpu-cache-compute
    pin_weights: bool = True  # FlexGen's --pin-weight
    sublayer: bool = True  # stream the attention's and the MLP's weights separately, as FlexGen's code does
    # FlexGen's approximations (``specs.Compression``): --compress-weight, --compress-cache, --sparse-attention
    compress_weight: bool = False
    compress_cache: bool = False
    sparse_attention: float = 1.0
    # pipeline parallelism (FlexGen's multi-GPU mode; docs/architecture.md §2.1): the layers split into
    # ``num_stages`` contiguous stages, one GPU each (every GPU with the hardware's GPU budget); ``stage_layers``:
    # layers per stage (default: balanced); ``micro_batches``: groups of GPU batches that flow through the stages
    # (0: num_stages, at most num_gpu_batches). The percentages apply within every stage. ``gpus_per_node``: the
    # stages' hosts (FlexGen's multi-node runs, e.g. 4 nodes x 1 GPU: 1): stage s on node s // gpus_per_node, each
    # node with the hardware's host memory, disk, CPU and links, hidden states between nodes over the network
    # (``HardwareSpec.network_bytes_per_s``); 0: every stage on one host
    num_stages: int = 1
    stage_layers: tuple = ()
    micro_batches: int = 0
    gpus_per_node: int = 0

    def __post_init__(self):
        check_field_types(self, "flexgen")
        if not isinstance(self.percent, (list, tuple)) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in self.percent):
            raise OffsimError(f"--percent needs six numbers in [0, 100] (weights, cache, activations: GPU %, CPU %), "
                              f"e.g. 20 80 0 100 100 0; got {self.percent!r}")
        p = tuple(self.percent)
        if len(p) != 6 or any(not 0 <= x <= 100 for x in p):
            raise OffsimError(f"--percent needs six numbers in [0, 100], got {list(p)}")
        for name, (a, b_) in (("weights", p[0:2]), ("cache", p[2:4]), ("activations", p[4:6])):
            if a + b_ > 100:
                raise OffsimError(f"--percent: {name} GPU + CPU = {a + b_} % exceeds 100 (the rest goes to disk)")
        if p[4] + p[5] != 100:
            raise OffsimError(f"--percent: activations GPU + CPU must sum to 100 (activations never go to disk), "
                              f"got {p[4]} + {p[5]}")
        object.__setattr__(self, "percent", p)
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        for name in ("num_stages", "micro_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "num_stages" else 0):
                raise OffsimError(f"{name} must be an integer >= {1 if name == 'num_stages' else 0}, got {v!r}")
        check_gpus_per_node(self.num_stages, self.gpus_per_node)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.stage_layers):
            raise OffsimError(f"stage_layers must be one integer >= 1 per stage (layers of each stage, in order), "
                              f"got {list(self.stage_layers)}")
        if self.stage_layers and len(self.stage_layers) != self.num_stages:
            raise OffsimError(f"stage_layers {list(self.stage_layers)} needs one layer count per stage "
                              f"(num_stages {self.num_stages})")
        compression_of(self)


_STAGE_DEFAULTS = {"num_stages": 1, "stage_layers": (), "micro_batches": 0, "gpus_per_node": 0}


def flexgen_schedule(model: ModelSpec, st: FlexGenSettings, wl: Workload | None = None) -> Schedule:
    """FlexGen's placement percentages as a block schedule (with stages, for workload ``wl``'s GPU batches)."""
    wg, wc, cg, cc, ag, ac = st.percent
    split = weight_split_from_percent(model, wg, wc)
    kv = kv_split_from_percent(model, cg, cc)
    # the pipeline's settings are recorded only when set, so that single-GPU plans record what they always did
    recorded = tuple((k, v) for k, v in dataclasses.asdict(st).items()
                     if k not in _STAGE_DEFAULTS or v != _STAGE_DEFAULTS[k])
    stages, micro = (), 1
    if st.num_stages > 1:
        stages = balanced_stages(model.num_layers, st.num_stages, st.stage_layers)
        nb = wl.num_gpu_batches if wl is not None else st.num_stages
        micro = st.micro_batches or min(st.num_stages, nb)
        if micro > nb:
            raise OffsimError(f"micro_batches {micro} exceeds the block's {nb} GPU batches")
    elif st.stage_layers and tuple(st.stage_layers) != (model.num_layers,):
        raise OffsimError(f"stage_layers {list(st.stage_layers)} with one stage must be [{model.num_layers}]")
    return Schedule(policy="flexgen", weight_split=(split,) * model.num_layers, kv_split=kv,
                    hidden_home="gpu" if ag >= ac else "cpu", prefetch=True, overlap=st.overlap,
                    cpu_attention=st.cpu_attention, pinned=st.pin_weights, sublayer=st.sublayer,
                    compression=compression_of(st), settings=recorded, stages=stages, micro_batches=micro,
                    gpus_per_node=st.gpus_per_node if st.num_stages > 1 else 0)


def flexgen_plan(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: FlexGenSettings) -> Plan:
    return build_block_plan(model, wl, flexgen_schedule(model, st, wl), capacity_of(hw))


def check_flexgen_stages(model: ModelSpec, hw: HardwareSpec, wl: Workload, st: FlexGenSettings,
                         what: str = "plan") -> None:
    """Every stage of a pipeline on one GPU's budget, each node's host memory and disk shared by its stages
    (``check_stages_fit``); over several nodes, the network rate between them given (``costmodel``)."""
    s = flexgen_schedule(model, st, wl)
    if max(s.stage_nodes()) > 0:
        network_bytes_per_s(hw)
    check_stages_fit(model, wl, s, capacity_of(hw), what)


def fit_gpu_weights(model: ModelSpec, hw: HardwareSpec, wl: Workload, percent: tuple, cpu_attention: bool,
                    fits=None, comp: Compression = NO_COMPRESSION) -> tuple:
    """``percent`` with the GPU share of the weights lowered, one point at a time, until the GPU holds the placement
    by the footprint's exact arithmetic. The LP's memory row is affine in the fractions, so it leaves out what is
    not: the tensor that straddles the GPU | offloaded boundary, which the executor assembles whole in each weight
    slot (``footprint.weight_slot_straddle_bytes``). A point moved off the GPU goes to the host when no weight is on
    disk, else to disk. Unchanged when it already fits (or when the GPU is not the short tier). ``fits(percent)``:
    another policy's test of its own placement (TightLLM's working set differs from FlexGen's)."""
    cap = capacity_of(hw)["gpu"]
    p = tuple(percent)
    while p[0] > 0:
        if fits is not None:
            if fits(p):
                break
        elif sum(fp.placement_tier_bytes(model, wl, flexgen_schedule(
                model, FlexGenSettings(percent=p, cpu_attention=cpu_attention, **comp.settings())
        ).placement())["gpu"].values()) <= cap:
            break
        wg, wc = p[0], p[1]
        p = (wg - 1, wc + 1 if wg + wc == 100 else wc) + p[2:]
    return p


def candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
               batch: int | None = None, compression: Compression = NO_COMPRESSION,
               num_gpus: int = 1, gpus_per_node: int = 0, key_mask: bool = False,
               max_batch: int | None = None) -> Iterable[Candidate]:
    """FlexGen's LP optimum for every block shape (with ``batch`` sequences when given), with and without CPU
    attention, best LP time first, made to fit exactly (``fit_placement``: the GPU weight share trimmed, then host
    bytes over host memory moved to disk); each also with the activations on the other tier (a near-tie in the LP,
    whose activation traffic is small, but not in a real schedule), fitted the same way. Candidates that still do
    not fit come after all that do: the search screens the first few, and these give it its reasons when none fits
    (before 2026-12-04 the host went unchecked and the other-tier variant unfitted, so that at some budgets every
    screened candidate was refused: Llama-2-70B on the H200 preset fitted at 24 and 48 GiB, not at 32).
    ``compression``: the LP, the fit and every candidate run with it (its settings in each candidate).
    ``num_gpus`` > 1: pipeline candidates (``stage_candidates``; ``gpus_per_node``: over that many hosts).
    ``key_mask``: every workload reserves a padded batch's key mask (``Workload.reserve_key_mask``), the fit
    included (the LP's memory row leaves it out, as it leaves out the straddling tensor). ``max_batch``: no block
    of more sequences (its LP is not solved)."""
    if num_gpus > 1:
        yield from stage_candidates(model, hw, prompt_len, gen_len, num_gpus, batch, compression, gpus_per_node,
                                    key_mask, max_batch)
        return
    extra = compression.settings() if compression.any else {}
    cap = capacity_of(hw)
    spilled, unfit = [], []
    for r in flexgen_candidates(model, hw, prompt_len, gen_len, batch=batch, comp=compression, max_batch=max_batch):
        wl = Workload(prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches, reserve_key_mask=key_mask)
        for q0 in (r.percent, r.percent[:4] + (r.percent[5], r.percent[4])):
            q = fit_placement(model, hw, wl, q0, r.cpu_attention, compression)
            c = Candidate({"percent": q, "cpu_attention": r.cpu_attention, **extra}, wl, r.seconds_per_token)
            if not fp.fits(model, cap, wl, flexgen_schedule(model, FlexGenSettings(**c.settings)).placement()):
                unfit.append(c)  # listed last: the search screens a few, and these give its reasons if none fits
            elif more_on_disk(q, q0):
                spilled.append(c)  # after those whose LP time still holds (see ``more_on_disk``)
            else:
                yield c
    yield from spilled + unfit


def more_on_disk(fitted: tuple, lp: tuple) -> bool:
    """Whether the exact fit put weights or KV on disk that the LP's placement kept off it. The LP's time per token
    is for its own placement; such a candidate's is optimistic, often by a lot (the disk is the slowest tier), so
    the candidate generators rank it after every candidate whose LP time still holds: the search screens only the
    first few (Llama-2-70B under flexgen-ref at 64 GiB: the LP's six best all spilled weights to disk, 7.2 total
    tok/s against 41.1 at 48 GiB, before 2026-12-04)."""
    return 100 - fitted[0] - fitted[1] > 100 - lp[0] - lp[1] or 100 - fitted[2] - fitted[3] > 100 - lp[2] - lp[3]


def spill_host_to_disk(p: tuple, host_over) -> tuple:
    """``percent`` with host-homed weights, then host-homed KV, moved to disk one point at a time while
    ``host_over(p)`` (the placement's host bytes exceed host memory); unchanged when nothing is left to move."""
    while host_over(p):
        wg, wc, cg, cc = p[:4]
        if wc > 0:
            p = (wg, wc - 1, cg, cc) + p[4:]
        elif cc > 0:
            p = (wg, wc, cg, cc - 1) + p[4:]
        else:
            break
    return p


def fit_placement(model: ModelSpec, hw: HardwareSpec, wl: Workload, percent: tuple, cpu_attention: bool,
                  comp: Compression = NO_COMPRESSION) -> tuple:
    """``percent`` made to fit one GPU and its host by the footprint's exact arithmetic, where the LP's rounded
    optimum does not: the GPU share of the weights lowered until the GPU holds the placement (``fit_gpu_weights``:
    the points go to the host), then, while the host bytes exceed host memory, host-homed weights and then KV moved
    to disk (``spill_host_to_disk``) -- the LP's host row is affine too, and the GPU trim adds to the host. The same
    fit as a pipeline's stages get (``fit_stages``)."""
    cpu = capacity_of(hw)["cpu"]

    def host_bytes(p):
        st = FlexGenSettings(percent=p, cpu_attention=cpu_attention, **comp.settings())
        return sum(fp.placement_tier_bytes(model, wl, flexgen_schedule(model, st).placement())["cpu"].values())

    p = fit_gpu_weights(model, hw, wl, percent, cpu_attention, comp=comp)
    return spill_host_to_disk(p, lambda q: host_bytes(q) > cpu)


def fit_stages(model: ModelSpec, hw: HardwareSpec, wl: Workload, percent: tuple, cpu_attention: bool, pipe: dict,
               comp: Compression = NO_COMPRESSION) -> tuple:
    """``percent`` of a pipeline (``pipe``: its num_stages, stage_layers, micro_batches, gpus_per_node) made to fit
    by the exact arithmetic of ``check_stages_fit``, where the LP's rounded optimum does not: the GPU share of the
    weights lowered until every stage fits its GPU (``fit_gpu_weights``), then, while a node's stages' host bytes
    together exceed its host memory, host-homed weights, then host-homed KV, moved to disk one point at a time."""
    cap = capacity_of(hw)

    def schedule(p):
        return flexgen_schedule(model, FlexGenSettings(percent=p, cpu_attention=cpu_attention, **pipe,
                                                       **comp.settings()), wl)

    p = fit_gpu_weights(model, hw, wl, percent, cpu_attention, comp=comp,
                        fits=lambda q: stages_fit_gpus(model, wl, schedule(q), cap["gpu"]))
    return spill_host_to_disk(p, lambda q: max(node_host_bytes(model, wl, schedule(q), "cpu")) > cap["cpu"])


def stage_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, num_stages: int,
                     batch: int | None = None, compression: Compression = NO_COMPRESSION,
                     gpus_per_node: int = 0, key_mask: bool = False,
                     max_batch: int | None = None) -> Iterable[Candidate]:
    """Pipeline candidates over ``num_stages`` GPUs, each with ``hw``'s GPU budget: the LP optimum of every block
    shape and stage split (``lp.flexgen_stage_candidates``: balanced, and the last stage's layers moved for the best
    block shapes), best LP time first, each with its layers per stage and micro-batch groups in its settings and its
    GPU weight share trimmed until every stage fits its GPU (``schedule.stages_fit_gpus``), and with the activations
    on the other tier. One candidate per block shape and CPU attention (the best of its micro-batch counts and
    splits), so that the few the search screens are different blocks; one on an unbalanced split is followed by
    the balanced one of the same block and micro-batches, so that the search screens both. Candidates that still do
    not fit (``check_stages_fit``) come after all the others: they give the search its reasons when none fits.
    ``gpus_per_node`` (0: one host): the stages' nodes, each with ``hw``'s host memory and disk (the LP's and the
    fit's host rows are per node), recorded in every candidate. ``key_mask``, ``max_batch``: as ``candidates``."""
    extra = compression.settings() if compression.any else {}
    rs = flexgen_stage_candidates(model, hw, prompt_len, gen_len, num_stages, batch=batch, comp=compression,
                                  gpus_per_node=gpus_per_node)
    rs = [r for r in rs if max_batch is None or r.gpu_batch_size * r.num_gpu_batches <= max_batch]
    balanced, even = {}, stage_splits(model.num_layers, num_stages)[0]
    for r in rs:
        if r.stage_layers == even:
            balanced.setdefault((r.gpu_batch_size, r.num_gpu_batches, r.cpu_attention, r.micro_batches), r)
    done = set()

    def emit(r):
        key = (r.gpu_batch_size, r.num_gpu_batches, r.cpu_attention, r.micro_batches, r.stage_layers)
        if key in done:
            return
        done.add(key)
        wl = Workload(prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches, reserve_key_mask=key_mask)
        pipe = {"num_stages": num_stages, "stage_layers": r.stage_layers, "micro_batches": r.micro_batches,
                **({"gpus_per_node": gpus_per_node} if gpus_per_node else {})}
        p = r.percent
        for q in (p, p[:4] + (p[5], p[4])):
            q = fit_stages(model, hw, wl, q, r.cpu_attention, pipe, compression)
            yield Candidate({"percent": q, "cpu_attention": r.cpu_attention, **extra, **pipe}, wl,
                            r.seconds_per_token)

    blocks, unfit = set(), []
    for r in rs:
        if (r.gpu_batch_size, r.num_gpu_batches, r.cpu_attention) in blocks:
            continue
        blocks.add((r.gpu_batch_size, r.num_gpu_batches, r.cpu_attention))
        b = balanced.get((r.gpu_batch_size, r.num_gpu_batches, r.cpu_attention, r.micro_batches))
        for c in list(emit(r)) + (list(emit(b)) if b is not None else []):
            try:
                check_stages_fit(model, c.workload, flexgen_schedule(model, FlexGenSettings(**c.settings), c.workload),
                                 capacity_of(hw))
            except OffsimError:
                unfit.append(c)  # listed last: the search's reasons when nothing fits
                continue
            yield c
    yield from unfit


FLEXGEN = Policy("flexgen", FlexGenSettings, flexgen_plan, candidates,
                 "FlexGen: zig-zag block schedule, LP placement of weights/KV/activations, optional CPU attention",
                 lambda m, hw, wl, st: flexgen_schedule(m, st).placement(),
                 before_inputs={"sublayer": False}, ranks_compression=True, check_stages=check_flexgen_stages)
