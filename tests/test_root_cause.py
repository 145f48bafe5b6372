"""Failures carry their root cause: every rank names the rank that failed first.

- 4 ranks on one host, rank 3 SIGKILLed during a stream of 64 MB all_reduces, the survivors
  exiting at once after their own failure (as a rank that gives up does): every survivor raises
  within the op timeout an error that names rank 3 and the op, never another survivor that
  merely exited after its own failure (a cross-memory attach read of its tensor failing with
  ESRCH, its process gone, its link closed). Over shared memory (the default: the survivors
  read each other's cause records in the segment, transport/shm) and over TCP
  (LINERATE_SHM=0: the ERROR frame carries the root rank).
- A Context that received an ERROR frame naming rank 3 and then loses another peer's
  connection still names rank 3.
- A set-up setting that differs, 4 ranks started by hand (rank 0 hosts the Store), every rank
  exiting at once after its failure: every rank names the setting, none says "the Store
  stopped answering" (the rank hosting the Store keeps it up until every rank has read the
  failure: transport/rendezvous.py ``failure_read``).

By hand, more runs: ``python tests/test_root_cause.py kill shm 20``, ``... kill tcp 20``,
``... setup 10``.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import run_rank_scripts  # noqa: E402

T_OP = 10  # the group timeout (seconds)

_KILL = r"""
import datetime, json, os, signal, threading, time
import torch, torch.distributed as dist
import linerate  # noqa: F401
RANK = int(os.environ["RANK"])
OUT = os.environ["OUT"]
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=float(os.environ["T_OP"])))
armed = False
if os.environ.get("SLOW_READER"):
    import linerate.collectives.shm_algos as sa
    _read, _killed = sa.cma_read, os.path.join(OUT, "killed")
    if RANK == 3:  # dies as it starts reading the others' results (cross-memory attach)
        def read(pid, local, remote, n):
            if armed and n > sa.CMA_PIECE:
                with open(_killed, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return _read(pid, local, remote, n)
        sa.cma_read = read
    elif os.environ["SLOW_READER"] == str(RANK):
        # descheduled once rank 3 is dead (as on a loaded host): its reads come late, after
        # the other survivors failed (because of rank 3) and exited
        def read(pid, local, remote, n):
            end = time.monotonic() + (0.5 if n > sa.CMA_PIECE else 0.0)
            while not os.path.exists(_killed) and time.monotonic() < end:
                time.sleep(0.005)  # its first read of a result waits for rank 3's death
            if os.path.exists(_killed):
                time.sleep(1.0)
            return _read(pid, local, remote, n)
        sa.cma_read = read
x = torch.ones(16 << 20)  # 64 MB
dist.all_reduce(x)
if RANK == 3 and os.environ.get("SLOW_READER"):
    def arm():
        global armed
        time.sleep(float(os.environ["KILL_AFTER"]))
        armed = True
    threading.Thread(target=arm, daemon=True).start()
elif RANK == 3:
    def die():
        time.sleep(float(os.environ["KILL_AFTER"]))
        with open(os.path.join(OUT, "killed"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die, daemon=True).start()
try:
    for i in range(100_000):
        x.fill_(1.0)
        dist.all_reduce(x)
except Exception as e:  # noqa: BLE001 - the subject
    with open(os.path.join(OUT, f"error-{RANK}"), "w") as f:
        json.dump({"at": time.time(), "error": str(e)}, f)
    print("ERROR", str(e).replace(chr(10), " "), flush=True)
    os._exit(3)  # at once, as a rank that gives up: its peers must not take this for the cause
print("COMPLETED", flush=True)
"""


def _blames(msg: str, rank: int) -> bool:
    """Whether ``msg`` puts a failure on ``rank`` (it exited, closed, could not be read)."""
    r = rf"rank {rank}\b"
    return bool(re.search(
        rf"{r}'s tensor|{r} \((process|pid)|{r} closed|to {r} [^:]*closed unexpectedly|"
        rf"connection to {r} failed|{r} exited|{r} has exited|because of {r}", msg))


def _kill_run(tmp: Path, shm: str, kill_after: float, env: dict | None = None) -> dict:
    """One run; returns {survivor: its error} (the test fails on anything else)."""
    tmp.mkdir(parents=True, exist_ok=True)
    res = run_rank_scripts(tmp, _KILL, 4, timeout=120,
                           env={"OUT": str(tmp), "T_OP": str(T_OP), "LINERATE_SHM": shm,
                                "KILL_AFTER": str(kill_after), **(env or {})})
    assert (tmp / "killed").exists(), f"rank 3 never killed itself:\n{res[3][1][-2000:]}"
    killed = float((tmp / "killed").read_text())
    errors = {}
    for r in (0, 1, 2):
        code, text = res[r]
        assert code == 3, f"survivor rank {r} exited {code}:\n{text[-3000:]}"
        rep = json.loads((tmp / f"error-{r}").read_text())
        delay = rep["at"] - killed
        assert 0 <= delay < T_OP, f"rank {r} raised {delay:.2f}s after the kill: {rep['error']}"
        errors[r] = rep["error"]
    return errors


def _kill_verdict(errors: dict) -> list[str]:
    """What is wrong with the survivors' errors (empty: each names rank 3 and the op, and
    blames no other survivor)."""
    bad = []
    for r, msg in errors.items():
        if not _blames(msg, 3) and not re.search(r"\brank 3\b", msg):
            bad.append(f"rank {r} does not name rank 3: {msg[:600]}")
        elif any(_blames(msg, s) for s in (0, 1, 2) if s != r):
            bad.append(f"rank {r} blames a survivor: {msg[:600]}")
        elif "all_reduce" not in msg:
            bad.append(f"rank {r} does not name the op: {msg[:600]}")
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shm", ["auto", "0"], ids=["shm", "tcp"])
def test_killed_rank_is_the_root_cause_on_every_survivor(tmp_path, shm):
    """Three runs (more by hand: 20 named rank 3 over shm and over TCP, see the module doc),
    the kill at different points of the stream."""
    for run, after in enumerate((0.3, 0.55, 0.8)):
        errors = _kill_run(tmp_path / f"run{run}", shm, after)
        bad = _kill_verdict(errors)
        for r, msg in errors.items():
            print(f"run {run} rank {r}: {msg[:300]}")
        assert not bad, f"run {run}: " + "\n".join(bad)


@pytest.mark.timeout(300)
def test_survivor_that_exited_after_its_failure_is_not_named():
    """The race seen on loaded hosts, made certain: rank 3 dies as the ranks start reading
    each other's results (cross-memory attach), and rank 0's reads come only after the other
    survivors failed (because of rank 3) and exited: its read of rank 1's tensor fails with
    ESRCH. Rank 1's cause record in the segment (and its ERROR frame) says that it failed
    because of rank 3, and rank 0 names rank 3 (it named rank 1 before)."""
    import tempfile
    for run, after in enumerate((0.3, 0.6)):
        with tempfile.TemporaryDirectory() as d:
            errors = _kill_run(Path(d), "auto", after, {"SLOW_READER": "0", "LINERATE_CMA": "1"})
        for r, msg in errors.items():
            print(f"run {run} rank {r}: {msg[:300]}")
        bad = _kill_verdict(errors)
        assert not bad, f"run {run}: " + "\n".join(bad)


# ----------------------------------------------------------------------------- TCP, in-process
@pytest.mark.timeout(60)
def test_error_frame_root_outlives_a_survivors_close():
    """Rank 0 receives rank 2's ERROR frame naming rank 3 (the frame's value: root + 1); then
    rank 1, which failed because of rank 3 too (its own ERROR frame says so), gives up and
    closes while rank 0 still waits on it: rank 0's collectives fail naming rank 3, never rank
    1's going (a point-to-point receive from rank 1 says that rank 1 closed)."""
    from linerate.transport import CHANNEL_COLLECTIVE, CHANNEL_P2P, PeerFailure, TransportError
    from linerate.transport.framing import KIND_ERROR

    from test_transport import _close_all, make_mesh

    ctxs = make_mesh(4, nsocks=2, connect="eager")
    try:
        c0, c1, c2, _ = ctxs
        p2p = c0.irecv(1, memoryview(bytearray(8)), CHANNEL_P2P, 3)
        coll = c0.irecv(1, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 0)
        c0.control(c0.peers[2].link, KIND_ERROR,
                   b"rank 2: all_reduce #5: rank 3 exited or crashed", 4)
        assert c0.root_cause()[0] == 3
        with pytest.raises(TransportError) as ei:
            coll.wait(5)
        assert "rank 3" in str(ei.value) and not _blames(str(ei.value), 1), str(ei.value)
        # rank 1 learnt of rank 3 (say from rank 2's frame), reports it and gives up
        c1.control(c1.peers[2].link, KIND_ERROR,
                   b"rank 2: all_reduce #5: rank 3 exited or crashed", 4)
        c1.report_error("rank 1: all_reduce #5 failed: rank 3 exited or crashed")
        assert c1.root_cause()[0] == 3
        c1.close(timeout=2.0)
        with pytest.raises(PeerFailure) as ei:
            p2p.wait(5)
        assert "rank 1 closed its process group" in str(ei.value), str(ei.value)
        assert c0.root_cause()[0] == 3
        assert c0.cause_of(1)[0] == 3
        new = c0.irecv(1, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 1)
        with pytest.raises(TransportError) as ei:
            new.wait(5)
        assert "rank 3" in str(ei.value) and not _blames(str(ei.value), 1), str(ei.value)
        err = c0.lost(1, "rank 0: all_reduce #6: rank 1 (pid 9) exited", "rank 0: all_reduce #6")
        assert str(err).startswith("rank 0: all_reduce #6: the group failed because of rank 3: ")
        assert err.root == 3 and not _blames(str(err), 1), str(err)
    finally:
        _close_all(ctxs)


