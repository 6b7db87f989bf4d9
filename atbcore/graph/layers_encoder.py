"""Encoder layers (BERT style) for a token-major ``GraphOp([...])``: the running
tensor is the packed real tokens of a batch, ``[T, ...]``, one sequence after the
other, so no padding token is ever computed.

* :class:`EncoderEmbeddings` — ``LayerNorm(word[ids] + table[pos_type])``: the block
  input is the token ids ``[T]``; position and token-type embeddings are summed once
  into one table indexed by ``token_type * P + position`` (graph input
  :data:`POS_TYPE`, ``[T]`` int64: one gather instead of two and an add);
* :class:`UnpadAttention` — bidirectional (or causal) attention of packed QKV rows
  ``[T, (H + 2*Hkv) * D]`` within each sequence (``UnpadFlashAttention``; graph input
  :data:`SEQ_LENS`, ``[B]`` int32, each sequence's token count);
* :class:`Pooler` — ``tanh(dense(first token))`` of each sequence (graph input
  :data:`FIRST_ROWS`, ``[B]`` int64, the row of each sequence's first token) as an
  extra graph output ``[B, H]``; the running tensor passes through unchanged.

The extra graph inputs come after the block input in this order (each declared by
the first layer that reads it); :func:`atbcore.models.encoder.encoder_inputs` makes
them from a padded batch and its mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..dtypes import Dtype
from ..errors import ParamsError
from ..tensor import TensorDesc
from .layers import Layer, _positive, host_array

if TYPE_CHECKING:
    from .sequential import LoweringContext

__all__ = ["EncoderEmbeddings", "UnpadAttention", "Pooler", "POS_TYPE", "SEQ_LENS", "FIRST_ROWS"]

POS_TYPE = "encoder.pos_type"
SEQ_LENS = "encoder.seq_lens"
FIRST_ROWS = "encoder.first_rows"


class EncoderEmbeddings(Layer):
    """``LayerNorm(word[ids] + pos_type[idx])`` over token ids ``[T]`` -> ``[T, H]``
    (weights ``word [V, H]``, ``pos_type [types * P, H]``, ``norm.weight``,
    ``norm.bias [H]``; floats in the model's dtype, which the output takes). With
    ``inputs_embeds`` the block input is the word vectors ``[T, H]`` themselves."""

    kind = "embeddings"

    def __init__(self, name: str | None = None, *, eps: float = 1e-12,
                 inputs_embeds: bool = False) -> None:
        super().__init__(name)
        if not eps > 0:
            raise ParamsError("EncoderEmbeddings", "eps", "> 0", repr(eps))
        self.eps, self.inputs_embeds = float(eps), bool(inputs_embeds)

    def _weight_names(self) -> set[str]:
        return {"word", "pos_type", "norm.weight", "norm.bias"}

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name, b = ctx.name_of(self), ctx.builder
        need = self._weight_names() - ({"word"} if self.inputs_embeds else set())
        if need - set(self._weights):
            raise ParamsError(name, "weights", f"{sorted(need)} loaded",
                              f"missing {sorted(need - set(self._weights))}")
        d = b.desc(x)
        pt = ctx.add_input(POS_TYPE, TensorDesc(d.shape[:1], Dtype.INT64))
        w = {k: b.add_weight(f"{name}.{k}_table" if "." not in k else f"{name}.{k}", v)
             for k, v in self._weights.items() if k in need}
        word = x  # inputs_embeds: the word vectors [T, H] are the block input
        if not self.inputs_embeds:
            word, = b.add_node("Embedding", [w["word"], x], name=f"{name}.word")
        extra, = b.add_node("Embedding", [w["pos_type"], pt], name=f"{name}.pos_type")
        s, = b.add_node("ResidualAdd", [word, extra], name=f"{name}.sum")
        return b.add_node("LayerNorm", [s, w["norm.weight"], w["norm.bias"]], {"eps": self.eps},
                          name=name)[0]


class UnpadAttention(Layer):
    """Attention of packed QKV rows within each sequence (see the module docstring);
    ``[T, (H + 2*Hkv) * D] -> [T, H * D]``."""

    kind = "attention"

    def __init__(self, name: str | None = None, *, num_heads: int, num_kv_heads: int | None = None,
                 scale: float | None = None, causal: bool = False) -> None:
        super().__init__(name)
        _positive("UnpadAttention", "num_heads", num_heads)
        _positive("UnpadAttention", "num_kv_heads", num_kv_heads, optional=True)
        self.params: dict[str, Any] = {"num_heads": int(num_heads),
                                       "num_kv_heads": int(num_kv_heads or num_heads),
                                       "causal": bool(causal)}
        if scale is not None:
            self.params["scale"] = float(scale)

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        lens = ctx.add_input(SEQ_LENS, TensorDesc((1,), Dtype.INT32))
        return ctx.builder.add_node("UnpadFlashAttention", [x, lens], self.params,
                                    name=ctx.name_of(self))[0]


class Pooler(Layer):
    """``tanh(first @ W.T + b)`` of each sequence's first token, as an extra graph
    output ``[B, H]`` (weights ``weight [H, H]``, ``bias [H]``); passes ``x`` on."""

    kind = "pooler"

    def _weight_names(self) -> set[str]:
        return {"weight", "bias"}

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name, b = ctx.name_of(self), ctx.builder
        d = b.desc(x)
        rows = ctx.add_input(FIRST_ROWS, TensorDesc((1,), Dtype.INT64))
        first, = b.add_node("Gather", [x, rows], {"axis": 0}, name=f"{name}.first")
        ins = [first] + [self._add_weight(ctx, name, k, d) for k in ("weight", "bias")]
        dense, = b.add_node("Linear", ins, {"bias": True}, name=f"{name}.dense")
        pooled, = b.add_node("Elewise", [dense], {"elewise_type": "tanh"}, name=name)
        ctx.extra_outputs.append(pooled)
        return x


def summed_position_types(position: Any, token_type: Any) -> Any:
    """The ``[types * P, H]`` table ``token_type[t] + position[p]`` at row
    ``t * P + p``, summed in fp32 and returned in the tables' dtype (NumPy)."""
    p, t = host_array(position), host_array(token_type)
    out = t.astype("float32")[:, None, :] + p.astype("float32")[None]   # [types, P, H]
    return out.reshape(-1, p.shape[1]).astype(p.dtype)
