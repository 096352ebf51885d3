"""Figures of bench results (update time per candidate, the cost model, several machines side by side).

Built on ``matplotlib.figure.Figure`` rather than pyplot, so saving PNGs needs no GUI backend and
no global state; in a notebook the returned figure displays itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure

from .costmodel import BYTES_PER_ELEMENT, DEFAULT_LLC_BYTES, cost_seconds
from .results import measured_runs, run_label, settings_differences

__all__ = ["plot_times", "plot_threads", "plot_cost_model", "plot_compare"]


def plot_times(record: dict[str, Any], device: str, threads: int | None = None) -> Figure:
    """Median EMA update time (ms, log scale, IQR whiskers) per model and candidate on one device.

    ``threads`` picks one of the run's thread counts (default: the first).
    """
    threads = record["settings"]["threads"][0] if threads is None else threads
    rows = [r for r in record["results"] if r["device"] == device and r["threads"] == threads]
    models = list(dict.fromkeys(r["model"] for r in rows))
    cands = list(dict.fromkeys(r["candidate"] for r in rows))
    by = {(r["model"], r["candidate"]): r for r in rows}
    fig = Figure(figsize=(max(6, 1.8 * len(models)), 4.2), layout="constrained")
    ax = fig.add_subplot()
    x, width = np.arange(len(models)), 0.8 / len(cands)
    for i, c in enumerate(cands):  # one bar per candidate in each model's group; NaN leaves a gap
        got = [by.get((m, c)) for m in models]
        median = [r["median_ms"] if r else np.nan for r in got]
        iqr = [[r["median_ms"] - r["q1_ms"] if r else np.nan for r in got]]
        iqr += [[r["q3_ms"] - r["median_ms"] if r else np.nan for r in got]]
        ax.bar(x + (i - (len(cands) - 1) / 2) * width, median, width, label=c, yerr=iqr, capsize=2)
    ax.set_xticks(x, models)
    ax.set_yscale("log")
    ax.set_ylabel("EMA update time per step (ms, log scale)")
    ax.set_xlabel("model")
    name = record["devices"][device]["environment"].get("device_name", device)
    ax.set_title(f"{device} ({name}), {threads} thread(s); whiskers: IQR", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_threads(record: dict[str, Any], device: str) -> Figure:
    """Thread scaling: median update time (log) against intra-op thread count, one panel per model."""
    counts = record["settings"]["threads"]
    rows = [r for r in record["results"] if r["device"] == device]
    models = list(dict.fromkeys(r["model"] for r in rows))
    cands = list(dict.fromkeys(r["candidate"] for r in rows))
    by = {(r["model"], r["candidate"], r["threads"]): r for r in rows}
    fig = Figure(figsize=(max(6, 3.2 * len(models)), 4.2), layout="constrained")
    axes = [fig.add_subplot(1, len(models), i + 1) for i in range(len(models))]
    for ax, model in zip(axes, models):
        for c in cands:
            got = [(n, by[model, c, n]) for n in counts if (model, c, n) in by]
            median = [r["median_ms"] for _, r in got]
            iqr = [
                [r["median_ms"] - r["q1_ms"] for _, r in got],
                [r["q3_ms"] - r["median_ms"] for _, r in got],
            ]
            style = "s--" if c in ("floor", "copy") else "o-"
            ax.errorbar([n for n, _ in got], median, yerr=iqr, fmt=style, capsize=2, label=c)
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


def _count_panel(ax: Any, cost: dict[str, Any]) -> None:
    """Time vs tensor count at a fixed total size (inside the cache), measured and fitted."""
    pts, fits = cost["points"], cost["fits"]
    for strategy in ("loop", "foreach"):
        fit = fits[strategy]
        sel = sorted(
            (p for p in pts if p["sweep"] == "count" and p["strategy"] == strategy),
            key=lambda p: p["tensors"],
        )
        x = [p["tensors"] for p in sel]
        line = ax.plot(x, [1e3 * p["median_s"] for p in sel], "o", label=f"{strategy}: measured")[0]
        fitted = [
            1e3 * cost_seconds(fit["overhead_per_op_us"], fit["bandwidth_gbps"], p["units"], p["bytes"])
            for p in sel
        ]
        ax.plot(x, fitted, "-", color=line.get_color(), alpha=0.6, label=f"{strategy}: fit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"tensors holding {cost['fixed_elements']:,} float32 elements in all")
    ax.set_ylabel("update time (ms, median)")
    ax.set_title(
        f"launch-bound: {fits['loop']['overhead_per_op_us']:.2f} us per dispatched op (loop)", fontsize=9
    )


def _bandwidth_panel(ax: Any, cost: dict[str, Any]) -> None:
    """Counted bytes per second vs working set, the cache/DRAM split and the floor's fitted bandwidths."""
    llc, knee = cost.get("llc_bytes"), cost.get("knee_bytes")
    split = cost.get("split_bytes") or llc or DEFAULT_LLC_BYTES
    for strategy, style in (("loop", "o-"), ("foreach", "s-"), ("floor", "D-"), ("copy", "^:")):
        sel = [
            p
            for p in cost["points"]
            if p["strategy"] == strategy and (p["sweep"] != "count" or p["tensors"] == cost["fixed_tensors"])
        ]
        sel.sort(key=lambda p: p["elements"])
        ax.plot(
            [p["working_set_bytes"] / 2**20 for p in sel],
            [p["bytes"] / p["median_s"] / 1e9 for p in sel],
            style,
            label=f"{strategy} ({BYTES_PER_ELEMENT[strategy]} accesses per element)",
        )
    ax.axvspan(
        split / 2 / 2**20, 2 * split / 2**20, color="grey", alpha=0.15, label="transition (not fitted)"
    )
    if knee:
        ax.axvline(knee / 2**20, color="C3", ls="-", lw=1, label=f"measured knee {knee / 2**20:.0f} MiB")
    if llc:
        by = (
            "last-level cache as reported by the OS"
            if cost.get("device", "cpu") == "cpu"
            else "L2 cache as reported by CUDA"
        )
        ax.axvline(llc / 2**20, color="grey", ls=":", label=f"{by}: {llc / 2**20:.0f} MiB")
    floor = cost["fits"]["floor"]
    for key, name in (("bandwidth_gbps", "cache"), ("dram_bandwidth_gbps", "DRAM")):
        if floor.get(key):
            ax.axhline(floor[key], color="k", lw=0.8, ls="--" if name == "DRAM" else "-")
            ax.annotate(
                f"floor fit, {name}: {floor[key]:.0f} GB/s",
                xy=(0.01, floor[key]),
                xycoords=("axes fraction", "data"),
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=7,
            )
    ax.set_xscale("log")
    ax.set_xlabel("working set: EMA + model (MiB, float32)")
    ax.set_ylabel("counted bytes / time (GB/s)")
    ax.set_title("bandwidth-bound: cache, then DRAM beyond the knee", fontsize=9)


