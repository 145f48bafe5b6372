"""Bandwidth-optimal ring algorithms, chunked and pipelined.

Every rank sends to its right neighbour and receives from its left one. Each segment is cut
into pieces (``piece_bytes``) that travel as separate messages, so that reducing piece k
overlaps receiving piece k+1, and a reduced piece is forwarded to the next step at once
instead of waiting for its whole segment. All receives of a step are posted before its data
arrives, so bytes land straight in their final (or staging) buffer.

Each link carries (P-1)/P of the data per phase: all-reduce moves 2(P-1)/P x size per rank,
the bus bandwidth bound of nccl-tests.
"""
from __future__ import annotations

import torch

from .comm import Comm, pieces
from .reduce_ops import reduce_into


def reduce_scatter(comm: Comm, segs: list[torch.Tensor], op) -> None:
    """Reduce segment i over all ranks into ``segs[i]`` of rank i (in place; the other
    segments of a rank are left holding partial results). ``segs`` are 1-D, one dtype."""
    P, r = comm.size, comm.rank
    if P == 1:
        return
    right, left = (r + 1) % P, (r - 1) % P
    pe = comm.piece_elems(segs[0])
    longest = max(s.numel() for s in segs)
    tmp = [torch.empty(longest, dtype=segs[0].dtype), torch.empty(longest, dtype=segs[0].dtype)]

    def post(step: int):
        # At step s a rank receives segment (r-s-2) from the left, reduces it, and sends it
        # on at step s+1; after P-1 steps segment r is complete here.
        mine = pieces(segs[(r - step - 2) % P], pe)
        bufs, reqs, off = [], [], 0
        for x in mine:
            b = tmp[step % 2][off:off + x.numel()]
            off += x.numel()
            bufs.append(b)
            reqs.append(comm.irecv(left, b))
        return mine, bufs, reqs

    nxt = post(0)
    sends = [comm.isend(right, x) for x in pieces(segs[(r - 1) % P], pe)]
    for step in range(P - 1):
        mine, bufs, reqs = nxt
        last = step == P - 2
        if not last:
            nxt = post(step + 1)
        for x, b, q in zip(mine, bufs, reqs):
            comm.wait(q)
            reduce_into(x, b, op)
            if not last:
                sends.append(comm.isend(right, x))
    comm.wait_all(sends)


def all_gather(comm: Comm, segs: list[torch.Tensor]) -> None:
    """Rank i provides ``segs[i]``; afterwards every rank has every segment. Segments are
    1-D and may differ in length (all ranks must agree on the lengths)."""
    P, r = comm.size, comm.rank
    if P == 1:
        return
    right, left = (r + 1) % P, (r - 1) % P
    pe = comm.piece_elems(segs[0])
    recvs = []
    for step in range(P - 1):  # all destinations are final: post every receive at once
        for x in pieces(segs[(r - step - 1) % P], pe):
            recvs.append((step, x, comm.irecv(left, x)))
    sends = [comm.isend(right, x) for x in pieces(segs[r], pe)]
    for step, x, q in recvs:
        comm.wait(q)
        if step < P - 2:
            sends.append(comm.isend(right, x))
    comm.wait_all(sends)


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    """Reduce-scatter then all-gather on a contiguous 1-D tensor, in place."""
    P = comm.size
    n = flat.numel()
    base, extra = divmod(n, P)
    segs, off = [], 0
    for i in range(P):
        k = base + (1 if i < extra else 0)
        segs.append(flat[off:off + k])
        off += k
    reduce_scatter(comm, segs, op)
    all_gather(comm, segs)
