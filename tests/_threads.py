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
``torch.distributed``'s functions, whose default group is one per process.
"""
from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_GROUPS = itertools.count()


class ThreadRankError(AssertionError):
    pass


def sync(**fields):
    """Options for a synchronous call (torch's ``async_op=False``)."""
    return _opts(dist.AllreduceOptions, asyncOp=False, **fields)


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def run_threads(fn, world: int, *, timeout: float = 120.0, op_timeout: float = 60.0,
                options=None, gloo_groups: bool = False, env: dict | None = None,
                monkeypatch=None) -> list:
    """``fn(pg, rank)`` (or ``fn(pg, gloo, rank)``) on ``world`` thread ranks; their results.
    ``options``: a ``linerate.Options`` for every group (else the environment's, with ``env``
    set through ``monkeypatch``).

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

    def rank_main(r: int) -> None:
        try:
            pg = ProcessGroupLinerate(dist.PrefixStore(name, store), r, world,
                                      timedelta(seconds=op_timeout),
                                      None if options is None else options.copy(),
                                      group_name=name)
            pgs[r] = pg
            if gloo_groups:
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
    for pg in pgs:
        if pg is not None:
            try:
                pg.abort() if late or errors else pg.shutdown()
            except Exception:  # noqa: BLE001 - teardown
                pass
    if late:
        raise ThreadRankError(f"ranks {late} still running after {timeout:.0f}s"
                              + (f"; errors: {errors}" if errors else ""))
    if errors:
        r = min(errors)
        raise ThreadRankError(f"rank {r} failed: {type(errors[r]).__name__}: {errors[r]}") \
            from errors[r]
    return results


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
