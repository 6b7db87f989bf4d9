"""atb's ops registered with ``torch.library`` under the namespace ``atb``.

``torch.ops.atb.rms_norm(x, w, 1e-6)`` runs the same torch kernel the core
dispatches to, and each op has a fake (meta) implementation so models using them
trace under ``torch.compile(fullgraph=True)`` without graph breaks. In-place ops
declare what they mutate. Ops are inference-only: there is no autograd formula,
so calling one on tensors that require grad raises an :class:`AtbError` instead
of returning a silently wrong gradient.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from atbcore.backends import get_backend
from atbcore.errors import AtbError
from atbcore.ops import get_op
from atbcore.ops.base import Params
from atbcore.tensor import describe

from .devices import check_devices

__all__ = ["call_kernel", "OPS", "register", "refusing_autograd", "refuse_backward"]

OPS: dict[str, str] = {}  # torch.ops.atb name -> core op name


@lru_cache(maxsize=4096)
def _params(op: str, items: tuple) -> Params:
    return get_op(op).make_params(dict(items))


def call_kernel(op: str, params: dict[str, Any], **ins: Tensor | None) -> list[Tensor]:
    """Validate like ``Operation.execute`` does, then run the torch kernel directly."""
    opdef = get_op(op)
    kernel = get_backend("torch").kernel(op)
    if kernel is None:
        raise AtbError(op, "no torch kernel", "a registered torch kernel", "none")
    check_devices(op, [t for t in ins.values() if isinstance(t, Tensor)], kernel.devices)
    p = _params(op, tuple(sorted(params.items())))
    descs = {n: (None if t is None else describe(t)) for n, t in ins.items()}
    for n in opdef.input_names:
        descs.setdefault(n, None)
        ins.setdefault(n, None)
    opdef.infer_shape(p, descs)
    opdef.check_values(p, ins)
    outs = list(kernel.fn(p, ins))
    # functional custom ops must not return views of their inputs
    inputs = [t for t in ins.values() if isinstance(t, Tensor)]
    for i, o in enumerate(outs):
        if any(o is t or (o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                          and o.numel() > 0) for t in inputs):
            outs[i] = o.clone()
    return outs


def _refuse(op: str, like: Tensor) -> Tensor:
    raise AtbError(op, "backward is not implemented (inference-only op)",
                   "no gradient through atb ops (run under torch.no_grad())", "a backward call")


# The "gradient" of every atb op: raises when it runs. An op of its own (not a Python
# raise inside the backward formula) so that torch.compile can trace a backward graph
# for a forward that records autograd, and the error comes when backward really runs.
# Exempt from opcheck: raising is its whole contract (tests check that it does).
refuse_backward = torch.library.custom_op("atb::refuse_backward", _refuse, mutates_args=())


@refuse_backward.register_fake
def _(op, like):
    return torch.empty_like(like)


def refusing_autograd(op: Any, core: Any) -> None:
    """Give custom op ``op`` an autograd formula whose gradients are
    ``refuse_backward`` calls: forward records the graph, backward raises AtbError.
    ``core`` names the op in the error (or is ``fn(inputs) -> name``)."""

    def setup_context(ctx, inputs, output):
        flat: list[Tensor] = []
        layout: list[Any] = []
        for a in inputs:
            if isinstance(a, Tensor):
                layout.append(len(flat))
                flat.append(a)
            elif isinstance(a, (list, tuple)) and a and all(isinstance(t, Tensor) for t in a):
                layout.append(list(range(len(flat), len(flat) + len(a))))
                flat.extend(a)
            else:
                layout.append(None)
        ctx.core, ctx.layout = (core(inputs) if callable(core) else core), layout
        ctx.save_for_backward(*flat)

    def backward(ctx, *grads):
        saved = ctx.saved_tensors

        def grad(i: int) -> Tensor | None:
            t = saved[i]
            return refuse_backward(ctx.core, t) if t.is_floating_point() else None

        return tuple(None if pos is None else [grad(i) for i in pos] if isinstance(pos, list)
                     else grad(pos) for pos in ctx.layout)

    op.register_autograd(backward, setup_context=setup_context)


def _register(name: str, core: str, autograd_guard: bool = True):
    """Decorator: custom_op + an autograd formula that refuses to differentiate."""

    def deco(fn):
        op = torch.library.custom_op(f"atb::{name}", fn, mutates_args=())
        OPS[name] = core
        if autograd_guard:
            refusing_autograd(op, core)
        return op

    return deco


register = _register  # the public name, for the sibling library_* modules


# ----------------------------------------------------------------------------- norms


@_register("rms_norm", "RmsNorm")
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return call_kernel("RmsNorm", {"eps": eps}, x=x, weight=weight)[0]


@rms_norm.register_fake
def _(x, weight, eps=1e-6):
    # contiguous, as the kernel's output (inductor checks fake strides against real ones)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_register("add_rms_norm", "AddRmsNorm")
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    y, s = call_kernel("AddRmsNorm", {"eps": eps}, x=x, residual=residual, weight=weight)
    return y, s


@add_rms_norm.register_fake
def _(x, residual, weight, eps=1e-6):
    return torch.empty_like(x), torch.empty_like(x)


@_register("layer_norm", "LayerNorm")
def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    return call_kernel("LayerNorm", {"eps": eps}, x=x, weight=weight, bias=bias)[0]


@layer_norm.register_fake
def _(x, weight=None, bias=None, eps=1e-5):
    return torch.empty_like(x)


@_register("add_layer_norm", "AddLayerNorm")
def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    y, s = call_kernel("AddLayerNorm", {"eps": eps}, x=x, residual=residual, weight=weight, bias=bias)
    return y, s


@add_layer_norm.register_fake
def _(x, residual, weight=None, bias=None, eps=1e-5):
    return torch.empty_like(x), torch.empty_like(x)


def _opt(v, unset):
    """Schemas carry plain ints/floats/strs; ``unset`` stands for "not given"."""
    return None if v == unset else v


# ----------------------------------------------------------------------------- linear


@_register("linear", "Linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return call_kernel("Linear", {}, x=x, weight=weight, bias=bias)[0]


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_register("linear_w8", "Linear")
def linear_w8(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """Weight-only int8 linear: ``weight`` int8 [out, in], ``scale`` [out] per channel."""
    return call_kernel("Linear", {"quant": "w8", "bias": bias is not None}, x=x, weight=weight,
                       scale=scale, bias=bias)[0]


@linear_w8.register_fake
def _(x, weight, scale, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_register("matmul", "MatMul")
def matmul(a: Tensor, b: Tensor, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    return call_kernel("MatMul", {"transpose_a": transpose_a, "transpose_b": transpose_b},
                       a=a, b=b)[0]


@matmul.register_fake
def _(a, b, transpose_a=False, transpose_b=False):
    return torch.matmul(a.transpose(-1, -2) if transpose_a else a,
                        b.transpose(-1, -2) if transpose_b else b)


# ----------------------------------------------------------------------------- rope


@_register("rope", "RoPE")
def rope(q: Tensor, k: Tensor, position_ids: Tensor | None = None, cos: Tensor | None = None,
         sin: Tensor | None = None, num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
         rotary_dim: int = 0, base: float = 10000.0, rotary_type: str = "half",
         layout: str = "", position_offset: int = 0) -> tuple[Tensor, Tensor]:
    """RoPE of q and k together; 0 / "" mean "infer" for the integer/str params."""
    params = {"num_heads": _opt(num_heads, 0), "num_kv_heads": _opt(num_kv_heads, 0),
              "head_dim": _opt(head_dim, 0), "rotary_dim": _opt(rotary_dim, 0), "base": base,
              "rotary_type": rotary_type, "layout": _opt(layout, ""),
              "position_offset": position_offset}
    qo, ko = call_kernel("RoPE", params, q=q, k=k, position_ids=position_ids, cos=cos, sin=sin)
    return qo, ko


@rope.register_fake
def _(q, k, position_ids=None, cos=None, sin=None, num_heads=0, num_kv_heads=0, head_dim=0,
      rotary_dim=0, base=10000.0, rotary_type="half", layout="", position_offset=0):
    return torch.empty_like(q), torch.empty_like(k)


# ----------------------------------------------------------------------------- attention


@_register("flash_attention", "FlashAttention")
def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                    seq_lens: Tensor | None = None, num_heads: int = 0, num_kv_heads: int = 0,
                    scale: float = 0.0, causal: bool = False, window: int = 0,
                    layout: str = "") -> Tensor:
    """Attention by the FlashAttention contract; 0 / "" mean "infer / default"."""
    params = {"num_heads": _opt(num_heads, 0), "num_kv_heads": _opt(num_kv_heads, 0),
              "scale": _opt(scale, 0.0), "causal": causal, "window": _opt(window, 0),
              "layout": _opt(layout, "")}
    return call_kernel("FlashAttention", params, q=q, k=k, v=v, mask=mask, seq_lens=seq_lens)[0]


@flash_attention.register_fake
def _(q, k, v, mask=None, seq_lens=None, num_heads=0, num_kv_heads=0, scale=0.0, causal=False,
      window=0, layout=""):
    return torch.empty_like(q, memory_format=torch.contiguous_format)  # as the kernel's


@_register("paged_attention", "PagedAttention")
def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    context_lens: Tensor, q_seq_lens: Tensor | None = None, num_heads: int = 0,
                    num_kv_heads: int = 0, scale: float = 0.0, causal: bool = True) -> Tensor:
    params = {"num_heads": _opt(num_heads, 0), "num_kv_heads": _opt(num_kv_heads, 0),
              "scale": _opt(scale, 0.0), "causal": causal}
    return call_kernel("PagedAttention", params, query=query, key_cache=key_cache,
                       value_cache=value_cache, block_tables=block_tables,
                       context_lens=context_lens, q_seq_lens=q_seq_lens)[0]


@paged_attention.register_fake
def _(query, key_cache, value_cache, block_tables, context_lens, q_seq_lens=None, num_heads=0,
      num_kv_heads=0, scale=0.0, causal=True):
    return torch.empty_like(query)


def _reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                       slot_mapping: Tensor) -> None:
    call_kernel("ReshapeAndCache", {}, key=key, value=value, key_cache=key_cache,
                value_cache=value_cache, slot_mapping=slot_mapping)


reshape_and_cache = torch.library.custom_op(
    "atb::reshape_and_cache", _reshape_and_cache, mutates_args=("key_cache", "value_cache"))
OPS["reshape_and_cache"] = "ReshapeAndCache"


@reshape_and_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping):
    return None


# The other families register on import, so ``import atb_torch.library`` gives every op.
from . import library_act, library_misc, library_graph  # noqa: E402,F401
