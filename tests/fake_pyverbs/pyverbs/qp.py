"""pyverbs.qp of rdma-core 44: QPCap, QPInitAttr, QPAttr, QP (RC only)."""
import errno

from . import _fabric
from . import enums as e
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

_MTU_ORDER = [e.IBV_MTU_256, e.IBV_MTU_512, e.IBV_MTU_1024, e.IBV_MTU_2048, e.IBV_MTU_4096]


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0):
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge, self.max_inline_data = max_send_sge, max_recv_sge, max_inline_data


class QPInitAttr:
    def __init__(self, qp_type=e.IBV_QPT_UD, qp_context=None, scq=None, rcq=None, srq=None, cap=None,
                 sq_sig_all=1):
        self.qp_type, self.send_cq, self.recv_cq, self.srq = qp_type, scq, rcq, srq
        self.cap = cap or QPCap()
        self.sq_sig_all = sq_sig_all


class QPAttr:
    def __init__(self, qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=1,
                 path_mtu=e.IBV_MTU_1024):
        self.qp_state, self.cur_qp_state, self.port_num, self.path_mtu = qp_state, cur_qp_state, port_num, path_mtu
        self.qp_access_flags = self.pkey_index = self.dest_qp_num = self.rq_psn = self.sq_psn = 0
        self.max_dest_rd_atomic = self.min_rnr_timer = self.timeout = self.retry_cnt = 0
        self.rnr_retry = self.max_rd_atomic = self.qkey = 0
        self.ah_attr = None


class QP:
    def __init__(self, creator, init_attr, qp_attr=None):
        from .pd import PD
        if not isinstance(creator, PD) or creator._closed:
            raise PyverbsUserError('The fake creates QPs from an open PD only')
        if init_attr.qp_type != e.IBV_QPT_RC:
            raise PyverbsRDMAError('Failed to create QP', errno.EOPNOTSUPP)
        if init_attr.srq is not None:
            raise PyverbsRDMAError('Failed to create QP', errno.EOPNOTSUPP)
        attr = creator._ctx.query_device()
        cap = init_attr.cap
        if (cap.max_send_wr > attr.max_qp_wr or cap.max_recv_wr > attr.max_qp_wr
                or cap.max_send_sge > attr.max_sge or cap.max_recv_sge > attr.max_sge):
            raise PyverbsRDMAError('Failed to create QP', errno.EINVAL)
        self._pd, self._cap, self._sq_sig_all = creator, cap, bool(init_attr.sq_sig_all)
        self._scq, self._rcq = init_attr.send_cq, init_attr.recv_cq
        self.qp_type = e.IBV_QPT_RC
        self._state = e.IBV_QPS_RESET
        self._port_num = 0
        self._access_flags = 0
        self._dest_qp_num = self._rq_psn = self._sq_psn = 0
        self._attr_timeout = self._attr_retry_cnt = 0
        self._ah_attr = None
        self._engine = _fabric.Engine(self)
        if qp_attr is not None:
            self.to_init(qp_attr)

    @property
    def qp_num(self):
        return self._engine.qpn

    @property
    def qp_state(self):
        return self._state

    def _fail(self, what):
        raise PyverbsRDMAError('Failed to modify QP state to {w}'.format(w=what), errno.EINVAL)

    def to_init(self, qp_attr):
        if self._state not in (e.IBV_QPS_RESET, e.IBV_QPS_INIT):
            self._fail('init')
        if not 1 <= qp_attr.port_num <= self._pd._ctx.query_device().phys_port_cnt:
            self._fail('init')
        qp_attr.qp_state = e.IBV_QPS_INIT
        self._port_num, self._access_flags = qp_attr.port_num, qp_attr.qp_access_flags
        with self._engine.cond:
            self._state = e.IBV_QPS_INIT

    def to_rtr(self, qp_attr):
        if self._state != e.IBV_QPS_INIT:
            self.to_init(qp_attr)
        port = self._pd._ctx.query_port(self._port_num)
        ah = qp_attr.ah_attr
        if ah is None or qp_attr.path_mtu not in _MTU_ORDER or \
                _MTU_ORDER.index(qp_attr.path_mtu) > _MTU_ORDER.index(port.active_mtu):
            self._fail('RTR')
        if port.link_layer == e.IBV_LINK_LAYER_ETHERNET:
            if not ah.is_global or ah.dgid == "0000:0000:0000:0000:0000:0000:0000:0000":
                self._fail('RTR')   # RoCE needs a GRH
            try:
                sgid = self._pd._ctx.query_gid(self._port_num, ah.sgid_index).gid
            except PyverbsRDMAError:
                self._fail('RTR')
            if sgid == "0000:0000:0000:0000:0000:0000:0000:0000":
                self._fail('RTR')
        elif not ah.dlid and not ah.is_global:
            self._fail('RTR')
        qp_attr.qp_state = e.IBV_QPS_RTR
        self._dest_qp_num, self._rq_psn, self._ah_attr = qp_attr.dest_qp_num, qp_attr.rq_psn, ah
        with self._engine.cond:
            self._state = e.IBV_QPS_RTR
            self._engine.cond.notify_all()

    def to_rts(self, qp_attr):
        if self._state != e.IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        qp_attr.qp_state = e.IBV_QPS_RTS
        self._sq_psn, self._attr_timeout, self._attr_retry_cnt = qp_attr.sq_psn, qp_attr.timeout, qp_attr.retry_cnt
        with self._engine.cond:
            self._state = e.IBV_QPS_RTS
            self._engine.cond.notify_all()

    def _addressed_by(self, dgid, dlid) -> bool:
        port = self._pd._ctx.query_port(self._port_num)
        gids = [g[0] for g in self._pd._ctx._gids(self._port_num)]
        if port.link_layer == e.IBV_LINK_LAYER_ETHERNET:
            return dgid in gids
        return dlid == port.lid or (bool(dgid) and dgid in gids)

    def post_send(self, wr, bad_wr=None):
        self._engine.post_send(wr)

    def post_recv(self, wr, bad_wr=None):
        self._engine.post_recv(wr)

    def close(self):
        engine, self._engine_closed = self._engine, True
        if engine is not None and not getattr(engine, "destroyed", False):
            engine.destroy()
        self._state = e.IBV_QPS_RESET
