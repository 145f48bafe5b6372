"""tools.linkprobe (raw TCP capacity of the ring links) and `linerate bench --raw/--plot`."""
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from linerate.tools.bench_report import Result, Row, Table
from linerate.tools.linkprobe import (DEFAULT_GRACE_S, LinkProbeError, _iperf_received,
                                      format_lines, probe_ring)

from test_bench_cli import run_cli, table_rows

ROOT = Path(__file__).resolve().parent.parent


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
        # first to last byte the receiver saw, of a 0.5 s transfer: a loaded machine
        # stretches or shrinks it, the phase bound (seconds + DEFAULT_GRACE_S) caps it
        assert 0 < rail.seconds < 0.5 + DEFAULT_GRACE_S
        assert rail.nbytes > 0 and rail.gbit_s == pytest.approx(rail.nbytes * 8 / rail.seconds / 1e9)
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


def _iperf3_children() -> list[int]:
    """The iperf3 processes that are this process's children."""
    me, found = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name == "iperf3" and int(rest.split()[1]) == me:
            found.append(int(pid))
    return found


@pytest.mark.processes  # the probe starts iperf3 servers and clients (tools/linkprobe.py)
@pytest.mark.timeout(90)  # a hang: each phase is bounded by 1 s + DEFAULT_GRACE_S
def test_probe_loopback_with_iperf3(monkeypatch):
    """tool="iperf3": a real iperf3 server and client per link, on 127.0.0.1; the figures are
    the receiving end's, and no iperf3 process is left behind."""
    if shutil.which("iperf3") is None:
        pytest.skip("iperf3 is not installed (tools/quickstart.sh installs it; apt-get install iperf3)")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    out = run_ranks(2, seconds=1.0, streams=2, tool="iperf3")
    for r in out.values():
        assert not isinstance(r, Exception), r
    assert out[0].to_dict() == out[1].to_dict()
    res = out[0]
    assert res.tool == "iperf3"
    assert [(link.src, link.dst) for link in res.links] == [(0, 1), (1, 0)]
    for link in res.links:
        (rail,) = link.rails
        assert rail.src_addr == rail.dst_addr == "127.0.0.1"
        assert rail.nbytes > 0 and rail.seconds > 0
        assert 0.05 < link.gbit_s < 2000
    assert "2 streams, iperf3" in format_lines(res)[0]
    assert not _iperf3_children()


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
            "--min-bytes", "1M", "--max-bytes", "1M", "--backends", "gloo", "--json", str(out),
            "--plot", str(png)]  # matplotlib: the test extra
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
    assert raw["tool"] == "socket"  # as --raw-tool asked, iperf3 installed or not
    assert [(link["src"], link["dst"]) for link in raw["links"]] == [(0, 1), (1, 0)]
    fig = doc["results"][0]["backends"]["gloo"]
    assert fig["busbw_gbit_s"] == pytest.approx(fig["busbw_gbps"] * 8)
    assert fig["util"] == pytest.approx(fig["busbw_gbit_s"] / raw["capacity_gbit_s"])
    assert doc["avg_util"]["gloo"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
def test_raw_is_off_on_loopback_by_default():
    proc = run_cli("bench", "--nproc", "2", "--ops", "all_reduce", "--min-bytes", "64K",
                   "--max-bytes", "64K", "--backends", "gloo")
    assert proc.returncode == 0, proc.stderr
    assert "# raw link capacity: off (all ranks on one host" in proc.stdout
    assert "util" not in proc.stdout


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    """matplotlib hidden from the command (an entry None in sys.modules: neither importable
    nor found), whether or not it is installed."""
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from linerate.tools.cli import main; "
            f"sys.exit(main(['bench', '--nproc', '2', '--plot', {str(tmp_path / 'p.png')!r}]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The command fails before starting any rank (1.5 s idle, most of it importing torch);
    # the bound only turns a command that went on to run the benchmark into a failure, with
    # room for a loaded machine.
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr
    assert "pip install matplotlib" in proc.stderr
    assert not (tmp_path / "p.png").exists()
