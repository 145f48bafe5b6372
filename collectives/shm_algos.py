"""Collectives of a group whose ranks share one host, straight on the group's shared segment.

No byte goes through a socket: each rank copies its contribution into its own slot of the
segment, the ranks wait for each other (one barrier per pipeline phase), and each reads what
it needs from the others' slots. all_reduce: every rank reduces a 1/P share of each chunk,
reading every rank's slot (rank order, so every rank gets the same bits), into the chunk's
result area, and every rank copies the whole result out. Phases overlap three chunks (copy in
chunk k, reduce chunk k-1, copy out chunk k-2), so the segment stays bounded
(transport.shm.BYTES_PER_RANK per rank, reused by every op). From CMA_BYTES an all_reduce may
instead read the peers' tensors directly with cross-memory attach (LINERATE_CMA, _cma_choice).

Synchronisation (transport/shm.py gives the words and a bell per rank): each rank publishes a
counter (its *tick*) after each phase; every rank advances it the same number of times for
the same calls, so "every rank reached tick T" means "every rank finished that phase". A
waiting rank checks the counters for a moment (where ranks outnumber cores it gives its core up
between looks: 4 ranks on 2 cores must not fight spinners), says which tick it waits for and
sleeps on its bell (a futex: no core burnt); a rank that publishes wakes exactly
the sleepers whose wait it completes. A sleeper also wakes after a short timeout and looks at
the transport's state and, every LIVE_S, whether the ranks it waits for still run: a rank that
died or reported an error fails the wait with that error. Each area of the segment remembers
the tick at which its last readers finish; a rank writes into an area only once every rank is
past it.

Agreement: before its first tick of an op a rank writes the op's sequence number, the digest of
its call (the same digest that travels in TCP frames) and the call's text into its control row;
a rank that sees a peer in the same op with another digest fails with both calls named and tells
every rank (the transport's ERROR frames), so a mismatch is named on every rank, never run.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
import types
import weakref

import numpy as np
import torch

from linerate.transport import MismatchError, TransportError
from linerate.transport.shm import (BYTES_PER_RANK, WEAK_ORDER, cma_read, pidns,
                                     usable_cores, watchable_pid)

from .comm import Comm, OpTimeout
from .reduce_ops import (NP_BINARY, NP_BOOL, NP_DTYPES, RedOpType, finish_avg, fold_rows,
                         fold_rows_into)
from .views import np_view

# control row words (int64); transport.shm.ctrl_row_bytes leaves 64 words + one per rank
_PROG, _SEQ, _DIGEST, _AUX = 0, 1, 2, 3
_WANT, _WHO = 4, 5   # the tick a sleeping rank waits for (0: awake); whose (-1: every rank's)
_PID, _PIDNS = 6, 7  # the rank's process id and pid namespace (a waiter checks it is alive)
_DESC_WORD, _DESC_BYTES = 8, 256          # words 8..39: the call's text
# words 40..55: the (seq, digest) of this rank's last _HIST_N ops, so that a rank that checks a
# peer which already moved on to a later op can still compare this op's call with its own
_HIST, _HIST_N = 40, 8
# words 56..59: cross-memory attach (see _all_reduce_cma): the tensor's address in this op; a
# private word's address and the nonce it holds (the probe); the probe's verdict (1 ok and
# tuned, 3 ok and always, 2 not); words 60..63: this rank's smoothed time per byte of each
# large all_reduce path (picoseconds: CMA, segment), in two slots by the parity of the op count
_CMA_PTR, _CMA_ADDR, _CMA_NONCE, _CMA_OK, _CMA_TIMES = 56, 57, 58, 59, 60
#: An all_reduce from this many bytes may read the peers' tensors with cross-memory attach
#: (process_vm_readv) where every rank may: one copy per byte moved, no staging in the segment.
#: Neither path wins everywhere: the copies through the segment are faster while the last-level
#: cache is the ranks' own, CMA while other work contends for it (the segment's chunks fall out
#: of the cache; CMA streams from memory either way), and that changes while a job runs. So
#: LINERATE_CMA=auto tries both and keeps taking the one that measured faster (_cma_choice).
CMA_BYTES = 1 << 20
#: LINERATE_CMA=auto: the first CMA_EXPLORE large all_reduces try the paths in the order
#: CMA_TRIAL (True: CMA; the first of each is not counted: it pays the page faults of fresh
#: buffers): CMA's ops over by the third op, op 5 the first that both paths' counted times
#: reach (each rank publishes op m's times in slot m % 2, read at op m + 2): the trials of the
#: slower path are over within the first few ops instead of spreading into the ops after a
#: caller's warm-up. Then every CMA_RETRY-th takes the path that measured
#: slower, so that a change of conditions is seen. A path's time is the best of its last
#: CMA_KEEP times per byte (noise only ever adds time).
CMA_TRIAL = (False, True, True, False, False)
CMA_EXPLORE = len(CMA_TRIAL)
CMA_RETRY = 16
CMA_KEEP = 3
#: The pieces that a rank reduces its share in (each peer's piece is read into a scratch
#: buffer that stays in cache, then folded); 1 MiB does better than 256 KiB or 4 MiB.
CMA_PIECE = 1 << 20
#: Seconds a waiting rank sleeps at most before it looks at the transport's state again.
POLL_S = 0.005
#: Seconds a waiting rank polls the counters before it sleeps on its bell, where the segment's
#: ranks have a core each: a futex sleep and wake-up costs tens of microseconds on each side,
#: more than a small op's peer usually keeps it waiting. Where ranks outnumber cores it does
#: not spin (a spinning rank would take the core the rank it waits for needs): YIELD_S.
SPIN_S = 100e-6
#: Seconds a waiting rank polls where ranks outnumber cores, giving its core up between looks
#: (sched_yield: a rank it waits for, runnable on the same core, runs at once), before it
#: sleeps: sleeping at once there costs a futex wake-up per wait on each side
#: (docs/performance.md, small operations at 4 ranks).
YIELD_S = 200e-6
#: Seconds between a waiting rank's looks at whether the ranks it waits for still run (one
#: poll of their pidfds: transport/shm.py PidWatch). Looking at every wake-up (where there are
#: no pidfds, a kill(0) and a read of /proc/<pid>/stat per late peer) would be most of a small
#: all_reduce's CPU on many ranks. A rank that died is still noticed within this plus POLL_S.
LIVE_S = 0.02
#: Seconds a rank that finds a peer past the current op without it (``_left_unfinished``)
#: waits for word that the peer failed before it names a sequence mismatch.
LEFT_WAIT_S = 0.2
#: all_reduce up to this many bytes: every rank folds all contributions (one barrier).
SMALL_BYTES = 64 << 10
_ALIGN = 64
#: x86 keeps stores in order and loads in order (TSO): a tick stored after a phase's data is
#: seen after it. Elsewhere (transport/shm.py WEAK_ORDER) a full barrier goes before each tick
#: and after each wait. (Only the x86 path has been exercised.)
_WEAK_ORDER = WEAK_ORDER

log = logging.getLogger("linerate.collectives")


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _unsigned(s: int) -> int:
    return s & ((1 << 64) - 1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_NP = NP_DTYPES
_BINARY = {RedOpType.SUM: torch.add, RedOpType.AVG: torch.add, RedOpType.PRODUCT: torch.mul,
           RedOpType.MIN: torch.minimum, RedOpType.MAX: torch.maximum}
#: torch runs an elementwise op on its intra-op threads from this many elements on; the
#: float16/bfloat16 folds stay below it (where ranks outnumber cores, OpenMP's spinning threads
#: would cost a large share of a big all_reduce's CPU time).
_GRAIN = 32768


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous tensors of the same size: glibc's memmove, one thread,
    without the GIL (torch's copy_ would start its intra-op threads for large ones)."""
    n = src.numel() * src.element_size()
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _fold(out: torch.Tensor, srcs: list[torch.Tensor], op) -> None:
    """out = ((srcs[0] op srcs[1]) op srcs[2]) ...: rank order, as collectives.direct folds.
    NumPy's loops where NumPy has the dtype (one thread, without the GIL; IEEE operations as
    torch's, so the bits are the same), torch's below its threading grain otherwise."""
    if len(srcs) == 1:
        _copy(out, srcs[0])
        return
    npdt = _NP.get(out.dtype)
    if npdt is not None:
        fold_rows(out, [np_view(s, npdt) for s in srcs], op, npdt)  # caller's: not .numpy()
        return
    f = _BINARY[op]  # float16, bfloat16 (floating point: no bitwise ops)
    n = out.numel()
    for lo in range(0, n, _GRAIN):
        hi = min(n, lo + _GRAIN)
        d = out[lo:hi]
        f(srcs[0][lo:hi], srcs[1][lo:hi], out=d)
        for x in srcs[2:]:
            f(d, x[lo:hi], out=d)


