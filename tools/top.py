"""linerate top: a live terminal view of the metrics every rank exports (docs/metrics-spec.md).

    linerate top                            # localhost:9400-9407, refreshed every second
    linerate top node1:9400-9403 node2:9400-9403 --interval 2
    linerate top localhost:9400-9401 --once --json

Each ENDPOINT is HOST:PORT, HOST:PORT1-PORT2 (one rank per port), a bare PORT or PORT1-PORT2
(localhost), or a full URL (http://host:port/metrics). Every --interval seconds all of them are
scraped in parallel; rates are the counter deltas between two scrapes. Shown: per link (host,
rank, interface, direction) the byte rate, the capacity and the utilization (from
linerate_interface_bytes_total, whose ``shm`` bytes count a copy that several peers read once:
the definition of the exporter's utilization and of the dashboard); per collective the
bus bandwidth (min/max over ranks), collectives per second, mean and p99 latency, and the
slowest rank; the rank that makes the others wait, as the ranks decided it together
(collectives/straggler.py: the share of recent collectives it entered last, how late); per peer
the TCP retransmits per second, the send queue and the share of time the rank spent waiting for
that peer's contributions (nonzero rows only, unless --all); per TCP connection measured by the ranks' slow-link watch, its rate while
sending and its ratio to its siblings (the connections named slow only, unless --all).
Endpoints that do not answer are listed as down.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_ENDPOINT = "localhost:9400-9407"
DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 0.8
#: Most endpoints one PORT1-PORT2 range may name (a typo should not start 60000 scrapes).
MAX_RANGE = 1024
#: Larger /metrics bodies are refused (a rank exports a few hundred series).
MAX_BODY_BYTES = 16 << 20
MAX_THREADS = 32
BAR_WIDTH = 10
#: A utilization above this is over capacity: the bar ends in "!" and the row says why.
OVER_CAPACITY = 1.005
PREFIX = "linerate_"

SENT = "linerate_sent_bytes_total"
RECEIVED = "linerate_received_bytes_total"
INTERFACE_BYTES = "linerate_interface_bytes_total"
CAPACITY = "linerate_link_capacity_bytes_per_second"
UTILIZATION = "linerate_link_utilization_ratio"
HISTOGRAM = "linerate_collective_seconds"
OP_BYTES = "linerate_collective_bytes_total"
BUSBW = "linerate_bus_bandwidth_bytes_per_second"
RETRANSMITS = "linerate_tcp_retransmits_total"
SEND_QUEUE = "linerate_send_queue_bytes"
LINK_RATE = "linerate_link_rate_bytes_per_second"
LINK_RATIO = "linerate_link_rate_ratio"
SLOW_LINK = "linerate_slow_link"
SLOWEST_RANK = "linerate_slowest_rank"
LATE_RATIO = "linerate_rank_late_ratio"
LATENESS = "linerate_rank_lateness_seconds"
SLOW_WINDOW = "linerate_slow_window_collectives"
PEER_WAIT = "linerate_peer_wait_seconds_total"
INFO = "linerate_info"

#: Row order of the collectives table (the spec's op values); other names follow, sorted.
OP_ORDER = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
            "gather", "scatter", "barrier")
_DIRECTIONS = (("tx", SENT), ("rx", RECEIVED))
_IDENTITY_LABELS = ("rank", "host")

# Scrapes go straight to the ranks: an http_proxy meant for the internet must not catch them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ----------------------------------------------------------------------------- endpoints
def parse_endpoint(text: str) -> list[str]:
    """The /metrics URLs one ENDPOINT argument names (raises ValueError when it is malformed)."""
    s = text.strip()
    if "://" in s:
        parts = urlsplit(s)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{text!r}: expected an http:// or https:// URL with a host")
        parts.port  # noqa: B018 - raises ValueError when the port is not a number in range
        path = parts.path if parts.path not in ("", "/") else "/metrics"
        return [urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))]
    host, sep, ports = s.rpartition(":")
    if not sep:
        host, ports = "localhost", s
    elif not host:
        host = "localhost"
    bracketed_ipv6 = host.startswith("[") and host.endswith("]") and len(host) > 2
    if not bracketed_ipv6 and (":" in host or "[" in host or "]" in host or "/" in host
                               or not host.strip()):
        raise ValueError(f"{text!r}: expected HOST:PORT, HOST:PORT1-PORT2 or a URL "
                         "(IPv6 addresses in brackets: [::1]:9400)")
    first, dash, last = ports.partition("-")
    try:
        lo = int(first)
        hi = int(last) if dash else lo
    except ValueError:
        raise ValueError(f"{text!r}: expected HOST:PORT, HOST:PORT1-PORT2 or a URL") from None
    if not (1 <= lo <= 65535 and 1 <= hi <= 65535):
        raise ValueError(f"{text!r}: ports are 1 to 65535")
    if hi < lo:
        raise ValueError(f"{text!r}: the range {lo}-{hi} is empty")
    if hi - lo >= MAX_RANGE:
        raise ValueError(f"{text!r}: more than {MAX_RANGE} ports in one range")
    return [f"http://{host}:{port}/metrics" for port in range(lo, hi + 1)]


def parse_endpoints(texts: list[str]) -> list[str]:
    """Every URL the arguments name, in order, each once."""
    urls: list[str] = []
    for text in texts:
        for url in parse_endpoint(text):
            if url not in urls:
                urls.append(url)
    return urls


# ----------------------------------------------------------------------------- scraping
#: A sample's labels as a hashable key: the sorted (name, value) pairs.
LabelKey = tuple


@dataclass
class Scrape:
    """One answer (or failure) of one endpoint. ``t``: time.monotonic() when it answered."""
    url: str
    t: float
    samples: dict[str, dict[LabelKey, float]] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.samples is not None


def parse_metrics(text: str) -> dict[str, dict[LabelKey, float]]:
    """The linerate_* samples of a Prometheus text exposition: {sample name: {labels: value}}.

    Parsed by prometheus_client's parser (no eval); NaN values are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[LabelKey, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(PREFIX):
                continue
            value = float(sample.value)
            if math.isnan(value):
                continue
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = value
    return out


