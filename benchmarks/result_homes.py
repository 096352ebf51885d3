"""Where each kind of result lives, written once for every script in ``benchmarks/`` (issue 32).

- ``STUDIES`` (``docs/results/``): the studies made with ``benchmarks/`` (peers, the trainer drop-in, cat
  runs, update costs), each a JSON record and a Markdown page that ``docs/benchmarks.md`` cites.
- ``GALLERY`` (``results/``): the readers' gallery of bench runs (``python -m ema_lab bench``) and GPU checks;
  the default of ``ema_lab.bench.results.results_dir()``, which notebooks read.

A script in this folder imports it as a sibling (``python benchmarks/x.py`` puts ``benchmarks/`` first on
``sys.path``).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "docs" / "results"
GALLERY = ROOT / "results"


def add_study_out(parser: argparse.ArgumentParser) -> None:
    """``--out [FOLDER]`` for a script whose record is optional: ``--out`` alone writes it to ``STUDIES``."""
    parser.add_argument(
        "--out",
        type=Path,
        nargs="?",
        const=STUDIES,
        metavar="FOLDER",
        help=f"write the record (JSON and Markdown) into this folder; --out alone: {shown(STUDIES)}",
    )


def shown(folder: Path) -> str:
    """``folder`` as a reader types it from the checkout (``docs/results/``), else its absolute path."""
    try:
        return f"{folder.resolve().relative_to(ROOT)}/"
    except ValueError:
        return str(folder)


def write_study(folder: Path, name: str, title: str, command: str, rows: list[dict], table: str) -> Path:
    """Write ``<name>-<date>.json`` (rows, command, environment) and its Markdown page; return the stem."""
    from ema_lab.bench.environment import environment

    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env = environment("cpu")
    stem = Path(folder) / f"{name}-{created[:10]}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    record = {"created": created, "command": command, "environment": env, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    stem.with_suffix(".md").write_text(
        f"# {title}\n\n`PYTHONPATH=. python {command}`\n\n{env['cpu']} ({env['cpu_count']} cores), "
        f"torch {env['torch']}, {created}\n\n{table}\n"
    )
    print(f"wrote {stem}.json and {stem}.md")
    return stem
