"""What an EMA does under torch.distributed: rank-local tensors and :meth:`RankDuties.sync_buffers`."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["RankDuties", "local_tensor", "world_size", "is_fully_sharded"]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (no copy), else ``t`` itself."""
    return getattr(t, "_local_tensor", t)  # to_local() without grad or a dispatched view (read per step)


def is_fully_sharded(model: nn.Module) -> bool:
    """True when FSDP2's ``fully_shard`` sharded a module of ``model`` (by name: FSDPModule moved in 2.6)."""
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
        """Copy rank ``src``'s EMA float buffers to every rank (a collective), before evaluating or saving."""
        if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            got = type(group).__name__
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {got}")
        world = world_size(group)
        if not (isinstance(src, int) and not isinstance(src, bool) and 0 <= src < world):
            raise ValueError(f"src must be a rank of the group, 0 to {world - 1}, got {src!r}")
        self.ranks_checked = True  # synced by hand, not in update(): there an EMA kept on one rank would hang
        if world == 1:
            return
        buffers = self.rank_local_tensors()
        # In place (the step keeps its tensors); C++ flat tensors: Python-made ones crashed gloo at exit.
        with torch.no_grad():
            size = sum(b.numel() * b.element_size() for b in buffers)  # one bucket per (dtype, device)
            dist._broadcast_coalesced(dist.group.WORLD if group is None else group, buffers, size, src)

    def _warn_unsynced(self, model: nn.Module) -> None:
        """Warn once when a rank-local float buffer differs from the model's (SyncBatchNorm's are synced)."""
        self.ranks_checked = True
        if world_size() == 1:
            return
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