def scrape(url: str, timeout: float = DEFAULT_TIMEOUT) -> Scrape:
    """GET one /metrics page; every failure becomes ``Scrape.error`` (never raises)."""
    t = time.monotonic()
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            # prometheus_client renders the whole page before it sends the status line: the
            # moment it answers is the moment closest to when the counters were read.
            t = time.monotonic()
            body = resp.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as e:
        return Scrape(url, t, error=f"HTTP {e.code} {e.reason}")
    except urllib.error.URLError as e:
        return Scrape(url, t, error=_reason(e.reason))
    except (TimeoutError, socket.timeout):
        return Scrape(url, t, error="timed out")
    except (OSError, http.client.HTTPException) as e:
        return Scrape(url, t, error=_reason(e))
    except Exception as e:  # noqa: BLE001 - a scrape never takes the view down
        return Scrape(url, t, error=f"{type(e).__name__}: {e}")
    if len(body) > MAX_BODY_BYTES:
        return Scrape(url, t, error=f"answer larger than {MAX_BODY_BYTES >> 20} MiB")
    try:
        samples = parse_metrics(body.decode("utf-8", errors="replace"))
    except Exception as e:  # noqa: BLE001 - malformed text is one endpoint's problem
        return Scrape(url, t, error=f"cannot parse the metrics: {e}")
    return Scrape(url, t, samples=samples)


def _reason(reason) -> str:
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


def scrape_all(pool: ThreadPoolExecutor, urls: list[str], timeout: float) -> list[Scrape]:
    futures = [pool.submit(scrape, url, timeout) for url in urls]
    return [f.result() for f in futures]


# ----------------------------------------------------------------------------- computation
def counter_delta(prev: float | None, cur: float) -> float:
    """Increase of a counter between two reads. A decrease means the process restarted and the
    counter began again at 0 (Prometheus' convention), so everything it counts now is new. A
    series absent before (``prev`` None) was created between the reads: all of it is new."""
    if prev is None or cur < prev:
        return cur
    return cur - prev


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Estimate the q-quantile from cumulative bucket counts {upper bound (le): count}, the
    way PromQL's histogram_quantile does: linear interpolation inside the bucket that holds
    the rank q * total. In the +Inf bucket the answer is the largest finite bound. None when
    there are no observations."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    counts, running = [], 0.0
    for b in bounds:  # deltas of separately reset buckets can dip: keep them monotonic
        running = max(running, buckets[b])
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return None
    target = q * total
    for i, (bound, cum) in enumerate(zip(bounds, counts)):
        if cum >= target:
            if math.isinf(bound):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            lower = bounds[i - 1] if i > 0 else min(0.0, bound)
            below = counts[i - 1] if i > 0 else 0.0
            if cum == below:
                return bound
            return lower + (bound - lower) * (target - below) / (cum - below)
    return None  # pragma: no cover - the last bucket always holds the total


def _labels(key: LabelKey) -> dict[str, str]:
    return dict(key)


