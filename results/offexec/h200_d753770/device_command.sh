# the device call that measured p512_g32/ and p512_g32_blocking/ (one NVIDIA H200, 2026-12-04 ~15:58 UTC, code d753770:
# a recompute block's attention straight to the flash kernel, offexec.model._lower_right_flash); ab/next/call2.sh of
# stop 56, after tests/test_offexec_gpu.py in the same call (../gputests_d753770/)
mkdir -p /tmp/site2; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=d753770
timeout 170 python3 -m experiments.offexec.h200 --out $OUT/x --time-limit-s 100 --configs tightllm
timeout 150 python3 -m experiments.offexec.h200 --out $OUT/y --time-limit-s 100 --cuda-sched blocking --configs tightllm
