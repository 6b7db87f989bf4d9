"""atb layers, ops and GraphOps as MindSpore Cells (imports MindSpore)."""

from .base import AtbCell
from .graph_op import GraphOp
from .layers import SEED_LAYERS, LayerCell, OpNode, wrap_core
from .op_cell import OP_CELLS, OpCell, op_cell_class

__all__ = ["AtbCell", "GraphOp", "LayerCell", "OpCell", "OpNode", "OP_CELLS", "SEED_LAYERS",
           "op_cell_class", "wrap_core"]
