# issue 13: is the slower CPU attention of 2026-12-01's calibration re-measurement the host or the executor?
# The same stored plans (saved at b497c67) run by today's executor and by b497c67's (build/ab/old), alternating, each
# with its own warm-up, the host probe (offexec/hostprobe.py) before each run. carry [".snap", ".whl", "build/ab"]
set -u
. .snap/dev.sh
export OFFSIM_COMMIT=$(cat .snap/commit)
OX='import sys; sys.argv[0]="offexec"; from offexec.cli import main; sys.exit(main())'
mkdir -p $OUT/ab
NEW=$PWD; OLD=$PWD/build/ab/old
probe() { PYTHONPATH=/tmp/site:$NEW python3 -c "from offexec.hostprobe import host_probe; import json; print(json.dumps({'at': '$1', **host_probe()}))" >> $OUT/ab/probes.jsonl; }
probe start
for i in 1 2; do  # ~30 s a run: 12 runs
  for side in new old new14; do  # new14: today's executor with torch's CPU threads at 14 of 16 (oversubscription?)
    R=$NEW; [ $side = old ] && R=$OLD
    T=""; [ $side = new14 ] && T="OMP_NUM_THREADS=14"
    for t in opt-6.7b_flexgen-cpuattn_b32_p128_g16:32 llama-3-8b_flexgen-cpuattn_b16_p256_g64:16; do
      n=${t%%:*}; g=${t##*:}
      probe "${n}_${side}_$i"
      (cd $R && env $T PYTHONPATH=/tmp/site:$R timeout 240 python3 -u -c "$OX" run --plan $NEW/build/ab/$n.plan.json.gz \
          --gpu-mem-gb $g --hardware $R/results/profiles/h200_offexec.json --trace $OUT/ab/${n}_${side}_$i.csv \
          > $OUT/ab/${n}_${side}_$i.log 2>&1); echo "$n $side $i rc=$?"
      grep -h "tok/s" $OUT/ab/${n}_${side}_$i.log | head -3 | cut -c1-200
    done
  done
done
probe end
cd $OUT && tar czf ab.tgz ab && rm -rf ab
