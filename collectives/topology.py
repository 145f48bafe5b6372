"""Mixing topologies for decentralized training (docs/neighbor-spec.md).

A topology of ``n`` ranks gives, for every step ``t``, a mixing matrix ``W(t)`` (n x n, float64,
nonnegative, doubly stochastic): after a neighbor all-reduce rank ``i`` holds
``sum_j W[i, j] * x_j``. Rank ``i`` receives from the ranks ``j != i`` with ``W[i, j] != 0`` (its
in-neighbors, :meth:`Topology.in_weights`) and sends to the ranks ``k != i`` with
``W[k, i] != 0`` (its out-peers, :meth:`Topology.out_peers`). Static graphs have ``period == 1``;
a time-varying graph repeats after ``period`` steps (``W(t) = W(t mod period)``).

Every topology accepts any ``n >= 1`` (not only powers of two): exponential hops are the powers
of two below ``n`` (``2^k < n``, so ``ceil(log2 n)`` of them, all distinct modulo ``n``); what a
power of two buys is exact averaging after one period of the one-peer graphs (spectral gap 1).

Orientation: in the exponential graphs rank ``i`` receives from ``(i + h) mod n`` and sends to
``(i - h) mod n`` for a hop ``h``; when ``h = n/2`` the two are the same rank (a pairwise
exchange).
"""
from __future__ import annotations

import hashlib
import math
import numbers

import numpy as np

__all__ = ["Topology", "ring", "torus2d", "exponential", "one_peer_exponential",
           "alternating_exponential_ring", "complete", "from_matrix", "by_name", "NAMES"]

#: Tolerance of the doubly-stochastic checks of :func:`from_matrix` (absolute, on the sums).
SUM_TOL = 1e-9


def _hops(n: int) -> list[int]:
    """The exponential hops of n ranks: 1, 2, 4, ... below n (ceil(log2 n) of them)."""
    out, h = [], 1
    while h < n:
        out.append(h)
        h *= 2
    return out


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {n!r}")
    return int(n)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an integer, got {step!r}")
    return int(step)


def _shift_mix(n: int, sources: list[int]) -> np.ndarray:
    """W = (I + P) / 2 where rank i receives from sources[i] (a permutation; i itself: W[i,i]=1)."""
    w = np.zeros((n, n))
    for i, s in enumerate(sources):
        w[i, i] += 0.5
        w[i, s] += 0.5
    return w


def _uniform(n: int, neighbors) -> np.ndarray:
    """Equal weight 1/(d+1) for rank i itself and each of its d in-neighbors (neighbors(i), a set
    without i). Doubly stochastic when every rank has the same d and every rank is the
    in-neighbor of d ranks (regular graphs: rings, tori, circulant graphs)."""
    w = np.zeros((n, n))
    for i in range(n):
        nb = neighbors(i)
        c = 1.0 / (len(nb) + 1)
        w[i, i] = c
        for j in nb:
            w[i, j] = c
    return w


