"""The (EMA, model) pairs a step is built over, matched by state_dict key, tied weights once. A step reads the
model through the *slots* (a module dict and a name) that hold what it uses now."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import getitem
from typing import TypeVar

from torch import Tensor, nn

__all__ = ["Slot", "Entry", "Pairs", "unique", "key_diff", "module_entries", "collect_pairs"]
__all__ += ["check_materialized"]

_T = TypeVar("_T")

Slot = tuple[dict, str]  # (the module dict that holds an entry, its name): what the entry is *now*


@dataclass(frozen=True)
class Entry:
    """One state_dict entry, matched across the EMAs and the model."""

    key: str
    emas: tuple[Tensor, ...]  # each EMA's tensor, the first EMA's first
    model: Tensor
    ema_slots: tuple[Slot, ...]  # where each EMA holds it
    model_slot: Slot  # where the model holds it


@dataclass(frozen=True)
class Pairs:
    """What a step is built over: the float entries (averaged), the counters (copied), the modules."""

    floats: list[Entry]
    counters: list[Entry]  # non-float entries (BatchNorm's num_batches_tracked): copied, not averaged
    modules: list[nn.Module]
    count: int  # how many EMAs
    sharded: bool = False  # ShardedModelEMA: the entries are DTensors, each step reads its local shard

    def ema_floats(self, k: int = 0) -> list[Tensor]:
        """EMA ``k``'s float tensors, in entry order."""
        return [e.emas[k] for e in self.floats]

    def model_floats(self) -> list[Tensor]:
        """The model's float tensors, in entry order."""
        return [e.model for e in self.floats]

    def slots(self) -> list[Slot]:
        """Every slot of every entry, the EMAs' and the model's."""
        return [s for e in (*self.floats, *self.counters) for s in (*e.ema_slots, e.model_slot)]


def unique(items: Iterable[_T], tensor: Callable[[_T], Tensor] = lambda t: t) -> list[_T]:
    """``items`` without repeats of the same tensor object (tied weights), first occurrence kept, in order."""
    first: dict[int, _T] = {}
    for item in items:
        first.setdefault(id(tensor(item)), item)
    return list(first.values())


def key_diff(a: Iterable[str], b: Iterable[str]) -> str:
    """How two sets of names differ, in one line: the first's missing in the second, the second's extra."""
    missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    return f"missing {missing[:5]}, extra {extra[:5]} ({len(missing)} and {len(extra)} in all)"


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


def check_materialized(entries: Iterable[tuple[str, Slot]]) -> None:
    """Refuse an uninitialized lazy entry in one line (torch's error, raised later, runs to many lines)."""
    if lazy := [key for key, slot in entries if nn.parameter.is_lazy(getitem(*slot))]:
        why = "run one forward pass with a batch before making or updating its EMA"
        raise ValueError(f"the model's {lazy[0]!r} is an uninitialized lazy parameter: {why}")


def collect_pairs(emas: Sequence[nn.Module], model: nn.Module) -> Pairs:
    """Match every parameter and persistent buffer of each EMA module with ``model``'s by key."""
    first = dict(module_entries(emas[0]))
    model_slots = dict(module_entries(model))
    check_materialized(model_slots.items())  # a model made anew, its first forward not run yet
    if first.keys() != model_slots.keys():
        raise ValueError(f"EMA and model do not hold the same entries: {key_diff(first, model_slots)}")
    others = [dict(module_entries(ema)) for ema in emas[1:]]
    for k, slots in enumerate(others, 2):
        if slots.keys() != first.keys():
            raise ValueError(f"EMA 1 and EMA {k} do not hold the same entries: {key_diff(first, slots)}")
    floats, counters = [], []
    for key, slot in unique(first.items(), lambda item: getitem(*item[1])):
        ema_slots = (slot, *(slots[key] for slots in others))
        tensors = tuple(getitem(*s) for s in ema_slots)
        entry = Entry(key, tensors, getitem(*model_slots[key]), ema_slots, model_slots[key])
        e, m = tensors[0], entry.model
        for k, other in enumerate(tensors[1:], 2):
            if other.shape != e.shape or other.is_floating_point() != e.is_floating_point():
                shapes = f"shape {tuple(other.shape)} {other.dtype}, EMA 1 shape {tuple(e.shape)} {e.dtype}"
                raise ValueError(f"entry {key!r}: EMA {k} holds {shapes}")
        if e.is_floating_point():
            floats.append(entry)
            continue
        if e.shape != m.shape or e.device != m.device or m.is_floating_point():
            mine, theirs = (f"shape {tuple(t.shape)} {t.dtype} on {t.device}" for t in (e, m))
            raise ValueError(f"entry {key!r}: EMA {mine} does not match model {theirs}")
        counters.append(entry)
    modules = unique(m for module in (model, *emas) for m in module.modules())
    return Pairs(floats, counters, modules, len(emas))
