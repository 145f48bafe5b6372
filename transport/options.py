"""Every transport setting in one place: a dataclass filled from ``LINERATE_*`` env variables.

The README's settings table documents each field; keep the two in step.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

_SIZE_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
                  "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
                  "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """Parse ``"512K"``, ``"4MB"``, ``"1048576"`` into a byte count (binary multiples)."""
    s = text.strip().lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = s[len(digits):]
    if suffix not in _SIZE_SUFFIXES or not digits:
        raise ValueError(f"cannot parse size {text!r}: expected a number with an optional K/M/G suffix")
    return int(float(digits) * _SIZE_SUFFIXES[suffix])


_RATE_UNITS = {  # tc's units: bit-based and byte-based (bps = bytes per second)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 (bits per second), tc's units; a bare number is bit/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m:
        raise ValueError(f"bad rate {text!r} (e.g. 1gbit, 200mbit)")
    unit = m.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"bad rate unit {m.group(2)!r} in {text!r} (bit, kbit, mbit, gbit, ...)")
    bps = int(float(m.group(1)) * _RATE_UNITS[unit])
    if bps < 8000:
        raise ValueError(f"rate {text!r} too small")
    return bps


def _parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e9:  # NaN fails too
        raise ValueError("expected a number of seconds >= 0 (0: the kernel's defaults)")
    return value


def _parse_bool(text: str) -> bool:
    s = text.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"cannot parse boolean {text!r}: expected 1/0, true/false, yes/no, on/off")


def _parse_nsocks(text: str) -> int:
    s = text.strip().lower()
    return 0 if s == "auto" else int(s)


def sockets_per_rail(nsocks: int, nrails: int) -> int:
    """The connections per peer per rail that ``nsocks`` (0: auto) means with ``nrails``."""
    if nsocks:
        return nsocks
    return 2 if nrails <= 1 else 1


TRANSPORTS = ("tcp", "rdma", "auto")


def _parse_transport(text: str) -> str:
    s = text.strip().lower()
    if s not in TRANSPORTS:
        raise ValueError(f"expected one of {', '.join(TRANSPORTS)}")
    return s


def _parse_gid_index(text: str) -> int:
    s = text.strip()
    if not s:
        return -1
    try:
        value = int(s)
    except ValueError:
        value = -2
    if not -1 <= value < 1 << 16:
        raise ValueError("expected a GID table index (0, 1, ...; -1 or empty: chosen automatically)")
    return value


def parse_env(env: Mapping[str, str], var: str, parse):
    """Parse one variable; a bad value raises a ValueError that names the variable."""
    try:
        return parse(env[var])
    except ValueError as e:
        raise ValueError(f"{var}={env[var]!r}: {e}") from None


@dataclasses.dataclass
class TransportOptions:
    """Settings of one transport context (one per process group)."""

    #: TCP connections per peer on each interface (rail); 0: auto, 2 with one rail and 1 per
    #: rail with several. Measured on 2 cores: with one rail 2 beats 1 by ~35% (loopback) and 4
    #: adds nothing; with 4 rails x 250 Mbit/s (netlab, 4 hosts) 1 per rail reached 0.90 Gbit/s
    #: and 2 per rail 0.68 (README "Performance").
    nsocks: int = 0
    #: Local interfaces to use, comma separated (``eth0,eth1`` = two rails). Empty: the
    #: interface that routes to MASTER_ADDR (or the hostname's address).
    socket_ifname: str = ""
    #: Bytes per chunk: a message is cut into chunks that are striped over the connections.
    #: 1 MiB measured better than 512 KiB with 4 MiB pieces (README "Performance").
    chunk_bytes: int = 1 << 20
    #: Seconds allowed to build the full mesh of connections at group creation.
    connect_timeout: float = 300.0
    #: Largest message (bytes) a peer may announce before a matching receive is posted; larger
    #: unexpected messages are an error rather than an unbounded allocation.
    max_unexpected_bytes: int = 1 << 34
    #: Address family preference for the automatic interface choice.
    prefer_ipv6: bool = False
    #: A CRC-32 after every chunk, checked on receipt (every rank must agree).
    checksum: bool = False
    #: Seconds a peer may acknowledge nothing (an idle connection: answer no keepalive probe)
    #: before its connections fail, naming it (TCP_USER_TIMEOUT); 0: the kernel's defaults.
    link_timeout: float = 60.0
    #: Credit window for priority scheduling: bytes a connection may hand to the kernel that
    #: are not yet on the wire (TCP_NOTSENT_LOWAT), so that a more urgent message waits behind
    #: at most this much of less urgent data per connection; 0: the kernel's buffer size.
    credit_bytes: int = 0
    #: ``tcp``, ``rdma`` (RC queue pairs through pyverbs; an error where a rank has no active
    #: RDMA port) or ``auto`` (RDMA when every rank has an active port, else TCP, logging
    #: why). Every rank must use the same setting. See transport/rdma.py.
    transport: str = "tcp"
    #: RDMA ports to use, ``dev[:port]`` comma separated (several = rails, like
    #: socket_ifname). Empty: the first active port.
    rdma_device: str = ""
    #: GID table index for RoCE (-1: a RoCE v2 GID with an IPv4 address, else the first valid).
    rdma_gid_index: int = -1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "TransportOptions":
        env = os.environ if env is None else env
        o = cls()
        parsers = {"LINERATE_NSOCKS": ("nsocks", _parse_nsocks),
                   "LINERATE_SOCKET_IFNAME": ("socket_ifname", str.strip),
                   "LINERATE_CHUNK_BYTES": ("chunk_bytes", parse_size),
                   "LINERATE_CONNECT_TIMEOUT": ("connect_timeout", float),
                   "LINERATE_MAX_UNEXPECTED_BYTES": ("max_unexpected_bytes", parse_size),
                   "LINERATE_PREFER_IPV6": ("prefer_ipv6", _parse_bool),
                   "LINERATE_CHECKSUM": ("checksum", _parse_bool),
                   "LINERATE_LINK_TIMEOUT": ("link_timeout", _parse_seconds),
                   "LINERATE_CREDIT_BYTES": ("credit_bytes", parse_size),
                   "LINERATE_TRANSPORT": ("transport", _parse_transport),
                   "LINERATE_RDMA_DEVICE": ("rdma_device", str.strip),
                   "LINERATE_RDMA_GID_INDEX": ("rdma_gid_index", _parse_gid_index)}
        for var, (field, parse) in parsers.items():
            if var in env:
                setattr(o, field, parse_env(env, var, parse))
        for k, v in overrides.items():
            if not hasattr(o, k):
                raise TypeError(f"unknown transport option {k!r}")
            setattr(o, k, v)
        o.validate()
        return o

    def validate(self) -> None:
        if not 0 <= self.nsocks <= 64:
            raise ValueError(f"LINERATE_NSOCKS must be between 1 and 64 (or 0 / auto), got {self.nsocks}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"LINERATE_CHUNK_BYTES must be at least 4096, got {self.chunk_bytes}")
        if self.chunk_bytes >= 1 << 32:
            raise ValueError(f"LINERATE_CHUNK_BYTES must be below 4 GiB, got {self.chunk_bytes}")
        if self.connect_timeout <= 0:
            raise ValueError(f"LINERATE_CONNECT_TIMEOUT must be positive, got {self.connect_timeout}")
        if not 0 <= self.credit_bytes < 1 << 31:
            raise ValueError(f"LINERATE_CREDIT_BYTES must be between 0 and 2 GiB, got {self.credit_bytes}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"LINERATE_TRANSPORT must be one of {', '.join(TRANSPORTS)}, "
                             f"got {self.transport!r}")

    @property
    def ifnames(self) -> list[str]:
        return [n.strip() for n in self.socket_ifname.split(",") if n.strip()]

    @property
    def rdma_ports(self) -> list[str]:
        return [n.strip() for n in self.rdma_device.split(",") if n.strip()]
