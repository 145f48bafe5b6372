"""Non-blocking requests returned by the transport (as ncclNet's isend/irecv + test/wait)."""
from __future__ import annotations

import threading

_cb_lock = threading.Lock()


class TransportError(RuntimeError):
    """A transfer failed: peer lost, mismatch, protocol violation, or the context is broken."""


class PeerFailure(TransportError):
    """A peer's connection broke (process died, link lost) or it closed its group."""

    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer


class ProtocolError(PeerFailure):
    """A peer sent what breaks the protocol (a malformed frame): that peer is the cause."""


class MismatchError(TransportError):
    """Two ranks disagree about what they are doing (op, size, sequence). ``facts``: the
    transport's record of the difference (matching.Mismatch), where it found one."""

    def __init__(self, message: str, facts=None):
        super().__init__(message)
        self.facts = facts


class Request:
    """One posted send or receive. ``wait`` raises the transfer's error, if any."""

    __slots__ = ("peer", "buf", "total", "channel", "tag", "msgno", "opcode", "done_bytes",
                 "next_off", "error", "_done", "_lock", "_callbacks", "is_send", "desc", "call",
                 "priority")

    def __init__(self, is_send: bool, peer: int | None, buf: memoryview, channel: int, tag: int,
                 opcode: int, desc: str):
        self.is_send = is_send
        self.peer = peer
        if buf.format != "B" or buf.ndim != 1:
            buf = buf.cast("B")  # chunks are cut by byte offsets; raises if not contiguous
        self.buf = buf
        self.total = buf.nbytes
        self.channel = channel
        self.tag = tag
        self.opcode = opcode
        self.desc = desc
        self.call = 0  # collective: digest of the call's arguments (framing: call)
        self.priority = 0  # sends: lower goes first (Context.isend)
        self.msgno = -1
        self.done_bytes = 0  # received, or (a send) written to the wire
        self.next_off = 0    # a send: where its next frame starts (framing.SendQueue)
        self.error: BaseException | None = None
        # A held lock that completion releases: far cheaper to create than an Event (one
        # request per chunked piece is created on the hot path).
        self._done = False
        self._lock = threading.Lock()
        self._lock.acquire()
        self._callbacks = None

    # -- completion (by the transport) ---------------------------------------------------
    def finish(self, error: BaseException | None = None) -> None:
        """Complete the request (with ``error``, or successfully); the first call counts.
        Its completion callbacks run on the caller's thread."""
        with _cb_lock:
            if self._done:
                return
            self._done = True
            self.error = error
            self.buf = None  # drop the reference to the caller's memory
            cbs, self._callbacks = self._callbacks, None
            self._lock.release()
        if cbs:
            for cb in cbs:
                cb(self)

    def add_done_callback(self, cb) -> None:
        """Call ``cb(request)`` on completion (at once if already complete). Keep it short:
        it runs on a transport thread."""
        with _cb_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                return
        cb(self)

    # -- user side ------------------------------------------------------------------------
    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            if not self._lock.acquire(True, -1 if timeout is None else timeout):
                what = "send to" if self.is_send else "receive from"
                who = "any rank" if self.peer is None else f"rank {self.peer}"
                raise TimeoutError(f"timed out after {timeout:.1f}s waiting to {what} {who} "
                                   f"({self.desc}, {self.total} bytes)")
            self._lock.release()  # let other waiters through
        if self.error is not None:
            raise self.error
