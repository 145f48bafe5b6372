"""The ``linerate`` torch.distributed process group: torch's calls in, algorithms run, Work out.

The adapter validates a call, stages its tensors and hands it to the group's runner
(collectives/runner.py), which numbers the calls and runs them one after another in call order
(every rank calls them in the same order, so every rank runs the same sequence; the op's
sequence number travels in every frame and a rank in a different op is reported); what runs is
the algorithm table's choice (collectives/dispatch.py). The adapter names no algorithm.
Point-to-point sends and receives go straight to the transport and progress on their own.

Method names follow what torch calls on a Python process group (2.13 is the tested version),
with both the names of torch before 2.13 and those of 2.13 bound to one implementation.
"""
from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from linerate import _log
from linerate.transport import Context, metrics, slowlink

from . import flight, frameworks, pipeline, straggler, timeline
from .comm import OPNAMES, Comm
from .dispatch import Dispatch
from .mixing import mix
from .op import FlightHook, Lifecycle, MetricsHook
from .p2p import PointToPoint
from .runner import Runner
from .stage import Stage
from .validate import Checks
from .options import Options
from .reduce_ops import RedOpType, finish_avg, op_name, op_type
from .work import Work

log = logging.getLogger("linerate")

BACKEND_NAME = "linerate"
#: The ops whose result is final when the algorithm returns (AVG divides after it).
_CHAIN_OPS = (RedOpType.SUM, RedOpType.MIN, RedOpType.MAX, RedOpType.PRODUCT)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)


_DTS: dict = {}


def _dt(t: torch.Tensor) -> str:
    """dtype[numel] of a tensor (cached: every call's description holds it)."""
    key = (t.dtype, t.numel())
    text = _DTS.get(key)
    if text is None:
        if len(_DTS) > 4096:
            _DTS.clear()
        text = _DTS[key] = f"{str(t.dtype).replace('torch.', '')}[{key[1]}]"
    return text


def _dts(tensors) -> str:
    """dtype[numel] of each tensor, for the agreement check."""
    return ",".join([_dt(t) for t in tensors])




def _rop(op) -> str:
    return op_name(op)




