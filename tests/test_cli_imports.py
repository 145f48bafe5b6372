"""The ``linerate`` command imports torch only where it needs it: ``top``, ``flight``,
``--version`` and the launching side of the commands that start ranks (``bench``, ``model``,
``whatif``, ``netlab``, ``probe``: their parsers and launchers) start without it (``import
linerate`` imports no torch, nor do the transport's options); the ranks import it. The backend
is still registered whenever torch is imported, with or without torch's entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _harness import REPO

pytestmark = pytest.mark.timeout(120)

RUN = """
import sys
from linerate.tools.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("TORCH-MODULES", len(torch), torch[:3], file=sys.stderr)
sys.exit(code or 0)
"""


def _linerate(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True,
                          timeout=90, env=e)


def _torch_modules(r: subprocess.CompletedProcess) -> int:
    line = next(x for x in r.stderr.splitlines() if x.startswith("TORCH-MODULES"))
    return int(line.split()[1])


@pytest.mark.parametrize("argv", [["top", "--help"], ["flight", "--help"], ["--version"],
                                  ["top", "127.0.0.1:1", "--once"], ["--help"],
                                  ["bench", "--help"], ["model", "--help"],
                                  ["whatif", "--help"], ["netlab", "--help"],
                                  ["probe", "--help"]],
                         ids=["top-help", "flight-help", "version", "top-once", "help",
                              "bench-help", "model-help", "whatif-help", "netlab-help",
                              "probe-help"])
def test_commands_that_need_no_torch_do_not_import_it(argv):
    r = _linerate(*argv)
    assert r.returncode in (0, 1), r.stdout + r.stderr  # top --once: nothing listens there
    assert _torch_modules(r) == 0, r.stderr


def _dump(rank: int, ops: list) -> dict:
    return {"kind": "linerate-flight", "version": 1, "rank": rank, "time": 1.0,
            "groups": [{"name": "0", "desc": "default_pg", "ranks": [0, 1, 2], "rank": rank,
                        "ops": ops}]}


def test_flight_reads_dumps_without_torch(tmp_path):
    # rank 2 entered every all_reduce 20 ms late; rank 1 never entered #13
    for r in range(3):
        ops = []
        for seq in range(1, 13):
            dur = 0.001 if r == 2 else 0.021
            waited = [[2, 0.02]] if r != 2 else []
            ops.append({"seq": seq, "op": "all_reduce", "state": "completed",
                        "started": 10.0 + seq, "ended": 10.0 + seq + dur, "waited": waited})
        if r != 1:
            ops.append({"seq": 13, "op": "all_reduce", "state": "started", "started": 30.0})
        (tmp_path / f"fr.rank{r}.json").write_text(json.dumps(_dump(r, ops)))
    r = _linerate("flight", str(tmp_path))
    assert _torch_modules(r) == 0, r.stderr
    assert "rank 1" in r.stdout and "rank 2 entered last" in r.stdout, r.stdout + r.stderr


def test_a_command_that_needs_torch_still_runs():
    r = _linerate("bench", "--help")
    assert r.returncode == 0 and "--backends" in r.stdout, r.stderr


REGISTERED = """
import sys
import linerate
assert "torch" not in sys.modules
import torch
import torch.distributed as dist
assert "LINERATE" in dist.Backend._plugins, dist.Backend._plugins
assert type(torch.__spec__.loader).__name__ == "SourceFileLoader", torch.__spec__.loader
assert type(torch.__loader__).__name__ == "SourceFileLoader", torch.__loader__
print("registered")
"""


@pytest.mark.parametrize("autoload", ["1", "0"], ids=["entry-point", "no-entry-point"])
def test_the_backend_is_registered_once_torch_is_imported_after_linerate(autoload):
    env = dict(os.environ, PYTHONPATH=REPO, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    r = subprocess.run([sys.executable, "-c", REGISTERED], capture_output=True, text=True,
                       timeout=90, env=env)
    assert r.returncode == 0 and "registered" in r.stdout, r.stdout + r.stderr
