"""Typed payloads of the execution points: what a plugin learns besides the tensors.

Every tensor in a payload is the caller's framework's (torch, MindSpore, Paddle or
NumPy), like the ``tensors`` list of ``atb_preprocess``; head-split tensors are
``[B, S, heads, head_dim]`` (token-major blocks run with an ``atb.KVCache`` show
their ``T`` tokens as ``B = 1, S = T``). ``positions`` are ``[B | 1, S]`` int64:
each token's absolute position, the cache offset already added.

* :class:`RopePayload` — the ``rope`` point (``atb_rope`` / a GraphOp's
  ``register_plugin("rope", p)``): q and k before the rotation.
* :class:`AttentionPayload` — ``pre_attention`` / ``post_attention``: q, k, v of
  the attention node (k and v are the keys/values attended to: past and new).
* :class:`PointPayload` — every other point (node, layer index, cache state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RopeParameters", "CacheState", "PointPayload", "AttentionPayload", "RopePayload"]


@dataclass(frozen=True)
class RopeParameters:
    """The rotation the model asks for (the RoPE node's parameters): ``base``
    (theta), ``rotary_dim`` (leading dims of each head that turn; the rest pass
    through), ``head_dim``, ``rotary_type`` (``"half"``: dim ``i`` pairs with
    ``i + rotary_dim/2``; ``"interleave"``: ``(2i, 2i+1)``), head counts and the
    ``position_offset`` of blocks that number positions themselves."""

    base: float
    rotary_dim: int
    head_dim: int
    rotary_type: str
    num_heads: int
    num_kv_heads: int | None
    position_offset: int = 0


@dataclass(frozen=True)
class CacheState:
    """How the block keeps keys and values across calls.

    ``form``: ``"none"`` (no cache), ``"concatenate"`` (past keys/values are
    graph inputs, presents are outputs) or ``"in_place"`` (an ``atb.KVCache``
    written by the plan). ``past_lengths``: tokens already cached before this
    call, one per row of the payload's ``positions`` (token-major in-place
    blocks have one row: every sequence of the batch holds as many). ``key_cache`` / ``value_cache``: in the in-place form at the
    attention points, the cache layer ``[max_batch, max_seq_len, kv_heads,
    head_dim]`` the attention reads (``None`` elsewhere)."""

    form: str
    past_lengths: tuple[int, ...] = ()
    key_cache: Any = None
    value_cache: Any = None


@dataclass(frozen=True)
class PointPayload:
    """Common to every point: ``point``, ``node`` (GraphOp/node name), ``layer``
    (index of the node among the block's nodes at the same point, in graph
    order: the model layer for decoders; ``None`` at ``pre_block`` /
    ``post_block``) and ``cache``."""

    point: str
    node: str
    layer: int | None
    cache: CacheState


@dataclass(frozen=True)
class AttentionPayload(PointPayload):
    """``pre_attention`` / ``post_attention``: ``q`` ``[B, S, H, D]``, ``k`` / ``v``
    ``[B, S_kv, Hkv, D]`` (views where the framework has them; at ``post_attention``
    they are the inputs the attention read), ``positions`` of the queries, ``rope``
    when the block rotates (the rotation already happened: q and k are rotated),
    ``output`` ``[B, S, H, D]`` at ``post_attention`` (``None`` before)."""

    q: Any = None
    k: Any = None
    v: Any = None
    positions: Any = None
    rope: RopeParameters | None = None
    output: Any = None


@dataclass(frozen=True)
class RopePayload(PointPayload):
    """The ``rope`` point: ``q`` ``[B, S, H, D]`` and ``k`` ``[B, S, Hkv, D]`` (or
    ``None``: a RoPE of q alone) before rotation, ``positions`` ``[B | 1, S]``
    int64 and the node's ``rope`` parameters. A plugin returns ``(q_rot, k_rot)``
    of the same shapes and dtypes (``k_rot`` ``None`` when ``k`` is), or ``None``
    to leave the rotation to the next plugin and finally to the built-in one."""

    q: Any = None
    k: Any = None
    positions: Any = None
    rope: RopeParameters | None = None
