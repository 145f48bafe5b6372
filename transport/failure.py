"""How a group fails: propagation of a failure to every transfer it ends, and the group's root
cause.

A peer that dies fails every transfer with it and (fail fast) every pending collective of the
group; the other ranks learn why from an ERROR frame (``KIND_ERROR``, its value the root rank
+ 1) that goes before this rank's CLOSE frames. A rank that failed because of another rank
names that rank, never itself nor a peer that merely exited after its own failure: the first
failure this rank learns of (its own report, a dead peer, a peer's ERROR frame) is the root
it keeps, and it writes it into its cause record of the host's shared segment
(transport/shm), where a co-located rank that finds this rank gone reads why it went.

``Failures`` holds that state for one Context (``ctx``), through the Context's public face:
its peers and their links, the matcher and its lock, ``control_to``, ``await_links``,
``closing`` and ``close_error``, ``shm`` and ``where``.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref

from . import framing, ioloop
from .framing import CHANNEL_COLLECTIVE, KIND_ERROR
from .request import PeerFailure, ProtocolError, Request, TransportError

log = logging.getLogger("linerate.transport")

#: Lazy links: how long a report waits for the links it is queued on.
REPORT_LINK_WAIT_S = 2.0
#: Seconds a rank waits, when a peer's connection ends, for that peer's ERROR frame naming the
#: rank it failed because of (it may come on another connection of the link).
ROOT_WAIT_S = 0.2
#: Seconds a rank that failed waits, before its user hears of it, for its ERROR frames to
#: reach the peers (``Link.flush_control``): a rank that then exits at once must not take them
#: with it.
REPORT_FLUSH_S = 0.5

#: How a message names the group's root cause (``Failures.lost``); a text that already says it
#: is not wrapped again.
BECAUSE = "the group failed because of rank {}: "


def error_payload(message: str) -> bytes:
    """An ERROR frame's payload: the message in UTF-8, cut to what a frame carries."""
    return message.encode("utf-8", "replace")[: framing.MAX_ERROR_BYTES]


def root_text(root: int, text: str) -> str:
    """What is known of root ``root``'s failure, without the wrappers that ranks on the way put
    around it (each says "the group failed because of rank <root>")."""
    marker = BECAUSE.format(root)
    i = text.rfind(marker)
    return text[i + len(marker):] if i >= 0 else text


def wrap(err: BaseException) -> BaseException:
    """A fresh exception of ``err``'s kind and words for one request (each waiter raises its
    own: a traceback is not shared across threads)."""
    if isinstance(err, TransportError):
        return type(err)(*err.args) if not isinstance(err, PeerFailure) else PeerFailure(err.peer, str(err))
    return TransportError(str(err))


def _is_collective(req: Request) -> bool:
    return req.channel == CHANNEL_COLLECTIVE


def _any(req: Request) -> bool:
    return True


