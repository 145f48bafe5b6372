"""`linerate top`: endpoints, rates (with counter resets), p99 from buckets, rendering, and the
command against fake ranks served by prometheus_client (and real ranks when the exporter is
there)."""
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _harness import free_port, free_port_range
from linerate.tools import cli, top

ROOT = Path(__file__).resolve().parent.parent


def run_top(*argv, timeout=120):  # a hang: starting the command alone can take seconds
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "linerate.tools.cli", "top", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def scrape_of(text: str, t: float, url: str = "http://h0:9400/metrics") -> top.Scrape:
    return top.Scrape(url, t, samples=top.parse_metrics(text))


def down(t: float, url: str = "http://h0:9400/metrics") -> top.Scrape:
    return top.Scrape(url, t, error="Connection refused")


# ----------------------------------------------------------------------------- endpoints
@pytest.mark.timeout(10)
def test_parse_endpoint_forms():
    assert top.parse_endpoint("localhost:9400-9403") == [
        f"http://localhost:{p}/metrics" for p in (9400, 9401, 9402, 9403)]
    assert top.parse_endpoint("10.0.0.2:9400") == ["http://10.0.0.2:9400/metrics"]
    assert top.parse_endpoint("9400-9401") == ["http://localhost:9400/metrics",
                                               "http://localhost:9401/metrics"]
    assert top.parse_endpoint(":9405") == ["http://localhost:9405/metrics"]
    assert top.parse_endpoint("[::1]:9400") == ["http://[::1]:9400/metrics"]
    assert top.parse_endpoint("http://node1:9400") == ["http://node1:9400/metrics"]
    assert top.parse_endpoint("https://node1:443/x/metrics?a=1") == [
        "https://node1:443/x/metrics?a=1"]
    assert top.parse_endpoints(["h:1-2", "h:2", "h:3"]) == [
        "http://h:1/metrics", "http://h:2/metrics", "http://h:3/metrics"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", ["localhost", "host:", "host:abc", "host:9403-9400",
                                 "host:0", "host:70000", "::1:9400", "ftp://h:1/",
                                 "http://:9400", "http://h:99999/", "host:1-5000"])
def test_parse_endpoint_rejects(bad):
    with pytest.raises(ValueError):
        top.parse_endpoint(bad)


@pytest.mark.timeout(10)
def test_cli_parses_endpoint_groups(capsys):
    args = cli.build_parser().parse_args(["top", "h:1-2", "http://x:5/metrics", "--once"])
    assert args.endpoints == [["http://h:1/metrics", "http://h:2/metrics"],
                              ["http://x:5/metrics"]]
    assert args.once and args.interval == top.DEFAULT_INTERVAL and args.func is top.run
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["top", "h:9-1"])
    assert e.value.code == 2
    assert "is empty" in capsys.readouterr().err


# ----------------------------------------------------------------------------- rates
SERIES = 'rank="{r}",host="h{r}"'


def link_text(r, sent_c0, sent_c1, received, cap=None, util=None, retrans=0.0, queue=0.0):
    lines = [
        "# TYPE linerate_sent_bytes_total counter",
        f'linerate_sent_bytes_total{{{SERIES.format(r=r)},peer="1",interface="eth0",'
        f'connection="0"}} {sent_c0}']
    if sent_c1 is not None:
        lines.append(f'linerate_sent_bytes_total{{{SERIES.format(r=r)},peer="1",'
                     f'interface="eth0",connection="1"}} {sent_c1}')
    lines += ["# TYPE linerate_received_bytes_total counter",
              f'linerate_received_bytes_total{{{SERIES.format(r=r)},peer="1",interface="eth0",'
              f'connection="0"}} {received}',
              "# TYPE linerate_tcp_retransmits_total counter",
              f'linerate_tcp_retransmits_total{{{SERIES.format(r=r)},peer="1"}} {retrans}',
              "# TYPE linerate_send_queue_bytes gauge",
              f'linerate_send_queue_bytes{{{SERIES.format(r=r)},peer="1"}} {queue}']
    if cap is not None:
        lines += ["# TYPE linerate_link_capacity_bytes_per_second gauge",
                  f'linerate_link_capacity_bytes_per_second{{{SERIES.format(r=r)},'
                  f'interface="eth0"}} {cap}']
    if util is not None:
        lines += ["# TYPE linerate_link_utilization_ratio gauge",
                  f'linerate_link_utilization_ratio{{{SERIES.format(r=r)},interface="eth0",'
                  f'direction="tx"}} {util}']
    return "\n".join(lines) + "\n"


def link(frame, rank, direction, iface="eth0"):
    [row] = [x for x in frame["links"] if x["rank"] == rank and x["direction"] == direction
             and x["interface"] == iface]
    return row


