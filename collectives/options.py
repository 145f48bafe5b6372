"""Algorithm settings of the backend, beside the transport's: the typed result of the
``LINERATE_*`` registry (linerate/settings.py), which declares every variable once."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from linerate import settings as _settings
from linerate.settings import ALLREDUCE_ALGOS, ROOTED_ALGOS  # noqa: F401 - this module's API
from linerate.transport.options import MetricsOptions, TransportOptions


#: Options.from_env's last parse of the process's environment: (its LINERATE_* values, Options).
_LAST: list = [None]


@dataclasses.dataclass
class Options:
    """Everything the ``linerate`` backend can be told; ``from_env`` reads ``LINERATE_*``.

    Pass one to torch as ``dist.init_process_group("linerate", pg_options=linerate.Options(...))``
    (or ``dist.new_group(backend="linerate", pg_options=...)``): the group then uses it as it
    is and reads no environment variable. Without one, a group reads ``Options.from_env()``.
    """

    transport: TransportOptions = dataclasses.field(default_factory=TransportOptions)
    #: The Prometheus exporter (one per process, started by the first group that asks).
    metrics: MetricsOptions = dataclasses.field(default_factory=MetricsOptions)
    #: all_reduce algorithm: auto (by size and layout), ring (bandwidth-optimal), direct (one
    #: round), hd (halving-doubling: bandwidth-optimal in 2 log2(P) exchanges), doubling
    #: (recursive doubling: log2(P) rounds of the whole tensor), two_level (shared memory within
    #: a host, TCP between hosts); ring, direct and two_level also for reduce_scatter and
    #: all_gather.
    allreduce_algo: str = "auto"
    #: broadcast/reduce algorithm: auto (by size and layout), chain (pipelined), direct (root
    #: to all), tree (binomial tree), two_level (shared memory within a host, TCP between hosts).
    rooted_algo: str = "auto"
    #: Messages up to this many bytes use the latency-optimal algorithms under "auto".
    small_bytes: int = 64 * 1024
    #: Pipeline granularity of ring and chain algorithms.
    piece_bytes: int = 4 << 20
    #: Two-level all_reduces of more than 16 MiB: "1" pipelined, "0" one chunk, "auto"
    #: measured (collectives/two_level.py PipeChoice).
    pipeline: str = "auto"
    #: Tensor fusion (collectives/fusion.py): all_reduces of one tensor of up to this many
    #: bytes are packed into fused all_reduces of at most this many bytes; 0 turns it off.
    fusion_bytes: int = 4 << 20
    #: How long a fusable all_reduce waits for more to fuse with, when nobody waits on it yet.
    cycle_ms: float = 1.0
    #: All_reduces of a CUDA tensor of at least ``stage_min_bytes`` (and above
    #: ``fusion_bytes``): "pipelined" through host memory in chunks, the device copies beside
    #: the exchange (collectives/pipeline.py), or "whole" (one staged copy each way).
    staging: str = "pipelined"
    #: The chunk of pipelined staging, and the size of each of its pinned host buffers.
    stage_chunk_bytes: int = 4 << 20
    #: CUDA all_reduces of at least this many bytes are pipelined (smaller ones: one copy).
    stage_min_bytes: int = 8 << 20
    #: Pinned host buffers a group keeps for pipelined staging (made by its first such op).
    stage_buffers: int = 3
    #: Priority scheduling (collectives/priority.py): a layer's gradients are all-reduced in
    #: partitions of at most this many bytes, which a more urgent layer's partitions overtake.
    partition_bytes: int = 4 << 20
    #: Write a Chrome trace per rank to this path (collectives/timeline.py); empty: off.
    timeline: str = ""
    #: Flight recorder (collectives/flight.py): the last this many collectives of each group
    #: are kept and written out when one times out; 0 turns it off.
    flight_entries: int = 2000
    #: Where each rank writes its flight recorder on a timeout (``{rank}`` replaced, else
    #: ``.rank<R>.json`` appended); empty: ``linerate-flight`` in the temporary folder.
    flight_dump: str = ""
    #: Slow ranks (collectives/straggler.py): a rank that enters collectives at least this many
    #: milliseconds after the others, in most of the recent ones, is named the slowest.
    slow_rank_ms: float = 5.0
    #: Log a warning naming a persistently late rank or slow link at most once per this many
    #: seconds; 0: no log line.
    slow_log_s: float = 0.0
    #: Slow links (transport/slowlink.py): a TCP connection whose rate while sending stays
    #: below this share of its siblings' median is named slow; 0: none is.
    slow_link_ratio: float = 0.6

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        """The defaults, then every ``LINERATE_*`` variable set in ``env`` (default: this
        process's environment); a bad value raises a ValueError naming the variable and what it
        accepts. From the process's environment, the options parsed last are reused (a copy)
        while no ``LINERATE_*`` variable changed: parsing and checking every setting would be a
        sizeable share of a small group's set-up CPU."""
        key = _settings.env_values() if env is None else None
        last = _LAST[0]
        if key is not None and last is not None and last[0] == key:
            return last[1].copy()
        o = cls(transport=TransportOptions.from_env(env), metrics=MetricsOptions.from_env(env))
        _settings.fill(o, "", env)
        _settings.validate(o, "")  # its parts were checked as they were read
        if key is not None:
            _LAST[0] = (key, o.copy())
        return o

    def copy(self) -> "Options":
        """A copy whose parts (transport, metrics) are copies too."""
        return dataclasses.replace(self, transport=dataclasses.replace(self.transport),
                                   metrics=dataclasses.replace(self.metrics))

    def agreed(self) -> dict:
        """The collective settings every rank of a group must share (compared at group
        creation, beside the transport's: a difference fails it naming the setting). Ranks
        that chose algorithms, cut pieces or fused calls differently would wait for each other
        until the timeout."""
        return {"LINERATE_PIPELINE": self.pipeline,
                "LINERATE_ALLREDUCE_ALGO": self.allreduce_algo,
                "LINERATE_ROOTED_ALGO": self.rooted_algo,
                "LINERATE_SMALL_BYTES": self.small_bytes,
                "LINERATE_PIECE_BYTES": self.piece_bytes,
                "LINERATE_FUSION_BYTES": self.fusion_bytes,
                "LINERATE_STAGING": self.staging,
                "LINERATE_STAGE_CHUNK_BYTES": self.stage_chunk_bytes,
                "LINERATE_STAGE_MIN_BYTES": self.stage_min_bytes}

    def validate(self) -> None:
        if not isinstance(self.transport, TransportOptions):
            raise TypeError(f"Options.transport must be a TransportOptions, got {type(self.transport).__name__}")
        if not isinstance(self.metrics, MetricsOptions):
            raise TypeError(f"Options.metrics must be a MetricsOptions, got {type(self.metrics).__name__}")
        _settings.validate(self, "")
        self.transport.validate()
        self.metrics.validate()
