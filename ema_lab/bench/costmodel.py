"""A per-launch cost model of the EMA update: ``time = overhead_per_op * ops + bytes / bandwidth``.

Two sweeps over synthetic (EMA, model) float32 tensor lists on one device, one size at a time (every
candidate of that size interleaved, then its memory freed):

- *count sweep*: 1 Mi elements (4 MiB per side) split into 1 .. 1024 tensors: launch-bound;
- *size sweep*: 64 tensors holding more and more elements: bandwidth-bound. Full mode doubles the size
  up to :func:`sweep_limit` (a multiple of the reported last-level cache, a cap, a share of the memory
  available now); the reported cache size is only a hint: virtual machines report anything from 32 MiB
  to over 1 GiB for the same kind of core.

For the per-tensor ``loop`` (``v *= d; v += (1 - d) * m.detach()``) ``ops`` is every op it dispatches
(:func:`ema_lab.bench.counting.count_ops`, views included: each is a trip through the dispatcher) and
``bytes`` its memory traffic (7 element-sized accesses per element). For one ``_foreach_lerp_`` the unit
is a tensor inside the call (3 accesses: read EMA and model, write EMA). A CPU store to memory not in
cache first reads the line (write-allocate), so a ``copy_`` moves 3 accesses per element too.

The bytes term has one bandwidth per regime, split at the *knee*: the working set (EMA + model) at which
the floor's bandwidth steps down (:func:`measured_knee`), else the reported cache size. *cache* is up
to half the split, *DRAM* from twice it; points in between are measured but not fitted. Each fit is a
non-negative least-squares fit without intercept, weighted by 1/time. ``floor`` is one ``lerp_`` over
two contiguous buffers, the best an update of that many elements can do; a strategy's *floor fraction*
is floor time over its time on the same elements, measured interleaved (1.0: as fast as the floor).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..updates import prepare
from .counting import count_ops
from .environment import available_memory_bytes, device_cache_bytes, environment
from .timing import progress_bar, time_candidates

__all__ = ["run_cost_model", "CostModel", "cost_seconds"]

#: element-sized memory accesses per element: mul_ (r+w), mul (r+w), add_ (2r+w); lerp (2r+w);
#: copy (r + the destination's write-allocate read + w)
BYTES_PER_ELEMENT = {"loop": 7, "foreach": 3, "floor": 3, "copy": 3}
FIXED_ELEMENTS = 1 << 20  # count sweep: 1M float32 elements (4 MiB per side)
FIXED_TENSORS = 64  # size sweep
LLC_MULTIPLE = 4  # full mode sweeps up to this many times the reported last-level cache per side ...
SIDE_CAP_BYTES = 256 << 20  # ... but never past 256 MiB per side: DRAM is reached, and a step stays seconds
MEMORY_FRACTION = 0.25  # ... nor past a quarter of the available memory: the rest stays the user's
SIDES_ALIVE = 4  # buffers of one size alive at once: the EMA and model lists, the floor's two flat buffers
DEFAULT_LLC_BYTES = 32 << 20  # assumed when the OS does not say (a common server L3 slice)
KNEE_MIN_WORKING_SET = 4 << 20  # the knee is looked for above private L2 caches (1-2 MiB per core)
KNEE_MIN_POINTS = 2  # points on each plateau: one point alone is not a plateau
KNEE_MIN_STEP = 1.3  # the floor's bandwidth must drop by this factor to count as a knee, not noise


def cost_seconds(overhead_per_op_us: float, gbps: float | None, units: float, nbytes: float) -> float:
    """Cost model seconds: ``overhead_per_op * units + nbytes / bandwidth`` (no bandwidth, no bytes)."""
    bytes_s = nbytes / (gbps * 1e9) if gbps and math.isfinite(gbps) else 0.0
    return overhead_per_op_us * 1e-6 * units + bytes_s


@dataclass(frozen=True)
class CostFit:
    """A fitted ``time = overhead * units + bytes / bandwidth`` for one strategy, one bandwidth per regime."""

    strategy: str
    unit: str  # what one "op" is for this strategy
    overhead_per_op_us: float
    bandwidth_gbps: float  # 1e9 bytes/s while the working set fits in the cache; inf when no bytes term fits
    r2: float
    points: int
    dram_bandwidth_gbps: float | None = None  # beyond the cache; None when no point of the sweep is there


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit until none is."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_cost(
    units: list[float],
    nbytes: list[float],
    seconds: list[float],
    strategy: str,
    unit: str,
    beyond_llc: list[bool] | None = None,
) -> CostFit:
    """Non-negative least squares (no intercept, relative error) of ``seconds = a * units + nbytes / bw``.

    With ``beyond_llc`` (one flag per point) the bytes of points beyond the last-level cache get their
    own bandwidth (``dram_bandwidth_gbps``).
    """
    if not (len(units) == len(nbytes) == len(seconds)) or len(units) < 2:
        raise ValueError(f"need >= 2 points of equal length, got {len(units)}, {len(nbytes)}, {len(seconds)}")
    far = np.zeros(len(units), dtype=bool) if beyond_llc is None else np.asarray(beyond_llc, dtype=bool)
    if far.shape != (len(units),):
        raise ValueError(f"beyond_llc: expected {len(units)} flags, got {far.shape[0]}")
    b = np.asarray(nbytes, dtype=float)
    x = np.column_stack([units, np.where(far, 0.0, b), np.where(far, b, 0.0)]).astype(float)
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / y  # relative error: a 10 us point weighs as much as a 10 ms point
    coef = _nonneg_lstsq(x * w[:, None], y * w)
    pred = x @ coef
    ss_res = float(np.sum(((y - pred) * w) ** 2))
    ss_tot = float(np.sum(((y - np.average(y, weights=w**2)) * w) ** 2)) or 1.0

    def gbps(c: float) -> float:
        return float(1.0 / c / 1e9) if c > 0 else float("inf")

    dram = gbps(coef[2]) if far.any() else None
    return CostFit(
        strategy, unit, float(coef[0]) * 1e6, gbps(coef[1]), float(1.0 - ss_res / ss_tot), len(units), dram
    )


def sweep_limit(
    llc_bytes: int | None, available_bytes: int | None, cap_bytes: int = SIDE_CAP_BYTES
) -> tuple[int, str]:
    """The largest side (bytes of EMA, or of model) the full size sweep may reach, and what bounds it.

    The smallest of ``LLC_MULTIPLE`` x the reported cache (``DEFAULT_LLC_BYTES`` when unknown), the cap,
    and ``MEMORY_FRACTION`` of the available memory shared by the ``SIDES_ALIVE`` buffers of one size.
    """
    limits = {f"the cap of {cap_bytes / 2**20:.0f} MiB per side": cap_bytes}
    llc = llc_bytes or DEFAULT_LLC_BYTES
    limits[f"{LLC_MULTIPLE}x the reported last-level cache ({llc / 2**20:.0f} MiB)"] = LLC_MULTIPLE * llc
    if available_bytes is not None:
        share = int(MEMORY_FRACTION * available_bytes) // SIDES_ALIVE
        limits[f"{MEMORY_FRACTION:.0%} of the available memory ({available_bytes / 2**30:.1f} GiB)"] = share
    reason = min(limits, key=limits.__getitem__)
    return limits[reason], reason


def sweep_plan(
    quick: bool = False,
    llc_bytes: int | None = None,
    available_bytes: int | None = None,
    cap_bytes: int = SIDE_CAP_BYTES,
) -> list[tuple[str, int, int]]:
    """The (sweep, tensors, total elements) points: counts at fixed size, sizes at fixed count.

    Full mode doubles the size from 16 Ki elements while one side (float32) stays within
    :func:`sweep_limit`; quick mode stays at two sizes inside any cache.
    """
    counts = (1, 16, 64, 1024) if quick else (1, 4, 16, 64, 256, 1024)
    if quick:
        sizes: list[int] = [1 << 16, 1 << 22]
    else:
        largest = sweep_limit(llc_bytes, available_bytes, cap_bytes)[0] // 4
        sizes = [1 << 14]
        while sizes[-1] * 2 <= largest:
            sizes.append(sizes[-1] * 2)
    plan = [("count", n, FIXED_ELEMENTS) for n in counts]
    plan += [("size", FIXED_TENSORS, e) for e in sizes if e != FIXED_ELEMENTS]
    return plan


def working_set_bytes(elements: int) -> int:
    """Bytes of EMA plus model (float32) that one update streams through."""
    return 2 * 4 * elements


def regime(working_set: int, split_bytes: int) -> str:
    """``"cache"`` up to half the split, ``"dram"`` from twice it, ``"transition"`` in between (not fitted).

    ``split_bytes`` is the working set where the cache ends: the measured knee, else the reported LLC.
    """
    if working_set <= split_bytes // 2:
        return "cache"
    return "dram" if working_set >= 2 * split_bytes else "transition"


def measured_knee(working_sets: list[int], gbps: list[float]) -> int | None:
    """The working set at which the floor's bandwidth steps down (cache to DRAM), or None if it does not.

    Over the points from ``KNEE_MIN_WORKING_SET`` on (sorted by working set), the split into a higher
    and a lower plateau (``KNEE_MIN_POINTS`` each at least) that leaves the least squared spread of
    log bandwidth; the knee is the first point of the lower plateau, if the plateaus differ by at
    least ``KNEE_MIN_STEP``.
    """
    pts = sorted((w, math.log(b)) for w, b in zip(working_sets, gbps) if w >= KNEE_MIN_WORKING_SET and b > 0)
    logs = np.array([b for _, b in pts])

    def spread(k: int) -> float:
        return float(np.sum((logs[:k] - logs[:k].mean()) ** 2) + np.sum((logs[k:] - logs[k:].mean()) ** 2))

    if len(pts) < 2 * KNEE_MIN_POINTS:
        return None
    k = min(range(KNEE_MIN_POINTS, len(pts) - KNEE_MIN_POINTS + 1), key=spread)
    step = logs[:k].mean() - logs[k:].mean()
    return pts[k][0] if step >= math.log(KNEE_MIN_STEP) else None


@dataclass
class CostModel:
    """The sweep's points, the fits, the reported cache size and the measured knee that split the regimes."""

    device: str
    threads: int
    fits: dict[str, CostFit]  # "loop", "foreach", and the single-kernel references "floor" and "copy"
    points: list[dict[str, Any]] = field(default_factory=list)
    llc_bytes: int | None = None  # as reported by the OS (sysfs or sysconf) or by CUDA, not measured
    llc_source: str = ""
    knee_bytes: int | None = None  # working set where the floor's bandwidth stepped down; None: no step seen
    max_side_bytes: int | None = None  # the largest side the sweep reached
    size_limit: str = ""  # what bounded the sweep (the cap, the reported cache, the available memory)

    @property
    def split_bytes(self) -> int:
        """The working set that splits cache from DRAM: the measured knee, else the reported LLC."""
        return self.knee_bytes or self.llc_bytes or DEFAULT_LLC_BYTES

    def floor_fraction(self, where: str = "cache") -> dict[str, float | None]:
        """Floor time over each strategy's time at the largest size of regime ``where`` (1.0: as fast).

        Interleaved measurements of the same elements: no byte-counting convention, no fitted term.
        """
        sized = [p for p in self.points if p["tensors"] in (FIXED_TENSORS, 1) and p.get("regime") == where]
        largest = max((p["elements"] for p in sized), default=None)
        at = {p["strategy"]: p["median_s"] for p in sized if p["elements"] == largest}
        return {k: at["floor"] / at[k] if k in at and "floor" in at else None for k in ("loop", "foreach")}

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly dict: the fields, the sweep's fixed sizes, the split and the floor fractions."""
        out = asdict(self) | {
            "fixed_elements": FIXED_ELEMENTS,
            "fixed_tensors": FIXED_TENSORS,
            "split_bytes": self.split_bytes,
            "floor_fraction": self.floor_fraction("cache"),
            "floor_fraction_dram": self.floor_fraction("dram"),
        }
        for fit in out["fits"].values():  # JSON has no infinity: a fit without a bytes term stores None
            for key in ("bandwidth_gbps", "dram_bandwidth_gbps"):
                if fit[key] is not None and not math.isfinite(fit[key]):
                    fit[key] = None
        return out


