"""Failures inside real training: what a training script meets, run as users run it.

- A rank that dies (os._exit) or stalls past the group timeout under DistributedDataParallel:
  the others raise a catchable RuntimeError naming it (not a SIGSEGV in DDP's Reducer, which
  would read a failed future's value as tensors).
- torchrun --max-restarts 2 with a rank that exits on the first attempt: the restart finishes
  with identical parameters on every rank, default (static) and c10d rendezvous, 5 runs in a
  row each (was: the restarted ranks used the failed attempt's keys from the kept Store).
- A set-up setting that differs on one rank fails every rank within seconds, naming it.
- A timed-out collective names the rank that never entered it, on every rank.
- A stride-0 (expand()ed) output is refused before anything is sent; the group stays usable.
- Memory kept after a large operation is bounded by LINERATE_KEEP_BYTES.

Ranks are separate processes (scripts below): a rank must be able to die or hang; the set-up
disagreements also run on thread ranks, one for each setting.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _harness import free_port, run_rank_scripts

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")

_PRELUDE = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
import linerate  # noqa: F401
RANK = int(os.environ["RANK"])


def mark(name):  # a file in the ranks' folder (their working directory), for wait_for
    open(name, "w").close()


def wait_for(*paths, at_most):  # until every path exists (mark's files, a flight dump):
    # a rank that stays away from a collective until the others gave up on it, at most at_most s
    end = time.monotonic() + at_most
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < end:
        time.sleep(0.02)
"""


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


#: How long a test's ranks may run: a hang bound (pyproject's pytest timeout is 300 s), generous
#: for a loaded machine, where starting the interpreters alone takes tens of seconds.
HANG_S = 180


def run_ranks_script(tmp_path: Path, body: str, world: int, timeout: float,
                     env: dict | None = None, per_rank_env: dict | None = None):
    """``body`` after the common prelude, as ``world`` rank processes (_harness.run_rank_scripts)."""
    return run_rank_scripts(tmp_path, _PRELUDE + textwrap.dedent(body), world, timeout, env,
                            per_rank_env)


# ----------------------------------------------------------------------------- 1: DDP
_DDP = """
mode = sys.argv[1] if len(sys.argv) > 1 else os.environ["MODE"]
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=5))
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    for step in range(20):
        if RANK == 1 and step == 5:
            if mode == "die":
                os._exit(13)
            wait_for("caught0", "caught2", at_most=10)   # past the 5 s timeout
            os._exit(0)
        model(torch.randn(8, 64)).sum().backward()
        opt.step(); opt.zero_grad()
    print("FINISHED", flush=True)
except RuntimeError as e:   # what a training script catches to log, checkpoint and exit
    print("CAUGHT", type(e).__name__, str(e).replace(chr(10), " ")[:1000], flush=True)
    mark(f"caught{RANK}")
    os._exit(3)
"""


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_ddp_survivors_raise_a_catchable_error(tmp_path, mode):
    res = run_ranks_script(tmp_path, _DDP, 3, timeout=HANG_S, env={"MODE": mode})
    for r in (0, 2):
        code, text = res[r]
        assert code == 3, f"rank {r} exited {code} (139/-11: the segfault):\n{text[-3000:]}"
        caught = text[text.index("CAUGHT"):]
        assert "rank 1" in caught, caught


# ----------------------------------------------------------------------------- 2: torchrun
_RESTART = _PRELUDE + """
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=20))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    if attempt == 0 and RANK == 1 and step == 3:
        os._exit(7)
    torch.manual_seed(100 + step * 10 + RANK)
    model(torch.randn(4, 32)).sum().backward(); opt.step(); opt.zero_grad()
w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
g = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(g, w)
assert all(torch.equal(g[0], x) for x in g), "parameters differ between ranks"
with open(os.path.join(os.environ["OUT"], f"rank{RANK}.json"), "w") as f:
    json.dump({"attempt": attempt, "params": w.tolist()}, f)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun beside {sys.executable}")
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_restart_recovers(tmp_path, rdzv):
    import json
    script = tmp_path / "train.py"
    script.write_text(_RESTART)
    # One restart per rendezvous kind in every CI run (each run costs the suite seconds of
    # CPU; more runs add time, not coverage).
    out = tmp_path / "run"
    out.mkdir()
    port = free_port()
    args = [str(TORCHRUN), "--nproc-per-node", "3", "--max-restarts", "2"]
    args += (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
             if rdzv == "c10d" else ["--master-port", str(port)])
    p = subprocess.run(args + [str(script)], env=_env({"OUT": str(out)}), cwd=tmp_path,
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{p.stderr[-4000:]}"
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(g["attempt"] == 1 for g in got), got
    assert got[0]["params"] == got[1]["params"] == got[2]["params"]


# ----------------------------------------------------------------------------- 3: set-up
_SETUP = """
print(f"STARTED {time.time()!r}", flush=True)
try:
    dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=30))
    print("JOINED", flush=True)
    dist.barrier()
except Exception as e:
    print(f"FAILED {time.time()!r} {e}".replace(chr(10), " "), flush=True)
    time.sleep(2)   # as a real rank would (logging, cleanup): the Store it hosts stays up
    os._exit(4)
