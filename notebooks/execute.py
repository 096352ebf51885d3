"""Execute notebooks in place: ``python notebooks/execute.py [NN_name.py|.ipynb ...]`` (default: all).

Each notebook is read from its jupytext ``.py`` (the source people edit), run top to bottom by nbclient
in a fresh kernel of *this* interpreter (not whatever kernelspec named python3 is installed), with cwd
``notebooks/`` and full mode unless ``EMA_LAB_QUICK`` is set, and written to its paired ``.ipynb`` only
after every cell ran: a cell error leaves the committed notebook as it was and the exit code is 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def kernel_manager() -> object:
    """An async kernel manager whose ``python3`` is ipykernel in this interpreter (sys.executable)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> object:
            if kernel_name == KERNELSPEC["name"]:
                spec = ipykernel.kernelspec.get_kernel_dict()
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES, **spec)
            return super().get_kernel_spec(kernel_name)

    return AsyncKernelManager(kernel_name=KERNELSPEC["name"], kernel_spec_manager=CurrentEnvSpecs())


def pair(path: str | Path) -> tuple[Path, Path]:
    """The (``.py``, ``.ipynb``) pair of a notebook given by either file; the ``.py`` must exist."""
    path = Path(path).resolve()
    if path.suffix not in {".py", ".ipynb"}:
        raise ValueError(f"{path}: not a notebook (expected NN_name.py or NN_name.ipynb)")
    source = path.with_suffix(".py")
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such jupytext notebook source")
    return source, path.with_suffix(".ipynb")


def run(nb: nbformat.NotebookNode, cwd: Path, timeout: int) -> None:
    """Execute ``nb`` in place, top to bottom, in a fresh kernel of this interpreter with cwd ``cwd``."""
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    client = NotebookClient(
        nb,
        km=kernel_manager(),
        timeout=timeout,
        record_timing=False,  # per-cell timestamps would make every refresh a diff
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute(cleanup_kc=True)  # nbclient keeps a kernel it did not start alive unless told


def execute(path: str | Path, timeout: int = 1800) -> nbformat.NotebookNode:
    """Run one notebook from its ``.py`` and write the executed ``.ipynb``; raise on a cell error."""
    source, target = pair(path)
    nb = jupytext.read(source)
    run(nb, source.parent, timeout)
    nbformat.validate(nb)
    # Written by jupytext as `jupytext --sync` writes it (the .py header's metadata filter kept, its text
    # representation dropped), so that a reader's first sync leaves the committed file as it is.
    jupytext.write(nb, target, fmt="ipynb")
    return nb


def main(argv: list[str] | None = None) -> int:
    """Execute the given notebooks (default: every ``notebooks/NN_*.py``); 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: every notebooks/[0-9]*.py)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(HERE.glob("[0-9]*.py"))
    failed = []
    for path in paths:
        t0 = time.perf_counter()
        print(f"[notebooks] executing {Path(path).name}", flush=True)
        try:
            execute(path, timeout=args.timeout)
        except (ValueError, FileNotFoundError) as e:
            parser.error(str(e))
        except CellExecutionError as e:
            print(f"[notebooks] FAILED {Path(path).name}: a cell raised; not written\n{e}", file=sys.stderr)
            failed.append(Path(path).name)
            continue
        print(f"[notebooks]   done in {time.perf_counter() - t0:.1f} s", flush=True)
    if failed:
        print(f"[notebooks] {len(failed)} of {len(paths)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
