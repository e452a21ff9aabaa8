#!/usr/bin/env bash
# Does the link sweep see what a run's copies see? On one H100 host (2026-12-06, results/offexec/h100prof_fd0e0c5/)
# decode's host-to-GPU copies moved 49.4-50.3 GB/s with the H2D stream busy 99-100 % of decode, while the one-buffer
# probes read 53.9-55.0 GB/s on that host (the profile's, and the run's own in-process probe), so offsim's prediction
# missed by +9 to +11 %; on another H100 host three hours before, the copies ran at 54.2 GB/s and offsim was within 2.7 %.
# This call measures, on one machine, in one go:
#   1. `offexec profile --link-sweep-only` at pools of 16 and 64 GiB (provenance.link_sweep: each pass's rate over the
#      pool, and one chunk copied as often) on the card's profile;
#   2. experiments.offexec.h200 at OPT-30B 512/32 (FlexGen's placement and TightLLM), whose link section now holds a
#      pass over the pinned weights (sweep_h2d_bytes_per_s) beside the one-GiB probe, and whose runs report the rate
#      decode's copies achieved (decode_h2d_achieved_bytes_per_s).
# If the sweep reads what the runs' copies achieve where the one-buffer probe does not, the profile's large-copy rate
# should come from the sweep; if all three agree on this host, the slow host of 2026-12-06 is not reproduced.
#
#   OFFSIM_COMMIT=abc1234 [PROFILE=results/profiles/h100_offexec.json] bash experiments/offexec/link_sweep_check.sh
#   (carry .whl; writes $OUT/link_sweep.tgz; about 5 min)
set -u
: "${OFFSIM_COMMIT:?set OFFSIM_COMMIT to the commit of the code (the copy has no .git)}"
PROFILE=${PROFILE:-results/profiles/h100_offexec.json}
mkdir -p /tmp/site2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT
R=$OUT/link_sweep; mkdir -p "$R"
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv | tee "$R/gpu.txt"
for gb in 16 64; do
  timeout 120 python3 -m offexec.cli profile --base "$PROFILE" --link-sweep-only --sweep-pool-gb $gb \
    --out "$R/sweep_${gb}g.json" > "$R/sweep_${gb}g.log" 2>&1
  echo "sweep ${gb} GiB rc=$?"
done
timeout 330 python3 -m experiments.offexec.h200 --hardware "$PROFILE" --out "$R/p512_g32" --time-limit-s 240 \
  --configs flexgen_gpu_attn tightllm > "$R/p512.log" 2>&1
echo "h200 rc=$?"; tail -6 "$R/p512.log"
python3 - "$R" <<'EOF'
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
for f in sorted(r.glob("sweep_*.json")):
    s = json.loads(f.read_text())["provenance"]["link_sweep"]
    print(f.name, "pool", s["pool_bytes"] / 2**30, "GiB; passes", [round(x / 1e9, 1) for x in s["pass_bytes_per_s"]],
          "GB/s; one chunk repeated", round(s["h2d_repeat_bytes_per_s"] / 1e9, 1))
d = json.loads((r / "p512_g32/offexec_h200.json").read_text())
print("run link", {k: round(v / 1e9, 1) for k, v in d["link"].items()})
for x in d["runs"]:
    print(x["config"], "decode H2D achieved", round(x["decode_h2d_achieved_bytes_per_s"] / 1e9, 1), "GB/s, busy",
          round(x["decode_h2d_stream_busy_frac"], 3))
EOF
tar czf "$OUT/link_sweep.tgz" -C "$OUT" link_sweep