"""


_DISAGREE = [
    ("LINERATE_NSOCKS", "1", "2"),
    ("LINERATE_NSOCKS", "2", "auto"),       # auto may narrow links to other hosts
    ("LINERATE_PIPELINE", "0", "auto"),     # a collectives setting, agreed the same way
    ("LINERATE_ALLREDUCE_ALGO", "direct", "ring"),  # else: ranks wait in different algorithms
    ("LINERATE_SMALL_BYTES", "4096", "65536"),
]


def _named(setting, mine, rank0):
    shown = "auto (2)" if setting == "LINERATE_NSOCKS" and rank0 == "auto" else rank0
    return f"{setting} is {mine} here but {shown} on rank 0"


def test_setup_disagreement_fails_every_rank_fast_naming_the_setting(tmp_path):
    """Rank processes, the setting from the environment as a job sets it (the thread test
    below takes every setting of _DISAGREE through the group's options)."""
    setting, mine, rank0 = _DISAGREE[0]
    res = run_ranks_script(tmp_path, _SETUP, 4, timeout=HANG_S,
                           per_rank_env={3: {setting: mine}}, env={setting: rank0})
    # from the moment the last rank started its set-up (a loaded machine starts the four
    # interpreters seconds apart), not from each rank's own start
    started = max(float(re.search(r"STARTED (\S+)", text).group(1)) for _, text in res)
    for r, (code, text) in enumerate(res):
        m = re.search(r"FAILED (\S+) (.*)", text)
        assert m and code == 4, f"rank {r} ({code}):\n{text[-2000:]}"
        took = float(m.group(1)) - started
        assert took < 10, f"rank {r} failed {took:.1f}s after the last rank started (the " \
                          f"set-up timeout is 30 s)"
        assert _named(setting, mine, rank0) in m.group(2), (r, m.group(2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting, mine, rank0", _DISAGREE)
def test_setup_disagreement_on_threads_fails_every_rank_naming_the_setting(setting, mine,
                                                                            rank0):
    """Four thread ranks (one interpreter), rank 3's group built with another value: every
    rank's set-up fails, naming the setting, well within the set-up timeout (30 s)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from linerate.collectives.backend import ProcessGroupLinerate
    from linerate.collectives.options import Options
    store, errors, made = dist.HashStore(), {}, []

    def rank_main(r):
        try:
            pg = ProcessGroupLinerate(dist.PrefixStore("g", store), r, 4, timedelta(seconds=30),
                                      Options.from_env({setting: mine if r == 3 else rank0}),
                                      group_name="g")
            made.append(pg)
            pg.barrier().wait()
        except Exception as e:  # noqa: BLE001 - each rank's error is the subject
            errors[r] = (time.monotonic(), str(e))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for pg in made:
        pg.abort()
    assert not any(t.is_alive() for t in threads), "a rank is still in its set-up after 60 s"
    assert sorted(errors) == [0, 1, 2, 3], errors
    for r, (when, text) in errors.items():
        assert when - t0 < 10, f"rank {r} failed after {when - t0:.1f}s"
        assert _named(setting, mine, rank0) in text, (r, text)


# ----------------------------------------------------------------------------- 4: stride 0
_STRIDE0 = """
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=20))
t = torch.ones(1).expand(4)
try:
    dist.all_reduce(t)
    print("ACCEPTED")
except ValueError as e:
    print("REFUSED", e)
x = torch.full((5,), float(RANK + 1))
dist.all_reduce(x)
print("AFTER", x.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_stride0_output_refused_before_sending_and_group_usable(tmp_path):
    res = run_ranks_script(tmp_path, _STRIDE0, 2, timeout=HANG_S, env={"LINERATE_SHM": "0"})
    for r, (code, text) in enumerate(res):
        assert code == 0, text[-3000:]
        assert f"REFUSED rank {r}: all_reduce: the output tensor float32[4] has elements that " \
               f"share memory" in text, text
        assert "AFTER [3.0, 3.0, 3.0, 3.0, 3.0]" in text, text


# ----------------------------------------------------------------------------- 5: blame
_BLAME = """
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=3))
x = torch.ones(2_000_000)
dist.all_reduce(x)
if RANK == 1:
    wait_for("error0", "error2", "error3", at_most=6)   # past the others' 3 s timeout
try:
    dist.all_reduce(x)
    print("DONE")
except Exception as e:
    print("ERROR", str(e).replace(chr(10), " "), flush=True)
    mark(f"error{RANK}")
"""


@pytest.mark.parametrize("shm", ["0", "auto"])
def test_timeout_names_the_rank_that_never_entered(tmp_path, shm):
    res = run_ranks_script(tmp_path, _BLAME, 4, timeout=HANG_S, env={"LINERATE_SHM": shm})
    for r in (0, 2, 3):
        text = res[r][1]
        assert "ERROR" in text, text[-2000:]
        err = text[text.index("ERROR"):]
        # every waiting rank blames rank 1, the one that was asleep; none blames a waiting rank
        assert re.search(r"rank 1\b[^;]*(has not entered|is in op #1)|waiting for ranks \[1\]", err), (r, err)
        assert not re.search(r"rank [023] \(last entered", err), (r, err)


# ----------------------------------------------------------------------------- 7: memory
_RSS = """
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=60))
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
x = torch.ones(64 << 20)    # 256 MB
before = rss_mib()
for _ in range(2):
    dist.all_reduce(x)
assert x[0].item() == 4.0 and x[-1].item() == 4.0
print("GROWTH", rss_mib() - before, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("shm", ["0", "auto"])
def test_memory_kept_after_a_large_op_is_bounded(tmp_path, shm):
    keep_mib = 16
    res = run_ranks_script(tmp_path, _RSS, 2, timeout=HANG_S,
                           env={"LINERATE_SHM": shm, "LINERATE_KEEP_BYTES": f"{keep_mib}M"})
    for r, (code, text) in enumerate(res):
        assert code == 0, text[-3000:]
        growth = int(re.search(r"GROWTH (-?\d+)", text).group(1))
        # staging and scratch each keep at most LINERATE_KEEP_BYTES; the rest is allocator slack
        # (without the cap: +163 MiB over TCP)
        assert growth < 2 * keep_mib + 24, f"rank {r}: {growth} MiB kept after a 256 MB all_reduce"
