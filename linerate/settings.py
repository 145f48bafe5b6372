"""Every ``LINERATE_*`` environment variable, declared once.

Each :class:`Setting` names its variable, how a value is parsed and checked, its default, one
line of doc, its scope (``transport``, ``collectives``, ``metrics``, ``rdma``, ``tools``,
``docker``) and a phrase saying what it accepts. A bad value raises a ``ValueError`` that names
the variable and that phrase.

The settings of a process group are parsed once, when the group is created:
``linerate.Options.from_env()`` (which ``create_process_group`` calls when it is given no
``linerate.Options`` through ``pg_options``) fills the typed dataclasses ``Options`` /
``TransportOptions`` / ``MetricsOptions`` from this registry, through each setting's ``field``.
The few process-wide settings (the shared I/O pool's size, where pyverbs is loaded from, the log
level, the netlab tools' state) are read here too, by :func:`read`. Nothing outside this module
reads ``os.environ`` for a ``LINERATE_*`` name (tests/test_settings.py checks it).

``python -m linerate.settings --page`` writes the documentation's settings reference
(docs/settings.md: every variable with its default, what it accepts and what it does, from this
registry and ``DETAILS``; tests/test_docs.py checks the page is what this writes), and
``python -m linerate.settings`` prints the registry as one markdown table.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Iterator, Mapping

__all__ = ["Setting", "SETTINGS", "read", "raw", "is_set", "parse", "check", "fields", "fill",
           "parse_size", "parse_rate", "parse_capacity", "parse_port_range", "markdown_table",
           "ALLREDUCE_ALGOS", "ROOTED_ALGOS", "TRANSPORTS", "LOG_LEVELS"]

ALLREDUCE_ALGOS = ("auto", "ring", "direct", "hd", "doubling", "two_level")
ROOTED_ALGOS = ("auto", "chain", "direct", "tree", "two_level")
TRANSPORTS = ("tcp", "rdma", "auto")
#: LINERATE_LOG_LEVEL's values ("": leave the level to the process's logging configuration).
LOG_LEVELS = ("", "DEBUG", "INFO", "WARNING", "ERROR")


# ============================================================================ value parsers
_SIZE_SUFFIXES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
                  "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
                  "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """Parse ``"512K"``, ``"4MB"``, ``"1048576"`` into a byte count (binary multiples)."""
    s = str(text).strip().lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = s[len(digits):]
    if suffix not in _SIZE_SUFFIXES or not digits:
        raise ValueError(f"cannot parse size {text!r}: expected a number with an optional K/M/G suffix")
    try:
        value = float(digits)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}: expected a number with an optional "
                         f"K/M/G suffix") from None
    if not math.isfinite(value):
        raise ValueError(f"cannot parse size {text!r}: not a finite number")
    return int(value * _SIZE_SUFFIXES[suffix])


_RATE_UNITS = {  # tc's units: bit-based and byte-based (bps = bytes per second)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 (bits per second), tc's units; a bare number is bit/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m:
        raise ValueError(f"bad rate {text!r} (e.g. 1gbit, 200mbit)")
    unit = m.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"bad rate unit {m.group(2)!r} in {text!r} (bit, kbit, mbit, gbit, ...)")
    bps = int(float(m.group(1)) * _RATE_UNITS[unit])
    if bps < 8000:
        raise ValueError(f"rate {text!r} too small")
    return bps


def parse_capacity(text: str) -> dict[str, float]:
    """LINERATE_LINK_CAPACITY: ``"10gbit"`` (every interface, key ``*``) or
    ``"eth0=10gbit,eth1=25gbit"``, as bytes per second by interface name."""
    out: dict[str, float] = {}
    raw = str(text).strip()
    if not raw:
        return out
    for item in raw.split(","):
        item = item.strip()
        name, _, rate = item.rpartition("=")
        try:
            out[name.strip() or "*"] = parse_rate(rate) / 8.0
        except ValueError as e:
            raise ValueError(f"{item!r}: {e}") from None
    return out


def _bool(text: str) -> bool:
    s = text.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"cannot parse boolean {text!r}")


def _int(text: str) -> int:
    return int(text.strip())


def _number(text: str) -> float:
    return float(text.strip())


def _nsocks(text: str) -> int:
    s = text.strip().lower()
    return 0 if s == "auto" else int(s)


def _word(text: str) -> str:
    return text.strip().lower()


def _text(text: str) -> str:
    return text.strip()


def _port_or_off(text: str) -> int:
    s = text.strip()
    return int(s) if s else 0


def _gid_index(text: str) -> int:
    s = text.strip()
    return int(s) if s else -1


def _log_level(text: str) -> str:
    return text.strip().upper()


def parse_port_range(text: str) -> tuple[int, int] | None:
    """LINERATE_PORT_RANGE: ``"20000-20100"`` -> (20000, 20100), both ends included; empty:
    None (any free port). A malformed range raises ValueError."""
    s = str(text).strip()
    if not s:
        return None
    m = re.fullmatch(r"(\d{1,5})\s*-\s*(\d{1,5})", s)
    if not m:
        raise ValueError(f"bad port range {text!r}: expected LOW-HIGH, e.g. 29600-29700")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"bad port range {text!r}: expected 1 <= LOW <= HIGH <= 65535")
    return lo, hi


def _port_range(text: str) -> str:
    r = parse_port_range(text)
    return "" if r is None else f"{r[0]}-{r[1]}"


def _optional_int(text: str) -> int | None:
    s = text.strip()
    return int(s) if s else None


# ============================================================================ checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    """An integer with lo <= v < hi."""
    return lambda v: _is_int(v) and lo <= v < hi


def _duration(zero_ok: bool = False, limit: float = 1e9) -> Callable[[Any], bool]:
    """A finite number of seconds (or ms) > 0 (>= 0 with zero_ok) and <= limit: nan and inf fail."""
    return lambda v: (_is_num(v) and math.isfinite(v) and (v > 0 or (zero_ok and v == 0))
                      and v <= limit)


def _one_of(choices) -> Callable[[Any], bool]:
    return lambda v: v in choices


def _is_str(v) -> bool:
    return isinstance(v, str)


def _parses(parse: Callable[[str], Any]) -> Callable[[Any], bool]:
    """A string that ``parse`` accepts (raises no ValueError)."""
    def ok(v) -> bool:
        if not isinstance(v, str):
            return False
        try:
            parse(v)
        except ValueError:
            return False
        return True
    return ok


_capacity_ok = _parses(parse_capacity)
_port_range_ok = _parses(parse_port_range)


# ============================================================================ the registry
@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``LINERATE_*`` variable."""

    name: str
    #: str -> value (raises ValueError, TypeError or OverflowError on text it cannot read).
    convert: Callable[[str], Any]
    #: value -> bool: whether a value (parsed, or set on an options object) is allowed.
    ok: Callable[[Any], bool]
    default: Any
    #: How the documentation states the default: a value ``convert`` reads back to ``default``,
    #: or a description in parentheses (or a word such as ``hostname``) where it is no value.
    default_text: str
    #: What a value may be (the error messages say "expected <accepts>").
    accepts: str
    doc: str
    scope: str
    #: The attribute of ``linerate.Options`` it fills (dotted: ``transport.nsocks``), or None for
    #: a setting that is no group's (the tools', docker compose's, the pyverbs loader's).
    field: str | None = None

    def parse(self, text: str):
        """Parse one value; a bad one raises a ValueError naming the variable."""
        try:
            value = self.convert(text)
        except (ValueError, TypeError, OverflowError):
            value = _BAD
        if value is _BAD or not self.ok(value):
            raise ValueError(f"{self.name}={text!r}: expected {self.accepts}") from None
        return value

    def check(self, value, where: str | None = None) -> None:
        """Check a value set on an options object; a bad one raises a ValueError naming the
        variable (and the options field)."""
        if not self.ok(value):
            at = f" (Options.{where or self.field})" if (where or self.field) else ""
            raise ValueError(f"{self.name}{at}: expected {self.accepts}, got {value!r}")

    def read(self, env: Mapping[str, str] | None = None):
        """The value in ``env`` (default: this process's environment), or the default."""
        text = raw(self.name, env)
        return self.default if text is None else self.parse(text)


