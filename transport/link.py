"""The link interface: how a transport Context moves bytes to and from one peer.

This docstring is the specification every link kind implements (``tcp``: transport/tcp.py,
``rdma``: transport/rdma.py, ``shm``: transport/shm/ring.py, rings in the shared segment of the
ranks of one host, transport/shm). tests/test_links.py runs one conformance suite against each kind.

A link joins this rank to one ``peer``; a Context holds one per peer. It knows messages,
never what they mean: a message is a buffer plus the header fields ``opcode``, ``channel``,
``tag``, ``msgno`` and ``digest`` (``Request.call``), carried opaquely; matching them to
receives is the Context's (transport/matching.py).

Properties
    ``kind``        "tcp", "rdma", "shm", ...: what carries the bytes.
    ``peer``        the peer's rank in the group.
    ``speed_bps``   the line rate in bits per second, or None when unknown.
    ``nstreams``    how many connections (queue pairs) the link stripes over.

Verbs (all non-blocking but ``flush_control``; none waits for the peer's process)
    ``start(sink)``
        Begin delivering what arrives to ``sink`` (a ``LinkSink``); called once.
    ``isend(req) -> bool``
        Queue the message of ``req`` (a ``request.Request``: ``buf``, ``total``, header
        fields, ``priority``). Returns False (the request untouched) when the link is down
        (failed or closed by either side): nothing was queued. Otherwise the link finishes
        the request with ``req.finish()`` once every byte was handed to the wire, or with an
        error if it cannot be; lower ``priority`` goes first, chunk by chunk.
    ``send_control(kind, payload=b"", value=0) -> bool``
        An urgent control frame (``framing.KIND_ERROR`` with UTF-8 text of at most
        ``framing.MAX_ERROR_BYTES``, ``KIND_QUERY``, ``KIND_PROGRESS`` with ``value``): ahead
        of every queued message. False when the link is down.
    ``flush_control(until) -> bool``
        The one verb that blocks (until the monotonic time ``until`` at most): wait until
        every control frame queued so far has reached the peer's side, where it stays readable
        if this process exits at once (written and acknowledged by the peer's kernel, or
        written into the shared segment). A rank that fails calls it before its user hears of
        the failure, so that its ERROR frames outlive it. True when they have; False on
        timeout or when the link is down. From a thread that writes this link's frames it
        cannot wait for them: a link returns False there at once, or writes them itself (the
        Context calls it from another thread where a sink callback runs on an I/O loop).
    ``cancel(match=None, underway=True) -> list[Request]``
        Take the queued sends (``match(req)`` true, or all) that have not begun out of the
        queue, and with ``underway`` also the sends whose chunks are on the wire but not all
        sent: the link no longer finishes them; the caller does. Without ``match``, queued
        control frames go too.
    ``drive(req, until)``, ``reclaim()``, ``lent``
        A caller's own reading (optional; by default ``drive`` returns at once): ``drive``
        reads the link in the calling thread until the receive ``req`` is finished or the
        monotonic time ``until``, delivering whatever arrives as the link's threads would;
        while ``lent`` the link's own readers wait, until ``reclaim`` (another thread waits
        for what the link receives) or the link's idle time passes.
    ``send_mark()``
        A value that changes while queued sends move, None when nothing is queued (for
        close's stall detection).
    ``unacknowledged_s()``
        Seconds the peer has acknowledged nothing while data is outstanding (0.0 when
        unknown or nothing is outstanding).
    ``stats()``
        A plain snapshot (a dict of numbers and strings, no live objects): ``kind``,
        ``peer``, ``state`` ("up", "failed", "closed"), ``speed_bps``, ``bytes_sent``,
        ``bytes_received`` (payload bytes, exactly), ``messages_sent``,
        ``messages_received``, ``queued_bytes`` (not yet handed to the wire, the kernel's
        or NIC's queue included), ``retransmits`` (or None), and ``connections``: one dict
        per stream (``index``, ``local``, ``remote``, ``device`` (an RDMA port or None),
        ``sent_bytes``, ``received_bytes``, and for a TCP connection ``tcp``: its
        ``tcp_info`` fields).
    ``begin_close()``, ``wait_sent(until)``, ``close(deadline)``
        Closing, in three steps so that a Context closes all its links at once:
        ``begin_close`` lets each stream's sender send what is queued, then a CLOSE frame,
        and end; ``wait_sent`` waits (until the monotonic time ``until``) for those senders;
        ``close`` shuts the streams down, waits for the receivers (a receiver may hold the
        last reference to a receive buffer), and releases everything. What is still queued
        after ``close`` is the caller's to ``cancel``.

Buffer ownership
    From ``isend`` until the request is finished the link owns ``req.buf``: the caller must
    not write it (the bytes may leave at any time, from several streams at once). Once
    finished (successfully or not) the link holds no reference to it and the caller may reuse
    it at once. On the receive side the link writes only into buffers that ``sink.claim``
    returns, only the range it was given, and only until it calls ``sink.filled`` for it.

Delivery (``LinkSink``, called from the link's own threads; none may block for long)
    ``claim(link, opcode, channel, tag, msgno, total, digest, offset, length)``
        A chunk of ``length`` bytes at ``offset`` of a ``total``-byte message arrives:
        returns (token, memoryview of exactly ``length`` bytes to fill) or (None, None) to
        drop the bytes. May raise ``framing.FrameError`` (the peer broke the protocol).
    ``filled(link, token, channel, tag, msgno, length)``
        Those bytes are in.
    ``control(link, kind, payload, value)``
        A control frame arrived (ERROR text, QUERY, PROGRESS).
    ``link_failed(link, error)``
        The link is down: its peer crashed or its connection broke (``error`` is a
        ``request.PeerFailure`` naming the peer), or the peer broke the protocol. May come
        more than once (from each thread of each stream that breaks; the first call's error
        is the cause); not while the link closes, except for a protocol violation.
    ``link_closed(link)``
        The peer closed its end in order (a CLOSE frame on every stream).

Failure
    After ``link_failed``/``link_closed`` the link accepts no sends; what it had queued stays
    queued until the caller cancels it. Frames of one stream arrive in order; the chunks of
    one message may come over several streams, in any order.

Every kind speaks the frames of transport/framing.py through its codec (``SendQueue``,
``FrameReader``); a kind only moves bytes. ``StreamLink`` below is the link over byte streams
(TCP, TLS, RDMA queue pairs); its streams are driven by a sender and a receiver thread each
(``ThreadedStreamLink``) or by the process's I/O loops (transport/ioloop.py
``LoopStreamLink``, LINERATE_IO), the two sharing everything but the loop.
"""
from __future__ import annotations

