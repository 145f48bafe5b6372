"""TCP links: ``LINERATE_NSOCKS`` connections per rail to each peer, striped (link.StreamLink),
optionally inside TLS (LINERATE_TLS, transport/tls.py). A sender and a receiver thread per
connection drive them (``TcpLink``, LINERATE_IO=threads or auto, the default), or with
``LINERATE_IO=shared`` the process's I/O loops (``SharedTcpLink``, transport/ioloop.py); TLS
connections, which block, always the former.

Set-up (``TcpMesh``): each rank listens on one socket per rail and publishes the addresses
through the rendezvous. Each connection is tuned (no Nagle; keepalive and TCP_USER_TIMEOUT
from LINERATE_LINK_TIMEOUT), wrapped in TLS when on, and authenticated by the HMAC handshake
(transport/handshake.py), which also says which peer and connection index it is. One thread
per process accepts on every listener of every group (``_Acceptor``, a selector); each
accepted connection's handshake runs on a short-lived thread of its own.

``LINERATE_CONNECT=eager`` (``connect``): a rank connects to every lower rank and accepts from
every higher one; once every connection of every peer is there the listeners close and each
peer's connections become one ``TcpLink``.

``LINERATE_CONNECT=lazy`` (``serve``/``want``): no connection at creation. The Context calls
``want(peer)`` when it first needs that peer (a send, a receive, a control frame); the link is
made on a short-lived thread and handed over with ``on_link(peer, link)``, or its failure with
``on_fail(peer, error)`` (the error names the peer). Either rank of a pair may dial, and both
may at once. The rule: a rank accepts an authenticated connection from a peer unless it is
itself the lower rank of the pair and is dialing that peer; then it answers DECLINE
(handshake.Declined), and so does a rank whose dial of that peer just completed (the peer
may still be taking the last connections). A rank that is closing, or has failed that peer,
answers GONE (handshake.Gone): the dialer fails the peer at once (it does not wait
LINERATE_CONNECT_TIMEOUT for connections that will never come). So when both dial, the lower rank's dial wins, the
higher rank's dialer is declined at its first connection (nothing was sent on it) and waits
for the lower rank's connections to arrive; a rank that has accepted a peer's first connection
never dials that peer. All connections of one link are dialed by one rank: no duplicates,
and messages of a pair travel on one link, in order per (channel, tag). A peer whose
listener refuses (its process is gone or its group closed) fails at once; a peer that does not
answer within LINERATE_CONNECT_TIMEOUT fails then. The listeners stay open until every peer's
link is made (or has failed), or the Context closes.
"""
from __future__ import annotations

import _socket
import errno
import logging
import os
import resource
import selectors
import socket
import threading
import time

from . import handshake, tls
from .ioloop import LoopStreamLink
from .link import ThreadedStreamLink
from .ports import listen_on
from .request import TransportError

log = logging.getLogger("linerate.transport")

#: Default of LINERATE_LINK_TIMEOUT (seconds; see tune).
LINK_TIMEOUT_DEFAULT = 60.0

class _Tcp:
    """What a peer's TCP (or TLS) connections add to a stream link, whoever drives them."""

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


class TcpLink(_Tcp, ThreadedStreamLink):
    """A peer's TCP (or TLS) connections, each with a sender and a receiver thread."""


class SharedTcpLink(_Tcp, LoopStreamLink):
    """A peer's plain TCP connections, driven by the process-wide I/O loops."""


def interface_speed_bps(address: str) -> int | None:
    """The line rate of the interface that holds ``address`` in bits per second
    (LINERATE_LINK_CAPACITY, else the driver's speed), or None (loopback, unknown)."""
    from . import metrics  # interface names and capacities (cached there)
    try:
        cap = metrics.link_capacity(metrics.interface_of(address))
    except ValueError:  # a bad LINERATE_LINK_CAPACITY: the metrics exporter reports it
        return None
    return int(cap * 8) if cap else None


