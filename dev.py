#!/usr/bin/env python3
"""One-file driver: creates or reuses ./.venv, then runs a job in it.

    python3 dev.py bench [args]   time the EMA strategies on this machine (`python -m ema_lab bench`)
    python3 dev.py compare FILES  a table of bench runs side by side; --plot FILE.png also draws them
    python3 dev.py test [args]    ruff, then the whole test suite including nbval over notebooks/
    python3 dev.py notebooks      execute every notebook in place (refreshes the committed outputs)
    python3 dev.py lab [args]     open JupyterLab on notebooks/; --notebook-dir DIR: on DIR, a copy of
                                  the notebooks (and figures/) made there the first time (later runs
                                  keep your edits)
    python3 dev.py demo           a short demo of every EMA strategy on a built-in model
    python3 dev.py gpu-check      on a CUDA machine: bench, kernels, CUDA tests, peers (benchmarks/)
    python3 dev.py lock [args]    rewrite constraints*.txt, the pinned sets every install takes (uv);
                                  --upgrade: move every pin to its newest release

Only the standard library is used here, so it runs on a bare Python >= 3.10.
lab, bench, compare and demo install the readers' extra (`notebooks`); test, notebooks, gpu-check and
lock the developers' (`dev`, a superset). Every package, torch included, comes at the version that
constraints.txt pins, so an install made on any later day is the same.
Run inside an active virtual or conda environment that holds this checkout's ema_lab (environment.yml
makes one), dev.py uses that environment as it is; so it does with EMA_LAB_VENV=<environment folder>.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints.txt"  # the pinned set (python3 dev.py lock)
# Each pinned set: the extra it pins and what it pins beside it. torch: 2.13.0, whose CPU wheel the
# project's CI machine has on disk; the trainers' tests (nox -s trainers) need 2.14.1 for torchvision
# 0.29.1. setuptools: pip's isolated build of ema_lab would otherwise take its newest release. The oldest
# Python each set resolves for: the project's 3.10; the trainers' session runs 3.11 (accelerate needs it).
LOCKS = {
    "constraints.txt": ("dev", "3.10", "torch==2.13.0\nsetuptools>=64\n"),
    "constraints-trainers.txt": ("trainers", "3.11", "torch==2.14.1\npytest\nsetuptools>=64\n"),
}


def active_environment() -> Path | None:
    """The active virtual or conda environment, when this checkout's ema_lab is installed in it."""
    prefix = Path(sys.prefix)
    active = sys.prefix != sys.base_prefix or os.environ.get("CONDA_PREFIX") == sys.prefix
    if not active or prefix == ROOT / ".venv":
        return None
    from importlib import metadata

    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    for dist in metadata.distributions(name="ema_lab", path=site):
        if json.loads(dist.read_text("direct_url.json") or "{}").get("url") == ROOT.as_uri():
            return prefix
    return None


GIVEN_VENV = os.environ.get("EMA_LAB_VENV") or active_environment()
VENV = Path(GIVEN_VENV).absolute() if GIVEN_VENV else ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".ema_lab-installed"
NBVAL_ARGS = [
    "--nbval",
    "--nbval-current-env",
    "--nbval-sanitize-with",
    str(ROOT / "notebooks" / "sanitize.cfg"),
]


JOBS = ("bench", "compare", "demo", "test", "gpu-check", "notebooks", "lock", "lab")
# Which extra each job needs; "dev" includes "notebooks" (pyproject.toml).
EXTRAS = {"test": "dev", "notebooks": "dev", "gpu-check": "dev", "lock": "dev"}  # others: the readers' extra


def run(*cmd: str | Path, env: dict | None = None) -> int:
    """Run a command from the repo root and return its exit code; stopping dev.py stops the command too."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env)
    try:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the command got the same Ctrl-C: let it end its own way (a summary)
            return proc.wait()
    finally:  # a signal (SIGTERM, Ctrl-C) ended dev.py early: leave nothing running behind it
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def replace_process(*cmd: str | Path, env: dict) -> int:
    """Become ``cmd`` (POSIX exec), so that signals reach it directly; elsewhere run it as a child.

    JupyterLab cleans up its kernels on SIGINT/SIGTERM; run as dev.py's child it would be killed by
    dev.py's own Ctrl-C handling before it could, and its kernels would outlive it.
    """
    if os.name == "nt":
        return run(*cmd, env=env)
    sys.stdout.flush()
    os.chdir(ROOT)
    os.execve(str(cmd[0]), [str(c) for c in cmd], env)
    return 1  # not reached: execve returns only by raising


def installed_from() -> str:
    """What an install depends on: pyproject.toml and the pinned set."""
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + CONSTRAINTS.read_bytes()).hexdigest()


def ensure_venv(extra: str = "notebooks") -> None:
    """Create .venv and install the project with ``extra`` from the pinned set, once per change of either."""
    if GIVEN_VENV:
        print(f"[dev] using the environment {VENV} as it is (nothing installed)", flush=True)
        return
    if not PY.exists():
        print(f"[dev] creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    wanted = installed_from()
    # The stamp is "<hash> <extra>"; a stamp without an extra predates the readers' extra: it was dev.
    done, _, installed = (STAMP.read_text() if STAMP.exists() else "").partition(" ")
    covered = {"dev": {"dev", "notebooks"}, "notebooks": {"notebooks"}}.get(installed or "dev", set())
    if done == wanted and extra in covered:
        return
    # pip prints a line per package, so a long first install shows where it is. PIP_CONSTRAINT, unlike -c,
    # reaches pip's isolated build of ema_lab too (its setuptools).
    print(f"[dev] installing ema_lab[{extra}] (editable) and torch, pinned by {CONSTRAINTS.name}", flush=True)
    pip = [PY, "-m", "pip", "install", "--disable-pip-version-check", "-e", f".[{extra}]"]
    if run(*pip, env=dict(os.environ, PIP_CONSTRAINT=str(CONSTRAINTS))):
        sys.exit("[dev] install failed (pip's message above)")
    STAMP.write_text(f"{wanted} {extra}")


def lock(args: list[str]) -> int:
    """Rewrite the pinned sets (LOCKS) for Python 3.10+ on Linux, macOS and Windows, CPU and CUDA torch.

    uv keeps the pins already in a file unless told otherwise (``--upgrade``), so a run with nothing
    changed rewrites each byte for byte.
    """
    for name, (extra, python, pinned) in LOCKS.items():
        cmd = [PY, "-m", "uv", "pip", "compile", "pyproject.toml", "-", "--extra", extra, "--universal"]
        cmd += ["--python-version", python, "--custom-compile-command", "python3 dev.py lock", "--quiet"]
        cmd += ["--output-file", name, *args]
        if rc := subprocess.run([str(c) for c in cmd], input=pinned, text=True, cwd=ROOT).returncode:
            return rc
    return 0


def notebook_dir(args: list[str]) -> tuple[list[str], Path | None]:
    """The lab's arguments with its --notebook-dir made absolute, and that folder (None if not given)."""
    args = list(args)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in {"--notebook-dir", "--ServerApp.root_dir"} and (eq or i + 1 < len(args)):
            folder = Path(value if eq else args[i + 1]).expanduser().absolute()
            # The lab runs from the repository root: a relative folder means one under the caller's cwd.
            if eq:
                args[i] = f"{key}={folder}"
            else:
                args[i + 1] = str(folder)
            return args, folder
    return args, None


