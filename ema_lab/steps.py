"""One EMA step per strategy, built once per model layout: it tells whether it is still current and applies.

``ModelEMA`` collects the (EMA, model) tensor pairs once instead of walking ``state_dict()`` twice per
update. That cache is only safe if it notices when the modules stop using the cached memory: ``.to()``,
``.half()``, a reassigned parameter, ``p.data = ...``, ``torch.utils.swap_tensors``. A step reads the model
through detached aliases (same memory, no autograd, no reference that would make ``swap_tensors`` refuse)
and before each update :class:`Watch` compares the ``data_ptr()`` each module slot holds now with the one
it was built from, plus a counter bumped by torch's global registration hooks (:func:`install_hooks`, on
the first EMA made, never at import). A stale step is rebuilt; a layout that no longer fits the EMA
raises before anything is written. A tensor re-viewed in place (``p.data = p.view(shape)``, same memory)
is averaged as that memory in the EMA's shape: the aliases keep theirs, so no foreach stops halfway.

``"loop"``, ``"foreach"``, ``"gated"``: :mod:`ema_lab.updates` over the aliases (:class:`ListStep`).
``"flat"`` (:class:`FlatStep`): the EMA tensors of each (device, EMA dtype, model dtype) group move into
one buffer, and the model side is read by layout: ``fused`` (the model's tensors tile one storage, as
after :func:`ema_lab.flatten_model`: one ``lerp_``, after one cast-copy if dtypes differ), ``cast`` (one
``_foreach_copy_`` into scratch, one ``lerp_``), ``cat`` (small tensors: one ``torch.cat``, one ``lerp_``),
``foreach`` (large ones: one ``_foreach_lerp_`` over views of the buffer) or ``cat+foreach``. Its flat
buffers (the EMA's, a fused model's) are checked by their storages' reference counts, O(1) each: a
replacement drops a reference; when a count moved, the exact per-slot check runs once. Limit: a fused
tensor replaced while something else keeps a new view of its buffer, or the replaced tensor, alive.
A 0-dim tensor decay is a tensor weight (no ``.item()``): sync-free, and data under ``torch.compile``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from operator import getitem

import torch
from torch import Tensor, nn

from .flat import empty_flat, group, into_one_buffer, tiles_in_order, whole_storage
from .gates import foreach_lerp_supported
from .updates import prepare, validate_pairs

#: Below this many elements a model tensor is gathered by one ``torch.cat`` (about a third of the
#: per-tensor cost of a foreach, plus one more pass over its elements); benchmarks/update_costs.py sweeps it.
CAT_MAX_NUMEL = 2048
#: ATen's ``GRAIN_SIZE``: a CPU ``torch.cat`` with a bigger result at 2+ threads copies input by input, so
#: a step built at 2+ threads gathers in runs under it (benchmarks/cat_runs.py).
CAT_RUN_NUMEL = 32768

# A private binding (present from torch 2.1 to at least 2.13). Without it every flat step takes the
# exact per-slot check: slower, never unsafe.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)

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


Slot = tuple[dict, str]  # (the module dict that holds an entry, its name): what the entry is *now*


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
    install_hooks()  # before any step reads the generation: from here on every registration bumps it
    ema_slots, model_slots = dict(module_entries(ema)), dict(module_entries(model))
    if ema_slots.keys() != model_slots.keys():
        missing = sorted(ema_slots.keys() - model_slots.keys())
        extra = sorted(model_slots.keys() - ema_slots.keys())
        raise ValueError(
            f"EMA and model do not hold the same entries: missing in model {missing[:5]}, "
            f"not in EMA {extra[:5]} ({len(missing)} and {len(extra)} in all)"
        )
    floats: list[tuple[str, Tensor, Tensor, Slot, Slot]] = []
    counters: list[tuple[str, Tensor, Tensor, Slot, Slot]] = []
    seen: set[int] = set()
    for key, slot in ema_slots.items():
        e, m = getitem(*slot), getitem(*model_slots[key])
        if id(e) not in seen:  # tied weights: one tensor under two keys
            seen.add(id(e))
            (floats if e.is_floating_point() else counters).append((key, e, m, slot, model_slots[key]))
    for key, e, m, _, _ in counters:
        if e.shape != m.shape or e.device != m.device or m.is_floating_point():
            raise ValueError(
                f"entry {key!r}: EMA shape {tuple(e.shape)} {e.dtype} on {e.device} does not match "
                f"model shape {tuple(m.shape)} {m.dtype} on {m.device}"
            )
    f, c = (list(zip(*x)) or [()] * 5 for x in (floats, counters))
    return Pairs([*f[0]], [*f[1]], [*f[2]], [*c[1]], [*c[2]], [*f[3], *c[3]], [*f[4], *c[4]])


class Watch:
    """Whether ``model`` is still the one a step was built for and its slots hold the same memory."""

    def __init__(self, model: nn.Module, slots: list[Slot], local: Callable[[Tensor], Tensor] | None = None):
        self.model_ref = weakref.ref(model)
        self.generation = _generation
        self.dicts, self.keys = (tuple(x) for x in zip(*slots)) if slots else ((), ())
        self.local = local  # ShardedModelEMA: the local shard of a DTensor
        self.ptrs = self.data_ptrs()

    def data_ptrs(self) -> list[int]:
        """``data_ptr()`` of the tensor each slot holds now; map() keeps the loop in C."""
        tensors = map(getitem, self.dicts, self.keys)
        return list(map(Tensor.data_ptr, tensors if self.local is None else map(self.local, tensors)))

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


class ListStep:
    """``"loop"``, ``"foreach"`` or ``"gated"``: the pure update of :mod:`ema_lab.updates` over aliases."""

    modes: list[str] = []

    def __init__(
        self, strategy: str, pairs: Pairs, model: nn.Module, local: Callable[[Tensor], Tensor] | None = None
    ) -> None:
        self.step = prepare(
            strategy, [e.detach() for e in pairs.ema], [m.detach() for m in pairs.model], pairs.names
        )
        self.counters = Counters(pairs.ema_counters, pairs.model_counters)
        self.current = Watch(model, pairs.ema_slots + pairs.model_slots, local).current

    def apply(self, decay: float) -> None:
        """One update of the EMA, then the counters."""
        self.step(decay)
        self.counters()


class FusedGroup:
    """The model's tensors of the group tile one storage: one ``lerp_`` (after one cast-copy if needed)."""

    mode = "fused"

    def __init__(self, ema: list[Tensor], model: list[Tensor]) -> None:
        self.model = whole_storage(model[0])
        order = sorted(range(len(model)), key=lambda i: model[i].storage_offset())
        self.ema = into_one_buffer([ema[i] for i in order])  # the model's layout: one lerp_ covers all
        cast = model[0].dtype != ema[0].dtype
        self.scratch = empty_flat(self.ema.numel(), self.ema.dtype, self.ema.device) if cast else None

    def apply(self, w: float | Tensor) -> None:
        src = self.model
        if self.scratch is not None:  # bf16/fp16 model, fp32 EMA
            src = self.scratch.copy_(src)
        self.ema.lerp_(src, w)


