"""The collectives' metrics: what a collective reports (its canonical name, its size and its
bus bandwidth factor: nccl-tests' definitions, so that busbw compares with the link rate) and
the series made of it, served by the exporter of transport/metrics.py on its ``REGISTRY``:

  linerate_collective_seconds{rank,host,op,algorithm,size_bucket}  histogram of durations
  linerate_collective_bytes_total{rank,host,op}                    message bytes (per rank)
  linerate_bus_bandwidth_bytes_per_second{rank,host,op}            busbw of the last window
                                                                   in which the op ran

``record`` (called once per finished collective by op.py, on the caller's path) only appends
the facts to a queue while ``metrics.enabled()``; they are folded into the series when the
window rolls or Prometheus scrapes (``_drain``), off the collectives' path. The busbw window rolls over with the exporter's sampler
(``metrics.on_window``, every LINERATE_METRICS_WINDOW seconds); ``rank`` and ``host`` are
``metrics.identity()``, as on the transport's series.
"""
from __future__ import annotations

import bisect
import collections
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from linerate.transport import metrics

__all__ = ["canonical", "bus_factor", "message_bytes", "record", "record_collective",
           "size_bucket", "SECONDS_BUCKETS"]

#: busbw = algbw * factor(world); algbw = size / time, size as nccl-tests counts it.
_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "barrier": lambda n: 0.0,
}

#: Upper bounds (seconds) of the collective duration histogram.
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: size_bucket label values: the upper bound of the message size.
_SIZE_BOUNDS = ((4 << 10, "4KiB"), (64 << 10, "64KiB"), (1 << 20, "1MiB"), (16 << 20, "16MiB"),
                (256 << 20, "256MiB"))

_lock = threading.Lock()
_hist: dict[tuple, list] = {}           # (op, algorithm, size_bucket) -> [counts..., sum]
_op_bytes: dict[str, int] = {}
_win_bus: dict[str, list] = {}          # op -> [bus bytes, seconds] in the current window
_busbw: dict[str, float] = {}           # op -> busbw of the last window in which it ran
#: Finished collectives not folded into the series yet: (op, algorithm, bytes, seconds, world).
_pending: collections.deque = collections.deque()
#: Folded at once beyond this many (no sampler or scrape for a long while).
_PENDING_MAX = 100_000


def canonical(op: str) -> str:
    """The metrics name of an op: coalesced variants count as their op."""
    return op[:-len("_coalesced")] if op.endswith("_coalesced") else op


def bus_factor(op: str, world: int) -> float:
    f = _FACTORS.get(canonical(op))
    return f(world) if f is not None and world > 0 else 0.0


def message_bytes(op: str, result: list, world: int) -> int:
    """nccl-tests' size from the tensors a Work returns: the whole buffer of gathers,
    scatters and all-to-all, the tensor of the others."""
    n = 0
    for t in result:
        if isinstance(t, (list, tuple)):
            n += sum(x.numel() * x.element_size() for x in t)
        else:
            n += t.numel() * t.element_size()
    if canonical(op) in ("reduce_scatter", "scatter"):
        n *= world  # result is this rank's share
    return n


def size_bucket(nbytes: int) -> str:
    """The ``size_bucket`` label of a message of ``nbytes``: the smallest bound that holds it."""
    for bound, name in _SIZE_BOUNDS:
        if nbytes <= bound:
            return name
    return "inf"


def record(op: str, algorithm: str, nbytes: int, seconds: float, world: int) -> None:
    """One finished collective of a group of ``world`` ranks (nothing while metrics are off):
    queued, folded into the series by ``_drain``."""
    if metrics.enabled():
        _pending.append((op, algorithm, nbytes, seconds, world))
        if len(_pending) > _PENDING_MAX:
            _drain()


def _drain() -> None:
    """Fold the queued collectives into the series (the sampler's window, a scrape)."""
    pop = _pending.popleft
    while True:
        try:
            op, algorithm, nbytes, seconds, world = pop()
        except IndexError:
            return
        name = canonical(op)
        record_collective(name, algorithm, nbytes, seconds, bus_factor(name, world))


def record_collective(op: str, algorithm: str, nbytes: int, seconds: float, bus_factor: float) -> None:
    """One finished collective under its metrics name ``op``: ``nbytes`` is nccl-tests' size
    (per rank), ``bus_factor`` turns algorithm bandwidth into bus bandwidth."""
    if not metrics.enabled():
        return
    key = (op, algorithm, size_bucket(nbytes))
    i = bisect.bisect_left(SECONDS_BUCKETS, seconds)
    with _lock:
        h = _hist.get(key)
        if h is None:
            h = _hist[key] = [0] * (len(SECONDS_BUCKETS) + 2)
        h[i] += 1
        h[-1] += seconds
        _op_bytes[op] = _op_bytes.get(op, 0) + nbytes
        if nbytes and bus_factor:
            w = _win_bus.get(op)
            if w is None:
                w = _win_bus[op] = [0.0, 0.0]
            w[0] += nbytes * bus_factor
            w[1] += seconds


def _roll_window() -> None:
    """The end of a window (the exporter's sampler): each op that ran in it gets its busbw."""
    _drain()
    with _lock:
        for op, (bus_bytes, seconds) in _win_bus.items():
            if seconds > 0:
                _busbw[op] = bus_bytes / seconds
        _win_bus.clear()


def _fmt(bound: float) -> str:
    return repr(float(bound))


class _Collector:
    """The collectives' series, read when Prometheus scrapes."""

    def collect(self):
        base = ["rank", "host"]
        ids = list(metrics.identity())
        _drain()
        with _lock:
            hist = {k: list(v) for k, v in _hist.items()}
            op_bytes = dict(_op_bytes)
            busbw = dict(_busbw)
            for op, (bus_bytes, seconds) in _win_bus.items():  # ran only in the open window
                if op not in busbw and seconds > 0:
                    busbw[op] = bus_bytes / seconds

        h = HistogramMetricFamily("linerate_collective_seconds", "Duration of collectives",
                                  labels=base + ["op", "algorithm", "size_bucket"])
        for (op, algo, sb), counts in sorted(hist.items()):
            cum, buckets = 0, []
            for bound, n in zip(SECONDS_BUCKETS, counts):
                cum += n
                buckets.append((_fmt(bound), cum))
            cum += counts[len(SECONDS_BUCKETS)]
            buckets.append(("+Inf", cum))
            h.add_metric(ids + [op, algo, sb], buckets, counts[-1])
        yield h
        b = CounterMetricFamily("linerate_collective_bytes", "Message bytes of collectives (per rank)",
                                labels=base + ["op"])
        for op, n in sorted(op_bytes.items()):
            b.add_metric(ids + [op], n)
        yield b
        bw = GaugeMetricFamily("linerate_bus_bandwidth_bytes_per_second",
                               "Bus bandwidth (nccl-tests) over the last window in which the op ran",
                               labels=base + ["op"])
        for op, v in sorted(busbw.items()):
            bw.add_metric(ids + [op], v)
        yield bw


metrics.REGISTRY.register(_Collector())
metrics.on_window(_roll_window)