@pytest.mark.timeout(10)
def test_counter_delta():
    assert top.counter_delta(100.0, 150.0) == 50.0
    assert top.counter_delta(1000.0, 200.0) == 200.0  # reset: it began again at 0
    assert top.counter_delta(None, 7.0) == 7.0        # born between the two reads
    assert top.counter_delta(5.0, 5.0) == 0.0


@pytest.mark.timeout(10)
def test_link_rates_sum_connections_and_survive_resets():
    prev = scrape_of(link_text(0, 1000, 5000, 0, cap=1.25e9, retrans=10), t=10.0)
    # connection 0: +2000; connection 1 restarted (5000 -> 600); rx +3e9; retransmits reset
    cur = scrape_of(link_text(0, 3000, 600, 3e9, cap=1.25e9, retrans=4, queue=8192), t=12.0)
    frame = top.compute_frame([prev], [cur])
    tx, rx = link(frame, 0, "tx"), link(frame, 0, "rx")
    assert tx["bytes_per_second"] == pytest.approx((2000 + 600) / 2)
    assert rx["bytes_per_second"] == pytest.approx(1.5e9)
    assert rx["bits_per_second"] == pytest.approx(12e9)
    assert rx["capacity_bytes_per_second"] == 1.25e9
    assert rx["utilization"] == pytest.approx(1.2) and rx["utilization_source"] == "counters"
    assert tx["host"] == "h0" and frame["interval_seconds"] == pytest.approx(2.0)
    [peer] = frame["peers"]
    assert peer["retransmits_per_second"] == pytest.approx(2.0)  # 4 new after the reset
    assert peer["send_queue_bytes"] == 8192 and peer["peer"] == 1


@pytest.mark.timeout(10)
def test_new_series_counts_from_zero_and_no_rates_without_previous_scrape():
    prev = scrape_of(link_text(0, 1000, None, 0), t=0.0)
    cur = scrape_of(link_text(0, 1000, 4000, 0), t=1.0)  # connection 1 appeared
    assert link(top.compute_frame([prev], [cur]), 0, "tx")["bytes_per_second"] == 4000.0
    for before in (None, down(0.0)):
        frame = top.compute_frame([before], [cur])
        row = link(frame, 0, "tx")
        assert row["bytes_per_second"] is None and row["utilization"] is None
        assert frame["interval_seconds"] is None and frame["endpoints"][0]["rates"] is False
    assert top.compute_frame(None, [cur])["up"] == 1


@pytest.mark.timeout(10)
def test_utilization_falls_back_to_the_gauge_and_is_unknown_without_capacity():
    prev = scrape_of(link_text(0, 0, None, 0, util=0.25), t=0.0)
    cur = scrape_of(link_text(0, 1e6, None, 1e6, util=0.5), t=1.0)
    frame = top.compute_frame([prev], [cur])
    tx, rx = link(frame, 0, "tx"), link(frame, 0, "rx")
    assert tx["utilization"] == 0.5 and tx["utilization_source"] == "gauge"
    assert rx["utilization"] is None and rx["capacity_bytes_per_second"] is None
    assert rx["bytes_per_second"] == pytest.approx(1e6)


@pytest.mark.timeout(10)
def test_peers_hidden_unless_nonzero_or_all():
    prev = scrape_of(link_text(0, 0, None, 0, retrans=3), t=0.0)
    cur = scrape_of(link_text(0, 0, None, 0, retrans=3), t=1.0)
    frame = top.compute_frame([prev], [cur])
    assert frame["peers"] == [] and frame["peers_hidden"] == 1
    frame = top.compute_frame([prev], [cur], show_all=True)
    assert frame["peers"][0]["retransmits_per_second"] == 0.0
    assert frame["peers"][0]["retransmits_total"] == 3.0 and frame["peers_hidden"] == 0


