"""What ``linerate bench`` prints (an nccl-tests style table) and writes (``--json``)."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    """One backend's figures for one (op, size) row."""
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    iters: int
    wrong: int | None = None  # elements that differed on the first call (max over ranks), with --check

    @classmethod
    def from_time(cls, nbytes: int, bus_factor: float, seconds: float, iters: int,
                  wrong: int | None) -> "Result":
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        return cls(seconds * 1e6, algbw, algbw * bus_factor, iters, wrong)


@dataclass
class Row:
    op: str
    size_bytes: int
    count: int
    dtype: str
    results: list[Result] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """busbw of the first backend over the second (when exactly two are compared)."""
        if len(self.results) != 2 or self.results[1].busbw_gbps <= 0:
            return None
        return self.results[0].busbw_gbps / self.results[1].busbw_gbps


_LEFT = (("size(B)", 12), ("count", 12), ("type", 9), ("op", 15))
_SEP = " |"


def utilization(busbw_gbps: float, capacity_gbit_s: float | None) -> float | None:
    """busbw (GB/s) as a fraction of the raw link capacity (Gbit/s)."""
    if not capacity_gbit_s:
        return None
    return busbw_gbps * 8 / capacity_gbit_s


class Table:
    def __init__(self, labels: list[str], check: bool, capacity_gbit_s: float | None = None):
        """``capacity_gbit_s`` (from --raw) adds busbw in Gbit/s and util = busbw / capacity."""
        self.labels = labels
        self.check = check
        self.capacity = capacity_gbit_s
        self.per = [("time(us)", 10), ("algbw(GB/s)", 12), ("busbw(GB/s)", 12)]
        if capacity_gbit_s:
            self.per += [("busbw(Gb/s)", 12), ("util", 7)]
        if check:
            self.per.append(("#wrong", 7))
        self.with_ratio = len(labels) == 2

    def header(self) -> list[str]:
        left_w = sum(w for _, w in _LEFT)
        block_w = sum(w for _, w in self.per)
        groups = "#" + " " * (left_w - 1)
        names = "".join(f"{n:>{w}}" for n, w in _LEFT)
        names = "#" + names[1:]
        for label in self.labels:
            groups += _SEP + f"{label:^{block_w}}"
            names += _SEP + "".join(f"{n:>{w}}" for n, w in self.per)
        if self.with_ratio:
            groups += _SEP + f"{'busbw':>7}"
            names += _SEP + f"{'ratio':>7}"
        return [groups.rstrip(), names]

    def row(self, row: Row) -> str:
        line = f"{row.size_bytes:>12}{row.count:>12}{row.dtype:>9}{row.op:>15}"
        for r in row.results:
            line += _SEP + f"{r.time_us:>10.1f}{r.algbw_gbps:>12.3f}{r.busbw_gbps:>12.3f}"
            if self.capacity:
                util = utilization(r.busbw_gbps, self.capacity)
                line += f"{r.busbw_gbps * 8:>12.2f}{util:>7.1%}"
            if self.check:
                line += f"{r.wrong:>7}"
        if self.with_ratio:
            ratio = row.ratio
            line += _SEP + (f"{ratio:>7.2f}" if ratio is not None else f"{'-':>7}")
        return line

    def footer(self, rows: list[Row]) -> list[str]:
        avgs = average_busbw(self.labels, rows)
        pair = "/".join(self.labels)
        width = max(len(label) for label in self.labels + ([pair] if self.with_ratio else []))
        lines = []
        for label in self.labels:
            line = f"# avg bus bandwidth  {label:<{width}} : {avgs[label]:.3f} GB/s"
            if self.capacity:
                line += (f" = {avgs[label] * 8:.2f} Gbit/s, "
                         f"{utilization(avgs[label], self.capacity):.1%} of the raw link capacity")
            lines.append(line)
        if self.with_ratio and avgs[self.labels[1]] > 0:
            a, b = self.labels
            lines.append(f"# avg busbw ratio    {pair:<{width}} : {avgs[a] / avgs[b]:.2f}")
        if self.check:
            wrong = total_wrong(rows)
            lines.append("# check: all results correct" if wrong == 0 else
                         f"# check FAILED: {wrong} wrong elements (see the #wrong columns)")
        return lines


def average_busbw(labels: list[str], rows: list[Row]) -> dict[str, float]:
    out = {}
    for i, label in enumerate(labels):
        vals = [row.results[i].busbw_gbps for row in rows]
        out[label] = sum(vals) / len(vals) if vals else 0.0
    return out


def total_wrong(rows: list[Row]) -> int:
    return sum(r.wrong or 0 for row in rows for r in row.results)


def describe_hosts(hosts: list[str]) -> str:
    """``["a", "a", "b"]`` -> ``"a (2 ranks), b (1 rank)"``."""
    return ", ".join(f"{h} ({n} rank{'s' if n > 1 else ''})" for h, n in Counter(hosts).items())


