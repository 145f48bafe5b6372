"""Who makes the others wait: the time each rank waits for each peer, how late each rank enters
its collectives, and the group's slowest rank, decided from every rank's view.

What one rank measures, per collective (a lifecycle hook, collectives/op.py):

- its own duration, from entering the op to its end;
- for each peer, how long it waited from its own entry for that peer's first contribution
  (the first chunk of the op's messages from it over a link, transport/matching.py; its first
  tick in the shared segment, collectives/shm_algos.py). Only waits are recorded: a peer whose
  contribution was there before this rank entered cost it nothing.

No rank can tell alone who entered last: over a ring, only a late rank's successor waits for it
directly. So every rank publishes its view (the durations and waits of its last ``HISTORY``
collectives, as JSON under a key of the group's torch Store) a few times a second from a thread
of its own, reads every rank's, and decides with :func:`decide`: in each collective that every
view holds, the rank with the shortest duration entered last, late by the longest duration less
its own; the entry counts when it is at least ``LINERATE_SLOW_RANK_MS`` and a peer did wait at
least half that for the rank's first contribution (the durations alone would mistake a rank
that merely finishes first, for a large op's last steps, for a late one). A rank late in at
least ``SHARE`` of at least ``MIN_OPS`` common collectives is the slowest. Every rank computes
the same answer from the same views.

Exported (``linerate_`` series, the exporter's ``rank`` and ``host`` labels):
``peer_wait_seconds_total{peer}``, ``entry_skew_seconds{op}`` (a histogram of this rank's own
lateness relative to the first rank to enter), ``rank_late_ratio{late_rank}`` and
``rank_lateness_seconds{late_rank}`` (share of the window's collectives each rank entered last,
and by how much on average), ``slowest_rank`` (the named rank, -1: nobody), and the window's
size ``slow_window_collectives``. The slow links of transport/slowlink.py travel in the same
views. A warning names a slow rank or link at most once per ``LINERATE_SLOW_LOG_S`` seconds.

Nothing read from the Store is evaluated or unpickled: a view is JSON of numbers and short
strings, checked field by field, and a view that does not parse is skipped.
"""
from __future__ import annotations

import atexit
import bisect
import collections
import json
import logging
import threading
import time
import weakref

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from linerate.transport import metrics, slowlink

from .lateness import MIN_OPS, SHARE, WINDOW, decide, describe  # noqa: F401 - also straggler's
from .op import waits as waited

log = logging.getLogger("linerate")

#: Collectives a view holds: views published a period (VIEW_S) apart share a window's worth
#: while collectives take at least VIEW_S / (HISTORY - WINDOW) (0.5 ms); a rank late by
#: LINERATE_SLOW_RANK_MS makes every collective take at least that long. Faster collectives
#: are late by less than any threshold: their views may share none, and nobody is named.
HISTORY = 256
#: Seconds between two publications of this rank's view while some rank entered late in the
#: last round's window; a round where none did doubles the period, up to VIEW_MAX_S (a
#: balanced job spends a few hundredths of a percent of a core on its views).
VIEW_S = 0.1
VIEW_MAX_S = 1.0
#: Publications between two samples of the links' rates (transport/slowlink.py: each reads
#: every connection's TCP_INFO).
LINK_EVERY = 3
#: Waits shorter than this are not published (they name nobody).
WAIT_FLOOR_S = 0.0005
#: Upper bounds (seconds) of the entry skew histogram.
SKEW_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_KEY = "linerate-watch/"
_MAX_VIEW = 1 << 20  # bytes: a longer value is nobody's view

_watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()
_lock = threading.Lock()


# ----------------------------------------------------------------------------- views
def encode(host: str, ops, links) -> str:
    """This rank's view as JSON: ``ops`` of (seq, seconds, {peer: seconds}) in increasing
    ``seq``, written as the first seq ``s0``, the durations in microseconds from it (-1 where a
    seq has no record: a failed op, another kind of call) and the waits as sparse
    ``[seq, peer, µs]`` triples; ``links``: the slow-link rows' encoding
    (transport/slowlink.py), or None."""
    s0 = ops[0][0] if ops else 0
    d = [-1] * (ops[-1][0] - s0 + 1 if ops else 0)
    w = []
    for seq, sec, ws in ops:
        d[seq - s0] = round(sec * 1e6)
        for q, x in ws.items():
            w.append([seq, q, round(x * 1e6)])
    return json.dumps({"v": 2, "host": host, "s0": s0, "d": d, "w": w, "links": links},
                      separators=(",", ":"))