def link_rate_text(r, rows):
    """The slow-link gauges of rank ``r``: rows of (peer, interface, connection, bytes/s,
    ratio, slow)."""
    lines = []
    for name, i in (("linerate_link_rate_bytes_per_second", 3), ("linerate_link_rate_ratio", 4),
                    ("linerate_slow_link", 5)):
        lines.append(f"# TYPE {name} gauge")
        for row in rows:
            lines.append(f'{name}{{{SERIES.format(r=r)},peer="{row[0]}",interface="{row[1]}",'
                         f'connection="{row[2]}"}} {float(row[i])}')
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(10)
def test_slow_links_shown_and_the_others_with_all():
    rank3 = link_rate_text(3, [(0, "eth0", 0, 25e6, 2.0, 0), (0, "eth1", 1, 11.5e6, 0.43, 1)])
    rank0 = link_rate_text(0, [(1, "eth0", 0, 25e6, 1.02, 0), (1, "eth1", 1, 24e6, 0.98, 0)])
    cur = [scrape_of(rank0, 1.0, "http://h0:9400/metrics"),
           scrape_of(rank3, 1.0, "http://h3:9400/metrics")]
    frame = top.compute_frame(None, cur)  # gauges: no previous scrape needed
    assert frame["slow_links"] == 1 and frame["link_rates_hidden"] == 3
    [row] = frame["link_rates"]
    assert row == {"host": "h3", "rank": 3, "peer": 0, "interface": "eth1", "connection": 1,
                   "bytes_per_second": 11.5e6, "bits_per_second": 92e6, "ratio": 0.43,
                   "slow": True}
    text = top.render(frame)
    [line] = [x for x in text.splitlines() if x.startswith("h3 ")]
    assert line.split() == ["h3", "3", "0", "eth1", "1", "92.0", "Mbit/s", "11.5", "MB/s",
                            "0.43x", "SLOW"]
    assert "4 connection rate(s) measured, 1 slow (--all lists every one)" in text
    frame = top.compute_frame(None, cur, show_all=True)
    assert [(r["rank"], r["interface"], r["slow"]) for r in frame["link_rates"]] == [
        (0, "eth0", False), (0, "eth1", False), (3, "eth0", False), (3, "eth1", True)]
    assert frame["link_rates_hidden"] == 0
    json.dumps(frame, allow_nan=False)
    frame = top.compute_frame(None, cur[:1])
    assert frame["link_rates"] == [] and frame["slow_links"] == 0
    assert "2 connection rate(s) measured, none slow" in top.render(frame)
    assert "connection rate" not in top.render(known_frame())


def late_text(r, slowest, late=(), waited=()):
    """The slow-rank series of rank ``r``: its group's verdict ``slowest`` (-1: nobody),
    ``late`` rows (late_rank, share, mean seconds), ``waited`` rows (peer, seconds)."""
    ids = SERIES.format(r=r)
    lines = ["# TYPE linerate_slowest_rank gauge", f"linerate_slowest_rank{{{ids}}} {slowest}",
             "# TYPE linerate_slow_window_collectives gauge",
             f"linerate_slow_window_collectives{{{ids}}} 64",
             "# TYPE linerate_rank_late_ratio gauge", "# TYPE linerate_rank_lateness_seconds gauge"]
    for q, share, mean in late:
        lines.append(f'linerate_rank_late_ratio{{{ids},late_rank="{q}"}} {share}')
        lines.append(f'linerate_rank_lateness_seconds{{{ids},late_rank="{q}"}} {mean}')
    lines.append("# TYPE linerate_peer_wait_seconds_total counter")
    for q, w in waited:
        lines.append(f'linerate_peer_wait_seconds_total{{{ids},peer="{q}"}} {w}')
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(10)
def test_the_slow_rank_and_the_waits_for_it():
    prev = [scrape_of(late_text(0, -1, waited=[(1, 0.0), (2, 1.0)]), 0.0, "http://h0:9400/metrics"),
            scrape_of(late_text(1, -1, waited=[(0, 0.0), (2, 1.0)]), 0.0, "http://h1:9400/metrics")]
    cur = [scrape_of(late_text(0, 2, [(2, 0.94, 0.0382)], [(1, 0.001), (2, 1.5)]), 1.0,
                     "http://h0:9400/metrics"),
           scrape_of(late_text(1, 2, [(2, 0.94, 0.0382)], [(0, 0.0), (2, 1.4)]), 1.0,
                     "http://h1:9400/metrics")]
    frame = top.compute_frame(prev, cur)
    assert frame["late_rank"] == {"rank": 2, "named_by": 2, "watched": 2, "collectives": 64,
                                  "share": 0.94, "mean_late_seconds": 0.0382}
    assert [(p["rank"], p["peer"], round(p["waited_per_second"], 3)) for p in frame["peers"]] \
        == [(0, 2, 0.5), (1, 2, 0.4)]
    assert frame["peers_hidden"] == 2  # the peers nobody waited for
    text = top.render(frame)
    assert ("SLOW RANK  rank 2 entered last in 94% of the last 64 collectives, 38.2 ms late on "
            "average  (named by 2/2 ranks)") in text
    [line] = [x for x in text.splitlines() if x.startswith("h0 ")]
    assert line.split()[-1] == "50.0%"
    frame = top.compute_frame(None, [scrape_of(late_text(0, -1), 1.0)])
    assert frame["late_rank"]["rank"] is None
    assert "SLOW RANK  none named (1 rank(s) watching, 64 collectives in the window)" \
        in top.render(frame)
    json.dumps(frame, allow_nan=False)
    assert top.compute_frame(None, [scrape_of(link_text(0, 0, None, 0), 1.0)])["late_rank"] is None


