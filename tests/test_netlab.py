"""``linerate netlab``: hosts as network namespaces joined by tbf-shaped veth links.

Needs root and iproute2; skipped (with the reason) where netlab cannot work.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from linerate.tools import netlab

ROOT = Path(__file__).resolve().parent.parent

needs_netlab = pytest.mark.netlab  # skipped with the reason where netlab cannot work (conftest)


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`linerate netlab ARGV` in a fresh interpreter (seconds to start on a loaded machine:
    the tests' timeouts below are hang bounds with room for a few such commands)."""
    return subprocess.run([sys.executable, "-m", "linerate.tools.cli", "netlab", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(30)
def test_unavailable_exits_2(monkeypatch, capsys):
    """Without root, every action prints one line saying why and exits 2."""
    from linerate.tools import cli as cli_mod
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = netlab.check_prereqs()
    assert reason and "root" in reason and "\n" not in reason
    assert cli_mod.main(["netlab", "status", "--name", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "root" in err


def test_parse_rate():
    assert netlab.parse_rate("1gbit") == 10 ** 9
    assert netlab.parse_rate("200mbit") == 200 * 10 ** 6
    assert netlab.parse_rate("10mbps") == 80 * 10 ** 6
    with pytest.raises(ValueError):
        netlab.parse_rate("fast")


def mbit(bps: float) -> float:
    return bps / 1e6


@needs_netlab
@pytest.mark.timeout(300)
def test_up_status_shaping_down(lab_name):
    r = cli("up", "--hosts", "2", "--rate", "200mbit", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    lab = netlab.load(lab_name)
    assert [h.netns for h in lab.hosts] == [f"lr-{lab_name}-h0", f"lr-{lab_name}-h1"]
    assert lab.rate_bps == 200_000_000 and lab.nodes == 1 and lab.inter_rate_bps is None
    assert set(netlab.lab_netns(lab_name)) == {h.netns for h in lab.hosts} | {lab.switch_netns}

    r = cli("status", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    assert ": up" in r.stdout and "200mbit" in r.stdout
    for h in lab.hosts:
        assert h.netns in r.stdout and h.addrs[0] in r.stdout

    have_ping = shutil.which("ping") is not None
    if have_ping:
        r = cli("exec", "--name", lab_name, "h0", "ping", "-c1", "-W2", lab.hosts[1].addrs[0])
        assert r.returncode == 0, r.stdout + r.stderr

    bps = netlab.probe(lab, 0, 1, seconds=1.5)
    assert 0.80 * 200e6 <= bps <= 1.05 * 200e6, f"{mbit(bps):.1f} Mbit/s over a 200mbit link"

    r = cli("down", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    assert netlab.lab_netns(lab_name) == []
    assert not netlab.state_path(lab_name).exists()
    r = cli("down", "--name", lab_name)
    assert r.returncode == 0 and "nothing to delete" in r.stdout
    assert cli("status", "--name", lab_name).returncode != 0
    if not have_ping:  # everything else was checked
        pytest.skip("ping is not installed, so `netlab exec ... ping` was not checked "
                    "(tools/quickstart.sh installs it; apt-get install iputils-ping)")


@needs_netlab
@pytest.mark.timeout(300)
def test_unshaped_lab(lab_name):
    r = cli("up", "--hosts", "2", "--rate", "none", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    try:
        lab = netlab.load(lab_name)
        assert lab.rate_bps == 0 and "unshaped" in r.stdout
        for ns in (lab.hosts[0].netns, lab.switch_netns):
            out = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"],
                                 capture_output=True, text=True, check=True).stdout
            assert "tbf" not in out, out
        env = netlab.rank_env(lab, 0, 2, 1234, env={})
        assert "LINERATE_LINK_CAPACITY" not in env  # no shaped rate to report
        assert "unshaped" in cli("status", "--name", lab_name).stdout
    finally:
        cli("down", "--name", lab_name)


@needs_netlab
@pytest.mark.timeout(300)
def test_down_without_state_file(lab_name):
    """down works from the namespace names alone (after a crash lost the state file)."""
    netlab.up(lab_name, hosts=2, rate="100mbit")
    netlab.state_path(lab_name).unlink()
    assert len(netlab.lab_netns(lab_name)) == 3
    assert len(netlab.down(lab_name)) == 3
    assert netlab.lab_netns(lab_name) == []


@needs_netlab
@pytest.mark.timeout(300)
def test_two_rails(lab_name):
    lab = netlab.up(lab_name, hosts=2, rate="1gbit", rails=2)
    assert lab.rails == 2
    for h in lab.hosts:
        assert h.ifnames == ["eth0", "eth1"]
        out = subprocess.run(["ip", "-n", h.netns, "-o", "-4", "addr", "show"],
                             capture_output=True, text=True, check=True).stdout
        for ifname, addr in zip(h.ifnames, h.addrs):
            assert any(ifname in line and f"{addr}/" in line for line in out.splitlines()), out
    # Separate subnets: rail k is 10.77.k.0/24.
    subnets = [{a.rsplit(".", 1)[0] for a in (h.addrs[k] for h in lab.hosts)} for k in range(2)]
    assert len(subnets[0]) == 1 and len(subnets[1]) == 1 and subnets[0] != subnets[1]
    for rail in (0, 1):
        # Each rail reachable, and routed out of its own interface.
        route = subprocess.run(["ip", "-n", lab.hosts[0].netns, "route", "get",
                                lab.hosts[1].addrs[rail]], capture_output=True, text=True,
                               check=True).stdout
        assert f"dev eth{rail}" in route, route
        assert netlab.probe(lab, 0, 1, seconds=0.5, rail=rail) > 100e6


@needs_netlab
@pytest.mark.timeout(300)
def test_two_tier(lab_name):
    r = cli("up", "--hosts", "4", "--rate", "400mbit", "--nodes", "2", "--inter-rate",
            "100mbit", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    lab = netlab.load(lab_name)
    assert lab.nodes == 2 and lab.inter_rate_bps == 100_000_000
    assert [h.node for h in lab.hosts] == [0, 0, 1, 1]
    intra = netlab.probe(lab, 0, 1, seconds=1.0)
    inter = netlab.probe(lab, 1, 2, seconds=1.0)
    assert intra > 2 * inter, (mbit(intra), mbit(inter))
    assert 0.80 * 100e6 <= inter <= 1.05 * 100e6, f"inter-node {mbit(inter):.1f} Mbit/s"


SMOKE = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("linerate")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert os.environ["LINERATE_SOCKET_IFNAME"] == "eth0", os.environ["LINERATE_SOCKET_IFNAME"]
    n = 1 << 20
    t = (torch.arange(n, dtype=torch.int64) % 1000 + rank * 7).to(torch.float32)
    dist.all_reduce(t)
    expect = ((torch.arange(n, dtype=torch.int64) % 1000) * world
              + 7 * sum(range(world))).to(torch.float32)
    assert torch.equal(t, expect), (t[:8], expect[:8])
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank, os.environ["MASTER_ADDR"], flush=True)
""")


@needs_netlab
@pytest.mark.timeout(300)
def test_run_linerate_all_reduce(lab_name, tmp_path):
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    assert cli("up", "--hosts", "2", "--rate", "500mbit", "--name", lab_name).returncode == 0
    lab = netlab.load(lab_name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LINERATE_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    r = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "netlab", "run", "--name", lab_name,
                        "--nproc", "2", "--timeout", "60", str(script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] ok {rank} {lab.hosts[0].addrs[0]}" in r.stdout, r.stdout


@needs_netlab
@pytest.mark.timeout(300)
def test_run_propagates_failure(lab_name, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], os.environ['GROUP_RANK'],"
                      " os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'])\n"
                      "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    lab = netlab.up(lab_name, hosts=2, rate="100mbit")
    r = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "netlab", "run", "--name", lab_name,
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "[rank 0] rank 0 0 0 2" in r.stdout and "[rank 1] rank 1 1 0 2" in r.stdout
    assert "rank 1 exited with code 3" in r.stderr
    assert netlab.run_ranks(lab, 2, ["-c", "import sys; sys.exit(0)"], timeout=30) == 0


@needs_netlab
@pytest.mark.timeout(300)
def test_run_ctrl_c_stops_every_rank(lab_name):
    import signal
    import time
    netlab.up(lab_name, hosts=2, rate="100mbit")
    code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(300)"
    p = subprocess.Popen([sys.executable, "-m", "linerate.tools.cli", "netlab", "run", "--name", lab_name,
                          "--", "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         # SIGINT is ignored when pytest itself runs as a background job
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                         stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        for _ in range(2):
            line = p.stdout.readline()
            pids.append(int(line.split()[-1]))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    time.sleep(0.2)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"rank process {pid} left running"


# ----------------------------------------------------------------------------- ranks per host

def test_ranks_per_host_layout():
    """Ranks fill host 0 first; a list gives uneven hosts; --nproc keeps the first ranks."""
    lab = netlab.plan("lay", 3, 1, 10 ** 9)
    assert lab.layout() == [1, 1, 1]  # a lab recorded without the field: one rank per host
    lab.ranks_per_host = [2, 2, 2]
    assert netlab.resolve_layout(lab) == [2, 2, 2]
    assert netlab.resolve_layout(lab, 3) == [2, 1]
    assert netlab.resolve_layout(lab, None, "4,3") == [4, 3]
    assert netlab.resolve_layout(lab, None, 1) == [1, 1, 1]
    assert [netlab.placement([4, 3], r) for r in (0, 3, 4, 6)] == [(0, 0), (0, 3), (1, 0), (1, 2)]
    for bad in ("0", "2,x", "1,2,3,4"):
        with pytest.raises(ValueError):
            netlab.resolve_layout(lab, None, bad)
    with pytest.raises(ValueError):
        netlab.resolve_layout(lab, 7)
    env = netlab.rank_env(lab, 5, 7, 1234, env={}, layout=[4, 3])
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "LINERATE_NETLAB_HOST")} == {
        "RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LINERATE_NETLAB_HOST": "h1"}
    # Without a layout rank_env places rank i alone on host i (callers that start one process
    # per host themselves, like linerate model's CPU probe).
    env = netlab.rank_env(lab, 1, 3, 1234, env={})
    assert (env["LOCAL_RANK"], env["GROUP_RANK"], env["LINERATE_NETLAB_HOST"]) == ("0", "1", "h1")
    # A state file written before ranks per host existed still loads.
    data = lab.to_json()
    del data["ranks_per_host"]
    assert netlab.Lab.from_json(data).layout() == [1, 1, 1]


TWO_BY_TWO = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    def tx_bytes():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    dist.init_process_group("linerate")
    rank, world = dist.get_rank(), dist.get_world_size()
    e = os.environ
    print("env", *(e[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                  "GROUP_RANK", "LINERATE_NETLAB_HOST")),
          os.readlink("/proc/self/ns/net"), flush=True)
    gloo = dist.new_group(backend="gloo")
    # linerate against Gloo: integers (exact whatever the order of the sums) and floats.
    n = 1_000_003
    for dtype in (torch.int64, torch.float32):
        g = torch.Generator().manual_seed(rank)
        x = (torch.randint(-1000, 1000, (n,), generator=g).to(dtype) if dtype == torch.int64
             else torch.randn(n, generator=g))
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        ok = torch.equal(a, b) if dtype == torch.int64 else torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        assert ok, (dtype, a[:4], b[:4])
    # Shared memory between the ranks of one host, TCP over eth0 between hosts.
    cpu = torch.device("cpu")
    local = dist.new_group([0, 1]), dist.new_group([2, 3])
    cross = dist.new_group([1, 2])
    mine = local[0] if rank < 2 else local[1]
    shm_local = mine._get_backend(cpu)._ctx.shm is not None
    S = 8 << 20
    dist.barrier()
    t0 = tx_bytes()
    y = torch.ones(S // 4)
    dist.all_reduce(y, group=mine)
    assert torch.equal(y, torch.full_like(y, 2.0))
    dist.barrier()
    local_tx = tx_bytes() - t0
    shm_cross, cross_tx = None, None
    if rank in (1, 2):
        shm_cross = cross._get_backend(cpu)._ctx.shm is not None
    dist.barrier()
    t0 = tx_bytes()
    if rank in (1, 2):
        z = torch.ones(S // 4)
        dist.all_reduce(z, group=cross)
        assert torch.equal(z, torch.full_like(z, 2.0))
    dist.barrier()
    cross_tx = tx_bytes() - t0
    print("shm", rank, int(shm_local), shm_cross, local_tx, cross_tx, flush=True)
    dist.destroy_process_group()
""")


@needs_netlab
@pytest.mark.timeout(400)
def test_two_hosts_two_ranks_each(lab_name, tmp_path):
    """netlab up --ranks-per-host 2: four ranks, two per host namespace, with torchrun's
    variables; linerate's all_reduce equals Gloo's; the ranks of one host share memory (and
    leave eth0 quiet), ranks of different hosts do not (and their bytes cross eth0)."""
    script = tmp_path / "two_by_two.py"
    script.write_text(TWO_BY_TWO)
    r = cli("up", "--hosts", "2", "--rate", "1gbit", "--ranks-per-host", "2", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    assert "2 hosts x 2 ranks" in r.stdout, r.stdout
    lab = netlab.load(lab_name)
    assert lab.layout() == [2, 2]
    st = cli("status", "--name", lab_name)
    assert "ranks 0-1" in st.stdout and "ranks 2-3" in st.stdout, st.stdout
    r = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "netlab", "run", "--name",
                        lab_name, "--timeout", "150", str(script)], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    envs, shm = {}, {}
    for line in r.stdout.splitlines():
        words = line.split()
        if len(words) > 2 and words[2] == "env":
            envs[int(words[3])] = words[3:]
        elif len(words) > 2 and words[2] == "shm":
            shm[int(words[3])] = words[4:]
    assert sorted(envs) == [0, 1, 2, 3], r.stdout
    netns = {}
    for rank, (rk, world, local, lws, group, host, ns) in envs.items():
        assert (rk, world, local, lws, group, host) == (
            str(rank), "4", str(rank % 2), "2", str(rank // 2), f"h{rank // 2}")
        netns[rank] = ns
    assert netns[0] == netns[1] != netns[2] == netns[3], netns
    S = 8 << 20
    for rank, (shm_local, shm_cross, local_tx, cross_tx) in shm.items():
        assert shm_local == "1", (rank, r.stdout)  # co-located: a shared segment
        assert int(local_tx) < S // 8, (rank, local_tx)  # ... and not the host's link
        if rank in (1, 2):
            assert shm_cross == "False", (rank, r.stdout)  # across hosts: no segment
            assert int(cross_tx) >= S // 2, (rank, cross_tx)  # ... the bytes went over eth0
    assert sorted(shm) == [0, 1, 2, 3], r.stdout


@needs_netlab
@pytest.mark.timeout(400)
def test_bench_ranks_per_host(lab_name):
    """`linerate bench --netlab NAME --ranks-per-host 2` overrides a one-rank-per-host lab and
    prints its table for 4 ranks."""
    netlab.up(lab_name, hosts=2, rate="1gbit")
    r = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "bench", "--netlab", lab_name,
                        "--ranks-per-host", "2", "--ops", "all_reduce", "--min-bytes", "64K",
                        "--max-bytes", "256K", "--iters", "3", "--warmup", "1", "--no-raw",
                        "--timeout", "120"], cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines()
            if line.strip() and not line.startswith("#") and "all_reduce" in line]
    assert [int(row[0]) for row in rows] == [65536, 262144], r.stdout
    # four ranks: the links table names peers 0..3
    assert any(line.split()[:2] == ["#", "3"] for line in r.stdout.splitlines()
               if line.startswith("#    3")), r.stdout
    bad = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "bench", "--netlab",
                          lab_name, "--ranks-per-host", "1,1,1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "names 3 hosts" in bad.stderr, bad.stderr


ENV_SCRIPT = ("import os\nprint('env', *(os.environ[k] for k in ('RANK', 'WORLD_SIZE', "
              "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE', "
              "'LINERATE_NETLAB_HOST', 'LINERATE_SOCKET_IFNAME')), "
              "os.readlink('/proc/self/ns/net'), flush=True)\n")


def _envs(stdout: str) -> dict[int, list[str]]:
    out = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) > 2 and words[2] == "env":
            out[int(words[3])] = words[3:]
    return out


@needs_netlab
@pytest.mark.timeout(300)
def test_uneven_ranks_per_host_with_rails_and_two_tiers(lab_name, tmp_path):
    """--ranks-per-host 2,1 on a two-tier lab with 2 rails: 3 ranks, two in h0 and one in h1,
    each with both rails; run --ranks-per-host and --nproc re-place them; bad lists refused."""
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    bad = cli("up", "--hosts", "2", "--ranks-per-host", "2,1,1", "--name", lab_name)
    assert bad.returncode == 1 and "3 counts for 2 hosts" in bad.stderr, bad.stderr
    r = cli("up", "--hosts", "2", "--rate", "200mbit", "--rails", "2", "--nodes", "2",
            "--inter-rate", "100mbit", "--ranks-per-host", "2,1", "--name", lab_name)
    assert r.returncode == 0, r.stderr
    assert "2+1 ranks on 2 hosts" in r.stdout, r.stdout

    def run(*extra):
        p = cli("run", "--name", lab_name, "--timeout", "60", *extra, str(script), timeout=80)
        assert p.returncode == 0, p.stdout + p.stderr
        return _envs(p.stdout)

    envs = run()
    assert {r: e[:8] for r, e in envs.items()} == {
        0: ["0", "3", "0", "2", "0", "2", "h0", "eth0,eth1"],
        1: ["1", "3", "1", "2", "0", "2", "h0", "eth0,eth1"],
        2: ["2", "3", "0", "1", "1", "2", "h1", "eth0,eth1"]}
    assert envs[0][8] == envs[1][8] != envs[2][8]
    envs = run("--ranks-per-host", "1,3")
    assert [(e[2], e[3], e[4]) for _, e in sorted(envs.items())] == [
        ("0", "1", "0"), ("0", "3", "1"), ("1", "3", "1"), ("2", "3", "1")]
    envs = run("--nproc", "2")  # the first two ranks: both in h0
    assert [(e[1], e[3], e[6]) for _, e in sorted(envs.items())] == [("2", "2", "h0")] * 2
    p = cli("run", "--name", lab_name, "--nproc", "4", str(script))
    assert p.returncode == 1 and "--nproc must be 1..3" in p.stderr, p.stderr
