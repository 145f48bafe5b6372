"""One conformance suite for every link kind (transport/link.py is the specification).

Each case builds a pair of links between two ranks of this process, through the same set-up
as a Context (rendezvous on a HashStore, then TcpMesh or rdma.build_links), and drives them
only through the Link interface, with a recording sink in place of a Context:

    tcp       plain TCP, 2 connections, driven by the process's I/O loops (LINERATE_IO=shared)
    threads   plain TCP with a sender and a receiver thread per connection (LINERATE_IO=threads)
    mixed     rank 0 shared, rank 1 threads: the same bytes on the wire
    tls       TCP inside TLS (LINERATE_TLS), 2 connections
    rdma      RDMA streams over the fake pyverbs of tests/fake_pyverbs, 2 queue pairs
    shm       shared memory (transport/shm/ring.py): rings in the host's segment, 1 stream
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from linerate.transport import TransportOptions, rdma, rendezvous, shm, tcp, tls, verbs
from linerate.transport.shm import ring as shmlink
from linerate.transport.framing import CHANNEL_COLLECTIVE, CHANNEL_P2P, KIND_ERROR, KIND_QUERY
from linerate.transport.link import Link, LinkSink
from linerate.transport.request import PeerFailure, Request

from _harness import use_transport

KINDS = ["tcp", "threads", "mixed", "tls", "rdma", "shm"]
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from test_tls import _CA, _cert_reason
    reason = _cert_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("pki")
    ca = _CA(d, "job-ca")
    return {"ca": ca.cert, 0: ca.issue("rank0"), 1: ca.issue("rank1")}


class Sink(LinkSink):
    """Records what a link delivers: each message into a buffer of its own."""

    def __init__(self):
        self.cond = threading.Condition()
        self.bufs: dict = {}       # (channel, tag, msgno) -> bytearray
        self.got: dict = {}        # key -> bytes received so far
        self.done: list = []       # keys in completion order
        self.controls: list = []
        self.failures: list = []
        self.closed = 0
        self.readers: dict = {}    # key -> the name of the thread that claimed its first chunk

    def claim(self, link, opcode, channel, tag, msgno, total, digest, offset, length):
        key = (channel, tag, msgno)
        with self.cond:
            self.readers.setdefault(key, threading.current_thread().name)
            buf = self.bufs.get(key)
            if buf is None:
                buf = self.bufs[key] = bytearray(total)
                self.got[key] = 0
        return key, memoryview(buf)[offset:offset + length]

    def filled(self, link, key, channel, tag, msgno, length):
        with self.cond:
            self.got[key] += length
            if self.got[key] == len(self.bufs[key]):
                self.done.append(key)
                self.cond.notify_all()

    def control(self, link, kind, payload, value):
        with self.cond:
            self.controls.append((kind, payload, value))
            self.cond.notify_all()

    def link_failed(self, link, error):
        with self.cond:
            self.failures.append(error)
            self.cond.notify_all()

    def link_closed(self, link):
        with self.cond:
            self.closed += 1
            self.cond.notify_all()

    def wait(self, pred, timeout=20.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred():
                left = deadline - time.monotonic()
                assert left > 0, "timed out"
                self.cond.wait(left)


def _pair(kind, pki=None, nsocks=2):
    """Links 0->1 and 1->0, built as a Context builds them, and started with Sinks."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    out, errors = [None, None], []

    def build(rank):
        try:
            opts = TransportOptions(socket_ifname="lo", connect_timeout=20.0, nsocks=nsocks,
                                    chunk_bytes=CHUNK, transport="rdma" if kind == "rdma" else "tcp",
                                    io="threads" if kind == "threads" or (kind == "mixed" and rank) else "shared")
            deadline = time.monotonic() + 20
            rv = rendezvous.Rendezvous(store, rank, deadline, 20.0, f"linerate/links-{kind}/")
            secret = rv.agree(rendezvous.agreed_settings(opts, 1))
            if kind == "shm":
                seg, _ = shm.establish(rv, rank, 2, secret, "1", rv.prefix, rv.generation)
                links = shmlink.build_links(seg, rank, [1 - rank])
            elif kind == "rdma":
                ports = rdma.open_ports(rank, opts)
                links = rdma.build_links(rv, rank, 2, secret, opts, ports, 5.0, deadline, rv.prefix)
            else:
                cfg = None
                if kind == "tls":
                    cert, key = pki[rank]
                    cfg = tls.load(True, str(cert), str(key), str(pki["ca"]))
                mesh = tcp.TcpMesh(rank, 2, secret, opts, ["127.0.0.1"], cfg, 5.0)
                rv.publish_addresses(mesh.listen())
                links = mesh.links(mesh.connect(rv, deadline))
            out[rank] = links[1 - rank]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    sinks = [Sink(), Sink()]
    for link, sink in zip(out, sinks):
        link.start(sink)
    return out, sinks


