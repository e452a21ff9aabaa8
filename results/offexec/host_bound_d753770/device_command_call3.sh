#!/bin/bash
# stop 56 call 3 (carry .whl ab): the two FlexGen GPU-attention coverage plans (host-bound: issue 74 %) run again with
# the per-handler issue times in their logs, auto vs blocking; then the issue/capture rows of both models re-measured
: "${COMMIT:?set COMMIT}"
S=$(date +%s)
PLANS="ab/llama-3-8b_flexgen_b12_p1024_g16.plan.json.gz:12 ab/opt-6.7b_flexgen_b12_p128_g64.plan.json.gz:12" \
  SIDES="auto=;blk=--cuda-sched blocking" REPEATS=2 OFFSIM_COMMIT=$COMMIT bash experiments/offexec/runtime_ab.sh > $OUT/ab_call3.log 2>&1
LEFT=$(( 560 - ($(date +%s) - S) ))
echo "profile with ${LEFT}s left" >> $OUT/ab_call3.log
mkdir -p /tmp/site2; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
PYTHONPATH=/tmp/site2:$PWD timeout $LEFT python3 -m offexec.cli profile --ops llama-3-8b,opt-6.7b --capture-only \
  --base results/profiles/h200_offexec_v2.json --out $OUT/issue_rows_now.json > $OUT/profile_call3.log 2>&1
echo "profile rc=$? at $(( $(date +%s) - S )) s" >> $OUT/ab_call3.log
ls $OUT
