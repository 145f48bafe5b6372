"""Slow links: each TCP connection's rate while it was sending, against its siblings' and its
capacity, and the host and rail that a group's measurements point at.

What one rank measures (``LinkRates.sample``, from ``Context.stats()``; nothing on the data
path): for each TCP connection, the kernel's TCP_INFO (transport/link.py ``tcp_info``) gives
the bytes the peer acknowledged and the time the connection had data in flight or queued
(``busy_us``), of which the peer's receive window held it back for ``rwnd_limited_us`` (the
receiver's doing, not the link's). Between two samples,

    rate = Δ bytes_acked / Δ (busy_us - rwnd_limited_us)

is what the path carried while linerate gave it something to carry: idle time between
collectives does not dilute it. Where the interface's capacity is known, a rate above it (the
busy time is counted in jiffies, and under load a connection's busy time comes out short) is
judged as the capacity. A connection is measured only when it moved at least
``MIN_BYTES`` in at least ``MIN_BUSY_S`` since the previous sample (a few small messages are
bound by round trips, and the kernel counts busy time in jiffies, 1 to 10 ms). Its ratio is
its rate over the median rate of its siblings, the rank's other connections measured in the
same sample (every peer, every rail). The ratio is smoothed per connection (``SMOOTHING``); a
connection is slow once ``CONFIRM`` samples in a row were below ``LINERATE_SLOW_LINK_RATIO``
and the smoothed ratio is too, and stays slow until the smoothed ratio is back above it: one
noisy sample names nobody.

One rank cannot tell which end of a slow connection is at fault. :func:`group_verdict` takes
every rank's rows and names a (host, rail) when most of the measured connections through it
are slow: the host's own connections on that rail and the other hosts' connections to it on
the same rail. Every rank computing it from the same rows gets the same answer.
:func:`encode` / :func:`decode` carry a rank's rows as plain JSON data (lists, numbers,
strings; nothing is ever unpickled).

Exported from the latest sample of every live ``LinkRates`` (labels ``rank``, ``host`` of the
exporter, ``peer`` (global rank), ``interface``, ``connection``):
``linerate_link_rate_bytes_per_second``, ``linerate_link_rate_ratio`` (smoothed, to the
siblings' median) and ``linerate_slow_link`` (1 slow, else 0).
"""
from __future__ import annotations

import math
import threading
import weakref

from prometheus_client.core import GaugeMetricFamily

from linerate import settings
from linerate.transport import metrics

__all__ = ["LinkRates", "group_verdict", "encode", "decode", "measure", "median",
           "MIN_BYTES", "MIN_BUSY_S", "SMOOTHING", "CONFIRM", "FIELDS"]

#: A connection is measured in a sample only when it moved at least this many bytes...
MIN_BYTES = 1 << 20
#: ... in at least this much busy time (the kernel counts it in jiffies: 4 ms at HZ=250).
MIN_BUSY_S = 0.010
#: Weight of a new sample in the smoothed ratio.
SMOOTHING = 0.5
#: Samples in a row below the threshold before a connection is named slow.
CONFIRM = 2
#: A sample's ratio is capped here before smoothing (a connection far faster than its siblings
#: would otherwise take many samples to look slow once it is).
RATIO_CAP = 2.0
#: group_verdict: share of the measured connections through a (host, rail) that must be slow.
SHARE = 0.5
#: Most rows ``decode`` accepts, and longest string in one.
MAX_ROWS = 1 << 14
MAX_TEXT = 255

#: The row fields, in the order ``encode`` writes them.
FIELDS = ("peer", "peer_host", "interface", "rail", "connection", "rate", "ratio",
          "capacity_ratio", "slow", "samples")

_live: "weakref.WeakSet[LinkRates]" = weakref.WeakSet()
_live_lock = threading.Lock()


def median(values) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2.0


def measure(before: dict | None, after: dict) -> float | None:
    """Bytes per second a connection carried while busy between two ``tcp_info`` readings,
    or None when it moved too little to tell (or the readings are not of one connection)."""
    need = ("bytes_acked", "busy_us", "rwnd_limited_us")
    if before is None or any(k not in before or k not in after for k in need):
        return None
    nbytes = after["bytes_acked"] - before["bytes_acked"]
    busy = ((after["busy_us"] - after["rwnd_limited_us"])
            - (before["busy_us"] - before["rwnd_limited_us"])) / 1e6
    if nbytes < MIN_BYTES or busy < MIN_BUSY_S:
        return None
    return nbytes / busy