def _rank_value(rank: str | int | None):
    """A rank label as an int when it is one (JSON and sorting), else as it came."""
    if isinstance(rank, str):
        try:
            return int(rank)
        except ValueError:
            return rank
    return rank


def _rank_sort(rank) -> tuple:
    return (0, rank, "") if isinstance(rank, int) else (1, 0, str(rank))


def _peer_sort(peer: str) -> tuple:
    return _rank_sort(_rank_value(peer))


def _op_sort(op: str) -> tuple:
    return (OP_ORDER.index(op), "") if op in OP_ORDER else (len(OP_ORDER), op)


class _Pair:
    """One endpoint's two successive scrapes: identity of its series, deltas and rates."""

    def __init__(self, prev: Scrape | None, cur: Scrape):
        self.cur = cur
        self.prev = prev if prev is not None and prev.ok and cur.ok else None
        self.dt = self.cur.t - self.prev.t if self.prev else None
        if self.dt is not None and self.dt <= 0:
            self.prev, self.dt = None, None
        url_host = urlsplit(cur.url).hostname or "?"
        self.host, self.rank = url_host, None
        for name in (INFO, SENT, HISTOGRAM + "_count", BUSBW, SEND_QUEUE):
            for key in (cur.samples or {}).get(name, {}):
                labels = _labels(key)
                if "rank" in labels:
                    self.host = labels.get("host", url_host)
                    self.rank = _rank_value(labels["rank"])
                    break
            if self.rank is not None:
                break

    def ident(self, labels: dict[str, str]) -> tuple[str, object]:
        rank = labels.get("rank")
        return (labels.get("host", self.host),
                _rank_value(rank) if rank is not None else self.rank)

    def series(self, name: str) -> dict[LabelKey, float]:
        return (self.cur.samples or {}).get(name, {})

    def delta(self, name: str, key: LabelKey) -> float | None:
        """Counter increase since the previous scrape; None without one."""
        if self.prev is None:
            return None
        return counter_delta(self.prev.samples.get(name, {}).get(key), self.cur.samples[name][key])


def compute_frame(prev: list[Scrape | None] | None, cur: list[Scrape], show_all: bool = False,
                  wall_time: float | None = None) -> dict:
    """The figures of one refresh, from each endpoint's previous and current scrape (lists in
    the same endpoint order; ``prev`` None or an entry None: no rates for that endpoint yet).
    The result is plain JSON data; ``render`` turns it into text."""
    prev = prev if prev is not None else [None] * len(cur)
    pairs = [_Pair(p, c) for p, c in zip(prev, cur)]
    endpoints = []
    for pair in pairs:
        info = {}
        for key in pair.series(INFO):
            info = {k: v for k, v in _labels(key).items() if k not in _IDENTITY_LABELS}
            break
        endpoints.append({"url": pair.cur.url, "up": pair.cur.ok, "error": pair.cur.error,
                          "host": pair.host if pair.cur.ok else urlsplit(pair.cur.url).hostname,
                          "rank": pair.rank, "rates": pair.dt is not None, "info": info,
                          "series": sum(len(v) for v in (pair.cur.samples or {}).values())})
    dts = [p.dt for p in pairs if p.dt is not None]
    return {
        "time": time.time() if wall_time is None else wall_time,
        "interval_seconds": sum(dts) / len(dts) if dts else None,
        "endpoints": endpoints,
        "up": sum(1 for e in endpoints if e["up"]),
        "links": _links(pairs),
        **_collectives(pairs),
        **_peers(pairs, show_all),
        **_link_rates(pairs, show_all),
        "late_rank": _late_rank(pairs),
    }


def _late_rank(pairs: list[_Pair]) -> dict | None:
    """The ranks' verdict on who makes the others wait (collectives/straggler.py): every
    endpoint exports the one its group decided from all ranks' views. None where no rank is
    watched; ``rank`` None where nobody is named."""
    named: dict[int, int] = {}
    watched = 0
    window = 0
    shares: dict[int, tuple] = {}
    for pair in pairs:
        for key, value in pair.series(SLOWEST_RANK).items():
            watched += 1
            if value >= 0:
                named[int(value)] = named.get(int(value), 0) + 1
        for key, value in pair.series(SLOW_WINDOW).items():
            window = max(window, int(value))
        lateness = {_labels(k).get("late_rank"): v for k, v in pair.series(LATENESS).items()}
        for key, value in pair.series(LATE_RATIO).items():
            r = _labels(key).get("late_rank")
            if r is not None and r.lstrip("-").isdigit():
                shares.setdefault(int(r), (value, lateness.get(r)))
    if not watched:
        return None
    if not named:
        return {"rank": None, "named_by": 0, "watched": watched, "collectives": window}
    rank = max(named, key=lambda r: (named[r], -r))
    share, mean = shares.get(rank, (None, None))
    return {"rank": rank, "named_by": named[rank], "watched": watched, "collectives": window,
            "share": share, "mean_late_seconds": mean}


