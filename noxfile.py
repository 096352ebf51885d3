"""Test sessions beyond ``python3 dev.py test``, each in its own venv.

- ``nox`` / ``nox -s "core(2.1.2)"``: the core tests on every torch ema_lab supports.
- ``nox -s pairs``: the notebooks' pair test on several jupytext releases.
- ``nox -s latest``: the whole suite with every dependency at its newest release (not in CI).
- ``nox -s trainers``: ema_lab inside timm, Lightning and accelerate (tests/trainers), on torch 2.14.1.
- ``nox -s peer_schedules -- --out``: ema_lab's schedules against the peers' code.

Every session takes its packages at the versions of constraints.txt (the pinned set), but for the one it
varies (torch, jupytext), ``trainers`` (constraints-trainers.txt) and ``latest``. The core session
installs torch first, then ema_lab with no extras (what ``pip install ema_lab`` gives a user) plus pytest
and hypothesis, and runs the test files that need torch alone. The venvs are 4-7 GB each for the PyPI
torch wheels with their CUDA libraries, so they are kept between runs (pip's cache serves the wheels
again). docs/compat.md records the last result.
"""

from __future__ import annotations

import re
from pathlib import Path

import nox

# The supported floor (pyproject's torch>=2.1), the CI's torch (its CPU wheel is on the CI machine's
# disk) and the newest the project's machines allow (their pip constraint caps torch at 2.14.1).
TORCH_VERSIONS = ["2.1.2", "2.13.0", "2.14.1"]

# The core's tests, a folder whole; tests/bench, tests/lessons and tests/repo need the extras (numpy,
# matplotlib, thop, jupytext, ...). test_flat.py counts ops with ema_lab.bench.counting (torch alone).
CORE_TESTS = ["tests/core"]

nox.options.sessions = ["core"]
nox.options.reuse_venv = "yes"


def pins(session: nox.Session, *leave_out: str) -> str:
    """constraints.txt (the pinned set) without the packages named, as a file in the session's tmp folder.

    A session that installs its own torch leaves out torch and what that torch alone brings (triton and
    the nvidia-* libraries); every other package keeps its pinned version.
    """
    pattern = re.compile(rf"^({'|'.join(map(re.escape, leave_out))})\S*==")
    kept = [ln for ln in Path("constraints.txt").read_text().splitlines() if not pattern.match(ln)]
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text("\n".join(kept) + "\n")
    return str(path)


TORCH_FAMILY = ("torch", "triton", "nvidia-")


# torch 2.1 has wheels for Python 3.8-3.11 only: one interpreter that every version in the list supports.
@nox.session(python="3.11")
@nox.parametrize("torch", TORCH_VERSIONS, ids=TORCH_VERSIONS)
def core(session: nox.Session, torch: str) -> None:
    """Install torch==<version>, then ema_lab without extras, and run the core tests."""
    constraints = pins(session, *TORCH_FAMILY)
    session.install(f"torch=={torch}", "-c", constraints)
    session.install("-e", ".", "pytest", "hypothesis", "-c", constraints)
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


# The pair test on the oldest jupytext that pyproject.toml admits and on the last two releases: what the
# committed .py pairs hold must not depend on which of them a reader has. Not a default session.
JUPYTEXT_VERSIONS = ["1.16.0", "1.19.6", "1.19.7"]


@nox.session(python="3.11")
@nox.parametrize("jupytext", JUPYTEXT_VERSIONS, ids=JUPYTEXT_VERSIONS)
def pairs(session: nox.Session, jupytext: str) -> None:
    """The notebooks' jupytext pair test with jupytext==<version>, everything else from the pinned set."""
    session.install("-e", ".", "pytest", f"jupytext=={jupytext}", "-c", pins(session, "jupytext"))
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "tests/lessons/test_notebooks.py",
        "-k",
        "the_pair_is",
    )


@nox.session(python="3.11")
def latest(session: nox.Session) -> None:
    """The whole suite, nbval included, with every dependency at its newest release (the set ignored).

    Not part of CI: run it (``nox -s latest``) to find the next drift before a reader does, then
    ``python3 dev.py lock --upgrade`` once it passes.
    """
    session.install("--upgrade", "-e", ".[dev]")
    session.run("python", "-m", "pip", "list", "--format=freeze")
    session.run(
        "python", "dev.py", "test", *session.posargs, env={"EMA_LAB_VENV": session.virtualenv.location}
    )


# tests/trainers run the real trainers (pyproject's test-only extra "trainers"), pinned by their own set:
# torchvision 0.29.1, which timm needs, requires torch 2.14.1: not the project's torch 2.13.0.
# A 5.5 GB venv, about 5 minutes to build from pip's cache, 1 minute to test.
@nox.session(python="3.11")
def trainers(session: nox.Session) -> None:
    """Install ema_lab[trainers] from constraints-trainers.txt and run tests/trainers."""
    session.install("-e", ".[trainers]", "pytest", "-c", "constraints-trainers.txt")
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "tests/trainers", *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
