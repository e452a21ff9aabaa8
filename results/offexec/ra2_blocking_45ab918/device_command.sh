#!/bin/bash
# stop 57 call 2 (carry .whl ab): issue 14's table with a compute window of two ops and blocking waits, both
# workloads (OPT-30B 512/32 16x3 and 1984/32 4x4, 16 GiB), all three configurations
: "${COMMIT:?set COMMIT}"
S=$(date +%s)
mkdir -p /tmp/site2 $OUT/x; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=$COMMIT
python3 -m experiments.offexec.h200 --out $OUT/x/p512_g32 --run-ahead 2 6 16 --cuda-sched blocking --time-limit-s 240 > $OUT/x/p512.log 2>&1
echo "p512 rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call2.log
LEFT=$(( 560 - ($(date +%s) - S) ))
timeout $LEFT python3 -m experiments.offexec.h200 --out $OUT/x/p1984_g32 --prompt-len 1984 --gpu-batch-size 4 --num-gpu-batches 4 \
  --run-ahead 2 6 16 --cuda-sched blocking --time-limit-s $(( LEFT - 120 )) > $OUT/x/p1984.log 2>&1
echo "p1984 rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call2.log
cp $OUT/call2.log $OUT/x/; tar czf $OUT/x.tgz -C $OUT x && rm -rf $OUT/x
