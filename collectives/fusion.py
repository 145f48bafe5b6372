"""Tensor fusion: small async all_reduces issued back to back run as one fused all_reduce.

Like Horovod's fusion buffer, with Horovod's coordinator replaced by a one-round agreement:

* Every ``all_reduce`` of one tensor of at most ``LINERATE_FUSION_BYTES`` is queued as an
  *entry* instead of an op, synchronous or not: whether a call fuses must not depend on
  anything that may differ between ranks (one rank may wait at once where another does not).
  Entries and ordinary ops keep one order on the group's worker, so a fused all_reduce never overtakes an earlier op
  nor is overtaken by a later one.
* When an entry reaches the head of the queue, the worker takes the longest run of entries
  behind it with the same reduce op, up to ``LINERATE_FUSION_BYTES`` in all. If the run is
  closed (an ordinary op follows, or the buffer is full) it goes at once; if more entries may
  still come, it waits up to ``LINERATE_CYCLE_MS`` after the head entry was queued, or until
  someone waits on one of their Works.
* Ranks see entries at different times, so they agree on how many to fuse: each sends the
  others its count ``c`` and a running digest of every fusable call so far (sequence number,
  dtype, size, op); all take ``k = min(c)``. The ranks whose ``c`` is ``k`` have sent the digest
  of exactly those k calls, and every rank compares its own: calls that differ (dtype, size, op,
  or a rank that issued other ops in between) fail on every rank at once, never fuse into
  corrupt results.
* The k tensors are packed by dtype into flat buffers, all-reduced with the usual algorithms
  (collectives/algorithms.py's table: by size and the group's layout) under the head entry's
  sequence number, and unpacked; each Work then
  completes with its own tensor's result.

Over TCP the agreement costs one message of 16 bytes to each peer per fused op (on shared
memory it goes through the segment: collectives/algorithms.py, "fusion agree"). A head entry of up to
``LINERATE_SMALL_BYTES`` travels with it and is reduced on arrival, so a lone small all_reduce
(a synchronous call: the caller waits at once, which ends the cycle wait) still takes one round.
"""
from __future__ import annotations

import ctypes
import hashlib
import struct
import time

import numpy as np
import torch

from .reduce_ops import NP_DTYPES, finish_avg, fold_rows, op_name, reduce_into

_AGREE = struct.Struct("<qQ")  # count of entries offered, running digest after the last of them
#: Most entries one fused op takes (bounds the unpacking work per op).
MAX_ENTRIES = 4096


class Entry:
    """One async all_reduce waiting to be fused."""

    __slots__ = ("seq", "buf", "tensor", "op", "opname", "stage", "work", "timeout", "desc",
                 "nbytes", "queued", "chain", "t0", "inline", "arrivals")

    #: For the op lifecycle (collectives/op.py): what every entry is.
    name = "all_reduce"

    def __init__(self, seq, buf, tensor, op, opname, stage, work, timeout, desc, chain):
        self.seq = seq
        self.buf = buf            # contiguous CPU tensor the result is written to
        self.tensor = tensor      # the caller's tensor (the Work's result)
        self.op = op
        self.opname = opname
        self.stage = stage
        self.work = work
        self.timeout = timeout
        self.desc = desc
        self.nbytes = buf.numel() * buf.element_size()
        self.queued = time.monotonic()
        self.chain = chain        # running digest of every fusable call up to this one
        self.t0 = 0.0
        self.arrivals = None  # as Op.arrivals
        #: Run by a synchronous caller in its own thread, never queued (its fused run takes
        #: nothing off the queue).
        self.inline = False

    @property
    def result(self) -> list:
        return [self.tensor]


_CALLS: dict = {}
_MASK = (1 << 64) - 1
#: Odd 64-bit multipliers (the golden ratio's and FNV's): prev -> prev * M is a bijection.
_MIX, _SEQ_MIX = 0x9E3779B97F4A7C15, 0x100000001B3


