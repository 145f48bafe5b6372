"""The GPU host check: every question a GPU host must answer, in one command that fits its
short loan (at most 7 minutes on one GPU and 16 cores), each step with a timeout of its own.

    python -m linerate.tools.dev.gpu_check --out DIR       # a checkout: PYTHONPATH=. (no install)
    python tools/dev/gpu_check.py --out DIR                # the same, with no PYTHONPATH at all
    python -m linerate.tools.dev.gpu_check --cpu --out DIR # every step on CPU tensors, small sizes
    python -m linerate.tools.dev.gpu_check --render DIR/gpu_check.json --docs docs/performance.md

Steps, in order (a step that fails or runs out of time is recorded and the next one runs):

- host: the machine (cores, memory copy bandwidth, torch, CUDA, the GPU); whether
  ``/sys/class/infiniband`` holds a device and whether ``rdma_rxe`` is loaded or loadable (one
  look), for the RDMA path; whether Open MPI (mpirun, mpi4py) is there.
- correctness-P (P = 2, 4): ranks sharing the one GPU run every collective on CUDA tensors
  (float32, bfloat16, float16, int64; sizes 0, 1, 7, 1023, 100003 and one of 10 MiB) and
  compare with the same inputs reduced on the CPU; a tensor written by a long kernel just
  before ``all_reduce(async_op=True)`` (on the current and on a side stream) must not be read
  early.
- staging-P (P = 2, 4): busbw of 64 MB and 256 MB all_reduces of CUDA tensors, pipelined
  (the default), staged whole (``LINERATE_STAGING=whole``) and Gloo, beside the same sizes of
  CPU tensors; the target is pipelined CUDA busbw >= 0.9x the CPU tensors' linerate busbw.
- ddp: torchvision's ResNet-18 on 2 ranks, 20 steps with linerate then Gloo from the same seed:
  the parameters must be equal; step times side by side, and where linerate's goes: the step
  without communication (``no_sync``) and with every bucket pipelined.
- unit: ``pytest -m unit`` with this host's torch (a second torch version beside CI's), spread
  over up to 8 processes where pytest-xdist is there.
- scale-P (P = 2, 4, 8, 16): CPU tensors: 64 MB all_reduce over shared memory (and at 2 ranks
  over loopback TCP, ``LINERATE_SHM=0``, with 1, 2, 4 and 8 connections per peer), 4 KB
  latency at 2, 8 and 16 ranks; Gloo beside each, and Open MPI where mpirun and mpi4py work;
  the ranks' CPU time over the wall time (cores busy).

Everything lands under DIR: ``gpu_check.json`` (rewritten after every step), ``gpu_check.log``
(every process's output) and ``performance-gpu.md`` (the section of docs/performance.md,
written by perf_report's section code; ``--docs PAGE`` replaces it in that page too). A short
summary is printed at the end; the exit status is 0 when every step ran and every check held.

``--cpu`` runs the same steps with CPU tensors, fewer ranks and small sizes (under a minute on
two cores), the pipelined staging on the stand-in copier (collectives/pipeline.py
``ThreadCopier``) and a small stand-in model where torchvision is missing: the test suite runs
it (tests/test_gpu_check.py), so the check cannot rot between GPU hosts.

The check needs no install: run from a checkout, it maps the package from the checkout's
folders and registers the backend by importing ``linerate`` (a GPU host's torch has no entry
point of ours), and its ranks get the checkout on their PYTHONPATH.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a file of a checkout (python tools/dev/gpu_check.py): the checkout's root holds
    # the ``linerate`` package (its __init__ maps the repository's folders in), not this folder.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parents[1]))
    from linerate.tools.dev.gpu_check import main as _main
    sys.exit(_main())

MODULE = "linerate.tools.dev.gpu_check"
#: The whole check's wall time on a GPU host, at most (steps that would start later are
#: skipped, a running one gets at most what is left).
BUDGET_S = 420.0
#: A step is not started with less than this many seconds of the budget left.
MIN_STEP_S = 15.0
#: Pipelined CUDA busbw over the CPU tensors' linerate busbw of the same run: the target.
TARGET = 0.9
#: Seconds a collective of the check's groups may take before it fails (a hung rank is named
#: well before its step's timeout).
OP_TIMEOUT_S = 60.0


@dataclass
class Plan:
    """What each step runs: GPU_PLAN on a GPU host, CPU_PLAN with --cpu."""
    cpu: bool
    corr_worlds: tuple
    corr_counts: tuple
    #: A pipelined all_reduce of the default settings: its size in bytes, whatever the dtype.
    corr_big_bytes: int
    #: linerate.Options fields of every linerate group the steps make (beside the defaults),
    #: and of the correctness step's group that pipelines in small chunks.
    group_options: dict
    chunked_options: dict
    ddp_options: dict
    ddp_steps: int
    ddp_batch: tuple
    speed_worlds: tuple
    speed_bytes: tuple
    speed_iters: dict          # bytes -> (warmup, iters)
    scale_worlds: tuple
    scale_bytes: int
    scale_iters: tuple         # (warmup, iters)
    nsocks: tuple
    lat_worlds: tuple
    lat_iters: int
    unit_args: list
    limits: dict = field(default_factory=dict)   # step kind -> seconds


_CHUNKED = {"stage_chunk_bytes": 64 << 10, "stage_min_bytes": 128 << 10, "fusion_bytes": 64 << 10}
#: The ddp step's "linerate pipelined" run, over the plan's options: every bucket above
#: LINERATE_STAGE_MIN_BYTES and LINERATE_FUSION_BYTES (DDP's first bucket, 1 MiB, otherwise
#: takes one blocking copy to the host, on the autograd thread).
DDP_PIPELINED = {"stage_min_bytes": 256 << 10, "fusion_bytes": 512 << 10}

GPU_PLAN = Plan(
    cpu=False, corr_worlds=(2, 4), corr_counts=(0, 1, 7, 1023, 100003), corr_big_bytes=10 << 20,
    group_options={}, chunked_options=_CHUNKED, ddp_options={}, ddp_steps=20,
    ddp_batch=(32, 3, 224, 224), speed_worlds=(2, 4), speed_bytes=(64 << 20, 256 << 20),
    speed_iters={64 << 20: (2, 5), 256 << 20: (1, 3)}, scale_worlds=(2, 4, 8, 16),
    scale_bytes=64 << 20, scale_iters=(2, 5), nsocks=(1, 2, 4, 8), lat_worlds=(2, 8, 16),
    lat_iters=300, unit_args=["-m", "unit", "tests"],
    limits={"correctness": 75, "staging": 75, "ddp": 90, "unit": 240, "scale": 60})

CPU_PLAN = Plan(
    cpu=True, corr_worlds=(2,), corr_counts=(0, 1, 7, 100003), corr_big_bytes=1 << 20,
    group_options={"stage_chunk_bytes": 256 << 10, "stage_min_bytes": 512 << 10,
                   "fusion_bytes": 256 << 10},
    chunked_options=_CHUNKED,
    ddp_options={"stage_chunk_bytes": 16 << 10, "stage_min_bytes": 32 << 10,
                 "fusion_bytes": 16 << 10},
    ddp_steps=20, ddp_batch=(8, 3, 32, 32), speed_worlds=(2,), speed_bytes=(1 << 20, 4 << 20),
    speed_iters={1 << 20: (1, 3), 4 << 20: (1, 2)}, scale_worlds=(2,), scale_bytes=1 << 20,
    scale_iters=(1, 3), nsocks=(1, 2), lat_worlds=(2,), lat_iters=30,
    unit_args=["-p", "no:xdist", "-p", "no:hypothesispytest", "-m", "unit",
               "tests/test_settings.py::test_every_setting_is_fully_declared"],
    limits={"correctness": 60, "staging": 45, "ddp": 60, "unit": 60, "scale": 60})

DTYPES = ("float32", "bfloat16", "float16", "int64")


class StepError(Exception):
    pass


# ============================================================================ main process
def _root() -> Path:
    """The folder that holds the ``linerate`` package (a checkout's root)."""
    from linerate.tools import launch
    return Path(launch._SOURCE_ROOT)


def rdma_line() -> dict:
    """One look for the RDMA path: devices under /sys/class/infiniband, and whether the
    soft-RoCE module rdma_rxe is loaded or in this kernel's module list."""
    ib = Path("/sys/class/infiniband")
    devices = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    if Path("/sys/module/rdma_rxe").exists():
        rxe = "loaded"
    else:
        dep = Path("/lib/modules") / os.uname().release / "modules.dep"
        try:
            rxe = "loadable" if "/rdma_rxe.ko" in dep.read_text() else "not in the kernel's modules"
        except OSError:
            rxe = f"unknown ({dep} unreadable)"
    return {"infiniband": devices, "rdma_rxe": rxe}


def host_step(plan: Plan) -> dict:
    import torch

    from linerate.tools.dev import latency_bench, perf_report
    out = {"machine": perf_report.machine(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "rdma": rdma_line(), "mpi": latency_bench.mpi_reason() or "available"}
    try:
        import torchvision  # noqa: F401
        out["torchvision"] = torchvision.__version__
    except Exception as e:  # noqa: BLE001 - absent, or a build that does not fit this torch
        out["torchvision"] = f"unavailable ({type(e).__name__})"
    if not plan.cpu:
        if not torch.cuda.is_available():
            raise StepError("no CUDA device (torch.cuda.is_available() is False); --cpu runs "
                            "the steps on CPU tensors")
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
    return out


_FORKS: list = []


def _forks():
    """Ranks start as forks of one server that imported torch and linerate once (Python's
    forkserver; it never touches CUDA, each rank initializes its own): a rank starts in
    milliseconds instead of an interpreter's and torch's start."""
    if not _FORKS:
        import multiprocessing
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "linerate",
                                    "linerate.collectives.backend", "linerate.tools.launch"])
        _FORKS.append(ctx)
    return _FORKS[0]


