"""What ``ema.sync_buffers()`` costs beside ``ema.update()`` under DDP: gloo ranks on 127.0.0.1, 1 thread.

    PYTHONPATH=. python benchmarks/sync_costs.py [--models yolo resnet50 tiny_cnn] [--world-size 2] [--out]

Each rank wraps the zoo model in DDP and times, interleaved in one loop that every rank runs in lockstep
(a collective needs every rank): ``update()`` alone, ``sync_buffers()`` alone, and both, as a collective
inside ``update()`` would cost on every step. A round times ``--calls`` calls of each; the figure is the
median over rounds of the slowest rank's time per call. ``--out`` writes ``sync-costs-<date>.json`` and
``.md`` into FOLDER, by default ``docs/results/``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from result_homes import add_study_out, write_study

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.lessons.distributed import launch


def rank_times(rank: int, world: int, name: str, rounds: int, calls: int) -> dict[str, object]:
    """This rank's seconds per call of each candidate, per round (same order on every rank)."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(models.build(name))
    ema = ModelEMA(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-EMA warning: this script syncs on purpose
        ema.update(model)
    candidates = {
        "update()": lambda: ema.update(model),
        "sync_buffers()": ema.sync_buffers,
        "update() + sync_buffers()": lambda: (ema.update(model), ema.sync_buffers()),
    }
    names = list(candidates)
    for fn in candidates.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # the same rotation on every rank
        for k in order:
            dist.barrier()  # every rank starts the candidate together
            start = time.perf_counter()
            for _ in range(calls):
                candidates[k]()
            times[k].append((time.perf_counter() - start) / calls)
    buffers = ema.rank_local_tensors()
    return {
        "times": times,
        "buffers": len(buffers),
        "bytes": sum(b.numel() * b.element_size() for b in buffers),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the ranks per model; print a table; with --out write the record."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["yolo", "resnet50", "tiny_cnn"], choices=sorted(models.ZOO)
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5)
    add_study_out(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        ranks = launch(rank_times, args.world_size, name, args.rounds, args.calls, timeout_s=600)
        update = None
        for k in ranks[0]["times"]:
            slowest = [max(r["times"][k][i] for r in ranks) for i in range(args.rounds)]
            median = torch.tensor(slowest).median().item()
            update = update or median
            rows.append(
                {
                    "model": name,
                    "world_size": args.world_size,
                    "threads": 1,
                    "candidate": k,
                    "median_ms": 1e3 * median,
                    "vs_update": median / update,
                    "buffers": ranks[0]["buffers"],
                    "buffer_bytes": ranks[0]["bytes"],
                }
            )
    table = "\n".join(
        [
            "| model | float buffers (bytes) | candidate | median ms per call | / update() |",
            "|---|---|---|---|---|",
        ]
        + [
            f"| {r['model']} | {r['buffers']} ({r['buffer_bytes']:,}) | {r['candidate']} "
            f"| {r['median_ms']:.3f} | {r['vs_update']:.2f} |"
            for r in rows
        ]
    )
    print(f"gloo, {args.world_size} ranks on 127.0.0.1, 1 thread each; the slowest rank's time per call")
    print(table)
    if args.out:
        command = " ".join(["benchmarks/sync_costs.py", *(sys.argv[1:] if argv is None else argv)])
        write_study(
            args.out,
            "sync-costs",
            "What sync_buffers() costs beside update() under DDP",
            command,
            rows,
            table,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