def link_lines(label: str, per_rank: list[dict]) -> list[str]:
    """Per (rank, peer) bytes moved by one linerate group during the benchmark, then per
    (rank, interface) the bytes of the utilization, their rates and the utilization
    (``interface_lines``).

    Every line starts with '#', so that the only other lines of the output are the table's rows."""
    lines = [f"# {label} links: bytes moved during the benchmark; rate = sent / time this rank "
             "spent in its collectives; balance = min/max bytes over the peer's connections",
             f"#{'rank':>5}{'peer':>6}{'conns':>7}{'sent(B)':>15}{'received(B)':>15}"
             f"{'rate(GB/s)':>12}{'balance':>9}"]
    for entry in per_rank:
        busy = entry["busy_s"]
        for link in entry["links"]:
            rate = link["sent_bytes"] / busy / 1e9 if busy > 0 else 0.0
            sent = [c["sent_bytes"] for c in link["connections"]]
            balance = min(sent) / max(sent) if sent and max(sent) > 0 else 0.0
            lines.append(f"#{entry['rank']:>5}{link['peer']:>6}{len(sent):>7}"
                         f"{link['sent_bytes']:>15}{link['received_bytes']:>15}"
                         f"{rate:>12.3f}{balance:>9.2f}")
    lines += interface_lines(label, per_rank)
    if per_rank and all(e.get("shared_memory") for e in per_rank):
        lines.append(f"# {label}: the ranks of this host share memory (LINERATE_SHM): these "
                     "are the bytes its collectives and messages moved through it (one "
                     "connection per peer, interface shm: sent = bytes a rank wrote for the "
                     "peer to read, for each peer that read them, received = bytes it read of "
                     "the peer's; the interfaces table counts a byte written for several peers "
                     "once), not TCP bytes; LINERATE_SHM=0 measures the TCP path")
    return lines


def interface_lines(label: str, per_rank: list[dict]) -> list[str]:
    """Per (rank, interface) the bytes moved during the benchmark as the exporter's
    utilization counts them (linerate_interface_bytes_total: for ``shm`` a byte written for
    several peers counts once), their rate over the time the rank spent in its collectives,
    the capacity and the utilization: the definition of ``linerate top`` and the dashboard.
    Nothing where the entries carry no ``interfaces`` (``interface_deltas``)."""
    rows = [(e, i) for e in per_rank for i in e.get("interfaces") or []]
    if not rows:
        return []
    lines = [f"# {label} interfaces: bytes each rank moved per interface, as its utilization "
             "counts them (shm: tx = bytes written for the peers, once however many read "
             "them; rx = bytes read of theirs); rate = bytes / time this rank spent in its "
             "collectives; util = rate / capacity",
             f"#{'rank':>5}  {'iface':<8}{'tx(B)':>15}{'rx(B)':>15}{'tx(GB/s)':>10}"
             f"{'rx(GB/s)':>10}{'capacity(Gb/s)':>16}{'util tx':>9}{'util rx':>9}"]
    for entry, i in rows:
        busy = entry["busy_s"]
        rates = [i[k] / busy if busy > 0 else 0.0 for k in ("tx_bytes", "rx_bytes")]
        cap = i.get("capacity_bytes_per_second")
        utils = [r / cap if cap else None for r in rates]
        line = (f"#{entry['rank']:>5}  {i['interface']:<8}{i['tx_bytes']:>15}{i['rx_bytes']:>15}"
                f"{rates[0] / 1e9:>10.3f}{rates[1] / 1e9:>10.3f}"
                + (f"{cap * 8 / 1e9:>16.2f}" if cap else f"{'-':>16}")
                + "".join(f"{u:>9.1%}" if u is not None else f"{'-':>9}" for u in utils))
        if any(u is not None and u > 1 for u in utils):
            line += ("  capacity set by LINERATE_LINK_CAPACITY is too low"
                     if i.get("capacity_source") == "setting" else "  above the capacity")
        lines.append(line)
    return lines


def interface_snapshot(ctx) -> dict | None:
    """A linerate group's bytes per (interface, direction) so far (its transport Context's:
    transport/metrics.py interface_bytes), or None without a Context."""
    if ctx is None:
        return None
    from linerate.transport import metrics
    return metrics.interface_bytes(ctx)


def interface_deltas(before: dict | None, after: dict | None) -> list[dict]:
    """Per interface, the bytes moved between two ``interface_snapshot``s, with the
    interface's capacity and its source (transport/metrics.py; None where unknown or where
    LINERATE_LINK_CAPACITY is malformed): the ``interfaces`` of a links entry."""
    if before is None or after is None:
        return []
    from linerate.transport import metrics
    out = []
    for iface in sorted({k[0] for k in after}):
        try:
            cap, source = metrics.link_capacity(iface), metrics.capacity_source(iface)
        except ValueError:
            cap = source = None
        out.append({"interface": iface,
                    "tx_bytes": after.get((iface, "tx"), 0) - before.get((iface, "tx"), 0),
                    "rx_bytes": after.get((iface, "rx"), 0) - before.get((iface, "rx"), 0),
                    "capacity_bytes_per_second": cap, "capacity_source": source})
    return out


def write_json(path: str, meta: dict, labels: list[str], rows: list[Row], links: list[dict],
               raw: dict | None = None) -> None:
    """``raw``: the link probe's result (``ProbeResult.to_dict()``), when --raw ran; then every
    backend figure also has busbw_gbit_s and util (busbw / raw capacity, a fraction)."""
    capacity = raw["capacity_gbit_s"] if raw else None

    def figures(r: Result) -> dict:
        d = asdict(r)
        if raw is not None:
            d["busbw_gbit_s"] = r.busbw_gbps * 8
            d["util"] = utilization(r.busbw_gbps, capacity)
        return d

    doc = dict(meta)
    doc["raw_link"] = raw
    doc["results"] = [
        {"op": row.op, "size_bytes": row.size_bytes, "count": row.count, "dtype": row.dtype,
         "backends": {label: figures(r) for label, r in zip(labels, row.results)},
         "ratio": row.ratio}
        for row in rows]
    doc["avg_busbw_gbps"] = average_busbw(labels, rows)
    if raw is not None:
        doc["avg_util"] = {label: utilization(v, capacity)
                           for label, v in doc["avg_busbw_gbps"].items()}
    doc["links"] = links
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