class _Conn:
    """One connection's smoothed state."""

    __slots__ = ("info", "rate", "ratio", "capacity_ratio", "low", "slow", "samples",
                 "interface", "rail")

    def __init__(self):
        self.info = None
        self.rate = None
        self.ratio = None
        self.capacity_ratio = None
        self.low = 0
        self.slow = False
        self.samples = 0
        self.interface = "unknown"
        self.rail = None

    def judge(self, ratio: float, threshold: float) -> None:
        r = min(ratio, RATIO_CAP)
        self.ratio = r if self.ratio is None else self.ratio + SMOOTHING * (r - self.ratio)
        self.samples += 1
        self.low = self.low + 1 if r < threshold else 0
        below = self.ratio < threshold
        self.slow = below if self.slow else below and self.low >= CONFIRM


class LinkRates:
    """The rates of one process group's TCP connections (see the module doc).

    ``ctx``: the group's transport Context. ``host_of``: global rank -> host name, for the
    rows' ``peer_host`` (None: left None; :func:`group_verdict` takes the peers' hosts from
    their own views). ``threshold``: default LINERATE_SLOW_LINK_RATIO, read here."""

    def __init__(self, ctx, host_of=None, threshold: float | None = None):
        self.ctx = ctx
        self.host_of = host_of
        self.threshold = (settings.read("LINERATE_SLOW_LINK_RATIO") if threshold is None
                          else float(threshold))
        self._conns: dict[tuple, _Conn] = {}
        self._lock = threading.Lock()
        #: The rows of the latest sample (what the exporter shows).
        self.rows: list[dict] = []
        with _live_lock:
            _live.add(self)

    def sample(self, stats: dict | None = None) -> list[dict]:
        """Measure every TCP connection since the previous call (``stats``: a
        ``Context.stats()`` snapshot; default: taken now) and return the rows of every
        connection measured at least once: ``peer`` (global rank), ``peer_host`` (or None),
        ``interface`` (this side's, as the metrics name it), ``rail`` (index of that address
        among the group's rails, or None), ``connection`` (its index), ``rate`` (bytes/s, the
        last measured), ``ratio`` (smoothed, to the siblings' median; None while it never had
        a sibling), ``capacity_ratio`` (last rate over the interface's capacity, or None),
        ``slow`` (bool), ``samples`` (samples that judged it)."""
        snap = self.ctx.stats() if stats is None else stats
        with self._lock:
            rows = self._sample(snap)
            self.rows = rows
        return rows

    def _sample(self, snap: dict) -> list[dict]:
        seen, measured = set(), []
        for p in snap.get("peers", ()):
            peer = p.get("global_peer", p.get("peer"))
            for link in p.get("links", ()):
                for c in link.get("connections", ()):
                    info = c.get("tcp")
                    if not info:
                        continue
                    key = (peer, c.get("index"), c.get("local"), c.get("remote"))
                    seen.add(key)
                    st = self._conns.get(key)
                    if st is None:
                        st = self._conns[key] = _Conn()
                        st.interface = _interface(c)
                        st.rail = self._rail(c.get("local"))
                    rate = measure(st.info, info)  # None too where the counters went back
                    st.info = info
                    if rate is not None:
                        measured.append((key, st, rate))
        for key in [k for k in self._conns if k not in seen]:  # gone with its link
            del self._conns[key]
        caps: dict[str, float | None] = {}
        judged = []  # each rate as judged: at most its interface's capacity
        for key, st, rate in measured:
            st.rate = rate
            if st.interface not in caps:
                caps[st.interface] = _capacity(st.interface)
            cap = caps[st.interface]
            st.capacity_ratio = rate / cap if cap else None
            # A rate above the capacity is the busy time's coarse count (jiffies), not the
            # path: judged as the capacity, it cannot make a sibling at the line look slow.
            judged.append(min(rate, cap) if cap else rate)
        for i, (key, st, rate) in enumerate(measured):
            siblings = [r for j, r in enumerate(judged) if j != i]
            if siblings:
                ref = median(siblings)
                if ref > 0:
                    st.judge(judged[i] / ref, self.threshold)
        rows = []
        for (peer, index, _, _), st in sorted(self._conns.items(), key=_key_sort):
            if st.rate is None:
                continue
            rows.append({"peer": peer,
                         "peer_host": self._host(peer),
                         "interface": st.interface, "rail": st.rail, "connection": index,
                         "rate": st.rate, "ratio": st.ratio, "capacity_ratio": st.capacity_ratio,
                         "slow": st.slow, "samples": st.samples})
        return rows

    def _host(self, peer) -> str | None:
        if self.host_of is None:
            return None
        try:
            h = self.host_of(peer)
        except Exception:  # noqa: BLE001 - a name is a nicety
            return None
        return None if h is None else str(h)

    def _rail(self, local) -> int | None:
        try:
            addrs = list(getattr(self.ctx, "addresses", None) or ())
        except Exception:  # noqa: BLE001 - the rails are a nicety too
            return None
        return addrs.index(local) if local in addrs else None

    def slow(self) -> list[dict]:
        """The rows of the latest sample that are slow."""
        return [r for r in self.rows if r["slow"]]


