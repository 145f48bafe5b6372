"""The shared segment as the collectives of one group use it: ticks, bells, liveness and
the agreement of calls (collectives/shm_algos.py runs its algorithms on it).

Each rank publishes a counter (its *tick*) after each phase of an op; every rank advances it
the same number of times for the same calls, so "every rank reached tick T" means "every rank
finished that phase" (``Engine.publish``, ``Engine.wait``). A waiting rank checks the counters
for a moment (where ranks outnumber cores it gives its core up between looks: 4 ranks on 2
cores must not fight spinners), says which tick it waits for and sleeps on its bell (a futex of
transport/shm's segment: no core burnt); a rank that publishes wakes exactly the sleepers
whose wait it completes. A sleeper also wakes after a short timeout and looks at the
transport's state and, every LIVE_S, whether the ranks it waits for still run: a rank that
died or reported an error fails the wait with that error. Each area of the segment remembers
the tick at which its last readers finish; a rank writes into an area only once every rank is
past it (``free``, ``wait_free``).

Agreement: before its first tick of an op a rank writes the op's sequence number, the digest of
its call (the same digest that travels in TCP frames) and the call's text into its control row
(``begin``); a rank that sees a peer in the same op with another digest fails with both calls
named and tells every rank, so a mismatch is named on every rank, never run.

An op is anything with the attributes a collective's ``Comm`` has (collectives/comm.py): ``op``,
``seq``, ``call`` (digest), ``call_text``, ``desc``, ``rank``, ``size``, ``timeout``, ``deadline``,
``arrivals`` and ``ctx`` (the transport Context: ``broken``, ``report_error``, ``peer_failure``,
``lost``, ``cause_of``, ``root_cause``, ``where``, ``close_error``). Nothing here knows an
algorithm.
"""
from __future__ import annotations

import os
import time
import weakref

import numpy as np

from ..request import MismatchError, TransportError
from . import BYTES_PER_RANK
from .sync import WEAK_ORDER, spin_for


class OpTimeout(TransportError):
    """An operation did not complete within its timeout (this rank's own verdict; a peer's
    report of its timeout arrives as a TransportError with the same words)."""


# control row words (int64); transport.shm.ctrl_row_bytes leaves 64 words + one per rank
PROG, SEQ, DIGEST, AUX = 0, 1, 2, 3
WANT, WHO = 4, 5   # the tick a sleeping rank waits for (0: awake); whose (-1: every rank's)
DESC_WORD, DESC_BYTES = 8, 256          # words 8..39: the call's text
# words 40..55: the (seq, digest) of this rank's last HIST_N ops, so that a rank that checks a
# peer which already moved on to a later op can still compare this op's call with its own
HIST, HIST_N = 40, 8
# words 56..59: cross-memory attach (see _all_reduce_cma): the tensor's address in this op; a
# private word's address and the nonce it holds (the probe); the probe's verdict (1 ok and
# tuned, 3 ok and always, 2 not); words 60..63: this rank's smoothed time per byte of each
# large all_reduce path (picoseconds: CMA, segment), in two slots by the parity of the op count
CMA_PTR, CMA_ADDR, CMA_NONCE, CMA_OK, CMA_TIMES = 56, 57, 58, 59, 60
#: Seconds a waiting rank sleeps at most before it looks at the transport's state again.
POLL_S = 0.005
# A waiting rank polls the counters before it sleeps on its bell for sync.SPIN_S where the
# group's ranks on its machine have a core each (sync.spin_for); where they outnumber cores
# it does not spin: YIELD_S.
#: Seconds a waiting rank polls where ranks outnumber cores, giving its core up between looks
#: (sched_yield: a rank it waits for, runnable on the same core, runs at once), before it
#: sleeps: sleeping at once there costs a futex wake-up per wait on each side
#: (docs/performance.md, small operations at 4 ranks).
YIELD_S = 200e-6
#: Seconds between a waiting rank's looks at whether the ranks it waits for still run (one
#: poll of their pidfds: transport/shm PidWatch). Looking at every wake-up (where there are
#: no pidfds, a kill(0) and a read of /proc/<pid>/stat per late peer) would be most of a small
#: all_reduce's CPU on many ranks. A rank that died is still noticed within this plus POLL_S.
LIVE_S = 0.02
#: Seconds a rank that finds a peer out of step (``_out_of_step``: past the current op without
#: it, or back in an earlier one with its tick) waits for word that the peer failed before it
#: names a sequence mismatch.
LEFT_WAIT_S = 0.2
# Memory order: x86 keeps stores in order and loads in order (TSO): a tick stored after a
# phase's data is seen after it. Elsewhere (WEAK_ORDER) a full barrier goes before each tick
# and after each wait. (Only the x86 path has been exercised.)


