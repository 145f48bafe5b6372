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


def as_dist_error(e: BaseException) -> BaseException:
    """Errors of the communication itself surface as DistBackendError, as Gloo's do."""
    if isinstance(e, (ValueError, TypeError, DistBackendError)):
        return e
    err = DistBackendError(str(e))
    err.__cause__ = e
    return err


class Work(dist._Work):
    """Completion of one operation: wait(timeout), is_completed(), get_future(), exception()."""

    def __init__(self, desc: str, result: list, devices: list | None = None):
        super().__init__()
        self._desc = desc
        self._result = result
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._src = -1
        self._fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()

    # -- completion (communication side) ----------------------------------------------------
    def _complete(self, exc: BaseException | None = None, source_rank: int = -1) -> None:
        self._exc = None if exc is None else as_dist_error(exc)
        self._src = source_rank
        self._event.set()
        _completer.submit(self._complete_future)

    def _complete_future(self) -> None:
        if self._exc is None:
            self._fut.set_result(self._result)
        else:
            self._fut.set_exception(self._exc)

    # -- user side --------------------------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if seconds > 0:
            if not self._event.wait(seconds):
                raise DistBackendError(f"linerate: {self._desc} did not complete within "
                                       f"Work.wait(timeout={seconds:.3f}s)")
        else:
            # The operation has its own deadline (the group's timeout), so this ends.
            self._event.wait()
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._exc is None

    def exception(self):
        return self._exc

    def get_future(self) -> torch.futures.Future:
        return self._fut

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
