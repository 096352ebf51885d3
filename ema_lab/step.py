"""What a cached EMA step is built from, how it knows it went stale, and the pieces both kinds of step use.

A step is built once per model layout: :class:`ema_lab.updates.ListStep` runs ``"loop"``, ``"foreach"`` and
``"gated"``; :class:`ema_lab.flat_step.FlatStep` runs ``"flat"``, and :class:`ema_lab.graph_step.GraphStep`
the flat step recorded in a CUDA graph (``ModelEMA(cuda_graph=True)``). One step moves one or more EMAs of
one model (``PostHocEMA`` keeps several), each with its own weight, from one read of the model. ``ModelEMA``
and ``ShardedModelEMA`` keep one step and rebuild it when :meth:`Step.intact` says a tensor moved.

A step reads the model through detached aliases (same memory, no autograd, no reference that would make
``swap_tensors`` refuse). Before each update :class:`Watch` compares the ``data_ptr()`` each watched module
slot holds now with the one it was built from (the flat step reads its small 1-D model tensors live
instead; a buffer's reference count would not do: a view kept elsewhere hides a replaced tensor), and
whether torch's global registration hooks (:func:`install_hooks`, when the first watch is made, never at
import) saw a parameter, buffer or submodule registered on one of the modules it watches (the model's and
the EMAs'; a module built anywhere else costs nothing): ``.to()``, ``.half()``, a reassigned parameter,
``p.data = ...`` and ``torch.utils.swap_tensors`` all show up as a moved pointer or a new registration,
and the step is rebuilt. A tensor re-viewed in place (``p.data = p.view(shape)``, same memory) is averaged
as that memory in the EMA's shape: the aliases keep theirs, so no foreach stops halfway. Every step also
copies the model's integer entries (:class:`Counters`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import getitem
from typing import Protocol

import torch
from torch import Tensor, nn

from .flat import group, into_one_buffer, tiles_in_order, whole_storage

__all__ = ["Step", "StepOptions", "CAT_MAX_NUMEL", "Slot", "Entry", "Pairs", "Watch", "Counters"]
__all__ += ["install_hooks", "lerp_pairs", "local_tensor"]

#: Below this many elements a model tensor is gathered by one ``torch.cat`` (about a third of the
#: per-tensor cost of a foreach, plus one more pass over its elements); benchmarks/update_costs.py sweeps it.
CAT_MAX_NUMEL = 2048

Slot = tuple[dict, str]  # (the module dict that holds an entry, its name): what the entry is *now*


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (no copy), else ``t`` itself."""
    # What to_local() returns without grad, minus a dispatched view: the per-step check reads it too.
    return getattr(t, "_local_tensor", t)


@dataclass(frozen=True)
class Entry:
    """One state_dict entry, matched across the EMAs and the model (:func:`ema_lab.pairs.collect_pairs`)."""

    key: str
    emas: tuple[Tensor, ...]  # each EMA's tensor, the first EMA's first
    model: Tensor
    ema_slots: tuple[Slot, ...]  # where each EMA holds it
    model_slot: Slot  # where the model holds it


@dataclass(frozen=True)
class Pairs:
    """What a step is built over: the float entries (averaged), the counters (copied), and every module
    of the model and the EMAs (whose registrations the step's watch listens to)."""

    floats: list[Entry]
    counters: list[Entry]  # non-float entries (BatchNorm's num_batches_tracked): copied, not averaged
    modules: list[nn.Module]
    count: int  # how many EMAs

    def ema_floats(self, k: int = 0) -> list[Tensor]:
        """EMA ``k``'s float tensors, in entry order."""
        return [e.emas[k] for e in self.floats]

    def model_floats(self) -> list[Tensor]:
        """The model's float tensors, in entry order."""
        return [e.model for e in self.floats]

    def slots(self) -> list[Slot]:
        """Every slot of every entry, the EMAs' and the model's."""
        return [s for e in (*self.floats, *self.counters) for s in (*e.ema_slots, e.model_slot)]


@dataclass(frozen=True)
class StepOptions:
    """What an EMA builds its step with; each kind of step reads the fields it uses."""

    strategy: str  # "loop", "foreach", "gated" or "flat" ("auto" already resolved)
    cat_max_numel: int = CAT_MAX_NUMEL  # the flat step gathers smaller model tensors by torch.cat
    sharded: bool = False  # ShardedModelEMA: the step reads each DTensor's local shard


