"""Linear fusions:

* ``qkv``: exactly three ``Linear``s reading one input (constant weights, same
  params but out_features, all with or all without a constant bias) -> one
  ``Linear`` on the weights concatenated once, here at build time, + ``Split``;
* ``linear_bias``: ``Linear(x, w) + b`` with ``b`` of shape ``[out]`` ->
  ``Linear(x, w, b)`` (the bias is added inside the GEMM);
* ``linear_activation``: an activation whose only input is a Linear's output ->
  ``LinearActivation``;
* ``linear_residual``: ``Linear(...) + r`` (or ``RmsNormLinear``), ``r`` shaped and
  typed as the Linear's output -> the Linear with ``r`` as its ``residual`` input
  (the residual stream's add rides in the GEMM's epilogue: on the CPU the C matmul
  adds ``r`` as it stores each output, one rounding). It runs before the add+norm
  fusions, so a block's residual adds go into its output projections and the norms
  that follow stay plain and fold into the next matmul (``norm_linear``).
"""

from __future__ import annotations

from ..graph.analysis import canonical_op
from ..graph.ir import Node
from ..ops.linear import LINEAR_FIELDS
from .pattern import Alt, Match, Op, elewise
from .rewrite import Rewrite, RewriteContext, concat_weights

__all__ = ["QKV_PATTERN", "qkv_rewrite", "LINEAR_BIAS_PATTERN", "linear_bias_rewrite",
           "LINEAR_ACT_PATTERN", "linear_activation_rewrite", "ACTIVATION_OPS",
           "activation_name", "plain_linear", "LINEAR_RESIDUAL_PATTERN",
           "linear_residual_rewrite"]

# ops computing one elementwise activation of one input
ACTIVATION_OPS = ("SiLU", "Gelu", "QuickGelu", "Relu", "Activation")


def activation_name(node: Node) -> str | None:
    """The registry name of a non-gated activation node, else None."""
    if canonical_op(node.op) not in ACTIVATION_OPS or len([t for t in node.inputs if t]) != 1:
        return None
    from ..ops.activation import get_activation

    name = node.params.activation_name()
    return None if get_activation(name).gated else name


def plain_linear(ctx: RewriteContext, n: Node, bias: bool | None = None) -> bool:
    """A dense Linear with a constant [out, in] weight (and a constant bias when it
    has one; ``bias`` True/False requires one / none)."""
    if canonical_op(n.op) != "Linear" or n.params.quant is not None:
        return False
    ins = list(n.inputs) + ["", ""]
    if len(n.inputs) > 3 or not ctx.is_weight(ins[1]):
        return False
    has_bias = bool(ins[2])
    if has_bias and not ctx.is_weight(ins[2]):
        return False
    return bias is None or bias == has_bias


QKV_PATTERN = Op("Linear", ("x", "w"), name="lin", partial=True)


def qkv_rewrite(m: Match) -> Rewrite | None:
    """Three projections of one input -> one merged Linear + Split."""
    ctx, anchor, x = m.ctx, m["lin"], m["x"]
    if not plain_linear(ctx, anchor):
        return None
    bias = len(anchor.inputs) > 2 and bool(anchor.inputs[2])
    base = anchor.params.replace(out_features=None, bias=None)
    group = [n for n in ctx.consumers(x)
             if n.inputs[0] == x and plain_linear(ctx, n, bias)
             and n.params.replace(out_features=None, bias=None) == base]
    if len(group) != 3 or group[0].name != anchor.name:
        return None
    ws = [ctx.weight(n.inputs[1]) for n in group]
    if len({w.dtype for w in ws}) != 1:
        return None
    axis = 0 if anchor.params.transpose_weight else 1
    outs = [w.shape[axis] for w in ws]
    name = ctx.fresh("+".join(n.name for n in group))
    weights = [(f"{name}.weight", concat_weights(ws, axis))]
    ins = [x, weights[0][0]]
    if bias:
        weights.append((f"{name}.bias", concat_weights([ctx.weight(n.inputs[2]) for n in group])))
        ins.append(weights[1][0])
    lin = Node(name, "Linear", base.replace(bias=True if bias else anchor.params.bias),
               tuple(ins), (name,))
    split = Node(f"{name}.split", "Split", ctx.params("Split", dim=-1, sizes=tuple(outs)),
                 (name,), tuple(n.outputs[0] for n in group))
    return Rewrite(add=(lin, split), remove=tuple(n.name for n in group), weights=tuple(weights))


