"""``ShardedModelEMA``: the EMA of an FSDP2 (``fully_shard``) model, kept as this rank's shards only.

``ModelEMA`` deep-copies the model, which a ``fully_shard``-ed module refuses (``ModelEMA`` checks first and
points here), and a full copy per rank would cost the memory FSDP exists to save. The EMA is elementwise, so
each rank averages just the shard it owns: ``lerp(ema_shard, param.to_local(), 1 - d)``, no communication.
Only a checkpoint needs the whole EMA: ``full_state_dict()`` gathers it with torch's ``get_model_state_dict``.
The shards live in ``.ema``, a module holding them as DTensor parameters (same mesh, placements and names as
the model's), so torch's state-dict tools treat it like the model. It is a container, not a runnable
network: load it into an FSDP model with :meth:`copy_to` to evaluate.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from .ema import EMASchedule, check_arguments, unwrap_model
from .steps import ListStep, collect_pairs, install_hooks, module_entries

__all__ = ["ShardedModelEMA", "STRATEGIES"]

#: Strategies that update the EMA's tensors in place; a strategy that moves them into new storage
#: would detach them from the DTensors that the state-dict and checkpoint calls read.
STRATEGIES = ("loop", "foreach", "gated", "auto")


def _dtensor_cls() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:  # torch 2.4 (public from 2.5)
            from torch.distributed._tensor import DTensor
        except ImportError:  # torch < 2.4's DTensor lacks what FSDP2 needs, or no distributed build
            return None
    return DTensor


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (no copy), else ``t`` itself."""
    # What to_local() returns without grad, minus a dispatched view: the per-step check reads it too.
    return getattr(t, "_local_tensor", t)


def _holder(entries: dict[str, Tensor]) -> nn.Module:
    """A bare module tree that registers ``entries`` under their dotted names (shared tensors stay shared)."""
    root = nn.Module()
    made: dict[int, Tensor] = {}
    for key, t in entries.items():
        *path, name = key.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if id(t) not in made:
            made[id(t)] = nn.Parameter(t, requires_grad=False) if t.is_floating_point() else t
        value = made[id(t)]
        if isinstance(value, nn.Parameter):
            mod.register_parameter(name, value)
        else:
            mod.register_buffer(name, value)
    return root


class ShardedModelEMA(EMASchedule):
    """EMA of a model whose parameters are sharded DTensors (FSDP2): local shards, no communication.

    Same schedule and counters as ``ModelEMA`` (``decay(n) = decay * (1 - exp(-n / tau))``,
    ``.updates``, ``.enabled``). Call :meth:`update` after ``optimizer.step()``, when FSDP has
    resharded the parameters; plain (replicated) tensors such as buffers are averaged whole.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        tau: float = 2000,
        updates: int = 0,
        strategy: str = "auto",
    ) -> None:
        check_arguments(model, decay, tau, updates, strategy, STRATEGIES)
        if _dtensor_cls() is None:
            raise RuntimeError("ShardedModelEMA needs torch.distributed.tensor.DTensor (torch >= 2.4)")
        install_hooks()  # torch's global registration hooks: first EMA made, once per process
        model = unwrap_model(model)
        copies: dict[int, Tensor] = {}
        entries: dict[str, Tensor] = {}
        with torch.no_grad():
            for key, (d, k) in module_entries(model):
                t = d[k]
                if id(t) not in copies:  # tied weights: one EMA tensor under every key
                    copies[id(t)] = t.detach().clone()  # a DTensor clones only its local shard
                entries[key] = copies[id(t)]
        self.ema = _holder(entries)
        self._init_schedule(decay, tau, updates, strategy)

    @property
    def resolved_strategy(self) -> str:
        """The strategy actually run ("auto" resolved to "gated", as in ``ModelEMA``)."""
        return "gated" if self.strategy == "auto" else self.strategy

    def local_tensors(self) -> dict[str, Tensor]:
        """This rank's EMA tensors by state_dict key (shards of sharded entries), tied weights once."""
        seen: set[int] = set()
        out = {}
        for key, t in self.ema.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                out[key] = local_tensor(t)
        return out

    def local_bytes(self) -> int:
        """Bytes of EMA memory this rank holds (its shards plus replicated entries)."""
        return sum(t.numel() * t.element_size() for t in self.local_tensors().values())

    def _build(self, model: nn.Module) -> ListStep:
        """The update step over this rank's shards, checked to be laid out like the EMA's."""
        pairs = collect_pairs(self.ema, model)
        dtensor = _dtensor_cls()
        for k, e, m in zip(pairs.names, pairs.ema, pairs.model):
            if isinstance(e, dtensor) != isinstance(m, dtensor):
                raise ValueError(
                    f"entry {k!r}: the EMA holds a {type(e).__name__} but the model now a "
                    f"{type(m).__name__}; call update() after optimizer.step(), when FSDP has resharded"
                )
            if isinstance(e, dtensor) and (e.placements != m.placements or e.shape != m.shape):
                raise ValueError(
                    f"entry {k!r}: model {tuple(m.shape)} {m.placements} does not match "
                    f"EMA {tuple(e.shape)} {e.placements}"
                )
        local = {
            k: [local_tensor(t) for t in getattr(pairs, k)]
            for k in ("ema", "model", "ema_counters", "model_counters")
        }
        step = ListStep(self.resolved_strategy, replace(pairs, **local), model, local_tensor)
        self.rebuilds += 1
        return step

    def update(self, model: nn.Module) -> None:
        """Move this rank's EMA shards one step towards the model's (no communication)."""
        if not self.enabled:
            return
        model = unwrap_model(model)
        if self._step is None or not self._step.current(model):
            self._step = None
            self._step = self._build(model)
        self._step.apply(self.decay(self.updates + 1))
        self.updates += 1

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

    def __repr__(self) -> str:
        return (
            f"ShardedModelEMA(decay={self.max_decay}, tau={self.tau}, updates={self.updates}, "
            f"strategy={self.strategy!r}, local_bytes={self.local_bytes()})"
        )
