"""The (EMA, model) tensor pairs of two modules, matched once by state_dict key, tied weights once.

A step reads the model through the *slots* that hold its tensors (a module's ``_parameters`` or
``_buffers`` dict and a name): what a slot holds now is what the model uses now, which is how
:mod:`ema_lab.step` notices a replaced tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import getitem
from typing import TypeVar

from torch import Tensor, nn

__all__ = ["Slot", "Pairs", "module_entries", "collect_pairs", "unique", "local_tensor"]

_T = TypeVar("_T")
Slot = tuple[dict, str]  # (the module dict that holds an entry, its name): what the entry is *now*


def unique(items: Iterable[_T], tensor: Callable[[_T], Tensor] = lambda t: t) -> list[_T]:
    """``items`` without repeats of the same tensor object (tied weights), first occurrence kept, in order."""
    first: dict[int, _T] = {}
    for item in items:
        first.setdefault(id(tensor(item)), item)
    return list(first.values())


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (no copy), else ``t`` itself."""
    # What to_local() returns without grad, minus a dispatched view: the per-step check reads it too.
    return getattr(t, "_local_tensor", t)


def module_entries(module: nn.Module) -> Iterator[tuple[str, Slot]]:
    """Yield (state_dict key, slot) for every parameter and persistent buffer."""
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, t in mod._parameters.items():
            if t is not None:
                yield dot + name, (mod._parameters, name)
        skip = mod._non_persistent_buffers_set
        for name, t in mod._buffers.items():
            if t is not None and name not in skip:
                yield dot + name, (mod._buffers, name)


@dataclass
class Pairs:
    """Matched entries of an EMA module and a model by state_dict key, tied weights once."""

    names: list[str]  # keys of the floating-point pairs
    ema: list[Tensor]
    model: list[Tensor]
    ema_counters: list[Tensor]  # non-float entries (BatchNorm's num_batches_tracked): copied, not averaged
    model_counters: list[Tensor]
    ema_slots: list[Slot]  # floats, then counters
    model_slots: list[Slot]  # floats, then counters


def collect_pairs(ema: nn.Module, model: nn.Module) -> Pairs:
    """Match every parameter and persistent buffer of ``ema`` with ``model``'s by key (else a clear error)."""
    ema_slots, model_slots = dict(module_entries(ema)), dict(module_entries(model))
    if ema_slots.keys() != model_slots.keys():
        missing = sorted(ema_slots.keys() - model_slots.keys())
        extra = sorted(model_slots.keys() - ema_slots.keys())
        raise ValueError(
            f"EMA and model do not hold the same entries: missing in model {missing[:5]}, "
            f"not in EMA {extra[:5]} ({len(missing)} and {len(extra)} in all)"
        )
    rows = [
        (key, getitem(*slot), getitem(*model_slots[key]), slot, model_slots[key])
        for key, slot in unique(ema_slots.items(), lambda item: getitem(*item[1]))
    ]
    floats = [r for r in rows if r[1].is_floating_point()]
    counters = [r for r in rows if not r[1].is_floating_point()]
    for key, e, m, _, _ in counters:
        if e.shape != m.shape or e.device != m.device or m.is_floating_point():
            raise ValueError(
                f"entry {key!r}: EMA shape {tuple(e.shape)} {e.dtype} on {e.device} does not match "
                f"model shape {tuple(m.shape)} {m.dtype} on {m.device}"
            )
    f, c = (list(zip(*x)) or [()] * 5 for x in (floats, counters))
    return Pairs([*f[0]], [*f[1]], [*f[2]], [*c[1]], [*c[2]], [*f[3], *c[3]], [*f[4], *c[4]])
