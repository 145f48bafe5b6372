"""TLS 1.3 on the TCP transport's connections (``LINERATE_TLS=1``), as Gloo's TCP_TLS.

Every connection is wrapped right after TCP connect/accept, before linerate's own HMAC
handshake (transport/handshake.py), which then runs inside TLS; frames follow as without TLS.

- **TLS 1.3 only**, mutual authentication: each rank presents ``LINERATE_TLS_CERT`` (with its
  private key ``LINERATE_TLS_KEY``) and requires that the other end's certificate chains to
  ``LINERATE_TLS_CA``, both ways (the acceptor requires a client certificate). Host names are
  not checked: peers are addressed by the IPs they publish in the Store, so the check is "signed
  by the job's CA", not "issued for this address". Any certificate of that CA is accepted for
  any rank; the job secret (the HMAC handshake) then proves that the peer belongs to this job.
- Certificates and keys are read once per group (``load``); a file that is missing, unreadable,
  not PEM, a key that does not belong to the certificate or that is encrypted fails group
  creation with a ``TlsSetupError`` (a ValueError) naming the variable, the path and the problem.
- No session tickets (``num_tickets = 0``) and no renegotiation (TLS 1.3 has none): after the
  handshake only application data and alerts travel.

**Threads.** A connection has a sender and a receiver thread. OpenSSL does not allow SSL_read
and SSL_write on one SSL object at the same time (concurrent ``SSLSocket.send``/``recv`` from
two threads is a data race that can corrupt the stream or crash), so
``TlsStream`` keeps the TLS state in an ``ssl.SSLObject`` over memory BIOs: encryption and
decryption take a per-connection lock (held only for the OpenSSL call and the BIO copy, never
for socket I/O), and the bytes go through the plain socket outside it. Outgoing bytes are
written to the socket in the order OpenSSL produced them (``_wlock``).

``TlsStream`` overrides the two calls that move bytes (``sendmsg``/``sendall``, ``recv_into``
with ``MSG_WAITALL``) and hands every other to the plain socket, so the stream link's threads
(link.ThreadedStreamLink; its calls block) drive it as they drive a socket, frames and all:
the choice between TLS and plain TCP is made once per connection, when it is set up.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

log = logging.getLogger("linerate.transport")

__all__ = ["TlsConfig", "TlsStream", "TlsError", "TlsSetupError", "load"]

#: Plaintext bytes encrypted per lock hold: the receiver thread may decrypt in between.
_PIECE = 256 << 10
#: Frames up to this size (header + payload) are encrypted as one write.
_JOIN = 16 << 10
#: Ciphertext read from the socket per system call.
_RAW_READ = 256 << 10
#: Seconds a refused peer is given to read our alert before the socket closes (else its
#: unread bytes make the kernel answer with a reset and it may never see why).
_ALERT_LINGER_S = 1.0


class TlsSetupError(ValueError):
    """A TLS setting or file that cannot work (names the variable and the problem)."""


class TlsError(OSError):
    """A TLS failure on a connection (handshake refused, certificate not trusted, bad record)."""


# ============================================================================ set-up
def _no_password(*_args):
    raise TlsSetupError("encrypted")


def _read_file(var: str, path: str, what: str) -> bytes:
    if not path:
        raise TlsSetupError(f"LINERATE_TLS=1 needs {var} (the path of {what}); it is not set")
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 22)
    except OSError as e:
        raise TlsSetupError(f"{var}={path!r}: cannot read {what}: {e.strerror or e}") from None
    if not data.strip():
        raise TlsSetupError(f"{var}={path!r}: the file is empty (expected {what} in PEM form)")
    return data


class TlsConfig:
    """The client and server contexts of one group (loaded once, from the files)."""

    def __init__(self, client: ssl.SSLContext, server: ssl.SSLContext, paths: dict):
        self.client = client
        self.server = server
        self.paths = paths
        #: The last refused incoming handshake (for the mesh-timeout message).
        self.last_refusal: str | None = None

    def wrap(self, sock: socket.socket, server_side: bool, peer: str) -> "TlsStream":
        """Run the TLS handshake on a connected socket (within its timeout); return the
        stream. A failure raises TlsError (or the socket's OSError) and leaves ``sock`` open."""
        ctx = self.server if server_side else self.client
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_side=server_side)
        timeout = sock.gettimeout()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            while True:
                try:
                    obj.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                data = outgoing.read()
                if data:
                    sock.sendall(data)
                if done:
                    break
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout("timed out in the TLS handshake")
                    sock.settimeout(left)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise TlsError(f"{peer} closed the connection during the TLS handshake "
                                   f"(is LINERATE_TLS=1 set there, and does it trust this "
                                   f"rank's certificate?)")
                incoming.write(chunk)
        except ssl.SSLError as e:
            # Tell the other end why (the alert OpenSSL queued), and give it a moment to read
            # it before the socket goes: closing with its bytes unread would send a reset.
            try:
                alert = outgoing.read()
                if alert:
                    sock.sendall(alert)
                if server_side:
                    _linger(sock)
            except OSError:
                pass
            why = describe(e, peer, server_side)
            if server_side:
                self.last_refusal = why
            raise TlsError(why) from None
        finally:
            if deadline is not None:
                sock.settimeout(timeout)
        return TlsStream(sock, obj, incoming, outgoing, peer)


