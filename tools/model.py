"""linerate model: predict the step time of All-Reduce and of decentralized topologies.

Given a cluster (nodes, ranks per node, intra-node and inter-node bandwidth and latency), the
bytes of the model and the compute time of one step, it predicts the time per training step of

  allreduce      ring All-Reduce of the gradients, overlapping the backward pass only:
                 T = T_fwd + max(T_bwd, T_ar),  T_ar = 2(n-1)a + 2(n-1)/n * M / b_eff
  ring, torus, exp, one-peer-exp, aer, complete
                 decentralized training (parameters averaged with the topology's neighbors),
                 the exchange overlapping the whole iteration:
                 T = max(T_fwd + T_bwd, T_exchange), averaged over a time-varying graph's period

and ranks them. With the CPU model (--cores, or --netlab) the ranks share P cores (R per
machine) and moving bytes costs CPU (kappa per byte alone, kappa_eff beside compute, and the
share phi of its pace an exchange keeps while its ranks compute; measured with --measure-cpu):
compute C' = max(1, R/P) C; communication alone T_x = max(T_net, K/P); DDP
T = C' + (1 - p) T_x, p the share of the ring done on spare cores during backward;
decentralized T = D1 + (1 - s1) T_x, D1 = max(C, (R C + s1 K_eff) / P), s1 = min(1, phi D1 / T_x)
(compute with the exchange beside it, then the rest of the exchange). The derivation and the
assumptions are in docs/model.md (section 5 for the CPU).

The cluster comes from options, from a running netlab (--netlab NAME: its configured rates) or
is measured (--measure --netlab NAME: TCP probes between hosts of one node and, all at once,
across the node uplink; and the CPU costs on the lab). On a real cluster, measure the links with
`linerate bench` (its raw link capacity line) or iperf3 and pass --intra-gbit / --inter-gbit,
and --cores with --measure-cpu (over loopback) for the CPU.

Python API: Cluster, CpuModel, CpuCosts, predict(), recommend(), measure_netlab(),
measure_cpu_costs().
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field

from linerate.tools.argtypes import nonneg_float as _nonneg_float
from linerate.tools.argtypes import positive_float as _positive_float
from linerate.tools.argtypes import positive_int as _positive_int
from linerate.tools.argtypes import size as _size

#: The topologies of collectives.topology (by_name keys), exchanged point to point by
#: neighbor_allreduce; the model mirrors their definitions (docs/model.md).
TOPOLOGIES = ("ring", "torus", "exp", "one-peer-exp", "aer", "complete")
#: What recommend() ranks by default: what linerate runs.
METHODS = ("allreduce",) + TOPOLOGIES
#: Averages over groups of ranks run as ring All-Reduces of each group (how Decent-DP, the
#: paper's library, runs AER and complete); not what neighbor_allreduce does today, so only
#: ranked when asked for (--methods).
GROUP_METHODS = ("aer-allreduce", "complete-allreduce")
#: For hosts whose ranks share memory (a Cluster with host_mem_gbs): AER with intra-host averaging
#: (alternating_exponential_ring(..., intra="average"): odd steps average each host on shared
#: memory) and the hierarchical neighbor all-reduce (linerate.hierarchical_neighbor_allreduce:
#: average in each host, then the hosts' one-peer exponential graph, each rank of a host
#: carrying 1/R of the tensor). Ranked by default when the cluster's hosts share memory.
HOST_METHODS = ("aer-average", "hierarchical")
ALL_METHODS = METHODS + GROUP_METHODS + HOST_METHODS
#: recommend()'s order among methods whose step times tie: best mixing first.
TIE_ORDER = ("allreduce", "complete-allreduce", "complete", "aer-allreduce", "hierarchical",
             "aer-average", "aer",
             "one-peer-exp", "exp", "torus", "ring")
_ALIASES = {"all-reduce": "allreduce", "all_reduce": "allreduce", "ar": "allreduce",
            "exponential": "exp", "one-peer-exponential": "one-peer-exp",
            "alternating-exp-ring": "aer", "alternating-exponential-ring": "aer",
            "torus2d": "torus", "hierarchical-neighbor": "hierarchical",
            "aer-avg": "aer-average"}
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
               "bfloat16": 2, "bf16": 2, "float64": 8, "double": 8, "fp64": 8,
               "int8": 1, "uint8": 1}
DEFAULT_FWD_FRACTION = 1 / 3
DEFAULT_MEASURE_SECONDS = 2.0
DEFAULT_PINGS = 200
DEFAULT_CPU_SECONDS = 1.0
DEFAULT_CPU_CYCLES = 3
DEFAULT_SHM_BYTES = 16 << 20


# ----------------------------------------------------------------------------- the cluster

@dataclass
class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks. Every rank has a full-duplex link of
    ``intra_gbit`` to its node's switch; each node reaches the others through one full-duplex
    uplink of ``inter_gbit``, shared by every flow that leaves (or enters) the node. Ranks are
    placed node-major (rank = node * ranks_per_node + local rank), as torchrun does.

    ``host_mem_gbs``: each node is one host whose ranks share memory (GB/s: the host's memory
    bandwidth for linerate's shared-memory collectives, IntraHost "memory"); the All-Reduce is
    then predicted flat and two-level and the faster taken, and group averages inside a host
    (AER's intra-host steps, the hierarchical neighbor all-reduce) run on shared memory, each
    operation costing ``shm_latency_s`` besides its bytes. ``layout``: ranks per node where they
    differ (``nodes`` entries, the largest ``ranks_per_node``); the topologies that need equal
    nodes refuse it."""
    nodes: int
    ranks_per_node: int
    intra_gbit: float
    inter_gbit: float
    intra_latency_s: float = 50e-6
    inter_latency_s: float = 100e-6
    host_mem_gbs: float | None = None
    shm_latency_s: float = 100e-6
    layout: tuple | None = None

    def __post_init__(self):
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"nodes and ranks_per_node must be at least 1, got "
                             f"{self.nodes} and {self.ranks_per_node}")
        if not self.intra_gbit > 0 or (self.nodes > 1 and not self.inter_gbit > 0):
            raise ValueError("bandwidths must be positive")
        if self.intra_latency_s < 0 or self.inter_latency_s < 0 or self.shm_latency_s < 0:
            raise ValueError("latencies must not be negative")
        if self.host_mem_gbs is not None and not self.host_mem_gbs > 0:
            raise ValueError(f"host_mem_gbs must be positive, got {self.host_mem_gbs}")
        if self.layout is not None:
            lay = tuple(_layout(self.layout))
            if len(lay) != self.nodes or max(lay) != self.ranks_per_node:
                raise ValueError(f"layout {list(lay)} must have one entry per node ({self.nodes}) "
                                 f"and ranks_per_node ({self.ranks_per_node}) as its largest")
            self.layout = None if len(set(lay)) == 1 else lay
            self._starts = [sum(lay[:k]) for k in range(len(lay))]

    @property
    def n(self) -> int:
        return sum(self.layout) if self.layout else self.nodes * self.ranks_per_node

    @property
    def even(self) -> bool:
        return self.layout is None

    def hosts(self) -> list[int]:
        """Ranks per node, one entry per node."""
        return list(self.layout) if self.layout else [self.ranks_per_node] * self.nodes

    def node_ranks(self, node: int) -> list[int]:
        if self.layout:
            return list(range(self._starts[node], self._starts[node] + self.layout[node]))
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def node_of(self, rank: int) -> int:
        if self.layout:
            import bisect
            return bisect.bisect_right(self._starts, rank) - 1
        return rank // self.ranks_per_node

    @property
    def shared_memory(self) -> bool:
        return self.host_mem_gbs is not None

    def intra_host(self) -> IntraHost:
        """How a node's ranks reach each other for collectives: shared memory where the node is
        a host (``host_mem_gbs``), else their rank links."""
        if self.host_mem_gbs is not None:
            return IntraHost("memory", self.host_mem_gbs * 1e9, self.shm_latency_s)
        return IntraHost("links", self.intra_gbit * 1e9 / 8, self.intra_latency_s)

    def describe(self) -> str:
        shape = ("+".join(map(str, self.layout)) if self.layout
                 else f"{self.nodes} node(s) x {self.ranks_per_node} rank(s)")
        s = (f"{shape} (n={self.n}), "
             f"rank links {self.intra_gbit:.4g} Gbit/s, {self.intra_latency_s * 1e6:.3g} us")
        if self.nodes > 1:
            s += (f"; node uplinks {self.inter_gbit:.4g} Gbit/s, "
                  f"{self.inter_latency_s * 1e6:.3g} us")
        if self.host_mem_gbs is not None:
            s += (f"; each node one host sharing memory at {self.host_mem_gbs:.4g} GB/s, "
                  f"{self.shm_latency_s * 1e6:.3g} us per operation")
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


#: Passes over a rank's bytes in memory of a shared-memory All-Reduce (copy in, reduce, copy
#: out) and of the hierarchical all-reduce's gather (copy out): the CPU model's memory cost.
SHM_ALLREDUCE_PASSES = 3
SHM_GATHER_PASSES = 1


def host_averages(cluster: Cluster, pattern, step: int) -> list[list[int]] | None:
    """The groups of ``step`` that run as shared-memory All-Reduces: the step averages disjoint
    groups (``averaging_groups``, of a Pattern or a library Topology), every group of
    more than one rank is all the ranks of one node (the ranks of a host's segment), and the
    nodes are hosts sharing memory. Else None (the step runs point to point)."""
    if not cluster.shared_memory:
        return None
    fn = getattr(pattern, "averaging_groups", None)
    groups = fn(step) if fn is not None else None
    if not groups:
        return None
    if any(sorted(g) != cluster.node_ranks(cluster.node_of(g[0])) for g in groups if len(g) > 1):
        return None   # a group that spans nodes, or part of one: point to point
    return [list(g) for g in groups]


def _hierarchical(cluster: Cluster, pattern, step: int, model_bytes: float) -> dict:
    """One step of the hierarchical neighbor all-reduce: each host's average (intra-host
    All-Reduce), then local rank l < K = min ranks per host sends its 1/K of the average to
    rank l of each host that receives this host's (the hosts' one-peer exponential graph),
    then each host gathers the K mixed shares (K broadcasts: R*S through memory)."""
    intra = cluster.intra_host()
    lay = cluster.hosts()
    k = min(lay)
    avg = max(intra.allreduce_s(model_bytes, r) for r in lay)
    flows = []
    for a in range(cluster.nodes):
        base = cluster.node_ranks(a)[0]
        for c in pattern.host_peers(a, step):
            dst = cluster.node_ranks(c)[0]
            flows += [(base + lo, dst + lo, model_bytes / k) for lo in range(k)]
    x = transfer(cluster, flows)
    gather = max(intra.allreduce_s(model_bytes, r, ops=k) for r in lay)
    mem = (SHM_ALLREDUCE_PASSES + SHM_GATHER_PASSES) * model_bytes * cluster.n \
        if cluster.shared_memory else 0.0
    return x | {"seconds": avg + x["seconds"] + gather, "intra_s": avg + gather,
                "exchange_s": x["seconds"], "kind": "hierarchical", "flows_list": flows,
                "memory_bytes": mem}