def _int(v) -> bool:
    return type(v) is int and -(1 << 62) < v < 1 << 62


class View:
    """One rank's parsed view: ``host``, ``s0``, ``d`` (µs per seq from ``s0``, -1: none),
    ``waits`` (seq -> {peer: seconds}), ``links`` (the slow-link encoding, unchecked here)."""

    __slots__ = ("host", "s0", "d", "waits", "links")

    def __init__(self, host, s0, d, waits, links):
        self.host, self.s0, self.d, self.waits, self.links = host, s0, d, waits, links

    def ops(self, lo: int, hi: int) -> list:
        """(seq, seconds, waits) for the seqs in [lo, hi) this view holds."""
        d, s0, waits = self.d, self.s0, self.waits
        return [(s, d[s - s0] / 1e6, waits.get(s, {})) for s in range(lo, hi)
                if 0 <= s - s0 < len(d) and d[s - s0] >= 0]


def parse(raw: bytes, size: int) -> View | None:
    """A view from its bytes, or None for anything that is not a well-formed one."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > _MAX_VIEW:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != 2:
        return None
    host, s0, d, w = doc.get("host"), doc.get("s0"), doc.get("d"), doc.get("w")
    if not (isinstance(host, str) and len(host) <= 255 and _int(s0) and isinstance(d, list)
            and len(d) <= HISTORY and all(_int(x) and x >= -1 for x in d)
            and isinstance(w, list) and len(w) <= HISTORY * size):
        return None
    waits: dict[int, dict] = {}
    for e in w:
        if not (isinstance(e, list) and len(e) == 3 and _int(e[0]) and 0 <= e[0] - s0 < len(d)
                and _int(e[1]) and 0 <= e[1] < size and _int(e[2]) and e[2] >= 0):
            return None
        waits.setdefault(e[0], {})[e[1]] = e[2] / 1e6
    return View(host, s0, d, waits, doc.get("links"))


def common(views: dict[int, View]) -> tuple[int, int]:
    """The seqs [lo, hi) that every view covers (lo >= hi: none)."""
    lo = max(v.s0 for v in views.values())
    hi = min(v.s0 + len(v.d) for v in views.values())
    return lo, hi


# ----------------------------------------------------------------------------- one group
class Watch:
    """One process group's waits, entry lateness and verdict; a lifecycle hook
    (``started``/``completed``/``failed``, collectives/op.py)."""

    def __init__(self, store, scope: str, rank: int, size: int, global_ranks, host: str,
                 late_ms: float, log_s: float, group: str = "", links=None):
        self.store = store
        self.rank, self.size = rank, size
        self.glob = list(global_ranks) if global_ranks and len(global_ranks) == size \
            else list(range(size))
        self.host = host
        self.late_s = late_ms / 1e3
        self.log_s = log_s
        self.group = group
        #: transport/slowlink.py LinkRates of this group's links (None: links not watched).
        self.links = links
        self._keys = [f"{_KEY}{scope}/{q}" for q in range(size)]
        #: (seq, seconds, waits, op name) of the last HISTORY collectives.
        self._ops: collections.deque = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self.waited = [0.0] * size  # seconds this rank waited for each peer (group ranks)
        self._done = 0              # collectives recorded
        self._published = -1
        self._rounds = 0
        self._period = VIEW_S
        self._rows = None           # the links' last sample (published with every view)
        self._skew_seen = -1        # the last seq observed in the skew histogram
        self._skew: dict[str, list] = {}
        #: The last verdict: decide()'s result with "hosts", "links" (slowlink.group_verdict)
        self.verdict: dict = {"collectives": 0, "late": {}, "slowest": None, "links": []}
        self._logged = 0.0
        self._stop = threading.Event()
        self._thread = None
        if size > 1:
            self._thread = threading.Thread(target=self._run, name="linerate-watch", daemon=True)
            self._thread.start()
        with _lock:
            _watches.add(self)

    # ------------------------------------------------------------------ lifecycle hook
    def started(self, op) -> None:
        pass

    def completed(self, op, algorithm: str, seconds: float, nbytes) -> None:
        waits = {}
        if op.arrivals:
            w = self.waited
            for q, d in waited(op).items():
                w[q] += d
                if d >= WAIT_FLOOR_S:
                    waits[q] = d
        # No lock on the collectives' path: a deque's append is atomic, and a count that
        # two threads finishing ops at once miss one of only delays a publication.
        self._ops.append((op.seq, seconds, waits, op.name))
        self._done += 1

    def failed(self, op, error: BaseException, algorithm: str) -> None:
        pass

    # ------------------------------------------------------------------ the views
    def close(self) -> None:
        """Stop the views' thread (waiting for a Store call under way: a thread left in one
        when the interpreter exits aborts the process)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=VIEW_MAX_S + 5.0)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._period):
                self.exchange()
        except Exception as e:  # noqa: BLE001 - the Store went (a rank exited): stop watching
            if not self._stop.is_set():
                log.debug("rank %d: linerate watch stopped: %s", self.glob[self.rank], e)

    def exchange(self) -> None:
        """Publish this rank's view, read every rank's, decide (one round; the thread runs
        it every VIEW_S to VIEW_MAX_S seconds while collectives complete)."""
        if self._done == self._published:
            return
        self._published = self._done
        ops = list(self._ops)  # one C call: no append can come between
        names = {seq: name for seq, _, _, name in ops}
        ops = [(seq, sec, w) for seq, sec, w, _ in ops]
        self._rounds += 1
        if self.links is not None and (self._rows is None or self._rounds % LINK_EVERY == 0):
            self._rows = self.links.sample()
        enc = slowlink.encode(self._rows) if self._rows is not None else None
        self.store.set(self._keys[self.rank], encode(self.host, ops, enc))
        if not self.store.check(self._keys):
            return
        raw = self.store.multi_get(self._keys)
        parsed = {}
        for q, value in enumerate(raw):
            got = parse(value, self.size)
            if got is not None:
                parsed[q] = got
        hosts = {q: v.host for q, v in parsed.items()}
        links = {q: v.links for q, v in parsed.items()}
        views = {}
        if len(parsed) == self.size:  # only the window decide() looks at is unpacked
            lo, hi = common(parsed)
            lo = max(lo, hi - WINDOW)
            views = {q: v.ops(lo, hi) for q, v in parsed.items()}
        v = decide(views, self.size, self.late_s)
        self._period = VIEW_S if v["late"] else min(VIEW_MAX_S, 2 * self._period)
        v["hosts"] = hosts
        v["links"] = self._link_verdict(hosts, links)
        self._observe_skew(v.pop("skew").get(self.rank, {}), names)
        self.verdict = v
        if self.log_s > 0 and self.rank == 0:
            self._log(v)

    def _link_verdict(self, hosts: dict, links: dict) -> list:
        if self.links is None:
            return []
        views = {}
        for q, enc in links.items():
            if enc is None:
                continue
            try:
                views[self.glob[q]] = (hosts[q], slowlink.decode(enc))
            except (ValueError, TypeError, KeyError):
                continue
        return slowlink.group_verdict(views)

    def _observe_skew(self, mine: dict, names: dict) -> None:
        with self._lock:
            for seq in sorted(mine):
                if seq <= self._skew_seen:
                    continue
                name = names.get(seq, "")
                h = self._skew.get(name)
                if h is None:
                    h = self._skew[name] = [0] * (len(SKEW_BUCKETS) + 2)
                s = mine[seq]
                h[bisect.bisect_left(SKEW_BUCKETS, s)] += 1
                h[-1] += s
                self._skew_seen = seq

    def _log(self, v: dict) -> None:
        now = time.monotonic()
        if now - self._logged < self.log_s:
            return
        lines = []
        r = v["slowest"]
        if r is not None:
            count, mean = v["late"][r]
            host = v["hosts"].get(r, "?")
            lines.append(describe(self.glob[r], count, v["collectives"], mean)
                         + f" (host {host})")
        lines += [link["evidence"] for link in v["links"]]
        if lines:
            self._logged = now
            where = f" (group {self.group})" if self.group else ""
            log.warning("linerate%s: %s", where, "; ".join(lines))

    # ------------------------------------------------------------------ reading
    def report(self) -> dict:
        """The last verdict in global ranks: ``{"collectives": n, "slowest": rank or None,
        "late": {rank: {"share": s, "mean_s": m}}, "text": ..., "links": [...],
        "waited": {peer: seconds}}``."""
        v = self.verdict
        n = v["collectives"]
        late = {self.glob[r]: {"share": c / n if n else 0.0, "mean_s": m}
                for r, (c, m) in v["late"].items()}
        r = v["slowest"]
        text = ""
        if r is not None:
            c, m = v["late"][r]
            text = describe(self.glob[r], c, n, m)
        return {"collectives": n, "slowest": None if r is None else self.glob[r], "late": late,
                "text": text, "links": list(v["links"]),
                "waited": {self.glob[q]: s for q, s in enumerate(self.waited) if q != self.rank}}

    def skew_histogram(self) -> dict:
        with self._lock:
            return {k: list(h) for k, h in self._skew.items()}


