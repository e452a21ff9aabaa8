# 2026-12-04 05:40-05:58 UTC, one NVIDIA H200, code at 7ad9567. The held-out cases an executor change since their
# runs touches (not chosen by error): a straddling weight tensor (its resident head now copied on the compute stream),
# CPU attention (pre_attn packs Q/K/V on the compute stream), and the one plan whose KV work buffers the binding
# changes (opt-6.7b_flexgen_b32_p1024_g128: 1 -> 2). Full warm-up, median of 3 for cases under 20 s, else one run;
# two device calls (carry: .whl); the second ran the three OPT-30B cases the first's time limit left.
LIMIT=570 SPLIT=heldout REPEATS=3 TL=420 COMMIT=7ad9567 CASES="opt-6.7b_flexgen_b32_p1024_g128 opt-6.7b_flexgen_b12_p2048_g64_disk opt-6.7b_flexgen-cpuattn_b40_p512_g64 opt-13b_flexgen_b24_p1024_g32 opt-13b_flexgen-cpuattn_b8_p128_g16 opt-30b_flexgen-cpuattn_b16_p1024_g32 opt-30b_flexgen-cpuattn_b40_p512_g32 opt-30b_tightllm_b32_p512_g16 opt-30b_flexgen-cpuattn_b16_p512_g32 llama-3-8b_flexgen-cpuattn_b40_p256_g16" bash experiments/validation/remeasure.sh
LIMIT=500 SPLIT=heldout REPEATS=3 TL=300 COMMIT=7ad9567 CASES="opt-30b_flexgen-cpuattn_b16_p1024_g32 opt-30b_flexgen-cpuattn_b40_p512_g32 opt-30b_flexgen-cpuattn_b16_p512_g32" bash experiments/validation/remeasure.sh