def _key_sort(item) -> tuple:
    peer, index, local, remote = item[0]
    return (peer, index if isinstance(index, int) else -1, str(local), str(remote))


def _interface(conn: dict) -> str:
    try:
        return metrics.conn_interface(conn)
    except Exception:  # noqa: BLE001 - a fabricated or odd connection record
        return "unknown"


def _capacity(ifname: str) -> float | None:
    try:
        cap = metrics.link_capacity(ifname)
    except (ValueError, OSError):  # a bad LINERATE_LINK_CAPACITY: the exporter reports it
        return None
    return cap if cap and cap > 0 else None


# ----------------------------------------------------------------------------- encoding
def encode(rows: list[dict]) -> list:
    """A rank's rows as plain JSON data: one list per row, the fields in ``FIELDS`` order
    (rates in whole bytes/s, ratios to 4 decimals, ``slow`` 0/1)."""
    out = []
    for r in rows:
        out.append([r["peer"], r["peer_host"], r["interface"], r["rail"], r["connection"],
                    _round(r["rate"], 0), _round(r["ratio"], 4), _round(r["capacity_ratio"], 4),
                    1 if r["slow"] else 0, r["samples"]])
    return out


def _round(v, digits: int):
    if v is None or not math.isfinite(v):
        return None
    return int(round(v)) if digits == 0 else round(float(v), digits)


def _is_int(v) -> bool:
    return type(v) is int and -(1 << 62) < v < 1 << 62


def _is_num(v) -> bool:
    return (type(v) is int and -(1 << 62) < v < 1 << 62) or (type(v) is float
                                                               and math.isfinite(v))


def _text_or_none(v) -> bool:
    return v is None or (isinstance(v, str) and len(v) <= MAX_TEXT)


def decode(data) -> list[dict]:
    """The rows ``encode`` wrote (after a JSON round trip); anything else raises ValueError."""
    if not isinstance(data, list) or len(data) > MAX_ROWS:
        raise ValueError("slow-link rows: expected a list of at most "
                         f"{MAX_ROWS} rows")
    rows = []
    for e in data:
        if not (isinstance(e, list) and len(e) == len(FIELDS)):
            raise ValueError(f"slow-link rows: a row of {len(FIELDS)} fields expected")
        peer, peer_host, iface, rail, conn, rate, ratio, cap, slow, samples = e
        if not (_is_int(peer) and _text_or_none(peer_host) and isinstance(iface, str)
                and len(iface) <= MAX_TEXT and (rail is None or (_is_int(rail) and rail >= 0))
                and _is_int(conn) and _is_num(rate) and rate >= 0
                and (ratio is None or (_is_num(ratio) and ratio >= 0))
                and (cap is None or (_is_num(cap) and cap >= 0))
                and slow in (0, 1) and type(slow) is int and _is_int(samples) and samples >= 0):
            raise ValueError(f"slow-link rows: a malformed row {str(e)[:200]}")
        rows.append({"peer": peer, "peer_host": peer_host, "interface": iface, "rail": rail,
                     "connection": conn, "rate": float(rate),
                     "ratio": None if ratio is None else float(ratio),
                     "capacity_ratio": None if cap is None else float(cap),
                     "slow": bool(slow), "samples": samples})
    return rows


# ----------------------------------------------------------------------------- the verdict
def _rail_key(row: dict) -> tuple:
    """A sortable key of a row's rail: its index among the rails, else its interface name."""
    rail = row.get("rail")
    return (0, rail, "") if rail is not None else (1, 0, str(row.get("interface")))


def _rail_text(key: tuple) -> str:
    return f"rail {key[1]}" if key[0] == 0 else f"interface {key[2]}"


