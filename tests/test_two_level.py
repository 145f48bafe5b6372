"""Two-level collectives (collectives/two_level.py) and what they stand on.

- ``Comm.sub``: algorithms (ring, direct, chain, halving) run unchanged on subsets of a group
  within one op, beside the op's own runs, without their messages meeting; in the same launch,
  two "hosts" on loopback (patched host ids) run two-level, and a size mismatch is named on
  every rank (small and large all_reduce).
- The algorithm table (no processes): auto choices, overrides; the two-level columns.
- Layouts 2x2, 2x4, 3x3 and 4+3 on thread ranks playing hosts (a per-thread host id), and 4+3
  on netlab hosts (one launch): every two-level op against Gloo on the same inputs (float32,
  float64, int32, bfloat16; SUM, AVG, PRODUCT, MIN, MAX; sizes 0, 1, 7, 1001, 70,001 with
  64 KiB pipeline chunks), a sub-group taking some ranks of a host, random floats
  bit-identical on every rank.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from _harness import garbage_left, run_netlab_script, run_ranks

needs_netlab = pytest.mark.netlab  # skipped with the reason where netlab cannot work (conftest)


# ----------------------------------------------------------------------------- SubComm
def _subcomm(rank, P, lr):
    from linerate.collectives import chain, direct, halving, ring
    from linerate.collectives.stage import Stage
    from linerate.collectives.reduce_ops import RedOpType
    out = {}

    def fn(comm):
        odd, even = [1, 3], [0, 2]
        mine = comm.sub(odd if rank in odd else even, 1 if rank in odd else 2)
        assert mine.size == 2 and mine.ranks[mine.rank] == rank
        x = torch.arange(10.0) + rank
        (ring if rank in odd else direct).all_reduce(mine, x, RedOpType.SUM)
        out["pair"] = x.tolist()
        # a sub-group of three (tag 3), nested: sub-rank 0 of a view of [3, 1, 2] is rank 3
        if rank != 0:
            trio = comm.sub([3, 1, 2], 3)
            y = torch.full((1001,), float(rank))
            halving.all_reduce(trio, y, RedOpType.MAX)
            z = torch.arange(7.0) if rank == 3 else torch.zeros(7)
            chain.broadcast(trio.sub([1, 2, 0], 4), z, 2)  # root: sub-rank 2 = rank 3
            out["trio"] = (y[0].item(), z.tolist())
        w = torch.full((5,), float(rank))
        ring.all_reduce(comm, w, RedOpType.SUM)  # the op's own run, after the subsets'
        out["all"] = w.tolist()

    lr._submit("all_reduce", fn, [], Stage(), 30.0, desc="subcomm").wait()
    # Two "hosts" of two ranks on loopback (their host ids patched): a group of all four runs
    # two-level; a rank that passes another size is named on every rank, at once, small
    # (the fused agreement on the segment) and large (the local reduce-scatter).
    from datetime import timedelta

    from linerate.transport import shm
    shm.host_id = lambda: f"fake-host-{rank // 2}"
    g = dist.new_group(backend="linerate", timeout=timedelta(seconds=30))
    x = torch.arange(3000.0)
    dist.all_reduce(x, group=g)
    out["two_level"] = (g._shape.two_level_auto, x[:3].tolist())
    out["mismatch"] = []
    for n in (1000, 3_000_000):
        y = torch.ones(n + (rank == 3))
        try:
            dist.all_reduce(y, group=g)
            out["mismatch"].append("completed")
        except Exception as e:  # noqa: BLE001
            out["mismatch"].append(str(e))
        g = dist.new_group(backend="linerate", timeout=timedelta(seconds=30))
    return out


@pytest.mark.timeout(120)
def test_subcomm_runs_algorithms_on_subsets():
    res = run_ranks(_subcomm, 4, timeout=90)
    for rank, r in enumerate(res):
        pair = (1, 3) if rank in (1, 3) else (0, 2)
        assert r["pair"] == [2 * i + sum(pair) for i in range(10)], r
        assert r["all"] == [6.0] * 5
        if rank:
            assert r["trio"] == (3.0, [float(i) for i in range(7)]), r
        assert r["two_level"] == (True, [0.0, 4.0, 8.0]), r
        for n, msg in zip((1001, 3_000_001), r["mismatch"]):  # rank 3's call is named
            assert f"float32[{n}]" in msg and "rank 3" in msg and "all_reduce" in msg, (rank, msg)


def _no_garbage(rank, P, lr):
    """Two "hosts" of two ranks on loopback; every two-level op, and large async all_reduces
    queued back to back (pipelined, chained), with the collector off: what they leave for it."""
    from datetime import timedelta

    from linerate.transport import shm
    shm.host_id = lambda: f"fake-host-{rank // 2}"
    g = dist.new_group(backend="linerate", timeout=timedelta(seconds=30))
    bigs = [torch.ones(1 << 20) for _ in range(3)]
    small = torch.ones(1001)
    outs = [torch.empty(1001) for _ in range(P)]

    def ops():
        for w in [dist.all_reduce(t, group=g, async_op=True) for t in bigs]:
            w.wait()
        dist.all_reduce(bigs[0], group=g)
        dist.all_reduce(small, group=g)
        dist.broadcast(small, 1, group=g)
        dist.reduce(bigs[1], 2, group=g)
        dist.all_gather(outs, small, group=g)
        dist.reduce_scatter(small, outs, group=g)
        dist.barrier(group=g)

    ops()
    ops()
    assert g._shape.two_level_auto
    out = garbage_left(ops, 4)
    out["chained"] = g._get_backend(torch.device("cpu")).chain_stats["ops"]
    return out


@pytest.mark.timeout(120)
def test_two_level_ops_leave_nothing_for_the_garbage_collector():
    """An op's SubComms point back at its Comm, and a chained op's tail is a closure over it:
    unless Comm.end breaks those cycles, each round here leaves hundreds of objects (Comms,
    SubComms, the helper threads' Futures and Conditions) that only a collection frees; a
    full collection of a process with torch imported takes tens of milliseconds, and each
    rank's stalls every rank's collectives."""
    # fusion up to 64 KiB: the large async calls are ops of their own, which chain
    res = run_ranks(_no_garbage, 4, timeout=90,
                    env={"LINERATE_PIPELINE": "1", "LINERATE_FUSION_BYTES": "64K",
                         "OMP_NUM_THREADS": "1"})
    for rank, r in enumerate(res):
        assert r["garbage"] < r["rounds"], (rank, r)  # nothing per round
    assert any(r["chained"] for r in res), res  # the chained path ran


# ----------------------------------------------------------------------------- the table
def _shape(hosts, shared=True):
    from linerate.collectives.algorithms import Shape
    return Shape(sum(len(h) for h in hosts), tuple(tuple(h) for h in hosts), shared)


def test_table_auto():
    from linerate.collectives.algorithms import choose
    two = _shape([[0, 1, 2, 3], [4, 5, 6, 7]])
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        for n in (0, 4096, 64 << 20):
            assert choose(op, n, two) == "two_level", (op, n)
        assert choose(op, 64 << 20, two, worker=False) != "two_level"  # beside the worker
    for op in ("gather", "scatter", "all_to_all"):
        assert choose(op, 1 << 20, two) == "direct"
    assert choose("barrier", 0, two) == "dissemination"
    assert choose("agree", 0, two) == "two_level"
    one = _shape([[0, 1, 2, 3]])
    for op in ("all_reduce", "all_to_all", "barrier", "agree", "broadcast"):
        assert choose(op, 1 << 20, one) == "shm"
    assert choose("all_reduce", 1 << 20, one, worker=False) == "ring"  # prioritized: TCP
    # one rank per host, or co-located ranks without shared memory: the flat size rule
    for shape in (_shape([[0], [1], [2], [3]]), _shape([[0, 1], [2, 3]], shared=False)):
        assert choose("all_reduce", 4096, shape) == "direct"
        assert choose("all_reduce", 64 << 20, shape) == "ring"
        assert choose("reduce_scatter", 64 << 20, shape) == "ring"
        assert choose("broadcast", 64 << 20, shape) == "chain"
        assert choose("broadcast", 4096, shape) == "direct"
    eight = _shape([[i] for i in range(8)])
    assert choose("all_reduce", 128 << 10, eight) == "hd"
    assert choose("all_reduce", 1 << 20, eight) == "ring"
    assert choose("all_reduce", 10, _shape([[0]])) == "direct"
    # uneven hosts and a host with one rank of the group
    assert choose("all_reduce", 1 << 20, _shape([[0, 1, 2, 3], [4, 5, 6]])) == "two_level"
    assert choose("all_reduce", 1 << 20, _shape([[0, 2], [1]])) == "two_level"


def test_table_overrides():
    from linerate.collectives.algorithms import choose
    two = _shape([[0, 1], [2, 3]])
    one = _shape([[0, 1, 2]])
    flat = _shape([[0], [1], [2]])
    noshm = _shape([[0, 1], [2, 3]], shared=False)
    for shape in (two, one):  # a flat algorithm is forced, over TCP even on one host
        assert choose("all_reduce", 1 << 20, shape, allreduce_algo="hd") == "hd"
        assert choose("all_reduce", 10, shape, allreduce_algo="ring") == "ring"
        assert choose("all_gather", 10, shape, allreduce_algo="ring") == "ring"
        assert choose("reduce_scatter", 1 << 20, shape, allreduce_algo="direct") == "direct"
        assert choose("broadcast", 10, shape, rooted_algo="chain") == "chain"
        assert choose("reduce", 1 << 20, shape, rooted_algo="direct") == "direct"
    assert choose("reduce_scatter", 1 << 20, two, allreduce_algo="hd") == "two_level"
    assert choose("all_gather", 10, flat, allreduce_algo="hd") == "direct"
    # doubling is an all_reduce: the gathers take the automatic choice under it
    assert choose("all_gather", 1 << 20, flat, allreduce_algo="doubling") == "ring"
    assert choose("reduce_scatter", 10, flat, allreduce_algo="doubling") == "direct"
    assert choose("all_reduce", 10, flat, allreduce_algo="doubling") == "doubling"
    # two_level is forced where it can run: one host, one rank per host; not without shm
    for shape in (two, one, flat):
        assert choose("all_reduce", 10, shape, allreduce_algo="two_level") == "two_level"
        assert choose("reduce", 10, shape, rooted_algo="two_level") == "two_level"
    assert choose("all_reduce", 1 << 20, noshm, allreduce_algo="two_level") == "ring"
    assert choose("all_reduce", 1 << 20, two, allreduce_algo="two_level", worker=False) == "ring"
    with pytest.raises(ValueError, match="no algorithm table entry"):
        choose("all_reduce_twice", 1, two)


def test_pipe_choice():
    """LINERATE_PIPELINE: 1 and 0 fixed; auto pipelined while link-bound (asked again every
    RECHECK ops), else both tried and the faster kept, the other tried again every RETRY ops;
    decisions only from exchanged values; an op right after a switch is not counted."""
    from linerate.collectives.two_level import PipeChoice as PC
    with pytest.raises(ValueError, match="LINERATE_PIPELINE"):
        PC("yes")
    asked = []

    def run(choice, per_byte, ops):
        modes = []
        for _ in range(ops):
            pipe, counted = choice.next_op(lambda vals: asked.append(list(vals)) or list(vals))
            modes.append(pipe)
            if counted:
                choice.note(pipe, per_byte[pipe])
        return modes

    for setting, want in (("1", True), ("0", False)):
        assert run(PC(setting), {True: 1.0, False: 1.0}, 50) == [want] * 50
    assert asked == []
    G = PC.GATE_AT
    # link-bound (1 Gbit/s: 8 ns per byte): pipelined throughout, the gate asked at op G and
    # again RECHECK ops later
    slow = PC("auto")
    n = G + PC.RECHECK + 1
    assert run(slow, {True: 8e-9, False: 1e-9}, n) == [True] * n
    assert asked == [[8e-9, 1.0], [8e-9, 1.0]] and slow.state == "pipe"
    asked.clear()
    # fast (unshaped: 1.5 ns per byte pipelined, 1.0 as one chunk): explore, then one chunk,
    # with two pipelined probes before each RETRY-th op
    fast = PC("auto")
    k = G + len(PC.EXPLORE)
    modes = run(fast, {True: 1.5e-9, False: 1.0e-9}, k + 1 + PC.RETRY + 1)
    assert modes[:k] == [True] * G + list(PC.EXPLORE)  # the gate's op is the trial's first
    assert modes[k:k + PC.RETRY - 2] == [False] * (PC.RETRY - 2)
    assert modes[k + PC.RETRY - 2:k + PC.RETRY] == [True, True]  # the probes
    assert modes[k + PC.RETRY] is False  # still one chunk after agreeing again
    assert asked[0] == [1.5e-9, 1.0]
    assert asked[1] == [1.5e-9, 1.0, 1.0e-9, 1.0] and len(asked) == 3
    tried = G + PC.EXPLORE.count(True) + 2
    assert fast.used == {True: tried, False: len(modes) - tried} and fast.exchanges == 3
    # one slow op before the gate (a full garbage collection: 4.2 ns per byte, the bound 4.0)
    # does not decide: the best of the counted ones does
    asked.clear()
    stalled = PC("auto")
    for m in range(G + 1):
        pipe, counted = stalled.next_op(lambda vals: asked.append(list(vals)) or list(vals))
        if counted:
            stalled.note(pipe, 4.2e-9 if m == 1 else 1.5e-9)
    assert asked == [[1.5e-9, 1.0]] and stalled.state == "explore"
    # where one chunk was measured slower, the explored group goes back to the pipeline
    asked.clear()
    back = PC("auto")
    modes = run(back, {True: 1.0e-9, False: 1.5e-9}, G + len(PC.EXPLORE) + 5)
    assert modes[G + len(PC.EXPLORE):] == [True] * 5 and back.pipe is True
    # a rank whose last op's end was chained into the next one has no time yet: it counts 0
    assert PC("auto")._mine(True) == [0.0, 0.0]


def test_plan_columns():
    """Every local rank owns a column; columns of a rank are contiguous; owners per column."""
    from linerate.collectives.two_level import Plan
    for hosts in ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6]], [[0, 2], [1], [3, 4, 5]],
                  [[0, 1, 2], [3, 4, 5], [6, 7, 8]]):
        L = max(len(h) for h in hosts)
        owned: dict = {}
        for h in hosts:
            for r in h:
                p = Plan(hosts, r)
                assert p.runs, (hosts, r)  # carries inter-host traffic
                assert p.cols and all(i % len(h) == h.index(r) for i in p.cols)
                for c0, c1, members in p.runs:
                    assert r in members and len(members) == len(hosts)
                    for c in range(c0, c1):
                        owned.setdefault(c, set()).add(r)
        assert sorted(owned) == list(range(L))
        assert all(len(v) == len(hosts) for v in owned.values())  # one owner per host
    p = Plan([[0, 1, 2, 3], [4, 5, 6, 7]], 5)
    assert p.runs == [(1, 2, (1, 5))] and p.cols == [1]
    assert p.bounds(10) == [0, 3, 6, 8, 10]


# ----------------------------------------------------------------------------- layouts
# Every rank loops over ops, dtypes and sizes, each against Gloo on the same inputs, then a
# sub-group taking some ranks of a host. One function, two harnesses: thread ranks playing
# hosts (a per-thread host id: shared memory within a "host", TCP on loopback between them)
# for every layout, and one netlab launch (rank processes in network namespaces, torchrun's
# variables) for one layout.
LAYOUTS = {"2x2": [2, 2], "2x4": [4, 4], "3x3": [3, 3, 3], "4+3": [4, 3]}


def _hosts_of(counts):
    hosts, r = [], 0
    for c in counts:
        hosts.append(list(range(r, r + c)))
        r += c
    return hosts


def _sub_of(hosts):
    """The sub-group: some ranks of the first host and the first rank of each other."""
    return hosts[0][:max(2, len(hosts[0]) - 1)] + [h[0] for h in hosts[1:]]


def _layout_matrix(d, rank, P, lr, gl, lr_sub, gl_sub, sub, root_of):
    """``d``: torch.distributed (a rank process) or tests/_threads.ThreadDist; ``lr``/``gl``
    the linerate and Gloo groups as ``d`` names them; ``lr_sub``/``gl_sub`` the sub-group's;
    ``root_of(g, root)``: the rank ``d`` takes for group ``g``'s rank ``root``."""
    import hashlib

    import torch
    R = d.ReduceOp
    DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
              "bfloat16": torch.bfloat16}
    fails, cases = [], [0]

    def values(n, dt, seed, prod=False):
        g = torch.Generator().manual_seed(seed)
        if prod:  # powers of two: products exact in every dtype
            return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).mul(
                torch.randint(1, 3, (n,), generator=g)).to(dt)
        return torch.randint(-3, 4, (n,), generator=g).to(dt)

    pending = []  # compared at the end: a batched ThreadDist's reference is read after settle()

    def check(what, a, b, then=None):
        pending.append((what, a, b, then))

    def compare():
        if hasattr(d, "settle"):
            d.settle()
        for what, a, b, then in pending:
            if then is not None:
                b = then(b)
            cases[0] += 1
            if not torch.equal(a, b):
                bad = (a != b).nonzero()
                fails.append(f"rank {rank}: {what}: {bad.numel()} elements differ, first at "
                             f"{bad[0].tolist()}: {a.reshape(-1)[bad[0]].tolist()} vs gloo "
                             f"{b.reshape(-1)[bad[0]].tolist()}")
        pending.clear()

    def run(g, gl, me, size, sizes, dtypes, tag):
        for n in sizes:
            for dname in dtypes:
                dt = DTYPES[dname]
                ops = [R.SUM, R.MAX, R.MIN, R.PRODUCT] + ([R.AVG] if dt.is_floating_point else [])
                for op in ops:
                    x = values(n, dt, 7 * me + n, prod=op == R.PRODUCT)
                    a, b = x.clone(), x.clone()
                    d.all_reduce(a, op=op, group=g)
                    d.all_reduce(b, op=R.SUM if op == R.AVG else op, group=gl)
                    check(f"{tag} all_reduce {dname}[{n}] {op}", a, b,
                          (lambda t: t.div(size)) if op == R.AVG else None)
                x = values(n * size, dt, 11 * me + n)
                a, b = torch.empty(n, dtype=dt), torch.empty(n, dtype=dt)
                d.reduce_scatter_tensor(a, x, group=g)
                d.reduce_scatter_tensor(b, x, group=gl)
                check(f"{tag} reduce_scatter {dname}[{n}]", a, b)
                x = values(n, dt, 13 * me + n)
                a, b = torch.empty(n * size, dtype=dt), torch.empty(n * size, dtype=dt)
                d.all_gather_into_tensor(a, x, group=g)
                d.all_gather_into_tensor(b, x, group=gl)
                check(f"{tag} all_gather {dname}[{n}]", a, b)
                for root in sorted({0, size // 2, size - 1}):
                    a, b = x.clone(), x.clone()
                    d.broadcast(a, root_of(g, root), group=g)
                    d.broadcast(b, root_of(gl, root), group=gl)
                    check(f"{tag} broadcast {dname}[{n}] root {root}", a, b)
                    a, b = x.clone(), x.clone()
                    d.reduce(a, root_of(g, root), group=g)
                    d.reduce(b, root_of(gl, root), group=gl)
                    check(f"{tag} reduce {dname}[{n}] root {root}", a,
                          b if me == root else x)  # a non-root's input is left alone

    run(lr, gl, rank, P, [0, 1, 7, 1001, 70_001], list(DTYPES), "world")
    # random floats: every rank the same bits (a digest of each result, gathered over Gloo)
    digests = []
    for n, dt in ((70_001, torch.float32), (1001, torch.bfloat16), (300_001, torch.float64)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dt)
        d.all_reduce(x, group=lr)
        digests.append(int.from_bytes(hashlib.blake2b(x.view(torch.uint8).numpy().tobytes(),
                                                      digest_size=7).digest(), "little"))
    every = [torch.zeros(3, dtype=torch.int64) for _ in range(P)]
    d.all_gather(every, torch.tensor(digests), group=gl)
    compare()
    if any(not torch.equal(e, every[0]) for e in every):
        fails.append(f"rank {rank}: random-float results differ between ranks: {every}")
    if rank in sub:
        run(lr_sub, gl_sub, sub.index(rank), len(sub), [7, 70_001], ["float32", "int32"], "sub")
    compare()
    return {"fails": fails[:20], "nfail": len(fails), "cases": cases[0]}


def _check_layout(out: dict, world: int):
    assert sorted(out) == list(range(world)), sorted(out)
    for rank, o in out.items():
        assert o["nfail"] == 0, "\n".join(o["fails"])
        assert o["cases"] > 100 and o["two_level"], o
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
            assert f"{op}:two_level" in o["algos"], o["algos"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_against_gloo(name, monkeypatch):
    """Thread ranks (tests/_threads.py); a per-thread host id places them on the layout's
    hosts."""
    import threading

    from _threads import run_threads
    from linerate.collectives import two_level
    from linerate.transport import shm
    monkeypatch.setattr(two_level, "PIPE_BYTES", 64 << 10)  # several pipeline chunks from 64 KiB
    hosts = _hosts_of(LAYOUTS[name])
    host_of = {r: i for i, h in enumerate(hosts) for r in h}
    where = threading.local()
    host_id = shm.host_id
    monkeypatch.setattr(shm, "host_id", lambda: f"{host_id()}/h{where.host}")
    sub = _sub_of(hosts)

    def rank_main(d, rank):
        lr_sub, gl_sub = d.new_group(sub)
        o = _layout_matrix(d, rank, d.world, d.lr, None, lr_sub, gl_sub, sub,
                           lambda g, root: root)
        o["algos"] = sorted({f"{r.op}:{r.algorithm}" for r in d.lr._flight.ring})
        o["two_level"] = d.lr._shape.two_level_auto
        return o

    world = sum(LAYOUTS[name])
    out = run_threads(rank_main, world, as_dist="batched", timeout=280,
                      before=lambda r: setattr(where, "host", host_of[r]))
    _check_layout(dict(enumerate(out)), world)


NETLAB_LAYOUT = "4+3"
RANK_SCRIPT = "\n".join([
    "import json, os",
    "import torch",
    "import torch.distributed as dist",
    inspect.getsource(_sub_of),
    inspect.getsource(_layout_matrix),
    '''
from linerate.collectives import two_level
two_level.PIPE_BYTES = 64 << 10  # several pipeline chunks from 64 KiB on
dist.init_process_group("linerate")
rank, P = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
# the layout from torchrun's variables, as netlab sets them (hosts filled in order)
hosts = json.loads(os.environ["TL_HOSTS"])
sub = _sub_of(hosts)
lr_sub, gl_sub = dist.new_group(sub, backend="linerate"), dist.new_group(sub, backend="gloo")
o = _layout_matrix(dist, rank, P, None, gloo, lr_sub, gl_sub, sub,
                   lambda g, root: root if g is None else dist.get_global_rank(g, root))
pg = dist.group.WORLD._get_backend(torch.device("cpu"))
o["algos"] = sorted({f"{r.op}:{r.algorithm}" for r in pg._flight.ring})
o["two_level"] = pg._shape.two_level_auto
print("TL", rank, json.dumps(o), flush=True)
dist.destroy_process_group()
'''])


@needs_netlab
@pytest.mark.timeout(150)
def test_layout_against_gloo_between_netlab_hosts(lab_name, tmp_path):
    """One layout (NETLAB_LAYOUT) as rank processes on netlab hosts: network namespaces,
    separate hosts to the kernel, launched by torchrun as a job is."""
    import json
    counts = LAYOUTS[NETLAB_LAYOUT]
    res, out = run_netlab_script(
        lab_name, tmp_path, RANK_SCRIPT,
        ["--hosts", str(len(counts)), "--rate", "none", "--ranks-per-host", ",".join(map(str, counts))],
        "TL", env={"TL_HOSTS": json.dumps(_hosts_of(counts)), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    _check_layout(out, sum(counts))


# ----------------------------------------------------------------------------- rails
RAILS_SCRIPT = r'''
import json, os
import torch
import torch.distributed as dist
dist.init_process_group("linerate")
rank, P = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
x = torch.arange(3 << 20, dtype=torch.float32) % 7 + rank   # 12 MB: the two-level all_reduce
want = x.clone()
dist.all_reduce(x)
dist.all_reduce(want, group=gloo)
ok = torch.equal(x, want)
# every pair of ranks on different hosts talks directly (the links the plan decides)
for peer in range(P):
    if peer != rank:
        y = torch.full((1 << 18,), float(rank))
        z = torch.empty(1 << 18)
        w = dist.irecv(z, peer)
        dist.send(y, peer)
        w.wait()
        ok = ok and bool((z == peer).all())
pg = dist.group.WORLD._get_backend(torch.device("cpu"))
addrs = pg._ctx.addresses
rails = {}
for c in pg.connection_stats():
    if c["local"] in addrs:
        rails.setdefault(c["peer"], []).append(addrs.index(c["local"]))
print("RAILS", rank, json.dumps({"ok": ok, "rails": {p: sorted(set(r)) for p, r in rails.items()},
                                 "conns": {p: len(r) for p, r in rails.items()}}), flush=True)
dist.destroy_process_group()
'''


@needs_netlab
@pytest.mark.timeout(150)
@pytest.mark.parametrize("spread", ["auto", "0"])
def test_rails_spread_over_local_ranks(spread, lab_name, tmp_path):
    """2 hosts x 2 ranks x 4 rails: with LINERATE_RAIL_SPREAD=auto a link between hosts uses
    the rails of the lower rank's local index (local rank 0: rails 0 and 2, local rank 1: 1
    and 3), LINERATE_NSOCKS connections on each; with 0 every link stripes over all 4 rails.
    Results against Gloo either way."""
    from linerate.transport.tcp import spread_rails
    assert spread_rails(0, 2, 4) == [0, 2] and spread_rails(1, 2, 4) == [1, 3]
    assert spread_rails(5, 8, 4) == [1] and spread_rails(2, 3, 2) == [0]
    res, out = run_netlab_script(
        lab_name, tmp_path, RAILS_SCRIPT,
        ["--hosts", "2", "--rate", "none", "--rails", "4", "--ranks-per-host", "2"], "RAILS",
        env={"OMP_NUM_THREADS": "1", "LINERATE_RAIL_SPREAD": spread, "LINERATE_NSOCKS": "1"},
        timeout=100)
    assert res.returncode == 0 and sorted(out) == [0, 1, 2, 3], res.stdout[-4000:] + res.stderr[-4000:]
    host = {0: 0, 1: 0, 2: 1, 3: 1}
    for rank, o in out.items():
        assert o["ok"], o
        remote = {int(p): r for p, r in o["rails"].items()}
        assert sorted(remote) == [p for p in range(4) if host[p] != host[rank]], o  # shm within
        for p, rails in remote.items():
            lower = min(p, rank)
            expect = ([0, 2] if lower % 2 == 0 else [1, 3]) if spread == "auto" else [0, 1, 2, 3]
            assert rails == expect, (rank, p, o)
            assert o["conns"][str(p)] == len(expect), o


# ----------------------------------------------------------------------------- chaining
CHAIN_SCRIPT = r'''
import json, os, time
from datetime import timedelta
import torch
import torch.distributed as dist
import linerate.collectives.backend as backend
from linerate.collectives import two_level
two_level.PIPE_BYTES = 256 << 10   # several pipeline chunks from 256 KiB on
backend.CHAIN_MIN_BYTES = 64 << 10
if os.environ.get("EXPLORE_EVERY"):  # one chunk and pipelined in turn, agreed often
    two_level.PipeChoice.FAST_BPS = 0.0
    two_level.PipeChoice.RETRY = int(os.environ["EXPLORE_EVERY"])
R = dist.ReduceOp
dist.init_process_group("linerate")
rank, P = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
pg = dist.group.WORLD._get_backend(torch.device("cpu"))
fails = []


def values(n, dt, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n,), generator=g).to(dt)


# Bursts of async all_reduces queued at once (as DDP queues its buckets): each large one may
# chain to the next; an AVG, a small one and a two-tensor call among them are not chainable.
calls = [(300_001, torch.float32, R.SUM), (1_000_003, torch.float32, R.SUM),
         (70_001, torch.int32, R.MAX), (400_000, torch.float64, R.MIN),
         (123, torch.float32, R.SUM), (250_000, torch.float32, R.AVG),
         (500_001, torch.int32, R.PRODUCT), (600_000, torch.float32, R.SUM)]
for rnd in range(3):
    ins = [values(n, dt, 1000 * rnd + 10 * i + rank) for i, (n, dt, _) in enumerate(calls)]
    if rnd == 2:  # products stay exact: +-1 and +-2
        ins[6] = (ins[6] % 2 * 2 - 1).to(torch.int32)
    mine = [x.clone() for x in ins]
    works = [dist.all_reduce(x, op=op, async_op=True) for x, (_, _, op) in zip(mine, calls)]
    if rnd == 1:  # and a call of two tensors in one work, between bursts
        pair = [values(200_000, torch.float32, 7 + rank), values(90_000, torch.float32, 8 + rank)]
        works.append(pg.allreduce([t for t in pair]))
    for w in works:
        w.wait()
    for i, ((n, dt, op), x, y) in enumerate(zip(calls, mine, ins)):
        want = y.clone()
        dist.all_reduce(want, op=R.SUM if op == R.AVG else op, group=gloo)
        if op == R.AVG:
            want = want / P
        if not torch.equal(x, want):
            bad = (x != want).nonzero()
            fails.append(f"rank {rank}: round {rnd} call {i} {dt}[{n}] {op}: {bad.numel()} "
                         f"differ, first at {bad[0].tolist()}")
# Synchronous calls: run in the caller's thread where the worker is idle (odd ranks wait for
# the first call), queued behind it elsewhere: the host's ranks still agree in each.
for rnd in range(4):
    a, b = values(300_000, torch.float32, rnd + rank), values(300_000, torch.float32, 50 + rank)
    a0, b0 = a.clone(), b.clone()
    wa = dist.all_reduce(a, async_op=True)
    if rank % 2:
        wa.wait()
    dist.all_reduce(b)
    wa.wait()
    for name, x, x0 in (("async", a, a0), ("sync", b, b0)):
        dist.all_reduce(x0, group=gloo)
        if not torch.equal(x, x0):
            fails.append(f"rank {rank}: sync round {rnd}: the {name} call differs from Gloo")
chained = pg.chain_stats["ops"]
choice = pg._plan.pipe
# LINERATE_NSOCKS auto: one connection per link to another host (the columns run side by side)
streams = sorted({peer.link.nstreams for peer in pg._ctx.peers.values()
                  if peer.link is not None and peer.link.kind == "tcp"})
pipe = {"used": [choice.used[True], choice.used[False]], "exchanges": choice.exchanges,
        "state": choice.state, "pipe": choice.pipe, "m": choice.m}
# A chained op followed by one whose size differs on one rank: every rank fails within the
# timeout (no hang), naming a rank and the op.
g = dist.new_group(backend="linerate", timeout=timedelta(seconds=15))
errs = []
t0 = time.monotonic()
xs = [torch.ones(400_000), torch.ones(400_000 + (8 if rank == P - 1 else 0)), torch.ones(400_000)]
ws = [dist.all_reduce(x, group=g, async_op=True) for x in xs]
for w in ws:
    try:
        w.wait()
    except Exception as e:  # noqa: BLE001
        errs.append(str(e)[:300])
print("CH", rank, json.dumps({"fails": fails[:10], "chained": chained, "errs": errs,
                              "secs": time.monotonic() - t0, "pipe": pipe,
                              "streams": streams}), flush=True)
# Every rank is through before any exits: where rank 0's process hosts the Store (a job
# started by hand; netlab run hosts it apart, as torchrun does), a rank still setting the
# group up when the others failed would otherwise lose it
dist.barrier(group=gloo)
os._exit(0)  # the broken group: no orderly teardown needed
'''


@needs_netlab
@pytest.mark.timeout(150)
@pytest.mark.parametrize("pipeline", ["auto", "explore"])
def test_chained_all_reduces_match_gloo(pipeline, lab_name, tmp_path):
    """Queued two-level all_reduces chain (the next one's first phase before this one's end):
    results equal Gloo's for every dtype and op, AVG and small calls among them; a chained
    op's successor that differs fails every rank within the timeout. ``explore``: the large
    ones run pipelined and as one chunk in turn (LINERATE_PIPELINE=auto made to try both
    and to agree every 4 ops): chained across the two modes, still Gloo's results, and every
    rank took the same decisions."""
    # fusion up to 64 KiB: the large calls are ops of their own (DDP's buckets exceed 4 MiB)
    env = {"OMP_NUM_THREADS": "1", "LINERATE_FUSION_BYTES": "64K"}
    if pipeline == "explore":
        env["EXPLORE_EVERY"] = "4"
    res, out = run_netlab_script(
        lab_name, tmp_path, CHAIN_SCRIPT, ["--hosts", "2", "--rate", "none", "--ranks-per-host", "2"],
        "CH", env=env)
    assert sorted(out) == [0, 1, 2, 3], res.stdout[-4000:] + res.stderr[-4000:]
    if pipeline == "explore":
        first = out[0]["pipe"]
        assert all(o["pipe"] == first for o in out.values()), [o["pipe"] for o in out.values()]
        assert first["used"][0] > 0 and first["used"][1] > 0, first  # both modes ran
        assert first["exchanges"] >= 3, first
    for rank, o in out.items():
        assert not o["fails"], o["fails"]
        assert o["streams"] == [1], o  # one TCP connection to each rank of the other host
        assert o["chained"] > 0, o  # the bursts did chain
        assert o["errs"], f"rank {rank} completed the differing calls"
        assert o["secs"] < 15, o
        assert any("all_reduce" in e for e in o["errs"]), o["errs"]
        # the first error names the root cause, the size that differs, on every rank (a rank
        # that left the failed op for the next one is not taken for a sequence mismatch)
        assert "float32[400008]" in o["errs"][0], o["errs"]
