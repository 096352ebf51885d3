"""Why the default gathers its small tensors in runs under 32768 elements at 2+ threads: CPU ``torch.cat``.

    PYTHONPATH=. python benchmarks/cat_runs.py [--model yolo_like] [--out results]

A CPU ``torch.cat`` whose result has at least ``at::internal::GRAIN_SIZE`` (32768) elements and runs on
more than one thread does not take the serial kernel: it copies input by input through
``narrow().copy_()``. This times, at 1 and 2 intra-op threads, one ``torch.cat`` of a model's small float
tensors (those the default's ``cat`` part gathers, under ``ema_lab.flat.CAT_MAX_NUMEL`` elements) against
the same tensors gathered in runs under 32768 elements (:func:`ema_lab.flat.cat_runs`), interleaved,
medians of ``--rounds``. Runs in the project venv (zoo models) or the peers venv (also ``yolo26n``).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from ema_lab.bench.environment import environment
from ema_lab.bench.timing import time_candidates
from ema_lab.flat import CAT_MAX_NUMEL, cat_runs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import build  # noqa: E402 - the benchmark models live in the sibling script


def main(argv: list[str] | None = None) -> int:
    """Time one cat against runs at 1 and 2 threads; print; with --out write results/cat-runs-*.{json,md}."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="yolo_like")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    small = [
        t.detach().reshape(-1)
        for t in build(args.model).state_dict().values()
        if t.is_floating_point() and t.numel() < CAT_MAX_NUMEL
    ]
    runs = [small[r.start : r.stop] for r in cat_runs([t.numel() for t in small])]
    elements = sum(t.numel() for t in small)
    fns = {
        "one torch.cat": lambda: torch.cat(small),
        f"{len(runs)} runs": lambda: [torch.cat(r) for r in runs],
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
        f"{args.model}: {len(small)} small float tensors, {elements} elements, {len(runs)} runs under 32768"
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
            f"# One torch.cat vs runs\n\n`PYTHONPATH=. python {command}`\n\n{env['cpu']} ({env['cpu_count']} "
            f"cores), torch {env['torch']}, {created}, {args.rounds} rounds\n\n{header}\n\n{table}\n"
        )
        print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
