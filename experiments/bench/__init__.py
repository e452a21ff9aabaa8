"""How fast offsim itself is: plan building and simulation at OPT-175B size."""
