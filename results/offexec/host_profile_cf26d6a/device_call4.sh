#!/bin/bash
# stop 55 call 4: cProfile of the issuing thread, TightLLM p512 16x3 plan with every recompute op graphed (18 GiB) (HEAD cf26d6a), then one calib case
S=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/hp && gunzip -c ab/hs/p512_graphed.plan.json.gz > /tmp/hp/p512_graphed.plan.json
timeout 200 python3 -u -m offexec.cli run --plan /tmp/hp/p512_graphed.plan.json --hardware results/profiles/h200_offexec_v2.json --gpu-mem-gb 18 --host-profile /tmp/hp/p512_graphed.pstats > /tmp/hp/p512_graphed_cprofile.log 2>&1
echo "cprofile rc=$? at $(( $(date +%s) - S )) s" >> /tmp/hp/call.log
tar czf $OUT/hp.tgz -C /tmp hp
LEFT=$(( 380 - ($(date +%s) - S) ))
LIMIT=$LEFT SPLIT=calib REPEATS=3 TL=$(( LEFT - 110 )) COMMIT=cf26d6a CASES="opt-30b_flexgen_b40_p256_g16" bash experiments/validation/remeasure.sh > $OUT/remeasure_call.log 2>&1
