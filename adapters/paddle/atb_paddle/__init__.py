"""atb for PaddlePaddle: ``import atb_paddle as atb``.

Re-exports the core API (``Builder``, ``Dtype``, ``TensorDesc``, ``AtbError`` ...,
``Plugin``, memory pools and KV caches), and adds, as ``paddle.nn.Layer``s:

* the seed-style layers with Paddle parameters: ``LayerNorm(eps=...)``,
  ``Linear(out_features=...)``, ``FlashAttention(num_heads=..., causal=True)``,
  ``SiLU()``, ``ResidualAdd()``, ``RmsNorm``, ``RoPE``, ``FusedFeedForward`` ...;
* every other core op (``MatMul``, ``Softmax``, ``AddRmsNorm``, ``PagedAttention`` ...)
  as a layer called on its tensors; all ops that way under ``atb_paddle.ops``;
* ``GraphOp([...])`` (``register_plugin(point, plugin)``, ``explain()`` ...);
* ``compile(layer)`` of a model built from GraphOps, with ``generate``.

    import paddle, atb_paddle as atb
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=mlp_dim), atb.SiLU(),
                       atb.Linear(out_features=hidden_dim), atb.ResidualAdd()])
    y = mlp(paddle.randn([2, 16, hidden_dim]))

Importing this package registers the Paddle backend (Paddle tensors run on Paddle
kernels, asked first) and the Paddle tensor bridge, without importing Paddle;
the layers import Paddle when first used. (MindSpore, if used in the same process,
must be imported before Paddle.)
"""

from __future__ import annotations

import importlib
from typing import Any

from atbcore import *  # noqa: F401,F403  (the contract: every front-end re-exports the core)
from atbcore import __all__ as _core_all
from atbcore import __version__  # noqa: F401
from atbcore.graph import layers as _core_layers
from atbcore.ops import list_operations as _list_operations

from .backend import register as _register_backend

_register_backend()

_ALIASES = ("SelfAttention", "MhaV2", "MhaV3")
_LAZY = frozenset({"GraphOp", "AtbLayer", "OpLayer", *_ALIASES, *_list_operations(),
                   *(n for n in _core_layers.__all__ if n not in ("Layer", "host_array"))})

# The core exports its own (framework-free) GraphOp and seed layers under the same
# names; here they are the Paddle layers, resolved lazily by __getattr__.
for _name in _LAZY:
    globals().pop(_name, None)

__all__ = [n for n in _core_all if n not in _LAZY] + ["ops", "compile", "LLM"] + sorted(_LAZY)


def __getattr__(name: str) -> Any:
    # Layers import Paddle: only when first asked for (PEP 562).
    if name == "compile":
        value = importlib.import_module(f"{__name__}.compiled").compile
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.layers"), name)
    elif name == "ops":
        value = importlib.import_module(f"{__name__}.ops")
    elif name == "LLM":
        value = importlib.import_module(f"{__name__}.llm").LLM
    else:
        raise AttributeError(f"module 'atb_paddle' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
