"""Two-level collectives for a group that spans hosts with several ranks on a host: shared
memory within each host (collectives/shm_algos.py on a SubComm of the host's ranks), TCP
between hosts (the flat algorithms on SubComms of one rank per host), with every local rank
carrying its share of the inter-host traffic (no leader per host).

Layout (transport/shm ``Layout``): hosts ``0..H-1`` ordered by their lowest rank, ``n_h``
ranks on host h (local ranks ``0..n_h-1`` in rank order), ``L = max n_h``. The data is cut
into ``L`` *columns*; on host h, column c belongs to one local rank, its *owner*; the owners
of column c on every host form the column's inter-host group (one rank per host, in host
order). Every local rank owns at least one column, so every rank carries inter-host traffic;
on even layouts each rank owns exactly one column and the H x n ranks form n disjoint
inter-host rings. Hosts with fewer ranks give some of them two or more columns (4 + 3: one rank
of the 3-rank host owns two); a rank runs its columns' inter-host groups in column order,
which cannot deadlock (the lowest unfinished column's owners have all finished their earlier
ones). A host with one rank of the group takes part without shared memory (its local phases
are empty).

- all_reduce: columns are contiguous (column c of host h: local rank ``c * n_h // L``), so a
  rank's columns are one slice; consecutive columns with the same owners run as one group.
  Local reduce-scatter in shared memory (each owner gets its slice reduced over the host, rank
  order), inter-host all-reduce of the slice among the column's owners (pipelined ring; direct
  when small), local all-gather in shared memory. Large tensors are cut into chunks of
  PIPE_BYTES: the inter-host phase of chunk k runs on helper thread k mod 2 (two, so that one
  chunk's rings end while the next one's start) while the worker does the local phases of the
  chunks before and after it; or run as one chunk where that measured faster (PipeChoice).
  Up to ``small_bytes``: a shared-memory all_reduce of the whole tensor (every rank of a host
  gets the host's sum), then each rank all-reduces it directly with its column's owners (no
  local all-gather).
- reduce_scatter / all_gather: column i is local rank i's segment on every host that has one
  (owner ``i % n_h``, so each rank's own segment is in its own column); inter-host ring
  reduce-scatter / all-gather per column; local phases through shared memory.
- broadcast: shared-memory broadcast on the root's host, inter-host chain (or direct) per
  column slice, local all-gather on the other hosts. reduce: local reduce-scatter, inter-host
  chain reduce per column slice to the root's host, local gather to the root.

Bit-identical results on every rank: each element is reduced at one place in a fixed order
(over a host's ranks in rank order, then over hosts as the ring does) and copied everywhere
else; the small path folds identical host sums in host order on every column group.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from linerate.transport import TransportError

from . import algorithms, direct, ring, shm_algos
from .algorithms import MAX_COLUMNS
from .comm import MAX_VIEW_TAG, OpTimeout, Scratch
from .reduce_ops import RedOpType

#: SubComm tag of a host's ranks (local phases: shared memory, no slots used); the inter-host
#: groups take 1 + first column (contiguous columns; + MAX_COLUMNS for the all_reduce
#: pipeline's odd chunks, which run beside the even ones) and RS_TAG + column (reduce_scatter /
#: all_gather columns): a tag always names the same ranks within an op.
LOCAL_TAG = MAX_VIEW_TAG
RS_TAG = 2 * MAX_COLUMNS + 1
#: all_reduce: chunk size of the pipeline between the local and the inter-host phases.
PIPE_BYTES = 8 << 20
#: Most middle chunks of one all_reduce (two quarter-size edge chunks come on top).
MAX_CHUNKS = 16


class PipeChoice:
    """Whether a large two-level all_reduce runs pipelined (chunks of PIPE_BYTES: the inter-host
    phase of one chunk on a helper thread beside the local phases of the others) or as one chunk
    (local reduce-scatter, inter-host all-reduce, local all-gather, one after the other), per
    group (``LINERATE_PIPELINE``: ``1`` always pipelined, ``0`` never, ``auto`` measured).

    The pipeline hides the local phases behind the links where the links are the bottleneck.
    Where they are not (CPU-bound ranks on fast links), its helper threads and hand-offs only
    add CPU, and one chunk is faster. ``auto``: an all_reduce that would have more than 2
    chunks is *eligible*; the first ``GATE_AT`` run pipelined. At the next, the group's ranks agree (``exchange``:
    every rank's value summed over the group, the same bits everywhere) on the pipelined time
    per byte, each rank's best of its counted ops so far (the first op is never counted: the
    best of ``GATE_AT - 1``). One slow op must not decide: a full garbage collection (tens of
    milliseconds on every rank of a process that imported torch) can fall into an early op of
    a fresh group and make a fast group look link-bound, which would keep it pipelined for
    ``RECHECK`` ops. A group slower than ``FAST_BPS`` (bytes of tensor per second) is link-bound
    and stays pipelined, asking again every ``RECHECK`` eligible ops; a faster one tries one
    chunk: this op and the next run in the modes listed in ``EXPLORE``, then the ranks agree
    on the faster (summed best of each rank's last ``KEEP`` times per byte; an op right after
    one of the other mode is not counted: ``next_op``), and before every ``RETRY``-th op two
    run in the other mode and they agree again. Every rank runs the same eligible ops in the
    same order (a failed collective breaks the group's collectives), so every rank takes the
    same decisions at the same ops: only agreed sums decide."""

    GATE_AT = 3
    FAST_BPS = 250e6
    #: The trial's modes (pipelined?): one chunk only. The pipelined times are the gate's
    #: ops' (trying the pipeline again in the trial would only add slow ops where one chunk is
    #: the faster mode).
    EXPLORE = (False, False, False)
    RETRY = 32
    RECHECK = 64
    KEEP = 3

    def __init__(self, setting: str = "auto"):
        if setting not in ("auto", "0", "1"):
            raise ValueError(f"LINERATE_PIPELINE must be auto, 0 or 1, got {setting!r}")
        self.setting = setting
        self.m = 0                    # eligible all_reduces so far
        self.state = "gate"           # gate -> explore -> chosen | pipe
        self.at = self.GATE_AT        # the op at which the next exchange is made
        self.pipe = True              # the agreed mode (chosen / pipe states)
        self.times = {True: [], False: []}
        self.last = True              # the mode of the last eligible op begun
        #: Eligible ops run in each mode (pipelined, one chunk), and exchanges made.
        self.used = {True: 0, False: 0}
        self.exchanges = 0

    def _mine(self, pipe: bool) -> list[float]:
        """This rank's part of an exchange about one mode: its best kept time per byte, and
        1 (0, 0 where it has none yet: an op whose end was chained to the next one)."""
        t = self.times[pipe]
        return [min(t), 1.0] if t else [0.0, 0.0]

    def next_op(self, exchange) -> tuple[bool, bool]:
        """Whether this eligible op runs pipelined, and whether its time counts (not the first
        op, nor one whose predecessor ran the other mode: it pays the page faults of scratch
        grown anew and a cold cache, and is markedly slower than an op in a run of its mode);
        ``exchange(values)`` returns the list of ``values`` summed over the group's ranks
        (called at the same ops on every rank)."""
        m = self.m
        self.m += 1
        if self.setting != "auto":
            pipe = self.setting != "0"
        elif self.state == "explore":
            k = m - self.at
            if k < len(self.EXPLORE):
                pipe = self.EXPLORE[k]
            else:
                pipe = self._decide(exchange, m)
        elif m < self.at:
            probe = self.state == "chosen" and m >= self.at - 2  # two: the first is a switch
            pipe = self.pipe != probe
        elif self.state == "chosen":
            pipe = self._decide(exchange, m)
        else:  # gate, pipe: pipelined until the group is shown fast enough to try both
            self.exchanges += 1
            t, n = exchange(self._mine(True))
            if t > 0 and n / t >= self.FAST_BPS:  # the ranks' mean time per byte, inverted
                self.state, self.at = "explore", m  # this op is the trial's first
                pipe = self.EXPLORE[0]
            else:
                self.state, self.at = "pipe", m + self.RECHECK
                pipe = True
        self.used[pipe] += 1
        counted = m > 0 and pipe == self.last
        self.last = pipe
        return pipe, counted

    def _decide(self, exchange, m: int) -> bool:
        self.exchanges += 1
        tp, np_, to, no = exchange(self._mine(True) + self._mine(False))
        self.state, self.at = "chosen", m + self.RETRY
        # one chunk only where both were measured and it was faster on the ranks' mean
        self.pipe = not (np_ > 0 and no > 0 and to / no < tp / np_)
        return self.pipe

    def note(self, pipe: bool, per_byte: float) -> None:
        """A counted op of this mode ended, taking ``per_byte`` seconds per byte of its tensor."""
        kept = self.times[pipe]
        kept.append(per_byte)
        del kept[:-self.KEEP]


class Plan:
    """A group's two-level layout, seen from one rank (the same columns on every rank)."""

    def __init__(self, hosts, rank: int, pipeline: str = "auto"):
        self.hosts = tuple(tuple(h) for h in hosts)
        self.H = len(self.hosts)
        self.n = [len(h) for h in self.hosts]
        self.L = max(self.n)
        self.rank = rank
        self.h = next(i for i, h in enumerate(self.hosts) if rank in h)
        self.local = self.hosts[self.h]
        self.j = self.local.index(rank)
        if self.L > MAX_COLUMNS:
            raise ValueError(f"rank {rank}: two-level collectives take at most {MAX_COLUMNS} ranks "
                             f"per host, the group has {self.L}")
        #: The inter-host phases' scratch and helper threads: all_reduce's even chunks on
        #: the first, odd chunks on the second (each in chunk order: the slots of a column
        #: group are taken in the same order on every rank).
        self.scratch = (Scratch(), Scratch())
        self._pools: list = []
        self._lock = threading.Lock()
        # all_reduce / broadcast / reduce: contiguous columns, grouped by their owners
        self.runs = self._runs(self.h, self.j)
        # reduce_scatter / all_gather: column i, owner i % n_h
        self.cols = [i for i in range(self.L) if i % self.n[self.h] == self.j]
        #: Pipelined or one chunk, for this group's large all_reduces (PipeChoice).
        self.pipe = PipeChoice(pipeline)

    # ------------------------------------------------------------------ columns
    def owner(self, g: int, c: int) -> int:
        """Group rank owning contiguous column c on host g."""
        return self.hosts[g][c * self.n[g] // self.L]

    def col_range(self, g: int, j: int) -> tuple[int, int]:
        """Contiguous columns [c0, c1) of local rank j of host g."""
        n = self.n[g]
        return -(-j * self.L // n), -(-(j + 1) * self.L // n)

    def _runs(self, g: int, j: int) -> list[tuple[int, int, tuple]]:
        """This rank's columns as (c0, c1, owners): consecutive columns with the same owners."""
        c0, c1 = self.col_range(g, j)
        runs: list[list] = []
        for c in range(c0, c1):
            members = tuple(self.owner(x, c) for x in range(self.H))
            if runs and runs[-1][2] == members:
                runs[-1][1] = c + 1
            else:
                runs.append([c, c + 1, members])
        return [tuple(r) for r in runs]

    def bounds(self, n: int) -> list[int]:
        """Element offsets of the L contiguous columns of n elements (L + 1 of them)."""
        base, extra = divmod(n, self.L)
        return [c * base + min(c, extra) for c in range(self.L + 1)]

    def slices(self, n: int, g: int) -> list[tuple[int, int]]:
        """[lo, hi) of each local rank of host g (its contiguous columns) in n elements."""
        b = self.bounds(n)
        return [(b[c0], b[c1]) for c0, c1 in (self.col_range(g, q) for q in range(self.n[g]))]

    def rs_members(self, i: int) -> tuple:
        """Owners of reduce-scatter/all-gather column i, in host order."""
        return tuple(h[i % len(h)] for h in self.hosts)

    # ------------------------------------------------------------------ helper thread
    def pools(self) -> list:
        with self._lock:
            if not self._pools:
                self._pools = [concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"linerate-2level-{self.rank}-{i}") for i in range(2)]
            return self._pools

    def close(self) -> None:
        with self._lock:
            for pool in self._pools:
                pool.shutdown(wait=False)
            self._pools = []


def _local(comm, plan: Plan, engine):
    """This host's ranks as a SubComm on the host's segment; None for a rank alone."""
    if len(plan.local) < 2:
        return None
    loc = comm.sub(plan.local, LOCAL_TAG)
    loc.shm = engine
    return loc


def _between(op: str, sub, nbytes: int, small_bytes: int) -> str:
    """The algorithm of an inter-host phase: the table's size rule for the phase's ranks, one
    per host (collectives/algorithms.py)."""
    return algorithms.size_rule(op, nbytes, sub.size, small_bytes)


def _ar(sub, x: torch.Tensor, op, small_bytes: int) -> None:
    """Inter-host all-reduce of one column slice among its owners."""
    name = _between("all_reduce", sub, x.numel() * x.element_size(), small_bytes)
    algorithms.implementation(name, "all_reduce")(sub, x, op)


def _chunks(n: int, es: int) -> list[tuple[int, int]]:
    """(offset, length) of the pipeline's chunks of n elements: PIPE_BYTES each (at most
    MAX_CHUNKS of them, larger beyond), and the first and the last a quarter of that: only the local reduce-scatter of the
    first and the local all-gather of the last are not overlapped by an inter-host phase."""
    per = max(1, PIPE_BYTES // es, -(-n // MAX_CHUNKS))
    if n <= 2 * per:
        sizes = [min(per, n - o) for o in range(0, n, per)]
    else:
        edge = per // 4
        mid = n - 2 * edge
        k = -(-mid // per)
        sizes = [edge] + [mid // k + (1 if i < mid % k else 0) for i in range(k)] + [edge]
    out, o = [], 0
    for ln in sizes:
        out.append((o, ln))
        o += ln
    return out


def _wait_futures(comm, futures) -> None:
    """Wait for the helper thread's work of this op (also after a failure here: it must not
    touch the tensors once the op returned)."""
    for f in futures:
        try:
            f.result(timeout=max(0.0, comm.deadline - time.monotonic()) + 5.0)
        except BaseException:  # noqa: BLE001 - the first failure is already being raised
            pass


# ---------------------------------------------------------------------------- all_reduce
def all_reduce(comm, flat: torch.Tensor, op, plan: Plan, engine, small_bytes: int) -> None:
    """In place on a contiguous 1-D tensor; AVG sums (the caller divides).

    Chaining (large tensors; the worker offers it, Comm ``chain_next`` / ``before_tail``):
    once this op's local reduce-scatters ran and its inter-host phases are queued on the
    helper threads, the host's ranks agree (on the segment) whether each has the next op,
    another chainable all_reduce, queued already. If all have, this op returns with its tail
    (waiting for the inter-host phases, the local all-gathers) left in ``comm.deferred_tail``:
    the next op runs its own local reduce-scatters and queues its inter-host phases first, then
    runs this tail (``before_tail``), so the host's links carry the next op's first chunks while
    this op's last ones are gathered (the pipeline's ends do not leave the links idle between
    the ops: DDP's buckets). Every rank of a host runs the same local phases in the same
    order: the tail runs on the segment under the next op's local view."""
    comm.algorithm = "two_level"
    loc = _local(comm, plan, engine)
    n = flat.numel()
    es = flat.element_size()
    subs = [(c0, c1, comm.sub(members, c0 + 1)) for c0, c1, members in plan.runs]
    if n * es <= small_bytes:
        _run_before_tail(comm, loc)
        _small(loc, subs, flat, op)
        return
    chunks = _chunks(n, es)
    done = None
    if len(chunks) > 2:  # the pipeline's or one chunk (PipeChoice)
        pipe, counted = plan.pipe.next_op(lambda vals: _exchange(loc, subs, vals))
        if not pipe:
            chunks = [(0, n)]
        t0 = time.perf_counter()

        def done() -> None:
            if counted:
                plan.pipe.note(pipe, (time.perf_counter() - t0) / (n * es))
    mine = []   # per chunk: this rank's slices of it
    # Chunk k's inter-host phase runs on helper thread k % 2 with the column groups of that
    # parity: the end of one chunk's rings overlaps the start of the next one's.
    both = (subs, [(c0, c1, comm.sub(members, c0 + 1 + MAX_COLUMNS))
                   for c0, c1, members in plan.runs])
    for p in (0, 1):
        for _, _, s in both[p]:
            s.scratch = plan.scratch[p]

    def inter(k: int) -> None:
        o, ln = chunks[k]
        b = plan.bounds(ln)
        for c0, c1, sub in both[k % 2]:
            _ar(sub, flat[o + b[c0]:o + b[c1]], op, small_bytes)

    pools = plan.pools()
    futures = []
    deferred = in_tail = False
    try:
        for k, (o, ln) in enumerate(chunks):
            x = flat[o:o + ln]
            sl = plan.slices(ln, plan.h)
            mine.append(sl)
            if loc is not None:
                lo, hi = sl[plan.j]
                shm_algos.reduce_scatter_v(loc, [x[a:b] for a, b in sl], [b - a for a, b in sl],
                                           x[lo:hi], op)
            futures.append(pools[k % 2].submit(inter, k))
        _run_before_tail(comm, loc)  # the op before this one ends now (chained: see above)
        if _agree_chain(comm, loc):
            deferred = True
            # (run without the next op's local view, where that op failed first: this one's)
            comm.deferred_tail = lambda loc_now: _tail(comm, flat, chunks, mine, futures,
                                                       loc if loc_now is None else loc_now,
                                                       done=done)
            return
        # Not yet queued everywhere (DDP's next bucket is still being computed): asked again
        # before the last chunk's local all-gather, which the next op may then follow.
        in_tail = True  # which reports its own failures
        deferred = _tail(comm, flat, chunks, mine, futures, loc, late=True, done=done)
    except BaseException as e:
        if futures and not in_tail and not isinstance(e, TransportError):
            # the peers (and this rank's helper threads, whose rings wait on them) hear of it
            # now, not after the helpers' waits ran out
            comm.ctx.report_error(f"rank {comm.rank}: {comm.desc} failed: {e}")
        _wait_futures(comm, futures)
        raise
    finally:
        if not deferred:  # the helpers of a deferred tail still use the scratch
            for sc in plan.scratch:
                sc.trim(comm.ctx.options.keep_bytes)


def _tail(comm, flat: torch.Tensor, chunks, mine, futures, loc, late: bool = False,
          done=None) -> bool:
    """An all_reduce's end: each chunk's inter-host phase awaited, then its local all-gather
    (on ``loc``: this op's local view, or the chained next op's). ``late``: before the last
    chunk's all-gather the host's ranks agree whether to chain the next op there (then it is
    left in ``comm.deferred_tail``); returns whether it was. ``done()``: called once the
    all_reduce's last all-gather ran."""
    try:
        for k, (o, ln) in enumerate(chunks):
            left = comm.deadline - time.monotonic()
            try:
                futures[k].result(timeout=max(0.0, left))
            except concurrent.futures.TimeoutError:
                raise OpTimeout(f"rank {comm.rank}: {comm.desc} did not complete within the "
                                f"{comm.timeout:.1f}s timeout: its inter-host phase (chunk {k} of "
                                f"{len(chunks)}) had not finished") from None
            if late and k == len(chunks) - 1 and _agree_chain(comm, loc):
                comm.deferred_tail = lambda loc_now: _tail(
                    comm, flat, chunks[k:], mine[k:], futures[k:],
                    loc if loc_now is None else loc_now, done=done)
                return True
            if loc is not None:
                x = flat[o:o + ln]
                shm_algos.gather_v(loc, [x[a:b] for a, b in mine[k]])
    except BaseException as e:
        if not isinstance(e, TransportError):
            comm.ctx.report_error(f"rank {comm.rank}: {comm.desc} failed: {e}")
        _wait_futures(comm, futures)
        raise
    if done is not None:
        done()
    return False


def _small(loc, subs, flat: torch.Tensor, op) -> None:
    """The small all_reduce, in place: a shared-memory all_reduce on the host's ranks, then
    the host's sum (the same bits on each of its ranks) folded over hosts in host order with
    each of this rank's column groups: the same result from each; a rank with several keeps
    the first."""
    if loc is not None:
        shm_algos.all_reduce(loc, flat, op)
    host_sum = flat.clone() if len(subs) > 1 else None
    for k, (_, _, sub) in enumerate(subs):
        direct.all_reduce(sub, flat if k == 0 else host_sum.clone(), op)


def _exchange(loc, subs, vals: list[float]) -> list[float]:
    """``vals`` summed over the group's ranks by the small all_reduce (the same bits on every
    rank). Within an all_reduce, before its first chunk: PipeChoice's agreements."""
    t = torch.tensor(vals, dtype=torch.float64)
    _small(loc, subs, t, RedOpType.SUM)
    return t.tolist()


def _run_before_tail(comm, loc) -> None:
    """The chained previous op's tail (Comm ``before_tail``), run here on this op's local view."""
    fn = comm.before_tail
    if fn is not None:
        comm.before_tail = None
        fn(loc)


def _agree_chain(comm, loc) -> bool:
    """Whether every rank of this host has the next op, a chainable all_reduce, queued
    (``comm.chain_next()``; no offer: False without a round). One small round on the
    segment: the same answer on each of the host's ranks."""
    offer = comm.chain_next
    if offer is None:
        return False
    want = torch.tensor([1 if offer() else 0], dtype=torch.int32)
    if loc is not None:
        shm_algos.all_reduce(loc, want, RedOpType.MIN)
    return bool(want[0])


# ---------------------------------------------------------------------------- reduce_scatter
def reduce_scatter(comm, segs: list[torch.Tensor], out: torch.Tensor, op, plan: Plan, engine,
                   small_bytes: int) -> None:
    """Rank p gets the reduction of every rank's ``segs[p]`` in ``out`` (segs read only; all
    of out's size). AVG sums (the caller divides)."""
    comm.algorithm = "two_level"
    loc = _local(comm, plan, engine)
    m = out.numel()
    H, hosts = plan.H, plan.hosts

    def column(i: int):
        """The group ranks whose segments form column i, in host order (None: host has none)."""
        return [hosts[g][i] if i < plan.n[g] else None for g in range(H)]

    # This host's local reduce-scatter: rank q of the host gets, for each of its columns, the
    # host's partial of every segment of the column (host order), laid out one after another.
    def share(q: int) -> list:
        return [p for i in range(plan.L) if i % plan.n[plan.h] == q
                for p in column(i) if p is not None]

    mine = share(plan.j)
    stage = comm.scratch.get(3, len(mine) * m, out.dtype)
    if loc is not None:
        shares = [share(q) for q in range(len(plan.local))]
        shm_algos.reduce_scatter_v(loc, [shm_algos.Cat([segs[p] for p in s]) for s in shares],
                                   [len(s) * m for s in shares], stage, op)
    else:
        for k, p in enumerate(mine):
            stage[k * m:(k + 1) * m].copy_(segs[p])
    off = 0
    for i in plan.cols:
        col = column(i)
        parts = []
        for p in col:
            parts.append(stage[off:off + m] if p is not None else stage[:0])
            off += m if p is not None else 0
        sub = comm.sub(plan.rs_members(i), RS_TAG + i)
        if _between("reduce_scatter", sub, len(col) * m * out.element_size(),
                    small_bytes) == "direct":
            _direct_rs(sub, parts, op)
        else:
            ring.reduce_scatter(sub, parts, op)  # in place, as the stage allows
        if col[plan.h] == comm.rank:
            out.copy_(parts[plan.h])


def _direct_rs(sub, parts: list[torch.Tensor], op) -> None:
    """direct.reduce_scatter in place: sub-rank g's ``parts[g]`` receives the reduction."""
    me = sub.rank
    res = torch.empty_like(parts[me])
    direct.reduce_scatter(sub, parts, res, op)
    parts[me].copy_(res)


# ---------------------------------------------------------------------------- all_gather
def all_gather(comm, segs: list[torch.Tensor], plan: Plan, engine, small_bytes: int) -> None:
    """``segs[q]`` receives rank q's contribution; ``segs[me]`` holds this rank's."""
    comm.algorithm = "two_level"
    loc = _local(comm, plan, engine)
    H, hosts = plan.H, plan.hosts
    empty = segs[comm.rank][:0]
    for i in plan.cols:
        col = [hosts[g][i] if i < plan.n[g] else None for g in range(H)]
        parts = [segs[p] if p is not None else empty for p in col]
        sub = comm.sub(plan.rs_members(i), RS_TAG + i)
        name = _between("all_gather", sub, sum(x.numel() for x in parts) * empty.element_size(),
                        small_bytes)
        algorithms.implementation(name, "all_gather")(sub, parts)
    if loc is not None:
        shares = []
        for q in range(len(plan.local)):
            shares.append(shm_algos.Cat([segs[hosts[g][i]] for i in range(plan.L)
                                         if i % plan.n[plan.h] == q
                                         for g in range(H) if i < plan.n[g]]))
        shm_algos.gather_v(loc, shares)


# ---------------------------------------------------------------------------- rooted
def broadcast(comm, t: torch.Tensor, root: int, plan: Plan, engine, small_bytes: int) -> None:
    comm.algorithm = "two_level"
    loc = _local(comm, plan, engine)
    hr = next(g for g, h in enumerate(plan.hosts) if root in h)
    n = t.numel()
    if plan.h == hr and loc is not None:
        shm_algos.broadcast(loc, t, plan.local.index(root))
    b = plan.bounds(n)
    for c0, c1, members in plan.runs:
        sub = comm.sub(members, c0 + 1)
        x = t[b[c0]:b[c1]]
        name = _between("broadcast", sub, x.numel() * x.element_size(), small_bytes)
        algorithms.implementation(name, "broadcast")(sub, x, hr)
    if plan.h != hr and loc is not None:
        shm_algos.gather_v(loc, [t[lo:hi] for lo, hi in plan.slices(n, plan.h)])


def reduce(comm, flat: torch.Tensor, op, root: int, plan: Plan, engine, small_bytes: int) -> None:
    """Result in ``flat`` on the root; other ranks' ``flat`` is not modified. AVG sums."""
    comm.algorithm = "two_level"
    loc = _local(comm, plan, engine)
    hr = next(g for g, h in enumerate(plan.hosts) if root in h)
    n = flat.numel()
    sl = plan.slices(n, plan.h)
    lo, hi = sl[plan.j]
    part = comm.scratch.get(3, hi - lo, flat.dtype)
    if loc is not None:
        shm_algos.reduce_scatter_v(loc, [flat[a:b] for a, b in sl], [b - a for a, b in sl],
                                   part, op)
    else:
        part.copy_(flat[lo:hi])
    b = plan.bounds(n)
    for c0, c1, members in plan.runs:
        sub = comm.sub(members, c0 + 1)
        x = part[b[c0] - lo:b[c1] - lo]
        name = _between("reduce", sub, x.numel() * x.element_size(), small_bytes)
        algorithms.implementation(name, "reduce")(sub, x, op, hr)
    if plan.h == hr:
        if loc is not None:
            # the root receives every slice into its flat; each rank sends its part (a non-root
            # rank's flat is only named for its length: it reads nothing into it)
            segs = [part if q == plan.j else flat[a:b] for q, (a, b) in enumerate(sl)]
            shm_algos.gather_v(loc, segs, plan.local.index(root))
        if comm.rank == root:
            flat[lo:hi].copy_(part)


# ---------------------------------------------------------------------------- fusion
def agree(comm, entries: list, offered: int, carry_bytes: int, plan: Plan,
          engine) -> tuple[int, bool]:
    """collectives.fusion.agree in two levels: the host's ranks agree on the segment
    (shm_algos.agree: the least count, the calls' digests compared), then each rank with its
    column groups over TCP (fusion.agree: the least count over hosts, digests compared; each
    group has one rank per host, so every pair of ranks is compared through a host). On even
    layouts the head entry of up to ``carry_bytes`` travels along: summed over the host on
    the segment, then over hosts in host order: the small two-level all_reduce, in the same
    two rounds. (Uneven layouts, where a rank may be in several column groups, carry nothing.)"""
    comm.algorithm = "two_level"
    even = len(set(plan.n)) == 1
    carry = carry_bytes if even else -1  # the same on every rank
    loc = _local(comm, plan, engine)
    k, done = offered, False
    if loc is not None:
        k, done = shm_algos.agree(loc, entries, offered, carry, avg_size=0)
    from .fusion import agree as agree_tcp
    for c0, _, members in plan.runs:
        k, done = agree_tcp(comm.sub(members, c0 + 1), entries, k, carry, avg_size=comm.size)
    return k, done
