#!/usr/bin/env bash
# The same stored plans run with two or more sets of runtime flags, alternating (A B A B ...), in one device call:
# what a runtime option (--graph-min-uses, --run-ahead, --no-cuda-graphs) does to a run, with the host's drift spread
# over both sides. Each run is `offexec run --plan` (default warm-up) on the profile the plans were made on; the logs
# are named PLAN_SIDE.log (runs of one side appended), which `python -m experiments.offexec.runs_table DIR` tabulates.
#
#   PLANS="ab/opt-13b_tightllm_b32_p128_g32.plan.json.gz:32 ..." \
#   SIDES="g1=--graph-min-uses 1;g2=--graph-min-uses 2" REPEATS=2 OFFSIM_COMMIT=abc1234 \
#       bash experiments/offexec/runtime_ab.sh            (writes $OUT/runtime_ab.tgz)
#
# PLANS: plan files (.json or .json.gz) with the GPU budget (GiB) each ran at; a plan of the validation splits is
# copied first to a folder the device call carries (the splits themselves are too large to travel with .whl).
# SIDES: NAME=FLAGS pairs separated by ';'. Nothing here needs the LP wheels: the plans are made already.
set -u
: "${OFFSIM_COMMIT:?set OFFSIM_COMMIT to the commit of the code (the copy has no .git)}"
: "${PLANS:?set PLANS to 'plan.json[.gz]:GIB ...'}"
: "${SIDES:?set SIDES to 'name=flags;name=flags'}"
REPEATS=${REPEATS:-2}
PROFILE=${PROFILE:-results/profiles/h200_offexec_v2.json}
export PYTHONPATH=$PWD
D=/tmp/runtime_ab
mkdir -p "$D"
IFS=';' read -r -a sides <<< "$SIDES"
for r in $(seq 1 "$REPEATS"); do
  for entry in $PLANS; do
    src=${entry%:*}; gib=${entry##*:}
    name=$(basename "$src"); name=${name%.gz}; name=${name%.plan.json}; name=${name%.json}
    [ -f "$D/$name.plan.json" ] || { case "$src" in *.gz) gunzip -c "$src" ;; *) cat "$src" ;; esac > "$D/$name.plan.json"; }
    for s in "${sides[@]}"; do
      label=${s%%=*}; flags=${s#*=}
      # shellcheck disable=SC2086  # the side's flags are words
      timeout 150 python3 -u -m offexec.cli run --plan "$D/$name.plan.json" --hardware "$PROFILE" \
        --gpu-mem-gb "$gib" $flags >> "$D/${name}_$label.log" 2>&1
      echo "$name $label run $r rc=$? $(grep 'host time' "$D/${name}_$label.log" | tail -1 | cut -c1-120)"
    done
  done
done
rm -f "$D"/*.plan.json
tar czf "$OUT/runtime_ab.tgz" -C /tmp runtime_ab