@pytest.fixture(params=KINDS)
def kind(request, monkeypatch):
    if request.param == "rdma":
        use_transport("rdma-fake", monkeypatch)
        assert verbs.load().fake
        yield "rdma"
        verbs.reset()
    else:
        yield request.param


@pytest.fixture
def pair(kind, request):
    pki = request.getfixturevalue("pki") if kind == "tls" else None
    links, sinks = _pair(kind, pki)
    yield kind, links, sinks
    for link in links:
        link.begin_close()
    for link in links:
        link.close(time.monotonic() + 2)


def _send(link, data, channel=CHANNEL_P2P, tag=0, msgno=0, priority=0):
    req = Request(True, link.peer, memoryview(data), channel, tag, 1, "test")
    req.msgno = msgno
    req.priority = priority
    assert link.isend(req)
    return req


def _crash(link):
    """The process behind ``link`` vanishes: its streams end without CLOSE frames."""
    if link.kind == "shm":  # its pid, as the peer reads it, is a process that has exited
        import subprocess
        gone = subprocess.Popen(["true"])
        gone.wait()
        link._port.seg.pids[link._port.me, 0] = gone.pid
        return
    for st in link._streams:
        try:
            st.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def test_link_conformance(pair):
    """Properties; ordering; zero-length and odd sizes; a large message striped over every
    stream; buffer ownership; control frames; exact statistics."""
    kind, (a, b), (sa, sb) = pair
    assert isinstance(a, Link) and a.kind == {"rdma": "rdma", "shm": "shm"}.get(kind, "tcp")
    assert (a.peer, b.peer) == (1, 0) and a.nstreams == (1 if kind == "shm" else 2)
    assert a.speed_bps is None or a.speed_bps > 0
    # ordering and sizes: one key per message; both sides see each message intact
    sizes = [0, 1, 3, 4097, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 8 << 20]
    payloads = [os.urandom(n) for n in sizes]
    reqs = [_send(a, bytearray(p), tag=5, msgno=i) for i, p in enumerate(payloads)]
    for r in reqs:
        r.wait(20)
        assert r.buf is None  # finished: the link keeps no reference to the buffer
    sb.wait(lambda: len(sb.done) == len(sizes))
    for i, p in enumerate(payloads):
        assert bytes(sb.bufs[(CHANNEL_P2P, 5, i)]) == p, sizes[i]
    # the large message went over both streams. Which stream takes a chunk is up to the
    # streams' threads (the I/O loops with LINERATE_IO=shared): one the OS does not schedule
    # for the whole of an 8 MB loopback transfer carries none of it (possible on loaded
    # cores: beside a loaded suite it happened to the first three). So up to
    # twenty more large messages, each on streams already running: striping that never
    # hands a chunk to a second stream still fails, a loaded scheduler does not.
    per_conn = [c["sent_bytes"] for c in a.stats()["connections"]]
    extra_sizes = []
    while min(per_conn) == 0 and len(extra_sizes) < 20:
        extra_sizes.append(8 << 20)
        _send(a, bytearray(8 << 20), tag=6, msgno=len(extra_sizes)).wait(20)
        sb.wait(lambda: (CHANNEL_P2P, 6, len(extra_sizes)) in sb.done)
        per_conn = [c["sent_bytes"] for c in a.stats()["connections"]]
    assert len(per_conn) == a.nstreams and min(per_conn) > 0, per_conn
    # buffer ownership: once a send is finished its buffer may be reused at once
    buf = bytearray(os.urandom(3 << 20))
    orig = bytes(buf)
    r = _send(b, buf, channel=CHANNEL_COLLECTIVE, tag=9)
    r.wait(20)
    buf[:] = bytes(len(buf))
    sa.wait(lambda: (CHANNEL_COLLECTIVE, 9, 0) in sa.done)
    assert bytes(sa.bufs[(CHANNEL_COLLECTIVE, 9, 0)]) == orig
    # small messages, many at once, each intact (they may complete in any order: the
    # streams are independent; the message number says which is which)
    small = [os.urandom(100 + i) for i in range(20)]
    for r in [_send(b, bytearray(p), tag=7, msgno=i) for i, p in enumerate(small)]:
        r.wait(20)
    sa.wait(lambda: sum(1 for k in sa.done if k[1] == 7) == 20)
    assert [bytes(sa.bufs[(CHANNEL_P2P, 7, i)]) for i in range(20)] == small
    # control frames carry their payload and value
    assert a.send_control(KIND_ERROR, "rank 0: boom ✓".encode(), 0)
    assert a.send_control(KIND_QUERY, b"", 0)
    sb.wait(lambda: len(sb.controls) == 2)  # over any stream: in any order
    assert sorted(sb.controls) == [(KIND_ERROR, "rank 0: boom ✓".encode(), 0), (KIND_QUERY, b"", 0)]
    # statistics: payload bytes and messages, exactly, both ways
    sizes = sizes + extra_sizes
    sent_a = sum(sizes)
    sent_b = len(orig) + sum(100 + i for i in range(20))
    sa_st, sb_st = a.stats(), b.stats()
    assert (sa_st["bytes_sent"], sa_st["bytes_received"]) == (sent_a, sent_b)
    assert (sb_st["bytes_sent"], sb_st["bytes_received"]) == (sent_b, sent_a)
    assert (sa_st["messages_sent"], sa_st["messages_received"]) == (len(sizes), 21)
    assert (sb_st["messages_sent"], sb_st["messages_received"]) == (21, len(sizes))
    assert sa_st["state"] == "up" and sa_st["peer"] == 1 and sa_st["kind"] == a.kind
    assert sum(c["received_bytes"] for c in sb_st["connections"]) == sent_a
    assert not sa.failures and not sb.failures


