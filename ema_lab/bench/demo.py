"""A short demo: every ModelEMA strategy on a zoo model, checked against a float64 reference and timed."""

from __future__ import annotations

import torch

from ..ema import STRATEGIES, ModelEMA
from . import models
from . import sweep as bench
from .reference import model_ema_errors
from .timing import time_candidates


def run_demo(model_name: str = "yolo", steps: int = 20, rounds: int = 5) -> int:
    """Print each strategy's max error against a float64 EMA and its median update time; 1 if any is off."""
    model = models.build(model_name)
    stats = models.describe(model)
    print(f"ema_lab demo: torch {torch.__version__}, 1 thread, model {model_name!r}")
    print(
        f"  {stats.entries} state_dict entries, {stats.float_tensors} float tensors, "
        f"{stats.float_elements:,} float elements"
    )
    errors = model_ema_errors(model, STRATEGIES, steps=steps)
    resolved = {s: s for s in STRATEGIES}
    resolved["auto"] = ModelEMA(model).resolved_strategy
    fns = bench.candidates(model, list(STRATEGIES), lambda: models.build(model_name))
    timed = time_candidates(fns, rounds=rounds, threads=1)
    print(
        f"  {'strategy':<10} {'resolved':<10} {'max |ema - float64 ref|':>24} {'median ms':>9} {'IQR ms':>7}"
    )
    for name in STRATEGIES:
        t = timed[name]
        print(
            f"  {name:<10} {resolved[name]:<10} {errors[name]:>24.2e} "
            f"{1e3 * t.median_s:>9.3f} {1e3 * t.iqr_s:>7.3f}"
        )
    print(f"  ({steps} random-walk steps; {rounds} interleaved timing rounds; `ema_lab bench` measures more)")
    return int(max(errors.values()) > 1e-5)
