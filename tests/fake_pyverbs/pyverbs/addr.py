"""pyverbs.addr of rdma-core 44: GID, GlobalRoute, AHAttr."""
from .pyverbs_error import PyverbsUserError


def _check(val):
    parts = val.split(':')
    if len(parts) != 8 or any(len(p) != 4 for p in parts):
        raise PyverbsUserError('Invalid GID value ({val})'.format(val=parts))
    int(''.join(parts), 16)
    return val.lower()


class GID:
    def __init__(self, val=None):
        self._gid = _check(val) if val is not None else "0000:0000:0000:0000:0000:0000:0000:0000"

    @property
    def gid(self):
        return self._gid

    @gid.setter
    def gid(self, val):
        self._gid = _check(val)

    def __str__(self):
        return self._gid


class GlobalRoute:
    """As pyverbs: ``dgid`` must be a GID; its property reads back the GID text."""

    def __init__(self, dgid=None, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0):
        if dgid is not None and not isinstance(dgid, GID):   # a typed Cython argument in pyverbs
            raise TypeError("Argument 'dgid' has incorrect type (expected pyverbs.addr.GID)")
        self._dgid = dgid.gid if dgid is not None else GID().gid
        self.flow_label, self.sgid_index = flow_label, sgid_index
        self.hop_limit, self.traffic_class = hop_limit, traffic_class

    @property
    def dgid(self):
        return self._dgid

    @dgid.setter
    def dgid(self, val):
        self._dgid = _check(val)


class AHAttr:
    """As pyverbs: the GlobalRoute's fields are copied in and read back as properties."""

    def __init__(self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr=None):
        if gr is not None and not isinstance(gr, GlobalRoute):
            raise TypeError("Argument 'gr' has incorrect type (expected pyverbs.addr.GlobalRoute)")
        self.dlid, self.sl, self.src_path_bits, self.static_rate = dlid, sl, src_path_bits, static_rate
        self.is_global, self.port_num = is_global, port_num
        gr = gr or GlobalRoute()
        self.dgid, self.sgid_index, self.hop_limit = gr.dgid, gr.sgid_index, gr.hop_limit
        self.flow_label, self.traffic_class = gr.flow_label, gr.traffic_class
