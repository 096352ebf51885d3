"""A per-launch cost model of the EMA update: ``time = overhead_per_op * ops + bytes / bandwidth``.

Two sweeps over synthetic (EMA, model) float32 tensor lists on one device:

- *count sweep*: the same total number of elements split into 1 .. 1024 tensors (time grows with
  the number of dispatched ops: launch-bound);
- *size sweep*: a fixed number of tensors holding more and more elements (time grows with bytes:
  bandwidth-bound).

For the per-tensor ``loop`` (``v *= d; v += (1 - d) * m.detach()``) ``ops`` is every op it dispatches
(counted with :func:`ema_lab.bench.counting.count_ops`, views included: each one is a trip through
the dispatcher) and ``bytes`` its memory traffic (7 element-sized reads/writes per element). For
one ``_foreach_lerp_`` the unit is a tensor inside the call (3 per element: read EMA and model, write EMA).
Each fit is a least-squares fit without intercept, weighted by 1/time so small and large points
count alike. The roofline is a single-kernel ``copy_`` of the same sizes, fitted the same way: its
bandwidth is what this device gives one streaming kernel, and ``roofline_fraction`` is a strategy's
fitted bandwidth over it. ``floor`` is one ``lerp_`` over two contiguous buffers: the best an EMA update
of that many elements can do. Sizes up to 16 Mi elements (64 MiB) span cache and DRAM, as models do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..updates import prepare
from .counting import count_ops
from .timing import time_candidates

__all__ = [
    "CostFit",
    "CostModel",
    "fit_cost",
    "run_cost_model",
    "sweep_plan",
    "BYTES_PER_ELEMENT",
    "FIXED_ELEMENTS",
    "FIXED_TENSORS",
]

#: element-sized memory accesses per element: mul_ (r+w), mul (r+w), add_ (2r+w); lerp (2r+w); copy (r+w)
BYTES_PER_ELEMENT = {"loop": 7, "foreach": 3, "floor": 3, "copy": 2}
FIXED_ELEMENTS = 1 << 20  # count sweep: 1M float32 elements (4 MiB per side)
FIXED_TENSORS = 64  # size sweep


@dataclass(frozen=True)
class CostFit:
    """A fitted ``time = overhead * units + bytes / bandwidth`` for one strategy on one device."""

    strategy: str
    unit: str  # what one "op" is for this strategy
    overhead_per_op_us: float
    bandwidth_gbps: float  # 1e9 bytes per second; inf when the fit found no bandwidth term
    r2: float
    points: int


def fit_cost(
    units: list[float], nbytes: list[float], seconds: list[float], strategy: str, unit: str
) -> CostFit:
    """Least-squares fit (no intercept, relative error) of ``seconds = a * units + nbytes / bw``."""
    if not (len(units) == len(nbytes) == len(seconds)) or len(units) < 2:
        raise ValueError(f"need >= 2 points of equal length, got {len(units)}, {len(nbytes)}, {len(seconds)}")
    x = np.column_stack([units, nbytes]).astype(float)
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / y  # relative error: a 10 us point weighs as much as a 10 ms point
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    if coef[0] < 0 or coef[1] < 0:
        # A negative coefficient is meaningless: keep the one term that fits, refit it alone.
        col = 0 if coef[1] < 0 else 1
        single, *_ = np.linalg.lstsq((x[:, col] * w)[:, None], y * w, rcond=None)
        coef = np.zeros(2)
        coef[col] = max(single[0], 0.0)
    pred = x @ coef
    ss_res = float(np.sum(((y - pred) * w) ** 2))
    ss_tot = float(np.sum(((y - np.average(y, weights=w**2)) * w) ** 2)) or 1.0
    bw = float(1.0 / coef[1] / 1e9) if coef[1] > 0 else float("inf")
    return CostFit(strategy, unit, float(coef[0]) * 1e6, bw, float(1.0 - ss_res / ss_tot), len(units))


@dataclass
class CostModel:
    """The sweep's points, the fits, and the copy roofline on one device."""

    device: str
    threads: int
    fits: dict[str, CostFit]  # "loop", "foreach", and the single-kernel references "floor" and "copy"
    points: list[dict[str, object]] = field(default_factory=list)

    @property
    def copy_bandwidth_gbps(self) -> float:
        """The roofline: fitted bandwidth of one ``copy_`` kernel over the same sizes."""
        return self.fits["copy"].bandwidth_gbps

    @property
    def roofline_fraction(self) -> dict[str, float]:
        """Fitted bandwidth of each strategy over the single-kernel copy's (1.0 = as fast as a copy)."""
        return {k: f.bandwidth_gbps / self.copy_bandwidth_gbps for k, f in self.fits.items() if k != "copy"}

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly dict (infinite bandwidths become None)."""

        def finite(v: float) -> float | None:
            return v if np.isfinite(v) else None

        fits = {}
        for k, f in self.fits.items():
            d = asdict(f)
            d["bandwidth_gbps"] = finite(f.bandwidth_gbps)
            fits[k] = d
        return {
            "device": self.device,
            "threads": self.threads,
            "fixed_elements": FIXED_ELEMENTS,
            "fixed_tensors": FIXED_TENSORS,
            "fits": fits,
            "copy_bandwidth_gbps": finite(self.copy_bandwidth_gbps),
            "roofline_fraction": {k: finite(v) for k, v in self.roofline_fraction.items()},
            "points": self.points,
        }


def sweep_plan(quick: bool = False) -> list[tuple[str, int, int]]:
    """The (sweep, tensors, total elements) points: counts at fixed size, sizes at fixed count."""
    counts = (1, 16, 64, 1024) if quick else (1, 4, 16, 64, 256, 1024)
    sizes = (1 << 16, 1 << 22) if quick else (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
    plan = [("count", n, FIXED_ELEMENTS) for n in counts]
    plan += [
        ("size", FIXED_TENSORS, e) for e in sizes if (FIXED_TENSORS, e) != (FIXED_TENSORS, FIXED_ELEMENTS)
    ]
    return plan


def _split(total: int, n: int, device: str) -> list[torch.Tensor]:
    """``n`` float32 tensors holding ``total`` elements between them (sizes differ by at most one)."""
    base, extra = divmod(total, n)
    return [torch.rand(base + (i < extra), device=device) for i in range(n)]


def run_cost_model(
    device: str = "cpu",
    *,
    quick: bool = False,
    threads: int = 1,
    rounds: int | None = None,
    on_round: Callable[[int], None] | None = None,
) -> CostModel:
    """Run both sweeps on ``device``, interleaved in one timing session, and fit the cost model."""
    decay = 0.9999
    rounds = rounds or (3 if quick else 9)
    candidates: dict[str, Callable[[], object]] = {}
    meta: dict[str, dict[str, object]] = {}
    for sweep, n, total in sweep_plan(quick):
        ema, model = _split(total, n, device), _split(total, n, device)
        for strategy in ("loop", "foreach"):
            step = prepare(strategy, ema, model)
            key = f"{strategy}/{sweep}/{n}/{total}"
            candidates[key] = lambda step=step: step(decay)
            ops = sum(count_ops(step, decay).values())
            units = ops if strategy == "loop" else n
            meta[key] = {"sweep": sweep, "strategy": strategy, "tensors": n, "elements": total, "ops": ops}
            meta[key]["units"] = units
    # The single-kernel references at every total size of the sweep, so they are fitted alike.
    for total in sorted({total for _, _, total in sweep_plan(quick)}):
        a, b = torch.rand(total, device=device), torch.rand(total, device=device)
        refs = {"copy": lambda a=a, b=b: a.copy_(b), "floor": lambda a=a, b=b: a.lerp_(b, 1 - decay)}
        for k, fn in refs.items():
            candidates[f"{k}/reference/1/{total}"] = fn
            meta[f"{k}/reference/1/{total}"] = {
                "sweep": "reference",
                "strategy": k,
                "tensors": 1,
                "elements": total,
                "ops": 1,
                "units": 1,
            }
    timed = time_candidates(
        candidates,
        device,
        rounds=rounds,
        target_s=0.01 if quick else 0.02,
        threads=threads,
        on_round=on_round,
    )
    points = []
    for k, m in meta.items():
        t = timed[k]
        nbytes = BYTES_PER_ELEMENT[str(m["strategy"])] * int(m["elements"]) * 4
        points.append({**m, "bytes": nbytes, "median_s": t.median_s, "q1_s": t.q1_s, "q3_s": t.q3_s})
    fits = {}
    units = {
        "loop": "dispatched op",
        "foreach": "tensor inside one _foreach_lerp_",
        "floor": "call",
        "copy": "call",
    }
    for strategy, unit in units.items():
        pts = [p for p in points if p["strategy"] == strategy]
        fits[strategy] = fit_cost(
            [float(p["units"]) for p in pts],
            [float(p["bytes"]) for p in pts],
            [float(p["median_s"]) for p in pts],
            strategy,
            unit,
        )
    return CostModel(device, threads, fits, points)
