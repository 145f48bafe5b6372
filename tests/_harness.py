"""Run a function on N spawned ranks with a hard timeout (for the torch.distributed backend tests).

    results = run_ranks(fn, world_size, *args, timeout=60, env=None)

starts ``world_size`` processes (forked from a server that imported torch once, each with
the test's environment and directory as a spawned process would have them). Each rank sets
MASTER_ADDR=127.0.0.1 and MASTER_PORT (the port of a TCPStore this process hosts, so no port
can be taken by someone else between choosing and binding it), calls
``dist.init_process_group(backend, rank=.., world_size=..)`` (``backend`` defaults to "gloo"),
creates ``lr = dist.new_group(backend="linerate")`` (or uses the default group when
``backend == "linerate"``), runs ``fn(rank, world_size, lr, *args)`` and destroys the
groups. ``fn`` must be a module-level function (it is pickled by reference).

``run_ranks`` returns the list of the ranks' return values (pickled with the standard pickler;
return tensors or plain data). An exception in a rank is re-raised here as ``RankError`` naming
the rank and carrying its traceback text. If ``timeout`` seconds pass first, every rank is sent
SIGUSR1 (which makes it dump all its threads' stacks), then killed, and ``RankTimeout`` names
the ranks that were still running, with their stacks. No process is ever left behind.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["run_ranks", "RankError", "RankTimeout", "free_port", "free_port_range",
           "netlab_reason", "REPO", "FAKE_PYVERBS", "CURRENT_TRANSPORT", "real_rdma_reason",
           "use_transport"]

_ERROR_GRACE = 5.0   # after one rank failed, how long the others may still report
_STACK_CHARS = 12000  # per rank, in a timeout message
# Threads that idle in these functions are left out of a timeout's stack dump.
_IDLE_MARKERS = (" in _send_loop", " in _recv_loop", "concurrent/futures/thread.py")


class RankError(AssertionError):
    """A rank raised (its traceback text is in the message)."""


class RankTimeout(AssertionError):
    """The ranks did not finish in time."""


# ----------------------------------------------------------------------------- child side
def _rank_main(fn, rank, world_size, port, env, backend, timeout, stack_file, conn, args):
    # What the fork server imported (torch) lives as long as the rank: out of the garbage
    # collector's view, a full collection neither walks it nor writes to its pages (each a
    # copy-on-write fault after the fork).
    gc.freeze()
    try:
        with open(stack_file, "w") as f_stack:
            faulthandler.register(signal.SIGUSR1, file=f_stack, all_threads=True)
            # Forked from the fork server: take the test's environment and directory as they
            # are now (as a spawned process would), not as they were when the server started.
            parent_env, cwd = env
            os.environ.clear()
            os.environ.update(parent_env)
            os.chdir(cwd)
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port)
            os.environ["RANK"] = str(rank)
            os.environ["WORLD_SIZE"] = str(world_size)
            import torch.distributed as dist

            import linerate  # noqa: F401 - registers the backend

            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=timeout))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
            if backend == "linerate":
                lr = dist.group.WORLD
            else:
                lr = dist.new_group(backend="linerate")
            result = fn(rank, world_size, lr, *args)
            if dist.is_initialized():  # a test may have destroyed every group itself
                dist.destroy_process_group()
            payload = pickle.dumps(result)
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        try:
            conn.send(("err", traceback.format_exc()))
        finally:
            conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed rank may have stuck threads: do not wait for them
    conn.send(("ok", payload))
    conn.close()


# ----------------------------------------------------------------------------- parent side
_CTX = None


def _context():
    """Ranks fork from a server that imported torch once ('forkserver', torch preloaded): a
    spawned rank would spend seconds of CPU importing torch, a large share of the suite's time
    on few cores. The server imports nothing else (linerate reads its settings when a
    rank imports it, after the rank's environment is set) and starts no thread before it
    forks."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        _CTX = ctx
    return _CTX


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():  # pragma: no cover - SIGKILL did not work: say so loudly
            raise RuntimeError(f"rank process {p.pid} survived SIGKILL")


def _read_stack(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "(no stack)"
    if not text.strip():
        return "(no stack dumped)"
    blocks, cur = [], []
    for line in text.splitlines():
        if (line.startswith("Thread 0x") or line.startswith("Current thread")) and cur:
            blocks.append(cur)
            cur = []
        cur.append(line)
    if cur:
        blocks.append(cur)
    keep = [b for b in blocks if not any(m in line for line in b for m in _IDLE_MARKERS)]
    out = "\n".join("\n".join(b) for b in keep)
    if len(keep) < len(blocks):
        out += f"\n({len(blocks) - len(keep)} idle transport/pool threads not shown)"
    return out[-_STACK_CHARS:]


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, env: dict | None = None,
              backend: str = "gloo", error_grace: float = _ERROR_GRACE):
    """Run ``fn(rank, world_size, lr, *args)`` on ``world_size`` spawned ranks; return the list
    of their return values (see the module docstring). ``env``: variables set in every rank
    before any group is created. ``backend``: the default group's backend ("linerate" makes
    ``lr`` the default group). ``error_grace``: after a rank failed, seconds the others may
    still take to report before they are killed."""
    import torch.distributed as dist

    ctx = _context()
    env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    # The store lives here: its port is bound before any rank starts.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    port = store.port
    tmpdir = tempfile.TemporaryDirectory(prefix="linerate-ranks-")
    procs, conns = [], []
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            stack_file = os.path.join(tmpdir.name, f"stack-{rank}.txt")
            p = ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, port, (env, os.getcwd()), backend,
                                  timeout, stack_file, child_end, args))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)

        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        timed_out = False
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            waitables = {}
            for r in pending:
                waitables[conns[r]] = r
                waitables[procs[r].sentinel] = r
            ready = mp.connection.wait(list(waitables), timeout=left)
            for obj in ready:
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = conns[r]
                msg = None
                try:
                    if obj is conn or conn.poll():
                        msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:
                    procs[r].join(timeout=1)
                    errors[r] = (f"rank {r} exited (exit code {procs[r].exitcode}) without "
                                 f"reporting a result")
                elif msg[0] == "ok":
                    results[r] = pickle.loads(msg[1])
                else:
                    errors[r] = msg[1]
                pending.discard(r)
                if errors:  # the others may be stuck in a collective: give them a moment
                    deadline = min(deadline, time.monotonic() + error_grace)

        if pending:
            for r in pending:
                if procs[r].is_alive():
                    with contextlib.suppress(Exception):
                        os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
        _kill_all(procs)

        if errors:
            first = next(iter(errors))  # the first to report (dicts keep insertion order)
            parts = [f"rank {r} failed:\n{errors[r]}" for r in [first] + sorted(set(errors) - {first})]
            if pending:
                parts.append(f"ranks still running when they were killed: {sorted(pending)}")
            raise RankError(f"rank {first} of {world_size} failed first ({len(errors)} failed)\n" + "\n".join(parts))
        if timed_out:
            stacks = "\n".join(f"--- rank {r} stacks:\n{_read_stack(os.path.join(tmpdir.name, f'stack-{r}.txt'))}"
                               for r in sorted(pending))
            raise RankTimeout(f"timeout after {timeout}s: ranks still running: {sorted(pending)} "
                              f"(of {world_size}); finished: {sorted(results)}\n{stacks}")
        return [results[r] for r in range(world_size)]
    finally:
        _kill_all(procs)
        for c in conns:
            with contextlib.suppress(Exception):
                c.close()
        del store
        tmpdir.cleanup()


