"""The entries of a model and its EMAs, matched once by state_dict key, tied weights once.

A step reads the model through the *slots* that hold its tensors (a module's ``_parameters`` or
``_buffers`` dict and a name): what a slot holds now is what the model uses now, which is how
:mod:`ema_lab.step` notices a replaced tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import getitem

from torch import nn

from .flat import unique
from .step import Entry, Pairs, Slot

__all__ = ["module_entries", "collect_pairs"]


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


def _mismatch(what: str, a: set[str], b: set[str]) -> ValueError:
    missing, extra = sorted(a - b), sorted(b - a)
    return ValueError(
        f"{what} do not hold the same entries: missing in the second {missing[:5]}, not in the first "
        f"{extra[:5]} ({len(missing)} and {len(extra)} in all)"
    )


def collect_pairs(emas: Sequence[nn.Module], model: nn.Module) -> Pairs:
    """Match every parameter and persistent buffer of each EMA module with ``model``'s by key (else a clear
    error); the EMAs after the first must hold tensors shaped like the first's."""
    first = dict(module_entries(emas[0]))
    model_slots = dict(module_entries(model))
    if first.keys() != model_slots.keys():
        raise _mismatch("EMA and model", set(first), set(model_slots))
    others = [dict(module_entries(ema)) for ema in emas[1:]]
    for k, slots in enumerate(others, 2):
        if slots.keys() != first.keys():
            raise _mismatch(f"EMA 1 and EMA {k}", set(first), set(slots))
    floats, counters = [], []
    for key, slot in unique(first.items(), lambda item: getitem(*item[1])):
        ema_slots = (slot, *(slots[key] for slots in others))
        tensors = tuple(getitem(*s) for s in ema_slots)
        entry = Entry(key, tensors, getitem(*model_slots[key]), ema_slots, model_slots[key])
        e, m = tensors[0], entry.model
        for k, other in enumerate(tensors[1:], 2):
            if other.shape != e.shape or other.is_floating_point() != e.is_floating_point():
                raise ValueError(
                    f"entry {key!r}: EMA {k} holds shape {tuple(other.shape)} {other.dtype}, "
                    f"EMA 1 shape {tuple(e.shape)} {e.dtype}"
                )
        if e.is_floating_point():
            floats.append(entry)
            continue
        if e.shape != m.shape or e.device != m.device or m.is_floating_point():
            raise ValueError(
                f"entry {key!r}: EMA shape {tuple(e.shape)} {e.dtype} on {e.device} does not match "
                f"model shape {tuple(m.shape)} {m.dtype} on {m.device}"
            )
        counters.append(entry)
    modules = unique(m for module in (model, *emas) for m in module.modules())
    return Pairs(floats, counters, modules, len(emas))
