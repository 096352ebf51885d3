"""The (EMA, model) tensor pairs of two modules, collected once, and the check that says they went stale.

Walking ``state_dict()`` twice per step is most of the seed's cost on CPU, so ``ModelEMA``
collects the pairs once. Such a cache is only safe if it notices when the modules stop using the
cached memory: ``model.to()``, ``.half()`` or ``.double()`` give parameters new storage (and buffers
new tensor objects), assigning a parameter swaps the object, and an optimizer or framework may
re-register tensors. ultralytics' cached lists miss exactly this and silently average dead memory.

The check is cheap and complete for memory: it reads ``data_ptr()`` of the tensor each module
slot holds *now* and compares it with the one cached, plus a process-wide counter bumped by
torch's global parameter/buffer/module registration hooks (new or reassigned entries). Those hooks
are registered by :func:`install_hooks` on first use (the first EMA made), once per process, never
at import. With the flat strategies ``ModelEMA`` skips the ``data_ptr()`` of the slots it reads live
(:class:`ema_lab.flat.FlatStep`): what those hold now is what the update reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter, getitem

import torch
from torch import Tensor, nn

__all__ = ["ModulePairs", "install_hooks"]

_generation = 0


def _bumper(table: str) -> Callable[[nn.Module, str, object], None]:
    def bump(module: nn.Module, name: str, value: object) -> None:
        global _generation
        # ``self.step += 1`` on a buffer re-registers the same object (AveragedModel and ema-pytorch do it
        # every update): not a replacement, so it must not make every cache in the process rebuild.
        if module.__dict__.get(table, {}).get(name) is not value:
            _generation += 1

    return bump


#: Handles of the global registration hooks, once :func:`install_hooks` ran (kept so they can be removed).
_hook_handles: list = []


def install_hooks() -> None:
    """Register torch's global parameter/buffer/module registration hooks once per process.

    Called when the first ``ModelEMA``/``ShardedModelEMA`` is made (and by :meth:`ModulePairs.collect`),
    not at import: importing ema_lab changes nothing in torch. The hooks bump a process-wide counter on
    any registration of a new object anywhere, which invalidates every cache; a rebuild is rare and
    cheap next to a stale EMA. Parameters need torch >= 2.0, buffers and modules 2.1.
    """
    if _hook_handles:
        return
    for name, table in (
        ("register_module_parameter_registration_hook", "_parameters"),
        ("register_module_buffer_registration_hook", "_buffers"),
        ("register_module_module_registration_hook", "_modules"),
    ):
        register = getattr(nn.modules.module, name, None)
        if register is not None:
            _hook_handles.append(register(_bumper(table)))


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the plain module inside DataParallel/DistributedDataParallel and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
            continue
        # A torch.compile wrapper holds the module as its submodule "_orig_mod". A dict lookup: getattr of
        # a missing name goes through Module.__getattr__ and builds an AttributeError on every update.
        inner = model._modules.get("_orig_mod")
        if not isinstance(inner, nn.Module):
            return model
        model = inner


Slot = tuple[dict, str]


def module_entries(module: nn.Module) -> Iterator[tuple[str, Slot]]:
    """Yield (state_dict key, (owning dict, name)) for every parameter and persistent buffer."""
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, t in mod._parameters.items():
            if t is not None:
                yield dot + name, (mod._parameters, name)
        skip = mod._non_persistent_buffers_set
        for name, t in mod._buffers.items():
            if t is not None and name not in skip:
                yield dot + name, (mod._buffers, name)


#: What a tensor read whole must keep besides its memory: ``p.data = p.view(new_shape)`` keeps
#: ``data_ptr()`` but a ``_foreach_lerp_`` over it would fail halfway through the list.
shape_and_dtype = attrgetter("shape", "dtype")


def _snapshot(slots: list[Slot]) -> tuple[list[int], list[tuple]]:
    """``data_ptr()`` and (shape, dtype) of the tensor each slot holds now; map() keeps the loops in C."""
    dicts, keys = zip(*slots) if slots else ((), ())
    tensors = list(map(getitem, dicts, keys))
    return list(map(Tensor.data_ptr, tensors)), list(map(shape_and_dtype, tensors))


@dataclass
class ModulePairs:
    """Matched tensors of an EMA module and a model, keyed like ``state_dict()``, tied weights once."""

    names: list[str]  # keys of the floating-point pairs
    ema: list[Tensor]
    model: list[Tensor]
    other_ema: list[Tensor]  # non-float entries (BatchNorm's num_batches_tracked): copied, not averaged
    other_model: list[Tensor]
    slots: list[Slot]
    ptrs: list[int]
    generation: int
    model_ref: weakref.ref
    metas: list[tuple] = field(default_factory=list)  # (shape, dtype) per slot, with ``ptrs``
    model_slots: list[Slot] = field(default_factory=list)  # the model side of each float pair, in order
    other_slots: list[Slot] = field(default_factory=list)  # both sides of every non-float entry

    @classmethod
    def collect(cls, ema: nn.Module, model: nn.Module) -> ModulePairs:
        """Match every parameter and persistent buffer of ``ema`` with ``model``'s by key."""
        install_hooks()  # before the generation is read: from here on, every registration bumps it
        ema_slots = dict(module_entries(ema))
        model_slots = dict(module_entries(model))
        if ema_slots.keys() != model_slots.keys():
            missing = sorted(ema_slots.keys() - model_slots.keys())
            extra = sorted(model_slots.keys() - ema_slots.keys())
            raise ValueError(
                f"EMA and model do not hold the same entries: missing in model {missing[:5]}, "
                f"not in EMA {extra[:5]} ({len(missing)} and {len(extra)} in all)"
            )
        pairs = cls([], [], [], [], [], [], [], _generation, weakref.ref(model))
        seen: set[int] = set()
        for key, (d, k) in ema_slots.items():
            e, (md, mk) = d[k], model_slots[key]
            m = md[mk]
            if id(e) in seen:  # tied weights: one tensor under two keys
                continue
            seen.add(id(e))
            if e.is_floating_point():
                pairs.names.append(key)
                pairs.ema.append(e)
                pairs.model.append(m)
                pairs.model_slots.append((md, mk))
            else:
                if e.shape != m.shape or e.device != m.device:
                    raise ValueError(
                        f"entry {key!r}: EMA shape {tuple(e.shape)} on {e.device} does not match "
                        f"model shape {tuple(m.shape)} on {m.device}"
                    )
                pairs.other_ema.append(e)
                pairs.other_model.append(m)
                pairs.other_slots += [(d, k), (md, mk)]
            pairs.slots += [(d, k), (md, mk)]
        pairs.ptrs, pairs.metas = _snapshot(pairs.slots)
        return pairs

    def is_current(self, model: nn.Module) -> bool:
        """True while ``model`` is the collected one and every slot still holds the cached memory,
        with the cached shape and dtype."""
        if self.generation != _generation or self.model_ref() is not model:
            return False
        try:
            return _snapshot(self.slots) == (self.ptrs, self.metas)
        except (KeyError, AttributeError, TypeError):  # an entry was deleted or set to None
            return False

    def refresh(self) -> None:
        """Record the slots' current memory as the intact state (after a strategy re-pointed tensors)."""
        self.ptrs, self.metas = _snapshot(self.slots)

    def release_ema(self) -> None:
        """Drop the EMA tensor list: a flat strategy counts the references to its buffers' views."""
        self.ema = []

    def copy_other(self) -> None:
        """Copy the non-float entries from the model into the EMA."""
        if not self.other_ema:
            return
        with torch.no_grad():
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(self.other_ema, self.other_model)
            else:  # torch < 2.1
                for e, m in zip(self.other_ema, self.other_model):
                    e.copy_(m)
