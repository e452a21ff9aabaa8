#!/bin/bash
# stop 58 call 1 (carry .whl ab): GPU tests (the split test among them, first run), then the recompute-split
# experiment on both issue-14 workloads (OPT-30B 512/32 16x3 and 1984/32 4x4, 16 GiB): TightLLM free, held at its
# smallest N_r, and held with the split's graphs; two-op compute window and blocking waits, as ra2_blocking_45ab918
: "${COMMIT:?set COMMIT}"
S=$(date +%s)
mkdir -p /tmp/site2 $OUT/x; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=$COMMIT
timeout 150 python3 -m pytest -q -x tests/test_offexec_gpu.py -p no:cacheprovider > $OUT/x/gputests.log 2>&1
echo "gputests rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call1.log
C="tightllm tightllm_held tightllm_held_split"
python3 -m experiments.offexec.h200 --out $OUT/x/p512_g32 --configs $C --run-ahead 2 6 16 --cuda-sched blocking --time-limit-s 300 > $OUT/x/p512.log 2>&1
echo "p512 rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call1.log
LEFT=$(( 570 - ($(date +%s) - S) ))
[ $LEFT -gt 150 ] && timeout $LEFT python3 -m experiments.offexec.h200 --out $OUT/x/p1984_g32 --prompt-len 1984 --gpu-batch-size 4 --num-gpu-batches 4 \
  --configs $C --run-ahead 2 6 16 --cuda-sched blocking --time-limit-s $(( LEFT - 110 )) > $OUT/x/p1984.log 2>&1
echo "p1984 rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call1.log
cp $OUT/call1.log $OUT/x/; tar czf $OUT/x.tgz -C $OUT x && rm -rf $OUT/x
