# Run 2026-12-02 18:11-18:14 UTC on the lent NVIDIA H200 machine (16 CPU cores, 128 GiB), code at 55c9fa9,
# carrying .whl (../shared/tools/device-wheels.sh) and .whl-ray (experiments/sweeps/ray_slim.sh: Ray 2.60.0, py3.12),
# results/ moved out of the working tree for the call (64 MiB limit):
COMMIT=55c9fa9 N=96 WORKERS="16 1" TL=400 bash experiments/sweeps/device_scaling.sh
# then here: tar xzf scaling.tgz -C results/sweeps/h200_cpus && python -m experiments.sweeps.device_scaling results/sweeps/h200_cpus
