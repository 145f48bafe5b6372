"""What a collective reports to linerate's metrics: its canonical name, its size and its bus
bandwidth factor (nccl-tests' definitions, so that busbw compares with the link rate)."""
from __future__ import annotations

from linerate.transport import metrics

#: busbw = algbw * factor(world); algbw = size / time, size as nccl-tests counts it.
_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "barrier": lambda n: 0.0,
}


def canonical(op: str) -> str:
    """The metrics name of an op: coalesced variants count as their op."""
    return op[:-len("_coalesced")] if op.endswith("_coalesced") else op


def bus_factor(op: str, world: int) -> float:
    f = _FACTORS.get(canonical(op))
    return f(world) if f is not None and world > 0 else 0.0


def message_bytes(op: str, result: list, world: int) -> int:
    """nccl-tests' size from the tensors a Work returns: the whole buffer of gathers,
    scatters and all-to-all, the tensor of the others."""
    n = 0
    for t in result:
        if isinstance(t, (list, tuple)):
            n += sum(x.numel() * x.element_size() for x in t)
        else:
            n += t.numel() * t.element_size()
    if canonical(op) in ("reduce_scatter", "scatter"):
        n *= world  # result is this rank's share
    return n


def record(op: str, algorithm: str, nbytes: int, seconds: float, world: int) -> None:
    if metrics.enabled():
        name = canonical(op)
        metrics.record_collective(name, algorithm, nbytes, seconds, bus_factor(name, world))
