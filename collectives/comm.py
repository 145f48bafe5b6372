"""What an algorithm sees of the transport: send/receive tensors to/from group ranks within one
collective, with the op's sequence number, opcode and deadline attached to every transfer."""
from __future__ import annotations

import hashlib
import time

import torch

from linerate.transport import CHANNEL_COLLECTIVE, Context, Request
from linerate.transport.shm.engine import OpTimeout  # noqa: F401 - also this module's API

from .mismatch import OpNames
from .views import byte_view  # noqa: F401 - also this module's API (collectives/p2p.py)

# Opcodes travel in every frame so that a rank in a different collective is named, not mixed in.
OPCODES = {
    "all_reduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "gather": 5, "scatter": 6,
    "reduce_scatter": 7, "all_to_all": 8, "barrier": 9, "all_reduce_coalesced": 10,
    "all_gather_coalesced": 11, "reduce_scatter_coalesced": 12, "neighbor_allreduce": 13,
}
# Their names, and the words for mismatches the transport reports (collectives/mismatch.py).
OPNAMES = OpNames({v: k for k, v in OPCODES.items()})


def pieces(t: torch.Tensor, piece_elems: int) -> list[torch.Tensor]:
    """Cut a 1-D tensor into views of at most piece_elems elements (one empty view if empty)."""
    n = t.numel()
    if n <= piece_elems:
        return [t]
    return [t[i:i + piece_elems] for i in range(0, n, piece_elems)]


MIN_PIECES = 4
#: Blocks of slots per (view of an) op before they wrap (Comm.block).
_BLOCKS = (1 << 12) - 1
#: Tags of SubComm views (slot bits 56-63).
MAX_VIEW_TAG = 255
MIN_PIECE_BYTES = 256 * 1024


