"""The op library. Each module registers its ops; see :mod:`atbcore.ops.base`."""

from .base import OpDef, Params
from .registry import all_ops, get_op, list_operations, register_op

__all__ = ["OpDef", "Params", "register_op", "get_op", "list_operations", "all_ops"]
