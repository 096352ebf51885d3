"""Two layout choices of the default ``ModelEMA``, timed side by side: cat runs and 2 MiB pages.

    PYTHONPATH=. python benchmarks/cat_runs.py [--model yolo] [--out [FOLDER]]

``--out`` writes ``cat-runs-<model>-<date>.json`` and ``.md`` into FOLDER, by default ``docs/results/``
(the studies, ``result_homes.STUDIES``).

1. A CPU ``torch.cat`` whose result has at least ``at::internal::GRAIN_SIZE`` (32768) elements and runs on
   more than one thread does not take the serial kernel: it copies input by input through
   ``narrow().copy_()``. A default ``ModelEMA`` built at 2+ threads therefore gathers its small tensors
   in runs under 32768 elements, one built at 1 thread in one ``torch.cat``. This times ``update()`` of
   both (each on its own copy of a zoo model) at 1 and 2 intra-op threads.
2. The floor (one ``lerp_`` over two flat buffers of the model's size) in ordinary memory and in the
   buffers ``ema_lab.flatten_tensors`` allocates (2 MiB transparent huge pages where the kernel grants them).

Interleaved, medians of ``--rounds`` (:func:`ema_lab.bench.timing.time_candidates`).
"""

from __future__ import annotations

import argparse
import json
import sys
from copy import deepcopy
from datetime import datetime, timezone
from pathlib import Path

import torch
from result_homes import add_study_out

from ema_lab import ModelEMA, flatten_tensors
from ema_lab.bench import models
from ema_lab.bench.environment import environment
from ema_lab.bench.timing import time_candidates


def built_at(threads: int, model: torch.nn.Module) -> ModelEMA:
    """A default ``ModelEMA`` whose step was built at ``threads`` intra-op threads (one cat, or runs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ema = ModelEMA(model)
        ema.update(model)
    finally:
        torch.set_num_threads(before)
    return ema


def main(argv: list[str] | None = None) -> int:
    """Time one cat against runs at 1 and 2 threads; print; with --out write docs/results/cat-runs-*."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="yolo", choices=sorted(models.ZOO))
    parser.add_argument("--rounds", type=int, default=21)
    add_study_out(parser)
    args = parser.parse_args(argv)
    base = models.build(args.model)
    one_model, runs_model = deepcopy(base), deepcopy(base)
    one, runs = built_at(1, one_model), built_at(2, runs_model)
    n = sum(t.numel() for t in base.state_dict().values() if t.is_floating_point())
    a, b = torch.rand(n), torch.rand(n)
    (ha,), (hb,) = flatten_tensors([a.clone()]), flatten_tensors([b.clone()])
    fns = {
        "update(), built at 1 thread (one cat)": lambda: one.update(one_model),
        "update(), built at 2 threads (runs)": lambda: runs.update(runs_model),
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
    header = f"{args.model}: modes {one.modes}; floor over {n} floats"
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
