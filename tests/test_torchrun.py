"""End to end as a user runs it: torchrun starts the ranks, the script never imports linerate
(the torch.backends entry point registers the backend at `import torch`)."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("linerate")
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((1001,), float(r + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1001,), float(w * (w + 1) // 2))), t[:4]
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.full((4, 8), float(r))).sum().backward()
        opt.step()
    p = model.module.weight.detach().clone()
    ps = [torch.empty_like(p) for _ in range(w)]
    dist.all_gather(ps, p)
    assert all(torch.equal(ps[0], q) for q in ps), "replicas diverged"
    print(f"rank {r}: ok {dist.get_backend()}", flush=True)
    dist.destroy_process_group()
''')


@pytest.mark.timeout(120)
def test_torchrun_two_ranks_without_import(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0: ok linerate" in out and "rank 1: ok linerate" in out, out[-4000:]