def _linger(sock: socket.socket) -> None:
    """Half-close and read until the peer closes (or _ALERT_LINGER_S), so that what we sent
    last reaches it instead of being cut by a reset."""
    try:
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + _ALERT_LINGER_S
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return
    except OSError:
        return


def describe(e: ssl.SSLError, peer: str, server_side: bool) -> str:
    """An SSLError as a sentence that says what to fix."""
    reason = (getattr(e, "reason", None) or "").upper()
    text = str(e)
    if isinstance(e, ssl.SSLCertVerificationError):
        return (f"{peer}'s certificate is not trusted: {e.verify_message} (it must be signed by "
                f"the CA in this rank's LINERATE_TLS_CA; {text})")
    if "ALERT_UNKNOWN_CA" in reason or "ALERT_BAD_CERTIFICATE" in reason or \
            "ALERT_CERTIFICATE_UNKNOWN" in reason:
        return (f"{peer} refused this rank's certificate: it does not trust the CA that signed "
                f"LINERATE_TLS_CERT here (it must be signed by the CA in LINERATE_TLS_CA "
                f"there; {text})")
    if "ALERT_CERTIFICATE_EXPIRED" in reason or "CERTIFICATE_REVOKED" in reason:
        return f"{peer} refused this rank's certificate ({text})"
    if "CERTIFICATE_REQUIRED" in reason or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in reason:
        return (f"{peer} sent no certificate (mutual authentication: every rank needs "
                f"LINERATE_TLS_CERT; {text})")
    if any(k in reason for k in ("WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG",
                                 "HTTP_REQUEST", "RECORD_LAYER_FAILURE", "UNEXPECTED_RECORD")):
        return f"{peer} does not speak TLS (is LINERATE_TLS=1 set there? {text})"
    if "PROTOCOL_VERSION" in reason or "UNSUPPORTED_PROTOCOL" in reason or \
            "NO_PROTOCOLS_AVAILABLE" in reason:
        return f"{peer} does not offer TLS 1.3, the only version linerate accepts ({text})"
    return f"TLS with {peer} failed: {text}"


def load(tls: bool, cert: str, key: str, ca: str) -> TlsConfig | None:
    """The TLS contexts for ``LINERATE_TLS``/``_CERT``/``_KEY``/``_CA`` (None when off).
    Raises TlsSetupError naming the variable and the problem."""
    if not tls:
        return None
    for var, path in (("LINERATE_TLS_CERT", cert), ("LINERATE_TLS_KEY", key),
                      ("LINERATE_TLS_CA", ca)):
        if not path:
            raise TlsSetupError(f"LINERATE_TLS=1 needs LINERATE_TLS_CERT, LINERATE_TLS_KEY and "
                                f"LINERATE_TLS_CA (PEM file paths); {var} is not set")
    cert_pem = _read_file("LINERATE_TLS_CERT", cert, "this rank's certificate")
    key_pem = _read_file("LINERATE_TLS_KEY", key, "this rank's private key")
    ca_pem = _read_file("LINERATE_TLS_CA", ca, "the job's CA certificate")
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise TlsSetupError(f"LINERATE_TLS_CERT={cert!r}: no PEM certificate in the file "
                            f"(expected -----BEGIN CERTIFICATE-----)")
    if b"PRIVATE KEY-----" not in key_pem:
        raise TlsSetupError(f"LINERATE_TLS_KEY={key!r}: no PEM private key in the file "
                            f"(expected -----BEGIN ... PRIVATE KEY-----)")
    if b"ENCRYPTED" in key_pem:
        raise TlsSetupError(f"LINERATE_TLS_KEY={key!r}: the key is encrypted (protected by a "
                            f"passphrase); linerate needs an unencrypted key file (mode 0600)")
    if b"-----BEGIN CERTIFICATE-----" not in ca_pem:
        raise TlsSetupError(f"LINERATE_TLS_CA={ca!r}: no PEM certificate in the file "
                            f"(expected the CA's -----BEGIN CERTIFICATE-----)")
    contexts = []
    for proto in (ssl.PROTOCOL_TLS_CLIENT, ssl.PROTOCOL_TLS_SERVER):
        ctx = ssl.SSLContext(proto)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        # Peers are addressed by IP: the check is that the chain ends at the job's CA.
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED  # server side: a client certificate is required
        if proto == ssl.PROTOCOL_TLS_SERVER:
            ctx.num_tickets = 0  # no post-handshake messages (and no resumption)
        try:
            ctx.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise TlsSetupError(f"LINERATE_TLS_CA={ca!r}: not a usable CA certificate: {e}") from None
        try:
            ctx.load_cert_chain(cert, key, password=_no_password)
        except TlsSetupError:
            raise TlsSetupError(f"LINERATE_TLS_KEY={key!r}: the key is encrypted (protected by "
                                f"a passphrase); linerate needs an unencrypted key") from None
        except ssl.SSLError as e:
            reason = (e.reason or "").upper()
            if "KEY_VALUES_MISMATCH" in reason:
                raise TlsSetupError(f"LINERATE_TLS_KEY={key!r} is not the private key of "
                                    f"LINERATE_TLS_CERT={cert!r}") from None
            raise TlsSetupError(f"LINERATE_TLS_CERT={cert!r} / LINERATE_TLS_KEY={key!r}: "
                                f"cannot load the certificate and key: {e}") from None
        except OSError as e:
            raise TlsSetupError(f"LINERATE_TLS_CERT={cert!r} / LINERATE_TLS_KEY={key!r}: "
                                f"{e.strerror or e}") from None
        contexts.append(ctx)
    return TlsConfig(contexts[0], contexts[1], {"LINERATE_TLS_CERT": cert,
                                                 "LINERATE_TLS_KEY": key, "LINERATE_TLS_CA": ca})


