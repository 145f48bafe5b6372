"""Conformance tests of the transport layer (transport/), without torch.distributed process groups.

Ranks are threads of this process sharing a ``torch.distributed.HashStore``, except for the peer
failure test, whose ranks are separate processes meeting at a ``TCPStore``. Some tests play a
rank themselves over raw frames (``FakePeer``) to control exactly what arrives and when.

The tests that take the ``transport`` fixture run once per transport: ``tcp``; ``rdma-fake``,
the RDMA transport (transport/rdma.py) on the fake pyverbs of tests/fake_pyverbs; and ``rdma``,
the same on this machine's real RDMA device, skipped (with the reason) where there is none.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

from linerate.transport import (CHANNEL_COLLECTIVE, CHANNEL_P2P, Context, MismatchError, PeerFailure,
                       TransportError, TransportOptions, parse_size)
from linerate.collectives.mismatch import OpNames
from linerate.transport import rendezvous
from linerate.transport import framing, handshake
from linerate.transport.fakepeer import FakePeer as _FakePeer

from _harness import CURRENT_TRANSPORT, REPO

OPNAMES = OpNames({1: "allreduce", 2: "broadcast"})  # the mismatch wording (collectives)
# Loopback only, so that the tests need no network and no MASTER_ADDR.
# Co-located ranks would link over shared memory (tests/test_shm_link.py): TCP is tested here.
BASE_OPTS = dict(socket_ifname="lo", connect_timeout=30.0, shm="0")


# --------------------------------------------------------------------------- helpers
def _opts(**kw) -> TransportOptions:
    o = TransportOptions(**{**BASE_OPTS, "transport": CURRENT_TRANSPORT["transport"], **kw})
    o.validate()
    return o


def _hash_store():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    return store


def _close_all(ctxs) -> None:
    for c in ctxs:
        if c is not None:
            c.close(timeout=5.0)


def make_mesh(size: int, store=None, **kw) -> list[Context]:
    """Build the contexts of ranks 0..size-1, one thread per rank (each constructor blocks
    until its mesh is complete)."""
    store = store or _hash_store()
    opts = _opts(**kw)
    ctxs: list = [None] * size
    errors: list = []

    def build(r):
        try:
            ctxs[r] = Context(store, r, size, opts, describe=OPNAMES)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    if errors or any(c is None for c in ctxs):
        _close_all(ctxs)
        raise errors[0] if errors else AssertionError("mesh set-up did not finish")
    return ctxs


@contextlib.contextmanager
def mesh(size: int, **kw):
    ctxs = make_mesh(size, **kw)
    try:
        yield ctxs
    finally:
        _close_all(ctxs)


def _wait_until(pred, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def _received_from(ctx: Context, peer: int) -> int:
    return sum(c["received_bytes"] for c in ctx.connection_stats() if c["peer"] == peer)


def _fence(fake: FakePeer, tag: int) -> None:
    """Return once the context has handled everything the fake peer sent so far: a small
    message sent after it (one connection, handled in order) has been received."""
    out = bytearray(4)
    r = fake.ctx.irecv(1, memoryview(out), CHANNEL_P2P, tag)
    fake.data(CHANNEL_P2P, tag, 0, 4, 0, b"done")
    r.wait(10)
    assert bytes(out) == b"done"


def _rand_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def FakePeer(**kw) -> _FakePeer:
    """Rank 1 of a 2-rank group played by the test: rank 0 is a real Context, and the test
    writes raw frames on rank 1's single connection (linerate.transport.fakepeer, which the
    fuzzer uses too), over a HashStore."""
    return _FakePeer(store=_hash_store(), describe=OPNAMES, **{**BASE_OPTS, **kw})


# --------------------------------------------------------------------------- 1. mesh set-up
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nsocks", [1, 3])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_mesh_setup(size, nsocks, transport):
    """Lazy links (the default, TCP): no connection at creation; once every ordered pair has
    talked, the full mesh (RDMA links are made at creation)."""
    with mesh(size, nsocks=nsocks) as ctxs:
        if transport == "tcp":
            assert all(c.connection_stats() == [] for c in ctxs)
        # every ordered pair of ranks can talk
        reqs, bufs = [], {}
        for src in range(size):
            for dst in range(size):
                if src != dst:
                    bufs[src, dst] = bytearray(8)
                    reqs.append(ctxs[dst].irecv(src, memoryview(bufs[src, dst]), CHANNEL_P2P, 1))
                    reqs.append(ctxs[src].isend(dst, memoryview(struct.pack("<ii", src, dst)),
                                                CHANNEL_P2P, 1))
        for r in reqs:
            r.wait(20)
        for (src, dst), b in bufs.items():
            assert struct.unpack("<ii", b) == (src, dst)
        for c in ctxs:
            stats = c.connection_stats()
            assert len(stats) == (size - 1) * nsocks
            assert {(s["peer"], s["connection"]) for s in stats} == {
                (p, k) for p in range(size) if p != c.rank for k in range(nsocks)}
            if transport == "tcp":
                assert all(s["local"] == "127.0.0.1" and s["remote"] == "127.0.0.1" for s in stats)
            else:  # device:port, and the peer's device:port@host
                assert all(":" in s["local"] and "@" in s["remote"] for s in stats), stats
            assert c.transport == ("tcp" if transport == "tcp" or size == 1 else "rdma")
            assert c.broken is None
        if size == 1:  # no peer to talk to
            with pytest.raises(ValueError, match="invalid peer rank"):
                ctxs[0].isend(0, memoryview(b"x"), CHANNEL_P2P, 0)


@pytest.mark.timeout(60)
def test_mesh_setup_default_interface(monkeypatch):
    """Without LINERATE_SOCKET_IFNAME the listener follows the route to MASTER_ADDR."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with mesh(2, nsocks=2, socket_ifname="", connect="eager") as ctxs:
        assert all(c.addresses == ["127.0.0.1"] for c in ctxs)
        assert len(ctxs[0].connection_stats()) == 2


# --------------------------------------------------------------------------- 2. striping
TEN_MB = 10 * 1024 * 1024


@pytest.mark.timeout(60)
def test_striping_large_message_intact(transport):
    rng = np.random.default_rng(2)
    with mesh(2, nsocks=3, chunk_bytes=64 * 1024) as (c0, c1):
        src = _rand_bytes(rng, TEN_MB)
        dst = np.zeros_like(src)
        r = c1.irecv(0, memoryview(dst), CHANNEL_P2P, 5)
        s = c0.isend(1, memoryview(src), CHANNEL_P2P, 5)
        s.wait(30)
        r.wait(30)
        np.testing.assert_array_equal(src, dst)
        assert sum(c["sent_bytes"] for c in c0.connection_stats()) == TEN_MB
        assert sum(c["received_bytes"] for c in c1.connection_stats()) == TEN_MB


@pytest.mark.timeout(60)
def test_striping_uses_every_connection(transport):
    rng = np.random.default_rng(3)
    with mesh(2, nsocks=3, chunk_bytes=64 * 1024) as (c0, c1):
        # let the sender threads reach their idle wait, as in a real job between two ops
        warm = bytearray(1)
        r = c1.irecv(0, memoryview(warm), CHANNEL_P2P, 0)
        c0.isend(1, memoryview(b"w"), CHANNEL_P2P, 0).wait(10)
        r.wait(10)
        time.sleep(0.3)
        before = [c["sent_bytes"] for c in c0.connection_stats()]
        src = _rand_bytes(rng, TEN_MB)
        dst = np.zeros_like(src)
        r = c1.irecv(0, memoryview(dst), CHANNEL_P2P, 5)
        c0.isend(1, memoryview(src), CHANNEL_P2P, 5).wait(30)
        r.wait(30)
        np.testing.assert_array_equal(src, dst)
        carried = [c["sent_bytes"] - b for c, b in zip(c0.connection_stats(), before)]
        # Chunks go to whichever connection is free; on a loaded 2-core machine a sender
        # thread may not be scheduled at all during a 10 MB message, so ask for striping over
        # at least two of the three connections, and every byte accounted for.
        assert sum(n > 0 for n in carried) >= 2, f"bytes per connection: {carried}"
        assert sum(carried) == TEN_MB
        # the stats snapshot: plain data, the same counts per link as per connection
        snap = c0.stats()
        json.dumps(snap)  # numbers and strings only
        (peer,) = snap["peers"]
        (link,) = peer["links"]
        assert (peer["peer"], peer["failure"], link["state"], link["messages_sent"]) == (1, None, "up", 2)
        assert link["kind"] == c0.transport and link["bytes_sent"] == TEN_MB + 1
        assert link["bytes_sent"] == sum(c["sent_bytes"] for c in c0.connection_stats())
        assert c1.stats()["peers"][0]["links"][0]["messages_received"] == 2


