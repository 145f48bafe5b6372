"""`linerate bench`: the CLI, the check data of each collective, and real runs on loopback."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linerate.tools import bench, bench_worker, cli
from linerate.tools.bench_ops import OPS, element_count
from linerate.tools.bench_report import Result, Row, Table

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*argv, timeout=110, extra_env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "linerate.tools.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(stdout: str) -> list[list[list[str]]]:
    """Data rows of the table, each split into its |-separated blocks of fields."""
    return [[block.split() for block in line.split("|")]
            for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


# ---------------------------------------------------------------------------- CLI surface
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip().startswith("linerate ")


def test_unknown_op_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--ops", "all_reduce,allreduce"])
    assert e.value.code == 2
    assert "unknown op(s) allreduce" in capsys.readouterr().err


def test_sizes_and_rank_argv():
    args = cli.build_parser().parse_args(
        ["bench", "--nproc", "3", "--min-bytes", "1K", "--max-bytes", "1M", "--factor", "8",
         "--ops", "broadcast", "--check"])
    assert bench.sizes(args.min_bytes, args.max_bytes, args.factor) == [1024, 8192, 65536, 524288]
    argv = bench.rank_argv(args)
    assert "--nproc" not in argv and "--check" in argv
    again = cli.build_parser().parse_args(["bench", *argv])
    assert vars(again) | {"nproc": 3} == vars(args)


def test_op_names_match():
    assert set(OPS) == set(bench.OP_NAMES)


# ---------------------------------------------------------------------------- check data
def _simulate(name, inputs, world, rank):
    """What a correct collective leaves in rank's output, given every rank's input."""
    if name == "all_reduce":
        return sum(inputs)
    if name == "all_gather":
        return torch.cat(inputs)
    if name == "reduce_scatter":
        return sum(inputs).chunk(world)[rank]
    if name == "broadcast":
        return inputs[0]
    return torch.cat([inp.chunk(world)[rank] for inp in inputs])  # all_to_all


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_expected_results(name, world, dtype):
    op = OPS[name]
    count = element_count(op, 1000, 1, world)
    inputs = [op.buffers(count, dtype, r, world)[0].clone() for r in range(world)]
    for rank in range(world):
        out = _simulate(name, inputs, world, rank).to(dtype).clone()
        assert op.count_wrong(out, count, rank, world) == 0
        out[1] += 1
        assert op.count_wrong(out, count, rank, world) == 1


def test_bus_factors():
    assert OPS["all_reduce"].bus_factor(4) == 1.5
    assert OPS["all_gather"].bus_factor(4) == OPS["reduce_scatter"].bus_factor(4) == 0.75
    assert OPS["all_to_all"].bus_factor(4) == 0.75
    assert OPS["broadcast"].bus_factor(4) == 1.0
    assert element_count(OPS["all_gather"], 1000, 4, 3) == 249
    assert element_count(OPS["all_reduce"], 1000, 4, 3) == 250


def test_table_row_and_ratio():
    row = Row("all_reduce", 4096, 1024, "float32",
              [Result.from_time(4096, 1.0, 1e-3, 10, 0), Result.from_time(4096, 1.0, 2e-3, 10, 0)])
    assert row.ratio == pytest.approx(2.0)
    line = Table(["linerate", "gloo"], check=True).row(row)
    assert [b.split() for b in line.split("|")] == [
        ["4096", "1024", "float32", "all_reduce"], ["1000.0", "0.004", "0.004", "0"],
        ["2000.0", "0.002", "0.002", "0"], ["2.00"]]


def test_link_deltas():
    before = [{"peer": 1, "connection": 0, "local": "a", "remote": "b", "sent_bytes": 10,
               "received_bytes": 5}]
    after = [dict(before[0], sent_bytes=110, received_bytes=55),
             {"peer": 1, "connection": 1, "local": "a", "remote": "c", "sent_bytes": 80,
              "received_bytes": 40}]
    [link] = bench_worker._link_deltas(before, after)
    assert (link["peer"], link["sent_bytes"], link["received_bytes"]) == (1, 180, 90)
    assert [c["sent_bytes"] for c in link["connections"]] == [100, 80]


def test_linerate_unavailable_is_reported(monkeypatch):
    def fail(name):
        raise ImportError("no module named linerate.collectives")
    monkeypatch.setattr(bench_worker.importlib, "import_module", fail)
    ok, reason = bench_worker._linerate_available()
    assert not ok and "import linerate.collectives failed" in reason


# ---------------------------------------------------------------------------- real runs
def _check_run(proc, json_path, labels, ops, sizes, world):
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"world size {world}" in out and "torch " in out
    header = [line for line in out.splitlines() if "time(us)" in line]
    assert len(header) == 1
    assert header[0].count("algbw(GB/s)") == header[0].count("busbw(GB/s)") == len(labels)
    assert "#wrong" in header[0] and "ratio" in header[0]
    rows = table_rows(out)
    assert [(r[0][3], int(r[0][0])) for r in rows] == [(op, s) for op in ops for s in sizes]
    for r in rows:
        assert len(r) == len(labels) + 2  # left block, one per backend, ratio
        for block in r[1:-1]:
            time_us, algbw, busbw, wrong = map(float, block)
            assert time_us > 0 and busbw >= 0 and wrong == 0  # 3 decimals: small sizes show 0
    for label in labels:
        assert f"# avg bus bandwidth  {label} " in out
    assert "# check: all results correct" in out

    doc = json.loads(Path(json_path).read_text())
    assert doc["world_size"] == world
    assert [b["label"] for b in doc["backends"]] == labels
    assert len(doc["results"]) == len(rows)
    for res in doc["results"]:
        factor = OPS[res["op"]].bus_factor(world)
        for fig in res["backends"].values():
            assert fig["busbw_gbps"] == pytest.approx(fig["algbw_gbps"] * factor)
            assert fig["busbw_gbps"] > 0 and fig["iters"] >= 2 and fig["wrong"] == 0
        assert res["ratio"] > 0
    assert set(doc["avg_busbw_gbps"]) == set(labels)
    return doc


@pytest.mark.timeout(120)
def test_bench_gloo_vs_gloo(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--nproc", "2", "--ops", "all_reduce,broadcast", "--min-bytes", "1K",
                   "--max-bytes", "64K", "--backends", "gloo,gloo", "--check", "--json", str(out))
    doc = _check_run(proc, out, ["gloo", "gloo#2"], ["all_reduce", "broadcast"],
                     [1024, 4096, 16384, 65536], 2)
    assert doc["links"] == []


@pytest.mark.timeout(120)
def test_bench_linerate_vs_gloo(tmp_path):
    out = tmp_path / "bench.json"
    ops = list(bench.OP_NAMES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli("bench", "--nproc", "2", "--ops", ",".join(ops), "--min-bytes", "4K",
                   "--max-bytes", "64K", "--iters", "5", "--warmup", "1", "--backends",
                   "linerate,gloo", "--check", "--json", str(out), "--metrics-port", str(port),
                   extra_env={"LINERATE_SHM": "0"})  # TCP: the link table below has bytes
    doc = _check_run(proc, out, ["linerate", "gloo"], ops, [4096, 16384, 65536], 2)
    # --metrics-port: every rank served metrics; rank 0 prints where, and a sample.
    assert f"linerate top localhost:{port}-{port + 1}" in proc.stdout, proc.stdout
    assert '#   linerate_info{' in proc.stdout
    assert 'linerate_bus_bandwidth_bytes_per_second{host=' in proc.stdout
    assert doc["backends"][0]["actual"] == "linerate"
    for entry in doc["links"]:  # present when the linerate group has connection_stats()
        assert entry["label"] == "linerate"
        assert sum(link["sent_bytes"] for link in entry["links"]) > 0


@pytest.mark.timeout(120)
def test_timeout_reaps_every_rank():
    proc = run_cli("bench", "--nproc", "2", "--ops", "all_reduce", "--min-bytes", "16M",
                   "--max-bytes", "16M", "--iters", "100000", "--backends", "gloo",
                   "--timeout", "3")
    assert proc.returncode != 0
    assert "timed out after 3 s" in proc.stderr
    assert "stopping all ranks" in proc.stderr


def test_link_table_says_when_the_ranks_share_memory():
    from linerate.tools.bench_report import link_lines
    entry = {"rank": 0, "busy_s": 1.0, "links": [
        {"peer": 1, "sent_bytes": 0, "received_bytes": 0,
         "connections": [{"sent_bytes": 0}, {"sent_bytes": 0}]}]}
    shm = link_lines("linerate", [dict(entry, shared_memory=True), dict(entry, rank=1, shared_memory=True)])
    assert "share memory (LINERATE_SHM)" in shm[-1] and "LINERATE_SHM=0" in shm[-1]
    tcp = link_lines("linerate", [dict(entry, shared_memory=False), dict(entry, rank=1, shared_memory=True)])
    assert not any("share memory" in line for line in tcp)
    assert all(line.startswith("#") for line in shm + tcp)


def test_decent_bench_rejects_an_unknown_topology_before_starting_ranks(capsys):
    from linerate.tools.dev import decent_bench
    assert decent_bench.main(["--nproc", "2", "--topology", "aer-average-p2p"]) == 2
    err = capsys.readouterr().err
    assert "unknown topology 'aer-average-p2p'" in err and "aer-average" in err and "decp2p" in err
