"""Raw host-to-host TCP capacity between the ranks of a running torch.distributed job.

Ring pattern, as the ring all-reduce uses it: rank r sends to rank r+1 (mod world). Each link
is measured with ``streams`` parallel TCP connections for ``seconds`` on each rail (one rail per
interface in LINERATE_SOCKET_IFNAME, else the address that routes to MASTER_ADDR, exactly as
``transport.interfaces.listen_addresses`` picks it); rails are measured one after the other
and a link's rate is the sum over its rails. The ring's raw capacity is the slowest link.

The bytes are moved either by ``iperf3`` (when it is installed on every rank; the receiver's
bits_per_second from its JSON report) or by plain sockets: the sender streams a preallocated
buffer with ``sendall``, the receiver counts with ``recv_into``, and the rate is the bytes over
the time between the first and the last byte seen by the receiver.

Coordination goes through the torch Store only (JSON strings, never pickles): addresses,
ports, a random token the sender must present (so a stray connection is never counted), the
results, and barriers between phases.
"""
from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from linerate import settings
from linerate.transport.interfaces import listen_addresses
from linerate.transport.ports import PortRangeExhausted, listen_on

DEFAULT_STREAMS = 4
DEFAULT_SECONDS = 2.0
#: Extra seconds, on top of the measuring time, that any phase of a probe may take.
DEFAULT_GRACE_S = 30.0
TOOLS = ("auto", "socket", "iperf3")

_BUF_BYTES = 1 << 20
_TOKEN_BYTES = 16
_PREFIX = "linerate/linkprobe"
_IPERF_CONNECT_TRIES = 20


class LinkProbeError(RuntimeError):
    """A link could not be measured; the message names the ranks."""


@dataclass
class RailRate:
    rail: int
    src_addr: str
    dst_addr: str
    nbytes: int
    seconds: float

    @property
    def gbit_s(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class LinkRate:
    """One directed ring link, src -> dst, summed over its rails."""
    src: int
    dst: int
    src_host: str
    dst_host: str
    rails: list[RailRate] = field(default_factory=list)

    @property
    def gbit_s(self) -> float:
        return sum(r.gbit_s for r in self.rails)

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "src_host": self.src_host,
                "dst_host": self.dst_host, "gbit_s": self.gbit_s,
                "rails": [asdict(r) | {"gbit_s": r.gbit_s} for r in self.rails]}


@dataclass
class ProbeResult:
    links: list[LinkRate]
    streams: int
    seconds: float
    tool: str
    simultaneous: bool

    @property
    def capacity_gbit_s(self) -> float | None:
        """The ring's raw capacity: the slowest link (None for a single rank)."""
        return min(link.gbit_s for link in self.links) if self.links else None

    def describe(self) -> str:
        how = "all links at once" if self.simultaneous else "one link at a time"
        return f"{self.streams} streams, {self.tool}, {self.seconds:g} s, {how}"

    def to_dict(self) -> dict:
        return {"capacity_gbit_s": self.capacity_gbit_s, "streams": self.streams,
                "seconds": self.seconds, "tool": self.tool, "simultaneous": self.simultaneous,
                "links": [link.to_dict() for link in self.links]}


# ---------------------------------------------------------------------------- entry point
def probe_ring(store=None, rank: int | None = None, world_size: int | None = None, *,
               streams: int = DEFAULT_STREAMS, seconds: float = DEFAULT_SECONDS,
               tool: str = "auto", simultaneous: bool = True,
               ifnames: list[str] | None = None, prefer_ipv6: bool | None = None,
               timeout: float | None = None) -> ProbeResult:
    """Measure every ring link r -> r+1; every rank must call this, in the same order.

    ``store``/``rank``/``world_size`` default to the default process group's. ``ifnames`` and
    ``prefer_ipv6`` default to LINERATE_SOCKET_IFNAME and LINERATE_PREFER_IPV6. ``simultaneous``
    measures all links at once (the ring all-reduce's load); False measures one link at a time.
    Every rank returns the same result. Each phase is bounded by ``seconds + timeout``.
    """
    if store is None or rank is None or world_size is None:
        import torch.distributed as dist
        if not dist.is_initialized():
            raise LinkProbeError("probe_ring needs a store, rank and world size, or an "
                                 "initialized default process group")
        store = dist.distributed_c10d._get_default_store() if store is None else store
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if streams < 1:
        raise ValueError(f"streams must be at least 1, got {streams}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {', '.join(TOOLS)}, got {tool!r}")
    if ifnames is None:
        ifnames = [n.strip() for n in settings.read("LINERATE_SOCKET_IFNAME").split(",")
                   if n.strip()]
    if prefer_ipv6 is None:
        prefer_ipv6 = settings.read("LINERATE_PREFER_IPV6")
    probe = _Probe(store, rank, world_size, streams, seconds, tool, simultaneous,
                   listen_addresses(ifnames, prefer_ipv6),
                   seconds + (DEFAULT_GRACE_S if timeout is None else timeout))
    return probe.run()


