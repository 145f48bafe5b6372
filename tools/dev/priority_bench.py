"""Tensor fusion and priority scheduling against Gloo, side by side in one run.

    python -m linerate.tools.dev.priority_bench --netlab pb                 # one rank per netlab host
    python -m linerate.tools.dev.priority_bench --nproc 4                   # local ranks, loopback
    torchrun --nproc-per-node 4 -m linerate.tools.dev.priority_bench        # under torchrun

Two parts (``--parts fusion,train``):

* fusion: ``--calls`` async all_reduces of ``--call-bytes`` tensors issued back to back, then
  waited on: seconds for the whole batch on Gloo and on linerate (fusion on), and the ratio.
  Results are checked.
* train: a ``--layers`` x ``--width`` MLP (ReLU, MSE loss, batch ``--batch``, SGD with
  momentum, one thread per rank), seconds per step for: its computation alone (every rank
  computing at once, no communication), DDP over Gloo, DDP over linerate, and
  PriorityDataParallel over linerate. Also the time a line-rate ring all-reduce of the
  gradients needs, 2(n-1)/n x bytes / link capacity, where the capacity is measured between
  two hosts first (``--netlab``) or given (``--link-gbit``), and the target
  1.15 x max(computation, line-rate all-reduce). A step's time is the slowest rank's mean
  over ``--steps`` steps after ``--warmup``, best of ``--rounds`` rounds that time every
  method in turn.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from linerate import settings
from linerate.tools.argtypes import positive_int, size
from linerate.tools.launch import dispatch

DEFAULT_NPROC = 4
LAUNCH_GRACE_S = 30.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help=f"ranks on this host (default {DEFAULT_NPROC}; with --netlab: every host)")
    parser.add_argument("--netlab", metavar="NAME", nargs="?", const="lab", default=None,
                        help="the ranks of a running `linerate netlab` (default name: lab)")
    parser.add_argument("--parts", default="fusion,train", help="fusion,train (default both)")
    parser.add_argument("--calls", type=positive_int, default=2000,
                        help="async all_reduces in the fusion part (default 2000)")
    parser.add_argument("--call-bytes", type=size, default=size("4K"),
                        help="bytes per tensor in the fusion part (default 4K)")
    parser.add_argument("--layers", type=positive_int, default=12)
    parser.add_argument("--width", type=positive_int, default=1024)
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per round")
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="link capacity for the line-rate column (default: measured on netlab)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before every rank is killed (default 900)")


def rank_argv(args) -> list[str]:
    argv = ["--parts", args.parts, "--calls", str(args.calls), "--call-bytes", str(args.call_bytes),
            "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--timeout", str(args.timeout)]
    if args.link_gbit:
        argv += ["--link-gbit", str(args.link_gbit)]
    return argv


def run(args) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in ("fusion", "train") for p in parts):
        print("priority_bench: error: --parts takes fusion and/or train", file=sys.stderr)
        return 2

    def probe_links(lab) -> None:
        from linerate.tools import netlab
        if args.link_gbit is None and "train" in parts and len(lab.hosts) > 1:
            args.link_gbit = netlab.probe(lab, 0, 1) / 1e9
            print(f"raw link capacity host 0 -> host 1: {args.link_gbit:.3f} Gbit/s")

    return dispatch("priority_bench", "linerate.tools.dev.priority_bench", args, lambda: rank_argv(args),
                    run_worker, DEFAULT_NPROC, args.timeout + LAUNCH_GRACE_S, on_lab=probe_links)


# ----------------------------------------------------------------------------- one rank
def _slowest(seconds: float, group) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _fusion(args, rank, world, groups) -> dict:
    import torch
    import torch.distributed as dist
    numel = max(1, args.call_bytes // 4)
    out = {}
    for name, g in groups:
        for attempt in range(2):  # the first is a warm-up (connections, allocations)
            ts = [torch.full((numel,), float(rank + i % 7)) for i in range(args.calls)]
            dist.barrier(group=groups[0][1])
            t0 = time.perf_counter()
            works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
            for w in works:
                w.wait()
            dt = time.perf_counter() - t0
            for i in (0, len(ts) // 2, len(ts) - 1):
                want = sum(r + i % 7 for r in range(world))
                if ts[i][0].item() != want or ts[i][-1].item() != want:
                    raise RuntimeError(f"rank {rank}: {name}: wrong result in call {i}")
        out[name] = _slowest(dt, groups[0][1])
    return out


def _mlp(args, seed: int):
    import torch
    torch.manual_seed(seed)
    layers = []
    for i in range(args.layers):
        layers.append(torch.nn.Linear(args.width, args.width))
        if i < args.layers - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _train(args, rank, world, gloo, lr_group, prio_group) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from linerate import PriorityDataParallel

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)

    def run_steps(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    def timed(kind):
        net = _mlp(args, 0)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        sync = None
        if kind == "compute":
            model = net
        elif kind == "ddp-gloo":
            model = DDP(net, process_group=gloo)
        elif kind == "ddp-linerate":
            model = DDP(net, process_group=lr_group)
        else:
            model = PriorityDataParallel(net, opt, process_group=prio_group)
            sync = model.synchronize
        run_steps(model, opt, args.warmup)
        if sync:
            sync()
        torch.distributed.barrier(group=gloo)
        t0 = time.perf_counter()
        run_steps(model, opt, args.steps)
        if sync:
            sync()
        dt = (time.perf_counter() - t0) / args.steps
        if kind == "priority":
            model.close()
        return _slowest(dt, gloo)

    kinds = ["compute", "ddp-gloo", "ddp-linerate", "priority"]
    best = {k: float("inf") for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            best[k] = min(best[k], timed(k))
    return best


def run_worker(args) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import linerate  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        gloo = dist.group.WORLD
        lr_group = dist.new_group(backend="linerate")
        prio_group = dist.new_group(backend="linerate")  # its own scratch and sequence
        parts = [p.strip() for p in args.parts.split(",")]
        lab = settings.read("LINERATE_NETLAB")
        where = f"netlab {lab}" if lab else "local"
        shown = settings.raw
        if "fusion" in parts:
            res = _fusion(args, rank, world, [("gloo", gloo), ("linerate", lr_group)])
            if rank == 0:
                print(f"fusion: {args.calls} async all_reduce of {args.call_bytes} bytes, {world} "
                      f"ranks ({where}); LINERATE_FUSION_BYTES="
                      f"{shown('LINERATE_FUSION_BYTES') or 'default'} "
                      f"LINERATE_CYCLE_MS={shown('LINERATE_CYCLE_MS') or 'default'}")
                print(f"  gloo      {res['gloo']:8.3f} s")
                print(f"  linerate  {res['linerate']:8.3f} s   {res['gloo'] / res['linerate']:6.1f}x faster")
        if "train" in parts:
            res = _train(args, rank, world, gloo, lr_group, prio_group)
            if rank == 0:
                nparams = args.layers * (args.width * args.width + args.width)
                mbytes = nparams * 4
                print(f"train: MLP {args.layers} x {args.width}, {mbytes / 2**20:.1f} MiB of "
                      f"gradients, batch {args.batch}, {world} ranks ({where}), s/step (slowest "
                      f"rank, best of {args.rounds} rounds of {args.steps} steps); "
                      f"LINERATE_PARTITION_BYTES={shown('LINERATE_PARTITION_BYTES') or 'default'} "
                      f"LINERATE_CREDIT_BYTES={shown('LINERATE_CREDIT_BYTES') or 'default'}")
                line = None
                if args.link_gbit:
                    line = 2 * (world - 1) / world * mbytes * 8 / (args.link_gbit * 1e9)
                for k, label in (("compute", "computation alone"), ("ddp-gloo", "DDP over Gloo"),
                                 ("ddp-linerate", "DDP over linerate"),
                                 ("priority", "PriorityDataParallel over linerate")):
                    extra = ""
                    if k != "compute":
                        extra = f"   {res['ddp-gloo'] / res[k]:5.2f}x Gloo DDP"
                    print(f"  {label:<36}{res[k]:8.3f}{extra}")
                if line is not None:
                    target = 1.15 * max(res["compute"], line)
                    print(f"  {'line-rate ring all-reduce':<36}{line:8.3f}   "
                          f"({args.link_gbit:.3f} Gbit/s links)")
                    print(f"  {'target 1.15 x max(compute, line)':<36}{target:8.3f}   priority / "
                          f"target = {res['priority'] / target:.3f}")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.dev.priority_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
