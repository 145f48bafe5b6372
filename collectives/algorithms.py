"""Which algorithm runs a collective: one table, from the op, its size, the group's shape
(ranks, hosts, ranks per host, whether co-located ranks share memory) and the overrides.

Every rank of a group must choose the same algorithm for the same call: everything this reads
is the same on every rank (the layout is agreed at group creation, the settings are checked to
agree, the size is part of the call every rank must agree on).

=============== ================================= ===================================== =========
op              one host, shared segment          several hosts, co-located ranks share  else
=============== ================================= ===================================== =========
all_reduce      shm                               two_level                             size rule
reduce_scatter  shm                               two_level                             size rule
all_gather      shm                               two_level                             size rule
broadcast       shm                               two_level                             size rule
reduce          shm                               two_level                             size rule
gather, scatter shm                               direct                                direct
all_to_all      shm                               direct                                direct
barrier         shm                               dissemination                         same
fusion agree    shm                               two_level (1)                         direct
=============== ================================= ===================================== =========

(1) two_level.agree: the host's ranks agree on their segment, then each rank with its column
groups over TCP; on even layouts a small head call is reduced along (the small two-level
all_reduce in the same two rounds).

"several hosts, co-located ranks share" needs at least one host with two or more ranks of the
group, every such host's segment proved (``Layout.shared``), at most MAX_COLUMNS ranks per
host, and the group's worker (prioritized all_reduces run there too where the worker would
get shared memory; elsewhere they run on threads of their own, beside each other, and take
the flat algorithms). Size rule, all_reduce: ``direct`` up to
``small_bytes``, ``hd`` on AUTO_MIN_RANKS+ ranks up to AUTO_MAX_BYTES, else ``ring``;
reduce_scatter / all_gather: ``direct`` up to ``small_bytes`` (all segments), else ``ring``;
broadcast / reduce: ``direct`` up to ``small_bytes``, else ``chain``.

Overrides (``LINERATE_ALLREDUCE_ALGO``: all_reduce, and reduce_scatter / all_gather for
``ring``, ``direct`` and ``two_level``; ``LINERATE_ROOTED_ALGO``: broadcast / reduce) force
their algorithm where it can run: a flat algorithm runs over the links even on one host
(shared-memory links between co-located ranks), not on the segment's collectives;
``two_level`` runs wherever co-located ranks share memory (on one host: the host is the only
level; with one rank per host: the inter-host level alone), else the size rule applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from . import halving

#: Ops the two-level algorithms implement.
TWO_LEVEL_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
#: Most ranks of one host for two-level algorithms (collectives/two_level.py: one slot tag
#: per column).
MAX_COLUMNS = 63
#: What choose() picks by itself (an override may also give ``doubling`` or ``tree``).
NAMES = ("shm", "two_level", "direct", "ring", "hd", "chain", "dissemination")
#: The LINERATE_ALLREDUCE_ALGO values that also force reduce_scatter and all_gather.
GATHER_FORCIBLE = ("ring", "direct", "two_level")


@dataclass(frozen=True)
class Shape:
    """The group, as the table sees it (the same on every rank)."""
    P: int
    #: group ranks per host (hosts ordered by their lowest rank)
    hosts: tuple
    #: every host with 2+ ranks of the group maps a proved shared segment
    shared: bool

    @cached_property  # the group's shape is fixed: each figure computed once
    def H(self) -> int:
        return len(self.hosts)

    @cached_property
    def per_host(self) -> int:
        return max((len(h) for h in self.hosts), default=1)

    @cached_property
    def one_host_shm(self) -> bool:
        return self.P > 1 and self.H == 1 and self.shared

    @cached_property
    def two_level_ok(self) -> bool:
        """Two-level algorithms can run: co-located ranks share memory (or there are none)."""
        return self.P > 1 and self.per_host <= MAX_COLUMNS and (self.shared or self.per_host == 1)

    @cached_property
    def two_level_auto(self) -> bool:
        """``auto`` takes them: several hosts, some with several ranks."""
        return self.two_level_ok and self.H > 1 and self.per_host >= 2


def choose(op: str, nbytes: int, shape: Shape, *, allreduce_algo: str = "auto",
           rooted_algo: str = "auto", small_bytes: int = 64 << 10, worker: bool = True) -> str:
    """The algorithm for ``op`` on ``nbytes`` (all_reduce, broadcast, reduce: the tensor;
    reduce_scatter / all_gather: all segments together). ``worker``: the op runs on the
    group's worker (the shared-memory engines can be used), not beside other ops."""
    if op not in _OPS:
        raise ValueError(f"no algorithm table entry for op {op!r} (known: {', '.join(_OPS)})")
    if shape.P <= 1:
        return "direct"
    shm = worker and shape.one_host_shm
    if op == "all_reduce":
        forced = allreduce_algo
    elif op in ("reduce_scatter", "all_gather"):
        # hd and doubling are all_reduces: these ops take the automatic choice under them.
        forced = allreduce_algo if allreduce_algo in GATHER_FORCIBLE else "auto"
    elif op in ("broadcast", "reduce"):
        forced = rooted_algo
    else:
        forced = "auto"
    if forced == "two_level" and worker and shape.two_level_ok:
        return "two_level"
    if forced not in ("auto", "two_level"):
        return forced
    if shm:
        return "shm"
    if op in TWO_LEVEL_OPS + ("agree",) and worker and shape.two_level_auto:
        return "two_level"
    return size_rule(op, nbytes, shape.P, small_bytes)


def size_rule(op: str, nbytes: int, P: int, small_bytes: int) -> str:
    """The flat algorithm for ``op`` on ``nbytes`` among ``P`` ranks that share no memory: the
    small/large rule, in one place. The two-level algorithms ask it for their inter-host
    phases (one rank per host), the neighbor collectives for a host's average."""
    small = nbytes <= small_bytes
    if op == "all_reduce":
        if small:
            return "direct"
        if P >= halving.AUTO_MIN_RANKS and nbytes <= halving.AUTO_MAX_BYTES:
            return "hd"
        return "ring"
    if op in ("reduce_scatter", "all_gather"):
        return "direct" if small else "ring"
    if op in ("broadcast", "reduce"):
        return "direct" if small else "chain"
    if op == "barrier":
        return "dissemination"
    return "direct"


#: Algorithm name -> the module that implements it (one function per op, named after the op).
_MODULES = {"shm": "shm_algos", "two_level": "two_level", "direct": "direct", "ring": "ring",
            "hd": "halving", "doubling": "doubling", "tree": "doubling", "chain": "chain",
            "dissemination": "direct"}
_IMPL: dict = {}


def implementation(name: str, op: str):
    """The function that runs ``op`` with algorithm ``name``: ``module.<op>(comm, ...)``
    (``two_level``'s take the group's plan, engine and small_bytes after the op's own
    arguments). An unknown pair raises ValueError naming both."""
    fn = _IMPL.get((name, op))
    if fn is None:
        import importlib
        mod = _MODULES.get(name)
        fn = getattr(importlib.import_module(f"{__package__}.{mod}"), op, None) if mod else None
        if fn is None:
            raise ValueError(f"algorithm {name!r} does not implement {op}")
        _IMPL[(name, op)] = fn
    return fn


_OPS = TWO_LEVEL_OPS + ("gather", "scatter", "all_to_all", "barrier", "agree")
