"""Every collective of the ``linerate`` process group against Gloo's output on the same inputs.

One test per (world size, family of collectives), ranks as threads of this process
(tests/_threads.py, the unit tier): each rank runs the whole matrix of dtypes x ops x sizes on
both backends (Gloo the default group, linerate a group of the same ranks, through
torch.distributed's functions: ``ThreadDist``) and compares. The Gloo calls, the reference, are
batched (``ThreadDist`` ``batched``: the same bits as one Gloo call per case, checked here for
every kind of call). Inputs are small integers (also for floating point dtypes), so every sum
and product is exact and results must be bit-identical (``torch.equal``); one family uses
random normal data and compares with ``allclose`` (the order of a reduction may differ from
Gloo's). The same sweep also runs on rank processes (``_run_processes``) for what only they
show: the shared segment mapped by separate processes, torch.distributed's own groups.

Sizes: 0, 1, 7 and 1001 elements run the latency-optimal ("direct") paths; BIG (70,001
elements, > 64 KiB even for 1-byte dtypes) runs the ring/chain paths (LINERATE_SMALL_BYTES is
64 KiB by default). The ``pipelined`` cases force ring/chain for every size with 4 KiB pieces.
"""
from __future__ import annotations

import itertools
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceCoalescedOptions, ReduceScatterOptions

from _harness import run_ranks
from _threads import run_threads

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]
BIG = 70_001          # > 64 KiB in every dtype: ring / chain paths
HUGE = 300_001        # a few larger cases (float32, int64)
SMALL_SIZES = [0, 1, 7, 1001]

PIPELINED_ENV = {"LINERATE_ALLREDUCE_ALGO": "ring", "LINERATE_ROOTED_ALGO": "chain",
                 "LINERATE_PIECE_BYTES": "4096", "LINERATE_SMALL_BYTES": "0"}
PIPELINED_DTYPES = [torch.float32, torch.float16, torch.complex128, torch.int8, torch.int64, torch.bool]
PIPELINED_SIZES = [0, 1, 7, 1001, 20_001]
#: 16 ranks (parity with Gloo at scale) on few cores: fewer dtypes and sizes per spawn.
WIDE_DTYPES = [torch.float32, torch.bfloat16, torch.complex64, torch.int64, torch.bool]
WIDE_SIZES = [0, 1, 1001]


def ops_for(dtype):
    if dtype.is_complex:
        return [R.SUM, R.AVG]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def _name(x) -> str:
    return str(x).replace("torch.", "").replace("RedOpType.", "")


