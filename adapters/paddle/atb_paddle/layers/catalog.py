"""Every atb layer name as a Paddle layer class.

* Seed-style layers (one per class in :mod:`atbcore.graph.layers`: ``Linear``,
  ``LayerNorm``, ``RmsNorm``, ``ResidualAdd``, ``SiLU``, ``Gelu``, ``Relu``,
  ``QuickGelu``, ``SwiGLU``, ``Activation``, ``FlashAttention``, ``RoPE``,
  ``FusedFeedForward``) are :class:`~.base.AtbLayer` subclasses with weights.
* Every core op is an :class:`~.base.OpLayer` subclass in :data:`OPS` (the
  ``atb_paddle.ops`` namespace): ``ops.FlashAttention(num_heads=4)(q, k, v)``.
* :data:`LAYERS` is the front-end's top level: the seed-style layer where one exists,
  else the op layer, plus the seed's aliases (``SelfAttention``, ``MhaV2``, ``MhaV3``
  for ``FlashAttention``).
"""

from __future__ import annotations

import inspect

from atbcore.graph import layers as core_layers
from atbcore.ops import list_operations
from atbcore.ops.registry import get_op

from .base import AtbLayer, OpLayer

__all__ = ["SEED_LAYERS", "OPS", "LAYERS", "ALIASES", "wrap_core"]

#: seed names the articles use for FlashAttention (DESIGN.md §4)
ALIASES = {"SelfAttention": "FlashAttention", "MhaV2": "FlashAttention", "MhaV3": "FlashAttention"}


def _seed_layers() -> dict[str, type[AtbLayer]]:
    out: dict[str, type[AtbLayer]] = {}
    for name in core_layers.__all__:
        core = getattr(core_layers, name)
        if not (inspect.isclass(core) and issubclass(core, core_layers.Layer)) or core is core_layers.Layer:
            continue
        doc = (f"``{name}`` as a Paddle layer with Paddle parameters (core: "
               f":class:`atbcore.graph.layers.{name}`).\n\n{inspect.getdoc(core) or ''}")
        out[name] = type(name, (AtbLayer,), {"CORE": core, "__doc__": doc,
                                               "__module__": "atb_paddle"})
    return out


def _op_layers() -> dict[str, type[OpLayer]]:
    out: dict[str, type[OpLayer]] = {}
    for name in list_operations():
        opdef = get_op(name)
        doc = (f"The ``{name}`` op as a Paddle layer: ``{name}(**params)(*tensors)``; inputs "
               f"{', '.join(opdef.inputs)} -> {', '.join(opdef.outputs)}.\n\n"
               f"{inspect.getdoc(type(opdef)) or ''}")
        out[name] = type(name, (OpLayer,), {"OP": name, "__doc__": doc,
                                              "__module__": "atb_paddle.ops"})
    return out


SEED_LAYERS = _seed_layers()
OPS = _op_layers()
LAYERS: dict[str, type] = {**OPS, **SEED_LAYERS}
LAYERS.update({alias: LAYERS[target] for alias, target in ALIASES.items()})


def wrap_core(core: core_layers.Layer) -> AtbLayer:
    """The Paddle layer around a core seed-style layer object."""
    cls = SEED_LAYERS.get(type(core).__name__)
    if cls is None or not isinstance(core, cls.CORE):
        cls = type(type(core).__name__, (AtbLayer,), {"CORE": type(core)})
    return cls.wrap(core)
