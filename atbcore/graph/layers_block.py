"""``Block``: a list of layers used as one layer, so several blocks lower as one graph.

    model = GraphOp([embed,
                     Block("l0.attn", attention_layers), Block("l0.mlp", mlp_layers),
                     ..., final_norm, lm_head])

Inside a block, ``ResidualAdd()`` adds the *block's* input (what it adds when the
layers are a GraphOp of their own) and ``ResidualAdd(residual="x")`` the block's
layer ``x``; each inner layer's node (and weight) name gets the block's name and a
dot in front (``"l0.attn.linear.weight"``). Fusion then runs over the whole graph:
a block's residual add can go into the GEMM of the next block's first matmul, and a
model made of per-block GraphOps runs as one program (``compile()`` of a GraphOp
model does this, :mod:`atb_torch.models.graph_trace`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ParamsError
from .layers import Layer, ResidualAdd

if TYPE_CHECKING:
    from .sequential import LoweringContext

__all__ = ["Block", "LastToken", "flat_layers"]


class Block(Layer):
    """``layers`` applied in order as one layer named ``name`` (see the module
    docstring). The layers are used as given (weights shared), renamed in copies."""

    kind = "block"

    def __init__(self, name: str, layers: Sequence[Layer]) -> None:
        if not isinstance(name, str) or not name:
            raise ParamsError("Block", "name", "a non-empty string", repr(name))
        super().__init__(name)
        layers = list(layers) if isinstance(layers, (list, tuple)) else None
        if not layers:
            raise ParamsError(name, "layers", "a non-empty list of layers", "none")
        for i, l in enumerate(layers):
            if not isinstance(l, Layer):
                raise ParamsError(name, f"layer {i}", "an atb layer", type(l).__name__)
        self.layers = layers

    def weights(self) -> dict[str, Any]:
        """The inner layers' weights by ``<layer name>.<weight>``."""
        return {f"{l.name}.{k}": v for l in self.layers for k, v in l.weights().items()}

    def _renamed(self, prefix: str) -> list[Layer]:
        named = {l.name for l in self.layers if l.name}
        out = []
        for l in self.layers:
            c = copy.copy(l)
            if l.name:
                c.name = prefix + l.name
            if isinstance(c, ResidualAdd) and c.residual in named:
                c.residual = prefix + c.residual
            out.append(c)
        return out

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        # kept while this lowering may still ask for their names (it keys them by id)
        inner = self._inner = self._renamed(name + ".")
        saved = ctx.input, ctx.layers, ctx.index
        ctx.input, ctx.layers = x, inner
        try:
            for i, layer in enumerate(inner):
                ctx.index = i
                x = layer.lower(ctx, x)
                ctx.record(layer, x)
        finally:
            ctx.input, ctx.layers, ctx.index = saved
        return x


class LastToken(Layer):
    """Each sequence's last token only: ``[B, S, H] -> [B, 1, H]`` (a decoder's final
    norm and LM head then run one row per sequence, as generation needs). In the
    in-place cache form (token-major ``[T, H]``, rows of any lengths) it gathers the
    rows of the feeder's ``cache.last_rows`` into ``[B, H]``, which the GraphOp hands
    back as ``[B, 1, ...]``."""

    kind = "last_token"

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name, b = ctx.name_of(self), ctx.builder
        if ctx.cache_desc is None:
            return b.add_node("Slice", [x], {"offsets": (0, -1, 0), "sizes": (-1, 1, -1)},
                              name=name)[0]
        from ..dtypes import Dtype
        from ..tensor import TensorDesc
        from .graph_op_feed import LAST_ROWS

        if LAST_ROWS not in b._taken():
            b.add_input(LAST_ROWS, TensorDesc((ctx.batch,), Dtype.INT64))
        return b.add_node("Gather", [x, LAST_ROWS], {"axis": 0}, name=name)[0]


def flat_layers(layers: Sequence[Layer]) -> list[Layer]:
    """``layers`` with every Block replaced by its inner layers (recursively)."""
    out: list[Layer] = []
    for l in layers:
        out += flat_layers(l.layers) if isinstance(l, Block) else [l]
    return out
