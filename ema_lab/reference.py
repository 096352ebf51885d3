"""Every update strategy against an independent float64 EMA on the same model trajectory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy

import torch
from torch import Tensor, nn

from .pairs import ModulePairs
from .updates import foreach_update, gated_update, loop_update

__all__ = ["STRATEGY_FUNCTIONS", "strategy_errors"]

STRATEGY_FUNCTIONS: dict[str, Callable[[Sequence[Tensor], Sequence[Tensor], float], None]] = {
    "loop": loop_update,
    "foreach": foreach_update,
    "gated": gated_update,
}


def strategy_errors(
    model: nn.Module, steps: int = 10, decay: float = 0.999, seed: int = 0, noise: float = 0.01
) -> dict[str, float]:
    """Max |EMA - float64 reference| of each strategy after ``steps`` updates; ``model`` is left untouched.

    A private copy of the model takes a seeded random walk (a stand-in for optimizer steps); each
    strategy keeps its own EMA tensors, and the reference applies ``d * ema + (1 - d) * model`` in
    float64 to the same trajectory.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = deepcopy(model)
    pairs = ModulePairs.collect(deepcopy(model), model)
    emas = {name: [t.detach().clone() for t in pairs.ema] for name in STRATEGY_FUNCTIONS}
    ref = [t.detach().double() for t in pairs.ema]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(steps):
            for m in pairs.model:
                m.add_(torch.randn(m.shape, generator=gen).to(m), alpha=noise)
            for name, update in STRATEGY_FUNCTIONS.items():
                update(emas[name], pairs.model, decay)
            for r, m in zip(ref, pairs.model):
                r.mul_(decay).add_(m.double(), alpha=1 - decay)
    return {
        name: max((e.double() - r).abs().max().item() for e, r in zip(tensors, ref))
        for name, tensors in emas.items()
    }
