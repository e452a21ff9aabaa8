#!/bin/bash
# stop 57 call 1 (carry .whl ab): GPU tests (the new capture-only test among them), then the capture-only profile
# of all five models (the new issue rows for head / embed / weight copies), one file per model
: "${COMMIT:?set COMMIT}"
S=$(date +%s)
mkdir -p $OUT/p /tmp/site2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD
timeout 150 python3 -m pytest -q -x tests/test_offexec_gpu.py -p no:cacheprovider > $OUT/p/gputests.log 2>&1
echo "gputests rc=$? at $(( $(date +%s) - S )) s" | tee -a $OUT/p/call1.log
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> $OUT/p/gputests.log
for M in opt-6.7b llama-3-8b opt-13b llama-2-13b opt-30b; do
  LEFT=$(( 575 - ($(date +%s) - S) ))
  [ $LEFT -lt 60 ] && { echo "skip $M: ${LEFT}s left" >> $OUT/p/call1.log; continue; }
  timeout $LEFT python3 -m offexec.cli profile --ops $M --capture-only --base results/profiles/h200_offexec_v2.json \
    --out $OUT/p/cap_$M.json > $OUT/p/cap_$M.log 2>&1
  echo "$M rc=$? at $(( $(date +%s) - S )) s" >> $OUT/p/call1.log
done
tar czf $OUT/cap.tgz -C $OUT p && rm -rf $OUT/p