_BARE = Op("Linear", ("x", "w"), name="lin")
LINEAR_BIAS_PATTERN = Alt(
    Op("Elewise", (_BARE, "b"), where=elewise("add"), commutative=True, name="add"),
    Op("ResidualAdd", (_BARE, "b"), commutative=True, name="add"))


def linear_bias_rewrite(m: Match) -> Rewrite | None:
    """``Linear(x, w) + b`` -> ``Linear(x, w, b)`` when ``b`` is ``[out]``."""
    ctx, lin, add = m.ctx, m["lin"], m["add"]
    if lin.params.quant is not None or lin.params.bias is False:
        return None
    dy, db = ctx.desc(lin.outputs[0]), ctx.desc(m["b"])
    if dy is None or db is None or db.shape != dy.shape[-1:] or db.dtype != dy.dtype:
        return None
    node = Node(lin.name, "Linear", lin.params.replace(bias=True), (m["x"], m["w"], m["b"]),
                add.outputs)
    return Rewrite(add=(node,))


LINEAR_ACT_PATTERN = Op(ACTIVATION_OPS, (Op("Linear", name="lin", partial=True, inputs=("x",)),),
                        name="act")


def linear_activation_rewrite(m: Match) -> Rewrite | None:
    """``act(Linear(...))`` -> ``LinearActivation(...)``."""
    lin, act = m["lin"], m["act"]
    name = activation_name(act)
    if name is None or len(lin.inputs) > 4:  # act(x @ W + residual) has no fused op
        return None
    if lin.params.quant not in (None, "w8"):  # LinearActivation takes dense and w8 weights
        return None
    fields = {f: getattr(lin.params, f) for f in LINEAR_FIELDS}
    params = m.ctx.params("LinearActivation", activation_type=name, **fields)
    return Rewrite(add=(Node(act.name, "LinearActivation", params, lin.inputs, act.outputs),))


_ANY_LINEAR = Op(("Linear", "RmsNormLinear"), name="lin", partial=True)
LINEAR_RESIDUAL_PATTERN = Alt(
    Op("Elewise", (_ANY_LINEAR, "r"), where=elewise("add"), commutative=True, name="add"),
    Op("ResidualAdd", (_ANY_LINEAR, "r"), commutative=True, name="add"))


def linear_residual_rewrite(m: Match) -> Rewrite | None:
    """``Linear(...) + r`` -> ``Linear(..., residual=r)`` (see the module docstring)."""
    from ..ops.registry import get_op

    ctx, lin, add = m.ctx, m["lin"], m["add"]
    names = get_op(lin.op).input_names
    at = names.index("residual")
    ins = list(lin.inputs) + [""] * (len(names) - len(lin.inputs))
    if ins[at] or m["r"] in lin.outputs:
        return None  # already carries one, or y + y
    dy, dr = ctx.desc(lin.outputs[0]), ctx.desc(m["r"])
    if dy is None or dr is None or tuple(dy.shape) != tuple(dr.shape) or dy.dtype != dr.dtype:
        return None
    ins[at] = m["r"]
    while not ins[-1]:  # optional inputs after the residual (w4 zero points) stay
        ins.pop()
    node = Node(lin.name, canonical_op(lin.op), lin.params, tuple(ins), add.outputs)
    return Rewrite(add=(node,))
