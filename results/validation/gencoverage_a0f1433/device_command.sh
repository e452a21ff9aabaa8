#!/bin/bash
# stop 60 call 2 (carry .whl): after tests/test_offexec_gpu.py (11 passed), the last generation-length coverage case's
# first measurement, 2026-12-05, code a0f1433 (one measured run after the unmeasured full warm-up: predicted 59 s)
CONFIG=results/validation/matrix_v2_gencoverage_config.json SPLIT=calib CASES=opt-13b_selectn_b12_p2048_g128 REPEATS=1 \
  TL=250 LIMIT=420 COMMIT=a0f1433 bash experiments/validation/remeasure.sh > $OUT/remeasure.log 2>&1