@pytest.mark.timeout(60)
def test_peer_that_failed_because_of_another_is_not_the_cause():
    """A peer that said (its ERROR frame, or its cause record) that it failed because of rank
    3, and whose connection then fails: rank 0's collective pending on it fails naming rank 3,
    not the peer; a point-to-point receive from it says what happened to it. A crashed peer
    that said nothing is the cause."""
    from linerate.transport import CHANNEL_COLLECTIVE, CHANNEL_P2P, PeerFailure, TransportError

    from test_transport import _close_all, make_mesh

    ctxs = make_mesh(4, nsocks=1, connect="eager")
    try:
        c0 = ctxs[0]
        coll = c0.irecv(1, memoryview(bytearray(8)), CHANNEL_COLLECTIVE, 0)
        p2p = c0.irecv(1, memoryview(bytearray(8)), CHANNEL_P2P, 1)
        # (as its ERROR frame would, without breaking rank 0's collectives first)
        c0.peers[1].root = (3, "rank 1: all_reduce #5: rank 3 (pid 77) exited")
        c0.link_failed(c0.peers[1].link, PeerFailure(1, "rank 0: connection 0 to rank 1 closed "
                                                        "unexpectedly: rank 1 exited or crashed"))
        with pytest.raises(TransportError) as ei:
            coll.wait(5)
        msg = str(ei.value)
        assert "because of rank 3: rank 1: all_reduce #5: rank 3 (pid 77) exited" in msg, msg
        assert not _blames(msg, 1), msg
        with pytest.raises(PeerFailure, match="rank 1 exited or crashed"):
            p2p.wait(5)
        assert c0.root_cause()[0] == 3
    finally:
        _close_all(ctxs)
    ctxs = make_mesh(2, nsocks=1, connect="eager")
    try:  # a crashed peer that said nothing is the cause
        c0 = ctxs[0]
        c0.link_failed(c0.peers[1].link, PeerFailure(1, "rank 0: connection to rank 1 failed"))
        assert c0.root_cause()[0] == 1
        assert str(c0.peers[1].failure) == "rank 0: connection to rank 1 failed"
        assert "rank 0: connection to rank 1 failed" in str(c0.broken)
    finally:
        _close_all(ctxs)


