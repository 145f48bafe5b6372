"""Step time of decentralized training against DDP, side by side in one run, with the runtime
model's prediction beside each.

    python -m linerate.tools.dev.decent_bench --netlab NAME [--nproc 8] [--width 1024 --depth 12]
    python -m linerate.tools.dev.decent_bench --nproc 4            # local ranks on loopback

Each rank trains the same MLP (``--depth`` layers of ``--width``, batch ``--batch``). Methods
(``--methods``, default all but xp2p and decp2p), timed in turn in every one of ``--rounds``
rounds so that each sees the same machine conditions:
  compute1   forward + backward + Adam step on rank 0 alone, the other ranks idle: the per-rank
             compute time the runtime model takes as input (C1);
  dcompute1  the same with the decentralized step's compute (DecentralizedDataParallel's
             optimizer and update, no exchange), on rank 0 alone;
  compute, dcompute  the same on every rank at once (no communication): the compute when the
             ranks share the machine's cores;
  allreduce  linerate all_reduce of the model's bytes alone (communication only);
  exchange   neighbor_allreduce of the model's bytes with ``--topology`` alone (communication
             only; time-varying topologies over whole periods);
  ddp        torch DDP over linerate (All-Reduce of gradients, overlapping the backward pass);
  dec        collectives.DecentralizedDataParallel (Adam, ``--topology``), whose parameter
             exchange overlaps the whole iteration;
  xp2p, decp2p  exchange and dec with the group averages inside a host point to point instead
             of on shared memory (``--topology aer-average`` on a lab with ``--ranks-per-host``:
             AER's intra-host steps; not in the default methods).
``--topology aer-average``: AER with intra-host averaging (alternating_exponential_ring(...,
intra="average")); on a lab started with ``--ranks-per-host R`` the nodes of aer are its hosts.
A step's time is the slowest rank's (a barrier before every step); a round's figure is the mean
over its ``--steps`` steps (rounded up to whole periods of the topology). Printed per method: the
best round, the mean over rounds, the machine's CPU use during the method (busy core-seconds per
step from /proc/stat: every process on the machine, other users' included, and the kernel's
network processing), and what ``tools.model`` predicts from the lab (or ``--gbit``), the number
of cores (``--cores``, default this machine's) and the measured compute1 and CPU costs
(``--cpu-costs`` from ``linerate model --measure-cpu --json``, else measured here first).
``--json FILE`` writes every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
METHODS = ("compute1", "dcompute1", "compute", "dcompute", "allreduce", "exchange", "ddp", "dec",
           "xp2p", "decp2p")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m linerate.tools.dev.decent_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netlab", metavar="NAME", default=None, help="run on this netlab cluster")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks (default: every netlab host, or 4)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=6,
                   help="timed steps per method and round (default 6; rounded up to whole "
                        "periods of the topology for exchange and dec)")
    p.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--topology", default="one-peer-exp")
    p.add_argument("--methods", default=",".join(METHODS[:8]),
                   help=f"comma-separated, from {', '.join(METHODS)} (default all)")
    p.add_argument("--gbit", type=float, default=None,
                   help="link rate for the model's prediction without --netlab (flat cluster)")
    p.add_argument("--cores", type=int, default=None,
                   help="cores the ranks share, for the model (default: this machine's)")
    p.add_argument("--cpu-costs", metavar="FILE", default=None,
                   help="the JSON of `linerate model --measure-cpu --json` (its cpu_costs); "
                        "default: measured by the launcher before the ranks start")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    p.add_argument("--timeout", type=float, default=900.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.netlab is None and args.nproc is None and all(k in os.environ for k in _TORCHRUN_ENV):
        return _rank(args)
    unknown = [m for m in _methods(args) if m not in METHODS]
    if unknown:
        print(f"decent_bench: unknown method(s) {', '.join(unknown)}; choose from "
              f"{', '.join(METHODS)}", file=sys.stderr)
        return 2
    from linerate.collectives.topology import NAMES
    topologies = sorted(NAMES) + ["aer-average"]
    if args.topology not in topologies:  # here, not once per rank after they started
        print(f"decent_bench: unknown topology {args.topology!r}; choose from "
              f"{', '.join(topologies)} (intra-host averages point to point: the methods "
              f"xp2p and decp2p)", file=sys.stderr)
        return 2
    if args.netlab is not None:
        from linerate.tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            print(f"decent_bench: --netlab: {reason}", file=sys.stderr)
            return 2
    fwd = list(argv if argv is not None else sys.argv[1:])
    fwd = _without(fwd, "--nproc", 1)
    fwd = _without(fwd, "--cpu-costs", 1)
    inputs = _cpu_costs_file(args)
    fwd += ["--cpu-costs", inputs]
    try:
        return _launch(args, fwd)
    finally:
        os.unlink(inputs)


def _launch(args, fwd: list[str]) -> int:
    if args.netlab is not None:
        from linerate.tools import netlab
        lab = netlab.load(args.netlab)
        # the ranks learn the lab from LINERATE_NETLAB (netlab.rank_env) and read its state
        fwd = _without(fwd, "--netlab", 1)
        return netlab.run_ranks(lab, args.nproc or None,
                                ["-m", "linerate.tools.dev.decent_bench", *fwd], timeout=args.timeout,
                                prefix_output=False)
    from linerate.tools.launch import launch_local
    return launch_local("linerate.tools.dev.decent_bench", fwd, args.nproc or 4, args.timeout)


def _methods(args) -> list[str]:
    return [s.strip() for s in args.methods.split(",") if s.strip()]


def _cpu_costs_file(args) -> str:
    """A JSON file with the model's inputs that the launcher measures before any rank runs (so
    the probes have the machine to themselves): the CPU costs (--cpu-costs FILE, else measured:
    `linerate model --measure-cpu`) and, on netlab, the links (`linerate model --measure`,
    unless FILE holds a cluster: `linerate model --measure --json` output)."""
    import tempfile
    from dataclasses import asdict

    from linerate.tools import model as rt
    nproc = args.nproc
    if nproc is None and args.netlab is not None:
        from linerate.tools import netlab
        nproc = sum(netlab.load(args.netlab).layout())
    out: dict = {}
    if args.cpu_costs:
        with open(args.cpu_costs) as f:
            data = json.load(f)
        out["cpu_costs"] = rt.CpuCosts.from_json(data.get("cpu_costs") or data).to_json()
        if "cluster" in data and data["cluster"]:
            out["cluster"] = {k: v for k, v in data["cluster"].items() if k != "n"}
    else:
        where = f"netlab {args.netlab}" if args.netlab else "loopback"
        print(f"# decent_bench: measuring CPU costs on {where} (`linerate model --measure-cpu`)",
              flush=True)
        out["cpu_costs"] = rt.measure_cpu_costs(args.netlab, ranks=nproc or 4,
                                                cores=args.cores).to_json()
    if args.netlab is not None and "cluster" not in out:
        print(f"# decent_bench: measuring the links of netlab {args.netlab} "
              f"(`linerate model --measure`)", flush=True)
        nbytes = args.depth * (args.width * args.width + args.width) * 4
        cluster, raw = rt.measure_netlab(args.netlab,
                                         shm_bytes=min(256 << 20, max(1 << 20, nbytes)))
        out["cluster"], out["measured"] = asdict(cluster), raw
    fd, path = tempfile.mkstemp(prefix="decent_bench_inputs", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f)
    return path


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


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _machine_cpu() -> dict:
    """Core-seconds of the whole machine so far by kind (/proc/stat's first line)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    return {k: v / hz for k, v in zip(_STAT_FIELDS, fields)}


def _busy(d: dict) -> float:
    """Busy core-seconds: all but idle, iowait and steal (time the hypervisor gave elsewhere)."""
    return sum(v for k, v in d.items() if k not in ("idle", "iowait", "steal"))


def _process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(args) -> int:
    import torch
    import torch.distributed as dist

    import linerate
    from linerate.collectives.neighbor import neighbor_allreduce
    from linerate.collectives.topology import by_name
    torch.set_num_threads(1)
    dist.init_process_group("linerate", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = _methods(args)

    def net():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    loss_fn = torch.nn.functional.mse_loss
    topo = _topology(args, world)
    period = topo.period

    def whole_periods(k: int) -> int:
        return -(-k // period) * period

    m = net()
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())

    phases: list[tuple[float, float, float]] = []  # compute1's forward, backward, optimizer

    def compute_step(record: bool = False):
        t0 = time.perf_counter()
        loss = loss_fn(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if record:
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

    def compute1_step():
        if rank == 0:
            compute_step(record=True)


    dm = None

    def dcompute_step():
        """Decentralized Adam's step without the exchange: the optimizer's work on the
        gradients and the update, applied to the parameters where they are (unmixed)."""
        loss_fn(dm.module(x), y).backward()
        with torch.no_grad():
            update = dm._prepare()
            if update is not None:
                update(dm._views[dm._cur])
        dm.zero_grad()  # dm.steps stays: dcompute1 runs on rank 0 alone, the exchange's step is agreed

    def dcompute1_step():
        if rank == 0:
            dcompute_step()


    flat = torch.zeros(nbytes // 4)

    def allreduce_step():
        dist.all_reduce(flat)

    def exchange_step():
        neighbor_allreduce(flat, topo)

    from linerate.collectives import neighbor as nb_mod

    def p2p(fn):
        def run():
            nb_mod._SHM_AVERAGES = False
            try:
                fn()
            finally:
                nb_mod._SHM_AVERAGES = True
        return run

    steps_of = {name: args.steps for name in METHODS}
    steps_of["exchange"] = steps_of["dec"] = whole_periods(args.steps)
    steps_of["xp2p"] = steps_of["decp2p"] = whole_periods(args.steps)
    fns = {"compute1": compute1_step, "dcompute1": dcompute1_step, "compute": compute_step,
           "dcompute": dcompute_step, "allreduce": allreduce_step, "exchange": exchange_step,
           "xp2p": p2p(exchange_step)}
    finish = {}
    if "ddp" in methods:
        ddp = torch.nn.parallel.DistributedDataParallel(net())
        dopt = torch.optim.Adam(ddp.parameters(), lr=1e-4)

        def ddp_step():
            loss_fn(ddp(x), y).backward()
            dopt.step()
            dopt.zero_grad()
        fns["ddp"] = ddp_step
    if {"dec", "dcompute1", "dcompute", "decp2p"} & set(methods):
        dec = linerate.DecentralizedDataParallel(net(), "adam", lr=1e-4, topology=topo)

        def dec_step():
            loss_fn(dec(x), y).backward()
            dec.step()
        fns["dec"] = dec_step
        dm = dec

        def dec_finish():
            if dec._works is not None:
                for w in dec._works:
                    w.wait()
                dec._works = None
        finish["dec"] = dec_finish
    if "decp2p" in methods:
        # its own model: dec's exchange in flight (it overlaps the next step) keeps its plan
        dec2 = linerate.DecentralizedDataParallel(net(), "adam", lr=1e-4, topology=topo)

        def decp2p_step():
            nb_mod._SHM_AVERAGES = False
            try:
                loss_fn(dec2(x), y).backward()
                dec2.step()
            finally:
                nb_mod._SHM_AVERAGES = True

        def decp2p_finish():
            if dec2._works is not None:
                for w in dec2._works:
                    w.wait()
                dec2._works = None
        fns["decp2p"], finish["decp2p"] = decp2p_step, decp2p_finish

    for name in methods:  # warm up every method once, before the first round
        for _ in range(args.warmup):
            fns[name]()
        if name in finish:
            finish[name]()

    def timed(name: str) -> dict:
        laps = []
        dist.barrier()
        stat0, cpu0, w0 = _machine_cpu(), _process_cpu_s(), time.perf_counter()
        for _ in range(steps_of[name]):
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            laps.append(time.perf_counter() - t0)
        if name in finish:
            finish[name]()
        dist.barrier()
        wall = time.perf_counter() - w0
        stat = {k: v - stat0.get(k, 0.0) for k, v in _machine_cpu().items()}
        cpu = _process_cpu_s() - cpu0
        t = torch.tensor(laps, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)        # each step: the slowest rank
        c = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(c)                               # CPU time of all ranks
        k = len(laps)
        return {"step_s": t.mean().item(), "steps": [v for v in t.tolist()],
                "wall_s_per_step": wall / k,
                "machine_busy_s_per_step": _busy(stat) / k, "ranks_cpu_s_per_step": c.item() / k,
                "machine_cpu_s": stat}

    def background() -> float:
        """Busy cores of the machine while every rank sleeps for a second: other users' load."""
        dist.barrier()
        s0, w0 = _machine_cpu(), time.perf_counter()
        time.sleep(1.0)
        s1, w1 = _machine_cpu(), time.perf_counter()
        dist.barrier()
        return (_busy(s1) - _busy(s0)) / (w1 - w0)

    rounds: dict[str, list[dict]] = {m_: [] for m_ in methods}
    backgrounds = []
    for _ in range(args.rounds):
        backgrounds.append(background())
        for name in methods:
            rounds[name].append(timed(name))
    backgrounds.append(background())
    if rank == 0:
        fwd_fraction = None
        if phases:
            f, b, o = (statistics.median(p_[i] for p_ in phases) for i in range(3))
            fwd_fraction = (f + o) / (f + b + o)
        _report(args, world, nbytes, period, rounds, backgrounds, fwd_fraction)
    dist.destroy_process_group()
    return 0


def _topology(args, world: int):
    """The library's topology of ``--topology``: aer's nodes are the lab's nodes, or its hosts
    where it runs several ranks per host; aer-average is aer with intra-host averaging."""
    from linerate.collectives.topology import by_name
    if args.topology == "aer":
        return by_name("aer", world, ranks_per_node=_ranks_per_node(world))
    if args.topology == "aer-average":
        return by_name("aer", world, ranks_per_node=_ranks_per_node(world), intra="average")
    return by_name(args.topology, world)


def topo_name(args, world: int):
    """The topology for the model: a name, or for aer the library's object (ranks per node)."""
    if args.topology not in ("aer", "aer-average"):
        return args.topology
    return _topology(args, world)


def _ranks_per_node(world: int) -> int:
    lab = _lab()
    if lab is not None and max(lab.layout()) > 1:
        return lab.layout()[0]
    if lab is not None and lab.nodes > 1:
        return len(lab.hosts) // lab.nodes
    return world


def _lab():
    from linerate import settings
    name = settings.read("LINERATE_NETLAB")
    if not name:
        return None
    try:
        from linerate.tools import netlab
        return netlab.load(name)
    except Exception:  # noqa: BLE001 - without the lab's state there is no lab model
        return None


def predictions(cluster, nbytes: int, compute1_s: float, dcompute1_s: float | None,
                cores: float, costs, topology, ranks_per_machine: int,
                fwd_fraction: float | None = None, shared: dict | None = None) -> dict:
    """What tools.model predicts for each method of the bench (seconds per step): the ranks
    share ``cores``; compute1 (DDP's compute: torch Adam) and dcompute1 (the decentralized
    step's compute) measured with one rank alone; ``fwd_fraction``: the share of compute1 that
    cannot overlap an All-Reduce (forward and optimizer step, measured). ``shared``: the
    compute with every rank at once, measured ({"compute": s, "dcompute": s}), to use as C'
    instead of rho * C (the second set of predictions)."""
    from linerate.tools import model as rt
    cpu = rt.CpuModel(cores=cores, ranks=ranks_per_machine, costs=costs)
    f = rt.DEFAULT_FWD_FRACTION if fwd_fraction is None else fwd_fraction
    dc = compute1_s if dcompute1_s is None else dcompute1_s
    shared = shared or {}
    c_sh, dc_sh = shared.get("compute"), shared.get("dcompute")
    import dataclasses
    p2p = dataclasses.replace(cluster, host_mem_gbs=None) if cluster.shared_memory else cluster
    ar = rt.predict(cluster, nbytes, 0.0, method="allreduce", cpu=cpu)
    return {"compute1": compute1_s,
            "dcompute1": dc,
            "compute": c_sh if c_sh is not None else rt.shared_compute_s(compute1_s, cpu),
            "dcompute": dc_sh if dc_sh is not None else rt.shared_compute_s(dc, cpu),
            "allreduce": ar["step_s"], "allreduce_algorithm": ar.get("algorithm"),
            "allreduce_algorithms": ar.get("algorithms"),
            "exchange": rt.predict(cluster, nbytes, 0.0, method=topology, cpu=cpu)["step_s"],
            "xp2p": rt.predict(p2p, nbytes, 0.0, method=topology, cpu=cpu)["step_s"],
            "decp2p": rt.predict(p2p, nbytes, dc, f, method=topology, cpu=cpu,
                                 measured_shared_s=dc_sh)["step_s"],
            "ddp": rt.predict(cluster, nbytes, compute1_s, f, method="allreduce", cpu=cpu,
                              measured_shared_s=c_sh)["step_s"],
            "dec": rt.predict(cluster, nbytes, dc, f, method=topology, cpu=cpu,
                              measured_shared_s=dc_sh)["step_s"]}


def _report(args, world: int, nbytes: int, period: int, rounds: dict,
            backgrounds: list[float], fwd_fraction: float | None) -> None:
    from linerate.tools import model as rt
    lab = _lab()
    cores = args.cores or os.cpu_count() or 1
    with open(args.cpu_costs) as f:
        inputs = json.load(f)
    costs = rt.CpuCosts.from_json(inputs["cpu_costs"])
    summary = {name: {"best_s": min(r["step_s"] for r in rs),
                      "mean_s": statistics.fmean(r["step_s"] for r in rs),
                      "machine_busy_s_per_step": statistics.fmean(
                          r["machine_busy_s_per_step"] for r in rs),
                      "ranks_cpu_s_per_step": statistics.fmean(
                          r["ranks_cpu_s_per_step"] for r in rs)}
               for name, rs in rounds.items() if rs}
    pred, pred2, cluster = {}, {}, None
    # the model's inputs: one rank's compute alone, from the best round (what the CPU does
    # when nothing else runs; the means are reported beside)
    c1 = summary.get("compute1", {}).get("best_s")
    dc1 = summary.get("dcompute1", {}).get("best_s")
    try:
        if "cluster" in inputs:
            cluster = rt.Cluster(**inputs["cluster"])
        elif lab is not None:
            cluster = rt.cluster_from_lab(lab)
        if cluster is not None and cluster.n != world:  # fewer ranks than hosts: flat
            cluster = rt.Cluster(1, world, cluster.intra_gbit, cluster.intra_gbit)
        if cluster is None and args.gbit:
            cluster = rt.Cluster(1, world, args.gbit, args.gbit)
        if cluster is not None and c1 is not None:
            # on netlab (or loopback) every rank runs on this machine
            pred = predictions(cluster, nbytes, c1, dc1, cores, costs, topo_name(args, world),
                               world, fwd_fraction)
            measured_shared = {k: summary[k]["best_s"] for k in ("compute", "dcompute")
                               if k in summary}
            if measured_shared:
                pred2 = predictions(cluster, nbytes, c1, dc1, cores, costs,
                                    topo_name(args, world), world, fwd_fraction, measured_shared)
    except Exception as e:  # noqa: BLE001 - the model is optional here
        print(f"# (no prediction: {type(e).__name__}: {e})")
    load = os.getloadavg()
    print(f"# decent_bench: {world} ranks on {cores} core(s), MLP {args.depth} x {args.width} "
          f"({nbytes / 1e6:.1f} MB of parameters), batch {args.batch}, topology {args.topology} "
          f"(period {period}); cluster: {cluster.describe() if cluster else '?'}")
    print(f"# seconds per step (slowest rank, mean of {args.steps}+ steps per round), "
          f"{args.rounds} round(s): best round, mean of rounds; machine CPU busy core-s per "
          f"step (all processes); load average now {load[0]:.2f}")
    print(f"# {'method':>9} {'best(s)':>8} {'mean(s)':>8} {'cpu(c-s)':>9} {'predicted':>10} "
          f"{'pred/best':>10} {'pred/mean':>10} {'pred(C*)':>9} {'/best':>6} {'/mean':>6}")
    for name in METHODS:
        if name not in summary:
            continue
        s, p, p2 = summary[name], pred.get(name), pred2.get(name)
        if name == "allreduce" and pred.get("allreduce_algorithms"):
            print("# all_reduce predicted: " + ", ".join(
                f"{k} {v['allreduce_s']:.3f} s" for k, v in pred["allreduce_algorithms"].items())
                + f" -> {pred['allreduce_algorithm']}")
        ps = (f"{p:>10.3f} {p / s['best_s']:>10.2f} {p / s['mean_s']:>10.2f}" if p
              else f"{'-':>10} {'-':>10} {'-':>10}")
        ps2 = (f" {p2:>9.3f} {p2 / s['best_s']:>6.2f} {p2 / s['mean_s']:>6.2f}"
               if p2 and name in ("ddp", "dec", "decp2p") else "")
        print(f"  {name:>9} {s['best_s']:>8.3f} {s['mean_s']:>8.3f} "
              f"{s['machine_busy_s_per_step']:>9.2f} {ps}{ps2}")
    if "ddp" in summary and "dec" in summary:
        best = summary["ddp"]["best_s"] / summary["dec"]["best_s"]
        mean = summary["ddp"]["mean_s"] / summary["dec"]["mean_s"]
        line = f"# speedup dec/ddp: measured {best:.2f} (best rounds), {mean:.2f} (means)"
        if "ddp" in pred and "dec" in pred:
            line += f"; predicted {pred['ddp'] / pred['dec']:.2f}"
        if "ddp" in pred2 and "dec" in pred2:
            line += f" ({pred2['ddp'] / pred2['dec']:.2f} with C*)"
        print(line)
    for a, b in (("exchange", "xp2p"), ("dec", "decp2p")):
        if a in summary and b in summary:
            line = (f"# {a} with shared-memory averages / point to point: measured "
                    f"{summary[a]['best_s']:.3f} / {summary[b]['best_s']:.3f} s (best rounds), "
                    f"{summary[a]['mean_s']:.3f} / {summary[b]['mean_s']:.3f} s (means)")
            if a in pred and b in pred:
                line += f"; predicted {pred[a]:.3f} / {pred[b]:.3f} s"
            print(line)
    print("# predicted: from one rank's compute alone (C' = rho C); pred(C*): with the compute "
          "of all ranks at once as measured above (compute, dcompute best rounds) as C'")
    print(f"# model inputs: compute1 {c1 if c1 is None else round(c1, 4)} s, dcompute1 "
          f"{dc1 if dc1 is None else round(dc1, 4)} s, not overlappable with an All-Reduce "
          f"{'-' if fwd_fraction is None else round(fwd_fraction, 3)}, {cores} core(s), "
          f"CPU costs {costs.describe()}")
    print(f"# other users' load (busy cores while the ranks slept, before each round and after "
          f"the last): {', '.join(f'{b:.2f}' for b in backgrounds)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "cores": cores, "nbytes": nbytes, "period": period,
                       "topology": args.topology, "batch": args.batch, "width": args.width,
                       "depth": args.depth, "lab": lab.name if lab else None,
                       "cluster": vars(cluster) if cluster else None,
                       "cpu_costs": costs.to_json(), "measured": inputs.get("measured"),
                       "rounds": rounds, "summary": summary,
                       "predicted": pred, "predicted_with_measured_shared_compute": pred2,
                       "loadavg": load, "fwd_fraction": fwd_fraction,
                       "background_cores": backgrounds}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
