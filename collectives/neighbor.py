"""Neighbor all-reduce (docs/neighbor-spec.md): every rank mixes its tensor with its
in-neighbors' under a topology's mixing matrix, with point-to-point transfers to and from its
neighbors only (all at once, striped like every transfer), on the group's collective worker.

    neighbor_allreduce(tensor, topology, step=None, async_op=False, group=None)

After the call rank i's tensor is ``W[i, i] * x_i + sum_j W[i, j] * x_j`` with W the topology's
matrix at ``step``. ``step=None`` takes the group's own counter: the number of neighbor
all-reduces called on the group before this one (every call advances it by one, whatever its
``step``), so ranks that make the same calls agree on it.
"""
from __future__ import annotations

import numbers
import queue
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .comm import Comm, pieces
from .topology import Topology

__all__ = ["neighbor_allreduce"]

#: Half types are accumulated in float32 (then rounded once); the others in their own dtype.
_ACC_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # backend -> calls so far
_steps_lock = threading.Lock()


def _linerate_backend(group):
    """The ProcessGroupLinerate behind ``group`` (None: the default group), or a clear error."""
    from .backend import ProcessGroupLinerate

    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("neighbor_allreduce: torch.distributed is not initialized: call "
                               "dist.init_process_group first")
        group = dist.group.WORLD
    if isinstance(group, ProcessGroupLinerate):
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - any failure here means: not a linerate group
        raise RuntimeError(f"neighbor_allreduce: the process group has no CPU backend ({e}); it "
                           f"needs a linerate group (dist.init_process_group('linerate') or "
                           f"dist.new_group(backend='linerate'))") from None
    if not isinstance(backend, ProcessGroupLinerate):
        name = getattr(backend, "name", lambda: type(backend).__name__)()
        raise RuntimeError(f"neighbor_allreduce needs a process group of the linerate backend; this "
                           f"group's CPU backend is {name!r}: pass group=dist.new_group(backend="
                           f"'linerate') or use dist.init_process_group('linerate')")
    return backend


def neighbor_allreduce(tensor: torch.Tensor, topology: Topology, step: int | None = None,
                       async_op: bool = False, group=None, out: torch.Tensor | None = None):
    """Mix ``tensor`` in place with the neighbors' under ``topology`` at ``step``; with ``out``
    (same shape and dtype, not overlapping ``tensor``) the result goes there and ``tensor`` is
    left unchanged (DecentralizedDataParallel mixes into a second buffer: no copies).

    Every rank of the group must call it with the same topology and step (checked: a rank that
    passes another topology, step, dtype or size fails the call on every rank). Returns a Work
    when ``async_op``, else None once the tensor holds the result."""
    backend = _linerate_backend(group)
    rank, size = backend.rank(), backend.size()
    if not isinstance(topology, Topology):
        raise TypeError(f"rank {rank}: neighbor_allreduce: topology must be a linerate.topology."
                        f"Topology, got {type(topology).__name__}")
    if topology.n != size:
        raise ValueError(f"rank {rank}: neighbor_allreduce: topology {topology!r} has {topology.n} "
                         f"ranks but the group has {size}")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"rank {rank}: neighbor_allreduce: step must be an int or None, got "
                            f"{step!r}")
        step = int(step)
    with _steps_lock:
        counter = _steps.get(backend, 0)
        if step is None:
            step = counter
        work = backend.neighbor_allreduce(tensor, topology.self_weight(rank, step),
                                          topology.in_weights(rank, step),
                                          topology.out_peers(rank, step),
                                          call=f"{topology!r} step={step}", out=out)
        _steps[backend] = counter + 1
    if async_op:
        return work
    work.wait()
    return None


_EMPTY = torch.empty(0, dtype=torch.uint8)


