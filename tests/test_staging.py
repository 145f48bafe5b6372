"""Pipelined staging of large device all_reduces (collectives/pipeline.py), with ranks as
threads: the stand-in copier (``pipeline.ThreadCopier``) makes CPU tensors take the pipelined
path, so that its chunking, ordering, buffer reuse, stream semantics and error paths are checked
here without a GPU; results against Gloo's (or the inputs folded here, for the dtypes and ops
Gloo lacks). The tests marked ``cuda`` run the same path with the real copier where a GPU is
(the unit tier of ``python -m linerate.tools.dev.gpu_check``).

These are the ``unit`` tier: ``pytest -m unit``."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from _threads import fold as _fold, ones_like_rank, outcomes, run_threads

import linerate
from linerate.collectives import pipeline

pytestmark = pytest.mark.timeout(120)  # ranks as threads: the unit tier (tests/_tiers.py)

R = dist.ReduceOp
CHUNK = 4096
#: Per dtype: sizes below the pipelined minimum (staged whole), a whole number of chunks, and
#: chunks with a partial last one.
COUNTS = (1500, 4096, 10007)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
GLOO_DTYPES = (torch.float32, torch.int64)


def _options(shm: bool = True, **kw):
    kw.setdefault("stage_chunk_bytes", CHUNK)
    kw.setdefault("stage_min_bytes", 2 * CHUNK)
    kw.setdefault("fusion_bytes", 0)
    o = linerate.Options(**kw)
    o.transport.shm = "auto" if shm else "0"
    return o


def _ops(dtype):
    if dtype.is_floating_point:
        return (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)
    return (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)


def _opts(op):
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


class Copiers:
    """A stand-in factory that keeps each rank's copier (by thread name: ``rank0``, ...) and
    makes them with ``kw`` (``log=True``: a log each), and ``per_rank[name]`` on top; only the
    ranks named in ``only`` get one (the others' groups stage whole)."""

    def __init__(self, only=None, per_rank=None, **kw):
        self.kw = kw
        self.only = only
        self.per_rank = per_rank or {}
        self.by_rank: dict = {}

    def __call__(self, device):
        name = threading.current_thread().name
        if self.only is not None and name not in self.only:
            return None
        kw = dict(self.kw, **self.per_rank.get(name, {}))
        if kw.get("log"):
            kw["log"] = []
        c = self.by_rank[name] = pipeline.ThreadCopier(device, **kw)
        return c


@pytest.fixture
def copiers():
    def install(**kw):
        c = Copiers(**kw)
        pipeline.install_standin(c)
        return c
    yield install
    pipeline.remove_standin()


# ----------------------------------------------------------------------------- results
def _every_case(pg, gloo, r, P):
    """Every dtype, op and size, issued back to back (async) and then waited for: the
    pipelined ops follow each other through the same buffers."""
    cases = []
    for dt in DTYPES:
        for n in COUNTS:
            xs = [ones_like_rank((n,), dt, q) for q in range(P)]
            for op in _ops(dt):
                t = xs[r].clone()
                cases.append((dt, n, op, xs, t, pg.allreduce([t], _opts(op))))
    bad = []
    for dt, n, op, xs, t, work in cases:
        work.wait()
        if dt in GLOO_DTYPES and op != R.AVG:
            want = xs[r].clone()
            gloo.allreduce([want], _opts(op)).wait()
        else:
            want = _fold(xs, op).to(dt)
        if not torch.equal(t, want):
            bad.append(f"{dt} n={n} {op}: max diff {(t.double() - want.double()).abs().max()}")
    return bad, pg.staging_stats


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("P", [2, 3])
def test_pipelined_all_reduce_matches_gloo(P, shm, copiers):
    copiers()
    res = run_threads(lambda pg, gloo, r: _every_case(pg, gloo, r, P), P, gloo_groups=True,
                      options=_options(shm), timeout=110)
    for bad, stats in res:
        assert bad == []
        # every case of at least two chunks took the pipelined path, the others were whole
        piped = sum(1 for dt in DTYPES for n in COUNTS if n * dt.itemsize >= 2 * CHUNK
                    for _ in _ops(dt))
        chunks = sum(-(-n * dt.itemsize // CHUNK) for dt in DTYPES for n in COUNTS
                     if n * dt.itemsize >= 2 * CHUNK for _ in _ops(dt))
        assert stats == {"cpu": {"ops": piped, "chunks": chunks, "buffers": 3,
                                 "buffer_bytes": CHUNK}}


def test_a_tensor_that_is_not_contiguous_is_reduced_in_place(copiers):
    copiers()

    def fn(pg, gloo, r):
        base = ones_like_rank((64, 300), torch.float32, r)
        keep = base.clone()
        view = base[:, ::2]                # 9600 floats, not contiguous
        want = view.contiguous()
        gloo.allreduce([want]).wait()
        pg.allreduce([view]).wait()
        untouched = torch.equal(base[:, 1::2], keep[:, 1::2])
        return torch.equal(view, want), untouched, pg.staging_stats["cpu"]["ops"]

    assert run_threads(fn, 2, gloo_groups=True, options=_options()) == [(True, True, 1)] * 2


def test_whole_staging_and_cpu_tensors_never_take_the_pipeline(copiers):
    def fn(pg, gloo, r):
        t = ones_like_rank((10007,), torch.float32, r)
        want = t.clone()
        gloo.allreduce([want]).wait()
        pg.allreduce([t]).wait()
        return torch.equal(t, want), pg.staging_stats

    # no stand-in: a CPU tensor goes the CPU way
    assert pipeline.copier_for(torch.device("cpu")) is None
    assert run_threads(fn, 2, gloo_groups=True, options=_options()) == [(True, {})] * 2
    # LINERATE_STAGING=whole: one staged copy, even where the stand-in would pipeline
    copiers()
    assert run_threads(fn, 2, gloo_groups=True,
                       options=_options(staging="whole")) == [(True, {})] * 2
    o = _options().agreed()
    assert {"LINERATE_STAGING", "LINERATE_STAGE_CHUNK_BYTES", "LINERATE_STAGE_MIN_BYTES"} <= set(o)


# ----------------------------------------------------------------------------- ordering
def _wait_for(log, entry, seconds=20.0):
    deadline = time.monotonic() + seconds
    while entry not in log:
        if time.monotonic() > deadline:
            raise AssertionError(f"{entry} never happened; log: {log}")
        time.sleep(0.001)


def test_copies_overlap_the_exchange_in_order(copiers):
    """The exchange of chunk k waits until the copy of chunk k+1 to the host and the copy
    of chunk k-1 back have run: it deadlocks (and fails at the timeout) unless both were
    issued before it began. Then the order of what was issued is checked on every rank."""
    cs = copiers(log=True)
    K = 6

    def fn(pg, gloo, r):
        real = pg._algos.all_reduce
        me = threading.current_thread().name
        k = [0]

        def exchange(comm, chunk, op, algo):   # on the group's worker
            c = cs.by_rank[me]
            i = k[0]
            c.note("begin", i)
            if i + 1 < K:
                _wait_for(c.log, ("to_host", i + 1))
            if i >= 1:
                _wait_for(c.log, ("to_device", i - 1))
            real(comm, chunk, op, algo)
            c.note("end", i)
            k[0] += 1
        pg._algos.all_reduce = exchange
        t = ones_like_rank((K * CHUNK // 4,), torch.float32, r)
        want = t.clone()
        gloo.allreduce([want]).wait()
        pg.allreduce([t]).wait()
        return torch.equal(t, want), list(cs.by_rank[me].log)

    for ok, log in run_threads(fn, 2, gloo_groups=True, options=_options()):
        assert ok
        at = {e: i for i, e in enumerate(log)}
        for k in range(K):
            assert at[("to_host", k)] < at[("begin", k)]              # read after it arrived
            assert at[("end", k)] < at[("issue to_device", k)]        # back once reduced
            if k + 1 < K:
                assert at[("issue to_host", k + 1)] < at[("begin", k)]  # issued before it
                assert at[("to_host", k + 1)] < at[("end", k)]          # ran beside it
            if k >= 1:
                assert at[("to_device", k - 1)] < at[("end", k)]


def test_buffers_are_reused_and_bounded(copiers):
    """Slow copies back, ops queued back to back, two buffers: a chunk copied into a buffer
    before the previous op's copy back had read it would show in the results."""
    cs = copiers(log=True, delay_s={"to_device": 0.003})

    def fn(pg, gloo, r):
        works, wants = [], []
        for i in range(5):
            t = ones_like_rank((5 * CHUNK // 4 + 3,), torch.float32, 7 * i + r)
            want = t.clone()
            gloo.allreduce([want]).wait()
            works.append((t, pg.allreduce([t])))
            wants.append(want)
        ok = [w.wait() and torch.equal(t, want) for (t, w), want in zip(works, wants)]
        c = cs.by_rank[threading.current_thread().name]
        c.drain()
        return ok, c.allocated, list(c.log), pg.staging_stats["cpu"]

    for ok, allocated, log, stats in run_threads(fn, 2, gloo_groups=True,
                                                 options=_options(stage_buffers=2)):
        assert all(ok)
        assert allocated == 2 and stats["buffers"] == 2 and stats["ops"] == 5
        # within the log, a buffer (chunk index mod 2, counted over every op) is written by a
        # copy to the host only after the copy back of its previous chunk ran
        ran = [e for e in log if e[0] in ("to_host", "to_device")]
        seq_to_host = [e for e in ran if e[0] == "to_host"]
        seq_back = [e for e in ran if e[0] == "to_device"]
        assert len(seq_to_host) == len(seq_back) == 5 * 6
        pos = {id(e): i for i, e in enumerate(ran)}
        for j in range(2, len(seq_to_host)):
            assert pos[id(seq_back[j - 2])] < pos[id(seq_to_host[j])], j


# ----------------------------------------------------------------------------- streams
def test_the_input_is_read_after_the_callers_stream_and_wait_does_not_block_the_host(copiers):
    """The stand-in's caller stream holds a slow "kernel" that writes the input: the op reads
    the input only once it ran. The copies back are held: Work.wait() returns anyway (the host
    waits for the exchange only), and work queued on the caller stream after wait() sees the
    whole result once they run."""
    cs = copiers(blocking_wait=False)
    n = 2 * CHUNK // 4 + 5   # 3 chunks, 3 buffers: none waits for a held copy back

    def fn(pg, r):
        pg.allreduce([torch.zeros(n)]).wait()     # makes this rank's copier
        c = cs.by_rank[threading.current_thread().name]
        c.sync()
        t = torch.zeros(n)
        kernel = threading.Event()
        c.launch(lambda: (kernel.wait(), t.fill_(r + 1)))
        work = pg.allreduce([t])
        time.sleep(0.3)
        early = work.is_completed()               # nothing can finish before the input exists
        hold = threading.Event()
        c._to_device.put(hold.wait)               # the copies back wait behind this
        kernel.set()
        work.wait()                               # returns: the host does not wait for them
        untouched = torch.equal(t, torch.full((n,), r + 1.0))  # no copy back ran yet
        seen = []
        c.launch(lambda: seen.append(t.clone()))  # after wait(): ordered after the copies back
        hold.set()
        c.sync()
        value = pg.allreduce([t]).get_future().wait()[0]
        return early, untouched, torch.equal(seen[0], torch.full((n,), 3.0)), \
            torch.equal(value, torch.full((n,), 6.0))

    assert run_threads(fn, 2, options=_options()) == [(False, True, True, True)] * 2


# ----------------------------------------------------------------------------- errors
def test_a_failed_allocation_is_refused_before_anything_is_sent(copiers):
    cs = copiers(per_rank={"rank1": {"fail": {"alloc": RuntimeError("pinned memory exhausted")}}})
    n = 3 * CHUNK // 4

    def fn(pg, gloo, r):
        t = ones_like_rank((n,), torch.float32, r)
        want = t.clone()
        gloo.allreduce([want]).wait()
        err = None
        if r == 1:
            try:
                pg.allreduce([t.clone()])
            except RuntimeError as e:
                err = str(e)
            cs.by_rank["rank1"].fail.clear()
        pg.allreduce([t]).wait()                 # the group is usable: rank 0's op is this one
        return err, torch.equal(t, want)

    res = run_threads(fn, 2, gloo_groups=True, options=_options())
    assert res[0] == (None, True) and res[1][1]
    err = res[1][0]
    for word in ("rank 1", "all_reduce", f"float32[{n}]", "LINERATE_STAGE_BUFFERS=3",
                 "LINERATE_STAGE_CHUNK_BYTES=4096", "LINERATE_STAGING=whole",
                 "pinned memory exhausted"):
        assert word in err, (word, err)


def test_a_failed_copy_names_rank_op_chunk_and_tensor_on_every_rank(copiers):
    cs = copiers(per_rank={"rank1": {"fail": {("to_host", 2): RuntimeError("device copy failed")}}})
    n = 5 * CHUNK // 4 + 1

    def fn(pg, r):
        t = ones_like_rank((n,), torch.float32, r)
        try:
            return pg.allreduce([t]).wait()
        finally:
            c = cs.by_rank[threading.current_thread().name]
            c.drain()   # nothing is left queued on the copy streams
            assert len(pg._stagers[torch.device("cpu")].bufs) == 3

    res = outcomes(fn, 2, options=_options(), op_timeout=15)
    assert all(isinstance(e, Exception) for e in res), res
    for e in res:   # rank 1's own error, and rank 0's report of it
        for word in ("rank 1", "all_reduce #1", "chunk 3 of 6", f"float32[{n}] on cpu",
                     "device copy failed"):
            assert word in str(e), (word, str(e))


def test_ranks_that_stage_differently_are_named_not_hung(copiers):
    copiers(only={"rank0"})   # rank 0 pipelines, rank 1 stages whole (a CPU tensor there)

    def fn(pg, r):
        return pg.allreduce([ones_like_rank((10007,), torch.float32, r)]).wait()

    t0 = time.monotonic()
    res = outcomes(fn, 2, options=_options(), op_timeout=15)
    assert time.monotonic() - t0 < 12
    assert all(isinstance(e, Exception) for e in res), res
    text = " ".join(map(str, res))
    assert "staged in chunks of 4096 bytes" in text and "other arguments" in text, text


# ----------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_all_reduce_is_pipelined_and_matches_the_cpu_fold(dtype):
    n = 10 * CHUNK // dtype.itemsize + 3

    def fn(pg, r):
        xs = [ones_like_rank((n,), dtype, q) for q in range(2)]
        bad = []
        for op in _ops(dtype):
            t = xs[r].cuda()
            pg.allreduce([t], _opts(op)).wait()
            if not torch.equal(t.cpu(), _fold(xs, op).to(dtype)):
                bad.append(str(op))
        return bad, pg.staging_stats["cuda:0"]["ops"]

    assert run_threads(fn, 2, options=_options()) == [([], len(_ops(dtype)))] * 2


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_input_written_by_a_long_kernel_is_never_read_early(side_stream):
    n = 64 * CHUNK // 4 + 7

    def fn(pg, r):
        s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
        got = []
        with torch.cuda.stream(s):
            for _ in range(3):
                t = torch.zeros(n, device="cuda")
                torch.cuda._sleep(200_000_000)   # ~0.1 s or more of one kernel
                t.fill_(r + 1)
                work = pg.allreduce([t])
                work.wait()
                got.append(torch.equal(t.cpu(), torch.full((n,), 3.0)))
        return got

    assert run_threads(fn, 2, options=_options()) == [[True] * 3] * 2

