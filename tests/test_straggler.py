"""The slow rank is named, from every rank's view, by every rank (collectives/straggler.py).

- decide(): a late rank, a rank that merely finishes first (no peer waited for it), ring-like
  views where only the late rank's successor waits for it, too few collectives; parse()
  refuses what is not a view.
- One host, 4 ranks (shared memory and TCP): one rank, chosen at random, sleeps 20 ms before
  each all_reduce (a slow data loader); within 20 collectives every rank's report and its
  exported metrics name it, and the flight records (linerate flight) name it too.
- A balanced run of 2,000 all_reduces (1 MB, a DDP bucket) names nobody.
- netlab, 4 hosts x 2 rails at 200 Mbit/s (conftest's lab_4x2): a slowed rank is named
  between hosts; the balanced run between hosts, naming nobody, is the balanced case of
  tests/test_slowlink.py's netlab test (one run on the same lab checks links and ranks).
"""
from __future__ import annotations

import json
import random

import pytest

from _harness import run_netlab_script, run_ranks
from linerate.collectives import straggler
from linerate.collectives.straggler import decide, encode, parse

needs_netlab = pytest.mark.netlab

LATE = 0.005


def _views(durations: dict[int, list[float]], waits: dict[int, list[dict]]) -> dict:
    return {r: [(s, d, waits.get(r, [{}] * len(ds))[s]) for s, d in enumerate(ds)]
            for r, ds in durations.items()}


# ----------------------------------------------------------------------------- decide
def test_a_late_rank_is_named_by_its_waiting_peers():
    n = 20
    durs = {0: [0.030] * n, 1: [0.031] * n, 2: [0.010] * n, 3: [0.029] * n}
    # everybody waited ~20 ms for rank 2's first contribution
    waits = {r: [{2: 0.02}] * n for r in (0, 1, 3)}
    v = decide(_views(durs, waits), 4, LATE)
    assert v["slowest"] == 2 and v["collectives"] == n
    count, mean = v["late"][2]
    assert count == n and mean == pytest.approx(0.021)
    assert straggler.describe(2, count, n, mean) == \
        "rank 2 entered last in 100% of the last 20 collectives, 21.0 ms late on average"
    # its own lateness, relative to the first rank in: the skew histogram's samples
    assert v["skew"][2][0] == pytest.approx(0.021) and v["skew"][1][0] == 0


def test_only_the_successor_waits_in_a_ring():
    n = 12
    durs = {0: [0.025] * n, 1: [0.026] * n, 2: [0.024] * n, 3: [0.004] * n}
    waits = {0: [{3: 0.02}] * n}  # rank 3's successor
    assert decide(_views(durs, waits), 4, LATE)["slowest"] == 3


def test_finishing_first_is_not_entering_last():
    """Durations alone would name rank 1 (a large op's last steps end earlier on it): no peer
    waited for its first contribution, so nobody is named."""
    n = 30
    durs = {0: [0.5] * n, 1: [0.4] * n, 2: [0.5] * n}
    v = decide(_views(durs, {}), 3, LATE)
    assert v["slowest"] is None and v["late"] == {}


def test_balanced_and_sparse_views_name_nobody():
    rng = random.Random(1)
    n = 64
    durs = {r: [0.001 + rng.random() * 0.002 for _ in range(n)] for r in range(4)}
    assert decide(_views(durs, {}), 4, LATE)["slowest"] is None
    # too few collectives in common
    durs = {0: [0.03] * 5, 1: [0.01] * 5}
    waits = {0: [{1: 0.02}] * 5}
    v = decide(_views(durs, waits), 2, LATE)
    assert v["slowest"] is None and v["late"][1][0] == 5
    assert decide(_views(durs, waits), 2, LATE, min_ops=5)["slowest"] == 1
    # late in a minority of collectives: not the slowest
    n = 20
    durs = {0: [0.03 if i % 4 == 0 else 0.002 for i in range(n)], 1: [0.002] * n}
    waits = {0: [{1: 0.028} if i % 4 == 0 else {} for i in range(n)]}
    assert decide(_views(durs, waits), 2, LATE)["slowest"] is None
    # a view missing: no verdict
    assert decide({0: []}, 2, LATE)["slowest"] is None