def test_link_peer_death_and_close(kind, request):
    """Ordering on one stream. A peer that vanishes: an error naming it, and the link
    refuses new sends. A link
    closed with sends pending: every send is finished by the link or handed back by cancel,
    and the peer learns that the link ended."""
    pki = request.getfixturevalue("pki") if kind == "tls" else None
    (a, b), (sa, sb) = _pair(kind, pki, nsocks=1)
    try:
        # one stream: messages arrive in the order they were queued, whatever their sizes
        sizes = [1, 5 * CHUNK, 0, 3, CHUNK + 1, 10]
        for i, n in enumerate(sizes):
            _send(a, bytearray(n), tag=1, msgno=i)
        sb.wait(lambda: len(sb.done) == len(sizes))
        assert [k[2] for k in sb.done] == list(range(len(sizes)))
        _crash(b)
        sa.wait(lambda: sa.failures)
        err = sa.failures[0]
        assert isinstance(err, PeerFailure) and err.peer == 1 and "rank 1" in str(err), err
        assert a.stats()["state"] == "failed"
        req = Request(True, 1, memoryview(bytearray(4)), CHANNEL_P2P, 2, 1, "after")
        assert a.isend(req) is False and not req.is_completed()
    finally:
        for link in (a, b):
            link.begin_close()
            link.close(time.monotonic() + 1)
    # close while pending
    (a, b), (sa, sb) = _pair(kind, pki)
    try:
        reqs = [_send(a, bytearray(1 << 20), tag=3, msgno=i) for i in range(16)]
        a.begin_close()
        a.close(time.monotonic() + 0.2)
        handed_back = a.cancel(None, underway=True)
        for r in handed_back:
            r.finish(RuntimeError("closed"))
        for r in reqs:  # finished by the link, or by us above: none is left hanging
            try:
                r.wait(5)
            except RuntimeError:  # one of ours (a TimeoutError is not)
                pass
        assert a.isend(Request(True, 1, memoryview(bytearray(1)), CHANNEL_P2P, 4, 1, "x")) is False
        sb.wait(lambda: sb.closed or sb.failures)
        if sb.failures:
            assert all("rank 0" in str(e) for e in sb.failures), sb.failures
        assert a.stats()["state"] == "closed"
    finally:
        b.begin_close()
        b.close(time.monotonic() + 1)


