"""The ``lossmask`` command line. Only this module touches argparse; each command calls the API."""

from __future__ import annotations

import argparse
import sys


def _example(args: argparse.Namespace) -> int:
    from .example import run_example

    return run_example()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossmask", description="Decide, for every token of every training row, whether it counts in the loss."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"lossmask {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    example = commands.add_parser("example", help="label a bundled ChatML-like sample and show what trains")
    example.set_defaults(run=_example)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)
