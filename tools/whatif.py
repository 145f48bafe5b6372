"""linerate whatif: would full link utilization make data-parallel training scale?

The what-if analysis of "Is Network the Bottleneck of Distributed Training?" (Zhang et al.,
2020) for any torch model, on this CPU:

1. run forward + backward a few times, recording with per-parameter hooks when each gradient
   is ready during backward (and its size), and the forward, backward and optimizer times;
2. put the gradients into Horovod-style fusion buckets, in ready order: a bucket is closed when
   it holds --bucket-bytes, or when --cycle-ms have passed since the previous one was closed;
3. for each link rate B, rank count N and compression ratio c, assume every all-reduce runs at
   full link rate:  T_ar(S) = 2(N-1)/N * S/(c*B) + (N-1) * t_add(S/N)  (+ 2(N-1)*latency),
   t_add measured here (the time to add two tensors of that size); each bucket's all-reduce
   starts when the bucket is ready and the previous all-reduce has ended;
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
import os
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


# ----------------------------------------------------------------------------- timelines

@dataclass
class Grad:
    name: str
    ready_s: float      # after the start of backward
    nbytes: int


@dataclass
class Timeline:
    """One iteration on one worker: gradients in ready order and the phase times (medians)."""
    grads: list[Grad]
    fwd_s: float
    bwd_s: float
    opt_s: float = 0.0
    params: int = 0
    unused: list[str] = field(default_factory=list)

    @property
    def iter_s(self) -> float:
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


# ----------------------------------------------------------------------------- all-reduce

class AddCost:
    """t_add(nbytes): time to add two float32 tensors of ``nbytes`` each, piecewise linear
    between measured sizes; below the smallest, its time (a fixed cost); above the largest,
    that size's time per byte. ``rate_bytes_s`` instead: nbytes / rate."""

    def __init__(self, points: list[tuple[int, float]] | None = None,
                 rate_bytes_s: float | None = None):
        if (points is None) == (rate_bytes_s is None):
            raise ValueError("give measured points or a rate")
        self.points = sorted(points) if points else None
        self.rate = rate_bytes_s

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
        return "t_add (one thread, measured): " + ", ".join(
            f"{s >> 10} KiB in {t * 1e6:.1f} us" for s, t in shown)

    def to_dict(self) -> dict:
        rate = "inf" if self.rate == float("inf") else self.rate
        return {"points": self.points, "rate_bytes_s": rate}


def measure_add(min_bytes: int = 1 << 10, max_bytes: int = 64 << 20) -> AddCost:
    """Time of ``a.add_(b)`` on float32 tensors of each size (powers of 4 from ``min_bytes``)
    on one thread (as one reduction thread runs it; no thread-pool wake-ups): the fastest of
    several runs -- what this CPU can do, as the analysis assumes of the links; on a shared
    machine the median mostly measures the other processes. Made non-decreasing in size."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    points = []
    try:
        size = min_bytes
        while size <= max_bytes:
            a = torch.ones(size // 4)
            b = torch.ones(size // 4)
            reps = max(10, min(200, (32 << 20) // size))
            a.add_(b)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                a.add_(b)
                best = min(best, time.perf_counter() - t0)
            points.append((size, max(best, points[-1][1] if points else 0.0)))
            size *= 4
    finally:
        torch.set_num_threads(threads)
    return AddCost(points)


def allreduce_time(nbytes: float, ranks: int, bits_per_s: float, t_add,
                   compression: float = 1.0, latency_s: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` on ``ranks`` workers at full link rate:
    2(N-1)/N * S / (c*B) + (N-1) * t_add(S/N) + 2(N-1) * latency."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    net = 2 * (ranks - 1) / ranks * nbytes * 8 / bits_per_s / compression
    return net + (ranks - 1) * t_add(nbytes / ranks) + 2 * (ranks - 1) * latency_s


def schedule(buckets: list[Bucket], bwd_s: float, ranks: int, bits_per_s: float, t_add,
             compression: float = 1.0, latency_s: float = 0.0) -> dict:
    """All-reduce each bucket as soon as it is ready and the previous all-reduce has ended.

    Returns {"overhead_s": max(0, last end - bwd_s), "ends": [...], "comm_s": sum of T_ar}."""
    end = 0.0
    ends, total = [], 0.0
    for b in buckets:
        t = allreduce_time(b.nbytes, ranks, bits_per_s, t_add, compression, latency_s)
        end = max(b.ready_s, end) + t
        ends.append(end)
        total += t
    return {"overhead_s": max(0.0, end - bwd_s) if buckets else 0.0, "ends": ends,
            "comm_s": total}


def scaling_factor(iter_s: float, overhead_s: float) -> float:
    return iter_s / (iter_s + overhead_s) if iter_s + overhead_s > 0 else 1.0


def analyze(timeline: Timeline, buckets: list[Bucket], gbits, ranks, compressions, t_add,
            latency_s: float = 0.0) -> list[dict]:
    out = []
    for c in compressions:
        for n in ranks:
            for gb in gbits:
                s = schedule(buckets, timeline.bwd_s, n, gb * 1e9, t_add, c, latency_s)
                out.append({"compression": c, "ranks": n, "gbit": gb,
                            "overhead_s": s["overhead_s"], "comm_s": s["comm_s"],
                            "scaling_factor": scaling_factor(timeline.iter_s,
                                                             s["overhead_s"])})
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


def build(spec: str, batch: int, image_size: int | None = None):
    """(model, inputs tuple, loss_fn) for a built-in name or MODULE:CALLABLE."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    if spec in BUILTIN_MODELS:
        model = _models()[spec]()
        if spec == "mlp":
            x = torch.randn(batch, 784, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)
            return model, (x,), lambda out: F.cross_entropy(out, y)
        if spec in ("cnn", "resnet18"):
            size = image_size or (32 if spec == "cnn" else 224)
            classes = 10 if spec == "cnn" else 1000
            x = torch.randn(batch, 3, size, size, generator=g)
            y = torch.randint(0, classes, (batch,), generator=g)
            return model, (x,), lambda out: F.cross_entropy(out, y)
        tokens = torch.randint(0, 8192, (batch, 128), generator=g)
        target = torch.randint(0, 8192, (batch, 128), generator=g)
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
    model, inputs = got[0], got[1]
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
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


