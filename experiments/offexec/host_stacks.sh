#!/usr/bin/env bash
# Stored plans run under py-spy (native frames, every thread) on the GPU machine, for experiments.offexec.host_stacks
# (issue 14: where an op handler's host time goes in a run). Carry .whl-tools (py-spy's wheel, fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl-tools py-spy
# ). Each plan: PLAN_FLAGS.txt (py-spy raw stacks) and PLAN_FLAGS.log (the run's output, for runs_table), in
# $OUT/host_stacks.tgz.
#
#   PLANS="ab/p512_eager.plan.json.gz:16 ..." FLAGS="--run-ahead 2 6 16" OFFSIM_COMMIT=abc1234 \
#       bash experiments/offexec/host_stacks.sh
set -u
: "${OFFSIM_COMMIT:?set OFFSIM_COMMIT to the commit of the code (the copy has no .git)}"
: "${PLANS:?set PLANS to 'plan.json[.gz]:GIB ...'}"
FLAGS=${FLAGS:-}
# 2026-12-04: at 500 Hz with --native an OPT-30B 16 x 3 run (weights made, warm-up, run) did not finish in 240 s and
# the timeout's SIGTERM left no profile at all. So: 100 Hz, and py-spy stops itself after DURATION s (writing what
# it has) before the outer timeout; `offexec run --host-profile` (cProfile, one thread) is the cheaper first look.
RATE=${RATE:-100}
DURATION=${DURATION:-200}
PROFILE=${PROFILE:-results/profiles/h200_offexec_v2.json}
python3 -m pip install -q --no-index --no-deps --target /tmp/tools .whl-tools/py_spy-*.whl
SPY=$(find /tmp/tools -name py-spy -type f | head -1)
chmod +x "$SPY"
export PYTHONPATH=$PWD
D=/tmp/host_stacks
mkdir -p "$D"
for entry in $PLANS; do
  src=${entry%:*}; gib=${entry##*:}
  name=$(basename "$src"); name=${name%.gz}; name=${name%.plan.json}; name=${name%.json}
  case "$src" in *.gz) gunzip -c "$src" ;; *) cat "$src" ;; esac > "$D/$name.plan.json"
  tag=$name$(echo " $FLAGS" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_')
  # shellcheck disable=SC2086  # FLAGS are words
  timeout $((DURATION + 40)) "$SPY" record --native --threads -r "$RATE" -d "$DURATION" -f raw -o "$D/$tag.txt" -- \
    python3 -u -m offexec.cli run --plan "$D/$name.plan.json" --hardware "$PROFILE" --gpu-mem-gb "$gib" $FLAGS \
    > "$D/$tag.log" 2>&1
  echo "$tag rc=$? $(grep 'host time' "$D/$tag.log" | cut -c1-120)"
  python3 -m experiments.offexec.host_stacks "$D/$tag.txt" --out "$D/$tag" > /dev/null 2>&1 || true
  rm -f "$D/$name.plan.json"
done
tar czf "$OUT/host_stacks.tgz" -C /tmp host_stacks
