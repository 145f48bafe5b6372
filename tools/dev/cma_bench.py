"""One-host all_reduce with and without cross-memory attach (LINERATE_CMA=1 / 0) and choosing
between them (auto), alternating in one run so that all see the same machine (the copies
through the segment can swing widely from minute to minute, with the share of the last-level
cache the ranks get).

    python -m linerate.tools.dev.cma_bench [--nproc 2] [--bytes 64M] [--rounds 10]

Each rank makes three linerate groups of the same ranks (LINERATE_CMA=auto, 1 and 0) and runs
rounds of 5 all_reduces on each in turn; rank 0 prints each variant's median and best time per
op, the mode each group agreed on (its probe may find cross-memory attach forbidden) and how
many ops took each path.
Wrap it in ``flock /tmp/bench.lock`` on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch.multiprocessing as mp


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _rank(rank: int, P: int, port: int, nbytes: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    # The setting is read when a group's shared-memory engine is made: one group with it on,
    # one with it off.
    variants = {"auto": {"LINERATE_CMA": "auto"}, "cma": {"LINERATE_CMA": "1"},
                "segment": {"LINERATE_CMA": "0"}}
    groups = {}
    for name, env in variants.items():
        os.environ.update(env)
        groups[name] = dist.new_group(backend="linerate")
    x = torch.zeros(nbytes // 4)  # zeros: sums repeated in place stay finite
    for g in groups.values():
        for _ in range(3):
            dist.all_reduce(x, group=g)
    times = {name: [] for name in groups}
    for _ in range(rounds):
        for name, g in groups.items():
            dist.barrier(group=g)
            t0 = time.perf_counter()
            for _ in range(5):
                dist.all_reduce(x, group=g)
            times[name].append((time.perf_counter() - t0) / 5)
    if rank == 0:
        for name, ts in times.items():
            eng = groups[name]._shm
            mode, (cma, seg) = (eng.cma, eng.big_paths) if eng is not None else (None, (0, 0))
            print(f"{P} ranks, {nbytes >> 20} MB all_reduce, {name:8s}: median "
                  f"{statistics.median(ts) * 1e3:.2f} ms, best {min(ts) * 1e3:.2f} ms "
                  f"(cross-memory attach: {mode}; ops by CMA {cma}, through the segment "
                  f"{seg})", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(a.nproc, port, _parse_size(a.bytes), a.rounds), nprocs=a.nproc)


if __name__ == "__main__":
    main()
