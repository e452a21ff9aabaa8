#!/bin/bash
# stop 56 call 1 (carry .whl ab): coverage cases (6, never measured), then the --cuda-sched blocking A/B on two CPU-attention plans
: "${COMMIT:?set COMMIT}"
S=$(date +%s)
LIMIT=330 CONFIG=results/validation/matrix_v2_coverage_config.json SPLIT=calib REPEATS=3 TL=220 COMMIT=$COMMIT \
  bash experiments/validation/remeasure.sh > $OUT/coverage_call.log 2>&1
LEFT=$(( 570 - ($(date +%s) - S) ))
echo "A/B with ${LEFT}s left" >> $OUT/coverage_call.log
PLANS="ab/llama-3-8b_flexgen-cpuattn_b16_p256_g64.plan.json.gz:16 ab/llama-2-13b_flexgen-cpuattn_b16_p128_g64.plan.json.gz:16" \
  SIDES="auto=;blk=--cuda-sched blocking" REPEATS=1 OFFSIM_COMMIT=$COMMIT bash experiments/offexec/runtime_ab.sh > $OUT/ab_call.log 2>&1
ls $OUT