# --------------------------------------------------------------------------- 3. ordering
@pytest.mark.timeout(60)
def test_ordering_one_tag_random_sizes(transport):
    rng = np.random.default_rng(4)
    sizes = [0, 1, 3, 0, 4095, 4097, 16383, 16384, 16385, 0]
    sizes += [int(n) for n in rng.integers(0, 60_000, 190)]
    sizes = [n | 1 if i % 3 == 0 and n else n for i, n in enumerate(sizes)]  # plenty of odd sizes
    assert len(sizes) == 200
    payloads = [_rand_bytes(rng, n) for n in sizes]
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    with mesh(2, nsocks=3, chunk_bytes=4096) as (c0, c1):
        sends = [c0.isend(1, memoryview(p), CHANNEL_P2P, 77) for p in payloads[:100]]  # unexpected
        recvs = [c1.irecv(0, memoryview(o), CHANNEL_P2P, 77) for o in outs]
        sends += [c0.isend(1, memoryview(p), CHANNEL_P2P, 77) for p in payloads[100:]]  # posted
        for r in sends + recvs:
            r.wait(30)
        for i, (p, o) in enumerate(zip(payloads, outs)):
            assert np.array_equal(p, o), f"message {i} ({sizes[i]} bytes) differs"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recv_first", [True, False])
def test_ordering_matches_by_tag(recv_first, transport):
    """Messages of the same size on different tags, posted in opposite orders on the two
    sides, still match by tag."""
    rng = np.random.default_rng(5)
    a, b = _rand_bytes(rng, 100_001), _rand_bytes(rng, 100_001)
    oa, ob = np.zeros_like(a), np.zeros_like(b)
    with mesh(2, nsocks=2, chunk_bytes=8192) as (c0, c1):
        def post_recvs():
            return [c1.irecv(0, memoryview(ob), CHANNEL_P2P, 11),
                    c1.irecv(0, memoryview(oa), CHANNEL_P2P, 10)]

        reqs = post_recvs() if recv_first else []
        reqs += [c0.isend(1, memoryview(a), CHANNEL_P2P, 10),
                 c0.isend(1, memoryview(b), CHANNEL_P2P, 11)]
        if not recv_first:
            assert _wait_until(lambda: _received_from(c1, 0) >= 2 * a.size, 10)
            reqs += post_recvs()
        for r in reqs:
            r.wait(20)
        np.testing.assert_array_equal(a, oa)
        np.testing.assert_array_equal(b, ob)


# --------------------------------------------------------------------------- 4. unexpected
@pytest.mark.timeout(60)
def test_unexpected_large_message_fully_arrived(transport):
    rng = np.random.default_rng(6)
    n = 5 * 1024 * 1024
    src = _rand_bytes(rng, n)
    dst = np.zeros_like(src)
    with mesh(2, nsocks=2, chunk_bytes=256 * 1024) as (c0, c1):
        c0.isend(1, memoryview(src), CHANNEL_P2P, 3).wait(20)
        assert _wait_until(lambda: _received_from(c1, 0) == n, 10)
        r = c1.irecv(0, memoryview(dst), CHANNEL_P2P, 3)
        r.wait(20)
        np.testing.assert_array_equal(src, dst)
        # a zero-byte unexpected message too
        c0.isend(1, memoryview(b""), CHANNEL_P2P, 4).wait(10)
        time.sleep(0.05)
        c1.irecv(0, memoryview(bytearray(0)), CHANNEL_P2P, 4).wait(10)


@pytest.mark.timeout(60)
def test_unexpected_partially_arrived_message():
    """The receive is posted while the message is still arriving: first after whole chunks,
    then in the middle of a chunk's payload; the rest must land in the user's buffer."""
    rng = np.random.default_rng(7)
    n = 5 * 1024 * 1024
    src = _rand_bytes(rng, n).tobytes()
    dst = np.zeros(n, dtype=np.uint8)
    fake = FakePeer(chunk_bytes=1 << 20)
    try:
        ctx = fake.ctx
        two = 2 * 1024 * 1024
        fake.data(CHANNEL_P2P, 9, 0, n, 0, src[:two])
        assert _wait_until(lambda: _received_from(ctx, 1) == two, 10)
        r = ctx.irecv(1, memoryview(dst), CHANNEL_P2P, 9)
        _fence(fake, 100)  # the staged 2 MiB are handled: 3 MiB still missing
        assert not r.is_completed()
        # the last chunk's header and half of its payload, then the rest
        last = 4 * 1024 * 1024
        fake.sock.sendall(framing.pack_header(framing.KIND_DATA, 0, CHANNEL_P2P, n - last, 9, 0,
                                              n, last) + src[last:last + 1000])
        time.sleep(0.05)  # most likely read apart: the receiver then holds half a payload
        fake.sock.sendall(src[last + 1000:])
        _fence(fake, 101)  # the last chunk is handled: the middle 2 MiB still missing
        assert _received_from(ctx, 1) == two + (n - last) + 8
        assert not r.is_completed()
        fake.data(CHANNEL_P2P, 9, 0, n, two, src[two:last])  # the middle, out of order
        r.wait(10)
        assert dst.tobytes() == src
        # a staged message whose receive is posted before any of its payload arrived
        small = bytes(range(256)) * 4
        fake.sock.sendall(framing.pack_header(framing.KIND_DATA, 0, CHANNEL_P2P, len(small), 9,
                                              1, len(small), 0))
        time.sleep(0.05)  # most likely read before the receive is posted
        out = bytearray(len(small))
        r = ctx.irecv(1, memoryview(out), CHANNEL_P2P, 9)
        fake.sock.sendall(small)
        r.wait(10)
        assert bytes(out) == small
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_driven_receive_of_a_frame_half_there():
    """Frames that come in two parts (the header and part of the payload, the rest later) to
    a caller that drives its receive: it waits for the rest and finishes the frame; where its
    deadline comes first, the drive returns with the receive open, the link's receivers read
    again (a receive is pending) and finish the frame where the caller left it."""
    fake = FakePeer(chunk_bytes=1 << 20)
    payload = bytes(range(256)) * 16

    def frame(msgno: int) -> bytes:
        return framing.pack_header(framing.KIND_DATA, 1, CHANNEL_COLLECTIVE, len(payload), 7,
                                   msgno, len(payload), 0)

    def post(msgno: int):
        out = bytearray(len(payload))
        return out, fake.ctx.irecv(1, memoryview(out), CHANNEL_COLLECTIVE, 7, opcode=1,
                                   slot=msgno, driven=True)

    try:
        ctx = fake.ctx
        assert _wait_until(lambda: ctx.peers[1].link is not None, 10)
        link = ctx.peers[1].link
        link.LEND_IDLE_S = 60.0  # (this instance's: the receivers stay parked between drives)
        out, r = post(0)
        fake.sock.sendall(frame(0) + payload)
        ctx.drive(r, time.monotonic() + 10)
        assert r.is_completed() and bytes(out) == payload and link.lent
        # the rest comes while the caller drives: it waits for it
        out, r = post(1)
        fake.sock.sendall(frame(1) + payload[:1000])
        threading.Timer(0.3, fake.sock.sendall, (payload[1000:],)).start()
        t0 = time.monotonic()
        ctx.drive(r, t0 + 10)
        assert r.is_completed() and time.monotonic() - t0 >= 0.25
        assert bytes(out) == payload and link.lent
        # the deadline comes first: the receivers finish it
        out, r = post(2)
        fake.sock.sendall(frame(2) + payload[:1000])
        t0 = time.monotonic()
        ctx.drive(r, t0 + 0.3)
        assert time.monotonic() - t0 >= 0.25
        assert not r.is_completed() and not link.lent
        fake.sock.sendall(payload[1000:])
        r.wait(10)
        assert bytes(out) == payload
    finally:
        fake.close()


