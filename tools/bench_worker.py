"""One rank of ``linerate bench``, started by torchrun or by ``tools.launch``.

The default group is Gloo: it carries the bookkeeping (agreeing on iteration counts, taking the
max of the times over ranks). Each compared backend gets a group of its own, and every (op, size)
runs on those groups one after the other, so they see the same machine conditions.
"""
from __future__ import annotations

import importlib
import math
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from linerate import settings
from linerate.tools import __version__
from linerate.tools.bench_ops import OPS, Collective, element_count
from linerate.tools.bench_report import Result, Row, Table, describe_hosts, link_lines, total_wrong, write_json
from linerate.tools.bench_report import interface_deltas, interface_snapshot
from linerate.tools.linkprobe import LinkProbeError, ProbeResult, format_lines, probe_ring

#: With automatic iteration counts: seconds of timed iterations per size and backend.
TARGET_S = 0.3
MIN_ITERS = 2
MAX_ITERS = 1000
EXIT_TIMEOUT = 124


class BenchError(Exception):
    """A problem with the request (no traceback is printed)."""


@dataclass
class Column:
    """One compared backend: its group, and what it cost this rank."""
    label: str
    requested: str
    actual: str
    group: object
    note: str = ""
    busy_s: float = 0.0
    stats_before: list[dict] | None = None
    moved_before: dict | None = None  # bytes per (interface, direction): interface_snapshot


@dataclass
class Sweep:
    ops: list[str]
    sizes: list[int]
    dtype: str
    warmup: int
    iters: int | None
    check: bool
    rows: list[Row] = field(default_factory=list)


