"""What each trainer's EMA costs per update beside ema_lab's, side by side in one process, CPU, 1 thread.

    PYTHONPATH=. python benchmarks/trainer_emas.py [--models test_resnet resnet18] [--rounds 15] [--out]

Needs the trainers extra (``nox -s trainers`` builds a venv with it: ``.nox/trainers/bin/python``). For
each timm model (no pretrained weights), interleaved by :func:`ema_lab.bench.timing.time_candidates`:

- timm: ``ModelEmaV3.update(model, step=n)``, timm's class and ``ema_lab.trainers.timm``'s;
- Lightning: the ``on_train_batch_end`` hook (where each callback updates) of ``EMAWeightAveraging`` and of
  ``ema_lab.trainers.lightning.EMACallback``, the global step advanced before each call;
- accelerate and plain DDP have no EMA of their own: torch's ``AveragedModel`` with
  ``get_ema_multi_avg_fn`` (its foreach EMA) beside ``ema_lab.ModelEMA.update``, the recipes' call.

The figure is the median time per call over the rounds (with its interquartile range) and its ratio to
ema_lab's. ``--out`` writes
``trainer-emas-<date>.json`` and ``.md`` into FOLDER, by default ``docs/results/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import lightning.pytorch as pl
import timm
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from result_homes import add_study_out, write_study
from timm.utils.model_ema import ModelEmaV3 as TimmEmaV3
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ema_lab import ModelEMA
from ema_lab.bench.timing import time_candidates
from ema_lab.schedules import constant
from ema_lab.trainers.lightning import EMACallback
from ema_lab.trainers.timm import ModelEmaV3

DECAY = 0.999


class Wrapped(pl.LightningModule):
    """The timm model as a LightningModule, as a Lightning user holds it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def hook(callback: pl.Callback, module: pl.LightningModule) -> callable:
    """One ``on_train_batch_end`` call after one more optimizer step, as the Trainer makes it."""
    trainer = SimpleNamespace(global_step=0)
    callback.setup(trainer, module, "fit")  # where EMAWeightAveraging makes its EMA
    callback.on_fit_start(trainer, module)  # where EMACallback makes its EMA

    def call() -> None:
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, None, 0)

    return call


def candidates(name: str) -> dict[str, dict[str, callable]]:
    """Per trainer: its own EMA's update and ema_lab's, on fresh copies of one model."""
    torch.manual_seed(0)
    model = timm.create_model(name)
    theirs, ours = TimmEmaV3(model, decay=DECAY), ModelEmaV3(model, decay=DECAY)
    module = Wrapped(model)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    ema = ModelEMA(model, decay=constant(DECAY))
    return {
        "timm": {
            "timm ModelEmaV3.update": lambda: theirs.update(model, step=1000),
            "ema_lab.trainers.timm.ModelEmaV3.update": lambda: ours.update(model, step=1000),
        },
        "Lightning": {
            "EMAWeightAveraging.on_train_batch_end": hook(EMAWeightAveraging(decay=DECAY), module),
            "ema_lab EMACallback.on_train_batch_end": hook(EMACallback(decay=constant(DECAY)), module),
        },
        "accelerate / DDP": {
            "torch AveragedModel.update_parameters": lambda: averaged.update_parameters(model),
            "ema_lab ModelEMA.update": lambda: ema.update(model),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Time each trainer's pair per model; print a table; with --out write the record."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["test_resnet", "resnet18"])
    parser.add_argument("--rounds", type=int, default=15)
    add_study_out(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        trainers = candidates(name)
        flat = {f"{t}: {k}": fn for t, pair in trainers.items() for k, fn in pair.items()}
        timed = time_candidates(flat, rounds=args.rounds, threads=1)
        for trainer, pair in trainers.items():
            theirs, ours = (timed[f"{trainer}: {k}"] for k in pair)
            rows.append(
                {
                    "model": name,
                    "weights": sum(p.numel() for p in timm.create_model(name).parameters()),
                    "trainer": trainer,
                    "trainer_ema": theirs.name.split(": ", 1)[1],
                    "trainer_ms": 1e3 * theirs.median_s,
                    "trainer_iqr_ms": 1e3 * theirs.iqr_s,
                    "ema_lab": ours.name.split(": ", 1)[1],
                    "ema_lab_ms": 1e3 * ours.median_s,
                    "ema_lab_iqr_ms": 1e3 * ours.iqr_s,
                    "ratio": theirs.median_s / ours.median_s,
                    "threads": 1,
                    "rounds": args.rounds,
                }
            )
    table = "\n".join(
        [
            "| model (weights) | trainer | trainer's EMA | ms (IQR) | ema_lab | ms (IQR) | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        + [
            f"| {r['model']} ({r['weights'] / 1e6:.2f} M) | {r['trainer']} | {r['trainer_ema']} "
            f"| {r['trainer_ms']:.3f} ({r['trainer_iqr_ms']:.3f}) | {r['ema_lab']} "
            f"| {r['ema_lab_ms']:.3f} ({r['ema_lab_iqr_ms']:.3f}) | {r['ratio']:.2f}x |"
            for r in rows
        ]
    )
    versions = f"timm {timm.__version__}, lightning {pl.__version__}, torch {torch.__version__}"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"CPU, 1 thread, median ms per call over {args.rounds} interleaved rounds; {versions}; load {load}")
    print(table)
    if args.out:
        command = " ".join(["benchmarks/trainer_emas.py", *(sys.argv[1:] if argv is None else argv)])
        write_study(
            args.out,
            "trainer-emas",
            f"Each trainer's EMA beside ema_lab's, per update ({versions}; load average {load})",
            command,
            rows,
            table,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
