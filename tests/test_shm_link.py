"""Point-to-point messages between ranks of one host over shared memory (transport/shm/ring.py).

- send/recv, isend/irecv, batch_isend_irecv byte-exact over "shm" links: dtypes, 0 and odd
  sizes, messages larger than a pair's ring, any-source receives, tags; and no TCP socket is
  opened for them (the group of one host makes no TCP mesh at all);
- a forced flat algorithm (LINERATE_ALLREDUCE_ALGO=ring) runs over the links and matches Gloo;
- a co-located peer SIGKILLed while a receive waits for it: the error names it, fast;
- nothing is left in /dev/shm after a normal exit, destroy_process_group or a SIGKILL;
- a rank blocked in a receive for ~1 s uses little CPU (the progress thread sleeps on a futex);
- LINERATE_SHM=0: the same traffic goes over TCP links.
- mixed groups: in this process (one rank's host id patched) shm beside lazy TCP and beside
  RDMA (the fake pyverbs); on netlab 2 hosts x 2 ranks, shm to the co-located peer and TCP
  (lazy and eager) to the other host, p2p every way and all_reduce (auto, ring) against Gloo.
"""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _harness import RankError, run_netlab_script, run_ranks


def _sockets() -> set:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def _kinds(lr) -> list:
    return sorted({link["kind"] for p in lr._ctx.stats()["peers"] for link in p["links"]})


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
SIZES = [0, 1, 3, 4097, 65_537, (3 << 20) // 4 + 5, 5_000_001]  # the last > a 2 MiB ring


def _data(dtype, n, src, dst, salt=0):
    g = torch.Generator().manual_seed(1000 * src + 10 * dst + n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _p2p(rank, P, lr):
    before = _sockets()
    bad = []
    # blocking send/recv in a ring, every dtype and size, each on its own tag
    right, left = (rank + 1) % P, (rank - 1) % P
    tag = 0
    for dtype in DTYPES:
        for n in SIZES:
            tag += 1
            out = _data(dtype, n, rank, right)
            got = torch.empty(n, dtype=dtype)
            if rank % 2 == 0:
                dist.send(out, right, group=lr, tag=tag)
                dist.recv(got, left, group=lr, tag=tag)
            else:
                dist.recv(got, left, group=lr, tag=tag)
                dist.send(out, right, group=lr, tag=tag)
            if not torch.equal(got, _data(dtype, n, left, rank)):
                bad.append(("ring", str(dtype), n))
    # isend/irecv to and from every peer at once, two tags posted in reverse order
    reqs, want = [], []
    for q in range(P):
        if q == rank:
            continue
        for t in (7, 8):
            got = torch.empty(1 << 20 if t == 7 else 33, dtype=torch.float64)
            reqs.append(dist.irecv(got, q, group=lr, tag=t))
            want.append((got, _data(torch.float64, got.numel(), q, rank, salt=t)))
    for q in range(P):
        if q != rank:
            for t in (8, 7):
                n = 1 << 20 if t == 7 else 33
                reqs.append(dist.isend(_data(torch.float64, n, rank, q, salt=t), q, group=lr, tag=t))
    for r in reqs:
        r.wait()
    bad += [("isend", i) for i, (g, w) in enumerate(want) if not torch.equal(g, w)]
    # batch_isend_irecv: everyone to everyone, one message per pair
    ops, want = [], []
    for q in range(P):
        if q != rank:
            ops.append(dist.P2POp(dist.isend, _data(torch.int32, 10_007, rank, q, salt=99), q, group=lr))
            got = torch.empty(10_007, dtype=torch.int32)
            ops.append(dist.P2POp(dist.irecv, got, q, group=lr))
            want.append((got, _data(torch.int32, 10_007, q, rank, salt=99)))
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    bad += [("batch", i) for i, (g, w) in enumerate(want) if not torch.equal(g, w)]
    # any source: rank 0 receives one message from each other rank, whoever comes first
    if rank == 0:
        seen = {}
        for _ in range(P - 1):
            got = torch.empty(3 << 20, dtype=torch.uint8)
            src = dist.recv(got, group=lr, tag=42)
            seen[src] = torch.equal(got, _data(torch.uint8, 3 << 20, src, 0, salt=42))
        if sorted(seen) != list(range(1, P)) or not all(seen.values()):
            bad.append(("anysource", seen))
    else:
        dist.send(_data(torch.uint8, 3 << 20, rank, 0, salt=42), 0, group=lr, tag=42)
    dist.barrier(group=lr)
    st = lr._ctx.stats()
    sent = sum(link["bytes_sent"] for p in st["peers"] for link in p["links"])
    return {"bad": bad, "kinds": _kinds(lr), "new_sockets": len(_sockets() - before),
            "tcp_mesh": lr._ctx._maker is not None, "sent": sent,
            "conns": lr._ctx.connection_stats()}


@pytest.mark.timeout(300)
def test_p2p_over_shared_memory_is_exact_and_opens_no_socket():
    res = run_ranks(_p2p, 3, timeout=240)
    for r, out in enumerate(res):
        assert not out["bad"], (r, out["bad"])
        assert out["kinds"] == ["shm"], out["kinds"]
        assert not out["tcp_mesh"] and out["new_sockets"] == 0, out
        assert out["sent"] > 100 << 20, out["sent"]
        assert out["conns"] and all(c["local"] == "shm" for c in out["conns"]), out["conns"]


@pytest.mark.timeout(300)
def test_p2p_over_tcp_with_shm_off():
    res = run_ranks(_p2p, 2, timeout=240, env={"LINERATE_SHM": "0"})
    for out in res:
        assert not out["bad"], out["bad"]
        assert out["kinds"] == ["tcp"] and out["tcp_mesh"], out


def _flat_ring(rank, P, lr):
    from linerate.collectives import flight
    g = torch.Generator().manual_seed(rank)
    ok = True
    algos = []
    # a large call, then small synchronous ones (the fused path's agreement round would
    # reduce them itself: the forced algorithm must run them)
    for n, dt in ((1_000_003, torch.float64), (1024, torch.float32), (7, torch.int64)):
        x = (torch.randn(n, generator=g, dtype=dt) if n > 1024  # small: exact in any order
             else torch.randint(-9, 9, (n,), generator=g).to(dt))
        y = x.clone()
        dist.all_reduce(x, group=lr)
        dist.all_reduce(y)  # the default group: Gloo
        ok = ok and torch.allclose(x, y, rtol=1e-12, atol=1e-12)
        mine = [gr for gr in flight.snapshot()["groups"] if gr["backend"] == "linerate"]
        algos.append(mine[-1]["ops"][-1]["algorithm"])
    return ok, _kinds(lr), lr._ctx._maker is not None, algos


@pytest.mark.timeout(240)
def test_forced_ring_all_reduce_over_shm_links_matches_gloo():
    """LINERATE_ALLREDUCE_ALGO=ring on one host: every all_reduce, small synchronous ones
    included, runs the ring over the shared-memory links and equals Gloo's."""
    res = run_ranks(_flat_ring, 3, timeout=180, env={"LINERATE_ALLREDUCE_ALGO": "ring"})
    for ok, kinds, tcp, algos in res:
        assert ok and kinds == ["shm"] and not tcp, res
        assert algos == ["ring"] * 3, algos


def _killed_in_recv(rank, P, lr, out):
    name = lr._ctx.shm.name
    with open(os.path.join(out, "name"), "w") as f:
        f.write(name)
    x = torch.ones(1000)
    dist.all_reduce(x, group=lr)
    if rank == 1:
        # Longer than the progress thread's idle sleep (shmlink.IDLE_S): the exit is seen by
        # the death watch (a pidfd turning readable), not by a periodic look.
        time.sleep(1.3)
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    got = torch.empty(1000)
    try:
        dist.recv(got, 1, group=lr, tag=5)
    except Exception as e:  # noqa: BLE001 - what it raises is the subject
        with open(os.path.join(out, f"error-{rank}"), "w") as f:
            json.dump({"at": time.time(), "error": str(e)}, f)
        raise
    return "completed"


@pytest.mark.timeout(120)
def test_killed_peer_fails_waiting_recv_naming_it_fast(tmp_path):
    with pytest.raises(RankError, match="rank 1"):
        run_ranks(_killed_in_recv, 2, str(tmp_path), timeout=60, error_grace=20)
    killed = float((tmp_path / "killed").read_text())
    rep = json.loads((tmp_path / "error-0").read_text())
    delay = rep["at"] - killed
    print(f"rank 0 noticed after {delay:.3f}s: {rep['error'][:300]}")
    assert re.search(r"\brank 1\b", rep["error"]), rep
    assert 0 <= delay < 0.5, f"noticed {delay:.3f}s after the kill"
    name = (tmp_path / "name").read_text()  # the group's only segment
    assert not os.path.exists(f"/dev/shm/{name}")


def _lifecycle(rank, P, lr):
    names = [lr._ctx.shm.name]
    t = torch.arange(100_000, dtype=torch.float32)
    dist.all_reduce(torch.ones(1), group=lr)  # the progress thread serves lr's links already
    firsts = []
    for _ in range(20):
        g = dist.new_group(backend="linerate")
        names.append(g._ctx.shm.name)
        t0 = time.monotonic()
        if rank == 0:
            dist.send(t, 1, group=g)
        else:
            got = torch.empty_like(t)
            dist.recv(got, 0, group=g)
            assert torch.equal(got, t)
        firsts.append(time.monotonic() - t0)
        dist.destroy_process_group(g)
        del g
    gc.collect()
    with open("/proc/self/maps") as f:
        mapped = sum(1 for line in f if "/linerate-" in line)
    return names, mapped, [n for n in names if os.path.exists(f"/dev/shm/{n}")], sorted(firsts)[10]


@pytest.mark.timeout(180)
def test_nothing_left_in_dev_shm_after_groups_and_exit():
    res = run_ranks(_lifecycle, 2, timeout=150)
    for names, mapped, present, first in res:
        assert not present, present
        assert mapped <= 2, mapped  # the default group's segment (and at most one more)
        # A new group's first message is served at once, not at the progress thread's next
        # timeout (it sleeps up to shmlink.IDLE_S, 1 s: a new port rings the engine's word).
        assert first < 0.25, f"median first send/recv of a new group took {first:.3f}s"
    for n in res[0][0]:
        assert not os.path.exists(f"/dev/shm/{n}")


def _shm_threads() -> dict:
    return {t.name: t.ident for t in threading.enumerate() if t.name.startswith("linerate-shm")}


def _send_one(rank, g, n=70_000):
    t = torch.arange(n, dtype=torch.float32)
    if rank == 0:
        dist.send(t, 1, group=g)
        return True
    got = torch.empty_like(t)
    dist.recv(got, 0, group=g)
    return torch.equal(got, t)


def _linger(rank, P, lr):
    from linerate.transport.shm import ring as shmlink
    out = {"ok": [_send_one(rank, lr)]}
    first = _shm_threads()
    dist.destroy_process_group(lr)
    # The last group that used shared memory is gone: its threads stay, idle, and the next
    # group of the process is served by the same ones (no Thread.start in its creation).
    out["after_destroy"] = _shm_threads() == first and shmlink.progress_threads() == len(first)
    g = dist.new_group(backend="linerate")
    out["ok"].append(_send_one(rank, g))
    out["same_threads"] = _shm_threads() == first
    # A forked child does not take the parent's lingering threads for its own.
    pid = os.fork()
    if pid == 0:
        code = 0 if shmlink.progress_threads() == 0 and not shmlink._ENGINE._ports else 1
        os._exit(code)
    out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    shmlink.LINGER_S = 0.3
    dist.destroy_process_group(g)
    end = time.monotonic() + 5.0
    while (_shm_threads() or shmlink.progress_threads()) and time.monotonic() < end:
        time.sleep(0.05)
    out["ended"] = (not _shm_threads(), shmlink.progress_threads())
    # And they start again for the next group.
    g = dist.new_group(backend="linerate")
    out["ok"].append(_send_one(rank, g, 3_000_001))  # more than a pair's ring: the thread works
    out["restarted"] = bool(_shm_threads())
    dist.destroy_process_group(g)
    return out


@pytest.mark.timeout(120)
def test_progress_threads_linger_after_the_last_group_then_end():
    """The progress thread and the death watch outlive the process's last shared-memory group
    by shmlink.LINGER_S, idle: the next group reuses them; then they end, and start again
    with the next group; a forked child starts with none."""
    for out in run_ranks(_linger, 2, timeout=90):
        assert all(out["ok"]), out
        assert out["after_destroy"] and out["same_threads"], out
        assert out["child"] == 0, out
        assert out["ended"] == (True, 0), out
        assert out["restarted"], out


def _idle_recv(rank, P, lr):
    x = torch.ones(10)
    dist.all_reduce(x, group=lr)  # both up
    if rank == 1:
        time.sleep(1.0)
        dist.send(torch.arange(1000.0), 0, group=lr)
        return None
    got = torch.empty(1000)
    c0, t0 = time.process_time(), time.monotonic()
    dist.recv(got, 1, group=lr)
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    threads = [t.name for t in threading.enumerate()]
    return cpu, wall, torch.equal(got, torch.arange(1000.0)), threads


@pytest.mark.timeout(120)
def test_blocked_recv_burns_no_cpu():
    res = run_ranks(_idle_recv, 2, timeout=90)
    cpu, wall, ok, threads = res[0]
    print(f"waited {wall:.2f}s using {cpu:.3f}s of CPU; threads: {threads}")
    assert ok and wall > 0.8
    assert cpu < 0.1 * wall, f"{cpu:.3f}s of CPU in a {wall:.2f}s wait"
    # The progress thread, and the death watch that sleeps on the peers' pidfds (where the
    # kernel has them): per process, not per link or group.
    shm_threads = sorted(t for t in threads if t.startswith("linerate-shm"))
    assert shm_threads in (["linerate-shm-deaths", "linerate-shm-progress"],
                           ["linerate-shm-progress"]), threads


# ----------------------------------------------------------------------------- mixed groups
@pytest.mark.timeout(90)
@pytest.mark.parametrize("net", ["tcp", "rdma-fake"])
def test_mixed_kinds_in_one_group_in_process(net, monkeypatch):
    """3 Contexts in this process, rank 2 on "another host" (its host id patched): ranks 0
    and 1 link over shared memory, each of them to rank 2 over TCP (lazy) or RDMA (the fake
    pyverbs); messages every way, byte-exact; the kinds per peer as chosen."""
    from datetime import timedelta

    from linerate.transport import CHANNEL_P2P, Context, TransportOptions, shm, verbs
    from _harness import use_transport
    use_transport(net, monkeypatch)
    monkeypatch.setattr(shm, "host_id", lambda: "B" if threading.current_thread().name == "r2" else "A")
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    opts = TransportOptions(socket_ifname="lo", connect_timeout=20.0,
                            transport="tcp" if net == "tcp" else "rdma")
    ctxs, errors = [None] * 3, []

    def build(r):
        try:
            ctxs[r] = Context(store, r, 3, opts)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,), name=f"r{r}") for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    try:
        assert not errors and all(ctxs), errors
        n = 3_000_017  # larger than a ring
        reqs, want = [], []
        for a in range(3):
            for b in range(3):
                if a != b:
                    got = bytearray(n)
                    reqs.append(ctxs[b].irecv(a, memoryview(got), CHANNEL_P2P, 5))
                    want.append((got, bytes([a * 3 + b]) * n))
        for a in range(3):
            for b in range(3):
                if a != b:
                    reqs.append(ctxs[a].isend(b, memoryview(bytes([a * 3 + b]) * n), CHANNEL_P2P, 5))
        for r in reqs:
            r.wait(30)
        assert all(bytes(g) == w for g, w in want)
        net_kind = "tcp" if net == "tcp" else "rdma"
        for r, ctx in enumerate(ctxs):
            kinds = {p["peer"]: [link["kind"] for link in p["links"]] for p in ctx.stats()["peers"]}
            local = {0: [1], 1: [0], 2: []}[r]
            assert kinds == {q: ["shm"] if q in local else [net_kind] for q in range(3) if q != r}, \
                (r, kinds)
    finally:
        for ctx in ctxs:
            if ctx is not None:
                ctx.close(timeout=5)
        if net != "tcp":
            verbs.reset()


