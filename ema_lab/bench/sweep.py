"""The main job: time every EMA strategy on the model zoo on every available device, save JSON and plots.

For each (device, model, thread count) the candidates (:func:`candidate_names`) are timed interleaved
(:func:`ema_lab.bench.timing.time_candidates`), their dispatched ops counted
(:func:`ema_lab.bench.counting.count_ops`) and, on CUDA, their kernel launches:

- ``seed_before`` (the baseline) and ``seed_after``: ultralytics PR #25315's before- and after-code;
- every strategy of :data:`ema_lab.ema.STRATEGIES` through ``ModelEMA(model, strategy=s).update``, and
  ``flat_model``: the default ``ModelEMA`` of a twin of the model after ``ema_lab.flatten_model``;
- ``floor``: one ``lerp_`` over two flat buffers of the model's floats, allocated as ema_lab's own are
  (:func:`ema_lab.buffers.empty_flat`): the best any update of that model can do, the reference of every
  row's ``floor_fraction``; ``copy``: one ``copy_`` of those bytes (on a CPU its store also reads its
  destination, write-allocate, so it is no cheaper yardstick than the floor and gets no fraction).

The decay is the ramp's value after ``RAMP_UPDATES`` steps (about 0.9999); the cost model runs at the
first thread count.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..buffers import empty_flat
from ..ema import STRATEGIES, ModelEMA
from ..flatten import flatten_model
from . import models as zoo
from .costmodel import run_cost_model
from .counting import count_ops, kernel_launches_or_reason, without_views
from .environment import available_devices, environment
from .results import (
    SCHEMA,
    SCHEMA_VERSION,
    Row,
    load_many,
    machine_label,
    measured_devices,
    measured_runs,
    result_stem,
    run_label,
    settings_differences,
    validate,
)
from .seed import seed_after, seed_before
from .timing import progress_bar, time_candidates

__all__ = ["DEFAULT_MODELS", "QUICK_MODELS", "run_bench", "write_results", "compare"]

# gpt2 (124M parameters) is left out by default: every candidate holds its own EMA copy, about 4 GB in
# all, and it measures nothing resnet50 does not (both bandwidth-bound, beyond the cache); ask for it.
DEFAULT_MODELS = ("yolo", "resnet50", "tiny_tensors")
QUICK_MODELS = ("yolo", "tiny_tensors")  # the two launch-bound models; copying 100-340 MB models dominates
BASELINE = "seed_before"
REFERENCES = ("floor", "copy")
FLAT_MODEL = "flat_model"  # the default ModelEMA of the model after flatten_model
RAMP_UPDATES = 20_000  # ModelEMA's ramp gives decay 0.9999 * (1 - exp(-10)) = 0.99986 here


def candidate_names() -> list[str]:
    """Every candidate name, baseline first; ``ModelEMA`` strategies are read from STRATEGIES at call time."""
    return [BASELINE, "seed_after", *STRATEGIES, FLAT_MODEL, *REFERENCES]


def resolve_devices(device: str) -> dict[str, str | None]:
    """Every device ema_lab knows -> None to measure it, else why not; "cpu"/"cuda"/"mps"/"all" picks."""
    avail = available_devices()
    if device == "all":
        return avail
    if device not in avail:
        raise ValueError(f"unknown device {device!r}; expected one of {[*avail, 'all']}")
    if avail[device] is not None:
        raise ValueError(f"device {device!r} is not available ({avail[device]})")
    skipped = {d: why or f"skipped: not requested (--device {device})" for d, why in avail.items()}
    return skipped | {device: None}


def _decay() -> float:
    """The decay every candidate applies: ModelEMA's ramp after ``RAMP_UPDATES`` updates."""
    return ModelEMA(torch.nn.Linear(1, 1)).decay(RAMP_UPDATES)


def candidates(
    model: torch.nn.Module, names: Sequence[str], rebuild: Callable[[], torch.nn.Module]
) -> dict[str, Callable[[], object]]:
    """Zero-argument update functions for each candidate on ``model``; ``rebuild()`` makes a fresh twin."""
    decay = _decay()
    out: dict[str, Callable[[], object]] = {}
    if {"seed_before", "seed_after"} & set(names):
        seed_ema = deepcopy(model).eval()
        out["seed_before"] = lambda: seed_before(seed_ema, model, decay)
        out["seed_after"] = lambda: seed_after(seed_ema, model, decay)
    if set(REFERENCES) & set(names):
        # In the memory ema_lab's own flat buffers get (2 MiB pages where granted), so no strategy beats it.
        values = torch.cat(
            [v.reshape(-1).float() for v in model.state_dict().values() if v.is_floating_point()]
        )
        ema, twin = (empty_flat(values.numel(), values.dtype, values.device).copy_(values) for _ in range(2))
        out["floor"] = lambda: ema.lerp_(twin, 1 - decay)
        out["copy"] = lambda: ema.copy_(twin)
    return {k: out[k] if k in out else _model_ema_step(model, k, rebuild) for k in names}


