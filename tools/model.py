"""linerate model: predict the step time of All-Reduce and of decentralized topologies.

Given a cluster (nodes, ranks per node, intra-node and inter-node bandwidth and latency), the
bytes of the model and the compute time of one step, it predicts the time per training step of

  allreduce      ring All-Reduce of the gradients, overlapping the backward pass only:
                 T = T_fwd + max(T_bwd, T_ar),  T_ar = 2(n-1)a + 2(n-1)/n * M / b_eff
  ring, torus, exp, one-peer-exp, aer, complete
                 decentralized training (parameters averaged with the topology's neighbors),
                 the exchange overlapping the whole iteration:
                 T = max(T_fwd + T_bwd, T_exchange), averaged over a time-varying graph's period

and ranks them. The derivation and the assumptions are in docs/model.md.

The cluster comes from options, from a running netlab (--netlab NAME: its configured rates) or
is measured (--measure --netlab NAME: TCP probes between hosts of one node and, all at once,
across the node uplink). On a real cluster, measure the links with `linerate bench` (its raw
link capacity line) or iperf3 and pass --intra-gbit / --inter-gbit.

Python API: Cluster, predict(), recommend(), measure_netlab().
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass

from tools.argtypes import nonneg_float as _nonneg_float
from tools.argtypes import positive_float as _positive_float
from tools.argtypes import positive_int as _positive_int
from tools.argtypes import size as _size

#: The topologies of collectives.topology (by_name keys), exchanged point to point by
#: neighbor_allreduce; the model mirrors their definitions (docs/model.md).
TOPOLOGIES = ("ring", "torus", "exp", "one-peer-exp", "aer", "complete")
#: What recommend() ranks by default: what linerate runs.
METHODS = ("allreduce",) + TOPOLOGIES
#: Averages over groups of ranks run as ring All-Reduces of each group (how Decent-DP, the
#: paper's library, runs AER and complete); not what neighbor_allreduce does today, so only
#: ranked when asked for (--methods).
GROUP_METHODS = ("aer-allreduce", "complete-allreduce")
ALL_METHODS = METHODS + GROUP_METHODS
#: recommend()'s order among methods whose step times tie: best mixing first.
TIE_ORDER = ("allreduce", "complete-allreduce", "complete", "aer-allreduce", "aer",
             "one-peer-exp", "exp", "torus", "ring")
_ALIASES = {"all-reduce": "allreduce", "all_reduce": "allreduce", "ar": "allreduce",
            "exponential": "exp", "one-peer-exponential": "one-peer-exp",
            "alternating-exp-ring": "aer", "alternating-exponential-ring": "aer",
            "torus2d": "torus"}
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
               "bfloat16": 2, "bf16": 2, "float64": 8, "double": 8, "fp64": 8,
               "int8": 1, "uint8": 1}
DEFAULT_FWD_FRACTION = 1 / 3
DEFAULT_MEASURE_SECONDS = 2.0
DEFAULT_PINGS = 200


# ----------------------------------------------------------------------------- the cluster

@dataclass
class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks. Every rank has a full-duplex link of
    ``intra_gbit`` to its node's switch; each node reaches the others through one full-duplex
    uplink of ``inter_gbit``, shared by every flow that leaves (or enters) the node. Ranks are
    placed node-major (rank = node * ranks_per_node + local rank), as torchrun does."""
    nodes: int
    ranks_per_node: int
    intra_gbit: float
    inter_gbit: float
    intra_latency_s: float = 50e-6
    inter_latency_s: float = 100e-6

    def __post_init__(self):
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"nodes and ranks_per_node must be at least 1, got "
                             f"{self.nodes} and {self.ranks_per_node}")
        if not self.intra_gbit > 0 or (self.nodes > 1 and not self.inter_gbit > 0):
            raise ValueError("bandwidths must be positive")
        if self.intra_latency_s < 0 or self.inter_latency_s < 0:
            raise ValueError("latencies must not be negative")

    @property
    def n(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def describe(self) -> str:
        s = (f"{self.nodes} node(s) x {self.ranks_per_node} rank(s) (n={self.n}), "
             f"rank links {self.intra_gbit:.4g} Gbit/s, {self.intra_latency_s * 1e6:.3g} us")
        if self.nodes > 1:
            s += (f"; node uplinks {self.inter_gbit:.4g} Gbit/s, "
                  f"{self.inter_latency_s * 1e6:.3g} us")
        return s


# ----------------------------------------------------------------------------- links

def link_loads(cluster: Cluster, flows) -> dict[tuple[str, int], list]:
    """Bytes and flow count on every directed link that ``flows`` (src, dst, nbytes) cross.

    Links: ("rank-out", r) and ("rank-in", r), rank r's link to its switch (intra_gbit each
    way); ("uplink-out", k) and ("uplink-in", k), node k's uplink (inter_gbit each way), crossed
    only by flows between different nodes."""
    loads: dict[tuple[str, int], list] = {}

    def add(link, nbytes):
        entry = loads.setdefault(link, [0.0, 0])
        entry[0] += nbytes
        entry[1] += 1

    for src, dst, nbytes in flows:
        add(("rank-out", src), nbytes)
        add(("rank-in", dst), nbytes)
        a, b = cluster.node_of(src), cluster.node_of(dst)
        if a != b:
            add(("uplink-out", a), nbytes)
            add(("uplink-in", b), nbytes)
    return loads


def capacity_bytes_s(cluster: Cluster, link: tuple[str, int]) -> float:
    gbit = cluster.inter_gbit if link[0].startswith("uplink") else cluster.intra_gbit
    return gbit * 1e9 / 8


def transfer(cluster: Cluster, flows, latency_s: float | None = None) -> dict:
    """Time for ``flows`` (src, dst, nbytes) that all start together: latency + the busiest
    link's bytes over its capacity (every link full-duplex and kept busy while it has bytes to
    carry). ``latency_s`` defaults to one round: the inter-node latency if any flow crosses
    nodes, else the intra-node one."""
    flows = [f for f in flows if f[0] != f[1] and f[2] > 0]
    loads = link_loads(cluster, flows)
    bw_s, bottleneck = 0.0, None
    for link, (nbytes, _) in sorted(loads.items()):
        t = nbytes / capacity_bytes_s(cluster, link)
        if t > bw_s:
            bw_s, bottleneck = t, link
    if latency_s is None:
        crossing = any(cluster.node_of(s) != cluster.node_of(d) for s, d, _ in flows)
        latency_s = 0.0 if not flows else (cluster.inter_latency_s if crossing
                                           else cluster.intra_latency_s)
    uplink_flows = max((k for (kind, _), (_, k) in loads.items() if kind.startswith("uplink")),
                       default=0)
    return {"seconds": latency_s + bw_s, "bandwidth_s": bw_s, "latency_s": latency_s,
            "bottleneck": f"{bottleneck[0]} {bottleneck[1]}" if bottleneck else None,
            "uplink_flows": uplink_flows, "flows": len(flows),
            "sent_bytes_per_rank": max((v[0] for k, v in loads.items() if k[0] == "rank-out"),
                                       default=0.0)}


def group_allreduce(cluster: Cluster, groups, model_bytes: float) -> dict:
    """Disjoint groups each averaging M bytes with a ring All-Reduce, all at once: the ring
    edges of a group of g ranks carry 2(g-1)/g * M each; a group's latency is 2(g-1) rounds
    of the inter-node latency if it spans nodes, else of the intra-node one."""
    flows, latency_s = [], 0.0
    for g in groups:
        k = len(g)
        if k < 2:
            continue
        per_edge = 2 * (k - 1) / k * model_bytes
        flows += [(g[i], g[(i + 1) % k], per_edge) for i in range(k)]
        spans = len({cluster.node_of(r) for r in g}) > 1
        alpha = cluster.inter_latency_s if spans else cluster.intra_latency_s
        latency_s = max(latency_s, 2 * (k - 1) * alpha)
    return transfer(cluster, flows, latency_s)


def neighbor_exchange(cluster: Cluster, pattern, step: int, model_bytes: float) -> dict:
    """One step of ``pattern``: group averages (``pattern.groups(step)``) where it has them,
    else every rank sends M to each of its out-peers, all at once."""
    groups = pattern.groups(step) if hasattr(pattern, "groups") else None
    if groups is not None:
        return group_allreduce(cluster, groups, model_bytes) | {"kind": "groups",
                                                                "groups": len(groups)}
    flows = [(r, p, model_bytes) for r in range(cluster.n) for p in pattern.out_peers(r, step)]
    return transfer(cluster, flows) | {"kind": "neighbors"}


def ring_allreduce(cluster: Cluster, model_bytes: float) -> dict:
    """T_ar = 2(n-1)a + 2(n-1)/n * M / b_eff for the ring r -> r+1 (node-major placement).

    b_eff is the slowest link the ring crosses, each link's capacity divided by the ring flows
    sharing it: every rank link carries one flow each way; with node-major placement exactly one
    ring edge leaves each node (its last rank -> the next node's first), so each uplink carries
    one flow each way and b_eff = min(intra, inter)."""
    n = cluster.n
    if n == 1 or model_bytes <= 0:
        return {"seconds": 0.0, "bandwidth_s": 0.0, "latency_s": 0.0, "beta_eff_gbit": None,
                "uplink_flows": 0, "bottleneck": None, "steps": 0}
    flows = [(r, (r + 1) % n, 1) for r in range(n)]
    loads = link_loads(cluster, flows)
    beta_eff, bottleneck = min((capacity_bytes_s(cluster, link) / k, link)
                               for link, (_, k) in loads.items())
    alpha = cluster.inter_latency_s if cluster.nodes > 1 else cluster.intra_latency_s
    latency_s = 2 * (n - 1) * alpha
    bw_s = 2 * (n - 1) / n * model_bytes / beta_eff
    uplink_flows = max((k for (kind, _), (_, k) in loads.items() if kind.startswith("uplink")),
                       default=0)
    return {"seconds": latency_s + bw_s, "bandwidth_s": bw_s, "latency_s": latency_s,
            "beta_eff_gbit": beta_eff * 8 / 1e9, "uplink_flows": uplink_flows,
            "bottleneck": f"{bottleneck[0]} {bottleneck[1]}", "steps": 2 * (n - 1),
            "sent_bytes_per_rank": 2 * (n - 1) / n * model_bytes}


# ----------------------------------------------------------------------------- topologies

def torus_shape(n: int) -> tuple[int, int]:
    """rows x cols with rows the largest divisor of n not above sqrt(n) (rows <= cols)."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def _hops(n: int) -> list[int]:
    """The exponential hops of n ranks: 1, 2, 4, ... below n."""
    out, h = [], 1
    while h < n:
        out.append(h)
        h *= 2
    return out


class Pattern:
    """What each step of a topology sends: the model's copy of collectives.topology's
    definitions (tests/test_model.py checks that the two cost the same).

    A step is either a neighbor exchange -- every rank sends its parameters (M bytes) to each
    of ``out_peers(rank, step)``, point to point, as neighbor_allreduce does -- or, for the
    GROUP_METHODS, averages within disjoint groups of ranks, each run as a ring All-Reduce of
    the group (``groups(step)``). ``n``, ``name``, ``period`` and ``out_peers`` are what
    collectives.topology.Topology has: any object with them can be passed to predict() as
    ``method``.
    """

    def __init__(self, name: str, n: int, ranks_per_node: int = 1):
        if n % ranks_per_node:
            raise ValueError(f"{n} ranks do not split into nodes of {ranks_per_node}")
        self.name, self.n, self.rpn = name, n, ranks_per_node
        self.nodes = n // ranks_per_node
        self._alternates = self.nodes > 1 and self.rpn > 1
        if name == "one-peer-exp" or (name == "aer" and not self._alternates):
            self.period = max(1, len(_hops(n)))
        elif name == "aer":
            t_nodes, t_local = len(_hops(self.nodes)), len(_hops(self.rpn))
            self.period = 2 * t_nodes * t_local // math.gcd(t_nodes, t_local)
        elif name == "aer-allreduce":
            self.period = max(1, len(_hops(self.nodes)) * (2 if self.rpn > 1 else 1))
        elif name in TOPOLOGIES or name in GROUP_METHODS:
            self.period = 1
        else:
            raise ValueError(f"no pattern {name!r}")

    def _node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.rpn, (node + 1) * self.rpn))

    def groups(self, step: int = 0) -> list[list[int]] | None:
        """The averaging groups of this step (ranks sorted), or None for a neighbor exchange.

        complete-allreduce: all ranks. aer-allreduce: even steps 2u average node a with node
        a + 2^u (pairs, lowest a first; an unpaired node averages alone), odd steps average
        within each node; one node: within it every step."""
        if self.name == "complete-allreduce":
            return [list(range(self.n))]
        if self.name != "aer-allreduce":
            return None
        if self.nodes == 1:
            return [self._node_ranks(0)]
        t = step % self.period
        if self.rpn > 1 and t % 2 == 1:
            return [self._node_ranks(a) for a in range(self.nodes)]
        u = t // 2 if self.rpn > 1 else t
        used, pairs = [False] * self.nodes, []
        for a in range(self.nodes):
            b = (a + (1 << u)) % self.nodes
            if a != b and not used[a] and not used[b]:
                used[a] = used[b] = True
                pairs.append((a, b))
        return ([self._node_ranks(a) + self._node_ranks(b) for a, b in pairs]
                + [self._node_ranks(a) for a in range(self.nodes) if not used[a]])

    def out_peers(self, rank: int, step: int = 0) -> list[int]:
        """Ranks that receive ``rank``'s parameters at ``step`` (W[i, rank] != 0, i != rank)."""
        n = self.n
        if n == 1:
            return []
        groups = self.groups(step)
        if groups is not None:
            peers = set(next(g for g in groups if rank in g))
        elif self.name == "ring":
            peers = {(rank - 1) % n, (rank + 1) % n}
        elif self.name == "torus":
            rows, cols = torus_shape(n)
            r, c = divmod(rank, cols)
            peers = {((r + dr) % rows) * cols + (c + dc) % cols
                     for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))}
        elif self.name == "exp":          # rank i receives from i + 2^k: read by rank - 2^k
            peers = {(rank - h) % n for h in _hops(n)}
        elif self.name == "complete":
            peers = set(range(n))
        elif self.name == "one-peer-exp" or not self._alternates:   # aer on 1 node / 1 rank
            peers = {(rank - (1 << (step % self.period))) % n}
        else:                             # aer: even steps across nodes, odd within
            t = step % self.period
            node, local = divmod(rank, self.rpn)
            if t % 2 == 0:
                hops = _hops(self.nodes)
                h = hops[(t // 2) % len(hops)]
                peers = {((node - h) % self.nodes) * self.rpn + local}
            else:
                hops = _hops(self.rpn)
                h = hops[(t // 2) % len(hops)]
                peers = {node * self.rpn + (local - h) % self.rpn}
        peers.discard(rank)
        return sorted(peers)


def canonical_method(method: str) -> str:
    name = _ALIASES.get(method.strip().lower(), method.strip().lower())
    if name not in ALL_METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(ALL_METHODS)}")
    return name


# ----------------------------------------------------------------------------- prediction

def overlapped(a: float, b: float, cpu_contention: float = 1.0) -> float:
    """Time of two activities that start together and share the CPU: while both run each goes
    ``cpu_contention`` (c) times slower, so T = max(a, b) + (c - 1) * min(a, b); c = 1 is
    perfect overlap, c = 2 no overlap at all (a + b)."""
    return max(a, b) + (cpu_contention - 1.0) * min(a, b)


def predict(cluster: Cluster, model_bytes: int, compute_s: float,
            fwd_fraction: float = DEFAULT_FWD_FRACTION, method="allreduce",
            overlap: bool = True, *, cpu_contention: float = 1.0) -> dict:
    """Predicted time of one training step.

    ``method``: "allreduce", a topology name (ring, torus, exp, one-peer-exp, aer, complete)
    or a topology object with ``n``, ``period`` and ``out_peers(rank, step)`` (exchanged
    point to point). Returns {"step_s", "comm_s", "compute_s", "formula", ...}: comm_s is the
    All-Reduce time, or the exchange time averaged over the topology's period."""
    if model_bytes < 0 or compute_s < 0:
        raise ValueError("model_bytes and compute_s must not be negative")
    if not 0.0 <= fwd_fraction <= 1.0:
        raise ValueError(f"fwd_fraction must be in [0, 1], got {fwd_fraction}")
    if not 1.0 <= cpu_contention <= 2.0:
        raise ValueError(f"cpu_contention must be in [1, 2], got {cpu_contention}")
    fwd_s = fwd_fraction * compute_s
    bwd_s = compute_s - fwd_s
    c = cpu_contention
    ms = 1e3
    base = {"compute_s": compute_s, "fwd_s": fwd_s, "bwd_s": bwd_s, "n": cluster.n,
            "model_bytes": model_bytes, "overlap": overlap, "cpu_contention": c}

    if isinstance(method, str) and canonical_method(method) == "allreduce":
        ar = ring_allreduce(cluster, model_bytes)
        t_ar = ar["seconds"]
        if overlap:
            step = fwd_s + overlapped(bwd_s, t_ar, c)
            how = "T = T_fwd + max(T_bwd, T_ar)"
            vals = f"{fwd_s * ms:.2f} + max({bwd_s * ms:.2f}, {t_ar * ms:.2f}) ms"
            if c != 1.0:
                how += f" (cpu contention {c:g})"
        else:
            step = compute_s + t_ar
            how = "T = T_fwd + T_bwd + T_ar"
            vals = f"{fwd_s * ms:.2f} + {bwd_s * ms:.2f} + {t_ar * ms:.2f} ms"
        if ar["beta_eff_gbit"] is not None:
            ar_f = (f"T_ar = 2(n-1)a + 2(n-1)/n*M/b_eff = {2 * (cluster.n - 1)}*"
                    f"{ar['latency_s'] / (2 * (cluster.n - 1)) * 1e6:g}us + "
                    f"{2 * (cluster.n - 1) / cluster.n:.3f}*{model_bytes / 2**20:.2f}MiB/"
                    f"{ar['beta_eff_gbit']:.4g}Gbit/s = {t_ar * ms:.2f} ms")
        else:
            ar_f = "T_ar = 0 (one rank, or nothing to send)"
        return {**base, "method": "allreduce", "step_s": step, "comm_s": t_ar, "period": 1,
                "formula": f"{how} = {vals} = {step * ms:.2f} ms; {ar_f}",
                "uplink_flows": ar["uplink_flows"], "allreduce": ar,
                "sent_bytes_per_rank": ar.get("sent_bytes_per_rank", 0.0)}

    pattern = Pattern(canonical_method(method), cluster.n, cluster.ranks_per_node) \
        if isinstance(method, str) else method
    if pattern.n != cluster.n:
        raise ValueError(f"topology has {pattern.n} ranks, the cluster {cluster.n}")
    steps, step_times = [], []
    for t in range(pattern.period):
        x = neighbor_exchange(cluster, pattern, t, model_bytes)
        steps.append(x)
        step_times.append(overlapped(compute_s, x["seconds"], c) if overlap
                          else compute_s + x["seconds"])
    step = sum(step_times) / len(step_times)
    comm = sum(x["seconds"] for x in steps) / len(steps)
    how = "max(T_fwd + T_bwd, T_exchange(t))" if overlap else "T_fwd + T_bwd + T_exchange(t)"
    per = ", ".join(f"{x['seconds'] * ms:.2f}" for x in steps[:8]) + \
        (", ..." if len(steps) > 8 else "")
    formula = (f"T = mean over {pattern.period} step(s) of {how}; T_exchange(t) = latency + "
               f"max over links of bytes/capacity = [{per}] ms; compute {compute_s * ms:.2f} ms"
               f" -> {step * ms:.2f} ms")
    if c != 1.0 and overlap:
        formula += f" (cpu contention {c:g})"
    return {**base, "method": getattr(pattern, "name", str(method)), "step_s": step,
            "comm_s": comm, "period": pattern.period, "formula": formula, "steps": steps,
            "uplink_flows": max(x["uplink_flows"] for x in steps),
            "sent_bytes_per_rank": sum(x["sent_bytes_per_rank"] for x in steps) / len(steps)}


def recommend(cluster: Cluster, model_bytes: int, compute_s: float,
              fwd_fraction: float = DEFAULT_FWD_FRACTION, *, methods=METHODS,
              overlap: bool = True, cpu_contention: float = 1.0) -> list[tuple[str, float]]:
    """(method, predicted step seconds) for every method, fastest first.

    ``methods``: names from ALL_METHODS (default METHODS, what linerate runs). Times equal to
    1 ns (e.g. every method hidden behind the compute) are ties, broken in favor of better
    mixing (TIE_ORDER): All-Reduce (exact average), complete, aer and one-peer-exp (exact
    average after a period for powers of two), exp, torus, ring."""
    names = list(dict.fromkeys(canonical_method(m) for m in methods))
    out = [(m, predict(cluster, model_bytes, compute_s, fwd_fraction, m, overlap,
                       cpu_contention=cpu_contention)["step_s"]) for m in names]
    order = {m: i for i, m in enumerate(TIE_ORDER)}
    return sorted(out, key=lambda mt: (round(mt[1], 9), order[mt[0]]))


# ----------------------------------------------------------------------------- netlab

_ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(64)
    if not b: break
    c.sendall(b)
"""

_PING = r"""
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(64); rtt.append(time.perf_counter() - t)
print(statistics.median(rtt), flush=True)
"""


def _one_way_latency(lab, src, dst, pings: int = DEFAULT_PINGS) -> float:
    """Half the median round trip of a 1-byte TCP ping-pong between two netlab hosts."""
    from tools import netlab
    s, d = lab.host(src), lab.host(dst)
    echo = subprocess.Popen(netlab.netns_argv(d, [sys.executable, "-c", _ECHO, d.addrs[0]]),
                            stdout=subprocess.PIPE, text=True)
    try:
        port = echo.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"latency probe: echo server on {d.name} did not start")
        out = subprocess.run(netlab.netns_argv(s, [sys.executable, "-c", _PING, d.addrs[0],
                                                   port, str(pings)]),
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return float(out.strip()) / 2
    finally:
        if echo.poll() is None:
            echo.kill()
        echo.wait()


def _concurrent(fns) -> list:
    """Run the zero-argument callables at once (threads); results in order, errors raised."""
    results, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True)
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _node_hosts(lab) -> list[list]:
    nodes: dict[int, list] = {}
    for h in lab.hosts:
        nodes.setdefault(h.node, []).append(h)
    return [nodes[k] for k in sorted(nodes)]


def cluster_from_lab(lab, intra_latency_s: float = 50e-6,
                     inter_latency_s: float = 100e-6) -> Cluster:
    """The lab as configured: tbf rates, one rank per host, hosts grouped by node."""
    per_node = _node_hosts(lab)
    return Cluster(nodes=len(per_node), ranks_per_node=max(len(h) for h in per_node),
                   intra_gbit=lab.rate_bps / 1e9 * lab.rails,
                   inter_gbit=(lab.inter_rate_bps or lab.rate_bps) / 1e9 * lab.rails,
                   intra_latency_s=intra_latency_s, inter_latency_s=inter_latency_s)


def measure_netlab(name: str = "lab", seconds: float = DEFAULT_MEASURE_SECONDS,
                   pings: int = DEFAULT_PINGS) -> tuple[Cluster, dict]:
    """Measure a running netlab: (Cluster, raw figures).

    intra: one TCP flow between two hosts of node 0 (a rank link is not shared by it);
    inter: every host of node 0 sends to its counterpart on node 1 at once (the flows share
    node 0's uplink, as the model says they do) and the rates are summed -- this is the uplink's
    capacity even where it is faster than one rank link; one flow alone is also reported;
    latencies: half the median round trip of a 1-byte TCP ping-pong. Rail 0 is measured; with
    several rails the bandwidths are multiplied by the rail count (identical fabrics, striped).
    """
    from tools import netlab
    lab = netlab.load(name)
    if not netlab.is_up(lab):
        raise RuntimeError(f"netlab {name!r} is not up (run: linerate netlab up --name {name})")
    per_node = _node_hosts(lab)
    raw: dict = {"lab": name, "seconds": seconds, "hosts_per_node": [len(h) for h in per_node]}
    first = per_node[0]
    if len(first) >= 2:
        raw["intra_bps"] = netlab.probe(lab, first[0].name, first[1].name, seconds)
        raw["intra_latency_s"] = _one_way_latency(lab, first[0].name, first[1].name, pings)
    if len(per_node) >= 2:
        second = per_node[1]
        pairs = list(zip(first, second))
        raw["inter_single_bps"] = netlab.probe(lab, first[0].name, second[0].name, seconds)
        rates = _concurrent([lambda a=a, b=b: netlab.probe(lab, a.name, b.name, seconds)
                             for a, b in pairs])
        raw["inter_flows"] = len(pairs)
        raw["inter_flow_bps"] = rates
        raw["inter_bps"] = sum(rates)
        raw["inter_latency_s"] = _one_way_latency(lab, first[0].name, second[0].name, pings)
    if "intra_bps" not in raw:  # one host per node: its rank link is only seen across nodes
        raw["intra_bps"] = raw.get("inter_single_bps") or lab.rate_bps
        raw["intra_latency_s"] = raw.get("inter_latency_s", 50e-6)
    rails = lab.rails  # rail 0 measured; the rails are identical fabrics, striped over
    raw["rails"] = rails
    cluster = Cluster(nodes=len(per_node), ranks_per_node=max(len(h) for h in per_node),
                      intra_gbit=raw["intra_bps"] * rails / 1e9,
                      inter_gbit=raw.get("inter_bps", raw["intra_bps"]) * rails / 1e9,
                      intra_latency_s=raw["intra_latency_s"],
                      inter_latency_s=raw.get("inter_latency_s", raw["intra_latency_s"]))
    return cluster, raw


# ----------------------------------------------------------------------------- CLI

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "model", help="predict step time of All-Reduce and decentralized topologies; recommend",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (options override what --netlab gives)")
    g.add_argument("--nodes", type=_positive_int, default=None, help="nodes (default 1)")
    g.add_argument("--ranks-per-node", type=_positive_int, default=None,
                   help="ranks per node (default 1)")
    g.add_argument("--intra-gbit", type=_positive_float, default=None,
                   help="Gbit/s of each rank's link inside a node, each way")
    g.add_argument("--inter-gbit", type=_positive_float, default=None,
                   help="Gbit/s of each node's uplink, each way (shared by the node's ranks)")
    g.add_argument("--intra-latency-us", type=_nonneg_float, default=None,
                   help="one-way latency inside a node, microseconds (default 50)")
    g.add_argument("--inter-latency-us", type=_nonneg_float, default=None,
                   help="one-way latency between nodes, microseconds (default 100)")
    g.add_argument("--netlab", metavar="NAME", nargs="?", const="lab", default=None,
                   help="take the cluster from a running `linerate netlab` (its configured "
                        "rates; default lab name: lab)")
    g.add_argument("--measure", action="store_true",
                   help="with --netlab: measure bandwidths and latencies with TCP probes. On a "
                        "real cluster use `linerate bench` (raw link capacity) or iperf3 and "
                        "pass --intra-gbit/--inter-gbit")
    g.add_argument("--measure-seconds", type=_positive_float, default=DEFAULT_MEASURE_SECONDS,
                   help=f"seconds per probe (default {DEFAULT_MEASURE_SECONDS:g})")
    g = parser.add_argument_group("model and compute")
    g.add_argument("--model-bytes", type=_size, default=None,
                   help="bytes exchanged per step (K/M/G suffixes, binary): 48M")
    g.add_argument("--params", type=_count, default=None,
                   help="parameters instead of --model-bytes (k/M/G suffixes, decimal): 25.6M")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                   help="with --params (default float32)")
    g.add_argument("--compute-ms", type=_nonneg_float, required=True,
                   help="forward + backward time of one step on one rank, milliseconds")
    g.add_argument("--fwd-fraction", type=_fraction, default=DEFAULT_FWD_FRACTION,
                   help="share of the compute time that is the forward pass (default 1/3)")
    g.add_argument("--cpu-contention", type=_contention, default=1.0,
                   help="slowdown c in [1, 2] of compute and communication while they overlap "
                        "(1: separate cores, the default; 2: no overlap); see docs/model.md")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="communication after compute instead of overlapped")
    g.add_argument("--methods", type=_method_list, default=list(METHODS),
                   help=f"comma separated (default: {','.join(METHODS)}; also "
                        f"{','.join(GROUP_METHODS)}: group averages by ring All-Reduce, as "
                        "the paper's library runs them)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def build_cluster(args: argparse.Namespace) -> tuple[Cluster, dict | None]:
    measured = None
    base: Cluster | None = None
    if args.measure and args.netlab is None:
        raise ValueError("--measure needs --netlab NAME: on a real cluster, measure the links "
                         "with `linerate bench` (raw link capacity) or iperf3 and pass "
                         "--intra-gbit and --inter-gbit")
    if args.netlab is not None:
        from tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            raise RuntimeError(f"--netlab: {reason}")
        if args.measure:
            base, measured = measure_netlab(args.netlab, args.measure_seconds)
        else:
            base = cluster_from_lab(netlab.load(args.netlab))
    nodes = args.nodes or (base.nodes if base else 1)
    rpn = args.ranks_per_node or (base.ranks_per_node if base else 1)
    intra = args.intra_gbit or (base.intra_gbit if base else None)
    if intra is None:
        raise ValueError("give --intra-gbit (or --netlab NAME)")
    inter = args.inter_gbit or (base.inter_gbit if base else None)
    if inter is None:
        if nodes > 1:
            raise ValueError("give --inter-gbit for more than one node")
        inter = intra
    lat_in = (args.intra_latency_us * 1e-6 if args.intra_latency_us is not None
              else base.intra_latency_s if base else 50e-6)
    lat_out = (args.inter_latency_us * 1e-6 if args.inter_latency_us is not None
               else base.inter_latency_s if base else 100e-6)
    return Cluster(nodes, rpn, intra, inter, lat_in, lat_out), measured


def run(args: argparse.Namespace) -> int:
    if (args.model_bytes is None) == (args.params is None):
        print("linerate model: error: give one of --model-bytes and --params", file=sys.stderr)
        return 2
    model_bytes = args.model_bytes if args.model_bytes is not None \
        else int(args.params * DTYPE_BYTES[args.dtype])
    try:
        cluster, measured = build_cluster(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"linerate model: error: {e}", file=sys.stderr)
        return 2
    compute_s = args.compute_ms / 1e3
    preds = {m: predict(cluster, model_bytes, compute_s, args.fwd_fraction, m, args.overlap,
                        cpu_contention=args.cpu_contention) for m in args.methods}
    ranking = recommend(cluster, model_bytes, compute_s, args.fwd_fraction,
                        methods=args.methods, overlap=args.overlap,
                        cpu_contention=args.cpu_contention)
    t_ar = predict(cluster, model_bytes, compute_s, args.fwd_fraction, "allreduce",
                   args.overlap, cpu_contention=args.cpu_contention)["step_s"]
    rows = []
    for method, step in ranking:
        p = preds[method]
        rows.append({"method": method, "step_s": step, "comm_s": p["comm_s"],
                     "speedup": t_ar / step if step > 0 else None,
                     "bound": "network" if p["step_s"] > p["compute_s"] * (1 + 1e-9) else
                              "compute",
                     "uplink_flows": p["uplink_flows"],
                     "period": p["period"], "formula": p["formula"]})
    if args.json:
        out = {"cluster": asdict(cluster) | {"n": cluster.n}, "measured": measured,
               "model_bytes": model_bytes, "compute_s": compute_s,
               "fwd_fraction": args.fwd_fraction, "overlap": args.overlap,
               "cpu_contention": args.cpu_contention, "allreduce_step_s": t_ar,
               "recommended": rows[0]["method"], "ranking": rows,
               "predictions": preds}
        print(json.dumps(out, indent=1))
        return 0
    print(format_table(cluster, measured, model_bytes, compute_s, args.fwd_fraction, rows))
    return 0


def format_table(cluster: Cluster, measured: dict | None, model_bytes: int, compute_s: float,
                 fwd_fraction: float, rows: list[dict]) -> str:
    lines = [f"# cluster: {cluster.describe()}"]
    if measured:
        lines.append(f"# measured on netlab {measured['lab']!r} ({measured['seconds']:g} s "
                     f"probes): intra {measured['intra_bps'] / 1e9:.3f} Gbit/s"
                     + (f", inter {measured['inter_bps'] / 1e9:.3f} Gbit/s over "
                        f"{measured['inter_flows']} concurrent flow(s) (one flow alone "
                        f"{measured['inter_single_bps'] / 1e9:.3f})"
                        if "inter_bps" in measured else ""))
    lines.append(f"# model: {model_bytes / 2**20:.2f} MiB per step; compute "
                 f"{compute_s * 1e3:.2f} ms (forward {fwd_fraction * compute_s * 1e3:.2f}, "
                 f"backward {(1 - fwd_fraction) * compute_s * 1e3:.2f})")
    w = max(13, max(len(r["method"]) for r in rows) + 1)
    lines.append(f"{'method':<{w}}{'step ms':>10}{'comm ms':>10}{'speedup':>9}"
                 f"{'uplink flows':>14}{'period':>8}  bound")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(f"{r['method']:<{w}}{r['step_s'] * 1e3:>10.2f}{r['comm_s'] * 1e3:>10.2f}"
                     f"{sp:>9}{r['uplink_flows']:>14}{r['period']:>8}  {r['bound']}")
    best = rows[0]
    lines.append(f"recommended: {best['method']}"
                 + (f" ({best['speedup']:.2f}x the All-Reduce step)"
                    if best["speedup"] is not None else ""))
    lines.append("# speedup = All-Reduce step / this step. Step time only: sparse topologies "
                 "mix more slowly and may need more steps (docs/model.md).")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- arg types

_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


def _count(text: str) -> int:
    s = text.strip().lower()
    digits = s.rstrip("kmgb")
    try:
        n = float(digits) * _COUNT_SUFFIX[s[len(digits):]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"cannot parse parameter count {text!r} (e.g. 25557032, 25.6M, 1.3G)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return int(round(n))


def _fraction(text: str) -> float:
    x = float(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return x


def _contention(text: str) -> float:
    x = float(text)
    if not 1 <= x <= 2:
        raise argparse.ArgumentTypeError(f"must be in [1, 2], got {text}")
    return x


def _method_list(text: str) -> list[str]:
    try:
        names = [canonical_method(m) for m in text.split(",") if m.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not names:
        raise argparse.ArgumentTypeError("expected a comma separated list")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