def format_lines(result: ProbeResult) -> list[str]:
    """'#' lines for the bench header: the capacity, then one line per link and rail."""
    cap = result.capacity_gbit_s
    if cap is None:
        return ["# raw link capacity: none (a single rank has no links)"]
    lines = [f"# raw link capacity: {cap:.2f} Gbit/s (min over ring links; "
             f"{result.describe()})"]
    for link in result.links:
        rails = "; ".join(f"rail {r.rail} {r.src_addr} -> {r.dst_addr}: {r.gbit_s:.2f}"
                          for r in link.rails)
        lines.append(f"#   link {link.src} -> {link.dst} ({link.src_host} -> {link.dst_host}): "
                     f"{link.gbit_s:.2f} Gbit/s ({rails})")
    return lines


# ---------------------------------------------------------------------------- the probe
class _Probe:
    def __init__(self, store, rank, world, streams, seconds, tool, simultaneous, addrs, limit):
        self.store, self.rank, self.world = store, rank, world
        self.streams, self.seconds, self.simultaneous = streams, seconds, simultaneous
        self.addrs, self.limit = addrs, limit
        self.requested_tool = tool
        self.dst, self.src = (rank + 1) % world, (rank - 1) % world
        self.barriers = 0

    def run(self) -> ProbeResult:
        epoch = self.store.add(f"{_PREFIX}/epoch/{self.rank}", 1)
        self.prefix = f"{_PREFIX}/{epoch}"
        has_iperf = shutil.which("iperf3") is not None
        self._set(f"info/{self.rank}", {"host": socket.gethostname(), "addrs": self.addrs,
                                        "iperf3": has_iperf})
        infos = [self._get(f"info/{r}", what=f"rank {r} to start the link probe")
                 for r in range(self.world)]
        tool = self._choose_tool(infos)
        if self.world < 2:
            return ProbeResult([], self.streams, self.seconds, tool, self.simultaneous)
        rails = {len(info["addrs"]) for info in infos}
        if len(rails) != 1:
            counts = ", ".join(f"rank {r}: {len(i['addrs'])}" for r, i in enumerate(infos))
            raise LinkProbeError(f"ranks have different numbers of rails ({counts}); set "
                                 "LINERATE_SOCKET_IFNAME to as many interfaces on every rank")
        measure = self._iperf_rail if tool == "iperf3" else self._socket_rail
        for rail in range(len(self.addrs)):
            for active in ([None] if self.simultaneous else range(self.world)):
                self._barrier()
                sending = active is None or active == self.rank
                receiving = active is None or active == self.src
                if sending or receiving:
                    measured = measure(rail, infos, sending, receiving)
                    if measured is not None:
                        self._set(f"rate/{rail}/{self.src}", asdict(measured))
        links = []
        for src in range(self.world):
            dst = (src + 1) % self.world
            rates = [RailRate(**self._get(f"rate/{rail}/{src}")) for rail in range(len(self.addrs))]
            links.append(LinkRate(src, dst, infos[src]["host"], infos[dst]["host"], rates))
        self._barrier()
        return ProbeResult(links, self.streams, self.seconds, tool, self.simultaneous)

    def _choose_tool(self, infos: list[dict]) -> str:
        everywhere = all(info["iperf3"] for info in infos)
        if self.requested_tool == "iperf3" and not everywhere:
            missing = [r for r, info in enumerate(infos) if not info["iperf3"]]
            raise LinkProbeError(f"iperf3 is not installed on rank(s) {missing}")
        if self.requested_tool == "auto":
            return "iperf3" if everywhere else "socket"
        return self.requested_tool

    # ------------------------------------------------------------------ store helpers
    def _set(self, key: str, value) -> None:
        self.store.set(f"{self.prefix}/{key}", json.dumps(value))

    def _get(self, key: str, what: str | None = None):
        full = f"{self.prefix}/{key}"
        try:
            self.store.wait([full], timedelta(seconds=self.limit))
        except Exception as e:
            raise LinkProbeError(f"rank {self.rank}: link probe timed out waiting for "
                                 f"{what or key} ({type(e).__name__}: {e})") from None
        return json.loads(self.store.get(full).decode())

    def _barrier(self) -> None:
        self.barriers += 1
        key = f"barrier/{self.barriers}"
        if self.store.add(f"{self.prefix}/{key}/count", 1) == self.world:
            self._set(f"{key}/done", True)
        self._get(f"{key}/done", what=f"every rank to reach link probe phase {self.barriers}")

    # ------------------------------------------------------------------ plain sockets
    def _socket_rail(self, rail: int, infos: list[dict], sending: bool,
                     receiving: bool) -> RailRate | None:
        """Send to dst and/or receive from src on one rail; the receiver returns the rate."""
        receiver = None
        if receiving:
            receiver = _Receiver(self.addrs[rail], self.streams, self.limit,
                                 f"rank {self.src} -> rank {self.rank} (rail {rail})")
            self._set(f"listen/{rail}/{self.rank}",
                      {"addr": self.addrs[rail], "port": receiver.port, "token": receiver.token})
        try:
            if receiver:
                receiver.start()
            if sending:
                peer = self._get(f"listen/{rail}/{self.dst}",
                                 what=f"rank {self.dst}'s rail {rail} listener")
                _send(self.addrs[rail], peer["addr"], peer["port"], bytes.fromhex(peer["token"]),
                      self.streams, self.seconds, self.limit,
                      f"rank {self.rank} -> rank {self.dst} (rail {rail})")
            if receiver:
                nbytes, secs = receiver.result()
                return RailRate(rail, infos[self.src]["addrs"][rail], self.addrs[rail], nbytes, secs)
            return None
        finally:
            if receiver:
                receiver.close()

    # ------------------------------------------------------------------ iperf3
    def _iperf_rail(self, rail: int, infos: list[dict], sending: bool,
                    receiving: bool) -> RailRate | None:
        """iperf3 server for src and/or client to dst; the receiver's rate is published by the
        client (its JSON has the receiver's figures) under the client's own key."""
        server = None
        what = f"rank {self.src} -> rank {self.rank} (rail {rail})"
        if receiving:
            server, port = _start_iperf_server(self.addrs[rail], what)
            self._set(f"listen/{rail}/{self.rank}", {"addr": self.addrs[rail], "port": port})
        try:
            if sending:
                peer = self._get(f"listen/{rail}/{self.dst}",
                                 what=f"rank {self.dst}'s rail {rail} iperf3 server")
                nbytes, secs = _run_iperf_client(
                    self.addrs[rail], peer["addr"], peer["port"], self.streams, self.seconds,
                    self.limit, f"rank {self.rank} -> rank {self.dst} (rail {rail})")
                self._set(f"iperf/{rail}/{self.rank}", [nbytes, secs])
            if receiving:
                nbytes, secs = self._get(f"iperf/{rail}/{self.src}",
                                         what=f"rank {self.src}'s iperf3 result ({what})")
                return RailRate(rail, infos[self.src]["addrs"][rail], self.addrs[rail],
                                nbytes, secs)
            return None
        finally:
            if server is not None:
                _stop(server)


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


