"""atb ops as functions on tensors: ``atb.functional.rms_norm(x, w, eps=1e-6)``.

Every function calls a ``torch.ops.atb.*`` custom op, so a model written with them
traces under ``torch.compile(fullgraph=True)``. Inputs may be torch tensors or
NumPy / MindSpore / Paddle tensors (converted through DLPack); results are torch
tensors. Optional parameters left as ``None`` mean "infer" as in the op contract.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from atbcore.dtypes import Dtype
from atbcore.errors import ShapeError
from atbcore.ops import get_op
from atbcore.tensor import describe

from . import library as _lib  # noqa: F401  (registers torch.ops.atb.*)
from .tensors import as_torch, as_torch_opt

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "linear", "matmul",
           "rope", "flash_attention", "paged_attention", "reshape_and_cache", "softmax",
           "scaled_masked_softmax", "gelu", "quick_gelu", "silu", "relu", "swiglu", "geglu",
           "activation", "fused_feed_forward", "moe", "residual_add", "elewise", "transpose",
           "reshape", "split", "concat", "slice", "gather", "embedding", "argmax",
           "topk_topp_sampling", "all_reduce"]

_A = torch.ops.atb


def _t(x: Any, op: str, what: str = "input") -> Tensor:
    return as_torch(x, op, what)


def _o(x: Any, op: str, what: str = "input") -> Tensor | None:
    return as_torch_opt(x, op, what)


def _z(v: Any, zero: Any = 0) -> Any:
    """``None`` -> the schema's "not given" value."""
    return zero if v is None else v


# ----------------------------------------------------------------------------- norms


def rms_norm(x: Any, weight: Any, eps: float = 1e-6) -> Tensor:
    """``x / rms(x) * weight`` over the last dim (fp32 compute)."""
    return _A.rms_norm(_t(x, "RmsNorm"), _t(weight, "RmsNorm", "weight"), eps)


def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    return tuple(_A.add_rms_norm(_t(x, "AddRmsNorm"), _t(residual, "AddRmsNorm", "residual"),
                                 _t(weight, "AddRmsNorm", "weight"), eps))


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim."""
    return _A.layer_norm(_t(x, "LayerNorm"), _o(weight, "LayerNorm"), _o(bias, "LayerNorm"), eps)


def add_layer_norm(x: Any, residual: Any, weight: Any = None, bias: Any = None,
                   eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """``(layer_norm(x + residual), x + residual)``."""
    return tuple(_A.add_layer_norm(_t(x, "AddLayerNorm"), _t(residual, "AddLayerNorm"),
                                   _o(weight, "AddLayerNorm"), _o(bias, "AddLayerNorm"), eps))


# ----------------------------------------------------------------------------- linear


def linear(x: Any, weight: Any, bias: Any = None, scale: Any = None) -> Tensor:
    """``x @ weight.T + bias`` (weight ``[out, in]``); with ``scale`` the weight is
    int8 and dequantised per output channel (weight-only int8)."""
    x, w, b = _t(x, "Linear"), _t(weight, "Linear", "weight"), _o(bias, "Linear", "bias")
    if scale is not None:
        return _A.linear_w8(x, w, _t(scale, "Linear", "scale"), b)
    return _A.linear(x, w, b)


def matmul(a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    """Batched, broadcasting ``a @ b`` (optionally transposing either)."""
    return _A.matmul(_t(a, "MatMul", "a"), _t(b, "MatMul", "b"), transpose_a, transpose_b)


# ----------------------------------------------------------------------------- rope, attention


def rope(q: Any, k: Any = None, position_ids: Any = None, cos: Any = None, sin: Any = None, *,
         num_heads: int | None = None, num_kv_heads: int | None = None,
         head_dim: int | None = None, rotary_dim: int | None = None, base: float = 10000.0,
         rotary_type: str = "half", layout: str | None = None,
         position_offset: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """Rotary embedding of q (and k): returns ``q_out`` or ``(q_out, k_out)``."""
    q = _t(q, "RoPE", "q")
    only_q = k is None
    kk = q if only_q else _t(k, "RoPE", "k")
    nkv = num_heads if only_q else num_kv_heads
    qo, ko = _A.rope(q, kk, _o(position_ids, "RoPE"), _o(cos, "RoPE"), _o(sin, "RoPE"),
                     _z(num_heads), _z(nkv), _z(head_dim), _z(rotary_dim), base, rotary_type,
                     _z(layout, ""), position_offset)
    return qo if only_q else (qo, ko)


def flash_attention(q: Any, k: Any, v: Any, mask: Any = None, seq_lens: Any = None, *,
                    num_heads: int | None = None, num_kv_heads: int | None = None,
                    scale: float | None = None, causal: bool = False, window: int | None = None,
                    layout: str | None = None) -> Tensor:
    """Attention with GQA, causal (bottom-right aligned), sliding window, masks and
    per-batch kv lengths; O(N) memory. Layouts BSH / BNSD / BSND."""
    return _A.flash_attention(_t(q, "FlashAttention", "q"), _t(k, "FlashAttention", "k"),
                              _t(v, "FlashAttention", "v"), _o(mask, "FlashAttention"),
                              _o(seq_lens, "FlashAttention"), _z(num_heads), _z(num_kv_heads),
                              _z(scale, 0.0), causal, _z(window), _z(layout, ""))


def paged_attention(query: Any, key_cache: Any, value_cache: Any, block_tables: Any,
                    context_lens: Any, q_seq_lens: Any = None, *, num_heads: int | None = None,
                    num_kv_heads: int | None = None, scale: float | None = None,
                    causal: bool = True) -> Tensor:
    """Attention of ``query [T, H, D]`` over paged caches ``[blocks, block_size, Hkv, D]``."""
    op = "PagedAttention"
    return _A.paged_attention(_t(query, op), _t(key_cache, op), _t(value_cache, op),
                              _t(block_tables, op), _t(context_lens, op), _o(q_seq_lens, op),
                              _z(num_heads), _z(num_kv_heads), _z(scale, 0.0), causal)


def reshape_and_cache(key: Any, value: Any, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Any) -> tuple[Tensor, Tensor]:
    """Write ``key``/``value [T, Hkv, D]`` into the caches at ``slot_mapping`` (in place;
    the caches must be torch tensors). Returns the caches."""
    op = "ReshapeAndCache"
    _A.reshape_and_cache(_t(key, op), _t(value, op), _t(key_cache, op), _t(value_cache, op),
                         _t(slot_mapping, op))
    return key_cache, value_cache


# ----------------------------------------------------------------------------- softmax, activations


def softmax(x: Any, dim: int | Sequence[int] = -1) -> Tensor:
    """Softmax over ``dim`` (an axis or several), fp32 compute."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    return _A.softmax(_t(x, "Softmax"), dims)


