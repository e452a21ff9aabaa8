"""FlexGen (ICML'23) reproduced in simulation: its T4 throughput table."""