def test_views_round_trip_and_junk_is_refused():
    ops = [(7, 0.0123, {1: 0.004}), (9, 0.001, {})]  # no record of 8
    raw = encode("h1", ops, None).encode()
    v = parse(raw, 4)
    assert v.host == "h1" and v.links is None and (v.s0, v.d) == (7, [12300, -1, 1000])
    assert v.ops(0, 100) == [(7, 0.0123, {1: 0.004}), (9, 0.001, {})]
    assert v.ops(8, 10) == [(9, 0.001, {})]
    other = parse(encode("h2", [(8, 0.002, {}), (9, 0.002, {}), (10, 0.001, {})], [1]).encode(), 4)
    assert straggler.common({0: v, 1: other}) == (8, 10) and other.links == [1]
    assert parse(encode("h", [], None).encode(), 4).ops(0, 10) == []
    ok = {"v": 2, "host": "h", "s0": 5, "d": [1, 2], "w": [[5, 1, 3]], "links": None}
    assert parse(json.dumps(ok).encode(), 4).waits == {5: {1: 3e-6}}
    for bad in ({"v": 1}, {"host": 3}, {"s0": 1.5}, {"d": [1, -2]}, {"d": [True]},
                {"d": [0] * (straggler.HISTORY + 1)}, {"w": [[5, 9, 1]]},  # peer 9 of 4
                {"w": [[7, 1, 1]]},  # a seq the view does not hold
                {"w": [[5, 1, -1]]}, {"w": [[5, 1]]}, {"d": "12"}):
        assert parse(json.dumps({**ok, **bad}).encode(), 4) is None, bad
    for bad in (b"", b"\xff", b"[]", b"x" * (straggler._MAX_VIEW + 1)):
        assert parse(bad, 4) is None, bad


