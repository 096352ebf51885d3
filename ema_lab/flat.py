"""Flat EMA state: one contiguous buffer per group, the EMA module's tensors views into it.

After PR #25315 an EMA update is one ``torch._foreach_lerp_`` call, but on CPU that call still
loops over every tensor in C++ (about 1 us each), and the code around it walks both modules.
The floor for the update is one ``lerp_`` over two contiguous buffers. This module gets there:

- ``"flat"``: each (device, EMA dtype, model dtype) group of EMA tensors is copied into one
  contiguous buffer and the EMA module's tensors are re-pointed into it (``t.data = view``), so
  the EMA side is one tensor per group. How the model side is read depends on its layout
  (:func:`plan_group` is the rule):

  ``fused``    the model's tensors of the group exactly tile one storage (the model was flattened):
               one ``lerp_`` (one cast-copy + one ``lerp_`` for a bf16/fp16 model into an fp32 EMA);
  ``cat``      same dtype, every tensor small (under :data:`CAT_MAX_NUMEL` elements): one
               ``torch.cat`` then one ``lerp_`` (cat costs about 0.3 us per tensor, a foreach
               about 1 us: :data:`CAT_TENSOR_US`, :data:`FOREACH_TENSOR_US`);
  ``foreach``  same dtype, every tensor large: ``torch._foreach_lerp_`` over views of the flat buffer;
  ``cat+foreach``  both kinds: the small tensors sit first in the buffer and take the ``cat`` path,
               the large ones the ``foreach`` path (a detector's BatchNorm vectors vs its conv weights);
  ``cast``     model dtype differs from the EMA's (bf16 model, fp32 EMA): ``torch._foreach_copy_``
               casts into an fp32 scratch buffer, then one ``lerp_``: no per-tensor Python path.

- ``"flat_model"`` (opt-in: it changes the training model): first :func:`flatten_tensors` the
  model's float parameters and buffers into one buffer per (device, dtype), then run ``"flat"``,
  which finds every group ``fused``: the whole update is one kernel per group. Optimizers and
  autograd see the same ``Parameter`` objects with the same values; only their storage moved.
  The model's integer counters (BatchNorm's ``num_batches_tracked``) go into one buffer per
  (device, dtype) as well, so copying them is one ``copy_`` (:func:`prepare_counter_copy`).
  :func:`unflatten_tensors` gives every tensor its own memory back.

Staleness (never average dead memory). ``ModelEMA`` reads the model side through its module slots on
every update (``step(decay, live)``, :meth:`FlatStep.bind`): the 1-D tensors of a ``cat`` part are read
as the slots hold them now, so they cannot be stale, and a slot whose tensor changed size, dtype or
device fails the gather before any group is written (:class:`StaleInputs`, then a rebuild); not seen:
two such slots that trade tensors of different sizes, which keeps the total (a model whose layers trade
widths no longer runs either). The other slots it reads are checked by ``data_ptr()`` first (below). The
step keeps no reference to the module tensors that are views into a flat buffer, so each flat storage's
reference count is exactly "our own views + the modules' tensors". ``model.to()``, ``.half()``, ``p.data
= ...``, ``torch.utils.swap_tensors`` or a module slot given a new tensor all drop references and change
that count: :meth:`FlatStep.refs_unchanged` compares it (O(1) per group) and ``ModelEMA`` falls back to
the exact per-slot check of :class:`ema_lab.pairs.ModulePairs` when it moved. Model tensors that are not
views and not read live unchecked (``foreach`` parts, N-D or 0-dim tensors of ``cat`` parts, ``cast``
groups, and the counters except ``flat_model``'s) are checked per slot by ``data_ptr()`` before each
step, which also sees a swap (an identity check would not: ``swap_tensors`` keeps the Python object),
and then read through the detached aliases built with the step. Those have the EMA views' shapes and
dtypes by construction, so a ``foreach`` over them cannot stop halfway through its list; a tensor
re-viewed in place (``p.data = p.view(new_shape)``: same memory, same ``data_ptr()``) is read as that
memory, in the EMA's shape. (The strategies that read the module's tensors themselves, ``gated``,
``foreach`` and ``loop``, check shape and dtype per slot too, and so refuse such a model.)
Limit of the O(1) count, so of ``fused`` groups only (``flat_model``, its counters included): it cannot
see a flat tensor that is re-pointed, swapped or replaced while something else keeps an equal number of
new views of the same buffer, or keeps the swapped-out or replaced tensor alive, between two updates
(``ModelEMA`` holds none).

Never in the way of torch's tensor swaps: ``torch.utils.swap_tensors`` (and so
``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses a tensor that something
else references at the C++ level, a view's base for one. Between updates the step holds the model
only through detached aliases (``m.detach()`` and views of those), never views of the module's own
tensors; the module tensors a live step reads are dropped when it returns. The aliases also keep the
memory they alias alive, so a replacement can never reuse a checked address.

Memory: every flat buffer of 2 MiB or more on a Linux CPU comes from :func:`empty_flat`, a private
mapping aligned to 2 MiB that asks for transparent huge pages: one TLB entry per 2 MiB of the stream
instead of per 4 KiB (``benchmarks/peers.py`` has a floor of each kind).

Sync-free: ``step(decay)`` takes a Python float or a 0-dim floating tensor on the group's device;
a tensor decay is used as a tensor weight (no ``.item()``), so under ``torch.compile`` a changing
decay is data, not a constant that forces a recompile. Its value is not range-checked: that
would need a host sync.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import torch
from torch import Tensor

from .gates import foreach_lerp_supported

__all__ = [
    "CAT_MAX_NUMEL",
    "FlatStep",
    "GroupPlan",
    "StaleInputs",
    "empty_flat",
    "flatten_model",
    "flatten_tensors",
    "unflatten_model",
    "unflatten_tensors",
    "storage_refs",
]

#: Per-tensor costs on CPU, one thread (``benchmarks/peers.py`` models, torch 2.13/2.14, this machine):
#: a tensor inside ``_foreach_lerp_`` costs one full per-tensor dispatch, a tensor gathered by
#: ``torch.cat`` much less but then each of its elements is written to scratch and read back once more.
FOREACH_TENSOR_US = 0.9
CAT_TENSOR_US = 0.3
CAT_ELEMENT_NS = 0.33
#: Break-even size of the two: same-dtype model tensors under this many elements take the ``cat`` path
#: (1818; a sweep of the split on the YOLO-like model is flat from 256 to 4096 with its minimum at 2048).
CAT_MAX_NUMEL = round(1000 * (FOREACH_TENSOR_US - CAT_TENSOR_US) / CAT_ELEMENT_NS)
#: ATen's ``at::internal::GRAIN_SIZE``. A CPU ``torch.cat`` whose result has fewer elements (or that runs on
#: one thread) takes the serial kernel, a memcpy per input; a larger one at 2+ threads copies each input
#: through its own ``narrow().copy_()``, about 1 us per tensor (yolo26n's 493 small tensors at 2 threads:
#: 0.56 ms instead of 0.11 ms, ``benchmarks/cat_runs.py``). So at 2+ threads the cat part goes in runs.
CAT_RUN_NUMEL = 32768


# A private binding (present in the torch versions tested here). Without it every step takes the exact
# per-slot check: slower, never unsafe.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)  # torch >= 2.3


def storage_refs(t: Tensor) -> int:
    """How many tensors (views included) hold ``t``'s storage right now; -1 if torch cannot say."""
    return -1 if _USE_COUNT is None else _USE_COUNT(t.untyped_storage()._cdata)


