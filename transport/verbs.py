"""pyverbs for the RDMA transport: finding the module, the devices and ports, and the few verbs
transport/rdma.py uses (protection domain, memory regions and their cache, RC queue pairs).

pyverbs is rdma-core's Python binding. It is not on PyPI (``pyverbs`` there is an unofficial
repackaging); distributions ship it: Debian/Ubuntu ``apt-get install python3-pyverbs``, Fedora
``dnf install python3-pyverbs``. A virtual environment does not see the system's
dist-packages, so ``load()`` looks, in order:

1. ``LINERATE_PYVERBS_PATH``: a folder that holds a ``pyverbs`` package (or the package folder
   itself); only there when it is set (the tests point it at tests/fake_pyverbs);
2. a ``pyverbs`` that this interpreter can import anyway;
3. the distributions' system folders (``/usr/lib/python3/dist-packages`` ...): only the
   ``pyverbs`` package is loaded from there, the folder is not put on ``sys.path`` (that
   would bring the system's other, older packages along).

Whatever fails is an ``RdmaUnavailable`` with a one-line reason; nothing here is imported by
the TCP path, so a missing pyverbs can never break ``import transport`` or TCP use.
Names checked against rdma-core 44 (Debian bookworm); the enums module is ``pyverbs.enums``
up to rdma-core 58 and ``pyverbs.libibverbs_enums`` from 59.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import importlib
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
import types

import numpy as np

log = logging.getLogger("linerate.rdma")

#: Where distributions install python3-pyverbs (the package folder is <dir>/pyverbs).
SYSTEM_DIRS = ("/usr/lib/python3/dist-packages",
               f"/usr/lib/python3.{sys.version_info.minor}/site-packages",
               f"/usr/lib64/python3.{sys.version_info.minor}/site-packages",
               "/usr/lib/python3/site-packages")
#: GID table entries looked at when a port is listed (RoCE tables hold up to 256, mostly empty).
GID_SCAN = 32
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
#: ibv_port_attr.active_width -> lanes, active_speed -> Gbit/s per lane (verbs.h).
_WIDTH = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
_SPEED = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0, 256: 200.0}
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


class RdmaUnavailable(Exception):
    """No RDMA here: pyverbs missing, no device, no active port (the message says which)."""

    @property
    def reason(self) -> str:
        return str(self)


_lock = threading.RLock()
_pv: types.SimpleNamespace | None = None
_pv_error: str | None = None
_open: dict[str, "OpenPort"] = {}


# ----------------------------------------------------------------------------- loading
def load() -> types.SimpleNamespace:
    """The pyverbs modules (device, pd, mr, cq, qp, wr, addr, enums as ``e``, ``Error``);
    raises RdmaUnavailable. The outcome is cached for the process (``reset()`` forgets it)."""
    global _pv, _pv_error
    with _lock:
        if _pv is not None:
            return _pv
        if _pv_error is not None:
            raise RdmaUnavailable(_pv_error)
        try:
            _pv = _load()
        except RdmaUnavailable as e:
            _pv_error = str(e)
            raise
        return _pv


def reset() -> None:
    """Forget the loaded pyverbs and the opened ports (tests switch between fake and real)."""
    global _pv, _pv_error
    with _lock:
        _pv = None
        _pv_error = None
        _open.clear()
        for name in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
            del sys.modules[name]


def _package_dir(folder: str) -> str | None:
    if os.path.isfile(os.path.join(folder, "pyverbs", "__init__.py")):
        return os.path.join(folder, "pyverbs")
    if os.path.basename(os.path.normpath(folder)) == "pyverbs" and \
            os.path.isfile(os.path.join(folder, "__init__.py")):
        return folder
    return None


def _load() -> types.SimpleNamespace:
    from linerate import settings
    explicit = settings.read("LINERATE_PYVERBS_PATH")
    if explicit:
        for folder in explicit.split(os.pathsep):
            pkg = _package_dir(folder) if folder else None
            if pkg:
                return _import(pkg)
        raise RdmaUnavailable(f"LINERATE_PYVERBS_PATH={explicit!r} holds no pyverbs package")
    try:
        found = "pyverbs" in sys.modules or importlib.util.find_spec("pyverbs") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return _import(None)
    for folder in SYSTEM_DIRS:
        pkg = _package_dir(folder)
        if pkg:
            return _import(pkg)
    raise RdmaUnavailable("pyverbs is not installed (Debian/Ubuntu: apt-get install python3-pyverbs "
                          "rdma-core; or point LINERATE_PYVERBS_PATH at a folder that holds it)")


def _import(pkg_dir: str | None) -> types.SimpleNamespace:
    before = set(sys.modules)
    try:
        if pkg_dir is not None:
            have = sys.modules.get("pyverbs")
            if have is not None:
                where = os.path.dirname(getattr(have, "__file__", "") or "")
                if os.path.realpath(where) != os.path.realpath(pkg_dir):
                    raise RdmaUnavailable(f"another pyverbs ({where}) is already imported")
            else:
                spec = importlib.util.spec_from_file_location(
                    "pyverbs", os.path.join(pkg_dir, "__init__.py"), submodule_search_locations=[pkg_dir])
                module = importlib.util.module_from_spec(spec)
                sys.modules["pyverbs"] = module
                spec.loader.exec_module(module)
        ns = types.SimpleNamespace()
        for name in ("device", "pd", "mr", "cq", "qp", "wr", "addr", "pyverbs_error"):
            setattr(ns, name, importlib.import_module("pyverbs." + name))
        try:
            ns.e = importlib.import_module("pyverbs.libibverbs_enums")  # rdma-core >= 59
        except ImportError:
            ns.e = importlib.import_module("pyverbs.enums")            # rdma-core <= 58
    except RdmaUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to import means "no RDMA here"
        for name in set(sys.modules) - before:
            if name == "pyverbs" or name.startswith("pyverbs."):
                del sys.modules[name]
        raise RdmaUnavailable(_import_failure(pkg_dir, exc)) from None
    ns.Error = ns.pyverbs_error.PyverbsError
    ns.path = os.path.dirname(sys.modules["pyverbs"].__file__ or "")
    ns.fake = bool(getattr(sys.modules["pyverbs"], "FAKE", False))
    return ns


def _import_failure(pkg_dir: str | None, exc: BaseException) -> str:
    where = pkg_dir or "the interpreter's path"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if pkg_dir and os.path.isdir(pkg_dir):
        built = sorted({f.split(".", 1)[1] for f in os.listdir(pkg_dir) if f.endswith(".so") and "." in f})
        if built and not any(suffix.endswith(b) or ("." + b) == suffix for b in built):
            return (f"pyverbs in {pkg_dir} is built for {', '.join('.' + b for b in built)}, "
                    f"not for this Python ({suffix})")
    return f"cannot import pyverbs from {where}: {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- discovery
@dataclasses.dataclass
class GidInfo:
    index: int
    gid: str
    type: str            # "IB/RoCE v1" or "RoCE v2" (the sysfs names)
    netdev: str | None   # the network interface a RoCE GID belongs to

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped RoCE GID (::ffff:a.b.c.d)."""
        h = self.gid.replace(":", "")
        if len(h) == 32 and h[:20] == "0" * 20 and h[20:24] == "ffff":
            return ".".join(str(int(h[i:i + 2], 16)) for i in range(24, 32, 2))
        return None


