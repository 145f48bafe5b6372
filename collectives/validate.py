"""What a process group checks of a call before anything is sent: each check raises a
ValueError or TypeError naming this rank, the op and what is wrong (dtype, shape, root, peer,
tag), on the caller's thread, so a refused call leaves the group usable."""
from __future__ import annotations

import math

import torch

from .reduce_ops import SUPPORTED, check_dtype, check_op

#: The largest point-to-point tag.
MAX_TAG = (1 << 63) - 1
#: (reduce op, dtype) pairs already checked (check_op), so that a call pays a set lookup.
_VALID_OPS: set = set()


def desc(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} dtype {str(t.dtype).replace('torch.', '')}"


class Checks:
    """The checks, as methods of the process group (``_rank``, ``_size``)."""

    _rank: int
    _size: int

    def _check_tensor(self, t, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rank {self._rank}: {what}: expected a tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED:
            check_dtype(t.dtype, f"rank {self._rank}: {what}")
        if t.is_sparse:
            raise ValueError(f"rank {self._rank}: {what}: sparse tensors are not supported")

    def _check_op(self, op, t: torch.Tensor, what: str) -> None:
        """check_op, once per (op, dtype) pair: the message is built only for a refusal."""
        if (op, t.dtype) not in _VALID_OPS:
            check_op(op, t.dtype, f"rank {self._rank}: {what} of {desc(t)}")
            _VALID_OPS.add((op, t.dtype))

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"rank {self._rank}: {what}: root rank {root} is not in the group "
                             f"of size {self._size}")

    def _check_same(self, ref: torch.Tensor, t: torch.Tensor, what: str, numel: int | None = None) -> None:
        if t.dtype != ref.dtype:
            raise ValueError(f"rank {self._rank}: {what}: dtype {t.dtype} differs from the input's "
                             f"{ref.dtype}")
        want = ref.numel() if numel is None else numel
        if t.numel() != want:
            raise ValueError(f"rank {self._rank}: {what}: {desc(t)} has {t.numel()} elements, "
                             f"expected {want} (input {desc(ref)})")

    def _single(self, tensors, what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"rank {self._rank}: {what}: expected one tensor per call, got {len(tensors)}")
        self._check_tensor(tensors[0], what)
        return tensors[0]

    def _check_out(self, tensor: torch.Tensor, out, what: str) -> None:
        """``out`` of an out-of-place op: a dense tensor like ``tensor``, on its device, apart
        from it in memory."""
        me = self._rank
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"rank {me}: {what}: out must be a tensor, got {type(out).__name__}")
        if out.layout != torch.strided:
            raise ValueError(f"rank {me}: {what}: out is {out.layout} (dense only)")
        if out.dtype != tensor.dtype or out.shape != tensor.shape or out.device != tensor.device:
            raise ValueError(f"rank {me}: {what}: out {desc(out)} on {out.device} must match the "
                             f"tensor {desc(tensor)} on {tensor.device}")
        if out.numel() and tensor.numel():
            a0, a1 = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
            b0, b1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
            if a0 < b1 and b0 < a1:
                raise ValueError(f"rank {me}: {what}: out overlaps the tensor in memory; pass "
                                 f"a separate buffer, or no out to mix in place")

    def _splits(self, t: torch.Tensor, splits, what: str) -> list[int]:
        P = self._size
        rows = t.shape[0] if t.dim() > 0 else t.numel()
        if not splits:
            if rows % P:
                raise ValueError(f"rank {self._rank}: all_to_all_single: {what} {desc(t)}: dim 0 ({rows}) "
                                 f"is not divisible by the group size {P}; pass split sizes")
            return [rows // P] * P
        splits = [int(s) for s in splits]
        if len(splits) != P or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"rank {self._rank}: all_to_all_single: {what} split sizes {splits} must be "
                             f"{P} non-negative numbers summing to dim 0 of {desc(t)}")
        return splits

    @staticmethod
    def _split_views(t: torch.Tensor, splits: list[int]) -> list[torch.Tensor]:
        row = math.prod(t.shape[1:]) if t.dim() > 0 else 1
        flat = t.view(-1)
        views, off = [], 0
        for s in splits:
            views.append(flat[off * row:(off + s) * row])
            off += s
        return views

    def _check_p2p(self, tensors, peer, tag, what: str) -> torch.Tensor:
        t = self._single(tensors, what)
        if peer is not None and (not 0 <= peer < self._size or peer == self._rank):
            raise ValueError(f"rank {self._rank}: {what}: invalid peer rank {peer} (group size "
                             f"{self._size}, own rank {self._rank})")
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"rank {self._rank}: {what}: tag {tag} must be in [0, 2^63)")
        return t
