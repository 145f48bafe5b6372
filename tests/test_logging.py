"""LINERATE_LOG_LEVEL (linerate/_log.py) and ``linerate.backend_of``.

Each logging case runs in a child interpreter: logging's configuration is process-wide."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

#: A group of one rank in this process (HashStore: nothing to connect), optionally with the
#: root logger configured first.
SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch.distributed as dist
    if "--basic" in sys.argv:
        logging.basicConfig(level=logging.WARNING, format="ROOT %(name)s: %(message)s")
    dist.init_process_group("linerate", store=dist.HashStore(), rank=0, world_size=1)
    logging.getLogger("linerate.transport").debug("a debug line")
    logging.getLogger("linerate").warning("a warning")
    dist.destroy_process_group()
""")


def _run(level: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LINERATE_")}
    if level is not None:
        env["LINERATE_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_unset_leaves_python_logging_alone():
    p = _run(None)
    assert p.returncode == 0, p.stderr
    assert "group 0 of 1 rank" not in p.stderr and "a debug line" not in p.stderr
    assert p.stderr.count("a warning") == 1  # Python's last-resort handler


def test_info_prints_the_group_line_and_debug_prints_more():
    p = _run("info")
    assert p.returncode == 0, p.stderr
    assert "INFO linerate pid" in p.stderr and "rank 0: group 0 of 1 rank on 1 host" in p.stderr
    assert "a debug line" not in p.stderr and p.stderr.count("a warning") == 1
    p = _run("DEBUG")
    assert p.returncode == 0, p.stderr
    assert "DEBUG linerate.transport pid" in p.stderr and "a debug line" in p.stderr


def test_error_hides_warnings():
    p = _run("error")
    assert p.returncode == 0, p.stderr
    assert "a warning" not in p.stderr


def test_a_configured_root_logger_prints_each_line_once():
    p = _run("debug", "--basic")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("a debug line") == 1 and "ROOT linerate.transport: a debug line" in p.stderr


def test_a_bad_level_fails_group_creation_naming_the_variable():
    p = _run("loud")
    assert p.returncode != 0
    assert "LINERATE_LOG_LEVEL='loud': expected DEBUG, INFO, WARNING or ERROR" in p.stderr


@pytest.mark.timeout(120)
def test_backend_of_finds_the_linerate_group():
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch.distributed as dist
        import linerate
        try:
            linerate.backend_of()
            raise SystemExit("no error before init")
        except RuntimeError as e:
            assert "not initialized" in str(e), e
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            linerate.backend_of()
            raise SystemExit("no error for a gloo group")
        except RuntimeError as e:
            assert "no linerate backend (cpu: gloo" in str(e), e
        g = dist.new_group(backend="linerate")
        pg = linerate.backend_of(g)
        assert isinstance(pg, linerate.ProcessGroupLinerate), type(pg)
        assert linerate.backend_of(pg) is pg
        assert pg.connection_stats() == [] and pg.slow_report() is None
        dist.destroy_process_group()
        dist.init_process_group("linerate", store=dist.HashStore(), rank=0, world_size=1)
        assert isinstance(linerate.backend_of(), linerate.ProcessGroupLinerate)
        dist.destroy_process_group()
        print("ok")
    """)], env={k: v for k, v in os.environ.items() if not k.startswith("LINERATE_")},
        capture_output=True, text=True, timeout=110)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
