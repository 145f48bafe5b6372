"""The event-loop I/O model of stream links: a process-wide pool of a few I/O threads, each an
epoll loop over non-blocking sockets, and ``LoopStreamLink``, the link.StreamLink they drive.

Every plain TCP link of every group in the process under ``LINERATE_IO=shared`` hands its
connections to these loops instead of running a sender and a receiver thread per connection
(link.ThreadedStreamLink: ``LINERATE_IO=threads`` or ``auto``, the default; TLS and RDMA
streams, which block, always): the pool's threads are ``LINERATE_IO_THREADS`` (default 2)
whatever the number of peers, links or groups. A connection is assigned to a loop round-robin
(the connections of one link land on different loops, so a striped message still uses several
threads, and several cores). Both models put the same bytes on the wire and share everything but the loop (the
frames: transport/framing.py; striping, state, failures: link.StreamLink).

A loop owns the sockets registered with it: only its thread reads or writes them. Other
threads talk to it with ``call_soon(fn)`` (run ``fn()`` on the loop's thread, soon), woken
through an eventfd (a pipe where there is none). Handlers run on the loop's thread and must
not block: everything a link does there is non-blocking socket calls and short critical
sections (the Context's matcher lock). So the sink's callbacks and the requests' completion
callbacks run on an I/O thread: one that waits for another transfer would wait for ever (the
thread that would move it is the one waiting): keep them short, as the link specification asks.

The pool is made on first use and lives as long as the process (daemon threads; stopped at
exit so that no loop holds a buffer while the interpreter finalizes).
"""
from __future__ import annotations

import atexit
import collections
import errno
import itertools
import logging
import os
import select
import threading
import time

from .link import StreamLink, Stream, advance, shut_down

log = logging.getLogger("linerate.transport")

#: Default of LINERATE_IO_THREADS.
IO_THREADS_DEFAULT = 2

EPOLLIN = select.EPOLLIN
EPOLLOUT = select.EPOLLOUT
_EPOLLERR = select.EPOLLERR | select.EPOLLHUP


