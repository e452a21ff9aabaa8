"""The block schedule that the static and FlexGen policies share: a description of placement and pipelining
(``Schedule``) turned into a Plan (``build_block_plan``).

FlexGen's zig-zag block schedule (FlexGen, ICML'23, §4.1, Alg. 1): for step i, layer j, batch k -- load the
weights of the next layer, load the cache of batch k+1, store the cache of batch k-1, compute batch k. Here the
"layers" of a step are [embedding (-1), decoder layers 0..L-1, LM head (L)], as in FlexGen's own layer list; the
embedding and the head keep their weights on the GPU. With one GPU batch and prefetching this is ZeRO-Inference's
layer-by-layer streaming; without prefetching and with pageable memory it is Accelerate's synchronous offload.

Units of streamed weights: whole decoder layers, or (``Schedule.sublayer``, FlexGen's granularity: its layer list
has a layer's attention and MLP as two layers) each layer's attention and its MLP, computed as separate ops
(``attn_layer`` / ``mlp``; with CPU attention ``pre_attn``, the CPU's ``attn``, ``attn_out``, then ``mlp``).

Buffers (what bounds GPU memory): streamed weights are double-buffered when prefetching (the load of a unit waits
until the unit loaded two loads earlier has run its last batch), single-buffered otherwise; loaded KV is
double-buffered across attention positions (a load, or a prefill compute that makes its buffer, takes the one the
KV stores of the attention position two back gave up, as offexec's pool hands it out); KV stored to disk
is double-buffered on the GPU and in host staging (``DiskStoreBuffers``).

Memory of the ops (sizes from ``offsim.core.footprint``, as offexec holds them): the first load of a streamed
layer allocates its whole weight slot (the streamed bytes plus the straddling tensor's resident head), the compute
that last uses it frees the slot; a position's KV of off-GPU heads lives in one full-length work buffer per head
group, allocated by its load (or, with nothing to load, by its compute) and freed by its store (or its compute); a
compute allocates and frees its op peak (``footprint.op_peak_bytes``), its output included -- the block's
activations between layers are resident -- and with activations parked on the host the hidden copy loaded for a
compute counts from its load to the end of the compute that consumes it, and at most ``fp.LANDING_BUFFERS`` such
copies are in flight (``LandingBuffers``: a load waits for the consumer of the load that many back, as offexec's
landing pool hands its buffers out). (Not modelled: a parked output waiting on the GPU for its d2h.)
"""
from __future__ import annotations

import functools

import dataclasses
from dataclasses import dataclass

from offsim.core import footprint as fp
from offsim.core.errors import OffsimError
from offsim.core.plan import Plan, PlanBuilder
from offsim.core.specs import NO_COMPRESSION, Compression, ModelSpec, Workload, check_positions


@dataclass(frozen=True)
class Schedule:
    """Everything the block-schedule generator needs; policies fill it in."""

    policy: str
    weight_split: tuple[tuple[int, int], ...]  # per layer: bytes (gpu, cpu) of its flat weights; the rest on disk
    kv_split: tuple[int, int]  # KV heads on (gpu, cpu); the rest on disk
    hidden_home: str = "gpu"  # 'gpu' or 'cpu': where activations wait between layers
    prefetch: bool = True  # load layer j+1's weights while layer j computes
    overlap: bool = True  # False: every op waits for the one issued before it
    cpu_attention: bool = False  # decode attention on the CPU over the host KV cache
    pinned: bool = True  # host buffers pinned (False: pageable copies)
    settings: tuple = ()  # (key, value) pairs: the policy's inputs, recorded in the plan
    derived: tuple = ()  # (key, value) pairs: what the policy chose from them (e.g. Accelerate's GPU layers)
    sublayer: bool = False  # stream weights per sub-layer (attention, MLP) as FlexGen's code does; needs prefetch
    compression: Compression = NO_COMPRESSION  # 4-bit weights / KV and sparse attention (FlexGen's approximations)
    # pipeline parallelism (FlexGen's multi-GPU mode; docs/architecture.md §2.1): the decoder layers [lo, hi) of
    # each stage, one GPU per stage in order (the first also runs the embedding, the last the LM head); () = one GPU.
    # ``micro_batches``: the block's GPU batches in that many contiguous groups that flow through the stages one
    # after another (FlexGen's inner iterations), so that stage s works on group t while stage s+1 works on t-1
    stages: tuple[tuple[int, int], ...] = ()
    micro_batches: int = 1
    # the pipeline's nodes (FlexGen's multi-node runs, e.g. 4 nodes x 1 GPU): stage d on node d // gpus_per_node,
    # each node a host of its own (``hw``'s host memory, disk, CPU and links); 0: every stage on one host
    gpus_per_node: int = 0
    # --- how a system's implementation executes the schedule (the ``*-ref`` policies; the defaults are the ideal
    # executor of the schedule, every earlier plan's). ``kv_pinned``: host-homed KV copies from pinned memory (None:
    # as ``pinned``; False: pageable, priced at the profile's pageable rates -- FlexGen allocates its CPU cache with
    # pin_memory=False). ``sync_positions``: a barrier after every (step, layer, batch) position -- FlexGen's
    # ``sync()`` (torch.cuda.synchronize) at the end of each iteration of its loop: no op of a position starts
    # before every op issued in the previous one has ended, except the KV and hidden-state stores, which FlexGen
    # issues one position later (store_cache(k-1), store_hidden(k-1)) and so must end by the next barrier but one.
    # ``weight_copies``: 'unit' (one copy per streamed unit and tier) or 'tensor' (one copy per weight tensor, each
    # paying the link's per-copy latency: Accelerate's per-module hooks, DeepSpeed's per-parameter fetches).
    # ``prefetch_from_step``: prefetch only from this generation step on (DeepSpeed prefetches once its module trace
    # is complete, after the first forward)
    kv_pinned: bool | None = None
    sync_positions: bool = False
    weight_copies: str = "unit"
    prefetch_from_step: int = 0
    weight_gather_copies: int = 0  # device copies after each weight copy (``Plan.weight_gather_copies``)
    cpu_attention_impl: str = ""  # whose CPU attention path runs the cpu_compute ops (``Plan.cpu_attention_impl``)
    pageable_copy: str = ""  # how unpinned copies move (``Plan.pageable_copy``)
    quant_impl: str = ""  # whose code runs the dequantize passes (``Plan.quant_impl``)
    issue_waits_for_deps: bool = False  # the issuer waits for each op's dependencies (``Plan.issue_waits_for_deps``)
    # FlexGen's own placement of whole tensors (``flexgen-ref``): ((unit, n_disk, n_cpu), ...) for each of its layers
    # (``footprint.FLEXGEN_UNITS``: the embedding, a decoder layer's attention and MLP -- the same in every layer --
    # and the head), the first n_disk tensors of the unit on disk, the next n_cpu in host memory, the rest on the GPU
    # (``footprint.flexgen_unit_cuts``). Set, it replaces ``weight_split``'s flat prefix in what each unit streams
    # (``weight_split`` then holds each layer's totals), and the embedding and the head stream like the decoder's
    # units where they are off the GPU; () = the flat prefix, the embedding and head resident (every other policy)
    unit_homes: tuple = ()
    # (``flexgen-ref``, with ``cpu_attention_impl`` 'flexgen') the decode CPU-attention op is the whole attention
    # sub-layer -- FlexGen's load_cache + mha_gen: norm, QKV, the small copies, the attention, the output projection
    # and residual -- priced by one profile row (``costmodel.cpu_attention_row_holds_sublayer``): no separate
    # pre_attn / qkv / attn_out ops (their time is in the row). Needs ``cpu_attention`` and a cache homed in host
    # memory only (the row timed ``load_cache`` from a CPU home)
    cpu_attention_sublayer: bool = False
    # (``flexgen-ref``) FlexGen's store_cache of a decode token's K and V into a host-homed cache with CPU attention:
    # two pageable D2H copies of [B, heads x head_dim] (the plain path of its ``general_copy``: one position, no
    # relay), on its main thread after the next position's compute (``store_cache(k-1)``), blocking it; none for
    # the last token (FlexGen does not store it)
    kv_token_stores: bool = False

    def stage_nodes(self) -> list[int]:
        """The node of each stage (``stage_nodes``)."""
        return stage_nodes(max(1, len(self.stages)), self.gpus_per_node)

    def placement(self) -> fp.Placement:
        """What this schedule puts where, for the footprint (``offsim.core.footprint``)."""
        return fp.Placement(weight_split=tuple(self.weight_split), kv_split=tuple(self.kv_split),
                            hidden_home=self.hidden_home, weight_buffers=2 if self.prefetch else 1,
                            cpu_attention=self.cpu_attention, sublayer=self.sublayer,
                            compression=self.compression, unit_homes=tuple(self.unit_homes))