def neighbor_exchange(cluster: Cluster, pattern, step: int, model_bytes: float) -> dict:
    """One step of ``pattern``: group averages (``pattern.groups(step)``) where it has them;
    host averages on shared memory (host_averages); the hierarchical all-reduce; else every
    rank sends M to each of its out-peers, all at once. ``flows_list``: the (src, dst, bytes)
    on the network (the CPU model's kappa), ``memory_bytes``: bytes the ranks move through
    shared memory (its memory passes)."""
    groups = pattern.groups(step) if hasattr(pattern, "groups") else None
    if groups is not None:
        flows = exchange_flows(cluster, pattern, step, model_bytes)
        return group_allreduce(cluster, groups, model_bytes) | {
            "kind": "groups", "groups": len(groups), "flows_list": flows, "memory_bytes": 0.0}
    if getattr(pattern, "name", None) == "hierarchical":
        return _hierarchical(cluster, pattern, step, model_bytes)
    avg = host_averages(cluster, pattern, step)
    if avg is not None:
        intra = cluster.intra_host()
        t = max((intra.allreduce_s(model_bytes, len(g)) for g in avg), default=0.0)
        return {"seconds": t, "bandwidth_s": t, "latency_s": 0.0, "bottleneck": "memory",
                "uplink_flows": 0, "flows": 0, "sent_bytes_per_rank": 0.0,
                "kind": "host averages", "groups": len(avg), "flows_list": [],
                "memory_bytes": SHM_ALLREDUCE_PASSES * model_bytes
                * sum(len(g) for g in avg if len(g) > 1)}
    flows = [(r, p, model_bytes) for r in range(cluster.n) for p in pattern.out_peers(r, step)]
    return transfer(cluster, flows) | {"kind": "neighbors", "flows_list": flows,
                                       "memory_bytes": 0.0}


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


# ----------------------------------------------------------------------------- hosts: two-level

