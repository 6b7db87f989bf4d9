"""MindSpore kernels for the fused ops the graph passes emit (RopeFlashAttention,
LinearActivation), composed from this backend's parts so they share their numerics.
LinearActivation applies the activation to the fp32 GEMM result and rounds once."""

from __future__ import annotations

from typing import Any

from atbcore.ops.attention import split_packed
from atbcore.ops.fused import attention_part, rope_part
from atbcore.ops.linear_quant import dense_or_w8_only
from atbcore.ops.registry import get_op

from . import kernel
from .activation import activation_reasons, ms_activation
from .attention import attention_run
from .common import cast, descs
from .linear import linear_fp32
from .rope import rope_outputs

__all__: list[str] = []


@kernel("RopeFlashAttention", impl="mindspore rotary (q, k) + chunked softmax attention",
        launches=8)
def rope_flash_attention(p, ins):
    dims, _ = get_op("RopeFlashAttention")._split(p, descs(ins))
    q, k, v = ins["q"], ins.get("k"), ins.get("v")
    if dims.packed:
        q, k, v = split_packed(q, dims)
    rp = rope_part(p, dims.heads, dims.kv_heads, dims.head_dim, dims.layout)
    qr, kr = rope_outputs(rp, {"q": q, "k": k, "position_ids": ins.get("position_ids"),
                               "cos": ins.get("cos"), "sin": ins.get("sin")})
    fa = attention_part(p).replace(num_heads=dims.heads, num_kv_heads=dims.kv_heads)
    out = attention_run(fa, {"q": qr, "k": kr, "v": v, "mask": ins.get("mask"),
                             "seq_lens": ins.get("seq_lens")}, op="RopeFlashAttention")
    return [out.contiguous()]


def _act_check(p: Any, ins: Any) -> list[str]:
    return activation_reasons(p.activation_type)


@kernel("LinearActivation", check=_act_check,
        impl="mindspore matmul + activation (fp32 compute, one rounding)", launches=2)
def linear_activation(p, ins):
    x = ins["x"]
    y = linear_fp32(p, x, ins["weight"], ins.get("bias"), ins.get("scale"))
    return [cast(ms_activation(p.activation_type, y), x.dtype)]


@kernel("RmsNormLinear", check=dense_or_w8_only,
        impl="mindspore RmsNorm + mindspore Linear (the fused op's parts)",
        launches=2)
def rms_norm_linear(p, ins):
    from . import MS_KERNELS

    n, = MS_KERNELS["RmsNorm"].fn(get_op("RmsNorm").make_params({"eps": p.eps}),
                                  {"x": ins["x"], "weight": ins["norm_weight"]})
    return MS_KERNELS["Linear"].fn(p.linear(), {"x": n, "weight": ins["weight"],
                                                "bias": ins.get("bias"), "scale": ins.get("scale"),
                                                "residual": ins.get("residual")})


def _token_rows(x: Any, layout: str, heads: int, d: int) -> Any:
    """q/k/v in ``layout`` as token rows ``[B*S, heads, D]``."""
    from .common import ops

    if layout == "BNSD":
        x = ops().transpose(x, (0, 2, 1, 3))
    return x.reshape((-1, heads, d))


@kernel("RopeKVCache", impl="mindspore rotary (q, k) + indexed cache write (the RoPE and "
        "ReshapeAndCache kernels)", launches=4)
def rope_kv_cache(p, ins):
    from atbcore.ops.rope_cache import compose_rope_kv_cache

    from . import MS_KERNELS
    from .common import ms

    return compose_rope_kv_cache(p, ins, MS_KERNELS["RoPE"].fn, MS_KERNELS["ReshapeAndCache"].fn,
                                 _token_rows, lambda a: ms().Tensor(a))