def _links(pairs: list[_Pair]) -> list[dict]:
    """Per (host, rank, interface, direction): the byte rate of linerate_interface_bytes_total
    (where an endpoint exports none, of the per-peer counters summed), the capacity and where
    it comes from (the ``source`` label), the utilization (rate over capacity, else the
    exporter's gauge) and, above 100 %, a note that says why."""
    rows: dict[tuple, dict] = {}
    capacity: dict[tuple, tuple[float, str | None]] = {}

    def row(key: tuple) -> dict:
        return rows.setdefault(key, {"rate": None, "gauge": None})

    for pair in pairs:
        per_iface = bool(pair.series(INTERFACE_BYTES))
        counters = ([(None, INTERFACE_BYTES)] if per_iface else list(_DIRECTIONS))
        for fixed, name in counters:
            for key, _value in pair.series(name).items():
                labels = _labels(key)
                direction = fixed or labels.get("direction", "?")
                r = row((*pair.ident(labels), labels.get("interface", "?"), direction))
                d = pair.delta(name, key)
                if d is not None:
                    r["rate"] = (r["rate"] or 0.0) + d / pair.dt
        for key, value in pair.series(UTILIZATION).items():
            labels = _labels(key)
            row((*pair.ident(labels), labels.get("interface", "?"),
                 labels.get("direction", "?")))["gauge"] = value
        for key, value in pair.series(CAPACITY).items():
            labels = _labels(key)
            capacity[(*pair.ident(labels), labels.get("interface", "?"))] = (
                value, labels.get("source"))
    out = []
    for (host, rank, iface, direction), r in rows.items():
        cap, source = capacity.get((host, rank, iface), (None, None))
        if cap is None or cap <= 0:
            cap, source = None, None
        if r["rate"] is not None and cap:
            util, how = r["rate"] / cap, "counters"
        elif r["gauge"] is not None:
            util, how = r["gauge"], "gauge"
        else:
            util, how = None, None
        out.append({"host": host, "rank": rank, "interface": iface, "direction": direction,
                    "bytes_per_second": r["rate"],
                    "bits_per_second": r["rate"] * 8 if r["rate"] is not None else None,
                    "capacity_bytes_per_second": cap, "capacity_source": source,
                    "utilization": util, "utilization_source": how,
                    "note": over_capacity_note(util, source)})
    out.sort(key=lambda x: (_rank_sort(x["rank"]), x["host"], x["interface"],
                            x["direction"] != "tx", x["direction"]))
    return out


def over_capacity_note(util: float | None, source: str | None) -> str | None:
    """Why a utilization is above 100 % (None where it is not): a capacity given by
    LINERATE_LINK_CAPACITY below what the link carries, or (a capacity from the driver or
    measured) counts that moved between the two scrapes unevenly."""
    if util is None or util <= OVER_CAPACITY:
        return None
    if source == "setting":
        return "capacity set by LINERATE_LINK_CAPACITY is too low"
    return "above the capacity over this interval"