class StaleInputs(RuntimeError):
    """A module slot read live holds a tensor of another size, dtype or device; nothing was written."""


Picker = Callable[[Sequence[Tensor]], Sequence[Tensor]]


def picker(positions: Sequence[int]) -> Picker:
    """``itemgetter`` that always returns a tuple (``itemgetter(i)`` alone returns the bare item)."""
    if len(positions) == 1:
        i = positions[0]
        return lambda seq: (seq[i],)
    return itemgetter(*positions)


#: The transparent huge page of x86-64 (and of arm64 with 4 KiB pages); buffers from this size up get
#: their own mapping, aligned to it (:func:`empty_flat`).
HUGE_PAGE = 2 << 20


def empty_flat(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """An uninitialised 1-D buffer; on Linux CPU, from 2 MiB up, in transparent huge pages where granted.

    A flat EMA buffer is streamed once per update. With 4 KiB pages that stream needs a TLB entry every
    4 KiB, and each miss is a page walk (a two-level one in a VM); one 2 MiB page covers 512 of them.
    torch has ``THP_MEM_ALLOC_ENABLE=1`` for the same purpose, but it is read once per process and
    applies to every allocation. Here only the buffers this module owns ask for huge pages: a private
    anonymous mapping aligned to 2 MiB, with ``madvise(MADV_HUGEPAGE)``, that the tensor keeps alive.
    Where the kernel grants none (THP "never", another OS) it is ordinary memory.
    """
    device = torch.device(device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel built without THP: the mapping is still good memory
        mapping.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=-start % HUGE_PAGE)


def _whole_storage(t: Tensor) -> Tensor:
    """A 1-D tensor over all of ``t``'s storage, in ``t``'s dtype."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


def tiles_one_storage(tensors: Sequence[Tensor]) -> bool:
    """True when the tensors are contiguous, share one storage and cover all of it without overlap."""
    if not tensors:
        return False
    first = tensors[0]
    ptr = first.untyped_storage().data_ptr()
    spans = []
    for t in tensors:
        if t.dtype != first.dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr:
            return False
        spans.append((t.storage_offset(), t.numel()))
    spans.sort()
    end = 0
    for off, n in spans:
        if off != end:  # a gap or an overlap
            return False
        end = off + n
    return end * first.element_size() == first.untyped_storage().nbytes()


def _repoint(t: Tensor, view: Tensor) -> None:
    # ``.data =`` keeps the Parameter object (optimizers, hooks and module slots hold it) and its grad.
    t.data = view


def flatten_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Move each (device, dtype) group of ``tensors`` into one new contiguous buffer; return the buffers.

    Every tensor keeps its object, value, shape and ``requires_grad``; its memory becomes a view of
    the group's buffer. Tensors listed twice (tied weights) are moved once.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            groups.setdefault((t.device, t.dtype), []).append(t)
    buffers = []
    with torch.no_grad():
        for (device, dtype), ts in groups.items():
            buf = empty_flat(sum(t.numel() for t in ts), dtype, device)
            views, off = [], 0
            for t in ts:  # copy everything first: the tensors may already share one storage
                views.append(buf[off : off + t.numel()].view(t.shape))
                views[-1].copy_(t)
                off += t.numel()
            for t, v in zip(ts, views):
                _repoint(t, v)
            buffers.append(buf)
    return buffers


def unflatten_tensors(tensors: Sequence[Tensor]) -> None:
    """Give every tensor its own contiguous memory again (undoes :func:`flatten_tensors`)."""
    with torch.no_grad():
        for t in {id(t): t for t in tensors}.values():
            _repoint(t, t.detach().clone(memory_format=torch.contiguous_format))


def _model_tensors(model: torch.nn.Module) -> list[Tensor]:
    return [*model.parameters(), *model.buffers()]


def flatten_model(model: torch.nn.Module) -> list[Tensor]:
    """Move the model's parameters and buffers into one contiguous buffer per (device, dtype); return them.

    Opt-in, because it rewrites the training model's memory: every ``Parameter`` keeps its object, value
    and ``requires_grad`` (optimizers and hooks still hold it), and ``state_dict()`` returns views of
    the shared buffers. An EMA of a flattened model updates each group with one ``lerp_``. Flatten
    before building the optimizer's fused/foreach state; ``.to()``, ``.half()`` or a new parameter
    give tensors their own memory again (still correct, no longer fused).
    """
    return flatten_tensors(_model_tensors(model))


def unflatten_model(model: torch.nn.Module) -> None:
    """Give every parameter and buffer of ``model`` its own memory again (undoes :func:`flatten_model`)."""
    unflatten_tensors(_model_tensors(model))


def _small(t: Tensor) -> bool:
    return t.numel() < CAT_MAX_NUMEL and t.is_contiguous()


def plan_group(model: Sequence[Tensor], ema_dtype: torch.dtype) -> str:
    """The group's mode: ``fused``, ``cast``, ``cat``, ``foreach`` or ``cat+foreach`` (module docstring)."""
    if tiles_one_storage(model):
        return "fused"
    if model[0].dtype != ema_dtype:
        return "cast"
    small = sum(map(_small, model))
    return "cat" if small == len(model) else "foreach" if small == 0 else "cat+foreach"


@dataclass(frozen=True)
class GroupPlan:
    """What one flat group runs: its mode and how many of its pairs take each path (public, for notebooks)."""

    mode: str  # fused, cast, cat, foreach or cat+foreach
    device: str
    ema_dtype: torch.dtype
    model_dtype: torch.dtype
    tensors: int  # pairs in the group
    cat: int  # of them gathered by one torch.cat
    foreach: int  # of them read by one _foreach_lerp_
    elements: int


@dataclass
class CatRun:
    """Consecutive small tensors of a group gathered by one ``torch.cat``, then one ``lerp_``."""

    ema: Tensor  # the slice of the group's EMA buffer they occupy
    scratch: Tensor  # the same slice of the scratch buffer (reads through the built aliases)
    model: list[Tensor]  # 1-D aliases of the model tensors, as built
    index: range  # their positions in the group's cat order
    pick: Picker | None = None  # bound by FlatStep.bind: these tensors out of a live list

    def gather(self, live: Sequence[Tensor] | None) -> Tensor:
        """The model values of the run: from ``live`` (checked, nothing written) or the built aliases."""
        if live is None:
            return torch.cat(self.model, out=self.scratch)
        try:
            out = torch.cat(self.pick(live))
        except (TypeError, RuntimeError) as exc:  # a slot holds None, or another ndim, device or dtype
            raise StaleInputs(f"a model tensor read live changed: {exc}") from exc
        ema = self.ema
        if out.numel() != ema.numel() or out.dtype != ema.dtype or out.device != ema.device:
            raise StaleInputs(
                f"model tensors read live now gather to {out.numel()} {out.dtype} elements on "
                f"{out.device}, not {ema.numel()} {ema.dtype} on {ema.device}"
            )
        return out


def cat_runs(numels: Sequence[int], limit: int = CAT_RUN_NUMEL) -> list[range]:
    """Split tensors (by element count, in order) into runs of consecutive ones under ``limit`` elements."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(numels):
        if total + n >= limit and i > start:
            runs.append(range(start, i))
            start, total = i, 0
        total += n
    if len(numels) > start:
        runs.append(range(start, len(numels)))
    return runs


@dataclass
class FlatGroup:
    """One (device, EMA dtype, model dtype) group: the flat EMA buffer and how to read the model side."""

    mode: str
    ema: Tensor  # 1-D, owns the EMA memory of the group
    ema_views: list[Tensor]  # our own views (foreach part), never the module's tensor objects
    model: list[Tensor]  # detached aliases of the model's tensors: foreach part, or all (cast); [] if fused
    model_flat: Tensor | None  # fused: 1-D over the model's storage
    scratch: Tensor | None  # cat part/cast/fused-mixed: gathered model values in the EMA dtype
    scratch_views: list[Tensor]
    foreach_ok: bool
    cat_model: list[Tensor] = field(default_factory=list)  # 1-D views of the small model tensors
    model_dtype: torch.dtype | None = None
    tensors: int = 0  # pairs in the group
    pairs: list[int] = field(default_factory=list)  # input pair index of each tensor, in buffer order
    # A live step gathers the 1-D cat tensors from the slots read now (CatRun.pick, set by FlatStep.bind).
    cat_live: list[bool] = field(default_factory=list)  # per cat tensor: 1-D in the model, read live
    cat_whole: list[CatRun] = field(default_factory=list)  # the cat part as one run (one thread, or CUDA)
    cat_grains: list[CatRun] = field(default_factory=list)  # in runs under CAT_RUN_NUMEL (CPU, 2+ threads)

    def plan(self) -> GroupPlan:
        """This group's :class:`GroupPlan`."""
        return GroupPlan(
            mode=self.mode,
            device=str(self.ema.device),
            ema_dtype=self.ema.dtype,
            model_dtype=self.model_dtype,
            tensors=self.tensors,
            cat=len(self.cat_model),
            foreach=len(self.model) if self.mode in ("foreach", "cat+foreach") else 0,
            elements=self.ema.numel(),
        )

    def cat_parts(self) -> list[CatRun]:
        """The runs the cat part is gathered in at the current intra-op thread count."""
        # Under torch.compile the generated code gathers on its own terms: one run, and no thread query
        # (a torch.* call returning an int would break the graph).
        if _is_compiling() or torch.get_num_threads() == 1:
            return self.cat_whole
        return self.cat_grains

    def gather(self, live: Sequence[Tensor] | None) -> list[Tensor]:
        """Phase one of a step: the cat part's model values (from ``live``, or the built aliases if None).

        Writes no EMA memory, so a live slot that no longer fits fails here with nothing updated.
        """
        return [run.gather(live) for run in self.cat_parts()] if self.cat_model else []

    def apply(self, w: float | Tensor, gathered: list[Tensor]) -> None:
        """Phase two: ``ema += w * (model - ema)`` for the whole group, the cat part from ``gathered``."""
        if self.mode == "fused":
            src = self.model_flat
            if self.scratch is not None:  # bf16/fp16 model, fp32 EMA: one cast-copy, one lerp
                self.scratch.copy_(src)
                src = self.scratch
            self.ema.lerp_(src, w)
        elif self.mode == "cast":
            if self.foreach_ok:
                torch._foreach_copy_(self.scratch_views, self.model)
            else:
                for s, m in zip(self.scratch_views, self.model):
                    s.copy_(m)
            self.ema.lerp_(self.scratch, w)
        else:
            for run, src in zip(self.cat_parts(), gathered):
                run.ema.lerp_(src, w)
            if not self.model:
                return
            # The aliases built with the step (their data_ptr() checked), not the module's tensors: their
            # shapes and dtypes are the EMA views' by construction, so this foreach cannot stop halfway.
            if self.foreach_ok:
                torch._foreach_lerp_(
                    self.ema_views, self.model, w if isinstance(w, float) else [w] * len(self.model)
                )
            else:
                for v, m in zip(self.ema_views, self.model):
                    v.lerp_(m, w)


def _views(buf: Tensor, offsets: Sequence[int], like: Sequence[Tensor]) -> list[Tensor]:
    return [buf[o : o + t.numel()].view(t.shape) for o, t in zip(offsets, like)]


def _build_group(ema: list[Tensor], model: list[Tensor], pairs: list[int]) -> FlatGroup:
    ema_dtype, device = ema[0].dtype, ema[0].device
    # Detached aliases of the model's tensors: same memory, but no reference to the module's tensor
    # (a view of it would hold it as its base and make torch.utils.swap_tensors refuse to swap it),
    # and no autograd bookkeeping per tensor inside the foreach. They also keep the memory they read
    # alive, so a replaced tensor's address cannot be reused by its successor and fool the ptr check.
    model = [m.detach() for m in model]
    mode = plan_group(model, ema_dtype)
    n_small = 0
    if mode in ("cat", "cat+foreach"):  # small tensors first: the cat path updates one leading slice
        order = sorted(range(len(model)), key=lambda i: not _small(model[i]))
        ema, model, pairs = [ema[i] for i in order], [model[i] for i in order], [pairs[i] for i in order]
        n_small = sum(map(_small, model))
    if mode == "fused":
        model_flat = _whole_storage(model[0])
        offsets = [m.storage_offset() for m in model]
        size = model_flat.numel()
    else:
        model_flat = None
        offsets = [0, *torch.tensor([e.numel() for e in ema]).cumsum(0).tolist()[:-1]]
        size = sum(e.numel() for e in ema)
    buf = empty_flat(size, ema_dtype, device).zero_()
    views = _views(buf, offsets, ema)
    with torch.no_grad():
        for v, e in zip(views, ema):
            v.copy_(e)
        for v, e in zip(views, ema):
            _repoint(e, v)
    cat_size = sum(m.numel() for m in model[:n_small])
    needs_scratch = n_small or mode == "cast" or (mode == "fused" and model[0].dtype != ema_dtype)
    scratch = empty_flat(cat_size if n_small else size, ema_dtype, device) if needs_scratch else None
    loop = mode in ("foreach", "cat+foreach")
    group = FlatGroup(
        mode=mode,
        ema=buf,
        ema_views=_views(buf, offsets[n_small:], ema[n_small:]) if loop else [],
        model=[] if mode in ("fused", "cat") else list(model[n_small:]),
        model_flat=model_flat,
        scratch=scratch,
        scratch_views=_views(scratch, offsets, ema) if mode == "cast" else [],
        foreach_ok=foreach_lerp_supported(None, device.type),
        cat_model=[m.view(-1) for m in model[:n_small]],  # views of the detached aliases
        model_dtype=model[0].dtype,
        tensors=len(model),
        pairs=list(pairs),
        cat_live=[m.dim() == 1 for m in model[:n_small]],
    )
    if n_small:
        numels = [m.numel() for m in model[:n_small]]
        ends = [0, *torch.tensor(numels).cumsum(0).tolist()]
        whole = [range(n_small)]
        grains = cat_runs(numels) if device.type == "cpu" else whole
        group.cat_whole, group.cat_grains = (
            [
                CatRun(
                    ema=buf[ends[r.start] : ends[r.stop]],
                    scratch=scratch[ends[r.start] : ends[r.stop]],
                    model=group.cat_model[r.start : r.stop],
                    index=r,
                )
                for r in runs
            ]
            for runs in (whole, grains)
        )
    return group


@dataclass
class CounterCopy:
    """Non-float entries (BatchNorm's ``num_batches_tracked``): the EMA's are views of one buffer per
    (device, dtype), filled from the model's with one ``torch.cat`` instead of a per-tensor copy, or with
    one ``copy_`` where the model's counters tile one storage in the same order (``"flat_model"``)."""

    buffers: list[Tensor]
    sources: list[list[Tensor]]  # per buffer: 1-D detached aliases of the model's tensors ([] if fused)
    model_flat: list[Tensor | None] = field(default_factory=list)  # per buffer: 1-D over the model's storage
    fused_pairs: list[bool] = field(default_factory=list)  # per input pair: read through a ``model_flat``

    def __call__(self) -> None:
        """Copy the model's counters into the EMA's."""
        with torch.no_grad():
            for buf, src, flat in zip(self.buffers, self.sources, self.model_flat):
                if flat is None:
                    torch.cat(src, out=buf)
                else:
                    buf.copy_(flat)


def _tiles_in_order(model: Sequence[Tensor]) -> bool:
    """True when the 1-D tensors lie back to back, in list order, over the whole of one storage."""
    if not tiles_one_storage(model):
        return False
    off = 0
    for m in model:
        if m.storage_offset() != off:
            return False
        off += m.numel()
    return True


def prepare_counter_copy(
    ema: Sequence[Tensor], model: Sequence[Tensor], flatten_model: bool = False
) -> CounterCopy:
    """Re-point the EMA's non-float tensors into one buffer per (device, dtype); return their copy step.

    ``flatten_model`` (``"flat_model"``): the model's counters of each group are moved into one buffer too
    (:func:`flatten_tensors`), so the copy is one ``copy_`` per group and the model side of the group is
    watched by the storage's reference count (O(1)), like a ``fused`` float group.
    """
    keyed: dict[tuple, tuple[list[Tensor], list[Tensor], list[int]]] = {}
    for i, (e, m) in enumerate(zip(ema, model)):
        if e.numel() and m.dtype == e.dtype and m.is_contiguous():
            es, ms, idx = keyed.setdefault((e.device, e.dtype), ([], [], []))
            es.append(e)
            ms.append(m)
            idx.append(i)
        else:  # a cast or a strided counter: a group of its own, cat casts and copies it alone
            keyed[(e.device, e.dtype, id(e))] = ([e], [m], [i])
    copy = CounterCopy([], [], [], [False] * len(ema))
    with torch.no_grad():
        for es, ms, idx in keyed.values():
            aliases = [m.detach().reshape(-1) for m in ms]
            distinct = len({id(m) for m in ms}) == len(ms)
            if flatten_model and len(ms) > 1 and distinct and not _tiles_in_order(aliases):
                flatten_tensors(ms)
                aliases = [m.detach().reshape(-1) for m in ms]
            fused = flatten_model and len(ms) > 1 and distinct and _tiles_in_order(aliases)
            buf = torch.empty(sum(e.numel() for e in es), dtype=es[0].dtype, device=es[0].device)
            off = 0
            for e in es:
                view = buf[off : off + e.numel()].view(e.shape)
                view.copy_(e)
                _repoint(e, view)
                off += e.numel()
            copy.buffers.append(buf)
            # Fused: hold only the whole-storage tensor, so the storage's reference count is "the module's
            # tensors + this one" and a replacement of any of them changes it.
            copy.sources.append([] if fused else aliases)
            copy.model_flat.append(_whole_storage(aliases[0]) if fused else None)
            for i in idx:
                copy.fused_pairs[i] = fused
    return copy


def _check_tensor_decay(decay: Tensor) -> None:
    if decay.dim() != 0 or not decay.is_floating_point():
        raise ValueError(
            f"a tensor decay must be a 0-dim floating tensor, got shape {tuple(decay.shape)} {decay.dtype}"
        )


@dataclass
class FlatStep:
    """The prepared ``"flat"`` update: call it with the decay; :meth:`refs_unchanged` is the O(1) check.

    Called as ``step(decay)`` it reads the model through the tensors it was built from. ``ModelEMA``
    calls ``step(decay, live)`` after :meth:`bind`: ``live`` holds what the model's module slots hold
    now, and the step gathers the 1-D tensors of its ``cat`` parts (:attr:`live_pairs`) from it. Those
    need no ``data_ptr()`` check: whatever their slots hold is what is read, and a slot whose tensor
    changed size, dtype or device fails the gather (:class:`StaleInputs`) before any EMA memory is
    written. Everything else it reads through the built aliases, whose slots ``ModelEMA`` checked.
    """

    groups: list[FlatGroup]
    fused_pairs: list[bool] = field(default_factory=list)  # per input pair: is its model tensor a flat view
    # every flat buffer whose storage the modules' tensors must be views of (the EMA's, fused models')
    watched: list[Tensor] = field(default_factory=list)
    live_pairs: frozenset[int] = frozenset()  # input pairs read live without a data_ptr() check
    ext: list[Tensor] = field(default_factory=list)  # appended to ``live``: aliases the cat parts read
    # (StorageImpl pointer, reference count at baseline) per watched buffer: the buffers keep each storage
    # (so the pointer) valid, and refs_unchanged makes no UntypedStorage object per check
    _counts: list[tuple[int, int]] = field(default_factory=list, repr=False)

    def bind(self, positions: dict[int, int], n_live: int) -> None:
        """Prepare live reads: input pair ``i`` sits at ``positions[i]`` of a ``live`` list of ``n_live``."""
        self.ext, live_pairs = [], set()
        for g in self.groups:
            if g.mode not in ("cat", "foreach", "cat+foreach"):
                continue
            cat = []
            for i, view, fresh in zip(g.pairs, g.cat_model, g.cat_live):
                if fresh:
                    cat.append(positions[i])
                    live_pairs.add(i)
                else:  # N-D or 0-dim: torch.cat needs 1-D inputs, so read the 1-D alias built for it
                    cat.append(n_live + len(self.ext))
                    self.ext.append(view)
            for run in (*g.cat_whole, *g.cat_grains):
                run.pick = picker(cat[run.index.start : run.index.stop])
        self.live_pairs = frozenset(live_pairs)

    def __call__(self, decay: float | Tensor, live: Sequence[Tensor] | None = None) -> None:
        """Apply one update; ``decay`` is a Python number or a 0-dim tensor (no host sync)."""
        if isinstance(decay, Tensor):
            _check_tensor_decay(decay)
            w = 1 - decay
            for g in self.groups:
                if w.device != g.ema.device:
                    raise ValueError(f"decay is on {w.device} but the EMA group is on {g.ema.device}")
        else:
            d = float(decay)
            if not (math.isfinite(d) and 0.0 <= d <= 1.0):
                raise ValueError(f"decay must be a finite number in [0, 1], got {decay!r}")
            w = 1.0 - d
        if live is not None and self.ext:
            live = [*live, *self.ext]
        with torch.no_grad():
            gathered = [g.gather(live) for g in self.groups]  # every read that can fail, before any write
            for g, src in zip(self.groups, gathered):
                g.apply(w, src)

    def baseline(self) -> None:
        """Record the reference counts of the watched storages as the intact state."""
        if _USE_COUNT is None:
            self._counts = []
            return
        pointers = [buf.untyped_storage()._cdata for buf in self.watched]
        self._counts = [(c, _USE_COUNT(c)) for c in pointers]  # counted as refs_unchanged counts

    def refs_unchanged(self) -> bool:
        """True while no watched flat storage gained or lost a reference since :meth:`baseline`."""
        if _USE_COUNT is None or len(self._counts) != len(self.watched):  # not baselined (or a copy)
            return False
        return all(_USE_COUNT(c) == n for c, n in self._counts)

    def __getstate__(self) -> dict:
        # The cached pointers belong to this step's storages: a deep copy or an unpickled step has
        # others, so it starts unbaselined (the exact check, then baseline()) instead of reading freed memory.
        return {**self.__dict__, "_counts": []}

    @property
    def modes(self) -> list[str]:
        """Each group's mode, in group order."""
        return [g.mode for g in self.groups]

    @property
    def plan(self) -> tuple[GroupPlan, ...]:
        """Each group's :class:`GroupPlan`, in group order."""
        return tuple(g.plan() for g in self.groups)


def prepare_flat(ema: list[Tensor], model: list[Tensor]) -> FlatStep:
    """Flatten the EMA tensors per (device, EMA dtype, model dtype) group; return the step over them."""
    keyed: dict[tuple, tuple[list[Tensor], list[Tensor], list[int]]] = {}
    for i, (e, m) in enumerate(zip(ema, model)):
        es, ms, idx = keyed.setdefault((e.device, e.dtype, m.dtype), ([], [], []))
        es.append(e)
        ms.append(m)
        idx.append(i)
    groups = [_build_group(es, ms, idx) for es, ms, idx in keyed.values()]
    fused = [False] * len(ema)
    for g, (_, _, idx) in zip(groups, keyed.values()):
        for i in idx:
            fused[i] = g.mode == "fused"
    step = FlatStep(groups, fused)
    step.watched = [g.ema for g in groups] + [g.model_flat for g in groups if g.mode == "fused"]
    step.baseline()
    return step


def prepare_flat_model(ema: list[Tensor], model: list[Tensor]) -> FlatStep:
    """Opt-in: flatten the model's tensors too (one buffer per device/dtype), then :func:`prepare_flat`."""
    buffers: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for m in model:
        buffers.setdefault((m.device, m.dtype), []).append(m)
    for ts in buffers.values():
        if not tiles_one_storage(ts):
            flatten_tensors(ts)
    return prepare_flat(ema, model)


def count_compiles(step: FlatStep, decays: Sequence[float], as_tensor: bool = True) -> int:
    """How many graphs ``torch.compile`` builds for ``step`` over ``decays`` (1 means no recompiles).

    Uses a counting backend that runs the captured graph as is (no code generation), so it measures
    Dynamo's guards alone and works without a C++ compiler.
    """
    import torch._dynamo

    compiles = 0

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> object:
        nonlocal compiles
        compiles += 1
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda d: step(d), backend=backend)
    for d in decays:
        compiled(torch.tensor(d) if as_tensor else d)
    torch._dynamo.reset()
    return compiles
