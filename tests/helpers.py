"""Shared test helpers: an independent float64 EMA reference, and the scripts of benchmarks/ as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor


def float_entries(module: torch.nn.Module) -> dict[str, Tensor]:
    """The floating-point state_dict entries (what every EMA averages)."""
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def reference_step(ref: list[Tensor], model: list[Tensor], d: float) -> None:
    """One EMA step in float64, written independently of ema_lab: ref = d * ref + (1 - d) * model."""
    for i, m in enumerate(model):
        ref[i] = d * ref[i] + (1 - d) * m.detach().double()


def tolerance(dtype: torch.dtype, steps: int) -> float:
    """A per-element error bound for ``steps`` EMA steps of values of order 1 in ``dtype``."""
    eps = torch.finfo(dtype).eps
    return 4 * eps * (1 + steps) if dtype in (torch.float16, torch.bfloat16) else 8 * eps * (1 + steps)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, with ``benchmarks/`` on ``sys.path`` as when it runs (a script
    imports its sibling ``result_homes.py``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks")
_HOOK_DICTS += ("_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_HOOK_DICTS += ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks")
_HOOK_DICTS += ("_load_state_dict_post_hooks",)


def fingerprint(model: torch.nn.Module) -> dict[str, tuple]:
    """Everything a profiler could change on a module tree, per module path: type, training flag, hook
    ids, and each parameter and buffer (persistent or not) as (object id, a copy)."""
    out = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        tensors = {
            name: (id(t), t.detach().clone())
            for name, t in (*mod._parameters.items(), *mod._buffers.items())
            if t is not None
        }
        hooks = {d: tuple(map(id, getattr(mod, d).values())) for d in _HOOK_DICTS if getattr(mod, d, None)}
        out[path] = (type(mod).__name__, mod.training, hooks, tensors)
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and values, NaN equal to NaN."""
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two fingerprints, one line each, sorted; empty when nothing does."""
    out = [f"module added or removed: {p!r}" for p in before.keys() ^ after.keys()]
    for path in before.keys() & after.keys():
        (kind, training, hooks, tensors), (kind2, training2, hooks2, tensors2) = before[path], after[path]
        out += [f"module type changed: {path!r}"] * (kind != kind2)
        out += [f"training mode changed: {path!r}"] * (training != training2)
        out += [f"hooks changed: {path!r}"] * (hooks != hooks2)
        dot = f"{path}." if path else ""
        for name in tensors.keys() | tensors2.keys():
            if name not in tensors or name not in tensors2:
                out.append(f"tensor added or removed: {dot}{name}")
            elif tensors[name][0] != tensors2[name][0]:
                out.append(f"tensor object replaced: {dot}{name}")
            elif not _same(tensors[name][1], tensors2[name][1]):
                out.append(f"values changed: {dot}{name}")
    return sorted(out)
