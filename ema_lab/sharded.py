"""``ShardedModelEMA``: an FSDP2 model's EMA as this rank's shards (DTensors, like the model's): a sharded
module refuses a deep copy, a full copy per rank would cost what FSDP saves, and the EMA is elementwise."""

from __future__ import annotations

from dataclasses import replace
from operator import getitem, itemgetter

import torch
from torch import Tensor, nn

from .ema import BaseEMA, unwrap_model
from .pairs import Entry, Pairs, collect_pairs, module_entries, unique
from .ranks import local_tensor

__all__ = ["ShardedModelEMA"]


class ShardedModelEMA(BaseEMA):
    """An FSDP2 model's EMA as this rank's shards (in-place strategies); update after ``optimizer.step()``."""

    sharded = True

    def _average_of(self, model: nn.Module) -> nn.Module:
        """A bare module tree of clones of ``model``'s entries (a DTensor's local shard), tied ones once."""
        if not torch.distributed.is_available():
            raise RuntimeError("ShardedModelEMA needs DTensor, and this torch build has no torch.distributed")
        entries = {key: getitem(*slot) for key, slot in module_entries(model)}
        root, made = nn.Module(), {}
        for t in unique(entries.values()):
            copy = t.detach().clone()  # a DTensor clones only its local shard
            made[id(t)] = nn.Parameter(copy, requires_grad=False) if copy.is_floating_point() else copy
        for key, t in entries.items():
            *path, name = key.split(".")
            mod = root
            for part in path:
                mod = mod._modules.setdefault(part, nn.Module())
            value = made[id(t)]
            (mod.register_parameter if isinstance(value, nn.Parameter) else mod.register_buffer)(name, value)
        return root

    def local_tensors(self) -> dict[str, Tensor]:
        """This rank's EMA tensors by state_dict key (shards of sharded entries), tied weights once."""
        items = unique(self.ema.state_dict(keep_vars=True).items(), itemgetter(1))
        return {key: local_tensor(t) for key, t in items}

    def local_bytes(self) -> int:
        """Bytes of EMA memory this rank holds (its shards plus replicated entries)."""
        return sum(t.numel() * t.element_size() for t in self.local_tensors().values())

    def _collect(self, model: nn.Module) -> Pairs:
        """The pairs of this rank's shards, checked to be laid out like the EMA's."""
        pairs = collect_pairs(self.emas, model)
        for entry in pairs.floats:  # a DTensor answers to .placements
            e, m = entry.emas[0], entry.model
            if hasattr(e, "placements") != hasattr(m, "placements"):
                raise ValueError(
                    f"entry {entry.key!r}: the EMA holds a {type(e).__name__} but the model now a "
                    f"{type(m).__name__}; call update() after optimizer.step(), when FSDP has resharded"
                )
            if hasattr(e, "placements") and (e.placements != m.placements or e.shape != m.shape):
                mine, theirs = (f"{tuple(t.shape)} {t.placements}" for t in (e, m))
                raise ValueError(f"entry {entry.key!r}: model {theirs} does not match EMA {mine}")

        def local(entry: Entry) -> Entry:
            return replace(entry, emas=tuple(map(local_tensor, entry.emas)), model=local_tensor(entry.model))

        floats, counters = [*map(local, pairs.floats)], [*map(local, pairs.counters)]
        return replace(pairs, floats=floats, counters=counters, sharded=True)

    def sharded_state_dict(self) -> dict[str, Tensor]:
        """The EMA as DTensors (this rank's shards, no copy, no communication), for DCP save or copy_to."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.ema)

    def full_state_dict(self, cpu_offload: bool = True) -> dict[str, Tensor]:
        """The whole EMA, gathered (a collective: call it on every rank); cpu_offload: only rank 0 gets it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        return get_model_state_dict(self.ema, options=options)

    def copy_to(self, model: nn.Module) -> None:
        """Load the EMA into an FSDP model sharded like the trained one (for evaluation), shard to shard."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(unwrap_model(model), self.sharded_state_dict())