def test_shared_segment_cause_records():
    """The cause records of transport/shm: written once, read by every rank, the root
    picked as the rank that names itself, else the one the others blame that left none."""
    import torch

    from linerate.transport.shm import Segment, p2p_layout, pick_root

    buf = torch.zeros(p2p_layout(4)[3], dtype=torch.uint8)
    segs = [Segment(buf, 4, i, "test", (0, 1, 2, 3)) for i in range(4)]
    assert segs[0].root_cause() is None
    assert segs[1].record_cause(3, "rank 1: all_reduce #5: rank 3 (process 9) has exited")
    assert not segs[1].record_cause(1, "later")  # the first wins
    assert segs[0].cause_of(1) == (3, "rank 1: all_reduce #5: rank 3 (process 9) has exited")
    segs[2].record_cause(1, "rank 2: reading rank 1's tensor failed: [Errno 3]")
    root, writer, text = segs[0].root_cause()
    assert (root, writer) == (3, 1), (root, writer, text)
    long = "é" * 1000
    segs[0].record_cause(0, long)
    assert segs[3].cause_of(0)[1] == long[:len(segs[3].cause_of(0)[1])]
    assert segs[3].root_cause()[0] == 0  # a rank that names itself failed on its own
    assert pick_root({}) is None
    assert pick_root({1: (2, 0, "a"), 2: (1, 1, "b")})[0] == 2  # blames that go round


