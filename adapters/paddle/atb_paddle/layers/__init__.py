"""atb layers as ``paddle.nn.Layer``s (imports Paddle): the seed-style layers with
Paddle parameters, every core op as a layer, and ``GraphOp``. See
:mod:`.catalog` for the names and :mod:`.graph_op` for the block."""

from .base import AtbLayer, OpLayer, OpNode
from .catalog import ALIASES, LAYERS, OPS, SEED_LAYERS, wrap_core
from .graph_op import GraphOp

globals().update(LAYERS)

__all__ = ["AtbLayer", "OpLayer", "OpNode", "GraphOp", "LAYERS", "OPS", "SEED_LAYERS", "ALIASES",
           "wrap_core", *sorted(LAYERS)]
