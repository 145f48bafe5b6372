"""What a process group checks of a call before anything is sent: each check raises a
ValueError or TypeError naming this rank, the op and what is wrong (dtype, shape, root, peer,
tag), on the caller's thread, so a refused call leaves the group usable.

Each op's checks are declared once, in ``CHECKS``; ``Checks._validate(op, **arguments)`` runs
them on a call's arguments."""
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


#: Every op's checks, in the order they run, before anything is staged or sent. The key is the
#: op as its errors name it; each check is ``(name, parameters...)``, the parameters naming the
#: call's arguments as the op passes them to ``Checks._validate`` (a list of one tensor where
#: an op takes one). The checks (functions of this module, ``_RULES``):
#:
#: - ``tensor x``, ``tensors xs``: x (each of xs) is a tensor of a supported dtype, not sparse.
#: - ``single xs``: xs is a list of one such tensor.
#: - ``root``: the argument ``root`` is a rank of the group.
#: - ``op xs``: the reduce op (argument ``op``) applies to the dtype of each of xs.
#: - ``root_list xs ys noun``: at the root only, xs is one list of a tensor per rank, each with
#:   the dtype and size of ys[0] ("the root needs a list of P <noun> tensors").
#: - ``gathered xs ys``: xs is one list of a tensor per rank, of ys[0]'s dtype; this rank's
#:   has ys[0]'s size.
#: - ``gathered_coalesced xs ys``: xs holds a list per rank, each with a tensor per tensor of
#:   ys, of its dtype; this rank's have their sizes.
#: - ``into xs ys``: each of xs holds group-size times the elements of its ys (dtype too).
#: - ``from_tensor xs ys``: each of ys holds group-size times the elements of its xs, and the
#:   reduce op applies.
#: - ``pairs xs ys``: as many outputs xs as inputs ys.
#: - ``one_list xs``: xs is a list of one list.
#: - ``scattered xs ys``: ys[0] holds a tensor per rank of xs[0]'s dtype; this rank's has its
#:   size.
#: - ``exchanged xs ys``: a tensor per rank in each, one dtype; this rank's two the same size.
#: - ``exchanged_single x y xs ys``: x and y of one dtype, split by the split sizes xs and ys
#:   (none: evenly) along dim 0; this rank's two pieces the same size.
#: - ``dense_float x``, ``in_weights w``, ``out_peers q``, ``self_weight w``, ``out x y``: a
#:   neighbor all-reduce's tensor, weights, peers, and out-of-place result (if any).
#: - ``peer p``, ``tag t``: a point-to-point peer (None: any) and tag.
CHECKS: dict[str, tuple] = {
    # all_reduce runs these inline (ProcessGroupLinerate.allreduce: the latency-critical path).
    "all_reduce": (("tensors", "tensors"), ("op", "tensors")),
    "all_reduce_coalesced": (("tensors", "tensors"), ("op", "tensors")),
    "neighbor_allreduce": (("dense_float", "tensor"), ("in_weights", "in_weights"),
                           ("out_peers", "out_peers"), ("self_weight", "self_weight"),
                           ("out", "out", "tensor")),
    "broadcast": (("single", "tensors"), ("root",)),
    "reduce": (("single", "tensors"), ("root",), ("op", "tensors")),
    "gather": (("single", "inputs"), ("root",), ("root_list", "outputs", "inputs", "output")),
    "scatter": (("single", "outputs"), ("root",), ("root_list", "inputs", "outputs", "input")),
    "all_gather": (("single", "inputs"), ("gathered", "outputs", "inputs")),
    "all_gather_coalesced": (("gathered_coalesced", "outputs", "inputs"),),
    "all_gather_into_tensor": (("into", "outputs", "inputs"),),
    "all_gather_into_tensor_coalesced": (("into", "outputs", "inputs"),
                                         ("pairs", "outputs", "inputs")),
    "reduce_scatter": (("single", "outputs"), ("one_list", "inputs"), ("op", "outputs"),
                       ("scattered", "outputs", "inputs")),
    "reduce_scatter_tensor": (("from_tensor", "outputs", "inputs"),),
    "reduce_scatter_tensor_coalesced": (("pairs", "outputs", "inputs"),
                                        ("from_tensor", "outputs", "inputs")),
    "all_to_all": (("exchanged", "outputs", "inputs"),),
    "all_to_all_single": (("exchanged_single", "output", "input", "output_splits",
                           "input_splits"),),
    "barrier": (),
    "send": (("single", "tensors"), ("peer", "peer"), ("tag", "tag")),
    "recv": (("single", "tensors"), ("peer", "peer"), ("tag", "tag")),
}