class _Rank:
    """A forked rank as tools/launch.py's supervise watches it (a Popen's poll, wait, pid)."""

    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    def poll(self):
        return self.proc.exitcode

    def wait(self):
        self.proc.join()
        return self.proc.exitcode


def _rank_main(env: dict, log_path: str, spec_path: str) -> None:
    """A rank's life in its fork: a session of its own (supervise stops it with what it
    started), output to the log, its thread stacks there too when it is stopped."""
    import faulthandler
    import signal
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    os.environ.clear()
    os.environ.update(env)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        code = worker(spec_path)
    except BaseException:  # noqa: BLE001 - printed to the log, the rank fails
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(log, kind: str, world: int, spec: dict, timeout: float) -> dict:
    """``world`` ranks of this module's worker ``kind`` (tools/launch.py supervises them);
    rank 0's result, partial where the ranks failed or ran out of time (``exit`` set)."""
    from linerate.tools import launch
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(dict(spec, kind=kind, out=out, timeout=timeout), f)
        port = launch.free_port()
        ctx = _forks()

        def start(rank: int) -> _Rank:
            p = ctx.Process(target=_rank_main, args=(launch.rank_env(rank, world, port),
                                                     log.name, path), daemon=False)
            p.start()
            return _Rank(p)

        log.flush()
        with contextlib.redirect_stderr(_Text(log)):
            code = launch.supervise(start, world, timeout, f"gpu_check {kind}-{world}")
        result = json.load(open(out)) if os.path.exists(out) else {}
    if code != 0:
        why = ("timed out" if code == launch.EXIT_TIMEOUT else f"exit {code}")
        if not result:
            raise StepError(f"the ranks failed ({why}) before reporting; see the log")
        result["exit"] = why
    return result


class _Text:
    """A text stream onto the log file (what supervise prints)."""

    def __init__(self, f):
        self.f = f

    def write(self, s: str) -> int:
        self.f.write(s.encode())
        return len(s)

    def flush(self) -> None:
        self.f.flush()


def _run_cmd(log, argv: list, timeout: float, label: str, cwd: str | None = None) -> tuple[int, str]:
    """A command of its own session, its output to the log and returned; killed (with what it
    started) at the timeout."""
    from linerate.tools import launch
    with tempfile.TemporaryFile() as cap:
        def start(_rank: int) -> subprocess.Popen:
            return subprocess.Popen(argv, stdout=cap, stderr=subprocess.STDOUT, cwd=cwd,
                                    start_new_session=True)
        with contextlib.redirect_stderr(_Text(log)):
            code = launch.supervise(start, 1, timeout, label)
        cap.seek(0)
        text = cap.read().decode(errors="replace")
    log.write(text.encode())
    return code, text


def unit_step(plan: Plan, log, timeout: float) -> dict:
    root = _root()
    if not (root / "tests" / "conftest.py").is_file():
        raise StepError(f"no tests/ beside the package ({root}): run the check from a checkout")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
            *_spread(plan.unit_args), *plan.unit_args]
    code, text = _run_cmd(log, argv, timeout, "gpu_check unit", cwd=str(root))
    import torch
    return dict(pytest_result(code, text), command=" ".join(["python", *argv[1:]]),
                torch=torch.__version__)


def _spread(args: list) -> list:
    """pytest-xdist's arguments spreading the unit tier over this host's cores (at most 8 and
    with CI's grouping), where xdist is there and the plan does not switch it off: one process
    runs the tier's 700 tests in more than the step's four minutes."""
    import importlib.util
    if "no:xdist" in args or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2))), "--dist", "loadgroup"]


def pytest_result(code: int, text: str) -> dict:
    """What a pytest run printed: counts, failed tests, the summary line, and the skips that
    tests/conftest.py did not expect; ``problem`` where the run failed for more than those."""
    import re
    tail = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|"
                                               r"xpassed|deselected)", tail[0])}
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in text.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    # tests/conftest.py fails a run on a skip it does not expect (a package the suite needs is
    # missing): a GPU host lacks the test extra's packages; that is said, not a failure
    unexpected = [line.strip() for line in text.splitlines() if line.startswith("UNEXPECTED (")]
    out = {"exit": code, "counts": counts, "failed": failed[:50],
           "summary": tail[0].strip("= "), "unexpected_skips": unexpected}
    only_skips = (code == 1 and unexpected and not failed
                  and not counts.get("failed") and not counts.get("error") and not counts.get("errors"))
    if code != 0 and not only_skips:
        out["problem"] = f"pytest exit {code}: {tail[0].strip('= ')}"
    return out


