"""The one place that runs HiGHS: every LP/MILP in offsim (FlexGen's LP, the TightLLM KV distributor, the Select-N
coordinator) is solved through ``run_quietly`` (cvxpy problems through ``solve_quietly``) so that HiGHS never writes
to stdout -- the CLIs promise that the last line of stdout is JSON, and notebooks should not show a licence banner."""
from __future__ import annotations

import os
import sys

_BANNER_SHOWN = [False]


def run_quietly(fn, *args, **kw):
    """``fn(*args, **kw)``, a HiGHS solve, without HiGHS's banner on stdout. HiGHS prints it from C on the first
    solve of the process whatever ``output_flag`` says, so that first solve runs with file descriptor 1 pointed at
    /dev/null; later solves only need ``output_flag`` off."""
    if _BANNER_SHOWN[0]:
        return fn(*args, **kw)
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return fn(*args, **kw)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        _BANNER_SHOWN[0] = True


def solve_quietly(prob, **kw):
    """``prob.solve(**kw)`` (a cvxpy problem) without HiGHS's banner on stdout (``run_quietly``)."""
    import cvxpy as cp

    if kw.get("solver") in (cp.HIGHS, "HIGHS"):
        kw.setdefault("output_flag", False)
    return run_quietly(prob.solve, **kw)
