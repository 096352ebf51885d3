"""The ``"flat"`` step: each EMA in one buffer per group, moved by one ``lerp_`` or ``_foreach_lerp_``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import getitem

import torch
from torch import Tensor, nn
from torch.utils import _foreach_utils

from .buffers import empty_flat, group, into_one_buffer, tiles_in_order, view_like, whole_storage
from .checks import validate_pairs
from .gates import foreach_lerp_supported
from .pairs import Pairs, Slot
from .step import Counters, StepOptions, Watch, lerp_pairs

__all__ = ["FlatStep", "CAT_MAX_NUMEL", "MIN_LIVE_RUN", "CAT_RUN_NUMEL", "DENSE_WEIGHT_NUMEL"]
__all__ += ["fused_foreach_devices"]

#: Below this many elements a model tensor is gathered by one ``torch.cat`` (about a third of the
#: per-tensor cost of a foreach, plus one more pass over its elements); benchmarks/update_costs.py sweeps it.
CAT_MAX_NUMEL = 2048

#: A trailing shape shared by fewer small model tensors joins the 1-D cat, each read as a ``view(-1)``: a
#: ``torch.cat`` of its own (and one more foreach target) costs more than that many views.
MIN_LIVE_RUN = 16

#: ATen's ``GRAIN_SIZE``: a CPU ``torch.cat`` with a bigger result at 2+ threads copies input by input, so
#: a step built at 2+ threads gathers in runs under it (benchmarks/cat_runs.py).
CAT_RUN_NUMEL = 32768

#: Where foreach is fused (:func:`fused_foreach_devices`) a 0-dim tensor weight launches a kernel per tensor,
#: so it goes as views of one buffer filled with it; a target above this many elements gets its own ``lerp_``
#: (one launch is small beside its bytes), so the buffer stays near 4 MiB.
DENSE_WEIGHT_NUMEL = 1 << 20


def fused_foreach_devices() -> list[str]:
    """The device types whose ``_foreach_lerp_`` has a fused kernel, as torch (2.1 on) lists them."""
    return _foreach_utils._get_foreach_kernels_supported_devices()


class _OneLerpGroup:
    """One ``lerp_`` over each EMA's whole buffer: ``fused`` (the model tiles one storage) or ``cast``."""

    def __init__(self, emas: list[list[Tensor]], model: list[Tensor], slots: list[Slot], fused: bool) -> None:
        order = sorted(range(len(model)), key=lambda i: model[i].storage_offset()) if fused else None
        self.emas = _buffers(emas, order or range(len(model)))  # fused: in the model's layout
        first, self.checked_slots, self.mode = self.emas[0], slots, "fused" if fused else "cast"
        self.model = whole_storage(model[0]) if fused else model
        same = fused and model[0].dtype == first.dtype
        self.source = self.model if same else empty_flat(first.numel(), first.dtype, first.device)
        off = [0, *accumulate(m.numel() for m in model)]
        # The model cast into scratch laid out as the EMA (its memory format): one lerp_ pairs their elements.
        parts = zip(off, off[1:], emas[0])
        self.views = [] if fused else [view_like(self.source[a:b], e) for a, b, e in parts]

    def read(self) -> None:
        if self.mode == "cast":
            torch._foreach_copy_(self.views, self.model)
        elif self.source is not self.model:  # a bf16/fp16 model, an fp32 EMA
            self.source.copy_(self.model)

    def lerp(self, k: int, weight: float | Tensor) -> None:
        self.emas[k].lerp_(self.source, weight)


