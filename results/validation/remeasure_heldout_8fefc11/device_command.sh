# 2026-12-03 07:28-07:35 UTC, one NVIDIA H200, code at 8fefc11. The nine held-out cases whose case files the
# 7040813 call lost (84435bc), re-measured with the full warm-up, median of 3 (carry: .whl).
LIMIT=600 SPLIT=heldout REPEATS=3 TL=420 COMMIT=8fefc11 CASES="opt-13b_flexgen-cpuattn_b8_p128_g16 opt-13b_selectn_b32_p128_g64 opt-6.7b_static-accelerate_b8_p512_g16 opt-6.7b_selectn_b16_p512_g64 opt-6.7b_selectn_b32_p512_g128 opt-13b_flexgen_b24_p1024_g32 opt-6.7b_flexgen_b32_p1024_g128 opt-13b_tightllm_b32_p1024_g128 opt-6.7b_tightllm_b40_p1024_g64" bash experiments/validation/remeasure.sh
