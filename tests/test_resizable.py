"""A tensor that went through a linerate collective stays resizable, as after Gloo.

``Tensor.numpy()`` marks a storage non-resizable for good; torch's ``batched_powerSGD_hook``
(and user code) later calls ``resize_`` on tensors that went through collectives. Every
collective kind, on shared memory and over TCP, small (one round) and large (pipelined):
afterwards every input and output tensor takes ``resize_``. Ranks are threads (the unit tier).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _threads import ones_like_rank, run_threads, sync

pytestmark = pytest.mark.timeout(120)

R = dist.ReduceOp


def _options(shm: bool):
    import linerate
    o = linerate.Options()
    o.transport.shm = "auto" if shm else "0"
    return o


def _every_kind(pg, r: int, P: int, n: int, dt) -> list:
    """Run every collective kind once on fresh tensors; return (name, tensors) pairs."""
    used = []

    def x(q=None, size=n):
        return ones_like_rank((size,), dt, r if q is None else q)

    t = x()
    pg.allreduce([t], sync(reduceOp=R.SUM)).wait()
    used.append(("all_reduce sync", [t]))
    t = x()
    o = dist.AllreduceOptions(); o.reduceOp = R.SUM
    pg.allreduce([t], o).wait()
    used.append(("all_reduce async", [t]))
    ts = [x(), x(size=3)]
    pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
    used.append(("all_reduce_coalesced", ts))
    t = x()
    o = dist.BroadcastOptions(); o.rootRank = P - 1
    pg.broadcast([t], o).wait()
    used.append(("broadcast", [t]))
    t = x()
    o = dist.ReduceOptions(); o.rootRank = 0; o.reduceOp = R.MAX
    pg.reduce([t], o).wait()
    used.append(("reduce", [t]))
    outs, inp = [torch.empty((n,), dtype=dt) for _ in range(P)], x()
    pg.allgather([outs], [inp]).wait()
    used.append(("all_gather", outs + [inp]))
    flat, inp = torch.empty((P * n,), dtype=dt), x()
    pg.all_gather_single(flat, inp).wait()
    used.append(("all_gather_into_tensor", [flat, inp]))
    parts = [x(10 * r + i) for i in range(P)]
    out = torch.empty((n,), dtype=dt)
    o = dist.ReduceScatterOptions(); o.reduceOp = R.SUM
    pg.reduce_scatter([out], [parts], o).wait()
    used.append(("reduce_scatter", [out] + parts))
    inp, out = torch.cat([x(q) for q in range(P)]), torch.empty((n,), dtype=dt)
    pg.reduce_scatter_single(out, inp, o).wait()
    used.append(("reduce_scatter_tensor", [out, inp]))
    inp = torch.cat([x(q) for q in range(P)])
    out = torch.empty_like(inp)
    pg.all_to_all_single(out, inp, [], [], dist.AllToAllOptions()).wait()
    used.append(("all_to_all_single", [out, inp]))
    ins, outs = [x(q) for q in range(P)], [torch.empty((n,), dtype=dt) for _ in range(P)]
    pg.alltoall(outs, ins, dist.AllToAllOptions()).wait()
    used.append(("all_to_all", outs + ins))
    outs, inp = ([torch.empty((n,), dtype=dt) for _ in range(P)] if r == 0 else []), x()
    o = dist.GatherOptions(); o.rootRank = 0
    pg.gather([outs] if r == 0 else [], [inp], o).wait()
    used.append(("gather", outs + [inp]))
    srcs, out = ([x(q) for q in range(P)] if r == 0 else []), torch.empty((n,), dtype=dt)
    o = dist.ScatterOptions(); o.rootRank = 0
    pg.scatter([out], [srcs] if r == 0 else [], o).wait()
    used.append(("scatter", srcs + [out]))
    t = x()
    if r == 0:
        pg.send([t], 1, 7).wait()
    elif r == 1:
        pg.recv([t], 0, 7).wait()
    used.append(("send/recv", [t]))
    pg.barrier(dist.BarrierOptions()).wait()
    return used


def _resize_all(used) -> list:
    """resize_ every tensor to twice its elements and back; the names of those refused."""
    bad = []
    for name, ts in used:
        for t in ts:
            n = t.numel()
            try:
                t.resize_(2 * n + 1)
                t.resize_(n)
            except RuntimeError as e:
                bad.append(f"{name}: {e}")
                break
    return bad


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("n", [5, 70001], ids=["small", "large"])
def test_every_collective_leaves_its_tensors_resizable(shm, n):
    P = 3

    def fn(pg, gloo, r):
        bad = _resize_all(_every_kind(pg, r, P, n, torch.float32))
        # Gloo, for reference, on the same kind of call
        t = ones_like_rank((n,), torch.float32, r)
        gloo.allreduce([t]).wait()
        t.resize_(2 * n)
        return bad

    res = run_threads(fn, P, gloo_groups=True, options=_options(shm), timeout=100)
    assert res == [[]] * P, res


@pytest.mark.parametrize("dt", [torch.float64, torch.int32, torch.float16, torch.bfloat16,
                                torch.bool, torch.complex64])
def test_reductions_of_every_dtype_leave_tensors_resizable(dt):
    def fn(pg, r):
        used = []
        for n in (5, 70001):
            t = ones_like_rank((n,), dt, r)
            op = R.MAX if dt == torch.bool else R.SUM
            pg.allreduce([t], sync(reduceOp=op)).wait()
            used.append((f"all_reduce n={n}", [t]))
        return _resize_all(used)

    for shm in (True, False):
        assert run_threads(fn, 2, options=_options(shm)) == [[]] * 2, shm


def _padding_hook(group, bucket):
    """A DDP comm hook that pads its bucket in place before reducing it, as torch's
    ``batched_powerSGD_hook`` does (``input_tensor.resize_(padded_total_length)``; that hook
    itself stops on its own assertion in torch 2.13, with Gloo as well). From the second
    step on, the bucket has been through a linerate all_reduce: its resize failed while the
    all_reduce pinned its storage."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    t = bucket.buffer()
    n = t.numel()
    t.resize_(n + 7)
    t[n:].zero_()
    t.resize_(n)
    return default_hooks.allreduce_hook(group, bucket)