_BAD = object()
_SIZE = "a byte count with an optional K/M/G suffix (binary)"


def _S(name, convert, ok, default, default_text, accepts, doc, scope, field=None) -> Setting:
    return Setting(name, convert, ok, default, default_text, accepts, doc, scope, field)


_ALL = [
    # ---------------------------------------------------------------- transport
    _S("LINERATE_NSOCKS", _nsocks, _int_in(0, 65), 0, "auto",
       "an integer from 1 to 64, or auto (or 0)",
       "TCP connections per peer per interface; auto: 2 with one interface, 1 per interface "
       "with several, and 1 to a rank of another host where hosts hold several ranks of the "
       "group (two-level: their columns already run side by side)", "transport",
       "transport.nsocks"),
    _S("LINERATE_SOCKET_IFNAME", _text, _is_str, "", "(route to `MASTER_ADDR`)",
       "comma-separated interface names (empty: the interface that routes to MASTER_ADDR)",
       "comma-separated interfaces to use; several = multi-rail", "transport",
       "transport.socket_ifname"),
    _S("LINERATE_CHUNK_BYTES", parse_size, _int_in(4096, 1 << 32), 1 << 20, "1M",
       f"{_SIZE}, from 4K to below 4G", "bytes per chunk striped over the connections",
       "transport", "transport.chunk_bytes"),
    _S("LINERATE_CONNECT_TIMEOUT", _number, _duration(), 300.0, "300",
       "a finite number of seconds > 0", "seconds to build the connection mesh of a group",
       "transport", "transport.connect_timeout"),
    _S("LINERATE_LINK_TIMEOUT", _number, _duration(zero_ok=True), 60.0, "60",
       "a finite number of seconds > 0, or 0 (the kernel's defaults)",
       "seconds a peer may leave sent data unacknowledged before its connections fail",
       "transport", "transport.link_timeout"),
    _S("LINERATE_MAX_UNEXPECTED_BYTES", parse_size, _int_in(0, 1 << 62), 1 << 34, "16G",
       _SIZE, "largest message a peer may send before its receive is posted", "transport",
       "transport.max_unexpected_bytes"),
    _S("LINERATE_KEEP_BYTES", parse_size, _int_in(0, 1 << 62), 64 << 20, "64M", _SIZE,
       "buffers a group keeps for reuse between operations (staging, and scratch); beyond it "
       "memory is given back when an operation ends", "transport", "transport.keep_bytes"),
    _S("LINERATE_PREFER_IPV6", _bool, _one_of((True, False)), False, "0",
       "1/0, true/false, yes/no or on/off",
       "with LINERATE_SOCKET_IFNAME, use the interfaces' global IPv6 addresses", "transport",
       "transport.prefer_ipv6"),
    _S("LINERATE_CHECKSUM", _bool, _one_of((True, False)), False, "0",
       "1/0, true/false, yes/no or on/off",
       "a CRC-32 after every chunk, checked on receipt (every rank must agree)", "transport",
       "transport.checksum"),
    _S("LINERATE_CREDIT_BYTES", parse_size, _int_in(0, 1 << 31), 0, "0",
       f"{_SIZE}, from 0 to below 2G (0: the kernel's buffer size)",
       "credit window of priority scheduling (TCP_NOTSENT_LOWAT) per connection", "transport",
       "transport.credit_bytes"),
    _S("LINERATE_TRANSPORT", _word, _one_of(TRANSPORTS), "tcp", "tcp",
       "one of " + ", ".join(TRANSPORTS),
       "the transport between hosts: tcp, rdma or auto (every rank must agree)",
       "transport", "transport.transport"),
    _S("LINERATE_CONNECT", _word, _one_of(("lazy", "eager")), "lazy", "lazy", "lazy or eager",
       "when TCP links are made: lazy (a peer's link when this rank first sends to it, "
       "receives from it or reports to it) or eager (to every peer at group creation); every "
       "rank must agree", "transport", "transport.connect"),
    _S("LINERATE_RAIL_SPREAD", _word, _one_of(("auto", "0")), "auto", "auto", "auto or 0",
       "with several rails (LINERATE_SOCKET_IFNAME) and co-located ranks that share memory: "
       "auto spreads a host's rails over its local ranks (local rank i's links to other hosts "
       "use rail i mod R; with fewer local ranks than rails, every L-th rail from i), as NCCL "
       "gives each GPU its nearest NIC; 0: every link stripes over every rail; every rank must "
       "agree", "transport", "transport.rail_spread"),
    _S("LINERATE_CMA", _word, _one_of(("auto", "0", "1")), "auto", "auto", "auto, 0 or 1",
       "cross-memory attach between the ranks of one host that share memory, for all_reduces "
       "of 1 MiB or more (each rank reads the peers' tensors with process_vm_readv: one copy "
       "per byte, nothing staged in the shared segment), where every rank of the host may "
       "(probed once per group; else the copies through the segment): auto tries both and "
       "takes the one measured faster, 1 always (where every rank has 1), 0 never (one rank "
       "with 0 turns it off for its host)", "transport", "transport.cma"),
    _S("LINERATE_IO", _word, _one_of(("threads", "shared", "auto")), "threads", "threads",
       "threads, shared or auto",
       "the I/O model of the plain TCP connections, one for every link of the process: "
       "threads (the default; auto is the same) gives each connection a sender and a "
       "receiver thread; shared drives them all from a process-wide pool of "
       "LINERATE_IO_THREADS epoll threads, so threads per rank do not grow with peers or "
       "groups; TLS and RDMA streams always have their threads; ranks may differ",
       "transport", "transport.io"),
    _S("LINERATE_IO_THREADS", _int, _int_in(1, 65), 2, "2", "an integer from 1 to 64",
       "I/O threads of the process-wide pool that drives the TCP connections under "
       "LINERATE_IO=shared (read when the first such link starts)", "transport"),
    _S("LINERATE_SHM", _word, _one_of(("auto", "0", "1")), "auto", "auto",
       "auto, 0 or 1",
       "shared memory between the ranks of one host (one segment per host of a group): auto "
       "(where every host's co-located ranks can map theirs), 1 (co-located ranks must share "
       "memory: group creation fails naming the ranks that cannot), 0 (off); every rank must "
       "agree", "transport", "transport.shm"),
    _S("LINERATE_PORT_RANGE", _port_range, _port_range_ok, "", "(any free port)",
       "LOW-HIGH: TCP ports from 1 to 65535, LOW <= HIGH, both included (empty: any free "
       "port)",
       "the ports linerate's listening sockets bind to (each rank's TCP listeners, one per "
       "interface, and the receivers of `linerate bench --raw`'s link probe), for firewalls "
       "that open only a range; ranks need not agree", "transport", "transport.port_range"),
    _S("LINERATE_TLS", _bool, _one_of((True, False)), False, "0",
       "1/0, true/false, yes/no or on/off",
       "TLS 1.3 with mutual authentication on every TCP connection (every rank must agree; "
       "not with LINERATE_TRANSPORT=rdma)", "transport", "transport.tls"),
    _S("LINERATE_TLS_CERT", _text, _is_str, "", "(none)",
       "a PEM file path (needed with LINERATE_TLS=1)",
       "this rank's certificate, signed by the CA of LINERATE_TLS_CA", "transport",
       "transport.tls_cert"),
    _S("LINERATE_TLS_KEY", _text, _is_str, "", "(none)",
       "a PEM file path of an unencrypted private key (needed with LINERATE_TLS=1)",
       "the private key of LINERATE_TLS_CERT", "transport", "transport.tls_key"),
    _S("LINERATE_TLS_CA", _text, _is_str, "", "(none)",
       "a PEM file path (needed with LINERATE_TLS=1)",
       "the CA certificate(s) a peer's certificate must chain to", "transport",
       "transport.tls_ca"),
    _S("LINERATE_RDMA_DEVICE", _text, _is_str, "", "(first active port)",
       "RDMA ports as dev[:port], comma separated (empty: the first active port)",
       "RDMA ports to use (several = rails)", "rdma", "transport.rdma_device"),
    _S("LINERATE_RDMA_GID_INDEX", _gid_index, _int_in(-1, 1 << 16), -1, "(auto)",
       "a GID table index (0, 1, ...; -1 or empty: chosen automatically)",
       "RoCE GID table index", "rdma", "transport.rdma_gid_index"),
    _S("LINERATE_PYVERBS_PATH", _text, _is_str, "", "(system folders)",
       "a folder that holds the pyverbs package, or several separated by ':' (empty: the "
       "system folders)",
       "a folder holding rdma-core's pyverbs package (read when pyverbs is first loaded)",
       "rdma"),
    # ---------------------------------------------------------------- collectives
    _S("LINERATE_PIECE_BYTES", parse_size, _int_in(4096, 1 << 62), 4 << 20, "4M",
       f"{_SIZE}, at least 4K", "pipeline granularity of the ring and chain algorithms",
       "collectives", "piece_bytes"),
    _S("LINERATE_PIPELINE", _word, _one_of(("auto", "0", "1")), "auto", "auto", "auto, 0 or 1",
       "two-level all_reduces of more than 16 MiB: 1 pipelined (8 MiB chunks, each one's "
       "inter-host phase beside the others' local phases), 0 one chunk (local, inter-host, "
       "local in turn), auto pipelined where the group is link-bound (under 250 MB/s of tensor "
       "per second), else both tried and the faster kept (measured, agreed by every rank); "
       "every rank must agree", "collectives", "pipeline"),
    _S("LINERATE_SMALL_BYTES", parse_size, _int_in(0, 1 << 62), 64 << 10, "64K",
       f"{_SIZE}, 0 or more", "messages up to this size use the one-round algorithms under auto",
       "collectives", "small_bytes"),
    _S("LINERATE_ALLREDUCE_ALGO", _word, _one_of(ALLREDUCE_ALGOS), "auto", "auto",
       "one of " + ", ".join(ALLREDUCE_ALGOS), "the all_reduce algorithm (ring, direct and "
       "two_level also for reduce_scatter and all_gather); forced where it can run",
       "collectives",
       "allreduce_algo"),
    _S("LINERATE_ROOTED_ALGO", _word, _one_of(ROOTED_ALGOS), "auto", "auto",
       "one of " + ", ".join(ROOTED_ALGOS), "the broadcast/reduce algorithm; forced where it "
       "can run", "collectives",
       "rooted_algo"),
    _S("LINERATE_FUSION_BYTES", parse_size, _int_in(0, 1 << 62), 4 << 20, "4M",
       f"{_SIZE}, 0 or more (0: no fusion)", "tensor fusion: largest fused all_reduce",
       "collectives", "fusion_bytes"),
    _S("LINERATE_CYCLE_MS", _number, _duration(zero_ok=True, limit=10_000), 1.0, "1",
       "a finite number of milliseconds from 0 (no wait) to 10000",
       "how long a fusable all_reduce waits for more to fuse with", "collectives", "cycle_ms"),
    _S("LINERATE_STAGING", _word, _one_of(("pipelined", "whole")), "pipelined", "pipelined",
       "pipelined or whole",
       "how an all_reduce of a CUDA tensor of at least LINERATE_STAGE_MIN_BYTES moves through "
       "host memory: pipelined (in chunks, the device copies on side streams beside the "
       "exchange) or whole (one copy of the whole tensor each way, as the other collectives of "
       "CUDA tensors); every rank must agree", "collectives", "staging"),
    _S("LINERATE_STAGE_CHUNK_BYTES", parse_size, _int_in(4096, 1 << 40), 4 << 20, "4M",
       f"{_SIZE}, from 4K to below 1T",
       "chunk of pipelined staging, and the size of each of its pinned host buffers; every "
       "rank must agree", "collectives", "stage_chunk_bytes"),
    _S("LINERATE_STAGE_MIN_BYTES", parse_size, _int_in(0, 1 << 62), 8 << 20, "8M",
       f"{_SIZE}, 0 or more",
       "all_reduces of a CUDA tensor of at least this size (and above LINERATE_FUSION_BYTES) "
       "are pipelined; every rank must agree", "collectives", "stage_min_bytes"),
    _S("LINERATE_STAGE_BUFFERS", _int, _int_in(2, 65), 3, "3", "an integer from 2 to 64",
       "pinned host buffers of LINERATE_STAGE_CHUNK_BYTES that a group keeps for pipelined "
       "staging, made by its first pipelined all_reduce", "collectives", "stage_buffers"),
    _S("LINERATE_PARTITION_BYTES", parse_size, _int_in(4096, 1 << 62), 4 << 20, "4M",
       f"{_SIZE}, at least 4K", "PriorityDataParallel's partition size", "collectives",
       "partition_bytes"),
    _S("LINERATE_TIMELINE", _text, _is_str, "", "(off)",
       "a file path (`.rank<R>` is inserted, or `{rank}` replaced; empty: off)",
       "write a Chrome trace per rank to this path", "collectives", "timeline"),
    _S("LINERATE_FR_ENTRIES", _int, _int_in(0, 1 << 24), 2000, "2000",
       "a number of operations from 0 (off) to 16777215",
       "flight recorder: the last this many collectives of each group are kept (op, sizes, "
       "state, peers awaited, times) and written out on a timeout; 0: off", "collectives",
       "flight_entries"),
    _S("LINERATE_FR_DUMP", _text, _is_str, "", "(tempdir/linerate-flight)",
       "a file path prefix (`.rank<R>.json` appended, or `{rank}` replaced; empty: "
       "linerate-flight in the temporary folder)",
       "where each rank writes its flight recorder on a timeout", "collectives",
       "flight_dump"),
    _S("LINERATE_SLOW_RANK_MS", _number, _duration(limit=1e7), 5.0, "5",
       "a finite number of milliseconds > 0",
       "a rank entering collectives at least this much later than the others, in most of the "
       "recent ones, is named the slowest", "collectives", "slow_rank_ms"),
    _S("LINERATE_SLOW_LOG_S", _number, _duration(zero_ok=True, limit=1e7), 0.0, "0",
       "a finite number of seconds from 0 (off)",
       "log a warning naming a persistently late rank or slow link at most once per this many "
       "seconds; 0: no log line", "collectives", "slow_log_s"),
    # ---------------------------------------------------------------- metrics
    _S("LINERATE_METRICS_PORT", _port_or_off, _int_in(0, 65536), 0, "(off)",
       "a TCP port from 1 to 65535 (0 or empty: no exporter)",
       "serve Prometheus metrics on this port + LOCAL_RANK", "metrics", "metrics.port"),
    _S("LINERATE_METRICS_ADDR", lambda t: t.strip() or "0.0.0.0", _is_str, "0.0.0.0", "0.0.0.0",
       "an address to bind (empty: 0.0.0.0)", "the exporter's bind address", "metrics",
       "metrics.addr"),
    _S("LINERATE_METRICS_HOST", _text, _is_str, "", "hostname",
       "any label value (empty: the hostname)", "the host label of every series", "metrics",
       "metrics.host"),
    _S("LINERATE_METRICS_WINDOW", lambda t: float(t) if t.strip() else 1.0, _duration(), 1.0,
       "1", "a finite number of seconds > 0",
       "seconds over which utilization and busbw gauges are computed", "metrics",
       "metrics.window"),
    _S("LINERATE_LINK_CAPACITY", _text, _capacity_ok, "", "(driver speed)",
       "a rate such as 10gbit for every interface, or eth0=10gbit,eth1=25gbit (tc units: "
       "gbps is gigaBYTES/s)", "link rate where the driver reports none; shm=RATE: shared "
       "memory's (default: the host's copy rate, measured once per host when its shared segment is set up)", "metrics",
       "metrics.link_capacity"),
    _S("LINERATE_SLOW_LINK_RATIO", _number,
       lambda v: _is_num(v) and math.isfinite(v) and 0 <= v < 1, 0.6, "0.6",
       "a number from 0 (off) to below 1",
       "a TCP connection whose rate while sending stays below this share of the median rate "
       "of its rank's other measured connections is named a slow link (read when a group's "
       "links start being watched)", "metrics", "slow_link_ratio"),
    _S("LINERATE_LOG_LEVEL", _log_level, _one_of(LOG_LEVELS), "", "(unset)",
       "DEBUG, INFO, WARNING or ERROR, in any case (empty: unset)",
       "level of linerate's loggers (`linerate` and the loggers below it), applied when a "
       "process group is created; where the process has configured no logging handler, "
       "linerate adds one that writes to stderr", "metrics"),
    # ---------------------------------------------------------------- tools
    _S("LINERATE_NETLAB", _text, _is_str, "", "(set by netlab)",
       "a netlab lab name", "the lab a rank runs in (netlab sets it for the ranks it starts)",
       "tools"),
    _S("LINERATE_NETLAB_HOST", _text, _is_str, "", "(set by netlab)",
       "a netlab host name", "the lab host a rank runs on (netlab sets it)", "tools"),
    _S("LINERATE_NETLAB_STATE", lambda t: t.strip() or "/run/linerate-netlab", _is_str,
       "/run/linerate-netlab", "/run/linerate-netlab", "a folder",
       "where netlab keeps the state of its labs", "tools"),
    # ---------------------------------------------------------------- docker compose
    _S("LINERATE_WORKERS", _optional_int, lambda v: v is None or _int_in(1, 1 << 16)(v), 3,
       "3", "a number of containers >= 1",
       "replicas of the `ranks` service of docker/compose.yaml", "docker"),
    _S("LINERATE_RANKS", _optional_int, lambda v: v is None or _int_in(1, 1 << 16)(v), 4, "4",
       "a number of ranks >= 2 (LINERATE_WORKERS + 1)",
       "torchrun's --nnodes in docker/compose.yaml", "docker"),
]

