"""The soak benchmark (tools/dev/soak.py) at CI size: 2 local ranks, 300 random collectives, every
result checked, no wrong result and no leaked descriptor; and its checker does catch a wrong
result (exit code 1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from linerate.tools.dev.soak import OPS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _soak(*argv, timeout=80):
    return subprocess.run([sys.executable, "-m", "linerate.tools.dev.soak", "--nproc", "2", "--progress", "0",
                           "--run-timeout", str(timeout - 10), *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(100)
def test_soak_300_ops_two_ranks(tmp_path):
    out = tmp_path / "soak.json"
    p = _soak("--ops", "300", "--seed", "20240601", "--max-bytes", str(1 << 20),
              "--json", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ops"] == 300 and s["world"] == 2
    assert s["mismatches"] == 0, s
    assert sum(o["count"] for o in s["per_op"].values()) == 300
    assert {k.split()[0] for k in s["per_op"]} == set(OPS)  # every kind of op ran
    for r in s["ranks"]:
        assert r["mismatches"] == 0
        assert r["fds_growth"] <= 1, f"rank {r['rank']} leaked descriptors: {r}"
    assert "0 mismatches" in p.stdout


@pytest.mark.timeout(100)
def test_soak_reports_a_wrong_result_and_fails():
    p = _soak("--ops", "30", "--seed", "7", "--warmup", "5", "--corrupt-op", "11")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "WRONG RESULT in op #11" in p.stderr
    assert "1 mismatches" in p.stdout