#: The dtypes a neighbor all-reduce mixes.
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _tensor(pg, what, a, x):
    pg._check_tensor(a[x], what)


def _tensors(pg, what, a, xs):
    for t in a[xs]:
        pg._check_tensor(t, what)


def _single(pg, what, a, xs):
    pg._single(a[xs], what)


def _root(pg, what, a):
    pg._check_root(a["root"], what)


def _op(pg, what, a, xs):
    op = a["op"]
    for t in a[xs]:
        pg._check_op(op, t, what)


def _root_list(pg, what, a, xs, ys, noun):
    if pg._rank != a["root"]:
        return
    lists, P = a[xs], pg._size
    if len(lists) != 1 or len(lists[0]) != P:
        raise ValueError(f"rank {pg._rank}: {what}: the root needs a list of {P} {noun} tensors")
    t = a[ys][0]
    for i, x in enumerate(lists[0]):
        pg._check_tensor(x, what)
        pg._check_same(t, x, f"{what} {noun} {i}")


def _gathered(pg, what, a, xs, ys):
    lists, P, me = a[xs], pg._size, pg._rank
    if len(lists) != 1 or len(lists[0]) != P:
        raise ValueError(f"rank {me}: {what}: expected a list of {P} output tensors")
    t = a[ys][0]
    for i, o in enumerate(lists[0]):
        pg._check_tensor(o, what)
        if o.dtype != t.dtype:
            raise ValueError(f"rank {me}: {what}: output {i} has dtype {o.dtype}, input {t.dtype}")
    pg._check_same(t, lists[0][me], f"{what} output {me}")


def _gathered_coalesced(pg, what, a, xs, ys):
    lists, ins, P, me = a[xs], a[ys], pg._size, pg._rank
    if len(lists) != P or any(len(o) != len(ins) for o in lists):
        raise ValueError(f"rank {me}: {what}: expected {P} output lists (one per rank) of "
                         f"{len(ins)} tensors each")
    for j, t in enumerate(ins):
        pg._check_tensor(t, what)
        for i in range(P):
            o = lists[i][j]
            pg._check_tensor(o, what)
            if o.dtype != t.dtype:
                raise ValueError(f"rank {me}: {what}: output dtype {o.dtype} != input {j}'s "
                                 f"{t.dtype}")
        pg._check_same(t, lists[me][j], f"{what} output for input {j}")


def _into(pg, what, a, xs, ys):
    for out, inp in zip(a[xs], a[ys]):
        pg._check_tensor(out, what)
        pg._check_tensor(inp, what)
        pg._check_same(inp, out, f"{what} output", numel=inp.numel() * pg._size)


def _from_tensor(pg, what, a, xs, ys):
    op = a["op"]
    for out, inp in zip(a[xs], a[ys]):
        pg._check_tensor(out, what)
        pg._check_tensor(inp, what)
        pg._check_op(op, out, what)
        pg._check_same(out, inp, f"{what} input", numel=out.numel() * pg._size)


def _pairs(pg, what, a, xs, ys):
    if len(a[xs]) != len(a[ys]):
        raise ValueError(f"rank {pg._rank}: {what}: {len(a[xs])} outputs for {len(a[ys])} inputs")


def _one_list(pg, what, a, xs):
    if len(a[xs]) != 1:
        raise ValueError(f"rank {pg._rank}: {what}: expected one list of inputs")


def _scattered(pg, what, a, xs, ys):
    out, ins, P, me = a[xs][0], a[ys][0], pg._size, pg._rank
    if len(ins) != P:
        raise ValueError(f"rank {me}: {what}: expected {P} input tensors, got {len(ins)}")
    for i, x in enumerate(ins):
        pg._check_tensor(x, what)
        if x.dtype != out.dtype:
            raise ValueError(f"rank {me}: {what}: input {i} has dtype {x.dtype}, output {out.dtype}")
    pg._check_same(out, ins[me], f"{what} input {me}")


