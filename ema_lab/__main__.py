"""Command line: ``python -m ema_lab demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one subcommand."""
    parser = argparse.ArgumentParser(prog="python -m ema_lab", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run every EMA strategy on a built-in model")
    demo.add_argument("--model", default="yolo")
    demo.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run_demo

        return run_demo(args.model, args.steps)
    return 2


if __name__ == "__main__":
    sys.exit(main())