def resident_bytes(model: ModelSpec, wl: Workload, s: Schedule) -> dict[str, int]:
    """Bytes held for the whole run on each tier (``footprint.resident_bytes`` of the schedule's placement; with
    stages, the sums over the stages' own: ``stage_resident_bytes``)."""
    if len(s.stages) > 1:
        per = stage_resident_bytes(model, wl, s)
        return {t: sum(r[t] for r in per) for t in ("gpu", "cpu", "disk")}
    return fp.resident_bytes(model, wl, s.placement())


def stage_resident_bytes(model: ModelSpec, wl: Workload, s: Schedule) -> list[dict[str, int]]:
    """``footprint.resident_bytes`` of each stage of ``s`` (its own layers; the embeddings on every stage)."""
    return [fp.resident_bytes(m, wl, pl) for m, pl in stage_placements(model, s)]


def layer_devices(stages: tuple, num_layers: int) -> dict[int, int]:
    """Each layer's GPU in a pipeline of ``stages`` ([lo, hi) per stage): stage d's decoder layers on GPU d, the
    embedding (-1) on the first, the head (``num_layers``) on the last."""
    dev_of = {-1: 0, num_layers: len(stages) - 1}
    for d, (lo, hi) in enumerate(stages):
        for j in range(lo, hi):
            dev_of[j] = d
    return dev_of


