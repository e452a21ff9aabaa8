#!/usr/bin/env bash
# Ray for the GPU machine, small enough to travel there (issue 19: the sweep's 1 vs 16 workers on its 16 cores).
# The machine has no network and a run carries at most 64 MiB with the working tree; Ray's wheel alone is 79 MB.
# This installs Ray (the version pinned here, or RAY_VERSION) for the machine's Python into a folder, without what a
# local runtime running `offsim sweep` never imports -- the Java jars, RLlib, Data, Serve, Tune, Train, LLM and the
# dashboard's web client -- with its native binaries stripped, plus the one dependency that image lacks (jsonschema
# and its own: ../.library/device/KINDS.md lists what is there), and packs it as .whl-ray/ray-slim.tgz.
#
#   bash experiments/sweeps/ray_slim.sh                 # for the GPU machine's python3.12
#   PYVER=3.11 OUT=/tmp/rs bash experiments/sweeps/ray_slim.sh   # for this machine: to try the slimmed Ray here
#
# There: `mkdir -p /tmp/site && tar xzf .whl-ray/ray-slim.tgz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD`
# (experiments/sweeps/device_scaling.sh does it).
set -euo pipefail
PYVER=${PYVER:-3.12}
RAY_VERSION=${RAY_VERSION:-$(python3 -c "import importlib.metadata as m; print(m.version('ray'))" 2>/dev/null || echo 2.60.0)}
OUT=${OUT:-.whl-ray}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 -m pip install -q --no-deps --only-binary=:all: --python-version "$PYVER" --platform manylinux2014_x86_64 \
  --implementation cp --target "$T/site" "ray==$RAY_VERSION" jsonschema jsonschema-specifications referencing \
  rpds-py
R=$T/site/ray
rm -rf "$R"/jars "$R"/rllib "$R"/data "$R"/serve "$R"/tune "$R"/train "$R"/llm "$R"/dashboard/client "$T"/site/bin
find "$T/site" -name __pycache__ -type d -prune -exec rm -rf {} +
# native code: symbols only (Ray's binaries ship unstripped)
for f in "$R"/_raylet.so "$R"/core/src/ray/gcs/gcs_server "$R"/core/src/ray/raylet/raylet; do
  strip --strip-unneeded "$f"
done
mkdir -p "$OUT"
tar czf "$OUT/ray-slim.tgz" -C "$T/site" .
echo "$OUT/ray-slim.tgz: ray $RAY_VERSION for python $PYVER, $(du -m "$OUT/ray-slim.tgz" | cut -f1) MB"
