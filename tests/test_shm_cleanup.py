"""Nothing of a group is left in /dev/shm: a segment's name goes the moment every rank of its
host has mapped it (the last of them unlinks it, without waiting for the creator's next look
at the store), and a segment that a set-up left behind because every rank of its host died
first (SIGKILL: nothing in the process can act) goes when the next segment is created on the
host (``sweep_stale``: its creator is gone)."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from _harness import REPO, free_port

pytestmark = pytest.mark.timeout(120)


def _segments() -> set:
    from linerate.transport import shm
    return {n for n in os.listdir(shm.SHM_DIR) if shm._SEGMENT_NAME.fullmatch(n)}


def _owner(name: str) -> int:
    from linerate.transport import shm
    with open(os.path.join(shm.SHM_DIR, name), "rb") as f:
        head = f.read(shm._OWNER_OFF + 16)
    return struct.unpack_from("<q", head, shm._OWNER_OFF)[0]


class _HeldStore:
    """A Rendezvous whose waits for the mates' ``ok/`` records block until ``go`` is set: the
    creator has not looked at the store yet."""

    def __init__(self, rv, go: threading.Event):
        self._rv, self._go = rv, go

    def wait_set(self, keys, *a, **kw):
        if any("/ok/" in k for k in ([keys] if isinstance(keys, str) else keys)):
            assert self._go.wait(30)
        return self._rv.wait_set(keys, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._rv, name)


def test_the_last_rank_to_map_a_host_segment_unlinks_its_name():
    from linerate.transport import rendezvous, shm
    store, secret, go = dist.HashStore(), os.urandom(32), threading.Event()
    got: dict = {}

    def rank(r: int) -> None:
        rv = rendezvous.Rendezvous(store, r, time.monotonic() + 30, 30.0, "c/")
        try:
            got[r] = shm._host_segment(_HeldStore(rv, go) if r == 0 else rv, "c/", r, (0, 1),
                                       secret)
        except BaseException as e:  # noqa: BLE001 - reported below
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    threads[1].join(30)  # rank 1 mapped it and said so; rank 0 has not read that yet
    assert not threads[1].is_alive() and threads[0].is_alive()
    name = got[1][1]
    assert got[1][0] is not None and name.startswith("linerate-"), got
    # its own name only: the other test worker's groups make and unlink segments meanwhile
    assert name not in _segments(), "the name outlived the mappings"
    go.set()
    threads[0].join(30)
    buf0, buf1 = got[0][0], got[1][0]
    buf0[5000] = 7  # one segment, mapped twice
    assert int(buf1[5000]) == 7


def test_the_last_rank_to_post_on_the_offered_segment_unlinks_it():
    from linerate.transport import rendezvous, shm
    name, path, token, buf = shm._create(2)
    try:
        shm.SetupBoard(buf, 2).post(0, "auto")  # rank 0 mapped it (it made it)
        assert os.path.exists(path)
        me = {"host": shm.host_id(), "mode": "auto", "offer": "ok"}
        rv = rendezvous.Rendezvous(dist.HashStore(), 1, time.monotonic() + 30, 30.0, "o/")
        peers = shm._records_of_mappers(rv, "o/", 1, 2, me, shm.SetupBoard(buf, 2), name)
        assert peers == [{**me, "pid": [os.getpid(), shm.pidns()]}, me]
        assert not os.path.exists(path)
    finally:
        shm._unlink(path)


RANK0 = """
import torch.distributed as dist
dist.init_process_group("linerate")  # rank 1 joins the Store, never the group: set-up waits
"""
RANK1 = """
import os, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, False,
                      timeout=timedelta(seconds=60))
time.sleep(120)
"""


def test_a_segment_left_by_a_killed_set_up_goes_at_the_next_creation(tmp_path):
    from linerate.transport import shm
    before = _segments()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    procs = []
    for r, text in enumerate((RANK0, RANK1)):
        (tmp_path / f"rank{r}.py").write_text(text)
        procs.append(subprocess.Popen([sys.executable, str(tmp_path / f"rank{r}.py")],
                                      env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    p = procs[0]
    try:
        deadline = time.monotonic() + 60
        left = set()
        while time.monotonic() < deadline and p.poll() is None:
            left = {n for n in _segments() - before if _owner(n) == p.pid}
            if left:
                break
            time.sleep(0.05)
        assert left, "rank 0 offered no segment: " + (p.stdout.read().decode()
                                                     if p.poll() is not None else "")
        for q in procs:  # every rank of the host dies during set-up
            os.kill(q.pid, signal.SIGKILL)
            q.wait(10)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    # The killed set-up's segment is there still, unless a group created meanwhile by another
    # test on this host swept it first (what this test checks, done by someone else).
    name, path, _, _ = shm._create(2)  # this creation sweeps
    try:
        assert not left & _segments(), f"{left} outlived its creator's next sweep"
        assert shm.sweep_stale() == [] and os.path.exists(path), "a live creator's segment went"
    finally:
        shm._unlink(path)


def test_sweep_touches_only_dead_creators_segments_of_this_user(tmp_path):
    from linerate.transport import shm
    d = str(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def segment(name: str, pid: int, mode: int = 0o600, magic: bytes | None = None) -> str:
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            head = bytearray(4096)
            head[:8] = magic or shm._MAGIC
            struct.pack_into("<qq", head, shm._OWNER_OFF, pid, shm.pidns())
            f.write(head)
        os.chmod(path, mode)
        return name

    stale = segment("linerate-" + "a" * 32, dead.pid)
    alive = segment("linerate-" + "b" * 32, os.getpid())
    other_mode = segment("linerate-" + "c" * 32, dead.pid, 0o644)
    old_layout = segment("linerate-" + "d" * 32, dead.pid, magic=b"LRSHM\x00\x02\x00")
    foreign = segment("torch_" + "e" * 32, dead.pid)
    assert shm.sweep_stale(d) == [stale]
    assert sorted(os.listdir(d)) == sorted([alive, other_mode, old_layout, foreign])