# ----------------------------------------------------------------------------- histograms
@pytest.mark.timeout(10)
def test_histogram_quantile():
    inf = math.inf
    b = {0.001: 0.0, 0.0025: 50.0, 0.005: 90.0, 0.01: 100.0, inf: 100.0}
    assert top.histogram_quantile(0.99, b) == pytest.approx(0.0095)
    assert top.histogram_quantile(0.5, b) == pytest.approx(0.0025)
    assert top.histogram_quantile(0.25, b) == pytest.approx(0.00175)
    # in the first bucket: from 0 to its bound
    assert top.histogram_quantile(0.5, {0.002: 10.0, inf: 10.0}) == pytest.approx(0.001)
    # in the +Inf bucket: the largest finite bound
    assert top.histogram_quantile(0.99, {0.1: 50.0, 1.0: 90.0, inf: 100.0}) == 1.0
    assert top.histogram_quantile(0.99, {0.1: 0.0, inf: 0.0}) is None
    assert top.histogram_quantile(0.99, {}) is None
    # a dip (buckets reset separately) is flattened, never a negative bucket
    assert top.histogram_quantile(0.5, {0.1: 10.0, 0.2: 4.0, 0.4: 20.0, inf: 20.0}) == \
        pytest.approx(0.1)


def hist_text(r, n, mean, fractions, op="all_reduce", size_bytes=None, busbw=None,
              buckets=("4KiB",)):
    """``n`` collectives of mean ``mean`` s on rank r, spread over ``buckets`` size buckets;
    ``fractions``: cumulative share at each le."""
    lines = ["# TYPE linerate_collective_seconds histogram"]
    for sb in buckets:
        lab = f'{SERIES.format(r=r)},op="{op}",algorithm="ring",size_bucket="{sb}"'
        share = n / len(buckets)
        for le, f in fractions:
            lines.append(f'linerate_collective_seconds_bucket{{{lab},le="{le}"}} {share * f}')
        lines.append(f'linerate_collective_seconds_bucket{{{lab},le="+Inf"}} {share}')
        lines.append(f"linerate_collective_seconds_count{{{lab}}} {share}")
        lines.append(f"linerate_collective_seconds_sum{{{lab}}} {share * mean}")
    if size_bytes is not None:
        lines += ["# TYPE linerate_collective_bytes_total counter",
                  f'linerate_collective_bytes_total{{{SERIES.format(r=r)},op="{op}"}} '
                  f"{n * size_bytes}"]
    if busbw is not None:
        lines += ["# TYPE linerate_bus_bandwidth_bytes_per_second gauge",
                  f'linerate_bus_bandwidth_bytes_per_second{{{SERIES.format(r=r)},op="{op}"}} '
                  f"{busbw}"]
    return "\n".join(lines) + "\n"


FAST = ((0.001, 0.0), (0.0025, 0.5), (0.005, 0.9), (0.01, 1.0), (0.025, 1.0))
SLOW = ((0.001, 0.0), (0.0025, 0.2), (0.005, 0.8), (0.01, 0.95), (0.025, 1.0))


@pytest.mark.timeout(10)
def test_collectives_rates_latency_p99_and_slowest():
    prevs = [scrape_of(hist_text(0, 100, 0.002, FAST, size_bytes=1 << 20, busbw=3e9,
                                 buckets=("4KiB", "1MiB")), 0.0, "http://a:1/metrics"),
             scrape_of(hist_text(1, 5000, 0.1, SLOW, size_bytes=1 << 20, busbw=2e9),
                       0.0, "http://a:2/metrics")]
    # rank 0: +400 at 2 ms in 2 s; rank 1 restarted: 400 at 3 ms since
    curs = [scrape_of(hist_text(0, 500, 0.002, FAST, size_bytes=1 << 20, busbw=3.5e9,
                                buckets=("4KiB", "1MiB")), 2.0, "http://a:1/metrics"),
            scrape_of(hist_text(1, 400, 0.003, SLOW, size_bytes=1 << 20, busbw=2.5e9),
                      2.0, "http://a:2/metrics")]
    frame = top.compute_frame(prevs, curs)
    [op] = frame["ops"]
    assert op["op"] == "all_reduce" and op["ranks"] == 2
    assert op["collectives_per_second"] == pytest.approx(200.0)
    assert op["collectives"] == pytest.approx(800.0)
    assert op["mean_latency_seconds"] == pytest.approx(0.0025)
    assert op["mean_size_bytes"] == pytest.approx(1 << 20)
    assert op["busbw_min_bytes_per_second"] == 2.5e9
    assert op["busbw_max_bytes_per_second"] == 3.5e9
    # pooled cumulative shares: .35 at 2.5 ms, .85 at 5 ms, .975 at 10 ms, 1 at 25 ms
    assert op["p99_seconds"] == pytest.approx(0.01 + 0.015 * 0.015 / 0.025)
    r0, r1 = op["per_rank"]
    assert r0["p99_seconds"] == pytest.approx(0.0095)
    assert r1["p99_seconds"] == pytest.approx(0.01 + 0.015 * 0.04 / 0.05)
    assert frame["slowest"] == {"op": "all_reduce", "rank": 1, "host": "h1",
                                "mean_latency_seconds": pytest.approx(0.003),
                                "p99_seconds": pytest.approx(0.022)}