class _Acceptor:
    """One thread per process accepts on every registered listener (of every group)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None

    def add(self, ls: socket.socket, on_conn) -> None:
        """Accept on ``ls`` from now on; ``on_conn(sock, addr)`` gets each connection."""
        ls.setblocking(False)
        with self._lock:
            self._sel.register(ls, selectors.EVENT_READ, on_conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="linerate-accept",
                                                daemon=True)
                self._thread.start()

    def remove(self, ls: socket.socket) -> None:
        """Stop accepting on ``ls`` (before closing it)."""
        with self._lock:
            try:
                self._sel.unregister(ls)
            except (KeyError, ValueError):
                pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._sel.get_map():
                    self._thread = None  # add() starts another
                    return
            try:
                events = self._sel.select(0.5)
            except OSError:  # a listener closed under select
                time.sleep(0.01)
                continue
            for key, _ in events:
                ls = key.fileobj
                try:
                    sock, addr = ls.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    if ls.fileno() < 0 or e.errno in (errno.EBADF, errno.EINVAL):
                        self.remove(ls)  # closed without remove()
                        continue
                    # Out of descriptors (a flood) or a reset before accept: keep accepting;
                    # the set-up's own deadline still bounds the wait.
                    log.warning("accept failed (%s); retrying", e)
                    time.sleep(0.1)
                    continue
                sock.setblocking(True)
                try:
                    key.data(sock, addr)
                except Exception:  # noqa: BLE001 - never kill the process's acceptor
                    log.exception("accepting a connection from %s failed", addr)
                    sock.close()


_ACCEPTOR = _Acceptor()


class TcpMesh:
    """The TCP connections of ``rank`` to every peer of a group of ``size`` ranks."""

    def __init__(self, rank: int, size: int, secret: bytes, options, addresses: list[str],
                 tls_config: tls.TlsConfig | None, link_timeout: float,
                 nsocks_auto: bool = False):
        self.rank, self.size, self.secret = rank, size, secret
        self.options = options
        self.addresses = addresses
        self.nrails = len(addresses)
        self.nconns = options.nsocks * self.nrails
        self.tls = tls_config
        self.link_timeout = link_timeout
        self.listeners: list[socket.socket] | None = None
        #: Each peer's connections: the rail of each connection index (``plan_rails`` may
        #: narrow it; both ends compute the same plan). Default: nsocks on every rail.
        every = [rail for rail in range(self.nrails) for _ in range(options.nsocks)]
        self._rails: dict[int, list[int]] = {p: every for p in range(size) if p != rank}
        #: Set once the plan is final: a connection that arrives earlier waits for it (only
        #: a plan that may spread rails is waited for: Context calls plan_rails).
        self._planned = threading.Event()
        #: LINERATE_NSOCKS auto with one rail: a link to another host of a two-level layout
        #: takes one connection (plan_rails).
        self._one_across = nsocks_auto and self.nrails == 1 and options.nsocks > 1
        if not self._one_across and (self.nrails < 2 or
                                     getattr(options, "rail_spread", "0") != "auto"):
            self._planned.set()
        self._socks: dict[int, list] = {p: [None] * self.nconns for p in range(size) if p != rank}
        # Every peer's connections may be needed (an all-to-all links every pair): a soft
        # file-descriptor limit of 1024 (many distributions' default) runs out near 500 ranks.
        raise_fd_limit(size * self.nconns + 256)
        self._cond = threading.Condition()
        #: Peers linked another way (``skip``): they neither dial nor are dialed.
        self._skipped: set = set()
        self._stop = False
        self._rv = None
        #: Lazy links (serve): each peer's state: None, "dial", "accept", "done", "failed".
        self.lazy = False
        self._state: dict[int, str | None] = {}
        self._remote: dict[int, list] = {}
        self._watched: set = set()
        self._on_link = self._on_fail = None
        self._listening = False

    def listen(self) -> list:
        """Open one listener per rail; return [[address, port], ...] to publish."""
        listeners = []
        ports = getattr(self.options, "ports", None)  # LINERATE_PORT_RANGE
        try:
            for addr in self.addresses:
                listeners.append(listen_on(addr, max(128, self.size * self.nconns), ports,
                                           f"rank {self.rank}"))
        except BaseException:
            for ls in listeners:
                ls.close()
            raise
        self.listeners = listeners
        return [[addr, ls.getsockname()[1]] for addr, ls in zip(self.addresses, listeners)]

    def plan_rails(self, hosts: tuple | None) -> None:
        """Fix each peer's connections before any is made (every rank calls it once, with
        the group's layout, or None to keep every link on every rail). With several rails,
        LINERATE_RAIL_SPREAD=auto and co-located ranks (``hosts``: group ranks per host, shared
        memory proved), a link to a rank of another host uses only the rails of the lower
        rank's local index i on its host of L ranks (``spread_rails``): the host's rails are
        spread over its local ranks, and the two-level columns (local rank i to local rank i)
        each keep one rail (or R/L rails) to themselves.

        With one rail and LINERATE_NSOCKS auto (2 connections per peer), a link to a rank of
        another host of such a layout takes one connection: the host's L ranks already run L
        links side by side to each other host (the two-level columns), so a second connection
        each adds threads and CPU but no bandwidth."""
        spread = self.nrails > 1 and getattr(self.options, "rail_spread", "0") == "auto"
        if hosts and (spread or self._one_across) and any(len(h) > 1 for h in hosts):
            where = {r: (h, i) for h in hosts for i, r in enumerate(h)}
            mine = where.get(self.rank)
            with self._cond:
                for p in self._rails:
                    if p not in where or mine is None or where[p][0] is mine[0]:
                        continue  # same host: shared memory, or no plan
                    if spread:
                        h, i = where[min(p, self.rank)]
                        rails = spread_rails(i, len(h), self.nrails)
                        self._rails[p] = [r for r in rails for _ in range(self.options.nsocks)]
                    else:  # one rail, auto: one connection
                        self._rails[p] = [0]
                    self._socks[p] = [None] * len(self._rails[p])
        self._planned.set()

    def skip(self, peers) -> None:
        """``peers`` are linked another way (shared memory, on this host): no TCP link is made
        to them, eager or lazy (the choice is the same on both ends of every pair), and the
        lazy listeners close once every other peer is linked or failed."""
        peers = set(peers)
        if not peers:
            return
        with self._cond:
            for p in peers:
                self._socks.pop(p, None)
                if p in self._state:
                    self._state[p] = "done"
            self._skipped = peers
            self._cond.notify_all()

    def _nconns(self, peer: int, wait: bool = True) -> int | None:
        """Connections ``peer`` must make to this rank (its connections wait for the plan;
        None if it is not made and ``wait`` is false)."""
        if not 0 <= peer < self.size or peer == self.rank:
            return self.nconns  # the handshake names the bad rank
        if peer in self._skipped:
            raise handshake.HandshakeError(f"rank {peer} dialed, but it is linked to this rank "
                                           f"over shared memory")
        if not wait and not self._planned.is_set():
            return None
        if not self._planned.wait(max(0.0, min(10.0, self.options.connect_timeout))):
            raise handshake.HandshakeError(f"rank {peer} connected before this rank knew the "
                                           f"group's layout")
        return len(self._rails[peer])

    def connect(self, rv, deadline: float) -> dict[int, list]:
        """Accept from the higher ranks, connect to the lower ones; return each peer's
        connected sockets (index order) once all are there."""
        self._rv = rv
        opts = self.options
        self._accept_on()
        try:
            for peer in range(self.rank):
                if peer in self._skipped:
                    continue
                remote = rv.addresses_of(peer, self.nrails)
                for index, rail in enumerate(self._rails[peer]):
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
        return {p: self._link(p, ss) for p, ss in socks.items()}

    def _link(self, p: int, ss: list) -> TcpLink:
        opts = self.options
        rails = set(self._rails.get(p, range(self.nrails)))
        speed = interface_speed_bps(self.addresses[min(rails)]) if len(rails) == 1 else None
        kw = dict(tls_on=self.tls is not None, rank=self.rank, chunk_bytes=opts.chunk_bytes,
                  checksum=opts.checksum, credit_bytes=opts.credit_bytes, speed_bps=speed)
        if getattr(opts, "io", "auto") == "shared" and self.tls is None:
            return SharedTcpLink(p, ss, **kw)
        return TcpLink(p, ss, **kw)  # (a TLS stream blocks: threads)

    def abort(self) -> None:
        """Set-up failed: stop accepting, close what was connected."""
        with self._cond:
            self._stop = True
            socks = [s for ss in self._socks.values() for s in ss if s is not None]
            self._cond.notify_all()
        self._close_listeners()
        for s in socks:
            _close(s)

    def _accept_on(self) -> None:
        with self._cond:
            self._listening = True
        for ls in self.listeners:
            _ACCEPTOR.add(ls, self._on_conn)

    def _on_conn(self, sock, addr) -> None:
        threading.Thread(target=self._accept_one, args=(sock, addr),
                         name="linerate-handshake", daemon=True).start()

    def _close_listeners(self) -> None:
        with self._cond:
            was, self._listening = self._listening, False
        for ls in self.listeners or []:
            if was:
                _ACCEPTOR.remove(ls)
            _close(ls)

    # ------------------------------------------------------------------ lazy links
    def serve(self, rv, on_link, on_fail) -> None:
        """Lazy links: accept from any peer from now on (before the addresses are published);
        dial a peer on ``want``. ``on_link(peer, link)``/``on_fail(peer, error)`` are called
        from this mesh's threads, once per peer."""
        self._rv = rv
        self.lazy = True
        self._on_link, self._on_fail = on_link, on_fail
        self._state = {p: None for p in self._socks}
        self._accept_on()

    def set_addresses(self, remote: dict[int, list]) -> None:
        """Every peer's listen addresses (rank -> [[host, port], ...]), before any ``want``."""
        self._remote = remote

    def want(self, peer: int) -> None:
        """The Context needs ``peer``'s link: dial it, or wait for its connections to arrive
        (bounded by LINERATE_CONNECT_TIMEOUT). Cheap when already under way."""
        with self._cond:
            if self._stop:
                return
            st = self._state[peer]
            if st is None:
                self._state[peer] = "dial"
                target = self._dial
            elif st == "accept" and peer not in self._watched:
                self._watched.add(peer)
                target = self._await_incoming
            else:
                return
        threading.Thread(target=target, args=(peer,), name=f"linerate-dial-{peer}",
                         daemon=True).start()

    def stop(self) -> None:
        """The Context closes: no more links (what is under way is closed as it ends)."""
        self.abort()

    def release(self) -> None:
        """The Context closed: drop its callbacks (they point back at it); a link that a dial
        still completes is closed at once, a failure is nobody's business any more."""
        with self._cond:
            self._on_link, self._on_fail = _close_link, _ignore_failure

    def _decide(self, peer: int, index: int) -> bytes:
        """An authenticated connection from ``peer`` arrived: keep it (ACK), decline it
        because the link is made the other way (DECLINE: this rank's own dial, under way or
        just done while the peer's side still takes its connections), or tell the peer no
        link will be made (GONE: this rank is closing, or has failed ``peer``; the peer fails
        its side at once instead of waiting for a dial that never comes)."""
        with self._cond:
            st = self._state[peer]
            if self._stop or st == "failed":
                return handshake.GONE
            if st == "done":
                return handshake.DECLINE
            if st == "dial":  # both dial: the lower rank's dial wins
                if self.rank < peer:
                    return handshake.DECLINE
                # The peer's dial wins: this rank's own dial will be declined, or refused
                # once the peer, holding its link, closes its listener; the dial thread then
                # waits for these connections (``_dial``), nobody else does.
                self._watched.add(peer)
            self._state[peer] = "accept"
            return handshake.ACK

    def _lazy_add(self, peer: int, index: int, sock) -> None:
        with self._cond:
            socks = self._socks[peer]
            if socks[index] is not None:
                raise handshake.HandshakeError(f"duplicate connection {index} from rank {peer}")
            socks[index] = sock
            if None in socks or self._state[peer] in ("done", "failed"):
                return
            self._state[peer] = "done"
            self._socks[peer] = [None] * len(socks)
            self._cond.notify_all()
        self._made(peer, socks)

    def _made(self, peer: int, socks: list) -> None:
        link = self._link(peer, socks)
        self._maybe_close()
        self._on_link(peer, link)

    def _lazy_failed(self, peer: int, err: BaseException) -> None:
        from .request import PeerFailure
        with self._cond:
            if self._state[peer] in ("done", "failed"):
                return
            self._state[peer] = "failed"
            stopped = self._stop
            socks = [s for s in self._socks[peer] if s is not None]
            self._socks[peer] = [None] * len(self._socks[peer])
            self._cond.notify_all()
        for s in socks:
            _close(s)
        self._maybe_close()
        if not stopped:
            self._on_fail(peer, PeerFailure(peer, str(err)))

    def _maybe_close(self) -> None:
        """Close the listeners once no peer may still dial (every link made or failed)."""
        with self._cond:
            if not all(st in ("done", "failed") for st in self._state.values()):
                return
        self._close_listeners()

    def _dial(self, peer: int) -> None:
        deadline = time.monotonic() + self.options.connect_timeout
        socks = []
        try:
            remote = self._remote[peer]
            for index, rail in enumerate(self._rails[peer]):
                socks.append(self._connect(peer, remote[rail], self.addresses[rail], index,
                                           deadline, lazy=True))
        except handshake.Declined as e:
            for s in socks:
                _close(s)
            if socks:  # a peer that kept a connection of this dial declines no other
                self._lazy_failed(peer, TransportError(
                    f"rank {self.rank}: rank {peer} declined connection {len(socks)} of a link "
                    f"it had accepted: {e}"))
                return
            self._await_incoming(peer, deadline)  # the peer's own dial wins: wait for it
            return
        except BaseException as e:  # noqa: BLE001 - handed to the Context
            for s in socks:
                _close(s)
            with self._cond:
                won = self._state[peer] == "accept"
            if won:  # the peer's dial was accepted meanwhile: it may have closed its listener
                self._await_incoming(peer, deadline)
                return
            self._lazy_failed(peer, e)
            return
        with self._cond:
            ok = self._state[peer] == "dial" and not self._stop
            if ok:
                self._state[peer] = "done"
                self._cond.notify_all()
        if not ok:
            for s in socks:
                _close(s)
            return
        self._made(peer, socks)

    def _await_incoming(self, peer: int, deadline: float | None = None) -> None:
        """Wait for the peer's connections (its dial); fail the peer at the deadline, or as
        soon as a connection of that dial that already arrived is closed (the peer gave up or
        died partway: the rest will never come)."""
        if deadline is None:
            deadline = time.monotonic() + self.options.connect_timeout
        cut = None
        with self._cond:
            while self._state[peer] not in ("done", "failed") and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, _PARTIAL_POLL_S))
                cut = self._partial_cut(peer)
                if cut is not None:
                    break
            else:
                return
        if cut is not None:
            self._lazy_failed(peer, TransportError(
                f"rank {self.rank}: rank {peer} closed connection {cut} of its link before its "
                f"other connections arrived: rank {peer} exited, crashed or gave up connecting"))
            return
        refused = self.tls.last_refusal if self.tls is not None else None
        self._lazy_failed(peer, TransportError(
            f"rank {self.rank}: the connections from rank {peer} did not arrive within "
            f"{self.options.connect_timeout:.0f}s (LINERATE_CONNECT_TIMEOUT); is rank {peer} "
            f"alive and its address reachable?"
            + (f" (LINERATE_TLS: the last TLS handshake refused here: {refused})" if refused else "")))

    def _partial_cut(self, peer: int) -> int | None:
        """*Under _cond.* The index of a connection of ``peer``'s incomplete dial that the
        peer closed (EOF or reset), else None. Peeks at the TCP stream itself (also under TLS:
        any byte, a record or close_notify, is not an end): nothing is consumed."""
        for index, sock in enumerate(self._socks[peer]):
            if sock is None:
                continue
            try:
                if _socket_recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return index
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return index
        return None

    def _complete(self) -> bool:
        return all(None not in s for s in self._socks.values())

    def _add(self, peer: int, index: int, sock) -> None:
        with self._cond:
            if self._socks[peer][index] is not None:
                raise handshake.HandshakeError(f"duplicate connection {index} from rank {peer}")
            self._socks[peer][index] = sock
            self._cond.notify_all()

    def _connect(self, peer: int, remote, local_addr: str, index: int, deadline: float,
                 lazy: bool = False):
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
                handshake.connect_side(sock, self.secret, self.rank, peer, index,
                                       len(self._rails[peer]))
                sock.settimeout(None)
                return sock
            except handshake.Declined:
                sock.close()
                raise
            except handshake.Gone as e:  # the peer closes the group or failed this rank
                sock.close()
                raise TransportError(f"rank {self.rank}: cannot connect to rank {peer} at "
                                     f"{host}:{port}: {e}") from e
            except (OSError, handshake.HandshakeError) as e:
                sock.close()
                refused = isinstance(e, ConnectionRefusedError) or (
                    isinstance(e, OSError) and e.errno == errno.ECONNREFUSED)
                retryable = isinstance(e, (ConnectionRefusedError, socket.timeout)) or (
                    isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ECONNRESET,
                                                           errno.EHOSTUNREACH, errno.ENETUNREACH))
                if lazy and refused:
                    # Lazy: the peer listened before it published its address and listens
                    # until it holds every link or closes: a refusal means it is gone.
                    raise TransportError(
                        f"rank {self.rank}: cannot connect to rank {peer} at {host}:{port}: "
                        f"refused: rank {peer} exited, crashed or closed the group") from e
                if self._stop:
                    raise TransportError(f"rank {self.rank}: set-up was given up") from e
                if not retryable or time.monotonic() + delay > deadline:
                    hint = ""
                    if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
                        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                        hint = (f" (out of file descriptors: RLIMIT_NOFILE soft {soft}, hard "
                                f"{hard}; {self.size - 1} peers x {self.nconns} connections "
                                f"may be needed: raise it, e.g. ulimit -n)")
                    self._peer_report_first(peer)
                    raise TransportError(f"rank {self.rank}: cannot connect to rank {peer} at "
                                         f"{host}:{port} (connection {index}): {e}{hint}") from e
                # A peer that gave up (a setting that differs, say) closed its listener: its
                # report, not this refusal, is the cause, and it must not take until the deadline.
                if self._rv is not None:
                    self._rv.raise_if_failed(f"while connecting to rank {peer}")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _peer_report_first(self, peer: int) -> None:
        """A connection that a peer cut (mid-handshake, say) may be that peer giving up: its
        report through the Store, when it comes within a second, is the cause to name, not
        this connection's end (a rank that trusts another CA is named by the rank that refused
        it; the others only see their connections to it cut)."""
        if self._rv is None:
            return
        end = time.monotonic() + 1.0
        while True:
            self._rv.raise_if_failed(f"while connecting to rank {peer}")
            if time.monotonic() >= end:
                return
            time.sleep(0.05)

    def _accept_one(self, sock: socket.socket, addr) -> None:
        try:
            sock.settimeout(min(10.0, self.options.connect_timeout))
            tune(sock, self.link_timeout)
            if self.tls is not None:  # TLS first; linerate's handshake runs inside it
                sock = self.tls.wrap(sock, True, f"the connection from {tls.peer_label(addr)}")
            peer, index = handshake.accept_side(sock, self.secret, self.rank, self.size, self._nconns,
                                                self._decide if self.lazy else None)
            if peer < self.rank and not self.lazy:
                raise handshake.HandshakeError(f"rank {peer} connected, but lower ranks are connected to")
            sock.settimeout(None)
            with self._cond:
                if self._stop:
                    raise TransportError("set-up was given up")
            if self.lazy:
                self._lazy_add(peer, index, sock)
            else:
                self._add(peer, index, sock)
        except handshake.Declined as e:  # both ranks dialed: this rank's dial is the link
            log.debug("rank %d: %s", self.rank, e)
            _close(sock)
        except (OSError, handshake.HandshakeError, TransportError) as e:
            log.warning("rank %d: dropped connection from %s: %s", self.rank, addr, e)
            _close(sock)


