"""argparse ``type=`` converters shared by the ``linerate`` subcommands and benchmarks: each
turns bad text into an ArgumentTypeError, which argparse prints as a usage error."""
from __future__ import annotations

import argparse

from linerate.transport.options import parse_size


def size(text: str) -> int:
    """A positive byte count with an optional K/M/G suffix (binary multiples)."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return n


def nonneg_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return n


def positive_float(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return x


def nonneg_float(text: str) -> float:
    x = float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return x


def port(text: str) -> int:
    v = int(text)
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return v
