"""Experiments: each module reproduces one figure, table or measurement and writes ``results/<name>/``.

Run from the repository root as ``python -m experiments.<topic>.<name>``; ``experiments.common`` holds what they share
(output folders, provenance, plotting defaults, the final JSON line). Topics: ``flexgen``, ``tightllm``, ``selectn``,
``validation``, ``offexec``, ``memory``, ``bench``. See docs/architecture.md (Experiments).
"""
