# the device call that measured p1984_g32/ (one NVIDIA H200, 2026-12-04 ~12:05 UTC, code 07babc2; the run's stdout
# was not kept beyond its summary table, which offexec_h200.json holds in full)
mkdir -p /tmp/site2; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=07babc2
timeout 560 python3 -m experiments.offexec.h200 --out $OUT/x --time-limit-s 480 --prompt-len 1984 --gpu-batch-size 4 --num-gpu-batches 4
tar czf $OUT/p1984.tgz -C $OUT x
