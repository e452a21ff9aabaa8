# 2026-12-04, one NVIDIA H200 (three device calls, each a fresh machine), code at d753770: matrix v2's coverage cases
# (results/validation/matrix_v2_coverage_config.json), never measured before; offsim's predictions for them were
# written down first (../coverage_predictions.md, 714fd48).
# call 1 (~15:50 UTC): the five short cases, median of 3 repeats (run_calib_short_155014.log); the long one was not reached
LIMIT=330 CONFIG=results/validation/matrix_v2_coverage_config.json SPLIT=calib REPEATS=3 TL=220 COMMIT=d753770 \
  bash experiments/validation/remeasure.sh
# call 2 (~16:00 UTC, after the GPU tests and two offexec.h200 runs in the same call): the sixth, once (run_calib_long_160050.log)
LIMIT=394 CONFIG=results/validation/matrix_v2_coverage_config.json SPLIT=calib REPEATS=1 TL=60 COMMIT=d753770 \
  CASES="opt-6.7b_flexgen_b12_p128_g64" bash experiments/validation/remeasure.sh
# -> the first runs: ../h200_calib/<case>.case.json (+ plan), runs_first.jsonl
# call 4 (~16:15 UTC): all six again, median of 3 repeats (run_calib_short_161529.log) -> second_round/, runs_second.jsonl
LIMIT=385 CONFIG=results/validation/matrix_v2_coverage_config.json SPLIT=calib REPEATS=3 TL=290 SHORT_S=30 COMMIT=d753770 \
  bash experiments/validation/remeasure.sh
# compare.md: python -m experiments.validation.remeasure_compare <first runs> <second_round> --out compare.csv
# (the 'offsim' figures in the run logs are the matrix runner's own, on the older results/profiles/h200_offexec.json;
# every error in compare.csv and in the validation README is on profile v2)