def garbage_left(fn, rounds: int) -> dict:
    """Run ``fn()`` ``rounds`` times with the garbage collector off, after a collection; return
    {"garbage": objects only the collector would have freed, "kinds": their count by type,
    "rounds": rounds} (``gc.DEBUG_SAVEALL``: the collector keeps what it found)."""
    import collections
    import gc

    gc.disable()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(rounds):
            fn()
        gc.collect()
        kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return {"garbage": sum(kinds.values()), "kinds": dict(kinds), "rounds": rounds}


def free_port_range(n: int) -> int:
    """A base port such that base .. base+n-1 are free now, below the kernel's ephemeral range
    (ip_local_port_range), so that the sockets the ranks open later (the transport's listeners
    and connections take ephemeral ports) cannot take them first."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(low, 2048) - n
    for _ in range(100):
        base = random.randint(1024, top) if top > 1024 else random.randint(20000, 30000)
        with contextlib.ExitStack() as stack:
            try:
                for p in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range (free_port_range):
    a rank binds it a second or more later, and a port of the kernel's choice is an ephemeral
    one that any connection made meanwhile on this host (another test's) may take first."""
    return free_port_range(1)


# ----------------------------------------------------------------------------- netlab
_netlab: dict = {}


def netlab_reason() -> str | None:
    """Why netlab cannot run here (None if it can); asked once per test session. The
    ``netlab`` marker (tests/conftest.py) skips a test with this reason."""
    if "reason" not in _netlab:
        if not sys.platform.startswith("linux"):
            _netlab["reason"] = "needs Linux"
        else:
            from linerate.tools import netlab
            _netlab["reason"] = netlab.check_prereqs()
    return _netlab["reason"]


