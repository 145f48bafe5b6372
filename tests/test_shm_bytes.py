"""The bytes that the shared-memory collectives move, counted like a link's (interface ``shm``).

Per collective and algorithm on one host (collectives/shm_algos.py), each rank's count per
peer, sent and received, equals what the algorithm moves; the rule (Engine.tx): a rank *sends*
to q the bytes it wrote into the segment that q reads (or that q reads from its tensor by
cross-memory attach), and *receives* from q the bytes it reads of q's. So r's sent to q is q's
received from r, which is checked for every pair. The figures come through the transport's
stats (``connection_stats``: the peer's ``shm`` connection), the benchmark's links and the
exporter's ``linerate_sent_bytes_total{interface="shm"}``; the capacity of ``shm`` is the
memory copy rate.
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
    counts) per op, and the engine's area size."""
    import torch
    import torch.distributed as dist
    os.environ["LINERATE_CMA"] = "0"   # large all_reduces copy through the segment
    seg = dist.new_group(backend="linerate")
    os.environ["LINERATE_CMA"] = "1"   # ... or read the peers' tensors, where the host allows
    cma = dist.new_group(backend="linerate")
    del os.environ["LINERATE_CMA"]
    out = []

    def measure(g, name, n, fn, root=0):
        E = g._shm
        assert E is not None, "the group did not get a shared segment"
        before, conn0, paths0 = E.traffic(), _conn_bytes(g), list(E.big_paths)
        fn()
        after, conn1 = E.traffic(), _conn_bytes(g)
        path = "cma" if E.big_paths[0] > paths0[0] else "segment"
        moved = {q: (after[q][0] - before[q][0], after[q][1] - before[q][1]) for q in after}
        stats = {q: (conn1[q][0] - conn0[q][0], conn1[q][1] - conn0[q][1]) for q in conn1}
        out.append((name, n, path, root, moved, stats))

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
        for name, n, path, root, moved, stats in ops:
            want = expected(name, P, r, C, n, path, root)
            assert moved == want, (r, name, n, path, moved, want)
            # The transport's stats carry the same figures on the peer's shm connection (no
            # point-to-point message ran meanwhile).
            assert stats == want, (r, name, n, path, stats, want)
    # r's sent to q is q's received from r, op by op.
    for r, (_, ops) in enumerate(res):
        for i, (name, *_rest, moved, _) in enumerate(ops):
            for q, (sent, _) in moved.items():
                assert sent == res[q][1][i][4][r][1], (name, r, q)
    paths = [(name, n, path) for name, n, path, *_ in res[0][1] if name == "all_reduce"]
    assert [p for _, _, p in paths[:3]] == ["segment"] * 3, paths
    # This machine allows cross-memory attach (see tests/test_shm.py): both paths counted.
    assert [p for _, _, p in paths[3:]] == ["cma", "cma"], paths
    # A large all_reduce moves 2(P-1)/P of its bytes each way per rank (shares round to 16
    # elements: within 1%).
    for r, (_, ops) in enumerate(res):
        for name, n, path, _, moved, _ in ops:
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
    assert rate == metrics.memcpy_rate() and rate > 2e8  # measured once: the same figure
    monkeypatch.setenv("LINERATE_LINK_CAPACITY", "eth0=1gbit,shm=400gbit")
    assert metrics.link_capacity("shm") == pytest.approx(5e10)
