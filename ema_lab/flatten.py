"""``flatten_model``: a model's tensors in one buffer per (device, dtype), so an EMA update is a ``lerp_``."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from .buffers import empty_flat, group, is_dense, tiles_in_order, whole_storage
from .pairs import unique

__all__ = ["flatten_model", "unflatten_model", "flatten_tensors"]

#: torch's private count of a storage's holders (2.1 on; not in CPU builds till mid-2025): None skips a check.
USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _refusal(t: Tensor) -> str | None:
    """Why ``t`` cannot become a view of a plain buffer, or None."""
    if t.layout != torch.strided or t.is_nested:
        return f"a {'nested' if t.is_nested else t.layout} tensor has no strided memory to move"
    if isinstance(t, nn.parameter.UninitializedTensorMixin):  # before anything that reads its storage
        return "an uninitialized lazy parameter: run one forward pass first"
    if type(t).__torch_dispatch__ is not Tensor.__torch_dispatch__:  # DTensor and other wrapper subclasses
        return f"a {type(t).__name__} (a tensor subclass) cannot be a view of a plain buffer"
    if t.is_quantized:
        return "a quantized tensor cannot be a view of a plain buffer"
    if t.device.type == "meta":
        return "a meta tensor has no memory: flatten once the model is materialized"
    if not is_dense(t):
        shape = tuple(t.shape)
        return f"strides {t.stride()} of shape {shape} leave gaps or overlap (an expand or a strided slice)"
    return None


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: the same for every tensor on one storage


def _by_storage(named: Sequence[tuple[str, Tensor]]) -> dict[int, list[tuple[str, Tensor]]]:
    """The tensors on each storage; two whose memory overlaps are refused (a move would untie them)."""
    out: dict[int, list[tuple[str, Tensor]]] = {}
    for name, t in named:
        out.setdefault(_storage_key(t), []).append((name, t))
    for on_one in out.values():
        bytes_at = [(t.storage_offset() * t.element_size(), t.numel() * t.element_size()) for _, t in on_one]
        # By start, then in the model's order (names reported in that order).
        spans = sorted((a, i, a + n, on_one[i][0]) for i, (a, n) in enumerate(bytes_at) if n)
        for (_, _, end, a), (start, _, _, b) in zip(spans, spans[1:]):
            if start < end:  # sorted by start: if any two spans overlap, two neighbours do
                raise ValueError(
                    f"cannot flatten {a!r} and {b!r}: they share memory (one is a view or the .data of the "
                    "other), and each would get its own copy (nothing moved)"
                )
    return out


def _check_held_outside(named: Sequence[tuple[str, Tensor]], on_storage: dict[int, list]) -> None:
    """Refuse a tensor whose storage more tensors hold than the model's: they would keep the old memory."""
    if USE_COUNT is None:
        return
    probe = torch.empty(1)
    extra = USE_COUNT(probe.untyped_storage()._cdata) - 1  # what a query itself adds (the storage object)

    def outside(t: Tensor) -> int:
        key = _storage_key(t)
        return USE_COUNT(key) - extra - len(on_storage[key])

    held = [(name, t) for name, t in named if outside(t) > 0]
    if held:
        gc.collect()  # a dead optimizer or EMA caught in a reference cycle holds views until collected
        held = [(name, outside(t)) for name, t in held if outside(t) > 0]
    if held:
        name, count = held[0]
        raise ValueError(
            f"cannot flatten {name!r}: {count} more tensor(s) hold its memory outside the model and "
            "would keep the old memory (a .data or view kept by an optimizer or your code, the buffers of "
            "an earlier flatten_model, an EMA, a live autograd graph): flatten before making them, or drop "
            f"them ({len(held)} of the model's tensors held so; nothing moved)"
        )


