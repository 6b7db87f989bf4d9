"""atb for MindSpore: ``import atb_mindspore as atb``.

Re-exports the core API (``Builder``, ``Dtype``, ``TensorDesc``, ``AtbError`` ...,
``Plugin``, memory pools and KV caches), and adds, as ``mindspore.nn.Cell``s:

* the seed-style layers with MindSpore Parameters: ``LayerNorm(eps=...)``,
  ``Linear(out_features=...)``, ``FlashAttention(num_heads=..., causal=True)``,
  ``SiLU()``, ``ResidualAdd()``, ``RmsNorm``, ``RoPE``, ``FusedFeedForward`` ...;
* every other core op (``MatMul``, ``Softmax``, ``AddRmsNorm``, ``PagedAttention`` ...)
  as a Cell called on its tensors; all ops that way under ``atb_mindspore.ops``;
* ``GraphOp([...])`` (``register_plugin(point, plugin)``, ``explain()`` ...);
* ``compile(cell)`` of a model built from GraphOps, with ``generate``.

    import mindspore, atb_mindspore as atb
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=mlp_dim), atb.SiLU(),
                       atb.Linear(out_features=hidden_dim), atb.ResidualAdd()])
    y = mlp(x)                                        # PyNative: through the core
    mindspore.set_context(mode=mindspore.GRAPH_MODE)
    y = mlp(x)                                        # GRAPH_MODE: a pyfunc custom op

Importing this package imports MindSpore (when installed; before Paddle, which
must come second in one process), registers the MindSpore backend (MindSpore
tensors run on MindSpore kernels, asked first) and the MindSpore tensor bridge.
MindSpore 2.10 is built against NumPy 1.x; with NumPy 2 its first sequence argument
fails once with a ``SystemError``: the import absorbs that failure.

Where tensors cross, and where they are copied
----------------------------------------------
* PyNative, MindSpore kernels: MindSpore tensors (Parameters included) go to the
  MindSpore backend as they are; nothing crosses.
* MindSpore <-> torch (the torch backend, a torch plugin): DLPack capsules
  (``mindspore.to_dlpack`` / ``from_dlpack``), no copy either way, strides kept.
* MindSpore -> NumPy (the NumPy reference backend, layer weights): ``asnumpy()``
  shares a contiguous CPU tensor's memory; bf16 crosses as an int16 DLPack view
  (read-only, no copy). **Copies:** a non-contiguous tensor (a transpose view) comes
  back contiguous, i.e. copied.
* NumPy -> MindSpore: ``Tensor.from_numpy`` shares memory. **Copies:** a read-only
  or non-contiguous array is copied first.
* **GRAPH_MODE copies:** MindSpore's pyfunc custom ops hand ``func`` NumPy copies of
  the inputs and copy its outputs back into graph buffers; that is the price of
  running the core inside a compiled graph on the CPU. Parameters are read at run
  time without a copy. pyfunc ops take no bf16: bf16 runs in PyNative only.
* **Half types:** every kernel computes fp16/bf16 in fp32 (a cast, i.e. a copy of
  the inputs) and rounds the result once, as every atb backend does.
* Tensors on an Ascend NPU never cross into another framework (DLPack has no
  Ascend device code): they run on the MindSpore backend or raise ``DeviceError``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from atbcore import *  # noqa: F401,F403  (the contract: every front-end re-exports the core)
from atbcore import __all__ as _core_all
from atbcore import __version__  # noqa: F401
from atbcore.graph import layers as _core_layers
from atbcore.ops import list_operations as _list_operations

from .backend import register as _register_backend
from .bridge import install_bridge as _install_bridge

_install_bridge()
_register_backend()

if importlib.util.find_spec("mindspore") is not None:
    from ._env import mindspore as _mindspore

    _mindspore()  # MindSpore before Paddle, and its one-time NumPy C-API hiccup absorbed

_ALIASES = ("SelfAttention", "MhaV2", "MhaV3")
_SEED = frozenset(n for n in _core_layers.__all__ if n not in ("Layer", "host_array"))
_HOOKS = ("HookPlugin", "register_plugin")
_LAZY = frozenset({"GraphOp", "AtbCell", "OpCell", "LayerCell", *_HOOKS, *_ALIASES,
                   *_list_operations(), *_SEED})

# The core exports its own GraphOp and seed layers (plain Python); here those names
# are the MindSpore Cells, resolved lazily below, so the core's must not shadow them.
for _name in _LAZY:
    globals().pop(_name, None)

__all__ = sorted(set(_core_all) - _LAZY) + ["ops", "compile", "LLM"] + sorted(_LAZY)


def __getattr__(name: str) -> Any:
    # Cells import MindSpore: only when first asked for (PEP 562).
    if name == "compile":
        value = importlib.import_module(f"{__name__}.compiled").compile
    elif name == "ops":
        value = importlib.import_module(f"{__name__}.ops")
    elif name == "LLM":
        value = importlib.import_module(f"{__name__}.llm").LLM
    elif name in _HOOKS:
        value = getattr(importlib.import_module(f"{__name__}.hooks"), name)
    elif name in _LAZY:
        cells = importlib.import_module(f"{__name__}.cells")
        if name in ("GraphOp", "AtbCell", "OpCell", "LayerCell"):
            value = getattr(cells, name)
        elif name in _SEED:
            value = cells.SEED_LAYERS[name]
        elif name in _ALIASES:
            value = cells.SEED_LAYERS["FlashAttention"]
        else:
            value = cells.OP_CELLS[name]
    else:
        raise AttributeError(f"module 'atb_mindspore' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