def run_netlab_script(lab_name: str, tmp_path, text: str, up: list | None, tag: str,
                      env: dict | None = None, timeout: int = 120):
    """``netlab up --name lab_name *up`` (``up`` None: the lab is up already), then ``netlab
    run`` of the script ``text`` with ``env`` added to this process's environment
    (``timeout``: netlab's, plus 20 s for the command). Returns the run's CompletedProcess and
    {rank: the JSON the rank printed after ``tag``} (lines ``[rank R] TAG R {...}``)."""
    import json
    import subprocess
    script = tmp_path / f"{tag.lower()}_ranks.py"
    script.write_text(text)
    cli = [sys.executable, "-m", "linerate.tools.cli", "netlab"]
    if up is not None:
        made = subprocess.run(cli + ["up", "--name", lab_name, *up], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
    res = subprocess.run(cli + ["run", "--name", lab_name, "--timeout", str(timeout), str(script)],
                         cwd=REPO, capture_output=True, text=True, timeout=timeout + 20,
                         env=dict(os.environ, **(env or {})))
    out = {}
    for line in res.stdout.splitlines():
        words = line.split(None, 4)
        if len(words) == 5 and words[2] == tag:
            out[int(words[3])] = json.loads(words[4])
    return res, out


# ----------------------------------------------------------------------------- transports
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_PYVERBS = os.path.join(REPO, "tests", "fake_pyverbs")
#: The transport the transport tests' helpers build meshes with (the ``transport`` fixture of
#: tests/conftest.py sets it, through ``use_transport``).
CURRENT_TRANSPORT = {"transport": "tcp"}
_real_rdma: dict = {}


def real_rdma_reason() -> str:
    """Why this machine cannot run the RDMA transport ("" if it can): asked in a fresh
    interpreter, so that the real pyverbs never mixes with the fake in this process."""
    import json
    import subprocess
    if "reason" not in _real_rdma:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LINERATE_", "FAKE_PYVERBS"))}
        code = ("import json; from linerate.transport import rdma, TransportOptions; "
                "print(json.dumps(rdma.local_status(TransportOptions(transport='rdma'))))")
        try:
            out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=60)
            ok, why, _ = json.loads(out.stdout.strip().splitlines()[-1])
            _real_rdma["reason"] = "" if ok else why
        except (subprocess.SubprocessError, ValueError, IndexError) as e:
            _real_rdma["reason"] = f"could not ask ({e})"
    return _real_rdma["reason"]


def use_transport(name: str, monkeypatch) -> None:
    """Make the transport tests' helpers build meshes over ``name`` (tcp, rdma-fake, rdma)
    until ``monkeypatch`` undoes it."""
    import pytest

    from linerate.transport import verbs
    if name == "rdma":
        reason = real_rdma_reason()
        if reason:
            pytest.skip(f"no RDMA device: {reason}")
        monkeypatch.delenv("LINERATE_PYVERBS_PATH", raising=False)
    elif name == "rdma-fake":
        monkeypatch.setenv("LINERATE_PYVERBS_PATH", FAKE_PYVERBS)
    if name != "tcp":
        verbs.reset()
        monkeypatch.setitem(CURRENT_TRANSPORT, "transport", "rdma")


def _script_main(path: str | None, code: str | None, argv: list, env: dict, cwd: str,
                 out_path: str) -> None:
    """A process of ForkedScript, forked from the fork server: ``python path argv...`` (or
    ``python -c code argv...``) as the interpreter would run it, with the given environment
    and directory, its stdout and stderr in ``out_path``, and the interpreter's exit
    (non-daemon threads joined, then the atexit handlers; the exit status of SystemExit, 1
    after an uncaught exception's traceback)."""
    import atexit
    import runpy
    import threading
    import types
    gc.freeze()  # (as _rank_main: what the server imported is not walked)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # PYTHONPATH's folders first, as an interpreter started with this environment has them
    for d in reversed([d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d]):
        sys.path.insert(0, os.path.abspath(d))
    status = 0
    try:
        if code is None:
            sys.argv = [path, *argv]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
        else:
            sys.argv = ["-c", *argv]
            sys.path.insert(0, "")
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, exit status 1
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(status)


