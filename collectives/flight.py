"""Flight recorder: the last N collectives of every group, written out when one times out.

Every group keeps a bounded record (``LINERATE_FR_ENTRIES``, 0: off) of its collectives: op,
sequence number, the call's arguments (the text every rank must agree on: dtypes, sizes, reduce
op, root), state (``queued`` -> ``started`` -> ``completed`` / ``failed``; ``failed`` with no
start time: the op was refused before it ran, e.g. because the group had already failed), the
algorithm that ran, the error and the peers still awaited when it failed, and wall-clock times
(``time.time()``) of queueing, start and end. Recording is a deque append of one small object
per op and a few attribute writes.

When an op of a group fails with a timeout (this rank's own ``OpTimeout``, or a peer's report
of one), this rank writes the records of all its groups as JSON to ``LINERATE_FR_DUMP``
(``{rank}`` replaced by the global rank, else ``.rank<R>.json`` appended; default
``<tempdir>/linerate-flight``), once per failed group, and logs one line naming the file.
``linerate flight`` reads the dumps of all ranks and says which ranks never joined which op.

The records are also served by torch's control plane (``torch._C._distributed_c10d``'s
worker server, as started by ``torch.distributed.debug.start_debug_server``) under the handler
name ``linerate_flight``: torch 2.13 offers no way for a Python backend to add entries to its
own Flight Recorder (docs/faults.md).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
import weakref

log = logging.getLogger("linerate")

#: Version of the dump format (``linerate flight`` refuses versions it does not know).
VERSION = 1
KIND = "linerate-flight"
#: The torch control-plane handler that serves this process's records.
HANDLER = "linerate_flight"

#: What every timeout message (comm.Comm.wait, shm_algos) says; a peer's report repeats it.
_TIMEOUT_MARK = "did not complete within the"

_recorders: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_dump_lock = threading.Lock()
_handler_registered = False


class Record:
    """One collective of a group."""

    __slots__ = ("seq", "op", "desc", "state", "algorithm", "queued", "started", "ended",
                 "error", "awaited", "waited")

    def __init__(self, seq: int, op: str, desc: str, queued: float):
        self.seq = seq
        self.op = op
        self.desc = desc
        self.state = "queued"
        self.algorithm = ""
        self.queued = queued
        self.started = None
        self.ended = None
        self.error = None
        self.awaited = None
        #: [[group rank, seconds], ...]: how long this rank waited, from entering the op, for
        #: each peer's first contribution (recorded while the group watches for slow ranks).
        self.waited = None

    def as_dict(self) -> dict:
        return {"seq": self.seq, "op": self.op, "desc": self.desc, "state": self.state,
                "algorithm": self.algorithm, "queued": self.queued, "started": self.started,
                "ended": self.ended, "error": self.error, "awaited": self.awaited,
                "waited": self.waited}


def is_timeout(e: BaseException | str | None) -> bool:
    """Whether a failure is a timeout: this rank's OpTimeout, or a peer's report of one (the
    text travels in the ERROR frame), or an op refused because the group failed so."""
    return e is not None and _TIMEOUT_MARK in str(e)


_WAITING = re.compile(r"waiting for ranks? \[?([0-9, ]+)\]?")
_NOT_ENTERED = re.compile(r"((?:rank \d+(?: \(last entered #\d+\))?(?:, )?)+) ha(?:s|ve) not "
                          r"entered")
_SILENT = re.compile(r"ranks? ([0-9, ]+) did not answer")


def awaited_ranks(text: str) -> list[int]:
    """The group ranks a timeout message says this rank still waited for, or that had not
    entered the op (comm.Comm.wait, shm_algos): what the transport knew when it gave up."""
    found: set[int] = set()
    for m in _NOT_ENTERED.finditer(text):
        found.update(int(r) for r in re.findall(r"rank (\d+)", m.group(1)))
    for pat in (_WAITING, _SILENT):
        for m in pat.finditer(text):
            found.update(int(r) for r in re.findall(r"\d+", m.group(1)))
    return sorted(found)


def rank_path(path: str, rank: int) -> str:
    """``{rank}`` replaced, else ``.rank<R>.json`` after the prefix (a ``.json`` ending is
    kept last: ``/tmp/fr.json`` -> ``/tmp/fr.rank0.json``)."""
    if not path:
        path = os.path.join(tempfile.gettempdir(), "linerate-flight")
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if path.endswith(".json"):
        path = path[:-5]
    return f"{path}.rank{rank}.json"


class Recorder:
    """The record of one process group (one per ProcessGroupLinerate)."""

    def __init__(self, entries: int, dump: str, group: str, rank: int, size: int,
                 global_ranks: list[int] | None, timeout: float, backend: str = "linerate"):
        self.ring: collections.deque = collections.deque(maxlen=entries)
        self.entries = entries
        self.dump_path = dump
        self.group = group
        self.desc = ""
        self.rank = rank
        self.size = size
        self.global_ranks = list(global_ranks) if global_ranks and len(global_ranks) == size \
            else list(range(size))
        self.global_rank = self.global_ranks[rank]
        self.timeout = timeout
        self.backend = backend
        self.created = time.time()
        #: Records not yet ended, by sequence number (priority ops run beside the worker).
        self._live: dict[int, Record] = {}
        self.failure: str | None = None
        self.dumped: str | None = None
        _recorders.add(self)
        _register_torch_handler()

    # ---------------------------------------------------------------- the hot path
    def queued(self, op: str, seq: int, desc: str) -> None:
        r = Record(seq, op, desc, time.time())
        self.ring.append(r)
        self._live[seq] = r

    def started(self, seq: int) -> None:
        r = self._live.get(seq)
        if r is not None:
            r.state = "started"
            r.started = time.time()

    def began(self, op) -> None:
        """queued() and started() at once: ``op`` (its name, seq and desc: collectives/op.py
        Op) numbered as it starts."""
        r = Record(op.seq, op.name, op.desc, time.time())
        r.state = "started"
        r.started = r.queued
        self.ring.append(r)
        self._live[op.seq] = r

    def completed(self, seq: int, algorithm: str = "", waited: dict | None = None) -> None:
        r = self._live.pop(seq, None)
        if r is not None:
            r.state = "completed"
            r.ended = time.time()
            r.algorithm = algorithm
            if waited:
                r.waited = [[q, round(w, 6)] for q, w in waited.items()]

    def failed(self, seq: int, error: BaseException, algorithm: str = "") -> None:
        """The op failed (or was refused); a timeout writes the dump (once per group)."""
        r = self._live.pop(seq, None)
        text = str(error)
        if r is not None:
            r.state = "failed"
            r.ended = time.time()
            r.algorithm = algorithm
            r.error = text
            if r.started is not None and is_timeout(text):  # refused ops awaited no one
                r.awaited = awaited_ranks(text)
        if self.failure is None:
            self.failure = text
        if is_timeout(text):
            # Even when the dump is under way (another thread heard of the timeout first):
            # dump_all waits for it, so that the user hears of the failure, and may exit, only
            # once the file is written (CI: a rank that exited meanwhile left no dump).
            dump_all(self, text)

    def peer_failed(self, text: str) -> None:
        """The transport learned of a peer's failure (an ERROR frame) whatever this rank is
        doing; a timeout writes the dump now (a rank busy computing writes what it did last)."""
        if self.failure is None:
            self.failure = text
        if self.dumped is None and is_timeout(text):
            dump_all(self, text)

    # ---------------------------------------------------------------- reading
    def as_dict(self) -> dict:
        return {"name": self.group, "desc": self.desc, "backend": self.backend,
                "rank": self.rank, "size": self.size, "ranks": self.global_ranks,
                "timeout": self.timeout, "entries": self.entries, "created": self.created,
                "failure": self.failure,
                "ops": [r.as_dict() for r in self.ring.copy()]}


class Off:
    """The recorder of a group with LINERATE_FR_ENTRIES=0: records nothing, at no cost (the
    backend calls it unconditionally)."""

    group = desc = ""

    def queued(self, op: str, seq: int, desc: str) -> None:
        pass

    def started(self, seq: int) -> None:
        pass

    def began(self, op: str, seq: int, desc: str) -> None:
        pass

    def completed(self, seq: int, algorithm: str = "", waited: dict | None = None) -> None:
        pass

    def failed(self, seq: int, err: BaseException, algorithm: str = "") -> None:
        pass


def watch(ctx, recorder: Recorder) -> None:
    """Have ``recorder`` dump when ``ctx`` (the group's transport) learns that a peer timed
    out, from the thread that receives the report: a rank that is computing, not waiting on the
    group, still writes its record at once (the context's ``on_failure`` callbacks)."""
    ref = weakref.ref(recorder)

    def on_failure(err):
        rec = ref()
        if rec is not None and rec.dumped is None and is_timeout(err):
            try:
                rec.peer_failed(str(err))
            except Exception:  # noqa: BLE001 - never into the transport's threads
                log.exception("flight recorder: writing the dump failed")

    ctx.on_failure.append(on_failure)


def snapshot(reason: str = "", rank: int | None = None) -> dict:
    """This process's records, every group's, as the dump writes them."""
    groups = sorted((r for r in list(_recorders)), key=lambda r: r.created)
    if rank is None:
        rank = groups[0].global_rank if groups else -1
    try:
        import torch
        torch_version = torch.__version__
    except Exception:  # noqa: BLE001 - informational only
        torch_version = ""
    try:
        from linerate import __version__ as version
    except Exception:  # noqa: BLE001
        version = ""
    return {"version": VERSION, "kind": KIND, "rank": rank, "host": socket.gethostname(),
            "pid": os.getpid(), "time": time.time(), "reason": reason, "linerate": version,
            "torch": torch_version, "groups": [g.as_dict() for g in groups]}


def dump(path: str | None = None, reason: str = "requested") -> str | None:
    """Write this process's records (every group's) now, as a timeout would: to ``path``
    (default: the first group's LINERATE_FR_DUMP, ``{rank}`` replaced or ``.rank<R>.json``
    appended), for ``linerate flight`` to read beside the other ranks' dumps (which rank
    entered the collectives last, for a job that is slow rather than stuck). Returns the
    file, or None where no group records."""
    groups = sorted((r for r in list(_recorders)), key=lambda r: r.created)
    if not groups:
        return None
    rank = groups[0].global_rank
    target = rank_path(path or groups[0].dump_path, rank)
    data = snapshot(reason, rank)
    d = os.path.dirname(target)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=None, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, target)
    return target


def dump_all(trigger: Recorder, reason: str) -> str | None:
    """Write every group's records to ``trigger``'s dump path; one log line names the file.
    Returns the path (None where it could not be written: that is logged instead)."""
    with _dump_lock:
        if trigger.dumped is not None:
            return trigger.dumped
        path = rank_path(trigger.dump_path, trigger.global_rank)
        trigger.dumped = path
        data = snapshot(reason, trigger.global_rank)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            d = os.path.dirname(path)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(data, f, indent=None, separators=(",", ":"))
                f.write("\n")
            os.replace(tmp, path)
        except OSError as e:
            log.error("rank %d: a collective of group %s timed out; the flight recorder could "
                      "not write %s (LINERATE_FR_DUMP): %s", trigger.global_rank,
                      trigger.group or "?", path, e)
            return None
        nops = sum(len(g["ops"]) for g in data["groups"])
        log.error("rank %d: a collective of group %s timed out; flight recorder: %d operations "
                  "of %d group(s) written to %s (read every rank's dump with: linerate flight "
                  "%s)", trigger.global_rank, trigger.group or "?", nops, len(data["groups"]),
                  path, os.path.dirname(os.path.abspath(path)))
        return path


def _serve(req, resp) -> None:  # torch control-plane handler
    try:
        resp.set_content(json.dumps(snapshot("requested")), "application/json")
        resp.set_status(200)
    except Exception as e:  # noqa: BLE001 - answered, never raised into torch
        resp.set_content(f"linerate flight recorder: {e}", "text/plain")
        resp.set_status(500)


def _register_torch_handler() -> None:
    """Serve the records from torch's worker server (handler ``linerate_flight``), once per
    process, where this torch has the control plane (`_register_handler`)."""
    global _handler_registered
    if _handler_registered:
        return
    _handler_registered = True
    try:
        import ctypes

        import torch._C._distributed_c10d as c10d
        if HANDLER not in c10d._get_handler_names():
            # torch keeps the callable in a static registry and releases it after the
            # interpreter is gone: a function freed then aborts the process at exit ("GIL
            # is released", torch 2.13). One extra reference, never dropped, keeps it alive.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_serve))
            c10d._register_handler(HANDLER, _serve)
    except Exception as e:  # noqa: BLE001 - an older torch: the dump file still works
        log.debug("flight recorder: torch's control plane is not available: %s", e)