def scaled_masked_softmax(x: Any, mask: Any = None, scale: float = 1.0, causal: bool = False,
                          dim: int = -1) -> Tensor:
    """``softmax(x * scale + mask)``; fully masked rows give zeros."""
    return _A.scaled_masked_softmax(_t(x, "ScaledMaskedSoftmax"),
                                    _o(mask, "ScaledMaskedSoftmax"), scale, causal, dim)


def gelu(x: Any, approximate: str = "none") -> Tensor:
    return _A.gelu(_t(x, "Gelu"), approximate)


def quick_gelu(x: Any) -> Tensor:
    return _A.quick_gelu(_t(x, "QuickGelu"))


def silu(x: Any) -> Tensor:
    return _A.silu(_t(x, "SiLU"))


def relu(x: Any) -> Tensor:
    return _A.relu(_t(x, "Relu"))


def swiglu(x: Any, up: Any = None) -> Tensor:
    """``silu(a) * b`` for ``x = [a | b]``, or ``silu(x) * up``."""
    return _A.swiglu(_t(x, "SwiGLU"), _o(up, "SwiGLU"))


def geglu(x: Any, up: Any = None, approximate: str = "none") -> Tensor:
    return _A.geglu(_t(x, "GeGLU"), _o(up, "GeGLU"), approximate)


def activation(x: Any, activation_type: str, up: Any = None) -> Tensor:
    """Any registered activation by name (``"gelu_tanh"``, a plugin's ...)."""
    return _A.activation(_t(x, "Activation"), _o(up, "Activation"), activation_type)


# ----------------------------------------------------------------------------- FFN, MoE


def fused_feed_forward(x: Any, gate_w: Any, up_w: Any, down_w: Any, *,
                       activation_type: str = "swiglu", gate_up_w: Any = None,
                       gate_b: Any = None, up_b: Any = None, down_b: Any = None,
                       gate_up_b: Any = None, residual: Any = None) -> Tensor:
    """``down(act(gate(x)) * up(x)) [+ residual]`` with nn.Linear-layout weights;
    give ``gate_up_w`` (gate rows first) with ``gate_w=up_w=None`` for merged
    weights, ``gate_w=None`` for non-gated activations."""
    op = "FusedFeedForward"
    return _A.fused_ffn(_t(x, op), _o(gate_w, op), _o(up_w, op), _t(down_w, op),
                        _o(gate_up_w, op), _o(gate_b, op), _o(up_b, op), _o(down_b, op),
                        _o(gate_up_b, op), _o(residual, op), activation_type)


