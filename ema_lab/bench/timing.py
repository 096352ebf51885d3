"""Device-aware timing of several candidates, interleaved in one process, reported as median and IQR.

Built on ``torch.utils.benchmark.Timer``, which fixes the intra-op thread count while it measures.
Its clock synchronizes CUDA before each reading, but MPS only since pytorch PR #157131 (July 2025,
``torch.accelerator.synchronize()``), while ema_lab supports torch 2.1: so the Timer here reads a
clock of this module's that synchronizes the device being timed, on every torch version, and queued
kernels are paid for by the candidate that launched them. On top of it this module adds what a
comparison needs: a warm-up per candidate, a per-candidate inner repeat count (``number``) sized
so one measurement is long enough to read, and *rounds* that visit every candidate in turn (in
a shuffled order), so a noisy neighbour or a clock change hits all candidates alike instead of
one.
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.benchmark import Timer

__all__ = ["time_candidates", "quantiles", "progress_bar"]


def progress_bar(**kwargs: Any) -> Any:
    """A tqdm bar (``kwargs`` go to tqdm): a widget in Jupyter where ipywidgets is installed, else text.

    ``tqdm.auto`` without ipywidgets prints a warning into the notebook before falling back to text;
    asking for text directly shows the same bar without it.
    """
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    return tqdm(**kwargs)


def synchronize(device: str) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def synchronized_clock(device: str) -> Callable[[], float]:
    """A clock for ``Timer(timer=...)`` that waits for ``device``'s queued work before each reading."""
    if device == "cpu":
        return timeit.default_timer

    def clock() -> float:
        synchronize(device)
        return timeit.default_timer()

    return clock


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``values`` (inclusive method: exact for small n)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


@dataclass(frozen=True)
class TimingResult:
    """Seconds per call of one candidate: median and quartiles over ``rounds`` measurements."""

    name: str
    device: str
    threads: int
    number: int  # calls per measurement
    rounds: int
    median_s: float
    q1_s: float
    q3_s: float
    times_s: tuple[float, ...]  # per-call time of each measurement, in round order

    @property
    def iqr_s(self) -> float:
        """Interquartile range (q3 - q1) in seconds."""
        return self.q3_s - self.q1_s


def _calls_per_measurement(fn: Callable[[], object], device: str, target_s: float, warmup: int) -> int:
    """Warm ``fn`` up, then pick how many calls make one measurement last about ``target_s``."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    one = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(10_000, round(target_s / one)))


def time_candidates(
    candidates: dict[str, Callable[[], object]],
    device: str = "cpu",
    *,
    rounds: int = 15,
    target_s: float = 0.02,
    warmup: int = 3,
    threads: int = 1,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, TimingResult]:
    """Time every candidate ``rounds`` times, interleaved; return per-call median and IQR for each.

    ``threads`` is the intra-op thread count during measurement (recorded in each result).
    ``target_s`` sizes each measurement (``number`` calls); ``on_round(i)`` reports progress.
    """
    if not candidates:
        raise ValueError("time_candidates needs at least one candidate")
    if rounds < 1 or threads < 1:
        raise ValueError(f"rounds and threads must be >= 1, got rounds={rounds}, threads={threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # warm-up and sizing at the measured thread count too
    try:
        numbers = {k: _calls_per_measurement(fn, device, target_s, warmup) for k, fn in candidates.items()}
        clock = synchronized_clock(device)
        timers = {
            k: Timer(stmt="fn()", globals={"fn": fn}, timer=clock, num_threads=threads, label=k)
            for k, fn in candidates.items()
        }
        names = list(candidates)
        times: dict[str, list[float]] = {k: [] for k in names}
        # A new order each round (seeded: a rerun repeats it), so no candidate always runs right after the
        # same neighbour, whose memory traffic can leave the caches cold (a rotation keeps each predecessor).
        order = random.Random(0)
        for r in range(rounds):
            for k in order.sample(names, len(names)):
                times[k].append(timers[k].timeit(numbers[k]).mean)
            if on_round is not None:
                on_round(r)
    finally:
        torch.set_num_threads(previous)
    out = {}
    for k in names:
        q1, med, q3 = quantiles(times[k])
        out[k] = TimingResult(k, device, threads, numbers[k], rounds, med, q1, q3, tuple(times[k]))
    return out