def group_verdict(views: dict) -> list[dict]:
    """The slow links that every rank's rows point at.

    ``views``: global rank -> (host, rows) (rows as ``LinkRates.sample`` returns them, or
    ``decode`` of their encoding), from every rank of a group that could send one. Each
    measured connection (a row with a ratio) runs through two (host, rail) places: its
    rank's host and its peer's host (the row's ``peer_host``, else the host of the peer's own
    view), on the connection's rail. A place is named when at least ``SHARE`` of the measured
    connections through it are slow and it accounts for slow connections that no place named
    before it did; places are taken most slow share first, then most slow connections, then
    by host and rail (so the answer depends on the views only). Returns, in that order,
    dicts: ``host``, ``interface`` (the host's own name of the rail, else its peers'),
    ``rail`` (index or None), ``slow`` and ``measured`` (connections through the place),
    ``ratio`` (median smoothed ratio of its slow ones), ``also`` (hosts that the same
    evidence points at as strongly: the measured connections cannot tell them apart) and
    ``evidence`` (one line of text)."""
    hosts = {r: str(v[0]) for r, v in views.items()}
    edges = []  # (rank, host, peer, peer host, rail key, row)
    for rank in sorted(views, key=lambda r: (str(type(r)), r)):
        host, rows = views[rank]
        for row in rows:
            if row.get("ratio") is None:
                continue
            peer_host = row.get("peer_host") or hosts.get(row["peer"])
            edges.append((rank, str(host), row["peer"], peer_host, _rail_key(row), row))
    through: dict[tuple, list[int]] = {}
    for i, (_, host, _, peer_host, rail, _) in enumerate(edges):
        through.setdefault((host, rail), []).append(i)
        if peer_host is not None and peer_host != host:
            through.setdefault((peer_host, rail), []).append(i)
    slow = {i for i, e in enumerate(edges) if e[5].get("slow")}
    left = set(slow)
    named = []
    while left:
        best, best_key, best_left = None, None, None
        ties = []
        for place in sorted(through):
            idx = through[place]
            nslow = sum(1 for i in idx if i in slow)
            share = nslow / len(idx)
            mine = frozenset(i for i in idx if i in left)
            if not mine or share < SHARE:
                continue
            key = (-share, -len(mine))
            if best is None or key < best_key:
                best, best_key, best_left, ties = place, key, mine, []
            elif key == best_key and mine == best_left:
                ties.append(place[0])
        if best is None:
            break
        left -= best_left
        named.append(_name(best, through[best], slow, edges, sorted(set(ties))))
    return named


def _name(place: tuple, idx: list[int], slow: set, edges: list, also: list) -> dict:
    host, rail = place
    own = sorted({e[5]["interface"] for e in (edges[i] for i in idx) if e[1] == host})
    other = sorted({e[5]["interface"] for e in (edges[i] for i in idx) if e[1] != host})
    iface = (own or other or ["?"])[0]
    bad = [edges[i] for i in idx if i in slow]
    ratio = median([e[5]["ratio"] for e in bad])
    rate = median([e[5]["rate"] for e in bad])
    caps = [e[5]["capacity_ratio"] for e in bad if e[5].get("capacity_ratio") is not None]
    pairs = sorted({(e[0], e[2]) for e in bad}, key=lambda x: (str(x[0]), str(x[1])))
    shown = ", ".join(f"{a}->{b}" for a, b in pairs[:6]) + (" ..." if len(pairs) > 6 else "")
    text = (f"slow link: host {host} {iface} ({_rail_text(rail)}): {len(bad)} of {len(idx)} "
            f"connections measured through it are slow, at {ratio:.2f}x their siblings' rate "
            f"({rate / 1e6:.1f} MB/s"
            + (f", {100 * median(caps):.0f}% of capacity" if caps else "")
            + f"; ranks {shown})"
            + (f"; the same evidence points at {', '.join(also)}" if also else ""))
    return {"host": host, "interface": iface, "rail": rail[1] if rail[0] == 0 else None,
            "slow": len(bad), "measured": len(idx), "ratio": ratio, "also": also,
            "evidence": text}


# ----------------------------------------------------------------------------- export
class _Collector:
    def collect(self):
        labels = ["rank", "host", "peer", "interface", "connection"]
        rate = GaugeMetricFamily("linerate_link_rate_bytes_per_second",
                                 "Rate of a TCP connection while it had data to send "
                                 "(TCP_INFO: bytes acknowledged over busy time)", labels=labels)
        ratio = GaugeMetricFamily("linerate_link_rate_ratio",
                                  "A connection's rate over the median of its rank's other "
                                  "measured connections (smoothed)", labels=labels)
        slow = GaugeMetricFamily("linerate_slow_link",
                                 "1 when a connection runs markedly slower than its siblings "
                                 "(LINERATE_SLOW_LINK_RATIO)", labels=labels)
        with _live_lock:
            live = list(_live)
        best: dict[tuple, dict] = {}
        for lr in live:
            for row in lr.rows:
                key = (str(row["peer"]), row["interface"], str(row["connection"]))
                old = best.get(key)
                # Several groups' connections under one label set: show the worst.
                if old is None or _worse(row, old):
                    best[key] = row
        if best:
            ids = list(metrics.identity())
            for key in sorted(best):
                row = best[key]
                rate.add_metric(ids + list(key), row["rate"])
                if row["ratio"] is not None:
                    ratio.add_metric(ids + list(key), row["ratio"])
                slow.add_metric(ids + list(key), 1.0 if row["slow"] else 0.0)
        yield rate
        yield ratio
        yield slow


def _worse(a: dict, b: dict) -> bool:
    if a["slow"] != b["slow"]:
        return a["slow"]
    ra = a["ratio"] if a["ratio"] is not None else math.inf
    rb = b["ratio"] if b["ratio"] is not None else math.inf
    return ra < rb


metrics.REGISTRY.register(_Collector())
