"""Prometheus metrics of linerate: one module owns them, the hot path only adds to integers.

What is counted where:
- bytes: each connection's ``sent_bytes`` / ``recv_bytes`` (plain ints that the sender and
  receiver threads add to once per chunk), and for co-located ranks the bytes the collectives
  moved through the shared segment (collectives/shm_algos.py: one add per phase), both under
  interface ``shm``. Nothing else runs on the data path.
- collectives: ``record_collective`` (called once per collective by the backend, only when
  metrics are enabled) adds to a histogram and to per-window bus-bandwidth sums.
- everything else (interfaces, capacities, TCP_INFO, queue depths) is read when Prometheus
  scrapes, by ``_Collector.collect``.

A sampler thread (started with the exporter) turns byte totals into
``linerate_link_utilization_ratio`` over a window of ``LINERATE_METRICS_WINDOW`` seconds.

Settings (``linerate.Options.metrics``, a ``MetricsOptions``, filled from these variables when
a process group is created, which passes it to ``start_from_env``; before any group, they are
read through the registry, linerate/settings.py):
  LINERATE_METRICS_PORT     serve /metrics on this port + LOCAL_RANK (unset: no exporter)
  LINERATE_METRICS_ADDR     bind address (default 0.0.0.0: every interface)
  LINERATE_METRICS_HOST     the ``host`` label (default: the hostname)
  LINERATE_METRICS_WINDOW   utilization and busbw window in seconds (default 1)
  LINERATE_LINK_CAPACITY    link rate where the driver reports none (veth, many clouds):
                            ``10gbit`` for every interface, or ``eth0=10gbit,eth1=25gbit``;
                            ``shm=...`` replaces shared memory's measured copy rate
"""
from __future__ import annotations

import bisect
import fcntl
import logging
import os
import socket
import struct
import threading
import time
import weakref

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from linerate import settings

from .link import tcp_info  # noqa: F401 - part of this module's interface
from .options import MetricsOptions, parse_env

log = logging.getLogger("linerate.metrics")

__all__ = ["REGISTRY", "start_exporter", "start_from_env", "enable", "enabled", "track",
           "retire", "record_collective", "set_info", "size_bucket", "link_capacity",
           "interface_of", "conn_interface", "tcp_info", "exporter_ports", "memcpy_rate"]

#: The registry the exporter serves (linerate's series only, no process/platform collectors).
REGISTRY = CollectorRegistry(auto_describe=False)

#: Upper bounds (seconds) of the collective duration histogram.
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: size_bucket label values: the upper bound of the message size.
_SIZE_BOUNDS = ((4 << 10, "4KiB"), (64 << 10, "64KiB"), (1 << 20, "1MiB"), (16 << 20, "16MiB"),
                (256 << 20, "256MiB"))


_lock = threading.Lock()
_enabled = False
_contexts: "weakref.WeakSet" = weakref.WeakSet()
_retired: dict[tuple, list] = {}        # (peer, interface, connection) -> [sent, received]
_retired_retrans: dict[int, int] = {}   # peer -> retransmits of closed connections
_hist: dict[tuple, list] = {}           # (op, algorithm, size_bucket) -> [counts..., sum]
_op_bytes: dict[str, int] = {}
_win_bus: dict[str, list] = {}          # op -> [bus bytes, seconds] in the current window
_busbw: dict[str, float] = {}           # op -> busbw of the last window in which it ran
_util: dict[tuple, float] = {}          # (interface, direction) -> ratio
_info: dict[str, str] = {"transport": "tcp", "nsocks": "", "algorithm": ""}
_servers: dict[int, object] = {}
_sampler: threading.Thread | None = None
_iface_cache: dict[str, str] = {}
_rank_label: str | None = None
#: The settings of the group that configured the exporter (None: read through the registry).
_config: MetricsOptions | None = None


def _version() -> str:
    from linerate import __version__
    return __version__


# ----------------------------------------------------------------------------- hot path
def enabled() -> bool:
    return _enabled


def enable() -> None:
    """Count collectives and sample utilization (the exporter calls this; tests may too)."""
    global _enabled, _sampler
    with _lock:
        _enabled = True
        if _sampler is None:
            _sampler = threading.Thread(target=_sample_loop, name="linerate-metrics", daemon=True)
            _sampler.start()


def size_bucket(nbytes: int) -> str:
    for bound, name in _SIZE_BOUNDS:
        if nbytes <= bound:
            return name
    return "inf"


def record_collective(op: str, algorithm: str, nbytes: int, seconds: float, bus_factor: float) -> None:
    """One finished collective: ``nbytes`` is nccl-tests' size (per rank), ``bus_factor`` turns
    algorithm bandwidth into bus bandwidth."""
    if not _enabled:
        return
    key = (op, algorithm, size_bucket(nbytes))
    i = bisect.bisect_left(SECONDS_BUCKETS, seconds)
    with _lock:
        h = _hist.get(key)
        if h is None:
            h = _hist[key] = [0] * (len(SECONDS_BUCKETS) + 2)
        h[i] += 1
        h[-1] += seconds
        _op_bytes[op] = _op_bytes.get(op, 0) + nbytes
        if nbytes and bus_factor:
            w = _win_bus.get(op)
            if w is None:
                w = _win_bus[op] = [0.0, 0.0]
            w[0] += nbytes * bus_factor
            w[1] += seconds


# ----------------------------------------------------------------------------- contexts
def track(ctx) -> None:
    """Export the byte counters of a transport Context (it calls this itself)."""
    with _lock:
        _contexts.add(ctx)


def retire(ctx) -> None:
    """Fold a closing Context's totals into the process's, so counters never go back."""
    with _lock:
        if ctx not in _contexts:
            return
        _contexts.discard(ctx)
    snap = ctx.stats()
    with _lock:
        for peer, key, sent, received in _conn_counts(snap):
            acc = _retired.setdefault(key, [0, 0])
            acc[0] += sent
            acc[1] += received
        for p in snap["peers"]:
            for link in p["links"]:
                if link["retransmits"]:
                    peer = p["global_peer"]
                    _retired_retrans[peer] = _retired_retrans.get(peer, 0) + link["retransmits"]



def set_info(**labels: str) -> None:
    with _lock:
        _info.update({k: str(v) for k, v in labels.items()})


def _conn_counts(snap: dict):
    """(global peer rank, (peer, interface, connection), sent bytes, received bytes) for each
    connection of a Context's stats() snapshot."""
    for p in snap["peers"]:
        peer = p["global_peer"]
        for link in p["links"]:
            for c in link["connections"]:
                yield (peer, (peer, conn_interface(c), str(c["index"])), c["sent_bytes"],
                       c["received_bytes"])


def _byte_totals() -> dict[tuple, list]:
    """(peer, interface, connection) -> [sent, received], closed contexts included."""
    with _lock:
        out = {k: list(v) for k, v in _retired.items()}
        live = list(_contexts)
    for ctx in live:
        for peer, key, sent, received in _conn_counts(ctx.stats()):
            acc = out.setdefault(key, [0, 0])
            acc[0] += sent
            acc[1] += received
    return out


# ----------------------------------------------------------------------------- the host
def interface_of(address: str) -> str:
    """The name of the local interface that holds ``address`` ("unknown" if none does)."""
    name = _iface_cache.get(address)
    if name is None:
        _iface_cache.update(_address_map())
        name = _iface_cache.setdefault(address, "unknown")
    return name


def conn_interface(conn: dict) -> str:
    """A connection's ``interface`` label (``conn``: one of a link's stats "connections"):
    the interface of its local address, for an RDMA stream its device:port (``mlx5_0:1``),
    for a shared-memory link ``shm``."""
    return conn["device"] or interface_of(conn["local"])


def _address_map() -> dict[str, str]:
    out: dict[str, str] = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                out[socket.inet_ntoa(packed[20:24])] = name
            except OSError:
                pass
    finally:
        s.close()
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    h = parts[0]
                    addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(h))
                    out[addr] = parts[5]
    except OSError:
        pass
    return out


