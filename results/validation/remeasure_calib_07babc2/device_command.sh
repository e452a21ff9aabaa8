# 2026-12-04 11:49-12:00 UTC, one NVIDIA H200 (nvidia-h200 device machine, torch 2.11.0+cu130), code at 07babc2.
# Two device calls (carry: .whl). The first also ran profile_updates.sh step 20 (results/profiles/new_q_07babc2/).
# 1. the largest calibration miss again (offsim +34.8 % on its 7040813 run):
COMMIT=07babc2 STEPS=20 bash experiments/validation/profile_updates.sh
LIMIT=$(( 585 - 39 )) SPLIT=calib REPEATS=3 TL=$(( 500 - 39 )) COMMIT=07babc2 CASES="opt-13b_tightllm_b32_p128_g32" bash experiments/validation/remeasure.sh
# 2. four CPU-attention calibration cases, with their models' CPU-attention rows measured first in the same call
#    (HOST_ROWS -> session_cpu_rows.json, a whole profile: v2 with those rows replaced):
HOST_ROWS=llama-3-8b,llama-2-13b,opt-13b LIMIT=570 SPLIT=calib REPEATS=3 TL=330 COMMIT=07babc2 CASES="llama-3-8b_flexgen-cpuattn_b16_p256_g64 llama-2-13b_flexgen-cpuattn_b40_p2048_g32 opt-13b_flexgen-cpuattn_b16_p128_g16_disk llama-2-13b_flexgen-cpuattn_b16_p128_g64" bash experiments/validation/remeasure.sh
# then, here:
#   python -m experiments.validation.remeasure_compare results/validation/h200_calib /tmp/new --out compare.csv > compare.md
#   offsim validate <the 4 CPU-attention cases> --hardware results/profiles/h200_offexec_v2.json --out cpu_rows_v2
#   offsim validate <the 4 CPU-attention cases> --hardware session_cpu_rows.json --out cpu_rows_session
