"""Feed-forward fusions:

* ``ffn`` (gated): ``down(act(gate(x)) * up(x))`` — or ``down(SwiGLU(gate(x), up(x)))``
  — with constant weights -> ``FusedFeedForward(x, gate_up_w, down_w)`` with gate
  and up concatenated once at build time (``gate_up_merged``; gate rows first);
  ``silu`` gives ``swiglu``, ``gelu`` ``geglu``, ``gelu_tanh`` ``geglu_tanh``;
* ``ffn`` (plain): ``down(act(up(x)))`` -> ``FusedFeedForward(x, up_w, down_w)``
  with the activation's name;
  biases (all three / both Linears with one, or none) ride along (``bias=True``);
* ``ffn_residual``: ``FusedFeedForward(...) + r`` (same shape) -> the same op with
  ``has_residual`` and ``r`` as its last input;
* ``ffn_gate_up``: a gated ``FusedFeedForward`` given separate constant gate and up
  weights (e.g. the ``FusedFeedForward`` layer) -> the same op on one ``gate_up_w``
  concatenated once at build time (one matmul reads x once for both);
* ``norm_ffn``: an ``RmsNorm`` over the last dim read only by a ``FusedFeedForward``
  (as its x) -> the FFN with ``norm_eps`` and the norm's weight: the first matmul
  RmsNorms the rows it reads (as ``RmsNormLinear`` does for a Linear).
"""

from __future__ import annotations

from ..graph.analysis import canonical_op
from ..graph.ir import Node
from .pattern import Alt, Match, Op, elewise
from .rewrite import Rewrite, concat_weights, in_consumers_only
from ..ops.ffn import ffn_input_names
from .rules_linear import ACTIVATION_OPS, activation_name, plain_linear

__all__ = ["FFN_PATTERN", "ffn_rewrite", "FFN_RESIDUAL_PATTERN", "ffn_residual_rewrite",
           "GATED", "FFN_GATE_UP_PATTERN", "ffn_gate_up_rewrite", "NORM_FFN_PATTERN",
           "norm_ffn_rewrite"]

GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}

_GATE = Op("Linear", ("x",), name="gate", partial=True)
_UP = Op("Linear", ("x",), name="up", partial=True)
_GLU = Alt(Op("Elewise", (Op(ACTIVATION_OPS, (_GATE,), name="act"), _UP), where=elewise("mul"),
              commutative=True, name="mul"),
           Op(("SwiGLU", "GeGLU"), (_GATE, _UP), name="glu"))
_PLAIN = Op(ACTIVATION_OPS, (_UP,), name="act")
FFN_PATTERN = Alt(Op("Linear", (_GLU,), name="down", partial=True),
                  Op("Linear", (_PLAIN,), name="down", partial=True))


def _gated_name(m: Match) -> str | None:
    if "glu" in m:
        return m["glu"].params.activation_name()
    act = activation_name(m["act"])
    return GATED.get(act) if act else None


def ffn_rewrite(m: Match) -> Rewrite | None:
    """-> ``FusedFeedForward``; see the module docstring."""
    ctx, down, up = m.ctx, m["down"], m["up"]
    gated = "gate" in m
    lins = [m["gate"], up, down] if gated else [up, down]
    if not all(plain_linear(ctx, n) and n.params.transpose_weight for n in lins):
        return None
    biased = {len(n.inputs) > 2 and bool(n.inputs[2]) for n in lins}
    if len(biased) != 1:
        return None
    bias = biased.pop()
    dtypes = {ctx.weight(n.inputs[1]).dtype for n in lins}
    dx = ctx.desc(m["x"])
    if len(dtypes) != 1 or dx is None:
        return None
    act = _gated_name(m) if gated else activation_name(m["act"])
    if act is None:
        return None
    w_up = ctx.weight(up.inputs[1])
    name = ctx.fresh("+".join(n.name for n in lins))
    weights, ins = [], [m["x"]]
    if gated:
        gate = m["gate"]
        weights.append((f"{name}.gate_up_weight",
                        concat_weights([ctx.weight(gate.inputs[1]), w_up])))
        ins += [weights[0][0], down.inputs[1]]
        if bias:
            weights.append((f"{name}.gate_up_bias",
                            concat_weights([ctx.weight(gate.inputs[2]), ctx.weight(up.inputs[2])])))
            ins += [weights[1][0], down.inputs[2]]
    else:
        ins += [up.inputs[1], down.inputs[1]]
        if bias:
            ins += [up.inputs[2], down.inputs[2]]
    params = ctx.params("FusedFeedForward", hidden_size=dx.shape[-1],
                        intermediate_size=w_up.shape[0], activation_type=act,
                        gate_up_merged=gated, bias=bias)
    node = Node(name, "FusedFeedForward", params, tuple(ins), down.outputs)
    return Rewrite(add=(node,), weights=tuple(weights))


