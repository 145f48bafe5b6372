"""Halving-doubling all-reduce (Rabenseifner): a reduce-scatter by recursive halving, then an
all-gather by recursive doubling.

Each rank sends (P-1)/P of the data per phase, as the ring does (bandwidth-optimal), but in
log2(P) exchanges per phase instead of P-1 ring steps: fewer hops on the critical path, at the
cost of longer messages per exchange and of every exchange going to another peer.

With P ranks and p2 the largest power of two <= P, the first 2 (P - p2) ranks pair up first:
in each pair the even rank hands its whole tensor to the odd one and sits out, and gets the
result back at the end. The others renumber 0..p2-1 and run the power-of-two algorithm. Each
element's final value is computed at exactly one rank and copied to the others, so every rank
ends with the same bits.

Every exchange is cut into pieces (``Comm.piece_elems``): reducing piece k overlaps receiving
piece k+1, and receives are posted before the matching sends go out.
"""
from __future__ import annotations

import torch

from .comm import Comm, Fold, pieces
from .reduce_ops import reduce_into

_FOLD, _HALVE, _DOUBLE, _UNFOLD = 0, 1, 2, 3  # message phases (Comm.slot)

#: ``LINERATE_ALLREDUCE_ALGO=auto`` takes halving-doubling above LINERATE_SMALL_BYTES up to
#: AUTO_MAX_BYTES on AUTO_MIN_RANKS or more ranks, the ring beyond. On 8 hosts over 1 Gbit/s
#: links it beats the ring up to about 256 KiB (fewer hops on the critical path) and loses
#: from about 512 KiB (its exchanges are not pipelined into each other as the ring's steps
#: are); on 4 hosts the two are about even at these sizes.
AUTO_MIN_RANKS = 8
AUTO_MAX_BYTES = 256 << 10


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    """Reduce ``flat`` (1-D, contiguous) over all ranks, in place. AVG sums (the caller
    divides)."""
    comm.algorithm = "halving-doubling"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    f = Fold(P, r)
    p2 = f.p2
    n = flat.numel()

    def exchange(peer: int, send: torch.Tensor, recv: torch.Tensor, phase: int, step: int,
                 on_piece=None) -> None:
        """Send ``send`` to ``peer`` while receiving the same number of elements from it into
        ``recv``; ``on_piece(k, received_piece)`` as each piece arrives."""
        pe = comm.piece_elems(recv)
        got = pieces(recv, pe)
        recvs = [comm.irecv(peer, b, comm.slot(base, phase, step, k)) for k, b in enumerate(got)]
        sends = [comm.isend(peer, x, comm.slot(base, phase, step, k))
                 for k, x in enumerate(pieces(send, comm.piece_elems(send)))]
        for k, (q, b) in enumerate(zip(recvs, got)):
            comm.wait(q)
            if on_piece is not None:
                on_piece(k, b, pe)
        comm.wait_all(sends)

    # Fold: ranks 2i and 2i+1 (i < rem) become one.
    whole = pieces(flat, comm.piece_elems(flat))  # fold / unfold messages
    if f.sits_out:
        comm.wait_all([comm.isend(r + 1, x, comm.slot(base, _FOLD, 0, k))
                       for k, x in enumerate(whole)])
        comm.wait_all([comm.irecv(r + 1, x, comm.slot(base, _UNFOLD, 0, k))
                       for k, x in enumerate(whole)])
        return
    if f.folds_in:
        theirs = pieces(comm.scratch.get(0, n, flat.dtype), comm.piece_elems(flat))
        recvs = [comm.irecv(r - 1, b, comm.slot(base, _FOLD, 0, k)) for k, b in enumerate(theirs)]
        for x, b, q in zip(whole, theirs, recvs):
            comm.wait(q)
            reduce_into(x, b, op)
    new, real = f.virtual, f.real

    bounds = [i * n // p2 for i in range(p2 + 1)]

    def span(lo: int, hi: int) -> torch.Tensor:  # blocks [lo, hi) of flat
        return flat[bounds[lo]:bounds[hi]]

    # Reduce-scatter by recursive halving: keep half of the range, send the other half.
    lo, hi, d, step = 0, p2, p2 // 2, 0
    tmp = comm.scratch.get(0, max(bounds[i + p2 // 2] - bounds[i] for i in range(p2 // 2 + 1)),
                           flat.dtype)
    while d >= 1:
        mid = lo + d
        keep, give = ((mid, hi), (lo, mid)) if new & d else ((lo, mid), (mid, hi))
        kept = span(*keep)
        buf = tmp[:kept.numel()]

        def fold_in(k, b, pe, kept=kept):
            reduce_into(kept[k * pe:k * pe + b.numel()], b, op)
        exchange(real(new ^ d), span(*give), buf, _HALVE, step, fold_in)
        lo, hi = keep
        d //= 2
        step += 1
    # All-gather by recursive doubling: swap ranges with a partner, the range doubles.
    d, step = 1, 0
    while d < p2:
        other = (lo - d, lo) if new & d else (hi, hi + d)
        exchange(real(new ^ d), span(lo, hi), span(*other), _DOUBLE, step)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        d *= 2
        step += 1
    if f.folds_in:  # unfold: the partner that sat out gets the result
        comm.wait_all([comm.isend(r - 1, x, comm.slot(base, _UNFOLD, 0, k))
                       for k, x in enumerate(whole)])