def _exchanged(pg, what, a, xs, ys):
    outs, ins, P, me = a[xs], a[ys], pg._size, pg._rank
    if len(outs) != P or len(ins) != P:
        raise ValueError(f"rank {me}: {what}: expected {P} input and {P} output tensors, "
                         f"got {len(ins)} and {len(outs)}")
    ref = ins[0]
    pg._check_tensor(ref, what)
    for t in list(outs) + list(ins):
        pg._check_tensor(t, what)
        if t.dtype != ref.dtype:
            raise ValueError(f"rank {me}: {what}: mixed dtypes {ref.dtype} and {t.dtype}")
    pg._check_same(ins[me], outs[me], f"{what} output {me}")


def _exchanged_single(pg, what, a, x, y, xs, ys):
    output, input, me = a[x], a[y], pg._rank
    pg._check_tensor(output, what)
    pg._check_tensor(input, what)
    if output.dtype != input.dtype:
        raise ValueError(f"rank {me}: {what}: output dtype {output.dtype} != input dtype "
                         f"{input.dtype}")
    sends = pg._splits(input, a[ys], "input")[me] * _row(input)
    gets = pg._splits(output, a[xs], "output")[me] * _row(output)
    if sends != gets:
        raise ValueError(f"rank {me}: {what}: this rank sends itself {sends} elements but "
                         f"expects {gets}")


def _row(t: torch.Tensor) -> int:
    """Elements per index of dim 0 (a scalar: one)."""
    return math.prod(t.shape[1:]) if t.dim() > 0 else 1


def _dense_float(pg, what, a, x):
    t, me = a[x], pg._rank
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rank {me}: {what}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"rank {me}: {what}: {t.layout} tensors are not supported (dense only)")
    if t.dtype not in _FLOATS:
        raise ValueError(f"rank {me}: {what} of {desc(t)}: dtype {t.dtype} is not supported "
                         f"(float32, float64, float16, bfloat16)")


def _in_weights(pg, what, a, x):
    me, size = pg._rank, pg._size
    for j, w in sorted(a[x].items()):
        if not isinstance(j, int) or not 0 <= j < size or j == me:
            raise ValueError(f"rank {me}: {what}: in-neighbor {j!r} is not another rank of the "
                             f"group of size {size}")
        if not math.isfinite(float(w)):
            raise ValueError(f"rank {me}: {what}: weight {w!r} of in-neighbor {j} is not finite")


def _out_peers(pg, what, a, x):
    me, size = pg._rank, pg._size
    outs = [int(q) for q in a[x]]
    if any(not 0 <= q < size or q == me for q in outs) or len(set(outs)) != len(outs):
        raise ValueError(f"rank {me}: {what}: out-peers {outs} must be distinct other ranks of "
                         f"the group of size {size}")


def _self_weight(pg, what, a, x):
    if not math.isfinite(float(a[x])):
        raise ValueError(f"rank {pg._rank}: {what}: self weight {a[x]!r} is not finite")


def _out(pg, what, a, x, y):
    if a[x] is not None:
        pg._check_out(a[y], a[x], what)


def _peer(pg, what, a, x):
    peer = a[x]
    if peer is not None and (not 0 <= peer < pg._size or peer == pg._rank):
        raise ValueError(f"rank {pg._rank}: {what}: invalid peer rank {peer} (group size "
                         f"{pg._size}, own rank {pg._rank})")


def _tag(pg, what, a, x):
    tag = a[x]
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"rank {pg._rank}: {what}: tag {tag} must be in [0, 2^63)")


#: The checks by name (CHECKS): ``check(pg, op, arguments, *parameters)``.
_RULES = {
    "tensor": _tensor, "tensors": _tensors, "single": _single, "root": _root, "op": _op,
    "root_list": _root_list, "gathered": _gathered, "gathered_coalesced": _gathered_coalesced,
    "into": _into, "from_tensor": _from_tensor, "pairs": _pairs, "one_list": _one_list,
    "scattered": _scattered, "exchanged": _exchanged, "exchanged_single": _exchanged_single,
    "dense_float": _dense_float, "in_weights": _in_weights, "out_peers": _out_peers,
    "self_weight": _self_weight, "out": _out, "peer": _peer, "tag": _tag,
}
#: CHECKS with each check's function looked up (an unknown name fails at import).
_PLANS = {op: tuple((_RULES[name], tuple(params)) for name, *params in checks)
          for op, checks in CHECKS.items()}


class Checks:
    """The checks, as methods of the process group (``_rank``, ``_size``)."""

    _rank: int
    _size: int

    def _validate(self, what: str, **args) -> None:
        """Run op ``what``'s checks (``CHECKS``) on the call's arguments ``args``."""
        for check, params in _PLANS[what]:
            check(self, what, args, *params)

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
