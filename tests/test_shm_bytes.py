"""The bytes that the shared-memory collectives move, counted like a link's (interface ``shm``).

Per collective and algorithm on one host (collectives/shm_algos.py), each rank's count per
peer, sent and received, equals what the algorithm moves; the rule (Engine.tx): a rank *sends*
to q the bytes it wrote into the segment that q reads (or that q reads from its tensor by
cross-memory attach), and *receives* from q the bytes it reads of q's. So r's sent to q is q's
received from r, which is checked for every pair. The figures come through the transport's
stats (``connection_stats``: the peer's ``shm`` connection), the benchmark's links and the
exporter's ``linerate_sent_bytes_total{interface="shm"}``.

What the memory moved (Engine.copied, the exporter's
``linerate_interface_bytes_total{interface="shm"}``, the bytes of the utilization): a byte
written for several peers counts once (a broadcast's root writes its tensor once for all); what
a rank read is what it received. The capacity of ``shm`` is the host's copy rate, measured by
the segment's creator and published in the segment: one figure on every rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from _harness import free_port_range, run_ranks

ROOT = Path(__file__).resolve().parent.parent
ES = 4  # float32


def _share(n: int, P: int, q: int) -> int:
    """Length of rank q's share of n elements (shm_algos._share: multiples of 16 elements)."""
    m = -(-n // P)
    m = -(-m // 16) * 16
    lo = min(n, q * m)
    return min(n, lo + m) - lo


def _chunks(n: int, per: int) -> list[int]:
    return [min(per, n - o) for o in range(0, n, per)] or [0]


# ----------------------------------------------------------------------------- the expected counts
def expected(name: str, P: int, r: int, C: int, n: int, path: str = "segment",
             root: int = 0) -> dict[int, tuple[int, int]]:
    """{peer: (sent, received)} that rank r of P must count for one op on ``n`` float32 per
    rank (C: the engine's area size), derived from the algorithms:

    - all_reduce up to 64 KiB: each rank copies its tensor into its slot and folds every
      rank's: n*4 each way with every peer.
    - all_reduce through the segment: per chunk (C/4 elements), q folds q's share of r's slot
      and copies r's share of the result out; r does the same with q's: (share_q + share_r)*4
      each way. Summed over the peers: 2(P-1)/P of the bytes where the shares are even.
    - all_reduce by cross-memory attach: the same shares of the whole tensor, read from the
      peers' tensors (one "chunk").
    - reduce: every rank folds its share of every slot; the root copies every share out.
    - broadcast, scatter: the root sends n*4 to each peer; the others receive it from the root.
    - all_gather: n*4 each way with every peer; gather: to / from the root only.
    - reduce_scatter (n per rank's result): q folds its block of every slot: n*4 each way.
    - all_to_all: what the splits say (rank r sends (r*P + q + 1)*100 elements to q).
    - barrier: nothing.
    """
    peers = [q for q in range(P) if q != r]
    out = {q: [0, 0] for q in peers}
    nb = n * ES
    if name == "all_reduce":
        if nb <= min(64 << 10, C):
            return {q: (nb, nb) for q in peers}
        chunks = [n] if path == "cma" else _chunks(n, C // ES)
        for ln in chunks:
            for q in peers:
                d = (_share(ln, P, q) + _share(ln, P, r)) * ES
                out[q][0] += d
                out[q][1] += d
    elif name == "reduce":
        if nb <= min(64 << 10, C):
            if r == root:
                return {q: (0, nb) for q in peers}
            return {q: (nb if q == root else 0, 0) for q in peers}
        for ln in _chunks(n, C // ES):
            for q in peers:
                out[q][0] += _share(ln, P, q) * ES
                out[q][1] += _share(ln, P, r) * ES
                if r == root:
                    out[q][1] += _share(ln, P, q) * ES
            if r != root:
                out[root][0] += _share(ln, P, r) * ES
    elif name in ("broadcast", "scatter"):
        for q in peers:
            out[q] = [nb, 0] if r == root else [0, nb if q == root else 0]
    elif name in ("all_gather", "reduce_scatter"):
        return {q: (nb, nb) for q in peers}
    elif name == "gather":
        for q in peers:
            out[q] = [0, nb] if r == root else [nb if q == root else 0, 0]
    elif name == "all_to_all":
        for q in peers:
            out[q] = [(r * P + q + 1) * 100 * ES, (q * P + r + 1) * 100 * ES]
    elif name != "barrier":
        raise AssertionError(name)
    return {q: tuple(v) for q, v in out.items()}


def expected_written(name: str, P: int, r: int, C: int, n: int, path: str = "segment",
                     root: int = 0) -> int:
    """Bytes rank r writes for its peers in one op (Engine.wrote), each once however many
    peers read it (what only r itself reads again does not count):

    - all_reduce up to 64 KiB: its tensor into its slot, once for every peer.
    - all_reduce through the segment: per chunk its slot but its own share (folded from its
      tensor) and its share of the result: the tensor's size. By cross-memory attach: only its
      share of the result (the peers read its input where it lies).
    - reduce: its slot but its own share, and its share of the result where the root reads it.
    - broadcast: the root's tensor, once; scatter: the root's block for each peer.
    - all_gather: its contribution, once; gather: the same, but the root's (no reader).
    - reduce_scatter, all_to_all: a block per peer (one reader each: the sum of the sent).
    """
    nb = n * ES
    if name == "all_reduce":
        if nb <= min(64 << 10, C):
            return nb
        return _share(n, P, r) * ES if path == "cma" else nb
    if name == "reduce":
        if nb <= min(64 << 10, C):
            return 0 if r == root else nb
        if r != root:
            return nb
        return sum(ln - _share(ln, P, r) for ln in _chunks(n, C // ES)) * ES
    if name == "broadcast":
        return nb if r == root else 0
    if name == "scatter":
        return (P - 1) * nb if r == root else 0
    if name == "all_gather":
        return nb
    if name == "gather":
        return 0 if r == root else nb
    if name == "reduce_scatter":
        return (P - 1) * nb
    if name == "all_to_all":
        return sum((r * P + q + 1) * 100 * ES for q in range(P) if q != r)
    assert name == "barrier", name
    return 0


# ----------------------------------------------------------------------------- the ranks
def _conn_bytes(g) -> dict[int, tuple[int, int]]:
    import torch
    be = g._get_backend(torch.device("cpu"))
    out: dict[int, list] = {}
    for c in be.connection_stats():
        acc = out.setdefault(c["peer"], [0, 0])
        acc[0] += c["sent_bytes"]
        acc[1] += c["received_bytes"]
    return {q: tuple(v) for q, v in out.items()}


def _counts(rank, P, lr):
    """Every collective once on the segment: (name, n, path, root, engine counts, stats
    counts, the engine's copied bytes, the metrics' shm bytes) per op, and the engine's area
    size."""
    import torch
    import torch.distributed as dist

    from linerate.transport import metrics
    os.environ["LINERATE_CMA"] = "0"   # large all_reduces copy through the segment
    seg = dist.new_group(backend="linerate")
    os.environ["LINERATE_CMA"] = "1"   # ... or read the peers' tensors, where the host allows
    cma = dist.new_group(backend="linerate")
    del os.environ["LINERATE_CMA"]
    out = []

    def shm_bytes(g):
        m = metrics.interface_bytes(g._get_backend(torch.device("cpu"))._ctx)
        return m.get(("shm", "tx"), 0), m.get(("shm", "rx"), 0)

    def measure(g, name, n, fn, root=0):
        E = g._shm
        assert E is not None, "the group did not get a shared segment"
        before, conn0, paths0 = E.traffic(), _conn_bytes(g), list(E.big_paths)
        copied0, iface0 = E.copied(), shm_bytes(g)
        fn()
        after, conn1 = E.traffic(), _conn_bytes(g)
        copied1, iface1 = E.copied(), shm_bytes(g)
        path = "cma" if E.big_paths[0] > paths0[0] else "segment"
        moved = {q: (after[q][0] - before[q][0], after[q][1] - before[q][1]) for q in after}
        stats = {q: (conn1[q][0] - conn0[q][0], conn1[q][1] - conn0[q][1]) for q in conn1}
        copied = (copied1[0] - copied0[0], copied1[1] - copied0[1])
        iface = (iface1[0] - iface0[0], iface1[1] - iface0[1])
        out.append((name, n, path, root, moved, stats, copied, iface))

    def t(n, fill=1.0):
        return torch.full((n,), float(rank) + fill)

    for n in (1000, 100_003, 1_000_003):
        x = t(n)
        measure(seg, "all_reduce", n, lambda: dist.all_reduce(x, group=seg))
    x = t(1_000_003)
    measure(cma, "all_reduce", 1_000_003, lambda: dist.all_reduce(x, group=cma))  # + the probe
    measure(cma, "all_reduce", 1_000_003, lambda: dist.all_reduce(x, group=cma))
    for n, root in ((1000, 0), (1_000_003, P - 1)):
        x = t(n)
        measure(seg, "reduce", n, lambda: dist.reduce(x, root, group=seg), root)
    x = t(500_001)
    measure(seg, "broadcast", 500_001, lambda: dist.broadcast(x, 1, group=seg), 1)
    x, outs = t(200_001), [t(200_001) for _ in range(P)]
    measure(seg, "all_gather", 200_001, lambda: dist.all_gather(outs, x, group=seg))
    ins, o = [t(150_001, q) for q in range(P)], t(150_001)
    measure(seg, "reduce_scatter", 150_001, lambda: dist.reduce_scatter(o, ins, group=seg))
    send = [(rank * P + q + 1) * 100 for q in range(P)]
    recv = [(q * P + rank + 1) * 100 for q in range(P)]
    a, b = t(sum(send)), t(sum(recv))
    measure(seg, "all_to_all", 0,
            lambda: dist.all_to_all_single(b, a, recv, send, group=seg))
    x = t(70_001)
    outs = [t(70_001) for _ in range(P)] if rank == 0 else None
    measure(seg, "gather", 70_001, lambda: dist.gather(x, outs, 0, group=seg))
    ins = [t(90_001, q) for q in range(P)] if rank == 1 else None
    o = t(90_001)
    measure(seg, "scatter", 90_001, lambda: dist.scatter(o, ins, 1, group=seg), 1)
    measure(seg, "barrier", 0, lambda: dist.barrier(group=seg))
    C = seg._shm.C
    dist.destroy_process_group(seg)
    dist.destroy_process_group(cma)
    return C, out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [3, 4])
def test_counted_bytes_equal_what_each_collective_moves(P):
    res = run_ranks(_counts, P, timeout=220)
    for r, (C, ops) in enumerate(res):
        for name, n, path, root, moved, stats, copied, iface in ops:
            want = expected(name, P, r, C, n, path, root)
            assert moved == want, (r, name, n, path, moved, want)
            # The transport's stats carry the same figures on the peer's shm connection (no
            # point-to-point message ran meanwhile).
            assert stats == want, (r, name, n, path, stats, want)
            # What the memory moved: each byte written once for all its readers (never more
            # than the per-peer sent), and read as received.
            wrote = expected_written(name, P, r, C, n, path, root)
            received = sum(v[1] for v in want.values())
            assert copied == (wrote, received), (r, name, n, path, copied, wrote, received)
            assert wrote <= sum(v[0] for v in want.values()), (r, name, n, path)
            # ... which are the exporter's shm bytes (those of the utilization).
            assert iface == copied, (r, name, n, path, iface, copied)
    # r's sent to q is q's received from r, op by op.
    for r, (_, ops) in enumerate(res):
        for i, (name, _n, _path, _root, moved, *_rest) in enumerate(ops):
            for q, (sent, _) in moved.items():
                assert sent == res[q][1][i][4][r][1], (name, r, q)
    paths = [(name, n, path) for name, n, path, *_rest in res[0][1] if name == "all_reduce"]
    assert [p for _, _, p in paths[:3]] == ["segment"] * 3, paths
    # This machine allows cross-memory attach (see tests/test_shm.py): both paths counted.
    assert [p for _, _, p in paths[3:]] == ["cma", "cma"], paths
    # A large all_reduce moves 2(P-1)/P of its bytes each way per rank (shares round to 16
    # elements: within 1%).
    for r, (_, ops) in enumerate(res):
        for name, n, path, _, moved, *_rest in ops:
            if name == "all_reduce" and n == 1_000_003:
                ideal = 2 * (P - 1) / P * n * ES
                for k in (0, 1):
                    assert sum(v[k] for v in moved.values()) == pytest.approx(ideal, rel=0.01)


# ----------------------------------------------------------------------------- bench, exporter, top
@pytest.mark.timeout(180)
def test_bench_links_show_shared_memory_bytes_per_peer(tmp_path):
    out = tmp_path / "b.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "bench", "--nproc", "2",
                           "--ops", "all_reduce", "--min-bytes", "1M", "--max-bytes", "1M",
                           "--iters", "3", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    entries = [e for e in doc["links"] if e["label"] == "linerate"]
    assert sorted(e["rank"] for e in entries) == [0, 1] and all(e["shared_memory"] for e in entries)
    ops = doc["warmup"] + doc["iters"]  # every all_reduce of the run: 1 MiB, 2(P-1)/P = 1
    for e in entries:
        (link,) = e["links"]
        assert link["peer"] == 1 - e["rank"]
        assert link["sent_bytes"] == link["received_bytes"] == ops << 20, e
        assert [c["local"] for c in link["connections"]] == ["shm"]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("#    ")]
    assert any(line.split()[4] == str(ops << 20) for line in rows), proc.stdout


def _exported(rank, P, lr, port):
    import torch
    import torch.distributed as dist
    from prometheus_client.parser import text_string_to_metric_families

    from linerate.transport import metrics
    metrics.start_exporter(port + rank, "127.0.0.1")
    x = torch.ones(1 << 20)
    dist.all_reduce(x, group=lr)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics",
                                  timeout=20).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    sent = [(s.labels["peer"], s.labels["interface"], s.value)
            for s in fams["linerate_sent_bytes"].samples if s.name.endswith("_total")]
    cap = {s.labels["interface"]: s.value
           for s in fams["linerate_link_capacity_bytes_per_second"].samples}
    return sent, cap


@pytest.mark.timeout(120)
def test_exporter_counts_shared_memory_with_a_capacity():
    port = free_port_range(2)
    res = run_ranks(_exported, 2, port, timeout=100, env={"LINERATE_LINK_CAPACITY": "shm=80gbit"})
    for rank, (sent, cap) in enumerate(res):
        assert sent == [(str(1 - rank), "shm", float(4 << 20))], sent  # 2(P-1)/P * 4 MiB
        assert cap == {"shm": pytest.approx(1e10)}, cap


def test_shm_capacity_is_the_measured_copy_rate_unless_set(monkeypatch):
    from linerate.transport import metrics
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "10gbit")  # every interface: not memory's
    rate = metrics.link_capacity("shm")
    assert rate == metrics.shm_rate() and rate > 2e8  # measured once: the same figure
    assert metrics.capacity_source("shm") == "measured"
    assert metrics.capacity_source("lo") == "setting"
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "eth0=1gbit,shm=400gbit")
    assert metrics.link_capacity("shm") == pytest.approx(5e10)
    assert metrics.capacity_source("shm") == "setting"
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "shm=lots")
    with pytest.raises(ValueError, match="LINERATE_LINK_CAPACITY.*shm=lots"):
        metrics.link_capacity("shm")


