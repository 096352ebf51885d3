"""The argument checks, one place for each rule: a one-line ``ValueError`` (``TypeError``: a wrong kind)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

from torch import Tensor

__all__ = ["is_int", "is_real", "require", "check_int", "check_gamma", "check_decay", "weight_of", "one_of"]
__all__ += ["validate_pairs"]


def is_int(x: object) -> bool:
    """True for an integer that is not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """True for a finite real number that is not a bool."""
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def require(ok: bool, name: str, value: object, what: str) -> None:
    """Raise ``ValueError("<name> must be <what>, got <value>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def check_int(name: str, value: object, least: int) -> None:
    """``value`` must be an int (not a bool) of at least ``least``."""
    require(is_int(value) and value >= least, name, value, f"an int >= {least}")


def check_gamma(name: str, gamma: object) -> None:
    """A power profile's exponent: a finite number >= 0."""
    require(is_real(gamma) and gamma >= 0, name, gamma, "a number >= 0")


def one_of(a: str, a_value: object, b: str, b_value: object) -> None:
    """Exactly one of two alternative arguments must be given (not None)."""
    if (a_value is None) == (b_value is None):
        raise ValueError(f"give one of {a} and {b}, got {a}={a_value!r}, {b}={b_value!r}")


def check_decay(decay: float | Tensor, tensor_ok: bool = False) -> float | Tensor:
    """The one decay rule: a number in [0, 1] (as a float) or, where ``tensor_ok``, a 0-dim float tensor."""
    if type(decay) is float and 0.0 <= decay <= 1.0:  # what every schedule gives, without the ABC check
        return decay
    if isinstance(decay, Tensor):
        if not tensor_ok:
            why = "only update(model, decay=...) of an EMA whose step is 'flat' takes a 0-dim tensor"
            raise TypeError(f"decay must be a Python number here ({why}), got a {type(decay).__name__}")
        if decay.dim() != 0 or not decay.is_floating_point():
            got = f"{decay.shape} {decay.dtype}"
            raise ValueError(f"a tensor decay must be a 0-dim floating tensor, got {got}")
        return decay  # its value unchecked: reading it would sync the host with its device
    # Inline, not is_real/require: every update runs it (tests/core/test_call_depth.py).
    if not (isinstance(decay, Real) and not isinstance(decay, bool) and 0.0 <= decay <= 1.0):
        raise ValueError(f"decay must be a finite number in [0, 1], got {decay!r}")
    return float(decay)


def weight_of(decay: float | Tensor) -> float | Tensor:
    """``1 - decay`` of a checked decay (a tensor's clamped to [0, 1], NaN as 0, on its device: no sync)."""
    if isinstance(decay, Tensor):
        return (1.0 - decay).nan_to_num_(0.0).clamp_(0.0, 1.0)
    return 1.0 - decay


def _label(i: int, names: Sequence[str] | None) -> str:
    return f"entry {i} ({names[i]!r})" if names is not None else f"entry {i}"


def validate_pairs(
    ema: Sequence[Tensor],
    model: Sequence[Tensor],
    names: Sequence[str] | None = None,
    *,
    same_dtype: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first bad pair, touching nothing (``same_dtype``: dtypes equal too)."""
    if len(ema) != len(model):
        raise ValueError(f"got {len(ema)} EMA tensors but {len(model)} model tensors")
    if names is not None and len(names) != len(ema):
        raise ValueError(f"got {len(names)} names for {len(ema)} tensor pairs")
    seen: dict[int, int] = {}
    for i, (e, m) in enumerate(zip(ema, model)):
        if not isinstance(e, Tensor) or not isinstance(m, Tensor):
            kinds = f"{type(e).__name__} and {type(m).__name__}"
            raise ValueError(f"{_label(i, names)}: expected two tensors, got {kinds}")
        if not e.is_floating_point() or not m.is_floating_point():
            dtypes = f"got EMA {e.dtype} and model {m.dtype}"
            raise ValueError(f"{_label(i, names)}: EMA and model tensors must be floating point, {dtypes}")
        if e.shape != m.shape or e.device != m.device or (same_dtype and e.dtype != m.dtype):
            mine, theirs = (f"shape {tuple(t.shape)}, {t.dtype}, {t.device}" for t in (e, m))
            raise ValueError(f"{_label(i, names)}: EMA {mine} does not match model {theirs}")
        if e.is_meta:  # every meta tensor's data_ptr() is 0: without this, "tied weights?" below
            raise ValueError(
                f"{_label(i, names)} is on the meta device (no values): build the EMA once the model's "
                "weights are materialized (model.to_empty(device=...), then load or initialize them)"
            )
        if e.numel():
            ptr = e.data_ptr()
            if ptr == m.data_ptr():  # e.g. one side loaded from the other's state_dict() with assign=True
                why = "the EMA would only follow it; give it a copy (load_state_dict without assign=True)"
                raise ValueError(f"{_label(i, names)}: the EMA's tensor is the model's own memory: {why}")
            if ptr in seen:
                why = "(tied weights?): pass each EMA tensor once or it is decayed twice"
                raise ValueError(f"{_label(i, names)} is the same memory as {_label(seen[ptr], names)} {why}")
            seen[ptr] = i
