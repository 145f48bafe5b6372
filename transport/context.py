"""A transport Context: the links of one rank to every other rank of a group, and matching.

Algorithms talk to it in two verbs (as Gloo's pairs and ncclNet do)::

    req = ctx.isend(peer, memoryview, channel, tag, opcode)   # bytes of this buffer to peer
    req = ctx.irecv(peer, memoryview, channel, tag, opcode)   # bytes from peer into this buffer
    req.wait(timeout)

Messages between two ranks on one (channel, tag) match in the order they were posted on each
side (a per-key message number travels with every message), whatever stream carried them
(transport/matching.py). The Context is built in three parts:

- rendezvous (transport/rendezvous.py): the Store, the agreement record, the group's secret,
  the network kind (TCP or RDMA);
- links (transport/link.py, the interface), one per peer, of the kind that claims the peer
  (transport/kinds.py: shared memory for co-located peers that share a segment, else RDMA or
  TCP as the group agreed), driven only through that interface; the Context is every link's
  sink: a link asks it where an arriving chunk goes (the matcher answers) and tells it of
  control frames, failures and closes. With LINERATE_CONNECT=lazy (the default; TCP only, RDMA links are
  made at creation) a peer's link is made when this rank first sends to it, receives from
  it or sends it a control frame (ERROR, QUERY); until the link is up, sends and control
  frames for that peer wait in order in ``_Peer.pending`` and go first once it is (who dials:
  transport/tcp.py). A link that cannot be made fails the peer like a crash would;
- failure propagation (transport/failure.py): a peer that dies fails every transfer with it
  and (fail fast) every pending collective of the group, and the others learn why (ERROR
  frames).

The Context speaks no collective vocabulary of its own: a mismatch is a set of facts
(matching.Mismatch) that ``describe``, given by the user of the Context, words (the
collectives' is collectives/mismatch.py).
``stats()`` is a plain snapshot of every link (the metrics exporter reads only that).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from . import kinds, metrics, rendezvous, shm, tls
from .framing import CHANNEL_COLLECTIVE, CHANNEL_P2P, KIND_ERROR, KIND_PROGRESS, KIND_QUERY
from .interfaces import listen_addresses
from .link import LinkSink
from .matching import Matcher, Mismatch, Staged as _Staged
from .options import TransportOptions, sockets_per_rail
from .failure import Failures, error_payload, wrap
from .request import MismatchError, PeerFailure, Request, TransportError
from .shm.sync import spin_for
from .tcp import LINK_TIMEOUT_DEFAULT, tune as _tune  # noqa: F401 - re-exported

log = logging.getLogger("linerate.transport")

_STORE_PREFIX = rendezvous.STORE_PREFIX
#: close(): seconds without a byte leaving after which a peer's queued sends are given up.
_STALL_S = 2.0


class _Peer:
    """A peer as the Context sees it: its link, and why it can no longer be reached."""

    __slots__ = ("rank", "link", "failure", "pending", "told", "root")

    def __init__(self, rank: int):
        self.rank = rank
        self.link = None
        self.failure: BaseException | None = None
        #: An ERROR frame went (or is queued) to this peer: it knows why our collectives broke.
        self.told = False
        #: This peer's ERROR frame: (the rank it names as the group's root cause, its text).
        self.root: tuple[int, str] | None = None
        #: Lazy links: sends (Requests) and control frames ((kind, payload, value)) posted
        #: before the link was up, in order (guarded by the Context's lock).
        self.pending: list = []


class Context(LinkSink):
    """The links of ``rank`` to every other rank of a group of ``size`` ranks."""

    def __init__(self, store, rank: int, size: int, options: TransportOptions | None = None,
                 describe=None, label: str = "", scope: str = "", agreed: dict | None = None):
        self.rank = rank
        #: Settings of the layers above that every rank must share (name -> JSON value),
        #: compared at rendezvous with rank 0's beside the transport's own.
        self._agreed_extra = dict(agreed or {})
        #: Every rendezvous key of this group lies under this prefix. ``scope`` names one
        #: incarnation of the job (e.g. torchrun's restart count): a store that outlives a
        #: failed attempt (torchrun keeps its TCPStore across restarts) still holds that
        #: attempt's secret and listen addresses, which must never be taken for this one's.
        self._prefix = f"{_STORE_PREFIX}{scope}/" if scope else _STORE_PREFIX
        self.size = size
        self.options = options or TransportOptions.from_env()
        #: Seconds of silence after which a peer's connections fail (LINERATE_LINK_TIMEOUT).
        self.link_timeout = self.options.link_timeout
        #: Words a mismatch: ``describe(mismatch, rank) -> str`` (matching.Mismatch: the
        #: facts); the user of the Context knows what its opcodes and digests mean.
        self.describe = describe
        self.label = label
        self._closing = False
        #: What transfers fail with once the group is closed (close()): "the process group was
        #: shut down", "... aborted".
        self._close_error: TransportError | None = None
        #: An opaque number the user of this Context keeps (the collectives: the sequence
        #: number of the last operation entered); peers can ask for it (peer_progress).
        self.progress = 0
        self._answers: dict[int, int] = {}   # peer -> progress it answered (peer_progress)
        #: Why transfers can no longer start, the group's root cause, the failure callbacks
        #: (transport/failure.py).
        self.failures = Failures(self)
        #: Called with each failure the group learns of (a dead peer, a peer's error report,
        #: this rank's own report), from the thread that learnt it; must not block or raise.
        self.on_failure: list = self.failures.on_failure
        rails = self.options.ifnames
        self._addresses: list[str] | None = None  # found when first needed (a TCP listener)
        self.nrails = len(rails) or 1  # listen_addresses: one per named interface, else one
        #: LINERATE_NSOCKS auto: the TCP mesh may narrow it once the layout is known
        #: (TcpMesh.plan_rails).
        self._nsocks_auto = not self.options.nsocks
        if not self.options.nsocks:  # auto: resolved once the rails are known
            self.options = dataclasses.replace(
                self.options, nsocks=sockets_per_rail(0, self.nrails))
        self.nconns = self.options.nsocks * self.nrails
        self.peers: dict[int, _Peer] = {p: _Peer(p) for p in range(size) if p != rank}
        #: Posted and staged messages of every peer (transport/matching.py); its lock guards
        #: the matching state and the mesh's progress (_mesh_cond).
        self.matcher = Matcher(self.peers, self.options.max_unexpected_bytes, self.options.keep_bytes)
        self.lock = self.matcher.lock
        #: Notified when a peer's link is made or it fails, and when a peer answers a query.
        self.mesh_cond = threading.Condition(self.lock)
        #: Global rank of each group rank (for metrics labels); None: the same numbers.
        self.global_ranks: list[int] | None = None
        #: "tcp" or "rdma": what the links to other hosts are (LINERATE_TRANSPORT, agreed at
        #: rendezvous); co-located peers may have "shm" links (each link's stats say its kind).
        self.transport = "tcp"
        #: The group's shared-memory segment (transport/shm), or None.
        self.shm = None
        #: Where the group's ranks are (transport/shm ``Layout``: the group ranks of each
        #: host, whether each host's co-located ranks share a segment), the same on every
        #: rank: learnt at rendezvous; until then (and in a group of one) one host, unshared.
        self.layout = shm.Layout((tuple(range(size)),), False)
        #: LINERATE_TLS: the group's TLS contexts (transport/tls.py), or None (plain TCP).
        self._tls: tls.TlsConfig | None = None
        #: Seconds a caller's ``drive`` polls before it sleeps (shm.sync.spin_for of the
        #: ranks on this machine; 0 for ranks that are threads of one process, as in the test
        #: suite: a polling thread holds the interpreter lock the thread it waits for needs).
        self._spin = 0.0
        #: What the link kinds built from (transport/kinds.py), once set-up reached them; its
        #: ``maker`` makes links on first use (LINERATE_CONNECT=lazy: the TCP mesh; eager:
        #: the mesh that made them, whose callbacks are dropped at close).
        self._setup: kinds.Setup | None = None
        if size > 1:
            self._build_mesh(store)
        metrics.track(self)

    # ------------------------------------------------------------------ set-up
    def _build_mesh(self, store) -> None:
        """Rendezvous and connect. A rank that fails here tells the others through the store,
        so that they fail at once with its message instead of waiting for it until
        LINERATE_CONNECT_TIMEOUT (or the store's own timeout)."""
        deadline = time.monotonic() + self.options.connect_timeout
        rv = self._rv = rendezvous.Rendezvous(store, self.rank, deadline,
                                              self.options.connect_timeout, self._prefix)
        try:
            self._build_mesh_on(rv, deadline)
        except BaseException as e:
            if rendezvous.store_lost(e):  # torch's words name no rank nor cause
                self._discard_links()
                raise rv.lost(e) from None
            if not isinstance(e, rendezvous.PeerSetupFailed):
                text = str(e)  # most set-up errors name this rank already
                rv.report(text if text.startswith(f"rank {self.rank}: ") else
                          f"rank {self.rank}: {text}")
            self._discard_links()
            # This rank has the group's failure: it says so, and where its process hosts the
            # Store it keeps it answering until every rank has read it (a few seconds at most).
            rv.failure_read(self.size)
            raise

    def _build_mesh_on(self, rv: rendezvous.Rendezvous, deadline: float) -> None:
        opts = self.options
        # Rank 0 offers a segment for the whole group with its settings (transport/shm):
        # a group on one host then proves its shared memory in the one round of host records.
        offer = None

        def make_offer(secret: bytes) -> bytes | None:
            nonlocal offer
            offer = shm.offer(opts.shm, self.size, secret)
            return offer.record if offer is not None else None

        try:
            shared = rendezvous.agreed_settings(self.options, self.nrails)
            if self._nsocks_auto:  # auto may narrow links to other hosts: not a set 2
                shared["LINERATE_NSOCKS"] = f"auto ({self.options.nsocks})"
            self._secret = rv.agree({**shared, **self._agreed_extra},
                                    make_offer if self.rank == 0 else None)
            setup = self._meet(rv, opts, deadline, offer)
        finally:  # the offered segment's name goes once every rank has read the records
            if offer is not None:
                offer.close()
        # Each kind takes the peers it links, in order (transport/kinds.py).
        left = set(self.peers)
        try:
            for kind in kinds.KINDS:
                mine = kind.claim(setup, left)
                left -= mine
                links = kind.build(setup, sorted(mine))
                for p, link in links.items():
                    self.peers[p].link = link
                kind.start(links, self)
        finally:  # set-up is over: the set-up keeps no reference back to this Context (a
            # maker that makes links later holds its own callbacks, dropped at close)
            setup.on_link = setup.on_fail = setup.addresses = None
        self.transport = setup.network
        if setup.nrails != self.nrails:
            self.nrails = setup.nrails
            self.nconns = self.options.nsocks * setup.nrails

    def _meet(self, rv: rendezvous.Rendezvous, opts, deadline: float, offer) -> kinds.Setup:
        """After the settings: the network kind, what the kinds prepare (TCP's listeners,
        unless they wait for the host records), shared memory. Returns the set-up the kinds
        build from, with the options as they apply (TLS makes ``auto`` mean TCP)."""
        if opts.tls:  # agreed above: every rank has it on
            if opts.transport == "rdma":
                raise ValueError(f"rank {self.rank}: LINERATE_TLS=1 with LINERATE_TRANSPORT=rdma: "
                                 f"the RDMA transport cannot encrypt (TLS runs over TCP only); "
                                 f"use LINERATE_TRANSPORT=tcp or turn LINERATE_TLS off")
            if opts.transport == "auto":  # TLS needs TCP: auto means TCP here, on every rank
                opts = dataclasses.replace(opts, transport="tcp")
            self._tls = tls.load(True, opts.tls_cert, opts.tls_key, opts.tls_ca)
        # The network kind first. A TCP rank listens and publishes its address before it waits
        # for the others' host records, unless rank 0 offered a segment for the whole group:
        # then the group is probably on one host, needs no TCP, and listens only if it spans hosts.
        network = rendezvous.agree_transport(rv, self.rank, self.size, opts, rv.prefix,
                                             same=True)  # LINERATE_TRANSPORT: in rv.agree
        setup = kinds.Setup(rv, self.rank, self.size, self._secret, opts, network, deadline,
                            self.link_timeout, lambda: self.addresses, self._tls,
                            self._nsocks_auto, self._link_made, self._link_failed_to_connect,
                            listen_later=shm.was_offered(rv.offered), nrails=self.nrails)
        self._setup = setup  # a failure from here on closes what the kinds made
        for kind in kinds.KINDS:
            kind.prepare(setup)
        # Ranks of one host that can map one segment share memory (transport/shm): the
        # collectives use it directly, and (LINERATE_SHM=auto|1) it is the link to each
        # co-located peer (transport/shm/ring.py), so it is proved before links are chosen.
        self.shm, self.layout = shm.establish(rv, self.rank, self.size, self._secret, opts.shm,
                                              self._prefix, rv.generation, rv.offered, offer)
        setup.seg, setup.layout = self.shm, self.layout
        self._spin = spin_for(self.layout, self.rank) or 0.0
        return setup

    @property
    def _maker(self) -> kinds.Maker | None:
        setup = self._setup
        return None if setup is None else setup.maker

    @property
    def _lazy(self) -> bool:
        """Links to other hosts are made on first use (``_maker.want``)."""
        setup = self._setup
        return setup is not None and setup.lazy

    @property
    def addresses(self) -> list[str]:
        """This rank's listen address per rail: the named interfaces (LINERATE_SOCKET_IFNAME),
        else the one that routes to MASTER_ADDR. Looked up when first needed: a group on one
        host never listens."""
        if self._addresses is None:
            self._addresses = listen_addresses(self.options.ifnames, self.options.prefer_ipv6)
        return self._addresses

    def _link_made(self, peer: int, link) -> None:
        """Lazy links: ``peer``'s link is up (from the mesh's thread): start it, hand it what
        waited, in order, then let posts use it directly."""
        p = self.peers[peer]
        link.start(self)
        down = []
        with self.lock:
            ok = p.failure is None and not self._closing
            if ok:
                for item in p.pending:
                    if isinstance(item, Request):
                        if not link.isend(item):
                            down.append(item)
                    else:
                        link.send_control(*item)
                p.pending = []
                p.link = link
            self.mesh_cond.notify_all()  # report_error may wait for this link
        if not ok:
            link.begin_close()
            link.close(time.monotonic() + 1.0)
            return
        for r in down:
            r.finish(wrap(p.failure or TransportError(
                f"rank {self.rank}: the link to rank {peer} went down as it was made")))

    def _link_failed_to_connect(self, peer: int, err: BaseException) -> None:
        """Lazy links: ``peer``'s link cannot be made (``err`` names it): fail it as if it
        had crashed."""
        self.failures.fail_peer(self.peers[peer], err)

    def control_to(self, p: _Peer, kind: int, payload: bytes = b"", value: int = 0) -> bool:
        """A control frame to ``p``: on its link, or (lazy) queued while the link is made."""
        with self.lock:
            if p.failure is not None:
                return False
            link = p.link
            if link is None:
                if not self._lazy or self._closing:
                    return False
                p.pending.append((kind, payload, value))
        if link is None:
            self._maker.want(p.rank)
            p.told = p.told or kind == KIND_ERROR
            return True
        sent = link.send_control(kind, payload, value)
        p.told = p.told or (sent and kind == KIND_ERROR)
        return sent

    def _discard_links(self) -> None:
        """Set-up failed: close what was built (peers learn the cause from the report)."""
        if self._maker is not None:
            self._maker.abort()
        for p in self.peers.values():
            if p.link is not None:
                p.link.begin_close()
                p.link.close(time.monotonic())

    # ------------------------------------------------------------------ posting
    def isend(self, peer: int, buf: memoryview, channel: int, tag: int, opcode: int = 0,
              desc: str = "", slot: int | None = None, call: int = 0,
              priority: int = 0) -> Request:
        """Send the bytes of ``buf`` to ``peer``; the buffer must stay untouched until done.

        ``slot`` names the message within its (channel, tag): the receive with the same slot
        gets it, whatever order either side posts in. Without a slot, messages on one
        (peer, channel, tag) match in posting order. ``call``: an opaque 64-bit digest (the
        collectives': of the call's arguments); on CHANNEL_COLLECTIVE a receive whose digest
        differs fails with a MismatchError.
        ``priority``: lower goes first. The connections to a peer take their next chunk from
        the most urgent queued message, so a message overtakes less urgent ones already
        queued, chunk by chunk (equal priorities: posting order)."""
        req = Request(True, peer, buf, channel, tag, opcode, desc)
        req.call = call
        req.priority = priority
        p = self._peer(peer)
        link = None
        with self.lock:
            err = self._refusal(channel) or p.failure
            if err is None:
                req.msgno = slot if slot is not None else self.matcher.next_send(peer, channel, tag)
                link = p.link
                if link is None:
                    if self._lazy and not self._closing:
                        p.pending.append(req)  # goes first once the link is up
                    else:
                        err = self._close_error if self._closing else TransportError(
                            f"rank {self.rank}: no link to rank {peer}")
        if link is None:
            if err is None:
                self._maker.want(peer)
            else:
                req.finish(wrap(err))
            return req
        if err is None and not link.isend_now(req):  # the link went down or closes
            err = p.failure or (self._close_error if self._closing else TransportError(
                f"rank {self.rank}: the link to rank {peer} is down"))
        if err is not None:
            req.finish(wrap(err))
        return req

    def irecv(self, peer: int | None, buf: memoryview, channel: int, tag: int, opcode: int = 0,
              desc: str = "", slot: int | None = None, call: int = 0,
              driven: bool = False) -> Request:
        """Receive a message of exactly ``buf.nbytes`` bytes from ``peer`` (None: any rank,
        point-to-point only) into ``buf``. ``driven``: the caller completes it with ``drive``
        (else a link that a caller drove reads with its own threads again: ``reclaim``)."""
        if peer is None and (channel != CHANNEL_P2P or slot is not None):
            raise ValueError("receive from any source is point-to-point only, without a slot")
        req = Request(False, peer, buf, channel, tag, opcode, desc)
        req.call = call
        if peer is not None:
            self._peer(peer)
        staged = None
        m = self.matcher
        with self.lock:
            err = self._refusal(channel)
            if err is None:
                try:
                    if peer is None:
                        failed = {r for r, q in self.peers.items() if q.failure is not None}
                        staged = m.post_anysource(req, failed)
                        if staged is False:
                            staged = None
                            err = TransportError("receive from any source: every peer has failed "
                                                 "or closed")
                    else:
                        staged = m.post(req, slot, self.peers[peer].failure is not None)
                except ValueError as e:
                    raise ValueError(f"rank {self.rank}: {e}") from None
                if req.error is True:  # the peer failed: nothing more will come from it
                    req.error = None
                    err = self.peers[req.peer].failure
        if err is not None:
            if staged is not None:
                with self.lock:
                    m.forget(staged)
            req.finish(wrap(err))
        elif staged is not None:
            self._deliver_staged(staged, req)
        elif self._lazy and peer is not None and self.peers[peer].link is None:
            self._maker.want(peer)  # a peer that is gone fails this receive at once
        if not driven:
            self.reclaim_links(peer)
        return req

    def drive(self, req: Request, until: float) -> None:
        """Wait for the receive ``req`` (posted ``driven``) by reading its peer's link in this
        thread where the link allows it (Link.drive), until the monotonic time ``until``; the
        caller then waits on ``req`` as for any (it may be finished already). It looks
        without sleeping first where the group's ranks on this machine (every host of its
        kernel) have a core each and are processes of their own (``_spin``)."""
        if req.peer is None:
            return
        link = self.peers[req.peer].link
        if link is None:
            return
        with self.lock:
            small, others = self._awaited_too(req)
        for other in others:  # awaited peers it will not read (a large message, another op's):
            other.reclaim()   # their links' threads read now, not once the lend runs out
        also = ()  # (else each awaited link is read in its turn)
        if self.matcher.arrivals is not None:
            # A group that times each peer's arrival: the op's receives from other peers that
            # nothing has arrived for yet are read in the same loop, each message as it comes
            # (a caller reading one link at a time would time a message that waited for its
            # turn late). Where more peers than DRIVE_PEERS are awaited, the links' threads read
            # them all (and the links a caller read before).
            if len(small) > self.DRIVE_PEERS:
                self.reclaim_links()
                return
            also = small
        link.drive(req, until, self._spin, also)
        # Receives still posted for the peer (point-to-point, an async op's, or this
        # one, timed out): the link's threads read for them.
        if link.lent:
            with self.lock:
                waiting = self.matcher.waiting(req.peer)
            if waiting:
                link.reclaim()

    #: At most this many other peers' receives are read in one caller's loop (``drive``).
    DRIVE_PEERS = 8

    def _awaited_too(self, req: Request) -> tuple:
        """(lock held) The links of the peers, other than ``req``'s, whose posted receives
        (nothing of them arrived yet) are all of ``req``'s op and small (a caller may read
        them: Link.drive's ``also``), and the links that a caller lent before to the other
        peers awaited (their threads read them)."""
        links: list = []
        others: list = []
        limit = getattr(self.peers[req.peer].link, "DIRECT_BYTES", 0)  # (0: not lendable)
        for r, pm in self.matcher.peers.items():
            if r == req.peer or not pm.posted:
                continue
            link = self.peers[r].link
            if link is None:
                continue
            if limit and all(q.channel == req.channel and q.tag == req.tag
                             and q.total <= limit for q in pm.posted.values()):
                links.append(link)
            elif link.lent:
                others.append(link)
        return links, others

    def reclaim_links(self, peer: int | None = None) -> None:
        """The link to ``peer`` (None: every link) reads with its own threads again, where a
        caller drove it (Link.reclaim)."""
        for p in (self.peers.values() if peer is None else (self.peers[peer],)):
            link = p.link
            if link is not None and link.lent:
                link.reclaim()

    def begin_call(self, tag: int, call: int, desc: str) -> None:
        """A call on CHANNEL_COLLECTIVE starts: messages of ``tag`` whose digest differs from
        ``call`` (already here, or arriving while it runs, whoever they are for) are a
        mismatch, reported to every rank (``desc`` is handed to ``describe``). It catches
        ranks that receive nothing the others send (e.g. a different root)."""
        with self.lock:
            bad = self.matcher.begin_call(tag, call, desc)
        if bad is not None:
            self.report_error(str(self._mismatch(bad)))

    def end_call(self, tag: int) -> dict | None:
        """The call ``tag`` ended: when each peer's first message of it began to arrive
        (peer -> ``time.perf_counter()``) while arrivals are recorded, else None."""
        with self.lock:
            return self.matcher.end_call(tag)

    def record_arrivals(self, on: bool = True) -> None:
        """Note when each peer's first message of a call (CHANNEL_COLLECTIVE) begins to arrive,
        for ``end_call`` to return (collectives/straggler.py: who makes the others wait)."""
        with self.lock:
            self.matcher.arrivals = {} if on else None

    def _mismatch(self, m: Mismatch) -> MismatchError:
        """The error for a mismatch's facts, in the words of ``describe`` (else neutral ones)."""
        if self.describe is not None:
            text = self.describe(m, self.rank)
        else:
            text = (f"rank {self.rank}: a message from rank {m.peer} (channel {m.channel}, tag "
                    f"{m.their_tag}, opcode {m.their_opcode}, digest {m.their_digest:#x}, "
                    f"{m.their_total} bytes) does not match what rank {self.rank} expects (tag "
                    f"{m.my_tag}, opcode {m.my_opcode}, digest {m.my_digest:#x}, {m.my_total} "
                    f"bytes): {m.reason} differs")
        return MismatchError(text + self.where(), facts=m)

    def _refusal(self, channel: int):
        """Why a new transfer on ``channel`` cannot start (None if it can)."""
        f = self.failures
        if f.broken is not None:
            return f.broken
        if channel == CHANNEL_COLLECTIVE:
            return f.coll_broken
        return None

    def _deliver_staged(self, staged: _Staged, req: Request) -> None:
        if req.error is not None:
            err, req.error = req.error, None
            with self.lock:
                self.matcher.forget(staged)
            if isinstance(err, Mismatch):
                self._on_mismatch(req, self._mismatch(err))
            else:
                req.finish(wrap(self.peers[req.peer].failure or err))
            return
        self.matcher.deliver(staged, req)  # numpy copies without holding the GIL
        req.finish()

    def staged(self, peer: int) -> list[tuple[int, int, int]]:
        """(channel, tag, opcode) of each message from ``peer`` that arrived (or is arriving)
        and waits for its receive: after a timeout they show where the peer is."""
        self._peer(peer)
        with self.lock:
            return sorted(self.matcher.staged_for(peer))

    def where(self) -> str:
        """The group's name as an error message ends with it: `` (group <label>)``, or ""
        for a group without a label."""
        return f" (group {self.label})" if self.label else ""

    def peer_failure(self, peer: int) -> BaseException | None:
        """Why group rank ``peer``'s links failed (it crashed, closed, reported an error),
        None while they work (and for this rank or a rank outside the group)."""
        p = self.peers.get(peer)
        return None if p is None else p.failure

    def _peer(self, peer: int) -> _Peer:
        try:
            return self.peers[peer]
        except KeyError:
            raise ValueError(f"invalid peer rank {peer} for rank {self.rank} in a group of "
                             f"{self.size}") from None

    @property
    def staged_messages(self) -> int:
        """Messages that arrived before their receive (each copied once)."""
        return self.matcher.staged_messages

    # ------------------------------------------------------------------ the links' sink
    def claim(self, link, opcode, channel, tag, msgno, total, digest, off, length):
        with self.lock:
            m = self.matcher
            target, bad = m.incoming(link.peer, opcode, channel, tag, msgno, total, digest)
            buf = None if target is None else target.buf
            dest = None if buf is None else buf[off:off + length]
            ready = m.take_ready() if m.ready else None
        if ready:
            for staged, req in ready:
                self._deliver_staged(staged, req)
        if bad is not None:
            self._on_mismatch(bad[0], self._mismatch(bad[1]))
        if dest is None:
            return None, None
        return target, dest

    def filled(self, link, target, channel, tag, msgno, length) -> None:
        with self.lock:
            done = self.matcher.arrived(link.peer, target, channel, tag, msgno, length)
        if done is None:
            return
        if isinstance(done, tuple):
            self._deliver_staged(*done)
        else:
            done.finish()

    def control(self, link, kind: int, payload: bytes, value: int) -> None:
        p = self.peers[link.peer]
        if kind == KIND_ERROR:
            msg = payload.decode("utf-8", "replace")
            # ``value``: the rank that the reporter names as the group's first failure, + 1
            # (0: none named, the reporter's own failure)
            root = value - 1 if 0 < value <= self.size else p.rank
            p.root = p.root or (root, msg)
            self.note_root(root, msg)
            self.failures.set_broken(TransportError(f"rank {p.rank} reported an error: {msg}"),
                                     only_collective=True)
        elif kind == KIND_QUERY:  # answered at once, whatever this rank is doing
            if p.failure is None:
                link.send_control(KIND_PROGRESS, b"", self.progress)
        elif kind == KIND_PROGRESS:
            with self.mesh_cond:
                self._answers[p.rank] = value
                self.mesh_cond.notify_all()

    def link_failed(self, link, error: BaseException) -> None:
        self.failures.fail_peer(self.peers[link.peer], error)

    def link_closed(self, link) -> None:
        p = self.peers[link.peer]
        self.failures.fail_peer(p, PeerFailure(p.rank, f"rank {p.rank} closed its process group "
                                                       f"while rank {self.rank} still expects "
                                                       f"data from it"),
                                break_group=False)

    def _on_mismatch(self, req: Request | None, err: BaseException) -> None:
        if req is not None:
            req.finish(err)
        if req is None or req.channel == CHANNEL_COLLECTIVE:
            self.report_error(str(err))

    # ------------------------------------------------------------------ failures
    @property
    def broken(self) -> BaseException | None:
        """Why collectives on this context can no longer run (None while healthy)."""
        f = self.failures
        return f.broken or f.coll_broken

    @property
    def closing(self) -> bool:
        """Whether close() (a shutdown or an abort) has begun."""
        return self._closing

    @property
    def close_error(self) -> TransportError | None:
        """What pending and new transfers fail with once the group is closed ("the process
        group was shut down", "... aborted"); None before close()."""
        return self._close_error

    def report_error(self, message: str, root: int | None = None) -> None:
        """Tell every peer that this rank failed the current collective (an ERROR frame naming
        ``root``, default: the group's root cause as this rank knows it, else this rank)
        (``Failures.report``)."""
        self.failures.report(message, root)

    def note_root(self, root: int, text: str) -> tuple[int, str]:
        """Remember the group's first failure as this rank learnt it (``Failures.note_root``)."""
        return self.failures.note_root(root, text)

    def root_cause(self) -> tuple[int, str] | None:
        """The group's first failure as this rank can tell: (rank, what is known of it), or
        None (``Failures.root_cause``)."""
        return self.failures.root_cause()

    def cause_of(self, peer: int) -> tuple[int, str] | None:
        """Why ``peer`` failed, where it said so (``Failures.cause_of``)."""
        return self.failures.cause_of(peer)

    def lost(self, peer: int, symptom: str, prefix: str) -> TransportError:
        """The error to raise when ``peer`` is found gone, naming the group's root cause where
        that is another rank (``Failures.lost``)."""
        return self.failures.lost(peer, symptom, prefix)

    def await_links(self, seconds: float) -> None:
        """Lazy links: wait (at most ``seconds``) until every peer that a report is queued
        for has its link (the report then goes out on it) or has failed. The caller's error is
        handed to its user only after that: a rank that reports and then exits must not take
        the report with it (the dial under way dies with the process; the peer, say asleep on
        a shared-memory group that holds no TCP link, would never hear why)."""
        if not self._lazy:
            return
        deadline = time.monotonic() + seconds
        with self.mesh_cond:
            while not self._closing:
                if all(p.link is not None or p.failure is not None or not p.pending
                       for p in self.peers.values()):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.mesh_cond.wait(left)

    def peer_progress(self, timeout: float = 1.0) -> dict[int, int | None]:
        """Ask every peer for its ``progress`` and wait up to ``timeout`` seconds for the
        answers (they come from the peers' receive threads, whatever their users are doing).
        Returns peer -> its progress, or None for a peer that failed or did not answer."""
        asked = []
        with self.mesh_cond:
            for r in self.peers:
                self._answers.pop(r, None)
        for p in self.peers.values():
            if p.failure is None and self.control_to(p, KIND_QUERY):
                asked.append(p.rank)
        deadline = time.monotonic() + timeout
        with self.mesh_cond:
            while not all(r in self._answers for r in asked):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.mesh_cond.wait(left)
            return {r: self._answers.get(r) for r in self.peers}

    # ------------------------------------------------------------------ statistics, teardown
    def stats(self) -> dict:
        """A plain snapshot (numbers and strings only) of this rank's links: per peer, its
        failure (text or None) and each link's ``Link.stats()`` (kind, state, bytes and
        messages sent and received, queued bytes, retransmits, per-stream counts); plus the
        matcher's staged messages. A co-located peer's ``shm`` link also counts the bytes the
        collectives moved with it through the shared segment (``segment_bytes_sent`` /
        ``_received`` say how many of them: transport/shm/engine.py Engine.traffic)."""
        peers = []
        seg = self.shm
        traffic = seg.traffic if seg is not None else None
        moved = traffic() if traffic is not None else {}
        for p in self.peers.values():
            links = [p.link.stats()] if p.link is not None else []
            if p.rank in moved:
                _add_segment(links, p.rank, *moved[p.rank])
            peers.append({"peer": p.rank, "global_peer": self._global(p.rank),
                          "failure": None if p.failure is None else str(p.failure),
                          "links": links})
        return {"rank": self.rank, "global_rank": self._global(self.rank), "size": self.size,
                "transport": self.transport, "closing": self._closing,
                "staged_messages": self.matcher.staged_messages,
                "staged_bytes": self.matcher.staged_bytes, "peers": peers}

    def _global(self, rank: int) -> int:
        return self.global_ranks[rank] if self.global_ranks else rank

    def connection_stats(self, snapshot: dict | None = None) -> list[dict]:
        """Bytes moved per connection (for metrics and benchmarks), from ``stats()``."""
        out = []
        for peer in (snapshot or self.stats())["peers"]:
            for link in peer["links"]:
                for c in link["connections"]:
                    out.append({"peer": peer["peer"], "connection": c["index"], "local": c["local"],
                                "remote": c["remote"], "sent_bytes": c["sent_bytes"],
                                "received_bytes": c["received_bytes"]})
        return out

    def close(self, timeout: float = 10.0, reason: str = "shut down") -> None:
        """Flush queued sends, tell peers (CLOSE frames), close every link; then fail
        whatever is still pending with "the process group was <reason>".

        Queued sends get up to ``timeout`` seconds, but only while they move: a peer whose
        link is dead (nothing leaves for _STALL_S seconds) is not waited for."""
        if self._closing:
            return
        deadline = time.monotonic() + timeout
        why = self.broken
        if why is not None:
            # Our collectives broke (a peer died, or one reported an error) and we give up: a
            # linked peer that has not heard why yet must not take our CLOSE, which it may see
            # before the report of whoever saw the failure first, for the cause ("rank 1
            # closed its process group while ..."). The ERROR frame goes ahead of the CLOSE.
            payload = error_payload(str(why))
            value = self.failures.root_value()
            for p in self.peers.values():
                if p.link is not None and not p.told and p.failure is None:
                    self.control_to(p, KIND_ERROR, payload, value)
        stalled = self._drain(deadline)
        self._close_error = TransportError(f"rank {self.rank}: the process group was {reason}")
        with self.lock:  # a lazy link made from now on is closed at once (_link_made)
            self._closing = True
            links = [p.link for p in self.peers.values() if p.link is not None]
            unsent = [r for p in self.peers.values() for r in p.pending if isinstance(r, Request)]
            for p in self.peers.values():
                p.pending = []
        if self._lazy:
            self._maker.stop()  # listeners close; no more links
        for link in links:
            link.begin_close()
        # Senders of drained peers send CLOSE and end; a stalled peer's senders are stuck in
        # the kernel until its streams are shut down below.
        join_until = min(deadline, time.monotonic() + _STALL_S)
        for p in self.peers.values():
            if p.link is not None and p.rank not in stalled:
                p.link.wait_sent(join_until)
        metrics.retire(self)  # final byte counts, before the streams go
        if self.shm is not None:
            self.shm.close()
        for link in links:
            link.close(deadline)
        self.failures.set_broken(self._close_error)
        for link in links:  # sends still queued or under way will not end: fail them
            for r in link.cancel(None, underway=True):
                r.finish(wrap(self._close_error))
        for r in unsent:  # lazy: their link was never made
            r.finish(wrap(self._close_error))
        # Nothing of a closed group is left for the garbage collector: its links and its
        # TCP mesh point back at this Context (their sink, the lazy links' callbacks), which
        # holds them; with the cycles, a destroyed TCP group (its matcher's kept buffers too)
        # would stay until the next collection.
        for link in links:
            link.detach()
        if self._maker is not None:
            self._maker.release()

    def _drain(self, deadline: float) -> set:
        """Wait until the sends queued for every peer have left; return the ranks given up
        on: their sends stopped moving for _STALL_S seconds (a dead link or host), or the
        deadline passed. All peers are watched at once: N dead peers cost _STALL_S, not N times."""
        marks: dict[int, tuple] = {}
        given_up: set = set()
        while True:
            now = time.monotonic()
            waiting = False
            for p in self.peers.values():
                if p.rank in given_up or p.failure is not None:
                    continue
                if p.link is None:  # lazy: sends wait for a link being made
                    with self.lock:
                        mark = (len(p.pending), "pending") if p.pending else None
                else:
                    mark = p.link.send_mark()
                if mark is None:
                    continue
                last, since = marks.get(p.rank, (None, now))
                if mark != last:
                    marks[p.rank] = (mark, now)
                    since = now
                if now >= deadline or now - since > _STALL_S:
                    if now < deadline:
                        log.warning("rank %d: %d queued sends to rank %d did not move for %.0fs; "
                                    "closing without them", self.rank, mark[0], p.rank, _STALL_S)
                    given_up.add(p.rank)
                    continue
                waiting = True
            if not waiting:
                return given_up
            time.sleep(0.02)

    def unacknowledged(self, min_seconds: float = 1.0) -> dict[int, float]:
        """Peers to which data has been outstanding without any acknowledgement for at least
        ``min_seconds``: {rank: seconds} (for error messages: a host or link that is down
        answers nothing, while a slow peer still acknowledges)."""
        out = {}
        for p in self.peers.values():
            if p.link is not None:
                silent = p.link.unacknowledged_s()
                if silent >= min_seconds:
                    out[p.rank] = silent
        return out


def _add_segment(links: list, peer: int, sent: int, received: int) -> None:
    """Count the bytes moved with ``peer`` through the shared segment in its ``shm`` link's
    stats (``links``: the peer's; one made up where it has none): one figure per peer."""
    link = next((x for x in links if x["kind"] == "shm"), None)
    if link is None:
        link = {"kind": "shm", "peer": peer, "state": "up", "speed_bps": None, "bytes_sent": 0,
                "bytes_received": 0, "messages_sent": 0, "messages_received": 0,
                "queued_bytes": 0, "retransmits": None,
                "connections": [{"index": 0, "local": "shm", "remote": "shm", "device": "shm",
                                 "sent_bytes": 0, "received_bytes": 0}]}
        links.append(link)
    link["segment_bytes_sent"], link["segment_bytes_received"] = sent, received
    link["bytes_sent"] += sent
    link["bytes_received"] += received
    conn = link["connections"][0]
    conn["sent_bytes"] += sent
    conn["received_bytes"] += received


def link_timeout_from_env(env=None) -> float:
    """LINERATE_LINK_TIMEOUT (TransportOptions.link_timeout): seconds a peer may acknowledge
    nothing before its connections fail (0: the kernel's defaults). A bad value raises a
    ValueError naming the variable."""
    from linerate import settings
    text = settings.raw("LINERATE_LINK_TIMEOUT", env)
    if not (text or "").strip():
        return LINK_TIMEOUT_DEFAULT
    return settings.parse("LINERATE_LINK_TIMEOUT", text)
