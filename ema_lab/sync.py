"""Equal EMA buffers on every rank: under DDP and FSDP2 each rank's BatchNorm updates its buffers itself.

DDP (``broadcast_buffers=True``, its default) sends rank 0's buffers to the other ranks at the start of each
forward; BatchNorm then updates ``running_mean``/``running_var`` from the rank's own batch, and the EMA,
updated after the step, averages those. FSDP2 never syncs buffers. So the parameters' EMA is the same on
every rank but the buffers' EMA is not. :func:`sync_buffers` (``ema.sync_buffers()``) broadcasts the EMA's
float buffers from one rank, one collective per dtype: call it on every rank before evaluating or saving.

Why not inside ``update()``: a collective there would hang (or pair with DDP's own broadcast of the next
forward) where the EMA lives on rank 0 only, and it would cost a collective on every step for what is read
once an evaluation; ``update()`` stays local. :func:`warn_unsynced` makes the call hard to forget: in a
process group of more than one rank, the first update that averages such buffers warns once, naming it.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

__all__ = ["sync_buffers", "rank_local_tensors", "warn_unsynced"]


def _world_size(group: object = None) -> int:
    """The size of ``group`` (the default group when None), 1 outside torch.distributed."""
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank_local_tensors(ema: object) -> list[Tensor]:
    """The EMA's float tensors that ranks compute apart: its buffers and, in a ``ShardedModelEMA`` (it holds
    buffers as parameters), every tensor that is not a DTensor shard; of every EMA it keeps (``.emas``)."""
    tensors = []
    for module in ema.emas:
        tensors += [*module.parameters(), *module.buffers()] if ema.sharded else list(module.buffers())
    return [t for t in tensors if t.is_floating_point() and not hasattr(t, "placements")]


def sync_buffers(ema: object, src: int = 0, group: object = None) -> None:
    """Overwrite every rank's EMA float buffers with rank ``src``'s (a rank of ``group``, by default the
    whole world); a collective: call it on every rank of ``group``.

    One ``broadcast`` per (dtype, device) of the buffers, coalesced into one flat tensor, on the buffers'
    device (CUDA for nccl); nothing, and no collective, outside torch.distributed or on one rank.
    """
    import torch.distributed as dist

    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    world = _world_size(group)
    if not (isinstance(src, int) and not isinstance(src, bool) and 0 <= src < world):
        raise ValueError(f"src must be a rank of the group, 0 to {world - 1}, got {src!r}")
    ema.ranks_checked = True  # its user syncs: no warning
    if world == 1:
        return
    buffers = rank_local_tensors(ema)
    # torch's own coalesced broadcast (DDP's): it copies the buffers in place (the EMA's cached step keeps its
    # tensors) through flat tensors made in C++. A flat tensor made in Python aborted the process at exit
    # (SIGABRT, "terminate called without an active exception"): gloo's worker thread frees the finished work
    # after the call returned, and freeing a Python-owned tensor needs the GIL, which a thread asking for it
    # while the interpreter shuts down cannot get (CPython exits that thread through a noexcept destructor).
    with torch.no_grad():
        size = sum(b.numel() * b.element_size() for b in buffers)  # one bucket per (dtype, device)
        dist._broadcast_coalesced(dist.group.WORLD if group is None else group, buffers, size, src)


def warn_unsynced(ema: object, model: nn.Module) -> None:
    """Warn when ``ema`` averages float buffers that the ranks compute apart; once per EMA: ``update()`` calls
    it, with the unwrapped model, until ``ema.ranks_checked``.

    It follows torch.distributed's state, whatever reaches ``update()`` (a DDP wrapper, ``ddp.module``, a
    LightningModule): an initialized default group of more than one rank, and a rank-local float buffer
    (BatchNorm's statistics, not SyncBatchNorm's) that differs from the model's, which a forward since the
    EMA was made changed; a buffer equal to the model's (a constant) is alike on every rank. Local: one
    comparison per buffer, on the first update only.
    """
    ema.ranks_checked = True
    if _world_size() == 1:
        return
    # SyncBatchNorm reduces its batch statistics over the ranks: its buffers are equal on every rank.
    synced = {id(t) for m in ema.ema.modules() if isinstance(m, nn.SyncBatchNorm) for t in m.buffers()}
    local = {id(t) for t in rank_local_tensors(ema)} - synced
    now = model.state_dict(keep_vars=True)
    moved = [
        key
        for key, t in ema.ema.state_dict(keep_vars=True).items()
        if id(t) in local and key in now and not torch.equal(t.detach(), now[key].detach().to(t))
    ]
    if moved:
        warnings.warn(
            f"{type(ema).__name__}: each rank updates the model's float buffers ({moved[0]!r}: BatchNorm's "
            "running statistics) from its own batch, so the EMA's buffers differ between ranks; call "
            "ema.sync_buffers() on every rank before you evaluate or save the EMA (an EMA kept on one "
            "rank only holds that rank's)",
            stacklevel=3,
        )
