"""Algorithm settings of the backend (``LINERATE_*`` env variables), beside the transport's."""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from linerate.transport import TransportOptions, parse_size

ALLREDUCE_ALGOS = ("auto", "ring", "direct", "hd")
ROOTED_ALGOS = ("auto", "chain", "direct")


@dataclasses.dataclass
class Options:
    """Everything the ``linerate`` backend can be told; ``from_env`` reads ``LINERATE_*``."""

    transport: TransportOptions = dataclasses.field(default_factory=TransportOptions)
    #: all_reduce algorithm: auto (by size), ring (bandwidth-optimal), direct (one round),
    #: hd (halving-doubling: bandwidth-optimal in 2 log2(P) exchanges).
    allreduce_algo: str = "auto"
    #: broadcast/reduce algorithm: auto (by size), chain (pipelined), direct (root to all).
    rooted_algo: str = "auto"
    #: Messages up to this many bytes use the latency-optimal algorithms under "auto".
    small_bytes: int = 64 * 1024
    #: Pipeline granularity of ring and chain algorithms (4 MiB measured best, README).
    piece_bytes: int = 4 << 20
    #: Tensor fusion (collectives/fusion.py): all_reduces of one tensor of up to this many
    #: bytes are packed into fused all_reduces of at most this many bytes; 0 turns it off.
    fusion_bytes: int = 4 << 20
    #: How long a fusable all_reduce waits for more to fuse with, when nobody waits on it yet.
    cycle_ms: float = 1.0
    #: Priority scheduling (collectives/priority.py): a layer's gradients are all-reduced in
    #: partitions of at most this many bytes, which a more urgent layer's partitions overtake.
    partition_bytes: int = 4 << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        env = os.environ if env is None else env
        o = cls(transport=TransportOptions.from_env(env))
        if "LINERATE_ALLREDUCE_ALGO" in env:
            o.allreduce_algo = env["LINERATE_ALLREDUCE_ALGO"].strip().lower()
        if "LINERATE_ROOTED_ALGO" in env:
            o.rooted_algo = env["LINERATE_ROOTED_ALGO"].strip().lower()
        if "LINERATE_SMALL_BYTES" in env:
            o.small_bytes = parse_size(env["LINERATE_SMALL_BYTES"])
        if "LINERATE_PIECE_BYTES" in env:
            o.piece_bytes = parse_size(env["LINERATE_PIECE_BYTES"])
        if "LINERATE_FUSION_BYTES" in env:
            o.fusion_bytes = parse_size(env["LINERATE_FUSION_BYTES"])
        if "LINERATE_PARTITION_BYTES" in env:
            o.partition_bytes = parse_size(env["LINERATE_PARTITION_BYTES"])
        if "LINERATE_CYCLE_MS" in env:
            raw = env["LINERATE_CYCLE_MS"]
            try:
                o.cycle_ms = float(raw)
            except ValueError:
                raise ValueError(f"LINERATE_CYCLE_MS must be a number of milliseconds, got {raw!r}") from None
        o.validate()
        return o

    def validate(self) -> None:
        if self.allreduce_algo not in ALLREDUCE_ALGOS:
            raise ValueError(f"LINERATE_ALLREDUCE_ALGO must be one of {', '.join(ALLREDUCE_ALGOS)}, "
                             f"got {self.allreduce_algo!r}")
        if self.rooted_algo not in ROOTED_ALGOS:
            raise ValueError(f"LINERATE_ROOTED_ALGO must be one of {', '.join(ROOTED_ALGOS)}, "
                             f"got {self.rooted_algo!r}")
        if self.piece_bytes < 4096:
            raise ValueError(f"LINERATE_PIECE_BYTES must be at least 4096, got {self.piece_bytes}")
        if self.small_bytes < 0:
            raise ValueError(f"LINERATE_SMALL_BYTES must be >= 0, got {self.small_bytes}")
        if self.fusion_bytes < 0:
            raise ValueError(f"LINERATE_FUSION_BYTES must be >= 0 (0: no fusion), got {self.fusion_bytes}")
        if self.partition_bytes < 4096:
            raise ValueError(f"LINERATE_PARTITION_BYTES must be at least 4096, got {self.partition_bytes}")
        if not 0 <= self.cycle_ms <= 10_000:
            raise ValueError(f"LINERATE_CYCLE_MS must be between 0 and 10000, got {self.cycle_ms}")
        self.transport.validate()
