# 2026-12-04 05:58-06:03 UTC, one NVIDIA H200, code at 7ad9567. The first calibration cases an executor change since
# their runs touches (a straddling weight tensor, CPU attention; listed shortest first, not chosen by error), as far
# as the session's device time went: 4 of the 5 asked (opt-30b_flexgen_b40_p256_g16 not started, time limit); the
# other 10 such calibration cases are still to re-measure. Full warm-up, median of 3 (carry: .whl).
LIMIT=370 SPLIT=calib REPEATS=3 TL=230 COMMIT=7ad9567 CASES="opt-6.7b_flexgen-cpuattn_b32_p128_g16 opt-13b_flexgen-cpuattn_b16_p128_g16_disk opt-30b_tightllm_b40_p256_g16 llama-3-8b_flexgen-cpuattn_b16_p256_g64 opt-30b_flexgen_b40_p256_g16" bash experiments/validation/remeasure.sh