def _incarnation() -> str:
    """Which incarnation of the job this process belongs to, for the rendezvous keys: torchrun
    keeps one Store across restarts (torch 2.13 reuses its agent's TCPStore), so the keys of
    a failed attempt are still there when the restarted ranks arrive; every attempt has a
    restart count of its own (TORCHELASTIC_RESTART_COUNT, set by torchrun's agent)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return f"attempt{int(count)}" if count.isdigit() else ""


#: timedelta -> seconds (0.0 where not > 0: unset), for _op_timeout.
_SECONDS: dict = {}


class ProcessGroupLinerate(Checks, PointToPoint, dist.ProcessGroup):
    """A torch.distributed process group over linerate's striped TCP transport."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta | None = None,
                 options: Options | None = None, group_name: str = "",
                 global_ranks: list[int] | None = None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size  # torch's rank() and size() are calls into C++
        # Every setting is parsed (LINERATE_*) or checked (pg_options) here, before any socket.
        if options is None:
            self._options = Options.from_env()  # checked as it is read
        else:
            self._options = options
            self._options.validate()
        _log.configure()  # LINERATE_LOG_LEVEL (the process's, not the group's)
        self._timeout = (timeout or timedelta(minutes=30)).total_seconds()
        self._group_name = group_name
        self._group_desc = ""
        self._ctx = Context(store, rank, size, self._options.transport, OPNAMES,
                            label=group_name or "", scope=_incarnation(),
                            agreed=self._options.agreed())
        if global_ranks and len(global_ranks) == size:
            self._ctx.global_ranks = list(global_ranks)
        layout = self._ctx.layout  # learnt at rendezvous (the ``layout`` property)
        seg = self._ctx.shm
        if log.isEnabledFor(logging.INFO):
            log.info("%s", self._summary())
        #: The algorithm table's choices and what they keep (collectives/dispatch.py): the
        #: shared-memory engine of every rank on this host (``shm``) or of this host's ranks
        #: where the group spans hosts (``local``), the two-level plan.
        self._algos = Dispatch.for_group(self._options, layout, rank, size, seg)
        self._shm, self._local = self._algos.shm, self._algos.local
        self._shape, self._plan = self._algos.shape, self._algos.plan
        #: (dtype, elements, op) -> the lone call's texts and bytes (() if too large)
        self._lone_desc: dict = {}
        metrics.set_info(nsocks=self._ctx.options.nsocks,
                         algorithm=self._options.allreduce_algo)
        metrics.start_from_env(str(global_ranks[rank] if global_ranks and len(global_ranks) == size
                                   else rank), self._options.metrics)
        #: Pipelined staging of large CUDA all_reduces (collectives/pipeline.py), by device:
        #: made by the first such op, its pinned buffers reused by the later ones.
        self._stagers: dict = {}
        self._stagers_lock = threading.Lock()
        self.timeline = timeline.get(global_ranks[rank] if global_ranks and len(global_ranks) == size
                                     else rank, path=self._options.timeline)
        #: The last LINERATE_FR_ENTRIES collectives, written out on a timeout (flight.py).
        self._flight = (flight.Recorder(self._options.flight_entries, self._options.flight_dump,
                                        group_name, rank, size, global_ranks, self._timeout)
                        if self._options.flight_entries > 0 else flight.Off())
        if isinstance(self._flight, flight.Recorder):
            flight.watch(self._ctx, self._flight)
        #: begin -> run -> finish | fail of every op (collectives/op.py), observed by the
        #: flight recorder and the metrics.
        self._life = Lifecycle(self._ctx, rank)
        #: How each call runs (collectives/runner.py): numbered, in order, plain, fused,
        #: lone, chained or prioritized; the algorithms asked of the table.
        self._run = Runner(self._ctx, self._options, rank, size, self._algos, self._life,
                           group_name)
        self._lone_max = self._run.lone_max
        if isinstance(self._flight, flight.Recorder):
            self._life.add(FlightHook(self._flight))
        #: Who makes the others wait (collectives/straggler.py): while the exporter runs or
        #: LINERATE_SLOW_LOG_S asks for a log line.
        self._watch = None
        if size > 1 and (metrics.enabled() or self._options.slow_log_s > 0):
            self._watch = straggler.Watch(
                store, _incarnation(), rank, size, self._ctx.global_ranks or None,
                metrics.identity()[1], self._options.slow_rank_ms, self._options.slow_log_s,
                group_name, links=slowlink.LinkRates(
                    self._ctx, threshold=self._options.slow_link_ratio))
            self._ctx.record_arrivals()
            self._life.arrivals = True
            self._life.add(self._watch)
        self._life.add(MetricsHook(size))
        # A framework that trains each rank alone beside this group (Accelerate without its
        # CPU mode, on a machine without a GPU) is named: now, at shutdown, at exit.
        frameworks.watch(rank, size)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        self._run.group_name = name
        self._ctx.label = name
        self._flight.group = name

    def setGroupName(self, name: str) -> None:
        self._set_group_name(name)

    def getGroupName(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        self._flight.desc = desc

    def setGroupDesc(self, desc: str) -> None:
        self._set_group_desc(desc)

    def getGroupDesc(self) -> str:
        return self._group_desc

    def _get_backend(self, device=None):
        return self

    @property
    def supports_coalescing(self) -> bool:
        return False

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def options(self) -> Options:
        return self._options

    @property
    def layout(self):
        """Where the group's ranks are (transport/shm ``Layout``: ``hosts``, the group ranks
        of each host, and ``shared``, whether each host's co-located ranks share a segment):
        the same on every rank, as the transport Context learnt it at rendezvous."""
        return self._ctx.layout

    @property
    def host_engine(self):
        """The shared-memory engine of this host's ranks where the group spans hosts
        (collectives/shm_algos.py), else None."""
        return self._local

    @property
    def small_bytes(self) -> int:
        """LINERATE_SMALL_BYTES of this group."""
        return self._options.small_bytes

    @property
    def shared_memory(self) -> bool:
        """Whether this group's collectives run on a shared-memory segment (every rank on this
        host, LINERATE_SHM): then its TCP connections carry (almost) nothing."""
        return self._shm is not None

    def _summary(self) -> str:
        """One line on what the group is made of (logged at INFO when it is created)."""
        ctx, hosts = self._ctx, self._ctx.layout.hosts

        def n(k: int, what: str) -> str:
            return f"{k} {what}{'s' if k != 1 else ''}"
        text = (f"rank {self._rank}: group {self._group_name or '?'} of {n(self._size, 'rank')} "
                f"on {n(len(hosts), 'host')}")
        if len(hosts) > 1:
            text += (f"; {ctx.transport} to other hosts, up to "
                     f"{n(ctx.options.nsocks, 'connection')} per peer on each of "
                     f"{n(ctx.nrails, 'interface')}")
        mine = next((h for h in hosts if self._rank in h), ())
        if len(mine) > 1:
            text += ("; shared memory with the other ranks of this host" if ctx.shm is not None
                     else "; TCP, not shared memory, to the other ranks of this host")
        return text

    def connection_stats(self) -> list[dict]:
        """Bytes sent and received per connection (peer rank, connection index, addresses)."""
        return self._ctx.connection_stats()

    def slow_report(self) -> dict | None:
        """Who makes this group wait, decided from every rank's view (collectives/straggler.py
        ``Watch.report``: the slowest rank, each late rank's share and mean lateness, the
        seconds this rank waited per peer, slow links); None while the group is not watched
        (no exporter and LINERATE_SLOW_LOG_S=0)."""
        return self._watch.report() if self._watch is not None else None

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    # ------------------------------------------------------------------ running ops
    def _op_timeout(self, opts) -> float:
        """The call's timeout in seconds: its options' where set (> 0), else the group's."""
        t = getattr(opts, "timeout", None)
        s = _SECONDS.get(t)
        if s is None:  # (torch makes a new timedelta per call: a job passes a few values)
            if len(_SECONDS) > 64:
                _SECONDS.clear()
            s = _SECONDS[t] = (max(0.0, t.total_seconds()) if isinstance(t, timedelta)
                               else 0.0)
        return s if s > 0 else self._timeout

    def _submit(self, name: str, fn, result: list, stage: Stage, timeout: float,
                nbytes: int | None = None, desc: str = "", opts=None, chain_bytes: int = 0) -> Work:
        """Queue ``fn(comm)`` as the group's next collective (collectives/runner.py ``submit``:
        a synchronous call that finds the worker idle runs in this thread)."""
        return self._run.submit(name, fn, result, stage, timeout, nbytes, desc, opts, chain_bytes)

    @property
    def _shut(self) -> bool:
        """Whether the group was shut down or aborted (its runner takes no more calls)."""
        return self._run.shut

    @_shut.setter
    def _shut(self, value: bool) -> None:
        self._run.shut = value

    @property
    def _worker(self):
        """The group's worker thread, or None while it has none (scheduler.py)."""
        return self._run.worker

    @property
    def fusion_stats(self) -> dict:
        """Tensor fusion so far: all_reduce calls run as fusion entries, fused ops run."""
        return self._run.fusion_stats

    @property
    def chain_stats(self) -> dict:
        """Two-level all_reduces whose end ran after the next op's start."""
        return self._run.chain_stats

    # ------------------------------------------------------------------ all_reduce
    def allreduce(self, tensors, opts=None):
        if (self._lone_max and opts is not None and len(tensors) == 1
                and not getattr(opts, "asyncOp", True) and isinstance(tensors[0], torch.Tensor)):
            work = self._lone(tensors[0], opts)
            if work is not None:
                return work
        opts = opts or dist.AllreduceOptions()
        what = "all_reduce"
        # validate.CHECKS["all_reduce"], inline: this is the latency-critical path.
        for t in tensors:
            self._check_tensor(t, what)
        op = op_type(opts.reduceOp)
        for t in tensors:
            self._check_op(op, t, what)
        if len(tensors) == 1 and (tensors[0].is_cuda or pipeline.standin_installed()):
            work = self._pipelined(tensors[0], op, opts)
            if work is not None:
                return work
        stage = Stage(self._rank, what)
        bufs = [stage.out(t, keep=True) for t in tensors]
        algo = self._options.allreduce_algo
        # Fusable: decided from the call alone (never from asyncOp: a rank may call the
        # same all_reduce synchronously where another does not), the same on every rank.
        if (len(bufs) == 1 and self._size > 1
                and bufs[0].numel() * bufs[0].element_size() <= self._options.fusion_bytes):
            return self._run.fusable(what, bufs[0], tensors[0], op, _rop(op), stage,
                                     self._op_timeout(opts), f"{_dts(tensors)} op={_rop(op)}",
                                     sync=not getattr(opts, "asyncOp", True))

        def run(comm: Comm):
            for b in bufs:
                self._algos.all_reduce(comm, _flat(b), op, algo)

        chain_bytes = (bufs[0].numel() * bufs[0].element_size()
                       if len(bufs) == 1 and op in _CHAIN_OPS else 0)
        return self._submit(what, run, list(tensors), stage, self._op_timeout(opts),
                            desc=f"{_dts(tensors)} op={_rop(op)}", opts=opts,
                            chain_bytes=chain_bytes)

    def _pipelined(self, t: torch.Tensor, op, opts) -> Work | None:
        """An all_reduce of one CUDA tensor of at least LINERATE_STAGE_MIN_BYTES (above
        LINERATE_FUSION_BYTES), pipelined through host memory (collectives/pipeline.py); None
        where it does not apply (a smaller tensor, LINERATE_STAGING=whole, a group of one).
        Decided from the call and the agreed settings: the same on every rank that passes a
        tensor on the same kind of device (the description says it was staged, so that a rank
        that passed another kind is named as a mismatch)."""
        o = self._options
        nbytes = t.numel() * t.element_size()
        if (o.staging != "pipelined" or self._size == 1 or nbytes < o.stage_min_bytes
                or nbytes <= o.fusion_bytes):
            return None
        with self._stagers_lock:
            stager = self._stagers.get(t.device)
            if stager is None:
                copier = pipeline.copier_for(t.device)
                if copier is None:
                    return None
                stager = self._stagers[t.device] = pipeline.Stager(
                    copier, o.stage_chunk_bytes, o.stage_buffers)
        what = "all_reduce"
        staged = pipeline.Staged(stager, t, self._rank, what)
        algo = o.allreduce_algo
        reduce_chunk = self._algos.all_reduce

        def run(comm: Comm):
            staged.run(comm, lambda c, chunk: reduce_chunk(c, chunk, op, algo))

        return self._submit(what, run, [t], staged, self._op_timeout(opts),
                            desc=f"{_dts([t])} op={_rop(op)} (a device tensor, staged in chunks "
                                 f"of {o.stage_chunk_bytes} bytes)", opts=opts)

    @property
    def staging_stats(self) -> dict:
        """Pipelined staging so far (collectives/pipeline.py): all_reduces run that way, chunks
        moved, host buffers held, by device."""
        return {str(d): {"ops": st.ops, "chunks": st.chunks, "buffers": len(st.bufs),
                         "buffer_bytes": st.chunk_bytes}
                for d, st in list(self._stagers.items())}

    def _close_stagers(self) -> None:
        for st in list(self._stagers.values()):
            st.close()
        self._stagers.clear()

    def _lone(self, t, opts) -> Work | None:
        """A synchronous all_reduce of one small contiguous CPU tensor that may run the lone
        way (collectives/runner.py ``lone_all_reduce``), checked as every call is; None where
        it does not apply or the worker is busy (the general way then runs the call). What
        the checks conclude of a (dtype, elements, op) is kept: a job repeats a few calls."""
        rop = opts.reduceOp
        op = getattr(rop, "op", None)
        if op.__class__ is not RedOpType:
            op = op_type(rop)  # (names what it cannot take)
        key = (t.dtype, t.numel(), op)
        call = self._lone_desc.get(key)
        if call is None:
            what = "all_reduce"
            self._check_tensor(t, what)
            self._check_op(op, t, what)
            if len(self._lone_desc) > 256:
                self._lone_desc.clear()
            nbytes = key[1] * t.element_size()
            call = self._lone_desc[key] = (
                (f"{_dt(t)} op={_rop(op)}", f"{_dt(t)} op={_rop(op)} (fused with what follows)",
                 nbytes) if nbytes <= self._lone_max else ())
        if not call or not t.is_cpu or t.is_sparse or not t.is_contiguous():
            return None  # (a sparse tensor: the general way names it)
        return self._run.lone_all_reduce(t, op, call, self._op_timeout(opts))

    def allreduce_priority(self, tensor: torch.Tensor, priority: int, op=dist.ReduceOp.SUM,
                           name: str = "", timeout: float | None = None) -> Work:
        """All-reduce ``tensor`` in place, starting now, beside the group's other operations;
        its sends go before those of lower priority (a larger number) already queued, chunk by
        chunk. Ranks must call it in the same order with the same tensors (``name``, e.g. a
        layer and partition, is part of what they must agree on). The caller must leave the
        tensor alone until the Work completes. Used by PriorityDataParallel."""
        what = "all_reduce"
        op = op_type(op)
        self._validate(what, tensors=(tensor,), op=op)
        if self._shut:
            raise RuntimeError(f"linerate: {what} on a process group that was shut down")
        stage = Stage(self._rank, what)
        buf = stage.out(tensor, keep=True)
        timeout = self._timeout if timeout is None else float(timeout)
        desc = f"{_dts([tensor])} op={_rop(op)} {name}".rstrip()
        return self._run.priority(buf, tensor, op, priority, stage, timeout, desc, name,
                                  self.timeline)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        what = "all_reduce_coalesced"
        op = op_type(opts.reduceOp)
        self._validate(what, tensors=tensors, op=op)
        stage = Stage(self._rank, what)
        bufs = [stage.out(t, keep=True) for t in tensors]
        algo = self._options.allreduce_algo

        def run(comm: Comm):
            # One flat buffer per dtype: one all-reduce instead of one per tensor.
            by_dtype: dict = {}
            for b in bufs:
                by_dtype.setdefault(b.dtype, []).append(b)
            for group in by_dtype.values():
                flat = torch.cat([_flat(b) for b in group]) if len(group) > 1 else _flat(group[0])
                self._algos.all_reduce(comm, flat, op, algo)
                if len(group) > 1:
                    off = 0
                    for b in group:
                        n = b.numel()
                        _flat(b).copy_(flat[off:off + n])
                        off += n

        return self._submit(what, run, list(tensors), stage, self._op_timeout(opts),
                            desc=f"{_dts(tensors)} op={_rop(op)}", opts=opts)

    # ------------------------------------------------------------------ neighbor all-reduce
    def neighbor_allreduce(self, tensor, self_weight, in_weights: dict, out_peers: list,
                           timeout=None, call: str = "", out=None, plan=None):
        """``tensor <- self_weight * tensor + sum_j in_weights[j] * (rank j's tensor)``, sending
        this rank's tensor to every rank in ``out_peers`` (collectives/mixing.py ``mix``). ``call``
        names the mixing step (topology and step) and must be the same on every rank, like the
        dtype and size; the weights and peers are this rank's own. With ``out`` the result goes
        there instead (same shape and dtype, not overlapping ``tensor``). ``plan(comm, flat,
        out_flat_or_None)``, where given, runs instead of the point-to-point mix (a group average
        on shared memory, the hierarchical all-reduce: collectives/neighbor.py). Returns a Work."""
        what = "neighbor_allreduce"
        self._validate(what, tensor=tensor, in_weights=in_weights, out_peers=out_peers,
                       self_weight=self_weight, out=out)
        ins = [(j, float(w)) for j, w in sorted(in_weights.items())]
        outs = [int(q) for q in out_peers]
        sw = float(self_weight)
        if timeout is None:
            timeout = self._timeout
        elif isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        stage = Stage(self._rank, what)
        if out is None:
            buf = dst = stage.out(tensor, keep=True)
        else:
            buf, dst = stage.inp(tensor), stage.out(out)
        handshake = tensor.numel() * tensor.element_size() > self._options.small_bytes  # same on every rank

        def run(comm: Comm):
            if plan is not None:
                return plan(comm, _flat(buf), None if out is None else _flat(dst))
            mix(comm, _flat(buf), sw, ins, outs, handshake, out=None if out is None else _flat(dst))

        return self._submit(what, run, [tensor if out is None else out], stage, float(timeout),
                            desc=f"{_dts([tensor])} {call}".rstrip())

    # ------------------------------------------------------------------ rooted ops
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        what = "broadcast"
        root = opts.rootRank
        self._validate(what, tensors=tensors, root=root)
        t = tensors[0]
        stage = Stage(self._rank, what)
        buf = stage.out(t, keep=(self._rank == root))
        return self._submit(what, lambda comm: self._algos.rooted(comm, "broadcast", _flat(buf), root),
                            list(tensors), stage, self._op_timeout(opts),
                            desc=f"{_dts([t])} root={root}", opts=opts)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        what = "reduce"
        root = opts.rootRank
        op = op_type(opts.reduceOp)
        self._validate(what, tensors=tensors, root=root, op=op)
        t = tensors[0]
        stage = Stage(self._rank, what)
        is_root = self._rank == root
        buf = stage.out(t, keep=True) if is_root else stage.inp(t)

        def run(comm: Comm):
            flat = _flat(buf)
            self._algos.rooted(comm, "reduce", flat, op, root)
            if is_root:
                finish_avg(flat, op, comm.size)

        return self._submit(what, run, list(tensors), stage, self._op_timeout(opts),
                            desc=f"{_dts([t])} op={_rop(op)} root={root}", opts=opts)

    def gather(self, output_lists, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        what = "gather"
        root = opts.rootRank
        self._validate(what, inputs=input_tensors, outputs=output_lists, root=root)
        t = input_tensors[0]
        stage = Stage(self._rank, what)
        src = stage.inp(t)
        outs = [_flat(stage.out(o)) for o in output_lists[0]] if self._rank == root else None

        def run(comm: Comm):
            self._algos.run(comm, "gather", 0, _flat(src), outs, root)

        result = list(output_lists[0]) if output_lists else []
        return self._submit(what, run, result, stage, self._op_timeout(opts),
                            nbytes=t.numel() * t.element_size() * self._size,
                            desc=f"{_dts([t])} root={root}", opts=opts)

    def scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        what = "scatter"
        root = opts.rootRank
        self._validate(what, outputs=output_tensors, inputs=input_lists, root=root)
        t = output_tensors[0]
        stage = Stage(self._rank, what)
        ins = [_flat(stage.inp(x)) for x in input_lists[0]] if self._rank == root else None
        out = stage.out(t)

        def run(comm: Comm):
            self._algos.run(comm, "scatter", 0, _flat(out), ins, root)

        return self._submit(what, run, list(output_tensors), stage, self._op_timeout(opts),
                            desc=f"{_dts([t])} root={root}", opts=opts)

    # ------------------------------------------------------------------ gathers
    def _gather_segs(self, stage: Stage, inp: torch.Tensor, outs: list[torch.Tensor]):
        src = _flat(stage.inp(inp))
        segs = [_flat(stage.out(o)) for o in outs]
        return src, segs

    def allgather(self, output_lists, input_tensors, opts=None):
        what = "all_gather"
        self._validate(what, inputs=input_tensors, outputs=output_lists)
        t = input_tensors[0]
        outs = output_lists[0]
        stage = Stage(self._rank, what)
        src, segs = self._gather_segs(stage, t, outs)
        return self._submit(what, lambda comm: self._algos.all_gather(comm, src, segs),
                            list(outs), stage, self._op_timeout(opts),
                            desc=_dts([t]), opts=opts)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """``output_lists[i][j]`` receives rank i's ``input_tensors[j]`` (torch's layout)."""
        what = "all_gather_coalesced"
        self._validate(what, outputs=output_lists, inputs=input_tensors)
        stage = Stage(self._rank, what)
        jobs = [self._gather_segs(stage, t, [outs[j] for outs in output_lists])
                for j, t in enumerate(input_tensors)]

        def run(comm: Comm):
            for src, segs in jobs:
                self._algos.all_gather(comm, src, segs)

        result = [o for outs in output_lists for o in outs]
        return self._submit(what, run, result, stage, self._op_timeout(opts),
                            desc=_dts(input_tensors), opts=opts)

    def _single_gather_job(self, stage: Stage, out: torch.Tensor, inp: torch.Tensor):
        o = _flat(stage.out(out))
        n = inp.numel()
        return _flat(stage.inp(inp)), [o[i * n:(i + 1) * n] for i in range(self._size)]

    def all_gather_single(self, output, input, opts=None):
        what = "all_gather_into_tensor"
        self._validate(what, outputs=(output,), inputs=(input,))
        stage = Stage(self._rank, what)
        src, segs = self._single_gather_job(stage, output, input)
        return self._submit("all_gather", lambda comm: self._algos.all_gather(comm, src, segs),
                            [output], stage, self._op_timeout(opts),
                            desc=_dts([input]), opts=opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        what = "all_gather_into_tensor_coalesced"
        self._validate(what, outputs=outputs, inputs=inputs)
        stage = Stage(self._rank, what)
        jobs = [self._single_gather_job(stage, o, i) for o, i in zip(outputs, inputs)]

        def run(comm: Comm):
            for src, segs in jobs:
                self._algos.all_gather(comm, src, segs)

        return self._submit("all_gather_coalesced", run, list(outputs), stage, self._op_timeout(opts),
                            desc=_dts(inputs), opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        what = "reduce_scatter"
        op = op_type(opts.reduceOp)
        self._validate(what, outputs=output_tensors, inputs=input_lists, op=op)
        out = output_tensors[0]
        stage = Stage(self._rank, what)
        segs = [_flat(stage.inp(x)) for x in input_lists[0]]
        o = _flat(stage.out(out))
        return self._submit(what, lambda comm: self._algos.reduce_scatter(comm, segs, o, op),
                            [out], stage, self._op_timeout(opts),
                            desc=f"{_dts([out])} op={_rop(op)}", opts=opts)

    def _single_scatter_job(self, stage: Stage, out: torch.Tensor, inp: torch.Tensor):
        n = out.numel()
        flat = _flat(stage.inp(inp))
        return [flat[i * n:(i + 1) * n] for i in range(self._size)], _flat(stage.out(out))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = op_type(opts.reduceOp)
        self._validate("reduce_scatter_tensor", outputs=(output,), inputs=(input,), op=op)
        stage = Stage(self._rank)
        segs, o = self._single_scatter_job(stage, output, input)
        return self._submit("reduce_scatter", lambda comm: self._algos.reduce_scatter(comm, segs, o, op),
                            [output], stage, self._op_timeout(opts),
                            desc=f"{_dts([output])} op={_rop(op)}", opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        what = "reduce_scatter_tensor_coalesced"
        op = op_type(opts.reduceOp)
        self._validate(what, outputs=outputs, inputs=inputs, op=op)
        stage = Stage(self._rank, what)
        jobs = [self._single_scatter_job(stage, o, i) for o, i in zip(outputs, inputs)]

        def run(comm: Comm):
            for segs, o in jobs:
                self._algos.reduce_scatter(comm, segs, o, op)

        return self._submit("reduce_scatter_coalesced", run, list(outputs), stage, self._op_timeout(opts),
                            desc=f"{_dts(outputs)} op={_rop(op)}", opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ all-to-all
    def alltoall(self, output_tensors, input_tensors, opts=None):
        what = "all_to_all"
        self._validate(what, outputs=output_tensors, inputs=input_tensors)
        ref = input_tensors[0]
        stage = Stage(self._rank, what)
        ins = [_flat(stage.inp(x)) for x in input_tensors]
        outs = [_flat(stage.out(o)) for o in output_tensors]
        return self._submit(what, lambda comm: self._algos.run(comm, "all_to_all", 0, outs, ins),
                            list(output_tensors), stage, self._op_timeout(opts),
                            desc=str(ref.dtype).replace("torch.", ""), opts=opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        what = "all_to_all_single"
        self._validate(what, output=output, input=input, output_splits=output_split_sizes,
                       input_splits=input_split_sizes)
        in_splits = self._splits(input, input_split_sizes, "input")
        out_splits = self._splits(output, output_split_sizes, "output")
        stage = Stage(self._rank, what)
        src = stage.inp(input)
        dst = stage.out(output)
        ins = self._split_views(src, in_splits)
        outs = self._split_views(dst, out_splits)
        return self._submit("all_to_all", lambda comm: self._algos.run(comm, "all_to_all", 0, outs, ins),
                            [output], stage, self._op_timeout(opts),
                            desc=str(input.dtype).replace("torch.", ""), opts=opts)

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------------ barrier
    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        self._validate("barrier")
        if self._run.lone_ok and not getattr(opts, "asyncOp", True):
            work = self._run.lone_barrier(self._op_timeout(opts))
            if work is not None:
                return work
        return self._submit("barrier", lambda comm: self._algos.run(comm, "barrier", 0), [],
                            Stage(), self._op_timeout(opts),
                            desc="", opts=opts)

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Finish queued collectives, flush sends, close every connection (idempotent)."""
        if self._shut:
            return
        self._shut = True
        frameworks.check(self._rank, self._size)
        if self._watch is not None:
            self._watch.close()
        self._run.stop(self._timeout)
        self._close_stagers()
        self._algos.close()
        self._ctx.close()

    def abort(self) -> None:
        """Close every connection now; pending operations fail."""
        if self._shut and self._ctx.closing:
            return
        self._shut = True
        if self._watch is not None:
            self._watch.close()
        self._ctx.close(timeout=0.0, reason="aborted")
        self._run.abort()

    def __del__(self):
        try:
            if not self._shut:
                self._shut = True
                if self._watch is not None:
                    self._watch.close()
                self._run.abort()
                self._ctx.close(timeout=1.0)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def create_process_group(dist_opts, backend_options=None) -> ProcessGroupLinerate:
    """The creator registered with torch (extended API): one group per call."""
    timeout = getattr(dist_opts, "timeout", None)
    name = str(getattr(dist_opts, "group_id", "") or "")
    options = backend_options if isinstance(backend_options, Options) else None
    ranks = list(getattr(dist_opts, "global_ranks_in_group", None) or [])
    return ProcessGroupLinerate(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                timeout, options, group_name=name, global_ranks=ranks or None)
