"""Fused ops that the graph fusion rules emit (usable directly too).

* ``RopeFlashAttention(q, k?, v?, position_ids?, cos?, sin?, mask?, seq_lens?)``:
  RoPE on q and k, then FlashAttention — what the ``rope_attention`` rule turns
  ``RoPE(q, k) -> FlashAttention(q', k', v)`` into. Params are FlashAttention's
  (``num_heads``, ``num_kv_heads``, ``head_dim``, ``scale``, ``causal``, ``window``,
  ``layout``) plus RoPE's (``rotary_dim``, ``base``, ``rotary_type``,
  ``position_offset``, ``max_seq_len``). One 3-D input alone is packed QKV
  ``[B, S, (H + 2*Hkv)*D]``. RoPE positions are RoPE's (``position_ids``, else
  ``position_offset + arange(S)``); the layout (BSH / BNSD / BSND, default by
  rank as FlashAttention) applies to q, k and v alike. Inputs are positional
  (``None`` / ``""`` for an absent one).
* ``LinearActivation(x, weight, bias?, scale?)``: ``act(x @ W.T + b)`` with
  Linear's params plus ``activation_type`` (a non-gated registered activation),
  rounded once in the reference.

The references compose the RoPE / FlashAttention / Linear references, so the
fused ops agree with the unfused graphs they replace by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError, ParamsError
from ..tensor import TensorDesc
from .activation import get_activation
from .attention import (LAYOUTS, FlashAttentionParams, attention_dims, check_seq_lens,
                        split_packed, validate_head_params)
from .base import OpDef, Params, f64
from .linear import LinearParams, _check_linear, ref_linear
from .registry import get_op, register_op
from .rope import ROTARY_TYPES, RoPEParams, check_positions, rope_geometry

__all__ = ["RopeFlashAttentionParams", "LinearActivationParams", "rope_part", "attention_part"]


@dataclass(frozen=True)
class RopeFlashAttentionParams(Params):
    """FlashAttention's params plus RoPE's; see the module docstring."""

    ALIASES = {"rotary_dims": "rotary_dim", "theta": "base", "rope_theta": "base",
               "input_layout": "layout"}
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    scale: float | None = None
    causal: bool = False
    window: int | None = None
    layout: str | None = None
    rotary_dim: int | None = None
    base: float = 10000.0
    rotary_type: str = "half"
    position_offset: int = 0
    max_seq_len: int = 8192
    dtype: Dtype | None = None

    def validate(self) -> None:
        validate_head_params(self)
        if self.layout is not None:
            lay = str(self.layout).upper()
            if lay not in LAYOUTS:
                self.fail("layout", " | ".join(LAYOUTS), repr(self.layout))
            object.__setattr__(self, "layout", lay)
        rt = ROTARY_TYPES.get(str(self.rotary_type).lower())
        if rt is None:
            self.fail("rotary_type", f"one of {sorted(ROTARY_TYPES)}", repr(self.rotary_type))
        object.__setattr__(self, "rotary_type", rt)
        # RoPE's own checks (base, rotary_dim, max_seq_len ...) at build time, under this
        # op's name: the user built a RopeFlashAttention, not a RoPE
        rope_part(self, self.num_heads, self.num_kv_heads, self.head_dim, self.layout)


def attention_part(p: RopeFlashAttentionParams) -> FlashAttentionParams:
    """The FlashAttention params inside ``p``."""
    return FlashAttentionParams(num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
                                head_dim=p.head_dim, scale=p.scale, causal=p.causal,
                                window=p.window, layout=p.layout, dtype=p.dtype)


def rope_part(p: RopeFlashAttentionParams, heads: int, kv_heads: int, head_dim: int,
              layout: str) -> RoPEParams:
    """The RoPE params inside ``p`` for resolved attention geometry."""
    try:
        return RoPEParams(head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads,
                          rotary_dim=p.rotary_dim, base=p.base, rotary_type=p.rotary_type,
                          layout=layout, max_seq_len=p.max_seq_len,
                          position_offset=p.position_offset, dtype=p.dtype)
    except ParamsError as e:
        raise ParamsError(p.OP, e.what, e.expected, e.given) from None


_ROPE_INS = ("position_ids", "cos", "sin")
_ATTN_INS = ("mask", "seq_lens")


def _packed_desc(d: TensorDesc, hid: int) -> TensorDesc:
    return d.replace(shape=(*d.shape[:-1], hid))


@register_op
class RopeFlashAttention(OpDef):
    """RoPE on q and k, then FlashAttention; see the module docstring."""

    name = "RopeFlashAttention"
    aliases = ("RoPEFlashAttention", "FlashAttentionRoPE")
    Params = RopeFlashAttentionParams
    inputs = ("q", "k?", "v?", "position_ids?", "cos?", "sin?", "mask?", "seq_lens?")
    outputs = ("out",)

    def bind(self, p, items):
        """Positional (``None`` for an absent input); one input alone is packed QKV."""
        if not 1 <= len(items) <= len(self.inputs):
            raise InputError(self.name, "number of inputs", f"1 to {len(self.inputs)} "
                             f"({', '.join(self.inputs)})", len(items))
        if len(items) >= 2 and (len(items) < 3 or (items[1] is None) != (items[2] is None)):
            raise InputError(self.name, "input 'k' or 'v' is missing", "q, k, v (or packed qkv)",
                             f"{len(items)} inputs")
        return super().bind(p, items)

    def _split(self, p, ins: Mapping[str, Any]):
        """(attention dims, per-part descriptors of q, k, v) validating attention."""
        fa = attention_part(p)
        descs = {n: (None if ins.get(n) is None else TensorDesc.of(ins[n]))
                 for n in ("q", "k", "v", *_ATTN_INS)}
        dims = attention_dims(self.name, fa, descs)
        q = descs["q"]
        if dims.packed:
            return dims, (_packed_desc(q, dims.heads * dims.head_dim),
                          _packed_desc(q, dims.kv_heads * dims.head_dim),
                          _packed_desc(q, dims.kv_heads * dims.head_dim))
        return dims, (q, descs["k"], descs["v"])

    def infer_shape(self, p, ins):
        dims, (q, k, _) = self._split(p, ins)
        rp = rope_part(p, dims.heads, dims.kv_heads, dims.head_dim, dims.layout)
        rope_geometry(self.name, rp, {"q": q, "k": k, **{n: ins.get(n) for n in _ROPE_INS}})
        if dims.packed:
            return [q]
        return [TensorDesc(ins["q"].shape, ins["q"].dtype)]

    def check_values(self, p, ins):
        descs = {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}
        dims, (q, k, v) = self._split(p, descs)
        check_positions(self.name, ins.get("position_ids"), ins.get("cos"))
        if not dims.packed:
            check_seq_lens(self.name, attention_part(p), {
                n: ins.get(n) for n in ("q", "k", "v", *_ATTN_INS)})

    def reference(self, p, ins):
        descs = {n: None if x is None else TensorDesc(np.shape(x), Dtype.of(np.asarray(x).dtype))
                 for n, x in ins.items()}
        dims, _ = self._split(p, descs)
        q, k, v = ins["q"], ins.get("k"), ins.get("v")
        if dims.packed:
            q, k, v = split_packed(np.asarray(q), dims)
        rp = rope_part(p, dims.heads, dims.kv_heads, dims.head_dim, dims.layout)
        qr, kr = get_op("RoPE").reference(rp, {"q": q, "k": k,
                                               **{n: ins.get(n) for n in _ROPE_INS}})
        fa = attention_part(p).replace(num_heads=dims.heads, num_kv_heads=dims.kv_heads)
        return get_op("FlashAttention").reference(fa, {"q": qr, "k": kr, "v": np.asarray(v),
                                                       **{n: ins.get(n) for n in _ATTN_INS}})


# ----------------------------------------------------------------------------- LinearActivation


@dataclass(frozen=True)
class LinearActivationParams(LinearParams):
    """Linear's params plus ``activation_type`` (a non-gated registered activation)."""

    activation_type: str = "gelu"

    def validate(self) -> None:
        super().validate()
        act = get_activation(self.activation_type, self.OP)
        if act.gated:
            self.fail("activation_type (gated activations need two projections)",
                      "a non-gated activation", act.name)
        object.__setattr__(self, "activation_type", act.name)


@register_op
class LinearActivation(OpDef):
    """``act(x @ W.T + b)``; see the module docstring."""

    name = "LinearActivation"
    aliases = ("LinearAct", "FusedLinearActivation")
    Params = LinearActivationParams
    inputs = ("x", "weight", "bias?", "scale?")
    outputs = ("y",)

    def bind(self, p, items):
        return get_op("Linear").bind(p.linear(), items)

    def infer_shape(self, p, ins):
        return [_check_linear(self.name, p, ins)]

    def reference(self, p, ins):
        x = ins["x"]
        y = ref_linear(p, x, ins["weight"], ins.get("bias"), ins.get("scale"))
        act = get_activation(p.activation_type, self.name)
        return [np.asarray(act.numpy(f64(y))).astype(np.asarray(x).dtype)]
