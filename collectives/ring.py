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


def reduce_scatter(comm: Comm, segs: list[torch.Tensor], op, on_step_sent=None) -> None:
    """Reduce segment i over all ranks into ``segs[i]`` of rank i (in place; the other
    segments of a rank are left holding partial results). ``segs`` are 1-D, one dtype.

    ``on_step_sent(step)`` is called once the sends of a step have completed, i.e. once
    segment (r-step-1) may be overwritten (all_reduce posts its all-gather receives there)."""
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
    sends = [[comm.isend(right, x) for x in pieces(segs[(r - 1) % P], pe)]]
    for step in range(P - 1):
        mine, bufs, reqs = nxt
        last = step == P - 2
        if not last:
            nxt = post(step + 1)
            sends.append([])
        for x, b, q in zip(mine, bufs, reqs):
            comm.wait(q)
            reduce_into(x, b, op)
            if not last:
                sends[step + 1].append(comm.isend(right, x))
        comm.wait_all(sends[step])  # issued one step ago: normally complete already
        if on_step_sent is not None:
            on_step_sent(step)


def all_gather(comm: Comm, segs: list[torch.Tensor], recvs=None) -> None:
    """Rank i provides ``segs[i]``; afterwards every rank has every segment. Segments are
    1-D and may differ in length (all ranks must agree on the lengths). ``recvs``: receives
    already posted by ``post_all_gather_step`` (all_reduce posts them early)."""
    P, r = comm.size, comm.rank
    if P == 1:
        return
    if recvs is None:
        recvs = []
        for step in range(P - 1):  # all destinations are final: post every receive at once
            recvs.extend(post_all_gather_step(comm, segs, step))
    right = (r + 1) % P
    pe = comm.piece_elems(segs[0])
    sends = [comm.isend(right, x) for x in pieces(segs[r], pe)]
    for step, x, q in recvs:
        comm.wait(q)
        if step < P - 2:
            sends.append(comm.isend(right, x))
    comm.wait_all(sends)


def post_all_gather_step(comm: Comm, segs: list[torch.Tensor], step: int) -> list:
    """Post the receives of all-gather step ``step``: segment (r-step-1) from the left."""
    P, r = comm.size, comm.rank
    left = (r - 1) % P
    return [(step, x, comm.irecv(left, x))
            for x in pieces(segs[(r - step - 1) % P], comm.piece_elems(segs[0]))]


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
    # All-gather step s receives into segment (r-s-1), the one reduce-scatter step s sent:
    # post those receives as soon as that send is done, so that no all-gather data arrives
    # before its receive (it would be staged and copied).
    early = []
    reduce_scatter(comm, segs, op,
                   on_step_sent=lambda step: early.extend(post_all_gather_step(comm, segs, step)))
    all_gather(comm, segs, early)