def _model_ema_step(
    model: torch.nn.Module, name: str, rebuild: Callable[[], torch.nn.Module]
) -> Callable[[], object]:
    """``ModelEMA(model, strategy=name).update``; for ``flat_model`` the default EMA of a flattened twin."""
    if name == FLAT_MODEL:
        model = rebuild()  # flattening re-points the model's tensors: the others keep the original layout
        flatten_model(model)
    ema = ModelEMA(model, strategy="auto" if name == FLAT_MODEL else name)
    ema.update(model)
    ema.updates = RAMP_UPDATES
    return lambda: ema.update(model)


def _kind(name: str) -> str:
    return "baseline" if name == BASELINE else "reference" if name in REFERENCES else "strategy"


def floor_fraction(candidate: str, floor_s: float | None, median_s: float) -> float | None:
    """The floor's median time over ``candidate``'s (1.0: as fast); None for ``copy`` or without a floor.

    ``copy`` is not an EMA update (it does not read two inputs), so a fraction of the floor says
    nothing about it; its row keeps only its time.
    """
    if floor_s is None or candidate == "copy":
        return None
    return floor_s / median_s


def _measure_model(
    device: str, name: str, names: Sequence[str], threads: int, rounds: int, quick: bool, tick: Callable
) -> list[dict[str, Any]]:
    """Rows for one (device, model): op counts, kernel launches, interleaved timings."""
    model = zoo.build(name).to(device)
    stats = zoo.describe(model)
    fns = candidates(model, names, lambda: zoo.build(name).to(device))
    for fn in fns.values():  # first call builds caches (ModelEMA's pairs): count the steady state
        fn()
    ops = {k: count_ops(fn) for k, fn in fns.items()}
    kernels = {k: kernel_launches_or_reason(fn, device=device) for k, fn in fns.items()}
    timed = time_candidates(
        fns, device, rounds=rounds, target_s=0.005 if quick else 0.02, threads=threads, on_round=tick
    )
    base = timed[BASELINE].median_s
    floor = timed["floor"].median_s if "floor" in timed else None
    rows = []
    for k, t in timed.items():
        launches = kernels[k]
        row = Row(
            device=device,
            model=name,
            candidate=k,
            kind=_kind(k),
            stats=asdict(stats),
            ops=dict(sorted(ops[k].items())),
            ops_total=sum(ops[k].values()),
            ops_compute=sum(without_views(ops[k]).values()),
            kernel_launches=None if isinstance(launches, str) else sum(launches.values()),
            kernel_launches_note=launches if isinstance(launches, str) else None,
            median_ms=1e3 * t.median_s,
            q1_ms=1e3 * t.q1_s,
            q3_ms=1e3 * t.q3_s,
            rounds=t.rounds,
            number=t.number,
            threads=t.threads,
            speedup_vs_seed_before=base / t.median_s,
            floor_fraction=floor_fraction(k, floor, t.median_s),
        )
        rows.append(asdict(row))
    del model, fns
    gc.collect()
    return rows


def thread_counts(threads: int | Sequence[int]) -> list[int]:
    """``1`` or ``(1, 2)`` as a list of distinct thread counts >= 1; anything else raises ValueError."""
    counts = [threads] if isinstance(threads, int) else list(threads)
    if not counts:
        raise ValueError("--threads needs at least one thread count")
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--threads must be >= 1, got {n}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"--threads lists a thread count twice: {counts}")
    return counts