def scale_step(plan: Plan, log, world: int, timeout: float) -> dict:
    t_end = time.monotonic() + timeout
    spec = {"cpu": plan.cpu, "bytes": plan.scale_bytes, "iters": plan.scale_iters,
            "nsocks": list(plan.nsocks) if world == 2 else [],
            "latency": world in plan.lat_worlds, "lat_iters": plan.lat_iters,
            "group_options": plan.group_options}
    result = _launch(log, "scale", world, spec, timeout)
    from linerate.tools.dev import latency_bench
    why = latency_bench.mpi_reason()
    if why is not None:
        result["mpi"] = f"not measured: {why}"
        return result
    result["mpi"] = {}
    sizes = [("bytes", plan.scale_bytes, *plan.scale_iters)]
    if spec["latency"]:
        sizes.append(("latency", 4096, 50, plan.lat_iters))
    with tempfile.TemporaryDirectory() as tmp:
        for key, nbytes, warmup, iters in sizes:
            left = t_end - time.monotonic()
            if left < 5:
                result["mpi"][key] = "not measured: out of time"
                continue
            ns = argparse.Namespace(nproc=world, ops=["all_reduce"], bytes=nbytes, iters=iters,
                                    warmup=warmup, timeout=left)
            try:
                with contextlib.redirect_stderr(_Text(log)):
                    rows = latency_bench.run_mpi(ns, os.path.join(tmp, f"{key}.json"))
            except subprocess.TimeoutExpired:
                rows = []
            result["mpi"][key] = rows[0]["median_us"] if rows else "failed (see the log)"
    return result


def _steps(plan: Plan) -> list:
    """(name, kind, world) in the order they run."""
    out = [("host", "host", 0)]
    out += [(f"correctness-{p}", "correctness", p) for p in plan.corr_worlds]
    out += [(f"staging-{p}", "staging", p) for p in plan.speed_worlds]
    out += [("ddp", "ddp", 2)]
    out += [(f"scale-{p}", "scale", p) for p in plan.scale_worlds]
    # Last: the unit tier holds the collective matrices on thread ranks (minutes on one
    # core); it takes what the budget has left, after every figure that needs the machine.
    out += [("unit", "unit", 0)]
    return out


def run_step(plan: Plan, log, name: str, kind: str, world: int, timeout: float) -> dict:
    if kind == "host":
        return host_step(plan)
    if kind == "unit":
        return unit_step(plan, log, timeout)
    if kind == "scale":
        return scale_step(plan, log, world, timeout)
    spec = {"cpu": plan.cpu, "group_options": plan.group_options}
    if kind == "correctness":
        spec.update(counts=list(plan.corr_counts), big_bytes=plan.corr_big_bytes,
                    chunked_options=plan.chunked_options)
    elif kind == "staging":
        spec.update(sizes=list(plan.speed_bytes),
                    iters={str(k): v for k, v in plan.speed_iters.items()})
    elif kind == "ddp":
        spec.update(steps=plan.ddp_steps, batch=list(plan.ddp_batch),
                    ddp_options=plan.ddp_options)
    return _launch(log, {"staging": "speed"}.get(kind, kind), world, spec, timeout)


def problems(name: str, result: dict) -> list[str]:
    """What a step's result says went wrong (empty: all held)."""
    out = []
    if result.get("exit") and not result.get("problem"):  # (pytest's names its exit)
        out.append(f"exit status {result['exit']}")
    if result.get("error"):
        out.append(result["error"])
    if result.get("problem"):
        out.append(result["problem"])
    if name.startswith("correctness"):
        if result.get("failed"):
            out.append(f"{len(result['failed'])} of {result.get('checks', '?')} checks failed: "
                       + "; ".join(result["failed"][:3]))
        for k, v in (result.get("long_kernel") or {}).items():
            if v is False:
                out.append(f"long kernel ({k}): read early")
        if result.get("checks") is not None and not result.get("pipelined"):
            out.append("no all_reduce took the pipelined path")
    if name == "ddp" and result.get("equal") is False:
        out.append(f"parameters differ from Gloo's (max diff {result.get('max_abs_diff')})")
    if name == "ddp" and result.get("replicas_agree") is False:
        out.append("the ranks' replicas differ after the steps")
    return out


def run_check(plan: Plan, out_dir: Path, budget: float, json_path: Path | None = None,
              only: list | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"mode": "cpu" if plan.cpu else "gpu", "budget_s": budget, "plan": asdict(plan),
            "steps": {}}
    t0 = time.monotonic()
    deadline = t0 + budget
    log_path = out_dir / "gpu_check.log"
    with open(log_path, "ab") as log:
        for name, kind, world in _steps(plan):
            if only and name not in only and kind not in only:
                continue
            left = deadline - time.monotonic()
            limit = plan.limits.get(kind, 30.0)
            entry = data["steps"][name] = {"status": "skipped"}
            if kind != "host" and left < MIN_STEP_S:
                entry["error"] = f"out of the {budget:.0f} s budget"
                _save(data, out_dir, json_path)
                continue
            timeout = max(1.0, min(limit, left))
            log.write(f"\n===== {name} (timeout {timeout:.0f} s) =====\n".encode())
            log.flush()
            print(f"gpu_check: {name} ...", flush=True)
            s0 = time.monotonic()
            try:
                result = run_step(plan, log, name, kind, world, timeout)
                entry.update(status="ok", result=result)
            except Exception as e:  # noqa: BLE001 - recorded; the next step runs
                log.write(traceback.format_exc().encode())
                entry.update(status="failed", error=f"{type(e).__name__}: {e}")
            entry["seconds"] = round(time.monotonic() - s0, 1)
            if entry["status"] == "ok":
                bad = problems(name, entry["result"])
                if bad:
                    entry["status"] = "timeout" if "timed out" in " ".join(bad) else "failed"
                    entry["error"] = "; ".join(bad)
            if kind == "host":
                data["host"] = entry.get("result", {})
            _save(data, out_dir, json_path)
    data["seconds"] = round(time.monotonic() - t0, 1)
    _save(data, out_dir, json_path)
    return data


def _save(data: dict, out_dir: Path, json_path: Path | None) -> None:
    tmp = out_dir / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(out_dir / "gpu_check.json")
    if json_path is not None:  # one line: perf_report reads it (its gpu setup)
        json_path.write_text(json.dumps(data, default=str) + "\n")


# ============================================================================ the report
def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None or isinstance(x, str) else fmt.format(x)


def _size(n: int) -> str:
    from linerate.tools.dev.perf_report import _size as size
    return size(n)


