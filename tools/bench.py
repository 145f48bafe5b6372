"""linerate bench: nccl-tests style bandwidth of linerate and Gloo, side by side in one run.

Local mode (the default): `linerate bench --nproc 4` starts 4 ranks on loopback itself.
Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, no --nproc), each process
is one rank: `torchrun --nnodes 2 --nproc-per-node 1 ... -m linerate.tools.bench`.
"""
from __future__ import annotations

import argparse
import os
import sys

from linerate.tools.argtypes import port as _port
from linerate.tools.argtypes import positive_float as _positive_float
from linerate.tools.argtypes import positive_int as _positive_int
from linerate.tools.argtypes import size as _size
from linerate.tools.launch import launch_local
from linerate.transport.options import parse_size

OP_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
DEFAULT_NPROC = 2
#: Seconds the launcher waits beyond --timeout, so a rank's own timeout message comes first.
LAUNCH_GRACE_S = 15.0
DEFAULT_RAW_STREAMS = 4
DEFAULT_RAW_SECONDS = 2.0
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="compare linerate and Gloo collectives (nccl-tests style)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=_positive_int, default=None,
                        help=f"ranks to start on this host (default {DEFAULT_NPROC}; "
                             "leave out under torchrun)")
    parser.add_argument("--ops", type=_op_list, default=list(OP_NAMES),
                        help=f"comma separated collectives (default: all, {','.join(OP_NAMES)})")
    parser.add_argument("--min-bytes", type=_size, default=parse_size("8K"),
                        help="smallest size, K/M/G suffixes allowed (default 8K)")
    parser.add_argument("--max-bytes", type=_size, default=parse_size("64M"),
                        help="largest size (default 64M)")
    parser.add_argument("--factor", type=_factor, default=4,
                        help="size multiplier between rows (default 4)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.add_argument("--iters", type=_positive_int, default=None,
                        help="timed iterations per size and backend (default: enough for "
                             "~0.3 s, at least 2)")
    parser.add_argument("--warmup", type=_positive_int, default=3,
                        help="untimed iterations before each measurement (default 3)")
    parser.add_argument("--backends", type=_name_list, default=["linerate", "gloo"],
                        help="comma separated backends to compare (default linerate,gloo)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write every result to FILE")
    parser.add_argument("--check", action="store_true",
                        help="verify each size's first result and count wrong elements")
    parser.add_argument("--raw", action=argparse.BooleanOptionalAction, default=None,
                        help="first measure the raw TCP capacity of the ring links (tools."
                             "linkprobe) and add a util column, busbw / capacity (default: on "
                             "when the ranks are on different hosts or LINERATE_SOCKET_IFNAME is "
                             "set; loopback has no line rate)")
    parser.add_argument("--raw-streams", type=_positive_int, default=DEFAULT_RAW_STREAMS,
                        help=f"parallel TCP streams per link for --raw (default "
                             f"{DEFAULT_RAW_STREAMS})")
    parser.add_argument("--raw-seconds", type=_positive_float, default=DEFAULT_RAW_SECONDS,
                        help=f"seconds per link (and rail) for --raw (default "
                             f"{DEFAULT_RAW_SECONDS:g})")
    parser.add_argument("--raw-tool", choices=("auto", "socket", "iperf3"), default="auto",
                        help="link probe: iperf3 when installed on every rank (auto), or "
                             "linerate's own parallel TCP streams (socket)")
    parser.add_argument("--raw-sequential", action="store_true",
                        help="with --raw, measure one link at a time instead of the whole ring "
                             "at once")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw busbw (Gbit/s) against size for each backend, with the raw "
                             "capacity as a line (needs matplotlib)")
    parser.add_argument("--netlab", metavar="NAME", nargs="?", const="lab", default=None,
                        help="run on a running `linerate netlab` (default lab name: lab), its "
                             "ranks per host in each host; --nproc defaults to every rank")
    parser.add_argument("--ranks-per-host", default=None, metavar="R",
                        help="with --netlab: ranks in each host namespace instead of the lab's "
                             "(a count, or one per host: 4,3)")
    parser.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                        help="serve Prometheus metrics: rank i on PORT + its local rank "
                             "(LINERATE_METRICS_PORT); watch with `linerate top`")
    parser.add_argument("--loop", action="store_true",
                        help="after the first sweep, repeat the linerate sweep until "
                             "interrupted (a live demo for Grafana / linerate top)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before every rank is killed (default 300)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.min_bytes > args.max_bytes:
        print("linerate bench: error: --min-bytes is larger than --max-bytes", file=sys.stderr)
        return 2
    args.sizes = sizes(args.min_bytes, args.max_bytes, args.factor)
    if args.json:
        args.json = os.path.abspath(args.json)
    if args.plot:
        from linerate.tools.bench_plot import matplotlib_missing
        missing = matplotlib_missing()
        if missing:
            print(f"linerate bench: error: --plot {missing}", file=sys.stderr)
            return 2
        args.plot = os.path.abspath(args.plot)
    if args.netlab is not None:
        from linerate.tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            print(f"linerate bench: --netlab: {reason}", file=sys.stderr)
            return 2
        lab = netlab.load(args.netlab)
        try:
            return netlab.run_ranks(lab, args.nproc, ["-m", "linerate.tools.bench"] + rank_argv(args),
                                    timeout=None if args.loop else args.timeout + LAUNCH_GRACE_S,
                                    prefix_output=False, ranks_per_host=args.ranks_per_host)
        except (ValueError, RuntimeError) as e:
            print(f"linerate bench: --netlab: {e}", file=sys.stderr)
            return 2
    if args.ranks_per_host is not None:
        print("linerate bench: error: --ranks-per-host needs --netlab", file=sys.stderr)
        return 2
    if args.nproc is None and all(k in os.environ for k in _TORCHRUN_ENV):
        from linerate.tools.bench_worker import run_worker  # imports torch: only in ranks
        return run_worker(args)
    return launch_local("linerate.tools.bench", rank_argv(args), args.nproc or DEFAULT_NPROC,
                        None if args.loop else args.timeout + LAUNCH_GRACE_S)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line of one rank: these options, without --nproc."""
    argv = ["--ops", ",".join(args.ops), "--min-bytes", str(args.min_bytes),
            "--max-bytes", str(args.max_bytes), "--factor", str(args.factor),
            "--dtype", args.dtype, "--warmup", str(args.warmup),
            "--backends", ",".join(args.backends), "--timeout", str(args.timeout)]
    if args.iters:
        argv += ["--iters", str(args.iters)]
    if args.json:
        argv += ["--json", args.json]
    if args.check:
        argv.append("--check")
    if args.raw is not None:
        argv.append("--raw" if args.raw else "--no-raw")
    argv += ["--raw-streams", str(args.raw_streams), "--raw-seconds", repr(args.raw_seconds)]
    argv += ["--raw-tool", args.raw_tool]
    if args.raw_sequential:
        argv.append("--raw-sequential")
    if args.plot:
        argv += ["--plot", args.plot]
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port)]
    if args.loop:
        argv.append("--loop")
    return argv


def _factor(text: str) -> int:
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {text}")
    return n


def _name_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma separated list")
    return names


def _op_list(text: str) -> list[str]:
    names = _name_list(text)
    unknown = [n for n in names if n not in OP_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OP_NAMES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