def chain_digest(prev: int, seq: int, desc: str) -> int:
    """The running digest after one more fusable call (same on every rank for the same calls):
    the previous digest mixed (a bijection) with the call's own 64-bit digest (blake2b of its
    text, cached: a job repeats a few calls) and its sequence number. Two ranks whose calls
    differ anywhere get different digests but for a 64-bit collision. Integer arithmetic, not a
    hash of the whole history per call: every small all_reduce pays it."""
    d = _CALLS.get(desc)
    if d is None:
        if len(_CALLS) > 4096:
            _CALLS.clear()
        d = _CALLS[desc] = int.from_bytes(
            hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little")
    return ((prev * _MIX) ^ d ^ ((seq * _SEQ_MIX) & _MASK)) & _MASK


def plan(queue, cap_bytes: int) -> tuple[int, bool]:
    """(entries the run at the head of ``queue`` may fuse, whether the run is closed).

    The run is the head entry and the entries right behind it with the same reduce op, as
    long as their bytes fit in ``cap_bytes``. Closed: what follows it is already known (an op,
    another reduce op, or a full buffer), so waiting cannot make it longer. The rule depends
    only on the calls, so every rank that has seen a closed run plans the same one."""
    head = queue[0]
    total = 0
    n = 0
    for item in queue:
        if not isinstance(item, Entry) or item.opname != head.opname:
            return n, True
        if n and (total + item.nbytes > cap_bytes or n >= MAX_ENTRIES):
            return n, True
        total += item.nbytes
        n += 1
    return n, total >= cap_bytes or n >= MAX_ENTRIES


def agree(comm, entries: list[Entry], offered: int, carry_bytes: int,
          avg_size: int | None = None) -> tuple[int, bool]:
    """(the number of entries every rank fuses: the least offered, whether the head entry is
    already reduced). Raises ValueError naming the calls when the ranks' calls differ.

    A head entry of at most ``carry_bytes`` travels with the agreement and is folded here in
    rank order (as collectives.direct does): a lone small all_reduce, the common synchronous
    case, costs one round as it would without fusion. ``comm`` may be a SubComm (the two-level
    agreement among a column's owners); an AVG head is divided by ``avg_size`` (default: the
    comm's size; 0: not divided)."""
    head = entries[0]
    if comm.size == 1:
        return offered, False
    carry = head.nbytes <= carry_bytes  # the same on every rank for the same call
    nb = head.nbytes if carry else 0
    size = _AGREE.size + nb
    out = bytearray(size)
    _AGREE.pack_into(out, 0, offered, entries[offered - 1].chain)
    if nb:  # the head's bytes after the words (a contiguous CPU tensor: one memmove)
        # (the address of a c_char in out: an array type per size would make garbage)
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(out, _AGREE.size)),
                       head.buf.data_ptr(), nb)
    # Byte buffers of this rank's own, sent and received as they are (no tensor views: each
    # view costs torch calls that are much of a small op's CPU time).
    mine = memoryview(out)
    reqs = {}
    sends = []
    base = comm.block()
    for peer in range(comm.size):
        if peer == comm.rank:
            continue
        buf = bytearray(size)
        reqs[peer] = (buf, comm.irecv_bytes(peer, memoryview(buf), base))
        sends.append(comm.isend_bytes(peer, mine, base))
    got = {}
    for peer, (buf, req) in reqs.items():
        comm.wait(req)
        c, digest = _AGREE.unpack_from(buf, 0)
        if c < 1:
            raise ValueError(f"rank {who(comm, comm.rank)}: fused all_reduce #{comm.seq}: rank "
                             f"{who(comm, peer)} offered {c} calls")
        got[peer] = (c, digest)
    comm.wait_all(sends)
    k = min([offered] + [c for c, _ in got.values()])
    compare_digests(entries, k, {peer: d for peer, (c, d) in got.items() if c == k},
                    lambda peer: who(comm, peer), who(comm, comm.rank))
    if not carry:
        return k, False
    if nb:  # every rank's part, this rank's from its own message (a copy), in rank order
        buf = head.buf  # (contiguous: its bytes went out above)
        n = buf.numel()
        bufs = [out if r == comm.rank else reqs[r][0] for r in range(comm.size)]
        npdt = NP_DTYPES.get(buf.dtype)
        if npdt is not None:
            fold_rows(buf, [np.frombuffer(b, dtype=npdt, count=n, offset=_AGREE.size)
                            for b in bufs], head.op, npdt)
        else:  # float16, bfloat16
            flat = buf.view(-1)
            parts = [torch.frombuffer(b, dtype=flat.dtype, offset=_AGREE.size, count=n)
                     for b in bufs]
            flat.copy_(parts[0])
            for part in parts[1:]:
                reduce_into(flat, part, head.op)
        if avg_size != 0:
            finish_avg(buf, head.op, comm.size if avg_size is None else avg_size)
    return k, True