@pytest.mark.timeout(90)
def test_a_driven_receive_reads_the_other_awaited_peers_as_they_come():
    """Where arrivals are recorded (a group that times each peer: collectives/straggler.py),
    a caller that drives its receive from one peer reads the same op's small receives from
    the others in the same loop: a peer whose message came first is timed when it came, not
    when the caller got to it, even with that link's receivers parked by an earlier drive
    (Context.drive, Link.drive's ``also``). A receive of another op is left to its link.
    With arrivals recorded or not, a large receive awaited from a peer whose link a caller
    lent before is read by that link's threads while the caller reads its own."""
    with mesh(3) as (c0, c1, c2):
        call = 0x5EED

        def exchange(tag, delays=None):  # {rank: seconds before it sends}
            outs = {q: bytearray(100) for q in (1, 2)}
            reqs = {q: c0.irecv(q, memoryview(outs[q]), CHANNEL_COLLECTIVE, tag, opcode=1,
                                slot=0, call=call, driven=True) for q in (1, 2)}
            for q, c in ((1, c1), (2, c2)):
                data = bytearray([q]) * 100
                if (delays or {}).get(q):
                    threading.Timer(delays[q], c.isend, (0, memoryview(data),
                                                         CHANNEL_COLLECTIVE, tag, 1, "", 0,
                                                         call)).start()
                else:
                    c.isend(0, memoryview(data), CHANNEL_COLLECTIVE, tag, 1, "", 0, call)
            return outs, reqs

        for r in exchange(1)[1].values():  # the links up
            r.wait(30)
        assert _wait_until(lambda: all(c0.peers[q].link is not None for q in (1, 2)), 30)
        outs, reqs = exchange(2)
        for q in (1, 2):  # each read by a caller: their receivers parked
            c0.peers[q].link.LEND_IDLE_S = 60.0  # (this instance's: they stay parked)
            c0.drive(reqs[q], time.monotonic() + 30)
            reqs[q].wait(30)
        assert c0.peers[1].link.lent and c0.peers[2].link.lent
        c0.record_arrivals()
        c0.begin_call(3, call, "all_reduce #3")
        t0 = time.perf_counter()
        outs, reqs = exchange(3, {1: 1.0})
        c0.drive(reqs[1], time.monotonic() + 30)
        assert reqs[1].is_completed() and reqs[2].is_completed()
        arrived = c0.end_call(3)
        assert arrived[2] - t0 < 0.9 and arrived[1] - t0 >= 0.95, \
            {q: t - t0 for q, t in arrived.items()}
        assert bytes(outs[1]) == bytes([1]) * 100 and bytes(outs[2]) == bytes([2]) * 100
        # another op's receive from rank 2 (a point-to-point one) is its link's to read
        p2p = bytearray(5)
        other = c0.irecv(2, memoryview(p2p), CHANNEL_P2P, 9)
        outs, reqs = exchange(4, {1: 0.2})
        c2.isend(0, memoryview(bytearray(b"hello")), CHANNEL_P2P, 9)
        c0.drive(reqs[1], time.monotonic() + 30)
        for r in (*reqs.values(), other):
            r.wait(30)
        assert bytes(p2p) == b"hello"
        # more peers awaited than a caller reads at once (DRIVE_PEERS): it reads none (it
        # returns before rank 1's message comes), and the links it read before are their
        # threads' again
        c0.drive(exchange(5)[1][1], time.monotonic() + 30)  # (both links lent again)
        c0.DRIVE_PEERS = 0
        c0.begin_call(6, call, "all_reduce #6")
        t0 = time.perf_counter()
        outs, reqs = exchange(6, {1: 1.5, 2: 0.5})
        c0.drive(reqs[1], time.monotonic() + 30)
        assert not reqs[1].is_completed()
        assert not c0.peers[1].link.lent and not c0.peers[2].link.lent
        for r in reqs.values():
            r.wait(30)
        arrived = c0.end_call(6)
        assert 0.45 <= arrived[2] - t0 < 1.4 and arrived[1] - t0 >= 1.45, \
            {q: t - t0 for q, t in arrived.items()}
        # a large receive awaited from a peer whose link a caller lent before: that link's
        # threads read it (in parallel, timed as it comes) while the caller reads its own
        c0.DRIVE_PEERS = 8
        for q in (1, 2):  # (both links lent again)
            c0.drive(exchange(7 + q)[1][q], time.monotonic() + 30)
        assert c0.peers[1].link.lent and c0.peers[2].link.lent
        c0.begin_call(10, call, "all_reduce #10")
        big = os.urandom(100 << 10)
        small, large = bytearray(100), bytearray(len(big))
        r1 = c0.irecv(1, memoryview(small), CHANNEL_COLLECTIVE, 10, opcode=1, slot=0, call=call,
                      driven=True)
        r2 = c0.irecv(2, memoryview(large), CHANNEL_COLLECTIVE, 10, opcode=1, slot=0, call=call,
                      driven=True)
        t0 = time.perf_counter()
        c2.isend(0, memoryview(bytearray(big)), CHANNEL_COLLECTIVE, 10, 1, "", 0, call)
        threading.Timer(1.0, c1.isend, (0, memoryview(bytearray(100)), CHANNEL_COLLECTIVE, 10,
                                        1, "", 0, call)).start()
        c0.drive(r1, time.monotonic() + 30)
        r2.wait(30)
        arrived = c0.end_call(10)
        assert arrived[2] - t0 < 0.9 and arrived[1] - t0 >= 0.95, \
            {q: t - t0 for q, t in arrived.items()}
        assert bytes(large) == big and not c0.peers[2].link.lent
        # the same without arrivals recorded: the large message's link is reclaimed too (its
        # receivers stayed parked until the lend ran out: 60 s here)
        c0.record_arrivals(False)
        for q in (1, 2):  # (both links lent again)
            c0.drive(exchange(11 + q)[1][q], time.monotonic() + 30)
        assert c0.peers[1].link.lent and c0.peers[2].link.lent
        c0.begin_call(14, call, "all_reduce #14")
        small, large = bytearray(100), bytearray(len(big))
        r1 = c0.irecv(1, memoryview(small), CHANNEL_COLLECTIVE, 14, opcode=1, slot=0, call=call,
                      driven=True)
        r2 = c0.irecv(2, memoryview(large), CHANNEL_COLLECTIVE, 14, opcode=1, slot=0, call=call,
                      driven=True)
        c2.isend(0, memoryview(bytearray(big)), CHANNEL_COLLECTIVE, 14, 1, "", 0, call)
        threading.Timer(1.0, c1.isend, (0, memoryview(bytearray(100)), CHANNEL_COLLECTIVE, 14,
                                        1, "", 0, call)).start()
        c0.drive(r1, time.monotonic() + 30)
        r2.wait(5)
        assert bytes(large) == big and not c0.peers[2].link.lent
        c0.end_call(14)


@pytest.mark.timeout(60)
def test_close_fails_posted_receive():
    fake = FakePeer()
    try:
        r = fake.ctx.irecv(1, memoryview(bytearray(8)), CHANNEL_P2P, 10)
        fake.ctx.close(timeout=2.0)
        with pytest.raises(TransportError, match="shut down"):
            r.wait(3)
    finally:
        fake.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["close", "error_frame"])
def test_broken_context_fails_receive_waiting_on_staged_message(how):
    fake = FakePeer()
    try:
        ctx = fake.ctx
        n = 100_000
        fake.data(CHANNEL_COLLECTIVE, 0, 0, n, 0, bytes(1000), opcode=1)  # the first 1000 bytes
        assert _wait_until(lambda: _received_from(ctx, 1) == 1000, 10)
        r = ctx.irecv(1, memoryview(bytearray(n)), CHANNEL_COLLECTIVE, 0, opcode=1)
        if how == "close":
            ctx.close(timeout=2.0)
        else:
            text = b"rank 1 failed"
            fake.sock.sendall(framing.pack_header(framing.KIND_ERROR, 0, 0, len(text), 0, 0,
                                                  len(text), 0) + text)
            assert _wait_until(lambda: ctx.broken is not None, 5)
        with pytest.raises(TransportError):
            r.wait(2)
    finally:
        fake.close()


