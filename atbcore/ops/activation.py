"""Activations by name, and the activation ops built on them.

One registry (:mod:`.activation_fns`, re-exported here) maps a name (``"gelu"``,
``"swiglu"`` ...) to a NumPy function (the float64 oracle) and a torch function. ``Gelu``, ``QuickGelu``, ``SiLU``, ``Relu``,
``SwiGLU``, ``GeGLU``, ``Activation``, ``FusedFeedForward`` and ``MoE`` all look
their formula up here, so each formula is written once. Plugins add names::

    from atbcore.ops.activation import register_activation
    register_activation("squareplus", np_fn, torch_fn)          # elementwise
    Builder().build_operation("Activation", {"activation_type": "squareplus"})

A *gated* activation takes ``[..., 2n]`` = ``[gate | up]`` and returns ``[..., n]``
(``swiglu``: ``silu(gate) * up``); ops also call it with gate and up apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ParamsError, ShapeError
from .activation_fns import (_REGISTRY, ActivationFn, _key, get_activation, list_activations,
                             register_activation, unregister_activation)
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype,
                   expect_same_dtype, expect_shape, f64)
from .registry import register_op

__all__ = ["ActivationFn", "register_activation", "unregister_activation", "get_activation",
           "list_activations", "GeluParams", "ActivationParams"]
_REGISTRY = _REGISTRY  # the registry itself stays reachable here for existing callers


# --------------------------------------------------------------------------- params
def _approximate(op: str, v: Any) -> str:
    s = _key(v)
    s = {"erf": "none", "exact": "none"}.get(s, s)
    if s not in ("none", "tanh"):
        raise ParamsError(op, "parameter 'approximate'", "'none' or 'tanh'", repr(v))
    return s


@dataclass(frozen=True)
class _ActParams(Params):
    """Base of the fixed-activation ops' params: optional ``dtype``."""

    ACT: ClassVar[str] = ""
    dtype: Dtype | None = None

    def activation_name(self) -> str:
        """The registry name this op applies."""
        return self.ACT


@dataclass(frozen=True)
class GeluParams(Params):
    """``approximate``: ``"none"`` (erf, default) or ``"tanh"``; optional ``dtype``."""

    ALIASES = {"approximation": "approximate"}
    approximate: str = "none"
    dtype: Dtype | None = None
    ACT: ClassVar[str] = "gelu"

    def validate(self) -> None:
        object.__setattr__(self, "approximate", _approximate(self.OP, self.approximate))

    def activation_name(self) -> str:
        return self.ACT + ("_tanh" if self.approximate == "tanh" else "")


@dataclass(frozen=True)
class ActivationParams(Params):
    """``activation_type``: any registered name (``gelu``, ``gelu_tanh``,
    ``quick_gelu``, ``silu``, ``swish``, ``relu``, ``swiglu``, ``geglu`` and what
    plugins add); optional ``dtype``."""

    ALIASES = {"act_type": "activation_type"}
    activation_type: str | None = None
    dtype: Dtype | None = None

    def validate(self) -> None:
        if self.activation_type is None:
            self.fail("parameter 'activation_type' is required", f"one of {list_activations()}",
                      None)
        object.__setattr__(self, "activation_type", get_activation(self.activation_type, self.OP).name)

    def activation_name(self) -> str:
        return str(self.activation_type)


@dataclass(frozen=True)
class QuickGeluParams(_ActParams):
    """QuickGelu: optional ``dtype``."""

    ACT: ClassVar[str] = "quick_gelu"


@dataclass(frozen=True)
class SiLUParams(_ActParams):
    """SiLU / Swish: optional ``dtype``."""

    ACT: ClassVar[str] = "silu"


@dataclass(frozen=True)
class ReluParams(_ActParams):
    """Relu: optional ``dtype``."""

    ACT: ClassVar[str] = "relu"


@dataclass(frozen=True)
class SwiGLUParams(_ActParams):
    """SwiGLU: optional ``dtype``."""

    ACT: ClassVar[str] = "swiglu"


@dataclass(frozen=True)
class GeGLUParams(GeluParams):
    """GeGLU: ``approximate`` picks the GELU inside; optional ``dtype``."""

    ACT: ClassVar[str] = "geglu"


# --------------------------------------------------------------------------- ops
class _ActivationOp(OpDef):
    """``y = act(x)``; gated activations take ``x`` = ``[..., 2n]`` or ``(gate, up)``."""

    inputs = ("x", "up?")
    outputs = ("y",)

    def entry(self, p: Any) -> ActivationFn:
        return get_activation(p.activation_name(), self.name)

    def infer_shape(self, p, ins):
        x, up = ins["x"], ins.get("up")
        assert x is not None
        expect_dtype(self.name, "x", x, FLOAT_DTYPES)
        expect_param_dtype(self.name, p, "x", x)
        act = self.entry(p)
        if not act.gated:
            if up is not None:
                raise InputError(self.name, f"second input: {act.name!r} is not gated",
                                 "one input (x)", f"2 inputs (x {list(x.shape)}, "
                                 f"up {list(up.shape)})")
            return [x]
        if x.rank < 1:
            raise ShapeError(self.name, "input 'x' rank", "rank >= 1", f"shape {list(x.shape)}")
        if up is not None:
            expect_same_dtype(self.name, "x", x, "up", up)
            expect_shape(self.name, "up", up, x.shape)
            return [x]
        n = x.shape[-1]
        if n % 2:
            raise ShapeError(self.name, f"input 'x' last dim ({act.name} splits it into gate|up)",
                             "an even size", f"{n} (shape {list(x.shape)})")
        return [x.replace(shape=(*x.shape[:-1], n // 2))]

    def reference(self, p, ins):
        x, up = ins["x"], ins.get("up")
        return [np.asarray(self.entry(p).numpy(f64(x), f64(up))).astype(x.dtype)]


@register_op
class Gelu(_ActivationOp):
    """GELU, erf form (``approximate="none"``) or tanh approximation."""

    name = "Gelu"
    aliases = ("GELU", "GeluOperation")
    Params = GeluParams
    inputs = ("x",)


@register_op
class QuickGelu(_ActivationOp):
    """``x * sigmoid(1.702 x)`` (CLIP)."""

    name = "QuickGelu"
    aliases = ("QuickGELU", "FastGelu")
    Params = QuickGeluParams
    inputs = ("x",)


@register_op
class SiLU(_ActivationOp):
    """``x * sigmoid(x)``."""

    name = "SiLU"
    aliases = ("Swish", "Silu")
    Params = SiLUParams
    inputs = ("x",)


@register_op
class Relu(_ActivationOp):
    """``max(x, 0)``."""

    name = "Relu"
    aliases = ("ReLU",)
    Params = ReluParams
    inputs = ("x",)


@register_op
class SwiGLU(_ActivationOp):
    """``silu(a) * b`` for ``x = [a | b]`` (last axis), or ``silu(gate) * up``."""

    name = "SwiGLU"
    aliases = ("Swiglu", "SwiGlu")
    Params = SwiGLUParams


@register_op
class GeGLU(_ActivationOp):
    """``gelu(a) * b`` for ``x = [a | b]``, or ``gelu(gate) * up``; ``approximate``."""

    name = "GeGLU"
    aliases = ("Geglu",)
    Params = GeGLUParams


@register_op
class Activation(_ActivationOp):
    """Any registered activation by ``activation_type``; gated ones accept ``up``."""

    name = "Activation"
    aliases = ("ActivationOperation",)
    Params = ActivationParams
