"""Build, execute and check the notebooks: one place for how every notebook in ``notebooks/`` is run.

    python -m ema_lab.notebooks execute [paths...]   run notebooks top to bottom and save them in place

Execution uses a fresh ``python3`` kernel from the *current* interpreter (not whatever kernelspec
named python3 happens to be installed), cwd ``notebooks/``, the repository root on ``PYTHONPATH``,
and full mode unless ``EMA_LAB_QUICK`` is already set. A cell error aborts that notebook without
overwriting it and makes the command exit non-zero.

The nbval side lives here too: :func:`without_stderr` drops stderr stream outputs so that library
noise (torch.profiler's USDT lines on 2.13, warnings, matplotlib's font-cache message) never
decides whether a notebook passes; ``notebooks/conftest.py`` installs it on every nbval cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import nbformat
from nbformat import NotebookNode

__all__ = [
    "ROOT",
    "NOTEBOOK_DIR",
    "KERNELSPEC",
    "md",
    "code",
    "new_notebook",
    "notebook_paths",
    "kernel_env",
    "execute_notebook",
    "without_stderr",
    "drop_stderr_from_comparison",
    "main",
]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def md(text: str) -> NotebookNode:
    """A markdown cell from an indented triple-quoted string."""
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str) -> NotebookNode:
    """A code cell from an indented triple-quoted string."""
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


def new_notebook(cells: Iterable[NotebookNode]) -> NotebookNode:
    """An unexecuted notebook with the project's kernelspec, ready for :func:`execute_notebook`."""
    nb = nbformat.v4.new_notebook(cells=list(cells))
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def notebook_paths(paths: Sequence[str | Path] = ()) -> list[Path]:
    """The given notebooks (checked to exist), or every ``notebooks/*.ipynb`` in name order."""
    if not paths:
        return sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    out = []
    for p in map(Path, paths):
        if p.suffix != ".ipynb":
            raise ValueError(f"{p}: not a notebook (expected a .ipynb file)")
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such notebook")
        out.append(p.resolve())
    return out


def kernel_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The kernel environment: ``base`` (default os.environ) with the repo root first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in parts:
        parts.insert(0, str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def _kernel_manager() -> object:
    """An async kernel manager whose ``python3`` is ipykernel in this interpreter (sys.executable)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> object:
            if kernel_name == KERNELSPEC["name"]:
                return self.kernel_spec_class(
                    resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict()
                )
            return super().get_kernel_spec(kernel_name)

    return AsyncKernelManager(kernel_name=KERNELSPEC["name"], kernel_spec_manager=CurrentEnvSpecs())


def execute_notebook(path: str | Path, timeout: int = 1800) -> NotebookNode:
    """Run ``path`` top to bottom in a fresh kernel and overwrite it with the outputs; raise on a cell error.

    The file is only written after every cell ran, so a failure leaves the committed notebook as it was.
    """
    from nbclient import NotebookClient

    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    client = NotebookClient(
        nb,
        km=_kernel_manager(),
        timeout=timeout,
        record_timing=False,  # per-cell timestamps would make every refresh a diff
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=kernel_env())
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return nb


def without_stderr(outputs: Iterable[dict]) -> list[dict]:
    """``outputs`` minus stderr stream outputs (nbval compares the rest)."""
    return [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


def drop_stderr_from_comparison(items: Iterable[object]) -> int:
    """Make every nbval cell item compare its outputs without stderr; return how many items were changed."""
    n = 0
    for item in items:
        compare = getattr(item, "compare_outputs", None)
        if compare is None or not hasattr(item, "cell"):  # not an nbval IPyNbCell
            continue

        def compare_without_stderr(test, ref, skip_compare=None, _compare=compare):
            return _compare(without_stderr(test), without_stderr(ref), skip_compare)

        item.compare_outputs = compare_without_stderr
        n += 1
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``execute [paths...]``."""
    parser = argparse.ArgumentParser(prog="python -m ema_lab.notebooks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="run notebooks top to bottom and save them with their outputs")
    ex.add_argument("paths", nargs="*", help="notebooks to run (default: every notebooks/*.ipynb)")
    ex.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    args = parser.parse_args(argv)

    from nbclient.exceptions import CellExecutionError

    from .environment import quick_mode

    try:
        paths = notebook_paths(args.paths)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if not paths:
        print(f"no notebooks in {NOTEBOOK_DIR}", file=sys.stderr)
        return 1
    mode = "quick" if quick_mode() else "full"
    failed = []
    for path in paths:
        print(
            f"[notebooks] executing {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
            f"({mode} mode)",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            execute_notebook(path, timeout=args.timeout)
        except CellExecutionError as e:
            print(
                f"[notebooks] FAILED {path.name}: a cell raised; the file was not overwritten\n{e}",
                file=sys.stderr,
                flush=True,
            )
            failed.append(path.name)
            continue
        print(f"[notebooks]   done in {time.perf_counter() - t0:.1f} s", flush=True)
    if failed:
        print(f"[notebooks] {len(failed)} of {len(paths)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