#: Every setting by name.
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}
assert len(SETTINGS) == len(_ALL)


# ============================================================================ reading
def env_values() -> tuple:
    """The value (or None) of every setting's variable in this process's environment: equal
    tuples mean equal options (Options.from_env reuses its last parse on them)."""
    get = os.environ.get
    return tuple(get(s.name) for s in _ALL)


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The text of a declared variable in ``env`` (default: this process's environment), or
    None where it is not set."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a declared linerate setting (linerate/settings.py)")
    return (os.environ if env is None else env).get(name)


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    return raw(name, env) is not None


def read(name: str, env: Mapping[str, str] | None = None):
    """The parsed value of a declared variable, or its default where it is not set; a bad
    value raises a ValueError naming the variable and what it accepts."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a declared linerate setting (linerate/settings.py)")
    return SETTINGS[name].read(env)


def parse(name: str, text: str):
    return SETTINGS[name].parse(text)


def check(name: str, value, where: str | None = None) -> None:
    SETTINGS[name].check(value, where)


def fields(prefix: str) -> Iterator[tuple[Setting, str]]:
    """(setting, attribute) for the settings that fill the options object at ``prefix``
    (``""``: ``Options``' own fields; ``"transport"``, ``"metrics"``: its parts)."""
    return iter(_by_prefix().get(prefix, ()))


_FIELDS: dict[str, tuple] = {}


def _by_prefix() -> dict[str, tuple]:
    """Every filled setting by options prefix, computed once: a group's creation fills and
    checks its options about ten times, and scanning the whole registry each time would be a
    large share of a small group's set-up CPU."""
    if not _FIELDS:
        by: dict[str, list] = {}
        for s in _ALL:
            if s.field is not None:
                head, _, attr = s.field.rpartition(".")
                by.setdefault(head, []).append((s, attr))
        _FIELDS.update({k: tuple(v) for k, v in by.items()})
    return _FIELDS


def fill(obj, prefix: str, env: Mapping[str, str] | None = None):
    """Set ``obj``'s fields from the variables set in ``env`` (default: this process's
    environment); returns ``obj``. Unset variables leave the field as it is."""
    env = os.environ if env is None else env
    for s, attr in fields(prefix):
        text = env.get(s.name)
        if text is not None:
            setattr(obj, attr, s.parse(text))
    return obj


def validate(obj, prefix: str) -> None:
    """Check every field of ``obj`` that a setting fills (see ``Setting.check``)."""
    for s, attr in fields(prefix):
        s.check(getattr(obj, attr), s.field)


# ============================================================================ docs
#: What the reference page says of a setting beyond its one line of ``doc``: how it interacts
#: with others, where ranks must agree, what the choices cost. Markdown.
DETAILS: dict[str, str] = {
    "LINERATE_NSOCKS": (
        "With several interfaces one connection per interface is enough to fill them, and "
        "more connections than cores only add context switches, which is why `auto` takes 2 "
        "on one interface and 1 per interface with several. A connection's count is checked "
        "once its peer is authenticated; ranks may differ only where `auto` resolves "
        "differently per peer."),
    "LINERATE_SOCKET_IFNAME": (
        "Several names make the host multi-rail: every link stripes its chunks over "
        "connections on each interface (see [Running on a cluster](cluster.md) and "
        "`LINERATE_RAIL_SPREAD`)."),
    "LINERATE_CHUNK_BYTES": (
        "A message is cut into chunks of this size. Each connection of a link, once it has "
        "written its previous chunk, takes the next chunk of the most urgent queued message, "
        "so one message uses every connection (and every rail) at once and a slower "
        "connection simply takes fewer chunks. The receiver reads each chunk straight into "
        "its place in the destination."),
    "LINERATE_PIECE_BYTES": (
        "Reducing piece k overlaps receiving piece k+1, and a reduced piece is forwarded at "
        "once. Smaller pieces start the pipeline sooner; larger ones cost fewer Python "
        "calls. Every rank must have the same value (checked at group creation)."),
    "LINERATE_PIPELINE": (
        "Under `auto` the group's second and third such all_reduces decide: below 250 MB of "
        "tensor per second the group is link-bound and stays pipelined; otherwise the next "
        "ops try one chunk and the ranks agree on the faster mode, and every 32nd op is "
        "preceded by two in the other mode and a new agreement. See "
        "[Two-level collectives](two-level.md)."),
    "LINERATE_SMALL_BYTES": (
        "Every rank must have the same value (checked at group creation). See "
        "[how an algorithm is chosen](collectives.md)."),
    "LINERATE_ALLREDUCE_ALGO": (
        "`hd` is halving-doubling, `doubling` recursive doubling; both are all_reduces only "
        "(reduce_scatter and all_gather then take the automatic choice). A forced algorithm "
        "runs where it can; elsewhere the automatic choice is taken. Every rank must have the "
        "same value (checked at group creation). See [Collectives](collectives.md)."),
    "LINERATE_ROOTED_ALGO": ("`tree` is a binomial tree; `chain` the pipelined chain. Every "
                             "rank must have the same value (checked at group creation)."),
    "LINERATE_CONNECT_TIMEOUT": (
        "The operation timeout is the process group's own "
        "(`init_process_group(timeout=...)`)."),
    "LINERATE_LINK_TIMEOUT": (
        "Set as `TCP_USER_TIMEOUT`; an idle connection is probed by keepalives after a third of "
        "it. It finds hosts that vanish without a reset, and fails the connections with an "
        "error naming the peer. `0` leaves the kernel's defaults (about 15 minutes with data "
        "in flight, hours when idle). A link outage longer than this fails the group even "
        "where the operation timeout is longer. Also `TransportOptions.link_timeout`."),
    "LINERATE_KEEP_BYTES": (
        "Covers the transport's staging buffers and the algorithms' scratch, each up to this "
        "much. A larger value keeps more resident memory and saves the page faults of fresh "
        "scratch in every large op."),
    "LINERATE_CHECKSUM": (
        "Catches corruption that TCP's own checksum misses. It costs nothing visible where "
        "the link is the limit, and a large share of busbw where the CPU is (every byte is "
        "read once more on each side)."),
    "LINERATE_CREDIT_BYTES": (
        "Small values keep the kernel's send queue short, so that a high-priority message "
        "overtakes queued low-priority ones sooner (see "
        "[Fusion and priority](fusion-priority.md))."),
    "LINERATE_TRANSPORT": (
        "`auto` takes RDMA where every rank has an active port, else TCP with one log line "
        "saying why. RDMA has been tested against a fake pyverbs only: see [RDMA](rdma.md)."),
    "LINERATE_CONNECT": (
        "A ring all_reduce holds 2 links per rank under `lazy`, so a large group makes few "
        "connections. RDMA links are always made at creation."),
    "LINERATE_RAIL_SPREAD": (
        "Each two-level column (local rank i to local rank i of other hosts) keeps its rails "
        "to itself; `LINERATE_NSOCKS` connections are opened on each rail."),
    "LINERATE_CMA": (
        "`process_vm_readv` is refused in a container without `CAP_SYS_PTRACE`, under Yama "
        "`ptrace_scope` 1 or more between ranks that are not parent and child (torchrun's "
        "ranks are siblings), or by a seccomp filter: the probe then falls back to the segment and "
        "logs it at INFO. Under `auto` the first five such all_reduces try segment, CMA, CMA, "
        "segment, segment (the first of each path not counted); then each op takes the path "
        "whose time per byte (every rank's, best of its last three) was lower, and every 16th "
        "op the other. Ranks need not agree. See [Shared memory](shared-memory.md)."),
    "LINERATE_IO": (
        "`threads` answers a small message sooner (no hand-off to a loop thread); `shared` "
        "keeps a rank with many peers or groups at a few I/O threads. Both share everything "
        "but the loop (transport/link.py `StreamLink`) and put the same bytes on the wire. "
        "See [Scaling](scaling.md)."),
    "LINERATE_SHM": (
        "A rank alone on its host needs no segment. With `auto` or `1`, point-to-point "
        "messages between co-located ranks also go over shared memory (links of kind `shm`); "
        "`0` keeps them on TCP. See [Shared memory](shared-memory.md)."),
    "LINERATE_PORT_RANGE": (
        "Each listener takes the first free port of the range. Every rank of a host takes one "
        "port per interface of `LINERATE_SOCKET_IFNAME` (one without it) and per process "
        "group: give a host at least that many ports per rank of the job. A range with no free port fails group creation "
        "naming the setting. The connections a rank makes go out from ephemeral ports, as "
        "usual; the Store's port is `MASTER_PORT` and the exporter's `LINERATE_METRICS_PORT`. "
        "A group whose ranks all share one host opens no listener. See "
        "[Running on a cluster](cluster.md#firewalls-and-ports)."),
    "LINERATE_TLS": ("See [Running on a cluster](cluster.md) for certificates."),
    "LINERATE_FUSION_BYTES": (
        "Every all_reduce of one tensor up to this size is fused, up to this many bytes per "
        "fused op. Every rank must have the same value (checked at group creation). See "
        "[Fusion and priority](fusion-priority.md)."),
    "LINERATE_CYCLE_MS": (
        "An all_reduce that somebody already waits on is not held back."),
    "LINERATE_STAGING": (
        "Pipelined, chunk k+1 is copied to the host while chunk k is exchanged, and chunk k "
        "is copied back while chunk k+1 is, so the critical path holds one chunk's copy each "
        "way instead of the whole tensor's. Either way the op reads its input after the work "
        "queued on the caller's current stream, and `Work.wait()` makes the caller's current "
        "stream wait for the result. Ranks must pass their tensors on the same kind of device "
        "(a CUDA tensor on one rank and a CPU tensor on another is named as a mismatch). See "
        "[GPU hosts](gpu.md)."),
    "LINERATE_STAGE_CHUNK_BYTES": (
        "Smaller chunks shorten the copies that do not overlap (the first one to the host, "
        "the last one back); larger ones cost fewer algorithm runs per op. Every rank must "
        "have the same value (checked at group creation)."),
    "LINERATE_STAGE_MIN_BYTES": (
        "Smaller CUDA tensors keep one staged copy each way. Every rank must have the same "
        "value (checked at group creation)."),
    "LINERATE_STAGE_BUFFERS": (
        "A group holds at most this many times LINERATE_STAGE_CHUNK_BYTES of pinned host "
        "memory for staging, from its first pipelined all_reduce until it is destroyed. Two "
        "suffice for the overlap; a third keeps the copy of chunk k+1 from waiting for the "
        "copy back of chunk k-1. Ranks may differ."),
    "LINERATE_FR_ENTRIES": ("See [Faults and the flight recorder](faults.md)."),
    "LINERATE_FR_DUMP": ("`/tmp/fr` gives `/tmp/fr.rank0.json`, `/tmp/fr.rank1.json`, ..."),
    "LINERATE_SLOW_RANK_MS": (
        "Watched while the exporter runs or LINERATE_SLOW_LOG_S is set: every rank publishes "
        "how long its recent collectives took and how long it waited for each peer, and every "
        "rank names the same slowest rank from all of them. See "
        "[Slow ranks](metrics.md#slow-ranks)."),
    "LINERATE_SLOW_LOG_S": (
        "One line from the group's rank 0, with the evidence (share of collectives entered "
        "last, mean lateness; a slow link's rate against its siblings')."),
    "LINERATE_METRICS_PORT": (
        "Each rank of a host gets its own port. See [Metrics](metrics.md)."),
    "LINERATE_METRICS_ADDR": (
        "The exporter serves plain HTTP, without TLS or authentication: bind it to a private "
        "address where the hosts are reachable from outside, or put a proxy that adds them "
        "in front (see [Metrics](metrics.md))."),
    "LINERATE_LINK_CAPACITY": (
        "Utilization is bytes carried over this capacity. Beware tc's units: `10gbps` is "
        "80 Gbit/s."),
    "LINERATE_SLOW_LINK_RATIO": (
        "The rate is the kernel's: bytes acknowledged over the time the connection had data "
        "in flight, less the time the peer's receive window held it back (TCP_INFO). A "
        "connection is measured when it moved at least 1 MiB in at least 10 ms since the last "
        "sample; its ratio to its siblings is smoothed, and it is named after two samples in a "
        "row below the threshold. Every rank's measurements together name the host and rail "
        "at fault. See [Slow links](metrics.md#slow-links)."),
    "LINERATE_LOG_LEVEL": (
        "`INFO` adds a line per rank when a group is created (its ranks and hosts, the "
        "transport to other hosts, shared memory or not) and the choices made at set-up; "
        "`DEBUG` adds the connections' set-up. See [Logging](logging.md)."),
    "LINERATE_WORKERS": ("See docker/README.md in the repository."),
}

_SCOPE_TITLES = {
    "transport": "Transport: connections, shared memory, TLS",
    "rdma": "RDMA",
    "collectives": "Collectives: algorithms, fusion, tracing",
    "metrics": "Metrics and logging",
    "tools": "Tools",
    "docker": "docker compose",
}


def markdown_table(scopes=None) -> str:
    """The registry as one markdown table (variable, default, meaning)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for s in _ALL:
        if scopes is None or s.scope in scopes:
            lines.append(f"| `{s.name}` | {s.default_text} | {s.doc}; accepts {s.accepts} |")
    return "\n".join(lines)


def _sentence(doc: str) -> str:
    """A setting's one line of doc as a sentence: its first letter capitalised where it starts
    with a plain word, left as it is where it starts with a name (``tcp,``, ``docker/...``,
    ``all_reduce``, a `code` span)."""
    first = doc.split(" ", 1)[0].rstrip(",;:")
    plain = (re.fullmatch(r"[a-z][a-z'-]*", first) is not None
             and first.removesuffix("'s") not in _NAME_WORDS)
    return (doc[0].upper() + doc[1:] if plain else doc) + "."


#: Lowercase words that are names (values a setting takes): never capitalised.
_NAME_WORDS = frozenset({"tcp", "rdma", "auto", "shm", "lazy", "eager", "torchrun", "pyverbs"})


def markdown_page() -> str:
    """docs/settings.md: every setting, grouped by scope, from this registry."""
    out = [
        "# Settings",
        "",
        "<!-- Generated by `python -m linerate.settings --page > docs/settings.md` from "
        "linerate/settings.py. Do not edit by hand. -->",
        "",
        "Every setting is an environment variable, read once when a process group is created. "
        "A bad value fails group creation with a `ValueError` naming the variable and what it "
        "accepts. Sizes take K/M/G suffixes (binary); durations are finite numbers (`nan`, "
        "`inf` and negative values are refused).",
        "",
        "The group settings also exist as a Python object, `linerate.Options` (with "
        "`.transport`, a `linerate.TransportOptions`, and `.metrics`). Pass one to skip the "
        "environment: "
        '`dist.init_process_group("linerate", pg_options=linerate.Options(allreduce_algo="ring"))`; '
        "`linerate.Options.from_env()` gives the environment's values to start from. The "
        "*field* of each setting below is its attribute there. The operation timeout is the "
        "process group's (`init_process_group(timeout=...)`).",
        "",
        "A setting without a field belongs to the process, not to a group, and is read from "
        "the environment only: "
        + ", ".join(f"`{s.name}`" for s in _ALL if s.field is None
                    and s.scope not in ("tools", "docker"))
        + " (each says when it is read), and those of the tools and of docker compose.",
        "",
        "`python -m linerate.settings` prints the same registry as one table.",
        "",
        "| variable | default | scope |",
        "|---|---|---|",
    ]
    for s in _ALL:
        out.append(f"| [`{s.name}`](#{s.name.lower()}) | {s.default_text} | {s.scope} |")
    for scope, title in _SCOPE_TITLES.items():
        members = [s for s in _ALL if s.scope == scope]
        if not members:
            continue
        out += ["", f"## {title}"]
        for s in members:
            out += ["", f"### {s.name}", "", _sentence(s.doc), "",
                    f"- default: {s.default_text}", f"- accepts: {s.accepts}"]
            if s.field:
                out.append(f"- field: `Options.{s.field}`")
            if s.name in DETAILS:
                out += ["", DETAILS[s.name]]
    assert not set(s.scope for s in _ALL) - set(_SCOPE_TITLES), "a scope without a title"
    assert not set(DETAILS) - set(SETTINGS), "DETAILS names an undeclared setting"
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover
    import sys
    print(markdown_page() if sys.argv[1:] == ["--page"] else markdown_table(), end="" if sys.argv[1:] == ["--page"] else "\n")
