"""NumPy views of a caller's tensor that leave the tensor as it was.

``Tensor.numpy()`` marks the tensor's storage non-resizable for good (torch 2.x: a NumPy array
may point into it), so a tensor that went through a collective could no longer be resized
(``resize_``: "Trying to resize storage that is not resizable"; torch's
``batched_powerSGD_hook`` resizes its input), where after Gloo it still can. These views are
made from the tensor's address instead: no copy, the storage untouched, and the tensor kept
alive as long as the view is (the array's base holds it). ``address_view``, for a view used
only during a call while its tensor is there, holds nothing and is cached per address.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch


class _Pointer:
    """What ``np.asarray`` reads a view from (the array interface), holding the tensor."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, typestr: str, shape: tuple, strides: tuple | None):
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": shape,
                                    "typestr": typestr, "strides": strides, "version": 3}


_DTYPES: dict = {}


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype torch's ``numpy()`` gives ``dtype`` (TypeError where there is none:
    bfloat16)."""
    dt = _DTYPES.get(dtype)
    if dt is None:
        dt = _DTYPES[dtype] = torch.empty((), dtype=dtype).numpy().dtype
    return dt


def np_view(t: torch.Tensor, dtype=None) -> np.ndarray:
    """A writable NumPy view of CPU tensor ``t`` (its shape and strides), as ``t.numpy()``
    gives but without pinning its storage; ``dtype``: the NumPy dtype of its elements (default:
    the one torch's ``numpy()`` would give)."""
    t = t.detach()
    dt = np.dtype(dtype) if dtype is not None else _np_dtype(t.dtype)
    es = t.element_size()
    if dt.itemsize != es:
        raise ValueError(f"np_view: {dt} elements are {dt.itemsize} bytes, the tensor's {es}")
    strides = None if t.is_contiguous() else tuple(s * es for s in t.stride())
    return np.asarray(_Pointer(t, dt.str, tuple(t.shape), strides))


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes, without a copy (the tensor
    stays resizable; the view keeps it alive)."""
    n = t.numel() * t.element_size()
    if n == 0:  # an empty tensor may carry any stride; there are no bytes to view
        return memoryview(bytearray(0))
    if not t.is_contiguous():  # a copy, as reshape gives: what was sent/received before
        t = t.reshape(-1)
    return memoryview(np.asarray(_Pointer(t.detach(), "|u1", (n,), None)))


_AT: dict = {}


def address_view(ptr: int, npdt, n: int) -> np.ndarray:
    """A writable NumPy view of ``n`` elements of ``npdt`` at address ``ptr`` (a contiguous CPU
    tensor's ``data_ptr()``), holding nothing: for use only while that tensor is there. What a
    job repeats is cached per address, dtype and size (a small op's result view costs a lookup,
    not np_view's few microseconds)."""
    key = (ptr, npdt, n)
    v = _AT.get(key)
    if v is None:
        if len(_AT) > 64:
            _AT.clear()
        v = _AT[key] = np.frombuffer((ctypes.c_char * (n * np.dtype(npdt).itemsize))
                                     .from_address(ptr), dtype=npdt)
    return v


__all__ = ["np_view", "byte_view", "address_view"]
