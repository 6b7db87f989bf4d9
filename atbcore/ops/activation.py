"""Activations by name, and the activation ops built on them.

One registry maps a name (``"gelu"``, ``"swiglu"`` ...) to a NumPy function (the
float64 oracle) and a torch function. ``Gelu``, ``QuickGelu``, ``SiLU``, ``Relu``,
``SwiGLU``, ``GeGLU``, ``Activation``, ``FusedFeedForward`` and ``MoE`` all look
their formula up here, so each formula is written once. Plugins add names::

    from atbcore.ops.activation import register_activation
    register_activation("squareplus", np_fn, torch_fn)          # elementwise
    Builder().build_operation("Activation", {"activation_type": "squareplus"})

A *gated* activation takes ``[..., 2n]`` = ``[gate | up]`` and returns ``[..., n]``
(``swiglu``: ``silu(gate) * up``); ops also call it with gate and up apart.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ParamsError, ShapeError
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype,
                   expect_same_dtype, expect_shape, f64)
from .registry import register_op

__all__ = ["ActivationFn", "register_activation", "unregister_activation", "get_activation",
           "list_activations", "GeluParams", "ActivationParams"]

Fn = Callable[[Any], Any]
PairFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class ActivationFn:
    """One activation: ``numpy_fn`` (float64 in, float64 out) and ``torch_fn``
    (kernels pass fp32 tensors and round the result once). For gated entries both
    take ``[..., 2n]`` and return ``[..., n]``; ``numpy_pair``/``torch_pair``
    (``fn(gate, up)``) are set when the entry was built from an elementwise one,
    which saves concatenating gate and up when they arrive apart."""

    name: str
    numpy_fn: Fn
    torch_fn: Fn
    gated: bool = False
    numpy_pair: PairFn | None = None
    torch_pair: PairFn | None = None

    def numpy(self, x: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
        """Apply to float64 arrays (``up`` only for gated entries)."""
        if up is None:
            return self.numpy_fn(x)
        if self.numpy_pair is not None:
            return self.numpy_pair(x, up)
        return self.numpy_fn(np.concatenate([x, up], axis=-1))

    def torch(self, x: Any, up: Any = None) -> Any:
        """Apply to torch tensors (``up`` only for gated entries)."""
        if up is None:
            return self.torch_fn(x)
        if self.torch_pair is not None:
            return self.torch_pair(x, up)
        import torch

        return self.torch_fn(torch.cat([x, up], dim=-1))


_REGISTRY: dict[str, ActivationFn] = {}
_LOCK = threading.Lock()


def _key(name: Any) -> str:
    return str(name).strip().lower()


def register_activation(name: str, numpy_fn: Fn, torch_fn: Fn, gated: bool = False) -> ActivationFn:
    """Add (or replace) the activation ``name`` (case-insensitive).

    ``numpy_fn(x: float64 ndarray) -> ndarray`` is the reference; ``torch_fn(x)``
    the kernel (given fp32 tensors, imports torch itself). ``gated=True``: both take
    ``[..., 2n]`` (gate first) and return ``[..., n]``. A later registration of a
    name replaces the earlier one, so a plugin can override a built-in."""
    if not isinstance(name, str) or not name.strip():
        raise ParamsError("register_activation", "activation name", "a non-empty string", repr(name))
    for what, fn in (("numpy_fn", numpy_fn), ("torch_fn", torch_fn)):
        if not callable(fn):
            raise ParamsError("register_activation", f"{what} of {name!r}", "a callable",
                              type(fn).__name__)
    entry = ActivationFn(_key(name), numpy_fn, torch_fn, bool(gated))
    with _LOCK:
        _REGISTRY[entry.name] = entry
    return entry


def unregister_activation(name: str) -> None:
    """Remove ``name`` from the registry (no error when absent)."""
    with _LOCK:
        _REGISTRY.pop(_key(name), None)


def list_activations() -> list[str]:
    """Every registered activation name, sorted."""
    return sorted(_REGISTRY)


def get_activation(name: Any, op: str = "activation") -> ActivationFn:
    """The activation ``name``; ParamsError naming ``op`` when nobody registered it.

    On a miss the plugin manager is started once (a no-op when it already runs),
    so activations that entry-point plugins register are found without setup."""
    entry = _REGISTRY.get(_key(name))
    if entry is None:
        try:
            from ..plugin import get_plugin_manager
        except ImportError:  # pluggy missing: only built-ins
            pass
        else:
            get_plugin_manager()
            entry = _REGISTRY.get(_key(name))
    if entry is None:
        raise ParamsError(op, f"unknown activation {name!r}", f"one of {list_activations()}",
                          repr(name))
    return entry


# --------------------------------------------------------------------------- built-ins
# NumPy has no erf; math.erf is correctly rounded in float64, which an oracle wants.
_erf = np.frompyfunc(math.erf, 1, 1)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _np_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def _np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def _np_sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only: no overflow warnings for large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _np_quick_gelu(x: np.ndarray) -> np.ndarray:
    return x * _np_sigmoid(1.702 * x)


def _np_silu(x: np.ndarray) -> np.ndarray:
    return x * _np_sigmoid(x)


def _np_relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


# torch is imported inside the functions: this module must not import a framework.
def _t_gelu(x: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(x)


def _t_gelu_tanh(x: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def _t_quick_gelu(x: Any) -> Any:
    import torch

    return x * torch.sigmoid(1.702 * x)


def _t_silu(x: Any) -> Any:
    import torch.nn.functional as F

    return F.silu(x)


def _t_relu(x: Any) -> Any:
    import torch

    return torch.relu(x)


def _register_gated(name: str, base: ActivationFn) -> None:
    """``name``: ``base(gate) * up`` over ``[..., 2n] = [gate | up]``."""
    np_pair = lambda g, u: base.numpy_fn(g) * u  # noqa: E731
    t_pair = lambda g, u: base.torch_fn(g) * u  # noqa: E731

    def np_fn(x: np.ndarray) -> np.ndarray:
        n = x.shape[-1] // 2
        return np_pair(x[..., :n], x[..., n:])  # x: [..., 2n] -> [..., n]

    def t_fn(x: Any) -> Any:
        gate, up = x.chunk(2, dim=-1)  # x: [..., 2n] -> [..., n] twice
        return t_pair(gate, up)

    _REGISTRY[name] = ActivationFn(name, np_fn, t_fn, True, np_pair, t_pair)


def _register_builtins() -> None:
    for name, np_fn, t_fn in (("gelu", _np_gelu, _t_gelu), ("gelu_tanh", _np_gelu_tanh, _t_gelu_tanh),
                              ("quick_gelu", _np_quick_gelu, _t_quick_gelu),
                              ("silu", _np_silu, _t_silu), ("swish", _np_silu, _t_silu),
                              ("relu", _np_relu, _t_relu)):
        register_activation(name, np_fn, t_fn)
    for name, base in (("swiglu", "silu"), ("geglu", "gelu"), ("geglu_tanh", "gelu_tanh")):
        _register_gated(name, _REGISTRY[base])


_register_builtins()


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
