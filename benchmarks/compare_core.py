"""The default ``ModelEMA`` of this checkout against another version's, side by side in one process.

Each zoo model gets three candidates, interleaved at one thread: the baseline's default ``ModelEMA``,
this checkout's, and this checkout's on the model after ``ema_lab.flatten_model`` (plus the floor: one
``lerp_`` over two flat buffers of the model's size). The baseline is another copy of the core package
under its own import name, e.g. the core before its redesign, exported with::

    mkdir -p /tmp/ema_lab_main/ema_lab_main
    base=daa5a08  # the last commit before the core redesign
    for f in $(git ls-tree --name-only $base ema_lab/ | grep 'py$'); do
        git show $base:$f > /tmp/ema_lab_main/ema_lab_main/$(basename $f); done
    python benchmarks/compare_core.py --baseline /tmp/ema_lab_main/ema_lab_main

Prints a markdown table of medians (us per update) and ratios. Times are the thread's CPU time
(``time.thread_time``), not wall time: on a machine shared with other jobs, wall time also counts the
time this process waited for a core, which no candidate controls.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

import ema_lab
from ema_lab.lessons import models


def load_package(path: Path) -> ModuleType:
    """Import the package folder ``path`` under its folder name (its relative imports intact)."""
    spec = importlib.util.spec_from_file_location(path.name, path / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.name] = module
    spec.loader.exec_module(module)
    return module


def candidates(name: str, baseline: ModuleType) -> dict[str, object]:
    """The four update calls for zoo model ``name``, each after one warm-up update."""
    model, flat = models.build(name), models.build(name)
    ema_lab.flatten_model(flat)
    old, new, fused = baseline.ModelEMA(model), ema_lab.ModelEMA(model), ema_lab.ModelEMA(flat)
    n = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
    (a,), (b,) = (ema_lab.flatten_tensors([torch.rand(n)]) for _ in range(2))  # memory as the EMA's
    out = {
        "baseline": lambda: old.update(model),
        "new": lambda: new.update(model),
        "flatten_model": lambda: fused.update(flat),
        "floor": lambda: a.lerp_(b, 1e-4),
    }
    for fn in out.values():
        fn()
    return out


def time_interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, target_s: float = 0.05
) -> dict[str, float]:
    """Median CPU seconds per call of each function, interleaved in a rotating order each round."""
    numbers = {}
    for k, fn in fns.items():
        start = time.thread_time()
        fn()
        numbers[k] = max(1, round(target_s / max(time.thread_time() - start, 1e-6)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            start = time.thread_time()
            for _ in range(numbers[k]):
                fns[k]()
            times[k].append((time.thread_time() - start) / numbers[k])
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="folder of the baseline's core package")
    parser.add_argument("--models", nargs="+", default=["yolo", "resnet50", "gpt2", "tiny_tensors"])
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = load_package(args.baseline.resolve())
    print(
        f"torch {torch.__version__}, 1 thread, {args.rounds} interleaved rounds, median CPU us per update\n"
    )
    print("| model | baseline | new | new/baseline | flatten_model | floor | flatten_model/floor |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        r = {k: v * 1e6 for k, v in time_interleaved(candidates(name, baseline), args.rounds).items()}
        print(
            f"| {name} | {r['baseline']:.0f} | {r['new']:.0f} | {r['new'] / r['baseline']:.3f} | "
            f"{r['flatten_model']:.0f} | {r['floor']:.0f} | {r['flatten_model'] / r['floor']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
