"""FlexGen's linear program over placement fractions: the LP that ranks FlexGen's (and TightLLM's) candidates.

FlexGen's LP (FlexGen, ICML'23, §4.3; docs/cost-model.md §7): for a fixed block shape (gpu_batch_size, num_gpu_batches), nine placement
fractions (weights, KV cache, activations over GPU/CPU/disk) are continuous; the latency of one block is
  T = T_pre · L + T_gen · L · (n − 1),
with T_pre and T_gen the per-layer maxima of the H2D, D2H, disk and compute times of the prefill and an average
decode step (context s + n/2), subject to peak memory per tier. Minimise T / block size. The terms here are built
from ``offsim.core.costmodel`` (the functions the simulator prices ops with), so the LP and the simulator agree up to what
an average step and a max-of-streams bound leave out; the search therefore simulates the best LP candidates and
keeps the best *simulated* one (``offsim.search``).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from offsim.core import costmodel as cm
from offsim.core import footprint as fp
from offsim.core.solvers import run_quietly
from offsim.core.specs import NO_COMPRESSION, Compression, HardwareSpec, ModelSpec, Workload

GPU_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
NUM_GPU_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16)
VARS = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc")
TIE_BREAK = 1e-3  # weight of total traffic time against the block time in the LP objective


# ----------------------------------------------------------------------------------------------------------------
# FlexGen's LP
# ----------------------------------------------------------------------------------------------------------------
def flexgen_terms(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, gbs: int, nb: int,
                  x: dict[str, Any], cpu_attention: bool, sublayer: bool = True,
                  comp: Compression = NO_COMPRESSION) -> dict[str, Any]:
    """Per-layer time terms and per-tier peak memory of FlexGen's cost model for placement fractions ``x``
    (floats or cvxpy expressions). Returns {'pre': [terms], 'gen': [terms], 'mem': {tier: bytes}}.

    Memory is ``footprint.tier_bytes`` -- the formula ``check_fits`` and the plans use -- with the fractions as
    variables: affine in them. Its one non-affine part, the straddling tensor of a partly resident layer's weight
    slot (at most one tensor), is left to ``check_fits`` on the rounded placement (``flexgen.fit_gpu_weights``).
    ``sublayer``: weights stream per sub-layer (FlexGen's code; TightLLM's loader streams whole layers).
    ``comp``: compression -- weights and KV move and sit at their stored sizes (``footprint.stored_*``), a decode
    KV load moves the stored KV whole (sparse attention too: ``footprint.kv_load_bytes``), and compute carries the
    dequantize / quantize passes and sparse attention (``costmodel.compute_seconds``)."""
    s, n = prompt_len, gen_len
    bls = gbs * nb
    W = fp.stored_layer_weight_bytes(model, comp)
    kv_tok = fp.stored_kv_bytes(model, bls, 1, comp=comp)  # the block's KV of one token, one layer, as stored
    kv_load_tok = fp.kv_load_bytes(model, bls, 1, comp=comp)  # ... as a decode load moves it (= kv_tok)
    hid_tok = fp.hidden_bytes(model, bls, 1)  # the block's hidden state of one token
    ctx_avg = s + n / 2  # FlexGen's average decode context
    w_off, c_off, h_off = x["wc"] + x["wd"], x["cc"] + x["cd"], x["hc"]
    T = cm.transfer_seconds

    # prefill of one layer for the whole block
    h2d_pre = T(hw, w_off * W, "h2d") + T(hw, h_off * s * hid_tok, "h2d")
    d2h_pre = T(hw, c_off * s * kv_tok, "d2h") + T(hw, h_off * s * hid_tok, "d2h")
    disk_pre = cm.disk_seconds(hw, x["wd"] * W, "read") + cm.disk_seconds(hw, x["cd"] * s * kv_tok, "write")
    comp_pre = nb * cm.compute_seconds(model, hw, "layer", gbs, s, s, graphs=False, comp=comp)
    # an average decode step of one layer for the whole block
    h2d_gen = T(hw, w_off * W, "h2d") + T(hw, h_off * hid_tok, "h2d")
    d2h_gen = T(hw, h_off * hid_tok, "d2h")
    disk_gen = cm.disk_seconds(hw, x["wd"] * W, "read") + cm.disk_seconds(hw, x["cd"] * kv_tok, "write")
    if cpu_attention:
        # QKV of the new token goes down, the attention output comes back; the CPU attends over the host cache
        d2h_gen = d2h_gen + T(hw, c_off * fp.qkv_bytes(model, bls, 1), "d2h")
        h2d_gen = h2d_gen + T(hw, c_off * fp.attn_out_bytes(model, bls, 1), "h2d")
        disk_gen = disk_gen + cm.disk_seconds(hw, x["cd"] * ctx_avg * kv_tok, "read")
        comp_gen = (nb * (cm.compute_seconds(model, hw, "pre_attn", gbs, 1, ctx_avg)
                          + cm.compute_seconds(model, hw, "post_attn", gbs, 1, ctx_avg))
                    + c_off * nb * cm.cpu_attention_seconds(model, hw, gbs, 1, ctx_avg, comp)
                    + x["cg"] * nb * cm.attention_seconds(model, hw, gbs, 1, ctx_avg, comp))
    else:
        h2d_gen = h2d_gen + T(hw, c_off * ctx_avg * kv_load_tok, "h2d")
        d2h_gen = d2h_gen + T(hw, c_off * kv_tok, "d2h")
        disk_gen = disk_gen + cm.disk_seconds(hw, x["cd"] * ctx_avg * kv_tok, "read")
        comp_gen = nb * cm.compute_seconds(model, hw, "layer", gbs, 1, ctx_avg, comp=comp)

    tiers = fp.tier_bytes(model, Workload(s, n, gbs, nb), x, cpu_attention, weight_buffers=2,
                          op_peak=_op_peak(model, s, n, gbs, cpu_attention, sublayer), sublayer=sublayer, comp=comp)
    mem = {t: sum(parts.values()) for t, parts in tiers.items()}
    return {"pre": [h2d_pre, d2h_pre, disk_pre, comp_pre], "gen": [h2d_gen, d2h_gen, disk_gen, comp_gen],
            "mem": mem}


@functools.lru_cache(maxsize=4096)
def _op_peak(model: ModelSpec, prompt_len: int, gen_len: int, gbs: int, cpu_attention: bool, sublayer: bool) -> int:
    """The block's largest op peak (``footprint.max_layer_peak_bytes``), cached: the LP asks once per shape."""
    return fp.max_layer_peak_bytes(model, Workload(prompt_len, gen_len, gbs, 1), cpu_attention, sublayer=sublayer)