class _Areas:
    """The segment's areas (2P + 2 of C bytes) as uint8 tensor views, each made when first used:
    a group's creation had made every one (66 at 32 ranks), where its small ops use a few."""

    __slots__ = ("_data", "_C", "_views")

    def __init__(self, data: torch.Tensor, C: int, n: int):
        self._data, self._C, self._views = data, C, [None] * n

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> torch.Tensor:
        v = self._views[i]
        if v is None:
            v = self._views[i] = self._data[i * self._C:(i + 1) * self._C]
        return v


class Engine:
    """A group's view of its shared segment: slots, counters, waiting. Used by one thread
    (the group's worker) at a time."""

    def __init__(self, seg, cma: str | None = None):
        self.seg = seg
        self.P = P = seg.size
        self.r = seg.rank
        #: Group rank of each segment rank (the comm this engine runs on has exactly these
        #: ranks, in this order: the group, or a SubComm of one host's ranks).
        self.gr = tuple(getattr(seg, "ranks", range(P)))
        self.me = self.gr[self.r]
        self.ctrl = seg.ctrl
        self.row = seg.ctrl[self.r]  # this rank's control row
        self.prog = seg.ctrl[:, _PROG]
        self.want = seg.ctrl[:, _WANT]
        # More ranks than cores (the affinity, bounded by a cgroup's CPU quota): a spinning
        # rank takes the core a rank it waits for needs (it yields instead: wait()).
        self.spin = SPIN_S if P <= usable_cores() else 0.0
        self.tick = 0
        self.base = 0
        nareas = 2 * P + 2
        self.C = (P * BYTES_PER_RANK // nareas) // 4096 * 4096
        self.areas = _Areas(seg.data, self.C, nareas)
        base = seg.data.data_ptr()  # for memmove without tensor views
        self.addr = [base + i * self.C for i in range(nareas)]
        #: The areas as one NumPy array (bytes, and int64 words): what every rank put in its
        #: slot is read for all ranks at once (agree), not through a tensor view per rank.
        self.np_data = seg.data[:nareas * self.C].numpy()
        self.words = self.np_data.view(np.int64)
        self.free = [0] * nareas
        self.cursor = 0
        #: The running op's Comm, weakly (its caller holds it for the op; comm.shm is this
        #: engine: a strong reference made a cycle that kept a destroyed group's objects
        #: until the garbage collector ran).
        self._comm = None
        self._checked = True
        self._desc_key = None  # (op, call text) written in this rank's row
        # Liveness without TCP: with lazy connections co-located ranks may never open one
        # (whose reset would tell a waiter that a peer died); a waiter checks the pids.
        self._pidns = pidns()
        self.ctrl[self.r, _PIDNS] = self._pidns
        self.ctrl[self.r, _PID] = os.getpid()
        #: Cross-memory attach between these ranks, agreed by all: None until the first large
        #: all_reduce asks every rank; then "off", "on" (every rank has LINERATE_CMA=1: always)
        #: or "tuned" (auto: the path that measured faster, _cma_choice).
        self.cma = None
        if cma is None:  # LINERATE_CMA from the environment (a group passes its Options')
            from linerate import settings
            cma = settings.read("LINERATE_CMA")
        self._cma_setting = cma
        self._cma_scratch = None
        #: lone_all_reduce's tensor views of the slots' rows: (set, dtype, elements) -> views.
        self.lone_rows: dict = {}
        #: lone_all_reduce's NumPy views of the callers' tensors: (address, dtype, elements) ->
        #: a view made from the address (holding nothing; used only while a tensor is there).
        self.lone_outs: dict = {}
        self._big = 0                 # large all_reduces run here (the same on every rank)
        self._times = ([], [])        # this rank's last seconds per byte: CMA, segment
        self.big_paths = [0, 0]       # large all_reduces by each path (CMA, segment)
        #: Bytes moved between this rank and each segment rank q, as a link would count them
        #: (``traffic``): tx[q], what this rank wrote into the segment that q reads (or what q
        #: read from this rank's tensor by CMA); rx[q], what this rank read of q's (its slot, its
        #: share of a result area, its tensor). tx_all/rx_all: bytes sent to / received from
        #: every peer alike (one add for an op that treats all peers the same). Payload only:
        #: the control words (ticks, digests, all_to_all's sizes) are not counted.
        self.tx, self.rx = [0] * P, [0] * P
        self.tx_all = self.rx_all = 0
        #: Bytes this rank wrote for its peers to read, each byte once however many peers read
        #: it (``copied``): into its slot, the root's slot, its share of a result area, or (by
        #: cross-memory attach) its share of the result in its own tensor. Where one peer reads
        #: each byte it equals the sum of ``tx``; a broadcast's root writes once what it sends
        #: to every peer. (What a rank writes that only it reads again is not counted.)
        self.wrote = 0
        seg.traffic = self.traffic  # read by the transport's stats (Context.stats)
        seg.copied = self.copied    # read by the metrics (interface shm's rate, utilization)
        seg.on_close.append(self._release)

    @property
    def comm(self) -> Comm | None:
        ref = self._comm
        return ref() if ref is not None else None

    @comm.setter
    def comm(self, comm: Comm | None) -> None:
        self._comm = weakref.ref(comm) if comm is not None else None

    def traffic(self) -> dict[int, tuple[int, int]]:
        """{peer's group rank: (bytes sent, bytes received)} through the segment so far (see
        ``tx``): what this rank wrote for the peer to read and what it read of the peer's;
        rank r's sent to q equals q's received from r."""
        tx, rx, ta, ra = self.tx, self.rx, self.tx_all, self.rx_all
        return {g: (tx[q] + ta, rx[q] + ra) for q, g in enumerate(self.gr) if q != self.r}

    def copied(self) -> tuple[int, int]:
        """(bytes written for the peers, bytes read of theirs) through the segment so far: what
        the memory moved, a byte that several peers read written once (``wrote``); what it read
        is the sum of its per-peer received bytes (``traffic``)."""
        return self.wrote, sum(self.rx) + self.rx_all * (self.P - 1)

    def _release(self) -> None:
        """The group closed: drop every view of the segment (its mapping goes now)."""
        self.areas = []
        self.lone_rows = {}
        self.lone_outs = {}
        self.np_data = self.words = None
        self._cma_scratch = None
        self.ctrl = self.row = self.prog = self.want = None

    # ------------------------------------------------------------------ areas
    def S(self, b: int, q: int) -> int:
        return b * self.P + q

    def R(self, b: int) -> int:
        return 2 * self.P + b

    def view(self, area: int, dtype: torch.dtype, n: int, nbytes_per: int) -> torch.Tensor:
        return self.areas[area][:n * nbytes_per].view(dtype)

    def next_set(self) -> int:
        b = self.cursor & 1
        self.cursor += 1
        return b

    # ------------------------------------------------------------------ op life
    def begin(self, comm: Comm) -> None:
        if self.ctrl is None:
            raise TransportError(f"rank {self.me}: {comm.desc}: the process group was closed")
        if comm.size != self.P or comm.rank != self.r:
            raise TransportError(f"rank {self.me}: {comm.desc}: the shared segment of ranks "
                                 f"{list(self.gr)} runs on a communicator of {comm.size} ranks")
        row = self.row
        #: The last tick before this op: a peer at a later tick is in this op or past it.
        self.base = self.tick
        row[_SEQ] = 0  # changing: a peer that read the old seq sees it changed (_check)
        row[_DIGEST] = _signed(comm.call)
        key = (comm.op, comm.call_text)
        if key != self._desc_key:  # the row holds the last op's text: a repeated call keeps it
            text = f"{comm.op}({comm.call_text})".encode("utf-8", "replace")[:_DESC_BYTES - 1]
            desc = row[_DESC_WORD:_DESC_WORD + _DESC_BYTES // 8].view(np.uint8)
            desc[:] = 0
            desc[:len(text)] = np.frombuffer(text, np.uint8)
            self._desc_key = key
        h = _HIST + 2 * (comm.seq % _HIST_N)
        row[h] = 0            # the entry is being rewritten
        row[h + 1] = row[_DIGEST]
        row[h] = comm.seq
        row[_SEQ] = comm.seq  # last: a peer reads seq, digest, seq (see _check)
        self.comm = comm
        self._checked = False

    def publish(self, reads=()) -> None:
        """This rank finished a phase; ``reads``: areas it read in it (free once every rank
        published this tick)."""
        self.tick += 1
        t = self.tick
        for a in reads:
            self.free[a] = t
        prog, want, ctrl = self.prog, self.want, self.ctrl
        if ctrl is None:  # closed (abort) while this op ran
            self._closed()
        seg = self.seg
        if _WEAK_ORDER:  # the phase's data stores before the tick
            seg.fence()
        prog[self.r] = t
        seg.fence()  # the tick is visible before the sleepers' wishes are read
        wants = want.tolist()  # a few words: a list beats NumPy's reductions on them
        if any(wants):  # wake exactly the sleepers whose wait is over
            ticks = None  # every rank's tick: read once (31 sleepers at 32 ranks)
            for q, w in enumerate(wants):
                if not w:
                    continue
                if ticks is None:
                    ticks = prog.tolist()
                who = int(ctrl[q, _WHO])
                if (ticks[who] if who >= 0 else min(ticks)) >= w:
                    seg.ring(q)

    def wait_free(self, area: int) -> None:
        t = self.free[area]
        prog = self.prog
        if t and (prog is None or min(prog.tolist()) < t):
            self.wait(t)

    def wait(self, t: int, who: list[int] | None = None) -> None:
        """Until every rank (or those in ``who``) published tick ``t``."""
        prog, ctrl = self.prog, self.ctrl  # kept: the group may close meanwhile (abort)
        if ctrl is None:
            self._closed()
        if _ready(prog, t, who):
            if not self._checked:
                if self._check(t, who, ctrl):
                    self._settle(t, who, ctrl)
            if _WEAK_ORDER:  # the ticks seen before the data they announce
                self.seg.fence()
            return
        comm = self.comm
        arr = comm.arrivals
        # Peers that have not published anything in this op yet (at or before its base
        # tick): when their first contribution comes is noted (collectives/straggler.py).
        first = None
        if arr is not None:
            base, ticks = self.base, prog.tolist()
            first = [q for q in (who or range(self.P)) if ticks[q] <= base and q != self.r]
        if self.spin:
            clock = time.perf_counter
            until = clock() + self.spin
            while not _ready(prog, t, who) and clock() < until:
                pass
        else:
            clock = time.perf_counter
            until = clock() + YIELD_S
            yld = os.sched_yield
            while not _ready(prog, t, who) and clock() < until:
                yld()
        seg = self.seg
        bells = seg.bells
        row = ctrl[self.r]
        live_at = time.monotonic() + LIVE_S  # the first look at the peers' processes
        try:
            while not _ready(prog, t, who):
                if first:
                    self._arrived(first, arr)
                if self.ctrl is None:
                    self._closed()
                self._check(t, who, ctrl)
                broken = comm.ctx.broken
                if broken is not None:
                    raise TransportError(str(broken))
                now = time.monotonic()
                if now >= live_at:
                    live_at = now + LIVE_S
                    self._peers_alive(t, who, prog, ctrl)
                left = comm.deadline - now
                if left <= 0:
                    late = [q for q in (who or range(self.P)) if prog[q] < t]
                    where = ", ".join(f"rank {self.gr[q]} is in op #{int(ctrl[q, _SEQ])}"
                                      for q in late)
                    late = [self.gr[q] for q in late]
                    raise OpTimeout(f"rank {self.me}: {comm.desc} did not complete within the "
                                    f"{comm.timeout:.1f}s timeout: still waiting for ranks {late} "
                                    f"(shared memory; {where})")
                # Say what this rank waits for (a publisher that completes it rings this
                # rank's bell), then sleep unless it came meanwhile.
                row[_WHO] = -1 if who is None else who[0]
                row[_WANT] = t
                seg.fence()
                seen = int(bells[self.r])
                if _ready(prog, t, who):
                    break
                seg.sleep(seen, min(POLL_S, left))
        finally:
            row[_WANT] = 0
        if first:
            self._arrived(first, arr)
        if not self._checked:
            if self._check(t, who, ctrl):
                self._settle(t, who, ctrl)
        if _WEAK_ORDER:
            seg.fence()

    def _arrived(self, first: list, arr: dict) -> None:
        """Note the time for the peers in ``first`` that published in this op meanwhile."""
        ticks = self.prog.tolist()
        base = self.base
        now = None
        for q in [q for q in first if ticks[q] > base]:
            if now is None:
                now = time.perf_counter()
            first.remove(q)
            g = self.gr[q]
            if g not in arr or now < arr[g]:
                arr[g] = now

    def _settle(self, t: int, who, ctrl) -> None:
        """Every rank waited for is at tick ``t`` but one was caught beginning its next op
        (its sequence number being rewritten): look again until it is readable, so that no op
        completes without its calls compared (the next op compares only its own)."""
        comm = self.comm
        while True:
            if time.monotonic() > comm.deadline:
                stuck = [self.gr[q] for q in (who or range(self.P))
                         if q != self.r and int(ctrl[q, _SEQ]) == 0]
                raise OpTimeout(f"rank {self.me}: {comm.desc} did not complete within the "
                                f"{comm.timeout:.1f}s timeout: ranks {stuck} never finished "
                                f"beginning their next op (shared memory; their sequence "
                                f"number stayed 0)")
            os.sched_yield()
            if not self._check(t, who, ctrl):
                return

    def _peers_alive(self, t: int, who, prog, ctrl) -> None:
        """Raise if a rank this one waits for (not at tick ``t`` yet) closed its group or
        failed (a link's failure) or its process has exited."""
        comm = self.comm
        ctx = comm.ctx
        late = [q for q in (who or range(self.P)) if prog[q] < t]
        for q in late:
            failure = ctx.peer_failure(self.gr[q])
            if failure is not None:
                # (a peer that failed because of another rank and then closed or exited
                # names that rank: Context.lost)
                raise ctx.lost(self.gr[q], str(failure), f"rank {self.me}: {comm.desc}")
        pids = {q: self._pid(q, ctrl) for q in late}
        gone = self.seg.watch.exited([p for p in pids.values() if p])  # one syscall
        for q in late:
            if pids[q] in gone:
                err = ctx.lost(self.gr[q], f"rank {self.me}: {comm.desc}: rank {self.gr[q]} "
                                           f"(process {int(ctrl[q, _PID])} on this host) has "
                                           f"exited{ctx.where()}",
                               f"rank {self.me}: {comm.desc}")
                ctx.report_error(str(err), err.root)  # the other ranks hear of it at once
                raise err

    def _pid(self, q: int, ctrl) -> int:
        """Segment rank q's pid where this rank can tell whether it runs, else 0 (no pid
        published yet, or another pid namespace)."""
        return watchable_pid(int(ctrl[q, _PID]), int(ctrl[q, _PIDNS]), self._pidns)

    def _closed(self) -> None:
        comm = self.comm
        if comm is None:
            raise TransportError(f"rank {self.me}: the process group was closed")
        why = comm.ctx.close_error
        raise TransportError(str(why) if why is not None else
                             f"rank {self.me}: {comm.desc}: the process group was closed")

    def _check(self, t: int, who, ctrl) -> bool:
        """A peer in this op with another call, or past this op without this rank, or at this
        op's tick ``t`` from an earlier op: mismatch. True where a rank at tick ``t`` was caught
        beginning its next op (its sequence number being rewritten: nothing to compare yet)."""
        comm = self.comm
        mine = _signed(comm.call)
        ready = True
        moving = False
        for q in (who or range(self.P)):
            if q == self.r:
                continue
            prog = int(ctrl[q, _PROG])  # before its seq: a seq read after it is as late or later
            seq = int(ctrl[q, _SEQ])
            digest = int(ctrl[q, _DIGEST])
            if int(ctrl[q, _SEQ]) != seq or seq == 0:  # it is beginning another op
                ready = False
                moving = moving or prog >= t
                continue
            if seq < comm.seq and prog >= t > self.base:
                # It published this op's tick t in an earlier op: the ranks' ticks only line up
                # when they make the same calls (e.g. a broadcast's root, one tick, then a
                # barrier, one tick, against a small all_reduce's two).
                self._mismatch(q, f"is in {self._desc(q)} #{seq}", "the ranks called "
                               "different sequences of collectives")
            if seq == comm.seq and digest != mine:
                self._mismatch(q, f"called {self._desc(q)} #{seq}", "the ranks called different "
                               "collectives or passed other arguments (dtype, size, reduce op or "
                               "root)")
            elif seq > comm.seq and self._past_call_differs(ctrl, q, mine):
                self._mismatch(q, f"called other arguments in #{comm.seq} (now in "
                               f"{self._desc(q)} #{seq})", "the ranks called different "
                               "collectives or passed other arguments (dtype, size, reduce op or "
                               "root)")
            elif seq > comm.seq and int(ctrl[q, _PROG]) < t:
                self._left_unfinished(q, seq)
            ready = ready and seq >= comm.seq
        if ready and _ready(ctrl[:, _PROG], t, who):
            self._checked = True
        return moving

    def _past_call_differs(self, ctrl, q: int, mine: int) -> bool:
        """Whether peer q, already in a later op, called this op with another digest (from its
        history; False where the entry is gone or being rewritten: nothing to compare)."""
        h = _HIST + 2 * (self.comm.seq % _HIST_N)
        seq = int(ctrl[q, h])
        digest = int(ctrl[q, h + 1])
        return seq == self.comm.seq and int(ctrl[q, h]) == seq and digest != mine

    def _desc(self, q: int) -> str:
        if self.ctrl is None:
            return "another op"
        row = self.ctrl[q, _DESC_WORD:_DESC_WORD + _DESC_BYTES // 8].view(np.uint8)
        return bytes(row).split(b"\0", 1)[0].decode("utf-8", "replace") or "another op"

    def _left_unfinished(self, q: int, seq: int) -> None:
        """Peer q is in op #seq, past this one, without this op's tick: it failed this op
        (chained ops: the next one's first phase had begun) or it called another sequence of
        collectives. A peer that failed records why before it moves on (its cause record, its
        ERROR frame): raise naming the group's root cause, which this rank may learn a moment
        later (up to ``LEFT_WAIT_S``), and the sequence mismatch only where nothing failed."""
        comm = self.comm
        ctx = comm.ctx
        peer = self.gr[q]
        deadline = time.monotonic() + LEFT_WAIT_S
        while ctx.cause_of(peer) is None and ctx.root_cause() is None:
            if time.monotonic() >= deadline:
                self._mismatch(q, f"is in {self._desc(q)} #{seq}", "the ranks called "
                               "different sequences of collectives")
            time.sleep(POLL_S)
        prefix = f"rank {self.me}: {comm.desc}"
        cause = ctx.cause_of(peer)
        said = f": {cause[1]}" if cause is not None and cause[0] == peer else ""
        raise ctx.lost(peer, f"{prefix}: rank {peer} left it unfinished for #{seq}, having "
                             f"failed{said}{ctx.where()}", prefix)

    def _mismatch(self, q: int, what: str, why: str) -> None:
        comm = self.comm
        msg = (f"rank {self.me}: rank {self.gr[q]} {what} while rank {self.me} called {comm.op}"
               f"({comm.call_text}) #{comm.seq}: {why}{comm.ctx.where()}")
        comm.ctx.report_error(msg)
        raise MismatchError(msg)


# ---------------------------------------------------------------------------- algorithms
def _ready(prog, t: int, who) -> bool:
    ticks = prog.tolist()  # one read of a few words (NumPy's min costs more than it)
    if who is None:
        return min(ticks) >= t
    return all(ticks[q] >= t for q in who)


def _engine(comm: Comm) -> Engine:
    e = comm.shm
    e.begin(comm)
    comm.algorithm = "shm"
    return e


def _chunks(n: int, per: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of at most ``per`` elements; one (0, 0) if n is 0."""
    if n == 0:
        return [(0, 0)]
    return [(o, min(per, n - o)) for o in range(0, n, per)]


def _share(n: int, P: int, q: int) -> tuple[int, int]:
    """Rank q's part [lo, hi) of n elements (cache-line sized multiples; may be empty)."""
    m = -(-n // P)
    m = -(-m // 16) * 16
    lo = min(n, q * m)
    return lo, min(n, lo + m)


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    E = _engine(comm)
    P, r = E.P, E.r
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    if n * es <= min(SMALL_BYTES, E.C):
        b = E.next_set()
        E.wait_free(E.S(b, r))
        _copy(E.view(E.S(b, r), dt, n, es), flat)
        E.publish()
        E.wait(E.tick)
        areas = [E.S(b, q) for q in range(P)]
        _fold(flat, [E.view(a, dt, n, es) for a in areas], op)
        E.publish(areas)
        E.tx_all += n * es  # every peer folds this rank's slot; it folds every peer's
        E.rx_all += n * es
        E.wrote += n * es
        return
    if n * es >= CMA_BYTES and P > 1:
        if E.cma is None:
            E.cma = _cma_probe(E)
        if E.cma != "off":
            m = E._big
            E._big += 1
            use = E.cma == "on" or _cma_choice(E, m)
            t0 = time.perf_counter()
            if use:
                _all_reduce_cma(E, flat, op)
            else:
                _all_reduce_segment(E, flat, op)
            _cma_note(E, m, use, (time.perf_counter() - t0) / (n * es))
            return
        E.big_paths[1] += 1
    _all_reduce_segment(E, flat, op)


def _count_shares(E: Engine, n: int, es: int, mine: int) -> None:
    """Bytes moved by an all_reduce of ``n`` elements of ``es`` bytes reduced in shares
    (``_share``; ``mine``: this rank's share's length): with each peer q this rank sends q's
    share of its input (q folds it) and its own share of the result (q copies it out), and
    receives the same: q's share of the result and this rank's share of q's input."""
    tx, rx, P, r = E.tx, E.rx, E.P, E.r
    for q in range(P):
        if q != r:
            lo, hi = _share(n, P, q)
            d = (hi - lo + mine) * es
            tx[q] += d
            rx[q] += d


def _all_reduce_segment(E: Engine, flat: torch.Tensor, op) -> None:
    """Chunks through the segment: copy in, each rank folds its share, copy out (pipelined)."""
    P, r = E.P, E.r
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    chunks = _chunks(n, E.C // es)
    nch = len(chunks)
    sets = [E.next_set() for _ in chunks]
    for ph in range(nch + 2):
        reads = []
        i = ph - 2  # copy the result of chunk i out
        if i >= 0:
            o, ln = chunks[i]
            _copy(flat[o:o + ln], E.view(E.R(sets[i]), dt, ln, es))
            reads.append(E.R(sets[i]))
        i = ph - 1  # reduce this rank's share of chunk i
        if 0 <= i < nch:
            o, ln = chunks[i]
            b = sets[i]
            lo, hi = _share(ln, P, r)
            E.wait_free(E.R(b))
            if hi > lo:
                _fold(E.view(E.R(b), dt, ln, es)[lo:hi],
                      [flat[o + lo:o + hi] if q == r else E.view(E.S(b, q), dt, ln, es)[lo:hi]
                       for q in range(P)], op)
            reads += [E.S(b, q) for q in range(P)]
            _count_shares(E, ln, es, hi - lo)
            E.wrote += ln * es  # its slot but its own share, and its share of the result
        i = ph  # copy chunk i in, but for this rank's own share (folded from flat)
        if i < nch:
            o, ln = chunks[i]
            a = E.S(sets[i], r)
            lo, hi = _share(ln, P, r)
            E.wait_free(a)
            slot = E.view(a, dt, ln, es)
            _copy(slot[:lo], flat[o:o + lo])
            _copy(slot[hi:], flat[o + hi:o + ln])
        E.publish(reads)
        if ph < nch + 1:
            E.wait(E.tick)


def _cma_probe(E: Engine) -> str:
    """Whether every rank of the segment allows cross-memory attach (LINERATE_CMA not 0) and
    can read every other's memory with it, agreed by all: "off", "on" (every rank has 1) or
    "tuned" (asked once, in the first large all_reduce; two barriers; every rank asks,
    whatever its setting, so that all run the same ticks). Each
    rank publishes the address of a private word holding a fresh nonce (the nonce itself goes
    in its control row) and reads every peer's: the read must succeed and find that nonce,
    which also proves the pid is the process that holds the segment. Containers without
    CAP_SYS_PTRACE, Yama's ptrace_scope of 1 or more between siblings, or a seccomp filter
    forbid it: then the copies go through the segment."""
    r, P, ctrl = E.r, E.P, E.ctrl
    nonce = int.from_bytes(os.urandom(8), "little") >> 1 or 1
    word = np.array([nonce], dtype=np.int64)  # private memory, alive until the 2nd barrier
    ctrl[r, _CMA_NONCE] = nonce
    allowed = E._cma_setting != "0"
    ctrl[r, _CMA_ADDR] = word.ctypes.data if allowed else 0
    E.publish()
    E.wait(E.tick)
    ok, why = allowed, "LINERATE_CMA=0"
    got = np.zeros(1, dtype=np.int64)
    for q in range(P):
        if not ok or q == r:
            continue
        addr = int(ctrl[q, _CMA_ADDR])
        if addr == 0:
            ok, why = False, f"rank {E.gr[q]} has LINERATE_CMA=0"
        elif int(ctrl[q, _PIDNS]) != E._pidns or not E._pidns:
            ok, why = False, f"rank {E.gr[q]} runs in another pid namespace"
        else:
            try:
                cma_read(int(ctrl[q, _PID]), got.ctypes.data, addr, 8)
                if int(got[0]) != int(ctrl[q, _CMA_NONCE]):
                    ok, why = False, f"process {int(ctrl[q, _PID])} is not rank {E.gr[q]}"
            except OSError as e:
                ok, why = False, str(e)
    ctrl[r, _CMA_OK] = (3 if E._cma_setting == "1" else 1) if ok else 2
    E.publish()
    E.wait(E.tick)
    verdicts = {int(ctrl[q, _CMA_OK]) for q in range(P)}
    agreed = "off" if 2 in verdicts else "on" if verdicts == {3} else "tuned"
    del word
    if not ok and allowed:
        log.info("rank %d: no cross-memory attach between the ranks of this host (%s): large "
                 "all_reduces copy through the shared segment", E.me, why)
    elif ok and agreed == "off":
        log.info("rank %d: another rank of this host cannot use cross-memory attach: large "
                 "all_reduces copy through the shared segment", E.me)
    return agreed


def _cma_choice(E: Engine, m: int) -> bool:
    """LINERATE_CMA=auto: whether the m-th large all_reduce of this engine reads by
    cross-memory attach. The same answer on every rank: it depends on m and on the times every
    rank published after its op m-2 (in slot m % 2; each rank wrote it before its first tick
    of op m-1, which every rank waited for, and will write it again only after op m, which
    needs this rank's ticks of op m); the path whose time per byte summed over the ranks is
    lower wins, every CMA_RETRY-th op the other one."""
    if m < CMA_EXPLORE:
        return CMA_TRIAL[m]
    slot = _CMA_TIMES + 2 * (m % 2)
    cma, seg = E.ctrl[:, slot], E.ctrl[:, slot + 1]
    if not cma.all() or not seg.all():  # a path without a time on some rank: measure it
        return not cma.all()
    faster = int(cma.sum()) < int(seg.sum())
    return (not faster) if m % CMA_RETRY == 0 else faster


def _cma_note(E: Engine, m: int, used_cma: bool, per_byte: float) -> None:
    """Keep this op's time per byte for its path (not the path's first: warm-up); publish
    each path's best of its last CMA_KEEP in slot m % 2 (0: none yet)."""
    i = 0 if used_cma else 1
    E.big_paths[i] += 1
    if E.big_paths[i] > 1:
        kept = E._times[i]
        kept.append(per_byte)
        del kept[:-CMA_KEEP]
    if E.ctrl is not None:
        slot = _CMA_TIMES + 2 * (m % 2)
        for j in (0, 1):
            E.ctrl[E.r, slot + j] = int(min(E._times[j]) * 1e12) if E._times[j] else 0


def _all_reduce_cma(E: Engine, flat: torch.Tensor, op) -> None:
    """all_reduce by cross-memory attach: each rank publishes its tensor's address; after a
    barrier it reduces its 1/P share (rank order, pieces of CMA_PIECE) reading every peer's
    piece straight from the peer's tensor into a cache-sized scratch buffer, writing the result
    into its own tensor; after a second barrier it reads every other share's result from its
    owner's tensor into its own; a third keeps every tensor alive until no one reads it. Per
    byte: about 2.5 bytes of memory traffic at 2 ranks (the copies through the segment: 5.5).
    Every rank's result is the bytes its owner computed: the same bits everywhere."""
    P, r, ctrl, comm = E.P, E.r, E.ctrl, E.comm
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    base = flat.data_ptr()
    ctrl[r, _CMA_PTR] = base
    E.publish()
    E.wait(E.tick)  # every rank is in this op, its tensor in place and its address known
    pids = [int(ctrl[q, _PID]) for q in range(P)]
    ptrs = [int(ctrl[q, _CMA_PTR]) for q in range(P)]

    def read(q: int, local: int, off: int, nbytes: int) -> None:
        try:
            cma_read(pids[q], local, ptrs[q] + off, nbytes)
        except OSError as e:
            # ESRCH, EFAULT: rank q is gone, or left this op; where it (or another rank)
            # recorded that it failed because of another rank, that rank is named.
            ctx = comm.ctx
            err = ctx.lost(E.gr[q], f"rank {E.me}: {comm.desc}: reading rank {E.gr[q]}'s "
                                    f"tensor (process {pids[q]}, cross-memory attach) failed: "
                                    f"{e}{ctx.where()}", f"rank {E.me}: {comm.desc}")
            ctx.report_error(str(err), err.root)
            raise err from None

    lo, hi = _share(n, P, r)
    if hi > lo:
        k = max(1, CMA_PIECE // es)
        if E._cma_scratch is None or E._cma_scratch.numel() < P * CMA_PIECE:
            E._cma_scratch = torch.empty(P * CMA_PIECE + 64, dtype=torch.uint8)
        sbase = -(-E._cma_scratch.data_ptr() // 64) * 64 - E._cma_scratch.data_ptr()
        scratch = [E._cma_scratch[sbase + q * CMA_PIECE:sbase + (q + 1) * CMA_PIECE]
                   for q in range(P)]
        for o in range(lo, hi, k):
            ln = min(k, hi - o)
            mine = flat[o:o + ln]
            srcs = []
            for q in range(P):
                if q == r:
                    if r >= 2:  # the fold writes its first result over mine before reading it
                        s = scratch[q][:ln * es].view(dt)
                        _copy(s, mine)
                        srcs.append(s)
                    else:
                        srcs.append(mine)
                else:
                    s = scratch[q][:ln * es].view(dt)
                    read(q, s.data_ptr(), o * es, ln * es)
                    srcs.append(s)
            _fold(mine, srcs, op)
    E.publish()
    E.wait(E.tick)  # every share is reduced; no one reads an input any more
    for q in range(P):
        if q != r:
            qlo, qhi = _share(n, P, q)
            if qhi > qlo:
                read(q, base + qlo * es, qlo * es, (qhi - qlo) * es)
    _count_shares(E, n, es, hi - lo)
    E.wrote += (hi - lo) * es  # its share of the result, in its tensor (the input: not written)
    E.publish()
    E.wait(E.tick)  # no one reads this rank's tensor any more


def reduce(comm: Comm, flat: torch.Tensor, op, root: int) -> None:
    E = _engine(comm)
    P, r = E.P, E.r
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    if n * es <= min(SMALL_BYTES, E.C):
        b = E.next_set()
        E.wait_free(E.S(b, r))
        _copy(E.view(E.S(b, r), dt, n, es), flat)
        E.publish()
        areas = [E.S(b, q) for q in range(P)]
        if r == root:
            E.wait(E.tick)
            _fold(flat, [E.view(a, dt, n, es) for a in areas], op)
            E.rx_all += n * es
        else:
            E.tx[root] += n * es
            E.wrote += n * es
        E.publish(areas)
        return
    chunks = _chunks(n, E.C // es)
    nch = len(chunks)
    sets = [E.next_set() for _ in chunks]
    for ph in range(nch + 2):
        reads = []
        i = ph - 2
        if i >= 0:
            if r == root:
                o, ln = chunks[i]
                _copy(flat[o:o + ln], E.view(E.R(sets[i]), dt, ln, es))
            reads.append(E.R(sets[i]))
        i = ph - 1
        if 0 <= i < nch:
            o, ln = chunks[i]
            b = sets[i]
            lo, hi = _share(ln, P, r)
            E.wait_free(E.R(b))
            if hi > lo:
                _fold(E.view(E.R(b), dt, ln, es)[lo:hi],
                      [E.view(E.S(b, q), dt, ln, es)[lo:hi] for q in range(P)], op)
            reads += [E.S(b, q) for q in range(P)]
            # every rank folds its share of every slot; the root copies every share out
            for q in range(P):
                if q != r:
                    qlo, qhi = _share(ln, P, q)
                    E.tx[q] += (qhi - qlo) * es
                    E.rx[q] += (hi - lo + (qhi - qlo if r == root else 0)) * es
            if r != root:
                E.tx[root] += (hi - lo) * es
            # its slot but its own share (every share of it has one reader), its share of the
            # result where the root reads it
            E.wrote += (ln - (hi - lo) if r == root else ln) * es
        i = ph
        if i < nch:
            o, ln = chunks[i]
            a = E.S(sets[i], r)
            E.wait_free(a)
            _copy(E.view(a, dt, ln, es), flat[o:o + ln])
        E.publish(reads)
        if ph < nch:
            E.wait(E.tick)
        elif ph == nch and r == root:
            E.wait(E.tick)


def broadcast(comm: Comm, t: torch.Tensor, root: int) -> None:
    """Chunk k: the root writes it into one of its two slots and publishes; every other rank
    waits for that, copies it out and publishes. One tick per chunk on every rank: the slot is
    free again once every rank has published it."""
    E = _engine(comm)
    r = E.r
    data = _bytes(t)
    if r == root:  # every other rank reads all of it, written once
        E.tx_all += data.numel()
        E.wrote += data.numel()
    else:
        E.rx[root] += data.numel()
    for o, ln in _chunks(data.numel(), E.C):
        a = E.S(E.next_set(), root)
        if r == root:
            E.wait_free(a)
            _copy(E.areas[a][:ln], data[o:o + ln])
        else:
            E.wait(E.tick + 1, [root])
            _copy(data[o:o + ln], E.areas[a][:ln])
        E.publish([a])


def all_gather(comm: Comm, segs: list[torch.Tensor]) -> None:
    """segs[q] receives rank q's contribution; segs[me] already holds this rank's."""
    _gather_impl(comm, [_bytes(s) for s in segs], None)


def gather(comm: Comm, t: torch.Tensor, outs: list[torch.Tensor] | None, root: int) -> None:
    if comm.rank == root:
        _copy(outs[root], t)
        segs = [_bytes(o) for o in outs]
    else:
        segs = [None] * comm.size
        segs[comm.rank] = _bytes(t)
    _gather_impl(comm, segs, root)


def _gather_impl(comm: Comm, segs: list, root: int | None) -> None:
    E = _engine(comm)
    P, r = E.P, E.r
    mine = segs[r]
    chunks = _chunks(mine.numel(), E.C)
    nch = len(chunks)
    sets = [E.next_set() for _ in chunks]
    reader = root is None or r == root
    # (all contributions have this rank's length: the reads below take it for every rank's)
    if root is None:  # every peer (the root) reads all of this rank's
        E.tx_all += mine.numel()
    elif r != root:
        E.tx[root] += mine.numel()
    if root is None or r != root:  # (the root's own slot has no other reader)
        E.wrote += mine.numel()
    if reader:
        E.rx_all += mine.numel()
    for ph in range(nch + 1):
        reads = []
        i = ph - 1
        if i >= 0:
            o, ln = chunks[i]
            b = sets[i]
            if reader:
                for q in range(P):
                    if q != r:
                        _copy(segs[q][o:o + ln], E.areas[E.S(b, q)][:ln])
            reads = [E.S(b, q) for q in range(P)]
        if ph < nch:
            o, ln = chunks[ph]
            a = E.S(sets[ph], r)
            E.wait_free(a)
            _copy(E.areas[a][:ln], mine[o:o + ln])
        E.publish(reads)
        if ph < nch and reader:
            E.wait(E.tick)


def scatter(comm: Comm, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
    """As broadcast, with the root's slot cut into one block per rank."""
    E = _engine(comm)
    P, r = E.P, E.r
    mine = _bytes(out)
    srcs = [_bytes(x) for x in ins] if r == root else None
    if r == root:
        _copy(mine, srcs[root])
        E.tx_all += mine.numel()  # a block of the out's size for every other rank
        E.wrote += mine.numel() * (P - 1)
    else:
        E.rx[root] += mine.numel()
    B = (E.C // P) // _ALIGN * _ALIGN
    for o, ln in _chunks(mine.numel(), B):
        a = E.S(E.next_set(), root)
        if r == root:
            E.wait_free(a)
            area = E.areas[a]
            for q in range(P):
                if q != root:
                    _copy(area[q * B:q * B + ln], srcs[q][o:o + ln])
        else:
            E.wait(E.tick + 1, [root])
            _copy(mine[o:o + ln], E.areas[a][r * B:r * B + ln])
        E.publish([a])


def reduce_scatter(comm: Comm, segs: list[torch.Tensor], out: torch.Tensor, op) -> None:
    """Rank q gets the reduction of every rank's segs[q] in ``out`` (segs are read only)."""
    reduce_scatter_v(comm, segs, [out.numel()] * comm.size, out, op)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Cat:
    """Byte ranges of several contiguous tensors read or written as one (the two-level
    algorithms' shares: one column from each host, scattered in the caller's tensors)."""

    def __init__(self, parts):
        self.parts = [(t.data_ptr(), t.numel() * t.element_size()) for t in parts]
        self.nbytes = sum(n for _, n in self.parts)

    def _spans(self, off: int, ln: int):
        for addr, n in self.parts:
            if ln <= 0:
                return
            if off >= n:
                off -= n
                continue
            k = min(n - off, ln)
            yield addr + off, k
            off, ln = 0, ln - k

    def read(self, dst: int, off: int, ln: int) -> None:
        """Bytes [off, off + ln) of the concatenation to address ``dst``."""
        for addr, k in self._spans(off, ln):
            ctypes.memmove(dst, addr, k)
            dst += k

    def write(self, src: int, off: int, ln: int) -> None:
        """``ln`` bytes at address ``src`` into bytes [off, off + ln) of the concatenation."""
        for addr, k in self._spans(off, ln):
            ctypes.memmove(addr, src, k)
            src += k


def _cat(x) -> Cat:
    return x if isinstance(x, Cat) else Cat([x])


def reduce_scatter_v(comm: Comm, srcs: list, lens: list[int], out: torch.Tensor, op) -> None:
    """Rank q gets the reduction of every rank's ``srcs[q]`` (a tensor or a Cat of
    ``lens[q]`` elements of out's dtype; read only) in ``out`` (``lens[me]`` elements); ``lens``
    are the same on every rank and may differ from rank to rank. Rank order everywhere."""
    E = _engine(comm)
    P, r = E.P, E.r
    es, dt = out.element_size(), out.dtype
    # This rank's own share folds straight from its tensor, not staged in its slot (one copy
    # of 1/P of its input less), unless it overlaps ``out`` where the fold would overwrite
    # it before reading it (ranks from 2 on: the first fold writes out).
    own = srcs[r]
    if not (isinstance(own, torch.Tensor) and own.is_contiguous() and own.dtype == dt
            and own.numel() == lens[r]) or (r >= 2 and _overlap(own, out)):
        own = None
    else:
        own = own.view(-1)
    srcs = [_cat(x) for x in srcs]
    m = max(1, (E.C // P) // es // 16 * 16)  # elements per rank's sub-block
    nch = max(1, max(-(-ln // m) for ln in lens))  # the same on every rank
    sets = [E.next_set() for _ in range(nch)]
    # rank q folds its block of every rank's slot; this rank folds its block of every peer's
    E.rx_all += lens[r] * es
    for q in range(P):
        if q != r:
            E.tx[q] += lens[q] * es
            E.wrote += lens[q] * es
    for ph in range(nch + 1):
        reads = []
        i = ph - 1
        if i >= 0:
            o = i * m
            ln = max(0, min(m, lens[r] - o))
            b = sets[i]
            if ln:
                srcs_q = [own[o:o + ln] if q == r and own is not None else
                          E.view(E.S(b, q), dt, P * m, es)[r * m:r * m + ln] for q in range(P)]
                _fold(out[o:o + ln], srcs_q, op)
            reads = [E.S(b, q) for q in range(P)]
        if ph < nch:
            o = ph * m
            a = E.S(sets[ph], r)
            E.wait_free(a)
            base = E.addr[a]
            for q in range(P):
                ln = max(0, min(m, lens[q] - o))
                if ln and (q != r or own is None):
                    srcs[q].read(base + q * m * es, o * es, ln * es)
        E.publish(reads)
        if ph < nch:
            E.wait(E.tick)


def gather_v(comm: Comm, segs: list, root: int | None = None) -> None:
    """``segs[q]`` (a Cat or tensor; its byte length the same on every rank, may differ from
    rank to rank) receives rank q's ``segs[q]`` on every rank (``root`` None) or on the root;
    ``segs[me]`` holds this rank's contribution."""
    E = _engine(comm)
    P, r = E.P, E.r
    segs = [_cat(x) for x in segs]
    lens = [s.nbytes for s in segs]
    C = E.C
    nch = max(1, max(-(-ln // C) for ln in lens))
    sets = [E.next_set() for _ in range(nch)]
    reader = root is None or r == root
    if root is None:  # every peer (the root) reads all of this rank's
        E.tx_all += lens[r]
    elif r != root:
        E.tx[root] += lens[r]
    if root is None or r != root:
        E.wrote += lens[r]
    if reader:
        for q in range(P):
            if q != r:
                E.rx[q] += lens[q]
    for ph in range(nch + 1):
        reads = []
        i = ph - 1
        if i >= 0:
            o = i * C
            b = sets[i]
            if reader:
                for q in range(P):
                    ln = min(C, lens[q] - o)
                    if q != r and ln > 0:
                        segs[q].write(E.addr[E.S(b, q)], o, ln)
            reads = [E.S(b, q) for q in range(P)]
        if ph < nch:
            o = ph * C
            a = E.S(sets[ph], r)
            ln = min(C, lens[r] - o)
            E.wait_free(a)
            if ln > 0:
                segs[r].read(E.addr[a], o, ln)
        E.publish(reads)
        if ph < nch and reader:
            E.wait(E.tick)


def all_to_all(comm: Comm, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """outs[q] receives rank q's ins[me] (any sizes; each rank's are checked against what the
    senders announce). Copies by address (memmove), no tensor views: this op is mostly Python
    overhead at small sizes."""
    E = _engine(comm)
    P, r = E.P, E.r
    move = ctypes.memmove
    src = [(x.data_ptr(), x.numel() * x.element_size()) for x in ins]
    dst = [(x.data_ptr(), x.numel() * x.element_size()) for x in outs]
    # The slots of phase 0 carry, after the P blocks, each rank's step count and the bytes it
    # sends to / expects from every rank (in the slot: a rank that finished this op may
    # already reuse its control row).
    B = ((E.C - 8 * (2 * P + 1)) // P) // _ALIGN * _ALIGN
    steps = max([1] + [-(-n // B) for _, n in src + dst])
    meta = [steps] + [n for _, n in src] + [n for _, n in dst]
    if src[r][1]:
        move(dst[r][0], src[r][0], src[r][1])
    tx, rx = E.tx, E.rx
    for q in range(P):
        if q != r:
            tx[q] += src[q][1]
            rx[q] += dst[q][1]
            E.wrote += src[q][1]
    ph = 0
    total = None
    sets: list = []
    while True:
        reads = []
        i = ph - 1
        if i >= 0:
            b = sets[i]
            o = i * B
            for q in range(P):
                ln = min(B, dst[q][1] - o)
                if q != r and ln > 0:
                    move(dst[q][0] + o, E.addr[E.S(b, q)] + r * B, ln)
            reads = [E.S(b, q) for q in range(P)]
        if total is None or ph < total:
            b = E.next_set()
            sets.append(b)
            a = E.S(b, r)
            E.wait_free(a)
            base = E.addr[a]
            if ph == 0:
                E.areas[a][P * B:P * B + 8 * len(meta)].numpy().view(np.int64)[:] = meta
            o = ph * B
            for q in range(P):
                ln = min(B, src[q][1] - o)
                if q != r and ln > 0:
                    move(base + q * B, src[q][0] + o, ln)
        E.publish(reads)
        if total is not None and ph >= total:
            break
        E.wait(E.tick)
        if total is None:
            metas = [E.areas[E.S(sets[0], q)][P * B:P * B + 8 * len(meta)].numpy()
                     .view(np.int64).tolist() for q in range(P)]
            total = max(m[0] for m in metas)
            for q in range(P):  # both ways: every rank involved names the mismatch
                for a, b in ((q, r), (r, q)):
                    sent, want = metas[a][1 + b], metas[b][1 + P + a]
                    if q != r and sent != want:
                        msg = (f"rank {r}: in all_to_all #{comm.seq} rank {a} sends {sent} bytes "
                               f"to rank {b}, which expects {want} bytes from it: the ranks "
                               f"passed other split sizes{comm.ctx.where()}")
                        comm.ctx.report_error(msg)
                        raise MismatchError(msg)
        ph += 1


def barrier(comm: Comm) -> None:
    E = _engine(comm)
    E.publish()
    E.wait(E.tick)


def agree(comm: Comm, entries: list, offered: int, carry_bytes: int,
          avg_size: int | None = None) -> tuple[int, bool]:
    """collectives.fusion.agree on the segment: (the number of entries every rank fuses, the
    least offered; whether the head entry is already reduced). Each rank publishes its count
    and the running digest of its calls; a head entry of at most ``carry_bytes`` goes along and
    is folded here in rank order (an AVG head divided by ``avg_size``, default the ranks here;
    0: not divided). Raises ValueError naming the calls when they differ."""
    from .fusion import compare_digests
    E = _engine(comm)
    P, r = E.P, E.r
    head = entries[0]
    carry = head.nbytes <= min(carry_bytes, E.C - 64)  # the same on every rank for the same call
    # In the slot (not the control row, which a rank that finished this op may already reuse):
    # count and digest in its first 16 bytes, the head entry's bytes from byte 64.
    b = E.next_set()
    mine = E.S(b, r)
    E.wait_free(mine)
    words, step = E.words, E.C // 8
    words[mine * step] = offered
    words[mine * step + 1] = _signed(entries[offered - 1].chain)
    flat = head.buf.view(-1)
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    if carry and n:
        ctypes.memmove(E.addr[mine] + 64, flat.data_ptr(), n * es)
        E.tx_all += n * es  # every rank folds every rank's carried entry
        E.rx_all += n * es
        E.wrote += n * es
    E.publish()
    E.wait(E.tick)
    # Every rank's count and digest in two NumPy reads (a tensor view per rank would be most
    # of a small all_reduce's CPU on many ranks).
    first = E.S(b, 0) * step
    cs = words[first:first + P * step:step].tolist()
    ds = words[first + 1:first + 1 + P * step:step].tolist()
    for q in range(P):
        if q != r and cs[q] < 1:
            raise ValueError(f"rank {E.me}: fused all_reduce #{comm.seq}: rank {E.gr[q]} offered "
                             f"{cs[q]} calls")
    k = min(cs)
    compare_digests(entries, k,
                    {q: _unsigned(ds[q]) for q in range(P) if q != r and cs[q] == k},
                    lambda q: E.gr[q], E.me)
    areas = [E.S(b, q) for q in range(P)]
    if carry:
        npdt = _NP.get(dt)
        if npdt is not None and n:  # every rank's carried entry as rows of one array
            rows = np.ndarray((P, n), dtype=npdt, buffer=E.np_data,
                              offset=E.S(b, 0) * E.C + 64, strides=(E.C, es))
            fold_rows(flat, rows, head.op, npdt)
        else:
            _fold(flat, [E.areas[a][64:64 + n * es].view(dt) for a in areas], head.op)
        if avg_size != 0:
            finish_avg(flat, head.op, P if avg_size is None else avg_size)
    E.publish(areas)
    return k, carry


def lone_all_reduce(comm: Comm, t: torch.Tensor, op, chain: int, desc: str) -> None:
    """agree() of a rank that offers one call, its entry carried (the same words in the same
    slot: peers that offered more fuse this one call with it), for a synchronous all_reduce of
    at most agree's carry bytes with nothing queued: the least Python that keeps its checks.
    ``chain``: the running digest after this call (fusion.chain_digest), ``desc`` the call's
    text (for a mismatch's error); ``t``, a contiguous CPU tensor, is reduced in place (an AVG
    is divided here), folded as agree() folds (the same bits on every rank, whichever of the
    two it ran). What a job repeats is cached: the rows' views per set, dtype and size, and
    the result's NumPy view per address, dtype and size (made from the address, holding
    nothing: it is used only while a caller's tensor is there)."""
    E = comm.shm
    E.begin(comm)
    P, r, C = E.P, E.r, E.C
    b = E.next_set()
    mine = E.S(b, r)
    if E.free[mine]:
        E.wait_free(mine)
    words, step = E.words, C >> 3
    w0 = mine * step
    words[w0] = 1
    signed = _signed(chain)
    words[w0 + 1] = signed
    n = t.numel()
    dt = t.dtype
    ptr = t.data_ptr()
    nb = n * t.element_size()
    if nb:
        ctypes.memmove(E.addr[mine] + 64, ptr, nb)
        E.tx_all += nb
        E.rx_all += nb
        E.wrote += nb
    E.publish()
    E.wait(E.tick)
    first = b * P * step
    cs = words[first:first + P * step:step].tolist()
    bad = {}
    for q in range(P):
        if q != r:
            c = cs[q]
            if c == 1:  # peers that offered more fuse just this call: compared next time
                d = int(words[first + q * step + 1])
                if d != signed:
                    bad[q] = _unsigned(d)
            elif c < 1:
                raise ValueError(f"rank {E.me}: fused all_reduce #{comm.seq}: rank {E.gr[q]} "
                                 f"offered {c} calls")
    if bad:
        from .fusion import compare_digests
        head = types.SimpleNamespace(seq=comm.seq, chain=chain, desc=desc)
        compare_digests([head], 1, bad, lambda q: E.gr[q], E.me)
    key = (b, dt, n)
    rows = E.lone_rows.get(key)
    if rows is None:  # agree()'s rows, as one array (NumPy's dtypes) or tensor views
        if len(E.lone_rows) > 64:
            E.lone_rows.clear()
        npdt = _NP.get(dt)
        rows = E.lone_rows[key] = (
            (npdt, np.ndarray((P, n), dtype=npdt, buffer=E.np_data, offset=b * P * C + 64,
                              strides=(C, nb // n if n else 1)))
            if npdt is not None and n else
            (None, [E.areas[b * P + q][64:64 + nb].view(dt) for q in range(P)]))
    npdt, rows = rows
    if npdt is not None:
        okey = (ptr, dt, n)
        out = E.lone_outs.get(okey)
        if out is None:
            if len(E.lone_outs) > 64:
                E.lone_outs.clear()
            out = E.lone_outs[okey] = np.frombuffer(
                (ctypes.c_char * nb).from_address(ptr), dtype=npdt)
        if npdt in _NO_WARNINGS:  # integers and bool: nothing to warn of
            f = _LONE_FOLD[npdt is np.bool_].get(op)
            f(rows[0], rows[1], out=out)
            for i in range(2, P):
                f(out, rows[i], out=out)
        else:
            fold_rows_into(out, rows, op, npdt)
        if op == RedOpType.AVG:
            finish_avg(t.detach().view(-1), op, P)
    else:
        flat = t.detach().view(-1)
        _fold(flat, rows, op)
        finish_avg(flat, op, P)
    E.publish(range(b * P, b * P + P))


#: The NumPy dtypes whose folds cannot overflow into a warning (lone_all_reduce folds them
#: without np.errstate, a sizeable share of a small all_reduce's time).
_NO_WARNINGS = frozenset(np.dtype(d).type for d in (np.int8, np.uint8, np.int16, np.int32,
                                                     np.int64, np.bool_))
_LONE_FOLD = {False: NP_BINARY, True: {**NP_BINARY, **NP_BOOL}}
