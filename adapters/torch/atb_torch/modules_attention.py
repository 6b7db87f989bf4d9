"""Attention modules: ``FlashAttention`` (aliases ``SelfAttention``, ``MhaV2``,
``MhaV3``), ``RoPE``, ``PagedAttention``, ``ReshapeAndCache``.

``FlashAttention`` is two things, as in the seed:

* called with ``(q, k, v[, mask, seq_lens])`` it is the op (no weights);
* called with one tensor it is a self-attention layer: hidden states
  ``[B, S, hidden]`` projected by its own ``q_proj``/``k_proj``/``v_proj`` (lazy
  until the hidden size is known), or — right after a ``Linear`` in a GraphOp, or
  with ``packed=True`` — a packed QKV tensor. With ``kv_cache=True`` the call takes
  and returns a cache: ``out, kv = attn(x, kv_cache=kv)`` (see ``atb_torch.graph``).
  The layer form runs as a one-layer GraphOp, so standalone and in-graph results
  are the same code.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from torch import Tensor, nn

from atbcore.errors import ParamsError
from atbcore.graph import layers as core

from . import functional as F
from .module_base import AtbModule, ParamHolder, new_param
from .tensors import as_torch

__all__ = ["FlashAttention", "SelfAttention", "MhaV2", "MhaV3", "RoPE", "PagedAttention",
           "ReshapeAndCache"]

_UNSET: Any = object()


def _pos(op: str, what: str, v: Any, optional: bool = True) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ParamsError(op, what, "a positive int", repr(v))
    return int(v)


class RoPE(AtbModule):
    """Rotary embedding. ``forward(q, k=None, position_ids=None, cos=None, sin=None)``
    returns ``q_out`` or ``(q_out, k_out)``. Right before a ``FlashAttention`` in a
    GraphOp it rotates that attention's q and k."""

    op_name, kind, graph_layer = "RoPE", "rope", True

    def __init__(self, name: str | None = None, *, num_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 rotary_dim: int | None = None, base: float = 10000.0, rotary_type: str = "half",
                 layout: str | None = None, position_offset: int = 0) -> None:
        super().__init__(name)
        self.num_heads, self.num_kv_heads = _pos("RoPE", "num_heads", num_heads), \
            _pos("RoPE", "num_kv_heads", num_kv_heads)
        self.head_dim, self.rotary_dim = _pos("RoPE", "head_dim", head_dim), \
            _pos("RoPE", "rotary_dim", rotary_dim)
        self.base, self.rotary_type = float(base), rotary_type
        self.layout, self.position_offset = layout, int(position_offset)
        self.core_layer("rope", {})  # validates the settings now, not at the first call

    def forward(self, q: Any, k: Any = None, position_ids: Any = None, cos: Any = None,
                sin: Any = None) -> Tensor | tuple[Tensor, Tensor]:
        return F.rope(q, k, position_ids, cos, sin, num_heads=self.num_heads,
                      num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                      rotary_dim=self.rotary_dim, base=self.base, rotary_type=self.rotary_type,
                      layout=self.layout, position_offset=self.position_offset)

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> core.RoPE:
        return core.RoPE(name, num_heads=self.num_heads, head_dim=self.head_dim,
                         rotary_dim=self.rotary_dim, base=self.base, rotary_type=self.rotary_type)


