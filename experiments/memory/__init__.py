"""The memory contract measured: settings chosen at 100 % of a GPU budget, run by offexec under that budget."""