import abc
import contextlib
import fcntl
import logging
import select
import socket
import struct
import sys
import termios
import threading
import time

from . import framing
from .request import PeerFailure, ProtocolError, Request

log = logging.getLogger("linerate.transport")

_TIOCOUTQ = 0x5411          # bytes in a socket's send queue not yet acknowledged
_TCPI_TOTAL_RETRANS = 100   # offsets in struct tcp_info (linux/tcp.h)
_TCPI_BYTES_ACKED = 120     # u64
_TCPI_SEGS_OUT = 136
_TCPI_BUSY_TIME = 168       # u64 microseconds, the three below (rwnd, sndbuf limited) included
_TCPI_RWND_LIMITED = 176    # u64 microseconds
_TCPI_SNDBUF_LIMITED = 184  # u64 microseconds
_TCPI_BYTES_SENT = 200


class LinkSink(abc.ABC):
    """What a link delivers to (the Context). See the module docstring."""

    @abc.abstractmethod
    def claim(self, link, opcode, channel, tag, msgno, total, digest, offset, length): ...

    @abc.abstractmethod
    def filled(self, link, token, channel, tag, msgno, length) -> None: ...

    @abc.abstractmethod
    def control(self, link, kind: int, payload: bytes, value: int) -> None: ...

    @abc.abstractmethod
    def link_failed(self, link, error: BaseException) -> None: ...

    @abc.abstractmethod
    def link_closed(self, link) -> None: ...


class _Detached(LinkSink):
    """The sink of a link whose owner closed it for good (``Link.detach``): what still
    arrives is dropped, what still happens goes unheard."""

    def claim(self, link, opcode, channel, tag, msgno, total, digest, offset, length):
        return None, None

    def filled(self, link, token, channel, tag, msgno, length) -> None:
        pass

    def control(self, link, kind: int, payload: bytes, value: int) -> None:
        pass

    def link_failed(self, link, error: BaseException) -> None:
        pass

    def link_closed(self, link) -> None:
        pass


DETACHED = _Detached()


