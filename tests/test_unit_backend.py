"""The process group with threads as ranks (tests/_threads.py): every collective against a
reference on the same inputs (Gloo's, where Gloo implements the op and dtype; else the inputs
folded here), the scheduler, dispatch, validation and the failure paths, in seconds.

These are the ``unit`` tier: ``pytest -m unit``."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from _threads import ThreadRankError, fold as _fold, ones_like_rank, outcomes, run_threads, sync

pytestmark = pytest.mark.timeout(120)  # ranks as threads: the unit tier (tests/_tiers.py)

R = dist.ReduceOp
SIZES = (0, 1, 7, 1001, 70001)       # 70001 float32: above LINERATE_SMALL_BYTES (pipelined)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64)
GLOO_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def _options(shm: bool, **kw):
    import linerate
    o = linerate.Options(**kw)
    o.transport.shm = "auto" if shm else "0"
    return o


def _ops_for(dtype):
    if dtype == torch.bool:
        return (R.SUM, R.MIN, R.MAX, R.BOR, R.BAND, R.BXOR)
    if dtype.is_complex:
        return (R.SUM, R.PRODUCT, R.AVG)
    if dtype.is_floating_point:
        return (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)
    return (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)


def _same(got, want, op=None):
    if op == R.AVG or got.dtype in (torch.float16, torch.bfloat16) and op == R.PRODUCT:
        return torch.allclose(got.double() if not got.is_complex() else got,
                              want.to(got.dtype).double() if not got.is_complex() else want,
                              rtol=1e-2, atol=1e-2)
    return torch.equal(got, want.to(got.dtype))


def _every_collective(pg, gloo, r, P):
    """Runs every collective on this rank; returns the list of what differed."""
    bad = []
    for n in SIZES:
        for dt in DTYPES:
            xs = [ones_like_rank((n,), dt, q) for q in range(P)]
            big = n == SIZES[-1]
            for op in (_ops_for(dt) if not big else (R.SUM,)):
                t = xs[r].clone()
                pg.allreduce([t], sync(reduceOp=op)).wait()
                if not _same(t, _fold(xs, op), op):
                    bad.append(f"all_reduce {dt} n={n} {op}")
            if big and dt not in (torch.float32, torch.int64):
                continue
            # broadcast and reduce from the last rank
            root = P - 1
            t = xs[r].clone()
            o = dist.BroadcastOptions(); o.rootRank = root
            pg.broadcast([t], o).wait()
            if not torch.equal(t, xs[root]):
                bad.append(f"broadcast {dt} n={n}")
            if dt != torch.complex64:
                t = xs[r].clone()
                o = dist.ReduceOptions(); o.rootRank = root; o.reduceOp = R.MAX
                pg.reduce([t], o).wait()
                if r == root and not torch.equal(t, _fold(xs, R.MAX)):
                    bad.append(f"reduce {dt} n={n}")
            # all_gather (list and into one tensor)
            outs = [torch.empty((n,), dtype=dt) for _ in range(P)]
            pg.allgather([outs], [xs[r].clone()]).wait()
            if not all(torch.equal(outs[q], xs[q]) for q in range(P)):
                bad.append(f"all_gather {dt} n={n}")
            flat = torch.empty((P * n,), dtype=dt)
            pg.all_gather_single(flat, xs[r].clone()).wait()
            if not torch.equal(flat, torch.cat(xs)):
                bad.append(f"all_gather_into_tensor {dt} n={n}")
            # reduce_scatter: rank q gets the SUM of every rank's q-th part
            parts = [[ones_like_rank((n,), dt, 10 * q + i) for i in range(P)] for q in range(P)]
            if dt != torch.bool:
                out = torch.empty((n,), dtype=dt)
                o = dist.ReduceScatterOptions(); o.reduceOp = R.SUM
                pg.reduce_scatter([out], [[p.clone() for p in parts[r]]], o).wait()
                if not _same(out, _fold([parts[q][r] for q in range(P)], R.SUM)):
                    bad.append(f"reduce_scatter {dt} n={n}")
                out = torch.empty((n,), dtype=dt)
                pg.reduce_scatter_single(out, torch.cat(parts[r]), o).wait()
                if not _same(out, _fold([parts[q][r] for q in range(P)], R.SUM)):
                    bad.append(f"reduce_scatter_tensor {dt} n={n}")
            # all_to_all_single, even splits: rank q's i-th block goes to rank i
            inp = torch.cat(parts[r])
            out = torch.empty_like(inp)
            pg.all_to_all_single(out, inp, [], [], dist.AllToAllOptions()).wait()
            if not torch.equal(out, torch.cat([parts[q][r] for q in range(P)])):
                bad.append(f"all_to_all_single {dt} n={n}")
            # gather and scatter to / from rank 0
            outs = [torch.empty((n,), dtype=dt) for _ in range(P)] if r == 0 else []
            o = dist.GatherOptions(); o.rootRank = 0
            pg.gather([outs] if r == 0 else [], [xs[r].clone()], o).wait()
            if r == 0 and not all(torch.equal(outs[q], xs[q]) for q in range(P)):
                bad.append(f"gather {dt} n={n}")
            out = torch.empty((n,), dtype=dt)
            o = dist.ScatterOptions(); o.rootRank = 0
            pg.scatter([out], [[x.clone() for x in xs]] if r == 0 else [], o).wait()
            if not torch.equal(out, xs[r]):
                bad.append(f"scatter {dt} n={n}")
        pg.barrier(dist.BarrierOptions()).wait()
    # Gloo on the same inputs, where it implements the op
    for dt in GLOO_DTYPES:
        xs = [ones_like_rank((1001,), dt, q) for q in range(P)]
        for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX):
            a, b = xs[r].clone(), xs[r].clone()
            pg.allreduce([a], sync(reduceOp=op)).wait()
            o = dist.AllreduceOptions(); o.reduceOp = op
            gloo.allreduce([b], o).wait()
            if not torch.equal(a, b):
                bad.append(f"all_reduce {dt} {op} differs from Gloo's")
    return bad


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_every_collective_dtype_op_and_size(P, shm):
    res = run_threads(lambda pg, gloo, r: _every_collective(pg, gloo, r, P), P,
                      gloo_groups=True, options=_options(shm), timeout=110)
    assert res == [[]] * P, res


@pytest.mark.parametrize("algo, rooted", [("ring", "chain"), ("direct", "direct"),
                                          ("hd", "tree"), ("doubling", "tree"),
                                          ("two_level", "two_level")])
def test_every_forced_algorithm_gives_gloos_result(algo, rooted):
    P = 3

    def fn(pg, gloo, r):
        got = []
        for n in (5, 70001):
            a = ones_like_rank((n,), torch.float32, r)
            b = a.clone()
            pg.allreduce([a], sync()).wait()
            gloo.allreduce([b]).wait()
            got.append(torch.equal(a, b))
            outs = [torch.empty(n) for _ in range(P)]
            pg.allgather([outs], [ones_like_rank((n,), torch.float32, r)]).wait()
            got.append(all(torch.equal(outs[q], ones_like_rank((n,), torch.float32, q))
                           for q in range(P)))
            t = ones_like_rank((n,), torch.float32, r)
            o = dist.BroadcastOptions(); o.rootRank = 1
            pg.broadcast([t], o).wait()
            got.append(torch.equal(t, ones_like_rank((n,), torch.float32, 1)))
        return got

    for shm in (True, False):
        res = run_threads(fn, P, gloo_groups=True,
                          options=_options(shm, allreduce_algo=algo, rooted_algo=rooted,
                                           fusion_bytes=0))
        assert all(all(x) for x in res), (shm, res)


# ----------------------------------------------------------------------------- the scheduler
def test_sync_calls_run_in_the_callers_thread_async_ones_on_the_worker():
    def fn(pg, r):
        seen = []
        real = pg._run._execute

        def spy(op):
            seen.append((op.name, threading.current_thread().name.startswith("rank")))
            real(op)
        pg._run._execute = spy
        t = torch.ones(100000)  # not fusable: above LINERATE_FUSION_BYTES below
        pg.allreduce([t], sync()).wait()
        w = pg.allreduce([t])                 # async: the worker
        w.wait()
        pg._run._execute = real
        return seen

    import linerate
    res = run_threads(fn, 2, options=linerate.Options(fusion_bytes=1024))
    for seen in res:
        assert seen == [("all_reduce", True), ("all_reduce", False)], seen


def test_async_small_all_reduces_fuse_and_agree():
    def fn(pg, r):
        ts = [torch.full((10 + i,), float(r + i)) for i in range(50)]
        works = [pg.allreduce([t]) for t in ts]
        for w in works:
            w.wait()
        ok = all(torch.equal(t, torch.full((10 + i,), float(2 * i + 1))) for i, t in enumerate(ts))
        return ok, pg.fusion_stats["calls"], pg.fusion_stats["ops"]

    import linerate
    # a long cycle: the calls issued back to back are all queued before the run closes
    for ok, calls, ops in run_threads(fn, 2, options=linerate.Options(cycle_ms=2000)):
        assert ok and calls == 50 and ops < 50, (ok, calls, ops)


def _lone_spy(pg):
    """Counts the calls that took the lone all_reduce's way (runner.lone_all_reduce)."""
    seen = [0]
    real = pg._run._run_lone

    def spy(name, *a, **k):
        work = real(name, *a, **k)
        seen[0] += name == "all_reduce" and work is not None
        return work
    pg._run._run_lone = spy
    return seen


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_lone_small_all_reduces_take_the_short_way_and_agree_with_fused_peers(P, shm):
    """Rank 0 calls synchronous small all_reduces (the lone way: runner.lone_all_reduce, on
    the segment or over TCP links); the other ranks
    issue the same calls asynchronously, queued and fused on their worker: every call runs
    alone on rank 0 and fused with nothing on the others (the least count offered), every result
    is the fold in rank order, the same bits on every rank, for every dtype and op."""
    def fn(pg, r):
        seen = _lone_spy(pg)
        calls = [(n, dt, op) for n in ((0,), (1,), (7,), (1001,), (0, 2), (3, 5)) for dt in DTYPES
                 for op in _ops_for(dt)]
        ts, works = [], []
        for i, (n, dt, op) in enumerate(calls):
            t = ones_like_rank(n, dt, r + i)
            if r == 0:
                pg.allreduce([t], sync(reduceOp=op)).wait()
            else:
                o = dist.AllreduceOptions()
                o.reduceOp = op
                works.append(pg.allreduce([t], o))
            ts.append(t)
        for w in works:
            w.wait()
        bad = [f"{c}" for i, (c, t) in enumerate(zip(calls, ts))
               if not _same(t, _fold([ones_like_rank(c[0], c[1], q + i) for q in range(P)],
                                     c[2]), c[2])]
        return bad, seen[0], len(calls), [t.clone() for t in ts]

    res = run_threads(fn, P, options=_options(shm, cycle_ms=50))
    for r, (bad, lone, ncalls, _) in enumerate(res):
        assert bad == [], (r, bad)
        assert lone == (ncalls if r == 0 else 0), (r, lone, ncalls)
    for i, t in enumerate(res[0][3]):  # the same bits on every rank
        for r in range(1, P):
            assert t.view(-1).view(torch.uint8).tolist() == \
                res[r][3][i].view(-1).view(torch.uint8).tolist(), (i, r)


