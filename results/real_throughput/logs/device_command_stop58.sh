#!/bin/bash
# stop 58 call 3 (carry .whl-peers ab): issue 15, Llama-2-13B 512/32 at 24 GiB: DeepSpeed and Accelerate first,
# then offexec's policies while time is left
: "${COMMIT:?set COMMIT}"
S=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .whl-peers/*.whl 2>/dev/null
export PYTHONPATH=/tmp/peers:$PWD
A="--models llama-2-13b --prompts 512 --gens 32 --budgets 24 --commit $COMMIT --timeout-s 300"
python3 -m experiments.real_throughput --only deepspeed-ref accelerate-ref $A --time-limit-s 300 > $OUT/rt_peers.log 2>&1
echo "peers rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call3.log
LEFT=$(( 545 - ($(date +%s) - S) ))
[ $LEFT -gt 100 ] && timeout $LEFT python3 -m experiments.real_throughput --only offexec $A --time-limit-s $(( LEFT - 95 )) > $OUT/rt_offexec.log 2>&1
echo "offexec rc=$? at $(( $(date +%s) - S )) s" >> $OUT/call3.log
cp $OUT/*.log results/real_throughput/logs/ 2>/dev/null; tar czf $OUT/rt.tgz results/real_throughput
