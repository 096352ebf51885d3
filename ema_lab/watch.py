"""Is a cached step still current? The staleness watch over the slots a step reads.

A step reads the model through detached aliases (same memory, no autograd, no reference that would make
``swap_tensors`` refuse). Before each update :class:`Watch` compares the ``data_ptr()`` each module slot
holds now with the one it was built from, plus a counter bumped by torch's global registration hooks
(:func:`install_hooks`, on the first EMA made, never at import): ``.to()``, ``.half()``, a reassigned
parameter, ``p.data = ...`` and ``torch.utils.swap_tensors`` all show up as a moved pointer or a new
registration, and the step is rebuilt. A tensor re-viewed in place (``p.data = p.view(shape)``, same
memory) is averaged as that memory in the EMA's shape: the aliases keep theirs, so no foreach stops halfway.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from operator import getitem

from torch import Tensor, nn

from .pairs import Slot, local_tensor

__all__ = ["Watch", "install_hooks"]

_generation = 0  # bumped by torch's registration hooks on every new or replaced module entry
_hooks: list = []


def _count_registrations(table: str) -> Callable[[nn.Module, str, object], None]:
    def hook(module: nn.Module, name: str, value: object) -> None:
        global _generation
        # ``self.step += 1`` on a buffer re-registers the same object (AveragedModel and ema-pytorch do it
        # every update): not a replacement, so it must not make every cache in the process rebuild.
        if module.__dict__.get(table, {}).get(name) is not value:
            _generation += 1

    return hook


def install_hooks() -> None:
    """Register torch's global parameter/buffer/module registration hooks, once per process."""
    if _hooks:
        return
    for name, table in (
        ("register_module_parameter_registration_hook", "_parameters"),
        ("register_module_buffer_registration_hook", "_buffers"),
        ("register_module_module_registration_hook", "_modules"),
    ):
        _hooks.append(getattr(nn.modules.module, name)(_count_registrations(table)))


class Watch:
    """Whether ``model`` is still the one a step was built for and its slots hold the same memory."""

    def __init__(self, model: nn.Module, slots: list[Slot], sharded: bool = False):
        self.model_ref = weakref.ref(model)
        self.generation = _generation
        self.dicts, self.keys = (tuple(x) for x in zip(*slots)) if slots else ((), ())
        self.sharded = sharded  # ShardedModelEMA: watch each DTensor's local shard
        self.ptrs = self.data_ptrs()

    def data_ptrs(self) -> list[int]:
        """``data_ptr()`` of the tensor each slot holds now; map() keeps the loop in C."""
        tensors = map(getitem, self.dicts, self.keys)
        return list(map(Tensor.data_ptr, map(local_tensor, tensors) if self.sharded else tensors))

    def current(self, model: nn.Module) -> bool:
        """True while no registration happened anywhere and every slot holds the memory it was built from."""
        if self.generation != _generation or self.model_ref() is not model:
            return False
        try:
            return self.data_ptrs() == self.ptrs
        except (KeyError, AttributeError, TypeError):  # an entry was deleted or set to None
            return False