def _ddp_with_padding_hook(rank, world, lr):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(33, 7), process_group=lr)
    model.register_comm_hook(lr, _padding_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    x, y = torch.randn(16, 33), torch.randn(16, 7)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    w = model.module.weight.detach().clone()
    replicas = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(replicas, w, group=lr)
    return all(torch.equal(replicas[0], q) for q in replicas)


def test_ddp_comm_hook_that_resizes_its_bucket_trains():
    from _harness import run_ranks
    assert run_ranks(_ddp_with_padding_hook, 2, timeout=90, backend="linerate") == [True, True]


def test_views_read_and_write_the_tensor_and_keep_it_alive():
    from linerate.collectives.views import byte_view, np_view
    t = torch.arange(6, dtype=torch.int32)
    v = np_view(t)
    v[0] = 41
    assert t[0].item() == 41 and v.dtype == np.int32 and v.shape == (6,)
    b = byte_view(t)
    b[4:8] = (7).to_bytes(4, "little")
    assert t[1].item() == 7 and len(b) == 24
    s = np_view(torch.arange(12, dtype=torch.float64).reshape(3, 4).t())  # not contiguous
    assert s.shape == (4, 3) and s[1, 2] == 9.0
    del t, v
    import gc
    gc.collect()
    assert bytes(b[4:8]) == (7).to_bytes(4, "little")  # the view still holds the tensor
    t = torch.zeros(4)
    np_view(t)[:] = 1
    byte_view(t)
    t.resize_(100)  # never pinned
    assert byte_view(torch.empty(0)).nbytes == 0
