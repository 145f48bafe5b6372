"""pyverbs.pd of rdma-core 44: PD."""
from .pyverbs_error import PyverbsUserError


class PD:
    def __init__(self, creator, **kwargs):
        if getattr(creator, "_closed", True):
            raise PyverbsUserError('Expected an open Context')
        self._ctx = creator
        self._closed = False

    def close(self):
        self._closed = True