@dataclasses.dataclass
class PortInfo:
    device: str
    port: int
    state: str
    link_layer: str      # "InfiniBand" or "Ethernet"
    lid: int
    active_mtu: int      # the ibv_mtu enum value
    rate_gbps: float | None
    gids: list[GidInfo]

    @property
    def name(self) -> str:
        return f"{self.device}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state in ("ACTIVE", "ACTIVE_DEFER")

    @property
    def mtu_bytes(self) -> int:
        return _MTU_BYTES.get(self.active_mtu, 0)

    @property
    def kind(self) -> str:
        if self.link_layer != "Ethernet":
            return "InfiniBand"
        return "RoCE v2" if any(g.type == "RoCE v2" for g in self.gids) else "RoCE"


def no_device_reason(exc: BaseException | None = None) -> str:
    """Why ibv_get_device_list finds nothing: pyverbs only says "Failed to get devices list",
    so ask libibverbs itself for the errno (ENOSYS: the kernel has no RDMA support)."""
    err = None
    try:
        lib = ctypes.CDLL("libibverbs.so.1", use_errno=True)
        lib.ibv_get_device_list.restype = ctypes.c_void_p
        lib.ibv_free_device_list.argtypes = [ctypes.c_void_p]
        n = ctypes.c_int(0)
        ctypes.set_errno(0)
        lst = lib.ibv_get_device_list(ctypes.byref(n))
        err = ctypes.get_errno()
        if lst:
            lib.ibv_free_device_list(lst)
            err = None
    except (OSError, AttributeError):
        pass
    sysfs = os.path.isdir("/sys/class/infiniband")
    what = f"ibv_get_device_list failed ({errno.errorcode.get(err, err)}: {os.strerror(err)})" \
        if err else f"ibv_get_device_list failed ({exc})" if exc else "no RDMA device"
    if not sysfs:
        return (f"{what}: this kernel has no RDMA device (/sys/class/infiniband does not exist; "
                f"no RDMA driver is loaded, not even soft-RoCE: modprobe rdma_rxe)")
    return what


