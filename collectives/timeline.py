"""A Chrome-trace timeline of communication and updates (``LINERATE_TIMELINE=path``).

Like Horovod's timeline: open the file in chrome://tracing or https://ui.perfetto.dev. Each
rank writes its own file: ``path`` with ``{rank}`` replaced by the rank, or, without a
``{rank}`` in it, ``.rank<R>`` inserted before the extension (``/tmp/tl.json`` ->
``/tmp/tl.rank0.json``). ``linerate timeline merge`` joins the ranks' files into one. Each
rank is a process (pid = rank) with one row per kind of activity: ``compute`` (forward of each
layer, and the waits for its parameters), ``comm`` (each partition's all_reduce, from start to
end, with its priority; an instant when it was queued) and ``update`` (each layer's optimizer
step). Times are wall-clock microseconds, so the files of ranks on one host line up.

The file is in the trace format's JSON array form, written as events come (in batches of
1,000, on ``flush()`` and at exit): its closing ``]`` is written at exit, and viewers accept
the file without it, so a run that is killed still leaves a readable timeline.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time

ROWS = {"compute": 1, "comm": 2, "update": 3}
_FLUSH_EVERY = 1000


def rank_path(path: str, rank: int) -> str:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


class Timeline:
    """Events of one rank, written as a Chrome trace (the JSON array format: one event per line)."""

    def __init__(self, path: str, rank: int):
        self.path = rank_path(path, rank)
        self.rank = rank
        self._lock = threading.Lock()
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()
        self._pending: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
        self._pending += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": row}} for row, tid in ROWS.items()]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "w")  # a bad path fails here, not at exit
        self._file.write("[\n")
        self._first = True
        self._closed = False
        atexit.register(self.close)

    def now(self) -> float:
        return time.perf_counter()

    def _us(self, t: float) -> float:
        return round((self._wall0 + (t - self._perf0)) * 1e6, 1)

    def span(self, name: str, row: str, start: float, end: float, **args) -> None:
        self._add({"name": name, "ph": "X", "pid": self.rank, "tid": ROWS[row],
                   "ts": self._us(start), "dur": round(max(0.0, end - start) * 1e6, 1),
                   **({"args": args} if args else {})})

    def instant(self, name: str, row: str, when: float, **args) -> None:
        self._add({"name": name, "ph": "i", "s": "t", "pid": self.rank, "tid": ROWS[row],
                   "ts": self._us(when), **({"args": args} if args else {})})

    def _add(self, event: dict) -> None:
        with self._lock:
            self._pending.append(event)
            full = len(self._pending) >= _FLUSH_EVERY
        if full:
            self.flush()

    def flush(self) -> None:
        """Write the events so far."""
        with self._lock:
            if self._closed:
                return
            events, self._pending = self._pending, []
            for e in events:
                self._file.write(("" if self._first else ",\n") + json.dumps(e))
                self._first = False
            self._file.flush()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._file.write("\n]\n")
                self._file.close()


_timelines: dict[int, Timeline] = {}
_lock = threading.Lock()


def get(rank: int, env=None, path: str | None = None) -> Timeline | None:
    """This process's timeline for ``rank`` if ``path`` (a group's ``Options.timeline``;
    None: ``LINERATE_TIMELINE`` in ``env``, read through the registry) is set, else None."""
    if path is None:
        from linerate import settings
        path = settings.read("LINERATE_TIMELINE", env)
    path = path.strip()
    if not path:
        return None
    with _lock:
        tl = _timelines.get(rank)
        if tl is None:
            tl = _timelines[rank] = Timeline(path, rank)
        return tl


def merge(paths: list[str], out: str) -> int:
    """Join ranks' timeline files into one trace; returns the number of events."""
    events: list = []
    for p in paths:
        with open(p) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:  # a run that was killed: the array is not closed
            data = json.loads(text.rstrip().rstrip(",") + "]")
        evs = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(evs, list):
            raise ValueError(f"{p}: not a Chrome trace (no traceEvents list)")
        events.extend(evs)
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