class IOLoop:
    """One I/O thread: an epoll set of sockets, each with a handler, and a queue of calls."""

    def __init__(self, name: str):
        self.name = name
        self._ep = select.epoll()
        self._handlers: dict[int, object] = {}
        self._calls: collections.deque = collections.deque()
        self._calls_lock = threading.Lock()
        self._asleep = False      # guarded by _calls_lock: the loop waits in epoll
        self._stop = False
        try:
            self._wfd = self._rfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except (AttributeError, OSError):  # no eventfd: a pipe
            self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._rfd, EPOLLIN)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ from any thread
    def call_soon(self, fn) -> None:
        """Run ``fn()`` on this loop's thread (after what it is doing now)."""
        with self._calls_lock:
            self._calls.append(fn)
            wake = self._asleep
            self._asleep = False
        if wake:
            self._wake()

    def in_loop(self) -> bool:
        return threading.current_thread() is self.thread

    def _wake(self) -> None:
        try:
            os.write(self._wfd, b"\1\0\0\0\0\0\0\0")
        except BlockingIOError:  # already pending
            pass
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EBADF):
                raise

    # ------------------------------------------------------------------ on the loop's thread
    def register(self, fd: int, events: int, handler) -> None:
        """``handler.on_events(mask)`` is called on this thread when ``fd`` is ready."""
        self._handlers[fd] = handler
        self._ep.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._ep.modify(fd, events)

    def unregister(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            try:
                self._ep.unregister(fd)
            except (OSError, ValueError):
                pass

    def _run(self) -> None:
        ep, handlers, calls, lock = self._ep, self._handlers, self._calls, self._calls_lock
        rfd = self._rfd
        while not self._stop:
            with lock:
                if calls:
                    timeout = 0
                else:
                    self._asleep = True
                    timeout = -1
            try:
                events = ep.poll(timeout)
            except InterruptedError:
                continue
            if timeout:
                with lock:
                    self._asleep = False
            for fd, mask in events:
                if fd == rfd:
                    try:
                        os.read(rfd, 8)
                    except OSError:
                        pass
                    continue
                h = handlers.get(fd)
                if h is None:
                    continue
                try:
                    h.on_events(mask)
                except Exception:  # noqa: BLE001 - never kill the process's I/O thread
                    log.exception("%s: an I/O handler raised", self.name)
            while calls:
                fn = calls.popleft()
                try:
                    fn()
                except Exception:  # noqa: BLE001 - as above
                    log.exception("%s: a call raised", self.name)
                fn = None
        self._handlers.clear()
        self._calls.clear()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop = True
        self._wake()
        if not self.in_loop():
            self.thread.join(timeout)


class _Pool:
    def __init__(self):
        self._lock = threading.Lock()
        self._loops: list[IOLoop] = []
        self._next = itertools.count()

    def loops(self) -> list[IOLoop]:
        with self._lock:
            if not self._loops:
                n = io_threads()
                self._loops = [IOLoop(f"linerate-io-{i}") for i in range(n)]
            return self._loops

    def assign(self, n: int) -> list[IOLoop]:
        """Loops for ``n`` connections of one link: consecutive ones, round-robin over the
        pool (the next link starts where this one ended)."""
        loops = self.loops()
        with self._lock:
            start = next(self._next)
            for _ in range(n - 1):
                next(self._next)
        return [loops[(start + i) % len(loops)] for i in range(n)]

    def stop(self) -> None:
        with self._lock:
            loops, self._loops = self._loops, []
        for lp in loops:
            lp.stop()


def io_threads(env=None) -> int:
    """LINERATE_IO_THREADS: the I/O threads of the process-wide pool (read once, when the
    first shared link starts)."""
    from linerate import settings
    return settings.read("LINERATE_IO_THREADS", env)


POOL = _Pool()
atexit.register(POOL.stop)


def on_a_loop() -> bool:
    """Whether the calling thread is one of the pool's I/O loops."""
    return any(lp.in_loop() for lp in POOL._loops)


def _after_fork_in_child() -> None:
    # The loops' threads do not exist in a forked child: a group it makes starts its own.
    global POOL
    POOL = _Pool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ----------------------------------------------------------------------------- the link
#: Per readiness event, at most this many bytes are read from one connection (fairness).
_READ_BUDGET = 1 << 20
#: Per turn, at most this many frames are written on one connection before the loop serves
#: the others.
_WRITE_BUDGET = 4


class _LoopStream(Stream):
    """A connection of a LoopStreamLink, with what its loop keeps of it."""

    __slots__ = ("link", "loop", "fd", "events", "registered", "idle", "send_done", "out",
                 "out_req", "out_n", "released", "pump")

    def __init__(self, index: int, sock, reader):
        super().__init__(index, sock, reader)
        self.link = self.loop = None
        self.fd = sock.fileno()
        self.events = 0
        self.registered = False
        self.idle = False        # nothing to write and not scheduled (guarded by link._cond)
        self.send_done = False   # CLOSE written, or the send side broke (guarded by link._cond)
        self.out = None          # the frame being written: a list of buffers
        self.out_req = None      # its request (None: a control frame)
        self.out_n = 0           # its payload bytes (-1: the CLOSE frame)
        self.released = False
        self.pump = _nothing

    def on_events(self, mask: int) -> None:
        link = self.link
        if link is not None:  # None: released (LoopStreamLink._release)
            link._on_events(self, mask)


def _nothing() -> None:
    pass


class LoopStreamLink(StreamLink):
    """A StreamLink whose connections the process's I/O loops drive: each connection, once its
    previous frame is fully written, takes the next (control frames first) and writes it with
    non-blocking ``sendmsg``; what the kernel does not take now waits for EPOLLOUT. A
    connection with nothing to write is idle; queuing wakes one idle connection, which wakes
    the next while frames remain. Reading: whatever has arrived, with non-blocking
    ``recv_into`` into what the connection's reader needs. ``close`` shuts the sockets down;
    the loops unregister and close them and drop every buffer reference; ``close`` waits."""

    _stream_type = _LoopStream

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        for st, lp in zip(self._streams, POOL.assign(len(self._streams))):
            st.link, st.loop = self, lp
            st.pump = lambda st=st: self._pump(st)  # for call_soon: one callable per connection
        self._kick_at = 0

    def start(self, sink) -> None:
        self._sink = sink
        for st in self._streams:
            st.sock.setblocking(False)
            self._credit_window(st)
            st.loop.call_soon(lambda st=st: self._attach(st))

    def _wake(self) -> None:
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

    def _wake_all(self) -> None:
        for st in self._streams:
            if st.idle:
                st.idle = False
                st.loop.call_soon(st.pump)

    def flush_control(self, until: float) -> bool:
        if any(st.loop.in_loop() for st in self._streams):
            return False  # on a loop that writes this link's frames: waiting would stop them
        return super().flush_control(until)

    def wait_sent(self, until: float) -> None:
        if self._sink is not None:
            self._wait_all(lambda st: st.send_done or st.released, until)

    def close(self, deadline: float) -> None:
        self.begin_close()
        # The loops unregister and close the sockets and drop every buffer reference (a
        # receive in progress may hold the last reference to a tensor); wait for that.
        for st in self._streams:
            shut_down(st.sock)
            if st.loop.in_loop() or not st.loop.thread.is_alive():  # (stopped at exit)
                self._release(st)
            else:
                st.loop.call_soon(lambda st=st: self._release(st))
        self._wait_all(lambda st: st.released, max(time.monotonic() + 0.5, deadline))

    def _wait_all(self, done, until: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: all(done(st) for st in self._streams),
                                max(0.0, until - time.monotonic()))

    # ------------------------------------------------------------------ on the loops
    def _attach(self, st: _LoopStream) -> None:
        if st.released:
            return
        st.events = EPOLLIN
        try:
            st.loop.register(st.fd, EPOLLIN, st)
            st.registered = True
        except (OSError, ValueError) as e:  # closed before it started
            self._recv_failed(st, e)
        self._pump(st)

    def _set_events(self, st: _LoopStream, want_out: bool) -> None:
        ev = (0 if st.reader.done else EPOLLIN) | (EPOLLOUT if want_out else 0)
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

    def _on_events(self, st: _LoopStream, mask: int) -> None:
        if st.released:
            return
        if not st.reader.done and mask & (EPOLLIN | _EPOLLERR):
            self._on_readable(st)
        if st.events & EPOLLOUT and mask & (EPOLLOUT | _EPOLLERR):
            self._pump(st)
        if st.reader.done and mask & _EPOLLERR and st.registered and not st.events & EPOLLOUT:
            # Both ways over (the peer hung up): nothing more to wait for on this socket.
            st.loop.unregister(st.fd)
            st.registered = False
            st.events = 0

    def _pump(self, st: _LoopStream) -> None:
        """Write on ``st`` until the kernel takes no more, or it has nothing to write."""
        if st.released or self._sink is None:
            return
        budget = _WRITE_BUDGET
        sock = st.sock
        while True:
            if st.out is None:
                with self._cond:
                    frame = None if st.send_done or st.released else self._take(st)
                    st.idle = frame is None and not st.send_done
                if frame is None:
                    if st.events & EPOLLOUT:
                        self._set_events(st, False)
                    return
                st.out_req, st.out, st.out_n = frame
            try:
                sent = sock.sendmsg(st.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                n, st.out, st.out_req = st.out_n, None, None
                with self._cond:
                    st.send_done = True
                    self._cond.notify_all()
                self._set_events(st, False)
                if n >= 0:  # (the CLOSE frame may find the stream shut)
                    self._send_failed(st, e)
                return
            advance(st.out, sent)
            if st.out:
                if not st.events & EPOLLOUT:
                    self._set_events(st, True)
                return
            req, n = st.out_req, st.out_n
            st.out = st.out_req = None
            if n < 0:  # the CLOSE frame: this connection's sending is over
                with self._cond:
                    st.send_done = True
                    self._cond.notify_all()
                if st.events & EPOLLOUT:
                    self._set_events(st, False)
                return
            self._written(st, req, n)
            req = None
            budget -= 1
            if budget == 0:  # let the loop serve the others; come back soon
                st.loop.call_soon(st.pump)
                return

    def _on_readable(self, st: _LoopStream) -> None:
        sock, reader, sink = st.sock, st.reader, self._sink
        budget = _READ_BUDGET
        try:
            while budget > 0:
                try:
                    k = sock.recv_into(reader.need())
                except (BlockingIOError, InterruptedError):
                    return
                if k == 0:
                    self._recv_failed(st, None)
                    break
                budget -= k
                if reader.advance(k, self, sink):
                    self._peer_closed(st)
                    break
        except Exception as e:  # noqa: BLE001 - the stream's end, reported as the link's
            self._recv_failed(st, e)
        if reader.done:  # no more reading on this socket
            self._set_events(st, bool(st.events & EPOLLOUT))

    def _release(self, st: _LoopStream) -> None:
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
        st.reader.stop()
        st.out = st.out_req = None
        # and no way back to the link, which holds st: the cycle would wait for the garbage
        # collector, while the link's Context is freed as soon as it is dropped
        st.link, st.pump = None, _nothing


__all__ = ["IOLoop", "POOL", "LoopStreamLink", "IO_THREADS_DEFAULT", "io_threads", "on_a_loop"]
