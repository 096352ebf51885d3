"""The step of ``"loop"``, ``"foreach"`` and ``"gated"``: an update of :mod:`ema_lab.updates` over aliases."""

from __future__ import annotations

from torch import nn

from .flat import Counters
from .pairs import Pairs
from .step import StepOptions
from .updates import prepare
from .watch import Watch

__all__ = ["ListStep"]


class ListStep:
    """``"loop"``, ``"foreach"`` or ``"gated"`` over detached aliases of the pairs, then the counters."""

    modes: list[str] = []
    tensor_decay = False  # a 0-dim tensor decay needs the flat step
    in_place = True  # the EMA's tensors keep their storage (ShardedModelEMA's DTensors rely on it)

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        ema, mod = [e.detach() for e in pairs.ema], [m.detach() for m in pairs.model]
        self.update = prepare(options.strategy, ema, mod, pairs.names)
        self.counters = Counters(pairs.ema_counters, pairs.model_counters)
        self.watch = Watch(model, pairs.ema_slots + pairs.model_slots, sharded=options.sharded)

    def current(self, model: nn.Module) -> bool:
        """True while the model's and the EMA's slots hold the memory this step was built over."""
        return self.watch.current(model)

    def apply(self, decay: float) -> None:
        """One update of the EMA, then the counters."""
        self.update(decay)
        self.counters()
