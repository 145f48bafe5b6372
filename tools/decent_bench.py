"""Step time of decentralized training against DDP, side by side in one run, with the runtime
model's prediction beside each.

    python -m tools.decent_bench --netlab NAME [--nproc 8] [--width 1024 --depth 12]
    python -m tools.decent_bench --nproc 4            # local ranks on loopback

Each rank trains the same MLP (``--depth`` layers of ``--width``, batch ``--batch``) with:
  compute  forward + backward alone (no communication): what a step costs at best;
  ddp      torch DDP over linerate (All-Reduce of gradients, overlapping the backward pass);
  dec      collectives.DecentralizedDataParallel (Adam, ``--topology``), whose parameter
           exchange overlaps the whole next iteration.
It prints seconds per step (max over ranks, median of ``--steps``), the speedup of dec over ddp,
and what ``tools.model`` predicts for both from the link rate (``--gbit``; under netlab the lab's)
and the measured compute time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.decent_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netlab", metavar="NAME", default=None, help="run on this netlab cluster")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every netlab host, or 4)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per method (default 8)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--topology", default="one-peer-exp")
    p.add_argument("--methods", default="ddp,dec", help="comma-separated: ddp, dec (default both)")
    p.add_argument("--gbit", type=float, default=None,
                   help="link rate for the model's prediction (default: the netlab lab's rate)")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.netlab is None and args.nproc is None and all(k in os.environ for k in _TORCHRUN_ENV):
        return _rank(args)
    fwd = [a for a in (argv if argv is not None else sys.argv[1:])]
    if args.netlab is not None:
        from tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            print(f"decent_bench: --netlab: {reason}", file=sys.stderr)
            return 2
        lab = netlab.load(args.netlab)
        fwd = _without(fwd, "--netlab", 1)
        fwd = _without(fwd, "--nproc", 1)
        if args.gbit is None:
            fwd += ["--gbit", str(lab.rate_bps / 1e9)]
        return netlab.run_ranks(lab, args.nproc or len(lab.hosts),
                                ["-m", "tools.decent_bench", *fwd], timeout=args.timeout,
                                prefix_output=False)
    from tools.launch import launch_local
    return launch_local("tools.decent_bench", _without(fwd, "--nproc", 1), args.nproc or 4,
                        args.timeout)


def _without(argv: list[str], flag: str, nargs: int) -> list[str]:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        if a == flag:
            skip = nargs
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def _rank(args) -> int:
    import torch
    import torch.distributed as dist

    import collectives
    torch.set_num_threads(1)
    dist.init_process_group("linerate", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    def net():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    loss_fn = torch.nn.functional.mse_loss

    def timed(step_fn) -> float:
        for _ in range(args.warmup):
            step_fn()
        laps = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step_fn()
            laps.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(laps)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    results = {}
    m = net()
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)

    def compute_only():
        loss_fn(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    results["compute"] = timed(compute_only)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    methods = [s.strip() for s in args.methods.split(",") if s.strip()]
    if "ddp" in methods:
        ddp = torch.nn.parallel.DistributedDataParallel(net())
        dopt = torch.optim.Adam(ddp.parameters(), lr=1e-4)

        def ddp_step():
            loss_fn(ddp(x), y).backward()
            dopt.step()
            dopt.zero_grad()
        results["ddp"] = timed(ddp_step)
        del ddp, dopt
    if "dec" in methods:
        dec = collectives.DecentralizedDataParallel(net(), "adam", lr=1e-4, topology=args.topology)

        def dec_step():
            loss_fn(dec(x), y).backward()
            dec.step()
        results["dec"] = timed(dec_step)
        if dec._works is not None:
            for w in dec._works:
                w.wait()
    if rank == 0:
        _report(args, world, nbytes, results)
    dist.destroy_process_group()
    return 0


def _report(args, world: int, nbytes: int, results: dict) -> None:
    pred = {}
    if args.gbit:
        try:
            from tools import model as rt
            cluster = rt.Cluster(nodes=world, ranks_per_node=1, intra_gbit=args.gbit,
                                 inter_gbit=args.gbit)
            pred["ddp"] = rt.predict(cluster, nbytes, results["compute"], method="allreduce")["step_s"]
            pred["dec"] = rt.predict(cluster, nbytes, results["compute"],
                                     method=args.topology)["step_s"]
        except Exception as e:  # noqa: BLE001 - the model is optional here
            print(f"# (no prediction: {type(e).__name__}: {e})")
    print(f"# decent_bench: {world} ranks, MLP {args.depth} x {args.width} ({nbytes / 1e6:.1f} MB "
          f"of parameters), batch {args.batch}, topology {args.topology}, links "
          f"{args.gbit or '?'} Gbit/s; seconds per step (max over ranks, median of {args.steps})")
    print(f"# {'method':>8} {'step(s)':>9} {'predicted(s)':>13} {'pred/meas':>10}")
    for name in ("compute", "ddp", "dec"):
        if name in results:
            p = pred.get(name)
            ps = f"{p:>13.3f} {p / results[name]:>10.2f}" if p else f"{'-':>13} {'-':>10}"
            print(f"  {name:>8} {results[name]:>9.3f} {ps}")
    if "ddp" in results and "dec" in results:
        line = f"# speedup dec/ddp: measured {results['ddp'] / results['dec']:.2f}"
        if "ddp" in pred and "dec" in pred:
            line += f", predicted {pred['ddp'] / pred['dec']:.2f}"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
