"""The core tests on every torch ema_lab supports: ``nox`` (all versions) or ``nox -s "core(2.1.2)"``;
``nox -s trainers``: ema_lab inside timm, Lightning and accelerate (tests/trainers).

Each session installs torch first, then ema_lab with no extras (what ``pip install ema_lab`` gives a user)
plus pytest and hypothesis, and runs the test files that need torch alone. The venvs are 4-7 GB each for
the PyPI torch wheels with their CUDA libraries, so they are kept between runs (pip's cache serves the
wheels again). docs/compat.md records the last result.
"""

from __future__ import annotations

import nox

# The supported floor (pyproject's torch>=2.1), the CI's torch (its CPU wheel is on the CI machine's
# disk) and the newest the project's machines allow (their pip constraint caps torch at 2.14.1).
TORCH_VERSIONS = ["2.1.2", "2.13.0", "2.14.1"]

# The core's tests, a folder whole; tests/bench, tests/lessons and tests/repo need the extras (numpy,
# matplotlib, thop, jupytext, ...). test_flat.py counts ops with ema_lab.bench.counting (torch alone).
CORE_TESTS = ["tests/core"]

nox.options.sessions = ["core"]
nox.options.reuse_venv = "yes"


# torch 2.1 has wheels for Python 3.8-3.11 only: one interpreter that every version in the list supports.
@nox.session(python="3.11")
@nox.parametrize("torch", TORCH_VERSIONS, ids=TORCH_VERSIONS)
def core(session: nox.Session, torch: str) -> None:
    """Install torch==<version>, then ema_lab without extras, and run the core tests."""
    session.install(f"torch=={torch}")
    session.install("-e", ".", "pytest>=8", "hypothesis>=6")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *CORE_TESTS, *session.posargs)


# The peers whose decay schedules and post-hoc EMA ema_lab.schedules and ema_lab.posthoc match, at the
# versions docs/results/peer-schedules.json records. Not a default session: the torch wheel brings its CUDA
# libraries (about 5 GB), and the run takes minutes.
PEERS = ["timm==1.0.31", "diffusers==0.42.1", "ema-pytorch==0.8.3", "ultralytics==8.4.190"]


@nox.session(python="3.11")
def peer_schedules(session: nox.Session) -> None:
    """Run benchmarks/peer_schedules.py against the peers: ``nox -s peer_schedules -- --out [--edm2 DIR]``."""
    session.install("torch==2.14.1", "torchvision==0.29.1", *PEERS)
    session.run("python", "benchmarks/peer_schedules.py", *session.posargs, env={"PYTHONPATH": "."})


# tests/trainers run the real trainers (pyproject's test-only extra "trainers", exact versions). torch 2.14.1,
# as torchvision 0.29.1 (timm needs it) requires; not a default session (a 5.5 GB venv, about 5 minutes to
# build from pip's cache, 1 minute to test).
@nox.session(python="3.11")
def trainers(session: nox.Session) -> None:
    """Install torch, then ema_lab[trainers], and run tests/trainers."""
    session.install("torch==2.14.1")
    session.install("-e", ".[trainers]", "pytest>=8")
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "tests/trainers",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )
