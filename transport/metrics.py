"""Prometheus metrics of linerate: the exporter, its registry and the link series; the hot
path only adds to integers.

What is counted where:
- bytes: each connection's ``sent_bytes`` / ``recv_bytes`` (plain ints that its driver, a
  sender and a receiver thread or an epoll loop, adds to once per frame), and for co-located ranks the bytes moved through
  the shared segment (its users add once per phase; ``Context.stats()`` counts them in the
  peer's ``shm`` link), both under interface ``shm``. Nothing else runs on the data path.
- per interface and direction (``linerate_interface_bytes_total``, the bytes of the
  utilization): a NIC's are its connections' bytes; ``shm``'s are the bytes the rank wrote
  into shared memory for its peers, once however many peers read them (the segment's
  ``copied()``, set by transport/shm/engine.py, plus the shared-memory links' own bytes), and
  the bytes it read of its peers'. A broadcast's root sends its tensor to every peer
  (``linerate_sent_bytes_total``, per peer) but writes it once.
- everything else of the links (interfaces, capacities, TCP_INFO, queue depths) is read when
  Prometheus scrapes, from the Contexts' ``stats()`` snapshots, by ``_Collector.collect``.

The layers above add their own series: they register a collector on ``REGISTRY``, label it
with ``identity()`` (the ``rank`` and ``host`` label values of every series), record only
while ``enabled()``, and keep per-window state rolled by ``on_window(callback)``.

A sampler thread (started with the exporter) turns byte totals into
``linerate_link_utilization_ratio`` over a window of ``LINERATE_METRICS_WINDOW`` seconds, and
calls the ``on_window`` callbacks once per window.

Settings (``linerate.Options.metrics``, a ``MetricsOptions``, filled from these variables when
a process group is created, which passes it to ``start_from_env``; before any group, they are
read through the registry, linerate/settings.py):
  LINERATE_METRICS_PORT     serve /metrics on this port + LOCAL_RANK (unset: no exporter)
  LINERATE_METRICS_ADDR     bind address (default 0.0.0.0: every interface)
  LINERATE_METRICS_HOST     the ``host`` label (default: the hostname)
  LINERATE_METRICS_WINDOW   the sampler's window in seconds (default 1)
  LINERATE_LINK_CAPACITY    link rate where the driver reports none (veth, many clouds):
                            ``10gbit`` for every interface, or ``eth0=10gbit,eth1=25gbit``;
                            ``shm=...`` replaces shared memory's measured copy rate (one
                            figure per host: the segment's creator measures it, ``memcpy_rate``,
                            and publishes it in the segment)
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from linerate import settings

from .link import tcp_info  # noqa: F401 - part of this module's interface
from .options import MetricsOptions, parse_env

log = logging.getLogger("linerate.metrics")

__all__ = ["REGISTRY", "start_exporter", "start_from_env", "enable", "enabled", "on_window",
           "identity", "track", "retire", "set_info", "link_capacity", "capacity_source",
           "interface_of", "conn_interface", "tcp_info", "exporter_ports", "memcpy_rate",
           "interface_bytes", "interface_totals"]

#: The registry the exporter serves (linerate's series only, no process/platform collectors).
REGISTRY = CollectorRegistry(auto_describe=False)

_lock = threading.Lock()
_enabled = False
_contexts: "weakref.WeakSet" = weakref.WeakSet()
_retired: dict[tuple, list] = {}        # (peer, interface, connection) -> [sent, received]
_retired_retrans: dict[int, int] = {}   # peer -> retransmits of closed connections
_retired_iface: dict[tuple, int] = {}   # (interface, direction) -> bytes of closed contexts
#: The capacity of ``shm``: the copy rate published in the first segment of this process
#: (every rank of a host reads its creator's figure), None until a tracked Context had one.
_shm_rate: float | None = None
_util: dict[tuple, float] = {}          # (interface, direction) -> ratio
_info: dict[str, str] = {"transport": "tcp", "nsocks": "", "algorithm": ""}
_servers: dict[int, object] = {}
_sampler: threading.Thread | None = None
_window_hooks: list[Callable[[], None]] = []  # on_window callbacks, in registration order
_iface_cache: dict[str, str] = {}
_rank_label: str | None = None
#: The settings of the group that configured the exporter (None: read through the registry).
_config: MetricsOptions | None = None


def _version() -> str:
    from linerate import __version__
    return __version__


# ----------------------------------------------------------------------------- hot path
def enabled() -> bool:
    """Whether metrics are on (the exporter started, or ``enable()`` called): a series'
    recording function returns at once while this is False."""
    return _enabled


def enable() -> None:
    """Turn recording on and start the sampler thread (the exporter calls this; tests may
    too)."""
    global _enabled, _sampler
    with _lock:
        _enabled = True
        if _sampler is None:
            _sampler = threading.Thread(target=_sample_loop, name="linerate-metrics", daemon=True)
            _sampler.start()


def on_window(callback: Callable[[], None]) -> None:
    """Have ``callback()`` (no arguments) called once per window of LINERATE_METRICS_WINDOW
    seconds by the sampler thread, while metrics are enabled (and by each ``sample`` call): a
    collector rolls its per-window sums over in it. A callback registered twice runs once; one
    that raises is logged and the others still run."""
    with _lock:
        if callback not in _window_hooks:
            _window_hooks.append(callback)


# ----------------------------------------------------------------------------- contexts
def track(ctx) -> None:
    """Export the byte counters of a transport Context (it calls this itself, once its links
    and shared segment are set up). The first Context with a shared segment gives the process
    its ``shm`` capacity: the copy rate the segment's creator measured and published there."""
    global _shm_rate
    rate = getattr(getattr(ctx, "shm", None), "copy_rate", None)
    with _lock:
        _contexts.add(ctx)
        if _shm_rate is None and rate:
            _shm_rate = float(rate)


