"""Elementwise ops: ``Elewise`` (one op, dispatching on ``elewise_type``) and
``ResidualAdd``.

    Builder().build_operation("Elewise", {"elewise_type": "muls", "var_attr": 0.5})
    Builder().build_operation("Elewise", {"elewise_type": "cast", "out_dtype": "fp16"})

Binary types broadcast like NumPy. Float results are computed in float64 by the
reference (fp32 by the kernels for half types) and rounded once to the output
dtype; integer add/sub/mul/neg wrap around in the input's own dtype, as both
NumPy and torch do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ShapeError
from ..tensor import TensorDesc
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype,
                   expect_same_dtype, expect_shape, f64)
from .registry import register_op

__all__ = ["ElewiseParams", "ResidualAddParams", "ELEWISE_TYPES", "UNARY", "BINARY",
           "broadcast_shape"]

BINARY = frozenset({"add", "sub", "mul", "div"})
UNARY = frozenset({"muls", "neg", "cast", "cos", "sin", "tanh", "exp", "rsqrt"})
ELEWISE_TYPES = BINARY | UNARY

_INTS = frozenset({Dtype.INT8, Dtype.UINT8, Dtype.INT32, Dtype.INT64})
_SIGNED_INTS = frozenset({Dtype.INT8, Dtype.INT32, Dtype.INT64})
# Which input dtypes each type accepts; cast accepts everything.
_ALLOWED: dict[str, frozenset] = {
    "add": FLOAT_DTYPES | _INTS,
    "sub": FLOAT_DTYPES | _INTS,
    "mul": FLOAT_DTYPES | _INTS,
    "div": FLOAT_DTYPES,
    "muls": FLOAT_DTYPES,
    "neg": FLOAT_DTYPES | _SIGNED_INTS,
    "cast": frozenset(Dtype),
    "cos": FLOAT_DTYPES,
    "sin": FLOAT_DTYPES,
    "tanh": FLOAT_DTYPES,
    "exp": FLOAT_DTYPES,
    "rsqrt": FLOAT_DTYPES,
}


def _norm_type(v: Any) -> Any:
    # ATB spells them ELEWISE_ADD, ELEWISE_MULS, ...; accept that spelling too.
    if isinstance(v, str):
        v = v.strip().lower()
        return v[len("elewise_"):] if v.startswith("elewise_") else v
    return v


@dataclass(frozen=True)
class ElewiseParams(Params):
    """``elewise_type`` (one of :data:`ELEWISE_TYPES`, ATB's ``ELEWISE_ADD`` spelling
    accepted); ``scalar`` (alias ``var_attr``) for ``muls``; ``out_dtype`` (alias
    ``out_tensor_type``) for ``cast`` only."""

    ALIASES = {"var_attr": "scalar", "out_tensor_type": "out_dtype", "type": "elewise_type"}
    elewise_type: str | None = None
    scalar: float = 1.0
    out_dtype: Any = None

    def validate(self) -> None:
        t = _norm_type(self.elewise_type)
        object.__setattr__(self, "elewise_type", t)
        if t not in ELEWISE_TYPES:
            self.fail("elewise_type", f"one of {sorted(ELEWISE_TYPES)}", repr(self.elewise_type))
        if self.out_dtype is not None:
            try:
                object.__setattr__(self, "out_dtype", Dtype.of(self.out_dtype))
            except (ValueError, TypeError):
                self.fail("out_dtype", "a Dtype", repr(self.out_dtype))
        if t == "cast" and self.out_dtype is None:
            self.fail("out_dtype (required by cast)", "a Dtype", None)
        if t != "cast" and self.out_dtype is not None:
            self.fail(f"out_dtype applies to cast only, not {t}", "no out_dtype", self.out_dtype)
        if not isinstance(self.scalar, (int, float, np.integer, np.floating)) or isinstance(
                self.scalar, bool):
            self.fail("scalar (var_attr)", "a number", repr(self.scalar))
        if t != "muls" and self.scalar != 1.0:
            self.fail(f"scalar (var_attr) applies to muls only, not {t}", "no scalar", self.scalar)


def broadcast_shape(op: str, a: TensorDesc, b: TensorDesc) -> tuple[int, ...]:
    """NumPy broadcasting of two shapes, as a :class:`ShapeError` when impossible."""
    try:
        return tuple(np.broadcast_shapes(a.shape, b.shape))
    except ValueError:
        raise ShapeError(op, "inputs 'x' and 'y' do not broadcast", "broadcastable shapes",
                         f"{list(a.shape)} and {list(b.shape)}") from None


@register_op
class Elewise(OpDef):
    """One elementwise op chosen by ``elewise_type``; binary types take ``y``."""

    name = "Elewise"
    aliases = ("ElewiseOperation", "Elementwise")
    Params = ElewiseParams
    inputs = ("x", "y?")
    outputs = ("z",)

    def infer_shape(self, p, ins):
        x, y = ins["x"], ins.get("y")
        t = p.elewise_type
        if t in BINARY and y is None:
            raise InputError(self.name, f"{t} needs a second input 'y'", "2 inputs (x, y)", 1)
        if t in UNARY and y is not None:
            raise InputError(self.name, f"{t} takes one input", "1 input (x)", 2)
        expect_dtype(self.name, "x", x, _ALLOWED[t])
        if y is None:
            out_dtype = p.out_dtype if t == "cast" else x.dtype
            return [x.replace(dtype=out_dtype)]
        expect_same_dtype(self.name, "x", x, "y", y)
        return [x.replace(shape=broadcast_shape(self.name, x, y))]

    def reference(self, p, ins):
        x, y = ins["x"], ins.get("y")
        t = p.elewise_type
        if t == "cast":
            return [np.asarray(x).astype(p.out_dtype.numpy)]
        if Dtype.of(x.dtype) in _INTS:
            # Integer math stays in the input dtype (wrap-around, like torch).
            z = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[t](x, y) \
                if t in BINARY else np.negative(x)
            return [np.asarray(z).astype(x.dtype)]
        a = f64(x)
        with np.errstate(all="ignore"):  # div by 0, rsqrt(<0): inf/nan like torch
            if t in BINARY:
                b = f64(y)
                z = {"add": np.add, "sub": np.subtract, "mul": np.multiply,
                     "div": np.divide}[t](a, b)
            elif t == "muls":
                z = a * float(p.scalar)
            elif t == "neg":
                z = -a
            elif t == "rsqrt":
                z = 1.0 / np.sqrt(a)
            else:
                z = {"cos": np.cos, "sin": np.sin, "tanh": np.tanh, "exp": np.exp}[t](a)
        return [np.asarray(z).astype(x.dtype)]


@dataclass(frozen=True)
class ResidualAddParams(Params):
    """No fields; optional ``dtype`` the inputs must have."""

    dtype: Dtype | None = None


@register_op
class ResidualAdd(OpDef):
    """``x + residual`` for same-shape, same-dtype float tensors."""

    name = "ResidualAdd"
    aliases = ("ResidualAddOperation",)
    Params = ResidualAddParams
    inputs = ("x", "residual")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x, r = ins["x"], ins["residual"]
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        expect_same_dtype(self.name, "x", x, "residual", r)
        expect_shape(self.name, "residual", r, x.shape)
        return [x]

    def reference(self, p, ins):
        x = ins["x"]
        return [(f64(x) + f64(ins["residual"])).astype(x.dtype)]

