"""Links whose connections are driven by the process-wide I/O loops (transport/ioloop.py).

``SharedStreamLink`` is ``link.StreamLink`` without threads of its own (``LINERATE_IO=shared``,
and under the default ``auto`` every plain TCP link beyond the process's first threaded ones,
transport/tcp.py ``AUTO_IO_THREADS``): its connections are non-blocking sockets registered with the pool of
``LINERATE_IO_THREADS`` epoll loops that every link of every group of the process shares, so
a rank runs a constant number of I/O threads whatever its number of peers and groups (the
threaded StreamLink runs a sender and a receiver thread per connection).

It implements transport/link.py's contract exactly as StreamLink does, and puts the same
bytes on the wire (a StreamLink at one end and a SharedStreamLink at the other interoperate):

- sending: each connection, once its previous frame is fully written, takes the next chunk of
  the most urgent queued message (control frames first), builds the header
  (transport/framing.py) and writes header, payload (a memoryview of the caller's buffer: no
  copy) and, with LINERATE_CHECKSUM, the payload's CRC-32, with non-blocking ``sendmsg``; what
  the kernel does not take now waits for EPOLLOUT. TCP_NOTSENT_LOWAT (the credit window)
  bounds what the kernel accepts, as with blocking sends. A connection with nothing to write
  is idle; queuing a message wakes one idle connection (as StreamLink's ``notify``), which
  wakes the next when chunks remain; a control frame is written by the caller itself when a
  connection is idle;
- receiving: a state machine per connection (header, payload, CRC, error text) that reads
  with non-blocking ``recv_into`` whatever has arrived, straight into the memoryview that
  ``sink.claim`` returned (into a discard buffer when it returns None);
- closing: ``begin_close`` wakes every connection, each writes what is queued, then a CLOSE
  frame; ``wait_sent`` waits for those; ``close`` shuts the sockets down, and the loops
  unregister and close them and drop every reference to a buffer; ``close`` waits for that.

The sink's callbacks (claim, filled, control, link_failed, link_closed) and the requests'
completion callbacks run on an I/O thread: they must not block (the Context's take its lock
briefly). A completion callback that waits for another transfer would wait for ever, since
the I/O thread that would move it is the one waiting: keep them short (as the link
specification already asks).

Not here: TLS connections (LINERATE_TLS) keep the threaded StreamLink (ssl.SSLSocket has no
sendmsg, and non-blocking TLS needs its own want-read/want-write handling); RDMA streams keep
StreamLink too.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import zlib

from . import framing, ioloop
from .framing import KIND_CLOSE, KIND_DATA, KIND_ERROR
from .ioloop import EPOLLIN, EPOLLOUT
from .link import _CRC, StreamLink, _Stream, enqueue
from .request import PeerFailure, ProtocolError, Request

log = logging.getLogger("linerate.transport")

_ERRHUP = ioloop._EPOLLERR
_HDR = framing.HEADER_SIZE
_CLOSE_FRAME = framing.pack_header(KIND_CLOSE, 0, 0, 0, 0, 0, 0, 0)
# receive states
_R_HEADER, _R_PAYLOAD, _R_CRC, _R_TEXT, _R_DONE = range(5)
#: Per readiness event, at most this many bytes are read from one connection (fairness).
_READ_BUDGET = 1 << 20
#: Per turn, at most this many frames are written on one connection before the loop serves
#: the others.
_WRITE_BUDGET = 4
#: Messages up to this size are written by the caller of isend when a connection is idle
#: (one thread hand-off less per message); larger ones by the loops. Off (-1): the hand-off
#: it saves helps small all_reduces over loopback, but across real network links writing from
#: the caller's thread makes them slower. Control frames (rare) are still written by the caller.
_DIRECT_BYTES = -1



def _advance(out: list, sent: int) -> None:
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

class _PeerEOF(Exception):
    pass


class _SStream(_Stream):
    """One connection of a SharedStreamLink and its send and receive state (the loop's)."""

    __slots__ = ("link", "loop", "fd", "events", "registered", "idle", "send_done", "out",
                 "out_req", "out_n", "rstate", "hbuf", "hview", "got", "need", "rview", "dest",
                 "token", "hdr", "cbuf", "text", "discard", "released", "pump")

    def __init__(self, index: int, sock, link, loop):
        super().__init__(index, sock)
        self.link = link
        self.loop = loop
        self.fd = sock.fileno()
        self.events = 0
        self.registered = False
        self.idle = False        # nothing to write and not scheduled (guarded by link._cond)
        self.send_done = False   # CLOSE written, or the send side broke (guarded by link._cond)
        self.out = None          # the frame being written: a list of buffers
        self.out_req = None      # its request (None: a control or CLOSE frame)
        self.out_n = 0
        self.rstate = _R_HEADER
        self.hbuf = bytearray(_HDR)
        self.hview = memoryview(self.hbuf)
        self.got = 0
        self.need = _HDR
        self.rview = None
        self.dest = None
        self.token = None
        self.hdr = None
        self.cbuf = bytearray(_CRC.size)
        self.text = None
        self.discard = None
        self.released = False
        self.pump = lambda: link._pump(self)  # for call_soon: one callable per connection

    def on_events(self, mask: int) -> None:
        link = self.link
        if link is not None:  # None: released (SharedStreamLink._release)
            link._on_events(self, mask)


def _nothing() -> None:
    pass


class SharedStreamLink(StreamLink):
    """A StreamLink whose connections the process's I/O loops drive (see the module doc)."""

    def __init__(self, peer: int, socks: list, *, rank: int, chunk_bytes: int,
                 checksum: bool = False, credit_bytes: int = 0, speed_bps: int | None = None):
        super().__init__(peer, socks, rank=rank, chunk_bytes=chunk_bytes, checksum=checksum,
                         credit_bytes=credit_bytes, speed_bps=speed_bps)
        loops = ioloop.POOL.assign(len(socks))
        self._streams = [_SStream(i, s, self, lp) for i, (s, lp) in enumerate(zip(socks, loops))]
        self._max_chunk = max(chunk_bytes, 1 << 24)  # peers may run another chunk size
        self._kick_at = 0

    # ------------------------------------------------------------------ Link
    def start(self, sink) -> None:
        self._sink = sink
        credit = self._credit
        for st in self._streams:
            sock = st.sock
            sock.setblocking(False)
            if credit and hasattr(socket, "TCP_NOTSENT_LOWAT"):
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT,
                                    max(16 << 10, credit // len(self._streams)))
                except (OSError, AttributeError) as e:
                    log.debug("rank %d: no credit window on connection %d to rank %d: %s",
                              self.rank, st.index, self.peer, e)
            st.loop.call_soon(lambda st=st: self._attach(st))

    def isend(self, req: Request) -> bool:
        req.chunks_left = max(1, -(-req.total // self._chunk))
        priority = req.priority
        with self._cond:
            if self._down is not None or self._closing:
                return False
            enqueue(self._queue, req, priority)
            if len(self._sending) >= self._prune_at:
                self._sending = {r for r in self._sending if not r.is_completed()}
                self._prune_at = max(256, 2 * len(self._sending))
            self._sending.add(req)
            st = self._claim_idle() if req.total <= _DIRECT_BYTES else None
            if st is None:
                self._kick_one()
        if st is not None:
            self._direct(st)
        return True

    def send_control(self, kind: int, payload: bytes = b"", value: int = 0) -> bool:
        with self._cond:
            if self._down is not None:
                return False
            self._queue.appendleft((kind, payload, value))
            self._ctl_left += 1
            st = self._claim_idle()
        if st is not None:
            self._direct(st)
        return True

    def flush_control(self, until: float) -> bool:
        if any(st.loop.in_loop() for st in self._streams):
            # On a loop that writes this link's frames: waiting here would stop them.
            return False
        return super().flush_control(until)

    def begin_close(self) -> None:
        with self._cond:
            self._closing = True
            for st in self._streams:
                if st.idle:
                    st.idle = False
                    st.loop.call_soon(lambda st=st: self._pump(st))
            self._cond.notify_all()

    def wait_sent(self, until: float) -> None:
        if self._sink is None:
            return
        with self._cond:
            while not all(st.send_done or st.released for st in self._streams):
                left = until - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self, deadline: float) -> None:
        self.begin_close()
        for st in self._streams:
            try:
                st.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # The loops unregister and close the sockets and drop every buffer reference (a
        # receive in progress may hold the last reference to a tensor); wait for that.
        done = threading.Event()
        left = [len(self._streams)]
        lock = threading.Lock()

        def release(st):
            self._release(st)
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for st in self._streams:
            if st.loop.in_loop() or not st.loop.thread.is_alive():  # (stopped at exit)
                release(st)
            else:
                st.loop.call_soon(lambda st=st: release(st))
        if not done.is_set():
            done.wait(max(0.0, max(time.monotonic() + 0.5, deadline) - time.monotonic()))

    # ------------------------------------------------------------------ on the loops
    def _attach(self, st: _SStream) -> None:
        if st.released:
            return
        st.events = EPOLLIN
        try:
            st.loop.register(st.fd, EPOLLIN, st)
            st.registered = True
        except (OSError, ValueError) as e:  # closed before it started
            st.rstate = _R_DONE
            self._recv_failed(st, e)
        self._pump(st)

    def _set_events(self, st: _SStream, want_out: bool) -> None:
        ev = (EPOLLIN if st.rstate != _R_DONE else 0) | (EPOLLOUT if want_out else 0)
        if ev == st.events and (st.registered or not ev):
            return
        st.events = ev
        try:
            if not ev:
                if st.registered:
                    st.loop.unregister(st.fd)
                    st.registered = False
            elif st.registered:
                st.loop.modify(st.fd, ev)
            elif not st.released:
                st.loop.register(st.fd, ev, st)
                st.registered = True
        except (OSError, ValueError):
            pass

    def _on_events(self, st: _SStream, mask: int) -> None:
        if st.released:
            return
        if st.rstate != _R_DONE and mask & (EPOLLIN | _ERRHUP):
            self._on_readable(st)
        if st.events & EPOLLOUT and mask & (EPOLLOUT | _ERRHUP):
            # (only while the loop owns the sending: a caller may be writing a small frame)
            self._pump(st)
        if st.rstate == _R_DONE and mask & _ERRHUP and st.registered and not st.events & EPOLLOUT:
            # Both ways over (the peer hung up): nothing more to wait for on this socket.
            st.loop.unregister(st.fd)
            st.registered = False
            st.events = 0

    def _claim_idle(self):
        """An idle connection for the caller to write on itself (under _cond), or None (then
        one is woken on its loop)."""
        streams = self._streams
        n = len(streams)
        start = self._kick_at
        for i in range(n):
            st = streams[(start + i) % n]
            if st.idle:
                st.idle = False
                self._kick_at = (start + i + 1) % n
                return st
        return None

    def _direct(self, st: _SStream) -> None:
        """A small message or control frame, on the caller's thread: write the next frame on
        the idle connection ``st`` (claimed under _cond) without waking its loop; what the
        kernel does not take at once, and whatever is queued after it, goes to the loop."""
        try:
            if not self._take(st):
                return  # nothing left (another connection took it): st is idle again
            out = st.out
            try:
                sent = st.sock.sendmsg(out)
            except OSError:  # EAGAIN, or a broken connection: the loop finds out which
                sent = 0
            _advance(out, sent)
            if out:
                st.loop.call_soon(st.pump)
                return
            st.out = None
            req, n = st.out_req, st.out_n
            st.out_req = None
            if n < 0:  # the CLOSE frame (the peer closed, the queue ran empty meanwhile)
                with self._cond:
                    st.send_done = True
                    self._cond.notify_all()
                return
            if req is not None:
                self._chunk_done(st, req, n)
                req = None
            else:
                self._control_written()
            with self._cond:
                if self._queue or self._closing or st.closed or st.released:
                    st.loop.call_soon(st.pump)
                else:
                    st.idle = True
        except BaseException:
            st.loop.call_soon(st.pump)
            raise

    def _chunk_done(self, st: _SStream, req: Request, n: int) -> None:
        st.sent_bytes += n
        with self._done_lock:
            req.chunks_left -= 1
            done = req.chunks_left == 0
            if done:
                self._messages_sent += 1
        if done:
            req._finish()

    def _kick_one(self) -> None:
        """Wake one idle connection (under _cond): it takes the next chunk or frame."""
        streams = self._streams
        n = len(streams)
        start = self._kick_at
        for i in range(n):
            st = streams[(start + i) % n]
            if st.idle:
                st.idle = False
                self._kick_at = (start + i + 1) % n
                st.loop.call_soon(st.pump)
                return

    def _take(self, st: _SStream) -> bool:
        """Give ``st`` its next frame (st.out). False: nothing to send (st is idle or done)."""
        while True:
            with self._cond:
                if st.send_done or st.released:
                    return False
                q = self._queue
                if not q:
                    if self._closing or st.closed:
                        st.out = [_CLOSE_FRAME]
                        st.out_req = None
                        st.out_n = -1  # the CLOSE frame
                        return True
                    st.idle = True
                    return False
                req = q[0]
                if isinstance(req, tuple):  # a control frame (kind, payload, value)
                    q.popleft()
                    if q:
                        self._kick_one()
                    kind, payload, ctag = req
                    st.out = [framing.HEADER.pack(kind, 0, 0, len(payload), ctag, 0, len(payload),
                                                  0, 0) + payload]
                    st.out_req = None
                    st.out_n = 0
                    return True
                off = req.next_off
                n = min(self._chunk, req.total - off)
                buf = req.buf
                req.next_off = off + n
                if req.next_off >= req.total:
                    q.popleft()
                if q:
                    self._kick_one()  # more chunks: another connection takes the next
            if req.error is not None or buf is None:
                continue  # failed while queued: drop the rest
            hdr = framing.HEADER.pack(KIND_DATA, req.opcode, req.channel, n, req.tag, req.msgno,
                                      req.total, off, req.call)
            if n:
                data = buf[off:off + n]
                st.out = [hdr, data, _CRC.pack(zlib.crc32(data))] if self._checksum else [hdr, data]
            else:
                st.out = [hdr]
            st.out_req = req
            st.out_n = n
            return True

    def _pump(self, st: _SStream) -> None:
        """Write on ``st`` until the kernel takes no more, or it has nothing to write."""
        if st.released or self._sink is None:
            return
        budget = _WRITE_BUDGET
        sock = st.sock
        while True:
            if st.out is None and not self._take(st):
                if st.events & EPOLLOUT:
                    self._set_events(st, False)
                return
            out = st.out
            try:
                sent = sock.sendmsg(out)
            except (BlockingIOError, InterruptedError):
                if not st.events & EPOLLOUT:
                    self._set_events(st, True)
                return
            except OSError as e:
                self._send_failed(st, e)
                return
            _advance(out, sent)
            if out:
                if not st.events & EPOLLOUT:
                    self._set_events(st, True)
                return
            st.out = None
            req, n = st.out_req, st.out_n
            st.out_req = None
            if n < 0:  # the CLOSE frame: this connection's sending is over
                with self._cond:
                    st.send_done = True
                    self._cond.notify_all()
                if st.events & EPOLLOUT:
                    self._set_events(st, False)
                return
            if req is not None:
                self._chunk_done(st, req, n)
                req = None
            else:
                self._control_written()
            budget -= 1
            if budget == 0:  # let the loop serve the others; come back soon
                st.loop.call_soon(st.pump)
                return

    def _send_failed(self, st: _SStream, e: OSError) -> None:
        st.out = None
        st.out_req = None
        with self._cond:
            st.send_done = True
            self._cond.notify_all()
        self._set_events(st, False)
        self._fail(PeerFailure(self.peer, f"rank {self.rank}: sending to rank {self.peer} "
                                          f"failed ({e}); did rank {self.peer} exit or crash?"))

    def _on_readable(self, st: _SStream) -> None:
        sock = st.sock
        sink = self._sink
        budget = _READ_BUDGET
        try:
            while budget > 0:
                rstate = st.rstate
                view = st.hview if rstate == _R_HEADER else st.rview
                try:
                    k = sock.recv_into(view[st.got:] if st.got else view, st.need - st.got)
                except (BlockingIOError, InterruptedError):
                    return
                if k == 0:
                    raise _PeerEOF
                st.got += k
                budget -= k
                if st.got < st.need:
                    continue
                st.got = 0
                if rstate == _R_HEADER:
                    kind, opcode, channel, length, tag, msgno, total, off, call = \
                        framing.unpack_header(st.hbuf, self._max_chunk)
                    if kind == KIND_DATA:
                        token, dest = sink.claim(self, opcode, channel, tag, msgno, total, call,
                                                 off, length)
                        if dest is None:  # nowhere to go (mismatched or failed receive): drop
                            token = None
                            dest = self._discard_view(st, length)
                        st.token, st.dest = token, dest
                        st.hdr = (channel, tag, msgno, length, off, total)
                        if length:
                            st.rstate, st.rview, st.need = _R_PAYLOAD, dest, length
                        else:
                            self._data_in(st)
                    elif kind == KIND_ERROR:
                        st.text = bytearray(length)
                        st.hdr = tag
                        if length:
                            st.rstate, st.rview, st.need = _R_TEXT, memoryview(st.text), length
                        else:
                            self._text_in(st)
                    elif kind == KIND_CLOSE:
                        self._close_in(st)
                        return
                    else:  # QUERY, PROGRESS
                        sink.control(self, kind, b"", tag)
                elif rstate == _R_PAYLOAD:
                    if self._checksum:
                        st.rstate, st.rview, st.need = _R_CRC, memoryview(st.cbuf), _CRC.size
                    else:
                        self._data_in(st)
                elif rstate == _R_CRC:
                    self._data_in(st)
                else:
                    self._text_in(st)
        except _PeerEOF:
            self._recv_over(st)
            self._fail(PeerFailure(self.peer, f"rank {self.rank}: connection {st.index} to "
                                              f"rank {self.peer} ({st.remote}) closed unexpectedly: "
                                              f"rank {self.peer} exited or crashed"))
        except framing.FrameError as e:
            self._recv_over(st)
            self._fail(ProtocolError(self.peer, f"rank {self.rank}: protocol error from rank "
                                              f"{self.peer}: {e}"), even_closing=True)
        except OSError as e:
            self._recv_failed(st, e)
        except Exception as e:  # noqa: BLE001 - a sink that raised: the link cannot go on
            log.exception("rank %d: receiving from rank %d", self.rank, self.peer)
            self._recv_over(st)
            self._fail(PeerFailure(self.peer, f"rank {self.rank}: receiving from rank "
                                              f"{self.peer} failed: {e!r}"), even_closing=True)

    def _recv_failed(self, st: _SStream, e: OSError) -> None:
        self._recv_over(st)
        self._fail(PeerFailure(self.peer, f"rank {self.rank}: connection to rank {self.peer} "
                                          f"failed: {e}; rank {self.peer} exited, crashed or its "
                                          f"link is down"))

    def _recv_over(self, st: _SStream) -> None:
        st.rstate = _R_DONE
        st.rview = st.dest = st.token = st.text = None
        self._set_events(st, bool(st.events & EPOLLOUT))

    def _data_in(self, st: _SStream) -> None:
        channel, tag, msgno, length, off, total = st.hdr
        dest, token = st.dest, st.token
        st.rstate, st.need, st.rview, st.dest, st.token = _R_HEADER, _HDR, None, None, None
        if self._checksum and length and _CRC.unpack(st.cbuf)[0] != zlib.crc32(dest):
            raise framing.FrameError(
                f"checksum mismatch in bytes [{off}, {off + length}) of a "
                f"{total}-byte message (tag {tag}): the data was corrupted on the "
                f"way (LINERATE_CHECKSUM)")
        dest = None
        st.recv_bytes += length
        if off + length == total:  # exactly one chunk of a message ends it
            st.recv_msgs += 1
        if token is not None:
            self._sink.filled(self, token, channel, tag, msgno, length)

    def _text_in(self, st: _SStream) -> None:
        text, tag = st.text, st.hdr
        st.rstate, st.need, st.rview, st.text = _R_HEADER, _HDR, None, None
        self._sink.control(self, KIND_ERROR, bytes(text), tag)

    def _close_in(self, st: _SStream) -> None:
        st.closed = True
        st.rstate = _R_DONE
        with self._cond:
            self._closes_seen += 1
            all_closed = self._closes_seen == len(self._streams)
            if all_closed and self._down is None:
                self._down = "closed"
            else:
                all_closed = False
            if st.idle:  # answer with this connection's CLOSE once its queue is empty
                st.idle = False
                st.loop.call_soon(st.pump)
            self._cond.notify_all()
        self._set_events(st, bool(st.events & EPOLLOUT))
        if all_closed and not self._closing:
            self._sink.link_closed(self)

    def _discard_view(self, st: _SStream, n: int) -> memoryview:
        buf = st.discard
        if buf is None or len(buf) < n:
            buf = st.discard = memoryview(bytearray(max(n, 1 << 16)))
        return buf[:n]

    def _release(self, st: _SStream) -> None:
        """On st's loop: unregister and close the socket; drop every buffer reference."""
        if st.registered:
            st.loop.unregister(st.fd)
            st.registered = False
        st.events = 0
        try:
            st.sock.close()
        except OSError:
            pass
        with self._cond:
            st.released = True
            st.idle = False
            self._cond.notify_all()
        st.rstate = _R_DONE
        st.out = st.out_req = st.rview = st.dest = st.token = st.text = st.discard = None
        # and no way back to the link, which holds st: the cycle would wait for the garbage
        # collector, while the link's Context is freed as soon as it is dropped
        st.link, st.pump = None, _nothing


__all__ = ["SharedStreamLink"]