class Failures:
    """The failures of one Context: why transfers can no longer start (``broken``: none;
    ``coll_broken``: collectives), the group's root cause as this rank knows it (``root``),
    and the callbacks told of each failure (``on_failure``)."""

    def __init__(self, ctx):
        #: The Context, weakly: it holds this object, and a destroyed group must leave no
        #: cycle for the garbage collector (tests/test_io_threads.py checks).
        self.ctx = weakref.proxy(ctx)
        self.broken: BaseException | None = None        # nothing can run any more
        self.coll_broken: BaseException | None = None   # collectives cannot run any more
        #: The group's first failure as this rank knows it: (root rank, text) (note_root).
        self.root: tuple[int, str] | None = None
        self._root_lock = threading.Lock()
        #: Called with each failure the group learns of (a dead peer, a peer's error report,
        #: this rank's own report), from the thread that learnt it; must not block or raise.
        self.on_failure: list = []

    def fail_peer(self, p, err: BaseException, break_group: bool = True) -> None:
        """Fail every transfer with peer p. ``break_group``: p crashed, so no collective of the
        group can complete: fail the others' pending collective transfers too (fail fast).
        A peer that closed in order may simply have finished before us: only transfers that
        involve it fail. While this rank closes (close(), abort()), what was pending fails
        with the close's own reason: a peer answering our CLOSE frames is not the cause."""
        ctx = self.ctx
        closing = ctx.closing
        if closing:
            err = coll_err = ctx.close_error
        else:
            # A peer that failed because of another rank (its ERROR frame, or its cause record
            # in the shared segment, says so) and then exited or closed is not the cause of
            # the group's failure: the collectives name that rank (``coll_err``); transfers
            # of its own (point-to-point) fail with what happened to it (``err``).
            coll_err = self._lost_error(p.rank, err, crashed=break_group)
        with ctx.lock:
            first = p.failure is None
            if first:
                p.failure = err
                ctx.mesh_cond.notify_all()  # a report may wait for this peer
            failed = ctx.matcher.take_peer(
                p.rank, all(q.failure is not None for q in ctx.peers.values()))
            failed += [r for r in p.pending if isinstance(r, Request)]
            p.pending = []
        if p.link is not None:
            # Mid-send when the stream died: its sender may be gone. A peer that closed in
            # order still reads what is under way: those sends end by themselves.
            failed += p.link.cancel(None, underway=break_group or closing)
        if break_group and not closing and first:
            # Tell the others why (an ERROR frame goes before this rank's CLOSE frames): a rank
            # that has not yet seen p die must not take our closing, once we give up, for the
            # cause ("rank 1 closed its process group ..."). Queued before any waiter hears of
            # the failure: a rank that exits at once after its own failure must not take the
            # report with it (its peer would name it instead of p).
            payload = error_payload(str(coll_err))
            value = self.root_value()
            told = [q for q in ctx.peers.values()
                    if q is not p and q.failure is None
                    and ctx.control_to(q, KIND_ERROR, payload, value)]
        else:
            told = []
        if told and ioloop.on_a_loop():
            # Those frames must be out before anyone here hears of the failure, and this
            # thread (an I/O loop) may be the one that writes them: the rest elsewhere.
            threading.Thread(target=self._fail_rest, daemon=True, name="linerate-fail",
                             args=(told, failed, err, coll_err, break_group, closing)).start()
        else:
            self._fail_rest(told, failed, err, coll_err, break_group, closing)

    def _fail_rest(self, told: list, failed: list, err: BaseException, coll_err: BaseException,
                   break_group: bool, closing: bool) -> None:
        """The end of fail_peer: once the ERROR frames to the peers ``told`` have reached them
        (a rank that exits at once after its own failure must not take its reports with it:
        its peers would name it instead of the root), finish the requests ``failed`` and, for
        a crashed peer, every collective transfer."""
        if told:
            self.flush_reports(told)
        # Requests taken out above must be finished whatever happens: a waiter of one that
        # is dropped here waits forever (abort() left collectives hanging so).
        if failed and not closing:
            log.error("%s", coll_err)
        for r in failed:
            r.finish(wrap(coll_err if r.channel == CHANNEL_COLLECTIVE else err))
        if break_group and not closing:
            self.set_broken(coll_err, only_collective=True)

    def flush_reports(self, peers) -> None:
        """Wait (REPORT_FLUSH_S at most, in all) until the ERROR frames queued for ``peers``
        have reached them (``Link.flush_control``)."""
        ctx = self.ctx
        until = time.monotonic() + REPORT_FLUSH_S
        for q in peers:
            link = q.link
            if link is not None and not link.flush_control(until):
                log.debug("rank %d: the report to rank %d may not have reached it",
                          ctx.rank, q.rank)

    def set_broken(self, err: BaseException, only_collective: bool = False) -> None:
        """Fail pending transfers (collective ones, or all) and refuse new ones of that kind."""
        ctx = self.ctx
        with ctx.lock:
            if only_collective:
                self.coll_broken = self.coll_broken or err
            else:
                self.broken = self.broken or err
            failed = ctx.matcher.take_channel(CHANNEL_COLLECTIVE if only_collective else None)
            for p in ctx.peers.values():
                if p.pending:
                    keep = []
                    for r in p.pending:
                        (failed if isinstance(r, Request) and (not only_collective or
                                  r.channel == CHANNEL_COLLECTIVE) else keep).append(r)
                    p.pending = keep
        # Sends too: an algorithm waiting on a send must see this reason, not whatever ends
        # that send later (e.g. the peer closing once it failed for the same reason).
        match = _is_collective if only_collective else _any
        for p in ctx.peers.values():
            if p.link is not None:
                failed += p.link.cancel(match, underway=True)
        for r in failed:
            r.finish(wrap(err))
        for fn in list(self.on_failure):
            try:
                fn(err)
            except Exception:  # noqa: BLE001 - never into the transport's threads
                log.exception("rank %d: a failure callback raised", ctx.rank)

    def report(self, message: str, root: int | None = None) -> None:
        """Tell every peer that this rank failed the current collective (an ERROR frame).
        ``root``: the rank whose failure caused it (default: the group's first failure as this
        rank knows it, else this rank's own); the frame carries it, and the shared segment's
        cause record of this rank says it (``note_root``)."""
        ctx = self.ctx
        if root is None:
            known = self.root_cause()
            root = known[0] if known is not None else ctx.rank
        self.note_root(root, message)
        payload = error_payload(message)
        value = self.root_value()
        told = [p for p in ctx.peers.values()  # before anyone here hears of it (fail_peer)
                if p.failure is None and ctx.control_to(p, KIND_ERROR, payload, value)]
        self.set_broken(TransportError(message), only_collective=True)
        ctx.await_links(REPORT_LINK_WAIT_S)
        if not ioloop.on_a_loop():
            self.flush_reports(told)

    # ------------------------------------------------------------------ the root cause
    def note_root(self, root: int, text: str) -> tuple[int, str]:
        """Remember the group's first failure as this rank learnt it (the first call wins):
        ``root`` failed, ``text`` says how. Written into this rank's cause record in the
        shared segment too (transport/shm), before the failure reaches this rank's user:
        a co-located rank that later finds this rank gone reads there why it went. Returns
        the root now remembered."""
        ctx = self.ctx
        with self._root_lock:
            if self.root is None:
                self.root = (root, root_text(root, text))
                seg = ctx.shm
                if seg is not None:
                    try:
                        seg.record_cause(*self.root)
                    except (AttributeError, TypeError, ValueError):  # closed meanwhile
                        pass
            return self.root

    def root_cause(self) -> tuple[int, str] | None:
        """The group's first failure as this rank can tell: (the rank that failed first, what
        is known of it), or None while nothing is. What this rank noted comes first (its own
        report, a dead peer, a peer's ERROR frame, which names the root); else the co-located
        ranks' cause records (a rank whose record names itself, else the rank the others
        blame that recorded nothing: transport/shm ``pick_root``)."""
        ctx = self.ctx
        if self.root is not None:
            return self.root
        seg = ctx.shm
        if seg is not None and not seg.closed:
            found = seg.root_cause()
            if found is not None:
                return found[0], root_text(found[0], found[2])
        return None

    def cause_of(self, peer: int) -> tuple[int, str] | None:
        """Why ``peer`` failed, where it said so: (root, text) from its ERROR frame or its cause
        record in the shared segment; None where it said nothing (it may be the cause)."""
        ctx = self.ctx
        p = ctx.peers.get(peer)
        if p is not None and p.root is not None:
            return p.root
        seg = ctx.shm
        if seg is not None and not seg.closed and peer in seg.ranks:
            return seg.cause_of(peer)
        return None

    def lost(self, peer: int, symptom: str, prefix: str) -> TransportError:
        """The error to raise when ``peer`` is found gone (exited, closed, unreadable), as
        ``symptom`` says: where ``peer`` itself failed because of another rank (its ERROR frame
        or cause record says so) or the group's first failure is known to be another rank's,
        an error naming that root (after ``prefix``: this rank and the op) instead of ``peer``:
        a rank that merely exited after its own failure is never the cause. The error's
        ``root`` attribute is the rank it blames."""
        ctx = self.ctx
        cause = self.cause_of(peer) or self.root_cause()
        if cause is not None and cause[0] != peer:
            root, text = cause
            log.info("%s (the group had failed because of rank %d)", symptom, root)
            text = root_text(root, text)
            where = ctx.where()
            err = TransportError(f"{prefix}: {BECAUSE.format(root)}{text}"
                                 f"{'' if where in text else where}")
        else:
            root = peer
            err = TransportError(symptom)
        err.root = root
        return err

    def _lost_error(self, peer: int, err: BaseException, crashed: bool) -> BaseException:
        """``fail_peer``'s error for ``peer``: where the peer failed because of another rank
        before it went (it said so), a PeerFailure naming that root; else ``err``, and a
        crashed peer is noted as the root (if none is known yet). A peer that broke the
        protocol (ProtocolError) is the cause: no frame of it is awaited."""
        ctx = self.ctx
        cause = self.cause_of(peer)
        if cause is None and crashed and not isinstance(err, ProtocolError):
            # A peer that failed because of another rank sends an ERROR frame naming that
            # rank before it goes; with several connections per peer this rank may see one of
            # them end before the frame, on another, is read. Wait a moment for it (or for the
            # group's root, learnt elsewhere), then take the peer for the cause. Not while this
            # rank closes the group itself: close() joins the thread that waits here.
            deadline = time.monotonic() + ROOT_WAIT_S
            while cause is None and time.monotonic() < deadline and not ctx.closing:
                known = self.root
                if known is not None and known[0] != peer:
                    cause = known
                    break
                time.sleep(0.005)
                cause = self.cause_of(peer)
        if cause is not None and cause[0] != peer:
            root, text = cause
            log.info("%s (rank %d had failed because of rank %d)", err, peer, root)
            self.note_root(root, text)
            return PeerFailure(peer, f"rank {ctx.rank}: {BECAUSE.format(root)}"
                                     f"{root_text(root, text)}")
        if crashed:
            self.note_root(peer, str(err))
        return err

    def root_value(self) -> int:
        """An ERROR frame's value: the root rank + 1 (0: none known)."""
        root = self.root
        return root[0] + 1 if root is not None else 0


__all__ = ["Failures", "BECAUSE", "error_payload", "root_text", "wrap", "REPORT_LINK_WAIT_S",
           "ROOT_WAIT_S", "REPORT_FLUSH_S"]