def _gated_pair(kind, request):
    """A pair of one stream each, whose receiving side (b's sink) can be made to stop reading:
    ``stop_reading()`` holds each next message's claim until ``gate`` is set (its buffers
    fill, so its peer's writes block)."""
    pki = request.getfixturevalue("pki") if kind == "tls" else None
    links, sinks = _pair(kind, pki, nsocks=1)
    gate = threading.Event()
    sb = sinks[1]
    claim = sb.claim

    def slow_claim(*args):
        gate.wait(30)
        return claim(*args)

    def stop_reading():
        sb.claim = slow_claim

    return links, sinks, gate, stop_reading


def test_isend_now(kind, request):
    """isend_now (what a Context's post calls) delivers on every kind, small and large. A
    threads TCP link writes a small message posted on an idle link in the caller's thread (its
    request complete when the call returns); what the socket cannot take at once (the peer
    reads nothing meanwhile) goes on with the stream's sender, in order, and arrives whole."""
    (a, b), (sa, sb), gate, stop_reading = _gated_pair(kind, request)

    def post(data, msgno):
        req = Request(True, a.peer, memoryview(data), CHANNEL_P2P, 9, 1, "test")
        req.msgno = msgno
        assert a.isend_now(req)
        return req

    direct = kind == "threads"
    try:
        sizes = [0, 1, 4096, CHUNK - 1, 3 * CHUNK + 5]
        payloads = [os.urandom(n) for n in sizes]
        for i, p in enumerate(payloads):
            if direct:  # the stream's sender waits for work: nothing is queued
                deadline = time.monotonic() + 10
                while not all(st.idle for st in a._streams):
                    assert time.monotonic() < deadline, "the sender never went idle"
                    time.sleep(0.001)
            req = post(bytearray(p), i)
            if direct and len(p) <= 4096:  # (what the kernel's smallest send buffer holds)
                assert req.is_completed() and req.error is None, (i, len(p))
            req.wait(20)
            sb.wait(lambda: (CHANNEL_P2P, 9, i) in sb.done)
            assert bytes(sb.bufs[(CHANNEL_P2P, 9, i)]) == p, i
        if direct:
            # The peer reads the first header, then nothing until the gate: messages of 60 KB,
            # each posted on the idle link, fill the kernel's buffers until one does not fit
            # at once (its request still open when the call returns: the sender has the rest).
            stop_reading()
            bigs, reqs = [], []
            while not reqs or reqs[-1].is_completed():
                assert len(reqs) < 500, "the kernel took 30 MB without the peer reading"
                deadline = time.monotonic() + 10
                while not a._streams[0].idle:
                    assert time.monotonic() < deadline, "the sender never went idle"
                    time.sleep(0.001)
                bigs.append(os.urandom(60000))
                reqs.append(post(bytearray(bigs[-1]), 100 + len(reqs)))
            follow = post(bytearray(b"after"), 99)  # queued behind the rest
            gate.set()
            for r in reqs + [follow]:
                r.wait(20)
            keys = [(CHANNEL_P2P, 9, 100 + i) for i in range(len(bigs))] + [(CHANNEL_P2P, 9, 99)]
            sb.wait(lambda: all(k in sb.done for k in keys))
            for k, data in zip(keys, bigs + [b"after"]):
                assert bytes(sb.bufs[k]) == data, k
        assert not sa.failures and not sb.failures
    finally:
        gate.set()
        for link in (a, b):
            link.begin_close()
            link.close(time.monotonic() + 1)