class Link(abc.ABC):
    """One peer's link. See the module docstring for the contract."""

    kind: str = "?"
    peer: int = -1
    speed_bps: int | None = None

    @property
    @abc.abstractmethod
    def nstreams(self) -> int: ...

    @abc.abstractmethod
    def start(self, sink: LinkSink) -> None: ...

    @abc.abstractmethod
    def isend(self, req: Request) -> bool: ...

    def isend_now(self, req: Request) -> bool:
        """isend, from a caller that holds no lock of the transport's: a link may then write
        a small message itself where its connection is idle (no hand-off to an I/O thread).
        By default the same as isend."""
        return self.isend(req)

    #: Whether a caller's ``drive`` holds the link's reading (its receivers wait).
    lent: bool = False

    def drive(self, req: Request, until: float, spin: float = 0.0, also=()) -> None:
        """Read this link in the calling thread until ``req`` (a receive from the peer) is
        finished, or until the monotonic time ``until``, where the link allows it (no
        hand-off from a receiver thread); whatever else arrives meanwhile is delivered as
        the link's threads would. ``spin``: seconds it looks without sleeping before it
        waits for bytes asleep (the caller's rank has a core of its own). ``also``: links to
        other peers whose small messages the caller awaits too; those of this link's kind
        that allow it are read in the same loop, each message as it comes (a group that
        times each peer's arrival: collectives/straggler.py). Returns at once where it does
        not: the caller then waits on ``req`` as usual. By default it does not."""

    def reclaim(self) -> None:
        """Another thread waits for what this link receives: its own readers read again
        (after ``drive``). By default nothing to do."""

    @abc.abstractmethod
    def send_control(self, kind: int, payload: bytes = b"", value: int = 0) -> bool: ...

    @abc.abstractmethod
    def flush_control(self, until: float) -> bool: ...

    @abc.abstractmethod
    def cancel(self, match=None, underway: bool = True) -> list: ...

    @abc.abstractmethod
    def send_mark(self): ...

    @abc.abstractmethod
    def unacknowledged_s(self) -> float: ...

    @abc.abstractmethod
    def stats(self) -> dict: ...

    @abc.abstractmethod
    def begin_close(self) -> None: ...

    @abc.abstractmethod
    def wait_sent(self, until: float) -> None: ...

    @abc.abstractmethod
    def close(self, deadline: float) -> None: ...

    def detach(self) -> None:
        """After ``close``: let go of the sink (its owner holds this link: the cycle would
        wait for the garbage collector, and with it the owner's buffers); whatever a thread of
        the link still delivers is dropped (``DETACHED``)."""
        self._sink = DETACHED


#: flush_control gives up on a peer that has acknowledged nothing for this long while data
#: to it is outstanding.
FLUSH_GIVE_UP_S = 0.2


# ----------------------------------------------------------------------------- streams
class Stream:
    """One connection of a StreamLink: a socket, or what offers the calls a driver makes on
    one (sendmsg, recv_into, shutdown, close, getsockname, getpeername, setsockopt), and its
    receiving state (``reader``, framing.FrameReader)."""

    __slots__ = ("index", "sock", "reader", "sent_bytes", "local", "remote", "closed", "device",
                 "direct", "idle", "writer", "pending", "rlock")

    def __init__(self, index: int, sock, reader: framing.FrameReader):
        self.index = index
        self.sock = sock
        self.reader = reader
        self.sent_bytes = 0
        self.closed = False  # the peer's CLOSE frame arrived on it
        # A caller's own write (ThreadedStreamLink.isend_now): whether the stream allows one (a
        # plain blocking socket), whether its sender waits for work, whether a caller writes
        # on it now, and what of a caller's frame the socket did not take (its sender's next).
        self.direct = False
        self.idle = False
        self.writer = False
        self.pending = None
        # A caller's own reading (ThreadedStreamLink.drive): the lock of whoever reads the
        # stream now.
        self.rlock = threading.Lock()
        port = getattr(sock, "interface", None)   # an RDMA stream: its device:port
        self.device = port if isinstance(port, str) else None
        try:
            self.local = sock.getsockname()[0]
            self.remote = sock.getpeername()[0]
        except OSError:
            self.local = self.remote = "?"


def advance(out: list, sent: int) -> None:
    """Drop the first ``sent`` bytes of the buffers ``out`` (what one sendmsg wrote)."""
    while sent:
        k = len(out[0])
        if sent >= k:
            sent -= k
            del out[0]
        else:
            out[0] = memoryview(out[0])[sent:]
            sent = 0
    if out and len(out[0]) == 0:
        del out[0]


