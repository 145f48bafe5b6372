"""The matching structure (transport/matching.py) on its own: no sockets, no threads.

A small driver plays the transport's part (posting receives, feeding chunks of messages as a
receiver thread would) and a randomized test compares many post/arrive orders with a
reference model: the k-th receive on a (peer, channel, tag) gets the k-th message sent on it.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from linerate.transport.framing import CHANNEL_COLLECTIVE as COLL, CHANNEL_P2P as P2P, FrameError
from linerate.transport.matching import Matcher, Mismatch, Staged


class Req:
    """What the matcher needs of a receive (request.Request's attributes)."""

    def __init__(self, peer, nbytes, channel, tag, opcode=0, call=0, desc=""):
        self.peer, self.channel, self.tag, self.opcode, self.call, self.desc = \
            peer, channel, tag, opcode, call, desc
        self.buf = memoryview(bytearray(nbytes))
        self.total = nbytes
        self.msgno = -1
        self.done_bytes = 0
        self.error = None
        self.result = None  # "ok" or the error it finished with

    def finish(self, err=None):
        assert self.result is None, "finished twice"
        self.result = err or "ok"


class Driver:
    def __init__(self, peers=(1, 2), **kw):
        self.m = Matcher(peers, **kw)
        self.mismatches = []

    def post(self, req, slot=None, peer_failed=False):
        with self.m.lock:
            if req.peer is None:
                staged = self.m.post_anysource(req)
            else:
                staged = self.m.post(req, slot, peer_failed)
        if staged is not None and staged is not False:
            self._deliver(staged, req)
        return req

    def _deliver(self, staged, req):
        if req.error is not None:
            err, req.error = req.error, None
            req.finish(err)
            return
        self.m.deliver(staged, req)
        req.finish()

    def chunk(self, peer, data, channel, tag, msgno, off, length, opcode=0, call=0):
        total = len(data)
        with self.m.lock:
            target, bad = self.m.incoming(peer, opcode, channel, tag, msgno, total, call)
            ready = self.m.take_ready()
        for staged, req in ready:
            self._deliver(staged, req)
        if bad is not None:
            self.mismatches.append(bad[1])
            if bad[0] is not None:
                bad[0].finish(bad[1])
        if target is None:
            return
        target.buf[off:off + length] = data[off:off + length]
        with self.m.lock:
            done = self.m.arrived(peer, target, channel, tag, msgno, length)
        if isinstance(done, tuple):
            self._deliver(*done)
        elif done is not None:
            done.finish()

    def message(self, peer, data, channel, tag, msgno, chunk=None, **kw):
        chunk = chunk or max(1, len(data))
        for off in range(0, max(1, len(data)), chunk):
            self.chunk(peer, data, channel, tag, msgno, off, min(chunk, len(data) - off), **kw)


def _bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_posted_then_arrives_and_staged_then_posted():
    d = Driver()
    a = d.post(Req(1, 10, P2P, 7))
    assert a.msgno == 0 and a.result is None
    d.message(1, _bytes(10, 1), P2P, 7, 0, chunk=3)
    assert a.result == "ok" and bytes(a.buf) == _bytes(10, 1)
    d.message(1, _bytes(6, 2), P2P, 7, 1)          # before its receive: staged
    assert d.m.staged_messages == 1 and d.m.staged_bytes == 6
    assert d.m.staged_for(1) == [(P2P, 7, 0)]
    b = d.post(Req(1, 6, P2P, 7))
    assert b.result == "ok" and bytes(b.buf) == _bytes(6, 2) and d.m.staged_bytes == 0


def test_staged_message_claimed_while_arriving_completes_on_the_last_chunk():
    d = Driver()
    data = _bytes(9, 3)
    d.chunk(1, data, P2P, 0, 0, 0, 4)
    r = d.post(Req(1, 9, P2P, 0))
    assert r.result is None
    d.chunk(1, data, P2P, 0, 0, 4, 5)
    assert r.result == "ok" and bytes(r.buf) == data


def test_slots_match_whatever_the_order():
    d = Driver()
    r1 = d.post(Req(1, 2, COLL, 5), slot=1)
    r0 = d.post(Req(1, 2, COLL, 5), slot=0)
    d.message(1, b"bb", COLL, 5, 1)
    d.message(1, b"aa", COLL, 5, 0)
    assert (bytes(r0.buf), bytes(r1.buf)) == (b"aa", b"bb")


def test_zero_length_messages_match():
    d = Driver()
    r = d.post(Req(2, 0, P2P, 1))
    d.message(2, b"", P2P, 1, 0)
    assert r.result == "ok"
    d.message(2, b"", P2P, 1, 1)
    assert d.post(Req(2, 0, P2P, 1)).result == "ok"


@pytest.mark.parametrize("recv_first", [True, False])
def test_mismatches_are_facts(recv_first):
    d = Driver()
    reqs = [Req(1, 4, COLL, 3, opcode=1, call=11, desc="a"),   # other opcode
            Req(1, 4, COLL, 3, opcode=2, call=12, desc="b"),   # other digest
            Req(1, 8, COLL, 3, opcode=2, call=11, desc="c")]   # other size
    for i, r in enumerate(reqs):
        if recv_first:
            d.post(r, slot=i)
            d.message(1, b"xxxx", COLL, 3, i, opcode=2, call=11)
        else:
            d.message(1, b"xxxx", COLL, 3, i, opcode=2, call=11)
            d.post(r, slot=i)
    reasons = [r.result.reason for r in reqs]
    assert reasons == ["op", "digest", "size"]
    m = reqs[1].result
    assert isinstance(m, Mismatch) and (m.peer, m.their_digest, m.my_digest, m.my_desc) == (1, 11, 12, "b")
    assert (reqs[2].result.their_total, reqs[2].result.my_total) == (4, 8)
    # p2p: only the size counts
    r = d.post(Req(2, 3, P2P, 0, opcode=9))
    d.message(2, b"xxxx", P2P, 0, 0)
    assert r.result.reason == "size"


def test_begin_call_flags_staged_and_arriving_messages_of_another_digest():
    d = Driver()
    d.message(1, b"zz", COLL, 4, 0, opcode=1, call=99)
    with d.m.lock:
        bad = d.m.begin_call(4, 100, "mine")
    assert bad.reason == "call" and (bad.their_digest, bad.my_digest, bad.my_desc) == (99, 100, "mine")
    d.message(2, b"zz", COLL, 4, 0, opcode=1, call=98)   # arrives during the call: dropped
    assert d.mismatches and d.mismatches[-1].peer == 2 and d.m.staged_for(2) == []
    with d.m.lock:
        d.m.end_call(4)
        assert d.m.begin_call(5, 1, "x") is None


def test_any_source_binds_to_staged_or_first_arrival():
    d = Driver(peers=(1, 2, 3))
    d.message(3, b"q", P2P, 8, 0)
    r = d.post(Req(None, 1, P2P, 8))
    assert r.peer == 3 and r.result == "ok"
    r2 = d.post(Req(None, 2, P2P, 8))
    assert r2.peer is None
    d.message(2, b"hi", P2P, 8, 0)
    assert r2.peer == 2 and bytes(r2.buf) == b"hi"
    # the next unslotted receive from 2 on tag 8 is its message 1
    r3 = d.post(Req(2, 1, P2P, 8))
    assert r3.msgno == 1
    with d.m.lock:
        assert d.m.post_anysource(Req(None, 1, P2P, 8), failed={1, 2, 3}) is False


def test_parked_any_source_receives_take_messages_that_started_out_of_order():
    """Message 1 of a peer starts (on another stream) before message 0: it is staged; when
    message 0 binds the first parked any-source receive, message 1 goes to the second."""
    d = Driver(peers=(1, 2))
    r0, r1 = d.post(Req(None, 3, P2P, 4)), d.post(Req(None, 3, P2P, 4))
    d.chunk(1, b"BBB", P2P, 4, 1, 0, 2)          # the start of message 1
    d.message(1, b"AAA", P2P, 4, 0)
    assert (r0.peer, r0.msgno, r0.result, bytes(r0.buf)) == (1, 0, "ok", b"AAA")
    assert (r1.peer, r1.msgno, r1.result) == (1, 1, None)
    d.chunk(1, b"BBB", P2P, 4, 1, 2, 1)
    assert (r1.result, bytes(r1.buf)) == ("ok", b"BBB")
    d.message(1, b"CCC", P2P, 4, 3)               # 3 before 2, both complete: staged
    d.message(1, b"DDD", P2P, 4, 2)
    r2, r3 = d.post(Req(None, 3, P2P, 4)), d.post(Req(None, 3, P2P, 4))
    assert [(r.msgno, bytes(r.buf)) for r in (r2, r3)] == [(2, b"DDD"), (3, b"CCC")]


def test_duplicate_post_and_bounds():
    d = Driver(max_unexpected_bytes=100)
    d.post(Req(1, 1, COLL, 0), slot=0)
    with pytest.raises(ValueError, match="already posted"):
        d.post(Req(1, 1, COLL, 0), slot=0)
    with pytest.raises(FrameError, match="LINERATE_MAX_UNEXPECTED_BYTES"):
        d.message(1, bytes(101), P2P, 0, 0)
    r = d.post(Req(1, 10, P2P, 1))
    d.chunk(1, bytes(10), P2P, 1, 0, 0, 5)
    with pytest.raises(FrameError, match="announces 12 bytes"):
        d.chunk(1, bytes(12), P2P, 1, 0, 5, 5)
    assert r.result is None


def test_failures_take_what_waits():
    d = Driver()
    a = d.post(Req(1, 4, COLL, 0))
    b = d.post(Req(1, 4, P2P, 0))
    d.chunk(1, bytes(4), P2P, 0, 0, 0, 2)            # b is being filled
    c = d.post(Req(None, 4, P2P, 5))
    d.chunk(2, bytes(8), P2P, 9, 0, 0, 4)            # staged, arriving
    w = d.post(Req(2, 8, P2P, 9))
    with d.m.lock:
        coll = d.m.take_channel(COLL)
        assert coll == [a]
        assert set(map(id, d.m.take_peer(1, anysource_too=True))) == {id(b), id(c)}
        assert d.m.take_channel(None) == [w]
    # the rest of a taken message is dropped or staged, never written into its old buffer
    d.chunk(1, bytes(4), P2P, 0, 0, 2, 2)
    assert b.result is None
    # a receive posted after its peer failed, with nothing staged, is refused
    with d.m.lock:
        assert d.m.post(Req(1, 1, P2P, 77), None, peer_failed=True) is None
    staged = d.m.peers[1].unexpected
    assert all(isinstance(s, Staged) for s in staged.values())


def test_staging_buffers_are_reused_up_to_keep_bytes():
    d = Driver(keep_bytes=16)
    for i in range(3):
        d.message(1, bytes(8), P2P, 0, i)
    bufs = [st.buf for st in d.m.peers[1].unexpected.values()]
    for i in range(3):
        d.post(Req(1, 8, P2P, 0))
    d.message(1, bytes(8), P2P, 0, 3)
    again = d.m.peers[1].unexpected[(P2P, 0, 3)].buf
    assert any(again is b for b in bufs)
    assert d.m._kept == 8  # 16 kept, one taken again


def test_fuzz_post_and_arrival_orders_against_a_reference():
    """Random interleavings of posts and chunk arrivals (striped chunks out of order, slotted
    and unslotted messages, any-source receives, zero-length ones) against the reference:
    every receive gets exactly its message's bytes, once."""
    rng = random.Random(1234)
    for case in range(300):
        peers = (1, 2, 3)
        d = Driver(peers)
        sent = {}     # (peer, channel, tag) -> list of payloads in send order
        events = []   # (kind, args)
        nmsg = rng.randint(1, 12)
        for i in range(nmsg):
            peer = rng.choice(peers)
            channel = rng.choice((COLL, P2P))
            tag = rng.randint(0, 2)
            size = rng.choice((0, 1, 7, 64, 300))
            anysrc = channel == P2P and rng.random() < 0.2
            if anysrc:  # any-source receives have a tag (and size) of their own
                tag, size = 9, 7
            data = bytes(rng.getrandbits(8) for _ in range(size))
            key = (peer, channel, tag)
            msgno = len(sent.setdefault(key, []))
            sent[key].append(data)
            chunk = rng.choice((1, 5, 64, 1000))
            pieces = [(off, min(chunk, size - off)) for off in range(0, max(1, size), chunk)]
            rng.shuffle(pieces)  # chunks of one message come in any order
            for off, n in pieces:
                events.append(("chunk", (peer, data, channel, tag, msgno, off, n)))
            events.append(("post", (None if anysrc else peer, size, channel, tag, key)))
        # Any interleaving, except that unslotted receives of one key are posted in the
        # order of its messages (the k-th receive is for the k-th message). Any-source
        # receives (all of one size) take whichever peer's next message comes first.
        rng.shuffle(events)
        fixed, seen = [], {}
        for ev in events:
            if ev[0] == "post" and ev[1][0] is not None:
                key = ev[1][4]
                k = seen.get(key, 0)
                seen[key] = k + 1
                size = len(sent[key][k])
                ev = ("post", (key[0], size, key[1], key[2], key))
            fixed.append(ev)
        seq = fixed
        got: dict = {}
        reqs = []
        for kind, args in seq:
            if kind == "chunk":
                d.chunk(*args)
            else:
                peer, size, channel, tag, key = args
                r = d.post(Req(peer, size, channel, tag))
                reqs.append((r, key))
        assert not d.mismatches, case
        for r, key in reqs:
            assert r.result == "ok", (case, key, r.result)
            real = (r.peer, key[1], key[2])
            got.setdefault(real, []).append((r.msgno, bytes(r.buf)))
        for real, items in got.items():
            for msgno, data in items:
                assert sent[real][msgno] == data, (case, real, msgno)
        assert d.m.staged_bytes == 0 and all(not p.unexpected and not p.inflight and not p.posted
                                             for p in d.m.peers.values()), case


def test_large_staging_buffers_are_mappings_of_their_own():
    """Staging buffers from ANON_BYTES on are anonymous mappings (unmapped when dropped, not
    left as allocator slack in a thread's arena); smaller ones come from the allocator."""
    import mmap
    import resource

    from linerate.transport.memory import ANON_BYTES, anon_bytes
    small, big = anon_bytes(ANON_BYTES - 1), anon_bytes(ANON_BYTES)
    assert not isinstance(small.obj, mmap.mmap) and isinstance(big.obj, mmap.mmap)
    assert len(small) == ANON_BYTES - 1 and len(big) == ANON_BYTES and not big.readonly

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    before = rss()
    buf = anon_bytes(64 << 20)
    buf[::4096] = b"\1" * (64 << 8)  # touch every page
    assert rss() - before >= 60 << 20
    del buf
    assert rss() - before < 4 << 20  # given back at once
