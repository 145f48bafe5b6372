"""Property-based fuzzing of the wire parsers (hypothesis), with CI-sized example counts.

The properties and strategies are those of ``tools/dev/fuzz.py`` (see its docstring for what each
asserts); ``python -m linerate.tools.dev.fuzz --examples 100000`` runs them at benchmark
scale. Here each runs a few hundred derandomized examples, plus fixed cases for inputs that
must be refused cleanly:

* a header buffer of the wrong length raises FrameError (not struct.error);
* a chunk whose announced total disagrees with its message's first chunk fails the peer (it
  must not kill the receiver thread with a ValueError from recv_into a too-small slice, which
  would leave the pending receives waiting for their timeout);
* the listen addresses read from the Store refuse deeply nested JSON (RecursionError), port 0,
  ports above 65535 and booleans.
"""
from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from linerate.tools.dev import fuzz  # noqa: E402
from linerate.transport import rendezvous  # noqa: E402
from linerate.transport import framing  # noqa: E402
from linerate.transport.request import PeerFailure, TransportError  # noqa: E402

STRATEGIES = fuzz.strategies()


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@_settings(800)
@given(STRATEGIES["header_bytes"])
def test_unpack_header_arbitrary_bytes(raw):
    fuzz.check_header_bytes(raw)


@_settings(800)
@given(STRATEGIES["header_fields"])
def test_unpack_header_accepts_exactly_the_valid_headers(case):
    fuzz.check_header_fields(case)


@_settings(500)
@given(STRATEGIES["hello"])
def test_accept_side_arbitrary_hello(data):
    fuzz.check_hello(data)


@_settings(300)
@given(STRATEGIES["challenge"])
def test_connect_side_arbitrary_challenge(data):
    fuzz.check_challenge(data)


@_settings(500)
@given(STRATEGIES["addresses"])
def test_parse_addresses_arbitrary_store_value(case):
    fuzz.check_addresses(case)


@pytest.mark.timeout(120)
@_settings(250)
@given(STRATEGIES["live"])
def test_live_context_survives_mutated_frames(frames):
    fuzz.check_live(frames)


# ----------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("n", [0, 1, framing.HEADER_SIZE - 1, framing.HEADER_SIZE + 1, 4096])
def test_unpack_header_wrong_length_is_frame_error(n):
    with pytest.raises(framing.FrameError, match="header"):
        framing.unpack_header(bytes(n), fuzz.MAX_CHUNK)


@pytest.mark.parametrize("raw", [b'[["h", 0]]', b'[["h", 65536]]', b'[["h", -1]]', b'[["h", true]]',
                                 b"[" * 5000 + b"]" * 5000, b"\xff\xfe", b'[["h", 1.0]]'])
def test_parse_addresses_rejects(raw):
    with pytest.raises(TransportError, match="malformed"):
        rendezvous.parse_addresses(raw, 1, 1)


def test_parse_addresses_accepts():
    assert rendezvous.parse_addresses(b'[["10.0.0.1", 1], ["::1", 65535]]', 1, 2) == \
        [["10.0.0.1", 1], ["::1", 65535]]


def _pending_receive_fails(pair, send: bytes, match: str, eof: bool = False) -> None:
    with fuzz._ThreadErrors() as errors:
        try:
            watch = pair.ctx.irecv(1, memoryview(bytearray(8)), framing.CHANNEL_P2P, fuzz.WATCH_TAG)
            pair.sock.sendall(send)
            if eof:
                pair.sock.shutdown(socket.SHUT_WR)
            t0 = time.monotonic()
            with pytest.raises(PeerFailure, match=match) as ei:
                watch.wait(10)
            assert ei.value.peer == 1
            assert time.monotonic() - t0 < 5
        finally:
            pair.close()
    assert not errors.errors


@pytest.mark.timeout(60)
def test_live_chunk_with_another_total_fails_the_peer():
    """Two chunks of one message (channel, tag, number) that disagree on its size: the second
    would not fit the first one's buffer. The peer fails with a protocol error at once."""
    pair = fuzz.LivePair()
    first = framing.pack_header(framing.KIND_DATA, 0, framing.CHANNEL_P2P, 5, 1, 0, 10, 0) + b"a" * 5
    second = framing.pack_header(framing.KIND_DATA, 0, framing.CHANNEL_P2P, 100, 1, 0, 1000, 500)
    _pending_receive_fails(pair, first + second + b"b" * 100, "protocol error.*announces 1000 bytes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,length", [(framing.KIND_DATA, 2**32 - 1),
                                         (framing.KIND_DATA, (1 << 24) + 1),
                                         (framing.KIND_ERROR, 2**32 - 1),
                                         (framing.KIND_ERROR, framing.MAX_ERROR_BYTES + 1)])
def test_live_length_over_the_limit_fails_before_reading(kind, length):
    """A header announcing more than the limit fails the peer at once, with the connection left
    open and nothing following: had the receiver allocated or started reading that many bytes,
    it would wait here instead."""
    pair = fuzz.LivePair()
    hdr = framing.pack_header(kind, 0, framing.CHANNEL_P2P, length, 3, 0, 2**63, 0)
    _pending_receive_fails(pair, hdr, "protocol error.*(exceeds|limit)")


@pytest.mark.timeout(60)
def test_live_unexpected_message_over_limit_fails_before_staging():
    pair = fuzz.LivePair()
    hdr = framing.pack_header(framing.KIND_DATA, 0, framing.CHANNEL_P2P, 16, 3, 0,
                              fuzz.LIVE_MAX_UNEXPECTED + 1, 0)
    _pending_receive_fails(pair, hdr, "LINERATE_MAX_UNEXPECTED_BYTES")
