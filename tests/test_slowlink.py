"""Slow links (transport/slowlink.py): the rate of each TCP connection while it was sending,
its smoothed ratio to its siblings, the group's verdict from every rank's rows, their encoding,
the exported series; and on a netlab cluster of 4 hosts x 2 rails (conftest's lab_4x2), one
host's second rail shaped to half the rate is named within 20 collectives, and a balanced
cluster names nothing: no link, and (the same run, then 2,000 all_reduces of 64 KB) no slow
rank either (tests/test_straggler.py's balanced check between hosts).

The netlab test needs root and iproute2; skipped with the reason elsewhere.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import textwrap
import threading
import time

import pytest

from linerate.transport import slowlink
from linerate.transport import metrics
from linerate.transport.link import tcp_info

MiB = 1 << 20


# ----------------------------------------------------------------------------- fabrication
class FakeCtx:
    """A Context whose ``stats()`` is what the test sets."""

    def __init__(self, addresses=("10.0.0.1", "10.0.1.1")):
        self.addresses = list(addresses)
        self.snap = {"peers": []}

    def stats(self):
        return self.snap


def conn(index, acked, busy_ms, rwnd_ms=0.0, local="10.0.0.1", device="eth0"):
    return {"index": index, "local": local, "remote": "10.0.0.9", "device": device,
            "sent_bytes": acked, "received_bytes": 0,
            "tcp": {"total_retrans": 0, "bytes_acked": int(acked), "busy_us": int(busy_ms * 1000),
                    "rwnd_limited_us": int(rwnd_ms * 1000), "sndbuf_limited_us": 0,
                    "bytes_sent": int(acked)}}


def snapshot(peers: dict) -> dict:
    """{global peer: [connection dicts]} -> a Context.stats() snapshot."""
    return {"rank": 0, "global_rank": 0, "size": len(peers) + 1, "peers": [
        {"peer": p, "global_peer": p, "failure": None,
         "links": [{"kind": "tcp", "peer": p, "connections": cs}]} for p, cs in peers.items()]}


class Traffic:
    """Cumulative counters of a rank's connections: ``step`` adds what each carried."""

    def __init__(self, ctx, layout):
        # layout: {(peer, index): (local address, device)}
        self.ctx, self.layout = ctx, layout
        self.acked = {k: 0 for k in layout}
        self.busy = {k: 0.0 for k in layout}
        self.rwnd = {k: 0.0 for k in layout}

    def step(self, carried: dict):
        """carried: {(peer, index): (bytes, busy ms[, rwnd-limited ms])}."""
        for k, v in carried.items():
            self.acked[k] += v[0]
            self.busy[k] += v[1]
            if len(v) > 2:
                self.rwnd[k] += v[2]
        peers: dict = {}
        for (p, i), (local, dev) in sorted(self.layout.items()):
            peers.setdefault(p, []).append(conn(i, self.acked[(p, i)], self.busy[(p, i)],
                                                self.rwnd[(p, i)], local, dev))
        self.ctx.snap = snapshot(peers)


@pytest.fixture
def capacity(monkeypatch):
    """Every interface has a capacity of 100 MB/s."""
    monkeypatch.setattr(slowlink, "_capacity", lambda ifname: 100e6)


def rows_by(rows):
    return {(r["peer"], r["connection"]): r for r in rows}


# ----------------------------------------------------------------------------- tcp_info
@pytest.mark.timeout(20)
def test_tcp_info_reads_bytes_acked_and_busy_time_of_a_real_connection():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    got = []
    t = threading.Thread(target=lambda: got.append(sum(iter(lambda: len(b.recv(1 << 20)), 0))))
    t.start()
    try:
        before = tcp_info(a)
        a.sendall(bytes(8 * MiB))
        a.shutdown(socket.SHUT_WR)
        t.join(10)
        deadline = time.monotonic() + 5
        while True:  # the last acknowledgements may still be on their way
            after = tcp_info(a)
            if after.get("bytes_acked", 0) - before.get("bytes_acked", 0) >= 8 * MiB \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        a.close()
        b.close()
        ls.close()
    assert got == [8 * MiB]
    if "busy_us" not in after:
        pytest.skip("this kernel's tcp_info has no busy time")
    assert after["bytes_acked"] - before["bytes_acked"] >= 8 * MiB
    assert after["busy_us"] >= after["rwnd_limited_us"] + after["sndbuf_limited_us"] >= 0
    assert after["bytes_sent"] >= 8 * MiB
    assert tcp_info(object()) is None


