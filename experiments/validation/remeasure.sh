#!/usr/bin/env bash
# Issue 13: re-measure cases of matrix v2 on the GPU machine at one commit, with the full warm-up: short cases
# (< SHORT_S s in their last run) REPEATS times back to back (the median run kept, every total recorded), long ones
# once. Resumable: cases already in build/remeasure (carried to the machine) are skipped. Each call leaves
# $OUT/v_<SPLIT>_<HHMMSS>.tgz; extract it into build/remeasure here, then compare with
# `python -m experiments.validation.remeasure_compare`.
#
#   CASES="tag1 tag2" SPLIT=calib REPEATS=3 TL=480 COMMIT=abc1234 bash experiments/validation/remeasure.sh
#
# CONFIG: the matrix configuration (default results/validation/matrix_v2_config.json; the mixed-length extension:
# results/validation/matrix_v2_mixed_config.json, whose cases' first runs are measured this way too, a case never
# run before timed by its predicted run); CASES: the tags to measure (default: every case of SPLIT); TL: start no
# case after this many seconds (a case
# started before TL runs to its end); LIMIT: the device call's limit in s (default 600): the runs stop 25 s before it.
# The machine has no network: the wheels of simpy, cvxpy & co. travel in .whl (../shared/tools/device-wheels.sh).
set -u
START=$(date +%s)  # the device call's clock starts about here (LIMIT below)
SPLIT=${SPLIT:-calib}; REPEATS=${REPEATS:-3}; SHORT_S=${SHORT_S:-20}; TL=${TL:-480}
WMODE=${WMODE:-full}; KEEP=${KEEP:-median}; CONFIG=${CONFIG:-results/validation/matrix_v2_config.json}; COMMIT=${COMMIT:?set COMMIT to the code\'s commit (the copy has no .git)}
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
STAMP=$(date +%H%M%S)
V=$OUT/v; mkdir -p "$V" /tmp/disktier
# pack $V however the script ends: a device call cut at its limit (SIGTERM) returns at most 8 files from $OUT, so the
# unpacked case files would be lost (2026-12-03: 10 held-out cases measured, 3 came back)
pack() { trap - EXIT TERM INT; cd "$OUT" && [ -d v ] && tar czf "v_${SPLIT}_$STAMP.tgz" v && rm -rf v; exit "${1:-0}"; }
trap 'pack 143' TERM INT
trap 'pack $?' EXIT
[ -d build/remeasure ] && cp -r build/remeasure/. "$V"/
read -r SHORT LONG SLACK < <(python3 - <<PY
import json
cfg = json.load(open('$CONFIG'))['cases']
wall = {c['tag']: c['predicted']['total_s'] for c in cfg if 'predicted' in c}  # never run: its predicted run
for line in open('results/validation/matrix_v2_runs.jsonl'):
    r = json.loads(line)
    if 'wall_s' in r:
        wall[r['case']] = r['wall_s']
want = set("${CASES:-}".split())
tags = [c['tag'] for c in cfg if c['split'] == '$SPLIT' and (not want or c['tag'] in want)]
unknown = want - set(tags)
assert not unknown, f"not in split $SPLIT: {sorted(unknown)}"
tags.sort(key=lambda t: wall.get(t, 1e9))  # short cases first: a time limit loses the long tail, not the many
short = [t for t in tags if wall.get(t, 1e9) < $SHORT_S]
long_ = [t for t in tags if t not in short]
# a safety net, not the limit (TL is: no case starts after it): a case started just before TL runs its warm-up and
# its measured runs, about (1 + REPEATS) times its last run's wall time, plus its model's weights
slack = 120 + (1 + $REPEATS) * max([wall.get(t, 300) for t in tags] or [0])
print(','.join(short) or '-', ','.join(long_) or '-', int(slack))
PY
)
M="python3 -u -m experiments.validation.matrix --config $CONFIG \
  --profile results/profiles/h200_offexec.json --out $V --warmup --warmup-mode $WMODE --keep $KEEP \
  --disk-dir /tmp/disktier --commit $COMMIT --kv-solver exact"
# the device call's own limit (LIMIT s from the script's start): each matrix call is stopped PACK_S before it, so
# that the folder is packed and comes back whole; a case cut there is lost, the finished ones are not
LIMIT=${LIMIT:-600}; PACK_S=25
within() {  # min($1, what is left before the stop); at least 1 ('timeout 0' would mean no limit at all)
  local left=$((LIMIT - PACK_S - $(date +%s) + START)); local t=$(( $1 < left ? $1 : left )); echo $(( t < 1 ? 1 : t ))
}
# HOST_ROWS: models (comma-separated) whose CPU-attention rows (offexec's path, 'attn_ctx:B') are measured first, in
# this call: $V/session_cpu_rows.json, profile v2 with those rows as the host is now. The same CPU-attention plans
# ran up to 25 % apart from one call to the next while repeats within a call agreed within a few per cent
# (results/offexec/cpu_threads_3732f5b): validating those cases on the call's own rows (`offsim validate DIR
# --hardware session_cpu_rows.json`, beside profile v2) says whether the model or the host's state misses them.
# About 100 s a model, before the cases (not counted in TL).
if [ -n "${HOST_ROWS:-}" ]; then
  NM=$(echo "$HOST_ROWS" | tr ',' '\n' | wc -l)
  timeout "$(within $((150 * NM)))" python3 -u -m offexec.cli profile --base results/profiles/h200_offexec_v2.json \
    --ops "$HOST_ROWS" --cpu-attention-only offexec --out "$V/session_cpu_rows.json" \
    > "$V/session_cpu_rows.log" 2>&1; echo "host rows rc=$?"
fi
T0=$(date +%s)
if [ "$SHORT" != "-" ]; then
  timeout "$(within $((TL + SLACK)))" $M --cases ${SHORT//,/ } --repeats "$REPEATS" --time-limit-s "$TL" \
    > "$V/run_${SPLIT}_short_$STAMP.log" 2>&1; echo "short rc=$?"
fi
LEFT=$((TL - $(date +%s) + T0))
if [ "$LONG" != "-" ] && [ $LEFT -gt 30 ]; then
  timeout "$(within $((LEFT + SLACK)))" $M --cases ${LONG//,/ } --time-limit-s "$LEFT" \
    > "$V/run_${SPLIT}_long_$STAMP.log" 2>&1; echo "long rc=$?"
fi
tail -n 4 "$V"/run_${SPLIT}_*_"$STAMP".log 2>/dev/null | cut -c1-300
