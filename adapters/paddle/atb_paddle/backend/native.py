"""Paddle CPU tensors on atb's C kernels, in place (no copies, no Paddle ops).

The norms, Linear (few rows), RoPE, ReshapeAndCache, the activations, Softmax and
FusedFeedForward of this backend run the framework-free C kernels
(:mod:`atbcore.backends.cpu_kernels.native_kernels`) when the call suits them
(CPU tensors, fp32/bf16/fp16, contiguous, a built-in activation), and
the Paddle kernels otherwise (the reason logged at DEBUG). A GraphOp's plan binds
them once: weight and planned-buffer addresses are packed then, and a run reads
only its inputs' ``data_ptr()`` and allocates its outputs.
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import _C_ops

from atbcore.backends.cpu_kernels.bindings import use_omp_team
from atbcore.backends.cpu_kernels.native_kernels import MethodsIO, native_kernels
from atbcore.dtypes import Dtype

from . import PADDLE_KERNELS
from .common import PATHS
# the kernels wrapped below must be registered first
from . import activation, ffn, linear, norm, paged, rope, shape  # noqa: F401

__all__ = ["PaddleIO"]

_CPU = paddle.CPUPlace()
_DTYPES: dict[Dtype, Any] = {}


def _dtype(dtype: Dtype) -> Any:
    """Paddle's dtype object of ``dtype`` (looked up once)."""
    got = _DTYPES[dtype] = getattr(paddle, dtype.value)
    return got


class PaddleIO(MethodsIO):
    """Paddle tensors: ``data_ptr()`` and ``strides`` (equal to their DLPack view)."""

    name = "paddle"

    def empty(self, shape: tuple[int, ...], dtype: Dtype) -> Any:
        # paddle.empty's own kernel, without its Python wrapper (argument checks and
        # dtype/place conversions cost three times the allocation); CPU only here
        return _C_ops.empty(list(shape), _DTYPES.get(dtype) or _dtype(dtype), _CPU)

    def why_not(self, t: Any) -> str | None:
        if not isinstance(t, paddle.Tensor):
            return f"not a Paddle tensor ({type(t).__name__})"
        if not t.place.is_cpu_place():
            return f"on {t.place}"
        if not t.is_contiguous():
            return "a non-contiguous tensor"
        return None

    def note(self, op: str, path: str) -> None:
        PATHS[(op, "native")] += 1


PADDLE_KERNELS.update(native_kernels(PaddleIO(), PADDLE_KERNELS))

# Paddle runs this process's ops: torch's OpenMP team (loaded with atbcore) sits idle,
# and a big C matmul handed to it waits whole time slices while Paddle's threads hold
# the cores (128 rows of the seed MLP: 12-17 ms); atb's own pool, whose caller
# finishes what a late worker has not claimed, takes them (4.8-5.2 ms)
use_omp_team(False)
