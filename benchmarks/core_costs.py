"""What each EMA beyond the first costs in one step, and what a module built in the training loop costs.

    PYTHONPATH=. python benchmarks/core_costs.py [--models yolo resnet50 tiny_tensors] [--threads 1]
                                                 [--main DIR] [--rounds 15]

Two interleaved studies per model, each candidate on its own copy of the model (after two warm-up updates):

1. ``ModelEMA`` (the default), ``PostHocEMA`` with 2 and 4 profiles (one step, one read of the model), and
   the floor, one ``lerp_`` over two flat buffers of the EMA's size: each profile beyond the first costs
   about that floor, one more lerp over the first's targets (the "per extra profile / floor" column).
2. ``ModelEMA`` updated as it is, and with a loss holding a buffer (``BCEWithLogitsLoss(pos_weight=...)``)
   built before each update: the same time, as no module outside the model and its EMA costs a rebuild.

``--main DIR``: DIR holds another copy of the package named ``ema_lab_main`` (for instance
``git archive HEAD ema_lab | tar -x -C DIR && mv DIR/ema_lab DIR/ema_lab_main``, its imports are relative);
its default ``ModelEMA`` joins study 1 and, built-module variant, study 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections.abc import Callable
from copy import deepcopy

import torch
from torch import nn

from ema_lab import ModelEMA, PostHocEMA, flatten_tensors
from ema_lab.bench import models
from ema_lab.bench.timing import time_candidates

PROFILES = {2: (0.05, 0.10), 4: (0.05, 0.075, 0.10, 0.15)}


def warmed_updates(
    base: nn.Module, makers: dict[str, Callable], before: Callable[[], object] = lambda: None
) -> dict:
    """One update of each EMA on its own copy of ``base``, ``before()`` run first."""
    fns = {}
    for label, make in makers.items():
        model = deepcopy(base)
        ema = make(model)
        for _ in range(2):
            ema.update(model)
        fns[label] = lambda ema=ema, model=model: (before(), ema.update(model))
    return fns


def profile_costs(base: nn.Module, folder: str, main: object | None) -> dict[str, Callable]:
    """Study 1: one EMA, PostHocEMA with 2 and 4 profiles, the floor (and main's ModelEMA)."""
    makers: dict[str, Callable] = {"ModelEMA": ModelEMA}
    for k, sigma_rels in PROFILES.items():
        makers[f"PostHocEMA, {k} profiles"] = lambda m, s=sigma_rels, k=k: PostHocEMA(
            m, f"{folder}/{k}", sigma_rels=s, snapshot_every=10**9
        )
    if main is not None:
        makers["main: ModelEMA"] = main.ModelEMA
    return warmed_updates(base, makers) | floor(base)


def floor(base: nn.Module) -> dict[str, Callable]:
    """One ``lerp_`` over two flat buffers of the size of ``base``'s EMA (its float entries)."""
    n = sum(t.numel() for t in base.state_dict().values() if t.is_floating_point())
    (a,), (b,) = flatten_tensors([torch.rand(n)]), flatten_tensors([torch.rand(n)])
    return {"floor: one lerp_ of the EMA's size": lambda: a.lerp_(b, 1e-4)}


def built_module_costs(base: nn.Module, main: object | None) -> dict[str, Callable]:
    """Study 2: ModelEMA as it is, and with a loss holding a buffer built before each update."""

    def build_loss() -> nn.Module:
        return nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))

    fns = warmed_updates(base, {"ModelEMA": ModelEMA})
    fns |= warmed_updates(base, {"ModelEMA, a loss built each step": ModelEMA}, build_loss)
    if main is not None:
        fns |= warmed_updates(base, {"main: ModelEMA, a loss built each step": main.ModelEMA}, build_loss)
    return fns


def main(argv: list[str] | None = None) -> int:
    """Time both studies per model and thread count; print one table per study."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["yolo", "resnet50", "tiny_tensors"], choices=models.ZOO
    )
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--main", help="a folder holding another copy of the package as ema_lab_main")
    args = parser.parse_args(argv)
    if args.main:
        sys.path.insert(0, args.main)
    other = importlib.import_module("ema_lab_main") if args.main else None
    profiles = [
        "| model | threads | " + " | ".join(["candidate", "median ms (IQR)"]) + " |",
        "|---|---|---|---|",
    ]
    extra = ["| model | threads | per extra profile, 2 / 4 profiles (ms) | floor (ms) | ratio to floor |"]
    extra.append("|---|---|---|---|---|")
    built = [
        "| model | threads | candidate | median ms (IQR) | rebuilds in the run |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            base = models.build(name)
            for threads in args.threads:
                timed = time_candidates(
                    profile_costs(base, folder, other), rounds=args.rounds, threads=threads
                )
                ms = {k: 1e3 * t.median_s for k, t in timed.items()}
                profiles += [
                    f"| {name} | {threads} | {k} | {v:.3f} ({1e3 * timed[k].iqr_s:.3f}) |"
                    for k, v in ms.items()
                ]
                floor = ms["floor: one lerp_ of the EMA's size"]
                per = [(ms[f"PostHocEMA, {k} profiles"] - ms["ModelEMA"]) / (k - 1) for k in PROFILES]
                extra.append(
                    f"| {name} | {threads} | {per[0]:.3f} / {per[1]:.3f} | {floor:.3f} | "
                    f"{per[0] / floor:.2f} / {per[1] / floor:.2f} |"
                )
                fns = built_module_costs(base, other)
                timed = time_candidates(fns, rounds=args.rounds, threads=threads)
                for k, t in timed.items():
                    ema = fns[k].__defaults__[0]
                    built.append(
                        f"| {name} | {threads} | {k} | {1e3 * t.median_s:.3f} ({1e3 * t.iqr_s:.3f}) | "
                        f"{ema.rebuilds} |"
                    )
    print("\n".join(profiles), "\n".join(extra), "\n".join(built), sep="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