def flexgen_block_seconds(terms: dict, model: ModelSpec, gen_len: int) -> float:
    """T = T_pre · L + T_gen · L · (n − 1) for float terms (the LP's objective times the block size)."""
    L = model.num_layers
    return max(terms["pre"]) * L + max(terms["gen"]) * L * (gen_len - 1)


class Affine:
    """An affine function of the placement fractions, c·x + c0: what ``flexgen_terms`` returns when given the basis
    (``Affine.basis()``). The cost model prices it like any non-number (large-transfer bandwidth), and its
    coefficients are the LP's rows (``_HighsLP``)."""

    __slots__ = ("c", "c0")

    def __init__(self, c: np.ndarray, c0: float = 0.0):
        self.c, self.c0 = c, c0

    @staticmethod
    def basis() -> dict[str, "Affine"]:
        return {k: Affine(np.eye(len(VARS))[i]) for i, k in enumerate(VARS)}

    def __add__(self, o):
        return Affine(self.c + o.c, self.c0 + o.c0) if isinstance(o, Affine) else Affine(self.c, self.c0 + o)

    __radd__ = __add__

    def __mul__(self, k):
        return Affine(self.c * k, self.c0 * k)

    __rmul__ = __mul__

    def __truediv__(self, k):
        return Affine(self.c / k, self.c0 / k)


def _affine(e) -> tuple[np.ndarray, float]:
    return (e.c, e.c0) if isinstance(e, Affine) else (np.zeros(len(VARS)), float(e))


@dataclass
class LPResult:
    gpu_batch_size: int
    num_gpu_batches: int
    cpu_attention: bool
    fractions: dict[str, float]  # the LP optimum
    seconds_per_token: float  # objective: T / block size
    percent: tuple[int, ...]  # rounded to FlexGen's six integers
    binding: list[str] = field(default_factory=list)  # memory constraints at their limit
    # pipeline parallelism (``flexgen_stage_lp``): layers per stage and micro-batch groups; () and 1 on one GPU
    stage_layers: tuple[int, ...] = ()
    micro_batches: int = 1


