"""offexec: run an offsim plan on a real GPU (or the CPU, for tests) and measure it."""
