"""Every ``ModelEMA`` strategy against an independent float64 EMA on the same model trajectory."""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy

import torch
from torch import Tensor, nn

from ..ema import STRATEGIES, ModelEMA
from ..pairs import collect_pairs

__all__ = ["model_ema_errors"]


def _walk(model_tensors: Sequence[Tensor], gen: torch.Generator, noise: float) -> None:
    """One seeded random step of the model's tensors: a stand-in for an optimizer step."""
    with torch.no_grad():
        for m in model_tensors:
            m.add_(torch.randn(m.shape, generator=gen).to(m), alpha=noise)


def _reference_step(ref: list[Tensor], model_tensors: Sequence[Tensor], decay: float) -> None:
    """``ref = d * ref + (1 - d) * model`` in float64, independent of every strategy."""
    with torch.no_grad():
        for r, m in zip(ref, model_tensors):
            r.mul_(decay).add_(m.double(), alpha=1 - decay)


def _max_error(tensors: Sequence[Tensor], ref: Sequence[Tensor]) -> float:
    return max((e.double() - r).abs().max().item() for e, r in zip(tensors, ref))


def model_ema_errors(
    model: nn.Module,
    strategies: Sequence[str] = STRATEGIES,
    steps: int = 10,
    decay: float = 0.999,
    seed: int = 0,
    noise: float = 0.01,
) -> dict[str, float]:
    """Max |EMA - float64 reference| of each ``ModelEMA(strategy=...)`` after ``steps`` updates.

    ``model`` is left untouched: a private copy takes a seeded random walk (a stand-in for optimizer
    steps), and the reference applies ``d * ema + (1 - d) * model`` in float64 to the same trajectory.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = deepcopy(model)
    # tau -> 0 makes the ramp a constant ``decay``, so the reference needs no schedule.
    emas = {name: ModelEMA(model, decay=decay, tau=1e-9, strategy=name) for name in strategies}
    ref = [t.detach().double() for t in collect_pairs([deepcopy(model)], model).ema_floats()]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        # Collected each step: a model may have been flattened (its tensors moved into one buffer).
        model_tensors = collect_pairs([model], model).model_floats()
        _walk(model_tensors, gen, noise)
        for ema in emas.values():
            ema.update(model)
        _reference_step(ref, model_tensors, decay)
    return {name: _max_error(collect_pairs([e.ema], model).ema_floats(), ref) for name, e in emas.items()}
