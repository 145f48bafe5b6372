"""The RDMA transport (transport/rdma.py, transport/verbs.py) on the fake pyverbs.

The transport conformance tests of tests/test_transport.py run over it too (their
``rdma-fake`` and ``rdma`` cases); these test what is particular to it: the byte stream over
one queue pair (sizes, gather and copy paths, credits, end of stream, timeouts, a peer that
vanishes, the framing checks on immediates), the rendezvous that agrees on a transport,
finding pyverbs, ``linerate probe``, the metrics labels, and collectives end to end through
``dist.init_process_group`` checked against Gloo and NumPy. ``rdma`` cases need a real device
and are skipped with the reason where there is none.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from linerate.transport import Context, TransportError, TransportOptions, metrics, rdma, rendezvous, shm, verbs
from linerate.transport.framing import CHANNEL_P2P

from _harness import run_ranks
from _harness import FAKE_PYVERBS, REPO, real_rdma_reason, use_transport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake(monkeypatch):
    """The fake pyverbs, with its default device (one soft-RoCE-like port)."""
    use_transport("rdma-fake", monkeypatch)
    monkeypatch.delenv("FAKE_PYVERBS_DEVICES", raising=False)
    assert verbs.load().fake
    from pyverbs import _fabric
    _fabric.STATS.clear()
    yield _fabric
    verbs.reset()


def stream_pair(link_timeout: float = 5.0):
    port = verbs.open_port(verbs.select_ports([])[0])
    a, b = rdma.RdmaStream(port, link_timeout), rdma.RdmaStream(port, link_timeout)
    a.connect(b.local_info(), "b")
    b.connect(a.local_info(), "a")
    return a, b


def close_pair(*streams):
    for s in streams:
        s.shutdown(socket.SHUT_RDWR)
        s.close()


def recv_exactly(s, n: int) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    got = s.recv_into(memoryview(out), n, socket.MSG_WAITALL) if n else 0
    assert got == n
    return out


# ----------------------------------------------------------------------------- the stream
def test_stream_sizes_gather_and_copy(fake):
    """Every size around the slot and copy thresholds, several buffers per send (header +
    payload as the Context sends), read back in odd pieces; the zero-copy path registered
    the payload's exporter once and reused it."""
    a, b = stream_pair()
    rng = np.random.default_rng(1)
    S, Z = rdma.SLOT_BYTES, rdma.ZCOPY_MIN
    sizes = [0, 1, 47, 48, Z - 1, Z, Z + 1, S - 48, S - 1, S, S + 1, 2 * S + 7, 5 * S + 12345, 3_000_001]
    try:
        big = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
        for n in sizes:
            hdr = rng.integers(0, 256, 48, dtype=np.uint8).tobytes()
            payload = memoryview(big)[:n]
            t = threading.Thread(target=lambda: a.sendmsg([hdr, payload, b"tail"]))
            t.start()
            assert recv_exactly(b, 48).tobytes() == hdr
            out = np.zeros(n + 4, np.uint8)
            got = 0
            while got < n + 4:  # without MSG_WAITALL: whatever is there, at least one byte
                k = b.recv_into(memoryview(out)[got:], min(99_991, n + 4 - got))
                assert k > 0
                got += k
            t.join(10)
            assert np.array_equal(out[:n], big[:n]), f"{n} bytes differ"
            assert out[n:].tobytes() == b"tail"
        cache = a.port.mr_cache
        assert cache.hits > 0 and cache.misses <= 2, (cache.hits, cache.misses)
        assert not (fake.STATS["rnr_wait"] or fake.STATS["sq_full"] or fake.STATS["cq_overrun"]), fake.STATS
    finally:
        close_pair(a, b)


def test_stream_over_infiniband_addresses_by_lid(fake, monkeypatch):
    monkeypatch.setenv("FAKE_PYVERBS_DEVICES", json.dumps(
        [{"name": "fakeib0", "ports": [{"state": "DOWN", "link_layer": "InfiniBand"},
                                       {"state": "ACTIVE", "link_layer": "InfiniBand"}]}]))
    a, b = stream_pair()
    try:
        assert a.port.name == "fakeib0:2" and a.port.gid is None and a.local_info()["lid"] > 0
        a.sendall(b"over IB")
        assert bytes(recv_exactly(b, 7)) == b"over IB"
    finally:
        close_pair(a, b)


