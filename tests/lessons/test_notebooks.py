"""The notebook machinery: jupytext pairs in sync, nbval strict on counts not on stderr, execute in place."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext", reason="jupytext is not installed (the notebooks extra)")
import nbformat  # jupytext depends on it
from jupytext.config import load_jupytext_config

from ..helpers import load_file

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
PAIRS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str, list[str], dict]]:
    """Each cell's type, source, tags (nbval reads them) and jupyter metadata (collapsed solutions)."""
    return [
        (c.cell_type, c.source.strip(), c.metadata.get("tags", []), c.metadata.get("jupyter", {}))
        for c in nb.cells
    ]


def test_every_notebook_has_a_jupytext_pair_and_nothing_else_generates_them() -> None:
    assert len(PAIRS) >= 6
    sources = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    assert [p.with_suffix(".ipynb") for p in sources] == PAIRS
    assert not (NOTEBOOKS / "src").exists()
    assert 'formats = "ipynb,py:percent"' in (NOTEBOOKS / "jupytext.toml").read_text()


@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_the_pair_is_in_sync(ipynb: Path) -> None:
    """The .py is what people edit; the .ipynb must hold exactly its cells, tags, collapsed cells and kernel.

    Compared by meaning, not by bytes, so that any jupytext from 1.16 on passes (nox -s jupytext).
    """
    source = ipynb.with_suffix(".py")
    text = jupytext.read(source)
    stored = nbformat.read(ipynb, as_version=4)
    assert _cells(stored) == _cells(text), (
        f"{ipynb.name} is out of sync with {source.name}: "
        f"run `python3 dev.py notebooks notebooks/{source.name}`"
    )
    assert stored.metadata.kernelspec == text.metadata.kernelspec
    # JupyterLab's jupytext opens a copy whose .ipynb is the newer file only when what it would write from
    # the .ipynb reads back as the .py: the same cells and the same header (notebooks/jupytext.toml's filter).
    config = load_jupytext_config(str(NOTEBOOKS))
    again = jupytext.reads(jupytext.writes(stored, "py:percent", config=config), "py:percent")
    assert _cells(again) == _cells(text) and again.metadata == text.metadata, (
        f"{source.name}'s header is not what jupytext writes: run `jupytext --sync notebooks/{ipynb.name}`"
    )
    # A version line would change with every jupytext release (jupytext.toml filters it out).
    assert "jupytext_version:" not in source.read_text().partition("\n# ---\n")[0]


@pytest.mark.parametrize("newer", [".py", ".ipynb"])
@pytest.mark.parametrize("ipynb", PAIRS, ids=lambda p: p.stem)
def test_the_pair_is_unchanged_by_jupytext_sync(ipynb: Path, newer: str, tmp_path: Path) -> None:
    """A reader's first `jupytext --sync` (JupyterLab's, or the command's) rewrites neither file of a pair.

    Whichever file is newer (a checkout sets the times at random), the bytes stay; nox -s pairs runs this
    on the oldest jupytext that pyproject.toml admits and on the last two releases.
    """
    from jupytext.cli import jupytext as jupytext_cli

    shutil.copy(NOTEBOOKS / "jupytext.toml", tmp_path)
    pair = [ipynb, ipynb.with_suffix(".py")]
    for path in pair:
        shutil.copy(path, tmp_path)
    later = tmp_path / ipynb.with_suffix(newer).name
    os.utime(later, (later.stat().st_atime, later.stat().st_mtime + 60))
    assert jupytext_cli(["--sync", "--quiet", str(tmp_path / ipynb.name)]) == 0
    changed = [p.name for p in pair if (tmp_path / p.name).read_bytes() != p.read_bytes()]
    rerun = f"python3 dev.py notebooks notebooks/{pair[1].name}"
    assert not changed, f"`jupytext --sync` rewrote {changed}: run `{rerun}`"


def _stream(name: str, text: str) -> dict:
    return nbformat.v4.new_output("stream", name=name, text=text)


def _notebook(cells: list) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for i, cell in enumerate(nb.cells, 1):  # a committed, executed notebook has execution counts
        cell.execution_count = i
    return nb


