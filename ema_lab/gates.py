"""When may an EMA update use ``torch._foreach_lerp_``? As ultralytics PR #25315 and its follow-up gate it:
from torch 2.0, on ``mps`` from 2.4, never on ``npu`` (Ascend, excluded by a later version of the gate)."""

from __future__ import annotations

import re

import torch

__all__ = ["foreach_lerp_supported"]

FOREACH_MIN = (2, 0)
MPS_FOREACH_MIN = (2, 4)
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)")


def parse_version(version: str) -> tuple[int, int]:
    """Return (major, minor) of a torch version string such as "2.13.0+cpu" or "2.4.0a0+git1234"."""
    match = _VERSION.match(str(version))
    if match is None:
        raise ValueError(f"cannot parse torch version {version!r}: expected 'MAJOR.MINOR[...]'")
    # A pre-release (2.4.0a0, a nightly) counts as its release: it carries that release's kernels.
    return int(match.group(1)), int(match.group(2))


def foreach_lerp_supported(torch_version: str | None = None, device_type: str = "cpu") -> bool:
    """True when ``torch._foreach_lerp_`` may run on ``device_type`` under ``torch_version`` (default:
    installed)."""
    version = parse_version(torch.__version__ if torch_version is None else torch_version)
    if version < FOREACH_MIN:
        return False
    if device_type == "mps":
        return version >= MPS_FOREACH_MIN
    return device_type != "npu"