# ----------------------------------------------------------------------------- export
class _Collector:
    def collect(self):
        base = ["rank", "host"]
        ids = list(metrics.identity())
        with _lock:
            live = list(_watches)
        wait = CounterMetricFamily("linerate_peer_wait_seconds",
                                   "Seconds this rank waited, from entering a collective, for a "
                                   "peer's first contribution", labels=base + ["peer"])
        skew = HistogramMetricFamily("linerate_entry_skew_seconds",
                                     "How late this rank entered each collective, relative to "
                                     "the first rank to enter", labels=base + ["op"])
        ratio = GaugeMetricFamily("linerate_rank_late_ratio",
                                  "Share of the recent collectives each rank entered last "
                                  "(decided from every rank's view)",
                                  labels=base + ["late_rank"])
        lateness = GaugeMetricFamily("linerate_rank_lateness_seconds",
                                     "How late a rank entered, on average, the recent "
                                     "collectives it entered last", labels=base + ["late_rank"])
        slowest = GaugeMetricFamily("linerate_slowest_rank",
                                    "The rank that makes the others wait (-1: nobody)",
                                    labels=base)
        window = GaugeMetricFamily("linerate_slow_window_collectives",
                                   "Collectives the slowest rank is decided over", labels=base)
        waited: dict[int, float] = {}
        hists: dict[str, list] = {}
        late: dict[int, tuple] = {}
        worst, n = None, 0
        for w in live:
            for q, s in enumerate(w.waited):
                if q != w.rank:
                    waited[w.glob[q]] = waited.get(w.glob[q], 0.0) + s
            for op, h in w.skew_histogram().items():
                acc = hists.setdefault(op, [0] * len(h))
                for i, c in enumerate(h):
                    acc[i] += c
            rep = w.report()
            if rep["collectives"] >= n:  # the largest group's verdict
                n = rep["collectives"]
                late = {r: (d["share"], d["mean_s"]) for r, d in rep["late"].items()}
                worst = rep["slowest"]
        for q in sorted(waited):
            wait.add_metric(ids + [str(q)], waited[q])
        for op in sorted(hists):
            h = hists[op]
            cum, buckets = 0, []
            for bound, c in zip(SKEW_BUCKETS, h):
                cum += c
                buckets.append((repr(float(bound)), cum))
            cum += h[len(SKEW_BUCKETS)]
            buckets.append(("+Inf", cum))
            skew.add_metric(ids + [op], buckets, h[-1])
        for r in sorted(late):
            ratio.add_metric(ids + [str(r)], late[r][0])
            lateness.add_metric(ids + [str(r)], late[r][1])
        if live:
            slowest.add_metric(ids, -1 if worst is None else worst)
            window.add_metric(ids, n)
        yield wait
        yield skew
        yield ratio
        yield lateness
        yield slowest
        yield window


metrics.REGISTRY.register(_Collector())


@atexit.register
def _close_all() -> None:
    with _lock:
        live = list(_watches)
    for w in live:
        w.close()
