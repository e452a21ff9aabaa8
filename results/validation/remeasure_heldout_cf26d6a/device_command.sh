# 2026-12-04, one NVIDIA H200, code at cf26d6a (device call 2 of stop 55, after a cProfile run of 93 s in the same call;
# ab/hs/call2.sh): the two held-out cases beyond 10 % outside CPU attention, last measured at 7040813, median of 3 repeats
LIMIT=$LEFT SPLIT=heldout REPEATS=3 TL=$((LEFT - 120)) COMMIT=cf26d6a \
  CASES="llama-2-13b_tightllm_b40_p1024_g128 llama-2-13b_flexgen_b40_p128_g128" bash experiments/validation/remeasure.sh
# compare.md: python -m experiments.validation.remeasure_compare results/validation/h200_heldout <the new case files> --out compare.csv
