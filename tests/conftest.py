"""The ``requires_torch`` marker: a test of a feature newer than the supported floor (torch 2.1) is skipped,
with the version it needs and the version installed, wherever that feature is missing.

    @pytest.mark.requires_torch("2.3", "torch.utils.swap_tensors")
    @pytest.mark.requires_torch("2.4", "fused AdamW on CPU")

A feature spelled as a dotted ``torch.`` name must also exist: a private binding can be absent from some
builds of a version that has it elsewhere.

And the reader's home is left as the run found it (tests/home.py): every kernel the run starts gets the
run's own IPython and Jupyter folders, and the run fails if ``~/.ipython``, ``~/.jupyter`` or
``~/.local/share/jupyter`` changed. ``dev.py test`` runs ``pytest tests notebooks``: this file is loaded
first, so nbval's kernels are covered too.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from .home import changes, own_folders, snapshot

_HOME = pytest.StashKey[tuple[Path, dict, Path]]()  # the home, its snapshot, the run's own folders


def has_torch_name(dotted: str) -> bool:
    """Whether a dotted name such as ``torch.utils.swap_tensors`` exists, importing submodules as needed."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


# Private bindings that some builds of a version lack, and which builds have them.
BUILDS = {
    "torch._C._storage_Use_Count": "CUDA builds from 2.1; CPU-only builds since pytorch PR #155451, mid-2025",
}


def torch_lacks(version: str, feature: str) -> str | None:
    """The skip reason when this torch lacks ``feature`` (added in ``version``), else None."""
    if torch.__version__ >= version and (not feature.startswith("torch.") or has_torch_name(feature)):
        return None
    since = BUILDS.get(feature, f"torch >= {version}")
    return f"needs {feature} ({since}); this is torch {torch.__version__}"


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (so ``--strict-markers`` accepts it); move IPython and Jupyter out of the home."""
    config.addinivalue_line(
        "markers", "requires_torch(version, feature): skip where torch lacks a feature added in that version"
    )
    home, own = Path.home(), Path(tempfile.mkdtemp(prefix="ema_lab-tests-"))
    config.stash[_HOME] = home, snapshot(home), own
    os.environ.update(own_folders(own))  # inherited by every kernel and process the tests start


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run if it changed the reader's IPython or Jupyter folders, naming each path."""
    home, before, _ = session.config.stash[_HOME]
    changed = changes(before, snapshot(home))
    if changed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["FAILED: the tests changed the reader's home (tests/home.py):", *changed[:20]]
        lines += [f"... and {len(changed) - 20} more"] if len(changed) > 20 else []
        lines.append("(an IPython or Jupyter started outside the tests meanwhile writes there too)")
        for line in lines:
            if reporter:
                reporter.write_line(line, red=True)
            else:
                print(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's own IPython and Jupyter folders."""
    if _HOME in config.stash:
        shutil.rmtree(config.stash[_HOME][2], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before fixtures: a fixture may use the missing feature
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``requires_torch`` where this torch lacks the feature."""
    for marker in item.iter_markers("requires_torch"):
        reason = torch_lacks(*marker.args)
        if reason:
            pytest.skip(reason)