@pytest.mark.timeout(20)
def test_a_tcp_link_stats_carry_each_connections_tcp_info():
    from linerate.transport.tcp import TcpLink
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(2)
    socks = [socket.create_connection(ls.getsockname()) for _ in range(2)]
    peers = [ls.accept()[0] for _ in range(2)]
    try:
        link = TcpLink(1, socks, rank=0, chunk_bytes=1 << 16)
        conns = link.stats()["connections"]
        assert [c["index"] for c in conns] == [0, 1]
        for c in conns:
            assert {"bytes_acked", "total_retrans"} <= set(c["tcp"]), c
    finally:
        for s in socks + peers:
            s.close()
        ls.close()


# ----------------------------------------------------------------------------- rates
@pytest.mark.timeout(10)
def test_measure_rate_over_busy_time_less_receive_window_time():
    a = {"bytes_acked": 0, "busy_us": 0, "rwnd_limited_us": 0}
    b = {"bytes_acked": 10 * MiB, "busy_us": 150_000, "rwnd_limited_us": 50_000}
    assert slowlink.measure(a, b) == pytest.approx(10 * MiB / 0.1)
    assert slowlink.measure(None, b) is None
    small = {"bytes_acked": MiB - 1, "busy_us": 500_000, "rwnd_limited_us": 0}
    assert slowlink.measure(a, small) is None                     # too few bytes
    short = {"bytes_acked": 10 * MiB, "busy_us": 9_000, "rwnd_limited_us": 0}
    assert slowlink.measure(a, short) is None                     # too little busy time
    assert slowlink.measure(b, a) is None                         # counters went back
    assert slowlink.measure(a, {"bytes_acked": 10 * MiB}) is None  # an older kernel
    assert slowlink.median([3, 1, 2]) == 2 and slowlink.median([4, 1, 2, 3]) == 2.5


@pytest.mark.timeout(10)
def test_sample_ratio_to_siblings_capacity_and_rails(capacity):
    ctx = FakeCtx()
    layout = {(1, 0): ("10.0.0.1", "eth0"), (1, 1): ("10.0.1.1", "eth1"),
              (2, 0): ("10.0.0.1", "eth0"), (2, 1): ("10.0.1.1", "eth1")}
    tr = Traffic(ctx, layout)
    tr.step({})
    lr = slowlink.LinkRates(ctx, host_of=lambda r: f"h{r}", threshold=0.6)
    assert lr.sample() == []  # the first sample is the baseline
    # 100 ms busy each: 8 MiB -> 83.9 MB/s; one connection at a quarter of that.
    tr.step({(1, 0): (8 * MiB, 100), (1, 1): (2 * MiB, 100), (2, 0): (8 * MiB, 100),
             (2, 1): (8 * MiB, 400, 300)})  # rwnd-limited time is left out
    rows = rows_by(lr.sample())
    assert set(rows) == set(layout)
    r = rows[(1, 1)]
    assert r["rate"] == pytest.approx(2 * MiB / 0.1)
    assert r["ratio"] == pytest.approx(0.25)  # over the median of the three others
    assert r["capacity_ratio"] == pytest.approx(2 * MiB / 0.1 / 100e6)
    assert (r["interface"], r["rail"], r["peer_host"], r["samples"]) == ("eth1", 1, "h1", 1)
    assert not r["slow"]  # one sample names nobody
    assert rows[(1, 0)]["ratio"] == pytest.approx(1.0) and rows[(1, 0)]["rail"] == 0
    assert rows[(2, 1)]["rate"] == pytest.approx(8 * MiB / 0.1)
    # Idle connections are not measured (their rows keep the last figures).
    tr.step({(1, 0): (8 * MiB, 100), (1, 1): (2 * MiB, 100), (2, 0): (100, 1)})
    rows = rows_by(lr.sample())
    assert rows[(1, 1)]["slow"] and rows[(1, 1)]["samples"] == 2
    assert rows[(1, 1)]["ratio"] == pytest.approx(0.25)  # only sibling: (1, 0)
    assert rows[(2, 0)]["samples"] == 1 and not any(rows[k]["slow"] for k in rows if k != (1, 1))
    assert lr.slow() == [rows[(1, 1)]]
    # A connection measured alone has no sibling: no judgement.
    tr.step({(1, 1): (2 * MiB, 100)})
    assert rows_by(lr.sample())[(1, 1)]["samples"] == 2
    # A link that goes away takes its rows with it.
    del layout[(2, 0)], layout[(2, 1)]
    tr.step({})
    assert set(rows_by(lr.sample())) == {(1, 0), (1, 1)}