MIXED_SCRIPT = r'''
import json, os
import torch
import torch.distributed as dist
import linerate

dist.init_process_group("linerate")
rank, P = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
pg = dist.group.WORLD._get_backend(torch.device("cpu"))
lw = int(os.environ["LOCAL_WORLD_SIZE"])
fails = []
# every pair, both ways, at once: 0, odd and ring-exceeding sizes
reqs, want = [], []
for q in range(P):
    if q == rank:
        continue
    for n in (0, 3, 70_001, 3_000_001):
        got = torch.empty(n, dtype=torch.float64)
        reqs.append(dist.irecv(got, q, tag=n))
        want.append((q, n, got, torch.arange(n, dtype=torch.float64) * (q + 1) + n))
for q in range(P):
    if q != rank:
        for n in (3_000_001, 70_001, 3, 0):
            reqs.append(dist.isend(torch.arange(n, dtype=torch.float64) * (rank + 1) + n, q, tag=n))
for r in reqs:
    r.wait()
for q, n, got, w in want:
    if not torch.equal(got, w):
        fails.append(f"rank {rank}: message of {n} from rank {q} differs")
# the group's choice, and a group whose all_reduce is a flat ring over both kinds of link
ring = dist.new_group(backend="linerate", pg_options=linerate.Options(allreduce_algo="ring"))
for g, name in ((None, "auto"), (ring, "ring")):
    for n in (7, 70_001, 1_000_003):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=g)
        dist.all_reduce(b, group=gloo)
        if not torch.allclose(a, b, rtol=1e-12, atol=1e-12):
            fails.append(f"rank {rank}: {name} all_reduce of {n} differs from Gloo")
ring_algos = sorted({r.algorithm for r in linerate.backend_of(ring)._flight.ring
                     if r.op == "all_reduce"})
kinds = {p["peer"]: [l["kind"] for l in p["links"]] for p in pg._ctx.stats()["peers"]}
print("MX", rank, json.dumps({"fails": fails, "kinds": kinds, "lw": lw, "ring": ring_algos}),
      flush=True)
dist.destroy_process_group()
'''