@dataclass(frozen=True)
class IntraHost:
    """How the ranks of one host reach each other, for the flat and two-level All-Reduce.

    ``kind`` "links": each rank has a full-duplex link of ``rate_bytes_s`` inside the host
    (NVLink, PCIe, a switch): the host's part of an All-Reduce is a ring over R ranks,
    2(R-1)/R * S / rate + (R-1) t_add(S/R) + 2(R-1) * latency.
    ``kind`` "memory": the ranks share memory (linerate's shared-memory collectives): all R
    ranks of the host together move ``rate_bytes_s`` of their inputs through memory, and an
    All-Reduce (or a reduce-scatter and an all-gather) of S bytes moves each rank's S once:
    R * S / rate + (R-1) t_add(S/R) + latency per operation. ``rate_bytes_s`` is then the
    host's memory bandwidth (one copy per byte; `linerate model --measure` measures it with
    the shared-memory All-Reduce itself, so it includes how close that comes to one copy)."""
    kind: str
    rate_bytes_s: float
    latency_s: float = 0.0

    def __post_init__(self):
        if self.kind not in ("links", "memory"):
            raise ValueError(f"IntraHost kind must be 'links' or 'memory', got {self.kind!r}")
        if not self.rate_bytes_s > 0 or self.latency_s < 0:
            raise ValueError(f"IntraHost rate must be positive and latency not negative, got "
                             f"{self.rate_bytes_s} and {self.latency_s}")

    def allreduce_s(self, nbytes: float, ranks: int, t_add=None, compression: float = 1.0,
                    ops: int = 1) -> float:
        """The host's All-Reduce of ``nbytes`` over ``ranks`` ranks (``ops`` = 2: as a
        reduce-scatter and an all-gather apart: the same bytes, each operation's latency)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        red = (ranks - 1) * t_add(nbytes / ranks) if t_add is not None else 0.0
        if self.kind == "links":
            return (2 * (ranks - 1) / ranks * nbytes / compression / self.rate_bytes_s + red
                    + 2 * (ranks - 1) * self.latency_s)
        return ranks * nbytes / compression / self.rate_bytes_s + red + ops * self.latency_s

    def hop_bytes_s(self, ranks: int) -> float:
        """What one ring hop inside the host gets while every rank of the host sends at once:
        its link, or a share of the memory."""
        return self.rate_bytes_s if self.kind == "links" else self.rate_bytes_s / max(1, ranks)

    def describe(self) -> str:
        what = ("rank links" if self.kind == "links" else "shared memory")
        return (f"{what} {self.rate_bytes_s * 8 / 1e9:.4g} Gbit/s "
                f"({self.rate_bytes_s / 1e9:.4g} GB/s), {self.latency_s * 1e6:.3g} us")


def _layout(layout) -> list[int]:
    out = [int(r) for r in layout]
    if not out or any(r < 1 for r in out):
        raise ValueError(f"ranks per host must be a non-empty list of counts >= 1, got {layout!r}")
    return out


def flat_ring_allreduce(nbytes: float, layout, nic_bytes_s: float, intra: IntraHost,
                        inter_latency_s: float = 0.0, t_add=None,
                        compression: float = 1.0) -> dict:
    """The ring All-Reduce over all P ranks of hosts with ``layout`` ranks each (host-major,
    uneven allowed): each of the 2(P-1) steps sends S/P on every hop at once, one hop per host
    through its NIC (``nic_bytes_s``, all rails) and the others inside the host, so a step takes
    S/P at min(NIC, intra.hop_bytes_s(R_max)) (the NIC alone with one rank per host; one host:
    the host's own All-Reduce, intra.allreduce_s):

        T_flat = 2(P-1)/P * S/(c*b) + (P-1) t_add(S/P) + 2(P-1) * inter_latency"""
    lay = _layout(layout)
    hosts, p, r = len(lay), sum(lay), max(lay)
    if p <= 1 or nbytes <= 0:
        return {"seconds": 0.0, "bandwidth_s": 0.0, "latency_s": 0.0, "rate_bytes_s": None,
                "nic_bytes": 0.0}
    if hosts == 1:
        t = intra.allreduce_s(nbytes, p, t_add, compression)
        return {"seconds": t, "bandwidth_s": t, "latency_s": 0.0,
                "rate_bytes_s": intra.hop_bytes_s(p), "nic_bytes": 0.0}
    rate = nic_bytes_s if r == 1 else min(nic_bytes_s, intra.hop_bytes_s(r))
    bw = 2 * (p - 1) / p * nbytes / compression / rate
    red = (p - 1) * t_add(nbytes / p) if t_add is not None else 0.0
    lat = 2 * (p - 1) * inter_latency_s
    return {"seconds": bw + red + lat, "bandwidth_s": bw, "reduce_s": red, "latency_s": lat,
            "rate_bytes_s": rate, "nic_bytes": 2 * (p - 1) / p * nbytes / compression}


#: linerate's two-level all_reduce (collectives/two_level.py) pipelines chunks of PIPE_BYTES,
#: at most MAX_CHUNKS of them: the inter-host phase of chunk k runs while the local phases of
#: the others do. Read from the runtime where it imports; these where it does not.
TWO_LEVEL_PIPE_BYTES = 8 << 20
TWO_LEVEL_MAX_CHUNKS = 16


def _two_level_pipe() -> tuple[int, int]:
    try:
        from linerate.collectives import two_level
        return int(two_level.PIPE_BYTES), int(two_level.MAX_CHUNKS)
    except Exception:  # noqa: BLE001 - no torch here: the model's copy
        return TWO_LEVEL_PIPE_BYTES, TWO_LEVEL_MAX_CHUNKS


def two_level_chunks(nbytes: float, elem_bytes: int = 4) -> int:
    """Chunks of linerate's two-level all_reduce of ``nbytes``: pieces of max(PIPE_BYTES,
    S / MAX_CHUNKS)."""
    pipe, most = _two_level_pipe()
    n = max(1, int(nbytes) // elem_bytes)
    per = max(1, min(n, max(pipe // elem_bytes, -(-n // most))))
    return -(-n // per)


def two_level_allreduce(nbytes: float, layout, nic_bytes_s: float, intra: IntraHost,
                        inter_latency_s: float = 0.0, t_add=None,
                        compression: float = 1.0, chunks: int = 1) -> dict:
    """Two-level All-Reduce on hosts with ``layout`` ranks each (uneven allowed): a
    reduce-scatter inside each host, an All-Reduce of the host's S across the H hosts (one
    ring per local rank, each with its share, all through the host's NIC at once: the NIC
    carries 2(H-1)/H * S each way), an all-gather inside each host. The largest host sets the
    intra-host time:

        T_2L = intra.allreduce_s(S, R_max, ops=2)
             + 2(H-1)/H * S/(c*NIC) + (H-1) t_add(S/(H*R_min)) + 2(H-1) * inter_latency

    (links: 2(R-1)/R * S/(c*X) + (R-1) t_add(S/R) + 2(R-1) a; memory: R*S/(c*mem) +
    (R-1) t_add(S/R) + 2 a_shm).

    ``chunks`` = k > 1: cut into k chunks, the inter-host phase of one overlapping the
    intra-host phases of the others (as linerate runs it: two_level_chunks), each phase of a
    chunk taking 1/k of its bytes and all of its latencies (t_i, t_e):
        T_2L = t_i + t_e + (k-1) * max(t_i, t_e)."""
    lay = _layout(layout)
    hosts, r = len(lay), max(lay)
    if sum(lay) <= 1 or nbytes <= 0:
        return {"seconds": 0.0, "intra_s": 0.0, "inter_s": 0.0, "inter_bandwidth_s": 0.0,
                "inter_latency_s": 0.0, "nic_bytes": 0.0}
    k = max(1, int(chunks))
    part = nbytes / k
    intra_s = intra.allreduce_s(part, r, t_add, compression, ops=2)
    inter_bw = inter_red = inter_lat = nic = 0.0
    if hosts > 1:
        nic = 2 * (hosts - 1) / hosts * nbytes / compression
        inter_bw = nic / nic_bytes_s / k
        if t_add is not None:
            inter_red = (hosts - 1) * t_add(part / (hosts * min(lay)))
        inter_lat = 2 * (hosts - 1) * inter_latency_s
    inter = inter_bw + inter_red + inter_lat
    total = intra_s + inter + (k - 1) * max(intra_s, inter)
    return {"seconds": total, "intra_s": intra_s * k, "inter_s": inter * k, "chunks": k,
            "inter_bandwidth_s": inter_bw * k, "inter_latency_s": inter_lat * k,
            "nic_bytes": nic}


def allreduce_choice(nbytes: float, layout, nic_bytes_s: float, intra: IntraHost,
                     inter_latency_s: float = 0.0, t_add=None,
                     compression: float = 1.0) -> dict:
    """Both All-Reduces and the faster: {"flat": ..., "two-level": ..., "pick": name,
    "seconds": the pick's}. A tie goes to the flat ring (one algorithm, no intra phases)."""
    both = {"flat": flat_ring_allreduce(nbytes, layout, nic_bytes_s, intra, inter_latency_s,
                                        t_add, compression),
            "two-level": two_level_allreduce(nbytes, layout, nic_bytes_s, intra,
                                             inter_latency_s, t_add, compression)}
    pick = "two-level" if both["two-level"]["seconds"] < both["flat"]["seconds"] else "flat"
    return both | {"pick": pick, "seconds": both[pick]["seconds"]}


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

    def __init__(self, name: str, n: int, ranks_per_node: int = 1, layout=None):
        if layout is not None and len(set(layout)) > 1:
            if name != "hierarchical":
                raise ValueError(f"{name} needs the same ranks on every node, not "
                                 f"{'+'.join(map(str, layout))}")
            self.layout = list(layout)
        elif n % ranks_per_node:
            raise ValueError(f"{n} ranks do not split into nodes of {ranks_per_node}")
        else:
            self.layout = [ranks_per_node] * (n // ranks_per_node)
        if sum(self.layout) != n:
            raise ValueError(f"layout {self.layout} does not hold {n} ranks")
        self.name, self.n, self.rpn = name, n, max(self.layout)
        self.nodes = len(self.layout)
        self._starts = [sum(self.layout[:k]) for k in range(self.nodes)]
        self._alternates = self.nodes > 1 and self.rpn > 1
        if name == "one-peer-exp" or (name in ("aer", "aer-average") and self.rpn == 1):
            self.period = max(1, len(_hops(n)))
        elif name == "aer-average":       # one node: its average every step
            self.period = 1 if self.nodes == 1 else 2 * len(_hops(self.nodes))
        elif name == "hierarchical":
            self.period = max(1, len(_hops(self.nodes)))
        elif name == "aer" and not self._alternates:
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
        return list(range(self._starts[node], self._starts[node] + self.layout[node]))

    def _host_average_step(self, step: int) -> bool:
        """aer-average's odd steps (one node: every step) average every node's ranks."""
        return (self.name == "aer-average" and self.rpn > 1
                and (self.nodes == 1 or step % self.period % 2 == 1))

    def averaging_groups(self, step: int = 0) -> list[list[int]] | None:
        """The disjoint groups this step averages, as collectives.topology.Topology's method of
        that name finds them in W (a neighbor all-reduce runs each as an All-Reduce, on shared
        memory inside a host), or None. Every pattern here weighs a rank and its in-neighbors
        equally, so a step averages groups exactly when every rank's closed neighborhood
        ({rank} + out-peers) is the same set for all its members: aer-average's intra-node
        steps, a pairwise swap (one-peer graphs at hop n/2, aer's 2-rank nodes), complete."""
        if self.name == "hierarchical" or self.groups(step) is not None:
            return None
        hood = [frozenset([r, *self.out_peers(r, step)]) for r in range(self.n)]
        if any(hood[j] != hood[r] for r in range(self.n) for j in hood[r]):
            return None
        seen, out = set(), []
        for r in range(self.n):
            if hood[r] not in seen:
                seen.add(hood[r])
                out.append(sorted(hood[r]))
        return out

    def host_peers(self, node: int, step: int = 0) -> list[int]:
        """hierarchical: the nodes that receive ``node``'s average at ``step`` (the one-peer
        exponential graph of the nodes)."""
        if self.nodes == 1:
            return []
        return [(node - (1 << (step % self.period))) % self.nodes]

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
        if groups is None and self._host_average_step(step):
            groups = [self._node_ranks(a) for a in range(self.nodes)]
        if self.name == "hierarchical":   # the average inside the node, then the shards
            node = bisect.bisect_right(self._starts, rank) - 1
            local = rank - self._starts[node]
            peers = set(self._node_ranks(node))
            if local < min(self.layout):
                peers |= {self._starts[c] + local for c in self.host_peers(node, step)}
        elif groups is not None:
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
        elif self.name == "aer-average":  # even steps: aer's, across nodes
            node, local = divmod(rank, self.rpn)
            hops = _hops(self.nodes)
            h = hops[(step % self.period // 2) % len(hops)]
            peers = {((node - h) % self.nodes) * self.rpn + local}
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


# ----------------------------------------------------------------------------- CPU

@dataclass
class CpuCosts:
    """What moving bytes costs the cores, in core-seconds per byte sent from one rank to
    another (every byte is also received, so both ends are included).

    ``net_s_per_byte`` (kappa): the communication's own CPU time -- the sender's and receiver's
    system calls and copies, the kernel's TCP/IP path (on netlab also the emulated network:
    veth, bridges, tbf, all run by the same cores in softirq), linerate's threads and the
    receiver's reduction. It sets how fast communication alone can go on a machine's cores.
    ``shared_net_s_per_byte`` (kappa_eff): the compute time a byte takes away from ranks that
    compute on the same cores while it moves: kappa plus what sharing the cores costs beyond it
    (context switches, caches). It is what an exchange overlapping compute adds to the step.
    None: kappa. ``inter_*``: the same for a byte that crosses nodes where the path differs
    (netlab's two-tier labs cross two more bridges and an uplink veth pair); None: as within a
    node. ``pace_beside_compute`` (phi): the share of its own pace that communication keeps
    while its ranks compute (each rank's main thread holds the cores and its GIL; 1: none
    lost). ``mem_s_per_byte``: one pass over memory (``a.copy_(b)``), for DDP's copies around
    its All-Reduce. Measured by measure_cpu_costs() (`linerate model --measure-cpu`), not
    fitted."""
    net_s_per_byte: float = 0.0
    mem_s_per_byte: float = 0.0
    inter_net_s_per_byte: float | None = None
    shared_net_s_per_byte: float | None = None
    shared_inter_net_s_per_byte: float | None = None
    pace_beside_compute: float = 1.0
    source: str = "given"
    raw: dict = field(default_factory=dict)

    def __post_init__(self):
        vals = [self.net_s_per_byte, self.mem_s_per_byte, self.inter_net_s_per_byte,
                self.shared_net_s_per_byte, self.shared_inter_net_s_per_byte]
        if any(v is not None and not v >= 0 for v in vals):
            raise ValueError(f"CPU costs must not be negative: {vals}")
        if not 0 < self.pace_beside_compute <= 1:
            raise ValueError(f"pace_beside_compute must be in (0, 1], got "
                             f"{self.pace_beside_compute}")

    def kappa(self, crossing: bool = False, shared: bool = False) -> float:
        """Core-seconds per byte: alone (kappa) or beside compute (kappa_eff), within a node or
        across nodes (falling back to within-node, and kappa_eff to kappa, where not given)."""
        alone = (self.inter_net_s_per_byte if crossing and self.inter_net_s_per_byte is not None
                 else self.net_s_per_byte)
        if not shared:
            return alone
        if crossing and self.shared_inter_net_s_per_byte is not None:
            return self.shared_inter_net_s_per_byte
        if self.shared_net_s_per_byte is not None:
            # across nodes without a measured kappa_eff: the within-node ratio applied
            if crossing and self.inter_net_s_per_byte is not None and self.net_s_per_byte > 0:
                return self.shared_net_s_per_byte * alone / self.net_s_per_byte
            return self.shared_net_s_per_byte
        return alone

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CpuCosts":
        known = {k: data[k] for k in ("net_s_per_byte", "mem_s_per_byte", "inter_net_s_per_byte",
                                       "shared_net_s_per_byte", "shared_inter_net_s_per_byte",
                                       "pace_beside_compute", "source", "raw") if k in data}
        return cls(**known)

    def describe(self) -> str:
        def ns(x):
            return f"{x * 1e9:.3g}"
        s = f"kappa {ns(self.net_s_per_byte)} ns/B"
        if self.shared_net_s_per_byte is not None:
            s += f" (beside compute {ns(self.shared_net_s_per_byte)})"
        if self.inter_net_s_per_byte is not None:
            s += f", across nodes {ns(self.inter_net_s_per_byte)}"
            if self.shared_inter_net_s_per_byte is not None:
                s += f" (beside compute {ns(self.shared_inter_net_s_per_byte)})"
        if self.pace_beside_compute != 1.0:
            s += f", pace beside compute {self.pace_beside_compute:.2f}"
        return s + f", memory pass {ns(self.mem_s_per_byte)} ns/B ({self.source})"


@dataclass
class CpuModel:
    """``ranks`` single-threaded ranks share ``cores`` cores (a host of a real cluster: its
    ranks and cores; netlab: every rank of the lab and the machine's cores), paying ``costs`` for
    the bytes they move."""
    cores: float
    ranks: int
    costs: CpuCosts = field(default_factory=CpuCosts)

    def __post_init__(self):
        if not self.cores > 0 or self.ranks < 1:
            raise ValueError(f"cores must be positive and ranks at least 1, got {self.cores} "
                             f"and {self.ranks}")

    @property
    def oversubscription(self) -> float:
        """rho = max(1, ranks / cores): how much slower a rank computes when all compute."""
        return max(1.0, self.ranks / self.cores)

    @property
    def spare_cores(self) -> float:
        return max(0.0, self.cores - self.ranks)

    def describe(self) -> str:
        return (f"{self.ranks} rank(s) on {self.cores:g} core(s) (rho {self.oversubscription:g}); "
                f"{self.costs.describe()}")


def shared_compute_s(compute_s: float, cpu: CpuModel | None) -> float:
    """C' = rho * C: a step's compute when every rank of the machine computes at once (C is
    measured with one rank alone; each rank runs one thread)."""
    return compute_s * (cpu.oversubscription if cpu is not None else 1.0)


def comm_cpu_s(cluster: Cluster, flows, cpu: CpuModel | None, shared: bool = False) -> float:
    """Core-seconds one machine spends on ``flows`` (src, dst, nbytes): every byte costs kappa
    (both ends, the kernel, the reduction; kappa_eff with ``shared``: beside compute), and the
    cluster's ranks are spread evenly over machines of ``cpu.ranks`` ranks, so a machine pays
    ranks/n of the total."""
    if cpu is None:
        return 0.0
    total = sum(cpu.costs.kappa(cluster.node_of(s) != cluster.node_of(d), shared) * b
                for s, d, b in flows if s != d and b > 0)
    return total * min(1.0, cpu.ranks / cluster.n)


def ring_flows(cluster: Cluster, model_bytes: float) -> list[tuple[int, int, float]]:
    n = cluster.n
    if n < 2:
        return []
    return [(r, (r + 1) % n, 2 * (n - 1) / n * model_bytes) for r in range(n)]


def exchange_flows(cluster: Cluster, pattern, step: int, model_bytes: float) -> list:
    groups = pattern.groups(step) if hasattr(pattern, "groups") else None
    if groups is not None:
        flows = []
        for g in groups:
            k = len(g)
            if k > 1:
                flows += [(g[i], g[(i + 1) % k], 2 * (k - 1) / k * model_bytes) for i in range(k)]
        return flows
    return [(r, p, model_bytes) for r in range(cluster.n) for p in pattern.out_peers(r, step)]


def allreduce_candidates(cluster: Cluster, model_bytes: float) -> dict:
    """The All-Reduces linerate can run on ``cluster``: {name: (times, network flows, bytes
    through shared memory)}. "flat": the ring over every rank (ring_allreduce, node-major; on
    uneven nodes flat_ring_allreduce; one host sharing memory: its shared-memory All-Reduce);
    where the nodes are hosts sharing memory and there are several, also "two-level"
    (two_level_allreduce: the intra-host phases on shared memory, one inter-host ring per local
    rank, K = min ranks per node of them)."""
    lay = cluster.hosts()
    if cluster.shared_memory and cluster.nodes == 1:
        t = cluster.intra_host().allreduce_s(model_bytes, cluster.n)
        return {"flat": ({"seconds": t, "bandwidth_s": t, "latency_s": 0.0, "uplink_flows": 0,
                          "beta_eff_gbit": None, "bottleneck": "memory"}, [],
                         SHM_ALLREDUCE_PASSES * model_bytes * cluster.n)}
    if cluster.even:
        flat = ring_allreduce(cluster, model_bytes)
    else:
        links = IntraHost("links", cluster.intra_gbit * 1e9 / 8, cluster.intra_latency_s)
        f = flat_ring_allreduce(model_bytes, lay, cluster.inter_gbit * 1e9 / 8, links,
                                cluster.inter_latency_s)
        flat = f | {"beta_eff_gbit": (f["rate_bytes_s"] * 8 / 1e9 if f["rate_bytes_s"]
                                      else None), "uplink_flows": 1 if cluster.nodes > 1 else 0,
                    "sent_bytes_per_rank": f["nic_bytes"]}
    out = {"flat": (flat, ring_flows(cluster, model_bytes), 0.0)}
    if cluster.shared_memory and cluster.nodes > 1 and cluster.n > cluster.nodes:
        two = two_level_allreduce(model_bytes, lay, cluster.inter_gbit * 1e9 / 8,
                                  cluster.intra_host(), cluster.inter_latency_s,
                                  chunks=two_level_chunks(model_bytes))
        k, h = min(lay), cluster.nodes
        flows = [(cluster.node_ranks(a)[0] + lo, cluster.node_ranks((a + 1) % h)[0] + lo,
                  2 * (h - 1) / h * model_bytes / k) for a in range(h) for lo in range(k)]
        two |= {"uplink_flows": k, "beta_eff_gbit": None,
                "sent_bytes_per_rank": two["nic_bytes"] / k}
        out["two-level"] = (two, flows, SHM_ALLREDUCE_PASSES * model_bytes * cluster.n)
    return out


# ----------------------------------------------------------------------------- prediction

def allreduce_step(compute_s: float, fwd_fraction: float, t_net: float, cpu_s: float,
                   cpu: CpuModel | None, overlap: bool = True,
                   shared_cpu_s: float | None = None,
                   measured_shared_s: float | None = None) -> dict:
    """DDP's step: the ring All-Reduce of the gradients may overlap the backward pass only.

    C' = rho C is the compute when every rank of a machine computes at once; the backward pass
    is (1 - f) C' (f: the share of the compute before backward and after it -- forward and
    the optimizer step). The All-Reduce alone takes T_c = max(T_net, K / P): the network's
    time, or the machine's P cores doing its K core-seconds (kappa), whichever is longer. While
    the backward pass runs the ring gets only the spare cores s = max(0, P - R) (on
    oversubscribed cores DDP's first bucket goes at a fraction of line rate during backward and
    the others become ready only at its end), so a share p = min(1, (1 - f) C' r) of it
    is done by then, r = min(1 / T_net, s / K_eff) of the All-Reduce per second (K_eff: kappa_eff
    bytes, beside compute). Then

        T = C' + (1 - p) T_c

    Without a CpuModel r = 1 / T_net, and this is the classic T = f C + max((1 - f) C, T_net);
    on oversubscribed cores (s = 0) it is C' + T_c: no overlap."""
    rho = cpu.oversubscription if cpu is not None else 1.0
    cs = rho * compute_s if measured_shared_s is None else measured_shared_s
    bwd = (1.0 - fwd_fraction) * cs
    t_c = max(t_net, cpu_s / cpu.cores) if cpu is not None else t_net
    if t_c <= 0:
        return {"step_s": cs, "comm_alone_s": 0.0, "overlap_share": 1.0, "rate": None}
    if not overlap:
        return {"step_s": cs + t_c, "comm_alone_s": t_c, "overlap_share": 0.0, "rate": 0.0}
    phi = cpu.costs.pace_beside_compute if cpu is not None else 1.0
    rates = [phi / t_net] if t_net > 0 else []
    k_eff = cpu_s if shared_cpu_s is None else shared_cpu_s
    if cpu is not None and k_eff > 0:
        rates.append(cpu.spare_cores / k_eff)
    rate = min(rates) if rates else math.inf
    share = min(1.0, bwd * rate)
    return {"step_s": cs + (1.0 - share) * t_c, "comm_alone_s": t_c, "overlap_share": share,
            "rate": rate}


def exchange_step(compute_s: float, t_net: float, cpu_s: float, cpu: CpuModel | None,
                  overlap: bool = True, shared_cpu_s: float | None = None,
                  measured_shared_s: float | None = None) -> dict:
    """A decentralized step: the exchange of x(t) overlaps the whole iteration.

    The exchange's flows are independent (no chain of steps: each rank posts its sends and
    receives at once and the kernel streams them), so it goes on while the ranks compute,
    at a share phi of its own pace (each rank's main thread holds a core and its GIL), and its bytes cost the compute K_eff = kappa_eff * bytes of CPU time. Alone the
    exchange takes T_x = max(T_net(t), K / P). Two phases:

    1. compute and exchange together, until the compute is done: the ranks' work R C plus
       the share s1 of K_eff moved meanwhile, on P cores (on R <= P cores at least one rank's
       C): D1 = max(C, (R C + s1 K_eff) / P), with s1 = min(1, phi D1 / T_x); solved for D1
       (D1 = R C / P / (1 - phi K_eff / (P T_x)) while s1 < 1);
    2. the rest of the exchange alone: (1 - s1) T_x.

        T(t) = D1 + (1 - s1) T_x

    With phi = 1 this is the largest of the three bounds max(T_net, C, (R C + K_eff) / P) up
    to the (small) difference between K and K_eff on the bytes of phase 2; without a CpuModel
    it is max(C, T_net(t)). ``overlap=False``: C' + T_x. ``measured_shared_s``: C' measured
    (every rank computing at once, no communication) instead of rho C; the ranks' work is
    then P C' where they oversubscribe the cores."""
    if cpu is None:
        return {"step_s": max(compute_s, t_net) if overlap else compute_s + t_net,
                "comm_alone_s": t_net, "bound": "network" if t_net > compute_s else "compute",
                "beside_share": None}
    k_eff = cpu_s if shared_cpu_s is None else shared_cpu_s
    p, r = cpu.cores, cpu.ranks
    cs = cpu.oversubscription * compute_s if measured_shared_s is None else measured_shared_s
    t_x = max(t_net, cpu_s / p)
    if not overlap:
        return {"step_s": cs + t_x, "comm_alone_s": t_x, "bound": "serial",
                "beside_share": 0.0}
    if t_x <= 0:
        return {"step_s": cs, "comm_alone_s": 0.0, "bound": "compute", "beside_share": 1.0}
    phi = cpu.costs.pace_beside_compute
    work = r * compute_s if measured_shared_s is None else max(r * compute_s, p * cs)
    denom = 1.0 - phi * k_eff / (p * t_x)
    if work <= 0:
        d1 = 0.0
    else:  # denom <= 0: the bytes would take the cores faster than they free: s1 reaches 1
        d1 = max(compute_s, work / p / denom) if denom > 0 else math.inf
    s1 = phi * d1 / t_x
    if s1 >= 1.0:
        d1, s1 = max(compute_s, (work + k_eff) / p), 1.0
    step = d1 + (1.0 - s1) * t_x
    if step <= cs * (1 + 1e-9):
        bound = "compute"
    elif s1 >= 1.0:
        bound = "cpu"
    else:
        bound = "network" if t_net >= cpu_s / p else "cpu"
    return {"step_s": step, "comm_alone_s": t_x, "bound": bound, "beside_share": s1}


#: DDP's passes over the gradients' bytes around its All-Reduce, per rank: copying them into
#: the bucket, dividing by the world size, copying the result back (gradient_as_bucket_view off).
DDP_MEMORY_PASSES = 3


def predict(cluster: Cluster, model_bytes: int, compute_s: float,
            fwd_fraction: float = DEFAULT_FWD_FRACTION, method="allreduce",
            overlap: bool = True, *, cpu: CpuModel | None = None,
            measured_shared_s: float | None = None) -> dict:
    """Predicted time of one training step.

    ``method``: "allreduce", a topology name (ring, torus, exp, one-peer-exp, aer, complete)
    or a topology object with ``n``, ``period`` and ``out_peers(rank, step)`` (exchanged
    point to point). ``compute_s``: one rank's compute per step, measured alone (forward,
    backward and the optimizer step). ``fwd_fraction``: the share of it that cannot overlap an
    All-Reduce (forward and optimizer). ``cpu``: the cores the ranks share and what bytes cost
    them (CpuModel); None: communication costs no CPU and every rank has a core of its own.
    Returns {"step_s", "comm_s", "compute_s", "formula", ...}: comm_s is the communication
    alone (All-Reduce, or the exchange averaged over the topology's period), CPU included.
    ``measured_shared_s`` (with ``cpu``): C', the compute per step with every rank of a machine
    computing at once (no communication), measured, instead of rho * compute_s: for compute
    that scales worse than the cores do (docs/model.md 5.7)."""
    if model_bytes < 0 or compute_s < 0:
        raise ValueError("model_bytes and compute_s must not be negative")
    if not 0.0 <= fwd_fraction <= 1.0:
        raise ValueError(f"fwd_fraction must be in [0, 1], got {fwd_fraction}")
    if cpu is not None and not isinstance(cpu, CpuModel):
        raise TypeError(f"cpu must be a CpuModel, got {type(cpu).__name__}")
    fwd_s = fwd_fraction * compute_s
    bwd_s = compute_s - fwd_s
    ms = 1e3
    rho = cpu.oversubscription if cpu is not None else 1.0
    base = {"compute_s": compute_s, "fwd_s": fwd_s, "bwd_s": bwd_s, "n": cluster.n,
            "model_bytes": model_bytes, "overlap": overlap,
            "shared_compute_s": (rho * compute_s if measured_shared_s is None or cpu is None
                                 else measured_shared_s),
            "cpu": None if cpu is None else {"cores": cpu.cores, "ranks": cpu.ranks,
                                              "rho": rho, "costs": cpu.costs.to_json()}}

    if isinstance(method, str) and canonical_method(method) == "allreduce":
        cands = allreduce_candidates(cluster, model_bytes)
        evals = {}
        for name, (ar, flows, mem_bytes) in cands.items():
            k = comm_cpu_s(cluster, flows, cpu)
            k_eff = comm_cpu_s(cluster, flows, cpu, shared=True)
            if cpu is not None and cluster.n > 1:
                mem = ((DDP_MEMORY_PASSES * model_bytes * min(cpu.ranks, cluster.n)
                        + mem_bytes * min(1.0, cpu.ranks / cluster.n))
                       * cpu.costs.mem_s_per_byte)
                k, k_eff = k + mem, k_eff + mem
            evals[name] = (ar, k, allreduce_step(
                compute_s, fwd_fraction, ar["seconds"], k, cpu, overlap, k_eff,
                measured_shared_s if cpu is not None else None))
        pick = min(evals, key=lambda m: (evals[m][2]["step_s"], m != "flat"))
        ar, k, x = evals[pick]
        t_ar = ar["seconds"]
        step = x["step_s"]
        if cpu is None:
            how = "T = T_fwd + max(T_bwd, T_ar)" if overlap else "T = T_fwd + T_bwd + T_ar"
            vals = (f"{fwd_s * ms:.2f} + max({bwd_s * ms:.2f}, {t_ar * ms:.2f}) ms" if overlap
                    else f"{fwd_s * ms:.2f} + {bwd_s * ms:.2f} + {t_ar * ms:.2f} ms")
        else:
            how = "T = C' + (1 - p) T_c, C' = rho C, T_c = max(T_ar, K/P)"
            vals = (f"{base['shared_compute_s'] * ms:.2f} + (1 - {x['overlap_share']:.3f}) * "
                    f"max({t_ar * ms:.2f}, {k:.3f}/{cpu.cores:g} s) ms")
        if pick == "two-level":
            ar_f = (f"two-level T_ar: intra R*M/mem + 2 a_shm, inter 2(H-1)/H*M/uplink + 2(H-1)a, "
                    f"{ar['chunks']} pipelined chunk(s): {ar['intra_s'] * ms:.2f} and "
                    f"{ar['inter_s'] * ms:.2f} -> {t_ar * ms:.2f} ms")
        elif ar.get("beta_eff_gbit") is not None:
            ar_f = (f"T_ar = 2(n-1)a + 2(n-1)/n*M/b_eff = {2 * (cluster.n - 1)}*"
                    f"{ar['latency_s'] / (2 * (cluster.n - 1)) * 1e6:g}us + "
                    f"{2 * (cluster.n - 1) / cluster.n:.3f}*{model_bytes / 2**20:.2f}MiB/"
                    f"{ar['beta_eff_gbit']:.4g}Gbit/s = {t_ar * ms:.2f} ms")
        else:
            ar_f = "T_ar = 0 (one rank, or nothing to send)"
        out = {**base, "method": "allreduce", "step_s": step, "comm_s": x["comm_alone_s"],
               "network_s": t_ar, "comm_cpu_s": k, "overlap_share": x["overlap_share"],
               "period": 1, "formula": f"{how} = {vals} = {step * ms:.2f} ms; {ar_f}",
               "uplink_flows": ar.get("uplink_flows", 0), "allreduce": ar,
               "algorithm": pick,
               "sent_bytes_per_rank": ar.get("sent_bytes_per_rank", 0.0)}
        if len(evals) > 1:
            out["algorithms"] = {m: {"step_s": e[2]["step_s"], "allreduce_s": e[0]["seconds"]}
                                 for m, e in evals.items()}
            other = next(m for m in evals if m != pick)
            out["formula"] += (f"; {pick} picked: {step * ms:.2f} ms against {other} "
                               f"{evals[other][2]['step_s'] * ms:.2f} ms")
        return out

    pattern = Pattern(canonical_method(method), cluster.n, cluster.ranks_per_node,
                      cluster.layout) if isinstance(method, str) else method
    if pattern.n != cluster.n:
        raise ValueError(f"topology has {pattern.n} ranks, the cluster {cluster.n}")
    steps, step_times, comm_times = [], [], []
    for t in range(pattern.period):
        x = neighbor_exchange(cluster, pattern, t, model_bytes)
        flows = x.pop("flows_list")
        k = comm_cpu_s(cluster, flows, cpu)
        k_eff = comm_cpu_s(cluster, flows, cpu, shared=True)
        if cpu is not None and x["memory_bytes"]:
            mem = x["memory_bytes"] * cpu.costs.mem_s_per_byte * min(1.0, cpu.ranks / cluster.n)
            k, k_eff = k + mem, k_eff + mem
        y = exchange_step(compute_s, x["seconds"], k, cpu, overlap, k_eff,
                          measured_shared_s if cpu is not None else None)
        x = x | {"comm_cpu_s": k, "shared_comm_cpu_s": k_eff,
                 "comm_alone_s": y["comm_alone_s"], "step_s": y["step_s"],
                 "bound": y.get("bound"), "beside_share": y.get("beside_share")}
        steps.append(x)
        step_times.append(y["step_s"])
        comm_times.append(y["comm_alone_s"])
    step = sum(step_times) / len(step_times)
    comm = sum(comm_times) / len(comm_times)
    if cpu is None:
        how = ("max(T_fwd + T_bwd, T_exchange(t))" if overlap
               else "T_fwd + T_bwd + T_exchange(t)")
    else:
        how = ("D1 + (1 - s1) T_x, D1 = max(C, (R C + s1 K_eff)/P), s1 = min(1, phi D1/T_x)"
               if overlap else "C' + max(T_exchange(t), K(t)/P)")
    per = ", ".join(f"{x['seconds'] * ms:.2f}" for x in steps[:8]) + \
        (", ..." if len(steps) > 8 else "")
    formula = (f"T = mean over {pattern.period} step(s) of {how}; T_exchange(t) = latency + "
               f"max over links of bytes/capacity = [{per}] ms; compute {compute_s * ms:.2f} ms"
               f" -> {step * ms:.2f} ms")
    if cpu is not None:
        formula += (f"; R={cpu.ranks}, P={cpu.cores:g}, K_eff(t) = kappa_eff*bytes = ["
                    + ", ".join(f"{x['shared_comm_cpu_s']:.3f}" for x in steps[:8])
                    + "] core-s")
    return {**base, "method": getattr(pattern, "name", str(method)), "step_s": step,
            "comm_s": comm, "network_s": sum(x["seconds"] for x in steps) / len(steps),
            "period": pattern.period, "formula": formula, "steps": steps,
            "uplink_flows": max(x["uplink_flows"] for x in steps),
            "sent_bytes_per_rank": sum(x["sent_bytes_per_rank"] for x in steps) / len(steps)}


def recommend(cluster: Cluster, model_bytes: int, compute_s: float,
              fwd_fraction: float = DEFAULT_FWD_FRACTION, *, methods=METHODS,
              overlap: bool = True, cpu: CpuModel | None = None,
              dec_compute_s: float | None = None) -> list[tuple[str, float]]:
    """(method, predicted step seconds) for every method, fastest first.

    ``methods``: names from ALL_METHODS (default METHODS, what linerate runs).
    ``dec_compute_s``: the compute of a decentralized step where its optimizer costs other
    than the All-Reduce one's (default ``compute_s``). Times within 1 ns of each other (e.g. every
    method hidden behind the compute) are ties, broken in favor of better mixing (TIE_ORDER):
    All-Reduce (exact average), complete, aer and one-peer-exp (exact average after a period
    for powers of two), exp, torus, ring."""
    names = list(dict.fromkeys(canonical_method(m) for m in methods))
    dec_c = compute_s if dec_compute_s is None else dec_compute_s
    out = [(m, predict(cluster, model_bytes, compute_s if m == "allreduce" else dec_c,
                       fwd_fraction, m, overlap, cpu=cpu)["step_s"]) for m in names]
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
    from linerate.tools import netlab
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


#: The rank links inside a netlab host (loopback TCP within its namespace) when not measured.
DEFAULT_LAB_LOOPBACK_GBIT = 10.0


def _lab_layout(lab) -> list[int] | None:
    """The lab's ranks per host where some host holds several (then each host is a node of
    the model, its ranks sharing memory), else None (one rank per host)."""
    layout = lab.layout() if hasattr(lab, "layout") else [1] * len(lab.hosts)
    if max(layout) <= 1:
        return None
    if getattr(lab, "nodes", 1) > 1:
        raise ValueError(f"netlab {lab.name!r} has both nodes ({lab.nodes}) and several ranks "
                         f"per host: the model knows two levels (hosts of ranks, or nodes of "
                         f"one-rank hosts), not three")
    return layout


def cluster_from_lab(lab, intra_latency_s: float = 50e-6,
                     inter_latency_s: float = 100e-6, host_mem_gbs: float | None = None,
                     shm_latency_s: float = 100e-6) -> Cluster:
    """The lab as configured: tbf rates, one rank per host, hosts grouped by node. An
    unshaped lab (``--rate none``) has no configured rate: measure it. A lab with several ranks
    per host (``netlab up --ranks-per-host``): each host is a node of its ranks, sharing memory
    at ``host_mem_gbs`` (None: the caller must give it, or --measure), joined by the host links
    (``rate`` x rails); the ranks of a host reach each other over loopback at
    DEFAULT_LAB_LOOPBACK_GBIT."""
    if not lab.rate_bps or lab.inter_rate_bps == 0:
        which = "--rate none" if not lab.rate_bps else "--inter-rate none"
        raise ValueError(f"netlab {lab.name!r} is unshaped ({which}): its links have no "
                         f"configured rate; measure them with --measure (or give --intra-gbit "
                         f"and --inter-gbit)")
    layout = _lab_layout(lab)
    if layout is not None:
        return Cluster(nodes=len(layout), ranks_per_node=max(layout),
                       intra_gbit=DEFAULT_LAB_LOOPBACK_GBIT,
                       inter_gbit=lab.rate_bps / 1e9 * lab.rails,
                       intra_latency_s=intra_latency_s, inter_latency_s=inter_latency_s,
                       host_mem_gbs=host_mem_gbs, shm_latency_s=shm_latency_s,
                       layout=tuple(layout))
    per_node = _node_hosts(lab)
    return Cluster(nodes=len(per_node), ranks_per_node=max(len(h) for h in per_node),
                   intra_gbit=lab.rate_bps / 1e9 * lab.rails,
                   inter_gbit=(lab.inter_rate_bps or lab.rate_bps) / 1e9 * lab.rails,
                   intra_latency_s=intra_latency_s, inter_latency_s=inter_latency_s)


def measure_netlab(name: str = "lab", seconds: float = DEFAULT_MEASURE_SECONDS,
                   pings: int = DEFAULT_PINGS,
                   shm_bytes: int = DEFAULT_SHM_BYTES) -> tuple[Cluster, dict]:
    """Measure a running netlab: (Cluster, raw figures).

    intra: one TCP flow between two hosts of node 0 (a rank link is not shared by it);
    inter: every host of node 0 sends to its counterpart on node 1 at once (the flows share
    node 0's uplink, as the model says they do) and the rates are summed -- this is the uplink's
    capacity even where it is faster than one rank link; one flow alone is also reported;
    latencies: half the median round trip of a 1-byte TCP ping-pong. Rail 0 is measured; with
    several rails the bandwidths are multiplied by the rail count (identical fabrics, striped).
    A lab with several ranks per host: measure_hosts.
    """
    from linerate.tools import netlab
    lab = netlab.load(name)
    if not netlab.is_up(lab):
        raise RuntimeError(f"netlab {name!r} is not up (run: linerate netlab up --name {name})")
    if _lab_layout(lab) is not None:
        return measure_hosts(lab, seconds, pings, shm_bytes)
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


_SHM_PROBE = r"""
import json, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
torch.set_num_threads(1)
out, nbytes, reps, layout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
dist.init_process_group("linerate", timeout=timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
starts = [sum(layout[:k]) for k in range(len(layout))]
mine = None
for h, (s, r) in enumerate(zip(starts, layout)):   # every rank creates every host's group
    g = dist.new_group(list(range(s, s + r)), backend="linerate")
    if s <= rank < s + r:
        host, mine = h, g
shared = bool(getattr(mine._get_backend(torch.device("cpu")), "shared_memory", False))
def times(t, k):
    ts = []
    for _ in range(k):
        dist.barrier()                  # every host's group starts together, as in a step
        t0 = time.perf_counter()
        dist.all_reduce(t, group=mine)
        ts.append(time.perf_counter() - t0)
    return ts
small, big = torch.ones(1024), torch.ones(nbytes // 4)
times(small, 3); times(big, 2)
res = torch.tensor([statistics.median(times(small, max(5, reps * 4))),
                    statistics.median(times(big, reps)), float(shared)], dtype=torch.float64)
allv = [torch.zeros_like(res) for _ in range(world)]
dist.all_gather(allv, res)
if rank == 0:
    with open(out, "w") as f:
        json.dump([v.tolist() for v in allv], f)
dist.destroy_process_group()
"""


def measure_shared_memory(lab, layout: list[int], nbytes: int = DEFAULT_SHM_BYTES,
                          reps: int = 5) -> dict:
    """The shared-memory All-Reduce of every host of ``lab`` at once (each host's ranks in a
    group of their own, all hosts' groups started together as in a training step, so the
    machine's cores and memory are shared as they are then): the median time of a 4 KiB one
    (the per-operation latency a_shm) and of an ``nbytes`` one, T, per rank; the host memory
    rate is R * nbytes / (T - a_shm) on the slowest host (IntraHost "memory")."""
    import statistics
    import tempfile
    from linerate.tools import netlab
    fd, out = tempfile.mkstemp(prefix="linerate_shm_probe", suffix=".json")
    os.close(fd)
    nproc = sum(layout)
    try:
        args = [sys.executable, "-c", _SHM_PROBE, out, str(nbytes), str(reps), json.dumps(layout)]
        port = netlab.free_port_in(lab.hosts[0])
        runs = []
        for r in range(nproc):
            h, _ = netlab.placement(layout, r)
            runs.append((netlab.netns_argv(lab.hosts[h], args),
                         netlab.rank_env(lab, r, nproc, port, layout=layout)))
        _run_probe_ranks(runs, timeout=300)
        with open(out) as f:
            rows = json.load(f)
    finally:
        os.unlink(out)
    if not all(row[2] for row in rows):
        raise RuntimeError("the shared-memory probe's host groups did not get shared memory "
                           "(LINERATE_SHM=0 set?): the two-level model needs it")
    starts = [sum(layout[:k]) for k in range(len(layout))]
    per_host = []
    for s, r in zip(starts, layout):
        small = statistics.median(rows[i][0] for i in range(s, s + r))
        big = max(rows[i][1] for i in range(s, s + r))
        per_host.append({"ranks": r, "latency_s": small, "allreduce_s": big,
                         "mem_bytes_s": r * nbytes / max(big - small, 1e-9)})
    slow = min(per_host, key=lambda x: x["mem_bytes_s"])
    return {"bytes": nbytes, "hosts": per_host, "latency_s": max(h["latency_s"] for h in per_host),
            "mem_bytes_s": slow["mem_bytes_s"]}


def measure_hosts(lab, seconds: float = DEFAULT_MEASURE_SECONDS, pings: int = DEFAULT_PINGS,
                  shm_bytes: int = DEFAULT_SHM_BYTES) -> tuple[Cluster, dict]:
    """Measure a lab with several ranks per host (``netlab up --ranks-per-host``): the host
    link (a TCP flow h0 -> h1 and one h1 -> h0 at once, the slower, rail 0, times the rails; one
    flow alone is reported too), the one-way latency between hosts,
    the loopback TCP inside h0 (the flat ring's hops inside a host), and the shared-memory
    All-Reduce of every host at once (measure_shared_memory, ``shm_bytes``: the model's bytes
    fit best)."""
    from linerate.tools import netlab
    layout = _lab_layout(lab)
    hosts = [lab.hosts[h] for h in range(len(layout))]
    raw: dict = {"lab": lab.name, "seconds": seconds, "ranks_per_host": layout}
    if len(hosts) >= 2:
        a, b = hosts[0].name, hosts[1].name
        raw["inter_single_bps"] = netlab.probe(lab, a, b, seconds)
        # both ways at once, as every collective loads the link (ring, exchanges): each
        # direction's data shares the wire with the other's acknowledgements
        both = _concurrent([lambda: netlab.probe(lab, a, b, seconds),
                            lambda: netlab.probe(lab, b, a, seconds)])
        raw["inter_both_ways_bps"] = both
        raw["inter_bps"] = min(both)
        raw["inter_flows"] = 1
        raw["inter_latency_s"] = _one_way_latency(lab, a, b, pings)
    raw["intra_bps"] = netlab.probe(lab, hosts[0].name, hosts[0].name, seconds)
    raw["intra_latency_s"] = _one_way_latency(lab, hosts[0].name, hosts[0].name, pings)
    raw["shm"] = measure_shared_memory(lab, layout, shm_bytes)
    raw["rails"] = lab.rails
    cluster = Cluster(nodes=len(layout), ranks_per_node=max(layout),
                      intra_gbit=raw["intra_bps"] / 1e9,
                      inter_gbit=raw.get("inter_bps", raw["intra_bps"]) * lab.rails / 1e9,
                      intra_latency_s=raw["intra_latency_s"],
                      inter_latency_s=raw.get("inter_latency_s", raw["intra_latency_s"]),
                      host_mem_gbs=raw["shm"]["mem_bytes_s"] / 1e9,
                      shm_latency_s=raw["shm"]["latency_s"], layout=tuple(layout))
    return cluster, raw


# ----------------------------------------------------------------------------- CPU costs

_CPU_PROBE = r"""
import json, os, resource, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from linerate.collectives.neighbor import neighbor_allreduce
from linerate.collectives.topology import by_name
torch.set_num_threads(1)
out, nbytes, seconds, cycles = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("linerate", timeout=timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
topo = by_name("one-peer-exp", world)
t = torch.ones(nbytes // 4)
x, w = torch.randn(64, 1024), torch.randn(1024, 1024)
a, b = torch.zeros(1 << 20), torch.ones(1 << 20)
def work():  # the stand-in for a rank's compute: a matmul of a batch and a pass over memory
    for _ in range(4):
        x @ w
    a.mul_(0.9).add_(b, alpha=0.1)
def softirq():
    with open("/proc/stat") as f:
        return int(f.readline().split()[7]) / os.sysconf("SC_CLK_TCK")
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
for _ in range(2):
    neighbor_allreduce(t, topo)
    work()
dist.barrier()
t0 = time.perf_counter()
neighbor_allreduce(t, topo)
k = torch.tensor([max(2, int(seconds / max(time.perf_counter() - t0, 1e-4)))])
dist.broadcast(k, 0)
k = int(k)
sent = sum(len(topo.out_peers(r, s)) for s in range(k) for r in range(world)) * (nbytes // 4 * 4)
rows = []
for _ in range(cycles):
    dist.barrier()                      # the exchange alone: k neighbor all-reduces
    s0, c0, w0 = softirq(), cpu(), time.perf_counter()
    for _ in range(k):
        neighbor_allreduce(t, topo)
    comm_s = time.perf_counter() - w0
    dist.barrier()
    comm_cpu, comm_softirq = cpu() - c0, softirq() - s0
    dist.barrier()                      # the compute alone, on every rank at once
    n, w0 = 0, time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        work()
        n += 1
    rate_alone = n / (time.perf_counter() - w0)
    dist.barrier()                      # both: the exchange posted, the main thread computing
    n, done, w0 = 0, 0, time.perf_counter()
    h = neighbor_allreduce(t, topo, async_op=True)
    while True:
        work()
        n += 1
        if h.is_completed():
            h.wait()
            done += 1
            if done == k:
                break
            h = neighbor_allreduce(t, topo, async_op=True)
    both_s = time.perf_counter() - w0
    rows.append([comm_s, comm_cpu, comm_softirq, rate_alone, n / both_s, both_s])
v = torch.tensor(rows, dtype=torch.float64)
allv = [torch.zeros_like(v) for _ in range(world)]
dist.all_gather(allv, v)
if rank == 0:
    with open(out, "w") as f:
        json.dump({"ops": k, "bytes_sent": sent, "ranks": [x.tolist() for x in allv]}, f)
dist.destroy_process_group()
"""


def _run_probe_ranks(argvs_envs: list[tuple[list[str], dict]], timeout: float) -> None:
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for argv, env in argvs_envs]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(i, p.returncode, e) for i, (p, e) in enumerate(zip(procs, errs)) if p.returncode]
    if bad:
        i, rc, err = bad[0]
        raise RuntimeError(f"CPU probe: rank {i} exited with {rc}: {err.strip()[-400:]}")


def _cpu_probe(ranks: int, cores: float, lab=None, nbytes: int = 16 << 20,
               seconds: float = DEFAULT_CPU_SECONDS, cycles: int = DEFAULT_CPU_CYCLES) -> dict:
    """``ranks`` linerate ranks (one per host of ``lab``, else local over loopback) exchange
    ``nbytes`` with their one-peer exponential neighbours (neighbor_allreduce, as
    DecentralizedDataParallel does), ``cycles`` times in three phases of about ``seconds``:

    1. the exchange alone, k ops: its time T_alone, and kappa = (the ranks' CPU time + the
       machine's softirq time) / bytes sent;
    2. the compute stand-in alone on every rank (a 64 x 1024 by 1024 x 1024 matmul four times
       and a pass over 4 MiB, one thread): iterations per second per rank;
    3. both in each rank, as in a decentralized step: the k exchanges posted one after the
       other (async) while the main thread computes: phi = T_alone / T_both, the pace the
       exchange keeps beside the compute, and kappa_eff = the compute the bytes displaced,
       sum over ranks of (1 - rate_both / rate_alone) * min(1, cores / ranks) * T_both, per byte
       sent (it includes the exchange's own CPU time and what sharing costs beyond it: context
       switches, caches, each rank's GIL).

    Each figure is the median over the cycles."""
    import statistics
    import tempfile
    from linerate.tools import launch
    fd, out = tempfile.mkstemp(prefix="linerate_cpu_probe", suffix=".json")
    os.close(fd)
    try:
        args = [sys.executable, "-c", _CPU_PROBE, out, str(nbytes), str(seconds), str(cycles)]
        if lab is None:
            port = launch.free_port()
            runs = [(args, launch.rank_env(r, ranks, port)) for r in range(ranks)]
        else:
            from linerate.tools import netlab
            port = netlab.free_port_in(lab.hosts[0])
            runs = [(netlab.netns_argv(lab.hosts[r], args), netlab.rank_env(lab, r, ranks, port))
                    for r in range(ranks)]
        _run_probe_ranks(runs, timeout=300 + 10 * cycles * seconds)
        with open(out) as f:
            raw = json.load(f)
    finally:
        os.unlink(out)
    held = min(1.0, cores / ranks)
    sent = raw["bytes_sent"]
    cyc = []
    for c in range(cycles):
        rows = [r[c] for r in raw["ranks"]]
        t_alone = max(r[0] for r in rows)
        t_both = max(r[5] for r in rows)
        displaced = sum(max(0.0, 1.0 - r[4] / r[3]) * held * r[5] for r in rows)
        cyc.append({"exchange_alone_s": t_alone, "exchange_beside_compute_s": t_both,
                    "kappa_s_per_byte": (sum(r[1] for r in rows) + rows[0][2]) / sent,
                    "kappa_eff_s_per_byte": displaced / sent,
                    "phi": t_alone / t_both,
                    "compute_rate_alone": sum(r[3] for r in rows),
                    "compute_rate_beside": sum(r[4] for r in rows)})
    med = {key: statistics.median(x[key] for x in cyc)
           for key in ("kappa_s_per_byte", "kappa_eff_s_per_byte", "phi")}
    return med | {"ranks": ranks, "ops": raw["ops"], "bytes_sent_per_phase": sent,
                  "cycles": cyc}


def _memory_pass_s_per_byte(nbytes: int = 16 << 20, repeats: int = 20) -> float:
    """One pass over memory: the fastest of ``repeats`` ``a.copy_(b)`` of ``nbytes`` float32,
    one thread, per byte."""
    import time

    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            a.copy_(b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best / (nbytes // 4 * 4)


def measure_cpu_costs(lab_name: str | None = None, seconds: float = DEFAULT_CPU_SECONDS,
                      ranks: int | None = None, cores: float | None = None,
                      cycles: int = DEFAULT_CPU_CYCLES) -> CpuCosts:
    """Measure CpuCosts on this machine (_cpu_probe): kappa, kappa_eff and phi with ``ranks``
    linerate ranks -- on every host of the netlab ``lab_name`` (its emulated network's cost
    included; on a two-tier lab the one-peer exchange crosses nodes at some steps, and the
    figures are the average), or over loopback with ``ranks`` local ranks (default: the
    cores) -- and the memory pass with a.copy_(b). The ranks' own CPU time and the machine's
    softirq time count toward kappa; the compute rates are the machine's: measure on a quiet one."""
    cores = cores or os.cpu_count() or 1
    lab = None
    if lab_name is not None:
        from linerate.tools import netlab
        lab = netlab.load(lab_name)
        if not netlab.is_up(lab):
            raise RuntimeError(f"netlab {lab_name!r} is not up")
        # one rank per host (a lab with several ranks per host: its first hosts' first ranks)
        ranks = min(ranks or len(lab.hosts), len(lab.hosts))
        if not 2 <= ranks <= len(lab.hosts):
            raise ValueError(f"the CPU probe needs 2..{len(lab.hosts)} ranks on lab {lab_name}")
        where = f"netlab {lab_name}, {ranks} ranks"
    else:
        ranks = max(2, ranks or int(math.ceil(cores)))
        where = f"loopback, {ranks} ranks"
    probe = _cpu_probe(ranks, cores, lab, seconds=seconds, cycles=cycles)
    mem = _memory_pass_s_per_byte()
    raw = {"where": where, "cores": cores, "seconds": seconds, "probe": probe,
           "memory_pass_s_per_byte": mem}
    return CpuCosts(net_s_per_byte=probe["kappa_s_per_byte"], mem_s_per_byte=mem,
                    shared_net_s_per_byte=probe["kappa_eff_s_per_byte"],
                    pace_beside_compute=min(1.0, probe["phi"]),
                    source=f"measured, {where}", raw=raw)


# ----------------------------------------------------------------------------- CLI

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "model", help="predict step time of All-Reduce and decentralized topologies; recommend",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (options override what --netlab gives)")
    g.add_argument("--nodes", type=_positive_int, default=None, help="nodes (default 1)")
    g.add_argument("--ranks-per-node", type=_layout_arg, default=None,
                   help="ranks per node (default 1), or one count per node where they differ "
                        "(4,3; --nodes then defaults to their number)")
    g.add_argument("--intra-gbit", type=_positive_float, default=None,
                   help="Gbit/s of each rank's link inside a node, each way")
    g.add_argument("--inter-gbit", type=_positive_float, default=None,
                   help="Gbit/s of each node's uplink, each way (shared by the node's ranks)")
    g.add_argument("--intra-latency-us", type=_nonneg_float, default=None,
                   help="one-way latency inside a node, microseconds (default 50)")
    g.add_argument("--inter-latency-us", type=_nonneg_float, default=None,
                   help="one-way latency between nodes, microseconds (default 100)")
    g.add_argument("--host-mem-gbs", type=_positive_float, default=None,
                   help="each node is one host whose ranks share memory, at this many GB/s "
                        "(memory bandwidth for linerate's shared-memory collectives): the "
                        "All-Reduce is predicted flat and two-level, the faster taken, and "
                        "aer-average and hierarchical are ranked too")
    g.add_argument("--shm-latency-us", type=_nonneg_float, default=None,
                   help="with --host-mem-gbs: each shared-memory operation's fixed cost, "
                        "microseconds (default 100)")
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
                   help="one rank's compute per step (forward, backward, optimizer step), "
                        "measured with that rank alone on the machine, milliseconds")
    g.add_argument("--dec-compute-ms", type=_nonneg_float, default=None,
                   help="the same for a decentralized step, where its optimizer costs "
                        "otherwise (default: --compute-ms)")
    g.add_argument("--shared-compute-ms", type=_nonneg_float, default=None,
                   help="with the CPU model: the compute per step measured with every rank of a "
                        "machine computing at once (no communication), used instead of "
                        "max(1, R/P) x --compute-ms (for compute that scales worse than the "
                        "cores)")
    g.add_argument("--dec-shared-compute-ms", type=_nonneg_float, default=None,
                   help="the same for the decentralized step")
    g.add_argument("--fwd-fraction", type=_fraction, default=DEFAULT_FWD_FRACTION,
                   help="share of the compute that cannot overlap an All-Reduce: the forward "
                        "pass and the optimizer step (default 1/3)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="communication after compute instead of overlapped")
    g.add_argument("--methods", type=_method_list, default=list(METHODS),
                   help=f"comma separated (default: {','.join(METHODS)}; also "
                        f"{','.join(GROUP_METHODS)}: group averages by ring All-Reduce, as "
                        "the paper's library runs them)")
    g = parser.add_argument_group(
        "CPU: the cores ranks share and what moving bytes costs them (docs/model.md section 5)")
    g.add_argument("--cores", type=_positive_float, default=None,
                   help="cores of each machine; turns the CPU model on (with --netlab it is on, "
                        "with this machine's cores, which run every host of the lab)")
    g.add_argument("--ranks-per-machine", type=_positive_int, default=None,
                   help="ranks sharing a machine's cores (default: --ranks-per-node; with "
                        "--netlab every rank of the lab)")
    g.add_argument("--no-cpu", dest="cpu", action="store_false",
                   help="no CPU model: every rank has cores of its own, bytes cost none")
    g.add_argument("--measure-cpu", action="store_true",
                   help="measure the CPU costs: linerate ranks exchanging bytes alone and while "
                        "they compute, on every host of the lab with --netlab, else over "
                        "loopback (--measure with --netlab implies it)")
    g.add_argument("--cpu-costs", metavar="FILE", default=None,
                   help="take the CPU costs from the JSON of an earlier --measure-cpu --json run "
                        "(its cpu_costs) or of tools.decent_bench --json")
    g.add_argument("--kappa-ns", type=_nonneg_float, default=None,
                   help="CPU nanoseconds per byte sent (both ends, the kernel, the reduction)")
    g.add_argument("--kappa-eff-ns", type=_nonneg_float, default=None,
                   help="compute nanoseconds a byte takes from ranks computing beside it "
                        "(default: --kappa-ns)")
    g.add_argument("--pace", type=_pace, default=1.0,
                   help="with --kappa-ns: the share of its pace communication keeps while its "
                        "ranks compute (phi, in (0, 1]; default 1)")
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
        from linerate.tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            raise RuntimeError(f"--netlab: {reason}")
        if args.measure:
            shm_bytes = min(256 << 20, max(1 << 20, getattr(args, "_model_bytes", 0) or 0))
            base, measured = measure_netlab(args.netlab, args.measure_seconds,
                                            shm_bytes=shm_bytes)
        else:
            base = cluster_from_lab(netlab.load(args.netlab))
    layout = None
    rpn_arg = args.ranks_per_node
    if isinstance(rpn_arg, list):
        layout = rpn_arg
        if args.nodes and args.nodes != len(layout):
            raise ValueError(f"--ranks-per-node {','.join(map(str, layout))} names "
                             f"{len(layout)} nodes, --nodes says {args.nodes}")
        nodes, rpn = len(layout), max(layout)
    else:
        nodes = args.nodes or (base.nodes if base else 1)
        rpn = rpn_arg or (base.ranks_per_node if base else 1)
        if base is not None and base.layout and not args.nodes and not rpn_arg:
            layout = list(base.layout)
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
    mem = args.host_mem_gbs or (base.host_mem_gbs if base else None)
    shm_lat = (args.shm_latency_us * 1e-6 if args.shm_latency_us is not None
               else base.shm_latency_s if base else 100e-6)
    if args.shm_latency_us is not None and mem is None:
        raise ValueError("--shm-latency-us needs --host-mem-gbs (hosts whose ranks share "
                         "memory)")
    if mem is None and args.netlab is not None \
            and _lab_layout(netlab.load(args.netlab)) is not None:
        raise ValueError(f"netlab {args.netlab!r} runs several ranks per host: give "
                         f"--host-mem-gbs (their shared memory's rate) or --measure")
    return Cluster(nodes, rpn, intra, inter, lat_in, lat_out, host_mem_gbs=mem,
                   shm_latency_s=shm_lat, layout=tuple(layout) if layout else None), measured


def build_cpu(args: argparse.Namespace, cluster: Cluster) -> CpuModel | None:
    """The CpuModel the options ask for, or None (no --cores and no --netlab, or --no-cpu)."""
    if not args.cpu or (args.cores is None and args.netlab is None):
        if args.measure_cpu or args.cpu_costs or args.kappa_ns is not None:
            raise ValueError("CPU costs need the CPU model: give --cores (or --netlab)")
        return None
    cores = args.cores or os.cpu_count() or 1
    ranks = args.ranks_per_machine or (cluster.n if args.netlab is not None
                                       else cluster.ranks_per_node)
    if args.cpu_costs:
        with open(args.cpu_costs) as f:
            data = json.load(f)
        costs = CpuCosts.from_json(data.get("cpu_costs") or data["cpu"]["costs"])
    elif args.kappa_ns is not None:
        costs = CpuCosts(net_s_per_byte=args.kappa_ns * 1e-9,
                         shared_net_s_per_byte=(args.kappa_eff_ns * 1e-9
                                                if args.kappa_eff_ns is not None else None),
                         pace_beside_compute=args.pace)
    elif args.measure_cpu or (args.measure and args.netlab is not None):
        costs = measure_cpu_costs(args.netlab, ranks=ranks, cores=cores)
    else:
        costs = CpuCosts(source="not measured: bytes cost no CPU (--measure-cpu)")
    return CpuModel(cores=cores, ranks=ranks, costs=costs)


def _bound(p: dict) -> str:
    if p["step_s"] <= p["shared_compute_s"] * (1 + 1e-9):
        return "compute"
    if p["method"] == "allreduce":
        cpu = p["cpu"]
        return "cpu" if cpu and p["comm_cpu_s"] / cpu["cores"] > p["network_s"] else "network"
    worst = max(p["steps"], key=lambda x: x["step_s"])
    return worst.get("bound") or "network"


def run(args: argparse.Namespace) -> int:
    if (args.model_bytes is None) == (args.params is None):
        print("linerate model: error: give one of --model-bytes and --params", file=sys.stderr)
        return 2
    model_bytes = args.model_bytes if args.model_bytes is not None \
        else int(args.params * DTYPE_BYTES[args.dtype])
    args._model_bytes = model_bytes
    try:
        cluster, measured = build_cluster(args)
        cpu = build_cpu(args, cluster)
    except (ValueError, RuntimeError, FileNotFoundError, KeyError) as e:
        print(f"linerate model: error: {e}", file=sys.stderr)
        return 2
    methods, skipped = list(args.methods), []
    if cluster.shared_memory and args.methods == list(METHODS):
        methods += list(HOST_METHODS)
    if not cluster.even:
        skipped = [m for m in methods if m not in ("allreduce", "hierarchical")]
        methods = [m for m in methods if m not in skipped]
    compute_s = args.compute_ms / 1e3
    dec_compute_s = compute_s if args.dec_compute_ms is None else args.dec_compute_ms / 1e3
    ms = None if args.shared_compute_ms is None else args.shared_compute_ms / 1e3
    dms = ms if args.dec_shared_compute_ms is None else args.dec_shared_compute_ms / 1e3
    preds = {m: predict(cluster, model_bytes, compute_s if m == "allreduce" else dec_compute_s,
                        args.fwd_fraction, m, args.overlap, cpu=cpu,
                        measured_shared_s=ms if m == "allreduce" else dms)
             for m in methods}
    ranking = sorted(((m, p["step_s"]) for m, p in preds.items()),
                     key=lambda mt: (round(mt[1], 9), TIE_ORDER.index(mt[0])))
    t_ar = predict(cluster, model_bytes, compute_s, args.fwd_fraction, "allreduce",
                   args.overlap, cpu=cpu, measured_shared_s=ms)["step_s"]
    rows = []
    for method, step in ranking:
        p = preds[method]
        if method == "allreduce" and "algorithms" in p:
            label = f"allreduce ({p['algorithm']})"
        else:
            label = method
        rows.append({"method": method, "label": label, "step_s": step, "comm_s": p["comm_s"],
                     "speedup": t_ar / step if step > 0 else None,
                     "bound": _bound(p), "uplink_flows": p["uplink_flows"],
                     "period": p["period"], "formula": p["formula"]})
    if args.json:
        out = {"cluster": asdict(cluster) | {"n": cluster.n}, "measured": measured,
               "model_bytes": model_bytes, "compute_s": compute_s,
               "dec_compute_s": dec_compute_s, "fwd_fraction": args.fwd_fraction,
               "overlap": args.overlap,
               "cpu": None if cpu is None else {"cores": cpu.cores, "ranks": cpu.ranks,
                                                "rho": cpu.oversubscription},
               "cpu_costs": None if cpu is None else cpu.costs.to_json(),
               "allreduce_step_s": t_ar, "recommended": rows[0]["method"], "ranking": rows,
               "skipped": skipped, "predictions": preds}
        print(json.dumps(out, indent=1))
        return 0
    ar = preds.get("allreduce")
    print(format_table(cluster, measured, model_bytes, compute_s, args.fwd_fraction, rows,
                       cpu=cpu, dec_compute_s=dec_compute_s,
                       allreduce=ar if ar and "algorithms" in ar else None, skipped=skipped))
    return 0


def format_table(cluster: Cluster, measured: dict | None, model_bytes: int, compute_s: float,
                 fwd_fraction: float, rows: list[dict], cpu: CpuModel | None = None,
                 dec_compute_s: float | None = None, allreduce: dict | None = None,
                 skipped: list[str] | None = None) -> str:
    lines = [f"# cluster: {cluster.describe()}"]
    if measured and "shm" in measured:
        shm = measured["shm"]
        lines.append(f"# measured on netlab {measured['lab']!r} ({measured['seconds']:g} s "
                     f"probes): host link {measured.get('inter_bps', 0) / 1e9:.3f} Gbit/s x "
                     f"{measured['rails']} rail(s), loopback {measured['intra_bps'] / 1e9:.3f} "
                     f"Gbit/s; shared memory: {shm['bytes'] / 2**20:g} MiB All-Reduce "
                     + ", ".join(f"{h['allreduce_s'] * 1e3:.2f} ms on {h['ranks']} ranks"
                                 for h in shm["hosts"])
                     + f" (all hosts at once), 4 KiB {shm['latency_s'] * 1e6:.0f} us -> "
                     f"{shm['mem_bytes_s'] / 1e9:.2f} GB/s")
    elif measured:
        lines.append(f"# measured on netlab {measured['lab']!r} ({measured['seconds']:g} s "
                     f"probes): intra {measured['intra_bps'] / 1e9:.3f} Gbit/s"
                     + (f", inter {measured['inter_bps'] / 1e9:.3f} Gbit/s over "
                        f"{measured['inter_flows']} concurrent flow(s) (one flow alone "
                        f"{measured['inter_single_bps'] / 1e9:.3f})"
                        if "inter_bps" in measured else ""))
    lines.append(f"# model: {model_bytes / 2**20:.2f} MiB per step; compute "
                 f"{compute_s * 1e3:.2f} ms alone (not overlappable "
                 f"{fwd_fraction * compute_s * 1e3:.2f}, backward "
                 f"{(1 - fwd_fraction) * compute_s * 1e3:.2f})"
                 + (f", decentralized {dec_compute_s * 1e3:.2f} ms"
                    if dec_compute_s is not None and dec_compute_s != compute_s else ""))
    if cpu is not None:
        lines.append(f"# cpu: {cpu.describe()}")
    if allreduce is not None:
        algs = allreduce["algorithms"]
        lines.append("# All-Reduce: " + ", ".join(
            f"{m} {a['allreduce_s'] * 1e3:.2f} ms (step {a['step_s'] * 1e3:.2f} ms)"
            for m, a in algs.items()) + f" -> {allreduce['algorithm']}, the faster")
    w = max(13, max(len(r.get("label", r["method"])) for r in rows) + 1)
    lines.append(f"{'method':<{w}}{'step ms':>10}{'comm ms':>10}{'speedup':>9}"
                 f"{'uplink flows':>14}{'period':>8}  bound")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(f"{r.get('label', r['method']):<{w}}{r['step_s'] * 1e3:>10.2f}"
                     f"{r['comm_s'] * 1e3:>10.2f}"
                     f"{sp:>9}{r['uplink_flows']:>14}{r['period']:>8}  {r['bound']}")
    if skipped:
        lines.append(f"# not ranked on uneven nodes (they need the same ranks on every node): "
                     f"{', '.join(skipped)}")
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


def _layout_arg(text: str):
    """``4`` -> 4 (every node), ``4,3`` -> [4, 3] (one count per node)."""
    try:
        xs = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or comma separated counts, got "
                                         f"{text!r}") from None
    if any(x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"counts must be at least 1, got {text!r}")
    return xs[0] if len(xs) == 1 else xs


def _fraction(text: str) -> float:
    x = float(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return x


def _pace(text: str) -> float:
    x = float(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
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
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
