"""The ``linerate`` console script: one argparse subcommand per module.

Each subcommand module defines ``add_parser(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returns the exit code) as a default. Only the module
of the subcommand run is imported (every one for ``linerate --help``). No subcommand module
imports torch at the top, nor does this module, ``import linerate`` or the transport's options:
``top``, ``flight``, every ``--help`` and the launching side of ``bench`` start in a fraction of
a second (importing torch costs over a second of CPU); the ranks import it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from linerate.tools import __version__

#: The subcommands and the module of each, in the order ``--help`` lists them.
SUBCOMMANDS = {"bench": "linerate.tools.bench", "netlab": "linerate.tools.netlab",
               "top": "linerate.tools.top", "model": "linerate.tools.model",
               "whatif": "linerate.tools.whatif", "probe": "linerate.tools.probe",
               "timeline": "linerate.tools.timeline", "flight": "linerate.tools.flight"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` (a subcommand's name) alone (``""``:
    none, for ``--version``)."""
    parser = argparse.ArgumentParser(
        prog="linerate",
        description="linerate: a torch.distributed backend over striped TCP, and its tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).add_parser(subparsers)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names, where it names a known one before any other word;
    ``""`` for ``--version`` alone; None (every subcommand's parser) otherwise."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in SUBCOMMANDS else None
    return "" if argv and all(w == "--version" for w in argv) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command(argv)).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
