"""pyverbs.cq of rdma-core 44: CQ (poll, close) and WC."""
import collections
import threading

from ._fabric import WC
from .pyverbs_error import PyverbsRDMAError

__all__ = ["CQ", "WC"]


class CQ:
    def __init__(self, context, cqe, cq_context=None, channel=None, comp_vector=0):
        if getattr(context, "_closed", True):
            raise PyverbsRDMAError('Failed to create CQ')
        self.cqe = cqe
        self._q = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def _push(self, wc) -> bool:
        with self._lock:
            if len(self._q) >= self.cqe:
                return False   # overrun: the caller moves the QP to ERR
            self._q.append(wc)
            return True

    def poll(self, num_entries=1):
        """(npolled, wcs): like ibv_poll_cq, never blocks."""
        wcs = []
        with self._lock:
            while self._q and len(wcs) < num_entries:
                wcs.append(self._q.popleft())
        return len(wcs), wcs

    def close(self):
        self._closed = True
