"""What a measurement ran on: versions, hardware and thread count, for result files and notebook cells;
the cache and free memory the OS reports, which bound the cost model's sweep."""

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
    no_cuda = "skipped: no CUDA device (torch.cuda.is_available() is False)"
    no_mps = "skipped: no Apple MPS device (torch.backends.mps.is_available() is False)"
    return {
        "cpu": None,
        "cuda": None if torch.cuda.is_available() else no_cuda,
        "mps": None if torch.backends.mps.is_available() else no_mps,
    }


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


def _parse_size(text: str) -> int:
    """``"32768K"`` / ``"1M"`` / ``"512"`` (sysfs cache sizes) in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache_bytes(
    sysfs: Path | str = "/sys/devices/system/cpu/cpu0/cache",
) -> tuple[int | None, str]:
    """The size of the largest data cache level of CPU 0 in bytes, and where it was read (None if unknown)."""
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(Path(sysfs).glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Unified", "Data") and size > 0 and (best is None or level > best[0]):
            best = (level, size)
    if best is not None:
        return best[1], f"{sysfs}/index*/size (L{best[0]})"
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size and size > 0:
            return int(size), f"os.sysconf({name!r})"
    return None, "unknown (no sysfs cache entries, no sysconf value)"


def device_cache_bytes(device: str) -> tuple[int | None, str]:
    """The last cache level before ``device``'s memory, in bytes, and where it was read (None if unknown)."""
    if device == "cpu":
        return last_level_cache_bytes()
    props = torch.cuda.get_device_properties(torch.cuda.current_device()) if device == "cuda" else None
    if getattr(props, "L2_cache_size", 0):
        return int(props.L2_cache_size), "torch.cuda.get_device_properties(...).L2_cache_size"
    return None, f"unknown for {device}"


def available_memory_bytes(meminfo: Path | str = "/proc/meminfo") -> tuple[int | None, str]:
    """Memory the OS says a new allocation can have now, in bytes, and where it was read (None if unknown).

    Linux's ``MemAvailable`` counts reclaimable page cache; elsewhere free pages from ``os.sysconf``.
    """
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, f"{meminfo} MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None, "unknown (no /proc/meminfo, no sysconf value)"
    return pages * size, "os.sysconf('SC_AVPHYS_PAGES')"
