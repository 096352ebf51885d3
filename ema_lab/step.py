"""What every cached EMA step is (:class:`Step`), its options, and what every kind of step shares: the watch
(which the EMA's own parameters and module dicts tell of a move), the lerp, the counters."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import getitem
from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn

from .buffers import group, into_one_buffer, tiles_in_order, whole_storage
from .pairs import Pairs, Slot
from .ranks import local_tensor

__all__ = ["Step", "StepOptions", "Watch", "install_hooks", "guard_dicts", "lerp_pairs", "Counters"]


@dataclass(frozen=True)
class StepOptions:
    """What an EMA builds its step with; each kind of step reads the fields it uses."""

    strategy: str  # "loop", "foreach", "gated" or "flat" ("auto" already resolved)
    cat_max_numel: int  # the flat step gathers smaller model tensors by torch.cat


class Step(Protocol):
    """A cached update of one model's EMAs: ``ready(model)`` (False: rebuild it), then ``apply``."""

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
    """``e += weight * (m - e)`` per pair: one ``_foreach_lerp_`` (``weight``: may be a list) or lerps."""
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
        # One lookup for a module no EMA watches (a loss, a metric); one with __eq__ but no __hash__ is none.
        watches = _listeners.get(module) if type(module).__hash__ else None
        if not watches:
            return
        # No replacement: the same object re-registered (``self.step += 1`` on a buffer, as AveragedModel and
        # ema-pytorch do), or a non-persistent buffer a forward reassigns (a rotary or mask cache, unread).
        same = module.__dict__.get(table, {}).get(name) is value
        if same or (table == "_buffers" and name in module.__dict__.get("_non_persistent_buffers_set", ())):
            return
        for watch in watches:
            watch.moved = True

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


class _Dict(dict):
    """An EMA module's ``_parameters`` or ``_buffers``: a change of an entry moves the module's watches."""

    __slots__ = ("watches",)

    def _moved(self) -> None:
        for watch in self.watches:
            watch.moved = True

    def __reduce_ex__(self, protocol: object) -> tuple:
        return dict, (dict(self),)  # copies and pickles hold a plain dict


def guard_dicts(emas: Iterable[nn.Module]) -> None:
    """Make the parameter and buffer dicts of the ``emas``' modules ``_Dict``s (but an unhashable one's)."""
    for module in (m for ema in emas for m in ema.modules() if type(m).__hash__):
        for table in ("_parameters", "_buffers"):
            if type(entries := module.__dict__[table]) in (dict, _Dict):  # not torch 2.1's OrderedDicts
                entries = module.__dict__[table] = _Dict(entries) if type(entries) is dict else entries
                entries.watches = _listeners.setdefault(module, weakref.WeakSet())


class _Parameter(nn.Parameter):
    """An EMA's parameter: ``.data =``, a swap (it sets ``__class__``) and the methods that change its storage
    move the watch that its step's own subclass names; deepcopy, pickle and repr see a plain Parameter."""

    __slots__ = ()

    def _moved(self) -> None:
        if (watch := type(self).watch()) is not None:  # a weakref.ref[Watch]
            watch.moved = True

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("data", "__class__"):
            self._moved()
        super().__setattr__(name, value)


def _moving(method: Callable) -> Callable:
    def moving(self: _Dict | _Parameter, *args: object, **kwargs: object) -> object:
        self._moved()
        return method(self, *args, **kwargs)

    return moving


def _as_parameter(method: Callable) -> Callable:
    def plain(self: _Parameter, *args: object) -> object:
        cls = type(self)
        object.__setattr__(self, "__class__", nn.Parameter)  # not through __setattr__: nothing moved
        try:
            return method(self, *args)
        finally:
            object.__setattr__(self, "__class__", cls)

    return plain


for _name in ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update", "setdefault"):
    setattr(_Dict, _name, _moving(getattr(dict, _name)))
for _name in ("set_", "resize_", "resize_as_", "as_strided_", "share_memory_"):
    setattr(_Parameter, _name, _moving(getattr(nn.Parameter, _name)))
for _name in ("__deepcopy__", "__reduce_ex__", "__repr__"):
    setattr(_Parameter, _name, _as_parameter(getattr(nn.Parameter, _name)))


class Watch:
    """Whether ``model`` is the one a step was built for, nothing was registered on ``modules`` or moved in
    the EMA's ``guarded`` slots since, and each tensor read per update holds its memory (``data_ptr()``)."""

    def __init__(
        self,
        model: nn.Module,
        slots: list[Slot],
        modules: Iterable[nn.Module] = (),
        sharded: bool = False,
        guarded: Iterable[Slot] = (),
    ) -> None:
        install_hooks()  # an EMA unpickled in a new process builds its watch before any constructor ran
        self.model_ref = weakref.ref(model)
        self.moved = False  # set by the hooks, the EMA's dicts and its parameters
        for module in modules:
            _listeners.setdefault(module, weakref.WeakSet()).add(self)
        self.held: list[Tensor] = []  # tensors of a _Dict: read without the dict, which tells of a change
        slots = [*slots, *self.guard(guarded)]
        self.dicts, self.keys = (tuple(x) for x in zip(*slots)) if slots else ((), ())
        self.sharded = sharded  # ShardedModelEMA: watch each DTensor's local shard
        self.ptrs = self.data_ptrs()

    def guard(self, slots: Iterable[Slot]) -> list[Slot]:
        """Give each EMA parameter in a ``_Dict`` a type that moves this watch, hold its buffers (compiling
        takes no other subclass as a plain tensor); return the slots of other dicts."""
        guarded = type("Parameter", (_Parameter,), {"watch": weakref.ref(self), "__slots__": ()})
        left = []
        for entries, key in slots:
            t = entries[key]
            if type(entries) is not _Dict:
                left.append((entries, key))
            elif type(t) is nn.Parameter or isinstance(t, _Parameter):  # a user's subclass keeps its type
                object.__setattr__(t, "__class__", guarded)  # not through __setattr__: nothing moved
            else:
                self.held.append(t)
        return left

    def data_ptrs(self) -> list[int]:
        """``data_ptr()`` of each held tensor and of the one in each slot now; map() keeps the loop in C."""
        tensors = chain(self.held, map(getitem, self.dicts, self.keys))
        return list(map(Tensor.data_ptr, map(local_tensor, tensors) if self.sharded else tensors))

    def current(self, model: nn.Module) -> bool:
        """True while nothing moved and every slot read per update holds its memory."""
        if self.moved or self.model_ref() is not model:
            return False
        try:
            return self.data_ptrs() == self.ptrs
        except (KeyError, AttributeError, TypeError):  # an entry was deleted or set to None
            return False


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
