"""``linerate netlab``: an emulated cluster on one machine, made of network namespaces.

Each host is a network namespace ``lr-<name>-h<i>`` with one veth interface per rail
(``eth0`` .. ``eth<K-1>``); rail ``k`` is a fabric of its own (addresses ``10.77.<k>.<i+1>/24``).
The bridges live in a separate "switch" namespace ``lr-<name>-sw``, so the machine's own
network is never touched. Every veth end is shaped with a ``tbf`` qdisc on egress, i.e. both
directions of every link are limited to ``--rate``. With ``--nodes M --inter-rate R`` the hosts
are split into M nodes: the hosts of a node share a node bridge, and each node bridge reaches
the core bridge through one uplink veth pair shaped at R both ways (a two-tier cluster).
With ``--ranks-per-host R`` (or a per-host list, ``4,3``) ``run`` places R ranks in each host
namespace, sharing its interfaces (ranks of one namespace share memory, those of different
namespaces talk over the links), with the environment torchrun gives R ranks on a node.

Subcommands: ``up``, ``down``, ``status``, ``exec HOST CMD...``, ``run --nproc N script.py``
(or ``-m module``), ``probe SRC DST`` (a single-TCP-flow throughput measurement).

Python API for other tools: :func:`load`, :func:`run_ranks`, :func:`check_prereqs`,
:func:`up`, :func:`down`, :func:`probe`.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from linerate import settings
from linerate.tools.launch import supervise
from linerate.transport.options import parse_rate  # noqa: F401 - part of netlab's API

STATE_DIR = Path(settings.read("LINERATE_NETLAB_STATE"))
PREFIX = "lr-"
#: Subnet of rail k is 10.77.k.0/24; host i is .i+1.
SUBNET_BASE = (10, 77)
MAX_HOSTS = 250
MAX_RAILS = 16

EXIT_UNAVAILABLE = 2
#: Where ``ip netns exec`` finds a namespace's own files for /etc, bind-mounted over
#: /etc/<file> in the processes it runs: netlab gives each namespace a ``hosts`` that names
#: every lab address (``write_hosts``), so that reverse lookups in the lab (torch's TCPStore
#: names the address of each socket it connects or accepts) succeed without a DNS server,
#: which the lab cannot reach.
NETNS_ETC = Path("/etc/netns")

_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,19}$")


# ----------------------------------------------------------------------------- rates, tbf

def format_rate(bps: int | None) -> str:
    if bps == 0:
        return "unshaped"
    if not bps:
        return "-"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps}bit"


def lab_rate(text: str) -> int:
    """A link rate in bits/s (tc units), or 0 for ``none``: no shaping, the veth's own speed
    (CPU-bound; what a fast NIC looks like to a Python transport)."""
    if text.strip().lower() in ("none", "unshaped", "0"):
        return 0
    return parse_rate(text)


def tbf_params(rate_bps: int) -> list[str]:
    """tc arguments of the token bucket shaping one direction of a link at ``rate_bps``.

    burst: 1 ms worth of bytes, at least 128 KiB -- veth hands tbf GSO super-packets of up to
    64 KiB of payload plus headers, and tbf segments a packet larger than its bucket into
    MTU-sized ones (a bucket smaller than a super-packet multiplies the packet rate until
    softirq takes the cores and the links fall far short of their rate); a bucket a few
    timer ticks deep keeps the link busy between dequeues. latency: 20 ms of queue -- enough to
    hold a single TCP flow's window (the fabric's own RTT is microseconds), so one flow fills
    the link; more only adds bufferbloat.
    """
    burst = max(128 * 1024, rate_bps // 8 // 1000)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "20ms"]


# ----------------------------------------------------------------------------- model

@dataclass
class Host:
    name: str              # "h0"
    index: int
    netns: str             # "lr-lab-h0"
    addrs: list[str]       # one per rail, without prefix length
    ifnames: list[str]     # "eth0", ...
    node: int = 0


@dataclass
class Lab:
    name: str
    hosts: list[Host]
    rails: int
    rate_bps: int
    inter_rate_bps: int | None = None
    nodes: int = 1
    switch_netns: str = ""
    prefixlen: int = 24
    created: float = field(default_factory=time.time)
    #: Ranks ``run`` places in each host (one entry per host; empty: one each, as for a lab
    #: recorded without this field).
    ranks_per_host: list[int] = field(default_factory=list)

    def layout(self) -> list[int]:
        """Ranks per host, one entry per host."""
        return list(self.ranks_per_host) or [1] * len(self.hosts)

    def host(self, which: str | int) -> Host:
        """A host by index (``1``, ``"1"``), short name (``"h1"``) or namespace name."""
        for h in self.hosts:
            if str(which) in (str(h.index), h.name, h.netns):
                return h
        raise KeyError(f"lab {self.name!r} has no host {which!r} "
                       f"(hosts: {', '.join(h.name for h in self.hosts)})")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Lab":
        data = dict(data)
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        return cls(**data)


# ----------------------------------------------------------------------------- rank layout

#: Most ranks one host namespace takes.
MAX_RANKS_PER_HOST = 64


def parse_ranks_per_host(text: str | int | list[int]) -> int | list[int]:
    """``"2"`` -> 2 (every host), ``"4,3"`` -> [4, 3] (per host, in host order)."""
    if isinstance(text, (int, list)):
        values, one = ([text] if isinstance(text, int) else list(text)), isinstance(text, int)
    else:
        parts = [t.strip() for t in str(text).split(",")]
        one = len(parts) == 1
        try:
            values = [int(t) for t in parts]
        except ValueError:
            raise ValueError(f"--ranks-per-host: expected a number or a comma separated list "
                             f"of numbers (one per host), got {text!r}") from None
    bad = [v for v in values if not 1 <= v <= MAX_RANKS_PER_HOST]
    if bad:
        raise ValueError(f"--ranks-per-host: each count must be 1..{MAX_RANKS_PER_HOST}, "
                         f"got {bad[0]}")
    return values[0] if one else values


def resolve_layout(lab: Lab, nproc: int | None = None,
                   ranks_per_host: str | int | list[int] | None = None) -> list[int]:
    """Ranks per host for a run: the lab's layout, or ``ranks_per_host`` (a count for every
    host, or a list for the first hosts: hosts past its end run none), then cut to the first
    ``nproc`` ranks in rank order (host 0's first) when ``nproc`` is given. Entries past the
    last host with ranks are dropped; no host in between is empty."""
    n = len(lab.hosts)
    if ranks_per_host is None:
        layout = lab.layout()
    else:
        r = parse_ranks_per_host(ranks_per_host)
        layout = [r] * n if isinstance(r, int) else list(r)
        if len(layout) > n:
            raise ValueError(f"--ranks-per-host names {len(layout)} hosts; lab {lab.name!r} "
                             f"has {n}")
    total = sum(layout)
    if nproc:
        if not 1 <= nproc <= total:
            raise ValueError(f"--nproc must be 1..{total} (ranks of lab {lab.name!r}: "
                             f"{'+'.join(map(str, layout))})")
        cut, left = [], nproc
        for count in layout:
            if left <= 0:
                break
            cut.append(min(count, left))
            left -= cut[-1]
        layout = cut
    return layout


def placement(layout: list[int], rank: int) -> tuple[int, int]:
    """(host index, local rank) of global rank ``rank``: ranks fill host 0 first."""
    first = 0
    for host, count in enumerate(layout):
        if rank < first + count:
            return host, rank - first
        first += count
    raise ValueError(f"rank {rank} is past the layout {'+'.join(map(str, layout))}")


def format_layout(layout: list[int]) -> str:
    if len(set(layout)) == 1:
        return f"{len(layout)} host{'s' if len(layout) > 1 else ''} x {layout[0]} rank" \
               f"{'s' if layout[0] > 1 else ''}"
    return f"{'+'.join(map(str, layout))} ranks on {len(layout)} hosts"


def netns_prefix(name: str) -> str:
    return f"{PREFIX}{name}-"


def state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(f"bad lab name {name!r}: letters, digits, '_' and '.', up to 20")


# ----------------------------------------------------------------------------- system

def check_prereqs() -> str | None:
    """None when netlab can work here, else a one-line reason."""
    if not sys.platform.startswith("linux"):
        return "netlab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netlab needs iproute2: no '{tool}' on PATH"
    probe_ns = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe_ns], capture_output=True, text=True)
    if r.returncode != 0:
        return f"netlab cannot create network namespaces: {r.stderr.strip() or r.returncode}"
    try:
        r = subprocess.run(["ip", "-n", probe_ns, "link", "add", "p0", "type", "veth",
                            "peer", "name", "p1"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"netlab cannot create veth pairs: {r.stderr.strip()}"
        r = subprocess.run(["tc", "-n", probe_ns, "qdisc", "add", "dev", "p0", "root",
                            *tbf_params(10 ** 9)], capture_output=True, text=True)
        if r.returncode != 0:
            return f"netlab cannot shape with tc tbf: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe_ns], capture_output=True)
    return None


def _sh(*argv: str, input: str | None = None) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True, input=input)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''}: "
                           f"{(r.stderr or r.stdout).strip()}")
    return r.stdout


def _batch(tool: str, netns: str, lines: list[str]) -> None:
    """Run ``ip``/``tc`` commands in ``netns`` in one process (``-batch -``)."""
    if lines:
        _sh(tool, "-n", netns, "-batch", "-", input="\n".join(lines) + "\n")


def list_netns() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def lab_netns(name: str) -> list[str]:
    """The namespaces that belong to lab ``name`` (by name, whatever the state file says)."""
    pat = re.compile(rf"^{re.escape(netns_prefix(name))}(h[0-9]+|sw)$")
    return [ns for ns in list_netns() if pat.match(ns)]


# ----------------------------------------------------------------------------- up / down

def plan(name: str, hosts: int, rails: int, rate_bps: int, nodes: int = 1,
         inter_rate_bps: int | None = None) -> Lab:
    _check_name(name)
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts must be 1..{MAX_HOSTS}")
    if not 1 <= rails <= MAX_RAILS:
        raise ValueError(f"--rails must be 1..{MAX_RAILS}")
    if not 1 <= nodes <= hosts:
        raise ValueError("--nodes must be 1..--hosts")
    if nodes > 1 and inter_rate_bps is None:
        raise ValueError("--nodes needs --inter-rate")
    per_node = -(-hosts // nodes)
    hl = []
    for i in range(hosts):
        hl.append(Host(name=f"h{i}", index=i, netns=f"{netns_prefix(name)}h{i}",
                       addrs=[f"{SUBNET_BASE[0]}.{SUBNET_BASE[1]}.{k}.{i + 1}" for k in range(rails)],
                       ifnames=[f"eth{k}" for k in range(rails)], node=i // per_node))
    return Lab(name=name, hosts=hl, rails=rails, rate_bps=rate_bps,
               inter_rate_bps=inter_rate_bps if nodes > 1 else None,
               nodes=max(h.node for h in hl) + 1, switch_netns=f"{netns_prefix(name)}sw")


def up(name: str = "lab", hosts: int = 2, rate: str | int = "1gbit", rails: int = 1,
       nodes: int = 1, inter_rate: str | int | None = None,
       ranks_per_host: str | int | list[int] = 1) -> Lab:
    """Create the lab (after removing any older lab of that name) and return it.

    ``ranks_per_host``: ranks ``run`` places in each host, a count for all or a list with one
    entry per host."""
    rate_bps = rate if isinstance(rate, int) else lab_rate(rate)
    inter_bps = (inter_rate if isinstance(inter_rate, int) or inter_rate is None
                 else lab_rate(inter_rate))
    lab = plan(name, hosts, rails, rate_bps, nodes, inter_bps)
    rph = parse_ranks_per_host(ranks_per_host)
    if isinstance(rph, list) and len(rph) != hosts:
        raise ValueError(f"--ranks-per-host lists {len(rph)} counts for {hosts} hosts")
    lab.ranks_per_host = [rph] * hosts if isinstance(rph, int) else rph
    down(name)
    try:
        _build(lab)
    except BaseException:
        down(name)
        raise
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = state_path(name).with_suffix(".tmp")
    tmp.write_text(json.dumps(lab.to_json(), indent=1))
    tmp.replace(state_path(name))
    return lab


def address_name(lab: Lab, host: Host, rail: int) -> str:
    """The name of ``host``'s address on ``rail`` in the lab's hosts files: ``h1.lab.netlab``,
    ``h1-r1.lab.netlab`` for rail 1."""
    return f"{host.name}{f'-r{rail}' if rail else ''}.{lab.name}.netlab"


def write_hosts(lab: Lab) -> None:
    """/etc/netns/<namespace>/hosts for each of the lab's host namespaces: this machine's
    /etc/hosts and a line per lab address. Best effort: where /etc cannot be written the lab
    works as before (torch then logs that it cannot name a socket's peer)."""
    try:
        base = Path("/etc/hosts").read_text()
    except OSError:
        base = "127.0.0.1 localhost\n"
    lines = [base.rstrip("\n"), "", f"# linerate netlab {lab.name}"]
    if not re.search(r"^\s*::1\s", base, re.M):
        lines.append("::1 localhost")
    # each address also as IPv6 maps it: a dual-stack listener (the TCPStore's) sees its
    # peers as ::ffff:a.b.c.d, which glibc looks up as an IPv6 address
    lines += [f"{a}{addr} {address_name(lab, h, k)}" for h in lab.hosts
              for k, addr in enumerate(h.addrs) for a in ("", "::ffff:")]
    text = "\n".join(lines) + "\n"
    for h in lab.hosts:
        try:
            d = NETNS_ETC / h.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(text)
        except OSError as e:
            print(f"netlab: cannot write {NETNS_ETC / h.netns / 'hosts'}: {e}", file=sys.stderr)
            return


def _remove_hosts(name: str) -> None:
    """The lab's /etc/netns folders (also those of namespaces already gone)."""
    pat = re.compile(rf"^{re.escape(netns_prefix(name))}(h[0-9]+|sw)$")
    try:
        folders = [d for d in NETNS_ETC.iterdir() if pat.match(d.name)]
    except OSError:
        return
    for d in folders:
        shutil.rmtree(d, ignore_errors=True)


def _build(lab: Lab) -> None:
    sw = lab.switch_netns
    for ns in [sw] + [h.netns for h in lab.hosts]:
        _sh("ip", "netns", "add", ns)
    write_hosts(lab)
    two_tier = lab.nodes > 1
    sw_ip = ["link set lo up"]
    sw_tc = []
    for k in range(lab.rails):
        # Bridges: one per rail; two-tier: one per node per rail plus a core per rail.
        if two_tier:
            sw_ip += [f"link add c{k} type bridge", f"link set c{k} up"]
            for n in range(lab.nodes):
                br, up_sw, up_core = f"n{n}r{k}", f"u{n}r{k}", f"v{n}r{k}"
                sw_ip += [f"link add {br} type bridge", f"link set {br} up",
                          f"link add {up_sw} type veth peer name {up_core}",
                          f"link set {up_sw} master {br}", f"link set {up_core} master c{k}",
                          f"link set {up_sw} up", f"link set {up_core} up"]
                if lab.inter_rate_bps:
                    sw_tc += [f"qdisc add dev {dev} root {' '.join(tbf_params(lab.inter_rate_bps))}"
                              for dev in (up_sw, up_core)]
        else:
            sw_ip += [f"link add r{k} type bridge", f"link set r{k} up"]
    _batch("ip", sw, sw_ip)
    # Host veths are created in the switch namespace with their peer moved into the host.
    sw_ip = []
    for h in lab.hosts:
        for k, ifname in enumerate(h.ifnames):
            port = f"h{h.index}e{k}"
            br = f"n{h.node}r{k}" if two_tier else f"r{k}"
            sw_ip += [f"link add {port} type veth peer name {ifname} netns {h.netns}",
                      f"link set {port} master {br}", f"link set {port} up"]
            if lab.rate_bps:
                sw_tc.append(f"qdisc add dev {port} root {' '.join(tbf_params(lab.rate_bps))}")
    _batch("ip", sw, sw_ip)
    if sw_tc:
        _batch("tc", sw, sw_tc)
    for h in lab.hosts:
        lines = ["link set lo up"]
        for k, ifname in enumerate(h.ifnames):
            lines += [f"addr add {h.addrs[k]}/{lab.prefixlen} dev {ifname}",
                      f"link set {ifname} up"]
        _batch("ip", h.netns, lines)
        if lab.rate_bps:
            _batch("tc", h.netns, [f"qdisc add dev {ifname} root {' '.join(tbf_params(lab.rate_bps))}"
                                   for ifname in h.ifnames])


def down(name: str = "lab") -> list[str]:
    """Delete every namespace of lab ``name`` (and so its veths and bridges) and its state.

    Idempotent; works from the namespace names alone, so also after a crash. Returns the
    namespaces deleted.
    """
    _check_name(name)
    gone = []
    for ns in lab_netns(name):
        r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        if r.returncode == 0:
            gone.append(ns)
        else:
            print(f"netlab: could not delete {ns}: {r.stderr.strip()}", file=sys.stderr)
    _remove_hosts(name)
    try:
        state_path(name).unlink()
    except FileNotFoundError:
        pass
    return gone


def load(name: str = "lab") -> Lab:
    """The lab ``name`` as recorded by ``up``; FileNotFoundError if there is none."""
    _check_name(name)
    try:
        data = json.loads(state_path(name).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no netlab {name!r} (run: linerate netlab up --name {name})") \
            from None
    return Lab.from_json(data)


def is_up(lab: Lab) -> bool:
    present = set(list_netns())
    return lab.switch_netns in present and all(h.netns in present for h in lab.hosts)


# ----------------------------------------------------------------------------- exec / probe

def netns_argv(host: Host, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", host.netns, *argv]


_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
buf = bytearray(1 << 20); n = 0; t0 = None; t_last = None
while True:
    k = c.recv_into(buf)
    if not k: break
    now = time.perf_counter()
    if t0 is None: t0 = now
    else: n += k
    t_last = now
print(n, (t_last - t0) if t0 is not None and t_last else 0.0, flush=True)
"""

_SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
data = bytes(1 << 20); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(data)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def probe(lab: Lab, src: str | int, dst: str | int, seconds: float = 2.0, rail: int = 0) -> float:
    """Throughput in bit/s of one TCP flow from host ``src`` to host ``dst`` over ``rail``."""
    s, d = lab.host(src), lab.host(dst)
    addr = d.addrs[rail]
    rx = subprocess.Popen(netns_argv(d, [sys.executable, "-c", _RECEIVER, addr]),
                          stdout=subprocess.PIPE, text=True)
    try:
        port = rx.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"probe receiver on {d.name} did not start")
        subprocess.run(netns_argv(s, [sys.executable, "-c", _SENDER, addr, port, str(seconds)]),
                       check=True, timeout=seconds + 60)
        out = rx.communicate(timeout=30)[0].split()
        nbytes, elapsed = int(out[0]), float(out[1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    return nbytes * 8 / elapsed if elapsed > 0 else 0.0


# ----------------------------------------------------------------------------- run ranks

def free_port_in(host: Host) -> int:
    out = _sh(*netns_argv(host, [sys.executable, "-c",
                                 "import socket; s=socket.socket(); s.bind(('',0)); "
                                 "print(s.getsockname()[1])"]))
    return int(out.strip())


def rank_env(lab: Lab, rank: int, nproc: int, port: int,
             env: dict[str, str] | None = None,
             layout: list[int] | None = None) -> dict[str, str]:
    """The environment of rank ``rank`` of ``nproc``, as torchrun's agent sets it on a node
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK = the host, GROUP_WORLD_SIZE =
    the hosts with ranks, ROLE_*), plus the lab's interfaces. ``layout``: ranks per host
    (:func:`resolve_layout`); default: rank i alone on host i, whatever the lab's layout (what
    a caller placing one process per host, like ``linerate model``'s CPU probe, needs)."""
    base = dict(os.environ if env is None else env)
    if layout is None:
        if not 1 <= nproc <= len(lab.hosts):
            raise ValueError(f"{nproc} ranks, one per host, on lab {lab.name!r} of "
                             f"{len(lab.hosts)} hosts")
        layout = [1] * nproc
    if sum(layout) != nproc:
        raise ValueError(f"layout {'+'.join(map(str, layout))} does not hold {nproc} ranks")
    h, local = placement(layout, rank)
    host = lab.hosts[h]
    base.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(layout[h]), GROUP_RANK=str(h),
                GROUP_WORLD_SIZE=str(len(layout)), ROLE_NAME="default", ROLE_RANK=str(rank),
                ROLE_WORLD_SIZE=str(nproc),
                MASTER_ADDR=lab.hosts[0].addrs[0], MASTER_PORT=str(port),
                LINERATE_NETLAB=lab.name, LINERATE_NETLAB_HOST=host.name)
    base.setdefault("LINERATE_SOCKET_IFNAME", ",".join(host.ifnames))
    base.setdefault("GLOO_SOCKET_IFNAME", host.ifnames[0])
    # veth reports 10 Gbit/s whatever tbf allows: tell the metrics the shaped rate (an
    # unshaped lab has no capacity but the CPU's: the metrics then show none).
    if lab.rate_bps:
        base.setdefault("LINERATE_LINK_CAPACITY",
                        ",".join(f"{n}={lab.rate_bps}bit" for n in host.ifnames))
    base.setdefault("LINERATE_METRICS_HOST", host.name)
    base.setdefault("OMP_NUM_THREADS", "1")
    path = base.get("PYTHONPATH")
    base["PYTHONPATH"] = _SOURCE_ROOT + (os.pathsep + path if path else "")
    return base


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        try:
            out.buffer.write(prefix.encode() + line if line.endswith(b"\n")
                             else prefix.encode() + line + b"\n")
            out.flush()
        except (ValueError, OSError):
            pass
    stream.close()


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_BIND, _MS_REC, _MS_SLAVE = 0x1000, 0x4000, 1 << 19


def _own_etc(libc, host: Host) -> None:
    """This thread: a mount namespace of its own where ``host``'s /etc/netns files are
    bind-mounted over /etc, as ``ip netns exec`` gives the processes it runs (``write_hosts``).
    Mounts are made only once the thread is in a namespace of its own whose mounts propagate
    nowhere (slave): the machine's /etc is never touched. Best effort: nothing is mounted where
    a step fails."""
    files = [f for f in sorted((NETNS_ETC / host.netns).glob("*"))
             if f.is_file() and (Path("/etc") / f.name).is_file()]
    if not files:
        return
    before = os.stat("/proc/thread-self/ns/mnt").st_ino
    if (libc.unshare(_CLONE_NEWNS) != 0
            or os.stat("/proc/thread-self/ns/mnt").st_ino == before
            or libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0):
        return
    for f in files:
        libc.mount(str(f).encode(), f"/etc/{f.name}".encode(), None, _MS_BIND, None)


def _in_netns(host: Host, fn):
    """``fn()`` run in ``host``'s network namespace, on a short-lived thread that enters it
    (setns(2) moves only the calling thread; sockets made there stay in that namespace,
    whichever thread uses them later, and threads it starts begin there), with the host's
    /etc/netns files over /etc as ``ip netns exec`` has them (``_own_etc``)."""
    got: dict = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/var/run/netns/{host.netns}") as ns:
                if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {host.netns}: {os.strerror(err)}")
            _own_etc(libc, host)
            got["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            got["error"] = e

    t = threading.Thread(target=run, name="linerate-netns")
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["value"]


def _host_store(host: Host):
    """As torchrun's agent does for its workers (TORCHELASTIC_USE_AGENT_STORE=True): the job's
    TCPStore served by this process (which has torch loaded), on a free port of ``host``'s
    rail-0 address, so that the Store outlives every rank (rank 0 exiting first, after a
    failure say, does not take it from the others). Returns (the store, its port); it serves
    until dropped."""
    import datetime

    from torch.distributed import TCPStore
    store = _in_netns(host, lambda: TCPStore(host.addrs[0], 0, None, True,
                                             timeout=datetime.timedelta(seconds=60),
                                             wait_for_workers=False))
    return store, store.port


def run_ranks(lab: Lab, nproc: int | None, argv: list[str], env: dict[str, str] | None = None,
              timeout: float | None = None, prefix_output: bool = True,
              ranks_per_host: str | int | list[int] | None = None) -> int:
    """Run ``python <argv>`` as the lab's ranks; return 0 if all ranks succeed.

    The ranks fill the hosts in order, the lab's ranks per host each (or ``ranks_per_host``,
    see :func:`resolve_layout`): rank ``host * R + local`` runs in host ``host``'s namespace.
    ``nproc`` (None or 0: every rank of the layout) keeps the first ``nproc`` ranks.
    ``argv`` is what follows ``python``: ``["script.py", ...]`` or ``["-m", "module", ...]``.
    Output lines are prefixed with ``[rank i]``. The first failing rank's exit code is returned
    (after the others had FAIL_GRACE_S to report); 124 on timeout, 130 on Ctrl-C. Every rank
    runs in a session of its own and is terminated (then killed) before this returns. As
    torchrun's agent does, this process hosts the Store (TORCHELASTIC_USE_AGENT_STORE) at
    MASTER_ADDR:MASTER_PORT, in host 0's namespace, until every rank has ended.
    """
    layout = resolve_layout(lab, nproc, ranks_per_host)
    nproc = sum(layout)
    if not is_up(lab):
        raise RuntimeError(f"netlab {lab.name!r} is not up (run: linerate netlab up)")
    store, port = _host_store(lab.hosts[0])
    pumps: list[threading.Thread] = []
    base = dict(os.environ if env is None else env, TORCHELASTIC_USE_AGENT_STORE="True")

    def start(rank: int) -> subprocess.Popen:
        host = lab.hosts[placement(layout, rank)[0]]
        p = subprocess.Popen(netns_argv(host, [sys.executable, *argv]),
                             env=rank_env(lab, rank, nproc, port, base, layout),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        pfx = f"[rank {rank}] " if prefix_output else ""
        t = threading.Thread(target=_pump, args=(p.stdout, pfx, sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
        return p

    def join_pumps() -> None:
        for t in pumps:
            t.join(timeout=2)

    try:
        return supervise(start, nproc, timeout, "netlab", cleanup=join_pumps)
    finally:
        del store  # the server stops


# ----------------------------------------------------------------------------- CLI

def _cmd_up(args) -> int:
    lab = up(args.name, args.hosts, args.rate, args.rails, args.nodes, args.inter_rate,
             args.ranks_per_host)
    layout = lab.layout()
    print(f"netlab {lab.name}: up, {len(lab.hosts)} hosts, {lab.rails} rail(s) at "
          f"{format_rate(lab.rate_bps)}"
          + (f", {lab.nodes} nodes, uplinks at {format_rate(lab.inter_rate_bps)}"
             if lab.nodes > 1 else "")
          + (f"; run places {format_layout(layout)} ({sum(layout)} ranks)"
             if any(c != 1 for c in layout) else ""))
    return 0


def _cmd_down(args) -> int:
    gone = down(args.name)
    print(f"netlab {args.name}: down" + (f" (deleted {len(gone)} namespaces)" if gone
                                         else " (nothing to delete)"))
    return 0


def _cmd_status(args) -> int:
    try:
        lab = load(args.name)
    except FileNotFoundError:
        stray = lab_netns(args.name)
        print(f"netlab {args.name}: not up" + (f"; stray namespaces {', '.join(stray)} "
                                               f"(linerate netlab down --name {args.name})"
                                               if stray else ""))
        return 1 if stray else 0 if args.quiet_ok else 1
    state = "up" if is_up(lab) else "DOWN (namespaces missing; run up again)"
    if args.json:
        print(json.dumps({**lab.to_json(), "up": is_up(lab)}, indent=1))
        return 0
    print(f"netlab {lab.name}: {state}")
    print(f"  rails {lab.rails} at {format_rate(lab.rate_bps)} per link, "
          f"switch namespace {lab.switch_netns}")
    if lab.nodes > 1:
        print(f"  {lab.nodes} nodes, uplinks at {format_rate(lab.inter_rate_bps)}")
    layout = lab.layout()
    print(f"  ranks per host {','.join(map(str, layout))} ({sum(layout)} ranks)")
    first = 0
    for h, count in zip(lab.hosts, layout):
        addrs = "  ".join(f"{i}={a}/{lab.prefixlen}" for i, a in zip(h.ifnames, h.addrs))
        node = f" node {h.node}" if lab.nodes > 1 else ""
        ranks = str(first) if count == 1 else f"{first}-{first + count - 1}"
        first += count
        print(f"  {h.name:<4} {h.netns:<16}{node}  {addrs}  ranks {ranks}")
    return 0 if state == "up" else 1


def _cmd_exec(args) -> int:
    lab = load(args.name)
    if not args.argv:
        print("netlab exec: give a command", file=sys.stderr)
        return 2
    try:
        host = lab.host(args.host)
    except KeyError as e:
        print(f"netlab: {e.args[0]}", file=sys.stderr)
        return 2
    return subprocess.call(netns_argv(host, args.argv))


def _cmd_run(args) -> int:
    lab = load(args.name)
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if args.module is not None:
        if not args.module:
            print("netlab run: -m needs a module name", file=sys.stderr)
            return 2
        argv = ["-m", *args.module]
    if not argv:
        print("netlab run: give a script (or -m module)", file=sys.stderr)
        return 2
    return run_ranks(lab, args.nproc or None, argv, timeout=args.timeout or None,
                     ranks_per_host=args.ranks_per_host)


def _cmd_probe(args) -> int:
    lab = load(args.name)
    bps = probe(lab, args.src, args.dst, args.seconds, args.rail)
    print(f"{lab.host(args.src).name} -> {lab.host(args.dst).name} rail {args.rail}: "
          f"{bps / 1e6:.1f} Mbit/s (one TCP flow)")
    return 0


def _main(args) -> int:
    reason = check_prereqs()
    if reason:
        print(f"netlab: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        return args.netlab_func(args)
    except (ValueError, RuntimeError, FileNotFoundError, KeyError) as e:
        print(f"netlab: {e}", file=sys.stderr)
        return 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("netlab", help="emulated cluster: hosts as network namespaces "
                              "joined by shaped links",
                              description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="netlab_command", metavar="ACTION", required=True)

    def action(name, func, help):
        a = sub.add_parser(name, help=help)
        a.add_argument("--name", default="lab", help="lab name (default: lab)")
        a.set_defaults(func=_main, netlab_func=func)
        return a

    a = action("up", _cmd_up, "create the lab (replacing one of the same name)")
    a.add_argument("--hosts", type=int, required=True)
    a.add_argument("--rate", default="1gbit",
                   help="rate of every host link, each way (tc units: 1gbit, 250mbit); none: "
                        "unshaped veth, as fast as the CPU moves bytes")
    a.add_argument("--rails", type=int, default=1, help="interfaces (fabrics) per host")
    a.add_argument("--nodes", type=int, default=1, help="split the hosts into this many nodes")
    a.add_argument("--inter-rate", default=None,
                   help="rate of each node's uplink, each way (none: unshaped)")
    a.add_argument("--ranks-per-host", default="1", metavar="R",
                   help="ranks `run` (and `bench --netlab`) place in each host namespace, "
                        "sharing its interfaces: a count, or one per host (4,3) (default 1)")
    action("down", _cmd_down, "delete the lab (idempotent)")
    a = action("status", _cmd_status, "show hosts, addresses, rates")
    a.add_argument("--json", action="store_true")
    a.set_defaults(quiet_ok=False)
    a = action("exec", _cmd_exec, "run a command in a host's namespace")
    a.add_argument("host", help="h0, 0 or lr-<name>-h0")
    a.add_argument("argv", nargs=argparse.REMAINDER)
    a = action("run", _cmd_run, "run the lab's ranks (per host: --ranks-per-host of up) with "
               "the torchrun environment")
    a.add_argument("--nproc", type=int, default=0,
                   help="ranks, the first ones in rank order (default: every rank of the lab)")
    a.add_argument("--ranks-per-host", default=None, metavar="R",
                   help="override the lab's ranks per host: a count, or one per host (4,3)")
    a.add_argument("--timeout", type=float, default=0, help="seconds (default: none)")
    a.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None,
                   metavar="MODULE ARGS", help="run a module, like python -m (the rest of the "
                   "line is its arguments)")
    a.add_argument("argv", nargs=argparse.REMAINDER, help="script.py args...")
    a = action("probe", _cmd_probe, "measure one TCP flow between two hosts")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--rail", type=int, default=0)
    a.add_argument("--seconds", type=float, default=2.0)
