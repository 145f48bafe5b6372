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


def reduce_scatter(comm: Comm, segs: list[torch.Tensor], op, on_piece_sent=None,
                   on_final_piece=None) -> None:
    """Reduce segment i over all ranks into ``segs[i]`` of rank i (in place; the other
    segments of a rank are left holding partial results). ``segs`` are 1-D, one dtype.

    ``on_piece_sent(step, k)`` is called once piece k of the segment that step ``step`` sends,
    (r-step-1), has been sent, i.e. may be overwritten (all_reduce posts its all-gather
    receives there), in order of k and step; by the end of a step, for all of its pieces. Per
    piece, not per step: with 2 ranks the last step is the first, and the peer's all-gather
    pieces arrive while it runs (posted per step, about half of them would arrive before their
    receive and be staged and copied).
    ``on_final_piece(k, piece)`` is called as each piece of this rank's own segment is
    complete (all_reduce starts sending it on at once: the two phases overlap)."""
    comm.algorithm = "ring"
    base = comm.block()
    P, r = comm.size, comm.rank
    if P == 1:
        return
    right, left = (r + 1) % P, (r - 1) % P
    longest = max(s.numel() for s in segs)
    pe = comm.piece_elems(segs[0], longest)
    tmp = [comm.scratch.get(0, longest, segs[0].dtype), comm.scratch.get(1, longest, segs[0].dtype)]

    def post(step: int):
        # At step s a rank receives segment (r-s-2) from the left, reduces it, and sends it
        # on at step s+1; after P-1 steps segment r is complete here.
        mine = pieces(segs[(r - step - 2) % P], pe)
        bufs, reqs, off = [], [], 0
        for k, x in enumerate(mine):
            b = tmp[step % 2][off:off + x.numel()]
            off += x.numel()
            bufs.append(b)
            reqs.append(comm.irecv(left, b, comm.slot(base, 0, step, k)))
        return mine, bufs, reqs

    nxt = post(0)
    sends = [[comm.isend(right, x, comm.slot(base, 0, 0, k))
              for k, x in enumerate(pieces(segs[(r - 1) % P], pe))]]
    posted = 0  # pieces of sends[step] reported to on_piece_sent

    def report(step: int) -> int:
        n, s = posted, sends[step]
        while n < len(s) and s[n].is_completed():
            on_piece_sent(step, n)
            n += 1
        return n

    for step in range(P - 1):
        mine, bufs, reqs = nxt
        last = step == P - 2
        if not last:
            nxt = post(step + 1)
            sends.append([])
        posted = 0
        for k, (x, b, q) in enumerate(zip(mine, bufs, reqs)):
            if on_piece_sent is not None:
                posted = report(step)
            comm.wait(q)
            if on_piece_sent is not None:
                posted = report(step)
            reduce_into(x, b, op)
            if not last:
                sends[step + 1].append(comm.isend(right, x, comm.slot(base, 0, step + 1, k)))
            elif on_final_piece is not None:
                on_final_piece(k, x)
        comm.wait_all(sends[step])  # issued one step ago: normally complete already
        if on_piece_sent is not None:
            for k in range(posted, len(sends[step])):
                on_piece_sent(step, k)


class AllGather:
    """Ring all-gather. Rank i provides ``segs[i]``; afterwards every rank has every segment.
    Segments are 1-D and may differ in length (all ranks must agree on the lengths).
    Receives can be posted step by step ahead of ``run`` (all_reduce does)."""

    def __init__(self, comm: Comm, segs: list[torch.Tensor]):
        self.comm, self.segs = comm, segs
        self.base = comm.block()
        self.pe = comm.piece_elems(segs[0], max(s.numel() for s in segs))
        self.recvs: list = []
        self.sends: list = []
        self._posted: dict[int, int] = {}  # step -> pieces whose receive is posted
        self._cut_step, self._cut = -1, []  # the pieces of the step being posted

    def post_piece(self, step: int, k: int) -> None:
        """Post the receive of piece k of step ``step`` (segment (r-step-1) from the left, in
        place). Steps in order, pieces in order within a step."""
        c = self.comm
        assert self._posted.get(step, 0) == k and (step == 0 or step - 1 in self._posted)
        x = self._pieces(step)[k]
        self.recvs.append((step, k, x, c.irecv((c.rank - 1) % c.size, x,
                                               c.slot(self.base, 0, step, k))))
        self._posted[step] = k + 1

    def _pieces(self, step: int) -> list[torch.Tensor]:
        if self._cut_step != step:
            c = self.comm
            self._cut_step, self._cut = step, pieces(self.segs[(c.rank - step - 1) % c.size], self.pe)
        return self._cut

    def post_step(self, step: int) -> None:
        """Post the receives of step ``step`` not posted yet."""
        for k in range(self._posted.get(step, 0), len(self._pieces(step))):
            self.post_piece(step, k)

    def send_own(self, k: int, x: torch.Tensor) -> None:
        """Send piece k of this rank's own segment now (step 0), before ``run``."""
        c = self.comm
        self.sends.append(c.isend((c.rank + 1) % c.size, x, c.slot(self.base, 0, 0, k)))

    def run(self) -> None:
        c = self.comm
        P, r = c.size, c.rank
        if P == 1:
            return
        for step in range(P - 1):
            self.post_step(step)
        right = (r + 1) % P
        own = pieces(self.segs[r], self.pe)
        for k in range(len(self.sends), len(own)):
            self.send_own(k, own[k])
        sends = self.sends
        for step, k, x, q in self.recvs:
            c.wait(q)
            if step < P - 2:  # forward at once what was received
                sends.append(c.isend(right, x, c.slot(self.base, 0, step + 1, k)))
        c.wait_all(sends)


def all_gather(comm: Comm, segs: list[torch.Tensor]) -> None:
    comm.algorithm = "ring"
    AllGather(comm, segs).run()


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    """Reduce-scatter then all-gather on a contiguous 1-D tensor, in place."""
    comm.algorithm = "ring"
    P = comm.size
    n = flat.numel()
    base, extra = divmod(n, P)
    segs, off = [], 0
    for i in range(P):
        k = base + (1 if i < extra else 0)
        segs.append(flat[off:off + k])
        off += k
    # All-gather step s receives into segment (r-s-1), the one reduce-scatter step s sent:
    # post each piece's receive as soon as that piece is sent, so that all-gather data finds
    # its receive posted (no staging copy). Each piece of this rank's segment goes out as soon as
    # it is reduced, so the all-gather overlaps the end of the reduce-scatter.
    ag = AllGather(comm, segs)
    reduce_scatter(comm, segs, op, on_piece_sent=ag.post_piece, on_final_piece=ag.send_own)
    ag.run()
