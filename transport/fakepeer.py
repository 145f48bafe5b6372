"""A fake peer for testing the transport: rank 1 of a 2-rank group played on raw frames.

Rank 0 is a real :class:`~linerate.transport.context.Context`; rank 1 is one raw TCP connection
that completed a genuine handshake (it reads the job secret from the store, as a rank of the
job would), on which a test or the fuzzer (``python -m linerate.tools.dev.fuzz``) writes
whatever frames it likes, to control exactly what arrives and when. The transport's tests
(tests/test_transport.py, test_checksum.py, test_fuzz.py) and the fuzzer share this one.

Test support only: nothing in linerate imports it.
"""
from __future__ import annotations

import json
import socket
import threading
import time

from . import framing, handshake, rendezvous
from .context import Context
from .options import TransportOptions
from .rendezvous import version_text

__all__ = ["FakePeer", "DictStore", "DEFAULT_OPTIONS"]

#: Rank 0's settings unless told otherwise: loopback, one connection, tcp, links made at
#: creation (the fake rank 1 connects as an eager higher rank does).
DEFAULT_OPTIONS = dict(socket_ifname="lo", connect_timeout=30.0, nsocks=1, transport="tcp",
                       connect="eager")


class DictStore:
    """The two Store calls a Context needs (set, and a get that waits), in memory. No check():
    like a user's Store subclass without it, the Context then waits with blocking gets."""

    def __init__(self, timeout: float = 30.0):
        self._d: dict = {}
        self._cond = threading.Condition()
        self._timeout = timeout

    def set(self, key: str, value) -> None:
        with self._cond:
            self._d[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._d, timeout=self._timeout):
                raise TimeoutError(f"store key {key!r} not set")
            return self._d[key]


class FakePeer:
    """Rank 1 of a 2-rank group played by the caller on ``self.sock``; rank 0 is the real
    Context ``self.ctx``. ``store``: the rendezvous store (default: a :class:`DictStore`);
    ``describe``: the Context's mismatch wording; anything else: rank 0's TransportOptions
    fields."""

    def __init__(self, store=None, describe=None, **options):
        opts = TransportOptions(**{**DEFAULT_OPTIONS, **options})
        opts.validate()
        store = DictStore() if store is None else store
        self.options = opts
        self.ctx: Context | None = None
        err: list = []

        def build():
            try:
                self.ctx = Context(store, 0, 2, opts, describe=describe)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                err.append(e)

        t = threading.Thread(target=build, name="fakepeer-build", daemon=True)
        t.start()
        secret = bytes.fromhex(store.get(rendezvous.STORE_PREFIX + "secret").decode())
        # Rank 1's shared-memory record, as a rank on another host would publish it: no
        # shared memory with rank 0 (transport/shm; keys under this group's generation).
        # Rank 0 reads it before it chooses its links (and publishes its address).
        generation = secret.hex()[:16]
        base = f"{rendezvous.STORE_PREFIX}shm/{generation}/host/"
        store.set(base + "1",
                  json.dumps({"host": "fakepeer-elsewhere", "mode": getattr(opts, "shm", "auto"),
                              "version": version_text()}))
        (host, port), = json.loads(store.get(rendezvous.STORE_PREFIX + "addr/0").decode())
        self.sock = socket.create_connection((host, port), timeout=10)
        handshake.connect_side(self.sock, secret, 1, 0, 0, 1)
        t.join(30)
        if err or self.ctx is None:
            self.sock.close()
            raise err[0] if err else AssertionError("rank 0 did not finish its mesh")
        #: The largest chunk rank 0's receiver accepts.
        self.max_chunk = max(opts.chunk_bytes, 1 << 24)

    def data(self, channel, tag, msgno, total, offset, payload=b"", opcode=0, length=None):
        """Send one DATA frame (``length``: the header's, if not the payload's)."""
        n = len(payload) if length is None else length
        self.sock.sendall(framing.pack_header(framing.KIND_DATA, opcode, channel, n, tag, msgno,
                                              total, offset) + bytes(payload))

    def close(self, within: float | None = None) -> None:
        """Close rank 0's Context and the raw connection; ``within``: assert that it took at
        most this many seconds."""
        t0 = time.monotonic()
        if self.ctx is not None:
            self.ctx.close(timeout=2.0)
        self.sock.close()
        if within is not None:
            assert time.monotonic() - t0 < within, "Context.close took too long"
