"""pyverbs.pd of rdma-core 44: PD."""
from .pyverbs_error import PyverbsUserError


class PD:
    def __init__(self, creator, **kwargs):
        if getattr(creator, "closed", True):
            raise PyverbsUserError('Expected an open Context')
        self.ctx = creator
        self.closed = False

    def close(self):
        self.closed = True