#: Waiting for a peer's dial: how often the connections that already arrived are looked at.
_PARTIAL_POLL_S = 0.1
#: recv of the socket itself, also for an ssl.SSLSocket (whose own recv refuses flags).
_socket_recv = _socket.socket.recv

_FD_LOCK = threading.Lock()


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE to ``need`` more descriptors than it has open
    (at most the hard limit), as a process opening one connection per peer must; returns the
    soft limit. A hard limit below that is left for the connect that fails to name
    (EMFILE: "Too many open files")."""
    with _FD_LOCK:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = 0
        want = open_now + need
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(hard, want)
            if new > soft:
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                    log.debug("raised the file descriptor limit from %d to %d", soft, new)
                    soft = new
                except (ValueError, OSError) as e:  # pragma: no cover - kernel refuses
                    log.warning("could not raise the file descriptor limit from %d to %d: %s",
                                soft, new, e)
        return soft


def spread_rails(index: int, local: int, nrails: int) -> list[int]:
    """The rails of local rank ``index`` of a host with ``local`` ranks and ``nrails`` rails:
    rail index mod R when there are at least as many local ranks as rails, else every
    ``local``-th rail from ``index`` (2 ranks, 4 rails: rank 0 rails 0 and 2, rank 1 rails 1
    and 3), so that every rail carries the traffic of some local rank."""
    if local >= nrails:
        return [index % nrails]
    return list(range(index % local, nrails, local))


def _close_link(peer: int, link) -> None:
    """A released mesh's ``on_link``: its Context is gone, so is the link."""
    link.begin_close()
    link.close(time.monotonic() + 1.0)


def _ignore_failure(peer: int, err: BaseException) -> None:
    """A released mesh's ``on_fail``."""


def _close(sock) -> None:
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


__all__ = ["TcpLink", "SharedTcpLink", "TcpMesh", "tune", "interface_speed_bps", "LINK_TIMEOUT_DEFAULT"]
