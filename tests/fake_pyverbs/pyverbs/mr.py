"""pyverbs.mr of rdma-core 44: MR (buf, lkey, rkey, length, read, write, close)."""
import ctypes

import numpy as np

from . import _fabric
from .pyverbs_error import PyverbsRDMAError


class MR:
    def __init__(self, creator, length=0, access=0, address=None, implicit=False, **kwargs):
        if getattr(creator, "_closed", True):
            raise PyverbsRDMAError('Failed to register a MR. length: {l}, access flags: {a}'.format(l=length, a=access))
        self._pd = creator
        self._mem = None
        if address:
            self._buf = int(address)
        else:   # pyverbs allocates page-aligned, zeroed memory
            self._mem = np.zeros(length + 4096, np.uint8)
            base = self._mem.ctypes.data
            self._buf = (base + 4095) & ~4095
        self._length = length
        self._access = access
        self._lkey, self._rkey = _fabric.new_keys()
        with _fabric.LOCK:
            _fabric.MRS_BY_LKEY[self._lkey] = self
            _fabric.MRS_BY_RKEY[self._rkey] = self
        self._closed = False

    buf = property(lambda self: self._buf)
    lkey = property(lambda self: self._lkey)
    rkey = property(lambda self: self._rkey)
    length = property(lambda self: self._length)

    def write(self, data, length, offset=0):
        data = data.encode() if isinstance(data, str) else bytes(data)
        ctypes.memmove(self._buf + offset, data, length)

    def read(self, length, offset):
        return ctypes.string_at(self._buf + offset, length)

    def close(self):
        if self._closed:
            return
        with _fabric.LOCK:   # no placement into this memory once close() returns
            _fabric.MRS_BY_LKEY.pop(self._lkey, None)
            _fabric.MRS_BY_RKEY.pop(self._rkey, None)
            self._closed = True
        self._mem = None
