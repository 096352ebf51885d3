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
from numbers import Real

import torch
from torch import Tensor, nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .gates import foreach_lerp_supported
from .pairs import Pairs
from .step import Counters, StepOptions, Watch

__all__ = ["loop_update", "foreach_update", "gated_update", "prepare", "check_decay", "validate_pairs"]
__all__ += ["ListStep"]

Update = Callable[[float], None]
Tensors = Sequence[Tensor]
Names = Sequence[str] | None


def _label(i: int, names: Names) -> str:
    return f"entry {i} ({names[i]!r})" if names is not None else f"entry {i}"


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, {t.dtype}, {t.device}"


def check_decay(decay: float | Tensor, tensor_ok: bool = False) -> float | Tensor:
    """The one decay rule: a finite real number in [0, 1] (returned as a float) or, where ``tensor_ok``,
    a 0-dim floating tensor (returned as is: checking its value would sync the host with its device)."""
    if isinstance(decay, Tensor):
        if not tensor_ok:
            raise TypeError(
                "decay must be a Python number here (only update(model, decay=...) of an EMA whose step is "
                f"'flat' takes a 0-dim tensor), got a {type(decay).__name__}"
            )
        if decay.dim() != 0 or not decay.is_floating_point():
            raise ValueError(
                f"a tensor decay must be a 0-dim floating tensor, got {tuple(decay.shape)} {decay.dtype}"
            )
        return decay
    if not (isinstance(decay, Real) and not isinstance(decay, bool) and 0.0 <= decay <= 1.0):
        raise ValueError(f"decay must be a finite number in [0, 1], got {decay!r}")
    return float(decay)


def validate_pairs(ema: Tensors, model: Tensors, names: Names = None, *, same_dtype: bool = False) -> None:
    """Raise ``ValueError`` naming the first bad pair; touch nothing.

    Checks: equal list lengths, tensors on both sides, floating dtypes, equal shapes and devices,
    equal dtypes when ``same_dtype``, and no EMA tensor listed twice (tied weights would be
    decayed twice per step).
    """
    if len(ema) != len(model):
        raise ValueError(f"got {len(ema)} EMA tensors but {len(model)} model tensors")
    if names is not None and len(names) != len(ema):
        raise ValueError(f"got {len(names)} names for {len(ema)} tensor pairs")
    seen: dict[int, int] = {}
    for i, (e, m) in enumerate(zip(ema, model)):
        if not isinstance(e, Tensor) or not isinstance(m, Tensor):
            raise ValueError(
                f"{_label(i, names)}: expected two tensors, got {type(e).__name__} and {type(m).__name__}"
            )
        if not e.is_floating_point() or not m.is_floating_point():
            raise ValueError(
                f"{_label(i, names)}: EMA and model tensors must be floating point, "
                f"got EMA {e.dtype} and model {m.dtype}"
            )
        if e.shape != m.shape or e.device != m.device or (same_dtype and e.dtype != m.dtype):
            raise ValueError(f"{_label(i, names)}: EMA {_describe(e)} does not match model {_describe(m)}")
        if e.numel():
            ptr = e.data_ptr()
            if ptr in seen:
                raise ValueError(
                    f"{_label(i, names)} is the same memory as {_label(seen[ptr], names)} "
                    "(tied weights?): pass each EMA tensor once or it is decayed twice"
                )
            seen[ptr] = i


def _prepare_loop(ema: list[Tensor], model: list[Tensor]) -> Update:
    def step(d: float) -> None:
        with torch.no_grad():
            for v, m in zip(ema, model):
                v *= d
                v += (1 - d) * m.detach()

    return step


def lerp_(
    ema: list[Tensor], model: list[Tensor], weight: float | Tensor | list[Tensor], foreach: bool = True
) -> None:
    """``e += weight * (m - e)`` for every pair: one ``torch._foreach_lerp_``, or one ``lerp_`` per pair.

    ``weight``: a number, a 0-dim tensor, or (foreach only) one tensor shaped like each pair's."""
    if not foreach:
        for e, m in zip(ema, model):
            e.lerp_(m, weight)
    elif ema:  # _foreach_lerp_([], [], w) raises "Tensor list must have at least one tensor"
        # torch has no single-tensor-weight overload (to 2.13 at least): a 0-dim weight goes once per pair.
        torch._foreach_lerp_(ema, model, weight if isinstance(weight, (float, list)) else [weight] * len(ema))