class Topology:
    """A mixing topology of ``n`` ranks (immutable). See the module docstring.

    ``name`` is the :func:`by_name` key of the family ("ring", "torus", ...; "matrix" for
    :func:`from_matrix`); ``repr()`` also gives the parameters (every rank of a neighbor
    all-reduce must use the same one: the backend checks it)."""

    __slots__ = ("_n", "_name", "_period", "_params", "_build", "_cache", "_gap", "_ctor",
                 "_groups")

    def __init__(self, n: int, name: str, period: int, build, params: str = "", ctor=None):
        object.__setattr__(self, "_n", _check_n(n))
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_period", int(period))
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_build", build)   # build(step in [0, period)) -> ndarray
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "_gap", None)
        object.__setattr__(self, "_ctor", ctor)  # (function, args) that makes it again: pickling
        object.__setattr__(self, "_groups", {})

    def __reduce__(self):
        if self._ctor is None:
            raise TypeError(f"{self!r} cannot be pickled")
        return self._ctor

    def __setattr__(self, key, value):
        raise AttributeError("Topology objects are immutable")

    def __delattr__(self, key):
        raise AttributeError("Topology objects are immutable")

    @property
    def n(self) -> int:
        return self._n

    @property
    def name(self) -> str:
        return self._name

    @property
    def period(self) -> int:
        return self._period

    def __repr__(self) -> str:
        extra = f", {self._params}" if self._params else ""
        return f"{self._name}(n={self._n}{extra})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Topology) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    # ------------------------------------------------------------------ matrices
    def _w(self, step: int) -> np.ndarray:
        k = _check_step(step) % self._period
        w = self._cache.get(k)
        if w is None:
            w = np.ascontiguousarray(self._build(k), dtype=np.float64)
            w.setflags(write=False)
            self._cache[k] = w
        return w

    def matrix(self, step: int = 0) -> np.ndarray:
        """The n x n mixing matrix W(step) (float64, a fresh copy): rank i's new value is
        sum_j W[i, j] * x_j."""
        return self._w(step).copy()

    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self._n:
            raise ValueError(f"rank {rank!r} is not in the topology {self!r} (ranks 0..{self._n - 1})")
        return int(rank)

    def in_weights(self, rank: int, step: int = 0) -> dict[int, float]:
        """{j: W[rank, j]} for the ranks j != rank whose value rank receives (nonzero weights),
        in increasing j."""
        i = self._check_rank(rank)
        row = self._w(step)[i]
        return {int(j): float(row[j]) for j in np.flatnonzero(row) if j != i}

    def self_weight(self, rank: int, step: int = 0) -> float:
        """W[rank, rank]."""
        i = self._check_rank(rank)
        return float(self._w(step)[i, i])

    def out_peers(self, rank: int, step: int = 0) -> list[int]:
        """The ranks i != rank with W[i, rank] != 0 (those that receive rank's value), increasing."""
        j = self._check_rank(rank)
        col = self._w(step)[:, j]
        return [int(i) for i in np.flatnonzero(col) if i != j]

    def averaging_groups(self, step: int = 0) -> list[list[int]] | None:
        """The disjoint groups whose ranks W(step) averages, if it is such a matrix: every rank
        i gives weight 1/|g| to each rank of its group g (itself included) and none to the
        others. Sorted groups in order of their lowest rank, singletons included; None when
        W(step) is anything else. A neighbor all-reduce runs such a step as an All-Reduce
        (average) of each group: on shared memory where the group's ranks share a host
        (AER's intra-host steps with ``intra="average"``, a complete graph on one host; a
        2-rank exchange is such a group too)."""
        k = _check_step(step) % self._period
        if k not in self._groups:
            w = self._w(k)
            n = self._n
            groups, seen = [], [False] * n
            for i in range(n):
                if seen[i]:
                    continue
                members = [int(j) for j in np.flatnonzero(w[i])]
                g = len(members)
                ok = i in members and all(
                    not seen[j] and np.array_equal(np.flatnonzero(w[j]), members)
                    and np.all(np.abs(w[j, members] - 1.0 / g) <= 1e-12) for j in members)
                if not ok:
                    groups = None
                    break
                for j in members:
                    seen[j] = True
                groups.append(members)
            self._groups[k] = groups
        got = self._groups[k]
        return None if got is None else [list(g) for g in got]

    def spectral_gap(self) -> float:
        """1 - |lambda_2| of W (static), or of the product W(period-1) ... W(0) taken to the power
        1/period (time-varying). |lambda_2| is the second largest eigenvalue modulus: for a
        doubly stochastic M, the spectral radius of M - J/n (J: all ones). 1 means exact averaging
        (after one period); 0 means the ranks never agree (a disconnected graph)."""
        if self._gap is None:
            n = self._n
            m = np.eye(n)
            for t in range(self._period):
                m = self._w(t) @ m
            if n == 1:
                rho = 0.0
            else:
                rho = float(np.max(np.abs(np.linalg.eigvals(m - np.full((n, n), 1.0 / n)))))
                if rho < 1e-10:  # rounding noise of an exact average
                    rho = 0.0
            gap = 1.0 - min(rho, 1.0) ** (1.0 / self._period)
            object.__setattr__(self, "_gap", float(gap))
        return self._gap


