"""Does an EMA still follow its model after a dtype conversion? The probe behind the stale-cache lesson."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..bench import models
from ..ema import ModelEMA

__all__ = ["CONVERSIONS", "follows_after"]

#: name -> what it does to (model, ema); each gives parameters new memory behind the same objects.
CONVERSIONS: dict[str, Callable[[nn.Module, ModelEMA], object]] = {
    "model.double()": lambda model, ema: model.double(),
    "ema.ema.half()": lambda model, ema: ema.ema.half(),
}


@dataclass(frozen=True)
class FollowCheck:
    """What happened to an EMA after a conversion and one shift of every model weight."""

    ema_class: str
    conversion: str
    ema_moved: bool  # did any EMA weight change at all
    gap: float  # max |EMA - model| afterwards, in the model's units (the shift is 1.0)

    @property
    def follows(self) -> bool:
        """True when the EMA closed (almost all of) the gap the shift opened."""
        return self.gap < 0.05


def _float_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def follows_after(ema_class: type[ModelEMA], conversion: str, updates: int = 20) -> FollowCheck:
    """Update once, apply ``conversion``, shift every model weight by 1.0, update ``updates`` more times.

    The EMA runs at decay ~0.5 (``tau`` tiny), so a working EMA closes the gap to within 0.5**updates.
    """
    if conversion not in CONVERSIONS:
        raise ValueError(f"unknown conversion {conversion!r}; expected one of {sorted(CONVERSIONS)}")
    model = models.build("tiny_cnn")
    ema = ema_class(model, decay=0.5, tau=0.01)
    ema.update(model)  # builds whatever cache the class keeps
    CONVERSIONS[conversion](model, ema)
    before = {k: v.clone() for k, v in _float_entries(ema.ema).items()}
    with torch.no_grad():
        for v in _float_entries(model).values():
            v.add_(1.0)
    for _ in range(updates):
        ema.update(model)
    after, target = _float_entries(ema.ema), _float_entries(model)
    moved = any(not torch.equal(before[k], v) for k, v in after.items())
    gap = max((v.double() - target[k].double()).abs().max().item() for k, v in after.items())
    return FollowCheck(ema_class.__name__, conversion, moved, gap)
