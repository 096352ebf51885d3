"""``ModelEMA``: a drop-in for ultralytics' class that keeps one cached step and nothing strategy-specific."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from copy import deepcopy
from operator import getitem

import torch
from torch import Tensor, nn

from .flat_step import FlatStep, Twin
from .graph_step import GraphStep
from .pairs import Pairs, collect_pairs, module_entries
from .posthoc import synthesize
from .schedules import decay_over, power
from .snapshots import check_folder, list_snapshots, load_snapshot, save_step
from .step import CAT_MAX_NUMEL, Step, StepOptions
from .updates import PREPARERS, ListStep, check_decay

__all__ = ["ModelEMA", "PostHocEMA", "BaseEMA", "STRATEGIES", "unwrap_model"]

#: Each strategy's step: the list strategies of :mod:`ema_lab.updates`, and "flat"; "auto"
#: (:func:`resolve_strategy`) picks one of them per model.
STEPS: dict[str, type[Step]] = {**dict.fromkeys(PREPARERS, ListStep), "flat": FlatStep}
STRATEGIES = (*STEPS, "auto")

#: A decay schedule: the update number n (1 for the first update) -> the decay of that update
#: (:mod:`ema_lab.schedules` has the peers' ones).
Schedule = Callable[[int], float]


def resolve_strategy(strategy: str, tensors: Sequence[Tensor], in_place: bool = False) -> str:
    """``"auto"``: "flat" (a superset of "gated"'s fast paths) unless a tensor cannot be a view of a flat
    buffer (sparse, meta or otherwise not strided) or the EMA's tensors must stay ``in_place``: "gated"."""
    if strategy != "auto":
        return strategy
    movable = all(t.layout == torch.strided and t.device.type != "meta" for t in tensors)
    return "flat" if movable and not in_place else "gated"


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


class BaseEMA:
    """The constructor, decay rule, counters and cached step's lifecycle of ``ModelEMA`` and
    ``ShardedModelEMA``: each says only how it holds the EMA (:meth:`_average_of`) and whether it is
    ``sharded``."""

    sharded = False  # ShardedModelEMA: the EMA stays in DTensor shards, so its step must update in place

    def __init__(
        self,
        model: nn.Module,
        decay: float | Schedule = 0.9999,
        tau: float = 2000,
        updates: int = 0,
        strategy: str = "auto",
        *,
        every: int = 1,
        cat_max_numel: int = CAT_MAX_NUMEL,
        cuda_graph: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(decay):
            check_decay(decay)
        if not (isinstance(tau, (int, float)) and tau > 0 and math.isfinite(tau)):
            raise ValueError(f"tau must be a positive number, got {tau!r}")
        for name, value, least, kind in (
            ("updates", updates, 0, "non-negative"),
            ("every", every, 1, "positive"),
        ):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ValueError(f"{name} must be a {kind} int, got {value!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if self.sharded and strategy != "auto" and not STEPS[strategy].in_place:
            raise ValueError(
                f"strategy {strategy!r} moves the EMA into new buffers; a sharded EMA keeps its DTensor "
                "shards in place: use 'auto', 'gated', 'foreach' or 'loop'"
            )
        if cuda_graph and self.sharded:
            raise ValueError("cuda_graph=True records one device's update; a sharded EMA cannot use it")
        self.ema = self._average_of(unwrap_model(model))
        floats = [t for t in (*self.ema.parameters(), *self.ema.buffers()) if t.is_floating_point()]
        self.resolved_strategy = resolve_strategy(strategy, floats, in_place=self.sharded)
        step_type = STEPS[self.resolved_strategy]
        if cuda_graph and not step_type.recordable:
            raise ValueError(
                f"cuda_graph=True records the 'flat' step; strategy {strategy!r} runs "
                f"{self.resolved_strategy!r} for this model"
            )
        if cuda_graph:
            GraphStep.check_devices([*self.ema.parameters(), *self.ema.buffers()])
            step_type = GraphStep
        self._step_type: type[Step] = step_type
        self._options = StepOptions(self.resolved_strategy, cat_max_numel, self.sharded)
        self._step: Step | None = None
        # A number is ultralytics' ramp (max_decay, tau); a callable is the schedule itself.
        self.schedule: Schedule | None = decay if callable(decay) else None
        self.max_decay = None if callable(decay) else float(decay)
        self.tau = float(tau)
        self.updates, self.every, self.strategy, self.cuda_graph = updates, every, strategy, cuda_graph
        self.enabled = True
        self.rebuilds = 0  # how many times the cached step was (re)built

    def _average_of(self, model: nn.Module) -> nn.Module:
        """The module that holds the EMA, made from the (unwrapped) model."""
        raise NotImplementedError

    def decay(self, n: int) -> float:
        """The decay of update number ``n``: ``max_decay * (1 - exp(-n / tau))``, or the schedule's."""
        if self.schedule is None:
            return self.max_decay * (1 - math.exp(-n / self.tau))
        d = self.schedule(n)
        try:
            return check_decay(d)
        except (TypeError, ValueError):
            raise ValueError(
                f"the schedule {self.schedule!r} gave decay {d!r} at update {n}, not a number in [0, 1]"
            ) from None

    @property
    def modes(self) -> list[str]:
        """Each flat group's mode: ``fused``, ``cast``, ``cat``, ``foreach`` or ``cat+foreach``."""
        return [] if self._step is None else self._step.modes

    def _collect(self, model: nn.Module) -> Pairs:
        """The (EMA, model) pairs a new step is built over."""
        return collect_pairs(self.ema, model)

    def _rebuild(self, model: nn.Module) -> Step:
        """A new step over ``model`` and the EMA, checked and read like a cached one (never a stale one)."""
        self._step = None  # a failed rebuild must not leave the stale step behind
        step = self._step_type(self._collect(model), model, self._options)
        if not (step.intact(model) and step.read()):  # only a model changed meanwhile fails here
            raise RuntimeError("the model changed while its EMA step was being built")
        self._step = step
        self.rebuilds += 1
        return step

    def update(self, model: nn.Module, decay: float | Tensor | None = None) -> None:
        """Move the EMA one step towards ``model`` (wrapped models are unwrapped).

        ``decay`` overrides the schedule for this step (with ``every=k``: for the k steps at once); with
        "flat" it may be a 0-dim tensor on the model's device: no host sync, no recompiles. With
        ``every=k`` only every k-th call updates, by the product of the k decays (the others only count).
        """
        if not self.enabled:
            return
        if decay is not None:
            decay = check_decay(decay, self._step_type.tensor_decay)
        n = self.updates + 1
        if n % self.every:
            self.updates = n
            return
        if decay is None:  # every == 1, the default, computes its decay here
            decay = self.decay(n) if self.every == 1 else decay_over(self.decay, n, self.every)
        model = unwrap_model(model)
        step = self._step
        if step is None or not step.intact(model) or not step.read():
            step = self._rebuild(model)
        step.apply(decay)
        self.updates = n

    def __getstate__(self) -> dict:
        # The cached step holds weak references and module dicts: dropped, the next update() rebuilds it.
        return {**self.__dict__, "_step": None}

    def __repr__(self) -> str:
        decay = self.schedule if self.schedule is not None else f"{self.max_decay}, tau={self.tau}"
        return (
            f"{type(self).__name__}(decay={decay}, updates={self.updates}, every={self.every}, "
            f"strategy={self.strategy!r}, cuda_graph={self.cuda_graph})"
        )


class ModelEMA(BaseEMA):
    """Exponential moving average of a model's weights, with the ramp ``decay * (1 - exp(-n / tau))``.

    Compatible with ``ultralytics.utils.torch_utils.ModelEMA``: ``.ema`` (a deep copy in eval mode,
    no grad), ``.updates``, ``.decay(n)``, ``.update(model)``, ``.update_attr(model)``, ``.enabled``.
    Unlike it, the (EMA, model) pairs are collected once into a step that is rebuilt when the model's
    or the EMA's tensors are replaced (``.to()``, ``.half()``, ``p.data = ...``, ``swap_tensors``, a new
    parameter), non-float entries are copied from the model, tied weights are averaged once, and a failed
    update changes nothing (:mod:`ema_lab.step`). It holds no view of a module tensor, so torch's
    ``swap_tensors`` and ``set_swap_module_params_on_conversion(True)`` keep working.

    ``decay``: a number in [0, 1] (ultralytics' ramp, with ``tau``) or a schedule, a callable of the update
    number returning the decay (:mod:`ema_lab.schedules`). ``every=k``: update on every k-th call only.
    With "flat" (the default "auto" picks it for ordinary tensors) the EMA module's float tensors (and its
    integer counters) are views of one buffer per group: ``torch.save(ema.ema.state_dict())`` stores each
    buffer once, but saving a *subset* of the entries stores the whole buffer; clone the subset first.
    ``cat_max_numel``: model tensors under this many elements are gathered by ``torch.cat``.
    ``cuda_graph=True`` (EMA on one CUDA device, "auto" or "flat"): the update is recorded once in a CUDA
    graph and replayed: two launches (the weight, the replay) instead of one per kernel
    (:mod:`ema_lab.graph_step`).
    """

    def _average_of(self, model: nn.Module) -> nn.Module:
        """A deep copy of ``model`` in eval mode, without grad."""
        if _is_fully_sharded(model):
            raise TypeError(
                "model is sharded with FSDP2 (fully_shard): a deep copy of it is not possible; "
                "use ema_lab.ShardedModelEMA, which keeps the EMA of the local shards"
            )
        ema = deepcopy(model).eval()
        for p in ema.parameters():
            p.requires_grad_(False)
        return ema

    def update_attr(
        self, model: nn.Module, include: tuple = (), exclude: tuple = ("process_group", "reducer")
    ) -> None:
        """Copy the model's plain attributes to the EMA module (names, strides, ...)."""
        if self.enabled:
            copy_attr(self.ema, model, include, exclude)


class PostHocEMA(ModelEMA):
    """Two power-function EMAs (Karras et al. 2024) of one model, both updated from one read of it, and their
    snapshots saved in ``folder`` every ``snapshot_every`` updates; :meth:`synthesize` then makes the EMA of
    any length ``sigma_rel`` after training (:mod:`ema_lab.posthoc`). ``.ema`` holds the first profile,
    ``.ema2`` the second, laid out like the first (its dtype follows the first's). ``updates=N`` resumes a
    run from its snapshots of update N; a snapshot is never written over.
    """

    def __init__(
        self,
        model: nn.Module,
        folder: str | os.PathLike,
        sigma_rels: tuple[float, float] = (0.05, 0.10),
        snapshot_every: int = 1000,
        updates: int = 0,
    ) -> None:
        if not (isinstance(sigma_rels, (tuple, list)) and len(sigma_rels) == 2):
            raise ValueError(f"sigma_rels must be two lengths, got {sigma_rels!r}")
        if not (
            isinstance(snapshot_every, int) and not isinstance(snapshot_every, bool) and snapshot_every > 0
        ):
            raise ValueError(f"snapshot_every must be a positive int, got {snapshot_every!r}")
        first, second = (power(sigma_rel=s) for s in sigma_rels)
        super().__init__(model, decay=first, updates=updates, strategy="flat")
        self.second = second
        self.ema2 = deepcopy(self.ema)
        for (_, slot), (_, (table, name)) in zip(module_entries(self.ema), module_entries(self.ema2)):
            if not getitem(*slot).is_floating_point():  # the counters: one tensor for both EMAs
                table[name] = getitem(*slot)
        self.folder, self.snapshot_every = check_folder(folder), snapshot_every  # a bad one fails here
        later = [s.step for s in list_snapshots(self.folder) if s.step > updates]
        if later:
            raise ValueError(
                f"{self.folder} holds snapshots up to update {max(later)}: resume with updates=<a saved "
                "update> or give an empty folder"
            )
        if updates:
            self._resume(updates)
        self._twin: Twin | None = None  # the second EMA laid out like the current step

    def _resume(self, step: int) -> None:
        """Load both EMAs from their snapshots of update ``step``."""
        saved = {s.gamma: s for s in list_snapshots(self.folder) if s.step == step}
        for ema, schedule in ((self.ema, self.schedule), (self.ema2, self.second)):
            if schedule.gamma not in saved:
                raise ValueError(
                    f"no snapshot of update {step} with gamma {schedule.gamma!r} in {self.folder}"
                )
            ema.load_state_dict(load_snapshot(saved[schedule.gamma]))

    def update(self, model: nn.Module) -> None:
        """Move both EMAs one step towards ``model``; every ``snapshot_every`` updates, save both."""
        if not self.enabled:
            return
        super().update(model)  # the first EMA: reads the model, lerps, copies the counters
        if self._twin is None or not self._twin.intact(self._step, self.ema2):
            self._twin = self._step.twin(self.ema2)
        self._twin.lerp(1.0 - self.second(self.updates))
        if self.updates % self.snapshot_every == 0:
            self.save()

    def save(self) -> None:
        """Write both EMAs' snapshots at the current update count (one step, complete or absent:
        ema_lab.snapshots)."""
        states = {self.schedule.gamma: self.ema.state_dict(), self.second.gamma: self.ema2.state_dict()}
        save_step(self.folder, self.updates, states)

    def synthesize(self, sigma_rel: float, step: int | None = None) -> dict[str, Tensor]:
        """The state_dict of the EMA of length ``sigma_rel`` at ``step`` (default: the last snapshot)."""
        return synthesize(self.folder, sigma_rel, step)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_twin": None}