# ---------------------------------------------------------------------------------- families
def ring(n: int) -> Topology:
    """Undirected ring: rank i averages itself and ranks i-1, i+1 with weight 1/3 each (n >= 3);
    n = 2: each of the two ranks weighs 1/2; n = 1: W = [[1]]."""
    n = _check_n(n)
    return Topology(n, "ring", 1, lambda t: _uniform(n, lambda i: {(i - 1) % n, (i + 1) % n} - {i}),
                    ctor=(ring, (n,)))


def _default_rows(n: int) -> int:
    """The largest divisor of n that is at most sqrt(n) (a prime n gives 1: a ring)."""
    best = 1
    for r in range(1, math.isqrt(n) + 1):
        if n % r == 0:
            best = r
    return best


def torus2d(n: int, rows: int | None = None) -> Topology:
    """2-D torus of ``rows`` x ``n // rows`` ranks (rank i at row i // cols, column i % cols;
    default rows: the largest divisor of n not above sqrt(n), so a prime n is a 1 x n ring).
    Rank i averages itself and its distinct up/down/left/right neighbors (with wrap-around) with
    equal weights 1/(d+1); d is 4, or less where a dimension has 1 or 2 ranks (then the two
    neighbors along it coincide or are i itself). The torus is vertex-transitive, so every rank has
    the same d and W is symmetric and doubly stochastic."""
    n = _check_n(n)
    if rows is None:
        rows = _default_rows(n)
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1 or n % rows:
        raise ValueError(f"torus2d: rows must be a positive divisor of n={n}, got {rows!r}")
    rows = int(rows)
    cols = n // rows

    def nb(i):
        r, c = divmod(i, cols)
        return {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                r * cols + (c - 1) % cols, r * cols + (c + 1) % cols} - {i}

    return Topology(n, "torus", 1, lambda t: _uniform(n, nb), params=f"rows={rows}",
                    ctor=(torus2d, (n, rows)))


def exponential(n: int) -> Topology:
    """Static exponential graph: rank i receives from (i + 2^k) mod n and sends to (i - 2^k)
    mod n for every 2^k < n, and weighs itself and each of its ceil(log2 n) in-neighbors equally,
    1/(ceil(log2 n) + 1). The hops are distinct modulo n for any n, so W is circulant, hence
    doubly stochastic (for n = 3 it is the complete graph)."""
    n = _check_n(n)
    hops = _hops(n)
    return Topology(n, "exp", 1, lambda t: _uniform(n, lambda i: {(i + h) % n for h in hops}),
                    ctor=(exponential, (n,)))


def _one_peer(n: int, k: int) -> np.ndarray:
    h = 1 << k
    return _shift_mix(n, [(i + h) % n for i in range(n)])


def one_peer_exponential(n: int) -> Topology:
    """One-peer exponential graph (time-varying): at step t, with h = 2^(t mod period) and
    period = ceil(log2 n) (the number of hops 2^k < n), rank i averages with rank (i + h) mod n:
    W(t) = (I + P_t) / 2 where P_t is the cyclic shift by h, so rank i receives from (i + h) mod n
    and sends to (i - h) mod n (one message each way; W is doubly stochastic since P_t is a
    permutation). For n a power of two the product over one period is exactly J/n (spectral gap
    1); for other n the hops still reach every rank and the gap is below 1. n = 1: W = [[1]]."""
    n = _check_n(n)
    period = max(1, len(_hops(n)))
    if n == 1:
        return Topology(1, "one-peer-exp", 1, lambda t: np.ones((1, 1)), ctor=(one_peer_exponential, (1,)))
    return Topology(n, "one-peer-exp", period, lambda t: _one_peer(n, t),
                    ctor=(one_peer_exponential, (n,)))


