"""Shared memory between the ranks of one host (transport/shm, collectives/shm_algos.py).

- Every collective on the shared segment against Gloo on the same inputs: dtypes (float16,
  bfloat16, complex, integers, bool), reduce ops, sizes 0, 1, 7, 1001, 70,001 and one larger
  than a pipeline chunk, world sizes 1-8 on one host. Inputs are small integers: results must
  be bit-identical to Gloo's; random floats must be bit-identical across ranks. Ranks as
  threads (tests/_threads.py, the unit tier; 2, 3 and 5-7 ranks: test_backend_collectives runs
  every collective on 8 thread ranks of one segment), and the whole matrix once on 4 rank
  processes.
- /dev/shm keeps nothing: the name is gone while the group runs (unlinked once every rank
  mapped it), after a normal exit, after destroy_process_group (the mapping goes too), after
  1,000 groups created and destroyed, after a rank is SIGKILLed.
- A co-located rank that dies fails the others' op fast, naming it; a mismatched call is named
  on every rank; a rank that never comes is named at the timeout; waiting burns no CPU.
- LINERATE_SHM=0/1/auto, ranks that disagree, a rank "on another host" (mixed: TCP), and a
  segment whose token does not match (refused).
"""
from __future__ import annotations

import gc
import json
import os
import re
import resource
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _harness import RankError, run_rank_scripts, run_ranks
from _threads import run_threads

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]
SIZES = [0, 1, 7, 1001, 70_001]
# Several pipeline chunks: a segment slot (transport/shm/engine.py Engine.C) is 1.4-1.7 MB at
# 2-4 ranks, so 3 chunks of float32 and 5-6 of int64 (the two sets of slots reused); over
# CMA_BYTES (shm_algos: cross-memory attach may take it).
BIG = 1_000_001


def _ops(dtype):
    if dtype.is_complex:
        return [R.SUM, R.AVG]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def _data(g, dtype, n, prod=False):
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if prod:
        v = torch.tensor([1, 2] if dtype == torch.uint8 else [-1, 1, 2])[
            torch.randint(0, 2 if dtype == torch.uint8 else 3, (n,), generator=g)]
    else:
        v = torch.randint(0 if dtype == torch.uint8 else -3, 4, (n,), generator=g)
    if dtype.is_complex:
        return torch.complex(v.double(), torch.randint(-3, 4, (n,), generator=g).double()).to(dtype)
    return v.to(dtype)


def _real(t):
    if isinstance(t, list):
        return [_real(x) for x in t]
    return torch.view_as_real(t) if t is not None and t.is_complex() else t


class _Cases:
    """The cases of a rank; with a ThreadDist that batches its Gloo calls (``d``), checks wait
    for ``settle()``."""

    def __init__(self, rank, P, d=dist):
        self.rank, self.P, self.k, self.d = rank, P, 0, d
        self.fails = []
        self.n = 0
        self._later = [] if getattr(d, "settle", None) else None

    def settle(self):
        if self._later is not None:
            self.d.settle()
            later, self._later = self._later, []
            for args in later:
                self._check(*args)

    def gen(self, same=False):
        self.k += 1
        return torch.Generator().manual_seed(7919 * self.k + (0 if same else self.rank + 1))

    def check(self, what, got, want):
        self.n += 1
        if self._later is not None:
            self._later.append((what, got, want))
        else:
            self._check(what, got, want)

    def _check(self, what, got, want):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            self.fails.append(f"rank {self.rank}: {what}: got {got.flatten()[:6].tolist()}, "
                              f"want {want.flatten()[:6].tolist()}")


