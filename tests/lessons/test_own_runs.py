"""Notebook 04's comparison figure: the committed runs its prose discusses, whatever runs a reader adds."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the bench extra is not installed")

import matplotlib

from ema_lab.lessons.runs import NOTEBOOK_04_RUNS, own_runs

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "04_timing_cpu_cuda_mps.py"


def _cell(source: str, first_line: str) -> str:
    """The code of the jupytext cell whose body starts with ``first_line``."""
    cells = re.split(r"^# %%.*\n", source, flags=re.M)
    (cell,) = [c for c in cells if c.startswith(first_line)]
    return cell


def _figure(results: Path, monkeypatch) -> tuple[list[str], str, dict]:
    """Run the listing and the figure cells of notebook 04 on ``results``: tick labels, output, names."""
    monkeypatch.setenv("EMA_LAB_RESULTS", str(results))
    matplotlib.use("Agg")
    source = NOTEBOOK.read_text()
    names: dict = {}
    exec("import matplotlib.pyplot as plt", names)
    printed = []
    names["print"] = lambda *a, **k: printed.append(" ".join(map(str, a)))
    exec(_cell(source, "from ema_lab.bench.results import results_dir"), names)  # the runs, listed
    exec(_cell(source, "def speedup("), names)  # the figure
    labels = [t.get_text() for t in names["fig"].axes[0].get_yticklabels()]
    names["plt"].close("all")
    return labels, "\n".join(printed), names


def _extra_runs(folder: Path, count: int) -> list[Path]:
    """``count`` runs of a reader, newer than every committed one: quick and full, 1 and 2 threads."""
    base = json.loads((ROOT / "results" / NOTEBOOK_04_RUNS[3]).read_text())  # a full run at 1 thread
    paths = []
    for i in range(count):
        rec = copy.deepcopy(base)
        rec["created"] = f"2027-01-01T{9 + i:02d}:{i:02d}:00+00:00"
        rec["settings"]["quick"] = i % 2 == 0
        if i % 3 == 2:  # measured at 2 threads only
            rec["settings"]["threads"] = [2]
            for row in rec["results"]:
                row["threads"] = 2
        paths.append(folder / f"mine-{i}.json")
        paths[-1].write_text(json.dumps(rec))
    return paths


def test_ten_extra_runs_change_neither_the_committed_runs_nor_the_prose(tmp_path, monkeypatch) -> None:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results, ignore=shutil.ignore_patterns("*.png", "*.log"))
    for stray in set(results.rglob("*.json")) - {results / n for n in NOTEBOOK_04_RUNS}:
        stray.unlink()  # only the committed runs (an untracked run of the checkout's reader goes)
    before, printed, names = _figure(results, monkeypatch)
    assert not any(label.startswith("yours") for label in before) and "not drawn" not in printed
    _extra_runs(results, 10)
    after, printed, names = _figure(results, monkeypatch)
    assert after[: len(before)] == before  # the committed runs, first, unchanged
    mine = after[len(before) :]
    assert len(mine) == 8 and all(label.startswith("yours: ") for label in mine)
    assert len(set(mine)) == 8  # told apart: time of day, mode, thread count
    assert mine[0].startswith("yours: 2027-01-01 18:09 full 1t") and " 2t, " in " ".join(mine)
    assert "older rows of your runs are not drawn" in printed

    # The prose under the figure quotes the committed runs' foreach speed-ups, oldest first.
    prose = _cell(NOTEBOOK.read_text(), "# See the green rows")
    quoted = re.search(r"gained ([\d.]+)x, ([\d.]+)x\s*#?\s*and ([\d.]+)x", prose).groups()
    epyc = [r for lab, r, d, n in names["committed_rows"] if "linux-amd-epyc-2c" in lab]
    assert len(epyc) == 3 and "three plotted `linux-amd-epyc-2c` runs" in prose
    assert tuple(f"{names['speedup'](rec, 'foreach', 'cpu')[1]:.1f}" for rec in epyc) == quoted
    assert sum("nvidia-h200" in label for label in before) == 2  # the H200 runs the next cells discuss


def test_own_runs_are_every_bench_run_but_the_discussed_ones_newest_first(tmp_path) -> None:
    for name in NOTEBOOK_04_RUNS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "results" / name, tmp_path / name)
    (tmp_path / "peers.json").write_text(json.dumps({"rows": []}))  # another tool's JSON
    assert own_runs(tmp_path) == []
    extra = _extra_runs(tmp_path, 4)
    assert [p for p, _ in own_runs(tmp_path)] == [extra[3], extra[2], extra[1], extra[0]]


def test_a_folder_without_the_committed_runs_is_one_clear_error(tmp_path) -> None:
    from ema_lab.lessons.runs import discussed_runs

    with pytest.raises(FileNotFoundError, match=f"lacks {NOTEBOOK_04_RUNS[0]}, a committed run"):
        discussed_runs(tmp_path)
