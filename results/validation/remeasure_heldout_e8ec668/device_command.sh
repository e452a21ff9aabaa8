# 2026-12-03, one NVIDIA H200, code at e8ec668: the held-out split's Llama-3-8B cases (chosen by model, as the
# calibration ones: results/validation/remeasure_calib_e8ec668/device_command.sh), median of 3 repeats.
CASES="llama-3-8b_static-accelerate_b40_p2048_g32 llama-3-8b_flexgen_b24_p512_g32 llama-3-8b_flexgen_b40_p512_g16 llama-3-8b_flexgen-cpuattn_b40_p256_g16 llama-3-8b_static-accelerate_b24_p1024_g64_disk" SPLIT=heldout REPEATS=3 TL=300 LIMIT=400 COMMIT=e8ec668 bash experiments/validation/remeasure.sh
