"""Reduction operators: which (op, dtype) pairs are valid, and the in-place kernel."""
from __future__ import annotations

import contextvars

import numpy as np
import torch
import torch.distributed as dist

from .views import address_view, np_view

RedOpType = dist.ReduceOp.RedOpType

SUPPORTED_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)
#: The same, for a membership test.
SUPPORTED = frozenset(SUPPORTED_DTYPES)

_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


def op_type(op) -> RedOpType:
    """Normalise what torch passes (ReduceOp object, RedOpType, or the user's ReduceOp.X)."""
    inner = getattr(op, "op", None)
    if isinstance(inner, RedOpType):
        return inner
    if isinstance(op, RedOpType):
        return op
    raise ValueError(f"unsupported reduce op {op!r}")


_NAMES: dict = {}


def op_name(op: RedOpType) -> str:
    # cached: str() of the pybind enum is costly, and it would be paid on every async
    # all_reduce issued
    name = _NAMES.get(op)
    if name is None:
        name = _NAMES[op] = str(op).rsplit(".", 1)[-1]
    return name


def check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in SUPPORTED:
        raise TypeError(f"{what}: dtype {dtype} is not supported by linerate (supported: "
                        f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)})")


def check_op(op: RedOpType, dtype: torch.dtype, what: str) -> None:
    """Raise a ValueError naming the op and dtype for combinations that have no meaning."""
    check_dtype(dtype, what)
    if op == RedOpType.PREMUL_SUM:
        raise ValueError(f"{what}: ReduceOp.PREMUL_SUM is not supported by linerate "
                         f"(scale the tensor, then use SUM)")
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{what}: ReduceOp.{op_name(op)} needs an integer or bool tensor, got {dtype}")
    if op in (RedOpType.MIN, RedOpType.MAX) and dtype.is_complex:
        raise ValueError(f"{what}: ReduceOp.{op_name(op)} is not defined for complex dtype {dtype}")
    if op == RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{what}: ReduceOp.AVG needs a floating point or complex tensor, got {dtype} "
                         f"(use SUM and divide)")
    if op not in (RedOpType.SUM, RedOpType.AVG, RedOpType.PRODUCT, RedOpType.MIN, RedOpType.MAX,
                  *_BITWISE):
        raise ValueError(f"{what}: unsupported reduce op {op_name(op)}")


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: RedOpType) -> None:
    """dst = dst (op) src, in place. AVG accumulates as SUM; call finish_avg afterwards."""
    if op == RedOpType.SUM or op == RedOpType.AVG:
        if dst.dtype == torch.bool:
            dst.logical_or_(src)
        else:
            dst.add_(src)
    elif op == RedOpType.PRODUCT:
        if dst.dtype == torch.bool:
            dst.logical_and_(src)
        else:
            dst.mul_(src)
    elif op == RedOpType.MIN:
        torch.minimum(dst, src, out=dst)
    elif op == RedOpType.MAX:
        torch.maximum(dst, src, out=dst)
    elif op == RedOpType.BAND:
        dst.bitwise_and_(src)
    elif op == RedOpType.BOR:
        dst.bitwise_or_(src)
    elif op == RedOpType.BXOR:
        dst.bitwise_xor_(src)
    else:  # check_op rejects these before anything is sent
        raise ValueError(f"unsupported reduce op {op_name(op)}")


def finish_avg(t: torch.Tensor, op: RedOpType, group_size: int) -> None:
    if op == RedOpType.AVG:
        t.div_(group_size)


#: NumPy's dtype for the torch dtypes folded with NumPy (float16 and bfloat16 fold with torch).
NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.complex64: np.complex64,
             torch.complex128: np.complex128, torch.int8: np.int8, torch.uint8: np.uint8,
             torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
             torch.bool: np.bool_}
NP_BINARY = {RedOpType.SUM: np.add, RedOpType.AVG: np.add, RedOpType.PRODUCT: np.multiply,
              RedOpType.MIN: np.minimum, RedOpType.MAX: np.maximum,
              RedOpType.BAND: np.bitwise_and, RedOpType.BOR: np.bitwise_or,
              RedOpType.BXOR: np.bitwise_xor}
NP_BOOL = {RedOpType.SUM: np.logical_or, RedOpType.AVG: np.logical_or,
            RedOpType.PRODUCT: np.logical_and}


def fold_rows(out: torch.Tensor, rows, op: RedOpType, npdt) -> None:
    """out = ((rows[0] op rows[1]) op rows[2]) ...: rank order, as collectives.direct folds,
    with NumPy's loops (one thread, without the GIL; IEEE operations as torch's, so the bits
    are the same). ``rows``: a 2-D array or a list of arrays of NumPy dtype ``npdt``
    (``NP_DTYPES[out.dtype]``); ``out`` a contiguous CPU tensor of that many elements. AVG
    accumulates as SUM (finish_avg divides)."""
    # Not out.numpy(): it pins the storage. A contiguous tensor's view is made from its
    # address (cached: views.address_view), a few microseconds less than np_view's.
    o = (address_view(out.data_ptr(), npdt, out.numel()) if out.is_contiguous()
         else np_view(out, npdt))
    fold_rows_into(o, rows, op, npdt)


def fold_rows_into(o: np.ndarray, rows, op: RedOpType, npdt) -> None:
    """fold_rows into the NumPy array ``o``."""
    if len(rows) == 1:
        o[...] = rows[0]
        return
    f = (NP_BOOL.get(op) if npdt is np.bool_ else None) or NP_BINARY[op]
    if npdt in _NO_WARNINGS:
        _fold_loop(f, o, rows)
        return
    # Overflow gives inf, as in torch and Gloo: no warning (np.errstate(all="ignore"), set
    # through its context variable where NumPy has one: the context manager costs twice the
    # fold of a small all_reduce).
    if _ERRSTATE is None:
        with np.errstate(all="ignore"):
            _fold_loop(f, o, rows)
        return
    token = _ERRSTATE.set(_IGNORE)
    try:
        _fold_loop(f, o, rows)
    finally:
        _ERRSTATE.reset(token)


def _ignore_state():
    """The context variable np.errstate sets and its all="ignore" value (NumPy 2 keeps the
    floating-point error state in one), found as the one variable entering np.errstate
    changes; else (None, None): np.errstate then."""
    before = contextvars.copy_context()
    with np.errstate(all="ignore"):
        inside = contextvars.copy_context()
    changed = [v for v in inside if v not in before or before[v] is not inside[v]]
    if len(changed) != 1:
        return None, None
    return changed[0], inside[changed[0]]


_ERRSTATE, _IGNORE = _ignore_state()


def _fold_loop(f, o: np.ndarray, rows) -> None:
    f(rows[0], rows[1], out=o)
    for i in range(2, len(rows)):
        f(o, rows[i], out=o)


#: NumPy dtypes whose folds never warn (integers wrap, bools saturate): folded without
#: np.errstate, about 1.2 us a call, a sizeable share of a small all_reduce.
_NO_WARNINGS = frozenset((np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_))
