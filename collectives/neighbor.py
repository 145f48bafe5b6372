"""Neighbor all-reduce (docs/neighbor-spec.md): every rank mixes its tensor with its
in-neighbors' under a topology's mixing matrix, with point-to-point transfers to and from its
neighbors only (all at once, striped like every transfer), on the group's collective worker.

    neighbor_allreduce(tensor, topology, step=None, async_op=False, group=None, out=None)

After the call rank i's tensor is ``W[i, i] * x_i + sum_j W[i, j] * x_j`` with W the topology's
matrix at ``step``. ``step=None`` takes the group's own counter: the number of neighbor
all-reduces called on the group before this one (every call advances it by one, whatever its
``step``), so ranks that make the same calls agree on it.

A step whose matrix averages disjoint groups (``Topology.averaging_groups``: AER's intra-host
steps with ``intra="average"``, a complete graph) runs, in each group that is exactly the ranks
of one host sharing memory, as a shared-memory All-Reduce of that host's ranks instead of point
to point; other groups exchange point to point.

    hierarchical_neighbor_allreduce(tensor, topology, step=None, async_op=False, group=None,
                                    out=None)

BlueFog's hierarchical neighbor all-reduce: the ranks of each host average their tensors (on
shared memory where the host's ranks share a segment), then each host mixes its average with its
neighbor hosts' under ``topology``, a topology of the group's hosts; every rank of a host ends
with the same value, ``sum_b W[a, b] * mean(host b)``. Local rank l < K (K: the fewest ranks of
any host) carries the l-th of K shares of the tensor to rank l of its host's out-neighbor hosts,
so a host's link carries its average once per neighbor, whatever its rank count; the host then
gathers the K mixed shares (K broadcasts).
"""
from __future__ import annotations

import numbers
import threading
import weakref

import torch
import torch.distributed as dist

from .backend import ProcessGroupLinerate
from .comm import Comm
from .mixing import mix
from .reduce_ops import op_type
from .topology import Topology

__all__ = ["neighbor_allreduce", "hierarchical_neighbor_allreduce"]

#: SubComm tags of this module's views (1..255; every member of a view passes the same).
_TAG_HOST = 11
#: Group averages inside a host on shared memory (False: point to point, as other groups; the
#: benchmarks compare the two: tools/dev/decent_bench.py's xp2p and decp2p). Every rank must
#: have the same value when it calls.
_SHM_AVERAGES = True

_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # backend -> calls so far
_steps_lock = threading.Lock()


