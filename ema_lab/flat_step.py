"""The ``"flat"`` step: the EMA in one buffer per (device, EMA dtype, model dtype) group.

Each group reads the model side by its layout, then every group is one ``lerp_`` or ``_foreach_lerp_``:

- ``fused``: the model's tensors tile one storage, as after :func:`ema_lab.flatten_model`: one ``lerp_``
  over the whole buffer (after one cast-copy into scratch if the dtypes differ);
- ``cast``: the model's dtype differs: one ``_foreach_copy_`` casts into scratch, then one ``lerp_``;
- ``cat``, ``foreach``, ``cat+foreach``: same dtype: small tensors gathered by ``torch.cat``, large ones
  read as they are, all in one ``_foreach_lerp_`` over views of the buffer (one ``lerp_`` if only a cat).

Its flat buffers (the EMA's, a fused model's) are checked by their storages' reference counts, O(1) each:
a replacement drops a reference; when a count moved, the exact per-slot check runs once. Limit: a fused
tensor replaced while something else keeps a new view of its buffer, or the replaced tensor, alive.
A 0-dim tensor decay is a tensor weight (no ``.item()``): sync-free, and data under ``torch.compile``.
"""

from __future__ import annotations

from itertools import accumulate
from operator import getitem

import torch
from torch import Tensor, nn

from .flat import empty_flat, group, into_one_buffer, tiles_in_order, whole_storage
from .gates import foreach_lerp_supported
from .pairs import Pairs, Slot, collect_pairs
from .step import Counters, StepOptions, Watch, generation
from .updates import validate_pairs

__all__ = ["FlatStep", "CAT_RUN_NUMEL"]

#: ATen's ``GRAIN_SIZE``: a CPU ``torch.cat`` with a bigger result at 2+ threads copies input by input, so
#: a step built at 2+ threads gathers in runs under it (benchmarks/cat_runs.py).
CAT_RUN_NUMEL = 32768

#: Devices whose ``_foreach_lerp_`` has a fused kernel. It takes a tensor weight only as one tensor shaped
#: like each target: with a 0-dim weight per target it launches one kernel per tensor.
_FUSED_FOREACH = ("cuda",)
#: There the weights are views of one buffer filled with the weight; a target above this many elements
#: gets its own ``lerp_`` instead (one launch is small beside its bytes): the buffer stays near 4 MiB.
DENSE_WEIGHT_NUMEL = 1 << 20

# A private binding (present from torch 2.1 to at least 2.13). Without it every flat step takes the
# exact per-slot check: slower, never unsafe.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class _Group:
    """A group moves its EMA buffer, ``ema``, towards ``source`` (what ``read`` left there)."""

    ema: Tensor
    source: Tensor

    @property
    def targets(self) -> list[Tensor]:
        return [self.ema]

    def lerp(self, weight: float | Tensor, targets: list[Tensor] | None = None) -> None:
        """``e += weight * (m - e)`` over the whole buffer (or a twin's, ``targets``): one ``lerp_``."""
        (self.ema if targets is None else targets[0]).lerp_(self.source, weight)


class _FusedGroup(_Group):
    """The model's tensors of the group tile one storage: one ``lerp_`` (after one cast-copy if needed)."""

    mode = "fused"
    checked_slots: list[Slot] = []  # watched by the two storages' reference counts instead

    def __init__(self, ema: list[Tensor], model: list[Tensor]) -> None:
        self.model = whole_storage(model[0])
        order = sorted(range(len(model)), key=lambda i: model[i].storage_offset())
        self.ema = into_one_buffer([ema[i] for i in order])  # the model's layout: one lerp_ covers all
        cast = model[0].dtype != ema[0].dtype  # bf16/fp16 model, fp32 EMA
        self.scratch = empty_flat(self.ema.numel(), self.ema.dtype, self.ema.device) if cast else None
        self.source = self.model if self.scratch is None else self.scratch
        self.storages = [self.ema.untyped_storage(), self.model.untyped_storage()]

    def read(self) -> None:
        if self.scratch is not None:
            self.scratch.copy_(self.model)


class _CastGroup(_Group):
    """Model dtype differs from the EMA's: one ``_foreach_copy_`` casts into scratch, then one ``lerp_``."""

    mode = "cast"

    def __init__(self, ema: list[Tensor], model: list[Tensor], slots: list[Slot]) -> None:
        self.ema = into_one_buffer(ema)
        scratch = empty_flat(self.ema.numel(), self.ema.dtype, self.ema.device)
        off = [0, *accumulate(e.numel() for e in ema)]
        self.scratch_views = [scratch[a:b].view(e.shape) for a, b, e in zip(off, off[1:], ema)]
        self.model, self.source = model, scratch
        self.storages, self.checked_slots = [self.ema.untyped_storage()], slots

    def read(self) -> None:
        torch._foreach_copy_(self.scratch_views, self.model)


