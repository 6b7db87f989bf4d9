"""``torch.ops.atb.*`` for activations, softmax, the fused FFN and MoE.

Same rules as :mod:`atb_torch.library`: each op runs the core's torch kernel after the
core's validation, has a fake kernel built from torch meta ops (so symbolic shapes
stay symbolic under ``torch.compile``), and refuses backward with an AtbError.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atbcore.ops.activation import get_activation

from .library import _opt, call_kernel, register

__all__ = ["gelu", "quick_gelu", "silu", "relu", "swiglu", "geglu", "activation", "softmax",
           "scaled_masked_softmax", "fused_ffn", "moe"]


def _gated_fake(x: Tensor, up: Tensor | None) -> Tensor:
    # one input [..., 2n] -> [..., n]; two inputs keep the shape. Contiguous, as the
    # kernel's output is (inductor checks the fake's strides against the real ones)
    if up is not None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# ----------------------------------------------------------------------------- activations


@register("gelu", "Gelu")
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return call_kernel("Gelu", {"approximate": approximate}, x=x)[0]


@gelu.register_fake
def _(x, approximate="none"):
    return torch.empty_like(x)


@register("quick_gelu", "QuickGelu")
def quick_gelu(x: Tensor) -> Tensor:
    return call_kernel("QuickGelu", {}, x=x)[0]


@quick_gelu.register_fake
def _(x):
    return torch.empty_like(x)


@register("silu", "SiLU")
def silu(x: Tensor) -> Tensor:
    return call_kernel("SiLU", {}, x=x)[0]


@silu.register_fake
def _(x):
    return torch.empty_like(x)


@register("relu", "Relu")
def relu(x: Tensor) -> Tensor:
    return call_kernel("Relu", {}, x=x)[0]


@relu.register_fake
def _(x):
    return torch.empty_like(x)


@register("swiglu", "SwiGLU")
def swiglu(x: Tensor, up: Tensor | None = None) -> Tensor:
    """``silu(a) * b`` of x = [a | b], or ``silu(x) * up``."""
    return call_kernel("SwiGLU", {}, x=x, up=up)[0]


@swiglu.register_fake
def _(x, up=None):
    return _gated_fake(x, up)


@register("geglu", "GeGLU")
def geglu(x: Tensor, up: Tensor | None = None, approximate: str = "none") -> Tensor:
    return call_kernel("GeGLU", {"approximate": approximate}, x=x, up=up)[0]


@geglu.register_fake
def _(x, up=None, approximate="none"):
    return _gated_fake(x, up)


@register("activation", "Activation")
def activation(x: Tensor, up: Tensor | None = None, activation_type: str = "gelu") -> Tensor:
    """Any registered activation by name (plugins add names)."""
    return call_kernel("Activation", {"activation_type": activation_type}, x=x, up=up)[0]


@activation.register_fake
def _(x, up=None, activation_type="gelu"):
    if get_activation(activation_type, "Activation").gated:
        return _gated_fake(x, up)
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- softmax


@register("softmax", "Softmax")
def softmax(x: Tensor, dim: list[int]) -> Tensor:
    """Softmax over one or several axes (fp32 compute)."""
    return call_kernel("Softmax", {"dim": tuple(dim)}, x=x)[0]


@softmax.register_fake
def _(x, dim):
    return torch.empty_like(x)


@register("scaled_masked_softmax", "ScaledMaskedSoftmax")
def scaled_masked_softmax(x: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                          causal: bool = False, dim: int = -1) -> Tensor:
    """``softmax(x * scale + mask)``; mask additive or bool (True = keep)."""
    return call_kernel("ScaledMaskedSoftmax", {"scale": scale, "causal": causal, "dim": dim},
                       x=x, mask=mask)[0]


@scaled_masked_softmax.register_fake
def _(x, mask=None, scale=1.0, causal=False, dim=-1):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- FFN, MoE


@register("fused_ffn", "FusedFeedForward")
def fused_ffn(x: Tensor, gate_w: Tensor | None, up_w: Tensor | None, down_w: Tensor,
              gate_up_w: Tensor | None = None, gate_b: Tensor | None = None,
              up_b: Tensor | None = None, down_b: Tensor | None = None,
              gate_up_b: Tensor | None = None, residual: Tensor | None = None,
              activation_type: str = "swiglu") -> Tensor:
    """``down(act(gate(x)) * up(x)) [+ residual]``; ``gate_up_w`` (gate rows first)
    replaces gate_w/up_w; non-gated activations use ``up_w`` only."""
    params = {"activation_type": activation_type, "gate_up_merged": gate_up_w is not None,
              "has_residual": residual is not None,
              "bias": any(b is not None for b in (gate_b, up_b, down_b, gate_up_b))}
    return call_kernel("FusedFeedForward", params, x=x, gate_w=gate_w, up_w=up_w,
                       gate_up_w=gate_up_w, down_w=down_w, gate_b=gate_b, up_b=up_b,
                       gate_up_b=gate_up_b, down_b=down_b, residual=residual)[0]


@fused_ffn.register_fake
def _(x, gate_w, up_w, down_w, gate_up_w=None, gate_b=None, up_b=None, down_b=None,
      gate_up_b=None, residual=None, activation_type="swiglu"):
    return torch.empty_like(x)


@register("moe", "MoE")
def moe(x: Tensor, router_w: Tensor, w_gate_up: Tensor, w_down: Tensor, top_k: int = 2,
        norm_topk_prob: bool = True, activation_type: str = "swiglu",
        num_experts: int = 0) -> Tensor:
    """Top-k routed experts (fp32 routing); ``num_experts`` 0 = router rows."""
    params = {"top_k": top_k, "norm_topk_prob": norm_topk_prob,
              "activation_type": activation_type, "num_experts": _opt(num_experts, 0)}
    return call_kernel("MoE", params, x=x, router_w=router_w, w_gate_up=w_gate_up,
                       w_down=w_down)[0]


@moe.register_fake
def _(x, router_w, w_gate_up, w_down, top_k=2, norm_topk_prob=True, activation_type="swiglu",
      num_experts=0):
    return torch.empty_like(x)