# --------------------------------------------------------------------------- 5. any source
@pytest.mark.timeout(60)
def test_any_source_receive(transport):
    with mesh(3, nsocks=2) as ctxs:
        c0 = ctxs[0]
        for sender in (2, 1):  # posted before the message
            out = bytearray(4)
            r = c0.irecv(None, memoryview(out), CHANNEL_P2P, 21)
            assert r.peer is None
            time.sleep(0.02)
            ctxs[sender].isend(0, memoryview(struct.pack("<i", sender)), CHANNEL_P2P, 21).wait(10)
            r.wait(10)
            assert r.peer == sender and struct.unpack("<i", out)[0] == sender
        # a message that arrived before the any-source receive
        ctxs[1].isend(0, memoryview(struct.pack("<i", 1)), CHANNEL_P2P, 22).wait(10)
        assert _wait_until(lambda: _received_from(c0, 1) >= 8, 10)
        out = bytearray(4)
        r = c0.irecv(None, memoryview(out), CHANNEL_P2P, 22)
        r.wait(10)
        assert r.peer == 1 and struct.unpack("<i", out)[0] == 1
        # a message on another tag does not satisfy it
        out = bytearray(4)
        r = c0.irecv(None, memoryview(out), CHANNEL_P2P, 23)
        ctxs[2].isend(0, memoryview(struct.pack("<i", 2)), CHANNEL_P2P, 24).wait(10)
        time.sleep(0.1)
        assert not r.is_completed()
        ctxs[2].isend(0, memoryview(struct.pack("<i", 9)), CHANNEL_P2P, 23).wait(10)
        r.wait(10)
        assert r.peer == 2 and struct.unpack("<i", out)[0] == 9
        c0.irecv(2, memoryview(bytearray(4)), CHANNEL_P2P, 24).wait(10)
        with pytest.raises(ValueError):
            c0.irecv(None, memoryview(bytearray(4)), CHANNEL_COLLECTIVE, 0)


# --------------------------------------------------------------------------- 6. mismatch
# kind -> (send size, send opcode, send tag), the receiver posting 100 bytes, opcode 1, tag 0
MISMATCHES = {"size": (200, 1, 0), "opcode": (100, 2, 0)}


@pytest.mark.timeout(60)
def test_collective_of_another_op_is_not_mixed_in(transport):
    """A message of op #1 never fills a receive of op #0 (it waits, staged, for op #1), and
    staged() and the wording (collectives/mismatch.py) name it for the timeout report."""
    with mesh(2, nsocks=2) as (c0, c1):
        c0.isend(1, memoryview(bytes(100)), CHANNEL_COLLECTIVE, 1, opcode=1).wait(10)
        assert _wait_until(lambda: _received_from(c1, 0) == 100, 10)
        out = bytearray(100)
        r = c1.irecv(0, memoryview(out), CHANNEL_COLLECTIVE, 0, opcode=1)
        with pytest.raises(TimeoutError):
            r.wait(0.5)
        assert c1.staged(0) == [(CHANNEL_COLLECTIVE, 1, 1)]
        assert OPNAMES.staged_ops(c1, 0) == [(1, "allreduce")]


def _post_mismatch(c0, c1, kind, recv_first):
    size, opcode, tag = MISMATCHES[kind]
    out = bytearray(100)
    r = c1.irecv(0, memoryview(out), CHANNEL_COLLECTIVE, 0, opcode=1) if recv_first else None
    s = c0.isend(1, memoryview(bytes(size)), CHANNEL_COLLECTIVE, tag, opcode=opcode)
    try:
        s.wait(10)
    except TransportError:
        # The receiver's error report may reach the sender before its send is marked done
        # (a loaded machine preempts the sending thread between writing and completing): the
        # send then fails with the mismatch, which is what the sender should learn anyway.
        assert recv_first, "the message must have arrived before its receive was posted"
    if not recv_first:
        assert _wait_until(lambda: _received_from(c1, 0) == size, 10)
        r = c1.irecv(0, memoryview(out), CHANNEL_COLLECTIVE, 0, opcode=1)
    return r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recv_first", [True, False], ids=["recv_first", "send_first"])
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_collective_mismatch_error_names_both_ranks(kind, recv_first, transport):
    with mesh(2, nsocks=2) as (c0, c1):
        r = _post_mismatch(c0, c1, kind, recv_first)
        with pytest.raises(MismatchError) as ei:
            r.wait(10)
        msg = str(ei.value)
        assert "rank 0" in msg and "rank 1" in msg, msg
        if kind == "size":
            assert "200 bytes" in msg and "100 bytes" in msg, msg
        elif kind == "opcode":
            assert "broadcast" in msg and "allreduce" in msg, msg
        else:
            assert "op #1" in msg and "op #0" in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recv_first", [
    True,
    False,
], ids=["recv_first", "send_first"])
def test_collective_mismatch_breaks_sender(recv_first, transport):
    with mesh(2, nsocks=2) as (c0, c1):
        r = _post_mismatch(c0, c1, "size", recv_first)
        with pytest.raises(MismatchError):
            r.wait(10)
        assert _wait_until(lambda: c0.broken is not None, 3), "sender never learnt of the mismatch"
        assert "rank 1 reported an error" in str(c0.broken)
        assert c1.broken is not None


@pytest.mark.timeout(60)
def test_error_frame_fails_collectives_only(transport):
    with mesh(2, nsocks=2) as (c0, c1):
        coll = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 0, opcode=1)
        out = bytearray(8)
        p2p = c1.irecv(0, memoryview(out), CHANNEL_P2P, 5)
        c0.report_error("rank 0 gave up: boom")
        with pytest.raises(TransportError, match="boom"):
            coll.wait(5)
        assert c1.broken is not None and "boom" in str(c1.broken)
        assert c0.broken is not None
        assert not p2p.is_completed()
        c0.isend(1, memoryview(b"p2p-fine"), CHANNEL_P2P, 5).wait(10)
        p2p.wait(10)
        assert bytes(out) == b"p2p-fine"


@pytest.mark.timeout(60)
def test_broken_context_refuses_new_collectives(transport):
    with mesh(2, nsocks=1) as (c0, c1):
        c0.report_error("boom")
        assert _wait_until(lambda: c1.broken is not None, 5)
        r = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 1, opcode=1)
        with pytest.raises(TransportError):
            r.wait(2)


# --------------------------------------------------------------------------- 7. peer failure
CHILD = textwrap.dedent("""
    import datetime, sys, time
    import torch.distributed as dist
    from linerate.transport import CHANNEL_P2P, Context, TransportOptions
    rank, size, port = map(int, sys.argv[1:4])
    transport, link_timeout = sys.argv[4], float(sys.argv[5])
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    ctx = Context(store, rank, size, TransportOptions(nsocks=2, socket_ifname="lo",
                                                      connect_timeout=60, transport=transport,
                                                      link_timeout=link_timeout, shm="0"))
    store.set(f"ready/{rank}", "1")
    if rank == 1:  # echo one p2p message, then wait for the test's word
        buf = bytearray(8)
        ctx.irecv(0, memoryview(buf), CHANNEL_P2P, 7).wait(60)
        ctx.isend(0, memoryview(buf), CHANNEL_P2P, 8).wait(60)
        store.get("finish")
        ctx.close()
    else:
        time.sleep(120)  # the test kills this rank
""")


