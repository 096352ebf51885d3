"""``ModelEMA``: a drop-in for ultralytics' class, a thin stateful wrapper over :mod:`ema_lab.updates`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from operator import getitem

import torch
from torch import Tensor, nn

from . import pairs as _pairs
from .flat import FlatStep, GroupPlan, Picker, StaleInputs, picker, prepare_counter_copy
from .pairs import ModulePairs, Slot, install_hooks, unwrap_model
from .updates import PREPARERS, Step, check_decay, prepare

__all__ = ["ModelEMA", "STRATEGIES"]

STRATEGIES = (*PREPARERS, "auto")
#: strategies that accept a 0-dim tensor decay (sync-free, compile-stable)
TENSOR_DECAY = ("flat", "flat_model")


def choose_strategy(ema_tensors: Sequence[Tensor], model_tensors: Sequence[Tensor]) -> str:
    """The "auto" rule: "flat" for dense strided tensors, else "gated".

    "flat" is never slower than "gated" in the bench: on a group of ordinary tensors it runs the
    same ``_foreach_lerp_`` (over views of one EMA buffer) with a cheaper staleness check; it gathers
    many tiny tensors with one ``torch.cat``; a bf16/fp16 model into an fp32 EMA is one cast-copy
    plus one ``lerp_`` per group instead of gated's per-tensor path; and a model flattened by
    ``"flat_model"`` (or :func:`ema_lab.flat.flatten_tensors`) is one ``lerp_`` per group. It never
    flattens the model itself: that stays opt-in. Sparse, meta or other non-strided tensors cannot
    be views of a flat buffer, so those go to "gated".
    """
    for t in (*ema_tensors, *model_tensors):
        if t.layout != torch.strided or t.device.type == "meta":
            return "gated"
    return "flat"


@dataclass
class _Prepared:
    """A cached step and what decides whether it is still valid for the model."""

    pairs: ModulePairs
    step: Step
    strategy: str
    watch: tuple[tuple[dict, ...], tuple[str, ...]]  # flat: (dicts, keys) of the model slots read per step
    check: Picker | None  # picks from what ``watch`` holds now the tensors whose data_ptr() must not move
    check_ptrs: list[int]
    copy_other: Callable[[], None]  # copies the non-float entries (BatchNorm's num_batches_tracked)

    def live(self, model: nn.Module) -> list[Tensor] | None:
        """What the watched model slots hold now (``[]`` for non-flat steps); None once the step is stale."""
        if not isinstance(self.step, FlatStep):
            return [] if self.pairs.is_current(model) else None
        if self.pairs.generation != _pairs._generation or self.pairs.model_ref() is not model:
            return None
        if not self.step.refs_unchanged():
            # A flat storage gained or lost a view: exact check; a live extra view is harmless.
            if not self.pairs.is_current(model):
                return None
            self.step.baseline()
        try:
            live = list(map(getitem, *self.watch))
            if self.check is not None and list(map(Tensor.data_ptr, self.check(live))) != self.check_ptrs:
                return None
        except (KeyError, AttributeError, TypeError):  # an entry was deleted or set to None
            return None
        return live

    def is_current(self, model: nn.Module) -> bool:
        """True while every tensor the step touches is still the module's memory."""
        return self.live(model) is not None

    def run(self, decay: float | Tensor, live: list[Tensor]) -> None:
        """One update of the EMA from ``live`` (see :meth:`live`), then the non-float entries."""
        if isinstance(self.step, FlatStep):
            self.step(decay, live)
        else:
            self.step(decay)
        self.copy_other()