def _copies_of_views(owner: int, module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` hook of a flattened module: entries viewing part of a larger storage saved as copies."""
    if id(module) != owner:  # a deep or pickled copy's hook: inert
        return
    for name, t in (*module._parameters.items(), *module._buffers.items()):
        saved = state.get(prefix + name)  # None: a non-persistent buffer
        if saved is None or saved is t or _refusal(saved) is not None:
            continue
        if saved.untyped_storage().nbytes() > saved.numel() * saved.element_size():
            state[prefix + name] = saved.clone()


def _hooks(model: nn.Module) -> list[int]:
    """The keys of the state_dict hooks of ``model`` that :func:`flatten_model` registered (or a copy's)."""
    return [k for k, h in model._state_dict_hooks.items() if getattr(h, "func", None) is _copies_of_views]


def _assign(moves: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Point each tensor at its new memory through ``.data`` (the object kept); if one fails, put all back."""
    done: list[tuple[Tensor, Tensor]] = []
    try:
        for t, new in moves:
            done.append((t, t.data))
            t.data = new
    except BaseException:
        for t, old in reversed(done):
            t.data = old
        raise


def _flatten(named: Sequence[tuple[str, Tensor]]) -> list[Tensor]:
    """Check every tensor, then move each (device, dtype) group into one new buffer: all or nothing."""
    for name, t in named:
        if (why := _refusal(t)) is not None:
            raise ValueError(f"cannot flatten {name!r}: {why} (nothing moved)")
    on_storage = _by_storage(named)
    by_kind = group(range(len(named)), lambda i: (named[i][1].device, named[i][1].dtype))
    groups = [[named[i] for i in idx] for idx in by_kind]
    # A group that tiles one storage (disjoint: checked above) is flat already: a second call moves nothing.
    flat = [tiles_in_order(sorted((t for _, t in g), key=Tensor.storage_offset), is_dense) for g in groups]
    _check_held_outside([item for g, done in zip(groups, flat) if not done for item in g], on_storage)
    buffers, moves = [], []
    with torch.inference_mode(False), torch.no_grad():  # normal tensors: inference ones cannot be trained
        for g, done in zip(groups, flat):
            tensors = [t for _, t in g]
            if done:
                buffers.append(whole_storage(tensors[0]))
                continue
            numel, dtype, device = sum(t.numel() for t in tensors), tensors[0].dtype, tensors[0].device
            if any(t.is_pinned() for t in tensors):  # page-locked host memory (fast copies to a GPU) stays so
                buf = torch.empty(numel, dtype=dtype, pin_memory=True)
            else:
                buf = empty_flat(numel, dtype, device)
            at = buf.storage_offset()
            for t in tensors:  # dense strides (checked): channels_last kept
                moves.append((t, buf.as_strided(t.shape, t.stride(), at).copy_(t)))
                at += t.numel()
            buffers.append(buf)
        _assign(moves)  # only once every copy is made: out of memory above leaves the model as it was
    return buffers


def _model_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    return unique([*model.named_parameters(), *model.named_buffers()], lambda item: item[1])


def flatten_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """:func:`flatten_model` for a list of tensors (named by their place in it); returns the buffers."""
    return _flatten(unique([(f"tensors[{i}]", t) for i, t in enumerate(tensors)], lambda item: item[1]))


def flatten_model(model: nn.Module) -> list[Tensor]:
    """Move the model's tensors into one buffer per (device, dtype), returned; then build optimizer, EMA."""
    buffers = _flatten(_model_tensors(model))
    for m in model.modules():  # state_dict copies: accelerate and safetensors want whole storages
        if not any(m._state_dict_hooks[k].args == (id(m),) for k in _hooks(m)):
            m._register_state_dict_hook(partial(_copies_of_views, id(m)))  # torch 2.1 has no public name
    return buffers


def unflatten_model(model: nn.Module) -> None:
    """Give every parameter and buffer that shares a buffer its own memory again (undoes flatten_model)."""
    movable = [(name, t) for name, t in _model_tensors(model) if _refusal(t) is None]
    on_storage = _by_storage(movable)
    moves = []
    with torch.inference_mode(False), torch.no_grad():  # normal tensors, as in _flatten
        for _, t in movable:
            shared = len(on_storage[_storage_key(t)]) > 1
            part = t.untyped_storage().nbytes() != t.numel() * t.element_size()
            # Not resizable: a slice of another storage (an EMA's); a torch without resizable(): left as is.
            if shared or part or not getattr(t.untyped_storage(), "resizable", lambda: True)():
                new = torch.empty_strided(  # dense (checked): its strides (channels_last) and pinning kept
                    t.shape, t.stride(), dtype=t.dtype, device=t.device, pin_memory=t.is_pinned()
                )
                moves.append((t, new.copy_(t)))
        _assign(moves)
    for m in model.modules():
        for key in _hooks(m):
            del m._state_dict_hooks[key]
