"""``ModelEMA``: a drop-in for ultralytics' class that keeps one cached step and nothing strategy-specific."""

from __future__ import annotations

import math
from collections.abc import Sequence
from copy import deepcopy

import torch
from torch import Tensor, nn

from .flat_step import FlatStep
from .graph_step import GraphStep
from .list_step import ListStep
from .pairs import Pairs, collect_pairs
from .step import CAT_MAX_NUMEL, Step, StepOptions
from .updates import check_decay
from .watch import install_hooks

__all__ = ["ModelEMA", "EMASchedule", "STEPS", "STRATEGIES", "resolve_strategy", "check_arguments"]
__all__ += ["unwrap_model", "copy_attr"]

#: Each strategy's step; "auto" (:func:`resolve_strategy`) picks one of them per model.
STEPS: dict[str, type[ListStep] | type[FlatStep]] = {
    "loop": ListStep,
    "foreach": ListStep,
    "gated": ListStep,
    "flat": FlatStep,
}
STRATEGIES = (*STEPS, "auto")


def resolve_strategy(strategy: str, tensors: Sequence[Tensor], in_place: bool = False) -> str:
    """``"auto"``: "flat" (a superset of "gated"'s fast paths) unless a tensor cannot be a view of a flat
    buffer (sparse, meta or otherwise not strided) or the EMA's tensors must stay ``in_place``: "gated"."""
    if strategy != "auto":
        return strategy
    movable = all(t.layout == torch.strided and t.device.type != "meta" for t in tensors)
    return "flat" if movable and not in_place else "gated"


def check_arguments(
    model: object, decay: float, tau: float, updates: int, strategy: str, strategies: Sequence[str]
) -> None:
    """Raise a clear TypeError/ValueError for a bad EMA constructor argument (shared with ShardedModelEMA)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_decay(decay)
    if not (isinstance(tau, (int, float)) and tau > 0 and math.isfinite(tau)):
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    if not (isinstance(updates, int) and updates >= 0):
        raise ValueError(f"updates must be a non-negative int, got {updates!r}")
    if strategy not in strategies:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {tuple(strategies)}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside DataParallel/DistributedDataParallel and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
            continue
        # torch.compile's wrapper holds the module as "_orig_mod"; a dict lookup, as getattr of a missing
        # name goes through Module.__getattr__ and builds an AttributeError on every update.
        inner = model._modules.get("_orig_mod")
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _is_fully_sharded(model: nn.Module) -> bool:
    # FSDP2 swaps each sharded module's class for a subclass of FSDPModule: public from torch 2.6,
    # under torch.distributed._composable.fsdp in 2.4 and 2.5.
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def copy_attr(a: object, b: object, include: tuple = (), exclude: tuple = ()) -> None:
    """Copy plain attributes (not starting with ``_``) from ``b`` to ``a``, as ultralytics does."""
    for k, v in b.__dict__.items():
        if (include and k not in include) or k.startswith("_") or k in exclude:
            continue
        setattr(a, k, v)


class EMASchedule:
    """The decay ramp, the counters and the cached step's lifecycle, shared by ``ModelEMA`` and
    ``ShardedModelEMA``: each says only which module holds the EMA and how its step is built."""

    ema: nn.Module
    resolved_strategy: str
    _options: StepOptions
    _step_type: type[Step]  # what a new step is built as

    def _init_schedule(self, decay: float, tau: float, updates: int, strategy: str) -> None:
        install_hooks()  # torch's global registration hooks: on the first EMA made, once per process
        self.updates = updates
        self.max_decay = float(decay)
        self.tau = float(tau)
        self.strategy = strategy
        self.enabled = True
        self.rebuilds = 0  # how many times the cached step was (re)built
        self._step: Step | None = None

    def decay(self, n: int) -> float:
        """The decay used at update number ``n``: ramps from 0 to ``max_decay``, time constant tau."""
        return self.max_decay * (1 - math.exp(-n / self.tau))

    @property
    def modes(self) -> list[str]:
        """Each flat group's mode: ``fused``, ``cast``, ``cat``, ``foreach`` or ``cat+foreach``."""
        return [] if self._step is None else self._step.modes

    def _collect(self, model: nn.Module) -> Pairs:
        """The (EMA, model) pairs a new step is built over."""
        return collect_pairs(self.ema, model)

    def _current_step(self, model: nn.Module) -> Step:
        """The cached step if it still matches ``model`` and the EMA, else a new one (never a stale one)."""
        step = self._step
        if step is None or not step.current(model):
            self._step = None  # a failed rebuild must not leave the stale step behind
            step = self._step_type(self._collect(model), model, self._options)
            if not step.current(model):  # reads the model; only a model changed meanwhile fails here
                raise RuntimeError("the model changed while its EMA step was being built")
            self._step = step
            self.rebuilds += 1
        return step

    def update(self, model: nn.Module, decay: float | Tensor | None = None) -> None:
        """Move the EMA one step towards ``model`` (wrapped models are unwrapped).

        ``decay`` overrides the ramp for this step; with "flat" it may be a 0-dim tensor on the model's
        device: no host sync, no recompiles.
        """
        if not self.enabled:
            return
        tensor_ok = self._step_type.tensor_decay
        decay = self.decay(self.updates + 1) if decay is None else check_decay(decay, tensor_ok)
        self._current_step(unwrap_model(model)).apply(decay)
        self.updates += 1

    def __getstate__(self) -> dict:
        # The cached step holds weak references and module dicts: dropped, the next update() rebuilds it.
        return {**self.__dict__, "_step": None}


