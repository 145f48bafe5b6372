"""Scale sweep: what a group costs as the number of ranks grows, linerate and Gloo in one run.

    python -m linerate.tools.dev.scale_bench --ranks 2,8,16,32 [--iters 50] [--subgroups 100]
    python -m linerate.tools.dev.scale_bench --ranks 64 --json scale.json

For each world size N the driver starts N local ranks (loopback, the way torchrun would). The
default group is Gloo and only carries the bookkeeping; each compared backend then gets a group
of all ranks of its own, one backend after the other, and every rank measures:

- **threads**: OS threads of the process (``/proc/self/task``) added by creating the group and
  running one op on it (the largest over ranks);
- **set-up**: seconds from ``new_group`` until a first 4-byte all_reduce on it has completed
  (a backend that connects lazily pays for its connections there), the largest over ranks;
  and the CPU seconds that took, summed over ranks (every thread of each process: on a host
  with fewer cores than ranks, that is what bounds set-up);
- **4 KB all_reduce**: mean milliseconds per op over ``--iters`` back-to-back blocking ops
  (after a warm-up), the largest over ranks;
- **2-rank new_group**: seconds for ranks 0 and 1 to create a group of just the two of them and
  complete a first op on it, while the other N-2 ranks take part in ``new_group`` as torch asks;
- with ``--repeat K`` (default 7): set-up and the 2-rank new_group again K times per backend,
  the backends alternating (each group destroyed before the next), each time the largest over
  ranks; the table shows the median of the K (and the first, one-shot figure above it in the
  JSON as ``setup_s`` / ``pair_group_s``): one sample of a few milliseconds on a host with
  fewer cores than ranks is mostly which process the scheduler ran first;
- with ``--subgroups K``: seconds to create K two-rank subgroups (pairs (i, i+1 mod N), every rank
  a member of some) and run one op on each, and the threads the rank holds after that.

Each group is destroyed before the next backend's, so their threads do not add up. Rank 0
prints one line per backend and size, and the ratio linerate/Gloo, and appends JSON lines to
``--json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from linerate.tools.launch import launch_local

MODULE = "linerate.tools.dev.scale_bench"
BACKENDS = ("linerate", "gloo")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _max(value: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum(value: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _timed_group(backend: str, one):
    """A group of all ranks and a first op on it: (group, seconds, CPU seconds of this rank)."""
    import torch.distributed as dist
    c0 = time.process_time()
    t0 = time.perf_counter()
    g = dist.new_group(backend=backend)
    dist.all_reduce(one, group=g)
    return g, time.perf_counter() - t0, time.process_time() - c0


def _timed_pair(backend: str, one):
    """Ranks 0 and 1 make a group of their own (every rank calls new_group) and run a first op
    on it: (group or None, seconds on ranks 0 and 1, 0 elsewhere)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    t0 = time.perf_counter()
    pair = dist.new_group([0, 1], backend=backend)
    if rank < 2:
        dist.all_reduce(one, group=pair)
    return pair, (time.perf_counter() - t0 if rank < 2 else 0.0)


def _measure(backend: str, iters: int, subgroups: int) -> dict:
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    one = torch.zeros(1)  # zeros: ops repeated in place stay finite
    dist.barrier()
    threads0 = _threads()
    g, setup, setup_cpu = _timed_group(backend, one)
    threads = _threads() - threads0
    x = torch.zeros(1024)  # 4 KB of float32
    for _ in range(5):
        dist.all_reduce(x, group=g)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=g)
    per_op = (time.perf_counter() - t0) / iters
    out = {"backend": backend, "ranks": size, "threads": _max(threads), "setup_s": _max(setup),
           "setup_cpu_s": _sum(setup_cpu),
           "allreduce_4k_ms": _max(per_op * 1e3), "rss_mib": _max(_rss_mib())}
    # A two-rank group on N ranks: every rank calls new_group; ranks 0 and 1 time it.
    dist.barrier()
    pair, pair_s = _timed_pair(backend, one) if size >= 2 else (None, 0.0)
    out["pair_group_s"] = _max(pair_s)
    if subgroups and size >= 2:
        dist.barrier()
        before = _threads()
        t0 = time.perf_counter()
        held = []
        for k in range(subgroups):
            a = k % size
            members = sorted({a, (a + 1) % size})
            sub = dist.new_group(members, backend=backend)
            held.append(sub)
            if rank in members:
                dist.all_reduce(one, group=sub)
        out["subgroups"] = subgroups
        out["subgroups_s"] = _max(time.perf_counter() - t0)
        out["subgroups_threads"] = _max(_threads() - before)
        for sub in held:
            if sub is not None and rank in dist.get_process_group_ranks(sub):
                dist.destroy_process_group(sub)
    if pair is not None and rank < 2:
        dist.destroy_process_group(pair)
    dist.destroy_process_group(g)
    dist.barrier()
    return out


