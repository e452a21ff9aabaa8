# 2026-12-02, one NVIDIA H200, code at 7c6e9a9 (.snap/commit). The six held-out cases not reached at 93bb5dd,
# with the full warm-up (median of 3 for short cases, long cases once). Call 1 (5 cases; the 6th not started at the time limit):
WMODE=full KEEP=median SPLIT=heldout REPEATS=3 TL=480 bash .snap/remeasure2.sh   # carry: .snap .whl build/remeasure
# call 3 (the 6th case; its call-2 result was overwritten by a second tarball in that call):
python3 -u -m experiments.validation.matrix --config results/validation/matrix_v2_config.json \
  --profile results/profiles/h200_offexec.json --out $OUT/hb --warmup --warmup-mode full --keep median \
  --disk-dir /tmp/disktier --commit 7c6e9a9 --kv-solver exact --cases llama-2-13b_static-zero_b12_p1024_g32
