"""Matching: which buffer the bytes of an incoming message go to.

A message is identified by its peer and its key ``(channel, tag, msgno)``: ``msgno`` is either
an explicit slot that both sides give, or the count of earlier messages on that
(peer, channel, tag), so messages on one (peer, channel, tag) match in the order each side
posted them, whatever connection or link their bytes took.

This module holds that state and nothing else: no sockets, no threads, no wording. A
``Matcher`` has one lock (``Matcher.lock``) that its user holds around every call marked
*lock held*; results that need work outside the lock (finishing a request, copying a staged
message, reporting a mismatch) are returned, never done here, except the copy of
:meth:`Matcher.deliver`, which runs without the lock.

The states of a message on the receive side::

    posted      a receive is posted and no byte of its message arrived yet
    inflight    bytes are arriving: into the posted receive's buffer, or into a staging buffer
    unexpected  it arrived (or is arriving) before its receive: staged in a buffer of its
                announced size (at most ``max_unexpected_bytes``); the receive copies it once
    DEAD        its receive failed: the rest of its bytes are read and dropped

Messages on the *checked* channel (the collectives') carry an operation identity: an opcode,
the tag and an opaque 64-bit *digest* of the call (both sides compute it; this module only
compares the integers). A receive whose message differs in any of these, or in size on any
channel, fails with a :class:`Mismatch` record of both sides' facts; the caller words it.
``begin_call(tag, digest)`` declares the call this rank is in for ``tag``: staged or arriving
messages of that tag with another digest are a mismatch even if no receive ever asks for them.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from .framing import CHANNEL_COLLECTIVE, CHANNEL_P2P, FrameError
from .memory import anon_bytes

#: Calls whose arrivals are kept at most (``Matcher.arrivals``).
_MAX_ARRIVAL_CALLS = 1024
#: Stands in ``inflight`` for a message whose receive failed: its chunks are dropped.
DEAD = object()


class Staged:
    """An unexpected message: bytes that arrived before the matching receive."""

    __slots__ = ("buf", "total", "done_bytes", "opcode", "tag", "waiter", "call")

    def __init__(self, buf: memoryview, total: int, opcode: int, tag: int, call: int = 0):
        self.buf = buf
        self.total = total
        self.done_bytes = 0
        self.opcode = opcode
        self.tag = tag
        self.call = call
        self.waiter = None  # the receive that claimed it while it was still arriving


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The facts of a message that does not fit the receive or call it met. ``reason``:
    ``"op"`` (another opcode or tag), ``"digest"`` (another call digest), ``"size"`` (another
    byte count) or ``"call"`` (a message for the tag of the current call whose digest differs
    from the call's, met by ``begin_call`` or on arrival, no receive involved)."""

    reason: str
    peer: int
    channel: int
    their_opcode: int
    their_tag: int
    their_total: int
    their_digest: int
    my_opcode: int = 0
    my_tag: int = 0
    my_total: int = 0
    my_digest: int = 0
    my_desc: str = ""


class PeerMatch:
    """The matching state of one peer."""

    __slots__ = ("rank", "send_counters", "recv_counters", "posted", "inflight", "unexpected")

    def __init__(self, rank: int):
        self.rank = rank
        self.send_counters: dict = {}
        self.recv_counters: dict = {}
        self.posted: dict = {}      # key -> receive (posted, no byte seen yet)
        self.inflight: dict = {}    # key -> receive, Staged or DEAD, being filled
        self.unexpected: dict = {}  # key -> Staged (arrived or arriving, no receive yet)


def _next(counters: dict, key) -> int:
    n = counters.get(key, 0)
    counters[key] = n + 1
    return n


