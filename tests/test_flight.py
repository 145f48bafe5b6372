"""The flight recorder: every group keeps its last
LINERATE_FR_ENTRIES collectives; on a timeout every rank writes them (LINERATE_FR_DUMP) with one
log line naming the file; ``linerate flight`` reads all ranks' dumps and names the rank that
never joined; records are bounded, off at 0; malformed dumps are named; torch's control plane
serves them (handler ``linerate_flight``)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from linerate.collectives import flight
from linerate.tools import flight as flight_cli
from test_training_faults import run_ranks_script

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "linerate.tools.cli", "flight", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


# ----------------------------------------------------------------------------- 4 ranks, a timeout
_SLEEPER = """
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=3))
x = torch.ones(1000)
for _ in range(10):
    dist.all_reduce(x)
if RANK == 1:  # past the others' 3 s timeout (and their query of the peers), its own dump written
    wait_for("error0", "error2", "error3", os.environ["LINERATE_FR_DUMP"] + ".rank1.json",
             at_most=8)
try:
    dist.all_reduce(x)   # #11
    print("DONE", flush=True)
except Exception as e:
    print("ERROR", str(e).replace(chr(10), " "), flush=True)
    mark(f"error{RANK}")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["0", "auto"])
def test_timeout_dumps_every_rank_and_flight_names_the_rank_that_never_joined(tmp_path, shm):
    prefix = tmp_path / "dumps" / "fr"
    res = run_ranks_script(tmp_path, _SLEEPER, 4, timeout=90,
                           env={"LINERATE_SHM": shm, "LINERATE_FR_DUMP": str(prefix)})
    awaited = []
    for r, (code, text) in enumerate(res):
        assert code == 0, (r, text[-3000:])
        assert "ERROR" in text, (r, text[-3000:])
        path = f"{prefix}.rank{r}.json"
        assert os.path.exists(path), (r, text[-3000:])
        # one log line, naming the file
        lines = [ln for ln in text.splitlines() if "flight recorder:" in ln]
        assert len(lines) == 1 and path in lines[0], (r, text[-3000:])
        dump = json.loads(Path(path).read_text())
        assert dump["version"] == flight.VERSION and dump["rank"] == r
        ops = dump["groups"][0]["ops"]
        assert all(o["state"] == "completed" for o in ops[:10])
        if r == 1:
            # written while it slept (from the thread that received the others' report):
            # its record ends with #10, completed
            assert [o["seq"] for o in ops] == list(range(1, 11)), ops[-2:]
        else:
            assert [o["seq"] for o in ops] == list(range(1, 12))
            assert ops[10]["op"] == "all_reduce" and ops[10]["started"] is not None
            assert ops[10]["state"] in ("started", "failed"), ops[10]
            awaited.append(ops[10]["awaited"] or [])
    # the rank that timed out first recorded whom it waited for before telling the others
    assert any(1 in a for a in awaited), awaited

    out = _cli(str(prefix))
    assert out.returncode == 0, out.stderr
    assert re.search(r"all_reduce #11 \(group 0\): ranks 0, 2, 3 entered; rank 1 never joined "
                     r"— its last op was #10, completed", out.stdout), out.stdout
    assert "first op that did not complete everywhere: all_reduce #11" in out.stdout, out.stdout
    # the same from the folder, as JSON
    out = _cli("--json", str(prefix.parent))
    assert out.returncode == 0, out.stderr
    g = json.loads(out.stdout)["groups"][0]
    assert g["first_incomplete"] == 11 and g["dumps"] == [0, 1, 2, 3] and not g["mismatches"]
    op = g["ops"][0]
    assert op["entered"] == [0, 2, 3]
    assert [(n["rank"], n["last_seq"], n["last_state"], n["called"])
            for n in op["never_joined"]] == [(1, 10, "completed", False)]


_SUBGROUP = """
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=30))
sub = dist.new_group([1, 2, 3], timeout=datetime.timedelta(seconds=3))
x = torch.ones(1000)
dist.all_reduce(x)
if RANK != 0:
    for _ in range(3):
        dist.all_reduce(x, group=sub)
    if RANK == 3:  # past the others' 3 s timeout, its own dump written
        wait_for("error1", "error2", os.environ["LINERATE_FR_DUMP"] + ".rank3.json", at_most=8)
    try:
        dist.all_reduce(x, group=sub)
    except Exception as e:
        print("ERROR", str(e).replace(chr(10), " "), flush=True)
        mark(f"error{RANK}")
"""


