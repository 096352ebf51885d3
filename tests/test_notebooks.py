"""The notebook machinery: nbval fails on a wrong stored count and ignores stderr; the execute inputs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ema_lab import notebooks
from ema_lab.notebooks import ROOT, code, new_notebook, notebook_paths, without_stderr


def _stream(name: str, text: str) -> dict:
    return nbformat.v4.new_output("stream", name=name, text=text)


def test_without_stderr_keeps_everything_else() -> None:
    outs = [_stream("stdout", "3 tensors\n"), _stream("stderr", "STAGE:... USDT\n"), {"output_type": "error"}]
    assert without_stderr(outs) == [outs[0], outs[2]]


def test_notebook_paths_checks_its_input(tmp_path: Path) -> None:
    assert all(p.suffix == ".ipynb" and p.parent == notebooks.NOTEBOOK_DIR for p in notebook_paths())
    with pytest.raises(ValueError, match="not a notebook"):
        notebook_paths([tmp_path / "x.py"])
    with pytest.raises(FileNotFoundError, match="no such notebook"):
        notebook_paths([tmp_path / "missing.ipynb"])


def test_kernel_env_puts_the_repo_on_pythonpath() -> None:
    env = notebooks.kernel_env({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
    assert notebooks.kernel_env(env)["PYTHONPATH"] == env["PYTHONPATH"]  # idempotent


def _stored(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Give every cell an execution count, as a committed, executed notebook has."""
    for i, cell in enumerate(nb.cells, 1):
        cell.execution_count = i
    return nb


def test_nbval_fails_on_a_wrong_stored_count_and_ignores_stderr(tmp_path: Path) -> None:
    """What CI relies on, end to end: the real conftest and sanitize file, one kernel, a few seconds."""
    noisy = code("import sys\nprint('noise that differs on every run', file=sys.stderr)\nprint(6 * 7)")
    noisy.outputs = [_stream("stderr", "other noise\n"), _stream("stdout", "42\n")]
    count = code("print(len(['a', 'b', 'c']), 'tensors at 0x7f00deadbeef')")
    count.outputs = [_stream("stdout", "4 tensors at 0x55aa\n")]  # wrong count; the address is sanitized
    address = code("print('3 tensors at 0x7f00deadbeef')")
    address.outputs = [_stream("stdout", "3 tensors at 0x55aa\n")]
    nbformat.write(_stored(new_notebook([noisy, count, address])), tmp_path / "check.ipynb")
    cfg = ROOT / "notebooks" / "sanitize.cfg"

    def nbval() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "--nbval",
             "--nbval-current-env", "--nbval-sanitize-with", str(cfg), "-o", "addopts=", "check.ipynb"],
            cwd=tmp_path, env=notebooks.kernel_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stdout + proc.stderr
        return proc.stdout

    # Without the project's conftest the stderr noise fails cell 0 as well: the conftest is what drops it.
    assert "2 failed, 1 passed" in nbval()
    shutil.copy(ROOT / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    out = nbval()
    assert "1 failed, 2 passed" in out, out
    assert "Cell 1: Cell outputs differ" in out and "+ 4 tensors at 0xADDRESS" in out, out


def test_execute_saves_in_order_and_refuses_to_save_a_failure(tmp_path: Path, capsys) -> None:
    good = tmp_path / "good.ipynb"
    nbformat.write(
        new_notebook([code("import os\nprint(os.getcwd())"), code("import ema_lab\nema_lab.__name__")]), good
    )
    bad = tmp_path / "bad.ipynb"
    nbformat.write(new_notebook([code("print('ran')"), code("1 / 0"), code("print('never')")]), bad)
    before = bad.read_text()

    assert notebooks.main(["execute", str(good), str(bad)]) == 1
    assert bad.read_text() == before  # the committed notebook is left as it was
    err = capsys.readouterr().err
    assert "FAILED bad.ipynb" in err and "ZeroDivisionError" in err and "1 of 2 failed" in err

    nb = nbformat.read(good, as_version=4)
    assert [c.execution_count for c in nb.cells] == [1, 2]
    assert nb.cells[0].outputs[0].text.strip() == str(tmp_path)  # cwd is the notebook's folder
    assert nb.cells[1].outputs[0].data["text/plain"] == "'ema_lab'"  # the repo is importable
    assert nb.metadata.kernelspec.name == "python3"
