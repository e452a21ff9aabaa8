#!/bin/bash
# stop 55 call 2: cProfile of the issuing thread, TightLLM p512 16x3 eager plan (HEAD cf26d6a), then 2 held-out cases
S=$(date +%s)
mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/hp && gunzip -c ab/hs/p512_eager.plan.json.gz > /tmp/hp/p512_eager.plan.json
timeout 200 python3 -u -m offexec.cli run --plan /tmp/hp/p512_eager.plan.json --hardware results/profiles/h200_offexec_v2.json --gpu-mem-gb 16 --host-profile /tmp/hp/p512_eager.pstats > /tmp/hp/p512_eager_cprofile.log 2>&1
echo "cprofile rc=$? at $(( $(date +%s) - S )) s" >> /tmp/hp/call.log
tar czf $OUT/hp.tgz -C /tmp hp
LEFT=$(( 575 - ($(date +%s) - S) ))
LIMIT=$LEFT SPLIT=heldout REPEATS=3 TL=$(( LEFT - 120 )) COMMIT=cf26d6a CASES="llama-2-13b_tightllm_b40_p1024_g128 llama-2-13b_flexgen_b40_p128_g128" bash experiments/validation/remeasure.sh > $OUT/remeasure_call.log 2>&1
