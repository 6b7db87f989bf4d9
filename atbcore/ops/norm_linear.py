"""RmsNormLinear: ``Linear(RmsNorm(x, norm_weight), weight, bias?, scale?)`` in one op.

The fusion ``norm_linear`` (:mod:`atbcore.passes.rules_norm`) makes it from an RmsNorm
whose only reader is a Linear: the projections of a LLaMA-style block read the
normed rows once, in the matmul. The normed rows are rounded to x's dtype before the
matmul, exactly as the separate RmsNorm stores them, so the fused op gives the
unfused graph's values. Params: the Linear's, plus the norm's ``eps``; an optional
``residual`` is added to the output as in Linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError
from .base import FLOAT_DTYPES, OpDef, expect_dtype
from .linear import INT8_WEIGHT_QUANTS, LinearParams, _check_linear, ref_linear
from .norm import ref_rms_norm
from .registry import register_op

__all__ = ["RmsNormLinearParams"]


@dataclass(frozen=True)
class RmsNormLinearParams(LinearParams):
    """Linear's params plus ``eps`` of the RmsNorm over the last dim."""

    eps: float = 1e-6

    def validate(self) -> None:
        super().validate()
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float, np.floating)) \
                or not 0 < float(self.eps) < float("inf"):
            self.fail("eps", "a finite float > 0", repr(self.eps))


@register_op
class RmsNormLinear(OpDef):
    """``x`` [..., K] -> RmsNorm (weight ``norm_weight`` [K]) -> Linear; see the module doc."""

    name = "RmsNormLinear"
    aliases = ("NormLinear",)
    Params = RmsNormLinearParams
    inputs = ("x", "norm_weight", "weight", "bias?", "scale?", "residual?")
    outputs = ("y",)

    def bind(self, p, items):
        """As Linear's inputs, with ``norm_weight`` second: with ``quant="w8"``, four
        inputs are (x, norm_weight, weight, scale) unless ``bias=True``."""
        if p.quant in INT8_WEIGHT_QUANTS and len(items) == 4 and p.bias is not True:
            return {"x": items[0], "norm_weight": items[1], "weight": items[2], "bias": None,
                    "scale": items[3]}
        return super().bind(p, items)

    def infer_shape(self, p, ins):
        x, nw = ins["x"], ins["norm_weight"]
        expect_dtype(self.name, "norm_weight", nw, FLOAT_DTYPES)
        if tuple(nw.shape) != tuple(x.shape[-1:]):
            raise ShapeError(self.name, "input 'norm_weight' shape (x's last dim)",
                             list(x.shape[-1:]), list(nw.shape))
        return [_check_linear(self.name, p, ins)]

    def reference(self, p, ins):
        x = ins["x"]
        n = ref_rms_norm(x, ins["norm_weight"], p.eps, 0.0, (np.asarray(x).ndim - 1,))
        n = n.astype(np.asarray(x).dtype)  # rounded as the RmsNorm op stores it
        y = ref_linear(p, n, ins["weight"], ins.get("bias"), ins.get("scale"),
                       ins.get("residual"))
        return [y.astype(np.asarray(x).dtype)]
