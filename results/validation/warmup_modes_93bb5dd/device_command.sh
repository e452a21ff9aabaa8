# issue 13: does a warm-up at the run's own length remove run 0's first-step cost? 4 calibration cases whose kept
# run 0 had a large step-1 excess (calib_misses.md, "The first decode step"), each with --warmup-mode short,
# same-length, full; --repeats 2 --keep first (run 0's steps kept, both totals recorded). carry [".snap", ".whl"]
set -u
. .snap/dev.sh
export OFFSIM_COMMIT=$(cat .snap/commit)
mkdir -p $OUT/w /tmp/disktier
CASES="llama-3-8b_tightllm_b40_p512_g32 opt-13b_static-accelerate_b32_p128_g64 opt-6.7b_static-accelerate_b32_p1024_g16 llama-2-13b_selectn_b32_p256_g16"
for mode in short same-length full; do
  timeout 170 python3 -u -m experiments.validation.matrix --config results/validation/matrix_v2_config.json \
    --profile results/profiles/h200_offexec.json --out $OUT/w/$mode --warmup --warmup-mode $mode --disk-dir /tmp/disktier \
    --commit $OFFSIM_COMMIT --kv-solver exact --cases $CASES --repeats 2 --keep first > $OUT/w/$mode.log 2>&1
  echo "$mode rc=$?"; grep -h "measured" $OUT/w/$mode.log | tail -4 | cut -c1-200
done
python3 - <<'PY'
import json, glob, os, numpy as np
for f in sorted(glob.glob(os.environ['OUT'] + '/w/*/*/*.case.json') + glob.glob(os.environ['OUT'] + '/w/*/*.case.json')):
    c = json.load(open(f)); st = np.array([s[3] for s in c['steps']])
    print(f.split('/w/')[1][:70], 'step1 excess %.1f ms' % ((st[1] - np.median(st[2:])) * 1e3), 'totals', c['meta'].get('repeat_total_tok_s'))
PY
cd $OUT && tar czf w.tgz w && rm -rf w