class Fold:
    """How the log-P algorithms (recursive doubling, halving-doubling) run on P ranks that are
    not a power of two: with ``p2`` the largest power of two <= P and ``rem = P - p2``, ranks
    2i and 2i+1 (i < rem) pair up: the even one hands its tensor to the odd one and sits out
    (``sits_out``), and gets the result back at the end. The p2 others renumber 0..p2-1
    (``virtual``); ``real(v)`` is a virtual rank's group rank."""

    __slots__ = ("p2", "rem", "sits_out", "folds_in", "virtual")

    def __init__(self, P: int, rank: int):
        self.p2 = 1 << (P.bit_length() - 1)
        self.rem = P - self.p2
        paired = rank < 2 * self.rem
        self.sits_out = paired and rank % 2 == 0          # partner: rank + 1
        self.folds_in = paired and rank % 2 == 1          # partner: rank - 1
        self.virtual = None if self.sits_out else (rank // 2 if paired else rank - self.rem)

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.rem else v + self.rem


class Scratch:
    """Reusable scratch buffers of a group (its collectives run one at a time).

    Fresh large allocations are fresh pages: every op would pay a page fault and a page
    zeroing per 4 KiB while the kernel copies received bytes in. Buffers are kept per index
    and grow as needed; after each op ``trim`` gives back the largest beyond
    LINERATE_KEEP_BYTES."""

    def __init__(self):
        self._bufs: dict[int, torch.Tensor] = {}
        self.held = 0  # bytes of every buffer kept

    def get(self, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(index)
        if buf is None or buf.numel() < nbytes:
            self.held -= 0 if buf is None else buf.numel()
            buf = self._bufs[index] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.held += buf.numel()
        return buf[:nbytes].view(dtype)

    def release(self) -> None:
        self._bufs.clear()
        self.held = 0

    def trim(self, keep_bytes: int) -> None:
        """Give back the largest buffers until at most ``keep_bytes`` are kept (after an op:
        LINERATE_KEEP_BYTES), so one large operation does not hold its scratch for good."""
        if self.held <= keep_bytes:
            return
        for index, buf in sorted(self._bufs.items(), key=lambda kv: -kv[1].numel()):
            if self.held <= keep_bytes:
                break
            self.held -= buf.numel()
            del self._bufs[index]


_DIGESTS: dict = {}


def call_digest(op: str, desc: str) -> int:
    """The 64-bit digest of a call (op and the arguments every rank must agree on), the same
    on every rank; cached, since a job repeats a few calls many times."""
    key = (op, desc)
    d = _DIGESTS.get(key)
    if d is None:
        if len(_DIGESTS) > 4096:
            _DIGESTS.clear()
        d = _DIGESTS[key] = int.from_bytes(
            hashlib.blake2b(f"{op}({desc})".encode(), digest_size=8).digest(), "little")
    return d


def answer_wait(timeout: float) -> float:
    """Seconds a timed-out op waits for the peers to say how far they got: a tenth of the
    timeout, from 0.05 s to 0.5 s. On a host whose ranks outnumber its cores, a receive thread
    may wait its turn for a few hundred milliseconds before it answers."""
    return min(0.5, max(0.05, timeout / 10))


class Comm:
    """One collective's view of the group: rank, size, send, recv, deadline."""

    def __init__(self, ctx: Context, op: str, seq: int, timeout: float, piece_bytes: int,
                 scratch: Scratch | None = None, worker: bool = False, shm=None):
        self.ctx = ctx
        self.rank = ctx.rank
        self.size = ctx.size
        self.op = op
        self.opcode = OPCODES[op]
        self.seq = seq
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.piece_bytes = piece_bytes
        #: The op as errors name it: ``all_reduce #12``.
        self.desc = f"{op} #{seq}"
        self._block = 0
        self.scratch = scratch or Scratch()
        #: This op's SubComm views, by (group ranks, tag): one per subset, so that its blocks
        #: keep counting across the algorithm runs of the op (sub()).
        self._subs: dict = {}
        #: The algorithm that ran (set by the algorithm; the metrics label).
        self.algorithm = "direct"
        self.call = 0
        self.call_text = ""
        self._call_op = None  # the op whose digest ``call`` is
        self._req_desc = self.desc
        #: Priority of this op's sends (lower goes first; transport Context.isend).
        self.priority = 0
        #: When each peer's first contribution arrived (group rank -> time.perf_counter()):
        #: a dict where the group watches for slow ranks (op.Lifecycle.begin), else None.
        self.arrivals = None
        #: Whether the op runs where the group's shared-memory engines are its own (the
        #: group's worker, or a synchronous caller on the worker's turn): the algorithm
        #: table offers shared-memory algorithms only then (collectives/algorithms.py).
        self.worker = worker
        #: The shared-memory engine of every rank of the group (collectives/shm_algos.py),
        #: given where ``worker``; None where the op has none.
        self.shm = shm
        #: Two-level all_reduces chained to each other (collectives/two_level.py), set by the
        #: group for an op on its worker: ``chain_next()`` says whether the next op queued
        #: can be chained to this one (None: never offered); ``before_tail(loc)`` is the end
        #: of the op before, for this op's algorithm to run once its own first phase is
        #: under way (None once run); the algorithm leaves this op's own end, for the next
        #: op to run, in ``deferred_tail(loc)`` (None: it ended here).
        self.chain_next = None
        self.before_tail = None
        self.deferred_tail = None
        #: Whether the thread that runs the op reads the links it waits on itself
        #: (transport Context.drive, for small messages): an op that a synchronous caller
        #: runs on the worker's turn (lone, fused or plain), which nothing else of the
        #: group runs beside.
        self.drive = False
        # What this rank tells a peer that asks how far it got (a timeout's diagnosis).
        if seq > ctx.progress:
            ctx.progress = seq

    def renew(self, op: str, seq: int, timeout: float, call: str) -> None:
        """This Comm for the group's next op ``seq`` with the arguments ``call`` (set_call),
        as a new one would start it: a group's lone small calls reuse one Comm (runner:
        _run_lone) instead of making one each; a repeated call keeps its digest."""
        if op != self.op:
            self.op = op
            self.opcode = OPCODES[op]
        self.seq = seq
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.desc = f"{op} #{seq}"
        self._block = 0
        self.algorithm = "direct"
        self.arrivals = None
        if seq > self.ctx.progress:
            self.ctx.progress = seq
        self.set_call(call)

    def piece_elems(self, t: torch.Tensor, span: int | None = None) -> int:
        """Elements per pipelined piece when cutting ``span`` elements (default: all of t).

        At most ``piece_bytes``, but small enough that a span is cut into at least
        MIN_PIECES pieces (not below MIN_PIECE_BYTES): big pieces cost less per byte, yet a
        span of one or two pieces does not pipeline, and stays well short of the line rate."""
        es = max(1, t.element_size())
        n = t.numel() if span is None else span
        target = min(self.piece_bytes, max(MIN_PIECE_BYTES, n * es // MIN_PIECES))
        return max(1, target // es)

    def set_call(self, desc: str) -> None:
        """The call's arguments that every rank must agree on (dtypes, sizes, reduce op,
        root), as text. Its digest travels in every frame of the op; a receiving rank whose
        own digest differs fails the op and tells every peer (transport: MismatchError)."""
        if desc != self.call_text or self._call_op != self.op:  # (a repeated call: its digest)
            self.call_text = desc
            self._call_op = self.op
            self.call = call_digest(self.op, desc)
        self._req_desc = f"{self.desc} [{desc}]" if desc else self.desc
        self.ctx.begin_call(self.seq, self.call, self._req_desc)

    def end(self) -> None:
        got = self.ctx.end_call(self.seq)
        if got and self.arrivals is not None:
            arr = self.arrivals
            for q, t in got.items():
                if q not in arr or t < arr[q]:
                    arr[q] = t
        self.scratch.trim(self.ctx.options.keep_bytes)
        # The op's SubComms point back at it (root), and a chained op's tail is a closure
        # over it: cycles that only the garbage collector would free. Broken here, the op's
        # objects go when the last reference does, so that ops leave nothing to collect: a
        # full collection of a process that imported torch takes tens of milliseconds, and
        # each rank's collection stalls every rank's collectives.
        self._subs.clear()
        self.deferred_tail = self.before_tail = self.chain_next = None

    def block(self) -> int:
        """Reserve a block of message slots for one algorithm run within this op.

        Every message of an op has a slot, and a receive gets the message with its slot
        whatever order the two sides post in (algorithms post receives early and out of
        order). Each algorithm run takes a fresh block, so runs within one op (coalesced
        tensors) never share a slot. Every rank must call block() the same number of times.
        Slots: view << 56 | block << 44 | phase << 40 | step << 20 | piece; ``view`` is 0 here
        and a SubComm's tag there, so a subset's runs never share a slot with the op's. Blocks
        count 1..4095 and wrap: a run ends only once its messages arrived, so the block of a
        run 4095 runs back is long free."""
        self._block = self._block % _BLOCKS + 1
        return self._block << 44

    def sub(self, ranks, tag: int) -> "SubComm":
        """This op's view restricted to the group ranks ``ranks`` (this rank among them), as
        ``SubComm``: sub-rank i is ``ranks[i]``. ``tag`` (1..255) keeps its slots apart from the
        op's and from other subsets' of the same op; every member must pass the same. The same
        ranks and tag give the same view for the whole op (its blocks keep counting)."""
        return SubComm.of(self, ranks, tag)

    @staticmethod
    def slot(base: int, phase: int = 0, step: int = 0, piece: int = 0) -> int:
        return base | (phase << 40) | (step << 20) | piece

    def isend(self, peer: int, t: torch.Tensor, slot: int) -> Request:
        return self.ctx.isend(peer, byte_view(t), CHANNEL_COLLECTIVE, self.seq, self.opcode,
                              self._req_desc, slot, self.call, self.priority)

    def irecv(self, peer: int, t: torch.Tensor, slot: int) -> Request:
        return self.ctx.irecv(peer, byte_view(t), CHANNEL_COLLECTIVE, self.seq, self.opcode,
                              self._req_desc, slot, self.call, self.drive)

    def isend_bytes(self, peer: int, view: memoryview, slot: int) -> Request:
        """``isend`` of a byte buffer of this rank's own (no tensor to view)."""
        return self.ctx.isend(peer, view, CHANNEL_COLLECTIVE, self.seq, self.opcode,
                              self._req_desc, slot, self.call, self.priority)

    def irecv_bytes(self, peer: int, view: memoryview, slot: int) -> Request:
        return self.ctx.irecv(peer, view, CHANNEL_COLLECTIVE, self.seq, self.opcode,
                              self._req_desc, slot, self.call, self.drive)

    def wait(self, req: Request) -> None:
        if self.drive and not req.is_send and not req.is_completed():
            self.ctx.drive(req, self.deadline)
        left = self.deadline - time.monotonic()
        try:
            req.wait(max(left, 0.0))
        except TimeoutError:
            if self.drive:  # the links' own threads read what the diagnosis needs
                self.ctx.reclaim_links()
            # A peer whose host or link is down acknowledges nothing: name it, since the rank
            # this one waits for may itself be stuck waiting for it. Looked at before the
            # diagnosis asks the peers how far they got (_absent): a question just sent is
            # outstanding until acknowledged, and on a connection that had nothing to carry
            # for a while it would make a live peer look unreachable.
            silent = "".join(f"; rank {r} has acknowledged nothing for {s:.1f}s while data to it "
                             f"is outstanding: its host or link is down?"
                             for r, s in sorted(self.ctx.unacknowledged().items()))
            absent = self._absent()
            hint = ""
            if req.peer is not None:
                other = [f"{name} #{seq}" for seq, name in OPNAMES.staged_ops(self.ctx, req.peer)
                         if seq != self.seq]
                if other:
                    hint = (f"; rank {req.peer} has sent data of {', '.join(other)} instead: the "
                            f"ranks called different collectives")
            who = "any rank" if req.peer is None else f"rank {req.peer}"
            if req.is_send:
                what = f"to send {req.total} bytes to it"
            else:
                what = f"{req.done_bytes} of {req.total} bytes received from it"
            raise OpTimeout(f"rank {self.rank}: {self.desc} did not complete within the "
                            f"{self.timeout:.1f}s timeout{absent}: this rank was still "
                            f"waiting for {who} ({what}){silent}{hint}") from None

    def _absent(self) -> str:
        """Which ranks have not entered this op, as far as they answer within answer_wait() (their
        receive threads answer at once, but on a loaded host a thread may wait its turn for a
        while; a rank whose link is down never does, and the error waits for it that long):
        the rank a ring waits for may itself be waiting for the one that never came."""
        late, silent = [], []
        for r, progress in sorted(self.ctx.peer_progress(answer_wait(self.timeout)).items()):
            if progress is None:
                silent.append(r)
            elif progress < self.seq:
                late.append(f"rank {r} (last entered #{progress})" if progress else f"rank {r}")
        parts = []
        if late:
            parts.append(f"{', '.join(late)} {'has' if len(late) == 1 else 'have'} not entered "
                         f"{self.op} #{self.seq}")
        if silent:
            parts.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
                         f"did not answer (exited, hung in native code, or link down)")
        return f": {'; '.join(parts)}" if parts else ""

    def wait_all(self, reqs) -> None:
        for r in reqs:
            self.wait(r)


class SubComm:
    """A Comm restricted to a subset of its group's ranks, for running the algorithms (ring,
    direct, halving, chain, shm_algos) unchanged on that subset: ``rank``/``size`` are this
    rank's position in ``ranks`` and their number; ``isend``/``irecv`` take sub-ranks and map
    them to group ranks; ``block()`` gives slots tagged with ``tag`` (bits 56-63), which can
    never collide with the parent op's own slots (tag 0) nor with another subset's of the same
    op that uses another tag. Everything else (sequence number, call digest, deadline, scratch,
    the op's description in errors) is the parent's: a mismatch or a timeout is reported as the
    op's, naming group ranks. ``shm`` is the shared-memory engine of exactly these ranks, or
    None (never the parent's)."""

    @staticmethod
    def of(parent, ranks, tag: int) -> "SubComm":
        """The op's view of ``ranks`` (of ``parent``) with ``tag``, made once per op."""
        root = parent.root if isinstance(parent, SubComm) else parent
        ranks = tuple(int(q) for q in ranks)
        key = (tuple(parent.ranks[q] for q in ranks) if isinstance(parent, SubComm) and
               all(0 <= q < parent.size for q in ranks) else ranks, tag)
        view = root._subs.get(key)
        if view is None:
            view = root._subs[key] = SubComm(parent, ranks, tag)
        return view

    def __init__(self, parent, ranks, tag: int):
        ranks = tuple(int(q) for q in ranks)
        if not 1 <= tag <= MAX_VIEW_TAG:
            raise ValueError(f"a sub-communicator's tag must be in 1..{MAX_VIEW_TAG}, got {tag}")
        if len(set(ranks)) != len(ranks) or any(not 0 <= q < parent.size for q in ranks):
            raise ValueError(f"rank {parent.rank}: {parent.desc}: sub-group {list(ranks)} must "
                             f"be distinct ranks of the group of size {parent.size}")
        if parent.rank not in ranks:
            raise ValueError(f"rank {parent.rank}: {parent.desc}: not a member of sub-group "
                             f"{list(ranks)}")
        root = parent
        if isinstance(parent, SubComm):  # compose: sub-ranks of a sub-group -> group ranks
            ranks = tuple(parent.ranks[q] for q in ranks)
            root = parent.root
        self.root = root
        self.ranks = ranks
        self.rank = ranks.index(root.rank)
        self.size = len(ranks)
        self.tag = tag
        self._block = 0
        self.algorithm = root.algorithm
        self.shm = None

    def __getattr__(self, name):  # seq, call, ctx, deadline, scratch, wait, piece_elems, ...
        return getattr(self.root, name)

    def block(self) -> int:
        self._block = self._block % _BLOCKS + 1
        return (self.tag << 56) | (self._block << 44)

    @staticmethod
    def slot(base: int, phase: int = 0, step: int = 0, piece: int = 0) -> int:
        return Comm.slot(base, phase, step, piece)

    def sub(self, ranks, tag: int) -> "SubComm":
        return SubComm.of(self, ranks, tag)

    def isend(self, peer: int, t: torch.Tensor, slot: int) -> Request:
        return self.root.isend(self.ranks[peer], t, slot)

    def irecv(self, peer: int, t: torch.Tensor, slot: int) -> Request:
        return self.root.irecv(self.ranks[peer], t, slot)

    def isend_bytes(self, peer: int, view: memoryview, slot: int) -> Request:
        return self.root.isend_bytes(self.ranks[peer], view, slot)

    def irecv_bytes(self, peer: int, view: memoryview, slot: int) -> Request:
        return self.root.irecv_bytes(self.ranks[peer], view, slot)