def test_isend_now_from_several_threads(kind, request):
    """Threads posting at once through isend_now (callers writing on idle streams, senders
    taking what is queued, rests handed over): every message arrives whole, none twice."""
    pki = request.getfixturevalue("pki") if kind == "tls" else None
    (a, b), (sa, sb) = _pair(kind, pki)
    rng = __import__("random").Random(7)
    plan = [[os.urandom(rng.choice((0, 1, 100, 4096, 20000, 70000, 300000))) for _ in range(60)]
            for _ in range(4)]
    reqs, errors = [], []

    def poster(t: int) -> None:
        try:
            for i, data in enumerate(plan[t]):
                req = Request(True, a.peer, memoryview(bytearray(data)), CHANNEL_P2P, 20 + t, 1,
                              "test")
                req.msgno = i
                assert a.isend_now(req)
                reqs.append(req)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        for r in reqs:
            r.wait(30)
        keys = [(CHANNEL_P2P, 20 + t, i) for t in range(4) for i in range(60)]
        sb.wait(lambda: len(sb.done) >= len(keys), timeout=60)
        assert sorted(sb.done) == sorted(keys)
        for t in range(4):
            for i, data in enumerate(plan[t]):
                assert bytes(sb.bufs[(CHANNEL_P2P, 20 + t, i)]) == data, (t, i)
        assert not sa.failures and not sb.failures
    finally:
        for link in (a, b):
            link.begin_close()
        for link in (a, b):
            link.close(time.monotonic() + 2)


class _Arrived:
    """What ``Link.drive`` waits for in these tests: a message in a Sink, or a failure."""

    def __init__(self, sink: Sink, key, total: int = 0, control: bool = False):
        self.sink, self.key, self.total, self.control = sink, key, total, control

    def is_completed(self) -> bool:
        s = self.sink
        return ((self.key in s.done and (s.controls or not self.control))
                or bool(s.failures))