def check_arguments(
    model: object, decay: float, tau: float, updates: int, strategy: str, strategies: Sequence[str]
) -> None:
    """Raise a clear TypeError/ValueError for a bad EMA constructor argument (shared with ShardedModelEMA)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(decay, (int, float)) and 0.0 < decay < 1.0):
        raise ValueError(f"decay must be in (0, 1), got {decay!r}")
    if not (isinstance(tau, (int, float)) and tau > 0 and math.isfinite(tau)):
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    if not (isinstance(updates, int) and updates >= 0):
        raise ValueError(f"updates must be a non-negative int, got {updates!r}")
    if strategy not in strategies:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {tuple(strategies)}")


def _is_fully_sharded(model: nn.Module) -> bool:
    # FSDP2 swaps each sharded module's class for a subclass of FSDPModule (torch >= 2.6 public path).
    try:
        from torch.distributed.fsdp import FSDPModule
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
    """The decay ramp and counters shared by :class:`ModelEMA` and ``ShardedModelEMA``."""

    def _init_schedule(self, decay: float, tau: float, updates: int, strategy: str) -> None:
        self.updates = updates
        self.max_decay = float(decay)
        self.tau = float(tau)
        self.strategy = strategy
        self.enabled = True

    def decay(self, n: int) -> float:
        """The decay used at update number ``n``: ramps from 0 to ``max_decay``, time constant tau."""
        return self.max_decay * (1 - math.exp(-n / self.tau))


class ModelEMA(EMASchedule):
    """Exponential moving average of a model's weights, with the ramp ``decay * (1 - exp(-n / tau))``.

    Compatible with ``ultralytics.utils.torch_utils.ModelEMA``: ``.ema`` (a deep copy in eval mode,
    no grad), ``.updates``, ``.decay(n)``, ``.update(model)``, ``.update_attr(model)``, ``.enabled``.
    Unlike it, the (EMA, model) tensor pairs are collected once and rebuilt when the model's or the
    EMA's tensors are replaced (``.to()``, ``.half()``, a new parameter), non-float entries are
    copied from the model, tied weights are averaged once, and a failed update changes nothing.

    Never in the way of torch's own tensor swaps: it holds no view of a module tensor, so
    ``torch.utils.swap_tensors`` and ``set_swap_module_params_on_conversion(True)`` work, and the EMA
    follows the swapped-in tensors (a rebuild, as after any replacement; none is needed for the 1-D
    tensors the flat strategies read live from the module slots, see :mod:`ema_lab.flat`).

    With the flat strategies (the default "auto" included) the EMA module's float tensors (and its
    integer counters) are views of one buffer per group (on a Linux CPU, from 2 MiB up, in huge pages
    where the kernel grants them: :func:`ema_lab.flat.empty_flat`): ``torch.save(ema.ema.state_dict())``
    stores each buffer once, but saving a *subset* of the entries stores the whole buffer they share;
    clone the subset first (``{k: v.clone() for k, v in ...}``) to save only what it holds.

    Public seams: :attr:`rebuilds`, :attr:`prepared_step`, :attr:`plan`, :attr:`modes`,
    :attr:`resolved_strategy`.

    Making the first one registers torch's global parameter/buffer/module registration hooks
    (:func:`ema_lab.pairs.install_hooks`, once per process); importing ema_lab registers nothing.
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
        if _is_fully_sharded(unwrap_model(model)):
            raise TypeError(
                "model is sharded with FSDP2 (fully_shard): a deep copy of it is not possible; "
                "use ema_lab.sharded.ShardedModelEMA, which keeps the EMA of the local shards"
            )
        install_hooks()  # torch's global registration hooks: first EMA made, once per process
        self.ema = deepcopy(unwrap_model(model)).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self._init_schedule(decay, tau, updates, strategy)
        self._state: _Prepared | None = None
        self._auto: str | None = None  # the cached "auto" choice
        self.rebuilds = 0  # how many times the cached pairs and step were (re)built

    @property
    def resolved_strategy(self) -> str:
        """The strategy actually run ("auto" resolved by :func:`choose_strategy`, chosen once and cached)."""
        if self.strategy != "auto":
            return self.strategy
        if self._auto is None:
            ts = [t for t in (*self.ema.parameters(), *self.ema.buffers()) if t.is_floating_point()]
            self._auto = choose_strategy(ts, ts)
        return self._auto

    @property
    def prepared_step(self) -> Step | None:
        """The cached update step (a :class:`ema_lab.flat.FlatStep` for the flat strategies), None before
        the first update and after pickling; call it with a decay to run one update of the EMA alone,
        unchecked, reading the model through the tensors it was built from (``update()`` reads the slots)."""
        return None if self._state is None else self._state.step

    @property
    def plan(self) -> tuple[GroupPlan, ...]:
        """Per flat group: mode and how many pairs take each path; ``()`` for other strategies or unbuilt."""
        step = self.prepared_step
        return step.plan if isinstance(step, FlatStep) else ()

    @property
    def modes(self) -> list[str]:
        """Each flat group's mode (``fused``, ``cast``, ``cat``, ``foreach``, ``cat+foreach``), in order."""
        return [g.mode for g in self.plan]

    def _build(self, model: nn.Module) -> _Prepared:
        """Collect the pairs, prepare the step and record what each update checks; cached in ``_state``."""
        self._state = None  # a failed rebuild must not leave the old (stale) step behind
        pairs = ModulePairs.collect(self.ema, model)
        if self.strategy == "auto" and self._auto is None:
            self._auto = choose_strategy(pairs.ema, pairs.model)
        strategy = self.resolved_strategy
        step = prepare(strategy, pairs.ema, pairs.model, pairs.names)
        watch: list[Slot] = []
        checked: list[int] = []
        copy_other = pairs.copy_other
        if isinstance(step, FlatStep):
            counter_fused = [False] * len(pairs.other_ema)
            if pairs.other_ema:  # the EMA's counters into one buffer too: one cat per step, not a foreach
                # flat_model flattens the model's counters as well: one copy_ and an O(1) check per group.
                counters = prepare_counter_copy(
                    pairs.other_ema, pairs.other_model, flatten_model=strategy == "flat_model"
                )
                step.watched += counters.buffers
                step.watched += [f for f in counters.model_flat if f is not None]
                counter_fused = counters.fused_pairs
                pairs.other_ema, pairs.other_model, copy_other = [], [], counters
            pairs.refresh()  # the EMA tensors (and with flat_model the model's) moved into flat buffers
            # Per step every model slot that is not a flat view is read (counters included). Its data_ptr()
            # is checked, which also sees torch.utils.swap_tensors and ``p.data = ...`` (an identity check
            # would not: the Parameter object stays), except for the slots the step reads live and
            # unchecked (FlatStep.live_pairs): what they hold now is what the step reads.
            floats = [i for i, f in enumerate(step.fused_pairs) if not f]
            watch = [pairs.model_slots[i] for i in floats]
            watch += [s for s, f in zip(pairs.other_slots[1::2], counter_fused) if not f]
            step.bind({i: k for k, i in enumerate(floats)}, len(watch))
            checked = [k for k, i in enumerate(floats) if i not in step.live_pairs]
            checked += range(len(floats), len(watch))
            # A reference held here to a tensor that is a view of a flat buffer would hide its
            # replacement from the reference count: drop them (model ones only when there are any).
            pairs.release_ema()
            if any(step.fused_pairs):
                pairs.model = []
            step.baseline()
        dicts, keys = (tuple(x) for x in zip(*watch)) if watch else ((), ())
        live = list(map(getitem, dicts, keys))
        check = picker(checked) if checked else None
        ptrs = list(map(Tensor.data_ptr, check(live))) if check else []
        state = _Prepared(pairs, step, strategy, (dicts, keys), check, ptrs, copy_other)
        self._state = state
        self.rebuilds += 1
        return state

    def update(self, model: nn.Module, decay: float | Tensor | None = None) -> None:
        """Move the EMA one step towards ``model`` (wrapped models are unwrapped).

        ``decay`` overrides the ramp for this step; with the flat strategies (and "auto" resolving to
        them) it may be a 0-dim tensor on the model's device: no host sync, no recompiles.
        """
        if not self.enabled:
            return
        if decay is None:
            decay = self.decay(self.updates + 1)
        elif isinstance(decay, Tensor):
            if self.resolved_strategy not in TENSOR_DECAY:
                raise TypeError(
                    f"a tensor decay needs one of the strategies {TENSOR_DECAY}, "
                    f"this ModelEMA runs {self.resolved_strategy!r}"
                )
        else:
            decay = check_decay(decay)
        model = unwrap_model(model)
        state = self._state
        live = None if state is None else state.live(model)
        if live is None:
            state = self._build(model)
            live = state.live(model)
        try:
            state.run(decay, live)
        except StaleInputs:  # a slot read live changed size, dtype or device; nothing was written
            state = self._build(model)
            state.run(decay, state.live(model))
        self.updates += 1

    def update_attr(
        self, model: nn.Module, include: tuple = (), exclude: tuple = ("process_group", "reducer")
    ) -> None:
        """Copy the model's plain attributes to the EMA module (names, strides, ...)."""
        if self.enabled:
            copy_attr(self.ema, model, include, exclude)

    def __getstate__(self) -> dict:
        # The cache holds weak references and module dicts: drop it, the next update() rebuilds it.
        state = self.__dict__.copy()
        state["_state"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"ModelEMA(decay={self.max_decay}, tau={self.tau}, updates={self.updates}, "
            f"strategy={self.strategy!r})"
        )
