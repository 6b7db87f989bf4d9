"""Normalisation ops: LayerNorm, RmsNorm and their fused residual-add forms.

AddLayerNorm / AddRmsNorm compute ``s = x + residual`` and return ``(norm(s), s)``
so the sum can feed the next residual without a second pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..dtypes import Dtype
from ..tensor import TensorDesc
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, expect_shape,
                   f64)
from .registry import register_op

__all__ = ["LayerNormParams", "RmsNormParams"]


def _norm_shape(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, (int, np.integer)):
        return (int(v),)
    return tuple(int(s) for s in v)


@dataclass(frozen=True)
class LayerNormParams(Params):
    """``eps``; ``normalized_shape`` (alias ``hidden_size``; inferred from the
    weight or the last dim when omitted); ``elementwise_affine``; optional ``dtype``."""

    ALIASES = {"hidden_size": "normalized_shape"}
    normalized_shape: Any = None
    eps: float = 1e-5
    elementwise_affine: bool = True
    dtype: Dtype | None = None

    def validate(self) -> None:
        object.__setattr__(self, "normalized_shape", _norm_shape(self.normalized_shape))
        if self.normalized_shape is not None and any(s <= 0 for s in self.normalized_shape):
            self.fail("normalized_shape", "positive sizes", self.normalized_shape)
        if not self.eps > 0:
            self.fail("eps", "> 0", self.eps)


@dataclass(frozen=True)
class RmsNormParams(Params):
    """``eps``; ``normalized_shape`` (alias ``hidden_size``); ``weight_offset``
    (1.0 for Gemma-style ``(1 + w)``); optional ``dtype``."""

    ALIASES = {"hidden_size": "normalized_shape"}
    normalized_shape: Any = None
    eps: float = 1e-6
    weight_offset: float = 0.0
    dtype: Dtype | None = None

    def validate(self) -> None:
        object.__setattr__(self, "normalized_shape", _norm_shape(self.normalized_shape))
        if self.normalized_shape is not None and any(s <= 0 for s in self.normalized_shape):
            self.fail("normalized_shape", "positive sizes", self.normalized_shape)
        if not self.eps > 0:
            self.fail("eps", "> 0", self.eps)


def _check_norm(op: OpDef, p: Any, ins: Mapping[str, TensorDesc | None],
                residual: bool) -> TensorDesc:
    x = ins["x"]
    assert x is not None
    expect_dtype(op.name, "x", x, FLOAT_DTYPES)
    expect_param_dtype(op.name, p, "x", x)
    norm = p.normalized_shape
    w = ins.get("weight")
    if norm is None:  # normalise over as many trailing dims as the weight has
        n = w.rank if w is not None and 0 < w.rank <= x.rank else 1
        norm = tuple(x.shape[x.rank - n:])
    if x.rank < len(norm) or tuple(x.shape[x.rank - len(norm):]) != tuple(norm):
        from ..errors import ShapeError

        raise ShapeError(op.name, "input 'x' trailing dims (normalized_shape)", list(norm),
                         f"shape {list(x.shape)}")
    for name in ("weight", "bias"):
        d = ins.get(name)
        if d is not None:
            expect_dtype(op.name, name, d, FLOAT_DTYPES)
            expect_shape(op.name, name, d, norm)
    if residual:
        r = ins["residual"]
        assert r is not None
        expect_shape(op.name, "residual", r, x.shape)
        from .base import expect_same_dtype

        expect_same_dtype(op.name, "x", x, "residual", r)
    return x


def _axes(x: np.ndarray, weight: np.ndarray | None, p: Any) -> tuple[int, ...]:
    n = len(p.normalized_shape) if p.normalized_shape else (weight.ndim if weight is not None else 1)
    return tuple(range(x.ndim - n, x.ndim))


def ref_layer_norm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float,
                   axes: tuple[int, ...]) -> np.ndarray:
    x = f64(x)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if w is not None:
        y = y * f64(w)
    if b is not None:
        y = y + f64(b)
    return y


def ref_rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float, offset: float,
                 axes: tuple[int, ...]) -> np.ndarray:
    x = f64(x)
    y = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    if w is not None:
        y = y * (f64(w) + offset)
    return y


@register_op
class LayerNorm(OpDef):
    name = "LayerNorm"
    aliases = ("LayerNormOperation", "Norm")
    Params = LayerNormParams
    inputs = ("x", "weight?", "bias?")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x = _check_norm(self, p, ins, residual=False)
        return [x]

    def reference(self, p, ins):
        x, w, b = ins["x"], ins["weight"], ins["bias"]
        y = ref_layer_norm(x, w, b, p.eps, _axes(x, w, p))
        return [y.astype(x.dtype)]


@register_op
class RmsNorm(OpDef):
    name = "RmsNorm"
    aliases = ("RMSNorm", "RmsNormOperation")
    Params = RmsNormParams
    inputs = ("x", "weight")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        return [_check_norm(self, p, ins, residual=False)]

    def reference(self, p, ins):
        x, w = ins["x"], ins["weight"]
        return [ref_rms_norm(x, w, p.eps, p.weight_offset, _axes(x, w, p)).astype(x.dtype)]


@register_op
class AddLayerNorm(OpDef):
    name = "AddLayerNorm"
    aliases = ("AddLayerNormOperation",)
    Params = LayerNormParams
    inputs = ("x", "residual", "weight?", "bias?")
    outputs = ("y", "sum")

    def infer_shape(self, p, ins):
        x = _check_norm(self, p, ins, residual=True)
        return [x, x]

    def reference(self, p, ins):
        x, r, w, b = ins["x"], ins["residual"], ins["weight"], ins["bias"]
        s = (f64(x) + f64(r)).astype(x.dtype)  # the sum is materialised in x's dtype
        y = ref_layer_norm(s, w, b, p.eps, _axes(x, w, p))
        return [y.astype(x.dtype), s]


@register_op
class AddRmsNorm(OpDef):
    name = "AddRmsNorm"
    aliases = ("AddRMSNorm", "AddRmsNormOperation")
    Params = RmsNormParams
    inputs = ("x", "residual", "weight")
    outputs = ("y", "sum")

    def infer_shape(self, p, ins):
        x = _check_norm(self, p, ins, residual=True)
        return [x, x]

    def reference(self, p, ins):
        x, r, w = ins["x"], ins["residual"], ins["weight"]
        s = (f64(x) + f64(r)).astype(x.dtype)
        y = ref_rms_norm(s, w, p.eps, p.weight_offset, _axes(x, w, p))
        return [y.astype(x.dtype), s]