def _collectives(pairs: list[_Pair]) -> dict:
    # (host, rank, op) -> that rank's figures over the interval
    per: dict[tuple, dict] = {}

    def entry(pair: _Pair, labels: dict[str, str]) -> dict:
        host, rank = pair.ident(labels)
        return per.setdefault((host, rank, labels.get("op", "?")), {
            "dt": pair.dt, "count": None, "sum": None, "bytes": None, "buckets": {},
            "busbw": None})

    def add(e: dict, field_: str, d: float | None) -> None:
        if d is not None:
            e[field_] = (e[field_] or 0.0) + d

    for pair in pairs:
        for suffix, field_ in (("_count", "count"), ("_sum", "sum")):
            name = HISTOGRAM + suffix
            for key in pair.series(name):
                add(entry(pair, _labels(key)), field_, pair.delta(name, key))
        name = HISTOGRAM + "_bucket"
        for key in pair.series(name):
            labels = _labels(key)
            e = entry(pair, labels)
            d = pair.delta(name, key)
            if d is None:
                continue
            try:
                le = float(labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(le):
                e["buckets"][le] = e["buckets"].get(le, 0.0) + d
        for key in pair.series(OP_BYTES):
            add(entry(pair, _labels(key)), "bytes", pair.delta(OP_BYTES, key))
        for key, value in pair.series(BUSBW).items():
            entry(pair, _labels(key))["busbw"] = value

    ops: dict[str, list[tuple]] = {}
    for (host, rank, op), e in per.items():
        ops.setdefault(op, []).append((host, rank, e))
    rows, slowest = [], None
    for op in sorted(ops, key=_op_sort):
        ranks = sorted(ops[op], key=lambda x: (_rank_sort(x[1]), x[0]))
        per_rank, rates, busbws = [], [], []
        count = total_sum = total_bytes = 0.0
        pooled: dict[float, float] = {}
        have_delta = False
        for host, rank, e in ranks:
            rate = mean = p99 = None
            if e["dt"] is not None and e["count"] is not None:
                have_delta = True
                rate = e["count"] / e["dt"]
                rates.append(rate)
                count += e["count"]
                total_sum += e["sum"] or 0.0
                total_bytes += e["bytes"] or 0.0
                for le, d in e["buckets"].items():
                    pooled[le] = pooled.get(le, 0.0) + d
                if e["count"] > 0:
                    mean = (e["sum"] or 0.0) / e["count"]
                    p99 = histogram_quantile(0.99, e["buckets"])
                    if slowest is None or mean > slowest["mean_latency_seconds"]:
                        slowest = {"op": op, "rank": rank, "host": host,
                                   "mean_latency_seconds": mean, "p99_seconds": p99}
            if e["busbw"] is not None:
                busbws.append(e["busbw"])
            per_rank.append({"host": host, "rank": rank, "collectives_per_second": rate,
                             "mean_latency_seconds": mean, "p99_seconds": p99,
                             "busbw_bytes_per_second": e["busbw"]})
        rows.append({
            "op": op, "ranks": len(ranks),
            "collectives_per_second": sum(rates) / len(rates) if rates else None,
            "collectives": count if have_delta else None,
            "mean_latency_seconds": total_sum / count if count > 0 else None,
            "p99_seconds": histogram_quantile(0.99, pooled) if count > 0 else None,
            "mean_size_bytes": total_bytes / count if count > 0 and total_bytes > 0 else None,
            "busbw_min_bytes_per_second": min(busbws) if busbws else None,
            "busbw_max_bytes_per_second": max(busbws) if busbws else None,
            "per_rank": per_rank})
    return {"ops": rows, "slowest": slowest}


def _peers(pairs: list[_Pair], show_all: bool) -> dict:
    rows: dict[tuple, dict] = {}

    def row(pair: _Pair, labels: dict[str, str]) -> dict:
        host, rank = pair.ident(labels)
        return rows.setdefault((host, rank, labels.get("peer", "?")),
                               {"retransmits_per_second": None, "retransmits_total": None,
                                "send_queue_bytes": None, "waited_per_second": None})

    for pair in pairs:
        for key, value in pair.series(RETRANSMITS).items():
            r = row(pair, _labels(key))
            r["retransmits_total"] = (r["retransmits_total"] or 0.0) + value
            d = pair.delta(RETRANSMITS, key)
            if d is not None:
                r["retransmits_per_second"] = (r["retransmits_per_second"] or 0.0) + d / pair.dt
        for key, value in pair.series(SEND_QUEUE).items():
            r = row(pair, _labels(key))
            r["send_queue_bytes"] = (r["send_queue_bytes"] or 0.0) + value
        for key in pair.series(PEER_WAIT):
            d = pair.delta(PEER_WAIT, key)
            if d is not None:
                r = row(pair, _labels(key))
                r["waited_per_second"] = (r["waited_per_second"] or 0.0) + d / pair.dt
    out, hidden = [], 0
    for (host, rank, peer), r in sorted(rows.items(), key=lambda kv: (
            _rank_sort(kv[0][1]), kv[0][0], _peer_sort(kv[0][2]))):
        if not (show_all or (r["retransmits_per_second"] or 0) > 0
                or (r["send_queue_bytes"] or 0) > 0 or (r["waited_per_second"] or 0) >= 0.01):
            hidden += 1
            continue
        out.append({"host": host, "rank": rank, "peer": _rank_value(peer), **r})
    return {"peers": out, "peers_hidden": hidden}


def _link_rates(pairs: list[_Pair], show_all: bool) -> dict:
    """Each connection's rate while sending and its ratio to its siblings (gauges of the
    ranks' slow-link watch, transport/slowlink.py): the slow ones, or all with ``show_all``."""
    rows: dict[tuple, dict] = {}
    for pair in pairs:
        for name, field_ in ((LINK_RATE, "bytes_per_second"), (LINK_RATIO, "ratio"),
                             (SLOW_LINK, "slow")):
            for key, value in pair.series(name).items():
                labels = _labels(key)
                host, rank = pair.ident(labels)
                r = rows.setdefault((host, rank, labels.get("peer", "?"),
                                     labels.get("interface", "?"), labels.get("connection", "?")),
                                    {"bytes_per_second": None, "ratio": None, "slow": None})
                r[field_] = bool(value) if field_ == "slow" else value
    out, hidden, slow = [], 0, 0
    for (host, rank, peer, iface, conn), r in sorted(rows.items(), key=lambda kv: (
            _rank_sort(kv[0][1]), kv[0][0], _peer_sort(kv[0][2]), kv[0][3],
            _peer_sort(kv[0][4]))):
        slow += bool(r["slow"])
        if not (show_all or r["slow"]):
            hidden += 1
            continue
        out.append({"host": host, "rank": rank, "peer": _rank_value(peer), "interface": iface,
                    "connection": _rank_value(conn),
                    "bits_per_second": (r["bytes_per_second"] * 8
                                        if r["bytes_per_second"] is not None else None),
                    **r})
    return {"link_rates": out, "link_rates_hidden": hidden, "slow_links": slow}


def format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


# ----------------------------------------------------------------------------- rendering
def _scaled(value: float, units: tuple[str, ...], base: float) -> str:
    i = 0
    while abs(value) >= base * 0.9995 and i < len(units) - 1:  # 999.96 -> "1.00 G", not "1000 M"
        value /= base
        i += 1
    if value == 0:
        text = "0"
    elif abs(value) >= 99.95:
        text = f"{value:.0f}"
    elif abs(value) >= 9.995:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {units[i]}"


def format_bits(bytes_per_second: float | None) -> str:
    """A byte rate in bits per second, decimal units (links are rated in Gbit/s)."""
    if bytes_per_second is None:
        return "-"
    return _scaled(bytes_per_second * 8, ("bit/s", "kbit/s", "Mbit/s", "Gbit/s", "Tbit/s"), 1e3)


def format_byte_rate(bytes_per_second: float | None) -> str:
    """A byte rate, decimal units (as nccl-tests' and linerate bench's GB/s)."""
    if bytes_per_second is None:
        return "-"
    return _scaled(bytes_per_second, ("B/s", "kB/s", "MB/s", "GB/s", "TB/s"), 1e3)


def format_bytes(n: float | None) -> str:
    """A size, binary units (messages and queues are powers of two)."""
    if n is None:
        return "-"
    return _scaled(n, ("B", "KiB", "MiB", "GiB", "TiB"), 1024.0)


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale * 0.9995:
            return _scaled(s / scale, (unit,), 1e300)
    return _scaled(s / 1e-9, ("ns",), 1e300)


def format_rate(per_second: float | None) -> str:
    if per_second is None:
        return "-"
    return f"{per_second:.1f}" if per_second < 1e5 else f"{per_second:.3g}"


def format_percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def bar(ratio: float | None, width: int = BAR_WIDTH) -> str:
    """``[#####     ]``; full (and ``!`` at the end) above 100 %, empty string when unknown."""
    if ratio is None:
        return ""
    filled = max(0, min(width, round(ratio * width)))
    inside = "#" * filled + " " * (width - filled)
    if ratio > OVER_CAPACITY:
        inside = inside[:-1] + "!"
    return f"[{inside}]"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(header)] + [line(r) for r in rows]


