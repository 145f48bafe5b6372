"""The synchronisation primitives of shared memory between the ranks of one host, used by the
segment (transport/shm), its ring links (ring.py) and the collectives' engine
(engine.py): the memory order (``WEAK_ORDER``, the fence's lock), futex wait and wake on a
word of the segment, watching co-located ranks' processes (``PidWatch``: pidfds, else signals),
the cores this process may use (affinity and cgroup quota) and how long a waiting rank spins
on them (``spin_seconds``: also a TCP caller's ``drive``), and cross-memory attach
(``cma_read``)."""
from __future__ import annotations

import ctypes
import errno
import functools
import math
import os
import platform
import select
import threading

from ..interfaces import read_text

#: x86 keeps stores in order and loads in order (TSO): data stored before a flag is seen before
#: it. Elsewhere (WEAK_ORDER) a fence goes between a record and its flag, here and in every
#: protocol on the segment (collectives/shm_algos.py, ring.py).
WEAK_ORDER = platform.machine() not in ("x86_64", "AMD64", "i386", "i686")
#: What ``Segment.fence`` runs on x86, where the one reordering left is a load passing an
#: earlier store (a tick published, then the sleepers' wishes read): any locked instruction
#: drains the store buffer, and taking and giving back a Python lock runs two (CPython's lock
#: is a semaphore or mutex of the C library: an atomic compare-and-swap, an atomic add), in
#: about 0.1 us against 1-2 us for the futex system call that serves as the fence elsewhere.
FENCE_LOCK = None if WEAK_ORDER else threading.Lock()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) still runs: a zombie, killed but not yet
    reaped by its parent, counts as gone; a process we may not signal (EPERM) as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read(512).rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class PidWatch:
    """Which of a segment's processes have exited, for many at once: a pidfd per process
    (Linux 5.3+: readable once the process exited, reaped or still a zombie), all of them
    polled with one syscall. Where a pidfd cannot be had (an older kernel, a seccomp filter)
    that process is asked with ``pid_alive``, a kill(0) and a read of /proc/<pid>/stat per
    peer per look: with every rank looking at all its peers every few tens of milliseconds,
    that is a sizeable share of a core for an idle group of many ranks on one host."""

    def __init__(self):
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}      # pid -> pidfd
        self._pid_of: dict[int, int] = {}   # pidfd -> pid
        self._gone: set[int] = set()
        self._slow: set[int] = set()        # no pidfd: pid_alive
        self._poll = select.poll()
        self._closed = False

    def _watch(self, pid: int) -> None:  # under the lock
        if pid in self._fds or pid in self._gone or pid in self._slow:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone.add(pid)
            return
        except (OSError, AttributeError):  # ENOSYS, EPERM; Python without pidfd_open
            self._slow.add(pid)
            return
        self._fds[pid] = fd
        self._pid_of[fd] = pid
        self._poll.register(fd, select.POLLIN)

    def exited(self, pids) -> set:
        """Those of ``pids`` whose process has exited (none once the watch is closed)."""
        with self._lock:
            if self._closed:
                return set()
            for pid in pids:
                self._watch(pid)
            for fd, _ in self._poll.poll(0):
                pid = self._pid_of.pop(fd)
                self._gone.add(pid)
                del self._fds[pid]
                self._poll.unregister(fd)
                os.close(fd)
            out = {p for p in pids if p in self._gone}
            slow = [p for p in pids if p in self._slow]
        return out | {p for p in slow if not pid_alive(p)}

    def alive(self, pid: int) -> bool:
        return not self.exited((pid,))

    def fds(self) -> list[int]:
        """The pidfds of the processes watched now (readable once one exits)."""
        with self._lock:
            return [] if self._closed else list(self._fds.values())

    def polled(self) -> bool:
        """Whether some process is watched without a pidfd (``pid_alive``: must be asked)."""
        with self._lock:
            return bool(self._slow) and not self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._pid_of.clear()


#: Seconds a waiting rank polls (its counters on a segment, its sockets over TCP) before it
#: sleeps, where the group's ranks on its machine have a core each: a sleep and wake-up (futex, or a
#: blocking poll) costs tens of microseconds on each side, more than a small op's peer usually
#: keeps it waiting. Where ranks outnumber cores it does not spin: a spinning rank would take
#: the core that the rank it waits for needs.
SPIN_S = 100e-6


def spin_seconds(ranks_here: int) -> float:
    """How long a rank that waits for a peer polls before it sleeps (``SPIN_S``, or 0 where
    the ``ranks_here`` ranks of its machine outnumber the cores this process may use)."""
    return SPIN_S if ranks_here <= usable_cores() else 0.0