class Matcher:
    """Posted receives, any-source receives, staged messages and message numbers of the peers
    of one rank. Receives are objects with the attributes of ``request.Request`` (``peer``,
    ``buf``, ``total``, ``channel``, ``tag``, ``msgno``, ``opcode``, ``call``, ``desc``,
    ``done_bytes``, ``error``); the matcher sets ``peer``, ``msgno``, ``done_bytes`` and
    ``error`` and never completes them."""

    def __init__(self, peers, max_unexpected_bytes: int = 1 << 34, keep_bytes: int = 64 << 20,
                 checked_channel: int = CHANNEL_COLLECTIVE, anysource_channel: int = CHANNEL_P2P):
        self.lock = threading.Lock()
        self.peers: dict[int, PeerMatch] = {p: PeerMatch(p) for p in peers}
        self.max_unexpected_bytes = max_unexpected_bytes
        self.keep_bytes = keep_bytes
        self.checked = checked_channel
        self.anysource_channel = anysource_channel
        self.anysource: dict[int, collections.deque] = {}   # tag -> parked any-source receives
        self.calls: dict[int, tuple[int, str]] = {}          # tag -> (digest, desc) of the call
        #: Messages that arrived before their receive (each copied once), and bytes staged now.
        self.staged_messages = 0
        self.staged_bytes = 0
        #: (Staged, receive) pairs that became deliverable inside ``incoming`` (parked
        #: any-source receives bound to messages staged out of order); see take_ready().
        self.ready: list = []
        self._free: dict[int, list] = {}
        self._kept = 0
        #: tag -> {peer: time.perf_counter() of the first chunk of its first message of the
        #: call} on the checked channel; None: not recorded (Context.record_arrivals).
        self.arrivals: dict[int, dict] | None = None

    # ------------------------------------------------------------------ sends
    def next_send(self, peer: int, channel: int, tag: int) -> int:
        """*Lock held.* The message number of the next unslotted send on (peer, channel, tag)."""
        return _next(self.peers[peer].send_counters, (channel, tag))

    # ------------------------------------------------------------------ receives
    def post(self, req, slot: int | None, peer_failed: bool = False):
        """*Lock held.* Post a receive from ``req.peer``. Returns a Staged message to deliver
        to it now (:meth:`deliver`; ``req.error`` set if it does not match), or None: the
        receive is registered (posted, or waiting for a staged message still arriving). With
        ``peer_failed`` and nothing staged, nothing more will come: the receive is not
        registered and ``req.error`` is set to True (the caller puts the peer's failure)."""
        p = self.peers[req.peer]
        req.msgno = slot if slot is not None else _next(p.recv_counters, (req.channel, req.tag))
        staged = self._claim(p, req, peer_failed)
        if staged is None and peer_failed and req.error is None:
            p.posted.pop((req.channel, req.tag, req.msgno), None)
            req.error = True
        return staged

    def post_anysource(self, req, failed=frozenset()):
        """*Lock held.* A receive from any peer (``req.peer`` None) on the any-source channel:
        bound to the first peer whose next message of that tag is staged (``req.peer`` is set;
        returns what :meth:`post` would), else parked until one arrives. ``failed``: the ranks
        that can send no more; when that is every peer, returns False (and parks nothing)."""
        key = (self.anysource_channel, req.tag)
        for p in self.peers.values():
            n = p.recv_counters.get(key, 0)
            if (self.anysource_channel, req.tag, n) in p.unexpected:
                req.peer = p.rank
                req.msgno = n
                p.recv_counters[key] = n + 1
                return self._claim(p, req, p.rank in failed)
        if self.peers and all(r in failed for r in self.peers):
            return False
        self.anysource.setdefault(req.tag, collections.deque()).append(req)
        return None

    def _claim(self, p: PeerMatch, req, peer_failed: bool):
        key = (req.channel, req.tag, req.msgno)
        staged = p.unexpected.pop(key, None)
        if staged is None:
            if key in p.posted or key in p.inflight:
                raise ValueError(f"a receive for message {key} from rank {p.rank} is already posted")
            p.posted[key] = req
            return None
        err = self.check(p.rank, req, staged.opcode, staged.tag, staged.total, staged.call)
        if err is not None:
            req.error = err
            return staged
        if staged.done_bytes < staged.total:
            if peer_failed:
                req.error = True
                return staged
            staged.waiter = req  # delivered by arrived() when the rest comes
            p.unexpected[key] = staged
            return None
        return staged

    def deliver(self, staged: Staged, req) -> None:
        """Copy a fully arrived staged message into its receive's buffer (no lock needed; the
        staging buffer goes back to the pool)."""
        np.copyto(np.frombuffer(req.buf, np.uint8), np.frombuffer(staged.buf, np.uint8))
        req.done_bytes = staged.total
        self.recycle(staged.buf)

    def check(self, peer: int, req, opcode: int, tag: int, total: int, digest: int = 0):
        """The Mismatch between a receive and a message's facts, or None if they match."""
        if req.channel == self.checked:
            if tag != req.tag or opcode != req.opcode:
                reason = "op"
            elif digest != req.call:
                reason = "digest"
            elif total != req.total:
                reason = "size"
            else:
                return None
        elif total != req.total:
            reason = "size"
        else:
            return None
        return Mismatch(reason, peer, req.channel, opcode, tag, total, digest,
                        req.opcode, req.tag, req.total, req.call, req.desc)

    # ------------------------------------------------------------------ arrivals
    def incoming(self, peer: int, opcode: int, channel: int, tag: int, msgno: int, total: int,
                 digest: int = 0):
        """*Lock held.* A chunk of message (channel, tag, msgno) of ``total`` bytes arrives from
        ``peer``: returns (target, failed): the receive or Staged its bytes go into (None: drop
        them), and a (receive or None, Mismatch) pair to fail, or None. Raises FrameError for
        what no valid peer sends (a chunk whose total differs from its message's, a staged
        message over ``max_unexpected_bytes``)."""
        p = self.peers[peer]
        key = (channel, tag, msgno)
        target = p.inflight.get(key)
        if target is not None:
            if target is DEAD:
                return None, None
            if target.total != total:  # its chunk would not fit the buffer
                raise FrameError(f"a chunk of message {key} announces {total} bytes, its "
                                 f"first chunk {target.total}")
            return target, None
        arr = self.arrivals
        if arr is not None and channel == self.checked:  # a message's first chunk
            a = arr.get(tag)
            if a is None:
                if len(arr) >= _MAX_ARRIVAL_CALLS:  # calls that never ended (failed ones)
                    arr.clear()
                arr[tag] = {peer: time.perf_counter()}
            elif peer not in a:
                a[peer] = time.perf_counter()
        req = p.posted.pop(key, None)
        if req is None and channel == self.anysource_channel:
            waiting = self.anysource.get(tag)
            ck = (channel, tag)
            if waiting and p.recv_counters.get(ck, 0) == msgno:
                req = waiting.popleft()
                req.peer = peer
                req.msgno = msgno
                p.recv_counters[ck] = msgno + 1
                # Later messages of this peer may have started first (other streams) and be
                # staged: they belong to the next parked receives, in order.
                while waiting and (channel, tag, p.recv_counters[ck]) in p.unexpected:
                    nxt = waiting.popleft()
                    nxt.peer = peer
                    nxt.msgno = p.recv_counters[ck]
                    p.recv_counters[ck] += 1
                    st = self._claim(p, nxt, False)
                    if st is not None:
                        self.ready.append((st, nxt))
        if req is not None:
            err = self.check(peer, req, opcode, tag, total, digest)
            if err is not None:
                if total:
                    p.inflight[key] = DEAD
                return None, (req, err)
            p.inflight[key] = req
            return req, None
        current = self.calls.get(tag) if channel == self.checked else None
        if current is not None and current[0] != digest:  # a message this call never takes
            if total:
                p.inflight[key] = DEAD
            return None, (None, Mismatch("call", peer, channel, opcode, tag, total, digest,
                                         my_tag=tag, my_digest=current[0], my_desc=current[1]))
        if total > self.max_unexpected_bytes:
            raise FrameError(f"unexpected message of {total} bytes exceeds "
                             f"LINERATE_MAX_UNEXPECTED_BYTES={self.max_unexpected_bytes}")
        staged = Staged(self._buffer(total), total, opcode, tag, digest)
        self.staged_messages += 1
        p.unexpected[key] = staged
        p.inflight[key] = staged
        return staged, None

    def take_ready(self) -> list:
        """*Lock held.* The (Staged, receive) pairs ``incoming`` made deliverable (each to
        :meth:`deliver`, or to fail with its ``error``, outside the lock)."""
        out, self.ready = self.ready, []
        return out

    def arrived(self, peer: int, target, channel: int, tag: int, msgno: int, length: int):
        """*Lock held.* ``length`` more bytes of ``target`` (from :meth:`incoming`) are in.
        Returns what became complete: a receive to finish, a (Staged, receive) pair to
        :meth:`deliver` then finish, or None."""
        target.done_bytes += length
        if target.done_bytes < target.total:
            return None
        p = self.peers[peer]
        key = (channel, tag, msgno)
        del p.inflight[key]
        if isinstance(target, Staged):
            waiter, target.waiter = target.waiter, None
            if waiter is None:
                return None
            p.unexpected.pop(key, None)
            return target, waiter
        return target

    # ------------------------------------------------------------------ calls
    def begin_call(self, tag: int, digest: int, desc: str = ""):
        """*Lock held.* This rank enters the call ``tag`` with ``digest``: the Mismatch of a
        staged message of that tag with another digest, or None."""
        self.calls[tag] = (digest, desc)
        for p in self.peers.values():
            for (channel, t, _), st in p.unexpected.items():
                if channel == self.checked and t == tag and st.call != digest:
                    return Mismatch("call", p.rank, channel, st.opcode, tag, st.total, st.call,
                                    my_tag=tag, my_digest=digest, my_desc=desc)
        return None

    def end_call(self, tag: int):
        """*Lock held.* The call ``tag`` ended: its arrivals (peer -> time the first chunk of
        the peer's first message of ``tag`` came) while ``arrivals`` are recorded, else None."""
        self.calls.pop(tag, None)
        arr = self.arrivals
        return arr.pop(tag, None) if arr is not None else None

    def staged_for(self, peer: int) -> list[tuple[int, int, int]]:
        """*Lock held.* (channel, tag, opcode) of each message from ``peer`` that arrived (or is
        arriving) and waits for its receive."""
        return [(k[0], k[1], st.opcode) for k, st in self.peers[peer].unexpected.items()]

    # ------------------------------------------------------------------ failures
    def take_peer(self, peer: int, anysource_too: bool) -> list:
        """*Lock held.* Every receive that waits for ``peer`` (posted, being filled, waiting for
        a staged message); with ``anysource_too`` the parked any-source receives as well. They
        are unregistered: later chunks of their messages are staged as unexpected."""
        p = self.peers[peer]
        out = list(p.posted.values())
        out += [t for t in p.inflight.values() if t is not DEAD and not isinstance(t, Staged)]
        out += [t.waiter for t in p.unexpected.values() if t.waiter is not None]
        p.posted.clear()
        p.inflight.clear()
        if anysource_too:
            out += self.take_anysource()
        return out

    def take_anysource(self) -> list:
        """*Lock held.*"""
        out = [r for dq in self.anysource.values() for r in dq]
        self.anysource.clear()
        return out

    def take_channel(self, channel: int | None) -> list:
        """*Lock held.* Every registered receive on ``channel`` (None: all, any-source ones
        included); the rest of their messages' bytes are dropped."""
        out = []
        for p in self.peers.values():
            for key, r in list(p.posted.items()):
                if channel is None or r.channel == channel:
                    out.append(p.posted.pop(key))
            for key, r in list(p.inflight.items()):
                if r is not DEAD and not isinstance(r, Staged) and (channel is None or r.channel == channel):
                    out.append(r)
                    p.inflight[key] = DEAD
            for staged in p.unexpected.values():
                w = staged.waiter
                if w is not None and (channel is None or w.channel == channel):
                    out.append(w)
                    staged.waiter = None
        if channel is None:
            out += self.take_anysource()
        return out

    # ------------------------------------------------------------------ staging buffers
    def _buffer(self, n: int) -> memoryview:
        """*Lock held.* A staging buffer of n bytes. Kept buffers are reused: fresh pages would
        cost a fault and a zeroing per 4 KiB on the receive path."""
        self.staged_bytes += n
        free = self._free.get(n)
        if free:
            self._kept -= n
            return free.pop()
        return anon_bytes(n)  # no zero-fill: the bytes are overwritten; unmapped when dropped

    def waiting(self, peer: int) -> bool:
        """*Lock held.* Whether a receive from ``peer`` (or from any peer) is posted and not
        yet filled."""
        p = self.peers[peer]
        return bool(p.posted or p.inflight or any(self.anysource.values()))

    def forget(self, staged: Staged) -> None:
        """*Lock held.* A staged message that no receive will copy (it did not match): its
        buffer is left to the garbage collector (bytes of it may still be arriving)."""
        self.staged_bytes -= staged.total

    def recycle(self, buf: memoryview) -> None:
        """A staging buffer's bytes were copied out: keep it for reuse (up to ``keep_bytes``).
        Takes the lock."""
        n = buf.nbytes
        with self.lock:
            self.staged_bytes -= n
            if self._kept + n <= self.keep_bytes:
                self._free.setdefault(n, []).append(buf)
                self._kept += n


__all__ = ["Matcher", "Mismatch", "PeerMatch", "Staged", "DEAD"]
