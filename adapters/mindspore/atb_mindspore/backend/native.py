"""MindSpore CPU tensors on atb's C kernels, in place (no copies, no MindSpore ops).

The norms, Linear (few rows), RoPE, ReshapeAndCache, the activations, Softmax and
FusedFeedForward of this backend run the framework-free C kernels
(:mod:`atbcore.backends.cpu_kernels.native_kernels`) when the call suits them
(CPU tensors, fp32/bf16/fp16, contiguous, a built-in activation), and
the MindSpore compositions otherwise (the reason logged at DEBUG). A GraphOp's plan binds
them once: weight and planned-buffer addresses are packed then, and a run reads
only its inputs' ``data_ptr()`` and allocates its outputs, where a MindSpore
PyNative op costs tens of microseconds of dispatch each.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from atbcore.backends.cpu_kernels.bindings import use_omp_team
from atbcore.backends.cpu_kernels.native_kernels import MethodsIO, native_kernels
from atbcore.dtypes import Dtype

from . import MS_KERNELS
# the kernels wrapped below must be registered first
from . import activation, ffn, gather, linear, norm, paged, rope, softmax  # noqa: F401
from . import shape as _shape_kernels  # noqa: F401
from .._env import device_name, mindspore
from .common import note

__all__ = ["MindSporeIO", "host_tensor", "ARRAY"]

# Set on the NumPy-backed tensors atb makes: their address, known when they are made.
# MindSpore's data_ptr() / is_contiguous() wait for its asynchronous op queue (tenths
# of a millisecond each on a busy machine); a decode step reads ~200 addresses.
_ADDRESS = "_atb_address"
ARRAY = "_atb_array"  # ... and the array itself


def host_tensor(a: np.ndarray) -> Any:
    """``Tensor.from_numpy(a)`` (sharing ``a``'s memory; ``a`` contiguous) with its
    address remembered for :class:`MindSporeIO`."""
    t = mindspore().Tensor.from_numpy(a)
    setattr(t, _ADDRESS, a.ctypes.data)
    setattr(t, ARRAY, a)  # its views (Reshape) come from the array, asking MindSpore nothing
    return t


class MindSporeIO(MethodsIO):
    """MindSpore tensors: ``data_ptr()`` and ``stride()`` (``to_dlpack`` synchronises
    and costs ~1 ms in 2.10); outputs are NumPy-backed tensors (``Tensor.from_numpy``
    shares the array's memory)."""

    name = "mindspore"

    def __init__(self) -> None:
        self.ms = mindspore()

    def empty(self, shape: tuple[int, ...], dtype: Dtype) -> Any:
        if dtype is Dtype.BF16:  # MindSpore takes no ml_dtypes array
            return self.ms.mint.empty(shape, dtype=self.ms.bfloat16)
        return host_tensor(np.empty(shape, dtype.numpy))

    def wrap(self, a: np.ndarray) -> Any:
        if a.dtype == Dtype.BF16.numpy:  # MindSpore takes no ml_dtypes array
            return None
        return host_tensor(a)

    def address(self, t: Any) -> int:
        a = getattr(t, _ADDRESS, None)
        return t.data_ptr() if a is None else a

    def is_contiguous(self, t: Any) -> bool:
        return getattr(t, _ADDRESS, None) is not None or t.is_contiguous()

    def why_not(self, t: Any) -> str | None:
        if not isinstance(t, self.ms.Tensor):
            return f"not a MindSpore tensor ({type(t).__name__})"
        if device_name(t) != "cpu":
            return f"on {device_name(t)}"
        if not t.is_contiguous():
            return "a non-contiguous tensor"
        return None

    def note(self, op: str, path: str) -> None:
        note(op, path)


MS_KERNELS.update(native_kernels(MindSporeIO(), MS_KERNELS))

# MindSpore runs this process's ops: torch's OpenMP team (loaded with atbcore) sits
# idle, and a big C matmul handed to it waits whole time slices while MindSpore's
# threads hold the cores (128 rows of the seed MLP: 5-16 ms, erratic); atb's own pool,
# whose caller finishes what a late worker has not claimed, takes them (5.2 ms, steady)
use_omp_team(False)
