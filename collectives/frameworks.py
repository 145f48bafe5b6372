"""What linerate can see of a framework that trains each rank alone beside a linerate group.

Hugging Face Accelerate, on a machine without a GPU and not in its CPU mode
(``ACCELERATE_USE_CPU=true``, ``Accelerator(cpu=True)``), sets itself up undistributed
(``num_processes`` 1) whatever process group exists: every rank trains alone, and nothing
fails. linerate sees it where the process has both a linerate group of several ranks and
Accelerate's state saying one process: when the group is created (Accelerate set up first), and
when it is shut down or the process exits (Accelerate set up after). It then logs one warning
per process. Accelerate is never imported here: only its state, where the process has it.
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading

log = logging.getLogger("linerate")

_lock = threading.Lock()
_state = {"seen": None, "warned": False, "atexit": False}


def accelerate_alone(rank: int, size: int) -> str | None:
    """The warning where Accelerate runs undistributed in this process while it is rank
    ``rank`` of a linerate group of ``size`` ranks; None otherwise (or without Accelerate)."""
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "PartialState", None), "_shared_state", None)
    if size < 2 or not isinstance(shared, dict) or not shared:  # not set up yet
        return None
    if shared.get("num_processes") != 1 or "distributed_type" not in shared:
        return None
    kind = str(shared.get("distributed_type")).rsplit(".", 1)[-1]
    return (f"linerate: rank {rank} of a linerate group of {size} ranks, but Accelerate set itself "
            f"up undistributed (num_processes 1, distributed_type {kind}): each rank trains "
            f"alone. Without a GPU, Accelerate distributes only in its CPU mode: set "
            f"ACCELERATE_USE_CPU=true (or Accelerator(cpu=True)) and create the linerate group "
            f"before the Accelerator (see the linerate docs, frameworks.md)")


def check(rank: int, size: int) -> bool:
    """Warn (once per process) where Accelerate runs undistributed beside this group; True
    if it does."""
    text = accelerate_alone(rank, size)
    if text is None:
        return False
    with _lock:
        if _state["warned"]:
            return True
        _state["warned"] = True
    log.warning("%s", text)
    return True


def watch(rank: int, size: int) -> None:
    """A linerate group of ``size`` ranks was created with this rank: check now, and again at
    exit (the group's shutdown calls ``check`` itself)."""
    if size < 2:
        return
    with _lock:
        _state["seen"] = (rank, size)
        first = not _state["atexit"]
        _state["atexit"] = True
    if first:
        atexit.register(_at_exit)
    check(rank, size)


def _at_exit() -> None:
    seen = _state["seen"]
    if seen is not None:
        try:
            check(*seen)
        except Exception:  # noqa: BLE001 - never fail an exiting process
            pass


__all__ = ["accelerate_alone", "check", "watch"]
