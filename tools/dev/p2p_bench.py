"""Point-to-point bandwidth and latency between two ranks of one host: linerate over shared
memory (the default), linerate with LINERATE_SHM=0 (loopback TCP) and Gloo, in one run.

    python -m linerate.tools.dev.p2p_bench [--sizes 64K,1M,64M] [--seconds 1.0]

Bandwidth: rank 0 streams messages of each size to rank 1 (isend, windows of max(4, 8 MB / size)
messages in flight),
rank 1 answers each window with a 1-byte message; bytes / wall time. Latency: 8 KB ping-pong,
half the round trip (median over the run). Each configuration runs in its own pair of
processes, one after the other (wrap it in ``flock /tmp/bench.lock`` on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _worker(rank, port, env, backend, sizes, seconds, q):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import linerate  # noqa: F401 - registers the backend
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank
    out = {}
    ack = torch.zeros(1, dtype=torch.uint8)
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)
        window = max(4, (8 << 20) // max(size, 1))  # >= 8 MB per window: streaming
        count, t_end, t0 = 0, None, None
        for phase in ("warm", "run"):
            limit = 0.2 if phase == "warm" else seconds
            dist.barrier()
            t0 = time.perf_counter()
            n = 0
            while True:
                if rank == 0:
                    reqs = [dist.isend(buf, peer, tag=1) for _ in range(window)]
                    for r in reqs:
                        r.wait()
                    dist.recv(ack, peer, tag=2)
                    n += window
                    go = torch.tensor([1 if time.perf_counter() - t0 < limit else 0], dtype=torch.uint8)
                    dist.send(go, peer, tag=3)
                else:
                    reqs = [dist.irecv(buf, peer, tag=1) for _ in range(window)]
                    for r in reqs:
                        r.wait()
                    dist.send(ack, peer, tag=2)
                    n += window
                    go = torch.zeros(1, dtype=torch.uint8)
                    dist.recv(go, peer, tag=3)
                if not int(go[0]):
                    break
            count, t_end = n, time.perf_counter()
        out[size] = count * size / (t_end - t0)
    # latency: 8 KB ping-pong
    msg = torch.zeros(8192, dtype=torch.uint8)
    rtts = []
    dist.barrier()
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        if rank == 0:
            dist.send(msg, peer, tag=4)
            dist.recv(msg, peer, tag=5)
            rtts.append(time.perf_counter() - t)
            go = torch.tensor([1 if t < end else 0], dtype=torch.uint8)
            dist.send(go, peer, tag=6)
        else:
            dist.recv(msg, peer, tag=4)
            dist.send(msg, peer, tag=5)
            go = torch.zeros(1, dtype=torch.uint8)
            dist.recv(go, peer, tag=6)
        if not int(go[0]):
            break
    dist.destroy_process_group()
    if rank == 0:
        q.put({"bw": out, "lat_us": statistics.median(rtts[len(rtts) // 10:]) / 2 * 1e6})


def run(name, backend, env, sizes, seconds):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, env, backend, sizes, seconds, q))
             for r in (0, 1)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return name, res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M,64M")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--configs", default="shm,tcp,gloo")
    args = ap.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    table = {"shm": ("linerate", {"LINERATE_SHM": "auto"}),
             "tcp": ("linerate", {"LINERATE_SHM": "0"}),
             "gloo": ("gloo", {})}
    rows = []
    for name in args.configs.split(","):
        backend, env = table[name]
        rows.append(run(name, backend, {**env, "OMP_NUM_THREADS": "1"}, sizes, args.seconds))
    print("config " + "".join(f"{s >> 10:>9} KB" for s in sizes) + "  8 KB latency")
    for name, res in rows:
        print(f"{name:<7}" + "".join(f"{res['bw'][s] / 1e9:>7.2f} GB/s" for s in sizes)
              + f"  {res['lat_us']:9.1f} us")
    print(json.dumps({n: {"GB/s": {str(k): round(v / 1e9, 3) for k, v in r["bw"].items()},
                          "lat_us": round(r["lat_us"], 1)} for n, r in rows}))


if __name__ == "__main__":
    main()