def reader_files(folder: str, names: list[str]) -> list[str]:
    """``shutil.copytree``'s ignore: keep the notebooks and figures/ they show, leave out the test machinery.

    conftest.py, execute.py, jupytext.toml, sanitize.cfg, the paired .py sources and figures/' drawing
    scripts would open in the lab beside the notebooks; a reader needs none of them.
    """
    if Path(folder) == ROOT / "notebooks":
        return [n for n in names if not (n.endswith(".ipynb") or n == "figures")]
    return [n for n in names if n.endswith(".py") or n in {"__pycache__", ".ipynb_checkpoints"}]


def copy_notebooks(folder: Path) -> None:
    """Copy the notebooks and figures/ to ``folder`` unless it exists: a second run keeps the edits made."""
    if folder.exists():
        return
    shutil.copytree(ROOT / "notebooks", folder, ignore=reader_files)
    print(f"[dev] copied the notebooks to {folder}; later runs open this copy as it is", flush=True)


LAB_SETTINGS = VENV / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
AUTOSAVE_OFF = {"@jupyterlab/docmanager-extension:plugin": {"autosave": False}}


def lab_settings() -> None:
    """Turn JupyterLab's autosave off in this venv: running a notebook never rewrites its outputs."""
    import json

    LAB_SETTINGS.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(LAB_SETTINGS.read_text()) if LAB_SETTINGS.exists() else {}
    for plugin, values in AUTOSAVE_OFF.items():
        current.setdefault(plugin, {}).update(values)
    LAB_SETTINGS.write_text(json.dumps(current, indent=2) + "\n")


def main(argv: list[str]) -> int:
    """Dispatch one job."""
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        return 0
    job, rest = argv[0], argv[1:]
    if job not in JOBS:  # before any install: a typo costs one line, not a venv
        print(f"[dev] unknown job {job!r}; try: python3 dev.py --help", file=sys.stderr)
        return 2
    ensure_venv(EXTRAS.get(job, "notebooks"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if job in {"bench", "demo", "compare"}:
        # Help and error lines name the command the user typed, not the module dev.py runs.
        env["EMA_LAB_PROG"] = f"{Path(sys.executable).name} {Path(sys.argv[0]).name}"
        return replace_process(PY, "-m", "ema_lab", job, *rest, env=env)
    if job == "test":
        rc = run(PY, "-m", "ruff", "check", ".")
        rc |= run(PY, "-m", "ruff", "format", "--check", ".")
        # Notebooks run in quick mode under test; readers get the full mode by default.
        env["EMA_LAB_QUICK"] = env.get("EMA_LAB_QUICK", "1")
        rc |= run(PY, "-m", "pytest", "tests", "notebooks", *NBVAL_ARGS, *rest, env=env)
        return rc
    if job == "lock":
        return lock(rest)
    if job == "gpu-check":
        return replace_process(PY, ROOT / "benchmarks" / "gpu_check.py", *rest, env=env)
    if job == "notebooks":
        return replace_process(PY, ROOT / "notebooks" / "execute.py", *rest, env=env)
    # lab, the last of JOBS
    # Jupyter refuses to start as root (containers, CI boxes) unless told it is intended.
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    # The reader's own --notebook-dir / --ServerApp.root_dir wins; jupyter accepts the option only once.
    rest, folder = notebook_dir(rest)
    if folder is not None:
        copy_notebooks(folder)
    where = [] if folder else ["--notebook-dir", ROOT / "notebooks"]
    lab_settings()
    # `python -m jupyterlab` rather than the `jupyter` script: a moved or copied .venv keeps its
    # scripts' old shebang, and the lab would read another environment's settings (autosave on).
    return replace_process(PY, "-m", "jupyterlab", *where, *root, *rest, env=env)


if __name__ == "__main__":
    # SIGTERM ends dev.py through SystemExit, so that run() stops the command it is waiting for.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main(sys.argv[1:]))
