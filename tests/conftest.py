"""The ``requires_torch`` marker: a test of a feature newer than the supported floor (torch 2.1) is skipped,
with the version it needs and the version installed, wherever that feature is missing.

    @pytest.mark.requires_torch("2.3", "torch.utils.swap_tensors")
    @pytest.mark.requires_torch("2.4", "fused AdamW on CPU")

A feature spelled as a dotted ``torch.`` name must also exist: a private binding can be absent from some
builds of a version that has it elsewhere.
"""

from __future__ import annotations

import importlib

import pytest
import torch


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
    """Register the marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line(
        "markers", "requires_torch(version, feature): skip where torch lacks a feature added in that version"
    )


@pytest.hookimpl(tryfirst=True)  # before fixtures: a fixture may use the missing feature
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``requires_torch`` where this torch lacks the feature."""
    for marker in item.iter_markers("requires_torch"):
        reason = torch_lacks(*marker.args)
        if reason:
            pytest.skip(reason)
