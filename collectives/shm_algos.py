"""Collectives of a group whose ranks share one host, straight on the group's shared segment.

No byte goes through a socket: each rank copies its contribution into its own slot of the
segment, the ranks wait for each other (one barrier per pipeline phase), and each reads what
it needs from the others' slots. all_reduce: every rank reduces a 1/P share of each chunk,
reading every rank's slot (rank order, so every rank gets the same bits), into the chunk's
result area, and every rank copies the whole result out. Phases overlap three chunks (copy in
chunk k, reduce chunk k-1, copy out chunk k-2), so the segment stays bounded
(transport.shm.BYTES_PER_RANK per rank, reused by every op). From CMA_BYTES an all_reduce may
instead read the peers' tensors directly with cross-memory attach (LINERATE_CMA, _cma_choice).

Synchronisation and agreement are the engine's (transport/shm/engine.py): each rank publishes
a tick after each phase and waits until every rank (or those it reads) published it; a rank in
an op with other arguments than its peers' is named on every rank, never run. The algorithms
here say what each phase copies and folds, between those publishes and waits.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
import types

import numpy as np
import torch

from linerate.transport import MismatchError
from linerate.transport.shm.sync import cma_read
from linerate.transport.shm.engine import (CMA_ADDR, CMA_NONCE, CMA_OK, CMA_PTR, CMA_TIMES,
                                          Engine, to_signed, to_unsigned)

from .comm import Comm
from .reduce_ops import NP_DTYPES, RedOpType, finish_avg, fold_rows, fold_rows_into
from .views import address_view, np_view

#: An all_reduce from this many bytes may read the peers' tensors with cross-memory attach
#: (process_vm_readv) where every rank may: one copy per byte moved, no staging in the segment.
#: Neither path wins everywhere: the copies through the segment are faster while the last-level
#: cache is the ranks' own, CMA while other work contends for it (the segment's chunks fall out
#: of the cache; CMA streams from memory either way), and that changes while a job runs. So
#: LINERATE_CMA=auto tries both and keeps taking the one that measured faster (_cma_choice).
CMA_BYTES = 1 << 20
#: LINERATE_CMA=auto: the first CMA_EXPLORE large all_reduces try the paths in the order
#: CMA_TRIAL (True: CMA; the first of each is not counted: it pays the page faults of fresh
#: buffers): CMA's ops over by the third op, op 5 the first that both paths' counted times
#: reach (each rank publishes op m's times in slot m % 2, read at op m + 2): the trials of the
#: slower path are over within the first few ops instead of spreading into the ops after a
#: caller's warm-up. Then every CMA_RETRY-th takes the path that measured
#: slower, so that a change of conditions is seen. A path's time is the best of its last
#: CMA_KEEP times per byte (noise only ever adds time).
CMA_TRIAL = (False, True, True, False, False)
CMA_EXPLORE = len(CMA_TRIAL)
CMA_RETRY = 16
CMA_KEEP = 3
#: The pieces that a rank reduces its share in (each peer's piece is read into a scratch
#: buffer that stays in cache, then folded); 1 MiB does better than 256 KiB or 4 MiB.
CMA_PIECE = 1 << 20
#: all_reduce up to this many bytes: every rank folds all contributions (one barrier).
SMALL_BYTES = 64 << 10
_ALIGN = 64

log = logging.getLogger("linerate.collectives")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_NP = NP_DTYPES
_BINARY = {RedOpType.SUM: torch.add, RedOpType.AVG: torch.add, RedOpType.PRODUCT: torch.mul,
           RedOpType.MIN: torch.minimum, RedOpType.MAX: torch.maximum}
#: torch runs an elementwise op on its intra-op threads from this many elements on; the
#: float16/bfloat16 folds stay below it (where ranks outnumber cores, OpenMP's spinning threads
#: would cost a large share of a big all_reduce's CPU time).
_GRAIN = 32768


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous tensors of the same size: glibc's memmove, one thread,
    without the GIL (torch's copy_ would start its intra-op threads for large ones)."""
    n = src.numel() * src.element_size()
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _fold(out: torch.Tensor, srcs: list[torch.Tensor], op) -> None:
    """out = ((srcs[0] op srcs[1]) op srcs[2]) ...: rank order, as collectives.direct folds.
    NumPy's loops where NumPy has the dtype (one thread, without the GIL; IEEE operations as
    torch's, so the bits are the same), torch's below its threading grain otherwise."""
    if len(srcs) == 1:
        _copy(out, srcs[0])
        return
    npdt = _NP.get(out.dtype)
    if npdt is not None:
        fold_rows(out, [np_view(s, npdt) for s in srcs], op, npdt)  # caller's: not .numpy()
        return
    f = _BINARY[op]  # float16, bfloat16 (floating point: no bitwise ops)
    n = out.numel()
    for lo in range(0, n, _GRAIN):
        hi = min(n, lo + _GRAIN)
        d = out[lo:hi]
        f(srcs[0][lo:hi], srcs[1][lo:hi], out=d)
        for x in srcs[2:]:
            f(d, x[lo:hi], out=d)


