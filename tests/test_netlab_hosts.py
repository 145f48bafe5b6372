"""A netlab run's output holds no "[c10d] The hostname of the client socket cannot be retrieved"
line: every lab address has a name in the lab's hosts files (/etc/netns/<namespace>/hosts,
bind-mounted over /etc/hosts by ``ip netns exec`` for the ranks, and for netlab's own Store
thread in a mount namespace of its own), so the reverse lookups torch's TCPStore makes succeed
without a DNS server the lab cannot reach. The machine's /etc/hosts is never changed, and
``down`` removes the lab's files."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from linerate.tools import netlab

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import socket
    import torch
    import torch.distributed as dist

    dist.init_process_group("linerate")
    t = torch.ones(4)
    dist.all_reduce(t)
    print("ok", dist.get_rank(), t.tolist(), socket.getnameinfo(("10.77.0.1", 0), 0)[0],
          flush=True)
    dist.destroy_process_group()
""")

LINE = "The hostname of the client socket cannot be retrieved"


@pytest.mark.netlab
@pytest.mark.timeout(120)
def test_a_run_names_every_socket_peer_without_dns(lab_name, tmp_path):
    hosts_before = Path("/etc/hosts").read_text()
    script = tmp_path / "names.py"
    script.write_text(SCRIPT)
    lab = netlab.up(lab_name, hosts=2, rate="500mbit")
    text = (netlab.NETNS_ETC / lab.hosts[1].netns / "hosts").read_text()
    assert f"10.77.0.1 h0.{lab_name}.netlab" in text and f"::ffff:10.77.0.2 h1.{lab_name}" \
        f".netlab" in text, text
    env = {k: v for k, v in os.environ.items()
           if k not in ("LINERATE_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    r = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "netlab", "run", "--name",
                        lab_name, "--timeout", "60", str(script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=90)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"[rank {rank}] ok {rank} [2.0, 2.0, 2.0, 2.0] h0.{lab_name}.netlab" in r.stdout, out
    assert LINE not in out, out
    assert Path("/etc/hosts").read_text() == hosts_before
    netlab.down(lab_name)
    assert not any(d.name.startswith(netlab.netns_prefix(lab_name))
                   for d in netlab.NETNS_ETC.iterdir()) if netlab.NETNS_ETC.exists() else True
