"""neighbor_allreduce against a ring all_reduce of the same tensor, in one run.

    python -m linerate.tools.dev.neighbor_bench --nproc 4 --bytes 64M                  # local ranks, loopback
    python -m linerate.tools.dev.neighbor_bench --netlab nb --bytes 64M                # one rank per netlab host
    torchrun --nproc-per-node 4 -m linerate.tools.dev.neighbor_bench --bytes 64M       # under torchrun

For each topology (``--topologies``, by_name keys) and for linerate's all_reduce (the ring
algorithm: LINERATE_ALLREDUCE_ALGO=ring unless set), rounds of back-to-back ops are timed in
turn (so every method sees the same machine conditions); a method's time is the slowest rank's.
Time-varying topologies are timed over whole periods. Printed: seconds per op, the ratio to
all_reduce, and the theoretical ratio from the bytes on the busiest link direction: a topology
at step t moves max over ranks of max(out-peers, in-neighbors) x M per rank, a ring all_reduce
2(n-1)/n x M (one-peer exponential: 1 / 1.75 = 0.571 at n = 8).

Hosts of several ranks (a lab started with ``--ranks-per-host``, or torchrun on several
nodes): ``aer`` takes the ranks per host (LOCAL_WORLD_SIZE) as its nodes unless
``--ranks-per-node`` says otherwise; ``aer-average`` is AER with intra-host averaging
(``intra="average"``: on shared memory); ``hierarchical`` is hierarchical_neighbor_allreduce with
the one-peer exponential graph of the hosts; ``aer-average-p2p`` is aer-average with its
intra-host averages point to point (for comparison).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from linerate import settings
from linerate.tools.bench import LAUNCH_GRACE_S, _positive_int, _size
from linerate.tools.launch import dispatch

DEFAULT_TOPOLOGIES = "one-peer-exp,ring,exp"
DEFAULT_NPROC = 4
_DTYPES = ("float32", "float64", "bfloat16", "float16")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=_positive_int, default=None,
                        help=f"ranks to start on this host (default {DEFAULT_NPROC}; with --netlab: "
                             "every host; leave out under torchrun)")
    parser.add_argument("--netlab", metavar="NAME", nargs="?", const="lab", default=None,
                        help="the ranks of a running `linerate netlab` (default name: lab)")
    parser.add_argument("--bytes", type=_size, default=_size("64M"),
                        help="tensor size, K/M/G suffixes allowed (default 64M)")
    parser.add_argument("--topologies", default=DEFAULT_TOPOLOGIES,
                        help=f"comma separated topology names (default {DEFAULT_TOPOLOGIES}; also "
                             "torus, aer, aer-average, aer-average-p2p, hierarchical, complete)")
    parser.add_argument("--ranks-per-node", type=_positive_int, default=None,
                        help="ranks per node for the aer topology")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32")
    parser.add_argument("--iters", type=_positive_int, default=6,
                        help="timed ops per method and round, rounded up to whole periods "
                             "(default 6)")
    parser.add_argument("--rounds", type=_positive_int, default=3,
                        help="rounds; each round times every method once, in turn (default 3)")
    parser.add_argument("--warmup", type=_positive_int, default=2,
                        help="untimed ops per method before the first round (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before every rank is killed (default 600)")


def rank_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--bytes", str(args.bytes), "--topologies", args.topologies, "--dtype", args.dtype,
            "--iters", str(args.iters), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--timeout", str(args.timeout)]
    if args.ranks_per_node:
        argv += ["--ranks-per-node", str(args.ranks_per_node)]
    return argv


def _check_topologies(args) -> str | None:
    from linerate.collectives.topology import NAMES
    known = list(NAMES) + list(_HOST_TOPOLOGIES)
    names = [t.strip() for t in args.topologies.split(",") if t.strip()]
    unknown = [t for t in names if t not in known]
    if unknown or not names:
        return f"unknown topology {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}"
    args.topology_names = names
    return None


_HOST_TOPOLOGIES = ("aer-average", "aer-average-p2p", "hierarchical")


def _make_topologies(args, world: int, hosts: int):
    """{name: (topology, op(x, topo, step), the rank-level matrix at a step)}."""
    import numpy as np

    from linerate import hierarchical_neighbor_allreduce, neighbor_allreduce
    from linerate import topology as T
    from linerate.collectives import neighbor as nb
    rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or world
    if world % rpn:
        raise ValueError(f"{world} ranks do not split into nodes of {rpn} (--ranks-per-node)")

    def p2p(x, topo, step):
        nb._SHM_AVERAGES = False
        try:
            neighbor_allreduce(x, topo, step=step)
        finally:
            nb._SHM_AVERAGES = True

    out = {}
    for name in args.topology_names:
        if name == "hierarchical":
            topo = T.one_peer_exponential(hosts)
            r = world // hosts
            out[name] = (topo, lambda x, t, s: hierarchical_neighbor_allreduce(x, t, step=s),
                         lambda s, topo=topo, r=r: np.kron(topo.matrix(s),
                                                           np.full((r, r), 1.0 / r)))
            continue
        if name in ("aer", "aer-average", "aer-average-p2p"):
            kw = {"ranks_per_node": rpn}
            if name != "aer":
                kw["intra"] = "average"
            topo = T.by_name("aer", world, **kw)
        else:
            topo = T.by_name(name, world)
        op = p2p if name == "aer-average-p2p" else (
            lambda x, t, s: neighbor_allreduce(x, t, step=s))
        out[name] = (topo, op, topo.matrix)
    return out


def run(args: argparse.Namespace) -> int:
    err = _check_topologies(args)
    if err:
        print(f"neighbor_bench: error: {err}", file=sys.stderr)
        return 2
    return dispatch("neighbor_bench", "linerate.tools.dev.neighbor_bench", args, lambda: rank_argv(args),
                    run_worker, DEFAULT_NPROC, args.timeout + LAUNCH_GRACE_S)


# ----------------------------------------------------------------------------- one rank
def theoretical_bytes(topo) -> float:
    """Bytes (in units of the message M) on the busiest link direction per op, averaged over a
    period: max over ranks of max(#out-peers, #in-neighbors)."""
    total = 0
    for step in range(topo.period):
        total += max(max(len(topo.out_peers(r, step)), len(topo.in_weights(r, step)))
                     for r in range(topo.n))
    return total / topo.period


def run_worker(args) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import linerate  # noqa: F401 - registers the backend
    from linerate.collectives import neighbor as nb

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = linerate.Options.from_env()
    if not linerate.settings.is_set("LINERATE_ALLREDUCE_ALGO"):
        options.allreduce_algo = "ring"  # this benchmark's default: the bandwidth-optimal one
    args.allreduce_algo = options.allreduce_algo
    dist.init_process_group("linerate", rank=rank, world_size=world, pg_options=options,
                            timeout=timedelta(seconds=args.timeout))
    try:
        dtype = getattr(torch, args.dtype)
        numel = args.bytes // torch.empty((), dtype=dtype).element_size()
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        hosts, _ = nb.host_layout(backend)
        made = _make_topologies(args, world, len(hosts))
        topos = {name: t for name, (t, _, _) in made.items()}
        x = torch.full((numel,), float(rank + 1), dtype=dtype)

        # sanity: constant inputs c_j = j + 1 give sum_j W[i, j] c_j everywhere
        for name, (topo, op, matrix) in made.items():
            x.fill_(rank + 1)
            op(x, topo, 0)
            want = float(matrix(0)[rank] @ (torch.arange(world, dtype=torch.float64) + 1).numpy())
            got = (x[0].item(), x[-1].item()) if numel else (want, want)
            tol = 1e-2 * abs(want) if dtype in (torch.bfloat16, torch.float16) else 1e-5 * abs(want)
            if any(abs(g - want) > tol for g in got):
                raise RuntimeError(f"rank {rank}: {name}: wrong result {got}, expected {want}")

        def op_for(name):
            if name == "all_reduce":
                return lambda i: dist.all_reduce(x)
            topo, op, _ = made[name]
            return lambda i: op(x, topo, i)

        methods = ["all_reduce"] + list(topos)
        iters = {m: args.iters if m == "all_reduce" else
                 -(-args.iters // topos[m].period) * topos[m].period for m in methods}
        for m in methods:
            f = op_for(m)
            for i in range(args.warmup):
                f(i)
        x.fill_(1.0)
        spent = {m: 0.0 for m in methods}
        best = {m: float("inf") for m in methods}
        count = {m: 0 for m in methods}
        for _ in range(args.rounds):
            for m in methods:
                f = op_for(m)
                dist.barrier()
                t0 = time.perf_counter()
                for i in range(iters[m]):
                    f(i)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
                spent[m] += dt.item()
                best[m] = min(best[m], dt.item() / iters[m])
                count[m] += iters[m]
                if m == "all_reduce":
                    x.fill_(1.0)  # keep the sums finite
        if rank == 0:
            _report(args, world, numel, dtype, topos, {m: spent[m] / count[m] for m in methods},
                    best, count)
    finally:
        dist.destroy_process_group()
    return 0


def _report(args, world, numel, dtype, topos, per_op, best, count) -> None:
    ar = per_op["all_reduce"]
    ar_units = 2 * (world - 1) / world
    lab = settings.read("LINERATE_NETLAB")
    where = f"netlab {lab}" if lab else "local"
    print(f"neighbor_allreduce vs all_reduce: {world} ranks ({where}), {args.bytes / 2**20:g} MiB "
          f"{str(dtype).replace('torch.', '')} ({numel} elements), linerate, "
          f"all_reduce algorithm {getattr(args, 'allreduce_algo', 'ring')}")
    w = max([30] + [len(repr(t)) + 14 for t in topos.values()])
    print(f"{'method':<{w}}{'s/op':>9}{'ratio':>8}{'best':>9}{'ratio':>8}{'theory':>8}"
          f"{'M/link':>8}{'ops':>6}  gap")
    print(f"{'all_reduce':<{w}}{ar:>9.4f}{1.0:>8.3f}{best['all_reduce']:>9.4f}{1.0:>8.3f}{1.0:>8.3f}"
          f"{ar_units:>8.3f}{count['all_reduce']:>6}")
    for name, topo in topos.items():
        units = theoretical_bytes(topo)
        label = (f"hierarchical {topo!r}" if name == "hierarchical" else
                 f"{topo!r} p2p" if name.endswith("-p2p") else repr(topo))
        theory = "-" if name in _HOST_TOPOLOGIES else f"{units / ar_units:.3f}"
        link = "-" if name in _HOST_TOPOLOGIES else f"{units:.3f}"
        print(f"{label:<{w}}{per_op[name]:>9.4f}{per_op[name] / ar:>8.3f}{best[name]:>9.4f}"
              f"{best[name] / best['all_reduce']:>8.3f}{theory:>8}{link:>8}"
              f"{count[name]:>6}  {topo.spectral_gap():.3f}")
    print("s/op: mean over all rounds (the slowest rank's time); best: the best round's s/op; "
          "ratio: over all_reduce's; theory: bytes on the busiest link direction over "
          "all_reduce's (M/link, in units of the tensor); gap: spectral gap")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.dev.neighbor_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
