"""Shared memory as a link (kind ``shm``): point-to-point messages between ranks of one host.

Ranks of one host that proved their host's segment at rendezvous (transport/shm: same host,
a 0600 segment with a random name, opened only after its creator's HMAC of the job secret
checked out, unlinked once every rank mapped it) talk through it instead of loopback TCP. The
segment's point-to-point area (``shm.p2p_layout``) holds:

- per segment rank a block: its *progress bell* (an int32 futex word, apart from the bells the
  collectives use, so that neither steals the other's wake-ups), its pid and pid namespace;
- per ordered pair (i -> j) a ring: a header page (``head``: bytes the producer i wrote,
  ``tail``: bytes the consumer j took, each in its own cache line; flags: the producer gave up,
  the consumer gave up) and ``shm.p2p_ring_bytes`` data bytes (2 MiB for up to 8 local ranks,
  halved as ranks grow, at least 64 KiB).

A ring carries the frames of transport/framing.py (its codec: ``SendQueue`` cuts the frames,
``FrameReader`` reads them), each padded to 8 bytes, wrapping around the ring's end. A message
is cut into chunks of at most a quarter of the ring, so that the producer writes the next chunk
while the consumer copies the last one out.

The producer is whoever holds the link's send lock: the thread that calls ``isend`` writes what
fits at once (no hand-off for a small message), the progress thread the rest. The consumer is
only the progress thread: it copies what arrived into what the reader needs (a header, then
the buffer the sink claimed for the payload: the bytes go there straight from the ring). Each
side rings the other's progress bell (FUTEX_WAKE_OP: an atomic add, a full barrier, and a
wake) after publishing its position.

ONE progress thread per process serves every shm link of every group: it sleeps on the
progress bells of all its groups at once (``futex_waitv``, Linux 5.16+; before that, on one
bell with a short timeout), so a rank waiting for a message burns no CPU. It also checks that
the peers of its links are alive (one poll of their pidfds, ``sync.PidWatch``; zombies count as
dead; same pid namespace only): a death watch thread blocked on those pidfds wakes it when one
exits, and where some peer cannot be watched through a pidfd it looks every ``POLL_S``. A
co-located rank that dies fails its links with a ``PeerFailure`` naming it. An orderly close
writes a CLOSE frame (the peer gets ``link_closed``);
a close that leaves data behind raises the ring's "gone" flag (the peer gets ``link_failed``).

Memory order: positions are published after the bytes they cover; x86's stores are not
reordered with stores nor loads with loads; elsewhere a fence (an atomic add) goes between.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import select
import threading
import time
import weakref

import numpy as np

from .. import shm
from . import sync
from ..framing import CLOSE_FRAME, HEADER_SIZE, FrameError, FrameReader, SendQueue
from ..link import FLUSH_GIVE_UP_S, Link, LinkSink
from ..request import PeerFailure, ProtocolError, Request

log = logging.getLogger("linerate.transport")

#: Seconds between liveness checks of the peers (and the longest futex sleep) where some
#: peer's process cannot be watched through a pidfd.
POLL_S = 0.05
#: The longest futex sleep of the progress thread where every peer's process is watched through
#: a pidfd (_Engine._watch_run wakes it when one exits): an idle rank wakes about once a second
#: instead of every POLL_S, which on a host full of idle ranks adds up to a steady CPU load.
IDLE_S = 1.0
#: The longest wait, when a group's last port is removed, for the progress thread to be done
#: with it (_Engine.remove).
JOIN_S = 2.0
#: Seconds the progress thread and the death watch stay, idle, after the last group of the
#: process that used shared memory went: the next group's creation does not start them again
#: (each Thread.start waits until the new thread has run, a wait for a core where ranks
#: outnumber cores). Idle, they hold nothing of any group and run no torch code; at the
#: interpreter's exit they end first (``_Engine.end_idle``, an atexit handler).
LINGER_S = 10.0
_HDR = HEADER_SIZE
_ALIGN = 8                  # every frame is padded to this
_CHUNK_MAX = 512 << 10
_MIN_PART = 4096            # a chunk cut short to fit the ring's free space: at least this
# ring header (int64 words): head, tail, the producer gave up, the consumer gave up
_HEAD, _TAIL, _WGONE, _RGONE = 0, 8, 16, 24
# per-rank block: bell (int32 at byte 0); the rank's pid is the segment's (Segment.pids)
_SYS_FUTEX_WAITV = 449      # the same number on every architecture (added in Linux 5.16)
_FUTEX_32 = 2
_CLOCK_MONOTONIC = 1


class _Waitv(ctypes.Structure):
    _fields_ = [("val", ctypes.c_uint64), ("uaddr", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]


# ----------------------------------------------------------------------------- a group's area
class _Port:
    """One group's point-to-point area as this rank sees it: its bell, every rank's pid, and
    the links of the group that run over it."""

    def __init__(self, seg: shm.Segment, rank: int):
        self.seg = seg
        self.rank = rank                    # this rank's group rank
        self.me = seg.rank                  # and segment rank
        n = seg.size
        base, rings, slot, _total = shm.p2p_layout(n)
        self.raw = seg.raw                  # keeps the mapping while a link uses it
        self.ring_bytes = shm.p2p_ring_bytes(n)
        self._rings, self._slot = rings, slot
        ptr = seg.raw.ctypes.data
        blk = shm.P2P_RANK_BYTES
        self._bell_addr = [ctypes.c_void_p(ptr + base + blk * q) for q in range(n)]
        self.bell_addr = ptr + base + blk * self.me
        self.bell = self.raw[base + blk * self.me: base + blk * self.me + 4].view(np.int32)
        self._lib = sync.futex_lib() if sync.SYS_FUTEX is not None else None
        self.links: dict[int, ShmLink] = {}
        self.lock = threading.Lock()

    def ring_pair(self, src: int, dst: int):
        """(header words, data view) of the ring from segment rank src to dst."""
        off = self._rings + (src * self.seg.size + dst) * self._slot
        words = self.raw[off:off + 256].view(np.int64)
        data = memoryview(self.raw[off + shm.P2P_RING_HEADER:off + shm.P2P_RING_HEADER + self.ring_bytes])
        return words, data

    def ring(self, q: int) -> None:
        """Bump segment rank q's progress bell and wake its progress thread."""
        addrs = self._bell_addr  # [] once the group is gone (_detach)
        if self._lib is not None and q < len(addrs):
            sync.futex_add_wake(self._lib, addrs[q])

    def _pid(self, q: int) -> int:
        """Segment rank q's pid where this rank can watch it, else 0 (none recorded yet,
        or another pid namespace): the segment's record (Segment.pids)."""
        return self.seg.watchable_pid(q)

    def alive(self, q: int) -> bool:
        pid = self._pid(q)
        return not pid or self.seg.watch.alive(pid)

    def add(self, link: "ShmLink", ring: bool = True) -> None:
        """Serve ``link`` from now on; ``ring``: wake the progress thread to look at it (a
        message may have come before the link was added). ``start_links`` rings once for
        all of a group's links: a ring per link woke the progress thread once per peer."""
        with self.lock:
            first = not self.links
            self.links[link.peer] = link
        if first:
            _ENGINE.add(self)
        if ring:
            self.ring(self.me)

    def drop(self, link: "ShmLink") -> None:
        with self.lock:
            if self.links.get(link.peer) is link:
                del self.links[link.peer]
            last = not self.links
        if last:
            _ENGINE.remove(self)  # (which rings this port's bell)
            if self.seg.closed:  # the group is gone: no view of its mapping stays here
                with self.lock:
                    self._detach()

    def _detach(self) -> None:
        """Drop every view of the segment (ShmLink._detach). The progress thread may still
        read the bell once, or sleep on its address once: a private word stands in; rings
        go nowhere (an address of the unmapped segment may be reused by other memory)."""
        self.raw = None
        self.bell = np.zeros(1, dtype=np.int32)
        self.bell_addr = self.bell.ctypes.data
        self._bell_addr = []

    def check_peers(self) -> None:
        links = [(link, self._pid(link._q)) for link in list(self.links.values())
                 if link._down is None]
        gone = self.seg.watch.exited([pid for _, pid in links if pid])  # one syscall
        for link, pid in links:
            if pid in gone:
                link._peer_died()