class _SplitGroup:
    """Same dtype: the small tensors (first in the buffer) by ``torch.cat`` runs, the large read as they are.

    The small 1-D tensors (BatchNorm's vectors, biases) are read live from their module slots by
    :meth:`read`, with no ``data_ptr()`` check: whatever a slot holds now is what is read, and one that
    changed size, dtype or device fails the gather, before anything is written.
    """

    def __init__(self, ema: list[Tensor], model: list[Tensor], slots: list[Slot], cat_max_numel: int) -> None:
        small = [i for i, m in enumerate(model) if m.numel() < cat_max_numel and m.is_contiguous()]
        small.sort(key=lambda i: model[i].dim() != 1)  # the live 1-D ones first
        # The large tensors that take a dense weight (see lerp) first: one slice of the lists holds them.
        large = sorted(
            set(range(len(model))) - set(small), key=lambda i: (model[i].numel() > DENSE_WEIGHT_NUMEL, i)
        )
        live = {i for i in small if model[i].dim() == 1}
        self.checked_slots = [slots[i] for i in range(len(model)) if i not in live]
        self.mode = "cat+foreach" if small and large else "cat" if small else "foreach"
        self.ema = into_one_buffer([ema[i] for i in small + large])
        self.storages = [self.ema.untyped_storage()]
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
        self.targets = [run[0] for run in self.runs] + [ema[i].detach() for i in large]
        self.large = [model[i] for i in large]
        self.sources: list[Tensor] = []  # the runs' gathered values, then the large tensors: set by read()
        self.foreach = len(self.targets) > 1 and foreach_lerp_supported(None, self.ema.device.type)
        # Where foreach is fused, a tensor weight goes as views of one buffer (made on first use).
        self.packed = len(self.runs) + sum(model[i].numel() <= DENSE_WEIGHT_NUMEL for i in large)
        self.dense = self.foreach and self.packed > 0 and self.ema.device.type in _FUSED_FOREACH
        self.dense_buffer: Tensor | None = None
        self.dense_views: list[Tensor] = []

    def read(self) -> None:
        """Gather the small tensors; raises if a slot read live no longer fits."""
        gathered = []
        for ema, dicts, keys, aliases in self.runs:
            src = torch.cat([*map(getitem, dicts, keys), *aliases])
            if src.shape != ema.shape or src.dtype != ema.dtype or src.device != ema.device:
                raise ValueError(f"the model's tensors gather to {src.numel()} {src.dtype} on {src.device}")
            gathered.append(src)
        self.sources = gathered + self.large

    def lerp(self, weight: float | Tensor, targets: list[Tensor] | None = None) -> None:
        """``e += weight * (m - e)``: one ``_foreach_lerp_`` (one ``lerp_`` per target off the foreach gate),
        over the EMA's targets or a twin's laid out the same (``targets``).

        Where foreach is fused, a tensor weight goes as views of one buffer filled with it (one kernel, no
        sync), and the targets above ``DENSE_WEIGHT_NUMEL`` one by one."""
        targets, sources = self.targets if targets is None else targets, self.sources
        if not self.foreach:
            for e, m in zip(targets, sources):
                e.lerp_(m, weight)
        elif isinstance(weight, float):
            torch._foreach_lerp_(targets, sources, weight)
        elif not self.dense:  # torch has no one-tensor-weight overload (to 2.13 at least): one per target
            torch._foreach_lerp_(targets, sources, [weight] * len(targets))
        else:
            n = self.packed
            if self.dense_buffer is None:  # a cat run may exceed DENSE_WEIGHT_NUMEL: sized to the largest
                numel = max(t.numel() for t in targets[:n])
                self.dense_buffer = torch.empty(numel, dtype=weight.dtype, device=weight.device)
                self.dense_views = [self.dense_buffer[: t.numel()].view(t.shape) for t in targets[:n]]
            self.dense_buffer.fill_(weight)
            torch._foreach_lerp_(targets[:n], sources[:n], self.dense_views)
            for e, m in zip(targets[n:], sources[n:]):
                e.lerp_(m, weight)


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

    tensor_decay = True
    in_place = False  # the EMA's tensors move into the groups' buffers
    recordable = True  # cuda_graph=True records it (graph_step.py)

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        validate_pairs(pairs.ema, pairs.model, pairs.names)
        ema, mod = pairs.ema, [m.detach() for m in pairs.model]
        self.groups: list[_FusedGroup | _CastGroup | _SplitGroup] = []
        indices = group(range(len(ema)), lambda i: (ema[i].device, ema[i].dtype, mod[i].dtype))
        for idx in indices:
            es, ms, slots = [ema[i] for i in idx], [mod[i] for i in idx], [pairs.model_slots[i] for i in idx]
            if tiles_in_order(sorted(ms, key=Tensor.storage_offset)):
                self.groups.append(_FusedGroup(es, ms))
            elif ms[0].dtype != es[0].dtype:
                self.groups.append(_CastGroup(es, ms, slots))
            else:
                self.groups.append(_SplitGroup(es, ms, slots, options.cat_max_numel))
        # Where each EMA tensor lies in its group's buffer, (pair, start): a Twin is laid out the same.
        # Positions, not the tensors: a reference to the EMA's own tensors would block swap_tensors.
        self.places = [
            [(i, ema[i].storage_offset() - g.ema.storage_offset()) for i in idx]
            for g, idx in zip(self.groups, indices)
        ]
        self.counters = Counters(pairs.ema_counters, pairs.model_counters)
        self.modes = [g.mode for g in self.groups]
        # Every read slot that is not a view of a watched buffer is checked per step (counters included).
        checked = [slot for g in self.groups for slot in g.checked_slots]
        self.watch = Watch(model, checked + pairs.model_slots[len(ema) :])
        self.exact = Watch(model, pairs.ema_slots + pairs.model_slots)  # when a reference count moved
        self.storages = [s for g in self.groups for s in g.storages]
        self.counts = _use_counts(self.storages)

    def intact(self, model: nn.Module) -> bool:
        """Per-slot check of the checked reads, O(1) per flat buffer (the exact check if a count moved)."""
        if not self.watch.current(model):
            return False
        if _USE_COUNT is None or _use_counts(self.storages) != self.counts:
            if not self.exact.current(model):
                return False
            self.counts = _use_counts(self.storages)  # a view made or dropped elsewhere: the new intact state
        return True

    def read(self) -> bool:
        """Every group gathers the model; False if a live slot holds None or another size, dtype or device:
        :meth:`apply` updates from what this read."""
        try:
            with torch.no_grad():
                for g in self.groups:
                    g.read()
        except (TypeError, RuntimeError, ValueError):
            return False
        return True

    def apply(self, decay: float | Tensor) -> None:
        """One update of every group, then the counters; ``decay`` is a float or a checked 0-dim tensor."""
        self.lerp(1.0 - decay)

    def lerp(self, weight: float | Tensor) -> None:
        """``e += weight * (m - e)`` in every group, then the counters; a tensor ``weight`` is 0-dim."""
        with torch.no_grad():
            if isinstance(weight, float):
                weights = [weight] * len(self.groups)
            else:  # no host sync; the weight in each buffer's dtype (torch < 2.10 wants them equal)
                for g in self.groups:
                    if weight.device != g.ema.device:
                        raise ValueError(
                            f"decay is on {weight.device} but the EMA group is on {g.ema.device}"
                        )
                weights = [weight.to(g.ema.dtype) for g in self.groups]
            for g, w in zip(self.groups, weights):
                g.lerp(w)
            self.counters()

    def twin(self, module: nn.Module) -> Twin:
        """A second EMA, ``module`` (a copy of the first), laid out like this step's buffers (see Twin)."""
        return Twin(self, module)


