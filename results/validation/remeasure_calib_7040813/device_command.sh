# 2026-12-03, one NVIDIA H200, code at 7040813 (the executor freezes the heap from Python's collector since 0b8e77a):
# the calibration cases whose host issue was >= 20 % of their run, short ones first (median of 3 repeats); 10 of
# the 12 named reached in one 580-s call. Compare: python -m experiments.validation.remeasure_compare
# results/validation/h200_calib <the call's v/h200_calib> --out compare.csv (before the 10 were copied in).
CASES="llama-2-13b_flexgen_b8_p128_g32 opt-30b_flexgen_b8_p128_g32 opt-13b_tightllm_b32_p128_g32 opt-13b_static-accelerate_b32_p128_g64 llama-3-8b_static-accelerate_b16_p128_g128 llama-2-13b_selectn_b32_p256_g16 opt-30b_flexgen_b40_p256_g16 opt-30b_tightllm_b40_p256_g16 opt-30b_flexgen-cpuattn_b8_p128_g32 opt-13b_flexgen-cpuattn_b16_p128_g16_disk llama-3-8b_tightllm_b40_p512_g32 opt-30b_flexgen_b24_p512_g32" SPLIT=calib REPEATS=3 TL=530 COMMIT=7040813 bash experiments/validation/remeasure.sh