class _HighsLP:
    """FlexGen's LP, min w·t + tie·x over the fractions x (``VARS``) and t = (t_pre, t_gen), all >= 0, subject to
    each of weights, cache and activations placed in full, cg <= cg_max, A_k·x + b_k <= t_k per term (k: pre, gen)
    and memory per tier (normalised by capacity) M·x + m <= 1: handed to HiGHS directly (``highspy``), not through
    cvxpy, whose import (~0.6 s, scipy.stats with it) and per-solve compile (~1 ms) were a third of
    ``offsim search`` (issue 19). The columns (t, then x), the rows (the three equalities, then cg, pre, gen,
    memory) and each solve starting from the previous optimum (cvxpy's default warm start, which this LP had) are
    as cvxpy handed them to HiGHS, so the optima are the ones it found. One instance per LP shape, each with its
    own last optimum (as each had its own cvxpy problem)."""

    def __init__(self):
        self.start = None  # HiGHS's solution of the last solve when optimal: the next solve starts from it

    def solve(self, A: dict, b: dict, M: np.ndarray, m: np.ndarray, w: np.ndarray, cg_max: float,
              tie: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(x, t) at the optimum, or None when HiGHS finds none (infeasible: no placement fits memory)."""
        import highspy  # imported here: the LP-free commands skip it

        rows, upper = [], []

        def row(t_coef, x_coef, ub):
            rows.append(np.concatenate([t_coef, x_coef]))
            upper.append(ub)

        for group in (("wg", "wc", "wd"), ("cg", "cc", "cd"), ("hg", "hc")):  # equalities: placed in full
            row((0.0, 0.0), np.array([float(v in group) for v in VARS]), 1.0)
        row((0.0, 0.0), np.array([float(v == "cg") for v in VARS]), cg_max)
        for j, k in enumerate(("pre", "gen")):  # A_k·x − t_k <= −b_k
            for a_r, b_r in zip(A[k], b[k]):
                row(-np.eye(2)[j], a_r, -b_r)
        for M_r, m_r in zip(M, m):
            row((0.0, 0.0), M_r, 1 - m_r)
        dense = np.array(rows)
        n_eq = 3
        inf = highspy.kHighsInf
        model = highspy.HighsModel()
        lp = model.lp_
        lp.num_row_, lp.num_col_ = dense.shape
        lp.offset_ = 0
        lp.col_cost_ = np.concatenate([w, tie])
        lp.col_lower_ = np.zeros(lp.num_col_)
        lp.col_upper_ = np.full(lp.num_col_, inf)
        lp.row_upper_ = np.array(upper)
        lp.row_lower_ = np.concatenate([lp.row_upper_[:n_eq], np.full(len(upper) - n_eq, -inf)])
        nz = dense.T != 0  # column-wise, rows ascending within a column
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(nz.sum(1))])
        lp.a_matrix_.index_ = np.nonzero(nz)[1]
        lp.a_matrix_.value_ = dense.T[nz]
        h = run_quietly(self._run, model)
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            self.start = None
            return None
        self.start = h.getSolution()
        col = np.array(self.start.col_value) + 0.0  # (-0.0 as 0.0, as cvxpy's values had it)
        return col[2:], col[:2]

    def _run(self, model):
        import highspy

        h = highspy.Highs()
        h.setOptionValue("log_to_console", False)
        h.setOptionValue("output_flag", False)
        h.passModel(model)
        if self.start is not None:
            h.setSolution(self.start)
        h.run()
        return h


_LP = _HighsLP()
_STAGE_LP = _HighsLP()  # with pipeline stages: four memory rows (``flexgen_stage_lp``)


def flexgen_lp(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, gbs: int, nb: int,
               cpu_attention: bool = False, sublayer: bool = True,
               comp: Compression = NO_COMPRESSION) -> LPResult | None:
    """Solve FlexGen's LP for one block shape; None if no placement fits memory (or the solver gives up)."""
    terms = flexgen_terms(model, hw, prompt_len, gen_len, gbs, nb, Affine.basis(), cpu_attention, sublayer, comp)
    cap = {"gpu": hw.gpu_mem_bytes, "cpu": hw.cpu_mem_bytes, "disk": hw.disk_bytes}
    mem = [(t, terms["mem"][t], cap[t]) for t in cap]
    L, bls = model.num_layers, gbs * nb
    return _solve(_LP, terms, mem, np.array([L / bls, L * (gen_len - 1) / bls]), gbs, nb, cpu_attention)


def _solve(lp: _HighsLP, terms: dict, mem: list, w: np.ndarray, gbs: int, nb: int, cpu_attention: bool,
           **extra) -> LPResult | None:
    """Solve ``lp`` for the time ``terms`` (``flexgen_terms``' 'pre' and 'gen'), the memory rows ``mem`` ((name,
    bytes, capacity): bytes affine in the fractions) and the objective weights ``w`` (of t_pre, t_gen)."""
    A, b = {}, {}
    for k in ("pre", "gen"):
        rows = [_affine(e) for e in terms[k]]
        A[k] = np.array([r[0] for r in rows])
        b[k] = np.array([r[1] for r in rows])
    rows = [_affine(e) for _, e, _ in mem]
    # each row as a share of its tier's capacity; a tier of 0 bytes (hardware without a disk) as one of 1 byte:
    # nothing can be placed there, and the LP says so instead of dividing by zero
    cap = [max(c, 1) for _, _, c in mem]
    M = np.array([r[0] / c for r, c in zip(rows, cap)])
    m = np.array([r[1] / c for r, c in zip(rows, cap)])
    # tie-break: among equally fast placements prefer the one that moves least (an LP optimum is often
    # degenerate when one stream dominates; the others' traffic still costs in a real schedule)
    tie = TIE_BREAK * w.sum() * (A["pre"].sum(0) + A["gen"].sum(0))
    opt = lp.solve(A, b, M, m, w, 0.0 if cpu_attention else 1.0, tie)
    if opt is None:
        return None
    x, t = opt
    fr = {k: float(np.clip(x[j], 0, 1)) for j, k in enumerate(VARS)}
    use = M @ x + m
    binding = [name for (name, _, _), u in zip(mem, use) if u > 1 - 1e-4]
    sec_per_tok = float(w @ t)
    return LPResult(gbs, nb, cpu_attention, fr, sec_per_tok, round_percent(fr), binding, **extra)


def stage_splits(num_layers: int, num_stages: int, spread: int = 2) -> list[tuple[int, ...]]:
    """Layers per stage that the pipeline search tries: the balanced split first (``schedule.balanced_stages``'
    default), then the last stage with up to ``spread`` layers fewer or more than L // S, the other stages
    balanced. Only the last stage differs in memory -- it sends nothing on (``footprint.p2p_send_bytes``); every
    stage holds the embeddings, as offexec keeps them -- and in time (it also runs the LM head, the first stage the
    embedding: small beside a stage's layers), so these are the splits that can gain."""
    from offsim.policies.schedule import balanced_stages

    def layers(n: int, k: int) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in balanced_stages(n, k))

    if num_stages == 1:
        return [(num_layers,)]
    out = [layers(num_layers, num_stages)]
    q = num_layers // num_stages
    for last in range(q - spread, q + spread + 1):
        if last >= 1 and num_layers - last >= num_stages - 1:
            split = layers(num_layers - last, num_stages - 1) + (last,)
            if split not in out:
                out.append(split)
    return out