@pytest.mark.timeout(10)
def test_idle_op_keeps_its_row_without_latency():
    prev = scrape_of(hist_text(0, 10, 0.001, FAST, op="broadcast", busbw=1e9), 0.0)
    cur = scrape_of(hist_text(0, 10, 0.001, FAST, op="broadcast", busbw=1e9), 1.0)
    frame = top.compute_frame([prev], [cur])
    [op] = frame["ops"]
    assert op["collectives_per_second"] == 0.0
    assert op["mean_latency_seconds"] is None and op["p99_seconds"] is None
    assert frame["slowest"] is None
    assert "broadcast" in top.render(frame)


# ----------------------------------------------------------------------------- rendering
def known_frame():
    return {
        "time": 0.0, "interval_seconds": 1.0, "up": 3,
        "endpoints": [
            {"url": "http://n1:9400/metrics", "up": True, "error": None, "host": "n1",
             "rank": 0, "rates": True, "info": {"version": "0.1.0", "transport": "tcp"},
             "series": 20},
            {"url": "http://n2:9400/metrics", "up": True, "error": None, "host": "n2",
             "rank": 1, "rates": True, "info": {"version": "0.1.0", "transport": "tcp"},
             "series": 20},
            {"url": "http://n4:9400/metrics", "up": True, "error": None, "host": "n4",
             "rank": None, "rates": True, "info": {}, "series": 0},
            {"url": "http://n3:9400/metrics", "up": False, "error": "Connection refused",
             "host": "n3", "rank": None, "rates": False, "info": {}, "series": 0}],
        "links": [
            {"host": "n1", "rank": 0, "interface": "eth0", "direction": "tx",
             "bytes_per_second": 1.17625e9, "bits_per_second": 9.41e9,
             "capacity_bytes_per_second": 1.25e9, "utilization": 0.941,
             "utilization_source": "counters"},
            {"host": "n1", "rank": 0, "interface": "lo", "direction": "rx",
             "bytes_per_second": 52e3, "bits_per_second": 416e3,
             "capacity_bytes_per_second": None, "utilization": None,
             "utilization_source": None}],
        "ops": [{"op": "all_reduce", "ranks": 2, "collectives_per_second": 412.0,
                 "collectives": 412.0, "mean_latency_seconds": 0.00241,
                 "p99_seconds": 0.0049, "mean_size_bytes": 1048576.0,
                 "busbw_min_bytes_per_second": 3.2e9, "busbw_max_bytes_per_second": 3.31e9,
                 "per_rank": []}],
        "slowest": {"op": "all_reduce", "rank": 1, "host": "n2",
                    "mean_latency_seconds": 0.0026, "p99_seconds": 0.0051},
        "peers": [{"host": "n2", "rank": 1, "peer": 0, "retransmits_per_second": 12.0,
                   "retransmits_total": 40.0, "send_queue_bytes": 2 * 1048576.0}],
        "peers_hidden": 1,
    }


@pytest.mark.timeout(10)
def test_render_known_frame():
    text = top.render(known_frame())
    assert "3/4 endpoints up" in text and "transport=tcp version=0.1.0" in text
    [tx] = [line for line in text.splitlines() if " eth0 " in line]
    for figure in ("n1", "tx", "9.41 Gbit/s", "1.18 GB/s", "10.0 Gbit/s", "94.1%",
                   "[#########"):
        assert figure in tx, figure
    [lo] = [line for line in text.splitlines() if " lo " in line]
    assert "416 kbit/s" in lo and "52.0 kB/s" in lo and lo.rstrip().endswith("-")
    [ar] = [line for line in text.splitlines() if line.startswith("all_reduce")]
    for figure in ("412.0", "2.41 ms", "4.90 ms", "1.00 MiB", "3.20 GB/s", "3.31 GB/s"):
        assert figure in ar, figure
    assert "slowest: all_reduce on rank 1 (n2)  mean 2.60 ms  p99 5.10 ms" in text
    [peer] = [line for line in text.splitlines() if line.startswith("n2")]
    assert peer.split() == ["n2", "1", "0", "12.0", "2.00", "MiB", "-"]
    assert "1 peer(s) without retransmits, queued bytes or waits not shown (--all)" in text
    assert "DOWN   http://n3:9400/metrics  Connection refused" in text
    assert "EMPTY  http://n4:9400/metrics  answers, but with no linerate_* series" in text


