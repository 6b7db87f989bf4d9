"""Framework-free views of tensors for the C kernels: address, shape, element strides
and dtype, read without a copy from NumPy arrays, DLPack producers (torch, Paddle,
anything with ``__dlpack__``) and MindSpore tensors.

The C kernels take addresses and sizes only (:mod:`.bindings`), so any framework's
CPU tensor can reach them once it is seen as a :class:`NativeView`::

    v = view_of(np.ones((2, 8), np.float32))
    v.address == arr.ctypes.data, v.shape, v.strides  # (2, 8), (8, 1) in elements

Two readers give the same view (tests compare them):

* :func:`dlpack_view` — the portable one: asks the tensor for a DLPack capsule and
  reads its ``DLTensor`` with ctypes (the capsule, kept in ``owner``, frees the
  producer's context when it is dropped; nothing is consumed);
* the framework's own attributes (``__array_interface__``, ``data_ptr()`` and
  strides): a few hundred ns where a capsule costs microseconds (and ~1 ms on
  MindSpore 2.10, whose ``to_dlpack`` synchronises), so plans use these per call.

This module also holds what every caller of the C kernels shares, whatever its
tensors: the dtype codes of ``csrc/common.h``, the argument-block layouts, the
status check and the thread count.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...dtypes import Dtype
from ...errors import DeviceError, DtypeError, InputError

__all__ = ["NativeView", "view_of", "dlpack_view", "array_view", "DTYPE_CODES",
           "WEIGHT_CODES", "BOOL_CODE", "ACT_CODES", "PANEL", "NORM", "ACT_HEAD", "ACT",
           "LINEAR_HEAD", "LINEAR_TAIL", "LINEAR", "CACHE", "SOFTMAX", "SM_DIMS", "Q",
           "check_status", "pool_threads", "contiguous_strides"]

# ATB_F32 / ATB_BF16 / ATB_F16 / ATB_BOOL in csrc/common.h; int8 weights are code 4
DTYPE_CODES = {Dtype.FP32: 0, Dtype.BF16: 1, Dtype.FP16: 2}
BOOL_CODE = 3
WEIGHT_CODES = {**DTYPE_CODES, Dtype.INT8: 4}
ACT_CODES = {"silu": 0, "swish": 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3, "relu": 4,
             "none": 5}
PANEL = 32   # ATB_PANEL in linear.c: outputs per panel of a packed weight
SM_DIMS = 8  # ATB_SM_DIMS in softmax.c

# The argument blocks (8-byte fields, see bindings.py), in the C structs' order.
Q = struct.Struct("<q")
NORM = struct.Struct("<16q2d")              # NormArgs (norm.c)
ACT_HEAD = struct.Struct("<13q")            # ActArgs up to its thread count (act.c)
LINEAR_HEAD = struct.Struct("<15q")         # LinArgs up to its thread count (linear.h)
LINEAR_TAIL = struct.Struct("<4q2d6q")      # LinArgs after it
LINEAR = struct.Struct("<20q2d6q")          # all of LinArgs
ACT = struct.Struct("<14q")                 # all of ActArgs
CACHE = struct.Struct("<17q")               # CacheArgs (cache.c)
SOFTMAX = struct.Struct(f"<13q{2 * SM_DIMS}qqd")  # SoftmaxArgs (softmax.c)


def check_status(status: int, what: str) -> None:
    """Raise for a C kernel's refusal (callers check every argument first, so a
    refusal is a missed check; -4 is a failed scratch allocation)."""
    if status == -4:
        raise MemoryError(f"{what}: the C kernel could not allocate its scratch memory")
    if status != 0:
        raise InputError(what, "arguments refused by the C kernel", "0 (accepted)",
                         f"status {status}")


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_CPUS = _cpu_count()
_TORCH_THREADS: list = []  # .threads.pool_threads once torch is loaded


def pool_threads() -> int:
    """Threads the C pool may use: torch's intra-op count where torch is loaded (its
    parking logic steers it, see :mod:`.threads`), else the CPUs this process may use."""
    if _TORCH_THREADS:
        return _TORCH_THREADS[0]()
    if "torch" in sys.modules:
        from .threads import pool_threads as torch_pool_threads

        _TORCH_THREADS.append(torch_pool_threads)
        return torch_pool_threads()
    return _CPUS


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class NativeView:
    """A CPU tensor as the C kernels see it: ``address`` of element 0, ``shape``,
    ``strides`` in elements, ``dtype``; ``owner`` keeps the memory alive."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Dtype
    owner: Any = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def contiguous(self) -> bool:
        """Row-major without gaps (size-1 dims may have any stride)."""
        acc = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != acc:
                return False
            acc *= d
        return True


