"""What each profile beyond the first costs a post-hoc EMA: one shared step, or one EMA per profile.

    PYTHONPATH=. python benchmarks/posthoc_layouts.py --main DIR [--models yolo tiny_tensors] [--rounds 15]

``--main DIR``: DIR holds another copy of the package named ``ema_lab_main`` (``git archive <rev> ema_lab |
tar -x -C DIR && mv DIR/ema_lab DIR/ema_lab_main``), whose ``PostHocEMA`` runs beside this one. Besides both
``PostHocEMA`` (no snapshot in the run), ``ModelEMA`` per profile (``strategy="flat"``, a power schedule):
what one EMA per profile costs, built from the public class. Each candidate has its own copy of the model,
two warm-up updates; 1, 2 and 4 profiles; the table gives medians and the cost per extra profile,
``(t4 - t1) / 3``, beside the floor of one profile's arithmetic: one ``lerp_`` over two flat buffers of the
model's float elements, as ``benchmarks/peers.py`` times it, in the same rounds.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections.abc import Callable
from copy import deepcopy

import torch

from ema_lab import ModelEMA, PostHocEMA
from ema_lab.bench import models
from ema_lab.bench.timing import time_candidates
from ema_lab.schedules import power

PROFILES = {1: (0.05,), 2: (0.05, 0.10), 4: (0.05, 0.075, 0.10, 0.15)}


def candidates(base: object, folder: str, others: dict[str, type]) -> dict[str, Callable[[], object]]:
    """Each layout with 1, 2 and 4 profiles, each on its own copy of ``base``, warmed up."""
    fns = {}
    for k, sigma_rels in PROFILES.items():
        makers = {
            f"{label}, {k}": lambda m, cls=cls, s=sigma_rels, label=label, k=k: [
                cls(m, f"{folder}/{label}-{k}", sigma_rels=s, snapshot_every=10**9)
            ]
            for label, cls in others.items()
        }
        makers[f"ModelEMA per profile, {k}"] = lambda m, s=sigma_rels: [
            ModelEMA(m, decay=power(sigma_rel=x), strategy="flat") for x in s
        ]
        for label, make in makers.items():
            model = deepcopy(base)
            emas = make(model)
            for _ in range(2):
                for ema in emas:
                    ema.update(model)
            fns[label] = lambda emas=emas, model=model: [ema.update(model) for ema in emas]
    n = sum(t.numel() for t in base.state_dict().values() if t.is_floating_point())
    a, b = torch.randn(n), torch.randn(n)
    fns["floor"] = lambda: a.lerp_(b, 1e-4)
    return fns


def main(argv: list[str] | None = None) -> int:
    """Time every layout per model, one thread, interleaved; print medians and the cost per extra profile."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["yolo", "tiny_tensors"], choices=models.ZOO)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--main", help="a folder holding another copy of the package as ema_lab_main")
    args = parser.parse_args(argv)
    others = {"PostHocEMA": PostHocEMA}
    if args.main:
        sys.path.insert(0, args.main)
        others["main: PostHocEMA"] = importlib.import_module("ema_lab_main").PostHocEMA
    rows = [
        "| model | layout | 1 profile (ms) | 2 profiles | 4 profiles | per extra profile | one lerp_ |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            timed = time_candidates(
                candidates(models.build(name), folder, others), rounds=args.rounds, threads=1
            )
            ms = {label: 1e3 * t.median_s for label, t in timed.items()}
            floor = ms.pop("floor")
            for layout in sorted({label.rsplit(", ", 1)[0] for label in ms}):
                t = [ms[f"{layout}, {k}"] for k in PROFILES]
                rows.append(
                    f"| {name} | {layout} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {(t[2] - t[0]) / 3:.3f} | "
                    f"{floor:.3f} |"
                )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