def spin_for(layout, rank: int) -> float | None:
    """How long group rank ``rank`` of ``layout`` (transport/shm's Layout) polls a peer's
    progress before it sleeps: ``spin_seconds`` of the group's ranks on its machine, or None
    where other ranks of the group are threads of its process (polling would hold the
    interpreter lock the awaited rank needs: such a rank sleeps at once). The one rule for
    the shared segment's waiters and the TCP links' callers."""
    if layout.threads_of_one_process(rank):
        return None
    return spin_seconds(layout.cores_shared_by(rank))


@functools.lru_cache(maxsize=4)
def usable_cores(proc_cgroup: str = "/proc/self/cgroup",
                 cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may keep busy: its CPU affinity, bounded by the CPU quota of its
    cgroup or of a cgroup above it (a container limited by ``cpu.max``, or v1's
    ``cpu.cfs_quota_us``, rather than by a cpuset sees every core of the host in its
    affinity, and a rank that spun as if it had them would burn the quota). Read once per
    process."""
    try:
        # The process's (its main thread's), not the calling thread's: the value is kept for
        # the process, whichever thread asks first.
        n = len(os.sched_getaffinity(os.getpid()))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        n = max(1, min(n, math.ceil(quota)))  # 1.5 cores of quota: 2 may run at once
    return n


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup",
                     cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """The smallest CPU quota, in cores, of this process's cgroup and those above it (cgroup
    v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None where none is set
    or none can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            base, v2 = cgroup_root, True
        elif "cpu" in controllers.split(","):
            base = next((os.path.join(cgroup_root, d) for d in (controllers, "cpu", "cpu,cpuacct")
                         if os.path.isdir(os.path.join(cgroup_root, d))), None)
            if base is None:
                continue
            v2 = False
        else:
            continue
        path = path.strip("/")
        while True:  # this cgroup, then each one above it
            d = os.path.join(base, path) if path else base
            q = _quota_v2(d) if v2 else _quota_v1(d)
            if q is not None:
                found.append(q)
            if not path:
                break
            path = os.path.dirname(path)
    return min(found) if found else None


def _quota_v2(d: str) -> float | None:
    words = (read_text(os.path.join(d, "cpu.max")) or "").split()
    if len(words) != 2 or words[0] == "max":
        return None
    try:
        quota, period = int(words[0]), int(words[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(d: str) -> float | None:
    try:
        quota = int(read_text(os.path.join(d, "cpu.cfs_quota_us")) or "-1")
        period = int(read_text(os.path.join(d, "cpu.cfs_period_us")) or "0")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def pidns() -> int:
    """The inode of this process's pid namespace (0 if unknown): a published pid means this
    process only where the namespaces match."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def watchable_pid(pid: int, pidns: int, my_pidns: int) -> int:
    """A co-located rank's published pid where this process can watch it (``PidWatch``), else
    0: none published yet, or another pid namespace (or one that cannot be told)."""
    return 0 if pid <= 0 or pidns != my_pidns or not my_pidns else pid


# ----------------------------------------------------------------------------- futex
_libc = None
SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE_OP = 0, 5
# FUTEX_WAKE_OP's operation: *uaddr2 += 1 (atomically), then wake (FUTEX_OP_ADD, CMP_EQ 0).
_OP_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_add_wake(lib, addr: ctypes.c_void_p) -> None:
    """Add 1 to the int32 at ``addr`` (atomically: also a full memory barrier) and wake every
    thread of any process sleeping on it (``lib``: futex_lib())."""
    lib.syscall(SYS_FUTEX, addr, _FUTEX_WAKE_OP, 0x7FFFFFFF, ctypes.c_void_p(0), addr, _OP_ADD_ONE)


def futex_wait(lib, addr: ctypes.c_void_p, seen: int, timeout: float) -> None:
    """Sleep while the int32 at ``addr`` still holds ``seen``, at most ``timeout`` seconds."""
    ts = Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    lib.syscall(SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(ts),
                ctypes.c_void_p(0), 0)


def futex_lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released in the call
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    return _libc


# ----------------------------------------------------------------------------- CMA
class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_cma_fn = None


def cma_read(pid: int, local: int, remote: int, n: int) -> None:
    """Copy ``n`` bytes at address ``remote`` of process ``pid`` to address ``local`` of this
    process: one copy, by the kernel (cross-memory attach, ``process_vm_readv``; the GIL is
    released). Raises OSError (EPERM: ptrace rules or a seccomp filter forbid it; ESRCH: the
    process is gone; EFAULT: its range is not mapped) when not every byte was read."""
    global _cma_fn
    if _cma_fn is None:
        f = futex_lib().process_vm_readv
        f.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                      ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        f.restype = ctypes.c_ssize_t
        _cma_fn = f
    while n > 0:
        lv, rv = _Iovec(local, n), _Iovec(remote, n)
        got = _cma_fn(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got <= 0:
            e = ctypes.get_errno() if got < 0 else errno.EFAULT  # nothing read
            raise OSError(e, f"process_vm_readv from process {pid}: {os.strerror(e)}")
        local += got
        remote += got
        n -= got
