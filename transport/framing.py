"""The wire codec: the frames every link kind carries (TCP, TLS, RDMA streams, shared-memory
rings), and no I/O. A link moves bytes; what they mean is decided here, once.

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
CLOSE ends a stream in order. With LINERATE_CHECKSUM a DATA frame's payload is followed by its
CRC-32 (4 bytes). A link may pad every frame to a multiple of ``align`` bytes (the
shared-memory rings: 8).

A message of ``total`` bytes is sent as one or more DATA frames whose [offset, offset+length)
ranges tile it exactly; the frames may travel on different streams of the same link.
Nothing here is pickled or evaluated: ERROR payloads are UTF-8 text, read with a bound.

The two halves of a link's protocol:

``SendQueue``
    a link's queued messages and control frames, most urgent first (control frames ahead of
    everything), cut into frames on demand: ``take()`` gives the next frame as the buffers to
    write (header, a view of the caller's buffer: no copy, the CRC), ``written()`` counts it
    once it is on the wire and says when its message is complete. The link's lock guards it.
``FrameReader``
    one stream's receiving state machine: ``need()`` is the memoryview to fill next (a
    header, the buffer the sink claimed for a payload: bytes land in place, an ERROR text,
    a CRC, padding), ``advance(n, link, sink)`` takes the bytes that were put there and
    delivers them to the sink (transport/link.py ``LinkSink``) in the name of ``link``.
    Protocol violations raise ``FrameError``.
"""
from __future__ import annotations

import collections
import struct
import threading
import zlib

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
#: LINERATE_CHECKSUM: the CRC-32 of a chunk's payload, after it.
CRC = struct.Struct("<I")


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


#: The frame that ends a stream in order.
CLOSE_FRAME = pack_header(KIND_CLOSE, 0, 0, 0, 0, 0, 0, 0)


def enqueue(q: collections.deque, item, priority: int) -> None:
    """Queue ``item`` behind the last queued message at least as urgent (a lower ``priority``
    is more urgent; control frames, tuples without one, stay first)."""
    if not q or priority >= getattr(q[-1], "priority", priority):
        q.append(item)
        return
    i = len(q) - 1
    while i > 0 and getattr(q[i - 1], "priority", priority) > priority:
        i -= 1
    q.insert(i, item)


