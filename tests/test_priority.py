"""Priority scheduling: the transport sends the most urgent queued message first (chunk by
chunk, within the credit window), and PriorityDataParallel trains exactly like DDP (same loss,
step for step, as DDP over Gloo) while all-reducing per layer by priority and updating each
layer as soon as its gradients arrive; its timeline shows when each partition was queued,
sent and applied."""
from __future__ import annotations

import datetime
import json
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _harness import run_ranks
from linerate.transport import CHANNEL_P2P, Context, TransportOptions


def _pair(**kw):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    opts = TransportOptions(nsocks=1, socket_ifname="lo", chunk_bytes=64 << 10, **kw)
    ctxs = [None, None]

    def build(r):
        ctxs[r] = Context(store, r, 2, opts)

    ts = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert all(ctxs)
    return ctxs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["shm", "tcp-threads", "tcp-shared"])
@pytest.mark.parametrize("urgent", [True, False])
def test_urgent_message_overtakes_queued_ones(urgent, kind):
    """On every link kind: shared memory, and TCP with a link's own sender threads or with
    the process's shared I/O loops (LINERATE_IO)."""
    kw = {} if kind == "shm" else {"shm": "0", "io": kind.split("-")[1]}
    c0, c1 = _pair(credit_bytes=64 << 10, **kw)
    try:
        big = np.zeros(64 << 20, np.uint8)
        small = np.ones(256 << 10, np.uint8)
        rbig, rsmall = np.empty_like(big), np.empty_like(small)
        done = []
        r1 = c1.irecv(0, memoryview(rbig), CHANNEL_P2P, 1)
        r2 = c1.irecv(0, memoryview(rsmall), CHANNEL_P2P, 2)
        r1.add_done_callback(lambda r: done.append("big"))
        r2.add_done_callback(lambda r: done.append("small"))
        # Held between the two sends, the sending side cannot move all 64 MB before the
        # second is queued, however long the scheduler keeps this thread off a core between
        # them (else "big" could finish first after such a pause). Shared memory: one progress
        # thread moves every ring (2 MiB each); TCP: a sender that wrote a chunk (64 KiB)
        # counts it under the link's done-lock, so at most one chunk of "big" goes meanwhile.
        from linerate.transport.shm import ring as shmlink
        # With shared memory the link is made with the group; over TCP (lazy) at the first
        # message: one goes before the test.
        w = c1.irecv(0, memoryview(bytearray(1)), CHANNEL_P2P, 3)
        c0.isend(1, memoryview(b"w"), CHANNEL_P2P, 3).wait(30)
        w.wait(30)
        link = c0.peers[1].link
        want = {"shm": "ShmLink", "tcp-threads": "TcpLink", "tcp-shared": "SharedTcpLink"}
        assert type(link).__name__ == want[kind], type(link).__name__
        hold = shmlink._ENGINE._lock if kind == "shm" else link._done_lock
        with hold:
            s1 = c0.isend(1, memoryview(big), CHANNEL_P2P, 1, priority=5)
            s2 = c0.isend(1, memoryview(small), CHANNEL_P2P, 2, priority=0 if urgent else 5)
        for r in (s1, s2, r1, r2):
            r.wait(30)
        assert np.array_equal(rsmall, small) and np.array_equal(rbig, big)
        assert done == (["small", "big"] if urgent else ["big", "small"]), done
    finally:
        c0.close(timeout=5)
        c1.close(timeout=5)


def test_credit_option_is_validated():
    with pytest.raises(ValueError, match="LINERATE_CREDIT_BYTES"):
        TransportOptions.from_env({"LINERATE_CREDIT_BYTES": "lots"})
    assert TransportOptions.from_env({"LINERATE_CREDIT_BYTES": "256K"}).credit_bytes == 256 << 10
    from linerate.collectives.options import Options
    assert Options.from_env({"LINERATE_PARTITION_BYTES": "1M"}).partition_bytes == 1 << 20
    with pytest.raises(ValueError, match="LINERATE_PARTITION_BYTES"):
        Options.from_env({"LINERATE_PARTITION_BYTES": "100"})


