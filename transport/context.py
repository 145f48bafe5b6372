"""A transport context: the full mesh of striped TCP connections of one group, and matching.

Algorithms talk to it in two verbs (as Gloo's pairs and ncclNet do)::

    req = ctx.isend(peer, memoryview, channel, tag, opcode)   # bytes of this buffer to peer
    req = ctx.irecv(peer, memoryview, channel, tag, opcode)   # bytes from peer into this buffer
    req.wait(timeout)

Messages between two ranks on one (channel, tag) match in the order they were posted on each
side (a per-key message number travels in every frame), whatever connection their chunks took.
Each message is cut into ``chunk_bytes`` chunks; every connection of the peer has a sender
thread that takes the next chunk of the head message, so the chunks of one message go out on
all connections (and all rails) at once, and a slow connection simply takes fewer. Each
connection also has a receiver thread that reads a header and then the payload straight into
the posted buffer (``recv_into`` a memoryview of the tensor): no copy, no Python bytes object.
A message that arrives before its receive is posted is staged in a buffer of its announced
size (bounded by ``max_unexpected_bytes``) and copied once the receive comes.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import socket
import struct
import threading
import time
import zlib

from . import framing, handshake, metrics, rdma, rendezvous, shm, tls
from .matching import Matcher, Mismatch, Staged as _Staged
from .framing import (CHANNEL_COLLECTIVE, CHANNEL_P2P, KIND_CLOSE, KIND_DATA, KIND_ERROR,
                      KIND_PROGRESS, KIND_QUERY)
from .interfaces import listen_addresses
from .options import TransportOptions, sockets_per_rail
from .request import MismatchError, PeerFailure, Request, TransportError

log = logging.getLogger("linerate.transport")

_STORE_PREFIX = rendezvous.STORE_PREFIX
#: close(): seconds without a byte leaving after which a peer's queued sends are given up.
_STALL_S = 2.0
#: Default of LINERATE_LINK_TIMEOUT (seconds; see _tune).
LINK_TIMEOUT_DEFAULT = 60.0


class _Conn:
    __slots__ = ("peer", "index", "sock", "sent_bytes", "recv_bytes", "local", "remote", "closed")

    def __init__(self, peer: int, index: int, sock: socket.socket):
        self.peer = peer
        self.index = index
        self.sock = sock
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.closed = False
        try:
            self.local = sock.getsockname()[0]
            self.remote = sock.getpeername()[0]
        except OSError:
            self.local = self.remote = "?"


class _Peer:
    def __init__(self, rank: int, nconns: int):
        self.rank = rank
        self.conns: list[_Conn | None] = [None] * nconns
        self.cond = threading.Condition(threading.Lock())  # guards send_queue
        self.send_queue: collections.deque = collections.deque()
        #: Sends not known to be finished (guarded by cond): a send whose last chunk a sender
        #: thread has taken has left send_queue; if that thread dies with the connection, the
        #: failure must still reach the send (finished ones are pruned now and then).
        self.sending: set = set()
        self.prune_at = 256  # len(sending) at which finished sends are dropped (amortized)
        self.failure: BaseException | None = None
        self.closes_seen = 0


class Context:
    """The connections of ``rank`` to every other rank of a group of ``size`` ranks."""

    def __init__(self, store, rank: int, size: int, options: TransportOptions | None = None,
                 opnames: dict[int, str] | None = None, label: str = "", scope: str = ""):
        self.rank = rank
        #: Every rendezvous key of this group lies under this prefix. ``scope`` names one
        #: incarnation of the job (e.g. torchrun's restart count): a store that outlives a
        #: failed attempt (torchrun keeps its TCPStore across restarts) still holds that
        #: attempt's secret and listen addresses, which must never be taken for this one's.
        self._prefix = f"{_STORE_PREFIX}{scope}/" if scope else _STORE_PREFIX
        self.size = size
        self.options = options or TransportOptions.from_env()
        #: Seconds of silence after which a peer's connections fail (LINERATE_LINK_TIMEOUT).
        self.link_timeout = self.options.link_timeout
        self.opnames = opnames or {}
        self.label = label
        self._closing = False
        #: An opaque number the user of this Context keeps (the collectives: the sequence
        #: number of the last operation entered); peers can ask for it (peer_progress).
        self.progress = 0
        self._answers: dict[int, int] = {}   # peer -> progress it answered (peer_progress)
        #: Called with each failure the group learns of (a dead peer, a peer's error report,
        #: this rank's own report), from the thread that learnt it; must not block or raise.
        self.on_failure: list = []
        self._broken: BaseException | None = None        # nothing can run any more
        self._coll_broken: BaseException | None = None   # collectives cannot run any more
        self._threads: list[threading.Thread] = []
        self._scratch = threading.local()
        rails = self.options.ifnames
        self.addresses = listen_addresses(rails, self.options.prefer_ipv6)
        self.nrails = len(self.addresses)
        if not self.options.nsocks:  # auto: resolved once the rails are known
            self.options = dataclasses.replace(
                self.options, nsocks=sockets_per_rail(0, self.nrails))
        self.nconns = self.options.nsocks * self.nrails
        self.peers: dict[int, _Peer] = {p: _Peer(p, self.nconns) for p in range(size) if p != rank}
        #: Posted and staged messages of every peer (transport/matching.py); its lock guards
        #: the matching state and the mesh's progress (_mesh_cond).
        self.matcher = Matcher(self.peers, self.options.max_unexpected_bytes, self.options.keep_bytes)
        self._lock = self.matcher.lock
        self._mesh_cond = threading.Condition(self._lock)
        #: Global rank of each group rank (for metrics labels); None: the same numbers.
        self.global_ranks: list[int] | None = None
        #: "tcp" or "rdma": what the connections are (LINERATE_TRANSPORT, agreed at rendezvous).
        self.transport = "tcp"
        #: The group's shared-memory segment (transport/shm.py), or None.
        self.shm = None
        #: LINERATE_TLS: the group's TLS contexts (transport/tls.py), or None (plain TCP).
        self._tls: tls.TlsConfig | None = None
        if size > 1:
            self._build_mesh(store)
        metrics.track(self)

    # ------------------------------------------------------------------ set-up
    def _build_mesh(self, store) -> None:
        """Rendezvous and connect. A rank that fails here tells the others through the store,
        so that they fail at once with its message instead of waiting for it until
        LINERATE_CONNECT_TIMEOUT (or the store's own timeout)."""
        deadline = time.monotonic() + self.options.connect_timeout
        rv = self._rv = rendezvous.Rendezvous(store, self.rank, deadline,
                                              self.options.connect_timeout, self._prefix)
        try:
            self._build_mesh_on(rv, deadline)
            # Ranks of one host that can map one segment share memory (transport/shm.py).
            self.shm = shm.establish(rv, self.rank, self.size, self._secret, self.options.shm,
                                     self._prefix, rv.generation)
        except BaseException as e:
            if not isinstance(e, rendezvous.PeerSetupFailed):
                rv.report(f"rank {self.rank}: {e}")
            raise

    def _build_mesh_on(self, store: rendezvous.Rendezvous, deadline: float) -> None:
        opts = self.options
        pre = self._prefix
        self._secret = store.agree(rendezvous.agreed_settings(self.options, self.nrails))
        if opts.tls:  # agreed above: every rank has it on
            if opts.transport == "rdma":
                raise ValueError(f"rank {self.rank}: LINERATE_TLS=1 with LINERATE_TRANSPORT=rdma: "
                                 f"the RDMA transport cannot encrypt (TLS runs over TCP only); "
                                 f"use LINERATE_TRANSPORT=tcp or turn LINERATE_TLS off")
            if opts.transport == "auto":  # TLS needs TCP: auto means TCP here, on every rank
                opts = dataclasses.replace(opts, transport="tcp")
            self._tls = tls.load(True, opts.tls_cert, opts.tls_key, opts.tls_ca)
        kinds = rendezvous.choose_links(store, self.rank, self.size, opts)
        self.transport = kinds[next(iter(kinds))] if kinds else "tcp"
        if self.transport == "rdma":  # RC queue pairs as the connections (transport/rdma.py)
            rdma.build_mesh(self, store, deadline, pre)
            return
        listeners = []
        for addr in self.addresses:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            ls = socket.socket(family, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((addr, 0))
            ls.listen(max(128, self.size * self.nconns))
            listeners.append(ls)
        self._listeners = listeners
        published = [[addr, ls.getsockname()[1]] for addr, ls in zip(self.addresses, listeners)]
        store.publish_addresses(published)
        for ls in listeners:
            self._spawn(self._accept_loop, ls, name="linerate-accept")
        # Each rank connects to the lower ranks and accepts from the higher ones.
        for peer in range(self.rank):
            remote = store.addresses_of(peer, self.nrails)
            for rail in range(self.nrails):
                for k in range(opts.nsocks):
                    index = rail * opts.nsocks + k
                    sock = self._connect(peer, remote[rail], self.addresses[rail], index, deadline)
                    self._add_conn(peer, index, sock)
        with self._mesh_cond:
            while not self._mesh_complete():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(p.rank for p in self.peers.values() if None in p.conns)
                    refused = self._tls.last_refusal if self._tls is not None else None
                    raise TransportError(
                        f"rank {self.rank}: connections from ranks {missing} did not arrive within "
                        f"{opts.connect_timeout:.0f}s (LINERATE_CONNECT_TIMEOUT); are all ranks "
                        f"started and is their address reachable?"
                        + (f" (LINERATE_TLS: the last TLS handshake refused here: {refused})"
                           if refused else ""))
                self._mesh_cond.wait(min(left, 0.05))
                store.raise_if_failed("while waiting for connections")
        for ls in listeners:  # mesh complete: nobody else may connect
            try:
                ls.close()
            except OSError:
                pass
        log.debug("rank %d: mesh of %d ranks x %d connections ready", self.rank, self.size, self.nconns)

    def _use_rails(self, nrails: int) -> None:
        """Another transport's number of rails (RDMA: ports), before any connection exists."""
        self.nrails = nrails
        self.nconns = self.options.nsocks * nrails
        self.peers = {p: _Peer(p, self.nconns) for p in self.peers}

    def _mesh_complete(self) -> bool:
        return all(None not in p.conns for p in self.peers.values())

    def _connect(self, peer: int, remote, local_addr: str, index: int, deadline: float) -> socket.socket:
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
                _tune(sock, self.link_timeout)
                if self._tls is not None:  # TLS first; linerate's handshake runs inside it
                    sock = self._tls.wrap(sock, False, f"rank {peer} ({host}:{port})")
                handshake.connect_side(sock, self._secret, self.rank, peer, index, self.nconns)
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
                rv = getattr(self, "_rv", None)
                if rv is not None:
                    rv.raise_if_failed(f"while connecting to rank {peer}")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _accept_loop(self, ls: socket.socket) -> None:
        while True:
            with self._lock:
                if self._closing or self._mesh_complete():
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
            self._spawn(self._accept_one, sock, addr, name="linerate-handshake")

    def _accept_one(self, sock: socket.socket, addr) -> None:
        try:
            sock.settimeout(min(10.0, self.options.connect_timeout))
            _tune(sock, self.link_timeout)
            if self._tls is not None:  # TLS first; linerate's handshake runs inside it
                sock = self._tls.wrap(sock, True, f"the connection from {tls.peer_label(addr)}")
            peer, index = handshake.accept_side(sock, self._secret, self.rank, self.size, self.nconns)
            if peer < self.rank:
                raise handshake.HandshakeError(f"rank {peer} connected, but lower ranks are connected to")
            sock.settimeout(None)
            self._add_conn(peer, index, sock)
        except (OSError, handshake.HandshakeError, TransportError) as e:
            log.warning("rank %d: dropped connection from %s: %s", self.rank, addr, e)
            try:
                sock.close()
            except OSError:
                pass

    def _add_conn(self, peer: int, index: int, sock: socket.socket) -> None:
        p = self.peers[peer]
        conn = _Conn(peer, index, sock)
        with self._mesh_cond:
            if p.conns[index] is not None:
                raise handshake.HandshakeError(f"duplicate connection {index} from rank {peer}")
            p.conns[index] = conn
            self._mesh_cond.notify_all()
        self._spawn(self._recv_loop, p, conn, name=f"linerate-recv-{peer}.{index}")
        self._spawn(self._send_loop, p, conn, name=f"linerate-send-{peer}.{index}")

    def _spawn(self, fn, *args, name: str) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # ------------------------------------------------------------------ posting
    def isend(self, peer: int, buf: memoryview, channel: int, tag: int, opcode: int = 0,
              desc: str = "", slot: int | None = None, call: int = 0,
              priority: int = 0) -> Request:
        """Send the bytes of ``buf`` to ``peer``; the buffer must stay untouched until done.

        ``slot`` names the message within its (channel, tag): the receive with the same slot
        gets it, whatever order either side posts in. Without a slot, messages on one
        (peer, channel, tag) match in posting order. ``call``: a digest of the collective
        call's arguments; a receive whose digest differs fails with a MismatchError.
        ``priority``: lower goes first. The connections to a peer take their next chunk from
        the most urgent queued message, so a message overtakes less urgent ones already
        queued, chunk by chunk (equal priorities: posting order)."""
        req = Request(True, peer, buf, channel, tag, opcode, desc)
        req.call = call
        req.priority = priority
        p = self._peer(peer)
        chunk = self.options.chunk_bytes
        req.chunks_left = max(1, -(-req.total // chunk))
        with self._lock:
            err = self._refusal(channel) or p.failure
            if err is None:
                req.msgno = slot if slot is not None else self.matcher.next_send(peer, channel, tag)
        if err is not None:
            req._finish(_wrap(err))
            return req
        with p.cond:
            q = p.send_queue
            if not q or priority >= getattr(q[-1], "priority", priority):
                q.append(req)
            else:  # behind the last message at least as urgent (control frames stay first)
                i = len(q) - 1
                while i > 0 and getattr(q[i - 1], "priority", priority) > priority:
                    i -= 1
                q.insert(i, req)
            if len(p.sending) >= p.prune_at:
                p.sending = {r for r in p.sending if not r.is_completed()}
                p.prune_at = max(256, 2 * len(p.sending))
            p.sending.add(req)
            p.cond.notify()
        return req

    def irecv(self, peer: int | None, buf: memoryview, channel: int, tag: int, opcode: int = 0,
              desc: str = "", slot: int | None = None, call: int = 0) -> Request:
        """Receive a message of exactly ``buf.nbytes`` bytes from ``peer`` (None: any rank,
        point-to-point only) into ``buf``."""
        if peer is None and (channel != CHANNEL_P2P or slot is not None):
            raise ValueError("receive from any source is point-to-point only, without a slot")
        req = Request(False, peer, buf, channel, tag, opcode, desc)
        req.call = call
        if peer is not None:
            self._peer(peer)
        staged = None
        m = self.matcher
        with self._lock:
            err = self._refusal(channel)
            if err is None:
                try:
                    if peer is None:
                        failed = {r for r, q in self.peers.items() if q.failure is not None}
                        staged = m.post_anysource(req, failed)
                        if staged is False:
                            staged = None
                            err = TransportError("receive from any source: every peer has failed "
                                                 "or closed")
                    else:
                        staged = m.post(req, slot, self.peers[peer].failure is not None)
                except ValueError as e:
                    raise ValueError(f"rank {self.rank}: {e}") from None
                if req.error is True:  # the peer failed: nothing more will come from it
                    req.error = None
                    err = self.peers[req.peer].failure
        if err is not None:
            if staged is not None:
                with self._lock:
                    m.forget(staged)
            req._finish(_wrap(err))
        elif staged is not None:
            self._deliver_staged(staged, req)
        return req

    def begin_call(self, tag: int, call: int, desc: str) -> None:
        """A collective starts: messages of op ``tag`` whose call digest differs from ``call``
        (already here, or arriving while it runs, whoever they are for) are a mismatch,
        reported to every rank. It catches ranks that receive nothing the others send (a
        different root)."""
        with self._lock:
            bad = self.matcher.begin_call(tag, call, desc)
        if bad is not None:
            self.report_error(self._describe(bad))

    def end_call(self, tag: int) -> None:
        with self._lock:
            self.matcher.end_call(tag)

    def _describe(self, m: Mismatch) -> str:
        """The words for a mismatch's facts (what users read in the MismatchError)."""
        where = self._where()
        if m.reason == "call":
            theirs = self._opname(m.their_opcode)
            if not m.my_desc.startswith(theirs + " "):
                return (f"rank {self.rank}: rank {m.peer} is in {theirs} #{m.their_tag} while rank "
                        f"{self.rank} called {m.my_desc}: the ranks called different "
                        f"collectives{where}")
            return (f"rank {self.rank}: rank {m.peer} called {theirs} #{m.their_tag} with other "
                    f"arguments (dtype, size, reduce op or root) than rank {self.rank}, which called "
                    f"{m.my_desc}{where}")
        if m.reason == "op":
            return (f"rank {m.peer} is in {self._opname(m.their_opcode)} (op #{m.their_tag}, "
                    f"{m.their_total} bytes) while rank {self.rank} is in "
                    f"{self._opname(m.my_opcode)} (op #{m.my_tag}, {m.my_total} bytes): the ranks "
                    f"called different collectives{where}")
        if m.reason == "digest":
            return (f"rank {m.peer} called {self._opname(m.their_opcode)} #{m.their_tag} with other "
                    f"arguments (dtype, size, reduce op or root) than rank {self.rank}, which called "
                    f"{m.my_desc}{where}")
        coll = m.channel == CHANNEL_COLLECTIVE
        what = self._opname(m.my_opcode) if coll else f"recv (tag {m.my_tag})"
        return (f"rank {m.peer} sent {m.their_total} bytes but rank {self.rank} expects "
                f"{m.my_total} bytes in {what}{' op #' + str(m.my_tag) if coll else ''}: the ranks "
                f"passed tensors of different sizes or dtypes{where}")

    def _refusal(self, channel: int):
        """Why a new transfer on ``channel`` cannot start (None if it can)."""
        if self._broken is not None:
            return self._broken
        if channel == CHANNEL_COLLECTIVE:
            return self._coll_broken
        return None

    def _deliver_staged(self, staged: _Staged, req: Request) -> None:
        if req.error is not None:
            err, req.error = req.error, None
            with self._lock:
                self.matcher.forget(staged)
            if isinstance(err, Mismatch):
                self._on_mismatch(req, MismatchError(self._describe(err)))
            else:
                req._finish(_wrap(self.peers[req.peer].failure or err))
            return
        self.matcher.deliver(staged, req)  # numpy copies without holding the GIL
        req._finish()

    def staged_collectives(self, peer: int) -> list[tuple[int, str]]:
        """(op sequence number, op name) of collective messages from ``peer`` that arrived and
        wait for a receive: after a timeout they show which op the peer is in."""
        self._peer(peer)
        with self._lock:
            seen = {(tag, self._opname(op)) for ch, tag, op in self.matcher.staged_for(peer)
                    if ch == CHANNEL_COLLECTIVE}
        return sorted(seen)

    def _opname(self, opcode: int) -> str:
        return self.opnames.get(opcode, f"op {opcode}")

    def _where(self) -> str:
        return f" (group {self.label})" if self.label else ""

    def _peer(self, peer: int) -> _Peer:
        try:
            return self.peers[peer]
        except KeyError:
            raise ValueError(f"invalid peer rank {peer} for rank {self.rank} in a group of "
                             f"{self.size}") from None

    # ------------------------------------------------------------------ threads
    def _send_loop(self, p: _Peer, conn: _Conn) -> None:
        sock = conn.sock
        credit = self.options.credit_bytes
        if credit and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            # The credit window: at most this much not-yet-sent data waits in the kernel's
            # (FIFO) buffer, so a more urgent message queued here overtakes the rest.
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT,
                                max(16 << 10, credit // self.nconns))
            except (OSError, AttributeError) as e:  # not a TCP socket (RDMA stream)
                log.debug("rank %d: no credit window on connection %d to rank %d: %s",
                          self.rank, conn.index, p.rank, e)
        chunk = self.options.chunk_bytes
        pack = framing.HEADER.pack
        checksum = self.options.checksum
        try:
            while True:
                with p.cond:
                    while not p.send_queue:
                        if self._closing or conn.closed:
                            raise _Closing
                        p.cond.wait()
                    req = p.send_queue[0]
                    if isinstance(req, tuple):  # a control frame (kind, payload[, tag])
                        p.send_queue.popleft()
                        kind, payload, ctag = req if len(req) == 3 else (*req, 0)
                        req = None
                    else:
                        off = req.next_off
                        n = min(chunk, req.total - off)
                        buf = req.buf  # once, here: a failure elsewhere may clear it
                        req.next_off = off + n
                        if req.next_off >= req.total:
                            p.send_queue.popleft()
                        if p.send_queue:
                            p.cond.notify()  # more chunks: another connection takes the next
                if req is None:
                    sock.sendall(pack(kind, 0, 0, len(payload), ctag, 0, len(payload), 0, 0) + payload)
                    continue
                if req.error is not None or buf is None:
                    continue  # failed while queued: drop the rest
                hdr = pack(KIND_DATA, req.opcode, req.channel, n, req.tag, req.msgno, req.total, off,
                           req.call)
                if n:
                    data = buf[off:off + n]
                    sent = sock.sendmsg((hdr, data))
                    if sent < framing.HEADER_SIZE:
                        sock.sendall(hdr[sent:])
                        sock.sendall(data)
                    elif sent < framing.HEADER_SIZE + n:
                        sock.sendall(data[sent - framing.HEADER_SIZE:])
                    if checksum:
                        sock.sendall(_CRC.pack(zlib.crc32(data)))
                else:
                    sock.sendall(hdr)
                conn.sent_bytes += n
                with self._lock:
                    req.chunks_left -= 1
                    done = req.chunks_left == 0
                if done:
                    req._finish()
        except _Closing:
            try:
                sock.sendall(framing.pack_header(KIND_CLOSE, 0, 0, 0, 0, 0, 0, 0))
            except OSError:
                pass
        except OSError as e:
            if not self._closing:
                self._fail_peer(p, PeerFailure(p.rank, f"rank {self.rank}: sending to rank {p.rank} "
                                                f"failed ({e}); did rank {p.rank} exit or crash?"))

    def _recv_loop(self, p: _Peer, conn: _Conn) -> None:
        sock = conn.sock
        hbuf = bytearray(framing.HEADER_SIZE)
        hview = memoryview(hbuf)
        max_chunk = max(self.options.chunk_bytes, 1 << 24)  # peers may run another chunk size
        unpack = framing.unpack_header
        checksum = self.options.checksum
        cbuf = bytearray(_CRC.size)
        try:
            while True:
                if not _recv_into(sock, hview, framing.HEADER_SIZE):
                    raise _PeerEOF
                kind, opcode, channel, length, tag, msgno, total, off, call = unpack(hbuf, max_chunk)
                if kind == KIND_DATA:
                    with self._lock:
                        target, mismatch = self.matcher.incoming(p.rank, opcode, channel, tag,
                                                                 msgno, total, call)
                        buf = None if target is None else target.buf
                        dest = buf[off:off + length] if buf is not None and length else None
                    if mismatch is not None:
                        self._on_mismatch(mismatch[0], MismatchError(self._describe(mismatch[1])))
                    if buf is None:  # mismatched or failed receive: drain and drop
                        target = None
                        dest = self._discard(length)
                    if length and not _recv_into(sock, dest, length):
                        raise _PeerEOF
                    if checksum and length:
                        if not _recv_into(sock, memoryview(cbuf), _CRC.size):
                            raise _PeerEOF
                        if _CRC.unpack(cbuf)[0] != zlib.crc32(dest):
                            raise framing.FrameError(
                                f"checksum mismatch in bytes [{off}, {off + length}) of a "
                                f"{total}-byte message (tag {tag}): the data was corrupted on the "
                                f"way (LINERATE_CHECKSUM)")
                    conn.recv_bytes += length
                    if target is not None:
                        self._chunk_arrived(p, target, channel, tag, msgno, length)
                elif kind == KIND_ERROR:
                    text = bytearray(length)
                    if length and not _recv_into(sock, memoryview(text), length):
                        raise _PeerEOF
                    msg = bytes(text).decode("utf-8", "replace")
                    self._set_broken(TransportError(f"rank {p.rank} reported an error: {msg}"),
                                     only_collective=True)
                elif kind == KIND_QUERY:  # answered at once, whatever this rank is doing
                    with p.cond:
                        if p.failure is None:
                            p.send_queue.appendleft((KIND_PROGRESS, b"", self.progress))
                            p.cond.notify()
                elif kind == KIND_PROGRESS:
                    with self._mesh_cond:
                        self._answers[p.rank] = tag
                        self._mesh_cond.notify_all()
                else:  # CLOSE
                    conn.closed = True
                    with self._lock:
                        p.closes_seen += 1
                        all_closed = p.closes_seen == self.nconns
                    if all_closed:
                        self._fail_peer(p, PeerFailure(p.rank, f"rank {p.rank} closed its process group "
                                                       f"while rank {self.rank} still expects data from it"),
                                        break_group=False)
                    with p.cond:
                        p.cond.notify_all()
                    return
        except _PeerEOF:
            if not self._closing:
                self._fail_peer(p, PeerFailure(p.rank, f"rank {self.rank}: connection {conn.index} to "
                                                f"rank {p.rank} ({conn.remote}) closed unexpectedly: "
                                                f"rank {p.rank} exited or crashed"))
        except framing.FrameError as e:
            self._fail_peer(p, PeerFailure(p.rank, f"rank {self.rank}: protocol error from rank "
                                            f"{p.rank}: {e}"))
        except OSError as e:
            if not self._closing:
                self._fail_peer(p, PeerFailure(p.rank, f"rank {self.rank}: connection to rank {p.rank} "
                                                f"failed: {e}; rank {p.rank} exited, crashed or its "
                                                f"link is down"))

    def _on_mismatch(self, req: Request | None, err: BaseException) -> None:
        if req is not None:
            req._finish(err)
        if req is None or req.channel == CHANNEL_COLLECTIVE:
            self.report_error(str(err))

    def _chunk_arrived(self, p: _Peer, target, channel, tag, msgno, length) -> None:
        with self._lock:
            done = self.matcher.arrived(p.rank, target, channel, tag, msgno, length)
        if done is None:
            return
        if isinstance(done, tuple):
            self._deliver_staged(*done)
        else:
            done._finish()

    def _discard(self, n: int) -> memoryview:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = memoryview(bytearray(max(n, 1 << 16)))
        return buf[:n]

    # ------------------------------------------------------------------ failures
    def _fail_peer(self, p: _Peer, err: BaseException, break_group: bool = True) -> None:
        """Fail every transfer with peer p. ``break_group``: p crashed, so no collective of the
        group can complete: fail the others' pending collective transfers too (fail fast).
        A peer that closed in order may simply have finished before us: only transfers that
        involve it fail. While this rank closes (close(), abort()), what was pending fails
        with the close's own reason: a peer answering our CLOSE frames is not the cause."""
        closing = self._closing
        if closing:
            err = self._close_error
        with self._lock:
            first = p.failure is None
            if first:
                p.failure = err
            failed = self.matcher.take_peer(
                p.rank, all(q.failure is not None for q in self.peers.values()))
        with p.cond:
            failed.extend(r for r in p.send_queue if isinstance(r, Request))
            if break_group or closing:
                # Mid-send when the connection died: its sender thread may be gone. A peer that
                # closed in order still reads what is under way: those sends end by themselves.
                failed.extend(r for r in p.sending if not r.is_completed())
                p.sending = set()
            p.send_queue.clear()
            p.cond.notify_all()
        # Requests taken out of the maps above must be finished whatever happens: a waiter
        # of one that is dropped here waits forever (abort() left collectives hanging so).
        if failed and not closing:
            log.error("%s", err)
        for r in failed:
            r._finish(_wrap(err))
        if break_group and not closing:
            self._set_broken(err, only_collective=True)
            if first:
                # Tell the others why (an ERROR frame goes before this rank's CLOSE frames):
                # a rank that has not yet seen p die must not take our closing, once we give
                # up, for the cause ("rank 1 closed its process group ...").
                payload = str(err).encode("utf-8", "replace")[: framing.MAX_ERROR_BYTES]
                for q in self.peers.values():
                    if q is not p:
                        with q.cond:
                            if q.failure is None:
                                q.send_queue.appendleft((KIND_ERROR, payload))
                                q.cond.notify()

    def _set_broken(self, err: BaseException, only_collective: bool = False) -> None:
        """Fail pending transfers (collective ones, or all) and refuse new ones of that kind."""
        failed = []
        with self._lock:
            if only_collective:
                self._coll_broken = self._coll_broken or err
            else:
                self._broken = self._broken or err
            failed = self.matcher.take_channel(CHANNEL_COLLECTIVE if only_collective else None)
        # Sends too: an algorithm waiting on a send must see this reason, not whatever ends
        # that send later (e.g. the peer closing once it failed for the same reason).
        for p in self.peers.values():
            with p.cond:
                hit = [r for r in p.send_queue if isinstance(r, Request)
                       and (not only_collective or r.channel == CHANNEL_COLLECTIVE)]
                if hit:
                    gone = set(map(id, hit))
                    p.send_queue = collections.deque(r for r in p.send_queue if id(r) not in gone)
                failed += hit
                failed += [r for r in p.sending if not r.is_completed()
                           and (not only_collective or r.channel == CHANNEL_COLLECTIVE)]
        for r in failed:
            r._finish(_wrap(err))
        for fn in list(self.on_failure):
            try:
                fn(err)
            except Exception:  # noqa: BLE001 - never into the transport's threads
                log.exception("rank %d: a failure callback raised", self.rank)

    @property
    def broken(self) -> BaseException | None:
        """Why collectives on this context can no longer run (None while healthy)."""
        return self._broken or self._coll_broken

    def report_error(self, message: str) -> None:
        """Tell every peer that this rank failed the current collective (an ERROR frame)."""
        payload = message.encode("utf-8", "replace")[: framing.MAX_ERROR_BYTES]
        self._set_broken(TransportError(message), only_collective=True)
        for p in self.peers.values():
            with p.cond:
                if p.failure is None:
                    p.send_queue.appendleft((KIND_ERROR, payload))
                    p.cond.notify()

    def peer_progress(self, timeout: float = 1.0) -> dict[int, int | None]:
        """Ask every peer for its ``progress`` and wait up to ``timeout`` seconds for the
        answers (they come from the peers' receive threads, whatever their users are doing).
        Returns peer -> its progress, or None for a peer that failed or did not answer."""
        asked = []
        with self._mesh_cond:
            for r in self.peers:
                self._answers.pop(r, None)
        for p in self.peers.values():
            with p.cond:
                if p.failure is None and None not in p.conns:
                    p.send_queue.appendleft((KIND_QUERY, b"", 0))
                    p.cond.notify()
                    asked.append(p.rank)
        deadline = time.monotonic() + timeout
        with self._mesh_cond:
            while not all(r in self._answers for r in asked):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._mesh_cond.wait(left)
            return {r: self._answers.get(r) for r in self.peers}

    # ------------------------------------------------------------------ statistics, teardown
    def connection_stats(self) -> list[dict]:
        """Bytes moved per connection (for metrics and benchmarks)."""
        out = []
        for p in self.peers.values():
            for c in p.conns:
                if c is not None:
                    out.append({"peer": p.rank, "connection": c.index, "local": c.local,
                                "remote": c.remote, "sent_bytes": c.sent_bytes,
                                "received_bytes": c.recv_bytes})
        return out

    def close(self, timeout: float = 10.0, reason: str = "shut down") -> None:
        """Flush queued sends, tell peers (CLOSE frames), close every connection; then fail
        whatever is still pending with "the process group was <reason>".

        Queued sends get up to ``timeout`` seconds, but only while they move: a peer whose
        link is dead (nothing leaves for _STALL_S seconds) is not waited for."""
        if self._closing:
            return
        deadline = time.monotonic() + timeout
        stalled = self._drain(deadline)
        self._close_error = TransportError(f"rank {self.rank}: the process group was {reason}")
        self._closing = True
        for p in self.peers.values():
            with p.cond:
                p.cond.notify_all()
        me = threading.current_thread()
        # Senders of drained peers send CLOSE and end; a stalled peer's senders are stuck in
        # the kernel until the sockets are shut down below.
        join_until = min(deadline, time.monotonic() + _STALL_S)
        for t in self._threads:
            if (t.name.startswith("linerate-send") and t is not me
                    and _thread_peer(t.name) not in stalled):
                t.join(max(0.0, join_until - time.monotonic()))
        metrics.retire(self)  # final byte counts, before the sockets go
        if self.shm is not None:
            self.shm.close()
        for p in self.peers.values():
            for c in p.conns:
                if c is not None:
                    try:
                        c.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    c.sock.close()
        for ls in getattr(self, "_listeners", []):
            try:
                ls.close()
            except OSError:
                pass
        # The sockets are shut down, so the receivers end now: wait for them. A receiver's
        # frame may hold the last reference to a tensor (a memoryview of a receive buffer),
        # and a daemon thread that frees a tensor during interpreter finalization aborts the
        # process (torch releases the GIL in the tensor's dealloc; taking it back then calls
        # pthread_exit through noexcept C++ frames: "terminate called without an active
        # exception").
        for t in self._threads:
            if t.name.startswith("linerate-recv") and t is not me:
                t.join(max(0.5, deadline - time.monotonic()))
        join_until = time.monotonic() + 1.0  # senders end on the shut-down sockets
        for t in self._threads:
            if t.name.startswith("linerate-send") and t is not me:
                t.join(max(0.0, join_until - time.monotonic()))
        self._set_broken(self._close_error)
        for p in self.peers.values():  # sends still queued or under way will not end: fail them
            with p.cond:
                queued = [r for r in p.send_queue if isinstance(r, Request)]
                queued += [r for r in p.sending if not r.is_completed()]
                p.send_queue.clear()
                p.sending = set()
            for r in queued:
                r._finish(_wrap(self._close_error))

    def _drain(self, deadline: float) -> set:
        """Wait until the sends queued for every peer have left; return the ranks given up
        on: their sends stopped moving for _STALL_S seconds (a dead link or host), or the
        deadline passed. All peers are watched at once: N dead peers cost _STALL_S, not N times."""
        marks: dict[int, tuple] = {}
        given_up: set = set()
        while True:
            now = time.monotonic()
            waiting = False
            for p in self.peers.values():
                if p.rank in given_up:
                    continue
                with p.cond:
                    if not p.send_queue or p.failure is not None:
                        continue
                    queued = len(p.send_queue)
                    mark = (queued, getattr(p.send_queue[0], "next_off", 0),
                            sum(c.sent_bytes for c in p.conns if c is not None))
                last, since = marks.get(p.rank, (None, now))
                if mark != last:
                    marks[p.rank] = (mark, now)
                    since = now
                if now >= deadline or now - since > _STALL_S:
                    if now < deadline:
                        log.warning("rank %d: %d queued sends to rank %d did not move for %.0fs; "
                                    "closing without them", self.rank, queued, p.rank, _STALL_S)
                    given_up.add(p.rank)
                    continue
                waiting = True
            if not waiting:
                return given_up
            time.sleep(0.02)

    def unacknowledged(self, min_seconds: float = 1.0) -> dict[int, float]:
        """Peers to which data has been outstanding without any acknowledgement for at least
        ``min_seconds``: {rank: seconds}, from the kernel's TCP_INFO (for error messages: a
        host or link that is down answers nothing, while a slow peer still acknowledges)."""
        out = {}
        for p in self.peers.values():
            for c in p.conns:
                if c is None:
                    continue
                try:
                    raw = c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64)
                except OSError:
                    continue
                if len(raw) < 60:
                    continue
                unacked = int.from_bytes(raw[24:28], "little")
                silent = int.from_bytes(raw[56:60], "little") / 1000.0  # tcpi_last_ack_recv
                if unacked and silent >= min_seconds:
                    out[p.rank] = max(out.get(p.rank, 0.0), silent)
        return out


class _Closing(Exception):
    pass


class _PeerEOF(Exception):
    pass


_CRC = struct.Struct("<I")  # LINERATE_CHECKSUM: CRC-32 of a chunk's payload, after it


def _wrap(err: BaseException) -> BaseException:
    if isinstance(err, TransportError):
        return type(err)(*err.args) if not isinstance(err, PeerFailure) else PeerFailure(err.peer, str(err))
    return TransportError(str(err))


def _recv_into(sock: socket.socket, view: memoryview, n: int) -> bool:
    """Fill view[:n]; False on end of stream. MSG_WAITALL lets the kernel fill the whole
    chunk in one call: one system call and one GIL hand-off per chunk instead of dozens."""
    got = sock.recv_into(view, n, socket.MSG_WAITALL)
    while got < n:
        if got == 0:
            return False
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            return False
        got += k
    return True


def _tune(sock: socket.socket, link_timeout: float = LINK_TIMEOUT_DEFAULT) -> None:
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


def link_timeout_from_env(env=None) -> float:
    """LINERATE_LINK_TIMEOUT (TransportOptions.link_timeout): seconds a peer may acknowledge
    nothing before its connections fail (0: the kernel's defaults). A bad value raises a
    ValueError naming the variable."""
    from linerate import settings
    text = settings.raw("LINERATE_LINK_TIMEOUT", env)
    if not (text or "").strip():
        return LINK_TIMEOUT_DEFAULT
    return settings.parse("LINERATE_LINK_TIMEOUT", text)


def _thread_peer(name: str) -> int | None:
    """The peer rank in a transport thread's name (linerate-send-<peer>.<connection>)."""
    try:
        return int(name.rsplit("-", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return None