# ----------------------------------------------------------------------------- rank-side helpers
class Ctx:
    """What a family needs: rank, size, the linerate group, ``d`` (torch.distributed in a rank
    process, its thread-rank counterpart tests/_threads.ThreadDist on threads), a case counter,
    the failures.

    With a ThreadDist that batches the Gloo calls, a check waits for ``settle()`` (which runs
    them), and so does what ``then(fn)`` is given: a family reads a Gloo result only there.
    In a rank process both run at once and ``settle()`` does nothing."""

    def __init__(self, rank, P, lr, variant, d=dist):
        self.rank, self.P, self.lr, self.variant, self.d = rank, P, lr, variant, d
        self.fails: list[str] = []
        self.ncases = 0
        self._case = itertools.count()
        self._checks: list | None = [] if getattr(d, "settle", None) else None
        self._then: list = []

    def settle(self) -> None:
        if self._checks is not None:
            self.d.settle()
            then, self._then = self._then, []
            for fn in then:
                fn()
            checks, self._checks = self._checks, []
            for args in checks:
                self._check(*args)

    def then(self, fn) -> None:
        """``fn()`` once the Gloo results are in (at once in a rank process)."""
        if self._checks is None:
            fn()
        else:
            self._then.append(fn)

    def gen(self, salt: int = 0, same_on_all_ranks: bool = False) -> torch.Generator:
        """A generator for the next case; different per rank unless same_on_all_ranks."""
        k = next(self._case)
        return torch.Generator().manual_seed(1_000_003 * k + 7919 * salt + (0 if same_on_all_ranks else self.rank + 1))

    def check(self, cid: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.ncases += 1
        if self._checks is not None:
            self._checks.append((cid, got, want))
        else:
            self._check(cid, got, want)

    def _check(self, cid: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape:
            self.fails.append(f"rank {self.rank}: {cid}: got {got.dtype} {tuple(got.shape)}, "
                              f"want {want.dtype} {tuple(want.shape)}")
        elif not torch.equal(got, want):
            bad = (got != want).nonzero()
            i = tuple(bad[0].tolist())
            self.fails.append(f"rank {self.rank}: {cid}: {bad.shape[0]} of {want.numel()} elements differ, "
                              f"first at {i}: got {got[i].item()} want {want[i].item()}")

    def at(self, cid: str) -> str:
        """Note the case about to run (named if it raises)."""
        self.current = cid
        return cid

    def sizes(self, dtype=None):
        if self.variant == "pipelined":
            return PIPELINED_SIZES
        if self.variant == "wide":  # 16 ranks: small tensors, one ring-sized case
            return WIDE_SIZES + ([20_001] if dtype == torch.float32 else [])
        if self.P >= 8:  # small tensors only on 8 ranks; one > 64 KiB case for the ring paths
            return SMALL_SIZES + ([20_001] if dtype in (torch.float32, torch.int64) else [])
        return SMALL_SIZES + [BIG] + ([HUGE] if dtype in (torch.float32, torch.int64) else [])

    def dtypes(self):
        if self.variant == "wide":
            return WIDE_DTYPES
        return PIPELINED_DTYPES if self.variant == "pipelined" else DTYPES


def _shape(n: int):
    return (7, 143) if n == 1001 else (n,)


def rand_int(g, dtype, shape, kind="sum", P=1) -> torch.Tensor:
    """Small integers (any dtype): sums/products of P of them are exact everywhere."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if kind == "prod":  # products of P values stay exact: +-1 and a few 2s only for P <= 4
        if dtype == torch.uint8:
            choices = torch.tensor([1, 2] if P <= 4 else [0, 1])
        else:
            choices = torch.tensor([-1, 1, 2] if P <= 4 else [-1, 1])
        v = choices[torch.randint(0, len(choices), shape, generator=g)]
    else:
        lo, hi = (0, 3) if dtype == torch.uint8 else (-3, 3)
        v = torch.randint(lo, hi + 1, shape, generator=g)
    if dtype.is_complex:
        im = torch.randint(-3, 4, shape, generator=g)
        return torch.complex(v.double(), im.double()).to(dtype)
    return v.to(dtype)


def _real(t):
    """Gloo's gather has no complex support: give it the real view (same bytes)."""
    if t is None:
        return None
    if isinstance(t, list):
        return [_real(x) for x in t]
    return torch.view_as_real(t) if t.is_complex() else t


# Gloo on torch 2.13 supports ReduceOp.AVG (sum, then divide by the group size in the dtype
# the backend receives: the real view for dist.all_reduce of complex tensors, the complex tensor
# for reduce / reduce_scatter), so AVG is compared with Gloo's AVG. Where Gloo refuses AVG,
# the reference is Gloo's SUM divided the same way.
def _gloo_has_avg() -> bool:
    return True


def _gloo_op(op):
    return R.SUM if op == R.AVG and not _gloo_has_avg() else op


def _finish_ref(t, op, P, real_view=False):
    if op == R.AVG and not _gloo_has_avg():
        (torch.view_as_real(t) if real_view and t.is_complex() else t).div_(P)
    return t


def _kind(op):
    return "prod" if op == R.PRODUCT else "sum"


# ----------------------------------------------------------------------------- families
def fam_all_reduce(c: Ctx):
    d = c.d
    for dtype in c.dtypes():
        for op in ops_for(dtype):
            for n in c.sizes(dtype):
                if n >= BIG and op not in (R.SUM, R.AVG, R.MAX, R.BXOR) and c.P > 1:
                    continue  # big tensors: a subset of the ops (time)
                cid = c.at(f"all_reduce {_name(dtype)} {_name(op)} n={n}")
                x = rand_int(c.gen(), dtype, _shape(n), _kind(op), c.P)
                want = x.clone()
                d.all_reduce(want, op=_gloo_op(op))
                _finish_ref(want, op, c.P, real_view=True)
                got = x.clone()
                d.all_reduce(got, op=op, group=c.lr)
                c.check(cid, got, want)
        c.settle()


def fam_rooted(c: Ctx):
    d = c.d
    rr = itertools.count()
    for dtype in c.dtypes():
        for n in c.sizes(dtype):
            root = next(rr) % c.P
            cid = c.at(f"broadcast {_name(dtype)} n={n} root={root}")
            x = rand_int(c.gen(), dtype, _shape(n), "sum", c.P)
            want, got = x.clone(), x.clone()
            d.broadcast(want, root)
            d.broadcast(got, root, group=c.lr)
            c.check(cid, got, want)
        for op in ops_for(dtype):
            for n in c.sizes(dtype):
                if n >= BIG and op not in (R.SUM, R.AVG, R.MIN, R.BOR) and c.P > 1:
                    continue
                root = next(rr) % c.P
                cid = c.at(f"reduce {_name(dtype)} {_name(op)} n={n} root={root}")
                x = rand_int(c.gen(), dtype, _shape(n), _kind(op), c.P)
                want, got = x.clone(), x.clone()
                d.reduce(want, root, op=_gloo_op(op))
                d.reduce(got, root, op=op, group=c.lr)
                if c.rank == root:
                    _finish_ref(want, op, c.P)
                    c.check(cid, got, want)
        c.settle()
    # Every root, with both the direct (n=7) and the chain (big) algorithm.
    big = c.sizes(torch.float32)[-1]
    for root in range(c.P):
        for dtype, n in ((torch.float32, 7), (torch.int64, 7), (torch.float32, big), (torch.int64, big)):
            c.at(f"every root {_name(dtype)} n={n} root={root}")
            x = rand_int(c.gen(), dtype, _shape(n), "sum", c.P)
            want, got = x.clone(), x.clone()
            d.broadcast(want, root)
            d.broadcast(got, root, group=c.lr)
            c.check(f"broadcast (every root) {_name(dtype)} n={n} root={root}", got, want)
            for op in (R.SUM, R.MAX):
                want, got = x.clone(), x.clone()
                d.reduce(want, root, op=op)
                d.reduce(got, root, op=op, group=c.lr)
                if c.rank == root:
                    c.check(f"reduce (every root) {_name(dtype)} {_name(op)} n={n} root={root}", got, want)
    c.settle()


def fam_gathers(c: Ctx):
    d = c.d
    P = c.P
    rr = itertools.count()
    for dtype in c.dtypes():
        for n in c.sizes(dtype):
            c.at(f"all_gather {_name(dtype)} n={n}")
            x = rand_int(c.gen(), dtype, _shape(n), "sum", P)
            # all_gather (list of outputs)
            want = [torch.full_like(x, 1) for _ in range(P)]
            got = [torch.full_like(x, 1) for _ in range(P)]
            d.all_gather(want, x)
            d.all_gather(got, x, group=c.lr)
            for i in range(P):
                c.check(f"all_gather {_name(dtype)} n={n} output {i}", got[i], want[i])
            c.at(f"all_gather_into_tensor {_name(dtype)} n={n}")
            want = torch.zeros((P * x.shape[0],) + tuple(x.shape[1:]), dtype=dtype)
            got = torch.zeros_like(want)
            d.all_gather_into_tensor(want, x)
            d.all_gather_into_tensor(got, x, group=c.lr)
            c.check(f"all_gather_into_tensor {_name(dtype)} n={n}", got, want)
            root = next(rr) % P
            c.at(f"gather {_name(dtype)} n={n} root={root}")
            want = [torch.zeros_like(x) for _ in range(P)] if c.rank == root else None
            got = [torch.zeros_like(x) for _ in range(P)] if c.rank == root else None
            d.gather(_real(x), _real(want), dst=root)
            d.gather(x, got, dst=root, group=c.lr)
            if c.rank == root:
                for i in range(P):
                    c.check(f"gather {_name(dtype)} n={n} root={root} output {i}", got[i], want[i])
        c.settle()
    for root in range(P):  # gather from every root
        c.at(f"gather (every root) root={root}")
        x = rand_int(c.gen(), torch.int32, (33,), "sum", P)
        want = [torch.zeros_like(x) for _ in range(P)] if c.rank == root else None
        got = [torch.zeros_like(x) for _ in range(P)] if c.rank == root else None
        d.gather(x, want, dst=root)
        d.gather(x, got, dst=root, group=c.lr)
        if c.rank == root:
            for i in range(P):
                c.check(f"gather (every root) root={root} output {i}", got[i], want[i])
    # all_gather_into_tensor coalesced: the group's all_gather_single_coalesced (2.13 name)
    for dtype in (torch.float32, torch.int8, torch.complex64, torch.bool):
        for ns in ([3, 0, 1001], [1, c.sizes(dtype)[-1]]):
            c.at(f"all_gather_single_coalesced {_name(dtype)} sizes={ns}")
            ins = [rand_int(c.gen(), dtype, (n,), "sum", P) for n in ns]
            got = [torch.zeros(P * n, dtype=dtype) for n in ns]
            c.lr.all_gather_single_coalesced(got, ins, AllgatherOptions()).wait()
            for i, (x, o) in enumerate(zip(ins, got)):
                want = torch.zeros_like(o)
                d.all_gather_into_tensor(want, x)
                c.check(f"all_gather_single_coalesced {_name(dtype)} sizes={ns} tensor {i}", o, want)
    c.settle()


def fam_scatters(c: Ctx):
    d = c.d
    P = c.P
    rr = itertools.count()
    for dtype in c.dtypes():
        for n in c.sizes(dtype):
            root = next(rr) % P
            c.at(f"scatter {_name(dtype)} n={n} root={root}")
            g = c.gen()
            chunks = [rand_int(g, dtype, _shape(n), "sum", P) for _ in range(P)] if c.rank == root else None
            want = torch.full(_shape(n), 1, dtype=dtype)
            got = torch.full(_shape(n), 1, dtype=dtype)
            d.scatter(want, chunks, src=root)
            d.scatter(got, chunks, src=root, group=c.lr)
            c.check(f"scatter {_name(dtype)} n={n} root={root}", got, want)
        for op in ops_for(dtype):
            for n in c.sizes(dtype):
                if n >= BIG and op not in (R.SUM, R.AVG, R.MAX, R.BAND) and P > 1:
                    continue
                seg = max(n // P, 0) if n >= 1001 else n  # per-rank segment
                g = c.gen()
                ins = [rand_int(g, dtype, (seg,), _kind(op), P) for _ in range(P)]
                c.at(f"reduce_scatter {_name(dtype)} {_name(op)} seg={seg}")
                want = torch.full((seg,), 1, dtype=dtype)
                got = torch.full((seg,), 1, dtype=dtype)
                d.reduce_scatter(want, [t.clone() for t in ins], op=_gloo_op(op))
                _finish_ref(want, op, P)
                mine = [t.clone() for t in ins]
                d.reduce_scatter(got, mine, op=op, group=c.lr)
                c.check(f"reduce_scatter {_name(dtype)} {_name(op)} seg={seg}", got, want)
                for i, (t, u) in enumerate(zip(mine, ins)):
                    c.check(f"reduce_scatter {_name(dtype)} {_name(op)} seg={seg}: input {i} unchanged", t, u)
                c.at(f"reduce_scatter_tensor {_name(dtype)} {_name(op)} seg={seg}")
                flat = torch.cat(ins)
                want = torch.full((seg,), 1, dtype=dtype)
                got = torch.full((seg,), 1, dtype=dtype)
                d.reduce_scatter_tensor(want, flat.clone(), op=_gloo_op(op))
                _finish_ref(want, op, P)
                inp = flat.clone()
                d.reduce_scatter_tensor(got, inp, op=op, group=c.lr)
                c.check(f"reduce_scatter_tensor {_name(dtype)} {_name(op)} seg={seg}", got, want)
                c.check(f"reduce_scatter_tensor {_name(dtype)} {_name(op)} seg={seg}: input unchanged", inp, flat)
                # in place, as FSDP may call it: the output is this rank's chunk of the input
                c.at(f"reduce_scatter_tensor in place {_name(dtype)} {_name(op)} seg={seg}")
                inp = flat.clone()
                got = inp[c.rank * seg:(c.rank + 1) * seg]
                d.reduce_scatter_tensor(got, inp, op=op, group=c.lr)
                c.check(f"reduce_scatter_tensor in place {_name(dtype)} {_name(op)} seg={seg}", got, want)
        c.settle()
    for root in range(P):  # scatter from every root
        c.at(f"scatter (every root) root={root}")
        g = c.gen()
        chunks = [rand_int(g, torch.float64, (5, 3), "sum", P) for _ in range(P)] if c.rank == root else None
        want, got = torch.zeros(5, 3, dtype=torch.float64), torch.zeros(5, 3, dtype=torch.float64)
        d.scatter(want, chunks, src=root)
        d.scatter(got, chunks, src=root, group=c.lr)
        c.check(f"scatter (every root) root={root}", got, want)
    # reduce_scatter_tensor coalesced: the group's reduce_scatter_single_coalesced (2.13 name)
    for dtype, op in ((torch.float32, R.SUM), (torch.float64, R.AVG), (torch.int32, R.MAX), (torch.bool, R.BOR)):
        for segs in ([3, 0, 250], [1, c.sizes(dtype)[-1] // P + 1]):
            c.at(f"reduce_scatter_single_coalesced {_name(dtype)} {_name(op)} segs={segs}")
            ins = [rand_int(c.gen(), dtype, (P * s,), "sum", P) for s in segs]
            got = [torch.zeros(s, dtype=dtype) for s in segs]
            opts = ReduceScatterOptions()
            opts.reduceOp = op
            c.lr.reduce_scatter_single_coalesced(got, [x.clone() for x in ins], opts).wait()
            for i, (x, o) in enumerate(zip(ins, got)):
                want = torch.zeros_like(o)
                d.reduce_scatter_tensor(want, x.clone(), op=_gloo_op(op))
                _finish_ref(want, op, P)
                c.check(f"reduce_scatter_single_coalesced {_name(dtype)} {_name(op)} segs={segs} tensor {i}", o, want)
    c.settle()


def _split_matrix(c: Ctx, kind: str):
    """S[i][j]: rows rank i sends rank j (the same matrix on every rank)."""
    P = c.P
    if kind == "equal":
        return [[3] * P for _ in range(P)]
    g = c.gen(same_on_all_ranks=True)
    S = torch.randint(0, 4, (P, P), generator=g).tolist()
    for i in range(P):  # some zero-size splits, always
        S[i][(i + 1) % P] = 0
    if P > 1:
        S[0] = [0] * P   # rank 0 sends nothing at all
        S[P - 1][0] = 5
    return S


def fam_alltoall(c: Ctx):
    d = c.d
    P, r = c.P, c.rank
    for dtype in c.dtypes():
        # all_to_all (lists): equal shapes, then uneven shapes incl. zero-size ones
        for n in c.sizes(dtype):
            if n >= BIG:
                n = n // P + 1
            c.at(f"all_to_all {_name(dtype)} n={n}")
            ins = [rand_int(c.gen(), dtype, _shape(n), "sum", P) for _ in range(P)]
            want = [torch.full(_shape(n), 1, dtype=dtype) for _ in range(P)]
            got = [torch.full(_shape(n), 1, dtype=dtype) for _ in range(P)]
            d.all_to_all(want, ins)
            d.all_to_all(got, ins, group=c.lr)
            for i in range(P):
                c.check(f"all_to_all {_name(dtype)} n={n} output {i}", got[i], want[i])
        S = _split_matrix(c, "uneven")
        c.at(f"all_to_all uneven {_name(dtype)} splits={S}")
        ins = [rand_int(c.gen(), dtype, (S[r][j], 2), "sum", P) for j in range(P)]
        # Gloo's all_to_all needs equal sizes: the reference is its all_to_all_single
        flat_want = torch.zeros((sum(S[j][r] for j in range(P)), 2), dtype=dtype)
        d.all_to_all_single(flat_want, torch.cat(ins), [S[j][r] for j in range(P)], S[r])
        want = list(flat_want.split([S[j][r] for j in range(P)]))
        got = [torch.zeros((S[j][r], 2), dtype=dtype) for j in range(P)]
        d.all_to_all(got, ins, group=c.lr)
        for i in range(P):
            c.check(f"all_to_all uneven {_name(dtype)} splits={S} output {i}", got[i], want[i])
        # all_to_all_single: no splits given (equal), equal splits given, uneven splits
        for n in c.sizes(dtype):
            rows = n if n < BIG else n // 4
            c.at(f"all_to_all_single {_name(dtype)} rows={rows}/rank no splits")
            x = rand_int(c.gen(), dtype, (P * rows, 3), "sum", P)
            want, got = torch.full_like(x, 1), torch.full_like(x, 1)
            d.all_to_all_single(want, x)
            d.all_to_all_single(got, x, group=c.lr)
            c.check(f"all_to_all_single {_name(dtype)} rows={rows}/rank no splits", got, want)
        for kind in ("equal", "uneven"):
            S = _split_matrix(c, kind)
            c.at(f"all_to_all_single {_name(dtype)} {kind} splits={S}")
            in_splits = S[r]
            out_splits = [S[j][r] for j in range(P)]
            x = rand_int(c.gen(), dtype, (sum(in_splits), 4), "sum", P)
            want = torch.full((sum(out_splits), 4), 1, dtype=dtype)
            got = torch.full_like(want, 1)
            d.all_to_all_single(want, x, out_splits, in_splits)
            d.all_to_all_single(got, x, out_splits, in_splits, group=c.lr)
            c.check(f"all_to_all_single {_name(dtype)} {kind} splits={S}", got, want)
        c.settle()
    # a large uneven all_to_all_single (over 64 KiB per rank)
    if P > 1:
        c.at("all_to_all_single big uneven")
        S = [[(1000 * (i + 2 * j)) % 7001 for j in range(P)] for i in range(P)]
        for i in range(P):
            S[i][i] = 0 if i % 2 else S[i][i]
        x = rand_int(c.gen(), torch.float32, (sum(S[r]), 8), "sum", P)
        out_splits = [S[j][r] for j in range(P)]
        want = torch.zeros((sum(out_splits), 8))
        got = torch.zeros_like(want)
        d.all_to_all_single(want, x, out_splits, S[r])
        d.all_to_all_single(got, x, out_splits, S[r], group=c.lr)
        c.check("all_to_all_single big uneven float32", got, want)
    c.settle()


def fam_misc(c: Ctx):
    """barrier, the coalesced all-reduces, non-contiguous tensors, async_op, random floats."""
    d = c.d
    P, r = c.P, c.rank
    c.at("barrier")
    for _ in range(3):
        d.barrier(group=c.lr)
    w = d.barrier(group=c.lr, async_op=True)
    w.wait()
    assert w.is_completed()
    # dist.all_reduce_coalesced (one dtype per call, as torch requires)
    for dtype in c.dtypes():
        for op in ops_for(dtype):
            c.at(f"all_reduce_coalesced {_name(dtype)} {_name(op)}")
            shapes = [(3,), (0,), (2, 5), (1001,)] + ([(BIG,)] if op == R.SUM and P <= 4 else [])
            g = c.gen()
            xs = [rand_int(g, dtype, s, _kind(op), P) for s in shapes]
            want = [x.clone() for x in xs]
            for t in want:
                d.all_reduce(t, op=_gloo_op(op))
                _finish_ref(t, op, P, real_view=True)
            got = [x.clone() for x in xs]
            d.all_reduce_coalesced(got, op=op, group=c.lr)
            for i in range(len(xs)):
                c.check(f"all_reduce_coalesced {_name(dtype)} {_name(op)} tensor {i} {shapes[i]}", got[i], want[i])
        c.settle()
    # the group's allreduce_coalesced with mixed dtypes (linerate groups them by dtype)
    for op in (R.SUM, R.MAX):
        c.at(f"allreduce_coalesced (method) mixed dtypes {_name(op)}")
        g = c.gen()
        big_part = (BIG // 2,)  # the float32 group is > 64 KiB: ring
        xs = [rand_int(g, dt, s, "sum", P) for dt, s in
              ((torch.float32, (4, 3)), (torch.int64, (7,)), (torch.float32, big_part),
               (torch.bfloat16, (0,)), (torch.int64, (1,)), (torch.float16, (11,)))]
        want = [x.clone() for x in xs]
        for t in want:
            d.all_reduce(t, op=op)
        got = [x.clone() for x in xs]
        opts = AllreduceCoalescedOptions()
        opts.reduceOp = op
        c.lr.allreduce_coalesced(got, opts).wait()
        for i in range(len(xs)):
            c.check(f"allreduce_coalesced (method) mixed dtypes {_name(op)} tensor {i} {xs[i].dtype}",
                    got[i], want[i])
    c.settle()
    # non-contiguous inputs: all_reduce and broadcast on transposed and strided views.
    # Gloo mishandles strided views in broadcast, so the reference is computed on a
    # contiguous copy and written into the same view of a copy of the base tensor.
    for dtype in (torch.float32, torch.int64, torch.complex64, torch.float16):
        for n_rows in (5, 300):  # 300 x 70 float32: > 64 KiB (ring/chain)
            base = rand_int(c.gen(), dtype, (n_rows, 70), "sum", P)
            views = {"transposed": lambda b: b.t(), "strided slice": lambda b: b[::2, 1::3],
                     "column": lambda b: b[:, 5]}
            for vname, view in views.items():
                for coll in ("all_reduce", "broadcast"):
                    root = (n_rows + len(vname)) % P
                    c.at(f"{coll} non-contiguous {vname} {_name(dtype)} rows={n_rows}")
                    ref_base = base.clone()
                    ref = view(ref_base).contiguous()
                    if coll == "all_reduce":
                        d.all_reduce(ref)
                    else:
                        d.broadcast(ref, root)
                    c.then(lambda view=view, ref_base=ref_base, ref=ref: view(ref_base).copy_(ref))
                    got_base = base.clone()
                    v = view(got_base)
                    assert not v.is_contiguous()
                    if coll == "all_reduce":
                        d.all_reduce(v, group=c.lr)
                    else:
                        d.broadcast(v, root, group=c.lr)
                    c.check(f"{coll} non-contiguous {vname} {_name(dtype)} base {tuple(base.shape)}",
                            got_base, ref_base)
        c.settle()
    # non-contiguous inputs and outputs of the other collectives. Gloo refuses or mishandles
    # several of these, so its reference always runs on contiguous copies.
    for dtype, n in ((torch.float32, 5), (torch.int64, 3001), (torch.complex64, 7)):
        g = c.gen()
        col = lambda b, i: b[:, i]  # noqa: E731 - a column: stride > 1
        c.at(f"all_gather non-contiguous outputs {_name(dtype)} n={n}")
        x = rand_int(g, dtype, (n,), "sum", P)
        want = [torch.zeros(n, dtype=dtype) for _ in range(P)]
        d.all_gather(want, x)
        base = torch.zeros(n, P + 1, dtype=dtype)
        d.all_gather([col(base, i + 1) for i in range(P)], x, group=c.lr)
        c.then(lambda cid=c.current, base=base, want=want, n=n, dtype=dtype: c.check(
            cid, base, torch.cat([torch.zeros(n, 1, dtype=dtype), torch.stack(want, 1)], 1)))
        c.at(f"all_gather non-contiguous input {_name(dtype)} n={n}")
        xb = rand_int(g, dtype, (n, 3), "sum", P)
        want = [torch.zeros(n, dtype=dtype) for _ in range(P)]
        d.all_gather(want, xb[:, 1].contiguous())
        got = [torch.zeros(n, dtype=dtype) for _ in range(P)]
        d.all_gather(got, xb[:, 1], group=c.lr)
        for i in range(P):
            c.check(f"{c.current} output {i}", got[i], want[i])
        if not dtype.is_complex:
            c.at(f"reduce_scatter non-contiguous input and output {_name(dtype)} n={n}")
            ins = [rand_int(g, dtype, (n, 2), "sum", P) for _ in range(P)]
            want = torch.zeros(n, dtype=dtype)
            d.reduce_scatter(want, [t[:, 1].contiguous() for t in ins])
            base = torch.zeros(n, 2, dtype=dtype)
            d.reduce_scatter(col(base, 1), [t[:, 1] for t in ins], group=c.lr)
            c.then(lambda cid=c.current, base=base, want=want, n=n, dtype=dtype: c.check(
                cid, base, torch.stack([torch.zeros(n, dtype=dtype), want], 1)))
        for root in {0, P - 1}:
            c.at(f"scatter / gather non-contiguous {_name(dtype)} n={n} root={root}")
            chunks = [rand_int(g, dtype, (n,), "sum", P) for _ in range(P)]
            want = torch.zeros(n, dtype=dtype)
            d.scatter(_real(want), _real(chunks) if c.rank == root else None, src=root)
            base = torch.zeros(n, 2, dtype=dtype)
            d.scatter(col(base, 0), chunks if c.rank == root else None, src=root, group=c.lr)
            c.then(lambda cid=c.current, base=base, want=want, n=n, dtype=dtype: c.check(
                cid + " (scatter)", base, torch.stack([want, torch.zeros(n, dtype=dtype)], 1)))
            x = rand_int(g, dtype, (n, 2), "sum", P)
            want = [torch.zeros(n, dtype=dtype) for _ in range(P)] if c.rank == root else None
            d.gather(_real(x[:, 0].contiguous()), _real(want), dst=root)
            base = torch.zeros(n, P, dtype=dtype)
            d.gather(x[:, 0], [col(base, i) for i in range(P)] if c.rank == root else None,
                        dst=root, group=c.lr)
            if c.rank == root:
                c.then(lambda cid=c.current, base=base, want=want: c.check(
                    cid + " (gather)", base, torch.stack(want, 1)))
        c.at(f"all_to_all non-contiguous {_name(dtype)} n={n}")
        ins = [rand_int(g, dtype, (n, 2), "sum", P)[:, 1] for _ in range(P)]
        want = [torch.zeros(n, dtype=dtype) for _ in range(P)]
        d.all_to_all(want, [t.contiguous() for t in ins])
        base = torch.zeros(n, P, dtype=dtype)
        d.all_to_all([col(base, i) for i in range(P)], ins, group=c.lr)
        c.then(lambda cid=c.current, base=base, want=want: c.check(cid, base, torch.stack(want, 1)))
        c.at(f"all_to_all_single non-contiguous input {_name(dtype)} n={n}")
        x = rand_int(g, dtype, (3, P * 2), "sum", P).t()  # (P*2, 3), transposed
        want = torch.zeros(P * 2, 3, dtype=dtype)
        d.all_to_all_single(want, x.contiguous())
        got = torch.zeros(P * 2, 3, dtype=dtype)
        d.all_to_all_single(got, x, group=c.lr)
        c.check(c.current, got, want)
    c.settle()
    # async_op=True on collectives: wait(), then the same result
    c.at("all_reduce async_op")
    x = rand_int(c.gen(), torch.float32, (BIG,), "sum", P)
    want = x.clone()
    d.all_reduce(want)
    got = x.clone()
    work = d.all_reduce(got, group=c.lr, async_op=True)
    assert work.wait()
    assert work.is_completed() and work.exception() is None
    fut_val = work.get_future().wait()
    c.check("all_reduce async_op", got, want)
    c.check("all_reduce async_op future value", fut_val[0], want)
    # random normal float32: allclose against Gloo (reduction order differs), and every rank
    # must hold bit-identical results
    for n in (1, 1001, c.sizes(torch.float32)[-1]):
        for op in (R.SUM, R.AVG):
            c.at(f"all_reduce randn {_name(op)} n={n}")
            x = torch.randn(n, generator=c.gen())
            want = x.clone()
            d.all_reduce(want, op=_gloo_op(op))
            _finish_ref(want, op, P, real_view=True)
            got = x.clone()
            d.all_reduce(got, op=op, group=c.lr)
            c.settle()
            c.ncases += 1
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                c.fails.append(f"rank {r}: all_reduce randn {_name(op)} n={n}: max abs diff "
                               f"{(got - want).abs().max().item()}")
            everyone = [torch.zeros_like(got) for _ in range(P)]
            d.all_gather(everyone, got)
            for i in range(P):
                c.check(f"all_reduce randn {_name(op)} n={n}: rank {i} result bits equal rank {r}'s",
                        everyone[i], got)
        c.at(f"reduce_scatter_tensor / reduce randn n={n}")
        x = torch.randn(P * n, generator=c.gen())
        want, got = torch.zeros(n), torch.zeros(n)
        d.reduce_scatter_tensor(want, x.clone())
        d.reduce_scatter_tensor(got, x.clone(), group=c.lr)
        c.settle()
        c.ncases += 1
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            c.fails.append(f"rank {r}: reduce_scatter_tensor randn n={n}: max abs diff "
                           f"{(got - want).abs().max().item()}")
        x = torch.randn(n, generator=c.gen())
        want, got = x.clone(), x.clone()
        d.reduce(want, 0)
        d.reduce(got, 0, group=c.lr)
        c.settle()
        if r == 0:
            c.ncases += 1
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                c.fails.append(f"rank {r}: reduce randn n={n}: max abs diff {(got - want).abs().max().item()}")


FAMILIES = {"all_reduce": fam_all_reduce, "rooted": fam_rooted, "gathers": fam_gathers,
            "scatters": fam_scatters, "alltoall": fam_alltoall, "misc": fam_misc}


def _sweep(c: Ctx, families) -> tuple[list[str], int]:
    c.current = "(none)"
    try:
        for fam in families:
            FAMILIES[fam](c)
    except BaseException as e:
        e.add_note(f"rank {c.rank}: the last case started was: {c.current}")
        raise
    c.settle()
    # Both backends must still be in step: one last collective on each.
    c.d.barrier()
    c.d.barrier(group=c.lr)
    return c.fails, c.ncases


def _check(results) -> None:
    fails = [f for fs, _ in results for f in fs]
    ncases = sum(n for _, n in results)
    assert ncases > 0
    assert not fails, f"{len(fails)} mismatches against Gloo:\n" + "\n".join(fails[:40])


def _rank_fn(rank, P, lr, families, variant):
    warnings.filterwarnings("ignore", category=FutureWarning)
    return _sweep(Ctx(rank, P, lr, variant), families)


def _run_processes(P, families, variant="default", timeout=120, env=None):
    """The sweep on P rank processes (Gloo their default group)."""
    _check(run_ranks(_rank_fn, P, families, variant, timeout=timeout, env=env))


def _run(P, families, variant="default", timeout=120, env=None):
    """The sweep on P thread ranks (tests/_threads.py), ``env``'s LINERATE_* settings (over this
    process's environment, as a rank process would read them) the groups' options."""
    import os

    import linerate
    options = linerate.Options.from_env({**os.environ, **(env or {})})
    _check(run_threads(lambda d, r: _sweep(Ctx(r, P, d.lr, variant, d), families), P,
                       as_dist="batched", options=options, timeout=timeout))


# ----------------------------------------------------------------------------- tests
WORLD_SIZES = [1, 2, 3, 4, 8]
FAMILY_NAMES = tuple(FAMILIES)
CASES = [pytest.param(P, (fam,), id=f"P{P}-{fam}") for P in WORLD_SIZES for fam in FAMILY_NAMES]

TIMEOUT = 150


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("P,families", CASES)
def test_collectives_match_gloo(P, families):
    _run(P, families, timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_collectives_match_gloo_16_ranks(family):
    """Every family on 16 ranks with small tensors (0, 1 and 1001 elements; one 20,001-element
    float32 case for the ring paths), five dtypes, every op."""
    _run(16, (family,), variant="wide", timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_collectives_pipelined_ring_chain(P):
    """LINERATE_ALLREDUCE_ALGO=ring, LINERATE_ROOTED_ALGO=chain, 4 KiB pieces and
    LINERATE_SMALL_BYTES=0: every size runs the pipelined algorithms with many pieces."""
    _run(P, ("all_reduce", "rooted", "gathers", "scatters"), variant="pipelined",
         timeout=TIMEOUT, env=PIPELINED_ENV)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_all_reduce_over_tcp_matches_gloo(P):
    """LINERATE_SHM=0 (every peer over TCP): the small calls take the fused path's agreement
    round, which carries the call and folds it on arrival (collectives/fusion.py ``agree``),
    the large ones the flat algorithms; every dtype, op and size against Gloo."""
    _run(P, ("all_reduce",), timeout=TIMEOUT, env={"LINERATE_SHM": "0"})


@pytest.mark.timeout(TIMEOUT + 30)
def test_every_family_over_tcp_matches_gloo():
    """LINERATE_SHM=0 on 3 ranks, every other family: the synchronous calls run in the
    caller's thread, which reads its own small receives (transport Link.drive) while the
    connections' receiver threads wait, and leaves the large ones to them."""
    _run(3, tuple(f for f in FAMILY_NAMES if f != "all_reduce"), timeout=TIMEOUT,
         env={"LINERATE_SHM": "0"})


def _drive_spins(pg, rank=None):
    """The ``spin`` of every drive of some small synchronous ops over TCP (``pg``: the group;
    in a rank process the linerate group, with the cores this process may use)."""
    from linerate.transport.link import ThreadedStreamLink
    from linerate.transport.shm.sync import usable_cores
    seen = []
    real = ThreadedStreamLink.drive

    def drive(self, req, until, spin=0.0, also=()):
        seen.append(spin)
        return real(self, req, until, spin, also)

    bo, ao = dist.BarrierOptions(), dist.AllreduceOptions()
    bo.asyncOp = ao.asyncOp = False  # (as torch's dist.barrier and dist.all_reduce pass them)
    ThreadedStreamLink.drive = drive
    try:
        for _ in range(5):
            pg.barrier(bo).wait()
            pg.allreduce([torch.ones(3)], ao).wait()
    finally:
        ThreadedStreamLink.drive = real
    return sorted(set(seen)), usable_cores()


def _drive_spins_rank(rank, P, lr):
    return _drive_spins(lr)


def _processes_rank(rank, P, lr):
    return lr._get_backend(torch.device("cpu"))._ctx.layout.processes


@pytest.mark.timeout(90)
def test_a_caller_spins_before_it_sleeps_only_with_a_core_of_its_own(monkeypatch):
    """A caller that reads its own receives over TCP looks without sleeping for SPIN_S first
    where the ranks of its host have a core each and are processes of their own; thread
    ranks (one interpreter lock) sleep at once."""
    from linerate.transport.shm.sync import SPIN_S
    for spins, _ in run_threads(lambda pg, r: _drive_spins(pg), 2, env={"LINERATE_SHM": "0"},
                                monkeypatch=monkeypatch):
        assert spins == [0.0], spins
    for spins, cores in run_ranks(_drive_spins_rank, 2, timeout=60, env={"LINERATE_SHM": "0"}):
        assert spins == [SPIN_S if 2 <= cores else 0.0], (spins, cores)
    # with shared memory (records posted on rank 0's offered segment, each rank's process
    # in its pid slot) the rank processes are told apart too
    assert run_ranks(_processes_rank, 2, timeout=60) == [((0,), (1,))] * 2


HD_ENV = {"LINERATE_ALLREDUCE_ALGO": "hd", "LINERATE_PIECE_BYTES": "4096",
          "LINERATE_SMALL_BYTES": "0"}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("P", [2, 3, 5, 6, 7, 8])
def test_all_reduce_halving_doubling(P):
    """LINERATE_ALLREDUCE_ALGO=hd with 4 KiB pieces for every size: powers of two and the
    folded ranks of the others (3, 5, 6, 7: 1-3 pairs sit out), every dtype and op of the
    pipelined set, against Gloo."""
    _run(P, ("all_reduce",), variant="pipelined", timeout=TIMEOUT, env=HD_ENV)


DOUBLING_ENV = {"LINERATE_ALLREDUCE_ALGO": "doubling", "LINERATE_ROOTED_ALGO": "tree",
                "LINERATE_SHM": "0", "LINERATE_FUSION_BYTES": "0"}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("P", [6])
def test_doubling_and_tree(P):
    """LINERATE_ALLREDUCE_ALGO=doubling (recursive doubling; on 6 ranks two pairs fold first)
    and LINERATE_ROOTED_ALGO=tree (binomial broadcast and reduce) for every size, against
    Gloo."""
    _run(P, ("all_reduce", "rooted"), variant="pipelined", timeout=TIMEOUT, env=DOUBLING_ENV)


def _batched_and_direct(d, r):
    """Every kind of Gloo call the families make, on every dtype, op and small size, through
    the batched reference (``group=None``) and one call at a time (``group=d.gloo``): the pairs
    of results, to be the same bits."""
    P, pairs = d.world, []

    def run(grp, case, dtype, n, root):
        out = {}

        def data(salt, kind="sum", shape=None):
            g = torch.Generator().manual_seed(1000 * case + 10 * salt + r)
            return rand_int(g, dtype, _shape(n) if shape is None else shape, kind, P)

        for k, op in enumerate(ops_for(dtype)):
            t = data(k, _kind(op))
            d.all_reduce(t, op=op, group=grp)
            out[f"all_reduce {_name(op)}"] = t
            t = data(k, _kind(op))
            d.reduce(t, root, op=op, group=grp)
            if r == root:
                out[f"reduce {_name(op)}"] = t
            xs = [data(10 * k + q, _kind(op)) for q in range(P)]
            out[f"reduce_scatter {_name(op)}"] = torch.zeros_like(xs[0])
            d.reduce_scatter(out[f"reduce_scatter {_name(op)}"], xs, op=op, group=grp)
            out[f"reduce_scatter_tensor {_name(op)}"] = torch.zeros_like(xs[0])
            d.reduce_scatter_tensor(out[f"reduce_scatter_tensor {_name(op)}"], torch.cat(xs),
                                    op=op, group=grp)
        x, xs = data(99), [data(100 + q) for q in range(P)]
        out["broadcast"] = x.clone()
        d.broadcast(out["broadcast"], root, group=grp)
        out["all_gather"] = [torch.zeros_like(x) for _ in range(P)]
        d.all_gather(out["all_gather"], x, group=grp)
        out["all_gather_into_tensor"] = torch.zeros((P * x.shape[0],) + x.shape[1:], dtype=dtype)
        d.all_gather_into_tensor(out["all_gather_into_tensor"], x, group=grp)
        ts = [torch.zeros_like(x) for _ in range(P)] if r == root else None
        d.gather(_real(x), _real(ts), dst=root, group=grp)
        if r == root:
            out["gather"] = ts
        out["scatter"] = torch.zeros_like(x)
        d.scatter(out["scatter"], xs if r == root else None, src=root, group=grp)
        out["all_to_all"] = [torch.zeros_like(x) for _ in range(P)]
        d.all_to_all(out["all_to_all"], xs, group=grp)
        send = [(r + q + n) % 3 for q in range(P)]  # rows rank r sends rank q
        recv = [(q + r + n) % 3 for q in range(P)]
        out["all_to_all_single"] = torch.zeros((sum(recv), 2), dtype=dtype)
        d.all_to_all_single(out["all_to_all_single"], data(200, shape=(sum(send), 2)), recv, send,
                            group=grp)
        return out

    for i, dtype in enumerate(DTYPES):
        for n in SMALL_SIZES:
            root = (i + n) % P
            case = f"{_name(dtype)} n={n}"
            pairs.append((case, run(None, i * 10 + n, dtype, n, root),
                          run(d.gloo, i * 10 + n, dtype, n, root)))
        d.settle()
    bad = []
    for case, batched, direct in pairs:
        assert batched.keys() == direct.keys()
        for kind, a in batched.items():
            b = direct[kind]
            for j, (u, v) in enumerate(zip(*(z if isinstance(z, list) else [z] for z in (a, b)))):
                if u.dtype != v.dtype or u.shape != v.shape or not torch.equal(u, v):
                    bad.append(f"rank {r}: {kind} {case} [{j}]")
    return bad, len(pairs)


@pytest.mark.timeout(210)
def test_the_batched_reference_is_gloos_result_call_by_call():
    """The threads' matrix batches its Gloo calls (tests/_threads.ThreadDist): for every kind
    of call, dtype and size, what it gives is what Gloo gives the call alone."""
    res = run_threads(_batched_and_direct, 3, as_dist="batched", timeout=180)
    assert [b for bad, _ in res for b in bad] == []
    assert all(n == len(DTYPES) * len(SMALL_SIZES) for _, n in res)


def _alltoall_both_ways(d, r):
    """Gloo's all_to_all of lists, and the reference's way for a torch whose Gloo has none
    (tests/_threads._alltoall_through_single), on odd sizes, zero sizes and several dtypes."""
    from _threads import _alltoall_through_single
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for n in (0, 1, 7, 1023):  # Gloo's lists are of one size
            ins = [torch.arange(n, dtype=torch.float32).mul(10 * r + q).to(dtype)
                   for q in range(d.world)]
            a = [torch.full((n,), -1, dtype=dtype) for q in range(d.world)]
            b = [t.clone() for t in a]
            d.gloo.alltoall(a, ins, dist.AllToAllOptions()).wait()
            _alltoall_through_single(d.gloo, b, ins, dist.AllToAllOptions()).wait()
            out.append(all(torch.equal(x, y) for x, y in zip(a, b)))
    return out


@pytest.mark.timeout(60)
def test_the_references_alltoall_without_gloos_is_gloos_result():
    """Gloo before torch 2.12 has no all_to_all of lists: the reference sends the lists' bytes
    in one all_to_all_single; it gives what Gloo's all_to_all gives where Gloo has one."""
    res = run_threads(_alltoall_both_ways, 3, as_dist=True, timeout=45)
    assert all(all(x) and len(x) == 16 for x in res)


# ----------------------------------------------------------------------------- rank processes
# What only separate processes show: the shared-memory segments mapped by other processes
# (their creation, mapping and unlinking across address spaces), torch.distributed's own
# functions and groups (the module's default group, new_group) and a rank per interpreter.
@pytest.mark.timeout(TIMEOUT + 30)
def test_collectives_match_gloo_between_processes():
    """Every family on 4 rank processes, the wide sweep (five dtypes, every op, 0, 1 and 1001
    elements and one 20,001-element float32 case for the ring paths). More ranks (5 to 8, 16)
    run on threads above, sharing one segment as processes do."""
    _run_processes(4, FAMILY_NAMES, variant="wide", timeout=TIMEOUT)


# ----------------------------------------------------------------------------- regressions
def _ring_all_reduce_fn(d, rank, sizes):
    """Ring all_reduce (> 64 KiB) on P ranks, with segment lengths equal and unequal; a
    Work.wait timeout turns a hang into an error. (On 4+ ranks the early all-gather receives
    must not match reduce-scatter messages: that would be size mismatch errors or a deadlock.)"""
    for n in sizes:
        x = torch.arange(n, dtype=torch.float32) % 5 + rank
        want = x.clone()
        d.all_reduce(want)
        got = x.clone()
        d.all_reduce(got, group=d.lr, async_op=True).wait(timeout=timedelta(seconds=20))
        assert torch.equal(got, want), f"n={n}: wrong result"
    return True


@pytest.mark.timeout(210)
@pytest.mark.parametrize("P", [4, 5, 8])
def test_ring_all_reduce_many_ranks(P):
    sizes = [20_001, 20_008, 40_000 + P - 1, 17_000 * P]
    assert run_threads(lambda d, r: _ring_all_reduce_fn(d, r, sizes), P, as_dist=True,
                       timeout=180) == [True] * P


@pytest.mark.timeout(210)
@pytest.mark.parametrize("P", [1, 2, 3])
def test_all_gather_coalesced(P):
    """torch's layout output_tensor_lists[rank][input], not [input][rank] (which would be
    refused, or silently transposed when #inputs == P with equal shapes)."""
    fails = [f for fs in run_threads(_ag_coalesced_fn, P, as_dist=True, timeout=180) for f in fs]
    assert not fails, "\n".join(fails[:20])


def _ag_coalesced_fn(d, rank):
    """all_gather_coalesced: output_tensor_lists[i][j] is rank i's input j (torch docs).
    Inputs of different shapes, then P inputs of one shape (where the layouts cannot be told
    apart by shape)."""
    P = d.world
    fails = []
    cases = [[(j + 2,) for j in range(k)] for k in (1, 2, 3)] + [[(4,)] * P]
    for shapes in cases:
        ins = [torch.full(s, 100 * rank + j, dtype=torch.int64) for j, s in enumerate(shapes)]
        want = [[torch.zeros(s, dtype=torch.int64) for s in shapes] for _ in range(P)]
        d.all_gather_coalesced(want, ins)
        got = [[torch.zeros(s, dtype=torch.int64) for s in shapes] for _ in range(P)]
        try:
            d.all_gather_coalesced(got, ins, group=d.lr)
        except Exception as e:  # noqa: BLE001 - a refusal is a failure of this case
            fails.append(f"shapes={shapes}: {type(e).__name__}: {e}")
            continue
        for i in range(P):
            for j in range(len(shapes)):
                if not torch.equal(got[i][j], want[i][j]):
                    fails.append(f"shapes={shapes}: output[{i}][{j}] = {got[i][j].tolist()}, "
                                 f"Gloo {want[i][j].tolist()}")
    return fails


def _worker_comes_and_goes(d, rank):
    """A group's worker starts with its first async call and ends once idle for
    WORKER_IDLE_S (0.3 s here); the next async call starts another, and results stay right."""
    P, lr = d.world, d.lr
    pg = lr._get_backend(torch.device("cpu"))
    x = torch.full((1000,), float(rank))
    d.all_reduce(x, group=lr, async_op=True).wait()
    assert torch.equal(x, torch.full((1000,), float(sum(range(P)))))
    first = pg._worker
    assert first is not None
    deadline = time.monotonic() + 60  # idle for 0.3 s: it goes; a loaded host may be slow
    while (pg._worker is not None or first.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.02)
    gone = pg._worker is None and not first.is_alive()
    y = torch.full((100_000,), float(rank))
    d.broadcast(y, 1, group=lr, async_op=True).wait()
    assert torch.equal(y, torch.full((100_000,), 1.0))
    again = pg._worker is not None and pg._worker is not first and pg._worker.is_alive()
    return gone, again


@pytest.mark.timeout(210)
def test_idle_worker_thread_ends_and_comes_back(monkeypatch):
    import linerate.collectives.scheduler as scheduler
    monkeypatch.setattr(scheduler, "WORKER_IDLE_S", 0.3)
    for r in run_threads(_worker_comes_and_goes, 3, as_dist=True, timeout=180):
        assert r == (True, True), r


def _where_ops_run(d, rank, queued):
    """Which thread ran each op: a synchronous call with the worker idle (a small all_reduce,
    a fusion entry, too; on one host the lone way, runner._run_lone) runs in the caller's thread; an
    async one, and a synchronous one queued behind it, on the worker, in order.
    (The barrier may go either way: the worker clears its turn just after it completes the
    broadcast's Work.) ``queued``: an Event per rank, set once its second broadcast is queued
    behind its all_gather; rank 0 joins the all_gather only then, so that the other ranks'
    all_gather is still running when they call that broadcast however the host delays them."""
    import threading
    P, lr = d.world, d.lr
    pg = lr._get_backend(torch.device("cpu"))
    ran = []
    execute = pg._run._execute

    def spy(item):
        ran.append((item.name, threading.current_thread().name))
        execute(item)

    run_fused = pg._run._run_fused

    def spy_fused(entries):
        ran.append(("all_reduce", threading.current_thread().name))
        run_fused(entries)

    run_lone = pg._run._run_lone

    def spy_lone(name, *a, **k):  # a lone small call on one host (None: it went the general way)
        work = run_lone(name, *a, **k)
        if work is not None:
            ran.append((name, threading.current_thread().name))
        return work

    put = pg._run.sched.put

    def spy_put(item):
        put(item)
        if getattr(item, "name", None) == "broadcast":
            queued[rank].set()

    pg._run._execute, pg._run._run_fused, pg._run._run_lone = spy, spy_fused, spy_lone
    pg._run.sched.put = spy_put
    s = torch.full((3,), float(rank))
    d.all_reduce(s, group=lr)  # a small one (a fusion entry): synchronous, here too
    assert torch.equal(s, torch.full((3,), float(sum(range(P)))))
    x = torch.full((1000,), float(rank))
    d.broadcast(x, 1, group=lr)  # synchronous, nothing queued: here
    assert torch.equal(x, torch.full((1000,), 1.0))
    outs = [torch.empty(1000) for _ in range(P)]
    if rank == 0:  # the others' all_gather is still running when they call broadcast
        for q in range(1, P):
            assert queued[q].wait(120), f"rank {q}'s broadcast was not queued"
    w = d.all_gather(outs, torch.full((1000,), float(rank)), group=lr, async_op=True)
    y = torch.full((5,), float(rank))
    d.broadcast(y, 0, group=lr)  # synchronous but behind a queued op: the worker, after it
    w.wait()
    assert [o[0].item() for o in outs] == [float(q) for q in range(P)]
    assert torch.equal(y, torch.zeros(5))
    d.barrier(group=lr)
    pg._run._execute, pg._run._run_fused, pg._run._run_lone = execute, run_fused, run_lone
    pg._run.sched.put = put
    return ran


@pytest.mark.timeout(210)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_synchronous_calls_run_in_the_callers_thread_in_order(shm):
    import os

    import linerate
    options = linerate.Options.from_env({**os.environ, **({} if shm else {"LINERATE_SHM": "0"})})
    import threading
    queued = [threading.Event() for _ in range(3)]
    for rank, ran in enumerate(run_threads(lambda d, r: _where_ops_run(d, r, queued), 3,
                                           as_dist=True, options=options, timeout=180)):
        ops = [op for op, _ in ran]
        assert ops == ["all_reduce", "broadcast", "all_gather", "broadcast", "barrier"], ran
        assert not ran[0][1].startswith("linerate-coll"), ran
        threads = [t for _, t in ran[1:]]
        assert not threads[0].startswith("linerate-coll"), ran
        assert threads[1].startswith("linerate-coll"), ran
        if rank:
            assert threads[2] == threads[1], ran
