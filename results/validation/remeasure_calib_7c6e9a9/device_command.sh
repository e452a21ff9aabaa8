# 2026-12-02, one NVIDIA H200, code at 7c6e9a9 (.snap/commit): the calibration split with the full warm-up, short
# cases first (median of 3 repeats), resumed over four calls by carrying the output folder (cases already there are
# skipped); 14 of 34 cases reached before the session's device time ran out. Each call's log is here.
SPLIT=calib REPEATS=3 TL=200 WMODE=full KEEP=median bash .snap/remeasure2.sh   # then TL=360, TL=80; carry .snap .whl build/remeasure
