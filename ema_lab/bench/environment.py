"""What a measurement ran on: versions, hardware and thread count, for result files and notebook cells."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

__all__ = ["environment", "available_devices", "quick_mode"]


def quick_mode() -> bool:
    """True when EMA_LAB_QUICK=1: smaller sweeps and fewer repeats (tests, CI); outputs keep their shape."""
    return os.environ.get("EMA_LAB_QUICK", "0") not in {"", "0", "false", "False"}


def cpu_model() -> str:
    """The CPU's marketing name, best effort across Linux, macOS and Windows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def available_devices() -> dict[str, str | None]:
    """Map each device type ema_lab knows to None when usable, else the reason it is skipped."""
    out: dict[str, str | None] = {"cpu": None}
    out["cuda"] = (
        None if torch.cuda.is_available() else "skipped: no CUDA device (torch.cuda.is_available() is False)"
    )
    mps = getattr(torch.backends, "mps", None)
    out["mps"] = (
        None
        if mps is not None and mps.is_available()
        else "skipped: no Apple MPS device (torch.backends.mps.is_available() is False)"
    )
    return out


def _git_revision() -> str | None:
    """The checkout's short revision, or None for an installed copy (no repository around it)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: str = "cpu") -> dict[str, object]:
    """Versions, hardware, OS and thread count for a result record."""
    from .. import __version__

    env: dict[str, object] = {
        "ema_lab": __version__,
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device,
        "device_name": cpu_model(),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    elif device == "mps":
        env["device_name"] = f"Apple MPS ({cpu_model()})"
    return env
