"""The bench result file: its schema, a validator, loading, file names and the printed table.

A result is one JSON object (``SCHEMA``, ``SCHEMA_VERSION``) holding the environment it ran in, the
settings (``threads``: the list of thread counts measured), every device's status (measured, or the
"skipped: <reason>" text), one :class:`Row` per (device, model, candidate, thread count) and the cost
model per measured device (measured at the first thread count: a fit per strategy with a cache and a
DRAM bandwidth, ``dram_bandwidth_gbps`` None when the sweep stayed in the cache).

Each run's files share a stem that is unique per run (:func:`result_stem`): machine, date and time
of day (UTC, to the second), quick or full, thread counts and measured devices, e.g.
``linux-amd-epyc-2c_2026-12-03T091512Z_quick_t1-2_cpu``. Older files are named ``<machine>_<date>``.
"""

from __future__ import annotations

import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import ModelStats

__all__ = ["Row", "ResultError", "results_dir", "load", "load_many", "bench_files", "format_table"]
__all__ += ["machine_label"]


def results_dir() -> Path:
    """The folder of result files: ``$EMA_LAB_RESULTS`` if set, else ``results/`` of the ema_lab checkout.

    Notebooks call this instead of reading ``../results``, so a copy of them opened anywhere, or a
    kernel started in another folder, still finds the committed runs.
    """
    env = os.environ.get("EMA_LAB_RESULTS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "results"


SCHEMA = "ema_lab.bench"
SCHEMA_VERSION = 3


class ResultError(ValueError):
    """A result object or file does not match the schema; the message names the field."""


@dataclass(frozen=True)
class Row:
    """A row of ``results``: one candidate on one (device, model, thread count); its fields are the schema."""

    device: str
    model: str
    candidate: str
    kind: str  # "baseline" (seed_before), "strategy" or "reference" (floor, copy)
    stats: dict  # the model's ModelStats: what one update touches
    ops: dict  # dispatched ATen ops per update, by overload name (count_ops)
    ops_total: int
    ops_compute: int  # ops_total without views
    kernel_launches: int | None  # CUDA kernels per update; None where they cannot be counted ...
    kernel_launches_note: str | None  # ... and then why
    median_ms: float
    q1_ms: float
    q3_ms: float
    rounds: int
    number: int  # calls per measurement
    threads: int
    speedup_vs_seed_before: float
    # The floor's median over this row's (same device, model, threads); None for copy (not an EMA
    # update) and where no floor ran.
    floor_fraction: float | None


def _spec(cls: type) -> dict[str, tuple[type, ...]]:
    """A dataclass's fields and the JSON types each accepts (a float field takes an int too)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (typing.get_origin(hint) or hint,)
        out[name] = tuple(t for a in args for t in ((int, float) if a is float else (a,)))
    return out


_NUM = (int, float)
# field -> accepted types, for each part of the record (None is listed where a value may be missing)
_TOP = {"schema": (str,), "schema_version": (int,), "created": (str,), "machine": (str,), "results": (list,)}
_TOP |= dict.fromkeys(("environment", "settings", "devices", "cost_model"), (dict,))
_SETTINGS = {"quick": (bool,), "threads": (list,), "rounds": (int,), "models": (list,), "candidates": (list,)}
_ENV = {"torch": (str,), "python": (str,), "os": (str,), "cpu": (str,), "threads": (int,), "ema_lab": (str,)}
_ROW = _spec(Row)
_STATS = _spec(ModelStats)
_COST = {"fits": (dict,), "points": (list,), "floor_fraction": (dict,), "llc_bytes": (int, type(None))}
_FIT = {
    "overhead_per_op_us": _NUM,
    "bandwidth_gbps": (*_NUM, type(None)),
    "dram_bandwidth_gbps": (*_NUM, type(None)),
    "unit": (str,),
}
_KINDS = {"baseline", "strategy", "reference"}


def _check_fields(obj: Any, spec: dict[str, tuple], where: str) -> None:
    if not isinstance(obj, dict):
        raise ResultError(f"{where}: expected an object, got {type(obj).__name__}")
    for key, accepted in spec.items():
        if key not in obj:
            raise ResultError(f"{where}: missing field {key!r}")
        value = obj[key]
        # bool is an int subclass: accept it only where bool is listed.
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            names = "/".join(t.__name__ for t in accepted)
            raise ResultError(f"{where}.{key}: expected {names}, got {type(value).__name__} {value!r:.40}")


def validate(record: Any) -> None:
    """Raise :class:`ResultError` naming the first field of ``record`` that does not match the schema."""
    _check_fields(record, _TOP, "result")
    if record["schema"] != SCHEMA:
        raise ResultError(f"result.schema: expected {SCHEMA!r}, got {record['schema']!r}")
    if record["schema_version"] != SCHEMA_VERSION:
        raise ResultError(
            f"result.schema_version: this ema_lab reads version {SCHEMA_VERSION} only, "
            f"got {record['schema_version']}"
        )
    _check_fields(record["settings"], _SETTINGS, "result.settings")
    threads = record["settings"]["threads"]
    if not threads or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in threads):
        raise ResultError(f"result.settings.threads: expected a non-empty list of ints >= 1, got {threads!r}")
    if len(set(threads)) != len(threads):
        raise ResultError(f"result.settings.threads: a thread count is listed twice: {threads!r}")
    _check_fields(record["environment"], _ENV, "result.environment")
    measured = set()
    for dev, status in record["devices"].items():
        where = f"result.devices.{dev}"
        _check_fields(status, {"status": (str,)}, where)
        if status["status"] == "measured":
            _check_fields(status, {"environment": (dict,)}, where)
            measured.add(dev)
        elif not status["status"].startswith("skipped: "):
            raise ResultError(
                f"{where}.status: expected 'measured' or 'skipped: <reason>', got {status['status']!r}"
            )
    for i, row in enumerate(record["results"]):
        where = f"result.results[{i}]"
        _check_fields(row, _ROW, where)
        _check_fields(row["stats"], _STATS, f"{where}.stats")
        if row["device"] not in measured:
            raise ResultError(f"{where}.device: {row['device']!r} is not a measured device")
        if row["threads"] not in threads:
            raise ResultError(f"{where}.threads: {row['threads']} is not in settings.threads {threads}")
        if row["kind"] not in _KINDS:
            raise ResultError(f"{where}.kind: expected one of {sorted(_KINDS)}, got {row['kind']!r}")
        times = (row["q1_ms"], row["median_ms"], row["q3_ms"])
        if not all(math.isfinite(t) and t > 0 for t in times) or not times[0] <= times[1] <= times[2]:
            raise ResultError(f"{where}: expected 0 < q1_ms <= median_ms <= q3_ms, got {times}")
        if (row["kernel_launches"] is None) == (row["kernel_launches_note"] is None):
            raise ResultError(f"{where}: give kernel_launches or a kernel_launches_note, exactly one")
    for dev, cm in record["cost_model"].items():
        if dev not in measured:
            raise ResultError(f"result.cost_model.{dev}: {dev!r} is not a measured device")
        _check_fields(cm, _COST, f"result.cost_model.{dev}")
        for name, fit in cm["fits"].items():
            _check_fields(fit, _FIT, f"result.cost_model.{dev}.fits.{name}")


def load(path: str | Path) -> dict[str, Any]:
    """Read and validate one result file; errors name the file and the field."""
    try:
        record = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ResultError(f"cannot read result file {str(path)!r}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultError(f"{str(path)!r} is not a JSON result file: {exc}") from None
    try:
        validate(record)
    except ResultError as exc:
        raise ResultError(f"{str(path)!r} is not a valid ema_lab result: {exc}") from None
    return record


def load_many(paths: list[str | Path]) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """Load every bench result among ``paths``; JSON files of other tools (no bench schema) are skipped.

    Returns ([(path, record)], notes on skipped files). A broken bench file still raises, and so does a
    list with no bench result at all: ``results/`` may hold other JSON (a peers benchmark), but a
    typo must not pass silently.
    """
    records, skipped = [], []
    for path in map(Path, paths):
        try:
            records.append((path, load(path)))
        except ResultError:
            if _schema(path) in (SCHEMA, None):  # a broken bench file, or no JSON object at all
                raise
            skipped.append(path.name)
    notes = []
    if skipped:  # one line, however many: the runs compared are what the reader came for
        names = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        notes.append(
            f'skipped {len(skipped)} file(s) that are not bench runs (no "schema": "{SCHEMA}"): {names}'
        )
    if not records:
        raise ResultError(
            f"no {SCHEMA} result among {[str(p) for p in paths]}" + "".join(f"; {n}" for n in notes)
        )
    return records, notes


def bench_files(folder: str | Path) -> list[Path]:
    """The ``*.json`` files in ``folder`` and one level down (``results/gpu-<machine>/``) that declare the
    bench schema, sorted: other tools' JSON is left out; a broken bench file is listed, for :func:`load`."""
    paths = sorted([*Path(folder).glob("*.json"), *Path(folder).glob("*/*.json")])
    return [path for path in paths if _schema(path) == SCHEMA]


def _schema(path: Path) -> str | None:
    """The ``"schema"`` a JSON file declares ("" for none); None where it is no readable JSON object."""
    try:
        return json.loads(path.read_text()).get("schema", "")
    except (OSError, ValueError, AttributeError):
        return None


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|\d+-core", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def machine_label(env: dict[str, Any], accelerators: list[str] = ()) -> str:
    """A file-name-safe machine name: OS, CPU model, logical cores, plus any measured GPU's name."""
    parts = [str(env.get("os", "")).split(" ")[0], str(env.get("cpu", "unknown")), f"{env.get('cpu_count')}c"]
    parts += list(accelerators)
    return "-".join(filter(None, (_slug(p) for p in parts)))[:80]


def measured_devices(record: dict[str, Any]) -> list[str]:
    """The devices a record measured (the others say why they were skipped)."""
    return [d for d, s in record["devices"].items() if s["status"] == "measured"]


def measured_runs(record: dict[str, Any]) -> list[tuple[str, int]]:
    """Every (device, thread count) a record measured: one run each, as compare labels them."""
    return [(dev, n) for dev in measured_devices(record) for n in record["settings"]["threads"]]


def result_stem(record: dict[str, Any]) -> str:
    """The stem of a run's JSON and PNG files, unique per run and saying what distinguishes it.

    ``<machine>_<YYYY-MM-DD>T<HHMMSS>Z_<quick|full>_t<threads, joined by ->_<measured devices>``.
    """
    created = record["created"]  # ISO 8601 in UTC, to the second
    stamp = created[:10] + "T" + created[11:19].replace(":", "") + "Z"
    mode = "quick" if record["settings"]["quick"] else "full"
    threads = "-".join(str(t) for t in record["settings"]["threads"])
    devices = "+".join(measured_devices(record)) or "none"
    return f"{record['machine']}_{stamp}_{mode}_t{threads}_{devices}"


def run_label(record: dict[str, Any], device: str, threads: int) -> str:
    """A legend label for one (run, device, thread count): machine, date and time, settings, torch."""
    env = record["environment"]
    mode = "quick" if record["settings"]["quick"] else "full"
    when = record["created"][:16].replace("T", " ")
    return f"{record['machine']} {device} {when} {threads}t {mode} torch {env['torch']}"


def settings_differences(records: list[dict[str, Any]]) -> list[str]:
    """One line per setting that differs between the runs compared (threads, rounds, quick, torch, ...).

    Machines and devices are what a comparison is for, so they are not listed; everything else that
    changes a timing is.
    """
    checks = {
        "thread counts": lambda r: "/".join(str(t) for t in r["settings"]["threads"]),
        "rounds": lambda r: str(r["settings"]["rounds"]),
        "mode (quick vs full)": lambda r: "quick" if r["settings"]["quick"] else "full",
        "torch version": lambda r: r["environment"]["torch"],
        "models": lambda r: ",".join(r["settings"]["models"]),
        "ema_lab revision": lambda r: r["environment"].get("git_revision") or r["environment"]["ema_lab"],
    }
    lines = []
    for what, get in checks.items():
        values = list(dict.fromkeys(get(r) for r in records))
        if len(values) > 1:
            lines.append(f"runs differ in {what}: {' vs '.join(values)}")
    return lines


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def cost_model_line(cm: dict[str, Any], threads: int) -> str:
    """One line of the cost model: per-op overheads, the floor's bandwidths in and beyond the cache."""
    loop, fe, floor = cm["fits"]["loop"], cm["fits"]["foreach"], cm["fits"]["floor"]
    head = (
        f"cost model ({cm.get('threads', threads)} thread(s)): "
        f"{loop['overhead_per_op_us']:.2f} us per dispatched op (per-tensor loop), "
        f"{fe['overhead_per_op_us']:.2f} us per tensor inside one _foreach_lerp_; "
    )

    def gbps(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} GB/s"

    llc = (
        f"{_mib(cm['llc_bytes'])} as reported" if cm["llc_bytes"] else cm.get("llc_source") or "size unknown"
    )
    # A run splits at the knee it measured; the OS's figure is only what it reports.
    knee = cm.get("knee_bytes")
    where = (
        f"the measured knee ({_mib(knee)} of EMA + model; last-level cache {llc})"
        if knee
        else f"the last-level cache ({llc})"
    )
    dram = floor["dram_bandwidth_gbps"]
    text = f"floor (one lerp_) {gbps(floor['bandwidth_gbps'])} in cache, " + (
        f"{gbps(dram)} beyond {where}" if dram is not None else f"no size beyond {where} measured"
    )
    for label, key in (
        ("at the largest size in cache", "floor_fraction"),
        ("beyond it", "floor_fraction_dram"),
    ):
        fr = {k: v for k, v in (cm.get(key) or {}).items() if v is not None}
        if fr:
            text += f"; floor fraction {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in fr.items())
    return head + text


def format_table(record: dict[str, Any]) -> str:
    """The bench table: a block per (device, thread count), a row per (model, candidate), with speed-ups."""
    threads = record["settings"]["threads"]
    lines = [
        f"threads={','.join(map(str, threads))}  (median [IQR] of {record['settings']['rounds']} rounds)"
    ]
    for dev, status in record["devices"].items():
        if status["status"] != "measured":
            lines.append(f"\n{dev}: {status['status']}")
            continue
        name = status["environment"].get("device_name", dev)
        for n in threads:
            lines.append(f"\n{dev}: {name}, {n} thread(s)")
            head = (
                f"{'model':<17}{'candidate':<13}{'ops/step':>9}{'kernels':>9}{'median ms':>11}{'IQR ms':>9}"
            )
            lines.append(head + f"{'speed-up':>10}{'floor frac':>12}")
            lines += _table_rows([r for r in record["results"] if r["device"] == dev and r["threads"] == n])
        cm = record["cost_model"].get(dev)
        if cm:
            lines.append(cost_model_line(cm, threads[0]))
    lines.append(
        "ops/step: dispatched non-view ATen ops per update (count_ops); kernels: CUDA kernels "
        "(torch.profiler), '-' where not available; floor frac: time of the floor (one lerp_ over two "
        "flat buffers of the model's floats, the fastest an update can be) over the row's time, same model "
        "and thread count: 1.00 is as fast, a little above 1 is noise; '-' for copy (not an EMA update) "
        "and where no floor was run"
    )
    return "\n".join(lines)


def _table_rows(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        k = "-" if row["kernel_launches"] is None else str(row["kernel_launches"])
        f = "-" if row["floor_fraction"] is None else f"{row['floor_fraction']:.3f}"
        lines.append(
            f"{row['model']:<17}{row['candidate']:<13}{row['ops_compute']:>9}{k:>9}"
            f"{row['median_ms']:>11.3f}{row['q3_ms'] - row['q1_ms']:>9.3f}"
            f"{row['speedup_vs_seed_before']:>9.1f}x{f:>12}"
        )
    return lines
