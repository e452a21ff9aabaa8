# issue 13: re-measure a split of matrix v2 at one commit, short cases (< SHORT_S s in their last run) REPEATS times
# (median kept, spread recorded), long ones once. Usage:
#   SPLIT=calib REPEATS=3 bash .snap/remeasure2.sh   (carry build/remeasure to resume: cases already there are skipped)
set -u
. .snap/dev.sh
export OFFSIM_COMMIT=$(cat .snap/commit)
SPLIT=${SPLIT:-calib}; REPEATS=${REPEATS:-3}; SHORT_S=${SHORT_S:-20}; TL=${TL:-480}
mkdir -p $OUT/v /tmp/disktier
[ -d build/remeasure ] && cp -r build/remeasure/. $OUT/v/
read -r SHORT LONG < <(python3 - <<PY
import json
cfg = json.load(open('results/validation/matrix_v2_config.json'))['cases']
wall = {}
for line in open('results/validation/matrix_v2_runs.jsonl'):
    r = json.loads(line)
    if 'wall_s' in r: wall[r['case']] = r['wall_s']
tags = [c['tag'] for c in cfg if c['split'] == '$SPLIT']
short = [t for t in tags if wall.get(t, 1e9) < $SHORT_S]
long_ = [t for t in tags if t not in short]
print(','.join(short), ','.join(long_))
PY
)
WMODE=${WMODE:-short}; KEEP=${KEEP:-median}  # the warm-up and kept-run protocol (next16.sh decides)
M="python3 -u -m experiments.validation.matrix --config results/validation/matrix_v2_config.json --profile results/profiles/h200_offexec.json --out $OUT/v --warmup --warmup-mode $WMODE --keep $KEEP --disk-dir /tmp/disktier --commit $OFFSIM_COMMIT --kv-solver exact"
T0=$(date +%s)
timeout $((TL + 60)) $M --cases ${SHORT//,/ } --repeats $REPEATS --time-limit-s $TL > $OUT/v/run_${SPLIT}_short.log 2>&1; echo "short rc=$?"
LEFT=$((TL - $(date +%s) + T0))
[ $LEFT -gt 30 ] && { timeout $((LEFT + 60)) $M --cases ${LONG//,/ } --time-limit-s $LEFT > $OUT/v/run_${SPLIT}_long.log 2>&1; echo "long rc=$?"; }
tail -3 $OUT/v/run_${SPLIT}_*.log | cut -c1-300; ls $OUT/v/h200_$SPLIT | wc -l
cd $OUT && tar czf v.tgz v && rm -rf v