def test_drive(kind, request):
    """Link.drive, a caller reading its own receive: on every kind what arrives is delivered
    whole and in order, whoever reads it (a kind that cannot be driven returns at once). A
    threads TCP link is read in the caller's thread for messages of at most DIRECT_BYTES
    (larger ones, striped over both streams, are left to the receivers, which read again),
    control frames too. After a drive the receivers stay parked while no caller drives, and
    read again once it is reclaimed or LEND_IDLE_S has passed; a drive with nothing coming
    returns at its deadline, spinning or not (a message that comes during the spin is read by
    the caller); a peer that vanishes during a drive is reported as the receivers report
    it."""
    pki = request.getfixturevalue("pki") if kind == "tls" else None
    (a, b), (sa, sb) = _pair(kind, pki)
    me = threading.current_thread().name
    lendable = kind in ("threads", "mixed")  # (b: rank 1, threads in both)
    try:
        b.LEND_IDLE_S = 30.0  # (this instance's: no reclaim by idleness below until changed)
        sizes = [0, 1, 4096, 64 << 10, 4097, (64 << 10) + 1, 3 * CHUNK + 7, 4 << 20, 5]
        parked = False
        for i, n in enumerate(sizes):
            data = os.urandom(n)
            _send(a, bytearray(data), tag=7, msgno=i)
            key = (CHANNEL_P2P, 7, i)
            t0 = time.monotonic()
            b.drive(_Arrived(sb, key, n), t0 + 30)
            sb.wait(lambda: key in sb.done)
            assert bytes(sb.bufs[key]) == data, n
            small = n <= 64 << 10
            assert b.lent is (lendable and small), n
            if lendable and small and parked:  # (a drive before parked the receivers)
                assert sb.readers[key] == me, (n, sb.readers[key])
            elif lendable and not small:
                assert sb.readers[key].startswith("linerate-recv"), (n, sb.readers[key])
            parked = lendable and small
        assert [k[2] for k in sb.done] == list(range(len(sizes)))
        # a control frame ahead of a message is delivered by whoever reads (the two may take
        # different streams: the caller waits for both, as the receivers are parked)
        assert a.send_control(KIND_QUERY)
        _send(a, bytearray(b"after the query"), tag=8)
        b.drive(_Arrived(sb, (CHANNEL_P2P, 8, 0), control=True), time.monotonic() + 30)
        sb.wait(lambda: (CHANNEL_P2P, 8, 0) in sb.done and sb.controls)
        assert sb.controls[0][0] == KIND_QUERY
        # nothing coming: back at the deadline (at once where the kind cannot be driven)
        t0 = time.monotonic()
        b.drive(_Arrived(sb, (CHANNEL_P2P, 9, 0)), t0 + 0.3)
        took = time.monotonic() - t0
        assert (0.25 <= took < 10) if lendable else took < 0.25, took
        if lendable:
            # parked receivers read nothing until reclaimed...
            _send(a, bytearray(b"parked"), tag=9)
            time.sleep(0.3)
            assert (CHANNEL_P2P, 9, 0) not in sb.done
            b.reclaim()
            assert not b.lent
            sb.wait(lambda: (CHANNEL_P2P, 9, 0) in sb.done)
            assert sb.readers[(CHANNEL_P2P, 9, 0)].startswith("linerate-recv")
            # ...or until no caller has driven for LEND_IDLE_S
            b.LEND_IDLE_S = 0.05
            _send(a, bytearray(b"one"), tag=10)
            b.drive(_Arrived(sb, (CHANNEL_P2P, 10, 0)), time.monotonic() + 30)
            assert b.lent
            _send(a, bytearray(b"two"), tag=10, msgno=1)
            sb.wait(lambda: (CHANNEL_P2P, 10, 1) in sb.done)
            assert sb.readers[(CHANNEL_P2P, 10, 1)].startswith("linerate-recv")
            assert not b.lent
        else:
            _send(a, bytearray(b"parked"), tag=9)
            sb.wait(lambda: (CHANNEL_P2P, 9, 0) in sb.done)
        # spinning: a message that comes while the caller looks without sleeping is the
        # caller's to read; with nothing coming, the drive still ends at its deadline
        b.LEND_IDLE_S = 30.0
        threading.Timer(0.05, _send, (a, bytearray(b"spun")), {"tag": 12}).start()
        b.drive(_Arrived(sb, (CHANNEL_P2P, 12, 0)), time.monotonic() + 30, spin=5.0)
        sb.wait(lambda: (CHANNEL_P2P, 12, 0) in sb.done)
        assert bytes(sb.bufs[(CHANNEL_P2P, 12, 0)]) == b"spun"
        if lendable:
            assert sb.readers[(CHANNEL_P2P, 12, 0)] == me
        t0 = time.monotonic()
        b.drive(_Arrived(sb, (CHANNEL_P2P, 13, 0)), t0 + 0.3, spin=5.0)
        took = time.monotonic() - t0
        assert (0.25 <= took < 10) if lendable else took < 0.25, took
        # the peer vanishes while a caller drives: the failure names it, the drive returns
        threading.Timer(0.2, _crash, (a,)).start()
        t0 = time.monotonic()
        b.drive(_Arrived(sb, (CHANNEL_P2P, 11, 0)), t0 + 30)
        sb.wait(lambda: sb.failures)
        assert time.monotonic() - t0 < 10
        err = sb.failures[0]
        assert isinstance(err, PeerFailure) and err.peer == 0 and "rank 0" in str(err), err
    finally:
        for link in (a, b):
            link.begin_close()
        for link in (a, b):
            link.close(time.monotonic() + 2)


