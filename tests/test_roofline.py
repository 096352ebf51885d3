"""Bench rows against their floor row: time ratios, three-stream GB/s, and the time-vs-bytes plot."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "numpy", reason="numpy is not installed (the bench extra; ema_lab.bench.roofline needs it)"
)
matplotlib = pytest.importorskip("matplotlib", reason="matplotlib is not installed (the bench extra)")
matplotlib.use("Agg")

from ema_lab.bench.roofline import floor_points, format_floor, plot_time_vs_bytes  # noqa: E402


def _row(candidate: str, ms: float, model: str = "m", nbytes: int = 10**9) -> dict:
    stats = {"float_bytes": nbytes}
    return {"device": "cpu", "model": model, "candidate": candidate, "median_ms": ms, "stats": stats}


def test_points_are_time_ratios_to_the_floor_and_count_three_streams():
    record = {
        "results": [_row("floor", 300.0), _row("copy", 280.0), _row("flat", 300.0), _row("gated", 3000.0)]
    }
    points = {p.candidate: p for p in floor_points(record)}
    assert set(points) == {"flat", "gated"}  # the references (floor, copy) are not updates
    assert points["flat"].gbps == pytest.approx(10.0) and points["flat"].of_floor == pytest.approx(1.0)
    assert points["gated"].of_floor == pytest.approx(0.1)
    assert "floor/time" in format_floor(list(points.values())) and "0.10" in format_floor([points["gated"]])


def test_a_model_without_a_floor_row_is_named():
    with pytest.raises(ValueError, match=r"no 'floor' row for model\(s\) \['x'\]"):
        floor_points({"results": [_row("flat", 1.0, model="x")]})


def test_plot_is_log_log_time_vs_bytes_with_the_regime_lines():
    rows = [_row("floor", 0.5, "small", 10**6), _row("flat", 2.0, "small", 10**6)]
    rows += [_row("floor", 30.0, "big", 4 * 10**8), _row("flat", 31.0, "big", 4 * 10**8)]
    fits = {"floor": {"overhead_per_op_us": 2.0, "bandwidth_gbps": 90.0, "dram_bandwidth_gbps": 30.0}}
    fig = plot_time_vs_bytes(floor_points({"results": rows}), {"fits": fits, "llc_bytes": 32 << 20})
    ax = fig.axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    labels = [line.get_label() for line in ax.get_lines()]
    assert "floor fit, cache: 90 GB/s" in labels and "floor fit, DRAM: 30 GB/s" in labels
    assert "EMA + model = the last-level cache as reported (32 MiB)" in labels
    knee = {"fits": fits, "llc_bytes": 480 << 20, "knee_bytes": 64 << 20, "split_bytes": 64 << 20}
    labels = [
        line.get_label() for line in plot_time_vs_bytes(floor_points({"results": rows}), knee).axes[0].lines
    ]
    assert "EMA + model = the measured knee (64 MiB)" in labels  # not the 480 MiB the OS reports
    fig = plot_time_vs_bytes(floor_points({"results": rows}))  # no cost model: the measured floor joined
    assert "floor (measured)" in [line.get_label() for line in fig.axes[0].get_lines()]
