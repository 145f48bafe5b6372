"""Accelerate without its CPU mode, on a machine without a GPU, trains each rank alone whatever
process group exists (docs/frameworks.md). linerate names it: every rank logs a warning once
its linerate group sees Accelerate's state say one process (at group creation where the
Accelerator came first, having made a default group of its own: a linerate subgroup; at the
group's destruction otherwise); in CPU mode nothing is said.
Runs under torchrun, 2 ranks; skipped where accelerate does not import."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from _harness import REPO, TAG_VAR, kill_tagged

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import os
import torch
import torch.distributed as dist
from accelerate import Accelerator

first = os.environ["WHICH_FIRST"]
if first == "group":
    dist.init_process_group("linerate")
accelerator = Accelerator()
if first == "accelerator":  # Accelerate made a default group (Gloo's): linerate's beside it
    dist.new_group(backend="linerate")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
accelerator.backward(model(torch.randn(8, 4)).sum())
opt.step()
print(f"rank {dist.get_rank()}: num_processes {accelerator.num_processes}", flush=True)
accelerator.end_training()
if dist.is_initialized():
    dist.destroy_process_group()
"""

WARNING = "but Accelerate set itself up undistributed"


def _torchrun(tmp_path, which_first: str, cpu_mode: bool) -> str:
    pytest.importorskip("accelerate", reason="accelerate is not installed "
                                             "(pip install '.[frameworks]')")
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: Accelerate distributes without its CPU mode")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    token = uuid.uuid4().hex
    env = dict(os.environ, WHICH_FIRST=which_first, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=REPO, **{TAG_VAR: token})
    env.pop("ACCELERATE_USE_CPU", None)
    if cpu_mode:
        env["ACCELERATE_USE_CPU"] = "true"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script)]
    try:
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=240)
    finally:
        kill_tagged(token)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("which_first", ["group", "accelerator"])
def test_accelerate_without_cpu_mode_is_named_on_every_rank(tmp_path, which_first):
    out = _torchrun(tmp_path, which_first, cpu_mode=False)
    assert "num_processes 1" in out, out[-3000:]
    for rank in (0, 1):
        assert f"linerate: rank {rank} of a linerate group of 2 ranks, {WARNING}" in out, \
            out[-4000:]
    assert out.count(WARNING) == 2, out[-4000:]  # once per process
    assert "ACCELERATE_USE_CPU=true" in out


def test_accelerate_in_cpu_mode_trains_distributed_and_nothing_is_said(tmp_path):
    out = _torchrun(tmp_path, "group", cpu_mode=True)
    assert "rank 0: num_processes 2" in out and "rank 1: num_processes 2" in out, out[-3000:]
    assert WARNING not in out, out[-3000:]
