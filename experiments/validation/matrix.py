"""Validation matrix (issue 6): run many plans on the GPU with offexec, save each measured run as a committed case
(``offsim.analysis.validate`` schema: metrics, per-step latency, op time per (step, layer, kind)), then re-simulate them.

One process per model generates the random weights once and runs every configuration of that model. Each
configuration's settings come from offsim's own search on the machine's profile under the GPU budget (so every
policy runs at its best), with the host-memory capacity reduced by the executor's master copy of the weights.

    python -m experiments.validation.matrix --profile results/profiles/h200.json --out results/validation \
        --models opt-6.7b llama-3-8b            # on the H200
    python -m experiments.validation.matrix --device cpu --quick --out /tmp/v   # CPU smoke test (tiny model)

Matrix v2 (issue 13): a seeded draw over five models, GPU budgets, prompt and generation lengths, every policy (CPU
attention and the disk tier among them), each at its best setting by offsim's search at the full budget, split into
a calibration set and a held-out set *before* anything is measured (the split is in the config). Runs are
resumable: a case whose file exists is skipped.

    python -m experiments.validation.matrix --v2-seed 2026 --plan-only results/validation/matrix_v2_config.json
    python -m experiments.validation.matrix --v2-mixed-seed 2026 --plan-only \
        results/validation/matrix_v2_mixed_config.json          # mixed prompt lengths, split the same way
    python -m experiments.validation.matrix --v2-coverage-seed 2026 --plan-only \
        results/validation/matrix_v2_coverage_config.json       # a calibration case per held-out-only variant
    python -m experiments.validation.matrix --v2-gen-coverage-seed 2026 --profile results/profiles/h200_offexec.json \
        --plan-only results/validation/matrix_v2_gencoverage_config.json --coverage-of results/validation/matrix_v2_config.json \
        results/validation/matrix_v2_mixed_config.json results/validation/matrix_v2_coverage_config.json
                                                                # a calibration case per variant at its held-out gen
    python -m experiments.validation.matrix --v2-fresh-heldout-seed 2026 --profile results/profiles/h200_offexec.json \
        --plan-only results/validation/matrix_v2_fresh_heldout_config.json --coverage-of \
        results/validation/matrix_v2_{,mixed_,coverage_,gencoverage_}config.json
                                                                # ten new held-out cases, predictions registered first
    python -m experiments.validation.matrix --v2-regime-coverage-seed 2026 --profile results/profiles/h200_offexec.json \
        --plan-only results/validation/matrix_v2_regime_coverage_config.json --coverage-of \
        results/validation/matrix_v2_{,mixed_,coverage_,gencoverage_,fresh_heldout_}config.json
                                                                # calibration cases per placement regime at its held-out gen
    python -m experiments.validation.matrix --config results/validation/matrix_v2_config.json \
        --out results/validation --warmup --disk-dir DIR --commit C          # on the H200: h200_calib/, h200_heldout/

OPT has 2048 learned positions: for prompt 2048 its position table is extended (random weights), as docs/anchors.md §2
says FlexGen's code needs too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

from experiments.common import case_tag, finish, predicted_within, provenance, searched_case
from offsim import POLICIES, Workload, build_plan, get_hardware, get_model, simulate
from offsim.core.errors import OffsimError
from offsim.search import search
from offsim.analysis.validate import case_from_trace, save_case

GiB = 1 << 30
# (model, GPU budget GiB, prompt lengths) -> every policy at each prompt length
MATRIX = {
    "opt-6.7b": [(8, (512, 2048))],
    "llama-3-8b": [(8, (512, 2048))],
    "opt-13b": [(16, (512,)), (24, (2048,))],
    "opt-30b": [(16, (512,)), (24, (512,))],
}
MAX_BATCH = 64  # prompts per run: keeps each measured run to seconds (device time is scarce)
HEADROOM = 0.85  # settings are chosen for 85 % of the budget: PyTorch's allocator needs slack the plan does not count
VARIANTS = [("static-accelerate", {}), ("static-zero", {}), ("flexgen", {"cpu_attention": False}),
            ("flexgen", {"cpu_attention": True}), ("tightllm", {}), ("selectn", {})]


def settings_for(policy, fixed, model, hw, prompt_len, gen_len, quick=False):
    """The policy's best settings by offsim's search, with ``fixed`` settings forced (e.g. CPU attention);
    ``quick`` (CPU smoke test): default settings on a small block."""
    if quick:
        wl = Workload(prompt_len, gen_len, 2, 1 if policy.startswith("static") else 2)
        st = {"percent": (0, 100, 0, 100, 100, 0), **fixed} if policy == "flexgen" else {}
        return st, wl
    if policy == "flexgen":
        from offsim.policies.lp import flexgen_candidates

        cands = flexgen_candidates(model, hw, prompt_len, gen_len, cpu_attention=(fixed["cpu_attention"],))
        cands = [r for r in cands if r.gpu_batch_size * r.num_gpu_batches <= MAX_BATCH]
        for r in cands[:6]:
            st = {"percent": r.percent, "cpu_attention": r.cpu_attention}
            wl = Workload(prompt_len, gen_len, r.gpu_batch_size, r.num_gpu_batches)
            try:
                simulate(build_plan(policy, model, hw, wl, st), hw)
                return st, wl
            except OffsimError:
                continue
        raise OffsimError(f"no feasible flexgen setting with cpu_attention={fixed['cpu_attention']}")
    res = search(policy, model, hw, prompt_len, gen_len, max_sims=2, max_batch=MAX_BATCH)
    return res.settings, res.workload


# ---- matrix v2 --------------------------------------------------------------------------------------------------
V2_MODELS = ("opt-6.7b", "opt-13b", "opt-30b", "llama-2-13b", "llama-3-8b")
V2_BUDGETS_GIB = (8, 12, 16, 24, 32, 40)
V2_PROMPTS = (128, 256, 512, 1024, 2048)
V2_GENS = (16, 32, 64, 128)  # half the draws generate 64 tokens or more
V2_DISK_SHARE = 0.15  # of the draws (not Select-N's): host memory cut so that the search must use the disk
V2_DISK_HOST_GIB = 12.0  # host memory such a case may use beyond the executor's master copy of the weights
V2_MAX_PREDICTED_S = 60.0  # a draw whose predicted run is longer is redrawn (device time)
V2_TRIES = 4  # draws per case; a variant that finds no case in as many is passed over for this model
SPLITS = ("calib", "heldout")


def _drawn(tag, mname, model, policy, st, wl, budget, host, disk, plan, pm) -> dict:
    """A drawn case's config entry (printed as it is drawn): what the GPU run rebuilds and what offsim predicted."""
    print(f"  {tag}: {wl.gpu_batch_size} x {wl.num_gpu_batches} {st}, predicted {pm['total_s']:.1f} s", flush=True)
    return {"tag": tag, "model": mname, "model_config": model.to_dict(), "policy": policy, "settings": st,
            "workload": wl.to_dict(), "gpu_mem_gb": budget, "host_bytes": host, "disk": disk,
            "plan_sha256": plan.fingerprint(),
            "predicted": {k: pm[k] for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s", "total_s",
                                             "peak_gpu_bytes")}}