# ----------------------------------------------------------------------------- DLPack
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_GET_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_GET_POINTER.restype = ctypes.c_void_p
_GET_POINTER.argtypes = [ctypes.py_object, ctypes.c_char_p]
_IS_VALID = ctypes.pythonapi.PyCapsule_IsValid
_IS_VALID.restype = ctypes.c_int
_IS_VALID.argtypes = [ctypes.py_object, ctypes.c_char_p]

_DL_CPU = 1
# (DLDataTypeCode, bits) -> Dtype; kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6
_DL_DTYPES = {(2, 32): Dtype.FP32, (2, 16): Dtype.FP16, (4, 16): Dtype.BF16,
              (2, 64): Dtype.FP64, (0, 8): Dtype.INT8, (1, 8): Dtype.UINT8,
              (0, 32): Dtype.INT32, (0, 64): Dtype.INT64, (6, 8): Dtype.BOOL,
              (1, 1): Dtype.BOOL}


def _capsule(x: Any) -> Any:
    if hasattr(x, "__dlpack__"):
        return x.__dlpack__()
    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(x, ms.Tensor):
        return ms.to_dlpack(x)  # MindSpore speaks DLPack through capsules only
    if type(x).__name__ == "PyCapsule":
        return x
    raise InputError("native view", "tensor", "a NumPy array or a DLPack producer",
                     type(x).__name__)


def dlpack_view(x: Any) -> NativeView:
    """``x`` (a DLPack producer, or a ``"dltensor"`` capsule) as a :class:`NativeView`
    read from its ``DLTensor``; the capsule is kept in ``owner`` and not consumed."""
    cap = _capsule(x)
    if not _IS_VALID(cap, b"dltensor"):
        raise InputError("native view", "DLPack capsule", "an unconsumed 'dltensor' capsule",
                         repr(cap))
    t = _DLTensor.from_address(_GET_POINTER(cap, b"dltensor"))  # DLManagedTensor starts with it
    if t.device.device_type != _DL_CPU:
        raise DeviceError("native view", "DLPack device type", f"{_DL_CPU} (CPU)",
                          t.device.device_type)
    key = (t.dtype.code, t.dtype.bits)
    if key not in _DL_DTYPES or t.dtype.lanes != 1:
        raise DtypeError("native view", "DLPack dtype", "a scalar numeric type",
                         f"code {t.dtype.code}, {t.dtype.bits} bits x {t.dtype.lanes}")
    dt = _DL_DTYPES[key]
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (tuple(t.strides[i] for i in range(t.ndim)) if t.strides
               else contiguous_strides(shape))
    return NativeView((t.data or 0) + t.byte_offset, shape, strides, dt, (cap, x))


# -------------------------------------------------------------- the frameworks' own attributes
def array_view(a: np.ndarray) -> NativeView:
    """A NumPy array through its array interface (native byte order only)."""
    if not a.dtype.isnative:
        raise DtypeError("native view", "byte order", "the machine's", a.dtype.str)
    size = a.itemsize
    return NativeView(a.__array_interface__["data"][0], a.shape,
                      tuple(s // size for s in a.strides), Dtype.of(a.dtype), a)


_DTYPE_NAMES: dict[Any, Dtype] = {}


def _dtype(d: Any) -> Dtype:
    dt = _DTYPE_NAMES.get(d)
    if dt is None:
        dt = _DTYPE_NAMES[d] = Dtype.of(str(d).lower().replace("paddle.", "").replace(
            "torch.", ""))
    return dt


def view_of(x: Any) -> NativeView:
    """Any supported CPU tensor as a :class:`NativeView` (no copy): NumPy by its array
    interface, torch / Paddle / MindSpore by their ``data_ptr()`` and strides, any
    other DLPack producer by :func:`dlpack_view`."""
    if isinstance(x, np.ndarray):
        return array_view(x)
    mod = type(x).__module__
    if mod.startswith("torch"):
        if x.device.type != "cpu":
            raise DeviceError("native view", "tensor device", "cpu", str(x.device))
        return NativeView(x.data_ptr(), tuple(x.shape), tuple(x.stride()), _dtype(x.dtype), x)
    if mod.startswith("paddle"):
        if not x.place.is_cpu_place():
            raise DeviceError("native view", "tensor device", "cpu", str(x.place))
        return NativeView(x.data_ptr(), tuple(x.shape), tuple(x.strides), _dtype(x.dtype), x)
    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(x, ms.Tensor):
        return NativeView(x.data_ptr(), tuple(x.shape), tuple(x.stride()), _dtype(x.dtype), x)
    return dlpack_view(x)
