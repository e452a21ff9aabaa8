# 2026-12-04 09:36-09:48 UTC, one NVIDIA H200 (nvidia-h200 device machine, torch 2.11.0+cu130), code at 3732f5b.
# The first measurement of matrix v2's mixed-length extension (results/validation/matrix_v2_mixed_config.json,
# seed 2026: 5 calibration, 7 held-out cases, split before anything was measured): full warm-up, median of 3 for
# cases whose predicted run is under 20 s, else one run; one device call per split (carry: .whl).
CONFIG=results/validation/matrix_v2_mixed_config.json LIMIT=570 SPLIT=calib REPEATS=3 TL=420 COMMIT=3732f5b bash experiments/validation/remeasure.sh
CONFIG=results/validation/matrix_v2_mixed_config.json LIMIT=570 SPLIT=heldout REPEATS=3 TL=420 COMMIT=3732f5b bash experiments/validation/remeasure.sh