# ============================================================================ the stream
class TlsStream:
    """A connected socket with TLS: what the transport calls on a connection's socket."""

    __slots__ = ("raw", "_obj", "_in", "_out", "_lock", "_wlock", "_rbuf", "_rview", "version",
                 "cipher", "peer")

    def __init__(self, raw: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO, peer: str = "the peer"):
        self.raw = raw
        self.peer = peer
        self._obj = obj
        self._in = incoming
        self._out = outgoing
        self._lock = threading.Lock()    # the SSL object and both BIOs
        self._wlock = threading.Lock()   # writing ciphertext to the socket (keeps its order)
        self._rbuf = bytearray(_RAW_READ)
        self._rview = memoryview(self._rbuf)
        self.version = obj.version()
        c = obj.cipher()
        self.cipher = c[0] if c else "?"

    def __repr__(self) -> str:
        return f"<TlsStream {self.version} {self.cipher} fd={self.raw.fileno()}>"

    # ---------------------------------------------------------------- sending
    def _write(self, data) -> None:
        """With _wlock held: encrypt ``data`` and send the records."""
        mv = data if isinstance(data, memoryview) else memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = mv.nbytes
        if not n:
            return
        off = 0
        while True:
            with self._lock:
                self._obj.write(mv[off:off + _PIECE])
                out = self._out.read()
            self.raw.sendall(out)
            off += _PIECE
            if off >= n:
                return

    def sendall(self, data) -> None:
        if not len(data):
            return
        with self._wlock:
            self._write(data)

    def send(self, data) -> int:
        self.sendall(data)
        return len(memoryview(data).cast("B"))

    def sendmsg(self, buffers, *_ancillary) -> int:
        """All of ``buffers`` (never a partial write): a small frame as one TLS record."""
        views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
        total = sum(v.nbytes for v in views)
        with self._wlock:
            if total <= _JOIN:
                self._write(b"".join(views))
            else:
                for v in views:
                    if v.nbytes:
                        self._write(v)
        return total

    # ---------------------------------------------------------------- receiving
    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        """Decrypt into ``buffer``: up to ``nbytes`` (0: its size), at least one byte unless
        the stream ended (0). With MSG_WAITALL, all of them unless it ended."""
        view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = nbytes or view.nbytes
        waitall = flags & socket.MSG_WAITALL
        got = 0
        fresh = 0
        obj, lock = self._obj, self._lock
        while got < n:
            with lock:
                if fresh:
                    self._in.write(self._rview[:fresh])
                    fresh = 0
                try:
                    k = obj.read(n - got, view[got:n])
                except ssl.SSLWantReadError:
                    k = -1
                except ssl.SSLZeroReturnError:  # close_notify
                    return got
                except ssl.SSLError as e:
                    # TLS 1.3: a peer that refuses this rank's certificate says so (an alert)
                    # after this side's handshake has ended, on the first read.
                    raise TlsError(describe(e, self.peer, False)) from None
                pending_out = self._out.pending
            if pending_out:
                self._flush_pending()
            if k > 0:
                got += k
                if not waitall:
                    return got
                continue
            if k == 0:
                return got
            fresh = self.raw.recv_into(self._rview)
            if fresh == 0:
                return got  # the connection ended (without close_notify)
        return got

    def _flush_pending(self) -> None:
        """Send what reading produced (a key update's answer, an alert), unless the sender
        is writing: it then sends it before its own records (one BIO, one order)."""
        if self._wlock.acquire(blocking=False):
            try:
                with self._lock:
                    out = self._out.read()
                if out:
                    self.raw.sendall(out)
            finally:
                self._wlock.release()

    # ---------------------------------------------------------------- the socket
    def __getattr__(self, name):
        """The socket's other calls (names, options, timeouts, fileno, shutdown, close) are
        the plain socket's."""
        return getattr(self.raw, name)


def peer_label(addr) -> str:
    try:
        return f"{addr[0]}:{addr[1]}"
    except (TypeError, IndexError):
        return str(addr)
