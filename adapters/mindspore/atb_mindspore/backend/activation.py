"""MindSpore kernels for the activation ops (Gelu, QuickGelu, SiLU, Relu, SwiGLU,
GeGLU, Activation), in fp32 with one rounding.

MindSpore formulas exist for the built-in activations only. An activation a plugin
registered (or a built-in name a plugin replaced) has no MindSpore formula: the
kernel's check says so and dispatch falls back to the torch or NumPy backend, with
the reason logged.
"""

from __future__ import annotations

from typing import Any, Callable

from atbcore.ops.activation import get_activation

from . import kernel
from .common import f32, cast, mint, ops

__all__ = ["ms_activation", "activation_reasons"]

_BUILTIN_MODULE = "atbcore.ops.activation_fns"


def _gelu(x: Any) -> Any:
    return ops().gelu(x, approximate="none")


def _gelu_tanh(x: Any) -> Any:
    return ops().gelu(x, approximate="tanh")


def _quick_gelu(x: Any) -> Any:
    mt = mint()
    return mt.mul(x, mt.sigmoid(mt.mul(x, 1.702)))


def _silu(x: Any) -> Any:
    return mint().nn.functional.silu(x)


def _relu(x: Any) -> Any:
    return mint().nn.functional.relu(x)


# name -> (elementwise fn, gated)
_FORMULAS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "gelu": (_gelu, False), "gelu_tanh": (_gelu_tanh, False), "quick_gelu": (_quick_gelu, False),
    "silu": (_silu, False), "swish": (_silu, False), "relu": (_relu, False),
    "swiglu": (_silu, True), "geglu": (_gelu, True), "geglu_tanh": (_gelu_tanh, True),
}


def activation_reasons(name: str) -> list[str]:
    """Why the MindSpore kernels cannot apply activation ``name`` (empty = they can)."""
    entry = get_activation(name)
    if entry.name not in _FORMULAS:
        return [f"no MindSpore formula for activation {entry.name!r} (plugin-registered)"]
    if getattr(entry.numpy_fn, "__module__", "") != _BUILTIN_MODULE:
        return [f"activation {entry.name!r} was replaced by a plugin; no MindSpore formula"]
    return []


def ms_activation(name: str, x: Any, up: Any = None) -> Any:
    """Apply activation ``name`` to fp32 tensors; gated ones take ``[..., 2n]`` or
    (gate, up) and return ``[..., n]``."""
    fn, gated = _FORMULAS[get_activation(name).name]
    if not gated:
        return fn(x)
    if up is None:
        n = x.shape[-1] // 2
        x, up = x[..., :n], x[..., n:]                     # [..., 2n] -> gate | up
    return mint().mul(fn(x), up)


def _check(p: Any, ins: Any) -> list[str]:
    return activation_reasons(p.activation_name())


def _make(op: str) -> Callable[[Any, dict], list]:
    def run(p: Any, ins: dict) -> list:
        x, up = ins["x"], ins.get("up")
        return [cast(ms_activation(p.activation_name(), f32(x), f32(up)), x.dtype)]

    run.__qualname__ = f"activation_{op}"
    return run


for _op, _launches in (("Gelu", 1), ("QuickGelu", 2), ("SiLU", 1), ("Relu", 1), ("SwiGLU", 2),
                       ("GeGLU", 2), ("Activation", 2)):
    kernel(_op, check=_check, impl="mindspore activation (fp32 compute)",
           launches=_launches)(_make(_op))