# ----------------------------------------------------------------------------- sending
class SendQueue:
    """The frames waiting to go to one peer (see the module docstring). Not thread-safe: the
    link's lock guards every call but ``written``, which takes ``lock`` (the count of a
    message's bytes on the wire; held only for that)."""

    def __init__(self, chunk: int, checksum: bool = False, min_part: int = 0):
        self.chunk = chunk
        self.checksum = checksum
        #: ``take(room)``: a chunk cut short to fit ``room`` is at least this long (or none).
        self.min_part = min_part
        self.lock = threading.Lock()
        self._q: collections.deque = collections.deque()
        #: Sends not known to be finished: a send whose last frame a stream has taken has left
        #: the queue; if that stream breaks, ``cancel`` must still hand it back (finished ones
        #: are pruned now and then).
        self._sending: set = set()
        self._prune_at = 256
        #: Control frames queued or being written (flush_control waits for 0).
        self.controls = 0
        #: Messages and payload bytes whose frames were all written.
        self.messages = 0
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._q)

    def put(self, req) -> None:
        """Queue the message of ``req`` (a request.Request) by its ``priority``."""
        enqueue(self._q, req, req.priority)
        sending = self._sending
        if len(sending) >= self._prune_at:
            sending = self._sending = {r for r in sending if not r.is_completed()}
            self._prune_at = max(256, 2 * len(sending))
        sending.add(req)

    def put_control(self, kind: int, payload: bytes, value: int) -> None:
        """A control frame (ERROR text, QUERY, PROGRESS with ``value``), ahead of everything."""
        self._q.appendleft((kind, bytes(payload), value))
        with self.lock:
            self.controls += 1

    def take(self, room: int | None = None):
        """The next frame: ``(req, buffers, n)`` (``req`` None for a control frame; ``n`` the
        payload bytes of a DATA frame), or None when nothing is queued or the frame that is
        next needs more than ``room`` bytes. A message finished meanwhile (failed, cancelled)
        is dropped: its buffer is no longer ours."""
        q = self._q
        while q:
            item = q[0]
            if type(item) is tuple:
                kind, payload, value = item
                n = len(payload)
                frame = HEADER.pack(kind, 0, 0, n, value, 0, n, 0, 0) + payload
                if room is not None and len(frame) > room:
                    return None
                q.popleft()
                return None, [frame], 0
            buf = item.buf  # once, here: a failure elsewhere may clear it
            if buf is None:
                q.popleft()
                continue
            off = item.next_off
            left = item.total - off
            n = min(self.chunk, left)
            if room is not None:
                n = min(n, room - HEADER_SIZE - (CRC.size if self.checksum else 0))
                if n < left and (n <= 0 or n < self.min_part):
                    return None
            item.next_off = off + n
            if off + n >= item.total:
                q.popleft()
            hdr = HEADER.pack(KIND_DATA, item.opcode, item.channel, n, item.tag, item.msgno,
                              item.total, off, item.call)
            if not n:
                return item, [hdr], 0
            data = buf[off:off + n]
            if self.checksum:
                return item, [hdr, data, CRC.pack(zlib.crc32(data))], n
            return item, [hdr, data], n
        return None

    def written(self, req, n: int) -> bool:
        """A frame of ``take`` is on the wire: True when it completed its message (the caller
        finishes the request)."""
        with self.lock:
            if req is None:
                self.controls -= 1
                return False
            req.done_bytes += n
            self.bytes += n
            if req.done_bytes < req.total:
                return False
            self.messages += 1
            return True

    def cancel(self, match=None, underway: bool = True) -> list:
        """Take out the queued sends (``match(req)`` true, or all) that have not begun, and
        with ``underway`` those under way too (queued or not); without ``match`` the control
        frames go too. Returns the requests: the caller finishes them."""
        out, keep = [], collections.deque()
        for item in self._q:
            if type(item) is tuple:
                if match is None:
                    with self.lock:
                        self.controls -= 1
                else:
                    keep.append(item)
            elif (match is None or match(item)) and (underway or item.next_off == 0):
                out.append(item)
            else:
                keep.append(item)
        self._q = keep
        if underway:
            queued = set(map(id, out))
            out += [r for r in self._sending if not r.is_completed() and id(r) not in queued
                    and (match is None or match(r))]
            if match is None:
                self._sending = set()
        return out

    def mark(self):
        """A value that changes while queued sends move; None when nothing is queued."""
        if not self._q:
            return None
        return len(self._q), getattr(self._q[0], "next_off", 0), self.bytes

    def queued_bytes(self) -> int:
        """Bytes queued and not yet taken."""
        return sum(len(item[1]) if type(item) is tuple else max(0, item.total - item.next_off)
                   for item in self._q)


# ----------------------------------------------------------------------------- receiving
_HEADER, _PAYLOAD, _CRC, _TEXT, _PAD, _DONE = range(6)
_NOTHING = memoryview(b"")


