"""LinearParallel: a matmul fused with the collective a tensor-parallel linear
needs (ATB's ``LinearParallelOperation`` types).

``type``:

* ``linear_all_reduce`` (default; row-parallel): rank r holds the input slice
  ``x_r [..., in/N]`` and ``W_r [out, in/N]``; ``y = all_reduce(sum_r x_r @ W_r.T)
  + bias`` — every rank gets the full ``[..., out]``.
* ``linear_reduce_scatter`` (row-parallel, sequence-parallel output): the same
  sum, split along dim 0: rank r keeps rows ``r`` of ``N`` equal chunks
  (``x [T, ...]`` -> ``y [T/N, ..., out]``), plus bias.
* ``all_gather_linear`` (column-parallel over gathered tokens): ``x_r [T, ..., in]``
  is gathered along dim 0 from every rank, then ``y = x_all @ W_r.T + bias`` with
  ``W_r [out/N, in]`` -> ``[N*T, ..., out/N]``.

``bias`` is the full (replicated) bias, added once after the collective.
``transpose_weight`` (alias ``trans_weight``): True = W ``[out, in]`` as nn.Linear.
``group`` and ``rank_size`` as every collective (:mod:`.collective`). The partial
products are accumulated and reduced in fp32 (DESIGN §5), then rounded to x's
dtype; for fp16/bf16 inputs that doubles the bytes on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError
from ..tensor import TensorDesc
from .base import f64
from .collective import CollectiveOp, CollectiveParams
from .linear import LinearParams, _check_linear
from .registry import register_op

__all__ = ["LinearParallelParams", "PARALLEL_TYPES"]

# accepted spelling -> canonical type (ATB's enum names and numbers included)
PARALLEL_TYPES = {"linear_all_reduce": "linear_all_reduce", "0": "linear_all_reduce",
                  "linear_reduce_scatter": "linear_reduce_scatter",
                  "1": "linear_reduce_scatter",
                  "all_gather_linear": "all_gather_linear", "2": "all_gather_linear"}


@dataclass(frozen=True)
class LinearParallelParams(CollectiveParams):
    """``type`` (module docstring), ``transpose_weight``, ``bias`` (True: required,
    False: refused, None: optional), ``group``, ``rank_size``."""

    ALIASES = {"trans_weight": "transpose_weight", "transWeight": "transpose_weight",
               "parallel_type": "type", "world_size": "rank_size", "has_bias": "bias"}
    type: str = "linear_all_reduce"
    transpose_weight: bool = True
    bias: bool | None = None

    def validate(self) -> None:
        key = str(self.type).lower()
        if key not in PARALLEL_TYPES:
            self.fail("type", " | ".join(sorted({v for v in PARALLEL_TYPES.values()})),
                      repr(self.type))
        object.__setattr__(self, "type", PARALLEL_TYPES[key])
        super().validate()

    def linear(self) -> LinearParams:
        return LinearParams(bias=self.bias, transpose_weight=self.transpose_weight)


@register_op
class LinearParallel(CollectiveOp):
    """A tensor-parallel linear with its collective (see the module docstring)."""

    name = "LinearParallel"
    aliases = ("LinearParallelOperation",)
    Params = LinearParallelParams
    inputs = ("x", "weight", "bias?")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        n = self.ranks(p)
        local = _check_linear(self.name, p.linear(), {**ins, "scale": None})
        shape = list(local.shape)
        if p.type == "linear_reduce_scatter":
            if shape[0] % n:
                raise ShapeError(self.name, f"input 'x' dim 0 must split evenly over {n} ranks "
                                 "(linear_reduce_scatter)", f"a multiple of {n}",
                                 f"shape {list(ins['x'].shape)}")
            shape[0] //= n
        elif p.type == "all_gather_linear":
            shape[0] *= n
        return [TensorDesc(tuple(shape), local.dtype, local.device)]

    def reference_ranks(self, p, per_rank):
        def w64(ins):
            w = f64(ins["weight"])
            return w if p.transpose_weight else w.T

        def finish(y, ins):
            b = ins.get("bias")
            return (y if b is None else y + f64(b)).astype(np.asarray(ins["x"]).dtype)

        n = len(per_rank)
        if p.type == "all_gather_linear":
            x_all = np.concatenate([f64(ins["x"]) for ins in per_rank], axis=0)
            return [[finish(x_all @ w64(ins).T, ins)] for ins in per_rank]
        total = sum(f64(ins["x"]) @ w64(ins).T for ins in per_rank)
        if p.type == "linear_reduce_scatter":
            return [[finish(c, ins)] for c, ins in zip(np.split(total, n, axis=0), per_rank)]
        return [[finish(total, ins)] for ins in per_rank]
