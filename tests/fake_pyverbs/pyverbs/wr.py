"""pyverbs.wr of rdma-core 44: SGE, RecvWR, SendWR."""
from . import enums as e
from .pyverbs_error import PyverbsUserError


class SGE:
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class RecvWR:
    def __init__(self, wr_id=0, num_sge=0, sg=None, next_wr=None):
        if num_sge < 1 or sg is None:
            raise PyverbsUserError('A WR needs at least one SGE')
        self.wr_id, self.num_sge = wr_id, num_sge
        self._sg = [SGE(s.addr, s.length, s.lkey) for s in sg[:num_sge]]   # copied, as pyverbs does


class SendWR:
    def __init__(self, wr_id=0, opcode=e.IBV_WR_SEND, num_sge=0, imm_data=0, sg=None,
                 send_flags=e.IBV_SEND_SIGNALED, next_wr=None):
        if num_sge < 1 or sg is None:
            raise PyverbsUserError('A WR needs at least one SGE')
        if not 0 <= imm_data < 1 << 32:
            raise OverflowError("value too large to convert to uint32_t")
        self.wr_id, self.opcode, self.num_sge, self.imm_data = wr_id, opcode, num_sge, imm_data
        self.send_flags = send_flags
        self._sg = [SGE(s.addr, s.length, s.lkey) for s in sg[:num_sge]]
        self._remote_addr = 0
        self._rkey = 0

    def set_wr_rdma(self, rkey, addr):
        self._rkey, self._remote_addr = rkey, addr