class Twin:
    """A second EMA module moved into buffers laid out like a flat step's groups, so that each group lerps
    it from what the step's :meth:`FlatStep.read` gathered: one read of the model for both EMAs. Its
    tensors are watched like the step's; once they move, a new twin copies them in again."""

    def __init__(self, step: FlatStep, module: nn.Module) -> None:
        pairs = collect_pairs(module, module)  # the same keys in the same order as the first EMA's
        ema = pairs.ema
        self.step, self.targets, self.storages = step, [], []
        with torch.no_grad():
            for g, places in zip(step.groups, step.places):
                buffer = empty_flat(g.ema.numel(), g.ema.dtype, g.ema.device)
                self.storages.append(buffer.untyped_storage())
                for i, start in places:
                    view = buffer[start : start + ema[i].numel()].view(ema[i].shape)
                    view.copy_(ema[i])
                    ema[i].data = view  # keeps the Parameter object, as into_one_buffer does
                base = g.ema.storage_offset()
                self.targets.append(
                    [buffer[t.storage_offset() - base :][: t.numel()].view(t.shape) for t in g.targets]
                )
        self.watch = Watch(module, pairs.ema_slots[: len(ema)])
        self.counts = _use_counts(self.storages)

    def intact(self, step: FlatStep, module: nn.Module) -> bool:
        """True while ``step`` is the one this twin was laid out for and its tensors have not moved: O(1) per
        buffer by reference counts, as the step's own buffers (the exact per-slot check if a count moved)."""
        if step is not self.step:
            return False
        if (
            self.counts
            and self.watch.generation == generation()
            and _use_counts(self.storages) == self.counts
        ):
            return True
        if not self.watch.current(module):
            return False
        self.counts = _use_counts(self.storages)  # a view made or dropped elsewhere: the new intact state
        return True

    def lerp(self, weight: float) -> None:
        """``e += weight * (m - e)`` over the twin, from what the step read for its own update."""
        with torch.no_grad():
            for g, targets in zip(self.step.groups, self.targets):
                g.lerp(weight, targets)


def _use_counts(storages: list) -> list[int]:
    """How many tensors (views included) hold each storage now; [] if torch cannot say."""
    return [] if _USE_COUNT is None else [_USE_COUNT(s._cdata) for s in storages]
