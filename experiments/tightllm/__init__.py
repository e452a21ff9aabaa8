"""TightLLM (IEEE TC'25) reproduced: throughput, ablations, latency breakdown, N_r, planning speed (simulated), and
its components measured on the H200."""
