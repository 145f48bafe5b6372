"""Ranks as threads of this process: the unit tier's harness.

``run_threads(fn, world)`` makes one ``ProcessGroupLinerate`` per rank over an in-memory Store
(as torch's MultiThreadedTestCase does for its groups) and runs ``fn(pg, rank)`` in a thread
per rank; it returns each rank's result, or raises the first rank's exception (named) or a
timeout naming the ranks still running. The groups move bytes for real (shared memory between
the "ranks" of this process, or TCP on loopback with ``LINERATE_SHM=0`` / ``shm=False``), so
the scheduler, fusion, dispatch, validation and failure paths run as in a job, in milliseconds
and without starting a process. ``gloo_groups=True`` gives ``fn`` a Gloo group too
(``fn(pg, gloo, rank)``): the reference every result is compared with.

Calls go to the process group's methods (``pg.allreduce([t], opts)``), not to
``torch.distributed``'s functions, whose default group is one per process. ``as_dist=True``
gives ``fn(d, rank)`` a ``ThreadDist`` instead: ``torch.distributed``'s collective functions
for this rank (``d.all_reduce(t, op=..., group=d.lr)``), whose default group is the rank's
Gloo group, so that code written for rank processes (``dist.all_reduce(want)`` against
``dist.all_reduce(got, group=lr)``) runs unchanged on threads.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

_GROUPS = itertools.count()


class ThreadRankError(AssertionError):
    pass


def sync(**fields):
    """Options for a synchronous call (torch's ``async_op=False``)."""
    return _opts(_c10d.AllreduceOptions, asyncOp=False, **fields)


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def run_threads(fn, world: int, *, timeout: float = 120.0, op_timeout: float = 60.0,
                options=None, gloo_groups: bool = False, as_dist: bool = False,
                env: dict | None = None, monkeypatch=None, before=None) -> list:
    """``fn(pg, rank)`` (or ``fn(pg, gloo, rank)``, or ``fn(ThreadDist, rank)`` with
    ``as_dist``; ``as_dist="batched"``: its Gloo calls batched, ThreadDist.settle) on ``world``
    thread ranks; their results. ``options``: a ``linerate.Options`` for every group (else the environment's, with ``env``
    set through ``monkeypatch``). ``before(rank)`` runs first in each rank's thread (a test
    that places its thread ranks on hosts sets a thread-local there).

    ``timeout`` (the whole run) and ``op_timeout`` (the groups' timeout) only turn a hang into
    a failure: the ranks share one interpreter's lock, and on a loaded 2-core machine one rank
    may reach a collective many seconds after another, which is no fault. A test of timeouts
    passes a short ``op_timeout`` of its own."""
    from linerate.collectives.backend import ProcessGroupLinerate
    if env:
        assert monkeypatch is not None, "env needs the monkeypatch fixture"
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    store = dist.HashStore()
    name = f"t{next(_GROUPS)}"
    results: list = [None] * world
    errors: dict = {}
    pgs: list = [None] * world
    subs: list = []  # the groups ThreadDist.new_group makes

    def rank_main(r: int) -> None:
        _one_core()
        try:
            if before is not None:
                before(r)
            pg = ProcessGroupLinerate(dist.PrefixStore(name, store), r, world,
                                      timedelta(seconds=op_timeout),
                                      None if options is None else options.copy(),
                                      group_name=name)
            pgs[r] = pg
            if as_dist:
                gloo = gloo_group(dist.PrefixStore(name + "g", store), r, world, op_timeout)
                d = ThreadDist(pg, gloo, r, world, batched=as_dist == "batched",
                               store=store, name=name, timeout=op_timeout, subs=subs)
                results[r] = fn(d, r)
            elif gloo_groups:
                gloo = dist.ProcessGroupGloo(dist.PrefixStore(name + "g", store), r, world,
                                             timedelta(seconds=op_timeout))
                results[r] = fn(pg, gloo, r)
            else:
                results[r] = fn(pg, r)
        except BaseException as e:  # noqa: BLE001 - reported with the rank
            errors[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [r for r, t in enumerate(threads) if t.is_alive()]
    for pg in subs + pgs:
        if pg is not None:
            try:
                pg.abort() if late or errors else pg.shutdown()
            except Exception:  # noqa: BLE001 - teardown
                pass
    if late:
        raise ThreadRankError(f"ranks {late} still running after {timeout:.0f}s"
                              + (f"; errors: {errors}" if errors else ""))
    if errors:
        # Every rank's error: the first rank's may only be the consequence (a timeout waiting
        # for a rank that failed on its own).
        r = min(errors)
        raise ThreadRankError("; ".join(f"rank {q} failed: {type(e).__name__}: {e}"
                                        for q, e in sorted(errors.items()))) from errors[r]
    return results


def _one_core() -> None:
    """Run the calling thread, and the threads it starts (they inherit it), on one core of the
    process's (under pytest-xdist, each worker its own): thread ranks take turns at one
    interpreter lock, and where they run on several cores each hand-over of the lock is a
    futex wake-up across cores, several per collective per rank (a 16-rank matrix spent most
    of its time in the kernel that way). The test's own thread keeps the process's cores, and
    what reads the process's affinity (transport/shm/sync.py ``usable_cores``) sees them."""
    try:
        cores = sorted(os.sched_getaffinity(os.getpid()))
    except (AttributeError, OSError):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    os.sched_setaffinity(0, {cores[index % len(cores)]})


def gloo_group(store, rank: int, world: int, timeout: float):
    """A torch ProcessGroup over Gloo, as ``init_process_group("gloo")`` makes for a job."""
    gloo = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout))
    group = dist.ProcessGroup(store, rank, world)
    kind = dist.ProcessGroup.BackendType.GLOO
    group._register_backend(torch.device("cpu"), kind, gloo)
    group._set_default_backend(kind)
    return group


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _call_opts(cls, async_op: bool, **fields):
    """Options as torch's functions make them (``asyncOp`` where this torch has it)."""
    o = _opts(cls, **fields)
    if hasattr(o, "asyncOp"):
        o.asyncOp = async_op
    return o