def mix(comm: Comm, flat: torch.Tensor, self_weight: float, in_weights: list[tuple[int, float]],
        out_peers: list[int], handshake: bool = True, out: torch.Tensor | None = None) -> None:
    """The algorithm (runs on the worker): ``flat <- self_weight * flat + sum in_w * x_j``,
    or into ``out`` (1-D, same size and dtype, not overlapping ``flat``) leaving ``flat`` as it
    is: then a piece is combined without waiting for its sends.

    Every receive (one scratch buffer per in-neighbor) is posted at once, cut into pipeline
    pieces; piece k is combined as soon as it has arrived from every in-neighbor and been sent
    to every out-peer (the sends read ``flat``), so combining overlaps the transfer of the pieces
    after it. Contributions are added in increasing rank order.

    ``handshake`` (every rank must pass the same): a rank sends its data to an out-peer only
    once that peer has said it is in this op (an empty "ready" message, sent when its receives
    are posted). Without it a rank that finished step t early sends step t+1's data at once, and
    with a time-varying topology that data competes for the receiver's link with step t's data
    still arriving from its old neighbor, which is late by then (measured: one-peer exponential,
    8 netlab hosts at 1 Gbit/s, 64 MB: 0.72 s per op without it, 0.58 with it, 0.60 with a
    barrier between ops instead; 0.54 is the line). It costs one latency: the backend turns it
    off for small tensors."""
    comm.algorithm = "neighbor"
    base = comm.block()
    n = flat.numel()
    nin = len(in_weights)
    bufs = comm.scratch.get(0, nin * n, flat.dtype).view(nin, n) if nin else None
    step = comm.piece_elems(flat)
    own = pieces(flat, step)
    theirs = [pieces(bufs[k], step) for k in range(nin)]
    ready_slot = comm.slot(base, phase=1)
    ready = [comm.irecv(q, _EMPTY, ready_slot) for q in out_peers] if handshake else []
    recvs = [[comm.irecv(j, theirs[k][p], comm.slot(base, piece=p)) for k, (j, _) in enumerate(in_weights)]
             for p in range(len(own))]
    sends: list[list] = [[] for _ in own]

    def send_to(q):
        for p in range(len(own)):
            sends[p].append(comm.isend(q, own[p], comm.slot(base, piece=p)))

    if handshake:
        told = [comm.isend(j, _EMPTY, ready_slot) for j, _ in in_weights]
        arrived: queue.SimpleQueue = queue.SimpleQueue()
        for i, r in enumerate(ready):
            r.add_done_callback(lambda _r, i=i: arrived.put(i))
        for _ in ready:  # send to each out-peer as soon as it is ready, in arrival order
            try:
                i = arrived.get(timeout=max(0.0, comm.deadline - time.monotonic()))
            except queue.Empty:
                comm.wait_all(ready)  # raises the timeout, naming the peer
                i = arrived.get()
            comm.wait(ready[i])  # raises its failure, if it failed
            send_to(out_peers[i])
        comm.wait_all(told)
    else:
        for q in out_peers:
            send_to(q)
    acc_dtype = _ACC_DTYPE.get(flat.dtype)
    in_place = out is None or out.data_ptr() == flat.data_ptr()
    dst = own if in_place else pieces(out, step)
    for p, piece in enumerate(own):
        comm.wait_all(recvs[p])
        if in_place:
            comm.wait_all(sends[p])  # the sends read this piece, which is overwritten now
        d = dst[p]
        if acc_dtype is None:
            if in_place:
                if self_weight != 1.0:
                    piece.mul_(self_weight)
            else:
                torch.mul(piece, self_weight, out=d)
            for k, (_, w) in enumerate(in_weights):
                d.add_(theirs[k][p], alpha=w)
        else:
            acc = piece.to(acc_dtype).mul_(self_weight)
            for k, (_, w) in enumerate(in_weights):
                acc.add_(theirs[k][p].to(acc_dtype), alpha=w)
            d.copy_(acc)
    if not in_place:
        for s in sends:
            comm.wait_all(s)
