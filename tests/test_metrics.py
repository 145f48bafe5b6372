"""The Prometheus exporter (transport/metrics.py) and the collectives' series it serves
(collectives/stats.py): names, labels, values against what the transport counted, histogram
and busbw arithmetic, the window and identity hooks, settings and their errors."""
from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from _harness import free_port, free_port_range, run_ranks
from linerate.collectives import stats
from linerate.transport import metrics

# Prometheus naming: base units and the suffix that says so (node_exporter's style).
_NAME_RULES = {
    "counter": re.compile(r"^linerate_[a-z_]+_total$"),
    # a unit suffix, or one of the unitless gauges: a rank's number, a count of collectives,
    # a 0/1 flag
    "gauge": re.compile(r"^linerate_(info|slowest_rank|slow_window_collectives|slow_link|"
                        r"[a-z_]+(_bytes|_ratio|_bytes_per_second|_seconds))$"),
    "histogram": re.compile(r"^linerate_[a-z_]+_seconds$"),
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


# ----------------------------------------------------------------------------- in this process
def test_size_bucket():
    assert stats.size_bucket(0) == "4KiB"
    assert stats.size_bucket(4096) == "4KiB"
    assert stats.size_bucket(4097) == "64KiB"
    assert stats.size_bucket(16 << 20) == "16MiB"
    assert stats.size_bucket((256 << 20) + 1) == "inf"


def test_link_capacity_from_env(monkeypatch):
    monkeypatch.delenv("LINERATE_LINK_CAPACITY", raising=False)
    assert metrics.link_capacity("lo") is None  # loopback reports no speed
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "10gbit")
    assert metrics.link_capacity("lo") == pytest.approx(1.25e9)
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "eth0=1gbit, eth1=250mbit")
    assert metrics.link_capacity("eth1") == pytest.approx(250e6 / 8)
    assert metrics.link_capacity("lo") is None
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "eth0=fast")
    with pytest.raises(ValueError, match="LINERATE_LINK_CAPACITY.*eth0=fast"):
        metrics.link_capacity("eth0")


def test_bad_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("LINERATE_METRICS_PORT", "http")
    with pytest.raises(ValueError, match="LINERATE_METRICS_PORT"):
        metrics.start_from_env()
    monkeypatch.setenv("LINERATE_METRICS_PORT", "70000")
    with pytest.raises(ValueError, match="LINERATE_METRICS_PORT"):
        metrics.start_from_env()
    monkeypatch.setenv("LINERATE_METRICS_WINDOW", "-1")
    with pytest.raises(ValueError, match="LINERATE_METRICS_WINDOW"):
        metrics._window()


