"""The repository's set-up files agree with each other and with the README."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (the dev extra)")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", d)[0] for d in requirements}


def _dev():
    """dev.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


def test_pyproject_dependencies() -> None:
    project = _pyproject()["project"]
    # The core needs torch alone; everything else is an extra.
    assert project["dependencies"] == ["torch>=2.1"]
    extras = project["optional-dependencies"]
    assert {"numpy", "matplotlib", "tqdm"} <= _names(extras["bench"])
    assert {"jupyterlab", "jupytext", "thop"} <= _names(extras["notebooks"])
    assert "thop==0.1.1.post2209072238" in extras["notebooks"]
    assert {"ema_lab[bench,notebooks]", "pytest>=8"} <= set(extras["dev"])
    assert {"pytest", "nbval", "hypothesis", "ruff"} <= _names(extras["dev"])
    for reqs in (project["dependencies"], *extras.values()):
        assert "ultralytics-thop" not in _names(reqs)  # same import package as thop: never both


def test_no_requirement_asks_for_torch_newer_than_the_cap() -> None:
    for path in [ROOT / "pyproject.toml", ROOT / "environment.yml", ROOT / "dev.py", ROOT / ".ci" / "run"]:
        for major, minor in re.findall(r"torch\s*(?:==|>=)\s*(\d+)\.(\d+)", path.read_text()):
            assert (int(major), int(minor)) <= (2, 14), path


