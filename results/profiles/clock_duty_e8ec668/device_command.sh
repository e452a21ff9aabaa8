# 2026-12-03, one NVIDIA H200, code at e8ec668: each matrix model's clock under load ('clock' 'sustained', 'held',
# 'duty' rows: costmodel.ClockModel), step 1 of experiments/validation/profile_updates.sh (198 s). Merged here with
#   offexec profile --base results/profiles/h200_offexec_v2.json --merge results/profiles/clock_duty_e8ec668/sus.json \
#     --out results/profiles/h200_offexec_v2.json
COMMIT=e8ec668 STEPS="1" bash experiments/validation/profile_updates.sh
