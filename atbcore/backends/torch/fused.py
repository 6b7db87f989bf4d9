"""Torch kernels for the fused ops of :mod:`atbcore.ops.fused`, composed from the
torch kernels of their parts (so they share those kernels' numerics); launches
count the parts' launches honestly."""

from __future__ import annotations

import torch.nn.functional as F

from ...ops.activation import get_activation
from ...ops.attention import split_packed
from ...ops.fused import attention_part, rope_part
from ...ops.registry import get_op
from ...tensor import TensorDesc
from ..cpu_kernels import torch_ops as ck
from . import TORCH_KERNELS, kernel
from .activation import c_activation
from .linear_dnnl import bind_dnnl_linear_activation, dnnl_linear_activation, why_not_dnnl
from .rope import rope_with_v

__all__ = ["composite_linear_activation"]


def _part(op: str):
    return TORCH_KERNELS[op].fn


@kernel("RopeFlashAttention", impl="C rope of q, k + contiguous v in one kernel (CPU; else torch "
        "rotary + copy) + torch scaled_dot_product_attention", launches=ck.c_launches(15, with_c=2))
def rope_flash_attention(p, ins):
    descs = {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}
    dims, _ = get_op("RopeFlashAttention")._split(p, descs)
    q, k, v = ins["q"], ins.get("k"), ins.get("v")
    if dims.packed:
        q, k, v = split_packed(q, dims)
    rp = rope_part(p, dims.heads, dims.kv_heads, dims.head_dim, dims.layout)
    # one C kernel rotates q, k and lays v (a packed-QKV slice) out contiguously
    qr, kr, vc = rope_with_v(rp, {"q": q, "k": k, "position_ids": ins.get("position_ids"),
                                  "cos": ins.get("cos"), "sin": ins.get("sin")}, v)
    fa = attention_part(p).replace(num_heads=dims.heads, num_kv_heads=dims.kv_heads)
    return _part("FlashAttention")(fa, {"q": qr, "k": kr, "v": vc,
                                        "mask": ins.get("mask"), "seq_lens": ins.get("seq_lens")})


@kernel("LinearActivation", impl="oneDNN GEMM + C activation in place (CPU fp32/bf16, "
        "gelu/gelu_tanh/relu); else F.linear (fp32 compute) + activation, one rounding; "
        "w8: the Linear kernel then the activation", launches=2,
        bind=bind_dnnl_linear_activation)
def linear_activation(p, ins):
    x, w, b = ins["x"], ins["weight"], ins.get("bias")
    if ins.get("scale") is None and why_not_dnnl(p, x, w, b) is None:
        return [dnnl_linear_activation(p, x, w, b)]
    return [composite_linear_activation(p, ins)]


def composite_linear_activation(p, ins):
    """LinearActivation as the Linear kernel (w8) or an fp32 F.linear, then the
    activation, rounded once."""
    act = get_activation(p.activation_type, "LinearActivation")
    x, w, b = ins["x"], ins["weight"], ins.get("bias")
    if p.quant is not None:
        y, = _part("Linear")(p.linear(), ins)
        return _activate(act, y.float()).to(x.dtype)
    wf = w.float() if p.transpose_weight else w.float().t()            # [out, in]
    y = F.linear(x.float(), wf, None if b is None else b.float())
    return _activate(act, y).to(x.dtype)


def _activate(act, y):
    """The activation the unfused graph's activation op would apply (the C kernel
    for built-ins on the CPU), so fusing does not change a value, not even at
    +-inf, where torch's vectorized gelu gives NaN and the formula gives inf."""
    name, why = c_activation(act)
    if not (why or ck.why_not(y)):
        return ck.activation(y, name)
    return act.torch(y)
