"""One call's life in a process group: begin -> run -> finish, or fail.

Every path an operation takes (a synchronous caller running it in its own thread, the group's
worker, a fused run of several calls, a chained two-level all_reduce whose end runs with the
next op, a prioritized all_reduce on a thread of its own) goes through ``Lifecycle``: the
flight recorder, the metrics, telling the peers why an op failed, naming this rank's call in
an error, and completing the Work each happen here and nowhere else.

Observers of the lifecycle (the flight recorder, the metrics, the slow-rank watch) are hooks:
objects with ``started(op)``, ``completed(op, algorithm, seconds, nbytes)`` and ``failed(op,
error, algorithm)``, called in the order they were added, and optionally ``queued(name, seq,
desc)``, called when a call is numbered (before it runs, or waits in the queue).
"""
from __future__ import annotations

import logging
import time

from linerate.transport import TransportError, metrics

from . import stats
from .comm import Comm, OpTimeout
from .work import complete, complete_many

log = logging.getLogger("linerate")


class Op:
    """One collective call: what runs (``fn(comm)``), on what (``stage``, ``result``), under
    which sequence number, deadline and description every rank must agree on (``desc``).
    ``stage`` None: nothing to copy back; ``work`` None: the Work is made once the op
    completed (a synchronous call run in the caller's thread: runner ``_run_lone``)."""

    __slots__ = ("name", "seq", "fn", "stage", "timeout", "work", "result", "nbytes", "desc",
                 "chain_bytes", "t0", "arrivals")

    def __init__(self, name: str, seq: int, fn, stage, timeout: float, work, result: list,
                 nbytes: int | None, desc: str, chain_bytes: int = 0):
        self.name = name
        self.seq = seq
        self.fn = fn
        self.stage = stage
        self.timeout = timeout
        self.work = work
        self.result = result
        #: The op's size for the metrics (None: from ``result``, stats.message_bytes).
        self.nbytes = nbytes
        self.desc = desc
        #: A single-tensor all_reduce's bytes, for chaining two-level all_reduces (0: never).
        self.chain_bytes = chain_bytes
        self.t0 = 0.0
        #: When each peer's first contribution arrived (group rank -> time.perf_counter()),
        #: where the group watches for slow ranks (collectives/straggler.py): set by finish.
        self.arrivals = None


def waits(op, floor: float = 0.0) -> dict:
    """How long this rank waited, from entering ``op``, for each peer's first contribution
    (group rank -> seconds, only those of at least ``floor`` > 0 s), from ``op.arrivals``."""
    t0 = op.t0
    return {q: t - t0 for q, t in (op.arrivals or {}).items() if t - t0 > floor}


class FlightHook:
    """The flight recorder (collectives/flight.py) as a lifecycle hook."""

    __slots__ = ("fr", "began")

    def __init__(self, fr):
        self.fr = fr
        #: queued() and started() of an op numbered as it starts: the recorder's own.
        self.began = fr.began

    def queued(self, name: str, seq: int, desc: str) -> None:
        self.fr.queued(name, seq, desc)

    def started(self, op) -> None:
        self.fr.started(op.seq)

    def completed(self, op, algorithm: str, seconds: float, nbytes) -> None:
        self.fr.completed(op.seq, algorithm, waits(op) if op.arrivals else None)

    def failed(self, op, error: BaseException, algorithm: str) -> None:
        self.fr.failed(op.seq, error, algorithm)