class ForkedScript:
    """A Python script run as its own process, forked from the fork server that imported
    torch once (as run_ranks' ranks are) rather than started as a new interpreter, whose
    start-up (mostly importing torch) costs seconds of CPU on a 2-core machine; otherwise as
    ``subprocess.Popen([sys.executable, path, *argv])`` (or ``-c code``) with ``env``,
    ``cwd`` and stdout and stderr appended to the file ``out``, and the same handle: ``pid``,
    ``poll()``, ``wait(timeout)``, ``returncode`` (negative: killed by that signal), ``kill()``.
    What it cannot stand in for: a test of an interpreter's own start or finalization."""

    def __init__(self, *, path=None, code: str | None = None, argv=(), env: dict, cwd, out):
        assert (path is None) != (code is None)
        self.args = [str(path) if code is None else "-c", *argv]
        self._p = _context().Process(
            target=_script_main, daemon=True,
            args=(None if path is None else str(path), code, [str(a) for a in argv],
                  dict(env), str(cwd), str(out)))
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self):
        return self._p.exitcode

    def poll(self):
        return self._p.exitcode

    def wait(self, timeout: float | None = None):
        import subprocess
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._p.exitcode

    def kill(self) -> None:
        if self._p.exitcode is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


def run_rank_scripts(tmp_path, script: str, world: int, timeout: float, env: dict | None = None,
                     per_rank_env: dict | None = None, host_store: bool = False,
                     fresh: bool = False):
    """Run ``script`` (Python source) as ``world`` separate rank processes, as a launcher
    would: MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set, the source tree on
    PYTHONPATH, ``env`` for all and ``per_rank_env[r]`` for rank r on top, the working
    directory ``tmp_path``. Ranks may die or hang (unlike run_ranks): returns [(returncode,
    output)] per rank (stdout and stderr together; a negative code: killed by that signal),
    and every process is killed at ``timeout`` (the test then fails with the output).

    Each rank is a ForkedScript (``python rank.py`` forked from the fork server that imported
    torch once). ``fresh``: each rank a new interpreter (``sys.executable rank.py``), for a
    test of what only a whole interpreter's start or finalization shows.

    ``host_store``: a TCPStore is hosted here, as torchrun's agent hosts one, and MASTER_PORT
    is its port (the script connects to it as a client); else rank 0 hosts it (env://)."""
    import subprocess
    import textwrap
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parent.parent
    path = Path(tmp_path) / "rank.py"
    path.write_text(textwrap.dedent(script))
    store = None
    if host_store:
        from datetime import timedelta as _td
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=_td(seconds=timeout))
        port = store.port
    else:
        port = free_port()
    envs = []
    for r in range(world):
        e = dict(os.environ)
        e["PYTHONPATH"] = str(root) + os.pathsep + e.get("PYTHONPATH", "")
        e.setdefault("OMP_NUM_THREADS", "1")
        e.update(env or {})
        e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                 WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        e.update((per_rank_env or {}).get(r, {}))
        envs.append(e)
    if fresh:
        return _run_fresh(path, envs, tmp_path, timeout)  # (the store lives until we return)
    outs = [Path(tmp_path) / f".rank{r}.out" for r in range(world)]
    procs = []
    deadline = time.monotonic() + timeout
    try:
        for r in range(world):
            outs[r].write_bytes(b"")
            procs.append(ForkedScript(path=path, env=envs[r], cwd=tmp_path, out=outs[r]))
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
    finally:  # nothing outlives the call (a rank still running at the timeout: killed)
        late = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            p.kill()
            p.wait()
        del store
    texts = [o.read_bytes().decode(errors="replace") for o in outs]
    for o in outs:
        o.unlink()
    if late:
        pytest.fail(f"ranks {late} still running after {timeout}s; rank {late[0]} said:\n"
                    f"{texts[late[0]][-3000:]}")
    return [(p.returncode, texts[r]) for r, p in enumerate(procs)]


def _run_fresh(path, envs: list, cwd, timeout: float) -> list:
    """run_rank_scripts' ranks as new interpreters."""
    import subprocess

    import pytest

    procs = [subprocess.Popen([sys.executable, str(path)], env=e, cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                text, _ = p.communicate()
                pytest.fail(f"ranks still running after {timeout}s; this one said:\n{text[-3000:]}")
            out.append((p.returncode, text))
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    return out


#: The environment variable that tags the processes a test starts (tagged_pids).
TAG_VAR = "TEST_PROCESS_TAG"


def tagged_pids(token: str) -> list[int]:
    """The processes whose environment carries ``TAG_VAR=token``: every process a test's
    command started, torchrun's ranks included (torchrun puts each rank in a session of its
    own, so killing the command's process group does not reach them)."""
    import contextlib
    pids, needle = [], f"{TAG_VAR}={token}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            with contextlib.suppress(OSError):
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(name))
    return pids


def kill_tagged(token: str) -> None:
    import contextlib
    for pid in tagged_pids(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