# ----------------------------------------------------------------------------- training
def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def _batches(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        yield x, (x[:, :1] * 2 - x[:, 1:2]).sin()


def _train(model, opt, rank, steps, sched=None):
    losses = []
    for x, y in _batches(rank, steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _compare(rank, world, lr, optim, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from linerate import PriorityDataParallel

    def make_opt(params):
        if optim == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
        return torch.optim.Adam(params, lr=3e-3)

    net = _mlp(1 + rank)  # different on every rank: the wrappers broadcast rank 0's
    ddp = DDP(net, process_group=None)  # the default group: Gloo
    opt = make_opt(ddp.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    ref = _train(ddp, opt, rank, steps, sched)
    ref_params = [p.detach().clone() for p in net.parameters()]

    net2 = _mlp(1 + rank)
    opt2 = make_opt(net2.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3, 0.5)
    pdp = PriorityDataParallel(net2, opt2, process_group=lr, partition_bytes=4096)
    mine = _train(pdp, opt2, rank, steps, sched2)
    pdp.synchronize()
    params = [p.detach().clone() for p in net2.parameters()]
    state_steps = len(opt2.state_dict()["state"])
    pdp.close()
    return ref, mine, ref_params, params, state_steps


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optim,world", [("sgd", 2), ("adam", 3), ("sgd", 4)])
def test_loss_curve_equals_ddp_over_gloo(optim, world):
    out = run_ranks(_compare, world, optim, 8, timeout=150)
    for rank, (ref, mine, ref_params, params, nstate) in enumerate(out):
        np.testing.assert_allclose(mine, ref, rtol=2e-5, atol=1e-6, err_msg=f"rank {rank}")
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert nstate == 8  # the optimizer's own state holds every parameter's
    for rank in range(1, world):  # every rank has the same model
        for a, b in zip(out[rank][3], out[0][3]):
            assert torch.equal(a, b)


def _timeline(rank, world, lr, path):
    from linerate import PriorityDataParallel
    net = _mlp(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    pdp = PriorityDataParallel(net, opt, process_group=lr, partition_bytes=4096)
    _train(pdp, opt, rank, 3)
    pdp.close()
    pdp._timeline.flush()
    return pdp._timeline.path


@pytest.mark.timeout(120)
def test_timeline_shows_queued_sent_applied(tmp_path):
    path = str(tmp_path / "tl.json")
    files = run_ranks(_timeline, 2, path, timeout=90, env={"LINERATE_TIMELINE": path})
    assert files == [str(tmp_path / "tl.rank0.json"), str(tmp_path / "tl.rank1.json")]
    from linerate.collectives.timeline import merge
    n = merge(files, str(tmp_path / "all.json"))
    events = json.load(open(tmp_path / "all.json"))["traceEvents"]
    assert n == len(events)
    names = [e["name"] for e in events]
    for kind in ("queued 0[0]", "all_reduce 0[0]", "apply 0", "forward 6", "gradients 6", "wait 0"):
        assert kind in names, kind
    sends = [e for e in events if e["name"].startswith("all_reduce") and e["pid"] == 0]
    assert sends and all(e["ph"] == "X" and e["dur"] >= 0 and "priority" in e["args"] for e in sends)
    # 4 layers: the first layer's partitions carry priority 0, the last layer's 3
    prio = {e["name"].split()[1].split("[")[0]: e["args"]["priority"] for e in sends}
    assert prio["0"] == 0 and prio["6"] == 3
    assert {e["pid"] for e in events} == {0, 1}


def _unused(rank, world, lr):
    from linerate import PriorityDataParallel

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x)

    net = Two()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pdp = PriorityDataParallel(net, opt, process_group=lr)
    pdp(torch.ones(2, 4)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(90)
def test_unused_parameters_are_named():
    for msg in run_ranks(_unused, 2, timeout=60):
        assert "['b']" in msg and "no gradient" in msg, msg


def _tied(rank, world, lr):
    from linerate import PriorityDataParallel

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight  # tied

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    net = Tied()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pdp = PriorityDataParallel(net, opt, process_group=lr)
    for _ in range(3):
        opt.zero_grad()
        pdp(torch.full((2, 4), float(rank))).sum().backward()
        opt.step()
    pdp.synchronize()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.timeout(90)
def test_tied_parameters_train_and_stay_equal():
    out = run_ranks(_tied, 2, timeout=60)
    for a, b in zip(out[0], out[1]):
        assert torch.equal(a, b)


def _not_linerate(rank, world, lr):
    from linerate import PriorityDataParallel
    net = _mlp(0)
    try:
        PriorityDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))  # default: Gloo
    except TypeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(90)
def test_needs_a_linerate_group():
    for msg in run_ranks(_not_linerate, 2, timeout=60):
        assert "needs a linerate process group" in msg


def test_nsocks_auto_is_two_on_one_rail_one_per_rail_on_several():
    from linerate.transport.options import sockets_per_rail
    assert TransportOptions.from_env({}).nsocks == 0
    assert TransportOptions.from_env({"LINERATE_NSOCKS": "auto"}).nsocks == 0
    assert TransportOptions.from_env({"LINERATE_NSOCKS": "3"}).nsocks == 3
    assert [sockets_per_rail(0, r) for r in (1, 2, 4)] == [2, 1, 1]
    assert sockets_per_rail(3, 4) == 3
    with pytest.raises(ValueError, match="LINERATE_NSOCKS"):
        TransportOptions.from_env({"LINERATE_NSOCKS": "many"})
    c0, c1 = _pair()  # nsocks=1 given: kept
    try:
        assert c0.options.nsocks == 1 and c0.nconns == 1
    finally:
        c0.close(timeout=5)
        c1.close(timeout=5)
