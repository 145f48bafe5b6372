"""DDP and FSDP2 over the ``linerate`` process group, against the same training over Gloo.

DDP: each rank trains a model wrapped in DDP over Gloo, then the same model wrapped in DDP
over linerate (same initial weights, same data), and returns the parameters after each run.
Two setups:

* ``int``: a float64 MLP with integer weights (different on every rank: DDP's initial
  broadcast must make them rank 0's), integer data, loss = P * sum(c * out) and SGD with lr=1,
  so every gradient is an integer multiple of P: DDP's division by P and the sums are exact,
  and the parameters must be bit-identical to Gloo's (``torch.equal``).
* ``real``: a float32 MLP with random normal weights (the same on all ranks) and MSE loss;
  a bucket is > 64 KiB (linerate's ring path). The order of a sum of three floats may differ
  from Gloo's, so P=3 is compared with ``allclose``; with P=2 a sum has one addition and is
  bit-identical in any order (``torch.equal``), except for PowerSGD (``allclose``).

FSDP2 (``fully_shard``) needs a DeviceMesh over the default group, so it runs twice: once with
linerate as the default group, once with Gloo; the full parameters are compared.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness import run_ranks

STEPS = 5
T = 90


# ----------------------------------------------------------------------------- models and data
def _int_model(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).double())
    return m


def _real_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def _batches(setup: str, rank: int, P: int):
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(STEPS):
        if setup == "int":
            x = torch.randint(-1, 2, (6, 8), generator=g).double()
            c = torch.randint(-2, 3, (6, 4), generator=g).double()
            out.append((x, c))
        else:
            out.append((torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)))
    return out


def _loss(setup, out, target, P):
    if setup == "int":
        return P * (out * target).sum()
    return nn.functional.mse_loss(out, target)


# ----------------------------------------------------------------------------- DDP
def _make_hook(variant, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

    if variant == "fp16_hook":
        return group, default_hooks.fp16_compress_hook
    if variant == "powersgd":
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.5, random_seed=0)
        return state, psgd.powerSGD_hook
    return None, None


def _train_ddp(rank, P, group, setup, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _int_model(seed=rank) if setup == "int" else _real_model(seed=0)
    kw = {}
    if variant == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    if variant == "small_buckets":
        kw["bucket_cap_mb"] = 0.0001 if setup == "int" else 0.0005  # 3 and 5 buckets
    ddp = DDP(model, process_group=group, **kw)
    state, hook = _make_hook(variant, group)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    lr = 1.0 if setup == "int" else 0.05
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.0 if setup == "int" else 0.9)
    losses = []
    for x, target in _batches(setup, rank, P):
        opt.zero_grad()
        loss = _loss(setup, ddp(x), target, P)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if variant == "small_buckets":  # buckets are rebuilt after the first step
        nb = ddp._get_ddp_logging_data().get("num_buckets_reduced")
        assert nb is not None and nb >= 3, f"{setup}/{variant}: {nb} buckets"
    return [p.detach().clone() for p in model.parameters()], losses


def _ddp_fn(rank, P, lr, runs):
    warnings.filterwarnings("ignore")
    out = {}
    for setup, variant in runs:
        gloo = _train_ddp(rank, P, None, setup, variant)
        dist.barrier()
        mine = _train_ddp(rank, P, lr, setup, variant)
        dist.barrier()
        out[(setup, variant)] = (gloo, mine)
    return out


def _compare(results, P, exact_pred):
    errors = []
    for rank, res in enumerate(results):
        for (setup, variant), ((gp, gl), (lp, ll)) in res.items():
            exact = exact_pred(setup, variant)
            for i, (a, b) in enumerate(zip(lp, gp)):
                ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                if not ok:
                    errors.append(f"rank {rank} {setup}/{variant}: parameter {i} differs from DDP over Gloo "
                                  f"(max abs diff {(a - b).abs().max().item():.3g}, exact={exact})")
            # every rank ends with the same parameters
            for i, (a, b) in enumerate(zip(lp, results[0][(setup, variant)][1][0])):
                if not torch.equal(a, b):
                    errors.append(f"rank {rank} {setup}/{variant}: parameter {i} differs from rank 0's")
    assert not errors, "\n".join(errors[:30])


def _exact(P):
    def pred(setup, variant):
        if setup == "int":
            return True
        return P == 2 and variant != "powersgd"
    return pred


PLAIN_RUNS = [("int", "default"), ("int", "bucket_view"), ("int", "small_buckets"),
              ("real", "default"), ("real", "bucket_view"), ("real", "small_buckets")]


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_ddp_matches_gloo(P):
    """Default DDP, gradient_as_bucket_view=True and a small bucket_cap_mb (several buckets)."""
    results = run_ranks(_ddp_fn, P, PLAIN_RUNS, timeout=T)
    _compare(results, P, _exact(P))


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_ddp_ring_pipelined(P):
    """The same with LINERATE_ALLREDUCE_ALGO=ring and 4 KiB pieces: every bucket takes the ring."""
    env = {"LINERATE_ALLREDUCE_ALGO": "ring", "LINERATE_ROOTED_ALGO": "chain", "LINERATE_PIECE_BYTES": "4096"}
    results = run_ranks(_ddp_fn, P, [("int", "default"), ("real", "small_buckets")], timeout=T, env=env)
    _compare(results, P, _exact(P))


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_ddp_fp16_compress_hook(P):
    """torch's Python fp16_compress_hook on both backends."""
    results = run_ranks(_ddp_fn, P, [("real", "fp16_hook")], timeout=T)
    _compare(results, P, _exact(P))


@pytest.mark.timeout(T + 30)
@pytest.mark.parametrize("P", [2, 3])
def test_ddp_powersgd_hook(P):
    """powerSGD_hook (start_powerSGD_iter=2: two plain steps, then compression): it starts
    collectives from future callbacks and waits on them; it must not deadlock."""
    results = run_ranks(_ddp_fn, P, [("real", "powersgd")], timeout=T)
    _compare(results, P, _exact(P))


# ----------------------------------------------------------------------------- FSDP2
def _fsdp_fn(rank, P, lr):
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (P,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return full, losses, dist.get_backend()


@pytest.mark.timeout(2 * T + 30)
def test_fsdp2_matches_gloo():
    gloo = run_ranks(_fsdp_fn, 2, timeout=T, backend="gloo")
    mine = run_ranks(_fsdp_fn, 2, timeout=T, backend="linerate")
    assert gloo[0][2] == "gloo" and mine[0][2] == "linerate"
    for rank in range(2):
        (gp, gl, _), (lp, ll, _) = gloo[rank], mine[rank]
        assert len(gp) == len(lp) == 4
        for i, (a, b) in enumerate(zip(lp, gp)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), \
                f"rank {rank}: parameter {i} differs (max abs diff {(a - b).abs().max().item():.3g})"
        assert torch.allclose(torch.tensor(ll), torch.tensor(gl), rtol=1e-5), (ll, gl)
