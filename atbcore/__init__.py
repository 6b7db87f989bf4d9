"""atbcore: the framework-agnostic core of atb (ops, backends, graphs, memory).

Importing it imports no deep-learning framework, and nothing else either: every public
name loads its module on first use (PEP 562), so ``atb --help`` and ``atb --version``
do not pay for NumPy and ml_dtypes.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from .dtypes import Dtype
    from .errors import (AtbError, CapabilityError, DeviceError, DtypeError, GraphError,
                         InputError, MemoryError_, ParamsError, PluginError,
                         PoolExhaustedError, ShapeError)
    from .numerics import assert_close, compare
    from .operation import Builder, Operation, destroy_operations
    from .ops import get_op, list_operations
    from .runtime import check_compatibility, get_config, init
    from .graph.builder import GraphBuilder
    from .graph.graph_op import GraphOp
    from .graph.layers import (Activation, FlashAttention, FusedFeedForward, Gelu, LayerNorm,
                               Linear, QuickGelu, Relu, ResidualAdd, RmsNorm, RoPE, SiLU, SwiGLU)
    from .memory import (KVCache, MemoryPoolConfig, PagedKVCache, get_memory_pool,
                         init_memory_pool, memory_stats)
    from .plugin import Plugin, get_plugin_manager, hookimpl
    from .passes.pipeline import FusionConfig
    from .tensor import TensorDesc

    Tensor = TensorDesc

# public name -> the submodule that defines it
_LAZY: dict[str, str] = {
    "Dtype": "dtypes",
    **dict.fromkeys(("AtbError", "CapabilityError", "DeviceError", "DtypeError", "GraphError",
                     "InputError", "MemoryError_", "ParamsError", "PluginError",
                     "PoolExhaustedError", "ShapeError"), "errors"),
    **dict.fromkeys(("assert_close", "compare"), "numerics"),
    **dict.fromkeys(("Builder", "Operation", "destroy_operations"), "operation"),
    **dict.fromkeys(("get_op", "list_operations"), "ops"),
    **dict.fromkeys(("check_compatibility", "get_config", "init"), "runtime"),
    "GraphBuilder": "graph.builder",
    "GraphOp": "graph.graph_op",
    **dict.fromkeys(("Activation", "FlashAttention", "FusedFeedForward", "Gelu", "LayerNorm",
                     "Linear", "QuickGelu", "Relu", "ResidualAdd", "RmsNorm", "RoPE", "SiLU",
                     "SwiGLU"), "graph.layers"),
    **dict.fromkeys(("KVCache", "MemoryPoolConfig", "PagedKVCache", "get_memory_pool",
                     "init_memory_pool", "memory_stats"), "memory"),
    **dict.fromkeys(("Plugin", "get_plugin_manager", "hookimpl"), "plugin"),
    "FusionConfig": "passes.pipeline",
    "TensorDesc": "tensor",
    #: The seed articles' ``atb.Tensor(shape=..., dtype=...)``: a descriptor (atb holds
    #: no tensor type of its own; data stays in the caller's framework).
    "Tensor": "tensor",
}

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


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use and keep the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), "TensorDesc" if name == "Tensor"
                    else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