@pytest.mark.timeout(90)
def test_peer_killed_fails_pending_receive_quickly(transport):
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # A killed process resets its TCP connections at once; its queue pairs just stop
    # answering, found by the keepalive writes within LINERATE_LINK_TIMEOUT.
    link_timeout = 60.0 if transport == "tcp" else 1.0
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), "3", str(store.port),
                                  CURRENT_TRANSPORT["transport"], str(link_timeout)],
                                 cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT) for r in (1, 2)]
    ctx = None
    try:
        ctx = Context(store, 0, 3, _opts(nsocks=2, connect_timeout=60, link_timeout=link_timeout),
                      describe=OPNAMES)
        store.get("ready/1")
        store.get("ready/2")
        dead = ctx.irecv(2, memoryview(bytearray(16)), CHANNEL_P2P, 5)
        coll = ctx.irecv(1, memoryview(bytearray(16)), CHANNEL_COLLECTIVE, 0, opcode=1)
        os.kill(children[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerFailure) as ei:
            dead.wait(30)
        assert time.monotonic() - t0 < 5
        assert ei.value.peer == 2 and "rank 2" in str(ei.value)
        # a collective cannot finish without rank 2: the one pending with rank 1 fails too
        with pytest.raises(TransportError):
            coll.wait(5)
        assert ctx.broken is not None
        # rank 2 is gone for good: a new receive from it fails at once
        with pytest.raises(PeerFailure):
            ctx.irecv(2, memoryview(bytearray(1)), CHANNEL_P2P, 6).wait(5)
        # point-to-point with the surviving rank still works
        back = bytearray(8)
        r = ctx.irecv(1, memoryview(back), CHANNEL_P2P, 8)
        ctx.isend(1, memoryview(b"survivor"), CHANNEL_P2P, 7).wait(10)
        r.wait(20)
        assert bytes(back) == b"survivor"
        store.set("finish", "1")
        out, _ = children[0].communicate(timeout=30)
        assert children[0].returncode == 0, out.decode(errors="replace")
    finally:
        if ctx is not None:
            ctx.close(timeout=2.0)
        for p in children:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)


@pytest.mark.timeout(60)
def test_peer_close_fails_pending_receives(transport):
    ctxs = make_mesh(2, nsocks=2)
    try:
        c0, c1 = ctxs
        p2p = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_P2P, 1)
        coll = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 0)
        c0.close()
        for r in (p2p, coll):
            with pytest.raises(PeerFailure) as ei:
                r.wait(5)
            assert ei.value.peer == 0 and "rank 0" in str(ei.value)
    finally:
        _close_all(ctxs)


@pytest.mark.timeout(60)
def test_driven_receive_and_the_receives_after_it(transport):
    """A receive posted ``driven`` and completed by Context.drive (a caller's lone op reading
    its peer's link itself, where the link allows: threads TCP): the bytes arrive, and a
    receive posted afterwards without ``driven`` (another op's, p2p) is read by the link's own
    threads at once, not after the link's idle wait; a driven receive whose peer closes fails
    naming it, and the drive returns."""
    ctxs = make_mesh(2, nsocks=2)
    try:
        c0, c1 = ctxs
        first = c1.irecv(0, memoryview(bytearray(1)), CHANNEL_P2P, 2)  # (links may be lazy)
        c0.isend(1, memoryview(b"x"), CHANNEL_P2P, 2)
        first.wait(20)
        assert _wait_until(lambda: c1.peers[0].link is not None, 20)
        link = c1.peers[0].link
        link.LEND_IDLE_S = 60.0  # (this instance's: only a reclaim brings the receivers back)
        for i in range(20):
            got = bytearray(4096)
            r = c1.irecv(0, memoryview(got), CHANNEL_COLLECTIVE, i, opcode=1, driven=True)
            data = os.urandom(4096)
            c0.isend(1, memoryview(data), CHANNEL_COLLECTIVE, i, opcode=1)
            c1.drive(r, time.monotonic() + 20)
            assert r.is_completed() or transport != "tcp"  # (threads TCP: driven here)
            r.wait(10)
            assert bytes(got) == data
        assert link.lent is (transport == "tcp")
        back = bytearray(8)
        p2p = c1.irecv(0, memoryview(back), CHANNEL_P2P, 3)  # not driven: the link's threads
        assert not link.lent
        c0.isend(1, memoryview(b"p2p read"), CHANNEL_P2P, 3)
        p2p.wait(10)
        assert bytes(back) == b"p2p read"
        # a receive posted before a drive, still pending after it: the link's threads again
        p2p = c1.irecv(0, memoryview(back), CHANNEL_P2P, 4)
        got = bytearray(4096)
        r = c1.irecv(0, memoryview(got), CHANNEL_COLLECTIVE, 50, opcode=1, driven=True)
        c0.isend(1, memoryview(bytes(4096)), CHANNEL_COLLECTIVE, 50, opcode=1)
        c1.drive(r, time.monotonic() + 20)
        r.wait(10)
        assert not link.lent
        c0.isend(1, memoryview(b"pending!"), CHANNEL_P2P, 4)
        p2p.wait(10)
        assert bytes(back) == b"pending!"
        r = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 99, opcode=1, driven=True)
        threading.Timer(0.2, c0.close).start()
        t0 = time.monotonic()
        c1.drive(r, t0 + 30)
        assert time.monotonic() - t0 < 10
        with pytest.raises(PeerFailure) as ei:
            r.wait(5)
        assert ei.value.peer == 0 and "rank 0" in str(ei.value)
    finally:
        _close_all(ctxs)


@pytest.mark.timeout(60)
def test_peer_close_after_a_failure_says_why(transport):
    """Rank 0's collectives broke (a report from a rank that rank 1 has not heard yet, say
    the neighbour of a rank that died); rank 0 gives up and closes. Rank 1, still waiting on
    rank 0 in the collective, learns the cause ahead of the CLOSE, not "rank 0 closed its
    process group" (seen in an 8-rank kill test under load)."""
    ctxs = make_mesh(3, nsocks=2)
    try:
        c0, c1, c2 = ctxs
        for c in (c0, c2):  # links 0-1 and 2-1 are up, as between ring neighbours
            r = c1.irecv(c.rank, memoryview(bytearray(2)), CHANNEL_P2P, 9)
            c.isend(1, memoryview(b"up"), CHANNEL_P2P, 9).wait(10)
            r.wait(10)
        coll = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 0)
        c0.failures.set_broken(TransportError("rank 2 reported an error: rank 5 died"),
                       only_collective=True)
        c0.close()
        with pytest.raises(TransportError) as ei:
            coll.wait(5)
        assert "rank 5 died" in str(ei.value) and "rank 0" in str(ei.value), str(ei.value)
        assert "closed its process group" not in str(ei.value)
        # a healthy close still says just that
        p2p = c1.irecv(2, memoryview(bytearray(8)), CHANNEL_P2P, 1)
        c2.close()
        with pytest.raises(PeerFailure) as ei:
            p2p.wait(5)
        assert "rank 2 closed its process group" in str(ei.value)
    finally:
        _close_all(ctxs)


# --------------------------------------------------------------------------- 8. handshake
SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))


def _hello(secret=SECRET, magic=handshake.MAGIC, version=handshake.VERSION, src=1, dst=0,
           index=0, nconns=2, job_id=None) -> bytes:
    job_id = handshake.job_id_from_secret(secret) if job_id is None else job_id
    return handshake.HELLO.pack(magic, version, 0, job_id, src, dst, index, nconns, os.urandom(16))


def _accept_async(sock, secret=SECRET, my_rank=0, world=4, nconns=2, timeout=2.0, decide=None):
    """Run accept_side on a thread, as Context does; drop the connection when it ends."""
    res: dict = {}

    def run():
        sock.settimeout(timeout)
        try:
            res["ok"] = handshake.accept_side(sock, secret, my_rank, world, nconns, decide)
        except BaseException as e:
            res["err"] = e
        finally:
            sock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, res


def _accept_result(t, res):
    t.join(10)
    assert not t.is_alive(), "accept_side did not return"
    return res


def _drained(sock, timeout=5.0) -> bytes:
    """Everything the other end sends until it closes."""
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            b = sock.recv(65536)
        except ConnectionResetError:
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