def moe(x: Any, router_w: Any, w_gate_up: Any, w_down: Any, *, top_k: int = 2,
        norm_topk_prob: bool = True, activation_type: str = "swiglu",
        num_experts: int | None = None) -> Tensor:
    """Mixture of experts: ``x [T, H]``, ``router_w [E, H]``, ``w_gate_up [E, 2I, H]``,
    ``w_down [E, H, I]``."""
    return _A.moe(_t(x, "MoE"), _t(router_w, "MoE"), _t(w_gate_up, "MoE"), _t(w_down, "MoE"),
                  top_k, norm_topk_prob, activation_type, _z(num_experts))


# ----------------------------------------------------------------------------- elementwise, shape


def residual_add(x: Any, residual: Any) -> Tensor:
    return _A.residual_add(_t(x, "ResidualAdd"), _t(residual, "ResidualAdd", "residual"))


def elewise(x: Any, y: Any = None, *, elewise_type: str, scalar: float = 1.0,
            out_dtype: Any = None) -> Tensor:
    """One elementwise op by name (add, sub, mul, div, muls, neg, cast, cos, sin,
    tanh, exp, rsqrt)."""
    od = "" if out_dtype is None else Dtype.of(out_dtype).name.lower()
    return _A.elewise(_t(x, "Elewise"), _o(y, "Elewise"), elewise_type, float(scalar), od)


def transpose(x: Any, perm: Sequence[int]) -> Tensor:
    return _A.transpose(_t(x, "Transpose"), list(perm))


def reshape(x: Any, shape: Sequence[int]) -> Tensor:
    """A view of ``x`` with ``shape`` (one -1 allowed); validated by the core op."""
    x = _t(x, "Reshape")
    if not torch.compiler.is_compiling():
        opdef = get_op("Reshape")
        opdef.infer_shape(opdef.make_params({"shape": tuple(shape)}),
                          {"x": describe(x)})
    return x.reshape(tuple(shape))


def split(x: Any, sizes: Sequence[int] | None = None, dim: int = -1, *,
          num: int | None = None) -> list[Tensor]:
    """Pieces of ``sizes`` along ``dim``, or ``num`` equal pieces."""
    x = _t(x, "Split")
    if sizes is None:
        if not num or x.shape[dim] % num:
            raise ShapeError("Split", f"dim {dim} of size {x.shape[dim]} into num equal parts",
                             "num > 0 dividing the size", num)
        sizes = [x.shape[dim] // num] * num
    return list(_A.split(x, list(sizes), dim))


def concat(xs: Sequence[Any], dim: int = -1) -> Tensor:
    return _A.concat([_t(x, "Concat") for x in xs], dim)


def slice(x: Any, offsets: Sequence[int], sizes: Sequence[int]) -> Tensor:  # noqa: A001
    """``x[offsets : offsets + sizes]`` per dim (size -1 = to the end)."""
    return _A.slice(_t(x, "Slice"), list(offsets), list(sizes))


def gather(x: Any, indices: Any, axis: int = 0) -> Tensor:
    return _A.gather(_t(x, "Gather"), _t(indices, "Gather", "indices"), axis)


def embedding(ids: Any, weight: Any) -> Tensor:
    """``weight[ids]`` — argument order of ``torch.nn.functional.embedding``."""
    return _A.embedding(_t(weight, "Embedding", "weight"), _t(ids, "Embedding", "ids"))


def argmax(x: Any, dim: int = -1, keepdim: bool = False) -> Tensor:
    return _A.argmax(_t(x, "Argmax"), dim, keepdim)


def topk_topp_sampling(logits: Any, top_k: int = 0, top_p: float = 1.0,
                       temperature: float = 1.0, seed: int = 0) -> Tensor:
    """Seeded top-k / top-p sampling, ``[B, V] -> int64 [B]``."""
    return _A.topk_topp_sampling(_t(logits, "TopkToppSampling"), top_k, top_p, temperature, seed)


def all_reduce(x: Any, op: str = "sum") -> Tensor:
    """Reduce across the default process group (identity in a single process)."""
    return _A.all_reduce(_t(x, "AllReduce"), op, 0)
