# 2026-12-03, one NVIDIA H200, code at e8ec668 (offexec caps its allocator at the budget by default since e7b2f54):
# the matrix's Llama-3-8B cases, chosen by model, where two calibration plans had retried allocations 30-42 times per
# run at the plan's cap (results/validation/allocator_cap_23ec055/); median of 3 repeats. Compare (before the cases
# were copied in): python -m experiments.validation.remeasure_compare results/validation/h200_calib <the call's
# v/h200_calib> --out compare.csv
CASES="llama-3-8b_static-zero_b16_p128_g64 llama-3-8b_flexgen-cpuattn_b16_p256_g64 llama-3-8b_tightllm_b24_p1024_g128_disk llama-3-8b_selectn_b40_p512_g128 llama-3-8b_static-accelerate_b16_p128_g128 llama-3-8b_static-zero_b40_p2048_g32 llama-3-8b_tightllm_b40_p512_g32 llama-3-8b_selectn_b40_p2048_g128 llama-3-8b_static-zero_b12_p128_g64" SPLIT=calib REPEATS=3 TL=450 COMMIT=e8ec668 bash experiments/validation/remeasure.sh
