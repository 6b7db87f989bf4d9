"""Reductions: ``ReduceMean`` (alias Mean) and ``ReduceSum`` (alias Sum).

    Builder().build_operation("ReduceMean", {"dim": -1, "keepdim": True})

Primitive ops that graphs spelled from primitives need (RMSNorm written as
``x * rsqrt(mean(x * x) + eps) * w``, which the norm fusion rule turns back into
``RmsNorm``). Float inputs reduce in float64 in the reference (fp32 in the kernels
for half types) and round once to the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ShapeError
from .base import FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, f64
from .registry import register_op

__all__ = ["ReduceParams", "ReduceMeanParams", "ReduceSumParams", "reduce_dims"]


@dataclass(frozen=True)
class ReduceParams(Params):
    """``dim``: an int or a list of ints (aliases ``axes``, ``axis``, ``dims``);
    ``keepdim`` keeps reduced dims as size 1 (as torch)."""

    ALIASES = {"axes": "dim", "axis": "dim", "dims": "dim", "keep_dims": "keepdim",
               "keepdims": "keepdim"}
    dim: Any = -1
    keepdim: bool = False
    dtype: Any = None

    def validate(self) -> None:
        d = self.dim
        dims = (int(d),) if isinstance(d, (int, np.integer)) else tuple(int(v) for v in d)
        if not dims or len(set(dims)) != len(dims):
            self.fail("dim", "an int or a non-empty list of distinct ints", repr(self.dim))
        object.__setattr__(self, "dim", dims if len(dims) > 1 else dims[0])
        if not isinstance(self.keepdim, (bool, np.bool_)):
            self.fail("keepdim", "a bool", repr(self.keepdim))


def reduce_dims(op: str, p: ReduceParams, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The reduced dims of an input of ``shape``, non-negative and sorted."""
    rank = len(shape)
    dims = p.dim if isinstance(p.dim, tuple) else (p.dim,)
    out = []
    for d in dims:
        if not -rank <= d < rank:
            raise ShapeError(op, f"dim {d} out of range for input 'x'",
                             f"a dim in [{-rank}, {rank})", f"shape {list(shape)}")
        out.append(d % rank)
    if len(set(out)) != len(out):
        raise ShapeError(op, "dim names one axis twice", "distinct axes", list(dims))
    return tuple(sorted(out))


class _Reduce(OpDef):
    Params = ReduceParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x = ins["x"]
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        if x.rank == 0:
            raise ShapeError(self.name, "input 'x' rank", "rank >= 1", "a scalar")
        dims = reduce_dims(self.name, p, x.shape)
        if p.keepdim:
            shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape))
        else:
            shape = tuple(s for i, s in enumerate(x.shape) if i not in dims)
        return [x.replace(shape=shape)]

    def _np(self, a: np.ndarray, dims: tuple[int, ...], keepdim: bool) -> np.ndarray:
        raise NotImplementedError

    def reference(self, p, ins):
        x = ins["x"]
        dims = reduce_dims(self.name, p, x.shape)
        return [np.asarray(self._np(f64(x), dims, p.keepdim)).astype(x.dtype)]


@dataclass(frozen=True)
class ReduceMeanParams(ReduceParams):
    """ReduceMean's params (errors name ReduceMean)."""


@dataclass(frozen=True)
class ReduceSumParams(ReduceParams):
    """ReduceSum's params (errors name ReduceSum)."""


@register_op
class ReduceMean(_Reduce):
    """Mean over ``dim``."""

    name = "ReduceMean"
    Params = ReduceMeanParams
    aliases = ("Mean", "ReduceMeanOperation")

    def _np(self, a, dims, keepdim):
        return a.mean(axis=dims, keepdims=keepdim)


@register_op
class ReduceSum(_Reduce):
    """Sum over ``dim``."""

    name = "ReduceSum"
    Params = ReduceSumParams
    aliases = ("Sum", "ReduceSumOperation")

    def _np(self, a, dims, keepdim):
        return a.sum(axis=dims, keepdims=keepdim)
