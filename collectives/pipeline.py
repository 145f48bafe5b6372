"""Pipelined staging: a large all_reduce of a CUDA tensor, chunk by chunk through pinned host
memory, the device copies beside the exchange.

The algorithms work on host memory. An all_reduce of a CUDA tensor of at least
LINERATE_STAGE_MIN_BYTES (and above LINERATE_FUSION_BYTES) moves in chunks of
LINERATE_STAGE_CHUNK_BYTES through a group's LINERATE_STAGE_BUFFERS pinned host buffers
(``Stager``: made on the first such op, reused by every later one), chunk k in buffer k mod D::

    caller   ready = an event on the caller's current stream (the input is read after it)
    the op   to_host(0)                       (waits for ready)
             for k in 0..K-1:
                 to_host(k+1)                  (waits for the copy that last read its buffer)
                 the host waits for to_host(k)
                 all_reduce of chunk k         (the group's algorithm, on the host buffer)
                 to_device(k)                  (its event frees buffer k mod D)
             done = an event after the last to_device
    wait()   the caller's current stream waits for done (the host waits only for the exchange)

The copies run on two side streams of the device (``CudaCopier``), so the copy to the host of
chunk k+1 and the copy back of chunk k-1 overlap the exchange of chunk k: the critical path
holds one chunk's copy each way instead of the whole tensor's. Smaller CUDA tensors, and every
other collective, keep one staged copy each way (collectives/stage.py ``Stage``); CPU tensors
never come here.

The device copies go through a copier. ``ThreadCopier`` is a stand-in on CPU tensors with the
same semantics (streams are threads that run their tasks in order, events are flags set when a
stream reaches them): ``install_standin`` makes CPU tensors take this path, so that the
chunking, the ordering, the buffer reuse and the error paths run without a GPU (the unit tests,
and ``python -m linerate.tools.dev.gpu_check --cpu``).
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch


# ---------------------------------------------------------------------------- copiers
class CudaCopier:
    """The device copies of one CUDA device: to the host on one side stream, back on another."""

    def __init__(self, device: torch.device):
        self.device = device
        self._to_host = torch.cuda.Stream(device)
        self._to_device = torch.cuda.Stream(device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def mark(self):
        """An event after the work queued so far on the caller's current stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def keep(self, t: torch.Tensor) -> None:
        """``t`` is used on the side streams: the caching allocator must not hand its memory
        to another tensor before their work on it is done."""
        t.record_stream(self._to_host)
        t.record_stream(self._to_device)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: list, chunk: int):
        s = self._to_host
        with torch.cuda.stream(s):
            for e in after:
                s.wait_event(e)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, chunk: int):
        s = self._to_device
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def done(self):
        """An event after every copy back issued so far."""
        ev = torch.cuda.Event()
        ev.record(self._to_device)
        return ev

    def wait(self, ev) -> None:
        """The host waits for ``ev`` (raises what the device reported)."""
        ev.synchronize()

    def stream_wait(self, ev) -> None:
        """The caller's current stream waits for ``ev``; the host does not."""
        torch.cuda.current_stream(self.device).wait_event(ev)

    def result_streams(self, ev):
        """A context in which a future's result is set after ``ev``: torch's CUDA futures
        record an event on the current stream when they are completed, and their users' streams
        wait for that one. A stream of torch's pool of its own that waits for ``ev`` (not the
        copy stream, which may hold later ops' copies by then)."""
        s = torch.cuda.Stream(self.device)
        s.wait_event(ev)
        return torch.cuda.stream(s)

    def close(self) -> None:
        pass


