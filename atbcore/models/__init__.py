"""Framework-neutral model description, shared by every front-end.

* :mod:`.arch` — ``ModelSpec`` / ``RopeSpec`` / ``MoESpec``, the weight dataclasses
  and the architecture registry (``ArchSpec``, ``register_architecture``);
* :mod:`.hf_arch` — the built-in Hugging Face families (``describe(config)``);
* :mod:`.decoder` — ``decoder_layers(spec, weights)``: a decoder's atb layers;
* :mod:`.checkpoint` — a local Hugging Face checkpoint (config, safetensors weights
  as NumPy arrays, tokenizer) without torch.

Importing this package imports no framework.
"""

from .arch import (ArchSpec, LayerWeights, ModelSpec, ModelWeights, MoESpec, RopeSpec,
                   register_architecture, resolve_architecture)

__all__ = ["ArchSpec", "LayerWeights", "ModelSpec", "ModelWeights", "MoESpec", "RopeSpec",
           "register_architecture", "resolve_architecture"]
