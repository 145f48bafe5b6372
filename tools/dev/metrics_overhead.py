"""What the metrics cost: all_reduce busbw and per-op time with metrics off and on, in one run.

    python -m linerate.tools.dev.metrics_overhead [--nproc 4] [--sizes 4K,1M,64M] [--rounds 6]

Each rank alternates rounds with metrics off and on. Off: the default group, created before
the exporter, records nothing. On: a group created after the exporter started, so everything
a user with ``LINERATE_METRICS_PORT`` gets runs: collectives recorded, the sampler, the
slow-rank and slow-link watch (collectives/straggler.py: arrivals noted in every op, views
exchanged through the Store), and a scraper thread reading the rank's own /metrics every
second, more often than any Prometheus would. Rounds interleave so that drift on a shared
machine hits both sides; the figure of each side is the median over its rounds. Under
torchrun it measures the ranks it is started in; otherwise it starts ``--nproc`` local ranks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from datetime import timedelta

from linerate.tools.launch import free_port, launch_local

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None) -> argparse.Namespace:
    from linerate.transport.options import parse_size
    p = argparse.ArgumentParser(prog="python -m linerate.tools.dev.metrics_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="local ranks (default 4)")
    p.add_argument("--sizes", default="4K,1M,64M",
                   type=lambda s: [parse_size(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=6, help="rounds per side (default 6)")
    p.add_argument("--seconds", type=float, default=1.0, help="length of a round (default 1)")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between scrapes of each rank in the 'on' rounds (default 1, "
                        "more often than Prometheus' usual 15 s; 0: no scraping)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="base port of the ranks' exporters (default: a free one)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nproc is None and all(k in os.environ for k in _TORCHRUN_ENV):
        return _rank(args)
    fwd = ["--sizes", ",".join(str(s) for s in args.sizes), "--rounds", str(args.rounds),
           "--seconds", str(args.seconds), "--scrape-interval", str(args.scrape_interval),
           "--metrics-port", str(args.metrics_port or free_port())]
    budget = len(args.sizes) * args.rounds * 2 * (args.seconds + 2) + 60
    return launch_local("linerate.tools.dev.metrics_overhead", fwd, args.nproc or 4, budget)


def _rank(args) -> int:
    import torch
    import torch.distributed as dist

    import linerate  # noqa: F401  (registers the backend)
    from linerate.transport import metrics

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("linerate", timeout=timedelta(seconds=120))
    port = metrics.start_exporter(args.metrics_port + int(os.environ.get("LOCAL_RANK", rank)),
                                  "127.0.0.1")
    # Created with the exporter on: this group is watched (collectives/straggler.py).
    watched = dist.new_group(backend="linerate", timeout=timedelta(seconds=120))
    groups = {False: dist.group.WORLD, True: watched}
    scraping = threading.Event()

    def scrape():
        url = f"http://127.0.0.1:{port}/metrics"
        while True:
            scraping.wait()
            urllib.request.urlopen(url, timeout=5).read()
            time.sleep(args.scrape_interval)

    if args.scrape_interval > 0:
        threading.Thread(target=scrape, daemon=True).start()
    factor = 2 * (world - 1) / world
    rows = []
    for size in args.sizes:
        t = torch.ones(max(1, size // 4))
        for _ in range(3):
            dist.all_reduce(t)
            dist.all_reduce(t, group=watched)
        # Iterations per round, agreed by all ranks, from one timed call.
        t0 = time.perf_counter()
        dist.all_reduce(t)
        n = torch.tensor([max(3, int(args.seconds / max(time.perf_counter() - t0, 1e-6)))])
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        iters = int(n.item())
        laps = {False: [], True: []}
        for r in range(2 * args.rounds):
            on = (r % 2 == 1) if (r // 2) % 2 == 0 else (r % 2 == 0)  # off,on,on,off,...
            metrics._enabled = on
            scraping.set() if on else scraping.clear()
            g = groups[on]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t, group=g)
            el = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            laps[on].append(el.item() / iters)
        off_s, on_s = statistics.median(laps[False]), statistics.median(laps[True])
        nbytes = t.numel() * 4
        rows.append((nbytes, iters, nbytes * factor / off_s, nbytes * factor / on_s))
    metrics._enabled = True
    if rank == 0:
        print(f"# metrics overhead: all_reduce float32, {world} ranks, {args.rounds} rounds per "
              f"side of ~{args.seconds:g} s, median per side; on = recording + sampler + the "
              f"slow-rank/link watch + a scrape every {args.scrape_interval:g} s (0: none)")
        print(f"# {'size(B)':>10} {'iters':>6} {'µs/op off':>10} {'µs/op on':>9} "
              f"{'busbw off(GB/s)':>16} {'busbw on(GB/s)':>15} {'on/off':>7}")
        for nbytes, iters, off, on in rows:
            f = nbytes * factor
            print(f"  {nbytes:>10} {iters:>6} {f / off * 1e6:>10.1f} {f / on * 1e6:>9.1f} "
                  f"{off / 1e9:>16.4f} {on / 1e9:>15.4f} {on / off:>7.3f}")
        sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
