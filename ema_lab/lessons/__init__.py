"""Pieces the notebooks import: thop profiling (notebook 03, docs/flop_counters.md) and the distributed EMA
(notebook 06). ``profiling`` needs the ``notebooks`` extra (the pinned ``thop``).
"""
