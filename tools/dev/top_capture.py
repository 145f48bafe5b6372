"""One frame of ``linerate top`` over a live benchmark, for docs/performance.md.

    LINERATE_SHM=0 LINERATE_LINK_CAPACITY=10gbit python -m linerate.tools.dev.top_capture --nproc 2

Starts ``linerate bench --nproc N --backends linerate --ops all_reduce --loop`` with its
exporter on (``--metrics-port``: N free consecutive ports), waits for its first pass, prints
one frame of ``linerate top --once`` of those ports, then stops the benchmark. The
environment goes to the benchmark's ranks: on one host ``LINERATE_SHM=0`` puts the traffic on
loopback TCP and ``LINERATE_LINK_CAPACITY`` gives loopback a capacity to compute utilization
against (without them the traffic is shared memory, interface ``shm``).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_ports(n: int, tries: int = 50) -> int:
    """The first of ``n`` consecutive TCP ports that are free on localhost now."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        held = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linerate.tools.dev.top_capture",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks of the benchmark (default 2)")
    p.add_argument("--min-bytes", default="64K")
    p.add_argument("--max-bytes", default="1M")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between top's two scrapes (default 1)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the benchmark's first pass (default 120)")
    args = p.parse_args(argv)
    port = free_ports(args.nproc)
    cli = [sys.executable, "-m", "linerate.tools.cli"]
    with tempfile.TemporaryFile("w+") as log:
        bench = subprocess.Popen(
            cli + ["bench", "--nproc", str(args.nproc), "--backends", "linerate", "--ops",
                   "all_reduce", "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes,
                   "--iters", "20", "--metrics-port", str(port), "--loop"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + args.timeout
            while True:
                log.seek(0)
                text = log.read()
                if "--loop: pass" in text:
                    break
                if bench.poll() is not None or time.monotonic() > deadline:
                    print(f"top_capture: the benchmark did not start looping:\n{text[-3000:]}",
                          file=sys.stderr)
                    return 1
                time.sleep(0.5)
            top = subprocess.run(cli + ["top", f"localhost:{port}-{port + args.nproc - 1}",
                                        "--once", "--interval", str(args.interval)],
                                 capture_output=True, text=True, timeout=60)
            sys.stdout.write(top.stdout)
            if top.returncode != 0:
                print(top.stderr[-3000:], file=sys.stderr)
            return top.returncode
        finally:
            try:
                os.killpg(bench.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                bench.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(bench.pid, signal.SIGKILL)
                bench.wait()


if __name__ == "__main__":
    sys.exit(main())
