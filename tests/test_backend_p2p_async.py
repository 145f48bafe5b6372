"""Point-to-point, asynchronous Work objects and subgroups of the ``linerate`` process group.

Each test spawns its ranks (tests/_harness.py): Gloo is the default group, ``lr`` a linerate
group of the same ranks. Where Gloo's behaviour is the specification (recv from any source,
what a Work's future holds, subgroups), the same steps run on both and are compared.
"""
from __future__ import annotations

import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _harness import run_ranks

T = 60  # harness timeout per test (seconds)


def _payload(tag: int, n: int, src: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) % 101) + 1000 * tag + 100_000 * src


def _both(lr):
    """(name, group) for Gloo (the default group) and linerate."""
    return (("gloo", None), ("linerate", lr))


# ----------------------------------------------------------------------------- tags
def _tags_fn(rank, P, lr):
    """Rank 0 sends messages with tags 1..4 in that order (sizes 1, 300k floats = 1.2 MB, 0, 7);
    rank 1 receives them in the opposite order: each receive must get its tag's message. Then
    three messages on one tag must arrive in order."""
    sizes = {1: 1, 2: 300_000, 3: 0, 4: 7}
    out = {}
    for name, g in _both(lr):
        if rank == 0:
            works = [dist.isend(_payload(tag, n, 0), 1, group=g, tag=tag) for tag, n in sizes.items()]
            for w in works:
                w.wait()
            for k in range(3):
                dist.send(_payload(9, 5, k), 1, group=g, tag=9)
        else:
            got = {}
            for tag in sorted(sizes, reverse=True):
                t = torch.full((sizes[tag],), -1.0)
                dist.recv(t, 0, group=g, tag=tag)
                got[tag] = t
            for tag, n in sizes.items():
                assert torch.equal(got[tag], _payload(tag, n, 0)), f"{name}: tag {tag} got the wrong message"
            for k in range(3):
                t = torch.empty(5)
                dist.recv(t, 0, group=g, tag=9)
                assert torch.equal(t, _payload(9, 5, k)), f"{name}: same-tag message {k} out of order"
            out[name] = True
        dist.barrier()
    return out


@pytest.mark.timeout(T + 30)
def test_send_recv_tags_matched_by_tag():
    res = run_ranks(_tags_fn, 2, timeout=T)
    assert res[1] == {"gloo": True, "linerate": True}


# ----------------------------------------------------------------------------- any source
def _anysource_fn(rank, P, lr):
    """Ranks 1..P-1 send to rank 0; rank 0 receives with src=None (blocking recv returns the
    sender's rank; an irecv's Work names it too). Compared with Gloo."""
    out = {}
    for name, g in _both(lr):
        if rank == 0:
            senders = []
            for _ in range(P - 1):
                t = torch.empty(4)
                src = dist.recv(t, src=None, group=g, tag=3)
                assert torch.equal(t, _payload(3, 4, src)), f"{name}: data does not come from rank {src}"
                senders.append(src)
            # irecv from any source
            works, bufs = [], []
            for _ in range(P - 1):
                t = torch.empty(4)
                works.append(dist.irecv(t, src=None, group=g, tag=4))
                bufs.append(t)
            srcs2 = []
            for w, t in zip(works, bufs):
                w.wait()
                s = w._source_rank()
                srcs2.append(s)
                assert torch.equal(t, _payload(4, 4, s)), f"{name}: irecv data does not come from rank {s}"
            out[name] = (sorted(senders), sorted(srcs2))
        else:
            dist.send(_payload(3, 4, rank), 0, group=g, tag=3)
            dist.send(_payload(4, 4, rank), 0, group=g, tag=4)
        dist.barrier()
    return out


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_recv_any_source(P):
    res = run_ranks(_anysource_fn, P, timeout=T)
    want = (list(range(1, P)), list(range(1, P)))
    assert res[0]["gloo"] == want
    assert res[0]["linerate"] == want