def _fold_slots(E: Engine, out: torch.Tensor, b: int, off: int, op, own=None) -> None:
    """_fold into ``out`` of its ``numel()`` elements at byte ``off`` of every rank's slot
    of set ``b``, in rank order; ``own``: this rank's row from this tensor instead of its
    slot. Where NumPy has the dtype, the slots are the rows of one strided array over the
    segment: no tensor view and NumPy view per slot (at 16 ranks those were most of a
    small reduce_scatter's CPU)."""
    P, dt, n = E.P, out.dtype, out.numel()
    npdt = _NP.get(dt)
    if npdt is None:  # torch's loops, on the rows of one strided view
        rows = E.rows(b, off, n, dt).unbind(0)
        if own is not None:
            rows = list(rows)
            rows[E.r] = own
        _fold(out, rows, op)
        return
    rows = np.ndarray((P, n), dtype=npdt, buffer=E.np_data, offset=E.S(b, 0) * E.C + off,
                      strides=(E.C, out.element_size()))
    if own is not None:
        rows = list(rows)
        rows[E.r] = np_view(own, npdt)
    fold_rows(out, rows, op, npdt)


# ---------------------------------------------------------------------------- algorithms
def _engine(comm: Comm) -> Engine:
    e = comm.shm
    e.begin(comm)
    comm.algorithm = "shm"
    return e