class CastGroup:
    """Model dtype differs from the EMA's: one ``_foreach_copy_`` casts into scratch, then one ``lerp_``."""

    mode = "cast"

    def __init__(self, ema: list[Tensor], model: list[Tensor]) -> None:
        self.ema = into_one_buffer(ema)
        self.scratch = empty_flat(self.ema.numel(), self.ema.dtype, self.ema.device)
        off = [0, *accumulate(e.numel() for e in ema)]
        self.scratch_views = [self.scratch[a:b].view(e.shape) for a, b, e in zip(off, off[1:], ema)]
        self.model = [m.detach() for m in model]

    def apply(self, w: float | Tensor) -> None:
        torch._foreach_copy_(self.scratch_views, self.model)
        self.ema.lerp_(self.scratch, w)


class SplitGroup:
    """Same dtype: the small tensors (first in the buffer) by ``torch.cat`` runs, the large by one foreach.

    The small 1-D tensors (BatchNorm's vectors, biases) are read live from their module slots by
    :meth:`gather`, with no ``data_ptr()`` check: whatever a slot holds now is what is read, and one that
    changed size, dtype or device fails the gather, before anything is written.
    """

    def __init__(self, ema: list[Tensor], model: list[Tensor], slots: list[Slot], cat_max_numel: int) -> None:
        small = [i for i, m in enumerate(model) if m.numel() < cat_max_numel and m.is_contiguous()]
        small.sort(key=lambda i: model[i].dim() != 1)  # the live 1-D ones first
        large = sorted(set(range(len(model))) - set(small))
        live = {i for i in small if model[i].dim() == 1}
        self.checked_slots = [slots[i] for i in range(len(model)) if i not in live]
        self.mode = "cat+foreach" if small and large else "cat" if small else "foreach"
        self.ema = into_one_buffer([ema[i] for i in small + large])
        numels = [model[i].numel() for i in small]
        ends = [0, *accumulate(numels)]
        # One cat at one thread (or off the CPU); at 2+ threads runs under CAT_RUN_NUMEL (see above).
        threaded = self.ema.device.type == "cpu" and torch.get_num_threads() > 1
        runs = _runs(numels, CAT_RUN_NUMEL) if threaded else [range(len(small))] if small else []
        self.runs = []
        for r in runs:
            members = [small[k] for k in r]
            read = [slots[i] for i in members if i in live]
            dicts, keys = (tuple(x) for x in zip(*read)) if read else ((), ())
            aliases = [model[i].detach().view(-1) for i in members if i not in live]
            self.runs.append((self.ema[ends[r.start] : ends[r.stop]], dicts, keys, aliases))
        self.sources: list[Tensor] = []  # the runs' model values, read by gather()
        self.views = [ema[i].detach() for i in large]  # aliases of the buffer's views, our own objects
        self.model = [model[i].detach() for i in large]
        self.foreach = foreach_lerp_supported(None, self.ema.device.type)

    def gather(self) -> None:
        """Read the small tensors into :attr:`sources`; raises if a slot read live no longer fits."""
        self.sources = []
        for ema, dicts, keys, aliases in self.runs:
            src = torch.cat([*map(getitem, dicts, keys), *aliases])
            if src.shape != ema.shape or src.dtype != ema.dtype or src.device != ema.device:
                raise ValueError(f"the model's tensors gather to {src.numel()} {src.dtype} on {src.device}")
            self.sources.append(src)

    def apply(self, w: float | Tensor) -> None:
        for (ema, *_), src in zip(self.runs, self.sources):
            ema.lerp_(src, w)
        if not self.model:
            return
        if not self.foreach:  # mps before 2.4, npu: the gate says per tensor
            for v, m in zip(self.views, self.model):
                v.lerp_(m, w)
        else:
            torch._foreach_lerp_(self.views, self.model, w if isinstance(w, float) else [w] * len(self.model))