def test_stream_zero_copy_send_returns_after_completion(fake):
    """A send from the caller's memory returns once the writes completed: overwriting the
    buffer right after sendmsg returns cannot change what the peer receives."""
    a, b = stream_pair()
    try:
        n = 4 * rdma.SLOT_BYTES
        src = np.full(n, 7, np.uint8)
        received = []
        t = threading.Thread(target=lambda: received.append(recv_exactly(b, n)))
        t.start()
        a.sendall(memoryview(src))
        src[:] = 9
        t.join(10)
        assert (received[0] == 7).all()
    finally:
        close_pair(a, b)


def test_stream_credits_hold_back_the_sender(fake):
    """The sender fills the peer's ring and then waits for credits; nothing is overrun and
    no write ever waits for a receive WQE."""
    a, b = stream_pair()
    try:
        n = 3 * rdma.RING_SLOTS * rdma.SLOT_BYTES
        src = np.arange(n, dtype=np.uint32).astype(np.uint8)
        done = threading.Event()
        t = threading.Thread(target=lambda: (a.sendall(memoryview(src)), done.set()))
        t.start()
        deadline = time.monotonic() + 10
        while a._sent - a._credited < rdma.RING_SLOTS and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert a._sent - a._credited == rdma.RING_SLOTS   # the ring is full, and no fuller
        assert not done.is_set(), "the sender wrote more than the ring holds"
        out = recv_exactly(b, n)
        t.join(10)
        assert done.is_set() and np.array_equal(out, src)
        assert fake.STATS["rnr_wait"] == 0 and fake.STATS["cq_overrun"] == 0, fake.STATS
    finally:
        close_pair(a, b)


def test_stream_end_timeout_and_shutdown(fake):
    a, b = stream_pair()
    try:
        b.settimeout(0.2)
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            b.recv_into(bytearray(10))
        assert 0.15 < time.monotonic() - t0 < 10  # the 0.2 s timeout, not a blocked read
        b.settimeout(None)
        # shutdown(SHUT_RD) wakes a blocked reader with end of stream
        got = []
        t = threading.Thread(target=lambda: got.append(b.recv_into(bytearray(10), 10, socket.MSG_WAITALL)))
        t.start()
        time.sleep(0.1)
        b.shutdown(socket.SHUT_RD)
        t.join(5)
        assert got == [0]
        # FIN after data: the data first, then end of stream (a partial MSG_WAITALL read)
        a.sendall(b"last words")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(BrokenPipeError):
            a.sendall(b"more")
        buf = bytearray(100)
        assert a.getsockname()[0] == "fakerxe0:1" and b.getpeername()[0] == "a"
        c, d = stream_pair()
        try:
            c.sendall(b"last words")
            c.shutdown(socket.SHUT_WR)
            assert d.recv_into(buf, 100, socket.MSG_WAITALL) == 10 and bytes(buf[:10]) == b"last words"
            assert d.recv_into(buf, 100) == 0
        finally:
            close_pair(c, d)
        with pytest.raises(OSError):
            a.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64)
    finally:
        close_pair(a, b)


def test_stream_peer_vanishes(fake):
    """A peer whose QP is gone without a word (a killed process) is found by the keepalive
    writes once the QP's retry time (LINERATE_LINK_TIMEOUT) has passed."""
    a, b = stream_pair(link_timeout=0.6)
    try:
        b._kill_qp()
        t0 = time.monotonic()
        with pytest.raises(ConnectionResetError, match="RETRY_EXC.*LINERATE_LINK_TIMEOUT"):
            a.recv_into(bytearray(10))
        assert time.monotonic() - t0 < 5
        with pytest.raises(ConnectionResetError):
            a.sendall(b"x")
    finally:
        close_pair(a, b)


def test_stream_framing_check_on_immediates(fake):
    """A write into the wrong ring slot is a protocol error, never data."""
    a, b = stream_pair()
    try:
        a.sendall(b"first")
        a._sent += 1  # the next write goes one slot too far
        a.sendall(b"second")
        assert bytes(recv_exactly(b, 5)) == b"first"
        with pytest.raises(ConnectionAbortedError, match="expected slot"):
            b.recv_into(bytearray(6), 6, socket.MSG_WAITALL)
    finally:
        close_pair(a, b)