def retire(ctx) -> None:
    """Fold a closing Context's totals into the process's, so counters never go back."""
    with _lock:
        if ctx not in _contexts:
            return
        _contexts.discard(ctx)
    snap = ctx.stats()
    ifaces = _interface_counts(ctx, snap)
    with _lock:
        for peer, key, sent, received in _conn_counts(snap):
            acc = _retired.setdefault(key, [0, 0])
            acc[0] += sent
            acc[1] += received
        for key, n in ifaces.items():
            _retired_iface[key] = _retired_iface.get(key, 0) + n
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


def _interface_counts(ctx, snap: dict | None = None) -> dict[tuple, int]:
    """(interface, direction) -> bytes of one Context (``snap``: its stats(), if at hand).

    A NIC's bytes are its connections'. For ``shm`` a rank's ``tx`` counts each byte it wrote
    into shared memory for its peers once, however many of them read it (a broadcast's root
    writes its tensor once for all), and ``rx`` the bytes it read of theirs: the shared-memory
    links' own bytes (a ring has one reader: the same as per peer) plus the segment's
    ``copied()`` (transport/shm/engine.py Engine.copied), where the per-peer counts of the
    ``shm`` connections hold the segment's bytes once per reader."""
    snap = ctx.stats() if snap is None else snap
    out: dict[tuple, int] = {}

    def add(key: tuple, n: int) -> None:
        out[key] = out.get(key, 0) + n

    for p in snap["peers"]:
        for link in p["links"]:
            for i, c in enumerate(link["connections"]):
                ifname = conn_interface(c)
                sent, received = c["sent_bytes"], c["received_bytes"]
                if i == 0:  # the segment's bytes, as Context.stats adds them (per peer)
                    sent -= link.get("segment_bytes_sent", 0)
                    received -= link.get("segment_bytes_received", 0)
                add((ifname, "tx"), sent)
                add((ifname, "rx"), received)
    copied = getattr(getattr(ctx, "shm", None), "copied", None)
    if copied is not None:
        wrote, read = copied()
        add(("shm", "tx"), wrote)
        add(("shm", "rx"), read)
    return out


def interface_bytes(ctx) -> dict[tuple, int]:
    """(interface, direction) -> the bytes one transport Context moved (``tx``, ``rx``): what
    its utilization counts (``linerate_interface_bytes_total``; for ``shm``: written once for
    every reader, and read)."""
    return _interface_counts(ctx)


