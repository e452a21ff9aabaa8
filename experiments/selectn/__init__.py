"""Select-N (arXiv 2502.08182) reproduced in simulation: SLO attainment, a shared PCIe link, per-phase intervals."""
