"""Achieved memory bandwidth of each EMA update against a single-kernel copy of the same bytes.

An EMA update of ``B`` float bytes reads the EMA and the model and writes the EMA: ``3 B`` bytes
of useful traffic. One ``copy_`` of ``B`` bytes moves ``2 B`` in one kernel; its GB/s is the
roofline this machine reaches with a single large kernel. A strategy at the roofline spends its
time moving bytes; one far below it spends it on per-tensor overhead.

The byte counts are :data:`ema_lab.bench.costmodel.BYTES_PER_ELEMENT`, shared with the cost model. They
count what a kernel asks for, not what the memory system moves: on a CPU with write-allocate
caches a copy also reads its destination, so a lerp can show a fraction above 1 there (about 1.5
when it runs as fast as the copy). The ratio that needs no byte model is ``floor`` time over a
strategy's time: the bench table lists the floor beside every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .costmodel import BYTES_PER_ELEMENT

__all__ = ["RooflinePoint", "roofline_points", "format_roofline", "plot_roofline"]


@dataclass(frozen=True)
class RooflinePoint:
    """One candidate on one model: achieved GB/s and the copy's GB/s on the same bytes."""

    model: str
    candidate: str
    median_ms: float
    gbps: float
    copy_gbps: float

    @property
    def fraction(self) -> float:
        """Achieved bandwidth as a fraction of the single-kernel copy."""
        return self.gbps / self.copy_gbps


def roofline_points(record: dict[str, Any], device: str = "cpu") -> list[RooflinePoint]:
    """Turn the rows of a bench record (:func:`ema_lab.bench.run_bench`) into roofline points."""
    rows = [r for r in record["results"] if r["device"] == device]
    copy = {r["model"]: r for r in rows if r["candidate"] == "copy"}
    out = []
    for r in rows:
        if r["candidate"] == "copy":
            continue
        nbytes = r["stats"]["float_bytes"]
        c = copy[r["model"]]
        out.append(
            RooflinePoint(
                model=r["model"],
                candidate=r["candidate"],
                median_ms=r["median_ms"],
                gbps=BYTES_PER_ELEMENT["floor"] * nbytes / (r["median_ms"] * 1e-3) / 1e9,
                copy_gbps=BYTES_PER_ELEMENT["copy"] * nbytes / (c["median_ms"] * 1e-3) / 1e9,
            )
        )
    return out


def format_roofline(points: list[RooflinePoint]) -> str:
    """A text table: model, candidate, median ms, GB/s, fraction of the copy's GB/s."""
    lines = [f"{'model':<13} {'candidate':<12} {'median ms':>10} {'GB/s':>7} {'of copy':>8}"]
    for p in points:
        lines.append(
            f"{p.model:<13} {p.candidate:<12} {p.median_ms:>10.3f} {p.gbps:>7.2f} {p.fraction:>7.0%}"
        )
    return "\n".join(lines)


def plot_roofline(points: list[RooflinePoint]) -> Any:
    """One panel per model: achieved GB/s per candidate (log scale) with the copy's GB/s as a line."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    names = list(dict.fromkeys(p.model for p in points))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        pts = [p for p in points if p.model == name]
        ax.barh([p.candidate for p in pts], [p.gbps for p in pts], color="tab:blue")
        ax.axvline(pts[0].copy_gbps, color="tab:red", ls="--", label=f"copy_ {pts[0].copy_gbps:.1f} GB/s")
        ax.set_xscale("log")
        ax.set_xlim(min(p.gbps for p in pts) / 2, 2 * max(max(p.gbps for p in pts), pts[0].copy_gbps))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("achieved bandwidth (GB/s, 3 x float bytes / time)")
        ax.set_title(name)
        ax.invert_yaxis()
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("candidate")
    fig.suptitle("EMA update vs the single-kernel copy roofline (1 thread)")
    fig.tight_layout()
    return fig
