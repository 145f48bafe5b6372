"""The spawn harness itself (tests/_harness.py): results, errors, timeouts, no leftovers."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from _harness import RankError, RankTimeout, run_ranks


def _pid_file(d, rank):
    return os.path.join(d, f"pid-{rank}")


def _note_pid(d, rank):
    with open(_pid_file(d, rank), "w") as f:
        f.write(str(os.getpid()))


def _assert_gone(d, P):
    for r in range(P):
        pid = int(open(_pid_file(d, r)).read())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _ok_fn(rank, P, lr, d):
    _note_pid(d, rank)
    t = torch.ones(3) * rank
    dist.all_reduce(t, group=lr)
    return {"rank": rank, "sum": t, "env": os.environ.get("LR_HARNESS_TEST"),
            "default": dist.get_backend(), "lr": dist.get_backend(lr)}


@pytest.mark.timeout(60)
def test_results_env_and_groups(tmp_path):
    res = run_ranks(_ok_fn, 3, str(tmp_path), timeout=40, env={"LR_HARNESS_TEST": "x"})
    assert [r["rank"] for r in res] == [0, 1, 2]
    for r in res:
        assert torch.equal(r["sum"], torch.full((3,), 3.0))
        assert r["env"] == "x" and r["default"] == "gloo" and r["lr"] == "linerate"
    _assert_gone(tmp_path, 3)


def _fail_fn(rank, P, lr, d):
    _note_pid(d, rank)
    if rank == 1:
        raise ValueError("boom from the test")
    dist.barrier(group=lr)  # never completes: rank 1 is gone


@pytest.mark.timeout(60)
def test_rank_exception_is_reraised_and_others_killed(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as ei:
        run_ranks(_fail_fn, 2, str(tmp_path), timeout=40, error_grace=1.0)
    msg = str(ei.value)
    assert msg.startswith("rank 1 of 2 failed first") and "ValueError: boom from the test" in msg
    # rank 0 either reported the peer's failure itself or was killed
    assert "rank 0 failed" in msg or "still running when they were killed: [0]" in msg
    assert time.monotonic() - t0 < 30
    _assert_gone(tmp_path, 2)


def _hang_fn(rank, P, lr, d):
    _note_pid(d, rank)
    if rank == 1:
        time.sleep(1000)
    return rank


@pytest.mark.timeout(60)
def test_timeout_names_running_ranks_and_kills_them(tmp_path):
    with pytest.raises(RankTimeout) as ei:
        run_ranks(_hang_fn, 2, str(tmp_path), timeout=8)
    msg = str(ei.value)
    assert "ranks still running: [1]" in msg and "finished: [0]" in msg
    assert "_hang_fn" in msg  # the stack of the hung rank
    _assert_gone(tmp_path, 2)
