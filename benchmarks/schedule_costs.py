"""What a schedule and a second EMA cost per update: ``ModelEMA`` with the ramp (a number), with a schedule,
``PostHocEMA`` (two power EMAs from one read of the model) and two separate ``ModelEMA``s, interleaved.

    PYTHONPATH=. python benchmarks/schedule_costs.py [--models yolo tiny_tensors] [--threads 1 2] [--out]

``--out`` writes ``schedule-costs-<date>.json`` and ``.md`` into FOLDER, by default ``docs/results/``. Each
candidate updates its own copy of the model (after two warm-up updates); ``floor`` is one ``lerp_`` over two
flat buffers of the EMA's size, about what the second EMA of ``PostHocEMA`` costs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from copy import deepcopy

from core_costs import floor, warmed_updates
from result_homes import add_study_out, write_study

from ema_lab import ModelEMA, PostHocEMA
from ema_lab.bench import models
from ema_lab.bench.timing import time_candidates
from ema_lab.schedules import power, warmup


def candidates(name: str, folder: str) -> dict[str, object]:
    """One update of each candidate, on its own model copy."""
    base = models.build(name)
    emas = {
        "ramp (a number, the default)": lambda m: ModelEMA(m),
        "warm-up schedule": lambda m: ModelEMA(m, decay=warmup()),
        "power schedule": lambda m: ModelEMA(m, decay=power(sigma_rel=0.05)),
        "PostHocEMA (two power EMAs, one read)": lambda m: PostHocEMA(m, folder, snapshot_every=10**9),
    }
    fns = warmed_updates(base, emas)
    model = deepcopy(base)
    pair = [ModelEMA(model, decay=power(sigma_rel=s)) for s in (0.05, 0.10)]
    fns["two ModelEMAs (two reads)"] = lambda: [e.update(model) for e in pair]
    return fns | floor(base)


def main(argv: list[str] | None = None) -> int:
    """Time the candidates per model and thread count; print a table; with --out write the record."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["yolo", "tiny_tensors"], choices=sorted(models.ZOO))
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    add_study_out(parser)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            for threads in args.threads:
                timed = time_candidates(candidates(name, folder), rounds=args.rounds, threads=threads)
                ramp = timed["ramp (a number, the default)"].median_s
                for label, t in timed.items():
                    rows.append(
                        {
                            "model": name,
                            "threads": threads,
                            "candidate": label,
                            "median_ms": 1e3 * t.median_s,
                            "iqr_ms": 1e3 * t.iqr_s,
                            "vs_ramp": t.median_s / ramp,
                        }
                    )
    table = "\n".join(
        ["| model | threads | candidate | median ms (IQR) | / ramp |", "|---|---|---|---|---|"]
        + [
            f"| {r['model']} | {r['threads']} | {r['candidate']} | {r['median_ms']:.3f} ({r['iqr_ms']:.3f}) "
            f"| {r['vs_ramp']:.2f} |"
            for r in rows
        ]
    )
    print(table)
    if args.out:
        command = " ".join(["benchmarks/schedule_costs.py", *(sys.argv[1:] if argv is None else argv)])
        write_study(args.out, "schedule-costs", "What a schedule and a second EMA cost", command, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