def _matrix(rank, P, lr, quick, d=dist):
    """Every collective against Gloo (``d``: torch.distributed in a rank process, its
    thread-rank counterpart tests/_threads.ThreadDist on threads)."""
    assert lr._shm is not None, "the group did not get a shared segment"
    c = _Cases(rank, P, d)
    sizes = SIZES if not quick else [0, 1, 7, 1001]
    for dtype in DTYPES:
        big = [BIG] if dtype in (torch.float32, torch.int64) and not quick else []
        for n in sizes + big:
            for op in _ops(dtype) if n < 70_000 else [R.SUM, R.MAX if not dtype.is_complex else R.AVG]:
                x = _data(c.gen(), dtype, n, op == R.PRODUCT)
                want, got = x.clone(), x.clone()
                d.all_reduce(_real(want) if op != R.AVG else want, op=op)
                d.all_reduce(got, op=op, group=lr)
                c.check(f"all_reduce {dtype} {op} n={n}", got, want)
                root = c.k % P
                want, got = x.clone(), x.clone()
                d.reduce(want, root, op=op)
                d.reduce(got, root, op=op, group=lr)
                if rank == root:
                    c.check(f"reduce {dtype} {op} n={n} root={root}", got, want)
                if dtype.is_complex:
                    continue
                xs = _data(c.gen(), dtype, n * P, op == R.PRODUCT)
                want, got = torch.empty(n, dtype=dtype), torch.full((n,), 9).to(dtype)
                if dtype != torch.bool:  # Gloo has no bool reduce_scatter
                    d.reduce_scatter_tensor(want, xs, op=op)
                    d.reduce_scatter_tensor(got, xs, op=op, group=lr)
                    c.check(f"reduce_scatter_tensor {dtype} {op} n={n}", got, want)
                    gl, ll = list(xs.chunk(P)) if n else [xs] * P, None
                    ll = [t.clone() for t in gl]
                    want2, got2 = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    d.reduce_scatter(want2, gl, op=op)
                    d.reduce_scatter(got2, ll, op=op, group=lr)
                    c.check(f"reduce_scatter {dtype} {op} n={n}", got2, want2)
            x = _data(c.gen(), dtype, n)
            root = c.k % P
            want, got = x.clone(), x.clone()
            d.broadcast(_real(want), root)
            d.broadcast(got, root, group=lr)
            c.check(f"broadcast {dtype} n={n} root={root}", got, want)
            want, got = torch.empty(n * P, dtype=dtype), torch.empty(n * P, dtype=dtype)
            d.all_gather_into_tensor(_real(want), _real(x))
            d.all_gather_into_tensor(got, x, group=lr)
            c.check(f"all_gather_into_tensor {dtype} n={n}", got, want)
            wl = [torch.empty(n, dtype=dtype) for _ in range(P)]
            gl = [torch.empty(n, dtype=dtype) for _ in range(P)]
            d.all_gather(_real(wl), _real(x))
            d.all_gather(gl, x, group=lr)
            for i in range(P):
                c.check(f"all_gather {dtype} n={n} [{i}]", gl[i], wl[i])
            wl = [torch.empty(n, dtype=dtype) for _ in range(P)] if rank == root else None
            gl = [torch.empty(n, dtype=dtype) for _ in range(P)] if rank == root else None
            d.gather(_real(x), _real(wl), root)
            d.gather(x, gl, root, group=lr)
            if rank == root:
                for i in range(P):
                    c.check(f"gather {dtype} n={n} root={root} [{i}]", gl[i], wl[i])
            ins = [_data(c.gen(same=True), dtype, n) for _ in range(P)] if rank == root else None
            want, got = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            d.scatter(_real(want), _real(ins), root)
            d.scatter(got, ins, root, group=lr)
            c.check(f"scatter {dtype} n={n} root={root}", got, want)
            inp = _data(c.gen(), dtype, n * P)
            want, got = torch.empty_like(inp), torch.empty_like(inp)
            d.all_to_all_single(_real(want), _real(inp))
            d.all_to_all_single(got, inp, group=lr)
            c.check(f"all_to_all_single {dtype} n={n}", got, want)
            il = list(inp.chunk(P)) if n else [inp] * P
            wl = [torch.empty(n, dtype=dtype) for _ in range(P)]
            gl = [torch.empty(n, dtype=dtype) for _ in range(P)]
            d.all_to_all(_real(wl), _real(il))
            d.all_to_all(gl, [t.clone() for t in il], group=lr)
            for i in range(P):
                c.check(f"all_to_all {dtype} n={n} [{i}]", gl[i], wl[i])
        c.settle()
    # uneven all_to_all_single: rank r sends (r + q) % 3 * 1000 + q rows to rank q
    send = [((rank + q) % 3) * 1000 + q for q in range(P)]
    recv = [((q + rank) % 3) * 1000 + rank for q in range(P)]
    inp = _data(c.gen(), torch.float32, sum(send))
    want, got = torch.empty(sum(recv)), torch.empty(sum(recv))
    d.all_to_all_single(want, inp, recv, send)
    d.all_to_all_single(got, inp, recv, send, group=lr)
    c.check("all_to_all_single uneven", got, want)
    # coalesced, and random floats: every rank gets the same bits
    xs = [_data(c.gen(), torch.float32, n) for n in (3, 70_001)]
    want, got = [x.clone() for x in xs], [x.clone() for x in xs]
    for w in want:
        d.all_reduce(w)
    d.all_reduce_coalesced(got, group=lr)
    for i in range(2):
        c.check(f"all_reduce_coalesced [{i}]", got[i], want[i])
    for n in (1001, BIG if not quick else 70_001):
        x = torch.randn(n, generator=c.gen())
        d.all_reduce(x, group=lr)
        allx = [torch.empty(n) for _ in range(P)]
        d.all_gather(allx, x)
        for i in range(P):
            c.check(f"random floats n={n}: rank {i} == rank {rank}", allx[i], x)
        ref = x.clone()
        d.all_reduce(ref)  # not compared bit for bit with Gloo (another order)
    c.settle()
    d.barrier(group=lr)
    return c.fails, c.n


def _thread_matrix(P, quick):
    return run_threads(lambda d, r: _matrix(r, P, d.lr, quick, d), P, as_dist="batched",
                       timeout=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [2, 3])
def test_every_collective_matches_gloo(P):
    """Thread ranks (tests/_threads.py): the ranks share the segment as processes do."""
    for fails, n in _thread_matrix(P, False):
        assert not fails, "\n".join(fails[:20])
        assert n > 500


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [5, 6, 7])
def test_more_ranks_small_sizes(P):
    for fails, n in _thread_matrix(P, True):
        assert not fails, "\n".join(fails[:20])


@pytest.mark.timeout(900)
def test_every_collective_matches_gloo_between_processes():
    """The whole matrix, its largest tensors (several pipeline chunks) too, on 4 rank
    processes: the segment mapped by separate processes."""
    for fails, n in run_ranks(_matrix, 4, False, timeout=800):
        assert not fails, "\n".join(fails[:20])
        assert n > 500


def _cma(rank, P, lr, how):
    """Large all_reduces (>= CMA_BYTES) against Gloo: every dtype and op at an odd size just
    over the threshold. ``how``: "on" (every rank LINERATE_CMA=1: cross-memory attach, which
    this machine allows, for every one), "auto" (the default: both paths tried, then the one
    measured faster), "off" (rank 1 sets LINERATE_CMA=0: every rank copies through the
    segment), "eperm" (rank 1's probe is refused as a seccomp filter or Yama would: the
    same)."""
    from linerate.collectives import shm_algos
    if how == "on":
        os.environ["LINERATE_CMA"] = "1"
    if how == "off" and rank == 1:
        os.environ["LINERATE_CMA"] = "0"
    if how == "eperm" and rank == 1:
        def refused(pid, local, remote, n):
            raise PermissionError(1, "Operation not permitted")
        shm_algos.cma_read = refused
    g = dist.new_group(backend="linerate")
    E = g._shm
    assert E is not None, "the group did not get a shared segment"
    c = _Cases(rank, P)
    for dtype in DTYPES:
        es = torch.empty(0, dtype=dtype).element_size()
        n = shm_algos.CMA_BYTES // es + 13
        for op in _ops(dtype):
            x = _data(c.gen(), dtype, n, op == R.PRODUCT)
            want, got = x.clone(), x.clone()
            dist.all_reduce(_real(want) if op != R.AVG else want, op=op)
            dist.all_reduce(got, op=op, group=g)
            c.check(f"all_reduce {dtype} {op} n={n}", got, want)
    # a view into a larger tensor (its address is not the storage's), and random floats:
    # every rank gets the same bits
    base = torch.randn(3 << 20, generator=c.gen())
    orig = base.clone()
    lo, hi = 12345, 12345 + (1 << 20) + 7
    x = base[lo:hi]
    dist.all_reduce(x, group=g)
    allx = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(allx, x.clone())
    for i in range(P):
        c.check(f"random floats: rank {i} == rank {rank}", allx[i], x)
    c.check("bytes around the view", torch.cat([base[:lo], base[hi:]]),
            torch.cat([orig[:lo], orig[hi:]]))
    return c.fails, c.n, E.cma, tuple(E.big_paths)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,how", [(2, "on"), (3, "on"), (4, "on"), (3, "auto"), (3, "off"),
                                   (2, "eperm")])
