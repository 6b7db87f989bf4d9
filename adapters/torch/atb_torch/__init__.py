"""atb for PyTorch: ``import atb_torch as atb``.

Every name of the design's user API, native to PyTorch:

* ops as ``nn.Module`` s (``atb.Linear``, ``atb.RmsNorm``, ``atb.FlashAttention`` ...)
  and as functions (``atb.functional.rms_norm`` ...), both running
  ``torch.ops.atb.*`` custom ops that ``torch.compile(fullgraph=True)`` traces;
* ``atb.GraphOp([...])``: a fused block as an ``nn.Module`` holding its layers'
  parameters (``state_dict``, ``.to()``), with plugins and KV caches;
* the core API re-exported (``Builder``, ``Operation``, ``GraphBuilder``,
  ``TensorDesc``, ``Dtype``, memory pools, ``PagedKVCache``, errors, ``Plugin``);
* ``atb.init``, ``atb.list_operations``, ``atb.__version__``,
  ``atb.check_compatibility``; profiles exported with ``atb.export_chrome_trace``;
* ``atb.compile`` and ``atb.LLM`` (loaded on first use).

Tensors from NumPy, MindSpore and Paddle are accepted through DLPack.
"""

from __future__ import annotations

from typing import Any

from atbcore import *  # noqa: F401,F403  (the contract: every front-end re-exports the core)
from atbcore import __all__ as _core_all
from atbcore import __version__  # noqa: F401
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.ir import Graph

from . import functional, library  # noqa: F401  (library registers torch.ops.atb.*)
from .devices import npu_available
from .graph import GraphOp
from .hooks import HookPlugin, register_plugin
from .modules import (GELU, Activation, AddLayerNorm, AddRmsNorm, GeGLU, Gelu, LayerNorm, Linear,
                      QuickGelu, Relu, ResidualAdd, RmsNorm, RMSNorm, SiLU, Swish, SwiGLU)
from .modules_attention import (FlashAttention, MhaV2, MhaV3, PagedAttention, ReshapeAndCache,
                                RoPE, SelfAttention)
from .modules_ops import (AllReduce, Argmax, Concat, Elewise, Embedding, FusedFeedForward, Gather,
                          LinearParallel, MatMul, MoE, Reshape, ScaledMaskedSoftmax, Softmax,
                          Split, TopkToppSampling, Transpose)
from .module_base import AtbModule
from .profiling import clear_profiles, export_chrome_trace, profile_table
from .runtime import KVCache, check_compatibility, init

_LAZY = {"compile": ("atb_torch.models.compile", "compile"), "LLM": ("atb_torch.llm", "LLM")}

__all__ = sorted(set(_core_all) | {
    "GraphOp", "GraphBuilder", "Graph", "functional", "AtbModule", "HookPlugin",
    "register_plugin", "npu_available", "export_chrome_trace", "profile_table",
    "clear_profiles", "init", "check_compatibility", "KVCache",
    "LayerNorm", "RmsNorm", "RMSNorm", "AddLayerNorm", "AddRmsNorm", "Linear", "MatMul", "RoPE",
    "FlashAttention", "SelfAttention", "MhaV2", "MhaV3", "PagedAttention", "ReshapeAndCache",
    "Softmax", "ScaledMaskedSoftmax", "Gelu", "GELU", "QuickGelu", "SiLU", "Swish", "Relu",
    "SwiGLU", "GeGLU", "Activation", "FusedFeedForward", "ResidualAdd", "Elewise", "Transpose",
    "Reshape", "Split", "Concat", "Gather", "Embedding", "MoE", "TopkToppSampling", "Argmax",
    "AllReduce", "LinearParallel", *_LAZY})


def __getattr__(name: str) -> Any:
    """``atb.compile`` and ``atb.LLM`` load their packages on first use."""
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'atb_torch' has no attribute {name!r}")
