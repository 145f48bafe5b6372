"""Latency-optimal and one-to-many algorithms: one round of messages between the ranks
concerned. Reductions fold the contributions in rank order, so every rank computes the same
bits (floating point addition is not associative)."""
from __future__ import annotations

import torch

from .comm import Comm
from .reduce_ops import reduce_into


def _fold_in_rank_order(acc: torch.Tensor, contributions: list[torch.Tensor], op) -> None:
    acc.copy_(contributions[0])
    for c in contributions[1:]:
        reduce_into(acc, c, op)


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    """Every rank sends its tensor to every other rank, then folds all of them: one round,
    for small messages."""
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    buf = comm.scratch.get(0, P * flat.numel(), flat.dtype).view(P, -1)
    recvs = [comm.irecv(p, buf[p], base) for p in range(P) if p != r]
    sends = [comm.isend((r + k) % P, flat, base) for k in range(1, P)]
    buf[r].copy_(flat)
    comm.wait_all(recvs)
    comm.wait_all(sends)  # the sends read flat, which the fold overwrites
    _fold_in_rank_order(flat, list(buf), op)


def reduce(comm: Comm, flat: torch.Tensor, op, root: int) -> None:
    """Every rank sends to the root, which folds in rank order into ``flat``."""
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    if r != root:
        comm.wait(comm.isend(root, flat, base))
        return
    buf = comm.scratch.get(0, P * flat.numel(), flat.dtype).view(P, -1)
    recvs = [comm.irecv(p, buf[p], base) for p in range(P) if p != r]
    buf[r].copy_(flat)
    comm.wait_all(recvs)
    _fold_in_rank_order(flat, list(buf), op)


def broadcast(comm: Comm, t: torch.Tensor, root: int) -> None:
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    if r == root:
        comm.wait_all([comm.isend((root + k) % P, t, base) for k in range(1, P)])
    else:
        comm.wait(comm.irecv(root, t, base))


def gather(comm: Comm, t: torch.Tensor, outs: list[torch.Tensor] | None, root: int) -> None:
    base = comm.block()
    P, r = comm.size, comm.rank
    if r != root:
        comm.wait(comm.isend(root, t, base))
        return
    recvs = [comm.irecv(p, outs[p], base) for p in range(P) if p != r]
    outs[r].copy_(t)
    comm.wait_all(recvs)


def scatter(comm: Comm, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
    base = comm.block()
    P, r = comm.size, comm.rank
    if r != root:
        comm.wait(comm.irecv(root, out, base))
        return
    sends = [comm.isend((r + k) % P, ins[(r + k) % P], base) for k in range(1, P)]
    out.copy_(ins[r])
    comm.wait_all(sends)


def all_to_all(comm: Comm, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """outs[p] receives rank p's ins[me]. Sends start at the right neighbour and go round, so
    that at any time every rank sends to a different rank."""
    base = comm.block()
    P, r = comm.size, comm.rank
    recvs = [comm.irecv(p, outs[p], base) for p in range(P) if p != r]
    sends = [comm.isend((r + k) % P, ins[(r + k) % P], base) for k in range(1, P)]
    outs[r].copy_(ins[r])
    comm.wait_all(recvs)
    comm.wait_all(sends)


_NOTHING = memoryview(bytearray(0))  # a barrier's messages (bytes: no tensor to view)


def barrier(comm: Comm) -> None:
    """Dissemination barrier: ceil(log2 P) rounds of empty messages."""
    comm.algorithm = "dissemination"
    base = comm.block()
    P, r = comm.size, comm.rank
    d = 1
    while d < P:
        q = comm.irecv_bytes((r - d) % P, _NOTHING, comm.slot(base, step=d))
        comm.wait(comm.isend_bytes((r + d) % P, _NOTHING, comm.slot(base, step=d)))
        comm.wait(q)
        d *= 2


def all_gather(comm: Comm, segs: list[torch.Tensor]) -> None:
    """Rank r's segs[r] goes to every rank in one round (small messages)."""
    base = comm.block()
    P, r = comm.size, comm.rank
    recvs = [comm.irecv(p, segs[p], base) for p in range(P) if p != r]
    sends = [comm.isend((r + k) % P, segs[r], base) for k in range(1, P)]
    comm.wait_all(recvs)
    comm.wait_all(sends)


def reduce_scatter(comm: Comm, segs: list[torch.Tensor], out: torch.Tensor, op) -> None:
    """Rank p receives everyone's segs[p] and folds them in rank order into ``out``."""
    base = comm.block()
    P, r = comm.size, comm.rank
    buf = comm.scratch.get(0, P * out.numel(), out.dtype).view(P, -1)
    recvs = [comm.irecv(p, buf[p], base) for p in range(P) if p != r]
    sends = [comm.isend((r + k) % P, segs[(r + k) % P], base) for k in range(1, P)]
    buf[r].copy_(segs[r])
    comm.wait_all(recvs)
    _fold_in_rank_order(out, list(buf), op)
    comm.wait_all(sends)
