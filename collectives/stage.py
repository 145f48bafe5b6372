"""Staging: the caller's tensors as the contiguous CPU tensors the algorithms use, and the
results copied back."""
from __future__ import annotations

import torch


class Stage:
    """Maps the caller's tensors to contiguous CPU tensors the algorithms can use.

    CUDA tensors are staged through pinned host memory; non-contiguous ones through a
    contiguous copy. Inputs are captured when the op is called; outputs are copied back to
    the caller's tensors when the op has finished (``finish``)."""

    __slots__ = ("_rank", "_what", "_back", "devices")
    #: What a Work waits on beyond the op's end (work.on_streams): nothing, the copies back
    #: are done by then (a pipelined op's ``pipeline.Staged`` has one).
    sync = None

    def __init__(self, rank: int | None = None, what: str = ""):
        self._rank = rank  # for errors: "rank R: op"
        self._what = what
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.devices: list | None = None

    def _note_device(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" and self.devices is None:
            self.devices = [t.device]

    def inp(self, t: torch.Tensor) -> torch.Tensor:
        self._note_device(t)
        if t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            host.copy_(t)  # a blocking copy: ordered after the caller's stream
            return host
        return t.detach() if t.is_contiguous() else t.detach().contiguous()

    def out(self, t: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """A tensor to write the result into; ``keep``: it starts with t's contents."""
        # Elements that share memory (expand(), as_strided with stride 0) cannot each receive
        # a result: refused here, on the caller's thread before anything is sent, so that the
        # group stays usable (copying back after the op failed and broke the group).
        # (A contiguous tensor has none: the check is skipped for the common case.)
        if t.numel() > 1 and not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
            who = "linerate" if self._rank is None else f"rank {self._rank}"
            raise ValueError(f"{who}{': ' + self._what if self._what else ''}: the output tensor {str(t.dtype).replace('torch.', '')}"
                             f"{list(t.shape)} has elements that share memory (strides "
                             f"{tuple(t.stride())}, e.g. from expand()); pass a tensor that owns "
                             f"each element (.clone() it)")
        self._note_device(t)
        if t.device.type == "cpu" and t.is_contiguous():
            return t.detach()
        if t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        else:
            host = torch.empty(t.shape, dtype=t.dtype)
        if keep:
            host.copy_(t)
        self._back.append((t, host))
        return host

    def finish(self) -> None:
        for dst, src in self._back:
            with torch.no_grad():
                dst.copy_(src)