_FFN = Op("FusedFeedForward", name="ffn", where=lambda n: not n.params.has_residual)
FFN_RESIDUAL_PATTERN = Alt(
    Op("Elewise", (_FFN, "r"), where=elewise("add"), commutative=True, name="add"),
    Op("ResidualAdd", (_FFN, "r"), commutative=True, name="add"))


def ffn_residual_rewrite(m: Match) -> Rewrite | None:
    """``FusedFeedForward(...) + r`` -> ``FusedFeedForward(..., r, has_residual=True)``."""
    ctx, ffn, add = m.ctx, m["ffn"], m["add"]
    dy, dr = ctx.desc(ffn.outputs[0]), ctx.desc(m["r"])
    if dy is None or dr is None or dy.shape != dr.shape or dy.dtype != dr.dtype:
        return None
    node = Node(ffn.name, canonical_op(ffn.op), ffn.params.replace(has_residual=True),
                (*ffn.inputs, m["r"]), add.outputs)
    return Rewrite(add=(node,))


FFN_GATE_UP_PATTERN = Op("FusedFeedForward", name="ffn", where=lambda n: (
    n.params.activation.gated and not n.params.gate_up_merged))


def ffn_gate_up_rewrite(m: Match) -> Rewrite | None:
    """Separate gate/up weights (and biases) -> one merged ``gate_up_w`` (gate rows
    first), when they are constants in the same ``[out, in]`` layout and dtype."""
    ctx, ffn = m.ctx, m["ffn"]
    names = ffn_input_names(ffn.params)
    ins = dict(zip(names, ffn.inputs))
    gate, up = ctx.weight(ins["gate_w"]), ctx.weight(ins["up_w"])
    if gate is None or up is None or gate.dtype != up.dtype or gate.shape != up.shape:
        return None
    dx = ctx.desc(ins["x"])
    if dx is None or gate.ndim != 2 or gate.shape[1] != dx.shape[-1]:
        return None  # [in, out] (transposed) weights keep their separate form
    name = ctx.fresh(f"{ffn.name}.gate_up")
    weights = [(f"{name}.weight", concat_weights([gate, up]))]
    if ffn.params.bias:
        gb, ub = ctx.weight(ins["gate_b"]), ctx.weight(ins["up_b"])
        if gb is None or ub is None or gb.dtype != ub.dtype:
            return None
        weights.append((f"{name}.bias", concat_weights([gb, ub])))
    params = ffn.params.replace(gate_up_merged=True)
    merged = dict(ins, gate_up_w=weights[0][0], gate_up_b=weights[-1][0] if ffn.params.bias
                  else None)
    new = tuple(merged[n] for n in ffn_input_names(params))
    node = Node(ffn.name, canonical_op(ffn.op), params, new, ffn.outputs)
    return Rewrite(add=(node,), weights=tuple(weights))


NORM_FFN_PATTERN = Op("FusedFeedForward", (Op("RmsNorm", ("x", "nw"), name="norm"),),
                      name="ffn", partial=True, where=lambda n: n.params.norm_eps is None)


def norm_ffn_rewrite(m: Match) -> Rewrite | None:
    """``FusedFeedForward(RmsNorm(x, nw), ...)`` -> ``FusedFeedForward(x, ..., nw)``
    with ``norm_eps``, when the norm is over the last dim with no weight offset and
    its output is read by this FFN alone, as its x only."""
    ctx, norm, ffn = m.ctx, m["norm"], m["ffn"]
    p, normed = norm.params, norm.outputs[0]
    if p.weight_offset or (p.normalized_shape is not None and len(p.normalized_shape) != 1):
        return None
    if not in_consumers_only(ctx, normed, {ffn.name}) or ffn.inputs.count(normed) != 1:
        return None
    dx, dw = ctx.desc(m["x"]), ctx.desc(m["nw"])
    if dx is None or dw is None or tuple(dw.shape) != tuple(dx.shape[-1:]):
        return None
    params = ffn.params.replace(norm_eps=float(p.eps))
    ins = dict(zip(ffn_input_names(ffn.params), ffn.inputs), x=m["x"], norm_weight=m["nw"])
    node = Node(ffn.name, canonical_op(ffn.op), params,
                tuple(ins.get(n) or "" for n in ffn_input_names(params)), ffn.outputs)
    return Rewrite(add=(node,))
