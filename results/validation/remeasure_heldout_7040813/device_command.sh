# 2026-12-03, one NVIDIA H200, code at 7040813: the held-out cases whose host issue was >= 20 % of their run, short
# ones first (median of 3 repeats); 12 of the 13 named were measured, but the 600-s call was cut before the script
# packed its folder, so only 3 case files came back (here, beside runs.jsonl, which has all 12 totals; remeasure.sh
# now packs on SIGTERM). compare.md: python -m experiments.validation.remeasure_compare
# results/validation/h200_heldout <the 3 case files> --runs runs.jsonl --runs-commit 7040813 --out compare.csv
CASES="llama-2-13b_flexgen_b40_p128_g128 opt-13b_flexgen-cpuattn_b8_p128_g16 opt-13b_selectn_b32_p128_g64 opt-6.7b_static-accelerate_b8_p512_g16 opt-6.7b_selectn_b16_p512_g64 opt-6.7b_selectn_b32_p512_g128 llama-3-8b_flexgen_b40_p512_g16 opt-30b_flexgen-cpuattn_b16_p512_g32 opt-13b_flexgen_b24_p1024_g32 opt-6.7b_flexgen_b32_p1024_g128 llama-2-13b_tightllm_b40_p1024_g128 opt-13b_tightllm_b32_p1024_g128 opt-6.7b_tightllm_b40_p1024_g64" SPLIT=heldout REPEATS=3 TL=520 COMMIT=7040813 bash experiments/validation/remeasure.sh
