#!/usr/bin/env bash
# TightLLM's recompute ops eager against replayed as CUDA graphs (issue 14: host issue <= 5 % of the run), OPT-30B,
# weights 20/80, KV on the host, planned by offsim on profile v2 for a 16 GiB GPU (kv_solver=exact), each plan run
# with `offexec run` (default warm-up, graphs on), its trace kept:
#   p512_eager       prompt 512, gen 32, 16 x 3 (recompute ops of more than 7 tokens run eagerly), 16 GiB
#   p512_graphed_nr  p512_eager's plan (its N_r) with graph_max_q_tokens raised to its longest recompute: every
#                    recompute op a graph at the eager plan's N_r, run under an 18 GiB budget -- offexec refuses it at
#                    16 from footprint arithmetic (decode_graph_bytes: 1.8 GiB of graphs); its measured peak says
#                    what the graphs really hold, its host issue what they save
#   p1984_eager, p1984_graphed_nr   prompt 1984, gen 32, 4 x 4, the same two
# (Planning N_r with the graphs' memory as decode_graph_bytes counts it -- twice the op's intermediates, plus static
# tensors for CPU attention -- caps N_r at 136 / 522 in an uncommitted prototype, and those plans, the graphs beside
# the prefill's cached transients, still need 16.9 GiB by offexec's arithmetic: what the graphs really hold decides.)
#
#   OFFSIM_COMMIT=abc1234 bash experiments/offexec/graph_recompute.sh     (carry .whl; writes $OUT/graph_recompute.tgz)
set -u
: "${OFFSIM_COMMIT:?set OFFSIM_COMMIT to the commit of the code (the copy has no .git)}"
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2> /dev/null
export PYTHONPATH=/tmp/site:$PWD
B=results/profiles/h200_offexec_v2.json
D=/tmp/graph_recompute
mkdir -p $D
plan() {  # name prompt gbs nb
  python3 -m offsim.cli simulate --model opt-30b --hardware $B --gpu-mem-gb 16 --policy tightllm \
    --gpu-batch-size "$3" --num-gpu-batches "$4" --prompt-len "$2" --gen-len 32 --percent 20 80 0 100 100 0 \
    --set kv_solver=exact --save-plan "$D/$1.plan.json" > "$D/$1.sim.log" 2>&1
}
graphed() {  # eager-plan graphed-plan: every recompute op a graph, N_r as planned
  python3 -c "
import json, sys
p = json.load(open(sys.argv[1]))
p['graph_max_q_tokens'] = max(n + 1 for row in p['derived']['recompute_tokens'] for n in row)
json.dump(p, open(sys.argv[2], 'w'))" "$D/$1.plan.json" "$D/$2.plan.json"
}
run() {  # name budget_gib
  timeout 120 python3 -u -m offexec.cli run --plan "$D/$1.plan.json" --hardware $B --gpu-mem-gb "$2" \
    --trace "$D/$1.trace.csv" > "$D/$1.log" 2>&1
  echo "$1 rc=$? $(grep 'host time' "$D/$1.log")"
}
plan p512_eager 512 16 3 && run p512_eager 16
graphed p512_eager p512_graphed_nr && run p512_graphed_nr 18
plan p1984_eager 1984 4 4 && run p1984_eager 16
graphed p1984_eager p1984_graphed_nr && run p1984_graphed_nr 18
gzip -f $D/*.trace.csv
tar czf "$OUT/graph_recompute.tgz" -C /tmp graph_recompute
