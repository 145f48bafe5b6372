"""Run N ranks of a module on this host, the way torchrun would, and reap every one of them.

Each rank is ``python -m <module> <argv>`` with the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so a tool's torchrun code path is the
only one it needs.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import linerate

#: Seconds the other ranks get to exit on their own after one rank failed.
FAIL_GRACE_S = 3.0
#: Seconds between SIGTERM and SIGKILL when stopping ranks.
KILL_GRACE_S = 5.0
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130

# The folder that holds the ``linerate`` package: a source tree (not installed) runs as well.
_SOURCE_ROOT = str(Path(linerate.__file__).resolve().parent.parent)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_ifname() -> str | None:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0")
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: ranks share the cores
    lo = loopback_ifname()
    if lo:
        env.setdefault("GLOO_SOCKET_IFNAME", lo)  # keep Gloo on loopback, like linerate
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _SOURCE_ROOT + (os.pathsep + path if path else "")
    return env


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


def launch_local(module: str, argv: list[str], nproc: int, timeout: float) -> int:
    """Run ``nproc`` ranks; return 0 if all succeed, else a nonzero code with a message on stderr."""
    port = free_port()

    def start(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", module, *argv],
                                env=rank_env(rank, nproc, port), start_new_session=True)

    return supervise(start, nproc, timeout, "linerate")


def supervise(start, nproc: int, timeout: float | None, label: str, cleanup=None) -> int:
    """Start ranks with ``start(rank) -> Popen`` (each in a session of its own) and watch them.

    Returns 0 when all succeed; else the first failing rank's exit code (after the others had
    FAIL_GRACE_S to report), EXIT_TIMEOUT, EXIT_INTERRUPTED or 128+signal. Whatever happens,
    every rank's session is terminated, then killed, and reaped before this returns;
    ``cleanup()`` runs after that (e.g. joining output pumps)."""
    procs: list[subprocess.Popen] = []
    # The ranks run in sessions of their own (a Ctrl-C reaches only us), so whatever stops this
    # process must stop them too.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for rank in range(nproc):
            procs.append(start(rank))
        return _wait(procs, timeout, label)
    except KeyboardInterrupt:
        print(f"{label}: interrupted, stopping all ranks", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Stopped as e:
        print(f"{label}: got {e}, stopping all ranks", file=sys.stderr)
        return 128 + e.signum
    finally:
        _reap(procs)
        if cleanup is not None:
            cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(procs: list[subprocess.Popen], timeout: float | None, label: str) -> int:
    deadline = None if not timeout else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return 0
        first = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
        if first:
            _grace(procs, FAIL_GRACE_S)  # let the other ranks report their own errors
            rank, code = first
            others = [r for r, p in enumerate(procs) if r != rank and p.poll() not in (None, 0)]
            also = (f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
                    "failed too)") if others else ""
            print(f"{label}: rank {rank} {_describe(code)}{also}; stopping all ranks",
                  file=sys.stderr)
            return code if code > 0 else 1
        if deadline is not None and time.monotonic() > deadline:
            print(f"{label}: timed out after {timeout:g} s; killing all ranks", file=sys.stderr)
            return EXIT_TIMEOUT
        time.sleep(0.05)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _grace(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the rank's own session: reaches what it started too
    except (ProcessLookupError, PermissionError):
        pass


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    _grace(procs, KILL_GRACE_S)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
        p.wait()


#: Variables that torchrun sets: with them (and no --nproc) a tool's process is one rank.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def dispatch(prog: str, module: str, args, rank_argv, run_worker, default_nproc: int,
             timeout: float, on_lab=None) -> int:
    """Where a benchmark's ranks run: the ranks of ``args.netlab`` (``on_lab(lab)`` first,
    e.g. to probe the links; the lab's ranks per host, or ``args.ranks_per_host`` where the
    tool has that option), this process as a rank under torchrun, or ``args.nproc`` local
    ranks. ``rank_argv()`` gives the ranks' arguments (called after ``on_lab``)."""
    if getattr(args, "netlab", None) is not None:
        from linerate.tools import netlab
        reason = netlab.check_prereqs()
        if reason:
            print(f"{prog}: --netlab: {reason}", file=sys.stderr)
            return 2
        lab = netlab.load(args.netlab)
        if on_lab is not None:
            on_lab(lab)
        return netlab.run_ranks(lab, args.nproc or None, ["-m", module] + rank_argv(),
                                timeout=timeout, prefix_output=False,
                                ranks_per_host=getattr(args, "ranks_per_host", None))
    if args.nproc is None and all(k in os.environ for k in TORCHRUN_ENV):
        return run_worker(args)
    return launch_local(module, rank_argv(), args.nproc or default_nproc, timeout)
