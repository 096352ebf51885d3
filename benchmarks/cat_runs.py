"""Two layout choices of the default ``ModelEMA``, timed side by side: cat runs and 2 MiB pages.

    PYTHONPATH=. python benchmarks/cat_runs.py [--model yolo] [--out results]

1. A CPU ``torch.cat`` whose result has at least ``at::internal::GRAIN_SIZE`` (32768) elements and runs on
   more than one thread does not take the serial kernel: it copies input by input through
   ``narrow().copy_()``. This times, at 1 and 2 intra-op threads, one ``torch.cat`` of a zoo model's small
   float tensors (those the default gathers: under ``ModelEMA``'s ``cat_max_numel``) against the same
   tensors gathered in runs under 32768 elements (what a step built at 2+ threads does).
2. The floor (one ``lerp_`` over two flat buffers of the model's size) in ordinary memory and in the
   buffers ``ema_lab.flatten_tensors`` allocates (2 MiB transparent huge pages where the kernel grants them).

Interleaved, medians of ``--rounds`` (:func:`ema_lab.bench.timing.time_candidates`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from ema_lab import ModelEMA, flatten_tensors
from ema_lab.bench.environment import environment
from ema_lab.bench.timing import time_candidates
from ema_lab.lessons import models

GRAIN = 32768  # ATen's at::internal::GRAIN_SIZE
CAT_MAX_NUMEL = inspect.signature(ModelEMA).parameters["cat_max_numel"].default


def runs_under(numels: list[int], limit: int = GRAIN) -> list[range]:
    """Consecutive tensors (by element count) in runs under ``limit`` elements; a bigger one runs alone."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(numels):
        if total + n >= limit and i > start:
            runs.append(range(start, i))
            start, total = i, 0
        total += n
    return [*runs, range(start, len(numels))] if numels else []


def main(argv: list[str] | None = None) -> int:
    """Time one cat against runs at 1 and 2 threads; print; with --out write results/cat-runs-*.{json,md}."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="yolo", choices=sorted(models.ZOO))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    floats = [
        t.detach().reshape(-1)
        for t in models.build(args.model).state_dict().values()
        if t.is_floating_point()
    ]
    small = [t for t in floats if t.numel() < CAT_MAX_NUMEL]
    runs = [small[r.start : r.stop] for r in runs_under([t.numel() for t in small])]
    elements = sum(t.numel() for t in small)
    n = sum(t.numel() for t in floats)
    a, b = torch.rand(n), torch.rand(n)
    (ha,), (hb,) = flatten_tensors([a.clone()]), flatten_tensors([b.clone()])
    fns = {
        "one torch.cat": lambda: torch.cat(small),
        f"{len(runs)} runs": lambda: [torch.cat(r) for r in runs],
        "floor, ordinary memory": lambda: a.lerp_(b, 1e-4),
        "floor, flatten_tensors memory": lambda: ha.lerp_(hb, 1e-4),
    }
    rows = []
    for threads in (1, 2):
        for name, t in time_candidates(fns, rounds=args.rounds, threads=threads).items():
            rows.append(
                {
                    "threads": threads,
                    "candidate": name,
                    "median_ms": 1e3 * t.median_s,
                    "iqr_ms": 1e3 * t.iqr_s,
                }
            )
    table = "\n".join(
        ["| threads | candidate | median ms (IQR) |", "|---|---|---|"]
        + [f"| {r['threads']} | {r['candidate']} | {r['median_ms']:.3f} ({r['iqr_ms']:.3f}) |" for r in rows]
    )
    header = (
        f"{args.model}: {len(small)} small float tensors, {elements} elements, "
        f"{len(runs)} runs under {GRAIN}; floor over {n} floats"
    )
    print(header + "\n\n" + table)
    if args.out:
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        command = " ".join(["benchmarks/cat_runs.py", *(sys.argv[1:] if argv is None else argv)])
        env = environment("cpu")
        record = {"created": created, "command": command, "environment": env, "rows": rows}
        stem = Path(args.out) / f"cat-runs-{args.model}-{created[:10]}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        stem.with_suffix(".md").write_text(
            f"# One torch.cat vs runs, ordinary vs huge-page floor\n\n`PYTHONPATH=. python {command}`\n\n"
            f"{env['cpu']} ({env['cpu_count']} "
            f"cores), torch {env['torch']}, {created}, {args.rounds} rounds\n\n{header}\n\n{table}\n"
        )
        print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
