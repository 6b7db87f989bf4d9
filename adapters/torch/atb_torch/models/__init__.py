"""Whole models: ``compile`` and the model runner behind it.

* :func:`compile` (:mod:`.compile`) — Hugging Face / sentence-transformers / GraphOp
  models in, a compiled model with the same ``forward`` and ``generate`` out.
* :class:`ModelRunner` (:mod:`.runner`) — decoders' prefill / decode / paged entry
  points, for serving code (``atb_torch.LLM``) and benchmarks.
* :mod:`.arch` — the architecture registry (``ArchSpec``, ``register_architecture``).
* :class:`ContiguousKVCache` (:mod:`.cache`), :class:`DecodePlan` (:mod:`.plan`).

Importing this package imports torch but not transformers.
"""

from .arch import ArchSpec, ModelSpec, ModelWeights, LayerWeights, register_architecture, \
    resolve_architecture
from .cache import ContiguousKVCache
from .compile import OPT_LEVELS, compile
from .plan import DecodePlan
from .runner import ModelRunner

__all__ = ["compile", "OPT_LEVELS", "ModelRunner", "ContiguousKVCache", "DecodePlan", "ArchSpec",
           "ModelSpec", "ModelWeights", "LayerWeights", "register_architecture",
           "resolve_architecture"]
