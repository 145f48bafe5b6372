"""Whether the utilization of interface ``shm`` stays at or under 1 under load, on every rank.

    python -m linerate.tools.dev.shm_utilization [--nproc 4] [--seconds 60] [--interval 0.5]
        [--ops all_reduce,broadcast,...] [--max-bytes 64M] [--json]

Starts ``linerate bench --nproc N --metrics-port PORT --loop --backends linerate`` (every op
by default, the bench's sizes up to --max-bytes, on the ranks' shared segment) and, once every
rank's exporter answers, scrapes every rank's /metrics every --interval seconds for --seconds
seconds. Each scrape gives each rank's ``linerate_link_utilization_ratio{interface="shm"}``
(the exporter's samples, over its LINERATE_METRICS_WINDOW) and, between two scrapes, the
utilization ``linerate top`` shows (the rate of ``linerate_interface_bytes_total`` over the
capacity). Also checked: every rank exports exactly one ``shm`` capacity, and every rank the
same figure. Prints, per rank and direction, the samples and their maximum; exit status 0
when no sample exceeded 1.0 and the capacities agree, else 1 (2: the bench did not come up).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from linerate.tools import top
from linerate.tools.launch import free_port

UTILIZATION = "linerate_link_utilization_ratio"
CAPACITY = "linerate_link_capacity_bytes_per_second"
#: Seconds the ranks get to start and serve their metrics.
START_S = 120.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m linerate.tools.dev.shm_utilization",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--seconds", type=float, default=60.0,
                   help="seconds of scraping once every rank answers (default 60)")
    p.add_argument("--interval", type=float, default=0.5,
                   help="seconds between scrapes of every rank (default 0.5)")
    p.add_argument("--ops", default=None, help="the bench's --ops (default: every op)")
    p.add_argument("--max-bytes", default=None, help="the bench's --max-bytes (default its own)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="base port of the ranks' exporters (default: a free one)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p.parse_args(argv)


def _bench_command(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "linerate.tools.cli", "bench", "--nproc", str(args.nproc),
           "--metrics-port", str(port), "--loop", "--backends", "linerate"]
    if args.ops:
        cmd += ["--ops", args.ops]
    if args.max_bytes:
        cmd += ["--max-bytes", args.max_bytes]
    return cmd


def watch(urls: list[str], seconds: float, interval: float) -> dict:
    """Scrape ``urls`` every ``interval`` s for ``seconds`` s: per (rank, direction) the
    exporter's shm utilization samples and top's, and the shm capacities seen."""
    gauge: dict[str, list[float]] = {}
    counters: dict[str, list[float]] = {}
    capacities: set[float] = set()
    bad_capacity: list[str] = []
    scrapes = 0
    prev = None
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            cur = top.scrape_all(pool, urls, top.DEFAULT_TIMEOUT)
            scrapes += 1
            for url, s in zip(urls, cur):
                if not s.ok:
                    continue
                caps = [(k, v) for k, v in s.samples.get(CAPACITY, {}).items()
                        if ("interface", "shm") in k]
                if len(caps) != 1:
                    bad_capacity.append(f"{url}: {len(caps)} shm capacities")
                capacities.update(v for _, v in caps)
                rank = dict(next(iter(s.samples.get("linerate_info", {})), ())).get("rank", url)
                for key, v in s.samples.get(UTILIZATION, {}).items():
                    labels = dict(key)
                    if labels.get("interface") == "shm":
                        gauge.setdefault(f"{rank} {labels.get('direction')}", []).append(v)
            frame = top.compute_frame(prev, cur)
            for row in frame["links"]:
                if row["interface"] == "shm" and row["utilization_source"] == "counters":
                    counters.setdefault(f"{row['rank']} {row['direction']}", []).append(
                        row["utilization"])
            prev = cur
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    return {"scrapes": scrapes, "gauge": gauge, "counters": counters,
            "capacities": sorted(capacities), "bad_capacity": bad_capacity[:8]}


def verdict(figures: dict) -> list[str]:
    """What is wrong with ``watch``'s figures (nothing: an empty list)."""
    wrong = []
    for kind in ("gauge", "counters"):
        if not figures[kind]:
            wrong.append(f"no {kind} samples of interface shm")
        for key, values in figures[kind].items():
            over = [v for v in values if v > 1.0]
            if over:
                wrong.append(f"rank/direction {key}: {len(over)} {kind} samples above 1.0 "
                             f"(max {max(over):.3f})")
    if figures["bad_capacity"]:
        wrong.append("not one shm capacity per rank: " + "; ".join(figures["bad_capacity"]))
    if len(figures["capacities"]) != 1:
        wrong.append(f"the ranks export {len(figures['capacities'])} shm capacities: "
                     f"{figures['capacities']}")
    return wrong


def main(argv=None) -> int:
    args = parse_args(argv)
    port = args.metrics_port or free_port()
    urls = [f"http://127.0.0.1:{port + r}/metrics" for r in range(args.nproc)]
    env = dict(os.environ)
    env.pop("LINERATE_LINK_CAPACITY", None)  # the measured capacity of shm
    with tempfile.TemporaryFile("w+") as err:
        bench = subprocess.Popen(_bench_command(args, port), env=env,
                                 stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            deadline = time.monotonic() + START_S
            while not all(top.scrape(u, top.DEFAULT_TIMEOUT).ok for u in urls):
                if bench.poll() is not None or time.monotonic() > deadline:
                    err.seek(0)
                    print(f"the bench did not serve metrics on ports {port}.."
                          f"{port + args.nproc - 1} (exit status {bench.poll()}): "
                          f"{err.read()[-2000:]}", file=sys.stderr)
                    return 2
                time.sleep(0.2)
            figures = watch(urls, args.seconds, args.interval)
        finally:
            bench.terminate()  # the launcher stops every rank's session
            try:
                bench.wait(timeout=30)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait(timeout=10)
    wrong = verdict(figures)
    if args.json:
        print(json.dumps(dict(figures, wrong=wrong), indent=2))
    else:
        print(f"# {args.nproc} ranks, {figures['scrapes']} scrapes of every rank in "
              f"{args.seconds:g} s; shm capacity: "
              + ", ".join(f"{c * 8 / 1e9:.1f} Gbit/s" for c in figures["capacities"]))
        print(f"#{'rank dir':>10}{'source':>10}{'samples':>9}{'max':>9}{'mean':>9}")
        for kind in ("gauge", "counters"):
            for key in sorted(figures[kind]):
                v = figures[kind][key]
                print(f" {key:>10}{kind:>10}{len(v):>9}{max(v):>9.4f}{sum(v) / len(v):>9.4f}")
        print("\n".join(f"WRONG: {w}" for w in wrong) or "ok: no shm utilization above 1.0, "
              "one shm capacity on every rank")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
