set -x
mkdir -p /tmp/site2; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=${C:-5e339da}
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv
P=${P:-results/profiles/h100_offexec.json}; ls -la $P
mkdir -p $OUT/x; date -u
timeout 560 python3 -m experiments.offexec.h200 --hardware $P --out $OUT/x/p$PL --time-limit-s 420 --prompt-len $PL $EXTRA --configs tightllm tightllm_graph_recompute flexgen_gpu_attn 2>&1 | tail -30
date -u
tar czf $OUT/call_p$PL.tgz -C $OUT x
# run as: C=fd0e0c5 P=results/profiles/h100_offexec.json PL=512 EXTRA='' bash ab/run512.sh
# and:    C=fd0e0c5 P=results/profiles/h100_offexec.json PL=1984 EXTRA='--gpu-batch-size 4 --num-gpu-batches 4' bash ab/run512.sh
