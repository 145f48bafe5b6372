"""Connection handshake: a connection proves it belongs to the job before it carries data.

Connector -> acceptor, HELLO (56 bytes)::

    4s magic b"LNRT" | u16 version | u16 flags | 16s job id | u32 src rank | u32 dst rank
    | u32 connection index | u32 connections per peer | 16s client nonce

Acceptor -> connector, CHALLENGE (56 bytes)::

    4s magic | u16 version | u16 status | 16s server nonce | 32s HMAC(secret, "acceptor" + HELLO + server nonce)

Connector -> acceptor, AUTH (32 bytes): HMAC(secret, "connector" + HELLO + server nonce).
Acceptor -> connector, ACK: b"LNOK"; DECLINE: b"LNDU" (an authenticated connection the
acceptor does not need: with lazy links both ranks of a pair may dial at once, and the lower
rank keeps its own dial; see transport/tcp.py); or GONE: b"LNGO" (the acceptor is closing the
group, or has already failed the connecting rank: no link will be made either way).

The job secret is 32 random bytes that rank 0 puts in the torch Store; the job id is derived from
it. Both sides prove knowledge of the secret over fresh nonces, so a stranger, a replay or a
peer of another job is dropped before any frame is read. All reads are bounded and timed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

MAGIC = b"LNRT"
VERSION = 2  # 2: frame headers carry the call digest (48 bytes)
ACK = b"LNOK"
DECLINE = b"LNDU"
GONE = b"LNGO"

HELLO = struct.Struct("<4sHH16sIIII16s")
CHALLENGE = struct.Struct("<4sHH16s32s")
AUTH_SIZE = 32
STATUS_OK = 0


class HandshakeError(Exception):
    """The other end is not a member of this job (or spoke a different protocol)."""


class Declined(HandshakeError):
    """The acceptor (a member of this job) does not need this connection: the link of the
    pair is being made the other way (lazy links, transport/tcp.py)."""


class Gone(HandshakeError):
    """The acceptor (a member of this job) makes no link with the connecting rank, either way:
    it is closing the group, or it has already failed the connecting rank."""


def job_id_from_secret(secret: bytes) -> bytes:
    return hashlib.sha256(b"linerate-job-id" + secret).digest()[:16]


def _mac(secret: bytes, role: bytes, hello: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + hello + nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes (n is a protocol constant here, never a peer's number).

    The socket's timeout bounds the whole read, not each recv: a peer that drips one byte
    at a time cannot hold a handshake (a thread and a descriptor) open for long."""
    timeout = sock.gettimeout()
    deadline = time.monotonic() + timeout if timeout else None
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout(f"timed out after {got} of {n} handshake bytes")
                sock.settimeout(left)
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise HandshakeError(f"connection closed after {got} of {n} handshake bytes")
            got += k
    finally:
        if deadline is not None:
            sock.settimeout(timeout)
    return bytes(buf)


def connect_side(sock: socket.socket, secret: bytes, src_rank: int, dst_rank: int,
                 conn_index: int, nconns: int) -> None:
    """Run the connector's half; raises HandshakeError if the acceptor is not of this job."""
    hello = HELLO.pack(MAGIC, VERSION, 0, job_id_from_secret(secret), src_rank, dst_rank,
                       conn_index, nconns, os.urandom(16))
    sock.sendall(hello)
    magic, version, status, server_nonce, server_mac = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size))
    if magic != MAGIC:
        raise HandshakeError(f"rank {dst_rank} answered with bad magic {magic!r}")
    if version != VERSION:
        raise HandshakeError(f"rank {dst_rank} speaks protocol version {version}, this rank {VERSION}")
    if status != STATUS_OK:
        raise HandshakeError(f"rank {dst_rank} refused the connection (status {status})")
    if not hmac.compare_digest(server_mac, _mac(secret, b"acceptor", hello, server_nonce)):
        raise HandshakeError(f"the listener at rank {dst_rank}'s address does not hold this job's secret")
    sock.sendall(_mac(secret, b"connector", hello, server_nonce))
    answer = recv_exact(sock, len(ACK))
    if answer == DECLINE:
        raise Declined(f"rank {dst_rank} makes the link the other way")
    if answer == GONE:
        raise Gone(f"rank {dst_rank} makes no link with rank {src_rank}: it closed the group "
                   f"or already failed rank {src_rank}")
    if answer != ACK:
        raise HandshakeError(f"rank {dst_rank} did not acknowledge the handshake")


def _check_nconns(src: int, theirs: int, index: int, nconns: int) -> None:
    if theirs != nconns or not 0 <= index < nconns:
        raise HandshakeError(f"rank {src} uses {theirs} connections per peer, this rank "
                             f"{nconns} (index {index}): set the same LINERATE_NSOCKS and "
                             f"LINERATE_SOCKET_IFNAME count on every rank")


def accept_side(sock: socket.socket, secret: bytes, my_rank: int, world_size: int,
                nconns, decide=None) -> tuple[int, int]:
    """Run the acceptor's half; return (peer rank, connection index) of an authenticated peer.
    ``nconns``: connections per peer, or ``nconns(peer, wait)`` where they differ by peer
    (None where not known yet and ``wait`` is false).
    ``decide(peer, index)``, once the peer is authenticated, answers ``ACK`` (go on),
    ``DECLINE`` (raises ``Declined``) or ``GONE`` (raises ``Gone``)."""
    hello = recv_exact(sock, HELLO.size)
    magic, version, _flags, job_id, src, dst, conn_index, their_nconns, _nonce = HELLO.unpack(hello)
    if magic != MAGIC:
        raise HandshakeError(f"bad magic {magic!r}: not a linerate connection")
    if version != VERSION:
        raise HandshakeError(f"protocol version {version}, expected {VERSION}")
    if job_id != job_id_from_secret(secret):
        raise HandshakeError(f"job id {job_id.hex()} is not this job's")
    if dst != my_rank:
        raise HandshakeError(f"connection meant for rank {dst} reached rank {my_rank}")
    if not 0 <= src < world_size or src == my_rank:
        raise HandshakeError(f"invalid source rank {src} (world size {world_size})")
    # Connections per peer: checked now where known; where they differ by peer and this
    # rank's plan of its links is not made yet (TcpMesh.plan_rails), only once the peer is
    # authenticated (waiting for the plan): a stranger's HELLO must not hold the acceptor up.
    want = nconns(src, False) if callable(nconns) else nconns
    if want is not None:
        _check_nconns(src, their_nconns, conn_index, want)
    server_nonce = os.urandom(16)
    sock.sendall(CHALLENGE.pack(MAGIC, VERSION, STATUS_OK, server_nonce,
                                _mac(secret, b"acceptor", hello, server_nonce)))
    auth = recv_exact(sock, AUTH_SIZE)
    if not hmac.compare_digest(auth, _mac(secret, b"connector", hello, server_nonce)):
        raise HandshakeError(f"claimed rank {src} failed authentication (wrong job secret)")
    if want is None:
        _check_nconns(src, their_nconns, conn_index, nconns(src, True))
    answer = ACK if decide is None else decide(src, conn_index)
    if answer == DECLINE:
        sock.sendall(DECLINE)
        raise Declined(f"rank {src}'s connection {conn_index}: the link is made the other way")
    if answer == GONE:
        sock.sendall(GONE)
        raise Gone(f"rank {src}'s connection {conn_index}: no link will be made with rank {src}")
    if answer != ACK:
        raise ValueError(f"decide answered {answer!r}, not ACK, DECLINE or GONE")
    sock.sendall(ACK)
    return src, conn_index
