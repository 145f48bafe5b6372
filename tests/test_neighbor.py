"""Neighbor all-reduce and the mixing topologies (docs/neighbor-spec.md).

Topologies (no processes): every matrix is nonnegative and doubly stochastic at every step for
n = 1..12, matches a construction written out here from the definition, agrees with
in_weights/self_weight/out_peers; spectral gaps of known cases; from_matrix's errors.

neighbor_allreduce: ONE spawn of 8 ranks (process start-up dominates on 2 cores). The default
group is linerate (world size 8); linerate subgroups of ranks 0..k-1 give the world sizes 2..7.
On every size, every topology (several steps of the time-varying ones) is checked against
W @ X computed with NumPy from float64 inputs (to 1e-12), plus float32 / bfloat16 / float16
with tolerances, async_op, size 0, odd sizes, a non-contiguous tensor, a tensor cut into many
pipeline pieces (LINERATE_PIECE_BYTES=4096), step=None (the group's counter), bad input, and
last, on a group of its own, a rank that passes another topology: every rank fails.
"""
from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from _harness import run_ranks
from linerate import topology as T

SIZES = range(1, 13)


def all_topologies(n):
    out = [T.ring(n), T.torus2d(n), T.exponential(n), T.one_peer_exponential(n), T.complete(n)]
    out += [T.alternating_exponential_ring(n, r) for r in range(1, n + 1) if n % r == 0]
    if n % 2 == 0 and n >= 4:
        out.append(T.torus2d(n, rows=2))
    return out


# ----------------------------------------------------------------------------- topologies
@pytest.mark.parametrize("n", SIZES)
def test_doubly_stochastic_and_consistent(n):
    for topo in all_topologies(n):
        assert topo.n == n and topo.period >= 1
        for step in range(2 * topo.period):
            W = topo.matrix(step)
            assert W.dtype == np.float64 and W.shape == (n, n)
            assert (W >= 0).all(), (topo, step)
            np.testing.assert_allclose(W.sum(axis=0), 1.0, atol=1e-12, err_msg=repr(topo))
            np.testing.assert_allclose(W.sum(axis=1), 1.0, atol=1e-12, err_msg=repr(topo))
            assert np.array_equal(W, topo.matrix(step + topo.period))
            for i in range(n):
                assert topo.self_weight(i, step) == W[i, i]
                iw = topo.in_weights(i, step)
                assert iw == {j: W[i, j] for j in range(n) if j != i and W[i, j] != 0}
                assert list(iw) == sorted(iw)
                assert topo.out_peers(i, step) == [k for k in range(n) if k != i and W[k, i] != 0]
        T.from_matrix(topo.matrix(0))  # passes its own validation


def _hops(n):
    return [1 << k for k in range(max(1, math.ceil(math.log2(n))))] if n > 1 else []


@pytest.mark.parametrize("n", SIZES)
def test_matrices_match_definitions(n):
    # ring: 1/3 on i-1, i, i+1 (n >= 3); n = 2: 1/2 everywhere
    W = np.zeros((n, n))
    for i in range(n):
        nb = {(i - 1) % n, i, (i + 1) % n}
        for j in nb:
            W[i, j] = 1 / len(nb)
    np.testing.assert_array_equal(T.ring(n).matrix(), W)
    # complete
    np.testing.assert_array_equal(T.complete(n).matrix(), np.full((n, n), 1 / n))
    # static exponential: receive from i + 2^k (2^k < n), uniform
    hops = [h for h in _hops(n) if h < n]
    W = np.zeros((n, n))
    for i in range(n):
        for j in [i] + [(i + h) % n for h in hops]:
            W[i, j] = 1 / (len(hops) + 1)
    np.testing.assert_array_equal(T.exponential(n).matrix(), W)
    # one-peer exponential: step t averages with (i + 2^(t mod ceil(log2 n))) mod n
    ope = T.one_peer_exponential(n)
    tau = max(1, math.ceil(math.log2(n))) if n > 1 else 1
    assert ope.period == tau
    for t in range(2 * tau + 1):
        W = np.eye(n) / 2
        for i in range(n):
            W[i, (i + 2 ** (t % tau)) % n] += 0.5
        if n == 1:
            W = np.ones((1, 1))
        np.testing.assert_array_equal(ope.matrix(t), W, err_msg=f"step {t}")


