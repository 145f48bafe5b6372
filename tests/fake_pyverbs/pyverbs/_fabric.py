"""The fake's fabric: devices, the memory-region table, and the engine that carries work
requests between queue pairs (possibly in different processes) over abstract UNIX sockets.

One RC QP pair uses two stream connections, one per direction: the requester side of QP A
connects to QP B's listener (``\\0linerate-fake-verbs/<qpn>``) on its first work request and
sends a hello (its QPN, the destination GID or LID it addresses, its send PSN) that B checks
against its own RTR attributes, as hardware would drop packets that do not match. Each work
request then travels as a header and its gathered payload; B's responder thread places it
and answers with a status byte, after which A's requester writes the send completion.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import json
import os
import socket
import struct
import threading
import time

from . import enums as e
from .pyverbs_error import PyverbsRDMAError

_NS = "\0linerate-fake-verbs/"
_HELLO = struct.Struct("<I40sHI")          # src qpn, dgid (text), dlid, psn
_REQ = struct.Struct("<BIQII")             # opcode, length, remote addr, rkey, imm
_ST_OK, _ST_ACCESS, _ST_INVALID, _ST_NAK = 0, 1, 2, 3

LOCK = threading.RLock()                   # MR table and every memory access
MRS_BY_LKEY: dict[int, object] = {}
MRS_BY_RKEY: dict[int, object] = {}
_next_key = [0x1000]
STATS = collections.Counter()

DEFAULT_DEVICES = [{
    "name": "fakerxe0",
    "ports": [{"state": "ACTIVE", "link_layer": "Ethernet", "active_mtu": e.IBV_MTU_1024,
               "gids": [["fe80:0000:0000:0000:0000:00ff:fe00:0001", "v1"],
                        ["fe80:0000:0000:0000:0000:00ff:fe00:0001", "v2"],
                        ["0000:0000:0000:0000:0000:ffff:7f00:0001", "v1"],
                        ["0000:0000:0000:0000:0000:ffff:7f00:0001", "v2"]]}],
}]


def devices():
    """The configured devices: a list, or the string "enosys"."""
    raw = os.environ.get(f"FAKE_PYVERBS_DEVICES_RANK{os.environ.get('RANK', '')}")
    if raw is None:
        raw = os.environ.get("FAKE_PYVERBS_DEVICES")
    if raw is None:
        return DEFAULT_DEVICES
    if raw.strip().lower() == "enosys":
        return "enosys"
    return json.loads(raw)


def new_keys() -> tuple[int, int]:
    """(lkey, rkey): different numbers, so that one passed for the other fails."""
    with LOCK:
        _next_key[0] += 1
        k = _next_key[0]
    return k, (k * 2654435761) & 0xFFFFFFFF | 0x80000000


def find_mr(key: int, addr: int, length: int, pd, access: int, remote: bool):
    """The MR that covers [addr, addr+length) for this key in this PD with this access, or None."""
    mr = (MRS_BY_RKEY if remote else MRS_BY_LKEY).get(key)
    if mr is None or mr._pd is not pd:
        return None
    if access and not mr._access & access:
        return None
    if addr < mr.buf or addr + length > mr.buf + mr.length:
        return None
    return mr


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError(errno.ECONNRESET, "peer QP gone")
        got += k
    return bytes(buf)


class WC:
    def __init__(self, wr_id=0, status=0, opcode=0, vendor_err=0, byte_len=0, qp_num=0, src_qp=0,
                 imm_data=0, wc_flags=0, pkey_index=0, slid=0, sl=0, dlid_path_bits=0):
        self.wr_id, self.status, self.opcode, self.vendor_err = wr_id, status, opcode, vendor_err
        self.byte_len, self.qp_num, self.src_qp, self.imm_data = byte_len, qp_num, src_qp, imm_data
        self.wc_flags, self.pkey_index, self.slid, self.sl = wc_flags, pkey_index, slid, sl
        self.dlid_path_bits = dlid_path_bits


class Engine:
    """The moving parts of one fake QP."""

    def __init__(self, qp):
        self.qp = qp
        self.cond = threading.Condition(threading.Lock())
        self.sq: collections.deque = collections.deque()   # posted, not yet carried
        self.sq_outstanding = 0                            # posted, completion not yet written
        self.rq: collections.deque = collections.deque()   # posted receive WQEs
        self.destroyed = False
        self.out_sock = None
        self.in_sock = None
        self.remote_qpn = None
        for _ in range(100):
            qpn = int.from_bytes(os.urandom(3), "little") | 2
            ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                ls.bind(f"{_NS}{qpn}")
            except OSError:
                ls.close()
                continue
            break
        else:
            raise PyverbsRDMAError("Failed to create QP", errno.ENOMEM)
        ls.listen(4)
        self.qpn = qpn
        self.listener = ls
        self.threads = [threading.Thread(target=self._responder, name=f"fakeverbs-resp-{qpn}", daemon=True),
                        threading.Thread(target=self._requester, name=f"fakeverbs-req-{qpn}", daemon=True)]
        for t in self.threads:
            t.start()

    # ------------------------------------------------------------------ verbs side
    def post_send(self, wr) -> None:
        qp = self.qp
        with self.cond:
            if self.destroyed:
                raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
            if qp._state not in (e.IBV_QPS_RTS, e.IBV_QPS_ERR):
                raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
            if wr.num_sge > qp._cap.max_send_sge:
                raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
            if self.sq_outstanding >= qp._cap.max_send_wr:
                STATS["sq_full"] += 1
                raise PyverbsRDMAError("Failed to post send", errno.ENOMEM)
            self.sq_outstanding += 1
            self.sq.append((wr.wr_id, wr.opcode, [(s.addr, s.length, s.lkey) for s in wr._sg[:wr.num_sge]],
                            wr._remote_addr, wr._rkey, wr.imm_data,
                            bool(wr.send_flags & e.IBV_SEND_SIGNALED) or qp._sq_sig_all))
            self.cond.notify_all()

    def post_recv(self, wr) -> None:
        qp = self.qp
        with self.cond:
            if self.destroyed or qp._state == e.IBV_QPS_RESET:
                raise PyverbsRDMAError("Failed to post recv", errno.EINVAL)
            if len(self.rq) >= qp._cap.max_recv_wr:
                raise PyverbsRDMAError("Failed to post recv", errno.ENOMEM)
            wqe = (wr.wr_id, [(s.addr, s.length, s.lkey) for s in wr._sg[:wr.num_sge]])
            if qp._state == e.IBV_QPS_ERR:
                self._complete(qp._rcq, WC(wr_id=wqe[0], status=e.IBV_WC_WR_FLUSH_ERR, qp_num=self.qpn))
                return
            self.rq.append(wqe)
            self.cond.notify_all()

    def destroy(self) -> None:
        with self.cond:
            self.destroyed = True
            self.cond.notify_all()
        for s in (self.listener, self.out_sock, self.in_sock):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join(5)
        for s in (self.listener, self.out_sock, self.in_sock):
            if s is not None:
                s.close()

    # ------------------------------------------------------------------ helpers
    def _complete(self, cq, wc) -> None:
        if cq is None:
            return
        if not cq._push(wc):
            STATS["cq_overrun"] += 1
            self.to_error()

    def to_error(self) -> None:
        """QP to ERR: what is posted completes with WR_FLUSH_ERR (cond held or not)."""
        qp = self.qp
        qp._state = e.IBV_QPS_ERR
        rq, self.rq = list(self.rq), collections.deque()
        for wr_id, _ in rq:
            self._complete(qp._rcq, WC(wr_id=wr_id, status=e.IBV_WC_WR_FLUSH_ERR, qp_num=self.qpn))

    def _retry_window(self) -> float:
        qp = self.qp
        t = qp._attr_timeout or 14
        return 4.096e-6 * (1 << t) * (qp._attr_retry_cnt + 1)

    # ------------------------------------------------------------------ requester
    def _requester(self) -> None:
        qp = self.qp
        while True:
            with self.cond:
                while not self.sq and not self.destroyed:
                    self.cond.wait()
                if self.destroyed:
                    return
                wr_id, opcode, sges, raddr, rkey, imm, signaled = self.sq.popleft()
                failed = qp._state == e.IBV_QPS_ERR
            if failed:
                status = e.IBV_WC_WR_FLUSH_ERR
            else:
                status = self._carry(opcode, sges, raddr, rkey, imm)
            wc_op = {e.IBV_WR_RDMA_WRITE: e.IBV_WC_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM: e.IBV_WC_RDMA_WRITE,
                     e.IBV_WR_SEND: e.IBV_WC_SEND, e.IBV_WR_SEND_WITH_IMM: e.IBV_WC_SEND}.get(opcode, 0)
            nbytes = sum(s[1] for s in sges)
            with self.cond:
                if self.destroyed:
                    return
                self.sq_outstanding -= 1
                if signaled or status != e.IBV_WC_SUCCESS:
                    self._complete(qp._scq, WC(wr_id=wr_id, status=status, opcode=wc_op, byte_len=nbytes,
                                              qp_num=self.qpn))
                if status != e.IBV_WC_SUCCESS and qp._state != e.IBV_QPS_ERR:
                    STATS["wc_error"] += 1   # the error's completion first, then the flushes
                    self.to_error()

    def _carry(self, opcode, sges, raddr, rkey, imm) -> int:
        qp = self.qp
        if opcode not in (e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM, e.IBV_WR_SEND,
                          e.IBV_WR_SEND_WITH_IMM):
            return e.IBV_WC_LOC_QP_OP_ERR
        with LOCK:   # gather now, as the HCA reads the memory when it executes the WR
            parts = []
            for addr, length, lkey in sges:
                if length and find_mr(lkey, addr, length, qp._pd, 0, remote=False) is None:
                    STATS["loc_prot_err"] += 1
                    return e.IBV_WC_LOC_PROT_ERR
                parts.append(ctypes.string_at(addr, length) if length else b"")
        payload = b"".join(parts)
        deadline = time.monotonic() + self._retry_window()
        try:
            if self.out_sock is None:
                self._connect(deadline)
            self.out_sock.sendall(_REQ.pack(opcode, len(payload), raddr, rkey, imm) + payload)
            status = _recv_exact(self.out_sock, 1)[0]
        except (OSError, _Nak):
            # The responder is gone (process died, QP destroyed) or drops our packets: the
            # HCA retransmits until retry_cnt is exhausted.
            left = deadline - time.monotonic()
            if left > 0:
                with self.cond:
                    self.cond.wait_for(lambda: self.destroyed, left)
            STATS["retry_exceeded"] += 1
            return e.IBV_WC_RETRY_EXC_ERR
        STATS["wr_carried"] += 1
        return {_ST_OK: e.IBV_WC_SUCCESS, _ST_ACCESS: e.IBV_WC_REM_ACCESS_ERR,
                _ST_INVALID: e.IBV_WC_REM_INV_REQ_ERR}.get(status, e.IBV_WC_REM_OP_ERR)

    def _connect(self, deadline: float) -> None:
        qp = self.qp
        ah = qp._ah_attr
        dgid = ah.dgid if ah.is_global else ""
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(f"{_NS}{qp._dest_qp_num}")
                s.sendall(_HELLO.pack(self.qpn, dgid.encode(), ah.dlid, qp._sq_psn))
                if _recv_exact(s, 1)[0] != _ST_OK:
                    raise _Nak()
                self.out_sock = s
                return
            except (OSError, _Nak):
                s.close()
                if time.monotonic() > deadline or self.destroyed:
                    raise
                time.sleep(0.02)

    # ------------------------------------------------------------------ responder
    def _responder(self) -> None:
        qp = self.qp
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            try:
                src, dgid, dlid, psn = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
                dgid = dgid.rstrip(b"\0").decode()
                with self.cond:  # packets reaching a QP before RTR are dropped: the sender retries
                    self.cond.wait_for(lambda: self.destroyed or qp._state in (e.IBV_QPS_RTR, e.IBV_QPS_RTS), 0.5)
                    ok = (not self.destroyed and qp._state in (e.IBV_QPS_RTR, e.IBV_QPS_RTS)
                          and src == qp._dest_qp_num and psn == qp._rq_psn and qp._addressed_by(dgid, dlid))
                if not ok:
                    STATS["hello_rejected"] += 1
                    sock.sendall(bytes([_ST_NAK]))
                    sock.close()
                    continue
                sock.sendall(bytes([_ST_OK]))
            except OSError:
                sock.close()
                continue
            self.in_sock = sock
            self.remote_qpn = src
            try:
                self._serve(sock)
            except OSError:
                pass
            finally:
                sock.close()
            return

    def _serve(self, sock) -> None:
        while True:
            opcode, length, raddr, rkey, imm = _REQ.unpack(_recv_exact(sock, _REQ.size))
            payload = _recv_exact(sock, length) if length else b""
            status = self._place(opcode, payload, raddr, rkey, imm)
            sock.sendall(bytes([status]))
            if status != _ST_OK:
                return

    def _place(self, opcode, payload, raddr, rkey, imm) -> int:
        qp = self.qp
        n = len(payload)
        wqe = None
        if opcode in (e.IBV_WR_RDMA_WRITE_WITH_IMM, e.IBV_WR_SEND, e.IBV_WR_SEND_WITH_IMM):
            with self.cond:  # RNR: wait for a receive WQE (rnr_retry 7 retries for ever)
                if not self.rq:
                    STATS["rnr_wait"] += 1
                self.cond.wait_for(lambda: self.destroyed or self.rq or qp._state == e.IBV_QPS_ERR)
                if self.destroyed or qp._state == e.IBV_QPS_ERR:
                    return _ST_NAK
                wqe = self.rq.popleft()
        with LOCK:
            if self.destroyed:
                return _ST_NAK
            if opcode in (e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM):
                if n and find_mr(rkey, raddr, n, qp._pd, e.IBV_ACCESS_REMOTE_WRITE, remote=True) is None:
                    STATS["rem_access_err"] += 1
                    with self.cond:
                        self.to_error()
                    return _ST_ACCESS
                if n:
                    ctypes.memmove(raddr, payload, n)
            else:  # SEND: scatter into the WQE's SGEs
                room = sum(length for _, length, _ in wqe[1])
                if n > room:
                    with self.cond:
                        self._complete(qp._rcq, WC(wr_id=wqe[0], status=e.IBV_WC_LOC_LEN_ERR, qp_num=self.qpn))
                        self.to_error()
                    return _ST_INVALID
                off = 0
                for addr, length, lkey in wqe[1]:
                    k = min(length, n - off)
                    if k <= 0:
                        break
                    if find_mr(lkey, addr, k, qp._pd, e.IBV_ACCESS_LOCAL_WRITE, remote=False) is None:
                        with self.cond:
                            self._complete(qp._rcq, WC(wr_id=wqe[0], status=e.IBV_WC_LOC_PROT_ERR, qp_num=self.qpn))
                            self.to_error()
                        return _ST_INVALID
                    ctypes.memmove(addr, payload[off:off + k], k)
                    off += k
        if wqe is not None:
            with_imm = opcode in (e.IBV_WR_RDMA_WRITE_WITH_IMM, e.IBV_WR_SEND_WITH_IMM)
            op = e.IBV_WC_RECV_RDMA_WITH_IMM if opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM else e.IBV_WC_RECV
            with self.cond:
                self._complete(qp._rcq, WC(wr_id=wqe[0], status=e.IBV_WC_SUCCESS, opcode=op, byte_len=n,
                                          qp_num=self.qpn, src_qp=self.remote_qpn or 0,
                                          imm_data=imm if with_imm else 0,
                                          wc_flags=e.IBV_WC_WITH_IMM if with_imm else 0))
        return _ST_OK


class _Nak(Exception):
    pass