def _split(total: int, n: int, device: str) -> list[torch.Tensor]:
    """``n`` float32 tensors holding ``total`` elements between them (sizes differ by at most one)."""
    base, extra = divmod(total, n)
    return [torch.rand(base + (i < extra), device=device) for i in range(n)]


def _step_weight(total: int, splits: list[int], rounds: int, target_s: float) -> float:
    """A size's expected seconds, for the progress bar only: every candidate's warm-up, sizing and rounds.

    Each call is priced with assumed costs (a dispatched op of 2 us, memory at 10 GB/s); a measurement
    repeats calls for at least ``target_s``; warm-up, sizing and op counting add about five calls.
    """
    calls = [("loop", 3 * n) for n in splits] + [("foreach", n) for n in splits] + [("floor", 1), ("copy", 1)]
    seconds = 0.0
    for strategy, ops in calls:
        one = cost_seconds(2.0, 10.0, ops, 4 * total * BYTES_PER_ELEMENT[strategy])
        seconds += rounds * max(target_s, one) + 5 * one
    return seconds


def _time_size(
    device: str, total: int, splits: list[tuple[str, int]], rounds: int, target_s: float, threads: int
) -> list[dict[str, Any]]:
    """Every candidate holding ``total`` elements, timed interleaved; the points, memory freed on return."""
    decay = 0.9999
    candidates: dict[str, Callable[[], object]] = {}
    points: dict[str, dict[str, Any]] = {}
    for sweep, n in splits:
        ema, model = _split(total, n, device), _split(total, n, device)
        for strategy in ("loop", "foreach"):
            step = prepare(strategy, ema, model)  # the library's own steps: what the bench times
            key = f"{strategy}/{sweep}/{n}"
            candidates[key] = lambda step=step: step(decay, 1 - decay)
            ops = sum(count_ops(step, decay, 1 - decay).values())
            units = ops if strategy == "loop" else n
            points[key] = {"sweep": sweep, "strategy": strategy, "tensors": n, "ops": ops, "units": units}
    # The single-kernel references at the same size, so they are fitted alike.
    a, b = (torch.empty(total, dtype=torch.float32, device=device).uniform_() for _ in range(2))
    candidates |= {"copy": lambda: a.copy_(b), "floor": lambda: a.lerp_(b, 1 - decay)}
    for k in ("copy", "floor"):
        points[k] = {"sweep": "reference", "strategy": k, "tensors": 1, "ops": 1, "units": 1}
    timed = time_candidates(candidates, device, rounds=rounds, target_s=target_s, threads=threads)
    return [
        p
        | {
            "elements": total,
            "bytes": BYTES_PER_ELEMENT[p["strategy"]] * total * 4,
            "working_set_bytes": working_set_bytes(total),
            "median_s": timed[k].median_s,
            "q1_s": timed[k].q1_s,
            "q3_s": timed[k].q3_s,
        }
        for k, p in points.items()
    ]


