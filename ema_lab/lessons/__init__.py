"""Pieces the notebooks build in their cells and then import: thop profiling, the float64 buffer bug,
the stale-cache probe, a low-precision EMA's stall and the distributed EMA.

``profiling`` and ``float64_bug`` need the ``notebooks`` extra (the pinned ``thop``).
"""
