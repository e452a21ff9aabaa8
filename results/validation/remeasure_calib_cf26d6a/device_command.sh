# 2026-12-04, one NVIDIA H200, code at cf26d6a (device call 4 of stop 55, after a cProfile run; ab/hs/call4.sh): one of
# the calibration cases last measured before the executor changes since 7040813 (a run over 20 s: measured once)
LIMIT=$LEFT SPLIT=calib REPEATS=3 TL=$((LEFT - 110)) COMMIT=cf26d6a CASES="opt-30b_flexgen_b40_p256_g16" \
  bash experiments/validation/remeasure.sh
# compare.md: python -m experiments.validation.remeasure_compare results/validation/h200_calib <the new case file> --out compare.csv