def _capacity_env() -> dict[str, float]:
    """LINERATE_LINK_CAPACITY (the configuring group's, else the environment's) as bytes per
    second by interface; a bad value raises a ValueError naming the variable."""
    if _config is not None:
        return _config.capacities
    return settings.parse_capacity(settings.read("LINERATE_LINK_CAPACITY"))


def link_capacity(ifname: str) -> float | None:
    """Bytes per second of an interface: LINERATE_LINK_CAPACITY, else the driver's speed (for
    an RDMA port ``dev:port``, the rate in /sys/class/infiniband). ``shm`` (co-located ranks:
    their shared segment and links) is the host's memory copy rate (``memcpy_rate``) unless
    LINERATE_LINK_CAPACITY names it (``shm=...``; a rate for every interface is not one for
    memory)."""
    env = _capacity_env()
    if ifname in env:
        return env[ifname]
    if ifname == "shm":
        return memcpy_rate()
    if "*" in env:
        return env["*"]
    if ":" in ifname:
        return _rdma_rate(ifname)
    try:
        with open(f"/sys/class/net/{ifname}/speed") as f:
            mbit = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1e6 / 8.0 if mbit > 0 else None


def _rdma_rate(port: str) -> float | None:
    dev, _, num = port.rpartition(":")
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{num}/rate") as f:
            gbit = float(f.read().split()[0])   # "100 Gb/sec (4X EDR)"
    except (OSError, ValueError, IndexError):
        return None
    return gbit * 1e9 / 8.0 if gbit > 0 else None


#: The memory copy probe (``memcpy_rate``): bytes per copy (larger than a last-level cache, so
#: the copies stream from memory as the collectives' do), and copies (the best one counts).
MEMCPY_PROBE_BYTES = 64 << 20
MEMCPY_PROBE_COPIES = 4
_memcpy_rate: float | None = None
_memcpy_lock = threading.Lock()


def memcpy_rate() -> float:
    """This host's memory copy bandwidth, bytes per second: the best of MEMCPY_PROBE_COPIES
    copies of MEMCPY_PROBE_BYTES by one thread with glibc's memmove (the copy the shared
    segment's collectives make), measured once per process, at the first use (about 0.1 s).
    The capacity of interface ``shm``: the bytes a rank sends through shared memory per second
    are the bytes it copies for its peers, so its utilization means what a NIC's does."""
    global _memcpy_rate
    with _memcpy_lock:
        if _memcpy_rate is None:
            import ctypes
            n = MEMCPY_PROBE_BYTES
            src, dst = bytearray(n), bytearray(n)
            a = ctypes.addressof((ctypes.c_char * n).from_buffer(src))
            b = ctypes.addressof((ctypes.c_char * n).from_buffer(dst))
            ctypes.memset(a, 1, n)  # both buffers' pages faulted in before the timing
            ctypes.memset(b, 0, n)
            best = float("inf")
            for _ in range(MEMCPY_PROBE_COPIES):
                t0 = time.perf_counter()
                ctypes.memmove(b, a, n)
                best = min(best, time.perf_counter() - t0)
            _memcpy_rate = n / max(best, 1e-9)
        return _memcpy_rate


def _capacity_or_none(ifname: str) -> float | None:
    """link_capacity for the scrape path: a setting changed to something bad is logged once
    and the capacity left out, so that the other series still export."""
    try:
        return link_capacity(ifname)
    except ValueError as e:
        if str(e) not in _warned:
            _warned.add(str(e))
            log.warning("linerate metrics: %s", e)
        return None


_warned: set[str] = set()


def _host() -> str:
    host = _config.host if _config is not None else settings.read("LINERATE_METRICS_HOST")
    return host or socket.gethostname()


def _rank() -> str:
    if _rank_label is not None:
        return _rank_label
    with _lock:
        live = list(_contexts)
    for ctx in live:
        return str(ctx.stats()["global_rank"])
    return os.environ.get("RANK", "0")


