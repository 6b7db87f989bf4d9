"""FusedFeedForward: ``y = down(act(gate(x)) * up(x)) [+ residual]`` in one op.

Inputs, in order (``activation_type`` decides gated or not, params decide the rest):

===========================  ==========================================================
gated (swiglu, geglu)        ``x, gate_w [I, H], up_w [I, H], down_w [H, I]``
gated, ``gate_up_merged``    ``x, gate_up_w [2I, H] (gate rows first), down_w [H, I]``
not gated (gelu, relu ...)   ``x, up_w [I, H], down_w [H, I]``
then, with ``bias=True``     one bias per weight, same order (``[I]``/``[2I]``/``[H]``)
then, ``has_residual``       ``residual [..., H]`` added to ``y``
then, ``norm_eps`` set       ``norm_weight [H]``: x is RmsNorm'd first (the
                             ``norm_ffn`` fusion: the norm inside the first matmul)
===========================  ==========================================================

Weights follow nn.Linear (``[out, in]``). A weight given ``[in, out]`` (the seed
article creates ``gate_proj [H, I]``) is accepted transposed when ``in != out``; a
square weight is read as ``[out, in]``. Matmuls accumulate in fp32, the activation
runs in fp32 and the result is rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from .activation import ActivationFn, get_activation
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype,
                   expect_same_dtype, expect_shape, f64)
from .registry import register_op

__all__ = ["FusedFeedForwardParams", "FfnLayout", "ffn_layout", "ffn_input_names"]


@dataclass(frozen=True)
class FusedFeedForwardParams(Params):
    """``hidden_size`` / ``intermediate_size`` (None = from the weights),
    ``activation_type`` (any registered activation; gated ones take gate and up),
    ``gate_up_merged``, ``has_residual``, ``bias`` (alias ``has_bias``), ``dtype``;
    ``norm_eps`` (None: no norm) RmsNorms x over its last dim with the
    ``norm_weight`` input first, rounded to x's dtype as the RmsNorm op stores it
    (the residual is added unnormed)."""

    ALIASES = {"ffn_hidden_size": "intermediate_size", "inter_size": "intermediate_size",
               "merged_gate_up": "gate_up_merged"}
    hidden_size: int | None = None
    intermediate_size: int | None = None
    activation_type: str = "swiglu"
    gate_up_merged: bool = False
    has_residual: bool = False
    bias: bool = False
    dtype: Dtype | None = None
    norm_eps: float | None = None

    def validate(self) -> None:
        e = self.norm_eps
        if e is not None and (isinstance(e, bool) or not isinstance(e, (int, float, np.floating))
                              or not 0 < float(e) < float("inf")):
            self.fail("norm_eps", "None or a finite float > 0", repr(e))
        for f in ("hidden_size", "intermediate_size"):
            v = getattr(self, f)
            bad = not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0
            if v is not None and bad:
                self.fail(f"parameter {f!r}", "a positive int or None", repr(v))
        act = get_activation(self.activation_type, self.OP)
        object.__setattr__(self, "activation_type", act.name)
        if self.gate_up_merged and not act.gated:
            self.fail("gate_up_merged needs a gated activation", "swiglu/geglu/... with "
                      "gate_up_merged=True", f"activation_type={act.name!r}")

    @property
    def activation(self) -> ActivationFn:
        return get_activation(self.activation_type, self.OP)


def ffn_input_names(p: FusedFeedForwardParams) -> list[str]:
    """Positional input names for these params (see the module docstring)."""
    gated = p.activation.gated
    ws = ["gate_up_w", "down_w"] if p.gate_up_merged else (
        ["gate_w", "up_w", "down_w"] if gated else ["up_w", "down_w"])
    names = ["x", *ws]
    if p.bias:
        names += [w[:-1] + "b" for w in ws]
    if p.has_residual:
        names.append("residual")
    if p.norm_eps is not None:
        names.append("norm_weight")
    return names


@dataclass(frozen=True)
class FfnLayout:
    """Sizes and, per weight name, whether it arrived ``[in, out]`` (transposed)."""

    hidden: int
    inter: int
    transposed: Mapping[str, bool]


def _orient(op: str, name: str, shape: Sequence[int], out: int | None, inp: int) -> tuple[int, bool]:
    """(out size, transposed) of a 2-D weight that maps ``inp`` -> ``out``
    (``out=None``: unknown, taken from the weight)."""
    if len(shape) != 2:
        raise ShapeError(op, f"input {name!r} rank", "rank 2", f"shape {list(shape)}")
    a, b = shape
    if b == inp and (out is None or a == out):
        return a, False                           # [out, in]; square weights land here
    if a == inp and (out is None or b == out):
        return b, True                            # [in, out], the seed article's layout
    want = f"[{out}, {inp}] (or [{inp}, {out}] transposed)" if out else f"[*, {inp}] or [{inp}, *]"
    raise ShapeError(op, f"input {name!r} shape", want, list(shape))


def ffn_layout(op: str, p: FusedFeedForwardParams, shapes: Mapping[str, Sequence[int]]) -> FfnLayout:
    """Resolve sizes and weight orientations from input shapes; errors name ``op``."""
    h = shapes["x"][-1]
    if p.hidden_size is not None and h != p.hidden_size:
        raise ShapeError(op, "input 'x' last dim (hidden_size)", p.hidden_size, f"{h} "
                         f"(shape {list(shapes['x'])})")
    mult = 2 if p.gate_up_merged else 1
    first = "gate_up_w" if p.gate_up_merged else ("gate_w" if "gate_w" in shapes else "up_w")
    want = None if p.intermediate_size is None else mult * p.intermediate_size
    n_out, t_first = _orient(op, first, shapes[first], want, h)
    if n_out % mult:
        raise ShapeError(op, f"input {first!r} rows (gate and up halves)", "an even count",
                         f"{n_out} (shape {list(shapes[first])})")
    inter = n_out // mult
    transposed = {first: t_first}
    if first == "gate_w":
        transposed["up_w"] = _orient(op, "up_w", shapes["up_w"], inter, h)[1]
    transposed["down_w"] = _orient(op, "down_w", shapes["down_w"], h, inter)[1]
    return FfnLayout(h, inter, transposed)


@register_op
class FusedFeedForward(OpDef):
    """Gate/up projection, activation, down projection and optional residual."""

    name = "FusedFeedForward"
    aliases = ("FFN", "FusedFFN", "FeedForward", "Mlp")
    Params = FusedFeedForwardParams
    inputs = ("x", "gate_w?", "up_w?", "gate_up_w?", "down_w", "gate_b?", "up_b?", "gate_up_b?",
              "down_b?", "residual?", "norm_weight?")
    outputs = ("y",)

    def bind(self, p, items):
        names = ffn_input_names(p)
        if len(items) != len(names):
            raise InputError(self.name, "number of inputs", f"{len(names)} ({', '.join(names)}) for "
                             f"activation_type={p.activation_type!r}, gate_up_merged="
                             f"{p.gate_up_merged}, bias={p.bias}, has_residual={p.has_residual}",
                             len(items))
        bound: dict[str, Any] = {n: None for n in self.input_names}
        bound.update(zip(names, items))
        for n in names:
            if bound[n] is None and not n.endswith("_b"):  # a bias may be left out as None
                raise InputError(self.name, f"input {n!r} is missing", "a tensor", "None")
        return bound

    def infer_shape(self, p, ins):
        x = ins["x"]
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        if x.rank < 2:
            raise ShapeError(self.name, "input 'x' rank", "rank >= 2 ([..., hidden])",
                             f"shape {list(x.shape)}")
        present = {n: d for n, d in ins.items() if d is not None}
        for n, d in present.items():
            if n != "x":
                expect_same_dtype(self.name, "x", x, n, d)
        nw = present.pop("norm_weight", None)
        if nw is not None:
            expect_shape(self.name, "norm_weight", nw, tuple(x.shape[-1:]))
        lay = ffn_layout(self.name, p, {n: d.shape for n, d in present.items()})
        mult = 2 if p.gate_up_merged else 1
        sizes = {"gate_b": lay.inter, "up_b": lay.inter, "gate_up_b": mult * lay.inter,
                 "down_b": lay.hidden}
        for n, size in sizes.items():
            if n in present:
                expect_shape(self.name, n, present[n], (size,))
        if "residual" in present:
            expect_shape(self.name, "residual", present["residual"], x.shape)
        return [x]

    def reference(self, p, ins):
        x = ins["x"]
        lay = ffn_layout(self.name, p, {n: np.shape(a) for n, a in ins.items() if a is not None})
        act = p.activation
        xin = x
        if p.norm_eps is not None:  # rounded to x's dtype, as the RmsNorm op stores it
            from .norm import ref_rms_norm

            xin = ref_rms_norm(x, ins["norm_weight"], p.norm_eps, 0.0,
                               (np.asarray(x).ndim - 1,)).astype(np.asarray(x).dtype)

        def proj(a: np.ndarray, w: str) -> np.ndarray:
            wt = f64(ins[w]) if lay.transposed[w] else f64(ins[w]).T         # [in, out]
            y = a @ wt
            b = ins.get(w[:-1] + "b")
            return y if b is None else y + f64(b)

        x2 = f64(xin).reshape(-1, lay.hidden)                                 # [T, H]
        if p.gate_up_merged or not act.gated:
            h = act.numpy(proj(x2, "gate_up_w" if p.gate_up_merged else "up_w"))
        else:
            h = act.numpy(proj(x2, "gate_w"), proj(x2, "up_w"))              # [T, I]
        y = proj(h, "down_w").reshape(x.shape)
        if ins.get("residual") is not None:
            y = y + f64(ins["residual"])
        return [y.astype(x.dtype)]