# ----------------------------------------------------------------------------- one host
def _slowed(rank, world, lr, slow, n, nbytes, dump):
    import time

    import torch
    import torch.distributed as dist
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    import linerate
    from linerate.transport import metrics

    pg = lr._get_backend(torch.device("cpu"))
    torch.set_num_threads(1)  # the fill and check below: four ranks on the machine's cores
    t = torch.empty(max(1, nbytes // 4))
    want = world * (world + 1) // 2  # every sum exact in float32
    named_at, wrong, decided, bad_sums = None, [], 0, []
    for i in range(n):
        t.fill_(rank + 1)
        if rank == slow:
            time.sleep(0.02)
        dist.all_reduce(t, group=lr)
        if not bool((t == want).all()):
            bad_sums.append(i)
        rep = pg.slow_report()
        got = rep["slowest"]
        decided = max(decided, rep["collectives"])
        if got is not None and got != slow:
            wrong.append((i, got))
        if named_at is None and got == slow:
            named_at = i + 1
    assert not bad_sums, f"rank {rank}: wrong all_reduce results in collectives {bad_sums[:10]}"
    exported = {}
    text = generate_latest(metrics.REGISTRY).decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("linerate_slowest_rank", "linerate_peer_wait_seconds_total"):
                exported.setdefault(s.name, {})[s.labels.get("peer", "")] = s.value
    dist.barrier(group=lr)
    path = linerate.dump_flight(dump) if dump else None
    rep = pg.slow_report()
    return {"named_at": named_at, "wrong": wrong, "report": rep, "exported": exported,
            "dump": path, "text": text, "decided": decided}


def _check_named(results, slow, within=20):
    from linerate.tools import top
    # linerate top, from every rank's /metrics text after the 30 collectives
    frame = top.compute_frame(None, [top.Scrape(f"http://h:{9400 + r}/metrics", 1.0,
                                                samples=top.parse_metrics(res["text"]))
                                     for r, res in enumerate(results)])
    assert frame["late_rank"]["rank"] == slow, frame["late_rank"]
    assert f"SLOW RANK  rank {slow} entered last in" in top.render(frame)
    for r, res in enumerate(results):
        assert not res["wrong"], (r, res["wrong"])
        assert res["named_at"] is not None and res["named_at"] <= within, (r, res)
        assert res["exported"]["linerate_slowest_rank"][""] == slow, (r, res["exported"])
        text = res["report"]["text"]
        assert text.startswith(f"rank {slow} entered last in "), text
        if r != slow:  # its peers waited for it longest
            waited = res["exported"]["linerate_peer_wait_seconds_total"]
            assert max(waited, key=waited.get) == str(slow), (r, waited)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
def test_a_slowed_rank_is_named_on_one_host(shm, tmp_path):
    slow = random.Random().randrange(4)
    results = run_ranks(_slowed, 4, slow, 30, 4096, str(tmp_path / "fr"), timeout=90,
                        env={"LINERATE_SHM": shm, "LINERATE_SLOW_LOG_S": "60"})
    print(f"slowed rank {slow}: named after",
          [r["named_at"] for r in results], "collectives;", results[0]["report"]["text"])
    _check_named(results, slow)
    # The flight records say the same (linerate flight).
    from linerate.tools import flight as tool
    dumps = [(r["dump"], tool.load(r["dump"])) for r in results]
    g = tool.analyze(dumps)["groups"][0]
    assert g["late"]["slowest"] == slow, g["late"]
    assert f"rank {slow} entered last in" in tool.report(tool.analyze(dumps))


@pytest.mark.timeout(360)  # a hang: 4 ranks' collectives crawl on a loaded 2-core machine
def test_a_balanced_run_names_nobody():
    """No rank is slowed: over 600 collectives (several windows) nobody is named. A loaded
    machine delays one rank or another by a few milliseconds at random (four ranks and other
    work on two cores), and where one rank shares its core it is late in turn after turn:
    LINERATE_SLOW_RANK_MS=50 counts only lateness that no scheduling delay reaches."""
    results = run_ranks(_slowed, 4, -1, 600, 1 << 20, "", timeout=300,
                        env={"LINERATE_SLOW_LOG_S": "60", "LINERATE_SLOW_RANK_MS": "50"})
    for r, res in enumerate(results):
        assert res["named_at"] is None and not res["wrong"], (r, res)
        assert res["decided"] >= straggler.MIN_OPS, res  # views were compared
        assert res["exported"]["linerate_slowest_rank"][""] == -1


# ----------------------------------------------------------------------------- netlab
NETLAB_SCRIPT = r'''
import json, os, time
import torch
import torch.distributed as dist
dist.init_process_group("linerate")
rank, P = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD._get_backend(torch.device("cpu"))
slow, n = int(os.environ["SLOW"]), int(os.environ["N"])
t = torch.ones(int(os.environ["NB"]) // 4)
named_at, wrong, decided = None, [], 0
for i in range(n):
    if rank == slow:
        time.sleep(0.02)
    dist.all_reduce(t)
    rep = pg.slow_report()
    got = rep["slowest"]
    decided = max(decided, rep["collectives"])
    if got is not None and got != slow:
        wrong.append([i, got])
    if named_at is None and got == slow:
        named_at = i + 1
dist.barrier()
rep = pg.slow_report()
print("SLOW", rank, json.dumps({"named_at": named_at, "wrong": wrong, "text": rep["text"],
                               "n": decided}), flush=True)
dist.destroy_process_group()
'''


@needs_netlab
@pytest.mark.timeout(150)
def test_a_slowed_rank_is_named_between_hosts(lab_4x2, tmp_path):
    slow = random.Random().randrange(4)
    res, out = run_netlab_script(lab_4x2.name, tmp_path, NETLAB_SCRIPT, None, "SLOW",
                                 env={"SLOW": str(slow), "N": "30", "NB": str(1 << 20),  # a DDP bucket
                                      "LINERATE_SLOW_LOG_S": "60"})
    assert res.returncode == 0 and sorted(out) == [0, 1, 2, 3], res.stdout[-3000:] + res.stderr[-3000:]
    print(f"slowed rank {slow}:", {r: o["named_at"] for r, o in out.items()}, out[0]["text"])
    for r, o in out.items():
        assert not o["wrong"] and o["named_at"] is not None and o["named_at"] <= 20, (r, o)


def test_the_log_line_names_the_rank_and_link_at_most_once_per_period(caplog, monkeypatch):
    import logging
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    w = straggler.Watch(store, "t", 0, 4, [10, 11, 12, 13], "h0", 5.0, 60.0, group="g")
    w.close()
    v = {"collectives": 64, "late": {2: (60, 0.0382)}, "slowest": 2, "hosts": {2: "h2"},
         "links": [{"evidence": "slow link: host h3 eth1 (rail 1): 2 of 2 connections"}]}
    clock = [1000.0]
    monkeypatch.setattr(straggler.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="linerate"):
        w._log(v)
        clock[0] += 30
        w._log(v)  # within the period: nothing
        clock[0] += 31
        w._log({**v, "slowest": None, "links": []})  # nothing to say
        w._log(v)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == 2 * ["linerate (group g): rank 12 entered last in 94% of the last 64 "
                         "collectives, 38.2 ms late on average (host h2); slow link: host h3 "
                         "eth1 (rail 1): 2 of 2 connections"]
    # the report speaks global ranks
    w.verdict = {**v, "late": {2: (60, 0.0382)}}
    rep = w.report()
    assert rep["slowest"] == 12 and rep["late"] == {12: {"share": 60 / 64, "mean_s": 0.0382}}
    assert set(rep["waited"]) == {11, 12, 13}
