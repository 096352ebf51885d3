"""What every cached EMA step is (:class:`Step`), its options, and the parts every kind of step shares."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import getitem, is_
from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn

from .buffers import group, into_one_buffer, tiles_in_order, whole_storage
from .pairs import Pairs, Slot
from .ranks import local_tensor

__all__ = ["Step", "StepOptions", "Watch", "install_hooks", "lerp_pairs", "Counters"]


@dataclass(frozen=True)
class StepOptions:
    """What an EMA builds its step with; each kind of step reads the fields it uses."""

    strategy: str  # "loop", "foreach", "gated" or "flat" ("auto" already resolved)
    cat_max_numel: int  # the flat step gathers smaller model tensors by torch.cat


class Step(Protocol):
    """A cached update of one model's EMAs: ``ready(model)`` (False: rebuild it), then ``apply(decays,
    weights)``."""

    tensor_decay: ClassVar[bool]  # apply() takes 0-dim tensor decays (no host sync)
    in_place: ClassVar[bool]  # the EMAs' tensors keep their storage (ShardedModelEMA needs it)
    recordable: ClassVar[bool]  # cuda_graph=True can record it (graph_step.py)
    modes: list[str]  # what each group of tensors runs (ModelEMA.modes)

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None: ...

    def ready(self, model: nn.Module) -> bool:
        """True while the step still fits ``model`` and the EMAs (it may read the model here)."""

    def apply(self, decays: Sequence[float | Tensor], weights: Sequence[float | Tensor]) -> None:
        """``e += weight * (m - e)`` for every EMA, then the counters."""


def lerp_pairs(
    ema: list[Tensor], model: list[Tensor], weight: float | Tensor | list[Tensor], foreach: bool = True
) -> None:
    """``e += weight * (m - e)`` per pair: one ``_foreach_lerp_`` (``weight`` may be a list), or a ``lerp_``
    each."""
    if not foreach:
        for e, m in zip(ema, model):
            e.lerp_(m, weight)
    elif ema:  # _foreach_lerp_([], [], w) raises "Tensor list must have at least one tensor"
        # torch has no single-tensor-weight overload (to 2.13 at least): a 0-dim weight goes once per pair.
        torch._foreach_lerp_(ema, model, weight if isinstance(weight, (float, list)) else [weight] * len(ema))


_ABSENT = object()  # a name a module's table does not hold (registering None under it is a change)

# Each watched module -> the watches that listen to it; weak both ways: a watch lives as long as its step.
_listeners: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Watch]] = weakref.WeakKeyDictionary()
_hooks: list = []


def _count_registrations(table: str) -> Callable[[nn.Module, str, object], None]:
    def hook(module: nn.Module, name: str, value: object) -> None:
        # One lookup for a module no EMA watches (a loss, a metric); one with __eq__ but no __hash__ is none.
        watches = _listeners.get(module) if type(module).__hash__ else None
        if not watches:
            return
        # No replacement: the same object re-registered (``self.step += 1`` on a buffer, as AveragedModel and
        # ema-pytorch do), or a non-persistent buffer a forward reassigns (a rotary or mask cache, unread).
        same = module.__dict__.get(table, {}).get(name, _ABSENT) is value
        if same or (table == "_buffers" and name in module.__dict__.get("_non_persistent_buffers_set", ())):
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


#: Containers whose own methods (``insert``, ``pop``, ``del``) edit ``_modules`` with no registration hook.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class Watch:
    """Whether ``model`` is the one a step was built for, nothing was registered on ``modules`` since, no
    submodule was inserted or deleted, and each slot holds its memory (``data_ptr()``: torch has no hook for
    ``p.data = x`` or ``swap_tensors``)."""

    def __init__(
        self, model: nn.Module, slots: list[Slot], modules: Iterable[nn.Module] = (), sharded: bool = False
    ) -> None:
        install_hooks()  # an EMA unpickled in a new process builds its watch before any constructor ran
        self.model_ref = weakref.ref(model, partial(_release, weakref.ref(self)))  # no cycle: freed at once
        self.registered = False  # set by the hooks on a registration on one of ``modules``
        modules = list(modules)
        for module in modules:
            _listeners.setdefault(module, weakref.WeakSet()).add(self)
        # Their children tables: ``del parent.child`` and the containers' edits change only a table's size,
        # but a container's ``pop`` or ``del`` then gives it a new table (an insert and a pop: the same size).
        parents = [m for m in modules if m._modules or isinstance(m, _CONTAINERS)]
        self.tables = [m._modules for m in parents]
        self.sizes = list(map(len, self.tables))
        self.containers = [vars(m) for m in parents if isinstance(m, _CONTAINERS)]
        self.container_tables = [c["_modules"] for c in self.containers]
        self.dicts, self.keys = (tuple(x) for x in zip(*slots)) if slots else ((), ())
        self.sharded = sharded  # ShardedModelEMA: watch each DTensor's local shard
        self.ptrs = self.data_ptrs()

    def release(self) -> None:
        """Drop what the watch holds of the modules (the model died: it can never be current again)."""
        self.tables, self.containers, self.container_tables, self.dicts, self.keys = [], [], [], (), ()

    def data_ptrs(self) -> list[int]:
        """``data_ptr()`` of the tensor each slot holds now; map() keeps the loop in C."""
        tensors = map(getitem, self.dicts, self.keys)
        return list(map(Tensor.data_ptr, map(local_tensor, tensors) if self.sharded else tensors))

    def current(self, model: nn.Module) -> bool:
        """True while nothing was registered on or deleted from a watched module and every slot holds its
        memory."""
        if self.registered or self.model_ref() is not model or list(map(len, self.tables)) != self.sizes:
            return False
        if not all(map(is_, map(getitem, self.containers, repeat("_modules")), self.container_tables)):
            return False
        try:
            return self.data_ptrs() == self.ptrs
        except (KeyError, AttributeError, TypeError):  # an entry was deleted or set to None
            return False


def _release(watch_ref: weakref.ref, _: object) -> None:
    if (watch := watch_ref()) is not None:
        watch.release()


class Counters:
    """The non-float entries, copied: one ``torch.cat`` or ``copy_`` per group, strided ones by a foreach."""

    def __init__(self, pairs: Pairs) -> None:
        ema = [e.emas[k] for k in range(pairs.count) for e in pairs.counters]
        model = [e.model for e in pairs.counters] * pairs.count
        self.copies: list[tuple[Tensor, list[Tensor]]] = []  # (EMA buffer, 1-D model aliases or the storage)
        flat = [i for i, m in enumerate(model) if m.is_contiguous() and ema[i].is_contiguous()]  # one order
        strided = sorted(set(range(len(model))) - set(flat))
        self.strided = ([ema[i] for i in strided], [model[i].detach() for i in strided])
        for idx in group(flat, lambda i: (ema[i].device, ema[i].dtype, model[i].dtype)):
            aliases = [model[i].detach().view(-1) for i in idx]
            buf = into_one_buffer([ema[i] for i in idx])
            self.copies.append((buf, [whole_storage(aliases[0])] if tiles_in_order(aliases) else aliases))

    def __call__(self) -> None:
        """Copy the model's counters into the EMAs'."""
        for buf, src in self.copies:
            if len(src) == 1:
                buf.copy_(src[0])
            else:
                torch.cat(src, out=buf)
        if self.strided[0]:
            torch._foreach_copy_(*self.strided)