def _v2_draw(rng: random.Random, mname: str, policy: str, fixed: dict, profile: str, host_mem_gb: float,
             gen: int | None = None) -> tuple:
    """One v2 draw for a model and policy variant: (tag, model, hardware, budget GiB, prompt, gen, disk, host bytes)
    -- a budget, prompt and generation length, the disk tier (V2_DISK_SHARE of the draws but Select-N's: host memory
    cut to V2_DISK_HOST_GIB), the host memory beside the executor's master copy of the weights. ``gen``: that
    generation length instead of the drawn one (the draw still consumes its number: earlier configs redraw alike)."""
    base = get_model(mname)
    budget, prompt, drawn = rng.choice(V2_BUDGETS_GIB), rng.choice(V2_PROMPTS), rng.choice(V2_GENS)
    gen = drawn if gen is None else gen
    disk = policy != "selectn" and rng.random() < V2_DISK_SHARE
    model = base
    if prompt + gen - 1 > base.max_positions:  # random weights: extend OPT's learned positions (as v1)
        model = dataclasses.replace(base, max_positions=4096)
    host = int(V2_DISK_HOST_GIB * GiB) if disk else int(host_mem_gb * GiB) - base.weight_bytes()
    hw = get_hardware(profile, budget).with_(cpu_mem_bytes=max(host, GiB))
    return case_tag(mname, policy, fixed, budget, prompt, gen, disk), model, hw, budget, prompt, gen, disk, host


def _v2_case(rng: random.Random, mname: str, policy: str, fixed: dict, profile: str, host_mem_gb: float,
             taken: set, gen: int | None = None) -> dict | None:
    """One v2 draw (``_v2_draw``; ``gen`` fixes its generation length) searched at its best setting
    (``searched_case``, up to MAX_BATCH prompts, a run predicted within V2_MAX_PREDICTED_S): its config entry, or
    None (printed why) where the tag is in ``taken`` or no setting qualifies -- the caller draws again."""
    tag, model, hw, budget, prompt, gen, disk, host = _v2_draw(rng, mname, policy, fixed, profile, host_mem_gb, gen)
    if tag in taken:
        print(f"  {tag}: redrawn (drawn before)", flush=True)
        return None
    try:
        st, wl, plan, pm = searched_case(policy, fixed, model, hw, prompt, gen, MAX_BATCH, V2_MAX_PREDICTED_S)
    except OffsimError as e:
        print(f"  {tag}: redrawn ({str(e)[:120]})", flush=True)
        return None
    return _drawn(tag, mname, model, policy, st, wl, budget, host, disk, plan, pm)


def plan_v2(seed: int, per_model: int, profile: str, host_mem_gb: float) -> dict:
    """The v2 config: ``per_model`` cases per model, each variant in turn; a draw with no feasible setting or a
    predicted run over V2_MAX_PREDICTED_S is redrawn, up to V2_TRIES times, then the next variant takes the turn.
    Then ``split_cases``."""
    rng = random.Random(seed)
    cases: list[dict] = []
    for mname in V2_MODELS:
        _draw_model(rng, mname, per_model, profile, host_mem_gb, cases)
    split_cases(cases, seed)
    return _config(seed, profile, host_mem_gb, cases)


def _config(seed: int, profile: str, host_mem_gb: float, cases: list[dict], kind: str | None = None,
            gaps: list | None = None) -> dict:
    """A matrix v2 config document (``--plan-only``): its draw (seed, profile, host memory), which extension it is
    (``kind``: a key set true) and the gaps it fills, how many cases each split holds, provenance and the cases."""
    return {"schema": "offsim.matrix/2", "seed": seed, **({kind: True} if kind else {}), "profile": profile,
            "host_mem_gb": host_mem_gb, "splits": {s: sum(c["split"] == s for c in cases) for s in SPLITS},
            **({"gaps": gaps} if gaps is not None else {}), "provenance": provenance(), "cases": cases}


def _draw_model(rng: random.Random, mname: str, per_model: int, profile: str, host_mem_gb: float, cases: list,
                start: int = 0, taken: frozenset = frozenset(), seen: frozenset = frozenset()) -> None:
    """v2's draws for one model, appended to ``cases``: ``per_model`` of them, the policy variants in turn from
    VARIANTS[``start``]; a variant with no qualifying draw in V2_TRIES passes its turn to the next. A draw qualifies
    when ``_v2_case`` finds a setting, its tag is none of ``cases``' and ``taken``, and its workload (model, variant,
    prompt, generation) none of ``seen``."""
    made = turn = tries = 0
    while made < per_model and turn < made + 2 * len(VARIANTS):
        if tries == V2_TRIES:  # this variant found nothing: the next one's turn
            turn, tries = turn + 1, 0
        tries += 1
        policy, fixed = VARIANTS[(start + turn) % len(VARIANTS)]
        # (a tag drawn before is drawn again; v2's committed config nevertheless holds one such repeat)
        c = _v2_case(rng, mname, policy, fixed, profile, host_mem_gb, {c["tag"] for c in cases} | taken)
        if c is None:
            continue
        if _workload_of(c) in seen:
            print(f"  {c['tag']}: redrawn (a workload measured before, at another budget)", flush=True)
            continue
        made, turn, tries = made + 1, turn + 1, 0
        cases.append(c)