@pytest.mark.timeout(20)
def test_a_connection_at_its_capacity_is_not_slow_beside_siblings_measured_above_it(capacity):
    """Siblings whose busy time came out short (a loaded host: the kernel counts it in
    jiffies) measure above the interface's capacity; a connection at 92% of its capacity is
    not named slow beside them, while one at 40% still is."""
    ctx = FakeCtx()
    layout = {(1, 0): ("10.0.0.1", "eth0"), (1, 1): ("10.0.1.1", "eth1"),
              (2, 0): ("10.0.0.1", "eth0"), (2, 1): ("10.0.1.1", "eth1")}
    tr = Traffic(ctx, layout)
    tr.step({})
    lr = slowlink.LinkRates(ctx, threshold=0.6)
    lr.sample()
    for _ in range(4):  # 100 ms busy each: 9.2 MB -> 92 MB/s; 17 MB -> 170 MB/s (above 100)
        tr.step({(1, 0): (9.2e6, 100), (1, 1): (17e6, 100), (2, 0): (17e6, 100),
                 (2, 1): (4e6, 100)})
        rows = rows_by(lr.sample())
    assert rows[(1, 0)]["capacity_ratio"] == pytest.approx(0.92)
    assert rows[(1, 0)]["ratio"] == pytest.approx(0.92) and not rows[(1, 0)]["slow"]
    assert rows[(2, 1)]["slow"] and rows[(2, 1)]["ratio"] == pytest.approx(0.4)
    assert rows[(1, 1)]["rate"] == pytest.approx(170e6)  # the rate itself is as measured
    assert [(r["peer"], r["connection"]) for r in lr.slow()] == [(2, 1)]


@pytest.mark.timeout(10)
def test_smoothing_one_noisy_sample_names_nobody_and_recovery_takes_the_average():
    st = slowlink._Conn()
    for r in (1.0, 1.0, 0.05, 1.0, 1.0):    # one sample far below: the average dips, no name
        st.judge(r, 0.6)
        assert not st.slow
    st.judge(0.4, 0.6)
    assert not st.slow and st.ratio == pytest.approx(0.640625)
    st.judge(0.4, 0.6)                      # two in a row, and the average below
    assert st.slow and st.ratio == pytest.approx(0.5203125) and st.samples == 7
    st.judge(0.65, 0.6)                     # one sample above: still below on average
    assert st.slow
    st.judge(1.0, 0.6)
    assert not st.slow and st.ratio >= 0.6
    st = slowlink._Conn()
    st.judge(50.0, 0.6)
    assert st.ratio == slowlink.RATIO_CAP   # a much faster connection is capped
    for r in (0.5, 0.5):                    # two low samples in a row, the average above
        st.judge(r, 0.6)
    assert not st.slow and st.ratio == pytest.approx(0.875)


