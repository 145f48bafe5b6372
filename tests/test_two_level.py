"""Two-level collectives (collectives/two_level.py) and what they stand on.

- ``Comm.sub``: algorithms (ring, direct, chain, halving) run unchanged on subsets of a group
  within one op, beside the op's own runs, without their messages meeting.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness import run_ranks


# ----------------------------------------------------------------------------- SubComm
def _subcomm(rank, P, lr):
    from linerate.collectives import chain, direct, halving, ring
    from linerate.collectives.backend import _Stage
    from linerate.collectives.reduce_ops import RedOpType
    out = {}

    def fn(comm):
        odd, even = [1, 3], [0, 2]
        mine = comm.sub(odd if rank in odd else even, 1 if rank in odd else 2)
        assert mine.size == 2 and mine.ranks[mine.rank] == rank
        x = torch.arange(10.0) + rank
        (ring if rank in odd else direct).all_reduce(mine, x, RedOpType.SUM)
        out["pair"] = x.tolist()
        # a sub-group of three (tag 3), nested: sub-rank 0 of a view of [3, 1, 2] is rank 3
        if rank != 0:
            trio = comm.sub([3, 1, 2], 3)
            y = torch.full((1001,), float(rank))
            halving.all_reduce(trio, y, RedOpType.MAX)
            z = torch.arange(7.0) if rank == 3 else torch.zeros(7)
            chain.broadcast(trio.sub([1, 2, 0], 1), z, 2)  # root: sub-rank 2 = rank 3
            out["trio"] = (y[0].item(), z.tolist())
        w = torch.full((5,), float(rank))
        ring.all_reduce(comm, w, RedOpType.SUM)  # the op's own run, after the subsets'
        out["all"] = w.tolist()

    lr._submit("all_reduce", fn, [], _Stage(), 30.0, desc="subcomm").wait()
    return out


@pytest.mark.timeout(120)
def test_subcomm_runs_algorithms_on_subsets():
    res = run_ranks(_subcomm, 4, timeout=90, env={"LINERATE_SHM": "0"})
    for rank, r in enumerate(res):
        pair = (1, 3) if rank in (1, 3) else (0, 2)
        assert r["pair"] == [2 * i + sum(pair) for i in range(10)], r
        assert r["all"] == [6.0] * 5
        if rank:
            assert r["trio"] == (3.0, [float(i) for i in range(7)]), r
