"""Property-based fuzzing of every parser that reads bytes from the network.

    python -m linerate.tools.dev.fuzz --examples 100000              # every property, 100k inputs each
    python -m linerate.tools.dev.fuzz --only header_bytes,hello -n 5000 --seed 1

The properties (each a plain function of one generated input, returning an outcome label that is
counted) and their hypothesis strategies live here; ``tests/test_fuzz.py`` runs the same
properties with a few hundred inputs each. What every property asserts:

``header_bytes``  framing.unpack_header on arbitrary bytes (any length) returns a header that
                  satisfies every invariant and re-packs to the same bytes, or raises FrameError.
``header_fields`` for structured headers (edge values, plausible DATA frames), unpack_header
                  accepts exactly what an independent oracle calls valid; so no accepted length
                  exceeds the chunk limit (DATA) or MAX_ERROR_BYTES (ERROR), and
                  [offset, offset + length) always lies inside the message: every allocation
                  or read that follows a header is bounded by a checked number.
``hello``         handshake.accept_side fed arbitrary bytes (raw, or HELLOs with mutated fields,
                  then an AUTH) raises HandshakeError; it answers with a CHALLENGE exactly when
                  the HELLO is valid for this job and never sends an ACK without the secret.
``challenge``     handshake.connect_side fed arbitrary CHALLENGE/ACK bytes raises
                  HandshakeError and never sends its AUTH to a listener without the secret.
``addresses``     rendezvous.parse_addresses (the listen addresses a rank reads from the Store)
                  returns nrails [host, port] pairs with a TCP port, or raises TransportError.
``live``          a real Context (rank 0) and a fuzzer that did a valid handshake as rank 1 send
                  sequences of mutated frames, then a probe message and EOF: the context either
                  delivers the probe intact or fails rank 1 with a PeerFailure that says why
                  (a malformed header must give "protocol error"), its receiver thread never dies
                  of an unexpected exception, nothing waits forever, and close() returns.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import json
import logging
import socket
import sys
import threading
import time
import traceback

from linerate.transport import rendezvous
from linerate.transport import framing, handshake
from linerate.transport.fakepeer import DictStore, FakePeer
from linerate.transport.request import PeerFailure, TransportError

log = logging.getLogger("linerate.fuzz")

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - the tool says what to install
    st = None

MAX_CHUNK = 1 << 20
SECRET = bytes(range(32))
JOB_ID = handshake.job_id_from_secret(SECRET)
#: Fields of a frame header: kind, opcode, channel, length, tag, msgno, total, offset, and any
#: fields the format adds after those (each a u64 here; e.g. the call digest).
NFIELDS = len(framing.HEADER.unpack(bytes(framing.HEADER_SIZE)))
#: The acceptor's view in the handshake properties: rank 1 of 4, 2 connections per peer.
MY_RANK, WORLD, NCONNS = 1, 4, 2


# ============================================================================ frame headers
def header_valid(fields, max_chunk: int) -> bool:
    """What a header must satisfy, written independently of framing.unpack_header."""
    kind, _opcode, channel, length, _tag, _msgno, total, offset = fields[:8]
    if kind == framing.KIND_DATA:
        return (channel in (framing.CHANNEL_COLLECTIVE, framing.CHANNEL_P2P)
                and length <= max_chunk and offset + length <= total)  # Python ints: no overflow
    if kind == framing.KIND_ERROR:
        return length <= framing.MAX_ERROR_BYTES
    if kind in (framing.KIND_CLOSE, framing.KIND_QUERY, framing.KIND_PROGRESS):
        return length == 0
    return False


def check_header_bytes(raw: bytes, max_chunk: int = MAX_CHUNK) -> str:
    try:
        fields = framing.unpack_header(raw, max_chunk)
    except framing.FrameError:
        if len(raw) == framing.HEADER_SIZE:
            assert not header_valid(framing.HEADER.unpack(raw), max_chunk), "valid header rejected"
        return "rejected"
    assert len(raw) == framing.HEADER_SIZE, f"accepted a {len(raw)}-byte header"
    assert header_valid(fields, max_chunk), f"accepted an invalid header {fields}"
    assert framing.pack_header(*fields) == bytes(raw)
    return "accepted"


def check_header_fields(case) -> str:
    fields, max_chunk = case
    raw = framing.pack_header(*fields)
    valid = header_valid(fields, max_chunk)
    try:
        got = framing.unpack_header(raw, max_chunk)
    except framing.FrameError:
        assert not valid, f"valid header {fields} rejected"
        return "rejected"
    assert valid, f"invalid header {fields} accepted"
    assert got == tuple(fields)
    kind, length = got[0], got[3]
    bound = max_chunk if kind == framing.KIND_DATA else framing.MAX_ERROR_BYTES
    assert length <= bound
    return "accepted"


# ============================================================================ handshake
def _pair(data: bytes):
    """A connected pair: ``data`` then EOF waits to be read on the second socket."""
    a, b = socket.socketpair()
    a.sendall(data)
    a.shutdown(socket.SHUT_WR)
    b.settimeout(5.0)  # a read that would wait is a failure of the property, not a hang
    return a, b


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(5.0)
    out = []
    while True:
        try:
            b = sock.recv(65536)
        except ConnectionResetError:
            break
        if not b:
            break
        out.append(b)
    return b"".join(out)


def hello_valid(data: bytes) -> bool:
    """Whether the first HELLO.size bytes are a HELLO that rank MY_RANK must answer."""
    if len(data) < handshake.HELLO.size:
        return False
    magic, version, _flags, job_id, src, dst, index, nconns, _nonce = \
        handshake.HELLO.unpack(data[:handshake.HELLO.size])
    return (magic == handshake.MAGIC and version == handshake.VERSION and job_id == JOB_ID
            and dst == MY_RANK and 0 <= src < WORLD and src != MY_RANK
            and nconns == NCONNS and 0 <= index < NCONNS)


def check_hello(data: bytes) -> str:
    a, b = _pair(data)
    try:
        try:
            result = handshake.accept_side(b, SECRET, MY_RANK, WORLD, NCONNS)
        except handshake.HandshakeError:
            pass
        else:
            raise AssertionError(f"accept_side authenticated {result} without the secret")
        b.close()
        answer = _read_all(a)
    finally:
        a.close()
        b.close()
    if not hello_valid(data):
        assert answer == b"", f"answered an invalid HELLO with {answer[:16]!r}..."
        return "refused"
    assert len(answer) == handshake.CHALLENGE.size, f"{len(answer)} bytes answered, no ACK allowed"
    magic, version, status, _nonce, _mac = handshake.CHALLENGE.unpack(answer)
    assert (magic, version, status) == (handshake.MAGIC, handshake.VERSION, handshake.STATUS_OK)
    return "challenged, auth refused"


def check_challenge(data: bytes) -> str:
    a, b = _pair(data)
    try:
        try:
            handshake.connect_side(b, SECRET, 2, 0, 1, NCONNS)
        except handshake.HandshakeError:
            pass
        else:
            raise AssertionError("connect_side accepted a listener without the secret")
        b.close()
        sent = _read_all(a)
    finally:
        a.close()
        b.close()
    assert len(sent) == handshake.HELLO.size, "the connector sent more than its HELLO (an AUTH?)"
    return "refused"


# ============================================================================ store addresses
def check_addresses(case) -> str:
    raw, nrails = case
    try:
        addrs = rendezvous.parse_addresses(raw, 3, nrails)
    except TransportError:
        return "rejected"
    assert isinstance(addrs, list) and len(addrs) == nrails
    for a in addrs:
        assert isinstance(a, list) and len(a) == 2 and isinstance(a[0], str)
        assert type(a[1]) is int and 0 < a[1] < 65536, f"port {a[1]!r}"
    return "accepted"


# ============================================================================ live pair
#: The fake peer (rank 1 on raw frames) and its in-memory store, shared with the transport tests.
_DictStore = DictStore

LIVE_MAX_UNEXPECTED = 1 << 20
WATCH_TAG = (1 << 40) + 12345  # the probe's tag: no fuzzed frame uses it
PROBE = b"probe-12345678"


class LivePair(FakePeer):
    """Rank 0 of a 2-rank group is a real Context; rank 1 is played here on one raw connection
    that completed a genuine handshake (the job secret comes from the store, as for a rank):
    linerate.transport.fakepeer.FakePeer over a store without check(), with a 1 MiB limit on
    unexpected messages."""

    def __init__(self, **overrides):
        super().__init__(store=DictStore(),
                         **{"max_unexpected_bytes": LIVE_MAX_UNEXPECTED, **overrides})

    def close(self, within: float | None = 10.0) -> None:
        super().close(within)


class _ThreadErrors:
    """Exceptions that escape any thread while active (they would kill a receiver silently)."""

    def __enter__(self):
        self.errors: list = []
        self._prev = threading.excepthook
        threading.excepthook = lambda args: self.errors.append(
            f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")
        return self

    def __exit__(self, *exc):
        threading.excepthook = self._prev
        return False


def _frame_bytes(frame) -> tuple[bytes, bool]:
    """(wire bytes, whether they keep the stream in sync: a full header and full payload)."""
    if frame[0] == "raw":
        return frame[1], False
    _, fields, payload = frame
    raw = framing.pack_header(*fields) + payload
    kind, length = fields[0], fields[3]
    in_sync = kind in (framing.KIND_DATA, framing.KIND_ERROR, framing.KIND_CLOSE, framing.KIND_QUERY,
                       framing.KIND_PROGRESS) and len(payload) == length
    return raw, in_sync


def expected_live(frames, max_chunk: int) -> str | None:
    """The outcome a stream must give, from a model of the receiver: "protocol error" for a
    header that unpack_header rejects, an unexpected message over the limit, or a chunk whose
    total disagrees with its message's first chunk; "closed its process group" for a CLOSE;
    "delivered" (the probe) otherwise. None once the stream is out of sync (raw bytes, or a
    payload shorter than announced): then any clear failure or a correct delivery will do."""
    inflight: dict = {}  # (channel, tag, msgno) -> [total, bytes arrived] of unfinished messages
    for frame in frames:
        if frame[0] == "raw":
            return None
        fields, payload = frame[1], frame[2]
        if not header_valid(fields, max_chunk):
            return "protocol error"
        kind, _op, channel, length, tag, msgno, total, _off = fields[:8]
        if kind == framing.KIND_CLOSE:
            return "closed its process group"
        if kind == framing.KIND_DATA:
            key = (channel, tag, msgno)
            msg = inflight.get(key)
            if msg is None:
                if total > LIVE_MAX_UNEXPECTED:
                    return "protocol error"
                msg = inflight[key] = [total, 0]
            elif msg[0] != total:
                return "protocol error"
            msg[1] += length
            if msg[1] >= msg[0]:
                del inflight[key]
        if len(payload) != length:
            return None  # the receiver waits for the rest: EOF ends it
    return "delivered"


def check_live(frames) -> str:
    pair = LivePair()
    with _ThreadErrors() as thread_errors:
        try:
            ctx = pair.ctx
            out = bytearray(len(PROBE))
            watch = ctx.irecv(1, memoryview(out), framing.CHANNEL_P2P, WATCH_TAG)
            stream = b"".join(_frame_bytes(f)[0] for f in frames)
            probe = framing.pack_header(framing.KIND_DATA, 0, framing.CHANNEL_P2P, len(PROBE),
                                        WATCH_TAG, 0, len(PROBE), 0) + PROBE
            try:
                pair.sock.sendall(stream + probe)
                pair.sock.shutdown(socket.SHUT_WR)
            except OSError as e:  # the context already dropped us: an outcome, judged below
                log.debug("fuzz: sending to the context failed: %s", e)
            try:
                watch.wait(5.0)
                outcome = "delivered"
            except PeerFailure as e:
                assert e.peer == 1, e
                text = str(e)
                outcome = next((k for k in ("protocol error", "closed its process group",
                                            "closed unexpectedly", "connection to rank 1 failed")
                                if k in text), None)
                assert outcome is not None, f"unclear failure: {text}"
            except TimeoutError as e:
                raise AssertionError(f"the receive neither completed nor failed: {e}") from None
        finally:
            pair.close()
    assert not thread_errors.errors, f"a transport thread died: {thread_errors.errors}"
    if outcome == "delivered":
        assert bytes(out) == PROBE, "the probe arrived corrupted"
    want = expected_live(frames, pair.max_chunk)
    if want is not None:
        assert outcome == want, f"expected {want!r}, got {outcome!r}"
    return outcome


# ============================================================================ strategies
def _u(bits: int, *extra):
    top = (1 << bits) - 1
    edges = sorted({0, 1, 2, top, top - 1, 1 << (bits - 1), *[e for e in extra if 0 <= e <= top]})
    return st.one_of(st.sampled_from(edges), st.integers(0, top))


def strategies() -> dict:
    """name -> hypothesis strategy of that property's input."""
    kinds = st.one_of(st.sampled_from([0, framing.KIND_DATA, framing.KIND_ERROR,
                                       framing.KIND_CLOSE, framing.KIND_QUERY,
                                       framing.KIND_PROGRESS, 6, 255]), _u(8))
    channels = st.one_of(st.sampled_from([0, framing.CHANNEL_COLLECTIVE, framing.CHANNEL_P2P, 3]),
                         _u(16))
    max_chunks = st.sampled_from([4096, MAX_CHUNK, 1 << 24])

    @st.composite
    def header_case(draw):
        max_chunk = draw(max_chunks)
        length = draw(_u(32, max_chunk - 1, max_chunk, max_chunk + 1, framing.MAX_ERROR_BYTES,
                         framing.MAX_ERROR_BYTES + 1))
        plausible = draw(st.booleans())
        if plausible:  # a DATA frame near the edge of validity
            total = draw(st.one_of(st.integers(0, 1 << 22), _u(64)))
            offset = draw(st.one_of(st.integers(0, min((1 << 64) - 1, max(0, total - length) + 2)),
                                    _u(64)))
            fields = (draw(st.sampled_from([framing.KIND_DATA, framing.KIND_DATA, framing.KIND_ERROR,
                                             framing.KIND_CLOSE])),
                      draw(_u(8)), draw(channels), length, draw(_u(64)), draw(_u(64)), total, offset)
        else:
            fields = (draw(kinds), draw(_u(8)), draw(channels), length, draw(_u(64)), draw(_u(64)),
                      draw(_u(64)), draw(_u(64)))
        fields += tuple(draw(_u(64)) for _ in range(NFIELDS - 8))
        return fields, max_chunk

    header_bytes = st.one_of(
        st.binary(min_size=framing.HEADER_SIZE, max_size=framing.HEADER_SIZE),
        st.binary(max_size=2 * framing.HEADER_SIZE),
        header_case().map(lambda c: framing.pack_header(*c[0])))

    @st.composite
    def hello(draw):
        # a valid HELLO of rank 2 to rank MY_RANK, then 0-3 fields replaced by wrong or edge values
        fields = [handshake.MAGIC, handshake.VERSION, 0, JOB_ID, 2, MY_RANK, 1, NCONNS,
                  draw(st.binary(min_size=16, max_size=16))]
        wrong = [
            st.sampled_from([b"LNRU", b"GET ", b"\0\0\0\0", handshake.MAGIC.lower()])
            | st.binary(min_size=4, max_size=4),
            st.sampled_from([0, handshake.VERSION - 1, handshake.VERSION + 1]) | _u(16),
            _u(16),                                                             # flags: ignored
            st.sampled_from([handshake.job_id_from_secret(b"other"), JOB_ID[:-1] + b"\0"])
            | st.binary(min_size=16, max_size=16),
            st.integers(0, WORLD) | _u(32),                                     # src
            st.sampled_from([0, 2, WORLD]) | _u(32),                            # dst
            st.integers(0, NCONNS) | _u(32),                                    # index
            st.sampled_from([0, 1, NCONNS + 1]) | _u(32),                       # nconns
        ]
        for i in draw(st.lists(st.integers(0, len(wrong) - 1), max_size=3)):
            fields[i] = draw(wrong[i])
        data = handshake.HELLO.pack(*fields)
        cut = draw(st.sampled_from([None, None, None]) | st.integers(0, len(data)))
        if cut is not None:
            data = data[:cut]
        # an AUTH: random, short, or a real MAC over the HELLO with a guessed server nonce
        auth = draw(st.one_of(
            st.binary(min_size=handshake.AUTH_SIZE, max_size=handshake.AUTH_SIZE),
            st.binary(max_size=handshake.AUTH_SIZE - 1),
            st.binary(min_size=16, max_size=16).map(
                lambda n: hmac.new(SECRET, b"connector" + data + n, hashlib.sha256).digest())))
        return data + auth + draw(st.binary(max_size=16))

    hello_bytes = st.one_of(st.binary(max_size=2 * handshake.HELLO.size), hello())

    @st.composite
    def challenge(draw):
        data = handshake.CHALLENGE.pack(
            draw(st.sampled_from([handshake.MAGIC, b"LNRU"]) | st.binary(min_size=4, max_size=4)),
            draw(st.sampled_from([handshake.VERSION, 2]) | _u(16)),
            draw(st.sampled_from([handshake.STATUS_OK, 1]) | _u(16)),
            draw(st.binary(min_size=16, max_size=16)),
            draw(st.binary(min_size=32, max_size=32)))
        cut = draw(st.sampled_from([None, None]) | st.integers(0, len(data)))
        if cut is not None:
            data = data[:cut]
        return data + draw(st.sampled_from([handshake.ACK, b""]) | st.binary(max_size=8))

    challenge_bytes = st.one_of(st.binary(max_size=2 * handshake.CHALLENGE.size), challenge())

    def containers(inner):
        return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
        containers, max_leaves=12)
    address = st.tuples(st.text(max_size=20) | st.sampled_from(["127.0.0.1", "::1", "10.0.0.2"]),
                        st.sampled_from([0, 1, 80, 65535, 65536, -1, True, False, 2 ** 64, 1.5, "80", None])
                        | st.integers(-1, 70000)).map(list)
    addr_text = st.one_of(
        st.lists(address, max_size=4).map(json.dumps),
        json_values.map(lambda v: json.dumps(v, allow_nan=True)),
        st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),  # deep nesting
        st.integers(1, 3000).map(lambda n: "[" * n))
    addr_raw = st.one_of(addr_text.map(lambda s: s.encode()), st.binary(max_size=64),
                         st.text(max_size=32).map(lambda s: s.encode("utf-8", "surrogatepass")))
    addresses = st.tuples(addr_raw, st.integers(1, 3))

    # live frames: few tags, and frames that continue an earlier frame's message (same channel,
    # tag and number, the same or another total), so that chunks of one message meet
    @st.composite
    def live_frame(draw, earlier=()):
        how = draw(st.integers(0, 19))
        if how == 0:
            return ("raw", draw(st.binary(min_size=1, max_size=96)))
        kind = draw(st.sampled_from([framing.KIND_DATA] * 12 + [framing.KIND_ERROR, framing.KIND_CLOSE]))
        total = draw(st.sampled_from([0, 1, 7, 64, 4096, LIVE_MAX_UNEXPECTED, LIVE_MAX_UNEXPECTED + 1])
                     | st.integers(0, 8192))
        if earlier and draw(st.integers(0, 1)) == 0:  # a chunk of an earlier frame's message
            prev = draw(st.sampled_from(earlier))
            channel, tag, msgno, extra = prev[2], prev[4], prev[5], prev[8:]
            if draw(st.booleans()):
                total = prev[6]
        else:
            channel = draw(st.sampled_from([framing.CHANNEL_COLLECTIVE, framing.CHANNEL_P2P]))
            tag = draw(st.sampled_from([0, 1, 2, 7]))
            msgno = draw(st.sampled_from([0, 0, 1, 2]))
            extra = tuple(draw(st.sampled_from([0, 0, 1]) | _u(64)) for _ in range(NFIELDS - 8))
        if kind == framing.KIND_ERROR:
            length = draw(st.integers(0, 64))
        elif kind == framing.KIND_CLOSE:
            length = 0
        else:
            length = draw(st.integers(0, min(total, 4096)))
        offset = draw(st.integers(0, max(0, total - length)))
        fields = [kind, draw(st.integers(0, 3)), channel, length, tag, msgno, total, offset, *extra]
        if how <= 3:  # mutate one field to an edge or random value
            i = draw(st.integers(0, NFIELDS - 1))
            bits = (8, 8, 16, 32, 64, 64, 64, 64)[i] if i < 8 else 64
            fields[i] = draw(_u(bits, (1 << 24), (1 << 24) + 1, framing.MAX_ERROR_BYTES + 1,
                                LIVE_MAX_UNEXPECTED + 1))
        fields = tuple(fields)
        length = fields[3]
        if length <= 8192 and draw(st.integers(0, 15)):
            payload = draw(st.binary(min_size=length, max_size=length))
        else:  # a header that announces more than follows
            payload = draw(st.binary(max_size=min(length, 64)))
        return ("frame", fields, payload)

    @st.composite
    def live_frames(draw):
        frames: list = []
        for _ in range(draw(st.integers(1, 6))):
            frames.append(draw(live_frame(tuple(f[1] for f in frames if f[0] == "frame"))))
        return frames

    live = live_frames()

    return {"header_bytes": header_bytes, "header_fields": header_case(), "hello": hello_bytes,
            "challenge": challenge_bytes, "addresses": addresses, "live": live}


