"""Profile a model's FLOPs with thop without letting thop touch it, and inspect what a call did to a model.

PyPI ``thop`` 0.1.1.post2209072238 (the release the float64 bug comes from) registers float64
``total_ops``/``total_params`` buffers on *every* module, removes them only from modules it has a
counting rule for, and has no try/finally. :func:`profile_flops` therefore profiles a deep copy, as
ultralytics PR #25315 did, and reports GFLOPs the way ultralytics does (``MACs / 1e9 * 2``).

:func:`compare_flop_counts` sets thop's count beside ``torch.utils.flop_counter.FlopCounterMode``'s
(``docs/flop_counters.md``); :func:`remove_thop_buffers` takes thop's leftovers off a model profiled in
place; :func:`check_movable` refuses a move to MPS (no float64 there) before any tensor moves.
"""

from __future__ import annotations

import importlib
import warnings
from collections import Counter
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor, nn

__all__ = ["THOP_BUFFERS", "import_thop", "profile_flops", "compare_flop_counts", "remove_thop_buffers"]
__all__ += ["check_movable"]

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


def _thop_macs_by_type(root: nn.Module, layers: dict, total: float) -> dict[str, float]:
    """Attribute thop's per-layer MACs (``ret_layer_info``) to the leaf module types that produced them."""
    out: Counter[str] = Counter()

    def walk(module: nn.Module, tree: dict) -> None:
        for name, (ops, _params, sub) in tree.items():
            child = module.get_submodule(name)
            if sub:
                walk(child, sub)
            else:
                out[type(child).__name__] += ops

    walk(root, layers)
    rest = total - sum(out.values())
    if rest:  # a root with its own rule (e.g. a bare nn.Linear) has no children to walk
        out[type(root).__name__] += rest
    return dict(out)


def _thop_matmul_types(thop: ModuleType) -> frozenset[str]:
    """Module types thop counts with its conv/linear rules: the ops FlopCounterMode also counts."""
    # `thop.profile` is the function; the module holding the rule table sits in sys.modules.
    hooks = importlib.import_module("thop.profile").register_hooks
    rules = {thop.vision.basic_hooks.count_convNd, thop.vision.basic_hooks.count_linear}
    return frozenset(t.__name__ for t, fn in hooks.items() if fn in rules)


@dataclass(frozen=True)
class FlopComparison:
    """One forward counted twice: thop (module hooks, x2) and ``torch.utils.flop_counter.FlopCounterMode``."""

    thop_flops: int  # 2 x thop's MACs
    counter_flops: int  # FlopCounterMode's total
    thop_by_type: dict[str, int]  # 2 x MACs per leaf module type, thop's view
    counter_by_op: dict[str, int]  # FLOPs per aten op, FlopCounterMode's view
    matmul_types: frozenset[str] = field(repr=False)

    @property
    def thop_matmul_flops(self) -> int:
        """thop's count for conv and linear layers only, the ops FlopCounterMode has formulas for."""
        return sum(v for k, v in self.thop_by_type.items() if k in self.matmul_types)

    @property
    def thop_only(self) -> dict[str, int]:
        """Non-zero thop counts for module types that are not conv/linear (BatchNorm, pooling, upsample)."""
        return {k: v for k, v in self.thop_by_type.items() if k not in self.matmul_types and v}

    @property
    def matmuls_agree(self) -> bool:
        """True when thop's conv/linear part equals FlopCounterMode's total exactly."""
        return self.thop_matmul_flops == self.counter_flops

    def explain(self) -> str:
        """A few lines saying where the two counts agree and why they differ."""
        ops = ", ".join(f"{k} {v:,}" for k, v in self.counter_by_op.items()) or "nothing"
        extra = ", ".join(f"{k} {v:,}" for k, v in self.thop_only.items()) or "nothing"
        lines = [
            f"thop (2 x MACs):  {self.thop_flops:>14,} FLOPs",
            f"FlopCounterMode:  {self.counter_flops:>14,} FLOPs ({ops})",
            f"thop conv/linear: {self.thop_matmul_flops:>14,} FLOPs -> "
            + ("equal to FlopCounterMode" if self.matmuls_agree else "NOT equal to FlopCounterMode"),
            f"thop only:        {extra} (FlopCounterMode has no formula for these ops)",
        ]
        if not self.matmuls_agree:
            lines.append(
                "the matmul parts differ: thop skips modules without a rule (attention, embeddings, "
                "functional calls) and FlopCounterMode skips fused kernels it has no formula for"
            )
        return "\n".join(lines)


def compare_flop_counts(model: nn.Module, inputs: Inputs) -> FlopComparison:
    """Count one eval-mode forward with thop and with ``FlopCounterMode``, each on its own deep copy."""
    from torch.utils.flop_counter import FlopCounterMode

    thop = import_thop()
    copy, args = _private_copy(model, inputs)
    macs, _params, layers = thop.profile(copy, inputs=args, verbose=False, ret_layer_info=True)
    by_type = {k: round(2 * v) for k, v in _thop_macs_by_type(copy, layers, macs).items()}

    copy, args = _private_copy(model, inputs)
    copy.eval()  # thop profiles in eval mode; count the same computation
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        copy(*args)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return FlopComparison(
        thop_flops=round(2 * macs),
        counter_flops=int(counter.get_total_flops()),
        thop_by_type=by_type,
        counter_by_op=by_op,
        matmul_types=_thop_matmul_types(thop),
    )


# --- What thop leaves behind, and where it cannot go ------------------------------------------------------


def remove_thop_buffers(model: nn.Module) -> list[str]:
    """Delete thop's ``total_ops``/``total_params`` buffers from every module; return the keys removed."""
    removed = []
    for path, mod in model.named_modules():
        for name in THOP_BUFFERS:
            if name in mod._buffers:
                del mod._buffers[name]
                removed.append(f"{path}.{name}" if path else name)
    return removed


def check_movable(model: nn.Module, device: str | torch.device) -> None:
    """Raise ``ValueError`` before any tensor moves if ``model`` cannot go to ``device`` (float64 on MPS)."""
    if torch.device(device).type != "mps":
        return
    bad = [
        f"{path}.{name}" if path else name
        for path, mod in model.named_modules(remove_duplicate=False)
        for name, t in (*mod._parameters.items(), *mod._buffers.items())  # persistent or not: all move
        if t is not None and t.dtype == torch.float64
    ]
    if bad:
        leaked = [k for k in bad if k.rsplit(".", 1)[-1] in THOP_BUFFERS]
        hint = (
            f"; {len(leaked)} of them are thop's total_ops/total_params buffers left by an in-place "
            "thop.profile: profile a deep copy (profile_flops) or call remove_thop_buffers (both in "
            "ema_lab.lessons.profiling)"
            if leaked
            else "; cast them with .float() first"
        )
        shown = ", ".join(bad[:5]) + (f", ... ({len(bad) - 5} more)" if len(bad) > 5 else "")
        raise ValueError(
            f"cannot move {type(model).__name__} to {str(device)!r}: MPS has no float64 and "
            f"{len(bad)} entries are float64 ({shown}){hint}"
        )