class ModelEMA(EMASchedule):
    """Exponential moving average of a model's weights, with the ramp ``decay * (1 - exp(-n / tau))``.

    Compatible with ``ultralytics.utils.torch_utils.ModelEMA``: ``.ema`` (a deep copy in eval mode,
    no grad), ``.updates``, ``.decay(n)``, ``.update(model)``, ``.update_attr(model)``, ``.enabled``.
    Unlike it, the (EMA, model) pairs are collected once into a step that is rebuilt when the model's
    or the EMA's tensors are replaced (``.to()``, ``.half()``, ``p.data = ...``, ``swap_tensors``, a new
    parameter), non-float entries are copied from the model, tied weights are averaged once, and a failed
    update changes nothing (:mod:`ema_lab.watch`). It holds no view of a module tensor, so torch's
    ``swap_tensors`` and ``set_swap_module_params_on_conversion(True)`` keep working.

    With "flat" (the default "auto" picks it for ordinary tensors) the EMA module's float tensors (and its
    integer counters) are views of one buffer per group: ``torch.save(ema.ema.state_dict())`` stores each
    buffer once, but saving a *subset* of the entries stores the whole buffer; clone the subset first.
    ``cat_max_numel``: model tensors under this many elements are gathered by ``torch.cat``.
    ``cuda_graph=True`` (EMA on one CUDA device, "auto" or "flat"): the update is recorded once in a CUDA
    graph and replayed: two launches (the weight, the replay) instead of one per kernel
    (:mod:`ema_lab.graph_step`).
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        tau: float = 2000,
        updates: int = 0,
        strategy: str = "auto",
        *,
        cat_max_numel: int = CAT_MAX_NUMEL,
        cuda_graph: bool = False,
    ) -> None:
        check_arguments(model, decay, tau, updates, strategy, STRATEGIES)
        if _is_fully_sharded(unwrap_model(model)):
            raise TypeError(
                "model is sharded with FSDP2 (fully_shard): a deep copy of it is not possible; "
                "use ema_lab.ShardedModelEMA, which keeps the EMA of the local shards"
            )
        self._init_schedule(decay, tau, updates, strategy)
        self.ema = deepcopy(unwrap_model(model)).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        floats = [t for t in (*self.ema.parameters(), *self.ema.buffers()) if t.is_floating_point()]
        self.resolved_strategy = resolve_strategy(strategy, floats)
        self._options = StepOptions(self.resolved_strategy, cat_max_numel)
        if cuda_graph and self.resolved_strategy != "flat":
            raise ValueError(
                f"cuda_graph=True records the 'flat' step; strategy {strategy!r} runs "
                f"{self.resolved_strategy!r} for this model"
            )
        if cuda_graph:
            GraphStep.check_devices([*self.ema.parameters(), *self.ema.buffers()])
        self.cuda_graph = cuda_graph
        self._step_type = GraphStep if cuda_graph else STEPS[self.resolved_strategy]

    def update_attr(
        self, model: nn.Module, include: tuple = (), exclude: tuple = ("process_group", "reducer")
    ) -> None:
        """Copy the model's plain attributes to the EMA module (names, strides, ...)."""
        if self.enabled:
            copy_attr(self.ema, model, include, exclude)

    def __repr__(self) -> str:
        return (
            f"ModelEMA(decay={self.max_decay}, tau={self.tau}, updates={self.updates}, "
            f"strategy={self.strategy!r}, cuda_graph={self.cuda_graph})"
        )
