"""Latency-bound algorithms in ceil(log2 P) rounds: for small messages on many ranks, where
the one-round direct algorithms (collectives/direct.py) make every rank send and receive P-1
messages and a ring takes P-1 chained steps.

- all_reduce: recursive doubling. With p2 the largest power of two <= P, the first P - p2 odd
  ranks 2i+1 first receive the tensor of rank 2i and fold it in (2i sits out); the p2 remaining
  ranks then exchange their whole partial results with the rank at distance 1, 2, 4, ...; at
  the end each folded-out rank gets the result from its partner. Each exchange combines the two
  partials as op(lower block, higher block), the same expression on both sides, so every rank
  computes the same bits (the reduce ops are commutative element by element, and the operand
  order is fixed anyway).
- broadcast: a binomial tree from the root (each rank that has the data sends it to the rank
  at distance 2^k in round k); reduce: the same tree the other way.

Every rank sends and receives at most ceil(log2 P) + 1 messages of the full size.
"""
from __future__ import annotations

import torch

from .comm import Comm, Fold
from .reduce_ops import reduce_into

_FOLD, _XCHG, _UNFOLD = 0, 1, 2  # message phases (Comm.slot)


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    """Reduce ``flat`` (1-D, contiguous) over all ranks, in place (AVG sums; the caller
    divides)."""
    comm.algorithm = "doubling"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    f = Fold(P, r)
    n = flat.numel()
    if f.sits_out:  # hand the tensor over, get the result back
        back = comm.irecv(r + 1, flat, comm.slot(base, _UNFOLD))
        comm.wait(comm.isend(r + 1, flat, comm.slot(base, _FOLD)))
        comm.wait(back)
        return
    tmp = comm.scratch.get(0, n, flat.dtype)
    if f.folds_in:
        comm.wait(comm.irecv(r - 1, tmp, comm.slot(base, _FOLD)))
        _combine(flat, tmp, op, mine_first=False)  # rank r-1's block comes first
    v = f.virtual
    d, step = 1, 0
    acc = comm.scratch.get(1, n, flat.dtype)
    while d < f.p2:
        peer = f.real(v ^ d)
        q = comm.irecv(peer, tmp, comm.slot(base, _XCHG, step))
        acc.copy_(flat)  # the send reads acc while flat takes the combination
        s = comm.isend(peer, acc, comm.slot(base, _XCHG, step))
        comm.wait(q)
        _combine(flat, tmp, op, mine_first=not (v & d))
        comm.wait(s)
        d <<= 1
        step += 1
    if f.folds_in:
        comm.wait(comm.isend(r - 1, flat, comm.slot(base, _UNFOLD)))


def _combine(mine: torch.Tensor, theirs: torch.Tensor, op, mine_first: bool) -> None:
    """mine = op(lower, higher) where the lower block is mine when ``mine_first``."""
    if mine_first:
        reduce_into(mine, theirs, op)
    else:
        # op(theirs, mine), computed in the receive buffer (free again after this).
        reduce_into(theirs, mine, op)
        mine.copy_(theirs)


def broadcast(comm: Comm, t: torch.Tensor, root: int) -> None:
    """Binomial-tree broadcast of ``t`` from ``root`` (in place on the others)."""
    comm.algorithm = "tree"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    v = (r - root) % P  # rank relative to the root
    d = 1
    # Receive once from the rank that clears this rank's highest set bit.
    if v:
        hb = 1 << (v.bit_length() - 1)
        comm.wait(comm.irecv((v - hb + root) % P, t, comm.slot(base, 0, hb.bit_length() - 1)))
        d = hb << 1
    sends = []
    while d < P:
        if v + d < P:
            sends.append(comm.isend((v + d + root) % P, t, comm.slot(base, 0, d.bit_length() - 1)))
        d <<= 1
    comm.wait_all(sends)


def reduce(comm: Comm, flat: torch.Tensor, op, root: int) -> None:
    """Binomial-tree reduce to ``root`` (the mirror of ``broadcast``): each rank folds its
    children's partial results into its own, nearest child first, and sends the sum up. The
    fold order is fixed by the tree, so the root's bits do not depend on timing. The inputs of
    the other ranks are left as they were."""
    comm.algorithm = "tree"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    v = (r - root) % P
    hb = 1 << (v.bit_length() - 1) if v else 0
    d = hb << 1 if v else 1
    children = []
    while d < P:
        if v + d < P:
            children.append(((v + d + root) % P, d))
        d <<= 1
    acc = flat
    if children:
        if v:  # a non-root's input stays as it was: fold into scratch
            acc = comm.scratch.get(1, flat.numel(), flat.dtype)
            acc.copy_(flat)
        n = flat.numel()
        tmp = comm.scratch.get(0, len(children) * n, flat.dtype)
        bufs = [tmp[i * n:(i + 1) * n] for i in range(len(children))]
        recvs = [comm.irecv(c, b, comm.slot(base, 1, d.bit_length() - 1))
                 for b, (c, d) in zip(bufs, children)]
        for b, q in zip(bufs, recvs):
            comm.wait(q)
            reduce_into(acc, b, op)
    if v:
        comm.wait(comm.isend((v - hb + root) % P, acc, comm.slot(base, 1, hb.bit_length() - 1)))