def test_the_copy_probe_measures_the_fastest_copies():
    """The probe's figure is at least what copies of the collectives' sizes reach when they
    run back to back from a warm cache (so a rank's utilization of shm stays at or under 1):
    within the noise of one more measurement."""
    import ctypes
    import time

    from linerate.transport import metrics
    rate = metrics.memcpy_rate()
    n = 1 << 20
    src, dst = bytearray(n), bytearray(n)
    a = ctypes.addressof((ctypes.c_char * n).from_buffer(src))
    b = ctypes.addressof((ctypes.c_char * n).from_buffer(dst))
    ctypes.memmove(b, a, n)
    t0 = time.perf_counter()
    for _ in range(32):
        ctypes.memmove(b, a, n)
    sustained = 32 * n / (time.perf_counter() - t0)
    assert sustained <= rate * 1.25, (sustained, rate)


def _broadcast_metrics(rank, P, lr, port, nbytes, p2p_bytes):
    """A 4-rank group on one host: scrape this rank's /metrics before and after a broadcast
    from rank 0 of ``nbytes`` and a message of ``p2p_bytes`` from rank 1 to rank 2 (the
    shared-memory link); return the shm series' deltas and the capacity samples."""
    import time

    import torch
    import torch.distributed as dist
    from prometheus_client.parser import text_string_to_metric_families

    from linerate.transport import metrics
    os.environ.pop("LINERATE_LINK_CAPACITY", None)  # the measured capacity
    g = dist.new_group(backend="linerate")
    assert g._shm is not None, "the group did not get a shared segment"
    metrics.start_exporter(port + rank, "127.0.0.1")

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics",
                                      timeout=20).read().decode()
        out = {"sent": {}, "iface": {}, "cap": []}
        for f in text_string_to_metric_families(text):
            for smp in f.samples:
                lab = smp.labels
                if smp.name == "linerate_sent_bytes_total" and lab["interface"] == "shm":
                    out["sent"][int(lab["peer"])] = smp.value
                elif smp.name == "linerate_interface_bytes_total" and lab["interface"] == "shm":
                    out["iface"][lab["direction"]] = smp.value
                elif smp.name == "linerate_link_capacity_bytes_per_second":
                    out["cap"].append((lab["interface"], lab.get("source"), smp.value))
        return out

    dist.barrier(group=g)
    before = scrape()
    x = torch.full((nbytes // 4,), float(rank))
    dist.broadcast(x, 0, group=g)
    assert bool((x == 0).all()), "wrong broadcast result"
    msg = torch.full((p2p_bytes // 4,), 7.0)
    if rank == 1:
        dist.send(msg, 2, group=g)
    elif rank == 2:
        dist.recv(msg, 1, group=g)
        assert bool((msg == 7.0).all()), "wrong message"
    dist.barrier(group=g)
    after = scrape()
    # The barriers move no payload; a second look at once sees nothing more.
    time.sleep(0.05)
    sent = {q: after["sent"].get(q, 0) - before["sent"].get(q, 0) for q in after["sent"]}
    iface = {d: after["iface"].get(d, 0) - before["iface"].get(d, 0) for d in ("tx", "rx")}
    dist.destroy_process_group(g)
    return {"sent": sent, "iface": iface, "cap": after["cap"],
            "rate": g._ctx.shm.copy_rate if g._ctx.shm is not None else None}


@pytest.mark.timeout(120)
def test_broadcast_root_writes_one_copy_at_4_ranks():
    """A broadcast's root sends its tensor to each of its 3 peers (per peer) and writes it
    once (interface bytes: one copy of the tensor); a shared-memory link's message counts the
    same in both; every rank exports one shm capacity, the host's, measured."""
    P, nbytes, p2p_bytes = 4, 3 << 20, 1 << 20
    port = free_port_range(P)
    res = run_ranks(_broadcast_metrics, P, port, nbytes, p2p_bytes, timeout=100)
    root = res[0]
    assert root["sent"] == {q: nbytes for q in (1, 2, 3)}, root["sent"]
    assert root["iface"] == {"tx": nbytes, "rx": 0}, root["iface"]
    for r in (1, 2, 3):
        tx = p2p_bytes if r == 1 else 0
        rx = nbytes + (p2p_bytes if r == 2 else 0)
        assert res[r]["iface"] == {"tx": tx, "rx": rx}, (r, res[r]["iface"])
        assert res[r]["sent"].get(0, 0) == 0, (r, res[r]["sent"])
    assert res[1]["sent"][2] == p2p_bytes
    caps = [[c for c in r["cap"] if c[0] == "shm"] for r in res]
    assert all(len(c) == 1 for c in caps), caps  # one shm capacity per rank
    assert len({c[0] for c in caps}) == 1, caps  # the same figure on every rank of the host
    (iface, source, value), = caps[0]
    assert source == "measured" and value == res[0]["rate"] > 2e8, caps