@pytest.mark.timeout(10)
def test_formatting_and_fit():
    assert top.format_bits(1.25e9) == "10.0 Gbit/s"
    assert top.format_bits(124.99e6) == "1000 Mbit/s" or top.format_bits(124.99e6) == \
        "1.00 Gbit/s"
    assert top.format_bits(0.0) == "0 bit/s" and top.format_bits(None) == "-"
    assert top.format_byte_rate(2.5e9) == "2.50 GB/s"
    assert top.format_bytes(4096) == "4.00 KiB"
    assert top.format_seconds(0.0025) == "2.50 ms" and top.format_seconds(3e-6) == "3.00 us"
    assert top.format_seconds(12.0) == "12.0 s"
    assert top.bar(0.5) == "[#####     ]" and top.bar(None) == ""
    assert top.bar(1.3) == "[#########!]"
    text = top.fit("a" * 50 + "\n" + "\n".join("x" for _ in range(30)) + "\n", 20, 10)
    lines = text.splitlines()
    assert len(lines) == 9 and len(lines[0]) == 19 and "more lines" in lines[-1]
    frame = top.compute_frame(None, [down(0.0)])
    assert frame["up"] == 0 and "DOWN" in top.render(frame)
    json.dumps(frame, allow_nan=False)


@pytest.mark.timeout(10)
def test_live_frame_redraws_in_place(monkeypatch, capsys):
    monkeypatch.setattr(top.shutil, "get_terminal_size", lambda: os.terminal_size((60, 12)))
    args = cli.build_parser().parse_args(["top"])
    top._emit(known_frame(), args, live=True)
    out = capsys.readouterr().out
    assert out.startswith("\x1b[H") and out.endswith("\x1b[J")
    lines = out[len("\x1b[H"):-len("\x1b[J")].split("\x1b[K\n")
    assert len(lines) == 12 and lines[-1] == ""  # 11 lines: a row left for the cursor
    assert all(len(line) < 60 for line in lines) and "more lines" in lines[-2]


# ----------------------------------------------------------------------------- fake ranks
class FakeRank:
    """A collector whose counters grow at known rates (per second since it started)."""

    TX = {0: 100e6, 1: 150e6}      # bytes/s, over two connections
    RX = {0: 150e6, 1: 100e6}
    OPS = 200.0                    # all_reduce per second on each rank
    MEAN = {0: 0.002, 1: 0.003}
    HIST = {0: FAST, 1: SLOW}
    BUSBW = {0: 3e9, 1: 2.5e9}

    def __init__(self, rank):
        self.rank, self.t0 = rank, time.monotonic()

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        r, e = self.rank, time.monotonic() - self.t0 + 1.0  # + 1 s: nonzero from the start
        ident = [str(r), f"fake{r}"]
        info = GaugeMetricFamily("linerate_info", "", labels=["rank", "host", "version",
                                                              "transport", "nsocks",
                                                              "algorithm"])
        info.add_metric(ident + ["0.1.0", "tcp", "2", "ring"], 1)
        yield info
        peer = str(1 - r)
        for name, rate in (("linerate_sent_bytes", self.TX[r]),
                           ("linerate_received_bytes", self.RX[r])):
            c = CounterMetricFamily(name, "", labels=["rank", "host", "peer", "interface",
                                                      "connection"])
            for conn in ("0", "1"):
                c.add_metric(ident + [peer, "lo", conn], rate / 2 * e)
            yield c
        if r == 0:  # rank 1 knows no capacity
            g = GaugeMetricFamily("linerate_link_capacity_bytes_per_second", "",
                                  labels=["rank", "host", "interface"])
            g.add_metric(ident + ["lo"], 1.25e9)
            yield g
        h = HistogramMetricFamily("linerate_collective_seconds", "",
                                  labels=["rank", "host", "op", "algorithm", "size_bucket"])
        n = self.OPS * e
        buckets = [(repr(le), n * f) for le, f in self.HIST[r]] + [("+Inf", n)]
        h.add_metric(ident + ["all_reduce", "ring", "1MiB"], buckets, n * self.MEAN[r])
        yield h
        c = CounterMetricFamily("linerate_collective_bytes", "", labels=["rank", "host", "op"])
        c.add_metric(ident + ["all_reduce"], n * (1 << 20))
        yield c
        g = GaugeMetricFamily("linerate_bus_bandwidth_bytes_per_second", "",
                              labels=["rank", "host", "op"])
        g.add_metric(ident + ["all_reduce"], self.BUSBW[r])
        yield g
        c = CounterMetricFamily("linerate_tcp_retransmits", "", labels=["rank", "host", "peer"])
        c.add_metric(ident + [peer], 5.0 * e if r == 0 else 7.0)
        yield c
        g = GaugeMetricFamily("linerate_send_queue_bytes", "", labels=["rank", "host", "peer"])
        g.add_metric(ident + [peer], 4096.0 if r == 1 else 0.0)
        yield g


