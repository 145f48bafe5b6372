"""Priority scheduling for data-parallel training (ByteScheduler's idea on linerate).

``PriorityDataParallel(model, optimizer)`` trains like DDP, with three differences in *when*
things happen (the math is DDP's: gradients averaged over the ranks, then the optimizer):

1. A layer's gradients are all-reduced as soon as the backward pass has produced all of
   them, in partitions of ``LINERATE_PARTITION_BYTES``, each with priority = the layer's
   position in the forward pass. The transport sends the most urgent queued partition first,
   chunk by chunk, so the first layers' gradients (produced last) overtake the later layers'
   still queued; ``LINERATE_CREDIT_BYTES`` bounds what waits in the kernel's FIFO buffers.
2. Each layer's parameters are updated as soon as its gradients have arrived (on an updater
   thread, with a copy of the user's optimizer per layer sharing its state and hyper-parameters).
3. ``optimizer.step()`` returns at once and the next forward pass starts: each layer waits
   only for its own parameters (a forward pre-hook).

The training loop is DDP's::

    model = PriorityDataParallel(net, opt)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    model.synchronize()   # before reading parameters outside forward (evaluation, checkpoint)

Not supported (raises or is documented): parameters that get no gradient in a step (DDP's
``find_unused_parameters``), several backward passes per step (gradient accumulation,
``no_sync``), optimizers that need every gradient at once (LBFGS, gradient clipping by global
norm between backward and step), and layers whose parameters have different dtypes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import types

import torch
import torch.distributed as dist

log = logging.getLogger("linerate")


class _Layer:
    """A module that owns parameters: the unit of priority, communication and update."""

    def __init__(self, index: int, name: str, module: torch.nn.Module, params: list):
        self.index = index
        self.priority = index
        self.name = name or "model"
        self.module = module
        self.params = params
        dtype = params[0].dtype
        if any(p.dtype != dtype for p in params):
            raise TypeError(f"PriorityDataParallel: layer {self.name} has parameters of several "
                            f"dtypes ({sorted({str(p.dtype) for p in params})}); not supported")
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.empty(self.numel, dtype=dtype, device=params[0].device)
        self.offsets = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.partitions: list[tuple[int, int]] = []
        self.arrived = 0
        self.left = 0
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.ready.set()
        self.launched_step = -1
        self.optimizer = None
        self.groups: list[int] = []  # user param_group index of each clone group
        self.hyper: list[dict] = []  # their hyper-parameters for the pending update

    def partition(self, max_bytes: int) -> None:
        es = self.flat.element_size()
        n = max(1, -(-self.numel * es // max_bytes))
        size = -(-self.numel // n)
        self.partitions = [(a, min(a + size, self.numel)) for a in range(0, self.numel, size)] or [(0, 0)]


class PriorityDataParallel(torch.nn.Module):
    """DDP-like wrapper with per-layer prioritized all-reduce and per-layer updates.

    ``optimizer``: the user's optimizer over the model's parameters (torch.optim style:
    ``type(optimizer)(param_groups, **optimizer.defaults)`` must build a copy). Its ``step``
    and ``zero_grad`` are replaced while the wrapper lives (restored by ``close()``); its
    ``state`` and ``param_groups`` stay the ones in use, so LR schedulers and
    ``optimizer.state_dict()`` work (after ``synchronize()``).
    ``process_group``: a linerate group (default: the default group).
    ``partition_bytes``: default ``LINERATE_PARTITION_BYTES`` (4 MiB)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 process_group=None, partition_bytes: int | None = None, broadcast: bool = True):
        super().__init__()
        self.module = module
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("PriorityDataParallel: call dist.init_process_group first")
        backend = group._get_backend(torch.device("cpu")) if hasattr(group, "_get_backend") else group
        if not hasattr(backend, "allreduce_priority"):
            raise TypeError(f"PriorityDataParallel needs a linerate process group, got "
                            f"{type(backend).__name__} (dist.init_process_group('linerate') or "
                            f"dist.new_group(backend='linerate'))")
        self._group = group
        self._pg = backend
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._timeline = backend.timeline
        pbytes = partition_bytes if partition_bytes is not None else backend.options.partition_bytes
        if pbytes < 4096:
            raise ValueError(f"PriorityDataParallel: partition_bytes must be at least 4096, got {pbytes}")
        if broadcast:
            src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=src, group=group)
        self._layers: list[_Layer] = []
        self._owner: dict = {}
        for name, m in module.named_modules():
            # a parameter shared by two modules (tied weights) belongs to the first
            params = [p for p in m.parameters(recurse=False)
                      if p.requires_grad and p not in self._owner]
            if params:
                layer = _Layer(len(self._layers), name, m, params)
                layer.partition(pbytes)
                self._layers.append(layer)
                for i, p in enumerate(params):
                    self._owner[p] = (layer, i)
        if not self._layers:
            raise ValueError("PriorityDataParallel: the model has no parameters that require grad")
        self._optimizer = optimizer
        self._clone_optimizer(optimizer)
        self._step = 0
        self._forward_order: list[_Layer] = []
        self._ordered = False
        self._lock = threading.Lock()
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._updater = threading.Thread(target=self._run_updates, daemon=True,
                                         name=f"linerate-pdp-update-{self._rank}")
        self._updater.start()
        self._hooks = []
        for layer in self._layers:
            self._hooks.append(layer.module.register_forward_pre_hook(self._make_pre_hook(layer)))
            if self._timeline is not None:
                self._hooks.append(layer.module.register_forward_hook(self._make_post_hook(layer)))
            for p in layer.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._patch_optimizer(optimizer)

    def _patch_optimizer(self, opt) -> None:
        """Give ``opt`` our step and zero_grad as methods of its own (so that an LR scheduler
        created later wraps them as it wraps any optimizer's; one created before still sees
        its mark and its step counted)."""
        pdp = self
        had_scheduler = hasattr(opt.step, "_wrapped_by_lr_sched")

        def step(opt_self, closure=None):
            opt_self._opt_called = True  # what an LR scheduler's wrapper records
            return pdp._optimizer_step(closure)

        def zero_grad(opt_self, set_to_none: bool = True):
            return pdp._optimizer_zero_grad(set_to_none)

        if had_scheduler:
            step._wrapped_by_lr_sched = True
        opt.step = types.MethodType(step, opt)
        opt.zero_grad = types.MethodType(zero_grad, opt)

    # ------------------------------------------------------------------ optimizer copies
    def _clone_optimizer(self, opt) -> None:
        group_of = {}
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                group_of[p] = gi
        missing = [n for n, p in self.module.named_parameters() if p.requires_grad and p not in group_of]
        if missing:
            raise ValueError(f"PriorityDataParallel: parameters {missing[:5]} are not in the optimizer")
        for layer in self._layers:
            by_group: dict[int, list] = {}
            for p in layer.params:
                by_group.setdefault(group_of[p], []).append(p)
            layer.groups = sorted(by_group)
            groups = [{**{k: v for k, v in opt.param_groups[gi].items() if k != "params"},
                       "params": by_group[gi]} for gi in layer.groups]
            try:
                clone = type(opt)(groups, **opt.defaults)
            except TypeError as e:
                raise TypeError(f"PriorityDataParallel: cannot build a per-layer copy of "
                                f"{type(opt).__name__} as type(opt)(param_groups, **opt.defaults): "
                                f"{e}") from None
            clone.state = opt.state  # one state, the user's: state_dict() sees it
            layer.optimizer = clone

    # ------------------------------------------------------------------ hooks
    def _make_pre_hook(self, layer: _Layer):
        def pre_hook(module, args):
            if not self._ordered:
                self._forward_order.append(layer)
            if not layer.ready.is_set():
                t0 = time.perf_counter()
                layer.ready.wait()
                if self._timeline is not None:
                    self._timeline.span(f"wait {layer.name}", "compute", t0, time.perf_counter())
            if layer.error is not None:
                err, layer.error = layer.error, None
                raise RuntimeError(f"rank {self._rank}: PriorityDataParallel: the update of layer "
                                   f"{layer.name} failed: {err}") from err
            if self._timeline is not None:
                layer._fwd_start = time.perf_counter()
        return pre_hook

    def _make_post_hook(self, layer: _Layer):
        def post_hook(module, args, output):
            start = getattr(layer, "_fwd_start", None)
            if start is not None:
                self._timeline.span(f"forward {layer.name}", "compute", start, time.perf_counter())
        return post_hook

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if not self._ordered and self._forward_order:
            # Priorities: the order of the first forward pass (first used, first sent).
            seen = []
            for layer in self._forward_order:
                if layer not in seen:
                    seen.append(layer)
            rest = [layer for layer in self._layers if layer not in seen]
            for prio, layer in enumerate(seen + rest):
                layer.priority = prio
            self._ordered = True
        return out

    def _grad_ready(self, p: torch.Tensor) -> None:
        layer, _ = self._owner[p]
        layer.arrived += 1
        if layer.arrived == len(layer.params):
            layer.arrived = 0
            self._launch(layer)

    def _launch(self, layer: _Layer) -> None:
        """All of a layer's gradients are here: pack them and all-reduce its partitions."""
        if layer.launched_step == self._step:
            raise RuntimeError(f"rank {self._rank}: PriorityDataParallel: layer {layer.name} got "
                               f"gradients twice in step {self._step}: several backward passes "
                               f"per optimizer step are not supported")
        layer.launched_step = self._step
        layer.ready.clear()
        # This step's hyper-parameters, as DDP's optimizer.step() would see them (an LR
        # scheduler may change them before the update runs).
        layer.hyper = [{k: v for k, v in self._optimizer.param_groups[gi].items() if k != "params"}
                       for gi in layer.groups]
        with torch.no_grad():
            for p, off in zip(layer.params, layer.offsets):
                layer.flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        layer.left = len(layer.partitions)
        if self._timeline is not None:
            self._timeline.instant(f"gradients {layer.name}", "compute", time.perf_counter())
        for i, (a, b) in enumerate(layer.partitions):
            work = self._pg.allreduce_priority(layer.flat[a:b], layer.priority, dist.ReduceOp.AVG,
                                               name=f"{layer.name}[{i}]")
            work.get_future().add_done_callback(lambda fut, layer=layer: self._partition_done(layer, fut))

    def _partition_done(self, layer: _Layer, fut) -> None:
        try:
            fut.value()
            err = None
        except BaseException as e:  # noqa: BLE001 - handed to the layer's next forward
            err = e
        with self._lock:
            if err is not None and layer.error is None:
                layer.error = err
            layer.left -= 1
            last = layer.left == 0
        if last:
            self._updates.put(layer)

    def _run_updates(self) -> None:
        while True:
            layer = self._updates.get()
            if layer is None:
                return
            if layer.error is None:
                t0 = time.perf_counter()
                try:
                    self._apply(layer)
                except BaseException as e:  # noqa: BLE001 - raised by the layer's next forward
                    log.exception("rank %d: update of layer %s failed", self._rank, layer.name)
                    layer.error = e
                if self._timeline is not None:
                    self._timeline.span(f"apply {layer.name}", "update", t0, time.perf_counter())
            layer.ready.set()

    def _apply(self, layer: _Layer) -> None:
        opt = layer.optimizer
        for clone_group, hyper in zip(opt.param_groups, layer.hyper):  # LR schedulers etc.
            clone_group.update(hyper)
        for p, off in zip(layer.params, layer.offsets):
            p.grad = layer.flat[off:off + p.numel()].view_as(p)
        opt.step()
        for p in layer.params:
            p.grad = None

    # ------------------------------------------------------------------ the optimizer's methods
    def _optimizer_step(self, closure=None):
        if closure is not None:
            raise ValueError("PriorityDataParallel: optimizer.step(closure) is not supported")
        missing = [layer.name for layer in self._layers if layer.launched_step != self._step]
        if missing:
            raise RuntimeError(
                f"rank {self._rank}: PriorityDataParallel: layers {missing[:5]} received no "
                f"gradient in step {self._step}: every parameter must get a gradient in every "
                f"step (unused parameters are not supported); was backward() called?")
        self._step += 1

    def _optimizer_zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each layer's gradients are taken (and .grad cleared) as soon as the
        backward pass has produced them; the updater thread may be using its own copy."""
        return None

    # ------------------------------------------------------------------ user side
    def synchronize(self) -> None:
        """Wait until every update started has been applied; raise the first failure."""
        for layer in self._layers:
            layer.ready.wait()
        for layer in self._layers:
            if layer.error is not None:
                err, layer.error = layer.error, None
                raise RuntimeError(f"rank {self._rank}: PriorityDataParallel: the update of layer "
                                   f"{layer.name} failed: {err}") from err

    def state_dict(self, *args, **kwargs):
        self.synchronize()
        return self.module.state_dict(*args, **kwargs)

    def close(self) -> None:
        """Wait for pending updates, remove the hooks and give the optimizer its methods back."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            for h in self._hooks:
                h.remove()
            del self._optimizer.step, self._optimizer.zero_grad  # the class's methods again
            self._updates.put(None)