def linerate_backend(group):
    """The ProcessGroupLinerate behind ``group`` (None: the default group), or a clear error."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("neighbor_allreduce: torch.distributed is not initialized: call "
                               "dist.init_process_group first")
        group = dist.group.WORLD
    if isinstance(group, ProcessGroupLinerate):
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - any failure here means: not a linerate group
        raise RuntimeError(f"neighbor_allreduce: the process group has no CPU backend ({e}); it "
                           f"needs a linerate group (dist.init_process_group('linerate') or "
                           f"dist.new_group(backend='linerate'))") from None
    if not isinstance(backend, ProcessGroupLinerate):
        name = getattr(backend, "name", lambda: type(backend).__name__)()
        raise RuntimeError(f"neighbor_allreduce needs a process group of the linerate backend; this "
                           f"group's CPU backend is {name!r}: pass group=dist.new_group(backend="
                           f"'linerate') or use dist.init_process_group('linerate')")
    return backend


def neighbor_allreduce(tensor: torch.Tensor, topology: Topology, step: int | None = None,
                       async_op: bool = False, group=None, out: torch.Tensor | None = None):
    """Mix ``tensor`` in place with the neighbors' under ``topology`` at ``step``; with ``out``
    (same shape and dtype, not overlapping ``tensor``) the result goes there and ``tensor`` is
    left unchanged (DecentralizedDataParallel mixes into a second buffer: no copies).

    Every rank of the group must call it with the same topology and step (checked: a rank that
    passes another topology, step, dtype or size fails the call on every rank). Returns a Work
    when ``async_op``, else None once the tensor holds the result."""
    backend = linerate_backend(group)
    rank, size = backend.rank(), backend.size()
    if not isinstance(topology, Topology):
        raise TypeError(f"rank {rank}: neighbor_allreduce: topology must be a linerate.topology."
                        f"Topology, got {type(topology).__name__}")
    if topology.n != size:
        raise ValueError(f"rank {rank}: neighbor_allreduce: topology {topology!r} has {topology.n} "
                         f"ranks but the group has {size}")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"rank {rank}: neighbor_allreduce: step must be an int or None, got "
                            f"{step!r}")
        step = int(step)
    with _steps_lock:
        counter = _steps.get(backend, 0)
        if step is None:
            step = counter
        plan = None
        groups = topology.averaging_groups(step) if _SHM_AVERAGES else None
        if groups is not None:
            mine = next(g for g in groups if rank in g)
            if len(mine) > 1 and _host_of_exactly(backend, mine) is not None:
                plan = _average_plan(backend, mine)
        work = backend.neighbor_allreduce(tensor, topology.self_weight(rank, step),
                                          topology.in_weights(rank, step),
                                          topology.out_peers(rank, step),
                                          call=f"{topology!r} step={step}", out=out, plan=plan)
        _steps[backend] = counter + 1
    if async_op:
        return work
    work.wait()
    return None


def hierarchical_neighbor_allreduce(tensor: torch.Tensor, topology: Topology,
                                    step: int | None = None, async_op: bool = False, group=None,
                                    out: torch.Tensor | None = None):
    """Average ``tensor`` within each host, then mix the hosts' averages under ``topology`` (a
    topology of the group's H hosts: host a gets ``sum_b W[a, b] * mean(host b)``); every rank
    of a host ends with the same value. Hosts are the group's layout (ranks grouped by host,
    hosts in the order of their lowest rank; torchrun and ``linerate netlab`` place host 0's
    ranks first). ``step``, ``async_op``, ``out`` as in neighbor_allreduce (the same per-group
    step counter). Every rank of the group must call it with the same topology and step.

    With uneven hosts the rank-level matrix is not doubly stochastic (a host's average counts
    once whatever its rank count): the mean over ranks is not kept."""
    backend = linerate_backend(group)
    rank = backend.rank()
    what = "hierarchical_neighbor_allreduce"
    if not isinstance(topology, Topology):
        raise TypeError(f"rank {rank}: {what}: topology must be a linerate.topology.Topology of "
                        f"the hosts, got {type(topology).__name__}")
    hosts, _ = host_layout(backend)
    if topology.n != len(hosts):
        raise ValueError(f"rank {rank}: {what}: topology {topology!r} has {topology.n} ranks but "
                         f"the group's ranks are on {len(hosts)} host(s) "
                         f"({'+'.join(str(len(h)) for h in hosts)} ranks): pass a topology of "
                         f"the hosts")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"rank {rank}: {what}: step must be an int or None, got {step!r}")
        step = int(step)
    with _steps_lock:
        counter = _steps.get(backend, 0)
        if step is None:
            step = counter
        work = backend.neighbor_allreduce(tensor, 1.0, {}, [],
                                          call=f"hierarchical {topology!r} step={step}",
                                          out=out, plan=_hierarchical_plan(backend, topology, step))
        _steps[backend] = counter + 1
    if async_op:
        return work
    work.wait()
    return None


# ----------------------------------------------------------------------------- hosts

def host_layout(backend) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """(hosts, shared): the group's ranks grouped by host (transport/shm's layout, the same
    on every rank), and whether every host's co-located ranks share a segment."""
    lay = getattr(backend, "layout", None)
    if lay is None:
        return (tuple(range(backend.size())),), False
    return tuple(tuple(h) for h in lay.hosts), bool(lay.shared)


