"""linerate soak: thousands of random collectives, every result checked, memory and descriptors
watched.

    python -m linerate.tools.dev.soak --nproc 4 --ops 10000 [--seed S]            # local ranks (loopback)
    python -m linerate.tools.dev.soak --netlab NAME --nproc 4 --ops 10000          # one rank per netlab host
    torchrun --nproc-per-node 2 -m linerate.tools.dev.soak --ops 1000               # under torchrun

Every rank draws the same sequence from the seed: the op (all_reduce with SUM, MAX, MIN or
PRODUCT, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather, scatter, barrier),
the dtype (float32, float64, int32, int64, bfloat16, float16, uint8, int8), the element count
(0 now and then, else log-uniform in bytes up to --max-bytes, so odd sizes are common), the root
and the reduce op. Inputs are integers drawn from a generator seeded by (seed, op index, rank,
chunk), so every rank can regenerate every other rank's input and compute the expected result
with NumPy; the ranges are chosen per dtype, op and world size so that sums and products are
exact in every dtype (bfloat16 holds integers up to 256 exactly, int8 up to 127). Every result
is compared bit for bit after every op; mismatches are counted and the first ones described.

RSS (VmRSS of /proc/self/status) and open descriptors (/proc/self/fd) of every rank are taken
after --warmup ops, every tenth of the run after that (in the JSON) and at the end; the growth
over the second half of the run is shown too (caches fill early; a leak keeps growing). Rank 0
prints a summary table; the exit code is 1 if any result was wrong. The default group is Gloo
(bookkeeping: the summary); the soak runs on a linerate group of all ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from linerate.tools.launch import launch_local

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
       "gather", "scatter", "barrier")
DTYPES = ("float32", "float64", "int32", "int64", "bfloat16", "float16", "uint8", "int8")
REDUCE_OPS = ("SUM", "MAX", "MIN", "PRODUCT")
#: Largest magnitude each dtype holds exactly (integers) and without overflow.
EXACT = {"float32": 2 ** 24, "float64": 2 ** 53, "int32": 2 ** 31 - 1, "int64": 2 ** 63 - 1,
         "bfloat16": 256, "float16": 2048, "uint8": 255, "int8": 127}
ITEMSIZE = {"float32": 4, "float64": 8, "int32": 4, "int64": 8, "bfloat16": 2, "float16": 2,
            "uint8": 1, "int8": 1}
MAX_REPORTED = 10  # mismatches described in detail, per rank


# ----------------------------------------------------------------------------- the plan
def value_range(dtype: str, op: str | None, world: int) -> tuple[int, int]:
    """[lo, hi] of input values such that ``op`` over ``world`` ranks is exact in ``dtype``."""
    limit = EXACT[dtype]
    if op == "SUM":
        b = min(1000, limit // world)
    elif op == "PRODUCT":
        b = 1
        while b < 3 and (b + 1) ** world <= limit:
            b += 1
    else:
        b = min(100, limit)
    return (0 if dtype == "uint8" else -b), b


def draw_plan(rng, world: int, max_bytes: int) -> dict:
    """One op of the sequence (the same on every rank: only the shared generator is used)."""
    op = OPS[rng.integers(len(OPS))]
    dtype = DTYPES[rng.integers(len(DTYPES))]
    root = int(rng.integers(world))
    rop = REDUCE_OPS[rng.integers(len(REDUCE_OPS))] if op in ("all_reduce", "reduce", "reduce_scatter") else None
    if rng.random() < 0.05:
        nbytes = 0
    else:
        nbytes = int(math.exp(rng.uniform(0.0, math.log(max_bytes))))
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        nbytes //= world  # per chunk: a rank's whole input stays within max_bytes
    n = 0 if op == "barrier" else nbytes // ITEMSIZE[dtype]
    return {"op": op, "dtype": dtype, "n": n, "root": root, "rop": rop}


def make_input(np, seed: int, index: int, rank: int, chunk: int, n: int, lo: int, hi: int):
    """The input of ``rank`` (its chunk ``chunk``) in op ``index``: any rank can rebuild it."""
    rng = np.random.default_rng([seed, index, rank, chunk])
    return rng.integers(lo, hi + 1, n, dtype=np.int64)


def fold(np, arrays, rop: str):
    stack = np.stack(arrays) if arrays else None
    return {"SUM": np.sum, "PRODUCT": np.prod, "MAX": np.max, "MIN": np.min}[rop](stack, axis=0)


# ----------------------------------------------------------------------------- one rank
def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_rank(args) -> int:
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    group = dist.new_group(backend="linerate", timeout=timeout)
    R = dist.ReduceOp
    tdt = {name: getattr(torch, name) for name in DTYPES}

    def tensor(values, dtype):
        if not len(values):
            # torch.from_numpy(<empty>).to(<other dtype>) has stride (0,), which linerate's
            # byte_view rejects ("stride(-1) must be 1"): a known bug, reported; not soaked here
            return torch.empty(0, dtype=tdt[dtype])
        return torch.from_numpy(values).to(tdt[dtype])

    def same(got, want, dtype) -> bool:
        return got.dtype == tdt[dtype] and torch.equal(got, tensor(want, dtype))

    plan_rng = np.random.default_rng(args.seed)
    warmup = min(args.warmup, args.ops)
    stats = {"ops": {}, "mismatches": 0, "first": []}
    every = max(1, (args.ops - warmup) // 10)
    samples = []  # (ops done, RSS kB, fds) after the warmup, every tenth of the run
    before = after = None
    t_start = time.perf_counter()
    t_measured = None
    for i in range(args.ops):
        if i == warmup:
            before = {"rss_kb": _rss_kb(), "fds": _nfds()}
            t_measured = time.perf_counter()
        if i >= warmup and (i - warmup) % every == 0:
            samples.append((i, _rss_kb(), _nfds()))
        plan = draw_plan(plan_rng, world, args.max_bytes)
        op, dtype, n, root, rop = plan["op"], plan["dtype"], plan["n"], plan["root"], plan["rop"]
        lo, hi = value_range(dtype, rop, world)

        def inp(r, chunk=0):
            return make_input(np, args.seed, i, r, chunk, n, lo, hi)

        t0 = time.perf_counter()
        ok = True
        if op == "all_reduce":
            x = tensor(inp(rank), dtype)
            dist.all_reduce(x, op=getattr(R, rop), group=group)
            ok = same(x, fold(np, [inp(r) for r in range(world)], rop), dtype)
        elif op == "broadcast":
            x = tensor(inp(rank), dtype)
            dist.broadcast(x, src=root, group=group)
            ok = same(x, inp(root), dtype)
        elif op == "reduce":
            x = tensor(inp(rank), dtype)
            dist.reduce(x, dst=root, op=getattr(R, rop), group=group)
            ok = rank != root or same(x, fold(np, [inp(r) for r in range(world)], rop), dtype)
        elif op == "all_gather":
            outs = [torch.empty(n, dtype=tdt[dtype]) for _ in range(world)]
            dist.all_gather(outs, tensor(inp(rank), dtype), group=group)
            ok = all(same(outs[r], inp(r), dtype) for r in range(world))
        elif op == "reduce_scatter":
            out = torch.empty(n, dtype=tdt[dtype])
            dist.reduce_scatter(out, [tensor(inp(rank, k), dtype) for k in range(world)],
                                op=getattr(R, rop), group=group)
            ok = same(out, fold(np, [inp(r, rank) for r in range(world)], rop), dtype)
        elif op == "all_to_all":
            outs = [torch.empty(n, dtype=tdt[dtype]) for _ in range(world)]
            dist.all_to_all(outs, [tensor(inp(rank, k), dtype) for k in range(world)], group=group)
            ok = all(same(outs[r], inp(r, rank), dtype) for r in range(world))
        elif op == "gather":
            outs = [torch.empty(n, dtype=tdt[dtype]) for _ in range(world)] if rank == root else None
            dist.gather(tensor(inp(rank), dtype), outs, dst=root, group=group)
            ok = rank != root or all(same(outs[r], inp(r), dtype) for r in range(world))
        elif op == "scatter":
            x = torch.empty(n, dtype=tdt[dtype])
            chunks = [tensor(inp(root, k), dtype) for k in range(world)] if rank == root else None
            dist.scatter(x, chunks, src=root, group=group)
            ok = same(x, inp(root, rank), dtype)
        else:
            dist.barrier(group=group)
        if i == args.corrupt_op and rank == 0:
            ok = False  # a test of the checking and the exit code (--corrupt-op)
        dt = time.perf_counter() - t0
        key = op if rop is None else f"{op} {rop}"
        s = stats["ops"].setdefault(key, {"count": 0, "mismatches": 0, "bytes": 0, "seconds": 0.0})
        s["count"] += 1
        s["bytes"] += n * ITEMSIZE[dtype]
        s["seconds"] += dt
        if not ok:
            s["mismatches"] += 1
            stats["mismatches"] += 1
            if len(stats["first"]) < MAX_REPORTED:
                what = f"op #{i}: {op} {dtype}[{n}] root={root} op={rop}"
                stats["first"].append(what)
                print(f"soak: rank {rank}: WRONG RESULT in {what}", file=sys.stderr, flush=True)
        if args.progress and rank == 0 and (i + 1) % args.progress == 0:
            print(f"soak: {i + 1}/{args.ops} ops, {time.perf_counter() - t_start:.0f} s",
                  flush=True)
    t_end = time.perf_counter()
    after = {"rss_kb": _rss_kb(), "fds": _nfds()}
    samples.append((args.ops, after["rss_kb"], after["fds"]))
    if before is None:
        before = after
        t_measured = t_end
    mine = {"rank": rank, "host": os.uname().nodename, "before": before, "after": after,
            "samples": samples,
            "stats": stats, "seconds": t_end - t_start, "measured_seconds": t_end - t_measured}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)  # on the Gloo group
    total_wrong = sum(r["stats"]["mismatches"] for r in everyone)
    if rank == 0:
        summary = summarize(everyone, args, warmup)
        print(format_summary(summary), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    return 1 if total_wrong else 0


# ----------------------------------------------------------------------------- the report
def summarize(ranks: list[dict], args, warmup: int) -> dict:
    ops: dict = {}
    for r in ranks:
        for key, s in r["stats"]["ops"].items():
            o = ops.setdefault(key, {"count": s["count"], "mismatches": 0, "bytes": s["bytes"],
                                     "seconds": 0.0})
            o["mismatches"] += s["mismatches"]
            o["seconds"] = max(o["seconds"], s["seconds"])
    rows = []
    for r in ranks:
        b, a = r["before"], r["after"]
        half = [x for x in r["samples"] if x[0] >= (warmup + args.ops) // 2]
        rows.append({"rank": r["rank"], "host": r["host"], "rss_before_kb": b["rss_kb"],
                     "rss_second_half_growth_kb": half[-1][1] - half[0][1] if half else 0,
                     "samples": r["samples"],
                     "rss_after_kb": a["rss_kb"], "rss_growth_kb": a["rss_kb"] - b["rss_kb"],
                     "fds_before": b["fds"], "fds_after": a["fds"], "fds_growth": a["fds"] - b["fds"],
                     "mismatches": r["stats"]["mismatches"], "first_mismatches": r["stats"]["first"]})
    seconds = max(r["seconds"] for r in ranks)
    return {"ops": args.ops, "seed": args.seed, "world": len(ranks), "max_bytes": args.max_bytes,
            "warmup": warmup, "seconds": seconds, "ops_per_second": args.ops / seconds if seconds else 0.0,
            "mismatches": sum(r["mismatches"] for r in rows), "per_op": ops, "ranks": rows}


def _mib(kb: int) -> str:
    return f"{kb / 1024:.1f}"


def format_summary(s: dict) -> str:
    out = [f"soak: {s['ops']} ops on {s['world']} ranks, seed {s['seed']}, sizes up to "
           f"{s['max_bytes']} bytes: {s['seconds']:.1f} s ({s['ops_per_second']:.0f} ops/s), "
           f"{s['mismatches']} mismatches",
           "",
           f"{'op':<22} {'count':>6} {'MB/rank':>9} {'ms/op':>8} {'wrong':>6}"]
    for key in sorted(s["per_op"]):
        o = s["per_op"][key]
        ms = 1000 * o["seconds"] / o["count"] if o["count"] else 0.0
        out.append(f"{key:<22} {o['count']:>6} {o['bytes'] / 1e6:>9.1f} {ms:>8.2f} {o['mismatches']:>6}")
    out += ["",
            f"rank host         RSS MiB after {s['warmup']} ops -> end (growth; in the 2nd half)"
            f"   fds (growth)   wrong",
            ]
    for r in s["ranks"]:
        out.append(f"{r['rank']:>4} {r['host'][:12]:<12} {_mib(r['rss_before_kb']):>9} -> "
                   f"{_mib(r['rss_after_kb']):>9} ({r['rss_growth_kb'] / 1024:+.1f}; "
                   f"{r['rss_second_half_growth_kb'] / 1024:+.1f})"
                   f"      {r['fds_before']:>4} -> {r['fds_after']:<4} ({r['fds_growth']:+d})  "
                   f"{r['mismatches']:>5}")
        for what in r["first_mismatches"]:
            out.append(f"       wrong: {what}")
    return "\n".join(out)


# ----------------------------------------------------------------------------- launcher
def rank_argv(args) -> list[str]:
    argv = ["-m", "linerate.tools.dev.soak", "--ops", str(args.ops), "--seed", str(args.seed),
            "--max-bytes", str(args.max_bytes), "--warmup", str(args.warmup),
            "--timeout", repr(args.timeout), "--progress", str(args.progress),
            "--corrupt-op", str(args.corrupt_op)]
    if args.json:
        argv += ["--json", args.json]
    return argv


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linerate.tools.dev.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=_positive, default=None,
                        help="ranks to start (default 2 locally, every host with --netlab; "
                             "leave out under torchrun)")
    parser.add_argument("--netlab", metavar="NAME", default=None,
                        help="run one rank per host of this running `linerate netlab`")
    parser.add_argument("--ops", type=_positive, default=10_000, help="collectives (default 10000)")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--max-bytes", type=_positive, default=4 << 20,
                        help="largest tensor in bytes (default 4 MiB)")
    parser.add_argument("--warmup", type=int, default=200,
                        help="ops before the first RSS/descriptor reading (default 200)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one collective may take (the process group's timeout)")
    parser.add_argument("--run-timeout", type=float, default=None,
                        help="seconds before the launcher kills every rank (default: none)")
    parser.add_argument("--progress", type=int, default=1000,
                        help="rank 0 prints progress every this many ops (0: never)")
    parser.add_argument("--json", default=None, help="rank 0 writes the summary here")
    parser.add_argument("--corrupt-op", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    if args.json:
        args.json = os.path.abspath(args.json)
    if args.nproc is None and args.netlab is None and all(k in os.environ for k in _TORCHRUN_ENV):
        return run_rank(args)
    if args.netlab is not None:
        from linerate.tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            print(f"soak: --netlab: {reason}", file=sys.stderr)
            return 2
        lab = netlab.load(args.netlab)
        return netlab.run_ranks(lab, args.nproc or None, rank_argv(args),
                                timeout=args.run_timeout, prefix_output=False)
    return launch_local("linerate.tools.dev.soak", rank_argv(args)[2:], args.nproc or 2, args.run_timeout)


if __name__ == "__main__":
    sys.exit(main())
