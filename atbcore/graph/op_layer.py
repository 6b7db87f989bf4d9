"""A core graph layer for any single op, so front-end modules without a seed-style
core layer (Softmax, Embedding, MoE, GeGLU, Transpose ...) can still sit in a
``GraphOp([...])``, and model lowering (:mod:`atbcore.models.decoder`) can place an
op the seed layers do not cover.

The running tensor ``x`` goes in at ``x_index`` among the layer's weights
(``Embedding`` reads ``(weight, ids)``, so its ``x_index`` is 1). Float weights are
cast to x's dtype like the core layers do, unless ``cast=False``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ..dtypes import Dtype
from .layers import Layer, host_array

if TYPE_CHECKING:
    from .sequential import LoweringContext

__all__ = ["OpLayer"]

_FLOATS = (Dtype.FP32, Dtype.FP16, Dtype.BF16, Dtype.FP64)


class OpLayer(Layer):
    """``op(weights[:x_index], x, weights[x_index:], **params)`` as one node."""

    def __init__(self, name: str, *, op: str, kind: str, params: Mapping[str, Any] | None = None,
                 weights: Mapping[str, Any] | None = None, x_index: int = 0,
                 cast: bool = True) -> None:
        super().__init__(name)
        self.op, self.params, self.x_index, self.cast = op, dict(params or {}), x_index, cast
        self.kind = kind  # instance attribute: the auto-name stem
        self._order = list((weights or {}).keys())
        self._weights = {k: host_array(v) for k, v in (weights or {}).items()}

    def _weight_names(self) -> set[str]:
        return set(self._order)

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        d = ctx.builder.desc(x)
        ids = []
        for k in self._order:
            arr = self._weights[k]
            if self.cast and Dtype.of(arr.dtype) in _FLOATS and d.dtype in _FLOATS \
                    and Dtype.of(arr.dtype) != d.dtype:
                arr = arr.astype(d.dtype.numpy)
            ids.append(ctx.builder.add_weight(f"{name}.{k}", arr))
        ins = ids[: self.x_index] + [x] + ids[self.x_index:]
        return ctx.builder.add_node(self.op, ins, self.params, name=name)[0]
