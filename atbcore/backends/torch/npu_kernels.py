"""The torch backend's NPU kernels: torch_npu's fused ops (:mod:`atbcore.backends.npu`).

Each registration encodes the op's documented constraints (dtype per SoC family,
shapes, layouts; ``reference/torch_npu.md``) as reasons; a call that breaks one runs
the op's torch kernel, logged with the reason. Nothing imports torch_npu until an NPU
tensor arrives.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...ops.activation import get_activation
from ..npu import into_out, npu_module, soc_family, unavailable_reason
from .activation import c_activation
from .device_kernels import device_kernel
from .rope import _token_cos_sin, geometry

__all__ = ["rms_norm_reasons", "add_rms_norm_reasons", "swiglu_reasons", "rotary_mul_reasons",
           "gated_activation_reasons"]

_HALF = (torch.float16, torch.float32)
_ALL = (torch.float16, torch.bfloat16, torch.float32)
# dtypes per SoC family (A2/A3 take bf16; the older 910 and 310P do not)
_NORM_DTYPES = {"A2": _ALL, "A3": _ALL, "950": _ALL, "910": _HALF, "310P": _HALF}


def _dtype_reason(op: str, t: torch.Tensor, table: Mapping[str, tuple]) -> str | None:
    fam = soc_family()
    allowed = table.get(fam)
    if allowed is None:
        return f"{op} is not documented for SoC family {fam}"
    if t.dtype not in allowed:
        return f"{op} on {fam} takes {'/'.join(str(d)[6:] for d in allowed)}; given {str(t.dtype)[6:]}"
    return None


def _norm_dims(p: Any, x: torch.Tensor, w: torch.Tensor | None) -> int:
    return len(p.normalized_shape) if p.normalized_shape else (w.dim() if w is not None else 1)


def rms_norm_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``npu_rms_norm`` cannot take this RmsNorm call."""
    why = unavailable_reason()
    if why:
        return why
    x, w = ins["x"], ins.get("weight")
    if w is None:
        return "npu_rms_norm needs gamma (a weight)"
    if not 2 <= x.dim() <= 8:
        return f"npu_rms_norm takes 2-8 dims; given {x.dim()}"
    if w.dtype != x.dtype:
        return f"gamma dtype {str(w.dtype)[6:]} differs from x's {str(x.dtype)[6:]}"
    why = _offset_reason(p, x) or _dtype_reason("npu_rms_norm", x, _NORM_DTYPES)
    if why is None and soc_family() == "310P" and x.shape[-1] * x.element_size() < 32:
        why = "npu_rms_norm on 310P needs the last axis >= 32 bytes"
    return why


def add_rms_norm_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``npu_add_rms_norm`` cannot take this AddRmsNorm call."""
    why = unavailable_reason()
    if why:
        return why
    x, r, w = ins["x"], ins["residual"], ins.get("weight")
    if w is None:
        return "npu_add_rms_norm needs gamma (a weight)"
    if not 1 <= x.dim() <= 8 or x.numel() == 0:
        return f"npu_add_rms_norm takes 1-8 non-empty dims; given {list(x.shape)}"
    if w.dtype != x.dtype or r.dtype != x.dtype:
        return "x, residual and gamma differ in dtype"
    return _offset_reason(p, x) or _dtype_reason("npu_add_rms_norm", x, _NORM_DTYPES)


def _offset_reason(p: Any, x: torch.Tensor) -> str | None:
    # gamma must have x's dtype: (offset + w) rounded to fp16/bf16 loses the weight's bits
    if p.weight_offset and x.dtype != torch.float32:
        return f"weight_offset with {str(x.dtype)[6:]}: gamma = offset + w would be rounded"
    return None


def _gamma(p: Any, w: torch.Tensor) -> torch.Tensor:
    return w if not p.weight_offset else w + p.weight_offset


@device_kernel("RmsNorm", "npu", why_not=rms_norm_reasons, provider="torch_npu", available=unavailable_reason,
               impl="torch_npu.npu_rms_norm")
def rms_norm_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    y, _rstd = npu_module().npu_rms_norm(ins["x"], _gamma(p, ins["weight"]), epsilon=p.eps)
    return [into_out(out, 0, y)]


@device_kernel("AddRmsNorm", "npu", why_not=add_rms_norm_reasons, provider="torch_npu", available=unavailable_reason,
               impl="torch_npu.npu_add_rms_norm")
def add_rms_norm_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    y, _rstd, s = npu_module().npu_add_rms_norm(ins["x"], ins["residual"],
                                                _gamma(p, ins["weight"]), epsilon=p.eps)
    return [into_out(out, 0, y), into_out(out, 1, s)]



def swiglu_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``npu_swiglu`` cannot take this SwiGLU call."""
    why = unavailable_reason()
    if why:
        return why
    name, why = c_activation(get_activation(p.activation_name(), "SwiGLU"))
    if why:
        return why
    x = ins["x"]
    if ins.get("up") is not None:
        return "gate and up given apart: npu_swiglu splits one [..., 2n] tensor"
    if x.dtype not in _ALL:
        return f"npu_swiglu takes fp16/bf16/fp32; given {str(x.dtype)[6:]}"
    return None


