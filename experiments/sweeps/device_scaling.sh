#!/usr/bin/env bash
# Issue 19 on the GPU machine's CPUs: the first N points of the TightLLM-vs-FlexGen sweep
# (experiments/sweeps/tightllm_vs_flexgen.yaml, in grid order: `offsim sweep --max-points N`) with each worker count
# of WORKERS on a local Ray runtime, each in its own output folder -- the same points each time, so the folders'
# sweep.json wall times compare directly, and their tables must be identical. Leaves $OUT/scaling.tgz.
#
#   bash experiments/sweeps/ray_slim.sh          # once, here: .whl-ray/ray-slim.tgz (Ray for the machine's Python)
#   COMMIT=abc1234 N=96 WORKERS="16 1" bash experiments/sweeps/device_scaling.sh
#   (here) mkdir -p results/sweeps/h200_cpus && tar xzf scaling.tgz -C results/sweeps/h200_cpus &&
#          python -m experiments.sweeps.device_scaling results/sweeps/h200_cpus
#
# Carry .whl (../shared/tools/device-wheels.sh: simpy, cvxpy & co.) and .whl-ray, and move results/ out of the
# working tree for the call (64 MiB in all: the two are ~58 MB). TL: each run's time limit in seconds.
set -u
export OFFSIM_COMMIT=${COMMIT:?set COMMIT to the code\'s commit (the copy has no .git)}
N=${N:-96}; WORKERS=${WORKERS:-16 1}; TL=${TL:-480}; RAY_TGZ=${RAY_TGZ:-.whl-ray/ray-slim.tgz}
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE" "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl 2> /dev/null
fi
tar xzf "$RAY_TGZ" -C "$SITE"
export PYTHONPATH=$SITE:$PWD
python3 -c "import ray, os; print('ray', ray.__version__, 'from', os.path.dirname(ray.__file__), '|', os.cpu_count(), 'CPUs')" \
  | tee "$OUT/env.log"
names=()
for w in $WORKERS; do
  T0=$(date +%s)
  timeout "$TL" python3 -u -m offsim.cli sweep experiments/sweeps/tightllm_vs_flexgen.yaml --workers "$w" \
    --max-points "$N" --out "$OUT/w$w" --no-progress > "$OUT/w$w.log" 2>&1
  echo "workers $w: rc=$? $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.log"
  names+=("w$w" "w$w.log")
done
cd "$OUT" && tar czf scaling.tgz env.log "${names[@]}" && rm -rf "${names[@]}"