@pytest.mark.timeout(30)
def test_handshake_correct_pair():
    a, b = socket.socketpair()
    with a:
        t, res = _accept_async(b, world=4, nconns=3)
        a.settimeout(5)
        handshake.connect_side(a, SECRET, 2, 0, 1, 3)
        assert _accept_result(t, res) == {"ok": (2, 1)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer", ["ACK", "DECLINE", "GONE"])
def test_handshake_answers(answer):
    """The acceptor's verdict reaches the connector as its own outcome: DECLINE (the link is
    made the other way: wait for it) differs from GONE (no link either way: fail the peer)."""
    a, b = socket.socketpair()
    t, res = _accept_async(b, timeout=5.0, decide=lambda peer, index: getattr(handshake, answer))
    with a:
        a.settimeout(5)
        if answer == "ACK":
            handshake.connect_side(a, SECRET, 2, 0, 1, 2)
        else:
            want = handshake.Declined if answer == "DECLINE" else handshake.Gone
            with pytest.raises(want) as ei:
                handshake.connect_side(a, SECRET, 2, 0, 1, 2)
            assert "rank 0" in str(ei.value)
            if answer == "GONE":
                assert not isinstance(ei.value, handshake.Declined)
    res = _accept_result(t, res)
    if answer == "ACK":
        assert res == {"ok": (2, 1)}
    else:
        assert isinstance(res.get("err"), handshake.Declined if answer == "DECLINE" else handshake.Gone)


@pytest.mark.timeout(60)
def test_lazy_dial_to_a_closing_rank_fails_at_once():
    """A lazy dial that a closing rank's listener still accepts is answered GONE: the dialer
    fails that peer at once, not after LINERATE_CONNECT_TIMEOUT (taking the answer for "the
    link is made the other way" and waiting would leave a pending receive hanging)."""
    if CURRENT_TRANSPORT["transport"] != "tcp":
        pytest.skip("lazy links are TCP's")
    ctxs = make_mesh(2, nsocks=2, connect="lazy", connect_timeout=30.0)
    try:
        c0, c1 = ctxs
        # Rank 0 is closing: its set-up is given up, but its listener still takes connections
        # (the window between the two in a real close).
        with c0._maker._cond:
            c0._maker._stop = True
        t0 = time.monotonic()
        r = c1.irecv(0, memoryview(bytearray(8)), CHANNEL_P2P, 1)
        with pytest.raises(PeerFailure) as ei:
            r.wait(10)
        assert time.monotonic() - t0 < 5.0
        assert ei.value.peer == 0 and "rank 0" in str(ei.value), ei.value
    finally:
        _close_all(ctxs)


BAD_HELLOS = {
    "random_bytes": lambda: b"\x00" + os.urandom(handshake.HELLO.size - 1),
    "short_random_bytes": lambda: os.urandom(10),
    "wrong_magic": lambda: _hello(magic=b"GET "),
    "wrong_version": lambda: _hello(version=handshake.VERSION + 1),
    "wrong_job": lambda: _hello(secret=OTHER_SECRET),
    "wrong_dst_rank": lambda: _hello(dst=3),
    "src_is_self": lambda: _hello(src=0),
    "src_out_of_range": lambda: _hello(src=4),
    "nconns_differ": lambda: _hello(nconns=3),
    "index_out_of_range": lambda: _hello(index=2),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(BAD_HELLOS))
def test_handshake_rejects_bad_hello(case):
    a, b = socket.socketpair()
    with a:
        t, res = _accept_async(b)
        a.sendall(BAD_HELLOS[case]())
        if case == "short_random_bytes":
            a.shutdown(socket.SHUT_WR)
        assert _drained(a) == b"", "the acceptor answered a bad hello"
        res = _accept_result(t, res)
    assert isinstance(res.get("err"), handshake.HandshakeError), res


def test_one_connection_per_link_across_hosts_with_auto_nsocks():
    """LINERATE_NSOCKS auto, one rail: 2 connections per peer, but 1 to a rank of another
    host once the layout shows hosts of several ranks (their columns run side by side); a set
    LINERATE_NSOCKS is kept; before the plan the count is unknown (None) only where it may
    change."""
    from linerate.transport.options import TransportOptions
    from linerate.transport.tcp import TcpMesh
    opts = TransportOptions(nsocks=2)
    for auto, layout, want in ((True, ((0, 1), (2, 3)), {1: 2, 2: 1, 3: 1}),
                               (False, ((0, 1), (2, 3)), {1: 2, 2: 2, 3: 2}),
                               (True, ((0,), (1,), (2,), (3,)), {1: 2, 2: 2, 3: 2}),
                               (True, None, {1: 2, 2: 2, 3: 2})):
        mesh = TcpMesh(0, 4, SECRET, opts, ["127.0.0.1"], None, 5.0, nsocks_auto=auto)
        assert mesh._nconns(2, False) == (None if auto else 2)
        mesh.plan_rails(layout)
        assert {p: mesh._nconns(p) for p in (1, 2, 3)} == want, (auto, layout)


@pytest.mark.timeout(30)
def test_handshake_checks_unplanned_nconns_once_authenticated():
    """Where this rank's connections per peer are not planned yet (TcpMesh.plan_rails waits
    for the group's layout), a HELLO is answered, and the count checked (waiting for the plan)
    only once the peer proved the secret: a stranger never holds the acceptor up."""
    calls = []

    def nconns(peer, wait):
        calls.append((peer, wait))
        return 1 if wait else None

    a, b = socket.socketpair()
    with a:  # a stranger with the job id: its CHALLENGE, then dropped at AUTH
        t, res = _accept_async(b, nconns=nconns)
        a.settimeout(5)
        a.sendall(_hello(nconns=1))
        assert handshake.recv_exact(a, handshake.CHALLENGE.size)[:4] == handshake.MAGIC
        a.sendall(os.urandom(handshake.AUTH_SIZE))
        assert _drained(a) == b""
        res = _accept_result(t, res)
    assert isinstance(res.get("err"), handshake.HandshakeError), res
    assert calls == [(1, False)]
    for theirs, ok in ((1, True), (2, False)):  # a peer of the job: the planned count decides
        calls.clear()
        a, b = socket.socketpair()
        with a:
            t, res = _accept_async(b, nconns=nconns)
            a.settimeout(5)
            try:
                handshake.connect_side(a, SECRET, 1, 0, 0, theirs)
            except handshake.HandshakeError:
                pass
            res = _accept_result(t, res)
        assert calls == [(1, False), (1, True)]
        if ok:
            assert res.get("ok") == (1, 0), res
        else:
            assert "connections per peer" in str(res.get("err")), res


@pytest.mark.timeout(30)
def test_handshake_wrong_secret_connect_side():
    a, b = socket.socketpair()
    with a:
        t, res = _accept_async(b)
        a.settimeout(5)
        with pytest.raises(handshake.HandshakeError):
            handshake.connect_side(a, OTHER_SECRET, 1, 0, 0, 2)
        res = _accept_result(t, res)
    assert isinstance(res.get("err"), handshake.HandshakeError), res


@pytest.mark.timeout(30)
@pytest.mark.parametrize("auth", ["random", "replayed"])
def test_handshake_right_job_id_without_secret(auth):
    """A stranger who sniffed the (clear-text) job id, or replays an old AUTH, is refused."""
    a, b = socket.socketpair()
    with a:
        t, res = _accept_async(b)
        hello = _hello()
        a.sendall(hello)
        a.settimeout(5)
        challenge = handshake.recv_exact(a, handshake.CHALLENGE.size)
        assert handshake.CHALLENGE.unpack(challenge)[0] == handshake.MAGIC
        if auth == "random":
            a.sendall(os.urandom(handshake.AUTH_SIZE))
        else:  # what a sniffer captured from an earlier connection with another server nonce
            a.sendall(handshake._mac(SECRET, b"connector", hello, os.urandom(16)))
        assert _drained(a) == b"", "no ACK may follow a bad AUTH"
        res = _accept_result(t, res)
    err = res.get("err")
    assert isinstance(err, handshake.HandshakeError) and "authentication" in str(err), res


@pytest.mark.timeout(30)
def test_handshake_connector_rejects_impostor_listener():
    """A listener that does not hold the secret cannot make a rank send it data (or an AUTH)."""
    a, b = socket.socketpair()
    with a, b:
        got: dict = {}

        def impostor():
            b.settimeout(5)
            hello = handshake.recv_exact(b, handshake.HELLO.size)
            b.sendall(handshake.CHALLENGE.pack(handshake.MAGIC, handshake.VERSION,
                                               handshake.STATUS_OK, os.urandom(16), os.urandom(32)))
            got["after"] = _drained(b)
            got["hello"] = hello

        t = threading.Thread(target=impostor, daemon=True)
        t.start()
        a.settimeout(5)
        with pytest.raises(handshake.HandshakeError, match="secret"):
            handshake.connect_side(a, SECRET, 1, 0, 0, 2)
        a.close()
        t.join(10)
        assert got["after"] == b"", "the connector sent its AUTH to an impostor"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prefix", [b"", b"LNRT\x01"], ids=["silent", "half_hello"])
def test_handshake_silent_connection_times_out(prefix):
    """accept_side on a timed socket gives up on a peer that stops talking (Context sets that
    timeout). NOTE: it surfaces as socket.timeout (TimeoutError), not HandshakeError; Context
    catches both."""
    a, b = socket.socketpair()
    with a:
        a.sendall(prefix)
        t0 = time.monotonic()
        t, res = _accept_async(b, timeout=0.5)
        res = _accept_result(t, res)
        assert time.monotonic() - t0 < 5
        assert isinstance(res.get("err"), (handshake.HandshakeError, TimeoutError)), res
        assert _drained(a) == b""


@pytest.mark.timeout(60)
def test_handshake_context_listener_ignores_strangers():
    """Strangers at a real rank's listener while its mesh is being built are dropped, and the
    mesh still completes with only the real peer's connections."""
    store = _hash_store()
    opts = _opts(nsocks=2)
    ctxs: list = [None, None]

    def build(r):
        ctxs[r] = Context(store, r, 2, opts)

    t0 = threading.Thread(target=build, args=(0,), daemon=True)
    t0.start()
    (host, port), = json.loads(store.get(rendezvous.STORE_PREFIX + "addr/0").decode())
    strangers = {}
    try:
        strangers["silent"] = socket.create_connection((host, port), timeout=5)
        for name, data in [("random", b"\x00" + os.urandom(handshake.HELLO.size - 1)),
                           ("magic", _hello(magic=b"HTTP", secret=b"x" * 32)),
                           ("version", _hello(version=99, secret=b"x" * 32))]:
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(data)
            strangers[name] = s
        s = socket.create_connection((host, port), timeout=5)
        with pytest.raises(handshake.HandshakeError):  # wrong job secret
            handshake.connect_side(s, OTHER_SECRET, 1, 0, 0, 2)
        s.close()
        t1 = threading.Thread(target=build, args=(1,), daemon=True)
        t1.start()
        t0.join(30)
        t1.join(30)
        assert ctxs[0] is not None and ctxs[1] is not None
        for name in ("random", "magic", "version"):
            assert _drained(strangers[name]) == b"", name
        out = bytearray(5)
        r = ctxs[0].irecv(1, memoryview(out), CHANNEL_P2P, 0)
        ctxs[1].isend(0, memoryview(b"hello"), CHANNEL_P2P, 0).wait(10)
        r.wait(10)
        assert bytes(out) == b"hello"
        assert _wait_until(lambda: len(ctxs[0].connection_stats()) == 2, 5)  # lazy: first use
    finally:
        for s in strangers.values():
            s.close()
        _close_all(ctxs)


# --------------------------------------------------------------------------- protocol errors
@pytest.mark.timeout(60)
def test_protocol_violation_fails_the_peer():
    fake = FakePeer()
    try:
        r = fake.ctx.irecv(1, memoryview(bytearray(8)), CHANNEL_P2P, 1)
        fake.sock.sendall(bytes([9]) + bytes(framing.HEADER_SIZE - 1))  # unknown frame kind
        with pytest.raises(PeerFailure, match="protocol error") as ei:
            r.wait(5)
        assert ei.value.peer == 1
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_unexpected_message_over_limit_fails_the_peer():
    fake = FakePeer(max_unexpected_bytes=1 << 20)
    try:
        r = fake.ctx.irecv(1, memoryview(bytearray(8)), CHANNEL_P2P, 1)
        fake.data(CHANNEL_P2P, 2, 0, 2 << 20, 0, bytes(4096))  # nobody posted tag 2
        with pytest.raises(PeerFailure, match="LINERATE_MAX_UNEXPECTED_BYTES"):
            r.wait(5)
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_non_byte_memoryview_is_sent_correctly_or_rejected(transport):
    a = np.arange(3000, dtype=np.float32)
    b = np.zeros_like(a)
    with mesh(2, nsocks=1, chunk_bytes=4096) as (c0, c1):
        try:
            r = c1.irecv(0, memoryview(b), CHANNEL_P2P, 1)
            s = c0.isend(1, memoryview(a), CHANNEL_P2P, 1)
        except ValueError:
            return  # rejecting is fine
        s.wait(5)
        r.wait(5)
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- 9. framing
MAX_CHUNK = 1 << 20


def test_framing_round_trip():
    cases = [
        (framing.KIND_DATA, 3, CHANNEL_P2P, 100, 2**64 - 1, 7, 1000, 900, 0),
        (framing.KIND_DATA, 0, CHANNEL_COLLECTIVE, 0, 0, 0, 0, 0, 2**64 - 1),
        (framing.KIND_DATA, 255, CHANNEL_COLLECTIVE, MAX_CHUNK, 5, 2**64 - 1, MAX_CHUNK, 0, 12345),
        (framing.KIND_ERROR, 0, 0, framing.MAX_ERROR_BYTES, 0, 0, 0, 0, 0),
        (framing.KIND_CLOSE, 0, 0, 0, 0, 0, 0, 0, 0),
    ]
    for fields in cases:
        raw = framing.pack_header(*fields)
        assert len(raw) == framing.HEADER_SIZE == 48
        assert framing.unpack_header(raw, MAX_CHUNK) == fields
        assert framing.unpack_header(bytearray(raw), MAX_CHUNK) == fields
        assert framing.unpack_header(memoryview(raw), MAX_CHUNK) == fields


@pytest.mark.parametrize("fields,match", [
    ((0, 0, CHANNEL_P2P, 0, 0, 0, 0, 0), "kind"),
    ((6, 0, CHANNEL_P2P, 0, 0, 0, 0, 0), "kind"),
    ((255, 0, CHANNEL_P2P, 0, 0, 0, 0, 0), "kind"),
    ((framing.KIND_DATA, 0, 0, 0, 0, 0, 0, 0), "channel"),
    ((framing.KIND_DATA, 0, 3, 0, 0, 0, 0, 0), "channel"),
    ((framing.KIND_DATA, 0, CHANNEL_P2P, MAX_CHUNK + 1, 0, 0, 2 * MAX_CHUNK, 0), "limit"),
    ((framing.KIND_DATA, 0, CHANNEL_P2P, 2**32 - 1, 0, 0, 2**63, 0), "limit"),
    ((framing.KIND_DATA, 0, CHANNEL_P2P, 0, 0, 0, 10, 11), "outside"),
    ((framing.KIND_DATA, 0, CHANNEL_P2P, 5, 0, 0, 10, 6), "outside"),
    ((framing.KIND_DATA, 0, CHANNEL_P2P, 1, 0, 0, 0, 0), "outside"),
    ((framing.KIND_DATA, 0, CHANNEL_P2P, 10, 0, 0, 2**64 - 1, 2**64 - 5), "outside"),
    ((framing.KIND_ERROR, 0, 0, framing.MAX_ERROR_BYTES + 1, 0, 0, 0, 0), "exceeds"),
    ((framing.KIND_CLOSE, 0, 0, 1, 0, 0, 0, 0), "CLOSE"),
    ((framing.KIND_QUERY, 0, 0, 1, 0, 0, 0, 0), "QUERY"),
    ((framing.KIND_PROGRESS, 0, 0, 8, 7, 0, 0, 0), "PROGRESS"),
])
def test_framing_rejects(fields, match):
    with pytest.raises(framing.FrameError, match=match):
        framing.unpack_header(framing.pack_header(*fields), MAX_CHUNK)


def test_framing_fuzz():
    rng = random.Random(1234)
    decoded = 0
    for i in range(5000):
        if i % 2:
            raw = rng.randbytes(framing.HEADER_SIZE)
        else:  # plausible headers reach the deeper checks
            raw = framing.pack_header(
                rng.choice([0, 1, 2, 3, 4, 5, 6, 255]), rng.randrange(256), rng.choice([0, 1, 2, 3, 65535]),
                rng.choice([0, 1, MAX_CHUNK, MAX_CHUNK + 1, rng.randrange(2**32)]),
                rng.randrange(2**64), rng.randrange(2**64),
                rng.choice([0, 1, MAX_CHUNK, rng.randrange(2**64)]),
                rng.choice([0, 1, rng.randrange(2**64)]), rng.randrange(2**64))
        try:
            kind, _op, channel, length, _tag, _no, total, offset, _call = framing.unpack_header(
                raw, MAX_CHUNK)
        except framing.FrameError:
            continue
        decoded += 1
        assert kind in (framing.KIND_DATA, framing.KIND_ERROR, framing.KIND_CLOSE,
                        framing.KIND_QUERY, framing.KIND_PROGRESS)
        if kind == framing.KIND_DATA:
            assert channel in (CHANNEL_COLLECTIVE, CHANNEL_P2P)
            assert length <= MAX_CHUNK and offset + length <= total
        elif kind == framing.KIND_ERROR:
            assert length <= framing.MAX_ERROR_BYTES
        else:
            assert length == 0
    assert decoded > 100  # the fuzz did exercise the accepting paths


# --------------------------------------------------------------------------- 10. options
def test_options_defaults():
    assert TransportOptions.from_env({}) == TransportOptions()


@pytest.mark.parametrize("text,value", [
    ("512K", 512 * 1024), ("1M", 1 << 20), ("1m", 1 << 20), ("4096", 4096), ("2MB", 2 << 20),
    ("1MiB", 1 << 20), (" 64k ", 64 * 1024), ("1.5M", 3 << 19), ("1G", 1 << 30),
])
def test_options_chunk_bytes(text, value):
    assert parse_size(text) == value
    assert TransportOptions.from_env({"LINERATE_CHUNK_BYTES": text}).chunk_bytes == value


def test_options_from_env():
    o = TransportOptions.from_env({
        "LINERATE_NSOCKS": "3", "LINERATE_CHUNK_BYTES": "1M",
        "LINERATE_SOCKET_IFNAME": " eth0, eth1 ", "LINERATE_CONNECT_TIMEOUT": "12.5",
        "LINERATE_MAX_UNEXPECTED_BYTES": "1G", "LINERATE_PREFER_IPV6": "yes",
        "UNRELATED": "whatever"})
    assert (o.nsocks, o.chunk_bytes, o.connect_timeout, o.max_unexpected_bytes, o.prefer_ipv6) == (
        3, 1 << 20, 12.5, 1 << 30, True)
    assert o.ifnames == ["eth0", "eth1"]
    assert TransportOptions.from_env({"LINERATE_NSOCKS": "3"}, nsocks=5).nsocks == 5
    with pytest.raises(TypeError):
        TransportOptions.from_env({}, no_such_option=1)


def test_options_from_os_environ(monkeypatch):
    monkeypatch.setenv("LINERATE_NSOCKS", "4")
    monkeypatch.setenv("LINERATE_CHUNK_BYTES", "512K")
    o = TransportOptions.from_env()
    assert (o.nsocks, o.chunk_bytes) == (4, 512 * 1024)


@pytest.mark.parametrize("var,text", [
    ("LINERATE_NSOCKS", "65"), ("LINERATE_NSOCKS", "-1"),
    ("LINERATE_CHUNK_BYTES", "1K"), ("LINERATE_CHUNK_BYTES", "4G"), ("LINERATE_CHUNK_BYTES", "0"),
    ("LINERATE_CONNECT_TIMEOUT", "0"), ("LINERATE_CONNECT_TIMEOUT", "-3"),
])
def test_options_rejects_out_of_range(var, text):
    with pytest.raises(ValueError, match=var):
        TransportOptions.from_env({var: text})




@pytest.mark.parametrize("var,text", [
    (v, t) for v, t in [
        ("LINERATE_NSOCKS", "three"), ("LINERATE_NSOCKS", ""), ("LINERATE_NSOCKS", "2.5"),
        ("LINERATE_CHUNK_BYTES", "12Q"), ("LINERATE_CHUNK_BYTES", "lots"),
        ("LINERATE_CONNECT_TIMEOUT", "soon"), ("LINERATE_MAX_UNEXPECTED_BYTES", "x"),
        ("LINERATE_PREFER_IPV6", "maybe"),
    ]])
def test_options_rejects_unparsable_naming_variable(var, text):
    with pytest.raises(ValueError, match=var):
        TransportOptions.from_env({var: text})


@pytest.mark.parametrize("var,text", [
    ("LINERATE_TRANSPORT", "infiniband"), ("LINERATE_TRANSPORT", ""), ("LINERATE_RDMA_GID_INDEX", "x"),
    ("LINERATE_RDMA_GID_INDEX", "-5"),
])
def test_options_rejects_bad_transport_settings(var, text):
    with pytest.raises(ValueError, match=var):
        TransportOptions.from_env({var: text})


def test_options_transport_settings():
    o = TransportOptions.from_env({"LINERATE_TRANSPORT": " RDMA ", "LINERATE_RDMA_DEVICE": "mlx5_0:1, mlx5_1",
                                   "LINERATE_RDMA_GID_INDEX": "3"})
    assert (o.transport, o.rdma_ports, o.rdma_gid_index) == ("rdma", ["mlx5_0:1", "mlx5_1"], 3)
    assert TransportOptions().transport == "tcp"
    with pytest.raises(ValueError, match="LINERATE_TRANSPORT"):
        TransportOptions(transport="udp").validate()


def test_options_unparsable_still_value_error():
    """Whatever the message, a bad value is a ValueError (not a crash of another kind)."""
    for var, text in [("LINERATE_NSOCKS", "three"), ("LINERATE_CHUNK_BYTES", "12Q"),
                      ("LINERATE_CHUNK_BYTES", "lots"), ("LINERATE_CONNECT_TIMEOUT", "soon"),
                      ("LINERATE_PREFER_IPV6", "maybe"), ("LINERATE_MAX_UNEXPECTED_BYTES", "x")]:
        with pytest.raises(ValueError):
            TransportOptions.from_env({var: text})


def test_fd_limit_raised_for_the_connections_a_group_may_need():
    """A group may link every pair (an all-to-all): its TcpMesh raises the soft RLIMIT_NOFILE
    to what that needs (a 1024 default runs out near 500 ranks), up to the hard limit."""
    import subprocess
    import sys
    code = r'''
import resource
from linerate.transport import tcp
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
got = tcp.raise_fd_limit(600)
assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got, got
assert got >= min(hard, 600), (got, hard)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
assert tcp.raise_fd_limit(10) == hard  # never lowered
print("ok", got)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


def test_a_rank_waits_for_rank_0s_record_past_the_stores_own_timeout():
    """The group's timeout is the Store's too (torch sets both from init_process_group's
    ``timeout``), and may be a few seconds; rank 0 may reach set-up later than that (imports, a
    loaded host). Waiting for its agreement record follows LINERATE_CONNECT_TIMEOUT, as every
    other set-up wait does, not the Store's timeout."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=0.2))
    got = {}

    def rank1():
        rv = rendezvous.Rendezvous(store, 1, time.monotonic() + 30, 30.0, "late/")
        try:
            got[1] = rv.agree({"LINERATE_X": "1"})
        except Exception as e:  # noqa: BLE001 - the assertion shows it
            got[1] = e

    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(1.0)  # five times the Store's timeout
    secret = rendezvous.Rendezvous(store, 0, time.monotonic() + 30, 30.0, "late/").agree(
        {"LINERATE_X": "1"})
    t.join(30)
    assert got[1] == secret