@pytest.mark.netlab
@pytest.mark.timeout(150)
@pytest.mark.parametrize("connect", ["lazy", "eager"])
def test_mixed_links_p2p_and_all_reduce(connect, lab_name, tmp_path):
    """netlab 2 hosts x 2 ranks: the co-located peer over shared memory, the others over
    TCP, in one group; p2p every way byte-exact; all_reduce (the group's choice, and a flat
    ring over both kinds of link in a second group) equals Gloo's; lazy and eager TCP links."""
    env = {"OMP_NUM_THREADS": "1", "LINERATE_CONNECT": connect}
    res, out = run_netlab_script(
        lab_name, tmp_path, MIXED_SCRIPT,
        ["--hosts", "2", "--rate", "none", "--ranks-per-host", "2,2"], "MX", env=env)
    assert res.returncode == 0 and sorted(out) == [0, 1, 2, 3], res.stdout[-4000:] + res.stderr[-4000:]
    for rank, o in out.items():
        assert not o["fails"], o["fails"]
        assert o["ring"] == ["ring"], o["ring"]
        host = rank // 2
        want = {str(q): ["shm"] if q // 2 == host else ["tcp"] for q in range(4) if q != rank}
        # lazy TCP: a remote peer's link exists once used (every pair was used above)
        assert o["kinds"] == want, (rank, o["kinds"])
