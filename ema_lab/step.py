"""What a cached EMA step is, and how it knows it went stale.

A step is built once per model layout: :class:`ema_lab.updates.ListStep` runs ``"loop"``, ``"foreach"`` and
``"gated"``; :class:`ema_lab.flat_step.FlatStep` runs ``"flat"``, and :class:`ema_lab.graph_step.GraphStep`
the flat step recorded in a CUDA graph (``ModelEMA(cuda_graph=True)``). ``ModelEMA`` and ``ShardedModelEMA``
keep one and rebuild it when :meth:`Step.intact` says the model's or the EMA's tensors moved.

A step reads the model through detached aliases (same memory, no autograd, no reference that would make
``swap_tensors`` refuse). Before each update :class:`Watch` compares the ``data_ptr()`` each watched module
slot holds now with the one it was built from (the flat step watches its own buffers by reference count
and reads its small 1-D tensors live instead), plus a counter bumped by torch's global registration hooks
(:func:`install_hooks`, when the first watch is made, never at import): ``.to()``, ``.half()``, a reassigned
parameter, ``p.data = ...`` and ``torch.utils.swap_tensors`` all show up as a moved pointer or a new
registration, and the step is rebuilt. A tensor re-viewed in place (``p.data = p.view(shape)``, same
memory) is averaged as that memory in the EMA's shape: the aliases keep theirs, so no foreach stops halfway.
Every step also copies the model's integer entries (:class:`Counters`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from operator import getitem
from typing import Protocol

import torch
from torch import Tensor, nn

from .flat import group, into_one_buffer, tiles_in_order, whole_storage
from .pairs import Pairs, Slot, local_tensor

__all__ = ["Step", "StepOptions", "CAT_MAX_NUMEL", "Watch", "Counters", "install_hooks"]

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
    """One EMA update over cached (EMA, model) pairs; the class says what it can do."""

    tensor_decay: bool  # whether apply() takes a 0-dim tensor decay (no host sync)
    in_place: bool  # whether the EMA's tensors keep their storage (ShardedModelEMA's DTensors need it)
    recordable: bool  # whether ``cuda_graph=True`` can record it (no live reads, fixed addresses)
    modes: list[str]  # how each flat group is updated ([] for a list step)

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None: ...

    def intact(self, model: nn.Module) -> bool:
        """True while ``model`` and the EMA still hold the memory the step was built over (no tensor read)."""
        ...

    def read(self) -> bool:
        """Gather what the update reads from the model; False if a slot read live no longer fits."""
        ...

    def apply(self, decay: float | Tensor) -> None:
        """Move every EMA tensor one step towards what :meth:`read` gathered, then copy the counters."""
        ...


_generation = 0  # bumped by torch's registration hooks on every new or replaced module entry
_hooks: list = []


def _count_registrations(table: str) -> Callable[[nn.Module, str, object], None]:
    def hook(module: nn.Module, name: str, value: object) -> None:
        global _generation
        # ``self.step += 1`` on a buffer re-registers the same object (AveragedModel and ema-pytorch do it
        # every update): not a replacement, so it must not make every cache in the process rebuild; nor
        # does a non-persistent buffer reassigned by a forward (a rotary or mask cache): no EMA reads it.
        if module.__dict__.get(table, {}).get(name) is value:
            return
        if table == "_buffers" and name in module.__dict__.get("_non_persistent_buffers_set", ()):
            return
        _generation += 1

    return hook


def generation() -> int:
    """How many module entries were registered or replaced anywhere since the hooks were installed."""
    return _generation


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
        install_hooks()  # an EMA unpickled in a new process builds its watch before any constructor ran
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


class Counters:
    """The non-float entries, copied from the model: the EMA's of each (device, dtype) pair of dtypes are
    views of one buffer, filled by one ``torch.cat`` of the model's (one ``copy_`` where the model's tile
    one storage in the same order, as after ``flatten_model``); a strided counter by ``_foreach_copy_``."""

    def __init__(self, ema: list[Tensor], model: list[Tensor]) -> None:
        self.copies: list[tuple[Tensor, list[Tensor]]] = []  # (EMA buffer, 1-D model aliases or the storage)
        strided = [i for i, m in enumerate(model) if not m.is_contiguous()]
        self.strided = ([ema[i] for i in strided], [model[i].detach() for i in strided])
        flat = [i for i, m in enumerate(model) if m.is_contiguous()]
        for idx in group(flat, lambda i: (ema[i].device, ema[i].dtype, model[i].dtype)):
            aliases = [model[i].detach().view(-1) for i in idx]
            buf = into_one_buffer([ema[i] for i in idx])
            self.copies.append((buf, [whole_storage(aliases[0])] if tiles_in_order(aliases) else aliases))

    def __call__(self) -> None:
        """Copy the model's counters into the EMA's."""
        for buf, src in self.copies:
            if len(src) == 1:
                buf.copy_(src[0])
            else:
                torch.cat(src, out=buf)
        if self.strided[0]:
            torch._foreach_copy_(*self.strided)
