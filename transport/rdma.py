"""RDMA links (transport/link.py): byte streams over reliable-connected queue pairs. A stream
offers what a TCP socket offers a ``link.StreamLink`` (sendall, sendmsg, recv_into,
shutdown, close, getsockname/getpeername, timeouts), so that framing, striping over
``LINERATE_NSOCKS`` streams per port and peer, the HMAC handshake and the statistics are the
TCP link's; ``RdmaLink`` is that link over RDMA streams. Like rsocket, one stream is one RC QP:

- the receiver owns a registered ring of RING_SLOTS slots of SLOT_BYTES; the sender fills
  the next slot with one RDMA WRITE WITH IMMEDIATE (immediate = slot << 24 | length; up to
  four gather entries: the frame header from a registered bounce buffer and the payload
  straight from the tensor, whose memory is registered through a cache keyed by address
  range); the receiver's completion says which slot holds how many bytes, and ``recv_into``
  copies from the ring into the caller's buffer (checking slot order, length and byte count);
- credits: the receiver returns freed slots in batches, as a WRITE WITH IMMEDIATE of a
  control word (bit 31 set, the running count of freed slots mod 2^24), so the sender never
  overruns the ring; a FIN control word ends the stream (``shutdown``);
- each side keeps 2 * RING_SLOTS + 4 receive WQEs posted (data and credit words can each be
  at most RING_SLOTS in flight), reposted as their completions are polled;
- completions are polled by one thread per process for every stream (pyverbs holds the GIL
  in its calls, so a blocking ``get_cq_event`` would stop every thread): it spins while
  completions come, then backs off to 1 ms; the threads that wait (for credits, for data, for
  their zero-copy writes to complete) wait on a condition it notifies;
- a send that used the caller's memory returns only when the writes completed (as a TCP
  send returns when the kernel has copied the bytes); copied pieces need not wait;
- a dead peer: an RC QP retries unacknowledged writes for ``LINERATE_LINK_TIMEOUT`` (the QP's
  timeout and retry count are derived from it) and then completes them in error; an idle
  stream sends an 8-byte keepalive write every second so that a peer that vanished is found
  without traffic.

Queue-pair numbers, PSNs, ring and control addresses and rkeys, LIDs and GIDs are exchanged
through the torch Store (``linerate/rdma/qp/<rank>/<peer>``), the QPs are brought to RTS, and
each stream then runs the same handshake as a TCP connection (the higher rank connects).

The choice between TCP and RDMA (LINERATE_TRANSPORT) is made at rendezvous
(``rendezvous.agree_transport``), from what ``local_status`` says on every rank; RDMA then
links every peer that shared memory does not (transport/kinds.py).

The tests run it against tests/fake_pyverbs, and against a real RDMA device only where the
machine has one.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import json
import logging
import math
import random
import socket
import threading
import time

from . import handshake, metrics, verbs
from .link import ThreadedStreamLink
from .request import TransportError
from .verbs import RdmaUnavailable, buffer_address

log = logging.getLogger("linerate.rdma")

# ----------------------------------------------------------------------------- protocol
RING_SLOTS = 8                   # slots of the receive ring (<= 127: 7 bits of the immediate)
SLOT_BYTES = 256 << 10           # bytes per slot (< 2^24: 24 bits of the immediate)
BOUNCE_SLOTS = 4                 # send-side registered copies in flight
ZCOPY_MIN = 32 << 10             # pieces from this size up are sent from the caller's memory
RQ_DEPTH = 2 * RING_SLOTS + 4
SQ_DEPTH = RING_SLOTS + BOUNCE_SLOTS + 16
SQ_RESERVE = 4                   # SQ entries data writes leave for credit, FIN and keepalive
CQ_DEPTH = SQ_DEPTH + RQ_DEPTH + 8
CREDIT_BATCH = max(1, RING_SLOTS // 4)
CTRL_BYTES = 64                  # [0:8) source of control writes, [8:16) their target at the
                                 # peer, [16:24) keepalive target, [32:64) receive SGE
IMM_CONTROL = 1 << 31
CTRL_CREDIT = 1
CTRL_FIN = 2
_RECV_ID = 1 << 62               # wr_id of receive WQEs (send WRs count from 0)
_IDLE_MAX = 0.001                # the poller's longest sleep
_KEEPALIVE_S = 1.0
_LINGER_S = 2.0                  # close(): how long queued writes (a CLOSE frame, FIN) may take
_HOP_LIMIT = 64

_WR_DATA, _WR_CTRL, _WR_KEEPALIVE = 0, 1, 2


def qp_timeout_exponent(link_timeout: float, retry_cnt: int = 7) -> int:
    """The RC QP's ``timeout`` (4.096 us * 2^t per try, retry_cnt + 1 tries) that comes closest
    to LINERATE_LINK_TIMEOUT from above; 14 (67 ms, ~0.5 s in all) when it is 0."""
    if link_timeout <= 0:
        return 14
    per_try = link_timeout / (retry_cnt + 1)
    return max(10, min(30, math.ceil(math.log2(per_try / 4.096e-6))))


def _status_name(pv, status: int) -> str:
    for name in dir(pv.e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") and getattr(pv.e, name) == status:
            return name[len("IBV_WC_"):]
    return f"status {status}"


# ----------------------------------------------------------------------------- verbs objects
# The pyverbs objects the stream builds, as functions of their inputs (tests build them with
# the real pyverbs too, where it is installed, to check every name and argument here).
def init_attr(pv, port_num: int):
    """QPAttr for RESET -> INIT: the port, remote writes allowed."""
    e = pv.e
    attr = pv.qp.QPAttr(port_num=port_num)
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    attr.pkey_index = 0
    return attr


def connect_attr(pv, port_num: int, ethernet: bool, sgid_index: int | None, local_mtu: int,
                 remote: dict, psn: int, link_timeout: float):
    """QPAttr for INIT -> RTR -> RTS towards ``remote`` (a peer's ``local_info()``): on RoCE
    (or where the peer has no LID) a GRH to its GID, else its LID."""
    e = pv.e
    attr = pv.qp.QPAttr(port_num=port_num, path_mtu=min(local_mtu, remote["mtu"]))
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    attr.dest_qp_num = remote["qpn"]
    attr.rq_psn = remote["psn"]
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = 12
    if ethernet or not remote["lid"]:
        if sgid_index is None or not remote["gid"]:
            raise TransportError("an RDMA port without a GID cannot reach a RoCE peer (or one without a LID)")
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(remote["gid"]), sgid_index=sgid_index, hop_limit=_HOP_LIMIT)
        attr.ah_attr = pv.addr.AHAttr(dlid=remote["lid"], sl=0, is_global=1, port_num=port_num, gr=gr)
    else:
        attr.ah_attr = pv.addr.AHAttr(dlid=remote["lid"], sl=0, is_global=0, port_num=port_num)
    attr.sq_psn = psn
    attr.timeout = qp_timeout_exponent(link_timeout)
    attr.retry_cnt = 7
    attr.rnr_retry = 7   # 7: retry for ever (receive WQEs are always posted anyway)
    attr.max_rd_atomic = 1
    return attr


def write_wr(pv, wr_id: int, sges, raddr: int, rkey: int, imm: int | None = None):
    """RDMA WRITE (WITH IMMEDIATE where ``imm`` is given) of the (addr, length, lkey) ``sges``."""
    e = pv.e
    sg = [pv.wr.SGE(a, n, k) for a, n, k in sges]
    if imm is None:
        swr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=len(sg), sg=sg)
    else:
        swr = pv.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=len(sg),
                           imm_data=socket.htonl(imm), sg=sg)
    swr.set_wr_rdma(rkey, raddr)
    return swr


def recv_wr(pv, wr_id: int, addr: int, length: int, lkey: int):
    return pv.wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[pv.wr.SGE(addr, length, lkey)])


class _Inflight:
    __slots__ = ("seq", "kind", "bounce", "pins", "nbytes")

    def __init__(self, seq, kind, bounce=None, pins=(), nbytes=0):
        self.seq, self.kind, self.bounce, self.pins, self.nbytes = seq, kind, bounce, pins, nbytes


# ----------------------------------------------------------------------------- the stream
class RdmaStream:
    """One RC queue pair as a byte stream (see the module docstring)."""

    def __init__(self, port: verbs.OpenPort, link_timeout: float = 60.0):
        pv = self.pv = port.pv
        e = pv.e
        self.port = port
        self.interface = port.name          # the metrics' interface label
        self._link_timeout = link_timeout
        self._keepalive_s = max(0.2, min(_KEEPALIVE_S, link_timeout / 3)) if link_timeout > 0 else _KEEPALIVE_S
        self._cond = threading.Condition(threading.Lock())
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._cq_lock = threading.Lock()   # the poller's, while it handles this stream
        self._timeout: float | None = None
        self._objs = []
        try:
            self._cq = pv.cq.CQ(port.ctx, CQ_DEPTH, None, None, 0)
            self._objs.append(self._cq)
            cap = pv.qp.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=RQ_DEPTH, max_send_sge=port.max_sge,
                              max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=1)
            self._qp = pv.qp.QP(port.pd, init)
            self._objs.insert(0, self._qp)
            rw = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            self._ring = port.register(RING_SLOTS * SLOT_BYTES, rw)
            self._objs.insert(1, self._ring)
            self._ctrl = port.register(CTRL_BYTES, rw)
            self._objs.insert(1, self._ctrl)
            self._bounce = port.register(BOUNCE_SLOTS * SLOT_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
            self._objs.insert(1, self._bounce)
            self._qp.to_init(init_attr(pv, port.info.port))
            self._recv_wrs = [recv_wr(pv, _RECV_ID | i, self._ctrl.buf + 32, 32, self._ctrl.lkey)
                              for i in range(RQ_DEPTH)]
            for wr in self._recv_wrs:
                self._qp.post_recv(wr)
        except pv.Error as exc:
            self._release_objs()
            raise OSError(errno.EIO, f"cannot set up an RDMA queue pair on {port.name}: {exc}") from None
        except BaseException:
            self._release_objs()
            raise
        self.psn = random.getrandbits(24)
        self.remote: dict | None = None
        self.remote_label = "?"
        # send side (guarded by _cond)
        self._r_ring = self._r_ctrl = (0, 0)       # (address, rkey) at the peer
        self._sent = 0             # data writes posted (slot of the next: _sent % RING_SLOTS)
        self._credited = 0         # of those, slots the peer has freed
        self._credit_val = 0       # the last credit word received (mod 2^24)
        self._seq = 0              # send WRs posted
        self._done = 0             # send WRs completed (completions come in posting order)
        self._inflight: collections.deque = collections.deque()
        self._bounce_taken = 0
        self._bounce_freed = 0
        self._posted_bytes = 0
        self._completed_bytes = 0
        self._last_post = time.monotonic()
        self._keepalive_out = False
        self._fin_sent = False
        # receive side (guarded by _cond)
        self._ready: collections.deque = collections.deque()   # (slot, length) received
        self._rd_off = 0           # bytes of _ready[0] already read
        self._recv_seq = 0         # data writes received
        self._freed = 0            # slots read out
        self._returned = 0         # of those, returned to the peer as credits
        self._credit_pending = False
        self._fin = False
        # life
        self._error: OSError | None = None
        self._error_tentative = False   # a flush: the QP's error state, not yet its cause
        self._shut_rd = self._shut_wr = False
        self._closed = False
        self._closed_at = 0.0
        self._destroyed = False
        self._busy = 0
        self._connected = False

    # ------------------------------------------------------------------ set-up
    def local_info(self) -> dict:
        info = self.port.info
        gid = self.port.gid
        return {"qpn": self._qp.qp_num, "psn": self.psn, "lid": info.lid, "mtu": info.active_mtu,
                "gid": gid.gid if gid else "", "ib": info.link_layer != "Ethernet",
                "ring": [self._ring.buf, self._ring.rkey], "ctrl": [self._ctrl.buf, self._ctrl.rkey],
                "slots": RING_SLOTS, "slot_bytes": SLOT_BYTES, "port": self.port.name}

    def connect(self, remote: dict, label: str = "") -> None:
        """INIT -> RTR -> RTS towards the peer's QP (its ``local_info()``)."""
        _check_remote(remote)
        if remote["slots"] != RING_SLOTS or remote["slot_bytes"] != SLOT_BYTES:
            raise TransportError(f"the peer's RDMA ring is {remote['slots']} x {remote['slot_bytes']} "
                                 f"bytes, this rank's {RING_SLOTS} x {SLOT_BYTES}: different linerate versions")
        pv, port = self.pv, self.port
        attr = connect_attr(pv, port.info.port, port.info.link_layer == "Ethernet",
                            port.gid.index if port.gid else None, port.info.active_mtu, remote,
                            self.psn, self._link_timeout)
        try:
            self._qp.to_rtr(attr)
            self._qp.to_rts(attr)
        except pv.Error as exc:
            raise OSError(errno.EIO, f"cannot connect RDMA queue pair {self._qp.qp_num} on {port.name} to "
                                     f"QP {remote['qpn']} ({label or remote['port']}): {exc}") from None
        self.remote = remote
        self.remote_label = label or remote["port"]
        self._r_ring = tuple(remote["ring"])
        self._r_ctrl = tuple(remote["ctrl"])
        self._connected = True
        _POLLER.add(self)

    # ------------------------------------------------------------------ socket-like surface
    def getsockname(self):
        return (self.port.name, self._qp.qp_num)

    def getpeername(self):
        return (self.remote_label, self.remote["qpn"] if self.remote else 0)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def setsockopt(self, *args) -> None:
        raise OSError(errno.ENOPROTOOPT, "an RDMA stream has no socket options")

    def getsockopt(self, *args):
        raise OSError(errno.ENOPROTOOPT, "an RDMA stream has no socket options (no TCP_INFO)")

    def fileno(self) -> int:
        return -1

    def queued_bytes(self) -> int:
        """Bytes posted to the queue pair whose writes have not completed (metrics)."""
        return max(0, self._posted_bytes - self._completed_bytes)

    def __repr__(self) -> str:
        qpn = self._qp.qp_num if not self._destroyed else "-"
        return f"<RdmaStream {self.port.name} qp {qpn} -> {self.remote_label}>"

    # ------------------------------------------------------------------ sending
    def sendall(self, data) -> None:
        self.sendmsg((data,))

    def send(self, data) -> int:
        return self.sendmsg((data,))

    def sendmsg(self, buffers, *_ancillary) -> int:
        """Send every byte of ``buffers`` (returns their total). Pieces from ZCOPY_MIN bytes up
        go from the caller's memory (registered through the MR cache) and are waited for;
        smaller ones are copied into a registered bounce slot."""
        self._enter()
        try:
            with self._send_lock:
                return self._sendmsg(buffers)
        finally:
            self._leave()

    def _sendmsg(self, buffers) -> int:
        self._check_send()
        cache = self.port.mr_cache
        max_sge = self.port.max_sge
        total = 0
        wr = _WR()
        last_zc = -1
        try:
            for buf in buffers:
                mv = memoryview(buf)
                if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
                    mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
                size = mv.nbytes
                total += size
                off = 0
                while off < size:
                    n = min(SLOT_BYTES - wr.length, size - off)
                    piece = mv[off:off + n]
                    addr = buffer_address(piece)
                    got = cache.acquire(piece) if n >= ZCOPY_MIN else None
                    if got is not None:
                        if len(wr.sges) >= max_sge:   # no gather entry left: next write
                            cache.release(got[0])
                            last_zc = max(last_zc, self._post_data(wr))
                            wr = _WR()
                            continue
                        wr.pins.append(got[0])
                        wr.sges.append([addr, n, got[1]])
                        wr.zero_copy = True
                    else:
                        last = wr.sges[-1] if wr.sges else None
                        dst = None if wr.bounce is None else \
                            self._bounce.buf + wr.bounce * SLOT_BYTES + wr.bounce_off
                        merge = last is not None and dst is not None and last[2] == self._bounce.lkey \
                            and last[0] + last[1] == dst
                        if not merge and len(wr.sges) >= max_sge:
                            last_zc = max(last_zc, self._post_data(wr))
                            wr = _WR()
                            continue
                        if wr.bounce is None:
                            wr.bounce = self._take_bounce()
                            dst = self._bounce.buf + wr.bounce * SLOT_BYTES
                        ctypes.memmove(dst, addr, n)
                        if merge:
                            last[1] += n
                        else:
                            wr.sges.append([dst, n, self._bounce.lkey])
                        wr.bounce_off += n
                    wr.length += n
                    off += n
                    if wr.length == SLOT_BYTES:
                        last_zc = max(last_zc, self._post_data(wr))
                        wr = _WR()
            if wr.length:
                last_zc = max(last_zc, self._post_data(wr))
            wr = None
        finally:
            if wr is not None:   # failed midway: drop the pins of what was not posted
                for ent in wr.pins:
                    cache.release(ent)
        if last_zc >= 0:  # the caller may reuse its buffer once we return
            with self._cond:
                while self._done <= last_zc:
                    if self._error is not None:
                        raise self._copy_error()
                    if self._closed and time.monotonic() > self._closed_at + _LINGER_S:
                        break
                    self._cond.wait(0.5)
                else:
                    if self._error is not None:  # our writes completed in error
                        raise self._copy_error()
                    return total
            # Closed while the HCA may still read the caller's memory (a peer that stopped
            # acknowledging): destroying the QP ends that, then the caller may have it back.
            self._kill_qp()
            raise BrokenPipeError(errno.EPIPE, "the RDMA stream was closed during a send")
        return total

    def _take_bounce(self) -> int:
        with self._cond:
            while self._bounce_taken - self._bounce_freed >= BOUNCE_SLOTS:
                self._raise_if_broken_send()
                _POLLER.kick()
                self._cond.wait(0.5)
            slot = self._bounce_taken % BOUNCE_SLOTS
            self._bounce_taken += 1
            return slot

    def _post_data(self, wr: "_WR") -> int:
        """Post one data write into the peer's next ring slot (waiting for a credit and an SQ
        entry); return its sequence number."""
        with self._cond:
            while True:
                self._raise_if_broken_send()
                if (self._sent - self._credited < RING_SLOTS
                        and self._seq - self._done < SQ_DEPTH - SQ_RESERVE):
                    break
                _POLLER.kick()
                self._cond.wait(0.5)
            slot = self._sent % RING_SLOTS
            swr = write_wr(self.pv, self._seq, wr.sges, self._r_ring[0] + slot * SLOT_BYTES,
                           self._r_ring[1], imm=(slot << 24) | wr.length)
            seq = self._post(swr, _Inflight(self._seq, _WR_DATA, wr.bounce, wr.pins, wr.length))
            wr.pins = []
            self._sent += 1
        return seq if wr.zero_copy else -1

    def _post(self, swr, rec: _Inflight) -> int:
        """With _cond held: post a send WR, remember it; OSError if the QP refuses it."""
        try:
            self._qp.post_send(swr)
        except self.pv.Error as exc:
            if rec.bounce is not None:
                self._bounce_freed += 1
            for ent in rec.pins:
                self.port.mr_cache.release(ent)
            if isinstance(rec.pins, list):
                rec.pins.clear()   # the caller's list too: released once
            err = ConnectionResetError(errno.ECONNRESET, f"RDMA post_send on QP {self._qp.qp_num} "
                                                         f"({self.port.name}) failed: {exc}")
            self._set_error(err)
            raise self._copy_error() from None
        self._inflight.append(rec)
        self._seq += 1
        self._posted_bytes += rec.nbytes
        self._last_post = time.monotonic()
        _POLLER.kick()
        return rec.seq

    def _post_control(self, kind: int, value: int = 0) -> bool:
        """With _cond held: a control word (CTRL_CREDIT, CTRL_FIN) or a keepalive (kind None);
        False where the SQ is full (the poller retries a pending credit)."""
        if self._seq - self._done >= SQ_DEPTH or self._error is not None or not self._connected:
            return False
        src = [(self._ctrl.buf, 8, self._ctrl.lkey)]
        if kind is None:
            swr = write_wr(self.pv, self._seq, src, self._r_ctrl[0] + 16, self._r_ctrl[1])
        else:
            swr = write_wr(self.pv, self._seq, src, self._r_ctrl[0] + 8, self._r_ctrl[1],
                           imm=IMM_CONTROL | (kind << 24) | (value & 0xFFFFFF))
        try:
            self._post(swr, _Inflight(self._seq, _WR_KEEPALIVE if kind is None else _WR_CTRL))
        except OSError:
            return False
        return True

    def _check_send(self) -> None:
        with self._cond:
            self._raise_if_broken_send()

    def _raise_if_broken_send(self) -> None:
        if self._error is not None:
            raise self._copy_error()
        if self._shut_wr or self._closed:
            raise BrokenPipeError(errno.EPIPE, "the RDMA stream was shut down")
        if not self._connected:
            raise OSError(errno.ENOTCONN, "the RDMA stream is not connected")

    # ------------------------------------------------------------------ receiving
    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        """Copy up to ``nbytes`` received bytes into ``buffer`` (all of them with
        MSG_WAITALL, unless the stream ends); 0 at the end of the stream."""
        view = memoryview(buffer)
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        if nbytes <= 0 or nbytes > view.nbytes:
            nbytes = view.nbytes
        if nbytes == 0:
            return 0
        waitall = bool(flags & socket.MSG_WAITALL)
        dst = buffer_address(view)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        got = 0
        self._enter()
        try:
            with self._recv_lock:
                while got < nbytes:
                    with self._cond:
                        while not self._ready:
                            if self._error is not None:
                                if got:
                                    return got
                                raise self._copy_error()
                            if self._fin or self._shut_rd or self._closed:
                                return got
                            if deadline is not None:
                                left = deadline - time.monotonic()
                                if left <= 0:
                                    if got:
                                        return got
                                    raise socket.timeout("timed out")
                                self._cond.wait(min(left, 0.5))
                            else:
                                self._cond.wait(0.5)
                        slot, length = self._ready[0]
                        rd = self._rd_off
                    n = min(length - rd, nbytes - got)
                    ctypes.memmove(dst + got, self._ring.buf + slot * SLOT_BYTES + rd, n)
                    got += n
                    with self._cond:
                        self._rd_off += n
                        if self._rd_off == length:
                            self._ready.popleft()
                            self._rd_off = 0
                            self._freed += 1
                            if self._freed - self._returned >= CREDIT_BATCH or not self._ready:
                                self._return_credits()
                    if not waitall:
                        break
            return got
        finally:
            self._leave()

    def _return_credits(self) -> None:
        """With _cond held: tell the peer how many slots are free (or leave it to the poller)."""
        if self._freed == self._returned or self._shut_rd:
            return
        if self._post_control(CTRL_CREDIT, self._freed):
            self._returned = self._freed
            self._credit_pending = False
        else:
            self._credit_pending = self._error is None

    # ------------------------------------------------------------------ completions (poller)
    def _progress(self) -> bool:
        """Poll this stream's CQ once; True if anything happened."""
        with self._cq_lock:
            if self._destroyed:
                return False
            try:
                n, wcs = self._cq.poll(32)
            except self.pv.Error as exc:
                self._set_error(ConnectionResetError(errno.EIO, f"polling the CQ of {self!r} failed: {exc}"))
                return True
            if not n and not self._credit_pending:
                return False
            e = self.pv.e
            with self._cond:
                for wc in wcs:
                    if wc.wr_id & _RECV_ID:
                        self._on_recv(wc, e)
                    else:
                        self._on_send(wc, e)
                if self._credit_pending:
                    self._return_credits()
                self._cond.notify_all()
            return bool(n)

    def _on_send(self, wc, e) -> None:
        if not self._inflight:
            self._protocol_error(f"a send completion (wr_id {wc.wr_id}) for nothing posted")
            return
        rec = self._inflight.popleft()
        if rec.seq != wc.wr_id:
            self._protocol_error(f"send completion {wc.wr_id} arrived where {rec.seq} was expected")
        self._done = rec.seq + 1
        self._completed_bytes += rec.nbytes
        if rec.bounce is not None:
            self._bounce_freed += 1
        for ent in rec.pins:
            self.port.mr_cache.release(ent)
        if rec.kind == _WR_KEEPALIVE:
            self._keepalive_out = False
        if wc.status != e.IBV_WC_SUCCESS:
            self._wc_error(wc, "write")

    def _on_recv(self, wc, e) -> None:
        if wc.status != e.IBV_WC_SUCCESS:
            self._wc_error(wc, "receive")
            return
        if not (self._closed or self._error):
            try:
                self._qp.post_recv(self._recv_wrs[wc.wr_id & ~_RECV_ID])
            except (self.pv.Error, IndexError) as exc:
                self._set_error(ConnectionResetError(errno.EIO, f"reposting a receive on {self!r} failed: {exc}"))
                return
        if wc.opcode != e.IBV_WC_RECV_RDMA_WITH_IMM:
            self._protocol_error(f"a completion of opcode {wc.opcode} (only RDMA writes with immediate "
                                 f"are expected)")
            return
        imm = socket.ntohl(wc.imm_data)
        if imm & IMM_CONTROL:
            kind, value = (imm >> 24) & 0x7F, imm & 0xFFFFFF
            if kind == CTRL_CREDIT:
                delta = (value - self._credit_val) & 0xFFFFFF
                if delta > self._sent - self._credited:
                    self._protocol_error(f"the peer returned {delta} ring slots but only "
                                         f"{self._sent - self._credited} are in use")
                    return
                self._credited += delta
                self._credit_val = value
            elif kind == CTRL_FIN:
                self._fin = True
            else:
                self._protocol_error(f"unknown control word {imm:#010x}")
            return
        slot, length = (imm >> 24) & 0x7F, imm & 0xFFFFFF
        expect = self._recv_seq % RING_SLOTS
        if slot != expect or not 0 < length <= SLOT_BYTES or length != wc.byte_len:
            self._protocol_error(f"write #{self._recv_seq} says slot {slot} ({length} bytes, "
                                 f"{wc.byte_len} arrived); expected slot {expect}, at most {SLOT_BYTES} bytes")
            return
        if len(self._ready) >= RING_SLOTS:
            self._protocol_error("the peer wrote into a ring slot that was not free")
            return
        self._ready.append((slot, length))
        self._recv_seq += 1

    def _wc_error(self, wc, what: str) -> None:
        e = self.pv.e
        flushed = wc.status == e.IBV_WC_WR_FLUSH_ERR
        if flushed and (self._closed or self._error is not None):
            return
        name = _status_name(self.pv, wc.status)
        hint = ""
        if wc.status == e.IBV_WC_RETRY_EXC_ERR:
            hint = (f": the peer ({self.remote_label}) acknowledged nothing for the QP's retry time "
                    f"(~{self._link_timeout:.0f}s, LINERATE_LINK_TIMEOUT): it exited or its link is down")
        if flushed:  # the QP went to error; the completion that says why may follow
            name = "WR_FLUSH_ERR (the queue pair is in the error state)"
        self._set_error(ConnectionResetError(errno.ECONNRESET, f"RDMA {what} on QP {self._qp.qp_num} "
                                                              f"({self.port.name}) failed: {name}{hint}"),
                        tentative=flushed)

    def _protocol_error(self, what: str) -> None:
        self._set_error(ConnectionAbortedError(errno.EPROTO, f"RDMA stream protocol error from "
                                                            f"{self.remote_label}: {what}"))

    def _set_error(self, err: OSError, tentative: bool = False) -> None:
        if self._error is None or self._error_tentative:
            self._error = err
            self._error_tentative = tentative

    def _copy_error(self) -> OSError:
        err = self._error
        return type(err)(err.errno, err.strerror)

    def _keepalive(self, now: float) -> None:
        """From the poller: an idle stream writes 8 bytes, so that a vanished peer shows."""
        if now - self._last_post < self._keepalive_s or self._keepalive_out:
            return
        with self._cond:
            if self._closed or self._error is not None or self._fin:
                return
            if self._post_control(None):
                self._keepalive_out = True

    # ------------------------------------------------------------------ the end
    def shutdown(self, how: int) -> None:
        with self._cond:
            if how in (socket.SHUT_WR, socket.SHUT_RDWR) and not self._shut_wr:
                self._shut_wr = True
                if not self._fin_sent and self._connected and self._error is None:
                    self._fin_sent = self._post_control(CTRL_FIN)
            if how in (socket.SHUT_RD, socket.SHUT_RDWR):
                self._shut_rd = True
            self._cond.notify_all()

    def close(self) -> None:
        """Returns at once; like a TCP close, writes already posted (the last frames, FIN)
        still go out: the poller destroys the QP once they completed (or after _LINGER_S)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._closed_at = time.monotonic()
            self._shut_rd = self._shut_wr = True
            self._cond.notify_all()
            idle = self._busy == 0
        if idle:
            self._retire()

    def _retire(self) -> None:
        if self._connected:
            _POLLER.retire(self, time.monotonic() + _LINGER_S)
        else:
            self._destroy()

    def _drained(self) -> bool:
        return self._done >= self._seq or self._error is not None

    def _enter(self) -> None:
        with self._cond:
            if self._closed:
                raise OSError(errno.EBADF, "the RDMA stream is closed")
            self._busy += 1

    def _leave(self) -> None:
        with self._cond:
            self._busy -= 1
            last = self._closed and self._busy == 0
        if last:
            self._retire()

    def _kill_qp(self) -> None:
        """Destroy the QP now (the rest waits for _destroy): no more DMA to or from anything."""
        with self._cq_lock:
            if self._objs and self._objs[0] is self._qp:
                try:
                    self._objs.pop(0).close()
                except Exception as exc:  # noqa: BLE001
                    log.debug("closing the QP of %r: %s", self, exc)

    def _destroy(self) -> None:
        """QP first (the HCA stops touching the memory), then the memory regions, the CQ."""
        with self._cq_lock:
            with self._cond:
                if self._destroyed:
                    return
                self._destroyed = True
                pins = [ent for rec in self._inflight for ent in rec.pins]
                self._inflight.clear()
            self._release_objs()
            for ent in pins:
                self.port.mr_cache.release(ent)

    def _release_objs(self) -> None:
        for obj in self._objs:
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.debug("closing %s: %s", obj, exc)
        self._objs = []


class _WR:
    """A data write being assembled: gather entries, pinned MR cache entries, bounce slot."""
    __slots__ = ("sges", "pins", "length", "bounce", "bounce_off", "zero_copy")

    def __init__(self):
        self.sges: list = []
        self.pins: list = []
        self.length = 0
        self.bounce = None
        self.bounce_off = 0
        self.zero_copy = False


def _check_remote(r) -> None:
    def u(v, bits):
        return type(v) is int and 0 <= v < 1 << bits
    ok = isinstance(r, dict) and u(r.get("qpn"), 24) and u(r.get("psn"), 24) and u(r.get("lid"), 16) \
        and u(r.get("mtu"), 8) and isinstance(r.get("gid"), str) and isinstance(r.get("port"), str) \
        and u(r.get("slots"), 8) and u(r.get("slot_bytes"), 32) and all(
            isinstance(r.get(k), list) and len(r[k]) == 2 and u(r[k][0], 64) and u(r[k][1], 32)
            for k in ("ring", "ctrl"))
    if not ok:
        raise TransportError(f"malformed RDMA queue pair information: {str(r)[:300]}")


# ----------------------------------------------------------------------------- the poller
class _Poller:
    """One thread per process polls the completion queues of every stream."""

    def __init__(self):
        self._lock = threading.Lock()
        self._streams: set = set()
        self._retiring: dict = {}      # closed streams -> when to destroy them regardless
        self._thread: threading.Thread | None = None
        self._kick = threading.Event()

    def add(self, s: RdmaStream) -> None:
        with self._lock:
            self._streams.add(s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="linerate-rdma-poll", daemon=True)
                self._thread.start()
        self._kick.set()

    def retire(self, s: RdmaStream, deadline: float) -> None:
        """``s`` was closed: destroy it once its posted writes completed (or at ``deadline``)."""
        with self._lock:
            if s in self._streams:
                self._retiring[s] = deadline
                s = None
        if s is not None:
            s._destroy()
        self._kick.set()

    def kick(self) -> None:
        self._kick.set()

    def _run(self) -> None:
        delay = 0.0
        next_keepalive = 0.0
        while True:
            with self._lock:
                streams = list(self._streams)
                if not streams:
                    self._thread = None
                    return
            busy = False
            for s in streams:
                try:
                    busy |= s._progress()
                except Exception as exc:  # noqa: BLE001 - one stream's trouble is its own
                    log.exception("linerate: RDMA poller")
                    with s._cond:
                        s._set_error(ConnectionResetError(errno.EIO, f"RDMA poller: {exc}"))
                        s._cond.notify_all()
            now = time.monotonic()
            with self._lock:
                done = [s for s, t in self._retiring.items() if now >= t or s._drained()]
                for s in done:
                    del self._retiring[s]
                    self._streams.discard(s)
            for s in done:
                s._destroy()
            if now >= next_keepalive:
                next_keepalive = now + 0.1
                for s in streams:
                    s._keepalive(now)
            if busy:
                delay = 0.0
                time.sleep(0)   # let the waiting threads have the GIL
                continue
            delay = 2e-5 if delay == 0 else min(delay * 2, _IDLE_MAX)
            if self._kick.wait(delay):
                self._kick.clear()
                delay = 0.0


_POLLER = _Poller()


# ----------------------------------------------------------------------------- rendezvous
def _store_get(store, key: str) -> bytes:
    value = store.get(key)
    return value if isinstance(value, bytes) else bytes(value)


def local_status(opts) -> tuple[bool, str, int]:
    """(has what LINERATE_TRANSPORT=rdma needs, why or which ports, number of ports)."""
    try:
        ports = verbs.select_ports(opts.rdma_ports)
        for p in ports:
            if p.link_layer == "Ethernet":
                if verbs.choose_gid(p, opts.rdma_gid_index) is None:
                    raise RdmaUnavailable(f"RoCE port {p.name} has no GID (no IP address on its interface?)")
            elif opts.rdma_gid_index >= 0:
                verbs.choose_gid(p, opts.rdma_gid_index)
    except RdmaUnavailable as e:
        return False, str(e), 0
    return True, ", ".join(f"{p.name} ({p.kind}, {p.state})" for p in ports), len(ports)


class RdmaLink(ThreadedStreamLink):
    """A peer's RDMA streams (one RC queue pair each), striped like TCP connections."""

    kind = "rdma"


def open_ports(rank: int, opts) -> list:
    """The ports LINERATE_RDMA_DEVICE selects, opened (a TransportError naming why not)."""
    try:
        return [verbs.open_port(p, opts.rdma_gid_index) for p in verbs.select_ports(opts.rdma_ports)]
    except RdmaUnavailable as e:
        raise TransportError(f"rank {rank}: LINERATE_TRANSPORT: cannot use RDMA: {e}") from None


def build_links(store, rank: int, size: int, secret: bytes, opts, ports: list,
                link_timeout: float, deadline: float, prefix: str,
                peers=None) -> dict[int, RdmaLink]:
    """Connect to ``peers`` (default: every other rank) over RDMA streams (``opts.nsocks`` per
    port): QPs, Store exchange, RTS, the handshake on each stream; returns each peer's link
    (not started). Both ends of every pair must list each other (transport/kinds.py: the
    ranks linked over shared memory are nobody's RDMA peers)."""
    nconns = opts.nsocks * len(ports)
    peers = [p for p in range(size) if p != rank] if peers is None else sorted(peers)
    streams: dict[tuple, RdmaStream] = {}
    done = False
    try:
        for peer in peers:
            for index in range(nconns):
                streams[peer, index] = RdmaStream(ports[index // opts.nsocks], link_timeout)
        host = socket.gethostname()
        for peer in peers:
            store.set(f"{prefix}rdma/qp/{rank}/{peer}", json.dumps(
                {"host": host, "conns": [streams[peer, i].local_info() for i in range(nconns)]}))
        for peer in peers:
            raw = _store_get(store, f"{prefix}rdma/qp/{peer}/{rank}")
            try:
                info = json.loads(raw.decode())
                conns = info["conns"]
                their_host = str(info["host"])[:64]
                if not isinstance(conns, list):
                    raise TypeError
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                raise TransportError(f"rank {peer} published malformed RDMA queue pair information: "
                                     f"{raw[:200]!r}") from None
            if len(conns) != nconns:
                raise TransportError(f"rank {peer} has {len(conns)} RDMA connections per peer, this rank "
                                     f"{nconns}: set the same LINERATE_NSOCKS and LINERATE_RDMA_DEVICE "
                                     f"port count on every rank")
            for index in range(nconns):
                label = f"{conns[index].get('port', '?') if isinstance(conns[index], dict) else '?'}@{their_host}"
                streams[peer, index].connect(conns[index], label)
        # A QP must be in RTR before packets reach it: each stream's handshake waits for its
        # peer's word that all its QPs are (a stream's first write would otherwise be retried,
        # and fail where that takes longer than the retry time).
        store.set(f"{prefix}rdma/rts/{rank}", "1")
        errors: list = []

        def run(peer: int, index: int, s: RdmaStream) -> None:
            try:
                _store_get(store, f"{prefix}rdma/rts/{peer}")
                s.settimeout(max(1.0, deadline - time.monotonic()))
                if peer < rank:
                    handshake.connect_side(s, secret, rank, peer, index, nconns)
                else:
                    src, idx = handshake.accept_side(s, secret, rank, size, nconns)
                    if (src, idx) != (peer, index):
                        raise handshake.HandshakeError(f"the queue pair meant for rank {peer} "
                                                       f"connection {index} says rank {src} connection {idx}")
                s.settimeout(None)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(TransportError(f"rank {rank}: RDMA connection {index} to rank {peer} "
                                             f"({s.remote_label}): handshake failed: {exc}"))

        threads = [threading.Thread(target=run, args=(peer, index, s), daemon=True,
                                    name=f"linerate-rdma-hs-{peer}.{index}")
                   for (peer, index), s in streams.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads) and not errors:
            errors.append(TransportError(f"rank {rank}: RDMA handshakes did not finish within "
                                         f"LINERATE_CONNECT_TIMEOUT ({opts.connect_timeout:.0f}s)"))
        if errors:
            raise errors[0]
        rates = [p.info.rate_gbps for p in ports]
        speed = int(sum(rates) * 1e9) if all(rates) else None
        links = {peer: RdmaLink(peer, [streams[peer, i] for i in range(nconns)], rank=rank,
                                chunk_bytes=opts.chunk_bytes, checksum=opts.checksum,
                                credit_bytes=opts.credit_bytes, speed_bps=speed)
                 for peer in peers}
        done = True
    finally:
        if not done:
            for s in streams.values():
                s.shutdown(socket.SHUT_RDWR)
                s.close()
    metrics.set_info(transport="rdma")
    log.debug("rank %d: RDMA mesh of %d ranks x %d queue pairs ready on %s", rank, size, nconns,
              ", ".join(p.name for p in ports))
    return links


def environment_summary() -> dict:
    """For ``linerate probe``: where pyverbs comes from and whether it is the test fake."""
    try:
        pv = verbs.load()
    except RdmaUnavailable as e:
        return {"pyverbs": None, "reason": str(e)}
    return {"pyverbs": pv.path, "fake": pv.fake, "reason": ""}


__all__ = ["RdmaStream", "RdmaLink", "build_links", "open_ports", "local_status", "qp_timeout_exponent",
           "RING_SLOTS", "SLOT_BYTES", "environment_summary"]
