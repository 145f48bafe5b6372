"""How a group's collective call runs, decided in one place: plain, fused, lone, chained or
prioritized.

The process-group adapter (collectives/backend.py) validates a call, stages its tensors and
hands it here as a function of a ``Comm`` (``submit``), a fusion entry (``fusable``), a lone
small call (``lone_all_reduce``, ``lone_barrier``) or a prioritized all_reduce (``priority``).
The runner numbers it, puts it in the group's order (collectives/scheduler.py) and runs it:

- **plain**: ``submit``'s function, on the worker thread, or in a synchronous caller's thread
  when the worker is idle with nothing queued (``Scheduler.take_turn``);
- **fused**: async small all_reduces queued together run as one (collectives/fusion.py), after
  the ranks agree how many to fuse (``Dispatch.agree``: the table picks the agreement's
  algorithm);
- **lone**: a synchronous small all_reduce or barrier that finds nothing queued on a one-host
  group of a shared segment runs straight on it, with one reused Comm, no queue entry;
- **chained**: a two-level all_reduce may leave its end to the next queued all_reduce
  (collectives/two_level.py), which runs it once its own first phase is under way;
- **prioritized**: on the worker where the table gives it shared memory, else on a thread of
  its own beside the other ops.

Every way goes through the op lifecycle (collectives/op.py: flight recorder, metrics, the
peers told of a failure, the Work completed). The runner names no algorithm: it asks the
group's table (collectives/dispatch.py) for every choice.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref

from . import fusion
from .comm import Comm, Scratch
from .dispatch import WORKER
from .op import Op
from .scheduler import Scheduler
from .stage import Stage
from .work import Work, call_on_wait, completed, on_streams

#: A two-level all_reduce of at least this many bytes may be chained to the next one queued
#: (its local phases and inter-host sends start before this one's end: two_level.all_reduce).
CHAIN_MIN_BYTES = 1 << 20


class Runner:
    """The calls of one group, numbered and run in order (see the module's docstring)."""

    #: Most prioritized all_reduces running at once; more wait, in call order (which keeps
    #: every rank's running set overlapping: no deadlock).
    PRIORITY_THREADS = 64

    def __init__(self, ctx, options, rank: int, size: int, algos, life, group_name: str = ""):
        self._ctx = ctx
        self._options = options
        self._rank = rank
        self._algos = algos
        self._life = life
        #: The group's name, in every Work's name (the adapter keeps it current).
        self.group_name = group_name
        self.seq = 0
        self._seq_lock = threading.Lock()
        self._scratch = Scratch()
        me = weakref.ref(self)
        #: The order ops run in: the worker thread and the callers' turns (scheduler.py). It
        #: calls _execute and _run_fused through the instance (so a test may wrap them),
        #: weakly: a destroyed group leaves no cycle for the garbage collector.
        self.sched = Scheduler(rank, options, lambda op: me()._execute(op),
                               lambda entries: me()._run_fused(entries))
        #: The end of a two-level all_reduce chained to the next op (two_level.all_reduce):
        #: the worker's next op runs it once its own first phase is under way.
        self._chained = None
        self._chain = 0  # running digest of the fusable calls (fusion.chain_digest)
        #: Tensor fusion so far: all_reduce calls run as fusion entries, fused ops run.
        self.fusion_stats = {"calls": 0, "ops": 0}
        #: Two-level all_reduces whose end ran after the next op's start (two_level.all_reduce).
        self.chain_stats = {"ops": 0}
        #: Synchronous calls that find nothing queued run in the caller's thread (the lone
        #: way): barriers on a group of one host's shared segment, and all_reduces up to
        #: lone_max bytes there or over a flat group's links.
        self.lone_ok = algos.lone_ok(size)
        self.lone_max = algos.lone_max(size)
        self._lone_comm: Comm | None = None
        # Prioritized all_reduces off the worker run at once, each on a thread of its own,
        # with a scratch of their own; created on first use.
        self._prio_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._prio_scratch = threading.local()
        self.shut = False

    # ------------------------------------------------------------------ identity
    def _work(self, name: str, seq: int, result, devices=(), extra: str = "") -> Work:
        return Work(f"{name} #{seq} (rank {self._rank} of group {self.group_name or '?'}{extra})",
                    result, devices)

    def _refuse_if_shut(self, name: str) -> None:
        if self.shut:
            raise RuntimeError(f"linerate: {name} on a process group that was shut down")

    def _comm(self, name: str, seq: int, timeout: float) -> Comm:
        """A Comm for an op of the worker's order (the shared-memory engines are its own)."""
        return Comm(self._ctx, name, seq, timeout, self._options.piece_bytes, self._scratch,
                    True, self._algos.shm)

    @property
    def worker(self):
        """The group's worker thread, or None while it has none (scheduler.py)."""
        return self.sched.worker

    # ------------------------------------------------------------------ plain
    def submit(self, name: str, fn, result: list, stage: Stage, timeout: float,
               nbytes: int | None = None, desc: str = "", opts=None, chain_bytes: int = 0) -> Work:
        """Queue ``fn(comm)`` to run as the group's next collective. ``desc`` is what every
        rank must agree on (dtypes, sizes, reduce op, root: checked against the neighbour's);
        ``nbytes`` its size for the metrics (default: from ``result``).

        A synchronous call (``opts.asyncOp`` False: torch waits on the Work at once) finds
        the worker idle with nothing queued: it runs here, in the caller's thread, in the same
        order and with the same checks, without the two thread hand-offs (to the worker and
        back) that are most of a small op's time where ranks outnumber cores. A call without
        options, or from C++ (asyncOp defaults to True), is queued."""
        self._refuse_if_shut(name)
        here = opts is not None and not getattr(opts, "asyncOp", True)
        with self._seq_lock:  # queue order is sequence order
            self.seq += 1
            seq = self.seq
            work = self._work(name, seq, result, stage.devices)
            if stage.sync is not None:
                on_streams(work, stage.sync)
            self._life.queued(name, seq, desc)
            op = Op(name, seq, fn, stage, timeout, work, result, nbytes, desc, chain_bytes)
            here = here and self.sched.take_turn()
            if not here:
                self.sched.put(op)
        if here:
            self.sched.run_on_turn(self._execute, op)
        return work

    def _execute(self, op: Op) -> None:
        """Run one queued op: on the worker, or in a synchronous caller's thread when the
        worker's turn was free (submit). Either way it alone uses the engines now."""
        life = self._life
        comm = None
        prev, self._chained = self._chained, None  # the op before, chained to this one
        try:
            life.usable(op.name, op.seq)
            comm = self._comm(op.name, op.seq, op.timeout)
            # (a synchronous caller's, on the worker's turn: nothing else of the group runs)
            comm.drive = threading.current_thread() is not self.sched.worker
            comm.set_call(op.desc)
            life.begin((op,), comm)
            comm.before_tail = prev
            if op.chain_bytes >= CHAIN_MIN_BYTES:
                # The host's ranks agree in every such op (the same calls on every rank),
                # wherever it runs; only the worker offers to chain.
                comm.chain_next = self._next_chainable
            op.fn(comm)
            if comm.before_tail is not None:  # not run by this op's algorithm: now
                comm.before_tail = None
                prev(None)
            if comm.deferred_tail is not None:  # chained: the next op ends this one
                self._chained = self._finisher(op, comm, comm.deferred_tail)
                self.chain_stats["ops"] += 1
                return
        except BaseException as e:  # every failure reaches the Work, and the peers
            if prev is not None and (comm is None or comm.before_tail is not None):
                prev(None)  # the op before ends (it fails on the broken group, or completes)
            life.fail((op,), comm, e)
        else:
            life.finish((op,), comm, op.nbytes)

    # ------------------------------------------------------------------ chained
    def _finisher(self, op: Op, comm: Comm, tail):
        """The end of a chained op (its ``tail(loc)``, then what _execute does after an op),
        for the next op to run: ``finish(loc)`` never raises (a failure goes to its Work)."""
        life = self._life

        def finish(loc) -> None:
            try:
                tail(loc)
            except BaseException as e:  # noqa: BLE001 - to this op's Work, and the peers
                life.fail((op,), comm, e)
                return
            life.finish((op,), comm, op.nbytes)

        return finish

    def _next_chainable(self) -> bool:
        """Whether the worker's next op is queued and is an all_reduce that a two-level
        all_reduce can chain to (two_level.all_reduce). Never from a synchronous caller's
        thread: the worker runs what is queued."""
        if threading.current_thread() is not self.sched.worker:
            return False
        head = self.sched.head()
        if type(head) is not Op or head.name != "all_reduce":
            return False
        nb = head.chain_bytes
        return nb >= CHAIN_MIN_BYTES and self._algos.choose(WORKER, "all_reduce", nb) == "two_level"

    # ------------------------------------------------------------------ fused
    def fusable(self, what: str, buf, tensor, op, opname: str, stage: Stage, timeout: float,
                desc: str, sync: bool = False) -> Work:
        """Queue an all_reduce as a fusion entry (collectives/fusion.py). ``sync``: the caller
        waits at once (see submit): with the worker idle and nothing queued, it runs the
        fused run of this one entry itself (the peers agree on what to fuse as from the
        worker: the least count offered)."""
        self._refuse_if_shut(what)
        with self._seq_lock:
            self.seq += 1
            seq = self.seq
            self._chain = fusion.chain_digest(self._chain, seq, desc)
            work = self._work(what, seq, [tensor], stage.devices)
            call_on_wait(work, self.sched.expedite)
            self._life.queued(what, seq, desc)
            entry = fusion.Entry(seq, buf, tensor, op, opname, stage, work, timeout, desc,
                                 self._chain)
            here = sync and self.sched.take_turn()
            if not here:
                self.sched.put(entry)
        if here:
            entry.inline = True
            self.sched.run_on_turn(self._run_fused, [entry])
        return work

    def _run_fused(self, offered: list) -> None:
        """Agree with the peers how many of the offered entries to fuse, then run them."""
        life = self._life
        head = offered[0]
        comm = None
        taken = offered
        try:
            life.usable("all_reduce", head.seq)
            comm = self._comm("all_reduce", head.seq, min(e.timeout for e in offered))
            comm.drive = head.inline  # (a synchronous caller's, on the worker's turn)
            # The head call is part of the digest: a head that differs (dtype, size, op) is
            # a mismatch named like any other; the calls after it are checked by agree().
            comm.set_call(f"{head.desc} (fused with what follows)")
            life.begin((head,), comm)
            k, head_done, how = self._algos.agree(comm, offered, len(offered))
            taken = offered[:k]
            if k > 1:
                for e in taken[1:]:
                    e.t0 = head.t0
                    for h in life.hooks:
                        h.started(e)
            nbytes = fusion.run(comm, taken[1:] if head_done else taken, self._algos.all_reduce,
                                self._options.allreduce_algo)
            if head_done:
                nbytes += taken[0].nbytes
                comm.algorithm = ("two_level" if how == "two_level" else "direct") if k == 1 \
                    else comm.algorithm
        except BaseException as e:  # every failure reaches the Works, and the peers
            # agree() raises ValueError naming the differing calls. A peer's report may end
            # the agreement before this rank compared, or before its run began (the group
            # already broken): its error then shows every call of its run, the one that
            # differs among them.
            seq, desc = ((f"{head.seq}..#{taken[-1].seq}", f"fused: {fusion.summary(taken)}")
                         if len(taken) > 1 else (head.seq, head.desc))
            if not head.inline:
                self.sched.pop(len(taken))
            life.fail(taken, comm, e, named=(ValueError,), seq_text=seq, desc=desc)
            return
        if not head.inline:
            self.sched.pop(len(taken))
        self.fusion_stats["calls"] += len(taken)
        self.fusion_stats["ops"] += 1
        life.finish(taken, comm, nbytes, comm.algorithm if len(taken) == 1 else
                    f"{comm.algorithm} (fused x{len(taken)})")

    # ------------------------------------------------------------------ lone
    def lone_all_reduce(self, t, op, desc: tuple, timeout: float) -> Work | None:
        """A synchronous all_reduce of one small contiguous CPU tensor ``t`` that finds nothing
        queued, on one host's segment or a flat group's links: the fused run of this one call
        (what ``fusable`` would run in this thread), straight to
        ``Dispatch.lone_all_reduce``: no queue entry, no Stage, no Comm of its own; the same
        agreement, checks, timeout, lifecycle and result. ``desc``: the call's text, as the
        head of a fused run, and its bytes. None where the worker is busy (the general way
        then runs the call)."""
        text = desc[0]
        return self._run_lone("all_reduce", text, desc[1], timeout, [t], desc[2],
                              self._algos.lone_all_reduce, (t, op, text), fused=True)

    def lone_barrier(self, timeout: float) -> Work | None:
        """A synchronous barrier that finds nothing queued, straight on the segment or over
        a flat group's links (see lone_all_reduce); None where the worker is busy."""
        algos = self._algos
        fn = algos.lone_barrier
        if fn is None:  # over the links: the table's barrier
            return self._run_lone("barrier", "", "", timeout, [], None, algos.run, ("barrier", 0))
        return self._run_lone("barrier", "", "", timeout, [], None, fn, ())

    def _run_lone(self, name: str, desc: str, call: str, timeout: float, result: list,
                  nbytes, fn, args: tuple, fused: bool = False) -> Work | None:
        """Number a synchronous call and run ``fn(comm, *args)`` for it in this thread, on
        the group's reused Comm, where the worker is idle with nothing queued (else None:
        the general way queues it). As _execute runs an op, for a one-host group's lone
        small calls: no two-level chaining there. ``fused``: a fusable all_reduce (it moves
        the running digest of fusable calls, ``chain``, passed as ``fn(comm, chain, *args)``).
        Its Work is made once it completed (a failure makes a Work as every op's)."""
        if self.shut:
            self._refuse_if_shut(name)
        with self._seq_lock:  # as submit and fusable: numbered and turn taken at once
            if not self.sched.take_turn():
                return None
            self.seq += 1
            seq = self.seq
            chain = self._chain = (fusion.chain_digest(self._chain, seq, desc) if fused
                                   else self._chain)
        life = self._life
        comm = None
        op = Op(name, seq, None, None, timeout, None, result, nbytes, desc)
        try:
            try:
                life.usable(name, seq)
                comm = self._lone_comm
                if comm is None:
                    comm = self._lone_comm = self._comm(name, seq, timeout)
                    comm.drive = True  # nothing else of the group runs beside it
                    comm.set_call(call)
                else:
                    comm.renew(name, seq, timeout, call)
                life.begin_now(op, comm)
                if fused:
                    fn(comm, chain, *args)
                else:
                    fn(comm, *args)
            except BaseException as e:  # as _execute's and _run_fused's: to the Work, the peers
                op.work = self._work(name, seq, result)
                life.fail((op,), comm, e, named=(ValueError,) if fused else ())
                return op.work
            if fused:
                self.fusion_stats["calls"] += 1
                self.fusion_stats["ops"] += 1
            life.finish((op,), comm, nbytes)  # (no Work yet: nothing to complete)
            return completed(name, seq, self._rank, self.group_name, result)
        finally:
            self.sched.give_turn()

    # ------------------------------------------------------------------ prioritized
    def priority(self, buf, tensor, op, priority: int, stage: Stage, timeout: float, desc: str,
                 name: str, timeline) -> Work:
        """A prioritized all_reduce of ``buf`` (staged from ``tensor``), starting now: on the
        worker where the table gives the worker shared memory (one host, or two-level over
        hosts of several ranks: flat algorithms beside each other on threads of their own
        make a DDP-sized step much slower there), else on a thread of its own beside the
        group's other operations. Its sends go before those of lower priority."""
        what = "all_reduce"
        self._refuse_if_shut(what)
        queued = time.perf_counter()
        algo = self._options.allreduce_algo
        on_worker = algo in ("auto", "two_level") and (self._algos.shape.two_level_auto
                                                       or self._algos.shape.one_host_shm)
        with self._seq_lock:
            self.seq += 1
            seq = self.seq
            work = self._work(what, seq, [tensor], stage.devices, f", priority {priority}")
            self._life.queued(what, seq, desc)
            if on_worker:
                def run(comm: Comm) -> None:
                    comm.priority = priority
                    t0 = time.perf_counter()
                    self._algos.all_reduce(comm, buf.view(-1), op, algo)
                    if timeline is not None:
                        timeline.span(f"all_reduce {name or seq}", "comm", t0,
                                      time.perf_counter(), priority=priority,
                                      bytes=buf.numel() * buf.element_size(),
                                      queued_ms=round((t0 - queued) * 1000, 3))
                self.sched.put(Op(what, seq, run, stage, timeout, work, [tensor], None, desc))
            else:
                if self._prio_pool is None:
                    self._prio_pool = concurrent.futures.ThreadPoolExecutor(
                        self.PRIORITY_THREADS, thread_name_prefix=f"linerate-prio-{self._rank}")
                self._prio_pool.submit(self._run_priority, seq, buf, op, priority, stage, work,
                                       timeout, desc, name, queued, timeline)
        if timeline is not None:
            timeline.instant(f"queued {name or seq}", "comm", queued, priority=priority)
        return work

    def _run_priority(self, seq, buf, op, priority, stage, work, timeout, desc, name, queued,
                      timeline):
        scratch = getattr(self._prio_scratch, "s", None)
        if scratch is None:
            scratch = self._prio_scratch.s = Scratch()
        life = self._life
        nbytes = buf.numel() * buf.element_size()
        me = Op("all_reduce", seq, None, stage, timeout, work, [buf], nbytes, desc)
        comm = None
        try:
            life.usable("all_reduce", seq)
            comm = Comm(self._ctx, "all_reduce", seq, timeout, self._options.piece_bytes, scratch)
            comm.priority = priority
            comm.set_call(desc)
            life.begin((me,), comm)
            self._algos.all_reduce(comm, buf.view(-1), op, self._options.allreduce_algo)
        except BaseException as e:  # noqa: BLE001 - reaches the Work and the peers
            life.fail((me,), comm, e)
            return
        t0, t1 = me.t0, time.perf_counter()
        life.finish((me,), comm, me.nbytes)
        if timeline is not None:
            timeline.span(f"all_reduce {name or seq}", "comm", t0, t1, priority=priority,
                          bytes=nbytes, queued_ms=round((t0 - queued) * 1000, 3))

    # ------------------------------------------------------------------ lifetime
    def stop(self, timeout: float) -> None:
        """Run what is queued, end the worker and the prioritized ops' threads."""
        self.shut = True
        self.sched.stop(timeout)
        if self._prio_pool is not None:  # prioritized ops end (each has its deadline)
            self._prio_pool.shutdown(
                wait=not threading.current_thread().name.startswith("linerate-prio"))

    def abort(self) -> None:
        """The worker ends after what it runs now (the group's connections are closed)."""
        self.shut = True
        self.sched.put(None)
