"""Norm fusions: RMSNorm spelled as primitives -> ``RmsNorm``; an add feeding a
norm -> ``AddRmsNorm`` / ``AddLayerNorm``; an RmsNorm read only by a Linear ->
``RmsNormLinear`` (the norm applied as the matmul reads its rows)."""

from __future__ import annotations

import dataclasses

from ..graph.ir import Node
from ..ops.linear import LINEAR_FIELDS
from .pattern import Alt, Match, Op, elewise
from .rewrite import Rewrite, in_consumers_only

__all__ = ["RMSNORM_PRIMITIVES", "ADD", "rmsnorm_rewrite", "add_rmsnorm_rewrite",
           "add_layernorm_rewrite", "ADD_RMSNORM_PATTERN", "ADD_LAYERNORM_PATTERN",
           "NORM_LINEAR_PATTERN", "norm_linear_rewrite"]

# x * rsqrt(mean(x * x, -1, keepdim) + eps) * w, products in any operand order
_SQ = Op("Elewise", ("x", "x"), where=elewise("mul"))
_MEAN = Op("ReduceMean", (_SQ,), name="mean")
_ADD_EPS = Op("Elewise", (_MEAN, "eps"), where=elewise("add"), commutative=True)
_RSQRT = Op("Elewise", (_ADD_EPS,), where=elewise("rsqrt"))
_NORMED = Op("Elewise", ("x", _RSQRT), where=elewise("mul"), commutative=True)
RMSNORM_PRIMITIVES = Op("Elewise", (_NORMED, "w"), where=elewise("mul"), commutative=True,
                        name="out")


def _last_dim_only(m: Match, x: str) -> bool:
    p, d = m["mean"].params, m.ctx.desc(x)
    if not p.keepdim or d is None:
        return False
    dims = p.dim if isinstance(p.dim, tuple) else (p.dim,)
    return len(dims) == 1 and dims[0] % d.rank == d.rank - 1


def rmsnorm_rewrite(m: Match) -> Rewrite | None:
    """-> ``RmsNorm(x, w)`` with eps read from the constant; w must be ``[H]``."""
    ctx, x, w = m.ctx, m["x"], m["w"]
    eps = ctx.scalar(m["eps"])
    dx, dw = ctx.desc(x), ctx.desc(w)
    if eps is None or not eps > 0 or dx is None or dw is None or not _last_dim_only(m, x):
        return None
    if dw.shape != dx.shape[-1:] or dw.dtype != dx.dtype:
        return None
    out = m["out"]
    node = Node(out.name, "RmsNorm", ctx.params("RmsNorm", eps=eps), (x, w), out.outputs)
    return Rewrite(add=(node,))


# ----------------------------------------------------------------------------- add + norm
ADD = Alt(Op("Elewise", ("a", "b"), where=elewise("add"), name="add"),
          Op("ResidualAdd", ("a", "b"), name="add"))
ADD_RMSNORM_PATTERN = Op("RmsNorm", (ADD, "w"), name="norm")
ADD_LAYERNORM_PATTERN = Op("LayerNorm", (ADD,), name="norm", partial=True)


def _same_shapes(m: Match) -> bool:
    da, db = m.ctx.desc(m["a"]), m.ctx.desc(m["b"])
    return da is not None and db is not None and da.shape == db.shape and da.dtype == db.dtype


def _fuse_add_norm(m: Match, op: str) -> Rewrite | None:
    if not _same_shapes(m):
        return None
    norm, add = m["norm"], m["add"]
    rest = norm.inputs[1:]
    # the fused op has its own params type: carry the norm's field values over
    values = {f.name: getattr(norm.params, f.name) for f in dataclasses.fields(norm.params)}
    node = Node(norm.name, op, m.ctx.params(op, **values), (m["a"], m["b"], *rest),
                (norm.outputs[0], add.outputs[0]))
    return Rewrite(add=(node,))


def add_rmsnorm_rewrite(m: Match) -> Rewrite | None:
    """-> ``AddRmsNorm(a, b, w)``, producing the norm and (for other readers) the sum."""
    return _fuse_add_norm(m, "AddRmsNorm")


def add_layernorm_rewrite(m: Match) -> Rewrite | None:
    """-> ``AddLayerNorm(a, b, weight?, bias?)``, producing the norm and the sum."""
    return _fuse_add_norm(m, "AddLayerNorm")


# ----------------------------------------------------------------------------- norm + linear
NORM_LINEAR_PATTERN = Op("Linear", (Op("RmsNorm", ("x", "nw"), name="norm"), "w"), name="lin",
                         partial=True)


def norm_linear_rewrite(m: Match) -> Rewrite | None:
    """``Linear(RmsNorm(x, nw), w, ...)`` -> ``RmsNormLinear(x, nw, w, ...)`` when the
    norm is over the last dim, with no weight offset, and read by this Linear alone."""
    ctx, norm, lin = m.ctx, m["norm"], m["lin"]
    p = norm.params
    if p.weight_offset or (p.normalized_shape is not None and len(p.normalized_shape) != 1):
        return None
    if not in_consumers_only(ctx, norm.outputs[0], {lin.name}):
        return None
    dx, dw = ctx.desc(m["x"]), ctx.desc(m["nw"])
    if dx is None or dw is None or tuple(dw.shape) != tuple(dx.shape[-1:]):
        return None
    values = {f: getattr(lin.params, f) for f in LINEAR_FIELDS}
    node = Node(lin.name, "RmsNormLinear", ctx.params("RmsNormLinear", eps=p.eps, **values),
                (m["x"], m["nw"], *lin.inputs[1:]), lin.outputs)
    return Rewrite(add=(node,))