@pytest.fixture
def fake_ranks():
    """Two fake ranks on consecutive free ports; yields the first port."""
    from prometheus_client import CollectorRegistry, start_http_server

    for _ in range(50):
        base = free_port()
        servers = []
        try:
            for r in range(2):
                registry = CollectorRegistry()
                registry.register(FakeRank(r))
                servers.append(start_http_server(base + r, "127.0.0.1", registry)[0])
        except OSError:
            for s in servers:
                s.shutdown()
                s.server_close()
            continue
        break
    else:
        pytest.fail("no two consecutive free ports in 50 tries")
    try:
        yield base
    finally:
        stoppers = [threading.Thread(target=s.shutdown) for s in servers]  # 0.5 s polls each
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        for s in servers:
            s.server_close()


@pytest.mark.timeout(180)  # a hang: run_top's own bound is 120 s
def test_once_json_against_fake_ranks(fake_ranks):
    """The rates divide what a rank's counters grew by the time between its two scrapes as
    top saw it; the fake's counters grow with the time the fake saw. The two clocks agree
    only as far as the machine's load lets both processes run on time, so the figures are
    checked where the clocks cancel: ratios of one rank's figures (one increase over one
    interval) are exact, pooled figures lie between the ranks' own. Each rate's size is only
    checked to be within 2x (units, not timing: that belongs in benchmarks)."""
    base, closed = fake_ranks, free_port()
    p = run_top("--once", "--json", "--interval", "1", f"127.0.0.1:{base}-{base + 1}",
                f"127.0.0.1:{closed}")
    assert p.returncode == 0, p.stderr
    frame = json.loads(p.stdout)
    assert frame["up"] == 2
    assert frame["interval_seconds"] > 0
    dead = frame["endpoints"][2]
    assert not dead["up"] and dead["url"] == f"http://127.0.0.1:{closed}/metrics"
    assert dead["error"]
    assert [(e["rank"], e["host"]) for e in frame["endpoints"][:2]] == [(0, "fake0"),
                                                                        (1, "fake1")]
    exact = 1e-9
    [op] = frame["ops"]
    assert op["op"] == "all_reduce"
    r0, r1 = op["per_rank"]
    peers = {(x["rank"], x["peer"]): x for x in frame["peers"]}
    assert set(peers) == {(0, 1), (1, 0)}  # rank 1: no retransmits but a queue
    for r, mine in ((0, r0), (1, r1)):
        tx, rx = link(frame, r, "tx", "lo"), link(frame, r, "rx", "lo")
        # this rank's own clock: its tx rate; everything else of it in proportion
        scale = tx["bytes_per_second"] / FakeRank.TX[r]
        assert 0.5 < scale < 2, (r, scale)
        assert rx["bytes_per_second"] == pytest.approx(FakeRank.RX[r] * scale, rel=exact)
        assert mine["collectives_per_second"] == pytest.approx(FakeRank.OPS * scale, rel=exact)
        if r == 0:
            assert tx["utilization"] == pytest.approx(tx["bytes_per_second"] / 1.25e9, rel=exact)
            assert peers[(0, 1)]["retransmits_per_second"] == pytest.approx(5.0 * scale, rel=exact)
    assert link(frame, 1, "tx", "lo")["utilization"] is None
    assert op["collectives_per_second"] == pytest.approx(
        (r0["collectives_per_second"] + r1["collectives_per_second"]) / 2, rel=exact)
    # one rank's ratios of deltas over the same interval: exact whatever the timing
    assert r0["mean_latency_seconds"] == pytest.approx(0.002, rel=1e-6)
    assert r1["mean_latency_seconds"] == pytest.approx(0.003, rel=1e-6)
    assert r0["p99_seconds"] == pytest.approx(0.0095, rel=1e-6)
    assert r1["p99_seconds"] == pytest.approx(0.022, rel=1e-6)
    # pooled over ranks, each weighted by its count in its own interval: between the two
    assert 0.002 < op["mean_latency_seconds"] < 0.003
    assert 0.0095 <= op["p99_seconds"] <= 0.022
    assert op["mean_size_bytes"] == pytest.approx(1 << 20, rel=1e-6)
    assert (op["busbw_min_bytes_per_second"], op["busbw_max_bytes_per_second"]) == (2.5e9, 3e9)
    assert frame["slowest"]["rank"] == 1
    assert frame["slowest"]["p99_seconds"] == pytest.approx(0.022, rel=1e-6)
    assert peers[(1, 0)]["retransmits_per_second"] == 0.0
    assert peers[(1, 0)]["send_queue_bytes"] == 4096.0