# ----------------------------------------------------------------------------- sampling
def _env(var: str, default, parse):
    """An environment setting; a bad value raises a ValueError that names the variable."""
    if not os.environ.get(var, "").strip():
        return default
    return parse_env(os.environ, var, parse)


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v < 65536:
        raise ValueError("expected a TCP port (0-65535)")
    return v


def _window() -> float:
    if _config is not None:
        return _config.window
    return settings.read("LINERATE_METRICS_WINDOW")


def _iface_totals() -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for (peer, ifname, _), (sent, received) in _byte_totals().items():
        out[(ifname, "tx")] = out.get((ifname, "tx"), 0) + sent
        out[(ifname, "rx")] = out.get((ifname, "rx"), 0) + received
    return out


def sample(prev: tuple | None) -> tuple:
    """One sampler step: update utilization and busbw from ``prev`` = (time, totals)."""
    now = time.monotonic()
    totals = _iface_totals()
    with _lock:
        for op, (bus_bytes, seconds) in _win_bus.items():
            if seconds > 0:
                _busbw[op] = bus_bytes / seconds
        _win_bus.clear()
    if prev is not None:
        t0, before = prev
        dt = now - t0
        util = {}
        for key, n in totals.items():
            cap = _capacity_or_none(key[0])
            if cap and dt > 0:
                util[key] = max(0, n - before.get(key, 0)) / dt / cap
        with _lock:
            _util.clear()
            _util.update(util)
    return now, totals


def _sample_loop() -> None:
    prev = None
    while True:
        try:
            prev = sample(prev) if _enabled else None
            time.sleep(_window())
        except Exception:  # noqa: BLE001 - metrics must never take the job down
            log.exception("linerate metrics sampler")
            time.sleep(5.0)


# ----------------------------------------------------------------------------- export
class _Collector:
    def collect(self):
        base = ["rank", "host"]
        ids = [_rank(), _host()]
        with _lock:
            info = dict(_info)
        fam = GaugeMetricFamily("linerate_info", "linerate version and configuration",
                                labels=base + ["version", "transport", "nsocks", "algorithm"])
        fam.add_metric(ids + [_version(), info["transport"], info["nsocks"], info["algorithm"]], 1)
        yield fam

        totals = _byte_totals()
        sent = CounterMetricFamily("linerate_sent_bytes", "Payload bytes sent, per connection",
                                   labels=base + ["peer", "interface", "connection"])
        recv = CounterMetricFamily("linerate_received_bytes", "Payload bytes received, per connection",
                                   labels=base + ["peer", "interface", "connection"])
        ifaces = set()
        for (peer, ifname, conn), (s, r) in sorted(totals.items()):
            sent.add_metric(ids + [str(peer), ifname, conn], s)
            recv.add_metric(ids + [str(peer), ifname, conn], r)
            ifaces.add(ifname)
        yield sent
        yield recv

        cap = GaugeMetricFamily("linerate_link_capacity_bytes_per_second",
                                "Link rate (driver speed or LINERATE_LINK_CAPACITY)",
                                labels=base + ["interface"])
        for ifname in sorted(ifaces):
            c = _capacity_or_none(ifname)
            if c:
                cap.add_metric(ids + [ifname], c)
        yield cap
        util = GaugeMetricFamily("linerate_link_utilization_ratio",
                                 "linerate's bytes over the last window / link capacity",
                                 labels=base + ["interface", "direction"])
        with _lock:
            util_now = dict(_util)
            hist = {k: list(v) for k, v in _hist.items()}
            op_bytes = dict(_op_bytes)
            busbw = dict(_busbw)
            for op, (bus_bytes, seconds) in _win_bus.items():  # ran only in the open window
                if op not in busbw and seconds > 0:
                    busbw[op] = bus_bytes / seconds
            retrans = dict(_retired_retrans)
            live = list(_contexts)
        for (ifname, direction), v in sorted(util_now.items()):
            util.add_metric(ids + [ifname, direction], v)
        yield util

        h = HistogramMetricFamily("linerate_collective_seconds", "Duration of collectives",
                                  labels=base + ["op", "algorithm", "size_bucket"])
        for (op, algo, sb), counts in sorted(hist.items()):
            cum, buckets = 0, []
            for bound, n in zip(SECONDS_BUCKETS, counts):
                cum += n
                buckets.append((_fmt(bound), cum))
            cum += counts[len(SECONDS_BUCKETS)]
            buckets.append(("+Inf", cum))
            h.add_metric(ids + [op, algo, sb], buckets, counts[-1])
        yield h
        b = CounterMetricFamily("linerate_collective_bytes", "Message bytes of collectives (per rank)",
                                labels=base + ["op"])
        for op, n in sorted(op_bytes.items()):
            b.add_metric(ids + [op], n)
        yield b
        bw = GaugeMetricFamily("linerate_bus_bandwidth_bytes_per_second",
                               "Bus bandwidth (nccl-tests) over the last window in which the op ran",
                               labels=base + ["op"])
        for op, v in sorted(busbw.items()):
            bw.add_metric(ids + [op], v)
        yield bw

        queued: dict[int, int] = {}
        for ctx in live:
            for p in ctx.stats()["peers"]:
                peer = p["global_peer"]
                n = 0
                for link in p["links"]:
                    n += link["queued_bytes"]
                    if link["retransmits"] is not None:
                        retrans[peer] = retrans.get(peer, 0) + link["retransmits"]
                queued[peer] = queued.get(peer, 0) + n
        r = CounterMetricFamily("linerate_tcp_retransmits", "TCP segments retransmitted (TCP_INFO)",
                                labels=base + ["peer"])
        for peer, n in sorted(retrans.items()):
            r.add_metric(ids + [str(peer)], n)
        yield r
        q = GaugeMetricFamily("linerate_send_queue_bytes",
                              "Bytes waiting to be sent to a peer (linerate's queue and the kernel's)",
                              labels=base + ["peer"])
        for peer, n in sorted(queued.items()):
            q.add_metric(ids + [str(peer)], n)
        yield q


