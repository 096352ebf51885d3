"""The update strategies as pure functions over lists of (EMA, model) tensor pairs, and their cached step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    return lambda d, w: lerp_pairs(ema, model, w)


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


LIST_STRATEGIES = {"loop": _prepare_loop, "foreach": _prepare_foreach, "gated": _prepare_gated}


def prepare(strategy: str, ema_tensors: Tensors, model_tensors: Tensors, names: Names = None) -> Update:
    """Validate the pairs once; return ``update(decay, weight)`` that applies ``strategy`` unchecked."""
    if strategy not in LIST_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(LIST_STRATEGIES)}")
    return _build(strategy, ema_tensors, model_tensors, names)


def _build(strategy: str, ema_tensors: Tensors, model_tensors: Tensors, names: Names) -> Update:
    # One _foreach_lerp_ takes pairs of one dtype; the others promote per pair.
    validate_pairs(ema_tensors, model_tensors, names, same_dtype=strategy == "foreach")
    return LIST_STRATEGIES[strategy](list(ema_tensors), list(model_tensors))


def _run(strategy: str, ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names) -> None:
    decay = check_decay(decay)
    update = prepare(strategy, ema_tensors, model_tensors, names)
    with torch.no_grad():
        update(decay, weight_of(decay))


def loop_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The pre-change update: per pair ``v *= d; v += (1 - d) * m`` (mul_, mul, add_), promoting dtypes."""
    _run("loop", ema_tensors, model_tensors, decay, names)


def foreach_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The post-change fast path: one ``torch._foreach_lerp_(ema, model, 1 - d)``; pairs of mixed dtypes
    are refused first (``_foreach_lerp_`` would raise after updating the pairs before the bad one)."""
    _run("foreach", ema_tensors, model_tensors, decay, names)


def gated_update(ema_tensors: Tensors, model_tensors: Tensors, decay: float, names: Names = None) -> None:
    """The post-change update behind its gate, made robust (grouped, mixed dtypes, empty input)."""
    _run("gated", ema_tensors, model_tensors, decay, names)


class ListStep:
    """``"loop"``, ``"foreach"`` or ``"gated"`` over detached aliases of the pairs, then the counters."""

    tensor_decay = False  # a 0-dim tensor decay needs the flat step
    in_place = True  # the EMA's tensors keep their storage (ShardedModelEMA's DTensors rely on it)
    recordable = False  # cuda_graph=True records the flat step
    modes: list[str] = []

    def __init__(self, pairs: Pairs, model: nn.Module, options: StepOptions) -> None:
        names, mod = [e.key for e in pairs.floats], [m.detach() for m in pairs.model_floats()]
        self.updates = [
            _build(options.strategy, [e.detach() for e in pairs.ema_floats(k)], mod, names)  # a known name
            for k in range(pairs.count)
        ]
        self.counters = Counters(pairs)
        self.watch = Watch(model, pairs.slots(), pairs.modules, sharded=pairs.sharded)

    def ready(self, model: nn.Module) -> bool:
        """True while every slot holds the memory this step was built over."""
        return self.watch.current(model)

    def apply(self, decays: Sequence[float], weights: Sequence[float]) -> None:
        """One update of each EMA, then the counters."""
        for update, d, w in zip(self.updates, decays, weights):
            update(d, w)
        self.counters()
