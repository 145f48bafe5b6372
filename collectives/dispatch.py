"""What runs a group's collective: the algorithm table's choice (collectives/algorithms.py),
called with what each algorithm needs (the two-level ones: the group's plan and the engine
of its host's shared segment).

This is the only place between the process-group adapter and the algorithms: the adapter
(collectives/backend.py) and the runner (collectives/runner.py, which decides how a call runs:
plain, fused, lone, chained or prioritized) ask it, and never name an algorithm's module. It
builds what the algorithms of one group keep (the shared-memory engines, the two-level plan),
picks the fusion agreement's algorithm from the same table, and offers the lone small calls
of a one-host group where the table gives them the shared segment."""
from __future__ import annotations

import torch

from linerate.transport.shm.engine import Engine

from . import algorithms, fusion, shm_algos, two_level
from .comm import Comm
from .reduce_ops import finish_avg


class _WorkerView:
    """What the table reads of a Comm (``choose``) when no op runs yet: the group's worker."""
    worker = True


WORKER = _WorkerView()


class Dispatch:
    """One group's algorithms: ``run(comm, op, nbytes, *args)`` runs ``op`` by the table's
    choice and names the algorithm it took."""

    def __init__(self, options, shape: algorithms.Shape, plan, shm, local):
        self.options = options
        self.shape = shape
        #: The two-level algorithms' columns (collectives/two_level.py), where they can run.
        self.plan = plan
        #: The engine of the whole group's shared segment (one host), and of this host's
        #: ranks where the group spans hosts (collectives/shm_algos.py); None where none.
        self.shm = shm
        self.local = local
        #: Where the table runs the fusion agreement, and so the lone calls: the group's
        #: segment (one host, "shm"), a flat group's links ("direct"), or neither.
        self._agree = self.choose(WORKER, "agree", 0)
        self._lone_on_segment = on_seg = shm is not None and self._agree == "shm"
        #: The lone calls' runs (collectives/runner.py ``_run_lone``), chosen here once: a
        #: synchronous all_reduce's fused run of its one call, ``(comm, chain, t, op, desc)``
        #: (on the segment: shm_algos.lone_all_reduce, else over the links:
        #: fusion.lone_all_reduce), and a synchronous barrier's on the segment, ``(comm)``
        #: (None over the links: the table's, ``run(comm, "barrier", 0)``). Module functions:
        #: a bound method of this object kept on it would make a cycle for the collector.
        self.lone_all_reduce = shm_algos.lone_all_reduce if on_seg else fusion.lone_all_reduce
        self.lone_barrier = shm_algos.barrier if on_seg else None

    @classmethod
    def for_group(cls, options, layout, rank: int, size: int, seg) -> "Dispatch":
        """The algorithms of one group: its shape (from the ``layout`` learnt at rendezvous),
        the shared-memory engine of the group's segment (every rank on this host) or of this
        host's ranks (the group spans hosts), and the two-level plan where it can run."""
        cma = options.transport.cma
        shm = Engine(seg, cma) if seg is not None and seg.size == size else None
        local = Engine(seg, cma) if seg is not None and seg.size < size else None
        shape = algorithms.Shape(size, layout.hosts, layout.shared)
        plan = two_level.Plan(layout.hosts, rank, options.pipeline) if shape.two_level_ok else None
        return cls(options, shape, plan, shm, local)

    def close(self) -> None:
        if self.plan is not None:
            self.plan.close()

    def choose(self, comm, op: str, nbytes: int, allreduce_algo: str | None = None) -> str:
        """The algorithm for this op (collectives/algorithms.py, the one table)."""
        o = self.options
        return algorithms.choose(op, nbytes, self.shape,
                                 allreduce_algo=allreduce_algo or o.allreduce_algo,
                                 rooted_algo=o.rooted_algo, small_bytes=o.small_bytes,
                                 worker=comm.worker)

    def run(self, comm: Comm, op: str, nbytes: int, *args, algo: str | None = None) -> str:
        """Run ``op`` by the table's choice (``choose`` names the algorithm,
        ``algorithms.implementation`` gives its function); returns the algorithm's name."""
        name = self.choose(comm, op, nbytes, algo)
        self.call(name, op, comm, *args)
        return name

    def call(self, name: str, op: str, comm: Comm, *args) -> None:
        fn = algorithms.implementation(name, op)
        if name == "two_level":
            fn(comm, *args, self.plan, self.host_engine(), self.options.small_bytes)
        else:
            fn(comm, *args)

    def host_engine(self):
        """The engine of the two-level algorithms' local phases."""
        return self.local if self.local is not None else self.shm

    # ------------------------------------------------------------------ fusion
    def carry_bytes(self, how: str) -> int:
        """Up to how many bytes the head call of a fused run travels with the agreement and
        is reduced there (``how``: the agreement's algorithm), which is that algorithm's own
        all_reduce: none where LINERATE_ALLREDUCE_ALGO forces another (the forced algorithm
        then runs every call, as the table says)."""
        algo = self.options.allreduce_algo
        if algo in ("auto", "two_level") or (algo == "direct" and how == "direct"):
            return self.options.small_bytes
        return 0

    def agree(self, comm: Comm, entries: list, offered: int) -> tuple[int, bool, str]:
        """How many of the ``offered`` fusion entries every rank fuses (collectives/fusion.py
        ``agree``, by the table's algorithm for it), whether the head entry was reduced along,
        and the agreement's algorithm."""
        how = self.choose(comm, "agree", 0)
        carry = self.carry_bytes(how)
        if how == "two_level":
            k, done = two_level.agree(comm, entries, offered, carry, self.plan, self.host_engine())
        else:
            k, done = (shm_algos if how == "shm" else fusion).agree(comm, entries, offered, carry)
        return k, done, how

    def lone_ok(self, size: int) -> bool:
        """Whether a synchronous barrier that finds nothing queued may run the lone way
        (``lone_barrier``): where the lone all_reduces run (one host's shared segment, or
        a flat group's links)."""
        return size > 1 and (self._lone_on_segment or self._agree == "direct")

    def lone_max(self, size: int) -> int:
        """Up to how many bytes a synchronous all_reduce that finds nothing queued runs the
        lone way (``lone_all_reduce``): what the fusion agreement carries, where the table
        gives it to the segment of one host's ranks or to the links of a flat group (0:
        none; a two-level group agrees in two rounds, and a forced algorithm carries
        nothing)."""
        if size <= 1:
            return 0
        if self._lone_on_segment:
            return min(self.options.fusion_bytes, self.carry_bytes("shm"), self.shm.C - 64)
        if self._agree == "direct":
            return min(self.options.fusion_bytes, self.carry_bytes("direct"))
        return 0

    # ------------------------------------------------------------------ ops with glue
    def all_reduce(self, comm: Comm, flat: torch.Tensor, op, algo: str) -> None:
        self.run(comm, "all_reduce", flat.numel() * flat.element_size(), flat, op, algo=algo)
        finish_avg(flat, op, comm.size)

    def rooted(self, comm: Comm, op: str, t: torch.Tensor, *args) -> None:
        """broadcast(comm, t, root) / reduce(comm, t, op, root)."""
        self.run(comm, op, t.numel() * t.element_size(), t, *args)

    def all_gather(self, comm: Comm, src: torch.Tensor, segs: list[torch.Tensor]) -> None:
        segs[comm.rank].copy_(src)
        total = sum(s.numel() for s in segs) * src.element_size()
        self.run(comm, "all_gather", total, segs)

    def reduce_scatter(self, comm: Comm, segs: list[torch.Tensor], out: torch.Tensor, op) -> None:
        """``segs`` are the caller's inputs (read only here)."""
        numel = sum(s.numel() for s in segs)
        name = self.choose(comm, "reduce_scatter", numel * out.element_size())
        if name != "ring":
            if any(s.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for s in segs):
                segs = [s.clone() for s in segs]    # out is written while segs are still read
            self.call(name, "reduce_scatter", comm, segs, out, op)
        else:
            # The ring reduces in place: work on a private copy, in reused scratch memory
            # (a fresh buffer per call would pay its page faults every time).
            flat = comm.scratch.get(2, numel, out.dtype)
            mine, off = [], 0
            for s in segs:
                mine.append(flat[off:off + s.numel()])
                mine[-1].copy_(s)
                off += s.numel()
            self.call("ring", "reduce_scatter", comm, mine, op)
            out.copy_(mine[comm.rank])
        finish_avg(out, op, comm.size)
