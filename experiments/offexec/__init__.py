"""offexec on a real GPU: the H200 runs of FlexGen's workload."""