def test_cross_memory_attach_all_reduce_matches_gloo(P, how):
    """all_reduce from CMA_BYTES on reads the peers' tensors (process_vm_readv) where every
    rank may (3 ranks: a rank past the first two folds from a copy of its own piece), and
    copies through the segment, with the same results, where one rank may not or does not
    want to; under auto every rank takes the same path for each op (else the op would hang or
    be named a mismatch) after trying both."""
    res = run_ranks(_cma, P, how, timeout=240)
    for fails, n, _, _ in res:
        assert not fails, "\n".join(fails[:20])
        assert n > 40
    modes = {cma for _, _, cma, _ in res}
    paths = {p for _, _, _, p in res}
    assert len(paths) == 1, res  # (CMA, segment) counts: the same on every rank
    cma, seg = paths.pop()
    # this machine allows cross-memory attach between its processes (root, no seccomp)
    if how == "on":
        assert modes == {"on"} and seg == 0 and cma > 40, res
    elif how == "auto":
        assert modes == {"tuned"} and cma >= 2 and seg >= 2, res
    else:
        assert modes == {"off"} and cma == 0 and seg > 40, res


def _overflow(rank, P, lr):
    """Sums that overflow to inf, inf + -inf = nan: as Gloo makes them, and no NumPy warning
    reaches the user (warnings are errors here), in a small all_reduce (the lone way) and a
    larger one; the user's NumPy error state is what it was."""
    import warnings

    import numpy as np
    out = []
    np.seterr(over="raise")  # the user's own setting: kept, and not applied to the folds
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (torch.float32, torch.float64):
            big = torch.finfo(dtype).max
            for repeat in (1, 3000):
                x = torch.tensor([big, big, float("inf") if rank == 0 else -float("inf"), 1.0]
                                 * repeat, dtype=dtype)
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
                    a, b = x.clone(), x.clone()
                    dist.all_reduce(a, op=op, group=lr)
                    dist.all_reduce(b, op=op)  # the default group: Gloo
                    out.append(torch.equal(a.isnan(), b.isnan())
                               and torch.equal(a.nan_to_num(), b.nan_to_num()))
    out.append(np.geterr()["over"])
    return out


@pytest.mark.timeout(120)
def test_overflow_gives_inf_and_nan_as_gloo_without_warnings():
    for r in run_ranks(_overflow, 3, timeout=90):
        assert r == [True] * 8 + ["raise"], r


def _polling(rank, P, lr):
    """The shared-memory engine's polling plan (transport/shm/engine.py), and an all_reduce
    through it."""
    x = torch.ones(3)
    lr.allreduce([x]).wait()
    assert x.tolist() == [float(P)] * 3
    return lr._shm.spin, lr._shm.yield_s


def test_the_layout_counts_the_ranks_that_share_a_machines_cores():
    """Hosts of one kernel (netlab's network namespaces: another host id, the same boot) are
    one machine: its ranks share its cores, whatever host each is (what a waiting rank's
    spin is decided on: transport/shm/sync.py spin_for); ranks of one host with one pid
    are threads of one process (which never spin)."""
    import datetime
    from linerate.transport import rendezvous, shm
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    rv = rendezvous.Rendezvous(store, 0, time.monotonic() + 10, 10.0, "linerate/layout-test/")
    boot, rest = shm.host_id().split("/", 1)
    version = rendezvous.version_text()
    me = os.getpid()
    records = {1: (f"{boot}/another-namespace/1:2/3:4", me), 2: (f"another-boot/{rest}", me),
               3: (f"{boot}/{rest}", me), 4: (f"{boot}/{rest}", me + 1)}
    for r, (host, pid) in records.items():
        store.set(f"{rv.prefix}shm/{rv.generation}/host/{r}",
                  json.dumps({"host": host, "mode": "0", "version": version,
                              "pid": [pid, shm.pidns()]}))
    seg, layout = shm.establish(rv, 0, 5, b"s" * 32, "0", rv.prefix, rv.generation)
    assert seg is None and layout.hosts == ((0, 3, 4), (1,), (2,))
    assert layout.machines == ((0, 1, 3, 4), (2,))
    assert [layout.cores_shared_by(r) for r in range(5)] == [4, 4, 1, 4, 4]
    assert layout.processes == ((0, 3), (1,), (2,), (4,))
    assert [layout.threads_of_one_process(r) for r in range(5)] == [True, False, False, True,
                                                                   False]
    bare = shm.Layout(((0, 1), (2,)), False)  # (no machines: hosts; no processes: one each)
    assert bare.cores_shared_by(2) == 1 and not bare.threads_of_one_process(0)


@pytest.mark.timeout(60)
def test_thread_ranks_sleep_at_once_and_processes_poll_first():
    """Ranks that are threads of one process neither spin nor yield before the futex sleep
    (polling would hold the interpreter lock the awaited thread needs); rank processes spin
    where each has a core, else yield."""
    from linerate.transport.shm import engine
    from linerate.transport.shm.sync import SPIN_S, usable_cores

    assert run_threads(lambda pg, r: _polling(r, 2, pg), 2) == [(0.0, 0.0)] * 2
    spin = SPIN_S if 2 <= usable_cores() else 0.0
    assert run_ranks(_polling, 2, timeout=45) == [(spin, engine.YIELD_S)] * 2


def _one_rank(rank, P, lr):
    x = torch.arange(5.0)
    dist.all_reduce(x, group=lr)
    dist.barrier(group=lr)
    return lr._shm is None, x.tolist()


