"""The ``linerate`` console script: one argparse subcommand per module.

Each subcommand module defines ``add_parser(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returns the exit code) as a default. Modules should
import torch lazily so that ``linerate --help`` and ``--version`` stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from linerate.tools import __version__

#: Modules that register a subcommand, in the order ``--help`` lists them.
SUBCOMMANDS = ("linerate.tools.bench", "linerate.tools.netlab", "linerate.tools.top", "linerate.tools.model", "linerate.tools.whatif",
               "linerate.tools.probe", "linerate.tools.timeline", "linerate.tools.flight")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="linerate",
        description="linerate: a torch.distributed backend over striped TCP, and its tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