def run_cost_model(
    device: str = "cpu",
    *,
    quick: bool = False,
    threads: int = 1,
    rounds: int | None = None,
    llc_bytes: int | None = None,
    available_bytes: int | None = None,
    cap_bytes: int = SIDE_CAP_BYTES,
    progress: bool = True,
) -> CostModel:
    """Run both sweeps on ``device``, one size at a time (its candidates interleaved), and fit the model.

    ``llc_bytes`` defaults to :func:`device_cache_bytes` (the CPU's last-level cache, a CUDA GPU's L2;
    ``DEFAULT_LLC_BYTES`` where unknown); ``available_bytes`` to
    :func:`available_memory_bytes`; with ``cap_bytes`` they bound the sweep (:func:`sweep_limit`).
    ``progress`` shows a bar that advances by each size's expected work, so its ETA is honest.
    """
    rounds = rounds or (3 if quick else 9)
    source = "given"
    if llc_bytes is None:
        llc_bytes, source = device_cache_bytes(device)
    if available_bytes is None:
        available_bytes = available_memory_bytes()[0]
    plan = sweep_plan(quick, llc_bytes, available_bytes, cap_bytes)
    by_total: dict[int, list[tuple[str, int]]] = {}
    for sweep, n, total in plan:
        by_total.setdefault(total, []).append((sweep, n))
    target_s = 0.01 if quick else 0.02
    weights = {t: _step_weight(t, [n for _, n in sp], rounds, target_s) for t, sp in by_total.items()}
    points: list[dict[str, Any]] = []
    bar_format = "{desc}{percentage:3.0f}%|{bar}| {elapsed}<{remaining}"
    with progress_bar(
        total=sum(weights.values()), disable=not progress, bar_format=bar_format, smoothing=0
    ) as bar:
        for total, splits in sorted(by_total.items()):
            bar.set_description(f"cost model: {4 * total / 2**20:g} MiB per side")
            points += _time_size(device, total, splits, rounds, target_s, threads)
            bar.update(weights[total])
    floor = [p for p in points if p["strategy"] == "floor"]
    knee = measured_knee(
        [p["working_set_bytes"] for p in floor], [p["bytes"] / p["median_s"] / 1e9 for p in floor]
    )
    why = (
        "quick mode: two sizes inside the cache"
        if quick
        else sweep_limit(llc_bytes, available_bytes, cap_bytes)[1]
    )
    model = CostModel(device, threads, {}, points, llc_bytes, source, knee, 4 * max(by_total), why)
    for p in points:
        p["regime"] = regime(p["working_set_bytes"], model.split_bytes)
    units = {
        "loop": "dispatched op",
        "foreach": "tensor inside one _foreach_lerp_",
        "floor": "call",
        "copy": "call",
    }
    for strategy, unit in units.items():
        pts = [p for p in points if p["strategy"] == strategy and p["regime"] != "transition"]
        model.fits[strategy] = fit_cost(
            [float(p["units"]) for p in pts],
            [float(p["bytes"]) for p in pts],
            [float(p["median_s"]) for p in pts],
            strategy,
            unit,
            beyond_llc=[p["regime"] == "dram" for p in pts],
        )
    return model


def main(argv: list[str] | None = None) -> int:
    """``python -m ema_lab.bench.costmodel [--quick] [--out FILE]``: run the sweep alone, print the fits."""
    import argparse
    import datetime as dt
    import json

    from .results import cost_model_line

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--quick", action="store_true", help="the small sweep (inside the cache)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the cost model and the environment as JSON here")
    args = parser.parse_args(argv)
    cost = run_cost_model("cpu", quick=args.quick, threads=args.threads).as_dict()
    print(f"{cost_model_line(cost, args.threads)}\nthe sweep was bounded by {cost['size_limit']}")
    if args.out:
        record = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment("cpu"),
            # How busy the machine was: other jobs share its cores and caches.
            "load_average_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "quick": args.quick,
            "cost_model": cost,
        }
        args.out.write_text(json.dumps(record, indent=1, default=float) + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