class _Receiver:
    """Accepts ``streams`` connections that present the token and counts their bytes."""

    def __init__(self, addr: str, streams: int, limit: float, what: str):
        self.streams, self.limit, self.what = streams, limit, what
        self.token = secrets.token_hex(_TOKEN_BYTES)
        try:  # within LINERATE_PORT_RANGE, as the ranks' own listeners
            self.listener = listen_on(addr, streams + 4, _port_range(), f"link probe {what}",
                                      reuse=False)
        except PortRangeExhausted as e:
            raise LinkProbeError(str(e)) from None
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.counts: list[tuple[int, float, float]] = []  # bytes, first byte, last byte
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._serve, name="linkprobe-recv", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        deadline = time.monotonic() + self.limit
        readers = []
        try:
            expected = bytes.fromhex(self.token)
            while len(readers) < self.streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only {len(readers)} of {self.streams} streams connected")
                self.listener.settimeout(left)
                conn, _ = self.listener.accept()
                with self.lock:
                    self.conns.append(conn)
                conn.settimeout(min(left, 10.0))
                if _recv_exact(conn, _TOKEN_BYTES) != expected:
                    conn.close()  # not our sender: ignore it
                    continue
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                t = threading.Thread(target=self._count, args=(conn,), daemon=True)
                t.start()
                readers.append(t)
            for t in readers:
                t.join(max(deadline - time.monotonic(), 0.0))
            if any(t.is_alive() for t in readers):
                raise TimeoutError("the sender did not finish in time")
        except Exception as e:
            with self.lock:
                self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.listener.close()

    def _count(self, conn: socket.socket) -> None:
        buf = memoryview(bytearray(_BUF_BYTES))
        nbytes, first, last = 0, 0.0, 0.0
        try:
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                last = time.perf_counter()
                if nbytes == 0:
                    first = last
                nbytes += n
            with self.lock:
                self.counts.append((nbytes, first, last))
        except Exception as e:
            with self.lock:
                self.errors.append(f"{type(e).__name__}: {e}")

    def result(self) -> tuple[int, float]:
        self.thread.join(self.limit + 1.0)
        if self.thread.is_alive():
            self.close()
            self.thread.join(1.0)
            raise LinkProbeError(f"link probe {self.what}: receiver did not finish in time")
        if self.errors:
            raise LinkProbeError(f"link probe {self.what}: receiving failed: {self.errors[0]}")
        got = [c for c in self.counts if c[0] > 0]
        if not got:
            raise LinkProbeError(f"link probe {self.what}: no bytes arrived")
        first = min(c[1] for c in got)
        last = max(c[2] for c in got)
        return sum(c[0] for c in got), max(last - first, 1e-9)

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            c.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            break
        got += k
    return bytes(buf[:got])


