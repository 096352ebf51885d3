"""Which per-entry signal can tell that an EMA's entry moved, and what each costs: why the watch reads
``data_ptr()`` through every EMA slot.

    PYTHONPATH=. python benchmarks/watch_signals.py [--model yolo] [--repeats 101]

A cached flat step writes the EMA's tensors through views of its own buffers, so it must know, before each
update, that every EMA entry still holds that memory. Each signal below is read for every EMA entry of a
default ``ModelEMA`` of ``tiny_cnn``, before and after one move a user can make (each move on a fresh EMA);
a signal that reads the same after a move would let the step write memory the EMA no longer holds. Then each
signal is timed per EMA entry on ``--model``, warm (read again and again) and cold (right after a pass over
32 MiB of other memory, as after a training step), at 1 thread. It prints one Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from operator import getitem

import torch
from torch import Tensor, nn
from watch_costs import cold_seconds

from ema_lab import ModelEMA
from ema_lab.bench import models
from ema_lab.pairs import module_entries

KEPT: list[object] = []  # what a move keeps alive (a user's "best checkpoint" dict, an old .data)


def _kept_data(m: nn.Module) -> None:
    p = m[0].conv.weight
    KEPT.append(p.data)
    p.data = KEPT[-1].clone()


def _kept_swap(m: nn.Module) -> None:
    p = m[-1].bias
    KEPT.append(p.detach())
    torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone(), requires_grad=False))


#: A move a user makes on the EMA module, by name (tests/core/test_watch.py runs 28, on 6 strategies).
MOVES: dict[str, Callable[[nn.Module], object]] = {
    "p.data = x": lambda m: setattr(m[0].conv.weight, "data", m[0].conv.weight.detach().clone()),
    "old = p.data kept, p.data = x": _kept_data,
    "view kept, swap_tensors": _kept_swap,
    "state_dict kept, .half()": lambda m: (KEPT.append(m.state_dict()), m.half()),
    "_buffers[k] = x": lambda m: m[1].bn._buffers.__setitem__("running_mean", m[1].bn.running_mean.clone()),
    "storage to shared memory": lambda m: m[-1].bias.untyped_storage().share_memory_(),
}


class Signals:
    """The signals of one EMA's entries, read in one pass each; ``read(name)`` is what the step compares."""

    def __init__(self, ema: ModelEMA) -> None:
        self.slots = [slot for _, slot in module_entries(ema.ema)]  # what the watch reads of the EMA
        self.dicts, self.keys = (tuple(x) for x in zip(*self.slots))
        self.held = list(map(getitem, self.dicts, self.keys))
        # 2ce76aa's signal: how many tensors hold each flat buffer's storage (each EMA entry's holds one).
        self.storages = [g.emas[0].untyped_storage() for g in ema._step.groups]
        self.storages.append(ema._step.counters.copies[0][0].untyped_storage())
        count = torch._C._storage_Use_Count
        self.read = {
            "the object in the slot (`is`)": lambda: list(map(id, map(getitem, self.dicts, self.keys))),
            "`_cdata` through the slot": lambda: [t._cdata for t in map(getitem, self.dicts, self.keys)],
            "`_version` through the slot": lambda: [t._version for t in map(getitem, self.dicts, self.keys)],
            "use count of each flat buffer": lambda: [count(s._cdata) for s in self.storages],
            "`data_ptr()` of the tensors held": lambda: list(map(Tensor.data_ptr, self.held)),
            "`data_ptr()` through the slot": lambda: list(
                map(Tensor.data_ptr, map(getitem, self.dicts, self.keys))
            ),
        }


def misses(name: str) -> list[str]:
    """The moves after which signal ``name`` reads as before."""
    missed = []
    for move, act in MOVES.items():
        model = models.build("tiny_cnn")
        ema = ModelEMA(model)
        ema.update(model)
        signals = Signals(ema)
        before = signals.read[name]()
        act(ema.ema)
        try:
            after = signals.read[name]()
        except KeyError:  # an entry deleted: seen
            after = None
        if after == before:
            missed.append(move)
        KEPT.clear()
    return missed


def ns_per_entry(fn: Callable[[], object], entries: int, repeats: int, cold: bool) -> float:
    """Median ns per entry of ``fn()``: back to back, or cold (``watch_costs.cold_seconds``)."""
    seconds = (
        cold_seconds(fn, repeats) if cold else statistics.median(timeit.repeat(fn, number=1, repeat=repeats))
    )
    return seconds / entries * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="yolo")
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = models.build(args.model)
    ema = ModelEMA(model)
    ema.update(model)
    timed = Signals(ema)
    entries = len(timed.slots)
    versions = f"torch {torch.__version__}, Python {sys.version.split()[0]}"
    print(f"{versions}, 1 thread, {args.model}: {entries} EMA entries")
    print("| signal | moves it misses | warm ns per entry | cold ns per entry |")
    print("|---|---|---|---|")
    for name, fn in timed.read.items():
        warm, cold = (ns_per_entry(fn, entries, args.repeats, c) for c in (False, True))
        print(f"| {name} | {', '.join(misses(name)) or 'none'} | {warm:.0f} | {cold:.0f} |", flush=True)


if __name__ == "__main__":
    main()