def test_stream_wrong_peer_is_not_connected(fake):
    """Queue pair information that does not match (a PSN) connects nothing: the first write
    fails once the retry time has passed."""
    port = verbs.open_port(verbs.select_ports([])[0])
    a, b = rdma.RdmaStream(port, 0.5), rdma.RdmaStream(port, 0.5)
    bad = dict(b.local_info(), psn=(b.psn + 1) % (1 << 24))
    try:
        a.connect(bad, "b")
        b.connect(a.local_info(), "a")
        with pytest.raises(ConnectionResetError, match="RETRY_EXC"):  # a expects another PSN from b
            b.sendall(np.zeros(rdma.ZCOPY_MIN, np.uint8))
        assert fake.STATS["hello_rejected"] > 0
        with pytest.raises(TransportError, match="malformed"):
            rdma.RdmaStream(port, 1.0).connect({"qpn": "7"})
    finally:
        close_pair(a, b)


# ----------------------------------------------------------------------------- rendezvous
def _contexts(size: int, opts_of, store=None, before=None):
    """``size`` Contexts built by thread ranks (``before(r)``: run first in rank r's thread)."""
    store = store or dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    out: list = [None] * size

    def build(r):
        if before is not None:
            before(r)
        try:
            out[r] = Context(store, r, size, opts_of(r))
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out[r] = e

    threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    return out


def _close(results):
    for c in results:
        if isinstance(c, Context):
            c.close(timeout=5)


def _opts(**kw):
    # shm "0": these ranks share a host and would link over shared memory; RDMA is the subject
    return TransportOptions(**{"socket_ifname": "lo", "connect_timeout": 20, "nsocks": 1,
                               "shm": "0", **kw})


@pytest.mark.parametrize("mode", ["auto", "rdma"])
def test_agreement_when_a_rank_has_no_port(fake, mode, caplog):
    """auto: every rank falls back to TCP, rank 0 logs one line naming the rank and why;
    rdma: every rank fails with an error naming it."""
    caplog.set_level(logging.INFO, logger="linerate.transport")
    rendezvous._logged.clear()
    res = _contexts(3, lambda r: _opts(transport=mode, rdma_device="nosuchdev0" if r == 2 else ""))
    try:
        if mode == "auto":
            assert all(isinstance(c, Context) and c.transport == "tcp" for c in res), res
            lines = [r.getMessage() for r in caplog.records if "LINERATE_TRANSPORT=auto" in r.getMessage()]
            assert len(lines) == 1 and "rank 2" in lines[0] and "nosuchdev0" in lines[0], lines
            out = bytearray(2)
            r = res[2].irecv(0, memoryview(out), CHANNEL_P2P, 1)
            res[0].isend(2, memoryview(b"ok"), CHANNEL_P2P, 1).wait(10)
            r.wait(10)
            assert out == b"ok"
        else:
            assert all(isinstance(c, TransportError) for c in res), res
            assert "LINERATE_TRANSPORT=rdma" in str(res[2]) and "nosuchdev0" in str(res[2])
            assert "rank 2" in str(res[0]) and "nosuchdev0" in str(res[0])
    finally:
        _close(res)


def test_agreement_auto_picks_rdma_and_settings_must_match(fake, caplog):
    caplog.set_level(logging.INFO, logger="linerate.transport")
    rendezvous._logged.clear()
    res = _contexts(2, lambda r: _opts(transport="auto"))
    try:
        assert [c.transport for c in res] == ["rdma", "rdma"]
        assert any("using RDMA" in r.getMessage() for r in caplog.records)
    finally:
        _close(res)
    # rank 1 finds the difference; rank 0 learns it from rank 1's report, at once (the
    # connect timeout is a minute)
    t0 = time.monotonic()
    res = _contexts(2, lambda r: _opts(transport="rdma" if r else "tcp", connect_timeout=60.0))
    try:
        assert time.monotonic() - t0 < 15
        assert isinstance(res[1], ValueError) and "LINERATE_TRANSPORT is rdma here but tcp on rank 0" in str(res[1])
        assert isinstance(res[0], TransportError) and "another rank failed" in str(res[0]) \
            and "rank 1: LINERATE_TRANSPORT is rdma here" in str(res[0]), res[0]
    finally:
        _close(res)