def record_timeline(model, inputs: tuple, loss_fn, iters: int = 3,
                    warmup: int = 1) -> Timeline:
    """Per-parameter gradient ready times (median over ``iters`` iterations after ``warmup``)
    from post-accumulate-grad hooks, and the forward, backward and SGD step times."""
    import torch
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in params], lr=1e-4, momentum=0.9)
    ready: dict[str, float] = {}
    clock = {"t0": 0.0}
    handles = [p.register_post_accumulate_grad_hook(
        lambda _p, name=n: ready.__setitem__(name, time.perf_counter() - clock["t0"]))
        for n, p in params]
    samples: dict[str, list[float]] = {n: [] for n, _ in params}
    fwd, bwd, step = [], [], []
    try:
        for i in range(warmup + iters):
            ready.clear()
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = loss_fn(model(*inputs))
            t1 = time.perf_counter()
            clock["t0"] = t1
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                step.append(t3 - t2)
                for n, t in ready.items():
                    samples[n].append(t)
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

def format_report(name: str, batch: int, timeline: Timeline, buckets: list[Bucket],
                  t_add: AddCost, results: list[dict], gbits, ranks, compressions,
                  threshold: int, cycle_ms: float) -> str:
    ms = 1e3
    lines = [f"# whatif: {name}, batch {batch}: {timeline.params / 1e6:.2f}M parameters, "
             f"{timeline.grad_bytes / 2**20:.2f} MiB of gradients in {len(buckets)} bucket(s) "
             f"({threshold / 2**20:g} MiB threshold"
             + (f", {cycle_ms:g} ms cycle)" if cycle_ms else ", no cycle)"),
             f"# iteration on this CPU: {timeline.iter_s * ms:.1f} ms (forward "
             f"{timeline.fwd_s * ms:.1f}, backward {timeline.bwd_s * ms:.1f}, optimizer "
             f"{timeline.opt_s * ms:.1f}); {t_add.describe()}"]
    if timeline.unused:
        lines.append(f"# {len(timeline.unused)} parameter(s) got no gradient and are left out")
    lines.append("# buckets (ready ms after backward start / MiB): " + ", ".join(
        f"{b.ready_s * ms:.1f}/{b.nbytes / 2**20:.2f}" for b in buckets[:12])
        + (", ..." if len(buckets) > 12 else ""))
    width = max(11, max(len(f"{g:g} Gbit/s") for g in gbits) + 2)
    for c in compressions:
        lines.append(f"scaling factor, full link utilization, compression {c:g}x:")
        lines.append(f"{'ranks':>6}" + "".join(f"{f'{g:g} Gbit/s':>{width}}" for g in gbits))
        for n in ranks:
            row = [r for r in results if r["compression"] == c and r["ranks"] == n]
            lines.append(f"{n:>6}" + "".join(f"{r['scaling_factor']:>{width}.3f}"
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
            ys = [next(r["scaling_factor"] for r in results if r["compression"] == c and
                       r["ranks"] == n and r["gbit"] == gb) for n in ranks]
            ax.plot(ranks, ys, marker="o", label=f"{gb:g} Gbit/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ranks))
        ax.set_xticklabels([str(n) for n in ranks])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("ranks")
        ax.set_title(f"compression {c:g}x")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left", fontsize="small")
    axes[0][0].set_ylabel("scaling factor (full link utilization)")
    fig.suptitle(f"what-if: {name}")
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
    parser.add_argument("--model", default="mlp",
                        help=f"{'|'.join(BUILTIN_MODELS)} or MODULE:CALLABLE (default mlp)")
    parser.add_argument("--batch", type=_positive_int, default=DEFAULT_BATCH,
                        help=f"batch per worker (default {DEFAULT_BATCH})")
    parser.add_argument("--image-size", type=_positive_int, default=None,
                        help="input height and width of cnn (default 32) and resnet18 (224)")
    parser.add_argument("--iters", type=_positive_int, default=3,
                        help="measured iterations (default 3; medians are used)")
    parser.add_argument("--warmup", type=_nonneg_int, default=1,
                        help="iterations before measuring (default 1)")
    parser.add_argument("--gbit", type=_float_list, default=list(DEFAULT_GBIT),
                        help="link rates, Gbit/s (default 1,10,25,100)")
    parser.add_argument("--ranks", type=_int_list, default=list(DEFAULT_RANKS),
                        help="rank counts (default 2,4,8,16,32,64)")
    parser.add_argument("--compression", type=_float_list, default=list(DEFAULT_COMPRESSION),
                        help="gradient compression ratios (default 1)")
    parser.add_argument("--bucket-bytes", type=_size, default=DEFAULT_BUCKET_BYTES,
                        help="fusion threshold (default 64M, Horovod's)")
    parser.add_argument("--cycle-ms", type=_nonneg_float, default=DEFAULT_CYCLE_MS,
                        help="also close a bucket this long after the previous one (default "
                             f"{DEFAULT_CYCLE_MS:g}; 0: by size only)")
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


def run(args: argparse.Namespace) -> int:
    if args.plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            print(f"linerate whatif: error: --plot {INSTALL_HINT}", file=sys.stderr)
            return 2
    try:
        model, inputs, loss_fn = build(args.model, args.batch, args.image_size)
    except ValueError as e:
        print(f"linerate whatif: error: {e}", file=sys.stderr)
        return 2
    timeline = record_timeline(model, inputs, loss_fn, args.iters, args.warmup)
    if not timeline.grads:
        print("linerate whatif: error: the model produced no gradients", file=sys.stderr)
        return 1
    cycle_s = args.cycle_ms / 1e3 if args.cycle_ms else None
    buckets = make_buckets(timeline.grads, args.bucket_bytes, cycle_s)
    t_add = (AddCost(rate_bytes_s=args.add_gbs * 1e9) if args.add_gbs is not None
             else measure_add(max_bytes=max(1 << 20, min(64 << 20, timeline.grad_bytes))))
    results = analyze(timeline, buckets, args.gbit, args.ranks, args.compression, t_add,
                      args.latency_us * 1e-6)
    if args.plot:
        plot(os.path.abspath(args.plot), f"{args.model}, batch {args.batch}", results,
             args.gbit, args.ranks, args.compression)
    if args.json:
        out = {"model": args.model, "batch": args.batch, "params": timeline.params,
               "grad_bytes": timeline.grad_bytes, "fwd_s": timeline.fwd_s,
               "bwd_s": timeline.bwd_s, "opt_s": timeline.opt_s, "iter_s": timeline.iter_s,
               "bucket_bytes": args.bucket_bytes, "cycle_ms": args.cycle_ms,
               "latency_s": args.latency_us * 1e-6, "t_add": t_add.to_dict(),
               "buckets": [asdict(b) for b in buckets],
               "grads": [asdict(g) for g in timeline.grads], "unused": timeline.unused,
               "results": results}
        print(json.dumps(out, indent=1, allow_nan=False))
    else:
        print(format_report(args.model, args.batch, timeline, buckets, t_add, results,
                            args.gbit, args.ranks, args.compression, args.bucket_bytes,
                            args.cycle_ms))
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