# ----------------------------------------------------------------------------- the thread
class _Engine:
    """The progress thread of this process: serves every port's links (see the module
    docstring), with the death watch beside it. Both start with the first port that has
    links, and end LINGER_S after the last such port went (idle meanwhile)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ports: list[_Port] = []
        self._thread: threading.Thread | None = None
        #: Rounds of the progress thread begun (each starts by reading the ports): one begun
        #: after a port's removal means the thread is done with that port (_done_with).
        self._rounds = 0
        self._round_cv = threading.Condition(self._lock)
        self._ending = False  # the interpreter exits: idle threads end now (end_idle)
        self._waitv = True
        self._waitv_key = None
        self._waitv_arr = None
        #: The death watch (_watch_run): a thread blocked in poll() on the peers' pidfds and
        #: on a pipe (``_poke``: the set of pidfds may have changed, or no port is left).
        self._watcher: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._look = False                 # a peer's process may have exited: check_peers
        self._looked = threading.Event()   # the progress thread did
        #: The engine's own futex word (private memory), in every sleep of the progress thread
        #: beside the ports' bells: add and remove bump it, so a new group's port is served at
        #: once (its own bell is not among those the thread sleeps on yet).
        self._word = np.zeros(1, dtype=np.int32)
        self._word_addr = self._word.ctypes.data

    def _wake(self) -> None:
        """Bump the engine's word and wake the progress thread sleeping on it."""
        if sync.SYS_FUTEX is not None:
            sync.futex_add_wake(sync.futex_lib(), ctypes.c_void_p(self._word_addr))

    def add(self, port: _Port) -> None:
        with self._lock:
            self._ending = False
            if port not in self._ports:
                self._ports.append(port)
                if self._thread is not None:
                    self._wake()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="linerate-shm-progress",
                                                daemon=True)
                self._thread.start()
            if self._watcher is None and hasattr(os, "pidfd_open"):
                try:
                    if self._pipe is None:
                        self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:
                    return  # no death watch: the progress thread looks every POLL_S
                self._watcher = threading.Thread(target=self._watch_run,
                                                 name="linerate-shm-deaths", daemon=True)
                self._watcher.start()

    def _poke(self) -> None:
        """Have the death watch read the pidfds again (or end: no port left)."""
        pipe = self._pipe
        if pipe is not None:
            try:
                os.write(pipe[1], b"x")
            except OSError:  # full (EAGAIN): a poke is pending anyway
                pass

    def _watching(self) -> bool:
        return self._watcher is not None and self._pipe is not None

    def _watch_run(self) -> None:
        """The death watch: sleeps in poll() until a watched peer's process exits (its pidfd
        turns readable; a closed one reads as POLLNVAL), then has the progress thread look
        (``_look``, and a ring of one port's bell) and waits until it did (the look closes a
        dead process's pidfd, so the same exit is not seen again)."""
        rfd = self._pipe[0]
        idle_since = None
        while True:
            with self._lock:
                ports = list(self._ports)
                if ports:
                    idle_since = None
                else:
                    idle_since, over = self._idle(idle_since)
                    if over:
                        self._watcher = None
                        return
            fds = [fd for port in ports for fd in port.seg.watch.fds()]
            ports = None  # no group's port is held while asleep
            poller = select.poll()
            poller.register(rfd, select.POLLIN)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(None if fds else LINGER_S * 1000)
            except OSError:  # EINTR and kin: look again
                events = []
            died = False
            for fd, _ in events:
                if fd == rfd:
                    try:
                        while os.read(rfd, 4096):
                            pass
                    except OSError:  # EAGAIN: drained
                        pass
                else:
                    died = True
            if died:
                with self._lock:
                    # (none left: the last group went, its pidfds closed: POLLNVAL)
                    first = self._ports[0] if self._ports else None
                if first is not None:
                    self._looked.clear()
                    self._look = True
                    first.ring(first.me)  # one bell wakes it (its futex_waitv has them all)
                    first = None
                    self._looked.wait(POLL_S)

    def remove(self, port: _Port) -> None:
        with self._lock:
            if port in self._ports:
                self._ports.remove(port)
            last = not self._ports
            thread, rounds = self._thread, self._rounds
        self._wake()
        port.ring(port.me)  # where there is no futex_waitv, the thread may sleep on its bell
        self._poke()  # its pidfds are no longer watched
        # The last port gone, the threads linger idle (LINGER_S), but the progress thread may
        # still be in a pass over this port (a link's copy into a tensor, the last reference
        # to one): wait until it began another round. A process that exits right after
        # destroy_process_group would otherwise finalize the interpreter under that pass,
        # and a daemon thread in torch's C++ code then aborts the process ("terminate called
        # without an active exception", SIGABRT).
        if last and thread is not None and thread is not threading.current_thread():
            self._done_with(rounds, thread)

    def end_idle(self) -> None:
        """(atexit) End the threads now if no group uses them, and wait for them: no thread of
        ours runs on into the interpreter's finalization, where a daemon thread taking the GIL
        back is ended by pthread_exit. (Where a group is still up at exit, they are left
        running.)"""
        with self._lock:
            if self._ports:
                return
            self._ending = True
            threads = [t for t in (self._thread, self._watcher) if t is not None]
        self._wake()
        self._poke()
        for t in threads:
            t.join(JOIN_S)

    def _idle(self, since: float | None) -> tuple[float, bool]:
        """(lock held, no port left) When a thread's idle spell began (``since``, None: now),
        and whether it is over: LINGER_S passed, or the interpreter exits (end_idle)."""
        now = time.monotonic()
        since = now if since is None else since
        return since, now - since >= LINGER_S or self._ending

    def _done_with(self, rounds: int, thread: threading.Thread) -> None:
        """Wait (up to JOIN_S) until the progress thread began a round after ``rounds`` (every
        round, its last included, begins with a notify)."""
        with self._round_cv:
            self._round_cv.wait_for(lambda: self._rounds != rounds or not thread.is_alive(),
                                    JOIN_S)

    def threads(self) -> int:
        return (self._thread is not None) + (self._watcher is not None)

    def _run(self) -> None:
        last_check = 0.0
        checked: tuple = ()   # the ports (ids) whose pidfds the death watch has
        every = POLL_S        # between looks at the peers: IDLE_S once the death watch has them
        #: Each port's bell as read before its links were last served, for the ports whose
        #: links were all idle then (id(port) -> value). Everything that gives a link work
        #: rings its port's bell (a peer's write or read, a local send, close, a new link), so
        #: a port whose bell still reads the same has nothing to do: a wake-up for one port (or
        #: the POLL_S look at the peers' processes) serves only what changed, not every link
        #: of every group (on 32 ranks, 31 idle links per wake-up: a steady CPU cost for an idle
        #: group). A weak reference tells a port from a later one at the same
        #: address, without keeping a destroyed group's mapping.
        quiet: dict[int, tuple] = {}
        idle_since = None
        while True:
            word = int(self._word[0])  # before the ports: an add after this ends the sleep
            with self._lock:
                ports = list(self._ports)
                self._rounds += 1
                self._round_cv.notify_all()
                if not ports:
                    idle_since, over = self._idle(idle_since)
                    if over:
                        self._thread = None
                        return
            if not ports:
                quiet.clear()
                self._sleep_word(word, LINGER_S - (time.monotonic() - idle_since))
                continue
            idle_since = None
            seen = [int(p.bell[0]) for p in ports]
            busy = False
            calm: dict[int, tuple] = {}
            for port, bell in zip(ports, seen):
                key = id(port)
                was = quiet.get(key)
                if was is not None and was[0] == bell and was[1]() is port:
                    calm[key] = was
                    continue
                did = False
                for link in list(port.links.values()):
                    try:
                        did |= link._progress()
                    except Exception:  # noqa: BLE001 - never lose the thread
                        log.exception("rank %d: shared-memory link to rank %d", port.rank, link.peer)
                if did:
                    busy = True
                else:
                    calm[key] = (bell, weakref.ref(port))
            quiet = calm
            now = time.monotonic()
            key = tuple(id(p) for p in ports)
            if self._look or key != checked or now - last_check >= every:
                self._look = False
                last_check = now
                before = sum(len(p.seg.watch.fds()) for p in ports)
                for port in ports:
                    port.check_peers()  # opens the pidfds of new peers, closes the dead's
                # Whether the death watch sees every peer (asked here, not on every round:
                # it changes only when check_peers opens or closes pidfds).
                watched = self._watching() and not any(p.seg.watch.polled() for p in ports)
                every = IDLE_S if watched else POLL_S
                if watched and (key != checked or
                                sum(len(p.seg.watch.fds()) for p in ports) != before):
                    self._poke()
                checked = key
                self._looked.set()
            port = link = None  # a destroyed group's mapping must not wait for the next round
            if not busy:
                self._sleep(ports, seen, every, word)
            ports = None

    def _sleep_word(self, word: int, timeout: float) -> None:
        """Until the engine's word changes from ``word`` (a port added, or removed), or
        ``timeout`` seconds."""
        timeout = max(0.0, timeout)
        if sync.SYS_FUTEX is None:
            time.sleep(min(timeout, POLL_S))
        else:
            sync.futex_wait(sync.futex_lib(), ctypes.c_void_p(self._word_addr), word, timeout)

    def _sleep(self, ports: list, seen: list, timeout: float, word: int) -> None:
        """Until a port's bell or the engine's word (``word``: its value before the ports
        were read) changes, or ``timeout`` seconds."""
        lib = ports[0]._lib
        if lib is None:
            time.sleep(0.0005)
            return
        if self._waitv and len(ports) < 128:
            key = (self._word_addr,) + tuple(p.bell_addr for p in ports)
            if key != self._waitv_key:
                arr = (_Waitv * len(key))()
                for i, addr in enumerate(key):
                    arr[i].uaddr = addr
                    arr[i].flags = _FUTEX_32
                self._waitv_key, self._waitv_arr = key, arr
            arr = self._waitv_arr
            arr[0].val = word & 0xFFFFFFFF
            for i, v in enumerate(seen):
                arr[i + 1].val = v & 0xFFFFFFFF
            end = time.monotonic() + timeout
            ts = sync.Timespec(int(end), int((end % 1.0) * 1e9))
            r = lib.syscall(_SYS_FUTEX_WAITV, arr, len(key), 0, ctypes.byref(ts), _CLOCK_MONOTONIC)
            # EFAULT: a destroyed group's bell, unmapped since the ports were read
            if r == -1 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR,
                                                      errno.EFAULT):
                self._waitv = False  # not available (ENOSYS) or refused: never spin on it
            return
        # No futex_waitv: one bell, then look at all (and at the ports: a new one's bell is
        # not this one), briefly where there are several.
        sync.futex_wait(lib, ctypes.c_void_p(ports[0].bell_addr), seen[0],
                        min(timeout, 0.002 if len(ports) > 1 else POLL_S))


