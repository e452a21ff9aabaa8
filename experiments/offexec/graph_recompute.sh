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
#   OFFSIM_COMMIT=abc1234 [HOLD=1] [PROMPTS="512 1984"] [GEN=32] [KPROF=1] [WR=1] [CUDA_SCHED=blocking] \
#     bash experiments/offexec/graph_recompute.sh     (carry .whl; writes $OUT/graph_recompute.tgz)
# HOLD=1: TightLLM's hold_recompute (one N_r per GPU batch over the run: one graph shape per batch and layer);
# KPROF=1: each plan run a second time (log NAME.kprof.txt) with --kernel-profile (NAME.kernels.csv.gz: GPU time by kernel)
# and --host-profile (NAME.pstats: the issuing thread under cProfile); the profilers slow that run, so its tok/s are
# no measurement; GEN: tokens per prompt (default 32); WR=1: also pNNN_graphed_wr, the graphed plan with
# graph_attention=written_rows (recompute ops sequence-first over the written rows, flash's variable-length call);
# GR=1: also pNNN_graph_recompute, TightLLM planned with graph_recompute=true (needs HOLD=1) for 16 GiB and run
# there (every recompute op a graph over the written rows, the graphs' memory in offexec's pre-check); NR=0: skip
# pNNN_graphed_nr; EAGER=0: plan pNNN_eager, do not run it; RA="2 6 16" (with GR=1): also pNNN_graph_recompute_ra,
# the graph_recompute plan run with `--run-ahead $RA` (a held N_r never changes shape, the reason the default window
# is 16; a shorter compute window keeps the host from issuing into a full device queue, which the host-issue figure
# counts as issue time).
set -u
: "${OFFSIM_COMMIT:?set OFFSIM_COMMIT to the commit of the code (the copy has no .git)}"
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2> /dev/null
export PYTHONPATH=/tmp/site:$PWD
B=results/profiles/h200_offexec_v2.json
D=/tmp/graph_recompute
mkdir -p $D
GEN=${GEN:-32}
HOLDSET=()
[ "${HOLD:-0}" = 1 ] && HOLDSET=(--set hold_recompute=true)
SCHED=()
[ -n "${CUDA_SCHED:-}" ] && SCHED=(--cuda-sched "$CUDA_SCHED")
plan() {  # name prompt gbs nb [--set ...]
  python3 -m offsim.cli simulate --model opt-30b --hardware $B --gpu-mem-gb 16 --policy tightllm \
    --gpu-batch-size "$3" --num-gpu-batches "$4" --prompt-len "$2" --gen-len "$GEN" --percent 20 80 0 100 100 0 \
    --set kv_solver=exact "${HOLDSET[@]}" "${@:5}" --save-plan "$D/$1.plan.json" > "$D/$1.sim.log" 2>&1
}
graphed() {  # eager-plan graphed-plan [attention]: every recompute op a graph, N_r as planned; attention '' (masked
  # over the whole buffer) or written_rows (Plan.graph_attention)
  python3 -c "
import json, sys
p = json.load(open(sys.argv[1]))
p['graph_max_q_tokens'] = max(n + 1 for row in p['derived']['recompute_tokens'] for n in row)
if sys.argv[3]:
    p['graph_attention'] = sys.argv[3]
json.dump(p, open(sys.argv[2], 'w'))" "$D/$1.plan.json" "$D/$2.plan.json" "${3:-}"
}
run() {  # name budget_gib [offexec run flags...]
  timeout 150 python3 -u -m offexec.cli run --plan "$D/$1.plan.json" --hardware $B --gpu-mem-gb "$2" \
    "${SCHED[@]}" "${@:3}" --trace "$D/$1.trace.csv" > "$D/$1.log" 2>&1
  echo "$1 rc=$? $(grep 'host time' "$D/$1.log")"; grep -E '^(peak memory|CUDA graphs|decode )' "$D/$1.log"
  if [ "${KPROF:-0}" = 1 ]; then
    timeout 150 python3 -u -m offexec.cli run --plan "$D/$1.plan.json" --hardware $B --gpu-mem-gb "$2" \
      "${SCHED[@]}" --kernel-profile "$D/$1.kernels.csv.gz" --host-profile "$D/$1.pstats" > "$D/$1.kprof.txt" 2>&1
    echo "$1 kernel profile rc=$?"; grep -A8 '^category' "$D/$1.kprof.txt"
  fi
}
for P in ${PROMPTS:-512 1984}; do
  case $P in 512) G=(16 3);; 1984) G=(4 4);; *) echo "PROMPTS: 512 or 1984, got $P"; exit 2;; esac
  plan p${P}_eager $P "${G[@]}" && [ "${EAGER:-1}" = 1 ] && run p${P}_eager 16
  [ "${NR:-1}" = 1 ] && graphed p${P}_eager p${P}_graphed_nr && run p${P}_graphed_nr 18
  if [ "${WR:-0}" = 1 ]; then graphed p${P}_eager p${P}_graphed_wr written_rows && run p${P}_graphed_wr 18; fi
  if [ "${GR:-0}" = 1 ]; then  # TightLLM's graph_recompute, planned by offsim at 16 GiB and run there
    plan p${P}_graph_recompute $P "${G[@]}" --set graph_recompute=true && run p${P}_graph_recompute 16
    if [ -n "${RA:-}" ]; then  # the same plan with another issue-ahead window (offexec run --run-ahead)
      cp "$D/p${P}_graph_recompute.plan.json" "$D/p${P}_graph_recompute_ra.plan.json"
      run p${P}_graph_recompute_ra 16 --run-ahead $RA
    fi
  fi
done
gzip -f $D/*.trace.csv
tar czf "$OUT/graph_recompute.tgz" -C /tmp graph_recompute
