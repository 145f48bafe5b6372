"""Link kinds: which kind of link joins this rank to each peer, and how it is made.

The Context asks the kinds of ``KINDS`` in order, shared memory, RDMA, TCP, as NCCL asks the
transports of its table whether they can connect two ranks:

- ``prepare(setup)`` runs once the network kind is agreed, before the ranks of each host prove
  their shared segment (TCP listens there, so that its address is published while the others
  still wait for host records);
- ``claim(setup, left)`` takes the peers, among those no earlier kind took, that this kind
  links: the same answer on both ends of every pair, decided from what every rank learnt at
  rendezvous (the host's proved segment, the network kind agreed on);
- ``build(setup, peers)`` makes their links (not started), called with no peers too, so that a
  kind that prepared something it does not need lets it go;
- ``start(links, sink)`` starts them, once the Context holds them.

A kind that makes links on first use (TCP with LINERATE_CONNECT=lazy) builds none and leaves
its ``Maker`` in ``setup.maker``: the Context calls ``want(peer)`` when it first needs that
peer's link, which arrives through ``Setup.on_link``/``on_fail``. The Context never branches
on a kind: it attaches what the kinds give it.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol

from . import rdma, rendezvous, shm, tcp
from .shm import ring as shm_ring

if TYPE_CHECKING:
    from .tls import TlsConfig
from .link import Link, LinkSink
from .options import TransportOptions


class Maker(Protocol):
    """Makes links on first use (transport/tcp.py ``TcpMesh``)."""

    def want(self, peer: int) -> None: ...          # make ``peer``'s link now
    def stop(self) -> None: ...                     # the Context closes: no more links
    def release(self) -> None: ...                  # closed: drop the Context's callbacks
    def abort(self) -> None: ...                    # set-up failed: close what was made


@dataclasses.dataclass
class Setup:
    """What rendezvous settled, for the kinds to decide and build from; the kinds fill in
    ``nrails``, ``maker`` and ``lazy``."""
    rv: rendezvous.Rendezvous
    rank: int
    size: int
    secret: bytes
    options: TransportOptions         # as they apply (LINERATE_TLS makes auto mean TCP)
    network: str                      # "tcp" or "rdma": the kind agreed on for other hosts
    deadline: float                   # of set-up (LINERATE_CONNECT_TIMEOUT)
    link_timeout: float
    addresses: Callable[[], list]     # this rank's listen address per rail (looked up late)
    tls: TlsConfig | None
    nsocks_auto: bool                 # LINERATE_NSOCKS auto: TCP may narrow other hosts' links
    on_link: Callable                 # lazy links: on_link(peer, link) once made
    on_fail: Callable                 # lazy links: on_fail(peer, error) if it cannot be
    listen_later: bool = False        # the group is probably on one host: listen only if not
    seg: object | None = None         # this host's proved shared segment (transport/shm)
    layout: shm.Layout | None = None  # the group's hosts, the same on every rank
    nrails: int = 1                   # rails of the network links (RDMA: its ports)
    maker: Maker | None = None        # what makes links later, or must be aborted on failure
    lazy: bool = False                # links to other hosts are made on first use


class LinkKind(abc.ABC):
    """One kind of link: ``claim`` and ``build`` are each kind's own; by default a kind
    prepares nothing and starts each link by itself."""
    name = ""

    def prepare(self, setup: Setup) -> None:
        pass

    @abc.abstractmethod
    def claim(self, setup: Setup, left: set) -> set:
        """The peers of ``left`` this kind links (both ends of a pair must agree)."""

    @abc.abstractmethod
    def build(self, setup: Setup, peers: list) -> dict[int, Link]:
        """``peers``' links, not started (called with none too)."""

    def start(self, links: dict, sink: LinkSink) -> None:
        for link in links.values():
            link.start(sink)


class ShmKind(LinkKind):
    """Co-located peers that proved their host's shared segment (transport/shm/ring.py)."""
    name = "shm"

    def claim(self, setup: Setup, left: set) -> set:
        seg = setup.seg
        return set() if seg is None else {p for p in left if p in seg.ranks}

    def build(self, setup: Setup, peers: list) -> dict[int, Link]:
        return shm_ring.build_links(setup.seg, setup.rank, peers) if peers else {}

    def start(self, links: dict, sink: LinkSink) -> None:
        shm_ring.start_links(links, sink)  # one wake of the progress thread for them all


class RdmaKind(LinkKind):
    """RC queue pairs to every other peer, where the group agreed on RDMA (transport/rdma.py)."""
    name = "rdma"

    def claim(self, setup: Setup, left: set) -> set:
        return set(left) if setup.network == "rdma" else set()

    def build(self, setup: Setup, peers: list) -> dict[int, Link]:
        if not peers:
            return {}
        ports = rdma.open_ports(setup.rank, setup.options)
        setup.nrails = len(ports)
        return rdma.build_links(setup.rv, setup.rank, setup.size, setup.secret, setup.options,
                                ports, setup.link_timeout, setup.deadline, setup.rv.prefix,
                                peers=peers)


class TcpKind(LinkKind):
    """Connections to every other peer, where the group agreed on TCP (transport/tcp.py):
    made at set-up, or (LINERATE_CONNECT=lazy) on first use."""
    name = "tcp"

    def prepare(self, setup: Setup) -> None:
        if setup.network == "tcp" and not setup.listen_later:
            self._listen(setup)

    def claim(self, setup: Setup, left: set) -> set:
        return set(left) if setup.network == "tcp" else set()

    def build(self, setup: Setup, peers: list) -> dict[int, Link]:
        mesh = setup.maker
        if not peers:  # every peer is linked another way: no TCP at all
            if mesh is not None:
                setup.maker, setup.lazy = None, False
                mesh.stop()
            return {}
        if mesh is None:  # it waited for the host records: they show other hosts
            mesh = self._listen(setup)
        layout = setup.layout
        mesh.plan_rails(layout.hosts if layout is not None and layout.shared else None)
        mesh.skip(set(range(setup.size)) - set(peers) - {setup.rank})
        if setup.lazy:
            mesh.set_addresses(setup.rv.gather_addresses(setup.size, setup.nrails))
            return {}
        return mesh.links(mesh.connect(setup.rv, setup.deadline))

    @staticmethod
    def _listen(setup: Setup) -> tcp.TcpMesh:
        """Open this rank's listeners and publish their addresses (lazy links: accept from
        that moment on, connect to nobody yet)."""
        opts = setup.options
        mesh = setup.maker = tcp.TcpMesh(setup.rank, setup.size, setup.secret, opts,
                                         setup.addresses(), setup.tls, setup.link_timeout,
                                         nsocks_auto=setup.nsocks_auto)
        listening = mesh.listen()
        if opts.connect == "lazy":
            setup.lazy = True
            mesh.serve(setup.rv, setup.on_link, setup.on_fail)
        setup.rv.publish_addresses(listening)
        return mesh


#: The kinds, in the order they are asked.
KINDS: tuple[LinkKind, ...] = (ShmKind(), RdmaKind(), TcpKind())


__all__ = ["KINDS", "LinkKind", "Maker", "Setup", "ShmKind", "RdmaKind", "TcpKind"]
