"""The committed bench runs notebook 04 discusses, and the reader's own runs beside them.

Notebook 04's prose quotes figures of particular committed runs. Its comparison figure therefore
draws those runs by name, whatever else ``results/`` holds, and every other run there, such as the
reader's own ``python3 dev.py bench`` runs, apart from them: choosing "the newest runs" instead
would let a reader's runs push out the ones the text discusses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ema_lab.bench.results import bench_files, load

__all__ = ["NOTEBOOK_04_RUNS", "discussed_runs", "own_runs", "run_name"]

#: The committed runs notebook 04 discusses, as paths under ``results_dir()``, oldest first.
NOTEBOOK_04_RUNS = (
    "linux-amd-epyc-2c_2026-12-02.json",
    "linux-amd-epyc-2c_2026-12-03T083304Z_quick_t1_cpu.json",
    "linux-amd-epyc-2c_2026-12-03T083322Z_quick_t2_cpu.json",
    "linux-amd-epyc-2c_2026-12-03T093048Z_full_t1_cpu.json",
    "linux-intel-xeon-2-80ghz-2c_2026-12-03T201556Z_full_t1_cpu.json",
    "gpu-linux-intel-xeon-16c-nvidia-h200/linux-intel-xeon-16c-nvidia-h200_2026-12-04T154430Z_quick_t1_cuda.json",
    "gpu-linux-intel-xeon-16c-nvidia-h200/linux-intel-xeon-16c-nvidia-h200_2026-12-04T154528Z_full_t1_cuda.json",
)


def discussed_runs(
    folder: Path, names: tuple[str, ...] = NOTEBOOK_04_RUNS
) -> list[tuple[Path, dict[str, Any]]]:
    """The runs ``names`` under ``folder``, in that order, loaded; a missing one is an error naming it."""
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {missing[0]}, a committed run the notebook discusses"
            " (does EMA_LAB_RESULTS name a folder without the committed runs?)"
        )
    return [(folder / name, load(folder / name)) for name in names]


def own_runs(folder: Path, names: tuple[str, ...] = NOTEBOOK_04_RUNS) -> list[tuple[Path, dict[str, Any]]]:
    """Every other bench run in ``folder`` and one level down, loaded, newest first."""
    discussed = {folder / name for name in names}
    runs = [(path, load(path)) for path in bench_files(folder) if path not in discussed]
    return sorted(runs, key=lambda run: run[1]["created"], reverse=True)


def run_name(record: dict[str, Any], threads: int) -> str:
    """A label that tells runs apart: date and time of day (UTC), mode, thread count, machine."""
    mode = "quick" if record["settings"]["quick"] else "full"
    return f"{record['created'][:16].replace('T', ' ')} {mode} {threads}t, {record['machine']}"
