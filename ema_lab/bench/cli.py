"""Command line: ``python -m ema_lab demo | bench | compare`` (needs the ``bench`` extra).

Also run as ``ema-lab`` (the installed script) and ``python3 dev.py bench|compare|demo``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _names(values: list[str]) -> list[str]:
    """Accept ``--models a b`` and ``--models a,b`` alike."""
    return [v for item in values for v in item.split(",") if v]


def command_name(argv0: str | None = None) -> str:
    """How the user started this command line, so help and errors name what they typed.

    ``dev.py`` says so in ``$EMA_LAB_PROG`` (e.g. ``python3 dev.py``); the ``ema-lab`` script runs with
    its own name as ``argv[0]``; anything else is ``python -m ema_lab``.
    """
    given = os.environ.get("EMA_LAB_PROG")
    if given:
        return given
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return "ema-lab" if name.startswith("ema-lab") else "python -m ema_lab"


def _parser() -> _Parser:
    from .models import ZOO
    from .sweep import DEFAULT_MODELS, QUICK_MODELS, candidate_names

    parser = _Parser(prog=command_name(), description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="run every EMA strategy on a built-in model")
    demo.add_argument("--model", default="yolo")
    demo.add_argument("--steps", type=int, default=20)
    bench = sub.add_parser(
        "bench",
        help="time every EMA strategy on the model zoo; write JSON and PNGs",
        description="Time EMA update strategies against the PR's before-code (seed_before) on the model "
        "zoo, count the ops they dispatch, fit the per-op cost model, and write results/<stem>.json plus "
        "PNG plots, where the stem is unique per run: "
        "<machine>_<date>T<time>Z_<quick|full>_t<threads>_<devices>. An existing file is never replaced.",
    )
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps", "all"])
    bench.add_argument(
        "--models",
        nargs="+",
        default=None,
        help=f"zoo models, of {list(ZOO)} (default: {list(DEFAULT_MODELS)}; --quick: {list(QUICK_MODELS)})",
    )
    bench.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        help=f"candidates to time (default: all of {candidate_names()}); seed_before and copy always run",
    )
    bench.add_argument(
        "--threads",
        nargs="+",
        default=["1"],
        help="intra-op thread count(s) while timing, e.g. 1 or 1 2 or 1,2; each is measured (default: 1)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="3 rounds, a smaller cost-model sweep, two models unless --models",
    )
    bench.add_argument("--out", default="results", help="output folder (default: results/)")
    bench.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    comp = sub.add_parser("compare", help="plot several result files side by side")
    comp.add_argument(
        "files",
        nargs="*",
        help="result JSON files, or folders: a folder stands for the bench runs in it and one level down "
        "(e.g. results, with the GPU runs in results/gpu-*/)",
    )
    comp.add_argument(
        "--plot",
        metavar="FILE",
        help=f"also draw the runs side by side into FILE ({', '.join(PLOT_FORMATS)}; replaced if it exists); "
        "without it compare writes no file",
    )
    return parser


def _threads(values: list[str]) -> list[int]:
    """``--threads 1 2`` and ``--threads 1,2`` alike, as ints; a non-number raises ValueError."""
    out = []
    for v in _names(values):
        try:
            out.append(int(v))
        except ValueError:
            raise ValueError(f"--threads: invalid int value: {v!r}") from None
    return out


def writable_folder(out: str, name: str | None = None) -> Path:
    """Create the folder ``out`` if needed and write a scratch file there; any failure is a ValueError.

    Run before any measuring, so that a folder the run cannot write to costs nothing but one line.
    ``name`` is how errors call the folder (default: ``--out '<out>'``); the error names the folder at
    fault: ``out`` itself when it exists, else the nearest folder above it that exists.
    """
    path, name = Path(out), name or f"--out {out!r}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        above = next(p for p in path.absolute().parents if p.exists())
        why = (
            "is a file, not a folder"
            if not above.is_dir()
            else f"takes no new folders ({exc.strerror or exc})"
        )
        raise ValueError(f"cannot create {name}: {above} {why}") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(
            f"cannot write to {name}: the folder takes no new files ({exc.strerror or exc})"
        ) from None
    return path


PLOT_FORMATS = (".png", ".svg", ".pdf")


def plot_file(plot: str) -> Path:
    """Check ``compare --plot FILE`` before any work: a known format, in a folder that takes files."""
    path = Path(plot)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {plot!r}: the file name must end in one of {', '.join(PLOT_FORMATS)}")
    if path.is_dir():
        raise ValueError(f"--plot {plot!r} is a folder; name the file to write")
    writable_folder(str(path.parent), f"the folder of --plot {plot!r}")
    return path


def _result_files(args: list[str]) -> list[Path]:
    """compare's arguments as files: a folder becomes the bench runs in it and one level down."""
    from .results import bench_files

    if not args:
        raise ValueError("name the runs to compare: result files or folders, e.g. `compare results`")
    files = []
    for arg in map(Path, args):
        found = bench_files(arg) if arg.is_dir() else [arg]
        if not found:
            raise ValueError(f"{arg}: no bench run in this folder or one level down")
        files += found
    return files


def _bench(args: argparse.Namespace) -> int:
    from .results import format_table
    from .sweep import run_bench, write_results

    record = run_bench(
        args.device,
        _names(args.models) if args.models else None,
        _names(args.strategies) if args.strategies else None,
        threads=_threads(args.threads),
        quick=args.quick,
        progress=not args.no_progress,
    )
    paths = write_results(record, args.out)
    print(format_table(record))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one subcommand; bad input is one line on stderr and exit code 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "demo":
            from .demo import run_demo

            return run_demo(args.model, args.steps)
        if args.cmd == "bench":
            writable_folder(args.out)  # before the work, not after it
            return _bench(args)
        from .sweep import compare

        plot = plot_file(args.plot) if args.plot else None
        print(compare(_result_files(args.files), plot))
        print(f"wrote {plot}" if plot else "add --plot FILE.png to draw these runs side by side")
        return 0
    except (ValueError, OSError) as exc:  # bad input (ResultError is a ValueError), FileExistsError, ...
        oserror = isinstance(exc, OSError) and exc.strerror  # e.g. a disk that filled while writing
        message = f"{exc.strerror}: {exc.filename}" if oserror else str(exc)
        print(f"{parser.prog} {args.cmd}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
