"""atbcore: the framework-agnostic core of atb (ops, backends, graphs, memory).

Importing it imports no deep-learning framework.
"""

from ._version import __version__
from .dtypes import Dtype
from .errors import (AtbError, CapabilityError, DeviceError, DtypeError, GraphError, InputError,
                     MemoryError_, ParamsError, PluginError, PoolExhaustedError, ShapeError)
from .numerics import assert_close, compare
from .operation import Builder, Operation, destroy_operations
from .ops import get_op, list_operations
from .runtime import check_compatibility, get_config, init
from .graph.builder import GraphBuilder
from .graph.graph_op import GraphOp
from .graph.layers import (Activation, FlashAttention, FusedFeedForward, Gelu, LayerNorm, Linear,
                           QuickGelu, Relu, ResidualAdd, RmsNorm, RoPE, SiLU, SwiGLU)
from .memory import (KVCache, MemoryPoolConfig, PagedKVCache, get_memory_pool, init_memory_pool,
                     memory_stats)
from .plugin import Plugin, get_plugin_manager, hookimpl
from .passes.pipeline import FusionConfig
from .tensor import TensorDesc

#: The seed articles' ``atb.Tensor(shape=..., dtype=...)``: a descriptor (atb holds no
#: tensor type of its own; data stays in the caller's framework).
Tensor = TensorDesc

__all__ = [
    "__version__", "Dtype", "TensorDesc", "Tensor", "Builder", "Operation", "destroy_operations",
    "list_operations", "get_op", "init", "get_config", "check_compatibility", "compare",
    "assert_close", "AtbError", "ShapeError", "DtypeError", "DeviceError", "ParamsError",
    "InputError", "CapabilityError", "GraphError", "PoolExhaustedError", "MemoryError_",
    "PluginError", "MemoryPoolConfig", "init_memory_pool", "get_memory_pool", "memory_stats",
    "KVCache", "PagedKVCache", "Plugin", "hookimpl", "get_plugin_manager", "GraphOp",
    "GraphBuilder", "FusionConfig", "Linear", "LayerNorm", "RmsNorm", "ResidualAdd", "SiLU",
    "Gelu", "Relu", "QuickGelu", "SwiGLU", "Activation", "FlashAttention", "RoPE",
    "FusedFeedForward",
]
