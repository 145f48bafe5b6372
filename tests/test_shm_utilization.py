"""The utilization of interface ``shm`` means the same everywhere and stays at or under 1.

Its bytes are ``linerate_interface_bytes_total{interface="shm"}`` (a copy that several peers
read counts once), its capacity the host's copy rate, one figure published in the segment:
``linerate top``, the bench's interfaces table and the exporter's gauge agree on it. Under the
bench's loop at 4 ranks (every op) no rank's sample exceeds 1.0 and every rank exports the same
single capacity (tools/dev/shm_utilization.py, here for a few seconds). A utilization above
100 % comes only from a capacity set too low by hand, and the row says so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from linerate.tools import bench_report, top
from linerate.tools.dev import shm_utilization

ROOT = Path(__file__).resolve().parent.parent
SERIES = 'rank="{r}",host="h"'


def exposition(r: int, tx: float, rx: float, sent: float, cap: float, source: str) -> str:
    """Rank r's shm series: per-peer sent bytes to each of 3 peers, the interface bytes and
    the capacity with its source."""
    lines = ["# TYPE linerate_sent_bytes_total counter"]
    lines += [f'linerate_sent_bytes_total{{{SERIES.format(r=r)},peer="{q}",interface="shm",'
              f'connection="0"}} {sent}' for q in (1, 2, 3)]
    lines += ["# TYPE linerate_interface_bytes_total counter",
              f'linerate_interface_bytes_total{{{SERIES.format(r=r)},interface="shm",'
              f'direction="tx"}} {tx}',
              f'linerate_interface_bytes_total{{{SERIES.format(r=r)},interface="shm",'
              f'direction="rx"}} {rx}',
              "# TYPE linerate_link_capacity_bytes_per_second gauge",
              f'linerate_link_capacity_bytes_per_second{{{SERIES.format(r=r)},interface="shm",'
              f'source="{source}"}} {cap}']
    return "\n".join(lines) + "\n"


def scrape_of(text: str, t: float) -> top.Scrape:
    return top.Scrape("http://h:9400/metrics", t, samples=top.parse_metrics(text))


@pytest.mark.timeout(10)
def test_top_rates_shm_by_the_bytes_written_once():
    """A broadcast root's 3 peers each got 1 GB (per peer) in a second while it wrote 1 GB
    once: the row's rate and utilization are the latter's."""
    prev = scrape_of(exposition(0, 0, 0, 0, 8e9, "measured"), 0.0)
    cur = scrape_of(exposition(0, 1e9, 0, 1e9, 8e9, "measured"), 1.0)
    frame = top.compute_frame([prev], [cur])
    [tx] = [x for x in frame["links"] if x["direction"] == "tx"]
    assert tx["interface"] == "shm" and tx["bytes_per_second"] == pytest.approx(1e9)
    assert tx["utilization"] == pytest.approx(0.125) and tx["utilization_source"] == "counters"
    assert tx["capacity_source"] == "measured" and tx["note"] is None
    assert "too low" not in top.render(frame)


@pytest.mark.timeout(10)
def test_top_says_when_a_capacity_set_by_hand_is_too_low():
    prev = scrape_of(exposition(0, 0, 0, 0, 5e8, "setting"), 0.0)
    cur = scrape_of(exposition(0, 1e9, 0, 1e9, 5e8, "setting"), 1.0)
    frame = top.compute_frame([prev], [cur])
    [tx] = [x for x in frame["links"] if x["direction"] == "tx"]
    assert tx["utilization"] == pytest.approx(2.0)
    assert tx["note"] == "capacity set by LINERATE_LINK_CAPACITY is too low"
    [line] = [x for x in top.render(frame).splitlines() if "shm" in x and " tx " in x]
    assert "[#########!]" in line and line.endswith("capacity set by LINERATE_LINK_CAPACITY "
                                                    "is too low")


@pytest.mark.timeout(10)
def test_bench_interface_table():
    entry = {"rank": 0, "busy_s": 2.0, "links": [], "interfaces": [
        {"interface": "shm", "tx_bytes": 4_000_000_000, "rx_bytes": 1_000_000_000,
         "capacity_bytes_per_second": 4e9, "capacity_source": "measured"}]}
    head, cols, row = bench_report.interface_lines("linerate", [entry])
    assert head.startswith("# linerate interfaces:") and "once however many read" in head
    assert row.split() == ["#", "0", "shm", "4000000000", "1000000000", "2.000", "0.500",
                           "32.00", "50.0%", "12.5%"]
    low = dict(entry["interfaces"][0], capacity_bytes_per_second=1e9, capacity_source="setting")
    *_, row = bench_report.interface_lines("linerate", [dict(entry, interfaces=[low])])
    assert "200.0%" in row and row.endswith("capacity set by LINERATE_LINK_CAPACITY is too low")
    assert bench_report.interface_lines("linerate", [dict(entry, interfaces=[])]) == []
    lines = bench_report.link_lines("linerate", [dict(entry, shared_memory=True)])
    assert any(line.startswith("# linerate interfaces:") for line in lines)
    assert all(line.startswith("#") for line in lines)


@pytest.mark.timeout(10)
def test_verdict_names_samples_above_one_and_disagreeing_capacities():
    ok = {"scrapes": 3, "gauge": {"0 tx": [0.2, 0.9]}, "counters": {"0 tx": [0.5]},
          "capacities": [4e10], "bad_capacity": []}
    assert shm_utilization.verdict(ok) == []
    over = dict(ok, gauge={"0 tx": [0.2, 1.3]})
    assert shm_utilization.verdict(over) == [
        "rank/direction 0 tx: 1 gauge samples above 1.0 (max 1.300)"]
    two = dict(ok, capacities=[4e10, 5e10])
    assert "2 shm capacities" in shm_utilization.verdict(two)[0]


@pytest.mark.timeout(240)
def test_bench_loop_at_4_ranks_keeps_every_shm_sample_at_or_under_one():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "linerate.tools.dev.shm_utilization",
                           "--nproc", "4", "--seconds", "12", "--interval", "0.5",
                           "--max-bytes", "8M", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    figures = json.loads(proc.stdout)
    assert figures["wrong"] == [], figures
    assert proc.returncode == 0
    ranks = {key.split()[0] for key in figures["gauge"]}
    assert ranks == {"0", "1", "2", "3"}, figures["gauge"]
    assert len(figures["capacities"]) == 1 and figures["capacities"][0] > 2e8, figures
    # every rank's gauge sampled its windows throughout, and showed the traffic
    assert all(len(v) >= 8 for v in figures["gauge"].values()), figures["gauge"]
    assert all(max(v) > 0 for v in figures["gauge"].values()), figures["gauge"]
