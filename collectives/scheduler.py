"""The order a group's collectives run in: one at a time, in call order.

Calls are queued (an ``Op``, a fusion ``Entry``, or None to stop) and run by the group's worker
thread, which starts with the first call that needs it and ends after ``WORKER_IDLE_S``
without one. A synchronous caller that finds the worker idle with nothing queued takes the
worker's turn (``take_turn``) and runs its op in its own thread (``run_on_turn``): the same
order, without two thread hand-offs. Fusion entries at the head of the queue wait up to
``cycle_ms`` for more to fuse with, unless a caller already waits on one (``expedite``) or the
run is full.

The scheduler knows nothing of what an op does: ``run_op(op)`` and ``run_fused(entries)`` are
the group's (collectives/backend.py).
"""
from __future__ import annotations

import collections
import itertools
import threading
import time

from . import fusion

#: A group's worker thread ends after this many seconds without a call to run (the next call
#: that needs it starts another): threads per rank follow the groups in use, not all groups.
WORKER_IDLE_S = 10.0


class Scheduler:
    def __init__(self, rank: int, options, run_op, run_fused):
        self._rank = rank
        self._options = options
        self._run_op = run_op
        self._run_fused = run_fused
        self.queue: collections.deque = collections.deque()
        #: The queue's lock, and the condition the worker waits on; the synchronous caller's
        #: turn (take_turn, give_turn) takes the lock itself (a C-level enter, where the
        #: Condition's is Python's).
        self._lock = threading.Lock()
        self.cond = threading.Condition(self._lock)
        #: While the worker waits on an open fusion run: (bytes, entries) it may still take
        #: before the run is full, and its reduce op (put wakes the worker only when needed).
        self._fuse_wait: tuple | None = None
        self._urgent = False   # someone waits on a queued fusion entry: fuse now
        self._running = False  # the worker runs an op (or a fused run)
        self._inline = False   # a synchronous caller runs an op in its own thread
        #: The worker thread, started by the first call that needs it (put).
        self.worker: threading.Thread | None = None

    # ------------------------------------------------------------------ callers
    def take_turn(self) -> bool:
        """Whether the worker is idle with nothing queued; if so the caller holds its turn
        (the worker waits) until run_on_turn gives it back."""
        with self._lock:
            if self.queue or self._running or self._inline:
                return False
            self._inline = True
            return True

    def run_on_turn(self, fn, arg) -> None:
        """``fn(arg)`` in the caller's thread, which holds the worker's turn (take_turn);
        the turn is given back however it ends."""
        try:
            fn(arg)
        finally:
            self.give_turn()

    def give_turn(self) -> None:
        """The caller that holds the worker's turn (take_turn) gives it back."""
        with self._lock:  # calls queued meanwhile (other threads) go to the worker
            self._inline = False
            if self.queue:
                self.cond.notify()

    def put(self, item) -> None:
        with self.cond:
            self.queue.append(item)
            if self.worker is None and item is not None:
                # Started under the lock: stop's join never sees it unstarted.
                self.worker = threading.Thread(target=self._work, daemon=True,
                                               name=f"linerate-coll-{self._rank}")
                self.worker.start()
            w = self._fuse_wait
            if w is not None and type(item) is fusion.Entry and item.opname == w[2]:
                # The worker waits for its open fusion run to fill or its cycle to end: this
                # entry only lengthens the run, so it need not wake (each wake-up takes the
                # GIL from the issuing thread). It wakes when the run closes: full (bytes or
                # entries, as fusion.plan counts them) or another call behind it.
                left, room = w[0] - item.nbytes, w[1] - 1
                if left > 0 and room > 0:
                    self._fuse_wait = (left, room, w[2])
                    return
            self.cond.notify()

    def expedite(self) -> None:
        """A caller waits on a queued fusion entry: stop waiting for more to fuse with."""
        with self.cond:
            if not self._urgent:
                self._urgent = True
                self.cond.notify()

    def head(self):
        """The next queued item, or None."""
        with self.cond:
            return self.queue[0] if self.queue else None

    def pop(self, n: int) -> None:
        """A fused run took its first ``n`` entries."""
        with self.cond:
            for _ in range(n):
                self.queue.popleft()

    def stop(self, timeout: float) -> None:
        """Run what is queued, then end the worker (waited for, unless this is it)."""
        self.put(None)
        worker = self.worker
        if worker is not None and threading.current_thread() is not worker:
            worker.join(timeout=timeout)

    # ------------------------------------------------------------------ the worker
    def _next(self):
        """The worker's next Op, a list of fusion entries (the count offered), or None."""
        cycle = self._options.cycle_ms / 1000.0
        with self.cond:
            while True:
                while not self.queue or self._inline:
                    if not self.cond.wait(WORKER_IDLE_S) and not self.queue:
                        # Idle this long: the thread ends (the next call that needs one
                        # starts another, put), so threads follow the groups in use.
                        self.worker = None
                        return None
                head = self.queue[0]
                if not isinstance(head, fusion.Entry):
                    self._running = head is not None
                    return self.queue.popleft()
                cap = self._options.fusion_bytes
                n, closed = fusion.plan(self.queue, cap)
                left = head.queued + cycle - time.monotonic()
                if closed or self._urgent or left <= 0:
                    self._urgent = False
                    self._running = True
                    return list(itertools.islice(self.queue, n))
                # Open: the run is the whole queue. put wakes this wait when it closes.
                self._fuse_wait = (cap - sum(e.nbytes for e in self.queue),
                                   fusion.MAX_ENTRIES - n, head.opname)
                self.cond.wait(left)
                self._fuse_wait = None

    def _work(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            try:
                if isinstance(item, list):
                    self._run_fused(item)
                else:
                    self._run_op(item)
            finally:
                with self.cond:
                    self._running = False
