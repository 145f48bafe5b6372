"""Bad input gets a clear ValueError/RuntimeError before anything is sent, naming the rank, the
op and what is wrong (dtype, shape, root, peer, tag); the group stays usable afterwards."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness import run_ranks

_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _cases(world):
    f = torch.ones(10)
    return {
        "band_on_float": (lambda g: dist.all_reduce(f.clone(), op=dist.ReduceOp.BAND, group=g),
                          ["BAND", "float32"]),
        "all_gather_output_size": (lambda g: _ag(torch.empty(10 * world + 1), f, group=g),
                                   ["elements", "all_gather"]),
        "reduce_scatter_input_size": (lambda g: _rs(torch.empty(10), torch.ones(10 * world - 1),
                                                    group=g), ["reduce_scatter", "elements"]),
        "all_gather_list_dtype": (lambda g: dist.all_gather(
            [torch.empty(10, dtype=torch.float64) for _ in range(world)], f, group=g),
            ["dtype", "float64"]),
        "all_to_all_mixed_dtypes": (lambda g: dist.all_to_all(
            [torch.empty(2) for _ in range(world)],
            [torch.ones(2, dtype=torch.float64)] + [torch.ones(2)] * (world - 1), group=g),
            ["dtype"]),
        "sparse": (lambda g: dist.all_reduce(torch.ones(4).to_sparse(), group=g), ["sparse"]),
        "not_a_tensor_list": (lambda g: g._get_backend(torch.device("cpu")).allreduce([3]),
                              ["tensor"]),
        "send_bad_tag": (lambda g: g._get_backend(torch.device("cpu")).send(
            [f], (dist.get_rank() + 1) % world, -5), ["tag"]),
        "send_bad_peer": (lambda g: g._get_backend(torch.device("cpu")).send([f], world + 3, 0),
                          [f"{world + 3}"]),
        "broadcast_bad_root": (lambda g: g._get_backend(torch.device("cpu")).broadcast(
            [f], _opts(dist.BroadcastOptions(), rootRank=world + 1)), ["root", f"{world + 1}"]),
    }


_TORCH_CHECKS = {"all_gather_list_dtype", "all_to_all_mixed_dtypes"}


def _opts(o, **kw):
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _run_bad(rank, world, lr):
    out = {}
    for name, (call, needles) in _cases(world).items():
        try:
            call(lr)
        except (ValueError, RuntimeError, TypeError) as e:
            msg = str(e)
            missing = [n for n in needles if n not in msg]
            out[name] = (type(e).__name__, msg, missing)
        else:
            out[name] = (None, "no error", [])
    # Nothing was sent: the group still works, sequence numbers still agree.
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=lr)
    return out, t.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_before_sending(world):
    results = run_ranks(_run_bad, world, timeout=100)
    for rank, (out, t) in enumerate(results):
        assert t == [float(sum(range(world)))] * 5
        for name, (etype, msg, missing) in out.items():
            assert etype is not None, f"rank {rank}: {name} raised nothing"
            assert not missing, f"rank {rank}: {name}: {msg!r} does not mention {missing}"
            # torch validates some calls itself before they reach a backend (as with Gloo)
            assert "linerate" in msg or f"rank {rank}" in msg or name in _TORCH_CHECKS, \
                f"rank {rank}: {name}: {msg!r} does not name the rank"


def _one_rank_bad(rank, world, lr):
    import time
    t0 = time.monotonic()
    try:
        if rank == 0:  # only the root's input list is wrong: it raises before sending...
            with pytest.raises(ValueError, match="scatter"):
                dist.scatter(torch.empty(10), [torch.ones(10)] * (world + 1), src=0, group=lr)
            dist.all_reduce(torch.ones(3), group=lr)  # ...and goes on to its next op
        else:
            dist.scatter(torch.empty(10), None, src=0, group=lr)
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - t0
    return "completed", time.monotonic() - t0


@pytest.mark.timeout(60)
def test_one_rank_rejects_its_call_the_others_fail_fast():
    """The rank with the bad call raises locally; the others, already in the collective, get
    a mismatch error (naming both calls) as soon as that rank's next op arrives: no hang."""
    for rank, (msg, secs) in enumerate(run_ranks(_one_rank_bad, 3, timeout=50)):
        assert "different collectives" in msg and "scatter" in msg and "#1" in msg, (rank, msg)
        assert secs < 10, (rank, secs)


def _differing_settings(rank, world, lr, env_name, values):
    """A linerate group whose ranks disagree on a setting: (seconds, error text) per rank."""
    import os
    import time
    os.environ[env_name] = values[rank]
    t0 = time.monotonic()
    try:
        g = dist.new_group(backend="linerate")
        dist.barrier(group=g)
        return time.monotonic() - t0, None
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"


@pytest.mark.timeout(120)
def test_ranks_with_different_settings_all_fail_fast():
    """Rank 2 of 4 sets LINERATE_CHECKSUM=1: it fails at once naming the setting, and the
    other ranks fail within seconds with its message (not after LINERATE_CONNECT_TIMEOUT,
    60 s here, nor after the store's timeout while waiting for rank 2's address)."""
    res = run_ranks(_differing_settings, 4, "LINERATE_CHECKSUM", ["0", "0", "1", "0"],
                    timeout=100, env={"LINERATE_CONNECT_TIMEOUT": "60"})
    for rank, (took, err) in enumerate(res):
        assert err is not None, f"rank {rank} built the group"
        assert "LINERATE_CHECKSUM is 1 here but 0 on rank 0" in err, (rank, err)
        assert "rank 2" in err and took < 20, (rank, took, err)
        if rank != 2:
            assert "another rank failed" in err, (rank, err)