def test_drive_reads_the_other_awaited_links_in_the_same_loop(kind, request):
    """Link.drive's ``also``: a caller that waits for one peer's small message reads the
    other links it awaits (of its kind, where they can be lent) in the same loop, each
    message as it comes, not once its own has come (a group that times each peer's arrival
    would time the early one late); a kind that cannot be driven returns at once and its
    threads read everything."""
    pki = request.getfixturevalue("pki") if kind == "tls" else None
    (a1, b1), (_, s1) = _pair(kind, pki)
    (a2, b2), (_, s2) = _pair(kind, pki)
    me = threading.current_thread().name
    lendable = kind in ("threads", "mixed")
    at: dict = {}

    def stamped(sink, n):
        filled = sink.filled

        def f(link, key, *rest):
            filled(link, key, *rest)
            at.setdefault(n, time.monotonic())
        return f
    s1.filled, s2.filled = stamped(s1, 1), stamped(s2, 2)
    try:
        for link in (b1, b2):
            link.LEND_IDLE_S = 30.0  # (no reclaim by idleness in this test)
        key = (CHANNEL_P2P, 3, 0)
        b2.drive(_Arrived(s2, (CHANNEL_P2P, 2, 0)), time.monotonic() + 0.05)  # b2 parked
        _send(a2, bytearray(b"early"), tag=3)
        threading.Timer(1.0, _send, (a1, bytearray(b"late")), {"tag": 3}).start()
        t0 = time.monotonic()
        b1.drive(_Arrived(s1, key), t0 + 30, 0.0, also=[b2])
        s1.wait(lambda: key in s1.done)
        s2.wait(lambda: key in s2.done)
        assert bytes(s1.bufs[key]) == b"late" and bytes(s2.bufs[key]) == b"early"
        assert at[2] - t0 < 0.9 and at[1] - t0 >= 0.95, (at[1] - t0, at[2] - t0)
        if lendable:
            assert s1.readers[key] == me and s2.readers[key] == me
            assert b1.lent and b2.lent
        else:
            assert s2.readers[key] != me
        # a large message on a link read beside: the caller reads it frame by frame until its
        # own message is there; the link's receivers read the rest once reclaimed
        big = os.urandom(3 * CHUNK + 7)
        _send(a2, bytearray(big), tag=4)
        threading.Timer(0.05, _send, (a1, bytearray(b"small")), {"tag": 4}).start()
        b1.drive(_Arrived(s1, (CHANNEL_P2P, 4, 0)), time.monotonic() + 30, 0.0, also=[b2])
        s1.wait(lambda: (CHANNEL_P2P, 4, 0) in s1.done)
        b2.reclaim()
        s2.wait(lambda: (CHANNEL_P2P, 4, 0) in s2.done)
        assert bytes(s2.bufs[(CHANNEL_P2P, 4, 0)]) == big
    finally:
        for link in (a1, b1, a2, b2):
            link.begin_close()
        for link in (a1, b1, a2, b2):
            link.close(time.monotonic() + 2)


def test_link_flush_control(kind, request):
    """flush_control: True once the control frames queued so far have reached the peer's side;
    while the peer reads nothing (its buffers full, a large message ahead) False by its
    deadline, not later; once the peer has read again, True, and the frame is there. On a
    link that is down, False at once."""
    (a, b), (sa, sb), gate, stop_reading = _gated_pair(kind, request)

    try:
        assert a.send_control(KIND_ERROR, b"rank 0: first", 0)
        assert a.flush_control(time.monotonic() + 10)
        sb.wait(lambda: sb.controls)
        assert sb.controls == [(KIND_ERROR, b"rank 0: first", 0)]
        stop_reading()  # the peer stops reading at the next message
        big = _send(a, bytearray(64 << 20), tag=1)
        time.sleep(0.2)  # its first chunk is under way and the peer's buffers fill
        assert a.send_control(KIND_ERROR, b"rank 0: second", 0)
        t0 = time.monotonic()
        assert a.flush_control(t0 + 0.5) is False
        assert time.monotonic() - t0 < 10  # at its deadline, not when the peer reads again (30 s)
        gate.set()
        big.wait(20)
        assert a.flush_control(time.monotonic() + 20)
        sb.wait(lambda: len(sb.controls) == 2)
        assert sb.controls[1] == (KIND_ERROR, b"rank 0: second", 0)
        # a link that is down: False at once
        _crash(b)
        sa.wait(lambda: sa.failures)
        a.send_control(KIND_ERROR, b"rank 0: third", 0)
        t0 = time.monotonic()
        assert a.flush_control(t0 + 5) is False and time.monotonic() - t0 < 4  # before its deadline
    finally:
        gate.set()
        for link in (a, b):
            link.begin_close()
            link.close(time.monotonic() + 1)