def _totals() -> tuple[dict[tuple, list], dict[tuple, int]]:
    """Closed contexts included: (peer, interface, connection) -> [sent, received], and
    (interface, direction) -> bytes (one stats() snapshot of each live Context for both)."""
    with _lock:
        conns = {k: list(v) for k, v in _retired.items()}
        ifaces = dict(_retired_iface)
        live = list(_contexts)
    for ctx in live:
        snap = ctx.stats()
        for peer, key, sent, received in _conn_counts(snap):
            acc = conns.setdefault(key, [0, 0])
            acc[0] += sent
            acc[1] += received
        for key, n in _interface_counts(ctx, snap).items():
            ifaces[key] = ifaces.get(key, 0) + n
    return conns, ifaces


def _byte_totals() -> dict[tuple, list]:
    """(peer, interface, connection) -> [sent, received], closed contexts included."""
    return _totals()[0]


def interface_totals() -> dict[tuple, int]:
    """(interface, direction) -> bytes this process moved (closed contexts included): the
    counters of ``linerate_interface_bytes_total`` and of the utilization."""
    return _totals()[1]


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
    their shared segment and links) is the most one rank copies per second, one figure per
    host (``shm_rate``), unless LINERATE_LINK_CAPACITY names it (``shm=...``; a rate for every
    interface is not one for memory)."""
    return _capacity_and_source(ifname)[0]


def capacity_source(ifname: str) -> str | None:
    """Where ``link_capacity(ifname)`` comes from: "setting" (LINERATE_LINK_CAPACITY),
    "measured" (``shm``: the copy rate measured on the host) or "driver" (the interface's
    speed, an RDMA port's rate); None where the capacity is unknown."""
    return _capacity_and_source(ifname)[1]


def _capacity_and_source(ifname: str) -> tuple[float | None, str | None]:
    env = _capacity_env()
    if ifname in env:
        return env[ifname], "setting"
    if ifname == "shm":
        return shm_rate(), "measured"
    if "*" in env:
        return env["*"], "setting"
    if ":" in ifname:
        rate = _rdma_rate(ifname)
        return rate, "driver" if rate else None
    try:
        with open(f"/sys/class/net/{ifname}/speed") as f:
            mbit = int(f.read().strip())
    except (OSError, ValueError):
        return None, None
    return (mbit * 1e6 / 8.0, "driver") if mbit > 0 else (None, None)


def shm_rate() -> float:
    """The measured capacity of ``shm``, bytes per second: the copy rate that the creator of
    this process's first shared segment measured (``memcpy_rate``) when it set the segment up,
    before any traffic, and published in it; every rank of the host reads the same figure.
    A process that never tracked a segment measures it itself."""
    global _shm_rate
    if _shm_rate is None:
        with _lock:
            live = list(_contexts)
        for ctx in live:
            rate = getattr(getattr(ctx, "shm", None), "copy_rate", None)
            if rate:
                with _lock:
                    if _shm_rate is None:
                        _shm_rate = float(rate)
                break
    return _shm_rate if _shm_rate is not None else memcpy_rate()


def _rdma_rate(port: str) -> float | None:
    dev, _, num = port.rpartition(":")
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{num}/rate") as f:
            gbit = float(f.read().split()[0])   # "100 Gb/sec (4X EDR)"
    except (OSError, ValueError, IndexError):
        return None
    return gbit * 1e9 / 8.0 if gbit > 0 else None


#: The copy probe (``memcpy_rate``): the sizes copied (the sizes of the shared-memory
#: collectives' copies, which run from a cache that holds them: their fastest) and the copies
#: of each size (the best one counts), after a warm-up of WARM copies of the largest.
MEMCPY_PROBE_SIZES = (64 << 10, 256 << 10, 1 << 20)
MEMCPY_PROBE_COPIES = 16
MEMCPY_PROBE_WARM = 4
_memcpy_rate: float | None = None
_memcpy_lock = threading.Lock()


def memcpy_rate() -> float:
    """The most bytes one thread of this host copies per second with glibc's memmove (the copy
    the shared-memory collectives and links make): the best of MEMCPY_PROBE_COPIES copies of
    each of MEMCPY_PROBE_SIZES between two buffers, after a warm-up; measured once per process
    (about 3 ms). The segment's creator measures it while setting the segment up
    (transport/shm), before any traffic, and publishes it there: the capacity of ``shm``.
    A rank's copies run one after the other on its thread, at best from a cache as these do,
    so its utilization of ``shm`` stays at or under 1; copies of tensors too large for the
    cache run slower than this."""
    global _memcpy_rate
    with _memcpy_lock:
        if _memcpy_rate is None:
            import ctypes
            n = max(MEMCPY_PROBE_SIZES)
            src, dst = bytearray(n), bytearray(n)
            a = ctypes.addressof((ctypes.c_char * n).from_buffer(src))
            b = ctypes.addressof((ctypes.c_char * n).from_buffer(dst))
            ctypes.memset(a, 1, n)  # both buffers' pages faulted in before the timing
            ctypes.memset(b, 0, n)
            move, clock = ctypes.memmove, time.perf_counter
            for _ in range(MEMCPY_PROBE_WARM):
                move(b, a, n)
            rate = 0.0
            for size in MEMCPY_PROBE_SIZES:
                best = float("inf")
                for _ in range(MEMCPY_PROBE_COPIES):
                    t0 = clock()
                    move(b, a, size)
                    best = min(best, clock() - t0)
                rate = max(rate, size / max(best, 1e-9))
            _memcpy_rate = rate
        return _memcpy_rate


def _capacity_or_none(ifname: str) -> float | None:
    """link_capacity for the scrape path: a setting changed to something bad is logged once
    and the capacity left out, so that the other series still export."""
    return _capacity_and_source_or_none(ifname)[0]


def _capacity_and_source_or_none(ifname: str) -> tuple[float | None, str | None]:
    try:
        return _capacity_and_source(ifname)
    except ValueError as e:
        if str(e) not in _warned:
            _warned.add(str(e))
            log.warning("linerate metrics: %s", e)
        return None, None


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


def identity() -> tuple[str, str]:
    """The ``rank`` and ``host`` label values every series of this process carries: the rank
    of the group that started the exporter (else of a tracked Context, else ``RANK``, else
    "0"), and LINERATE_METRICS_HOST (else the hostname). Collectors of other layers label
    their series with them."""
    return _rank(), _host()


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


def sample(prev: tuple | None) -> tuple:
    """One sampler step: update utilization from ``prev`` = (time, totals) and call the
    ``on_window`` callbacks."""
    now = time.monotonic()
    totals = interface_totals()
    with _lock:
        hooks = list(_window_hooks)
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - one collector's failure leaves the others theirs
            log.exception("linerate metrics: window callback %r", hook)
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
        ids = list(identity())
        with _lock:
            info = dict(_info)
        fam = GaugeMetricFamily("linerate_info", "linerate version and configuration",
                                labels=base + ["version", "transport", "nsocks", "algorithm"])
        fam.add_metric(ids + [_version(), info["transport"], info["nsocks"], info["algorithm"]], 1)
        yield fam

        totals, ifbytes = _totals()
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
        moved = CounterMetricFamily(
            "linerate_interface_bytes",
            "Bytes moved per interface, those of the utilization (shm: written once for all "
            "readers, and read)", labels=base + ["interface", "direction"])
        for (ifname, direction), n in sorted(ifbytes.items()):
            moved.add_metric(ids + [ifname, direction], n)
            ifaces.add(ifname)
        yield moved

        cap = GaugeMetricFamily("linerate_link_capacity_bytes_per_second",
                                "Link rate (driver speed, LINERATE_LINK_CAPACITY, or for shm "
                                "the host's measured copy rate)",
                                labels=base + ["interface", "source"])
        for ifname in sorted(ifaces):
            c, source = _capacity_and_source_or_none(ifname)
            if c:
                cap.add_metric(ids + [ifname, source], c)
        yield cap
        util = GaugeMetricFamily("linerate_link_utilization_ratio",
                                 "linerate_interface_bytes_total over the last window / link "
                                 "capacity", labels=base + ["interface", "direction"])
        with _lock:
            util_now = dict(_util)
            retrans = dict(_retired_retrans)
            live = list(_contexts)
        for (ifname, direction), v in sorted(util_now.items()):
            util.add_metric(ids + [ifname, direction], v)
        yield util

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