def _fmt(bound: float) -> str:
    return repr(float(bound))


REGISTRY.register(_Collector())


def start_exporter(port: int, addr: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``addr:port`` (idempotent per port; 0: any free port); returns
    the bound port. A bad
    LINERATE_LINK_CAPACITY or LINERATE_METRICS_WINDOW raises here, before anything runs."""
    _capacity_env()
    _window()
    enable()
    with _lock:
        if port in _servers:
            return port
    server, _ = start_http_server(port, addr=addr, registry=REGISTRY)
    port = server.server_port  # the one bound, also when port 0 asked for any free one
    with _lock:
        _servers[port] = server
    log.info("linerate metrics at http://%s:%d/metrics", addr, port)
    return port


def exporter_ports() -> list[int]:
    with _lock:
        return sorted(_servers)


def start_from_env(rank_label: str | None = None,
                   options: MetricsOptions | None = None) -> int | None:
    """Start the exporter if ``options.port`` (a group's ``Options.metrics``; without options:
    LINERATE_METRICS_PORT, read through the registry) is set (port + LOCAL_RANK). The options
    of the group that starts the exporter configure it for the process. A port that is taken
    is logged, not raised: metrics never stop a training job."""
    global _rank_label, _config
    explicit = options is not None
    if options is None:
        options = MetricsOptions.from_env()
    else:
        options.validate()
    if rank_label is not None and _rank_label is None:
        _rank_label = rank_label
    base = options.port
    if not base:
        return None
    local = _env("LOCAL_RANK", 0, _port)
    port = base + local
    if port > 65535:
        raise ValueError(f"LINERATE_METRICS_PORT={base} + LOCAL_RANK={local} is past port 65535")
    addr = options.addr
    configured = False
    with _lock:
        if explicit and not _servers:  # the group that starts the exporter configures it
            _config, configured = options, True
    try:
        return start_exporter(port, addr)
    except (OSError, ValueError) as e:
        if configured:
            with _lock:
                _config = None
        if isinstance(e, ValueError):
            raise
        log.warning("linerate: cannot serve metrics on %s:%d (LINERATE_METRICS_PORT=%d + "
                    "LOCAL_RANK=%d): %s", addr, port, base, local, e)
        return None