def lone_all_reduce(comm, chain: int, t: torch.Tensor, op, desc: str) -> None:
    """agree() of a rank that offers one call, carried and reduced in place in ``t`` (a
    contiguous CPU tensor of at most the carried bytes): the fused run of a synchronous call
    that finds nothing queued, over the links, without a queue entry or a staged copy
    (collectives/runner.py ``lone_all_reduce``; peers that offered more fuse just this call).
    ``chain``: the running digest after this call, ``desc`` its text."""
    entry = Entry(comm.seq, t, t, op, op_name(op), None, None, comm.timeout, desc, chain)
    agree(comm, [entry], 1, entry.nbytes)


def compare_digests(entries: list[Entry], k: int, digests: dict, name, me) -> None:
    """Raise ValueError naming this rank's first ``k`` calls if a peer that offered exactly
    ``k`` (the least count: what every rank fuses) sent another running digest after its
    k-th. Peers that offered more are not compared here: their digest covers calls beyond the
    k fused, which the next agreement compares, each rank then naming its own calls (a rank
    whose differing call lay beyond k had fused the k and failed on a peer's report without
    naming it). Running digests: equal after k calls means every one of them agrees."""
    for peer, digest in digests.items():
        if digest != entries[k - 1].chain:
            raise ValueError(
                f"rank {me}: all_reduce calls #{entries[0].seq}..#{entries[k - 1].seq} (fused) "
                f"differ from rank {name(peer)}'s: the ranks passed other dtypes, sizes or "
                f"reduce ops, or called other operations in between; rank {me} called "
                f"{summary(entries[:k])}")


def who(comm, r: int) -> int:
    """Group rank of (sub-)rank r of ``comm`` (for messages)."""
    ranks = getattr(comm, "ranks", None)
    return ranks[r] if ranks is not None else r


def summary(entries: list[Entry]) -> str:
    """``float32[1024] x3, int64[7]`` op=SUM: the calls, run-length encoded (for messages)."""
    parts: list[list] = []
    for e in entries:
        d = e.desc.split(" op=", 1)[0]
        if parts and parts[-1][0] == d:
            parts[-1][1] += 1
        else:
            parts.append([d, 1])
    text = ", ".join(d if n == 1 else f"{d} x{n}" for d, n in parts[:8])
    if len(parts) > 8:
        text += f", ... ({len(entries)} calls)"
    return f"{text} op={entries[0].opname}"


def run(comm, entries: list[Entry], allreduce_flat, algo: str) -> int:
    """All-reduce the entries' buffers as one message per dtype; returns the bytes reduced."""
    if not entries:
        return 0
    if len(entries) == 1:
        e = entries[0]
        allreduce_flat(comm, e.buf.view(-1), e.op, algo)
        return e.nbytes
    by_dtype: dict = {}
    for e in entries:
        by_dtype.setdefault(e.buf.dtype, []).append(e)
    total = 0
    for group in by_dtype.values():
        flat = torch.cat([e.buf.view(-1) for e in group])
        allreduce_flat(comm, flat, group[0].op, algo)
        off = 0
        for e in group:
            n = e.buf.numel()
            e.buf.view(-1).copy_(flat[off:off + n])
            off += n
        total += flat.numel() * flat.element_size()
    return total