class StreamLink(Link):
    """A link over ``len(socks)`` byte streams to one peer, all used at once: the striping,
    the state and the words of its failures, whoever drives the streams (a subclass: the
    ``start``, ``_wake``, ``_wake_all``, ``wait_sent`` and ``close`` of its I/O model).

    Each message is cut into ``chunk_bytes`` chunks; a stream that is free takes the next
    chunk of the most urgent queued message (framing.SendQueue), so the chunks of one message
    go out on all streams (and all rails) at once, and a slow stream simply takes fewer. A
    stream's reader (framing.FrameReader) asks the sink where a payload goes and the bytes are
    read straight there (``recv_into`` a memoryview of the receive buffer: no copy).
    ``checksum``: a CRC-32 follows every chunk's payload and is checked on receipt.
    ``credit_bytes``: the most not-yet-sent bytes the kernel may hold per link
    (TCP_NOTSENT_LOWAT), so urgent messages overtake."""

    _stream_type = Stream

    def __init__(self, peer: int, socks: list, *, rank: int, chunk_bytes: int,
                 checksum: bool = False, credit_bytes: int = 0, speed_bps: int | None = None):
        self.peer = peer
        self.rank = rank
        self.speed_bps = speed_bps
        self._credit = credit_bytes
        max_chunk = max(chunk_bytes, 1 << 24)  # peers may run another chunk size
        self._streams = [self._stream_type(i, s, framing.FrameReader(max_chunk, checksum))
                         for i, s in enumerate(socks)]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the queue and the state
        self._queue = framing.SendQueue(chunk_bytes, checksum)
        self._done_lock = self._queue.lock  # held while a written frame is counted
        self._closing = False
        self._down: str | None = None   # "failed" or "closed"
        self._closes_seen = 0
        self._sink: LinkSink | None = None

    # ------------------------------------------------------------------ the I/O model's
    # What each driver (ThreadedStreamLink below, ioloop.LoopStreamLink) says for itself.
    @abc.abstractmethod
    def _wake(self) -> None:
        """(under _cond) Something was queued: one stream should look."""

    @abc.abstractmethod
    def _wake_all(self) -> None:
        """(under _cond) Every stream should look (the link closes, or a stream's peer did)."""

    # ------------------------------------------------------------------ Link
    @property
    def nstreams(self) -> int:
        return len(self._streams)

    def isend(self, req: Request) -> bool:
        with self._cond:
            if self._down is not None or self._closing:
                return False
            self._queue.put(req)
            self._wake()
        return True

    def send_control(self, kind: int, payload: bytes = b"", value: int = 0) -> bool:
        with self._cond:
            if self._down is not None:
                return False
            self._queue.put_control(kind, payload, value)
            self._wake()
        return True

    def cancel(self, match=None, underway: bool = True) -> list:
        with self._cond:
            return self._queue.cancel(match, underway)

    def send_mark(self):
        with self._cond:
            return self._queue.mark()

    def unacknowledged_s(self) -> float:
        worst = 0.0
        for st in self._streams:
            try:
                raw = st.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64)
            except (OSError, AttributeError, TypeError):
                continue
            if not isinstance(raw, (bytes, bytearray)) or len(raw) < 60:
                continue
            unacked = int.from_bytes(raw[24:28], "little")
            silent = int.from_bytes(raw[56:60], "little") / 1000.0  # tcpi_last_ack_recv
            if unacked:
                worst = max(worst, silent)
        return worst

    def stats(self) -> dict:
        conns, retrans, kq = [], None, 0
        for st in self._streams:
            conns.append({"index": st.index, "local": st.local, "remote": st.remote,
                          "device": st.device, "sent_bytes": st.sent_bytes,
                          "received_bytes": st.reader.bytes})
            info = tcp_info(st.sock)
            if info is not None:
                retrans = (retrans or 0) + info["total_retrans"]
                conns[-1]["tcp"] = info
            kq += kernel_queued(st.sock)
        with self._cond:
            queued = self._queue.queued_bytes()
            state = self._down or ("closed" if self._closing else "up")
        return {"kind": self.kind, "peer": self.peer, "state": state, "speed_bps": self.speed_bps,
                "bytes_sent": sum(c["sent_bytes"] for c in conns),
                "bytes_received": sum(c["received_bytes"] for c in conns),
                "messages_sent": self._queue.messages,
                "messages_received": sum(st.reader.messages for st in self._streams),
                "queued_bytes": queued + kq, "retransmits": retrans, "connections": conns}

    def begin_close(self) -> None:
        with self._cond:
            self._closing = True
            self._wake_all()

    def flush_control(self, until: float) -> bool:
        # Polls (a failure path, rare): written by a stream, then acknowledged by the peer's
        # kernel. A peer that has acknowledged nothing for a while (its host or link down)
        # would not get the frames in time anyway: given up on at once.
        while True:
            with self._cond:
                if self._down is not None:
                    return False
            if self._queue.controls <= 0 and not any(_unsent(st.sock) for st in self._streams):
                return True
            if time.monotonic() >= until or self.unacknowledged_s() > FLUSH_GIVE_UP_S:
                return False
            time.sleep(0.001)

    # ------------------------------------------------------------------ for the drivers
    def _credit_window(self, st: Stream) -> None:
        """The credit window: at most this much not-yet-sent data waits in the kernel's (FIFO)
        buffer, so a more urgent message queued here overtakes the rest."""
        if self._credit and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            try:
                st.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT,
                                   max(16 << 10, self._credit // len(self._streams)))
            except (OSError, AttributeError) as e:  # not a TCP socket (RDMA stream)
                log.debug("rank %d: no credit window on connection %d to rank %d: %s",
                          self.rank, st.index, self.peer, e)

    def _take(self, st: Stream):
        """(under _cond) ``st``'s next frame, (request or None, buffers, payload bytes); the
        CLOSE frame (payload bytes -1) once nothing is queued and the link closes or the peer
        closed ``st``; None: nothing to send now."""
        frame = self._queue.take()
        if frame is not None:
            if len(self._queue):
                self._wake()  # more: another stream takes the next
            return frame
        if self._closing or st.closed:
            return None, [framing.CLOSE_FRAME], -1
        return None

    def _written(self, st: Stream, req: Request | None, n: int) -> None:
        """A frame of ``_take`` is in the stream."""
        st.sent_bytes += n
        if self._queue.written(req, n):
            req.finish()

    def _peer_closed(self, st: Stream) -> None:
        """The peer's CLOSE frame arrived on ``st``: its answer is this side's CLOSE, once the
        queue is empty; the link is closed once every stream's came."""
        st.closed = True
        with self._cond:
            self._closes_seen += 1
            last = self._closes_seen == len(self._streams) and self._down is None
            if last:
                self._down = "closed"
            self._wake_all()
            self._cond.notify_all()
        if last and not self._closing:
            self._sink.link_closed(self)

    def _send_failed(self, st: Stream, e: OSError) -> None:
        self._fail(PeerFailure(self.peer, f"rank {self.rank}: sending to rank {self.peer} "
                                          f"failed ({e}); did rank {self.peer} exit or crash?"))

    def _recv_failed(self, st: Stream, e: BaseException | None) -> None:
        """``st`` cannot be read any more: it ended without a CLOSE frame (``e`` None), broke
        (an OSError), carried what breaks the protocol (a FrameError), or the sink raised."""
        st.reader.stop()
        if e is None:
            self._fail(PeerFailure(self.peer, f"rank {self.rank}: connection {st.index} to "
                                              f"rank {self.peer} ({st.remote}) closed unexpectedly: "
                                              f"rank {self.peer} exited or crashed"))
        elif isinstance(e, framing.FrameError):
            self._fail(ProtocolError(self.peer, f"rank {self.rank}: protocol error from rank "
                                              f"{self.peer}: {e}"), even_closing=True)
        elif isinstance(e, OSError):
            self._fail(PeerFailure(self.peer, f"rank {self.rank}: connection to rank {self.peer} "
                                              f"failed: {e}; rank {self.peer} exited, crashed or its "
                                              f"link is down"))
        else:  # a sink that raised: the link cannot go on
            log.error("rank %d: receiving from rank %d", self.rank, self.peer, exc_info=e)
            self._fail(PeerFailure(self.peer, f"rank {self.rank}: receiving from rank "
                                              f"{self.peer} failed: {e!r}"), even_closing=True)

    def _fail(self, err: BaseException, even_closing: bool = False) -> None:
        with self._cond:
            if self._closing and not even_closing:
                return
            if self._down is None:
                self._down = "failed"
            self._cond.notify_all()
        self._sink.link_failed(self, err)


class ThreadedStreamLink(StreamLink):
    """A StreamLink whose every stream has a sender and a receiver thread (LINERATE_IO=threads
    or auto, the default; TLS and RDMA streams, which block, always): the sender takes the
    next frame and writes it, the receiver reads into what its reader needs, with MSG_WAITALL
    (one system call per header or payload)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._threads: list[threading.Thread] = []
        # drive: the receivers of lent streams wait on _parked; how many callers drive now,
        # when the last one stopped, the streams' descriptors to poll.
        self._parked = threading.Condition(self._lock)
        self._drivers = 0
        self._driven_at = 0.0
        self._poller = None
        self._by_fd: dict = {}

    #: Messages of at most this many bytes, posted while the link has nothing queued, are
    #: written by the caller's thread on a stream whose sender waits (``isend_now``): a small
    #: op's message then costs no wake-up of the sender thread.
    DIRECT_BYTES = 64 << 10

    #: After a caller drove the link (``drive``), its receivers stay parked until no caller
    #: has for this long, or until another thread waits for what the link receives
    #: (``reclaim``): a caller's next small op finds them asleep. So at most this long, a
    #: control frame that arrives between a caller's ops waits to be read.
    LEND_IDLE_S = 0.05

    def start(self, sink: LinkSink) -> None:
        self._sink = sink
        for st in self._streams:
            self._credit_window(st)
            st.direct = type(st.sock) is socket.socket and st.sock.gettimeout() is None
        if all(st.direct for st in self._streams):
            self._poller = select.poll()
            for st in self._streams:
                self._poller.register(st.sock, select.POLLIN)
                self._by_fd[st.sock.fileno()] = st
        for st in self._streams:
            for fn, what in ((self._recv_loop, "recv"), (self._send_loop, "send")):
                t = threading.Thread(target=fn, args=(st,), daemon=True,
                                     name=f"linerate-{what}-{self.peer}.{st.index}")
                t.start()
                self._threads.append(t)

    def _wake(self) -> None:
        self._cond.notify()

    def _wake_all(self) -> None:
        self._cond.notify_all()
        self._parked.notify_all()  # (parked receivers look: the link may close)

    def wait_sent(self, until: float) -> None:
        self._join("linerate-send", until)

    def close(self, deadline: float) -> None:
        self.begin_close()
        for st in self._streams:
            shut_down(st.sock)
            try:
                st.sock.close()
            except OSError:
                pass
        # The streams are shut down, so the receivers end now: wait for them. A receiver's
        # frame may hold the last reference to a tensor (a memoryview of a receive buffer),
        # and a daemon thread that frees a tensor during interpreter finalization aborts the
        # process (torch releases the GIL in the tensor's dealloc; taking it back then calls
        # pthread_exit through noexcept C++ frames: "terminate called without an active
        # exception").
        self._join("linerate-recv", max(time.monotonic() + 0.5, deadline))
        self._join("linerate-send", time.monotonic() + 1.0)  # senders end on the shut streams

    def _join(self, prefix: str, until: float) -> None:
        me = threading.current_thread()
        for t in self._threads:
            if t.name.startswith(prefix) and t is not me:
                t.join(max(0.0, until - time.monotonic()))

    def isend_now(self, req: Request) -> bool:
        """isend; a message of at most DIRECT_BYTES that finds nothing queued and a stream
        whose sender waits is written here, without blocking (MSG_DONTWAIT): what the socket
        does not take at once goes on with that stream's sender."""
        with self._cond:
            if self._down is not None or self._closing:
                return False
            self._queue.put(req)
            st = None
            if req.total <= self.DIRECT_BYTES and len(self._queue) == 1:
                for s in self._streams:
                    if s.direct and s.idle and not s.writer and s.pending is None and not s.closed:
                        st = s
                        break
            if st is None:
                self._wake()
                return True
            frame = self._take(st)
            if frame is None:  # (a message finished meanwhile: nothing to write)
                return True
            st.writer = True
        sent, out, n = frame
        try:
            write_now(st.sock, out)
        except OSError as e:
            with self._cond:
                st.writer = False
                self._wake_all()
            self._send_failed(st, e)
            return True
        if not out:
            self._written(st, sent, n)
        with self._cond:
            if out:
                st.pending = (sent, out, n)
            st.writer = False
            if out or len(self._queue) or self._closing or st.closed:
                self._wake_all()  # (this stream's sender must look: notify_all)
        return True

    def _next(self, st: Stream):
        """(under _cond) The sender's next frame: the rest of a caller's, else ``_take``'s;
        None while a caller writes on the stream or nothing is there."""
        if st.writer:
            return None
        if st.pending is not None:
            frame, st.pending = st.pending, None
            return frame
        return self._take(st)

    def _send_loop(self, st: Stream) -> None:
        sock, cond, n = st.sock, self._cond, 0
        try:
            while n >= 0:
                with cond:
                    frame = self._next(st)
                    while frame is None:
                        st.idle = True
                        cond.wait()
                        st.idle = False
                        frame = self._next(st)
                req, out, n = frame
                while out:  # (sendmsg may take part of it)
                    advance(out, sock.sendmsg(out))
                if n >= 0:
                    self._written(st, req, n)
        except OSError as e:
            if n >= 0:  # (the CLOSE frame may find the stream shut)
                self._send_failed(st, e)

    # ------------------------------------------------------------------ a caller's reading
    def drive(self, req: Request, until: float, spin: float = 0.0, also=()) -> None:
        """Read the streams in the calling thread until ``req`` is finished or the monotonic
        time ``until`` (a link of plain blocking sockets, a message of at most DIRECT_BYTES,
        one caller at a time; else nothing, the receivers reading again): the receivers wait
        meanwhile (``lent``), and after it until LEND_IDLE_S passes with no caller driving
        or ``reclaim``. Whoever reads a stream holds its ``rlock`` and reads whole frames
        (``_read``); a stream's receiver that reads when a caller begins ends its frame
        first. For ``spin`` seconds it polls without sleeping (a reply that comes soon is
        read without a wake-up), then asleep in slices. The links of ``also`` that can be
        lent the same way are read in the same poll."""
        if not self._lend(req.total):
            return
        links = [self]
        for link in also:
            if isinstance(link, ThreadedStreamLink) and link is not self and link._lend(0):
                links.append(link)
        alone = len(links) == 1
        if alone:
            poller, by_fd = self._poller, self._by_fd  # fd -> stream
        else:  # one poll of every lent link's streams that have not ended: fd -> (link, stream)
            poller, by_fd = select.poll(), {}
            for link in links:
                for fd, st in link._by_fd.items():
                    if not st.reader.done:
                        poller.register(fd, select.POLLIN)
                        by_fd[fd] = (link, st)
        clock = time.monotonic
        awake = clock() + spin
        try:
            while not req.is_completed():
                now = clock()
                left = until - now
                if left <= 0:
                    return
                # (asleep in slices: a failure elsewhere may finish req without a byte here)
                for fd, _ in poller.poll(0 if now < awake else min(left, 0.05) * 1000.0):
                    link, st = (self, by_fd[fd]) if alone else by_fd[fd]
                    if not st.rlock.acquire(True, max(0.0, until - time.monotonic())):
                        return
                    try:
                        if link._read(st, until) < 0:
                            # (ended: it would poll readable at once)
                            for p in {poller, link._poller}:
                                with contextlib.suppress(KeyError):
                                    p.unregister(fd)
                    finally:
                        st.rlock.release()
        finally:
            for link in links:
                link._release()

    def _lend(self, nbytes: int) -> bool:
        """A caller begins to read the streams for a message of ``nbytes`` (see ``drive``):
        whether it may (plain blocking sockets, the link is up, no other caller reads it, the
        message is small)."""
        if self._poller is None:
            return False
        with self._lock:
            if self._down is not None or self._closing or self._drivers:
                return False
            if nbytes > self.DIRECT_BYTES:  # the receivers read it, several streams at once
                self._unlend()
                return False
            self._drivers += 1
            self.lent = True
        return True

    def _release(self) -> None:
        """The caller that lent the link stopped reading it (the receivers stay parked until
        LEND_IDLE_S passes or ``reclaim``)."""
        with self._lock:
            self._drivers -= 1
            self._driven_at = time.monotonic()

    def reclaim(self) -> None:
        with self._lock:
            self._unlend()

    def _unlend(self) -> None:
        """(under _lock) The receivers read again."""
        if self.lent:
            self.lent = False
            self._parked.notify_all()

    def _park(self, st: Stream) -> None:
        """(a receiver of a lent link) Wait while callers drive the link: until it is
        reclaimed, closes or goes down, or no caller has driven for LEND_IDLE_S."""
        with self._lock:
            while self.lent:
                if (self._closing or self._down is not None or st.reader.done
                        or (not self._drivers
                            and time.monotonic() - self._driven_at >= self.LEND_IDLE_S)):
                    self._unlend()
                    return
                self._parked.wait(self.LEND_IDLE_S)

    def _read(self, st: Stream, until: float | None, first: int = socket.MSG_DONTWAIT) -> int:
        """(holding ``st.rlock``, or the stream's receiver where no caller reads) Read ``st``
        up to the end of the frame its bytes begin, if any are there: 1 read, 0 nothing
        there, -1 the stream ended (in order or not: reported as a receiver reports it).
        ``until``: a caller's deadline, up to which the rest of a frame begun is awaited (it
        stays half read after); None: a receiver's, which waits as long as the frame takes.
        ``first``: the flags of a frame's first read (MSG_WAITALL: wait for it)."""
        reader, sock, sink = st.reader, st.sock, self._sink
        dontwait, waitall = socket.MSG_DONTWAIT, socket.MSG_WAITALL
        read = 0
        try:
            while True:
                view = reader.need()
                n = len(view)
                if not n:
                    return -1
                if reader.between:
                    if read:
                        return 1
                    try:
                        got = sock.recv_into(view, n, first)
                    except BlockingIOError:
                        return 0
                elif until is None:
                    got = sock.recv_into(view, n, waitall)
                else:
                    try:
                        got = sock.recv_into(view, n, dontwait)
                    except BlockingIOError:
                        left = until - time.monotonic()
                        if left <= 0 or not _readable(sock, left):
                            return 1
                        continue
                if not got:
                    self._recv_failed(st, None)
                    return -1
                read = 1
                if reader.advance(got, self, sink):
                    self._peer_closed(st)
                    return -1
        except Exception as e:  # noqa: BLE001 - the stream's end, reported as the link's
            self._recv_failed(st, e)
            return -1

    def _recv_loop(self, st: Stream) -> None:
        if self._poller is not None:
            self._recv_lendable(st)
            return
        # A stream that blocks (TLS, an RDMA queue pair): frame after frame, each header and
        # payload in one call (MSG_WAITALL: one GIL hand-off per chunk, not dozens).
        while self._read(st, None, socket.MSG_WAITALL) > 0:
            pass

    def _recv_lendable(self, st: Stream) -> None:
        """A receiver that callers may relieve (``drive``): it waits for bytes with poll, and
        reads a frame holding the stream's ``rlock``, unless a caller holds the reading."""
        poller = select.poll()
        poller.register(st.sock, select.POLLIN)
        rlock = st.rlock
        while True:
            if self.lent:
                self._park(st)
                continue
            try:
                poller.poll()
            except OSError as e:  # (closed under it)
                with rlock:
                    if not st.reader.done:
                        self._recv_failed(st, e)
                return
            with rlock:
                if st.reader.done:
                    return
                if not self.lent and self._read(st, None) < 0:
                    return


# ----------------------------------------------------------------------------- helpers
def _readable(sock, seconds: float) -> bool:
    """Whether ``sock`` has bytes to read within ``seconds`` (poll: select cannot take a
    descriptor above 1023, which a rank with many links has)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(seconds * 1000.0))


def shut_down(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _unsent(sock) -> int:
    """Bytes a socket's kernel holds that its peer has not acknowledged (TIOCOUTQ); 0 for what
    is not a socket or is closed."""
    try:
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, TypeError, ValueError):
        return 0
    return int.from_bytes(out, sys.byteorder, signed=True)


def write_now(sock, out: list) -> None:
    """Write what ``sock`` takes of the buffers ``out`` without blocking (MSG_DONTWAIT);
    what it did not take stays in ``out`` (its buffer is full)."""
    while out:
        try:
            sent = sock.sendmsg(out, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        advance(out, sent)


def tcp_info(sock) -> dict | None:
    """A few fields of the kernel's TCP_INFO for a connection (None if it is closed or not
    a TCP socket): ``total_retrans``, and where the kernel's struct is long enough
    ``bytes_acked``, ``segs_out``, ``busy_us`` (microseconds with data in flight or queued,
    counted in jiffies: 1 to 10 ms steps), ``rwnd_limited_us`` and ``sndbuf_limited_us`` (the
    parts of ``busy_us`` that the peer's receive window, or this side's send buffer, held the
    sender back), ``bytes_sent`` (retransmissions included). Read only when asked
    (``stats()``), never on the data path."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except (OSError, AttributeError, TypeError):
        return None
    if not isinstance(raw, (bytes, bytearray)) or len(raw) < _TCPI_TOTAL_RETRANS + 4:
        return None
    out = {"total_retrans": struct.unpack_from("<I", raw, _TCPI_TOTAL_RETRANS)[0]}
    if len(raw) >= _TCPI_BYTES_ACKED + 8:
        out["bytes_acked"] = struct.unpack_from("<Q", raw, _TCPI_BYTES_ACKED)[0]
    if len(raw) >= _TCPI_SEGS_OUT + 4:
        out["segs_out"] = struct.unpack_from("<I", raw, _TCPI_SEGS_OUT)[0]
    if len(raw) >= _TCPI_SNDBUF_LIMITED + 8:
        busy, rwnd, sndbuf = struct.unpack_from("<QQQ", raw, _TCPI_BUSY_TIME)
        out.update(busy_us=busy, rwnd_limited_us=rwnd, sndbuf_limited_us=sndbuf)
    if len(raw) >= _TCPI_BYTES_SENT + 8:
        out["bytes_sent"] = struct.unpack_from("<Q", raw, _TCPI_BYTES_SENT)[0]
    return out


def kernel_queued(sock) -> int:
    """Bytes handed to a stream and not yet acknowledged (the kernel's send queue; an RDMA
    stream's posted, uncompleted writes)."""
    queued = getattr(sock, "queued_bytes", None)
    if queued is not None:
        return queued()
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0


__all__ = ["Link", "LinkSink", "Stream", "StreamLink", "ThreadedStreamLink", "advance",
           "shut_down", "tcp_info", "kernel_queued", "FLUSH_GIVE_UP_S"]