class FlashAttention(AtbModule):
    """Attention op and self-attention layer; see the module docstring."""

    op_name, kind, graph_layer = "FlashAttention", "attention", True

    def __init__(self, name: str | None = None, *, num_heads: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 causal: bool = False, scale: float | None = None, window: int | None = None,
                 kv_cache: bool = False, packed: bool | None = None, qkv_bias: bool = False,
                 layout: str | None = None, hidden_size: int | None = None, dtype: Any = None,
                 device: Any = None) -> None:
        super().__init__(name)
        self.num_heads = _pos("FlashAttention", "num_heads", num_heads, optional=False)
        self.num_kv_heads = _pos("FlashAttention", "num_kv_heads", num_kv_heads) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ParamsError("FlashAttention", "num_kv_heads must divide num_heads",
                              f"a divisor of {self.num_heads}", self.num_kv_heads)
        self.head_dim = _pos("FlashAttention", "head_dim", head_dim)
        self.causal, self.scale, self.window = bool(causal), scale, window
        self.kv_cache, self.packed, self.qkv_bias = bool(kv_cache), packed, bool(qkv_bias)
        self.layout = layout
        self._factory = {"dtype": dtype, "device": device}
        self._solo_op: Any = None
        if packed is not True:
            self._make_projections(_pos("FlashAttention", "hidden_size", hidden_size))

    # ------------------------------------------------------------------ projections
    def _make_projections(self, hidden: int | None) -> None:
        hd = self.head_dim or (hidden // self.num_heads if hidden else None)
        for p, heads in (("q", self.num_heads), ("k", self.num_kv_heads), ("v", self.num_kv_heads)):
            shape = (heads * hd, hidden) if hidden and hd else None
            params = {"weight": new_param(shape, **self._factory)}
            if self.qkv_bias:
                params["bias"] = new_param(None if shape is None else shape[:1], **self._factory)
            setattr(self, f"{p}_proj", ParamHolder(**params))
        if hidden and hd:
            for k, p in self.core_weights().items():
                self._init(k, p, hidden)

    def drop_projections(self) -> None:
        """Packed-QKV use (after a Linear): this layer owns no weights."""
        for p in "qkv":
            if hasattr(self, f"{p}_proj"):
                delattr(self, f"{p}_proj")

    @property
    def has_projections(self) -> bool:
        return hasattr(self, "q_proj")

    def _init(self, key: str, p: nn.Parameter, hidden: int) -> None:
        import torch

        bound = 1.0 / math.sqrt(hidden)
        with torch.no_grad():
            nn.init.uniform_(p, -bound, bound)

    def _init_param(self, key: str, p: nn.Parameter) -> None:
        self._init(key, p, int(self.q_proj.weight.shape[1]))

    def kv_hidden(self, prev: Any = None) -> int:
        """``num_kv_heads * head_dim`` of the cache (needs the sizes known)."""
        if self.has_projections:
            return int(self.k_proj.weight.shape[0])
        hd = self.head_dim
        if hd is None:
            out = getattr(prev, "out_features", None)
            if not out or out % (self.num_heads + 2 * self.num_kv_heads):
                raise ParamsError(self.name or "FlashAttention", "packed QKV head_dim",
                                  "head_dim= or a preceding Linear with (H + 2*Hkv) * D outputs",
                                  out)
            hd = out // (self.num_heads + 2 * self.num_kv_heads)
        return self.num_kv_heads * hd

    # ------------------------------------------------------------------ calls
    def forward(self, q: Any, k: Any = None, v: Any = None, mask: Any = None,
                seq_lens: Any = None, *, kv_cache: Any = _UNSET) -> Any:
        if k is not None or v is not None:
            if v is None or kv_cache is not _UNSET:
                raise ParamsError(self.name or "FlashAttention", "op call",
                                  "(q, k, v[, mask, seq_lens]) without kv_cache", "k without v")
            return F.flash_attention(q, k, v, mask, seq_lens, num_heads=self.num_heads,
                                     num_kv_heads=self.num_kv_heads, scale=self.scale,
                                     causal=self.causal, window=self.window, layout=self.layout)
        if mask is not None or seq_lens is not None:
            raise ParamsError(self.name or "FlashAttention", "layer call (one input)",
                              "no mask/seq_lens (use the op form q, k, v)", "mask or seq_lens")
        solo = self._solo()
        return solo(as_torch(q, "FlashAttention")) if kv_cache is _UNSET else \
            solo(as_torch(q, "FlashAttention"), kv_cache=kv_cache)

    def _solo(self) -> Any:
        if self._solo_op is None:
            from .graph import GraphOp

            # Not a registered child: the parameters stay this module's own.
            object.__setattr__(self, "_solo_op", GraphOp([self], name=self.name or "attention",
                                                         _borrow=True))
        return self._solo_op

    def core_layer(self, name: str, weights: Mapping[str, Any]) -> core.FlashAttention:
        layer = core.FlashAttention(name, num_heads=self.num_heads,
                                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                    causal=self.causal, scale=self.scale, window=self.window,
                                    kv_cache=self.kv_cache, packed=not self.has_projections,
                                    qkv_bias=self.qkv_bias)
        return layer.load_weights(weights) if self.has_projections else layer

    def extra_repr(self) -> str:
        return (f"{self.name!r}, " if self.name else "") + \
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, " \
            f"causal={self.causal}, kv_cache={self.kv_cache}"


SelfAttention = MhaV2 = MhaV3 = FlashAttention


class PagedAttention(AtbModule):
    """``forward(query, key_cache, value_cache, block_tables, context_lens,
    q_seq_lens=None)`` over paged caches."""

    op_name, kind = "PagedAttention", "paged_attention"

    def __init__(self, name: str | None = None, *, num_heads: int | None = None,
                 num_kv_heads: int | None = None, scale: float | None = None,
                 causal: bool = True) -> None:
        super().__init__(name)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.scale, self.causal = scale, causal

    def forward(self, query: Any, key_cache: Any, value_cache: Any, block_tables: Any,
                context_lens: Any, q_seq_lens: Any = None) -> Tensor:
        return F.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                 q_seq_lens, num_heads=self.num_heads,
                                 num_kv_heads=self.num_kv_heads, scale=self.scale,
                                 causal=self.causal)


class ReshapeAndCache(AtbModule):
    """``forward(key, value, key_cache, value_cache, slot_mapping)`` writes in place
    and returns the caches."""

    op_name, kind = "ReshapeAndCache", "reshape_and_cache"

    def forward(self, key: Any, value: Any, key_cache: Tensor, value_cache: Tensor,
                slot_mapping: Any) -> tuple[Tensor, Tensor]:
        return F.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