def _res(data: dict, name: str) -> dict:
    step = data.get("steps", {}).get(name) or {}
    return step.get("result") or {}


def findings(data: dict) -> list[str]:
    """What the figures say about how busbw scales with connections and cores and what
    limits it, and whether the staging target was met: sentences computed from the figures."""
    out = []
    copy = (data.get("host", {}).get("machine") or {}).get("copy_gbs")
    cores = (data.get("host", {}).get("machine") or {}).get("cores")
    # staging target
    ratios = [(r["world"], r["bytes"], r["ratio"]) for name, step in data.get("steps", {}).items()
              if name.startswith("staging") for r in (step.get("result") or {}).get("summary", [])
              if r.get("ratio") is not None]
    if ratios:
        met = [x for x in ratios if x[2] >= TARGET]
        worst = min(ratios, key=lambda x: x[2])
        what = ("Pipelined CUDA busbw" if data.get("mode") != "cpu" else
                "Pipelined busbw on the stand-in copier (CPU tensors, --cpu: no GPU figure)")
        out.append(f"{what} over the CPU tensors' linerate busbw: target {TARGET}x "
                   f"met in {len(met)} of {len(ratios)} cases; lowest {worst[2]:.2f}x "
                   f"({_size(worst[1])}, {worst[0]} ranks).")
    # connections
    tcp = sorted((r for r in _res(data, "scale-2").get("rows", []) if r["transport"] == "tcp"),
                 key=lambda r: r["connections"])
    if len(tcp) >= 2 and all(r.get("linerate_busbw") for r in tcp):
        first, best = tcp[0], max(tcp, key=lambda r: r["linerate_busbw"])
        knee = next(r for r in tcp if r["linerate_busbw"] >= 0.9 * best["linerate_busbw"])
        per_core = [r["linerate_busbw"] / r["linerate_cores"] for r in tcp if r.get("linerate_cores")]
        text = (f"Loopback TCP, 2 ranks: {first['linerate_busbw']:.2f} GB/s with "
                f"{first['connections']} connection per peer, best {best['linerate_busbw']:.2f} "
                f"GB/s with {best['connections']} ({best['linerate_busbw'] / first['linerate_busbw']:.2f}x); "
                f"90% of the best reached with {knee['connections']} per peer. Cores busy: "
                + ", ".join(f"{r['linerate_cores']:.1f}" for r in tcp) + " at "
                + ", ".join(str(r["connections"]) for r in tcp) + " connections")
        if per_core and max(per_core) <= 1.25 * min(per_core):
            text += (f"; the bytes per busy core stay within 25% ({min(per_core):.2f} to "
                     f"{max(per_core):.2f} GB/s): busbw follows the cores the connections keep "
                     f"busy, so the CPU cost of the kernel's TCP copies is the limit.")
        elif per_core:
            text += (f"; the bytes per busy core fall from {per_core[0]:.2f} to "
                     f"{per_core[-1]:.2f} GB/s as connections grow: past the knee more "
                     f"connections cost CPU without adding bandwidth.")
        out.append(text)
    # cores (ranks)
    shm = sorted((r for name, step in data.get("steps", {}).items() if name.startswith("scale-")
                  for r in (step.get("result") or {}).get("rows", []) if r["transport"] == "shm"
                  and r.get("linerate_busbw")), key=lambda r: r["world"])
    if shm:
        parts = [f"{r['world']} ranks {r['linerate_busbw']:.2f} GB/s"
                 + (f" ({r['linerate_cores']:.1f} cores busy)" if r.get("linerate_cores") else "")
                 for r in shm]
        text = f"Shared memory, {_size(shm[0]['bytes'])}: " + "; ".join(parts)
        if copy:
            best = max(shm, key=lambda r: r["linerate_busbw"])
            text += (f". The best is {100 * best['linerate_busbw'] / copy:.0f}% of one core's "
                     f"memory copy bandwidth ({copy:.1f} GB/s)")
        if len(shm) >= 2 and cores:
            last = shm[-1]
            ratio = last["linerate_busbw"] / shm[0]["linerate_busbw"]
            flat = ratio < 1.1
            how = ("stays within 10%" if 0.9 <= ratio < 1.1 else "falls" if ratio < 0.9
                   else "rises")
            text += (f"; from {shm[0]['world']} to {last['world']} ranks busbw {how} "
                     f"({ratio:.2f}x) while "
                     f"the ranks keep more of the {cores} cores busy: "
                     + ("more cores do not raise busbw, so a resource the ranks share (memory "
                        "bandwidth), not cores, is the limit." if flat else
                        "more ranks bring more cores to the copies."))
        out.append(text + ("" if text.endswith(".") else "."))
    return out


