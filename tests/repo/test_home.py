"""The tests leave the reader's home as they found it (tests/home.py, its hooks in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ..home import WATCHED, changes, snapshot

ROOT = Path(__file__).resolve().parents[2]


def _pytest(tmp_path: Path, test_body: str) -> subprocess.CompletedProcess:
    """Run one test under this project's conftest, in a fresh home whose IPython history already exists."""
    home = tmp_path / "home"
    history = home / ".ipython" / "profile_default" / "history.sqlite"
    history.parent.mkdir(parents=True)
    history.write_bytes(b"the reader's history")
    (home / ".jupyter").mkdir()
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (suite / "test_one.py").write_text(
        "import subprocess, sys\nfrom pathlib import Path\n\n\ndef test_one():\n"
        + textwrap.indent(test_body, "    ")
    )
    env = {k: v for k, v in os.environ.items() if k not in {"IPYTHONDIR"} and not k.startswith("JUPYTER")}
    env |= {"HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(suite)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_kernel_the_tests_start_keeps_its_history_out_of_the_home(tmp_path) -> None:
    # IPython as a kernel runs it: it records the session in <IPYTHONDIR>/profile_default/history.sqlite
    body = 'subprocess.run([sys.executable, "-m", "IPython", "-c", "1 + 1"], check=True)\n'
    body += 'assert "ema_lab-tests-" in __import__("os").environ["IPYTHONDIR"]\n'
    run = _pytest(tmp_path, body)
    assert run.returncode == 0, run.stdout + run.stderr
    home = tmp_path / "home"
    assert (home / ".ipython" / "profile_default" / "history.sqlite").read_bytes() == b"the reader's history"
    assert sorted(p.name for p in home.rglob("*")) == [
        ".ipython",
        ".jupyter",
        "history.sqlite",
        "profile_default",
    ]


def test_a_run_that_changes_the_home_fails_and_names_the_file(tmp_path) -> None:
    body = 'history = Path.home() / ".ipython" / "profile_default" / "history.sqlite"\n'
    body += 'history.write_bytes(history.read_bytes() + b" and a session more")\n'
    body += '(Path.home() / ".jupyter" / "migrated").write_text("2026")\n'
    run = _pytest(tmp_path, body)
    assert run.returncode == 1 and "1 passed" in run.stdout, run.stdout + run.stderr
    home = tmp_path / "home"
    assert "FAILED: the tests changed the reader's home (tests/home.py):" in run.stdout
    assert f"added {home / '.jupyter' / 'migrated'}" in run.stdout
    assert f"changed {home / '.ipython' / 'profile_default' / 'history.sqlite'}" in run.stdout


def test_snapshot_sees_each_added_removed_and_changed_path_but_not_jupyters_runtime(tmp_path) -> None:
    for name in WATCHED:
        (tmp_path / name).mkdir(parents=True)
    kept, gone = tmp_path / ".jupyter" / "kept.json", tmp_path / ".ipython" / "gone"
    kept.write_text("{}")
    gone.write_text("x")
    before = snapshot(tmp_path)
    (tmp_path / ".local/share/jupyter/runtime").mkdir()  # a Jupyter the reader runs meanwhile
    (tmp_path / ".local/share/jupyter/runtime/kernel-1.json").write_text("{}")
    assert changes(before, snapshot(tmp_path)) == []
    kept.write_text('{"a": 1}')
    gone.unlink()
    (tmp_path / ".local/share/jupyter/nbsignatures.db").write_text("")
    assert changes(before, snapshot(tmp_path)) == [
        f"added {tmp_path / '.local/share/jupyter/nbsignatures.db'}",
        f"removed {gone}",
        f"changed {kept}",
    ]


def test_dev_py_test_runs_the_notebooks_in_the_same_pytest_as_tests(monkeypatch) -> None:
    """nbval's kernels are covered: tests/conftest.py (loaded for ``tests``) sets the run's folders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    commands = []
    monkeypatch.setattr(dev, "ensure_venv", lambda extra: None)
    monkeypatch.setattr(dev, "run", lambda *cmd, env=None: commands.append([str(c) for c in cmd]) or 0)
    assert dev.main(["test"]) == 0
    (pytest_cmd,) = [c for c in commands if "pytest" in c]
    assert pytest_cmd.index("tests") < pytest_cmd.index("notebooks") and "--nbval" in pytest_cmd