class _Event:
    """A stand-in CUDA event: set when its stream reaches it; carries a failed copy's error."""

    __slots__ = ("_flag", "error")

    def __init__(self):
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._flag.is_set()

    def fire(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag.set()

    def reached(self) -> None:
        """Wait until the event's stream reached it (whatever its copy did)."""
        self._flag.wait()

    def synchronize(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise self.error


class _Stream:
    """A stand-in CUDA stream: its tasks run in order, on a thread of its own (once closed, in
    the thread that queues them: nothing queued is ever left unrun)."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"linerate-standin-{name}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            task = self._q.get()
            if task is None:
                return
            task()

    def put(self, task) -> None:
        with self._lock:
            if not self._closed:
                self._q.put(task)
                return
        self._thread.join()
        task()

    def record(self) -> _Event:
        ev = _Event()
        self.put(ev.fire)
        return ev

    def wait_event(self, ev: _Event) -> None:
        self.put(ev.reached)

    def synchronize(self) -> None:
        self.record().reached()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._q.put(None)


class ThreadCopier:
    """A stand-in for ``CudaCopier`` on CPU tensors, with the same ordering semantics: a
    "caller" stream (the caller's current stream: ``launch`` queues work there, as a kernel
    launch would), a stream to the host and one back, each a thread that runs its tasks in
    order; events are set when their stream reaches them.

    ``delay_s``: every copy takes at least this long (what overlaps then shows; a dict:
    ``{"to_host": s, "to_device": s}``, per direction). ``fail``:
    ``{("to_host" | "to_device", chunk): exception}`` makes that copy fail (its event carries
    the error, as a CUDA error surfaces when the event is waited for), ``{"alloc": exception}``
    makes the host buffers' allocation fail. ``log`` (a list) receives ``(what, chunk)``
    entries in the order things happen: ``("issue to_host", k)`` when a copy is queued,
    ``("to_host", k)`` when it ran, likewise ``to_device``; ``note`` adds an entry of the
    caller's. ``blocking_wait``: ``stream_wait`` blocks the host until the copies back are done
    (CPU code reads results on the host, not on a stream); with False it queues the wait on
    the caller stream, as CUDA does."""

    def __init__(self, device: torch.device | None = None, *, delay_s: float | dict = 0.0,
                 fail: dict | None = None, log: list | None = None, blocking_wait: bool = True):
        self.device = device if device is not None else torch.device("cpu")
        self.delay_s = delay_s if isinstance(delay_s, dict) else {"to_host": delay_s,
                                                                  "to_device": delay_s}
        self.fail = dict(fail or {})
        self.log = log
        self.blocking_wait = blocking_wait
        self._lock = threading.Lock()
        self.caller = _Stream("caller")
        self._to_host = _Stream("to-host")
        self._to_device = _Stream("to-device")
        #: Host buffers made (the pool's bound: tests check it stays at LINERATE_STAGE_BUFFERS).
        self.allocated = 0

    def note(self, *entry) -> None:
        if self.log is not None:
            with self._lock:
                self.log.append(entry)

    def launch(self, fn) -> None:
        """Queue ``fn()`` on the caller stream (the stand-in of a kernel launch)."""
        self.caller.put(fn)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        err = self.fail.get("alloc")
        if err is not None:
            raise err
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def mark(self) -> _Event:
        return self.caller.record()

    def keep(self, t: torch.Tensor) -> None:
        pass

    def _copy(self, stream: _Stream, what: str, src, dst, after: list, chunk: int) -> _Event:
        ev = _Event()
        err = self.fail.get((what, chunk))
        delay = self.delay_s.get(what, 0.0)

        def task():
            for e in after:
                e.reached()
            if delay:
                time.sleep(delay)
            if err is not None:
                ev.fire(err)
                return
            dst.copy_(src)
            self.note(what, chunk)
            ev.fire()

        self.note(f"issue {what}", chunk)
        stream.put(task)
        return ev

    def to_host(self, src, dst, after: list, chunk: int) -> _Event:
        return self._copy(self._to_host, "to_host", src, dst, after, chunk)

    def to_device(self, src, dst, chunk: int) -> _Event:
        return self._copy(self._to_device, "to_device", src, dst, [], chunk)

    def done(self) -> _Event:
        return self._to_device.record()

    def wait(self, ev: _Event) -> None:
        ev.synchronize()

    def stream_wait(self, ev: _Event) -> None:
        if self.blocking_wait:
            ev.reached()
        else:
            self.caller.wait_event(ev)

    @contextlib.contextmanager
    def result_streams(self, ev: _Event):
        ev.reached()  # a CPU future has no stream to order its users after the copies
        yield

    def sync(self) -> None:
        """Wait until everything queued on the caller stream ran (torch.cuda.synchronize)."""
        self.caller.synchronize()

    def drain(self) -> None:
        """Wait until both copy streams ran everything queued on them so far."""
        self._to_host.synchronize()
        self._to_device.synchronize()

    def close(self) -> None:
        for s in (self.caller, self._to_host, self._to_device):
            s.close()


#: Makes the copier of a CPU "device" (``factory(device)``) while a stand-in is installed
#: (install_standin); None: CPU tensors are never pipelined.
_standin = None


def install_standin(factory=ThreadCopier) -> None:
    """Make all_reduces of CPU tensors take the pipelined path, with ``factory(device)`` as
    their groups' copier (a ``ThreadCopier``, or a function that makes one): for tests, and
    ``gpu_check --cpu``. Groups keep the copier they made first."""
    global _standin
    _standin = factory


def remove_standin() -> None:
    global _standin
    _standin = None


def standin_installed() -> bool:
    return _standin is not None


@contextlib.contextmanager
def standin(factory=ThreadCopier):
    """``install_standin(factory)`` for the duration of a ``with`` block."""
    install_standin(factory)
    try:
        yield
    finally:
        remove_standin()


def copier_for(device: torch.device):
    """The copier of ``device``: a ``CudaCopier`` for CUDA, the stand-in for CPU where one is
    installed, else None (the tensor is staged whole)."""
    if device.type == "cuda":
        return CudaCopier(device)
    if device.type == "cpu" and _standin is not None:
        return _standin(device)
    return None


# ---------------------------------------------------------------------------- the pool
class Stager:
    """One group's pipelined staging on one device: its copier, and its ``count`` host buffers
    of ``chunk_bytes`` (pinned, for CUDA), made by the first op and reused by every later one.
    ``free[i]``: the event after which buffer i may be written again (the last copy that read
    it), or None. Used by one op at a time (the group runs its collectives one after another)."""

    def __init__(self, copier, chunk_bytes: int, count: int):
        self.copier = copier
        self.chunk_bytes = chunk_bytes
        self.count = count
        self.bufs: list[torch.Tensor] = []
        self.free: list = []
        #: Pipelined ops run and chunks moved (``ProcessGroupLinerate.staging_stats``).
        self.ops = 0
        self.chunks = 0

    def ready(self, who: str) -> None:
        """Make the buffers if not yet: in the caller's thread, before anything is sent, so
        that a failure (pinned memory exhausted) leaves the group usable."""
        if self.bufs:
            return
        try:
            bufs = [self.copier.host_buffer(self.chunk_bytes) for _ in range(self.count)]
        except (RuntimeError, MemoryError) as e:
            raise RuntimeError(
                f"{who}: could not allocate {self.count} host buffers of {self.chunk_bytes} "
                f"bytes for pipelined staging (LINERATE_STAGE_BUFFERS={self.count} x "
                f"LINERATE_STAGE_CHUNK_BYTES={self.chunk_bytes}): {e}; smaller values, or "
                f"LINERATE_STAGING=whole, need less") from e
        self.bufs = bufs
        self.free = [None] * self.count

    def close(self) -> None:
        self.copier.close()
        self.bufs = []
        self.free = []


# ---------------------------------------------------------------------------- one op
class Staged:
    """One pipelined all_reduce of ``tensor`` (in place): made in the caller's thread (the
    event the input is read after, the buffers), run by the group (``run``), waited for by
    its Work (``stream_wait``, ``result_streams``). Stands where a ``Stage`` does."""

    def __init__(self, stager: Stager, tensor: torch.Tensor, rank: int, what: str):
        self.stager = stager
        self.copier = stager.copier
        self.rank = rank
        self.what = what
        self.devices = [tensor.device] if tensor.device.type != "cpu" else None
        self.name = (f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)} on "
                     f"{tensor.device}")
        stager.ready(f"rank {rank}: {what} of {self.name}")
        t = tensor.detach()
        #: A tensor that is not contiguous moves through a contiguous copy on its device (made
        #: on the caller's stream, before the event below), copied back into it at the end.
        self.back = None if t.is_contiguous() else t
        self.flat = (t if self.back is None else t.contiguous()).view(-1)
        self.ready = self.copier.mark()
        self.copier.keep(self.flat)
        if self.back is not None:
            self.copier.keep(self.back)
        #: The event after the last copy back (set by run).
        self.done = None

    #: What the Work waits on (work.on_streams): this object.
    @property
    def sync(self):
        return self

    def run(self, comm, reduce) -> None:
        """The op: ``reduce(comm, host_chunk)`` all-reduces each chunk in place, in order."""
        st, c, flat = self.stager, self.copier, self.flat
        n = flat.numel()
        es = flat.element_size()
        per = st.chunk_bytes // es
        count = -(-n // per)
        depth = len(st.bufs)
        hosts: list = [None] * count
        to_host: list = [None] * count

        def issue(j: int) -> None:
            i = j % depth
            a, b = j * per, min(n, (j + 1) * per)
            host = st.bufs[i][:(b - a) * es].view(flat.dtype)
            after = [self.ready] if j == 0 else []
            if st.free[i] is not None:
                after.append(st.free[i])
            hosts[j] = host
            to_host[j] = c.to_host(flat[a:b], host, after, j)

        issue(0)
        for k in range(count):
            if k + 1 < count:
                issue(k + 1)  # before this chunk's exchange: it overlaps it
            try:
                c.wait(to_host[k])
            except Exception as e:  # noqa: BLE001 - the device's error, named
                raise RuntimeError(
                    f"rank {self.rank}: {comm.desc}: copying chunk {k + 1} of {count} (elements "
                    f"{k * per}..{min(n, (k + 1) * per) - 1}) of {self.name} to host memory "
                    f"failed: {type(e).__name__}: {e}") from e
            reduce(comm, hosts[k])
            a, b = k * per, min(n, (k + 1) * per)
            st.free[k % depth] = c.to_device(hosts[k], flat[a:b], k)
            hosts[k] = to_host[k] = None
        if self.back is not None:
            c.to_device(self.flat.view(self.back.shape), self.back, count)
        self.done = c.done()
        st.ops += 1
        st.chunks += count

    def finish(self) -> None:
        """Nothing to copy back here: ``run`` queued the copies, the Work waits for them."""

    # -- the Work's side (collectives/work.py) ------------------------------------------------
    def stream_wait(self) -> None:
        self.copier.stream_wait(self.done)

    def result_streams(self):
        return self.copier.result_streams(self.done)