def render(data: dict) -> str:
    """The markdown of the check's section (below the machine line and the commands)."""
    h = data.get("host", {})
    lines = []
    mode = ("CPU tensors with the stand-in copier (--cpu)" if data.get("mode") == "cpu" else
            f"GPU: {h.get('gpu', '?')} (CUDA {h.get('torch_cuda')}, {h.get('gpus', '?')} "
            f"visible), torch {h.get('torch')}")
    rd = h.get("rdma") or {}
    lines.append(f"{mode}. RDMA: `/sys/class/infiniband` "
                 + (f"holds {', '.join(rd['infiniband'])}" if rd.get("infiniband") else "is empty or absent")
                 + f"; `rdma_rxe`: {rd.get('rdma_rxe', '?')}. Open MPI: {h.get('mpi', '?')}. "
                 f"torchvision: {h.get('torchvision', '?')}.")
    bad = [f"{n} ({s['status']}: {s.get('error', '')})" for n, s in data.get("steps", {}).items()
           if s.get("status") != "ok"]
    if bad:
        lines.append("")
        lines.append("Steps that did not complete or whose checks failed: " + "; ".join(bad) + ".")
    # correctness
    rows = [(n, _res(data, n)) for n in data.get("steps", {}) if n.startswith("correctness")]
    if any(r for _, r in rows):
        lines += ["", "| ranks | collectives checked | failed | pipelined all_reduces (chunks) | "
                      "long kernel before an async all_reduce |", "|---|---|---|---|---|"]
        for n, r in rows:
            lk = ", ".join(f"{k} {'ok' if v is True else ('read early' if v is False else v)}"
                           for k, v in (r.get("long_kernel") or {}).items())
            pipe = r.get("pipelined") or {}
            lines.append(f"| {n.split('-')[1]} | {r.get('checks', '–')} | "
                         f"{len(r.get('failed', []))} | {pipe.get('ops', 0)} ({pipe.get('chunks', 0)}) | "
                         f"{lk or '–'} |")
    # ddp
    d = _res(data, "ddp")
    if d.get("step_ms"):
        lr, gl = d["step_ms"].get("linerate"), d["step_ms"].get("gloo")
        floor = d.get("gloo_vs_gloo_diff") or 0.0
        eq = ("equal to Gloo's, bit for bit" if d.get("bitwise") else
              f"max diff {_f(d.get('max_abs_diff'), '{:.3g}')} from Gloo's, {floor:.3g} between two Gloo "
              f"runs ({'within' if d.get('equal') else 'beyond'} 10x)")
        lines += ["", "| model | ranks | steps | linerate step ms | Gloo step ms | Gloo / linerate "
                      "| parameters after the steps |", "|---|---|---|---|---|---|---|",
                  f"| {d.get('model')} | 2 | {d.get('steps')} | {_f(lr, '{:.1f}')} | "
                  f"{_f(gl, '{:.1f}')} | {_f(gl / lr if lr and gl else None)}x | {eq} |"]
        pp, alone = d["step_ms"].get("linerate pipelined"), d["step_ms"].get("linerate no communication")
        if pp or alone:
            how = " ".join(f"LINERATE_{k.upper()}={v >> 10}K"
                           for k, v in d.get("pipelined_options", DDP_PIPELINED).items())
            lines += ["", "Where a linerate DDP step goes: "
                      f"{_f(alone, '{:.1f}')} ms without communication (`no_sync`); "
                      f"{_f(pp, '{:.1f}')} ms with every bucket pipelined "
                      f"(`{how}`: DDP's first bucket, 1 MiB, otherwise takes one blocking copy "
                      "to the host)."]
    # staging
    srows = [r for n in data.get("steps", {}) if n.startswith("staging")
             for r in _res(data, n).get("summary", [])]
    if srows:
        dl = "CUDA" if data.get("mode") != "cpu" else "stand-in"
        lines += ["", "all_reduce busbw, GB/s (the slowest rank's mean per iteration):", "",
                  f"| ranks | size | {dl} pipelined | {dl} whole | {dl} Gloo | CPU linerate | "
                  f"CPU Gloo | pipelined / CPU linerate (target {TARGET}x) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in srows:
            b = r["busbw"]
            lines.append(f"| {r['world']} | {_size(r['bytes'])} | {_f(b.get('cuda pipelined'))} | "
                         f"{_f(b.get('cuda whole'))} | {_f(b.get('cuda gloo'))} | "
                         f"{_f(b.get('cpu linerate'))} | {_f(b.get('cpu gloo'))} | "
                         f"{_f(r.get('ratio'))}x |")
    # scaling
    sc = [(n, _res(data, n)) for n in data.get("steps", {}) if n.startswith("scale-")]
    if any(r.get("rows") for _, r in sc):
        nbytes = next(r["bytes"] for _, r in sc if r.get("bytes"))
        lines += ["", f"CPU tensors, all_reduce of {_size(nbytes)} "
                      "(median of the slowest rank's time per call):", "",
                  "| ranks | transport | connections per peer | linerate busbw GB/s | cores busy "
                  "| Gloo busbw GB/s | Gloo cores busy | Open MPI busbw GB/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for _, r in sc:
            mpi = r.get("mpi") if isinstance(r.get("mpi"), dict) else {}
            for row in r.get("rows", []):
                m_us = mpi.get("bytes") if row["transport"] == "shm" else None
                m_bw = (r["bytes"] / (m_us * 1e-6) / 1e9 * row["factor"]
                        if isinstance(m_us, (int, float)) and m_us else None)
                lines.append(f"| {row['world']} | {'shared memory' if row['transport'] == 'shm' else 'TCP (LINERATE_SHM=0)'} | "
                             f"{row.get('connections', '–') if row['transport'] == 'tcp' else '–'} | "
                             f"{_f(row.get('linerate_busbw'))} | {_f(row.get('linerate_cores'), '{:.1f}')} | "
                             f"{_f(row.get('gloo_busbw'))} | {_f(row.get('gloo_cores'), '{:.1f}')} | "
                             f"{_f(m_bw)} |")
        lat = [(r, r.get("latency")) for _, r in sc if r.get("latency")]
        if lat:
            lines += ["", "| ranks | 4 KB all_reduce, linerate µs (median, p90) | Gloo µs | "
                          "Open MPI µs |", "|---|---|---|---|"]
            for r, l in lat:
                mpi = r.get("mpi") if isinstance(r.get("mpi"), dict) else {}
                lines.append(f"| {r['world']} | {_f(l['linerate']['median_us'], '{:.1f}')}, "
                             f"{_f(l['linerate']['p90_us'], '{:.1f}')} | "
                             f"{_f(l['gloo']['median_us'], '{:.1f}')} | "
                             f"{_f(mpi.get('latency'), '{:.1f}')} |")
    found = findings(data)
    if found:
        lines += ["", *[f"- {x}" for x in found]]
    u = _res(data, "unit")
    if u:
        lines += ["", f"Unit tier with torch {u.get('torch')} (`{u.get('command')}`): "
                      f"{u.get('summary') or 'no summary'}."
                  + (" Failed: " + ", ".join(f"`{x}`" for x in u["failed"]) + "."
                     if u.get("failed") else "")
                  + (" Skips for what this host lacks: "
                     + "; ".join(x.split(": ", 1)[-1] for x in u["unexpected_skips"]) + "."
                     if u.get("unexpected_skips") else "")]
    return "\n".join(lines)


def summary(data: dict) -> list[str]:
    out = []
    for name, s in data.get("steps", {}).items():
        r = s.get("result") or {}
        what = ""
        if name == "host" and r:
            what = (f"{r.get('gpu', 'CPU only')}, torch {r.get('torch')}, "
                    f"{r.get('machine', {}).get('cores')} cores; RDMA: "
                    f"{', '.join(r.get('rdma', {}).get('infiniband', [])) or 'no device'}, "
                    f"rdma_rxe {r.get('rdma', {}).get('rdma_rxe')}")
        elif name.startswith("correctness") and r:
            what = f"{r.get('checks')} checks, {len(r.get('failed', []))} failed"
        elif name.startswith("staging") and r:
            what = "; ".join(f"{_size(x['bytes'])} pipelined/CPU {_f(x.get('ratio'))}x"
                             for x in r.get("summary", []))
        elif name == "ddp" and r.get("step_ms"):
            what = (f"{r.get('model')}: step {r['step_ms'].get('linerate', 0):.1f} ms vs Gloo "
                    f"{r['step_ms'].get('gloo', 0):.1f} ms, parameters "
                    f"{'equal' if r.get('equal') else 'DIFFER'}")
        elif name == "unit" and r:
            what = r.get("summary", "")
        elif name.startswith("scale") and r.get("rows"):
            what = "; ".join(f"{x['transport']}{'/' + str(x['connections']) if x['transport'] == 'tcp' else ''} "
                             f"{_f(x.get('linerate_busbw'))} GB/s" for x in r["rows"])
        err = f" [{s.get('error')}]" if s.get("error") else ""
        out.append(f"  {name:15} {s['status']:8} {s.get('seconds', 0):6.1f}s  {what}{err}")
    return out


# ============================================================================ rank workers
def _options(fields: dict):
    import linerate
    o = linerate.Options.from_env()
    for k, v in fields.items():
        if k.startswith("transport."):
            setattr(o.transport, k.split(".", 1)[1], v)
        else:
            setattr(o, k, v)
    return o


def _group(backend: str, options: dict | None = None):
    import torch.distributed as dist
    from datetime import timedelta
    return dist.new_group(backend=backend, timeout=timedelta(seconds=OP_TIMEOUT_S),
                          pg_options=_options(options or {}) if backend == "linerate" else None)


def _backend(group, device):
    """The linerate process group behind a torch.distributed group, for its own methods."""
    return group._get_backend(device)


class Device:
    """The steps' device: cuda:0 (every rank shares it), or the CPU with the stand-in copier."""

    def __init__(self, cpu: bool):
        import torch
        self.cpu = cpu
        if cpu:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)

    def sync(self) -> None:
        """Everything queued is done (torch.cuda.synchronize; the stand-in's wait() already
        blocks until the copies back ran)."""
        if not self.cpu:
            import torch
            torch.cuda.synchronize()


def _inputs(n: int, dtype, seed: int):
    """Small integers (exact in every dtype): a rank's deterministic input."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def _fold(xs, op):
    import torch
    import torch.distributed as dist
    R = dist.ReduceOp
    out = xs[0].clone()
    for x in xs[1:]:
        if op in (R.SUM, R.AVG):
            out = out + x
        elif op == R.PRODUCT:
            out = out * x
        elif op == R.MIN:
            out = torch.minimum(out, x)
        elif op == R.MAX:
            out = torch.maximum(out, x)
        elif op == R.BAND:
            out = out & x
        elif op == R.BOR:
            out = out | x
        elif op == R.BXOR:
            out = out ^ x
    return out / len(xs) if op == R.AVG else out


def _reduce_ops(dtype):
    import torch.distributed as dist
    R = dist.ReduceOp
    if dtype.is_floating_point:
        return (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)
    return (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)


def k_correctness(spec, dev: Device, rank: int, P: int, res: dict, save) -> None:
    import torch
    import torch.distributed as dist
    R = dist.ReduceOp
    d = dev.device
    res.update(checks=0, failed=[], long_kernel={})
    if not dev.cpu:
        res.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    g_def = _group("linerate", spec["group_options"])
    g_chunk = _group("linerate", dict(spec["group_options"], **spec["chunked_options"]))
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def check(what: str, fn) -> None:
        res["checks"] += 1
        try:
            ok = fn()
        except Exception as e:  # noqa: BLE001 - recorded by name
            res["failed"].append(f"{what}: {type(e).__name__}: {str(e)[:300]}")
            return
        if not ok:
            res["failed"].append(what)

    def same(t, want) -> bool:
        return torch.equal(t.cpu(), want.to(t.dtype))

    def on(x):
        return x.to(d, copy=True)   # the op's own tensor: never the reference input itself

    def every(g, dtype, n, case: int) -> None:
        xs = [_inputs(n, dtype, 1000 * case + q) for q in range(P)]
        mine = xs[rank]
        label = f"{str(dtype).replace('torch.', '')}[{n}]"
        for op in _reduce_ops(dtype):
            want = _fold(xs, op)

            def ar(async_op, op=op, want=want):
                t = on(mine)
                w = dist.all_reduce(t, op=op, group=g, async_op=async_op)
                if async_op:
                    w.wait()
                return same(t, want)
            check(f"all_reduce {label} {op}", lambda: ar(False))
            check(f"all_reduce async {label} {op}", lambda: ar(True))
        root = P - 1

        def bcast():
            t = on(mine)
            dist.broadcast(t, src=root, group=g)
            return same(t, xs[root])

        def red():
            t = on(mine)
            dist.reduce(t, dst=root, op=R.MAX, group=g)
            return rank != root or same(t, _fold(xs, R.MAX))

        def ag():
            outs = [torch.empty(n, dtype=dtype, device=d) for _ in range(P)]
            dist.all_gather(outs, on(mine), group=g)
            return all(same(outs[q], xs[q]) for q in range(P))

        def ag1():
            out = torch.empty(P * n, dtype=dtype, device=d)
            gather_single(out, on(mine), group=g)
            return same(out, torch.cat(xs))

        parts = [[_inputs(n, dtype, 1000 * case + 10 * q + i + 500) for i in range(P)]
                 for q in range(P)]

        def rs():
            out = torch.empty(n, dtype=dtype, device=d)
            dist.reduce_scatter(out, [on(p) for p in parts[rank]], op=R.SUM, group=g)
            return same(out, _fold([parts[q][rank] for q in range(P)], R.SUM))

        def rs1():
            out = torch.empty(n, dtype=dtype, device=d)
            scatter_single(out, on(torch.cat(parts[rank])), op=R.SUM, group=g)
            return same(out, _fold([parts[q][rank] for q in range(P)], R.SUM))

        def a2a():
            outs = [torch.empty(n, dtype=dtype, device=d) for _ in range(P)]
            dist.all_to_all(outs, [on(p) for p in parts[rank]], group=g)
            return all(same(outs[q], parts[q][rank]) for q in range(P))

        def a2a1():
            out = torch.empty(P * n, dtype=dtype, device=d)
            dist.all_to_all_single(out, on(torch.cat(parts[rank])), group=g)
            return same(out, torch.cat([parts[q][rank] for q in range(P)]))

        def gat():
            outs = [torch.empty(n, dtype=dtype, device=d) for _ in range(P)] if rank == 0 else None
            dist.gather(on(mine), outs, dst=0, group=g)
            return rank != 0 or all(same(outs[q], xs[q]) for q in range(P))

        def sca():
            out = torch.empty(n, dtype=dtype, device=d)
            dist.scatter(out, [on(x) for x in xs] if rank == 0 else None, src=0, group=g)
            return same(out, xs[rank])

        def p2p():
            out = torch.empty(n, dtype=dtype, device=d)
            reqs = [dist.isend(on(mine), (rank + 1) % P, group=g),
                    dist.irecv(out, (rank - 1) % P, group=g)]
            for q in reqs:
                q.wait()
            return same(out, xs[(rank - 1) % P])

        for what, fn in (("broadcast", bcast), ("reduce", red), ("all_gather", ag),
                         ("all_gather_into_tensor", ag1), ("reduce_scatter", rs),
                         ("reduce_scatter_tensor", rs1), ("all_to_all", a2a),
                         ("all_to_all_single", a2a1), ("gather", gat), ("scatter", sca),
                         ("send/recv", p2p)):
            check(f"{what} {label}", fn)
        check(f"barrier after {label}", lambda: dist.barrier(group=g) or True)

    case = 0
    for name in DTYPES:
        dtype = getattr(torch, name)
        for n in spec["counts"]:
            case += 1
            every(g_chunk, dtype, n, case)
        save()
        # one all_reduce of the default settings' pipelined size
        n = spec["big_bytes"] // dtype.itemsize + 3
        xs = [_inputs(n, dtype, 77 + q) for q in range(P)]
        for op in (R.SUM, R.MAX):
            def big(op=op, xs=xs):
                t = on(xs[rank])
                dist.all_reduce(t, op=op, group=g_def, async_op=True).wait()
                return same(t, _fold(xs, op))
            check(f"all_reduce {name}[{n}] {op} (default settings)", big)
    stats = {}
    for g in (g_def, g_chunk):
        for k, v in _backend(g, d).staging_stats.items():
            stats["ops"] = stats.get("ops", 0) + v["ops"]
            stats["chunks"] = stats.get("chunks", 0) + v["chunks"]
    res["pipelined"] = stats
    save()
    # An input written by a long kernel just before all_reduce(async_op=True).
    want = P * (P + 1) / 2
    n_big = spec["big_bytes"] // 4 + 3
    cases = [("pipelined", n_big, False), ("whole", 1000, False)]
    if not dev.cpu:
        cases += [("pipelined, side stream", n_big, True), ("whole, side stream", 1000, True)]
    for label, n, side in cases:
        def long_kernel(n=n, side=side):
            t = torch.zeros(n, device=d)
            if dev.cpu:
                if n * 4 < _options(spec["group_options"]).stage_min_bytes:
                    return "n/a on CPU tensors"   # staged whole: CPU tensors have no stream
                copier = _backend(g_def, d)._stagers[d].copier
                copier.launch(lambda: (time.sleep(0.2), t.fill_(rank + 1)))
                work = dist.all_reduce(t, group=g_def, async_op=True)
                work.wait()
                return bool(torch.equal(t, torch.full((n,), want)))
            s = torch.cuda.Stream() if side else torch.cuda.current_stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(300_000_000)   # one kernel of ~0.2 s
                t.fill_(rank + 1)
                work = dist.all_reduce(t, group=g_def, async_op=True)
                work.wait()
                return bool(torch.equal(t.cpu(), torch.full((n,), want)))
        try:
            res["long_kernel"][label] = long_kernel()
        except Exception as e:  # noqa: BLE001 - recorded
            res["long_kernel"][label] = f"{type(e).__name__}: {str(e)[:200]}"
        res["checks"] += 1
        if res["long_kernel"][label] is not True and not str(res["long_kernel"][label]).startswith("n/a"):
            res["failed"].append(f"long kernel before async all_reduce ({label}): "
                                 f"{res['long_kernel'][label]}")
    # every rank's failures, not rank 0's only
    res["failed"] = _gather_failures(res["failed"], rank, P)


def _gather_failures(mine: list, rank: int, P: int) -> list:
    import torch.distributed as dist
    every = [None] * P
    dist.all_gather_object(every, mine)
    out = []
    for q, fails in enumerate(every):
        out += [f"rank {q}: {f}" for f in fails]
    return out


class StandInNet:
    """A small CNN for the DDP step where torchvision is missing (--cpu on a host without it):
    3x32x32 images, 10 classes."""

    @staticmethod
    def make():
        import torch.nn as nn
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def k_ddp(spec, dev: Device, rank: int, P: int, res: dict, save) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    d = dev.device
    try:
        import torchvision

        def make():
            return torchvision.models.resnet18(num_classes=10)
        res["model"] = "ResNet-18 (torchvision)"
    except Exception as e:  # noqa: BLE001 - absent, or not a build for this torch
        make = StandInNet.make
        res["model"] = f"stand-in CNN (torchvision unavailable: {type(e).__name__})"
    if not dev.cpu:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    batch = tuple(spec["batch"])
    res["steps"] = spec["steps"]
    res["step_ms"] = {}
    params = {}

    def train(name: str, extra: dict | None = None, alone: bool = False) -> None:
        """20 steps of DDP over a group of ``name``'s backend (its first word), the check's
        options with ``extra``; ``alone``: every step under no_sync (no communication: the
        step's floor)."""
        g = _group(name.split()[0], {**spec["group_options"], **spec["ddp_options"],
                                     **(extra or {})})
        torch.manual_seed(0)
        model = make().to(d)
        ddp = DDP(model, device_ids=[d.index] if d.type == "cuda" else None, process_group=g)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 + rank)
        times = []
        for _ in range(spec["steps"]):
            x = torch.randn(batch, generator=gen).to(d)
            y = torch.randint(0, 10, (batch[0],), generator=gen).to(d)
            dev.sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with ddp.no_sync() if alone else contextlib.nullcontext():
                F.cross_entropy(ddp(x), y).backward()
            opt.step()
            dev.sync()
            times.append(time.perf_counter() - t0)
        params[name] = torch.cat([p.detach().double().cpu().reshape(-1) for p in model.parameters()])
        worst = torch.tensor([statistics.median(times[2:]) * 1e3], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        res["step_ms"][name] = worst.item()
        if name == "linerate":
            res["staging"] = _backend(g, d).staging_stats
        save()

    def every_rank(flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    train("linerate")
    train("gloo")
    # Where a linerate step's time goes: with every bucket pipelined (DDP_PIPELINED), and the
    # step without communication
    train("linerate pipelined", DDP_PIPELINED)
    res["pipelined_options"] = DDP_PIPELINED
    train("linerate no communication", alone=True)
    res["max_abs_diff"] = (params["linerate"] - params["gloo"]).abs().max().item()
    res["bitwise"] = every_rank(torch.equal(params["linerate"], params["gloo"]))
    if res["bitwise"]:
        res["equal"] = True
    else:
        # Gloo against Gloo: what the device's own nondeterminism (atomics in some kernels'
        # backward) leaves between two runs of the same seed and the same reduction
        train("gloo again")
        res["gloo_vs_gloo_diff"] = (params["gloo again"] - params["gloo"]).abs().max().item()
        res["equal"] = every_rank(res["max_abs_diff"] <= 10 * res["gloo_vs_gloo_diff"])
    # every rank's replica the same (DDP's promise)
    total = params["linerate"].sum().item()
    lo = torch.tensor([total], dtype=torch.float64)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    res["replicas_agree"] = bool(lo.item() == hi.item())


def _time_calls(fn, warmup: int, iters: int, sync, per_call: bool) -> tuple[float, float]:
    """(seconds per call, cores busy) of ``fn``: the slowest rank's mean over back-to-back
    calls, or (``per_call``) the median of the slowest rank's time of calls each timed alone
    after a barrier (as latency_bench times them); cores busy: every rank's CPU time together
    over the wall time of the calls."""
    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
        sync()
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    if per_call:
        laps = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            laps.append(time.perf_counter() - t0)
        worst = torch.tensor(laps, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        seconds = statistics.median(worst.tolist())
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        seconds = time.perf_counter() - t0
        w = torch.tensor([seconds / iters], dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        seconds = w.item()
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    wall = time.perf_counter() - w0
    dist.all_reduce(cpu)
    return seconds, cpu.item() / wall


def k_speed(spec, dev: Device, rank: int, P: int, res: dict, save) -> None:
    import torch
    import torch.distributed as dist

    from linerate.collectives.stats import bus_factor
    piped = _group("linerate", spec["group_options"])
    whole = _group("linerate", dict(spec["group_options"], staging="whole"))
    gloo = _group("gloo")
    factor = bus_factor("all_reduce", P)
    res["rows"], res["summary"] = [], []
    for nbytes in spec["sizes"]:
        warmup, iters = spec["iters"][str(nbytes)]
        busbw = {}
        variants = [("cuda pipelined", dev.device, piped), ("cuda whole", dev.device, whole),
                    ("cuda gloo", dev.device, gloo), ("cpu linerate", torch.device("cpu"), whole),
                    ("cpu gloo", torch.device("cpu"), gloo)]
        for label, where, g in variants:
            t = torch.zeros(nbytes // 4, device=where)
            try:
                secs, cores = _time_calls(lambda: dist.all_reduce(t, group=g), warmup, iters,
                                          dev.sync if where.type == "cuda" else (lambda: None),
                                          per_call=False)
                busbw[label] = nbytes / secs / 1e9 * factor
                res["rows"].append({"world": P, "bytes": nbytes, "variant": label,
                                    "seconds": secs, "busbw": busbw[label], "cores": cores})
            except Exception as e:  # noqa: BLE001 - recorded, the other variants run
                res["rows"].append({"world": P, "bytes": nbytes, "variant": label,
                                    "error": f"{type(e).__name__}: {str(e)[:300]}"})
            del t
            save()
        pipe, cpu_lr = busbw.get("cuda pipelined"), busbw.get("cpu linerate")
        res["summary"].append({"world": P, "bytes": nbytes, "busbw": busbw,
                               "ratio": pipe / cpu_lr if pipe and cpu_lr else None})
        save()
    res["staging"] = _backend(piped, dev.device).staging_stats


def k_scale(spec, dev: Device, rank: int, P: int, res: dict, save) -> None:
    import torch
    import torch.distributed as dist

    from linerate.collectives.stats import bus_factor
    from linerate.tools.dev import latency_bench
    nbytes = spec["bytes"]
    warmup, iters = spec["iters"]
    factor = bus_factor("all_reduce", P)
    res.update(world=P, bytes=nbytes, rows=[])
    t = torch.zeros(nbytes // 4)

    def measure(g):
        secs, cores = _time_calls(lambda: dist.all_reduce(t, group=g), warmup, iters,
                                  lambda: None, per_call=True)
        return nbytes / secs / 1e9 * factor, cores

    gloo = _group("gloo")
    g_bw, g_cores = measure(gloo)
    configs = [("shm", None, {})]
    configs += [("tcp", k, {"transport.shm": "0", "transport.nsocks": k}) for k in spec["nsocks"]]
    for transport, conns, fields in configs:
        row = {"world": P, "bytes": nbytes, "transport": transport, "connections": conns,
               "factor": factor,
               "gloo_busbw": g_bw, "gloo_cores": g_cores}
        try:
            g = _group("linerate", dict(spec["group_options"], **fields))
            row["linerate_busbw"], row["linerate_cores"] = measure(g)
            dist.destroy_process_group(g)
        except Exception as e:  # noqa: BLE001 - recorded, the next configuration runs
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["rows"].append(row)
        save()
    if spec["latency"]:
        lat = {}
        for backend in ("linerate", "gloo"):
            s = latency_bench._slowest(latency_bench._samples_torch(
                backend, "all_reduce", 4096, spec["lat_iters"], 50))
            lat[backend] = {"median_us": statistics.median(s) * 1e6,
                            "p90_us": sorted(s)[int(0.9 * (len(s) - 1))] * 1e6}
        res["latency"] = lat
        save()


KINDS = {"correctness": k_correctness, "ddp": k_ddp, "speed": k_speed, "scale": k_scale}


def worker(spec_path: str) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    import linerate  # noqa: F401 - registers the backend (no entry point where not installed)
    from linerate.collectives import pipeline
    with open(spec_path) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=OP_TIMEOUT_S))
    if spec["cpu"] and spec["kind"] != "scale":
        pipeline.install_standin()  # CPU tensors take the pipelined path, on the stand-in
    dev = Device(spec["cpu"] or spec["kind"] == "scale")
    res: dict = {"world": world}

    def save() -> None:
        if rank == 0:
            tmp = spec["out"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f, default=str)
            os.replace(tmp, spec["out"])

    try:
        KINDS[spec["kind"]](spec, dev, rank, world, res, save)
        code = 0
    except Exception as e:  # noqa: BLE001 - what was measured so far is kept
        traceback.print_exc()
        res["error"] = f"rank {rank}: {type(e).__name__}: {str(e)[:500]}"
        code = 1
    save()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group at exit
        pass
    return code


# ============================================================================ command line
def write_docs(data: dict, page: Path) -> str:
    """The check's section (perf_report's ``gpu`` setup, rendered by its code) into ``page``;
    returns the section's text."""
    from linerate.tools.dev import perf_report as pr
    setup = next(s for s in pr.SETUPS if s.key == "gpu")
    text = pr.render_section(setup, data["host"]["machine"], [{"jsonl": [data]}],
                             pr.commands(setup))
    if page is not None:
        pr.write_section(page, setup, text)
    return text


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for gpu_check.json, gpu_check.log and "
                                 "performance-gpu.md")
    p.add_argument("--json", help="also write the results to this file, on one line (what "
                                  "perf_report's gpu setup reads)")
    p.add_argument("--cpu", action="store_true",
                   help="the same steps on CPU tensors, small sizes, few ranks (no GPU needed)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole check (default {BUDGET_S:g}; 90 with --cpu)")
    p.add_argument("--only", default="", help="comma-separated steps or kinds (host always runs)")
    p.add_argument("--docs", default=None, metavar="PAGE",
                   help="replace the check's section of this page (docs/performance.md)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="write the section from a gpu_check.json of an earlier run, run nothing")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        print(write_docs(data, Path(args.docs) if args.docs else None))
        return 0
    if not args.out and not args.json:
        p.error("--out DIR (or --json FILE) is needed")
    out_dir = Path(args.out) if args.out else Path(args.json).resolve().parent
    # The ranks, pytest and mpirun import linerate from where this process did.
    root = str(_root())
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + [x for x in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if x and x != root])
    plan = CPU_PLAN if args.cpu else GPU_PLAN
    budget = args.budget if args.budget is not None else (90.0 if args.cpu else BUDGET_S)
    only = ["host"] + [x for x in args.only.split(",") if x] if args.only else None
    data = run_check(plan, out_dir, budget, Path(args.json).resolve() if args.json else None, only)
    text = ""
    if data.get("host", {}).get("machine"):
        text = write_docs(data, Path(args.docs) if args.docs else None)
        (out_dir / "performance-gpu.md").write_text(text)
    print(f"gpu_check ({data['mode']}): {data['seconds']:.0f} s of {budget:.0f}; results in "
          f"{out_dir / 'gpu_check.json'}, log {out_dir / 'gpu_check.log'}")
    print("\n".join(summary(data)))
    for line in findings(data):
        print(f"  - {line}")
    if args.docs and text:
        print(f"gpu_check: section written to {args.docs}")
    ok = all(s["status"] == "ok" for s in data["steps"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
