#!/usr/bin/env python3
"""One-file driver: creates or reuses ./.venv, then runs a job in it.

    python dev.py bench [args]   time the EMA strategies on this machine (`python -m ema_lab bench`)
    python dev.py compare FILES  plot several bench runs side by side
    python dev.py test [args]    ruff, then the whole test suite including nbval over notebooks/
    python dev.py notebooks      execute every notebook in place (refreshes the committed outputs)
    python dev.py lab            open JupyterLab on notebooks/
    python dev.py demo           a short demo of every EMA strategy on a built-in model
    python dev.py gpu-check      on a CUDA machine: bench, kernel counts, CUDA tests (benchmarks/gpu_check.py)

Only the standard library is used here, so it runs on a bare Python >= 3.10.
Set EMA_LAB_TORCH to choose the torch requirement installed first (default: torch==2.13.0,
whose CPU wheel the project's CI machine has on disk); set it to "" to keep whatever torch pip picks.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".ema_lab-installed"
NBVAL_ARGS = [
    "--nbval",
    "--nbval-current-env",
    "--nbval-sanitize-with",
    str(ROOT / "notebooks" / "sanitize.cfg"),
]


def run(*cmd: str | Path, env: dict | None = None) -> int:
    """Run a command from the repo root and return its exit code."""
    return subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)


def ensure_venv() -> None:
    """Create .venv and install the project with its dev extra, once per pyproject.toml change."""
    if not PY.exists():
        print(f"[dev] creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    pip = [PY, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    torch_req = os.environ.get("EMA_LAB_TORCH", "torch==2.13.0")
    has_torch = subprocess.call([str(PY), "-c", "import torch"], stderr=subprocess.DEVNULL) == 0
    if torch_req and not has_torch:
        print(f"[dev] installing {torch_req}", flush=True)
        if run(*pip, *shlex.split(torch_req)):
            sys.exit("[dev] torch install failed")
    print("[dev] installing ema_lab[dev] (editable)", flush=True)
    if run(*pip, "-e", ".[dev]"):
        sys.exit("[dev] project install failed")
    STAMP.write_text(wanted)


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
    ensure_venv()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if job in {"bench", "demo", "compare"}:
        # Help and error lines name the command the user typed, not the module dev.py runs.
        env["EMA_LAB_PROG"] = f"{Path(sys.executable).name} {Path(sys.argv[0]).name}"
        return run(PY, "-m", "ema_lab", job, *rest, env=env)
    if job == "test":
        rc = run(PY, "-m", "ruff", "check", ".")
        rc |= run(PY, "-m", "ruff", "format", "--check", ".")
        # Notebooks run in quick mode under test; readers get the full mode by default.
        env["EMA_LAB_QUICK"] = env.get("EMA_LAB_QUICK", "1")
        rc |= run(PY, "-m", "pytest", "tests", "notebooks", *NBVAL_ARGS, *rest, env=env)
        return rc
    if job == "gpu-check":
        return run(PY, ROOT / "benchmarks" / "gpu_check.py", *rest, env=env)
    if job == "notebooks":
        return run(PY, ROOT / "notebooks" / "execute.py", *rest, env=env)
    if job == "lab":
        # Jupyter refuses to start as root (containers, CI boxes) unless told it is intended.
        root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        # The reader's own --notebook-dir / --ServerApp.root_dir wins; jupyter accepts the option only once.
        given = any(a.split("=")[0] in {"--notebook-dir", "--ServerApp.root_dir"} for a in rest)
        where = [] if given else ["--notebook-dir", ROOT / "notebooks"]
        lab_settings()
        # `python -m jupyterlab` rather than the `jupyter` script: a moved or copied .venv keeps its
        # scripts' old shebang, and the lab would read another environment's settings (autosave on).
        return run(PY, "-m", "jupyterlab", *where, *root, *rest, env=env)
    print(f"[dev] unknown job {job!r}; try: python dev.py --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
