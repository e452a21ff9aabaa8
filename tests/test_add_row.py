"""``PlanBuilder.add_row``: the ops of ``add`` with the fields dict kept as given (shared between rows)."""
import pytest

from offsim.core.plan import PlanBuilder


def _calls():
    hidden = {"tensor": "hidden", "lo": 0, "hi": 1, "nbytes": 2, "alloc": (2, 0, 0)}
    layer = {"part": "layer", "num_seqs": 1, "q_tokens": 1, "ctx_tokens": 1}
    return [("compute", [None], layer), ("h2d", [0, None, 0], hidden), ("d2h", (1,), hidden),
            ("compute", [2, 0, 1, 2], layer), ("h2d", [3, 1], hidden), ("h2d", [], hidden)]


@pytest.mark.parametrize("serial", [False, True])
def test_add_row_builds_what_add_builds(serial):
    a, b = PlanBuilder(serial=serial), PlanBuilder(serial=serial)
    for kind, deps, f in _calls():
        assert a.add(kind, deps, "prefill", 0, 0, 0, **f) == b.add_row(kind, deps, "prefill", 0, 0, 0, f)
    assert [o.deps for o in b.ops] == [o.deps for o in a.ops]
    assert b.ops == a.ops


def test_add_row_shares_its_fields_and_refuses_as_add():
    b = PlanBuilder()
    calls = _calls()
    for kind, deps, f in calls:
        b.add_row(kind, deps, "prefill", 0, 0, 0, f)
    rows = b.ops.rows
    assert rows[1][6] is rows[2][6] is calls[1][2]  # one dict for the rows of one shape
    assert rows[3][1] == (0, 1, 2)  # Nones dropped, duplicates merged, sorted
    with pytest.raises(TypeError, match="unknown fields"):
        b.add_row("h2d", [], "prefill", 0, 0, 0, {"colour": "red"})
    with pytest.raises(KeyError):
        b.add_row("teleport", [], "prefill", 0, 0, 0, {})
    # a stream of its own is kept on an Op (as ``add`` keeps it); from then on the builder appends Ops
    assert b.add_row("d2h", [0], "prefill", 0, 0, 0, {"stream": "h2d", "tensor": "hidden", "lo": 0, "hi": 1,
                                                       "nbytes": 2}) == len(calls)
    assert b.ops.rows is None and b.ops[-1].stream == "h2d"
    assert b.add_row("h2d", [len(calls)], "prefill", 0, 0, 0, calls[1][2]) == len(calls) + 1
    assert b.ops[-1].deps == (len(calls),) and b.ops[-1].alloc == (2, 0, 0)
