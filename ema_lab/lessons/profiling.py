"""Profile a model's FLOPs with thop without letting thop touch it.

PyPI ``thop`` 0.1.1.post2209072238 (the release the float64 bug comes from) registers float64
``total_ops``/``total_params`` buffers on *every* module, removes them only from modules it has a
counting rule for, and has no try/finally. :func:`profile_flops` therefore profiles a deep copy, as
ultralytics PR #25315 did, and reports GFLOPs the way ultralytics does (``MACs / 1e9 * 2``).

``benchmarks/flop_counters.py`` sets thop's count beside ``torch.utils.flop_counter.FlopCounterMode``'s
(``docs/flop_counters.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from copy import deepcopy
from types import ModuleType

from torch import Tensor, nn

__all__ = ["THOP_BUFFERS", "import_thop", "profile_flops"]

#: The buffer names thop registers on every module it profiles.
THOP_BUFFERS = ("total_ops", "total_params")

Inputs = Tensor | Sequence[object]


def import_thop() -> ModuleType:
    """Import ``thop`` (optional until needed), silencing its ``distutils`` deprecation warning."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import thop
    except ImportError as e:
        raise ImportError(
            "profiling needs thop: pip install thop==0.1.1.post2209072238 "
            "(or ultralytics-thop, never both: they ship the same `thop` package)"
        ) from e
    return thop


def _as_tuple(inputs: Inputs) -> tuple[object, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def _private_copy(model: nn.Module, inputs: Inputs) -> tuple[nn.Module, tuple[object, ...]]:
    """Deep copies of the model and inputs: an in-place first op must not write into the caller's input."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        return deepcopy(model), deepcopy(_as_tuple(inputs))
    except Exception as e:  # deepcopy failures are arbitrary (non-leaf tensors, locks, C handles)
        raise TypeError(
            f"cannot profile {type(model).__name__}: it (or its inputs) cannot be deep-copied ({e}); "
            "profiling it in place would leave thop's float64 buffers on it"
        ) from e


def profile_flops(model: nn.Module, inputs: Inputs) -> tuple[float, int]:
    """Return (GFLOPs, parameters) as thop counts them, profiling a deep copy so ``model`` is untouched.

    GFLOPs are ultralytics' ``thop.profile(...)[0] / 1e9 * 2`` (thop counts multiply-accumulates).
    The parameter count is thop's too: only modules with a thop rule count, so it can be lower than
    ``sum(p.numel() for p in model.parameters())``. If the forward raises, the exception propagates
    and the caller's model is still untouched (only the copy carries thop's leftovers). Forward hooks
    the caller registered are copied with the model and do run during the profiled forward.
    """
    thop = import_thop()
    copy, args = _private_copy(model, inputs)
    macs, params = thop.profile(copy, inputs=args, verbose=False)
    return macs / 1e9 * 2, int(params)


# --- Cross-check with torch's own counter --------------------------------------------------------------