def run_bench(
    device: str = "cpu",
    models: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    threads: int | Sequence[int] = 1,
    quick: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the sweep and return the (validated) result record; see the module docstring for what runs.

    ``models`` defaults to DEFAULT_MODELS, or QUICK_MODELS when ``quick``; ``threads`` is one intra-op
    thread count or several, each measured in this run.
    """
    models = list(models or (QUICK_MODELS if quick else DEFAULT_MODELS))
    for m in models:
        if m not in zoo.ZOO:
            raise ValueError(f"unknown model {m!r}; expected one of {sorted(zoo.ZOO)}")
    known = candidate_names()
    for s in strategies or ():
        if s not in known:
            raise ValueError(f"unknown strategy {s!r}; expected one of {known}")
    counts = thread_counts(threads)
    devices = resolve_devices(device)  # every known device appears in the result, measured or not
    # The baseline (for speed-ups) and the references (the floor for each row's floor fraction, the
    # copy for what moving the same bytes costs) are always measured.
    chosen = [c for c in known if c in {BASELINE, *REFERENCES, *(strategies or known)}]
    rounds = 3 if quick else 9  # 9 interleaved rounds: a stable median within the 3-minute budget on 2 cores
    previous = torch.get_num_threads()
    torch.set_num_threads(counts[0])
    try:
        record: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment("cpu"),
            "settings": {
                "quick": quick,
                "threads": counts,
                "rounds": rounds,
                "models": list(models),
                "candidates": chosen,
                "decay": _decay(),
            },
            "devices": {},
            "results": [],
            "cost_model": {},
        }
        for dev, reason in devices.items():
            if reason is not None:
                record["devices"][dev] = {"status": reason}
                continue
            record["devices"][dev] = {"status": "measured", "environment": environment(dev)}
            # A step is one round of every candidate on one model; the cost model then draws its own
            # bar, whose steps are its sizes.
            steps = len(models) * len(counts) * rounds
            with progress_bar(total=steps, disable=not progress, unit="round") as bar:
                for name in models:
                    for n in counts:
                        bar.set_description(f"{dev} {name} {n} thread(s)")
                        record["results"] += _measure_model(
                            dev, name, chosen, n, rounds, quick, lambda _r: bar.update(1)
                        )
            cost = run_cost_model(dev, quick=quick, threads=counts[0], rounds=rounds, progress=progress)
            record["cost_model"][dev] = cost.as_dict()
    finally:
        torch.set_num_threads(previous)
    gpus = [
        record["devices"][d]["environment"]["device_name"] for d in measured_devices(record) if d != "cpu"
    ]
    record["machine"] = machine_label(record["environment"], gpus)
    record = json.loads(json.dumps(record, default=_jsonable))  # numpy floats -> plain JSON numbers
    validate(record)
    return record


def _jsonable(obj: object) -> object:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in a result file")


def write_results(record: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``<stem>.json`` plus PNGs per measured device into ``out``; never replace an existing file.

    The stem (:func:`ema_lab.bench.results.result_stem`) is unique per run. If any file this run
    would write exists already, nothing is written and ``FileExistsError`` names it.
    """
    from .plots import plot_cost_model, plot_threads, plot_times

    validate(record)
    out = Path(out)
    stem = result_stem(record)
    counts = record["settings"]["threads"]
    figures: dict[Path, Callable[[], Any]] = {}
    measured = measured_devices(record)
    for dev in measured:
        # The stem ends with the measured devices; a file names its device only when there are several.
        base = f"{stem}_{dev}" if len(measured) > 1 else stem
        for n in counts:
            suffix = "times" if len(counts) == 1 else f"times_{n}t"
            figures[out / f"{base}_{suffix}.png"] = lambda dev=dev, n=n: plot_times(record, dev, n)
        figures[out / f"{base}_costmodel.png"] = lambda dev=dev: plot_cost_model(record["cost_model"][dev])
        if len(counts) > 1:
            figures[out / f"{base}_threads.png"] = lambda dev=dev: plot_threads(record, dev)
    path = out / f"{stem}.json"
    for p in (path, *figures):
        if p.exists():
            raise FileExistsError(f"{p} exists already; a run never replaces another (move it away first)")
    out.mkdir(parents=True, exist_ok=True)
    with path.open("x") as f:  # "x": fail rather than replace, even if another process wrote it meanwhile
        f.write(json.dumps(record, indent=1, allow_nan=False) + "\n")
    paths = [path]
    for png, make in figures.items():
        make().savefig(png, dpi=110)
        paths.append(png)
    return paths


def compare(files: Sequence[str | Path], plot: str | Path | None = None) -> str:
    """The table of several result files (an invalid one raises ResultError); with ``plot``, their figure.

    Each (file, device, thread count) is one labelled run; the table first lists the runs and every
    setting in which they differ, so that unlike runs are not read as like.
    """
    from .plots import plot_compare

    if not files:
        raise ValueError("compare needs at least one result file")
    loaded, notes = load_many(list(files))
    records = [rec for _, rec in loaded]
    lines = [*notes, *settings_differences(records)]
    runs = [(f, rec, dev, n) for f, rec in loaded for dev, n in measured_runs(rec)]
    lines += [f"run {i}: {run_label(rec, dev, n)}  ({f.name})" for i, (f, rec, dev, n) in enumerate(runs, 1)]
    lines.append(f"{'run':<5}{'device':<7}{'model':<17}{'candidate':<13}{'median ms':>10}{'speed-up':>10}")
    for i, (_f, rec, dev, n) in enumerate(runs, 1):
        for r in rec["results"]:
            if r["kind"] != "reference" and r["device"] == dev and r["threads"] == n:
                lines.append(
                    f"{i:<5}{dev:<7}{r['model']:<17}{r['candidate']:<13}"
                    f"{r['median_ms']:>10.3f}{r['speedup_vs_seed_before']:>9.1f}x"
                )
    if plot is not None:  # only where asked: a file per call would pile up in the reader's results/
        plot_compare(records).savefig(plot, dpi=110)
    return "\n".join(lines)
