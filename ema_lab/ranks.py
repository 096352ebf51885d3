"""What an EMA does under torch.distributed: rank-local tensors and :meth:`RankDuties.sync_buffers`."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["RankDuties", "local_tensor", "world_size", "is_fully_sharded"]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (no copy), else ``t`` itself."""
    # What to_local() returns without grad, minus a dispatched view: the per-step check reads it too.
    return getattr(t, "_local_tensor", t)


def is_fully_sharded(model: nn.Module) -> bool:
    # FSDP2's fully_shard makes each sharded module a subclass of FSDPModule, which torch 2.4 and 2.5 keep in
    # torch.distributed._composable.fsdp, 2.6 on in torch.distributed.fsdp: found by name, with no import.
    return any(c.__name__ == "FSDPModule" for m in model.modules() for c in type(m).__mro__)


def world_size(group: object = None) -> int:
    """The size of ``group`` (the default group when None), 1 outside torch.distributed."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class RankDuties:
    """The multi-rank duties of an EMA that holds ``.emas`` (``.ema`` the first), ``sharded`` or not."""

    emas: list[nn.Module]
    ema: nn.Module
    sharded: bool
    ranks_checked = False  # set by the first update() or sync_buffers(): no warning about unsynced buffers

    def rank_local_tensors(self) -> list[Tensor]:
        """The EMAs' float tensors that ranks compute apart: buffers (a ShardedModelEMA's: all but shards)."""
        found = [t for e in self.emas for t in (*(e.parameters() if self.sharded else ()), *e.buffers())]
        return [t for t in found if t.is_floating_point() and not hasattr(t, "placements")]

    def sync_buffers(self, src: int = 0, group: object = None) -> None:
        """Overwrite every rank's EMA float buffers with rank ``src``'s (of ``group``): a collective, on every
        rank before evaluating or saving; not in ``update()``, where it would hang an EMA kept on one rank."""
        if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            got = type(group).__name__
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {got}")
        world = world_size(group)
        if not (isinstance(src, int) and not isinstance(src, bool) and 0 <= src < world):
            raise ValueError(f"src must be a rank of the group, 0 to {world - 1}, got {src!r}")
        self.ranks_checked = True  # its user syncs: no warning
        if world == 1:
            return
        buffers = self.rank_local_tensors()
        # DDP's coalesced broadcast copies in place (the step keeps its tensors) through flat tensors made in
        # C++: one made in Python aborted the process at exit (gloo's worker freed it without the GIL).
        with torch.no_grad():
            size = sum(b.numel() * b.element_size() for b in buffers)  # one bucket per (dtype, device)
            dist._broadcast_coalesced(dist.group.WORLD if group is None else group, buffers, size, src)

    def _warn_unsynced(self, model: nn.Module) -> None:
        """Warn, once, when a rank-local float buffer (not SyncBatchNorm's) differs from the model's."""
        self.ranks_checked = True
        if world_size() == 1:
            return
        # SyncBatchNorm reduces its batch statistics over the ranks: its buffers are equal on every rank.
        synced = {id(t) for m in self.ema.modules() if isinstance(m, nn.SyncBatchNorm) for t in m.buffers()}
        local = {id(t) for t in self.rank_local_tensors()} - synced
        now = model.state_dict(keep_vars=True)
        mine = self.ema.state_dict(keep_vars=True).items()
        moved = [
            k for k, t in mine if id(t) in local and k in now and not torch.equal(t, now[k].detach().to(t))
        ]
        if moved:
            warnings.warn(
                f"{type(self).__name__}: each rank updates the model's float buffers ({moved[0]!r}: "
                "BatchNorm's running statistics) from its own batch, so the EMA's buffers differ between "
                "ranks; call ema.sync_buffers() on every rank before you evaluate or save the EMA (an EMA "
                "kept on one rank only holds that rank's)",
                stacklevel=3,
            )