def _host_of_exactly(backend, ranks) -> int | None:
    """The host whose ranks are exactly ``ranks`` and share a segment, else None."""
    hosts, shared = host_layout(backend)
    if not shared:
        return None
    want = tuple(sorted(ranks))
    for h, members in enumerate(hosts):
        if members == want:
            return h
    return None


def _host_comm(comm: Comm, backend, members: tuple) -> Comm:
    """This op's view of this host's ranks ``members``, with the host's shared-memory engine
    where they share one (else None: the point-to-point algorithms run on the view)."""
    if len(members) == comm.size:          # the whole group is this host
        return comm
    sub = comm.sub(members, _TAG_HOST)
    _, shared = host_layout(backend)
    sub.shm = backend.host_engine if shared else None
    return sub


_SUM = op_type(dist.ReduceOp.SUM)


def _host_average(backend, sub: Comm, flat: torch.Tensor) -> None:
    """flat <- the mean of the view's ranks' flat (every rank the same bits)."""
    from . import algorithms
    if sub.size <= 1:
        return
    if getattr(sub, "shm", None) is not None:
        name = "shm"
    else:  # the table's size rule for the view's ranks
        name = algorithms.size_rule("all_reduce", flat.numel() * flat.element_size(), sub.size,
                                    backend.small_bytes)
    algorithms.implementation(name, "all_reduce")(sub, flat, _SUM)
    flat.mul_(1.0 / sub.size)


def _host_broadcast(sub: Comm, t: torch.Tensor, root: int) -> None:
    from . import chain, shm_algos
    if sub.size <= 1:
        return
    if getattr(sub, "shm", None) is not None:
        shm_algos.broadcast(sub, t, root)
    else:
        chain.broadcast(sub, t, root)


def _average_plan(backend, members):
    """A step that averages ``members``, the ranks of one host sharing memory: a shared-memory
    All-Reduce of the host's ranks, then / |members|."""
    members = tuple(sorted(members))

    def run(comm: Comm, flat: torch.Tensor, out: torch.Tensor | None) -> None:
        comm.algorithm = "neighbor-shm"
        dst = flat if out is None else out
        if out is not None:
            out.copy_(flat)
        _host_average(backend, _host_comm(comm, backend, members), dst)

    return run


def _bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """Share i of k of n elements: [lo, hi), the first n % k shares one element longer."""
    q, rem = divmod(n, k)
    lo = i * q + min(i, rem)
    return lo, lo + q + (1 if i < rem else 0)


def _hierarchical_plan(backend, topology: Topology, step: int):
    hosts, _ = host_layout(backend)
    me = backend.rank()
    h = next(a for a, members in enumerate(hosts) if me in members)
    members = hosts[h]
    local = members.index(me)
    k = min(len(m) for m in hosts)
    sw = topology.self_weight(h, step)
    ins = [(hosts[b][local], w) for b, w in topology.in_weights(h, step).items()] \
        if local < k else []
    outs = [hosts[c][local] for c in topology.out_peers(h, step)] if local < k else []

    def run(comm: Comm, flat: torch.Tensor, out: torch.Tensor | None) -> None:
        dst = flat if out is None else out
        if out is not None:
            out.copy_(flat)
        sub = _host_comm(comm, backend, members) if len(members) > 1 else None
        if sub is not None:
            _host_average(backend, sub, dst)
        if len(hosts) > 1:
            n = dst.numel()
            if local < k:
                lo, hi = _bounds(n, k, local)
                mix(comm, dst[lo:hi], sw, ins, outs,
                    handshake=(hi - lo) * dst.element_size() > backend.small_bytes)
            if sub is not None:
                for i in range(k):
                    lo, hi = _bounds(n, k, i)
                    _host_broadcast(sub, dst[lo:hi], i)
        comm.algorithm = "hierarchical"

    return run
