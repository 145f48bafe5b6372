"""Ranks that disagree about a collective (dtype, size, reduce op, root, or the collective
itself) get an error on every rank involved, naming rank, op, sequence number and the
mismatch, within seconds and never with mixed data presented as a result."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _harness import run_ranks

TIMEOUT_S = 20.0  # the group's timeout: every error must come well before it


def _disagree(rank, world, lr, case):
    g = dist.new_group(backend="linerate", timeout=timedelta(seconds=TIMEOUT_S))
    n = 1000 if case != "large" else 3_000_001
    odd = rank == world - 1  # the last rank calls differently
    t = torch.arange(n, dtype=torch.float32)
    kwargs = {}
    if case == "dtype":  # same byte count: only the call digest can tell
        t = t.to(torch.int32) if odd else t
    elif case in ("size", "large"):
        t = torch.arange(n + (4 if odd else 0), dtype=torch.float32)
    elif case == "op":
        kwargs["op"] = dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM
    t0 = time.monotonic()
    try:
        if case == "root":
            dist.broadcast(t, src=1 if odd else 0, group=g)
        elif case == "collective":
            if odd:
                dist.broadcast(t, src=0, group=g)
            else:
                dist.all_reduce(t, group=g)
        else:
            dist.all_reduce(t, group=g, **kwargs)
        # A rank that only sends (a broadcast root) may finish; it learns on its next op.
        dist.all_reduce(torch.ones(4), group=g)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "completed", time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,world,needle", [
    ("dtype", 2, "int32"),
    ("op", 3, "MAX"),
    ("size", 3, "[1004]"),
    ("large", 2, "[3000005]"),
    ("root", 3, "root=1"),
    ("collective", 2, "broadcast"),
])
def test_disagreeing_ranks_all_fail_fast(case, world, needle):
    out = run_ranks(_disagree, world, case, timeout=90)
    for rank, (etype, msg, secs) in enumerate(out):
        assert etype is not None, f"rank {rank} completed a mismatched {case}"
        assert secs < TIMEOUT_S / 2, (rank, secs, msg)
        assert "#" in msg and ("all_reduce" in msg or "broadcast" in msg), msg
        if case != "collective":
            # The message shows the odd rank's call, wherever it was detected.
            assert needle in msg or f"rank {world - 1}" in msg, (rank, msg)
    texts = " ".join(m for _, m, _ in out)
    assert needle in texts, texts
