"""End to end with a real Prometheus: 4 linerate ranks on loopback export metrics, Prometheus
scrapes them every second, and every query of the Grafana dashboard must return data.

The ranks move traffic of every kind the dashboard shows: all_reduces of 1 to 8 MiB over TCP
(the default group, LINERATE_SHM=0: the byte counters, link rates and utilization), a few over
shared memory (a second group, created with LINERATE_SHM=auto: ``interface="shm"``), then
small all_reduces that one rank enters 20 ms late each time, so that every rank names it as
``linerate_slowest_rank``. LINERATE_SLOW_LOG_S turns the slow-rank watch on for the default
group, which exists before the rank starts its exporter.

Needs the ``prometheus`` binary on PATH (tools/quickstart.sh installs it on CI machines); the
test is skipped without it. Only the standard library talks to Prometheus (urllib).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from _harness import free_port, free_port_range, run_ranks
from test_dashboard import dashboard_exprs

WORLD = 4
TRAFFIC_S = 5.0      # all_reduce loop over TCP
KEEP_ALIVE_S = 3.0   # ranks keep serving /metrics this long after the traffic stopped
SCRAPE_S = 1
RATE_RANGE_S = 15  # the range of the peak-rate check (see there)
SIZES = (1 << 20, 2 << 20, 4 << 20, 8 << 20)  # bytes per all_reduce, cycled
SHM_ITERS, SHM_BYTES = 12, 4 << 20           # all_reduces over shared memory
SLOW_RANK, SLOW_ITERS, SLOW_BYTES = 2, 64, 4096  # the rank entering late, 20 ms each time
SLOW_SLEEP_S = 0.02

PROMETHEUS = shutil.which("prometheus")


# ----------------------------------------------------------------------------- rank side
def _traffic(rank, world_size, lr, base_port, traffic_s, keep_alive_s, api):
    """Serve metrics on base_port + rank; once Prometheus (``api``) holds every rank's TCP byte
    counter, all_reduce over TCP for ``traffic_s`` seconds (rank 0 decides when to stop), then
    over shared memory, then late on SLOW_RANK; then keep serving. Returns what this rank knows
    it did."""
    import torch
    import torch.distributed as dist

    from linerate.transport import metrics

    # The harness gives every rank the same environment (no per-rank LOCAL_RANK), so the
    # exporter is started here rather than through LINERATE_METRICS_PORT.
    metrics.start_exporter(base_port + rank, "127.0.0.1")
    cpu = torch.device("cpu")
    pg = lr._get_backend(cpu)
    # A group's settings are read when it is created: this one shares memory.
    os.environ["LINERATE_SHM"] = "auto"
    shm_group = dist.new_group(backend="linerate")
    shm_pg = shm_group._get_backend(cpu)
    os.environ["LINERATE_SHM"] = "0"
    assert shm_pg._shm is not None, "the second group has no shared segment"
    # The ranks leave together through Gloo (no linerate traffic after the final values):
    # every exporter is then up until the last rank's end plus keep_alive_s.
    hold = dist.new_group(backend="gloo")

    # Prometheus samples every rank's TCP byte counter before the traffic: a rate over the
    # traffic then has a sample on each side of it, also where the loaded host answers the
    # scrapes during the traffic late or not at all (the first sample would otherwise come
    # after most of the traffic, and rate() cannot count what came before a series' first
    # sample). One small all_reduce makes the counters; rank 0 waits for Prometheus; the Gloo
    # barrier releases the others.
    first = torch.ones(1, dtype=torch.float32)
    dist.all_reduce(first, group=lr)
    payload = first.numel() * first.element_size()
    if rank == 0:
        _wait_scraped(api, 'linerate_sent_bytes_total{job="linerate", interface!="shm"}',
                      world_size)
    dist.barrier(group=hold)

    expected = world_size * (world_size + 1) / 2
    deadline = time.monotonic() + traffic_s
    iters = 0
    go = torch.zeros(1, dtype=torch.int32)
    while True:
        nbytes = SIZES[iters % len(SIZES)]
        t = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
        dist.all_reduce(t, group=lr)
        if not bool((t == expected).all()):
            raise AssertionError(f"rank {rank}: wrong all_reduce result in iteration {iters}")
        go.fill_(1 if (rank == 0 and time.monotonic() < deadline) else 0)
        dist.all_reduce(go, group=lr)  # every rank runs the same number of iterations
        iters += 1
        payload += nbytes + go.numel() * go.element_size()
        if int(go.item()) == 0:
            break
    t = torch.empty(SHM_BYTES // 4, dtype=torch.float32)
    for i in range(SHM_ITERS):
        t.fill_(float(rank + 1))
        dist.all_reduce(t, group=shm_group)
        if not bool((t == expected).all()):
            raise AssertionError(f"rank {rank}: wrong shared-memory all_reduce result ({i})")
        payload += SHM_BYTES
    small = torch.ones(SLOW_BYTES // 4, dtype=torch.float32)
    for _ in range(SLOW_ITERS):
        if rank == SLOW_RANK:
            time.sleep(SLOW_SLEEP_S)
        dist.all_reduce(small, group=lr)
        payload += SLOW_BYTES
    dist.barrier(group=lr)
    end = time.time()
    time.sleep(keep_alive_s)  # a few scrapes of the final values
    dist.barrier(group=hold)
    stats = pg.connection_stats() + shm_pg.connection_stats()
    sent = sum(c["sent_bytes"] for c in stats if c["local"] != "shm")
    shm_sent = sum(c["sent_bytes"] for c in stats if c["local"] == "shm")
    return {"rank": rank, "sent": sent, "shm_sent": shm_sent, "iters": iters, "payload": payload,
            "end": end, "report": pg.slow_report()}


# ----------------------------------------------------------------------------- helpers
def _wait_scraped(api: str, series: str, ranks: int, timeout: float = 30.0) -> None:
    """Until Prometheus holds a sample of ``series`` from each of ``ranks`` ranks."""
    expr = f"count(count by (rank) ({series}))"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, AssertionError):  # not up yet, or a bad answer
            result = _query(api, expr, time.time())
            if result and float(result[0]["value"][1]) >= ranks:
                return
        time.sleep(0.2)
    raise AssertionError(f"Prometheus held no sample of {series} from {ranks} ranks after "
                         f"{timeout:.0f} s: {_targets_report(api)}")


def _scrapes(api: str, at: float, window: int) -> str:
    """Every scrape of the last ``window`` seconds before ``at``, per target: the seconds
    before ``at`` and whether it succeeded (``up``), for a failure's message."""
    with contextlib.suppress(Exception):
        q = urllib.parse.urlencode({"query": f'up{{job="linerate"}}[{window}s]',
                                    "time": f"{at:.3f}"})
        doc = _get(f"{api}/api/v1/query?{q}")
        return "scrapes (s before the end: up): " + "; ".join(
            f"{m['metric'].get('instance')}: "
            + " ".join(f"{at - float(t):.1f}:{v}" for t, v in m["values"])
            for m in doc["data"]["result"])
    return "(no scrape report)"


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _query(api: str, expr: str, at: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    try:
        doc = _get(f"{api}/api/v1/query?{q}")
    except urllib.error.HTTPError as e:  # 400 with Prometheus' own message on a bad expr
        raise AssertionError(f"{expr!r}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    assert doc["status"] == "success", doc
    assert doc["data"]["resultType"] == "vector", doc
    return doc["data"]["result"]


def _substitute(expr: str) -> str:
    """Grafana's variables as the dashboard would send them for this job."""
    expr = expr.replace("$__rate_interval", "5s").replace("$__interval", "1s")
    expr = expr.replace("${datasource}", "prometheus")
    expr = re.sub(r"\$job\b", "linerate", expr)
    return re.sub(r"\$host\b", ".*", expr)


def _wait_ready(api: str, proc: subprocess.Popen, log_path: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{api}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready after {timeout}s")


def _targets_report(api: str) -> str:
    with contextlib.suppress(Exception):
        doc = _get(f"{api}/api/v1/targets")
        return "; ".join(f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}"
                         for t in doc["data"]["activeTargets"])
    return "(no target report)"


# ----------------------------------------------------------------------------- the test
@pytest.mark.skipif(PROMETHEUS is None,
                    reason="prometheus is not on PATH (tools/quickstart.sh installs it; "
                           "Debian/Ubuntu: apt-get install prometheus)")
@pytest.mark.timeout(180)  # a hang (Prometheus or the ranks never answering); usually ~30 s
def test_dashboard_queries_against_real_prometheus(tmp_path):
    base = free_port_range(WORLD)
    prom_port = free_port()
    api = f"http://127.0.0.1:{prom_port}"
    targets = ", ".join(f'"127.0.0.1:{base + r}"' for r in range(WORLD))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_S}s\n"
        f"  evaluation_interval: {SCRAPE_S}s\n"
        "scrape_configs:\n"
        "  - job_name: linerate\n"
        f"    scrape_interval: {SCRAPE_S}s\n"
        f"    scrape_timeout: {SCRAPE_S}s\n"
        "    static_configs:\n"
        f"      - targets: [{targets}]\n")
    log_path = str(tmp_path / "prometheus.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(api, proc, log_path)
        env = {"LINERATE_LINK_CAPACITY": "10gbit",  # loopback reports no speed
               "LINERATE_METRICS_WINDOW": "1",
               "LINERATE_SHM": "0",  # the default group over TCP (the second one: shm)
               "LINERATE_SLOW_LOG_S": "60"}  # watch the default group's ranks and links
        results = run_ranks(_traffic, WORLD, base, TRAFFIC_S, KEEP_ALIVE_S, api, timeout=75,
                            env=env, backend="linerate")
        # Evaluate while every exporter was still up (each rank served until the last one's
        # end plus KEEP_ALIVE_S: the Gloo barrier), after the final values were scraped twice.
        at = max(r["end"] for r in results) + KEEP_ALIVE_S - 0.4
        assert KEEP_ALIVE_S - 0.4 >= 2 * SCRAPE_S
        iters = {r["iters"] for r in results}
        assert len(iters) == 1, results
        n_iters = iters.pop()
        assert n_iters >= 4, f"only {n_iters} iterations in {TRAFFIC_S}s"

        # (a) every query of the dashboard returns at least one series
        empty = []
        for title, expr in dashboard_exprs():
            promql = _substitute(expr)
            if not _query(api, promql, at):
                empty.append(f"{title}: {promql}")
        assert not empty, ("dashboard queries without data:\n  " + "\n  ".join(empty)
                           + f"\ntargets: {_targets_report(api)}")

        # (b) the exported byte counters are the transport's own, over TCP and shared memory
        for interface, key in (('interface!="shm"', "sent"), ('interface="shm"', "shm_sent")):
            series = _query(api, f'sum by (rank) (linerate_sent_bytes_total'
                                 f'{{job="linerate", {interface}}})', at)
            exported = {int(s["metric"]["rank"]): float(s["value"][1]) for s in series}
            assert sorted(exported) == list(range(WORLD)), (interface, series,
                                                           _targets_report(api))
            for r in results:
                assert r[key] > 0, (key, r)
                assert math.isclose(exported[r["rank"]], r[key], rel_tol=0.01), \
                    f"rank {r['rank']} {interface}: exported {exported[r['rank']]:.0f} B, " \
                    f"transport counted {r[key]} B"

        # collectives: the histogram counted every all_reduce, the bytes counter their sizes
        series = _query(api, 'sum by (rank) (linerate_collective_seconds_count'
                             '{job="linerate", op="all_reduce"})', at)
        counts = {int(s["metric"]["rank"]): float(s["value"][1]) for s in series}
        want = 1.0 + 2.0 * n_iters + SHM_ITERS + SLOW_ITERS
        assert counts == {r: want for r in range(WORLD)}, counts
        series = _query(api, 'sum by (rank) (linerate_collective_bytes_total'
                             '{job="linerate", op="all_reduce"})', at)
        op_bytes = {int(s["metric"]["rank"]): float(s["value"][1]) for s in series}
        assert op_bytes == {r["rank"]: float(r["payload"]) for r in results}, op_bytes

        # (c) the send rate over the run is plausible
        moved = sum(r["sent"] for r in results)
        window = int(TRAFFIC_S + KEEP_ALIVE_S + 20)
        (peak,) = _query(api, f'max_over_time(sum(rate(linerate_sent_bytes_total'
                              f'{{job="linerate", interface!="shm"}}[{RATE_RANGE_S}s]))'
                              f'[{window}s:1s])', at)
        peak_rate = float(peak["value"][1])
        assert 0 < peak_rate < moved / 1.0, (peak_rate, moved, _scrapes(api, at, window))
        # the busiest RATE_RANGE_S held a good part of the traffic: the peak is not far below
        # the average. Prometheus sampled the counters before the traffic (_traffic), and the
        # range spans the traffic three times over, so that scrapes a loaded host answers late
        # (1 s timeout) or not at all during the traffic still leave a sample on each side.
        assert peak_rate > 0.1 * moved / TRAFFIC_S, (peak_rate, moved, _scrapes(api, at, window))

        # (d) the interface kinds panel saw both kinds move bytes
        kinds = next(e for t, e in dashboard_exprs() if t == "Bytes/s per interface kind")  # tx
        series = _query(api, f"max_over_time(({_substitute(kinds)})[{window}s:1s])", at)
        peaks = {s["metric"]["kind"]: float(s["value"][1]) for s in series}
        assert peaks.get("shm", 0) > 0 and peaks.get("tcp", 0) > 0, peaks

        # (e) every rank names the late rank, in Prometheus as in its own report
        series = _query(api, 'linerate_slowest_rank{job="linerate"}', at)
        named = {int(s["metric"]["rank"]): float(s["value"][1]) for s in series}
        reports = {r["rank"]: r["report"] for r in results}
        assert named == {r: float(SLOW_RANK) for r in range(WORLD)}, (named, reports)
        assert all(rep["slowest"] == SLOW_RANK for rep in reports.values()), reports
        series = _query(api, 'linerate_rank_late_ratio{job="linerate"}', at)
        shares = {(int(s["metric"]["rank"]), int(s["metric"]["late_rank"])): float(s["value"][1])
                  for s in series}
        assert all(shares.get((r, SLOW_RANK), 0) >= 0.5 for r in range(WORLD)), shares
        series = _query(api, 'sum by (peer) (linerate_peer_wait_seconds_total{job="linerate"})', at)
        waited = {int(s["metric"]["peer"]): float(s["value"][1]) for s in series}
        # the others waited for the late rank at least most of its sleeps, all together
        assert waited.get(SLOW_RANK, 0) > 0.5 * SLOW_ITERS * SLOW_SLEEP_S, waited
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
