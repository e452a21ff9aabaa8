# 2026-12-02 13:53 UTC, one NVIDIA H200, code at 183911c (same offsim/offexec code as a549c4a): seven llama-3-8b
# calibration cases (all short: median of 3 after the full warm-up), in one call. The call's log is here.
CASES="llama-3-8b_selectn_b40_p2048_g128 llama-3-8b_selectn_b40_p512_g128 llama-3-8b_static-accelerate_b16_p128_g128 llama-3-8b_static-zero_b12_p128_g64 llama-3-8b_static-zero_b40_p2048_g32 llama-3-8b_tightllm_b24_p1024_g128_disk llama-3-8b_tightllm_b40_p512_g32" \
  SPLIT=calib REPEATS=3 TL=220 COMMIT=183911c bash experiments/validation/remeasure.sh   # carry: .whl
# A later call for opt-30b_flexgen-cpuattn_b8_p128_g32 was killed by the script's own timeout (then TL + 60 s,
# shorter than the case's warm-up and run; the script now allows (1 + REPEATS) x the case's last wall time): not measured.