def _send(local: str, addr: str, port: int, token: bytes, streams: int, seconds: float,
          limit: float, what: str) -> None:
    """``streams`` connections, each streaming one shared buffer for ``seconds``."""
    payload = memoryview(bytearray(_BUF_BYTES))
    errors: list[str] = []
    socks: list[socket.socket] = []
    try:
        for _ in range(streams):
            s = socket.socket(_family(addr), socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(limit)
            s.bind((local, 0))
            s.connect((addr, port))
            s.sendall(token)
        stop = time.monotonic() + seconds

        def stream(s: socket.socket) -> None:
            try:
                while time.monotonic() < stop:
                    s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except OSError as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=stream, args=(s,), daemon=True) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit)
        if any(t.is_alive() for t in threads):
            errors.append("sending did not finish in time")
    except OSError as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        for s in socks:
            s.close()
    if errors:
        raise LinkProbeError(f"link probe {what} to {addr}:{port} failed: {errors[0]}")


# ---------------------------------------------------------------------------- iperf3 processes
def _free_port(addr: str) -> int:
    """A port for iperf3's server: free now, within LINERATE_PORT_RANGE where it is set."""
    try:
        with listen_on(addr, 1, _port_range(), "link probe's iperf3 server", reuse=False) as s:
            return s.getsockname()[1]
    except PortRangeExhausted as e:
        raise LinkProbeError(str(e)) from None


def _port_range() -> tuple[int, int] | None:
    return settings.parse_port_range(settings.read("LINERATE_PORT_RANGE"))


def _start_iperf_server(addr: str, what: str) -> tuple[subprocess.Popen, int]:
    port = _free_port(addr)
    try:
        proc = subprocess.Popen(["iperf3", "-s", "-1", "-B", addr, "-p", str(port), "-J"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        raise LinkProbeError(f"link probe {what}: cannot start iperf3 server: {e}") from None
    return proc, port


def _run_iperf_client(local: str, addr: str, port: int, streams: int, seconds: float,
                      limit: float, what: str) -> tuple[int, float]:
    """(bytes, seconds) as the receiving end counted them. Retries while the server starts."""
    cmd = ["iperf3", "-c", addr, "-p", str(port), "-B", local, "-P", str(streams),
           "-t", f"{seconds:g}", "-J"]
    deadline = time.monotonic() + limit
    doc: dict = {}
    for _ in range(_IPERF_CONNECT_TRIES):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            raise LinkProbeError(f"link probe {what}: iperf3 did not finish in time") from None
        try:
            doc = json.loads(proc.stdout)
        except json.JSONDecodeError:
            doc = {"error": (proc.stderr or proc.stdout).strip()[-300:]}
        if proc.returncode == 0 and "error" not in doc:
            return _iperf_received(doc, what)
        if "connect" not in str(doc.get("error", "")).lower():
            break  # a real failure, not the server still starting
        time.sleep(0.1)
    raise LinkProbeError(f"link probe {what}: iperf3 failed: {doc.get('error', 'no output')}")


def _iperf_received(doc: dict, what: str) -> tuple[int, float]:
    try:
        received = doc["end"]["sum_received"]
        bits_per_second = float(received["bits_per_second"])
        secs = float(received["seconds"])
    except (KeyError, TypeError, ValueError):
        raise LinkProbeError(f"link probe {what}: iperf3 JSON has no end.sum_received") from None
    return int(round(bits_per_second * secs / 8)), secs


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
