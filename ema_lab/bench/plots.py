"""Figures of bench results (update time per candidate, the cost model, several machines side by side).

Built on ``matplotlib.figure.Figure`` rather than pyplot, so saving PNGs needs no GUI backend and
no global state; in a notebook the returned figure displays itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure

from .costmodel import plot_cost_regimes, plot_count_panel
from .results import run_label, settings_differences, upgrade

__all__ = ["plot_times", "plot_threads", "plot_cost_model", "plot_compare"]


def _bars(ax: Any, groups: list[str], series: dict[str, list[float | None]], err: dict | None = None) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series (None leaves a gap)."""
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(series.items()):
        v = np.array([np.nan if y is None else y for y in values], dtype=float)
        yerr = None
        if err is not None:
            lo, hi = err[label]
            yerr = np.array(
                [[np.nan if a is None else a for a in lo], [np.nan if b is None else b for b in hi]]
            )
        ax.bar(x + (i - (len(series) - 1) / 2) * width, v, width, label=label, yerr=yerr, capsize=2)
    ax.set_xticks(x, groups)


def plot_times(record: dict[str, Any], device: str, threads: int | None = None) -> Figure:
    """Median EMA update time (ms, log scale, IQR whiskers) per model and candidate on one device.

    ``threads`` picks one of the run's thread counts (default: the first).
    """
    record = upgrade(record)
    threads = record["settings"]["threads"][0] if threads is None else threads
    rows = [r for r in record["results"] if r["device"] == device and r["threads"] == threads]
    models = list(dict.fromkeys(r["model"] for r in rows))
    cands = list(dict.fromkeys(r["candidate"] for r in rows))
    by = {(r["model"], r["candidate"]): r for r in rows}
    series = {c: [by[m, c]["median_ms"] if (m, c) in by else None for m in models] for c in cands}
    err = {
        c: (
            [by[m, c]["median_ms"] - by[m, c]["q1_ms"] if (m, c) in by else None for m in models],
            [by[m, c]["q3_ms"] - by[m, c]["median_ms"] if (m, c) in by else None for m in models],
        )
        for c in cands
    }
    fig = Figure(figsize=(max(6, 1.8 * len(models)), 4.2), layout="constrained")
    ax = fig.add_subplot()
    _bars(ax, models, series, err)
    ax.set_yscale("log")
    ax.set_ylabel("EMA update time per step (ms, log scale)")
    ax.set_xlabel("model")
    name = record["devices"][device]["environment"].get("device_name", device)
    ax.set_title(f"{device} ({name}), {threads} thread(s); whiskers: IQR", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_threads(record: dict[str, Any], device: str) -> Figure:
    """Thread scaling: median update time (log) against intra-op thread count, one panel per model."""
    record = upgrade(record)
    counts = record["settings"]["threads"]
    rows = [r for r in record["results"] if r["device"] == device]
    models = list(dict.fromkeys(r["model"] for r in rows))
    cands = list(dict.fromkeys(r["candidate"] for r in rows))
    by = {(r["model"], r["candidate"], r["threads"]): r for r in rows}
    fig = Figure(figsize=(max(6, 3.2 * len(models)), 4.2), layout="constrained")
    axes = [fig.add_subplot(1, len(models), i + 1) for i in range(len(models))]
    for ax, model in zip(axes, models):
        for c in cands:
            pts = [(n, by[model, c, n]) for n in counts if (model, c, n) in by]
            if not pts:
                continue
            style = "s--" if c in ("floor", "copy") else "o-"
            ax.errorbar(
                [n for n, _ in pts],
                [r["median_ms"] for _, r in pts],
                yerr=[
                    [r["median_ms"] - r["q1_ms"] for _, r in pts],
                    [r["q3_ms"] - r["median_ms"] for _, r in pts],
                ],
                fmt=style,
                capsize=2,
                label=c,
            )
        ax.set_yscale("log")
        ax.set_xticks(counts)
        ax.set_xlabel("intra-op threads")
        ax.set_title(model, fontsize=9)
    axes[0].set_ylabel("EMA update time per step (ms, log scale)")
    axes[-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    name = record["devices"][device]["environment"].get("device_name", device)
    fig.suptitle(
        f"{device} ({name}): thread scaling, median and IQR of {record['settings']['rounds']} rounds",
        fontsize=9,
    )
    return fig


def plot_cost_model(cost: dict[str, Any]) -> Figure:
    """The cost model of one device: launch-bound (time vs tensor count) and bandwidth-bound panels.

    A version-3 cost model (it has ``llc_bytes``) is drawn by
    :func:`ema_lab.bench.costmodel.plot_cost_regimes`: achieved bandwidth per working set, with the
    floor's cache and DRAM fits. An older one has a single bandwidth fitted on its sweep's sizes; its
    size panel draws each fit only over the sizes it was fitted on, since beyond them (past the
    last-level cache) that bandwidth no longer holds.
    """
    if "llc_bytes" in cost:
        return _legends_beside(plot_cost_regimes(cost))
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    plot_count_panel(left, cost)
    pts = cost["points"]
    for strategy in ("loop", "foreach"):
        fit = cost["fits"][strategy]
        bw = fit["bandwidth_gbps"]
        sel = sorted(
            (p for p in pts if p["tensors"] == cost["fixed_tensors"] and p["strategy"] == strategy),
            key=lambda p: p["elements"],
        )
        x = [p["elements"] * 4 / 2**20 for p in sel]
        line = right.plot(x, [1e3 * p["median_s"] for p in sel], "o", label=f"{strategy}: measured")[0]
        fitted = [
            1e3 * (fit["overhead_per_op_us"] * 1e-6 * p["units"] + (p["bytes"] / (bw * 1e9) if bw else 0.0))
            for p in sel
        ]
        right.plot(x, fitted, "-", color=line.get_color(), alpha=0.6, label=f"{strategy}: fit")
    for ref, style in (("floor", "s--"), ("copy", "^:")):
        sel = sorted((p for p in pts if p["strategy"] == ref), key=lambda p: p["elements"])
        label = f"{ref}: one {'lerp_' if ref == 'floor' else 'copy_'} over 1 buffer"
        right.plot(
            [p["elements"] * 4 / 2**20 for p in sel], [1e3 * p["median_s"] for p in sel], style, label=label
        )
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel(f"total size of {cost['fixed_tensors']} EMA tensors (MiB per side, float32)")
    right.set_ylabel("update time (ms, median)")
    right.legend(fontsize=7)
    largest = max((p["elements"] * 4 for p in pts), default=0)
    right.set_title(
        f"older result file: one bandwidth per strategy, fitted on sizes up to {largest / 2**20:.0f} MiB\n"
        "per side (no cache/DRAM split; the fit lines end where the fitted sizes do)",
        fontsize=8,
    )
    return _legends_beside(fig)


def _legends_beside(fig: Figure) -> Figure:
    """Move each panel's legend out to its right, where it cannot cover a data point; widen to match."""
    for ax in fig.axes:
        if ax.get_legend() is not None:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.set_size_inches(15, 4.2)
    return fig


def plot_compare(records: list[dict[str, Any]], candidates: tuple[str, ...] = ()) -> Figure:
    """Speed-up vs seed_before (log scale) of every run, one panel per model present in any run.

    A run is one (record, device, thread count), labelled by :func:`ema_lab.bench.results.run_label`,
    so runs from one machine stay apart. ``floor`` (one ``lerp_`` over flat buffers) is a bound, not
    a strategy: it is drawn as a dashed line in the run's colour. Settings in which the runs differ
    are written under the figure.
    """
    records = [upgrade(r) for r in records]
    runs = []  # (label, device, threads, record)
    for rec in records:
        for dev, status in rec["devices"].items():
            if status["status"] == "measured":
                runs += [(run_label(rec, dev, n), dev, n, rec) for n in rec["settings"]["threads"]]
    labels = [label for label, *_ in runs]
    for i, label in enumerate(labels):  # two files with identical settings to the minute: number them
        if labels.count(label) > 1:
            runs[i] = (f"{label} #{labels[:i].count(label) + 1}", *runs[i][1:])
    models = list(dict.fromkeys(r["model"] for rec in records for r in rec["results"]))
    cands = list(candidates) or list(
        dict.fromkeys(r["candidate"] for rec in records for r in rec["results"] if r["kind"] == "strategy")
    )
    cands = [c for c in cands if c not in ("floor", "copy")]
    fig = Figure(figsize=(max(7, 3.4 * len(models)), 4.6 + 0.22 * len(runs)), layout="constrained")
    axes = [fig.add_subplot(1, len(models), i + 1) for i in range(len(models))]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(cands))
    for ax, model in zip(axes, models):
        for i, (label, dev, n, rec) in enumerate(runs):
            by = {
                r["candidate"]: r
                for r in rec["results"]
                if r["device"] == dev and r["threads"] == n and r["model"] == model
            }
            v = np.array([by[c]["speedup_vs_seed_before"] if c in by else np.nan for c in cands], dtype=float)
            ax.bar(x + (i - (len(runs) - 1) / 2) * width, v, width, color=colors[i], label=label)
            if "floor" in by:
                ax.axhline(by["floor"]["speedup_vs_seed_before"], color=colors[i], ls="--", lw=1.2)
        # Said in the title: text inside the panel would be drawn over the other runs' bars.
        absent = [
            str(i + 1)
            for i, (_, dev, n, rec) in enumerate(runs)
            if not any(
                r["device"] == dev and r["threads"] == n and r["model"] == model for r in rec["results"]
            )
        ]
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(x, cands)
        note = f"\nnot measured in run{'s' * (len(absent) > 1)} {', '.join(absent)}" if absent else ""
        ax.set_title(model + note, fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    axes[0].set_ylabel("speed-up vs seed_before (x, log scale)")
    handles, _ = axes[0].get_legend_handles_labels()
    from matplotlib.lines import Line2D

    handles = [h for h in handles if not isinstance(h, Line2D)]
    handles.append(
        Line2D([], [], color="black", ls="--", label="floor: one lerp_ over flat buffers (a bound)")
    )
    fig.legend(handles=handles, loc="outside lower center", fontsize=7, ncols=1)
    diffs = settings_differences(records)
    if diffs:
        fig.suptitle("NOTE, unlike settings:\n" + "\n".join(diffs), fontsize=8, color="darkred")
    return fig
