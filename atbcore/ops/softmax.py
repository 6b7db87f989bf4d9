"""Softmax and ScaledMaskedSoftmax.

Both compute in fp32 (reference: float64) with the maximum subtracted first, and
round once to the input dtype. ``dim`` may name several axes; the softmax then
runs over all of them jointly.

``ScaledMaskedSoftmax``: ``softmax(x * scale + mask)`` where ``mask`` is additive
(float) or boolean (True = keep, as torch SDPA), broadcastable to ``x``; ``causal``
masks the last two axes ``[..., Sq, Sk]`` bottom-right aligned (query ``i`` sees
keys ``j <= i + Sk - Sq``). A row with every element masked gives zeros, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, ParamsError, ShapeError
from ..tensor import TensorDesc
from .base import FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, f64
from .registry import register_op

__all__ = ["SoftmaxParams", "ScaledMaskedSoftmaxParams", "softmax_axes", "ref_softmax",
           "causal_keep"]


def _dims(op: str, v: Any) -> tuple[int, ...]:
    if isinstance(v, (int, np.integer)):
        v = (v,)
    dims = tuple(v) if isinstance(v, (tuple, list)) else None
    if not dims or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
        raise ParamsError(op, "parameter 'dim'", "an int or a non-empty sequence of ints", repr(v))
    return tuple(int(d) for d in dims)


@dataclass(frozen=True)
class SoftmaxParams(Params):
    """``dim`` (aliases ``axes``, ``axis``): an axis or a sequence of axes,
    normalised to a tuple; optional ``dtype``."""

    ALIASES = {"axes": "dim", "axis": "dim"}
    dim: Any = -1
    dtype: Dtype | None = None

    def validate(self) -> None:
        object.__setattr__(self, "dim", _dims(self.OP, self.dim))


@dataclass(frozen=True)
class ScaledMaskedSoftmaxParams(SoftmaxParams):
    """``scale`` (multiplies x before the mask), ``causal`` (alias ``is_causal``),
    ``dim``, optional ``dtype``."""

    scale: float = 1.0
    causal: bool = False

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.scale, (int, float, np.floating)) or not np.isfinite(self.scale):
            self.fail("parameter 'scale'", "a finite number", repr(self.scale))
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "causal", bool(self.causal))


def softmax_axes(op: str, p: SoftmaxParams, x: TensorDesc) -> tuple[int, ...]:
    """``p.dim`` as sorted non-negative axes of ``x``; errors name ``op``."""
    r = x.rank
    if any(not -r <= d < r for d in p.dim):
        raise ShapeError(op, f"input 'x' rank (softmax dim {list(p.dim)})",
                         f"rank > {max(d if d >= 0 else -d - 1 for d in p.dim)}",
                         f"shape {list(x.shape)}")
    axes = tuple(sorted(d % r for d in p.dim))
    if len(set(axes)) != len(axes):
        raise ParamsError(op, "parameter 'dim' names an axis twice", "distinct axes",
                          f"{list(p.dim)} for rank {r}")
    return axes


def causal_keep(sq: int, sk: int) -> np.ndarray:
    """Bool [sq, sk]: True where query i may see key j (j <= i + sk - sq)."""
    return np.tril(np.ones((sq, sk), dtype=bool), k=sk - sq)


def ref_softmax(z: np.ndarray, axes: tuple[int, ...], empty_rows_zero: bool) -> np.ndarray:
    """Float64 softmax over ``axes``; rows that are all ``-inf`` give zeros when
    ``empty_rows_zero`` (masked rows), NaN otherwise (the plain mathematical result)."""
    m = z.max(axis=axes, keepdims=True)
    empty = np.isneginf(m)
    with np.errstate(invalid="ignore"):
        e = np.exp(z - np.where(empty & empty_rows_zero, 0.0, m))
        s = e.sum(axis=axes, keepdims=True)
        return e / np.where(empty & empty_rows_zero, 1.0, s)


@register_op
class Softmax(OpDef):
    """``softmax(x)`` over ``dim``, fp32 compute."""

    name = "Softmax"
    aliases = ("SoftmaxOperation",)
    Params = SoftmaxParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x = ins["x"]
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        softmax_axes(self.name, p, x)
        return [x]

    def reference(self, p, ins):
        x = ins["x"]
        axes = softmax_axes(self.name, p, TensorDesc.of(x))
        return [ref_softmax(f64(x), axes, empty_rows_zero=False).astype(x.dtype)]


@register_op
class ScaledMaskedSoftmax(OpDef):
    """``softmax(x * scale + mask)`` with an optional additive/bool mask and causal."""

    name = "ScaledMaskedSoftmax"
    aliases = ("MaskedSoftmax", "ScaledMaskedSoftmaxOperation")
    Params = ScaledMaskedSoftmaxParams
    inputs = ("x", "mask?")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x, mask = ins["x"], ins.get("mask")
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        axes = softmax_axes(self.name, p, x)
        if p.causal:
            if x.rank < 2:
                raise ShapeError(self.name, "input 'x' rank (causal masks [..., Sq, Sk])",
                                 "rank >= 2", f"shape {list(x.shape)}")
            if axes != (x.rank - 1,):
                raise ParamsError(self.name, "causal softmax runs over the last axis only",
                                  f"dim -1 (or {x.rank - 1})", list(p.dim))
        if mask is not None:
            if mask.dtype != Dtype.BOOL and mask.dtype not in FLOAT_DTYPES:
                raise DtypeError(self.name, "input 'mask' dtype", "BOOL (True = keep) or a float "
                                 "(additive)", mask.dtype.name)
            try:
                ok = np.broadcast_shapes(tuple(mask.shape), tuple(x.shape)) == tuple(x.shape)
            except ValueError:
                ok = False
            if not ok:
                raise ShapeError(self.name, "input 'mask' shape (must broadcast to x)",
                                 f"broadcastable to {list(x.shape)}", list(mask.shape))
        return [x]

    def reference(self, p, ins):
        x, mask = ins["x"], ins.get("mask")
        axes = softmax_axes(self.name, p, TensorDesc.of(x))
        z = f64(x) * p.scale
        if mask is not None:
            mask = np.asarray(mask)
            z = np.where(mask, z, -np.inf) if mask.dtype == bool else z + f64(mask)
        if p.causal:
            z = np.where(causal_keep(*z.shape[-2:]), z, -np.inf)
        masked = mask is not None or p.causal
        return [ref_softmax(z, axes, empty_rows_zero=masked).astype(x.dtype)]