@pytest.mark.timeout(120)
def test_subgroup_timeout_names_global_ranks(tmp_path):
    """A subgroup of global ranks 1, 2, 3 (group ranks 0, 1, 2) in which global rank 3 sleeps:
    the members dump (both their groups), rank 0 (not a member, its group fine) does not, and
    the analysis names global ranks."""
    prefix = tmp_path / "fr"
    res = run_ranks_script(tmp_path, _SUBGROUP, 4, timeout=90, env={"LINERATE_FR_DUMP": str(prefix)})
    for r, (code, text) in enumerate(res):
        assert code == 0, (r, text[-3000:])
        assert os.path.exists(f"{prefix}.rank{r}.json") == (r != 0), (r, text[-3000:], res)
    out = _cli(str(prefix))
    assert out.returncode == 0, out.stderr
    ranks = "\n".join(f"rank {r}: {text[-1500:]}" for r, (_, text) in enumerate(res))
    assert re.search(r"all_reduce #4 \(group \S+\): ranks 1, 2 entered; rank 3 never joined — its "
                     r"last op was #3, completed", out.stdout), out.stdout + ranks
    # the rank that timed out first recorded whom it awaited (the other may have written its
    # dump on hearing of it, before its own op failed)
    assert re.search(r"ranks? (1, 2|1|2) still waited for rank 3 when", out.stdout), \
        out.stdout + ranks