def _samples(backends, repeat: int) -> dict:
    """Set-up and 2-rank new_group, ``repeat`` times per backend, the backends alternating:
    {backend: {"setup": [...], "setup_cpu": [...], "pair": [...]}} (each sample the largest
    over ranks; CPU summed over ranks)."""
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    one = torch.zeros(1)
    got = {b: {"setup": [], "setup_cpu": [], "pair": []} for b in backends}
    for k in range(repeat):
        for b in (backends if k % 2 == 0 else tuple(reversed(backends))):
            # Every sample starts with nothing left for the collector: a full collection of a
            # process that imported torch takes tens of milliseconds of CPU (far more wall time
            # where ranks outnumber cores); one set off inside a sample by earlier garbage is
            # not the backend's cost.
            gc.collect()
            dist.barrier()
            g, setup, setup_cpu = _timed_group(b, one)
            got[b]["setup"].append(setup)
            got[b]["setup_cpu"].append(setup_cpu)
            if size >= 2:  # made while the group of all ranks is up, as a job's subgroups are
                dist.barrier()
                pair, pair_s = _timed_pair(b, one)
                got[b]["pair"].append(pair_s)
                dist.barrier()  # no rank tears a group down while 0 and 1 still make theirs
                if rank < 2:
                    dist.destroy_process_group(pair)
                del pair
            dist.destroy_process_group(g)
            # A group's object goes when its last reference does: here, not in the next
            # sample's new_group (Gloo closes its connections and joins its threads then).
            del g
            gc.collect()
    for b in backends:
        for key in ("setup", "pair"):
            t = torch.tensor(got[b][key] or [0.0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            got[b][key] = t.tolist()
        t = torch.tensor(got[b]["setup_cpu"] or [0.0], dtype=torch.float64)
        dist.all_reduce(t)
        got[b]["setup_cpu"] = t.tolist()
    return got


def worker(args) -> int:
    import torch.distributed as dist
    import linerate  # noqa: F401  (registers the backend)
    # Load the backend's modules before timing, as Gloo's code is loaded with torch: set-up
    # times compare connecting, not importing.
    import linerate.collectives.backend  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = [_measure(b, args.iters, args.subgroups) for b in BACKENDS]
    if args.repeat > 0:
        import statistics
        got = _samples(BACKENDS, args.repeat)
        for row in rows:
            g = got[row["backend"]]
            row["repeat"] = args.repeat
            row["setup_med_s"] = statistics.median(g["setup"])
            row["setup_min_s"] = min(g["setup"])
            row["setup_cpu_med_s"] = statistics.median(g["setup_cpu"])
            row["pair_group_med_s"] = statistics.median(g["pair"])
            row["pair_group_min_s"] = min(g["pair"])
            row["setup_samples_s"] = [round(x, 4) for x in g["setup"]]
            row["pair_group_samples_s"] = [round(x, 4) for x in g["pair"]]
    if rank == 0:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()
    return 0


def _table(rows: list[dict]) -> str:
    by = {(r["ranks"], r["backend"]): r for r in rows}
    lines = ["| ranks | threads/rank | set-up s | set-up CPU s | 4 KB all_reduce ms | 2-rank new_group s |"
             + (" subgroups s (threads) |" if any("subgroups" in r for r in rows) else ""),
             "|---|---|---|---|---|---|" + ("---|" if any("subgroups" in r for r in rows) else "")]
    for n in sorted({r["ranks"] for r in rows}):
        lr, gl = by.get((n, "linerate")), by.get((n, "gloo"))
        if lr is None or gl is None:
            continue

        def cell(key, fmt):
            return f"{fmt.format(lr[key])} ({fmt.format(gl[key])})"
        med = "setup_med_s" in lr and "setup_med_s" in gl
        line = (f"| {n} | {cell('threads', '{:.0f}')} | "
                f"{cell('setup_med_s' if med else 'setup_s', '{:.3f}')} | "
                f"{cell('setup_cpu_med_s' if med else 'setup_cpu_s', '{:.2f}')} | "
                f"{cell('allreduce_4k_ms', '{:.2f}')} | "
                f"{cell('pair_group_med_s' if med else 'pair_group_s', '{:.4f}')} |")
        if "subgroups" in lr:
            line += (f" {lr['subgroups_s']:.2f} ({gl['subgroups_s']:.2f}), "
                     f"{lr['subgroups_threads']:.0f} ({gl['subgroups_threads']:.0f}) |")
        lines.append(line)
    return "\n".join(lines) + ("\n(linerate, Gloo in parentheses; each the largest over ranks; "
                                "set-up and 2-rank new_group: the median of --repeat samples, "
                                "the backends alternating)")


def _count(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m " + MODULE, description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,8,16,32", help="world sizes, comma-separated")
    p.add_argument("--iters", type=int, default=50, help="timed 4 KB all_reduces per backend")
    p.add_argument("--repeat", type=int, default=7,
                   help="set-up and 2-rank new_group samples per backend, alternating (median shown)")
    p.add_argument("--subgroups", type=int, default=0, help="also create and use K two-rank subgroups")
    p.add_argument("--json", default="", help="append the results as JSON lines to this file")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per world size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    try:
        sizes = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks: expected comma-separated integers, got {args.ranks!r}")
    if not sizes or min(sizes) < 1:
        p.error("--ranks: world sizes must be at least 1")
    out = args.json or f"/tmp/linerate-scale-{os.getpid()}.jsonl"
    if not args.json and os.path.exists(out):
        os.unlink(out)
    rows: list[dict] = []
    for n in sizes:
        start = _count(out)
        code = launch_local(MODULE, ["--worker", "--iters", str(args.iters), "--repeat",
                                     str(args.repeat), "--subgroups",
                                     str(args.subgroups), "--json", out], n, args.timeout)
        if code != 0:
            print(f"scale_bench: {n} ranks failed (exit {code})", file=sys.stderr)
            return code
        with open(out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for r in rows[start:]:
            print(json.dumps(r), flush=True)
    print(_table(rows))
    if not args.json:
        os.unlink(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
