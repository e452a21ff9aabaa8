# 2026-12-02 16:27 UTC, one NVIDIA H200, code of bcedf0c (run as 34657a2+dirty: the device copy had bcedf0c's
# offexec changes, not yet committed; none touches a single-GPU run): the two opt-30b calibration cases the
# session's last device minutes allowed, once each after the full warm-up (both are long cases, > 20 s).
CASES="opt-30b_flexgen-cpuattn_b8_p128_g32 opt-30b_flexgen_b40_p256_g16" \
  SPLIT=calib REPEATS=1 TL=120 COMMIT=34657a2+dirty bash experiments/validation/remeasure.sh   # carry: .whl
