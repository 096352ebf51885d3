"""Reusable pieces of the notebooks: the PR's before/after code, the model zoo, thop helpers, references.

Small functions the notebooks and tests share; the narrative itself lives in the notebook cells.
``profiling`` and ``float64_bug`` need the ``notebooks`` extra (the pinned ``thop``).
"""