def _pinned() -> dict[str, set[str]]:
    """constraints.txt as {normalized name: pinned versions} (a package can have one per Python or OS)."""
    pins: dict[str, set[str]] = {}
    for name, version in re.findall(r"^([\w.-]+)==([^\s;]+)", (ROOT / "constraints.txt").read_text(), re.M):
        pins.setdefault(_normal(name), set()).add(version)
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_environment_yml_installs_the_readers_extra_from_the_pinned_set() -> None:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    deps = env["dependencies"]
    assert any(str(d).startswith("python") for d in deps) and "pip" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict))
    # conda runs pip in environment.yml's folder (the repository root), whatever the caller's folder.
    assert "-c constraints.txt" in pip_section and "-e .[notebooks]" in pip_section
    assert not any(line.startswith("-e") and line != "-e .[notebooks]" for line in pip_section)
    # Everything the readers' extra installs is pinned: its requirements, followed down, as installed here.
    from importlib import metadata

    from packaging.requirements import Requirement

    pins, seen = _pinned(), set()
    todo = [Requirement(r) for r in _pyproject()["project"]["dependencies"]]
    todo += [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["notebooks"]]
    while todo:
        req = todo.pop()
        name = _normal(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        if name == "ema-lab":  # ema_lab[bench]
            todo += [
                Requirement(r)
                for e in req.extras
                for r in _pyproject()["project"]["optional-dependencies"][e]
            ]
            continue
        assert name in pins, (
            f"{name} (needed by the readers' extra) is not in constraints.txt: python3 dev.py lock"
        )
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    assert {"torch", "jupyterlab", "jupytext", "thop", "matplotlib"} <= seen


def test_the_pinned_set_holds_every_package_dev_py_installed() -> None:
    """pip freeze of the environment dev.py made lists only what constraints.txt pins (torch too)."""
    if not (Path(sys.prefix) / ".ema_lab-installed").exists():
        pytest.skip(f"{sys.prefix} was not made by dev.py (it has no .ema_lab-installed stamp)")
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pins = _pinned()
    installed = dict(re.findall(r"^([\w.-]+)==([^\s+]+)", freeze, re.M))  # 2.13.0+cpu pinned as 2.13.0
    installed.pop("ema_lab", None)  # this checkout, whichever way pip reports it
    assert "torch" in installed
    unpinned = {n: v for n, v in installed.items() if v not in pins.get(_normal(n), set())}
    assert not unpinned, f"installed at versions constraints.txt does not pin: {unpinned}"


def test_readme_starts_a_newcomer_with_clone_and_lab_and_ci_runs_its_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    before, first_block = readme.split("```")[:2]  # the first code block: what a newcomer types from nothing
    assert "git clone" in before and "python3 dev.py lab" in first_block
    # No placeholder address: the README names the repository's URL only once pyproject.toml has one.
    assert "<" not in first_block
    assert all(url in readme for url in _pyproject()["project"].get("urls", {}).values())
    assert "01_launch_overhead" in readme[: readme.index("```", readme.index("```") + 3) + 600]
    assert len(readme.split()) < 1300  # a front door, not a measurement log
    commands = re.findall(r"^(python3 dev\.py \w+)", readme, flags=re.M)
    assert {"python3 dev.py lab", "python3 dev.py bench", "python3 dev.py test"} <= set(commands)
    # The copy of the notebooks is made by a command that is safe to repeat (cp -r nests a second copy).
    assert "cp -r notebooks" not in readme and "python3 dev.py lab --notebook-dir ~/" in readme
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    # Before the test command CI may only set up the machine (the browser test's Chromium), nothing else.
    i = lines.index("python3 dev.py test")
    setup, after = lines[:i], lines[i + 1 :]
    assert all(ln.startswith(("set ", "cd ", "export ", "command -v chromium")) for ln in setup), setup
    # After it, the core tests on the supported torch floor (docs/compat.md).
    assert any('-m nox -s "core(2.1.2)"' in ln for ln in after), after


def test_dev_help() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "dev.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "python3 dev.py test" in out.stdout
    # Every command dev.py suggests is the README's (python3), never another spelling.
    dev = [sys.executable, str(ROOT / "dev.py")]
    wrong = subprocess.run([*dev, "frobnicate"], capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stderr.endswith("try: python3 dev.py --help\n")
    assert not re.search(r"\bpython dev\.py", out.stdout + wrong.stderr)


def test_dev_lab_passes_a_notebook_dir_through_once(monkeypatch, tmp_path) -> None:
    dev = _dev()
    calls = []
    monkeypatch.setattr(dev, "ensure_venv", lambda extra: None)
    monkeypatch.setattr(dev, "LAB_SETTINGS", tmp_path / "settings" / "overrides.json")
    monkeypatch.setattr(dev, "replace_process", lambda *cmd, env: calls.append([str(c) for c in cmd]) or 0)
    assert dev.main(["lab", "--notebook-dir", str(tmp_path)]) == 0
    assert dev.main(["lab", "--no-browser"]) == 0
    mine, default = calls
    assert mine.count("--notebook-dir") == 1 and mine[mine.index("--notebook-dir") + 1] == str(tmp_path)
    assert (
        default[default.index("--notebook-dir") + 1] == str(ROOT / "notebooks") and "--no-browser" in default
    )


def test_dev_lab_turns_autosave_off_and_keeps_other_settings(monkeypatch, tmp_path) -> None:
    import json

    dev = _dev()
    settings = tmp_path / "overrides.json"
    settings.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    monkeypatch.setattr(dev, "ensure_venv", lambda extra: None)
    monkeypatch.setattr(dev, "replace_process", lambda *cmd, env: 0)
    monkeypatch.setattr(dev, "LAB_SETTINGS", settings)
    assert dev.main(["lab"]) == 0
    assert json.loads(settings.read_text()) == {
        "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
        "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    }


def test_dev_bench_tells_the_command_line_how_it_was_started(monkeypatch) -> None:
    dev = _dev()
    envs = []
    monkeypatch.setattr(dev, "ensure_venv", lambda extra: None)
    monkeypatch.setattr(dev, "replace_process", lambda *cmd, env: envs.append(env) or 0)
    monkeypatch.setattr(sys, "argv", ["dev.py", "bench", "--quick"])
    assert dev.main(["bench", "--quick"]) == 0
    assert envs[0]["EMA_LAB_PROG"] == f"{Path(sys.executable).name} dev.py"  # e.g. "python3 dev.py"


def test_results_holds_only_files_its_index_names() -> None:
    # What git tracks: a reader's own runs (untracked until they add them) are theirs to keep there.
    listed = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    index = (ROOT / "results" / "README.md").read_text()
    stems = set(re.findall(r"`([\w.+-]+?)(?:\.json|\.png)?`", index))
    # A folder's files are named by the folder's row; a top-level file by its name, or a run's plots by
    # suffix (`_times.png`) after the JSON's name.
    tops = {Path(f).relative_to("results").parts[0] for f in listed.stdout.splitlines()} - {"README.md"}
    unnamed = [
        n
        for n in tops
        if n not in index and not any(Path(n).stem.startswith(s) for s in stems if len(s) > 20)
    ]
    assert not unnamed, (
        f"results/ tracks {unnamed}, which results/README.md does not name: add a row for each to its table"
        " (file, machine, date, what it is), or `git rm` them"
    )


def test_the_docs_name_only_result_files_that_exist() -> None:
    for doc in (ROOT / "README.md", ROOT / "results" / "README.md", *(ROOT / "docs").glob("*.md")):
        text = doc.read_text()
        for where, name in re.findall(r"((?:\.\./|docs/)?)results/([\w.+-]+\.(?:json|md|png))", text):
            folders = (doc.parent / where / "results", ROOT / where / "results", ROOT / "results")
            assert any((d / name).exists() for d in folders), (doc, where, name)
        for stem, parts in re.findall(r"results/([\w.+-]+)-\{([\w,-]+)\}\.md", text):
            for part in parts.split(","):
                assert (doc.parent / "results" / f"{stem}-{part}.md").exists(), (doc, stem, part)


def test_the_readers_extra_holds_no_developer_tools() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    readers = _names(extras["notebooks"]) | _names(extras["bench"])
    assert not readers & {"pytest", "nbval", "hypothesis", "nox", "ruff", "playwright", "nbclient", "pyyaml"}


@pytest.mark.parametrize(
    "job, extra", [("lab", "notebooks"), ("bench", "notebooks"), ("compare", "notebooks"), ("test", "dev")]
)
def test_dev_installs_the_readers_extra_for_reading_and_the_dev_extra_for_testing(
    job, extra, monkeypatch
) -> None:
    dev = _dev()
    asked = []
    monkeypatch.setattr(dev, "ensure_venv", lambda e: asked.append(e))
    monkeypatch.setattr(dev, "replace_process", lambda *cmd, env: 0)
    monkeypatch.setattr(dev, "run", lambda *cmd, env=None: 0)
    monkeypatch.setattr(dev, "lab_settings", lambda: None)
    assert dev.main([job]) == 0 and asked == [extra]


@pytest.mark.parametrize(
    "stamp, extra, installs",
    [
        ("{h}", "dev", False),  # a stamp from before the readers' extra: the dev extra was installed
        ("{h} dev", "notebooks", False),  # dev includes the readers' extra
        ("{h} notebooks", "notebooks", False),
        ("{h} notebooks", "dev", True),
        ("0123 dev", "notebooks", True),  # pyproject.toml or constraints.txt changed since
        (None, "notebooks", True),
    ],
)
def test_dev_installs_an_extra_only_when_the_stamp_does_not_cover_it(
    stamp, extra, installs, monkeypatch, tmp_path
) -> None:
    dev = _dev()
    monkeypatch.setattr(dev, "GIVEN_VENV", None)
    monkeypatch.setattr(dev, "PY", Path(sys.executable))  # exists: no venv is made
    monkeypatch.setattr(dev, "STAMP", tmp_path / "stamp")
    if stamp is not None:
        dev.STAMP.write_text(stamp.format(h=dev.installed_from()))
    pips, envs = [], []
    monkeypatch.setattr(
        dev, "run", lambda *cmd, env=None: pips.append([str(c) for c in cmd]) or envs.append(env)
    )
    dev.ensure_venv(extra)
    assert [c[-1] for c in pips] == ([f".[{extra}]"] if installs else [])
    if installs:
        assert dev.STAMP.read_text().endswith(f" {extra}")
        # Every package at its pinned version, ema_lab's own build requirements too (pip passes the
        # environment variable to its isolated build; a -c option it does not).
        assert envs[0]["PIP_CONSTRAINT"] == str(ROOT / "constraints.txt")


def test_dev_lab_copies_the_notebooks_once_and_keeps_the_readers_edits(monkeypatch, tmp_path) -> None:
    dev = _dev()
    calls = []
    monkeypatch.setattr(dev, "ensure_venv", lambda extra: None)
    monkeypatch.setattr(dev, "lab_settings", lambda: None)
    monkeypatch.setattr(dev, "replace_process", lambda *cmd, env: calls.append([str(c) for c in cmd]) or 0)
    monkeypatch.chdir(tmp_path)
    assert dev.main(["lab", "--notebook-dir", "copy"]) == 0  # relative to where the reader is
    copy = tmp_path / "copy"
    first = sorted(p.name for p in copy.iterdir())
    # What a reader opens: the notebooks and the figures they show; none of the test machinery.
    notebooks = ROOT / "notebooks"
    assert first == sorted([p.name for p in notebooks.glob("*.ipynb")] + ["figures"])
    svgs = sorted(p.name for p in (notebooks / "figures").glob("*.svg"))
    assert sorted(p.name for p in (copy / "figures").iterdir()) == svgs
    for nb in copy.glob("*.ipynb"):  # every file a notebook shows lies in the copy beside it
        for target in re.findall(r"\]\((figures/[^)\s]+)\)", nb.read_text()):
            assert (copy / target).is_file(), (nb.name, target)
    (copy / "01_launch_overhead.ipynb").write_text("the reader's edit")
    assert dev.main(["lab", "--notebook-dir=copy"]) == 0  # the second time: no nesting, nothing replaced
    assert sorted(p.name for p in copy.iterdir()) == first
    assert (copy / "01_launch_overhead.ipynb").read_text() == "the reader's edit"
    assert calls[0][calls[0].index("--notebook-dir") + 1] == str(copy)
    assert f"--notebook-dir={copy}" in calls[1]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds processes through Linux's /proc")
def test_stopping_dev_py_stops_the_command_it_runs(tmp_path) -> None:
    import signal

    from ..processes import leftovers, marked, marked_env

    # An environment whose python only sleeps: `dev.py test` starts it (as ruff) and waits on it.
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexec sleep 120\n")
    python.chmod(0o755)
    env, mark = marked_env({**os.environ, "EMA_LAB_VENV": str(tmp_path / "venv")})
    job = subprocess.Popen([sys.executable, str(ROOT / "dev.py"), "test"], env=env)
    try:
        deadline = time.monotonic() + 30
        while len(found := marked(mark)) < 2 and time.monotonic() < deadline:  # dev.py and its command
            time.sleep(0.1)
        time.sleep(1)  # the command runs before Popen returns: let run() get its handle first
        job.send_signal(signal.SIGTERM)
        rc = job.wait(timeout=30)
    finally:
        left = leftovers(mark)  # and killed, whatever happened above
    assert len(found) == 2 and rc == 128 + signal.SIGTERM, (found, rc)
    assert left == []


def test_the_readmes_compare_command_selects_every_bench_run_and_nothing_else(tmp_path, capsys) -> None:
    """`dev.py compare results`: each bench run in results/ and results/gpu-*/, no other JSON (issue 39)."""
    import json

    from ema_lab.bench.cli import _result_files, main

    commands = {
        tuple(line.split("#")[0].split()[3:])
        for doc in (ROOT / "README.md", ROOT / "results" / "README.md")
        for line in re.findall(r"python3 dev\.py compare [^`\n]*", doc.read_text())
    }
    assert commands == {("results",)}
    runs = [
        p
        for p in (ROOT / "results").rglob("*.json")
        if json.loads(p.read_text()).get("schema") == "ema_lab.bench"
    ]
    assert any(p.parent.name.startswith("gpu-") for p in runs) and len(runs) >= 5
    assert any(p.name.startswith("costmodel-") for p in (ROOT / "results").glob("*.json"))  # left out
    assert _result_files([str(ROOT / "results")]) == sorted(runs)
    assert main(["compare", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip().endswith(f"{tmp_path}: no bench run in this folder or one level down")
    )


@pytest.mark.parametrize("checkout, used", [("this", True), ("another", False)])
def test_dev_uses_an_active_environment_that_holds_this_checkout(
    checkout, used, monkeypatch, tmp_path
) -> None:
    """A conda env made from environment.yml, or any venv with this checkout installed editable, is used."""
    import json

    site = tmp_path / "env" / "site-packages"
    info = site / "ema_lab-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ema_lab\nVersion: 0.1.0\n")
    url = (ROOT if checkout == "this" else tmp_path / "other").as_uri()
    (info / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": True}}))
    dev = _dev()
    monkeypatch.setattr(dev.sysconfig, "get_paths", lambda: {"purelib": str(site), "platlib": str(site)})
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env"))
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "env"))  # conda's envs are not venvs: no base_prefix
    assert dev.active_environment() == (tmp_path / "env" if used else None)
    monkeypatch.delenv("CONDA_PREFIX")
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # no environment active: dev.py makes .venv
    assert dev.active_environment() is None