def micro_batch_groups(num_gpu_batches: int, groups: int) -> list[range]:
    """The block's GPU batches in ``groups`` contiguous micro-batch groups that flow through a pipeline's stages
    together (the first ones smaller where they do not divide evenly)."""
    nb = num_gpu_batches
    return [range(t * nb // groups, (t + 1) * nb // groups) for t in range(groups)]


def check_gpus_per_node(num_stages: int, gpus_per_node: int) -> None:
    """A pipeline's node size: 0 (one host) or a positive divisor of ``num_stages`` (every node as many GPUs)."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 0 \
            or (gpus_per_node and num_stages % gpus_per_node):
        valid = [g for g in range(1, num_stages + 1) if num_stages % g == 0]
        raise OffsimError(f"gpus_per_node must divide the {num_stages} stages (GPUs) into equal nodes: one of "
                          f"{valid} (or 0: all on one host), got {gpus_per_node!r}")


def stage_nodes(num_stages: int, gpus_per_node: int) -> list[int]:
    """The node of each of ``num_stages`` stages: stage d on node d // ``gpus_per_node`` (0: all on node 0)."""
    check_gpus_per_node(num_stages, gpus_per_node)
    return [d // gpus_per_node if gpus_per_node else 0 for d in range(num_stages)]


def node_sums(values: list[int], nodes: list[int]) -> list[int]:
    """Per node, the sum of its stages' ``values`` (``nodes``: each stage's node, from ``stage_nodes``)."""
    out = [0] * (max(nodes) + 1)
    for v, n in zip(values, nodes):
        out[n] += v
    return out


def stage_model(model: ModelSpec, lo: int, hi: int) -> ModelSpec:
    """The model as one stage holds it: its decoder layers [lo, hi) (and, as offexec keeps them on every stage,
    the embeddings), so that the footprint's arithmetic of a whole model is a stage's."""
    return dataclasses.replace(model, num_layers=hi - lo)


def stage_placements(model: ModelSpec, s: Schedule) -> list[tuple[ModelSpec, fp.Placement]]:
    """(stage model, stage placement) of each stage of ``s``: what one GPU of a pipeline holds."""
    pl = s.placement()
    return [(stage_model(model, lo, hi), dataclasses.replace(pl, weight_split=tuple(pl.weight_split[lo:hi])))
            for lo, hi in s.stages]


def balanced_stages(num_layers: int, num_stages: int, layers: tuple = ()) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges of ``num_stages`` stages: ``layers`` (layers per stage, summing to ``num_layers``)
    when given, else balanced (the first ``num_layers % num_stages`` stages one layer more)."""
    if num_stages < 1:
        raise OffsimError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise OffsimError(f"num_stages {num_stages} exceeds the model's {num_layers} layers (a stage needs one)")
    if layers:
        layers = tuple(int(x) for x in layers)
        if len(layers) != num_stages or any(x < 1 for x in layers) or sum(layers) != num_layers:
            raise OffsimError(f"stage_layers {list(layers)} must be {num_stages} positive layer counts summing to "
                              f"the model's {num_layers} layers")
    else:
        q, r = divmod(num_layers, num_stages)
        layers = tuple(q + (1 if d < r else 0) for d in range(num_stages))
    out, at = [], 0
    for x in layers:
        out.append((at, at + x))
        at += x
    return tuple(out)


def stage_tier_bytes(model: ModelSpec, wl: Workload, s: Schedule) -> list[dict[str, dict[str, int]]]:
    """``footprint.placement_tier_bytes`` of each stage of ``s`` (its own layers; the embeddings on every stage, as
    offexec keeps them), with the sends in flight of every stage but the last (``footprint.p2p_send_bytes``)."""
    per = [fp.placement_tier_bytes(m, wl, pl) for m, pl in stage_placements(model, s)]
    for t in per[:-1]:  # every stage but the last sends its hidden states on (offexec.distributed's StageComm)
        t["gpu"]["p2p sends in flight"] = fp.p2p_send_bytes(model, wl)
    return per


def stages_fit_gpus(model: ModelSpec, wl: Workload, s: Schedule, gpu_capacity: int) -> bool:
    """Whether every stage of ``s`` fits one GPU of ``gpu_capacity`` bytes (the GPU half of ``check_stages_fit``)."""
    return all(sum(t["gpu"].values()) <= gpu_capacity for t in stage_tier_bytes(model, wl, s))


def node_host_bytes(model: ModelSpec, wl: Workload, s: Schedule, tier: str) -> list[int]:
    """Per node of ``s``, the host bytes (``tier`` 'cpu' or 'disk') its stages hold together: each node's host
    memory and disk are its own, shared by its stages."""
    return node_sums([sum(t[tier].values()) for t in stage_tier_bytes(model, wl, s)], s.stage_nodes())


def check_stages_fit(model: ModelSpec, wl: Workload, s: Schedule, capacity: dict[str, int],
                     what: str = "plan") -> None:
    """``footprint.check_fits`` for a pipeline: every stage's GPU against one GPU's budget, each node's host
    memory and disk against the sums over its stages (``capacity``'s are one host's; one node: every stage on one
    host, shared). One line (``PlanError``) naming the first short stage or node."""
    per = stage_tier_bytes(model, wl, s)
    nodes = s.stage_nodes()
    for d, t in enumerate(per):
        need, cap = sum(t["gpu"].values()), int(capacity.get("gpu", 0))
        if need > cap:
            parts = sorted(((v, k) for k, v in t["gpu"].items() if v), reverse=True)[:3]
            lo, hi = s.stages[d]
            raise fp.PlanError(f"{what}: stage {d} (layers {lo}-{hi - 1}) does not fit on its GPU: short by "
                               f"{fp.gib(need - cap)} (needs {fp.gib(need)}: "
                               f"{', '.join(f'{k} {fp.gib(v)}' for v, k in parts)}; capacity {fp.gib(cap)}); use "
                               "more stages, fewer or smaller GPU batches or place less on the GPU")
    for tier, name in (("cpu", "host memory"), ("disk", "disk")):
        cap = int(capacity.get(tier, 0))
        for n, need in enumerate(node_sums([sum(t[tier].values()) for t in per], nodes)):
            if need <= cap:
                continue
            if max(nodes) == 0:
                raise fp.PlanError(f"{what}: the {len(per)} stages do not fit: {name} (shared by all stages) short "
                                   f"by {fp.gib(need - cap)} (needs {fp.gib(need)}; capacity {fp.gib(cap)})")
            ds = [d for d, x in enumerate(nodes) if x == n]
            raise fp.PlanError(f"{what}: node {n} (stages {ds[0]}-{ds[-1]}) does not fit: its {name} (shared by its "
                               f"stages) short by {fp.gib(need - cap)} (needs {fp.gib(need)}; capacity "
                               f"{fp.gib(cap)})")


class DiskStoreBuffers:
    """Two GPU buffers and two host staging buffers for the KV that goes to disk. A new token's KV waits on the GPU
    until its d2h and in host memory until its disk write; a static plan has no back-pressure of its own, so
    without these dependencies compute runs ahead of a slow disk and the buffers grow without bound (a prefill that
    writes its KV to disk fills host memory). With them: the compute of a position waits for the d2h of the store
    ``depth`` stores back (its GPU buffer), that d2h for the disk write ``depth`` stores back (its staging)."""

    def __init__(self, depth: int = 2):
        self.depth = depth
        self.d2h: list[int] = []
        self.writes: list[int] = []

    def compute_deps(self) -> list[int]:
        return [self.d2h[-self.depth]] if len(self.d2h) >= self.depth else []

    def d2h_deps(self) -> list[int]:
        return [self.writes[-self.depth]] if len(self.writes) >= self.depth else []

    def record(self, d2h: int, write: int) -> None:
        self.d2h.append(d2h)
        self.writes.append(write)


class LandingBuffers:
    """The GPU buffers that activations parked on the host are loaded back into (``fp.LANDING_BUFFERS``). Without a
    bound a layer's loads of every batch run ahead of its computes (each waits only for its own store from the layer
    before) and hold a whole hidden state each; with it, a load waits for the compute that consumed the load
    ``depth`` loads back (the one that frees the buffer it reuses), so the next batch's load overlaps the current
    batch's compute."""

    def __init__(self, depth: int = fp.LANDING_BUFFERS):
        self.depth = depth
        self.consumers: list[int] = []

    def load_deps(self) -> list[int]:
        return [self.consumers[-self.depth]] if len(self.consumers) >= self.depth else []

    def record(self, consumer: int) -> None:
        self.consumers.append(consumer)


_PART_OF_SUB = {None: "layer", "attn": "attn_layer", "mlp": "mlp"}  # a decoder position's compute part


def _is_store(ops, i: int) -> bool:
    """Whether op ``i`` of a plan being built is a store (a KV or hidden-state copy to the host, or a KV write to
    disk): what FlexGen issues one position after the compute that made it (``Schedule.sync_positions``)."""
    rows = ops.rows
    if rows is not None:
        kind, kw = rows[i][0], rows[i][6]
        tensor = kw.get("tensor", "")
    else:
        kind, tensor = ops[i].kind, ops[i].tensor
    return (kind == "d2h" and tensor in ("kv", "hidden")) or (kind == "disk_write" and tensor == "kv")


def build_block_plan(model: ModelSpec, wl: Workload, s: Schedule, capacity: dict[str, int]) -> Plan:
    """Emit the ops of one block (``num_gpu_batches`` × ``gpu_batch_size`` prompts, all generation steps). Each GPU
    batch runs at its own prompt length, padded to its longest prompt (``Workload.batch_prompt_lens``; all
    ``prompt_len`` for a uniform workload); buffers are sized for the block's longest (``wl.max_len``)."""
    L, nb, gbs = model.num_layers, wl.num_gpu_batches, wl.gpu_batch_size
    W = model.layer_weight_bytes()
    n_kv = model.num_kv_heads
    kg, kc = s.kv_split
    kd = n_kv - kg - kc
    if s.cpu_attention and kg:
        raise OffsimError("CPU attention needs the KV cache off the GPU: the GPU share of the cache must be 0 %")
    compression = s.compression  # (not ``comp``: that name is the compute op's id below)
    compression.check_cpu_attention(s.cpu_attention)
    if s.sublayer and not s.prefetch:
        raise OffsimError("sub-layer weight streaming double-buffers the attention and MLP slots: it needs prefetch")
    check_positions(model, wl)
    if s.weight_copies not in ("unit", "tensor"):
        raise OffsimError(f"weight_copies must be 'unit' or 'tensor', got {s.weight_copies!r}")
    if s.sync_positions and len(s.stages) > 1:
        raise OffsimError("a barrier after every position (sync_positions) is a single-GPU schedule: use one stage")
    if s.unit_homes and (s.weight_copies != "unit" or len(s.stages) > 1):
        raise OffsimError("FlexGen's placement of whole tensors (unit_homes) is a single-GPU schedule of one copy per "
                          "streamed range: use one stage and weight_copies 'unit'")
    if s.cpu_attention_sublayer and not (s.cpu_attention and kd == 0):
        raise OffsimError("the CPU attention sub-layer op (cpu_attention_sublayer) needs CPU attention over a cache "
                          "homed in host memory (no KV on disk)")
    b = PlanBuilder(serial=not s.overlap)
    add = b.add
    pinned = s.pinned
    kv_pinned = pinned if s.kv_pinned is None else s.kv_pinned
    if s.sync_positions:
        # FlexGen's sync() between positions: every op of a position waits for the ops of the previous position
        # (``barrier``) and for the stores issued two positions back (``deferred``); see ``Schedule``
        barrier: list[int] = []
        deferred: list[int] = []
        plain_add_sync = add

        def add(kind, deps, phase, step, layer, batch, **kw):  # noqa: F811
            if barrier:
                deps = [*deps, *barrier]
            return plain_add_sync(kind, deps, phase, step, layer, batch, **kw)

    # pipeline parallelism: stage d on GPU d runs its decoder layers (stage 0 also the embedding, the last the head);
    # the block's GPU batches flow through the stages in ``micro_batches`` contiguous groups. One stage and one group:
    # exactly the single-GPU schedule (the same ops in the same order, with no device field)
    stages = tuple(tuple(x) for x in s.stages) or ((0, L),)
    S = len(stages)
    multi = S > 1
    G = s.micro_batches
    if not 1 <= G <= nb:
        raise OffsimError(f"micro_batches must be in [1, num_gpu_batches = {nb}], got {G}")
    if stages[0][0] != 0 or stages[-1][1] != L or any(a[1] != b_[0] or a[1] <= a[0]
                                                      for a, b_ in zip(stages, stages[1:])):
        raise OffsimError(f"stages {[list(x) for x in stages]} must tile the layers [0, {L}) in order")
    dev_of = layer_devices(stages, L)  # layer -> its stage's GPU
    groups = micro_batch_groups(nb, G)
    group_of = {k: t for t, g in enumerate(groups) for k in g}
    if multi:
        cur_dev = [0]  # the GPU the ops being emitted run on (p2p ops name theirs)
        plain_add = add

        def add(kind, deps, phase, step, layer, batch, **kw):  # noqa: F811  (every op of a pipeline: its device)
            kw.setdefault("device", cur_dev[0])
            return plain_add(kind, deps, phase, step, layer, batch, **kw)

    if multi or s.sync_positions:  # (ops with a device or a barrier: each through ``add`` above, with its own fields)
        def add_row(kind, deps, phase, step, layer, batch, fields):
            return add(kind, deps, phase, step, layer, batch, **fields)
    else:  # ops that share their fields dicts (``compute_fields`` and ``copy_fields`` below)
        add_row = b.add_row

    # sizes by shape (offsim.core.footprint), memoized for this build: a block asks the same few shapes ~10^5 times;
    # every stored KV or weight byte is its stored size (4-bit with compression)
    @functools.cache
    def kv_bytes(heads: int, tokens: int) -> int:
        return fp.stored_kv_bytes(model, gbs, tokens, heads, comp=compression)

    @functools.cache
    def kv_load(heads: int, tokens: int) -> int:  # a KV h2d for GPU attention: the stored KV (sparse too)
        return fp.kv_load_bytes(model, gbs, tokens, heads, compression)

    @functools.cache
    def w_bytes(lo: int, hi: int) -> int:
        return fp.stored_weight_bytes(model, lo, hi, compression)

    # the fp16 copies a decoder compute dequantizes into, beside the packed storage, while it runs
    dq = fp.dequantized_copy_bytes(model, gbs, wl.max_len, compression, s.sublayer) + \
        fp.sparse_attention_bytes(model, gbs, wl.max_len, compression)  # (and sparse attention's temporaries)

    @functools.cache
    def op_peak(part: str, q: int, ctx: int) -> int:
        return fp.op_peak_bytes(model, part, gbs, q, ctx, kv_groups, masked=wl.key_masked)

    @functools.cache
    def act_bytes(what: str, q: int) -> int:  # 'hidden', 'qkv' or 'attn_out' of the block's gbs sequences
        return {"hidden": fp.hidden_bytes, "qkv": fp.qkv_bytes, "attn_out": fp.attn_out_bytes}[what](model, gbs, q)

    # the fields of the block's ops (those emitted through ``add_row``), one dict per shape, shared by the ops of that
    # shape: a block has ~10^5 ops of a few hundred shapes, and a dict made and kept per op was a third of the build.
    # None: the field left out (as ``add`` would have it). (Arguments are compared by value, as any cache's: each
    # call site passes its own types, and no two sites can pass equal arguments of different types)
    @functools.cache
    def compute_fields(part: str, q: int, ctx: int, frees_weights, alloc, free) -> dict:
        f = {"part": part, "num_seqs": gbs, "q_tokens": q, "ctx_tokens": ctx}
        if frees_weights is not None:
            f["frees_weights"] = frees_weights
        if alloc is not None:
            f["alloc"] = alloc
        if free is not None:
            f["free"] = free
        return f

    @functools.cache
    def gpu_compute_fields(part: str, q: int, ctx: int, frees_weights, alloc_gpu, free_gpu) -> dict:
        """``compute_fields`` of a compute whose memory is GPU bytes alone, ``alloc_gpu`` and ``free_gpu`` (None: the
        field left out) -- every compute but the CPU's attention. (Its own cache: ints make a cheaper key than two
        tuples, and every position makes such a compute)"""
        return compute_fields(part, q, ctx, frees_weights, None if alloc_gpu is None else (alloc_gpu, 0, 0),
                              None if free_gpu is None else (free_gpu, 0, 0))

    @functools.cache
    def copy_fields(tensor: str, lo: int, hi: int, heads, nbytes: int, pinned, alloc, free) -> dict:
        f = {"tensor": tensor, "lo": lo, "hi": hi}
        if heads is not None:
            f["head_lo"], f["head_hi"] = heads
        f["nbytes"] = nbytes
        if pinned is not None:
            f["pinned"] = pinned
        if alloc is not None:
            f["alloc"] = alloc
        if free is not None:
            f["free"] = free
        return f

    @functools.cache
    def hidden_copy_fields(q: int, ctx: int, load: bool) -> dict:
        """The fields of a copy of the hidden states of the new positions [ctx - q, ctx) between the GPU and their
        home in host memory: a load allocates the GPU copy it lands in (freed by the compute that consumes it), a
        store nothing. (Its own cache: two or three small ints make a cheaper key than ``copy_fields``' eight, for
        two ops of every position)"""
        hb = act_bytes("hidden", q)
        return copy_fields("hidden", ctx - q, ctx, None, hb, pinned, (hb, 0, 0) if load else None, None)

    @functools.cache
    def work_bytes(part: str, cpu_attn: bool, q: int, ctx: int) -> int:
        """GPU bytes a position's compute holds while it runs (``part``: its compute part; ``cpu_attn``: attention
        delegated to the CPU): the op's peak (``footprint.op_peak_bytes``), and on a decoder layer the fp16 copies
        it dequantizes into (``dq``)."""
        if cpu_attn and part == "attn_layer":  # pre_attn to attn_out: both halves' peaks, held across the CPU's work
            ws = max(op_peak("cpu_attn_pre", q, ctx), op_peak("attn_out", q, ctx))
        else:
            ws = op_peak("cpu_attn_layer" if cpu_attn else part, q, ctx)
        return ws if part in ("embed", "head") else ws + dq

    @functools.cache
    def cpu_delegation_fields(q: int, ctx: int) -> tuple[dict | None, dict, dict, dict, dict | None]:
        """The fields of the ops of FlexGen's CPU delegation (below) whose shape follows from the positions alone,
        for q new tokens at context ctx: (the read of a disk-homed cache's prefix into host memory, the QKV's d2h,
        the CPU's attention -- holding that prefix in host memory while it runs --, its output's h2d, the new
        tokens' KV write to disk); the disk ops None without a disk-homed cache. (One cached call for the five: a
        decode attention position with CPU attention makes them all)"""
        read = write = None
        disk_staged = 0
        if kd:
            disk_staged = nbytes = kv_bytes(kd, ctx - q)
            read = copy_fields("kv", 0, ctx - q, (kc, n_kv), nbytes, None, (0, nbytes, 0), None)
            write = copy_fields("kv", ctx - q, ctx, (kc, n_kv), kv_bytes(kd, q), None, None, None)
        qkv = copy_fields("qkv", ctx - q, ctx, None, act_bytes("qkv", q), pinned, None, None)
        attn = compute_fields("attn", q, ctx, None, None, (0, disk_staged, 0))
        out = copy_fields("attn_out", ctx - q, ctx, None, act_bytes("attn_out", q), pinned, None, None)
        return read, qkv, attn, out, write

    @functools.cache
    def kv_load_fields(ctx_prev: int) -> tuple[dict | None, dict | None, dict | None]:
        """The fields of a position's KV loads for GPU attention (``emit_kv_loads``) of the prefix [0, ctx_prev):
        (the host-homed heads' h2d, the disk-homed heads' read into host staging, their h2d), None where the cache
        has no heads on that tier. Each h2d allocates its group's full-length work buffer on the GPU (its store
        frees it). (One cached call for the three)"""
        host = read = disk = None
        if kc:
            host = copy_fields("kv", 0, ctx_prev, (kg, kg + kc), kv_load(kc, ctx_prev), kv_pinned, (buf_c, 0, 0), None)
        if kd:
            nbytes = kv_bytes(kd, ctx_prev)
            read = copy_fields("kv", 0, ctx_prev, (kg + kc, n_kv), nbytes, None, (0, nbytes, 0), None)
            disk = copy_fields("kv", 0, ctx_prev, (kg + kc, n_kv), kv_load(kd, ctx_prev), pinned, (buf_d, 0, 0),
                               (0, nbytes, 0))
        return host, read, disk

    @functools.cache
    def kv_store_fields(q: int, ctx: int) -> tuple[dict | None, dict | None, dict | None]:
        """The fields of a position's stores of its new tokens' KV [ctx - q, ctx) (GPU attention): (the host-homed
        heads' d2h, the disk-homed heads' d2h into host staging, their write to disk), None where the cache has no
        heads on that tier. Each d2h is the last user of its group's work buffer and frees it. (One cached call
        for the three)"""
        host = d2h = write = None
        if kc:
            host = copy_fields("kv", ctx - q, ctx, (kg, kg + kc), kv_bytes(kc, q), kv_pinned, None, (buf_c, 0, 0))
        if kd:
            nbytes = kv_bytes(kd, q)
            d2h = copy_fields("kv", ctx - q, ctx, (kg + kc, n_kv), nbytes, pinned, (0, nbytes, 0), (buf_d, 0, 0))
            write = copy_fields("kv", ctx - q, ctx, (kg + kc, n_kv), nbytes, None, None, (0, nbytes, 0))
        return host, d2h, write

    # a position's KV work buffer of each off-GPU head group, full length (as offexec allocates it)
    buf_c, buf_d = kv_bytes(kc, wl.max_len), kv_bytes(kd, wl.max_len)
    kv_groups = sum(1 for h in (kg, kc, kd) if h)

    # --- streamed weights: instances (step, layer, sub-layer) in execution order, loaded ahead by the cursor ----
    # a unit is a whole layer (sub None) or, with FlexGen's granularity, its attention or its MLP
    subs = fp.SUBLAYERS if s.sublayer else (None,)
    unit_range = dict(fp.sublayer_ranges_bytes(model)) if s.sublayer else {}
    unit_range[None] = (0, W)

    # FlexGen's own placement (``Schedule.unit_homes``, flexgen-ref): each of its layers streams its host- and
    # disk-homed tensors, whole (no straddling head), the embedding (layer -1) and the head (layer L) too
    homes = {u: (nd, nc) for u, nd, nc in s.unit_homes}

    def home_name(j: int, sub) -> str:  # the FlexGen layer of unit (j, sub) (sub None: the decoder layer's two)
        return "embed" if j < 0 else "head" if j >= L else sub

    @functools.cache
    def home_ranges(j: int, sub) -> tuple[list, list]:
        """(host, disk) fp16 byte ranges that unit (j, sub) streams, by FlexGen's placement (``unit_homes``)."""
        host, disk = [], []
        for u in (fp.SUBLAYERS if 0 <= j < L and sub is None else (home_name(j, sub),)):
            lo, d_end, c_end, _ = fp.flexgen_unit_cuts(model, u, *homes[u])
            host += [(d_end, c_end)] if c_end > d_end else []
            disk += [(lo, d_end)] if d_end > lo else []
        return host, disk

    @functools.cache
    def home_bytes(j: int, lo: int, hi: int) -> int:  # stored bytes of [lo, hi) of unit j's tensors
        return w_bytes(lo, hi) if 0 <= j < L else fp.flexgen_unit_stored_bytes(model, home_name(j, None), lo, hi,
                                                                               compression)

    @functools.cache
    def unit_slot(j: int, sub) -> int:
        if homes:
            return sum(home_bytes(j, lo, hi) for r in home_ranges(j, sub) for lo, hi in r)
        return fp.stored_slot_bytes(model, s.weight_split[j][0], sub, compression)

    @functools.cache
    def unit_straddle(j: int, sub) -> int:  # the slot beyond its streamed bytes: the straddling tensor's head
        g = s.weight_split[j][0]
        return unit_slot(j, sub) - w_bytes(max(g, unit_range[sub][0]), unit_range[sub][1])

    if homes:  # in a step's order: the embedding, the decoder's units, the head (FlexGen's layer list)
        streamed = [(j, sub) for j in range(-1, L + 1) for sub in (subs if 0 <= j < L else (None,))
                    if unit_slot(j, sub)]
    else:
        streamed = [(j, sub) for j in range(L) for sub in subs if s.weight_split[j][0] < unit_range[sub][1]]
    # per GPU, its streamed units in execution order: one instance per (step, group, layer, sub-layer) -- a stage
    # streams its layers once per micro-batch group, as FlexGen's pipeline does -- loaded ahead by its own cursor and
    # buffered in its own slots; instance keys are (device, index)
    instances = [[(i, t, j, sub) for i in range(wl.gen_len) for t in range(G) for j, sub in streamed
                  if dev_of[j] == d] for d in range(S)]
    inst_index = {key: (d, u) for d in range(S) for u, key in enumerate(instances[d])}
    loaded: dict[tuple, list[int]] = {}  # instance -> ids of its h2d ops
    free_op: dict[tuple, int] = {}  # instance -> id of the last compute that used it
    cursor = [0] * S

    def issue_weight_load(d: int, u: int) -> None:
        i, _, j, sub = instances[d][u]
        if multi:
            cur_dev[0] = d
        back = 2 if s.prefetch else 1  # double or single buffering of streamed weights (units)
        dep = free_op.get((d, u - back))
        phase = "prefill" if i == 0 else "decode"
        ids = []
        if homes:
            # FlexGen's load_weight of one of its layers (flex_opt.py ``SelfAttention.load_weight`` etc.: a
            # ``smart_copy`` of each weight tensor not already on the GPU): its host-homed tensors (one copy per
            # contiguous range: the copies are back to back on its load stream), then its disk-homed ones through
            # host staging; each copy allocates its own bytes of the layer's GPU buffer
            host, disk = home_ranges(j, sub)
            for lo, hi in host:
                n = home_bytes(j, lo, hi)
                ids.append(add_row("h2d", [dep], phase, i, j, 0, copy_fields("weight", lo, hi, None, n, pinned,
                                                                             (n, 0, 0), None)))
            for lo, hi in disk:
                n = home_bytes(j, lo, hi)
                rd = add_row("disk_read", [dep], phase, i, j, 0, copy_fields("weight", lo, hi, None, n, None,
                                                                             (0, n, 0), None))
                ids.append(add_row("h2d", [rd], phase, i, j, 0, copy_fields("weight", lo, hi, None, n, pinned,
                                                                            (n, 0, 0), (0, n, 0))))
            loaded[(d, u)] = ids
            return
        g, c = s.weight_split[j]
        u_lo, u_hi = unit_range[sub]
        straddle = unit_straddle(j, sub)  # the slot's first load takes the whole slot
        h_lo, h_hi = max(g, u_lo), min(g + c, u_hi)  # the unit's host-homed bytes
        d_lo = max(g + c, u_lo)  # ... and its disk-homed bytes [d_lo, u_hi)
        if per_tensor:
            # one copy per weight tensor (each with its own per-copy latency), in buffer order; the unit's first
            # copy allocates its whole slot on the GPU, as the single copy does
            first = True
            for lo, hi in tensor_pieces(h_lo, h_hi):
                n = w_bytes(lo, hi)
                ids.append(add("h2d", [dep], phase, i, j, 0, tensor="weight", lo=lo, hi=hi, nbytes=n, pinned=pinned,
                               alloc=((w_bytes(h_lo, h_hi) + straddle) if first else 0, 0, 0)))
                first = False
            for lo, hi in tensor_pieces(d_lo, u_hi):
                n = w_bytes(lo, hi)
                # without prefetch the copies are synchronous, one tensor at a time (Accelerate's hooks read a
                # tensor of the offload folder and copy it before the next): each read waits for the last copy
                rd = add("disk_read", [dep] + (ids[-1:] if not s.prefetch else []), phase, i, j, 0, tensor="weight",
                         lo=lo, hi=hi, nbytes=n, alloc=(0, n, 0))
                ids.append(add("h2d", [rd], phase, i, j, 0, tensor="weight", lo=lo, hi=hi, nbytes=n, pinned=pinned,
                               alloc=((w_bytes(d_lo, u_hi) + straddle) if first else 0, 0, 0), free=(0, n, 0)))
                first = False
            loaded[(d, u)] = ids
            return
        if h_hi > h_lo:
            n = w_bytes(h_lo, h_hi)
            ids.append(add_row("h2d", [dep], phase, i, j, 0, copy_fields("weight", h_lo, h_hi, None, n, pinned,
                                                                         (n + straddle, 0, 0), None)))
        if u_hi > d_lo:
            n = w_bytes(d_lo, u_hi)
            rd = add_row("disk_read", [dep], phase, i, j, 0, copy_fields("weight", d_lo, u_hi, None, n, None,
                                                                         (0, n, 0), None))
            ids.append(add_row("h2d", [rd], phase, i, j, 0,
                               copy_fields("weight", d_lo, u_hi, None, n, pinned,
                                           (n + (0 if h_hi > h_lo else straddle), 0, 0), (0, n, 0))))
        loaded[(d, u)] = ids

    per_tensor = s.weight_copies == "tensor"
    tensor_bounds = sorted({x for _, lo, hi in fp.weight_tensor_ranges_bytes(model) for x in (lo, hi)})

    def tensor_pieces(lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) cut at the weight tensors' boundaries (empty when hi <= lo)."""
        if hi <= lo:
            return []
        cuts = [lo] + [x for x in tensor_bounds if lo < x < hi] + [hi]
        return list(zip(cuts, cuts[1:]))

    def ensure_loaded(d: int, upto: int) -> None:
        while cursor[d] <= min(upto, len(instances[d]) - 1):
            issue_weight_load(d, cursor[d])
            cursor[d] += 1

    # --- per batch state --------------------------------------------------------------------------------------
    last_out: dict[int, int] = {}  # batch -> op that produced its current hidden (on GPU)
    hidden_store: dict[int, int] = {}  # batch -> d2h op that parked its hidden on the CPU
    kv_stored: dict[tuple[int, int], list[int]] = {}  # (layer, batch) -> ops that made the last KV durable
    disk_stores = [DiskStoreBuffers() for _ in range(S)]  # per GPU (and its rank's host staging)
    landings = [LandingBuffers() for _ in range(S)]  # per GPU
    last_dev: dict[int, int] = {}  # batch -> the GPU that holds its current hidden state (or token ids)

    # positions (step, layer, sub-layer, batch) in FlexGen's order: the zig-zag over batches for every layer of
    # [embedding, decoder layers (or their attention and MLP), head]; with stages, per step each micro-batch group
    # through every stage in turn (each stage's positions a zig-zag over the group's batches)
    positions = [(i, j, sub, k) for i in range(wl.gen_len) for grp in groups for d, (lo, hi) in enumerate(stages)
                 for j in ([-1] if d == 0 else []) + list(range(lo, hi)) + ([L] if d == S - 1 else [])
                 for sub in (subs if 0 <= j < L else (None,)) for k in grp]
    # KV positions: the decoder layers' attention (not the embedding, the head or an MLP: they touch no KV); their
    # index orders the reuse of the KV work buffers of their GPU: the n-th KV position of GPU d has index n·S + d
    kv_index: dict[int, int] = {}
    kv_count = [0] * S
    for p, (_, j, sub, _) in enumerate(positions):
        if 0 <= j < L and sub != "mlp":
            d = dev_of[j]
            kv_index[p] = kv_count[d] * S + d
            kv_count[d] += 1
    # per GPU, how many of its streamed instances the positions so far have used (they use them in order, each first
    # at its group's first batch): the embedding and the head prefetch the next one
    units_used = [0] * S
    pending_kv_loads: dict[int, list[int]] = {}  # position -> its KV h2d ops
    pending_kv_bufs: dict[int, tuple[bool, bool]] = {}  # position -> (host group loaded, disk group loaded)

    # KV work buffers: a new position's buffer is the one that the stores ``kv_reuse`` KV positions back gave up --
    # as offexec's pool of that many buffers hands it out (the stream waits for those stores' end). Two with GPU
    # attention (a load runs ahead of the compute that stores the previous position); one with CPU attention, whose
    # only work buffers are prefill's (``footprint.tier_bytes``' KV work buffers).
    kv_reuse = (1 if s.cpu_attention else 2) * S  # (in KV indices: S apart on one GPU)
    # KV index -> the stores that free its work buffers; KV position a takes the buffers of a - kv_reuse
    buf_frees: dict[int, list[int]] = {}

    loads_kv = not s.cpu_attention and bool(kc or kd)  # GPU attention over a host/disk cache: KV loads at all
    # each GPU batch runs at its own (padded) prompt length; all the same for a uniform workload
    batch_prompt_len = wl.batch_prompt_lens

    def emit_kv_loads(p: int) -> None:
        """Bring the KV prefix of position p to the GPU (GPU attention over a host/disk cache)."""
        i, j, sub, k = positions[p]
        if i == 0 or not 0 <= j < L or sub == "mlp":
            return
        if multi:
            cur_dev[0] = dev_of[j]
        ctx_prev = batch_prompt_len[k] + i - 1  # tokens whose KV exists before this step
        # the load takes the work buffer that the stores two KV positions back give up (double buffering)
        deps = buf_frees.get(kv_index[p] - kv_reuse, []) + kv_stored.get((j, k), [])
        phase = "decode"
        ids = []
        host_f, read_f, disk_f = kv_load_fields(ctx_prev)
        if kc:  # the load allocates the position's full-length work buffer; its store frees it
            ids.append(add_row("h2d", deps, phase, i, j, k, host_f))
        if kd:
            rd = add_row("disk_read", deps, phase, i, j, k, read_f)
            ids.append(add_row("h2d", [rd], phase, i, j, k, disk_f))
        pending_kv_loads[p] = ids
        pending_kv_bufs[p] = (bool(kc), bool(kd))

    # (the loop below runs once per position, ~10^5 times for OPT-175B: the settings it reads are locals)
    hidden_cpu = s.hidden_home == "cpu"
    prefetch = s.prefetch
    prefetch_from = s.prefetch_from_step
    cpu_attention = s.cpu_attention
    sublayer_op = s.cpu_attention_sublayer
    token_stores = s.kv_token_stores and cpu_attention and bool(kc)
    pending_store = None  # (token_stores) the (layer, batch, producing op, context) whose new KV is yet to store
    late_stores: set[int] = set()  # (token_stores) store ops issued after the next position's compute: not deferred
    sync = s.sync_positions
    pos_start = 0  # (sync) the id of the previous position's first op
    for p, (i, j, sub, k) in enumerate(positions):
        if sync:
            # FlexGen's sync() after the previous position: its ops, but for its stores, which join the next
            # barrier (they run beside this position, as FlexGen issues store_cache(k-1) here) -- except the stores
            # already issued after that position's compute (``late_stores``: FlexGen's order), which it waits for
            end = len(b.ops)
            stores = [x for x in range(pos_start, end) if _is_store(b.ops, x) and x not in late_stores]
            barrier[:] = [x for x in range(pos_start, end) if not _is_store(b.ops, x) or x in late_stores] + deferred
            deferred[:] = stores
            pos_start = end
        phase = "prefill" if i == 0 else "decode"
        prompt_len = batch_prompt_len[k]
        q = prompt_len if i == 0 else 1
        ctx = prompt_len + i
        decoder = 0 <= j < L
        dev = dev_of[j]
        t = group_of[k]
        grp = groups[t]
        hin = 0  # GPU bytes of a hidden copy received for this compute: counted while the compute runs
        land = 0  # GPU bytes of a hidden copy loaded from the host: counted from its load to this compute's end
        recv = None
        if multi:
            cur_dev[0] = dev
            src = last_dev.get(k)
            if src is not None and src != dev:
                # the batch's activations (or, for the next step's embedding, its new token ids) are on another GPU:
                # a GPU-to-GPU copy on the sender's p2p stream
                if j < 0:
                    recv = add("p2p", [last_out[k]], phase, i, j, k, tensor="token", lo=ctx - q, hi=ctx,
                               nbytes=gbs * q * fp.TOKEN_ID_BYTES, device=src, peer=dev)
                else:
                    hin = act_bytes("hidden", q)
                    recv = add("p2p", [last_out[k]], phase, i, j, k, tensor="hidden", lo=ctx - q, hi=ctx,
                               nbytes=hin, device=src, peer=dev)
            last_dev[k] = dev
        # hidden input: from the CPU if parked there. Issued before this position's prefetches: the H2D stream is
        # in order, and this batch's compute needs its few-KB hidden state now, the next layer's weights and the
        # next batch's KV only later (FlexGen's load_hidden(k+1) likewise runs ahead of compute(k+1), not behind
        # a whole layer's weights)
        deps = [last_out.get(k) if recv is None else recv]
        if hidden_cpu and k in hidden_store and j >= 0:
            land = act_bytes("hidden", q)
            # (the block's activations are reserved on their home tier in `resident`; the GPU copy is scratch)
            hl = add_row("h2d", [hidden_store.pop(k)] + landings[dev].load_deps(), phase, i, j, k,
                         hidden_copy_fields(q, ctx, True))
            deps = [hl]
        # weights: the current unit's (first batch only), then, when prefetching, the next streamed unit's
        # this position's streamed unit (device, index), if any
        u = inst_index.get((i, t, j, sub)) if (decoder or homes) else None
        first_k = k == grp[0]
        pf = prefetch and i >= prefetch_from
        if first_k and u is not None:
            units_used[dev] = u[1] + 1
            ensure_loaded(dev, u[1] + (1 if pf else 0))
        elif first_k and pf and not decoder:
            # embedding / head: prefetch the next streamed decoder unit of this GPU
            nxt = units_used[dev]
            if nxt < len(instances[dev]):
                ensure_loaded(dev, nxt)
        if loads_kv:
            if p == 0:
                emit_kv_loads(0)
            if p + 1 in kv_index:  # (only a decoder attention position has KV to load)
                emit_kv_loads(p + 1)  # prefetch the next batch's cache (FlexGen: load_cache(k+1))
        if multi:
            cur_dev[0] = dev  # (the loads above may have been another GPU's: the next stage's first KV)
        if u is not None:
            deps += loaded[u]
        if pending_kv_loads:
            deps += pending_kv_loads.pop(p, [])
        last_k = k == grp[-1]
        w_free = unit_slot(j, sub) if last_k and (decoder or u is not None) else 0
        loaded_c, loaded_d = pending_kv_bufs.pop(p, (False, False)) if pending_kv_bufs else (False, False)
        part = _PART_OF_SUB[sub] if decoder else ("embed" if j < 0 else "head")
        cpu_attn = decoder and cpu_attention and i > 0 and sub != "mlp"
        ws = work_bytes(part, cpu_attn, q, ctx)
        if sub == "mlp":
            comp = add_row("compute", deps, phase, i, j, k, gpu_compute_fields("mlp", q, ctx, last_k, ws + hin,
                                                                               ws + hin + land + w_free))
        elif cpu_attn and sublayer_op:
            # FlexGen's attention sub-layer as its code runs it with --cpu-cache-compute, one call on its main thread
            # (``SelfAttention.load_cache`` path 1 + ``TorchDevice.mha_gen``: the norm and QKV on the GPU, Q and the
            # new K/V copied to the host, the fp32 attention on the CPU, the result copied back, the output
            # projection and residual on the GPU): one op, priced by the profile row that timed that call
            # (``costmodel.cpu_attention_row_holds_sublayer``), so its parts are not priced again beside it
            att = add_row("cpu_compute", deps + kv_stored.get((j, k), []), phase, i, j, k,
                          compute_fields("attn", q, ctx, last_k if sub else None, (ws + hin, 0, 0),
                                         (ws + hin + land + w_free, 0, 0) if sub else None))
            comp = att
            if sub is None:  # a whole decoder layer (FlexGen's TransformerLayer): its MLP follows on the GPU
                comp = add_row("compute", [att], phase, i, j, k, gpu_compute_fields("mlp", q, ctx, last_k, None,
                                                                                    ws + hin + land + w_free))
            kv_stored[(j, k)] = [att]
        elif cpu_attn:
            # FlexGen's CPU delegation: QKV on the GPU, attention on the CPU over the host cache, rest on the GPU
            read_f, qkv_f, attn_f, out_f, write_f = cpu_delegation_fields(q, ctx)
            pre = add_row("compute", deps + kv_stored.get((j, k), []), phase, i, j, k,
                          gpu_compute_fields("pre_attn", q, ctx, None, ws + hin, None))
            cpu_deps = []
            if kd:  # the cache lives on disk: read the prefix into host memory for the CPU
                cpu_deps.append(add_row("disk_read", kv_stored.get((j, k), []), phase, i, j, k, read_f))
            d = add_row("d2h", [pre], phase, i, j, k, qkv_f)
            att = add_row("cpu_compute", [d] + cpu_deps, phase, i, j, k, attn_f)
            back = add_row("h2d", [att], phase, i, j, k, out_f)
            comp = add_row("compute", [back, pre], phase, i, j, k,
                           gpu_compute_fields("attn_out" if sub else "post_attn", q, ctx, last_k, None,
                                              ws + hin + land + w_free))
            stores = [att]
            if kd:  # append the new token's KV to the disk copy
                stores = [add_row("disk_write", [att], phase, i, j, k, write_f)]
            kv_stored[(j, k)] = stores
        else:
            # (the embedding of step i waits for the LM head of step i-1 through last_out: the next token)
            if decoder and kd:
                deps += disk_stores[dev].compute_deps()
            # work buffers of off-GPU heads that no load brought: this compute creates them (the stores free them)
            new_bufs = (0 if loaded_c else buf_c) + (0 if loaded_d else buf_d) if decoder else 0
            if new_bufs:
                deps += buf_frees.get(kv_index[p] - kv_reuse, [])
            comp = add_row("compute", deps, phase, i, j, k,
                           gpu_compute_fields(part, q, ctx, decoder and last_k, ws + hin + new_bufs,
                                              ws + hin + land + w_free))
            if decoder and (kc or kd):
                # store the new tokens' KV of the host- and disk-homed heads (FlexGen: store_cache); each store is
                # the last user of its group's work buffer
                stores = []
                host_f, d2h_f, write_f = kv_store_fields(q, ctx)
                if kc:
                    stores.append(add_row("d2h", [comp], phase, i, j, k, host_f))
                    buf_frees.setdefault(kv_index[p], []).append(stores[-1])
                if kd:
                    st = add_row("d2h", [comp] + disk_stores[dev].d2h_deps(), phase, i, j, k, d2h_f)
                    buf_frees.setdefault(kv_index[p], []).append(st)
                    stores.append(add_row("disk_write", [st], phase, i, j, k, write_f))
                    disk_stores[dev].record(st, stores[-1])
                kv_stored[(j, k)] = stores
        if pending_store is not None:
            # FlexGen's store_cache(k-1) after this position's compute_layer(k) (flex_opt.py
            # ``generation_loop_overlap_multi_batch``; ``SelfAttention.store_cache``): the previous attention
            # position's new K and V, each [1, B x heads, head_dim], into the unpinned host cache by
            # ``general_copy``'s plain path (one position: no relay), a pageable copy that blocks its main thread
            # until done -- so after this compute, and before the position's sync
            sj, sk, src, sctx = pending_store
            nb_half = kv_bytes(kc, 1) // 2
            st_ids = [add_row("d2h", [src, comp], "decode", i, sj, sk,
                              copy_fields("kv", sctx - 1, sctx, (kg, kg + kc), nb_half, kv_pinned, None, None))
                      for _ in ("k", "v")]
            late_stores.update(st_ids)
            kv_stored[(sj, sk)] = kv_stored.get((sj, sk), []) + st_ids
            pending_store = None
        if token_stores and cpu_attn and i < wl.gen_len - 1:  # (FlexGen stores no KV of the last token)
            pending_store = (j, k, comp, ctx)
        last_out[k] = comp
        if land:
            landings[dev].record(comp)  # (with CPU attention ``comp`` is attn_out: pre's residual is the copy)
        if last_k and u is not None:
            free_op[u] = comp
        # (the last layer of a stage sends its output to the next GPU from the GPU: nothing parked)
        if hidden_cpu and j < L and not (multi and j == stages[dev][1] - 1 and dev < S - 1 and sub != "attn"):
            hidden_store[k] = add_row("d2h", [comp], phase, i, j, k, hidden_copy_fields(q, ctx, False))
    cap = dict(capacity)
    settings = dict(s.settings)
    plan_stages, plan_nodes = [], []
    if multi:  # every GPU has the budget ``capacity['gpu']``; the plan's gpu capacity and residents are the sums
        per = stage_resident_bytes(model, wl, s)
        plan_stages = [{"layers": [lo, hi], "gpu_capacity": int(capacity["gpu"]), "gpu_resident": int(r["gpu"])}
                       for (lo, hi), r in zip(stages, per)]
        cap["gpu"] = int(capacity["gpu"]) * S
        nodes = s.stage_nodes()
        N = max(nodes) + 1
        if N > 1:  # several hosts: each node's host memory and disk are capacity's, their residents its stages'
            for st, n in zip(plan_stages, nodes):
                st["node"] = n
            res = {t: node_sums([int(r[t]) for r in per], nodes) for t in ("cpu", "disk")}
            plan_nodes = [{f"{t}_{k}": int(capacity[t]) if k == "capacity" else res[t][n]
                           for t in ("cpu", "disk") for k in ("capacity", "resident")} for n in range(N)]
            cap["cpu"], cap["disk"] = int(capacity["cpu"]) * N, int(capacity["disk"]) * N
    return Plan(model=model, workload=wl, policy=s.policy, settings=settings, capacity=cap,
                resident=resident_bytes(model, wl, s), weight_split=[tuple(x) for x in s.weight_split],
                kv_split=tuple(s.kv_split), hidden_home=s.hidden_home, ops=b.ops, derived=dict(s.derived),
                stages=plan_stages, nodes=plan_nodes, weight_gather_copies=s.weight_gather_copies,
                cpu_attention_impl=s.cpu_attention_impl, pageable_copy=s.pageable_copy, quant_impl=s.quant_impl,
                issue_waits_for_deps=s.issue_waits_for_deps)

