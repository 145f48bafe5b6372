"""linerate whatif: would full link utilization make data-parallel training scale?

The what-if analysis of "Is Network the Bottleneck of Distributed Training?" (Zhang et al.,
2020), for a torch model profiled here (on the CPU, or with --device cuda on a GPU) or for a
per-layer backward timeline recorded elsewhere (--timeline):

1. a timeline: when each gradient is ready during backward (and its size), and the iteration
   time. Profiling runs forward + backward a few times with per-parameter hooks (CUDA events on
   a GPU); --timeline FILE reads the paper simulator's *.bk.log, this command's own --json
   output, or a torch.profiler Chrome trace of a training step (see docs/whatif.md);
2. put the gradients into Horovod-style fusion buckets, in ready order: a bucket is closed when
   it holds --bucket-bytes, or when --cycle-ms have passed since the previous one was closed;
3. for each link rate B, rank count N and compression ratio c, assume every all-reduce runs at
   full link rate:  T_ar(S) = 2(N-1)/N * S/(c*B) + (N-1) * t_add(S/N)  (+ 2(N-1)*latency),
   t_add measured on --device (the time to add two tensors of that size), or read from
   --add-cost FILE (bytes,seconds per line, interpolated), or S / --add-gbs; each bucket's
   all-reduce starts when the bucket is ready and the previous all-reduce has ended. With
   --gpus-per-host G (hosts of G ranks sharing one NIC of B, ranks linked at --intra-gbit inside
   a host) the flat ring and the two-level all-reduce are both scheduled and the faster taken;
4. overhead = end of the last all-reduce - end of backward (>= 0);
   scaling factor = T_iter / (T_iter + overhead).

Models: mlp, cnn, resnet18, transformer-small (defined here; torchvision is not needed), or
MODULE:CALLABLE -- CALLABLE(batch) returns (model, inputs) or (model, inputs, loss_fn); inputs
is a tensor or a tuple of tensors; the default loss is the mean of the (first) output.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from linerate.tools.argtypes import nonneg_float as _nonneg_float
from linerate.tools.argtypes import nonneg_int as _nonneg_int
from linerate.tools.argtypes import positive_float as _positive_float
from linerate.tools.argtypes import positive_int as _positive_int
from linerate.tools.argtypes import size as _size

BUILTIN_MODELS = ("mlp", "cnn", "resnet18", "transformer-small")
DEFAULT_GBIT = (1.0, 10.0, 25.0, 100.0)
DEFAULT_RANKS = (2, 4, 8, 16, 32, 64)
DEFAULT_COMPRESSION = (1.0,)
DEFAULT_BUCKET_BYTES = 64 << 20   # Horovod's HOROVOD_FUSION_THRESHOLD default
DEFAULT_CYCLE_MS = 5.0            # Horovod's cycle time in the paper's simulator
DEFAULT_BATCH = 32
INSTALL_HINT = "needs matplotlib, which is not installed: pip install matplotlib"


class TimelineError(ValueError):
    """Bad input in a timeline or add-cost file: the message names the file, line and problem."""


# ----------------------------------------------------------------------------- timelines

@dataclass
class Grad:
    name: str
    ready_s: float      # after the start of backward
    nbytes: int


@dataclass
class Timeline:
    """One iteration on one worker: gradients in ready order and the phase times (medians).
    ``fwd_s`` / ``opt_s`` are None where the source does not give them (a bk.log);
    ``iter_given_s``, when set, is the iteration time (``--iter-ms``, or a JSON's ``iter_s``)
    instead of forward + backward + optimizer."""
    grads: list[Grad]
    fwd_s: float | None
    bwd_s: float
    opt_s: float | None = 0.0
    params: int = 0
    unused: list[str] = field(default_factory=list)
    iter_given_s: float | None = None

    @property
    def iter_s(self) -> float | None:
        if self.iter_given_s is not None:
            return self.iter_given_s
        if self.fwd_s is None or self.opt_s is None:
            return None
        return self.fwd_s + self.bwd_s + self.opt_s

    @property
    def grad_bytes(self) -> int:
        return sum(g.nbytes for g in self.grads)


@dataclass
class Bucket:
    ready_s: float      # when its last gradient is ready (after the start of backward)
    nbytes: int
    grads: int


def make_buckets(grads: list[Grad], threshold_bytes: int,
                 cycle_s: float | None = DEFAULT_CYCLE_MS / 1e3) -> list[Bucket]:
    """Fuse gradients in ready order. A bucket is closed when it holds ``threshold_bytes`` or
    more, or when the gradient just added became ready ``cycle_s`` or more after the previous
    bucket was closed (``cycle_s`` None or 0: by size only); the last one at the last gradient.
    """
    out: list[Bucket] = []
    size = count = 0
    last_close = 0.0
    for g in sorted(grads, key=lambda g: g.ready_s):
        size += g.nbytes
        count += 1
        if size >= threshold_bytes or (cycle_s and g.ready_s - last_close >= cycle_s):
            out.append(Bucket(g.ready_s, size, count))
            size = count = 0
            last_close = g.ready_s
    if count:
        out.append(Bucket(max(g.ready_s for g in grads), size, count))
    return out


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(text)
    return x


def load_bk_log(path: str) -> Timeline:
    """The paper simulator's input (netx-repo/training-bottleneck, simulation/bk_time_logs):
    line 1 a comment, line 2 the number of batches, line 3 the number of layers, then per batch
    one line per gradient in backward order: ``wait_us,bytes`` (microseconds since the previous
    gradient was ready; its size). Several batches: the mean wait per layer. The iteration time
    is not in the file (``--iter-ms``)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()

    def count(i: int, what: str) -> int:
        text = lines[i].strip() if i < len(lines) else ""
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise TimelineError(f"{path}:{i + 1}: expected the number of {what} (an integer "
                                f">= 1), got {text!r}" + ("" if i < len(lines) else
                                                          " (the file ends there)"))
        return n

    batches, layers = count(1, "batches"), count(2, "layers")
    body = lines[3:]
    while body and not body[-1].strip():
        body.pop()
    want = batches * layers
    if len(body) != want:
        where = 3 + min(len(body), want) + 1
        raise TimelineError(f"{path}:{where}: expected {batches} batch(es) x {layers} layers "
                            f"= {want} lines of 'wait_us,bytes' after line 3, found "
                            f"{len(body)}")
    waits = [0.0] * layers
    sizes: list[int] = []
    for k, text in enumerate(body):
        lineno = k + 4
        parts = text.split(",")
        try:
            if len(parts) != 2:
                raise ValueError
            wait, nbytes = _finite(parts[0]), int(parts[1])
        except ValueError:
            raise TimelineError(f"{path}:{lineno}: expected 'wait_us,bytes' (a number and an "
                                f"integer), got {text!r}") from None
        if wait < 0 or nbytes < 0:
            raise TimelineError(f"{path}:{lineno}: negative wait or size in {text!r}")
        layer = k % layers
        if k < layers:
            sizes.append(nbytes)
        elif sizes[layer] != nbytes:
            raise TimelineError(f"{path}:{lineno}: layer {layer + 1} of batch "
                                f"{k // layers + 1} has {nbytes} bytes, batch 1 had "
                                f"{sizes[layer]}")
        waits[layer] += wait / batches
    grads, t = [], 0.0
    for i, (w, s) in enumerate(zip(waits, sizes)):
        t += w / 1e6
        grads.append(Grad(f"layer{i}", t, s))
    return Timeline(grads=grads, fwd_s=None, bwd_s=t, opt_s=None,
                    params=sum(sizes) // 4)


def _get(obj, key: str, where: str, path: str, kind=(int, float), minimum=None,
         optional=False):
    if not isinstance(obj, dict) or key not in obj or obj[key] is None:
        if optional:
            return None
        raise TimelineError(f"{path}: {where}{key} is missing")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, kind) or \
            (isinstance(v, float) and not math.isfinite(v)) or \
            (minimum is not None and v < minimum):
        want = {(int, float): "a number", int: "an integer", str: "a string",
                list: "a list"}.get(kind, str(kind))
        raise TimelineError(f"{path}: {where}{key} must be {want}"
                            + (f" >= {minimum}" if minimum is not None else "")
                            + f", got {v!r}")
    return v


def load_whatif_json(path: str, data: dict) -> tuple[Timeline, dict]:
    """This command's own --json output: its grads, phase times, iteration time, and t_add."""
    grads_in = _get(data, "grads", "", path, list)
    grads = []
    for i, g in enumerate(grads_in):
        where = f"grads[{i}]."
        grads.append(Grad(str(_get(g, "name", where, path, str, optional=True) or f"grad{i}"),
                          float(_get(g, "ready_s", where, path, minimum=0)),
                          int(_get(g, "nbytes", where, path, int, minimum=0))))
    if not grads:
        raise TimelineError(f"{path}: grads is empty")
    bwd = float(_get(data, "bwd_s", "", path, minimum=0))
    tl = Timeline(grads=sorted(grads, key=lambda g: g.ready_s),
                  fwd_s=_get(data, "fwd_s", "", path, minimum=0, optional=True),
                  bwd_s=bwd, opt_s=_get(data, "opt_s", "", path, minimum=0, optional=True),
                  params=int(_get(data, "params", "", path, int, minimum=0, optional=True) or
                             sum(g.nbytes for g in grads) // 4),
                  unused=[str(u) for u in data.get("unused") or []],
                  iter_given_s=_get(data, "iter_s", "", path, minimum=0, optional=True))
    meta = {"model": data.get("model"), "batch": data.get("batch"),
            "device": data.get("device")}
    if isinstance(data.get("t_add"), dict):
        meta["t_add"] = AddCost.from_dict(data["t_add"], path)
    return tl, meta


_DTYPE_BYTES = {"float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2,
                "bfloat16": 2, "long int": 8, "int": 4, "short int": 2, "signed char": 1,
                "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
                "c10::complex<double>": 16, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1}
ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
AUTOGRAD_EVENT = "autograd::engine::evaluate_function: "


def _start(e: dict) -> float:
    """A Chrome trace event's start, seconds (``ts`` is in microseconds)."""
    return float(e["ts"]) / 1e6


def _end(e: dict) -> float:
    return (float(e["ts"]) + float(e.get("dur", 0))) / 1e6


class _DeviceClock:
    """When work queued by the host up to a time had finished on the device: from the trace's
    kernels (cat kernel / gpu_memcpy / gpu_memset) and the launches (cuda_runtime,
    cuda_driver) that share their ``correlation`` id -- as a CUDA event recorded at that
    time would complete. Without device events: the host time."""

    def __init__(self, events: list[dict]):
        launches = {}
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in \
                    (e.get("args") or {}):
                launches[e["args"]["correlation"]] = _start(e)
        pairs = []
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                c = (e.get("args") or {}).get("correlation")
                if c in launches:
                    pairs.append((launches[c], _end(e)))
        pairs.sort()
        self.launch = [p[0] for p in pairs]
        self.done, best = [], -math.inf
        for _, end in pairs:
            best = max(best, end)
            self.done.append(best)

    @property
    def kernels(self) -> int:
        return len(self.launch)

    def __call__(self, t: float) -> float:
        import bisect
        i = bisect.bisect_right(self.launch, t)
        return max(t, self.done[i - 1]) if i else t


def load_profiler_trace(path: str, data: dict) -> tuple[Timeline, dict]:
    """A torch.profiler Chrome trace (``prof.export_chrome_trace``) of training steps, taken
    with ``record_shapes=True``. Per ProfilerStep (or the whole trace where there is none):
    backward runs from the first to the end of the last ``autograd::engine::evaluate_function``
    event; a gradient is ready when its ``torch::autograd::AccumulateGrad`` op ends (on a GPU:
    when the device has finished the work launched until then), its size from that op's input
    dims and type (an unknown type counts 4 bytes); forward = step start to backward start,
    optimizer = backward end to step end (without ProfilerStep events neither is known, nor the
    iteration: --iter-ms). Several steps: the median of each (the same gradients in the same
    order in every step)."""
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise TimelineError(f"{path}: traceEvents must be a list")
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
             and all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur"))]
    clock = _DeviceClock(spans)
    steps = sorted((_start(e), _end(e)) for e in spans
                   if str(e.get("name", "")).startswith("ProfilerStep#"))
    host = [e for e in spans if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    whole = not steps
    if whole:
        steps = [(min(_start(e) for e in host) if host else 0.0,
                  max(_end(e) for e in host) if host else 0.0)]
    per_step = []
    for n, (s0, s1) in enumerate(steps):
        inside = [e for e in host if s0 <= _start(e) <= s1]
        auto = [e for e in inside if str(e.get("name", "")).startswith(AUTOGRAD_EVENT)]
        acc = sorted((e for e in inside if e.get("name") == ACCUMULATE_GRAD),
                     key=lambda e: _end(e))
        if not auto or not acc:
            continue
        b0 = clock(min(_start(e) for e in auto))
        b1 = clock(max(_end(e) for e in auto))
        grads = []
        for i, e in enumerate(acc):
            args = e.get("args") or {}
            dims, types = args.get("Input Dims"), args.get("Input type")
            if not dims or not isinstance(dims[0], list) or not types:
                raise TimelineError(
                    f"{path}: {ACCUMULATE_GRAD} events carry no input shapes: profile with "
                    "torch.profiler.profile(record_shapes=True, ...)")
            nbytes = math.prod(int(d) for d in dims[0]) * _DTYPE_BYTES.get(
                str(types[0]).lower(), 4)
            grads.append(Grad(f"grad{i}[{'x'.join(str(d) for d in dims[0])}]",
                              clock(_end(e)) - b0,
                              nbytes))
        per_step.append((grads, None if whole else b0 - clock(s0), b1 - b0,
                         None if whole else clock(s1) - b1))
    if not per_step:
        raise TimelineError(
            f"{path}: no backward found: no step has both '{AUTOGRAD_EVENT}...' and "
            f"'{ACCUMULATE_GRAD}' events (profile the backward pass with "
            "activities=[ProfilerActivity.CPU, ...] and record_shapes=True)")
    if len({len(g) for g, *_ in per_step}) > 1:
        raise TimelineError(f"{path}: the steps have different numbers of gradients "
                            f"({sorted({len(g) for g, *_ in per_step})}): profile steps of "
                            "the same model")
    first = per_step[0][0]
    grads = [Grad(g.name, statistics.median(s[0][i].ready_s for s in per_step), g.nbytes)
             for i, g in enumerate(first)]

    def med(k: int) -> float | None:
        return None if whole else statistics.median(s[k] for s in per_step)

    tl = Timeline(grads=sorted(grads, key=lambda g: g.ready_s), fwd_s=med(1),
                  bwd_s=statistics.median(s[2] for s in per_step),
                  opt_s=med(3), params=sum(g.nbytes for g in grads) // 4)
    return tl, {"steps": len(per_step), "device": "cuda" if clock.kernels else "cpu"}


def load_timeline(path: str) -> tuple[Timeline, dict]:
    """Read a bk.log, a whatif --json output or a torch.profiler Chrome trace, by content.
    Returns the timeline and what else the file gives (``format``, maybe ``t_add``, ...)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TimelineError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column "
                                f"{e.colno})") from None
        if isinstance(data, list):      # Chrome's other trace form: the events alone
            data = {"traceEvents": data}
        if isinstance(data, dict) and "traceEvents" in data:
            tl, meta = load_profiler_trace(path, data)
            meta["format"] = "torch-profiler"
        elif isinstance(data, dict) and "grads" in data:
            tl, meta = load_whatif_json(path, data)
            meta["format"] = "whatif-json"
        else:
            raise TimelineError(f"{path}: JSON that is neither a torch.profiler trace "
                                "(traceEvents) nor linerate whatif --json output (grads)")
    else:
        tl, meta = load_bk_log(path), {"format": "bk.log"}
    if not tl.grads:
        raise TimelineError(f"{path}: the timeline has no gradients")
    return tl, meta


# ----------------------------------------------------------------------------- all-reduce

class AddCost:
    """t_add(nbytes): time to add two float32 tensors of ``nbytes`` each, piecewise linear
    between measured sizes (as numpy.interp); below the smallest, its time (a fixed cost);
    above the largest, that size's time per byte. ``rate_bytes_s`` instead: nbytes / rate."""

    def __init__(self, points: list[tuple[int, float]] | None = None,
                 rate_bytes_s: float | None = None, source: str = "measured"):
        if (points is None) == (rate_bytes_s is None):
            raise ValueError("give measured points or a rate")
        self.points = sorted(points) if points else None
        self.rate = rate_bytes_s
        self.source = source

    @classmethod
    def from_file(cls, path: str) -> AddCost:
        """A table of ``bytes,seconds`` lines (the paper's cuda_vec_add.log); blank lines and
        lines starting with # are skipped."""
        points: dict[float, tuple[float, int]] = {}
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                parts = text.split(",")
                try:
                    if len(parts) != 2:
                        raise ValueError
                    nbytes, secs = _finite(parts[0]), _finite(parts[1])
                except ValueError:
                    raise TimelineError(f"{path}:{lineno}: expected 'bytes,seconds' (two "
                                        f"numbers), got {text!r}") from None
                if nbytes <= 0 or secs < 0:
                    raise TimelineError(f"{path}:{lineno}: bytes must be positive and seconds "
                                        f"not negative, got {text!r}")
                if nbytes in points:
                    raise TimelineError(f"{path}:{lineno}: {nbytes:g} bytes given twice "
                                        f"(also on line {points[nbytes][1]})")
                points[nbytes] = (secs, lineno)
        if not points:
            raise TimelineError(f"{path}:1: no 'bytes,seconds' lines")
        return cls([(s, t) for s, (t, _) in points.items()],
                   source=os.path.basename(path))

    @classmethod
    def from_dict(cls, d: dict, path: str = "JSON") -> AddCost:
        """The ``t_add`` of a --json output."""
        rate, points = d.get("rate_bytes_s"), d.get("points")
        source = str(d.get("source") or "measured")
        if rate is not None:
            rate = float("inf") if rate == "inf" else rate
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                raise TimelineError(f"{path}: t_add.rate_bytes_s must be a positive number or "
                                    f"\"inf\", got {d.get('rate_bytes_s')!r}")
            return cls(rate_bytes_s=float(rate), source=source)
        try:
            pts = [(float(s), float(t)) for s, t in points]
            if not pts or any(not (s > 0 and t >= 0 and math.isfinite(s) and math.isfinite(t))
                              for s, t in pts):
                raise ValueError
        except (TypeError, ValueError):
            raise TimelineError(f"{path}: t_add.points must be a list of [bytes, seconds] "
                                f"pairs, got {points!r}") from None
        return cls(pts, source=source)

    def __call__(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        if self.rate is not None:
            return nbytes / self.rate if self.rate != float("inf") else 0.0
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if nbytes <= s1:
                return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
        s, t = pts[-1]
        return t * nbytes / s

    def describe(self) -> str:
        if self.rate is not None:
            return ("t_add = 0 (given)" if self.rate == float("inf")
                    else f"t_add at {self.rate / 1e9:g} GB/s (given)")
        shown = [p for p in self.points if p[0] in (1 << 20, 16 << 20)] or self.points[-1:]
        how = ("one thread, measured" if self.source == "measured" else
               self.source if self.source.startswith("measured") else
               f"{self.source}, {len(self.points)} sizes, interpolated")
        return f"t_add ({how}): " + ", ".join(f"{_bytes(s)} in {t * 1e6:.1f} us"
                                              for s, t in shown)

    def to_dict(self) -> dict:
        rate = "inf" if self.rate == float("inf") else self.rate
        return {"points": self.points, "rate_bytes_s": rate, "source": self.source}


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n:g} B"


def measure_add(min_bytes: int = 1 << 10, max_bytes: int = 64 << 20,
                device: str = "cpu") -> AddCost:
    """Time of ``a.add_(b)`` on float32 tensors of each size (powers of 4 from ``min_bytes``):
    the fastest of several runs -- what this device can do, as the analysis assumes of the
    links; on a shared machine the median mostly measures the other processes. On the CPU on
    one thread (as one reduction thread runs it; no thread-pool wake-ups), timed with
    perf_counter; on a CUDA device each add timed alone with CUDA events (the kernel's time
    on the device, launches not counted). Made non-decreasing in size."""
    import torch
    cuda = torch.device(device).type == "cuda"
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    points = []
    try:
        size = min_bytes
        while size <= max_bytes:
            a = torch.ones(size // 4, device=device)
            b = torch.ones(size // 4, device=device)
            reps = max(10, min(200, (32 << 20) // size))
            a.add_(b)
            best = float("inf")
            if cuda:
                marks = [(torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                for e0, e1 in marks:
                    e0.record()
                    a.add_(b)
                    e1.record()
                torch.cuda.synchronize(device)
                best = min(e0.elapsed_time(e1) / 1e3 for e0, e1 in marks)
            else:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    a.add_(b)
                    best = min(best, time.perf_counter() - t0)
            points.append((size, max(best, points[-1][1] if points else 0.0)))
            size *= 4
    finally:
        torch.set_num_threads(threads)
    return AddCost(points, source="measured" if not cuda else f"measured on {device}")


def allreduce_time(nbytes: float, ranks: int, bits_per_s: float, t_add,
                   compression: float = 1.0, latency_s: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` on ``ranks`` workers at full link rate:
    2(N-1)/N * S / (c*B) + (N-1) * t_add(S/N) + 2(N-1) * latency (one worker per host:
    linerate.tools.model.flat_ring_allreduce)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return _flat(nbytes, ranks, 1, bits_per_s, bits_per_s, t_add, compression, latency_s)


def host_shape(ranks: int, gpus_per_host: int) -> tuple[int, int]:
    """(ranks per host G, hosts H) with G * H = ranks; fewer ranks than G: one host."""
    g = min(gpus_per_host, ranks)
    if ranks % g:
        raise ValueError(f"{ranks} ranks do not fill hosts of {gpus_per_host} GPUs")
    return g, ranks // g


def _hosts(ranks: int, gpus_per_host: int, intra_bits_per_s: float, latency_s: float):
    from linerate.tools.model import IntraHost
    g, hosts = host_shape(ranks, gpus_per_host)
    return [g] * hosts, IntraHost("links", intra_bits_per_s / 8, latency_s)


def _flat(nbytes, ranks, gpus_per_host, bits_per_s, intra_bits_per_s, t_add, compression,
          latency_s) -> float:
    from linerate.tools.model import flat_ring_allreduce
    layout, intra = _hosts(ranks, gpus_per_host, intra_bits_per_s, latency_s)
    return flat_ring_allreduce(nbytes, layout, bits_per_s / 8, intra, latency_s, t_add,
                               compression)["seconds"]


def flat_ring_time(nbytes: float, ranks: int, gpus_per_host: int, bits_per_s: float,
                   intra_bits_per_s: float, t_add, compression: float = 1.0,
                   latency_s: float = 0.0) -> float:
    """The flat ring over all P ranks, neighbours on one host next to each other: every step
    sends S/P on every hop at once, one of them per host through its NIC (B) and the others
    inside the host (B_intra), so a step takes S/P over min(B, B_intra) (B_intra alone when
    all ranks are on one host). The formula is linerate.tools.model.flat_ring_allreduce's
    (hosts of G ranks joined by rank links of B_intra), shared with `linerate model`."""
    return _flat(nbytes, ranks, gpus_per_host, bits_per_s, intra_bits_per_s, t_add,
                 compression, latency_s)


def two_level_time(nbytes: float, ranks: int, gpus_per_host: int, bits_per_s: float,
                   intra_bits_per_s: float, t_add, compression: float = 1.0,
                   latency_s: float = 0.0) -> float:
    """Intra-host reduce-scatter over G ranks, inter-host all-reduce of each rank's S/G over the
    H hosts (G rings at once, one per local rank, sharing the host's NIC: S/H per step per NIC),
    intra-host all-gather:
    2(G-1)/G * S/(c*B_intra) + (G-1) t_add(S/G) + 2(H-1)/H * S/(c*B) + (H-1) t_add(S/P)
    (+ 2(G-1 + H-1) * latency). The formula is linerate.tools.model.two_level_allreduce's,
    shared with `linerate model` (which also knows hosts whose ranks share memory)."""
    from linerate.tools.model import two_level_allreduce
    layout, intra = _hosts(ranks, gpus_per_host, intra_bits_per_s, latency_s)
    return two_level_allreduce(nbytes, layout, bits_per_s / 8, intra, latency_s, t_add,
                               compression)["seconds"]


def schedule(buckets: list[Bucket], bwd_s: float, ranks: int, bits_per_s: float, t_add,
             compression: float = 1.0, latency_s: float = 0.0, ar_time=None) -> dict:
    """All-reduce each bucket as soon as it is ready and the previous all-reduce has ended;
    ``ar_time(nbytes)`` (default: the ring of ``allreduce_time``) is one all-reduce's time.

    Returns {"overhead_s": max(0, last end - bwd_s), "ends": [...], "comm_s": sum of T_ar}."""
    if ar_time is None:
        def ar_time(nbytes):
            return allreduce_time(nbytes, ranks, bits_per_s, t_add, compression, latency_s)
    end = 0.0
    ends, total = [], 0.0
    for b in buckets:
        t = ar_time(b.nbytes)
        end = max(b.ready_s, end) + t
        ends.append(end)
        total += t
    return {"overhead_s": max(0.0, end - bwd_s) if buckets else 0.0, "ends": ends,
            "comm_s": total}


def scaling_factor(iter_s: float, overhead_s: float) -> float:
    return iter_s / (iter_s + overhead_s) if iter_s + overhead_s > 0 else 1.0


def analyze(timeline: Timeline, buckets: list[Bucket], gbits, ranks, compressions, t_add,
            latency_s: float = 0.0, gpus_per_host: int = 1,
            intra_gbit: float | None = None) -> list[dict]:
    """One row per (compression, ranks, gbit). With ``gpus_per_host`` > 1 the flat ring and the
    two-level all-reduce are both scheduled, the one with the smaller overhead (then the
    smaller communication time; flat on a tie) is taken: ``algorithm`` says which, and
    ``flat_scaling_factor`` / ``two_level_scaling_factor`` give both."""
    out = []
    iter_s = timeline.iter_s
    for c in compressions:
        for n in ranks:
            for gb in gbits:
                row = {"compression": c, "ranks": n, "gbit": gb}
                if gpus_per_host <= 1:
                    s = schedule(buckets, timeline.bwd_s, n, gb * 1e9, t_add, c, latency_s)
                    row["algorithm"] = "ring"
                else:
                    both = {}
                    for name, fn in (("flat", flat_ring_time), ("two-level", two_level_time)):
                        both[name] = schedule(
                            buckets, timeline.bwd_s, n, gb * 1e9, t_add, c, latency_s,
                            ar_time=lambda S, fn=fn: fn(S, n, gpus_per_host, gb * 1e9,
                                                        intra_gbit * 1e9, t_add, c,
                                                        latency_s))
                    pick = min(both, key=lambda k: (both[k]["overhead_s"], both[k]["comm_s"],
                                                    k != "flat"))
                    s = both[pick]
                    row["algorithm"] = pick
                    row["flat_scaling_factor"] = scaling_factor(
                        iter_s, both["flat"]["overhead_s"])
                    row["two_level_scaling_factor"] = scaling_factor(
                        iter_s, both["two-level"]["overhead_s"])
                row.update({"overhead_s": s["overhead_s"], "comm_s": s["comm_s"],
                            "scaling_factor": scaling_factor(iter_s, s["overhead_s"])})
                out.append(row)
    return out


# ----------------------------------------------------------------------------- models

def _models():
    """The built-in models, defined here so that torch is imported only when needed."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, d_in=784, hidden=2048, layers=3, d_out=10):
            super().__init__()
            dims = [d_in] + [hidden] * layers
            self.body = nn.Sequential(*[m for a, b in zip(dims, dims[1:])
                                        for m in (nn.Linear(a, b), nn.ReLU())])
            self.head = nn.Linear(hidden, d_out)

        def forward(self, x):
            return self.head(self.body(x))

    class SmallCNN(nn.Module):
        def __init__(self, classes=10):
            super().__init__()

            def block(a, b):
                return nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False),
                                     nn.BatchNorm2d(b), nn.ReLU())
            self.features = nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2),
                                          block(64, 128), nn.MaxPool2d(2), block(128, 128),
                                          nn.AdaptiveAvgPool2d(4))
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(128 * 16, 256), nn.ReLU(),
                                      nn.Linear(256, classes))

        def forward(self, x):
            return self.head(self.features(x))

    class Basic(nn.Module):
        """Two 3x3 convolutions with a shortcut (ResNet's basic block)."""

        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.short = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                        nn.BatchNorm2d(c_out))
                          if stride != 1 or c_in != c_out else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.short(x))

    class ResNet18(nn.Module):
        """ResNet-18 for ImageNet-sized inputs: 4 stages of 2 basic blocks, 11.7M params."""

        def __init__(self, classes=1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            stages, c_in = [], 64
            for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                stages += [Basic(c_in, c_out, stride), Basic(c_out, c_out, 1)]
                c_in = c_out
            self.stages = nn.Sequential(*stages)
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(512, classes))

        def forward(self, x):
            return self.head(self.stages(self.stem(x)))

    class SmallTransformer(nn.Module):
        """A 4-layer encoder language model: d_model 256, 4 heads, vocabulary 8192."""

        def __init__(self, vocab=8192, d=256, heads=4, layers=4, ff=1024, seq=128):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(seq, d))
            layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab)

        def forward(self, tokens):
            h = self.embed(tokens) + self.pos[: tokens.shape[1]]
            return self.lm_head(self.norm(self.encoder(h)))

    return {"mlp": MLP, "cnn": SmallCNN, "resnet18": ResNet18,
            "transformer-small": SmallTransformer}


def build(spec: str, batch: int, image_size: int | None = None, device: str = "cpu"):
    """(model, inputs tuple, loss_fn) for a built-in name or MODULE:CALLABLE, on ``device``
    (a user's loss_fn gets the model's output on that device)."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    if spec in BUILTIN_MODELS:
        model = _models()[spec]().to(device)
        if spec == "mlp":
            x = torch.randn(batch, 784, generator=g).to(device)
            y = torch.randint(0, 10, (batch,), generator=g).to(device)
            return model, (x,), lambda out: F.cross_entropy(out, y)
        if spec in ("cnn", "resnet18"):
            size = image_size or (32 if spec == "cnn" else 224)
            classes = 10 if spec == "cnn" else 1000
            x = torch.randn(batch, 3, size, size, generator=g).to(device)
            y = torch.randint(0, classes, (batch,), generator=g).to(device)
            return model, (x,), lambda out: F.cross_entropy(out, y)
        tokens = torch.randint(0, 8192, (batch, 128), generator=g).to(device)
        target = torch.randint(0, 8192, (batch, 128), generator=g).to(device)
        return model, (tokens,), lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                              target.reshape(-1))
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}: choose from {', '.join(BUILTIN_MODELS)} or "
                         "give MODULE:CALLABLE")
    mod_name, fn_name = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec!r}: {e}") from None
    got = fn(batch)
    if not isinstance(got, tuple) or len(got) not in (2, 3) or \
            not isinstance(got[0], torch.nn.Module):
        raise ValueError(f"{spec} must return (model, inputs) or (model, inputs, loss_fn), "
                         f"got {type(got).__name__}")
    model, inputs = got[0].to(device), got[1]
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    loss_fn = got[2] if len(got) == 3 else _default_loss
    return model, inputs, loss_fn


def _default_loss(out):
    import torch
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model returned {type(out).__name__}; give a loss_fn")
    return out.float().mean()


def check_device(device: str) -> str:
    """``device`` if torch can use it here, else a ValueError that says why."""
    import torch
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise ValueError(f"--device {device}: CUDA is not available here ({why}); profile "
                             "on the GPU machine with --json and analyse that file here with "
                             "--timeline")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} CUDA "
                             "device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device}: only cpu and cuda are supported")
    return device


def record_timeline(model, inputs: tuple, loss_fn, iters: int = 3,
                    warmup: int = 1, device: str = "cpu") -> Timeline:
    """Per-parameter gradient ready times (median over ``iters`` iterations after ``warmup``)
    from post-accumulate-grad hooks, and the forward, backward and SGD step times.

    On the CPU the hooks and phases read perf_counter. On a CUDA device each reads a CUDA event
    recorded on the current stream (the hooks run on the autograd engine's thread, with the
    gradient's stream current), so a time is when the device has finished the work queued
    before it, not when the host queued it; the iteration is synchronized before the events
    are read (the paper's profiler synchronized inside the hook instead, one parameter per
    run)."""
    import torch
    cuda = torch.device(device).type == "cuda"
    if cuda:
        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def since(a, b) -> float:
            return a.elapsed_time(b) / 1e3
    else:
        mark = time.perf_counter

        def since(a, b) -> float:
            return b - a
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in params], lr=1e-4, momentum=0.9)
    ready: dict = {}
    handles = [p.register_post_accumulate_grad_hook(
        lambda _p, name=n: ready.__setitem__(name, mark())) for n, p in params]
    samples: dict[str, list[float]] = {n: [] for n, _ in params}
    fwd, bwd, step = [], [], []
    try:
        for i in range(warmup + iters):
            ready.clear()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = mark()
            loss = loss_fn(model(*inputs))
            t1 = mark()
            loss.backward()
            t2 = mark()
            opt.step()
            t3 = mark()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:
                fwd.append(since(t0, t1))
                bwd.append(since(t1, t2))
                step.append(since(t2, t3))
                for n, t in ready.items():
                    samples[n].append(since(t1, t))
    finally:
        for h in handles:
            h.remove()
    sizes = {n: p.numel() * p.element_size() for n, p in params}
    grads = [Grad(n, statistics.median(ts), sizes[n]) for n, ts in samples.items() if ts]
    grads.sort(key=lambda g: g.ready_s)
    return Timeline(grads=grads, fwd_s=statistics.median(fwd), bwd_s=statistics.median(bwd),
                    opt_s=statistics.median(step), params=sum(p.numel() for _, p in params),
                    unused=[n for n, ts in samples.items() if not ts])


# ----------------------------------------------------------------------------- output

def format_report(name: str, batch: int | None, timeline: Timeline, buckets: list[Bucket],
                  t_add: AddCost, results: list[dict], gbits, ranks, compressions,
                  threshold: int, cycle_ms: float, where: str = "iteration on this CPU",
                  gpus_per_host: int = 1, intra_gbit: float | None = None,
                  iter_note: str = "") -> str:
    ms = 1e3
    tl = timeline
    lines = [f"# whatif: {name}" + (f", batch {batch}" if batch else "")
             + f": {tl.params / 1e6:.2f}M parameters, "
             f"{tl.grad_bytes / 2**20:.2f} MiB of gradients in {len(buckets)} bucket(s) "
             f"({threshold / 2**20:g} MiB threshold"
             + (f", {cycle_ms:g} ms cycle)" if cycle_ms else ", no cycle)")]
    phases = [f"{k} {v * ms:.1f}" for k, v in (("forward", tl.fwd_s), ("backward", tl.bwd_s),
                                               ("optimizer", tl.opt_s)) if v is not None]
    lines.append(f"# {where}: {tl.iter_s * ms:.1f} ms{iter_note} ("
                 + ", ".join(phases) + f"); {t_add.describe()}")
    if gpus_per_host > 1:
        lines.append(f"# hosts of {gpus_per_host} GPUs sharing one NIC at the rate below, "
                     f"{intra_gbit:g} Gbit/s between the GPUs of a host; each cell takes the "
                     "faster of the flat ring (F) and the two-level all-reduce (2L)")
    if tl.unused:
        lines.append(f"# {len(tl.unused)} parameter(s) got no gradient and are left out")
    lines.append("# buckets (ready ms after backward start / MiB): " + ", ".join(
        f"{b.ready_s * ms:.1f}/{b.nbytes / 2**20:.2f}" for b in buckets[:12])
        + (", ..." if len(buckets) > 12 else ""))
    tag = {"ring": "", "flat": " F", "two-level": " 2L"}
    width = max(11 if gpus_per_host <= 1 else 13,
                max(len(f"{g:g} Gbit/s") for g in gbits) + 2)
    for c in compressions:
        lines.append(f"scaling factor, full link utilization, compression {c:g}x:")
        lines.append(f"{'ranks':>6}" + "".join(f"{f'{g:g} Gbit/s':>{width}}" for g in gbits))
        for n in ranks:
            row = [r for r in results if r["compression"] == c and r["ranks"] == n]
            lines.append(f"{n:>6}" + "".join(
                f"{format(r['scaling_factor'], '.3f') + tag[r['algorithm']]:>{width}}"
                for r in row))
    lines.append("# scaling factor = T_iter / (T_iter + overhead); overhead = end of the last "
                 "all-reduce - end of backward")
    return "\n".join(lines)


def plot(path: str, name: str, results: list[dict], gbits, ranks, compressions) -> None:
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(f"--plot {INSTALL_HINT}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(compressions), figsize=(5.5 * len(compressions), 4),
                             squeeze=False, sharey=True)
    for ax, c in zip(axes[0], compressions):
        for gb in gbits:
            rows = [next(r for r in results if r["compression"] == c and r["ranks"] == n and
                         r["gbit"] == gb) for n in ranks]
            line, = ax.plot(ranks, [r["scaling_factor"] for r in rows], marker="o",
                            label=f"{gb:g} Gbit/s")
            two = [(n, r["scaling_factor"]) for n, r in zip(ranks, rows)
                   if r["algorithm"] == "two-level"]
            if two:   # two-level picks: filled squares
                ax.plot(*zip(*two), linestyle="none", marker="s", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ranks))
        ax.set_xticklabels([str(n) for n in ranks])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("ranks")
        ax.set_title(f"compression {c:g}x")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left", fontsize="small")
    axes[0][0].set_ylabel("scaling factor (full link utilization)")
    fig.suptitle(f"what-if: {name}"
                 + ("  (squares: two-level all-reduce)"
                    if any(r["algorithm"] == "two-level" for r in results) else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "whatif", help="scaling factor of a model at full link utilization (what-if analysis)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"{'|'.join(BUILTIN_MODELS)} or MODULE:CALLABLE (default mlp)")
    parser.add_argument("--timeline", metavar="FILE", default=None,
                        help="read the backward timeline instead of profiling: the paper "
                             "simulator's *.bk.log, this command's --json output, or a "
                             "torch.profiler Chrome trace (record_shapes=True)")
    parser.add_argument("--device", default="cpu",
                        help="profile the model, and measure t_add, on this device: cpu "
                             "(default) or cuda[:N] (CUDA events)")
    parser.add_argument("--iter-ms", type=_positive_float, default=None,
                        help="single-worker iteration time, ms: needed when the timeline has "
                             "none (a bk.log), else replaces the timeline's")
    parser.add_argument("--batch", type=_positive_int, default=None,
                        help=f"batch per worker (default {DEFAULT_BATCH})")
    parser.add_argument("--image-size", type=_positive_int, default=None,
                        help="input height and width of cnn (default 32) and resnet18 (224)")
    parser.add_argument("--iters", type=_positive_int, default=3,
                        help="measured iterations (default 3; medians are used)")
    parser.add_argument("--warmup", type=_nonneg_int, default=1,
                        help="iterations before measuring (default 1)")
    parser.add_argument("--gbit", type=_float_list, default=list(DEFAULT_GBIT),
                        help="link rates (per host NIC), Gbit/s (default 1,10,25,100)")
    parser.add_argument("--ranks", type=_int_list, default=list(DEFAULT_RANKS),
                        help="rank counts (default 2,4,8,16,32,64)")
    parser.add_argument("--compression", type=_float_list, default=list(DEFAULT_COMPRESSION),
                        help="gradient compression ratios (default 1)")
    parser.add_argument("--gpus-per-host", type=_positive_int, default=1,
                        help="ranks per host, sharing its NIC (default 1); > 1 needs "
                             "--intra-gbit and compares the flat ring with the two-level "
                             "all-reduce")
    parser.add_argument("--intra-gbit", type=_positive_float, default=None,
                        help="rate between the ranks of one host, Gbit/s per rank")
    parser.add_argument("--bucket-bytes", type=_size, default=DEFAULT_BUCKET_BYTES,
                        help="fusion threshold (default 64M, Horovod's)")
    parser.add_argument("--cycle-ms", type=_nonneg_float, default=DEFAULT_CYCLE_MS,
                        help="also close a bucket this long after the previous one (default "
                             f"{DEFAULT_CYCLE_MS:g}; 0: by size only)")
    parser.add_argument("--add-cost", metavar="FILE", default=None,
                        help="reduction cost table: 'bytes,seconds' per line (the paper's "
                             "cuda_vec_add.log), interpolated")
    parser.add_argument("--add-gbs", type=_positive_float, default=None,
                        help="take t_add(S) = S / (this many GB/s) instead of measuring it "
                             "(inf: no reduction cost)")
    parser.add_argument("--latency-us", type=_nonneg_float, default=0.0,
                        help="per-step latency added as 2(N-1)*latency (default 0, as the "
                             "paper)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="scaling factor against ranks, one line per rate (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def _fail(msg: str, rc: int = 2) -> int:
    print(f"linerate whatif: error: {msg}", file=sys.stderr)
    return rc


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this result from the --json output (saved as
    WHATIF.json): the same grid and settings, the timeline and t_add read back from it."""
    parts = ["linerate", "whatif", "--timeline", "WHATIF.json",
             "--ranks", ",".join(str(n) for n in args.ranks),
             "--gbit", ",".join(f"{g:g}" for g in args.gbit),
             "--compression", ",".join(f"{c:g}" for c in args.compression),
             "--bucket-bytes", str(args.bucket_bytes), "--cycle-ms", f"{args.cycle_ms:g}"]
    if args.latency_us:
        parts += ["--latency-us", f"{args.latency_us:g}"]
    if args.gpus_per_host > 1:
        parts += ["--gpus-per-host", str(args.gpus_per_host),
                  "--intra-gbit", f"{args.intra_gbit:g}"]
    return " ".join(shlex.quote(p) for p in parts + ["--json"])


def run(args: argparse.Namespace) -> int:
    if args.plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            return _fail(f"--plot {INSTALL_HINT}")
    if args.gpus_per_host > 1 and args.intra_gbit is None:
        return _fail(f"--gpus-per-host {args.gpus_per_host} needs --intra-gbit (the rate "
                     "between the GPUs of a host)")
    if args.gpus_per_host == 1 and args.intra_gbit is not None:
        return _fail("--intra-gbit needs --gpus-per-host G > 1")
    for n in args.ranks:
        try:
            host_shape(n, args.gpus_per_host)
        except ValueError as e:
            return _fail(f"--ranks {n}: {e} (--gpus-per-host {args.gpus_per_host})")
    if args.add_cost and args.add_gbs is not None:
        return _fail("give --add-cost or --add-gbs, not both")
    if args.timeline and (args.model or args.batch or args.image_size):
        return _fail("--timeline replaces profiling: drop --model, --batch and --image-size")
    meta: dict = {}
    try:
        device = check_device(args.device)
        t_add = (AddCost.from_file(args.add_cost) if args.add_cost else
                 AddCost(rate_bytes_s=args.add_gbs * 1e9, source="given")
                 if args.add_gbs is not None else None)
        if args.timeline:
            timeline, meta = load_timeline(args.timeline)
            name = meta.get("model") or os.path.basename(args.timeline)
            batch = meta.get("batch")
            where = "timeline " + (
                "from the paper simulator's log" if meta["format"] == "bk.log" else
                "from whatif JSON" + (f", profiled on {meta['device']}" if meta.get("device")
                                      else "") if meta["format"] == "whatif-json" else
                f"from a torch.profiler trace, {meta['steps']} step(s) on {meta['device']}") \
                + "; iteration"
        else:
            name, batch = args.model or "mlp", args.batch or DEFAULT_BATCH
            model, inputs, loss_fn = build(name, batch, args.image_size, device)
            where = "iteration on " + ("this CPU" if device == "cpu" else device)
    except (ValueError, OSError) as e:    # TimelineError is a ValueError
        if isinstance(e, OSError):
            return _fail(f"cannot read {e.filename}: {e.strerror}")
        return _fail(str(e))
    if not args.timeline:
        timeline = record_timeline(model, inputs, loss_fn, args.iters, args.warmup, device)
        if not timeline.grads:
            return _fail("the model produced no gradients", 1)
        meta = {"format": "profiled", "device": device}
    iter_note = ""
    if args.iter_ms is not None:
        timeline.iter_given_s = args.iter_ms / 1e3
        iter_note = " (--iter-ms)"
    elif args.timeline and timeline.iter_given_s is not None:
        iter_note = " (from the file)"
    if timeline.iter_s is None:
        return _fail(f"{args.timeline} gives no iteration time (only the backward pass): "
                     "give --iter-ms, the single-worker iteration time")
    if t_add is None:
        t_add = meta.get("t_add") or measure_add(
            max_bytes=max(1 << 20, min(64 << 20, timeline.grad_bytes)), device=device)
    cycle_s = args.cycle_ms / 1e3 if args.cycle_ms else None
    buckets = make_buckets(timeline.grads, args.bucket_bytes, cycle_s)
    results = analyze(timeline, buckets, args.gbit, args.ranks, args.compression, t_add,
                      args.latency_us * 1e-6, args.gpus_per_host, args.intra_gbit)
    title = f"{name}" + (f", batch {batch}" if batch else "")
    if args.plot:
        plot(os.path.abspath(args.plot), title, results, args.gbit, args.ranks,
             args.compression)
    if args.json:
        out = {"model": name,
               "batch": batch, "device": meta.get("device"),
               "timeline": {"file": args.timeline, "format": meta["format"]},
               "params": timeline.params, "grad_bytes": timeline.grad_bytes,
               "fwd_s": timeline.fwd_s, "bwd_s": timeline.bwd_s, "opt_s": timeline.opt_s,
               "iter_s": timeline.iter_s, "bucket_bytes": args.bucket_bytes,
               "cycle_ms": args.cycle_ms, "latency_s": args.latency_us * 1e-6,
               "gbit": args.gbit, "ranks": args.ranks, "compression": args.compression,
               "gpus_per_host": args.gpus_per_host, "intra_gbit": args.intra_gbit,
               "t_add": t_add.to_dict(), "reproduce": _command(args),
               "buckets": [asdict(b) for b in buckets],
               "grads": [asdict(g) for g in timeline.grads], "unused": timeline.unused,
               "results": results}
        print(json.dumps(out, indent=1, allow_nan=False))
    else:
        print(format_report(title if args.timeline else name, None if args.timeline else batch,
                            timeline, buckets, t_add, results, args.gbit, args.ranks,
                            args.compression, args.bucket_bytes, args.cycle_ms, where,
                            args.gpus_per_host, args.intra_gbit, iter_note))
        if args.plot:
            print(f"# plot: {os.path.abspath(args.plot)}")
    return 0


def _float_list(text: str) -> list[float]:
    try:
        xs = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma separated numbers, got {text!r}") \
            from None
    if not xs or any(not x > 0 for x in xs):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return xs


def _int_list(text: str) -> list[int]:
    try:
        xs = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma separated integers, got {text!r}") \
            from None
    if not xs or any(x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return xs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.whatif", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