class Step(Protocol):
    """One update of every EMA over cached (EMA, model) pairs; the class says what it can do."""

    tensor_decay: bool  # whether apply() takes 0-dim tensor decays (no host sync)
    in_place: bool  # whether the EMA's tensors keep their storage (ShardedModelEMA's DTensors need it)
    recordable: bool  # whether ``cuda_graph=True`` can record it (no live reads, fixed addresses)
    modes: list[str]  # how each flat group is updated ([] for a list step)

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None: ...

    def intact(self, model: nn.Module) -> bool:
        """True while ``model`` and the EMAs hold the memory the step was built over (no tensor read)."""
        ...

    def try_gather(self) -> bool:
        """Gather what the update reads from the model; False if a slot read live no longer fits."""
        ...

    def apply(self, decays: Sequence[float | Tensor], weights: Sequence[float | Tensor]) -> None:
        """Move each EMA by its ``decay`` (lerp ``weight = 1 - decay``) towards what was gathered, then copy
        the counters."""
        ...


def lerp_pairs(
    ema: list[Tensor], model: list[Tensor], weight: float | Tensor | list[Tensor], foreach: bool = True
) -> None:
    """``e += weight * (m - e)`` for every pair: one ``torch._foreach_lerp_``, or one ``lerp_`` per pair.

    ``weight``: a number, a 0-dim tensor, or (foreach only) one tensor shaped like each pair's."""
    if not foreach:
        for e, m in zip(ema, model):
            e.lerp_(m, weight)
    elif ema:  # _foreach_lerp_([], [], w) raises "Tensor list must have at least one tensor"
        # torch has no single-tensor-weight overload (to 2.13 at least): a 0-dim weight goes once per pair.
        torch._foreach_lerp_(ema, model, weight if isinstance(weight, (float, list)) else [weight] * len(ema))


# Each watched module -> the watches that listen to it; weak both ways: a watch lives as long as its step.
_listeners: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Watch]] = weakref.WeakKeyDictionary()
_hooks: list = []


def _count_registrations(table: str) -> Callable[[nn.Module, str, object], None]:
    def hook(module: nn.Module, name: str, value: object) -> None:
        # One dict lookup for a module no EMA watches (a loss, a metric, another model): nothing to do.
        watches = _listeners.get(module)
        if not watches:
            return
        # ``self.step += 1`` on a buffer re-registers the same object (AveragedModel and ema-pytorch do it
        # every update): not a replacement; nor is a non-persistent buffer reassigned by a forward (a rotary
        # or mask cache): no EMA reads it.
        if module.__dict__.get(table, {}).get(name) is value:
            return
        if table == "_buffers" and name in module.__dict__.get("_non_persistent_buffers_set", ()):
            return
        for watch in watches:
            watch.registered = True

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
    """Whether ``model`` is still the one a step was built for, no entry was registered on ``modules``
    since, and its slots hold the same memory."""

    def __init__(
        self, model: nn.Module, slots: list[Slot], modules: Iterable[nn.Module] = (), sharded: bool = False
    ) -> None:
        install_hooks()  # an EMA unpickled in a new process builds its watch before any constructor ran
        self.model_ref = weakref.ref(model)
        self.registered = False  # set by the hooks on a registration on one of ``modules``
        for module in modules:
            _listeners.setdefault(module, weakref.WeakSet()).add(self)
        self.dicts, self.keys = (tuple(x) for x in zip(*slots)) if slots else ((), ())
        self.sharded = sharded  # ShardedModelEMA: watch each DTensor's local shard
        self.ptrs = self.data_ptrs()

    def data_ptrs(self) -> list[int]:
        """``data_ptr()`` of the tensor each slot holds now; map() keeps the loop in C."""
        tensors = map(getitem, self.dicts, self.keys)
        return list(map(Tensor.data_ptr, map(local_tensor, tensors) if self.sharded else tensors))

    def current(self, model: nn.Module) -> bool:
        """True while nothing was registered on a watched module and every slot holds its memory."""
        if self.registered or self.model_ref() is not model:
            return False
        try:
            return self.data_ptrs() == self.ptrs
        except (KeyError, AttributeError, TypeError):  # an entry was deleted or set to None
            return False


class Counters:
    """The non-float entries, copied from the model: the EMAs' of each (device, dtype) pair of dtypes are
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

    @classmethod
    def of(cls, pairs: Pairs) -> Counters:
        """The counters of every EMA in ``pairs`` (each EMA's copied from the same model entries)."""
        entries = pairs.counters
        return cls(
            [e.emas[k] for k in range(pairs.count) for e in entries], [e.model for e in entries] * pairs.count
        )

    def __call__(self) -> None:
        """Copy the model's counters into the EMAs'."""
        for buf, src in self.copies:
            if len(src) == 1:
                buf.copy_(src[0])
            else:
                torch.cat(src, out=buf)
        if self.strided[0]:
            torch._foreach_copy_(*self.strided)
