"""The README's steps, in its order, on a fresh clone, twice: each succeeds and leaves nothing running.

lab on a copy of the notebooks (a kernel started in it; in Chromium where there is one), bench --quick,
compare, then the README's test command narrowed to the set-up tests that read results/ (the ones a
reader's own files there could break; the whole suite is what runs this test). The clone uses this
test's environment (``EMA_LAB_VENV``) instead of installing its own. About 3 minutes on 2 loaded cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ..processes import leftovers, marked_env
from .test_browser import CHROMIUM, TOKEN, _open, jupyter_dirs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this repository's committed state."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    where = tmp_path_factory.mktemp("reader") / "ema_lab"
    done = subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot clone {ROOT}: {done.stderr.strip()}")
    return where


def _env(home: Path) -> dict[str, str]:
    """A reader's environment: their home (Jupyter's folders in it), this test's venv, none of dev.py's."""
    drop = {"EMA_LAB_RESULTS", "EMA_LAB_PROG", "EMA_LAB_QUICK", "PYTHONPATH"}
    return {
        **{k: v for k, v in os.environ.items() if k not in drop},
        "HOME": str(home),
        "EMA_LAB_VENV": sys.prefix,
        **jupyter_dirs(home / "jupyter"),  # a reader's own JUPYTER_* variables would point out of home
    }


def _dev(clone: Path, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python3 dev.py ARGS`` in the clone, as the README says; a failure shows its output."""
    done = subprocess.run(
        [sys.executable, "dev.py", *args], cwd=clone, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"dev.py {' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}{done.stderr}"
    )
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, path: str, method: str = "GET") -> object:
    request = urllib.request.Request(
        f"{url}{path}", method=method, headers={"Authorization": f"token {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def _lab_on_a_copy(clone: Path, env: dict[str, str], copy: Path) -> None:
    """``python3 dev.py lab --notebook-dir COPY``: it answers, runs a kernel, and stops with nothing left."""
    port = _free_port()
    env, mark = marked_env(env)
    log = copy.parent / "lab.log"
    with log.open("w") as out:
        lab = subprocess.Popen(
            [sys.executable, "dev.py", "lab", "--notebook-dir", str(copy), "--no-browser"]
            + [f"--port={port}", "--ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}"]
            + ["--LabApp.expose_app_in_browser=True"],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _api(url, "/api/status")
                break
            except OSError:
                assert lab.poll() is None, f"the lab exited:\n{log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "the lab did not answer within 90 s"
                time.sleep(0.5)
        kernel = _api(url, "/api/kernels", method="POST")
        if CHROMIUM is not None and importlib.util.find_spec("playwright") is not None:
            from playwright.sync_api import (
                sync_playwright,
            )  # the browser part: a notebook opens, gets a kernel

            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
                page = browser.new_page()
                _open(page, url, "01_launch_overhead.ipynb", "Notebook")
                browser.close()
        assert any(k["id"] == kernel["id"] for k in _api(url, "/api/kernels"))
    finally:
        lab.terminate()  # what stopping the lab does: JupyterLab itself gets the signal (dev.py execs it)
        lab.wait(timeout=60)
    left = leftovers(mark)
    assert not left, f"still running after the lab stopped (now killed): {left}"


def test_the_readme_steps_twice_on_a_fresh_clone(clone: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home)
    copy = home / "ema_lab_notebooks"
    mine = set()
    for round_ in (1, 2):
        _lab_on_a_copy(clone, env, copy)  # the README's lab on a copy: the first time it makes the copy
        assert not (copy / "notebooks").exists(), "the second run nested the copy"
        before = set((clone / "results").glob("*.json"))
        printed = _dev(clone, env, "bench", "--quick", "--no-progress").stdout
        (new,) = set((clone / "results").glob("*.json")) - before
        assert f"wrote results/{new.name}" in printed
        mine.add(new)
        compared = _dev(clone, env, "compare", "results").stdout  # the README's line: its runs and the H200's
        assert "add --plot FILE.png" in compared and f"({new.name})" in compared  # and no file written
        assert "_cuda.json)" in compared and "skipped" not in compared
        # The README's test command; -k narrows it to the tests a reader's runs in results/ could break.
        _dev(clone, env, "test", "-q", "-k", "test_setup and result", "-p", "no:cacheprovider")
        assert len(mine) == round_ and all(run.exists() for run in mine)  # a run never replaces another
    # The reader's runs are theirs: untracked, nothing the clone tracks was changed.
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True
    ).stdout
    assert status and all(line.startswith("?? results/") for line in status.splitlines()), status
    assert "compare_" not in status  # compare, run twice, wrote no picture: none was asked for
