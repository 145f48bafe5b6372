"""Wire format of the frames that follow the handshake on every connection.

Each frame is a fixed 48-byte little-endian header, then ``length`` payload bytes::

    u8  kind      DATA, ERROR, CLOSE, QUERY or PROGRESS
    u8  opcode    what the sender is doing (collective or point-to-point op), for mismatch reports
    u16 channel   CHANNEL_COLLECTIVE or CHANNEL_P2P
    u32 length    payload bytes of this frame (one chunk)
    u64 tag       collective: the op's sequence number; point-to-point: the user's tag
    u64 msgno     per (peer, channel, tag) message number; orders the chunks of striped messages
    u64 total     bytes of the whole message
    u64 offset    where this chunk's bytes go in the message
    u64 call      collective: a digest of the call's arguments (dtypes, sizes, reduce op, root)
                  that every rank must agree on; 0 where there is none (point-to-point)

QUERY asks the peer for its progress (an opaque number its user keeps, e.g. the last
operation it entered); PROGRESS answers with that number in ``tag``. Both carry no payload.

A message of ``total`` bytes is sent as one or more DATA frames whose [offset, offset+length)
ranges tile it exactly; the frames may travel on different connections of the same peer.
Nothing here is pickled or evaluated: ERROR payloads are UTF-8 text, read with a bound.
"""
from __future__ import annotations

import struct

HEADER = struct.Struct("<BBHIQQQQQ")
HEADER_SIZE = HEADER.size  # 48

KIND_DATA = 1
KIND_ERROR = 2
KIND_CLOSE = 3
KIND_QUERY = 4
KIND_PROGRESS = 5
_KINDS = (KIND_DATA, KIND_ERROR, KIND_CLOSE, KIND_QUERY, KIND_PROGRESS)
_NAMES = {KIND_CLOSE: "CLOSE", KIND_QUERY: "QUERY", KIND_PROGRESS: "PROGRESS"}

CHANNEL_COLLECTIVE = 1
CHANNEL_P2P = 2
_CHANNELS = (CHANNEL_COLLECTIVE, CHANNEL_P2P)

#: Longest ERROR text accepted from a peer.
MAX_ERROR_BYTES = 8192


class FrameError(Exception):
    """A header that cannot be valid: the connection is out of sync or not one of ours."""


def pack_header(kind: int, opcode: int, channel: int, length: int, tag: int, msgno: int,
                total: int, offset: int, call: int = 0) -> bytes:
    return HEADER.pack(kind, opcode, channel, length, tag, msgno, total, offset, call)


def unpack_header(buf, max_chunk: int) -> tuple[int, int, int, int, int, int, int, int, int]:
    """Decode and check a header; raise FrameError on anything inconsistent."""
    if len(buf) != HEADER_SIZE:  # else struct.error would escape
        raise FrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(buf)}")
    kind, opcode, channel, length, tag, msgno, total, offset, call = HEADER.unpack(buf)
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if kind == KIND_DATA:
        if channel not in _CHANNELS:
            raise FrameError(f"unknown channel {channel}")
        if length > max_chunk:
            raise FrameError(f"chunk of {length} bytes exceeds the limit of {max_chunk}")
        if offset > total or length > total - offset:
            raise FrameError(f"chunk [{offset}, {offset + length}) lies outside a message of {total} bytes")
    elif kind == KIND_ERROR:
        if length > MAX_ERROR_BYTES:
            raise FrameError(f"error text of {length} bytes exceeds {MAX_ERROR_BYTES}")
    elif length != 0:
        raise FrameError(f"{_NAMES[kind]} frame with a payload of {length} bytes")
    return kind, opcode, channel, length, tag, msgno, total, offset, call
