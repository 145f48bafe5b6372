"""The collectives ``linerate bench`` measures: buffers, the call, nccl-tests' bus bandwidth
factor, and the expected result for ``--check``.

Sizes follow nccl-tests: for all_gather, reduce_scatter and all_to_all the size is the whole
(gathered / scattered) buffer, so its element count is a multiple of the world size.
Check data is integer valued and small (at most 7 per rank), so sums are exact in every dtype
up to 36 ranks (bfloat16 holds integers exactly up to 256).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from linerate.collectives.stats import bus_factor

# torch 2.13 renamed the tensor forms; keep working with the older names (torch >= 2.4).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _index(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.int64)


def _addends(start: int, count: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank contributes to a reduction at global indices [start, start + count)."""
    return (_index(start, count) % 5 + rank % 3 + 1).to(dtype)


def _sums(start: int, count: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """The SUM over all ranks of _addends, in closed form."""
    rank_part = sum(r % 3 for r in range(world))
    return ((_index(start, count) % 5 + 1) * world + rank_part).to(dtype)


def _tagged(start: int, count: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Data owned by rank at global indices [start, start + count), telling ranks apart."""
    return (_index(start, count) % 7 + 8 * rank).to(dtype)


class Collective(ABC):
    name: str
    #: The element count must be a multiple of the world size.
    split = False

    def bus_factor(self, world: int) -> float:
        """busbw = algbw * bus_factor (nccl-tests' definitions, shared with the metrics)."""
        return bus_factor(self.name, world)

    @abstractmethod
    def buffers(self, count: int, dtype: torch.dtype, rank: int, world: int):
        """(input, output) for one rank; they may be the same tensor (in place)."""

    @abstractmethod
    def run(self, inp: torch.Tensor, out: torch.Tensor, group) -> None:
        """One call of the collective on group."""

    @abstractmethod
    def expected(self, count: int, dtype: torch.dtype, rank: int, world: int) -> torch.Tensor:
        """What ``out`` holds after the first call on fresh buffers."""

    def count_wrong(self, out: torch.Tensor, count: int, rank: int, world: int) -> int:
        want = self.expected(count, out.dtype, rank, world)
        return int((out != want).sum())


class AllReduce(Collective):
    name = "all_reduce"

    def buffers(self, count, dtype, rank, world):
        t = _addends(0, count, rank, dtype)
        return t, t

    def run(self, inp, out, group):
        dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group)

    def expected(self, count, dtype, rank, world):
        return _sums(0, count, world, dtype)


class AllGather(Collective):
    name = "all_gather"
    split = True

    def buffers(self, count, dtype, rank, world):
        chunk = count // world
        return _tagged(rank * chunk, chunk, rank, dtype), torch.empty(count, dtype=dtype)

    def run(self, inp, out, group):
        _all_gather_single(out, inp, group=group)

    def expected(self, count, dtype, rank, world):
        chunk = count // world
        return torch.cat([_tagged(r * chunk, chunk, r, dtype) for r in range(world)])


class ReduceScatter(Collective):
    name = "reduce_scatter"
    split = True

    def buffers(self, count, dtype, rank, world):
        return _addends(0, count, rank, dtype), torch.empty(count // world, dtype=dtype)

    def run(self, inp, out, group):
        _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group)

    def expected(self, count, dtype, rank, world):
        chunk = count // world
        return _sums(rank * chunk, chunk, world, dtype)


class Broadcast(Collective):
    name = "broadcast"
    root = 0

    def buffers(self, count, dtype, rank, world):
        t = _tagged(0, count, rank, dtype) if rank == self.root else torch.zeros(count, dtype=dtype)
        return t, t

    def run(self, inp, out, group):
        dist.broadcast(inp, src=self.root, group=group)

    def expected(self, count, dtype, rank, world):
        return _tagged(0, count, self.root, dtype)


class AllToAll(Collective):
    name = "all_to_all"
    split = True

    def buffers(self, count, dtype, rank, world):
        return _tagged(0, count, rank, dtype), torch.empty(count, dtype=dtype)

    def run(self, inp, out, group):
        dist.all_to_all_single(out, inp, group=group)

    def expected(self, count, dtype, rank, world):
        # Chunk j of the output is chunk `rank` of rank j's input.
        chunk = count // world
        return torch.cat([_tagged(rank * chunk, chunk, j, dtype) for j in range(world)])


OPS: dict[str, Collective] = {op.name: op for op in
                              (AllReduce(), AllGather(), ReduceScatter(), Broadcast(), AllToAll())}


def element_count(op: Collective, size_bytes: int, elem_bytes: int, world: int) -> int:
    """Elements for a nominal size: rounded down to a multiple of the world size for split ops."""
    count = size_bytes // elem_bytes
    if op.split:
        count -= count % world
    return count