def test_lone_way_is_taken_only_where_it_applies():
    """The lone way takes a synchronous call of one small contiguous CPU tensor, on a one-host
    group's segment and over a TCP-only group's links; a larger tensor, a non-contiguous one,
    an async call, LINERATE_FUSION_BYTES=0 and a forced algorithm go the general way, with
    the same results."""
    def fn(pg, r):
        seen = _lone_spy(pg)
        out = []
        for t, o in ((torch.full((8,), float(r)), sync()),
                     (torch.full((100000,), float(r)), sync()),          # above carry bytes
                     (torch.full((8, 2), float(r)).t(), sync()),         # not contiguous
                     (torch.full((8,), float(r)), None)):                # async
            w = pg.allreduce([t], o) if o is not None else pg.allreduce([t])
            w.wait()
            out.append(bool((t == 1.0).all()))
        return seen[0], out

    import linerate
    for opts in (None, _options(False)):
        for lone, out in run_threads(fn, 2, options=opts):
            assert (lone, out) == (1, [True] * 4), (lone, out)
    for opts in (linerate.Options(fusion_bytes=0), linerate.Options(allreduce_algo="ring"),
                 _options(False, allreduce_algo="ring")):
        for lone, out in run_threads(fn, 2, options=opts):
            assert (lone, out) == (0, [True] * 4), (lone, out)


