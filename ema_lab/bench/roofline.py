"""Each EMA update against the floor: one ``lerp_`` over two contiguous buffers of the same elements.

An EMA update of ``B`` float bytes reads the EMA and the model and writes the EMA: ``3 B`` bytes of
traffic (the EMA's cache lines are already read, so its write needs no extra write-allocate read).
The floor does exactly that in one kernel, so ``floor time / strategy time`` needs no byte model at
all and cannot exceed 1 except by noise: 1.0 means "as fast as one kernel over the same bytes".

:func:`plot_time_vs_bytes` draws every candidate as time against bytes on log-log axes, with the
floor's fitted cost from the same record's cost model (:mod:`ema_lab.bench.costmodel`): one line per
memory regime (cache, DRAM beyond the last-level cache) and the last-level cache size marked, so a
reader sees which models are launch-bound (far above the line) and which stream memory (on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .costmodel import BYTES_PER_ELEMENT, DEFAULT_LLC_BYTES

__all__ = ["floor_points", "format_floor", "plot_time_vs_bytes"]


@dataclass(frozen=True)
class FloorPoint:
    """One candidate on one model: its median time, the bytes it must move and the floor's time."""

    model: str
    candidate: str
    median_ms: float
    float_bytes: int  # bytes of the model's floating-point tensors (one side)
    floor_ms: float

    @property
    def traffic_bytes(self) -> int:
        """Bytes an update must move: read EMA and model, write EMA."""
        return BYTES_PER_ELEMENT["floor"] * self.float_bytes

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in 1e9 bytes per second, counting the update's three streams."""
        return self.traffic_bytes / (self.median_ms * 1e-3) / 1e9

    @property
    def of_floor(self) -> float:
        """Floor time over this candidate's time: 1.0 is as fast as one ``lerp_`` over the same bytes."""
        return self.floor_ms / self.median_ms


def floor_points(record: dict[str, Any], device: str = "cpu") -> list[FloorPoint]:
    """Turn the update rows of a bench record (:func:`ema_lab.bench.run_bench`) into points vs its floor."""
    rows = [r for r in record["results"] if r["device"] == device]
    floor = {r["model"]: r for r in rows if r["candidate"] == "floor"}
    missing = sorted({r["model"] for r in rows} - set(floor))
    if missing:
        raise ValueError(f"no 'floor' row for model(s) {missing} on {device}: run the bench with the floor")
    return [
        FloorPoint(
            r["model"],
            r["candidate"],
            r["median_ms"],
            r["stats"]["float_bytes"],
            floor[r["model"]]["median_ms"],
        )
        for r in rows
        if r["candidate"] not in ("floor", "copy")  # copy_ is another single-kernel reference, not an update
    ]


def format_floor(points: list[FloorPoint]) -> str:
    """A text table: model, candidate, median ms, GB/s (three streams), time of the floor over its time."""
    lines = [f"{'model':<13} {'candidate':<12} {'median ms':>10} {'GB/s':>7} {'floor/time':>10}"]
    for p in points:
        lines.append(
            f"{p.model:<13} {p.candidate:<12} {p.median_ms:>10.3f} {p.gbps:>7.2f} {p.of_floor:>10.2f}"
        )
    return "\n".join(lines)


def plot_time_vs_bytes(points: list[FloorPoint], cost_model: dict[str, Any] | None = None) -> Any:
    """Log-log time per update against bytes moved, one marker per candidate and model, with the floor.

    ``cost_model`` is a record's ``cost_model[device]`` (:meth:`CostModel.as_dict`); its floor fit draws
    the floor line per regime, split at its measured knee (else at the reported last-level cache).
    Without it the measured floor points of the models are joined instead.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, cand in enumerate(dict.fromkeys(p.candidate for p in points)):
        pts = sorted((p for p in points if p.candidate == cand), key=lambda p: p.traffic_bytes)
        ax.plot(
            [p.traffic_bytes / 2**20 for p in pts],
            [p.median_ms for p in pts],
            marker="os^vD<>ph*"[i % 10],
            ls="",
            label=cand,
        )
    by_model = {p.model: p for p in points}
    for name, p in by_model.items():
        ax.annotate(
            name,
            (p.traffic_bytes / 2**20, p.floor_ms),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    lo = min(p.traffic_bytes for p in points) / 2
    hi = max(p.traffic_bytes for p in points) * 2
    fit = (cost_model or {}).get("fits", {}).get("floor")
    # The regimes split where the cost model did: at its measured knee, else at the reported cache.
    cm = cost_model or {}
    split = cm.get("split_bytes") or cm.get("llc_bytes") or DEFAULT_LLC_BYTES
    # The update's working set is EMA + model = 2/3 of its traffic; the regimes split on it.
    llc_traffic = 1.5 * split
    if fit and fit.get("bandwidth_gbps"):
        over = fit["overhead_per_op_us"] * 1e-3
        # One line per fitted regime, each drawn only over the sizes where it holds.
        regimes = [("cache", "bandwidth_gbps", "k-", lo, min(hi, llc_traffic / 2))]
        if fit.get("dram_bandwidth_gbps") and hi > 2 * llc_traffic:
            regimes.append(("DRAM", "dram_bandwidth_gbps", "k--", 2 * llc_traffic, hi))
        for name, key, style, start, stop in regimes:
            x = np.geomspace(start, stop, 50)
            label = f"floor fit, {name}: {fit[key]:.0f} GB/s"
            ax.plot(x / 2**20, over + x / (fit[key] * 1e6), style, lw=1.2, label=label)
    else:
        floors = sorted(by_model.values(), key=lambda p: p.traffic_bytes)
        ax.plot(
            [p.traffic_bytes / 2**20 for p in floors],
            [p.floor_ms for p in floors],
            "k-",
            label="floor (measured)",
        )
    if cm.get("knee_bytes"):
        what = "the measured knee"
    elif cm.get("llc_bytes"):
        what = "the last-level cache as reported"
    else:
        what = "an assumed last-level cache"
    ax.axvline(
        llc_traffic / 2**20, color="grey", ls=":", label=f"EMA + model = {what} ({split / 2**20:.0f} MiB)"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes an update moves (MiB: read EMA + read model + write EMA)")
    ax.set_ylabel("time per update (ms, median)")
    ax.set_title("EMA update time vs bytes moved; on the floor line = streaming as fast as one lerp_")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
