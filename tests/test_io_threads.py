"""Threads per rank stay a small constant over TCP with LINERATE_IO=shared: every TCP link of
every group of a process is driven by the process-wide pool of LINERATE_IO_THREADS epoll
threads (transport/ioloop.py), not by a sender and a receiver thread per connection (the
default, threads, has those).

8 ranks without shared memory (LINERATE_SHM=0): a small all_reduce and an all_to_all link
every peer, then 20 two-rank subgroups are created and each used once. Each rank counts its
threads (``threading.active_count()``) and checks the op results.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from _harness import garbage_left, run_ranks

P = 8
SUBGROUPS = 20


def _many_links(rank, size, lr):
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t, group=lr)  # 4 KB: direct, every peer
    assert t[0].item() == size * (size + 1) / 2
    inp = torch.arange(size, dtype=torch.float32) + 100 * rank
    out = torch.empty(size)
    dist.all_to_all_single(out, inp, group=lr)
    assert out.tolist() == [100 * r + rank for r in range(size)]
    after_world = threading.active_count()
    pairs = [(i % size, (i * 3 + 1 + i // size) % size) for i in range(SUBGROUPS * 3)]
    pairs = [tuple(sorted(p)) for p in pairs if p[0] != p[1]]
    pairs = list(dict.fromkeys(pairs))[:SUBGROUPS]
    assert len(pairs) == SUBGROUPS, pairs
    for pair in pairs:  # every rank creates every group (new_group is collective)
        g = dist.new_group(list(pair), backend="linerate")
        if rank in pair:
            x = torch.ones(1000)
            dist.all_reduce(x, group=g)
            assert x[0].item() == 2
    dist.barrier(group=lr)
    names = [t.name for t in threading.enumerate()]
    return {"world": after_world, "all": threading.active_count(),
            "io": sum(n.startswith("linerate-io-") for n in names),
            "per_connection": sum(n.startswith(("linerate-send", "linerate-recv")) for n in names),
            "names": names}


def test_threads_per_rank_bounded():
    """``shared``: no thread per connection at all, a few loop threads for every link of
    every group."""
    env = {"LINERATE_SHM": "0", "LINERATE_IO": "shared"}
    res = run_ranks(_many_links, P, timeout=180, backend="linerate", env=env)
    for rank, r in enumerate(res):
        assert r["per_connection"] == 0, (rank, r["names"])
        assert 1 <= r["io"] <= 2, (rank, r["names"])
        assert r["all"] <= 16, (rank, r["all"], r["names"])


def _destroyed_groups(rank, size, lr):
    """Two-rank TCP groups made, used and destroyed, with the collector off: what they leave
    for it (after two first ones: the process's first links and loops are made once)."""
    def one():
        g = dist.new_group([0, 1], backend="linerate")
        t = torch.ones(1000)
        dist.all_reduce(t, group=g)
        dist.broadcast(t, 1, group=g)
        dist.destroy_process_group(g)
        return t[0].item()

    one()
    one()
    results = []
    out = garbage_left(lambda: results.append(one()), 5)
    out["results"] = results
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("io,connect", [("threads", "lazy"), ("shared", "lazy"),
                                        ("shared", "eager")])
def test_destroyed_tcp_group_leaves_nothing_for_the_garbage_collector(io, connect):
    """A TCP group's links and lazy-link mesh point back at its Context (their sink, the
    callbacks), and a shared-loop connection at its link: before Context.close let go of
    them, each destroyed pair group left 132 objects (30 with LINERATE_IO=shared's links)
    for the collector, its Context and the buffers its matcher kept among them."""
    env = {"LINERATE_SHM": "0", "LINERATE_IO": io, "LINERATE_CONNECT": connect}
    res = run_ranks(_destroyed_groups, 2, timeout=90, env=env)
    for rank, r in enumerate(res):
        assert r["results"] == [2.0] * r["rounds"], (rank, r)
        assert r["garbage"] < r["rounds"], (rank, r)  # nothing per group