def _chunks(n: int, per: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of at most ``per`` elements; one (0, 0) if n is 0."""
    if n == 0:
        return [(0, 0)]
    return [(o, min(per, n - o)) for o in range(0, n, per)]


def _share(n: int, P: int, q: int) -> tuple[int, int]:
    """Rank q's part [lo, hi) of n elements (cache-line sized multiples; may be empty)."""
    m = -(-n // P)
    m = -(-m // 16) * 16
    lo = min(n, q * m)
    return lo, min(n, lo + m)


def all_reduce(comm: Comm, flat: torch.Tensor, op) -> None:
    E = _engine(comm)
    P, r = E.P, E.r
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    if n * es <= min(SMALL_BYTES, E.C):
        b = E.next_set()
        E.wait_free(E.S(b, r))
        _copy(E.view(E.S(b, r), dt, n, es), flat)
        E.publish()
        E.wait(E.tick)
        areas = [E.S(b, q) for q in range(P)]
        _fold_slots(E, flat, b, 0, op)
        E.publish(areas)
        E.tx_all += n * es  # every peer folds this rank's slot; it folds every peer's
        E.rx_all += n * es
        E.wrote += n * es
        return
    if n * es >= CMA_BYTES and P > 1:
        if E.cma is None:
            E.cma = _cma_probe(E)
        if E.cma != "off":
            m = E.big
            E.big += 1
            use = E.cma == "on" or _cma_choice(E, m)
            t0 = time.perf_counter()
            if use:
                _all_reduce_cma(E, flat, op)
            else:
                _all_reduce_segment(E, flat, op)
            _cma_note(E, m, use, (time.perf_counter() - t0) / (n * es))
            return
        E.big_paths[1] += 1
    _all_reduce_segment(E, flat, op)


def _count_shares(E: Engine, n: int, es: int, mine: int) -> None:
    """Bytes moved by an all_reduce of ``n`` elements of ``es`` bytes reduced in shares
    (``_share``; ``mine``: this rank's share's length): with each peer q this rank sends q's
    share of its input (q folds it) and its own share of the result (q copies it out), and
    receives the same: q's share of the result and this rank's share of q's input."""
    tx, rx, P, r = E.tx, E.rx, E.P, E.r
    for q in range(P):
        if q != r:
            lo, hi = _share(n, P, q)
            d = (hi - lo + mine) * es
            tx[q] += d
            rx[q] += d


def _all_reduce_segment(E: Engine, flat: torch.Tensor, op) -> None:
    """Chunks through the segment: copy in, each rank folds its share, copy out (pipelined)."""
    P, r = E.P, E.r
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    chunks = _chunks(n, E.C // es)
    nch = len(chunks)
    sets = [E.next_set() for _ in chunks]
    for ph in range(nch + 2):
        reads = []
        i = ph - 2  # copy the result of chunk i out
        if i >= 0:
            o, ln = chunks[i]
            _copy(flat[o:o + ln], E.view(E.R(sets[i]), dt, ln, es))
            reads.append(E.R(sets[i]))
        i = ph - 1  # reduce this rank's share of chunk i
        if 0 <= i < nch:
            o, ln = chunks[i]
            b = sets[i]
            lo, hi = _share(ln, P, r)
            E.wait_free(E.R(b))
            if hi > lo:
                _fold_slots(E, E.view(E.R(b), dt, ln, es)[lo:hi], b, lo * es, op,
                            own=flat[o + lo:o + hi])
            reads += [E.S(b, q) for q in range(P)]
            _count_shares(E, ln, es, hi - lo)
            E.wrote += ln * es  # its slot but its own share, and its share of the result
        i = ph  # copy chunk i in, but for this rank's own share (folded from flat)
        if i < nch:
            o, ln = chunks[i]
            a = E.S(sets[i], r)
            lo, hi = _share(ln, P, r)
            E.wait_free(a)
            slot = E.view(a, dt, ln, es)
            _copy(slot[:lo], flat[o:o + lo])
            _copy(slot[hi:], flat[o + hi:o + ln])
        E.publish(reads)
        if ph < nch + 1:
            E.wait(E.tick)


def _cma_probe(E: Engine) -> str:
    """Whether every rank of the segment allows cross-memory attach (LINERATE_CMA not 0) and
    can read every other's memory with it, agreed by all: "off", "on" (every rank has 1) or
    "tuned" (asked once, in the first large all_reduce; two barriers; every rank asks,
    whatever its setting, so that all run the same ticks). Each
    rank publishes the address of a private word holding a fresh nonce (the nonce itself goes
    in its control row) and reads every peer's: the read must succeed and find that nonce,
    which also proves the pid is the process that holds the segment. Containers without
    CAP_SYS_PTRACE, Yama's ptrace_scope of 1 or more between siblings, or a seccomp filter
    forbid it: then the copies go through the segment."""
    r, P, ctrl = E.r, E.P, E.ctrl
    nonce = int.from_bytes(os.urandom(8), "little") >> 1 or 1
    word = np.array([nonce], dtype=np.int64)  # private memory, alive until the 2nd barrier
    ctrl[r, CMA_NONCE] = nonce
    allowed = E.cma_setting != "0"
    ctrl[r, CMA_ADDR] = word.ctypes.data if allowed else 0
    E.publish()
    E.wait(E.tick)
    ok, why = allowed, "LINERATE_CMA=0"
    got = np.zeros(1, dtype=np.int64)
    for q in range(P):
        if not ok or q == r:
            continue
        addr = int(ctrl[q, CMA_ADDR])
        if addr == 0:
            ok, why = False, f"rank {E.gr[q]} has LINERATE_CMA=0"
        elif not E.seg.watchable_pid(q):
            ok, why = False, f"rank {E.gr[q]} runs in another pid namespace"
        else:
            try:
                cma_read(E.seg.pid(q), got.ctypes.data, addr, 8)
                if int(got[0]) != int(ctrl[q, CMA_NONCE]):
                    ok, why = False, f"process {E.seg.pid(q)} is not rank {E.gr[q]}"
            except OSError as e:
                ok, why = False, str(e)
    ctrl[r, CMA_OK] = (3 if E.cma_setting == "1" else 1) if ok else 2
    E.publish()
    E.wait(E.tick)
    verdicts = {int(ctrl[q, CMA_OK]) for q in range(P)}
    agreed = "off" if 2 in verdicts else "on" if verdicts == {3} else "tuned"
    del word
    if not ok and allowed:
        log.info("rank %d: no cross-memory attach between the ranks of this host (%s): large "
                 "all_reduces copy through the shared segment", E.me, why)
    elif ok and agreed == "off":
        log.info("rank %d: another rank of this host cannot use cross-memory attach: large "
                 "all_reduces copy through the shared segment", E.me)
    return agreed


def _cma_choice(E: Engine, m: int) -> bool:
    """LINERATE_CMA=auto: whether the m-th large all_reduce of this engine reads by
    cross-memory attach. The same answer on every rank: it depends on m and on the times every
    rank published after its op m-2 (in slot m % 2; each rank wrote it before its first tick
    of op m-1, which every rank waited for, and will write it again only after op m, which
    needs this rank's ticks of op m); the path whose time per byte summed over the ranks is
    lower wins, every CMA_RETRY-th op the other one."""
    if m < CMA_EXPLORE:
        return CMA_TRIAL[m]
    slot = CMA_TIMES + 2 * (m % 2)
    cma, seg = E.ctrl[:, slot], E.ctrl[:, slot + 1]
    if not cma.all() or not seg.all():  # a path without a time on some rank: measure it
        return not cma.all()
    faster = int(cma.sum()) < int(seg.sum())
    return (not faster) if m % CMA_RETRY == 0 else faster


def _cma_note(E: Engine, m: int, used_cma: bool, per_byte: float) -> None:
    """Keep this op's time per byte for its path (not the path's first: warm-up); publish
    each path's best of its last CMA_KEEP in slot m % 2 (0: none yet)."""
    i = 0 if used_cma else 1
    E.big_paths[i] += 1
    if E.big_paths[i] > 1:
        kept = E.times[i]
        kept.append(per_byte)
        del kept[:-CMA_KEEP]
    if E.ctrl is not None:
        slot = CMA_TIMES + 2 * (m % 2)
        for j in (0, 1):
            E.ctrl[E.r, slot + j] = int(min(E.times[j]) * 1e12) if E.times[j] else 0


def _all_reduce_cma(E: Engine, flat: torch.Tensor, op) -> None:
    """all_reduce by cross-memory attach: each rank publishes its tensor's address; after a
    barrier it reduces its 1/P share (rank order, pieces of CMA_PIECE) reading every peer's
    piece straight from the peer's tensor into a cache-sized scratch buffer, writing the result
    into its own tensor; after a second barrier it reads every other share's result from its
    owner's tensor into its own; a third keeps every tensor alive until no one reads it. Per
    byte: about 2.5 bytes of memory traffic at 2 ranks (the copies through the segment: 5.5).
    Every rank's result is the bytes its owner computed: the same bits everywhere."""
    P, r, ctrl, comm = E.P, E.r, E.ctrl, E.comm
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    base = flat.data_ptr()
    ctrl[r, CMA_PTR] = base
    E.publish()
    E.wait(E.tick)  # every rank is in this op, its tensor in place and its address known
    pids = [E.seg.pid(q) for q in range(P)]
    ptrs = [int(ctrl[q, CMA_PTR]) for q in range(P)]

    def read(q: int, local: int, off: int, nbytes: int) -> None:
        try:
            cma_read(pids[q], local, ptrs[q] + off, nbytes)
        except OSError as e:
            # ESRCH, EFAULT: rank q is gone, or left this op; where it (or another rank)
            # recorded that it failed because of another rank, that rank is named.
            ctx = comm.ctx
            err = ctx.lost(E.gr[q], f"rank {E.me}: {comm.desc}: reading rank {E.gr[q]}'s "
                                    f"tensor (process {pids[q]}, cross-memory attach) failed: "
                                    f"{e}{ctx.where()}", f"rank {E.me}: {comm.desc}")
            ctx.report_error(str(err), err.root)
            raise err from None

    lo, hi = _share(n, P, r)
    if hi > lo:
        k = max(1, CMA_PIECE // es)
        if E.cma_scratch is None or E.cma_scratch.numel() < P * CMA_PIECE:
            E.cma_scratch = torch.empty(P * CMA_PIECE + 64, dtype=torch.uint8)
        sbase = -(-E.cma_scratch.data_ptr() // 64) * 64 - E.cma_scratch.data_ptr()
        scratch = [E.cma_scratch[sbase + q * CMA_PIECE:sbase + (q + 1) * CMA_PIECE]
                   for q in range(P)]
        for o in range(lo, hi, k):
            ln = min(k, hi - o)
            mine = flat[o:o + ln]
            srcs = []
            for q in range(P):
                if q == r:
                    if r >= 2:  # the fold writes its first result over mine before reading it
                        s = scratch[q][:ln * es].view(dt)
                        _copy(s, mine)
                        srcs.append(s)
                    else:
                        srcs.append(mine)
                else:
                    s = scratch[q][:ln * es].view(dt)
                    read(q, s.data_ptr(), o * es, ln * es)
                    srcs.append(s)
            _fold(mine, srcs, op)
    E.publish()
    E.wait(E.tick)  # every share is reduced; no one reads an input any more
    for q in range(P):
        if q != r:
            qlo, qhi = _share(n, P, q)
            if qhi > qlo:
                read(q, base + qlo * es, qlo * es, (qhi - qlo) * es)
    _count_shares(E, n, es, hi - lo)
    E.wrote += (hi - lo) * es  # its share of the result, in its tensor (the input: not written)
    E.publish()
    E.wait(E.tick)  # no one reads this rank's tensor any more


def reduce(comm: Comm, flat: torch.Tensor, op, root: int) -> None:
    E = _engine(comm)
    P, r = E.P, E.r
    n, es, dt = flat.numel(), flat.element_size(), flat.dtype
    if n * es <= min(SMALL_BYTES, E.C):
        b = E.next_set()
        E.wait_free(E.S(b, r))
        _copy(E.view(E.S(b, r), dt, n, es), flat)
        E.publish()
        areas = [E.S(b, q) for q in range(P)]
        if r == root:
            E.wait(E.tick)
            _fold_slots(E, flat, b, 0, op)
            E.rx_all += n * es
        else:
            E.tx[root] += n * es
            E.wrote += n * es
        E.publish(areas)
        return
    chunks = _chunks(n, E.C // es)
    nch = len(chunks)
    sets = [E.next_set() for _ in chunks]
    for ph in range(nch + 2):
        reads = []
        i = ph - 2
        if i >= 0:
            if r == root:
                o, ln = chunks[i]
                _copy(flat[o:o + ln], E.view(E.R(sets[i]), dt, ln, es))
            reads.append(E.R(sets[i]))
        i = ph - 1
        if 0 <= i < nch:
            o, ln = chunks[i]
            b = sets[i]
            lo, hi = _share(ln, P, r)
            E.wait_free(E.R(b))
            if hi > lo:
                _fold_slots(E, E.view(E.R(b), dt, ln, es)[lo:hi], b, lo * es, op)
            reads += [E.S(b, q) for q in range(P)]
            # every rank folds its share of every slot; the root copies every share out
            for q in range(P):
                if q != r:
                    qlo, qhi = _share(ln, P, q)
                    E.tx[q] += (qhi - qlo) * es
                    E.rx[q] += (hi - lo + (qhi - qlo if r == root else 0)) * es
            if r != root:
                E.tx[root] += (hi - lo) * es
            # its slot but its own share (every share of it has one reader), its share of the
            # result where the root reads it
            E.wrote += (ln - (hi - lo) if r == root else ln) * es
        i = ph
        if i < nch:
            o, ln = chunks[i]
            a = E.S(sets[i], r)
            E.wait_free(a)
            _copy(E.view(a, dt, ln, es), flat[o:o + ln])
        E.publish(reads)
        if ph < nch:
            E.wait(E.tick)
        elif ph == nch and r == root:
            E.wait(E.tick)


def broadcast(comm: Comm, t: torch.Tensor, root: int) -> None:
    """Chunk k: the root writes it into one of its two slots and publishes; every other rank
    waits for that, copies it out and publishes. One tick per chunk on every rank: the slot is
    free again once every rank has published it."""
    E = _engine(comm)
    r = E.r
    data = _bytes(t)
    if r == root:  # every other rank reads all of it, written once
        E.tx_all += data.numel()
        E.wrote += data.numel()
    else:
        E.rx[root] += data.numel()
    for o, ln in _chunks(data.numel(), E.C):
        a = E.S(E.next_set(), root)
        if r == root:
            E.wait_free(a)
            _copy(E.areas[a][:ln], data[o:o + ln])
        else:
            E.wait(E.tick + 1, [root])
            _copy(data[o:o + ln], E.areas[a][:ln])
        E.publish([a])


def all_gather(comm: Comm, segs: list[torch.Tensor]) -> None:
    """segs[q] receives rank q's contribution; segs[me] already holds this rank's."""
    _gather_impl(comm, [_bytes(s) for s in segs], None)


def gather(comm: Comm, t: torch.Tensor, outs: list[torch.Tensor] | None, root: int) -> None:
    if comm.rank == root:
        _copy(outs[root], t)
        segs = [_bytes(o) for o in outs]
    else:
        segs = [None] * comm.size
        segs[comm.rank] = _bytes(t)
    _gather_impl(comm, segs, root)


def _gather_impl(comm: Comm, segs: list, root: int | None) -> None:
    E = _engine(comm)
    P, r = E.P, E.r
    mine = segs[r]
    chunks = _chunks(mine.numel(), E.C)
    nch = len(chunks)
    sets = [E.next_set() for _ in chunks]
    reader = root is None or r == root
    # (all contributions have this rank's length: the reads below take it for every rank's)
    if root is None:  # every peer (the root) reads all of this rank's
        E.tx_all += mine.numel()
    elif r != root:
        E.tx[root] += mine.numel()
    if root is None or r != root:  # (the root's own slot has no other reader)
        E.wrote += mine.numel()
    if reader:
        E.rx_all += mine.numel()
    # By address (segs are contiguous bytes): no tensor slices per peer and chunk.
    move, addr = ctypes.memmove, E.addr
    ptrs = [0 if x is None else x.data_ptr() for x in segs] if reader else None
    for ph in range(nch + 1):
        reads = []
        i = ph - 1
        if i >= 0:
            o, ln = chunks[i]
            b = sets[i]
            if reader and ln:
                for q in range(P):
                    if q != r:
                        move(ptrs[q] + o, addr[E.S(b, q)], ln)
            reads = [E.S(b, q) for q in range(P)]
        if ph < nch:
            o, ln = chunks[ph]
            a = E.S(sets[ph], r)
            E.wait_free(a)
            if ln:
                move(addr[a], mine.data_ptr() + o, ln)
        E.publish(reads)
        if ph < nch and reader:
            E.wait(E.tick)


def scatter(comm: Comm, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
    """As broadcast, with the root's slot cut into one block per rank."""
    E = _engine(comm)
    P, r = E.P, E.r
    mine = _bytes(out)
    srcs = [_bytes(x) for x in ins] if r == root else None
    if r == root:
        _copy(mine, srcs[root])
        E.tx_all += mine.numel()  # a block of the out's size for every other rank
        E.wrote += mine.numel() * (P - 1)
    else:
        E.rx[root] += mine.numel()
    B = (E.C // P) // _ALIGN * _ALIGN
    move = ctypes.memmove  # by address (contiguous bytes): no tensor slices per rank
    ptrs = [x.data_ptr() for x in srcs] if r == root else None
    for o, ln in _chunks(mine.numel(), B):
        a = E.S(E.next_set(), root)
        base = E.addr[a]
        if r == root:
            E.wait_free(a)
            if ln:
                for q in range(P):
                    if q != root:
                        move(base + q * B, ptrs[q] + o, ln)
        else:
            E.wait(E.tick + 1, [root])
            if ln:
                move(mine.data_ptr() + o, base + r * B, ln)
        E.publish([a])


def reduce_scatter(comm: Comm, segs: list[torch.Tensor], out: torch.Tensor, op) -> None:
    """Rank q gets the reduction of every rank's segs[q] in ``out`` (segs are read only)."""
    reduce_scatter_v(comm, segs, [out.numel()] * comm.size, out, op)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Cat:
    """Byte ranges of several contiguous tensors read or written as one (the two-level
    algorithms' shares: one column from each host, scattered in the caller's tensors)."""

    def __init__(self, parts):
        self.parts = [(t.data_ptr(), t.numel() * t.element_size()) for t in parts]
        self.nbytes = sum(n for _, n in self.parts)

    def _spans(self, off: int, ln: int):
        for addr, n in self.parts:
            if ln <= 0:
                return
            if off >= n:
                off -= n
                continue
            k = min(n - off, ln)
            yield addr + off, k
            off, ln = 0, ln - k

    def read(self, dst: int, off: int, ln: int) -> None:
        """Bytes [off, off + ln) of the concatenation to address ``dst``."""
        for addr, k in self._spans(off, ln):
            ctypes.memmove(dst, addr, k)
            dst += k

    def write(self, src: int, off: int, ln: int) -> None:
        """``ln`` bytes at address ``src`` into bytes [off, off + ln) of the concatenation."""
        for addr, k in self._spans(off, ln):
            ctypes.memmove(addr, src, k)
            src += k


def _cat(x) -> Cat:
    return x if isinstance(x, Cat) else Cat([x])


def reduce_scatter_v(comm: Comm, srcs: list, lens: list[int], out: torch.Tensor, op) -> None:
    """Rank q gets the reduction of every rank's ``srcs[q]`` (a tensor or a Cat of
    ``lens[q]`` elements of out's dtype; read only) in ``out`` (``lens[me]`` elements); ``lens``
    are the same on every rank and may differ from rank to rank. Rank order everywhere."""
    E = _engine(comm)
    P, r = E.P, E.r
    es, dt = out.element_size(), out.dtype
    # This rank's own share folds straight from its tensor, not staged in its slot (one copy
    # of 1/P of its input less), unless it overlaps ``out`` where the fold would overwrite
    # it before reading it (ranks from 2 on: the first fold writes out).
    own = srcs[r]
    if not (isinstance(own, torch.Tensor) and own.is_contiguous() and own.dtype == dt
            and own.numel() == lens[r]) or (r >= 2 and _overlap(own, out)):
        own = None
    else:
        own = own.view(-1)
    srcs = [_cat(x) for x in srcs]
    m = max(1, (E.C // P) // es // 16 * 16)  # elements per rank's sub-block
    nch = max(1, max(-(-ln // m) for ln in lens))  # the same on every rank
    sets = [E.next_set() for _ in range(nch)]
    # rank q folds its block of every rank's slot; this rank folds its block of every peer's
    E.rx_all += lens[r] * es
    for q in range(P):
        if q != r:
            E.tx[q] += lens[q] * es
            E.wrote += lens[q] * es
    for ph in range(nch + 1):
        reads = []
        i = ph - 1
        if i >= 0:
            o = i * m
            ln = max(0, min(m, lens[r] - o))
            b = sets[i]
            if ln:
                _fold_slots(E, out[o:o + ln], b, r * m * es, op,
                            own=None if own is None else own[o:o + ln])
            reads = [E.S(b, q) for q in range(P)]
        if ph < nch:
            o = ph * m
            a = E.S(sets[ph], r)
            E.wait_free(a)
            base = E.addr[a]
            for q in range(P):
                ln = max(0, min(m, lens[q] - o))
                if ln and (q != r or own is None):
                    srcs[q].read(base + q * m * es, o * es, ln * es)
        E.publish(reads)
        if ph < nch:
            E.wait(E.tick)


def gather_v(comm: Comm, segs: list, root: int | None = None) -> None:
    """``segs[q]`` (a Cat or tensor; its byte length the same on every rank, may differ from
    rank to rank) receives rank q's ``segs[q]`` on every rank (``root`` None) or on the root;
    ``segs[me]`` holds this rank's contribution."""
    E = _engine(comm)
    P, r = E.P, E.r
    segs = [_cat(x) for x in segs]
    lens = [s.nbytes for s in segs]
    C = E.C
    nch = max(1, max(-(-ln // C) for ln in lens))
    sets = [E.next_set() for _ in range(nch)]
    reader = root is None or r == root
    if root is None:  # every peer (the root) reads all of this rank's
        E.tx_all += lens[r]
    elif r != root:
        E.tx[root] += lens[r]
    if root is None or r != root:
        E.wrote += lens[r]
    if reader:
        for q in range(P):
            if q != r:
                E.rx[q] += lens[q]
    for ph in range(nch + 1):
        reads = []
        i = ph - 1
        if i >= 0:
            o = i * C
            b = sets[i]
            if reader:
                for q in range(P):
                    ln = min(C, lens[q] - o)
                    if q != r and ln > 0:
                        segs[q].write(E.addr[E.S(b, q)], o, ln)
            reads = [E.S(b, q) for q in range(P)]
        if ph < nch:
            o = ph * C
            a = E.S(sets[ph], r)
            ln = min(C, lens[r] - o)
            E.wait_free(a)
            if ln > 0:
                segs[r].read(E.addr[a], o, ln)
        E.publish(reads)
        if ph < nch and reader:
            E.wait(E.tick)


def all_to_all(comm: Comm, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """outs[q] receives rank q's ins[me] (any sizes; each rank's are checked against what the
    senders announce). Copies by address (memmove), no tensor views: this op is mostly Python
    overhead at small sizes."""
    E = _engine(comm)
    P, r = E.P, E.r
    move = ctypes.memmove
    src = [(x.data_ptr(), x.numel() * x.element_size()) for x in ins]
    dst = [(x.data_ptr(), x.numel() * x.element_size()) for x in outs]
    # The slots of phase 0 carry, after the P blocks, each rank's step count and the bytes it
    # sends to / expects from every rank (in the slot: a rank that finished this op may
    # already reuse its control row).
    B = ((E.C - 8 * (2 * P + 1)) // P) // _ALIGN * _ALIGN
    steps = max([1] + [-(-n // B) for _, n in src + dst])
    meta = [steps] + [n for _, n in src] + [n for _, n in dst]
    if src[r][1]:
        move(dst[r][0], src[r][0], src[r][1])
    tx, rx = E.tx, E.rx
    for q in range(P):
        if q != r:
            tx[q] += src[q][1]
            rx[q] += dst[q][1]
            E.wrote += src[q][1]
    ph = 0
    total = None
    sets: list = []
    while True:
        reads = []
        i = ph - 1
        if i >= 0:
            b = sets[i]
            o = i * B
            for q in range(P):
                ln = min(B, dst[q][1] - o)
                if q != r and ln > 0:
                    move(dst[q][0] + o, E.addr[E.S(b, q)] + r * B, ln)
            reads = [E.S(b, q) for q in range(P)]
        if total is None or ph < total:
            b = E.next_set()
            sets.append(b)
            a = E.S(b, r)
            E.wait_free(a)
            base = E.addr[a]
            if ph == 0:
                w0 = (a * E.C + P * B) >> 3
                E.words[w0:w0 + len(meta)] = meta
            o = ph * B
            for q in range(P):
                ln = min(B, src[q][1] - o)
                if q != r and ln > 0:
                    move(base + q * B, src[q][0] + o, ln)
        E.publish(reads)
        if total is not None and ph >= total:
            break
        E.wait(E.tick)
        if total is None:
            # every rank's (its slot of phase 0's set) as the rows of one array
            metas = np.ndarray((P, len(meta)), dtype=np.int64, buffer=E.np_data,
                               offset=E.S(sets[0], 0) * E.C + P * B, strides=(E.C, 8)).tolist()
            total = max(m[0] for m in metas)
            for q in range(P):  # both ways: every rank involved names the mismatch
                for a, b in ((q, r), (r, q)):
                    sent, want = metas[a][1 + b], metas[b][1 + P + a]
                    if q != r and sent != want:
                        msg = (f"rank {r}: in all_to_all #{comm.seq} rank {a} sends {sent} bytes "
                               f"to rank {b}, which expects {want} bytes from it: the ranks "
                               f"passed other split sizes{comm.ctx.where()}")
                        comm.ctx.report_error(msg)
                        raise MismatchError(msg)
        ph += 1


def barrier(comm: Comm) -> None:
    E = _engine(comm)
    E.publish()
    E.wait(E.tick)


def agree(comm: Comm, entries: list, offered: int, carry_bytes: int,
          avg_size: int | None = None) -> tuple[int, bool]:
    """collectives.fusion.agree on the segment: (the number of entries every rank fuses, the
    least offered; whether the head entry is already reduced). Each rank publishes its count
    and the running digest of its calls; a head entry of at most ``carry_bytes`` goes along and
    is folded here in rank order (an AVG head divided by ``avg_size``, default the ranks here;
    0: not divided). Raises ValueError naming the calls when they differ."""
    from .fusion import compare_digests
    E = _engine(comm)
    P, r = E.P, E.r
    head = entries[0]
    carry = head.nbytes <= min(carry_bytes, E.C - 64)  # the same on every rank for the same call
    # In the slot (not the control row, which a rank that finished this op may already reuse):
    # count and digest in its first 16 bytes, the head entry's bytes from byte 64.
    b = E.next_set()
    mine = E.S(b, r)
    E.wait_free(mine)
    words, step = E.words, E.C // 8
    words[mine * step] = offered
    words[mine * step + 1] = to_signed(entries[offered - 1].chain)
    flat = head.buf.view(-1)
    n, es = flat.numel(), flat.element_size()
    if carry and n:
        ctypes.memmove(E.addr[mine] + 64, flat.data_ptr(), n * es)
        E.tx_all += n * es  # every rank folds every rank's carried entry
        E.rx_all += n * es
        E.wrote += n * es
    E.publish()
    E.wait(E.tick)
    # Every rank's count and digest in two NumPy reads (a tensor view per rank would be most
    # of a small all_reduce's CPU on many ranks).
    first = E.S(b, 0) * step
    cs = words[first:first + P * step:step].tolist()
    ds = words[first + 1:first + 1 + P * step:step].tolist()
    for q in range(P):
        if q != r and cs[q] < 1:
            raise ValueError(f"rank {E.me}: fused all_reduce #{comm.seq}: rank {E.gr[q]} offered "
                             f"{cs[q]} calls")
    k = min(cs)
    compare_digests(entries, k,
                    {q: to_unsigned(ds[q]) for q in range(P) if q != r and cs[q] == k},
                    lambda q: E.gr[q], E.me)
    areas = [E.S(b, q) for q in range(P)]
    if carry:
        _fold_slots(E, flat, b, 64, head.op)  # every rank's carried entry, from byte 64
        if avg_size != 0:
            finish_avg(flat, head.op, P if avg_size is None else avg_size)
    E.publish(areas)
    return k, carry


def lone_all_reduce(comm: Comm, chain: int, t: torch.Tensor, op, desc: str) -> None:
    """agree() of a rank that offers one call, its entry carried (the same words in the same
    slot: peers that offered more fuse this one call with it), for a synchronous all_reduce of
    at most agree's carry bytes with nothing queued: the least Python that keeps its checks.
    ``chain``: the running digest after this call (fusion.chain_digest), ``desc`` the call's
    text (for a mismatch's error); ``t``, a contiguous CPU tensor, is reduced in place (an AVG
    is divided here), folded as agree() folds (the same bits on every rank, whichever of the
    two it ran). What a job repeats is cached: the rows' views per set, dtype and size, and
    the result's NumPy view (views.address_view)."""
    E = comm.shm
    E.begin(comm)
    P, r, C = E.P, E.r, E.C
    b = E.next_set()
    mine = E.S(b, r)
    if E.free[mine]:
        E.wait_free(mine)
    words, step = E.words, C >> 3
    w0 = mine * step
    words[w0] = 1
    signed = to_signed(chain)
    words[w0 + 1] = signed
    n = t.numel()
    dt = t.dtype
    ptr = t.data_ptr()
    nb = n * t.element_size()
    key = (b, dt, n)
    rows = E.lone_rows.get(key)
    if rows is None:  # agree()'s rows, as arrays (NumPy's dtypes) or tensor views
        if len(E.lone_rows) > 64:
            E.lone_rows.clear()
        npdt = _NP.get(dt)
        rows = E.lone_rows[key] = (
            (npdt, list(np.ndarray((P, n), dtype=npdt, buffer=E.np_data, offset=b * P * C + 64,
                                   strides=(C, nb // n))))  # (n > 0 here)
            if npdt is not None and n else
            (None, [E.areas[b * P + q][64:64 + nb].view(dt) for q in range(P)]))
    npdt, rows = rows
    if npdt is not None:
        o = address_view(ptr, npdt, n)  # the tensor, as the result's view
        rows[r][...] = o  # into this rank's slot (a plain copy: the same dtype)
    elif nb:
        ctypes.memmove(E.addr[mine] + 64, ptr, nb)
    E.tx_all += nb
    E.rx_all += nb
    E.wrote += nb
    E.publish()
    E.wait(E.tick)
    first = b * P * step
    cs = words[first:first + P * step:step].tolist()
    bad = {}
    for q in range(P):
        if q != r:
            c = cs[q]
            if c == 1:  # peers that offered more fuse just this call: compared next time
                d = int(words[first + q * step + 1])
                if d != signed:
                    bad[q] = to_unsigned(d)
            elif c < 1:
                raise ValueError(f"rank {E.me}: fused all_reduce #{comm.seq}: rank {E.gr[q]} "
                                 f"offered {c} calls")
    if bad:
        from .fusion import compare_digests
        head = types.SimpleNamespace(seq=comm.seq, chain=chain, desc=desc)
        compare_digests([head], 1, bad, lambda q: E.gr[q], E.me)
    if npdt is not None:
        fold_rows_into(o, rows, op, npdt)
        if op == RedOpType.AVG:
            finish_avg(t.detach().view(-1), op, P)
    else:
        flat = t.detach().view(-1)
        _fold(flat, rows, op)
        finish_avg(flat, op, P)
    E.publish(range(b * P, b * P + P))