def _host(host: str, limit: int = 24) -> str:
    return host if len(host) <= limit else host[:limit - 1] + "~"


def _rank(rank) -> str:
    return "?" if rank is None else str(rank)


def render(frame: dict) -> str:
    """The text of one frame (no terminal control sequences)."""
    eps = frame["endpoints"]
    stamp = time.strftime("%H:%M:%S", time.localtime(frame["time"]))
    every = frame["interval_seconds"]
    head = (f"linerate top  {stamp}  {frame['up']}/{len(eps)} endpoints up"
            + (f"  rates over {every:.2f} s" if every is not None else "  (no rates yet)"))
    infos = {tuple(sorted(e["info"].items())) for e in eps if e["up"] and e["info"]}
    if len(infos) == 1:
        head += "  " + " ".join(f"{k}={v}" for k, v in next(iter(infos)))
    elif len(infos) > 1:
        head += "  (ranks differ in linerate_info: see --json)"
    lines = [head]
    late = frame.get("late_rank")
    if late is not None:
        if late["rank"] is None:
            lines.append(f"SLOW RANK  none named ({late['watched']} rank(s) watching, "
                         f"{late['collectives']:,} collectives in the window)")
        else:
            text = f"SLOW RANK  rank {late['rank']}"
            if late.get("share") is not None:
                text += f" entered last in {100 * late['share']:.0f}% of the last " \
                        f"{late['collectives']:,} collectives"
            if late.get("mean_late_seconds") is not None:
                text += f", {late['mean_late_seconds'] * 1e3:.1f} ms late on average"
            text += f"  (named by {late['named_by']}/{late['watched']} ranks)"
            lines.append(text)
    lines.append("")

    links = frame["links"]
    if links:
        rows = [[_host(r["host"]), _rank(r["rank"]), r["interface"], r["direction"],
                 format_bits(r["bytes_per_second"]), format_byte_rate(r["bytes_per_second"]),
                 format_bits(r["capacity_bytes_per_second"]), format_percent(r["utilization"]),
                 bar(r["utilization"]) + ("  (gauge)" if r["utilization_source"] == "gauge"
                                          else "")
                 + (f"  {r['note']}" if r.get("note") else "")]
                for r in links]
        lines += _table(["LINK HOST", "RANK", "IFACE", "DIR", "RATE", "BYTES", "CAPACITY",
                         "UTIL", ""], rows, right={1, 4, 5, 6, 7})
    else:
        lines.append("LINKS  none reported yet")
    rates = frame.get("link_rates") or []
    if rates:
        rows = [[_host(r["host"]), _rank(r["rank"]), str(r["peer"]), r["interface"],
                 str(r["connection"]), format_bits(r["bytes_per_second"]),
                 format_byte_rate(r["bytes_per_second"]), format_ratio(r["ratio"]),
                 "SLOW" if r["slow"] else ""] for r in rates]
        lines.append("")
        lines += _table(["CONN HOST", "RANK", "PEER", "IFACE", "CONN", "RATE SENDING", "BYTES",
                         "VS SIBLINGS", ""], rows, right={1, 2, 4, 5, 6, 7})
    hidden = frame.get("link_rates_hidden") or 0
    if hidden:
        nslow = frame.get("slow_links") or 0
        lines.append(f"{len(rates) + hidden} connection rate(s) measured, "
                     f"{nslow or 'none'} slow (--all lists every one)")
    lines.append("")

    ops = frame["ops"]
    if ops:
        rows = [[r["op"], str(r["ranks"]), format_rate(r["collectives_per_second"]),
                 format_seconds(r["mean_latency_seconds"]), format_seconds(r["p99_seconds"]),
                 format_bytes(r["mean_size_bytes"]),
                 format_byte_rate(r["busbw_min_bytes_per_second"]),
                 format_byte_rate(r["busbw_max_bytes_per_second"])] for r in ops]
        lines += _table(["COLLECTIVE", "RANKS", "OPS/S", "MEAN LAT", "P99 LAT", "MEAN SIZE",
                         "BUSBW MIN", "BUSBW MAX"], rows, right={1, 2, 3, 4, 5, 6, 7})
        s = frame["slowest"]
        if s:
            lines.append(f"slowest: {s['op']} on rank {_rank(s['rank'])} ({s['host']})  "
                         f"mean {format_seconds(s['mean_latency_seconds'])}  "
                         f"p99 {format_seconds(s['p99_seconds'])}")
    else:
        lines.append("COLLECTIVES  none reported yet")
    lines.append("")

    peers = frame["peers"]
    if peers:
        rows = [[_host(r["host"]), _rank(r["rank"]), str(r["peer"]),
                 format_rate(r["retransmits_per_second"]), format_bytes(r["send_queue_bytes"]),
                 format_percent(r.get("waited_per_second"))]
                for r in peers]
        lines += _table(["PEER HOST", "RANK", "PEER", "RETRANS/S", "SEND QUEUE", "WAITED"], rows,
                        right={1, 2, 3, 4, 5})
    if frame["peers_hidden"]:
        lines.append(f"{'' if peers else 'PEERS  '}{frame['peers_hidden']} peer(s) without "
                     "retransmits, queued bytes or waits not shown (--all)")
    elif not peers:
        lines.append("PEERS  none reported yet")

    down = [e for e in eps if not e["up"]]
    empty = [e for e in eps if e["up"] and not e["series"]]
    if down or empty:
        lines.append("")
        width = max(len(e["url"]) for e in down + empty)
        lines += [f"DOWN   {e['url']:<{width}}  {e['error']}" for e in down]
        lines += [f"EMPTY  {e['url']:<{width}}  answers, but with no linerate_* series"
                  for e in empty]
    return "\n".join(lines) + "\n"