# ----------------------------------------------------------------------------- isend / irecv
def _isend_irecv_fn(rank, P, lr):
    """Every pair exchanges with isend/irecv; sizes 0 .. 2M floats (8 MB, many chunks)."""
    for n in (0, 1, 1001, 2_000_000):
        works, bufs = [], {}
        for peer in range(P):
            if peer == rank:
                continue
            bufs[peer] = torch.full((n,), -1.0)
            works.append(dist.irecv(bufs[peer], peer, group=lr, tag=n % 7))
            works.append(dist.isend(_payload(1, n, rank), peer, group=lr, tag=n % 7))
        for w in works:
            w.wait()
        for peer, t in bufs.items():
            assert torch.equal(t, _payload(1, n, peer)), f"n={n}: wrong data from rank {peer}"
    return True


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_isend_irecv(P):
    assert all(run_ranks(_isend_irecv_fn, P, timeout=T))


def _irecv_first_fn(rank, P, lr):
    """Both ranks post irecv before isend (each blocks on neither): must not deadlock, also with
    a message larger than the kernel's socket buffers and when the receive waits first."""
    peer = 1 - rank
    for n in (3, 4_000_000):
        t = torch.full((n,), -1.0)
        r = dist.irecv(t, peer, group=lr)
        s = dist.isend(_payload(2, n, rank), peer, group=lr)
        r.wait()
        s.wait()
        assert torch.equal(t, _payload(2, n, peer))
    # a recv that is waited on before the send is even posted on this rank
    t = torch.empty(10)
    r = dist.irecv(t, peer, group=lr, tag=11)
    if rank == 0:
        r.wait()
        dist.send(_payload(11, 10, rank), peer, group=lr, tag=11)
    else:
        dist.send(_payload(11, 10, rank), peer, group=lr, tag=11)
        r.wait()
    assert torch.equal(t, _payload(11, 10, peer))
    # non-contiguous send and receive buffers (Gloo refuses these; linerate stages them)
    src = _payload(12, 12, rank).reshape(3, 4).t()
    base = torch.zeros(4, 6)
    r = dist.irecv(base[:, ::2], peer, group=lr, tag=12)
    dist.isend(src, peer, group=lr, tag=12).wait()
    r.wait()
    want = torch.zeros(4, 6)
    want[:, ::2] = _payload(12, 12, peer).reshape(3, 4).t()
    assert torch.equal(base, want), "non-contiguous send/recv"
    return True


@pytest.mark.timeout(T + 30)
def test_irecv_before_isend_on_both_ranks():
    assert all(run_ranks(_irecv_first_fn, 2, timeout=T))


