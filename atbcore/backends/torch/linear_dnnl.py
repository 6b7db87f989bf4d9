"""LinearActivation on the CPU as one oneDNN GEMM with the activation as its
post-op (``torch.ops.mkldnn._linear_pointwise``): ``act(x @ W.T + b)`` with fp32
sums and the activation applied before the one rounding -- the op's definition.
The encoder fast path's FFN up projection (bias + GELU inside the GEMM) is this
call; on large row counts it is faster than a matmul followed by a separate
activation pass over the ``[rows, intermediate]`` result.

Taken for fp32/bf16 activations with weights (and bias) of x's dtype, GELU (exact
or tanh) and ReLU, on a torch built with oneDNN; other calls keep the composite."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ...runtime.binding import Slot, getter

__all__ = ["checked_linear_activation", "why_not_dnnl", "dnnl_linear_activation", "bind_dnnl_linear_activation",
           "dnnl_available"]

# atb activation -> (oneDNN post-op, algorithm)
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
_DTYPES = (torch.float32, torch.bfloat16)


def dnnl_available() -> bool:
    """Whether torch has oneDNN's linear with post-ops."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and \
            hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # pragma: no cover - torch without oneDNN
        return False


def why_not_dnnl(p: Any, x: Any, w: Any, b: Any) -> str | None:
    """Why the oneDNN GEMM does not take this LinearActivation (None = it does)."""
    def desc(t: Any) -> tuple[Any, str]:
        if type(t) is Slot:
            return t.desc.dtype.torch, str(t.desc.device)
        return t.dtype, str(t.device)
    if p.quant is not None:
        return f"quant {p.quant}"
    if p.activation_type not in POST_OPS:
        return f"activation {p.activation_type} is no oneDNN post-op here"
    xd, dev = desc(x)
    if not dev.startswith("cpu"):
        return f"oneDNN runs on the CPU, not {dev}"
    if xd not in _DTYPES or desc(w)[0] != xd or (b is not None and desc(b)[0] != xd):
        return "x, weight and bias not all fp32 or all bf16"
    if type(w) is Slot or type(b) is Slot:
        return "the weight or bias changes per run"
    if not dnnl_available():
        return "torch built without oneDNN (mkldnn)"
    return None


def checked_linear_activation(p: Any, x: torch.Tensor, w: torch.Tensor, b: Any
                              ) -> torch.Tensor:
    """:func:`dnnl_linear_activation`, redone by the composite kernel when its result
    holds a NaN/Inf (one sum over it): oneDNN's GELU post-op turns +-inf into NaN
    where the op's formula gives +-inf or 0, and NaN inputs must propagate as the
    reference's arithmetic does."""
    y = dnnl_linear_activation(p, x, w, b)
    if math.isfinite(float(y.sum())):
        return y
    from .fused import composite_linear_activation

    return composite_linear_activation(p, {"x": x, "weight": w, "bias": b})


def dnnl_linear_activation(p: Any, x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
    """The call itself (``why_not_dnnl`` checked): ``[..., K] -> [..., N]``."""
    post, algo = POST_OPS[p.activation_type]
    wv = w if p.transpose_weight else w.t()                              # [N, K]
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(x2, wv, b, post, [], algo)    # [M, N]
    return y.reshape(*x.shape[:-1], wv.shape[0])


def bind_dnnl_linear_activation(p: Any, ins: dict[str, Any], outs: list, ctx: Any
                                ) -> Callable[[list], None] | None:
    """The bound call: the GEMM's result becomes the output (its slot filled per run);
    None where oneDNN does not take the call or the output is a planned buffer."""
    x, w, b = ins["x"], ins["weight"], ins.get("bias")
    out = outs[0]
    if type(out) is not Slot or ins.get("scale") is not None or why_not_dnnl(p, x, w, b):
        return None
    ctx.note_layout("weight", "[out, in] rows (oneDNN)")
    gx, i = getter(x), out.index

    def call(env: list) -> None:
        env[i] = checked_linear_activation(p, gx(env), w, b)
    return call


bind_dnnl_linear_activation.fills_slots = True  # type: ignore[attr-defined]