def fit(text: str, columns: int, rows: int) -> str:
    """Cut a frame to the terminal: long lines are truncated, extra lines dropped (and said)."""
    lines = text.rstrip("\n").split("\n")
    if rows > 1 and len(lines) > rows - 1:
        cut = len(lines) - (rows - 2)
        lines = lines[:rows - 2] + [f"... {cut} more lines (a larger terminal, or --json)"]
    return "\n".join(line[:max(columns - 1, 1)] for line in lines) + "\n"


# ----------------------------------------------------------------------------- command
def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "top", help="live view of the ranks' metrics (links, collectives, peers)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("endpoints", nargs="*", metavar="ENDPOINT", type=_endpoint,
                        help=f"HOST:PORT, HOST:PORT1-PORT2 or a URL (default {DEFAULT_ENDPOINT})")
    parser.add_argument("--interval", type=_positive_float, default=DEFAULT_INTERVAL,
                        help=f"seconds between refreshes (default {DEFAULT_INTERVAL:g})")
    parser.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT,
                        help=f"seconds one scrape may take (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--once", action="store_true",
                        help="print one frame (two scrapes --interval apart) and exit; exit "
                             "status 1 when no endpoint answered")
    parser.add_argument("--count", type=_positive_int, default=None,
                        help="print this many frames, then exit")
    parser.add_argument("--json", action="store_true",
                        help="print each frame as one line of JSON instead of a table")
    parser.add_argument("--all", action="store_true",
                        help="list every peer, also those without retransmits, queued bytes "
                             "or waits, and every measured connection's rate, also those not "
                             "slow")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    groups = args.endpoints or [parse_endpoint(DEFAULT_ENDPOINT)]
    urls = list(dict.fromkeys(url for group in groups for url in group))
    frames = 1 if args.once else args.count
    live = not args.json and frames != 1 and sys.stdout.isatty()
    pool = ThreadPoolExecutor(max_workers=min(MAX_THREADS, len(urls)),
                              thread_name_prefix="linerate-top")
    frame = None
    # Ctrl-C ends the loop at the next frame boundary (at most one scrape's timeout later): a
    # KeyboardInterrupt raised anywhere could land inside the pool's submit, holding its locks,
    # and the interpreter's exit would then wait on them for ever.
    stop = threading.Event()
    old = (signal.signal(signal.SIGINT, lambda *_: stop.set())
           if threading.current_thread() is threading.main_thread() else None)
    try:
        if live:
            sys.stdout.write(f"\x1b[H\x1b[2Jlinerate top: scraping {len(urls)} endpoint(s) "
                             f"every {args.interval:g} s ...\n")
            sys.stdout.flush()
        next_t = time.monotonic()
        prev = scrape_all(pool, urls, args.timeout)
        shown = 0
        while (frames is None or shown < frames) and not stop.is_set():
            next_t += args.interval
            if stop.wait(max(0.0, next_t - time.monotonic())):
                break
            next_t = max(next_t, time.monotonic() - args.interval)  # after a stall: no burst
            cur = scrape_all(pool, urls, args.timeout)
            if stop.is_set():
                break
            frame = compute_frame(prev, cur, show_all=args.all)
            prev = cur
            shown += 1
            _emit(frame, args, live)
    except BrokenPipeError:  # `linerate top | head`: the reader left, which is fine
        _silence_stdout()
        return 0
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
        pool.shutdown(wait=False, cancel_futures=True)
    if stop.is_set():
        if live:
            sys.stdout.write("\n")
        return 0
    return 0 if frame is not None and frame["up"] > 0 else 1


def _emit(frame: dict, args: argparse.Namespace, live: bool) -> None:
    if args.json:
        sys.stdout.write(json.dumps(frame, allow_nan=False) + "\n")
    elif live:
        size = shutil.get_terminal_size()
        text = fit(render(frame), size.columns, size.lines)
        # home, each line over the old one (erase to its end), erase what is left below
        sys.stdout.write("\x1b[H" + text.replace("\n", "\x1b[K\n") + "\x1b[J")
    else:
        sys.stdout.write(render(frame)
                         + ("" if args.once or args.count == 1 else "\n"))
    sys.stdout.flush()


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


def _endpoint(text: str) -> list[str]:
    try:
        return parse_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    x = float(text)
    if not x > 0 or math.isinf(x):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return x


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return n