def flexgen_stage_lp(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, gbs: int, nb: int,
                     layers: tuple[int, ...], micro_batches: int | None = None, cpu_attention: bool = False,
                     sublayer: bool = True, comp: Compression = NO_COMPRESSION,
                     gpus_per_node: int = 0) -> LPResult | None:
    """FlexGen's LP for a pipeline of ``len(layers)`` stages, one GPU each (``layers``: decoder layers per stage),
    the block's ``nb`` GPU batches in ``micro_batches`` groups (default min(S, nb), the plan's). The placement
    fractions apply within every stage, as the plan's percentages do.

    Time: a stage computes one group at a time, so the per-layer terms are ``flexgen_terms``' for a group's GPU
    batches (⌈nb / G⌉: a stage streams its weights once per group and step). A decode step keeps every stage busy
    with its G groups when G >= S, else each group's step crosses the S stages before its next: max(G, S) group
    passes of the longest stage (l_max layers); prefill fills and drains the pipeline, G + S − 1 of them. So
    T = (G + S − 1) · l_max · t_pre + max(G, S) · l_max · (n − 1) · t_gen per block (S = G = 1: FlexGen's). Each
    GPU has its own links, but the disk and the host CPU are one for all stages: their terms (disk traffic, CPU
    attention) count every stage's and group's layers, G · L per step, scaled into t_pre and t_gen so that the
    objective prices them at that. Memory (``footprint.tier_bytes`` of a stage's layers with the whole block's KV
    and activations): two GPU rows, the largest sending stage (with its sends in flight) and the last stage, each
    at most one GPU's budget; host memory and disk summed over the stages (one host).

    ``gpus_per_node`` (0: one host): the stages on nodes of that many GPUs, each node a host of its own. The disk's
    and the CPU's terms then count the layers of the node with the most (G · L_node per step), and the host memory
    and disk rows are that node's stages' sums (a stage's host bytes grow with its layers, and every node holds as
    many stages, so that node's are the largest). The network between nodes is left out (hidden states: small
    beside a stage's weights)."""
    from offsim.policies.schedule import node_sums, stage_model, stage_nodes

    S = len(layers)
    G = micro_batches or min(S, nb)
    nb_g = -(-nb // G)
    x = Affine.basis()
    terms = flexgen_terms(model, hw, prompt_len, gen_len, gbs, nb_g, x, cpu_attention, sublayer, comp)
    l_max, bls = max(layers), gbs * nb
    passes = {"pre": G + S - 1, "gen": max(G, S)}
    nodes = stage_nodes(S, gpus_per_node)
    node_layers = node_sums(list(layers), nodes)
    host = node_layers.index(max(node_layers))  # the node with the most layers: its disk, CPU and host memory bind
    L_host = node_layers[host]
    for k, i_disk in (("pre", 2), ("gen", 2)):  # a node's disk: G · L_host layers' traffic per step, not one stage's
        terms[k][i_disk] = terms[k][i_disk] * (G * L_host / (passes[k] * l_max))
    if cpu_attention:  # a node's host CPU: its attention (in the compute row, as FlexGen's) for G · L_host layers too
        ctx_avg = prompt_len + gen_len / 2
        cpu = (x["cc"] + x["cd"]) * (nb_g * cm.cpu_attention_seconds(model, hw, gbs, 1, ctx_avg, comp))
        terms["gen"][3] = terms["gen"][3] + cpu * (G * L_host / (passes["gen"] * l_max) - 1)
    wl = Workload(prompt_len, gen_len, gbs, nb)
    peak = _op_peak(model, prompt_len, gen_len, gbs, cpu_attention, sublayer)
    tiers: dict[int, dict] = {}
    for n_layers in set(layers):
        t = fp.tier_bytes(stage_model(model, 0, n_layers), wl, x, cpu_attention, weight_buffers=2, op_peak=peak,
                          sublayer=sublayer, comp=comp)
        tiers[n_layers] = {k: sum(v.values()) for k, v in t.items()}
    sending = max(layers[:-1]) if S > 1 else layers[-1]
    mem = [("gpu (sending stage)", tiers[sending]["gpu"] + (fp.p2p_send_bytes(model, wl) if S > 1 else 0),
            hw.gpu_mem_bytes),
           ("gpu (last stage)", tiers[layers[-1]]["gpu"], hw.gpu_mem_bytes),
           ("cpu", sum(tiers[n]["cpu"] for n, nd in zip(layers, nodes) if nd == host), hw.cpu_mem_bytes),
           ("disk", sum(tiers[n]["disk"] for n, nd in zip(layers, nodes) if nd == host), hw.disk_bytes)]
    w = np.array([passes["pre"] * l_max / bls, passes["gen"] * l_max * (gen_len - 1) / bls])
    return _solve(_STAGE_LP, terms, mem, w, gbs, nb, cpu_attention, stage_layers=tuple(layers), micro_batches=G)


def round_percent(fr: dict[str, float]) -> tuple[int, int, int, int, int, int]:
    """FlexGen's six integers from fractions, rounding down the GPU shares so memory stays within the LP's."""
    wg = int(math.floor(fr["wg"] * 100 + 1e-6))
    wc = 100 - wg if fr["wd"] < 5e-3 else min(100 - wg, int(math.floor(fr["wc"] * 100 + 1e-6)))
    cg = int(math.floor(fr["cg"] * 100 + 1e-6))
    cc = 100 - cg if fr["cd"] < 5e-3 else min(100 - cg, int(math.floor(fr["cc"] * 100 + 1e-6)))
    ag = 100 if fr["hg"] >= 0.5 else 0
    return (wg, wc, cg, cc, ag, 100 - ag)


def block_shapes(batch: int | None = None, gpu_batch_sizes: Iterable[int] = GPU_BATCH_SIZES,
                 num_gpu_batches: Iterable[int] = NUM_GPU_BATCHES) -> list[tuple[int, int]]:
    """(gpu_batch_size, num_gpu_batches) pairs the search tries, by number of GPU batches then batch size; with
    ``batch``, the pairs whose product is exactly ``batch`` (any GPU batch size that divides it)."""
    if batch is not None:
        return [(batch // nb, nb) for nb in num_gpu_batches if batch % nb == 0]
    return [(gbs, nb) for nb in num_gpu_batches for gbs in gpu_batch_sizes]


def flexgen_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int,
                       gpu_batch_sizes: Iterable[int] = GPU_BATCH_SIZES,
                       num_gpu_batches: Iterable[int] = NUM_GPU_BATCHES,
                       cpu_attention: Iterable[bool] = (False, True), batch: int | None = None,
                       sublayer: bool = True, comp: Compression = NO_COMPRESSION,
                       max_batch: int | None = None) -> list[LPResult]:
    """LP optimum for every block shape that fits (with ``batch`` sequences when given; at most ``max_batch`` when
    given), best (lowest seconds per token) first. ``sublayer``: weights stream per sub-layer (FlexGen) or whole
    layers (TightLLM). ``comp``: the compression every candidate runs with (CPU attention is left out with
    compressed weights or cache, as FlexGen turns it off)."""
    out = []
    for ca in cpu_attention:
        if ca and (comp.weight or comp.cache):
            continue
        too_big: set[int] = set()  # num_gpu_batches whose smaller GPU batch already did not fit
        for gbs, nb in block_shapes(batch, gpu_batch_sizes, num_gpu_batches):
            if nb in too_big or (max_batch is not None and gbs * nb > max_batch):
                continue  # a larger GPU batch needs more memory still; a cap on sequences per block
            r = flexgen_lp(model, hw, prompt_len, gen_len, gbs, nb, ca, sublayer, comp)
            if r is None:
                too_big.add(nb)
                continue
            out.append(r)
    return sorted(out, key=lambda r: r.seconds_per_token)


SPLIT_REFINE_TOP = 6  # the pipeline search tries other splits and micro-batches for this many best LP optima


def flexgen_stage_candidates(model: ModelSpec, hw: HardwareSpec, prompt_len: int, gen_len: int, num_stages: int,
                             gpu_batch_sizes: Iterable[int] = GPU_BATCH_SIZES,
                             num_gpu_batches: Iterable[int] = NUM_GPU_BATCHES,
                             cpu_attention: Iterable[bool] = (False, True), batch: int | None = None,
                             sublayer: bool = True, comp: Compression = NO_COMPRESSION,
                             refine: int = SPLIT_REFINE_TOP, gpus_per_node: int = 0) -> list[LPResult]:
    """``flexgen_candidates`` for a pipeline of ``num_stages`` GPUs (``flexgen_stage_lp``): the LP optimum of every
    block shape on the balanced split with FlexGen's min(S, nb) micro-batch groups (the stages overlap; each streams
    its weights once per group and step), then, for the ``refine`` best of them, on every split of
    ``stage_splits`` with those groups and with one group (the stages take turns; weights stream once per step: what
    a shared disk that streams the weights favours); all of them, best (lowest seconds per token) first.
    ``gpus_per_node``: the stages' nodes (``flexgen_stage_lp``; 0: one host)."""
    splits = stage_splits(model.num_layers, num_stages)
    out = []
    for ca in cpu_attention:
        if ca and (comp.weight or comp.cache):
            continue
        too_big: set[int] = set()
        for gbs, nb in block_shapes(batch, gpu_batch_sizes, num_gpu_batches):
            if nb in too_big:
                continue
            r = flexgen_stage_lp(model, hw, prompt_len, gen_len, gbs, nb, splits[0], None, ca, sublayer, comp,
                                 gpus_per_node)
            if r is None:
                too_big.add(nb)
                continue
            out.append(r)
    out.sort(key=lambda r: r.seconds_per_token)
    more = []
    for r in out[:refine]:
        for g in sorted({r.micro_batches, 1}, reverse=True):
            for split in splits:
                if (g, split) != (r.micro_batches, splits[0]):
                    r2 = flexgen_stage_lp(model, hw, prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches,
                                          split, g, r.cpu_attention, sublayer, comp, gpus_per_node)
                    if r2 is not None:
                        more.append(r2)
    return sorted(out + more, key=lambda r: r.seconds_per_token)


def _silence_cvxpy():
    warnings.filterwarnings("ignore", module="cvxpy")


_silence_cvxpy()
