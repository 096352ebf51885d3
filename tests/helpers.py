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
