"""What a cached EMA step is: built once per model layout, it says whether it is still current and applies.

:class:`ema_lab.list_step.ListStep` runs ``"loop"``, ``"foreach"`` and ``"gated"``;
:class:`ema_lab.flat_step.FlatStep` runs ``"flat"``, and :class:`ema_lab.graph_step.GraphStep` the flat
step recorded in a CUDA graph (``ModelEMA(cuda_graph=True)``). ``ModelEMA`` and ``ShardedModelEMA`` keep
one and rebuild it when :meth:`Step.current` says the model's or the EMA's tensors moved
(:mod:`ema_lab.watch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor, nn

__all__ = ["Step", "StepOptions", "CAT_MAX_NUMEL"]

#: Below this many elements a model tensor is gathered by one ``torch.cat`` (about a third of the
#: per-tensor cost of a foreach, plus one more pass over its elements); benchmarks/update_costs.py sweeps it.
CAT_MAX_NUMEL = 2048


@dataclass(frozen=True)
class StepOptions:
    """What an EMA builds its step with; each kind of step reads the fields it uses."""

    strategy: str  # "loop", "foreach", "gated" or "flat" ("auto" already resolved)
    cat_max_numel: int = CAT_MAX_NUMEL  # the flat step gathers smaller model tensors by torch.cat
    sharded: bool = False  # ShardedModelEMA: the step reads each DTensor's local shard


class Step(Protocol):
    """One EMA update over cached (EMA, model) pairs."""

    modes: list[str]  # how each flat group is updated ([] for a list step)
    tensor_decay: bool  # whether apply() takes a 0-dim tensor decay (no host sync)
    in_place: bool  # whether the EMA's tensors keep their storage

    def current(self, model: nn.Module) -> bool:
        """True while ``model`` and the EMA still hold the memory the step was built over."""
        ...

    def apply(self, decay: float | Tensor) -> None:
        """Move every EMA tensor one step towards the model's."""
        ...