@pytest.mark.timeout(10)
def test_threshold_from_the_setting(monkeypatch):
    monkeypatch.setenv("LINERATE_SLOW_LINK_RATIO", "0.3")
    assert slowlink.LinkRates(FakeCtx()).threshold == 0.3
    monkeypatch.setenv("LINERATE_SLOW_LINK_RATIO", "1.5")
    with pytest.raises(ValueError, match="LINERATE_SLOW_LINK_RATIO"):
        slowlink.LinkRates(FakeCtx())
    monkeypatch.delenv("LINERATE_SLOW_LINK_RATIO")
    assert slowlink.LinkRates(FakeCtx()).threshold == 0.6


# ----------------------------------------------------------------------------- encoding
def row(peer, iface, rail, ratio, slow, conn=None, rate=50e6, host=None, cap=0.5):
    return {"peer": peer, "peer_host": host, "interface": iface, "rail": rail,
            "connection": (rail or 0) if conn is None else conn, "rate": rate, "ratio": ratio,
            "capacity_ratio": cap, "slow": slow, "samples": 3}


@pytest.mark.timeout(10)
def test_encode_decode_round_trip_and_refusals():
    rows = [row(1, "eth0", 0, 1.23456789, False, host="h1"),
            row(2, "eth1", None, None, True, rate=1.5e6, cap=None)]
    enc = slowlink.encode(rows)
    wire = json.loads(json.dumps(enc, allow_nan=False))
    back = slowlink.decode(wire)
    assert back[0] == dict(rows[0], ratio=1.2346, rate=50e6)
    assert back[1] == dict(rows[1], rate=1.5e6)
    assert slowlink.encode([dict(rows[0], rate=float("inf"))])[0][5] is None
    good = wire[0]
    bad = [None, {}, [good[:-1]], [good[:2] + [7] + good[3:]], [good[:5] + ["x"] + good[6:]],
           [good[:8] + [2] + good[9:]], [good[:8] + [True] + good[9:]],
           [good[:6] + [-1.0] + good[7:]], [[10 ** 30] + good[1:]], [good] * (slowlink.MAX_ROWS + 1),
           [[good[0], "h" * 300] + good[2:]]]
    for data in bad:
        with pytest.raises(ValueError):
            slowlink.decode(data)


# ----------------------------------------------------------------------------- verdict
def four_hosts(slow_host=3, slow_rail=1, extra=None):
    """Views of 4 single-rank hosts, two rails, a ring (rank r sends to r+1): the connections
    through ``slow_host``'s ``slow_rail`` are slow."""
    views = {}
    for r in range(4):
        p = (r + 1) % 4
        rows = []
        for rail in (0, 1):
            bad = rail == slow_rail and slow_host in (r, p)
            rows.append(row(p, f"eth{rail}", rail, 0.5 if bad else (2.0 if slow_host in (r, p)
                                                                    else 1.0), bad))
        views[r] = (f"h{r}", rows)
    for (r, p, rail) in extra or ():
        views[r][1].append(row(p, f"eth{rail}", rail, 0.4, True, conn=rail + 2))
    return views


@pytest.mark.timeout(10)
def test_group_verdict_names_the_host_and_rail_at_both_ends_of_the_slow_connections():
    [v] = slowlink.group_verdict(four_hosts())
    assert (v["host"], v["interface"], v["rail"], v["slow"], v["measured"], v["also"]) == \
        ("h3", "eth1", 1, 2, 2, [])
    assert "host h3 eth1 (rail 1)" in v["evidence"] and "2 of 2" in v["evidence"]
    assert "0.50x" in v["evidence"] and "50% of capacity" in v["evidence"]
    assert "2->3" in v["evidence"] and "3->0" in v["evidence"]
    [v] = slowlink.group_verdict(four_hosts(slow_host=1, slow_rail=0))
    assert (v["host"], v["interface"]) == ("h1", "eth0")
    balanced = {r: (h, [dict(x, slow=False, ratio=1.0) for x in rows])
                for r, (h, rows) in four_hosts().items()}
    assert slowlink.group_verdict(balanced) == []
    assert slowlink.group_verdict({}) == []