def _alltoall_through_single(pg, outs, ins, opts):
    """Gloo's all_to_all of lists where it has none: the lists' bytes, one after another, in
    one all_to_all_single with a split per rank (as ThreadDist._exchange_all batches them),
    copied into the outputs before it returns; the bytes each rank gets are the ones the lists
    call would give it. Returns the finished Gloo work."""
    sends, recvs = [_bytes(t) for t in ins], [_into(t) for t in outs]
    recv = torch.empty(sum(b.numel() for b in recvs), dtype=torch.uint8)
    work = getattr(pg, _method("all_to_all_single", "alltoall_base"))(
        recv, _cat(sends or [torch.empty(0, dtype=torch.uint8)]),
        [b.numel() for b in recvs], [b.numel() for b in sends], opts)
    work.wait()
    _scatter_back(recv, recvs)
    return work


def _method(new: str, old: str) -> str:
    """The group method torch's functions call: 2.13's name, or the one before it."""
    return new if hasattr(dist.ProcessGroup, new) else old


class ThreadDist:
    """``torch.distributed``'s collective functions for one thread rank (``as_dist=True``).
    ``group=None`` is the rank's Gloo group (``gloo``), ``lr`` its linerate group. Each function
    prepares its call as torch's does (torch/distributed/distributed_c10d.py: the same options,
    complex tensors passed as their real views where torch does so, the same refusals) and
    calls the group's method; ranks are group ranks (every group spans the world).

    ``batched``: the Gloo calls (``group=None``, the reference) are kept until ``settle()``,
    which makes them as a few Gloo calls on their tensors concatenated: every reduction
    (all_reduce, reduce, reduce_scatter) with one op and dtype is one Gloo all_reduce (a
    reduce-scatter's output is its rank's part of it, a reduce's its root's), every data
    movement is bytes in one Gloo all_gather (broadcast, all_gather, gather) or all_to_all
    (scatter, all_to_all); a large call goes to Gloo at once (AT_ONCE_ELEMENTS). Collectives
    are elementwise, so each output is what Gloo gives the call alone, bit for bit where the
    reduction is exact (inputs of small integers), which
    tests/test_backend_collectives.py::test_the_batched_reference_is_gloos_result_call_by_call
    checks for every kind, dtype and op: a few Gloo calls instead of thousands (on threads,
    each Gloo call costs several thread wake-ups per rank). A caller reads a reference only
    after ``settle()`` (the calls on other groups run at once)."""

    ReduceOp = dist.ReduceOp

    def __init__(self, lr, gloo, rank: int, world: int, batched: bool = False, store=None,
                 name: str = "", timeout: float = 60.0, subs: list | None = None):
        self.lr, self.gloo, self.rank, self.world = lr, gloo, rank, world
        self._kept: list | None = [] if batched else None
        # for new_group: the run's Store, its name, the groups' timeout, and where the groups
        # it makes are kept (run_threads shuts them down)
        self._store, self._name, self._timeout = store, name, timeout
        self._subs = subs if subs is not None else []

    def _run(self, group, method: str, *args, async_op: bool = False, future: bool = False):
        if group is None and self._kept is not None and not _at_once(method, args):
            assert not async_op, "a batched reference call is synchronous"
            opts = args[-1]
            op = getattr(opts, "reduceOp", None)
            key = (method, str(getattr(op, "op", op)), getattr(opts, "rootRank", None))
            # The inputs as they are now: the call reads them now, not at settle() (the tensor
            # of an in-place one is the reference itself, which nothing else writes).
            ins = args[0] if method in _IN_PLACE else _copy(args[1])
            self._kept.append((key, args[:-1], ins, opts))
            return None
        pg = self.gloo if group is None else group
        try:
            work = getattr(pg, method)(*args)
        except RuntimeError as e:
            # torch before 2.12: Gloo takes no all_to_all of lists (every rank is refused alike)
            if method != "alltoall" or "does not support alltoall" not in str(e):
                raise
            work = _alltoall_through_single(pg, *args)
        if async_op:
            return work.get_future() if future else work
        if work is not None:
            work.wait()
        return None

    def get_rank(self, group=None) -> int:
        return self.rank

    def new_group(self, ranks: list) -> tuple:
        """A linerate and a Gloo group of ``ranks`` (their group ranks in that order), as
        ``new_group`` makes them: ``(lr, gloo)`` on a member, ``(None, None)`` elsewhere."""
        if self.rank not in ranks:
            return None, None
        from linerate.collectives.backend import ProcessGroupLinerate
        key = f"{self._name}s{'.'.join(map(str, ranks))}"
        me = ranks.index(self.rank)
        lr = ProcessGroupLinerate(dist.PrefixStore(key, self._store), me, len(ranks),
                                  timedelta(seconds=self._timeout), None, group_name=key)
        self._subs.append(lr)
        return lr, gloo_group(dist.PrefixStore(key + "g", self._store), me, len(ranks),
                              self._timeout)

    def get_world_size(self, group=None) -> int:
        return self.world

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.is_complex() and not dist.distributed_c10d.supports_complex(op):
            raise ValueError(f"all_reduce does not support {op} on complex tensors")
        o = _call_opts(_c10d.AllreduceOptions, async_op, reduceOp=op)
        return self._run(group, "allreduce", [_real(tensor)], o, async_op=async_op)

    def all_reduce_coalesced(self, tensors, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if any(t.is_complex() for t in tensors) and not dist.distributed_c10d.supports_complex(op):
            raise ValueError(f"all_reduce does not support {op} on complex tensors")
        o = _call_opts(_c10d.AllreduceCoalescedOptions, async_op, reduceOp=op)
        return self._run(group, "allreduce_coalesced", [_real(t) for t in tensors], o,
                         async_op=async_op, future=True)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        o = _call_opts(_c10d.BroadcastOptions, async_op, rootRank=src, rootTensor=0)
        return self._run(group, "broadcast", [_real(tensor)], o, async_op=async_op)

    def reduce(self, tensor, dst=0, op=dist.ReduceOp.SUM, group=None, async_op=False):
        o = _call_opts(_c10d.ReduceOptions, async_op, reduceOp=op, rootRank=dst)
        return self._run(group, "reduce", [tensor], o, async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        o = _call_opts(_c10d.AllgatherOptions, async_op)
        return self._run(group, "allgather", [[_real(t) for t in tensor_list]], [_real(tensor)],
                         o, async_op=async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        o = _call_opts(_c10d.AllgatherOptions, async_op)
        return self._run(group, _method("all_gather_single", "_allgather_base"),
                         _real(output_tensor), _real(input_tensor), o, async_op=async_op)

    def all_gather_coalesced(self, output_tensor_lists, input_tensor_list, group=None,
                             async_op=False):
        o = _call_opts(_c10d.AllgatherOptions, async_op)
        return self._run(group, "allgather_coalesced",
                         [[_real(t) for t in ts] for ts in output_tensor_lists],
                         [_real(t) for t in input_tensor_list], o, async_op=async_op, future=True)

    def gather(self, tensor, gather_list=None, dst=0, group=None, async_op=False):
        gather_list = gather_list or []
        if (self.rank == dst) != bool(gather_list):
            raise ValueError("gather_list must be given on the destination rank, and only there")
        o = _call_opts(_c10d.GatherOptions, async_op, rootRank=dst)
        return self._run(group, "gather", [gather_list] if self.rank == dst else [], [tensor], o,
                         async_op=async_op)

    def scatter(self, tensor, scatter_list=None, src=0, group=None, async_op=False):
        scatter_list = [_real(t) for t in scatter_list or []]
        if (self.rank == src) != bool(scatter_list):
            raise ValueError("scatter_list must be given on the source rank, and only there")
        o = _call_opts(_c10d.ScatterOptions, async_op, rootRank=src)
        return self._run(group, "scatter", [_real(tensor)],
                         [scatter_list] if self.rank == src else [], o, async_op=async_op)

    def reduce_scatter(self, output, input_list, op=dist.ReduceOp.SUM, group=None,
                       async_op=False):
        o = _call_opts(_c10d.ReduceScatterOptions, async_op, reduceOp=op)
        return self._run(group, "reduce_scatter", [output], [input_list], o, async_op=async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None,
                              async_op=False):
        o = _call_opts(_c10d.ReduceScatterOptions, async_op, reduceOp=op)
        return self._run(group, _method("reduce_scatter_single", "_reduce_scatter_base"),
                         output, input, o, async_op=async_op)

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        o = _call_opts(_c10d.AllToAllOptions, async_op)
        return self._run(group, "alltoall", [_real(t) for t in output_tensor_list],
                         [_real(t) for t in input_tensor_list], o, async_op=async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        o = _call_opts(_c10d.AllToAllOptions, async_op)
        return self._run(group, _method("all_to_all_single", "alltoall_base"),
                         _real(output), _real(input), list(output_split_sizes or []),
                         list(input_split_sizes or []), o, async_op=async_op)

    def barrier(self, group=None, async_op=False):
        if group is None:
            self.settle()
            group = self.gloo
        o = _call_opts(_c10d.BarrierOptions, async_op, device=torch.device("cpu"))
        return self._run(group, "barrier", o, async_op=async_op)

    # ------------------------------------------------------------------------- batched
    def settle(self) -> None:
        """Run the Gloo calls kept since the last settle, batched (see the class docstring):
        every reduction with one op and dtype in one Gloo all_reduce; the data movements as
        bytes, in one Gloo all_gather (broadcast, all_gather, gather) and one all_to_all
        (scatter, all_to_all). Every rank keeps the same calls in the same order, so every
        rank makes the same Gloo calls."""
        if not self._kept:
            return
        reductions: dict = {}
        gathered, exchanged = [], []
        for key, args, ins, opts in self._kept:
            method = _CANON.get(key[0], key[0])
            if method in _REDUCTIONS:
                dtype = next(t.dtype for t in _tensors(ins))
                reductions.setdefault((key[1], dtype), (opts.reduceOp, []))[1].append(
                    (method, args, ins))
            elif method in _GATHERED:
                gathered.append((method, args, ins, getattr(opts, "rootRank", None)))
            else:
                exchanged.append((method, args, ins, getattr(opts, "rootRank", None)))
        self._kept = []
        for op, calls in reductions.values():
            self._reduce_all(op, calls)
        if gathered:
            self._gather_all(gathered)
        if exchanged:
            self._exchange_all(exchanged)

    def _reduce_all(self, op, calls) -> None:
        """One all_reduce; a reduce-scatter's output is this rank's row of its inputs
        reduced."""
        P, pieces, outs = self.world, [], []
        for method, args, ins in calls:
            if method in _IN_PLACE:
                pieces.append(ins[0])
                outs.append(args[0][0])
            else:
                out = args[0][0] if method == "reduce_scatter" else args[0]
                rows = (torch.stack([t.reshape(-1) for t in ins[0]]) if method == "reduce_scatter"
                        else ins.reshape(P, out.numel()))
                pieces.append(rows)
                outs.append((out, out.numel()))
        flat = _cat(pieces)
        self._gloo("allreduce", [flat], _opts(_c10d.AllreduceOptions, reduceOp=op))
        off = 0
        for piece, out in zip(pieces, outs):
            n = piece.numel()
            if isinstance(out, tuple):  # this rank's row
                out, m = out
                out.copy_(flat[off + self.rank * m:off + (self.rank + 1) * m].view(out.shape))
            else:
                out.copy_(flat[off:off + n].view(out.shape))
            off += n

    def _gather_all(self, calls) -> None:
        """One all_gather of every rank's bytes: a broadcast takes its root's, a gather its
        root takes every rank's, an all_gather every rank's."""
        mine = [_bytes(ins[0] if method != "all_gather_single" else ins)
                for method, _, ins, _ in calls]
        flat = _cat(mine)
        rows = torch.empty((self.world, flat.numel()), dtype=torch.uint8)
        self._gloo(_method("all_gather_single", "_allgather_base"), rows.view(-1), flat,
                   _c10d.AllgatherOptions())
        off = 0
        for (method, args, _, root), b in zip(calls, mine):
            n = b.numel()
            if method == "broadcast":
                _into(args[0][0]).copy_(rows[root, off:off + n])
            elif method == "allgather" or (method == "gather" and self.rank == root):
                for q, t in enumerate(args[0][0]):
                    _into(t).copy_(rows[q, off:off + n])
            elif method == "all_gather_single":
                _into(args[0]).copy_(rows[:, off:off + n].reshape(-1))
            off += n

    def _exchange_all(self, calls) -> None:
        """One all_to_all of bytes: a scatter's root sends each rank its part, an all_to_all
        every rank."""
        P = self.world
        sends = [[] for _ in range(P)]
        recvs = [[] for _ in range(P)]
        for method, args, ins, root in calls:
            if method == "scatter":
                if self.rank == root:
                    for q in range(P):
                        sends[q].append(_bytes(ins[0][q]))
                recvs[root].append(_into(args[0][0]))
            elif method == "alltoall":
                for q in range(P):
                    sends[q].append(_bytes(ins[q]))
                    recvs[q].append(_into(args[0][q]))
            else:  # all_to_all_single: rows, as the splits say (equal without them)
                out, _, out_splits, in_splits = args
                for parts, t, splits, view in ((sends, ins, in_splits, _bytes),
                                               (recvs, out, out_splits, _into)):
                    rows = list(splits) or [t.shape[0] // P] * P
                    for q, piece in enumerate(t.split(rows)):
                        parts[q].append(view(piece))
        send = _cat([b for q in range(P) for b in sends[q]] or [torch.empty(0, dtype=torch.uint8)])
        recv = torch.empty(sum(b.numel() for r in recvs for b in r), dtype=torch.uint8)
        self._gloo(_method("all_to_all_single", "alltoall_base"), recv, send,
                   [sum(b.numel() for b in r) for r in recvs],
                   [sum(b.numel() for b in s) for s in sends], _c10d.AllToAllOptions())
        _scatter_back(recv, [b for r in recvs for b in r])

    def _gloo(self, method: str, *args) -> None:
        getattr(self.gloo, method)(*args).wait()


_REDUCTIONS = ("allreduce", "reduce", "reduce_scatter", "reduce_scatter_single")
_GATHERED = ("broadcast", "allgather", "all_gather_single", "gather")
#: The group methods of torch before 2.13, by their 2.13 names.
_CANON = {"_allgather_base": "all_gather_single", "_reduce_scatter_base": "reduce_scatter_single",
          "alltoall_base": "all_to_all_single"}
_IN_PLACE = ("allreduce", "broadcast", "reduce")
#: A reference call of at least this many elements per tensor goes to Gloo at once: it is not
#: latency-bound, and copying it in and out of a batch would cost more than it saves.
AT_ONCE_ELEMENTS = 1 << 16


def _at_once(method: str, args) -> bool:
    """Whether a reference call skips the batch: decided on a size every rank shares (the
    one tensor of an in-place call, the input of a gather or all-gather, the output of a
    scatter or reduce-scatter); all-to-alls, whose sizes may differ by rank, are batched."""
    if method in _IN_PLACE:
        t = args[0][0]
    elif method in ("allgather", "gather"):
        t = args[1][0]
    elif method in ("all_gather_single", "_allgather_base"):
        t = args[1]
    elif method in ("scatter", "reduce_scatter"):
        t = args[0][0]
    elif method in ("reduce_scatter_single", "_reduce_scatter_base"):
        t = args[0]
    else:
        return False
    return t.numel() >= AT_ONCE_ELEMENTS


def _copy(x):
    """``x`` with every tensor in it copied (nested lists kept)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    return [_copy(y) for y in x]


def _tensors(x):
    """The tensors in ``x`` (nested lists and tuples), in order."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (a view of them where ``t`` is contiguous, else a copy)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _into(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an output ``t``, to write: a view (a reference's outputs are contiguous)."""
    assert t.is_contiguous(), "a batched reference's output must be contiguous"
    return t.view(-1).view(torch.uint8)


def _cat(ts) -> torch.Tensor:
    """The tensors flattened, one after another, in one new contiguous tensor."""
    return torch.cat([t.reshape(-1) for t in ts])


def _scatter_back(flat: torch.Tensor, ts) -> None:
    """Copy ``flat``'s consecutive pieces into ``ts`` (their sizes, in order)."""
    off = 0
    for t in ts:
        n = t.numel()
        t.copy_(flat[off:off + n].view(t.shape))
        off += n


def outcomes(fn, world: int, **kw) -> list:
    """Like run_threads, but each rank's exception is its result (for failure tests)."""
    def wrapped(*args):
        try:
            return fn(*args)
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            return e
    return run_threads(wrapped, world, **kw)


def ones_like_rank(shape, dtype, rank: int) -> torch.Tensor:
    """A rank's distinct, exactly representable input (small integers, any dtype)."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    t = torch.randint(-3, 4, shape, generator=g)
    if dtype in (torch.uint8,):
        t = t.abs()
    return t.to(dtype)


def fold(xs, op):
    """The reduction of the ranks' inputs ``xs`` (tensors, in rank order) by ReduceOp ``op``:
    what every collective that reduces is checked against."""
    out = xs[0].clone()
    for x in xs[1:]:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            out = out | x if out.dtype == torch.bool else out + x
        elif op == dist.ReduceOp.PRODUCT:
            out = out & x if out.dtype == torch.bool else out * x
        elif op == dist.ReduceOp.MIN:
            out = torch.minimum(out, x)
        elif op == dist.ReduceOp.MAX:
            out = torch.maximum(out, x)
        elif op == dist.ReduceOp.BAND:
            out = out & x
        elif op == dist.ReduceOp.BOR:
            out = out | x
        elif op == dist.ReduceOp.BXOR:
            out = out ^ x
    if op == dist.ReduceOp.AVG:
        out = out / len(xs)
    return out
