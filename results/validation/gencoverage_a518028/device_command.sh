#!/bin/bash
# stop 58 call 2 (carry .whl): the generation-length coverage cases' first measurement, 2026-12-04, code a518028
CONFIG=results/validation/matrix_v2_gencoverage_config.json SPLIT=calib REPEATS=3 TL=430 LIMIT=580 COMMIT=a518028 \
  bash experiments/validation/remeasure.sh > $OUT/remeasure.log 2>&1
