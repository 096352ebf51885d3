"""A per-launch cost model of the EMA update: ``time = overhead_per_op * ops + bytes / bandwidth``.

Two sweeps over synthetic (EMA, model) float32 tensor lists on one device:

- *count sweep*: the same total number of elements (1 Mi, 4 MiB per side) split into 1 .. 1024
  tensors (time grows with the number of dispatched ops: launch-bound);
- *size sweep*: 64 tensors holding more and more elements (time grows with bytes: bandwidth-bound).
  In full mode it doubles the size until one side would exceed the smallest of: ``LLC_MULTIPLE`` x the
  last-level cache the OS reports (:func:`last_level_cache_bytes`), ``SIDE_CAP_BYTES``, and
  ``MEMORY_FRACTION`` of the memory available now (:func:`available_memory_bytes`) shared by the
  ``SIDES_ALIVE`` buffers of one size (:func:`sweep_limit`). The reported cache size is only a hint:
  virtual machines report anything from 32 MiB to over 1 GiB for the same kind of core.

The sweep runs one size at a time (every candidate of that size interleaved, then its memory is
freed), so a progress bar advances by real work and the memory held is that of one size.

For the per-tensor ``loop`` (``v *= d; v += (1 - d) * m.detach()``) ``ops`` is every op it dispatches
(counted with :func:`ema_lab.bench.counting.count_ops`, views included: each one is a trip through
the dispatcher) and ``bytes`` its memory traffic (7 element-sized accesses per element). For one
``_foreach_lerp_`` the unit is a tensor inside the call (3 accesses per element: read EMA and model,
write EMA). A CPU store to memory that is not in cache first reads the line (write-allocate), so a
``copy_`` moves 3 accesses per element too, the same as a ``lerp_``; both are counted that way.

The bytes term has one bandwidth per regime, split at the *knee*: the working set (EMA + model) at
which the floor's bandwidth steps down, found in the measured points (:func:`measured_knee`), or the
reported cache size when no step was measured. *cache* is up to half the split, *DRAM* from twice it;
points in between are measured and plotted but not fitted. Each fit is a non-negative least-squares
fit without intercept, weighted by 1/time so small and large points count alike. ``floor`` is one
``lerp_`` over two contiguous buffers: the best an EMA update of that many elements can do, and the
reference of :attr:`CostModel.floor_fraction`: floor time over a strategy's time on the same elements,
measured interleaved (the same op over the same bytes, so no byte-counting convention enters; 1.0
means as fast as the floor, and values a little above 1 are timing noise).
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
from .timing import progress_bar, time_candidates

__all__ = [
    "run_cost_model",
    "plot_cost_regimes",
    "working_set_bytes",
    "regime",
    "sweep_limit",
    "sweep_plan",
    "measured_knee",
    "available_memory_bytes",
    "device_cache_bytes",
    "last_level_cache_bytes",
]

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
# Progress-bar weights only (relative step sizes, not a measurement): a dispatched op of about 2 us,
# memory at about 10 GB/s.
_ASSUMED_OP_S = 2e-6
_ASSUMED_BYTES_PER_S = 10e9


def _parse_size(text: str) -> int:
    """``"32768K"`` / ``"1M"`` / ``"512"`` (sysfs cache sizes) in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache_bytes(
    sysfs: Path | str = "/sys/devices/system/cpu/cpu0/cache",
) -> tuple[int | None, str]:
    """The size of the largest data cache level of CPU 0 in bytes, and where it was read (None if unknown)."""
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(Path(sysfs).glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Unified", "Data") and size > 0 and (best is None or level > best[0]):
            best = (level, size)
    if best is not None:
        return best[1], f"{sysfs}/index*/size (L{best[0]})"
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size and size > 0:
            return int(size), f"os.sysconf({name!r})"
    return None, "unknown (no sysfs cache entries, no sysconf value)"


def device_cache_bytes(device: str) -> tuple[int | None, str]:
    """The last cache level before ``device``'s memory, in bytes, and where it was read (None if unknown)."""
    if device == "cpu":
        return last_level_cache_bytes()
    props = torch.cuda.get_device_properties(torch.cuda.current_device()) if device == "cuda" else None
    if getattr(props, "L2_cache_size", 0):
        return int(props.L2_cache_size), "torch.cuda.get_device_properties(...).L2_cache_size"
    return None, f"unknown for {device}"


@dataclass(frozen=True)
class CostFit:
    """A fitted ``time = overhead * units + bytes / bandwidth`` for one strategy, one bandwidth per regime."""

    strategy: str
    unit: str  # what one "op" is for this strategy
    overhead_per_op_us: float
    bandwidth_gbps: float  # 1e9 bytes/s while the working set fits in the LLC; inf when no bytes term fits
    r2: float
    points: int
    dram_bandwidth_gbps: float | None = None  # beyond the LLC; None when no point of the sweep is there

    def seconds(self, units: float, nbytes: float, beyond_llc: bool = False) -> float:
        """The fitted time of one update of ``units`` ops moving ``nbytes`` bytes."""
        bw = self.dram_bandwidth_gbps if beyond_llc else self.bandwidth_gbps
        if bw is None:
            raise ValueError(f"{self.strategy}: no point beyond the last-level cache was measured")
        return self.overhead_per_op_us * 1e-6 * units + (0.0 if np.isinf(bw) else nbytes / (bw * 1e9))


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


def available_memory_bytes(meminfo: Path | str = "/proc/meminfo") -> tuple[int | None, str]:
    """Memory the OS says a new allocation can have now, in bytes, and where it was read (None if unknown).

    Linux's ``MemAvailable`` counts reclaimable page cache; elsewhere free pages from ``os.sysconf``.
    """
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, f"{meminfo} MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None, "unknown (no /proc/meminfo, no sysconf value)"
    return pages * size, "os.sysconf('SC_AVPHYS_PAGES')"


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
    points: list[dict[str, object]] = field(default_factory=list)
    llc_bytes: int | None = None  # as reported by the OS (sysfs or sysconf) or by CUDA, not measured
    llc_source: str = ""
    knee_bytes: int | None = None  # working set where the floor's bandwidth stepped down; None: no step seen
    max_side_bytes: int | None = None  # the largest side the sweep reached
    size_limit: str = ""  # what bounded the sweep (the cap, the reported cache, the available memory)

    @property
    def split_bytes(self) -> int:
        """The working set that splits cache from DRAM: the measured knee, else the reported LLC."""
        return self.knee_bytes or self.llc_bytes or DEFAULT_LLC_BYTES

    @property
    def copy_bandwidth_gbps(self) -> float:
        """Fitted bandwidth of one ``copy_`` kernel in the cache regime (write-allocate read counted)."""
        return self.fits["copy"].bandwidth_gbps

    def _fraction(self, where: str) -> dict[str, float | None]:
        # Time ratio at the largest size of the regime (64 tensors, bytes dominate): interleaved
        # measurements of the same elements, no byte-counting convention and no fitted term involved.
        sized = [p for p in self.points if p["tensors"] in (FIXED_TENSORS, 1) and p.get("regime") == where]
        if not sized:
            return {"loop": None, "foreach": None}
        largest = max(int(p["elements"]) for p in sized)  # type: ignore[call-overload]
        at = {p["strategy"]: float(p["median_s"]) for p in sized if p["elements"] == largest}  # type: ignore[arg-type]
        return {k: (at["floor"] / at[k] if k in at and "floor" in at else None) for k in ("loop", "foreach")}

    @property
    def floor_fraction(self) -> dict[str, float | None]:
        """Floor time over each strategy's time at the largest cache-regime size (1.0: as fast)."""
        return self._fraction("cache")

    @property
    def floor_fraction_dram(self) -> dict[str, float | None]:
        """The same at the largest size beyond the cache (None if the sweep did not go there)."""
        return self._fraction("dram")

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly dict (infinite bandwidths become None)."""

        def finite(v: float | None) -> float | None:
            return v if v is not None and np.isfinite(v) else None

        fits = {}
        for k, f in self.fits.items():
            d = asdict(f)
            d["bandwidth_gbps"] = finite(f.bandwidth_gbps)
            d["dram_bandwidth_gbps"] = finite(f.dram_bandwidth_gbps)
            fits[k] = d
        return {
            "device": self.device,
            "threads": self.threads,
            "fixed_elements": FIXED_ELEMENTS,
            "fixed_tensors": FIXED_TENSORS,
            "llc_bytes": self.llc_bytes,
            "llc_source": self.llc_source,
            "knee_bytes": self.knee_bytes,
            "split_bytes": self.split_bytes,
            "max_side_bytes": self.max_side_bytes,
            "size_limit": self.size_limit,
            "fits": fits,
            "copy_bandwidth_gbps": finite(self.copy_bandwidth_gbps),
            "floor_fraction": self.floor_fraction,
            "floor_fraction_dram": self.floor_fraction_dram,
            "points": self.points,
        }


def _split(total: int, n: int, device: str) -> list[torch.Tensor]:
    """``n`` float32 tensors holding ``total`` elements between them (sizes differ by at most one)."""
    base, extra = divmod(total, n)
    return [torch.rand(base + (i < extra), device=device) for i in range(n)]


def _step_weight(total: int, splits: list[int], rounds: int, target_s: float) -> float:
    """A size's expected seconds, for the progress bar only: every candidate's warm-up, sizing and rounds.

    A candidate's call streams its bytes and dispatches its ops; a measurement repeats calls for at
    least ``target_s``; warm-up, sizing and op counting add about five calls.
    """
    calls = [(BYTES_PER_ELEMENT["loop"], 3 * n) for n in splits] + [
        (BYTES_PER_ELEMENT["foreach"], n) for n in splits
    ]
    calls += [(BYTES_PER_ELEMENT["floor"], 1), (BYTES_PER_ELEMENT["copy"], 1)]
    seconds = 0.0
    for accesses, ops in calls:
        one = 4 * total * accesses / _ASSUMED_BYTES_PER_S + ops * _ASSUMED_OP_S
        seconds += rounds * max(target_s, one) + 5 * one
    return seconds


def _time_size(
    device: str,
    total: int,
    splits: list[tuple[str, int]],
    decay: float,
    rounds: int,
    target_s: float,
    threads: int,
) -> list[dict[str, Any]]:
    """Every candidate holding ``total`` elements, timed interleaved; the points, memory freed on return."""
    candidates: dict[str, Callable[[], object]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for sweep, n in splits:
        ema, model = _split(total, n, device), _split(total, n, device)
        for strategy in ("loop", "foreach"):
            step = prepare(strategy, ema, model)  # the library's own steps: what the bench times
            key = f"{strategy}/{sweep}/{n}/{total}"
            candidates[key] = lambda step=step: step(decay)
            ops = sum(count_ops(step, decay).values())
            units = ops if strategy == "loop" else n
            meta[key] = {"sweep": sweep, "strategy": strategy, "tensors": n, "elements": total, "ops": ops}
            meta[key]["units"] = units
    # The single-kernel references at the same size, so they are fitted alike.
    a, b = (torch.empty(total, dtype=torch.float32, device=device).uniform_() for _ in range(2))
    for k, fn in {"copy": lambda: a.copy_(b), "floor": lambda: a.lerp_(b, 1 - decay)}.items():
        candidates[f"{k}/reference/1/{total}"] = fn
        meta[f"{k}/reference/1/{total}"] = {
            "sweep": "reference",
            "strategy": k,
            "tensors": 1,
            "elements": total,
            "ops": 1,
            "units": 1,
        }
    timed = time_candidates(candidates, device, rounds=rounds, target_s=target_s, threads=threads)
    points = []
    for k, m in meta.items():
        t = timed[k]
        points.append(
            {
                **m,
                "bytes": BYTES_PER_ELEMENT[str(m["strategy"])] * total * 4,
                "working_set_bytes": working_set_bytes(total),
                "median_s": t.median_s,
                "q1_s": t.q1_s,
                "q3_s": t.q3_s,
            }
        )
    return points


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
    decay = 0.9999
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
            points += _time_size(device, total, splits, decay, rounds, target_s, threads)
            bar.update(weights[total])
    floor = [p for p in points if p["strategy"] == "floor"]
    knee = measured_knee(
        [int(p["working_set_bytes"]) for p in floor], [p["bytes"] / p["median_s"] / 1e9 for p in floor]
    )
    _, why = sweep_limit(llc_bytes, available_bytes, cap_bytes)
    model = CostModel(device, threads, {}, points, llc_bytes, source, knee, 4 * max(by_total), why)
    if quick:
        model.size_limit = "quick mode: two sizes inside the cache"
    for p in points:
        p["regime"] = regime(int(p["working_set_bytes"]), model.split_bytes)
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


def plot_count_panel(ax: Any, cost: dict[str, Any]) -> None:
    """Draw the count sweep on ``ax``: time vs tensor count at a fixed total size, measured and fitted.

    All its points hold ``fixed_elements`` elements, inside the cache, so the fit's cache bandwidth
    (the only one an older result file has) applies to each of them.
    """
    pts, fits = cost["points"], cost["fits"]
    for strategy in ("loop", "foreach"):
        fit = fits[strategy]
        sel = sorted(
            (p for p in pts if p["sweep"] == "count" and p["strategy"] == strategy),
            key=lambda p: p["tensors"],
        )
        x = [p["tensors"] for p in sel]
        line = ax.plot(x, [1e3 * p["median_s"] for p in sel], "o", label=f"{strategy}: measured")[0]
        bw = fit["bandwidth_gbps"]
        model = [
            1e3 * (fit["overhead_per_op_us"] * 1e-6 * p["units"] + (p["bytes"] / (bw * 1e9) if bw else 0.0))
            for p in sel
        ]
        ax.plot(x, model, "-", color=line.get_color(), alpha=0.6, label=f"{strategy}: fit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"tensors holding {cost['fixed_elements']:,} float32 elements in all")
    ax.set_ylabel("update time (ms, median)")
    ax.set_title(
        f"launch-bound: {fits['loop']['overhead_per_op_us']:.2f} us per dispatched op (loop)", fontsize=9
    )
    ax.legend(fontsize=7)


def plot_cost_regimes(cost: dict[str, Any]) -> Any:
    """Left: time vs tensor count (launch-bound); right: GB/s vs working set with the cache and DRAM regimes.

    ``cost`` is :meth:`CostModel.as_dict` (or a result file's ``cost_model[device]``).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    plot_count_panel(left, cost)
    pts, fits = cost["points"], cost["fits"]
    llc = cost.get("llc_bytes")
    knee = cost.get("knee_bytes")
    split = cost.get("split_bytes") or llc or DEFAULT_LLC_BYTES  # older files: the reported cache split
    for strategy, style in (("loop", "o-"), ("foreach", "s-"), ("floor", "D-"), ("copy", "^:")):
        sel = [
            p
            for p in pts
            if p["strategy"] == strategy and (p["sweep"] != "count" or p["tensors"] == cost["fixed_tensors"])
        ]
        sel.sort(key=lambda p: p["elements"])
        right.plot(
            [p["working_set_bytes"] / 2**20 for p in sel],
            [p["bytes"] / p["median_s"] / 1e9 for p in sel],
            style,
            label=f"{strategy} ({BYTES_PER_ELEMENT[strategy]} accesses per element)",
        )
    right.axvspan(
        split / 2 / 2**20, 2 * split / 2**20, color="grey", alpha=0.15, label="transition (not fitted)"
    )
    if knee:
        right.axvline(knee / 2**20, color="C3", ls="-", lw=1, label=f"measured knee {knee / 2**20:.0f} MiB")
    if llc:
        by = (
            "last-level cache as reported by the OS"
            if cost.get("device", "cpu") == "cpu"
            else "L2 cache as reported by CUDA"
        )
        label = f"{by}: {llc / 2**20:.0f} MiB"
        right.axvline(llc / 2**20, color="grey", ls=":", label=label)
    right.set_xscale("log")
    floor = fits["floor"]
    for key, name in (("bandwidth_gbps", "cache"), ("dram_bandwidth_gbps", "DRAM")):
        if floor.get(key):
            right.axhline(floor[key], color="k", lw=0.8, ls="--" if name == "DRAM" else "-")
            right.annotate(
                f"floor fit, {name}: {floor[key]:.0f} GB/s",
                xy=(0.01, floor[key]),
                xycoords=("axes fraction", "data"),
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=7,
            )
    right.set_xscale("log")
    right.set_xlabel("working set: EMA + model (MiB, float32)")
    right.set_ylabel("counted bytes / time (GB/s)")
    right.set_title("bandwidth-bound: cache, then DRAM beyond the knee", fontsize=9)
    right.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> int:
    """``python -m ema_lab.bench.costmodel [--quick] [--out FILE]``: run the sweep, print the fits."""
    import argparse
    import datetime as _dt
    import json

    from .environment import environment

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--quick", action="store_true", help="the small sweep (inside the cache)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the cost model and the environment as JSON here")
    args = parser.parse_args(argv)
    cost = run_cost_model("cpu", quick=args.quick, threads=args.threads)
    print(f"last-level cache as reported: {cost.llc_bytes} bytes, from {cost.llc_source}")
    print(f"measured knee: {cost.knee_bytes} bytes of working set; largest side {cost.max_side_bytes} bytes")
    print(f"the sweep was bounded by {cost.size_limit}")
    for name, f in cost.fits.items():
        dram = "-" if f.dram_bandwidth_gbps is None else f"{f.dram_bandwidth_gbps:.1f}"
        print(
            f"{name:<8} {f.overhead_per_op_us:6.2f} us per {f.unit:<34} cache {f.bandwidth_gbps:6.1f} GB/s, "
            f"DRAM {dram} GB/s (R^2 {f.r2:.2f})"
        )
    if args.out:
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        # The load average says how busy the machine was (other jobs share its cores and caches).
        load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        record = {
            "created": now,
            "environment": environment("cpu"),
            "load_average_1_5_15min": load,
            "quick": args.quick,
            "cost_model": cost.as_dict(),
        }
        args.out.write_text(json.dumps(record, indent=1, default=float) + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
