#!/bin/bash
# stop 60 call 1 (carry .whl): the fresh held-out draw's first measurement, 2026-12-05, code a0f1433
CONFIG=results/validation/matrix_v2_fresh_heldout_config.json SPLIT=heldout REPEATS=3 TL=430 LIMIT=580 COMMIT=a0f1433 \
  bash experiments/validation/remeasure.sh > $OUT/remeasure.log 2>&1
