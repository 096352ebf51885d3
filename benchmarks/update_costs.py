"""Where the default ``ModelEMA``'s split between ``torch.cat`` and foreach pays: the ``cat_max_numel`` sweep.

    PYTHONPATH=. python benchmarks/update_costs.py [--models yolo tiny_tensors] [--out [FOLDER]]

``--out`` writes ``update-costs-<date>.json`` and ``.md`` into FOLDER, by default ``docs/results/`` (the
studies, ``result_homes.STUDIES``).

Model tensors under ``cat_max_numel`` elements are gathered by one ``torch.cat`` and averaged with one
``lerp_`` (a cheap dispatch per tensor, plus one more pass over their elements); larger ones go to one
``torch._foreach_lerp_`` (a full dispatch per tensor, no extra pass). This times ``update()`` of a
``ModelEMA(model, cat_max_numel=split)`` per split, all interleaved in one process at one thread (each on
its own copy of the model), next to the floor (one ``lerp_`` over two flat buffers of the model's size).
The constant ``ModelEMA`` uses by default is the split where this curve is lowest on the zoo's detector.
"""

from __future__ import annotations

import argparse
import sys
from copy import deepcopy

import torch
from result_homes import add_study_out, write_study

from ema_lab import ModelEMA, flatten_tensors
from ema_lab.bench import models
from ema_lab.bench.timing import time_candidates

SPLITS = (1, 256, 1024, 2048, 4096, 16384)


def candidates(name: str, splits: tuple[int, ...]) -> dict[str, object]:
    """``update()`` per split (each on its own model copy, after one warm-up update) and the floor."""
    base = models.build(name)
    fns = {}
    for split in splits:
        model = deepcopy(base)
        ema = ModelEMA(model, cat_max_numel=split)
        ema.update(model)
        fns[f"cat_max_numel={split} ({'/'.join(ema.modes)})"] = lambda ema=ema, model=model: ema.update(model)
    n = sum(t.numel() for t in base.state_dict().values() if t.is_floating_point())
    (a,), (b,) = flatten_tensors([torch.rand(n)]), flatten_tensors([torch.rand(n)])
    fns["floor"] = lambda: a.lerp_(b, 1e-4)
    return fns


def main(argv: list[str] | None = None) -> int:
    """Time the sweep per model; print a table; with --out write docs/results/update-costs-*.{json,md}."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["yolo", "tiny_tensors"], choices=sorted(models.ZOO))
    parser.add_argument("--splits", nargs="+", type=int, default=list(SPLITS))
    parser.add_argument("--rounds", type=int, default=15)
    add_study_out(parser)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        for label, t in time_candidates(candidates(name, tuple(args.splits)), rounds=args.rounds).items():
            rows.append(
                {"model": name, "candidate": label, "median_ms": 1e3 * t.median_s, "iqr_ms": 1e3 * t.iqr_s}
            )
    table = "\n".join(
        ["| model | candidate | median ms (IQR) |", "|---|---|---|"]
        + [f"| {r['model']} | {r['candidate']} | {r['median_ms']:.3f} ({r['iqr_ms']:.3f}) |" for r in rows]
    )
    print(table)
    if args.out:
        command = " ".join(["benchmarks/update_costs.py", *(sys.argv[1:] if argv is None else argv)])
        title = f"The cat/foreach split ({args.rounds} rounds, 1 thread)"
        write_study(args.out, "update-costs", title, command, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
