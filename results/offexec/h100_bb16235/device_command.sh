# the two device calls that measured p512_g32/ and p1984_g32/ (one NVIDIA H100 80GB HBM3, asked as nvidia-h200,
# 2026-12-05 22:40 and 22:47 UTC, code bb16235: ab/call1.sh and ab/call2.sh of stop 67; call 1 first ran the GPU
# tests, ../gputests_bb16235/)
mkdir -p /tmp/site2; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=bb16235
timeout 400 python3 -m experiments.offexec.h200 --out $OUT/x/p512 --time-limit-s 330 --configs tightllm tightllm_graph_recompute flexgen_gpu_attn
timeout 560 python3 -m experiments.offexec.h200 --out $OUT/x/p1984 --time-limit-s 420 --prompt-len 1984 --gpu-batch-size 4 --num-gpu-batches 4 --configs tightllm tightllm_graph_recompute flexgen_gpu_attn
