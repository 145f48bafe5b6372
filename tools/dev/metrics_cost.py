"""What watching costs: small-op latency and large-op bus bandwidth with the metrics exporter on
(which also turns on the slow-rank and slow-link watch, collectives/straggler.py) against off.

    python -m linerate.tools.dev.metrics_cost --nproc 2
    python -m linerate.tools.dev.metrics_cost --nproc 4 --rounds 4 --json cost.json
    LINERATE_SHM=0 python -m linerate.tools.dev.metrics_cost --nproc 2     # TCP on loopback

Each round runs the ranks twice, metrics off then on (fresh processes each time, so nothing of
one mode stays in the other): the median over ``--iters`` samples of the slowest rank's time of
one 4 KB all_reduce after a barrier, and the median bus bandwidth of ``--big-iters`` all_reduces
of ``--big`` bytes. The table gives each round's figures and the median over rounds, with the
on/off ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

MODULE = "linerate.tools.dev.metrics_cost"


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    import linerate  # noqa: F401  (registers the backend)
    from linerate.transport import metrics

    if args.mode == "on":
        metrics.start_exporter(0, "127.0.0.1")  # any free port: enabled, as with METRICS_PORT
    dist.init_process_group("linerate")
    P, rank = dist.get_world_size(), dist.get_rank()
    clock = time.perf_counter
    small = torch.zeros(max(1, args.small // 4), dtype=torch.float32)
    for _ in range(args.warmup):
        dist.barrier()
        dist.all_reduce(small)
    lat = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = clock()
        dist.all_reduce(small)
        lat.append(clock() - t0)
    big = torch.ones(args.big // 4, dtype=torch.float32)
    dist.all_reduce(big)
    bus = []
    for _ in range(args.big_iters):
        dist.barrier()
        t0 = clock()
        dist.all_reduce(big)
        bus.append(clock() - t0)
    t = torch.tensor(lat + bus, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each sample's slowest rank
    worst = t.tolist()
    lat, bus = worst[:len(lat)], worst[len(lat):]
    factor = 2 * (P - 1) / P
    if rank == 0:
        with open(args.json_out, "w") as f:
            json.dump({"mode": args.mode, "ranks": P, "latency_us": statistics.median(lat) * 1e6,
                       "busbw_gbs": statistics.median(factor * args.big / s / 1e9 for s in bus)}, f)
    dist.destroy_process_group()
    return 0


def run(args) -> list[dict]:
    from linerate.tools.launch import launch_local
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for mode in ("off", "on"):
                out = os.path.join(tmp, f"{rnd}{mode}.json")
                argv = ["--worker", "--mode", mode, "--json-out", out, "--small", str(args.small),
                        "--big", str(args.big), "--iters", str(args.iters), "--warmup",
                        str(args.warmup), "--big-iters", str(args.big_iters)]
                code = launch_local(MODULE, argv, args.nproc, args.timeout)
                if code != 0:
                    raise SystemExit(f"metrics_cost: the ranks failed (exit {code}, metrics {mode})")
                row = json.load(open(out))
                row["round"] = rnd + 1
                rows.append(row)
    return rows


def _fmt(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}B"
    return f"{n} B"


def table(rows: list[dict], small: int, big: int) -> str:
    lines = [f"| round | metrics | ranks | {_fmt(small)} all_reduce µs | "
             f"{_fmt(big)} busbw GB/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['mode']} | {r['ranks']} | {r['latency_us']:.1f} | "
                     f"{r['busbw_gbs']:.2f} |")
    med = {}
    for mode in ("off", "on"):
        mine = [r for r in rows if r["mode"] == mode]
        med[mode] = (statistics.median(r["latency_us"] for r in mine),
                     statistics.median(r["busbw_gbs"] for r in mine))
        lines.append(f"| median | {mode} | {rows[0]['ranks']} | {med[mode][0]:.1f} | "
                     f"{med[mode][1]:.2f} |")
    lines.append(f"| on / off | | | {med['on'][0] / med['off'][0]:.3f} | "
                 f"{med['on'][1] / med['off'][1]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from linerate.tools.argtypes import size as _size
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks on this host (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs (default 3)")
    p.add_argument("--small", type=_size, default=4096, help="small all_reduce (default 4K)")
    p.add_argument("--big", type=_size, default=64 << 20, help="large all_reduce (default 64M)")
    p.add_argument("--iters", type=int, default=1000, help="timed small calls (default 1000)")
    p.add_argument("--warmup", type=int, default=100, help="untimed small calls first")
    p.add_argument("--big-iters", type=int, default=8, help="timed large calls (default 8)")
    p.add_argument("--json", default="", help="write the rows to this file")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("on", "off"), default="off", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = run(args)
    print(table(rows, args.small, args.big))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