# ----------------------------------------------------------------------------- validation
def test_bad_input_is_refused_on_the_callers_rank_and_the_group_stays_usable():
    def fn(pg, r):
        errors = []
        if r == 0:
            for call in (lambda: pg.allreduce([torch.ones(3, dtype=torch.float32)],
                                              sync(reduceOp=R.BAND)),
                         lambda: pg.allreduce([torch.ones(1).expand(4)], sync()),
                         lambda: pg.broadcast([torch.ones(3)], _root(7))):
                try:
                    call()
                except (ValueError, TypeError) as e:
                    errors.append(str(e))
        t = torch.full((4,), float(r))
        pg.allreduce([t], sync()).wait()   # the group still works
        return errors, t.tolist()

    res = run_threads(fn, 2)
    errors, t = res[0]
    assert len(errors) == 3, errors
    assert all(e.startswith("rank 0: ") for e in errors), errors
    assert "BAND" in errors[0] and "float32" in errors[0]
    assert "share memory" in errors[1]
    assert "root rank 7" in errors[2]
    assert t == [1.0] * 4 and res[1][1] == [1.0] * 4


def _root(r):
    o = dist.BroadcastOptions()
    o.rootRank = r
    return o


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_ranks_that_disagree_fail_naming_each_other(shm, fusion):
    """Synchronous all_reduces of other sizes: fused runs of one call (on one host: the lone
    way, runner.lone_all_reduce) and unfused ones."""
    def fn(pg, r):
        t = torch.ones(10 if r == 0 else 11)
        pg.allreduce([t], sync()).wait()

    o = _options(shm)
    if not fusion:
        o.fusion_bytes = 0
    res = outcomes(fn, 2, options=o, op_timeout=10)
    for r, e in enumerate(res):
        assert isinstance(e, Exception), (r, e)
        text = str(e)
        assert "all_reduce" in text and ("rank 0" in text and "rank 1" in text), (r, text)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_a_rank_that_never_calls_is_named_at_the_timeout_and_the_group_stays_broken(shm, tmp_path):
    import re
    import threading
    import time

    done = threading.Event()

    def fn(pg, r):
        if r == 1:  # never calls; stays in the group until rank 0 is done (or the test's end)
            done.wait(25)
            return None
        try:
            t = torch.ones(10)
            t0 = time.monotonic()
            try:
                pg.allreduce([t], sync()).wait()
            except RuntimeError as e:
                first, took = str(e), time.monotonic() - t0
            else:
                return "completed"
            try:
                pg.allreduce([t], sync()).wait()
            except RuntimeError as e:
                return first, took, str(e)
            return first, took, "second completed"
        finally:
            done.set()

    o = _options(shm, flight_dump=str(tmp_path / "fr"))
    first, took, second = outcomes(fn, 2, op_timeout=2.0, timeout=30, options=o)[0]
    assert re.search(r"waiting for ranks \[1\]|rank 1 has not entered", first), first
    assert first.startswith("rank 0: all_reduce #1") and "float32[10]" in first, first
    # Rank 1 is alive and answers: nothing says its host or link is down (the question the
    # timeout's diagnosis sends it is not data it failed to acknowledge).
    assert "acknowledged nothing" not in first, first
    # Rank 1 leaves only after rank 0 is done: the op timeout (2 s) ended the op, neither
    # early nor at the test's 30 s bound (12 s: room for a loaded machine).
    assert 1.9 <= took < 12, took
    assert "failed earlier" in second, second


def test_failures_reach_the_flight_recorder_once_per_op():
    def fn(pg, r):
        t = torch.ones(5)
        pg.allreduce([t], sync()).wait()
        pg.barrier(dist.BarrierOptions()).wait()
        return [(rec.op, rec.state) for rec in pg._flight.ring]

    for ops in run_threads(fn, 2):
        assert ops == [("all_reduce", "completed"), ("barrier", "completed")], ops


def test_run_threads_names_a_rank_that_raised():
    with pytest.raises(ThreadRankError, match="rank 1 failed: RuntimeError: boom"):
        run_threads(lambda pg, r: (_ for _ in ()).throw(RuntimeError("boom")) if r == 1 else None,
                    2)
