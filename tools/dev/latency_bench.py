"""The fixed cost of a small collective: linerate, Gloo and (where installed) Open MPI in one run.

    python -m linerate.tools.dev.latency_bench --nproc 2
    python -m linerate.tools.dev.latency_bench --nproc 4 --bytes 4K --iters 2000 --json lat.json
    LINERATE_SHM=0 python -m linerate.tools.dev.latency_bench --nproc 2   # TCP on loopback

Each sample is one call, timed alone: every rank enters a barrier of the backend being measured,
then times one ``all_reduce`` of ``--bytes`` (float32, SUM) or one ``barrier``. The figure is
the median over ``--iters`` samples of the slowest rank's time (each rank's sample is gathered
after the loop, so the gathering costs nothing inside it). Gloo and linerate run in the same
processes, one after the other; Open MPI runs in processes of its own under ``mpirun`` (mpi4py
with Open MPI's shared-memory transport) when ``mpirun`` and mpi4py are there, as a reference
for what a compiled backend costs on this machine, not as a dependency.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MODULE = "linerate.tools.dev.latency_bench"
OPS = ("all_reduce", "barrier")


def _samples_torch(backend: str, op: str, nbytes: int, iters: int, warmup: int) -> list[float]:
    import torch
    import torch.distributed as dist
    group = dist.new_group(backend=backend)
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    fn = (lambda: dist.all_reduce(t, group=group)) if op == "all_reduce" else \
        (lambda: dist.barrier(group=group))
    for _ in range(warmup):
        dist.barrier(group=group)
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = clock()
        fn()
        out.append(clock() - t0)
    dist.destroy_process_group(group)
    return out


def _slowest(samples: list[float]) -> list[float]:
    """Each sample's largest time over ranks (gathered after the loop)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(args) -> int:
    import torch.distributed as dist
    import linerate  # noqa: F401  (registers the backend)
    dist.init_process_group("gloo")
    rows = []
    for op in args.ops:
        for backend in ("linerate", "gloo"):
            s = _slowest(_samples_torch(backend, op, args.bytes, args.iters, args.warmup))
            rows.append({"backend": backend, "op": op, "bytes": args.bytes if op != "barrier" else 0,
                         "ranks": dist.get_world_size(), "median_us": statistics.median(s) * 1e6,
                         "p90_us": sorted(s)[int(0.9 * (len(s) - 1))] * 1e6})
    if dist.get_rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    return 0


def mpi_worker(args) -> int:
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = []
    for op in args.ops:
        a = np.zeros(max(1, args.bytes // 4), dtype=np.float32)
        b = np.empty_like(a)
        fn = (lambda: comm.Allreduce(a, b, op=MPI.SUM)) if op == "all_reduce" else comm.Barrier
        for _ in range(args.warmup):
            comm.Barrier()
            fn()
        s = []
        for _ in range(args.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            s.append(time.perf_counter() - t0)
        s = np.array(s)
        worst = np.empty_like(s)
        comm.Allreduce(s, worst, op=MPI.MAX)
        rows.append({"backend": "Open MPI", "op": op, "bytes": args.bytes if op != "barrier" else 0,
                     "ranks": comm.Get_size(), "median_us": float(np.median(worst)) * 1e6,
                     "p90_us": float(np.sort(worst)[int(0.9 * (len(worst) - 1))]) * 1e6})
    if comm.Get_rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump(rows, f)
    return 0


def mpi_reason() -> str | None:
    """Why Open MPI cannot be measured here, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (Debian: openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install mpi4py)"
    return None


def _argv(args, json_out: str) -> list[str]:
    return ["--ops", ",".join(args.ops), "--bytes", str(args.bytes), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--json-out", json_out]


def run_mpi(args, out: str) -> list[dict]:
    """Open MPI's rows: ``args.nproc`` processes of this module's --mpi-worker under mpirun
    (shared-memory transport), ``out`` their JSON; [] where they failed (why, on stderr)."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(args.nproc),
           "--mca", "btl", "self,vader", sys.executable, "-m", MODULE, "--mpi-worker"]
    p = subprocess.run(cmd + _argv(args, out), capture_output=True, text=True,
                       timeout=args.timeout, env=dict(os.environ, OMPI_MCA_hwloc_base_binding_policy="none",
                                                      OMPI_MCA_rmaps_base_oversubscribe="1"))
    if p.returncode == 0:
        return json.load(open(out))
    print(f"latency_bench: Open MPI failed (exit {p.returncode}): "
          f"{p.stderr.strip()[-800:]}", file=sys.stderr)
    return []


def run(args) -> list[dict]:
    from linerate.tools.launch import launch_local
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "torch.json")
        code = launch_local(MODULE, ["--worker"] + _argv(args, out), args.nproc, args.timeout)
        if code != 0:
            raise SystemExit(f"latency_bench: the ranks failed (exit {code})")
        rows += json.load(open(out))
        why = mpi_reason() if args.mpi != "off" else "--mpi off"
        if why is None:
            rows += run_mpi(args, os.path.join(tmp, "mpi.json"))
        elif args.mpi == "on":
            raise SystemExit(f"latency_bench: --mpi on, but {why}")
        else:
            print(f"latency_bench: Open MPI not measured: {why}", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| op | bytes | ranks | backend | median µs | p90 µs | Gloo / this |",
             "|---|---|---|---|---|---|---|"]
    gloo = {(r["op"], r["ranks"]): r["median_us"] for r in rows if r["backend"] == "gloo"}
    for r in rows:
        g = gloo.get((r["op"], r["ranks"]))
        ratio = f"{g / r['median_us']:.2f}x" if g and r["median_us"] else "–"
        lines.append(f"| {r['op']} | {r['bytes']} | {r['ranks']} | {r['backend']} | "
                     f"{r['median_us']:.1f} | {r['p90_us']:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from linerate.tools.argtypes import size as _size
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks on this host (default 2)")
    p.add_argument("--ops", default=",".join(OPS), help="all_reduce and/or barrier")
    p.add_argument("--bytes", type=_size, default=4096, help="all_reduce size (default 4K)")
    p.add_argument("--iters", type=int, default=1000, help="timed calls per backend and op")
    p.add_argument("--warmup", type=int, default=100, help="untimed calls first")
    p.add_argument("--mpi", choices=("auto", "on", "off"), default="auto",
                   help="measure Open MPI too: where installed (auto), required (on), never")
    p.add_argument("--json", default="", help="write the rows to this file")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    bad = set(args.ops) - set(OPS)
    if bad:
        p.error(f"unknown op(s) {', '.join(sorted(bad))} (choose from {', '.join(OPS)})")
    if args.worker:
        return worker(args)
    if args.mpi_worker:
        return mpi_worker(args)
    rows = run(args)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
