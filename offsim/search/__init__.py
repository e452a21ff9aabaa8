"""Search: each policy at its best (``search``), and sweeps of a policy at fixed batches (``sweep``)."""
from offsim.search.search import SearchResult, search

__all__ = ["SearchResult", "search"]
