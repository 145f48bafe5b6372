"""What runs a group's collective: the algorithm table's choice (collectives/algorithms.py),
called with what each algorithm needs (the two-level ones: the group's plan and the engine
of its host's shared segment)."""
from __future__ import annotations

import torch

from . import algorithms
from .comm import Comm
from .reduce_ops import finish_avg


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