def test_ranks_linked_over_shared_memory_get_no_queue_pairs(fake, monkeypatch):
    """The link kinds are asked in order (transport/kinds.py): co-located ranks that share a
    segment link over shared memory, and RDMA builds queue pairs only to the peers of other
    hosts, instead of building them to every peer and dropping the co-located ones. Four
    thread ranks play two hosts of two (``shm.host_id`` answers per thread)."""
    made = []
    init = rdma.RdmaStream.__init__

    def counted(self, *a, **kw):
        made.append(1)
        init(self, *a, **kw)

    where = threading.local()
    host_id = shm.host_id
    monkeypatch.setattr(rdma.RdmaStream, "__init__", counted)
    monkeypatch.setattr(shm, "host_id", lambda: f"{host_id()}/h{where.host}")
    res = _contexts(4, lambda r: _opts(transport="rdma", shm="1"),
                    before=lambda r: setattr(where, "host", r // 2))
    try:
        assert all(isinstance(c, Context) for c in res), res
        assert [c.transport for c in res] == ["rdma"] * 4
        for r, c in enumerate(res):
            kinds = {p["peer"]: {link["kind"] for link in p["links"]}
                     for p in c.stats()["peers"]}
            assert kinds == {p: {"shm" if p // 2 == r // 2 else "rdma"}
                             for p in range(4) if p != r}, (r, kinds)
        assert len(made) == 4 * 2  # each rank: one queue pair to each rank of the other host
        for src, dst in ((0, 1), (0, 3), (2, 1)):
            out = bytearray(2)
            r = res[dst].irecv(src, memoryview(out), CHANNEL_P2P, 1)
            res[src].isend(dst, memoryview(b"ok"), CHANNEL_P2P, 1).wait(10)
            r.wait(10)
            assert out == b"ok", (src, dst)
    finally:
        _close(res)


def test_rdma_without_device_is_a_clear_error(fake, monkeypatch):
    monkeypatch.setenv("FAKE_PYVERBS_DEVICES", "enosys")
    ok, why, _ = rdma.local_status(_opts(transport="rdma"))
    assert not ok and "ibv_get_device_list failed" in why
    monkeypatch.setenv("FAKE_PYVERBS_DEVICES", json.dumps([{"name": "d0", "ports": [{"state": "DOWN"}]}]))
    ok, why, _ = rdma.local_status(_opts(transport="rdma"))
    assert not ok and why == "no active RDMA port (d0:1 DOWN)"
    res = _contexts(2, lambda r: _opts(transport="rdma"))
    try:
        assert all(isinstance(c, TransportError) and "d0:1 DOWN" in str(c) for c in res), res
    finally:
        _close(res)


def test_metrics_label_rdma_connections_by_port(fake):
    res = _contexts(2, lambda r: _opts(transport="rdma", nsocks=2))
    try:
        c0, c1 = res
        out = bytearray(1 << 20)
        r = c1.irecv(0, memoryview(out), CHANNEL_P2P, 3)
        c0.isend(1, memoryview(bytes(range(256)) * 4096), CHANNEL_P2P, 3).wait(10)
        r.wait(10)
        totals = metrics._byte_totals()
        mine = {k: v for k, v in totals.items() if k[1] == "fakerxe0:1"}
        assert sum(v[0] for v in mine.values()) >= 1 << 20, totals
        link = c0.stats()["peers"][0]["links"][0]
        assert link["kind"] == "rdma" and link["retransmits"] is None and link["queued_bytes"] >= 0
        assert metrics.conn_interface(link["connections"][0]) == "fakerxe0:1"
    finally:
        _close(res)


# ----------------------------------------------------------------------------- pyverbs
def _python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LINERATE_", "FAKE_PYVERBS"))}
    base["PYTHONPATH"] = REPO
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def test_without_pyverbs_tcp_is_unaffected():
    """No pyverbs at all: importing linerate, TCP and auto all work; rdma says why not."""
    code = ("import json, sys, datetime; import linerate.transport, linerate.collectives; "
            "from linerate.transport import rdma, verbs, TransportOptions; "
            "ok, why, _ = rdma.local_status(TransportOptions()); "
            "print(json.dumps([ok, why, 'pyverbs' in sys.modules]))")
    out = _python(code, LINERATE_PYVERBS_PATH=os.path.join(REPO, "no-such-folder"))
    assert out.returncode == 0, out.stderr
    ok, why, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert not ok and "LINERATE_PYVERBS_PATH" in why and not imported


_system_pyverbs: dict = {}


def system_pyverbs_reason() -> str | None:
    """Why the real pyverbs (rdma-core's, from the system's packages) cannot be loaded in
    this Python; None where it can. Loading it needs no RDMA device."""
    if "reason" not in _system_pyverbs:
        if not any(verbs._package_dir(d) for d in verbs.SYSTEM_DIRS):
            apt_cache = shutil.which("apt-cache")
            if apt_cache and subprocess.run([apt_cache, "show", "python3-pyverbs"],
                                            capture_output=True, timeout=60).returncode != 0:
                reason = "this platform's packages have no python3-pyverbs (apt-cache show)"
            else:
                reason = ("python3-pyverbs is not installed here (tools/quickstart.sh installs "
                          "it; apt-get install python3-pyverbs)")
        else:
            out = _python("from linerate.transport import verbs; verbs.load()")
            last = (out.stderr.strip().splitlines() or [""])[-1]
            reason = None if out.returncode == 0 else (
                f"the system's pyverbs cannot load in this Python: {last}" if "built for" in last
                else None)  # any other failure is the test's to report
        _system_pyverbs["reason"] = reason
    return _system_pyverbs["reason"]


def test_system_pyverbs_is_found_without_its_folder_on_the_path():
    """Debian's python3-pyverbs: loaded from /usr/lib/python3/dist-packages without putting
    that folder (and its old packages) on sys.path."""
    reason = system_pyverbs_reason()
    if reason:
        pytest.skip(reason)
    code = ("import json, sys; from linerate.transport import verbs; pv = verbs.load(); "
            "print(json.dumps([pv.path, pv.e.__name__, pv.fake, "
            "any(p.rstrip('/').endswith('dist-packages') and p.startswith('/usr/lib/python3') for p in sys.path)]))")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    path, enums, fake_, on_path = json.loads(out.stdout.strip().splitlines()[-1])
    assert path.endswith("pyverbs") and enums in ("pyverbs.enums", "pyverbs.libibverbs_enums")
    assert not fake_ and not on_path


_BUILD = """
import json, sys
from linerate.transport import rdma, verbs
pv = verbs.load()
e = pv.e
remote = {"qpn": 0x1234, "psn": 0xABCDE, "lid": 0, "mtu": e.IBV_MTU_1024, "port": "x:1",
          "gid": "0000:0000:0000:0000:0000:ffff:0a00:0002"}
a = rdma.init_attr(pv, 1)
c = rdma.connect_attr(pv, 1, True, 3, e.IBV_MTU_4096, remote, 0x777, 60.0)
ib = rdma.connect_attr(pv, 2, False, None, e.IBV_MTU_4096, dict(remote, lid=9, gid=""), 1, 0)
w = rdma.write_wr(pv, 5, [(0x1000, 10, 7), (0x2000, 20, 8)], 0x3000, 99, imm=(3 << 24) | 30)
k = rdma.write_wr(pv, 6, [(0x1000, 8, 7)], 0x3010, 99)
r = rdma.recv_wr(pv, rdma._RECV_ID | 3, 0x4000, 32, 9)
print(json.dumps({"fake": pv.fake, "enums": pv.e.__name__,
    "init": [a.port_num, a.qp_access_flags, a.pkey_index],
    "conn": [c.port_num, c.path_mtu, c.dest_qp_num, c.rq_psn, c.sq_psn, c.timeout, c.retry_cnt,
             c.rnr_retry, c.min_rnr_timer, c.max_dest_rd_atomic, c.max_rd_atomic, c.qp_access_flags],
    "ah": [c.ah_attr.is_global, c.ah_attr.dgid, c.ah_attr.sgid_index, c.ah_attr.hop_limit, c.ah_attr.port_num],
    "ib_ah": [ib.ah_attr.is_global, ib.ah_attr.dlid, ib.ah_attr.port_num, ib.timeout],
    "wr": [w.wr_id, w.opcode, w.num_sge, w.imm_data, k.opcode, k.num_sge],
    "recv": [r.wr_id, r.num_sge]}))
"""


@pytest.mark.parametrize("which", ["fake", "system"])
def test_verbs_objects_build_with_pyverbs(which):
    """Every pyverbs class, argument and attribute name the transport uses, with the fake and
    with the real rdma-core pyverbs where it is installed (building these needs no device)."""
    env = {"LINERATE_PYVERBS_PATH": FAKE_PYVERBS} if which == "fake" else {}
    if which == "system" and system_pyverbs_reason():
        pytest.skip(system_pyverbs_reason())
    out = _python(_BUILD, **env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fake"] == (which == "fake")
    e_mtu1024 = 3
    assert got["init"] == [1, 3, 0]
    assert got["conn"] == [1, e_mtu1024, 0x1234, 0xABCDE, 0x777, rdma.qp_timeout_exponent(60.0), 7, 7, 12, 1, 1, 3]
    assert got["ah"] == [1, "0000:0000:0000:0000:0000:ffff:0a00:0002", 3, 64, 1]
    assert got["ib_ah"] == [0, 9, 2, 14]
    assert got["wr"] == [5, 1, 2, socket.htonl((3 << 24) | 30), 0, 1]
    assert got["recv"] == [rdma._RECV_ID | 3, 1]


_API = """
import inspect, json
from linerate.transport import verbs
pv = verbs.load()
out = {}
for m in ("addr", "cq", "device", "enums", "mr", "pd", "qp", "wr", "pyverbs_error"):
    mod = pv.e if m == "enums" else getattr(pv, m)
    names = {}
    for n in dir(mod):
        o = getattr(mod, n)
        if n.startswith("_") or inspect.ismodule(o):
            continue
        if inspect.isclass(o):
            names[n] = {"module": o.__module__.rsplit(".", 1)[-1],
                        "attrs": sorted(a for a in dir(o) if not a.startswith("_"))}
        elif isinstance(o, int):
            names[n] = {"value": int(o)}
        else:
            names[n] = {"module": getattr(o, "__module__", "").rsplit(".", 1)[-1]}
    out[m] = names
print(json.dumps({"fake": pv.fake, "modules": out}))
"""


def _api(env: dict) -> dict:
    out = _python(_API, **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fake_instance_attrs() -> dict:
    """{(module, class): the public attributes its methods assign on self} in the fake."""
    import ast
    found = {}
    folder = os.path.join(FAKE_PYVERBS, "pyverbs")
    for name in os.listdir(folder):
        if not name.endswith(".py") or name.startswith("_"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            found[(name[:-3], cls.name)] = {
                t.attr for t in ast.walk(cls) if isinstance(t, ast.Attribute)
                and isinstance(t.ctx, ast.Store) and isinstance(t.value, ast.Name)
                and t.value.id == "self" and not t.attr.startswith("_")}
    return found


def test_fake_pyverbs_offers_only_what_the_real_one_has():
    """The fake against rdma-core's pyverbs (building the module list needs no device): every
    public name a fake module defines exists in the real module, every enum value is the
    real one, and every public method, property or attribute of a fake class is one of the
    real class's. What is the fake's own (its fabric, its bookkeeping) is private, so a
    transport that used it would fail on real hardware and here."""
    reason = system_pyverbs_reason()
    if reason:
        pytest.skip(reason)
    fake, real = _api({"LINERATE_PYVERBS_PATH": FAKE_PYVERBS}), _api({})
    assert fake["fake"] and not real["fake"]
    assigned = _fake_instance_attrs()
    wrong = []
    for m, names in fake["modules"].items():
        have = real["modules"][m]
        for n, what in names.items():
            if what.get("module") not in (None, m) and m != "enums":
                continue  # imported from another fake module: checked there
            if n not in have:
                wrong.append(f"pyverbs.{m}.{n}: not in the real pyverbs")
            elif "value" in what:
                if have[n].get("value") != what["value"]:
                    wrong.append(f"pyverbs.{m}.{n} = {what['value']}, real {have[n].get('value')}")
            elif "attrs" in what:
                extra = set(what["attrs"]) - set(have[n].get("attrs", []))
                extra |= assigned.get((m, n), set()) - set(have[n].get("attrs", []))
                if extra:
                    wrong.append(f"pyverbs.{m}.{n}: {sorted(extra)} not in the real class")
    assert not wrong, "\n".join(wrong)


def test_real_rdma_skip_reason_names_the_cause():
    reason = real_rdma_reason()
    if not reason:
        pytest.skip("this machine has an RDMA device: the rdma cases of test_transport.py ran")
    assert reason.startswith(("ibv_get_device_list", "pyverbs", "no active", "no RDMA", "cannot import")), reason


# ----------------------------------------------------------------------------- probe
def test_probe_command():
    env = {"LINERATE_PYVERBS_PATH": FAKE_PYVERBS}
    out = _python("from linerate.tools.cli import main; main(['probe'])", **env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Network interfaces:" in text and "lo " in text and "127.0.0.1/8" in text
    assert "fakerxe0:1" in text and "ACTIVE" in text and "RoCE v2" in text
    assert "* GID 3" in text and "0000:ffff:7f00:0001" in text
    assert "auto would use RDMA here" in text
    out = _python("from linerate.tools.cli import main; main(['probe', '--json'])", FAKE_PYVERBS_DEVICES="enosys", **env)
    report = json.loads(out.stdout)
    assert report["rdma"]["auto"]["transport"] == "tcp"
    assert "ibv_get_device_list failed" in report["rdma"]["error"]
    assert any(i["name"] == "lo" for i in report["interfaces"])


# ----------------------------------------------------------------------------- end to end
def _collectives(rank, world, lr):
    """A few collectives on the default group (init_process_group("linerate") over RDMA),
    each against a Gloo group or NumPy-style expectations."""
    gloo = dist.new_group(backend="gloo")
    ctx = getattr(lr, "_ctx", None)
    transport = getattr(ctx, "transport", "?")
    gen = torch.Generator().manual_seed(rank)
    out = {"transport": transport, "ok": []}
    for n in (1, 1000, 300_000, 1_500_001):
        x = torch.randn(n, generator=gen)
        a, g = x.clone(), x.clone()
        dist.all_reduce(a, group=lr)
        dist.all_reduce(g, group=gloo)
        out["ok"].append(("all_reduce", n, torch.equal(a, g) or torch.allclose(a, g, rtol=1e-5, atol=1e-5)))
    b = torch.arange(70_000, dtype=torch.int64) * (rank + 1)
    dist.broadcast(b, src=1, group=lr)
    out["ok"].append(("broadcast", 0, torch.equal(b, torch.arange(70_000, dtype=torch.int64) * 2)))
    t = torch.full((50_000,), rank, dtype=torch.int32)
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t, group=lr)
    out["ok"].append(("all_gather", 0, all(torch.equal(v, torch.full_like(t, r)) for r, v in enumerate(gathered))))
    x = torch.arange(world * 1000, dtype=torch.float64) + rank
    rs = torch.empty(1000, dtype=torch.float64)
    dist.reduce_scatter_tensor(rs, x, group=lr)
    want = (torch.arange(world * 1000, dtype=torch.float64) * world + sum(range(world)))[rank * 1000:(rank + 1) * 1000]
    out["ok"].append(("reduce_scatter", 0, torch.equal(rs, want)))
    a2a_in = torch.arange(world * 3, dtype=torch.int64) + 100 * rank
    a2a_out = torch.empty_like(a2a_in)
    dist.all_to_all_single(a2a_out, a2a_in, group=lr)
    want = torch.cat([torch.arange(3, dtype=torch.int64) + 3 * rank + 100 * r for r in range(world)])
    out["ok"].append(("all_to_all", 0, torch.equal(a2a_out, want)))
    if rank == 0:
        dist.send(torch.arange(200_000, dtype=torch.float32), dst=world - 1, group=lr)
    elif rank == world - 1:
        got = torch.empty(200_000, dtype=torch.float32)
        dist.recv(got, src=0, group=lr)
        out["ok"].append(("send_recv", 0, torch.equal(got, torch.arange(200_000, dtype=torch.float32))))
    dist.barrier(group=lr)
    return out


@pytest.mark.parametrize("which", ["rdma-fake", "rdma"])
def test_backend_collectives(which):
    """dist.init_process_group's groups over RDMA: collectives against Gloo and NumPy."""
    # LINERATE_SHM=0: co-located ranks would use shared memory for collectives and p2p alike
    env = {"LINERATE_TRANSPORT": "rdma", "LINERATE_SOCKET_IFNAME": "lo", "LINERATE_NSOCKS": "2",
           "LINERATE_SHM": "0"}
    if which == "rdma":
        reason = real_rdma_reason()
        if reason:
            pytest.skip(f"no RDMA device: {reason}")
        env["LINERATE_PYVERBS_PATH"] = ""
    else:
        env["LINERATE_PYVERBS_PATH"] = FAKE_PYVERBS
    results = run_ranks(_collectives, 3, timeout=50, env=env, backend="linerate")
    for rank, res in enumerate(results):
        assert res["transport"] == "rdma", res
        bad = [c for c in res["ok"] if not c[2]]
        assert not bad, f"rank {rank}: {bad}"