_ENGINE = _Engine()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads, and its groups are not the child's:
    a fresh engine (the parent's lingering threads would otherwise be taken for running)."""
    global _ENGINE
    old, _ENGINE = _ENGINE, _Engine()
    for fd in old._pipe or ():
        try:
            os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(lambda: _ENGINE.end_idle())


def progress_threads() -> int:
    """Threads this module runs now: the progress thread and the death watch (0 to 2)."""
    return _ENGINE.threads()


# ----------------------------------------------------------------------------- the link
class ShmLink(Link):
    """A link to a co-located rank over the group's shared segment (module docstring)."""

    kind = "shm"

    def __init__(self, port: _Port, peer: int, peer_seg_rank: int, *, rank: int):
        self.peer = peer
        self.rank = rank
        self.speed_bps = None
        self._port = port
        self._q = peer_seg_rank
        self._oh, self._out = port.ring_pair(port.me, peer_seg_rank)
        self._ih, self._in = port.ring_pair(peer_seg_rank, port.me)
        self._R = port.ring_bytes
        self._mask = self._R - 1
        self._chunk = min(_CHUNK_MAX, self._R // 4)
        self._lock = threading.Lock()      # the send side: queue, head, the out ring
        self._rlock = threading.Lock()     # the receive side (the progress thread)
        self._queue = SendQueue(self._chunk, min_part=_MIN_PART)
        self._reader = FrameReader(self._R, align=_ALIGN)
        # Where this link's positions start: 0. Each group's segment is new (zero-filled), and
        # these two words are written by this link only. (Reading them here touched both ring
        # header pages of every pair at group creation: a page fault each, most of a link's
        # cost, for pairs that may never talk.)
        self._head = 0
        self._tail_in = 0
        self._closing = False
        self._close_sent = False
        self._down: str | None = None
        # CLOSE written, or the link is down (_set_sent, send lock held); the Event only for a
        # waiter (wait_sent): one per link would be a large share of a link's creation cost.
        self._sent = False
        self._sent_ev: threading.Event | None = None
        self._sink: LinkSink | None = None
        self._ack = (self._head, time.monotonic())

    # ------------------------------------------------------------------ Link
    @property
    def nstreams(self) -> int:
        return 1

    def start(self, sink: LinkSink, ring: bool = True) -> None:
        """``ring``: wake the progress thread to look at this link (``start_links`` wakes it
        once for all of a group's links)."""
        self._sink = sink
        self._port.add(self, ring)

    def isend(self, req: Request) -> bool:
        with self._lock:
            if self._down is not None or self._closing:
                return False
            self._queue.put(req)
            finished: list = []
            moved = self._push(finished)
        self._after_push(moved, finished)
        return True

    def send_control(self, kind: int, payload: bytes = b"", value: int = 0) -> bool:
        with self._lock:
            if self._down is not None:
                return False
            self._queue.put_control(kind, payload, value)
            finished: list = []  # sends behind the frame may complete in this push too
            moved = self._push(finished)
        self._after_push(moved, finished)
        return True

    def flush_control(self, until: float) -> bool:
        # A frame in the ring stays readable after this process exits: push what the ring
        # takes (here, not waiting for the progress thread, which may be the caller).
        while True:
            with self._lock:
                if self._down is not None:
                    return False
                if self._queue.controls <= 0:
                    return True
                finished: list = []
                moved = self._push(finished)
            self._after_push(moved, finished)
            if time.monotonic() >= until or self.unacknowledged_s() > FLUSH_GIVE_UP_S:
                return False  # (a peer that reads nothing would not get it in time)
            time.sleep(0.001)

    def cancel(self, match=None, underway: bool = True) -> list:
        with self._lock:
            return self._queue.cancel(match, underway)

    def send_mark(self):
        with self._lock:
            return self._queue.mark()

    def unacknowledged_s(self) -> float:
        tail, now = int(self._oh[_TAIL]), time.monotonic()
        if tail == self._head or tail != self._ack[0]:
            self._ack = (tail, now)
            return 0.0
        return now - self._ack[1]

    def stats(self) -> dict:
        with self._lock:
            queued = self._queue.queued_bytes() + max(0, self._head - int(self._oh[_TAIL]))
            state = self._down or ("closed" if self._closing else "up")
        sent, received = self._queue.bytes, self._reader.bytes
        conn = {"index": 0, "local": "shm", "remote": "shm", "device": "shm",
                "sent_bytes": sent, "received_bytes": received}
        return {"kind": self.kind, "peer": self.peer, "state": state, "speed_bps": None,
                "bytes_sent": sent, "bytes_received": received,
                "messages_sent": self._queue.messages, "messages_received": self._reader.messages,
                "queued_bytes": queued, "retransmits": None, "connections": [conn]}

    def begin_close(self) -> None:
        with self._lock:
            self._closing = True
            finished: list = []  # sends that complete in this push are finished below
            moved = self._push(finished)
            if self._down is not None or int(self._oh[_RGONE]):
                self._set_sent()  # nothing more can go: the peer closed or the link is down
        self._after_push(moved, finished)
        self._port.ring(self._port.me)  # the progress thread sends the rest, then CLOSE

    def wait_sent(self, until: float) -> None:
        with self._lock:
            if self._sent:
                return
            if self._sent_ev is None:
                self._sent_ev = threading.Event()
            ev = self._sent_ev
        ev.wait(max(0.0, until - time.monotonic()))

    def _set_sent(self) -> None:
        """(send lock held) Nothing more will be written: wake a wait_sent."""
        self._sent = True
        if self._sent_ev is not None:
            self._sent_ev.set()

    def close(self, deadline: float) -> None:
        self.begin_close()
        with self._lock:
            if not self._close_sent:
                self._oh[_WGONE] = 1   # what is left will not come: the peer fails the link
            if self._down is None:
                self._down = "closed"
            self._set_sent()
        self._ih[_RGONE] = 1           # and nothing more is read here
        port = self._port
        port.ring(self._q)
        with self._rlock:              # the progress thread is done with our buffers
            port.drop(self)
            with self._lock:
                self._detach()

    def detach(self) -> None:
        """(Link.detach) Nothing to do: closing let go of the sink already (_detach), and its
        None tells the progress thread to leave this link alone."""

    def _detach(self) -> None:
        """Closed: keep private copies of the ring headers and no view of the segment, so that
        the group's mapping goes at destroy_process_group even while this object lives on (a
        user's reference to the group, or a reference cycle that waits for the collector: a
        destroyed group's segment had stayed mapped, its /dev/shm space in use, until then)."""
        self._oh, self._ih = self._oh.copy(), self._ih.copy()
        self._out = self._in = memoryview(b"")
        self._reader.stop()
        self._sink = None  # the Context holds this link: no cycle back to it

    # ------------------------------------------------------------------ moving bytes
    def _after_push(self, moved: bool, finished: list) -> None:
        if moved:
            self._port.ring(self._q)
        for req in finished:
            req.finish()

    def _put(self, pos: int, data) -> None:
        p = pos & self._mask
        n = len(data)
        first = self._R - p
        out = self._out
        if n <= first:
            out[p:p + n] = data
        else:
            out[p:] = data[:first]
            out[:n - first] = data[first:]

    def _get(self, pos: int, dest) -> None:
        p = pos & self._mask
        n = len(dest)
        first = self._R - p
        src = self._in
        if n <= first:
            dest[:] = src[p:p + n]
        else:
            dest[:first] = src[p:]
            dest[first:] = src[:n - first]

    def _push(self, finished: list) -> bool:
        """Write what fits of the queue into the out ring (send lock held); True if anything
        was written. Finished sends go to ``finished`` (finished outside the lock)."""
        q = self._queue
        if self._down is not None or (not len(q) and (self._close_sent or not self._closing)):
            return False
        if int(self._oh[_RGONE]):
            if self._closing:
                self._set_sent()
            return False   # the peer stopped reading: the progress thread fails the link
        head = self._head
        free = self._R - (head - int(self._oh[_TAIL]))
        moved = False
        put = self._put
        while True:
            frame = q.take(free & ~(_ALIGN - 1))  # (a frame that fits, padded, fits in free)
            if frame is None:
                break
            req, parts, n = frame
            pos = head
            for part in parts:
                put(pos, part)
                pos += len(part)
            rec = pos - head + (head - pos) % _ALIGN
            head += rec
            free -= rec
            moved = True
            if q.written(req, n):
                finished.append(req)
        if not len(q) and self._closing and not self._close_sent and free >= _HDR:
            put(head, CLOSE_FRAME)
            head += _HDR
            self._close_sent = True
            moved = True
        if moved:
            if sync.WEAK_ORDER:
                self._port.ring(self._port.me)  # a fence: the bytes before the position
            self._head = head
            self._oh[_HEAD] = head
            if self._close_sent:
                self._set_sent()
        return moved

    def _pull(self) -> bool:
        """Take what arrived in the in ring (the progress thread, receive lock held)."""
        head = int(self._ih[_HEAD])
        tail = self._tail_in
        if head == tail or self._reader.done:
            if int(self._ih[_WGONE]) and self._down is None:
                self._fail(PeerFailure(self.peer, f"rank {self.rank}: rank {self.peer} closed its "
                                                  f"shared-memory link to rank {self.rank} before "
                                                  f"sending everything it had queued"))
            return False
        if sync.WEAK_ORDER:
            self._port.ring(self._port.me)
        sink, reader, get = self._sink, self._reader, self._get
        freed = 0
        closed = False
        while tail != head and not closed:
            view = reader.need()
            n = min(len(view), head - tail)
            get(tail, view[:n] if n < len(view) else view)
            view = None
            tail += n
            freed += n
            closed = reader.advance(n, self, sink)
            if freed >= self._chunk:  # the producer may wait for room: tell it now
                freed = 0
                self._tail_in = tail
                self._ih[_TAIL] = tail
                self._port.ring(self._q)
            if tail == head:
                head = int(self._ih[_HEAD])
        self._tail_in = tail
        self._ih[_TAIL] = tail
        self._port.ring(self._q)
        if closed:
            self._peer_closed()
        return True

    def _progress(self) -> bool:
        """One round of the progress thread for this link: receive, then send."""
        did = False
        if self._down is None:
            with self._rlock:
                if self._sink is not None and self._port.links.get(self.peer) is self:
                    try:
                        did = self._pull()
                    except (FrameError, ValueError, TypeError) as e:
                        self._fail(ProtocolError(self.peer, f"rank {self.rank}: protocol error from "
                                                          f"rank {self.peer} (shared memory): {e}"),
                                   even_closing=True)
                        return False
        if self._queue or (self._closing and not self._close_sent):
            if int(self._oh[_RGONE]) and self._down is None:
                self._fail(PeerFailure(self.peer, f"rank {self.rank}: rank {self.peer} closed its "
                                                  f"process group; sends to it cannot complete"))
                return did
            finished: list = []
            with self._lock:
                moved = self._push(finished)
            self._after_push(moved, finished)
            did |= moved
        return did

    def _peer_closed(self) -> None:
        with self._lock:
            if self._down is not None:
                return
            self._down = "closed"
            closing = self._closing
            self._set_sent()
        sink = self._sink
        if not closing and sink is not None:
            sink.link_closed(self)

    def _peer_died(self) -> None:
        with self._rlock:  # what it wrote before it died (its CLOSE, say) comes first
            if self._port.links.get(self.peer) is self and self._down is None:
                try:
                    self._pull()
                except (FrameError, ValueError, TypeError):
                    pass
        if self._down is not None:
            return
        pid = self._port.seg.pid(self._q)
        self._fail(PeerFailure(self.peer, f"rank {self.rank}: rank {self.peer} (pid {pid}, on this "
                                          f"host) exited or crashed: its process is gone "
                                          f"(shared-memory link)"))

    def _fail(self, err: BaseException, even_closing: bool = False) -> None:
        with self._lock:
            if self._closing and not even_closing:
                return
            if self._down is None:
                self._down = "failed"
            self._set_sent()
        sink = self._sink
        if sink is not None:  # None: closed (_detach), nothing waits on this link any more
            sink.link_failed(self, err)


def start_links(links: dict, sink: LinkSink) -> None:
    """``link.start(sink)`` for every link of ``build_links``, waking the progress thread
    once (at 32 ranks on one host: one ring instead of 31)."""
    port = None
    for link in links.values():
        link.start(sink, ring=False)
        port = link._port
    if port is not None:
        port.ring(port.me)


def build_links(seg: shm.Segment, rank: int, peers) -> dict[int, ShmLink]:
    """This rank's links to the co-located ``peers`` (group ranks that share ``seg``)."""
    port = _Port(seg, rank)
    return {p: ShmLink(port, p, seg.ranks.index(p), rank=rank) for p in peers}


__all__ = ["ShmLink", "build_links", "start_links", "progress_threads", "POLL_S", "IDLE_S"]
