"""tools.linkprobe (raw TCP capacity of the ring links) and `linerate bench --raw/--plot`."""
import importlib.util
import json
import os
import threading

import pytest
import torch.distributed as dist

from linerate.tools.bench_report import Result, Row, Table
from linerate.tools.linkprobe import LinkProbeError, _iperf_received, format_lines, probe_ring

from test_bench_cli import run_cli, table_rows

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def open_sockets() -> set:
    """This process's open sockets (their inodes). Compared as sets: a socket of an earlier
    test that closes meanwhile (a lazily linked group's listener going with its collection) is
    not one the probe left open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def run_ranks(world, **kwargs):
    """probe_ring on ``world`` threads sharing one store; {rank: result or exception}."""
    store = dist.HashStore()
    out = {}

    def rank_main(rank):
        try:
            out[rank] = probe_ring(store, rank, world, ifnames=[], **kwargs)
        except Exception as e:  # reported to the test below
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("simultaneous", [True, False])
def test_probe_loopback(simultaneous, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    before = open_sockets()
    out = run_ranks(2, seconds=0.5, streams=2, tool="socket", simultaneous=simultaneous)
    assert not open_sockets() - before
    for r in out.values():
        assert not isinstance(r, Exception), r
    assert out[0].to_dict() == out[1].to_dict()  # every rank gets the same answer
    res = out[0]
    assert [(link.src, link.dst) for link in res.links] == [(0, 1), (1, 0)]
    for link in res.links:
        (rail,) = link.rails
        assert rail.src_addr == rail.dst_addr == "127.0.0.1"
        assert 0.3 < rail.seconds < 1.5  # first to last byte, of a 0.5 s transfer
        assert 0.05 < link.gbit_s < 2000  # loopback: from a busy CI box to memory speed
    assert res.capacity_gbit_s == min(link.gbit_s for link in res.links)
    lines = format_lines(res)
    assert lines[0].startswith("# raw link capacity: ") and "2 streams, socket" in lines[0]
    assert len(lines) == 3 and "link 1 -> 0" in lines[2]


@pytest.mark.timeout(30)
def test_probe_missing_rank_is_named(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    before = open_sockets()
    with pytest.raises(LinkProbeError, match="rank 0: link probe timed out waiting for"):
        probe_ring(dist.HashStore(), 0, 2, ifnames=[], seconds=0.2, timeout=0.5)
    assert not open_sockets() - before


def test_iperf3_json_uses_the_receiver_figures():
    doc = {"end": {"sum_sent": {"bits_per_second": 9.9e9, "seconds": 2.0},
                   "sum_received": {"bits_per_second": 9.4e9, "seconds": 2.0}}}
    assert _iperf_received(doc, "rank 0 -> rank 1") == (int(9.4e9 * 2 / 8), 2.0)
    with pytest.raises(LinkProbeError, match="rank 0 -> rank 1"):
        _iperf_received({"end": {}}, "rank 0 -> rank 1")


def test_table_util_column():
    table = Table(["a", "b"], check=False, capacity_gbit_s=10.0)
    row = Row("all_reduce", 1 << 20, 1 << 18, "float32",
              [Result(1000.0, 1.0, 1.0, 5), Result(2000.0, 0.5, 0.5, 5)])
    assert "util" in table.header()[1]
    assert table.row(row).split("|")[1].split()[-2:] == ["8.00", "80.0%"]
    assert "80.0% of the raw link capacity" in table.footer([row])[0]


@pytest.mark.timeout(120)
def test_bench_raw_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--nproc", "2", "--raw", "--raw-tool", "socket", "--raw-seconds", "0.5",
            "--ops", "all_reduce",
            "--min-bytes", "1M", "--max-bytes", "1M", "--backends", "gloo", "--json", str(out)]
    if HAVE_MATPLOTLIB:
        argv += ["--plot", str(png)]
    proc = run_cli(*argv)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "# raw link capacity: " in proc.stdout and "4 streams, " in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "size(B)" in line)
    assert "busbw(Gb/s)" in header and "util" in header
    (row,) = table_rows(proc.stdout)
    assert row[1][-1].endswith("%")
    doc = json.loads(out.read_text())
    raw = doc["raw_link"]
    assert raw["capacity_gbit_s"] > 0 and raw["streams"] == 4
    assert raw["tool"] in ("socket", "iperf3")  # iperf3 when installed
    assert [(link["src"], link["dst"]) for link in raw["links"]] == [(0, 1), (1, 0)]
    fig = doc["results"][0]["backends"]["gloo"]
    assert fig["busbw_gbit_s"] == pytest.approx(fig["busbw_gbps"] * 8)
    assert fig["util"] == pytest.approx(fig["busbw_gbit_s"] / raw["capacity_gbit_s"])
    assert doc["avg_util"]["gloo"] > 0
    if HAVE_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_raw_is_off_on_loopback_by_default():
    proc = run_cli("bench", "--nproc", "2", "--ops", "all_reduce", "--min-bytes", "64K",
                   "--max-bytes", "64K", "--backends", "gloo")
    assert proc.returncode == 0, proc.stderr
    assert "# raw link capacity: off (all ranks on one host" in proc.stdout
    assert "util" not in proc.stdout


@pytest.mark.skipif(HAVE_MATPLOTLIB, reason="matplotlib is installed")
def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    proc = run_cli("bench", "--nproc", "2", "--plot", str(tmp_path / "p.png"), timeout=30)
    assert proc.returncode == 2
    assert "pip install matplotlib" in proc.stderr
