"""Roofline points from a bench record: bytes moved over time, against the copy of the same bytes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from ema_lab.bench.roofline import format_roofline, plot_roofline, roofline_points  # noqa: E402


def _row(candidate: str, ms: float) -> dict:
    stats = {"float_bytes": 10**9}
    return {"device": "cpu", "model": "m", "candidate": candidate, "median_ms": ms, "stats": stats}


def test_gbps_counts_three_transfers_for_an_update_and_two_for_the_copy():
    record = {"results": [_row("copy", 200.0), _row("flat", 300.0), _row("gated", 3000.0)]}
    points = {p.candidate: p for p in roofline_points(record)}
    assert set(points) == {"flat", "gated"}
    assert points["flat"].gbps == pytest.approx(10.0) and points["flat"].copy_gbps == pytest.approx(10.0)
    assert points["flat"].fraction == pytest.approx(1.0) and points["gated"].fraction == pytest.approx(0.1)
    assert "100%" in format_roofline(list(points.values()))
    fig = plot_roofline(list(points.values()))
    assert fig.axes[0].get_xlabel().startswith("achieved bandwidth (GB/s")
