"""One-buffer helpers: tensors as views of one contiguous buffer, what the steps and flatten_model use."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["group", "empty_flat", "is_dense", "view_like", "into_one_buffer", "whole_storage"]
__all__ += ["tiles_in_order"]


def group(items: Iterable[int], key: Callable[[int], object]) -> list[list[int]]:
    """Positions grouped by ``key``, in first-seen order (torch's foreach grouping keys on one list only)."""
    out: dict[object, list[int]] = {}
    for i in items:
        out.setdefault(key(i), []).append(i)
    return list(out.values())


#: A transparent huge page: one TLB entry per 2 MiB (benchmarks/cat_runs.py); torch's switch is process-wide.
_HUGE_PAGE = 2 << 20


def empty_flat(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """An uninitialised 1-D buffer; on Linux CPU, from 2 MiB up, in transparent huge pages where granted."""
    device = torch.device(device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without THP: the mapping is still good memory
        mapping.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=-start % _HUGE_PAGE)


def is_dense(t: Tensor) -> bool:
    """True when ``t`` fills ``t.numel()`` consecutive places of its storage in some dimension order."""
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def view_like(part: Tensor, t: Tensor) -> Tensor:
    """``part`` (1-D) as ``t``'s shape, in ``t``'s strides where they are dense (channels_last stays so)."""
    return part.as_strided(t.shape, t.stride()) if is_dense(t) else part.view(t.shape)


def into_one_buffer(tensors: Sequence[Tensor], like: Sequence[Tensor] | None = None) -> Tensor:
    """A new 1-D buffer of ``tensors`` back to back, each now a view of its part laid out as its ``like``."""
    like = tensors if like is None else like
    buf = empty_flat(sum(t.numel() for t in tensors), like[0].dtype, like[0].device)
    storage, size, off = buf.untyped_storage(), buf.element_size(), buf.storage_offset()
    # A storage per part: accelerate and safetensors see one storage's tensors as tied; torch.save saves all.
    with torch.no_grad():
        for t, layout in zip(tensors, like):
            part = torch.empty(0, dtype=buf.dtype, device=buf.device)
            part.set_(storage[off * size : (off + t.numel()) * size], 0, (t.numel(),), (1,))
            view = view_like(part, layout)
            view.copy_(t)  # a fresh buffer: tensors that shared memory before are still read intact
            t.data = view  # keeps the Parameter object (optimizers, hooks and module slots hold it)
            off += t.numel()
    return buf


def whole_storage(t: Tensor) -> Tensor:
    """A 1-D tensor over all of ``t``'s storage, in ``t``'s dtype."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


def tiles_in_order(tensors: Sequence[Tensor], dense: Callable[[Tensor], bool] = Tensor.is_contiguous) -> bool:
    """True when the tensors are ``dense``, lie back to back in list order and cover one whole storage."""
    if not tensors:
        return False
    first, end = tensors[0], 0
    ptr = first.untyped_storage().data_ptr()
    for t in tensors:
        if t.dtype != first.dtype or not dense(t) or t.storage_offset() != end:
            return False
        if t.untyped_storage().data_ptr() != ptr:  # only now: a tensor without storage failed above
            return False
        end += t.numel()
    return end * first.element_size() == first.untyped_storage().nbytes()