def test_nbval_fails_on_a_wrong_stored_count_and_ignores_stderr(tmp_path: Path) -> None:
    """What CI relies on, end to end: the real conftest and sanitize file, one kernel, a few seconds."""
    code = nbformat.v4.new_code_cell
    noisy = code("import sys\nprint('noise that differs on every run', file=sys.stderr)\nprint(6 * 7)")
    noisy.outputs = [_stream("stderr", "other noise\n"), _stream("stdout", "42\n")]
    count = code("print(len(['a', 'b', 'c']), 'tensors at 0x7f00deadbeef')")
    count.outputs = [_stream("stdout", "4 tensors at 0x55aa\n")]  # wrong count; the address is sanitized
    address = code("print('3 tensors at 0x7f00deadbeef')")
    address.outputs = [_stream("stdout", "3 tensors at 0x55aa\n")]
    nbformat.write(_notebook([noisy, count, address]), tmp_path / "check.ipynb")
    cfg = NOTEBOOKS / "sanitize.cfg"

    def nbval() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "--nbval",
             "--nbval-current-env", "--nbval-sanitize-with", str(cfg), "-o", "addopts=", "check.ipynb"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stdout + proc.stderr
        return proc.stdout

    # Without the project's conftest the stderr noise fails cell 0 as well: the conftest is what drops it.
    assert "2 failed, 1 passed" in nbval()
    shutil.copy(NOTEBOOKS / "conftest.py", tmp_path / "conftest.py")
    out = nbval()
    assert "1 failed, 2 passed" in out, out
    assert "Cell 1: Cell outputs differ" in out and "+ 4 tensors at 0xADDRESS" in out, out


def test_execute_writes_the_pair_in_order_and_never_a_failure(tmp_path: Path, capsys) -> None:
    execute = load_file(NOTEBOOKS / "execute.py", "nb_execute")
    good = tmp_path / "01_good.py"
    cells = ["import os\nprint(os.getcwd())", "import ema_lab\nema_lab.__name__", "os.getpid()"]
    good.write_text("".join(f"# %%\n{c}\n\n" for c in cells))
    bad = tmp_path / "02_bad.py"
    bad.write_text("# %%\nprint('ran')\n\n# %%\n1 / 0\n\n# %%\nprint('never')\n")
    committed = "committed outputs"
    (tmp_path / "02_bad.ipynb").write_text(committed)

    assert execute.main([str(good), str(bad)]) == 1
    assert (tmp_path / "02_bad.ipynb").read_text() == committed  # left as it was
    err = capsys.readouterr().err
    assert "FAILED 02_bad.py" in err and "ZeroDivisionError" in err and "1 of 2 failed" in err

    nb = nbformat.read(tmp_path / "01_good.ipynb", as_version=4)
    assert [c.execution_count for c in nb.cells] == [1, 2, 3]
    assert nb.cells[0].outputs[0].text.strip() == str(tmp_path)  # cwd is the notebook's folder
    assert nb.cells[1].outputs[0].data["text/plain"] == "'ema_lab'"  # this interpreter's ema_lab
    assert nb.metadata.kernelspec.name == "python3"
    # What `jupytext --sync` would write: the .py's jupytext options, without its text representation.
    assert "text_representation" not in nb.metadata.get("jupytext", {})
    with pytest.raises(ProcessLookupError):  # each kernel is shut down when its notebook is done
        os.kill(int(nb.cells[2].outputs[0].data["text/plain"]), 0)
    with pytest.raises(ValueError, match="not a notebook"):
        execute.pair(tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError, match="no such jupytext notebook source"):
        execute.pair(tmp_path / "missing.ipynb")


def _sanitize(text: str) -> str:
    """``text`` after every regex/replace pair of notebooks/sanitize.cfg, as nbval applies them."""
    import configparser
    import re

    cfg = configparser.ConfigParser()
    cfg.read(NOTEBOOKS / "sanitize.cfg")
    for section in cfg.sections():
        text = re.sub(cfg[section]["regex"], cfg[section]["replace"], text)
    return text


@pytest.mark.parametrize(
    "version", ["2.1.2", "2.13.0+cpu", "2.15.0+cu132", "2.11.0+cu130", "2.16.0a0+git1234"]
)
def test_committed_outputs_compare_equal_on_every_torch(version: str) -> None:
    """A cell that prints its torch version passes nbval on any torch (issue 30)."""
    line = f"torch {version}: 3792 ops\ntorch {version}, cpu: foreach\n"
    assert _sanitize(line) == _sanitize("torch 2.13.0+cpu: 3792 ops\ntorch 2.13.0+cpu, cpu: foreach\n")
    assert _sanitize("3792 ops") != _sanitize("3793 ops")  # counts are still compared


def test_nbval_collects_the_committed_notebooks_and_not_the_labs_checkpoint_copies(tmp_path: Path) -> None:
    """Opening notebooks in JupyterLab leaves .ipynb_checkpoints/ copies beside them; nbval skips those."""
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))

    def collected() -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "--nbval",
             "--nbval-current-env", "-o", "addopts=", "notebooks"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [line for line in proc.stdout.splitlines() if "::" in line]

    before = collected()
    checkpoints = folder / ".ipynb_checkpoints"
    checkpoints.mkdir()
    for ipynb in folder.glob("*.ipynb"):  # what the lab writes when it opens or saves a notebook
        shutil.copy(ipynb, checkpoints / f"{ipynb.stem}-checkpoint.ipynb")
    assert {line.split("::")[0] for line in before} == {f"notebooks/{p.name}" for p in PAIRS}
    assert collected() == before
