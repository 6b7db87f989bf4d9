"""Position pieces of decoder layers: learned absolute positions
(:class:`PositionEmbedding`, GPT-2), RoPE cos/sin tables made from a model's own
frequencies (:func:`rope_table_inputs`: scaled RoPE such as llama3, linear, yarn,
dynamic NTK within its length) and the per-head RmsNorm of q and k
(:func:`head_norm`, Qwen3).

Positions come from the attention's cache feeding: every call's tokens sit at
``past + 0 .. past + S - 1`` of their row, and both cache forms already feed them to
an input named ``<attention>.position_ids`` (``[S]`` in the concatenating form,
``[T]`` token-major in the in-place form; see :mod:`.sequential`). A
``PositionEmbedding`` before the model's first ``FlashAttention(kv_cache=True)``
declares that input itself, so the learned table is read at the right rows on
every decode step.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import ParamsError, ShapeError
from ..tensor import TensorDesc
from .layers import Layer

if TYPE_CHECKING:
    from .sequential import LoweringContext

__all__ = ["PositionEmbedding", "rope_table", "rope_table_inputs", "head_norm"]


def _first_cached_attention(ctx: "LoweringContext") -> Any:
    from .layers_attention import FlashAttention
    from .layers_block import flat_layers

    for layer in flat_layers(ctx.layers[ctx.index + 1:]):
        if isinstance(layer, FlashAttention) and layer.kv_cache:
            return layer
    return None


class PositionEmbedding(Layer):
    """``x + table[position]``: learned absolute positions (GPT-2's ``wpe``), weight
    ``weight [max_positions, hidden]``. Without a cached attention after it the
    positions are ``0 .. S-1`` (a call without a past)."""

    kind = "position_embedding"

    def _weight_names(self) -> set[str]:
        return {"weight"}

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name, b = ctx.name_of(self), ctx.builder
        if "weight" not in self._weights:
            raise ParamsError(name, "weight", "a loaded [max_positions, hidden] table", "none")
        d = b.desc(x)
        table = self._add_weight(ctx, name, "weight", d)
        if tuple(self._weights["weight"].shape[1:]) != tuple(d.shape[-1:]):
            raise ShapeError(name, "weight shape [max_positions, hidden]",
                             ["max_positions", d.shape[-1]], list(self._weights["weight"].shape))
        attn = _first_cached_attention(ctx)
        if attn is None:  # positions 0 .. S-1 of x [B, S, H]
            rows, = b.add_node("Slice", [table], {"offsets": (0, 0), "sizes": (d.shape[-2], -1)},
                               name=f"{name}.rows")
            return b.add_node("Elewise", [x, rows], {"elewise_type": "add"}, name=name)[0]
        # the attention's own position input: both cache forms feed it (module docstring)
        tokens = d.shape[0] if ctx.cache_desc is not None else d.shape[-2]
        pos = b.add_input(f"{ctx.name_of(attn)}.position_ids",
                          TensorDesc((tokens,), Dtype.INT64))
        rows, = b.add_node("Embedding", [table, pos], name=f"{name}.rows")   # [T|S, H]
        if ctx.cache_desc is not None:                                        # x [T, H]
            return b.add_node("ResidualAdd", [x, rows], name=name)[0]
        return b.add_node("Elewise", [x, rows], {"elewise_type": "add"}, name=name)[0]


def rope_table(inv_freq: Sequence[float], rows: int, attention_factor: float = 1.0,
               rotary_type: str = "half") -> tuple[np.ndarray, np.ndarray]:
    """fp32 full-width cos/sin ``[rows, 2 * len(inv_freq)]`` for positions
    ``0 .. rows-1``, built in float64 and scaled by ``attention_factor`` (as Hugging
    Face's rotary embeddings and the runner build them)."""
    inv = np.asarray(inv_freq, dtype=np.float64)
    ang = np.arange(rows, dtype=np.float64)[:, None] * inv[None]           # [P, rd/2]
    full = np.concatenate([ang, ang], -1) if rotary_type == "half" else np.repeat(ang, 2, -1)
    f = float(attention_factor)
    return (np.cos(full) * f).astype(np.float32), (np.sin(full) * f).astype(np.float32)


def rope_table_inputs(ctx: "LoweringContext", rope: Any) -> list[str]:
    """The cos/sin table constants for RoPE layer ``rope`` (``[]`` when it rotates by
    its ``base``). Rows: the cache's ``max_seq_len`` in the in-place form (positions
    never pass it), else ``max_positions`` or 8192; never past ``max_positions``
    when the layer has one (dynamic NTK's frequencies change there: a position past
    the table is refused by the op). One table per graph for equal frequencies."""
    if rope.inv_freq is None:
        return []
    rows = int(ctx.cache_desc.shape[1]) if ctx.cache_desc is not None else \
        int(rope.max_positions or 8192)
    if rope.max_positions is not None:
        rows = min(rows, int(rope.max_positions))
    rt = rope.params["rotary_type"]
    key = np.asarray(rope.inv_freq, dtype=np.float64).tobytes() + \
        repr((float(rope.attention_factor), rows, rt)).encode()
    stem = f"rope_table_{zlib.crc32(key):08x}"
    names = [f"{stem}.cos", f"{stem}.sin"]
    if names[0] not in ctx.builder._taken():
        cos, sin = rope_table(rope.inv_freq, rows, rope.attention_factor, rt)
        ctx.builder.add_weight(names[0], cos)
        ctx.builder.add_weight(names[1], sin)
    return names


def head_norm(ctx: "LoweringContext", layer: Layer, name: str, which: str, x: str,
              head_dim: int, eps: float) -> str:
    """RmsNorm of every head of ``x`` (``[..., heads * head_dim]``) with weight
    ``<which>_norm.weight [head_dim]`` of ``layer``; same shape out."""
    b = ctx.builder
    d = b.desc(x)
    w = layer._add_weight(ctx, name, f"{which}_norm.weight", d)
    # [.., heads, head_dim]: a view even of a strided split of the packed QKV
    lead = (-1,) if d.rank == 2 else (d.shape[0], -1)
    # [.., heads, head_dim]: a view even of a strided split of the packed QKV
    lead = (-1,) if d.rank == 2 else (d.shape[0], -1)
    heads, = b.add_node("Reshape", [x], {"shape": (*lead, d.shape[-1] // head_dim, head_dim)},
                        name=f"{name}.{which}_norm_in")
    normed, = b.add_node("RmsNorm", [heads, w], {"eps": eps}, name=f"{name}.{which}_norm")
    back = (-1, d.shape[-1]) if d.rank == 2 else (d.shape[0], -1, d.shape[-1])
    return b.add_node("Reshape", [normed], {"shape": back}, name=f"{name}.{which}_merge")[0]