def test_port_in_use_is_logged_not_raised(monkeypatch, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setenv("LINERATE_METRICS_PORT", str(port - 1))
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("LINERATE_METRICS_ADDR", "127.0.0.1")
        with caplog.at_level(logging.WARNING, logger="linerate.metrics"):
            assert metrics.start_from_env() is None
    assert f"127.0.0.1:{port}" in caplog.text and "LOCAL_RANK=1" in caplog.text


@pytest.fixture
def fresh_stats(monkeypatch):
    """The collectives' series empty (nothing queued either) and metrics on."""
    import collections
    for name in ("_hist", "_op_bytes", "_win_bus", "_busbw"):
        monkeypatch.setattr(stats, name, {})
    monkeypatch.setattr(stats, "_pending", collections.deque())
    monkeypatch.setattr(metrics, "_enabled", True)


def test_histogram_bytes_and_busbw(fresh_stats):
    # 3 all_reduces of 1 MiB on 4 ranks (bus factor 1.5): 0.002 s, 0.002 s, 0.008 s.
    for secs in (0.002, 0.002, 0.008):
        stats.record("all_reduce_coalesced", "ring", 1 << 20, secs, 4)
    metrics.sample(None)  # the sampler's window ends: busbw of the ops that ran in it
    text = generate_latest(metrics.REGISTRY).decode()
    labels = {"op": "all_reduce", "algorithm": "ring", "size_bucket": "1MiB"}
    buckets = {s.labels["le"]: s.value for s in samples(text, "linerate_collective_seconds_bucket")
               if all(s.labels.get(k) == v for k, v in labels.items())}
    assert buckets["0.001"] == 0 and buckets["0.0025"] == 2 and buckets["0.005"] == 2
    assert buckets["0.01"] == 3 and buckets["+Inf"] == 3
    (count,) = [s.value for s in samples(text, "linerate_collective_seconds_count")
                if s.labels.get("op") == "all_reduce"]
    (total,) = [s.value for s in samples(text, "linerate_collective_seconds_sum")
                if s.labels.get("op") == "all_reduce"]
    assert count == 3 and total == pytest.approx(0.012)
    (nbytes,) = [s.value for s in samples(text, "linerate_collective_bytes_total")]
    assert nbytes == 3 << 20
    (busbw,) = [s.value for s in samples(text, "linerate_bus_bandwidth_bytes_per_second")]
    assert busbw == pytest.approx(3 * (1 << 20) * 1.5 / 0.012)


def test_busbw_window_rolls_over_with_the_sampler(fresh_stats, monkeypatch):

    def busbw():
        text = generate_latest(metrics.REGISTRY).decode()
        return {s.labels["op"]: s.value
                for s in samples(text, "linerate_bus_bandwidth_bytes_per_second")}

    stats.record_collective("broadcast", "chain", 1000, 0.001, 1.0)
    assert busbw() == {"broadcast": pytest.approx(1e6)}  # the open window, before any roll
    metrics.sample(None)
    stats.record_collective("broadcast", "chain", 1000, 0.004, 1.0)
    assert busbw() == {"broadcast": pytest.approx(1e6)}  # the last closed window's
    metrics.sample(None)
    assert busbw() == {"broadcast": pytest.approx(250e3)}
    metrics.sample(None)  # a window without the op keeps its last value
    assert busbw() == {"broadcast": pytest.approx(250e3)}
    monkeypatch.setattr(metrics, "_enabled", False)
    stats.record("broadcast", "chain", 1000, 1.0, 2)  # metrics off: nothing recorded
    assert stats._op_bytes == {"broadcast": 2000}


def test_window_hooks_and_identity(monkeypatch, caplog):
    monkeypatch.setattr(metrics, "_window_hooks", [])
    calls = []

    def broken():
        raise RuntimeError("broken hook")

    metrics.on_window(broken)
    metrics.on_window(lambda: calls.append(1))
    metrics.on_window(broken)  # registered once
    assert len(metrics._window_hooks) == 2
    with caplog.at_level(logging.ERROR, logger="linerate.metrics"):
        metrics.sample(None)
        metrics.sample(None)
    failed = [r for r in caplog.records if r.exc_info and "broken hook" in str(r.exc_info[1])]
    assert calls == [1, 1] and len(failed) == 2
    monkeypatch.setattr(metrics, "_rank_label", "7")
    monkeypatch.setenv("LINERATE_METRICS_HOST", "hostZ")
    assert metrics.identity() == ("7", "hostZ")


def test_transport_knows_nothing_of_the_collectives():
    # ``import linerate`` registers the backend (linerate/_torch_hook.py); the transport's
    # import must add no module of the collectives to that.
    code = ("import sys, linerate; before = set(sys.modules); "
            "import linerate.transport.metrics as m; "
            "new = sorted(n for n in set(sys.modules) - before if 'collectives' in n); "
            "assert not new, new; "
            "assert not hasattr(m, 'record_collective') and not hasattr(m, 'SECONDS_BUCKETS')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_names_follow_prometheus_conventions():
    from datetime import timedelta

    import torch.distributed as dist

    from linerate.collectives import straggler
    from linerate.transport import slowlink

    # a watched group's series (collectives/straggler.py, transport/slowlink.py) are there too
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    w = straggler.Watch(store, "names", 0, 2, None, "h", 5.0, 0.0)
    w.close()
    w.verdict = {"collectives": 8, "late": {1: (8, 0.02)}, "slowest": 1, "links": []}

    class _Ctx:
        addresses = []

        def stats(self):
            return {"rank": 0, "global_rank": 0, "size": 2, "peers": []}

    rates = slowlink.LinkRates(_Ctx())
    fams = families(generate_latest(metrics.REGISTRY).decode())
    assert "linerate_slowest_rank" in fams and "linerate_rank_lateness_seconds" in fams
    del rates
    assert "linerate_info" in fams and "linerate_sent_bytes" in fams
    for name, fam in fams.items():
        full = name + "_total" if fam.type == "counter" else name
        assert _NAME_RULES[fam.type].match(full), (name, fam.type)


# ----------------------------------------------------------------------------- real ranks
def _exchange(rank, world, lr, base, sub_ranks):
    import torch
    import torch.distributed as dist
    metrics.start_exporter(base + rank, "127.0.0.1")
    t = torch.full((300_001,), float(rank))
    for _ in range(3):
        dist.all_reduce(t, group=lr)
    dist.broadcast(t, 0, group=lr)
    sub = dist.new_group(ranks=sub_ranks, backend="linerate")
    if rank in sub_ranks:
        x = torch.ones(1000)
        dist.all_reduce(x, group=sub)
        assert x[0].item() == len(sub_ranks)
    dist.barrier(group=lr)
    own = {}
    for g in (lr, sub) if rank in sub_ranks else (lr,):
        be = g._get_backend(torch.device("cpu"))
        for c in be.connection_stats():
            peer = dist.get_global_rank(g, c["peer"])
            own[peer] = own.get(peer, 0) + c["sent_bytes"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/metrics", timeout=5).read().decode()
    dist.destroy_process_group(sub) if rank in sub_ranks else None
    after = urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/metrics", timeout=5).read().decode()
    return own, text, after


@pytest.mark.timeout(90)
def test_exported_counts_match_the_transport():
    base = free_port_range(3)
    out = run_ranks(_exchange, 3, base, [1, 2], timeout=80,  # TCP (one host would share memory)
                    env={"LINERATE_METRICS_HOST": "hostA", "LINERATE_SHM": "0"})
    for rank, (own, text, after) in enumerate(out):
        sent = samples(text, "linerate_sent_bytes_total")
        assert sent and all(s.labels["rank"] == str(rank) and s.labels["host"] == "hostA"
                            for s in sent)
        assert {s.labels["interface"] for s in sent} == {"lo"}
        by_peer: dict[int, float] = {}
        for s in sent:
            by_peer[int(s.labels["peer"])] = by_peer.get(int(s.labels["peer"]), 0) + s.value
        # Peers are global ranks, the subgroup's bytes included.
        assert by_peer == {p: float(n) for p, n in own.items()}, (by_peer, own)
        assert rank not in by_peer
        ops = {s.labels["op"]: s.value for s in samples(text, "linerate_collective_seconds_count")
               if s.labels["algorithm"] in ("ring", "direct", "chain", "dissemination")}
        assert ops.get("barrier", 0) >= 1 and ops.get("broadcast", 0) >= 1
        counted = sum(s.value for s in samples(text, "linerate_collective_seconds_count")
                      if s.labels["op"] == "all_reduce")
        assert counted == (4 if rank in (1, 2) else 3)
        (ar_bytes,) = [s.value for s in samples(text, "linerate_collective_bytes_total")
                       if s.labels["op"] == "all_reduce"]
        assert ar_bytes == 3 * 300_001 * 4 + (4000 if rank in (1, 2) else 0)
        # A destroyed group's bytes stay in the counters (they never go back).
        total = sum(s.value for s in sent)
        assert sum(s.value for s in samples(after, "linerate_sent_bytes_total")) >= total
        # Over a NIC the bytes of the utilization are its connections': the per-peer sums.
        received = sum(s.value for s in samples(text, "linerate_received_bytes_total"))
        iface = {(s.labels["interface"], s.labels["direction"]): s.value
                 for s in samples(text, "linerate_interface_bytes_total")}
        assert iface == {("lo", "tx"): total, ("lo", "rx"): received}, iface
        iface_after = {(s.labels["interface"], s.labels["direction"]): s.value
                       for s in samples(after, "linerate_interface_bytes_total")}
        assert all(iface_after[k] >= v for k, v in iface.items()), (iface, iface_after)
        (info,) = samples(text, "linerate_info")
        assert info.labels["transport"] == "tcp" and info.labels["nsocks"] == "2"
        assert [s.labels["peer"] for s in samples(text, "linerate_send_queue_bytes")]


def test_bad_capacity_fails_at_start_and_never_breaks_a_scrape(monkeypatch, caplog):
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "fast")
    with pytest.raises(ValueError, match="LINERATE_LINK_CAPACITY"):
        metrics.start_exporter(free_port(), "127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="linerate.metrics"):
        assert metrics._capacity_or_none("eth0") is None  # set after start: logged, skipped
        text = generate_latest(metrics.REGISTRY).decode()
    assert "linerate_info" in text and "LINERATE_LINK_CAPACITY" in caplog.text


def test_port_zero_returns_the_bound_port():
    port = metrics.start_exporter(0, "127.0.0.1")
    assert port > 0 and port in metrics.exporter_ports()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "linerate_info{" in text