class MetricsHook:
    """Each completed op's time and size to the Prometheus exporter (transport/metrics.py),
    while the exporter is on."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def started(self, op) -> None:
        pass

    def completed(self, op, algorithm: str, seconds: float, nbytes) -> None:
        if metrics.enabled():
            if nbytes is None:
                nbytes = stats.message_bytes(op.name, op.result, self.size)
            stats.record(op.name, algorithm, nbytes, seconds, self.size)

    def failed(self, op, error: BaseException, algorithm: str) -> None:
        pass


class Lifecycle:
    """Begin, finish and fail for the ops of one group (see the module's docstring)."""

    def __init__(self, ctx, rank: int):
        self.ctx = ctx
        self.rank = rank
        self.hooks: list = []
        self._queued: list = []  # the hooks with a queued() method
        #: What begin_now calls per hook: its began(op), else its queued() (where it has
        #: one) and started(op).
        self._began: list = []
        #: The hooks finish tells before completing the Works, and those it tells after
        #: (the metrics: off the caller's path where the worker ran the op).
        self._done: list = []
        self._metrics: list = []
        #: Whether ops record when each peer's first contribution arrived (Comm.arrivals):
        #: while the group watches for slow ranks (collectives/straggler.py).
        self.arrivals = False

    def add(self, hook) -> None:
        self.hooks.append(hook)
        if hasattr(hook, "queued"):
            self._queued.append(hook)
        if hasattr(hook, "began"):
            self._began.append(hook.began)
        elif hasattr(hook, "queued"):
            self._began.append(lambda op, h=hook: (h.queued(op.name, op.seq, op.desc),
                                                   h.started(op)))
        else:
            self._began.append(hook.started)
        (self._metrics if type(hook) is MetricsHook else self._done).append(hook)

    def queued(self, name: str, seq: int, desc: str) -> None:
        """A call got its sequence number (it runs now, or waits in the group's queue)."""
        for h in self._queued:
            h.queued(name, seq, desc)

    # ------------------------------------------------------------------ begin
    def usable(self, name: str, seq) -> None:
        """Raise if the group already failed: an op must not start on a broken group."""
        broken = self.ctx.broken
        if broken is not None:
            raise TransportError(f"rank {self.rank}: {name} #{seq} cannot run: the group failed "
                                 f"earlier: {broken}")

    def begin(self, ops, comm: Comm) -> None:
        now = time.perf_counter()
        if self.arrivals:
            comm.arrivals = {}
        for op in ops:
            op.t0 = now
            for h in self.hooks:
                h.started(op)

    def begin_now(self, op, comm: Comm) -> None:
        """``queued`` and ``begin`` of one op at once: a synchronous call numbered and run in
        the caller's thread (collectives/runner.py ``_run_lone``)."""
        op.t0 = time.perf_counter()
        if self.arrivals:
            comm.arrivals = {}
        for began in self._began:
            began(op)

    # ------------------------------------------------------------------ finish
    def finish(self, ops, comm: Comm, nbytes=None, algorithm: str | None = None) -> None:
        """The ops ran: copy results back, release the op's resources, record, complete the
        Works. ``nbytes``: the size the metrics count (one fused op: all of them together);
        ``algorithm``: the label recorded per op (default: what ran)."""
        try:
            for op in ops:
                if op.stage is not None:  # (None: nothing staged, a lone call's)
                    op.stage.finish()
        except BaseException as e:  # noqa: BLE001 - copying the result back failed
            self.fail(ops, comm, e)
            return
        seconds = time.perf_counter() - ops[0].t0
        comm.end()
        ops[0].arrivals = comm.arrivals
        algo = comm.algorithm if algorithm is None else algorithm
        if len(ops) == 1:
            op = ops[0]
            for h in self._done:
                h.completed(op, algo, seconds, nbytes)
            if op.work is not None:  # (None: a lone call's, made once it completed)
                complete(op.work)
        else:
            for op in ops:
                for h in self._done:
                    h.completed(op, algo, seconds, nbytes)
            complete_many([op.work for op in ops])
        # The metrics last: after the Works completed (on the worker: off the caller's path).
        for h in self._metrics:
            h.completed(ops[0], comm.algorithm, seconds, nbytes)

    # ------------------------------------------------------------------ fail
    def fail(self, ops, comm: Comm | None, e: BaseException, named: tuple = (),
             seq_text=None, desc: str | None = None) -> None:
        """The ops failed with ``e``: record it (a timeout: dumped) before anyone hears, tell
        the peers why (unless it is their news), name this rank's call in the error, release
        the op's resources, fail the Works. ``named``: exception types whose text already
        names rank, op and calls; ``seq_text`` and ``desc``: how the error names the call(s)
        (default: the first op's)."""
        head = ops[0]
        algo = comm.algorithm if comm is not None else ""
        for op in ops:
            for h in self.hooks:
                h.failed(op, e, algo)
        self.report(e, head.name, head.seq, named)
        if comm is not None:
            e = self.annotate(e, head.name, head.seq if seq_text is None else seq_text,
                              head.desc if desc is None else desc)
            comm.end()
        elif seq_text is not None:
            e = self.annotate(e, head.name, seq_text, desc or "")
        if len(ops) == 1:
            complete(head.work, e)
        else:
            complete_many([op.work for op in ops], e)

    def report(self, e: BaseException, name: str, seq, named: tuple = ()) -> None:
        """Tell the peers why this rank's op failed (a peer's own failure they know of)."""
        if isinstance(e, (OpTimeout,) + named):
            self.ctx.report_error(str(e))
        elif not isinstance(e, TransportError):
            log.exception("rank %d: %s #%s failed", self.rank, name, seq)
            self.ctx.report_error(f"rank {self.rank}: {name} #{seq} failed: {e}")

    def annotate(self, e: BaseException, name: str, seq, desc: str) -> BaseException:
        """A transport failure (often a peer's report) with what this rank called beside it,
        so that every rank's error shows its own arguments (the peer names its own)."""
        if not desc or not isinstance(e, TransportError) or desc in str(e):
            return e
        wrapped = TransportError(f"{e} [rank {self.rank} was in {name} #{seq} ({desc})]")
        wrapped.__cause__ = e
        return wrapped