def list_ports() -> list[PortInfo]:
    """Every port of every RDMA device; raises RdmaUnavailable when there is none."""
    pv = load()
    try:
        devices = pv.device.get_device_list()
    except pv.Error as e:
        raise RdmaUnavailable(no_device_reason(e)) from None
    if not devices:
        raise RdmaUnavailable(no_device_reason())
    e = pv.e
    out = []
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            ctx = pv.device.Context(name=name)
        except pv.Error as exc:
            log.warning("linerate: cannot open RDMA device %s: %s", name, exc)
            continue
        try:
            nports = ctx.query_device().phys_port_cnt
            for port in range(1, nports + 1):
                pa = ctx.query_port(port)
                eth = pa.link_layer == e.IBV_LINK_LAYER_ETHERNET
                gids = []
                for idx in range(min(pa.gid_tbl_len, GID_SCAN)):
                    try:
                        gid = str(ctx.query_gid(port, idx).gid)
                        gtype = ctx.query_gid_type(port, idx) if eth else None
                    except pv.Error:
                        continue
                    if gid == _ZERO_GID:
                        continue
                    kind = ("RoCE v2" if gtype == e.IBV_GID_TYPE_SYSFS_ROCE_V2 else "IB/RoCE v1") \
                        if eth else "IB"
                    gids.append(GidInfo(idx, gid, kind, _gid_netdev(name, port, idx)))
                lanes, speed = _WIDTH.get(pa.active_width), _SPEED.get(pa.active_speed)
                out.append(PortInfo(name, port, _PORT_STATES.get(pa.state, str(pa.state)),
                                    "Ethernet" if eth else "InfiniBand", pa.lid, pa.active_mtu,
                                    lanes * speed if lanes and speed else None, gids))
        finally:
            ctx.close()
    return out


def _gid_netdev(dev: str, port: int, index: int) -> str | None:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs/{index}") as f:
            return f.read().strip() or None
    except OSError:
        return None


def select_ports(spec: list[str], ports: list[PortInfo] | None = None) -> list[PortInfo]:
    """The ports LINERATE_RDMA_DEVICE names (``dev`` or ``dev:port``), each active; or the
    first active port. Raises RdmaUnavailable naming what is missing or down."""
    ports = list_ports() if ports is None else ports
    if not spec:
        for p in ports:
            if p.active:
                return [p]
        states = ", ".join(f"{p.name} {p.state}" for p in ports)
        raise RdmaUnavailable(f"no active RDMA port ({states})")
    chosen = []
    for item in spec:
        dev, _, num = item.partition(":")
        try:
            want = int(num) if num else None
        except ValueError:
            raise RdmaUnavailable(f"LINERATE_RDMA_DEVICE: bad port in {item!r} (dev or dev:port)") from None
        match = [p for p in ports if p.device == dev and (want is None or p.port == want)]
        if not match:
            have = ", ".join(p.name for p in ports)
            raise RdmaUnavailable(f"LINERATE_RDMA_DEVICE names {item!r}, which does not exist (ports here: {have})")
        act = [p for p in match if p.active]
        if not act:
            raise RdmaUnavailable(f"RDMA port {match[0].name} is {match[0].state}, not ACTIVE")
        chosen.append(act[0])
    return chosen


def choose_gid(port: PortInfo, index: int = -1) -> GidInfo | None:
    """The GID to address ``port`` by: ``index`` if given; on RoCE a RoCE v2 GID with an
    IPv4 address (routable, what rdma_cm picks), else v2 IPv6 (not link-local), else any."""
    if index >= 0:
        for g in port.gids:
            if g.index == index:
                return g
        raise RdmaUnavailable(f"LINERATE_RDMA_GID_INDEX={index}: {port.name} has no such GID "
                              f"(valid: {[g.index for g in port.gids]})")
    if not port.gids:
        return None

    def rank(g: GidInfo):
        v2 = g.type == "RoCE v2"
        return (not v2, g.ipv4 is None, g.gid.startswith("fe80"), g.index)
    return min(port.gids, key=rank)