def _prepare_foreach(ema: list[Tensor], model: list[Tensor]) -> Update:
    def step(d: float) -> None:
        with torch.no_grad():
            lerp_(ema, model, 1 - d)

    return step


def _prepare_gated(ema: list[Tensor], model: list[Tensor]) -> Update:
    same = [i for i, (v, m) in enumerate(zip(ema, model)) if v.dtype == m.dtype]
    mixed = [(v, m) for v, m in zip(ema, model) if v.dtype != m.dtype]
    groups = (
        _group_tensors_by_device_and_dtype([[ema[i] for i in same], [model[i] for i in same]]) if same else {}
    )
    runs = [
        (es, ms, foreach_lerp_supported(None, device.type)) for (device, _), ([es, ms], _) in groups.items()
    ]

    def step(d: float) -> None:
        w = 1.0 - d
        with torch.no_grad():
            for es, ms, foreach in runs:  # behind the gate (mps before 2.4, npu): per tensor
                lerp_(es, ms, w, foreach)
            # add_ computes in the promoted dtype and casts back, as the pre-change loop did.
            for v, m in mixed:
                v.mul_(d).add_(m, alpha=w)

    return step


#: strategy name -> (needs equal dtypes in every pair, builder of a step over validated lists); "flat" is
#: :class:`ema_lab.flat_step.FlatStep`, which owns its EMA buffers.
PREPARERS: dict[str, tuple[bool, Callable[[list[Tensor], list[Tensor]], Update]]] = {
    "loop": (False, _prepare_loop),
    "foreach": (True, _prepare_foreach),
    "gated": (False, _prepare_gated),
}


def prepare(strategy: str, ema_tensors: Tensors, model_tensors: Tensors, names: Names = None) -> Update:
    """Validate the pairs once and return ``step(decay)`` that applies ``strategy`` without re-checking."""
    if strategy not in PREPARERS:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(PREPARERS)}")
    same_dtype, build = PREPARERS[strategy]
    validate_pairs(ema_tensors, model_tensors, names, same_dtype=same_dtype)
    return build(list(ema_tensors), list(model_tensors))


def loop_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The pre-change update: per pair ``v *= d; v += (1 - d) * m`` (mul_, mul, add_), promoting dtypes."""
    prepare("loop", ema_tensors, model_tensors, names)(check_decay(decay))


def foreach_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The post-change fast path: one ``torch._foreach_lerp_(ema, model, 1 - d)`` call.

    Every pair must agree in dtype (``_foreach_lerp_`` raises otherwise, after updating the
    pairs before the bad one); this checks that first and raises ``ValueError`` instead.
    """
    prepare("foreach", ema_tensors, model_tensors, names)(check_decay(decay))


def gated_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The post-change update behind its gate, made robust (grouped, mixed dtypes, empty input)."""
    prepare("gated", ema_tensors, model_tensors, names)(check_decay(decay))


class ListStep:
    """``"loop"``, ``"foreach"`` or ``"gated"`` over detached aliases of the pairs, then the counters."""

    tensor_decay = False  # a 0-dim tensor decay needs the flat step
    in_place = True  # the EMA's tensors keep their storage (ShardedModelEMA's DTensors rely on it)
    recordable = False  # cuda_graph=True records the flat step
    modes: list[str] = []

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        ema, mod = [e.detach() for e in pairs.ema], [m.detach() for m in pairs.model]
        self.update = prepare(options.strategy, ema, mod, pairs.names)
        self.counters = Counters(pairs.ema_counters, pairs.model_counters)
        self.watch = Watch(model, pairs.ema_slots + pairs.model_slots, sharded=options.sharded)

    def intact(self, model: nn.Module) -> bool:
        """True while the model's and the EMA's slots hold the memory this step was built over."""
        return self.watch.current(model)

    def read(self) -> bool:
        """Nothing to gather: the update reads the model through its aliases."""
        return True

    def apply(self, decay: float) -> None:
        """One update of the EMA, then the counters."""
        self.update(decay)
        self.counters()