class _SameDtypeGroup:
    """Same dtype: the small tensors gathered live from their slots by ``torch.cat`` runs (a bad slot fails
    the gather before anything is written), the large read as they are, their slots watched."""

    def __init__(
        self, emas: list[list[Tensor]], model: list[Tensor], slots: list[Slot], cat_max_numel: int
    ) -> None:
        # Contiguous, the EMA's too, and in the EMA's shape (a strided or re-viewed one goes with the large,
        # through an alias shaped like the EMA's): the gather's values then lie as the EMA's do.
        small = [
            i
            for i, m in enumerate(model)
            if m.numel() < cat_max_numel
            and m.is_contiguous()
            and emas[0][i].is_contiguous()
            and getitem(*slots[i]).shape == m.shape
        ]
        # The large tensors that take a dense weight (see lerp) first: one slice of the lists holds them.
        large = sorted(set(range(len(model))) - set(small))
        large.sort(key=lambda i: model[i].numel() > DENSE_WEIGHT_NUMEL)
        self.checked_slots = [slots[i] for i in large]
        # One cat per trailing shape; a shape too rare for a cat of its own joins the 1-D one, each of its
        # tensors read as a live ``view(-1)`` (a cat call costs as much as several views).
        shapes = group(small, lambda i: model[i].shape[1:] if model[i].dim() else None)
        shared = [same for same in shapes if model[same[0]].dim() != 1 and len(same) >= MIN_LIVE_RUN]
        rare = {i for same in shapes if model[same[0]].dim() != 1 and len(same) < MIN_LIVE_RUN for i in same}
        self.mode = "cat+foreach" if small and large else "cat" if small else "foreach"
        device = model[0].device
        threaded = device.type == "cpu" and torch.get_num_threads() > 1
        vectors = [i for i in small if model[i].dim() == 1] + sorted(rare)  # the 1-D ones, then the rare
        runs = []
        for same in [vectors, *shared] if vectors else shared:
            cuts = _runs([model[i].numel() for i in same], CAT_RUN_NUMEL) if threaded else [range(len(same))]
            runs += [[same[k] for k in r] for r in cuts]
        self.emas = _buffers(emas, [i for run in runs for i in run] + large)
        ends = [0, *accumulate(sum(model[i].numel() for i in run) for run in runs)]
        self.runs = []  # (its slots' dicts and keys, its rare ones', the gather (cat or stack), its shape)
        for run in runs:
            as_is, flat = ([slots[i] for i in run if (i in rare) == r] for r in (False, True))
            first = model[run[0]]
            if first.dim() == 1 or run[0] in rare:  # the 1-D run, its rare tensors last
                gather, shape = torch.cat, (sum(model[i].numel() for i in run),)
            elif first.dim():
                gather, shape = torch.cat, (sum(model[i].shape[0] for i in run), *first.shape[1:])
            else:
                gather, shape = torch.stack, (len(run),)
            self.runs.append((*_unzip(as_is), *_unzip(flat), gather, torch.Size(shape)))
        self.targets = [
            [buffer[a:b] for a, b in zip(ends, ends[1:])] + [e[i].detach() for i in large]
            for buffer, e in zip(self.emas, emas)
        ]
        self.large = [model[i] for i in large]
        self.sources: list[Tensor] = []  # the runs' gathered values, then the large tensors: set by read()
        self.foreach = len(self.targets[0]) > 1 and foreach_lerp_supported(None, device.type)
        self.packed = len(self.runs) + sum(model[i].numel() <= DENSE_WEIGHT_NUMEL for i in large)
        self.dense = self.foreach and self.packed > 0 and device.type in fused_foreach_devices()
        self.dense_buffer: Tensor | None = None
        self.dense_views: list[Tensor] = []

    def read(self) -> None:
        gathered = []
        ema = self.emas[0]
        for dicts, keys, rare_dicts, rare_keys, gather, shape in self.runs:
            rare = map(Tensor.view, map(getitem, rare_dicts, rare_keys), repeat(-1))  # non-contiguous: raises
            src = gather([*map(getitem, dicts, keys), *rare])
            if src.shape != shape or src.dtype != ema.dtype or src.device != ema.device:
                why = f"{tuple(src.shape)} {src.dtype} on {src.device}, not {tuple(shape)} {ema.dtype}"
                raise ValueError(f"the model's tensors gather to {why}")
            gathered.append(src.view(-1))
        self.sources = gathered + self.large

    def lerp(self, k: int, weight: float | Tensor) -> None:
        """``e += weight * (m - e)`` over EMA ``k``'s targets (a tensor weight: ``DENSE_WEIGHT_NUMEL``)."""
        targets, sources = self.targets[k], self.sources
        if not self.dense or isinstance(weight, float):
            lerp_pairs(targets, sources, weight, self.foreach)
            return
        n = self.packed
        if self.dense_buffer is None:  # a cat run may exceed DENSE_WEIGHT_NUMEL: sized to the largest
            numel = max(t.numel() for t in targets[:n])
            self.dense_buffer = torch.empty(numel, dtype=weight.dtype, device=weight.device)
            self.dense_views = [self.dense_buffer[: t.numel()].view(t.shape) for t in targets[:n]]
        self.dense_buffer.fill_(weight)
        lerp_pairs(targets[:n], sources[:n], self.dense_views)
        lerp_pairs(targets[n:], sources[n:], weight, foreach=False)


