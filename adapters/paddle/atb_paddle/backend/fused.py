"""Paddle kernels for the fused ops the graph passes emit (:mod:`atbcore.ops.fused`),
composed from this backend's own RoPE, FlashAttention, Linear and activation
kernels, so they share those kernels' numerics; launches count the parts."""

from __future__ import annotations

from atbcore.ops.attention import split_packed
from atbcore.ops.fused import attention_part, rope_part
from atbcore.ops.linear_quant import dense_or_w8_only
from atbcore.ops.registry import get_op
from atbcore.tensor import TensorDesc

from . import PADDLE_KERNELS, kernel
from .activation import PADDLE_ACTIVATIONS, paddle_activation
from .common import f32, to_dtype

__all__: list[str] = []


def _part(op: str):
    return PADDLE_KERNELS[op].fn


@kernel("RopeFlashAttention", impl="paddle rotary (q, k) + paddle attention (fp32 compute)",
        launches=3)
def rope_flash_attention(p, ins):
    descs = {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}
    dims, _ = get_op("RopeFlashAttention")._split(p, descs)
    q, k, v = ins["q"], ins.get("k"), ins.get("v")
    if dims.packed:
        q, k, v = split_packed(q, dims)
    rp = rope_part(p, dims.heads, dims.kv_heads, dims.head_dim, dims.layout)
    qr, kr = _part("RoPE")(rp, {"q": q, "k": k, "position_ids": ins.get("position_ids"),
                                "cos": ins.get("cos"), "sin": ins.get("sin")})
    fa = attention_part(p).replace(num_heads=dims.heads, num_kv_heads=dims.kv_heads)
    return _part("FlashAttention")(fa, {"q": qr, "k": kr, "v": v, "mask": ins.get("mask"),
                                        "seq_lens": ins.get("seq_lens")})


def _check_linear_activation(p, ins) -> list[str]:
    if p.activation_type not in PADDLE_ACTIVATIONS:
        return [f"no Paddle function for activation {p.activation_type!r}"]
    return []


@kernel("LinearActivation", check=_check_linear_activation,
        impl="paddle.matmul + activation (fp32 compute, one rounding)", launches=2)
def linear_activation(p, ins):
    from .linear import linear_fp32

    x = ins["x"]
    y = linear_fp32(x, ins["weight"], ins.get("bias"), p.transpose_weight,
                    ins.get("scale") if p.quant == "w8" else None)
    return [to_dtype(paddle_activation(p.activation_type, f32(y)), x.dtype)]


@kernel("RmsNormLinear", launches=2, check=dense_or_w8_only,
        impl="paddle fused_rms_norm + paddle.matmul (the RmsNorm and Linear kernels)")
def rms_norm_linear(p, ins):
    from atbcore.ops.registry import get_op as _op

    n, = _part("RmsNorm")(_op("RmsNorm").make_params({"eps": p.eps}),
                          {"x": ins["x"], "weight": ins["norm_weight"]})
    return _part("Linear")(p.linear(), {"x": n, "weight": ins["weight"], "bias": ins.get("bias"),
                                        "scale": ins.get("scale"),
                                        "residual": ins.get("residual")})


def _token_rows(x, layout: str, heads: int, d: int):
    """q/k/v in ``layout`` as token rows ``[B*S, heads, D]``."""
    if layout == "BNSD":
        x = x.transpose([0, 2, 1, 3])
    return x.reshape([-1, heads, d])


@kernel("RopeKVCache", impl="paddle rotary (q, k) + index_put_ cache write (the RoPE and "
        "ReshapeAndCache kernels)", launches=4)
def rope_kv_cache(p, ins):
    import paddle

    from atbcore.ops.rope_cache import compose_rope_kv_cache

    return compose_rope_kv_cache(p, ins, _part("RoPE"), _part("ReshapeAndCache"), _token_rows,
                                 paddle.to_tensor)
