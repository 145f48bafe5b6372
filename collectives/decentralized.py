"""Decentralized data-parallel training: each rank keeps its own parameters and, every step,
averages them with a few neighbours (a topology's mixing matrix W) instead of all-reducing
gradients over all ranks.

The update is "communicate while adapt" (see ../shared/BACKGROUND.md, section 2)::

    x_i(t+1) = sum_j W_ij x_j(t) - lr * d_i(x_i(t))

The direction d_i is computed from the gradient at the rank's own, unmixed parameters x_i(t), so
the exchange of x(t) can start when step t's forward pass starts and run during the whole
forward and backward pass: a step costs max(compute, exchange) instead of compute + exchange.
What travels is parameters, bucket by bucket (one flat buffer per bucket of about
``bucket_bytes``), with ``neighbor_allreduce``.

Optimizers:
- ``"sgd"``: d = g (+ weight decay), with optional momentum (heavy ball on the local gradient).
- ``"adam"`` / ``"adamw"``: local Adam moments. With ``accumulation=A > 1`` (the accumulation
  technique, for small local batches whose moments are noisy): every step updates the
  parameters with look-ahead moments that include the mean gradient of the current window of
  A steps, but the stored moments absorb only that window's mean gradient, once per window,
  and bias correction counts windows, not steps. A = 1 is plain Adam.

Not supported: parameters that do not require gradients are left out of the exchange (they are
made equal once, at construction, by a broadcast from rank 0); buffers (e.g. BatchNorm running
statistics) are not averaged; sparse gradients; a model whose parameters change after
construction.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .neighbor import neighbor_allreduce
from .topology import Topology, by_name

__all__ = ["DecentralizedDataParallel"]


class DecentralizedDataParallel(torch.nn.Module):
    """Wrap ``module`` for decentralized training on ``group`` (default: the default group,
    which must use the linerate backend). Use it like DDP::

        model = DecentralizedDataParallel(net, "adam", lr=1e-3, topology="one-peer-exp")
        for x, y in data:
            loss = loss_fn(model(x), y)
            loss.backward()
            model.step()          # also clears the gradients

    ``topology``: a ``collectives.topology.Topology`` or a name for ``topology.by_name``
    (default "one-peer-exp"). ``overlap=False`` exchanges after the backward pass instead
    (for comparison; the math is the same)."""

    def __init__(self, module: torch.nn.Module, optimizer: str = "adam", lr: float = 1e-3,
                 topology: Topology | str = "one-peer-exp", accumulation: int = 1,
                 bucket_bytes: int = 25 << 20, group=None, overlap: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, **topology_kw):
        super().__init__()
        if optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"DecentralizedDataParallel: optimizer {optimizer!r} is not one of "
                             f"adam, adamw, sgd")
        if accumulation < 1:
            raise ValueError(f"DecentralizedDataParallel: accumulation must be >= 1, got {accumulation}")
        if lr <= 0:
            raise ValueError(f"DecentralizedDataParallel: lr must be positive, got {lr}")
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if isinstance(topology, str):
            topology = by_name(topology, self.world, **topology_kw)
        if topology.n != self.world:
            raise ValueError(f"DecentralizedDataParallel: topology {topology.name} is for "
                             f"{topology.n} ranks, the group has {self.world}")
        self.topology = topology
        self.optimizer = optimizer
        self.lr = lr
        self.accumulation = accumulation
        self.overlap = overlap
        self.betas, self.eps = betas, eps
        self.weight_decay, self.momentum = weight_decay, momentum
        self.steps = 0
        self.params = [p for p in module.parameters() if p.requires_grad]
        for p in module.parameters():  # every rank starts from rank 0's model (like DDP)
            dist.broadcast(p.data, dist.get_global_rank(group, 0) if group is not None else 0,
                           group=group)
        self.buckets = _buckets(self.params, bucket_bytes)
        self._flat = [torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                      for b in self.buckets]
        self._works: list | None = None
        self._state = [{} for _ in self.params]
        self._windows = 0  # completed accumulation windows (Adam's bias correction counts these)

    # ------------------------------------------------------------------ exchange
    def _start_exchange(self) -> None:
        """Copy x(t) into the bucket buffers and start W x(t), bucket by bucket."""
        step = self.steps
        works = []
        for bucket, flat in zip(self.buckets, self._flat):
            off = 0
            with torch.no_grad():
                for p in bucket:
                    n = p.numel()
                    flat[off:off + n].copy_(p.detach().reshape(-1))
                    off += n
            works.append(neighbor_allreduce(flat, self.topology, step=step, async_op=True,
                                            group=self.group))
        self._works = works

    def forward(self, *args, **kwargs):
        if self.overlap and self._works is None:
            self._start_exchange()
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self) -> None:
        """x(t+1) = W x(t) - lr * d(x(t)); then clears the gradients."""
        if self._works is None:
            self._start_exchange()  # overlap=False, or step() without forward()
        directions = [self._direction(i, p) for i, p in enumerate(self.params)]
        if self.optimizer != "sgd" and (self.steps + 1) % self.accumulation == 0:
            self._windows += 1
        for w in self._works:
            w.wait()
        self._works = None
        k = 0
        for bucket, flat in zip(self.buckets, self._flat):
            off = 0
            for p in bucket:
                n = p.numel()
                p.copy_(flat[off:off + n].view_as(p))
                d = directions[k]
                if d is not None:
                    p.add_(d, alpha=-self.lr)
                off += n
                k += 1
        self.steps += 1
        self.zero_grad()

    def _direction(self, i: int, p: torch.Tensor) -> torch.Tensor | None:
        g = p.grad
        if g is None:
            return None
        if g.is_sparse:
            raise ValueError("DecentralizedDataParallel: sparse gradients are not supported")
        st = self._state[i]
        x = p.detach()
        if self.optimizer == "sgd":
            d = g.add(x, alpha=self.weight_decay) if self.weight_decay else g.clone()
            if self.momentum:
                buf = st.get("momentum")
                buf = d.clone() if buf is None else buf.mul_(self.momentum).add_(d)
                st["momentum"] = buf
                d = buf.clone()
            return d
        b1, b2 = self.betas
        if self.optimizer == "adam" and self.weight_decay:
            g = g.add(x, alpha=self.weight_decay)
        if not st:
            st["m"] = torch.zeros_like(x)
            st["v"] = torch.zeros_like(x)
            st["acc"] = torch.zeros_like(x)
        A = self.accumulation
        k = self.steps % A + 1  # steps of the current window so far, this one included
        acc = st["acc"].add_(g)
        mean = acc / k
        m = st["m"] * b1 + mean * (1 - b1)       # look-ahead moments: the window's mean gradient
        v = st["v"] * b2 + mean * mean * (1 - b2)
        w = self._windows + 1                   # windows, this one included
        d = (m / (1 - b1 ** w)) / ((v / (1 - b2 ** w)).sqrt_() + self.eps)
        if k == A:                              # the window ends: the moments absorb its mean
            st["m"], st["v"] = m, v
            acc.zero_()
        if self.optimizer == "adamw" and self.weight_decay:
            d = d.add(x, alpha=self.weight_decay)
        return d

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def global_average(self) -> None:
        """Replace every rank's parameters by their average over all ranks (an All-Reduce),
        e.g. before evaluation. Waits for a pending exchange first."""
        if self._works is not None:
            for w in self._works:
                w.wait()
            self._works = None
        for flat, bucket in zip(self._flat, self.buckets):
            off = 0
            for p in bucket:
                flat[off:off + p.numel()].copy_(p.reshape(-1))
                off += p.numel()
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            off = 0
            for p in bucket:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """sqrt(mean over ranks of ||x_i - mean(x)||^2): how far the ranks' models are apart."""
        local = 0.0
        for p in self.params:
            mean = p.detach().to(torch.float64).clone()
            dist.all_reduce(mean, group=self.group)
            mean /= self.world
            local += float(((p.detach().to(torch.float64) - mean) ** 2).sum())
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return math.sqrt(total.item() / self.world)


def _buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, about ``bucket_bytes`` each."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if (not out or size + nbytes > bucket_bytes or out[-1][0].dtype != p.dtype
                or out[-1][0].device != p.device):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out
