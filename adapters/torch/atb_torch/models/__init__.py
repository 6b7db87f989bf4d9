"""Whole models: ``compile`` and the core engine behind it.

* :func:`compile` (:mod:`.compile`) — Hugging Face / sentence-transformers / GraphOp
  models in, a compiled model with the same ``forward`` and ``generate`` out.
* :class:`~.core_runner.CoreRunner` (:mod:`.core_runner`) — a decoder lowered to one
  core GraphOp: prefill / decode / forward over a :class:`~.row_cache.RowKVCache`, for
  serving code and benchmarks (``compiled.atb_runner``); encoders:
  :class:`~.lower_encoder.CoreEncoder`.
* :mod:`.arch` — the architecture registry (``ArchSpec``, ``register_architecture``).

Importing this package imports torch but not transformers.
"""

from .arch import ArchSpec, ModelSpec, ModelWeights, LayerWeights, register_architecture, \
    resolve_architecture
from .compile import OPT_LEVELS, compile
from .core_runner import CoreRunner
from .row_cache import RowKVCache

__all__ = ["compile", "OPT_LEVELS", "CoreRunner", "RowKVCache", "ArchSpec",
           "ModelSpec", "ModelWeights", "LayerWeights", "register_architecture",
           "resolve_architecture"]
