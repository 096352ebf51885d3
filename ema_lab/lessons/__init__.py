"""Pieces the notebooks import: thop profiling (notebook 03, docs/flop_counters.md), the bench runs notebook
04 draws beside the reader's own (``runs``), the distributed EMA (notebook 06), and :func:`scratch_dir`, a
temporary folder that outlives no kernel (notebooks 06 and 07).
``profiling`` needs the ``notebooks`` extra (the pinned ``thop``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["scratch_dir"]

_WATCHERS: list[subprocess.Popen] = []  # kept, so that no watcher is ever reaped as garbage meanwhile


def scratch_dir(prefix: str) -> Path:
    """A new temporary folder, removed when this process ends however it ends: exit, restart, even killed.

    A small watcher process removes it: it waits on a pipe whose writing end only this process holds,
    and the system closes that end when this process ends, whatever ended it.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    read_end, write_end = os.pipe()  # write_end stays open, never inherited, until this process ends
    code = (
        "import os, shutil, sys; os.read(int(sys.argv[1]), 1); shutil.rmtree(sys.argv[2], ignore_errors=True)"
    )
    watcher = subprocess.Popen(
        [sys.executable, "-c", code, str(read_end), str(path)],
        pass_fds=(read_end,),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in a terminal reaches this process, not the watcher
    )
    os.close(read_end)
    _WATCHERS.append(watcher)
    return path
