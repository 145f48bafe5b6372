"""Every transport setting as a dataclass, filled from the ``LINERATE_*`` registry.

The variables, their parsers, defaults and what they accept are declared once, in
linerate/settings.py (docs/settings.md is generated from it); these dataclasses are
the typed result. ``MetricsOptions`` holds the Prometheus exporter's settings (transport/metrics.py).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from linerate import settings as _settings
from linerate.settings import TRANSPORTS, parse_rate, parse_size  # noqa: F401 - this module's API

__all__ = ["TransportOptions", "MetricsOptions", "parse_size", "parse_rate", "parse_env",
           "sockets_per_rail", "TRANSPORTS"]


def parse_env(env: Mapping[str, str], var: str, parse):
    """Parse one variable with ``parse``; a bad value raises a ValueError that names the
    variable. (Declared settings: use ``linerate.settings.read``.)"""
    try:
        return parse(env[var])
    except ValueError as e:
        raise ValueError(f"{var}={env[var]!r}: {e}") from None


def sockets_per_rail(nsocks: int, nrails: int) -> int:
    """The connections per peer per rail that ``nsocks`` (0: auto) means with ``nrails``."""
    if nsocks:
        return nsocks
    return 2 if nrails <= 1 else 1


def _apply_overrides(o, overrides: dict, what: str) -> None:
    for k, v in overrides.items():
        if not hasattr(o, k):
            raise TypeError(f"unknown {what} option {k!r}")
        setattr(o, k, v)


@dataclasses.dataclass
class TransportOptions:
    """Settings of one transport context (one per process group)."""

    #: TCP connections per peer on each interface (rail); 0: auto, 2 with one rail and 1 per
    #: rail with several, and 1 to a rank of another host where hosts hold several ranks of the
    #: group (transport/tcp.py ``plan_rails``). With one rail a second connection raises the
    #: throughput and more add nothing; with several rails one per rail does better than two.
    nsocks: int = 0
    #: Local interfaces to use, comma separated (``eth0,eth1`` = two rails). Empty: the
    #: interface that routes to MASTER_ADDR (or the hostname's address).
    socket_ifname: str = ""
    #: Bytes per chunk: a message is cut into chunks that are striped over the connections.
    #: 1 MiB does better than 512 KiB with the default 4 MiB pieces.
    chunk_bytes: int = 1 << 20
    #: Seconds allowed to build the full mesh of connections at group creation.
    connect_timeout: float = 300.0
    #: Largest message (bytes) a peer may announce before a matching receive is posted; larger
    #: unexpected messages are an error rather than an unbounded allocation.
    max_unexpected_bytes: int = 1 << 34
    #: Bytes of buffers a group keeps between operations for reuse (the transport's staging
    #: buffers, and the algorithms' scratch, each up to this much); what an operation needs
    #: beyond it is given back when the operation ends. Reuse spares fresh pages their fault
    #: and zeroing; the cap keeps one large operation from holding its memory for good.
    keep_bytes: int = 64 << 20
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
    #: ``lazy``: a peer's TCP link is made when this rank first talks to it (transport/tcp.py
    #: says who dials); ``eager``: every link at group creation. Every rank must agree.
    connect: str = "lazy"
    #: ``auto``: with several rails, a host's rails are spread over its local ranks (when
    #: co-located ranks share memory): each link to another host uses the rails of the lower
    #: rank's local index (transport/tcp.py ``spread_rails``); ``0``: every link stripes over
    #: every rail. Every rank must agree.
    rail_spread: str = "auto"
    #: The I/O model of the plain TCP connections, one for the whole process: ``threads``
    #: (default; ``auto`` is the same): a sender and a receiver thread per connection
    #: (link.ThreadedStreamLink); ``shared``: the process-wide pool of LINERATE_IO_THREADS epoll
    #: threads (ioloop.LoopStreamLink), so threads per rank do not grow with peers or groups.
    #: TLS and RDMA streams always use threads. Need not be agreed: both interoperate.
    io: str = "threads"
    #: Shared memory between the ranks of one host (transport/shm): ``auto`` (where every
    #: rank of the group proves it can map the group's segment), ``1`` (group creation fails
    #: naming the ranks that cannot) or ``0`` (off). Every rank must use the same setting.
    shm: str = "auto"
    #: Cross-memory attach for the large all_reduces of co-located ranks
    #: (collectives/shm_algos.py): ``auto`` (measured against the copies through the segment),
    #: ``1`` (where every rank of the host has 1) or ``0`` (one rank with 0 turns it off).
    cma: str = "auto"
    #: ``LOW-HIGH``: the ports this rank's TCP listeners bind to, the first free one of the
    #: range (transport/ports.py); empty: any free port. Ranks need not agree.
    port_range: str = ""
    #: TLS 1.3 on every TCP connection (transport/tls.py), mutual authentication against
    #: ``tls_ca``; every rank must agree. Not with the RDMA transport (group creation fails).
    tls: bool = False
    #: This rank's certificate (PEM file), signed by the CA in ``tls_ca``.
    tls_cert: str = ""
    #: The private key of ``tls_cert`` (PEM file, unencrypted).
    tls_key: str = ""
    #: The CA certificate(s) (PEM file) every peer's certificate must chain to.
    tls_ca: str = ""
    #: RDMA ports to use, ``dev[:port]`` comma separated (several = rails, like
    #: socket_ifname). Empty: the first active port.
    rdma_device: str = ""
    #: GID table index for RoCE (-1: a RoCE v2 GID with an IPv4 address, else the first valid).
    rdma_gid_index: int = -1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "TransportOptions":
        """The defaults, then the ``LINERATE_*`` variables set in ``env`` (default: this
        process's environment), then ``overrides``; checked (a ValueError names the variable)."""
        o = _settings.fill(cls(), "transport", env)
        _apply_overrides(o, overrides, "transport")
        o.validate()
        return o

    def validate(self) -> None:
        _settings.validate(self, "transport")

    @property
    def ifnames(self) -> list[str]:
        return [n.strip() for n in self.socket_ifname.split(",") if n.strip()]

    @property
    def ports(self) -> tuple[int, int] | None:
        """port_range as (low, high), or None: any free port."""
        return _settings.parse_port_range(self.port_range)

    @property
    def rdma_ports(self) -> list[str]:
        return [n.strip() for n in self.rdma_device.split(",") if n.strip()]


@dataclasses.dataclass
class MetricsOptions:
    """The Prometheus exporter's settings (transport/metrics.py; one exporter per process,
    started by the first group that asks for it)."""

    #: Serve ``/metrics`` on this port + LOCAL_RANK; 0: no exporter.
    port: int = 0
    #: The exporter's bind address.
    addr: str = "0.0.0.0"
    #: The ``host`` label of every series; empty: the hostname.
    host: str = ""
    #: Seconds over which the utilization and busbw gauges are computed.
    window: float = 1.0
    #: Link rate where the driver reports none: ``10gbit``, or ``eth0=10gbit,eth1=25gbit``.
    link_capacity: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "MetricsOptions":
        o = _settings.fill(cls(), "metrics", env)
        _apply_overrides(o, overrides, "metrics")
        o.validate()
        return o

    def validate(self) -> None:
        _settings.validate(self, "metrics")

    @property
    def capacities(self) -> dict[str, float]:
        """link_capacity as bytes per second by interface name (``*``: every interface)."""
        return _settings.parse_capacity(self.link_capacity)