def _workload_of(c: dict) -> tuple:
    """A config case's workload as the draws compare them: (model, variant index, prompt, generation)."""
    return c["model"], _variant(c), c["workload"]["prompt_len"], c["workload"]["gen_len"]


# a fresh held-out draw: cases per model (five models: ten cases, every policy variant in turn across them)
V2_FRESH_PER_MODEL = 2


def plan_v2_fresh_heldout(seed: int, configs: list[dict], profile: str, host_mem_gb: float,
                          per_model: int = V2_FRESH_PER_MODEL) -> dict:
    """A fresh held-out set for matrix v2 (issue 13): ``per_model`` cases per model drawn as v2 draws them, the
    policy variants in turn across the models from a seeded start (so that ten cases reach all six), every one
    held out, none repeating a tag or a workload (model, variant, prompt, generation) of ``configs``. The first
    held-out set has been reported beside every model change since it was measured; this one is drawn after the
    model was developed (written 2026-12-04, after profile v2 adopted the graphed-attention rows) and its
    predictions are registered before any is measured (``experiments.validation.preregister``): its first
    measurement tests the model as it stands, on workloads nobody has looked at."""
    rng = random.Random(f"fresh-heldout-{seed}")
    taken = frozenset(c["tag"] for doc in configs for c in doc["cases"])
    seen = frozenset(_workload_of(c) for doc in configs for c in doc["cases"])
    start = rng.randrange(len(VARIANTS))
    cases: list[dict] = []
    for i, mname in enumerate(V2_MODELS):
        _draw_model(rng, mname, per_model, profile, host_mem_gb, cases, start + i * per_model, taken, seen)
    for c in cases:
        c["split"] = "heldout"
    return _config(seed, profile, host_mem_gb, cases, "fresh_heldout")


# mixed prompt lengths (issue 13: "some batches of mixed prompt lengths"): a seeded draw of its own, the same models,
# budgets and policies; each request's prompt and generation length drawn in a range (a batch is padded to its
# longest prompt and runs until its longest generation, docs/jobs.md), settings searched at the ranges' tops
V2_MIXED_PROMPT_TOPS = (512, 1024, 2048)
V2_MIXED_PROMPT_SPREAD = (2, 4, 8)  # the shortest prompt is the top over one of these
V2_MIXED_GENS = (32, 64, 128)  # generation tops; the shortest generation is a quarter of its top


def mixed_lengths(rng: random.Random, n: int, prompt_range: tuple[int, int], gen_range: tuple[int, int]):
    """``n`` requests' (prompt_lens, gen_lens), uniform in the ranges; the first request has both tops, so that
    the workload's prompt_len and gen_len (its longest) are the ranges' tops, the lengths the settings were
    searched at."""
    (plo, phi), (glo, ghi) = prompt_range, gen_range
    if not (1 <= plo <= phi and 1 <= glo <= ghi and n >= 1):
        raise ValueError(f"bad ranges or count: prompts {prompt_range}, generations {gen_range}, {n} requests")
    prompts = [phi] + [rng.randint(plo, phi) for _ in range(n - 1)]
    gens = [ghi] + [rng.randint(glo, ghi) for _ in range(n - 1)]
    order = list(range(n))
    rng.shuffle(order)  # the longest request lands in any GPU batch
    return tuple(prompts[i] for i in order), tuple(gens[i] for i in order)


