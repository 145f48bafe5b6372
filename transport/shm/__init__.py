"""Shared memory between the ranks of one host: one segment per host of a group, proved at
rendezvous.

The ranks of a group are grouped by host (same boot id, hostname, /dev/shm file system and
network namespace: ``host_id``); hosts are ordered by their lowest rank, ranks within a host
by rank (the group's *layout*). The ranks of each host with two or more of them map one
segment that they can all read and write. The proof is that it works: the host's lowest rank
creates ``/dev/shm/linerate-<128 random bits>`` (``O_EXCL``, mode 0600), writes a random token
into it and publishes the name and ``HMAC(job secret, name + token)`` through the store at
rendezvous, before the links are chosen (the job secret never leaves the store nor the
handshake; the link to a co-located peer that proved the segment is a ``shm`` link). Every other rank of that host opens it (refusing a file that is not a regular 0600
file of its own user of the announced size), checks the token against the MAC and says so
through the store; the creator then unlinks the name, so the segment lives only as long as the
ranks' mappings: nothing is left in /dev/shm after a normal exit, ``destroy_process_group``, or
a SIGKILL. Every rank then reads every host's outcome, so that all ranks agree whether the
group has shared memory (the collectives' choice of algorithm must be the same everywhere).
A group on one host takes a shortcut: rank 0 creates a segment for all its ranks and publishes
it with the group's settings (``offer``), every rank on its host maps it before publishing its
host record, and when the records show one host that segment is proved in that single round
(``establish``).

``LINERATE_SHM``: ``auto`` (default) uses shared memory where every host's co-located ranks
proved it, and the group's TCP connections for everything otherwise (one log line says which
ranks could not and why); ``1``: co-located ranks must share memory, group creation fails on
every rank naming the ranks that cannot (ranks alone on their host need none); ``0`` never
tries. Every rank must use the same setting.

A rank alone on its host (of this group) gets no Segment; every rank gets the layout from
``establish`` beside its Segment (the transport Context keeps it as ``Context.layout``).

What the segment holds is the collectives' business (collectives/shm_algos.py), except its
point-to-point area (``p2p_layout``: the rings of transport/shm/ring.py). The transport
gives: a control row per rank (``ctrl``: int64 words), a data area (``data``: bytes), and a
bell per rank: ``ring(q)`` bumps rank q's counter in the segment and wakes it if it sleeps in
``sleep()`` (a futex on the shared page: a waiting rank burns no CPU). Each control row also
holds its rank's *cause record* (``record_cause``, read with ``causes``/``root_cause``): the
first failure that rank learnt of, the rank it blames as the root and what it knows of it,
written before that rank raises; a co-located rank that finds it gone or failed reads it there,
so that it names the rank that failed first, not one that merely exited after its own failure.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
from typing import NamedTuple

import numpy as np
import torch

from ..metrics import memcpy_rate
from ..rendezvous import multi_get, version_mismatch, version_text
from ..request import TransportError
from .sync import (FENCE_LOCK, SYS_FUTEX, WEAK_ORDER, PidWatch, futex_add_wake, futex_lib,
                   futex_wait, pid_alive, pidns, watchable_pid)

log = logging.getLogger("linerate.transport")

SHM_DIR = "/dev/shm"
#: Data bytes per rank of the group (the collectives pipeline through it in chunks).
BYTES_PER_RANK = 4 << 20
#: The segment's layout (header, bells, control rows, data and point-to-point areas): bumped
#: with any change to it. The segment's magic carries it, and the ranks compare it at rendezvous
#: with the linerate and wire versions (transport/rendezvous.py ``version_text``), so that ranks
#: of different layouts never share a segment. 3: the header records the host's copy rate and
#: the segment's creator (``_OWNER_OFF``). 4: each rank's pid is recorded once, beside its
#: bell (``_PID_IN_LINE``), for the collectives and the rings alike.
LAYOUT_VERSION = 4
_MAGIC = b"LRSHM\x00" + struct.pack("<H", LAYOUT_VERSION)
_HEADER = 4096            # magic, sizes, copy rate, token; then one bell per rank
#: The host's copy rate (a float64, bytes per second: the capacity of interface ``shm``),
#: measured by the segment's creator before it publishes the segment (``_create``).
_RATE_OFF = 24
#: The segment's creator: its pid and pid namespace (int64 each), for ``sweep_stale``.
_OWNER_OFF = 32
_TOKEN_OFF, _TOKEN_LEN = 64, 32
_SETUP_BELL_OFF = 128     # an int32 rung during set-up (SetupBoard)
_BELL_OFF = 256           # rank q's bell: an int32 at _BELL_OFF + 64 q (a cache line each)
#: Rank q's process id and pid namespace: two int64 in the rest of its bell's cache line, at
#: _BELL_OFF + 64 q + _PID_IN_LINE (bytes 8-11 hold its SetupBoard slot). Written once, when
#: the rank maps the segment; read where a rank waits for another and asks whether it still
#: runs, and for cross-memory attach: the segment's one record of its ranks' processes.
_PID_IN_LINE = 16


def _pid_slots(raw: np.ndarray, size: int) -> np.ndarray:
    """The ranks' pid slots of a mapping ``raw`` (uint8) of ``size`` ranks: row q is rank q's
    (pid, pid namespace)."""
    return np.ndarray((size, 2), dtype=np.int64, buffer=raw, offset=_BELL_OFF + _PID_IN_LINE,
                      strides=(64, 8))
_PAGE = 4096


class Layout(NamedTuple):
    """Where a group's ranks are: ``hosts[h]`` lists the group ranks of host h (hosts ordered by
    their lowest rank, ranks ascending); ``shared``: every host with two or more ranks has a
    proved segment (the same on every rank); ``machines``: the group ranks of each kernel (its
    boot), which share its cores: hosts of one machine (netlab's network namespaces) are one
    (empty: one per host); ``processes``: the group ranks of each process (threads of one
    process as ranks, as in linerate's tests; empty: one per rank)."""
    hosts: tuple
    shared: bool
    machines: tuple = ()
    processes: tuple = ()

    def cores_shared_by(self, rank: int) -> int:
        """How many of the group's ranks run on ``rank``'s machine (itself included)."""
        return next(len(m) for m in (self.machines or self.hosts) if rank in m)

    def threads_of_one_process(self, rank: int) -> bool:
        """Whether ``rank`` shares its process with other ranks of the group."""
        return any(rank in p and len(p) > 1 for p in self.processes)

    def host_of(self, rank: int) -> int:
        for h, ranks in enumerate(self.hosts):
            if rank in ranks:
                return h
        raise ValueError(f"rank {rank} is not in the layout {self.hosts}")


def group_hosts(ids: list[str]) -> tuple:
    """The layout's hosts from each rank's host id: ranks with the same id, ordered by their
    lowest rank."""
    by: dict[str, list[int]] = {}
    for r, h in enumerate(ids):
        by.setdefault(h, []).append(r)
    return tuple(tuple(v) for v in sorted(by.values(), key=lambda v: v[0]))


def pick_root(records: dict) -> tuple[int, int, str] | None:
    """The group's first failure from cause records ``{writer: (root, when, text)}`` (group
    ranks; ``when`` in one clock): (root, writer, text), or None without records. A rank that
    names itself failed on its own: the earliest of those is the root. Else the root is a rank
    that the others blame and that recorded nothing itself (killed, or on another host), the
    most blamed one; else (blames that go round) the earliest record's."""
    if not records:
        return None
    order = sorted(records.items(), key=lambda kv: (kv[1][1], kv[0]))
    for w, (root, _, text) in order:
        if root == w:
            return root, w, text
    blamed: dict[int, int] = {}
    for w, (root, _, _) in order:
        if root not in records:
            blamed[root] = blamed.get(root, 0) + 1
    if blamed:
        root = max(blamed, key=lambda r: (blamed[r], -r))
        w, (_, _, text) = next((w, rec) for w, rec in order if rec[0] == root)
        return root, w, text
    w, (root, _, text) = order[0]
    return root, w, text


class ShmError(TransportError):
    """Shared memory was asked for (LINERATE_SHM=1) and some rank cannot use it."""


class ShmRefused(Exception):
    """This rank cannot use the announced segment (the reason is the message)."""


#: A rank's cause record (``Segment.record_cause``) in its control row, after the collectives'
#: 64 words: words [CAUSE_WORD, CAUSE_WORD + CAUSE_BYTES / 8): written (1, last), the root
#: rank + 1, when (CLOCK_MONOTONIC ns: one clock for the whole host), the text's length, then
#: the text (UTF-8).
CAUSE_WORD = 64
CAUSE_BYTES = 512
_CAUSE_TEXT = CAUSE_BYTES - 32


def ctrl_row_bytes(size: int) -> int:
    """Bytes of one rank's control row: 64 words of state, the cause record, then two words
    per rank."""
    return -(-(8 * CAUSE_WORD + CAUSE_BYTES + 16 * size) // 256) * 256


def segment_layout(size: int) -> tuple[int, int, int]:
    """(offset of the control rows, offset of the data area, total bytes) for ``size`` ranks."""
    ctrl = -(-(_BELL_OFF + 64 * size) // _PAGE) * _PAGE
    data = -(-(ctrl + size * ctrl_row_bytes(size)) // _PAGE) * _PAGE
    return ctrl, data, data + size * BYTES_PER_RANK


#: Point-to-point area (transport/shm/ring.py): a block of ``P2P_RANK_BYTES`` per rank (its
#: progress bell), then one ring per ordered pair of ranks: a header page (producer's and
#: consumer's positions) and ``p2p_ring_bytes(size)`` data bytes. Pages of /dev/shm are only
#: allocated when touched, so rings of pairs that never talk cost nothing.
P2P_RANK_BYTES = 256
P2P_RING_HEADER = _PAGE
P2P_RING_MAX = 2 << 20
P2P_RING_MIN = 64 << 10
P2P_AREA_BUDGET = 128 << 20   # rings of every pair together (if all were used at once)


def p2p_ring_bytes(size: int) -> int:
    """Data bytes of one pair's ring: 2 MiB, halved for many co-located ranks so that every
    pair's ring together stays within 128 MiB, but never below 64 KiB (from 33 ranks on, the
    rings together take more)."""
    ring = P2P_RING_MAX
    while ring > P2P_RING_MIN and size * (size - 1) * ring > P2P_AREA_BUDGET:
        ring //= 2
    return ring


def p2p_layout(size: int) -> tuple[int, int, int, int]:
    """(offset of the p2p area, offset of the first ring, bytes per ring slot (header + data),
    total bytes of the segment) for ``size`` ranks."""
    base = segment_layout(size)[2]
    rings = base + -(-(size * P2P_RANK_BYTES) // _PAGE) * _PAGE
    slot = P2P_RING_HEADER + p2p_ring_bytes(size)
    return base, rings, slot, rings + size * size * slot


_boot_id: str | None = None


def host_id() -> str:
    """What ranks that can share memory have in common: the kernel boot, the host name, the
    /dev/shm file system (a container with its own /dev/shm has another device number) and the
    network namespace: ranks in separate network namespaces are treated as separate hosts
    (netlab's emulated hosts are namespaces of one machine; they must talk over their links)."""
    global _boot_id
    if _boot_id is None:  # the same for the process's life: read once
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError:
            _boot_id = "?"
    boot = _boot_id
    ids = []
    for path in (SHM_DIR, "/proc/self/ns/net"):
        try:
            st = os.stat(path)
            ids.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            ids.append("?")
    return f"{boot}/{socket.gethostname()}/{'/'.join(ids)}"


def _mac(secret: bytes, name: str, token: bytes) -> str:
    return hmac.new(secret, b"linerate-shm\0" + name.encode() + b"\0" + token,
                    hashlib.sha256).hexdigest()


#: Seconds after which a rank that mapped the offered segment, still waiting for some rank's
#: post, publishes its own host record in the store too (``_records_of_mappers``): a rank that
#: cannot map the segment (another host's, or a refused one) needs it there. Ranks of one host
#: that arrive together never ask the store.
PUBLISH_AFTER_S = 0.002


class SetupBoard:
    """The offered segment's header while the group is set up (``establish``). A rank that
    mapped the segment posts there that it did, and its LINERATE_SHM: an int32 slot per rank in
    the unused part of its bell's cache line (``_BELL_OFF + 64 q + 8``), then rings a futex word
    (``_SETUP_BELL_OFF``) that the ranks waiting for the others' posts sleep on between their
    polls of the store. Ranks of one host then learn of each other through the segment: no
    round trip through the store, no wait for another process's next poll."""

    _MODES = {"auto": 1, "1": 2}

    def __init__(self, buf: torch.Tensor, size: int):
        self._buf = buf  # the mapping stays while the board is used
        raw = buf.numpy()
        self._word = raw[_SETUP_BELL_OFF:_SETUP_BELL_OFF + 4].view(np.int32)
        self._slots = raw[_BELL_OFF:_BELL_OFF + 64 * size].view(np.int32)[2::16]
        # the ranks' pid slots (the segment's one record of its ranks' processes: Segment.pids)
        self._pids = _pid_slots(raw, size)
        self._addr = ctypes.c_void_p(buf.data_ptr() + _SETUP_BELL_OFF)
        self._lib = futex_lib() if SYS_FUTEX is not None else None
        self._got: dict[int, str] = {}   # posted(), as last read

    def post(self, rank: int, mode: str) -> bool:
        """This rank mapped the segment (with LINERATE_SHM ``mode``): say so, with its process
        (its pid slot, written before the post), and wake the waiting ranks (the futex add is
        a full barrier: the post is seen before the ring). Returns whether every rank of the
        segment has posted, as seen after the ring: the last of them to post sees every post
        (each one's store comes before its barrier)."""
        self._pids[rank] = (os.getpid(), pidns())
        if WEAK_ORDER:  # the pid before the post that announces it (the futex add: a barrier)
            self.ring()
        self._slots[rank] = self._MODES.get(mode, 3)
        self.ring()
        return self.all_posted()

    def all_posted(self) -> bool:
        """Whether every rank of the segment has mapped it (its name can go)."""
        return int(np.count_nonzero(self._slots)) == len(self._slots)

    def posted(self) -> dict[int, str]:
        """{rank: its LINERATE_SHM} of the ranks that posted so far ("?" for a value no
        rank of this version writes). A slot is written once: read again only when the
        count of posts changed (a wait polls this while 32 ranks post one by one)."""
        if np.count_nonzero(self._slots) != len(self._got):
            names = {v: k for k, v in self._MODES.items()}
            self._got = {int(r): names.get(int(self._slots[r]), "?")
                         for r in np.flatnonzero(self._slots)}
        return self._got

    def process(self, rank: int) -> list:
        """A posted rank's process: [pid, pid namespace] (its host record's ``pid``)."""
        return [int(x) for x in self._pids[rank]]

    def value(self) -> int:
        return int(self._word[0])

    def wait(self, seen: int, timeout: float) -> None:
        """Sleep until the futex word differs from ``seen`` or ``timeout`` seconds passed."""
        if self._lib is None:
            time.sleep(timeout)
        elif timeout > 0:
            futex_wait(self._lib, self._addr, seen, timeout)

    def ring(self) -> None:
        if self._lib is not None:
            futex_add_wake(self._lib, self._addr)
        else:
            self._word[0] += 1


class Segment:
    """One host's mapping of a group's shared segment (see the module docstring). ``size`` and
    ``rank`` count the ranks that share it (segment ranks); ``ranks[i]`` is the group rank of
    segment rank i; ``layout`` the whole group's (every host's group ranks)."""

    def __init__(self, buf: torch.Tensor, size: int, rank: int, name: str,
                 ranks: tuple | None = None, layout: Layout | None = None):
        self.size = size
        self.rank = rank
        self.name = name  # unlinked once every rank had mapped it: for messages only
        self.ranks = tuple(range(size)) if ranks is None else tuple(ranks)
        self.layout = layout if layout is not None else Layout((self.ranks,), True)
        if len(self.ranks) != size:
            raise ValueError(f"a segment of {size} ranks needs {size} group ranks, got {self.ranks}")
        ctrl_off, data_off, total = segment_layout(size)
        self._buf = buf
        raw = buf.numpy()
        #: The whole mapping (uint8), for the point-to-point rings (transport/shm/ring.py).
        self.raw = raw
        row = ctrl_row_bytes(size)
        #: int64 control words, one row per rank: ``ctrl[rank, i]``.
        self.ctrl = raw[ctrl_off:ctrl_off + size * row].view(np.int64).reshape(size, row // 8)
        #: The data area, ``size * BYTES_PER_RANK`` bytes.
        self.data = buf[data_off:total]
        #: bells[q]: rank q's bell (rank q sleeps on it; others ring it).
        self.bells = raw[_BELL_OFF:_BELL_OFF + 64 * size].view(np.int32)[::16]
        self._bell_addrs = [ctypes.c_void_p(buf.data_ptr() + _BELL_OFF + 64 * q)
                            for q in range(size)]
        self._lib = futex_lib() if SYS_FUTEX is not None else None
        self.closed = False
        #: This process's pid namespace, and pids[q] = (pid, pid namespace) of segment rank q,
        #: (0, 0) until it mapped the segment (``_PID_IN_LINE``).
        self.pidns = pidns()
        self.pids = _pid_slots(raw, size)
        self.pids[rank] = (os.getpid(), self.pidns)
        #: Whether the processes of the segment's other ranks still run (Engine, links).
        self.watch = PidWatch()
        #: Called by close(): users of the segment drop their views of it there, so that the
        #: mapping goes with the group, not whenever the last view is collected.
        self.on_close: list = []
        #: What the collectives moved through the segment: a callable returning
        #: {peer's group rank: (bytes sent to it, bytes received from it)}, set by whoever moves
        #: them (transport/shm/engine.py Engine), read by Context.stats; None: nothing counted.
        self.traffic = None
        #: The same bytes as the memory moved them: a callable returning (bytes written for
        #: the peers, each once however many read it; bytes read of theirs), set by the same
        #: user, read by transport/metrics.py (interface ``shm``'s rate and utilization).
        self.copied = None
        #: The host's copy rate, bytes per second, as the segment's creator measured it before
        #: any traffic (transport/metrics.py memcpy_rate): every rank of the host reads the same.
        self.copy_rate = float(raw[_RATE_OFF:_RATE_OFF + 8].view(np.float64)[0])
        self._cause_lock = threading.Lock()

    # ------------------------------------------------------------------ cause records
    def record_cause(self, root: int, text: str) -> bool:
        """Write this rank's cause record, once (the first failure it learnt of): ``root``, the
        group rank that failed first as this rank knows it (itself, where its own op failed);
        ``text``, what is known of it (cut to a few hundred bytes). The co-located ranks read
        it (``causes``) when this rank is gone or failed, so that a rank that merely exited
        after its own failure is never taken for the cause. False if already written (or the
        segment is closed)."""
        with self._cause_lock:
            ctrl = self.ctrl
            if ctrl is None:
                return False
            row = ctrl[self.rank]
            if int(row[CAUSE_WORD]):
                return False
            data = text.encode("utf-8", "replace")[:_CAUSE_TEXT]
            area = row[CAUSE_WORD + 4:CAUSE_WORD + CAUSE_BYTES // 8].view(np.uint8)
            area[:len(data)] = np.frombuffer(data, np.uint8)
            row[CAUSE_WORD + 1] = root + 1
            row[CAUSE_WORD + 2] = time.monotonic_ns()
            row[CAUSE_WORD + 3] = len(data)
            if WEAK_ORDER:  # the record before its flag
                self.fence()
            row[CAUSE_WORD] = 1
            return True

    def causes(self) -> dict[int, tuple[int, int, str]]:
        """Every rank's cause record, as written so far: {writer's group rank: (root group
        rank, when (ns), text)}."""
        ctrl = self.ctrl
        out: dict[int, tuple[int, int, str]] = {}
        if ctrl is None:
            return out
        for q in range(self.size):
            row = ctrl[q]
            if not int(row[CAUSE_WORD]):
                continue
            if WEAK_ORDER:  # the flag before the record
                self.fence()
            root = int(row[CAUSE_WORD + 1]) - 1
            n = min(max(int(row[CAUSE_WORD + 3]), 0), _CAUSE_TEXT)
            area = row[CAUSE_WORD + 4:CAUSE_WORD + CAUSE_BYTES // 8].view(np.uint8)
            if root < 0:
                continue
            out[self.ranks[q]] = (root, int(row[CAUSE_WORD + 2]),
                                  bytes(area[:n]).decode("utf-8", "replace"))
        return out

    def cause_of(self, rank: int) -> tuple[int, str] | None:
        """Group rank ``rank``'s cause record (root, text), if it is on this segment and wrote
        one: it failed, and says because of whom."""
        rec = self.causes().get(rank)
        return None if rec is None else (rec[0], rec[2])

    def root_cause(self) -> tuple[int, int, str] | None:
        """(root, writer, text) from every rank's cause record (``pick_root``), or None."""
        return pick_root(self.causes())

    def ring(self, q: int) -> None:
        """Bump rank q's bell (an atomic add: also a full memory barrier) and wake it."""
        if self._lib is not None:
            futex_add_wake(self._lib, self._bell_addrs[q])
        else:  # no futex number for this machine: sleepers poll (sleep() below)
            self.bells[q] += 1

    def fence(self) -> None:
        """A full memory barrier: stores before it are visible to every rank before loads after
        it are done (x86: a lock taken and given back, FENCE_LOCK; elsewhere an atomic add on
        this rank's own bell)."""
        lock = FENCE_LOCK
        if lock is not None:
            lock.acquire()
            lock.release()
        else:
            self.ring(self.rank)

    def sleep(self, seen: int, timeout: float) -> None:
        """Sleep until this rank's bell differs from ``seen`` (read it before checking the
        condition waited for), or ``timeout`` seconds passed."""
        if timeout <= 0:
            return
        if self._lib is None:
            time.sleep(min(timeout, 0.0005))
            return
        futex_wait(self._lib, self._bell_addrs[self.rank], seen, timeout)

    def close(self) -> None:
        """Drop this rank's mapping (it goes when the last view of it is gone)."""
        if self.closed:
            return
        self.closed = True
        for fn in self.on_close:
            fn()
        self.on_close = []
        self.ctrl = self.data = self.bells = self.raw = None
        self.pids = self.pids.copy()  # for messages after the close; no view of the mapping
        self._buf = None
        self.watch.close()

    def pid(self, q: int) -> int:
        """Segment rank q's process id as it recorded it (0: not yet)."""
        return int(self.pids[q, 0])

    def watchable_pid(self, q: int) -> int:
        """Segment rank q's pid where this process can watch it (``PidWatch``), else 0: none
        recorded yet, or another pid namespace."""
        return watchable_pid(int(self.pids[q, 0]), int(self.pids[q, 1]), self.pidns)


# ----------------------------------------------------------------------------- set-up
def _create(size: int) -> tuple[str, str, bytes, torch.Tensor]:
    """Create and map a fresh segment; (name, path, token, mapping). Not yet unlinked. The
    segments that crashed set-ups left behind go first (``sweep_stale``)."""
    nbytes = p2p_layout(size)[3]
    sweep_stale()
    for _ in range(8):
        name = "linerate-" + secrets.token_hex(16)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            break
        except FileExistsError:
            continue
    else:
        raise OSError(f"cannot create a segment in {SHM_DIR}")
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)
    token = secrets.token_bytes(_TOKEN_LEN)
    mm[_TOKEN_OFF:_TOKEN_OFF + _TOKEN_LEN] = token
    mm[0:len(_MAGIC)] = _MAGIC
    struct.pack_into("<qq", mm, 8, nbytes, size)
    struct.pack_into("<d", mm, _RATE_OFF, memcpy_rate())
    struct.pack_into("<qq", mm, _OWNER_OFF, os.getpid(), pidns())
    return name, path, token, torch.frombuffer(mm, dtype=torch.uint8)


def _attach(name: str, size: int, secret: bytes, mac: str) -> torch.Tensor:
    """Open and map the segment announced by the host's lowest rank; ShmRefused says why not."""
    nbytes = p2p_layout(size)[3]
    if not (name.startswith("linerate-") and all(c in "0123456789abcdef" for c in name[9:])
            and len(name) == 41):
        raise ShmRefused(f"malformed segment name {name[:60]!r}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ShmRefused(f"cannot open {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShmRefused(f"{path} is not a regular file")
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise ShmRefused(f"{path} has owner {st.st_uid} and mode {stat.S_IMODE(st.st_mode):o}, "
                             f"expected {os.geteuid()} and 600")
        if st.st_size != nbytes:
            raise ShmRefused(f"{path} has {st.st_size} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise ShmRefused(f"cannot map {path}: {e}") from None
    finally:
        os.close(fd)
    token = bytes(mm[_TOKEN_OFF:_TOKEN_OFF + _TOKEN_LEN])
    magic = bytes(mm[0:len(_MAGIC)])
    if magic != _MAGIC and magic[:6] == _MAGIC[:6]:
        mm.close()
        raise ShmRefused(f"{path} has shared-memory layout {struct.unpack('<H', magic[6:])[0]}, "
                         f"this rank's linerate {LAYOUT_VERSION}: the ranks run different "
                         f"linerate versions")
    if magic != _MAGIC or not hmac.compare_digest(_mac(secret, name, token), mac):
        mm.close()
        raise ShmRefused(f"{path}: the token in the segment does not match its creator's (not the "
                         f"segment the host's lowest rank created)")
    return torch.frombuffer(mm, dtype=torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - /dev/shm is ours to clean
        log.warning("could not unlink %s: %s", path, e)


def sweep_stale(shm_dir: str | None = None) -> list[str]:
    """Unlink the segments of this user in ``shm_dir`` (default SHM_DIR) whose creator has
    exited: names a set-up left behind when every rank of its host died before they had all
    mapped the segment (a segment's name goes once they have; after that the mappings alone
    hold it). Only a regular 0600 file of this user, of this layout (its magic), whose creator's
    pid namespace is this process's and whose creator is gone, is touched. Returns the names
    unlinked; never raises."""
    shm_dir = shm_dir or SHM_DIR
    gone = []
    me, uid = pidns(), os.geteuid()
    if not me:
        return gone
    try:
        entries = [e.name for e in os.scandir(shm_dir) if _SEGMENT_NAME.fullmatch(e.name)]
    except OSError:
        return gone
    for name in entries:
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != uid
                    or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size < _TOKEN_OFF):
                continue
            head = os.pread(fd, _OWNER_OFF + 16, 0)
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(head) < _OWNER_OFF + 16 or head[:len(_MAGIC)] != _MAGIC:
            continue
        pid, ns = struct.unpack_from("<qq", head, _OWNER_OFF)
        if pid > 0 and ns == me and not pid_alive(pid):
            _unlink(path)
            gone.append(name)
    if gone:
        log.info("linerate: unlinked %d shared-memory segment(s) in %s left by set-ups whose "
                 "processes died: %s", len(gone), shm_dir, ", ".join(gone))
    return gone


_SEGMENT_NAME = re.compile(r"linerate-[0-9a-f]{32}")


class Offer:
    """Rank 0's segment for every rank of the group, made before anyone knows where the ranks
    are (``offer``): published with the group's settings, so that a group on one host proves
    its segment in the one round of host records that every group needs anyway."""

    def __init__(self, record: dict, buf=None, path: str | None = None, name: str = "?"):
        self.record = json.dumps(record).encode()
        self.buf, self.path, self.name = buf, path, name

    def unlink(self) -> None:
        """The name goes (every rank that would map it has); the mapping stays."""
        if self.path is not None:
            _unlink(self.path)
            self.path = None

    def close(self) -> None:
        """The name and rank 0's own reference to the mapping go (idempotent)."""
        self.unlink()
        self.buf = None


def may_be_one_host(size: int) -> bool:
    """Whether a group of ``size`` ranks may lie on one host: not when the launcher says this
    host has fewer ranks (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "")) >= size
    except ValueError:
        return True


def offer(mode: str, size: int, secret: bytes) -> Offer | None:
    """Rank 0, at rendezvous: a segment for all ``size`` ranks, offered in case they share its
    host (``establish`` takes it where they all do, and drops it otherwise), or None where no
    offer is worth making (LINERATE_SHM=0, one rank, or more ranks than this host has)."""
    if size < 2 or mode == "0" or not may_be_one_host(size):
        return None
    me = host_id()
    try:
        name, path, token, buf = _create(size)
    except OSError as e:
        return Offer({"host": me, "error": f"rank 0: cannot create a segment in {SHM_DIR}: {e}"})
    return Offer({"host": me, "name": name, "mac": _mac(secret, name, token)}, buf, path, name)


def was_offered(record: bytes) -> bool:
    """Whether rank 0's offer record (``Rendezvous.offered``) offers a segment (or says why it
    could not make one): the group is then probably on one host."""
    try:
        rec = json.loads(record)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(rec, dict) and ("name" in rec or "error" in rec)


def establish(store, rank: int, size: int, secret: bytes, mode: str, prefix: str,
              generation: str, offered: bytes | None = None,
              mine_offer: Offer | None = None) -> tuple[Segment | None, Layout]:
    """Agree with the group's other ranks on a shared segment per host (every rank calls it,
    at rendezvous, before the links are chosen). Returns this rank's Segment (shared with the other
    ranks of its host), or None where this rank shares none: alone on its host, LINERATE_SHM=0,
    or (under auto) some host's ranks could not map theirs, which leaves every rank without
    (all ranks agree); and the group's Layout (the same on every rank, with or without a
    Segment). With ``mode == "1"`` a group whose co-located ranks cannot share memory raises
    ShmError naming the ranks, on every rank.

    ``offered``: rank 0's offer record, as every rank read it with the group's settings
    (``Rendezvous.offered``); ``mine_offer``: on rank 0, the Offer itself. Every rank on rank
    0's host maps the offered segment before it publishes its host record, with the outcome in
    it; when the records show every rank on that host, that is the group's segment, proved in
    one round (rank 0 unlinks it once it has read every record). Otherwise it is dropped and
    each host's lowest rank makes one for its host: two more rounds.

    ``store`` has ``set``/``get`` (get waits for the key, failing when another rank gave up);
    keys are under ``prefix + "shm/" + generation`` (this group's incarnation)."""
    if size < 2:
        return None, Layout(((rank,),), True)
    base = f"{prefix}shm/{generation}/"
    me = {"host": host_id(), "mode": mode, "version": version_text(),
          "pid": [os.getpid(), pidns()]}
    offer_rec = _loads(offered, 0) if offered else {}
    segment_offered = "name" in offer_rec or "error" in offer_rec
    spec = None
    spec_name = str(offer_rec.get("name", "?"))
    if rank == 0 and mine_offer is not None:
        spec = mine_offer.buf
        me["offer"] = "ok" if spec is not None else "no segment"
    elif segment_offered and mode != "0" and offer_rec.get("host") == me["host"]:
        if "error" in offer_rec:
            me["offer"] = str(offer_rec["error"])
        else:
            try:
                spec = _attach(spec_name, size, secret, str(offer_rec.get("mac", "")))
                me["offer"] = "ok"
            except ShmRefused as e:
                me["offer"] = str(e)
    try:
        if spec is None:
            store.set(f"{base}host/{rank}", json.dumps(me))
            peers = [me if r == rank else _loads(raw, r)
                     for r, raw in enumerate(_gather(store, f"{base}host/", range(size)))]
        else:
            peers = _records_of_mappers(store, base, rank, size, me, SetupBoard(spec, size),
                                        spec_name)
    finally:
        if mine_offer is not None:  # every rank on this host has mapped it, or given up
            mine_offer.close()
    # Every rank's versions, on every rank: a rank of a linerate too old to compare its own
    # with rank 0's at rendezvous is named here (its record says none).
    for r, p in enumerate(peers):
        if p.get("version") != me["version"]:
            raise version_mismatch(rank, r, me["version"], p.get("version"))
    modes = {str(p.get("mode")) for p in peers}
    if len(modes) > 1:
        detail = ", ".join(f"rank {r}: {p.get('mode')}" for r, p in enumerate(peers))
        raise ShmError(f"rank {rank}: LINERATE_SHM differs between ranks ({detail}): every rank "
                       f"must use the same setting")
    ids = [str(p.get("host")) for p in peers]
    hosts = group_hosts(ids)
    machines = group_hosts([i.split("/", 1)[0] for i in ids])  # (host_id: the boot first)
    # (a record without a pid, which no rank of this version writes, counts as a process of
    # its own)
    processes = group_hosts([f"{i}/{p['pid']}" if p.get("pid") is not None else f"rank {r}"
                             for r, (i, p) in enumerate(zip(ids, peers))])
    shared = [h for h in hosts if len(h) >= 2]
    if mode == "0" or not shared:
        return None, Layout(hosts, False, machines, processes)
    bad: dict[int, str] = {}
    if segment_offered and len(hosts) == 1:
        # Every rank is on rank 0's host and tried the offered segment: their records say how.
        mine, buf, name = hosts[0], spec, spec_name
        bad = {r: str(p.get("offer", "did not try the offered segment"))
               for r, p in enumerate(peers) if p.get("offer") != "ok"}
    else:
        spec = None  # the ranks span hosts: a segment per host, sized for its ranks
        mine = next(h for h in hosts if rank in h)
        buf = None
        name = "?"
        if len(mine) >= 2:
            buf, name = _host_segment(store, base, rank, mine, secret)
        # Every host's outcome, on every rank: all agree whether the group shares memory.
        for h in shared:
            done = _loads(store.get(f"{base}done/{h[0]}"), h[0])
            bad.update({int(r): str(w) for r, w in done.items()})
    if bad:
        buf = spec = None  # the mapping goes with its last view
        detail = "; ".join(f"rank {r}: {w}" for r, w in sorted(bad.items()))
        if mode == "1":
            raise ShmError(f"rank {rank}: LINERATE_SHM=1 but ranks {sorted(bad)} cannot map "
                           f"their host's shared memory: {detail}")
        if rank == 0:
            log.warning("linerate: group of %d ranks uses TCP, not shared memory: %s",
                        size, detail)
        return None, Layout(hosts, False, machines, processes)
    layout = Layout(hosts, True, machines, processes)
    if buf is None:
        return None, layout  # alone on its host
    if rank == 0 and len(hosts) > 1:
        log.info("linerate: group of %d ranks on %d hosts (%s): shared memory within each host",
                 size, len(hosts), "+".join(str(len(h)) for h in hosts))
    return Segment(buf, len(mine), mine.index(rank), name, mine, layout), layout


def _host_segment(store, base: str, rank: int, mine: tuple, secret: bytes):
    """The segment of this host's ranks ``mine`` (group ranks, ascending): the lowest creates
    it, the others prove they map it; (mapping or None, name). The creator publishes the
    host's outcome as ``done/<creator>`` ({rank: why} of those that could not)."""
    creator = mine[0]
    n = len(mine)
    buf = None
    path = None
    name = "?"
    try:
        if rank == creator:
            try:
                name, path, token, buf = _create(n)
                SetupBoard(buf, n).post(0, "auto")  # mapped (the last mapper unlinks it)
                store.set(f"{base}seg/{creator}", json.dumps({"name": name,
                                                              "mac": _mac(secret, name, token)}))
            except OSError as e:
                store.set(f"{base}seg/{creator}", json.dumps({
                    "error": f"rank {creator}: cannot create a segment in {SHM_DIR}: {e}"}))
            results = {creator: "ok" if buf is not None else "no segment"}
            for r, raw in zip(mine[1:], _gather(store, f"{base}ok/", mine[1:])):
                results[r] = bytes(raw).decode(errors="replace")
            if path is not None:
                _unlink(path)  # every rank has mapped it (or given up): the name goes now
                path = None
            bad = {str(r): why for r, why in results.items() if why != "ok"}
            store.set(f"{base}done/{creator}", json.dumps(bad))
        else:
            seg = _loads(store.get(f"{base}seg/{creator}"), creator)
            if "error" in seg:
                why = str(seg["error"])
            else:
                try:
                    buf = _attach(str(seg.get("name", "")), n, secret, str(seg.get("mac", "")))
                    why = "ok"
                except ShmRefused as e:
                    why = str(e)
                else:  # the last of the host's ranks to map it unlinks its name at once
                    if SetupBoard(buf, n).post(mine.index(rank), "auto"):
                        _unlink(os.path.join(SHM_DIR, str(seg["name"])))
            store.set(f"{base}ok/{rank}", why)
            name = str(seg.get("name", "?"))
    finally:
        if path is not None:
            _unlink(path)
    return buf, name


def _records_of_mappers(store, base: str, rank: int, size: int, me: dict,
                        board: SetupBoard, name: str | None = None) -> list:
    """Every rank's host record, on a rank that mapped the offered segment: the ranks that
    mapped it too post on its ``board`` (their record is then this rank's host, their
    LINERATE_SHM, "ok"); the others' records come from the store. This rank posts; it publishes
    its record in the store as well (for ranks that cannot read the board: they read every
    record from the store) only once some rank has not posted within PUBLISH_AFTER_S, or had
    not when the wait ended. When every rank posted by then, this rank asks nothing of the
    store here: a store request is a hand-off to the process that hosts it, and a small
    group's set-up on a busy host is a chain of such hand-offs.

    The rank that sees every rank posted unlinks the segment's name ``name`` at once: every
    rank has mapped it (where some ranks are on other hosts, rank 0 unlinks it once it has read
    the records)."""
    unlinked = board.post(rank, str(me["mode"])) and name is not None
    if unlinked:
        _unlink(os.path.join(SHM_DIR, name))
    keys = [f"{base}host/{r}" for r in range(size)]
    published = False
    since = time.monotonic()

    def publish() -> None:
        nonlocal published
        store.set(keys[rank], json.dumps(me))
        published = True

    def pending(ks):
        got = board.posted()
        left = [k for r, k in enumerate(ks) if r not in got]
        if left and not published and time.monotonic() - since >= PUBLISH_AFTER_S:
            publish()  # a rank of another host, or a late one: it may need this record
        return left

    store.wait_set(keys, max_delay=0.02, bell=board, pending=pending)
    got = board.posted()
    if len(got) == size and not unlinked and name is not None:
        _unlink(os.path.join(SHM_DIR, name))
    rest = [r for r in range(size) if r not in got]
    raws = {}
    if rest:
        if not published:
            publish()
        raws = dict(zip(rest, multi_get(store, [keys[r] for r in rest])))
    # A rank that posted mapped this segment, of this layout (its magic): its record is this
    # rank's (host, versions) but for its LINERATE_SHM and its process.
    return [me if r == rank else
            {**me, "mode": got[r], "offer": "ok", "pid": board.process(r)} if r in got else
            _loads(raws[r], r) for r in range(size)]


def _gather(store, key: str, ranks) -> list:
    """The records ``key<r>`` of ``ranks`` once all are there: the rendezvous store is polled
    with one ``check`` of every key (a polled ``get`` per rank would keep the store busy for
    most of the set-up of a large group), then read with one ``multi_get`` where the store
    has it."""
    keys = [f"{key}{r}" for r in ranks]
    store.wait_set(keys, max_delay=0.02)
    return multi_get(store, keys)


def _loads(raw, peer: int):
    try:
        value = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        value = None
    if not isinstance(value, (dict, list)):
        raise TransportError(f"rank {peer} published a malformed shared-memory record: "
                             f"{bytes(raw)[:200]!r}")
    return value if isinstance(value, dict) else {}
