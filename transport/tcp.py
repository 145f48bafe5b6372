"""TCP links: ``LINERATE_NSOCKS`` connections per rail to each peer, striped (link.StreamLink),
optionally inside TLS (LINERATE_TLS, transport/tls.py).

Set-up (``TcpMesh``): each rank listens on one socket per rail and publishes the addresses
through the rendezvous; it connects to every lower rank and accepts from every higher one.
Each connection is tuned (no Nagle; keepalive and TCP_USER_TIMEOUT from LINERATE_LINK_TIMEOUT),
wrapped in TLS when on, and authenticated by the HMAC handshake (transport/handshake.py),
which also says which peer and connection index it is. Once every connection of every peer is
there the listeners close and each peer's connections become one ``TcpLink``.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

from . import handshake, tls
from .link import StreamLink
from .request import TransportError

log = logging.getLogger("linerate.transport")

#: Default of LINERATE_LINK_TIMEOUT (seconds; see tune).
LINK_TIMEOUT_DEFAULT = 60.0


class TcpLink(StreamLink):
    """A peer's TCP (or TLS) connections."""

    kind = "tcp"

    def __init__(self, peer: int, socks: list, *, tls_on: bool = False, **kw):
        super().__init__(peer, socks, **kw)
        self.tls = tls_on
        # Each connection's TLS version ("TLSv1.3"), or None for plain TCP.
        self._tls_versions = [getattr(s, "version", None) if tls_on else None for s in socks]

    def stats(self) -> dict:
        """``Link.stats()``, plus ``tls`` (on or off) and each connection's TLS version."""
        out = super().stats()
        out["tls"] = self.tls
        for c, v in zip(out["connections"], self._tls_versions):
            c["tls"] = v
        return out


def interface_speed_bps(address: str) -> int | None:
    """The line rate of the interface that holds ``address`` in bits per second
    (LINERATE_LINK_CAPACITY, else the driver's speed), or None (loopback, unknown)."""
    from . import metrics  # interface names and capacities (cached there)
    try:
        cap = metrics.link_capacity(metrics.interface_of(address))
    except ValueError:  # a bad LINERATE_LINK_CAPACITY: the metrics exporter reports it
        return None
    return int(cap * 8) if cap else None