# ----------------------------------------------------------------------------- set-up
_SETUP = r"""
import datetime, os, time
import torch, torch.distributed as dist
import linerate  # noqa: F401
t0 = time.monotonic()
try:
    dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=30))
    print("JOINED", flush=True)
    dist.barrier()
except Exception as e:
    print(f"FAILED {time.monotonic() - t0:.2f} {e}".replace(chr(10), " "), flush=True)
    os._exit(4)  # at once: a rank hosting the Store takes it with it
"""


def _setup_run(tmp: Path, odd: int) -> list[str]:
    """4 ranks by hand (rank 0 hosts the Store), rank ``odd`` with another LINERATE_NSOCKS;
    returns what is wrong (empty: every rank failed within seconds naming the setting)."""
    tmp.mkdir(parents=True, exist_ok=True)
    mine, others = ("1", "2") if odd == 0 else ("2", "1")
    res = run_rank_scripts(tmp, _SETUP, 4, timeout=90, env={"LINERATE_NSOCKS": others},
                           per_rank_env={odd: {"LINERATE_NSOCKS": mine}})
    want = (f"LINERATE_NSOCKS is {others} here but {mine} on rank 0" if odd == 0 else
            f"LINERATE_NSOCKS is {mine} here but {others} on rank 0")
    bad = []
    for r, (code, text) in enumerate(res):
        m = re.search(r"FAILED ([0-9.]+) (.*)", text)
        if not m or code != 4:
            bad.append(f"rank {r} ({code}): {text[-1500:]}")
        elif want not in m.group(2):
            bad.append(f"rank {r} does not name the setting: {m.group(2)[:600]}")
        elif re.search(r"(rank \d+: )\1", m.group(2)):
            bad.append(f"rank {r} repeats a rank's prefix: {m.group(2)[:600]}")
        elif float(m.group(1)) >= 10:
            bad.append(f"rank {r} took {m.group(1)}s")
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("odd", [0, 3], ids=["store-host-odd", "other-odd"])
def test_setup_failure_named_on_every_rank_when_the_store_host_exits_at_once(tmp_path, odd):
    for run in range(3):
        bad = _setup_run(tmp_path / f"run{run}", odd)
        assert not bad, f"run {run}: " + "\n".join(bad)


_STORE_HOST = r"""
import datetime, sys, time
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_store_lost_during_setup_is_named():
    """A rank still setting a group up when the process hosting the Store exits (its user
    quit after the others' failure, as a script's ``os._exit`` does) raises within seconds an
    error that says the Store stopped answering and where the cause lies, not torch's bare
    network error."""
    import datetime
    import subprocess
    import threading
    import time

    import torch.distributed as dist

    from linerate.transport import Context, TransportError, TransportOptions

    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(host.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, None, False,
                              timeout=datetime.timedelta(seconds=30))
        threading.Timer(0.5, host.kill).start()  # rank 1 waits for rank 0's settings meanwhile
        t0 = time.monotonic()
        with pytest.raises(TransportError) as err:
            Context(store, 1, 2, TransportOptions(socket_ifname="lo", connect_timeout=30,
                                                  shm="0"))
        assert time.monotonic() - t0 < 10
        text = str(err.value)
        assert text.startswith("rank 1: the Store stopped answering during group set-up"), text
        assert "probably exited after failing" in text, text
    finally:
        host.kill()
        host.wait()


# ----------------------------------------------------------------------------- by hand
def _main(argv: list[str]) -> None:
    import tempfile
    what, rest = argv[0], argv[1:]
    with tempfile.TemporaryDirectory() as d:
        if what == "kill":
            shm, n = ("auto" if rest[0] == "shm" else "0"), int(rest[1])
            good = 0
            for i in range(n):
                try:
                    errors = _kill_run(Path(d) / f"run{i}", shm, 0.3 + 0.05 * (i % 10))
                    bad = _kill_verdict(errors)
                except (AssertionError, Exception, pytest.fail.Exception) as e:
                    bad = [str(e)[:1500]]
                good += not bad
                print(f"run {i}: {'ok' if not bad else 'BAD'}", *bad, sep="\n  ", flush=True)
            print(f"{rest[0]}: {good} of {n} runs named rank 3 on every survivor")
        else:
            n = int(rest[0]) if rest else 10
            for odd in (0, 3):
                good = 0
                for i in range(n):
                    try:
                        bad = _setup_run(Path(d) / f"s{odd}-{i}", odd)
                    except (Exception, pytest.fail.Exception) as e:
                        bad = [str(e)[:1500]]
                    good += not bad
                    print(f"odd {odd} run {i}: {'ok' if not bad else 'BAD'}", *bad, sep="\n  ",
                          flush=True)
                print(f"set-up, rank {odd} odd: {good} of {n} runs named the setting on every rank")


if __name__ == "__main__":
    _main(sys.argv[1:])
