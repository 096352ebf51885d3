"""The reader's path: JupyterLab started as the README says, notebooks run in headless Chromium.

It follows the README's copy workflow (``python3 dev.py lab --notebook-dir <dir>``, which copies
the notebooks and figures/ there), so a notebook that reads committed results must find them from a copy in
another folder, and the committed outputs stay as they are. When the lab stops, nothing it started
may be left running. Chromium is Debian's
``chromium`` package (playwright cannot download its own browsers on every machine); without it the
test is skipped with the reason, unless ``EMA_LAB_REQUIRE_BROWSER=1`` (set by ``.ci/run``) makes that a
failure. The lab keeps its settings, workspace, runtime files and IPython history in the test's own
folders: the reader's next lab opens as they left it.
"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Every lesson, run whole from the copy (01 and 04 read committed results; 06 writes and runs a script).
NOTEBOOKS = tuple(sorted(p.stem for p in (ROOT / "notebooks").glob("0*.ipynb")))
NOTEBOOK = "02_ema_strategies"  # the one whose jupytext form is opened as well
TOKEN = "ema-lab-browser-test"


def jupyter_dirs(where: Path) -> dict[str, str]:
    """Environment variables that give a lab and its kernels their own Jupyter folders under ``where``."""
    names = {
        "JUPYTER_CONFIG_DIR": "config",
        "JUPYTER_DATA_DIR": "data",
        "JUPYTER_RUNTIME_DIR": "runtime",
        "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
        "IPYTHONDIR": "ipython",
    }
    return {var: str(where / name) for var, name in names.items()}


def readers_jupyter_files() -> dict[str, int | None]:
    """The reader's own Jupyter folders (config, with lab settings and workspaces; data): path -> mtime.

    Folders map to None; runtime/ (and the folders above it) are left out: any Jupyter the reader runs
    meanwhile writes there.
    """
    from jupyter_core.paths import jupyter_config_dir, jupyter_data_dir, jupyter_runtime_dir

    runtime = Path(jupyter_runtime_dir())
    tops = {Path(jupyter_config_dir()), Path(jupyter_data_dir())}
    tops |= {
        Path(os.environ[v])
        for v in ("JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR")
        if v in os.environ
    }
    found: dict[str, int | None] = {}
    for top in tops:
        for p in [top, *top.rglob("*")] if top.exists() else []:
            if p != runtime and runtime not in p.parents and p not in runtime.parents:
                found[str(p)] = p.stat().st_mtime_ns if p.is_file() else None
    return found


def _missing(reason: str) -> None:
    if os.environ.get("EMA_LAB_REQUIRE_BROWSER") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of notebooks/, started through ``dev.py lab``."""
    try:
        import playwright  # noqa: F401
    except ModuleNotFoundError:
        _missing("playwright is not installed (pip install playwright)")
    if CHROMIUM is None:
        _missing("no chromium on PATH (Debian: apt-get install chromium)")
    # Not beside results/, as in the README; dev.py makes the copy, as it does for a reader.
    copy = tmp_path_factory.mktemp("lab") / "ema_lab_notebooks"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (copy.parent / "lab.log").open("w")
    # Without EMA_LAB_RESULTS: the copy must find results/ the way a reader's kernel does.
    env = {**{k: v for k, v in os.environ.items() if k != "EMA_LAB_RESULTS"}, "EMA_LAB_QUICK": "1"}
    env.update(jupyter_dirs(copy.parent / "jupyter"))  # the reader's workspace and settings stay theirs
    env, mark = marked_env(env)  # finds the lab, its kernels and theirs at the end
    readers_files = readers_jupyter_files()
    (copy.parent / "readers_jupyter_files.json").write_text(json.dumps(readers_files))
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "dev.py"), "lab", "--notebook-dir", str(copy), "--no-browser"]
        + [f"--port={port}", "--ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}"]
        # The test drives JupyterLab through its own command registry, as a menu click would.
        + ["--LabApp.expose_app_in_browser=True"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    break
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not answer within 60 s")
        if server.poll() is not None:
            pytest.fail("JupyterLab exited:\n" + (copy.parent / "lab.log").read_text()[-2000:])
        yield url, copy
    finally:
        server.terminate()  # reaches JupyterLab itself (dev.py execs it), which shuts its kernels down
        server.wait(timeout=60)
        log.close()
        left = leftovers(mark)
        assert not left, f"still running after the lab stopped (now killed): {left}"
        assert readers_jupyter_files() == readers_files, "the lab changed the reader's Jupyter folders"


def _open(page, url: str, path: str, factory: str) -> None:
    page.goto(f"{url}/lab?token={TOKEN}")
    page.wait_for_function("window.jupyterapp && window.jupyterapp.started", timeout=120_000)
    page.evaluate(
        """async ([path, factory]) => {
            await window.jupyterapp.started;
            await window.jupyterapp.restored;
            await window.jupyterapp.commands.execute('docmanager:open', {path, factory});
        }""",
        [path, factory],
    )
    page.wait_for_function(
        "() => { const w = window.jupyterapp.shell.currentWidget;"
        " return w && w.context && w.context.isReady && w.sessionContext"
        " && w.sessionContext.session && w.sessionContext.session.kernel"
        " && w.sessionContext.session.kernel.status === 'idle'; }",
        timeout=120_000,
    )


_NOTEBOOK_JSON = "() => window.jupyterapp.shell.currentWidget.context.model.toJSON()"


def _run_all(url: str, path: str) -> dict:
    """Open ``path`` in JupyterLab, Run All Cells, and return the notebook as the browser holds it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        page = browser.new_page()
        _open(page, url, path, "Notebook")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        # Done when every code cell has run, or a cell failed (Run All stops there), and the kernel is idle.
        page.wait_for_function(
            """() => {
                const w = window.jupyterapp.shell.currentWidget;
                const cells = w.context.model.toJSON().cells.filter(c => c.cell_type === 'code');
                const failed = cells.some(c => c.outputs.some(o => o.output_type === 'error'));
                const ran = cells.every(c => c.execution_count !== null);
                return (failed || ran) && w.sessionContext.session.kernel.status === 'idle';
            }""",
            timeout=300_000,
            polling=1000,
        )
        nb = page.evaluate(_NOTEBOOK_JSON)
        browser.close()
    return nb


def _errors(nb: dict) -> list[dict]:
    return [
        o
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c["outputs"]
        if o["output_type"] == "error"
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_run_all_cells_of_a_copy_in_jupyterlab_without_an_error(lab, notebook) -> None:
    url, copy = lab
    committed = (ROOT / "notebooks" / f"{notebook}.ipynb").read_bytes()
    nb = _run_all(url, f"{notebook}.ipynb")
    errors = _errors(nb)
    assert not errors, f"{notebook}: {errors[0]['ename']}: {errors[0]['evalue']}"
    assert all(c["execution_count"] for c in nb["cells"] if c["cell_type"] == "code")
    assert (ROOT / "notebooks" / f"{notebook}.ipynb").read_bytes() == committed  # the browser ran a copy


def test_an_error_in_a_cell_is_seen(lab) -> None:
    import nbformat

    url, copy = lab
    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("1 / 0")]
    kernel = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=kernel), copy / "broken.ipynb")
    assert [e["ename"] for e in _errors(_run_all(url, "broken.ipynb"))] == ["ZeroDivisionError"]


def test_autosave_is_off_in_the_lab_dev_py_starts(lab) -> None:
    url, _ = lab
    plugin = "@jupyterlab/docmanager-extension:plugin"
    with urllib.request.urlopen(f"{url}/lab/api/settings/{plugin}?token={TOKEN}", timeout=10) as r:
        answer = json.load(r)
    # overrides.json changes the schema's default (what the lab uses while the user sets nothing).
    assert answer["schema"]["properties"]["autosave"]["default"] is False
    assert "autosave" not in answer["settings"]


def test_the_jupytext_py_form_opens_as_the_same_notebook(lab) -> None:
    from playwright.sync_api import sync_playwright

    url, copy = lab
    # A reader's copy holds no .py source; the developer's does (notebooks/): put one beside it, for now.
    source = copy / "source"
    source.mkdir()
    shutil.copy(ROOT / "notebooks" / f"{NOTEBOOK}.py", source)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
            page = browser.new_page()
            _open(page, url, f"source/{NOTEBOOK}.py", "Jupytext Notebook")
            nb = page.evaluate(_NOTEBOOK_JSON)
            browser.close()
    finally:
        shutil.rmtree(source)
    stored = json.loads((ROOT / "notebooks" / f"{NOTEBOOK}.ipynb").read_text())
    assert [c["cell_type"] for c in nb["cells"]] == [c["cell_type"] for c in stored["cells"]]
    assert ["".join(c["source"]) for c in nb["cells"]] == ["".join(c["source"]) for c in stored["cells"]]


def test_the_lab_keeps_its_workspace_in_its_own_folder_not_the_readers(lab) -> None:
    """A notebook opened in the lab: the layout the lab saves lands in the test's folder, not the reader's."""
    from playwright.sync_api import sync_playwright

    url, copy = lab
    before = json.loads((copy.parent / "readers_jupyter_files.json").read_text())
    workspaces = Path(jupyter_dirs(copy.parent / "jupyter")["JUPYTERLAB_WORKSPACES_DIR"])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        page = browser.new_page()
        _open(page, url, f"{NOTEBOOK}.ipynb", "Notebook")
        for _ in range(60):  # JupyterLab saves its layout a moment after it changes
            if list(workspaces.glob("*.jupyterlab-workspace")):
                break
            page.wait_for_timeout(500)
        browser.close()
    saved = [json.loads(w.read_text()) for w in workspaces.glob("*.jupyterlab-workspace")]
    assert any(f"notebook:{NOTEBOOK}.ipynb" in w["data"] for w in saved), f"no workspace in {workspaces}"
    assert readers_jupyter_files() == before
