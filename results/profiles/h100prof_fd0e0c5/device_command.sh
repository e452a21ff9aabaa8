set -x
mkdir -p /tmp/site2; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site2:$PWD OFFSIM_COMMIT=${C:-5e339da}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv
mkdir -p /tmp/h100prof; date -u
timeout 130 python3 -m offexec.cli profile --model opt-30b --name h100-offexec --out $OUT/h100_base.json > $OUT/log_base.txt 2>&1; echo "base rc=$?"
tail -3 $OUT/log_base.txt; date -u
timeout 360 python3 -m offexec.cli profile --base $OUT/h100_base.json --ops opt-30b --name h100-offexec --out $OUT/h100_ops.json > $OUT/log_ops.txt 2>&1; echo "ops rc=$?"
tail -3 $OUT/log_ops.txt; date -u
timeout 55 python3 -m offexec.cli profile --base $OUT/h100_ops.json --ops opt-30b --sustained-only layer --name h100-offexec --out $OUT/h100_offexec.json > $OUT/log_sus.txt 2>&1; echo "sus rc=$?"
tail -3 $OUT/log_sus.txt; date -u
cp $OUT/*.json /tmp/h100prof/; ls -la /tmp/h100prof