#: name -> property; each takes one input drawn from strategies()[name].
PROPERTIES = {"header_bytes": check_header_bytes, "header_fields": check_header_fields,
              "hello": check_hello, "challenge": check_challenge, "addresses": check_addresses,
              "live": check_live}


# ============================================================================ the tool
def run_property(name: str, examples: int, seed: int | None = None) -> tuple[collections.Counter, float]:
    """Run one property over ``examples`` generated inputs; return (outcome counts, seconds)."""
    counts: collections.Counter = collections.Counter()
    prop = PROPERTIES[name]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
              print_blob=True)
    @given(strategies()[name])
    def run(x):
        counts[prop(x)] += 1

    if seed is not None:
        run = hypothesis_seed(seed)(run)
    t0 = time.perf_counter()
    run()
    return counts, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.dev.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--examples", type=int, default=100_000,
                        help="inputs per property (default 100000)")
    parser.add_argument("--only", default=",".join(PROPERTIES),
                        help=f"comma separated properties (default all: {','.join(PROPERTIES)})")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default random)")
    args = parser.parse_args(argv)
    if st is None:
        print("linerate.tools.dev.fuzz needs hypothesis: pip install -e '.[test]'", file=sys.stderr)
        return 2
    # the live property makes the context log every peer it fails: thousands of lines
    logging.getLogger("linerate").setLevel(logging.CRITICAL + 1)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROPERTIES]
    if unknown:
        parser.error(f"unknown properties {unknown}; choose from {list(PROPERTIES)}")
    print(f"{'property':<14} {'inputs':>8} {'seconds':>8} {'inputs/s':>9}  outcomes")
    failed = []
    total_t = 0.0
    for name in names:
        try:
            counts, dt = run_property(name, args.examples, args.seed)
        except Exception as e:  # noqa: BLE001 - a falsified property: report, go on
            print(f"{name:<14} FAILED:", flush=True)
            traceback.print_exception(e, file=sys.stdout)
            failed.append(name)
            continue
        total_t += dt
        n = sum(counts.values())
        outcomes = ", ".join(f"{k} {v}" for k, v in counts.most_common())
        print(f"{name:<14} {n:>8} {dt:>8.1f} {n / dt:>9.0f}  {outcomes}", flush=True)
    print(f"total {total_t:.1f} s; {'FAILED: ' + ', '.join(failed) if failed else 'all properties held'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