@device_kernel("SwiGLU", "npu", why_not=swiglu_reasons, provider="torch_npu", available=unavailable_reason,
               impl="torch_npu.npu_swiglu")
def swiglu_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    return [into_out(out, 0, npu_module().npu_swiglu(ins["x"].contiguous(), dim=-1))]


def gated_activation_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``npu_swiglu`` cannot take this Activation call (swiglu only)."""
    if p.activation_name() != "swiglu":
        return f"activation {p.activation_name()!r}: torch_npu's fused one here is swiglu"
    return swiglu_reasons(p, ins)


# models run their gated MLP as Activation(activation_type="swiglu")
device_kernel("Activation", "npu", why_not=gated_activation_reasons, provider="torch_npu",
              available=unavailable_reason, impl="torch_npu.npu_swiglu (swiglu)")(swiglu_npu)


_ROPE_INS = ("q", "k", "position_ids", "cos", "sin")


def rotary_mul_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``npu_rotary_mul`` cannot take this RoPE call."""
    why = unavailable_reason()
    if why:
        return why
    rins = {n: ins.get(n) for n in _ROPE_INS}
    g = geometry("RoPE", p, rins)
    if g.rotary_dim != g.head_dim:
        return f"partial rotary (rotary_dim {g.rotary_dim} < head_dim {g.head_dim})"
    fam = soc_family()
    heads = max(g.q_heads, g.k_heads or 0)
    if fam in ("A2", "A3"):
        if g.head_dim >= 896 or g.head_dim % 2:
            return f"npu_rotary_mul on {fam} needs an even head_dim < 896; given {g.head_dim}"
        if g.batch >= 1000 or heads >= 1000:
            return f"npu_rotary_mul on {fam} needs batch and heads < 1000"
    elif fam in ("910", "310P"):
        if p.rotary_type != "half" or g.head_dim != 128:
            return f"npu_rotary_mul on {fam} takes rotary_mode 'half' with head_dim 128"
    else:
        return f"npu_rotary_mul is not documented for SoC family {fam}"
    allowed = _ALL if fam in ("A2", "A3") else _HALF
    if ins["q"].dtype not in allowed:
        return f"npu_rotary_mul on {fam} does not take {str(ins['q'].dtype)[6:]}"
    if ins["q"].dtype == torch.bfloat16:  # r1/r2 take x's dtype
        return "bf16: cos/sin rounded to bf16 (r1/r2 take x's dtype) miss the bf16 tolerance"
    return None


@device_kernel("RoPE", "npu", why_not=rotary_mul_reasons, provider="torch_npu", available=unavailable_reason,
               impl="torch_npu.npu_rotary_mul per tensor (cos/sin from the cached tables)")
def rope_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    rins = {n: ins.get(n) for n in _ROPE_INS}
    g = geometry("RoPE", p, rins)
    q = ins["q"]
    cos, sin = _token_cos_sin(p, g, rins, q.device)                  # fp32 [B|1, S, D]
    if g.layout == "BNSD":
        cos, sin = cos[:, None], sin[:, None]                         # [B|1, 1, S, D]
    else:
        cos, sin = cos[:, :, None], sin[:, :, None]                   # [B|1, S, 1, D]
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    mode = "half" if p.rotary_type == "half" else "interleave"
    outs = []
    for name, heads in (("q", g.q_heads), ("k", g.k_heads)):
        x = ins.get(name)
        if x is None:
            continue
        x4 = x.unflatten(-1, (heads, g.head_dim)) if g.layout == "BSH" else x
        y = npu_module().npu_rotary_mul(x4, cos, sin, rotary_mode=mode)
        outs.append(into_out(out, len(outs), y.reshape(x.shape)))
    return outs


# the attention, paged-cache and w8 kernels live beside torch_npu's facts
from ..npu import attention as _npu_attention, ffn as _npu_ffn, linear as _npu_linear  # noqa: E402,F401,E501