def _buffers(emas: list[list[Tensor]], order: Sequence[int]) -> list[Tensor]:
    """Each EMA's tensors moved, in ``order``, into a new buffer laid out like the first EMA's."""
    first = [emas[0][i] for i in order]
    return [into_one_buffer(first), *(into_one_buffer([e[i] for i in order], like=first) for e in emas[1:])]


def _unzip(slots: list[Slot]) -> tuple[tuple, tuple]:
    """The slots' dicts and keys, as two tuples (for ``map(getitem, ...)``)."""
    return (tuple(d for d, _ in slots), tuple(k for _, k in slots))


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
    """``"flat"``, each group in a mode: ``fused``, ``cast``, ``cat``, ``foreach`` or ``cat+foreach``."""

    tensor_decay = True  # apply() takes 0-dim tensor decays (no host sync)
    in_place = False  # the EMAs' tensors move into the groups' buffers (ShardedModelEMA needs in place)
    recordable = True  # cuda_graph=True records it (graph_step.py): no live reads, fixed addresses
    gathers = True  # ready() gathers the model (a CUDA graph's replay reads it itself)

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        floats = pairs.floats
        emas = [pairs.ema_floats(k) for k in range(pairs.count)]
        # A model tensor re-viewed in place (``p.data = p.view(shape)``) is averaged as its memory, in the
        # EMA's shape, as the list steps' aliases do.
        mod = [
            m.detach().view(e.shape)
            if m.shape != e.shape and m.numel() == e.numel() and m.is_contiguous()
            else m.detach()
            for m, e in zip(pairs.model_floats(), emas[0])
        ]
        validate_pairs(emas[0], mod, [e.key for e in floats])
        self.groups: list[_OneLerpGroup | _SameDtypeGroup] = []
        first = emas[0]
        for idx in group(range(len(floats)), lambda i: (first[i].device, first[i].dtype, mod[i].dtype)):
            es, ms = [[e[i] for i in idx] for e in emas], [mod[i] for i in idx]
            slots = [floats[i].model_slot for i in idx]
            tiled = tiles_in_order(sorted(ms, key=Tensor.storage_offset))
            fused = tiled and all(e.is_contiguous() for e in es[0])  # one lerp_: one element order
            if fused or ms[0].dtype != es[0][0].dtype:
                self.groups.append(_OneLerpGroup(es, ms, slots, fused))
            else:
                self.groups.append(_SameDtypeGroup(es, ms, slots, options.cat_max_numel))
        self.counters = Counters(pairs)
        self.modes = [g.mode for g in self.groups]
        # Every slot but the model's live ones (read per update by the gather).
        checked = [s for e in (*floats, *pairs.counters) for s in e.ema_slots]
        checked += [slot for g in self.groups for slot in g.checked_slots]
        checked += [e.model_slot for e in pairs.counters]
        self.watch = Watch(model, checked, pairs.modules)

    def ready(self, model: nn.Module) -> bool:
        """True while every watched slot holds its memory and every group gathered its live ones."""
        if not self.watch.current(model):
            return False
        try:
            for g in self.groups if self.gathers else ():
                g.read()
        except (KeyError, TypeError, RuntimeError, ValueError):  # KeyError: a live slot's entry deleted
            return False
        return True

    def check_weights(self, weights: Sequence[float | Tensor]) -> None:
        """A tensor weight must be on the device of every group it moves."""
        for w in weights:
            for g in self.groups if isinstance(w, Tensor) else ():
                if w.device != g.emas[0].device:
                    raise ValueError(f"decay is on {w.device} but the EMA is on {g.emas[0].device}")

    def apply(self, decays: Sequence[float | Tensor], weights: Sequence[float | Tensor]) -> None:
        """``e += weight * (m - e)`` in every group of each EMA, then the counters; a tensor weight is 0-dim
        (no host sync; cast to each buffer's dtype, as torch < 2.10 wants them equal)."""
        self.check_weights(weights)
        for k, weight in enumerate(weights):
            for g in self.groups:
                g.lerp(k, weight if isinstance(weight, float) else weight.to(g.emas[0].dtype))
        self.counters()
