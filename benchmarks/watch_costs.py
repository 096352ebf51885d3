"""What the default step's staleness watch costs per update, per slot and against the issue's budget.

    PYTHONPATH=. python benchmarks/watch_costs.py [--models yolo resnet50 gpt2 tiny_tensors] [--rounds 21]
        [--baseline FOLDER]

For each model, at 1 thread:

- interleaved (:func:`ema_lab.bench.timing.time_candidates`): the default ``ModelEMA`` update; the same update
  with the EMA's own slots left unchecked (an instrument, not a mode: its watch lists only the model's slots),
  so their difference is what checking the EMA's slots costs inside an update; the watch alone
  (``step.watch.current(model)``: one ``data_ptr()`` per watched slot); and the budget unit, one plain
  pointer read per float tensor of the model, ``list(map(Tensor.data_ptr, tensors)) == saved``;
- with ``--baseline FOLDER`` (another version's core package, as ``benchmarks/peers.py`` takes it), that
  version's default update too, in the same rounds;
- cold: the watch and the budget unit each timed right after a pass over 32 MiB of other memory, as they run
  in training, where the forward and backward passes have left nothing of the EMA in the caches.

It prints the watched slots (the EMA's, the model's), the times, and the cost per EMA slot warm, cold and
inside the update.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from peers import load_package
from torch import Tensor

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.bench.timing import time_candidates

FLUSH_BYTES = 32 << 20  # beyond the last-level cache of the CPUs these runs use (8-32 MiB)


def cold_seconds(fn: Callable[[], object], repeats: int = 101) -> float:
    """Median time of ``fn()`` right after a pass over ``FLUSH_BYTES`` of other memory."""
    other = torch.zeros(FLUSH_BYTES // 4)
    times = []
    for _ in range(repeats):
        other.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def with_ema_unchecked(model: torch.nn.Module) -> ModelEMA:
    """A default ``ModelEMA`` whose watch checks only the model's slots (for measuring, never for use)."""
    ema = ModelEMA(model)
    ema.update(model)
    watch = ema._step.watch
    own = {id(t) for e in ema.emas for m in e.modules() for t in (m._parameters, m._buffers)}
    kept = [(d, k) for d, k in zip(watch.dicts, watch.keys) if id(d) not in own]
    watch.dicts, watch.keys = (tuple(x) for x in zip(*kept)) if kept else ((), ())
    watch.ptrs = watch.data_ptrs()
    return ema


def costs(name: str, rounds: int, baseline: ModuleType | None = None) -> str:
    """One Markdown row for ``name``."""
    model = models.build(name)
    ema = ModelEMA(model)
    for _ in range(2):
        ema.update(model)
    unchecked = with_ema_unchecked(model)
    step = ema._step  # the cached step: its watch is this study's subject
    floats = [t.detach() for t in model.state_dict().values() if t.is_floating_point()]
    saved = list(map(Tensor.data_ptr, floats))
    fns = {
        "update": lambda: ema.update(model),
        "unchecked": lambda: unchecked.update(model),
        "watch": lambda: step.watch.current(model),
        "budget": lambda: list(map(Tensor.data_ptr, floats)) == saved,
    }
    if baseline is not None:
        old = baseline.ModelEMA(model)
        old.update(model)
        fns["baseline"] = lambda: old.update(model)
    ms = {k: r.median_s * 1e3 for k, r in time_candidates(fns, rounds=rounds).items()}
    cold = {k: cold_seconds(fns[k]) * 1e3 for k in ("watch", "budget")}
    slots = len(step.watch.keys)
    own = sum(len(e.state_dict()) for e in ema.emas)
    ns = {  # per EMA slot, or per float tensor for the budget
        "warm": ms["watch"] / slots * 1e6,
        "cold": cold["watch"] / slots * 1e6,
        "in update": (ms["update"] - ms["unchecked"]) / own * 1e6,
        "budget": ms["budget"] / len(floats) * 1e6,
        "budget cold": cold["budget"] / len(floats) * 1e6,
    }
    cells = [name, len(floats), f"{own} + {slots - own}", *(f"{ms[k]:.3f}" for k in ("update", "unchecked"))]
    cells += [f"{ms['watch']:.3f}", f"{cold['watch']:.3f}", *(f"{v:.0f}" for v in ns.values())]
    cells.append(f"{(ms['update'] - ms['unchecked']) / ms['update']:.0%}")
    cells += [f"{ms['baseline']:.3f}"] if baseline is not None else []
    return "| " + " | ".join(map(str, cells)) + " |"


HEAD = [
    "model",
    "float tensors",
    "watched slots (EMA + model)",
    "update ms",
    "update, EMA slots unchecked ms",
    "watch ms (warm)",
    "watch ms (cold)",
    "ns per slot, warm",
    "cold",
    "ns per EMA slot inside the update",
    "budget ns per tensor, warm",
    "cold",
    "EMA check / update",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["yolo", "resnet50", "gpt2", "tiny_tensors"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--baseline", type=Path, help="folder of another version's core package")
    args = parser.parse_args()
    baseline = load_package(args.baseline.resolve()) if args.baseline else None
    head = [*HEAD, "baseline's update ms"] if baseline else HEAD
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.rounds} interleaved rounds")
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for name in args.models:
        print(costs(name, args.rounds, baseline), flush=True)


if __name__ == "__main__":
    main()