@pytest.mark.timeout(10)
def test_group_verdict_is_deterministic_and_takes_peer_hosts_from_the_views():
    views = four_hosts(extra=[(0, 2, 0), (2, 0, 0)])  # and the rail-0 link between h0 and h2
    a = slowlink.group_verdict(views)
    b = slowlink.group_verdict(dict(reversed(list(views.items()))))
    assert a == b
    assert [(x["host"], x["interface"]) for x in a] == [("h3", "eth1"), ("h0", "eth0")]
    # h0 and h2 carry the same evidence (one connection each way): both are said.
    assert a[1]["also"] == ["h2"] and "points at h2" in a[1]["evidence"]
    # A slow connection to a rank whose view is missing still names its own host and rail.
    only = {0: ("h0", [row(5, "eth1", 1, 0.3, True), row(5, "eth0", 0, 1.7, False)])}
    [v] = slowlink.group_verdict(only)
    assert (v["host"], v["interface"], v["rail"]) == ("h0", "eth1", 1)
    # A named peer host counts too; rails without an index match by interface name.
    only = {0: ("h0", [row(5, "ib1", None, 0.3, True, host="h5"),
                       row(5, "ib0", None, 1.7, False, host="h5")]),
            1: ("h1", [row(5, "ib1", None, 0.3, True, host="h5"),
                       row(5, "ib0", None, 1.7, False, host="h5")])}
    [v] = slowlink.group_verdict(only)
    assert (v["host"], v["interface"], v["rail"], v["slow"]) == ("h5", "ib1", None, 2)
    assert "interface ib1" in v["evidence"]


@pytest.mark.timeout(10)
def test_group_verdict_needs_most_connections_through_a_place_slow():
    views = four_hosts(slow_host=None)
    # One slow connection out of many through h0's rail 0 and h1's rail 0.
    views[0] = ("h0", views[0][1] + [row(2, "eth0", 0, 0.5, False, conn=2),
                                     row(3, "eth0", 0, 0.5, False, conn=4)])
    views[1] = ("h1", views[1][1] + [row(0, "eth0", 0, 1.0, False, conn=2),
                                     row(3, "eth0", 0, 1.0, False, conn=4)])
    views[0][1][0]["slow"] = True
    assert slowlink.group_verdict(views) == []


# ----------------------------------------------------------------------------- export
@pytest.mark.timeout(10)
def test_exported_series(capacity):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def series():
        got = {}
        for fam in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode()):
            for s in fam.samples:
                if s.name.startswith(("linerate_link_rate", "linerate_slow_link")) \
                        and s.labels.get("peer") == "91":
                    assert set(s.labels) == {"rank", "host", "peer", "interface", "connection"}
                    got[(s.name, s.labels["interface"], s.labels["connection"])] = s.value
        return got

    ctx = FakeCtx()
    tr = Traffic(ctx, {(91, 0): ("10.0.0.1", "eth0"), (91, 1): ("10.0.1.1", "eth1")})
    lr = slowlink.LinkRates(ctx, threshold=0.6)
    tr.step({})
    lr.sample()
    for _ in range(2):
        tr.step({(91, 0): (8 * MiB, 100), (91, 1): (2 * MiB, 100)})
        lr.sample()
    got = series()
    assert got[("linerate_slow_link", "eth1", "1")] == 1.0
    assert got[("linerate_slow_link", "eth0", "0")] == 0.0
    assert got[("linerate_link_rate_ratio", "eth1", "1")] == pytest.approx(0.25)
    assert got[("linerate_link_rate_ratio", "eth0", "0")] == pytest.approx(2.0)  # capped
    assert got[("linerate_link_rate_bytes_per_second", "eth0", "0")] == pytest.approx(
        8 * MiB / 0.1)
    assert len(got) == 6
    del lr  # a group that is gone exports nothing more
    gc.collect()
    assert series() == {}


# ----------------------------------------------------------------------------- netlab
needs_netlab = pytest.mark.netlab  # skipped with the reason where netlab cannot work (conftest)

COLLECTIVES = 20
EVERY = 2  # collectives between two samples
BALANCED_OPS = 2000  # then, on the balanced cluster: all_reduces of 64 KB that name no slow rank