def _batch_fn(rank, P, lr):
    """batch_isend_irecv: a ring exchange (send right, receive from left), both backends."""
    out = {}
    right, left = (rank + 1) % P, (rank - 1) % P
    for name, g in _both(lr):
        for n in (5, 300_000):
            send = _payload(5, n, rank)
            recv = torch.full((n,), -1.0)
            ops = [dist.P2POp(dist.isend, send, right, group=g),
                   dist.P2POp(dist.irecv, recv, left, group=g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            assert torch.equal(recv, _payload(5, n, left)), f"{name} n={n}: wrong data"
        out[name] = True
    return out


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_batch_isend_irecv_ring(P):
    for r in run_ranks(_batch_fn, P, timeout=T):
        assert r == {"gloo": True, "linerate": True}


# ----------------------------------------------------------------------------- Work objects
def _work_fn(rank, P, lr):
    """async_op=True: wait(), wait(timeout=timedelta), is_completed(), exception() None,
    get_future().wait() whose value is the list of output tensors (as Gloo's)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    checks = []

    def check(cond, what):
        checks.append(what)
        assert cond, what

    for name, g in _both(lr):
        x = torch.arange(6, dtype=torch.float32) + rank
        w = dist.all_reduce(x, group=g, async_op=True)
        check(w.wait() in (True, None), f"{name}: wait() returns")
        check(w.is_completed(), f"{name}: is_completed after wait")
        check(w.exception() is None if name == "linerate" else True, f"{name}: exception() None")
        val = w.get_future().wait()
        check(isinstance(val, list) and len(val) == 1, f"{name}: future value is a list of one tensor")
        check(torch.equal(val[0], x), f"{name}: future value is the output")
        want = sum(torch.arange(6, dtype=torch.float32) + r for r in range(P))
        check(torch.equal(x, want), f"{name}: all_reduce result")
        # wait(timeout=...)
        y = torch.ones(1000) * rank
        w = dist.all_reduce(y, group=g, async_op=True)
        w.wait(timeout=timedelta(seconds=30))
        check(w.is_completed(), f"{name}: completed after wait(timeout)")
        check(torch.equal(y, torch.full((1000,), float(sum(range(P))))), f"{name}: wait(timeout) result")
        # the future alone (no wait): then() sees the result
        z = torch.ones(3) * (rank + 1)
        w = dist.all_reduce(z, group=g, async_op=True)
        fut = w.get_future().then(lambda f: f.value()[0] * 2)
        check(torch.equal(fut.wait(), torch.full((3,), 2.0 * sum(range(1, P + 1)))), f"{name}: future.then")
        # broadcast and all_gather futures
        b = torch.arange(4.0) if rank == 0 else torch.zeros(4)
        w = dist.broadcast(b, 0, group=g, async_op=True)
        val = w.get_future().wait()
        check(torch.equal(val[0], torch.arange(4.0)), f"{name}: broadcast future value")
        outs = [torch.zeros(2) for _ in range(P)]
        w = dist.all_gather(outs, torch.full((2,), float(rank)), group=g, async_op=True)
        w.wait()
        check(all(torch.equal(o, torch.full((2,), float(i))) for i, o in enumerate(outs)),
              f"{name}: all_gather async result")
        # point-to-point Works
        if P > 1:
            peer = 1 - rank if rank < 2 else None
            if peer is not None:
                t = torch.zeros(5)
                rw = dist.irecv(t, peer, group=g)
                sw = dist.isend(torch.full((5,), float(rank)), peer, group=g)
                sw.wait(timeout=timedelta(seconds=30))
                rw.wait(timeout=timedelta(seconds=30))
                check(rw.is_completed() and sw.is_completed(), f"{name}: p2p works completed")
                check(torch.equal(t, torch.full((5,), float(peer))), f"{name}: irecv data")
        dist.barrier()
    # linerate's Work: the future's value is the very output tensor (no copy)
    x = torch.ones(8)
    w = dist.all_reduce(x, group=lr, async_op=True)
    check(w.get_future().wait()[0].data_ptr() == x.data_ptr(), "linerate: future holds the output tensor")
    return checks


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_async_work(P):
    res = run_ranks(_work_fn, P, timeout=T)
    assert all(len(r) > 5 for r in res)


def _wait_timeout_fn(rank, P, lr):
    """Work.wait(timeout=200 ms) on a recv nobody has sent raises; the receive stays posted and
    completes when the message comes. Then a collective whose peer is late: the first wait times
    out, a second one returns the right result."""
    if rank == 1:
        t = torch.full((6,), -1.0)
        w = dist.irecv(t, 0, group=lr, tag=77)
        t0 = time.monotonic()
        raised = None
        try:
            w.wait(timeout=timedelta(milliseconds=200))
        except Exception as e:  # noqa: BLE001 - what it raises is checked below
            raised = e
        waited = time.monotonic() - t0
        assert raised is not None, "wait(timeout=200ms) on an unmatched recv returned"
        assert 0.15 < waited < 5.0, f"wait(timeout=200ms) took {waited:.3f}s"
        assert not w.is_completed()
        dist.barrier()  # (Gloo) now rank 0 sends
        w.wait(timeout=timedelta(seconds=30))
        assert torch.equal(t, _payload(77, 6, 0))
        assert w.exception() is None
        err = f"{type(raised).__name__}: {raised}"
    else:
        dist.barrier()
        dist.send(_payload(77, 6, 0), 1, group=lr, tag=77)
        err = None
    # a collective: rank 0 is late
    x = torch.full((4,), float(rank + 1))
    if rank == 0:
        time.sleep(1.0)
        dist.all_reduce(x, group=lr)
    else:
        w = dist.all_reduce(x, group=lr, async_op=True)
        with pytest.raises(Exception):
            w.wait(timeout=timedelta(milliseconds=200))
        w.wait()
    assert torch.equal(x, torch.full((4,), float(sum(range(1, P + 1)))))
    dist.barrier(group=lr)
    return err


@pytest.mark.timeout(T + 30)
def test_work_wait_timeout_then_complete():
    res = run_ranks(_wait_timeout_fn, 2, timeout=T)
    assert res[1] is not None and ("timeout" in res[1].lower() or "0.200" in res[1]), res[1]


# ----------------------------------------------------------------------------- subgroups
def _subgroups_fn(rank, P, lr):
    """Linerate subgroups vs Gloo subgroups of the same ranks, including two overlapping groups
    used alternately, rooted ops with a global root rank, and p2p inside a subgroup."""
    specs = [[0, 1], [1, 2, 3], [0, 1, 2], [3, 0]]  # [3, 0]: group rank order follows sorting
    lgroups = [dist.new_group(ranks=s, backend="linerate") for s in specs]
    ggroups = [dist.new_group(ranks=s, backend="gloo") for s in specs]
    A, B = 1, 2  # [1, 2, 3] and [0, 1, 2]: overlapping in ranks 1 and 2
    done = []
    for it in range(6):
        for k in (A, B, 0, 3):
            ranks = sorted(specs[k])
            if rank not in ranks:
                continue
            x = (torch.arange(1000, dtype=torch.float64) + 10 * rank + it) if it % 2 else \
                (torch.arange(30_000, dtype=torch.float64) % 7 + rank)  # > 64 KiB: ring/chain
            want, got = x.clone(), x.clone()
            dist.all_reduce(want, group=ggroups[k])
            dist.all_reduce(got, group=lgroups[k])
            assert torch.equal(got, want), f"all_reduce on {specs[k]} iteration {it}"
            root = ranks[it % len(ranks)]  # a global rank
            want, got = x.clone(), x.clone()
            dist.broadcast(want, root, group=ggroups[k])
            dist.broadcast(got, root, group=lgroups[k])
            assert torch.equal(got, want), f"broadcast on {specs[k]} root {root} iteration {it}"
            want, got = x.clone(), x.clone()
            dist.reduce(want, root, group=ggroups[k])
            dist.reduce(got, root, group=lgroups[k])
            if rank == root:
                assert torch.equal(got, want), f"reduce on {specs[k]} root {root} iteration {it}"
            outs_w = [torch.zeros_like(x) for _ in ranks]
            outs_g = [torch.zeros_like(x) for _ in ranks]
            dist.all_gather(outs_w, x, group=ggroups[k])
            dist.all_gather(outs_g, x, group=lgroups[k])
            assert all(torch.equal(a, b) for a, b in zip(outs_g, outs_w)), f"all_gather on {specs[k]}"
            done.append((it, k))
    # p2p in [1, 2, 3]: global rank 3 sends to global rank 1 (group ranks 2 -> 0)
    g = lgroups[A]
    if rank == 3:
        dist.send(_payload(8, 9, 3), 1, group=g, tag=8)
        dist.send(_payload(9, 9, 3), 1, group=g, tag=9)
    elif rank == 1:
        t = torch.empty(9)
        dist.recv(t, 3, group=g, tag=8)
        assert torch.equal(t, _payload(8, 9, 3))
        src = dist.recv(t, src=None, group=g, tag=9)
        assert src == 3, f"recv(src=None) in a subgroup returned {src}, not the global rank 3"
        assert torch.equal(t, _payload(9, 9, 3))
    # the full linerate group still works after all this
    y = torch.ones(3)
    dist.all_reduce(y, group=lr)
    assert torch.equal(y, torch.full((3,), float(P)))
    return len(done)


@pytest.mark.timeout(T + 30)
def test_subgroups_overlapping():
    res = run_ranks(_subgroups_fn, 4, timeout=T)
    assert all(n > 0 for n in res)
