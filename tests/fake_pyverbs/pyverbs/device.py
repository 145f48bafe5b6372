"""pyverbs.device of rdma-core 44: get_device_list, Device, Context, DeviceAttr, PortAttr."""
from . import _fabric
from . import enums as e
from .addr import GID
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

_STATES = {"NOP": e.IBV_PORT_NOP, "DOWN": e.IBV_PORT_DOWN, "INIT": e.IBV_PORT_INIT,
           "ARMED": e.IBV_PORT_ARMED, "ACTIVE": e.IBV_PORT_ACTIVE}
_GID_TABLE = 16


class Device:
    def __init__(self, name, guid, node_type, transport_type, index):
        self._name, self._guid, self._node_type = name, guid, node_type
        self._transport_type, self._index = transport_type, index

    name = property(lambda self: self._name)
    guid = property(lambda self: self._guid)
    node_type = property(lambda self: self._node_type)
    transport_type = property(lambda self: self._transport_type)
    index = property(lambda self: self._index)


def get_device_list():
    devs = _fabric.devices()
    if devs == "enosys":   # what rdma-core 44 raises where the kernel has no RDMA (errno ENOSYS)
        raise PyverbsRDMAError('Failed to get devices list')
    return [Device(d["name"].encode(), 0x1000 + i, e.IBV_NODE_CA, e.IBV_TRANSPORT_IB, i)
            for i, d in enumerate(devs)]


class DeviceAttr:
    def __init__(self, nports):
        self.phys_port_cnt = nports
        self.max_qp_wr = 16384
        self.max_sge = 32
        self.max_cqe = 1 << 16
        self.max_mr_size = 1 << 40
        self.vendor_id = 0
        self.vendor_part_id = 0
        self.fw_version = "fake"


class PortAttr:
    def __init__(self, cfg, lid):
        self.state = _STATES[cfg.get("state", "ACTIVE").upper()]
        self.link_layer = (e.IBV_LINK_LAYER_ETHERNET if cfg.get("link_layer", "Ethernet") == "Ethernet"
                           else e.IBV_LINK_LAYER_INFINIBAND)
        self.active_mtu = cfg.get("active_mtu", e.IBV_MTU_1024)
        self.max_mtu = e.IBV_MTU_4096
        self.lid = 0 if self.link_layer == e.IBV_LINK_LAYER_ETHERNET else lid
        self.gid_tbl_len = _GID_TABLE
        self.active_width = 1                     # 1X
        self.active_speed = 32                    # 25 Gbit/s per lane
        self.phys_state = 5 if self.state == e.IBV_PORT_ACTIVE else 3


class Context:
    def __init__(self, **kwargs):
        self.name = kwargs.get('name')
        if self.name is None:
            raise PyverbsUserError('Device name must be provided')
        devs = _fabric.devices()
        if devs == "enosys":
            raise PyverbsRDMAError('Failed to get devices list')
        for i, d in enumerate(devs):
            if d["name"] == self.name:
                self._cfg = d
                self._index = i
                break
        else:
            raise PyverbsRDMAError('Failed to find device {dev}'.format(dev=self.name))
        self._closed = False

    def close(self):
        self._closed = True

    def query_device(self):
        return DeviceAttr(len(self._cfg["ports"]))

    def _port(self, port_num):
        ports = self._cfg["ports"]
        if not 1 <= port_num <= len(ports):
            raise PyverbsRDMAError('Failed to query port {p}'.format(p=port_num), 22)
        return ports[port_num - 1]

    def query_port(self, port_num):
        return PortAttr(self._port(port_num), 1 + 16 * self._index + port_num)

    def _gids(self, port_num):
        return self._port(port_num).get("gids", [])

    def query_gid(self, port_num, index):
        gids = self._gids(port_num)
        if not 0 <= index < _GID_TABLE:
            raise PyverbsRDMAError('Failed to query gid {idx} of port {port}'.format(idx=index, port=port_num))
        return GID(gids[index][0] if index < len(gids) else "0000:0000:0000:0000:0000:0000:0000:0000")

    def query_gid_type(self, port_num, index):
        gids = self._gids(port_num)
        if not 0 <= index < len(gids):
            raise PyverbsRDMAError('Failed to query gid type of port {p} and gid index {g}'.format(p=port_num, g=index), 22)
        return e.IBV_GID_TYPE_SYSFS_ROCE_V2 if gids[index][1] == "v2" else e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1
