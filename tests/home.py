"""The reader's home, left as the tests found it: their IPython history and their Jupyter folders.

Every kernel the tests start (nbval's, tests/lessons/test_notebooks.py's, the lab's) would otherwise write
into ``~/.ipython/profile_default/history.sqlite`` and Jupyter's folders. :func:`own_folders` gives the whole
run its own folders instead; :func:`snapshot` and :func:`changes` check, around the run, that the
reader's stayed as they were. Caches elsewhere (matplotlib's font list in ``~/.cache``) are not watched.
"""

from __future__ import annotations

from pathlib import Path

#: The reader's folders the tests must leave as they found them, under their home.
WATCHED = (".ipython", ".jupyter", ".local/share/jupyter")
#: Left out: any Jupyter the reader runs meanwhile writes its connection files there.
RUNTIME = ".local/share/jupyter/runtime"

#: Variables that move IPython's and Jupyter's folders, and each one's folder name under the run's own.
FOLDERS = {
    "IPYTHONDIR": "ipython",
    "JUPYTER_CONFIG_DIR": "jupyter-config",
    "JUPYTER_DATA_DIR": "jupyter-data",
    "JUPYTER_RUNTIME_DIR": "jupyter-runtime",
    "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
    "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
}


def own_folders(where: Path) -> dict[str, str]:
    """Environment variables that give kernels and labs their own IPython and Jupyter folders in ``where``."""
    return {var: str(where / name) for var, name in FOLDERS.items()}


def snapshot(home: Path) -> dict[str, tuple[int, int] | None]:
    """The watched folders under ``home``: path -> (size, mtime in ns) of each file, None for a folder."""
    runtime = home / RUNTIME
    found: dict[str, tuple[int, int] | None] = {}
    for top in (home / name for name in WATCHED):
        for path in [top, *top.rglob("*")] if top.is_dir() else []:
            if path == runtime or runtime in path.parents:
                continue
            stat = path.lstat()
            found[str(path)] = None if path.is_dir() else (stat.st_size, stat.st_mtime_ns)
    return found


def changes(before: dict, after: dict) -> list[str]:
    """One line per path added, removed or changed (size or mtime) between two snapshots."""
    lines = [f"added {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"changed {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return lines