def plan_v2_mixed(seed: int, n_cases: int, profile: str, host_mem_gb: float) -> dict:
    """The mixed-length extension of matrix v2: ``n_cases`` cases over the five models in turn and the policy
    variants in turn (a variant with no feasible draw in V2_TRIES is passed over for that case), each request's
    lengths from ``mixed_lengths``; a draw predicted over V2_MAX_PREDICTED_S at the search's best batch (up to
    MAX_BATCH) is searched again at half, a quarter, an eighth of it, then redrawn. Split by ``split_cases``
    with the same seed, before anything is measured. Tags end in ``_mixed``: ``..._p{lo}-{hi}_g{lo}-{hi}_mixed``."""
    rng = random.Random(f"mixed-{seed}")
    cases: list[dict] = []
    turn = 0
    while len(cases) < n_cases and turn < 4 * n_cases * len(VARIANTS):
        mname = V2_MODELS[len(cases) % len(V2_MODELS)]
        policy, fixed = VARIANTS[turn % len(VARIANTS)]
        turn += 1
        base = get_model(mname)
        for _ in range(V2_TRIES):
            budget = rng.choice(V2_BUDGETS_GIB)
            phi = rng.choice(V2_MIXED_PROMPT_TOPS)
            plo = phi // rng.choice(V2_MIXED_PROMPT_SPREAD)
            ghi = rng.choice(V2_MIXED_GENS)
            glo = ghi // 4
            model = base
            if phi + ghi - 1 > base.max_positions:  # random weights: extend OPT's learned positions (as v1)
                model = dataclasses.replace(base, max_positions=4096)
            host = int(host_mem_gb * GiB) - base.weight_bytes()  # the executor keeps a host master copy
            hw = get_hardware(profile, budget).with_(cpu_mem_bytes=max(host, GiB))
            tag = (f"{mname}_{policy}{'-cpuattn' if fixed.get('cpu_attention') else ''}_b{budget}_p{plo}-{phi}"
                   f"_g{glo}-{ghi}_mixed")
            if any(c["tag"] == tag for c in cases):
                continue
            try:
                for max_batch in (MAX_BATCH, MAX_BATCH // 2, MAX_BATCH // 4, MAX_BATCH // 8):
                    try:  # a long generation at the largest batch outlasts the device time: a smaller batch
                        st, uniform, _, _ = searched_case(policy, fixed, model, hw, phi, ghi, max_batch,
                                                          V2_MAX_PREDICTED_S)
                        break
                    except OffsimError as e:
                        if "predicted" not in str(e) or max_batch == MAX_BATCH // 8:
                            raise
                prompt_lens, gen_lens = mixed_lengths(rng, uniform.num_prompts, (plo, phi), (glo, ghi))
                wl = Workload(phi, ghi, uniform.gpu_batch_size, uniform.num_gpu_batches, prompt_lens=prompt_lens,
                              gen_lens=gen_lens)
                plan, pm = predicted_within(policy, model, hw, wl, st, V2_MAX_PREDICTED_S)
            except OffsimError as e:
                print(f"  {tag}: redrawn ({str(e)[:120]})", flush=True)
                continue
            cases.append(_drawn(tag, mname, model, policy, st, wl, budget, host, False, plan, pm))
            break
    split_cases(cases, seed)
    return _config(seed, profile, host_mem_gb, cases, "mixed")


def _variant(c: dict) -> int:
    """A config case's index into VARIANTS."""
    return VARIANTS.index((c["policy"], {"cpu_attention": True} if c["settings"].get("cpu_attention") else
                           {"cpu_attention": False} if c["policy"] == "flexgen" else {}))


def coverage_gaps(configs: list[dict]) -> list[tuple[str, int]]:
    """(model, index into VARIANTS) of every model and policy variant the configs measure (in either set) with no
    calibration case: where the held-out set would test the model on something it was never developed on."""
    seen: dict[tuple, set] = {}
    for doc in configs:
        for c in doc["cases"]:
            seen.setdefault((c["model"], _variant(c)), set()).add(c["split"])
    return sorted(k for k, splits in seen.items() if "calib" not in splits)


def gen_coverage_gaps(configs: list[dict]) -> list[tuple[str, int, int]]:
    """(model, index into VARIANTS, generation length) of every model and policy variant whose longest held-out
    generation is longer than its longest calibration one, at that held-out length: where the held-out set tests
    the model at a decode length it was never developed on for that variant (a longer decode: more steps over a
    longer context, more of the KV cache to load or recompute). A variant with no calibration case at all is
    ``coverage_gaps``' (its first draw) and is left to it. Mixed-length cases count by their longest generation."""
    longest: dict[tuple, dict] = {}
    for doc in configs:
        for c in doc["cases"]:
            g = longest.setdefault((c["model"], _variant(c)), {})
            g[c["split"]] = max(g.get(c["split"], 0), int(c["workload"]["gen_len"]))
    return sorted((m, v, g["heldout"]) for (m, v), g in longest.items()
                  if "calib" in g and g.get("heldout", 0) > g["calib"])


def _fill_gaps(rng: random.Random, gaps: list[tuple], configs: list[dict], profile: str, host_mem_gb: float,
               held: set | None = None) -> list[dict]:
    """One calibration case per gap (model, index into VARIANTS, generation length or None: drawn): v2 draws
    (``_v2_case``) until one qualifies, up to 2 x V2_TRIES; its tag new to ``configs``, and where ``held`` is given
    its (model, variant, prompt, generation) none of those. A gap with no qualifying draw is printed and passed
    over."""
    taken = {c["tag"] for doc in configs for c in doc["cases"]}
    cases: list[dict] = []
    for mname, v, gen in gaps:
        policy, fixed = VARIANTS[v]
        for _ in range(2 * V2_TRIES):
            c = _v2_case(rng, mname, policy, fixed, profile, host_mem_gb, taken, gen)
            if c is None:
                continue
            if held is not None and _workload_of(c) in held:
                print(f"  {c['tag']}: redrawn (a held-out workload at another budget)", flush=True)
                taken.add(c["tag"])
                continue
            c["split"] = "calib"
            cases.append(c)
            taken.add(c["tag"])
            break
        else:
            print(f"  {mname} {policy} {fixed}{'' if gen is None else f' gen {gen}'}: no feasible draw in "
                  f"{2 * V2_TRIES}", flush=True)
    return cases


def plan_v2_coverage(seed: int, configs: list[dict], profile: str, host_mem_gb: float) -> dict:
    """Matrix v2's coverage extension (issue 13): one calibration case for each model and policy variant that the
    configs measure only in the held-out set (``coverage_gaps``), drawn as v2 draws (budget, prompt, generation,
    the disk tier's share; redrawn up to 2 x V2_TRIES times), every one in the calibration set. The rule is
    coverage, not error: it names the gaps from the configs alone, and the draws are seeded, so the cases do not
    copy a held-out workload. Tags never repeat a config's."""
    rng = random.Random(f"coverage-{seed}")
    cases = _fill_gaps(rng, [(m, v, None) for m, v in coverage_gaps(configs)], configs, profile, host_mem_gb)
    return _config(seed, profile, host_mem_gb, cases, "coverage",
                   gaps=[[m, VARIANTS[v][0], VARIANTS[v][1]] for m, v in coverage_gaps(configs)])


def plan_v2_gen_coverage(seed: int, configs: list[dict], profile: str, host_mem_gb: float) -> dict:
    """Matrix v2's generation-length coverage (issue 13): one calibration case for each model and policy variant at
    the longest generation its held-out cases run and its calibration cases do not (``gen_coverage_gaps``), the
    budget, prompt and disk tier drawn as v2 draws them (up to 2 x V2_TRIES draws), every one in the calibration
    set. Coverage, not error: the rule reads the configs alone (written 2026-12-04, after the held-out results were
    seen: its README says so); the predictions are registered before any is measured
    (``experiments.validation.preregister``)."""
    rng = random.Random(f"gen-coverage-{seed}")
    gaps = gen_coverage_gaps(configs)
    # a held-out workload (model, variant, prompt, generation) is never drawn again at another budget: with the
    # generation fixed, a repeated prompt would copy a held-out case into the calibration set
    held = {_workload_of(c) for doc in configs for c in doc["cases"] if c["split"] == "heldout"}
    cases = _fill_gaps(rng, gaps, configs, profile, host_mem_gb, held)
    return _config(seed, profile, host_mem_gb, cases, "gen_coverage",
                   gaps=[[m, VARIANTS[v][0], VARIANTS[v][1], gen] for m, v, gen in gaps])


def placement_regime(c: dict) -> str | None:
    """A config case's placement regime, from its settings' FlexGen six numbers: whether the weights are all on the
    GPU ('weights on GPU' / 'weights offloaded') and where the KV cache is ('KV on GPU', 'KV split' between the GPU
    and the host or disk, 'KV off GPU'). None for policies without a placement (static-*, Select-N). The regime
    says what a decode step moves and computes: a plan whose weights stay and whose KV is split (TightLLM then
    recomputes part of a small offloaded share) runs a different step from one that streams its weights."""
    p = c["settings"].get("percent")
    if p is None:
        return None
    kv = "KV on GPU" if p[2] == 100 else "KV off GPU" if p[2] == 0 else "KV split"
    return f"{'weights on GPU' if p[0] == 100 else 'weights offloaded'}, {kv}"


def regime_coverage_gaps(configs: list[dict]) -> list[tuple[int, str, int]]:
    """(index into VARIANTS, placement regime, generation length) of every policy variant and placement regime
    (``placement_regime``) whose longest held-out generation is longer than its longest calibration one (or that
    has no calibration case at all), at that held-out length: where the held-out set tests a kind of decode step,
    at a decode length, the model was never developed on. Across models: a regime is the plan's shape, which the
    draw then finds on whichever model and budget give it."""
    longest: dict[tuple, dict] = {}
    for doc in configs:
        for c in doc["cases"]:
            reg = placement_regime(c)
            if reg is None:
                continue
            g = longest.setdefault((_variant(c), reg), {})
            g[c["split"]] = max(g.get(c["split"], 0), int(c["workload"]["gen_len"]))
    return sorted((v, reg, g["heldout"]) for (v, reg), g in longest.items()
                  if g.get("heldout", 0) > g.get("calib", 0))


V2_REGIME_CASES = 2  # calibration cases per regime gap, each on another model
V2_REGIME_TRIES = 48  # draws per gap: the search, not the draw, decides the placement, so most draws miss the regime


def plan_v2_regime_coverage(seed: int, configs: list[dict], profile: str, host_mem_gb: float) -> dict:
    """Matrix v2's placement-regime coverage (issue 13): for each gap of ``regime_coverage_gaps``, up to
    V2_REGIME_CASES calibration cases on different models whose searched placement falls in that regime, at that
    generation length; budget, prompt and the disk tier drawn as v2 draws them (the models in a seeded order, up to
    V2_REGIME_TRIES draws per gap; a draw that lands in another gap of the same variant and length still short of
    cases counts there), never a held-out workload (model, variant, prompt, generation) at another budget.
    Coverage, not error: the rule reads the configs alone (written 2026-12-05, after the held-out results were seen:
    the README says so); the predictions are registered before any is measured (``experiments.validation.preregister``)."""
    rng = random.Random(f"regime-coverage-{seed}")
    gaps = regime_coverage_gaps(configs)
    held = {_workload_of(c) for doc in configs for c in doc["cases"] if c["split"] == "heldout"}
    taken = {c["tag"] for doc in configs for c in doc["cases"]}
    used: dict[tuple, set] = {g: set() for g in gaps}  # gap -> the models of its cases
    cases: list[dict] = []
    for gap in gaps:
        v, reg, gen = gap
        policy, fixed = VARIANTS[v]
        models = list(V2_MODELS)
        rng.shuffle(models)
        for i in range(V2_REGIME_TRIES):
            free = [m for m in models if m not in used[gap]]
            if len(used[gap]) >= V2_REGIME_CASES or not free:
                break
            mname = free[i % len(free)]
            c = _v2_case(rng, mname, policy, fixed, profile, host_mem_gb, taken, gen)
            if c is None:
                continue
            taken.add(c["tag"])
            home = (v, placement_regime(c), gen)
            if home not in used or len(used[home]) >= V2_REGIME_CASES or mname in used[home]:
                print(f"  {c['tag']}: redrawn (placement {c['settings']['percent']}: {placement_regime(c)}, "
                      f"not a regime still short of cases)", flush=True)
                continue
            if _workload_of(c) in held:
                print(f"  {c['tag']}: redrawn (a held-out workload at another budget)", flush=True)
                continue
            c["split"] = "calib"
            cases.append(c)
            used[home].add(mname)
    for (v, reg, gen), ms in used.items():
        if len(ms) < V2_REGIME_CASES:
            print(f"  {VARIANTS[v][0]} {VARIANTS[v][1]} {reg} gen {gen}: {len(ms)} of {V2_REGIME_CASES} cases",
                  flush=True)
    return _config(seed, profile, host_mem_gb, cases, "regime_coverage",
                   gaps=[[VARIANTS[v][0], VARIANTS[v][1], reg, gen] for v, reg, gen in gaps])


def case_settings(c: dict, kv_solver: str | None = None) -> dict:
    """A config case's settings as a run uses them: with ``kv_solver`` TightLLM's N_r by that solver ('exact': the
    ILP's N_r on its exact path, no cvxpy needed on the GPU machine)."""
    if kv_solver and c["policy"] == "tightllm":
        return {**c["settings"], "kv_solver": kv_solver}
    return c["settings"]


def case_plan(c: dict, model, profile: str):
    """(plan, hardware, workload) of a config case as its GPU run builds it: on ``profile`` at the case's GPU budget,
    with the host memory it was drawn with (v2: the disk cases' cut), from ``c['settings']``."""
    base = get_hardware(profile, c["gpu_mem_gb"])
    if "host_bytes" in c:
        base = base.with_(cpu_mem_bytes=max(int(c["host_bytes"]), GiB))
    wl = Workload.from_dict(c["workload"])
    return build_plan(c["policy"], model, base, wl, c["settings"]), base, wl


def split_cases(cases: list[dict], seed: int) -> None:
    """Each case's set, 'calib' or 'heldout', drawn before anything is measured: within each policy variant (CPU
    attention apart, the disk tier apart) the cases are shuffled by ``seed`` and dealt alternately, from a
    seeded side, so both sets hold every variant."""
    rng = random.Random(f"split-{seed}")
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault((c["policy"], bool(c["settings"].get("cpu_attention")), c.get("disk", False)), []).append(c)
    for key in sorted(groups, key=str):
        g = groups[key]
        rng.shuffle(g)
        first = rng.randrange(2)
        for i, c in enumerate(g):
            c["split"] = SPLITS[(i + first) % 2]


def plan_cases(args) -> list[dict]:
    """Choose every case's settings with offsim's search (no GPU needed): the config the GPU run executes."""
    matrix = {"opt-125m": [(1.0, (32,))]} if args.quick else {m: MATRIX[m] for m in args.models}
    gen_len = 3 if args.quick else args.gen_len
    cases = []
    for mname, configs in matrix.items():
        model = get_model(mname)
        if model.family == "opt" and max(p for _, ps in configs for p in ps) + gen_len > model.max_positions:
            model = dataclasses.replace(model, max_positions=4096)  # random weights: extend OPT's positions
        if args.device != "cuda":
            model = dataclasses.replace(model, dtype_bytes=4)  # fp32 on the CPU
        for budget_gb, prompts in configs:
            host = int(args.host_mem_gb * GiB) - model.weight_bytes()  # the executor keeps a host master copy
            hw = get_hardware(args.profile, budget_gb * (1.0 if args.quick else HEADROOM))
            hw = hw.with_(cpu_mem_bytes=max(host, 1 << 30))
            for prompt_len in prompts:
                for policy, fixed in VARIANTS:
                    if policy not in POLICIES:
                        continue
                    tag = f"{mname}_{policy}{'-cpuattn' if fixed.get('cpu_attention') else ''}_p{prompt_len}" \
                          f"_g{budget_gb:g}"
                    try:
                        st, wl = settings_for(policy, fixed, model, hw, prompt_len, gen_len, args.quick)
                        build_plan(policy, model, hw, wl, st)
                    except OffsimError as e:
                        print(f"  {tag}: no setting ({e})", flush=True)
                        continue
                    cases.append({"tag": tag, "model": mname, "model_config": model.to_dict(), "policy": policy,
                                  "settings": st, "workload": wl.to_dict(), "gpu_mem_gb": budget_gb})
                    print(f"  {tag}: {wl.gpu_batch_size} x {wl.num_gpu_batches} {st}", flush=True)
    return cases


def median_run(runs: list[tuple]) -> tuple:
    """Of K measured runs ``(total tok/s, ...)``, the one of median throughput (the lower middle for even K): one
    slow outlier (a host hiccup, a clock dip) moves neither the case nor its error; all K totals stay in the case
    (its spread, ``validate``'s ``measured_spread``)."""
    return sorted(runs, key=lambda t: t[0])[(len(runs) - 1) // 2]


def warmup_plan(plan, policy: str, model, hw, wl: Workload, settings: dict, mode: str = "short"):
    """The unmeasured run before a case's measured runs. 'short': the same policy and settings for 2 tokens (the
    prefill's shapes and one decode step); 'same-length': 2 tokens after a prompt of prompt_len + gen_len - 2, so
    that the KV buffers and the graphed decode attention over them have the measured run's full length (uniform
    batches; a mixed-length one falls back to 'short'); 'full': the case's own plan, every step (twice the time).
    Why the modes: a run's first decode op after the short warm-up cost a median 9.9 ms, a later run's 0.4 ms
    (results/validation/calib_misses.md); after 'full' run 0 is a steady-state run
    (results/validation/warmup_modes_93bb5dd/README.md). Returns (plan, the mode it is)."""
    if mode == "full":
        return plan, mode
    if mode == "same-length" and not wl.prompt_lens and wl.gen_len > 2:
        return build_plan(policy, model, hw, wl.with_(prompt_len=wl.prompt_len + wl.gen_len - 2, gen_len=2),
                          settings), mode
    from offexec.job import shortened  # per-request generation lengths capped too (mixed-length batches)

    return build_plan(policy, model, hw, shortened(wl, 2), settings), "short"


def run_cases(cases: list[dict], args) -> list[dict]:
    """Run each case on the device with offexec (weights generated once per model); save each as a case JSON."""
    import torch

    from offexec.executor import check_plan, run_plan
    from offexec.hostprobe import host_probe
    from offexec.weights import random_weights
    from offsim.core.specs import ModelSpec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    summary = []
    started = time.time()

    def record(row: dict, c: dict) -> None:
        """One line per case run or failed: in the summary, and for v2 (split) cases in matrix_v2_runs.jsonl as it
        happens (a batch killed by its time limit keeps its lines)."""
        summary.append(row)
        if "split" in c:
            with open(out / "matrix_v2_runs.jsonl", "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    by_model: dict[str, list[dict]] = {}
    for c in cases:
        done = out / (f"h200_{c['split']}" if "split" in c else "") / f"{c['tag']}.case.json"
        if done.exists() and not args.remeasure:  # measured by an earlier run: resumable
            continue
        by_model.setdefault(json.dumps(c["model_config"], sort_keys=True), []).append(c)
    for key, group in by_model.items():
        if args.time_limit_s is not None and time.time() - started > args.time_limit_s:
            print(f"{len(group)} cases of {group[0]['model']} not started (--time-limit-s)", flush=True)
            continue
        model = ModelSpec.from_dict(json.loads(key))
        dtype = torch.float16 if model.dtype_bytes == 2 else torch.float32
        t0 = time.time()
        weights = random_weights(model, 0, dtype, device=args.device, pinned=args.device == "cuda", progress=False)
        print(f"{model.name}: weights ready in {time.time() - t0:.1f} s", flush=True)
        try:
            for c in group:
                if args.time_limit_s is not None and time.time() - started > args.time_limit_s:
                    print(f"  {c['tag']}: not started (--time-limit-s)", flush=True)
                    continue
                tag, policy = c["tag"], c["policy"]
                dest = out / f"h200_{c['split']}" if "split" in c else out
                dest.mkdir(parents=True, exist_ok=True)
                c = {**c, "settings": case_settings(c, args.kv_solver)}
                try:
                    plan, base, wl = case_plan(c, model, args.profile)
                    check_plan(plan, torch.device(args.device), int(base.gpu_mem_bytes), args.disk_dir,
                               weights_loaded=True)
                    warm_mode = None
                    if args.warmup:  # unmeasured: kernel loading, cuBLAS heuristics, allocator growth
                        for mode in dict.fromkeys((args.warmup_mode, "short")):
                            try:  # a same-length warm-up's longer prefill may not fit where the case does
                                warm, warm_mode = warmup_plan(plan, policy, model, base, wl, c["settings"], mode)
                                check_plan(warm, torch.device(args.device), int(base.gpu_mem_bytes), args.disk_dir,
                                           weights_loaded=True)
                                break
                            except Exception as e:  # noqa: BLE001 - the short warm-up is checked like the case
                                if mode == "short":
                                    raise
                                print(f"  {tag}: {mode} warm-up refused ({str(e)[:120]}); short warm-up",
                                      flush=True)
                        run_plan(warm, weights, args.device, gpu_budget_bytes=int(base.gpu_mem_bytes),
                                 disk_dir=args.disk_dir)
                    probe = host_probe()  # the host's state as this case runs in it (offexec.hostprobe)
                    runs = []  # (total tok/s, result, wall s) of each measured run, in run order
                    for _ in range(args.repeats):
                        t1 = time.time()
                        r = run_plan(plan, weights, args.device, gpu_budget_bytes=int(base.gpu_mem_bytes),
                                     disk_dir=args.disk_dir, meta={"hardware": base.name})
                        runs.append((r.trace.metrics()["total_tok_s"], r, time.time() - t1))
                    kept = runs[0] if args.keep == "first" else median_run(runs)
                    _, res, wall = kept
                    repeats = [t for t, _, _ in runs]
                    kept_run = next(i for i, r in enumerate(runs) if r is kept)
                except Exception as e:  # one failed configuration must not lose the others
                    msg = str(e).split("\n")[0][:300]
                    print(f"  {tag}: FAILED {type(e).__name__}: {msg}", flush=True)
                    record({"case": tag, "error": f"{type(e).__name__}: {msg}"}, c)
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                tr = res.trace
                plan.save(dest / f"{tag}.plan.json.gz")  # what ran, op for op: `offsim validate` re-simulates it
                tr.meta.update({"plan_file": f"{tag}.plan.json.gz", "plan_sha256": plan.fingerprint(),
                                "model": c["model"], "policy": policy, "settings": plan.settings,
                                "workload": wl.to_dict(), "gpu_mem_gb": c["gpu_mem_gb"], "hardware": base.name,
                                "hardware_profile": args.profile_ref or args.profile,
                                "model_config": c["model_config"]})
                commit = {"commit": args.commit} if args.commit else {}
                case = case_from_trace(tr, **provenance(gpu=gpu, wall_s=round(wall, 2), **commit,
                                                        issue_frac=res.stats.get("issue_frac"),
                                                        # the allocator's cap and its retries (each a device-wide
                                                        # synchronisation: results/validation/allocator_cap_23ec055)
                                                        allocator_cap_bytes=res.stats.get("allocator_cap_bytes"),
                                                        allocator=res.stats.get("allocator"),
                                                        warmup=bool(args.warmup),
                                                        **({"warmup_mode": warm_mode} if warm_mode else {}),
                                                        host_mem_gb=args.host_mem_gb, host_probe=probe,
                                                        **({"repeat_total_tok_s": repeats, "kept_run": kept_run,
                                                            "kept": args.keep}
                                                           if args.repeats > 1 else {})))
                save_case(case, dest / f"{tag}.case.json")
                pred = simulate(plan, base, check_memory=False).metrics()
                m = tr.metrics()
                row = {"case": tag, "batch": wl.num_prompts, "measured_total_tok_s": m["total_tok_s"],
                       "predicted_total_tok_s": pred["total_tok_s"],
                       "err": (pred["total_tok_s"] - m["total_tok_s"]) / m["total_tok_s"],
                       "peak_gpu_GiB": m["peak_gpu_bytes"] / GiB, "wall_s": wall,
                       "alloc_retries": (res.stats.get("allocator") or {}).get("num_alloc_retries"),
                       **({"repeat_total_tok_s": repeats} if args.repeats > 1 else {})}
                record(row, c)
                print(f"  {tag}: batch {wl.num_prompts} measured {m['total_tok_s']:.1f} tok/s, offsim "
                      f"{pred['total_tok_s']:.1f} ({row['err']:+.1%}), decode {m['decode_tok_s']:.1f}, "
                      f"{wall:.1f} s", flush=True)
        finally:
            weights.close()
    if not any("split" in c for c in cases):  # v2 cases' lines are in matrix_v2_runs.jsonl (record)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h200", help="hardware profile JSON (or preset) of this machine")
    ap.add_argument("--profile-ref", default=None,
                    help="the profile path to record in each case (default: --profile), e.g. the committed copy")
    ap.add_argument("--out", help="directory for the *.case.json files (run mode)")
    ap.add_argument("--models", nargs="+", default=list(MATRIX))
    ap.add_argument("--gen-len", type=int, default=4, help="tokens per prompt (default: %(default)s)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-mem-gb", type=float, default=110.0, help="host memory the runs may use (GiB)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: opt-125m, tiny budget")
    ap.add_argument("--plan-only", metavar="CONFIG", help="choose the cases' settings and write them to CONFIG")
    ap.add_argument("--config", metavar="CONFIG", help="run the cases of CONFIG (written by --plan-only)")
    ap.add_argument("--commit", default=None,
                    help="commit to record (the device machine's copy has no .git, so provenance cannot read it)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="before each case's measured runs, an unmeasured run (--warmup-mode); on by default, as in "
                         "every case of h200_calib/ and h200_heldout/ (--no-warmup: a process's first run, kernel loading "
                         "and captures included, is measured)")
    # full by default since 2026-12-02: after it run 0's first decode step is within ~10 ms of offsim's and run 1
    # within a median 1.7 % of run 0; after 'short' step 1 ran ~80 ms longer and run 1 5 % faster
    # (results/validation/warmup_modes_93bb5dd/README.md)
    ap.add_argument("--warmup-mode", choices=("short", "same-length", "full"), default="full",
                    help="with --warmup: the same policy for 2 tokens (short), 2 tokens at the case's full length "
                         "(same-length: KV buffers and graphed attention as long as the run's), or the case's own "
                         "plan (full: the measured runs are steady-state runs, what offsim predicts); a mode that "
                         "does not fit falls back to short; recorded in the case (default: %(default)s)")
    ap.add_argument("--disk-dir", default=None, help="folder of the disk tier (a real disk: O_DIRECT)")
    ap.add_argument("--only-models", nargs="+", default=None, help="run mode: only the cases of these models")
    ap.add_argument("--only-cases", nargs="+", default=None,
                    help="run mode: only the cases whose tag contains one of these strings")
    ap.add_argument("--cases", nargs="+", default=None, metavar="TAG",
                    help="run mode: only the cases with exactly these tags (--only-cases matches substrings: "
                         "'..._g64' also selects '..._g64_disk')")
    ap.add_argument("--remeasure", action="store_true",
                    help="run mode: measure cases whose file exists again (replacing it: after an executor change)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run mode: measure each case this many times back to back (after the warm-up) and keep "
                         "the run --keep says; all totals are recorded in the case (default: %(default)s)")
    ap.add_argument("--keep", choices=("median", "first"), default="median",
                    help="with --repeats: the case is the run of median total tok/s, or the first run (what "
                         "`offexec run` measures: one run after its warm-up; later runs of the same process meet "
                         "each shape a second time); the case records which (kept_run, 0-based) "
                         "(default: %(default)s)")
    ap.add_argument("--kv-solver", default=None, choices=("ilp", "exact"),
                    help="TightLLM's N_r solver instead of the config's (exact: the ILP's answers without cvxpy)")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="run mode: start no case after this many seconds (a later run resumes)")
    ap.add_argument("--v2-seed", type=int, default=None,
                    help="plan matrix v2 with this seed (five models, every policy, split into calib/heldout)")
    ap.add_argument("--v2-per-model", type=int, default=14, help="v2 cases per model (default: %(default)s)")
    ap.add_argument("--v2-mixed-seed", type=int, default=None,
                    help="plan matrix v2's mixed-length extension with this seed (each request's prompt and "
                         "generation length drawn in a range; split into calib/heldout like v2)")
    ap.add_argument("--v2-mixed-cases", type=int, default=12,
                    help="cases of the mixed-length extension (default: %(default)s)")
    ap.add_argument("--v2-coverage-seed", type=int, default=None,
                    help="plan matrix v2's coverage extension with this seed: one calibration case per model and "
                         "policy variant that --coverage-of measures only in the held-out set")
    ap.add_argument("--v2-gen-coverage-seed", type=int, default=None,
                    help="plan matrix v2's generation-length coverage with this seed: one calibration case per "
                         "model and policy variant at the longest generation --coverage-of measures for it only in "
                         "the held-out set")
    ap.add_argument("--v2-fresh-heldout-seed", type=int, default=None,
                    help="plan a fresh held-out draw with this seed: v2's draws, a few per model, every one held "
                         "out, none repeating a workload of --coverage-of")
    ap.add_argument("--v2-regime-coverage-seed", type=int, default=None,
                    help="plan the placement-regime coverage with this seed: calibration cases for each policy "
                         "variant and placement regime (weights on the GPU or not, KV on the GPU, split or off) "
                         "whose held-out cases in --coverage-of generate longer than its calibration cases")
    ap.add_argument("--coverage-of", nargs="+", default=["results/validation/matrix_v2_config.json",
                                                          "results/validation/matrix_v2_mixed_config.json"],
                    metavar="CONFIG", help="with --v2-coverage-seed / --v2-gen-coverage-seed: the configs whose "
                                           "gaps it fills; with --v2-fresh-heldout-seed: the configs it repeats "
                                           "nothing of "
                                           "(default: %(default)s)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.config:
        doc = json.loads(Path(args.config).read_text())
        cases = doc["cases"] if isinstance(doc, dict) else doc
    elif args.v2_seed is not None:
        doc = plan_v2(args.v2_seed, args.v2_per_model, args.profile, args.host_mem_gb)
        cases = doc["cases"]
    elif args.v2_mixed_seed is not None:
        doc = plan_v2_mixed(args.v2_mixed_seed, args.v2_mixed_cases, args.profile, args.host_mem_gb)
        cases = doc["cases"]
    elif (args.v2_coverage_seed, args.v2_gen_coverage_seed, args.v2_fresh_heldout_seed,
          args.v2_regime_coverage_seed) != (None, None, None, None):
        configs = []
        for f in args.coverage_of:
            try:
                configs.append(json.loads(Path(f).read_text()))
            except (OSError, ValueError) as e:
                ap.error(f"--coverage-of {f}: cannot read a matrix config ({e})")
        if args.v2_coverage_seed is not None:
            doc = plan_v2_coverage(args.v2_coverage_seed, configs, args.profile, args.host_mem_gb)
        elif args.v2_fresh_heldout_seed is not None:
            doc = plan_v2_fresh_heldout(args.v2_fresh_heldout_seed, configs, args.profile, args.host_mem_gb)
        elif args.v2_regime_coverage_seed is not None:
            doc = plan_v2_regime_coverage(args.v2_regime_coverage_seed, configs, args.profile, args.host_mem_gb)
        else:
            doc = plan_v2_gen_coverage(args.v2_gen_coverage_seed, configs, args.profile, args.host_mem_gb)
        cases = doc["cases"]
    else:
        cases = doc = plan_cases(args)
    if args.plan_only:
        Path(args.plan_only).write_text(json.dumps(doc, indent=1, default=list))
        finish({"cases": len(cases), "config": args.plan_only})
        return
    if args.only_models:
        cases = [c for c in cases if c["model"] in args.only_models]
    if args.only_cases:
        cases = [c for c in cases if any(s in c["tag"] for s in args.only_cases)]
    if args.cases:
        unknown = sorted(set(args.cases) - {c["tag"] for c in cases})
        if unknown:
            ap.error(f"--cases: no case tagged {', '.join(unknown)} in the configuration (tags look like "
                     f"{cases[0]['tag'] if cases else 'opt-13b_flexgen_b32_p512_g32'})")
        cases = [c for c in cases if c["tag"] in set(args.cases)]
    summary = run_cases(cases, args)
    finish({"cases": sum("err" in r for r in summary), "failed": sum("error" in r for r in summary),
            "out": args.out})


if __name__ == "__main__":
    main()
