"""The one exception type offsim raises for bad input.

The CLI catches it and prints its message on one line with exit code 2; library users catch it like a ValueError.
"""


class OffsimError(ValueError):
    """Bad input (unknown name, infeasible workload, malformed file): the message says what and what would be valid."""
