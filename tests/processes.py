"""Find the processes a test started, however deep, by a mark in their environment (Linux's /proc).

A JupyterLab server starts kernels in their own sessions, and a kernel may start more (06's torchrun);
all of them inherit the environment, so a mark set there finds every one, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

MARK = "EMA_LAB_TEST_MARK"


def marked_env(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """``env`` with a fresh mark added, and the mark."""
    mark = uuid.uuid4().hex
    return {**env, MARK: mark}, mark


def marked(mark: str) -> list[str]:
    """'<pid> <command line>' of every live process carrying ``mark`` (empty where there is no /proc)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie is gone already; its parent has not reaped it yet
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{proc.name} {cmd.strip()}")
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def leftovers(mark: str, wait_s: float = 15.0) -> list[str]:
    """The marked processes still alive after up to ``wait_s``; those are then killed (to leave none)."""
    deadline = time.monotonic() + wait_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.25)
    for line in left:
        with contextlib.suppress(OSError):  # ended meanwhile
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return left
