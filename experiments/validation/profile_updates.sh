#!/usr/bin/env bash
# The short GPU measurements that stop 39 built the code for, in one device call (issues 13, 15, 18): each step has
# its own time limit and its own output under $OUT, so a step that fails or overruns loses only itself.
#   1. each matrix model's clock under load: sustained fraction, settling, duty curve ('clock' 'sustained',
#      'held', 'duty' rows: costmodel.ClockModel; ~4 min)                                 -> $OUT/sus.json
#   2. FlexGen 0.1.8's own prefill KV store into a fresh host cache (OPT-30B shapes)    -> $OUT/store.json
#   3. a 2-stage OPT-30B pipeline plan (16 x 4: the 16 x 8 plan's 146 GiB of host memory do not fit a one-GPU
#      machine's 125) rehearsed on one GPU (memory contract, tokens)                    -> $OUT/pp_one_gpu.json
#   4. CPU attention (offexec's path and FlexGen's, OPT-30B) now, then with the link kept busy as a weight stream
#      keeps it: does a CPU-attention op slow while weights stream?       -> $OUT/cpuattn.json, $OUT/cpuattn_h2d.json
#   5. step 4 for opt-6.7b, opt-13b, llama-2-13b, llama-3-8b (offexec's path)  -> $OUT/cpuattn[_h2d]_MODEL.json
#   6. the issuing loop's CUDA calls, the link idle and busy, behind a busy GPU and a deep launch queue, incl. copies
#      from memory page-locked in place
#      (experiments/offexec/issue_under_load.py)                                 -> $OUT/issue_under_load.json
#   7. OPT's CPU-attention rows again, now reaching 2036 tokens (offexec's path and FlexGen's; the probe dropped
#      OPT's 2048 point before 369e279)                                         -> $OUT/cpuattn_opt_long.json
#   8. TightLLM at OPT-30B 1984/8, 4 x 4: the compute stream's run-ahead window 16 (the plan's) and 4 -- is part of
#      its eager recompute ops' host issue the driver waiting on a full launch queue? -> $OUT/runahead_{16,4}.log
#   9. TightLLM's capture-aware N_r (offsim/policies/tightllm/policy.py hold_for_captures) against Algorithm 1's
#      per-step N_r, on the one matrix configuration where they differ (opt-13b 128/32, 64 x 1, 32 GiB), planned on
#      profile v2, run back to back: offsim predicts decode 2,542 -> 2,797 tok/s        -> $OUT/capture_{0,1}.log
#  10. TightLLM's job blocks alone, with traces: block 0 of the summarization and translation jobs (Llama-2-13B,
#      16 GiB; results/offline_jobs/h200), their first 24 steps, planned as the jobs planned them
#      (experiments/offexec/job_block_plan.py), each run with `offexec run --trace`: which stream the -13.7 % and
#      -6.6 % job errors come from (`offsim validate` the folder)          -> $OUT/job_blocks.tgz
#  11. the disk tier's time per request by size, 4.5 KiB to 72 MiB (`offexec profile --disk-ops-only`, in the
#      system temp directory as runs use it): small KV stores cost far more than their bytes at the rate
#      (results/validation/calib_misses.md, 'Disk requests')                    -> $OUT/disk_ops.json
#  12. step 10's two blocks again, each twice: with --host-profile (the caching allocator's retries by op handler;
#      step 10's traces show each decode step's first layer op of each batch taking 10-20x its siblings), and with
#      the allocator capped at a 16 GiB budget instead of the plan's bytes (--allocator-cap budget)
#                                                                               -> $OUT/alloc_blocks.tgz
#  13. what a key mask costs SDPA (time, memory beyond its output) by backend, at the job blocks' shapes
#      (experiments/offexec/mask_sdpa.py)                                          -> $OUT/mask_sdpa.json
#  14. GPU attention again for the job blocks' model, now with the masked rows (('attn', 'prefill_masked'),
#      ('attn', 'recompute_masked'): a left-padded batch's per-sequence key mask)          -> $OUT/attn_masked.json
#  15. prefill under the allocator cap: each plan in build/p15/ (carry it: copy calibration plans there first) run
#      with the cap at the plan's bytes and at a 24 GiB budget, the runs' JSON 'allocator' retries beside prefill
#      tok/s (the job blocks' prefill retried 46-126 times and ran ~11 % slower at the plan's cap)
#                                                                               -> $OUT/p15.tgz
#  16. the memory contract for left-padded blocks: the 22 cases of results/memory/padded/config.json (offsim job's
#      settings, the key mask reserved; `h200_sweep plan --padded`), each run under its budget with the allocator
#      capped at the plan's bytes: no OOM, measured / predicted peak        -> $OUT/padded_runs.jsonl
#      (here: `python -m experiments.memory.h200_sweep report --config results/memory/padded/config.json
#       --runs padded_runs.jsonl --out results/memory/padded`)
#  17. step 3 for TightLLM's pipeline: its 2-stage OPT-30B plan (8 x 8, 16 GiB a GPU: the 8 x 16 plan for two GPUs,
#      results/multigpu/h200/plan_2gpu_tightllm_8x16.json.gz, needs 121 GiB of host memory) rehearsed on one GPU
#      (memory contract per stage, tokens)                                         -> $OUT/pp_tightllm_one_gpu.json
#  18. a graphed decode op's attention for the five matrix models: the masked kernel over the whole KV buffer,
#      replayed from a graph, by sequences and buffer length ('attn' 'decode_graph:B' rows; a decode op's measured
#      time is flat over the steps, offsim's grew with the context)                 -> $OUT/decode_attn.json
#  19. step 1 with each model's whole prefill layer as the clock probes' load instead of its FFN GEMM: does a
#      prefill's op mix hold another clock (prefill_layers.md: the error differs by model)?  -> $OUT/sus_layer.json
#  20. TightLLM's graph captures at a recompute's own rows ('capture', 'recompute:PART'; with the 'new_q:PART'
#      rows again, from the same runs): calibration case opt-13b_tightllm_b32_p128_g32 spent 2.8-4.3 ms a layer
#      at each new q in its run, where the one-token 'capture' row read flat prices 1.16      -> $OUT/new_q.json
# Then, here: `offexec profile --base results/profiles/h200_offexec_v2.json --merge sus.json store.json --out ...`,
# re-validate the calibration split before adopting (docs/cost-model.md):
#   python -m experiments.validation.profile_variants --base results/profiles/h200_offexec_v2.json \
#       --variant NAME=PART ... --out DIR
# tabulates each merged variant beside the base.
#
#   COMMIT=abc1234 STEPS="1 2 3 4" bash experiments/validation/profile_updates.sh
#
# Carry .whl (../shared/tools/device-wheels.sh) and, for step 2, .whl-peers
# (`pip download --no-deps flexgen==0.1.8 attrs -d .whl-peers`): the machine has no network.
set -u
export OFFSIM_COMMIT=${COMMIT:?set COMMIT to the code\'s commit (the copy has no .git)}
STEPS=${STEPS:-1 2 3 4}
mkdir -p /tmp/site
for d in .whl .whl-peers; do
  if ls "$d"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl 2> /dev/null
  fi
done
export PYTHONPATH=/tmp/site:$PWD
BASE=results/profiles/h200_offexec_v2.json
MODELS=opt-6.7b,opt-13b,opt-30b,llama-2-13b,llama-3-8b
for s in $STEPS; do
  T0=$(date +%s)
  case $s in
    1) timeout 330 python3 -u -m offexec.cli profile --base $BASE --ops $MODELS --sustained-only \
         --out "$OUT/sus.json" > "$OUT/sus.log" 2>&1 ;;
    2) timeout 240 python3 -u -m offexec.cli profile --base $BASE --ops opt-30b --flexgen-only store \
         --out "$OUT/store.json" > "$OUT/store.log" 2>&1 ;;
    3) timeout 420 torchrun --standalone --nproc-per-node 2 -m offexec.distributed \
         --plan results/multigpu/h200/plan_2gpu_flexgen_16x4_rehearsal.json.gz --one-gpu --no-warmup \
         --out "$OUT/pp_one_gpu.json" > "$OUT/pp_one_gpu.log" 2>&1 ;;
    4) timeout 200 python3 -u -m offexec.cli profile --base $BASE --ops opt-30b --cpu-attention-only \
         --out "$OUT/cpuattn.json" > "$OUT/cpuattn.log" 2>&1 &&
       timeout 200 python3 -u -m offexec.cli profile --base $BASE --ops opt-30b --cpu-attention-only \
         --under-h2d-load --out "$OUT/cpuattn_h2d.json" > "$OUT/cpuattn_h2d.log" 2>&1 ;;
    5) for m in opt-6.7b opt-13b llama-2-13b llama-3-8b; do  # step 4 for the other matrix models
         timeout 120 python3 -u -m offexec.cli profile --base $BASE --ops $m --cpu-attention-only \
           --out "$OUT/cpuattn_$m.json" > "$OUT/cpuattn_$m.log" 2>&1 &&
         timeout 120 python3 -u -m offexec.cli profile --base $BASE --ops $m --cpu-attention-only \
           --under-h2d-load --out "$OUT/cpuattn_h2d_$m.json" > "$OUT/cpuattn_h2d_$m.log" 2>&1
         echo "  $m rc=$?"
       done ;;
    6) timeout 200 python3 -u -m experiments.offexec.issue_under_load --out "$OUT/issue_under_load.json" \
         > "$OUT/issue_under_load.log" 2>&1 ;;
    7) timeout 420 python3 -u -m offexec.cli profile --base $BASE --ops opt-6.7b,opt-13b,opt-30b --cpu-attention-only \
         --out "$OUT/cpuattn_opt_long.json" > "$OUT/cpuattn_opt_long.log" 2>&1 ;;
    8) P="--model opt-30b --hardware $BASE --gpu-mem-gb 16 --policy tightllm --gpu-batch-size 4 --num-gpu-batches 4
          --prompt-len 1984 --gen-len 8 --percent 20 80 0 100 100 0 --set kv_solver=exact"
       mkdir -p /tmp/ra && python3 -m offsim.cli simulate $P --save-plan /tmp/ra/p16.json > /dev/null &&
       python3 -c "import json; d = json.load(open('/tmp/ra/p16.json')); d['run_ahead'] = [4, 6, 16]; \
json.dump(d, open('/tmp/ra/p4.json', 'w'))" &&
       for w in 16 4; do
         timeout 150 python3 -u -m offexec.cli run --plan /tmp/ra/p$w.json --hardware $BASE > "$OUT/runahead_$w.log" 2>&1
         echo "  run_ahead $w: rc=$? $(grep 'host time' "$OUT/runahead_$w.log")"
       done ;;
    9) P="--model opt-13b --hardware $BASE --gpu-mem-gb 32 --policy tightllm --gpu-batch-size 64 --num-gpu-batches 1
          --prompt-len 128 --gen-len 32 --percent 100 0 86 14 100 0 --set kv_solver=exact"
       mkdir -p /tmp/ca && for a in false true; do
         python3 -m offsim.cli simulate $P --set capture_aware=$a --save-plan /tmp/ca/$a.json > /dev/null
       done
       for r in 1 2; do  # twice each, alternating: the host's state drifts between runs
         for a in false true; do
           LOG="$OUT/capture_$([ $a = true ] && echo 1 || echo 0).log"
           timeout 120 python3 -u -m offexec.cli run --plan /tmp/ca/$a.json --hardware $BASE >> "$LOG" 2>&1
           echo "  capture_aware $a run $r: rc=$? $(grep '^decode' "$LOG" | tail -1)"
         done
       done ;;
    10) mkdir -p /tmp/jb && for k in summarization translation; do
          python3 -m experiments.offexec.job_block_plan experiments/offexec/jobs/llama-2-13b_$k.yaml \
            results/offline_jobs/h200/$k --policy tightllm --block 0 --gen-len 24 --out /tmp/jb/tightllm_$k.plan.json.gz &&
          timeout 150 python3 -u -m offexec.cli run --plan /tmp/jb/tightllm_$k.plan.json.gz --hardware $BASE \
            --trace /tmp/jb/tightllm_$k.trace.csv > /tmp/jb/tightllm_$k.log 2>&1
          echo "  $k rc=$? $(grep '^total' /tmp/jb/tightllm_$k.log)"
        done
        (cd /tmp/jb && gzip -f *.trace.csv; tar czf "$OUT/job_blocks.tgz" .) ;;
    11) timeout 240 python3 -u -m offexec.cli profile --base $BASE --disk-ops-only --out "$OUT/disk_ops.json" \
          > "$OUT/disk_ops.log" 2>&1 ;;
    12) mkdir -p /tmp/ab && for k in translation summarization; do
          python3 -m experiments.offexec.job_block_plan experiments/offexec/jobs/llama-2-13b_$k.yaml \
            results/offline_jobs/h200/$k --policy tightllm --block 0 --gen-len 24 --out /tmp/ab/$k.plan.json.gz &&
          timeout 150 python3 -u -m offexec.cli run --plan /tmp/ab/$k.plan.json.gz --hardware $BASE \
            --host-profile /tmp/ab/${k}_plan.pstats --trace /tmp/ab/${k}_plan.trace.csv > /tmp/ab/${k}_plan.log 2>&1
          echo "  $k cap plan rc=$? $(grep '^total' /tmp/ab/${k}_plan.log)"
          timeout 150 python3 -u -m offexec.cli run --plan /tmp/ab/$k.plan.json.gz --hardware $BASE \
            --allocator-cap budget --gpu-mem-gb 16 --trace /tmp/ab/${k}_budget.trace.csv > /tmp/ab/${k}_budget.log 2>&1
          echo "  $k cap budget rc=$? $(grep '^total' /tmp/ab/${k}_budget.log)"
        done
        (cd /tmp/ab && gzip -f *.trace.csv; tar czf "$OUT/alloc_blocks.tgz" .) ;;
    13) timeout 120 python3 -u -m experiments.offexec.mask_sdpa --out "$OUT/mask_sdpa.json" > "$OUT/mask_sdpa.log" 2>&1 ;;
    14) timeout 240 python3 -u -m offexec.cli profile --base $BASE --ops llama-2-13b --attention-only \
          --out "$OUT/attn_masked.json" > "$OUT/attn_masked.log" 2>&1 ;;
    15) mkdir -p /tmp/p15 && for pl in build/p15/*.plan.json.gz; do
          n=$(basename $pl .plan.json.gz)
          for cap in plan budget; do
            timeout 150 python3 -u -m offexec.cli run --plan $pl --hardware $BASE --allocator-cap $cap \
              --gpu-mem-gb 24 > /tmp/p15/${n}_$cap.log 2>&1
            echo "  $n cap $cap rc=$? $(grep '^prefill' /tmp/p15/${n}_$cap.log) $(grep -o '"num_alloc_retries": [0-9]*' /tmp/p15/${n}_$cap.log)"
          done
        done
        (cd /tmp/p15 && tar czf "$OUT/p15.tgz" .) ;;
    16) mkdir -p /tmp/disktier && timeout 540 python3 -u -m experiments.memory.h200_sweep run --config results/memory/padded/config.json \
          --out /tmp/padded --commit "$COMMIT" --disk-dir /tmp/disktier > "$OUT/padded.log" 2>&1
        cp /tmp/padded/runs.jsonl "$OUT/padded_runs.jsonl" ;;
    17) timeout 420 torchrun --standalone --nproc-per-node 2 -m offexec.distributed \
          --plan results/multigpu/h200/plan_2gpu_tightllm_8x8_rehearsal.json.gz --one-gpu --no-warmup \
          --out "$OUT/pp_tightllm_one_gpu.json" > "$OUT/pp_tightllm_one_gpu.log" 2>&1 ;;
    18) timeout 300 python3 -u -m offexec.cli profile --base $BASE --ops $MODELS --attention-only decode \
          --out "$OUT/decode_attn.json" > "$OUT/decode_attn.log" 2>&1 ;;
    19) timeout 420 python3 -u -m offexec.cli profile --base $BASE --ops $MODELS --sustained-only layer \
          --out "$OUT/sus_layer.json" > "$OUT/sus_layer.log" 2>&1 ;;
    20) timeout 420 python3 -u -m offexec.cli profile --base $BASE --ops $MODELS --capture-only new_q \
          --out "$OUT/new_q.json" > "$OUT/new_q.log" 2>&1 ;;
    *) echo "unknown step $s (1 to 20)"; continue ;;
  esac
  echo "step $s rc=$? $(( $(date +%s) - T0 )) s"
done
tail -n 3 "$OUT"/*.log | cut -c1-300