# ----------------------------------------------------------------------------- bounded, off
_COUNT = """
from linerate.collectives import flight
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=30))
x = torch.ones(8)
for _ in range(12):
    dist.all_reduce(x)
dist.broadcast(x, 0)
snap = flight.snapshot()
print("SNAP", json.dumps([[o["seq"] for o in g["ops"]] for g in snap["groups"]]), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entries, want", [("5", [[9, 10, 11, 12, 13]]), ("0", [])])
def test_record_is_bounded_and_off_at_zero(tmp_path, entries, want):
    res = run_ranks_script(tmp_path, _COUNT, 2, timeout=90,
                           env={"LINERATE_FR_ENTRIES": entries})
    for r, (code, text) in enumerate(res):
        assert code == 0, (r, text[-3000:])
        got = json.loads(text[text.index("SNAP") + 5:].splitlines()[0])
        assert got == want, (r, got)


def test_recorder_states_and_one_dump_per_group(tmp_path, caplog):
    rec = flight.Recorder(3, str(tmp_path / "x{rank}.json"), "7", 1, 2, [4, 5], 3.0)
    for s in range(1, 6):
        rec.queued("all_reduce", s, "float32[4] op=SUM")
    assert [r.seq for r in rec.ring] == [3, 4, 5]              # bounded
    rec.started(3)
    rec.completed(3, "ring")
    rec.started(4)
    err = RuntimeError("rank 1: all_reduce #4 did not complete within the 3.0s timeout: rank 0 "
                       "(last entered #3) has not entered all_reduce #4")
    with caplog.at_level("ERROR", logger="linerate"):
        rec.failed(4, err, "ring")
        rec.failed(5, RuntimeError(f"the group failed earlier: {err}"))   # refused: not started
    states = [(r.seq, r.state, r.algorithm, r.awaited) for r in rec.ring]
    assert states == [(3, "completed", "ring", None), (4, "failed", "ring", [0]),
                      (5, "failed", "", None)]
    path = tmp_path / "x5.json"   # the global rank of group rank 1
    assert path.exists()
    logged = [m for m in caplog.messages if "flight recorder" in m]
    assert len(logged) == 1 and str(path) in logged[0], caplog.messages
    data = json.loads(path.read_text())
    assert data["kind"] == "linerate-flight" and data["rank"] == 5
    g = next(g for g in data["groups"] if g["name"] == "7")
    assert g["ranks"] == [4, 5] and [o["state"] for o in g["ops"]] == ["completed", "failed", "queued"]
    assert flight.rank_path("/a/fr", 3) == "/a/fr.rank3.json"
    assert flight.rank_path("/a/fr.json", 3) == "/a/fr.rank3.json"
    assert flight.rank_path("/a/{rank}/fr", 3) == "/a/3/fr"
    assert flight.awaited_ranks("still waiting for ranks [1, 3] (shared memory; ...)") == [1, 3]


# ----------------------------------------------------------------------------- the analyzer
def _dump(rank: int, ops: list[tuple], ranks=(0, 1, 2)) -> dict:
    """ops: (seq, op, state, started?)."""
    return {"version": 1, "kind": "linerate-flight", "rank": rank, "time": 1.0, "groups": [
        {"name": "0", "desc": "default_pg", "rank": list(ranks).index(rank), "size": len(ranks),
         "ranks": list(ranks), "ops": [
             {"seq": s, "op": op, "desc": "float32[4] op=SUM", "state": st, "queued": 1.0 + s,
              "started": (1.0 + s) if started else None, "ended": None, "error": None,
              "awaited": None} for s, op, st, started in ops]}]}


def _write(tmp_path, dumps: dict[int, dict]) -> list[str]:
    paths = []
    for r, d in dumps.items():
        p = tmp_path / f"fr.rank{r}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    return paths


def test_flight_names_mismatches_stuck_ranks_and_missing_dumps(tmp_path, capsys):
    dumps = {
        0: _dump(0, [(9, "all_reduce", "completed", 1), (10, "all_reduce", "completed", 1),
                     (11, "all_reduce", "failed", 1)], ranks=(0, 1, 2, 3)),
        1: _dump(1, [(9, "all_reduce", "completed", 1), (10, "all_reduce", "started", 1)],
                 ranks=(0, 1, 2, 3)),
        2: _dump(2, [(9, "all_reduce", "completed", 1), (10, "broadcast", "completed", 1),
                     (11, "all_reduce", "failed", 1)], ranks=(0, 1, 2, 3)),
    }
    assert flight_cli.main(["flight", *_write(tmp_path, dumps)]) == 0
    out = capsys.readouterr().out
    assert "no dump from rank 3" in out, out
    assert "MISMATCH at #10: ranks 0, 1 called all_reduce [float32[4] op=SUM]; rank 2 called " \
           "broadcast [float32[4] op=SUM]" in out, out
    assert "all_reduce #11 (group 0): ranks 0, 2 entered; rank 1 never joined — its last op was " \
           "#10, started (still running)" in out, out
    assert "first op that did not complete everywhere: all_reduce #10" in out, out


@pytest.mark.parametrize("content, why", [
    ("{\"version\": 1, \"kind\": \"linerate-fl", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ("{\"version\": 1, \"kind\": \"chrome-trace\"}", "'kind'"),
    ("{\"version\": 99, \"kind\": \"linerate-flight\", \"rank\": 0, \"groups\": []}", "version 99"),
    ("{\"version\": 1, \"kind\": \"linerate-flight\", \"rank\": 0, \"groups\": "
     "[{\"name\": \"0\", \"rank\": 0, \"ranks\": [0], \"ops\": [{\"seq\": \"x\"}]}]}", "'seq'"),
])
def test_malformed_dump_is_named(tmp_path, capsys, content, why):
    good = _write(tmp_path, {0: _dump(0, [(1, "barrier", "completed", 1)])})
    bad = tmp_path / "broken.rank1.json"
    bad.write_text(content)
    assert flight_cli.main(["flight", *good, str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and why in err, err


def test_nothing_to_read_is_named(tmp_path, capsys):
    assert flight_cli.main(["flight", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert flight_cli.main(["flight", str(tmp_path / "empty")]) == 2
    assert "no flight-recorder dump" in capsys.readouterr().err


# ----------------------------------------------------------------------------- torch's control plane
@pytest.mark.timeout(90)
def test_records_served_by_torch_worker_server(tmp_path):
    """torch 2.13's worker server answers /handler/linerate_flight with the records; the
    process exits cleanly (torch aborts at exit if a registered handler is freed late)."""
    code = textwrap.dedent("""
        import json, sys, urllib.request, datetime
        import torch, torch.distributed as dist, linerate
        store = dist.FileStore(sys.argv[1], 1)
        dist.init_process_group("linerate", store=store, rank=0, world_size=1)
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        from torch._C._distributed_c10d import _WorkerServer
        server = _WorkerServer("localhost", 0)
        body = urllib.request.urlopen(f"http://localhost:{server.port}/handler/linerate_flight",
                                      data=b"", timeout=30).read()
        server.shutdown()
        d = json.loads(body)
        print("OPS", [(o["seq"], o["state"]) for o in d["groups"][0]["ops"]], flush=True)
        dist.destroy_process_group()
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OPS [(1, 'completed'), (2, 'completed'), (3, 'completed')]" in out.stdout, out.stdout


@pytest.mark.timeout(90)
def test_torch_flight_recorder_has_no_linerate_entries(tmp_path):
    """torch 2.13's own Flight Recorder (TORCH_FR_BUFFER_SIZE) records Gloo's collectives but
    has no hook for a Python backend (docs/faults.md). If this fails, torch records
    Python backends now: make linerate's entries useful there and update docs/faults.md."""
    code = textwrap.dedent("""
        import json, sys
        import torch, torch.distributed as dist, linerate
        import torch._C._distributed_c10d as c
        if not hasattr(c, "_dump_fr_trace_json"):
            print("NO-FR"); sys.exit(0)
        store = dist.FileStore(sys.argv[1], 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        lr = dist.new_group([0], backend="linerate")
        for g in (None, lr):
            dist.all_reduce(torch.ones(4), group=g)
        names = [e.get("profiling_name") for e in json.loads(c._dump_fr_trace_json()).get("entries", [])]
        print("NAMES", names, flush=True)
        dist.destroy_process_group()
    """)
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    if "NO-FR" in out.stdout:
        pytest.skip("this torch has no _dump_fr_trace_json")
    assert "NAMES ['gloo:all_reduce']" in out.stdout, out.stdout