class FrameReader:
    """One stream's receiving side (see the module docstring). ``max_chunk``: the longest
    DATA payload accepted; ``checksum``: a CRC follows every payload; ``align``: frames are
    padded to a multiple of it. ``bytes`` and ``messages`` count the payload received (a
    message counted by the chunk that ends it)."""

    __slots__ = ("max_chunk", "checksum", "align", "bytes", "messages", "_state", "_part",
                 "_got", "_hbuf", "_hview", "_cbuf", "_cview", "_fields", "_dest", "_token",
                 "_discard")

    def __init__(self, max_chunk: int, checksum: bool = False, align: int = 1):
        self.max_chunk = max_chunk
        self.checksum = checksum
        self.align = align
        self.bytes = 0
        self.messages = 0
        self._hbuf = bytearray(HEADER_SIZE)
        self._hview = memoryview(self._hbuf)
        self._cbuf = bytearray(max(CRC.size, align))
        self._cview = memoryview(self._cbuf)
        self._state = _HEADER
        self._part = self._hview    # what the current state fills
        self._got = 0               # of it, filled so far
        self._fields = None
        self._dest = self._token = self._discard = None

    def need(self) -> memoryview:
        """The bytes to fill next (empty once the stream ended)."""
        got = self._got
        return self._part[got:] if got else self._part

    def advance(self, n: int, link, sink) -> bool:
        """``n`` bytes of ``need()`` were filled: deliver what they complete to ``sink``.
        True once the stream ended in order (a CLOSE frame). Raises FrameError (the peer
        broke the protocol) and whatever the sink raises."""
        got = self._got + n
        if got < len(self._part):
            self._got = got
            return False
        self._got = 0
        state = self._state
        if state == _HEADER:
            return self._header(link, sink)
        if state == _PAYLOAD and self.checksum:
            self._state, self._part = _CRC, self._cview[:CRC.size]
        elif state <= _CRC:  # the payload (and its CRC) is in
            self._data_in(link, sink)
        elif state == _TEXT:
            text, tag = self._dest, self._fields
            self._dest = None
            self._next(HEADER_SIZE + len(text))
            sink.control(link, KIND_ERROR, bytes(text), tag)
        elif state == _PAD:
            self._state, self._part = _HEADER, self._hview
        return False

    def _header(self, link, sink) -> bool:
        fields = unpack_header(self._hbuf, self.max_chunk)
        kind, opcode, channel, length, tag, msgno, total, off, call = fields
        if kind == KIND_DATA:
            token, dest = sink.claim(link, opcode, channel, tag, msgno, total, call, off, length)
            if dest is None:  # nowhere to go (mismatched or failed receive): drop the bytes
                token, dest = None, self._scratch(length)
            elif dest.format != "B" or dest.ndim != 1:
                dest = dest.cast("B")
            self._fields, self._dest, self._token = fields, dest, token
            if length:
                self._state, self._part = _PAYLOAD, dest
            else:
                self._data_in(link, sink)
        elif kind == KIND_ERROR:
            if length:
                self._fields, self._dest = tag, bytearray(length)
                self._state, self._part = _TEXT, memoryview(self._dest)
            else:
                self._next(HEADER_SIZE)
                sink.control(link, KIND_ERROR, b"", tag)
        elif kind == KIND_CLOSE:
            self.stop()
            return True
        else:  # QUERY, PROGRESS
            self._next(HEADER_SIZE)
            sink.control(link, kind, b"", tag)
        return False

    def _data_in(self, link, sink) -> None:
        _kind, _op, channel, length, tag, msgno, total, off, _call = self._fields
        dest, token = self._dest, self._token
        self._dest = self._token = None
        size = HEADER_SIZE + length
        if self.checksum and length:
            if CRC.unpack_from(self._cbuf)[0] != zlib.crc32(dest):
                raise FrameError(f"checksum mismatch in bytes [{off}, {off + length}) of a "
                                 f"{total}-byte message (tag {tag}): the data was corrupted on "
                                 f"the way (LINERATE_CHECKSUM)")
            size += CRC.size
        dest = None
        if self.align == 1:
            self._state, self._part = _HEADER, self._hview
        else:
            self._next(size)
        self.bytes += length
        if off + length == total:  # exactly one chunk of a message ends it
            self.messages += 1
        if token is not None:
            sink.filled(link, token, channel, tag, msgno, length)

    def _next(self, frame_bytes: int) -> None:
        """The frame of ``frame_bytes`` is in: its padding, then the next header."""
        pad = -frame_bytes % self.align
        if pad:
            self._state, self._part = _PAD, self._cview[:pad]
        else:
            self._state, self._part = _HEADER, self._hview

    def _scratch(self, n: int) -> memoryview:
        buf = self._discard
        if buf is None or len(buf) < n:
            buf = self._discard = memoryview(bytearray(max(n, 1 << 16)))
        return buf[:n]

    def stop(self) -> None:
        """No more bytes are read: drop every reference to a receive buffer."""
        self._state, self._part, self._got = _DONE, _NOTHING, 0
        self._dest = self._token = self._discard = None

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def between(self) -> bool:
        """No frame is partly read: the next byte begins a header."""
        return self._state == _HEADER and not self._got
