"""Decentralized data-parallel training: each rank keeps its own parameters and, every step,
averages them with a few neighbours (a topology's mixing matrix W) instead of all-reducing
gradients over all ranks.

The update is "communicate while adapt" (docs/decentralized.md)::

    x_i(t+1) = sum_j W_ij x_j(t) - lr * d_i(x_i(t))

The direction d_i is computed from the gradient at the rank's own, unmixed parameters x_i(t), so
the exchange of x(t) can start when step t's forward pass starts and run during the whole
forward and backward pass: a step costs max(compute, exchange) instead of compute + exchange.
What travels is parameters, bucket by bucket (about ``bucket_bytes`` each), with
``neighbor_allreduce``. The parameters are views of one of two flat buffers per bucket: the
exchange reads them and writes W x(t) into the other buffer (``out=``), the update is applied
there, and the parameters become views of it, so a step copies nothing. The optimizers run as
multi-tensor (``torch._foreach_*``) ops on preallocated state, as torch's foreach Adam does;
what needs only the gradients and x(t) is done before waiting for the exchange.

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

from .neighbor import (hierarchical_neighbor_allreduce, host_layout, linerate_backend,
                       neighbor_allreduce)
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
    (for comparison; the math is the same). ``hierarchical=True``: each step averages the
    parameters within each host (shared memory) and mixes the hosts' averages under
    ``topology``, then a topology of the group's hosts (hierarchical_neighbor_allreduce); every
    rank of a host then holds the same parameters."""

    def __init__(self, module: torch.nn.Module, optimizer: str = "adam", lr: float = 1e-3,
                 topology: Topology | str = "one-peer-exp", accumulation: int = 1,
                 bucket_bytes: int = 25 << 20, group=None, overlap: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, hierarchical: bool = False,
                 **topology_kw):
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
        self.hierarchical = bool(hierarchical)
        nodes = self.world
        if self.hierarchical:
            hosts, _ = host_layout(linerate_backend(group))
            nodes = len(hosts)
        if isinstance(topology, str):
            topology = by_name(topology, nodes, **topology_kw)
        if topology.n != nodes:
            if self.hierarchical:
                raise ValueError(f"DecentralizedDataParallel: hierarchical=True mixes hosts: "
                                 f"topology {topology.name} is for {topology.n} ranks, the "
                                 f"group's ranks are on {nodes} host(s)")
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
        # Two flat buffers per bucket. The parameters are views of one (x(t), what the exchange
        # sends); the exchange writes W x(t) into the other, the update is applied there, and
        # the parameters then become views of it. No copies per step (copying the parameters
        # in and out of one exchange buffer cost two passes over the model per step).
        self._bufs = [[torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                       for b in self.buckets] for _ in range(2)]
        self._views = [[], []]
        for side in (0, 1):
            for bucket, flat in zip(self.buckets, self._bufs[side]):
                off = 0
                for p in bucket:
                    self._views[side].append(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()
        self._cur = 0
        with torch.no_grad():
            for p, v in zip(self.params, self._views[0]):
                v.copy_(p)
                p.data = v
        self._works: list | None = None
        n = len(self.params)
        self._m: list = [None] * n     # Adam's moments / SGD's momentum buffer, per parameter
        self._v: list = [None] * n
        self._acc: list = [None] * n   # accumulation: the gradient sum of the current window
        self._tmp: list = [None] * n   # scratch: the denominator, and the look-ahead moments
        self._windows = 0  # completed accumulation windows (Adam's bias correction counts these)

    # ------------------------------------------------------------------ exchange
    def _start_exchange(self) -> None:
        """Start W x(t) from the parameters' buffers into the other ones, bucket by bucket."""
        step = self.steps
        src, dst = self._bufs[self._cur], self._bufs[1 - self._cur]
        fn = hierarchical_neighbor_allreduce if self.hierarchical else neighbor_allreduce
        self._works = [fn(s, self.topology, step=step, async_op=True, group=self.group, out=d)
                       for s, d in zip(src, dst)]

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
        update = self._prepare()  # what needs only x(t) and the gradients, before the wait
        for w in self._works:
            w.wait()
        self._works = None
        self._finish(self._views[1 - self._cur], update)
        self.steps += 1
        self.zero_grad()

    def _finish(self, new: list[torch.Tensor], update) -> None:
        """Apply the update to the mixed parameters ``new`` (views of the other buffers) and
        make the parameters views of them."""
        if update is not None:
            update(new)
        for p, v in zip(self.params, new):
            p.data = v
        self._cur = 1 - self._cur

    def _prepare(self):
        """The optimizer's work on this step's gradients: the state is updated here, and a
        function of the mixed parameters (list, in place) that subtracts lr * d is returned,
        or None without gradients. Multi-tensor (``torch._foreach_*``) ops on preallocated
        state, like torch's own foreach Adam: no temporaries per step."""
        idx = []
        for i, p in enumerate(self.params):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise ValueError("DecentralizedDataParallel: sparse gradients are not supported")
                idx.append(i)
        if not idx:
            return None
        gs = [self.params[i].grad for i in idx]
        xs = [self.params[i].detach() for i in idx]
        lr, wd = self.lr, self.weight_decay

        def pick(lst: list) -> list:
            return [lst[i] for i in idx]

        if self.optimizer == "sgd":
            if wd:
                gs = torch._foreach_add(gs, xs, alpha=wd)
            d = gs
            if self.momentum:
                for i, g in zip(idx, gs):
                    if self._m[i] is None:
                        self._m[i] = g.clone()   # the first step's buffer is the direction
                    else:
                        self._m[i].mul_(self.momentum).add_(g)
                d = pick(self._m)
            return lambda new: torch._foreach_add_([new[i] for i in idx], d, alpha=-lr)

        b1, b2 = self.betas
        if self.optimizer == "adam" and wd:
            gs = torch._foreach_add(gs, xs, alpha=wd)
        A = self.accumulation
        k = self.steps % A + 1                  # steps of the current window so far, this one included
        ends = k == A                           # the window ends: the moments absorb its mean
        for i, x in zip(idx, xs):
            if self._m[i] is None:
                self._m[i], self._v[i] = torch.zeros_like(x), torch.zeros_like(x)
                self._tmp[i] = [torch.empty_like(x) for _ in range(1 if A == 1 else 3)]
                if A > 1:
                    self._acc[i] = torch.zeros_like(x)
        if A == 1:
            mean = gs
        else:
            mean = pick(self._acc)
            torch._foreach_add_(mean, gs)       # the window's sum; mean = sum / k below
        if ends:
            self._windows += 1
            m, v = pick(self._m), pick(self._v)
        else:                                   # look-ahead moments, the stored ones kept
            m = [self._tmp[i][1] for i in idx]
            v = [self._tmp[i][2] for i in idx]
            torch._foreach_copy_(m, pick(self._m))
            torch._foreach_copy_(v, pick(self._v))
        torch._foreach_mul_(m, b1)
        torch._foreach_add_(m, mean, alpha=(1 - b1) / k)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, mean, mean, value=(1 - b2) / (k * k))
        if ends and A > 1:
            torch._foreach_zero_(mean)
        w = self._windows + (0 if ends else 1)  # windows, this one included
        bc1, bc2 = 1 - b1 ** w, 1 - b2 ** w
        den = [self._tmp[i][0] for i in idx]
        torch._foreach_copy_(den, v)
        torch._foreach_sqrt_(den)
        torch._foreach_div_(den, math.sqrt(bc2))
        torch._foreach_add_(den, self.eps)     # d = (m / bc1) / (sqrt(v / bc2) + eps)
        decay = xs if self.optimizer == "adamw" and wd else None

        def update(new: list[torch.Tensor]) -> None:
            mine = [new[i] for i in idx]
            if decay is not None:
                torch._foreach_add_(mine, decay, alpha=-lr * wd)
            torch._foreach_addcdiv_(mine, m, den, value=-lr / bc1)
        return update

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state_dict(self) -> dict:
        """This rank's optimizer state (moments or momentum buffers, the accumulation sum, the
        step and window counters), for ``torch.save`` beside ``module.state_dict()``: in
        decentralized training every rank has its own parameters and state, so every rank
        saves its own. Tensors are copies."""
        state = {}
        for i in range(len(self.params)):
            entry = {k: t.detach().clone() for k, t in
                     (("m", self._m[i]), ("v", self._v[i]), ("acc", self._acc[i])) if t is not None}
            if entry:
                state[i] = entry
        return {"optimizer": self.optimizer, "accumulation": self.accumulation,
                "steps": self.steps, "windows": self._windows, "state": state}

    @torch.no_grad()
    def load_optimizer_state_dict(self, sd: dict) -> None:
        """Restore ``optimizer_state_dict()``. Load the parameters after wrapping (the wrapper
        starts every rank from rank 0's model): ``model.module.load_state_dict(...)``, then
        this. Every rank must restore the same step (the exchange checks it)."""
        where = f"rank {self.rank}: DecentralizedDataParallel.load_optimizer_state_dict"
        for key in ("optimizer", "accumulation", "steps", "windows", "state"):
            if key not in sd:
                raise ValueError(f"{where}: the state has no {key!r}")
        if sd["optimizer"] != self.optimizer or sd["accumulation"] != self.accumulation:
            raise ValueError(f"{where}: saved by optimizer {sd['optimizer']!r} with accumulation "
                             f"{sd['accumulation']}, this one is {self.optimizer!r} with "
                             f"{self.accumulation}")
        if self._works is not None:
            raise RuntimeError(f"{where}: an exchange is in flight (forward() was called); "
                               f"load before the next forward")
        n = len(self.params)
        m, v, acc, tmp = [None] * n, [None] * n, [None] * n, [None] * n
        for i, entry in sd["state"].items():
            if not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"{where}: parameter index {i!r} is not one of this model's {n}")
            p = self.params[i]
            for k, t in entry.items():
                if k not in ("m", "v", "acc") or not isinstance(t, torch.Tensor):
                    raise ValueError(f"{where}: parameter {i}: unexpected entry {k!r}")
                if t.shape != p.shape:
                    raise ValueError(f"{where}: parameter {i}: {k} has shape {tuple(t.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
            m[i] = entry["m"].to(p).clone() if "m" in entry else None
            if self.optimizer != "sgd":
                if "v" not in entry or (self.accumulation > 1) != ("acc" in entry):
                    raise ValueError(f"{where}: parameter {i}: incomplete Adam state "
                                     f"({', '.join(sorted(entry))})")
                v[i] = entry["v"].to(p).clone()
                acc[i] = entry["acc"].to(p).clone() if "acc" in entry else None
                tmp[i] = [torch.empty_like(p) for _ in range(1 if self.accumulation == 1 else 3)]
        self._m, self._v, self._acc, self._tmp = m, v, acc, tmp
        self.steps, self._windows = int(sd["steps"]), int(sd["windows"])

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
        for flat in self._bufs[self._cur]:   # the parameters are views of these
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)

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
