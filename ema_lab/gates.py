"""When may an update use ``torch._foreach_lerp_``? As ultralytics PR #25315 and its follow-ups gate it."""

from __future__ import annotations

import re

import torch

__all__ = ["foreach_lerp_supported"]

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)")


def parse_version(version: str) -> tuple[int, int]:
    """Return (major, minor) of a torch version string such as "2.13.0+cpu" or "2.4.0a0+git1234"."""
    if (match := _VERSION.match(str(version))) is None:
        raise ValueError(f"cannot parse torch version {version!r}: expected 'MAJOR.MINOR[...]'")
    return int(match.group(1)), int(match.group(2))  # a pre-release or nightly has its release's kernels


def foreach_lerp_supported(torch_version: str | None = None, device_type: str = "cpu") -> bool:
    """Whether ``_foreach_lerp_`` may run on ``device_type`` under ``torch_version`` (default: installed)."""
    version = parse_version(torch.__version__ if torch_version is None else torch_version)
    if device_type == "mps":
        return version >= (2, 4)
    return version >= (2, 0) and device_type != "npu"  # npu (Ascend): excluded by a later version of the gate
