"""tools/dev/gpu_check.py: the one command a GPU host runs.

Its ``--cpu`` mode runs every step (host, correctness, staging, DDP, unit tier, scaling) with
CPU tensors, the pipelined staging on the stand-in copier, few ranks and small sizes, from a
checkout with a Python that has torch but not linerate installed, as on a GPU host: the check
cannot rot between GPU hosts. The section it writes into docs/performance.md is rendered by
perf_report's section code, and is checked here from a GPU run's JSON too."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linerate.tools.dev import gpu_check as gc
from linerate.tools.dev import perf_report as pr

ROOT = Path(__file__).resolve().parents[1]


def _python_without_linerate(tmp_path: Path) -> Path:
    """A virtual environment whose site-packages are this one's (torch, numpy, pytest), less
    linerate's install (the editable finder and its metadata, hence no torch entry point)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    shelf = tmp_path / "site"
    shelf.mkdir()
    for here in site.getsitepackages():   # this venv's, then the ones it shares
        for entry in Path(here).iterdir():
            if ("linerate" in entry.name or entry.suffix == ".pth"
                    or (shelf / entry.name).exists()):
                continue
            (shelf / entry.name).symlink_to(entry)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
    Path(purelib, "shelf.pth").write_text(str(shelf) + "\n")
    return py