def run_worker(args) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    watchdog = _start_watchdog(args.timeout, rank)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout))
        try:
            return _bench(args, rank, world, watchdog)
        finally:
            dist.destroy_process_group()
    except BenchError as e:
        print(f"linerate bench: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        traceback.print_exc()
        print(f"linerate bench: rank {rank} failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        watchdog.cancel()


def _start_watchdog(timeout: float, rank: int) -> threading.Timer:
    def expire():
        print(f"linerate bench: rank {rank} timed out after {timeout:g} s", file=sys.stderr,
              flush=True)
        os._exit(EXIT_TIMEOUT)
    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    return timer


def _bench(args, rank: int, world: int, watchdog: threading.Timer | None = None) -> int:
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    raw, raw_lines = _raw_capacity(args, world, hosts)  # before any group opens connections
    capacity = raw.capacity_gbit_s if raw else None
    columns = _make_columns(args.backends, rank, args.timeout, getattr(args, "metrics_port", None))
    labels = [c.label for c in columns]
    sweep = Sweep(args.ops, args.sizes, args.dtype, args.warmup, args.iters, args.check)
    table = Table(labels, args.check, capacity)
    if rank == 0:
        _print(*_header_lines(args, world, hosts, columns), *raw_lines, *table.header())

    for c in columns:
        c.stats_before = _connection_stats(c.group)
        c.moved_before = interface_snapshot(_backend_attr(c.group, "_ctx"))
    for name in sweep.ops:
        for i, size in enumerate(sweep.sizes):
            row = _measure_row(OPS[name], size, sweep, columns, rank, world, flip=i % 2 == 1)
            if row is not None:
                sweep.rows.append(row)
                if rank == 0:
                    _print(table.row(row))
    links = _gather_links(columns, rank)

    if rank == 0:
        _print(*table.footer(sweep.rows))
        for label in dict.fromkeys(entry["label"] for entry in links):
            _print(*link_lines(label, [e for e in links if e["label"] == label]))
        if args.json:
            write_json(args.json, _meta(args, world, hosts, columns), labels, sweep.rows, links,
                       raw.to_dict() if raw else None)
            _print(f"# results written to {args.json}")
        if args.plot:
            _plot(args, world, labels, sweep.rows, capacity)
        if getattr(args, "metrics_port", None):
            _print(*_metrics_lines(args.metrics_port))
    if getattr(args, "loop", False):
        if watchdog is not None:
            watchdog.cancel()  # runs until interrupted
        _loop(sweep, [c for c in columns if c.requested == "linerate"] or columns[:1], rank,
              world, capacity)
    dist.barrier()
    return 1 if total_wrong(sweep.rows) else 0


def _loop(sweep: Sweep, columns: list[Column], rank: int, world: int,
          capacity: float | None) -> None:
    """--loop: the sweep again and again on one backend (a live load for the metrics)."""
    table = Table([c.label for c in columns], sweep.check, capacity)
    passes = 0
    while True:
        passes += 1
        if rank == 0:
            _print(f"# --loop: pass {passes}", *table.header())
        for name in sweep.ops:
            for size in sweep.sizes:
                row = _measure_row(OPS[name], size, sweep, columns, rank, world, flip=False)
                if row is not None and rank == 0:
                    _print(table.row(row))
                if row is not None and total_wrong([row]):
                    raise BenchError(f"--loop pass {passes}: wrong results in {name} of {size} B")


def _metrics_lines(base_port: int) -> list[str]:
    """Where the metrics are, and a sample of rank 0's exposition."""
    from prometheus_client import generate_latest

    from linerate.transport import metrics
    ports = metrics.exporter_ports()
    if not ports:
        return [f"# metrics: rank 0 could not serve on port {base_port} (see the warning above)"]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    last = base_port + local - 1
    lines = [f"# metrics: every rank serves Prometheus metrics at http://{socket.gethostname()}:"
             f"{base_port}+LOCAL_RANK/metrics (here ports {base_port}..{last}); watch live with: "
             f"linerate top localhost:{base_port}-{last}",
             "# a sample of rank 0's /metrics:"]
    keep = ("linerate_info", "linerate_sent_bytes_total", "linerate_link_capacity",
            "linerate_link_utilization", "linerate_bus_bandwidth", "linerate_collective_bytes_total",
            "linerate_tcp_retransmits_total")
    text = generate_latest(metrics.REGISTRY).decode()
    lines += [f"#   {line}" for line in text.splitlines() if line.startswith(keep)]
    return lines


def _print(*lines: str) -> None:
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------- raw capacity
def _raw_capacity(args, world: int, hosts: list[str]) -> tuple[ProbeResult | None, list[str]]:
    """Run the link probe if --raw is on (by default: several hosts, or LINERATE_SOCKET_IFNAME
    set); every rank must agree, so the decision is the max over ranks."""
    auto = args.raw is None
    wanted = args.raw if not auto else (len(set(hosts)) > 1
                                        or bool(settings.read("LINERATE_SOCKET_IFNAME")))
    agreed = torch.tensor([int(wanted)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if not agreed.item() or world < 2:
        note = ("off (all ranks on one host, loopback has no line rate; --raw measures it "
                "anyway)" if auto else "off (--no-raw)")
        return None, [f"# raw link capacity: {note}" if world > 1 else
                      "# raw link capacity: none (a single rank has no links)"]
    try:
        result = probe_ring(streams=args.raw_streams, seconds=args.raw_seconds, tool=args.raw_tool,
                            simultaneous=not args.raw_sequential,
                            timeout=min(args.timeout, 60.0))
    except LinkProbeError as e:
        raise BenchError(f"--raw: {e} (--no-raw skips the link probe)") from None
    return result, format_lines(result) + [
        "# busbw(Gb/s) = busbw(GB/s) * 8; util = busbw / raw link capacity"]


def _plot(args, world: int, labels: list[str], rows: list[Row], capacity: float | None) -> None:
    from linerate.tools.bench_plot import plot_busbw
    title = (f"linerate bench: {world} ranks, {args.dtype}"
             + (f", raw link capacity {capacity:.2f} Gbit/s" if capacity else ""))
    try:
        plot_busbw(args.plot, labels, rows, capacity, title)
    except RuntimeError as e:
        raise BenchError(str(e)) from None
    _print(f"# plot written to {args.plot}")


# ---------------------------------------------------------------------------- groups
def _linerate_available() -> tuple[bool, str]:
    try:
        importlib.import_module("linerate.collectives")
    except Exception as e:  # the backend may be absent, or broken while being written
        return False, f"import linerate.collectives failed: {type(e).__name__}: {e}"
    if "linerate" not in dist.Backend.backend_list:
        return False, "import linerate did not register the 'linerate' backend"
    return True, ""


def _linerate_options(metrics_port: int | None):
    """The linerate group's settings: the LINERATE_* environment, and --metrics-port (passed to
    the backend as pg_options, not through the environment)."""
    from linerate import Options
    options = Options.from_env()
    if metrics_port:
        options.metrics.port = metrics_port
    return options


def _make_columns(names: list[str], rank: int, timeout: float,
                  metrics_port: int | None = None) -> list[Column]:
    available, reason = True, ""
    if "linerate" in names:
        available, reason = _linerate_available()
        everywhere = torch.tensor([int(available)])
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)  # every rank must pick the same
        if available and not everywhere.item():
            available, reason = False, "the 'linerate' backend is not available on every rank"
        if not available and rank == 0:
            print(f"linerate bench: warning: {reason}; measuring a second gloo group in its "
                  "place, labelled 'linerate[gloo]'", file=sys.stderr, flush=True)
    columns, seen = [], {}
    for name in names:
        actual = "gloo" if name == "linerate" and not available else name
        if actual not in dist.Backend.backend_list:
            raise BenchError(f"unknown backend {actual!r}; registered: "
                             + ", ".join(b for b in dist.Backend.backend_list if b != "undefined"))
        label = name if actual == name else f"{name}[{actual}]"
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        pg_options = _linerate_options(metrics_port) if actual == "linerate" else None
        group = dist.new_group(backend=actual, timeout=timedelta(seconds=timeout),
                               pg_options=pg_options)
        columns.append(Column(label, name, actual, group, reason if actual != name else ""))
    return columns


# ---------------------------------------------------------------------------- measuring
def _measure_row(op: Collective, size: int, sweep: Sweep, columns: list[Column], rank: int,
                 world: int, flip: bool) -> Row | None:
    """One table row; flip runs the backends in reverse order (every other size, so that
    neither one always goes first)."""
    dtype = getattr(torch, sweep.dtype)
    count = element_count(op, size, dtype.itemsize, world)
    if count == 0:
        return None
    order = range(len(columns) - 1, -1, -1) if flip else range(len(columns))
    by_column = {i: _measure(op, columns[i], count, dtype, rank, world, sweep) for i in order}
    measured = [by_column[i] for i in range(len(columns))]
    # Max over ranks of each backend's per-iteration mean, and of its wrong element count.
    summary = torch.tensor([[t, w] for t, w, _ in measured], dtype=torch.float64)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    nbytes = count * dtype.itemsize
    results = [Result.from_time(nbytes, op.bus_factor(world), seconds, iters,
                                int(wrong) if sweep.check else None)
               for (seconds, wrong), (_, _, iters) in zip(summary.tolist(), measured)]
    return Row(op.name, nbytes, count, sweep.dtype, results)


def _measure(op: Collective, col: Column, count: int, dtype: torch.dtype, rank: int, world: int,
             sweep: Sweep) -> tuple[float, int, int]:
    """(seconds per iteration, wrong elements, iterations) on this rank."""
    inp, out = op.buffers(count, dtype, rank, world)
    wrong = 0
    laps = []
    for i in range(sweep.warmup):
        t0 = time.perf_counter()
        op.run(inp, out, col.group)
        laps.append(time.perf_counter() - t0)
        if i == 0 and sweep.check:
            wrong = op.count_wrong(out, count, rank, world)
    # Ranks agree on the count (the slowest rank's estimate wins); this also lines them up.
    agreed = torch.tensor([sweep.iters or _auto_iters(laps)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    iters = int(agreed.item())
    t0 = time.perf_counter()
    for _ in range(iters):
        op.run(inp, out, col.group)
    elapsed = time.perf_counter() - t0
    col.busy_s += sum(laps) + elapsed
    return elapsed / iters, wrong, iters


def _auto_iters(laps: list[float]) -> int:
    """Iterations for ~TARGET_S, estimated from the warmup laps after the first."""
    steady = laps[1:] or laps
    per_iter = max(sum(steady) / len(steady), 1e-6)
    return max(MIN_ITERS, min(MAX_ITERS, math.ceil(TARGET_S / per_iter)))


# ---------------------------------------------------------------------------- link statistics
def _backend_attr(group, name: str):
    """An attribute of the group or of its CPU backend (None where neither has it)."""
    candidates = [group]
    try:
        candidates.append(group._get_backend(torch.device("cpu")))
    except (AttributeError, RuntimeError):
        pass
    for obj in candidates:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _connection_stats(group) -> list[dict] | None:
    """The linerate group's per-connection byte counters, if it exposes them."""
    fn = _backend_attr(group, "connection_stats")
    return [dict(s) for s in fn()] if callable(fn) else None


def _link_deltas(before: list[dict], after: list[dict]) -> list[dict]:
    """Bytes per peer (and per connection) moved between two snapshots."""
    base = {(s["peer"], s["connection"]): s for s in before}
    peers: dict[int, dict] = {}
    for s in after:
        b = base.get((s["peer"], s["connection"]), {})
        conn = {"connection": s["connection"], "local": str(s.get("local")),
                "remote": str(s.get("remote")),
                "sent_bytes": s["sent_bytes"] - b.get("sent_bytes", 0),
                "received_bytes": s["received_bytes"] - b.get("received_bytes", 0)}
        p = peers.setdefault(s["peer"], {"peer": s["peer"], "sent_bytes": 0, "received_bytes": 0,
                                         "connections": []})
        p["sent_bytes"] += conn["sent_bytes"]
        p["received_bytes"] += conn["received_bytes"]
        p["connections"].append(conn)
    return [peers[k] for k in sorted(peers)]


def _gather_links(columns: list[Column], rank: int) -> list[dict]:
    """Every rank's link deltas for the groups that expose connection_stats(), on rank 0."""
    mine = []
    for c in columns:
        after = _connection_stats(c.group)
        if c.stats_before is not None and after is not None:
            mine.append({"label": c.label, "rank": rank, "host": socket.gethostname(),
                         "busy_s": c.busy_s, "links": _link_deltas(c.stats_before, after),
                         "interfaces": interface_deltas(
                             c.moved_before, interface_snapshot(_backend_attr(c.group, "_ctx"))),
                         "shared_memory": bool(_backend_attr(c.group, "shared_memory"))})
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return [entry for per_rank in gathered for entry in per_rank] if rank == 0 else []


# ---------------------------------------------------------------------------- header, metadata
def _header_lines(args, world: int, hosts: list[str], columns: list[Column]) -> list[str]:
    backends = ", ".join(c.label + (f" ({c.note})" if c.note else "") for c in columns)
    iters = (f"{args.iters}" if args.iters else
             f"auto (~{TARGET_S:g} s per size and backend, {MIN_ITERS}..{MAX_ITERS})")
    lines = [
        f"# linerate bench {__version__}: world size {world}, hosts {describe_hosts(hosts)}, "
        f"torch {torch.__version__}",
        f"# backends: {backends}",
        f"# dtype {args.dtype}, sizes {args.sizes[0]}..{args.sizes[-1]} B (x{args.factor}), "
        f"warmup {args.warmup}, iters {iters}, check {'on' if args.check else 'off'}",
        "# time: max over ranks of the mean per iteration; busbw as in nccl-tests",
    ]
    if len(columns) == 2:
        lines.append(f"# ratio: busbw({columns[0].label}) / busbw({columns[1].label})")
    lines.append("#")
    return lines


def _meta(args, world: int, hosts: list[str], columns: list[Column]) -> dict:
    return {
        "tool": "linerate bench", "version": __version__, "torch": torch.__version__,
        "world_size": world, "hosts": hosts, "dtype": args.dtype, "ops": args.ops,
        "sizes": args.sizes, "warmup": args.warmup, "iters": args.iters or "auto",
        "check": args.check, "raw": args.raw,
        "backends": [{"label": c.label, "requested": c.requested, "actual": c.actual,
                      "note": c.note} for c in columns],
    }