class TcpMesh:
    """The TCP connections of ``rank`` to every peer of a group of ``size`` ranks."""

    def __init__(self, rank: int, size: int, secret: bytes, options, addresses: list[str],
                 tls_config: tls.TlsConfig | None, link_timeout: float):
        self.rank, self.size, self.secret = rank, size, secret
        self.options = options
        self.addresses = addresses
        self.nrails = len(addresses)
        self.nconns = options.nsocks * self.nrails
        self.tls = tls_config
        self.link_timeout = link_timeout
        self.listeners: list[socket.socket] | None = None
        self._socks: dict[int, list] = {p: [None] * self.nconns for p in range(size) if p != rank}
        self._cond = threading.Condition()
        self._stop = False
        self._rv = None

    def listen(self) -> list:
        """Open one listener per rail; return [[address, port], ...] to publish."""
        listeners = []
        for addr in self.addresses:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            ls = socket.socket(family, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((addr, 0))
            ls.listen(max(128, self.size * self.nconns))
            listeners.append(ls)
        self.listeners = listeners
        return [[addr, ls.getsockname()[1]] for addr, ls in zip(self.addresses, listeners)]

    def connect(self, rv, deadline: float) -> dict[int, list]:
        """Accept from the higher ranks, connect to the lower ones; return each peer's
        connected sockets (index order) once all are there."""
        self._rv = rv
        opts = self.options
        for ls in self.listeners:
            threading.Thread(target=self._accept_loop, args=(ls,), name="linerate-accept",
                             daemon=True).start()
        try:
            for peer in range(self.rank):
                remote = rv.addresses_of(peer, self.nrails)
                for rail in range(self.nrails):
                    for k in range(opts.nsocks):
                        index = rail * opts.nsocks + k
                        sock = self._connect(peer, remote[rail], self.addresses[rail], index, deadline)
                        self._add(peer, index, sock)
            with self._cond:
                while not self._complete():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = sorted(p for p, s in self._socks.items() if None in s)
                        refused = self.tls.last_refusal if self.tls is not None else None
                        raise TransportError(
                            f"rank {self.rank}: connections from ranks {missing} did not arrive "
                            f"within {opts.connect_timeout:.0f}s (LINERATE_CONNECT_TIMEOUT); are all "
                            f"ranks started and is their address reachable?"
                            + (f" (LINERATE_TLS: the last TLS handshake refused here: {refused})"
                               if refused else ""))
                    self._cond.wait(min(left, 0.05))
                    rv.raise_if_failed("while waiting for connections")
        except BaseException:
            self.abort()
            raise
        self._close_listeners()  # mesh complete: nobody else may connect
        log.debug("rank %d: mesh of %d ranks x %d connections ready", self.rank, self.size,
                  self.nconns)
        return {p: list(s) for p, s in self._socks.items()}

    def links(self, socks: dict[int, list]) -> dict[int, TcpLink]:
        opts = self.options
        out = {}
        for p, ss in socks.items():
            speed = interface_speed_bps(self.addresses[0]) if self.nrails == 1 else None
            out[p] = TcpLink(p, ss, tls_on=self.tls is not None, rank=self.rank,
                             chunk_bytes=opts.chunk_bytes, checksum=opts.checksum,
                             credit_bytes=opts.credit_bytes, speed_bps=speed)
        return out

    def abort(self) -> None:
        """Set-up failed: stop accepting, close what was connected."""
        with self._cond:
            self._stop = True
            socks = [s for ss in self._socks.values() for s in ss if s is not None]
        self._close_listeners()
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def _close_listeners(self) -> None:
        for ls in self.listeners or []:
            try:
                ls.close()
            except OSError:
                pass

    def _complete(self) -> bool:
        return all(None not in s for s in self._socks.values())

    def _add(self, peer: int, index: int, sock) -> None:
        with self._cond:
            if self._socks[peer][index] is not None:
                raise handshake.HandshakeError(f"duplicate connection {index} from rank {peer}")
            self._socks[peer][index] = sock
            self._cond.notify_all()

    def _connect(self, peer: int, remote, local_addr: str, index: int, deadline: float):
        host, port = remote
        delay = 0.01
        while True:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if self.nrails > 1:
                    sock.bind((local_addr, 0))
                sock.settimeout(max(1.0, min(30.0, deadline - time.monotonic())))
                sock.connect((host, port))
                tune(sock, self.link_timeout)
                if self.tls is not None:  # TLS first; linerate's handshake runs inside it
                    sock = self.tls.wrap(sock, False, f"rank {peer} ({host}:{port})")
                handshake.connect_side(sock, self.secret, self.rank, peer, index, self.nconns)
                sock.settimeout(None)
                return sock
            except (OSError, handshake.HandshakeError) as e:
                sock.close()
                retryable = isinstance(e, (ConnectionRefusedError, socket.timeout)) or (
                    isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ECONNRESET,
                                                           errno.EHOSTUNREACH, errno.ENETUNREACH))
                if not retryable or time.monotonic() + delay > deadline:
                    raise TransportError(f"rank {self.rank}: cannot connect to rank {peer} at "
                                         f"{host}:{port} (connection {index}): {e}") from e
                # A peer that gave up (a setting that differs, say) closed its listener: its
                # report, not this refusal, is the cause, and it must not take until the deadline.
                if self._rv is not None:
                    self._rv.raise_if_failed(f"while connecting to rank {peer}")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _accept_loop(self, ls: socket.socket) -> None:
        while True:
            with self._cond:
                if self._stop or self._complete():
                    return
            try:
                ls.settimeout(0.5)
                sock, addr = ls.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if ls.fileno() < 0 or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # listener closed
                # Out of descriptors (a flood) or a connection reset before accept: keep
                # accepting; the mesh's own deadline still bounds the wait.
                log.warning("rank %d: accept failed (%s); retrying", self.rank, e)
                time.sleep(0.1)
                continue
            threading.Thread(target=self._accept_one, args=(sock, addr),
                             name="linerate-handshake", daemon=True).start()

    def _accept_one(self, sock: socket.socket, addr) -> None:
        try:
            sock.settimeout(min(10.0, self.options.connect_timeout))
            tune(sock, self.link_timeout)
            if self.tls is not None:  # TLS first; linerate's handshake runs inside it
                sock = self.tls.wrap(sock, True, f"the connection from {tls.peer_label(addr)}")
            peer, index = handshake.accept_side(sock, self.secret, self.rank, self.size, self.nconns)
            if peer < self.rank:
                raise handshake.HandshakeError(f"rank {peer} connected, but lower ranks are connected to")
            sock.settimeout(None)
            with self._cond:
                if self._stop:
                    raise TransportError("set-up was given up")
            self._add(peer, index, sock)
        except (OSError, handshake.HandshakeError, TransportError) as e:
            log.warning("rank %d: dropped connection from %s: %s", self.rank, addr, e)
            try:
                sock.close()
            except OSError:
                pass


def tune(sock: socket.socket, link_timeout: float = LINK_TIMEOUT_DEFAULT) -> None:
    """No Nagle; and a connection whose peer acknowledges nothing for ``link_timeout``
    seconds fails (ETIMEDOUT), which fails the peer with an error naming it.

    A host that loses its link or power sends no RST: without this a connection with data
    in flight retries for ~15 minutes (tcp_retries2) and an idle one is never found dead.
    TCP_USER_TIMEOUT bounds the first; keepalive probes (the first after a third of the
    timeout of silence) make the second case the first. A slow peer still acknowledges, and
    an outage shorter than the timeout is ridden out by TCP's retransmissions."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if link_timeout > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        idle = int(min(max(1, link_timeout // 3), 32767))
        intvl = int(min(max(1, link_timeout // 6), 32767))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT,
                        int(min(127, max(1, -(-(link_timeout - idle) // intvl) + 1))))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                        int(min(link_timeout * 1000, 2**31 - 1)))


__all__ = ["TcpLink", "TcpMesh", "tune", "interface_speed_bps", "LINK_TIMEOUT_DEFAULT"]