@pytest.mark.timeout(240)
def test_cpu_mode_runs_every_step_from_a_checkout_without_an_install(tmp_path):
    py = _python_without_linerate(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("LINERATE_")}
    probe = subprocess.run([str(py), "-c", "from importlib.util import find_spec as f; "
                            "print(f('torch') is not None, f('linerate') is None)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["True", "True"], probe.stderr[-2000:]   # torch, no linerate
    page = tmp_path / "performance.md"
    page.write_text((ROOT / "docs" / "performance.md").read_text())
    before = pr.parse_sections(page.read_text())
    out = tmp_path / "out"
    t0 = time.monotonic()
    p = subprocess.run([str(py), str(ROOT / "tools" / "dev" / "gpu_check.py"), "--cpu", "--out",
                        str(out), "--docs", str(page)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=230)
    took = time.monotonic() - t0
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}\n{log[-4000:]}"
    data = json.loads((out / "gpu_check.json").read_text())
    steps = data["steps"]
    assert list(steps) == ["host", "correctness-2", "staging-2", "ddp", "scale-2", "unit"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    corr = steps["correctness-2"]["result"]
    assert corr["failed"] == [] and corr["checks"] > 300
    assert corr["pipelined"]["ops"] > 0 and corr["long_kernel"]["pipelined"] is True
    ddp = steps["ddp"]["result"]
    assert ddp["equal"] and ddp["bitwise"] and ddp["replicas_agree"]
    assert ddp["staging"]["cpu"]["ops"] > 0
    # where a linerate step goes: without communication, and every bucket pipelined
    assert set(ddp["step_ms"]) == {"linerate", "gloo", "linerate pipelined",
                                   "linerate no communication"}
    assert all(v > 0 for v in ddp["step_ms"].values())
    if "stand-in" in ddp["model"]:
        assert "stand-in CNN" in p.stdout
    speed = steps["staging-2"]["result"]
    assert {r["variant"] for r in speed["rows"]} == {"cuda pipelined", "cuda whole", "cuda gloo",
                                                     "cpu linerate", "cpu gloo"}
    assert all(r.get("busbw") for r in speed["rows"]) and speed["staging"]["cpu"]["ops"] > 0
    scale = steps["scale-2"]["result"]
    assert [(r["transport"], r["connections"]) for r in scale["rows"]] == \
        [("shm", None), ("tcp", 1), ("tcp", 2)]
    assert all(r.get("linerate_busbw") and r.get("gloo_busbw") for r in scale["rows"])
    assert scale["latency"]["linerate"]["median_us"] > 0
    assert steps["unit"]["result"]["counts"] == {"passed": 1}
    # the section: in the page, beside the others, and in DIR
    after = pr.parse_sections(page.read_text())
    assert set(after) == set(before) | {"gpu"}
    assert all(after[k] == v for k, v in before.items() if k != "gpu")
    assert (out / "performance-gpu.md").read_text() == after["gpu"]
    assert f"| 2 | {corr['checks']} | 0 | {corr['pipelined']['ops']} (" in after["gpu"]
    assert "Where a linerate DDP step goes: " in after["gpu"]
    assert "gpu_check: section written to" in p.stdout
    print(f"gpu_check --cpu took {took:.1f} s")


def _gpu_run() -> dict:
    """A GPU host's results, as gpu_check.json holds them (made-up figures)."""
    m = {"cores": 16, "cpu": "Intel Xeon", "kernel": "6.8.0", "copy_gbs": 12.0,
         "torch": "2.11.0+cu130", "linerate": "0.2.0", "python": "3.12.3", "date": "2026-12-01"}
    host = {"machine": m, "torch": "2.11.0+cu130", "torch_cuda": "13.0", "gpu": "NVIDIA H100",
            "gpus": 1, "rdma": {"infiniband": [], "rdma_rxe": "loadable"},
            "mpi": "available", "torchvision": "0.26.0"}

    def scale(world, rows, latency=None):
        out = {"world": world, "bytes": 64 << 20, "rows": rows,
               "mpi": {"bytes": 20000.0, **({"latency": 9.5} if latency else {})}}
        if latency:
            out["latency"] = latency
        return {"status": "ok", "seconds": 10.0, "result": out}

    def row(world, transport, conns, bw, cores):
        return {"world": world, "bytes": 64 << 20, "transport": transport, "connections": conns,
                "factor": 2 * (world - 1) / world, "linerate_busbw": bw, "linerate_cores": cores,
                "gloo_busbw": 1.0, "gloo_cores": 1.5}

    lat = {"linerate": {"median_us": 30.0, "p90_us": 40.0},
           "gloo": {"median_us": 300.0, "p90_us": 400.0}}
    steps = {
        "host": {"status": "ok", "seconds": 2.0, "result": host},
        "correctness-2": {"status": "ok", "seconds": 20.0, "result": {
            "checks": 950, "failed": [], "pipelined": {"ops": 40, "chunks": 300},
            "long_kernel": {"pipelined": True, "whole": True}}},
        "staging-2": {"status": "ok", "seconds": 20.0, "result": {"summary": [
            {"world": 2, "bytes": 64 << 20, "ratio": 0.95,
             "busbw": {"cuda pipelined": 5.7, "cuda whole": 3.1, "cuda gloo": 1.0,
                       "cpu linerate": 6.0, "cpu gloo": 1.2}}]}},
        "ddp": {"status": "ok", "seconds": 30.0, "result": {
            "model": "ResNet-18 (torchvision)", "steps": 20, "equal": True, "bitwise": False,
            "max_abs_diff": 1e-7, "gloo_vs_gloo_diff": 2e-7,
            "step_ms": {"linerate": 40.0, "gloo": 90.0, "gloo again": 91.0}}},
        "unit": {"status": "ok", "seconds": 40.0, "result": {
            "torch": "2.11.0+cu130", "command": "python -m pytest -m unit tests",
            "summary": "400 passed, 12 skipped in 38.0s", "counts": {"passed": 400}}},
        "scale-2": scale(2, [row(2, "shm", None, 6.0, 2.0), row(2, "tcp", 1, 2.0, 1.0),
                             row(2, "tcp", 2, 3.9, 2.0), row(2, "tcp", 4, 4.2, 3.0),
                             row(2, "tcp", 8, 4.3, 4.5)], lat),
        "scale-16": scale(16, [row(16, "shm", None, 6.2, 14.0)], lat),
    }
    return {"mode": "gpu", "budget_s": 420.0, "host": host, "steps": steps, "seconds": 200.0}


def test_a_gpu_runs_json_renders_as_the_pages_section(tmp_path):
    data = _gpu_run()
    src = tmp_path / "gpu_check.json"
    src.write_text(json.dumps(data))
    page = tmp_path / "performance.md"
    page.write_text((ROOT / "docs" / "performance.md").read_text())
    assert gc.main(["--render", str(src), "--docs", str(page)]) == 0
    text = pr.parse_sections(page.read_text())["gpu"]
    setup = next(s for s in pr.SETUPS if s.key == "gpu")
    assert text.startswith(f"<!-- perf:gpu -->\n## {setup.title}\n\n{setup.about}\n\nMachine: 16 cores")
    assert "```text\npython -m linerate.tools.dev.gpu_check --json out.json\n```" in text
    assert "GPU: NVIDIA H100 (CUDA 13.0, 1 visible), torch 2.11.0+cu130" in text
    assert "`rdma_rxe`: loadable" in text
    assert "| 2 | 950 | 0 | 40 (300) | pipelined ok, whole ok |" in text
    assert "| 2 | 64 MiB | 5.70 | 3.10 | 1.00 | 6.00 | 1.20 | 0.95x |" in text
    assert "within 10x" in text and "| ResNet-18 (torchvision) | 2 | 20 | 40.0 | 90.0 | 2.25x |" in text
    assert "| 2 | TCP (LINERATE_SHM=0) | 8 | 4.30 | 4.5 | 1.00 | 1.5 | – |" in text
    assert "| 16 | shared memory | – | 6.20 | 14.0 | 1.00 | 1.5 | 6.29 |" in text   # Open MPI
    assert "| 16 | 30.0, 40.0 | 300.0 | 9.5 |" in text
    assert "target 0.9x met in 1 of 1 cases" in text
    assert "best 4.30 GB/s with 8 (2.15x); 90% of the best reached with 2 per peer" in text
    assert "Unit tier with torch 2.11.0+cu130" in text


def test_findings_say_what_limits_busbw():
    data = _gpu_run()
    found = gc.findings(data)
    tcp = next(f for f in found if f.startswith("Loopback TCP"))
    # 2.0/1.0, 3.9/2.0, 4.2/3.0, 4.3/4.5: bytes per busy core fall as connections grow
    assert "fall from 2.00 to 0.96 GB/s" in tcp and "without adding bandwidth" in tcp
    shm = next(f for f in found if f.startswith("Shared memory"))
    assert "2 ranks 6.00 GB/s (2.0 cores busy); 16 ranks 6.20 GB/s (14.0 cores busy)" in shm
    assert "stays within 10%" in shm and "not cores, is the limit" in shm
    rows = data["steps"]["scale-2"]["result"]["rows"]
    data["steps"]["scale-2"]["result"]["rows"] = rows[:3]   # shared memory, 1 and 2 connections
    tcp = next(f for f in gc.findings(data) if f.startswith("Loopback TCP"))
    assert "stay within 25%" in tcp and "kernel's TCP copies is the limit" in tcp


def test_a_step_that_failed_or_was_not_run_is_said_so():
    data = _gpu_run()
    data["steps"]["ddp"] = {"status": "timeout", "seconds": 90.0,
                            "error": "ranks timed out"}
    data["steps"]["scale-16"] = {"status": "skipped", "error": "out of the 420 s budget"}
    text = gc.render(data)
    assert "ddp (timeout: ranks timed out); scale-16 (skipped: out of the 420 s budget)" in text
    assert gc.problems("correctness-2", {"checks": 10, "failed": ["a", "b"],
                                         "pipelined": {"ops": 1}}) == ["2 of 10 checks failed: a; b"]
    assert gc.problems("correctness-2", {"checks": 10, "failed": [], "pipelined": {},
                                         "long_kernel": {"whole": False}}) == \
        ["long kernel (whole): read early", "no all_reduce took the pipelined path"]
    line = gc.rdma_line()
    assert set(line) == {"infiniband", "rdma_rxe"} and isinstance(line["infiniband"], list)


def test_a_unit_tier_that_misses_only_optional_packages_is_not_a_failure():
    text = ("....s...\n=== skips: 2, 1 unexpected ===\n"
            "UNEXPECTED (1): could not import 'hypothesis': No module named 'hypothesis'\n"
            "    tests/test_fuzz.py\nallowed, no GPU (1): needs a CUDA device\n"
            "==== 400 passed, 2 skipped in 30.1s ====\n")
    r = gc.pytest_result(1, text)
    assert r["counts"] == {"passed": 400, "skipped": 2} and "problem" not in r
    assert r["unexpected_skips"] == ["UNEXPECTED (1): could not import 'hypothesis': No module "
                                     "named 'hypothesis'"]
    r = gc.pytest_result(1, "FAILED tests/test_x.py::test_y - boom\n"
                            "UNEXPECTED (1): no mkdocs\n=== 1 failed, 3 passed in 2.0s ===\n")
    assert r["failed"] == ["tests/test_x.py::test_y"] and r["problem"].startswith("pytest exit 1")
