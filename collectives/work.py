"""The Work object handed back to torch (and to DDP's C++ Reducer) for every operation."""
from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

# Future callbacks run on the thread that completes the future. Completing from this small
# pool, never from the thread that runs collectives, lets a comm hook start a collective from
# a callback and wait on it (PowerSGD does) without deadlock.
_completer = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="linerate-future")

DistBackendError = getattr(dist, "DistBackendError", RuntimeError)


def as_dist_error(e: BaseException, desc: str = "") -> BaseException:
    """Errors of the communication itself surface as DistBackendError (a RuntimeError, as
    Gloo's are), naming the operation (``desc``: "all_reduce #3 (rank 0 of ...)") when the
    message does not already."""
    if isinstance(e, (ValueError, TypeError, DistBackendError)):
        return e
    text = str(e)
    head = desc.split(" (", 1)[0]
    if head and head not in text:
        text = f"linerate: {head} failed: {text}"
    err = DistBackendError(text)
    err.__cause__ = e
    return err


def _unwrap(fut: torch.futures.Future):
    """The value of a Work's future: its output tensors, or its error raised."""
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _complete_futures(works) -> None:
    for w in works:
        w._complete_future()


class Work(dist._Work):
    """Completion of one operation: wait(timeout), is_completed(), get_future(), exception()."""

    # What most Works keep as made, as class attributes: an instance sets only what differs
    # (each attribute set on an instance of this pybind-derived class is a sizeable share of
    # making a Work, and a small synchronous op makes one per call).
    #: Seconds that wait() without a timeout waits (the group's timeout), for operations
    #: without a deadline of their own (point-to-point); None: until the operation ends.
    _timeout = None
    _done = False
    _exc: BaseException | None = None
    _src = -1
    _devices = None
    # A failed operation must fail the future for C++ consumers too. Python's
    # Future.set_exception does not: it completes the C++ future *successfully* with the
    # exception object as its value (only Python's wait() raises it), and DDP's Reducer
    # then reads that value as tensors and crashes (SIGSEGV in parseCppCommHookResult).
    # A then() callback that raises sets a real C++ error on the future it returns, so
    # the future handed out is that child: DDP, .then() chains and wait() all raise.
    # The futures are made on the first get_future() (DDP asks for every bucket; a plain
    # async_op=True caller never does): making them for every Work is a sizeable share of
    # issuing many small async all_reduces, and a Work without one needs no completion job
    # either.
    _base = _fut = None
    _fut_done = False  # the base future's result has been (or is being) set
    #: Called when someone starts waiting for the result (a queued fusion entry then
    #: stops waiting for more calls to fuse with).
    _on_wait = None
    #: A pipelined op's device side (collectives/pipeline.py ``Staged``): once the op is done,
    #: wait() makes the caller's current stream wait for its copies back to the device (the
    #: host does not wait for them), and a future's result is set on a stream that waited.
    _streams = None

    def __init__(self, desc: str, result: list, devices: list | None = None,
                 timeout: float | None = None):
        super().__init__()
        self._desc = desc
        self._result = result
        # Completion: _done, and a lock held until then that waiters acquire and pass on
        # (a threading.Event costs an order of magnitude more to make, most of a Work's making).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._lock = threading.Lock()
        if timeout is not None:
            self._timeout = timeout
        if devices:
            self._devices = devices

    # -- completion (communication side) ----------------------------------------------------
    def _complete(self, exc: BaseException | None = None, source_rank: int = -1) -> None:
        self._exc = None if exc is None else as_dist_error(exc, self._desc)
        self._src = source_rank
        self._set_done()
        # (a future handed out after _set_done is completed by get_future, which sees _done)
        if self._base is not None and self._claim_future():
            _completer.submit(self._complete_future)

    @staticmethod
    def _complete_many(works: list["Work"], exc: BaseException | None = None) -> None:
        """Complete several Works (a fused op's): one job for all their futures, not one each
        (a pool submission per Work is a sizeable share of a rank's time issuing many small
        fused all_reduces)."""
        for w in works:
            w._exc = None if exc is None else as_dist_error(exc, w._desc)
            w._set_done()
        pending = [w for w in works if w._claim_future()]
        if pending:
            _completer.submit(_complete_futures, pending)

    def _set_done(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._gate.release()

    def _wait_done(self, seconds: float | None) -> bool:
        """Wait until completed (at most ``seconds``; None: no limit); whether it is."""
        if self._done:
            return True
        if not (self._gate.acquire() if seconds is None else self._gate.acquire(timeout=seconds)):
            return self._done
        self._gate.release()  # the next waiter's turn
        return True

    def _claim_future(self) -> bool:
        """After completion: whether this caller must set the future's result (a future has
        been handed out and nobody set it yet). Exactly one caller gets True."""
        with self._lock:
            if self._base is None or self._fut_done:
                return False
            self._fut_done = True
            return True

    def _complete_future(self) -> None:
        if self._streams is not None and self._exc is None:
            with self._streams.result_streams():
                self._base.set_result(self._result)
            return
        self._base.set_result(self._result if self._exc is None else self._exc)

    # -- user side --------------------------------------------------------------------------
    def _waiting(self) -> None:
        if self._on_wait is not None and not self._done:
            self._on_wait()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._waiting()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if seconds > 0:
            if not self._wait_done(seconds):
                raise DistBackendError(f"linerate: {self._desc} did not complete within "
                                       f"Work.wait(timeout={seconds:.3f}s)")
        elif self._timeout is not None:
            # No deadline of its own (point-to-point): the group's timeout bounds the wait, as
            # on Gloo. The operation stays posted (docs/limits.md).
            if not self._wait_done(self._timeout):
                raise DistBackendError(f"linerate: {self._desc} did not complete within the "
                                       f"process group's timeout ({self._timeout:.1f}s); it "
                                       f"is still posted")
        else:
            # A collective has its own deadline (the group's timeout), so this ends.
            self._wait_done(None)
        if self._exc is not None:
            raise self._exc
        if self._streams is not None:
            self._streams.stream_wait()
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._exc is None

    def exception(self):
        return self._exc

    def get_future(self) -> torch.futures.Future:
        self._waiting()
        with self._lock:
            if self._fut is None:
                devices = self._devices
                self._base = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
                self._fut = self._base.then(_unwrap)
            fut = self._fut
        # Completed before anyone asked: set the result here (callbacks added later run on
        # the thread that adds them, as with any completed future).
        if self._done and self._claim_future():
            self._complete_future()
        return fut

    def result(self) -> list:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        self.wait()
        return self._src

    def _source_rank(self) -> int:
        return self.source_rank()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<linerate Work {self._desc} {state}>"


class _Completed(Work):
    """A Work that completed successfully before it was handed out (a synchronous call run in
    the caller's thread, collectives/runner.py ``_run_lone``): no gate to pass, and one lock
    shared by all of them for the rare future asked of one; its name is made only if read."""

    _done = True
    _lock = threading.Lock()

    def __init__(self, name: str, seq: int, rank: int, group: str, result: list):
        dist._Work.__init__(self)
        self._name = (name, seq, rank, group)
        self._result = result

    @property
    def _desc(self) -> str:
        name, seq, rank, group = self._name
        return f"{name} #{seq} (rank {rank} of group {group or '?'})"

    def _complete(self, exc: BaseException | None = None, source_rank: int = -1) -> None:
        if exc is not None:  # (done already: only a failure while finishing changes it)
            self._exc = as_dist_error(exc, self._desc)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._exc is not None:
            raise self._exc
        return True  # done, on the host


def completed(name: str, seq: int, rank: int, group: str, result: list) -> Work:
    """A Work for a call that already completed (its result: ``result``), named as
    Runner names every Work."""
    return _Completed(name, seq, rank, group, result)


# -- the communication side's verbs: what the group, its lifecycle and point-to-point call (a
# Work's user sees torch's Work API only)
def complete(work: Work, exc: BaseException | None = None, source_rank: int = -1) -> None:
    """Complete ``work``: successfully, or failed with ``exc`` (``source_rank``: whom a
    receive got its message from)."""
    work._complete(exc, source_rank)


def complete_many(works: list[Work], exc: BaseException | None = None) -> None:
    """Complete the Works of a fused op, their futures in one job."""
    Work._complete_many(works, exc)


def on_streams(work: Work, staged) -> None:
    """``work``'s result is on a device, ready once ``staged`` (collectives/pipeline.py
    ``Staged``) says: its ``stream_wait()`` runs in wait(), its ``result_streams()`` around
    setting a future's result."""
    work._streams = staged


def call_on_wait(work: Work, fn) -> None:
    """Call ``fn()`` when someone starts waiting for ``work``'s result (before it completed)."""
    work._on_wait = fn
