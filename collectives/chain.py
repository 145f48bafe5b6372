"""Pipelined chains for large rooted collectives: every link carries the data once.

broadcast: root -> root+1 -> ... -> root-1; each rank forwards piece k while piece k+1 arrives.
reduce:    root-1 -> root-2 -> ... -> root; each rank adds its own piece and passes it on.
Time ~ size / link rate + (P-2) x piece time, against (P-1) x size / rate for one-to-all.
"""
from __future__ import annotations

import torch

from .comm import Comm, pieces
from .reduce_ops import reduce_into


def broadcast(comm: Comm, t: torch.Tensor, root: int) -> None:
    comm.algorithm = "chain"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    pos = (r - root) % P
    nxt = (r + 1) % P if pos < P - 1 else None
    parts = pieces(t, comm.piece_elems(t))
    if pos == 0:
        comm.wait_all([comm.isend(nxt, x, base | k) for k, x in enumerate(parts)])
        return
    prev = (r - 1) % P
    recvs = [comm.irecv(prev, x, base | k) for k, x in enumerate(parts)]
    sends = []
    for k, (x, q) in enumerate(zip(parts, recvs)):
        comm.wait(q)
        if nxt is not None:
            sends.append(comm.isend(nxt, x, base | k))
    comm.wait_all(sends)


def reduce(comm: Comm, flat: torch.Tensor, op, root: int) -> None:
    """Result in ``flat`` on the root; other ranks' ``flat`` is not modified."""
    comm.algorithm = "chain"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    pos = (r - root) % P
    pe = comm.piece_elems(flat)
    if pos == P - 1:  # head of the chain: just send
        comm.wait_all([comm.isend((r - 1) % P, x, base | k) for k, x in enumerate(pieces(flat, pe))])
        return
    acc = flat if pos == 0 else flat.clone()
    tmp = comm.scratch.get(0, acc.numel(), acc.dtype)
    acc_parts, tmp_parts = pieces(acc, pe), pieces(tmp, pe)
    src = (r + 1) % P
    recvs = [comm.irecv(src, b, base | k) for k, b in enumerate(tmp_parts)]
    sends = []
    for k, (x, b, q) in enumerate(zip(acc_parts, tmp_parts, recvs)):
        comm.wait(q)
        reduce_into(x, b, op)
        if pos != 0:
            sends.append(comm.isend((r - 1) % P, x, base | k))
    comm.wait_all(sends)
