"""``ModelEMA``: a drop-in for ultralytics' class, a thin stateful wrapper over :mod:`ema_lab.updates`."""

from __future__ import annotations

import math
from copy import deepcopy

from torch import nn

from .pairs import ModulePairs, unwrap_model
from .updates import PREPARERS, Step, prepare

__all__ = ["ModelEMA", "STRATEGIES", "copy_attr"]

#: "auto" resolves to the safest fast strategy: "gated" handles every device and dtype mix.
AUTO = "gated"
STRATEGIES = (*PREPARERS, "auto")


def copy_attr(a: object, b: object, include: tuple = (), exclude: tuple = ()) -> None:
    """Copy plain attributes (not starting with ``_``) from ``b`` to ``a``, as ultralytics does."""
    for k, v in b.__dict__.items():
        if (include and k not in include) or k.startswith("_") or k in exclude:
            continue
        setattr(a, k, v)


class ModelEMA:
    """Exponential moving average of a model's weights, with the ramp ``decay * (1 - exp(-n / tau))``.

    Compatible with ``ultralytics.utils.torch_utils.ModelEMA``: ``.ema`` (a deep copy in eval mode,
    no grad), ``.updates``, ``.decay(n)``, ``.update(model)``, ``.update_attr(model)``, ``.enabled``.
    Unlike it, the (EMA, model) tensor pairs are collected once and rebuilt when the model's or the
    EMA's tensors are replaced (``.to()``, ``.half()``, a new parameter), non-float entries are
    copied from the model, tied weights are averaged once, and a failed update changes nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        tau: float = 2000,
        updates: int = 0,
        strategy: str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(decay, (int, float)) and 0.0 < decay < 1.0):
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if not (isinstance(tau, (int, float)) and tau > 0 and math.isfinite(tau)):
            raise ValueError(f"tau must be a positive number, got {tau!r}")
        if not (isinstance(updates, int) and updates >= 0):
            raise ValueError(f"updates must be a non-negative int, got {updates!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        self.ema = deepcopy(unwrap_model(model)).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.updates = updates
        self.max_decay = float(decay)
        self.tau = float(tau)
        self.strategy = strategy
        self.enabled = True
        self._pairs: ModulePairs | None = None
        self._step: Step | None = None

    def decay(self, n: int) -> float:
        """The decay used at update number ``n``: ramps from 0 to ``max_decay``, time constant tau."""
        return self.max_decay * (1 - math.exp(-n / self.tau))

    @property
    def resolved_strategy(self) -> str:
        """The strategy actually run ("auto" resolved)."""
        return AUTO if self.strategy == "auto" else self.strategy

    def _prepared(self, model: nn.Module) -> tuple[ModulePairs, Step]:
        """The cached pairs and step for ``model``, rebuilt (and re-validated) if any tensor was replaced."""
        if self._pairs is None or not self._pairs.is_current(model):
            pairs = ModulePairs.collect(self.ema, model)
            step = prepare(self.resolved_strategy, pairs.ema, pairs.model, pairs.names)
            self._pairs, self._step = pairs, step
        return self._pairs, self._step

    def update(self, model: nn.Module) -> None:
        """Move the EMA one step towards ``model`` (wrapped models are unwrapped)."""
        if not self.enabled:
            return
        pairs, step = self._prepared(unwrap_model(model))
        step(self.decay(self.updates + 1))
        pairs.copy_other()
        self.updates += 1

    def update_attr(
        self, model: nn.Module, include: tuple = (), exclude: tuple = ("process_group", "reducer")
    ) -> None:
        """Copy the model's plain attributes to the EMA module (names, strides, ...)."""
        if self.enabled:
            copy_attr(self.ema, model, include, exclude)

    def __repr__(self) -> str:
        return (
            f"ModelEMA(decay={self.max_decay}, tau={self.tau}, updates={self.updates}, "
            f"strategy={self.strategy!r})"
        )
