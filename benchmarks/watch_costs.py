"""What the default step's staleness watch costs per update, per slot and against the issue's budget.

    PYTHONPATH=. python benchmarks/watch_costs.py [--models yolo resnet50 gpt2 tiny_tensors] [--rounds 21]

For each model, interleaved (:func:`ema_lab.bench.timing.time_candidates`, 1 thread): the default
``ModelEMA`` update, its watch alone (``step.watch.current(model)``: one ``data_ptr()`` per watched slot),
and the budget unit: ``list(map(Tensor.data_ptr, tensors)) == saved`` over the model's float tensors, one
plain pointer read each. It prints the watched slots (the EMA's, the model's), each time, the watch's time per
slot and its share of the update, and the watch over the budget unit.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.bench.timing import time_candidates


def costs(name: str, rounds: int) -> str:
    """One Markdown row for ``name``."""
    model = models.build(name)
    ema = ModelEMA(model)
    for _ in range(2):
        ema.update(model)
    step = ema._step  # the cached step: its watch is this study's subject
    floats = [t.detach() for t in model.state_dict().values() if t.is_floating_point()]
    saved = list(map(Tensor.data_ptr, floats))
    times = time_candidates(
        {
            "update": lambda: ema.update(model),
            "watch": lambda: step.watch.current(model),
            "budget": lambda: list(map(Tensor.data_ptr, floats)) == saved,
        },
        rounds=rounds,
    )
    ms = {k: r.median_s * 1e3 for k, r in times.items()}
    slots = len(step.watch.keys)
    own = sum(len(e.state_dict()) for e in ema.emas)
    return (
        f"| {name} | {len(floats)} | {own} + {slots - own} | {ms['update']:.3f} | {ms['watch']:.3f} | "
        f"{ms['watch'] / slots * 1e6:.0f} | {ms['watch'] / ms['update']:.0%} | "
        f"{ms['watch'] / ms['budget']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["yolo", "resnet50", "gpt2", "tiny_tensors"])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.rounds} interleaved rounds")
    head = ["model", "float tensors", "watched slots (EMA + model)", "update ms", "watch ms", "ns per slot"]
    print("| " + " | ".join([*head, "watch / update", "watch / budget"]) + " |")
    print("|---" * 8 + "|")
    for name in args.models:
        print(costs(name, args.rounds), flush=True)


if __name__ == "__main__":
    main()
