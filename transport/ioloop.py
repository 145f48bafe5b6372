"""A process-wide pool of a few I/O threads, each an epoll loop over non-blocking sockets.

Every plain TCP link of every group in the process under ``LINERATE_IO=shared`` (under the
default ``auto``: every one beyond the process's first threaded links, transport/tcp.py
``AUTO_IO_THREADS``) hands its connections to these loops (transport/sharedlink.py) instead of
running a sender and a receiver thread per connection: the pool's threads are
``LINERATE_IO_THREADS`` (default 2) whatever the number of peers, links or groups. A
connection is assigned to a loop round-robin (the connections of one link land on different
loops, so a striped message still uses several threads, and several cores).

A loop owns the sockets registered with it: only its thread reads or writes them. Other
threads talk to it with ``call_soon(fn)`` (run ``fn()`` on the loop's thread, soon), woken
through an eventfd (a pipe where there is none). Handlers run on the loop's thread and must
not block: everything a link does there is non-blocking socket calls and short critical
sections (the Context's matcher lock).

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

__all__ = ["IOLoop", "POOL", "EPOLLIN", "EPOLLOUT", "IO_THREADS_DEFAULT", "io_threads"]
