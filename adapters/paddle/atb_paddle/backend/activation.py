"""Paddle kernels for the activations, Softmax and ScaledMaskedSoftmax (fp32 compute,
one rounding).

The core's activation registry holds NumPy and torch functions; the Paddle ones for
the built-in names live here (:data:`PADDLE_ACTIVATIONS`, extendable with
:func:`register_paddle_activation`). A name only a plugin registered with the core
(no Paddle function) is refused by the kernel's ``check`` with the reason, so
dispatch falls back to the torch or NumPy backend. SwiGLU uses Paddle's fused
``swiglu`` where it is registered (CPU fp32, GPU).
"""

from __future__ import annotations

from typing import Any, Callable

import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F

from atbcore.ops.activation import get_activation
from atbcore.ops.softmax import softmax_axes
from atbcore.tensor import describe

from . import kernel
from .common import f32, fused_or, to_dtype

__all__ = ["PADDLE_ACTIVATIONS", "register_paddle_activation", "paddle_activation",
           "softmax_fp32"]

Fn = Callable[[Any], Any]


def _quick_gelu(x):
    return x * F.sigmoid(1.702 * x)


#: name -> (fn(x) for elementwise, or fn(gate, up) for gated, gated?)
PADDLE_ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    "gelu": (lambda x: F.gelu(x), False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate=True), False),
    "quick_gelu": (_quick_gelu, False),
    "silu": (F.silu, False),
    "swish": (F.silu, False),
    "relu": (F.relu, False),
    "geglu": (lambda g, u: F.gelu(g) * u, True),
    "geglu_tanh": (lambda g, u: F.gelu(g, approximate=True) * u, True),
}


def _swiglu(g, u):
    return fused_or("SwiGLU", "swiglu", g, lambda: IF.swiglu(g, u), lambda: F.silu(g) * u)


PADDLE_ACTIVATIONS["swiglu"] = (_swiglu, True)


def register_paddle_activation(name: str, fn: Callable, gated: bool = False) -> None:
    """Give the Paddle backend a function for the core activation ``name``:
    ``fn(x)`` (fp32 Paddle tensor) or, gated, ``fn(gate, up)``."""
    PADDLE_ACTIVATIONS[name.strip().lower()] = (fn, bool(gated))


def paddle_activation(name: str, x, up=None):
    """Apply the activation ``name`` to fp32 Paddle tensors (gated: ``x`` is
    ``[..., 2n]`` = gate | up, or gate with ``up`` given)."""
    fn, gated = PADDLE_ACTIVATIONS[name]
    if not gated:
        return fn(x)
    if up is None:
        n = x.shape[-1] // 2
        x, up = x[..., :n], x[..., n:]                 # [..., 2n] -> gate, up [..., n]
    return fn(x, up)


def _check_activation(p, ins) -> list[str]:
    name = p.activation_name()
    if name not in PADDLE_ACTIVATIONS:
        return [f"no Paddle function for activation {name!r} (only in the core registry)"]
    if PADDLE_ACTIVATIONS[name][1] != get_activation(name).gated:
        return [f"Paddle function for {name!r} disagrees with the registry on gating"]
    return []


def _make(op: str) -> Callable:
    def run(p, ins):
        x, up = ins["x"], ins.get("up")
        y = paddle_activation(p.activation_name(), f32(x), f32(up))
        return [to_dtype(y, x.dtype)]

    run.__qualname__ = f"activation_{op}"
    return run


for _op, _launches in (("Gelu", 1), ("QuickGelu", 1), ("SiLU", 1), ("Relu", 1), ("SwiGLU", 1),
                       ("GeGLU", 2), ("Activation", 2)):
    kernel(_op, check=_check_activation, impl="paddle activation (fp32 compute; swiglu fused)",
           launches=_launches)(_make(_op))


# ----------------------------------------------------------------------------- softmax


def softmax_fp32(z, axes: tuple[int, ...], empty_rows_zero: bool):
    """Softmax of ``z`` over ``axes`` in fp32 (returns fp32); rows that are all
    ``-inf`` give zeros when ``empty_rows_zero``."""
    if len(axes) == 1 and not empty_rows_zero:
        return F.softmax(z, axis=axes[0], dtype="float32")
    z = f32(z)
    m = z.amax(axis=list(axes), keepdim=True)
    empty = paddle.isinf(m) & (m < 0)
    if empty_rows_zero:
        m = paddle.where(empty, paddle.zeros_like(m), m)   # exp(-inf - 0) = 0: the row sums to 0
    e = paddle.exp(z - m)
    s = e.sum(axis=list(axes), keepdim=True)
    if empty_rows_zero:
        s = paddle.where(empty, paddle.ones_like(s), s)
    return e / s


@kernel("Softmax", impl="paddle.nn.functional.softmax (fp32 compute)")
def softmax(p, ins):
    x = ins["x"]
    axes = softmax_axes("Softmax", p, describe(x))
    return [to_dtype(softmax_fp32(x, axes, empty_rows_zero=False), x.dtype)]


@kernel("ScaledMaskedSoftmax", impl="scale + mask, paddle softmax (fp32 compute)", launches=4)
def scaled_masked_softmax(p, ins):
    x, mask = ins["x"], ins.get("mask")
    axes = softmax_axes("ScaledMaskedSoftmax", p, describe(x))
    z = f32(x) * p.scale if p.scale != 1.0 else f32(x)
    neg_inf = paddle.full([], float("-inf"), dtype="float32")
    if mask is not None:
        if mask.dtype == paddle.bool:
            z = paddle.where(mask, z, neg_inf)            # mask broadcasts to x
        else:
            z = z + f32(mask)
    if p.causal:
        sq, sk = z.shape[-2:]
        keep = paddle.tril(paddle.ones([sq, sk], dtype="int32"), diagonal=sk - sq).astype("bool")
        z = paddle.where(keep, z, neg_inf)
    masked = mask is not None or p.causal
    return [to_dtype(softmax_fp32(z, axes, empty_rows_zero=masked), x.dtype)]