def alternating_exponential_ring(n: int, ranks_per_node: int, intra: str = "one-peer") -> Topology:
    """Alternating exponential ring (AER): the n = N * r ranks sit on N nodes of
    r = ``ranks_per_node`` ranks (rank i on node a = i // r with local index l = i % r; n must be
    a multiple of r). The nodes form a ring that is crossed by exponential hops, and steps
    alternate between the network and the node:

    * even step t (s = t // 2): across nodes. Rank (a, l) averages with rank
      ((a + 2^(s mod tN)) mod N, l), the rank with the same local index on the node 2^k further
      along the ring of nodes (tN = ceil(log2 N)): every rank sends one message over the network
      and receives one, and each column {(a, l) : a} runs a one-peer exponential graph.
      W = W1pe_N(s) (x) I_r.
    * odd step t: within a node. Rank (a, l) averages with (a, (l + 2^(s mod tr)) mod r)
      (tr = ceil(log2 r)): the one-peer exponential graph of the node's r ranks, over the fast
      intra-node links (for r <= 3, a ring). W = I_N (x) W1pe_r(s).

    Each W is (I + P) / 2 for a permutation P, hence doubly stochastic. The two kinds of steps act
    on different factors of the Kronecker product, so for N and r powers of two one period
    (2 * lcm(tN, tr) steps) averages exactly (spectral gap 1). With a single node (N = 1) or one
    rank per node (r = 1) nothing alternates: every step is the one-peer exponential graph of the
    n ranks.

    ``intra="average"`` (as the AER of Decent-DP): every odd step averages each node's r ranks
    instead, W = I_N (x) J_r / r, which a neighbor all-reduce runs as an All-Reduce of the node's
    ranks -- on shared memory where they share a host; period 2 * tN (one node: its average
    every step, period 1). With r = 2 the two are the same matrices."""
    n = _check_n(n)
    if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, numbers.Integral)
            or ranks_per_node < 1 or n % ranks_per_node):
        raise ValueError(f"alternating_exponential_ring: ranks_per_node must be a positive divisor "
                         f"of n={n}, got {ranks_per_node!r}")
    r = int(ranks_per_node)
    nodes = n // r
    if intra not in ("one-peer", "average"):
        raise ValueError(f"alternating_exponential_ring: intra must be 'one-peer' or 'average', "
                         f"got {intra!r}")
    params = f"ranks_per_node={r}" + (", intra=average" if intra == "average" else "")
    if intra == "average" and r > 1:
        block = np.kron(np.eye(nodes), np.full((r, r), 1.0 / r))
        if nodes == 1:
            return Topology(n, "aer", 1, lambda t: block, params=params,
                            ctor=(alternating_exponential_ring, (n, r, intra)))
        t_nodes = len(_hops(nodes))

        def build_avg(t):
            if t % 2 == 1:
                return block
            h = 1 << ((t // 2) % t_nodes)
            return _shift_mix(n, [((i // r + h) % nodes) * r + i % r for i in range(n)])

        return Topology(n, "aer", 2 * t_nodes, build_avg, params=params,
                        ctor=(alternating_exponential_ring, (n, r, intra)))
    if nodes == 1 or r == 1:
        base = one_peer_exponential(n)
        return Topology(n, "aer", base.period, base._build, params=params,
                        ctor=(alternating_exponential_ring, (n, r)))
    t_nodes, t_local = len(_hops(nodes)), len(_hops(r))
    period = 2 * math.lcm(t_nodes, t_local)

    def build(t):
        s = t // 2
        if t % 2 == 0:
            h = 1 << (s % t_nodes)
            src = [((i // r + h) % nodes) * r + i % r for i in range(n)]
        else:
            h = 1 << (s % t_local)
            src = [(i // r) * r + (i % r + h) % r for i in range(n)]
        return _shift_mix(n, src)

    return Topology(n, "aer", period, build, params=params, ctor=(alternating_exponential_ring, (n, r)))


def complete(n: int) -> Topology:
    """Every rank averages all n ranks: W = J / n (what an all-reduce average computes)."""
    n = _check_n(n)
    return Topology(n, "complete", 1, lambda t: np.full((n, n), 1.0 / n), ctor=(complete, (n,)))


def from_matrix(W, graph=None) -> Topology:
    """A static topology with the user's mixing matrix ``W`` (n x n; W[i, j] is the weight rank i
    gives rank j's value). Raises ValueError, naming the row/column and its sum or the entry, when
    W is not square and finite, has a negative entry, has a row or a column that does not sum to 1
    (within 1e-9), or, with ``graph`` (a bool n x n adjacency: graph[i, j] means rank i receives
    from rank j; the diagonal is ignored), when an off-diagonal W[i, j] is nonzero without the edge
    or zero on an edge."""
    try:
        w = np.array(W, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"from_matrix: W is not a numeric matrix: {e}") from None
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
        raise ValueError(f"from_matrix: W must be a square n x n matrix, got shape {w.shape}")
    n = w.shape[0]
    bad = np.argwhere(~np.isfinite(w))
    if bad.size:
        i, j = bad[0]
        raise ValueError(f"from_matrix: W[{i}, {j}] = {float(w[i, j])} is not finite")
    bad = np.argwhere(w < 0)
    if bad.size:
        i, j = bad[0]
        raise ValueError(f"from_matrix: W[{i}, {j}] = {float(w[i, j]):.12g} is negative: a mixing matrix must "
                         f"be nonnegative")
    rows, cols = w.sum(axis=1), w.sum(axis=0)
    for i in range(n):
        if abs(rows[i] - 1.0) > SUM_TOL:
            raise ValueError(f"from_matrix: row {i} of W sums to {float(rows[i]):.12g}, not 1: W must be "
                             f"doubly stochastic (rows and columns summing to 1)")
    for j in range(n):
        if abs(cols[j] - 1.0) > SUM_TOL:
            raise ValueError(f"from_matrix: column {j} of W sums to {float(cols[j]):.12g}, not 1: W must be "
                             f"doubly stochastic (rows and columns summing to 1)")
    if graph is not None:
        g = np.asarray(graph)
        if g.shape != (n, n):
            raise ValueError(f"from_matrix: graph must be a {n} x {n} adjacency matrix like W, got "
                             f"shape {g.shape}")
        g = g.astype(bool)
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                if w[i, j] != 0 and not g[i, j]:
                    raise ValueError(f"from_matrix: W[{i}, {j}] = {float(w[i, j]):.12g} but the graph has no "
                                     f"edge {j} -> {i} (graph[{i}, {j}] is False): the support of W "
                                     f"must be the graph")
                if w[i, j] == 0 and g[i, j]:
                    raise ValueError(f"from_matrix: the graph has the edge {j} -> {i} (graph[{i}, "
                                     f"{j}]) but W[{i}, {j}] is 0: the support of W must be the "
                                     f"graph")
    w.setflags(write=False)
    digest = hashlib.blake2b(np.ascontiguousarray(w).tobytes(), digest_size=6).hexdigest()
    return Topology(n, "matrix", 1, lambda t: w, params=f"sha={digest}", ctor=(from_matrix, (w,)))


#: by_name keys and their constructors.
NAMES = {
    "ring": ring,
    "torus": torus2d,
    "exp": exponential,
    "one-peer-exp": one_peer_exponential,
    "aer": alternating_exponential_ring,
    "complete": complete,
}


def by_name(name: str, n: int, **kw) -> Topology:
    """The topology called ``name`` ("ring", "torus", "exp", "one-peer-exp", "aer", "complete")
    of n ranks; ``kw`` goes to its constructor (torus: rows; aer: ranks_per_node, required)."""
    try:
        make = NAMES[name]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; choose from {', '.join(NAMES)}") from None
    try:
        return make(n, **kw)
    except TypeError as e:
        raise TypeError(f"topology {name!r}: {e}") from None
