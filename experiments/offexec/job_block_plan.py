"""Save one block of a measured job as a plan `offexec run --plan` runs on its own, with a trace (issue 20).

    python -m experiments.offexec.job_block_plan experiments/offexec/jobs/llama-2-13b_summarization.yaml \\
        results/offline_jobs/h200/summarization --policy tightllm --block 0 --gen-len 24 --out plan.json.gz

A job's blocks keep only their token times; to see which stream a block's time went to, run the block again alone
with `offexec run --plan plan.json.gz --trace t.csv` (and `offsim validate` the trace). The block is the one
`offexec job` ran: the spec's requests, split by the policy's block shape and settings recorded in the job
folder's ``best.json``, with the same batching; ``--gen-len`` shortens it (its first K steps: the same prompts,
the same plan up to there) to fit a short device call. Nothing is measured here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from offexec.job import shortened
from offsim.core.errors import OffsimError
from offsim.core.requests import make_blocks
from offsim.core.specs import get_hardware, get_model
from offsim.policies.registry import build_plan
from offsim.search import job as J
from experiments.common import argparser


def block_plan(spec_path: Path, job_dir: Path, policy: str, block: int, gen_len: int | None):
    """The block's plan and the hardware (the spec's profile and GPU budget) it was planned on."""
    spec = J.load_job_spec(spec_path)
    best_path = job_dir / "best.json"
    if not best_path.is_file():
        raise OffsimError(f"{best_path}: no such file (the folder `offexec job --out` wrote)")
    shapes = [v[policy] for v in json.loads(best_path.read_text()).values() if policy in v]
    if len(shapes) != 1:
        raise OffsimError(f"{best_path}: {len(shapes)} entries for policy {policy!r}; expected one")
    b = shapes[0]
    blocks = make_blocks(list(spec.requests), b["gpu_batch_size"], b["num_gpu_batches"], spec.batching)
    if not 0 <= block < len(blocks):
        raise OffsimError(f"--block {block}: the job has blocks 0 to {len(blocks) - 1} for {policy}")
    wl = blocks[block].workload
    if gen_len is not None:
        if not 2 <= gen_len <= wl.gen_len:
            raise OffsimError(f"--gen-len {gen_len}: give 2 to the block's {wl.gen_len}")
        wl = shortened(wl, gen_len)
    hw = get_hardware(spec.hardware, spec.gpu_mem_gb)
    return build_plan(policy, get_model(spec.model), hw, wl, dict(b["settings"])), hw


def main(argv=None) -> int:
    ap = argparser(__doc__)
    ap.add_argument("spec", type=Path, help="the job spec (YAML or JSON)")
    ap.add_argument("job_dir", type=Path, help="the job's folder (its best.json)")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--gen-len", type=int, default=None, help="run only the block's first K steps")
    ap.add_argument("--out", type=Path, required=True, help="plan file (.json or .json.gz)")
    a = ap.parse_args(argv)
    try:
        plan, _ = block_plan(a.spec, a.job_dir, a.policy, a.block, a.gen_len)
    except OffsimError as e:
        print(f"job_block_plan: {e}", file=sys.stderr)
        return 2
    plan.save(a.out)
    wl = plan.workload
    print(f"{a.out}: {plan.policy} block {a.block}, {wl.gpu_batch_size} x {wl.num_gpu_batches}, prompts "
          f"{' '.join(map(str, wl.batch_prompt_lens))}, gen {wl.gen_len}, {len(plan.ops)} ops")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