def plot_cost_model(cost: dict[str, Any]) -> Figure:
    """The cost model of one device: time vs tensor count (launch-bound), GB/s vs working set (cache, DRAM).

    ``cost`` is :meth:`ema_lab.bench.costmodel.CostModel.as_dict` (a result file's ``cost_model[device]``).
    """
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    _count_panel(left, cost)
    _bandwidth_panel(right, cost)
    for ax in (left, right):  # beside each panel, where a legend cannot cover a data point
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_compare(records: list[dict[str, Any]], candidates: tuple[str, ...] = ()) -> Figure:
    """Speed-up vs seed_before (log scale) of every run, one panel per model present in any run.

    A run is one (record, device, thread count), labelled by :func:`ema_lab.bench.results.run_label`,
    so runs from one machine stay apart. ``floor`` (one ``lerp_`` over flat buffers) is a bound, not
    a strategy: it is drawn as a dashed line in the run's colour. Settings in which the runs differ
    are written under the figure.
    """
    runs = [(run_label(rec, dev, n), dev, n, rec) for rec in records for dev, n in measured_runs(rec)]
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
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(cands))
    for ax, model in zip(axes, models):
        absent = []  # said in the title: text inside the panel would be drawn over the other runs' bars
        for i, (label, dev, n, rec) in enumerate(runs):
            by = {
                r["candidate"]: r
                for r in rec["results"]
                if r["device"] == dev and r["threads"] == n and r["model"] == model
            }
            if not by:
                absent.append(str(i + 1))
            v = np.array([by[c]["speedup_vs_seed_before"] if c in by else np.nan for c in cands], dtype=float)
            ax.bar(x + (i - (len(runs) - 1) / 2) * width, v, width, color=f"C{i % 10}", label=label)
            if "floor" in by:
                ax.axhline(by["floor"]["speedup_vs_seed_before"], color=f"C{i % 10}", ls="--", lw=1.2)
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