# ----------------------------------------------------------------------------- opened ports
class OpenPort:
    """A device context, protection domain and MR cache for one port, shared by every stream
    of the process (opened once, kept for the process's life, like NCCL's)."""

    def __init__(self, info: PortInfo, gid_index: int):
        pv = self.pv = load()
        self.info = info
        self.gid = choose_gid(info, gid_index)
        if info.link_layer == "Ethernet" and self.gid is None:
            raise RdmaUnavailable(f"RoCE port {info.name} has no GID (no IP address on its interface?)")
        self.ctx = pv.device.Context(name=info.device)
        attr = self.ctx.query_device()
        self.max_sge = max(1, min(4, attr.max_sge))
        self.max_qp_wr = attr.max_qp_wr
        self.pd = pv.pd.PD(self.ctx)
        self.mr_cache = MRCache(self)
        self.lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.info.name

    def register(self, length: int, access: int, address: int | None = None):
        """An MR: pyverbs allocates page-aligned memory when ``address`` is None. A failure
        says what usually causes it (RLIMIT_MEMLOCK)."""
        pv = self.pv
        try:
            if address is None:
                return pv.mr.MR(self.pd, length, access)
            return pv.mr.MR(self.pd, length, access, address=address)
        except pv.Error as exc:
            raise OSError(errno.ENOMEM, f"cannot register {length} bytes with {self.name}: {exc} "
                                        f"({memlock_hint()})") from None


def memlock_hint() -> str:
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return "check the locked-memory limit"
    if soft == resource.RLIM_INFINITY:
        return "RLIMIT_MEMLOCK is unlimited"
    return (f"RLIMIT_MEMLOCK is {soft} bytes: raise it (ulimit -l unlimited; docker run --ulimit "
            f"memlock=-1)")


def open_port(info: PortInfo, gid_index: int = -1) -> OpenPort:
    with _lock:
        op = _open.get(info.name)
        if op is None:
            op = _open[info.name] = OpenPort(info, gid_index)
        return op


def buffer_address(view) -> int:
    """The address of a contiguous buffer (read-only ones too)."""
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


class MRCache:
    """Memory regions on the caller's buffers, keyed by address range, least recently used
    first out. An entry holds a reference to the buffer's exporter (the numpy array of a
    tensor), so that memory cannot be freed and reused at the same address while registered
    (a registration cache's classic stale-page bug); hence the bound on what it keeps."""

    MAX_BYTES = 256 << 20
    MAX_ENTRIES = 64

    def __init__(self, port: OpenPort):
        self.port = port
        self.lock = threading.Lock()
        self.entries: collections.OrderedDict = collections.OrderedDict()  # (start, end) -> _Entry
        self.bytes = 0
        self.hits = self.misses = self.failures = 0
        self._warned = False

    def acquire(self, view: memoryview):
        """(entry, lkey) covering ``view`` (registered now if need be), or None where it cannot
        be registered (the caller copies). ``release(entry)`` when the transfer completed."""
        addr = buffer_address(view)
        end = addr + view.nbytes
        with self.lock:
            for key, ent in self.entries.items():
                if ent.start <= addr and end <= ent.end:
                    ent.refs += 1
                    self.entries.move_to_end(key)
                    self.hits += 1
                    return ent, ent.mr.lkey
            self.misses += 1
            owner, base, size = _exporter_range(view, addr)
            if size > self.MAX_BYTES:
                owner, base, size = view, addr, view.nbytes
            self._evict(size)
            try:
                mr = self.port.register(size, 0, address=base)  # local read: a send source
            except OSError as exc:
                self.failures += 1
                if not self._warned:
                    self._warned = True
                    log.warning("linerate: RDMA memory registration failed, copying instead: %s", exc)
                return None
            ent = _Entry(mr, base, base + size, owner)
            self.entries[(base, base + size)] = ent
            self.bytes += size
            ent.refs = 1
            return ent, mr.lkey

    def release(self, ent: "_Entry") -> None:
        with self.lock:
            ent.refs -= 1

    def _evict(self, incoming: int) -> None:
        for key in list(self.entries):
            if self.bytes + incoming <= self.MAX_BYTES and len(self.entries) < self.MAX_ENTRIES:
                return
            ent = self.entries[key]
            if ent.refs == 0:
                del self.entries[key]
                self.bytes -= ent.end - ent.start
                try:
                    ent.mr.close()
                except Exception:  # noqa: BLE001 - a dying device: nothing to save
                    pass


class _Entry:
    __slots__ = ("mr", "start", "end", "owner", "refs")

    def __init__(self, mr, start: int, end: int, owner):
        self.mr, self.start, self.end, self.owner, self.refs = mr, start, end, owner, 0


def _exporter_range(view: memoryview, addr: int):
    """The whole buffer ``view`` is a slice of (register it once for every later slice)."""
    owner = view.obj
    try:
        base = np.frombuffer(owner, np.uint8)
        start = base.ctypes.data
        if start <= addr and addr + view.nbytes <= start + base.nbytes:
            return owner, start, base.nbytes
    except (TypeError, ValueError, BufferError):
        pass
    return view, addr, view.nbytes
