"""Static binding of a plan's ops to the data they read and write (the executor's first pass, no policy logic).

The plan says *what* each op moves or computes (offsim/core/plan.py's docstring); this pass decides *which buffer*, by
replaying the plan in plan order -- the order in which the simulator also understands the data -- and recording, for
every op, the values it uses (by id) and, for every value, how many ops use it, so the executor frees a buffer right
after its last user. Binding in plan order, rather than at run time, makes the data each op sees independent of the
order in which the executor's threads happen to issue ops.

Values (``Value.kind``), all per GPU batch ``k`` and layer ``j``:
- ``hidden`` (GPU) / ``hidden_host``: a batch's activations between ops (compute output, or an h2d of a parked one);
- ``pre`` (GPU): a ``pre_attn`` result -- residual, Q, K, V of the new tokens -- for ``attn`` / ``post_attn``;
- ``qkv_host``, ``attn_host`` (host), ``attn`` (GPU): CPU-attention traffic (FlexGen's delegation);
- ``wslot`` (GPU pool): the streamed part of layer j's weights for step i, filled by one or more weight h2d ops and
  read by that step's compute ops of layer j; with sub-layer streaming (FlexGen's granularity: compute parts
  ``attn_layer`` / ``attn_out`` and ``mlp``) one ``wslot_attn`` and one ``wslot_mlp`` per (step, layer) instead, each
  holding that sub-layer's streamed tensors;
- ``hidden_in`` (GPU pool): a batch's parked activations loaded back by an h2d (``footprint.landing_buffer_bytes``);
  then the batch's current hidden state like a ``hidden``. The schedule bounds these loads to
  ``footprint.LANDING_BUFFERS`` in flight (``offsim.policies.schedule.LandingBuffers``), the pool holds that many;
  with CPU attention the landed tensor is also ``pre``'s residual, so ``attn_out`` / ``post_attn`` use it too;
- ``kvwork_cpu`` / ``kvwork_disk`` (GPU pool): a working KV buffer of the heads homed on the host / on disk, holding
  positions [0, ctx): the prefix delivered by KV h2d ops plus the tokens the next compute of (j, k) adds; stores
  (d2h) of those heads read it;
- ``wstage``, ``kvread``, ``kvout`` (host staging): data on its way between disk and the GPU.

One stage of a pipeline (offexec/distributed.py): ``rank`` is this process's GPU; a ``p2p`` op whose ``peer`` is
``rank`` receives (a hidden state: a new ``hidden`` value of its batch; token ids: into the token table), any other
sends (the batch's current ``hidden`` value, or the ids from the token table).

Homes (never values; the executor allocates them once): resident weight bytes [0, gpu) per layer, host weight bytes,
disk weight bytes, the KV of GPU-homed heads on the GPU, of host-homed heads in host memory, of disk-homed heads on
disk, the token ids of every sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from offsim.core import footprint as fp
from offsim.core.plan import Op, Plan

from .memory import ExecError

GPU_STREAMS = ("compute", "h2d", "d2h")
P2P_STREAM = "p2p"  # a pipeline stage's sends and receives (offexec/distributed.py)
HOST_STREAMS = ("cpu", "disk")
POOL_KINDS = ("wslot", "wslot_attn", "wslot_mlp", "kvwork_cpu", "kvwork_disk", "hidden_in")
# pools whose values are bound to buffers ahead of the run (``bind_pool_buffers``): the KV work buffers, up to the
# count offsim's placement reserves (``footprint.placement_tier_bytes``: two per off-GPU group, one with CPU
# attention); weight slots and landing buffers are handed out in plan order as before
BOUND_POOL_KINDS = ("kvwork_cpu", "kvwork_disk")
SUBLAYER_PARTS = ("attn_layer", "attn_out", "mlp")  # compute parts of a plan that streams weights per sub-layer
GPU_VALUE_KINDS = ("hidden", "pre", "attn")  # GPU activations, sized by offsim.core.footprint
HOST_VALUE_KINDS = ("wstage", "kvread", "kvout", "qkv_host", "attn_host")  # host staging


@dataclass(slots=True)
class Value:
    id: int
    kind: str
    key: tuple
    producer: int  # op that creates it
    users: int = 0  # ops that use it, the producer included
    last: int = -1  # last user in plan order
    nbytes: int = 0
    covered: list = field(default_factory=list)  # kvwork / wslot: [lo, hi) ranges filled by transfers


@dataclass(slots=True)
class Bound:
    """What op ``op`` does: handler name and the values it uses by role."""

    op: Op
    fn: str
    args: dict  # role -> value id
    info: dict  # role -> plain number or tag (offsets of staged data)


@dataclass
class Program:
    plan: Plan
    bound: list[Bound]
    values: list[Value]
    pool_peak: dict[str, int]  # buffers of each pool: most live at once in plan order, or what binding them needs
    host_peak_bytes: int  # most bytes of host staging values live at once, in plan order
    gpu_value_peak_bytes: int  # most bytes of GPU activation values (GPU_VALUE_KINDS) live at once, in plan order
    slot_base: dict[tuple, int]  # (layer, unit) -> first element of its streamed slot (the straddling tensor's start)
    slot_numel: dict[str, int]  # weight pool kind -> elements of one slot
    groups: dict[str, tuple[int, int]]  # home group -> KV heads [lo, hi)
    units: dict  # unit (None: whole layer; 'attn', 'mlp') -> its elements [lo, hi) of a layer's flat buffer
    landing_tokens: int = 0  # positions of the plan's longest activation load (h2d hidden): a landing buffer's size
    buffer_of: dict = field(default_factory=dict)  # pool value id -> its buffer in the pool (``bind_pool_buffers``)


def weight_slot_base(layout, g_elems: int) -> int:
    """First element of a layer's streamed slot: the start of the tensor that holds element ``g_elems`` (the first
    byte not resident on the GPU), so that every tensor lies wholly in the resident buffer or in the slot."""
    for t in layout:
        if t.lo <= g_elems < t.hi:
            return t.lo
    return g_elems


def bind(plan: Plan, layout, rank: int = 0) -> Program:
    """Resolve every op's inputs and outputs; raise ExecError naming the first op the executor cannot run.
    ``rank``: this process's GPU in a pipeline (which p2p ops receive)."""
    m, wl = plan.model, plan.workload
    e = m.dtype_bytes
    Wn = layout[-1].hi
    n_kv = m.num_kv_heads
    kg, kc = plan.kv_split
    groups = {"gpu": (0, kg), "cpu": (kg, kg + kc), "disk": (kg + kc, n_kv)}
    gbs = wl.gpu_batch_size
    g_el = [g // e for g, _ in plan.weight_split]
    c_el = [c // e for _, c in plan.weight_split]
    sublayer = any(o.kind == "compute" and o.part in SUBLAYER_PARTS for o in plan.ops)
    if sublayer:
        units = {u: (lo // e, hi // e) for u, (lo, hi) in fp.sublayer_ranges_bytes(m).items()}
    else:
        units = {None: (0, Wn)}
    slot_base = {}  # (layer, unit) -> first element of the unit's slot; the unit's end when it is all resident
    for j, g in enumerate(g_el):
        for u, (ulo, uhi) in units.items():
            slot_base[(j, u)] = max(ulo, weight_slot_base(layout, g)) if g < uhi else uhi
    slot_numel = {pool_of(u): max([units[u][1] - slot_base[(j, u)] for j in range(len(g_el))] + [0])
                  for u in units}

    values: list[Value] = []
    bound: list[Bound] = []
    landing_tokens = max((op.hi - op.lo for op in plan.ops if op.tensor == "hidden" and op.kind == "h2d"), default=0)

    def new(kind, key, op, nbytes=0) -> int:
        if kind in GPU_VALUE_KINDS or kind in ("qkv_host", "attn_host"):
            tokens = op.q_tokens if op.kind in ("compute", "cpu_compute") else op.hi - op.lo
            nbytes = value_bytes(m, kind, gbs, tokens)
        v = Value(len(values), kind, key, op.id, nbytes=nbytes)
        values.append(v)
        return v.id

    def use(vid, op):
        v = values[vid]
        v.users += 1
        v.last = op.id
        return vid

    def fail(op, msg):
        raise ExecError(f"{op.describe()}: {msg}")

    def group_of(op) -> str:
        for name, (lo, hi) in groups.items():
            if lo <= op.head_lo and op.head_hi <= hi and hi > lo:
                return name
        fail(op, f"KV heads [{op.head_lo}, {op.head_hi}) span more than one home tier (gpu heads [0, {kg}), cpu "
                 f"[{kg}, {kg + kc}), disk [{kg + kc}, {n_kv}))")

    hidden: dict[int, int] = {}
    hidden_host: dict[int, int] = {}
    pre: dict[tuple, int] = {}
    pre_landing: dict[tuple, int] = {}  # (j, k) -> the landing buffer value that pre_attn's residual is a view of
    qkv_host: dict[tuple, int] = {}
    attn_host: dict[tuple, int] = {}
    attn_gpu: dict[tuple, int] = {}
    wslot: dict[tuple, int] = {}
    wstage: dict[int, list] = {}
    kv_pending: dict[tuple, int] = {}
    kv_current: dict[tuple, int] = {}
    kv_read: dict[tuple, list] = {}
    host_frag: dict[tuple, list] = {}

    def weights_of(op, args, unit=None):
        j = op.layer
        ulo, uhi = units[unit]
        if g_el[j] < uhi:
            vid = wslot.get((op.step, j, unit))
            what = f"layer {j}" + (f"'s {unit}" if unit else "")
            if vid is None:
                fail(op, f"computes {what}, whose weight bytes [{max(g_el[j], ulo) * e}, {uhi * e}) are not "
                         f"GPU-resident, but no weight load of them for step {op.step} precedes it")
            need_lo = max(g_el[j], ulo)
            if _prefix_end(values[vid].covered, need_lo) < uhi:
                fail(op, f"{what}'s streamed weight bytes [{need_lo * e}, {uhi * e}) are not all loaded for step "
                         f"{op.step} (loaded element ranges: {values[vid].covered})")
            args["w"] = use(vid, op)

    def kv_for_attention(op, args):
        """Working KV buffers of the off-GPU head groups for a GPU attention over positions [0, ctx)."""
        j, k = op.layer, op.batch
        start = op.ctx_tokens - op.q_tokens
        for g in ("cpu", "disk"):
            lo, hi = groups[g]
            if hi <= lo:
                continue
            vid = kv_pending.pop((j, k, g), None)
            if vid is None:
                if start > 0:
                    fail(op, f"attends over KV positions [0, {start}) of heads [{lo}, {hi}) (home: {g}) but no KV "
                             f"load of layer {j} batch {k} precedes it")
                vid = new(f"kvwork_{g}", (j, k), op)
            elif _prefix_end(values[vid].covered, 0) < start:
                fail(op, f"attends over KV positions [0, {start}) of heads [{lo}, {hi}) but only "
                         f"{values[vid].covered} were loaded")
            args[f"kv_{g}"] = use(vid, op)
            kv_current[(j, k, g)] = vid

    for op in plan.ops:
        args: dict = {}
        info: dict = {}
        kind, j, k, i = op.kind, op.layer, op.batch, op.step
        if kind in ("compute", "cpu_compute") and op.num_seqs != gbs:
            fail(op, f"computes {op.num_seqs} sequences; the executor runs GPU batches of {gbs}")
        if kind == "p2p":
            recv = op.peer == rank
            if op.tensor == "hidden":
                if recv:
                    fn = "recv_hidden"
                    args["out"] = use(new("hidden", (k,), op), op)
                    hidden[k] = args["out"]
                else:
                    if k not in hidden:
                        fail(op, f"sends activations of batch {k} that do not exist yet")
                    fn = "send_hidden"
                    args["src"] = use(hidden[k], op)
            elif op.tensor == "token":
                fn = "recv_token" if recv else "send_token"
            else:
                fail(op, f"a p2p op moves 'hidden' or 'token', not {op.tensor!r}")
        elif kind == "compute":
            part = op.part
            if part == "embed":
                fn = "embed"
                args["out"] = use(new("hidden", (k,), op), op)
                hidden[k] = args["out"]
            elif part in ("layer", "pre_attn", "head", "attn_layer", "mlp"):
                if k not in hidden:
                    fail(op, f"no activations of batch {k} precede it (no embed or earlier layer)")
                args["x"] = use(hidden[k], op)
                if part == "head":
                    fn = "head"
                else:
                    unit = ("mlp" if part == "mlp" else "attn") if sublayer else None
                    if unit is not None and part == "layer":
                        fail(op, "a whole-layer compute in a plan that streams weights per sub-layer")
                    weights_of(op, args, unit)
                    if part in ("layer", "attn_layer", "mlp"):
                        fn = part
                        if part != "mlp":
                            kv_for_attention(op, args)
                        args["out"] = use(new("hidden", (k,), op), op)
                        hidden[k] = args["out"]
                    else:
                        fn = "pre_attn"
                        args["out"] = use(new("pre", (j, k), op), op)
                        pre[(j, k)] = args["out"]
                        if values[args["x"]].kind == "hidden_in":
                            pre_landing[(j, k)] = args["x"]
            elif part == "attn":
                fn = "attn_gpu"
                if (j, k) not in pre:
                    fail(op, "GPU attention with no pre_attn of this layer and batch before it")
                args["pre"] = use(pre[(j, k)], op)
                kv_for_attention(op, args)
                args["out"] = use(new("attn", (j, k), op), op)
                attn_gpu[(j, k)] = args["out"]
            elif part in ("post_attn", "attn_out"):
                fn = part
                if (j, k) not in pre or (j, k) not in attn_gpu:
                    fail(op, f"{part} needs a pre_attn and an attention output of this layer and batch before it")
                if (part == "attn_out") != sublayer:
                    fail(op, f"{part} in a plan that streams weights per {'sub-layer' if sublayer else 'layer'}")
                args["pre"] = use(pre[(j, k)], op)
                args["attn"] = use(attn_gpu[(j, k)], op)
                if (j, k) in pre_landing:  # the residual in ``pre`` is the landing buffer: held until here
                    args["landing"] = use(pre_landing.pop((j, k)), op)
                weights_of(op, args, "attn" if sublayer else None)
                args["out"] = use(new("hidden", (k,), op), op)
                hidden[k] = args["out"]
            else:  # pragma: no cover - validate() rejects other parts
                fail(op, f"unknown compute part {part!r}")
        elif kind == "cpu_compute":
            fn = "attn_cpu"
            if (j, k) not in qkv_host:
                fail(op, "CPU attention with no Q/K/V copied to the host (d2h 'qkv') before it")
            if groups["gpu"][1] > 0:
                fail(op, f"CPU attention over KV heads homed on the GPU ([0, {kg})) is not supported")
            args["qkv"] = use(qkv_host[(j, k)], op)
            start = op.ctx_tokens - op.q_tokens
            lo, hi = groups["disk"]
            if hi > lo and start > 0:
                frag = kv_read.get((j, k))
                if frag is None or frag[1] > 0 or frag[2] < start or (frag[3], frag[4]) != (lo, hi):
                    fail(op, f"CPU attention over disk-homed heads [{lo}, {hi}) needs positions [0, {start}) read "
                             "from disk (disk_read 'kv') before it")
                args["kvread"] = use(frag[0], op)
            args["out"] = use(new("attn_host", (j, k), op), op)
            attn_host[(j, k)] = args["out"]
            host_frag[(j, k)] = [args["qkv"], start, op.ctx_tokens, 0, n_kv, "qkv"]
        elif op.tensor == "weight":
            if kind == "h2d":
                fn = "h2d_weight"
                if not 0 <= j < len(g_el):
                    fail(op, "streams the embedding or the LM head, which the executor keeps on the GPU; such a "
                             "plan (flexgen-ref with weights off the GPU: FlexGen's code places those by --percent "
                             "too) is simulated only -- run flexgen-ref with the weights all on the GPU, or flexgen")
                lo, hi = op.lo // e, op.hi // e
                if lo < g_el[j]:
                    fail(op, f"loads weight bytes [{op.lo}, {op.hi}) of which [{op.lo}, {g_el[j] * e}) are GPU-resident")
                if lo < g_el[j] + c_el[j] < hi:
                    fail(op, f"one weight load spans the host and disk parts of layer {j} (split at byte "
                             f"{(g_el[j] + c_el[j]) * e})")
                unit = next(u for u, (ulo, uhi) in units.items() if ulo <= lo < uhi)
                if hi > units[unit][1]:
                    fail(op, f"one weight load spans layer {j}'s attention and MLP (split at byte "
                             f"{units[unit][1] * e}), which stream separately")
                vid = wslot.get((i, j, unit))
                if vid is not None and any(a < hi and lo < b for a, b in values[vid].covered):
                    # bytes this slot already holds: a reload for a later group of batches (a pipeline's micro-batch
                    # groups each load the layer), not another slice of the same load -- a fresh slot, so the first
                    # is freed after its own group's ops instead of staying live for the whole step
                    vid = None
                if vid is None:
                    vid = wslot[(i, j, unit)] = new(pool_of(unit), (i, j, unit), op)
                    info["init"] = True  # first load of this slot: bring the straddling tensor's resident head
                info["unit"] = unit
                values[vid].covered.append((lo, hi))
                args["slot"] = use(vid, op)
                if lo >= g_el[j] + c_el[j]:
                    frag = wstage.get(j)
                    if frag is None or not (frag[1] <= lo and hi <= frag[2]):
                        fail(op, f"loads disk-homed weight bytes [{op.lo}, {op.hi}) of layer {j} with no disk_read "
                                 "of them before it")
                    args["stage"] = use(frag[0], op)
                    info["stage_lo"] = frag[1]
            elif kind == "disk_read":
                fn = "disk_read_weight"
                lo, hi = op.lo // e, op.hi // e
                if lo < g_el[j] + c_el[j]:
                    fail(op, f"reads weight bytes [{op.lo}, {op.hi}) from disk, but layer {j}'s disk part starts at "
                             f"byte {(g_el[j] + c_el[j]) * e}")
                vid = new("wstage", (j,), op, nbytes=op.nbytes)
                wstage[j] = [vid, lo, hi]
                args["out"] = use(vid, op)
            else:
                fail(op, f"the executor does not run {kind} of weights (weights are read-only)")
        elif op.tensor == "kv":
            g = group_of(op)
            if kind == "h2d":
                fn = "h2d_kv"
                if g == "gpu":
                    fail(op, "loads KV heads that live on the GPU")
                vid = kv_pending.get((j, k, g))
                if vid is None:
                    vid = kv_pending[(j, k, g)] = new(f"kvwork_{g}", (j, k), op)
                values[vid].covered.append((op.lo, op.hi))
                args["dst"] = use(vid, op)
                if g == "disk":
                    frag = kv_read.get((j, k))
                    if frag is None or not (frag[1] <= op.lo and op.hi <= frag[2]) or (frag[3], frag[4]) != \
                            (op.head_lo, op.head_hi):
                        fail(op, "loads disk-homed KV with no disk_read of the same heads and positions before it")
                    args["src"] = use(frag[0], op)
                    info["src_lo"] = frag[1]
            elif kind == "d2h":
                fn = "d2h_kv"
                if g == "gpu":
                    fail(op, "stores KV heads that live on the GPU (they are never copied out)")
                vid = kv_current.get((j, k, g))
                if vid is None:
                    fail(op, f"stores KV of layer {j} batch {k} that no compute produced")
                args["src"] = use(vid, op)
                frag = host_frag.get((j, k))
                if g == "cpu" and frag is not None and frag[5] == "qkv" and frag[1] <= op.lo and op.hi <= frag[2]:
                    # these positions' K/V came from CPU attention, which wrote them into the host cache itself and
                    # never into the GPU work buffer: the store (flexgen-ref's token stores, FlexGen's store_cache)
                    # moves its bytes over the link as planned, into scratch, not over the cache with stale rows
                    info["scratch"] = True
                if g == "disk":
                    out = new("kvout", (j, k), op, nbytes=op.nbytes)
                    args["out"] = use(out, op)
                    host_frag[(j, k)] = [out, op.lo, op.hi, op.head_lo, op.head_hi, "kv"]
            elif kind == "disk_read":
                fn = "disk_read_kv"
                if g != "disk":
                    fail(op, "reads from disk KV heads that are not homed on disk")
                vid = new("kvread", (j, k), op, nbytes=op.nbytes)
                kv_read[(j, k)] = [vid, op.lo, op.hi, op.head_lo, op.head_hi]
                args["out"] = use(vid, op)
            elif kind == "disk_write":
                fn = "disk_write_kv"
                if g != "disk":
                    fail(op, "writes to disk KV heads that are not homed on disk")
                frag = host_frag.get((j, k))
                if frag is None or not (frag[1] <= op.lo and op.hi <= frag[2] and frag[3] <= op.head_lo and
                                        op.head_hi <= frag[4]):
                    fail(op, "writes KV to disk that is not in host memory (no d2h or CPU attention of those "
                             "positions and heads before it)")
                args["src"] = use(frag[0], op)
                info["src_lo"], info["src_h0"], info["src_kind"] = frag[1], frag[3], frag[5]
            else:
                fail(op, f"unsupported KV transfer {kind}")
        elif op.tensor == "hidden":
            if kind == "d2h":
                fn = "d2h_hidden"
                if k not in hidden:
                    fail(op, f"parks activations of batch {k} that do not exist yet")
                args["src"] = use(hidden[k], op)
                args["out"] = use(new("hidden_host", (k,), op), op)
                hidden_host[k] = args["out"]
            elif kind == "h2d":
                fn = "h2d_hidden"
                if k not in hidden_host:
                    fail(op, f"loads parked activations of batch {k} but none were parked")
                args["src"] = use(hidden_host[k], op)
                args["out"] = use(new("hidden_in", (k,), op), op)  # (a pool buffer: landing_buffer_bytes)
                hidden[k] = args["out"]
            else:
                fail(op, f"unsupported activation transfer {kind}")
        elif op.tensor == "qkv" and kind == "d2h":
            fn = "d2h_qkv"
            if (j, k) not in pre:
                fail(op, "copies Q/K/V to the host but no pre_attn produced them")
            args["src"] = use(pre[(j, k)], op)
            args["out"] = use(new("qkv_host", (j, k), op), op)
            qkv_host[(j, k)] = args["out"]
        elif op.tensor == "attn_out" and kind == "h2d":
            fn = "h2d_attn_out"
            if (j, k) not in attn_host:
                fail(op, "loads an attention output that no CPU attention produced")
            args["src"] = use(attn_host[(j, k)], op)
            args["out"] = use(new("attn", (j, k), op), op)
            attn_gpu[(j, k)] = args["out"]
        else:
            fail(op, f"the executor does not know how to run a {kind} of {op.tensor!r}")
        bound.append(Bound(op, fn, args, info))

    # pool peaks and host staging peak in plan order (a value lives from its producer to its last user)
    live: dict[str, int] = {k: 0 for k in POOL_KINDS}
    peak = dict(live)
    host_live = host_peak = 0
    gpu_live = gpu_peak = 0
    ends: dict[int, list[Value]] = {}
    for v in values:
        ends.setdefault(v.last, []).append(v)
    starts: dict[int, list[Value]] = {}
    for v in values:
        starts.setdefault(v.producer, []).append(v)
    for op in plan.ops:
        for v in starts.get(op.id, ()):
            if v.kind in live:
                live[v.kind] += 1
                peak[v.kind] = max(peak[v.kind], live[v.kind])
            elif v.kind in HOST_VALUE_KINDS:
                host_live += v.nbytes
                host_peak = max(host_peak, host_live)
            elif v.kind in GPU_VALUE_KINDS:
                gpu_live += v.nbytes
                gpu_peak = max(gpu_peak, gpu_live)
        for v in ends.get(op.id, ()):
            if v.kind in live:
                live[v.kind] -= 1
            elif v.kind in HOST_VALUE_KINDS:
                host_live -= v.nbytes
            elif v.kind in GPU_VALUE_KINDS:
                gpu_live -= v.nbytes
    if peak["hidden_in"]:  # loads run ahead of plan order up to the schedule's bound (``LandingBuffers``)
        peak["hidden_in"] = max(peak["hidden_in"], fp.LANDING_BUFFERS)
    cap = fp.kv_work_buffers(any(op.kind == "cpu_compute" for op in plan.ops))
    buffer_of, counts = bind_pool_buffers(plan, values, bound, {k: max(cap, peak[k]) for k in BOUND_POOL_KINDS})
    for k, c in counts.items():
        peak[k] = max(peak[k], c)
    return Program(plan, bound, values, peak, host_peak, gpu_peak, slot_base, slot_numel, groups, units,
                   landing_tokens, buffer_of)


def bind_pool_buffers(plan: Plan, values: list, bound: list, caps: dict) -> tuple[dict[int, int], dict[str, int]]:
    """Which buffer of its pool each value of the kinds in ``caps`` (kind -> most buffers) lives in, so that reusing
    a buffer orders an op after no work the plan does not order it after, where the pool's buffers allow: a value
    takes a buffer whose previous value's every user is the value's first op itself, one of its dependencies
    (transitively), or an earlier op of its own stream (stream order); else a new buffer up to the cap; else the
    buffer taken longest ago (the pool's own order). Handing out buffers in plan order -- a buffer free again once its
    value's last user is issued -- made a FlexGen plan whose KV load of layer j+1 depends on the store of layer j-1
    wait on the GPU for the store of layer j as well, serialising every load with the attention before it (heldout
    opt-6.7b_flexgen_b32_p1024_g128: one KV work buffer where offsim's placement counts two; decode 1,641 tok/s,
    offsim 2,588). Returns (value id -> buffer index, kind -> buffers)."""
    kinds = tuple(caps)
    users: dict[int, list[int]] = {}
    for b in bound:
        for vid in b.args.values():
            if isinstance(vid, int) and values[vid].kind in kinds:
                users.setdefault(vid, []).append(b.op.id)
    ops = plan.ops
    # done[x][s]: the last op of stream s that has ended on the GPU whenever op x starts -- x's own stream's ops up to
    # x in stream order, and whatever its dependencies (transitively) had (plan order is a topological order)
    streams = sorted({op.stream for op in ops})
    sidx = {st: i for i, st in enumerate(streams)}
    done: list[list[int]] = []
    last_on = [-1] * len(streams)
    for op in ops:
        row = list(done[last_on[sidx[op.stream]]]) if last_on[sidx[op.stream]] >= 0 else [-1] * len(streams)
        for d in op.deps:
            row = [a if a >= b else b for a, b in zip(row, done[d])]
        row[sidx[op.stream]] = op.id
        done.append(row)
        last_on[sidx[op.stream]] = op.id

    def covered(prev: list[int], first: int) -> bool:
        row = done[first]
        return all(u == first or u <= row[sidx[ops[u].stream]] for u in prev)

    buffer_of: dict[int, int] = {}
    holders: dict[str, list[list[int]]] = {k: [] for k in kinds}  # per buffer: its current value's users
    for vid in sorted(users, key=lambda v: min(users[v])):
        us, kind = users[vid], values[vid].kind
        bufs, first = holders[kind], min(us)
        i = next((i for i, prev in enumerate(bufs) if covered(prev, first)), None)
        if i is None and len(bufs) < caps[kind]:
            i = len(bufs)
            bufs.append(us)
        if i is None:  # the cap reached: the buffer whose value began longest ago, as a FIFO pool would give
            i = min(range(len(bufs)), key=lambda b: min(bufs[b]))
        bufs[i] = us
        buffer_of[vid] = i
    return buffer_of, {k: len(b) for k, b in holders.items()}


def pool_of(unit) -> str:
    """The buffer pool of a weight unit's slots: 'wslot' (whole layers) or 'wslot_attn' / 'wslot_mlp'."""
    return "wslot" if unit is None else f"wslot_{unit}"


def value_bytes(model, kind: str, num_seqs: int, q_tokens: int) -> int:
    """Bytes of an activation value of ``q_tokens`` new tokens of ``num_seqs`` sequences (``offsim.core.footprint``):
    a hidden state; pre_attn's (x, Q, K, V) -- x counted again although it is the input hidden state's tensor, which
    the tuple keeps alive until post_attn, past that value's last user; CPU attention's packed Q/K/V on the host;
    an attention output (GPU or host)."""
    if kind == "hidden":
        return fp.hidden_bytes(model, num_seqs, q_tokens)
    if kind == "pre":
        return fp.hidden_bytes(model, num_seqs, q_tokens) + fp.qkv_bytes(model, num_seqs, q_tokens)
    if kind == "qkv_host":
        return fp.qkv_bytes(model, num_seqs, q_tokens)
    return fp.attn_out_bytes(model, num_seqs, q_tokens)  # 'attn', 'attn_host'


def _prefix_end(ranges: list, start: int) -> int:
    """End of the contiguous run of [lo, hi) ranges that starts at or before ``start``."""
    end = start
    for lo, hi in sorted(ranges):
        if lo <= end:
            end = max(end, hi)
    return end
