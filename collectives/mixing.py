"""The neighbor all-reduce's point-to-point step (collectives/neighbor.py,
docs/neighbor-spec.md): each rank mixes its tensor with its in-neighbors' tensors, sending its
own to its out-peers, on the group's collective worker."""
from __future__ import annotations

import queue
import time

import torch

from .comm import Comm, pieces

#: Half types are accumulated in float32 (then rounded once); the others in their own dtype.
_ACC_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

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
    still arriving from its old neighbor, which is late by then: with a time-varying topology
    on a link-bound group the handshake brings large ops close to the line rate (and does
    better than a barrier between ops). It costs one latency: the backend turns it off for
    small tensors."""
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
