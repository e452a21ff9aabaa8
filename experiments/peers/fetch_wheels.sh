#!/usr/bin/env bash
# Wheels of the peer systems for the H200 machine (Python 3.12, x86-64, no network there; torch 2.11, transformers
# 5.17, accelerate already in its image) into ./.whl-peers (ignored by git through .git/info/exclude). Run from the
# repository root, here. DeepSpeed is published as a source archive only: its pure-Python wheel is built here with
# DS_BUILD_OPS=0 (no CUDA op compiled; ZeRO-3 parameter offload to CPU needs none) against this machine's torch
# (any torch >= 2.0 works: no extension is built). On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .whl-peers/*.whl \
#     && export PYTHONPATH=/tmp/peers:$PWD
# and carry .whl-peers (plus .whl from /work/shared/tools/device-wheels.sh for offsim's own needs, installed by a pip
# call of its own: both hold simpy, and pip refuses a package named twice in one call and then installs nothing --
# a 2026-12-05 run lost DeepSpeed that way).
# Set PY to the python that has torch (default: python3). Lists each wheel's size and the total at the end.
set -euo pipefail
PY=${PY:-python3}
DEST=.whl-peers
EXCL=$(git rev-parse --git-path info/exclude)  # (a worktree's .git is a file)
mkdir -p "$(dirname "$EXCL")"
grep -qx "/$DEST/" "$EXCL" 2>/dev/null || echo "/$DEST/" >> "$EXCL"
mkdir -p "$DEST"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# flexgen 0.1.8 imports attrs (flexgen/utils.py); pulp only in its experimental cost model (not imported); simpy:
# offsim simulates the cached plans (offexec_run) without the rest of device-wheels.sh (cvxpy, HiGHS: 23 MB)
# deepspeed 0.19.8's requirements less what the image has (torch, numpy, packaging, psutil, tqdm, pydantic 2 --
# pydantic and its core are fetched too in case the image lacks them: deepspeed's config is pydantic)
pkgs=${PEER_PKGS:-"flexgen==0.1.8 attrs simpy hjson msgpack ninja py-cpuinfo einops pydantic pydantic-core annotated-types typing-inspection typing-extensions"}
for p in $pkgs; do
  "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$DEST" "$p"
done
if ! ls "$DEST"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
  tar -xzf "$tmp"/deepspeed-0.19.8.tar.gz -C "$tmp"
  (cd "$tmp"/deepspeed-0.19.8 && DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip wheel -q --no-build-isolation \
     --no-deps -w "$OLDPWD/$DEST" .)
  rm -rf "$tmp"
fi
ls -la "$DEST"
du -ch "$DEST"/*.whl | tail -1
