"""A short demo: every strategy on a built-in model, checked against a float64 reference."""

from __future__ import annotations

import time

import torch

from . import models
from .ema import STRATEGIES, ModelEMA
from .pairs import ModulePairs


def run_demo(model_name: str = "yolo", steps: int = 20) -> int:
    """Run each ModelEMA strategy for ``steps`` updates on a zoo model; print error and time per update."""
    torch.manual_seed(0)
    model = models.build(model_name)
    stats = models.describe(model)
    print(f"ema_lab demo: torch {torch.__version__}, {torch.get_num_threads()} threads, model {model_name!r}")
    print(
        f"  {stats.entries} state_dict entries, {stats.float_tensors} float tensors, "
        f"{stats.float_elements:,} float elements"
    )
    emas = {s: ModelEMA(model, decay=0.999, tau=10, strategy=s) for s in STRATEGIES}
    ref = ModelEMA(model).ema.double()
    ref_pairs = ModulePairs.collect(ref, model)
    elapsed: dict[str, list[float]] = {name: [] for name in emas}
    worst = 0
    for n in range(1, steps + 1):
        with torch.no_grad():  # stand-in for an optimizer step
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        d = emas["auto"].decay(n)
        for r, m in zip(ref_pairs.ema, ref_pairs.model):
            r.mul_(d).add_(m.double(), alpha=1 - d)
        for name, ema in emas.items():
            t0 = time.perf_counter()
            ema.update(model)
            elapsed[name].append(time.perf_counter() - t0)
    head = (
        f"{'strategy':<10} {'resolved':<10} {'max |ema - float64 ref|':>24} {'first ms':>9} {'median ms':>9}"
    )
    print("  " + head)
    for name, ema in emas.items():
        err = max(
            (e.double() - r).abs().max().item()
            for e, r in zip(ModulePairs.collect(ema.ema, model).ema, ref_pairs.ema)
        )
        worst = max(worst, err > 1e-5)
        first, rest = elapsed[name][0], sorted(elapsed[name][1:]) or [float("nan")]
        median = rest[len(rest) // 2]
        print(
            f"  {name:<10} {ema.resolved_strategy:<10} {err:>24.2e} {1e3 * first:>9.3f} {1e3 * median:>9.3f}"
        )
    print("  (first = collect + validate + update; wall clock, for orientation; `ema_lab bench` measures)")
    return int(worst)
