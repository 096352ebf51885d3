"""The EMA update strategies, as pure functions over lists of (EMA, model) tensor pairs.

Every strategy computes ``ema = decay * ema + (1 - decay) * model`` for each pair, in place:

- :func:`loop_update`: the code before ultralytics PR #25315, one pair at a time
  (``v *= d; v += (1 - d) * m``: three dispatched ops and a temporary per tensor).
- :func:`foreach_update`: the code after it, one ``torch._foreach_lerp_`` call.
- :func:`gated_update`: the after-code behind its torch-version/device gate, made robust: one
  foreach call per (device, dtype) group, a per-tensor path for pairs whose dtypes differ.
- ``"flat"`` (:mod:`ema_lab.flat_step`): the EMA in one contiguous buffer per group, so the update
  approaches one ``lerp_`` per group (exactly one after :func:`ema_lab.flatten_model`).

All of them validate the whole input before touching any tensor, so a bad input raises a
``ValueError`` and leaves the EMA bit-for-bit unchanged. That matters because a failed
``torch._foreach_lerp_`` is not atomic: the pairs before the bad one are already updated.

:func:`prepare` splits the two halves: validate once, then apply many times. ``ModelEMA`` caches
the prepared step, a :class:`ListStep`, for as long as the tensors keep their memory (:mod:`ema_lab.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .checks import check_decay, validate_pairs, weight_of
from .gates import foreach_lerp_supported
from .pairs import Pairs
from .step import Counters, StepOptions, Watch, lerp_pairs

__all__ = ["loop_update", "foreach_update", "gated_update", "prepare", "ListStep", "LIST_STRATEGIES"]

#: A prepared update: ``update(decay, weight)`` with ``weight = 1 - decay`` (computed once, by the caller).
Update = Callable[[float, float], None]
Tensors = Sequence[Tensor]
Names = Sequence[str] | None


def _prepare_loop(ema: list[Tensor], model: list[Tensor]) -> Update:
    def update(d: float, w: float) -> None:
        for v, m in zip(ema, model):
            v *= d
            v += w * m.detach()

    return update


def _prepare_foreach(ema: list[Tensor], model: list[Tensor]) -> Update:
    def update(d: float, w: float) -> None:
        lerp_pairs(ema, model, w)

    return update


def _prepare_gated(ema: list[Tensor], model: list[Tensor]) -> Update:
    same = [i for i, (v, m) in enumerate(zip(ema, model)) if v.dtype == m.dtype]
    mixed = [(v, m) for v, m in zip(ema, model) if v.dtype != m.dtype]
    groups = (
        _group_tensors_by_device_and_dtype([[ema[i] for i in same], [model[i] for i in same]]) if same else {}
    )
    runs = [
        (es, ms, foreach_lerp_supported(None, device.type)) for (device, _), ([es, ms], _) in groups.items()
    ]

    def update(d: float, w: float) -> None:
        for es, ms, foreach in runs:  # behind the gate (mps before 2.4, npu): per tensor
            lerp_pairs(es, ms, w, foreach)
        # add_ computes in the promoted dtype and casts back, as the pre-change loop did.
        for v, m in mixed:
            v.mul_(d).add_(m, alpha=w)

    return update


@dataclass(frozen=True)
class ListStrategy:
    """A list strategy: whether every pair must share its dtype, and the builder of its update over
    validated lists."""

    same_dtype: bool
    build: Callable[[list[Tensor], list[Tensor]], Update]


#: The strategies over tensor lists; "flat" is :class:`ema_lab.flat_step.FlatStep`, which owns its buffers.
LIST_STRATEGIES = {
    "loop": ListStrategy(False, _prepare_loop),
    "foreach": ListStrategy(True, _prepare_foreach),
    "gated": ListStrategy(False, _prepare_gated),
}


def prepare(strategy: str, ema_tensors: Tensors, model_tensors: Tensors, names: Names = None) -> Update:
    """Validate the pairs once and return ``update(decay, weight)`` that applies ``strategy`` unchecked (call
    it under ``torch.no_grad()`` where a tensor requires grad)."""
    if strategy not in LIST_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(LIST_STRATEGIES)}")
    chosen = LIST_STRATEGIES[strategy]
    validate_pairs(ema_tensors, model_tensors, names, same_dtype=chosen.same_dtype)
    return chosen.build(list(ema_tensors), list(model_tensors))


def _run(strategy: str, ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names) -> None:
    decay = check_decay(decay)
    update = prepare(strategy, ema_tensors, model_tensors, names)
    with torch.no_grad():
        update(decay, weight_of(decay))


def loop_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The pre-change update: per pair ``v *= d; v += (1 - d) * m`` (mul_, mul, add_), promoting dtypes."""
    _run("loop", ema_tensors, model_tensors, decay, names)


def foreach_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The post-change fast path: one ``torch._foreach_lerp_(ema, model, 1 - d)`` call.

    Every pair must agree in dtype (``_foreach_lerp_`` raises otherwise, after updating the
    pairs before the bad one); this checks that first and raises ``ValueError`` instead.
    """
    _run("foreach", ema_tensors, model_tensors, decay, names)


def gated_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The post-change update behind its gate, made robust (grouped, mixed dtypes, empty input)."""
    _run("gated", ema_tensors, model_tensors, decay, names)


class ListStep:
    """``"loop"``, ``"foreach"`` or ``"gated"`` over detached aliases of the pairs, one update per EMA, then
    the counters."""

    tensor_decay = False  # a 0-dim tensor decay needs the flat step
    in_place = True  # the EMA's tensors keep their storage (ShardedModelEMA's DTensors rely on it)
    recordable = False  # cuda_graph=True records the flat step
    modes: list[str] = []

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        names, mod = [e.key for e in pairs.floats], [m.detach() for m in pairs.model_floats()]
        self.updates = [
            prepare(options.strategy, [e.detach() for e in pairs.ema_floats(k)], mod, names)
            for k in range(pairs.count)
        ]
        self.counters = Counters.of(pairs)
        self.watch = Watch(model, pairs.slots(), pairs.modules, sharded=options.sharded)

    def ready(self, model: nn.Module) -> bool:
        """True while the model's and the EMAs' slots hold the memory this step was built over (the update
        reads the model through its aliases: nothing to gather)."""
        return self.watch.current(model)

    def apply(self, decays: Sequence[float], weights: Sequence[float]) -> None:
        """One update of each EMA, then the counters."""
        for update, d, w in zip(self.updates, decays, weights):
            update(d, w)
        self.counters()