def _runs(numels: list[int], limit: int) -> list[range]:
    """Consecutive tensors (by element count) in runs under ``limit`` elements; a bigger one runs alone."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(numels):
        if total + n >= limit and i > start:
            runs.append(range(start, i))
            start, total = i, 0
        total += n
    return [*runs, range(start, len(numels))] if numels else []


class FlatStep:
    """``"flat"``: one buffer per (device, EMA dtype, model dtype) group; modes in the module docstring."""

    def __init__(self, pairs: Pairs, model: nn.Module, cat_max_numel: int = CAT_MAX_NUMEL) -> None:
        validate_pairs(pairs.ema, pairs.model, pairs.names)
        ema, mod = pairs.ema, [m.detach() for m in pairs.model]
        self.groups: list[FusedGroup | CastGroup | SplitGroup] = []
        self.reading: list[SplitGroup] = []  # the groups that read slots live (gathered by current())
        checked: list[Slot] = []
        for idx in group(range(len(ema)), lambda i: (ema[i].device, ema[i].dtype, mod[i].dtype)):
            es, ms, slots = [ema[i] for i in idx], [mod[i] for i in idx], [pairs.model_slots[i] for i in idx]
            if tiles_in_order(sorted(ms, key=Tensor.storage_offset)):
                self.groups.append(FusedGroup(es, ms))  # watched by the storage's reference count
            elif ms[0].dtype != es[0].dtype:
                self.groups.append(CastGroup(es, ms))
                checked += slots
            else:
                self.groups.append(SplitGroup(es, ms, slots, cat_max_numel))
                self.reading.append(self.groups[-1])
                checked += self.groups[-1].checked_slots
        self.counters = Counters(pairs.ema_counters, pairs.model_counters)
        self.modes = [g.mode for g in self.groups]
        self.devices = [g.ema.device for g in self.groups]
        # Every read slot that is not a view of a watched buffer is checked per step (counters included).
        self.watch = Watch(model, checked + pairs.model_slots[len(ema) :])
        self.exact = Watch(model, pairs.ema_slots + pairs.model_slots)  # when a reference count moved
        self.storages = [g.ema.untyped_storage() for g in self.groups]
        self.storages += [g.model.untyped_storage() for g in self.groups if g.mode == "fused"]
        self.counts = self.use_counts()

    def use_counts(self) -> list[int]:
        """How many tensors (views included) hold each flat storage now; [] if torch cannot say."""
        return [] if _USE_COUNT is None else [_USE_COUNT(s._cdata) for s in self.storages]

    def current(self, model: nn.Module) -> bool:
        """Per-slot check of the checked reads, O(1) per flat buffer (the exact check if a count moved),
        then the live reads: :meth:`apply` updates from what this read."""
        if not self.watch.current(model):
            return False
        if _USE_COUNT is None or self.use_counts() != self.counts:
            if not self.exact.current(model):
                return False
            self.counts = self.use_counts()  # a view made or dropped elsewhere: the new intact state
        try:
            with torch.no_grad():
                for g in self.reading:
                    g.gather()
        except (TypeError, RuntimeError, ValueError):  # a live slot holds None, or another size/dtype/device
            return False
        return True

    def apply(self, decay: float | Tensor) -> None:
        """One update of every group, then the counters; ``decay`` is a float or a checked 0-dim tensor."""
        with torch.no_grad():
            if isinstance(decay, float):
                weights = [1.0 - decay] * len(self.groups)
            else:  # no host sync; the weight in each buffer's dtype (torch < 2.10 wants them equal)
                for device in self.devices:
                    if decay.device != device:
                        raise ValueError(f"decay is on {decay.device} but the EMA group is on {device}")
                weights = [(1 - decay).to(g.ema.dtype) for g in self.groups]
            for g, w in zip(self.groups, weights):
                g.apply(w)
            self.counters()