RANK = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from linerate.transport import slowlink

    out, n, every, balanced = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("linerate")
    rank = dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    ctx = pg._ctx
    lr = slowlink.LinkRates(ctx)
    t = torch.ones(1 << 20)  # 4 MB
    dist.all_reduce(t)       # the links are made
    lr.sample()              # the baseline
    samples = []
    for i in range(1, n + 1):
        dist.all_reduce(t)
        if i % every == 0:
            samples.append([i, slowlink.encode(lr.sample())])
    dist.barrier()
    named, decided = [], 0   # the slow-rank watch's verdicts (LINERATE_SLOW_LOG_S is set)
    s = torch.ones(16 << 10)  # 64 KB
    for i in range(balanced):
        dist.all_reduce(s)
        rep = pg.slow_report()
        decided = max(decided, rep["collectives"])
        if rep["slowest"] is not None:
            named.append([i, rep["slowest"]])
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"host": os.environ["LINERATE_NETLAB_HOST"], "samples": samples,
                   "named": named, "decided": decided}, f)
    dist.destroy_process_group()
""")


def _shape(lab, host, rail: int, rate_bps: int) -> None:
    """Both directions of ``host``'s ``rail`` at ``rate_bps``: its interface's egress, and the
    switch port's toward it."""
    from linerate.tools import netlab
    h = lab.host(host)
    for ns, dev in ((h.netns, h.ifnames[rail]), (lab.switch_netns, f"h{h.index}e{rail}")):
        subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                        *netlab.tbf_params(rate_bps)], check=True, capture_output=True)


@needs_netlab
@pytest.mark.timeout(180)
@pytest.mark.parametrize("shaped", [True, False], ids=["slow_rail", "balanced"])
def test_netlab_slow_rail_is_named(lab_4x2, tmp_path, shaped):
    from linerate.tools import netlab

    lab = lab_4x2
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LINERATE_")}
    env.update(LINERATE_CHUNK_BYTES="256K", LINERATE_NSOCKS="1")
    balanced = 0 if shaped else BALANCED_OPS
    if shaped:
        _shape(lab, 3, 1, lab.rate_bps // 2)
    else:
        env.update(LINERATE_SLOW_LOG_S="60")  # the slow-rank watch on
    try:
        rc = netlab.run_ranks(lab, 4, [str(script), str(tmp_path), str(COLLECTIVES), str(EVERY),
                                       str(balanced)], env=env, timeout=150)
    finally:
        if shaped:  # the shared lab as it was
            _shape(lab, 3, 1, lab.rate_bps)
    assert rc == 0
    runs = {}
    for r in range(4):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        runs[r] = (doc["host"], doc["samples"])
    verdicts = []
    for k, (at, _) in enumerate(runs[0][1]):
        views = {r: (host, slowlink.decode(samples[k][1])) for r, (host, samples) in runs.items()}
        for r, (host, rows) in views.items():
            print(f"after {at} collectives, rank {r} ({host}): " + ", ".join(
                f"->{x['peer']} {x['interface']} {x['rate'] / 1e6:.1f} MB/s "
                f"x{x['ratio'] if x['ratio'] is None else round(x['ratio'], 2)}"
                f"{' SLOW' if x['slow'] else ''}" for x in rows))
        verdicts.append((at, slowlink.group_verdict(views)))
        print(f"after {at} collectives: {[v['evidence'] for v in verdicts[-1][1]]}")
    if not shaped:
        assert all(v == [] for _, v in verdicts), verdicts
        for r in range(4):  # no slow rank either, over the 2,000 all_reduces
            doc = json.loads((tmp_path / f"rank{r}.json").read_text())
            assert doc["named"] == [] and doc["decided"] >= 8, (r, doc["named"], doc["decided"])
        return
    named = [at for at, v in verdicts if [(x["host"], x["interface"]) for x in v] == [("h3", "eth1")]]
    assert named and named[0] <= 20, verdicts
    # Once named, it stays named, and nothing else is.
    assert all([(x["host"], x["interface"]) for x in v] == [("h3", "eth1")]
               for at, v in verdicts if at >= named[0]), verdicts