def to_signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def to_unsigned(s: int) -> int:
    return s & ((1 << 64) - 1)


class _Areas:
    """The segment's areas (2P + 2 of C bytes) as uint8 tensor views, each made when first used:
    a group's creation had made every one (66 at 32 ranks), where its small ops use a few."""

    __slots__ = ("_data", "_C", "_views")

    def __init__(self, data, C: int, n: int):
        self._data, self._C, self._views = data, C, [None] * n

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int):
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
        #: The control rows as one flat memoryview of int64 words, word i of rank q's row at
        #: ``q * self.W + i``: a scalar read or write there costs a fraction of NumPy's.
        self.W = seg.ctrl.shape[1]
        self.cw = memoryview(seg.ctrl.reshape(-1))
        self.rw = self.r * self.W  # this rank's row in cw
        self.prog = seg.ctrl[:, PROG]
        self.want = seg.ctrl[:, WANT]
        # How a waiting rank polls before it sleeps (sync.spin_for): ``spin`` seconds on its
        # core where the group's ranks on its machine have a core each; where they outnumber
        # cores, ``yield_s`` seconds giving the core up (a spinning rank would take the core a
        # rank it waits for needs); ranks that are threads of one process (the test suite's)
        # do neither: the rank a waiter waits for needs the interpreter lock that polling
        # holds, and the futex sleep lets it go.
        spin = spin_for(seg.layout, self.me)
        self.spin = spin or 0.0
        self.yield_s = 0.0 if spin is None else YIELD_S
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
        self._typed: dict = {}  # dtype -> the areas as one flat tensor of it (rows())
        self.free = [0] * nareas
        self.cursor = 0
        #: The running op's Comm, weakly (its caller holds it for the op; comm.shm is this
        #: engine: a strong reference made a cycle that kept a destroyed group's objects
        #: until the garbage collector ran).
        self._comm = None
        self._checked = True
        self._desc_key = None  # (op, call text) written in this rank's row
        #: Cross-memory attach between these ranks, agreed by all: None until the first large
        #: all_reduce asks every rank; then "off", "on" (every rank has LINERATE_CMA=1: always)
        #: or "tuned" (auto: the path that measured faster, _cma_choice).
        self.cma = None
        if cma is None:  # LINERATE_CMA from the environment (a group passes its Options')
            from linerate import settings
            cma = settings.read("LINERATE_CMA")
        self.cma_setting = cma
        self.cma_scratch = None
        #: lone_all_reduce's tensor views of the slots' rows: (set, dtype, elements) -> views.
        self.lone_rows: dict = {}
        self.big = 0                 # large all_reduces run here (the same on every rank)
        self.times = ([], [])        # this rank's last seconds per byte: CMA, segment
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
    def comm(self):
        ref = self._comm
        return ref() if ref is not None else None

    @comm.setter
    def comm(self, comm) -> None:
        ref = self._comm
        if ref is None or ref() is not comm:  # (the lone calls' Comm comes back each call)
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
        self.np_data = self.words = None
        self._typed = {}
        self.cma_scratch = None
        self.ctrl = self.row = self.prog = self.want = self.cw = None

    # ------------------------------------------------------------------ areas
    def S(self, b: int, q: int) -> int:
        return b * self.P + q

    def R(self, b: int) -> int:
        return 2 * self.P + b

    def view(self, area: int, dtype, n: int, nbytes_per: int):
        return self.areas[area][:n * nbytes_per].view(dtype)

    def rows(self, b: int, off: int, n: int, dtype):
        """``n`` elements of ``dtype`` at byte ``off`` of every rank's slot of set ``b``, as the
        rows of one strided tensor (row q: rank q's slot): one view for all ranks, not one
        per slot. ``off``: a multiple of the element size."""
        t = self._typed.get(dtype)
        if t is None:
            if self.np_data is None:  # closed (abort) while this op ran: its mapping is gone
                self._closed()
            t = self._typed[dtype] = self.seg.data[:len(self.addr) * self.C].view(dtype)
        es = t.element_size()  # (as_strided's offset counts from the storage's start)
        return t.as_strided((self.P, n), (self.C // es, 1),
                            t.storage_offset() + (b * self.P * self.C + off) // es)

    def next_set(self) -> int:
        b = self.cursor & 1
        self.cursor += 1
        return b

    # ------------------------------------------------------------------ op life
    def begin(self, comm) -> None:
        if self.ctrl is None:
            raise TransportError(f"rank {self.me}: {comm.desc}: the process group was closed")
        if comm.size != self.P or comm.rank != self.r:
            raise TransportError(f"rank {self.me}: {comm.desc}: the shared segment of ranks "
                                 f"{list(self.gr)} runs on a communicator of {comm.size} ranks")
        cw, w = self.cw, self.rw  # this rank's control row
        #: The last tick before this op: a peer at a later tick is in this op or past it.
        self.base = self.tick
        cw[w + SEQ] = 0  # changing: a peer that read the old seq sees it changed (_check)
        digest = cw[w + DIGEST] = to_signed(comm.call)
        key = (comm.op, comm.call_text)
        if key != self._desc_key:  # the row holds the last op's text: a repeated call keeps it
            text = f"{comm.op}({comm.call_text})".encode("utf-8", "replace")[:DESC_BYTES - 1]
            desc = self.row[DESC_WORD:DESC_WORD + DESC_BYTES // 8].view(np.uint8)
            desc[:] = 0
            desc[:len(text)] = np.frombuffer(text, np.uint8)
            self._desc_key = key
        seq = comm.seq
        h = w + HIST + 2 * (seq % HIST_N)
        cw[h] = 0            # the entry is being rewritten
        cw[h + 1] = digest
        cw[h] = seq
        cw[w + SEQ] = seq  # last: a peer reads seq, digest, seq (see _check)
        ref = self._comm  # (the comm setter, inline: the lone calls' Comm comes back each call)
        if ref is None or ref() is not comm:
            self._comm = weakref.ref(comm)
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
        if WEAK_ORDER:  # the phase's data stores before the tick
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
                who = int(ctrl[q, WHO])
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
            if WEAK_ORDER:  # the ticks seen before the data they announce
                self.seg.fence()
            return
        ref = self._comm  # (the comm property, inline)
        comm = ref() if ref is not None else None
        arr = comm.arrivals
        # Peers that have not published anything in this op yet (at or before its base
        # tick): when their first contribution comes is noted (collectives/straggler.py).
        first = None
        if arr is not None:
            base, ticks = self.base, prog.tolist()
            first = [q for q in (who or range(self.P)) if ticks[q] <= base and q != self.r]
        spin = self.spin
        if spin:
            clock = time.perf_counter
            until = clock() + spin
            if who is None:  # (_ready, inline: each look sooner)
                while min(prog.tolist()) < t and clock() < until:
                    pass
            else:
                while not _ready(prog, t, who) and clock() < until:
                    pass
        elif self.yield_s:
            clock = time.perf_counter
            until = clock() + self.yield_s
            yld = os.sched_yield
            while not _ready(prog, t, who) and clock() < until:
                yld()
        if not _ready(prog, t, who):
            self._sleep_until(t, who, prog, ctrl, comm, first, arr)
        if first:
            self._arrived(first, arr)
        if not self._checked:
            if self._check(t, who, ctrl):
                self._settle(t, who, ctrl)
        if WEAK_ORDER:
            self.seg.fence()

    def _sleep_until(self, t: int, who, prog, ctrl, comm, first, arr) -> None:
        """wait()'s end where its polling did not see tick ``t``: checks, looks at the peers'
        processes and sleeps on this rank's bell until it comes, the group breaks or the op
        times out."""
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
                    self._peers_alive(t, who, prog)
                left = comm.deadline - now
                if left <= 0:
                    late = [q for q in (who or range(self.P)) if prog[q] < t]
                    where = ", ".join(f"rank {self.gr[q]} is in op #{int(ctrl[q, SEQ])}"
                                      for q in late)
                    late = [self.gr[q] for q in late]
                    raise OpTimeout(f"rank {self.me}: {comm.desc} did not complete within the "
                                    f"{comm.timeout:.1f}s timeout: still waiting for ranks {late} "
                                    f"(shared memory; {where})")
                # Say what this rank waits for (a publisher that completes it rings this
                # rank's bell), then sleep unless it came meanwhile.
                row[WHO] = -1 if who is None else who[0]
                row[WANT] = t
                seg.fence()
                seen = int(bells[self.r])
                if _ready(prog, t, who):
                    break
                seg.sleep(seen, min(POLL_S, left))
        finally:
            row[WANT] = 0

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
                         if q != self.r and int(ctrl[q, SEQ]) == 0]
                raise OpTimeout(f"rank {self.me}: {comm.desc} did not complete within the "
                                f"{comm.timeout:.1f}s timeout: ranks {stuck} never finished "
                                f"beginning their next op (shared memory; their sequence "
                                f"number stayed 0)")
            os.sched_yield()
            if not self._check(t, who, ctrl):
                return

    def _peers_alive(self, t: int, who, prog) -> None:
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
        pids = {q: self.seg.watchable_pid(q) for q in late}
        gone = self.seg.watch.exited([p for p in pids.values() if p])  # one syscall
        for q in late:
            if pids[q] in gone:
                err = ctx.lost(self.gr[q], f"rank {self.me}: {comm.desc}: rank {self.gr[q]} "
                                           f"(process {self.seg.pid(q)} on this host) has "
                                           f"exited{ctx.where()}",
                               f"rank {self.me}: {comm.desc}")
                ctx.report_error(str(err), err.root)  # the other ranks hear of it at once
                raise err

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
        mine = to_signed(comm.call)
        ready = True
        moving = False
        cw, W, progs = self.cw, self.W, self.prog
        if cw is None or progs is None:  # closed (abort) meanwhile
            self._closed()
        for q in (who or range(self.P)):
            if q == self.r:
                continue
            w = q * W
            prog = cw[w + PROG]  # before its seq: a seq read after it is as late or later
            seq = cw[w + SEQ]
            digest = cw[w + DIGEST]
            if cw[w + SEQ] != seq or seq == 0:  # it is beginning another op
                ready = False
                moving = moving or prog >= t
                continue
            if seq < comm.seq and prog >= t > self.base:
                # It published this op's tick t in an earlier op: the ranks' ticks only line up
                # when they make the same calls (e.g. a broadcast's root, one tick, then a
                # barrier, one tick, against a small all_reduce's two); or it failed its op
                # and ends the chained op before it on that op's own view.
                self._out_of_step(q, seq)
            if seq == comm.seq and digest != mine:
                self._mismatch(q, f"called {self._desc(q)} #{seq}", "the ranks called different "
                               "collectives or passed other arguments (dtype, size, reduce op or "
                               "root)")
            elif seq > comm.seq and self._past_call_differs(ctrl, q, mine):
                self._mismatch(q, f"called other arguments in #{comm.seq} (now in "
                               f"{self._desc(q)} #{seq})", "the ranks called different "
                               "collectives or passed other arguments (dtype, size, reduce op or "
                               "root)")
            elif seq > comm.seq and cw[w + PROG] < t:
                self._out_of_step(q, seq)
            ready = ready and seq >= comm.seq
        if ready and _ready(progs, t, who):
            self._checked = True
        return moving

    def _past_call_differs(self, ctrl, q: int, mine: int) -> bool:
        """Whether peer q, already in a later op, called this op with another digest (from its
        history; False where the entry is gone or being rewritten: nothing to compare)."""
        h = HIST + 2 * (self.comm.seq % HIST_N)
        seq = int(ctrl[q, h])
        digest = int(ctrl[q, h + 1])
        return seq == self.comm.seq and int(ctrl[q, h]) == seq and digest != mine

    def _desc(self, q: int) -> str:
        if self.ctrl is None:
            return "another op"
        row = self.ctrl[q, DESC_WORD:DESC_WORD + DESC_BYTES // 8].view(np.uint8)
        return bytes(row).split(b"\0", 1)[0].decode("utf-8", "replace") or "another op"

    def _out_of_step(self, q: int, seq: int) -> None:
        """Peer q is in op #seq, past this one without this op's tick, or before this one with
        its tick: it failed this op (chained ops: the next one's first phase had begun) or
        the op after #seq (it then ends the chained #seq on that op's own view), or it called
        another sequence of collectives. A peer that failed, or whose failure came from
        another rank, hears why (its cause record, an ERROR frame): raise naming the group's
        root cause, which this rank may learn a moment later (up to ``LEFT_WAIT_S``), and the
        sequence mismatch only where nothing failed."""
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
        where = "left it unfinished for" if seq > comm.seq else "went back to"
        raise ctx.lost(peer, f"{prefix}: rank {peer} {where} #{seq}, having "
                             f"failed{said}{ctx.where()}", prefix)

    def _mismatch(self, q: int, what: str, why: str) -> None:
        comm = self.comm
        msg = (f"rank {self.me}: rank {self.gr[q]} {what} while rank {self.me} called {comm.op}"
               f"({comm.call_text}) #{comm.seq}: {why}{comm.ctx.where()}")
        comm.ctx.report_error(msg)
        raise MismatchError(msg)


def _ready(prog, t: int, who) -> bool:
    ticks = prog.tolist()  # one read of a few words (NumPy's min costs more than it)
    if who is None:
        return min(ticks) >= t
    return all(ticks[q] >= t for q in who)