@pytest.mark.timeout(300)  # a hang: two commands of up to 120 s each
def test_table_frames_and_ctrl_c(fake_ranks):
    base = fake_ranks
    p = run_top("--count", "2", "--interval", "0.3", f"127.0.0.1:{base}-{base + 1}")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("linerate top ") == 2 and "\x1b[" not in p.stdout
    assert "slowest: all_reduce on rank 1 (fake1)" in p.stdout
    assert "nsocks=2" in p.stdout
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "linerate.tools.cli", "top", "--interval", "0.2",
                             "--json", f"127.0.0.1:{base}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # one frame: it is running
        assert json.loads(first)["up"] == 1
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.timeout(180)  # a hang: run_top's own bound is 120 s
def test_nothing_answers_exits_1():
    p = run_top("--once", "--interval", "0.1", f"127.0.0.1:{free_port()}")
    assert p.returncode == 1
    assert p.stdout.count("DOWN   http://127.0.0.1:") == 1
    assert "0/1 endpoints up" in p.stdout and "Traceback" not in p.stderr


# ----------------------------------------------------------------------------- real ranks
consecutive_free_ports = free_port_range


def _all_reduce_until_told(rank, world, lr, base, stop_file, max_s):
    """Serve metrics, then all_reduce 1 MiB until the test's frame is taken (``stop_file``
    exists) or ``max_s`` passed; rank 0 decides, in the last element, so that both ranks run
    the same number of collectives."""
    import torch
    import torch.distributed as dist
    from linerate.transport import metrics

    metrics.start_exporter(base + rank, "127.0.0.1")
    x = torch.empty(1 << 18)
    deadline = time.monotonic() + max_s
    n = 0
    while True:
        x.fill_(1.0)
        if rank == 0 and (os.path.exists(stop_file) or time.monotonic() > deadline):
            x[-1] = 1e9
        dist.all_reduce(x, group=lr)
        n += 1
        if x[-1] >= 1e9:
            return n


@pytest.mark.timeout(280)  # a hang: the ranks stop once the frame is taken, at most after 150 s
@pytest.mark.parametrize("shm", ["0", "1"])
def test_once_json_against_real_linerate_ranks(tmp_path, shm):
    """TCP links (LINERATE_SHM=0, loopback) and the shared segment (interface shm, whose
    capacity is the memory copy rate: a utilization too)."""
    from _harness import run_ranks

    base = consecutive_free_ports(2)
    stop_file = str(tmp_path / "stop")
    got: dict = {}

    def watch():
        try:
            urls = top.parse_endpoint(f"127.0.0.1:{base}-{base + 1}")
            deadline = time.monotonic() + 120
            while not all(top.scrape(u, 0.5).ok for u in urls):  # ranks still starting
                assert time.monotonic() < deadline, "the exporters never answered"
                time.sleep(0.2)
            got["run"] = run_top("--once", "--json", "--interval", "1",
                                 f"127.0.0.1:{base}-{base + 1}")
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            got["error"] = e
        finally:
            open(stop_file, "w").close()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    counts = run_ranks(_all_reduce_until_told, 2, base, stop_file, 150.0, timeout=200,
                       backend="linerate", env={"LINERATE_SHM": shm})
    watcher.join(timeout=10)
    assert "error" not in got, got.get("error")
    p = got["run"]
    assert p.returncode == 0, p.stderr
    frame = json.loads(p.stdout)
    assert counts[0] == counts[1] > 0
    assert frame["up"] == 2 and [e["rank"] for e in frame["endpoints"]] == [0, 1]
    iface = "shm" if shm == "1" else "lo"
    for r in (0, 1):
        tx = sum(x["bytes_per_second"] or 0 for x in frame["links"]
                 if x["rank"] == r and x["direction"] == "tx" and x["interface"] == iface)
        rx = sum(x["bytes_per_second"] or 0 for x in frame["links"]
                 if x["rank"] == r and x["direction"] == "rx" and x["interface"] == iface)
        assert tx > 0 and rx > 0, frame["links"]
        if shm == "1":
            assert all(x["capacity_bytes_per_second"] and x["utilization"] is not None
                       for x in frame["links"] if x["rank"] == r), frame["links"]
    [ar] = [op for op in frame["ops"] if op["op"] == "all_reduce"]
    assert ar["ranks"] == 2 and ar["collectives_per_second"] > 0
    assert ar["mean_latency_seconds"] > 0 and ar["p99_seconds"] > 0
    assert ar["mean_size_bytes"] == pytest.approx(1 << 20)
    assert ar["busbw_min_bytes_per_second"] > 0
    assert frame["slowest"]["op"] == "all_reduce"