def test_torus_and_aer_examples():
    # 2 x 4 torus: rank 0's neighbors are 4 (up and down coincide), 1 and 3: weight 1/4
    t = T.torus2d(8)
    assert t.in_weights(0) == {1: 0.25, 3: 0.25, 4: 0.25} and t.self_weight(0) == 0.25
    # 3 x 3: four distinct neighbors, 1/5
    t = T.torus2d(9)
    assert t.in_weights(4) == {1: 0.2, 3: 0.2, 5: 0.2, 7: 0.2}
    # a prime n is a 1 x n torus, i.e. a ring
    np.testing.assert_array_equal(T.torus2d(7).matrix(), T.ring(7).matrix())
    with pytest.raises(ValueError, match="rows"):
        T.torus2d(8, rows=3)
    # AER, 2 nodes x 4 ranks: even steps to the same local index on the other node, odd steps
    # within the node at hops 1, 2
    a = T.alternating_exponential_ring(8, 4)
    assert a.period == 4
    assert a.in_weights(1, 0) == {5: 0.5} and a.out_peers(1, 0) == [5]
    assert a.in_weights(1, 1) == {2: 0.5} and a.out_peers(1, 1) == [0]
    assert a.in_weights(1, 3) == {3: 0.5} and a.out_peers(1, 3) == [3]
    assert a.in_weights(6, 2) == {2: 0.5}
    # every even step stays within a column (same local index), every odd one within a node
    b = T.alternating_exponential_ring(12, 3)
    for step in range(b.period):
        for i in range(12):
            for j in b.in_weights(i, step):
                assert (j % 3 == i % 3) if step % 2 == 0 else (j // 3 == i // 3)
    with pytest.raises(ValueError, match="ranks_per_node"):
        T.alternating_exponential_ring(8, 3)
    # one rank per node or one node: the one-peer exponential graph
    for n, r in ((8, 1), (8, 8)):
        a = T.alternating_exponential_ring(n, r)
        for s in range(4):
            np.testing.assert_array_equal(a.matrix(s), T.one_peer_exponential(n).matrix(s))


def test_aer_intra_average_and_averaging_groups():
    # 2 nodes x 4 ranks, intra="average": even steps as before, odd steps each node's average
    a = T.alternating_exponential_ring(8, 4, intra="average")
    assert a.period == 2 and "intra=average" in repr(a)
    assert a.in_weights(1, 0) == {5: 0.5}
    np.testing.assert_allclose(a.matrix(1), np.kron(np.eye(2), np.full((4, 4), 0.25)))
    assert a.averaging_groups(1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the even step of 2 nodes swaps pairs across them: groups too (they span nodes)
    assert a.averaging_groups(0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert a.spectral_gap() == pytest.approx(1.0, abs=1e-9)
    # 4 nodes: hops 1, 2 across (a shift, not groups), period 4
    b = T.alternating_exponential_ring(16, 4, intra="average")
    assert b.period == 4 and b.averaging_groups(0) is None
    assert b.averaging_groups(3) == [list(range(k, k + 4)) for k in (0, 4, 8, 12)]
    # one node: its average every step; 2 ranks per node: the same matrices as one-peer
    assert T.alternating_exponential_ring(4, 4, intra="average").averaging_groups(5) == [[0, 1, 2, 3]]
    for t in range(4):
        np.testing.assert_array_equal(T.alternating_exponential_ring(8, 2, intra="average").matrix(t),
                                      T.alternating_exponential_ring(8, 2).matrix(t))
    assert T.by_name("aer", 8, ranks_per_node=4, intra="average") == a
    with pytest.raises(ValueError, match="intra"):
        T.alternating_exponential_ring(8, 4, intra="ring")
    # others: complete is one group; a ring of 4, a torus are not; the one-peer hop 1 of 2 ranks
    assert T.complete(3).averaging_groups() == [[0, 1, 2]]
    assert T.ring(4).averaging_groups() is None and T.torus2d(4).averaging_groups() is None
    assert T.one_peer_exponential(4).averaging_groups(1) == [[0, 2], [1, 3]]
    assert T.one_peer_exponential(4).averaging_groups(0) is None
    assert T.from_matrix([[1.0, 0.0], [0.0, 1.0]]).averaging_groups() == [[0], [1]]


def _ring_gap(n):
    lam = [abs((1 + 2 * math.cos(2 * math.pi * k / n)) / 3) for k in range(1, n)]
    return 1 - max(lam)


def test_spectral_gaps():
    for n in range(1, 10):
        assert T.complete(n).spectral_gap() == pytest.approx(1.0, abs=1e-12)
    for n in range(3, 13):
        assert T.ring(n).spectral_gap() == pytest.approx(_ring_gap(n), abs=1e-9), n
    assert T.ring(2).spectral_gap() == pytest.approx(1.0)
    # power-of-two one-peer graphs average exactly after one period
    for n in (2, 4, 8, 16):
        assert T.one_peer_exponential(n).spectral_gap() == pytest.approx(1.0, abs=1e-9)
    for n, r in ((8, 2), (8, 4), (16, 4), (32, 8)):
        assert T.alternating_exponential_ring(n, r).spectral_gap() == pytest.approx(1.0, abs=1e-9)
    # n = 3: W0 W1 = (2I + P + P^2) / 4, |lambda_2| = 1/4, over 2 steps
    assert T.one_peer_exponential(3).spectral_gap() == pytest.approx(1 - 0.25 ** 0.5)
    # not a power of two: connected, yet not exact
    for n in (5, 6, 7):
        assert 0 < T.one_peer_exponential(n).spectral_gap() < 1
    # a disconnected matrix: gap 0
    W = np.kron(np.eye(2), np.full((2, 2), 0.5))
    assert T.from_matrix(W).spectral_gap() == pytest.approx(0.0, abs=1e-12)
    # exponential graph of 4 (hops 1, 2), eigenvalues (1 + w + w^2) / 3 at the 4th roots w
    lam = max(abs((1 + w + w * w) / 3) for w in (1j, -1, -1j))
    assert T.exponential(4).spectral_gap() == pytest.approx(1 - lam)


def test_from_matrix_validation():
    ok = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])
    topo = T.from_matrix(ok, graph=ok > 0)
    assert topo.name == "matrix" and topo.n == 3 and topo.in_weights(0) == {1: 0.5}
    assert topo.out_peers(0) == [2]
    with pytest.raises(ValueError, match=r"row 0 of W sums to 1\.1, not 1"):
        T.from_matrix([[0.6, 0.5], [0.4, 0.5]])
    with pytest.raises(ValueError, match=r"column 0 of W sums to 1\.2, not 1"):
        T.from_matrix([[0.5, 0.5], [0.7, 0.3]])
    with pytest.raises(ValueError, match=r"W\[0, 1\] = -0\.5 is negative"):
        T.from_matrix([[1.5, -0.5], [-0.5, 1.5]])
    no_edge = ok > 0
    no_edge[1, 2] = False
    with pytest.raises(ValueError, match=r"W\[1, 2\] = 0\.5 but the graph has no edge 2 -> 1"):
        T.from_matrix(ok, graph=no_edge)
    extra = ok > 0
    extra[0, 2] = True
    with pytest.raises(ValueError, match=r"graph has the edge 2 -> 0 .* but W\[0, 2\] is 0"):
        T.from_matrix(ok, graph=extra)
    with pytest.raises(ValueError, match="square"):
        T.from_matrix(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="2 x 2 adjacency"):
        T.from_matrix(np.full((2, 2), 0.5), graph=np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="not finite"):
        T.from_matrix([[np.nan, 1.0], [1.0, 0.0]])


def test_by_name_pickle_immutable():
    for name in T.NAMES:
        kw = {"ranks_per_node": 2} if name == "aer" else {}
        topo = T.by_name(name, 6, **kw)
        assert topo.name == name and topo.n == 6
        again = pickle.loads(pickle.dumps(topo))
        assert again == topo and repr(again) == repr(topo)
        np.testing.assert_array_equal(again.matrix(1), topo.matrix(1))
        with pytest.raises(AttributeError):
            topo.n = 3
    assert repr(T.by_name("torus", 8, rows=2)) == "torus(n=8, rows=2)"
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        T.by_name("star", 4)
    with pytest.raises(TypeError, match="ranks_per_node"):
        T.by_name("aer", 4)
    m = T.one_peer_exponential(4).matrix(0)
    m[0, 0] = 7.0  # a copy: the topology is untouched
    assert T.one_peer_exponential(4).matrix(0)[0, 0] == 0.5


# ----------------------------------------------------------------------------- neighbor_allreduce
def _topologies_for(k):
    out = [T.ring(k), T.torus2d(k), T.exponential(k), T.one_peer_exponential(k), T.complete(k)]
    out += [T.alternating_exponential_ring(k, r) for r in (2, 3, 4) if k % r == 0 and r < k]
    rng = np.random.default_rng(100 + k)  # a random doubly stochastic W: mix of permutations
    W = sum(c * np.eye(k)[rng.permutation(k)] for c in rng.dirichlet(np.ones(3)))
    out.append(T.from_matrix(W, graph=W > 0))
    return out


def _inputs(k, m, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, m, generator=g, dtype=torch.float64).to(dtype)


def _run_neighbor(rank, world, lr):
    import torch.distributed as dist

    from linerate import neighbor_allreduce

    fails = []
    ncases = 0

    def check(cid, got, want, atol):
        nonlocal ncases
        ncases += 1
        got = np.asarray(got.double().reshape(-1))
        want = np.asarray(want).reshape(-1)
        if got.shape != want.shape:
            fails.append(f"rank {rank}: {cid}: shape {got.shape} != {want.shape}")
        elif got.size and not np.allclose(got, want, rtol=0, atol=atol):
            i = int(np.argmax(np.abs(got - want)))
            fails.append(f"rank {rank}: {cid}: max error {abs(got[i] - want[i]):.3g} at {i} "
                         f"(got {got[i]!r}, want {want[i]!r})")

    groups = {}
    for k in range(2, world):
        groups[k] = dist.new_group(ranks=list(range(k)), backend="linerate")
    groups[world] = None  # the default group (linerate)
    # (view of ranks != 2, view of rank 2, elements); 10,001 float64 > 64 KiB: ready handshake
    bad_cases = [("complete", "ring", 8), ("complete", "ring", 10_001), ("ring", "exp", 8)]
    bad_groups = [dist.new_group(ranks=list(range(4)), backend="linerate") for _ in bad_cases]
    gloo = dist.new_group(backend="gloo")

    for k, g in groups.items():
        if rank >= k:
            continue
        for ti, topo in enumerate(_topologies_for(k)):
            steps = range(min(topo.period + 1, 4)) if topo.period > 1 else [0]
            for step in steps:
                m = 13 + step  # odd sizes
                X = _inputs(k, m, seed=1000 * k + 10 * ti + step)
                x = X[rank].clone()
                neighbor_allreduce(x, topo, step=step, group=g)
                want = topo.matrix(step) @ X.numpy()
                check(f"k={k} {topo!r} step={step}", x, want[rank], 1e-12)
        # step=None: the group's counter (calls so far on this group), async, several at once
        topo = T.one_peer_exponential(k)
        X = _inputs(k, 7, seed=77)
        xs = [X[rank].clone() for _ in range(3)]
        works = [neighbor_allreduce(x, topo, async_op=True, group=g) for x in xs]
        first = None
        for w in works:
            assert w is not None
            w.wait()
        from linerate.collectives.neighbor import linerate_backend, _steps
        after = _steps[linerate_backend(g)]
        first = after - 3
        for i, x in enumerate(xs):
            check(f"k={k} counter step {first + i}", x, (topo.matrix(first + i) @ X.numpy())[rank], 1e-12)
        # other dtypes, with tolerances
        topo = T.exponential(k)
        W = topo.matrix()
        for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
            X = _inputs(k, 101, seed=5, dtype=dtype)
            x = X[rank].clone()
            neighbor_allreduce(x, topo, step=0, group=g)
            assert x.dtype == dtype
            check(f"k={k} {dtype}", x, (W @ X.double().numpy())[rank], atol)
        # size 0, many pipeline pieces, non-contiguous
        x = torch.empty(0, dtype=torch.float64)
        neighbor_allreduce(x, topo, step=0, group=g)
        check(f"k={k} size 0", x, np.empty(0), 0)
        # 10,001 float64 (> 64 KiB: the ready handshake; 20 pieces of 4 KiB), three calls in
        # flight at once, a time-varying topology among them
        X = _inputs(k, 10_001, seed=9)
        x = X[rank].clone()
        calls = [(T.ring(k), 0), (T.one_peer_exponential(k), 0), (T.one_peer_exponential(k), 1)]
        works = [neighbor_allreduce(x, t, step=st, async_op=True, group=g) for t, st in calls]
        for w in works:
            w.wait()
        want = X.numpy()
        for t, st in calls:
            want = t.matrix(st) @ want
        check(f"k={k} 10001 elements, 3 in flight", x, want[rank], 1e-12)
        X = _inputs(k, 12, seed=11)
        x = X[rank].clone().reshape(3, 4).t()  # non-contiguous view
        assert not x.is_contiguous()
        neighbor_allreduce(x, topo, step=0, group=g)
        check(f"k={k} non-contiguous", x.t(), (W @ X.numpy())[rank], 1e-12)
        # out=: the result elsewhere, the input unchanged; small (direct) and 10,001 elements
        # (pieces, the ready handshake), float64 and float16 (accumulated in float32), 3 in flight
        for m, dtype, atol in ((9, torch.float64, 1e-12), (10_001, torch.float64, 1e-12),
                               (10_001, torch.float16, 2e-3)):
            X = _inputs(k, m, seed=13, dtype=dtype)
            xs = [X[rank].clone() for _ in range(3)]
            outs = [torch.full_like(x, 7.0) for x in xs]
            topo1 = T.one_peer_exponential(k)
            works = [neighbor_allreduce(x, topo1, step=st, async_op=True, group=g, out=o)
                     for st, (x, o) in enumerate(zip(xs, outs))]
            for w in works:
                w.wait()
            for st, (x, o) in enumerate(zip(xs, outs)):
                check(f"k={k} out= {m} {dtype} step {st}", o,
                      (topo1.matrix(st) @ X.double().numpy())[rank], atol)
                check(f"k={k} out= {m} {dtype} step {st}: input unchanged", x, X[rank].double().numpy(), 0)

    # bad input: a clear error before anything is sent; the group stays usable
    errors = {}
    for cid, call in {
        "int dtype": lambda: neighbor_allreduce(torch.ones(3, dtype=torch.int64), T.ring(world)),
        "topology size": lambda: neighbor_allreduce(torch.ones(3), T.ring(world + 1)),
        "not a topology": lambda: neighbor_allreduce(torch.ones(3), "ring"),
        "gloo group": lambda: neighbor_allreduce(torch.ones(3), T.ring(world), group=gloo),
        "sparse": lambda: neighbor_allreduce(torch.ones(3).to_sparse(), T.ring(world)),
        "out dtype": lambda: neighbor_allreduce(torch.ones(3), T.ring(world),
                                                out=torch.ones(3, dtype=torch.float64)),
        "out shape": lambda: neighbor_allreduce(torch.ones(3), T.ring(world), out=torch.ones(4)),
        "out overlaps": lambda: (lambda b: neighbor_allreduce(b[:3], T.ring(world), out=b[2:]))(torch.ones(5)),
    }.items():
        try:
            call()
            errors[cid] = None
        except (ValueError, TypeError, RuntimeError) as e:
            errors[cid] = f"{type(e).__name__}: {e}"
    x = torch.full((4,), float(rank), dtype=torch.float64)
    neighbor_allreduce(x, T.complete(world), step=0)
    check("after bad input", x, np.full(4, (world - 1) / 2), 1e-12)

    # disagreement: rank 2 passes another topology. A rank fails in the call if the odd rank
    # is its neighbor in its own view (with "complete", everyone's); one whose own neighbors all
    # agree with it may complete, but the group is broken: its next collective fails.
    disagree = []
    for (honest, odd, size), bad_group in zip(bad_cases, bad_groups):
        if rank >= 4:
            continue
        topo = T.by_name(odd if rank == 2 else honest, 4)
        outcome = []
        for _ in range(2):
            try:
                w = neighbor_allreduce(torch.ones(size, dtype=torch.float64), topo, step=0,
                                       async_op=True, group=bad_group)
                w.wait()
            except Exception as e:  # noqa: BLE001 - the test looks at it
                outcome.append(f"{type(e).__name__}: {e}")
                break
            outcome.append("no error")
        disagree.append(outcome)
    return {"fails": fails, "ncases": ncases, "errors": errors, "disagree": disagree}


@pytest.mark.timeout(150)
def test_neighbor_allreduce_all_sizes():
    world = 8
    res = run_ranks(_run_neighbor, world, timeout=130, backend="linerate",
                    env={"LINERATE_PIECE_BYTES": "4096"})
    fails = [f for r in res for f in r["fails"]]
    assert not fails, "\n".join(fails[:30])
    assert res[0]["ncases"] > 100 and all(r["ncases"] > 20 for r in res)
    for rank, r in enumerate(res):
        e = r["errors"]
        assert e["int dtype"].startswith("ValueError") and f"rank {rank}" in e["int dtype"] \
            and "neighbor_allreduce" in e["int dtype"] and "int64" in e["int dtype"], e
        assert "ValueError" in e["topology size"] and f"{world + 1} ranks" in e["topology size"], e
        assert "TypeError" in e["not a topology"], e
        assert "RuntimeError" in e["gloo group"] and "linerate" in e["gloo group"], e
        assert "ValueError" in e["sparse"] and "dense" in e["sparse"], e
        assert "ValueError" in e["out dtype"] and "must match" in e["out dtype"], e
        assert "ValueError" in e["out shape"] and "must match" in e["out shape"], e
        assert "ValueError" in e["out overlaps"] and "overlaps" in e["out overlaps"], e
    for case in range(3):
        outcomes = [res[rank]["disagree"][case] for rank in range(4)]
        for rank, out in enumerate(outcomes):
            if case < 2 or rank in (1, 2, 3):  # every rank / the odd one and its neighbors
                assert len(out) == 1 and "neighbor_allreduce" in out[0], (case, rank, out)
            else:  # rank 0 (ring) is not a neighbor of rank 2: it fails by its next call
                assert out[-1] != "no error" and "neighbor_allreduce" in out[-1], (case, rank, out)
            assert out[-1].startswith(("DistBackendError", "RuntimeError")), out
        # the ranks that received the odd rank's messages name its call and theirs
        text = " ".join(o[-1] for o in outcomes)
        assert "ring(n=4) step=0" in text, text


# ----------------------------------------------------------------------------- hosts (netlab)
# ONE launch on a netlab of 2 hosts x 2 ranks (shared memory within a host, TCP between): the
# intra-host averages of AER (intra="average") as shared-memory All-Reduces, a group spanning
# hosts (complete) point to point, the hierarchical neighbor all-reduce with two host
# topologies, several dtypes and sizes, out=, async, a wrong topology; and
# DecentralizedDataParallel(hierarchical=True) with SGD against x(t+1) = M x(t) - lr g(x(t))
# computed from the ranks' x(t) and g gathered with Gloo. References: NumPy on the inputs
# gathered with Gloo.

HOSTS_SCRIPT = r'''
import numpy as np
import torch
import torch.distributed as dist
import linerate
import linerate.collectives.neighbor as nb
from linerate import topology as T

dist.init_process_group("linerate")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
hosts, shared = nb.host_layout(backend)
assert hosts == ((0, 1), (2, 3)) and shared and backend.host_engine is not None, (hosts, shared)
host = 0 if rank < 2 else 1
shm_calls = []
orig = nb._average_plan
nb._average_plan = lambda b, m: (shm_calls.append(tuple(m)), orig(b, m))[1]

def gather(x):
    xs = [torch.empty_like(x, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(xs, x.to(torch.float64), group=gloo)
    return np.stack([v.numpy() for v in xs])

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
checks = 0
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    for n in (1, 37, 70_001, 300_000):
        g = torch.Generator().manual_seed(1000 * rank + n)
        x = torch.randn(n, generator=g).to(dtype)
        X = gather(x)
        tol = TOL[dtype] * max(1.0, float(np.abs(X).max()))
        aer = T.alternating_exponential_ring(4, 2, intra="average")
        for step in (0, 1):          # across hosts (point to point), within (shared memory)
            y = x.clone()
            before = len(shm_calls)
            linerate.neighbor_allreduce(y, aer, step=step)
            want = aer.matrix(step) @ X
            np.testing.assert_allclose(y.to(torch.float64).numpy(), want[rank], atol=tol, rtol=0)
            assert len(shm_calls) - before == (1 if step == 1 else 0), (step, shm_calls)
            checks += 1
        y = torch.empty_like(x)      # complete: one group spanning the hosts, point to point
        w = linerate.neighbor_allreduce(x, T.complete(4), step=0, out=y, async_op=True)
        w.wait()
        np.testing.assert_allclose(y.to(torch.float64).numpy(), X.mean(0), atol=tol, rtol=0)
        for topo in (T.one_peer_exponential(2), T.from_matrix([[0.75, 0.25], [0.25, 0.75]])):
            Wm = topo.matrix(0)
            avg = np.stack([X[0:2].mean(0), X[2:4].mean(0)])
            want = (Wm @ avg)[host]
            y = x.clone()
            linerate.hierarchical_neighbor_allreduce(y, topo, step=0)
            np.testing.assert_allclose(y.to(torch.float64).numpy(), want, atol=tol, rtol=0)
            z = torch.empty_like(x)
            linerate.hierarchical_neighbor_allreduce(x, topo, step=0, out=z, async_op=True).wait()
            assert torch.equal(y, z), (dtype, n)
            peers = gather(y)        # the ranks of a host hold the same bits
            assert np.array_equal(peers[2 * host], peers[2 * host + 1])
            checks += 2
try:
    linerate.hierarchical_neighbor_allreduce(torch.ones(4), T.ring(4))
except ValueError as e:
    assert "on 2 host(s)" in str(e), e
else:
    raise AssertionError("a topology of ranks, not hosts, was accepted")

# DecentralizedDataParallel(hierarchical=True), SGD: x(t+1) = M x(t) - lr g(x(t)),
# M = W_hosts(t) (x) averaging within hosts
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model = linerate.DecentralizedDataParallel(net, "sgd", lr=0.05, topology="one-peer-exp",
                                           hierarchical=True, bucket_bytes=1024)
assert model.topology.n == 2
for t in range(3):
    g = torch.Generator().manual_seed(10 * t + rank)
    xb, yb = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    x_t = torch.cat([p.detach().reshape(-1) for p in model.params])
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.params])
    X, G = gather(x_t), gather(grad)
    Wm = model.topology.matrix(t)
    M = np.kron(Wm, np.full((2, 2), 0.5))
    model.step()
    x_new = torch.cat([p.detach().reshape(-1) for p in model.params]).to(torch.float64).numpy()
    np.testing.assert_allclose(x_new, (M @ X)[rank] - 0.05 * G[rank], atol=1e-6, rtol=0)
    checks += 1
print("hosts-ok", rank, checks, len(shm_calls), flush=True)
dist.destroy_process_group()
'''


@pytest.mark.netlab
@pytest.mark.timeout(200)
def test_host_averages_and_hierarchical_on_netlab(lab_name, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from linerate.tools import netlab
    root = Path(__file__).resolve().parent.parent
    netlab.up(lab_name, hosts=2, rate="1gbit", ranks_per_host=2)
    script = tmp_path / "hosts.py"
    script.write_text(HOSTS_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "linerate.tools.cli", "netlab", "run", "--name",
                        lab_name, "--timeout", "150", str(script)], cwd=root,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    ok = [line.split() for line in r.stdout.splitlines() if "hosts-ok" in line]
    assert len(ok) == 4, r.stdout[-4000:]
    for words in ok:
        i = words.index("hosts-ok")
        assert int(words[i + 2]) == 4 * 4 * 6 + 3 and int(words[i + 3]) == 16, words
