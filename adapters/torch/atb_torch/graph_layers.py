"""Moved to the core (:mod:`atbcore.graph.op_layer`), where every front-end and the
model lowering share it."""

from atbcore.graph.op_layer import OpLayer

__all__ = ["OpLayer"]