@pytest.mark.timeout(120)
def test_usable_cores_follow_the_cgroup_cpu_quota(tmp_path):
    """A container limited by a CPU quota rather than a cpuset: the cores a rank counts (to
    decide whether waiting ranks may spin) are bounded by the smallest quota of its cgroup and
    those above it, rounded up; no quota, or none readable: the affinity alone."""
    from linerate.transport.shm.sync import cgroup_cpu_quota, usable_cores

    affinity = len(os.sched_getaffinity(0))

    def tree(proc_lines, files):
        root = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        root.mkdir(exist_ok=True)
        (root / "cgroup").write_text("".join(line + "\n" for line in proc_lines))
        return str(root / "cgroup"), str(root / "fs")

    # v2: the quota of a cgroup above this one (1.5 cores) bounds it; "max" means none
    paths = tree(["0::/job/rank"], {"fs/cpu.max": "max 100000\n",
                                    "fs/job/cpu.max": "150000 100000\n",
                                    "fs/job/rank/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(*paths) == 1.5
    assert usable_cores(*paths) == min(affinity, 2)
    # v1 (cpu,cpuacct): -1 is no quota; 50 ms per 100 ms is half a core: still one
    paths = tree(["4:memory:/x", "2:cpu,cpuacct:/pod/c"],
                 {"fs/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                  "fs/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                  "fs/cpu,cpuacct/pod/c/cpu.cfs_quota_us": "50000\n",
                  "fs/cpu,cpuacct/pod/c/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(*paths) == 0.5
    assert usable_cores(*paths) == 1
    # none set, or nothing readable: the affinity
    paths = tree(["0::/"], {"fs/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(*paths) is None and usable_cores(*paths) == affinity
    assert usable_cores(str(tmp_path / "absent"), str(tmp_path)) == affinity
    assert 1 <= usable_cores() <= affinity  # this machine's own
    # The process's cores, whichever thread asks first (the value is kept for the process):
    # a thread pinned to one core does not make every rank of the process count one.
    if affinity > 1:
        seen = []

        def pinned():
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            seen.append(usable_cores(str(tmp_path / "none"), str(tmp_path)))
        t = threading.Thread(target=pinned)
        t.start()
        t.join()
        assert seen == [affinity]


def test_one_rank_has_no_segment():
    assert run_ranks(_one_rank, 1, timeout=90) == [(True, [0.0, 1.0, 2.0, 3.0, 4.0])]


# ----------------------------------------------------------------------------- /dev/shm
def _segment_state(rank, P, lr):
    """The name is gone once the group exists; after destroy the mapping is gone too."""
    name = lr._ctx.shm.name
    x = torch.ones(100_000)
    dist.all_reduce(x, group=lr)
    present = os.path.exists(f"/dev/shm/{name}")
    mapped = _mapped(name)
    g = dist.new_group(backend="linerate")
    gname = g._ctx.shm.name
    dist.all_reduce(x, group=g)
    # The mapping goes with destroy_process_group itself: while the user still holds the
    # group object, and before the garbage collector has run (a destroyed group's objects
    # had stayed mapped, and its /dev/shm space in use, until the collector freed them).
    gc.disable()
    try:
        dist.destroy_process_group(g)
        sub_mapped = _mapped(gname)
    finally:
        gc.enable()
    del g
    return {"name": name, "present": present, "mapped": mapped, "sub": gname,
            "sub_mapped_after_destroy": sub_mapped, "sum": x[0].item()}


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()


@pytest.mark.timeout(120)
def test_nothing_left_in_dev_shm_after_exit_and_destroy():
    res = run_ranks(_segment_state, 3, timeout=90)
    names = {r["name"] for r in res} | {r["sub"] for r in res}
    assert len(names) == 2, res  # one segment per group, the same on every rank
    for r in res:
        assert r["mapped"] and not r["present"], r  # mapped, and already unlinked
        assert not r["sub_mapped_after_destroy"], r
        assert r["sum"] == 9.0
    for n in names:
        assert not os.path.exists(f"/dev/shm/{n}")
        assert re.fullmatch(r"linerate-[0-9a-f]{32}", n), n


def _threads_after_destroy(rank, P, lr):
    from linerate.transport.shm import ring as shmlink
    sub = dist.new_group(backend="linerate")
    for g in (lr, sub):
        x = torch.ones(100_003)
        dist.all_reduce(x, group=g)
        dist.all_gather_into_tensor(torch.empty(x.numel() * P), x, group=g)
    dist.destroy_process_group()  # every group: the script's last line, as users write it
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("linerate-"))
    return names, len(shmlink._ENGINE._ports)


_EXIT_SCRIPT = """
import threading, time, torch, torch.distributed as dist
dist.init_process_group("linerate")
sub = dist.new_group(backend="linerate")
for g in (dist.group.WORLD, sub):
    x = torch.ones(100_003)
    dist.all_reduce(x, group=g)
    dist.all_gather_into_tensor(torch.empty(x.numel() * dist.get_world_size()), x, group=g)
    assert x[0].item() == dist.get_world_size()
dist.destroy_process_group()
print(sorted(t.name for t in threading.enumerate() if t.name.startswith("linerate-")))
print("last line at", repr(time.time()), flush=True)
"""


@pytest.mark.timeout(330)  # a hang: 90 s for the threads check, 60 s for each of three runs
def test_no_thread_of_a_group_outlives_destroy_process_group_and_exit_is_clean(tmp_path):
    """destroy_process_group leaves no thread that serves a group: only the shared-memory
    engine's two, idle (they linger shmlink.LINGER_S for the next group, holding nothing).
    A daemon thread still running in torch's C++ code when the interpreter finalizes dies
    there (taking the GIL back calls pthread_exit through noexcept frames): the process aborts,
    "terminate called without an active exception". So a script whose last line is
    destroy_process_group exits at once and cleanly: the idle threads end at exit (atexit),
    not LINGER_S later."""
    from linerate.transport.shm import ring as shmlink
    for rank, (names, ports) in enumerate(run_ranks(_threads_after_destroy, 3, timeout=90)):
        assert set(names) <= {"linerate-shm-deaths", "linerate-shm-progress"}, (rank, names)
        assert ports == 0, rank
    for attempt in range(3):  # the race is at exit: a few runs
        out = run_rank_scripts(tmp_path, _EXIT_SCRIPT, 3, timeout=60, fresh=True)  # a hang
        exited = time.time()
        last = []
        for r, (code, text) in enumerate(out):
            assert code == 0, (attempt, r, code, text[-2000:])
            assert "terminate called" not in text, (attempt, r, text[-2000:])
            assert "linerate-shm-progress" in text, (attempt, r, text)  # it did linger
            last.append(float(re.search(r"last line at (\S+)", text).group(1)))
        # From each script's last line to its exit: the idle threads end at exit, not
        # LINGER_S later (interpreter start-up and the collectives are not counted).
        took = exited - min(last)
        assert took < shmlink.LINGER_S, f"the ranks took {took:.1f}s from their last line to exit"


def _thousand_groups(rank, P, lr, count):
    """Each of ``count`` groups all_reduces its own values (exact in float32); returns the
    segment names, the segments still mapped, and the groups whose sum was wrong."""
    names, wrong = set(), []
    gc.disable()  # what is left mapped must not depend on when the collector runs
    try:
        for i in range(count):
            g = dist.new_group(backend="linerate")
            names.add(g._ctx.shm.name)
            x = torch.full((3,), float((rank + 1) * (i + 1)))
            dist.all_reduce(x, group=g)
            if not bool((x == P * (P + 1) // 2 * (i + 1)).all()):
                wrong.append((i, x.tolist()))
            dist.destroy_process_group(g)
            del g
        with open("/proc/self/maps") as f:
            left = sum(1 for line in f if "/linerate-" in line)
    finally:
        gc.enable()
    return sorted(names), left, wrong


@pytest.mark.timeout(900)
def test_thousand_groups_created_and_destroyed():
    count = 1000
    res = run_ranks(_thousand_groups, 2, count, timeout=850)
    names = res[0][0]
    assert len(names) == count and res[1][0] == names
    for r in res:
        assert r[2] == [], f"groups whose all_reduce was wrong (group, values): {r[2][:5]}"
        assert r[1] <= 2, f"{r[1]} segments still mapped in a rank after {count} groups"
    present = set(os.listdir("/dev/shm"))
    assert not present & set(names)


def _killed(rank, P, lr, out):
    """Rank 2 SIGKILLs itself during a stream of 64 MB all_reduces; the others must fail
    fast naming it."""
    name = lr._ctx.shm.name
    with open(os.path.join(out, f"name-{rank}"), "w") as f:
        f.write(name)
    x = torch.ones(16 << 20)
    dist.all_reduce(x, group=lr)
    if rank == 2:
        def die():
            time.sleep(0.3)
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    try:
        for _ in range(10_000):
            dist.all_reduce(x, group=lr)
    except Exception as e:  # noqa: BLE001 - what it raises is the subject
        at = time.time()
        with open(os.path.join(out, f"error-{rank}"), "w") as f:
            json.dump({"at": at, "error": str(e), "type": type(e).__name__}, f)
        return str(e)
    return "completed"


@pytest.mark.timeout(180)
def test_killed_rank_is_named_fast_and_leaves_nothing(tmp_path):
    with pytest.raises(RankError, match="rank 2"):
        run_ranks(_killed, 3, str(tmp_path), timeout=120, error_grace=20)
    killed = float((tmp_path / "killed").read_text())
    name = (tmp_path / "name-0").read_text()
    assert not os.path.exists(f"/dev/shm/{name}")
    for r in (0, 1):
        rep = json.loads((tmp_path / f"error-{r}").read_text())
        delay = rep["at"] - killed
        print(f"rank {r}: {delay:.3f}s after the kill: {rep['error'][:300]}")
        assert re.search(r"\brank 2\b", rep["error"]), rep
        assert "all_reduce" in rep["error"], rep
        assert 0 <= delay < 2.0, f"rank {r} noticed the death after {delay:.3f}s"


# ----------------------------------------------------------------------------- errors
def _mismatch(rank, P, lr, kind):
    g = dist.new_group(backend="linerate", timeout=timedelta(seconds=30))
    assert g._shm is not None
    x = torch.ones(100 if rank == 0 or kind != "size" else 200)
    t0 = time.monotonic()
    try:
        if kind == "size":
            dist.all_reduce(x, group=g)
        elif kind == "op":
            if rank == 0:
                dist.all_reduce(x, group=g)
            else:
                dist.broadcast(x, 1, group=g)
        elif kind == "big":
            y = torch.ones((3 << 20) if rank else (3 << 20) + 16)
            dist.all_reduce(y, group=g)
        elif kind == "splits":
            # rank 1 sends rank 0 two rows, rank 0 expects three (the rest agrees)
            send = [3, 3] if rank == 0 else [2, 4]
            recv = [3, 3] if rank == 0 else [3, 4]
            inp, out = torch.ones(sum(send)), torch.empty(sum(recv))
            dist.all_to_all_single(out, inp, recv, send, group=g)
        # A root that only writes (broadcast) may finish before the others look: as over TCP,
        # where a send completes once written, it learns of the mismatch in its next op.
        dist.barrier(group=g)
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - t0
    return "completed", time.monotonic() - t0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["size", "op", "big", "splits"])
def test_mismatched_calls_are_named_on_every_rank(kind):
    res = run_ranks(_mismatch, 2, kind, timeout=200)
    for rank, (msg, took) in enumerate(res):
        assert msg != "completed", res
        assert took < 20, res  # named at once, not at the 30 s timeout
        assert "rank 0" in msg and "rank 1" in msg, msg
        if kind == "splits":
            assert "bytes" in msg, msg
        else:
            assert re.search(r"all_reduce|broadcast", msg), msg


class _Ctx:
    """What an Engine asks of its transport context, for two engines in one process."""
    broken = None
    close_error = None

    def __init__(self):
        self.reported = []

    def report_error(self, msg):
        self.reported.append(msg)

    def where(self):
        return ""

    def peer_failure(self, peer):
        return None

    #: (root, text) of the group's first failure as told to this rank (None: none known).
    cause = None

    def cause_of(self, peer):
        return self.cause if self.cause is not None and self.cause[0] == peer else None

    def root_cause(self):
        return self.cause

    def lost(self, peer, symptom, prefix):
        from linerate.transport import TransportError
        return TransportError(symptom)


class _Call:
    #: The engine keeps an op's Comm weakly (its caller holds it while the op runs): so do
    #: these tests, for every call they begin.
    live: list = []

    def __init__(self, ctx, rank, seq, op, digest):
        _Call.live.append(self)
        self.ctx, self.rank, self.size, self.seq, self.op = ctx, rank, 2, seq, op
        self.call, self.call_text, self.desc = digest, "x", f"{op} #{seq}"
        self.timeout = 5.0
        self.deadline = time.monotonic() + self.timeout


def _two_engines():
    from linerate.collectives.shm_algos import Engine
    from linerate.transport.shm import Segment, segment_layout
    buf = torch.zeros(segment_layout(2)[2], dtype=torch.uint8)
    return [Engine(Segment(buf, 2, r, "test")) for r in (0, 1)], [_Ctx(), _Ctx()]


@pytest.mark.timeout(30)
def test_peer_caught_beginning_its_next_op_is_still_compared():
    """Rank 1: broadcast #1 as root (one tick), then barrier #2; rank 0: a small all_reduce #1
    (its first wait is at tick 1). Rank 0 finds rank 1 at tick 1 in the middle of beginning #2
    (its sequence number being rewritten): it must look again and name the mismatch, not
    complete unchecked (rank 1's barrier must not complete against rank 0's all_reduce)."""
    from linerate.transport import MismatchError
    (e0, e1), (c0, c1) = _two_engines()
    e1.begin(_Call(c1, 1, 1, "broadcast", 111))
    e1.publish()
    e1.ctrl[1, 1] = 0  # _SEQ: rank 1 is inside begin() of its next op
    e0.begin(_Call(c0, 0, 1, "all_reduce", 222))
    e0.publish()
    threading.Timer(0.2, lambda: e1.begin(_Call(c1, 1, 2, "barrier", 333))).start()
    t0 = time.monotonic()
    with pytest.raises(MismatchError, match=r"rank 1 called other arguments in #1 .*rank 0 "
                                            r"called all_reduce"):
        e0.wait(e0.tick)
    assert 0.15 < time.monotonic() - t0 < 10  # after rank 1's begin (0.2 s), not at a timeout
    assert c0.reported  # the other ranks are told


@pytest.mark.timeout(30)
def test_peer_that_reached_this_tick_in_an_earlier_op_is_a_mismatch():
    """Rank 1 published ticks 1 and 2 in all_reduce #1 (two ticks); rank 0 published tick 1 in
    broadcast #1 and tick 2 in barrier #2. Rank 0's barrier sees every tick it waits for, from
    a rank still in #1: the ranks called different sequences, named, not completed."""
    from linerate.transport import MismatchError
    (e0, e1), (c0, c1) = _two_engines()
    e1.begin(_Call(c1, 1, 1, "all_reduce", 222))
    e1.publish()
    e1.publish()
    e0.begin(_Call(c0, 0, 1, "broadcast", 111))
    e0.publish()
    e0.begin(_Call(c0, 0, 2, "barrier", 333))
    e0.publish()
    with pytest.raises(MismatchError, match=r"rank 1 is in all_reduce.*#1.*different sequences"):
        e0.wait(e0.tick)


@pytest.mark.timeout(30)
def test_peer_that_went_back_to_its_chained_op_after_a_failure_names_the_root_cause():
    """As above, but rank 1 failed its op #2 (a report from another host) and ends the chained
    #1 on that op's own view: rank 0, in #2, sees its tick from #1. The group's root cause,
    known to rank 0 within LEFT_WAIT_S, is named, not a sequence mismatch."""
    from linerate.transport import MismatchError, TransportError
    (e0, e1), (c0, c1) = _two_engines()
    e1.begin(_Call(c1, 1, 1, "all_reduce", 222))
    e1.publish()
    e0.begin(_Call(c0, 0, 1, "all_reduce", 222))
    e0.publish()
    e0.begin(_Call(c0, 0, 2, "all_reduce", 222))  # chained: #2 begins, #1's tail to come
    e0.publish()
    e1.publish()  # rank 1: #2 failed, #1's tail on #1's view
    threading.Timer(0.05, lambda: setattr(c0, "cause", (3, "rank 3 passed float32[9]"))).start()
    with pytest.raises(TransportError, match=r"rank 1 went back to #1, having failed") as err:
        e0.wait(e0.tick)
    assert not isinstance(err.value, MismatchError)
    assert not c0.reported  # no mismatch of its own told to the others


def _absent(rank, P, lr):
    g = dist.new_group(backend="linerate", timeout=timedelta(seconds=3))
    x = torch.ones(10)
    t0 = time.monotonic()
    if rank == 1:
        time.sleep(5)  # never calls it
        return "slept", 0.0
    try:
        dist.all_reduce(x, group=g)
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - t0
    return "completed", 0.0


@pytest.mark.timeout(120)
def test_rank_that_never_comes_is_named_at_the_timeout():
    (msg, took), _ = run_ranks(_absent, 2, timeout=90)
    assert "timeout" in msg and "rank 1" in msg, msg
    assert 2.5 < took < 8, took


def _waiting_cpu(rank, P, lr):
    x = torch.ones(1000)
    dist.all_reduce(x, group=lr)
    if rank == 0:
        time.sleep(2.0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    dist.all_reduce(x, group=lr)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


@pytest.mark.timeout(120)
def test_waiting_burns_no_cpu():
    cpu = run_ranks(_waiting_cpu, 4, timeout=90)
    for r in (1, 2, 3):  # they waited ~2 s for rank 0
        assert cpu[r] < 0.3, f"rank {r} used {cpu[r]:.2f}s of CPU waiting 2 s: {cpu}"


# ----------------------------------------------------------------------------- LINERATE_SHM
def _mode(rank, P, lr, patch):
    from linerate.transport import shm
    if patch == "host" and rank == 1:
        shm.host_id = lambda: "another-host"
    if patch == "token" and rank == 1:
        shm._mac = lambda secret, name, token: "0" * 64
    try:
        g = dist.new_group(backend="linerate")
    except Exception as e:  # noqa: BLE001
        return "error", str(e)
    x = torch.full((70_001,), float(rank + 1))
    dist.all_reduce(x, group=g)
    y = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    dist.broadcast(y, 0, group=g)
    ok = bool((x == P * (P + 1) / 2).all()) and y.tolist() == [0.0, 1.0, 2.0, 3.0]
    seg = g._ctx.shm
    if g._shm is not None:
        return "shm", ok
    if seg is not None:  # this host's ranks share a segment, the group spans hosts
        return f"local{list(seg.ranks)}", ok
    return "tcp", ok


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env,patch,want", [
    ({}, None, "shm"),
    ({"LINERATE_SHM": "auto"}, None, "shm"),
    ({"LINERATE_SHM": "1"}, None, "shm"),
    ({"LINERATE_SHM": "0"}, None, "tcp"),
    # rank 1 on "another host": ranks 0 and 2 share their host's segment, rank 1 has none
    ({}, "host", ("local[0, 2]", "tcp", "local[0, 2]")),
    ({}, "token", "tcp"),            # the segment's token is refused: TCP
    # co-located ranks must share memory; rank 1, alone on its host, needs none
    ({"LINERATE_SHM": "1"}, "host", ("local[0, 2]", "tcp", "local[0, 2]")),
    ({"LINERATE_SHM": "1"}, "token", "error"),
])
def test_linerate_shm_setting(env, patch, want):
    res = run_ranks(_mode, 3, patch, env=env, timeout=240)
    for rank, (got, detail) in enumerate(res):
        assert got == (want[rank] if isinstance(want, tuple) else want), res
        if want == "error":
            assert "LINERATE_SHM=1" in detail and "[1]" in detail, detail
            if patch == "token":
                assert "token" in detail, detail
        else:
            assert detail is True, res


def _disagree(rank, P, lr):
    os.environ["LINERATE_SHM"] = "0" if rank == 1 else "1"
    try:
        dist.new_group(backend="linerate")
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "created"


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_setting():
    for msg in run_ranks(_disagree, 2, timeout=90):
        assert "LINERATE_SHM" in msg and "same setting" in msg, msg


def _offer(rank, P, lr, local_world):
    """Rank 0 offers a segment for the whole group with its settings; on one host that is the
    group's segment, and no TCP listener is opened. ``local_world``: LOCAL_WORLD_SIZE."""
    if local_world is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    g = dist.new_group(backend="linerate")
    x = torch.full((5_003,), float(rank + 1))
    dist.all_reduce(x, group=g)
    ctx = g._ctx
    offered = json.loads(ctx._rv.offered)
    name = ctx.shm.name if ctx.shm is not None else None
    out = {"offered": offered.get("name"), "segment": name, "tcp": ctx._maker is not None,
           "engine": g._shm is not None, "left": name is not None and os.path.exists(f"/dev/shm/{name}"),
           "sum": x[0].item()}
    dist.destroy_process_group(g)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("local_world", [None, 1])
def test_one_host_group_takes_rank_0s_offered_segment(local_world):
    res = run_ranks(_offer, 3, local_world, timeout=120)
    for r in res:
        assert r["sum"] == 6.0 and r["engine"] and not r["left"], res
        assert not r["tcp"], res  # every peer on this host: no listener, no connection
        if local_world is None:  # offered, and taken: the same name everywhere
            assert r["offered"] == r["segment"] == res[0]["segment"], res
        else:  # this host has fewer ranks than the group, says the launcher: no offer
            assert r["offered"] is None and r["segment"] == res[0]["segment"], res


def _disagree_offered(rank, P, lr):
    """_disagree, with the names of the segments this rank created."""
    from linerate.transport import shm
    made, create = [], shm._create

    def recorded(size):
        out = create(size)
        made.append(out[0])
        return out

    shm._create = recorded
    return _disagree(rank, P, lr), made


@pytest.mark.timeout(120)
def test_offered_segment_is_unlinked_when_the_group_fails():
    # rank 0 offered a segment, rank 1 refuses shared memory; the offered segment's name (not
    # a listing of /dev/shm, where the other test worker's groups come and go)
    res = run_ranks(_disagree_offered, 2, timeout=90)
    for msg, _ in res:
        assert "LINERATE_SHM" in msg and "same setting" in msg, msg
    offered = res[0][1]
    assert len(offered) == 1 and res[1][1] == [], res
    assert not os.path.exists(os.path.join("/dev/shm", offered[0])), offered


# ----------------------------------------------------------------------------- segment proof
def test_segment_is_private_and_authenticated():
    from linerate.transport import shm
    secret = os.urandom(32)
    name, path, token, buf = shm._create(2)
    try:
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600
        assert re.fullmatch(r"linerate-[0-9a-f]{32}", name)
        good = shm._mac(secret, name, token)
        seg = shm._attach(name, 2, secret, good)
        assert seg.numel() == buf.numel()
        with pytest.raises(shm.ShmRefused, match="token"):
            shm._attach(name, 2, secret, shm._mac(os.urandom(32), name, token))  # another job
        buf[shm._TOKEN_OFF] ^= 0xFF  # a segment with another token in it
        with pytest.raises(shm.ShmRefused, match="token"):
            shm._attach(name, 2, secret, good)
        buf[shm._TOKEN_OFF] ^= 0xFF
        os.chmod(path, 0o644)
        with pytest.raises(shm.ShmRefused, match="mode"):
            shm._attach(name, 2, secret, good)
        with pytest.raises(shm.ShmRefused, match="malformed"):
            shm._attach("../etc/passwd", 2, secret, good)
        with pytest.raises(shm.ShmRefused, match="cannot open"):
            shm._attach("linerate-" + "0" * 32, 2, secret, good)
    finally:
        os.unlink(path)


@pytest.mark.timeout(60)
def test_setup_board_carries_the_records_of_ranks_that_mapped_the_offered_segment():
    """Ranks that mapped rank 0's offered segment post on it that they did (and their
    LINERATE_SHM) and ring it; a rank waiting for the group's host records sleeps on it between
    polls of the store. A post ends the wait at once: here nothing is ever set in the store, so
    only the post (at 0.2 s) can end a wait whose polls (at most 60 s apart) would otherwise run
    into the 120 s deadline. A rank that could not map the segment is read from the store."""
    from linerate.transport import rendezvous, shm
    if shm.SYS_FUTEX is None:
        pytest.skip("no futex system call number for this machine: the board is polled")
    name, path, token, buf = shm._create(3)
    try:
        mine, theirs = shm.SetupBoard(buf, 3), shm.SetupBoard(buf, 3)  # ranks 1 and 0
        mine.post(1, "auto")
        keys = [f"t/host/{r}" for r in range(3)]
        rv = rendezvous.Rendezvous(dist.HashStore(), 1, time.monotonic() + 120, 120.0, "t/")
        timer = threading.Timer(0.2, theirs.post, (0, "auto"))
        t0 = time.monotonic()
        timer.start()
        rv.wait_set(keys[:2], max_delay=60.0, bell=mine,
                    pending=lambda ks: [k for r, k in enumerate(ks) if r not in mine.posted()])
        took = time.monotonic() - t0
        timer.join()
        assert 0.15 < took < 10, took
        assert mine.posted() == {0: "auto", 1: "auto"}
        # Rank 2 could not map it (another host): its record comes through the store, and
        # every record is the one the store would hold.
        store = dist.HashStore()
        store.set("t/host/2", json.dumps({"host": "elsewhere", "mode": "auto"}))
        rv = rendezvous.Rendezvous(store, 1, time.monotonic() + 30, 30.0, "t/")
        me = {"host": shm.host_id(), "mode": "auto", "offer": "ok"}
        # (rank 0's record: this rank's but for its process, which it posted: this one here)
        posted = {**me, "pid": [os.getpid(), shm.pidns()]}
        peers = shm._records_of_mappers(rv, "t/", 1, 3, me, mine)
        assert peers == [posted, me, {"host": "elsewhere", "mode": "auto"}], peers
        assert json.loads(store.get("t/host/1")) == me  # for the ranks that cannot read the board
        # Every rank posted: the records come from the board alone, none goes to the store.
        store = dist.HashStore()
        board = shm.SetupBoard(buf, 2)
        board.post(0, "auto")
        board.post(1, "auto")
        rv = rendezvous.Rendezvous(store, 1, time.monotonic() + 30, 30.0, "u/")
        assert shm._records_of_mappers(rv, "u/", 1, 2, me, board) == [posted, me]
        assert not store.check(["u/host/1"]), "a record no rank reads went to the store"
        # A rank that neither posts nor publishes is named at the deadline.
        rv = rendezvous.Rendezvous(dist.HashStore(), 1, time.monotonic() + 0.3, 0.3, "t/")
        with pytest.raises(rendezvous.TransportError, match="t/host/2"):
            shm._records_of_mappers(rv, "t/", 1, 3, me, mine)
    finally:
        os.unlink(path)


class _CountingStore(dist.Store):
    """A Python Store with ``check``, counting the keys each request asks about."""

    def __init__(self):
        super().__init__()
        self.data, self.checked = {}, []

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        self.checked.append(list(keys))
        return all(k in self.data for k in keys)


@pytest.mark.timeout(60)
def test_waiting_for_records_asks_the_store_about_each_key_only_to_name_a_failure():
    """While ranks wait for others' records, each look after the first quick ones asks the store
    two things: are all the keys there, and did a rank report a failure. Which keys are
    missing (one request per key: 31 of them per look at 32 ranks) is asked only to name
    them in an error: at the deadline, or once a rank reported a failure."""
    from linerate.transport import rendezvous
    keys = [f"t/host/{r}" for r in range(8)]
    store = _CountingStore()
    store.set(keys[3], b"{}")
    rv = rendezvous.Rendezvous(store, 1, time.monotonic() + 0.2, 0.2, "t/")
    rv.generation = "g"
    with pytest.raises(rendezvous.TransportError, match="did not appear") as e:
        rv.wait_set(keys, max_delay=0.01)
    assert "t/host/0" in str(e.value) and "t/host/3" not in str(e.value)
    looks = [c for c in store.checked if len(c) > 1]
    singles = [c for c in store.checked if len(c) == 1]
    assert looks, store.checked
    # One fail-key check per look after the first 2 ms, and the naming at the deadline (7 keys).
    assert len(singles) <= len(looks) + 7, (len(singles), len(looks))
    assert sum(1 for c in singles if c == ["t/setup_failed/g"]) >= len(looks) - 4
    # A rank reported a failure: the wait ends with its message and names the missing keys.
    store = _CountingStore()
    store.set("t/setup_failed/g", b"rank 5: no good")
    rv = rendezvous.Rendezvous(store, 1, time.monotonic() + 30, 30.0, "t/")
    rv.generation = "g"
    with pytest.raises(rendezvous.PeerSetupFailed, match="rank 5: no good") as e:
        rv.wait_set(keys, max_delay=0.01)
    assert "'t/host/0'" in str(e.value) and "(and 4 more)" in str(e.value), e.value


def test_pid_watch_sees_exited_processes_zombie_or_reaped_and_closes_its_descriptors():
    """PidWatch (the co-located ranks' liveness): a running process is alive; one killed but
    not reaped (a zombie, as a SIGKILLed rank is until torchrun reaps it) and one reaped are
    gone, in one call for several; a pid that never existed is gone; close() closes every
    pidfd, and a closed watch reports nothing gone."""
    import signal
    import subprocess

    from linerate.transport.shm.sync import PidWatch
    a = subprocess.Popen(["sleep", "30"])
    b = subprocess.Popen(["sleep", "30"])
    w = PidWatch()
    try:
        assert w.exited([a.pid, b.pid]) == set()
        before = len(os.listdir("/proc/self/fd"))
        assert w.alive(a.pid) and w.alive(b.pid)
        assert len(os.listdir("/proc/self/fd")) == before, "one pidfd per process, kept"
        os.kill(a.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while w.alive(a.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        state = open(f"/proc/{a.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        assert state == "Z" and not w.alive(a.pid), "a zombie counts as exited"
        b.kill()
        b.wait()
        assert w.exited([a.pid, b.pid]) == {a.pid, b.pid}
        c = subprocess.Popen(["true"])
        c.wait()
        assert not w.alive(c.pid), "a pid already reaped when first asked about"
        d = subprocess.Popen(["sleep", "30"])
        assert w.alive(d.pid)
        open_fds = len(os.listdir("/proc/self/fd"))
        w.close()
        assert len(os.listdir("/proc/self/fd")) == open_fds - 1, "close() closes the pidfds"
        assert w.exited([d.pid, a.pid]) == set()
        d.kill()
        d.wait()
    finally:
        w.close()
        a.wait()
        for p in (a, b):
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(30)
def test_peer_that_never_finishes_beginning_is_named_at_the_timeout():
    """A rank at this op's tick whose sequence number stays 0 (it died inside begin()): the
    waiter does not spin past the op's timeout, and names the rank."""
    from linerate.collectives.comm import OpTimeout
    (e0, e1), (c0, c1) = _two_engines()
    e1.begin(_Call(c1, 1, 1, "broadcast", 111))
    e1.publish()
    e1.ctrl[1, 1] = 0  # _SEQ, and it stays so
    call = _Call(c0, 0, 1, "broadcast", 111)
    call.timeout = 0.5
    call.deadline = time.monotonic() + 0.5
    e0.begin(call)
    e0.publish()
    t0 = time.monotonic()
    with pytest.raises(OpTimeout, match=r"ranks \[1\] never finished beginning"):
        e0.wait(e0.tick)
    assert time.monotonic() - t0 < 10  # the call's 0.5 s timeout ended it
